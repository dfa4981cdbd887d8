"""Every effect a run has on its process has one owner, RunKeeper (docs/run-keeping.md, "One owner"): the interpreter
(Ctrl-C's and SIGTERM's handlers, the environment, the exit handlers, the warnings filters, torch's threads, default
dtype and matrix precision) is as found around every lesson's refused parse, and around its refused, interrupted and
finished runs, each run in this process as IPython's %run and a notebook run it; and Ctrl-C at any line a run prints
is one line and 130, nothing held, nothing left changed. (A lesson whose strategy runs processes is refused at a
prompt; run otherwise, its processes end as the run does: docs/run-keeping.md, "The end of a run of processes".)"""
import atexit
import io
import json
import os
import runpy
import signal
import sys
import warnings

import pytest
import torch

from conftest import ROOT, parse_as
from run_keeping.reading import lessons

TRAINING = [script for script, row in lessons().items() if row["epochs"]]  # all but 08
ONE_PROCESS = [script for script in TRAINING if lessons()[script]["devices"] == 1]
SHORT = ["--smoke", "--epochs", "1", "--max-steps", "1"]


class Escaped(Exception):
    """A signal that reached the test's own handler: the run did not own it."""


def escaped(signum, frame):
    raise Escaped(signal.Signals(signum).name)


def interpreter():
    """What a run may change in the process, as a comparable whole."""
    return {"SIGINT": signal.getsignal(signal.SIGINT), "SIGTERM": signal.getsignal(signal.SIGTERM),
            "environment": dict(os.environ), "exit handlers": atexit._ncallbacks(),  # CPython's count of them
            "warnings filters": list(warnings.filters), "threads": torch.get_num_threads(),
            "default dtype": torch.get_default_dtype(), "matmul precision": torch.get_float32_matmul_precision()}


class Printed(io.TextIOBase):
    """sys.stdout or sys.stderr, its lines counted with the other's; at line `stop_at`, Ctrl-C to this process."""

    def __init__(self, lines, stop_at):
        self.lines, self.stop_at = lines, stop_at

    def write(self, text):
        for piece in text.splitlines(keepends=True):
            self.lines[-1] += piece
            if piece.endswith("\n"):
                self.lines.append("")
                if len(self.lines) - 1 == self.stop_at:
                    os.kill(os.getpid(), signal.SIGINT)
        return len(text)


def run_here(script, *flags, stop_at=None):
    """`python SCRIPT FLAGS` run in this process as %run runs it (runpy, as __main__): (its exit code, the lines it
    printed). At its line `stop_at`, Ctrl-C is sent to this process."""
    lines = [""]
    printed = Printed(lines, stop_at)
    argv, streams = sys.argv, (sys.stdout, sys.stderr)
    sys.argv, sys.stdout, sys.stderr = [str(ROOT / script), *flags], printed, printed
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code
    finally:
        sys.argv, (sys.stdout, sys.stderr) = argv, streams
    return code, [line for line in lines if line]


@pytest.fixture
def as_found(monkeypatch):
    """as_found(script): the interpreter as it is once the script's libraries are imported (what they change as they
    load, once, is theirs), with the test's own Ctrl-C and SIGTERM handlers (a signal a run does not own fails the
    test, never the suite), a variable a run's launcher sets already set, and none that sets Fabric's arguments."""
    found = {signum: signal.signal(signum, escaped) for signum in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # Lightning's launcher sets it where it is not set
    monkeypatch.delenv("LT_PRECISION", raising=False)  # a run gives Fabric its precision here: removed again

    def after_importing(script, *flags):
        """The interpreter once the script's imports ran, and with `flags` a whole run of it (the libraries a run
        imports as it goes, torch.compile's among them, and what they register as they load)."""
        runpy.run_path(str(ROOT / script), run_name="imported_by_the_test")  # its imports, not its run
        before = dict(os.environ)
        if flags:
            assert run_here(script, *flags, "--checkpoint-dir", "warm-up", "--save-model", "warm-up.pt")[0] == 0
        changed = {name for name, value in before.items() if os.environ.get(name) != value}
        assert not changed, f"the run left {changed} changed"
        return interpreter()
    try:
        yield after_importing
    finally:
        for signum, handler in found.items():
            signal.signal(signum, handler)


@pytest.mark.parametrize("script", TRAINING)
def test_a_refused_parse_changes_nothing(script, as_found, capsys):
    """Each lesson's parse, refused (a bad value; a lesson of processes at a prompt): one line, exit 2, the
    interpreter as found."""
    as_found = as_found(script)
    with pytest.raises(SystemExit) as stop:
        parse_as(script, "--smoke", "--epochs", "0")
    assert stop.value.code == 2 and interpreter() == as_found
    if lessons()[script]["devices"] > 1:
        sys.ps1 = ">>> "  # a prompt
        try:
            with pytest.raises(SystemExit) as stop:
                parse_as(script, "--smoke")
        finally:
            del sys.ps1
        assert stop.value.code == 2 and "cannot run at a prompt" in capsys.readouterr().err
        assert interpreter() == as_found


@pytest.mark.slow
@pytest.mark.parametrize("script", ONE_PROCESS)
def test_refused_interrupted_and_finished_runs_leave_the_interpreter_as_found(script, as_found, tmp_path):
    """Each one-process lesson run in this process: refused as the flags are read (nothing to resume) and once
    started (a checkpoint that cannot be loaded), interrupted at its first line, and to its end; after each, the
    interpreter as found and no lock held."""
    as_found = as_found(script, *SHORT)
    code, printed = run_here(script, *SHORT, "--resume")
    assert code == 2 and "nothing to resume" in printed[-1] and interpreter() == as_found, printed
    folder = tmp_path / "damaged"
    folder.mkdir()
    (folder / "epoch-0001.ckpt").write_bytes(b"cut short")
    (folder / "latest.json").write_text(json.dumps({"checkpoint": "epoch-0001.ckpt", "script": script, "kind": "smoke",
                                                    "settings": settings_of(script), "flags": SHORT}))
    code, printed = run_here(script, *SHORT, "--checkpoint-dir", str(folder), "--resume")
    assert code == 2 and "epoch-0001.ckpt" in printed[-1] and interpreter() == as_found, printed
    assert not (folder / ".lock").exists()
    code, printed = run_here(script, *SHORT, stop_at=1)
    assert code == 130 and printed[-1] == f"{script}: interrupted (SIGINT) while starting; no checkpoint, model or record was written.\n"
    assert interpreter() == as_found and not (tmp_path / "checkpoints").exists(), printed
    code, printed = run_here(script, *SHORT)
    assert code == 0 and printed[-1].startswith("Run record appended") and interpreter() == as_found, printed
    assert not (tmp_path / "checkpoints").exists()


def settings_of(script):
    args = parse_as(script, *SHORT)
    return {key: getattr(args, key) for key in ("vit", "batch_size", "seed", "epochs", "max_steps", "world_size",
                                                 "precision")} | args.own


@pytest.mark.slow
def test_ctrl_c_at_every_line_a_run_prints_is_one_line_and_130(as_found, tmp_path, monkeypatch):
    """04 run in this process to its end, then again once for each line it prints, Ctrl-C sent as that line is
    written, until a run prints fewer lines than the line to stop at (its last was reached): each run ends 130 in one
    line that says what is kept, with no traceback, no lock held and the interpreter as found; at the last line, past
    the record, the line says the run finished."""
    script = "04_fabric-vit-mixed-precision.py"
    as_found = as_found(script, *SHORT)
    code, whole = run_here(script, *SHORT)
    assert code == 0 and len(whole) > 10, whole
    stop_at, said = 0, []
    while True:
        stop_at += 1
        monkeypatch.chdir(tmp_path.joinpath(str(stop_at)).mkdir() or tmp_path / str(stop_at))
        code, printed = run_here(script, *SHORT, stop_at=stop_at)
        if code == 0 and len(printed) < stop_at:  # its whole run: every line it prints had its Ctrl-C
            break
        said = [line for line in printed if "interrupted (SIGINT)" in line]
        assert code == 130 and len(said) == 1 and said[0] == printed[-1], (stop_at, code, printed, whole)
        assert not any("Traceback" in line for line in printed) and interpreter() == as_found, (stop_at, printed)
        assert not list(tmp_path.joinpath(str(stop_at)).rglob(".lock")), stop_at
    assert stop_at > len(whole) - 1 and "after the run finished: its record is in results/runs.jsonl" in said[0], said


def a_run_that(does, folder):
    """A lesson of its own in `folder` whose run's block does `does` (a line of Python), and nothing else."""
    script = folder / "17_your-lesson.py"
    script.write_text("import sys\n\nfrom local_utilities import lesson_parser\nfrom run_keeping.keeper import RunKeeper"
                      "\n\nif __name__ == '__main__':\n    with RunKeeper(lesson_parser(epochs=3).parse_args()):\n"
                      f"        {does}\n")
    return script


def test_sys_exit_with_words_in_a_run_is_its_line_and_1(as_found, tmp_path):
    """sys.exit("why") in a run's block ends it as Python would end it, within the run's end: its words in one line,
    exit 1, no traceback, the interpreter as found."""
    script = a_run_that("sys.exit('why it stopped')", tmp_path)
    as_found = as_found(script)
    code, printed = run_here(script, "--smoke")
    assert code == 1 and printed[-1] == "17_your-lesson.py: why it stopped\n", printed
    assert not any("Traceback" in line for line in printed) and interpreter() == as_found


def test_a_variable_a_run_changes_is_set_back_as_found(as_found, tmp_path):
    """A variable that was set before the run (OMP_NUM_THREADS, as the fixture sets it) and that the run changes is
    set back to its value, not removed; one the run adds is removed."""
    script = a_run_that("sys.modules['os'].environ.update(OMP_NUM_THREADS='7', ADDED_BY_THE_RUN='1')", tmp_path)
    as_found = as_found(script)
    assert run_here(script, "--smoke")[0] == 0 and interpreter() == as_found
    assert os.environ["OMP_NUM_THREADS"] == "1" and "ADDED_BY_THE_RUN" not in os.environ


@pytest.mark.parametrize("first_in", ["the block", "the set-up"])
def test_a_second_ctrl_c_as_the_runs_end_begins_waits_for_it(first_in, as_found, tmp_path):
    """Ctrl-C twice: the first in the run's block (or its set-up, where it is deferred to the set-up's end), the second
    as __exit__ is called with the first's KeyboardInterrupt (by the with statement, or by __enter__), before its first
    line: the first's one line and 130, no traceback, the interpreter as found."""
    from run_keeping.keeper import RunKeeper

    script = a_run_that("__import__('os').kill(__import__('os').getpid(), 2)" if first_in == "the block" else "pass",
                        tmp_path)
    as_found = as_found(script)
    sent = []

    def send(where):
        sent.append(where)
        os.kill(os.getpid(), signal.SIGINT)  # its handler runs here, before the traced line or call

    def in_the_set_up(frame, event, arg):  # the first, once the run owns Ctrl-C
        if event == "line" and not sent and signal.getsignal(signal.SIGINT) is not escaped:
            send("set_up")
        return in_the_set_up

    def at_the_call(frame, event, arg):
        if event == "call" and frame.f_code is RunKeeper.__exit__.__code__ and len(sent) < 2:
            send("__exit__")
        elif event == "call" and frame.f_code is RunKeeper.set_up.__code__ and first_in == "the set-up":
            return in_the_set_up

    tracer = sys.gettrace()  # coverage's, say
    sys.settrace(at_the_call)
    try:
        code, printed = run_here(script, "--smoke")
    except KeyboardInterrupt:  # out of the run's hands (pytest would stop the suite)
        pytest.fail(f"the second Ctrl-C (at {sent}) left the run as a KeyboardInterrupt")
    finally:
        sys.settrace(tracer)
    assert sent[-1] == "__exit__", sent
    assert code == 130, (code, printed)
    assert printed[-1] == "17_your-lesson.py: interrupted (SIGINT) while starting; no checkpoint, model or record was written.\n"
    assert not any("Traceback" in line for line in printed) and interpreter() == as_found, printed


SWALLOWED = """import os
import signal

import torch

from local_utilities import lesson_parser
from run_keeping.keeper import RunKeeper


class Swallows:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # its KeyboardInterrupt is raised here, in a finalizer, where Python ignores it


if __name__ == "__main__":
    with RunKeeper(lesson_parser(epochs=3).parse_args()) as keeper:
        keeper.start()
        model = torch.nn.Linear(2, 2)
        keeper.before_training(model, torch.optim.SGD(model.parameters(), lr=0.1), train_loader=[None])
        keeper.batch_done(torch.tensor(1.0), 1)
"""
# then: swallowed in an evaluation, say, a signal sent meanwhile, and the next batch
NEXT_BATCH = """        Swallows()
        os.kill(os.getpid(), signal.SIGTERM)  # deferred
        keeper.batch_done(torch.tensor(1.0), 1)
        raise SystemExit("not stopped")
"""
# or: swallowed where no batch follows (the test evaluation, say)
NO_BATCH = """        keeper.checkpoint(0.5)
        Swallows()
        keeper.finish(1.0, 0.5, model)
"""


CLOSED_ON_THE_WAY = """import os
import signal

from local_utilities import lesson_parser
from run_keeping.keeper import RunKeeper


def batches():
    try:
        yield 1
    finally:  # run as the loop lets go of its iterator on the way to __exit__, as a loader's worker shutdown is
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    with RunKeeper(lesson_parser(epochs=3).parse_args()) as keeper:
        keeper.start()
        for batch in batches():
            os.kill(os.getpid(), signal.SIGINT)
"""


def run_ignoring(text, as_found, folder, monkeypatch, *flags):
    """The lesson `text` run here with --smoke and `flags`: (its exit code, its lines, the exceptions Python ignored
    in it, as its unraisable hook was handed them, the interpreter as found before it)."""
    script = folder / "17_your-lesson.py"
    script.write_text(text)
    found = as_found(script)
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: ignored.append(unraisable.exc_type))
    code, printed = run_here(script, "--smoke", *flags)
    return code, printed, ignored, found


def test_a_ctrl_c_a_finalizer_swallowed_stops_the_run_at_its_next_batch(as_found, tmp_path, monkeypatch):
    """A Ctrl-C whose KeyboardInterrupt is raised in a finalizer, where Python ignores it ("Exception ignored in"),
    stops the run at its next batch, a signal sent meanwhile deferred: the first's line, 130, as found."""
    code, printed, ignored, found = run_ignoring(SWALLOWED + NEXT_BATCH, as_found, tmp_path, monkeypatch)
    assert ignored == [KeyboardInterrupt], ignored  # the interrupt was swallowed
    assert code == 130 and printed[-1].startswith("17_your-lesson.py: interrupted (SIGINT); no checkpoint yet"), printed
    assert interpreter() == found


def test_a_ctrl_c_a_finalizer_swallowed_after_the_last_batch_is_said_as_the_run_finishes(as_found, tmp_path, monkeypatch):
    """Swallowed where no batch follows (the test evaluation, say): the run finishes, writes its files and says it was
    interrupted, 130, as found; never a silent 0."""
    code, printed, ignored, found = run_ignoring(SWALLOWED + NO_BATCH, as_found, tmp_path, monkeypatch, "--epochs", "1")
    assert ignored == [KeyboardInterrupt] and code == 130, (ignored, code, printed)
    assert printed[-1].startswith("17_your-lesson.py: interrupted (SIGINT) after the run finished: its record is in")
    assert (tmp_path / "results" / "runs.jsonl").exists() and interpreter() == found


def test_a_second_signal_in_a_finalizer_on_the_way_to_the_runs_end_is_deferred(as_found, tmp_path, monkeypatch):
    """Ctrl-C in the loop, then SIGTERM from a generator's finally that runs as the loop lets go of its iterator on the
    way to __exit__ (where no exception is being handled, as in a loader's worker shutdown): deferred, not raised
    there, so nothing is ignored and the first's line is said, 130, as found."""
    code, printed, ignored, found = run_ignoring(CLOSED_ON_THE_WAY, as_found, tmp_path, monkeypatch)
    assert not ignored and code == 130, (ignored, code, printed)
    assert printed[-1] == "17_your-lesson.py: interrupted (SIGINT) while starting; no checkpoint, model or record was written.\n"
    assert interpreter() == found


def test_ctrl_c_at_every_line_of_the_runs_set_up_is_one_line_and_130(as_found, tmp_path):
    """Ctrl-C as each line of RunKeeper's __enter__ and set_up runs once the run owns Ctrl-C (Python's tracer sends
    it), before the run's first line is printed: one line, 130, no traceback, the interpreter as found, until a run's
    set-up has fewer lines. (Before the run owns it, Ctrl-C is Python's own: docs/flags-records-exit-codes.md.)"""
    from run_keeping.keeper import RunKeeper

    script = a_run_that("pass", tmp_path)
    as_found = as_found(script)
    set_up = {RunKeeper.__enter__.__code__, RunKeeper.set_up.__code__}
    stop_at, lines = 0, 0
    while lines >= stop_at:
        stop_at, lines = stop_at + 1, 0

        def at_each_line(frame, event, arg):
            nonlocal lines
            if event == "line" and signal.getsignal(signal.SIGINT) is not escaped:
                lines += 1
                if lines == stop_at:
                    os.kill(os.getpid(), signal.SIGINT)
            return at_each_line

        tracer = sys.gettrace()  # coverage's, say
        sys.settrace(lambda frame, event, arg: at_each_line if frame.f_code in set_up else None)
        try:
            code, printed = run_here(script, "--smoke")
        except KeyboardInterrupt:  # out of the run's hands: a traceback and no line (pytest would stop the suite)
            pytest.fail(f"Ctrl-C at set-up line {stop_at} left the run as a KeyboardInterrupt")
        finally:
            sys.settrace(tracer)
        if lines >= stop_at:
            assert code == 130, (stop_at, code, printed)
            assert printed[-1] == "17_your-lesson.py: interrupted (SIGINT) while starting; no checkpoint, model or record was written.\n"
            assert not any("Traceback" in line for line in printed) and interpreter() == as_found, (stop_at, printed)
    assert stop_at > 10, stop_at  # set_up's lines were each reached
