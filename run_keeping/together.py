"""What the processes of a run decide together, so that none is left waiting for another that has
stopped. On gloo (CPUs) a process that exits closes its sockets and the others notice at once;
on NCCL (GPUs) they do not: they wait in their next collective until its timeout (30 minutes by
default), holding their GPUs. So:

- a step that may fail in one process (process 0's writes, each process's part of a
  checkpoint) is followed by an exchange of how it went, and if it failed anywhere every process
  stops there, with one line each and the failing process's exit code (`together`);
- a stop asked for by a signal is voted on every few optimizer steps, and every process stops
  at the same step (`StopVote`);
- once the run is set up, the collectives' timeout is shortened (`bound_waits`), which bounds
  whatever is left (a process killed outright, a machine lost).
"""
import os
import sys
from datetime import timedelta

import torch

from run_keeping.errors import Stopped, fail, leave, program

# How long a process waits in a collective for the others once the run is set up: well over a
# checkpoint's write (ViT-L/16 with Adam, some 5 GB), far under NCCL's 10 and Lightning's 30
# minutes. COLLECTIVE_TIMEOUT_S in the environment sets another.
COLLECTIVE_TIMEOUT_S = 300
VOTE_EVERY = 8  # optimizer steps between stop votes; a vote is read a round later (no GPU wait)


def together(fabric, action, quiet=False):
    """Run `action` in this process, then learn whether it failed in any process of the run
    (fail() raises Stopped); if so, every process leaves with the failing one's exit code, the
    others saying in one line each that they stop too (quiet: they leave without a word, for
    checks that the failing process's line explains whole). Returns what `action` returned."""
    code, result = 0, None
    try:
        result = action()
    except Stopped as stopped:
        code = stopped.code or 1
    if fabric is not None and fabric.world_size > 1:
        codes = gather(fabric, code)
        if not code and any(codes):
            first = next(rank for rank, c in enumerate(codes) if c)
            code = int(codes[first])
            if not quiet:
                print(f"{program()}: error: process {fabric.global_rank} of {fabric.world_size} "
                      f"stops too: process {first} could not go on (its line says why).",
                      file=sys.stderr, flush=True)
    if code:
        leave(code)
    return result


def gather(fabric, number):
    """`number` from every process of the run, in rank order. (torch.distributed directly:
    Fabric's all_gather goes through a function torch deprecates, and each process warns.)"""
    import torch.distributed as dist
    if fabric is None or fabric.world_size == 1:
        return [number]
    mine = torch.tensor([number], dtype=torch.float64, device=fabric.device)
    every = [torch.empty_like(mine) for _ in range(fabric.world_size)]
    dist.all_gather(every, mine)
    return [value.item() for value in every]


class StopVote:
    """Every VOTE_EVERY optimizer steps each process of a multi-process run puts in whether it
    was asked to stop (a signal's exit code, or 0), in an all-reduce it does not wait for; the
    result is read one round later, when it has long arrived, so no process waits for the GPU,
    and all of them stop at the same step whichever of them got the signal."""

    def __init__(self, fabric):
        self.fabric, self.steps, self.pending = fabric, 0, None

    def step(self, wanted):
        """After each optimizer step: the agreed stop code (0: go on)."""
        if self.fabric is None or self.fabric.world_size == 1:
            return wanted
        self.steps += 1
        if self.steps % VOTE_EVERY:
            return 0
        agreed = self.pending.result() if self.pending else 0
        self.pending = _Vote(self.fabric, wanted)
        return agreed


class _Vote:
    def __init__(self, fabric, wanted):
        import torch.distributed as dist
        value = torch.tensor([wanted], dtype=torch.int32, device=fabric.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)  # on NCCL: queued on the GPU, no host wait
        if value.is_cuda:
            self.value = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self.value.copy_(value, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.value, self.done = value, None

    def result(self):
        if self.done is not None:
            self.done.synchronize()  # recorded a round ago: long done
        return int(self.value[0])


def collective_timeout():
    """COLLECTIVE_TIMEOUT_S, or its default, as a timedelta; a value that is no number of seconds
    over 0: one line, exit 2 (parse_args checks it before any process starts)."""
    given = os.environ.get("COLLECTIVE_TIMEOUT_S", str(COLLECTIVE_TIMEOUT_S))
    try:
        timeout = timedelta(seconds=float(given))
    except (ValueError, OverflowError):
        timeout = None
    if timeout is None or timeout.total_seconds() <= 0:
        fail(f"COLLECTIVE_TIMEOUT_S={given!r}: give the seconds a process waits for the others, "
             f"a number over 0 (default {COLLECTIVE_TIMEOUT_S})")
    return timeout


def bound_waits(fabric):
    """Shorten the collectives' timeout of a multi-process run, now that its slow start (a
    download on process 0 while the others wait) is over."""
    import torch.distributed as dist
    if fabric is None or fabric.world_size == 1 or not dist.is_initialized():
        return
    set_timeout = getattr(dist, "set_timeout", None) or getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return
    timeout = collective_timeout()
    mesh = getattr(fabric.strategy, "device_mesh", None)
    groups = [None] + ([mesh.get_group(d) for d in range(mesh.ndim)] if mesh is not None else [])
    for group in groups:
        try:
            set_timeout(timeout, group)
        except (RuntimeError, ValueError, AttributeError):
            pass  # a backend that keeps its timeout (MPI, UCC) says so itself
