"""Per-epoch checkpoints and --resume: a checkpoint keeps the model, optimizer, scheduler,
random states, the figures so far and the settings that shape its run; --resume restores them
after checking that the checkpoint is this run's (script, kind of run, settings)."""
import io
import json
import os
import random
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from run_keeping.errors import fail, why_unloadable
from run_keeping.files import remove, remove_empty_folders, write_atomically, write_error
from run_keeping.model_file import load_state_dict, plain_state_dict

LATEST = "latest.json"  # names a checkpoint folder's newest finished epoch
# The settings that shape a run: a checkpoint keeps them, and --resume refuses to change them.
SETTINGS = ("batch_size", "seed", "epochs", "max_steps", "world_size", "tensor_parallel",
            "precision", "lr")


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


class Checkpoints:
    def __init__(self, args, fabric, barrier):
        self.args, self.fabric, self.barrier = args, fabric, barrier
        self.rank = fabric.global_rank if fabric else 0
        self.folder = Path(args.checkpoint_dir)
        self.last = None  # the newest checkpoint written or resumed from
        latest = self.folder / LATEST
        if latest.exists() and not args.resume:
            try:
                flags = json.loads(latest.read_text())["flags"]
            except (OSError, ValueError, KeyError, TypeError):
                flags = None
            fail(f"{self.folder} holds the checkpoint of an unfinished run: continue it with "
                 f"{resume_command(flags)}, or choose another --checkpoint-dir (or delete that "
                 "one) to start over.")
        if args.resume and not latest.exists():
            stem = Path(args.script).stem
            others = sorted(p.parent.name for p in self.folder.parent.glob(f"{stem}*/{LATEST}"))
            hint = "".join(f" {name} holds one: continue it with python {args.script}"
                           f"{kind_flags(name[len(stem) + 1:])} --resume." for name in others)
            fail(f"--resume: nothing to resume in {self.folder} (no {LATEST}).{hint} On "
                 "several machines --checkpoint-dir must be a folder every machine sees.")

    def load(self, model, optimizer, settings, scheduler=None):
        """The newest checkpoint into model, optimizer and scheduler; returns its progress
        (epochs done, steps, figures so far) and its random states (for set_rng_states)."""
        latest_file = self.folder / LATEST
        try:
            latest = json.loads(latest_file.read_text())
            path, script, kind = self.folder / latest["checkpoint"], latest["script"], latest["kind"]
            saved, flags = latest["settings"], latest["flags"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            fail(f"--resume: {latest_file} is unreadable or corrupt ({type(err).__name__}: {err}).")
        if (script, kind) != (self.args.script, self.args.kind):
            fail(f"--resume: the checkpoint in {self.folder} is from {script} ({kind or 'full'} "
                 f"run); this is {self.args.script} ({self.args.kind or 'full'} run). Each script "
                 "and kind of run continues only its own.")
        differences = [f"{k} {saved.get(k)} (now {settings[k]})" for k in SETTINGS
                       if saved.get(k) != settings[k]]
        if differences:
            fail(f"--resume: the checkpoint in {self.folder} was made with "
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
        self.last = path
        return state["progress"], state["rng"]

    def save(self, epoch, model, optimizer, progress, settings, scheduler=None, lost_peer=None):
        """The epoch's checkpoint, written beside the last one and renamed into place, then
        named in latest.json; older ones removed. A failed write: one line, exit 1."""
        name = f"epoch-{epoch + 1:04d}.ckpt"
        final, tmp = self.folder / name, self.folder / (name + ".tmp")
        meta = {"script": self.args.script, "kind": self.args.kind, "settings": settings,
                "flags": [a for a in sys.argv[1:] if a != "--resume"]}
        extra = {"scheduler": scheduler} if scheduler else {}
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            remove(tmp)
        self.barrier()
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
            if lost_peer and lost_peer(err):
                raise  # not the disk: a process of the run is gone (signals.py says so)
            remove(tmp)
            fail(f"cannot write the checkpoint {tmp}: {write_error(err, tmp)}. The last good "
                 f"checkpoint ({self.last or 'none yet'}) is untouched.", code=1)
        self.barrier()
        if self.rank == 0:
            os.replace(tmp, final)
            write_atomically(self.folder / LATEST,
                             json.dumps({"checkpoint": name, **meta, **progress}).encode())
            for old in self.folder.glob("epoch-*.ckpt"):
                if old.name != name:
                    remove(old)
        self.last = final  # before the barrier: a process lost there can name it
        self.barrier()

    def remove_all(self):
        """A finished run: nothing left to resume, and no empty folder left behind."""
        remove(self.folder / LATEST)
        for old in self.folder.glob("epoch-*.ckpt"):
            remove(old)
        # the default folder's parent (checkpoints/) goes too when this run leaves it empty
        default = self.args.checkpoint_dir_is_default
        remove_empty_folders(self.folder, up_to=self.folder.parent.parent if default else self.folder.parent)


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
