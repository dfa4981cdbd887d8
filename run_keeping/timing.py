"""Per optimizer step, without waiting for the GPU: the epoch's loss sum, the first NaN or
infinite loss (read only at the print points and the epoch's end), and the timed steps."""
import time

import torch

from run_keeping.errors import fail

WARMUP_STEPS = 3   # the run's first training steps are not timed (start-up, compilation)
PRINT_EVERY = 300  # the scripts print the loss every 300 batches; the loss guard reads then


class StepMeter:
    def __init__(self, cuda):
        self.cuda = cuda
        self.steps_per_epoch = None       # set once the loader is known
        self.timed_images, self.timed_seconds = 0, 0.0
        self.session_steps = 0            # steps since this process started (after --resume too)
        self.epoch = None                 # the figures of the epoch under way

    def step(self, loss, batch_size, lr, epoch_number):
        """Add the loss to the epoch's sum and note a bad one, on the device; time every step
        but the run's first WARMUP_STEPS and each epoch's first."""
        loss = loss.detach().float()
        if self.epoch is None:  # the epoch's first step
            zero = torch.zeros((), device=loss.device)
            self.epoch = {"steps": 0, "loss": zero, "index": zero.clone(), "bad": zero - 1,
                          "bad_loss": zero.clone(), "timer": None, "timed": 0, "lr": lr}
        e = self.epoch
        first_bad = ~torch.isfinite(loss) & (e["bad"] < 0)
        e["bad"] = torch.where(first_bad, e["index"], e["bad"])
        e["bad_loss"] = torch.where(first_bad, loss, e["bad_loss"])
        e["loss"], e["index"] = e["loss"] + loss, e["index"] + 1
        e["steps"] += 1
        self.session_steps += 1
        if e["steps"] % PRINT_EVERY == 1:
            self.stop_on_bad_loss(epoch_number)
        if e["timer"] is not None:
            e["timed"] += batch_size
        if e["steps"] == self.steps_per_epoch and e["timer"] is not None:
            self.timed_images += e["timed"]
            self.timed_seconds += self.now() - e["timer"]
        elif e["timer"] is None and self.session_steps >= WARMUP_STEPS:
            e["timer"] = self.now()
            if self.session_steps == WARMUP_STEPS and self.cuda:
                torch.cuda.reset_peak_memory_stats()  # the steady state's peak, not start-up's

    def partial(self):
        """The epoch so far, for a checkpoint written mid-epoch (read back from the device)."""
        e = self.epoch
        return {"steps": e["steps"], "lr": e["lr"],
                **{k: float(e[k]) for k in ("loss", "index", "bad", "bad_loss")}}

    def restore(self, partial):
        """The epoch so far as a checkpoint written mid-epoch kept it; its timing starts again."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.epoch = {**{k: torch.tensor(partial[k], device=device) for k in ("loss", "index", "bad", "bad_loss")},
                      "steps": partial["steps"], "lr": partial["lr"], "timer": None, "timed": 0}

    def end_epoch(self, epoch_number):
        """The epoch's mean loss (a tensor on the CPU) and its learning rate; stops on a bad loss."""
        self.stop_on_bad_loss(epoch_number)
        e, self.epoch = self.epoch, None
        return (e["loss"] / e["steps"]).cpu(), e["lr"]

    def now(self):
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def stop_on_bad_loss(self, epoch_number):
        bad = int(self.epoch["bad"]) if self.epoch else -1
        if bad >= 0:
            fail(f"the loss is {float(self.epoch['bad_loss'])} at epoch {epoch_number}, batch "
                 f"{bad}: stopping; no checkpoint or record written for it.", code=1)
