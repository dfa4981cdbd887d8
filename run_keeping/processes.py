"""The run's processes and the devices they run on.

What the processes of a run decide together, so that none is left waiting for another that has
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

And the devices: who started the processes (the opening line), the CPU's cores shared among
them, bfloat16 where the device computes it only by emulation (a GPU before Ampere, a CPU without
oneDNN's bfloat16 kernels) replaced by the nearest precision that runs, said in one line, and
each device's name and peak memory as the record gives them.
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
    """Which launcher started this process, the world size and this process's rank."""
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
    """Which launcher started the run's processes (Lightning's name for it), or None."""
    environment = getattr(getattr(fabric, "strategy", None), "cluster_environment", None)
    return type(environment).__name__ if environment is not None else None


# -- deciding together ---------------------------------------------------------------------------
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


def lost_peer(world_size, err):
    """The match if `err` says another process of a multi-process run is gone, else None."""
    return world_size > 1 and isinstance(err, RuntimeError) and LOST_PEER.search(str(err))


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


# -- the devices ---------------------------------------------------------------------------------
def share_cpu_threads(processes_here):
    """On a CPU, give each of the run's processes on this machine its share of the cores (as
    torchrun's OMP_NUM_THREADS=1 does for several processes a node): PyTorch gives every
    process all of them, and two processes that each run as many threads as there are cores
    wait on each other (10 --smoke on 2 cores: 31.8 s with the default, 19.1 s with one thread
    a process; 2026-12-02); so do GPU processes that each step Adam on the CPU (15 on several
    GPUs). An OMP_NUM_THREADS the user set is kept."""
    if processes_here > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes_here))


# A run is marked busy when its computing thread spent more than this share of its ready time
# waiting for a core (waiting_share). On an idle 2-core AMD EPYC (2026-12-05), --smoke --max-steps
# 20: 04 0.04%, 05 5.7% and 07 9.0% (two processes and their gloo threads on 2 cores); beside two
# programs spinning on the cores: 04 49%, 07 50%, 2-4 times slower; beside one: 35%. A quarter is
# over twice the most an idle machine showed, and under what one other busy program costs.
BUSY_WAIT = 0.25


def cpu_from():
    """(seconds run, seconds waited for a core) of the calling thread so far, from Linux's
    /proc/thread-self/schedstat; None where the kernel does not say (not Linux). The thread is
    the one that computes (a script's main thread): the run's own helper threads (gloo's, the
    loader's) would count its own work as waiting when its processes fill the cores, which a
    multi-process run on a CPU does by design (07 --smoke's 2 processes on 2 idle cores: 27% over
    all threads)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return None


def waiting_share(since):
    """The share of the time the calling thread was ready to run, since cpu_from() gave `since`,
    that it spent waiting for a core; -1 where the kernel does not say."""
    now = cpu_from()
    if now is None or since is None:
        return -1.0
    ran, waited = now[0] - since[0], now[1] - since[1]
    return waited / (waited + ran) if waited + ran > 0 else 0.0


def native_bf16(device_type):
    """Whether the device computes bfloat16 matrix products in hardware: a GPU from Ampere on;
    a CPU where oneDNN has bfloat16 kernels (AVX512, with AVX512-BF16 or AMX to be fast). On a
    CPU with AVX2 alone PyTorch emulates bfloat16: a 512x512 product ran 110x slower than in
    float32 on a 2-core AMD EPYC (1.2 against 132.8 GFLOP/s). oneDNN's own answer is asked, so
    ONEDNN_MAX_CPU_ISA=AVX2 (which leaves oneDNN only its AVX2 kernels) rehearses such a CPU on
    any other; ATen's ATEN_CPU_CAPABILITY changes nothing here, as it leaves oneDNN's kernels
    alone (tests/test_precision.py measures both)."""
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
    """Where the run's device (`device`: the kind, else Fabric's) has no native bfloat16, the
    precision FALLBACKS gives instead, set through the strategy's public `precision` setter
    before the model is set up (the lesson's line keeps the talk's precision="bf16-mixed");
    said in one line. Returns what runs."""
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
    """The GPU's name, or the CPU's model, cores and the bfloat16 matrix units it has (what makes
    bf16 fast or slow on it), and oneDNN's cap where ONEDNN_MAX_CPU_ISA sets one."""
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
    """GPU: torch.cuda.max_memory_reserved (the talk's figure); CPU: the process's peak resident
    memory since the start or the last forget_cpu_peak (Linux's VmHWM, in kilobytes)."""
    if accelerator == "cuda":
        return torch.cuda.max_memory_reserved() / 1e9
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024 / 1e9
    except (OSError, StopIteration):  # not Linux: the peak of the whole run
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def forget_cpu_peak():
    """Linux: the peak resident memory restarts from what the process holds now (writing 5 to
    clear_refs), so that what a checkpoint write held briefly does not count as training's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def fsdp_units(model):
    """(FSDP2 units, units whose shards are kept in CPU memory): the modules fully_shard made,
    and the offload policy each carries."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    except ImportError:
        return 0, 0
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    policies = [getattr(getattr(m._get_fsdp_state(), "_fsdp_param_group", None), "offload_policy", None)
                for m in units]
    return len(units), sum(isinstance(policy, CPUOffloadPolicy) for policy in policies)
