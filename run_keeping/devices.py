"""What the run's devices need: the CPU's cores shared among the processes on it, and bf16-mixed
on a GPU without native bfloat16 (before Ampere) replaced by the nearest precision that runs."""
import os

import torch

FALLBACK = "This GPU ({gpu}) has no native bfloat16: running {instead} instead of bf16-mixed{why}."


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
        fabric.strategy.precision, instead = Precision(), "32-true"
        why = " (Fabric's FSDP2 strategy takes no 16-mixed)"
    else:
        fabric.strategy.precision, instead = MixedPrecision("16-mixed", "cuda"), "16-mixed"
        why = ""
    if fabric.global_rank == 0:
        print(FALLBACK.format(gpu=torch.cuda.get_device_name(), instead=instead, why=why), flush=True)


def share_cpu_threads(processes_here):
    """On a CPU, give each of the run's processes on this machine its share of the cores (as
    torchrun's OMP_NUM_THREADS=1 does for several processes a node): PyTorch gives every
    process all of them, and two processes that each run as many threads as there are cores
    wait on each other (10 --smoke on 2 cores: 31.8 s with the default, 19.1 s with one thread
    a process; 2026-12-02). An OMP_NUM_THREADS the user set is kept."""
    if processes_here > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes_here))
