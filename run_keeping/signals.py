"""Stopping in one line. Ctrl-C and SIGTERM (what SLURM sends first, KillWait seconds before it
kills) stop a run in training at its next optimizer step (in every process at the same step),
after saving a checkpoint of where it is; before training, during its last evaluation, or at a
second signal, at once. The errors a user can act on (torch.compile without its compiler, a GPU
out of memory, a process of the run lost) replace the traceback."""
import os
import re
import signal
import sys

import torch

from run_keeping.checkpoints import resume_command
from run_keeping.errors import EXIT_CODES, clean_up, first_sentence, leave

# How a collective reports a process of the run that is gone (gloo, NCCL, the c10d store).
LOST_PEER = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|Socket Timeout|Timed out waiting|"
                       r"NCCL communicator was aborted|remote process exited|ProcessGroupNCCL.*"
                       r"(?:timeout|Watchdog)|Connection refused", re.I)
COMPILERS = {  # what torch.compile needs on each device, and where to find it
    "cpu": "On a CPU it needs a working C++ compiler: install g++ (or point CXX at one)",
    "cuda": "On a GPU it needs Triton (torch's CUDA wheels bring it) and a C compiler to build "
            "Triton's launcher: install gcc (or point CC at one)",
}


def install(keeper):
    """Ctrl-C (exit 130), SIGTERM (143) and the excepthook, for this run."""
    for sig in EXIT_CODES:
        signal.signal(sig, lambda signum, frame: on_signal(keeper, signum))
    sys.excepthook = lambda kind, err, tb: on_uncaught(keeper, kind, err, tb)


def lost_peer(keeper, err):
    """The match if `err` says another process of a multi-process run is gone, else None."""
    return keeper.world_size > 1 and isinstance(err, RuntimeError) and LOST_PEER.search(str(err))


def on_signal(keeper, signum):
    """In training: note the stop, which the next optimizer step (or the epoch's checkpoint)
    carries out; while the finished run writes its model and record: note it, and stop once
    they are written; otherwise, or at a second signal, stop now."""
    if (keeper.training or keeper.finishing) and not keeper.stop_wanted:
        keeper.stop_wanted, keeper.stop_signal = EXIT_CODES[signum], signum
        return
    stop_now(keeper, signum)


def written(keeper):
    """The finished run's model and record are written: a signal noted meanwhile stops it now."""
    keeper.finishing, keeper.finished = False, True
    if keeper.stop_wanted:
        stop_now(keeper, keeper.stop_signal)


def stop_now(keeper, signum):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if keeper.finished:  # whole and written; the interpreter may be shutting down: at once
        stopped(keeper, f"interrupted ({signal.Signals(signum).name}) after the run finished: its record "
                f"is in {keeper.args.results} and its model in {keeper.args.save_model}.",
                EXIT_CODES[signum], at_once=True)
    last = keeper.checkpoints.last
    where = (f"last checkpoint: {last}; continue with: {resume_command()}" if last else
             "no checkpoint yet (one is written after each epoch, and where the run is when it "
             "is stopped in training)")
    stopped(keeper, f"interrupted ({signal.Signals(signum).name}); {where}", EXIT_CODES[signum])


def stopped(keeper, message, code, at_once=False):
    """Process 0 says why the run stops in one line; every process lets go of the run's folder
    and leaves with `code`."""
    if keeper.rank == 0:
        print(f"\n{keeper.args.script}: {message}", file=sys.stderr, flush=True)
    leave(code, at_once)


def on_uncaught(keeper, kind, err, traceback):
    """torch.compile without its compiler (exit 2), a GPU out of memory (exit 1), a process of
    the run lost (exit 3): one line. Anything else: the usual traceback."""
    reason, lost = first_sentence(err) or kind.__name__, lost_peer(keeper, err)
    if kind.__module__.startswith(("torch._dynamo", "torch._inductor")):
        message, code = (f"torch.compile could not compile the model ({reason}). "
                         f"{COMPILERS.get(keeper.args.accelerator, COMPILERS['cpu'])}; or run "
                         "without compiling: python 01_pytorch-vit.py is 02 without it, and 09 "
                         "compiles on a CPU only with --compile-on-cpu."), 2
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
    clean_up()
    os._exit(code)  # an excepthook cannot choose the exit code otherwise
