"""The command line every numbered script shares, checked before any work starts: a bad value,
a flag the run would ignore, a path that cannot be used or a batch larger than the training set
is one line, exit 2."""
import csv
import inspect
import os
import sys
from pathlib import Path

import torch

from run_keeping.commands import Parser, check_path, invoked, whole_number
from run_keeping.errors import fail
from run_keeping.launch import check_launch
from run_keeping.timing import WARMUP_STEPS
from run_keeping.together import collective_timeout

ROOT = Path(__file__).resolve().parent.parent
# The talk trains 10 epochs from random init (00) and 3 finetuning (01-07); --smoke keeps that
# shape: 4 from random init, 2 finetuning the pretrained smoke ViT.
SMOKE_EPOCHS = {10: 4, 3: 2}
SMOKE_GLOBAL_BATCH = 16   # --smoke splits the talk's batch of 16 across data-parallel replicas
SYNTHETIC_STEPS = 20      # --synthetic trains this many steps (one epoch) unless --max-steps
DATA_FLAGS = ("num_workers", "data_dir", "no_download")  # what only CIFAR-10's loader reads
VITS = {"vit_b_16": "ViT-B/16", "vit_l_16": "ViT-L/16"}  # --vit: the talk's, the memory sequel's
MOST_WORKERS = 64         # --num-workers: loader processes, more than any machine here has cores
# The settings that name a run's checkpoint folder and model file where they differ from the
# script's defaults, so runs of other settings never share them (a --max-steps debugging run
# never replaces the real model): (setting, how it is written in the name).
NAMED_SETTINGS = (("seed", "seed{}"), ("epochs", "epochs{}"), ("batch_size", "batch{}"),
                  ("max_steps", "max-steps{}"), ("world_size", "procs{}"),
                  ("tensor_parallel", "tp{}"), ("vit", "{}"))


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
    add("--max-steps", type=whole_number(1), metavar="N", help=f"train N batches per epoch "
        f"(--synthetic: {SYNTHETIC_STEPS}, one epoch; more than {WARMUP_STEPS}, the untimed "
        "warm-up steps); a run cut short so is recorded as one, not as a result")
    add("--epochs", type=whole_number(1), metavar="N",
        help=f"default {epochs} (--synthetic: 1, --smoke: {smoke_epochs})")
    talks = ", the talk's" if batch_size == 16 else ""
    add("--batch-size", type=whole_number(1), metavar="N", help=f"per process (default {batch_size}"
        f"{talks}; --smoke: {SMOKE_GLOBAL_BATCH} divided among the data-parallel processes)")
    if loader:
        add("--num-workers", type=whole_number(0, MOST_WORKERS), metavar="N",
            help="CIFAR-10 loader processes (default 4)")
    add("--data-dir", metavar="DIR", help="where CIFAR-10 is, or goes (default data)")
    add("--no-download", action="store_true", help="fail instead of downloading CIFAR-10")
    add("--results", default="results/runs.jsonl", metavar="FILE", help="run records, one JSON "
        "line per run, appended (default results/runs.jsonl, under the current folder)")
    add("--save-model", metavar="PATH", help="where the finetuned model goes (default "
        "models/<run>.pt: the script, -smoke/-synthetic, then each setting that differs from "
        "the defaults, as -seed1)")
    add("--vit", choices=list(VITS), help="torchvision's model (default vit_b_16, the talk's; vit_l_16, "
        "304 M parameters, is the sequel's on memory); not with --smoke")
    add("--seed", type=whole_number(0, 2**63 - 1), default=123, metavar="N",
        help="default 123, the talk's")
    add("--accelerator", default="auto", choices=["auto", "cuda", "cpu"],
        help="auto: the GPU if there is one, else the CPU with --smoke")
    if devices is not None:
        capped = f"; --smoke on a CPU: {min(devices, 2)}" if devices > 2 else ""
        add("--devices", type=whole_number(1), metavar="N",
            help=f"processes (GPUs) per machine (default {devices}{capped})")
        add("--num-nodes", type=whole_number(1), default=1, metavar="N", help="machines")
    for flag, keywords in extra:
        add(flag, **keywords)
    add("--checkpoint-dir", metavar="DIR", help="checkpoints to continue from (default "
        "checkpoints/<run>/, named as the model file); every machine must see it")
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
    parser = Parser(description=describe(script))
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
    defaults = {"seed": 123, "vit": "vit_b_16"}
    place_processes(args, parser, devices, defaults)
    settle_sizes(args, parser, epochs, smoke_epochs, batch_size, train_images, defaults)
    args.run_name = run_name(script, args, defaults)
    args.checkpoint_dir_is_default = args.checkpoint_dir is None
    args.checkpoint_dir = args.checkpoint_dir or os.path.join("checkpoints", args.run_name)
    args.save_model = args.save_model or os.path.join("models", args.run_name + ".pt")
    check_path("--results", args.results)
    check_path("--save-model", args.save_model)
    check_path("--checkpoint-dir", args.checkpoint_dir, folder=True)
    check_data_dir(args)
    collective_timeout()
    return args


def check_data_dir(args):
    """--data-dir: a folder CIFAR-10 is in, or one that can be made and written to."""
    args.data_dir = args.data_dir or "data"
    if args.smoke or args.synthetic:
        return
    if Path(args.data_dir).exists() and not Path(args.data_dir).is_dir():
        fail(f"--data-dir {args.data_dir} is a file, not a folder: give the folder CIFAR-10 is in "
             "(or is to be downloaded to)")
    if not args.no_download:
        check_path("--data-dir", args.data_dir, folder=True)


def run_name(script, args, defaults):
    """The name of a run's checkpoint folder and model file: the script, the kind of run, and
    each setting that differs from the script's default (as -seed1 or -max-steps3)."""
    parts = [Path(script).stem, args.kind]
    parts += [spelling.format(getattr(args, key)) for key, spelling in NAMED_SETTINGS
              if key in defaults and getattr(args, key) != defaults[key]]
    return "-".join(part for part in parts if part)


def place_processes(args, parser, devices, defaults):
    """The accelerator, the processes per machine (checked against what the launcher started)
    and how they split into tensor- and data-parallel groups."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.accelerator == "auto":
        if cuda_count == 0 and not args.smoke:
            hint = invoked(*[a for a in sys.argv[1:] if a != "--resume"], "--smoke",
                           *(["--resume"] if args.resume else []))
            fail(f"no CUDA GPU found. A full run on a CPU takes about a day: try {hint}, or add "
                 "--accelerator cpu to insist.")
        args.accelerator = "cuda" if cuda_count else "cpu"
    default_devices = 1 if devices is None else devices
    if devices is not None and args.smoke and args.accelerator == "cpu":
        default_devices = min(devices, 2)  # 2 CPU processes show the technique on a laptop
    if devices is None:
        args.devices, args.num_nodes = 1, 1
    elif args.devices is None:
        args.devices = default_devices
    if args.accelerator == "cuda" and args.devices > cuda_count:
        asked = f"--devices {args.devices}" if devices else "--accelerator cuda"
        fail(f"asked for {args.devices} GPU(s) per machine ({asked}) but this machine has {cuda_count}.")
    cores = os.cpu_count() or 1
    if args.accelerator == "cpu" and args.devices > max(4, cores):
        parser.error(f"--devices {args.devices}: on a CPU each process needs a core; this machine "
                     f"has {cores}")
    check_launch(args, invoked, takes_devices=devices is not None)
    args.world_size = args.devices * args.num_nodes
    args.tensor_parallel = getattr(args, "tensor_parallel", 1)
    if args.world_size % args.tensor_parallel:
        parser.error(f"--tensor-parallel {args.tensor_parallel} does not divide the "
                     f"{args.world_size} processes (--devices x --num-nodes)")
    args.data_parallel = args.world_size // args.tensor_parallel  # replicas that split the batch
    defaults["world_size"] = default_devices
    defaults["tensor_parallel"] = next((kw["default"] for flag, kw in brought_flags()
                                        if flag == "--tensor-parallel"), 1)


def settle_sizes(args, parser, epochs, smoke_epochs, batch_size, train_images, defaults):
    """Epochs, steps and the batch, with what a smoke run's batch is said to be."""
    default_epochs = 1 if args.synthetic else smoke_epochs if args.smoke else epochs
    args.epochs = args.epochs or default_epochs
    defaults["max_steps"] = SYNTHETIC_STEPS if args.synthetic else None
    if args.synthetic and args.max_steps is None:
        args.max_steps = SYNTHETIC_STEPS
    if args.synthetic and args.max_steps <= WARMUP_STEPS and args.epochs == 1:
        parser.error(f"--synthetic measures throughput after {WARMUP_STEPS} untimed warm-up "
                     f"steps: give --max-steps {WARMUP_STEPS + 1} or more")
    talks, replicas = SMOKE_GLOBAL_BATCH, args.data_parallel
    default_batch = max(1, talks // replicas) if args.smoke else batch_size
    args.batch_size = args.batch_size or default_batch
    defaults.update(epochs=default_epochs, batch_size=default_batch)
    if args.batch_size % args.micro_batches:
        parser.error(f"--batch-size {args.batch_size}: this script trains on it in {args.micro_batches} "
                     f"equal micro-batches, so it must divide by {args.micro_batches}")
    args.batch_note = ""
    if args.smoke and talks % replicas and args.batch_size == default_batch:
        args.batch_note = (f" The batch is {args.batch_size} per data-parallel process, "
                           f"{args.batch_size * replicas} in all, not the talk's {talks}: {talks} "
                           f"does not divide by {replicas}.")
    images = None if args.synthetic else (train_images or {}).get(args.kind or "full")
    if images is not None and args.batch_size * replicas > images:
        parser.error(f"--batch-size {args.batch_size}: the {images:,} training images of a "
                     f"{args.kind or 'full'} run make no batch of {args.batch_size} for each of "
                     f"{replicas} data-parallel process(es) (the last partial batch is dropped); "
                     f"the largest that works is {images // replicas}")
    args.whole = args.synthetic or args.max_steps is None  # --max-steps cuts a real run short
