"""RunKeeper: what a numbered script calls to keep its run, out of the lesson's way."""
import io
import os
import time

import torch

from run_keeping import signals
from run_keeping.checkpoints import SETTINGS, Checkpoints, set_rng_states
from run_keeping.errors import leave
from run_keeping.files import append_record, write_atomically
from run_keeping.model_file import count_local_parameters, count_parameters, plain_state_dict
from run_keeping.devices import fall_back_from_bf16, share_cpu_threads
from run_keeping.flags import VITS
from run_keeping.record import device_name, forget_cpu_peak, make_record, peak_memory_gb, techniques
from run_keeping.timing import WARMUP_STEPS, StepMeter

WHAT_RUNS = {"smoke": "a 3-layer ViT ({init}) trained on scikit-learn's 8x8 handwritten digits",
         "synthetic": "{vit} from random init on random images and labels",
         "smoke-synthetic": "the 3-layer smoke ViT from random init on random 32x32 images and labels"}


class RunKeeper:
    def __init__(self, args, fabric=None):
        self.args, self.fabric = args, fabric
        self.rank = fabric.global_rank if fabric else 0
        self.world_size = fabric.world_size if fabric else 1
        self.checkpoints = Checkpoints(args, fabric, self._barrier)
        self.precision_asked = fabric.strategy.precision.precision if fabric else "32-true"
        if fabric and fabric.device.type == "cuda":
            fall_back_from_bf16(fabric)
        elif fabric:
            share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", args.devices)))
        signals.install(self)
        self.meter = StepMeter(cuda=args.accelerator == "cuda")
        self.start_epoch, self.resumed, self.steps = 0, False, 0
        self.train_loss, self.val_acc, self.lr = [], [], []
        self.earlier = {"train_time_s": 0.0, "timed_images": 0.0, "timed_seconds": 0.0}
        self.peak_gb = 0.0  # the largest peak before a checkpoint write (checkpoint())
        self.settings = None  # known once the optimizer is: resume()

    def print(self, *a):
        """print on global rank 0 only: fabric.print prints once per machine."""
        if self.rank == 0:
            print(*a, flush=True)

    def kind_line(self):
        """What a smoke or synthetic run is, said before its training and again at its end."""
        what = WHAT_RUNS[self.args.kind].format(init=getattr(self.args, "init", "random init"),
                                                vit=VITS[self.args.vit])
        return (f"{self.args.kind.upper().replace('-', '+')} RUN on "
                f"{device_name(self.args.accelerator)}: {what}. Not the talk's experiment; its "
                f"figures are not the talk's.{getattr(self.args, 'batch_note', '')}")

    def resume(self, model, optimizer, train_loader, scheduler=None):
        """Says what the run is; with --resume restores model, optimizer, scheduler, random
        states and the figures so far from the newest checkpoint. Returns the first epoch."""
        self.optimizer, self.meter.steps_per_epoch = optimizer, len(train_loader)
        self.scheduler = scheduler  # saved with each checkpoint, as it is resumed here
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
        progress, rng = self.checkpoints.load(model, optimizer, self.settings, scheduler)
        if hasattr(getattr(train_loader, "sampler", None), "set_epoch"):
            # Fabric's loader sets the distributed sampler's epoch from the number of times it
            # was iterated: start it once per finished epoch (the random states follow below).
            for _ in range(progress["epochs_done"]):
                next(iter(train_loader), None)
        set_rng_states(rng)
        self.start_epoch, self.steps = progress["epochs_done"], progress["steps"]
        self.train_loss, self.val_acc, self.lr = progress["train_loss"], progress["val_acc"], progress["lr"]
        self.earlier = {k: progress[k] for k in self.earlier}
        self.resumed = True
        self.print(f"Resuming {self.args.script} from {self.checkpoints.last}: "
                   f"{self.start_epoch} of {self.args.epochs} epochs done.")
        return self.start_epoch

    def step(self, loss, batch_size):
        """After each optimizer step, without waiting for the GPU (timing.StepMeter)."""
        self.steps += 1
        self.meter.step(loss, batch_size, self.optimizer.param_groups[0]["lr"], len(self.train_loss) + 1)

    def checkpoint(self, epoch, model, optimizer, val_acc, scheduler=None):
        """After an epoch's validation: keep its figures and save the checkpoint to resume from."""
        mean_loss, lr = self.meter.end_epoch(len(self.train_loss) + 1)
        if self.fabric:
            mean_loss = self.fabric.all_reduce(mean_loss, reduce_op="mean")
        self.train_loss.append(float(mean_loss))
        self.val_acc.append(val_acc)
        self.lr.append(lr)
        progress = {"epochs_done": epoch + 1, "steps": self.steps, "train_loss": self.train_loss,
                    "val_acc": self.val_acc, "lr": self.lr,
                    **self._totals(time.time() - self._started)}
        # memory is training's: a checkpoint write holds a serialised copy of the state for a
        # moment (Fabric's save, a second in memory), which the talk's scripts never wrote
        self.peak_gb = max(self.peak_gb, peak_memory_gb(self.args.accelerator))
        self.checkpoints.save(epoch, model, optimizer, progress, self.settings, scheduler or self.scheduler,
                              lost_peer=lambda err: signals.lost_peer(self, err))
        if self.args.accelerator == "cpu":
            forget_cpu_peak()

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
        totals = self._totals(train_time_s)
        images_per_s = totals["timed_images"] / totals["timed_seconds"] if totals["timed_seconds"] else None
        memory = [max(self.peak_gb, peak_memory_gb(self.args.accelerator))]  # each process's
        if self.fabric and self.world_size > 1:
            memory = self.fabric.all_gather(torch.tensor([memory[0]])).flatten().tolist()
        self.techniques = techniques(model, self.optimizer, self.fabric)
        state = plain_state_dict(model)  # every process takes part when the model is sharded
        self.print(f"Time elapsed {totals['train_time_s'] / 60:.2f} min")
        self.print(f"Memory used: {max(memory):.02f} GB")
        self.print(f"Throughput {images_per_s:.1f} training images/s" if images_per_s else
                   f"Throughput not measured: no step was timed (a run's first {WARMUP_STEPS} "
                   "steps and each epoch's first are not)")
        self.print("Synthetic data: no accuracy" if self.args.synthetic else
                   f"Test accuracy {test_acc * 100:.2f}%")
        if self.rank == 0:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            write_atomically(self.args.save_model, buffer.getvalue())
            append_record(self.args.results, make_record(self.args, self.fabric, self, totals,
                                                         images_per_s, memory, test_acc))
            self.checkpoints.remove_all()
            if self.args.kind:
                self.print(self.kind_line())
            self.print(f"Run record appended to {self.args.results}; finetuned model saved to "
                       f"{self.args.save_model}")
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
