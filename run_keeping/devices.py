"""What the run's devices need: the CPU's cores shared among the processes on it (on a GPU too,
where the optimizer steps on the CPU: 15's offload), and bf16-mixed on a GPU without native
bfloat16 (before Ampere) replaced by the nearest precision that runs."""
import os

import torch

FALLBACK = "This GPU ({gpu}) has no native bfloat16: running {instead} instead of bf16-mixed{why}."
# What bf16-mixed becomes there: on one device or under DDP, 16-mixed; under FSDP2 (Fabric's
# ModelParallelStrategy takes no 16-mixed), 32-true.
FALLBACKS = {"single-device": ("16-mixed",), "sharded": ("32-true",)}


def gpu_lacks_bf16():
    return not torch.cuda.is_bf16_supported(including_emulation=False)


def fall_back_from_bf16(fabric):
    """16-mixed instead, or 32-true under FSDP2, since Fabric's ModelParallelStrategy refuses
    16-mixed; said in one line. Set through the strategy's public `precision` setter before the
    model is set up (the lesson line keeps the talk's precision="bf16-mixed")."""
    from lightning.fabric.plugins import MixedPrecision, Precision
    from lightning.fabric.strategies import ModelParallelStrategy
    if fabric.strategy.precision.precision != "bf16-mixed" or not gpu_lacks_bf16():
        return
    if isinstance(fabric.strategy, ModelParallelStrategy):
        (instead,) = FALLBACKS["sharded"]
        fabric.strategy.precision, why = Precision(), " (Fabric's FSDP2 strategy takes no 16-mixed)"
    else:
        (instead,) = FALLBACKS["single-device"]
        fabric.strategy.precision, why = MixedPrecision(instead, "cuda"), ""
    if fabric.global_rank == 0:
        print(FALLBACK.format(gpu=torch.cuda.get_device_name(), instead=instead, why=why), flush=True)


def share_cpu_threads(processes_here):
    """On a CPU, give each of the run's processes on this machine its share of the cores (as
    torchrun's OMP_NUM_THREADS=1 does for several processes a node): PyTorch gives every
    process all of them, and two processes that each run as many threads as there are cores
    wait on each other (10 --smoke on 2 cores: 31.8 s with the default, 19.1 s with one thread
    a process; 2026-12-02); so do GPU processes that each step Adam on the CPU (15 on several
    GPUs). An OMP_NUM_THREADS the user set is kept."""
    if processes_here > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes_here))


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
