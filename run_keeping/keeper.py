"""RunKeeper, around a lesson's run in a `with` block: checkpoints and --resume, Ctrl-C and SIGTERM, one line for a
known error, the timing and the record. Every effect it has on a run is listed in docs/run-keeping.md."""

import fcntl
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from traceback import print_exception
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from run_keeping.config import EXIT_ON_SIGNAL, SLURM_INTERACTIVE_JOBS, VITS, WARMUP_STEPS, device_name, fail
from run_keeping.config import fallback_line
from run_keeping.config import PROCESS_END, end_process, invoked, on_signals, resume_command, started_flags
from run_keeping.record import append_record, build, first_line, peak_memory_gb, why_unloadable, write_atomically
from run_keeping.record import write_whole

PRINT_EVERY = 300  # the loss is checked every 300 batches, the talk's print interval (09 prints every 100)
MEET_WITHIN = 60  # seconds a finished process waits at the end for the others, whose files are written by then
FAILED = ".failed-process-"  # beside the lock: a process that failed with an error names itself for the others
LATEST = "latest.json"  # names a checkpoint folder's newest checkpoint
# The settings that shape a run: a checkpoint keeps them, and --resume refuses to change them.
SETTINGS = ("vit", "batch_size", "seed", "epochs", "max_steps", "world_size", "precision")  # and the lesson's own
# A run is busy when its computing thread spent more than this share of its ready time waiting for a core. On an
# idle 2-core AMD EPYC (2026-12-05), --smoke --max-steps 20: 04 0.04%, 05 5.7%, 07 9.0%; beside two programs spinning
# on the cores: 04 49%, 07 50%, 2-4 times slower.
BUSY_WAIT = 0.25
# How a collective reports a process of the run that is gone (gloo, NCCL, the c10d store).
LOST_PEER = r"Connection (?:reset|closed) by peer|Broken pipe|Socket Timeout|Timed out waiting|Connection refused"
LOST_PEER += r"|NCCL communicator was aborted|remote process exited|ProcessGroupNCCL.*(?:timeout|Watchdog)"
# How torch.compile says its compiler is missing; any other compile error is said as itself.
NO_COMPILER = r"Failed to find C compiler|No working C\+\+ compiler|InvalidCxxCompiler|No such file or directory: "
NO_COMPILER += r"'(?:g\+\+|gcc|cc|c\+\+|clang\+*)'|(?:g\+\+|gcc|cc|clang): (?:command )?not found"
WHAT_RUNS = {"smoke": "a 3-layer ViT ({init}) trained on scikit-learn's 8x8 handwritten digits"}
WHAT_RUNS |= {"synthetic": "{vit} from random init on random images and labels"}
WHAT_RUNS |= {"smoke-synthetic": "the 3-layer smoke ViT from random init on random 32x32 images and labels"}


class RunKeeper:
    """`with RunKeeper(args, fabric) as keeper:` around a script's run, which calls keep_in_checkpoints(), resume(),
    batch_done() after each batch, checkpoint() after each epoch and finish(): docs/run-keeping.md."""

    def __init__(self, args, fabric=None):
        self.args, self.fabric, self.folder = args, fabric, Path(args.checkpoint_dir)
        self.rank, self.world_size = (fabric.global_rank, fabric.world_size) if fabric else (0, 1)
        # What it keeps of the run, all of it here: the folder's lock, the last checkpoint kept, the epochs it holds,
        self.lock: FolderLock | None = None
        self.last: Path | None = None
        self.kept = self.start_epoch = 0
        # the figures of the epochs trained (a resumed run's earlier ones too) and the peak memory of every session,
        self.train_loss: list[float] = []
        self.val_acc: list[float] = []
        self.lr: list[float] = []
        self.peak_gb = 0.0
        self.earlier = {"train_time_s": 0.0, "timed_images": 0.0, "timed_seconds": 0.0}  # before a --resume
        # this session's timing and the epoch in progress (batch_done),
        self.checkpoint_s: list[float] = []
        self.started = 0.0
        self.timed_images, self.timed_seconds, self.steps_this_session = 0, 0.0, 0
        self.epoch_timer: float | None = None
        self.epoch_images = self.batch_in_epoch = 0
        self.epoch_loss: torch.Tensor | None = None
        self.first_bad = torch.tensor(-1.0)
        self.epoch_lr = 0.0
        self.cpu_at_start = cpu_times()
        # what resume() is handed and what the model starts from, the scheduler checkpoints keep,
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.batches_per_epoch = 0
        self.init = "random init"
        # and how it ends: the signal that interrupts it, one noted while it must not, whether it finished
        self.signum, self.deferred, self.finished = signal.SIGINT, None, False
        on_signals(self.on_signal)  # Ctrl-C and SIGTERM: KeyboardInterrupt wherever the run is
        try:  # a collective: every process takes part, and all stop where one cannot go on
            restart = self.agree(self.claim_folder)
        except BaseException as stopped:  # refused, interrupted or failed: no lock or folder left, all handed back
            self.let_go()
            if isinstance(stopped, KeyboardInterrupt):
                name = signal.Signals(self.signum).name
                self.say(f"\n{args.script}: interrupted ({name}) while starting; nothing was written.", to=sys.stderr)
                self.end(EXIT_ON_SIGNAL[self.signum])
                raise SystemExit(EXIT_ON_SIGNAL[self.signum]) from None
            code = stopped.code if isinstance(stopped, SystemExit) else None
            self.end(code if isinstance(code, int) else 1, None if isinstance(stopped, SystemExit) else stopped)
            raise
        self.resuming = args.resume or bool(restart)
        print(opening_line(fabric, self.rank, self.world_size), flush=True)
        self.say(fallback_line(args), f"{restart}: continuing the run in {self.folder}." if restart else None)

    def __enter__(self):
        return self

    def on_signal(self, signum, frame):  # Ctrl-C, SIGTERM, while the run trains
        self.signum = signum
        raise KeyboardInterrupt

    def defer_signal(self, signum, frame):  # while the last files are written, or a checkpoint is named
        self.deferred = self.deferred or signum

    def __exit__(self, exc_type, error, traceback):
        """One line and an exit code for an interruption or a known error, else a traceback; then it hands back."""
        on_signals(self.defer_signal)  # a signal from here on changes nothing: noted, said below
        code, message = 0, None
        if exc_type and issubclass(exc_type, KeyboardInterrupt):
            code, message = EXIT_ON_SIGNAL[self.signum], self.interrupted_line(self.signum)
        elif exc_type and issubclass(exc_type, SystemExit):
            code = error.code if isinstance(error.code, int) else 1  # its line is said
        elif exc_type:
            message, code = explain(error, self.args, self.rank, self.world_size, self.last) or (None, None)
            own = self.world_size > 1 and not lost_peer(self.world_size, error)  # this process's own error
            if own:  # the others, stopped by its leaving, name this process
                note_failure(self.folder, self.rank, self.world_size)
            if own and message and self.rank:  # said by the process that met it (process 0 speaks for the rest)
                print(f"\n{self.args.script}: process {self.rank}: {message}", file=sys.stderr, flush=True)
        if exc_type is None and self.world_size > 1:  # every process finished: the collectives in flight end
            code, message = self.meet_at_the_end()
        if not code and self.deferred:  # a signal while the finished run wrote its files, or since
            code, message = EXIT_ON_SIGNAL[self.deferred], self.interrupted_line(self.deferred)
        self.let_go()
        self.say(message and f"\n{self.args.script}: {message}", to=sys.stderr)
        self.end(code, error if code is None else None)
        if code:
            raise SystemExit(code) from None
        return False  # finished (0), or an error nobody can act on but by reading its traceback (None)

    def meet_at_the_end(self):
        """(0, None) once every process has finished; a signal meanwhile ends the wait with its code and line, and a
        process that never comes with exit 3 after MEET_WITHIN seconds. The wait is torch's barrier, started and
        then polled, so that Python's signal handlers run while it waits (a blocking one runs none until it ends)."""
        met, deadline = torch.distributed.barrier(async_op=True), time.monotonic() + MEET_WITHIN
        assert met is not None, "barrier(async_op=True) returns its work"
        while not met.is_completed():
            if self.deferred:
                return EXIT_ON_SIGNAL[self.deferred], self.interrupted_line(self.deferred)
            if time.monotonic() > deadline:
                lost = f"another process did not reach the run's end within {MEET_WITHIN} s (lost, or stuck)"
                return 3, f"error: {lost}; the run finished: its record is in {self.args.results}."
            time.sleep(0.01)
        try:
            met.wait()  # raises where the barrier failed: a process was lost after it finished
        except RuntimeError as err:
            lost = f"a process of the run was lost at its end ({first_line(err, 160)})"
            return 3, f"error: {lost}; the run finished: its record is in {self.args.results}."
        return 0, None

    def end(self, code, error=None):
        """Hands back: the process group destroyed where every process met at the end, the interpreter as found
        (Python's handlers again, for a prompt, a notebook, a debugger). A run of processes that did not meet (a
        signal, an error: a collective may be open, which destroying the group, or Lightning's exit handler that
        does, would wait for on NCCL) ends its process here, after the traceback of an `error`; one that met ends
        it after the exit handlers (config.PROCESS_END)."""
        distributed = torch.distributed.is_initialized()
        if distributed and code == 0:
            torch.distributed.destroy_process_group()
        self.args.as_found.put_back(guard=code is not None)  # after a traceback, Ctrl-C ends it as in any program
        if distributed and code != 0:
            if error is not None:
                print_exception(error)
            end_process(1 if code is None else code)
        if distributed:
            PROCESS_END["code"] = 0

    def let_go(self):
        """The folder let go of, and removed if nothing of the run is left in it."""
        if self.lock:
            self.lock.release()
            self.lock = None
            top = self.folder.parent if self.args.checkpoint_dir_is_default else self.folder
            for folder in (self.folder, top):
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()

    def say(self, *lines, to=None):  # on global rank 0 only (fabric.print prints once per machine)
        for line in lines:
            if line and self.rank == 0:
                print(line, file=to or sys.stdout, flush=True)

    def agree(self, action):
        """`action` here; where it failed in any process, every one exits with the highest code (the failing one
        said why)."""
        code, result = 0, None
        try:
            result = action()
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        if self.fabric and self.world_size > 1:
            failed = int(reduced(self.fabric, code, "max"))
            if failed and not code:
                why = f"process {self.rank} of {self.world_size} stops too: another process could not go on"
                why += " (its line says why)."
                print(f"{self.args.script}: error: {why}", file=sys.stderr, flush=True)
            code = failed
        if code:
            raise SystemExit(code)
        return result

    def claim_folder(self):
        """Process 0 locks the folder; all read whether the run continues the one in it: why a launcher restarted
        it, or None."""
        if self.rank == 0:
            self.lock = FolderLock(self.folder)
            for leftover in [*self.folder.glob("*.tmp"), *self.folder.glob(f"{FAILED}*")]:  # a write cut off, a note
                remove(leftover)
        exists, latest, c = (self.folder / LATEST).exists(), read_json(self.folder / LATEST) or {}, self.args
        restart = restart_reason(latest)
        if exists and not c.resume and not restart:
            continuing = f"continue it with: {resume_command(latest.get('flags'))}; or {elsewhere(self.folder)}"
            continuing += f"; or {start_over(self.folder, c.checkpoint_dir_is_default)}"
            fail(f"{self.folder} holds the checkpoint of an unfinished run: {continuing}")
        if c.resume and not exists:
            others = sorted(self.folder.parent.glob(f"{Path(c.script).stem}*/{LATEST}"))
            hint = [
                f"{p.parent} holds one: continue it with {resume_command((read_json(p) or {}).get('flags'))}."
                for p in others
            ]
            hint += ["Every machine must see it (--checkpoint-dir)."] if c.num_nodes > 1 else []
            fail(" ".join([f"--resume: nothing to resume in {self.folder} (no {LATEST}).", *hint]))
        return restart

    def keep_in_checkpoints(self, scheduler):  # a learning-rate scheduler, in each checkpoint
        self.scheduler = scheduler

    def resume(self, model, optimizer, train_loader):
        """Before training; with --resume (or a launcher's restart), the last checkpoint's state and the loader's
        order."""
        self.model, self.optimizer, self.batches_per_epoch = model, optimizer, len(train_loader)
        self.init = getattr(model, "init", "random init")  # local_utilities.build_vit notes it
        self.say(kind_line(self.args, self.init) if self.args.kind else None)
        self.cpu_at_start = cpu_times()  # the computing thread's waits count from here
        if self.fabric and self.world_size > 1:  # what each process holds: the shards made visible
            held = torch.zeros(self.world_size, dtype=torch.float64)
            held[self.rank] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
            held = ", ".join(f"{int(n):,}" for n in reduced(self.fabric, held, "sum"))
            self.say(f"Parameters held per process: {held} of {sum(p.numel() for p in model.parameters()):,}")
        if self.resuming:
            rng = self.agree(self.load_checkpoint)
            if self.world_size > 1:  # Fabric's loader sets its distributed sampler's epoch from the
                for _ in range(self.start_epoch):  # times it was iterated
                    next(iter(train_loader), None)
            torch.set_rng_state(rng)  # after those: each iteration draws a seed from it
            self.say(f"Resuming from {self.last}: {self.start_epoch} of {self.args.epochs} epochs done.")
        self.started = time.perf_counter()  # the loop starts now

    def batch_done(self, loss, batch_size):
        """After each batch, without waiting for the GPU: the epoch's loss sum, checked every PRINT_EVERY
        batches, and the timing of the steps after the first WARMUP_STEPS and each epoch's first."""
        loss = loss.detach().float()
        if self.epoch_loss is None:  # the epoch's loss sum, and its first batch whose loss is not finite
            self.epoch_loss, self.first_bad = torch.zeros_like(loss), torch.full_like(loss, -1)
            self.epoch_lr = self.optimizer.param_groups[0]["lr"]  # the rate the epoch starts at
        self.epoch_loss = self.epoch_loss + loss
        good = torch.isfinite(self.epoch_loss) | (self.first_bad >= 0)
        self.first_bad = torch.where(good, self.first_bad, self.batch_in_epoch)
        self.batch_in_epoch += 1
        if self.batch_in_epoch % PRINT_EVERY == 1:
            self.check_loss()
        optimizer_step = self.batch_in_epoch % self.args.micro_batches == 0
        if optimizer_step:
            self.steps_this_session += 1
        if self.epoch_timer is not None:
            self.epoch_images += batch_size
            if self.batch_in_epoch == self.batches_per_epoch:
                self.timed_images += self.epoch_images
                self.timed_seconds += self.now() - self.epoch_timer
        elif optimizer_step and self.steps_this_session >= WARMUP_STEPS:
            self.epoch_timer, self.epoch_images = self.now(), 0
            if self.steps_this_session == WARMUP_STEPS and self.args.accelerator == "cuda":
                torch.cuda.reset_peak_memory_stats()  # the steady state's peak, not start-up's

    def now(self):  # once the device has done what it was given
        if self.args.accelerator == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def check_loss(self):
        """Where the loss is not finite in any process: one line from process 0, and every process exits 1."""
        first = torch.where(self.first_bad >= 0, self.first_bad, float("inf"))  # this process's first bad batch
        bad = first if self.world_size == 1 else reduced(self.fabric, first.clone(), "min")  # reduced in place
        if bad < float("inf"):
            value = f"{self.epoch_loss:g}" if first == bad else "not finite in another process"
            where = f"at epoch {len(self.train_loss) + 1}, batch {int(bad)}"
            stop = f"the loss is {value} {where}: stopping; no checkpoint or record written for it."
            self.say(f"{self.args.script}: error: {stop}", to=sys.stderr)
            raise SystemExit(1)

    def checkpoint(self, val_acc):
        """After an epoch's validation: its figures, and the checkpoint to continue from."""
        self.check_loss()
        assert self.epoch_loss is not None, "checkpoint() comes after an epoch's batch_done()"
        mean_loss = self.epoch_loss / self.batch_in_epoch
        if self.fabric:
            mean_loss = reduced(self.fabric, mean_loss, "mean")
        self.train_loss.append(round(float(mean_loss), 6))
        self.val_acc.append(val_acc)
        self.lr.append(self.epoch_lr)
        self.epoch_loss, self.epoch_timer, self.batch_in_epoch = None, None, 0
        if self.args.synthetic and len(self.train_loss) == self.args.epochs:
            return  # a synthetic run measures: after its last epoch nothing is left to continue
        self.peak_gb = max(self.peak_gb, peak_memory_gb(self.args.accelerator))
        began = time.perf_counter()
        self.agree(self.save_checkpoint)
        self.checkpoint_s.append(time.perf_counter() - began)
        if self.args.accelerator == "cpu":  # a write's copy of the state is not training's memory:
            with open("/proc/self/clear_refs", "w") as f:  # the peak resident memory starts again
                f.write("5")

    def timed_totals(self):
        """Timed images of all processes (a tensor-parallel group's once), the slowest's seconds, and those before a
        --resume."""
        images, seconds = float(self.timed_images), self.timed_seconds
        if self.fabric and self.world_size > 1:
            images = float(reduced(self.fabric, images, "sum")) * self.args.data_parallel / self.world_size
            seconds = float(reduced(self.fabric, seconds, "max"))
        return images + self.earlier["timed_images"], seconds + self.earlier["timed_seconds"]

    def save_checkpoint(self):
        c, done = self.args, len(self.train_loss)
        name = f"epoch-{done:04d}.ckpt"
        final, partial = self.folder / name, self.folder / (name + ".tmp")
        images, seconds = self.timed_totals()
        train_time_s = self.earlier["train_time_s"] + time.perf_counter() - self.started - sum(self.checkpoint_s)
        progress: dict[str, Any] = dict(epochs_done=done, train_loss=self.train_loss, lr=self.lr, val_acc=self.val_acc)
        progress |= {
            "train_time_s": train_time_s,
            "timed_images": images,
            "timed_seconds": seconds,
            "peak_gb": self.peak_gb,
        }
        state = {"model": self.model, "optimizer": self.optimizer, "progress": progress, "rng": torch.get_rng_state()}
        state |= {"scheduler": self.scheduler} if self.scheduler else {}
        go_on = f"continue with: {resume_command()}" if self.last else f"start again with: {invoked(*started_flags())}"
        kept = f"the last good checkpoint ({self.last}) is untouched" if self.last else "no checkpoint was written yet"
        kept += f": once there is room, {go_on}"
        try:
            if self.fabric:
                self.fabric.save(partial, state)
            else:  # plain PyTorch (00-02): the state dicts, as Fabric's save writes them
                plain = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
                plain |= {"scheduler": self.scheduler.state_dict()} if self.scheduler else {}
                write_whole(partial, plain | {"progress": progress, "rng": state["rng"]})
            on_signals(self.defer_signal)  # the checkpoint named whole: the interruption line is true at any moment
            if self.rank == 0:
                os.replace(partial, final)
                launch = {k.lower(): os.environ.get(k) for k in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")}  # a restart's
                latest = {"checkpoint": name, "epochs_done": done, "script": c.script, "kind": c.kind, "launch": launch}
                latest |= {"settings": {key: getattr(c, key) for key in SETTINGS} | c.own, "flags": started_flags()}
                write_atomically(self.folder / LATEST, json.dumps(latest).encode(), then=kept)
            self.last, self.kept = final, done
            if self.rank == 0:
                for older in self.folder.glob("epoch-*.ckpt"):
                    if older.name != name:
                        remove(older)
        except (OSError, RuntimeError) as err:  # torch reports a full disk as a RuntimeError
            if lost_peer(self.world_size, err):
                raise  # not the disk: a process of the run is gone (explain says so)
            if self.rank == 0:
                remove(partial)
            full = shutil.disk_usage(self.folder).free < 64 * 2**20  # torch says a full disk without strerror
            why = getattr(err, "strerror", None) or ("No space left on device" if full else first_line(err))
            fail(f"cannot write {partial}: {why}; {kept}.", code=1)
        finally:
            on_signals(self.on_signal)
            if self.deferred:  # a signal while the checkpoint was named: acted on now
                self.signum, self.deferred = self.deferred, None
                raise KeyboardInterrupt

    def load_checkpoint(self):
        latest, c = read_json(self.folder / LATEST), self.args
        afresh = start_over(self.folder, c.checkpoint_dir_is_default)
        if not isinstance(latest, dict):
            fail(f"--resume: {self.folder / LATEST} is unreadable or corrupt (not the JSON a run writes); {afresh}")
        path, saved = self.folder / str(latest.get("checkpoint")), latest.get("settings") or {}
        mine = {"script": c.script, "kind": c.kind, **{key: getattr(c, key) for key in SETTINGS}, **c.own}
        theirs = {"script": latest.get("script"), "kind": latest.get("kind"), **saved}
        differences = [f"{key} {theirs.get(key)} (now {v})" for key, v in mine.items() if theirs.get(key) != v]
        as_started = f"continue it as started: {resume_command(latest.get('flags'))}"
        if differences:
            made = f"the checkpoint in {self.folder} was made with {', '.join(differences)}"
            fail(f"--resume: {made}; {as_started}; or {elsewhere(self.folder)}")
        state: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer, "progress": {}, "rng": None}
        state |= {"scheduler": self.scheduler} if self.scheduler else {}
        try:
            if self.fabric:
                self.fabric.load(path, state)  # restores the model, optimizer and scheduler in place
            else:
                state = torch.load(path, map_location="cpu", weights_only=True)
                for key in ["model", "optimizer"] + (["scheduler"] if self.scheduler else []):
                    getattr(self, key).load_state_dict(state[key])
        except Exception as err:  # a truncated or foreign file fails in many ways
            why = why_unloadable(err)
            if "damaged" in why or "not a file" in why:
                fail(f"--resume: cannot load {path} ({why}); {afresh}")
            other = "it was made by another script or version"
            fail(f"--resume: {path} does not fit what this script builds ({why}): {other}; {as_started}")
        progress, self.last = state["progress"], path
        self.start_epoch = self.kept = progress["epochs_done"]
        self.train_loss, self.val_acc, self.lr = progress["train_loss"], progress["val_acc"], progress["lr"]
        self.earlier, self.peak_gb = {key: progress[key] for key in self.earlier}, progress.get("peak_gb", 0.0)
        return state["rng"]

    def finish(self, train_time_s, test_acc, model):
        """The talk's closing lines, the model file, the record, then the checkpoints go; a signal waits for them."""
        on_signals(self.defer_signal)  # all or nothing: a signal waits until the files are written
        c, test_acc = self.args, None if self.args.synthetic else test_acc
        train_time_s = self.earlier["train_time_s"] + train_time_s - sum(self.checkpoint_s)  # the talk wrote none
        images, seconds = self.timed_totals()
        peak, waited = max(self.peak_gb, peak_memory_gb(c.accelerator)), waiting_share(self.cpu_at_start)
        if self.fabric and self.world_size > 1:
            peak, waited = map(float, reduced(self.fabric, torch.tensor([peak, waited], dtype=torch.float64), "max"))
        # every process takes part where the model is sharded; process 0 gets the whole state dict
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        images_per_s = round(images / seconds, 2) if seconds else None
        untimed = f"a run's first {WARMUP_STEPS} optimizer steps and each epoch's first are not timed"
        untimed = f"Throughput not measured ({untimed})"
        lines = [f"Time elapsed {train_time_s / 60:.2f} min", f"Memory used: {peak:.02f} GB"]  # the talk's, then ours
        lines += [f"Throughput {images_per_s:.1f} training images/s" if images_per_s else untimed]
        lines += ["Synthetic data: no accuracy" if test_acc is None else f"Test accuracy {test_acc * 100:.2f}%"]
        written = (
            f"Checkpoints: {len(self.checkpoint_s)} written in {sum(self.checkpoint_s):.1f} s, not in the time above"
        )
        busy = f"BUSY: this run waited for a CPU core {waited:.0%} of the time it was ready to run (another program"
        busy += " was using the cores): its time and throughput are not comparable"
        self.say(*lines, written if self.checkpoint_s else None, busy if waited > BUSY_WAIT else None)
        measured = dict(train_time_s=round(train_time_s, 3), images_per_s=images_per_s, peak_memory_gb=round(peak, 4))
        measured |= dict(train_loss=self.train_loss, lr=self.lr, val_acc=None if c.synthetic else self.val_acc)
        cpu_s = round(sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), 3)  # what the machine's load does not change
        measured |= dict(test_acc=test_acc, busy=waited > BUSY_WAIT, cpu_s=cpu_s)

        def keep():
            if self.rank == 0:
                if c.synthetic:
                    again = invoked(*started_flags())
                    kept = f"a synthetic run keeps no checkpoint of its last epoch: run it again with: {again}"
                else:
                    kept = f"the checkpoint of the finished training is kept in {self.folder}"
                    kept += f": finish with: {resume_command()}"
                write_atomically(c.save_model, state, then=kept)
                compiled = any(type(module).__name__ == "OptimizedModule" for module in model.modules())
                record = build(c, self.fabric, compiled, measured)
                append_record(c.results, record, then=f"The model is saved in {c.save_model}, and {kept}.")
                for checkpoint in [self.folder / LATEST, *self.folder.glob("epoch-*.ckpt")]:
                    remove(checkpoint)
                cut_short = f"CUT SHORT by --max-steps {c.max_steps}: recorded as such; plot_results.py and 08 leave"
                cut_short += " it out unless asked."
                self.say(kind_line(c, self.init) if c.kind else None, None if c.whole else cut_short)
                self.say(f"Run record appended to {c.results}; finetuned model saved to {c.save_model}")

        self.agree(keep)
        self.finished = True

    def interrupted_line(self, signum):
        name, c = signal.Signals(signum).name, self.args
        if self.finished:
            where = f"its record is in {c.results} and its model in {c.save_model}"
            return f"interrupted ({name}) after the run finished: {where}."
        trained, batches, losing = len(self.train_loss), self.batch_in_epoch, ""
        if trained > self.kept:  # between an epoch's end and its checkpoint's name in latest.json
            losing = f"; epoch {trained}, whose checkpoint was being written, is not kept"
        elif batches:
            losing = f"; the {batches} batches of epoch {trained + 1} trained since are not kept"
        if self.last:
            held = f"the last checkpoint, {self.last}, holds {self.kept} of {c.epochs} epochs{losing}"
            return f"interrupted ({name}); {held}; continue with: {resume_command()}"
        return f"interrupted ({name}); no checkpoint yet (one is written after each epoch){losing}."


def start_over(folder, default_folder):
    """The commands that drop the unfinished run (and checkpoints/ where it is left empty) and start anew."""
    parent = f" && rmdir {shlex.quote(str(folder.parent))} 2>/dev/null" if default_folder else ""
    return f"start over with: rm -rf {shlex.quote(str(folder))}{parent}; {invoked(*started_flags())}"


def elsewhere(folder):
    """The command that starts this run in a folder of its own, the checkpoint in `folder` left as it is."""
    number = next(n for n in range(2, 10**6) if not Path(f"{folder}-{n}").exists())
    flags, skip = [], False
    for flag in started_flags():  # all but an earlier --checkpoint-dir
        if not skip and not flag.startswith("--checkpoint-dir"):
            flags.append(flag)
        skip = flag == "--checkpoint-dir"
    return f"start this one in a folder of its own: {invoked(*flags, '--checkpoint-dir', f'{folder}-{number}')}"


def note_failure(folder, rank, world_size):
    """A file in the run's folder (every machine sees it) that names this process as failed with an error."""
    try:
        (folder / f"{FAILED}{rank}").write_text(f"process {rank} of {world_size}\n")
    except OSError:
        pass  # the others then say that a process was lost


def explain(error, args, rank, world_size, last_checkpoint):
    """(one line, exit code) for an error a user can act on (flags-records-exit-codes.md), or None."""
    reason, lost = first_line(error) or type(error).__name__, lost_peer(world_size, error)
    if type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):  # torch.compile's errors
        while getattr(error, "inner_exception", None) or error.__cause__:  # Dynamo wraps the backend's
            error = getattr(error, "inner_exception", None) or error.__cause__
        without = "or run the script without its torch.compile line"
        if re.search(NO_COMPILER, f"{type(error).__name__} {error} {reason}", re.I):
            needs = "a C++ compiler (install g++)"
            needs = "Triton and a C compiler (install gcc)" if args.accelerator == "cuda" else needs
            return f"error: torch.compile could not compile the model ({reason}): here it needs {needs}, {without}.", 2
        return f"error: torch.compile failed ({type(error).__name__}: {first_line(error)}); {without}.", 1
    if isinstance(error, torch.OutOfMemoryError):
        oom = f"the GPU ran out of memory at --batch-size {args.batch_size} ({first_line(reason, 160)})"
        return f"error: {oom}: try a smaller --batch-size.", 1
    failed = sorted(Path(args.checkpoint_dir).glob(f"{FAILED}*")) if lost else []
    if failed:  # not lost: a process failed with an error, and said it in its traceback
        which = " and ".join(f.read_text().strip() for f in failed)  # left for the others; the next start clears them
        return f"error: {which} failed with an error (its traceback says which). Process {rank} stops too.", 1
    if lost:
        peer = re.search(r"\[([^\]]+)\]:(\d+)", str(error))
        which = f" (the one at {peer.group(1)}:{peer.group(2)})" if peer else ""
        go_on = f"the last checkpoint is {last_checkpoint}; continue with {resume_command()} once every machine is back"
        go_on = go_on if last_checkpoint else "no checkpoint was written yet: start it again"
        lost_line = f"a process of the run was lost{which}: a machine died, or a process was killed ({lost.group(0)})"
        return f"error: {lost_line}. Process {rank} of {world_size} stops too; {go_on}.", 3
    return None


def lost_peer(world_size, error):
    return world_size > 1 and isinstance(error, RuntimeError) and re.search(LOST_PEER, str(error), re.I)


class FolderLock:
    """A run's hold on its folder: an flock on its .lock, which names the holder for a run it refuses."""

    def __init__(self, folder):
        self.path = Path(folder) / ".lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(self.fd, 400, 0).decode(errors="replace").strip() or "another process"
                os.close(self.fd)
                fail(f"a run is in progress in {folder} ({holder}): wait, or give this one another --checkpoint-dir.")
            if self.path.exists() and os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                break  # not a .lock that the run before removed as this one opened it
            os.close(self.fd)
        since = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
        os.ftruncate(self.fd, 0)  # exactly this holder's line, however long the last one's was
        os.pwrite(self.fd, f"process {os.getpid()} on {socket.gethostname()}, since {since}".encode(), 0)

    def release(self):
        remove(self.path)
        os.close(self.fd)


def reduced(fabric, value, op):
    """`value` reduced over the run's processes, as a tensor (Fabric gives back what it is given)."""
    result = fabric.all_reduce(torch.as_tensor(value), reduce_op=op)
    assert isinstance(result, torch.Tensor)
    return result


def read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def remove(path):
    if Path(path).is_dir():
        shutil.rmtree(path)
    else:
        Path(path).unlink(missing_ok=True)


def restart_reason(latest):
    """Why this process is the run that wrote `latest`, started again by its launcher (SLURM, torchrun), or None."""
    env, launch = os.environ, latest.get("launch") or {}
    slurm, torchrun = int(env.get("SLURM_RESTART_COUNT", "0")), int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if slurm and env.get("SLURM_JOB_ID") == launch.get("slurm_job_id"):
        return f"SLURM requeued job {env['SLURM_JOB_ID']} (restart {slurm})"
    if torchrun and env.get("TORCHELASTIC_RUN_ID") == launch.get("torchelastic_run_id"):
        return f"torchrun restarted its workers (restart {torchrun})"
    return None


def cpu_times():
    """(seconds run, seconds waited for a core) of the calling thread, the one that computes (Linux's schedstat)."""
    try:
        return tuple(int(n) / 1e9 for n in Path("/proc/thread-self/schedstat").read_text().split()[:2])
    except (OSError, ValueError):
        return 0.0, 0.0


def waiting_share(since):
    """The share of its ready time since `since` (cpu_times) the thread waited for a core."""
    ran, waited = (now - then for now, then in zip(cpu_times(), since))
    return waited / (waited + ran) if waited + ran > 0 else 0.0


def opening_line(fabric, rank, world_size):
    env = os.environ
    cluster = type(fabric.strategy.cluster_environment).__name__ if world_size > 1 else None
    by = "Lightning, which started this machine's processes itself" if world_size > 1 else None
    if cluster == "SLURMEnvironment":
        by = f"SLURM (job {env.get('SLURM_JOB_ID')}, srun task {env.get('SLURM_PROCID')})"
    elif cluster == "TorchElasticEnvironment":
        by = f"torchrun (node {env.get('GROUP_RANK', '0')}, local rank {env.get('LOCAL_RANK')})"
    if env.get("SLURM_JOB_NAME") in SLURM_INTERACTIVE_JOBS and cluster != "SLURMEnvironment":
        job, name = env.get("SLURM_JOB_ID"), env["SLURM_JOB_NAME"]
        by = (by or "you") + f", inside SLURM job {job}, whose name {name!r} makes Lightning ignore SLURM"
    return f"Process {rank} of {world_size}, started by {by}." if by else "One process, started without a launcher."


def kind_line(args, init):
    what = WHAT_RUNS[args.kind].format(init=init, vit=VITS[args.vit])
    run = f"{args.kind.upper().replace('-', '+')} RUN on {device_name(args.accelerator)}: {what}."
    return f"{run} Not the talk's experiment; its figures are not the talk's.{args.batch_note}"
