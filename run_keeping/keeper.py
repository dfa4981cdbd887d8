"""RunKeeper wraps a lesson's run, Fabric(...) included: `with RunKeeper(args) as keeper:`. It owns what it changes in
the process for the run (set_up registers an undo beside each change, and for what Lightning's launcher changes;
start(), the lock's); as the block ends it prints how the run ended, undoes it all, sets the exit code; it records."""

import contextlib
import fcntl
import json
import os
import re
import resource
import shutil
import signal
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path
from datetime import datetime, timezone
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from run_keeping.config import EXIT_ON_SIGNAL, LATEST, NO_LOCKS, SETTINGS, SLURM_INTERACTIVE_JOBS, VITS, WARMUP_STEPS
from run_keeping.config import fail, in_progress, invoked, read_json, resume_command, start_over, started_flags
from run_keeping.device import device_name, fallback_line
from run_keeping.record import append_record, build, first_line, peak_memory_gb, why_unloadable, write_atomically
from run_keeping.record import write_whole

PRINT_EVERY = 300  # batches between loss checks, where the lessons print (09 prints every 100, which divides it)
MEET_WITHIN = 60  # seconds a finished process waits at the end for the others (the run's files are already written)
# A run is busy when its computing thread waited for a core more than this share of its ready time. An idle 2-core
# AMD EPYC, --smoke --max-steps 20: 04 0.04%, 07 9.0%; beside two programs spinning: 04 49%, 07 50% (2026-12-05).
BUSY_WAIT = 0.25
# Errors with which a collective reports that a process of the run is gone (gloo, NCCL, the c10d store).
LOST_PEER = r"Connection (?:reset|closed) by peer|Broken pipe|Socket Timeout|Timed out waiting|Connection refused"
LOST_PEER += r"|NCCL communicator was aborted|remote process exited|ProcessGroupNCCL.*(?:timeout|Watchdog)"
# Errors meaning torch.compile's C/C++ compiler is missing; any other compile error is reported as it is.
NO_COMPILER = r"Failed to find C compiler|No working C\+\+ compiler|InvalidCxxCompiler|No such file or directory: "
NO_COMPILER += r"'(?:g\+\+|gcc|cc|c\+\+|clang\+*)'|(?:g\+\+|gcc|cc|clang): (?:command )?not found"
WHAT_RUNS = {
    "smoke": "a 3-layer ViT ({init}) trained on scikit-learn's 8x8 handwritten digits",
    "synthetic": "{vit} from random init on random images and labels",
    "smoke-synthetic": "the 3-layer smoke ViT from random init on random 32x32 images and labels",
}


class RunKeeper:
    """Inside the block the lesson calls start() (after fabric.launch()), keep_in_checkpoints() for a scheduler or EMA,
    before_training(), batch_done() after each batch, checkpoint() after each epoch and finish() at the end."""

    def __init__(self, args):
        self.args = args
        self.folder = Path(args.checkpoint_dir)
        self.undo = contextlib.ExitStack()  # each change the run makes to the process, undone as the block is left
        # this process's rank and the run's size (set by start)
        self.fabric: Any = None
        self.rank = 0
        self.world_size = 1
        self.precision_ran = "32-true"  # 00-02's (plain PyTorch); start(fabric) reads what Fabric runs
        # how the run ends: its signal, one held back while a step must finish (set_up, a save, the end), whether done
        self.signum = signal.SIGINT
        self.deferring = False
        self.deferred: signal.Signals | None = None
        self.finished = False
        # what before_training() is handed, and what else each checkpoint keeps (keep_in_checkpoints)
        self.model: Any = None
        self.optimizer: Any = None
        self.init = "random init"  # what the model starts from (build_vit's note)
        self.kept_too: list = []
        self.batches_per_epoch = 0
        # the last checkpoint kept, the epochs it holds, and the epoch the loop starts at
        self.last: Path | None = None
        self.epochs_kept = 0
        self.start_epoch = 0
        # each epoch's figures (a resumed run's earlier ones too), the peak memory of every session
        self.train_loss: list[float] = []
        self.val_acc: list[float] = []
        self.lr: list[float] = []
        self.peak_gb = 0.0
        self.earlier = {"train_time_s": 0.0, "timed_images": 0.0, "timed_seconds": 0.0}  # earlier sessions' (--resume)
        # this session's timing (started: when training began, 0 before)
        self.started = 0.0
        self.cpu_at_start = (0.0, 0.0)
        self.checkpoint_s: list[float] = []
        self.timed_images = 0
        self.timed_seconds = 0.0
        self.steps_this_session = 0
        self.new_epoch()

    def new_epoch(self):
        """Resets the epoch in progress; batch_done fills it (loss sum, first non-finite batch: kept on the device)."""
        self.batch_in_epoch = 0
        self.epoch_loss: torch.Tensor | None = None
        self.first_bad = torch.tensor(-1.0)  # none yet; moved to the loss's device at the epoch's first batch
        self.epoch_lr = 0.0
        self.timed_since: float | None = None  # the epoch's timer, from its first optimizer step's end (time_the_step)
        self.epoch_images = 0

    def __enter__(self):
        try:
            with self.signals_deferred():  # a signal during set_up is raised once every change is made
                self.set_up()
            return self
        except KeyboardInterrupt as stop:  # a signal during set_up acts as if at the block's start:
            self.__exit__(KeyboardInterrupt, stop, None)  # __exit__ prints it, undoes all, exits 130 or 143
            raise  # (not reached)
        except BaseException:
            self.deferring = True  # a signal during the undo waits, so every change is undone
            self.undo.close()
            raise

    def set_up(self):
        """Makes each change but the folder's lock (start's), its undo beside it on self.undo (undone in reverse)."""
        # Ctrl-C and SIGTERM: from here to the run's end, they stop it with one line and exit code 130 or 143
        for signum in EXIT_ON_SIGNAL:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # a background job's ignored signals stay ignored
                self.undo.callback(signal.signal, signum, signal.getsignal(signum) or signal.SIG_DFL)  # None: set in C
                signal.signal(signum, self.on_signal)
        # The environment is restored as found, without what Lightning's launcher adds (MASTER_PORT, LOCAL_RANK ...) or
        # LT_PRECISION, set here: the precision that runs, which Fabric takes over its argument (fabric/connector.py)
        self.undo.callback(put_back_environment, dict(os.environ))
        if self.args.precision:
            os.environ["LT_PRECISION"] = self.args.precision
        # torch's thread count is restored: Lightning's launcher (DDP, FSDP, ModelParallel) sets each process's to its
        # share of the cores, unless OMP_NUM_THREADS is set (lightning/fabric/utilities/distributed.py)
        self.undo.callback(torch.set_num_threads, torch.get_num_threads())
        # The warnings filters are restored. Muted: Lightning's warning that srun exists but did not start the process
        # (the opening line says what started it, and config refuses a launch that does not match the flags)
        self.undo.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")

    def on_signal(self, signum, frame):
        """Ctrl-C or SIGTERM raises KeyboardInterrupt wherever the run is, except in a step that must finish (set_up,
        naming a checkpoint, the finished run's files, the ending): then it is deferred until that step is done."""
        if self.deferring:
            self.deferred = self.deferred or signal.Signals(signum)
        else:
            self.signum = self.deferred = signal.Signals(signum)  # deferred too: said even where it is swallowed
            self.deferring = True  # from here a second is deferred, even in a finalizer run on the way to __exit__
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def signals_deferred(self):
        """Defers a signal during the block and raises it after the block (not if the block fails: its error shows)."""
        deferring = self.deferring  # restored after the block
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = deferring
        if self.deferred and not deferring:  # (when nested, the outermost block raises it)
            signum, self.deferred = self.deferred, None
            self.on_signal(signum, None)  # handled as if it arrived now

    def __exit__(self, exc_type, error, tb):
        """Reports how the run ended in one line and an exit code (a finished run prints nothing more), and undoes every
        change the run made, however it ended. An error with no known explanation propagates with its traceback."""
        self.deferring = True  # a signal from here on is deferred and reported below
        distributed = torch.distributed.is_initialized()
        gloo = distributed and torch.distributed.get_backend() == "gloo"
        try:
            line, code = self.ending(error)
            if code == 0 and distributed:  # this process finished: wait for all the others
                line, code = self.meet_at_the_end()
            self.say_the_end(line, error)
            if code == 0 and distributed:
                torch.distributed.destroy_process_group()  # as torchtitan does; only once every process reached the end
        finally:
            self.undo.close()  # releases the folder, restores the process as found, Python's signal handlers last
        if code == 0 and self.deferred:  # a signal while the finished run wrote its files, or later: report it
            line, code = self.interrupted_line(self.deferred), EXIT_ON_SIGNAL[self.deferred]
            self.say_the_end(line, error)
        unexplained = line is None and not isinstance(error, (SystemExit, KeyboardInterrupt, type(None)))
        if gloo:
            end_this_process(code, error if unexplained else None)  # now, skipping gloo's teardown (see its docstring)
        if code and not unexplained:
            raise SystemExit(code) from None
        return False  # finished; or the error propagates: traceback, exit 1

    def ending(self, error):
        """(message, exit code) for how the block was left: finished (None, 0); interrupted; a known error; a SystemExit
        already reported (None, its code), or sys.exit("why") ("why", 1); an error only a traceback explains."""
        if error is None:
            return None, 0
        if isinstance(error, KeyboardInterrupt):
            return self.interrupted_line(self.signum), EXIT_ON_SIGNAL[self.signum]
        if isinstance(error, SystemExit):
            if error.code is None or isinstance(error.code, int):
                return None, error.code or 0
            return str(error.code), 1
        return explain(error, self.args, self.rank, self.world_size, self.last) or (None, 1)

    def say_the_end(self, line, error):
        """Process 0 prints how the run ended; any other process prints only an error of its own (not a lost peer's)."""
        own = error is not None and not isinstance(error, KeyboardInterrupt) and not lost_peer(self.world_size, error)
        if line and (self.rank == 0 or own):
            process = f"process {self.rank}: " if self.rank else ""
            print(f"\n{self.args.script}: {process}{line}", file=sys.stderr, flush=True)

    def meet_at_the_end(self):
        """Waits for all processes to finish: (None, 0); on a signal meanwhile, or a process missing after MEET_WITHIN
        seconds, its (message, code). The barrier is async and polled: a blocking one would run no signal handler."""
        met = torch.distributed.barrier(async_op=True)
        assert met is not None, "barrier(async_op=True) returns its work"
        finished = f"the run finished: its record is in {self.args.results}"
        deadline = time.monotonic() + MEET_WITHIN
        while not met.is_completed():
            if self.deferred:
                return self.interrupted_line(self.deferred), EXIT_ON_SIGNAL[self.deferred]
            if time.monotonic() > deadline:
                lost = f"another process did not reach the run's end within {MEET_WITHIN} s (lost, or stuck)"
                return f"error: {lost}; {finished}.", 3
            time.sleep(0.01)
        try:
            met.wait()  # raises where the barrier failed: a process was lost after it finished
        except RuntimeError as err:
            return f"error: a process of the run was lost at its end ({first_line(err, 160)}); {finished}.", 3
        return None, 0

    def say(self, *lines, to=None):
        """Prints each non-empty line, on process 0 only (fabric.print prints once per machine)."""
        for line in lines:
            if line and self.rank == 0:
                print(line, file=to or sys.stdout, flush=True)

    def agree(self, action, *args):
        """Runs `action(*args)`; if fail() stops it in a process, all exit with the highest code (that one said why)."""
        code = 0
        result = None
        try:
            result = action(*args)
        except SystemExit as stop:  # fail() already printed its line
            code = int(stop.code or 0)
        failed = int(reduced(self.fabric, code, "max"))
        if failed and not code:
            why = f"process {self.rank} of {self.world_size} stops too: another process could not go on"
            print(f"{self.args.script}: error: {why} (its line says why).", file=sys.stderr, flush=True)
        if failed:
            raise SystemExit(failed)
        return result

    def start(self, fabric=None):
        """Called in each of the run's processes: process 0 locks the checkpoint folder (if any process fails, all
        stop); each prints who started it; process 0 reports a precision fallback and a launcher's restart."""
        if fabric is not None:
            self.fabric = fabric
            self.rank = fabric.global_rank
            self.world_size = fabric.world_size
            self.precision_ran = fabric.strategy.precision.precision
        self.agree(self.take_the_folder)
        print(opening_line(fabric, self.rank, self.world_size), flush=True)
        self.say(fallback_line(self.args, self.precision_ran))
        if self.args.restart:
            self.say(f"{self.args.restart}: continuing the run in {self.folder}.")

    def take_the_folder(self):
        """Process 0 locks the folder for the run (released as the block is left), removes its own writes' leftovers."""
        if self.rank == 0:
            with self.signals_deferred():  # take the lock and register its release, as one step
                ours = [self.folder, self.folder.parent] if self.args.checkpoint_dir_is_default else []
                lock = FolderLock(self.folder, ours)
                self.undo.callback(lock.release)
            if lock.unguarded:
                not_refused = "a second run started in it is not refused: give each run its own --checkpoint-dir"
                self.say(f"{self.folder} is on a file system that takes no locks ({lock.unguarded}): {not_refused}.")
            for leftover in [*self.folder.glob("epoch-*.ckpt.tmp"), self.folder / f"{LATEST}.tmp"]:  # a write cut off
                remove(leftover)

    def keep_in_checkpoints(self, *kept):
        """Adds objects (with state_dict(), load_state_dict()) that checkpoints save and --resume restores, in order."""
        self.kept_too += kept

    def before_training(self, model, optimizer, train_loader):
        """Stores what checkpoints save and prints what runs; with --resume or a restart, loads the last checkpoint and
        sets the loader's shuffling to where the run stopped; then starts the training clock (used by progress())."""
        self.model = model
        self.optimizer = optimizer
        self.batches_per_epoch = len(train_loader)
        self.init = getattr(model, "init", self.init)  # set by build_vit; Fabric's wrapper passes it through
        if self.args.kind:
            self.say(kind_line(self.args, self.init))
        if self.world_size > 1:
            self.say(parameters_held(self.fabric, model))
        if self.args.resume or self.args.restart:
            rng = self.agree(self.load_last_checkpoint)
            if self.world_size > 1:  # Fabric's loader sets its sampler's epoch to the number of times it was iterated
                for _ in range(self.start_epoch):  # (fabric/wrappers.py), so iterate once per finished epoch
                    next(iter(train_loader), None)
            torch.set_rng_state(rng)  # after those: each pass over the loader draws a seed from it
            self.say(f"Resuming from {self.last}: {self.start_epoch} of {self.args.epochs} epochs done.")
        self.cpu_at_start = cpu_times()  # the computing thread's waits count from here
        self.started = time.perf_counter()  # the loop starts now

    def batch_done(self, loss, batch_size):
        """Call after each batch. Adds to the epoch's loss sum and notes its first non-finite batch, on the device
        without waiting for it (checked every PRINT_EVERY batches and at the epoch's end); then times the step."""
        loss = loss.detach().float()
        if self.epoch_loss is None:  # the epoch's first batch
            self.epoch_loss = torch.zeros_like(loss)
            self.first_bad = self.first_bad.to(loss.device)
            self.epoch_lr = self.optimizer.param_groups[0]["lr"]  # the rate the epoch starts at
        self.epoch_loss = self.epoch_loss + loss  # once not finite, it stays so
        first_bad_now = (self.first_bad < 0) & ~torch.isfinite(self.epoch_loss)
        self.first_bad = torch.where(first_bad_now, self.batch_in_epoch, self.first_bad)
        self.batch_in_epoch += 1  # trained: an interrupt from here on counts it
        if self.deferring:  # here, only where a signal's KeyboardInterrupt was swallowed (a finalizer's, an except's)
            raise KeyboardInterrupt  # so the run stops as it asked
        if self.batch_in_epoch % PRINT_EVERY == 1:  # counted from 1: after batch_idx 0, 300, ..., where the lesson
            self.check_loss()  # prints (and waits for the device); the epoch's end checks too
        self.time_the_step(batch_size)

    def time_the_step(self, batch_size):
        """Times each epoch from the end of its first optimizer step, but not before this session's first WARMUP_STEPS
        (start-up, compilation) are done, to its last batch. A GPU's peak memory is reset as timing first starts."""
        optimizer_step = self.batch_in_epoch % self.args.micro_batches == 0
        if optimizer_step:
            self.steps_this_session += 1
        if self.timed_since is not None:
            self.epoch_images += batch_size
            if self.batch_in_epoch == self.batches_per_epoch:
                self.timed_images += self.epoch_images
                self.timed_seconds += self.now() - self.timed_since
        elif optimizer_step and self.steps_this_session >= WARMUP_STEPS:  # a step past the warm-up: the timer starts
            self.timed_since = self.now()
            if self.steps_this_session == WARMUP_STEPS and self.args.accelerator == "cuda":
                torch.cuda.reset_peak_memory_stats()

    def now(self):
        """The time, once the GPU (if any) has finished the work queued on it."""
        if self.args.accelerator == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def check_loss(self):
        """If the loss is not finite in any process, process 0 prints one line and every process exits 1."""
        first = torch.where(self.first_bad >= 0, self.first_bad, float("inf"))  # this process's first bad batch
        bad = reduced(self.fabric, first.clone(), "min")
        if bad < float("inf"):
            value = f"{self.epoch_loss:g}" if first == bad else "not finite in another process"
            where = f"at epoch {len(self.train_loss) + 1}, batch {int(bad)}"
            stop = f"the loss is {value} {where}: stopping; no checkpoint or record written for it."
            self.say(f"{self.args.script}: error: {stop}", to=sys.stderr)
            raise SystemExit(1)

    def checkpoint(self, val_acc):
        """Call after an epoch's validation: records the epoch's figures and saves the checkpoint to continue from."""
        self.check_loss()
        assert self.epoch_loss is not None, "checkpoint() comes after an epoch's batch_done()"
        mean_loss = reduced(self.fabric, self.epoch_loss / self.batch_in_epoch, "mean")
        self.train_loss.append(round(float(mean_loss), 6))
        self.val_acc.append(val_acc)
        self.lr.append(self.epoch_lr)
        self.new_epoch()
        if self.args.synthetic and len(self.train_loss) == self.args.epochs:
            return  # a synthetic run only measures: nothing is left to continue after its last epoch
        if self.steps_this_session >= WARMUP_STEPS or self.args.accelerator != "cuda":  # a GPU's: once reset
            self.peak_gb = max(self.peak_gb, peak_memory_gb(self.args.accelerator))
        began = time.perf_counter()
        self.agree(self.save_checkpoint)
        self.checkpoint_s.append(time.perf_counter() - began)

    def timed_totals(self):
        """Timed images of all processes (a tensor-parallel group's once), the slowest's seconds, plus earlier ones."""
        images = float(reduced(self.fabric, self.timed_images, "sum")) * self.args.data_parallel / self.world_size
        seconds = float(reduced(self.fabric, self.timed_seconds, "max"))
        return images + self.earlier["timed_images"], seconds + self.earlier["timed_seconds"]

    def progress(self):
        """The figures and timing a checkpoint keeps, earlier sessions' included (timed by the keeper's clock)."""
        images, seconds = self.timed_totals()
        train_time_s = self.earlier["train_time_s"] + time.perf_counter() - self.started - sum(self.checkpoint_s)
        figures = dict(epochs_done=len(self.train_loss), train_loss=self.train_loss, lr=self.lr, val_acc=self.val_acc)
        timing = dict(train_time_s=train_time_s, timed_images=images, timed_seconds=seconds, peak_gb=self.peak_gb)
        return figures | timing

    def save_checkpoint(self):
        """Writes the checkpoint of the epochs done under a .tmp name, then renames it and names it in latest.json, as
        one step a signal waits for; the previous checkpoint is removed. A failed write prints one line and exits 1."""
        done = len(self.train_loss)
        name = f"epoch-{done:04d}.ckpt"
        final, partial = self.folder / name, self.folder / (name + ".tmp")  # its name, and the name it is written as
        state = {"model": self.model, "optimizer": self.optimizer, "progress": self.progress()}
        state |= {"rng": torch.get_rng_state()} | {f"kept_{i}": kept for i, kept in enumerate(self.kept_too)}
        go_on = f"continue with: {resume_command()}" if self.last else f"start again with: {invoked(*started_flags())}"
        kept = f"the last good checkpoint ({self.last}) is untouched" if self.last else "no checkpoint was written yet"
        kept += f": once there is room, {go_on}"
        try:
            if self.fabric:
                self.fabric.save(partial, state)
            else:  # plain PyTorch (00-02): the state dicts, as Fabric's save writes them
                plain = {key: value.state_dict() for key, value in state.items() if key not in ("progress", "rng")}
                write_whole(partial, plain | {"progress": state["progress"], "rng": state["rng"]})
            with self.signals_deferred():  # the rename, latest.json and the old one's removal: one step
                if self.rank == 0:
                    os.replace(partial, final)
                    latest = latest_json(self.args, name, done)
                    write_atomically(self.folder / LATEST, json.dumps(latest).encode(), then=kept)
                    for older in self.folder.glob("epoch-*.ckpt"):
                        if older.name != name:
                            remove(older)
                self.last = final
                self.epochs_kept = done
        except (OSError, RuntimeError) as err:  # torch reports a full disk as a RuntimeError
            if lost_peer(self.world_size, err):
                raise  # not the disk: a process of the run is gone (explain says so)
            if self.rank == 0:
                remove(partial)
            full = shutil.disk_usage(self.folder).free < 64 * 2**20  # under 64 MiB free; torch's error has no strerror
            why = getattr(err, "strerror", None) or ("No space left on device" if full else first_line(err))
            fail(f"cannot write {partial}: {why}; {kept}.", code=1)

    def load_last_checkpoint(self):
        """Loads latest.json's checkpoint into the model, optimizer and kept objects; returns the saved RNG state."""
        latest = read_json(self.folder / LATEST)
        path = self.folder / str(latest.get("checkpoint"))
        state: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer, "progress": {}, "rng": None}
        state |= {f"kept_{i}": kept for i, kept in enumerate(self.kept_too)}
        if not path.exists():  # checked here: strategies report it differently (FileNotFoundError, FSDP2's ValueError)
            fail(f"--resume: cannot load {path} (it is not there); {start_over(self.args)}")
        try:
            if self.fabric:
                self.fabric.load(path, state)  # the model, optimizer and the rest in place; progress and rng filled in
            else:
                saved = torch.load(path, map_location="cpu", weights_only=True)
                for key in [k for k in state if k not in ("progress", "rng")]:
                    state[key].load_state_dict(saved[key])
                state |= {"progress": saved["progress"], "rng": saved["rng"]}
        except Exception as err:  # a truncated or foreign file fails in many ways
            why, whole = why_unloadable(err)
            if not whole:
                fail(f"--resume: cannot load {path} ({why}); {start_over(self.args)}")
            as_started = resume_command(latest.get("flags"))
            other = f"it was made by another script or version; continue it as started: {as_started}"
            fail(f"--resume: {path} does not fit what this script builds ({why}): {other}")
        progress = state["progress"]
        self.last = path
        self.epochs_kept = progress["epochs_done"]
        self.start_epoch = self.epochs_kept
        self.train_loss, self.val_acc, self.lr = progress["train_loss"], progress["val_acc"], progress["lr"]
        self.earlier = {key: progress[key] for key in self.earlier}
        self.peak_gb = progress.get("peak_gb", 0.0)
        return state["rng"]

    def finish(self, train_time_s, test_acc, model):
        """Prints the closing lines, writes the model file and record, then removes the checkpoints; a signal waits."""
        self.deferring = True  # never reset: a signal waits until the files are written, and __exit__ reports it
        args = self.args
        test_acc = None if args.synthetic else test_acc
        train_time_s = self.earlier["train_time_s"] + train_time_s - sum(self.checkpoint_s)  # the talk saved none
        images, seconds = self.timed_totals()
        this_process = [max(self.peak_gb, peak_memory_gb(args.accelerator)), waiting_share(self.cpu_at_start)]
        peak, waited = map(float, reduced(self.fabric, torch.tensor(this_process, dtype=torch.float64), "max"))
        # all processes take part where the model is sharded; process 0 gets it whole, under the ViT's own keys
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        images_per_s = round(images / seconds, 2) if seconds else None
        self.say(*closing_lines(train_time_s, peak, images_per_s, test_acc, self.checkpoint_s, waited))
        measured = dict(train_time_s=round(train_time_s, 3), images_per_s=images_per_s, peak_memory_gb=round(peak, 4))
        measured |= dict(train_loss=self.train_loss, lr=self.lr, val_acc=None if args.synthetic else self.val_acc)
        cpu_s = round(sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), 3)  # user + system: the load changes neither
        measured |= dict(test_acc=test_acc, busy=waited > BUSY_WAIT, cpu_s=cpu_s)
        # torch.compile's wrapper, by the name of its class (torch keeps it in a private module)
        compiled = any(type(module).__name__ == "OptimizedModule" for module in model.modules())
        self.agree(self.write_the_results, state, build(args, self.precision_ran, compiled, measured))
        self.finished = True

    def write_the_results(self, state, record):
        """Process 0 writes the model file and record, then deletes the checkpoints; a failed write says what's kept."""
        if self.rank:
            return
        args = self.args
        if args.synthetic:
            again = invoked(*started_flags())
            kept = f"a synthetic run keeps no checkpoint of its last epoch: run it again with: {again}"
        else:
            kept = f"the checkpoint of the finished training is kept in {self.folder}: finish with: {resume_command()}"
        write_atomically(args.save_model, state, then=kept)
        append_record(args.results, record, then=f"The model is saved in {args.save_model}, and {kept}.")
        for checkpoint in [self.folder / LATEST, *self.folder.glob("epoch-*.ckpt")]:
            remove(checkpoint)
        if args.kind:
            self.say(kind_line(args, self.init))
        if not args.whole:
            out = "plot_results.py and 08 leave it out unless asked"
            self.say(f"CUT SHORT by --max-steps {args.max_steps}: recorded as such; {out}.")
        self.say(f"Run record appended to {args.results}; finetuned model saved to {args.save_model}")

    def interrupted_line(self, signum):
        name = signal.Signals(signum).name
        if self.finished:
            where = f"its record is in {self.args.results} and its model in {self.args.save_model}"
            return f"interrupted ({name}) after the run finished: {where}."
        if not self.started:  # training has not begun
            if self.args.resume or self.args.restart:
                kept = f"{self.folder} is as it was: continue with: {resume_command()}"
                return f"interrupted ({name}) while starting; {kept}"
            return f"interrupted ({name}) while starting; no checkpoint, model or record was written."
        trained = len(self.train_loss)
        losing = ""
        if trained > self.epochs_kept:  # stopped after an epoch ended, before latest.json named its checkpoint
            losing = f"; epoch {trained}, trained but in no checkpoint yet, is not kept"
        elif self.batch_in_epoch:
            losing = f"; the {self.batch_in_epoch} batches of epoch {trained + 1} trained since are not kept"
        if self.last:
            held = f"the last checkpoint, {self.last}, holds {self.epochs_kept} of {self.args.epochs} epochs{losing}"
            return f"interrupted ({name}); {held}; continue with: {resume_command()}"
        return f"interrupted ({name}); no checkpoint yet (one follows each epoch but a synthetic run's last){losing}."


def latest_json(args, name, epochs_done):
    """latest.json's content: the newest checkpoint, what made it, and the launch ids a launcher's restart matches."""
    launch = {key.lower(): os.environ.get(key) for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")}
    settings = {key: getattr(args, key) for key in SETTINGS} | args.own  # (a record has SETTINGS as its own columns)
    made = {"script": args.script, "kind": args.kind, "settings": settings, "flags": started_flags()}
    return {"checkpoint": name, "epochs_done": epochs_done} | made | {"launch": launch}


def put_back_environment(found):
    """Restores os.environ to `found`: removes the variables added since, and sets back those changed or removed."""
    for name in set(os.environ) - set(found):
        del os.environ[name]
    os.environ.update(found)


def end_this_process(code, error=None):
    """Ends a process of a gloo (CPU) run at once, after printing `error`'s traceback, skipping the interpreter's
    teardown: there gloo's worker threads may still release a collective's tensor, whose Python object then aborts the
    process ("terminate called without an active exception": pytorch/pytorch#190489). So no code after the block and
    no exit handler runs in such a process (docs/run-keeping.md)."""
    if error is not None:
        traceback.print_exception(error)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a full disk: nothing more to say
            stream.flush()
    os._exit(code)


def parameters_held(fabric, model):
    """A line giving the parameters each process holds (its FSDP2 or tensor-parallel shards); a collective call."""
    held = torch.zeros(fabric.world_size, dtype=torch.float64)
    held[fabric.global_rank] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    each = ", ".join(f"{int(n):,}" for n in reduced(fabric, held, "sum"))
    return f"Parameters held per process: {each} of {sum(p.numel() for p in model.parameters()):,}"


def closing_lines(train_time_s, peak, images_per_s, test_acc, checkpoint_s, waited):
    """The talk's closing lines (time, memory), then ours: throughput, test accuracy, checkpoints, a busy machine."""
    lines = [f"Time elapsed {train_time_s / 60:.2f} min", f"Memory used: {peak:.02f} GB"]
    if images_per_s:
        lines.append(f"Throughput {images_per_s:.1f} training images/s")
    else:
        untimed = f"a run's first {WARMUP_STEPS} optimizer steps and each epoch's first are not timed"
        lines.append(f"Throughput not measured ({untimed})")
    lines.append("Synthetic data: no accuracy" if test_acc is None else f"Test accuracy {test_acc * 100:.2f}%")
    if checkpoint_s:
        lines.append(f"Checkpoints: {len(checkpoint_s)} written in {sum(checkpoint_s):.1f} s, not in the time above")
    if waited > BUSY_WAIT:
        busy = f"BUSY: this run waited for a CPU core {waited:.0%} of the time it was ready to run (another program"
        lines.append(busy + " was using the cores): its time and throughput are not comparable")
    return lines


def explain(error, args, rank, world_size, last_checkpoint):
    """(message, exit code) for an error the user can act on (docs/flags-records-exit-codes.md), or None."""
    reason = first_line(error) or type(error).__name__
    if type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):  # torch.compile's errors
        while wrapped := getattr(error, "inner_exception", None) or error.__cause__:  # unwrap to the backend's error
            error = wrapped
        without = "or run the script without its torch.compile line"
        if re.search(NO_COMPILER, f"{type(error).__name__} {error} {reason}", re.I):
            cuda = args.accelerator == "cuda"
            needs = "Triton and a C compiler (install gcc)" if cuda else "a C++ compiler (install g++)"
            return f"error: torch.compile could not compile the model ({reason}): here it needs {needs}, {without}.", 2
        return f"error: torch.compile failed ({type(error).__name__}: {first_line(error)}); {without}.", 1
    if isinstance(error, torch.OutOfMemoryError):
        oom = f"the GPU ran out of memory at --batch-size {args.batch_size} ({first_line(reason, 160)})"
        return f"error: {oom}: try a smaller --batch-size.", 1
    if lost := lost_peer(world_size, error):
        peer = re.search(r"\[([^\]]+)\]:(\d+)", str(error))
        which = f" (the one at {peer.group(1)}:{peer.group(2)})" if peer else ""
        if last_checkpoint:
            go_on = f"the last checkpoint is {last_checkpoint}; continue with {resume_command()} once every process can"
        else:
            go_on = "no checkpoint was written yet: start it again"
        said = lost.group(0)  # the collective's own words
        how = f"it was lost (a machine died, a process was killed) or it failed (its own output says which; {said})"
        stops = f"Process {rank} of {world_size} stops too; {go_on}"
        return f"error: a process of the run stopped{which}: {how}. {stops}.", 3
    return None


def lost_peer(world_size, error):
    return world_size > 1 and isinstance(error, RuntimeError) and re.search(LOST_PEER, str(error), re.I)


class FolderLock:
    """A run's exclusive flock on its folder's .lock file, whose text names the holder. On release it removes each
    folder it made and the run's own (`ours`: checkpoints/<run>/, checkpoints/) if empty; any other folder stays."""

    def __init__(self, folder, ours=()):
        self.path = Path(folder) / ".lock"
        self.unguarded = None  # why the file system took no lock (a second run is then not refused), or None
        made = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]  # deepest first
        self.made = list(dict.fromkeys([*made, *ours]))
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)  # again, in case a run releasing it just removed it
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in NO_LOCKS:  # no locks on this file system: the run goes on unguarded (start says so)
                    self.unguarded = err.strerror
                    break
                os.close(self.fd)
                self.release_folders()
                if isinstance(err, BlockingIOError):  # another run holds it
                    fail(in_progress(folder))
                raise
            if self.path.exists() and os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                break  # held; else a run releasing the .lock removed it meanwhile: open it again
            os.close(self.fd)
        since = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
        try:
            os.ftruncate(self.fd, 0)  # clear the previous holder's text, whatever its length
            os.pwrite(self.fd, f"process {os.getpid()} on {socket.gethostname()}, since {since}".encode(), 0)
        except BaseException:  # a full disk, say: release everything
            self.release()
            raise

    def release(self):
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.release_folders()

    def release_folders(self):
        for folder in self.made:
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def reduced(fabric, value, op):
    """`value` reduced by `op` over the run's processes, as a tensor (Fabric returns the type given); alone, `value`."""
    if fabric is None or fabric.world_size == 1:
        return value
    return torch.as_tensor(fabric.all_reduce(torch.as_tensor(value), reduce_op=op))


def remove(path):
    if Path(path).is_dir():
        shutil.rmtree(path)
    else:
        Path(path).unlink(missing_ok=True)


def cpu_times():
    """(seconds run, seconds waited for a core) of the calling thread, the one that computes (Linux's schedstat)."""
    try:
        return tuple(int(n) / 1e9 for n in Path("/proc/thread-self/schedstat").read_text().split()[:2])
    except (OSError, ValueError):
        return 0.0, 0.0


def waiting_share(since):
    """The fraction of its ready time since `since` (a cpu_times() result) that this thread waited for a core."""
    ran_now, waited_now = cpu_times()
    ran, waited = ran_now - since[0], waited_now - since[1]
    return waited / (waited + ran) if waited + ran > 0 else 0.0


def opening_line(fabric, rank, world_size):
    """Who started this process: SLURM, torchrun, Lightning's launcher, or nobody."""
    env = os.environ
    cluster = type(fabric.strategy.cluster_environment).__name__ if world_size > 1 else None
    by = "Lightning, which started this machine's processes itself" if world_size > 1 else None
    if cluster == "SLURMEnvironment":
        by = f"SLURM (job {env.get('SLURM_JOB_ID')}, srun task {env.get('SLURM_PROCID')})"
    elif cluster == "TorchElasticEnvironment":
        by = f"torchrun (node {env.get('GROUP_RANK', '0')}, local rank {env.get('LOCAL_RANK')})"
    if env.get("SLURM_JOB_NAME") in SLURM_INTERACTIVE_JOBS and cluster != "SLURMEnvironment":
        by = (by or "you") + f", inside SLURM job {env.get('SLURM_JOB_ID')}, whose name {env['SLURM_JOB_NAME']!r}"
        by += " makes Lightning ignore SLURM"
    return f"Process {rank} of {world_size}, started by {by}." if by else "One process, started without a launcher."


def kind_line(args, init):
    what = WHAT_RUNS[args.kind].format(init=init, vit=VITS[args.vit])
    run = f"{args.kind.upper().replace('-', '+')} RUN on {device_name(args.accelerator)}: {what}."
    return f"{run} Not the talk's experiment; its figures are not the talk's.{args.batch_note}"
