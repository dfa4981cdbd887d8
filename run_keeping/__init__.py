"""Run-keeping for the numbered scripts, kept out of the lesson, one concern a module:

    __init__.py     this file: one line and a documented exit code instead of a traceback, for
                    every program of the suite; Ctrl-C while the libraries load
    files.py        whole-or-absent writes, JSONL records, a run's hold on its folder, reports
    config.py       the command line, parsed once into a Config; the commands the suite prints;
                    lessons.csv
    processes.py    the run's processes and devices: who started them, what they decide
                    together, CPU threads, bfloat16 where the device has none, memory
    checkpoints.py  checkpoints and --resume, random states, the finetuned model file
    record.py       the run record: its fields and types (Record), built and read here only
    keeper.py       RunKeeper, what a script calls: its timing, signals and record

Importing it does nothing; a program's parser (config.Parser) starts the run (start_run). A
script makes one RunKeeper and calls it four times: RunKeeper(args, fabric), then resume(),
batch_done() after each batch, checkpoint() after each epoch and finish(). The exit codes are
docs/flags-records-exit-codes.md's.
"""
import atexit
import gc
import os
import re
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_started = []  # whether start_run() has run in this process


def start_run():
    """From a program's start on (its parser calls this, once): what is left to let go of is let
    go of at exit, a multi-process gloo run leaves quickly, and a Ctrl-C or SIGTERM before the
    run's own handlers is one line. At exit the interpreter's last garbage collection would walk
    every object torch, torchvision and Lightning made, to free memory the OS takes back anyway
    (1.5 s at the end of each run on a 2-core CPU); frozen, they are skipped. Python never
    promised finalisers at exit, and nothing here needs one: files are written whole and closed,
    and child processes are stopped by their own exit handlers, which still run."""
    if _started:
        return
    _started.append(True)
    for handler in (gc.freeze, clean_up, _leave_a_gloo_run_quickly):  # at exit: the last first
        atexit.register(handler)
    if ours():
        for signum in EXIT_CODES:
            signal.signal(signum, stop_at_once)


def process_age_s():
    """Seconds since this process started, its imports included (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


_ending = [None]  # the code of the last Stopped: what the program ends with if none catches it


class Stopped(SystemExit):
    """What fail() raises once its line is printed: SystemExit(code). Uncaught, the program ends
    with that code; a multi-process run catches it to stop every process together
    (run_keeping/processes.py)."""

    def __init__(self, code):
        super().__init__(code)
        _ending[0] = code


def program():
    return Path(sys.argv[0]).name


def fail(message, code=2, say=True):
    """`<program>: error: <message>` on one line of stderr, then Stopped(code); never a
    traceback. The message is said whole: a reason is shortened only at a sentence's end.
    say=False: the line is left to another process of the run, which says the same."""
    message = " ".join(str(message).split())
    if say:
        print(f"{program()}: error: {message}", file=sys.stderr, flush=True)
    raise Stopped(code)


def multi_process_gloo():
    """Whether this is one process of several talking over gloo (CPUs)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1 and dist.get_backend() != "nccl")


_cleanups = []  # what a run lets go of on its way out (its checkpoint folder's lock)


def on_exit(cleanup):
    """Call `cleanup` when the program ends: by leave(), an uncaught Stopped or a traceback."""
    _cleanups.append(cleanup)


def clean_up():
    while _cleanups:
        try:
            _cleanups.pop()()
        except Exception:  # noqa: BLE001  a cleanup that fails must not hide why the run ended
            pass


def leave(code, at_once=False):
    """Exit with `code`, once the run has let go of what it held (on_exit). With `at_once`, without
    the interpreter's shutdown, which may be under way and ignores a SystemExit raised in it. A
    process of a multi-process run on gloo (CPUs) leaves at once too, without the interpreter's
    shutdown: after a collective, gloo's worker thread releases its tensors a
    moment later, and during the shutdown that release aborts the process ("terminate called
    without an active exception"; pytorch/pytorch#190489), which left a torchrun node waiting
    at its exit barrier. Lightning tears NCCL groups down itself; anywhere else: SystemExit."""
    clean_up()
    if at_once or multi_process_gloo():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def _leave_a_gloo_run_quickly():
    """A multi-process gloo run ending by an uncaught Stopped or traceback: leave as leave()
    does, with the code the program is ending with."""
    if multi_process_gloo():
        clean_up()
        code = _ending[0] if _ending[0] is not None else 1 if getattr(sys, "last_value", None) else 0
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def first_sentence(text, limit=300):
    """The first line of `text`, whole; past `limit` characters cut at the last sentence's end
    (or word) before it, so a reason never stops mid-word."""
    line = (str(text).strip().splitlines() or [""])[0].strip()
    if len(line) <= limit:
        return line
    cut = max(line.rfind(". ", 0, limit), line.rfind("; ", 0, limit))
    return line[:cut + 1] if cut > limit // 3 else line[:line.rfind(" ", 0, limit)] + " ..."


def why_unloadable(err):
    """What torch.load found wrong with a file, in whole words: never torch's advice to load it
    with weights_only=False (unsafe for a file of unknown origin)."""
    text = str(err)
    if "Weights only load failed" in text:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        if found:
            return f"it holds a {found.group(1)} object, not only tensors"
        return "it is not a file that torch.save wrote"
    if "failed finding central directory" in text or "PytorchStreamReader" in text:
        return "it is cut short or damaged (not a whole file that torch.save wrote)"
    return f"{type(err).__name__}: {first_sentence(text)}"


# -- Ctrl-C and SIGTERM before a run has started -------------------------------------------------
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def stop_at_once(signum, frame=None):
    """One line and 130 (Ctrl-C) or 143 (SIGTERM): nothing of a run exists yet to keep."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"\n{program()}: interrupted ({signal.Signals(signum).name}) while starting; nothing "
          "was written.", file=sys.stderr, flush=True)
    os._exit(EXIT_CODES[signum])


def ours():
    """Whether the running program is one of the suite's (not pytest or another importer)."""
    try:
        return sys.argv[0].endswith(".py") and Path(sys.argv[0]).resolve().parent in (ROOT, ROOT / "tools")
    except (OSError, IndexError):
        return False

