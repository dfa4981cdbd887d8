"""Stopping in one line: Ctrl-C and SIGTERM (what SLURM sends first) say how to continue, and
the errors a user can act on (no C++ compiler for torch.compile, a GPU out of memory, a process
of the run lost) replace the traceback."""
import os
import re
import signal
import sys

import torch

from run_keeping.checkpoints import resume_command
from run_keeping.errors import first_sentence, leave

# How a collective reports a process of the run that is gone (gloo, NCCL, the c10d store).
LOST_PEER = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|Socket Timeout|"
                       r"NCCL communicator was aborted|remote process exited|ProcessGroupNCCL.*"
                       r"(?:timeout|Watchdog)|Connection refused", re.I)


def install(keeper):
    """Ctrl-C (exit 130), SIGTERM (143) and the excepthook, for this run."""
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        signal.signal(sig, lambda signum, frame, code=code: on_signal(keeper, signum, code))
    sys.excepthook = lambda kind, err, tb: on_uncaught(keeper, kind, err, tb)


def lost_peer(keeper, err):
    """The match if `err` says another process of a multi-process run is gone, else None."""
    return keeper.world_size > 1 and isinstance(err, RuntimeError) and LOST_PEER.search(str(err))


def on_signal(keeper, signum, code):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if keeper.rank == 0:
        last = keeper.checkpoints.last
        where = (f"last checkpoint: {last}; continue with: {resume_command()}" if last else
                 "no checkpoint yet (one is written at the end of each epoch)")
        print(f"\n{keeper.args.script}: interrupted ({signal.Signals(signum).name}); {where}",
              file=sys.stderr, flush=True)
    leave(code)


def on_uncaught(keeper, kind, err, traceback):
    """torch.compile without a working C++ compiler (exit 2), a GPU out of memory (exit 1), a
    process of the run lost (exit 3): one line. Anything else: the usual traceback."""
    reason, lost = first_sentence(err) or kind.__name__, lost_peer(keeper, err)
    if kind.__module__.startswith(("torch._dynamo", "torch._inductor")):
        message, code = (f"torch.compile could not compile the model ({reason}). On a CPU it "
                         "needs a working C++ compiler: install g++ (or point CXX at one), or "
                         "run without compiling: python 01_pytorch-vit.py is 02 without it, and "
                         "09 compiles on a CPU only with --compile-on-cpu."), 2
    elif issubclass(kind, torch.OutOfMemoryError):
        message, code = (f"the GPU ran out of memory at --batch-size {keeper.args.batch_size} "
                         f"({first_sentence(reason, 160)}): try a smaller --batch-size."), 1
    elif lost:
        peer = re.search(r"\[([^\]]+)\]:(\d+)", str(err))
        which = f" (the one at {peer.group(1)}:{peer.group(2)})" if peer else ""
        last = keeper.checkpoints.last
        where = (f"the last checkpoint is {last}; continue with {resume_command()} once every "
                 "machine is back" if last else "no checkpoint was written yet: start it again")
        message, code = (f"a process of the run was lost{which}: a machine died, or a process "
                         f"was killed ({lost.group(0)}). Process {keeper.rank} of "
                         f"{keeper.world_size} stops too; {where}."), 3
    else:
        return sys.__excepthook__(kind, err, traceback)
    print(f"{keeper.args.script}: error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)  # an excepthook cannot choose the exit code otherwise
