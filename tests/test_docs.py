"""The README and docs/ say what the records say: every measured figure is in a block that
tools/figures.py makes from a record in reference/, and a figure outside the blocks is the
talk's (lessons.csv), a setting, or one the page's blocks give; no help text states a
time; and every documented command that runs on a CPU runs, in a copy of the checkout, leaving
git status clean."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, script_env

sys.path.insert(0, str(ROOT / "tools"))
import figures  # noqa: E402

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIGURE = re.compile(r"(?<![\w.,-])(\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?)(?: ?(GB|GiB|MB|%|s\b|min\b|images/s|TFLOP/s|GFLOP)|(x)\b)")
# Figures that are settings, sizes or expectations, not measurements: each says what it is.
NOT_MEASURED = {
    "24 GiB",    # the machine's memory, in its description
    "9 MB",      # the size of the tests' small filesystem
    "1.7 MB",    # the smoke weights file's size, which the tests bound
    "85%",       # --memory --talk plans processes within 85% of the free memory
    "80%",       # --memory skips a model whose state needs more than 80% of the memory
    "20%",       # a configuration whose bare loops run this far apart is marked busy (throughput.BUSY)
    "5%",        # closer than this, two configurations are tied (throughput.TIE); 09's warm-up
    "26%", "105 GFLOP", "95%",  # 09's expectation on an H200, not measured
    "30 s",      # SLURM's KillWait default
    "1%",        # 10's tests: its losses within this of a --tensor-parallel 1 run's
    "3.23x", "1.17x",  # published: a ViT with and without CUDA graphs, PyTorch's dashboard (pytorch/pytorch#96191)
    "3,300 images/s", "35%",  # 09's goal on one H200, not yet measured
}


def test_every_block_is_what_its_records_make():
    stale = figures.differing()
    assert not stale, (f"{stale}: these pages' tables are not what lessons.csv and reference/ make now: run "
                       "python tools/figures.py (docs/adding-a-lesson.md)")


def outside_blocks(text):
    return figures.BLOCK.sub("", re.sub(r"```.*?```", "", text, flags=re.S))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_measured_figure_outside_the_blocks(page):
    """A figure with a unit in the prose is the talk's, a setting (NOT_MEASURED, each with its
    reason), or one of the page's own blocks: never a measurement that no record backs."""
    text = page.read_text()
    talk = (ROOT / "lessons.csv").read_text()
    blocks = "".join(m[3] for m in figures.BLOCK.finditer(text))
    for number, unit, times in FIGURE.findall(outside_blocks(text)):
        unit = unit or times
        figure = f"{number}{unit}" if unit in ("%", "x") else f"{number} {unit}"
        if figure in NOT_MEASURED or f"{number} {unit}" in NOT_MEASURED:
            continue
        assert all(n in talk or n in blocks for n in number.split("-")), f"{page.name}: {figure} is no record's"


def test_steps_mean_optimizer_steps_in_help_docs_and_records(capsys, monkeypatch):
    """--max-steps counts optimizer steps in --help and in the flags' page (12-14 load each step's
    batch in 4 micro-batches)."""
    import runpy
    monkeypatch.setattr(sys, "argv", ["12_fabric-vit-grad-accumulation.py", "--help"])
    with pytest.raises(SystemExit):
        runpy.run_path(str(ROOT / "12_fabric-vit-grad-accumulation.py"), run_name="__main__")
    assert "train N optimizer steps per epoch" in " ".join(capsys.readouterr().out.split())
    flags = (ROOT / "docs" / "flags-records-exit-codes.md").read_text()
    assert "| `--max-steps N` | `--synthetic`: 20, one epoch | train N optimizer steps per epoch" in flags
    assert "`steps`" not in flags


def test_the_docs_list_every_record_field_and_no_other():
    """docs/flags-records-exit-codes.md's table of run-record fields is the schema's (Record)."""
    from run_keeping.reading import FIELDS
    page = (ROOT / "docs" / "flags-records-exit-codes.md").read_text()
    table = page.split("## Run records", 1)[1].split("\n\n| field |", 1)[1].split("\n\n", 1)[0]
    documented = [name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split(" | ")[0])]
    assert documented == FIELDS, "add the field to the table in docs/flags-records-exit-codes.md, in Record's order"


def test_help_texts_state_no_time(capsys, monkeypatch):
    """A help text that says how long something takes goes stale: none does."""
    import runpy
    for program in [*sorted(p.name for p in ROOT.glob("[01][0-9]_*.py")), "benchmark.py", "plot_results.py",
                    "make_smoke_weights.py"]:
        monkeypatch.setattr(sys, "argv", [program, "--help"])
        with pytest.raises(SystemExit):
            runpy.run_path(str(ROOT / program), run_name="__main__")
        text = " ".join(capsys.readouterr().out.split())
        assert not re.search(r"\d+ ?(s|min|seconds|minutes)\b", text), (program, text)


def documented_commands():
    """(page, command) for each command the README and docs/ give: in bash blocks, and in the
    prose's `python ...` and `bash ...`."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in re.sub(r"\s*\\\n\s*", " ", block).splitlines():
                line = line.split("  #")[0].strip()
                if line and not line.startswith("#"):
                    found.append((page.name, line))
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        found += [(page.name, command) for command in re.findall(r"`((?:python|bash) [^`]+)`", prose)]
    return found


# Each documented command, as the test runs it on a CPU (the long ones at their smallest size), or
# None and why it cannot run here.
SMALLEST = "--repeat 1 --max-steps 4 --loader-images 0"
RUN = {
    "pip install -r requirements.txt && python 04_fabric-vit-mixed-precision.py --smoke": "python 04_fabric-vit-mixed-precision.py --smoke",
    "diff 01_pytorch-vit.py 03_fabric-vit.py": "diff 01_pytorch-vit.py 03_fabric-vit.py || true",
    "diff 04_fabric-vit-mixed-precision.py 16_fabric-vit-cuda-graphs.py":
        "diff 04_fabric-vit-mixed-precision.py 16_fabric-vit-cuda-graphs.py || true",
    "diff 04_fabric-vit-mixed-precision.py 11_fabric-vit-bf16-true.py": "diff 04_fabric-vit-mixed-precision.py 11_fabric-vit-bf16-true.py || true",
    "python 06_fabric-vit-mixed-fsdp.py --help": "python 06_fabric-vit-mixed-fsdp.py --help",
    "for seed in 123 1 2; do for s in 00 01 03 04; do python ${s}_*.py --smoke --seed $seed; done; done":
        "for seed in 1; do for s in 01; do python ${s}_*.py --smoke --seed $seed --max-steps 4 --epochs 1; done; done",
    "for seed in 123 1 2; do for s in 04 11 12 13 14 15; do python ${s}_*.py --smoke --seed $seed; done; done":
        "for seed in 1; do for s in 11; do python ${s}_*.py --smoke --seed $seed --max-steps 4 --epochs 1; done; done",
    "python plot_results.py --smoke": "python plot_results.py --smoke",
    "python plot_results.py": "python plot_results.py",
    "python 08_load-and-evaluate.py --smoke": "python 08_load-and-evaluate.py --smoke",
    "python 09_fabric-vit-fast.py --smoke": "python 09_fabric-vit-fast.py --smoke --max-steps 4 --epochs 1",
    "python benchmark.py --smoke": f"python benchmark.py --smoke --scripts 01 {SMALLEST}",
    "python benchmark.py --peaks": "python benchmark.py --peaks",
    "python make_smoke_weights.py": "python make_smoke_weights.py --images 100 --steps 2",
    "python tools/figures.py": "python tools/figures.py",
    "bash gpu_check.sh --plan": "bash gpu_check.sh --plan",
    "python tools/bf16_probe.py": "python tools/bf16_probe.py",
    "for s in 03 04 05 06 07 09 10 11 12 13 14 15; do ONEDNN_MAX_CPU_ISA=AVX2 python ${s}_*.py --smoke; done":
        "for s in 04; do ONEDNN_MAX_CPU_ISA=AVX2 python ${s}_*.py --smoke --max-steps 4 --epochs 1; done",
}
ELSEWHERE = {  # why a documented command does not run here, and what runs it or its steps instead
    "pip install -r requirements.txt && python -m pytest -q": "this suite",
    "python -m pytest -q": "this suite", "python -m pytest -q -m \"not slow\"": "this suite",
    "python -m pytest -q -n 0": "this suite",
    "ruff check --select I --fix 17_your-lesson.py": "a contributor's new lesson: test_layout.py's new-lesson test runs it",
    "python 00_pytorch-vit-random-init.py": "a GPU's", "python 01_pytorch-vit.py": "a GPU's",
    "python 04_fabric-vit-mixed-precision.py": "a GPU's", "python 05_fabric-vit-mixed-ddp.py": "a GPU's",
    "python 09_fabric-vit-fast.py": "a GPU's, and CIFAR-10 and the weights downloaded",
    "python benchmark.py --scripts 01 02 03 04 09 01@128 04@128": "a GPU's",
    "python 08_load-and-evaluate.py": "a full run's model and CIFAR-10",
    "python 08_load-and-evaluate.py --model models/06_fabric-vit-mixed-fsdp.pt": "a full run's model",
    "python 08_load-and-evaluate.py --predict cat.png truck.jpg": "a full run's model and your pictures",
    "python benchmark.py --memory": "minutes on ViT-B/16 and ViT-L/16; test_benchmark.py runs its steps",
    "python benchmark.py --memory --talk": "a minute a script at 224 on a CPU, even the smallest; test_memory.py runs "
                                           "the scripts at that size, test_gpu_rehearsal.py makes the tables and chart",
    "python benchmark.py --memory --sequel": "as --memory --talk",
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr 10.0.0.1 --master-port 29500 "
    "06_fabric-vit-mixed-fsdp.py --devices 4 --num-nodes 2": "two machines; test_fabric.py runs two torchrun nodes here",
    "srun python 06_fabric-vit-mixed-fsdp.py --devices 4 --num-nodes 2": "a SLURM job; test_slurm.py runs it",
    "bash tools/local_slurm.sh start DIR": "test_slurm.py runs it",
    "bash gpu_check.sh": "its --smoke, from another folder, in test_benchmark.py, which checks that it leaves "
                         "the checkout as it was",
    "bash gpu_check.sh --smoke": "test_benchmark.py: within a minute's --minutes, with a configuration made to fail, "
                                 "and killed in the middle",
    "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu && pip install -r requirements.txt":
        "PyTorch's own package index, which CI does not reach; the rest is this suite's install",
    "python benchmark.py --scripts 10 15 --devices 2": "2 GPUs",
    "bash tools/check_stack.sh minimums": "several GB of downloads", "bash tools/check_stack.sh h200": "several GB of downloads",
}


def test_every_documented_command_is_known():
    unknown = [(page, command) for page, command in documented_commands()
               if command not in RUN and command not in ELSEWHERE]
    assert not unknown, unknown


@pytest.mark.slow
def test_every_documented_command_leaves_the_checkout_clean(tmp_path):
    """In a copy of the checkout (its files as they are now, committed there), every documented
    command that runs on a CPU, from its root as the docs say, in the order the docs give them:
    each ends well, and git status is clean after them all: the outputs went to the folders git
    ignores (results/, models/, checkpoints/, data/), and nothing tracked changed."""
    copy = tmp_path / "checkout"
    copy.mkdir()
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    subprocess.run(["tar", "cf", str(tmp_path / "files.tar"), "-C", str(ROOT), *[f for f in files if f]], check=True)
    subprocess.run(["tar", "xf", str(tmp_path / "files.tar"), "-C", str(copy)], check=True)
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=copy,  # noqa: E731
                                    capture_output=True, text=True, check=True).stdout
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "the checkout as it is")
    commands = list(dict.fromkeys(RUN[c] for _, c in documented_commands() if c in RUN))
    env = script_env(copy, PATH=f"{Path(sys.executable).parent}:{script_env(copy)['PATH']}")
    for command in commands:
        proc = subprocess.run(["bash", "-c", command], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (command, proc.stderr[-2000:])
    changed = git("status", "--porcelain")
    assert changed == "", changed
    ignored = [line[3:] for line in git("status", "--porcelain", "--ignored").splitlines()
               if line.startswith("!!") and "__pycache__" not in line]
    assert ignored and all(path.split("/")[0] in ("results", "models", "checkpoints", "data") for path in ignored), ignored
