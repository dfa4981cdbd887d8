"""The run record: one JSON line per finished run saying what ran and what it measured."""
import importlib.metadata
import os
import platform
import resource
import socket
import sys
from datetime import datetime, timezone

import torch

WHAT_RUNS = {"smoke": "a 3-layer ViT ({init}) trained on scikit-learn's 8x8 handwritten digits",
             "synthetic": "{vit} from random init on random images and labels",
             "smoke-synthetic": "the 3-layer smoke ViT from random init on random 32x32 images and labels"}
STRATEGIES = {"SingleDeviceStrategy": "single-device", "DDPStrategy": "ddp",
              "ModelParallelStrategy": "fsdp2-per-block", "FSDPStrategy": "fsdp"}


def kind_line(args):
    """What a smoke or synthetic run is, said before its training and again at its end."""
    from run_keeping.flags import VITS
    what = WHAT_RUNS[args.kind].format(init=getattr(args, "init", "random init"), vit=VITS[args.vit])
    return (f"{args.kind.upper().replace('-', '+')} RUN on {device_name(args.accelerator)}: {what}. "
            f"Not the talk's experiment; its figures are not the talk's.{getattr(args, 'batch_note', '')}")


def techniques(model, optimizer, fabric):
    """What the memory arithmetic needs that the precision and strategy do not say: the optimizer,
    whether blocks are checkpointed, the parallelize function, and the FSDP2 units and how many
    of them keep their shards in CPU memory (15's offload), as the model carries them."""
    from run_keeping.devices import fsdp_units
    parallelize = getattr(getattr(fabric, "strategy", None), "_parallelize_fn", None)
    units, offloaded = fsdp_units(model)
    return {"optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
            "activation_checkpointing": any(type(m).__name__ == "CheckpointWrapper" for m in model.modules()),
            "parallelize": getattr(parallelize, "__name__", None),
            "fsdp2_units": units, "cpu_offload_units": offloaded}


def make_record(args, fabric, keeper, totals, images_per_s, memory, test_acc):
    """What ran (script, kind, start, machine, processes, precision, strategy, settings) and what
    it measured (time, throughput, memory, per-epoch loss, lr and validation accuracy, test
    accuracy), the model file, versions, host and time."""
    precision = fabric.strategy.precision.precision if fabric else "32-true"
    strategy = type(fabric.strategy).__name__ if fabric else "SingleDeviceStrategy"
    strategy = "tensor-parallel+fsdp2" if args.tensor_parallel > 1 else STRATEGIES.get(strategy, strategy)
    return {
        "script": args.script, "kind": args.kind or "full", "smoke": args.smoke,
        "synthetic": args.synthetic, "init": getattr(args, "init", None),
        "whole": args.whole, "cut_short_by": None if args.whole else f"--max-steps {args.max_steps}",
        "resumed": keeper.resumed, "launcher": launcher(fabric), "accelerator": args.accelerator,
        "device_name": device_name(args.accelerator), "devices": args.devices,
        "num_nodes": args.num_nodes, "world_size": keeper.world_size,
        "data_parallel_size": args.data_parallel, "tensor_parallel_size": args.tensor_parallel,
        "precision": precision, "strategy": strategy,
        "model": "smoke ViT" if args.smoke else args.vit, "epochs": args.epochs,
        "batch_size": args.batch_size, "micro_batches": args.micro_batches, "seed": args.seed,
        "max_steps": args.max_steps, "steps": keeper.steps,
        "train_time_s": round(totals["train_time_s"], 3),
        "images_per_s": None if images_per_s is None else round(images_per_s, 2),
        "timed_images": int(totals["timed_images"]),
        "timed_seconds": round(totals["timed_seconds"], 3),
        "peak_memory_gb": round(max(memory), 4), "peak_memory_gb_per_process": [round(m, 4) for m in memory],
        **keeper.techniques,
        "parameters_per_process": [int(n) for n in keeper.held_parameters],
        "train_loss": keeper.train_loss, "lr": keeper.lr,
        "val_acc": None if args.synthetic else keeper.val_acc,
        "test_acc": None if args.synthetic else test_acc,
        "model_file": str(args.save_model), "compiled": compiled(),
        "checkpoint_s": keeper.checkpoint_s,
        "torch": torch.__version__, "torchvision": version("torchvision"),
        "lightning": version("lightning"), "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def launcher(fabric):
    """Which launcher started the run's processes (Lightning's name for it), or None."""
    environment = getattr(getattr(fabric, "strategy", None), "cluster_environment", None)
    return type(environment).__name__ if environment is not None else None


def compiled():
    """Whether torch.compile compiled anything in this process."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return bool(dynamo and dynamo.counters["stats"]["unique_graphs"])


def version(package):
    """A package's version without importing it (lightning takes seconds to import)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(accelerator):
    """The GPU's name, or the CPU's model, cores and the bfloat16 matrix units it has (what makes
    bf16 fast or slow on it)."""
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
