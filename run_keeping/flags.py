"""The command line every numbered script shares, checked before any work starts: a bad value,
a flag the run would ignore, or a batch larger than the training set is one line, exit 2."""
import argparse
import csv
import inspect
import os
import sys
from pathlib import Path

import torch

from run_keeping.errors import fail
from run_keeping.files import unwritable
from run_keeping.timing import WARMUP_STEPS

ROOT = Path(__file__).resolve().parent.parent
# The talk trains 10 epochs from random init (00) and 3 finetuning (01-07); --smoke keeps that
# shape: 4 from random init, 2 finetuning the pretrained smoke ViT.
SMOKE_EPOCHS = {10: 4, 3: 2}
SMOKE_GLOBAL_BATCH = 16   # --smoke splits the talk's batch of 16 across data-parallel replicas
SYNTHETIC_STEPS = 20      # --synthetic trains this many steps (one epoch) unless --max-steps
DATA_FLAGS = ("num_workers", "data_dir", "no_download")  # what only CIFAR-10's loader reads
VITS = {"vit_b_16": "ViT-B/16", "vit_l_16": "ViT-L/16"}  # --vit: the talk's, the memory sequel's


def check_versions(script):
    """One line, exit 2, when an installed library is older than requirements.txt's lower bound
    (its comment says why each bound is what it is)."""
    import importlib.metadata
    import re
    from packaging.version import Version
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        found = re.match(r"^(torch|torchvision|lightning|torchmetrics)>=([\d.]+)", line)
        if not found:
            continue
        try:
            installed = importlib.metadata.version(found[1])
        except importlib.metadata.PackageNotFoundError:
            continue  # the import at the script's top says so
        if Version(installed.split("+")[0]) < Version(found[2]):
            fail(f"{script} needs {found[1]} >= {found[2]} (requirements.txt says why); this is "
                 f"{installed}. pip install -r requirements.txt brings it.")


def at_least(minimum):
    def check(text):
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
        return value
    return check


def describe(script):
    """--help's opening: the script's technique and change (talk_reference.csv), else the first
    paragraph of its docstring."""
    with open(ROOT / "talk_reference.csv") as f:
        for row in csv.DictReader(line for line in f if not line.startswith("#")):
            if row["script"] == script:
                return f"{script}: {row['technique']}. Changes {row['change']}."
    return " ".join((sys.modules["__main__"].__doc__ or "").strip().split("\n\n")[0].split())


def brought_flags():
    """Flags that the functions a script imports bring with them (`fn.flags`: pairs of a flag
    and add_argument's keywords): 10's tensor_parallel_mlps_then_fsdp brings --tensor-parallel,
    so the script that uses a technique is the one that has its flag."""
    main = sys.modules.get("__main__")
    return [flag for value in (vars(main).values() if main else ())
            if inspect.isfunction(value) for flag in getattr(value, "flags", ())]


def add_flags(parser, epochs, devices, batch_size, smoke_epochs, loader, extra):
    add = parser.add_argument
    add("--smoke", action="store_true", help="offline demo on the CPU: a small ViT (pretrained on "
        "printed digits where the full run loads ImageNet weights) on scikit-learn's 8x8 "
        "handwritten digits (32x32); docs/smoke.md")
    add("--synthetic", action="store_true", help="random images and labels of the run's shape, "
        "random init, nothing downloaded: for throughput and memory (no accuracy)")
    add("--max-steps", type=at_least(1), metavar="N", help=f"train N batches per epoch "
        f"(--synthetic: {SYNTHETIC_STEPS}, one epoch; more than {WARMUP_STEPS}, the untimed warm-up steps)")
    add("--epochs", type=at_least(1), metavar="N",
        help=f"default {epochs} (--synthetic: 1, --smoke: {smoke_epochs})")
    talks = ", the talk's" if batch_size == 16 else ""
    add("--batch-size", type=at_least(1), metavar="N", help=f"per process (default {batch_size}"
        f"{talks}; --smoke: {SMOKE_GLOBAL_BATCH} divided among the data-parallel processes)")
    if loader:
        add("--num-workers", type=at_least(0), metavar="N", help="CIFAR-10 loader processes (default 4)")
    add("--data-dir", metavar="DIR", help="where CIFAR-10 is, or goes (default data)")
    add("--no-download", action="store_true", help="fail instead of downloading CIFAR-10")
    add("--results", default="results/runs.jsonl", metavar="FILE", help="run records, one JSON "
        "line per run, appended (default results/runs.jsonl, under the current folder)")
    add("--save-model", metavar="PATH", help="where the finetuned model goes (default "
        "models/<script>.pt, -smoke/-synthetic before .pt)")
    add("--vit", choices=list(VITS), help="torchvision's model (default vit_b_16, the talk's; vit_l_16, "
        "304 M parameters, is the sequel's on memory); not with --smoke")
    add("--seed", type=int, default=123, help="default 123, the talk's")
    add("--accelerator", default="auto", choices=["auto", "cuda", "cpu"],
        help="auto: the GPU if there is one, else the CPU with --smoke")
    if devices is not None:
        capped = f"; --smoke on a CPU: {min(devices, 2)}" if devices > 2 else ""
        add("--devices", type=at_least(1), metavar="N",
            help=f"processes (GPUs) per machine (default {devices}{capped})")
        add("--num-nodes", type=at_least(1), default=1, metavar="N", help="machines")
    for flag, keywords in extra:
        add(flag, **keywords)
    add("--checkpoint-dir", metavar="DIR", help="per-epoch checkpoints (default "
        "checkpoints/<script>/, -smoke/-synthetic suffix); every machine must see it")
    add("--resume", action="store_true", help="continue the run in --checkpoint-dir")


def parse_args(epochs, devices=None, batch_size=16, smoke_epochs=None, flags=(), loader=True,
               train_images=None, micro_batches=1):
    """The flags; `auto` becomes `cuda` or `cpu`. `devices` given: the Fabric scripts' --devices
    and --num-nodes with that default. `flags`: the script's own; `loader=False`: the script
    has no loader workers; `train_images`: {kind: training images}, to check the batch against;
    `micro_batches`: the loader hands out each batch in that many parts (gradient accumulation)."""
    script = Path(sys.argv[0]).name
    check_versions(script)
    smoke_epochs = smoke_epochs or SMOKE_EPOCHS.get(epochs, 2)
    parser = argparse.ArgumentParser(description=describe(script))
    add_flags(parser, epochs, devices, batch_size, smoke_epochs, loader, [*flags, *brought_flags()])
    args = parser.parse_args()
    args.micro_batches = micro_batches
    args.script, args.kind = script, "-".join(k for k in ("smoke", "synthetic") if getattr(args, k))
    ignored = [f"--{k.replace('_', '-')}" for k in DATA_FLAGS if getattr(args, k, None) not in (None, False)]
    if ignored and (args.smoke or args.synthetic):
        parser.error(f"{' and '.join(ignored)}: a {args.kind} run reads no CIFAR-10 (its data are "
                     "made in memory); drop " + ("them" if len(ignored) > 1 else "it"))
    if args.smoke and args.vit:
        parser.error("--vit: a smoke run trains its own small ViT; drop it")
    args.vit = args.vit or "vit_b_16"
    args.num_workers = 4 if getattr(args, "num_workers", None) is None else args.num_workers
    args.data_dir = args.data_dir or "data"
    place_processes(args, parser, devices, script)
    settle_sizes(args, parser, epochs, smoke_epochs, batch_size, train_images)
    suffix = f"-{args.kind}" if args.kind else ""
    args.checkpoint_dir_is_default = args.checkpoint_dir is None
    args.checkpoint_dir = args.checkpoint_dir or os.path.join("checkpoints", Path(script).stem + suffix)
    args.save_model = args.save_model or os.path.join("models", Path(script).stem + suffix + ".pt")
    for flag, path in (("--results", args.results), ("--save-model", args.save_model)):
        problem = unwritable(path)
        if problem:
            parser.error(f"{flag} {path} cannot be written: {problem}")
    return args


def place_processes(args, parser, devices, script):
    """The accelerator, the processes per machine and how they split into tensor- and
    data-parallel groups."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.accelerator == "auto":
        if cuda_count == 0 and not args.smoke:
            hint = " --smoke --resume to continue a smoke run" if args.resume else " --smoke"
            parser.exit(2, f"{parser.prog}: error: no CUDA GPU found. A full run on a CPU takes "
                           f"about a day: try python {script}{hint}, or add --accelerator cpu "
                           "to insist.\n")
        args.accelerator = "cuda" if cuda_count else "cpu"
    if devices is None:
        args.devices, args.num_nodes = 1, 1
    elif args.devices is None:
        args.devices = devices
        if args.smoke and args.accelerator == "cpu":
            args.devices = min(devices, 2)  # 2 CPU processes show the technique on a laptop
    if args.accelerator == "cuda" and args.devices > cuda_count:
        asked = f"--devices {args.devices}" if devices else "--accelerator cuda"
        parser.exit(2, f"{parser.prog}: error: asked for {args.devices} GPU(s) per machine "
                       f"({asked}) but this machine has {cuda_count}.\n")
    args.world_size = args.devices * args.num_nodes
    args.tensor_parallel = getattr(args, "tensor_parallel", 1)
    if args.world_size % args.tensor_parallel:
        parser.error(f"--tensor-parallel {args.tensor_parallel} does not divide the "
                     f"{args.world_size} processes (--devices x --num-nodes)")
    args.data_parallel = args.world_size // args.tensor_parallel  # replicas that split the batch


def settle_sizes(args, parser, epochs, smoke_epochs, batch_size, train_images):
    """Epochs, steps and the batch, with what a smoke run's batch is said to be."""
    if args.epochs is None:
        args.epochs = 1 if args.synthetic else smoke_epochs if args.smoke else epochs
    if args.synthetic and args.max_steps is None:
        args.max_steps = SYNTHETIC_STEPS
    if args.synthetic and args.max_steps <= WARMUP_STEPS and args.epochs == 1:
        parser.error(f"--synthetic measures throughput after {WARMUP_STEPS} untimed warm-up "
                     f"steps: give --max-steps {WARMUP_STEPS + 1} or more")
    talks, replicas = SMOKE_GLOBAL_BATCH, args.data_parallel
    if args.batch_size is None:
        args.batch_size = max(1, talks // replicas) if args.smoke else batch_size
    if args.batch_size % args.micro_batches:
        parser.error(f"--batch-size {args.batch_size}: this script trains on it in {args.micro_batches} "
                     f"equal micro-batches, so it must divide by {args.micro_batches}")
    args.batch_note = ""
    if args.smoke and talks % replicas and args.batch_size == max(1, talks // replicas):
        args.batch_note = (f" The batch is {args.batch_size} per data-parallel process, "
                           f"{args.batch_size * replicas} in all, not the talk's {talks}: {talks} "
                           f"does not divide by {replicas}.")
    images = None if args.synthetic else (train_images or {}).get(args.kind or "full")
    if images is not None and args.batch_size * replicas > images:
        parser.error(f"--batch-size {args.batch_size}: the {images:,} training images of a "
                     f"{args.kind or 'full'} run make no batch of {args.batch_size} for each of "
                     f"{replicas} data-parallel process(es) (the last partial batch is dropped); "
                     f"the largest that works is {images // replicas}")
