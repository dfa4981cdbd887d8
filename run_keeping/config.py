"""The command line every numbered script shares, parsed once into a frozen Config with every
derived value; a bad value, an ignored flag, an unusable path or a launch that does not match the
flags is one line, exit 2. Also the commands the suite prints and lessons.csv, read here for every
tool. Imports no torch until a script's flags are parsed.
"""
from __future__ import annotations

import argparse
import csv
import os
import shlex
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from run_keeping import fail, start_run
from run_keeping.files import unwritable

ROOT = Path(__file__).resolve().parent.parent
# The talk trains 10 epochs from random init (00) and 3 finetuning (01-07); --smoke keeps that
# shape: 4 from random init, 2 finetuning the pretrained smoke ViT.
SMOKE_EPOCHS = {10: 4, 3: 2}
SMOKE_GLOBAL_BATCH = 16   # --smoke splits the talk's batch of 16 across data-parallel replicas
SYNTHETIC_STEPS = 20      # --synthetic trains this many optimizer steps (one epoch) unless --max-steps
WARMUP_STEPS = 3          # a run's first optimizer steps are not timed (start-up, compilation)
DATA_FLAGS = ("num_workers", "data_dir", "no_download")  # what only CIFAR-10's loader reads
VITS = {"vit_b_16": "ViT-B/16", "vit_l_16": "ViT-L/16"}  # --vit: the talk's, the memory sequel's
MOST_WORKERS = 64         # --num-workers: loader processes, more than any machine here has cores
INTERACTIVE = ("bash", "interactive")  # SLURM job names for which Lightning ignores SLURM
# How long a process waits in a collective for the others once the run is set up: well over a
# checkpoint's write (ViT-L/16 with Adam, some 5 GB), far under NCCL's 10 and Lightning's 30
# minutes. COLLECTIVE_TIMEOUT_S in the environment sets another.
COLLECTIVE_TIMEOUT_S = 300
# The settings that name a run's checkpoint folder and model file where they differ from the
# script's defaults, so runs of other settings never share them (a --max-steps debugging run
# never replaces the real model): (setting, how it is written in the name).
NAMED_SETTINGS = (("seed", "seed{}"), ("epochs", "epochs{}"), ("batch_size", "batch{}"),
                  ("max_steps", "max-steps{}"), ("world_size", "procs{}"),
                  ("tensor_parallel", "tp{}"), ("vit", "{}"))


# -- lessons.csv: every lesson's facts, read here for every tool and test ----------------------
TEXT = ("script", "technique", "change", "against", "precision", "strategy", "compiles", "gpu_check")
WHOLE = ("budget", "epochs", "devices", "min_devices")
LISTED = ("flags", "memory_chain")


def lessons():
    """{script: its row of lessons.csv}, each column typed (None where empty)."""
    with open(ROOT / "lessons.csv") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return {row["script"]: {k: v.split() if k in LISTED else (v or None) if k in TEXT else
                            (int(v) if k in WHOLE else float(v)) if v else None
                            for k, v in row.items()} for row in rows}


# -- the commands the suite prints ---------------------------------------------------------------
def invoked(*flags):
    """The command that runs this program again with `flags`, as it was invoked, quoted for a POSIX
    shell."""
    return " ".join(["python", *map(shlex.quote, [sys.argv[0], *flags])])


def started_flags():
    return [a for a in sys.argv[1:] if a != "--resume"]


def resume_command(flags=None):
    """The command that continues this run (the flags it started with, or `flags`, plus --resume)."""
    command = invoked(*(started_flags() if flags is None else flags), "--resume")
    if "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_JOB_ID" in os.environ:
        return f"the same torchrun/srun launch with --resume added ({command})"
    return command


def start_over_command(folder, parent=None):
    """The commands that drop the unfinished run in `folder` (and `parent` where left empty) and start
    afresh."""
    drop = f"rm -rf {shlex.quote(str(folder))}"
    if parent is not None:
        drop += f" && rmdir {shlex.quote(str(parent))} 2>/dev/null"
    return f"{drop}; {invoked(*started_flags())}"


def chart_command(kind, results):
    """The command that charts the `kind` runs in `results`, beside the program that prints it."""
    flags = "".join(f" --{k}" for k in kind.split("-") if k != "full")
    where = "" if str(results) == "results/runs.jsonl" else f" --results {shlex.quote(str(results))}"
    beside = Path(sys.argv[0]).with_name("plot_results.py")  # as the program was invoked
    return f"python {shlex.quote(str(beside if beside.exists() else ROOT / 'plot_results.py'))}{flags}{where}"


def kind_flags(kind):
    return "".join(f" --{k}" for k in kind.split("-") if k)


# -- one-line errors for every value -------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (`<program>: error: ...`, exit 2)."""

    def error(self, message):
        fail(f"{message}; {invoked('--help')} lists the flags")

    def parse_known_args(self, args=None, namespace=None):
        start_run()  # the program's start: its exit handlers, one line for a Ctrl-C from here on
        return super().parse_known_args(args, namespace)


def whole_number(minimum, maximum=None):
    def check(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,}, got {value:,}")
        return value
    return check


def check_path(flag, path, folder=False):
    problem = unwritable(path, folder=folder)
    if problem:
        fail(f"{flag} {path} cannot be written: {problem}")


def collective_timeout():
    """COLLECTIVE_TIMEOUT_S (or its default) as a timedelta; one line, exit 2, if it is no positive
    number."""
    given = os.environ.get("COLLECTIVE_TIMEOUT_S", str(COLLECTIVE_TIMEOUT_S))
    try:
        timeout = timedelta(seconds=float(given))
    except (ValueError, OverflowError):
        timeout = None
    if timeout is None or timeout.total_seconds() <= 0:
        fail(f"COLLECTIVE_TIMEOUT_S={given!r}: give the seconds a process waits for the others, "
             f"a number over 0 (default {COLLECTIVE_TIMEOUT_S})")
    return timeout


# -- the run's config ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """What a run is, as its flags and their derived values say; made once, by parse_args."""
    script: str            # the script's file name
    kind: str              # "", "smoke", "synthetic" or "smoke-synthetic"
    smoke: bool
    synthetic: bool
    accelerator: str       # "cuda" or "cpu" (auto decided)
    devices: int           # processes per machine
    num_nodes: int
    world_size: int        # devices x num_nodes
    tensor_parallel: int   # processes that split each MLP (10), else 1
    data_parallel: int     # replicas that split the batch: world_size / tensor_parallel
    epochs: int
    batch_size: int        # per data-parallel process
    micro_batches: int     # the parts the loader hands each batch out in (12-14's accumulation)
    max_steps: int | None  # optimizer steps per epoch, where cut short (or --synthetic)
    whole: bool            # not cut short by --max-steps: a result, not a debugging run
    seed: int
    vit: str
    num_workers: int
    data_dir: str
    no_download: bool
    results: str
    save_model: str
    checkpoint_dir: str
    checkpoint_dir_is_default: bool
    resume: bool           # --resume was given (a requeued job continues without it: RunKeeper)
    run_name: str
    batch_note: str        # what a smoke run's batch is, where 16 does not divide among the replicas
    own: dict = field(default_factory=dict)  # the script's own flags (09's --compile-on-cpu)

    def __getattr__(self, name):  # a script's own flag, as config.compile_on_cpu
        own = self.__dict__.get("own", {})
        if name in own:
            return own[name]
        raise AttributeError(f"the run's config has no {name!r}")


def check_versions(script):
    """One line, exit 2, where a library is older than requirements.txt's lower bound."""
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


# The flags a lesson's technique brings (lessons.csv's flags column names them per script).
TECHNIQUE_FLAGS = {"--tensor-parallel": dict(
    type=whole_number(1), default=2, metavar="N", help="processes that split each MLP between "
    "them (default 2); the rest of --devices x --num-nodes is data parallel")}


def add_flags(parser, epochs, devices, batch_size, smoke_epochs, loader, own):
    add = parser.add_argument
    add("--smoke", action="store_true", help="offline demo on the CPU: a small ViT (pretrained on "
        "printed digits where the full run loads ImageNet weights) on scikit-learn's 8x8 "
        "handwritten digits (32x32); docs/smoke.md")
    add("--synthetic", action="store_true", help="random images and labels of the run's shape, "
        "random init, nothing downloaded: for throughput and memory (no accuracy)")
    add("--max-steps", type=whole_number(1), metavar="N", help=f"train N optimizer steps per epoch "
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
    for flag, keywords in own:
        add(flag, **keywords)
    add("--checkpoint-dir", metavar="DIR", help="checkpoints to continue from (default "
        "checkpoints/<run>/, named as the model file); every machine must see it")
    add("--resume", action="store_true", help="continue the run in --checkpoint-dir")


def parse_args(epochs, devices=None, batch_size=16, smoke_epochs=None, flags=(), loader=True,
               train_images=None, micro_batches=1):
    """The run's Config. `devices`: the Fabric scripts' --devices and --num-nodes default; `flags`: the
    script's own (flag, add_argument keywords); `loader=False`: no loader workers; `train_images`:
    {kind: training images} to check the batch against; `micro_batches`: the parts each batch is
    handed out in."""
    script = Path(sys.argv[0]).name
    check_versions(script)
    smoke_epochs = smoke_epochs or SMOKE_EPOCHS.get(epochs, 2)
    row = lessons().get(script, {})
    brought = [(flag, TECHNIQUE_FLAGS[flag]) for flag in row.get("flags") or ()]
    parser = Parser(description=describe(script, row))
    add_flags(parser, epochs, devices, batch_size, smoke_epochs, loader, [*flags, *brought])
    given = parser.parse_args()
    kind = "-".join(k for k in ("smoke", "synthetic") if getattr(given, k))
    check_kind(given, kind, parser)
    places = place_processes(given, parser, devices, brought)
    sizes = settle_sizes(given, parser, kind, places, epochs, smoke_epochs, batch_size,
                         train_images, micro_batches)
    defaults = {"seed": 123, "vit": "vit_b_16", **places.pop("defaults"), **sizes.pop("defaults")}
    chosen = {**vars(given), **places, **sizes, "vit": given.vit or "vit_b_16"}
    name = run_name(script, kind, chosen, defaults)
    own = {flag.lstrip("-").replace("-", "_") for flag, _ in flags}
    config = Config(
        script=script, kind=kind, smoke=given.smoke, synthetic=given.synthetic, **places, **sizes,
        seed=given.seed, vit=chosen["vit"],
        num_workers=4 if getattr(given, "num_workers", None) is None else given.num_workers,
        data_dir=given.data_dir or "data", no_download=given.no_download, results=given.results,
        save_model=given.save_model or os.path.join("models", name + ".pt"),
        checkpoint_dir=given.checkpoint_dir or os.path.join("checkpoints", name),
        checkpoint_dir_is_default=given.checkpoint_dir is None, resume=given.resume,
        run_name=name, own={k: getattr(given, k) for k in own})
    check_path("--results", config.results)
    check_path("--save-model", config.save_model)
    check_path("--checkpoint-dir", config.checkpoint_dir, folder=True)
    check_data_dir(config)
    collective_timeout()
    return config


def describe(script, row):
    return f"{script}: {row['technique']}. Changes {row['change']}." if row else script


def check_kind(given, kind, parser):
    ignored = [f"--{k.replace('_', '-')}" for k in DATA_FLAGS if getattr(given, k, None) not in (None, False)]
    if ignored and kind:
        parser.error(f"{' and '.join(ignored)}: a {kind} run reads no CIFAR-10 (its data are "
                     "made in memory); drop " + ("them" if len(ignored) > 1 else "it"))
    if given.smoke and given.vit:
        parser.error("--vit: a smoke run trains its own small ViT; drop it")


def check_data_dir(config):
    if config.smoke or config.synthetic:
        return
    if Path(config.data_dir).exists() and not Path(config.data_dir).is_dir():
        fail(f"--data-dir {config.data_dir} is a file, not a folder: give the folder CIFAR-10 is in "
             "(or is to be downloaded to)")
    if not config.no_download:
        check_path("--data-dir", config.data_dir, folder=True)


def run_name(script, kind, chosen, defaults):
    """The name of a run's checkpoint folder and model file: the script, the kind, each setting that
    differs from its default."""
    parts = [Path(script).stem, kind]
    parts += [spelling.format(chosen[key]) for key, spelling in NAMED_SETTINGS
              if key in defaults and chosen[key] != defaults[key]]
    return "-".join(part for part in parts if part)


def place_processes(given, parser, devices, brought):
    """The accelerator, the processes per machine and their tensor- and data-parallel split, with the
    defaults the run name is measured against."""
    import torch
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    accelerator = given.accelerator
    if accelerator == "auto":
        if cuda_count == 0 and not given.smoke:
            hint = invoked(*[a for a in sys.argv[1:] if a != "--resume"], "--smoke",
                           *(["--resume"] if given.resume else []))
            fail(f"no CUDA GPU found. A full run on a CPU takes about a day: try {hint}, or add "
                 "--accelerator cpu to insist.")
        accelerator = "cuda" if cuda_count else "cpu"
    default_devices = 1 if devices is None else devices
    if devices is not None and given.smoke and accelerator == "cpu":
        default_devices = min(devices, 2)  # 2 CPU processes show the technique on a laptop
    count = 1 if devices is None else given.devices or default_devices
    num_nodes = 1 if devices is None else given.num_nodes
    if accelerator == "cuda" and count > cuda_count:
        asked = f"--devices {count}" if devices else "--accelerator cuda"
        fail(f"asked for {count} GPU(s) per machine ({asked}) but this machine has {cuda_count}.")
    cores = os.cpu_count() or 1
    if accelerator == "cpu" and count > max(4, cores):
        parser.error(f"--devices {count}: on a CPU each process needs a core; this machine "
                     f"has {cores}")
    check_launch(count, num_nodes, takes_devices=devices is not None)
    tensor_parallel = getattr(given, "tensor_parallel", 1)
    if (count * num_nodes) % tensor_parallel:
        parser.error(f"--tensor-parallel {tensor_parallel} does not divide the "
                     f"{count * num_nodes} processes (--devices x --num-nodes)")
    return {"accelerator": accelerator, "devices": count, "num_nodes": num_nodes,
            "world_size": count * num_nodes, "tensor_parallel": tensor_parallel,
            "data_parallel": count * num_nodes // tensor_parallel,
            "defaults": {"world_size": default_devices, "tensor_parallel": next(
                (kw["default"] for flag, kw in brought if flag == "--tensor-parallel"), 1)}}


def settle_sizes(given, parser, kind, places, epochs, smoke_epochs, batch_size, train_images,
                 micro_batches):
    default_epochs = 1 if given.synthetic else smoke_epochs if given.smoke else epochs
    max_steps = given.max_steps
    if given.synthetic and max_steps is None:
        max_steps = SYNTHETIC_STEPS
    chosen_epochs = given.epochs or default_epochs
    if given.synthetic and max_steps <= WARMUP_STEPS and chosen_epochs == 1:
        parser.error(f"--synthetic measures throughput after {WARMUP_STEPS} untimed warm-up "
                     f"steps: give --max-steps {WARMUP_STEPS + 1} or more")
    talks, replicas = SMOKE_GLOBAL_BATCH, places["data_parallel"]
    default_batch = max(1, talks // replicas) if given.smoke else batch_size
    batch = given.batch_size or default_batch
    if batch % micro_batches:
        parser.error(f"--batch-size {batch}: this script trains on it in {micro_batches} "
                     f"equal micro-batches, so it must divide by {micro_batches}")
    note = ""
    if given.smoke and talks % replicas and batch == default_batch:
        note = (f" The batch is {batch} per data-parallel process, {batch * replicas} in all, not "
                f"the talk's {talks}: {talks} does not divide by {replicas}.")
    images = None if given.synthetic else (train_images or {}).get(kind or "full")
    if images is not None and batch * replicas > images:
        parser.error(f"--batch-size {batch}: the {images:,} training images of a "
                     f"{kind or 'full'} run make no batch of {batch} for each of "
                     f"{replicas} data-parallel process(es) (the last partial batch is dropped); "
                     f"the largest that works is {images // replicas}")
    return {"epochs": chosen_epochs, "batch_size": batch, "micro_batches": micro_batches,
            "max_steps": max_steps, "whole": given.synthetic or max_steps is None, "batch_note": note,
            "defaults": {"epochs": default_epochs, "batch_size": default_batch,
                         "max_steps": SYNTHETIC_STEPS if given.synthetic else None}}


# -- the launch: the processes that were started must be the run the flags ask for ---------------
def tasks_per_node(text):
    return int(text.split("(")[0])


def check_launch(devices, num_nodes, takes_devices):
    """One line, exit 2, where the started processes cannot be the run the flags ask for: srun's or
    torchrun's counts differ, several SLURM tasks without srun, several machines with no launcher.
    Lightning ignores SLURM when the job name is "bash" or "interactive"."""
    env, asked = os.environ, f"--devices {devices} --num-nodes {num_nodes}"
    first = int(env.get("SLURM_PROCID", env.get("RANK", "0"))) == 0  # says it for all of them

    def refuse(message):
        fail(message, say=first)
    flags = "" if takes_devices else " (this script runs one process)"
    job = env.get("SLURM_JOB_NAME")
    if "SLURM_NTASKS" in env and job not in INTERACTIVE:
        ntasks, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))
        if "SLURM_STEP_ID" not in env and ntasks > 1:
            refuse(f"SLURM gave this job {ntasks} tasks, but this process was started without srun, "
                   f"so it would wait for the others forever: start it with srun {invoked(*sys.argv[1:])}")
        if "SLURM_NTASKS_PER_NODE" not in env:
            refuse(f"SLURM started {ntasks} tasks with --ntasks, which does not say how many run "
                   "on each machine: use #SBATCH --ntasks-per-node (one task per GPU) instead")
        per_node = tasks_per_node(env["SLURM_NTASKS_PER_NODE"])
        if (per_node, nodes) != (devices, num_nodes):
            refuse(f"SLURM started {per_node} task(s) per machine on {nodes} machine(s) "
                   f"(--ntasks-per-node {per_node}, --nodes {nodes}), but the flags ask for {asked}"
                   f"{flags}: make the two agree (one task per GPU)")
    elif "TORCHELASTIC_RUN_ID" in env:
        local, world = int(env.get("LOCAL_WORLD_SIZE", "1")), int(env.get("WORLD_SIZE", "1"))
        if (local, world) != (devices, devices * num_nodes):
            refuse(f"torchrun started {local} process(es) here and {world} in all, but the flags ask "
                   f"for {asked}{flags}: make --nproc-per-node and --nnodes agree with them")
    elif num_nodes > 1 and "NODE_RANK" not in env:
        inside = (f" Inside `srun --pty bash` (SLURM job name {job!r}) Lightning does not use "
                  "SLURM: submit the job script with sbatch instead." if job in INTERACTIVE else "")
        refuse(f"--num-nodes {num_nodes}: processes on other machines need a launcher: srun in "
               "a SLURM job, or torchrun on each machine (README: Running on several machines)."
               f"{inside}")
