"""bfloat16 where the device computes it, float32 where it would only be emulated: the detection,
right on both kinds of CPU and rehearsed on either (oneDNN's ONEDNN_MAX_CPU_ISA=AVX2 leaves it the
kernels of a CPU without AVX512-BF16 or AMX; ATen's ATEN_CPU_CAPABILITY=avx2 changes ATen's
vector code alone), and what a script and the tools do where it says no."""
import argparse
import json
import re
import subprocess
import sys

import pytest

from benchmarks import memory, throughput
from conftest import ROOT, SAID, YARDSTICK, native_bf16, parse_as, run_script, script_env
from run_keeping.reading import lessons
from run_keeping.reading import upgrade

# bfloat16 matrix products emulated run about 100 times slower than float32 (a 512x512 product:
# 1.2 against 132.8 GFLOP/s on an AVX2-only AMD EPYC; 1.4 against 52 on an AVX512-BF16 one with
# oneDNN capped at AVX2), and natively at float32's rate or faster (2.5 times it on the AVX512-BF16
# EPYC). A quarter of float32's rate is 25 times above the one and 4 times below the other: no
# machine's day-to-day drift (25-30%) moves a CPU across it.
EMULATED_BELOW = 0.25


def probe(tmp_path, **env):
    """tools/bf16_probe.py's answer (the suite's detection, and both rates) in that environment."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bf16_probe.py")], capture_output=True,
                          text=True, timeout=120, env=script_env(tmp_path, **env))
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    return {**seen, "ratio": seen["bf16_gflops"] / seen["fp32_gflops"]}


@pytest.mark.slow
def test_the_detection_agrees_with_the_speed_and_the_rehearsals(tmp_path):
    """Whatever this CPU is: native bfloat16 is said exactly where bfloat16 runs at least a quarter
    of float32's rate. oneDNN capped at AVX2 is a CPU without it, on any machine; ATen's AVX2 code
    is not (ATen's capability changes, oneDNN's kernels and the answer do not), nor oneDNN's DEFAULT."""
    here, capped, aten = probe(tmp_path), probe(tmp_path, ONEDNN_MAX_CPU_ISA="AVX2"), \
        probe(tmp_path, ATEN_CPU_CAPABILITY="avx2")
    uncapped = probe(tmp_path, ONEDNN_MAX_CPU_ISA="DEFAULT")  # oneDNN's documented default: its own choice, no cap
    older = probe(tmp_path, DNNL_MAX_CPU_ISA="AVX2", ONEDNN_MAX_CPU_ISA="")  # the older name, read where the newer
    # is empty or unset (as where the suite runs capped)
    for seen in (here, capped, aten, uncapped, older):
        assert seen["native"] == (seen["ratio"] >= EMULATED_BELOW), seen
    assert not capped["native"] and not older["native"]
    assert aten["capability"] == "AVX2" and aten["native"] == here["native"]


@pytest.mark.slow
def test_on_a_cpu_without_bfloat16_04_runs_float32_says_why_and_keeps_03s_time(smoke_runs, tmp_path):
    """The README's first command on a CPU whose bfloat16 is emulated (rehearsed: oneDNN capped at
    AVX2): one line naming the CPU and what runs instead, no warning beside it, the record saying
    both, and a run that takes at most twice 03's (the same maths, float32, on the same CPU)."""
    bin_dir = tmp_path / "bin"  # an srun on PATH, as a cluster's nodes have: Lightning warns of it
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    env = script_env(tmp_path, ONEDNN_MAX_CPU_ISA="AVX2", PATH=f"{bin_dir}:{script_env(tmp_path)['PATH']}")
    proc = run_script("04_fabric-vit-mixed-precision.py", "--smoke", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the one line says it all: no warning beside it (a warning's line begins with where it was raised)
    assert not re.search(r"\.py:\d+: ", proc.stdout + proc.stderr), proc.stdout + proc.stderr
    said = [line for line in proc.stdout.splitlines() if "no native bfloat16" in line]
    assert len(said) == 1 and said[0].startswith("This CPU ") and "oneDNN capped at AVX2" in said[0]
    assert "running 32-true instead of bf16-mixed" in said[0]
    record = json.loads((tmp_path / "results" / "runs.jsonl").read_text().splitlines()[-1])
    assert record["precision"] == "32-true" and record["precision_asked"] == "bf16-mixed"
    # start to record, in CPU seconds: the suite runs beside it, and wall time would measure that;
    # 04 alone takes 0.96 times 03's, so even the drift between two runs (EMULATION_GUARD) keeps it
    # under twice
    assert record["cpu_s"] <= 2 * smoke_runs(YARDSTICK).record["cpu_s"]


# Within the suite, one run's CPU seconds against another's measure the machine as much as the
# script: the two runs happen minutes apart, each beside whatever test the other worker runs, and
# on a 2-core VM the same --smoke run has taken 1.9 times the CPU seconds in one suite run that it
# took in another half an hour earlier (14: 15.0 and 28.7 s; 03: 9.6 and 10.8). The scripts' own ratios
# to 03 without bfloat16, measured alone (reference/no-bf16-smoke-runs-avx2.jsonl, docs/smoke.md),
# are 0.68-1.73 for the one-process lessons and 05: the 2x of 03 those runs show. Emulated bfloat16
# is at least 5 times 03 (04: 103 s against 19). So the suite's guard is what separates the two
# whatever the drift: under 4 times 03's (1.73 x 1.9 = 3.3 below it, 5 above it). In the suite the
# lessons' smoke runs are forked from a process that has loaded the libraries (conftest.YARDSTICK,
# warm_start.py), so their CPU seconds lack the 8-10 s a fresh 03's count: their ratios only fall,
# and emulated bfloat16 stays above the guard (04: (103 - 10) / 19 = 4.9).
EMULATION_GUARD = 4.0

# FSDP2 on 2 CPU processes takes over 2x 03's time whatever the precision: with native bfloat16
# here 06's smoke run took 3.1x 03's (its two processes start one after the other, and FSDP2
# gathers each block over gloo twice a step); their bound is the float32 run itself. The lessons
# that ask for a bf16 precision, as their scripts say; those that neither shard nor compile (a compile's
# CPU seconds are its own) are held to the guard.
BF16_LESSONS = [s for s in lessons() if (SAID[s]["precision"] or "").startswith("bf16")]
WITHIN_TWICE_03 = [s for s in BF16_LESSONS if lessons()[s]["strategy"] != "fsdp2" and not SAID[s]["compile_mode"]]


@pytest.mark.slow
@pytest.mark.parametrize("script", BF16_LESSONS)
def test_where_the_cpu_lacks_bfloat16_every_bf16_lesson_runs_float32(smoke_runs, script):
    """On a CPU without native bfloat16, every script that asks for a bf16 precision ran float32,
    never emulated bfloat16, its record saying what was asked; the one-process lessons and 05
    well under emulation's time, in CPU seconds (EMULATION_GUARD: their 2x of 03 is measured
    alone, in reference/; 12-14's training loop alone takes longer at this size, with 4
    micro-batches a step, whatever the precision; the smoke runs are the suite's own, so on such a
    CPU this costs nothing more)."""
    if native_bf16():
        pytest.skip("this CPU has native bfloat16, so its bf16 runs are its own; the 04 test above rehearses "
                    "a CPU without (ONEDNN_MAX_CPU_ISA=AVX2)")
    record = smoke_runs(script).record
    assert record["precision"] == "32-true" and record["precision_asked"].startswith("bf16")
    if script in WITHIN_TWICE_03:  # start to record, in CPU seconds: whatever else runs beside it
        assert record["cpu_s"] <= EMULATION_GUARD * smoke_runs(YARDSTICK).record["cpu_s"]


@pytest.mark.parametrize("script", ["04_fabric-vit-mixed-precision.py", "11_fabric-vit-bf16-true.py"])
def test_the_fallback_sets_up_and_runs_the_model_in_float32(monkeypatch, script, capsys):
    """On a CPU without native bfloat16 (rehearsed: oneDNN capped at AVX2), parse_args decides 32-true and changes
    nothing; inside the run's `with RunKeeper(args)` block LT_PRECISION says it, and the lesson's own
    Fabric(precision=...) line then sets the model up in float32 (11's bf16-true would otherwise cast it to
    bfloat16) and runs it without autocast; the run's line says so; after the block LT_PRECISION is gone. A Fabric
    made before the block runs what it asks for, and the run's line says nothing of a fallback: it says what runs."""
    import os

    import lightning as L
    import torch
    import local_utilities as lu
    from run_keeping.keeper import RunKeeper
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("LT_PRECISION", raising=False)
    settings = parse_as(script, "--smoke")
    asked = settings.precision_asked
    assert settings.precision == "32-true" and asked.startswith("bf16") and "LT_PRECISION" not in os.environ
    with RunKeeper(settings) as keeper:  # as the lesson's Fabric(...) line finds it
        assert os.environ["LT_PRECISION"] == "32-true"
        fabric = L.Fabric(accelerator="cpu", devices=1, precision=asked)
        keeper.start(fabric)
        with fabric.init_module():
            model = lu.smoke_vit()
        model = fabric.setup_module(model)
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert model(torch.rand(2, 3, 32, 32)).dtype == torch.float32
        with fabric.autocast():
            assert torch.get_autocast_dtype("cpu") != torch.bfloat16 or not torch.is_autocast_enabled("cpu")
    assert f"running 32-true instead of {asked}" in capsys.readouterr().out
    assert "LT_PRECISION" not in os.environ  # the run's end takes the fallback away again
    before = L.Fabric(accelerator="cpu", devices=1, precision=asked)  # a lesson's Fabric made before its RunKeeper
    with RunKeeper(settings) as keeper:
        keeper.start(before)
    assert before.strategy.precision.precision == asked and "instead of" not in capsys.readouterr().out


def test_the_memory_tables_measure_no_bf16_script_on_a_cpu_without_it(monkeypatch):
    """--memory --talk on a CPU without native bfloat16: the talk table's lessons that ask for a bf16
    precision (their scripts say so) not measured, in one line that says why and where they can be measured,
    the others measured; --sequel (all of it bf16): nothing, said so."""
    from run_keeping.reading import lessons
    monkeypatch.setattr(memory, "native_bf16", lambda device: False)
    monkeypatch.setattr(memory, "available_memory", lambda cuda: 200e9)
    asks = {script[:2]: SAID[script]["precision"] or "" for script in lessons()}
    bf16 = lambda numbers: [n for n in numbers if asks[n].startswith("bf16")]  # noqa: E731
    talk = argparse.Namespace(memory_scripts=None, sequel=False, memory_models_given=False, memory_models=[], smoke=False)
    plan, notes = memory.memory_plan(talk, cuda=False, libraries=0.8)
    chain = memory.chain("talk")
    assert [number for _, number, _ in plan] == [n for n in chain if n not in bf16(chain)] and bf16(chain)
    assert len(notes) == 1 and notes[0].startswith(f"{', '.join(bf16(chain))} not measured: this CPU ")
    assert "has no native bfloat16" in notes[0] and "AVX512-BF16 or AMX, or on a GPU" in notes[0]
    sequel = argparse.Namespace(**{**vars(talk), "sequel": True})
    plan, notes = memory.memory_plan(sequel, cuda=False, libraries=0.8)
    assert plan == [] and notes[0].startswith(f"{', '.join(memory.chain('sequel'))} not measured")
    plan, _ = memory.memory_plan(talk, cuda=True, libraries=0.0)  # a GPU answers for itself
    assert "04" in [number for _, number, _ in plan]


def test_a_benchmark_row_says_what_ran_and_what_was_asked():
    """benchmark.py --smoke's 04 row on a CPU without bfloat16: its precision as it ran, the one
    asked beside it, and the verdict saying which scripts were not measured as they ask."""
    records = [upgrade({"script": "04_fabric-vit-mixed-precision.py", "batch_size": 16, "precision": "32-true",
                        "world_size": 1,
                        "images_per_s": 100.0, "peak_memory_gb": 1.0, "device_name": "CPU AMD EPYC (2 cores)"})]
    measured = {("04_fabric-vit-mixed-precision.py", 16): {"records": records, "bares": []}}
    args = argparse.Namespace(peak_tflops={}, smoke=True, repeat=1, max_steps=200)
    rows = throughput.rows_of(measured, 1e9, args)
    assert rows[0]["precision"] == "32-true (asked bf16-mixed)"
    assert any(line.startswith("- Not measured in the precision they ask for: 04")
               for line in throughput.verdict(rows, args, "CPU AMD EPYC (2 cores)"))


@pytest.mark.parametrize("call, said", [
    ('L.Fabric(accelerator="cpu", precision="bf16-true")', "bf16-true"),
    ('L.Fabric(accelerator="cpu")', "32-true"),  # Fabric's own default
    ('L.Fabric(accelerator="cpu", **dict(precision="bf16-mixed"))', None),
    ('L.Fabric(accelerator="cpu", precision=PRECISION)', None),
    ('L.Fabric(accelerator="cpu", precision=16)', None),  # Fabric takes the number too: not a text, not read
    ('L.Fabric(accelerator="cpu", precision="bf16")', "bf16"),  # Lightning's short name for bf16-mixed
    ('L.Fabric(precision="32-true") if 0 else L.Fabric(precision="bf16-mixed")', None),  # two that differ
    ('L.Fabric(precision="bf16-true") if 0 else L.Fabric(precision="bf16-true")', "bf16-true"),  # two, alike
])
def test_only_a_literal_precision_is_read_from_the_script(tmp_path, call, said):
    """The precision a script asks for is read from its Fabric(...) only where it is a keyword written as text; given
    through **, by a name or as a number, it is not known (None): no fallback is set over it, and what the script
    asks for runs (a contributor's copy that moves the precision into a dict keeps it). Fabric takes its arguments
    by keyword only."""
    from run_keeping.config import read_script

    script = tmp_path / "17_your-lesson.py"
    script.write_text(f"import lightning as L\n\nfabric = {call}\n")
    assert read_script(script)["precision"] == said


def test_only_a_precision_that_computes_in_bfloat16_falls_back_and_only_a_fallback_is_said(monkeypatch):
    """On a CPU without native bfloat16 (oneDNN capped at AVX2): each bf16 precision, by its short name too, and
    16-mixed, which Lightning runs as bf16-mixed on a CPU, run 32-true, and the line says it in the words the script
    used; one that does not compute in bfloat16 runs as asked. Where nothing fell back, nothing is said of a
    fallback, whatever Fabric made of the name (16-mixed run as bf16-mixed on a CPU with the units)."""
    from run_keeping.device import fallback_line, precision_that_runs
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    for asked in ("bf16-mixed", "bf16-true", "bf16", "16-mixed"):
        assert precision_that_runs(asked, "cpu") == "32-true", asked
        fell_back = argparse.Namespace(precision_asked=asked, precision="32-true", accelerator="cpu")
        said = fallback_line(fell_back, "32-true")
        assert f"(no AVX512-BF16 or AMX, or oneDNN capped below them): running 32-true instead of {asked}, " in said
    for asked in ("32-true", "64-true", None):
        assert precision_that_runs(asked, "cpu") == asked
    assert precision_that_runs("16-mixed", "cuda") == "16-mixed"  # a GPU's float16: no bfloat16 in it
    as_asked = argparse.Namespace(precision_asked="16-mixed", precision="16-mixed", accelerator="cpu")
    assert fallback_line(as_asked, "bf16-mixed") is None


def test_onednns_default_is_no_cap(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=DEFAULT, oneDNN's documented default (its own choice), is as if unset: bfloat16 as native,
    and the CPU's name saying no cap; AVX2 is a cap, said in the name, and bfloat16 not native; so is the older
    DNNL_MAX_CPU_ISA's, where ONEDNN_MAX_CPU_ISA is not set."""
    from run_keeping.device import device_name, native_bf16 as native

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    unset = (native("cpu"), device_name("cpu"))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "DEFAULT")
    assert (native("cpu"), device_name("cpu")) == unset
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not native("cpu") and "oneDNN capped at AVX2 by ONEDNN_MAX_CPU_ISA" in device_name("cpu")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")  # the older name counts only where the newer is unset, as in oneDNN
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    assert (native("cpu"), device_name("cpu")) == unset
    for unset in (monkeypatch.delenv, lambda name: monkeypatch.setenv(name, "")):  # as oneDNN reads it: empty, unset
        unset("ONEDNN_MAX_CPU_ISA")
        assert not native("cpu") and "oneDNN capped at AVX2 by DNNL_MAX_CPU_ISA" in device_name("cpu")
