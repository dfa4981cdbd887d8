"""The README and docs/ say what the records say: every measured figure is in a block that
tools/figures.py makes from a record in reference/, and a figure outside the blocks is the
talk's (lessons.csv), a setting, or one the page's blocks give; no help text states a
time; and every documented command that runs on a CPU runs, in a copy of the checkout, leaving
git status clean."""
import re
import shutil
import subprocess
import sys

import pytest

from conftest import GPU_HOST, ROOT, run_script, script_env

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
    "120 s",     # a lesson's smoke run's time limit in test_scripts.py (WALL_LIMIT_S)
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
    for program in [*sorted(p.name for p in ROOT.glob("[0-9][0-9]_*.py")), "benchmark.py", "plot_results.py",
                    "make_smoke_weights.py"]:
        monkeypatch.setattr(sys, "argv", [program, "--help"])
        with pytest.raises(SystemExit):
            runpy.run_path(str(ROOT / program), run_name="__main__")
        text = " ".join(capsys.readouterr().out.split())
        assert not re.search(r"\d+ ?(s|min|seconds|minutes)\b", text), (program, text)


def documented_commands():
    """(page, command) for each command in a bash block of the README and docs/."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in re.sub(r"\s*\\\n\s*", " ", block).splitlines():
                line = line.split("  #")[0].strip()
                if line and not line.startswith("#"):
                    found.append((page.name, line))
    return found


# The documented commands that cannot run on this machine at all, each with what it needs and the
# test that runs its steps instead. Every other command is run, as run_here says, by the test below.
CANNOT_RUN_HERE = {
    "pip install -r requirements.txt && python -m pytest -q": "this suite", "python -m pytest -q": "this suite",
    "python -m pytest -q -m \"not slow\"": "this suite",
    "pip install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cpu && pip install -r requirements.txt":
        "PyTorch's own package index, which this machine does not reach; the rest is this suite's install",
    "pip install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cu128 && pip install -r requirements.txt":
        "PyTorch's own package index, which this machine does not reach; the rest is this suite's install",
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr 10.0.0.1 --master-port 29500 "
    "06_fabric-vit-mixed-fsdp.py --devices 4 --num-nodes 2": "two machines; test_fabric.py runs two torchrun nodes on this one",
    "srun python 06_fabric-vit-mixed-fsdp.py --devices 4 --num-nodes 2": "a SLURM job; test_slurm.py submits it",
    "ruff check --select I --fix 17_your-lesson.py": "a contributor's lesson 17: test_layout.py's new-lesson test runs it",
    "bash tools/check_stack.sh minimums": "several GB of downloads", "bash tools/check_stack.sh h200": "several GB of downloads",
}
# The smallest scale of a program's command that reaches its code, added to each of its commands
SMALLEST = {"benchmark.py --smoke": "--repeat 1 --max-steps 4 --loader-images 0 --scripts 01",
            "make_smoke_weights.py": "--images 100 --steps 2"}
# What each documented command that cannot run here says instead, in its own one line (exit 2): what it needs that
# this machine lacks (a GPU, CIFAR-10, a finished full run's model, the pictures a user gives)
FULL_RUN = "no CUDA GPU found. A full run on a CPU takes about a day"
STOPS_HERE = {
    **{f"python {script}": FULL_RUN for script in ("00_pytorch-vit-random-init.py", "01_pytorch-vit.py",
                                                   "04_fabric-vit-mixed-precision.py", "05_fabric-vit-mixed-ddp.py",
                                                   "09_fabric-vit-fast.py")},
    "bash gpu_check.sh": "no CUDA GPU found. On a CPU, run the same check at smoke size",
    "python benchmark.py --scripts 01 02 03 04 09 01@128 04@128": "no CUDA GPU found. Without --smoke this measures",
    "python 08_load-and-evaluate.py": "no model of a whole run in models/",
    "python 08_load-and-evaluate.py --model models/06_fabric-vit-mixed-fsdp.pt": "--model models/06_fabric-vit-mixed-fsdp.pt: no such file",
    "python 08_load-and-evaluate.py --predict cat.png truck.jpg": "cannot read the image cat.png",
}
# What stops here for want of a GPU would run on a host whose torch sees one (conftest.GPU_HOST): not run there
NEEDS_NO_GPU = {command for command, said in STOPS_HERE.items() if said.startswith("no CUDA GPU found")}
# A scaled-down command that measures nothing (exit 6) passes only where every page that gives it says this
MEASURES_NOTHING = "measures nothing on a CPU without native bfloat16"


def run_here(command):
    """How the suite runs a documented command on a CPU without the network: the same command, at its
    smallest scale. A loop runs its first item, and a lesson's --smoke run in one trains 4 steps of
    one epoch; benchmark.py --memory measures at --smoke (ViT-B/16 alone; --talk and --sequel: their
    table's first lesson, on the smoke ViT); the pip install before a command is this suite's own."""
    command = command.removeprefix("pip install -r requirements.txt && ")
    if command.startswith("for "):
        command = re.sub(r"for (\w+) in (\S+)[^;]*;", r"for \1 in \2;", command)
        command = re.sub(r"(python \$\{s\}_\*\.py --smoke[^;]*)", r"\1 --max-steps 4 --epochs 1", command)
    for program, flags in SMALLEST.items():
        if program in command:
            command += f" {flags}"
    if "benchmark.py --memory" in command and "--smoke" not in command:
        from benchmarks.memory import chain
        table = "sequel" if "--sequel" in command else "talk" if "--talk" in command else None
        command += f" --smoke --scripts {chain(table)[0]}" if table else " --smoke"
    return command


def test_every_documented_command_is_known():
    """Every command the pages give is run (run_here) or says why it cannot be, here; every command expected
    to stop here is one a page gives."""
    given = {command for _, command in documented_commands()}
    run = [command for command in given if command not in CANNOT_RUN_HERE]
    assert run and all(run_here(command) for command in run)
    assert set(CANNOT_RUN_HERE) <= given and set(STOPS_HERE) <= given, "a command no page gives any more"


@pytest.mark.slow
def test_every_documented_command_leaves_the_checkout_clean(tmp_path):
    """In a copy of the checkout (its files as they are now, committed there), every documented
    command, from its root as the docs say, in the order the docs give them, at its smallest scale
    (run_here): each ends well, or, where it needs what this machine lacks (a GPU, CIFAR-10, a
    finished run's model), stops at once in its own one line (STOPS_HERE); one that measures nothing on a
    CPU without native bfloat16 (exit 6) is said so on its pages; and git status is clean after them all: the outputs went to the folders git ignores
    (results/, models/, checkpoints/, data/), and nothing tracked changed."""
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
    pages = {}
    for page, documented in documented_commands():
        if documented not in CANNOT_RUN_HERE:
            pages.setdefault(documented, []).append(page)
    env = script_env(copy)
    for documented in pages:
        if GPU_HOST and documented in NEEDS_NO_GPU:
            continue
        command = run_here(documented)
        plain = re.fullmatch(r"python (\S+\.py)((?: [\w@./=-]+)*)", command)  # no shell syntax: as bash would run it,
        if plain:  # forked from an interpreter that has the libraries loaded (conftest.run_script)
            proc = run_script(str(copy / plain.group(1)), *plain.group(2).split(), cwd=copy, timeout=300)
        else:
            proc = subprocess.run(["bash", "-c", command], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
        said = [line for line in proc.stderr.splitlines() if line.strip()]
        last = said[-1] if said else ""
        if documented in STOPS_HERE:  # its own line, its one error line, and exit 2
            errors = [line for line in said if ": error: " in line]
            assert proc.returncode == 2 and STOPS_HERE[documented] in last and errors == [last], (command, proc.returncode, said)
        elif proc.returncode == 6 and "no native bfloat16" in last:  # measured nothing: said on its pages
            for page in pages[documented]:
                text = " ".join((ROOT / ("README.md" if page == "README.md" else f"docs/{page}")).read_text().split())
                assert MEASURES_NOTHING in text, f"{page}: say that {documented} {MEASURES_NOTHING} (exit 6)"
        else:
            ended_well = proc.returncode == 0 or (command.startswith("diff ") and proc.returncode == 1)  # they differ
            assert ended_well and "Traceback" not in proc.stderr, (command, proc.returncode, proc.stderr[-2000:])
    changed = git("status", "--porcelain")
    assert changed == "", changed
    ignored = [line[3:] for line in git("status", "--porcelain", "--ignored").splitlines()
               if line.startswith("!!") and "__pycache__" not in line]
    assert ignored and all(path.split("/")[0] in ("results", "models", "checkpoints", "data") for path in ignored), ignored


@pytest.mark.slow
@pytest.mark.parametrize("mistake, said", [
    (("04_fabric-vit-mixed-precision.py,+ bf16-mixed,03,2,", "04_fabric-vit-mixed-precision.py,+ bf16-mixed,03,two,"),
     "(04_fabric-vit-mixed-precision.py): budget is 'two', not a whole number"),
    (("\n16_fabric-vit-cuda-graphs.py,", "\n16_fabric-vit-cuda-graphs.py,an extra field,"),
     "(16_fabric-vit-cuda-graphs.py): more fields than the header's"),
])
def test_figures_writes_every_page_or_none(tmp_path, mistake, said):
    """python tools/figures.py with a row of lessons.csv it cannot read: one line naming the row and what is
    wrong with it, exit 2, and no page written (the tables it makes are made before any page is)."""
    copy = tmp_path / "project"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", "results", "models", "checkpoints"))
    pages = {page: page.read_bytes() for page in [copy / "README.md", *(copy / "docs").glob("*.md")]}
    for page in pages:  # each table out of date, so a page would be written if any were
        page.write_text(re.sub(r"(<!-- figures: [\w-]+ -->\n).*?(<!-- end of figures -->)", r"\1stale\n\2",
                               page.read_text(), flags=re.S))
    stale = {page: page.read_bytes() for page in pages}
    old, new = mistake
    text = (copy / "lessons.csv").read_text()
    assert old in text
    (copy / "lessons.csv").write_text(text.replace(old, new, 1))
    proc = subprocess.run([sys.executable, "tools/figures.py"], cwd=copy, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and said in lines[0] and "lessons.csv line " in lines[0], proc.stderr
    assert lines[0].endswith("no page was written") and all(page.read_bytes() == stale[page] for page in pages)
