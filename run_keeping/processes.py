"""The run's processes and the devices they run on.

On NCCL (GPUs) the processes of a run do not notice one that stopped: they wait in their next
collective until its timeout (30 minutes by default), holding their GPUs. So a step that may fail
in one process is followed by an exchange of how it went (`together`), a stop asked for by a
signal is voted on so that every process stops at the same step (`StopVote`), and once the run is
set up the collectives' timeout is shortened (`bound_waits`) for whatever is left (a machine lost).

The devices: the CPU's cores shared among the processes, bfloat16 replaced where the device only
emulates it, each device's name and peak memory.
"""
import os
import platform
import re
import resource
import sys
import warnings

import torch

from run_keeping import Stopped, leave, program
from run_keeping.config import INTERACTIVE, collective_timeout

VOTE_EVERY = 8  # optimizer steps between stop votes; a vote is read a round later (no GPU wait)
# Lightning warns wherever srun exists but did not start the process (a cluster's login node, a
# one-process run on a GPU node). config.check_launch refuses the case where that matters (several
# SLURM tasks started without srun), and the opening line says what did start the run.
warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
# How a collective reports a process of the run that is gone (gloo, NCCL, the c10d store).
LOST_PEER = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|Socket Timeout|Timed out waiting|"
                       r"NCCL communicator was aborted|remote process exited|ProcessGroupNCCL.*"
                       r"(?:timeout|Watchdog)|Connection refused", re.I)


# -- who started the processes -------------------------------------------------------------------
def opening_line(fabric, rank, world_size):
    env = os.environ
    cluster = type(getattr(getattr(fabric, "strategy", None), "cluster_environment", None)).__name__
    if cluster == "SLURMEnvironment":
        by = f"SLURM (job {env.get('SLURM_JOB_ID')}, srun task {env.get('SLURM_PROCID')})"
    elif cluster == "TorchElasticEnvironment":
        by = f"torchrun (node {env.get('GROUP_RANK', '0')}, local rank {env.get('LOCAL_RANK')})"
    elif world_size > 1:
        by = "Lightning, which started this machine's processes itself"
    else:
        by = None
    if env.get("SLURM_JOB_NAME") in INTERACTIVE and cluster != "SLURMEnvironment":
        by = (by or "you") + (f", inside SLURM job {env.get('SLURM_JOB_ID')}, whose name "
                              f"{env['SLURM_JOB_NAME']!r} makes Lightning ignore SLURM")
    if by is None:
        return "One process, started without a launcher."
    return f"Process {rank} of {world_size}, started by {by}."


def launcher(fabric):
    environment = getattr(getattr(fabric, "strategy", None), "cluster_environment", None)
    return type(environment).__name__ if environment is not None else None


# -- deciding together ---------------------------------------------------------------------------
def together(fabric, action, quiet=False):
    """`action` here, then whether it failed (raised Stopped) in any process: if so every process
    leaves with the failing one's code, the others saying they stop too (quiet: without a word)."""
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
    """`number` from every process, in rank order (Fabric's all_gather warns of a deprecation)."""
    import torch.distributed as dist
    if fabric is None or fabric.world_size == 1:
        return [number]
    mine = torch.tensor([number], dtype=torch.float64, device=fabric.device)
    every = [torch.empty_like(mine) for _ in range(fabric.world_size)]
    dist.all_gather(every, mine)
    return [value.item() for value in every]


def lost_peer(world_size, err):
    return world_size > 1 and isinstance(err, RuntimeError) and LOST_PEER.search(str(err))


class StopVote:
    """Every VOTE_EVERY optimizer steps each process puts its stop code (or 0) in an all-reduce it
    reads a round later, so no process waits for the GPU and all stop at the same step."""

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


def bound_waits(fabric):
    """Shorten the collectives' timeout, now that the slow start (process 0's download) is over."""
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


# -- the devices ---------------------------------------------------------------------------------
def share_cpu_threads(processes_here):
    """Each process on this machine its share of the cores (as torchrun's OMP_NUM_THREADS=1), unless
    the user set OMP_NUM_THREADS: processes that each take every core wait on each other (10 --smoke
    on 2 cores: 31.8 s, 19.1 s with one thread a process; 2026-12-02)."""
    if processes_here > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes_here))


# A run is marked busy when its computing thread spent more than this share of its ready time
# waiting for a core (waiting_share). On an idle 2-core AMD EPYC (2026-12-05), --smoke --max-steps
# 20: 04 0.04%, 05 5.7% and 07 9.0% (two processes and their gloo threads on 2 cores); beside two
# programs spinning on the cores: 04 49%, 07 50%, 2-4 times slower; beside one: 35%. A quarter is
# over twice the most an idle machine showed, and under what one other busy program costs.
BUSY_WAIT = 0.25


def cpu_from():
    """(seconds run, seconds waited for a core) of the calling thread, the one that computes
    (/proc/thread-self/schedstat; None off Linux). Over all threads the run's own helpers would
    count as waiting (07 --smoke's 2 processes on 2 idle cores: 27%)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return None


def waiting_share(since):
    """The share of its ready time since `since` the thread waited for a core; -1 if unknown."""
    now = cpu_from()
    if now is None or since is None:
        return -1.0
    ran, waited = now[0] - since[0], now[1] - since[1]
    return waited / (waited + ran) if waited + ran > 0 else 0.0


def native_bf16(device_type):
    """Whether the device computes bfloat16 in hardware: a GPU from Ampere on, a CPU where oneDNN
    has bfloat16 kernels. With AVX2 alone a 512x512 product ran 110x slower than in float32 (2-core
    AMD EPYC). oneDNN is asked, so ONEDNN_MAX_CPU_ISA=AVX2 rehearses such a CPU on any other."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported()) if supported is not None else True


# What a bf16 precision becomes where the device has no native bfloat16: on a GPU, bf16-mixed
# becomes 16-mixed on one device or under DDP, 32-true under FSDP2 (Fabric's ModelParallelStrategy
# takes no 16-mixed); on a CPU, 32-true (its float16 is emulated too); bf16-true, 32-true anywhere
# (16-true would lose Adam's small steps, as bfloat16 does, without a scaler to keep them).
FALLBACKS = {("cuda", "bf16-mixed", "single-device"): "16-mixed", ("cuda", "bf16-mixed", "sharded"): "32-true",
             ("cpu", "bf16-mixed", "single-device"): "32-true", ("cpu", "bf16-mixed", "sharded"): "32-true",
             **{(device, "bf16-true", layout): "32-true" for device in ("cuda", "cpu")
                for layout in ("single-device", "sharded")}}


def fall_back_from_bf16(fabric, device=None):
    """Where the device has no native bfloat16, FALLBACKS' precision instead, set before the model
    is set up (the lesson keeps precision="bf16-mixed") and said in one line. Returns what runs."""
    from lightning.fabric.plugins import MixedPrecision, Precision
    from lightning.fabric.strategies import ModelParallelStrategy
    asked, device = fabric.strategy.precision.precision, device or fabric.device.type
    if asked not in ("bf16-mixed", "bf16-true") or native_bf16(device):
        return asked
    sharded = isinstance(fabric.strategy, ModelParallelStrategy)
    instead = FALLBACKS[(device, asked, "sharded" if sharded else "single-device")]
    fabric.strategy.precision = MixedPrecision(instead, device) if instead.endswith("-mixed") else Precision()
    # Fabric keeps a reference of its own to the plugin it was made with, which setup_module
    # converts the model with and fabric.autocast enters (lightning/fabric/fabric.py, 2.6.6), and
    # has no setter for it: without this, bf16-true's plugin would still cast the model to bfloat16
    fabric._precision = fabric.strategy.precision
    if fabric.global_rank == 0:
        print(fallback_line(device, asked, instead, sharded), flush=True)
    return instead


def fallback_line(device, asked, instead, sharded):
    if device == "cuda":
        why = " (Fabric's FSDP2 strategy takes no 16-mixed)" if sharded and asked == "bf16-mixed" else ""
        return (f"This GPU ({torch.cuda.get_device_name()}) has no native bfloat16: running {instead} "
                f"instead of {asked}{why}.")
    return (f"This {device_name('cpu')} has no native bfloat16 (no oneDNN bfloat16 kernels): running "
            f"{instead} instead of {asked}, since emulated bfloat16 runs many times slower than float32; "
            "the record says both. What bfloat16 saves in time and memory shows on a CPU with "
            "AVX512-BF16 or AMX, or a GPU from Ampere on (docs/smoke.md).")


def device_name(accelerator):
    """The GPU's name, or the CPU's model, cores, bfloat16 units and oneDNN's cap if one is set."""
    if accelerator == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        model, flags = platform.processor() or platform.machine(), []
    units = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    units += [f"oneDNN capped at {cap} by ONEDNN_MAX_CPU_ISA"] if cap and cap.upper() != "ALL" else []
    return f"CPU {model} ({os.cpu_count()} cores{''.join(', ' + u for u in units)})"


def peak_memory_gb(accelerator):
    """GPU: max_memory_reserved (the talk's figure); CPU: peak resident memory (VmHWM)."""
    if accelerator == "cuda":
        return torch.cuda.max_memory_reserved() / 1e9
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024 / 1e9
    except (OSError, StopIteration):  # not Linux: the peak of the whole run
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def forget_cpu_peak():
    """The peak resident memory restarts from now (Linux), so a checkpoint write is not training's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def fsdp_units(model):
    """(FSDP2 units, units whose shards are kept in CPU memory)."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    except ImportError:
        return 0, 0
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    policies = [getattr(getattr(m._get_fsdp_state(), "_fsdp_param_group", None), "offload_policy", None)
                for m in units]
    return len(units), sum(isinstance(policy, CPUOffloadPolicy) for policy in policies)
