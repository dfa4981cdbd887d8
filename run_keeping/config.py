"""A lesson's command line: the flags every lesson shares, then the lesson's own (argparse's add_argument,
in the script); parse_args() refuses a bad value, an ignored flag, an unusable path or a launch that does
not match in one line (exit 2), and adds what they decide. What the script's own text asks for (its
precision, torch.compile mode and --help) is read from it (read_script): docs/run-keeping.md."""

import argparse
import ast
import atexit
import contextlib
import json
import logging
import os
import re
import shlex
import signal
import sys
import tempfile
import warnings
from pathlib import Path

from run_keeping.gpu import fewer_gpus_line, flags_for, no_gpu_line, no_kernels_line, usable_gpus

SMOKE_EPOCHS = {10: 4, 3: 2}  # --smoke keeps the talk's shape: 4 epochs from random init, 2 finetuning
SMOKE_GLOBAL_BATCH = 16  # --smoke splits the talk's batch of 16 across data-parallel replicas
SYNTHETIC_STEPS = 20  # --synthetic trains this many optimizer steps (one epoch) unless --max-steps
WARMUP_STEPS = 3  # a run's first optimizer steps are not timed (start-up, compilation)
DATA_FLAGS = ("num_workers", "data_dir", "no_download")  # what only CIFAR-10's loader reads
VITS = {"vit_b_16": "ViT-B/16", "vit_l_16": "ViT-L/16"}  # --vit: the talk's, the memory sequel's
MOST_WORKERS = 64  # --num-workers: loader processes, more than any machine here has cores
SLURM_INTERACTIVE_JOBS = ("bash", "interactive")  # SLURM job names for which Lightning ignores SLURM
EXIT_ON_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}
# The settings that name a run's checkpoint folder and model file where they differ from the
# script's defaults, so runs of other settings never share them, with their spelling there; a
# lesson's own flags follow as the flag and its value: --max-norm 0.5 as max-norm0.5.
NAMED_SETTINGS = {"seed": "seed{}", "epochs": "epochs{}", "batch_size": "batch{}", "max_steps": "max-steps{}"}
NAMED_SETTINGS |= {"world_size": "procs{}", "vit": "{}"}
# What a bf16 precision becomes where the device has no native bfloat16: on a GPU, bf16-mixed
# becomes 16-mixed unless sharded (Fabric's ModelParallelStrategy takes no 16-mixed); otherwise
# 32-true (a CPU's float16 is emulated too; 16-true would lose Adam's small steps).
FALLBACKS = {("cuda", "bf16-mixed", False): "16-mixed"}


def fail(message, code=2):
    """`<program>: error: <message>` on one line of stderr, then exit with `code`."""
    print(f"{Path(sys.argv[0]).name}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    raise SystemExit(code) from None


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
    """Where a run installs its handler for Ctrl-C and SIGTERM (docs/run-keeping.md lists when); AsFound puts back
    those it found."""
    for signum in EXIT_ON_SIGNAL:
        signal.signal(signum, handler)


@contextlib.contextmanager
def tool_run():
    """A tool's run (08, benchmark.py, plot_results.py, make_smoke_weights.py): Ctrl-C and SIGTERM end it in one
    line, and it leaves the interpreter as it found it, however it ends."""
    as_found = AsFound()
    as_found.moment = ""  # a tool may have written its files: the line says no more than the signal
    on_signals(as_found.stop_while_starting)
    try:
        yield
    finally:
        as_found.put_back()


def is_interactive():
    """Whether Python runs a prompt (IPython, a notebook, python -i), as Lightning tells it."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


class AsFound:
    """What a run changes in the interpreter, as parse_args (or tool_run) found it, put back by put_back() however
    the run ends (RunKeeper's exit, a refusal before it, a tool's end): Ctrl-C's and SIGTERM's handlers, the
    environment (LT_PRECISION, the variables Lightning's launcher sets: MASTER_PORT, WORLD_SIZE, OMP_NUM_THREADS...),
    the warnings filters and torch's threads (that launcher gives each process its share of the cores)."""

    def __init__(self):
        torch = sys.modules.get("torch")  # a lesson has imported it; a tool may not need it
        self.handlers = {signum: signal.getsignal(signum) for signum in EXIT_ON_SIGNAL}
        self.threads = torch.get_num_threads() if torch else None
        self.environ, self.restored = dict(os.environ), False
        self.moment = " while starting; nothing was written"  # what the line says of when it came (tool_run: nothing)
        self.warnings = warnings.catch_warnings()  # the warnings module's own way to keep the filters and put them back
        self.warnings.__enter__()

    def put_back(self, guard=False):
        """The interpreter as found; `guard`: as it exits, Ctrl-C and SIGTERM ignored (no exit code changes)."""
        if not self.restored:
            self.restored = True
            self.warnings.__exit__(None, None, None)
            for name in set(os.environ) - set(self.environ):
                del os.environ[name]
            os.environ.update(self.environ)
            if self.threads is not None:
                sys.modules["torch"].set_num_threads(self.threads)
            for signum, handler in self.handlers.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        if guard:
            atexit.register(on_signals, signal.SIG_IGN)

    def stop_while_starting(self, signum, frame=None):
        """Ctrl-C or SIGTERM from the parse to RunKeeper (nothing of the run exists yet), or in a tool: one line."""
        name = signal.Signals(signum).name
        print(f"\n{Path(sys.argv[0]).name}: interrupted ({name}){self.moment}.", file=sys.stderr)
        self.put_back(guard=True)
        raise SystemExit(EXIT_ON_SIGNAL[signum])


# How a lesson's processes end where a strategy runs them (DDP, FSDP2; Lightning's launcher, torchrun or srun
# started them): by os._exit with the run's code, once the exit handlers registered since the lesson was parsed
# have run (Lightning's among them; logging's, registered as it was imported, is called), and never in the
# interpreter's teardown. There the process group outlives destroy_process_group (the model holds it: DDP's
# reducer, FSDP2's mesh), and a gloo thread letting go of a collective's tensor aborted the process ("terminate
# called without an active exception": pytorch/pytorch#190489). Lightning starts no such processes from a prompt
# (refuse_at_a_prompt refuses there), so IPython, a notebook and `python -i` never meet this.
PROCESS_END: dict = {"registered": False, "code": None}


def end_multi_process_run():
    """The exit handler that ends a lesson's process as PROCESS_END says: with its last run's code, or 1 where a
    traceback followed it; where no run of processes ended, it does nothing."""
    if PROCESS_END["code"] is not None:
        end_process(1 if getattr(sys, "last_value", None) is not None else PROCESS_END["code"])


def end_process(code):
    """Ends this process with `code` at once (os._exit): Ctrl-C and SIGTERM ignored, logging's handlers and the
    standard streams flushed first."""
    on_signals(signal.SIG_IGN)  # Lightning's NCCL exit handler put SIGINT's default back
    logging.shutdown()  # registered at logging's import, before the parse: its handlers flushed and closed here
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a full disk: nothing more to say
            pass
    os._exit(code)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (exit 2)."""

    def error(self, message):
        fail(f"{message}; {invoked('--help')} lists the flags")


def whole_number(least, most=None):
    """argparse's type for a whole number from `least` (to `most`): one line otherwise."""

    def check(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < least or (most is not None and value > most):
            wrong = f"must be {least} or more" if value < least else f"must be at most {most:,}"
            raise argparse.ArgumentTypeError(f"{wrong}, got {value:,}")
        return value

    return check


def read_script(path):
    """What a lesson's own text asks for, read before it runs, so that a copy under any name asks the same: its
    Fabric's precision (None where no literal), whether its strategy shards, torch.compile's mode, its --help
    (its own tagged lines, then its docstring's first paragraph)."""
    said = {"precision": "32-true", "sharded": False, "compile_mode": None, "description": ""}
    try:
        text = Path(path).read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return said | {"precision": None}
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
        name, keywords = ast.unparse(call.func), {k.arg: k.value for k in call.keywords}
        if name.endswith("Fabric"):
            said["precision"] = literal(keywords["precision"]) if "precision" in keywords else "32-true"
            said["sharded"] = bool(re.search(r"ModelParallel|fsdp", ast.unparse(keywords.get("strategy", call))))
        elif name == "torch.compile":
            said["compile_mode"] = literal(keywords.get("mode")) or "default"
    tags = re.findall(r"#\s*\[(\d+)\]\s*(.+)$", text, re.M)
    own = [f"[{number}] {change}." for number, change in tags if number == max(n for n, _ in tags)]
    own = [tag for tag in dict.fromkeys(own) if len(tag.split()) > 2]  # each once, and not a bare "new"
    said["description"] = " ".join([f"{Path(path).name}:", *own, (ast.get_docstring(tree) or "").split("\n\n")[0]])
    return said


def literal(node):
    return node.value if isinstance(node, ast.Constant) else None


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


class Settings(argparse.Namespace):
    """A run's settings: each flag's value (argparse's), then what parse_args decides from them, declared here."""

    script: str  # the script's file name
    kind: str  # "smoke", "synthetic", "smoke-synthetic", or "" (the talk's run)
    accelerator: str  # "cuda" or "cpu" ("auto" decided)
    devices: int  # processes per machine
    num_nodes: int  # machines (1 for a lesson of one process, which takes no --num-nodes)
    num_workers: int  # CIFAR-10's loader processes (4 where the lesson takes no --num-workers)
    world_size: int  # processes in all
    data_parallel: int  # model replicas: the processes over tensor_parallel
    micro_batches: int  # parts the loader hands out each batch in (12's gradient accumulation); 1 otherwise
    tensor_parallel: int  # processes that hold one replica between them (10's); 1 otherwise
    steps: int  # the optimizer steps the run trains in all, over every epoch
    whole: bool  # False where --max-steps cut the epochs short
    batch_note: str  # a smoke run's word on a batch other than the talk's 16, or ""
    own: dict  # the lesson's own flags, by their first option string, and their values (defaults too)
    precision_asked: str | None  # what the script's Fabric(...) asks for
    precision: str | None  # what runs: precision_asked, or its fallback without native bfloat16 (LT_PRECISION)
    compile_mode: str | None  # the mode of the script's torch.compile(...), or None where it compiles nothing
    checkpoint_dir_is_default: bool  # checkpoints/<run>/, which the run may remove with checkpoints/ when empty
    as_found: AsFound  # the interpreter as the run found it, put back as it ends


class LessonGroup:
    """A group of a lesson's flags (add_argument_group, add_mutually_exclusive_group): argparse's, its flags
    counted as the lesson's own as the parser's are; argparse's group class is private, so this one wraps it."""

    def __init__(self, group, parser):
        self.group, self.parser = group, parser

    def add_argument(self, *names, **keywords):
        return self.parser.own(self.group.add_argument(*names, **keywords))

    def add_mutually_exclusive_group(self, **keywords):
        return LessonGroup(self.group.add_mutually_exclusive_group(**keywords), self.parser)

    def __getattr__(self, name):  # the rest of argparse's group (set_defaults, get_default, ...)
        return getattr(self.group, name)


class LessonParser(Parser):
    """The flags every lesson shares (docs/flags-records-exit-codes.md), then the lesson's own, in argparse's words
    (add_argument, groups). A lesson's flag may set, by its dest, a setting the shared code reads: micro_batches
    (the loader hands out each batch in that many parts) or tensor_parallel (the processes that hold one replica
    between them). `devices`: the processes a lesson runs per machine by default, where it runs several; a
    one-process lesson (None) takes no --devices or --num-nodes. `check(settings)`: the lesson's own relation to
    what the run derives (its steps, its replicas), a message where it fails, asked before the machine is."""

    own_flags: list | None = None  # the lesson's, as add_argument returns them (after the shared ones)

    def __init__(self, epochs, devices=None, batch_size=16, loader=True, train_images=None, check=None):
        super().__init__()  # the description, the script's own words, is read as it prints --help (read_script)
        self.shape = dict(epochs=epochs, devices=devices, batch_size=batch_size)
        self.shape["smoke_epochs"] = SMOKE_EPOCHS.get(epochs, 2)
        self.train_images, self.check = train_images or {}, check
        add, number, switch = self.add_argument, dict(type=whole_number(1), metavar="N"), dict(action="store_true")
        add("--smoke", **switch, help="offline demo on the CPU: a small ViT on 8x8 digits (docs/smoke.md)")
        add("--synthetic", **switch, help="random images and labels, random init: for throughput and memory")
        steps = f"train N optimizer steps per epoch (--synthetic: {SYNTHETIC_STEPS}, one epoch); recorded as cut short"
        add("--max-steps", **number, help=steps)
        add("--epochs", **number, help=f"default {epochs} (--synthetic: 1, --smoke: {self.shape['smoke_epochs']})")
        add("--batch-size", **number, help=f"per process (default {batch_size}; --smoke: 16 in all)")
        if loader:
            add("--num-workers", type=whole_number(0, MOST_WORKERS), metavar="N", help="CIFAR-10 loader processes (4)")
        add("--data-dir", metavar="DIR", help="where CIFAR-10 is, or goes (default data)")
        add("--no-download", **switch, help="fail instead of downloading CIFAR-10")
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
        self.own_flags = []

    # argparse's add_argument is typed to take its keywords one by one; this one hands them on as they come
    def add_argument(self, *names, **keywords):  # type: ignore[override]
        action = super().add_argument(*names, **keywords)
        return action if self.own_flags is None else self.own(action)

    def own(self, action):
        """A lesson's flag, counted as its own; one whose dest is a setting the run derives is refused."""
        if action.dest in Settings.__annotations__ and action.dest not in ("micro_batches", "tensor_parallel"):
            flag = "/".join(action.option_strings) or action.dest
            self.error(f"{flag}: its dest {action.dest!r} is a setting the run derives (Settings); give it another")
        assert self.own_flags is not None, "own() is for the lesson's flags, after the shared ones"
        self.own_flags.append(action)
        return action

    def add_argument_group(self, *args, **keywords):  # type: ignore[override]  (a LessonGroup, not argparse's class)
        group = super().add_argument_group(*args, **keywords)
        return group if self.own_flags is None else LessonGroup(group, self)

    def add_mutually_exclusive_group(self, **keywords):  # type: ignore[override]  (likewise)
        group = super().add_mutually_exclusive_group(**keywords)
        return group if self.own_flags is None else LessonGroup(group, self)

    def flag(self, dest, otherwise):  # the lesson's flag that sets `dest`, or `otherwise`
        flags = [a.option_strings[0] for a in self.own_flags or [] if a.dest == dest and a.option_strings]
        return flags[0] if flags else otherwise

    # argparse's parse_args returns a Namespace; this one returns Settings, a Namespace
    def parse_args(self, args=None, namespace=None) -> Settings:  # type: ignore[override]
        """The settings (Settings), or one line and exit 2; the interpreter as found where it refuses."""
        as_found, PROCESS_END["code"] = AsFound(), None  # a refusal ends this process as Python ends
        on_signals(as_found.stop_while_starting)  # until RunKeeper's: nothing of the run exists yet to keep
        try:
            return self.settle(super().parse_args(args, namespace or Settings()), as_found)
        except SystemExit:
            as_found.put_back()
            raise

    def settle(self, given, as_found):
        """`given` (argparse's values) made the run's settings: flags that do not go together refused, the places
        and sizes, the run's name and files; then what the run cannot do is refused, and prepared (prepare)."""
        said = read_script(sys.argv[0])
        kind = "-".join(k for k in ("smoke", "synthetic") if getattr(given, k))
        given_data = [f"--{k.replace('_', '-')}" for k in DATA_FLAGS if getattr(given, k, None) not in (None, False)]
        ignored = " and ".join(given_data)
        if ignored and kind:
            self.error(f"{ignored}: a {kind} run reads no CIFAR-10 (its data are made in memory); drop it")
        if given.smoke and given.vit:
            self.error("--vit: a smoke run trains its own small ViT; drop it")
        places = place_processes(given, self)
        sizes = settle_sizes(given, self, kind, places)
        machine = places.pop("problem")  # what the machine refuses, said after the lesson's own refusals
        defaults = {"seed": 123, "vit": "vit_b_16", **places.pop("defaults"), **sizes.pop("defaults")}
        chosen = {**vars(given), **places, **sizes, "vit": given.vit or "vit_b_16"}
        named = [how.format(chosen[key]) for key, how in NAMED_SETTINGS.items() if chosen[key] != defaults[key]]
        own = own_settings(self.own_flags or [], given)
        named += [name_part(flag, value) for flag, (value, default) in own.items() if value != default]
        name = "-".join(part for part in [Path(sys.argv[0]).stem, kind, *named] if part)
        vars(given).update(places, **sizes)  # the declared settings place_processes and settle_sizes make
        given.script, given.kind, given.vit = Path(sys.argv[0]).name, kind, chosen["vit"]
        given.own = {flag: value for flag, (value, _) in own.items()}
        given.precision_asked, given.compile_mode = said["precision"], said["compile_mode"]
        given.precision = precision_that_runs(said["precision"], places["accelerator"], said["sharded"])
        given.data_dir, given.save_model = given.data_dir or "data", given.save_model or f"models/{name}.pt"
        given.checkpoint_dir_is_default = not given.checkpoint_dir
        given.checkpoint_dir = given.checkpoint_dir or f"checkpoints/{name}"
        given.num_workers = 4 if getattr(given, "num_workers", None) is None else given.num_workers
        return self.prepare(given, kind, machine, as_found)

    def prepare(self, given, kind, machine, as_found):
        """Refused in this order: the lesson's own relation (check=), the `machine`'s refusal, places the run
        cannot write, a prompt; then what the run sets (a warnings filter, LT_PRECISION), put back as it ends."""
        if self.check and (wrong := self.check(given)):  # every setting but as_found, which comes last
            self.error(wrong)
        if machine:
            fail(machine)
        check_path("--results", given.results)  # each place the run writes, before any work
        check_path("--save-model", given.save_model)
        check_path("--checkpoint-dir", given.checkpoint_dir, folder=True)
        if not kind and Path(given.data_dir).exists() and not Path(given.data_dir).is_dir():
            fail(f"--data-dir {given.data_dir} is a file, not a folder: give the folder CIFAR-10 is in (or goes to)")
        if not kind and not given.no_download:
            check_path("--data-dir", given.data_dir, folder=True)
        if self.shape["devices"] is not None:  # a strategy of processes (DDP, FSDP2), even of one
            refuse_at_a_prompt()
            register_process_end()
        # Lightning warns wherever srun exists but did not start the process (a login node, a one-process run
        # on a GPU node); check_launch refuses where that matters, and the opening line says what started it
        warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
        if given.precision != given.precision_asked:
            os.environ["LT_PRECISION"] = given.precision  # read by the lesson's Fabric(...)
        given.as_found = as_found
        return given

    def format_help(self):  # the script's own words first: its tagged lines, its docstring (read_script)
        self.description = read_script(sys.argv[0])["description"]
        return super().format_help()


def own_settings(actions, given):
    """The lesson's own flags, by their first option string (a positional's by its dest): (value, default), as
    JSON values; argparse applies a flag's type to a default given as text, so this does too."""
    own = {}
    for action in (a for a in actions if a.dest != argparse.SUPPRESS):
        default = action.default
        if isinstance(default, str) and callable(action.type):
            default = action.type(default)
        as_json = [json.loads(json.dumps(v, default=str)) for v in (getattr(given, action.dest), default)]
        own[(action.option_strings or [action.dest])[0]] = tuple(as_json)
    return own


def name_part(flag, value):
    """A changed setting in a run's name: a switch by its flag alone, a value after it (a list by commas)."""
    if isinstance(value, bool):
        return flag.lstrip("-")
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return flag.lstrip("-") + text.replace("/", "_")  # a path's value names a file, not folders


def refuse_at_a_prompt():
    """A lesson whose strategy runs processes (Lightning's subprocess launcher starts them, even one) at a prompt
    (IPython, a notebook, python -i), where that launcher refuses to start them: one line, with the shell's command."""
    if is_interactive():
        how = f"from a shell: {invoked(*sys.argv[1:])}"
        launcher = "Lightning's subprocess launcher, which cannot run at a prompt"
        fail(f"this lesson's processes are started by {launcher}: run it {how}")


def register_process_end():
    """The exit handler that ends a lesson's processes (end_multi_process_run), once an interpreter; a run's code
    set by RunKeeper as the run ends (parse_args clears it: a refused run ends as Python ends)."""
    if not PROCESS_END["registered"]:
        PROCESS_END["registered"] = True
        atexit.register(end_multi_process_run)


def place_processes(given, parser):
    """The accelerator, processes per machine and data-parallel replicas, the defaults the run's name is against, and
    the machine's refusal (where it cannot run what the flags ask: said after the lesson's own); a launch, a count of
    CPU processes or a tensor-parallel size that cannot be is refused here."""
    on_the_cpu = given.accelerator == "cpu" or (given.smoke and given.accelerator == "auto")  # CUDA not started
    devices, cuda_count = parser.shape["devices"], 0 if on_the_cpu else usable_gpus()
    accelerator, problem = given.accelerator, None  # the machine's refusal, said after the lesson's own (settle)
    if accelerator == "auto" and cuda_count == 0 and not given.smoke:
        hint = invoked(*started_flags(), "--smoke", *(["--resume"] if given.resume else []))
        cpu = f"A full run on a CPU takes about a day: try {hint}, or add --accelerator cpu to insist."
        problem = no_gpu_line(cpu) or f"no CUDA GPU found. {cpu}"
    if accelerator == "auto":  # the GPU if there is one; --smoke on the CPU, as its help says
        accelerator = "cuda" if cuda_count and not given.smoke else "cpu"
    default_devices = 1 if devices is None else min(devices, 2) if given.smoke and accelerator == "cpu" else devices
    count = 1 if devices is None else given.devices or default_devices  # --smoke on a CPU: 2 processes show it
    num_nodes, group = 1 if devices is None else given.num_nodes, given.tensor_parallel
    if accelerator == "cuda" and count > cuda_count:
        asked = f"--devices {count}" if devices else "--accelerator cuda"
        if not cuda_count:
            none = f"asked for {count} GPU(s) per machine ({asked}) but this machine has 0."
            problem = no_gpu_line(none[0].upper() + none[1:]) or none
        else:
            flags = flags_for(started_flags(), cuda_count, group, parser.flag("tensor_parallel", None))
            command = invoked(*flags, *(["--resume"] if given.resume else []))
            problem = fewer_gpus_line(count, cuda_count, asked, command)
    if accelerator == "cuda" and cuda_count and not problem:
        problem = no_kernels_line()
    cores = os.cpu_count() or 1
    if accelerator == "cpu" and count > max(4, cores):
        parser.error(f"--devices {count}: on a CPU each process needs a core; this machine has {cores}")
    check_launch(count, num_nodes, takes_devices=devices is not None)
    world = count * num_nodes
    if group < 1 or world % group:
        flag = parser.flag("tensor_parallel", "tensor_parallel")
        parser.error(f"{flag} {group} does not divide the {world} processes")
    places = dict(accelerator=accelerator, devices=count, num_nodes=num_nodes, world_size=world)
    return places | {"data_parallel": world // group, "defaults": {"world_size": default_devices}, "problem": problem}


def settle_sizes(given, parser, kind, places):
    """The epochs, batch, steps and micro-batches, checked against each other and the data; a smoke run's word on
    its batch; and the defaults the run's name is against."""
    shape, micro, replicas = parser.shape, given.micro_batches, places["data_parallel"]
    default_epochs = 1 if given.synthetic else shape["smoke_epochs"] if given.smoke else shape["epochs"]
    max_steps = SYNTHETIC_STEPS if given.synthetic and given.max_steps is None else given.max_steps
    epochs = given.epochs or default_epochs
    if given.synthetic and max_steps <= WARMUP_STEPS and epochs == 1:
        parser.error(f"--synthetic times the steps after {WARMUP_STEPS}: give --max-steps {WARMUP_STEPS + 1} or more")
    default_batch = max(1, SMOKE_GLOBAL_BATCH // replicas) if given.smoke else shape["batch_size"]
    batch = given.batch_size or default_batch
    if micro < 1 or batch % micro:
        split = f"the batch of {batch} (--batch-size) is trained on in {micro} micro-batches, so it must divide it"
        parser.error(f"{parser.flag('micro_batches', 'micro-batches')} {micro}: {split}")
    note, images = "", None if given.synthetic else parser.train_images.get(kind or "full")
    if given.smoke and SMOKE_GLOBAL_BATCH % replicas and batch == default_batch:
        note = f" The batch is {batch} per data-parallel process, {batch * replicas} in all, not the talk's 16:"
        note += f" 16 does not divide by {replicas}."
    if images is not None and batch * replicas > images:
        none = f"the {images:,} training images of a {kind or 'full'} run make no batch of {batch} for each of"
        largest = f"{replicas} data-parallel process(es); the largest that works is {images // replicas}"
        parser.error(f"--batch-size {batch}: {none} {largest}")
    per_epoch = images // replicas // batch if images is not None else max_steps  # the loader drops a last part
    per_epoch = min(per_epoch, max_steps) if max_steps else per_epoch
    sizes = dict(epochs=epochs, batch_size=batch, max_steps=max_steps, whole=given.synthetic or max_steps is None)
    sizes["steps"] = per_epoch * epochs
    steps = given.synthetic and SYNTHETIC_STEPS or None
    defaults = dict(epochs=default_epochs, batch_size=default_batch, max_steps=steps)
    return sizes | {"batch_note": note, "defaults": defaults}


def check_launch(devices, num_nodes, takes_devices):
    """One line, exit 2, where the started processes cannot be the run the flags ask for: all stop, the first
    says why."""
    env, one = os.environ, "" if takes_devices else " (one process)"
    asked = f"--devices {devices} --num-nodes {num_nodes}{one}"
    job, problem = env.get("SLURM_JOB_NAME"), None
    if "SLURM_NTASKS" in env and job not in SLURM_INTERACTIVE_JOBS:
        ntasks, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))
        per_node = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0])
        if "SLURM_STEP_ID" not in env and ntasks > 1:
            problem = f"SLURM gave this job {ntasks} tasks, but this process was started without srun, so it would"
            problem += f" wait for the others forever: start it with srun {invoked(*sys.argv[1:])}"
        elif "SLURM_NTASKS_PER_NODE" not in env:
            problem = f"SLURM started {ntasks} tasks with --ntasks, which does not say how many run on each machine:"
            problem += " use #SBATCH --ntasks-per-node (one task per GPU) instead"
        elif (per_node, nodes) != (devices, num_nodes):
            started = f"{per_node} task(s) per machine on {nodes} machine(s)"
            problem = f"SLURM started {started} (--ntasks-per-node {per_node}, --nodes {nodes}), but the flags ask for"
            problem += f" {asked}: make the two agree (one task per GPU)"
    elif "TORCHELASTIC_RUN_ID" in env:
        local, world = int(env.get("LOCAL_WORLD_SIZE", "1")), int(env.get("WORLD_SIZE", "1"))
        if (local, world) != (devices, devices * num_nodes):
            problem = f"torchrun started {local} process(es) here and {world} in all, but the flags ask for {asked}:"
            problem += " make --nproc-per-node and --nnodes agree with them"
    elif num_nodes > 1 and "NODE_RANK" not in env:
        launcher = "srun in a SLURM job, or torchrun on each machine (README: Running on several machines)"
        problem = f"--num-nodes {num_nodes}: processes on other machines need a launcher: {launcher}."
        if job in SLURM_INTERACTIVE_JOBS:
            problem += f" Inside `srun --pty bash` (SLURM job name {job!r}) Lightning does not use SLURM:"
            problem += " submit the job script with sbatch instead."
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
    """Whether the device computes bfloat16 in hardware: a GPU from Ampere on; a CPU with AVX512-BF16 or AMX (or Arm's
    bf16) unless ONEDNN_MAX_CPU_ISA caps oneDNN below them. With AVX2 alone a 512x512 product ran 110x slower."""
    if device_type == "cuda":
        import torch

        return torch.cuda.is_bf16_supported(including_emulation=False)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    capped = not (cap == "ALL" or any(isa in cap for isa in ("BF16", "FP16", "AMX", "AVX10")))
    return not capped and bool({"avx512_bf16", "amx_bf16", "bf16"} & set(cpu_model_and_flags()[1]))


def precision_that_runs(asked, accelerator, sharded):
    if not (asked or "").startswith("bf16") or native_bf16(accelerator):
        return asked
    return FALLBACKS.get((accelerator, asked, sharded), "32-true")


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


def fallback_line(args):
    """What a run says where the device has no native bfloat16, or None."""
    ran, asked = args.precision, args.precision_asked
    if ran == asked:
        return None
    if args.accelerator == "cuda":
        why = " (Fabric's FSDP2 strategy takes no 16-mixed)" if ran == "32-true" and asked == "bf16-mixed" else ""
        return f"This GPU ({device_name('cuda')}) has no native bfloat16: running {ran} instead of {asked}{why}."
    slow = "emulated bfloat16 runs many times slower than float32; the record says both. What bfloat16 saves in time"
    where = "and memory shows on a CPU with AVX512-BF16 or AMX, or a GPU from Ampere on (docs/smoke.md)."
    none = f"This {device_name('cpu')} has no native bfloat16 (no AVX512-BF16 or AMX)"
    return f"{none}: running {ran} instead of {asked}, since {slow} {where}"
