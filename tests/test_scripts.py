"""Every numbered script's --smoke run end to end, and the lesson read from the scripts' source:
the diff budgets, each changed line marked, the talk's settings, no hidden extras."""
import ast
import json
import math
import os
import re
import subprocess
import sys
import time
import types
import typing

import pytest

from conftest import native_bf16, parse_as, read_records, ROOT, run_script, SAID, SCRIPTS, script_env, warm_starts
from run_keeping.config import SMOKE_EPOCHS
from run_keeping.device import precision_that_runs
from run_keeping.reading import lessons
from run_keeping.reading import read_runs
from run_keeping.reading import REQUIRED, Record
from run_keeping.record import VERSION

TYPES = typing.get_type_hints(Record)


def of_type(value, kind):
    """Whether a value read from JSON is of the schema's type (an int where a float is declared
    too: the numeric tower, as type checkers take it)."""
    if isinstance(kind, types.UnionType):
        return any(of_type(value, k) for k in typing.get_args(kind))
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(of_type(v, typing.get_args(kind)[0]) for v in value)
    if typing.get_origin(kind) is dict:
        key, item = typing.get_args(kind)
        return isinstance(value, dict) and all(of_type(k, key) and of_type(v, item) for k, v in value.items())
    if kind in (int, float):
        return isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def test_a_record_of_an_earlier_version_reads_as_this_one():
    """reference/smoke-runs.jsonl was written before record_version: it reads as this version,
    with its compile mode from "compiled", None for what it did not record and its own fields kept
    ("steps" renamed batches_loaded); and a value of a wrong type is told apart."""
    old = read_runs(ROOT / "reference" / "smoke-runs.jsonl")
    raw = [json.loads(line) for line in (ROOT / "reference" / "smoke-runs.jsonl").read_text().splitlines()]
    assert all(r["record_version"] == VERSION and set(REQUIRED) <= r.keys() and "steps" not in r for r in old)
    assert [r["batches_loaded"] for r in old] == [r["steps"] for r in raw]
    assert {r["compile_mode"] for r in old if r["compiled"]} == {"default"}
    assert {r["compile_mode"] for r in old if not r["compiled"]} == {None}
    assert all(r["busy"] is None and r["lr"] == raw_r["lr"] for r, raw_r in zip(old, raw))
    assert not of_type("1.5", TYPES["train_time_s"]) and not of_type(True, TYPES["devices"])
    assert of_type(None, TYPES["test_acc"]) and not of_type(None, TYPES["devices"])

FABRIC_SCRIPTS = [s for s in SCRIPTS if "fabric" in s]
ROWS = lessons()
BF16_TRUE = [s for s in SCRIPTS if SAID[s]["precision"] == "bf16-true"]
ACCUMULATING = [s for s in SCRIPTS if "micro_batches=" in (ROOT / s).read_text()]  # their parse_args says so
BATCH_LINE = re.compile(r"^Epoch: \d{4}/\d{4} \| Batch \d{4}/\d{4} \| Loss: \d+\.\d{4}$", re.M)
EPOCH_LINE = re.compile(r"^Epoch: \d{4}/\d{4} \| Train acc\.: \d+\.\d{2}% \| Val acc\.: \d+\.\d{2}%$",
                        re.M)
# A smoke run is small: this catches one that is not (a full-size run takes hours on a CPU), with
# room for a loaded 2-core machine (01 --smoke: 7 s alone, 61 s beside a second test suite).
# A lesson that compiles (40-60 s with a cold cache), starts 2 processes, or takes 4 times the steps
# (micro-batches of 4: about 35 s alone) has 240 s.
WALL_LIMIT_S = {s: 240 for s in SCRIPTS if SAID[s]["compile_mode"] or ROWS[s]["devices"] > 1 or s in ACCUMULATING}


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_run_learns_and_records(smoke_runs, script):
    run = smoke_runs(script)
    out, record = run.out, run.record
    random_init = "random init" in ROWS[script]["technique"]  # its row: 00
    assert list(record) == REQUIRED and not [f for f, v in record.items() if not of_type(v, TYPES[f])]
    assert record["script"] == script and record["kind"] == "smoke"
    assert record["accelerator"] == "cpu" and record["device_name"].startswith("CPU")
    assert record["test_acc"] >= (0.75 if random_init else 0.85)  # random init: lower
    epochs = len(record["train_loss"])
    assert len(record["val_acc"]) == len(record["lr"]) == epochs == SMOKE_EPOCHS.get(ROWS[script]["epochs"], 2)
    assert record["train_loss"][-1] < record["train_loss"][0]
    assert record["peak_memory_gb"] > 0 and record["images_per_s"] > 0
    assert 0 < record["train_time_s"] < run.wall_s
    # the talk's log lines, once per epoch each (the smoke epoch has under 300 batches)
    assert len(BATCH_LINE.findall(out)) == epochs
    assert len(EPOCH_LINE.findall(out)) == epochs
    assert re.search(r"^Time elapsed \d+\.\d{2} min$", out, re.M)
    assert re.search(r"^Memory used: \d+\.\d{2} GB$", out, re.M)
    assert f"Test accuracy {record['test_acc'] * 100:.2f}%" in out
    # a busy machine shows (the record keeps 2 decimals, the line 1: compare the numbers)
    throughput = re.search(r"^Throughput (\d+\.\d) training images/s$", out, re.M)
    assert throughput and abs(float(throughput[1]) - record["images_per_s"]) <= 0.055 + 1e-9  # 0.05 + 0.005
    assert record["kind"] == "smoke"
    init = "random init" if random_init else "pretrained on printed digits, smoke_weights/smoke-vit-printed-digits.pt"
    # a smoke run says so in its first lines and its last, and the last names the model file
    lines = [line for line in out.splitlines() if line.strip()]
    before_training = lines[:next(i for i, line in enumerate(lines) if line.startswith("Epoch:"))]
    assert any(line.startswith("SMOKE RUN on CPU") and init in line
               for line in before_training), before_training
    # rank 0's last line (another process sharing the terminal may print after it)
    last = [i for i, line in enumerate(lines) if line.startswith("Run record appended")]
    assert len(last) == 1 and last[0] >= len(lines) - 3, lines[-4:]
    assert lines[last[0] - 1].startswith("SMOKE RUN on CPU") and "8x8 handwritten digits" in lines[last[0] - 1]
    assert record["model_file"] in lines[last[0]] and (run.dir / record["model_file"]).exists()
    assert run.wall_s <= WALL_LIMIT_S.get(script, 120), f"took {run.wall_s:.0f} s"


@pytest.mark.slow
def test_a_run_that_shares_the_cpu_says_so(tmp_path):
    """Programs spinning on the cores beside a run (on purpose): its last lines and its record say
    it waited for a core (run_keeping/keeper.py: BUSY_WAIT), so its time is not taken for a
    quiet machine's. Each spinner has a session of its own, as a program started from another
    terminal has: Linux shares the cores among sessions (autogroup), so twice as many spinners as
    cores leave the run's session a fifth of 2 cores (measured: 60% of its time waiting)."""
    spin = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 120\n"
                              "while time.time() < end: pass"], start_new_session=True)
            for _ in range(2 * (os.cpu_count() or 2))]
    try:
        proc = run_script("04_fabric-vit-mixed-precision.py", "--smoke", "--max-steps", "40", cwd=tmp_path)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = read_records(tmp_path / "results" / "runs.jsonl")[-1]
    last = proc.stdout.strip().splitlines()[-7:]
    busy = [line for line in last if line.startswith("BUSY: this run waited for a CPU core ")]
    assert record["busy"] is True and len(busy) == 1, last
    assert int(busy[0].split("core ")[1].split("%")[0]) > 25 and busy[0].endswith("its time and throughput are not comparable")


def test_a_sleeping_thread_does_not_wait_for_a_core():
    """The measure's idle side: half a second asleep (not ready to run) counts neither as running
    nor as waiting for a core, however busy the machine (a wake-up waits some milliseconds at most)."""
    from run_keeping.keeper import cpu_times
    since = cpu_times()
    time.sleep(0.5)
    now = cpu_times()
    if since is None:
        pytest.skip("this kernel does not say how long a thread waited (not Linux)")
    ran, waited = now[0] - since[0], now[1] - since[1]
    assert ran < 0.1 and waited < 0.1, (ran, waited)


# Fabric's save (what a checkpoint of 04 is written with) 6 s slower: a library's, so that the hook works in a
# fresh interpreter too, whose sitecustomize cannot import the project (its folder is not on sys.path yet)
SLOW_CHECKPOINTS = """
import time
from lightning.fabric import Fabric
save = Fabric.save
def slow_save(self, *args, **kwargs):
    time.sleep(6)
    return save(self, *args, **kwargs)
Fabric.save = slow_save
"""


@pytest.mark.slow
def test_the_printed_time_leaves_out_the_checkpoint_writes(tmp_path):
    """"Time elapsed" and train_time_s are the talk's: training with its per-epoch validation.
    Each of the 2 checkpoint writes is made 6 s slower here: the closing lines count them apart,
    and not in the time (2 epochs of 2 steps take well under the 12 s they would add)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_CHECKPOINTS)
    env = script_env(tmp_path, PYTHONPATH=str(site))
    proc = run_script("04_fabric-vit-mixed-precision.py", "--smoke", "--max-steps", "2", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = read_records(tmp_path / "results" / "runs.jsonl")[-1]
    written = re.search(r"^Checkpoints: 2 written in (\d+\.\d) s, not in the time above$", proc.stdout, re.M)
    assert written and float(written[1]) >= 12, proc.stdout[-2000:]
    assert record["train_time_s"] < 6
    assert f"Time elapsed {record['train_time_s'] / 60:.2f} min" in proc.stdout


@pytest.mark.slow
def test_records_say_what_ran(smoke_runs):
    """Each record's precision is what ran: what the lesson's Fabric(...) asks for, or, on a CPU
    without native bfloat16, its fallback, with what it asked; and its processes."""
    from run_keeping.reading import lessons
    rows = lessons()
    for script in SCRIPTS:
        record, row = smoke_runs(script).record, rows[script]
        asked = SAID[script]["precision"]
        ran = precision_that_runs(asked, "cpu") if not native_bf16() else asked
        assert (record["precision"], record["precision_asked"]) == (ran, asked), script
        assert record["world_size"] == (2 if row["devices"] > 1 else 1), script  # --smoke on a CPU: 2 processes


@pytest.mark.slow
def test_the_schedule_multiplies_the_learning_rate_by_0_9_each_epoch(smoke_runs):
    record = smoke_runs("07_fabric-vit-mixed-fsdp-with-scheduler.py").record
    epochs = len(record["train_loss"])
    assert record["lr"] == pytest.approx([5e-5 * 0.9 ** k for k in range(epochs)], rel=1e-9)
    assert smoke_runs("06_fabric-vit-mixed-fsdp.py").record["lr"] == [5e-5] * epochs


@pytest.mark.slow
def test_the_cosine_schedule_counts_optimizer_steps(smoke_runs):
    """14's CosineAnnealingLR falls over the optimizer steps, one per 4 micro-batches (the sequel's
    T_max counted batches, so its schedule had hardly begun to fall when it ended): half-way down
    after one of two epochs."""
    run = smoke_runs("14_fabric-vit-sgd-cosine.py")
    record = run.record
    micro_batches = int(run.out.split("Batch 0000/")[1][:4])  # an epoch's
    # 4 micro-batches a step; an epoch's last micro-batches short of a whole step are loaded, not stepped
    steps_per_epoch, epochs = micro_batches // 4, len(record["train_loss"])
    total = epochs * steps_per_epoch
    expected = [0.01 * (1 + math.cos(math.pi * k * steps_per_epoch / total)) / 2 for k in range(epochs)]
    assert record["lr"] == pytest.approx(expected, rel=1e-6)
    assert record["lr"][-1] <= 0.0051


def optimizer_references(source):
    """(optimizer, line number) for each torch.optim optimizer the code names, called or not (not in its
    comments): `torch.optim.Adam(...)`, each of the choices a flag picks from (a dict of them, a
    conditional), or a name imported from torch.optim."""
    import torch
    tree = ast.parse(source)
    imported = {alias.asname or alias.name: alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "torch.optim" for alias in node.names}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("torch.optim", "optim"):
            found.append((node.attr, node.lineno))
        elif isinstance(node, ast.Name) and node.id in imported:
            found.append((imported[node.id], node.lineno))
    def an_optimizer(name):
        kind = getattr(torch.optim, name, None)
        return isinstance(kind, type) and issubclass(kind, torch.optim.Optimizer)
    return sorted((name, line) for name, line in found if an_optimizer(name))


def test_lessons_csv_names_each_lessons_optimizer_and_checkpointing():
    """What the memory arithmetic and the bare loop take from lessons.csv is what each script does:
    the optimizer it makes (where a flag chooses, one of its choices: the one its measured_with
    flags choose, docs/adding-a-lesson.md), whether it checkpoints activations, and (15) whether it
    offloads."""
    from run_keeping.reading import lessons
    for script, row in lessons().items():
        if not row["against"] and not script.startswith("00"):
            continue  # 08 trains nothing; 09, a recipe of its own: test_fast_recipe.py
        source = (ROOT / script).read_text()
        named = {name for name, _ in optimizer_references(source)}
        assert row["optimizer"] in named, (
            f"{script}: lessons.csv's optimizer column says {row['optimizer']}, and the script names "
            f"{', '.join(sorted(named)) or 'no torch.optim optimizer'}: write torch.optim.{row['optimizer']} out in it "
            "(a flag may choose among several written out), or name in the row the one its measured_with flags choose")
        assert bool(row["activation_checkpointing"]) == ("apply_activation_checkpointing(" in source), script
        assert ("offload" in row["strategy"]) == ("offloaded" in source), script


@pytest.mark.slow
def test_a_cpu_run_of_cuda_graphs_says_it_has_none(smoke_runs):
    """A lesson that compiles with mode="reduce-overhead" (CUDA graphs) says, run on a CPU, that the CPU
    has no CUDA graphs and what runs instead, before training; its record gives the mode."""
    graphs = [s for s, said in SAID.items() if said["compile_mode"] == "reduce-overhead"]
    assert graphs
    for script in graphs:
        run = smoke_runs(script)
        before = run.out.split("Epoch: 0001")[0]
        assert "A CPU has no CUDA graphs: here the model is only compiled." in before, script
        assert run.record["compile_mode"] == "reduce-overhead", script


@pytest.mark.slow
def test_records_name_the_micro_batches(smoke_runs):
    assert [smoke_runs(s).record["micro_batches"] for s in SCRIPTS] == [4 if s in ACCUMULATING else 1 for s in SCRIPTS]


@pytest.mark.slow
@pytest.mark.parametrize("script", FABRIC_SCRIPTS)
def test_only_rank_zero_prints_the_training_lines(smoke_runs, script):
    """Fabric scripts print through fabric.print: once per machine (06 runs as two torchrun
    'nodes', so each node's output has each line once); the Fabric launcher's 2 processes on
    one machine print each line once in all."""
    run = smoke_runs(script)
    epochs = len(run.record["train_loss"])
    for output in run.outputs:
        assert output.count("Train acc.:") == epochs
        assert output.count("Python implementation") == 1  # the watermark block too
        assert output.count("Test accuracy") == (1 if output is run.outputs[0] else 0)


def changed_lines(a, b):
    out = subprocess.run(["diff", str(ROOT / a), str(ROOT / b)], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line[:1] in "<>"]


def chain():
    """(the script a lesson is a diff against, the lesson, its budget), from lessons.csv."""
    from run_keeping.reading import lessons
    rows = lessons()
    names = {script[:2]: script for script in rows}
    return [(names[row["against"]], script, row["budget"]) for script, row in rows.items() if row["against"]]


CHAIN = chain()


@pytest.mark.parametrize("a, b, budget", CHAIN)
def test_the_diff_is_the_lesson(a, b, budget):
    changed = len(changed_lines(a, b))
    assert 0 < changed <= budget, (f"{b}: {changed} changed lines against {a}, over its budget of {budget} (its row's "
                                   "budget in lessons.csv): change only the technique's lines, or, where the technique "
                                   "needs more, raise the row's budget (docs/adding-a-lesson.md)")


# A tag names the lesson that made the change it marks: `# [03] instead of loss.backward()`,
# `# [04] new: mixed precision`. A later script keeps the line as it is (its diff budget counts
# every changed line), and with it the tag, which still says which lesson changed it.
TAG = re.compile(r"#\s*\[(\d\d)\]\s+(?:new\b|instead of\b)")
AGAINST = {b[:2]: a for a, b, _ in CHAIN}
ROOT_BEFORE = ROOT  # the checkout's, for the test that points ROOT elsewhere


def diff_sides(a, b):
    """(the line numbers of b that `diff a b` shows as new, the stripped lines it shows as old)."""
    out = subprocess.run(["diff", str(ROOT / a), str(ROOT / b)], capture_output=True, text=True).stdout
    new, old = set(), set()
    for header in re.finditer(r"^(\d+)(?:,(\d+))?([acd])(\d+)(?:,(\d+))?$", out, re.M):
        if header[3] != "d":
            new.update(range(int(header[4]), int(header[5] or header[4]) + 1))
    old = {line[2:].strip() for line in out.splitlines() if line.startswith("< ")}
    return new, old


def own_tag_problems(a, b):
    """Where b's own tags ([NN], b's number) and its changed lines disagree: a changed line with no
    tag of b's, or a tag of b's on a line b did not change. A changed line needs no tag of its
    own where it continues a statement whose changed first line has one, or where it is a line of
    a's moved into a block whose changed header has one (re-indented, as under a new `with`)."""
    lines = (ROOT / b).read_text().splitlines()
    new, old = diff_sides(a, b)
    mine = {n for n, line in enumerate(lines, 1) if b[:2] in TAG.findall(line)}
    statements = [node for node in ast.walk(ast.parse("\n".join(lines))) if isinstance(node, ast.stmt)]
    problems = [f"{b}:{n}: a tag of {b[:2]} on a line it does not change" for n in sorted(mine - new)]
    for n in sorted(new - mine):
        if not lines[n - 1].strip():
            continue
        inner = max((s for s in statements if s.lineno <= n <= s.end_lineno), key=lambda s: s.lineno)
        if inner.lineno < n and inner.lineno in mine & new:
            continue  # a continuation line of a tagged change
        header = next((h for h in range(n - 1, 0, -1) if len(lines[h - 1]) - len(lines[h - 1].lstrip())
                       < len(lines[n - 1]) - len(lines[n - 1].lstrip()) and lines[h - 1].strip()), None)
        if lines[n - 1].strip() in old and header in mine & new:
            continue  # an unchanged line, moved into the tagged block
        problems.append(f"{b}:{n}: changed, with no tag of {b[:2]}: {lines[n - 1].strip()}")
    return problems


@pytest.mark.parametrize("a, b, budget", CHAIN)
def test_each_changed_line_is_tagged_and_no_unchanged_one(a, b, budget):
    """Both ways: each line b changes carries b's tag, and no line b leaves as it was does."""
    problems = own_tag_problems(a, b)
    assert not problems, "\n".join(problems + [f"end each line {b[:2]} changes with # [{b[:2]}] new: ... or "
                                                f"# [{b[:2]}] instead of ...: (docs/adding-a-lesson.md)"])


@pytest.mark.parametrize("script", sorted(p.name for p in ROOT.glob("[0-9][0-9]_*.py")))
def test_every_inherited_tag_is_its_lessons_own(script):
    """A tag of another lesson is that lesson's: an earlier lesson of this one's chain, which
    changed that line (as it stands here) and tagged it. Scripts outside the chain (08, 09)
    carry none."""
    ancestors, number = [], script[:2]
    while number in AGAINST:
        number = AGAINST[number][:2]
        ancestors.append(number)
    names = {p.name[:2]: p.name for p in ROOT.glob("[0-9][0-9]_*.py")}
    for n, line in enumerate((ROOT / script).read_text().splitlines(), 1):
        for tag in set(TAG.findall(line)) - {script[:2]}:
            assert tag in ancestors, f"{script}:{n}: a tag of {tag}, which is not a lesson before it"
            theirs = (ROOT / names[tag]).read_text().splitlines()
            new, _ = diff_sides(AGAINST[tag], names[tag])
            assert any(theirs[k - 1].strip() == line.strip() for k in new), \
                f"{script}:{n}: a tag of {tag} on a line {tag} did not change so: {line.strip()}"
    if script[:2] not in AGAINST and script[:2] != "00":
        assert not TAG.search((ROOT / script).read_text()) and "# instead of" not in (ROOT / script).read_text()


def test_the_tag_checker_finds_both_kinds_of_stale_tag(tmp_path, monkeypatch):
    """The checker above, on a lesson made wrong both ways: 04 with a line changed but untagged
    (its precision's tag taken off), and with a tag of its own on a line it does not change."""
    for name in ("03_fabric-vit.py", "04_fabric-vit-mixed-precision.py"):
        (tmp_path / name).write_text((ROOT_BEFORE / name).read_text())
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    four = tmp_path / "04_fabric-vit-mixed-precision.py"
    text = four.read_text()
    untagged = re.sub(r'(precision="bf16-mixed",)\s*#.*', r"\1", text)
    four.write_text(untagged)
    assert any("changed, with no tag of 04" in p for p in own_tag_problems("03_fabric-vit.py", four.name))
    for name in ("03_fabric-vit.py", four.name):  # 04's tag in both: on a line 04 does not change
        path = tmp_path / name
        path.write_text(path.read_text().replace("optimizer.step()\n", "optimizer.step()  # [04] new: stale\n", 1))
    assert any("a tag of 04 on a line it does not change" in p for p in own_tag_problems("03_fabric-vit.py", four.name))
    for name in ("03_fabric-vit.py", four.name):
        (tmp_path / name).write_text((ROOT_BEFORE / name).read_text())
    assert not own_tag_problems("03_fabric-vit.py", four.name)


def calls(script, name):
    """The keyword and positional arguments of every call of `name` (a function or a method)
    in a script's source."""
    found = []
    for node in ast.walk(ast.parse((ROOT / script).read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == name:
                found.append(({k.arg: ast.literal_eval(k.value) for k in node.keywords
                               if isinstance(k.value, ast.Constant)}, node))
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_talks_weights_epochs_batch_and_learning_rate(script):
    (parse_kwargs, _), = calls(script, "lesson_parser")
    (vit_kwargs, _), = calls(script, "build_vit")
    row = lessons()[script]
    assert parse_kwargs["epochs"] == row["epochs"]
    assert vit_kwargs["weights"] == (None if "random init" in row["technique"] else "IMAGENET1K_V1")
    assert parse_kwargs.get("devices", 1) == lessons()[script]["devices"]
    assert parse_as(script, "--smoke").micro_batches == (4 if script in ACCUMULATING else 1)
    # the optimizer its row names, made once, and no other but the choices of a flag on that same line; its
    # line (with its learning rate) is the talk's, kept from the script it is the diff against, or one this
    # lesson changed and tagged
    named = optimizer_references((ROOT / script).read_text())
    assert [name for name, _ in named].count(row["optimizer"]) == 1, (script, row["optimizer"], named)
    line = optimizer_line(script, row["optimizer"])
    assert {number for _, number in named} == {number for name, number in named if name == row["optimizer"]}, (
        f"{script}: a lesson makes one optimizer, on one line: where a flag chooses it, each choice is written "
        f"out on that line (a dict of choices or a conditional expression); it names {named}")
    if row["against"]:
        against = next(s for s in lessons() if s.startswith(row["against"]))
        kept = line == optimizer_line(against, lessons()[against]["optimizer"])
        assert kept or f"# [{script[:2]}] instead of" in line, f"{script}: {line}"
    else:
        assert line.startswith("optimizer = torch.optim.Adam(model.parameters(), lr=5e-5)"), line  # the talk's


def optimizer_line(script, optimizer):
    """The line that makes the optimizer (where a flag chooses, the line that writes each choice out)."""
    number = next(number for name, number in optimizer_references((ROOT / script).read_text()) if name == optimizer)
    return (ROOT / script).read_text().splitlines()[number - 1].strip()


@pytest.mark.parametrize("script", ACCUMULATING)
def test_accumulation_steps_after_the_4th_micro_batch_of_4(script):
    """4 micro-batches make the batch: zeroed before the 1st, stepped after the 4th (the sequel
    stepped after batch 0), each loss a quarter, gradients synced only at the step."""
    source, step = (ROOT / script).read_text(), "if batch_idx % MICRO_BATCHES == MICRO_BATCHES - 1: optimizer.step()"
    assert "\nMICRO_BATCHES = 4  # [12] new" in source and "parser.set_defaults(micro_batches=MICRO_BATCHES)" in source
    assert "if batch_idx % MICRO_BATCHES == 0: optimizer.zero_grad()" in source
    assert ("with fabric.no_backward_sync(model, enabled=batch_idx % MICRO_BATCHES != MICRO_BATCHES - 1): "
            "fabric.backward(loss / MICRO_BATCHES)") in source
    assert step in source and "optimizer.step()" not in source.replace(step, "")


@pytest.mark.parametrize("script", FABRIC_SCRIPTS)
def test_fabric_scripts_call_fabric_backward(script):
    source = (ROOT / script).read_text()
    assert len(calls(script, "backward")) == 1 and "fabric.backward(loss)" in source
    assert "loss.backward()" not in source.replace("# [03] instead of loss.backward()", "")


@pytest.mark.parametrize("script", FABRIC_SCRIPTS)
def test_the_talks_precision_line(script):
    """The precision the run reads from the script (read_script) is its line in the talk's words
    (precision="bf16-mixed"), or 32-true where it has none; a bf16-true lesson makes its model in
    bfloat16 (under fabric.init_module)."""
    source, precision = (ROOT / script).read_text(), SAID[script]["precision"]
    if precision == "32-true":
        assert "precision=" not in source
    else:
        assert len(re.findall(rf'^            precision="{precision}",  # \[\d\d\] ', source, re.M)) == 1, script
    assert ("    with fabric.init_module():  # [" in source) == (precision == "bf16-true"), script


def test_no_tf32_switch_anywhere():
    """One change per step: nothing in the project switches TF32 on behind the lesson's back."""
    for path in [*ROOT.glob("*.py"), *ROOT.glob("*.sh")]:
        text = path.read_text()
        assert "set_float32_matmul_precision" not in text and "allow_tf32" not in text, path.name


def test_a_lessons_own_tags_are_those_of_its_highest_number(tmp_path):
    """The tagged lines --help opens with are the highest number's, compared as numbers (a lesson 100 tags after
    99), under a heading that names that number; a bare "[100] new" says nothing and is left out."""
    from run_keeping.config import own_tags, read_script

    text = "x = 1  # [99] instead of y: the old way\nz = 2  # [100] new: the third way\nw = 3  # [100] new\n"
    assert own_tags(text) == ["[100] new: the third way."]
    lesson = tmp_path / "100_your-lesson.py"
    lesson.write_text(text)
    said = read_script(lesson)["description"]
    assert said.startswith("100_your-lesson.py: its own changes, the lines tagged [100]:\n  - [100] new: the"), said


@pytest.mark.slow
def test_help_opens_with_the_scripts_own_technique(tmp_path):
    """--help of each script: its own flags and defaults; it opens with the lines the script changed against
    the one before (those tagged with its own number), a line each, then its docstring's first paragraph."""
    code = ("import runpy, sys\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "for script in sys.argv[1:]:\n"
            "    sys.argv = [script, '--help']\n"
            "    try:\n        runpy.run_path(script, run_name='__main__')\n"
            "    except SystemExit:\n        pass\n")
    scripts = [*SCRIPTS, "09_fabric-vit-fast.py"]
    proc = subprocess.run([sys.executable, "-c", code, *[str(ROOT / s) for s in scripts]],
                          cwd=tmp_path, env=script_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    helps = proc.stdout.split("usage: ")[1:]
    assert len(helps) == len(scripts), proc.stderr[-2000:]
    text = dict(zip(scripts, helps))
    # each help is generated from what its script does: its own flags, its own defaults
    flag = {script: {name for name in re.findall(r"--[a-z-]+", h)} for script, h in text.items()}
    assert [s for s in scripts if "--tensor-parallel" in flag[s]] == ["10_fabric-vit-tensor-parallel.py"]
    assert [s for s in scripts if "--compile-on-cpu" in flag[s]] == ["09_fabric-vit-fast.py"]
    assert "--num-workers" not in flag["09_fabric-vit-fast.py"] and "--num-workers" in flag[SCRIPTS[4]]
    devices = {s: " ".join(h.split("--devices N")[-1].split("--num-nodes")[0].split())
               for s, h in text.items() if "--devices" in flag[s]}
    assert devices["09_fabric-vit-fast.py"] == "processes (GPUs) per machine (default 1)"
    assert devices["05_fabric-vit-mixed-ddp.py"].endswith("(default 4; --smoke on a CPU: 2)")
    assert not any("02 spends" in h or "40 s" in h for h in helps)
    openings = []
    for script, text in zip(scripts[:-1], helps):
        opening = text.split("\n\n")[1]
        if script.startswith("00"):  # 00 is the starting point: no line of its own, its docstring
            assert opening.startswith("One chapter of the CVPR 2023 talk"), opening
        else:  # a heading, then each of its tagged changes on a line of its own
            heading, *changes = opening.splitlines()
            assert heading == f"{script}: its own changes, the lines tagged [{script[:2]}]:", heading
            assert changes and all(line.startswith(("  - [", "    ")) for line in changes), opening
        openings.append(" ".join(opening.split()))
    assert len(set(openings)) == len(SCRIPTS)
    assert helps[-1].split("\n\n")[1].startswith("09, the fast recipe")
    said = dict(zip(scripts, openings))
    assert "ImageNet-pretrained" in said["01_pytorch-vit.py"] and "compiled" in said["02_pytorch-vit-compile.py"]
    assert "mixed precision" in said["04_fabric-vit-mixed-precision.py"] and "distributed data parallel" in said["05_fabric-vit-mixed-ddp.py"]
    assert "learning rate times 0.9" in said["07_fabric-vit-mixed-fsdp-with-scheduler.py"]


def test_the_shared_fixture_fails_on_a_process_killed_by_a_signal():
    """A process killed by a signal has a negative exit code: it fails, with its output."""
    from conftest import check_ok
    killed = subprocess.Popen([sys.executable, "-c", "import os, signal; print('last words', "
                               "flush=True); os.kill(os.getpid(), signal.SIGKILL)"],
                              stdout=subprocess.PIPE, text=True)
    fine = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, text=True)
    outputs = [p.communicate()[0] for p in (killed, fine)]
    with pytest.raises(pytest.fail.Exception) as failure:
        check_ok([killed, fine], outputs, "a run")
    assert "exit codes [-9, 0]" in str(failure.value) and "last words" in str(failure.value)


# The lines a forked run prints otherwise: its times and speed, which the machine's load moves, and
# its peak memory, which counts only the pages of the libraries' files that the process itself
# touches (a fresh one reads them all in as it loads; 0.92 against 0.61 GB for 01 here)
# What a run measures, whole lines: a BUSY line, said where another program used the cores, is one of them
MEASURED = re.compile(r"^(Time elapsed|Memory used:|Throughput|Checkpoints:|BUSY:) .*\n", re.M)


AS_SLURM_STARTS_IT = """
import os, sys, tempfile
print("torch" in sys.modules, tempfile.gettempdir(), os.environ["SLURM_PROCID"])
"""


@pytest.mark.slow
def test_a_task_slurm_starts_is_a_copy_that_reads_its_own_tmpdir(tmp_path):
    """A `python` in what SLURM sets for a task (its SLURM_* variables, its own TMPDIR): a warm copy (the libraries
    imported before the script's first line), whose temporary folder is the task's, as a fresh interpreter's is."""
    (tmp_path / "task.py").write_text(AS_SLURM_STARTS_IT)
    (tmp_path / "job-tmp").mkdir()
    assert warm_starts().ready()
    env = script_env(tmp_path, TMPDIR=str(tmp_path / "job-tmp"), SLURM_PROCID="1", SLURM_JOB_ID="7",
                     ENVIRONMENT="BATCH", HOSTNAME="node1")
    proc = subprocess.run(["python", str(tmp_path / "task.py")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", str(tmp_path / "job-tmp"), "1"], proc


AS_TORCHRUN_STARTS_IT = """
import os, sys
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torchmetrics.utilities import prints
print("torch" in sys.modules, sys.stdout.write_through, os.environ["RANK"], rank_zero_only.rank,
      prints.rank_zero_only.rank)
"""


@pytest.mark.slow
def test_a_worker_torchrun_starts_is_a_copy(tmp_path):
    """`python -u SCRIPT` (torchrun's command for a worker, with the tests' `python` as its PYTHON_EXEC) in what
    torchrun sets for a worker (its ranks, sizes and TORCHELASTIC_* settings): a warm copy, unbuffered as -u asks,
    whose rank Lightning and torchmetrics (which read it as they load) read again."""
    (tmp_path / "worker.py").write_text(AS_TORCHRUN_STARTS_IT)
    assert warm_starts().ready()
    python = str(ROOT / "tests" / "warm_python" / "python")
    ranks = dict(RANK="1", GROUP_RANK="0", ROLE_RANK="1", ROLE_NAME="default", LOCAL_WORLD_SIZE="2", WORLD_SIZE="2",
                 GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    env = script_env(tmp_path, PYTHON_EXEC=python, TORCHELASTIC_RUN_ID="none", TORCHELASTIC_RESTART_COUNT="0",
                     TORCH_NCCL_ASYNC_ERROR_HANDLING="1", **ranks)
    proc = subprocess.run([python, "-u", str(tmp_path / "worker.py")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True", "1", "1", "1"], proc


@pytest.mark.slow
def test_a_forked_run_is_a_fresh_ones_run(smoke_runs, tmp_path):
    """A script forked from the process that has loaded the libraries (start_script, run_script:
    warm_start.py) does what a fresh interpreter does: 03's smoke run forked prints what the
    suite's fresh one (conftest.YARDSTICK) printed, but for what it measures (MEASURED), and
    records the same figures and model file (one process, one thread: exact); a wrong flag is one
    line and exit 2; and at its time-out it is killed, as subprocess.run kills."""
    from conftest import YARDSTICK, descendants, finish, run_script, start, warm_starts
    from warm_start import Started
    fresh = smoke_runs(YARDSTICK)
    procs = start(YARDSTICK, "--smoke", cwd=tmp_path)
    assert isinstance(procs[0], Started)  # forked, not a fresh interpreter
    forked = finish(procs)[0]
    assert procs[0].returncode == 0, forked[-2000:]
    assert MEASURED.sub("", forked) == MEASURED.sub("", fresh.out)
    record = read_records(tmp_path / "results" / "runs.jsonl")[-1]
    for key in ("train_loss", "lr", "val_acc", "test_acc", "model_file", "torch", "lightning"):
        assert record[key] == fresh.record[key], key
    assert warm_starts().fits(script_env(tmp_path))  # the runs below are forked too
    wrong = run_script(YARDSTICK, "--smoke", "--epochs", "x", cwd=tmp_path)
    assert (wrong.returncode, wrong.stdout) == (2, "") and len(wrong.stderr.splitlines()) == 1
    assert wrong.stderr.startswith(f"{YARDSTICK}: error: argument --epochs: ")
    before = set(descendants(os.getpid()))
    with pytest.raises(subprocess.TimeoutExpired):
        run_script(YARDSTICK, "--smoke", cwd=tmp_path, timeout=2)
    deadline = time.monotonic() + 30  # the server reaps it, however loaded the machine
    while not set(descendants(os.getpid())) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(descendants(os.getpid())) <= before  # the server, started before, and nothing of the run


def test_an_environment_a_library_reads_as_it_loads_starts_fresh(tmp_path, monkeypatch):
    """What a fork cannot change: a run whose environment differs from the server's in what a
    library reads as it loads (oneDNN's ISA cap, glibc's thresholds, a PYTHONPATH where the server
    has one) is not forked, and no server is started for it; a run's own torch hub cache is, and
    what libraries called in this process add to its environment reaches no script (conftest.ENVIRON:
    had it, a server made before would fork no script after)."""
    from conftest import script_env
    from warm_start import WarmStarts
    starts = WarmStarts(script_env(tmp_path), str(tmp_path))
    # SSE41: a cap other than the suite's own where it runs capped at AVX2 (docs/tests.md)
    for extra in ({"ONEDNN_MAX_CPU_ISA": "SSE41"}, {"MALLOC_ARENA_MAX": "1"}, {"OMP_NUM_THREADS": "2"}):
        assert not starts.fits(script_env(tmp_path, **extra)), extra
    with_path = WarmStarts(script_env(tmp_path, PYTHONPATH="/a"), str(tmp_path))
    assert not with_path.fits(script_env(tmp_path, PYTHONPATH="/b"))
    assert starts.server is None and with_path.server is None
    starts.ready = lambda: True  # as if the server were up: the only difference is the hub cache
    monkeypatch.setenv("KMP_INIT_AT_FORK", "FALSE")  # as scikit-learn's OpenMP sets it in this process
    assert "KMP_INIT_AT_FORK" not in script_env(tmp_path) or "KMP_INIT_AT_FORK" in starts.env
    assert starts.fits(script_env(tmp_path / "elsewhere"))
    assert starts.fits(script_env(tmp_path, HOOK_A_NEW_TESTS_SETTING="1"))  # a hook's setting, whatever its name


@pytest.mark.slow
def test_where_the_server_cannot_start_every_script_starts_fresh(tmp_path):
    """A server that cannot listen (here: its socket's folder is missing) is said to have failed,
    and fits() answers no, so the script starts in a fresh interpreter instead."""
    from conftest import script_env
    from warm_start import WarmStarts
    starts = WarmStarts(script_env(tmp_path), str(tmp_path / "missing"))
    assert not starts.fits(script_env(tmp_path)) and starts.failed and starts.server is None


@pytest.mark.slow
def test_a_smoke_run_leaves_git_status_clean(smoke_runs):
    """Everything the README's first command writes (record, model, checkpoints while it runs)
    lies where the project's .gitignore ignores it."""
    run = smoke_runs("04_fabric-vit-mixed-precision.py")
    written = [str(p.relative_to(run.dir)) for p in run.dir.rglob("*") if p.is_file()]
    assert "models/04_fabric-vit-mixed-precision-smoke.pt" in written
    written.append("checkpoints/04_fabric-vit-mixed-precision-smoke/latest.json")
    proc = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching",
                           *written], cwd=ROOT, capture_output=True, text=True)
    assert not [line for line in proc.stdout.splitlines() if line.startswith("::")], proc.stdout


@pytest.mark.slow
def test_pretraining_beats_random_init_with_half_the_epochs(smoke_runs):
    """The talk's first lesson on a CPU: 01 (pretrained on printed digits) at least 3 points
    above 00 (random init) in test accuracy with at most half its epochs, and already ahead
    after its first epoch."""
    scratch = smoke_runs("00_pytorch-vit-random-init.py").record
    finetuned = smoke_runs("01_pytorch-vit.py").record
    assert 2 * len(finetuned["train_loss"]) <= len(scratch["train_loss"])
    assert finetuned["test_acc"] >= scratch["test_acc"] + 0.03
    assert finetuned["val_acc"][0] > scratch["val_acc"][0] + 0.03


@pytest.mark.slow
def test_the_shared_fixture_fails_on_a_hang_with_the_output():
    """A run that hangs is killed at the time-out and fails with what it printed (06's two
    torchrun nodes once hung this way), instead of an exception without its output."""
    from conftest import finish
    hung = subprocess.Popen([sys.executable, "-c", "print('started', flush=True); import time; "
                             "time.sleep(120)"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    with pytest.raises(pytest.fail.Exception) as failure:
        finish([hung], timeout=3)
    assert "timed out after 3 s" in str(failure.value) and "started" in str(failure.value)
    assert hung.poll() is not None  # killed, not left running


def test_a_pytest_a_test_starts_shares_no_folder_with_other_runs(tmp_path_factory, monkeypatch):
    """Whether a pytest process is an xdist worker (whose shared runs sit beside the other workers') is its config's:
    a pytest that a test starts with -n 0 inherits the worker's PYTEST_XDIST_WORKER, and read from the environment
    it would keep its shared runs where every later test run on the machine finds them."""
    from conftest import shared_folder
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    assert shared_folder(tmp_path_factory, types.SimpleNamespace()) == tmp_path_factory.getbasetemp()


def test_a_shared_run_is_made_once_and_its_failure_kept(once_per_run, tmp_path):
    """conftest.once_per_run: a result is made once and read back; a make that fails fails every
    test that asks, with its message, and is not made again."""
    made = []

    def broken(folder):
        made.append(folder)
        pytest.fail("broken on purpose", pytrace=False)
    for _ in range(2):
        with pytest.raises(pytest.fail.Exception) as failure:
            once_per_run(f"broken-{tmp_path.name}", broken)
        assert "broken on purpose" in str(failure.value)
    assert len(made) == 1

    def fine(folder):
        made.append(folder)
        return {"made": len(made)}
    assert [once_per_run(f"fine-{tmp_path.name}", fine) for _ in range(2)] == [{"made": 2}] * 2
    assert len(made) == 2
