"""RunKeeper: what a numbered script calls to keep its run, out of the lesson's way."""
import io
import os
import signal
import sys
import time

import torch

from run_keeping import signals
from run_keeping.checkpoints import SETTINGS, Checkpoints, continue_mid_epoch, resume_command, rng_states, set_rng_states
from run_keeping.devices import fall_back_from_bf16, fsdp_units, share_cpu_threads
from run_keeping.errors import leave, on_exit
from run_keeping.files import append_record, sha256, write_atomically
from run_keeping.launch import opening_line
from run_keeping.model_file import count_local_parameters, count_parameters, held_line, plain_state_dict
from run_keeping.record import forget_cpu_peak, kind_line, make_record, peak_memory_gb, techniques
from run_keeping.timing import WARMUP_STEPS, StepMeter
from run_keeping.together import StopVote, bound_waits, gather, together

class RunKeeper:
    def __init__(self, args, fabric=None):
        self.args, self.fabric = args, fabric
        self.rank = fabric.global_rank if fabric else 0
        self.world_size = fabric.world_size if fabric else 1
        self.checkpoints = Checkpoints(args, fabric, self.rank)
        self.precision_asked = fabric.strategy.precision.precision if fabric else "32-true"
        self.training = self.finishing = self.finished = False  # finishing: writing model and record
        self.stop_wanted, self.stop_signal = 0, None
        signals.install(self)
        on_exit(self.checkpoints.release)
        together(fabric, lambda: self.checkpoints.claim() if self.rank == 0 else None, quiet=True)
        again = together(fabric, self.checkpoints.decide, quiet=True)
        if again:  # a requeued SLURM job, a torchrun restart: the run continues by itself
            args.resume = True
            self.print(f"{again}: continuing the run in {self.checkpoints.folder}.")
        sys.stdout.write(opening_line(fabric, self.rank, self.world_size) + "\n")  # one write: the
        sys.stdout.flush()  # processes of a machine share the terminal, and lines never mix
        if fabric and fabric.device.type == "cuda":
            fall_back_from_bf16(fabric)
        elif fabric:
            share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", args.devices)))
        self.meter, self.vote = StepMeter(cuda=args.accelerator == "cuda"), StopVote(fabric)
        self.start_epoch, self.resumed, self.steps = 0, False, 0
        self.train_loss, self.val_acc, self.lr = [], [], []
        self.earlier = {"train_time_s": 0.0, "timed_images": 0.0, "timed_seconds": 0.0}
        self.peak_gb, self.checkpoint_s = 0.0, []  # the largest peak before a checkpoint write

    def print(self, *a):
        """print on global rank 0 only: fabric.print prints once per machine."""
        if self.rank == 0:
            print(*a, flush=True)

    def kind_line(self):
        return kind_line(self.args)

    def resume(self, model, optimizer, train_loader, scheduler=None):
        """Says what the run is; with --resume (or when its launcher started it again) restores
        model, optimizer, scheduler, random states and the figures so far from the newest
        checkpoint, mid-epoch too. Returns the first epoch."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.meter.steps_per_epoch, self._started = len(train_loader), time.time()
        group = optimizer.param_groups[0]
        self.settings = {**{k: getattr(self.args, k) for k in SETTINGS[:4]},
                         "world_size": self.world_size, "tensor_parallel": self.args.tensor_parallel,
                         "precision": self.precision_asked, "lr": group.get("initial_lr", group["lr"])}
        if self.args.kind:
            self.print(self.kind_line())
        self.held_parameters = [int(n) for n in gather(self.fabric, count_local_parameters(model))]
        if self.world_size > 1:
            self.print(held_line(self.held_parameters, count_parameters(model)))
        if self.fabric and self.fabric.device.type == "cuda" and fsdp_units(model)[1]:
            share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", self.args.devices)))  # Adam steps on the CPU
        bound_waits(self.fabric)
        self.epoch_rng = rng_states()  # the random state each epoch's data order comes from
        if self.args.resume:
            restore(self, train_loader)
        self.training = True
        return self.start_epoch

    def step(self, loss, batch_size):
        """After each optimizer step, without waiting for the GPU (timing.StepMeter); a stop
        asked for by a signal is carried out after an optimizer step, at the same step in every
        process (together.StopVote)."""
        self.steps += 1
        self.meter.step(loss, batch_size, self.optimizer.param_groups[0]["lr"], len(self.train_loss) + 1)
        if self.meter.epoch["steps"] % self.args.micro_batches == 0:
            code = self.vote.step(self.stop_wanted)
            if code:
                meter = self.meter.partial()
                if self.fabric and self.world_size > 1:  # one checkpoint for all: the mean of their
                    # sums, which gives the epoch's mean loss as theirs do (it is linear in them)
                    meter["loss"] = float(self.fabric.all_reduce(torch.tensor(meter["loss"]), reduce_op="mean"))
                self._stop(code, self._save(partial={"batches": self.meter.epoch["steps"], "meter": meter,
                                                     "epoch_rng": self.epoch_rng}))

    def checkpoint(self, epoch, model, optimizer, val_acc, scheduler=None):
        """After an epoch's validation: keep its figures and save the checkpoint to resume from."""
        self.scheduler = scheduler or self.scheduler
        mean_loss, lr = self.meter.end_epoch(len(self.train_loss) + 1)
        if self.fabric:
            mean_loss = self.fabric.all_reduce(mean_loss, reduce_op="mean")
        self.train_loss.append(float(mean_loss))
        self.val_acc.append(val_acc)
        self.lr.append(lr)
        seconds = self._save()
        if self.args.accelerator == "cpu":
            forget_cpu_peak()
        self.epoch_rng = rng_states()
        code = self.stop_wanted
        if self.fabric and self.world_size > 1:
            code = int(self.fabric.all_reduce(torch.tensor(code, device=self.fabric.device), reduce_op="max"))
        if code:
            self._stop(code, seconds)

    def _save(self, partial=None):
        """A checkpoint of the progress so far; returns the seconds it took."""
        progress = {"epochs_done": len(self.train_loss), "batches_done": partial["batches"] if partial else 0,
                    "steps": self.steps, "train_loss": self.train_loss, "val_acc": self.val_acc,
                    "lr": self.lr, **self._totals(time.time() - self._started), "partial": partial}
        # memory is training's: a checkpoint write holds a serialised copy of the state for a
        # moment (Fabric's save, a second in memory), which the talk's scripts never wrote
        self.peak_gb = max(self.peak_gb, peak_memory_gb(self.args.accelerator))
        seconds = self.checkpoints.save(self.model, self.optimizer, progress, self.settings, self.scheduler,
                                        lambda action: together(self.fabric, action),
                                        lambda err: signals.lost_peer(self, err))
        self.checkpoint_s.append(round(seconds, 3))
        return seconds

    def _stop(self, code, seconds):
        """Stopped by a signal: say where the run is kept and how to continue it, and leave."""
        name = signal.Signals(self.stop_signal or code - 128).name
        signals.stopped(self, f"interrupted ({name}); saved {self.checkpoints.last} in "
                              f"{seconds:.1f} s; continue with: {resume_command()}", code)

    def _totals(self, train_time_s):
        """Timed training images of all processes (each image once: a tensor-parallel group
        shares its batch), the slowest process's seconds, and the training time, each including
        the part before a --resume."""
        images = torch.tensor(float(self.meter.timed_images))
        seconds = torch.tensor(self.meter.timed_seconds)
        if self.fabric and self.world_size > 1:
            images = self.fabric.all_reduce(images, reduce_op="sum") / self.args.tensor_parallel
            seconds = self.fabric.all_reduce(seconds, reduce_op="max")
        return {"timed_images": float(images) + self.earlier["timed_images"],
                "timed_seconds": float(seconds) + self.earlier["timed_seconds"],
                "train_time_s": self.earlier["train_time_s"] + train_time_s}

    def finish(self, train_time_s, test_acc, model):
        """The talk's closing lines, the finetuned model file, the run record; then the
        checkpoints are removed (nothing left to resume), and a multi-process run ends (leave)."""
        self.training = False
        totals = self._totals(train_time_s)
        images_per_s = totals["timed_images"] / totals["timed_seconds"] if totals["timed_seconds"] else None
        memory = gather(self.fabric, max(self.peak_gb, peak_memory_gb(self.args.accelerator)))  # each process's
        self.techniques = {**techniques(model, self.optimizer, self.fabric), "lr_end": self.optimizer.param_groups[0]["lr"]}
        state = plain_state_dict(model)  # every process takes part when the model is sharded
        self.print(f"Time elapsed {totals['train_time_s'] / 60:.2f} min")
        self.print(f"Memory used: {max(memory):.02f} GB")
        self.print(f"Throughput {images_per_s:.1f} training images/s" if images_per_s else
                   f"Throughput not measured: no step was timed (a run's first {WARMUP_STEPS} "
                   "steps and each epoch's first are not)")
        self.print("Synthetic data: no accuracy" if self.args.synthetic else
                   f"Test accuracy {test_acc * 100:.2f}%")
        self.finishing = True  # a signal now waits until the model and the record are written
        together(self.fabric, lambda: keep(self, state, totals, images_per_s, memory, test_acc) if self.rank == 0 else None)
        signals.written(self)  # a signal noted while they were written stops the run now
        if self.world_size > 1:
            leave(0)  # the run is done: the last line of every script


def restore(keeper, train_loader):
    """--resume: the newest checkpoint into the run, mid-epoch too (its data order again, less
    the batches done)."""
    state = {}
    together(keeper.fabric, lambda: state.update(zip(("progress", "rng"), keeper.checkpoints.load(
        keeper.model, keeper.optimizer, keeper.settings, keeper.scheduler))))
    progress, partial = state["progress"], state["progress"].get("partial") or {}
    if hasattr(getattr(train_loader, "sampler", None), "set_epoch"):
        # Fabric's loader sets the distributed sampler's epoch from the number of times it
        # was iterated: start it once per finished epoch (the random states follow below).
        for _ in range(progress["epochs_done"]):
            next(iter(train_loader), None)
    set_rng_states(partial.get("epoch_rng") or state["rng"])
    keeper.epoch_rng = rng_states()
    if partial:  # stopped mid-epoch: its data order again, less the batches done
        continue_mid_epoch(train_loader, partial["batches"], state["rng"])
        keeper.meter.restore(partial["meter"])
    keeper.start_epoch, keeper.steps = progress["epochs_done"], progress["steps"]
    keeper.train_loss, keeper.val_acc, keeper.lr = progress["train_loss"], progress["val_acc"], progress["lr"]
    keeper.earlier = {k: progress[k] for k in keeper.earlier}
    keeper.resumed = True
    within = f" and {partial['batches']} of {len(train_loader)} batches of the next" if partial else ""
    keeper.print(f"Resuming {keeper.args.script} from {keeper.checkpoints.last}: "
                 f"{keeper.start_epoch} of {keeper.args.epochs} epochs done{within}.")


def keep(keeper, state, totals, images_per_s, memory, test_acc):
    """Process 0: the model file and the run record, then the checkpoints go."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    kept = (f"the checkpoint of the finished training is kept in {keeper.checkpoints.folder}: once "
            f"there is room, finish the run with: {resume_command()}")
    write_atomically(keeper.args.save_model, buffer.getvalue(), then=kept)
    keeper.techniques["model_sha256"] = sha256(buffer.getvalue())
    append_record(keeper.args.results, make_record(keeper.args, keeper.fabric, keeper, totals,
                                                   images_per_s, memory, test_acc),
                  then=f"The model is saved in {keeper.args.save_model}, and {kept}.")
    keeper.checkpoints.remove_all()
    if keeper.args.kind:
        keeper.print(keeper.kind_line())
    if not keeper.args.whole:
        keeper.print(f"CUT SHORT by --max-steps {keeper.args.max_steps}: recorded as such; "
                     "plot_results.py and 08 leave it out unless asked.")
    keeper.print(f"Run record appended to {keeper.args.results}; finetuned model saved to "
                 f"{keeper.args.save_model}")
