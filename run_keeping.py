"""Run-keeping for the numbered scripts, kept out of the lesson: the run record, throughput
timing, the loss guard, per-epoch checkpoints and --resume, Ctrl-C and SIGTERM, and the
finetuned model file. A script makes one `RunKeeper` and calls it four times:

    keeper = RunKeeper(args, fabric)            # checks, signal handlers (fabric: None in 00-02)
    keeper.resume(model, optimizer, train_loader)   # with --resume: sets keeper.start_epoch
    keeper.step(loss, len(targets))             # after each optimizer step
    keeper.checkpoint(epoch, model, optimizer, val_acc)           # after each epoch
    keeper.finish(train_time_s, test_acc, model)                  # closing lines, model, record

Files are written beside their final name and renamed into place; a write that fails (a full
disk, no permission) says which file and why in one line, removes what it half wrote and exits 1.
Exit codes: 1 a failed write or a NaN/inf loss, 2 bad input, 3 a process of the run was lost
(a machine died or was killed: continue with --resume), 130 Ctrl-C, 143 SIGTERM.
"""
import importlib.metadata
import io
import json
import re
import os
import platform
import random
import resource
import shlex
import shutil
import signal
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch


LATEST = "latest.json"   # names a checkpoint folder's newest finished epoch
WARMUP_STEPS = 3         # the run's first training steps are not timed (start-up, compilation)
PRINT_EVERY = 300        # the scripts print the loss every 300 batches; the loss guard reads then
FALLBACK = "This GPU ({gpu}) has no native bfloat16: running {instead} instead of bf16-mixed{why}."
# The settings that shape a run: a checkpoint keeps them, and --resume refuses to change them.
SETTINGS = ("batch_size", "seed", "epochs", "max_steps", "world_size", "tensor_parallel",
            "precision", "lr")
# How a collective reports a process of the run that is gone (gloo, NCCL, the c10d store).
LOST_PEER = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|Socket Timeout|"
                       r"NCCL communicator was aborted|remote process exited|ProcessGroupNCCL.*"
                       r"(?:timeout|Watchdog)|Connection refused", re.I)


def gpu_lacks_bf16():
    return not torch.cuda.is_bf16_supported(including_emulation=False)


def resume_command(flags=None):
    """The command that continues this run: the flags it was started with (or `flags`), plus
    --resume."""
    flags = [a for a in (sys.argv[1:] if flags is None else flags) if a != "--resume"]
    command = " ".join(["python", Path(sys.argv[0]).name, *map(shlex.quote, flags), "--resume"])
    if "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_JOB_ID" in os.environ:
        return f"the same torchrun/srun launch with --resume added ({command})"
    return command


def kind_flags(kind):
    """The flags of a kind of run: "smoke-synthetic" -> " --smoke --synthetic"."""
    return "".join(f" --{k}" for k in kind.split("-") if k)


def fail(message, code=2):
    """One line on stderr and exit `code` (2: bad input or machine), never a traceback."""
    message = " ".join(str(message).split())
    print(f"{Path(sys.argv[0]).name}: error: {message[:800]}", file=sys.stderr, flush=True)
    leave(code)


def leave(code):
    """Exit with `code`. A process of a multi-process run on gloo (CPUs) leaves at once, without
    the interpreter's shutdown: after an all_reduce or all_gather, gloo's worker thread releases
    the collective's tensors a moment after the caller goes on, and if the interpreter is
    shutting down by then, that release aborts the process ("terminate called without an active
    exception", exit -6; pytorch/pytorch#190489). Seen here in 06's two torchrun nodes, where the
    surviving node's agent then waited out torchrun's exit barrier, and in 3 of 24 bare loops.
    Lightning tears NCCL groups down itself at exit; anywhere else: SystemExit, as usual."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 \
            and dist.get_backend() != "nccl":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def why_unloadable(err):
    """What torch.load found wrong with a file, in a few words: never torch's advice to load it
    with weights_only=False (unsafe for a file of unknown origin)."""
    text = str(err)
    if "Weights only load failed" in text:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        if found:
            return f"it holds a {found.group(1)} object, not only tensors"
        return "it is not a file that torch.save wrote"
    return f"{type(err).__name__}: {(text.strip().splitlines() or [''])[0][:200]}"


def unwritable(path):
    """Why `path` cannot be written, or None; creates nothing (a file, or the folders to come)."""
    path = Path(path).absolute()
    if path.is_dir():
        return "it is a folder"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    target = path if path.exists() else parent
    return None if os.access(target, os.W_OK) else f"permission denied on {target}"


class RunKeeper:
    def __init__(self, args, fabric=None):
        self.args, self.fabric = args, fabric
        self.rank = fabric.global_rank if fabric else 0
        self.world_size = fabric.world_size if fabric else 1
        self.ckpt_dir = Path(args.checkpoint_dir)
        self.last_checkpoint = None
        self._check_checkpoint_folder()
        self.precision_asked = fabric.strategy.precision.precision if fabric else "32-true"
        if fabric and fabric.device.type == "cuda":
            fall_back_from_bf16(fabric)
        for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
            signal.signal(sig, lambda signum, frame, code=code: self._on_signal(signum, code))
        sys.excepthook = self._on_uncaught
        self.start_epoch, self.resumed, self.steps = 0, False, 0
        self.train_loss, self.val_acc, self.lr = [], [], []
        self.earlier = {"train_time_s": 0.0, "timed_images": 0.0, "timed_seconds": 0.0}
        self.timed_images, self.timed_seconds = 0, 0.0
        self._session_steps, self._epoch = 0, None
        self.settings = None  # known once the optimizer is: resume()

    # -- output ----------------------------------------------------------------------------------
    def print(self, *a):
        """print on global rank 0 only: fabric.print prints once per machine."""
        if self.rank == 0:
            print(*a, flush=True)

    def kind_line(self):
        """What a smoke or synthetic run is, said before its training and again at its end."""
        init = getattr(self.args, "init", "random init")
        what = {"smoke": f"a 3-layer ViT ({init}) trained on scikit-learn's 8x8 handwritten digits",
                "synthetic": "ViT-B/16 from random init on random images and labels",
                "smoke-synthetic": "the 3-layer smoke ViT from random init on random 32x32 "
                                   "images and labels"}[self.args.kind]
        from local_utilities import SMOKE_GLOBAL_BATCH as talks
        batch, replicas = "", self.args.data_parallel
        if self.args.smoke and talks % replicas and self.args.batch_size == talks // replicas:
            batch = (f" The batch is {self.args.batch_size} per data-parallel process, "
                     f"{self.args.batch_size * replicas} in all, not the talk's {talks}: {talks} "
                     f"does not divide by {replicas}.")
        return (f"{self.args.kind.upper().replace('-', '+')} RUN on "
                f"{device_name(self.args.accelerator)}: {what}. Not the talk's experiment; its "
                f"figures are not the talk's.{batch}")

    def _on_signal(self, signum, code):
        """Ctrl-C or SIGTERM (what SLURM sends first): one line saying how to continue."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.rank == 0:
            where = (f"last checkpoint: {self.last_checkpoint}; continue with: {resume_command()}"
                     if self.last_checkpoint else
                     "no checkpoint yet (one is written at the end of each epoch)")
            print(f"\n{self.args.script}: interrupted ({signal.Signals(signum).name}); {where}",
                  file=sys.stderr, flush=True)
        leave(code)

    def _on_uncaught(self, kind, err, traceback):
        """Errors a user can act on, in one line instead of a traceback: torch.compile without a
        working C++ compiler (exit 2), a GPU out of memory (exit 1), a process of the run lost
        (exit 3). Anything else: as usual."""
        first_line = (str(err).strip().splitlines() or [kind.__name__])[0]
        lost = self.world_size > 1 and issubclass(kind, RuntimeError) and LOST_PEER.search(str(err))
        if kind.__module__.startswith(("torch._dynamo", "torch._inductor")):
            instead = ("python 01_pytorch-vit.py, the same lesson without it" if
                       self.args.script.startswith("02") else "the script without its "
                       "torch.compile line")
            message, code = (f"torch.compile could not compile the model ({first_line}). On a "
                             "CPU it needs a working C++ compiler: install g++ (or point CXX at "
                             f"one), or run without compiling: {instead}."), 2
        elif issubclass(kind, torch.OutOfMemoryError):
            message, code = (f"the GPU ran out of memory at --batch-size {self.args.batch_size} "
                             f"({first_line[:120]}): try a smaller --batch-size."), 1
        elif lost:
            peer = re.search(r"\[([^\]]+)\]:(\d+)", str(err))
            which = f" (the one at {peer.group(1)}:{peer.group(2)})" if peer else ""
            where = (f"the last checkpoint is {self.last_checkpoint}; continue with "
                     f"{resume_command()} once every machine is back" if self.last_checkpoint
                     else "no checkpoint was written yet: start it again")
            message, code = (f"a process of the run was lost{which}: a machine died, or a "
                             f"process was killed ({lost.group(0)}). Process {self.rank} of "
                             f"{self.world_size} stops too; {where}."), 3
        else:
            return sys.__excepthook__(kind, err, traceback)
        print(f"{self.args.script}: error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)  # an excepthook cannot choose the exit code otherwise

    # -- checkpoints and --resume ---------------------------------------------------------------
    def _check_checkpoint_folder(self):
        latest = self.ckpt_dir / LATEST
        if latest.exists() and not self.args.resume:
            try:
                flags = json.loads(latest.read_text())["flags"]
            except (OSError, ValueError, KeyError, TypeError):
                flags = None
            fail(f"{self.ckpt_dir} holds the checkpoint of an unfinished run: continue it with "
                 f"{resume_command(flags)}, or choose another --checkpoint-dir (or delete that "
                 "one) to start over.")
        if self.args.resume and not latest.exists():
            stem = Path(self.args.script).stem
            others = sorted(p.parent.name for p in self.ckpt_dir.parent.glob(f"{stem}*/{LATEST}"))
            hint = "".join(f" {name} holds one: continue it with python {self.args.script}"
                           f"{kind_flags(name[len(stem) + 1:])} --resume." for name in others)
            fail(f"--resume: nothing to resume in {self.ckpt_dir} (no {LATEST}).{hint} On "
                 "several machines --checkpoint-dir must be a folder every machine sees.")

    def resume(self, model, optimizer, train_loader, scheduler=None):
        """With --resume: restore model, optimizer, scheduler, random states and the figures so
        far from the newest checkpoint, after checking that it is this run's (script, kind and
        SETTINGS). Sets and returns the first epoch to train."""
        self.optimizer, self.steps_per_epoch = optimizer, len(train_loader)
        self._started = time.time()
        group = optimizer.param_groups[0]
        self.settings = {**{k: getattr(self.args, k) for k in SETTINGS[:4]},
                         "world_size": self.world_size, "tensor_parallel": self.args.tensor_parallel,
                         "precision": self.precision_asked, "lr": group.get("initial_lr", group["lr"])}
        if self.args.kind:
            self.print(self.kind_line())
        self.held_parameters = self._gather(count_local_parameters(model))
        if self.world_size > 1:
            self.print("Parameters held per process: " + " + ".join(
                f"{n:,}" for n in self.held_parameters) + f" of {count_parameters(model):,}")
        if not self.args.resume:
            return 0
        latest_file = self.ckpt_dir / LATEST
        try:
            latest = json.loads(latest_file.read_text())
            path, script, kind = self.ckpt_dir / latest["checkpoint"], latest["script"], latest["kind"]
            settings, flags = latest["settings"], latest["flags"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            fail(f"--resume: {latest_file} is unreadable or corrupt ({type(err).__name__}: {err}).")
        if (script, kind) != (self.args.script, self.args.kind):
            fail(f"--resume: the checkpoint in {self.ckpt_dir} is from {script} ({kind or 'full'} "
                 f"run); this is {self.args.script} ({self.args.kind or 'full'} run). Each script "
                 "and kind of run continues only its own.")
        differences = [f"{k} {settings.get(k)} (now {self.settings[k]})" for k in SETTINGS
                       if settings.get(k) != self.settings[k]]
        if differences:
            fail(f"--resume: the checkpoint in {self.ckpt_dir} was made with "
                 f"{', '.join(differences)}; a resumed run keeps the settings it started with. "
                 f"Continue it as started: {resume_command(flags)}")
        extra = {"scheduler": scheduler} if scheduler else {}
        try:
            if self.fabric:
                state = {"model": model, "optimizer": optimizer, "progress": {}, "rng": {}, **extra}
                self.fabric.load(path, state)
            else:
                state = torch.load(path, map_location="cpu", weights_only=True)
                load_state_dict(model, state["model"])
                optimizer.load_state_dict(state["optimizer"])
                if scheduler:
                    scheduler.load_state_dict(state["scheduler"])
        except Exception as err:  # a truncated or foreign file fails in many ways
            fail(f"--resume: cannot load {path} ({why_unloadable(err)})")
        progress = state["progress"]
        if hasattr(getattr(train_loader, "sampler", None), "set_epoch"):
            # Fabric's loader sets the distributed sampler's epoch from the number of times it
            # was iterated: start it once per finished epoch (the random states follow below).
            for _ in range(progress["epochs_done"]):
                next(iter(train_loader), None)
        set_rng_states(state["rng"])
        self.start_epoch, self.steps = progress["epochs_done"], progress["steps"]
        self.train_loss, self.val_acc, self.lr = progress["train_loss"], progress["val_acc"], progress["lr"]
        self.earlier = {k: progress[k] for k in self.earlier}
        self.resumed, self.last_checkpoint = True, path
        self.print(f"Resuming {self.args.script} from {path}: {self.start_epoch} of "
                   f"{self.args.epochs} epochs done.")
        return self.start_epoch

    def step(self, loss, batch_size):
        """After each optimizer step, without waiting for the GPU: add the loss to the epoch's
        sum, note a NaN or infinite loss (read at the print points and the epoch's end), and
        time the steps (all but the run's first 3 and each epoch's first)."""
        loss = loss.detach().float()
        if self._epoch is None:  # the epoch's first step
            zero = torch.zeros((), device=loss.device)
            self._epoch = {"steps": 0, "loss": zero, "index": zero.clone(), "bad": zero - 1,
                           "bad_loss": zero.clone(), "timer": None, "timed": 0,
                           "lr": self.optimizer.param_groups[0]["lr"]}
        e = self._epoch
        first_bad = ~torch.isfinite(loss) & (e["bad"] < 0)
        e["bad"] = torch.where(first_bad, e["index"], e["bad"])
        e["bad_loss"] = torch.where(first_bad, loss, e["bad_loss"])
        e["loss"], e["index"] = e["loss"] + loss, e["index"] + 1
        e["steps"] += 1
        self.steps += 1
        self._session_steps += 1
        if e["steps"] % PRINT_EVERY == 1:
            self._stop_on_bad_loss()
        if e["timer"] is not None:
            e["timed"] += batch_size
        if e["steps"] == self.steps_per_epoch and e["timer"] is not None:
            self.timed_images += e["timed"]
            self.timed_seconds += self._now() - e["timer"]
        elif e["timer"] is None and self._session_steps >= WARMUP_STEPS:
            e["timer"] = self._now()
            if self._session_steps == WARMUP_STEPS and self.args.accelerator == "cuda":
                torch.cuda.reset_peak_memory_stats()  # the steady state's peak, not start-up's

    def _now(self):
        if self.args.accelerator == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _stop_on_bad_loss(self):
        bad = int(self._epoch["bad"]) if self._epoch else -1
        if bad >= 0:
            fail(f"the loss is {float(self._epoch['bad_loss'])} at epoch {len(self.train_loss) + 1}, "
                 f"batch {bad}: stopping; no checkpoint or record written for it.", code=1)

    def checkpoint(self, epoch, model, optimizer, val_acc, scheduler=None):
        """After an epoch's validation: keep its figures and save the checkpoint to resume from."""
        self._stop_on_bad_loss()
        e, self._epoch = self._epoch, None
        mean_loss = (e["loss"] / e["steps"]).cpu()
        if self.fabric:
            mean_loss = self.fabric.all_reduce(mean_loss, reduce_op="mean")
        self.train_loss.append(float(mean_loss))
        self.val_acc.append(val_acc)
        self.lr.append(e["lr"])
        name = f"epoch-{epoch + 1:04d}.ckpt"
        final, tmp = self.ckpt_dir / name, self.ckpt_dir / (name + ".tmp")
        progress = {"epochs_done": epoch + 1, "steps": self.steps, "train_loss": self.train_loss,
                    "val_acc": self.val_acc, "lr": self.lr,
                    **self._totals(time.time() - self._started)}
        meta = {"script": self.args.script, "kind": self.args.kind, "settings": self.settings,
                "flags": [a for a in sys.argv[1:] if a != "--resume"]}
        extra = {"scheduler": scheduler} if scheduler else {}
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            remove(tmp)
        self._barrier()
        try:
            if self.fabric:
                self.fabric.save(tmp, {"model": model, "optimizer": optimizer, "progress": progress,
                                       "rng": rng_states(), **extra})
            else:
                state = {"model": plain_state_dict(model), "optimizer": optimizer.state_dict(),
                         "progress": progress, "rng": rng_states(),
                         **{k: v.state_dict() for k, v in extra.items()}}
                buffer = io.BytesIO()
                torch.save(state, buffer)
                write_atomically(tmp, buffer.getvalue(), replace=False)
        except (OSError, RuntimeError) as err:  # torch reports a full disk as a RuntimeError
            if self.world_size > 1 and LOST_PEER.search(str(err)):
                raise  # not the disk: a process of the run is gone (_on_uncaught says so)
            remove(tmp)
            fail(f"cannot write the checkpoint {tmp}: {write_error(err, tmp)}. The last good "
                 f"checkpoint ({self.last_checkpoint or 'none yet'}) is untouched.", code=1)
        self._barrier()
        if self.rank == 0:
            os.replace(tmp, final)
            write_atomically(self.ckpt_dir / LATEST,
                             json.dumps({"checkpoint": name, **meta, **progress}).encode())
            for old in self.ckpt_dir.glob("epoch-*.ckpt"):
                if old.name != name:
                    remove(old)
        self.last_checkpoint = final  # before the barrier: a process lost there can name it
        self._barrier()

    # -- the end ---------------------------------------------------------------------------------
    def _totals(self, train_time_s):
        """Timed training images of all processes (each image once: a tensor-parallel group
        shares its batch), the slowest process's seconds, and the training time, each including
        the part before a --resume."""
        images, seconds = torch.tensor(float(self.timed_images)), torch.tensor(self.timed_seconds)
        if self.fabric and self.world_size > 1:
            images = self.fabric.all_reduce(images, reduce_op="sum") / self.args.tensor_parallel
            seconds = self.fabric.all_reduce(seconds, reduce_op="max")
        return {"timed_images": float(images) + self.earlier["timed_images"],
                "timed_seconds": float(seconds) + self.earlier["timed_seconds"],
                "train_time_s": self.earlier["train_time_s"] + train_time_s}

    def finish(self, train_time_s, test_acc, model):
        """The talk's closing lines, the finetuned model file, the run record; then the
        checkpoints are removed (nothing left to resume), and a multi-process run ends (leave)."""
        args = self.args
        totals = self._totals(train_time_s)
        images_per_s = (totals["timed_images"] / totals["timed_seconds"]
                        if totals["timed_seconds"] else None)
        memory = peak_memory_gb(args.accelerator)
        if self.fabric and self.world_size > 1:
            memory = float(self.fabric.all_reduce(torch.tensor(memory), reduce_op="max"))
        state = plain_state_dict(model)  # every process takes part when the model is sharded
        self.print(f"Time elapsed {totals['train_time_s'] / 60:.2f} min")
        self.print(f"Memory used: {memory:.02f} GB")
        self.print(f"Throughput {images_per_s:.1f} training images/s" if images_per_s else
                   f"Throughput not measured: no step was timed (a run's first {WARMUP_STEPS} "
                   "steps and each epoch's first are not)")
        if args.synthetic:
            self.print("Synthetic data: no accuracy")
        else:
            self.print(f"Test accuracy {test_acc * 100:.2f}%")
        if self.rank == 0:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            write_atomically(args.save_model, buffer.getvalue())
            precision = self.fabric.strategy.precision.precision if self.fabric else "32-true"
            strategy = type(self.fabric.strategy).__name__ if self.fabric else "SingleDeviceStrategy"
            strategy = STRATEGIES.get(strategy, strategy)
            if args.tensor_parallel > 1:
                strategy = "tensor-parallel+fsdp2"
            append_record(args.results, {
                "script": args.script, "kind": args.kind or "full", "smoke": args.smoke,
                "synthetic": args.synthetic, "init": getattr(args, "init", None),
                "resumed": self.resumed, "accelerator": args.accelerator,
                "device_name": device_name(args.accelerator), "devices": args.devices,
                "num_nodes": args.num_nodes, "world_size": self.world_size,
                "data_parallel_size": args.data_parallel,
                "tensor_parallel_size": args.tensor_parallel,
                "precision": precision, "strategy": strategy,
                "epochs": args.epochs, "batch_size": args.batch_size, "seed": args.seed,
                "max_steps": args.max_steps, "steps": self.steps,
                "train_time_s": round(totals["train_time_s"], 3),
                "images_per_s": None if images_per_s is None else round(images_per_s, 2),
                "timed_images": int(totals["timed_images"]),
                "timed_seconds": round(totals["timed_seconds"], 3),
                "peak_memory_gb": round(memory, 4),
                "parameters_per_process": [int(n) for n in self.held_parameters],
                "train_loss": self.train_loss, "lr": self.lr,
                "val_acc": None if args.synthetic else self.val_acc,
                "test_acc": None if args.synthetic else test_acc,
                "model_file": str(args.save_model), "compiled": compiled(),
                "torch": torch.__version__, "torchvision": version("torchvision"),
                "lightning": version("lightning"), "python": platform.python_version(),
                "hostname": socket.gethostname(),
                "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            })
            remove(self.ckpt_dir / LATEST)
            for old in self.ckpt_dir.glob("epoch-*.ckpt"):
                remove(old)
            if self.ckpt_dir.is_dir() and not any(self.ckpt_dir.iterdir()):
                self.ckpt_dir.rmdir()
            if args.kind:
                self.print(self.kind_line())
            self.print(f"Run record appended to {args.results}; finetuned model saved to "
                       f"{args.save_model}")
        self._barrier()
        if self.world_size > 1:
            leave(0)  # the run is done: the last line of every script

    def _barrier(self):
        if self.fabric and self.world_size > 1:
            self.fabric.barrier()

    def _gather(self, number):
        if self.fabric and self.world_size > 1:
            return [int(n) for n in self.fabric.all_gather(torch.tensor([number])).flatten()]
        return [number]


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


STRATEGIES = {"SingleDeviceStrategy": "single-device", "DDPStrategy": "ddp",
              "ModelParallelStrategy": "fsdp2-per-block", "FSDPStrategy": "fsdp"}


def fall_back_from_bf16(fabric):
    """bf16-mixed asked for on a GPU without native bfloat16 (before Ampere): 16-mixed instead,
    or 32-true under FSDP2, since Fabric's ModelParallelStrategy refuses 16-mixed; said in one
    line. Set through the strategy's public `precision` setter before the model is set up (the
    lesson line keeps the talk's precision="bf16-mixed")."""
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


# -- model state -------------------------------------------------------------------------------
def count_local_parameters(model):
    """Parameters this process holds: a sharded parameter counts only its local shard."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
               for p in model.parameters())


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def plain_state_dict(model):
    """The model's whole state dict on the CPU, with the keys of torchvision's model: FSDP2's
    shards gathered (every process must call this), torch.compile's "_orig_mod." dropped."""
    import logging  # gathering a 2-D (tensor x data parallel) shard warns that it takes two
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # steps
    state = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):  # a DTensor: a shard of an FSDP2 parameter
            value = value.full_tensor()
        state[key.replace("_orig_mod.", "")] = value.detach().cpu()
    return state


def load_state_dict(model, state):
    """model.load_state_dict for a plain state dict, also into a torch.compile'd model (whose own
    keys carry "_orig_mod.")."""
    own = {key.replace("_orig_mod.", ""): key for key in model.state_dict()}
    model.load_state_dict({own.get(key, key): value for key, value in state.items()})


def load_model_file(model, path):
    """A finetuned model file (a plain state dict) into `model`, or one line saying what is wrong
    with the file, exit 2."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        fail(f"no model file {path}: a finished training run writes one (see --save-model).")
    except Exception as err:
        fail(f"{path} is not a readable model file: {why_unloadable(err)}.")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        fail(f"{path} is not a model file of this suite (not a state dict of tensors).")
    try:
        load_state_dict(model, state)
    except RuntimeError as err:
        kind = "the small --smoke ViT" if state.get("conv_proj.weight", torch.empty(0)).shape[:1] == (128,) \
            else "ViT-B/16" if "conv_proj.weight" in state else "another model"
        fail(f"{path} holds {kind}, which does not fit the model built here "
             f"({str(err).splitlines()[0]}). Add or drop --smoke to match the run that made it.")
    if state["heads.head.weight"].shape[0] != 10:
        fail(f"{path} has {state['heads.head.weight'].shape[0]} outputs, not {10}.")


# -- random states -------------------------------------------------------------------------------
def rng_states():
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}  # plain, for weights_only
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states):
    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# -- files ---------------------------------------------------------------------------------------
def write_error(err, path):
    """The system's reason a write failed: torch reports a full disk as a RuntimeError."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    try:
        if shutil.disk_usage(Path(path).parent).free < 64 * 2**20:
            return "No space left on device"
    except OSError:
        pass
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def write_atomically(path, data, replace=True):
    """`data` to `path`: written beside it and renamed into place (replace=False: written to
    `path` itself), so the file is whole or absent. A failed write: one line, exit 1."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp") if replace else path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
    except OSError as err:
        remove(tmp)
        fail(f"cannot write {path}: {write_error(err, path)}; nothing else was changed.", code=1)


def append_record(path, record):
    """One JSON line, appended in one write, so the file stays valid JSONL even if the process is
    killed; a failed write is cut off again, leaving the earlier records as they were."""
    line = (json.dumps(record) + "\n").encode()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as err:
        fail(f"cannot write the run record to {path}: {write_error(err, path)}.", code=1)
    size = os.fstat(fd).st_size
    try:
        if os.write(fd, line) != len(line):
            raise OSError(28, "No space left on device")
    except OSError as err:
        os.ftruncate(fd, size)
        fail(f"cannot write the run record to {path}: {write_error(err, path)}; the earlier "
             "records are as they were.", code=1)
    finally:
        os.close(fd)


def read_records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def record_of(model_file, results):
    """The newest run record in `results` that saved `model_file`, or None."""
    try:
        records = read_records(results)
    except (OSError, ValueError):
        return None
    wanted = Path(model_file).resolve()
    return next((r for r in reversed(records)
                 if r.get("model_file") and Path(r["model_file"]).resolve() == wanted), None)


def remove(path):
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# -- the machine -----------------------------------------------------------------------------
def device_name(accelerator):
    if accelerator == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"CPU {model} ({os.cpu_count()} cores)"


def peak_memory_gb(accelerator):
    """GPU: torch.cuda.max_memory_reserved (the talk's figure); CPU: the process's peak resident
    memory (Linux reports kilobytes)."""
    if accelerator == "cuda":
        return torch.cuda.max_memory_reserved() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
