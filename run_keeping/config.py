"""Parses a lesson's command line: the flags every lesson shares, then the lesson's own (added with plain argparse).
parse_args() reads the flags, the machine and the checkpoint folder, rejects with a one-line error (exit 2) a run that
cannot work, and returns the run's Settings. Its only change to the process is starting CUDA's runtime to count the
GPUs, which cannot be undone; RunKeeper (keeper.py) makes and undoes every other change. See docs/run-keeping.md."""

import argparse
import ast
import errno
import fcntl
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import textwrap
from pathlib import Path

from run_keeping.device import cuda_gpus, no_gpu_line, precision_that_runs, unusable_gpu_line

SMOKE_EPOCHS = {10: 4, 3: 2}  # --smoke's default epochs, by the lesson's: 10 (random init) -> 4, 3 (finetuning) -> 2
SMOKE_GLOBAL_BATCH = 16  # --smoke splits the talk's batch of 16 across data-parallel replicas
SYNTHETIC_STEPS = 20  # --synthetic trains this many optimizer steps (one epoch) unless --max-steps
WARMUP_STEPS = 3  # a run's first optimizer steps are not timed (start-up, compilation)
DATA_FLAGS = ("num_workers", "data_dir", "no_download")  # flags only CIFAR-10's loader reads
VITS = {"vit_b_16": "ViT-B/16", "vit_l_16": "ViT-L/16"}  # --vit's choices: the talk's model and the memory sequel's
MOST_WORKERS = 64  # --num-workers' upper limit: more loader processes than any machine here has cores
SLURM_INTERACTIVE_JOBS = ("bash", "interactive")  # SLURM job names for which Lightning ignores SLURM
EXIT_ON_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}  # exit codes of a run stopped by Ctrl-C (SIGINT) or SIGTERM
LATEST = "latest.json"  # names a checkpoint folder's newest checkpoint, and the settings it was made with
CIFAR10_FILES = ("batches.meta", "test_batch", *(f"data_batch_{i}" for i in range(1, 6)))  # all there: never written
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)  # flock's errors on a file system without locks (Lustre, NFS)
# Settings that shape a run: a checkpoint stores them (and the lesson's own flags); --resume refuses to change them
SETTINGS = ("vit", "batch_size", "seed", "epochs", "max_steps", "world_size", "precision")
# Settings shown in a run's name (its checkpoint folder and model file) when not at their defaults, in these formats;
# the lesson's own flags follow (name_part). A precision fallback on a machine without bfloat16 does not change it.
NAMED_SETTINGS = {"seed": "seed{}", "epochs": "epochs{}", "batch_size": "batch{}", "max_steps": "max-steps{}"}
NAMED_SETTINGS |= {"world_size": "procs{}", "vit": "{}"}


def fail(message, code=2):
    """`<program>: error: <message>` on one line of stderr, then exit with `code`."""
    print(f"{Path(sys.argv[0]).name}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    raise SystemExit(code) from None


def fail_once(message):
    """`fail` in the first process of a launch (srun's, torchrun's, Lightning's); the others exit 2 silently."""
    if not any(int(os.environ.get(rank, "0")) for rank in ("SLURM_PROCID", "RANK", "LOCAL_RANK")):
        fail(message)
    raise SystemExit(2)


def invoked(*flags):
    """The command that runs this program again with `flags`, quoted for a POSIX shell."""
    return " ".join(["python", *map(shlex.quote, [sys.argv[0], *flags])])


def started_flags():
    return [flag for flag in sys.argv[1:] if flag != "--resume"]


def resume_command(flags=None):
    """The command that continues this run (its flags, or `flags`, plus --resume)."""
    command = invoked(*(started_flags() if flags is None else flags), "--resume")
    if "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_JOB_ID" in os.environ:
        return f"the same torchrun/srun launch with --resume added ({command})"
    return command


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (exit 2)."""

    def error(self, message):
        fail(f"{message}; {invoked('--help')} lists the flags")


def whole_number(least, most=None):
    """An argparse `type` for a whole number from `least` up to `most` (if given); anything else is a usage error."""

    def check(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, got {value:,}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:,}, got {value:,}")
        return value

    return check


def read_script(path):
    """Reads what a lesson asks for from its source, so a copy under any name asks the same: its Fabric(...)'s precision
    (32-true if none is given; None if it is not a string literal, or two calls differ), its torch.compile mode (None if
    it compiles nothing; "default" if not given as a literal) and its --help text. Read before the lesson runs, because
    the precision that runs must be set (LT_PRECISION) before its Fabric exists."""
    said = {"precision": "32-true", "compile_mode": None, "description": ""}
    try:
        text = Path(path).read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return said | {"precision": None}
    asked = set()  # each Fabric(...)'s precision
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
        name = ast.unparse(call.func)
        keywords = {keyword.arg: keyword.value for keyword in call.keywords}
        if name.split(".")[-1] == "Fabric" and "precision" in keywords:
            asked.add(text_literal(keywords["precision"]))
        elif name.split(".")[-1] == "Fabric":  # no precision=: Fabric's 32-true, unless **options (arg None) has one
            asked.add(None if None in keywords else "32-true")
        elif name == "torch.compile":
            said["compile_mode"] = text_literal(keywords.get("mode")) or "default"
    if asked:
        said["precision"] = asked.pop() if len(asked) == 1 else None
    tags = own_tags(text)
    items = [textwrap.fill(tag, 116, initial_indent="  - ", subsequent_indent="    ") for tag in tags]
    head = [f"{Path(path).name}: its own changes, the lines tagged {tags[0].split()[0]}:", *items, ""] if tags else []
    said["description"] = "\n".join([*head, (ast.get_docstring(tree) or "").split("\n\n")[0]])
    return said


def text_literal(node):
    """The text a syntax tree's node writes out (`"bf16-mixed"`), or None where it is anything else."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def own_tags(text):
    """The changes its comments tag with the lesson's own (highest) number, each once, not bare ones like "[17] new"."""
    tags = re.findall(r"#\s*\[(\d+)\]\s*(.+)$", text, re.M)
    number = max(tags, key=lambda tag: int(tag[0]), default=[None])[0]  # the lesson's own: the highest (or none)
    own = dict.fromkeys(f"[{number}] {change.rstrip('.')}." for n, change in tags if n == number)
    return [tag for tag in own if len(tag.split()) > 2]


def check_path(flag, path, folder=False, in_place=False):
    """Exits 2 with one line if the run cannot write `path` (a file, or a folder). Tested as the run writes: by creating
    and deleting a temporary file in its folder, or the nearest existing parent (files are written under a temporary
    name, then renamed); an existing file appended to `in_place` (--results) by its write permission."""
    path = Path(path).absolute()
    if path.exists() and path.is_dir() != folder:
        fail(f"{flag} {path} cannot be written: it is a {'file, not a folder' if folder else 'folder'}")
    parent = path if path.is_dir() else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        fail(f"{flag} {path} cannot be written: {parent} is a file, not a folder")
    target = path if path.exists() and in_place else parent
    try:
        if target.is_dir():
            tempfile.TemporaryFile(dir=target).close()
        elif not os.access(target, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as err:
        why = f"{target} is on a read-only file system" if os.statvfs(target).f_flag & os.ST_RDONLY else err.strerror
        fail(f"{flag} {path} cannot be written: {why}")


class Settings(argparse.Namespace):
    """A run's settings: each flag's value as argparse parsed it, plus those declared here, which parse_args derives."""

    script: str  # the script's file name
    kind: str  # "smoke", "synthetic", "smoke-synthetic", or "" (the talk's run)
    accelerator: str  # "cuda" or "cpu" ("auto" resolved to one)
    devices: int  # processes per machine
    num_nodes: int  # machines (1 for a lesson of one process, which takes no --num-nodes)
    num_workers: int  # CIFAR-10's loader processes (4 where the lesson takes no --num-workers)
    world_size: int  # processes in all
    data_parallel: int  # model replicas: world_size // tensor_parallel
    micro_batches: int  # loader batches each batch is split into (12's gradient accumulation); 1 otherwise
    tensor_parallel: int  # processes that share one model replica (10's tensor parallelism); 1 otherwise
    steps: int  # the optimizer steps the run trains in all, over every epoch
    whole: bool  # False where --max-steps cut the epochs short
    batch_note: str  # a smoke run's note when its global batch is not the talk's 16, or ""
    own: dict  # the lesson's own flags, by their first option string, and their values (defaults too)
    precision_asked: str | None  # what the script's Fabric(...) asks for (None: not a literal)
    precision: str | None  # the precision that runs: precision_asked, or 32-true where bfloat16 would be emulated
    compile_mode: str | None  # the mode of the script's torch.compile(...), or None where it compiles nothing
    checkpoint_dir_is_default: bool  # True: the default checkpoints/<run>/, removed (with checkpoints/) if left empty
    restart: str | None  # why a launcher's restart continues the folder's run without --resume, or None


class LessonGroup:
    """Wraps an argparse group (its class is private) so that the flags added to it count as the lesson's own."""

    def __init__(self, group, parser):
        self.group = group
        self.parser = parser

    def add_argument(self, *names, **keywords):
        return self.parser.own(self.group.add_argument(*names, **keywords))

    def add_argument_group(self, *args, **keywords):
        return LessonGroup(self.group.add_argument_group(*args, **keywords), self.parser)

    def add_mutually_exclusive_group(self, **keywords):
        return LessonGroup(self.group.add_mutually_exclusive_group(**keywords), self.parser)

    def __getattr__(self, name):  # the rest of argparse's group (set_defaults, get_default, ...)
        return getattr(self.group, name)


class LessonParser(Parser):
    """The shared flags (docs/flags-records-exit-codes.md); a lesson's flag may use dest micro_batches, tensor_parallel.
    `devices`: default processes per machine (None: 1, no --devices); `check(settings)`: returns an error or None."""

    def __init__(self, epochs, devices=None, batch_size=16, num_workers_flag=True, train_images=None, check=None):
        self.own_flags: list = []  # the lesson's flags, as add_argument returns them
        self.lessons_turn = False  # True once the shared flags are added: a flag added later is the lesson's
        # --help keeps the description's line breaks; allow_abbrev=False: flags only in full, as printed commands are
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
        self.shape = dict(epochs=epochs, devices=devices, batch_size=batch_size)
        self.shape["smoke_epochs"] = SMOKE_EPOCHS.get(epochs, 2)
        self.train_images = train_images or {}
        self.check = check
        add = self.add_argument
        number = dict(type=whole_number(1), metavar="N")
        switch = dict(action="store_true")
        add("--smoke", **switch, help="offline demo on the CPU: a small ViT on 8x8 digits (docs/smoke.md)")
        add("--synthetic", **switch, help="random images and labels, random init: for throughput and memory")
        steps = f"train N optimizer steps per epoch (--synthetic: {SYNTHETIC_STEPS}, one epoch); recorded as cut short"
        add("--max-steps", **number, help=steps)
        add("--epochs", **number, help=f"default {epochs} (--synthetic: 1, --smoke: {self.shape['smoke_epochs']})")
        add("--batch-size", **number, help=f"per process (default {batch_size}; --smoke: 16 in all)")
        if num_workers_flag:  # not for 09, whose loader has no worker processes
            add("--num-workers", type=whole_number(0, MOST_WORKERS), metavar="N", help="CIFAR-10 loader processes (4)")
        add("--data-dir", metavar="DIR", help="where CIFAR-10 is, or goes (default data)")
        add("--no-download", **switch, default=None, help="fail instead of downloading CIFAR-10")  # None: not given
        add("--results", default="results/runs.jsonl", metavar="FILE", help="run records, a JSON line a run, appended")
        add("--save-model", metavar="PATH", help="where the finetuned model goes (default models/<run>.pt)")
        add("--vit", choices=list(VITS), help="torchvision's model (default vit_b_16, the talk's)")
        add("--seed", type=whole_number(0, 2**63 - 1), default=123, metavar="N", help="default 123, the talk's")
        add("--accelerator", default="auto", choices=["auto", "cuda", "cpu"], help="GPU if any (not --smoke)")
        if devices is not None:
            capped = f"; --smoke on a CPU: {min(devices, 2)}" if devices > 2 else ""
            add("--devices", **number, help=f"processes (GPUs) per machine (default {devices}{capped})")
            add("--num-nodes", type=whole_number(1), default=1, metavar="N", help="machines")
        add("--checkpoint-dir", metavar="DIR", help="checkpoints (default checkpoints/<run>/), seen by every machine")
        add("--resume", **switch, help="continue the run in --checkpoint-dir from its last epoch")
        self.set_defaults(micro_batches=1, tensor_parallel=1)
        self.lessons_turn = True

    def add_argument(self, *names, **keywords):  # type: ignore[override]  (argparse types each keyword)
        action = super().add_argument(*names, **keywords)
        return self.own(action) if self.lessons_turn else action

    def own(self, action):
        """Counts `action` as the lesson's own flag; refuses it if its dest is a setting the run derives (Settings)."""
        if action.dest in Settings.__annotations__ and action.dest not in ("micro_batches", "tensor_parallel"):
            flag = "/".join(action.option_strings) or action.dest
            self.error(f"{flag}: its dest {action.dest!r} is a setting the run derives (Settings); give it another")
        self.own_flags.append(action)
        return action

    def add_argument_group(self, *args, **keywords):  # type: ignore[override]  (a LessonGroup, not argparse's class)
        group = super().add_argument_group(*args, **keywords)
        return LessonGroup(group, self) if self.lessons_turn else group

    def add_mutually_exclusive_group(self, **keywords):  # type: ignore[override]  (likewise; only a lesson's)
        return LessonGroup(super().add_mutually_exclusive_group(**keywords), self)

    def flag(self, dest, otherwise):
        """The lesson's flag that sets `dest`, or `otherwise`."""
        flags = [a.option_strings[0] for a in self.own_flags if a.dest == dest and a.option_strings]
        return flags[0] if flags else otherwise

    def parse_args(self, args=None, namespace=None) -> Settings:  # type: ignore[override]  (Settings, a Namespace)
        return self.settle(super().parse_args(args, namespace or Settings()))

    def settle(self, given):
        """Turns `given` (argparse's values) into the run's Settings; exits 2 on, in order: conflicting flags, processes
        and sizes, the lesson's check=, the machine, unwritable paths, a prompt, the launch, the checkpoint folder."""
        kind = "-".join(k for k in ("smoke", "synthetic") if getattr(given, k))
        # CIFAR-10's flags have no default (None: not given; --num-workers' 4 is set below), so 0 counts as given
        data_flags = " and ".join(f"--{k.replace('_', '-')}" for k in DATA_FLAGS if getattr(given, k, None) is not None)
        if data_flags and kind:
            self.error(f"{data_flags}: a {kind} run reads no CIFAR-10 (its data are made in memory); drop it")
        if given.smoke and given.vit:
            self.error("--vit: a smoke run trains its own small ViT; drop it")
        places, default_devices, machine_refusal = place_processes(given, self)
        sizes, size_defaults = settle_sizes(given, self, kind, places)
        vars(given).update(places, **sizes)  # adds derived Settings: accelerator ... data_parallel; epochs ... steps
        defaults = {"seed": self.get_default("seed"), "vit": "vit_b_16", "world_size": default_devices, **size_defaults}
        given.vit = given.vit or defaults["vit"]
        given.kind = kind
        given.script = Path(sys.argv[0]).name
        own = own_settings(self.own_flags, given)
        given.own = {flag: value for flag, (value, _) in own.items()}
        name = run_name(given, kind, defaults, own)
        said = read_script(sys.argv[0])
        given.precision_asked = said["precision"]
        # a machine refused below (after check=, so flag errors come first) is not probed for bfloat16
        given.precision = said["precision"]
        if not machine_refusal:
            given.precision = precision_that_runs(said["precision"], given.accelerator)
        given.compile_mode = said["compile_mode"]
        given.data_dir = given.data_dir or "data"
        given.save_model = given.save_model or f"models/{name}.pt"
        given.checkpoint_dir_is_default = not given.checkpoint_dir
        given.checkpoint_dir = given.checkpoint_dir or f"checkpoints/{name}"
        given.num_workers = 4 if getattr(given, "num_workers", None) is None else given.num_workers  # --help's 4
        if self.check and (wrong := self.check(given)):
            self.error(wrong)
        if machine_refusal:  # only now: a flag error, which no machine fixes, is reported first
            fail(machine_refusal)
        check_path("--results", given.results, in_place=True)  # every place the run writes, tested before any work
        check_path("--save-model", given.save_model)
        check_path("--checkpoint-dir", given.checkpoint_dir, folder=True)
        if not kind and Path(given.data_dir).exists() and not Path(given.data_dir).is_dir():
            fail(f"--data-dir {given.data_dir} is a file, not a folder: give the folder CIFAR-10 is in (or goes to)")
        downloaded = all((Path(given.data_dir) / "cifar-10-batches-py" / file).is_file() for file in CIFAR10_FILES)
        if not kind and not given.no_download and not downloaded:
            check_path("--data-dir", given.data_dir, folder=True)
        check_launch(given, takes_devices=self.shape["devices"] is not None)
        given.restart = read_the_checkpoint_folder(given)
        return given

    def format_help(self):  # --help opens with the script's tagged changes and docstring (read_script)
        self.description = read_script(sys.argv[0])["description"]
        return super().format_help()


def own_settings(actions, given):
    """The lesson's flags by first option string: (value, default) as JSON values (a text default put through type)."""
    own = {}
    for action in actions:
        if action.dest == argparse.SUPPRESS:
            continue
        typed = isinstance(action.default, str) and callable(action.type)  # a text default, as argparse types it
        default = action.type(action.default) if typed else action.default
        value, default = json.loads(json.dumps([getattr(given, action.dest), default], default=str))
        own[(action.option_strings or [action.dest])[0]] = (value, default)
    return own


def run_name(given, kind, defaults, own):
    """The run's name (for its checkpoint folder, model file): the script, its kind, each setting not at its default."""
    parts = [Path(sys.argv[0]).stem, kind]
    for key, spelling in NAMED_SETTINGS.items():
        if getattr(given, key) != defaults[key]:
            parts.append(spelling.format(getattr(given, key)))
    parts += [name_part(flag, value) for flag, (value, default) in own.items() if value != default]
    return "-".join(part for part in parts if part)


def name_part(flag, value):
    """How a changed setting appears in a run's name: a switch as its flag (no-ema-eval for BooleanOptionalAction's
    --ema-eval turned off), a number right after its flag (max-norm0.5), a word after a dash (scheduler-none)."""
    if isinstance(value, bool):
        return flag.lstrip("-") if value or flag.startswith("--no-") else "no-" + flag.lstrip("-")
    text = spoken(value).replace("/", "_")  # a path's value names a file, not folders
    return flag.lstrip("-") + ("-" if text[:1].isalpha() else "") + text


def spoken(value, flag=""):
    """A setting's value as messages and run names show it: a switch "on" or "off" (--no-bias "on": given, so its value
    is False), None as "unset", a list joined by commas."""
    if isinstance(value, bool):
        given = not value if flag.startswith("--no-") else value
        return "on" if given else "off"
    if value is None:
        return "unset"
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def place_processes(given, parser):
    """Returns (the accelerator and process counts; the default count, which the run's name is compared with; the
    machine's error, reported after the flags' own, or None). Exits 2: too many CPU processes, a bad tensor_parallel."""
    devices = parser.shape["devices"]
    on_the_cpu = given.accelerator == "cpu" or (given.smoke and given.accelerator == "auto")
    gpus, torch_says = (0, None) if on_the_cpu else cuda_gpus()
    refusal = unusable_gpu_line(torch_says) if torch_says else None  # first of three: torch's error, no GPU, too few
    accelerator = given.accelerator
    if accelerator == "auto":  # the GPU if there is one; --smoke on the CPU, as its help says
        accelerator = "cuda" if gpus else "cpu"  # (--smoke: none counted)
        if not gpus and not given.smoke and not refusal:
            hint = invoked(*started_flags(), "--smoke", *(["--resume"] if given.resume else []))
            cpu = f"A full run on a CPU takes about a day: try {hint}, or add --accelerator cpu to insist."
            refusal = no_gpu_line(cpu)
    default_devices = 1 if devices is None else devices
    if devices is not None and given.smoke and accelerator == "cpu":
        default_devices = min(devices, 2)  # --smoke on a CPU: 2 processes show it
    count = 1 if devices is None else given.devices or default_devices
    num_nodes = 1 if devices is None else given.num_nodes
    group = given.tensor_parallel
    if accelerator == "cuda" and count > gpus and not refusal:
        refusal = fewer_gpus_line(given, parser, count, gpus)
    cores = os.cpu_count() or 1
    if accelerator == "cpu" and count > max(4, cores):  # up to 4 processes even on fewer cores (the tests' TP 2 x DP 2)
        parser.error(f"--devices {count}: on a CPU each process needs a core; this machine has {cores}")
    world = count * num_nodes
    if group < 1 or world % group:
        flag = parser.flag("tensor_parallel", "tensor_parallel")
        parser.error(f"{flag} {group} does not divide the {world} processes")
    places = dict(accelerator=accelerator, devices=count, num_nodes=num_nodes, world_size=world)
    places["data_parallel"] = world // group
    return places, default_devices, refusal


def fewer_gpus_line(given, parser, count, gpus):
    """The error when CUDA gives torch fewer GPUs than the run asks for, with a command that runs on those it has."""
    asked = f"--devices {count}" if parser.shape["devices"] else "--accelerator cuda"
    if not gpus:
        return no_gpu_line(f"Asked for {count} GPU(s) per machine ({asked}) but this machine has 0.")
    # suggest whole tensor-parallel groups; with fewer GPUs than one group, all as one group (via the lesson's flag)
    group = given.tensor_parallel
    group_flag = parser.flag("tensor_parallel", None)
    regroup = gpus < group and group_flag
    kept = without(started_flags(), "--devices", *([group_flag] if regroup else []))
    devices = gpus - gpus % group if gpus >= group else gpus
    flags = [*kept, "--devices", str(devices), *([group_flag, str(gpus)] if regroup else [])]
    command = invoked(*flags, *(["--resume"] if given.resume else []))
    it = "it" if gpus == 1 else "them"
    has = f"this machine has {gpus}"
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        has = f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} shows torch {gpus}"
    return f"asked for {count} GPU(s) per machine ({asked}) but {has}: {command} runs on {it}."


def without(flags, *dropped):
    """`flags` less each of `dropped` with its value (`--flag value` or `--flag=value`)."""
    kept = []
    values = iter(flags)
    for flag in values:
        if flag.split("=")[0] not in dropped:
            kept.append(flag)
        elif "=" not in flag:
            next(values, None)  # its value
    return kept


def settle_sizes(given, parser, kind, places):
    """Returns (the epochs, batch, steps and a smoke run's batch note, checked against each other, the micro-batches and
    the data; the defaults that the run's name is compared with)."""
    micro = given.micro_batches
    replicas = places["data_parallel"]
    default_epochs = parser.shape["smoke_epochs"] if given.smoke else parser.shape["epochs"]
    if given.synthetic:
        default_epochs = 1
    epochs = given.epochs or default_epochs
    max_steps = SYNTHETIC_STEPS if given.synthetic and given.max_steps is None else given.max_steps
    if given.synthetic and (max_steps < 2 or max_steps * epochs <= WARMUP_STEPS):  # no step left to time
        untimed = f"--synthetic times the steps after the first {WARMUP_STEPS}, and after each epoch's first"
        parser.error(f"{untimed}: give --max-steps {max(2, WARMUP_STEPS // epochs + 1)} or more")
    default_batch = max(1, SMOKE_GLOBAL_BATCH // replicas) if given.smoke else parser.shape["batch_size"]
    batch = given.batch_size or default_batch
    if micro < 1 or batch % micro:
        split = f"the batch of {batch} (--batch-size) is trained on in {micro} micro-batches, so it must divide it"
        parser.error(f"{parser.flag('micro_batches', 'micro-batches')} {micro}: {split}")
    note = ""
    if given.smoke and SMOKE_GLOBAL_BATCH % replicas and batch == default_batch:
        note = f" The batch is {batch} per data-parallel process, {batch * replicas} in all, not the talk's 16:"
        note += f" 16 does not divide by {replicas}."
    images = None if given.synthetic else parser.train_images.get(kind or "full")
    if images is not None and batch * replicas > images:
        none = f"the {images:,} training images of a {kind or 'full'} run make no batch of {batch} for each of"
        largest = f"{replicas} data-parallel process(es); the largest that works is {images // replicas}"
        parser.error(f"--batch-size {batch}: {none} {largest}")
    # batches per replica: the distributed sampler pads each share up; drop_last drops a partial batch
    per_epoch = max_steps if images is None else (images + replicas - 1) // replicas // batch
    per_epoch = min(per_epoch, max_steps or per_epoch)  # --max-steps cuts it short
    sizes = dict(epochs=epochs, batch_size=batch, max_steps=max_steps, steps=per_epoch * epochs)
    sizes |= dict(whole=given.synthetic or max_steps is None, batch_note=note)
    synthetic_steps = SYNTHETIC_STEPS if given.synthetic else None
    return sizes, dict(epochs=default_epochs, batch_size=default_batch, max_steps=synthetic_steps)


def check_launch(given, takes_devices):
    """Exits 2 if the processes started do not match the flags or cannot start here; only the first process says why."""
    if takes_devices and (hasattr(sys, "ps1") or sys.flags.interactive):  # at a prompt, tested as Lightning does
        launcher = "Lightning's subprocess launcher, which cannot run at a prompt"
        fail(f"this lesson's processes are started by {launcher}: run it from a shell: {invoked(*sys.argv[1:])}")
    env = os.environ
    problem = None
    asked = f"--devices {given.devices} --num-nodes {given.num_nodes}{'' if takes_devices else ' (one process)'}"
    job = env.get("SLURM_JOB_NAME")
    # Fabric lets LT_ ... variables override its arguments; set_up's LT_PRECISION, which child processes inherit, is ok
    setting_fabric = [f"{name}={value}" for name, value in env.items() if name.startswith("LT_")]
    setting_fabric = [setting for setting in setting_fabric if setting != f"LT_PRECISION={given.precision}"]
    if "LT_CLI_USED" in env:  # Fabric then raises where an argument differs from `fabric run`'s flag
        problem = "`fabric run` sets Fabric's arguments, which this lesson's flags set: run it with python or torchrun"
    elif setting_fabric:
        problem = f"{', '.join(setting_fabric)} in the environment would set Fabric's arguments over this lesson's"
        problem += " flags: unset it"
    elif "SLURM_NTASKS" in env and job not in SLURM_INTERACTIVE_JOBS:
        ntasks, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))  # SLURM's sizes
        per_node = int(env.get("SLURM_NTASKS_PER_NODE", ntasks))  # set by --ntasks-per-node alone
        if "SLURM_STEP_ID" not in env and ntasks > 1:
            problem = f"SLURM gave this job {ntasks} tasks, but this process was started without srun, so it would"
            problem += f" wait for the others forever: start it with srun {invoked(*sys.argv[1:])}"
        elif "SLURM_NTASKS_PER_NODE" not in env and ntasks > 1:  # one task (srun -n 1) is one process anywhere
            problem = f"SLURM started {ntasks} tasks with --ntasks, which does not say how many run on each machine:"
            problem += " use #SBATCH --ntasks-per-node (one task per GPU) instead"
        elif (per_node, nodes) != (given.devices, given.num_nodes):
            started = f"{per_node} task(s) per machine on {nodes} machine(s)"
            problem = f"SLURM started {started} (--ntasks-per-node {per_node}, --nodes {nodes}), but the flags ask for"
            problem += f" {asked}: make the two agree (one task per GPU)"
    elif "TORCHELASTIC_RUN_ID" in env:
        local, world = int(env.get("LOCAL_WORLD_SIZE", "1")), int(env.get("WORLD_SIZE", "1"))  # torchrun's sizes
        if (local, world) != (given.devices, given.world_size):
            problem = f"torchrun started {local} process(es) here and {world} in all, but the flags ask for {asked}:"
            problem += " make --nproc-per-node and --nnodes agree with them"
    elif given.num_nodes > 1 and "NODE_RANK" not in env:
        launcher = "srun in a SLURM job, or torchrun on each machine (README: Running on several machines)"
        problem = f"--num-nodes {given.num_nodes}: processes on other machines need a launcher: {launcher}."
        if job in SLURM_INTERACTIVE_JOBS:
            problem += f" Inside `srun --pty bash` (SLURM job name {job!r}) Lightning does not use SLURM:"
            problem += " submit the job script with sbatch instead."
    if problem:
        fail_once(problem)


def read_the_checkpoint_folder(given):
    """Why a launcher restarted this run to continue its folder's checkpoint, or None. Exits 2 on: a run in progress
    there, bad latest.json, an unfinished run without --resume, nothing to resume, a checkpoint of other settings."""
    folder = Path(given.checkpoint_dir)
    if lock_holder(folder) is not None:  # refused before any work; start() takes the lock itself (FolderLock)
        fail_once(in_progress(folder))
    latest = read_json(folder / LATEST)
    exists = (folder / LATEST).exists()
    restart = restart_reason(latest)
    if exists and not latest:
        fail_once(f"{folder / LATEST} is unreadable or corrupt (not the JSON a run writes); {start_over(given)}")
    if exists and not given.resume and not restart:
        how = f"continue it with: {resume_command(latest.get('flags'))}; or {elsewhere(folder)}"
        fail_once(f"{folder} holds the checkpoint of an unfinished run: {how}; or {start_over(given)}")
    if given.resume and not exists:
        fail_once(nothing_to_resume(given, folder))
    if latest and (differences := made_with(given, latest)):
        made = f"the checkpoint in {folder} was made with {', '.join(differences)}"
        precision = (latest.get("settings") or {}).get("precision")
        precision_alone = all(difference.startswith("precision ") for difference in differences)  # no flag sets it
        where = f" on a machine whose device runs {precision}" if precision_alone and precision else ""
        if where and precision == "32-true" and given.accelerator == "cpu":  # the fallback, which no flag asks for
            where += " (on a CPU with bfloat16 units: ONEDNN_MAX_CPU_ISA=AVX2 before the command)"
        as_started = f"continue it as started{where}: {resume_command(latest.get('flags'))}"
        fail_once(f"--resume: {made}; {as_started}; or {elsewhere(folder)}")
    return restart


def made_with(given, latest):
    """Each setting in which `given` differs from the run that wrote `latest`, such as "batch_size 16 (now 8)"."""
    mine = {"script": given.script, "kind": given.kind or "full", **{key: getattr(given, key) for key in SETTINGS}}
    theirs = {"script": latest.get("script"), "kind": latest.get("kind") or "full", **(latest.get("settings") or {})}
    mine |= given.own
    changed = [key for key, value in mine.items() if theirs.get(key) != value]
    return [f"{key} {spoken(theirs.get(key), key)} (now {spoken(mine[key], key)})" for key in changed]


def nothing_to_resume(given, folder):
    """--resume's error when the folder has no checkpoint; names this script's folders that do, with resume commands."""
    line = [f"--resume: nothing to resume in {folder} (no {LATEST})."]
    for path in sorted(folder.parent.glob(f"{Path(given.script).stem}*/{LATEST}")):
        latest = read_json(path)
        differences = made_with(given, latest)
        made = f", made with {', '.join(differences)}" if differences else ""
        line.append(f"{path.parent} holds one{made}: continue it with {resume_command(latest.get('flags'))}.")
    return " ".join(line)


def lock_holder(folder):
    """Who holds the folder's .lock (keeper.FolderLock), as its text says, or None; creates no file, keeps no lock."""
    try:
        with open(Path(folder) / ".lock", "rb") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)  # acquired (released as the file closes): no holder
            except BlockingIOError:  # held: return the holder's text
                return lock.read(400).decode(errors="replace").strip()
    except OSError:  # no .lock, or a file system without locks, where nobody can hold it
        return None
    return None


def in_progress(folder):
    holder = lock_holder(folder) or "another process"
    return f"a run is in progress in {folder} ({holder}): wait, or give this one another --checkpoint-dir."


def read_json(path):
    try:
        found = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def restart_reason(latest):
    """A message if SLURM or torchrun restarted the run that wrote `latest` (same job or run id); else None."""
    env = os.environ
    launch = latest.get("launch") or {}
    slurm = int(env.get("SLURM_RESTART_COUNT", "0"))
    torchrun = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if slurm and env.get("SLURM_JOB_ID") == launch.get("slurm_job_id"):
        return f"SLURM requeued job {env['SLURM_JOB_ID']} (restart {slurm})"
    if torchrun and env.get("TORCHELASTIC_RUN_ID") == launch.get("torchelastic_run_id"):
        return f"torchrun restarted its workers (restart {torchrun})"
    return None


def start_over(given):
    """The commands that delete the unfinished run's folder (and a default checkpoints/ left empty) and start again."""
    folder = Path(given.checkpoint_dir)
    parent = f" && rmdir {shlex.quote(str(folder.parent))} 2>/dev/null" if given.checkpoint_dir_is_default else ""
    return f"start over with: rm -rf {shlex.quote(str(folder))}{parent}; {invoked(*started_flags())}"


def elsewhere(folder):
    """The command that starts this run in a new folder (`folder`-2, or the next free number), `folder` left alone."""
    number = next(n for n in range(2, 10**6) if not Path(f"{folder}-{n}").exists())
    flags = without(started_flags(), "--checkpoint-dir")  # all but an earlier one
    return f"start this one in a folder of its own: {invoked(*flags, '--checkpoint-dir', f'{folder}-{number}')}"
