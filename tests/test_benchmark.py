"""benchmark.py and gpu_check.sh: MFU from the right peaks, the table from the records, the bare
loop beside each configuration, and the one GPU command at smoke size."""
import os
import re
import subprocess
import sys

import pytest

import benchmark
import benchmark_memory
from conftest import ROOT, read_records, script_env


def test_vit_b_16_training_flops_match_the_known_figure():
    # torchvision's 17.56 GFLOPS are multiply-adds: 35.1 GFLOP forward, x3 with backward
    assert 104e9 < benchmark.flops_per_image(smoke=False) < 106e9


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
    assert benchmark.peak_tflops(name, precision) == expected


def test_peak_tflops_per_precision_overrides_the_table():
    args = benchmark.parse_args(["--peak-tflops", "32-true=60", "bf16-mixed=800"])
    assert benchmark.peak_tflops("NVIDIA H200", "bf16-mixed", args.peak_tflops) == 800
    assert benchmark.peak_tflops("NVIDIA H200", "32-true", args.peak_tflops) == 60
    assert benchmark.peak_tflops("CPU Xeon", "32-true", {}) is None  # no GPU here: no MFU


def round_records(script, precision, rates, processes=1, batch=16):
    """A configuration's records over the rounds: what its script appended in each."""
    return [{"script": script, "batch_size": batch, "precision": precision, "world_size": processes,
             "strategy": "single-device" if processes == 1 else "ddp", "images_per_s": rate,
             "peak_memory_gb": 3.0, "device_name": "NVIDIA H200"} for rate in rates]


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
    rows = {(r["script"], r.get("of")): r for r in benchmark.rows_of(measured, 105e9, args)}
    four = rows[("04_fabric-vit-mixed-precision.py", None)]
    assert four["vs_01"] == (3.0, 3.0, 3.0)  # 300/100, 330/110, 270/90: the same in every round
    assert four["vs_bare"] == (0.75, 0.75, 0.9)
    assert four["images_per_s"] == (300, 270, 330)
    assert four["mfu"] == pytest.approx(300 * 105e9 / 989.5e12)
    assert four["busy"] and "busy: its bare loops differ by 47%" in "\n".join(benchmark.markdown_table(list(rows.values())))
    three = rows[("03_fabric-vit.py", None)]
    assert not three["busy"] and three["spread_bare"] == pytest.approx(1628 / 1475 - 1)
    assert three["noise"] and not four["noise"]  # 0.99-1.02 around 0.99: cannot be told from 1
    assert rows[("05_fabric-vit-mixed-ddp.py", None)]["vs_01"] == (None, None, None)  # 2 processes: no 01 on 2
    bare = rows[("bare loop", "04_fabric-vit-mixed-precision.py")]
    assert bare["images_per_s"] == (400, 300, 440) and bare["mfu"] == pytest.approx(400 * 105e9 / 989.5e12)
    chosen, order = benchmark.ranking(list(rows.values()))
    assert order == "04 > 01 = 03"


@pytest.mark.parametrize("rates, told_apart", [
    ([104, 104, 104], True),   # 4% faster in every round: more than TIE
    ([102, 102, 102], False),  # 2% in every round: within TIE, tied
    ([110, 110, 99], False),   # 10% in the median, but the slower in one round: tied
])
def test_the_ranking_tells_apart_only_what_every_round_agrees_on(rates, told_apart):
    """Two configurations are ordered (>) only where one was faster in every round and by more
    than TIE in the median; otherwise they are tied (=)."""
    assert benchmark.TIE == 0.03  # the cases above straddle it
    measured = {
        ("01_pytorch-vit.py", 16): {"records": round_records("01_pytorch-vit.py", "32-true", [100, 100, 100]), "bares": []},
        ("02_pytorch-vit-compile.py", 16): {"records": round_records("02_pytorch-vit-compile.py", "32-true", rates), "bares": []}}
    _, order = benchmark.ranking(benchmark.rows_of(measured, 1e9, benchmark.parse_args([])))
    assert order == ("02 > 01" if told_apart else "02 = 01")


def test_the_verdict_says_what_the_machine_showed_and_what_it_cannot(tmp_path):
    args = benchmark.parse_args(["--smoke"])
    measured = {
        ("01_pytorch-vit.py", 16): {"records": round_records("01_pytorch-vit.py", "32-true", [100, 100, 100]),
                                    "bares": [{"images_per_s": b, "peak_memory_gb": 1.0} for b in (120, 60, 121)]},
        ("04_fabric-vit-mixed-precision.py", 16): {"records": round_records("04_fabric-vit-mixed-precision.py", "bf16-mixed", [70, 71, 69]), "bares": []}}
    for record in (r for runs in measured.values() for r in runs["records"]):
        record["device_name"] = "CPU Intel(R) Xeon(R) Processor (2 cores)"
    lines = benchmark.verdict(benchmark.rows_of(measured, 1e9, args), args, "CPU Intel(R) Xeon(R) Processor (2 cores)")
    text = "\n".join(lines)
    assert "From fastest to slowest (one process, batch 16; >: faster in every round" in text and ": 01 > 04." in text
    assert "BUSY MACHINE: the bare loops of one configuration ran up to 102% apart" in text
    assert f"--repeat {2 * args.repeat} --max-steps {2 * args.max_steps}" in text
    assert "What it cannot say: anything about a GPU" in text and "mostly its libraries" in text


def without_the_interpreter_on_path(tmp_path):
    """An environment whose PATH lacks the folder of the interpreter running the tests (as with a
    virtual environment that is not activated): only sys.executable reaches the packages."""
    folder = os.path.dirname(sys.executable)
    path = [p for p in os.environ["PATH"].split(os.pathsep) if p and os.path.realpath(p) !=
            os.path.realpath(folder) and "pyenv" not in p]
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
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--scripts", "16"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown script 16" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_loader_rate_is_measured():
    rates = benchmark.loader_rates(48, [0])
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
    count, the scripts and their bare loops, the report, the input pipeline), with the table's
    figures taken from the records; run by the interpreter PYTHON names, which is not on PATH;
    every output in results/gpu-check/ under the folder it ran in, nothing else left (no model
    files, no checkpoints), and the checkout as it was."""
    env = dict(without_the_interpreter_on_path(tmp_path),
               PYTHON=sys.executable)  # an unactivated virtual environment's python, say
    checkout = checkout_files()
    # at smoke size, and for the suite's time only the baseline, one round (every precision and
    # strategy goes through the report in test_gpu_rehearsal.py)
    flags = ["--smoke", "--max-steps", "8", "--repeat", "1", "--scripts", "01", "--loader-workers", "0", "1"]
    proc = subprocess.run(["bash", str(ROOT / "gpu_check.sh"), *flags],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert checkout_files() == checkout  # nothing in the checkout written, added or removed
    out = tmp_path / "results" / "gpu-check"  # its outputs' folder: under the folder it ran in
    assert "preflight: every module the scripts import is there." in proc.stderr
    report = (out / "gpu-check.md").read_text()
    assert report.startswith("## GPU check, ") and "no NVIDIA GPU: a CPU run; GPUs the scripts see: 0" in report
    records = read_records(out / "gpu-check.jsonl")
    assert [r["script"][:2] for r in records] == ["01"]
    assert all(r["synthetic"] and r["test_acc"] is None for r in records)
    rows = table_rows(report)
    scripts = [r for r in rows if r[0] != "bare loop"]
    bare = [r for r in rows if r[0] == "bare loop"]
    assert len(scripts) == len(records) and len(bare) == len(records)  # each its own layout
    for row, record in zip(scripts, records):
        assert (row[0], int(row[1]), row[2], int(row[4])) == (record["script"], record["batch_size"],
                                                              record["precision"], record["world_size"])
        assert float(row[5]) == pytest.approx(record["images_per_s"], abs=0.06)
        assert row[7] != "-"  # every script has its bare loop to compare with
    assert scripts[0][6] == "1.00"  # 01 against itself, in the same round
    assert "What this run shows, on CPU" in report and "What it cannot say: anything about a GPU" in report
    # its own outputs, nothing else: no model file, no checkpoint, under it or where it ran
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.jsonl", "gpu-check.md", "throughput.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) in (["results"], ["results", "torch-home"])
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpu-check"]
    # the command benchmark.py prints for charting its records runs as printed
    hint = re.search(r"chart them with: (python \S*plot_results\.py [^)]*)\)", proc.stdout + proc.stderr)
    assert hint and "--smoke --synthetic" in hint[1], (proc.stdout + proc.stderr)[-2000:]
    charted = subprocess.run(["bash", "-c", hint[1].replace("python", sys.executable, 1)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
    assert charted.returncode == 0, charted.stderr[-2000:]
    assert "Chart written to results/charts.png" in charted.stdout
    assert "workers:" in report and "09's pipeline" in report


def test_the_talks_speedups_and_memory_beside_ours():
    """gpu_check's comparison: the talk's figures come from talk_reference.csv."""
    from plot_results import load_reference
    rows = [{"script": benchmark.SCRIPTS[n], "batch": 16, "devices": 1, "vs_01": (v, v, v), "memory_gb": m}
            for n, v, m in (("01", 1.0, 3.5), ("02", 1.1, 3.6), ("03", 0.99, 3.5), ("04", 3.0, 2.9))]
    lines = benchmark.talk_comparison(rows, load_reference())[2:]
    talk = [(line.split(" | ")[2], line.split(" | ")[4].rstrip(" |")) for line in lines]
    assert talk == [("1.00x", "3.71"), ("1.04x", "3.73"), ("1.01x", "3.71"), ("2.94x", "3.04")]
    assert lines[3].split(" | ")[1] == "3.00x" and lines[3].split(" | ")[3] == "2.90"


def test_memory_arithmetic_per_strategy():
    """What each strategy should hold per process, by arithmetic: DDP adds its buckets to a whole
    copy, FSDP2 halves everything, TP halves each MLP (two thirds of a ViT-L/16) and so lies
    between them."""
    parameters, _ = benchmark_memory.expected_held("ViT-L/16", "one process")
    assert 300e6 < parameters < 310e6
    held = {s: benchmark_memory.expected_held("ViT-L/16", s)[1] for s in benchmark_memory.MEMORY_STRATEGIES}
    state = {s: benchmark_memory.state_bytes(s, parameters, held[s]) for s in held}
    assert state["DDP (05)"] == 20 * parameters and state["one process"] == 16 * parameters
    assert state["FSDP2 (06)"] == 8 * parameters
    assert state["FSDP2 (06)"] < state["TP (10)"] < state["DDP (05)"]
    assert 0.6 < held["TP (10)"] / parameters < 0.7


def test_tensor_parallel_script_is_known_with_its_layout():
    args = benchmark.parse_args(["--scripts", "10"])
    assert args.runs == [("10_fabric-vit-tensor-parallel.py", 16)]
    record = {"precision": "bf16-mixed", "strategy": "tensor-parallel+fsdp2", "world_size": 2,
              "tensor_parallel_size": 2, "batch_size": 16}
    assert benchmark.bare_spec(record) == {
        "precision": "bf16-mixed", "strategy": "tensor-parallel+fsdp2", "processes": 2, "tensor_parallel": 2,
        "batch": 16, "micro_batches": 1, "checkpointing": False, "optimizer": "Adam", "parallelize": None}


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
    --memory would count as held; with benchmark_memory.EXACT_MALLOC it is handed back."""
    def resident_after_free(**env):
        proc = subprocess.run([sys.executable, "-c", FREED_BUT_RESIDENT], capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, **env))
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.split()[-1])
    if resident_after_free() < 200:
        pytest.skip("this C library hands freed memory back by itself")
    assert resident_after_free(**benchmark_memory.EXACT_MALLOC) < 50


@pytest.mark.parametrize("seen, listed", [(1, 1), (2, 2), (1, 2)])
def test_gpu_check_runs_10_only_where_the_scripts_see_two_gpus(tmp_path, seen, listed):
    """gpu_check.sh on a GPU machine, with nvidia-smi and the interpreter stood in for (no GPU
    here): the report names the GPU; 10 runs where torch sees 2 GPUs, as the scripts count them,
    and is left out, saying why, where it sees 1, also when nvidia-smi lists 2
    (CUDA_VISIBLE_DEVICES=0 on a 2-GPU machine)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "echo 'NVIDIA H200, 570.86.15, 143771 MiB'\n" * listed)
    python = bin_dir / "python-stand-in"  # the preflight passes and counts $GPUS; benchmark.py
    python.write_text('#!/bin/sh\ncase "$1" in */tools/preflight.py) echo "$GPUS"; exit 0 ;; esac\n'
                      'echo "$@" >> "$ARGS"\nwhile [ $# -gt 0 ]; do\n'  # records what it was asked
                      '  [ "$1" = --report ] && echo "| the table of $2 |" > "$2"\n  shift\ndone\n')
    for tool in (smi, python):
        tool.chmod(0o755)
    env = script_env(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", GPUS=str(seen),
                     PYTHON=str(python), ARGS=str(tmp_path / "args"), GPU_CHECK_DIR=str(tmp_path / "out"))
    proc = subprocess.run(["bash", str(ROOT / "gpu_check.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "args").read_text().splitlines()
    scripts = calls[0].split("--scripts ")[1].split(" --")[0].split()
    assert scripts[:13] == ["01", "02", "03", "04", "05", "06", "07", "09", "11", "12", "13", "14", "15"]
    # then the talk's memory column and the sequel's chain, each in a report of its own
    assert [c.split("benchmark.py ")[1].split(" --results")[0] for c in calls[1:]] == \
        ["--memory --talk", "--memory --sequel"]
    skipped = "10_fabric-vit-tensor-parallel.py skipped: tensor parallelism splits each MLP across 2 GPUs, and this machine has 1."
    assert ("10" in scripts) == (seen == 2) and (skipped in proc.stderr) == (seen == 1)
    report = (tmp_path / "out" / "gpu-check.md").read_text()
    assert f"GPU (name, driver, memory): NVIDIA H200, 570.86.15, 143771 MiB; GPUs the scripts see: {seen}" in report
    assert "| the table of" in report and report.count("| the table of") == 3
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "gpu-check.md", "memory-sequel.md", "memory-talk.md", "throughput.md"]


BLOCK_IPYTHON = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "IPython":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
"""


@pytest.mark.slow
def test_gpu_check_first_names_a_missing_module_and_its_wheel(tmp_path):
    """A machine without IPython (which watermark needs, as the H200 machine lacked): before
    anything runs, one line naming the module, what needs it and the wheel to install, exit 4,
    not the "no GPU" of exit 2; nothing written."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_IPYTHON)
    env = script_env(tmp_path, PYTHONPATH=str(site), GPU_CHECK_DIR=str(tmp_path / "out"))
    proc = subprocess.run(["bash", str(ROOT / "gpu_check.sh"), "--smoke"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preflight: error: missing: watermark (it needs IPython)")
    assert "pip install ipython" in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_memory_lessons_are_known_with_their_processes():
    args = benchmark.parse_args(["--scripts", "11", "12", "13", "14", "15"])
    assert [s for s, _ in args.runs] == ["11_fabric-vit-bf16-true.py", "12_fabric-vit-grad-accumulation.py",
                                         "13_fabric-vit-activation-checkpointing.py",
                                         "14_fabric-vit-sgd-cosine.py", "15_fabric-vit-fsdp-cpu-offload.py"]
    assert [b for _, b in args.runs] == [16] * 5
    # read from each script: whether it takes --devices, and the fewest processes it runs on
    assert benchmark_memory.process_range("15_fabric-vit-fsdp-cpu-offload.py") == (True, 1)
    assert benchmark_memory.process_range("10_fabric-vit-tensor-parallel.py") == (True, 2)
    assert benchmark_memory.process_range("11_fabric-vit-bf16-true.py") == (False, 1)
    memory = benchmark.parse_args(["--memory", "--sequel"])
    assert memory.memory_scripts is None and memory.sequel
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--talk"])  # only with --memory
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--memory", "--talk", "--memory-models", "ViT-H/14"])  # no script builds it
