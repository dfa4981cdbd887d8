"""One line and a documented exit code instead of a traceback, for every tool of the suite.

Exit codes: 0 done; 1 a failed write (a full disk, no permission) or a NaN/inf loss; 2 bad input
or machine (a flag, missing data or weights, an unusable file, a library too old); 3 a process
of the run was lost (a machine died or was killed: continue with --resume); 130 Ctrl-C;
143 SIGTERM.
"""
import atexit
import gc
import os
import re
import sys
from pathlib import Path

# At exit the interpreter's last garbage collection walks every object torch, torchvision and
# Lightning made, to free memory the OS takes back anyway: 1.5 s at the end of each run on a
# 2-core CPU. Frozen, those objects are skipped. Python never promised finalisers at exit, and
# nothing here needs one: files are written whole and closed, and child processes are stopped
# by their own exit handlers, which still run.
atexit.register(gc.freeze)


def fail(message, code=2):
    """`<program>: error: <message>` on one line of stderr, then exit `code`; never a
    traceback. The message is said whole: a reason is shortened only at a sentence's end."""
    message = " ".join(str(message).split())
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr, flush=True)
    leave(code)


def leave(code):
    """Exit with `code`. A process of a multi-process run on gloo (CPUs) leaves at once, without
    the interpreter's shutdown: after a collective, gloo's worker thread releases its tensors a
    moment later, and during the shutdown that release aborts the process ("terminate called
    without an active exception"; pytorch/pytorch#190489), which left a torchrun node waiting
    at its exit barrier. Lightning tears NCCL groups down itself; anywhere else: SystemExit."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1 and dist.get_backend() != "nccl":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


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
