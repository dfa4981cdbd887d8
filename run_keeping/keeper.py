"""RunKeeper: what a numbered script calls to keep its run, out of the lesson's way: the figures so
far (Figures), the step timing (StepMeter), the signals (Stopping) and the record.

Ctrl-C and SIGTERM (SLURM's warning before it kills) stop a run in training at its next optimizer
step, the same in every process, after a checkpoint of where it is; otherwise at once.
"""
import io
import os
import re
import signal
import sys
import time

import torch

from run_keeping import EXIT_CODES, clean_up, fail, first_sentence, leave, on_exit
from run_keeping.checkpoints import (SETTINGS, Checkpoints, continue_data_order, count_local_parameters,
                                     count_parameters, held_line, plain_state_dict, rng_states)
from run_keeping.config import VITS, WARMUP_STEPS, invoked, resume_command, started_flags
from run_keeping.record import build, compile_mode, techniques
from run_keeping.files import append_record, sha256, write_atomically
from run_keeping.processes import (StopVote, bound_waits, device_name, fall_back_from_bf16, forget_cpu_peak,
                                   fsdp_units, gather, lost_peer, opening_line, peak_memory_gb,
                                   share_cpu_threads, together, BUSY_WAIT, cpu_from, waiting_share)

PRINT_EVERY = 300  # the scripts print the loss every 300 batches; the loss guard reads then
WHAT_RUNS = {"smoke": "a 3-layer ViT ({init}) trained on scikit-learn's 8x8 handwritten digits",
             "synthetic": "{vit} from random init on random images and labels",
             "smoke-synthetic": "the 3-layer smoke ViT from random init on random 32x32 images and labels"}
COMPILERS = {  # what torch.compile needs on each device, and where to find it
    "cpu": "On a CPU it needs a working C++ compiler: install g++ (or point CXX at one)",
    "cuda": "On a GPU it needs Triton (torch's CUDA wheels bring it) and a C compiler to build "
            "Triton's launcher: install gcc (or point CC at one)",
}
# How torch.compile says its compiler is missing (inductor's C++ check, Triton's C compiler, a
# compiler command that is not there); any other compile error is said as itself.
NO_COMPILER = re.compile(r"Failed to find C compiler|No working C\+\+ compiler|InvalidCxxCompiler|"
                         r"No such file or directory: '(?:g\+\+|gcc|cc|c\+\+|clang\+*)'|"
                         r"(?:g\+\+|gcc|cc|clang): (?:command )?not found", re.I)


class RunKeeper:
    def __init__(self, config, fabric=None):
        self.config, self.fabric = config, fabric
        self.rank, self.world_size = (fabric.global_rank, fabric.world_size) if fabric else (0, 1)
        self.checkpoints = Checkpoints(config, fabric, self.rank)
        self.stopping = Stopping(config, self.rank, self.world_size, self.checkpoints)
        self.precision_asked = fabric.strategy.precision.precision if fabric else "32-true"
        on_exit(self.checkpoints.release)
        together(fabric, lambda: self.checkpoints.claim() if self.rank == 0 else None, quiet=True)
        again = together(fabric, self.checkpoints.decide, quiet=True)
        self.resuming = config.resume or bool(again)  # a requeued SLURM job, a torchrun restart
        if again:
            self.print(f"{again}: continuing the run in {self.checkpoints.folder}.")
        sys.stdout.write(opening_line(fabric, self.rank, self.world_size) + "\n")  # one write: the
        sys.stdout.flush()  # processes of a machine share the terminal, and lines never mix
        self.precision = fall_back_from_bf16(fabric) if fabric else "32-true"
        if fabric and fabric.device.type == "cpu":
            share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", config.devices)))
        self.meter = StepMeter(config.accelerator == "cuda", config.micro_batches)
        self.vote, self.figures = StopVote(fabric), Figures()
        self.first_batch = 0  # where the loop counts its batches from: 0, or where a run stopped mid-epoch was

    def print(self, *a):  # on global rank 0 only: fabric.print prints once per machine
        if self.rank == 0:
            print(*a, flush=True)

    @property
    def start_epoch(self):
        return self.figures.epochs_done

    def resume(self, model, optimizer, train_loader, scheduler=None):
        """Says what the run is; with --resume (or a launcher's restart) restores the newest
        checkpoint, mid-epoch too. Returns the first epoch."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler or scheduler_of(optimizer)
        self.init = getattr(model, "init", "random init")  # local_utilities.build_vit notes it
        self.started, self.cpu_from = self.meter.start(len(train_loader)), cpu_from()
        c, group = self.config, optimizer.param_groups[0]
        self.settings = {**{k: getattr(c, k) for k in SETTINGS[:4]}, "world_size": self.world_size,
                         "tensor_parallel": c.tensor_parallel, "precision": self.precision_asked,
                         "lr": group.get("initial_lr", group["lr"])}  # what a --resume may not change
        for line in opening_notes(c, self.init, model):
            self.print(line)
        self.held_parameters = [int(n) for n in gather(self.fabric, count_local_parameters(model))]
        if self.world_size > 1:
            self.print(held_line(self.held_parameters, count_parameters(model)))
        if self.fabric and self.fabric.device.type == "cuda" and fsdp_units(model)[1]:
            share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", c.devices)))  # Adam steps on the CPU
        bound_waits(self.fabric)
        self.epoch_rng = rng_states()  # the random state each epoch's data order comes from
        if self.resuming:
            self._restore(train_loader)
        self.stopping.phase = "training"
        return self.start_epoch

    def _restore(self, train_loader):
        progress, rng = together(self.fabric, lambda: self.checkpoints.load(
            self.model, self.optimizer, self.settings, self.scheduler))
        partial = progress.get("partial") or {}
        continue_data_order(train_loader, progress, rng)
        self.epoch_rng = rng_states()
        if partial:  # stopped mid-epoch: the epoch's figures so far
            self.meter.restore(partial["meter"])
            self.first_batch = partial["batches"]
        self.figures.restore(progress)
        within = f" and {partial['batches']} of {len(train_loader)} batches of the next" if partial else ""
        self.print(f"Resuming {self.config.script} from {self.checkpoints.last}: "
                   f"{self.start_epoch} of {self.config.epochs} epochs done{within}.")

    def batch_done(self, loss, batch_size):
        """After each batch the loader hands out, without waiting for the GPU; a stop asked for by a
        signal is carried out after an optimizer step, at the same step in every process."""
        stepped = self.meter.step(loss, batch_size, self.optimizer.param_groups[0]["lr"], self.figures.epochs_done + 1)
        self.figures.count(stepped)
        code = self.vote.step(self.stopping.wanted) if stepped else 0
        if code:
            self.stopping.saved(code, self._save(partial={"batches": self.meter.epoch["batches"],
                                                          "meter": self.meter.partial(self.fabric),
                                                          "epoch_rng": self.epoch_rng}))

    def checkpoint(self, epoch, model, optimizer, val_acc, scheduler=None):
        """After an epoch's validation: keep its figures and save the checkpoint to resume from."""
        self.scheduler = scheduler or self.scheduler
        if self.first_batch:  # the loop's train accuracy counted only the batches since the resume
            self.print(resumed_epoch_line(self.first_batch, self.meter.steps_per_epoch))
            self.first_batch = 0
        mean_loss, lr = self.meter.end_epoch(self.figures.epochs_done + 1)
        if self.fabric:
            mean_loss = self.fabric.all_reduce(mean_loss, reduce_op="mean")
        self.figures.end_epoch(float(mean_loss), val_acc, lr)
        # a synthetic run measures: after its last epoch nothing is left to resume, only its record
        last_measured = self.config.synthetic and self.figures.epochs_done == self.config.epochs
        seconds = None if last_measured else self._save()
        if self.config.accelerator == "cpu" and seconds is not None:
            forget_cpu_peak()
        self.epoch_rng = rng_states()
        code = self.stopping.wanted
        if self.fabric and self.world_size > 1:
            code = int(self.fabric.all_reduce(torch.tensor(code, device=self.fabric.device), reduce_op="max"))
        if code:
            self.stopping.saved(code, seconds) if seconds is not None else self.stopping.stop_now(self.stopping.signal)

    def _save(self, partial=None):
        """A checkpoint of the progress so far; returns the seconds it took."""
        elapsed = self.figures.training_s(time.time() - self.started)
        progress = self.figures.progress(self.meter.totals(self.fabric, self.config.tensor_parallel,
                                                           self.figures.earlier, elapsed), partial)
        # memory is training's: a checkpoint write holds a serialised copy of the state for a
        # moment (Fabric's save, a second in memory), which the talk's scripts never wrote
        self.figures.peak_gb = max(self.figures.peak_gb, peak_memory_gb(self.config.accelerator))
        seconds = self.checkpoints.save(self.model, self.optimizer, progress, self.settings, self.scheduler)
        self.figures.checkpoint_s.append(round(seconds, 3))
        return seconds

    def finish(self, train_time_s, test_acc, model):
        """The talk's closing lines, the model file, the run record; then the checkpoints go and a
        multi-process run ends."""
        self.stopping.phase = "ending"
        totals = self.meter.totals(self.fabric, self.config.tensor_parallel, self.figures.earlier,
                                   self.figures.training_s(train_time_s))
        images_per_s = totals["timed_images"] / totals["timed_seconds"] if totals["timed_seconds"] else None
        memory = gather(self.fabric, max(self.figures.peak_gb, peak_memory_gb(self.config.accelerator)))
        state = plain_state_dict(model)  # every process takes part when the model is sharded
        waited = max(gather(self.fabric, waiting_share(self.cpu_from)))
        self.print(closing_lines(totals["train_time_s"], max(memory), images_per_s,
                                 None if self.config.synthetic else test_acc, waited))
        ran = {"cpu_wait_share": None if waited < 0 else round(waited, 4), "busy": waited > BUSY_WAIT,
               "precision": self.precision, "precision_asked": self.precision_asked, "init": self.init,
               "world_size": self.world_size, "parameters_per_process": self.held_parameters,
               **techniques(model, self.optimizer, self.fabric, self.scheduler)}
        self.stopping.phase = "finishing"  # a signal now waits until the model and the record are written
        together(self.fabric, lambda: self._keep(state, ran, totals, images_per_s, memory, test_acc)
                 if self.rank == 0 else None)
        self.stopping.finished()  # a signal noted while they were written stops the run now
        if self.world_size > 1:
            leave(0)  # the run is done: the last line of every script

    def _keep(self, state, ran, totals, images_per_s, memory, test_acc):
        c, buffer, kept = self.config, io.BytesIO(), what_is_kept(self.config, self.checkpoints.folder)
        torch.save(state, buffer)
        write_atomically(c.save_model, buffer.getvalue(), then=kept)
        record = build(c, self.fabric, ran, self.figures, totals, images_per_s, memory, test_acc,
                       model_sha256=sha256(buffer.getvalue()))
        append_record(c.results, record, then=f"The model is saved in {c.save_model}, and {kept}.")
        self.checkpoints.remove_all()
        self.print(last_lines(c, self.init))


class Figures:
    """The run's figures so far, kept in each checkpoint and restored by --resume."""

    def __init__(self):
        self.epochs_done, self.batches_loaded, self.optimizer_steps, self.resumed = 0, 0, 0, False
        self.train_loss, self.val_acc, self.lr, self.checkpoint_s = [], [], [], []
        self.earlier = {"train_time_s": 0.0, "timed_images": 0.0, "timed_seconds": 0.0}
        self.peak_gb = 0.0

    def count(self, stepped):
        self.batches_loaded += 1
        self.optimizer_steps += stepped

    def training_s(self, elapsed_s):
        """The talk's time out of `elapsed_s` of the loop: less the checkpoint writes, which the talk
        never made."""
        return elapsed_s - sum(self.checkpoint_s)

    def end_epoch(self, mean_loss, val_acc, lr):
        self.train_loss.append(mean_loss)
        self.val_acc.append(val_acc)
        self.lr.append(lr)
        self.epochs_done += 1

    def progress(self, totals, partial=None):
        return {"epochs_done": self.epochs_done, "batches_done": partial["batches"] if partial else 0,
                "batches_loaded": self.batches_loaded, "optimizer_steps": self.optimizer_steps,
                "train_loss": self.train_loss, "val_acc": self.val_acc, "lr": self.lr, **totals, "partial": partial}

    def restore(self, progress):
        self.epochs_done, self.resumed = progress["epochs_done"], True
        # a checkpoint written before these two were told apart: "steps", the batches loaded
        self.batches_loaded = progress.get("batches_loaded", progress.get("steps", 0))
        self.optimizer_steps = progress.get("optimizer_steps", self.batches_loaded)
        self.train_loss, self.val_acc, self.lr = progress["train_loss"], progress["val_acc"], progress["lr"]
        self.earlier = {k: progress[k] for k in self.earlier}


class Stopping:
    """Ctrl-C and SIGTERM, and the errors a user can act on. In training a signal is carried out after
    the next optimizer step, with a checkpoint (`saved`); while the finished run writes its model
    and record, once they are written; otherwise, or at a second signal, at once."""

    def __init__(self, config, rank, world_size, checkpoints):
        self.config, self.rank, self.world_size, self.checkpoints = config, rank, world_size, checkpoints
        self.phase = "starting"  # then training, ending (its last lines), finishing (model and record), finished
        self.wanted, self.signal = 0, None
        for sig in EXIT_CODES:
            signal.signal(sig, lambda signum, frame: self.on_signal(signum))
        sys.excepthook = self.on_uncaught

    def on_signal(self, signum):
        if self.phase in ("training", "finishing") and not self.wanted:
            self.wanted, self.signal = EXIT_CODES[signum], signum
            return
        self.stop_now(signum)

    def saved(self, code, seconds):
        name = signal.Signals(self.signal or code - 128).name
        self.stopped(f"interrupted ({name}); saved {self.checkpoints.last} in {seconds:.1f} s; "
                     f"continue with: {resume_command()}", code)

    def finished(self):
        self.phase = "finished"
        if self.wanted:
            self.stop_now(self.signal)

    def stop_now(self, signum):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        name, c = signal.Signals(signum).name, self.config
        if self.phase == "finished":  # whole and written; the interpreter may be shutting down: at once
            self.stopped(f"interrupted ({name}) after the run finished: its record is in "
                         f"{c.results} and its model in {c.save_model}.", EXIT_CODES[signum], at_once=True)
        last = self.checkpoints.last
        where = (f"last checkpoint: {last}; continue with: {resume_command()}" if last else
                 "no checkpoint yet (one is written after each epoch, and where the run is when it "
                 "is stopped in training)")
        self.stopped(f"interrupted ({name}); {where}", EXIT_CODES[signum])

    def stopped(self, message, code, at_once=False):
        """Process 0 says why the run stops; every process lets go and leaves with `code`."""
        if self.rank == 0:
            print(f"\n{self.config.script}: {message}", file=sys.stderr, flush=True)
        leave(code, at_once)

    def on_uncaught(self, kind, err, traceback):
        """The errors explain() knows: one line and its exit code; anything else: the usual traceback."""
        said = explain(kind, err, self.config, self.rank, self.world_size, self.checkpoints.last)
        if said is None:
            return sys.__excepthook__(kind, err, traceback)
        message, code = said
        print(f"{self.config.script}: error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        clean_up()
        os._exit(code)  # an excepthook cannot choose the exit code otherwise


def what_is_kept(config, folder):
    """What a finished run keeps where its model or record cannot be written, and how to go on."""
    if config.synthetic:
        return ("a synthetic run keeps no checkpoint of its last epoch: once there is room, run it again "
                f"with: {invoked(*started_flags())}")
    return (f"the checkpoint of the finished training is kept in {folder}: once there is room, finish the "
            f"run with: {resume_command()}")


def closing_lines(train_time_s, memory_gb, images_per_s, test_acc, waited=0.0):
    """The talk's closing lines, ours (throughput, accuracy) and one where the run had to share the
    CPU."""
    busy = [f"BUSY: this run waited for a CPU core {waited:.0%} of the time it was ready to run (another "
            "program was using the cores): its time and throughput are not comparable"]
    return "\n".join([f"Time elapsed {train_time_s / 60:.2f} min", f"Memory used: {memory_gb:.02f} GB",
                      f"Throughput {images_per_s:.1f} training images/s" if images_per_s else
                      f"Throughput not measured: no step was timed (a run's first {WARMUP_STEPS} "
                      "optimizer steps and each epoch's first are not)",
                      "Synthetic data: no accuracy" if test_acc is None else f"Test accuracy {test_acc * 100:.2f}%"]
                     + busy * (waited > BUSY_WAIT))


def resumed_epoch_line(first_batch, batches):
    return (f"(Train acc. above: batches {first_batch}-{batches - 1} of this epoch, since the --resume; "
            "the loss and validation cover the whole epoch)")


def last_lines(config, init):
    c = config
    return "\n".join([*([kind_line(c, init)] if c.kind else []),
                      *([f"CUT SHORT by --max-steps {c.max_steps}: recorded as such; plot_results.py and 08 "
                         "leave it out unless asked."] if not c.whole else []),
                      f"Run record appended to {c.results}; finetuned model saved to {c.save_model}"])


def opening_notes(config, init, model):
    """Said before training: what a smoke or synthetic run is, and that a CPU has no CUDA graphs (16)."""
    notes = [kind_line(config, init)] if config.kind else []
    if compile_mode(model) == "reduce-overhead" and config.accelerator != "cuda":
        notes.append(f"This {device_name(config.accelerator)} has no CUDA graphs: torch.compile(mode=\"reduce-"
                     "overhead\") compiles the model and runs it without them (on a GPU it records each step's "
                     "kernels once and replays them)")
    return notes


def kind_line(config, init):
    what = WHAT_RUNS[config.kind].format(init=init, vit=VITS[config.vit])
    return (f"{config.kind.upper().replace('-', '+')} RUN on {device_name(config.accelerator)}: {what}. "
            f"Not the talk's experiment; its figures are not the talk's.{config.batch_note}")


def explain(kind, err, config, rank, world_size, last_checkpoint):
    """(one line, exit code) for an error a user can act on, or None: torch.compile without its
    compiler (2) or failing otherwise (1), a GPU out of memory (1), a process of the run lost (3)."""
    reason, lost = first_sentence(err) or kind.__name__, lost_peer(world_size, err)
    if kind.__module__.startswith(("torch._dynamo", "torch._inductor")):
        inner = err
        while getattr(inner, "inner_exception", None) or inner.__cause__:  # Dynamo wraps the backend's
            inner = getattr(inner, "inner_exception", None) or inner.__cause__
        without = ("run without compiling: python 01_pytorch-vit.py is 02 without it, and 09 compiles "
                   "on a CPU only with --compile-on-cpu.")
        said = f"{type(inner).__name__}: {first_sentence(inner) or type(inner).__name__}"
        if NO_COMPILER.search(f"{type(inner).__name__} {inner} {err}"):
            return (f"torch.compile could not compile the model ({reason}). "
                    f"{COMPILERS.get(config.accelerator, COMPILERS['cpu'])}; or {without}"), 2
        return f"torch.compile failed ({said}); {without}", 1
    if issubclass(kind, torch.OutOfMemoryError):
        return (f"the GPU ran out of memory at --batch-size {config.batch_size} "
                f"({first_sentence(reason, 160)}): try a smaller --batch-size."), 1
    if lost:
        peer = re.search(r"\[([^\]]+)\]:(\d+)", str(err))
        which = f" (the one at {peer.group(1)}:{peer.group(2)})" if peer else ""
        where = (f"the last checkpoint is {last_checkpoint}; continue with {resume_command()} once "
                 "every machine is back" if last_checkpoint else "no checkpoint was written yet: start it again")
        return (f"a process of the run was lost{which}: a machine died, or a process was killed "
                f"({lost.group(0)}). Process {rank} of {world_size} stops too; {where}."), 3
    return None


class StepMeter:
    """Per batch, without waiting for the GPU: the epoch's loss sum, its first bad loss (read only at
    the print points and the epoch's end) and the timed steps. Timing starts after WARMUP_STEPS
    optimizer steps, so Adam's first step is never timed."""

    def __init__(self, cuda, micro_batches=1):
        self.cuda, self.micro_batches = cuda, micro_batches
        self.steps_per_epoch = None       # batches, set once the loader is known
        self.timed_images, self.timed_seconds = 0, 0.0
        self.session_steps = 0            # optimizer steps since this process started (after --resume too)
        self.began = self.warmup_s = None  # the loop's start; its untimed first steps' seconds (a first compile's too)
        self.epoch = None                 # the figures of the epoch under way

    def start(self, steps_per_epoch):
        self.steps_per_epoch, self.began = steps_per_epoch, time.perf_counter()
        return time.time()

    def step(self, loss, batch_size, lr, epoch_number):
        """Add the loss and note a bad one, on the device; time every step but the warm-up and each
        epoch's first. Returns whether this batch ended an optimizer step."""
        loss = loss.detach().float()
        if self.epoch is None:  # the epoch's first batch
            zero = torch.zeros((), device=loss.device)
            self.epoch = {"batches": 0, "loss": zero, "index": zero.clone(), "bad": zero - 1,
                          "bad_loss": zero.clone(), "timer": None, "timed": 0, "lr": lr}
        e = self.epoch
        first_bad = ~torch.isfinite(loss) & (e["bad"] < 0)
        e["bad"] = torch.where(first_bad, e["index"], e["bad"])
        e["bad_loss"] = torch.where(first_bad, loss, e["bad_loss"])
        e["loss"], e["index"] = e["loss"] + loss, e["index"] + 1
        e["batches"] += 1
        stepped = e["batches"] % self.micro_batches == 0
        self.session_steps += stepped
        if e["batches"] % PRINT_EVERY == 1:
            self.stop_on_bad_loss(epoch_number)
        if e["timer"] is not None:
            e["timed"] += batch_size
        if e["batches"] == self.steps_per_epoch and e["timer"] is not None:
            self.timed_images += e["timed"]
            self.timed_seconds += self.now() - e["timer"]
        elif e["timer"] is None and stepped and self.session_steps >= WARMUP_STEPS:
            e["timer"] = self.now()
            if self.warmup_s is None:
                self.warmup_s = e["timer"] - self.began
            if self.session_steps == WARMUP_STEPS and self.cuda:
                torch.cuda.reset_peak_memory_stats()  # the steady state's peak, not start-up's
        return stepped

    def totals(self, fabric, tensor_parallel, earlier, train_time_s):
        """Timed images of all processes (a tensor-parallel group's once), the slowest process's
        seconds and the training time, each with the part before a --resume (`earlier`)."""
        images, seconds = torch.tensor(float(self.timed_images)), torch.tensor(self.timed_seconds)
        if fabric and fabric.world_size > 1:
            images = fabric.all_reduce(images, reduce_op="sum") / tensor_parallel
            seconds = fabric.all_reduce(seconds, reduce_op="max")
        return {"timed_images": float(images) + earlier["timed_images"], "warmup_s": self.warmup_s,
                "timed_seconds": float(seconds) + earlier["timed_seconds"],
                "train_time_s": earlier["train_time_s"] + train_time_s}

    def partial(self, fabric=None):
        """The epoch so far, for a mid-epoch checkpoint: of several processes, the mean of their loss
        sums (the epoch's mean loss is linear in them)."""
        e = self.epoch
        if fabric and fabric.world_size > 1:
            return {**self.partial(), "loss": float(fabric.all_reduce(e["loss"].float().cpu(), reduce_op="mean"))}
        return {"batches": e["batches"], "lr": e["lr"],
                **{k: float(e[k]) for k in ("loss", "index", "bad", "bad_loss")}}

    def restore(self, partial):
        device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.epoch = {**{k: torch.tensor(partial[k], device=device) for k in ("loss", "index", "bad", "bad_loss")},
                      "batches": partial.get("batches", partial.get("steps")), "lr": partial["lr"],
                      "timer": None, "timed": 0}

    def end_epoch(self, epoch_number):
        """The epoch's mean loss (on the CPU) and its learning rate; stops on a bad loss."""
        self.stop_on_bad_loss(epoch_number)
        e, self.epoch = self.epoch, None
        return (e["loss"] / e["batches"]).cpu(), e["lr"]

    def now(self):
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def stop_on_bad_loss(self, epoch_number):
        bad = int(self.epoch["bad"]) if self.epoch else -1
        if bad >= 0:
            fail(f"the loss is {float(self.epoch['bad_loss'])} at epoch {epoch_number}, batch "
                 f"{bad}: stopping; no checkpoint or record written for it.", code=1)


def scheduler_of(optimizer):
    """The learning-rate scheduler made on `optimizer`, or None, found among the optimizer's referrers
    (a scheduler keeps its optimizer, not the reverse), so that 07's lesson needs no line to hand it
    over. Of a SequentialLR or ChainedScheduler, the outer one."""
    import gc
    from torch.optim.lr_scheduler import LRScheduler
    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper, or the optimizer itself
    found = []
    for referrer in gc.get_referrers(optimizer, inner):
        owners = gc.get_referrers(referrer) if isinstance(referrer, dict) else [referrer]  # an instance's __dict__
        found += [o for o in owners if isinstance(o, LRScheduler) and o.optimizer in (optimizer, inner)]
    nested = {id(s) for outer in found for s in getattr(outer, "_schedulers", [])}
    outer = [s for s in found if id(s) not in nested]
    return outer[0] if outer else None
