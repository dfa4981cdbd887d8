"""benchmark.py and gpu_check.sh: MFU from the right peaks, the table from the records, the bare
loop beside each configuration, and the one GPU command at smoke size."""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import benchmark
from benchmarks import memory, peaks, runs, throughput
from conftest import ROOT, read_records, script_env, warm_starts
from warm_start import PYTHON
from run_keeping.reading import lessons
from run_keeping.reading import read_runs, upgrade


def test_vit_b_16_training_flops_match_the_known_figure():
    # torchvision's 17.56 GFLOPS are multiply-adds: 35.1 GFLOP forward, x3 with backward
    assert 104e9 < peaks.flops_per_image(smoke=False) < 106e9


@pytest.mark.parametrize("name, precision, expected", [
    ("NVIDIA H200", "bf16-mixed", 989.5),        # Lightning: missing, or 2x (sparsity)
    ("NVIDIA H200", "32-true", 67.0),
    ("NVIDIA H200 NVL", "bf16-mixed", 835.5),
    ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.5),  # the SXM card's name
    ("NVIDIA H100 PCIe", "32-true", 51.0),
    ("NVIDIA H100 NVL", "16-mixed", 835.5),
    ("NVIDIA A100-SXM4-80GB", "bf16-mixed", 312.0),
    ("NVIDIA A100 80GB PCIe", "32-true", 19.5),
])
def test_dense_peaks_by_the_name_cuda_reports(name, precision, expected):
    assert peaks.peak_tflops(name, precision) == expected


def test_peak_tflops_per_precision_overrides_the_table():
    args = benchmark.parse_args(["--peak-tflops", "32-true=60", "bf16-mixed=800"])
    assert peaks.peak_tflops("NVIDIA H200", "bf16-mixed", args.peak_tflops) == 800
    assert peaks.peak_tflops("NVIDIA H200", "32-true", args.peak_tflops) == 60
    assert peaks.peak_tflops("CPU Xeon", "32-true", {}) is None  # no GPU here: no MFU


def round_records(script, precision, rates, processes=1, batch=16, device="NVIDIA H200") -> list[dict[str, Any]]:
    """A configuration's records over the rounds: what its script appended in each."""
    return [upgrade({"script": script, "batch_size": batch, "precision": precision, "world_size": processes,
                     "strategy": "single-device" if processes == 1 else "ddp", "images_per_s": rate,
                     "peak_memory_gb": 3.0, "device_name": device}) for rate in rates]


def test_mfu_and_ratios_in_the_rows():
    """Each ratio is formed round by round (01 and the script in the same round, the script and
    its bare loop in the same round), reported as the median and its range; MFU from the
    median; a configuration whose bare loops disagree is marked busy, a ratio whose spread is
    wider than its difference from 1 within noise."""
    args = benchmark.parse_args([])
    measured = {
        ("01_pytorch-vit.py", 16): {"records": round_records("01_pytorch-vit.py", "32-true", [100, 110, 90]), "bares": []},
        ("03_fabric-vit.py", 16): {  # bare loops 10% apart: what an idle 2-core CPU shows, not busy
            "records": round_records("03_fabric-vit.py", "32-true", [99, 112, 89]),
            "bares": [{"images_per_s": b, "peak_memory_gb": 2.9} for b in (1628, 1475, 1550)]},
        ("04_fabric-vit-mixed-precision.py", 16): {
            "records": round_records("04_fabric-vit-mixed-precision.py", "bf16-mixed", [300, 330, 270]),
            "bares": [{"images_per_s": b, "peak_memory_gb": 2.9} for b in (400, 440, 300)]},
        ("05_fabric-vit-mixed-ddp.py", 16): {
            "records": round_records("05_fabric-vit-mixed-ddp.py", "bf16-mixed", [500, 520, 480], processes=2), "bares": []}}
    rows = {(r["script"], r.get("of")): r for r in throughput.rows_of(measured, 105e9, args)}
    four = rows[("04_fabric-vit-mixed-precision.py", None)]
    assert four["vs_01"] == (3.0, 3.0, 3.0)  # 300/100, 330/110, 270/90: the same in every round
    assert four["vs_bare"] == (0.75, 0.75, 0.9)
    assert four["images_per_s"] == (300, 270, 330)
    assert four["mfu"] == pytest.approx(300 * 105e9 / 989.5e12)
    assert four["busy"] and "busy: bare loops of its settings differ by 47%" in "\n".join(throughput.rows_table(list(rows.values())))
    three = rows[("03_fabric-vit.py", None)]
    assert not three["busy"] and three["spread_bare"] == pytest.approx(1628 / 1475 - 1)
    assert three["noise"] and not four["noise"]  # 0.99-1.02 around 0.99: cannot be told from 1
    assert rows[("05_fabric-vit-mixed-ddp.py", None)]["vs_01"] == (None, None, None)  # 2 processes: no 01 on 2
    bare = rows[("bare loop", "04_fabric-vit-mixed-precision.py")]
    assert bare["images_per_s"] == (400, 300, 440) and bare["mfu"] == pytest.approx(400 * 105e9 / 989.5e12)
    chosen, order = throughput.ranking(list(rows.values()))
    assert order == "04 > 01 = 03"


def test_one_round_is_marked_busy_by_its_waits_or_by_alike_bare_loops_that_disagree():
    """In a single round: a run whose threads waited for a core over BUSY_WAIT of their time, or
    two configurations whose bare loops are of the same settings and disagree by over BUSY (the
    768.8 against 93.5 images/s of one shared run), mark their rows busy; idle ones do not."""
    args = benchmark.parse_args(["--repeat", "1"])

    def one(script, rate, bare, waited=0.001):
        records = round_records(script, "bf16-mixed", [rate])
        records[0]["busy"] = waited > throughput.BUSY_WAIT  # as the keeper decides it
        return {"records": records, "bares": [{"images_per_s": bare, "peak_memory_gb": 1.0, "cpu_wait_share": 0.002}]}

    idle = {("04_fabric-vit-mixed-precision.py", 16): one("04_fabric-vit-mixed-precision.py", 300, 768.8)}
    assert not throughput.rows_of(idle, 1e9, args)[0]["busy"]
    shared = {**idle, ("03_fabric-vit.py", 16): one("03_fabric-vit.py", 40, 93.5)}
    rows = throughput.rows_of(shared, 1e9, args)  # 03 in these records' precision: the same bare loop as 04's
    assert all(r["busy"] for r in rows if r["script"] != "bare loop")
    assert "busy: bare loops of its settings differ by 722%" in "\n".join(throughput.rows_table(rows))
    waited = {("04_fabric-vit-mixed-precision.py", 16): one("04_fabric-vit-mixed-precision.py", 40, 93.5, waited=0.5)}
    rows = throughput.rows_of(waited, 1e9, args)
    assert rows[0]["busy"] and "busy: a run of it waited for a CPU core over 25% of its time" in throughput.busy_note(rows[0])
    assert any("BUSY MACHINE" in line for line in throughput.verdict(rows, args, "CPU"))


@pytest.mark.parametrize("rates, told_apart", [
    ([104, 104, 104], True),   # 4% faster in every round: more than TIE
    ([102, 102, 102], False),  # 2% in every round: within TIE, tied
    ([110, 110, 99], False),   # 10% in the median, but the slower in one round: tied
])
def test_the_ranking_tells_apart_only_what_every_round_agrees_on(rates, told_apart):
    """Two configurations are ordered (>) only where one was faster in every round and by more
    than TIE in the median; otherwise they are tied (=)."""
    assert throughput.TIE == 0.03  # the cases above straddle it
    measured = {
        ("01_pytorch-vit.py", 16): {"records": round_records("01_pytorch-vit.py", "32-true", [100, 100, 100]), "bares": []},
        ("02_pytorch-vit-compile.py", 16): {"records": round_records("02_pytorch-vit-compile.py", "32-true", rates), "bares": []}}
    _, order = throughput.ranking(throughput.rows_of(measured, 1e9, benchmark.parse_args([])))
    assert order == ("02 > 01" if told_apart else "02 = 01")


def test_the_verdict_says_what_the_machine_showed_and_what_it_cannot(tmp_path):
    args = benchmark.parse_args(["--smoke"])
    cpu = "CPU Intel(R) Xeon(R) Processor (2 cores)"
    measured = {
        ("01_pytorch-vit.py", 16): {"records": round_records("01_pytorch-vit.py", "32-true", [100, 100, 100], device=cpu),
                                    "bares": [{"images_per_s": b, "peak_memory_gb": 1.0} for b in (120, 60, 121)]},
        ("04_fabric-vit-mixed-precision.py", 16): {"records": round_records("04_fabric-vit-mixed-precision.py", "bf16-mixed", [70, 71, 69], device=cpu), "bares": []}}
    lines = throughput.verdict(throughput.rows_of(measured, 1e9, args), args, "CPU Intel(R) Xeon(R) Processor (2 cores)")
    text = "\n".join(lines)
    assert "From fastest to slowest (one process, batch 16; >: faster in every round" in text and ": 01 > 04." in text
    assert "BUSY MACHINE (busy: bare loops of its settings differ by 102% (01))" in text
    assert f"--repeat {2 * args.repeat} --max-steps {2 * args.max_steps}" in text
    assert "What it cannot say: anything about a GPU" in text and "mostly its libraries" in text


def without_the_interpreter_on_path(tmp_path):
    """An environment whose PATH lacks the folder of the interpreter running the tests (as with a
    virtual environment that is not activated): only sys.executable reaches the packages."""
    folder = os.path.dirname(sys.executable)
    path = [p for p in os.environ["PATH"].split(os.pathsep) if p and os.path.realpath(p) !=
            os.path.realpath(folder) and "pyenv" not in p and not os.path.exists(os.path.join(p, "python"))]
    return script_env(tmp_path, PATH=os.pathsep.join(path))


@pytest.mark.slow
def test_peaks_command_prints_the_table(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--peaks"], cwd=tmp_path,
                          env=without_the_interpreter_on_path(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^H200\s+67\.0\s+494\.5\s+989\.5$", proc.stdout, re.M)


@pytest.mark.slow
def test_benchmark_rejects_unknown_scripts(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--scripts", "99"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown script 99" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_loader_rate_is_measured():
    rates = throughput.loader_rates(48, [0])
    assert rates[0] > 0


def checkout_files():
    """Every file of the checkout but git's own and Python's bytecode, with its size and time."""
    return {(str(p.relative_to(ROOT)), p.stat().st_size, p.stat().st_mtime_ns) for p in ROOT.rglob("*")
            if p.is_file() and not {".git", "__pycache__"} & set(p.relative_to(ROOT).parts)}


def table_rows(report):
    """The throughput table's rows, split into their columns."""
    return [line.strip("| ").split(" | ") for line in report.splitlines()
            if re.match(r"^\| (\d\d_|bare loop)", line)]


@pytest.mark.slow
def test_gpu_check_at_smoke_size(tmp_path):
    """`bash gpu_check.sh --smoke`: its steps end to end on this CPU (the modules first, the GPU
    count, 16 beside its bare loop compiled as 16 is, 09 at batch 128 beside its own, the report,
    the input pipeline at 4, 8 and 16 workers), with the table's figures taken from the records; run by the interpreter PYTHON
    names, which is not on PATH;
    every output in results/gpu-check/ under the folder it ran in, nothing else left (no model
    files, no checkpoints), and the checkout as it was. (A kill at any moment leaves a whole
    report: the test below reads it at every moment of a check.)"""
    # an unactivated virtual environment's python, say: the suite's `python` (tests/warm_python), off the PATH
    env = dict(without_the_interpreter_on_path(tmp_path), PYTHON=PYTHON)
    checkout = checkout_files()
    # at smoke size, and for the suite's time 16 and 09 alone, one round (01 and 04 run in the test
    # below; every precision and strategy goes through the report in test_gpu_rehearsal.py)
    flags = ["--smoke", "--max-steps", "8", "--repeat", "1", "--scripts", "16", "09@128"]
    proc = subprocess.run(["bash", str(ROOT / "gpu_check.sh"), *flags],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert checkout_files() == checkout  # nothing in the checkout written, added or removed
    out = tmp_path / "results" / "gpu-check"  # its outputs' folder: under the folder it ran in
    assert "preflight: every module the scripts import is there." in proc.stderr
    report = (out / "gpu-check.md").read_text()
    assert report.startswith("## GPU check, ") and "no NVIDIA GPU used: a CPU run; GPUs the scripts see: 0" in report
    records = read_records(out / "gpu-check.jsonl")
    assert [(r["script"][:2], r["batch_size"], r["compile_mode"]) for r in records] == [
        ("16", 16, "reduce-overhead"), ("09", 128, None)]  # 09 compiles on a GPU
    assert all("synthetic" in r["kind"] and r["test_acc"] is None for r in records)
    rows = table_rows(report)
    scripts = [r for r in rows if r[0] != "bare loop"]
    bare = [r for r in rows if r[0] == "bare loop"]
    assert len(scripts) == len(records) and len(bare) == len(records)  # each its own layout
    for row, record in zip(scripts, records):
        ran = row[2].split(" (asked ")[0]  # a CPU without native bfloat16 says what was asked too
        assert (row[0], int(row[1]), ran, int(row[4])) == (record["script"], record["batch_size"],
                                                           record["precision"], record["world_size"])
        assert float(row[5]) == pytest.approx(record["images_per_s"], abs=0.06)
        assert row[7] != "-"  # every script has its bare loop to compare with
    assert "What this run shows, on CPU" in report and "What it cannot say: anything about a GPU" in report
    # its own outputs, nothing else: no model file, no checkpoint, under it or where it ran
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.jsonl", "gpu-check.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) in (["results"], ["results", "torch-home"])
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpu-check"]
    # the command benchmark.py prints for charting its records runs as printed
    hint = re.search(r"chart them with: (python \S*plot_results\.py [^)]*)\)", proc.stdout + proc.stderr)
    assert hint and "--smoke --synthetic" in hint[1], (proc.stdout + proc.stderr)[-2000:]
    charted = subprocess.run(["bash", "-c", hint[1]], cwd=tmp_path, env=script_env(tmp_path),  # python on its PATH
                             capture_output=True, text=True, timeout=120)
    assert charted.returncode == 0, charted.stderr[-2000:]
    assert "Chart written to results/charts.png" in charted.stdout
    assert all(f"- {w} workers:" in report for w in (4, 8, 16)) and "09's pipeline" in report


def report_is_whole(report):
    """A gpu-check.md as a reader gets it: its heading, every table row with all its cells, and
    the list of what did not run (yet)."""
    assert report.startswith("## GPU check, ") and "GPUs the scripts see:" in report
    assert all(line.count(" | ") == 10 for line in report.splitlines() if re.match(r"^\| (\d\d_|bare loop)", line))
    assert "### Not run" in report


def broken_copy(tmp_path, number="04"):
    """A copy of the suite whose script `number` fails as it starts (RuntimeError: broken on purpose)."""
    copy = tmp_path / "suite"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", "reference", "docs", "tests"))
    script = copy / runs.SCRIPTS[number]
    broken = "    raise RuntimeError('broken on purpose')\n    with RunKeeper(args) as keeper:"
    script.write_text(script.read_text().replace("    with RunKeeper(args) as keeper:", broken, 1))
    assert "broken on purpose" in script.read_text()
    return copy


@pytest.mark.slow
def test_gpu_check_within_its_minutes_leaves_a_partial_report_and_a_failure_its_row(tmp_path):
    """--minutes 1 at smoke size, in a copy of the suite whose 04 is broken: it ends within about a
    minute (the minute less what it keeps back for the report, then the report's writing and the
    interpreter's exit, which take seconds even on a loaded 2-core CPU), exit 6; the headline's
    01 measured, 04's row saying why it failed in one line, and the stages that did not fit said
    not run, each with why. Read every 0.1 s while the check runs, the report is whole at every
    moment, as a kill (SIGKILL, every process) at that moment would leave it: after the first
    run, with that run's row and what has not run yet."""
    copy = broken_copy(tmp_path)
    report_file = tmp_path / "results" / "gpu-check" / "gpu-check.md"
    began = time.monotonic()
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        # runs of 8 steps: the headline's 01 and 04 fit in the minute however slow this machine is
        # today (at the default 200, a loaded 2-core VM once spent it on 01 and the preflight alone)
        run = subprocess.Popen(["bash", str(copy / "gpu_check.sh"), "--smoke", "--minutes", "1", "--max-steps", "8"],
                               cwd=tmp_path,
                               env=script_env(tmp_path), stdout=out, stderr=err, start_new_session=True)
        seen = []
        try:
            while run.poll() is None and time.monotonic() - began < 300:
                if report_file.exists():
                    seen.append(report_file.read_text())
                time.sleep(0.1)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    wall = time.monotonic() - began
    stderr = (tmp_path / "err.txt").read_text()
    assert run.returncode == 6, stderr[-3000:]
    assert wall < 60 + 15, wall
    for report in dict.fromkeys(seen):
        report_is_whole(report)
    after_the_first = next(r for r in seen if "01_pytorch-vit.py | 16 | 32-true" in r)
    assert "### Not run yet" in after_the_first
    report = report_file.read_text()
    report_is_whole(report)
    rows = {(row[0], row[1]): row for row in table_rows(report)}
    # images/s: one round's figure, or the median of two and their range, "579.7 (473.4-686.1)",
    # when 01's 8 steps are quick enough for the headline's second round to fit in the minute
    assert float(rows["01_pytorch-vit.py", "16"][5].split(" (")[0]) > 0, report
    assert rows["04_fabric-vit-mixed-precision.py", "16"][10] == "FAILED: exit 1: RuntimeError: broken on purpose"
    assert "### 2. The fast recipe" in report  # measured, or not run saying why: the minute is short
    assert re.search(r"^- headline: .*; round 1 stopped before 16, planned at \d+ s with \d+ s left$", report, re.M), report


@pytest.mark.slow
def test_gpu_check_finds_python3_where_there_is_no_python(tmp_path):
    """A machine with python3 and no python on PATH: gpu_check.sh runs it (its preflight answers
    exit 4, not the shell's 127 for a missing command). That machine lacks IPython, which
    watermark needs, as the H200 machine did: before anything runs, one line naming the module,
    what needs it and the wheel to install, exit 4, not the "no GPU" of exit 2; nothing written."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # python3 runs the interpreter of the tests, its virtual environment too (a link to it outside
    # the environment's folder would be a bare interpreter without its packages)
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    (bin_dir / "python3").chmod(0o755)
    for tool in ("bash", "dirname", "sh"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_IPYTHON)
    env = {k: v for k, v in script_env(tmp_path, PATH=str(bin_dir), PYTHONPATH=str(site)).items() if k != "PYTHON"}
    proc = subprocess.run([str(bin_dir / "bash"), str(ROOT / "gpu_check.sh"), "--smoke", "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preflight: error: missing: watermark (it needs IPython)"), lines
    assert "pip install ipython" in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_talks_speedups_and_memory_beside_ours():
    """gpu_check's comparison: the talk's figures come from lessons.csv."""
    from run_keeping.reading import lessons as load_reference
    rows = [{"script": runs.SCRIPTS[n], "batch": 16, "devices": 1, "vs_01": (v, v, v), "memory_gb": m}
            for n, v, m in (("01", 1.0, 3.5), ("02", 1.1, 3.6), ("03", 0.99, 3.5), ("04", 3.0, 2.9))]
    lines = throughput.talk_comparison(rows, load_reference())[2:]
    talk = [(line.split(" | ")[2], line.split(" | ")[4].rstrip(" |")) for line in lines]
    assert talk == [("1.00x", "3.71"), ("1.04x", "3.73"), ("1.01x", "3.71"), ("2.94x", "3.04")]
    assert lines[3].split(" | ")[1] == "3.00x" and lines[3].split(" | ")[3] == "2.90"


def test_memory_arithmetic_per_strategy():
    """What each strategy should hold per process, by arithmetic: DDP adds its buckets to a whole
    copy, FSDP2 halves everything, TP halves each MLP (two thirds of a ViT-L/16) and so lies
    between them."""
    parameters, _ = memory.expected_held("ViT-L/16", "one process")
    assert 300e6 < parameters < 310e6
    held = {s: memory.expected_held("ViT-L/16", s)[1] for s in memory.MEMORY_STRATEGIES}
    state = {s: memory.state_bytes(s, parameters, held[s]) for s in held}
    assert state["DDP (05)"] == 20 * parameters and state["one process"] == 16 * parameters
    assert state["FSDP2 (06)"] == 8 * parameters
    assert state["FSDP2 (06)"] < state["TP (10)"] < state["DDP (05)"]
    assert 0.6 < held["TP (10)"] / parameters < 0.7


def test_the_bare_loop_steps_with_the_scripts_optimizer_and_kernel():
    """The bare loop makes the lesson's optimizer (lessons.csv) as the script makes it: torch's own
    choice of kernel, as the lessons leave it, and 09's fused AdamW where 09 compiles (its GPU path):
    not fused Adam against the scripts' foreach, which would time the kernel as the harness's cost."""
    plain = throughput.make_optimizer("Adam", torch.nn.Linear(2, 2).parameters())
    assert (plain.defaults["fused"], plain.defaults["foreach"]) == (None, None)
    assert throughput.make_optimizer("AdamW", torch.nn.Linear(2, 2).parameters(), fused=True).defaults["fused"]
    fast = upgrade({"script": "09_fabric-vit-fast.py", "precision": "bf16-mixed", "world_size": 1, "batch_size": 128,
                    "compile_mode": "default"})
    assert (throughput.bare_spec(fast)["optimizer"], throughput.bare_spec(fast)["compile_mode"]) == ("AdamW", "default")
    sgd = throughput.bare_spec(upgrade({"script": "14_fabric-vit-sgd-cosine.py", "precision": "bf16-true",
                                        "world_size": 1, "batch_size": 16, "micro_batches": 4}))
    assert (sgd["optimizer"], sgd["checkpointing"], sgd["micro_batches"]) == ("SGD", True, 4)


def test_tensor_parallel_script_is_known_with_its_layout():
    args = benchmark.parse_args(["--scripts", "10"])
    assert args.runs == [("10_fabric-vit-tensor-parallel.py", 16)]
    # a record before version 4 held 10's --tensor-parallel as tensor_parallel_size: read as 10's own flag
    record = upgrade({"script": "10_fabric-vit-tensor-parallel.py", "precision": "bf16-mixed", "world_size": 2,
                      "tensor_parallel_size": 2, "batch_size": 16})
    assert record["settings"] == {"--tensor-parallel": 2} and "tensor_parallel_size" not in record
    assert (record["data_parallel"], record["precision_asked"]) == (1, "bf16-mixed")  # from the script itself
    assert throughput.bare_spec(record) == {
        "precision": "bf16-mixed", "strategy": "tensor-parallel+fsdp2", "processes": 2, "tensor_parallel": 2,
        "batch": 16, "micro_batches": 1, "checkpointing": False, "optimizer": "Adam", "compile_mode": None}
    # a compiled script's bare loop is compiled as it was, its mode too (records before compile_mode: default)
    assert throughput.bare_spec(dict(record, compile_mode="reduce-overhead"))["compile_mode"] == "reduce-overhead"
    old = {k: v for k, v in record.items() if k not in ("compile_mode", "record_version")}
    assert throughput.bare_spec(upgrade(dict(old, compiled=True)))["compile_mode"] == "default"


FREED_BUT_RESIDENT = """
import torch
from pathlib import Path
def rss_mb():
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]) / 1e3
base = rss_mb()
big = torch.ones(4 * 2**20); del big   # a 16 MB buffer freed: glibc raises its mmap threshold
freed, kept = [], []
for _ in range(100):                    # 100 buffers of 4 MB, each followed by a small one kept
    freed.append(torch.ones(2**20)); kept.append(torch.ones(100))
del freed
print(round(rss_mb() - base))
"""


@pytest.mark.slow
def test_memory_runs_count_what_a_process_holds_not_what_malloc_keeps(tmp_path):
    """400 MB freed between small tensors that stay: glibc's default keeps it resident, which
    --memory would count as held; with runs.EXACT_MALLOC it is handed back: in a fresh interpreter, and in a script
    the tests' `python` runs (a warm copy, given them by mallopt: tests/warm_start.py)."""
    (tmp_path / "freed.py").write_text(FREED_BUT_RESIDENT)
    assert warm_starts().ready()  # the server the script's `python` asks for a copy

    def resident_after_free(how, **env):
        proc = subprocess.run(["python", *how], capture_output=True, text=True, timeout=120,
                              env=script_env(tmp_path, **env))
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.split()[-1])
    if resident_after_free(["-c", FREED_BUT_RESIDENT]) < 200:
        pytest.skip("this C library hands freed memory back by itself")
    assert resident_after_free(["-c", FREED_BUT_RESIDENT], **runs.EXACT_MALLOC) < 50
    assert resident_after_free([str(tmp_path / "freed.py")]) >= 200  # a copy keeps it as a fresh one does
    assert resident_after_free([str(tmp_path / "freed.py")], **runs.EXACT_MALLOC) < 50


def test_gpu_check_plans_its_stages_from_the_lessons_and_names_the_gpu(tmp_path, monkeypatch, capsys):
    """gpu_check.sh's plan on a GPU machine, stood in whole (its nvidia-smi and torch.cuda's answers;
    no GPU here): the stages in their order of value, each with the lessons lessons.csv gives it
    (a lesson added with a gpu_check stage is in it, and its title names it); the report names the
    GPU as nvidia-smi does; --plan --smoke names the smoke ViT its memory stage would run."""
    from benchmarks import gpu_check
    from gpu_machine.machine import stand_in
    stand_in(monkeypatch, "1 x NVIDIA H200, driver 570.86.15", build="12.8")
    args = gpu_check.parse_args(["--out", str(tmp_path)])
    stages = gpu_check.plan(args)
    staged = {name: [s for s, row in lessons().items() if row["gpu_check"] == name] for name, *_ in gpu_check.STAGES}
    batches = {name: settings.get("batch") for name, _, _, settings in gpu_check.STAGES}
    assert [(name, runs) for name, _, _, _, runs in stages] == [
        (name, [(s, batches[name]) for s in staged[name]]) for name, *_ in gpu_check.STAGES]
    assert all(n[:2] in title for name, _, title, _, runs in stages for n, _ in runs)  # each title names its lessons
    assert staged["headline"] and staged["sequel"]  # lessons.csv names the stages' lessons
    asked = gpu_check.plan(gpu_check.parse_args(["--scripts", "01", "09@128"]))  # in place of the throughput stages
    assert [(name, runs) for name, _, _, _, runs in asked] == [
        ("lessons", [("01_pytorch-vit.py", 16), ("09_fabric-vit-fast.py", 128)]),
        *((name, runs) for name, kind, _, _, runs in stages if kind != "throughput")]
    check = gpu_check.Check(args)
    assert "GPU (name, driver, memory): NVIDIA H200, 570.86.15, 143771 MiB; GPUs the scripts see: 1" \
        in gpu_check.report_text(check)
    gpu_check.print_plan(gpu_check.parse_args(["--plan", "--smoke"]), 1)  # its memory stage on the smoke ViT
    assert "11 on the smoke ViT, 1 process(es)" in capsys.readouterr().out


BLOCK_IPYTHON = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "IPython":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
"""


def test_the_preflight_names_every_missing_package_at_once(tmp_path, monkeypatch):
    """An installed package whose own requirements are missing (as IPython's were on the H200
    machine, after IPython itself): the line names all of them, not only the one the import
    stopped at, and the commands that fetch them with what they need, then install them on a
    machine without internet. Its extras' requirements, and what is installed, are not named."""
    sys.path.insert(0, str(ROOT / "tools"))
    import preflight
    (tmp_path / "outer_pkg.py").write_text("import inner_missing_a\n")
    info = tmp_path / "outer_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: outer-pkg\nVersion: 1.0\n"
                                   "Requires-Dist: inner-missing-a\nRequires-Dist: inner_missing_b>=2\n"
                                   "Requires-Dist: numpy\nRequires-Dist: extra-only; extra == 'test'\n")
    (tmp_path / "second_pkg.py").write_text("import inner_missing_c\n")  # a second module, missing its own
    monkeypatch.syspath_prepend(str(tmp_path))
    assert preflight.missing(["outer_pkg", "numpy", "second_pkg"]) == {"outer_pkg": "inner_missing_a",
                                                                     "second_pkg": "inner_missing_c"}
    absent = preflight.missing(["outer_pkg"])
    assert absent == {"outer_pkg": "inner_missing_a"}
    line = preflight.verdict(absent)
    assert "the packages to install: inner-missing-a inner-missing-b." in line, line
    assert "extra-only" not in line and "numpy" not in line
    assert re.search(r"pip download --only-binary=:all: --python-version \d\.\d+ --platform \S+ -d wheels "
                     r"inner-missing-a inner-missing-b", line)
    assert line.endswith("pip install --no-index --find-links wheels inner-missing-a inner-missing-b")


def test_the_memory_lessons_are_known_with_their_processes():
    args = benchmark.parse_args(["--scripts", "11", "12", "13", "14", "15"])
    assert [s for s, _ in args.runs] == ["11_fabric-vit-bf16-true.py", "12_fabric-vit-grad-accumulation.py",
                                         "13_fabric-vit-activation-checkpointing.py",
                                         "14_fabric-vit-sgd-cosine.py", "15_fabric-vit-fsdp-cpu-offload.py"]
    assert [b for _, b in args.runs] == [16] * 5
    # read from each script: whether it takes --devices, and the fewest processes it runs on
    assert runs.process_range("15_fabric-vit-fsdp-cpu-offload.py") == (True, 1)
    assert runs.process_range("10_fabric-vit-tensor-parallel.py") == (True, 2)
    assert runs.process_range("11_fabric-vit-bf16-true.py") == (False, 1)
    memory = benchmark.parse_args(["--memory", "--sequel"])
    assert memory.memory_scripts is None and memory.sequel
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--talk"])  # only with --memory
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--memory", "--talk", "--memory-models", "ViT-H/14"])  # no script builds it


def test_gpu_check_never_runs_the_baseline_alone(tmp_path, monkeypatch):
    """01 is what the others are measured against: a round starts with it only where the next
    configuration fits in the time left too (the first H200 check ran 01 alone twice, when each
    of the last two stages had room for one run). Here 01 would fit and 01 with 03 would not:
    nothing runs, and the stage says what stopped it; with room for both, the plan goes on."""
    from benchmarks import gpu_check
    ran, smoke = [], {r["script"]: r for r in read_runs(ROOT / "reference" / "benchmark-smoke.jsonl")}
    monkeypatch.setattr(throughput, "run_configuration",  # the planner under test, not the runs: a smoke record
                        # each, as a busy machine leaves it (its report's verdict then says how to measure longer)
                        lambda script, batch, *a: (ran.append(script[:2]) or dict(smoke[script], busy=True), 10.0))
    monkeypatch.setattr(throughput, "run_bare", lambda record, *a: ({"images_per_s": 1.0, "peak_memory_gb": 1.0}, 5.0))
    check = gpu_check.Check(gpu_check.parse_args(["--smoke", "--out", str(tmp_path)]), gpus=0)
    scripts = [("01_pytorch-vit.py", 16), ("03_fabric-vit.py", 16)]
    for script, _ in scripts:
        check.keep("run", (script, 16), 10.0)
        check.keep("bare loop", (script, 16), 5.0)
    check.deadline = time.monotonic() + 20  # room for one 10 s run and its 5 s bare loop, not two
    state, _ = gpu_check.run_throughput(check, "t", "t", {"batch": 16, "rounds": 1}, scripts, str(tmp_path))
    assert ran == []
    assert state.startswith("not run: round 1 stopped before 01 and 03 beside it, planned at 30 s"), state
    check.deadline = time.monotonic() + 35
    state, text = gpu_check.run_throughput(check, "t", "t", {"batch": 16, "rounds": 1}, scripts, str(tmp_path))
    assert ran == ["01", "03"], state
    assert "BUSY MACHINE" in text and "--repeat 2 --max-steps" in text


def test_the_input_stage_never_starts_with_less_time_left_than_it_is_planned_at(tmp_path, monkeypatch):
    """gpu_check's input stage, planned at its default (nothing has timed it yet): with a second less
    than that left it is not started, and says so; with room, it runs once and keeps its cost."""
    from benchmarks import gpu_check
    measured = []
    monkeypatch.setattr(throughput, "input_rates", lambda args: measured.append(1) or {})  # its measuring, not its planning
    monkeypatch.setattr(throughput, "input_lines", lambda rates, rows, args: ["rates"])
    check = gpu_check.Check(gpu_check.parse_args(["--smoke", "--out", str(tmp_path)]), gpus=0)
    settings = next(s for name, _, _, s in gpu_check.STAGES if name == "input")
    planned = gpu_check.DEFAULT_S["smoke"]["input"]
    check.deadline = time.monotonic() + planned - 1
    state, text = gpu_check.run_input(check, settings)
    assert measured == [] and state.startswith(f"not run: planned at {planned} s with ") and text == ""
    check.deadline = time.monotonic() + planned + 30
    state, _ = gpu_check.run_input(check, settings)
    assert (state, measured) == ("done", [1]) and check.costs["input"]["input"]


@pytest.mark.slow
def test_the_flags_a_lessons_row_is_measured_with_reach_its_run(tmp_path, monkeypatch):
    """run_script, which every table and stage runs a lesson with, adds the flags its row's measured_with names:
    04's row given "--max-steps 2 --seed 7" here, its real --smoke run's record has them."""
    rows = {script: dict(row) for script, row in lessons().items()}
    rows["04_fabric-vit-mixed-precision.py"]["measured_with"] = ["--max-steps", "2", "--seed", "7"]
    monkeypatch.setattr(runs, "lessons", lambda: rows)
    record, _ = runs.run_script("04_fabric-vit-mixed-precision.py", ["--smoke", "--epochs", "1"], tmp_path / "runs.jsonl",
                                env=script_env(tmp_path), timeout=240)
    assert (record["max_steps"], record["seed"], len(record["train_loss"])) == (2, 7, 1), record
