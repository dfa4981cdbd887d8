"""Run-keeping for the numbered scripts, kept out of the lesson, one concern a module:

    __init__.py     one line and a documented exit code instead of a traceback
    files.py        whole-or-absent writes, JSONL records, a run's hold on its folder, reports
    config.py       the command line, parsed once into a Config; the commands printed; lessons.csv
    processes.py    the run's processes and devices: what they decide together, bfloat16, memory
    checkpoints.py  checkpoints and --resume, random states, the finetuned model file
    record.py       the run record: its fields and types, built and read here only
    keeper.py       RunKeeper, what a script calls: its timing, signals and record

Importing it does nothing; a program's parser (config.Parser) starts the run (start_run). A script
calls RunKeeper(args, fabric), resume(), batch_done() after each batch, checkpoint() after each
epoch and finish(). Exit codes: docs/flags-records-exit-codes.md.
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
    """From a program's start on (its parser calls this): cleanups at exit, a quick exit for a
    multi-process gloo run, one line for a Ctrl-C or SIGTERM before the run's own handlers. gc is
    frozen at exit: its last collection would walk every object torch made (1.5 s a run on 2
    cores) to free memory the OS takes back anyway; files are written whole, so no finaliser is needed."""
    if _started:
        return
    _started.append(True)
    for handler in (gc.freeze, clean_up, _leave_a_gloo_run_quickly):  # at exit: the last first
        atexit.register(handler)
    if ours():
        for signum in EXIT_CODES:
            signal.signal(signum, stop_at_once)


def process_age_s():
    """Seconds since this process started (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


_ending = [None]  # the code of the last Stopped: what the program ends with if none catches it


class Stopped(SystemExit):
    """What fail() raises once its line is printed: SystemExit(code); processes.together catches it."""

    def __init__(self, code):
        super().__init__(code)
        _ending[0] = code


def program():
    return Path(sys.argv[0]).name


def fail(message, code=2, say=True):
    """`<program>: error: <message>` on one line of stderr, then Stopped(code); never a traceback.
    say=False: another process of the run says the same line."""
    message = " ".join(str(message).split())
    if say:
        print(f"{program()}: error: {message}", file=sys.stderr, flush=True)
    raise Stopped(code)


def multi_process_gloo():
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1 and dist.get_backend() != "nccl")


_cleanups = []  # what a run lets go of on its way out (its checkpoint folder's lock)


def on_exit(cleanup):
    _cleanups.append(cleanup)


def clean_up():
    while _cleanups:
        try:
            _cleanups.pop()()
        except Exception:  # noqa: BLE001  a cleanup that fails must not hide why the run ended
            pass


def leave(code, at_once=False):
    """Exit with `code` once the cleanups ran. With `at_once` (a shutdown may be under way, which
    ignores SystemExit), or in a multi-process gloo run, without the interpreter's shutdown: gloo's
    worker thread frees its tensors a moment after a collective, and during the shutdown that aborts
    the process ("terminate called without an active exception"; pytorch/pytorch#190489), which
    left a torchrun node waiting at its exit barrier."""
    clean_up()
    if at_once or multi_process_gloo():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def _leave_a_gloo_run_quickly():
    """A multi-process gloo run ending by an uncaught Stopped or traceback: leave() with its code."""
    if multi_process_gloo():
        clean_up()
        code = _ending[0] if _ending[0] is not None else 1 if getattr(sys, "last_value", None) else 0
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def first_sentence(text, limit=300):
    """The first line of `text`; past `limit` characters cut at a sentence's end (or a word's)."""
    line = (str(text).strip().splitlines() or [""])[0].strip()
    if len(line) <= limit:
        return line
    cut = max(line.rfind(". ", 0, limit), line.rfind("; ", 0, limit))
    return line[:cut + 1] if cut > limit // 3 else line[:line.rfind(" ", 0, limit)] + " ..."


def why_unloadable(err):
    """What torch.load found wrong with a file, without torch's advice of weights_only=False (unsafe)."""
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
    try:
        return sys.argv[0].endswith(".py") and Path(sys.argv[0]).resolve().parent in (ROOT, ROOT / "tools")
    except (OSError, IndexError):
        return False

