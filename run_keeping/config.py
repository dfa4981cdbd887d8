"""The command line every numbered script shares, parsed once: a bad value, an ignored flag, an
unusable path or a launch that does not match the flags is one line and exit 2. Where the device
has no native bfloat16 it sets LT_PRECISION, which the lesson's Fabric(...) reads; from its start
Ctrl-C and SIGTERM end the program in one line (docs/run-keeping.md). Also lessons.csv, read here."""

import argparse
import csv
import math
import os
import shlex
import signal
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOKE_EPOCHS = {10: 4, 3: 2}  # --smoke keeps the talk's shape: 4 epochs from random init, 2 finetuning
SMOKE_GLOBAL_BATCH = 16  # --smoke splits the talk's batch of 16 across data-parallel replicas
SYNTHETIC_STEPS = 20  # --synthetic trains this many optimizer steps (one epoch) unless --max-steps
WARMUP_STEPS = 3  # a run's first optimizer steps are not timed (start-up, compilation)
DATA_FLAGS = ("num_workers", "data_dir", "no_download")  # what only CIFAR-10's loader reads
VITS = {"vit_b_16": "ViT-B/16", "vit_l_16": "ViT-L/16"}  # --vit: the talk's, the memory sequel's
MOST_WORKERS = 64  # --num-workers: loader processes, more than any machine here has cores
INTERACTIVE = ("bash", "interactive")  # SLURM job names for which Lightning ignores SLURM
EXIT_ON_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}
# The settings that name a run's checkpoint folder and model file where they differ from the
# script's defaults, so runs of other settings never share them, with their spelling there.
# A lesson's own flags (lessons.csv) follow, as the flag and its value: --max-norm 0.5 as max-norm0.5.
NAMED_SETTINGS = {"seed": "seed{}", "epochs": "epochs{}", "batch_size": "batch{}", "max_steps": "max-steps{}"}
NAMED_SETTINGS |= {"world_size": "procs{}", "vit": "{}"}
# What a bf16 precision becomes where the device has no native bfloat16: on a GPU, bf16-mixed
# becomes 16-mixed unless sharded (Fabric's ModelParallelStrategy takes no 16-mixed); otherwise
# 32-true (a CPU's float16 is emulated too; 16-true would lose Adam's small steps).
FALLBACKS = {("cuda", "bf16-mixed", False): "16-mixed"}


def fail(message, code=2):
    """`<program>: error: <message>` on one line of stderr, then exit with `code`."""
    print(f"{Path(sys.argv[0]).name}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def lesson_rows():
    """lessons.csv: {script: its row}, as text (reading.lessons types it for the tools)."""
    with open(ROOT / "lessons.csv") as f:
        return {row["script"]: row for row in csv.DictReader(line for line in f if not line.startswith("#"))}


def invoked(*flags):
    """The command that runs this program again with `flags`, quoted for a POSIX shell."""
    return " ".join(["python", *map(shlex.quote, [sys.argv[0], *flags])])


def started_flags():
    return [a for a in sys.argv[1:] if a != "--resume"]


def resume_command(flags=None):
    """The command that continues this run (its flags, or `flags`, plus --resume)."""
    command = invoked(*(started_flags() if flags is None else flags), "--resume")
    if "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_JOB_ID" in os.environ:
        return f"the same torchrun/srun launch with --resume added ({command})"
    return command


def on_signals(handler):
    """The one place a handler for Ctrl-C and SIGTERM is installed: parse_args installs the starting
    one; RunKeeper its own while the run trains, and one that notes a signal while the run ends."""
    for signum in EXIT_ON_SIGNAL:
        signal.signal(signum, handler)


def stop_while_starting(signum, frame=None):
    name = signal.Signals(signum).name
    print(f"\n{Path(sys.argv[0]).name}: interrupted ({name}) while starting; nothing was written.", file=sys.stderr)
    sys.stderr.flush()
    os._exit(EXIT_ON_SIGNAL[signum])  # at once: an import may be half done, and nothing is to be kept


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (exit 2)."""

    def error(self, message):
        fail(f"{message}; {invoked('--help')} lists the flags")


def whole_number(minimum, maximum=None):
    return number(int, minimum, maximum)


def number(kind, least=None, most=None, above=None):
    """argparse's type for a number of `kind` (int or float) within its range: one line otherwise."""

    def check(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {NUMBER_WORDS[kind]}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if least is not None and value < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, got {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:,}, got {value:,}")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"must be above {above}, got {value}")
        return value

    return check


NUMBER_WORDS = {int: "whole number", float: "number"}


def own_flags(row):
    """The flags a lesson's row declares (lessons.csv's flags column), each (flag, its declaration):
    --max-norm type=float default=1.0 above=0 help='...' is ("--max-norm", {"type": "float", ...})."""
    declared = []
    for word in shlex.split(row.get("flags") or ""):
        if word.startswith("--"):
            declared.append((word, {}))
        else:
            key, _, value = word.partition("=")
            declared[-1][1][key] = value
    return declared


def dest(flag):
    """A flag's name in the settings: --max-norm is max_norm."""
    return flag[2:].replace("-", "_")


def group_size(declared, settings):
    """The processes that hold one replica of the model: the product of a lesson's own settings (or
    their defaults) that divide the processes (10's --tensor-parallel), 1 for a lesson with none."""
    divide = [(flag, d) for flag, d in declared if d.get("divides") == "processes"]
    return math.prod(settings.get(dest(flag), flag_keywords(d)["default"]) for flag, d in divide)


def flag_keywords(declaration):
    """add_argument's keywords for a declared flag: its type and range checked, its default in its help."""
    kind = {"int": int, "float": float}[declaration["type"]]
    bounds = {key: kind(declaration[key]) for key in ("min", "above") if key in declaration}
    check = number(kind, least=bounds.get("min"), above=bounds.get("above"))
    default = kind(declaration["default"])
    divides = "; it must divide the processes" if declaration.get("divides") == "processes" else ""
    help = f"{declaration['help']} (default {default}{divides}; the lesson's own flag, lessons.csv)"
    return dict(type=check, default=default, metavar="N" if kind is int else "X", help=help)


def check_path(flag, path, folder=False):
    """One line, exit 2, where `path` (a file, or a folder) cannot be written; leaves nothing behind."""
    path = Path(path).absolute()
    if path.exists() and path.is_dir() != folder:
        fail(f"{flag} {path} cannot be written: it is a {'file, not a folder' if folder else 'folder'}")
    parent = path if path.is_dir() else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        fail(f"{flag} {path} cannot be written: {parent} is a file, not a folder")
    target = path if path.exists() and not folder else parent
    try:  # os.access reads the permission bits; a read-only file system or /proc refuse all the same
        if target.is_dir():
            tempfile.TemporaryFile(dir=target).close()
        elif not os.access(target, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as err:
        why = f"{target} is on a read-only file system" if os.statvfs(target).f_flag & os.ST_RDONLY else err.strerror
        fail(f"{flag} {path} cannot be written: {why}")


def add_flags(parser, epochs, devices, batch_size, smoke_epochs, loader, own):
    """The shared flags; docs/flags-records-exit-codes.md says more of each."""
    add, number = parser.add_argument, dict(type=whole_number(1), metavar="N")
    add("--smoke", action="store_true", help="offline demo on the CPU: a small ViT on 8x8 digits (docs/smoke.md)")
    add("--synthetic", action="store_true", help="random images and labels, random init: for throughput and memory")
    add(
        "--max-steps",
        **number,
        help=f"train N optimizer steps per epoch (--synthetic: {SYNTHETIC_STEPS}, one epoch); recorded as cut short",
    )
    add("--epochs", **number, help=f"default {epochs} (--synthetic: 1, --smoke: {smoke_epochs})")
    add("--batch-size", **number, help=f"per process (default {batch_size}; --smoke: 16 in all)")
    if loader:
        add("--num-workers", type=whole_number(0, MOST_WORKERS), metavar="N", help="CIFAR-10 loader processes (4)")
    add("--data-dir", metavar="DIR", help="where CIFAR-10 is, or goes (default data)")
    add("--no-download", action="store_true", help="fail instead of downloading CIFAR-10")
    add("--results", default="results/runs.jsonl", metavar="FILE", help="run records, a JSON line a run, appended")
    add("--save-model", metavar="PATH", help="where the finetuned model goes (default models/<run>.pt)")
    add("--vit", choices=list(VITS), help="torchvision's model (default vit_b_16, the talk's)")
    add("--seed", type=whole_number(0, 2**63 - 1), default=123, metavar="N", help="default 123, the talk's")
    add(
        "--accelerator",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="auto: the GPU, else the CPU (--smoke: CPU)",
    )
    if devices is not None:
        capped = f"; --smoke on a CPU: {min(devices, 2)}" if devices > 2 else ""
        add("--devices", **number, help=f"processes (GPUs) per machine (default {devices}{capped})")
        add("--num-nodes", type=whole_number(1), default=1, metavar="N", help="machines")
    for flag, keywords in own:
        add(flag, **keywords)
    add("--checkpoint-dir", metavar="DIR", help="checkpoints (default checkpoints/<run>/), seen by every machine")
    add("--resume", action="store_true", help="continue the run in --checkpoint-dir from its last epoch")


def parse_args(
    epochs, devices=None, batch_size=16, smoke_epochs=None, flags=(), loader=True, train_images=None, micro_batches=1
):
    """The run's settings: the flags, and what they decide (docs/run-keeping.md). `devices`: the Fabric scripts'
    --devices default; `flags`: the script's own (flag, add_argument keywords); `train_images`: {kind: images}."""
    on_signals(stop_while_starting)  # until RunKeeper's: nothing of the run exists yet to keep
    script, smoke_epochs = Path(sys.argv[0]).name, smoke_epochs or SMOKE_EPOCHS.get(epochs, 2)
    row = lesson_rows().get(script, {})
    brought = [(flag, flag_keywords(declaration)) for flag, declaration in own_flags(row)]
    parser = Parser(description=f"{script}: {row['technique']}. Changes {row['change']}." if row else script)
    add_flags(parser, epochs, devices, batch_size, smoke_epochs, loader, [*flags, *brought])
    given = parser.parse_args()
    kind = "-".join(k for k in ("smoke", "synthetic") if getattr(given, k))
    ignored = [f"--{k.replace('_', '-')}" for k in DATA_FLAGS if getattr(given, k, None) not in (None, False)]
    if ignored and kind:
        parser.error(f"{' and '.join(ignored)}: a {kind} run reads no CIFAR-10 (its data are made in memory); drop it")
    if given.smoke and given.vit:
        parser.error("--vit: a smoke run trains its own small ViT; drop it")
    own = {dest(flag): getattr(given, dest(flag)) for flag, _ in brought}
    places = place_processes(given, parser, devices, own_flags(row))
    sizes = settle_sizes(given, parser, kind, places, epochs, smoke_epochs, batch_size, train_images, micro_batches)
    defaults = {"seed": 123, "vit": "vit_b_16", **places.pop("defaults"), **sizes.pop("defaults")}
    chosen = {**vars(given), **places, **sizes, "vit": given.vit or "vit_b_16"}
    named = [spelling.format(chosen[key]) for key, spelling in NAMED_SETTINGS.items() if chosen[key] != defaults[key]]
    named += [f"{flag[2:]}{own[dest(flag)]}" for flag, kw in brought if own[dest(flag)] != kw["default"]]
    name = "-".join(part for part in [Path(script).stem, kind, *named] if part)
    asked = row.get("precision") or "32-true"
    args = given  # the flags as given, and what they decide:
    vars(args).update(places, **sizes, script=script, kind=kind, vit=chosen["vit"], data_dir=given.data_dir or "data")
    args.own = own  # the lesson's own settings: its row's flags, by name
    precision = precision_that_runs(asked, places["accelerator"], row.get("strategy") or "")
    vars(args).update(save_model=given.save_model or f"models/{name}.pt", compile_mode=row.get("compiles") or None)
    vars(args).update(checkpoint_dir_is_default=not given.checkpoint_dir, precision_asked=asked)  # before the next
    vars(args).update(checkpoint_dir=given.checkpoint_dir or f"checkpoints/{name}", precision=precision)
    args.num_workers = 4 if getattr(given, "num_workers", None) is None else given.num_workers
    check_places(args)
    # Lightning warns wherever srun exists but did not start the process (a login node, a one-process run
    # on a GPU node); check_launch refuses where that matters, and the opening line says what started it
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
    if args.precision != asked:
        os.environ["LT_PRECISION"] = args.precision  # read by the lesson's Fabric(...)
    return args


def check_places(args):
    """Each place the run writes can be written: one line and exit 2 before any work otherwise."""
    check_path("--results", args.results)
    check_path("--save-model", args.save_model)
    check_path("--checkpoint-dir", args.checkpoint_dir, folder=True)
    if not args.kind and Path(args.data_dir).exists() and not Path(args.data_dir).is_dir():
        fail(f"--data-dir {args.data_dir} is a file, not a folder: give the folder CIFAR-10 is in (or goes to)")
    if not args.kind and not args.no_download:
        check_path("--data-dir", args.data_dir, folder=True)


def place_processes(given, parser, devices, declared):
    """The accelerator, the processes per machine and their data-parallel replicas (the processes over
    the lesson's own settings that divide them), with the defaults the run name is measured against."""
    import torch

    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    accelerator = given.accelerator
    if accelerator == "auto" and cuda_count == 0 and not given.smoke:
        hint = invoked(*started_flags(), "--smoke", *(["--resume"] if given.resume else []))
        fail(
            f"no CUDA GPU found. A full run on a CPU takes about a day: try {hint}, or add --accelerator cpu to insist."
        )
    if accelerator == "auto":  # the GPU if there is one; --smoke on the CPU, as its help says
        accelerator = "cuda" if cuda_count and not given.smoke else "cpu"
    default_devices = 1 if devices is None else min(devices, 2) if given.smoke and accelerator == "cpu" else devices
    count = 1 if devices is None else given.devices or default_devices  # --smoke on a CPU: 2 processes show it
    num_nodes = 1 if devices is None else given.num_nodes
    if accelerator == "cuda" and count > cuda_count:
        asked = f"--devices {count}" if devices else "--accelerator cuda"
        fail(f"asked for {count} GPU(s) per machine ({asked}) but this machine has {cuda_count}.")
    cores = os.cpu_count() or 1
    if accelerator == "cpu" and count > max(4, cores):
        parser.error(f"--devices {count}: on a CPU each process needs a core; this machine has {cores}")
    check_launch(count, num_nodes, takes_devices=devices is not None)
    for flag, declaration in declared:
        value = getattr(given, dest(flag))
        if declaration.get("divides") == "processes" and (count * num_nodes) % value:
            parser.error(f"{flag} {value} does not divide the {count * num_nodes} processes")
    group = group_size(declared, vars(given))
    places = dict(accelerator=accelerator, devices=count, num_nodes=num_nodes, world_size=count * num_nodes)
    places.update(data_parallel=count * num_nodes // group)
    return places | {"defaults": {"world_size": default_devices}}


def settle_sizes(given, parser, kind, places, epochs, smoke_epochs, batch_size, train_images, micro_batches):
    default_epochs = 1 if given.synthetic else smoke_epochs if given.smoke else epochs
    max_steps = SYNTHETIC_STEPS if given.synthetic and given.max_steps is None else given.max_steps
    chosen_epochs = given.epochs or default_epochs
    if given.synthetic and max_steps <= WARMUP_STEPS and chosen_epochs == 1:
        parser.error(f"--synthetic times the steps after {WARMUP_STEPS}: give --max-steps {WARMUP_STEPS + 1} or more")
    replicas = places["data_parallel"]
    default_batch = max(1, SMOKE_GLOBAL_BATCH // replicas) if given.smoke else batch_size
    batch = given.batch_size or default_batch
    if batch % micro_batches:
        parser.error(
            f"--batch-size {batch}: it is trained on in {micro_batches} micro-batches, so it must divide by {micro_batches}"
        )
    note = ""
    if given.smoke and SMOKE_GLOBAL_BATCH % replicas and batch == default_batch:
        note = f" The batch is {batch} per data-parallel process, {batch * replicas} in all, not the talk's 16: 16 does not divide by {replicas}."
    images = None if given.synthetic else (train_images or {}).get(kind or "full")
    if images is not None and batch * replicas > images:
        parser.error(
            f"--batch-size {batch}: the {images:,} training images of a {kind or 'full'} run make no batch of {batch} "
            f"for each of {replicas} data-parallel process(es); the largest that works is {images // replicas}"
        )
    sizes = dict(epochs=chosen_epochs, batch_size=batch, micro_batches=micro_batches, max_steps=max_steps)
    sizes.update(whole=given.synthetic or max_steps is None, batch_note=note)
    defaults = {
        "epochs": default_epochs,
        "batch_size": default_batch,
        "max_steps": given.synthetic and SYNTHETIC_STEPS or None,
    }
    return sizes | {"defaults": defaults}


def check_launch(devices, num_nodes, takes_devices):
    """One line, exit 2, where the started processes cannot be the run the flags ask for: srun's or
    torchrun's counts differ, several SLURM tasks without srun, several machines with no launcher.
    Every process stops; the first says why."""
    env, one = os.environ, "" if takes_devices else " (one process)"
    asked = f"--devices {devices} --num-nodes {num_nodes}{one}"
    job, problem = env.get("SLURM_JOB_NAME"), None
    if "SLURM_NTASKS" in env and job not in INTERACTIVE:
        ntasks, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))
        per_node = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0])
        if "SLURM_STEP_ID" not in env and ntasks > 1:
            problem = f"SLURM gave this job {ntasks} tasks, but this process was started without srun, so it would wait for the others forever: start it with srun {invoked(*sys.argv[1:])}"
        elif "SLURM_NTASKS_PER_NODE" not in env:
            problem = f"SLURM started {ntasks} tasks with --ntasks, which does not say how many run on each machine: use #SBATCH --ntasks-per-node (one task per GPU) instead"
        elif (per_node, nodes) != (devices, num_nodes):
            problem = f"SLURM started {per_node} task(s) per machine on {nodes} machine(s) (--ntasks-per-node {per_node}, --nodes {nodes}), but the flags ask for {asked}: make the two agree (one task per GPU)"
    elif "TORCHELASTIC_RUN_ID" in env:
        local, world = int(env.get("LOCAL_WORLD_SIZE", "1")), int(env.get("WORLD_SIZE", "1"))
        if (local, world) != (devices, devices * num_nodes):
            problem = f"torchrun started {local} process(es) here and {world} in all, but the flags ask for {asked}: make --nproc-per-node and --nnodes agree with them"
    elif num_nodes > 1 and "NODE_RANK" not in env:
        problem = f"--num-nodes {num_nodes}: processes on other machines need a launcher: srun in a SLURM job, or torchrun on each machine (README: Running on several machines)."
        if job in INTERACTIVE:
            problem += f" Inside `srun --pty bash` (SLURM job name {job!r}) Lightning does not use SLURM: submit the job script with sbatch instead."
    if problem and int(env.get("SLURM_PROCID", env.get("RANK", "0"))) == 0:
        fail(problem)
    if problem:
        raise SystemExit(2)


def cpu_model_and_flags():
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "", []
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    return model, next((line.split(":", 1)[1].split() for line in info if line.startswith(("flags", "Features"))), [])


def native_bf16(device_type):
    """Whether the device computes bfloat16 in hardware: a GPU from Ampere on; a CPU with AVX512-BF16
    or AMX (or Arm's bf16), unless ONEDNN_MAX_CPU_ISA caps oneDNN below them, which rehearses such a
    CPU on any other. With AVX2 alone a 512x512 product ran 110x slower than in float32."""
    if device_type == "cuda":
        import torch

        return torch.cuda.is_bf16_supported(including_emulation=False)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    capped = not (cap == "ALL" or any(isa in cap for isa in ("BF16", "FP16", "AMX", "AVX10")))
    return not capped and bool({"avx512_bf16", "amx_bf16", "bf16"} & set(cpu_model_and_flags()[1]))


def precision_that_runs(asked, accelerator, strategy):
    if not asked.startswith("bf16") or native_bf16(accelerator):
        return asked
    return FALLBACKS.get((accelerator, asked, "fsdp" in strategy), "32-true")


def device_name(accelerator):
    """The GPU's name, or the CPU's model, cores, bfloat16 units and oneDNN's cap if one is set."""
    if accelerator == "cuda":
        import torch

        return torch.cuda.get_device_name()
    model, flags = cpu_model_and_flags()
    units = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    units += [f"oneDNN capped at {cap} by ONEDNN_MAX_CPU_ISA"] if cap and cap.upper() != "ALL" else []
    return f"CPU {model or 'unknown'} ({os.cpu_count()} cores{''.join(', ' + u for u in units)})"


def fallback_line(config):
    """What a run says where the device has no native bfloat16, or None."""
    ran, asked = config.precision, config.precision_asked
    if ran == asked:
        return None
    if config.accelerator == "cuda":
        why = " (Fabric's FSDP2 strategy takes no 16-mixed)" if ran == "32-true" and asked == "bf16-mixed" else ""
        return f"This GPU ({device_name('cuda')}) has no native bfloat16: running {ran} instead of {asked}{why}."
    return (
        f"This {device_name('cpu')} has no native bfloat16 (no AVX512-BF16 or AMX): running {ran} instead of {asked}, "
        "since emulated bfloat16 runs many times slower than float32; the record says both. What bfloat16 saves in "
        "time and memory shows on a CPU with AVX512-BF16 or AMX, or a GPU from Ampere on (docs/smoke.md)."
    )
