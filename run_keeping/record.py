"""The run record, the one JSON line a finished run appends to --results: its fields and types
(Record), built here (build) and read by every tool through read_runs, which brings an older
record up to this version (upgrade). docs/flags-records-exit-codes.md says what each field means.
"""
import importlib.metadata
import platform
import resource
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import NotRequired, TypedDict

from run_keeping import process_age_s
from run_keeping.files import read_records, sha256

VERSION = 2  # 1: no record_version; "steps" for batches_loaded; none of the fields version 2 added
STRATEGIES = {"SingleDeviceStrategy": "single-device", "DDPStrategy": "ddp",
              "ModelParallelStrategy": "fsdp2-per-block", "FSDPStrategy": "fsdp"}


class Record(TypedDict):
    record_version: int
    # what ran
    script: str
    kind: str
    smoke: bool
    synthetic: bool
    init: str
    whole: bool
    cut_short_by: str | None
    resumed: bool
    launcher: str | None
    accelerator: str
    device_name: str
    devices: int
    num_nodes: int
    world_size: int
    data_parallel_size: int
    tensor_parallel_size: int
    precision: str
    precision_asked: str
    strategy: str
    compiled: bool
    compile_mode: str | None
    model: str
    epochs: int
    batch_size: int
    micro_batches: int
    seed: int
    max_steps: int | None
    batches_loaded: int
    optimizer_steps: int
    schedule: str
    parameters_per_process: list[int]
    optimizer: str
    optimizer_kernel: str
    activation_checkpointing: bool
    parallelize: str | None
    fsdp2_units: int
    cpu_offload_units: int
    # what it measured
    train_time_s: float
    images_per_s: float | None
    timed_images: int
    timed_seconds: float
    warmup_s: float | None
    peak_memory_gb: float
    peak_memory_gb_per_process: list[float]
    train_loss: list[float]
    lr: list[float]
    val_acc: list[float] | None
    lr_end: float
    test_acc: float | None
    checkpoint_s: list[float]
    run_s: float | None
    cpu_s: float
    cpu_wait_share: float | None
    busy: bool
    # the model file, versions, host and time
    model_file: str
    model_sha256: str
    torch: str
    torchvision: str | None
    lightning: str | None
    python: str
    hostname: str
    timestamp: str
    # benchmark.py --memory's own file of runs adds the table a run is for and the libraries' share
    memory_table: NotRequired[str]
    libraries_gb: NotRequired[float]


FIELDS = list(Record.__annotations__)
REQUIRED = [f for f in FIELDS if f in Record.__required_keys__]


def upgrade(record):
    """A record as this version writes it: renamed fields under their new names, None for each it
    lacks."""
    old = dict(record)
    if "steps" in old:  # version 1 counted the batches loaded as "steps"
        old["batches_loaded"] = old.pop("steps")
    old.setdefault("whole", True)  # the first records: no run was cut short
    if not old.get("kind"):  # the first records: the kind from the flags
        old["kind"] = "-".join(k for k in ("smoke", "synthetic") if old.get(k)) or "full"
    if "compile_mode" not in old:  # version 1 compiled with torch.compile's default, or not
        old["compile_mode"] = "default" if old.get("compiled") else None
    return {**dict.fromkeys(REQUIRED), **old, "record_version": VERSION}


def read_runs(path, skip=None, numbered=False):
    return [(n, upgrade(r)) if numbered else upgrade(r) for n, r in read_records(path, skip, numbered=True)]


def record_of(model_file, results):
    """The newest record in `results` that saved the model now in `model_file`, or None."""
    try:
        records = read_runs(results)
        digest = sha256(Path(model_file).read_bytes())
    except (OSError, ValueError):
        return None
    wanted = Path(model_file).resolve()
    return next((r for r in reversed(records) if r["model_file"] and Path(r["model_file"]).resolve() == wanted
                 and r["model_sha256"] in (None, digest)), None)


def build(config, fabric, ran, figures, totals, images_per_s, memory, test_acc, model_sha256):
    """The record of a finished run, from its Config, `ran` (what the keeper saw) and its figures.
    Imports torch here: the tools that only read records never load it."""
    import torch
    from run_keeping.processes import device_name, launcher
    c = config
    strategy = type(fabric.strategy).__name__ if fabric else "SingleDeviceStrategy"
    strategy = "tensor-parallel+fsdp2" if c.tensor_parallel > 1 else STRATEGIES.get(strategy, strategy)
    run_s = process_age_s()
    values = dict(
        record_version=VERSION, script=c.script, kind=c.kind or "full", smoke=c.smoke, synthetic=c.synthetic,
        whole=c.whole, cut_short_by=None if c.whole else f"--max-steps {c.max_steps}", resumed=figures.resumed,
        launcher=launcher(fabric), accelerator=c.accelerator, device_name=device_name(c.accelerator),
        devices=c.devices, num_nodes=c.num_nodes, data_parallel_size=c.data_parallel,
        tensor_parallel_size=c.tensor_parallel, strategy=strategy, compiled=compiled(),
        model="smoke ViT" if c.smoke else c.vit, epochs=c.epochs, batch_size=c.batch_size,
        micro_batches=c.micro_batches, seed=c.seed, max_steps=c.max_steps,
        batches_loaded=figures.batches_loaded, optimizer_steps=figures.optimizer_steps, **ran,
        train_time_s=round(totals["train_time_s"], 3),
        images_per_s=None if images_per_s is None else round(images_per_s, 2),
        timed_images=int(totals["timed_images"]), timed_seconds=round(totals["timed_seconds"], 3),
        warmup_s=totals["warmup_s"] and round(totals["warmup_s"], 3),
        peak_memory_gb=round(max(memory), 4), peak_memory_gb_per_process=[round(m, 4) for m in memory],
        train_loss=figures.train_loss, lr=figures.lr, val_acc=None if c.synthetic else figures.val_acc,
        test_acc=None if c.synthetic else test_acc, checkpoint_s=figures.checkpoint_s,
        run_s=run_s and round(run_s, 3), cpu_s=round(sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), 3),
        model_file=str(c.save_model), model_sha256=model_sha256, torch=torch.__version__,
        torchvision=version("torchvision"), lightning=version("lightning"), python=platform.python_version(),
        hostname=socket.gethostname(), timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    if values.keys() != set(REQUIRED):  # a field built that Record does not declare, or one it lacks
        raise KeyError(f"the record's fields differ from Record's: {sorted(values.keys() ^ set(REQUIRED))}")
    return Record(**{field: values[field] for field in REQUIRED})  # in the schema's order


def techniques(model, optimizer, fabric, scheduler=None):
    """What the memory arithmetic and the bare loop need beyond precision and strategy."""
    from run_keeping.processes import fsdp_units
    parallelize = getattr(getattr(fabric, "strategy", None), "_parallelize_fn", None)
    units, offloaded = fsdp_units(model)
    inner = getattr(optimizer, "optimizer", optimizer)
    return {"optimizer": type(inner).__name__, "optimizer_kernel": optimizer_kernel(inner),
            "activation_checkpointing": any(type(m).__name__ == "CheckpointWrapper" for m in model.modules()),
            "parallelize": getattr(parallelize, "__name__", None), "fsdp2_units": units,
            "cpu_offload_units": offloaded, "schedule": schedule_name(scheduler), "compile_mode": compile_mode(model),
            "lr_end": inner.param_groups[0]["lr"]}


def schedule_name(scheduler):
    """The schedule that ran, as its class names it ("none" without one)."""
    if scheduler is None:
        return "none"
    name = type(scheduler).__name__
    if hasattr(scheduler, "lr_lambdas"):
        name += f"({scheduler.lr_lambdas[0].__qualname__.split('.<locals>')[0]})"
    inner = getattr(scheduler, "_schedulers", None)
    return f"{name}({', '.join(map(schedule_name, inner))})" if inner else name


def optimizer_kernel(optimizer):
    """How torch.optim stepped ("fused", "foreach" or "for-loop"), by its own default where the script
    set neither."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    defaults = optimizer.defaults
    if defaults.get("fused"):
        return "fused"
    if defaults.get("foreach") is not None:
        return "foreach" if defaults["foreach"] else "for-loop"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fused, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return "fused" if fused else "foreach" if foreach else "for-loop"


def compile_mode(model):
    """torch.compile's mode ("default" where none was given), or None: Lightning keeps the call's
    keywords on the module (_compile_kwargs)."""
    from torch._dynamo.eval_frame import OptimizedModule
    for module in (model, getattr(model, "_forward_module", None)):
        if isinstance(module, OptimizedModule):
            return (getattr(module, "_compile_kwargs", None) or {}).get("mode") or "default"
    return None


def compiled():
    dynamo = sys.modules.get("torch._dynamo.utils")
    return bool(dynamo and dynamo.counters["stats"]["unique_graphs"])


def version(package):
    """A package's version without importing it (lightning takes seconds to import)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
