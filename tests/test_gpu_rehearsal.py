"""The GPU command rehearsed on a CPU: gpu_check.sh's Python steps that turn records into its
report (the throughput table with MFU, the talk's comparison, the memory tables and charts, the
processes each memory run plans), run on records of every precision and strategy the scripts
can produce, as an A100, an H100, an H200 and a GPU no table knows would have written them.
Only torch.cuda's answers (the GPU's name, count and memory) are stood in for: every lookup keyed
by a precision, a strategy or a device name meets each value a script can produce."""
import json
import re

import pytest
import torch

import benchmark
from benchmarks import memory, peaks, runs, throughput
from conftest import ROOT, SAID, SCRIPTS
from gpu_machine.machine import MODELS, stand_in
from run_keeping.reading import lessons
from run_keeping.reading import read_records

GPUS = {"NVIDIA A100-SXM4-80GB": 80e9, "NVIDIA H100 80GB HBM3": 80e9, "NVIDIA H200": 141e9,
        "NVIDIA Quadro Z9000 (in no table)": 48e9}


def precisions_the_scripts_produce():
    """Each precision a numbered script asks Fabric for (00-02 and plain Fabric: 32-true), and
    what a device without bfloat16 runs instead, 32-true (run_keeping/device.py)."""
    asked = {m for path in ROOT.glob("[0-9][0-9]_*.py") for m in re.findall(r'precision="([\w-]+)"', path.read_text())}
    return asked | {"32-true"}


def strategies_the_scripts_produce():
    return {row["strategy"] for row in lessons().values() if row["strategy"]}


@pytest.fixture
def gpu(monkeypatch):
    """A machine with `count` GPUs called `name` of GPUS's memory, as its nvidia-smi lists them and torch.cuda
    answers (tests/gpu_machine/machine.py); nothing else replaced."""
    def machine(name, count=2):
        memory = f"memory {int(GPUS[name]) // 2**20}, compute_cap {MODELS.get(name, (0, '9.0'))[1]}"
        stand_in(monkeypatch, f"{count} x {name}, driver 580.82.07, {memory}", build="13.0")
    return machine


def as_on(record, name, **changes):
    return {**record, "device_name": name, "accelerator": "cuda", **changes}


@pytest.fixture
def every_kind_of_record(smoke_runs):
    """Real records of every precision and strategy the scripts produce on this CPU, and, made
    from them, the precision each asks for as a GPU with bfloat16 runs it (a CPU without it ran
    32-true) and the fallback an older GPU runs (32-true)."""
    real = [smoke_runs(s).record for s in [*SCRIPTS, "09_fabric-vit-fast.py"] if not s.startswith("00")]
    asked = [dict(r, precision=r["precision_asked"]) for r in real]
    older = [dict(r, precision="32-true") for r in asked if r["precision"].startswith("bf16")]
    records = real + asked + older
    assert {r["precision"] for r in records} >= precisions_the_scripts_produce()
    assert {lessons()[r["script"]]["strategy"] for r in records} >= strategies_the_scripts_produce()
    return records


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GPUS))
def test_the_throughput_report_is_written_whole_on_each_gpu(every_kind_of_record, gpu, name):
    """benchmark.py's report, from records as the GPU would write them: a row for every one,
    MFU where the GPU's peak for that precision is known (every precision on the tables' GPUs),
    the talk's comparison, the input pipeline, the verdict. Before, bf16-true raised KeyError."""
    gpu(name)
    args = benchmark.parse_args(["--accelerator", "cuda"])
    measured = {}
    for i, record in enumerate(every_kind_of_record):
        rounds = [as_on(record, name, images_per_s=record["images_per_s"] * f) for f in (1.0, 1.02, 0.98)]
        bares = [{"images_per_s": r["images_per_s"] * 1.1, "peak_memory_gb": 1.0} for r in rounds]
        measured[(f"{record['script']}", record["batch_size"] + i * 1000)] = {"records": rounds, "bares": bares}
    rates = {"workers": {0: 2000.0, 4: 6000.0}, "device": "cuda", "resize": 50000.0}
    text = throughput.report(args, measured, 105.1e9, rates)
    rows = [line for line in text.splitlines() if re.match(r"^\| \d\d_", line) and line.count(" | ") == 10]
    assert len(rows) == len(every_kind_of_record)
    mfu = [line.split(" | ")[9] for line in rows]
    known = "Quadro" not in name
    assert all(m.endswith("%") for m in mfu) if known else all(m == "-" for m in mfu), mfu
    assert "Beside the talk's published figures" in text and "09's pipeline" in text
    assert "What this run shows, on " + name in text and "cannot say: anything about a GPU" not in text


def memory_records():
    """The memory runs' records in the reference folder (the talk's column and the sequel's chain
    on ViT-B/16 and ViT-L/16), each script as it ran at 224x224."""
    return read_records(ROOT / "reference" / "memory-runs.jsonl")


@pytest.mark.parametrize("name", list(GPUS))
def test_the_memory_tables_are_written_whole_on_each_gpu(gpu, name, tmp_path):
    """benchmark.py --memory --talk and --sequel, from their records as the GPU would write them:
    every row beside its arithmetic (15's offloaded state not in the GPU's), the talk's and the
    sequel's figures, the staircase, the chart."""
    gpu(name)
    records = [as_on(r, name) for r in memory_records()]
    from run_keeping.reading import lessons as load_reference
    reference = load_reference()
    rows = [memory.row_of(r, memory.libraries_gb(cuda=True), reference) for r in records]
    text = memory.memory_tables(rows, 0.0, [], cuda=True)
    assert text.count("\n| 0") + text.count("\n| 1") >= 2 * len(records)
    assert "torch.cuda.max_memory_reserved" in text and "The chain as a staircase" in text
    offloaded = next(r for r in rows if r["record"]["script"].startswith("15"))
    assert offloaded["terms"]["weights"] == offloaded["terms"]["optimizer"] == 0  # in CPU memory there
    memory.staircase_chart(rows, tmp_path / "memory.png", name)
    assert (tmp_path / "memory.png").stat().st_size > 10_000


@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_each_memory_run_plans_the_talks_processes(gpu, count):
    """On a GPU machine: the talk table's lessons of several processes (lessons.csv's devices) on the
    talk's 4 GPUs where there are 4 (fewer where fewer, saying so), one that needs 2 (min_devices)
    skipped on one, the others on one."""
    gpu("NVIDIA H200", count)
    plans = {n: memory.talk_processes(n, "vit_b_16", True, 0.0) for n in memory.chain("talk")}
    rows = {script[:2]: row for script, row in lessons().items()}
    for number, (processes, note) in plans.items():
        if rows[number]["devices"] == 1:
            assert (processes, note) == (1, None)
        elif rows[number]["min_devices"] > count:
            assert processes is None and f"needs {rows[number]['min_devices']} processes" in note
        else:
            assert processes == min(4, count) and (note is None) == (count >= 4), (number, note)


def test_on_a_cpu_with_room_the_talks_four_processes_run(monkeypatch):
    """--memory --talk on a CPU with room for them: its lessons of several processes (lessons.csv's
    devices) each on the talk's 4, the others on one (a regression to one process would hold a whole
    copy less DDP's work)."""
    monkeypatch.setattr(memory, "available_memory", lambda cuda: 200e9)
    plans = {n: memory.talk_processes(n, "vit_b_16", False, 0.8)[0] for n in memory.chain("talk")}
    rows = {script[:2]: row for script, row in lessons().items()}
    assert plans == {n: 4 if rows[n]["devices"] > 1 else 1 for n in memory.chain("talk")} and 4 in plans.values()
    monkeypatch.setattr(memory, "available_memory", lambda cuda: 8e9)
    processes, note = memory.talk_processes("05", "vit_b_16", False, 0.8)
    assert processes < 4 and f"{processes} processes, not 4" in note


@pytest.mark.parametrize("name", list(GPUS))
def test_every_peak_lookup_answers(name, gpu):
    """peak_tflops for every precision the scripts produce: a figure on the GPUs the tables know,
    None (no MFU) on one they do not, never a KeyError."""
    gpu(name)
    for precision in precisions_the_scripts_produce() | set(peaks.UNIT):
        peak = peaks.peak_tflops(name, precision)
        if "Quadro" in name or precision == "64-true":
            assert peak is None, (name, precision)
        else:
            assert peak > 0, (name, precision)


@pytest.mark.slow
def test_every_bare_loop_a_record_asks_for_is_made(every_kind_of_record, capsys, monkeypatch):
    """benchmark.py's bare loop of each configuration the scripts' records describe: its
    strategy and parallelize function (15's offload), optimizer (14's SGD, 09's AdamW),
    micro-batches and checkpointing are each made from lessons.csv's words; the one-process ones
    run here, 4 steps each (the others would start processes: their strategy is made)."""
    import argparse
    monkeypatch.setenv("LT_PRECISION", "32-true")  # each bare loop's, in its own process: taken away after the test
    specs = {throughput.bare_key(r): throughput.bare_spec(r) for r in every_kind_of_record}
    assert {s["optimizer"] for s in specs.values()} >= {"Adam", "AdamW", "SGD"}
    assert {s["micro_batches"] for s in specs.values()} >= {1, 4} and any(s["checkpointing"] for s in specs.values())
    for spec in specs.values():
        runs.make_strategy(spec["strategy"], spec["processes"], spec["tensor_parallel"])
        throughput.make_optimizer(spec["optimizer"], torch.nn.Linear(2, 2).parameters())
        if spec["processes"] == 1:
            args = argparse.Namespace(bare_loop=json.dumps(spec), max_steps=4, smoke=True, accelerator="cpu")
            throughput.bare_loop(args)
            line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("BARE "))
            answer = json.loads(line[5:])
            assert answer["images_per_s"] > 0 and answer["compile_mode"] == spec["compile_mode"], spec


COMPILED = {script: said["compile_mode"] for script, said in SAID.items() if said["compile_mode"]}  # as its script says


@pytest.mark.parametrize("script", COMPILED)
def test_a_bare_loop_compiles_in_its_lessons_mode(script, monkeypatch, capsys):
    """A compiled lesson's record (its compile_mode is its script's torch.compile mode, as the record
    builds it): its bare loop calls torch.compile in that mode, 16's "reduce-overhead" (CUDA
    graphs on a GPU) included. torch.compile is watched, not run: what it is asked is the test."""
    import argparse
    asked = []

    def watched(model, **options):
        asked.append(options.get("mode"))
        return model
    monkeypatch.setattr(torch, "compile", watched)
    monkeypatch.setenv("LT_PRECISION", "32-true")  # the bare loop's, in its own process: taken away after the test
    record = {"script": script, "precision": "32-true", "world_size": 1, "data_parallel": 1, "settings": {},
              "batch_size": 4, "micro_batches": 1, "compile_mode": COMPILED[script]}
    spec = throughput.bare_spec(record)
    throughput.bare_loop(argparse.Namespace(bare_loop=json.dumps(spec), max_steps=4, smoke=True, accelerator="cpu"))
    assert asked == [COMPILED[script]], asked
    capsys.readouterr()
