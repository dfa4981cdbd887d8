"""Checkpoints and --resume; the finetuned model file. A checkpoint keeps the model, optimizer,
scheduler, random states, the figures so far and the settings that shape the run; one is written
after each epoch, and one mid-epoch when the run is asked to stop, so a continued run goes on from
that batch. A running run holds its folder: a second run there is refused.
"""
import io
import json
import logging
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from run_keeping import fail, why_unloadable
from run_keeping.config import invoked, kind_flags, resume_command, start_over_command, started_flags
from run_keeping.files import FolderLock, remove, remove_empty_folders, write_atomically, write_error
from run_keeping.processes import lost_peer, together

LATEST = "latest.json"  # names a checkpoint folder's newest checkpoint
# The settings that shape a run: a checkpoint keeps them, and --resume refuses to change them.
SETTINGS = ("batch_size", "seed", "epochs", "max_steps", "world_size", "tensor_parallel",
            "precision", "lr")


def resume_hint(folder):
    """The command that continues the run in another folder: its own flags, or those of its kind."""
    try:
        latest = json.loads((folder / LATEST).read_text())
    except (OSError, ValueError):
        latest = {}
    kind = latest.get("kind") or "-".join(k for k in ("smoke", "synthetic") if f"-{k}" in folder.name)
    return resume_command(latest.get("flags") or kind_flags(kind).split())


def checkpoint_name(progress):
    done = progress["batches_done"]
    epoch = progress["epochs_done"] + (1 if done else 0)
    return f"epoch-{epoch:04d}" + (f"-batch-{done:05d}" if done else "") + ".ckpt"


def launched_by():
    """What started this process: a requeued SLURM job or a torchrun restart has the same."""
    env = os.environ
    return {"slurm_job_id": env.get("SLURM_JOB_ID"), "torchelastic_run_id": env.get("TORCHELASTIC_RUN_ID")}


def restarted(latest):
    """Why this process is the run that wrote `latest`, started again by its launcher (SLURM's requeue,
    torchrun's restart), or None: a user at a terminal is not let into an unfinished run without
    --resume."""
    env, launch = os.environ, latest.get("launch") or {}
    if int(env.get("SLURM_RESTART_COUNT", "0")) > 0 and env.get("SLURM_JOB_ID") == launch.get("slurm_job_id"):
        return f"SLURM requeued job {env['SLURM_JOB_ID']} (restart {env['SLURM_RESTART_COUNT']})"
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and \
            env.get("TORCHELASTIC_RUN_ID") == launch.get("torchelastic_run_id"):
        return f"torchrun restarted its workers (restart {env['TORCHELASTIC_RESTART_COUNT']})"
    return None


class Checkpoints:

    def __init__(self, config, fabric, rank):
        self.config, self.fabric, self.rank = config, fabric, rank
        self.world_size = fabric.world_size if fabric else 1
        self.folder = Path(config.checkpoint_dir)
        self.last = None  # the newest checkpoint written or resumed from
        self.held = None  # the lock file, held by process 0

    def read_latest(self):
        try:
            return json.loads((self.folder / LATEST).read_text())
        except (OSError, ValueError):
            return None

    def claim(self):
        self.held = FolderLock(self.folder)

    def release(self):
        """Let go of the folder, and remove it if nothing of the run is left in it."""
        if self.held:
            self.held.release()
            self.held = None
            default = self.config.checkpoint_dir_is_default
            remove_empty_folders(self.folder, up_to=self.folder.parent.parent if default else self.folder.parent)

    def start_over(self):
        default = self.config.checkpoint_dir_is_default
        return start_over_command(self.folder, self.folder.parent if default else None)

    def decide(self):
        """Whether this run continues the one in the folder (--resume, or a launcher's restart);
        refuses a fresh run over an unfinished one, and --resume with nothing to resume."""
        latest = self.read_latest()
        exists = (self.folder / LATEST).exists()
        again = restarted(latest) if latest else None
        if exists and not self.config.resume and not again:
            flags = (latest or {}).get("flags")
            fail(f"{self.folder} holds the checkpoint of an unfinished run: continue it with: "
                 f"{resume_command(flags)}; or start over with: {self.start_over()}")
        if self.config.resume and not exists:
            stem = Path(self.config.script).stem
            others = sorted(p.parent.name for p in self.folder.parent.glob(f"{stem}*/{LATEST}"))
            hint = "".join(f" {name} holds one: continue it with "
                           f"{resume_hint(self.folder.parent / name)}." for name in others)
            fail(f"--resume: nothing to resume in {self.folder} (no {LATEST}).{hint} On "
                 "several machines --checkpoint-dir must be a folder every machine sees.")
        return again

    def load(self, model, optimizer, settings, scheduler=None):
        """The newest checkpoint into model, optimizer and scheduler; returns its progress and random
        states."""
        latest_file = self.folder / LATEST
        try:
            latest = json.loads(latest_file.read_text())
            path, script, kind = self.folder / latest["checkpoint"], latest["script"], latest["kind"]
            saved, flags = latest["settings"], latest["flags"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            fail(f"--resume: {latest_file} is unreadable or corrupt ({type(err).__name__}: {err}); "
                 f"start over with: {self.start_over()}")
        if (script, kind) != (self.config.script, self.config.kind):
            fail(f"--resume: the checkpoint in {self.folder} is from {script} ({kind or 'full'} "
                 f"run); this is {self.config.script} ({self.config.kind or 'full'} run). Each script "
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
            fail(f"--resume: cannot load {path} ({why_unloadable(err)}); start over with: {self.start_over()}")
        self.last = path
        return state["progress"], state["rng"]

    def save(self, model, optimizer, progress, settings, scheduler):
        """A checkpoint written beside the last and renamed into place, then named in latest.json;
        older ones removed. A failed write, in any process: one line each, exit 1, the last good one
        kept."""
        name, began = checkpoint_name(progress), time.perf_counter()
        final, tmp = self.folder / name, self.folder / (name + ".tmp")
        meta = {"script": self.config.script, "kind": self.config.kind, "settings": settings,
                "flags": started_flags(), "launch": launched_by()}
        extra = {"scheduler": scheduler} if scheduler else {}
        kept = (f"the last good checkpoint ({self.last}) is untouched: once there is room, "
                f"continue with: {resume_command()}" if self.last else "no checkpoint was written "
                f"yet: once there is room, start again with: {invoked(*started_flags())}")
        together(self.fabric, lambda: remove(tmp) if self.rank == 0 else None)

        def write():
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
                    write_atomically(tmp, buffer.getvalue(), replace=False, then=kept)
            except (OSError, RuntimeError) as err:  # torch reports a full disk as a RuntimeError
                if lost_peer(self.world_size, err):
                    raise  # not the disk: a process of the run is gone (the keeper says so)
                remove(tmp)
                fail(f"cannot write the checkpoint {tmp}: {write_error(err, tmp)}; {kept}.", code=1)
        together(self.fabric, write)

        def name_it():
            if self.rank == 0:
                try:
                    os.replace(tmp, final)
                except OSError as err:
                    remove(tmp)
                    fail(f"cannot write the checkpoint {final}: {write_error(err, final)}; {kept}.", code=1)
                figures = {k: v for k, v in progress.items() if k != "partial"}  # plain JSON
                write_atomically(self.folder / LATEST, json.dumps({"checkpoint": name, **meta, **figures})
                                 .encode(), then=kept)
                for old in self.folder.glob("epoch-*.ckpt"):
                    if old.name != name:
                        remove(old)
        self.last = final  # before the exchange: a process lost there can name it
        together(self.fabric, name_it)
        return time.perf_counter() - began

    def remove_all(self):
        remove(self.folder / LATEST)
        for old in self.folder.glob("epoch-*.ckpt"):
            remove(old)
        self.release()


def rng_states():
    """The random states: Python's, NumPy's, torch's CPU generator and this process's GPU's."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}  # plain, for weights_only
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states):
    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in states["python"]))
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        # a list: one state per visible GPU, as checkpoints before this one kept
        torch.cuda.set_rng_state(cuda[torch.cuda.current_device() % len(cuda)] if isinstance(cuda, list) else cuda)


class SkipFirst:
    """A sampler that, for one pass, leaves out the first `count` indices of another (the batches done
    before a mid-epoch stop), then puts the random state back."""

    def __init__(self, batch_sampler, count, rng):
        self.batch_sampler, self.original = batch_sampler, batch_sampler.sampler
        self.count, self.rng = count, rng

    def __len__(self):
        return len(self.original)  # the epoch's batches, as the loop prints them

    def __iter__(self):
        self.batch_sampler.sampler = self.original
        indices = iter(self.original)
        for _ in range(self.count):
            next(indices)
        set_rng_states(self.rng)
        yield from indices


def continue_data_order(train_loader, progress, rng):
    """--resume: the loader's order goes on as the stopped run's would have (the distributed sampler's
    epoch, the random state, mid-epoch: less the batches done)."""
    partial = progress.get("partial") or {}
    if hasattr(getattr(train_loader, "sampler", None), "set_epoch"):
        # Fabric's loader sets the distributed sampler's epoch from the number of times it
        # was iterated: start it once per finished epoch (the random states follow below).
        for _ in range(progress["epochs_done"]):
            next(iter(train_loader), None)
    set_rng_states(partial.get("epoch_rng") or rng)
    if partial:
        continue_mid_epoch(train_loader, partial["batches"], rng)


def continue_mid_epoch(train_loader, batches, rng):
    if hasattr(train_loader, "skip_first"):
        train_loader.skip_first(batches)
        set_rng_states(rng)
        return
    batch_sampler = train_loader.batch_sampler
    batch_sampler.sampler = SkipFirst(batch_sampler, batches * batch_sampler.batch_size, rng)


# -- the finetuned model file ------------------------------------------------------------------

def count_local_parameters(model):
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
               for p in model.parameters())


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def held_line(held, whole):
    if len(set(held)) == 1 and held[0] == whole:
        return f"Parameters held per process: each of the {len(held)} processes holds all {whole:,}"
    return "Parameters held per process: " + ", ".join(f"{n:,}" for n in held) + f" of {whole:,}"


def plain_state_dict(model):
    """The whole state dict on the CPU with torchvision's keys: FSDP2's shards gathered (every process
    must call this), torch.compile's "_orig_mod." dropped."""
    # gathering a 2-D (tensor x data parallel) shard warns that it takes two steps
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    state, cpu_meshes = {}, {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):  # a DTensor: a shard of an FSDP2 parameter
            value = whole(value, cpu_meshes)
        state[key.replace("_orig_mod.", "")] = value.detach().cpu()
    return state


def whole(dtensor, cpu_meshes):
    """A DTensor's whole tensor. A shard in CPU memory (15's offload) on an NCCL mesh, which takes no
    CPU tensors, is gathered over a gloo group of the same processes; torch's own full state dict
    would move each whole tensor to the GPU for a moment instead."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    mesh = dtensor.device_mesh
    if mesh.ndim == 1 and not has_backend(mesh.get_group(), dtensor.device):
        if id(mesh) not in cpu_meshes:
            ranks = dist.get_process_group_ranks(mesh.get_group())
            cpu_meshes[id(mesh)] = DeviceMesh.from_group(dist.new_group(ranks, backend="gloo"), "cpu")
        dtensor = DTensor.from_local(dtensor.to_local(), cpu_meshes[id(mesh)], dtensor.placements,
                                     shape=dtensor.shape, stride=dtensor.stride(), run_check=False)
    return dtensor.full_tensor()


def has_backend(group, device):
    try:
        group._get_backend(device)
        return True
    except RuntimeError:
        return False


def load_state_dict(model, state):
    """model.load_state_dict for a plain state dict, also into a compiled model ("_orig_mod.")."""
    own = {key.replace("_orig_mod.", ""): key for key in model.state_dict()}
    model.load_state_dict({own.get(key, key): value for key, value in state.items()})


def misfit(model, state):
    own = {key.replace("_orig_mod.", ""): value for key, value in model.state_dict().items()}
    missing, extra = own.keys() - state.keys(), state.keys() - own.keys()
    shapes = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
    parts = [f"{len(missing)} of the model's tensors missing"] if missing else []
    parts += [f"{len(extra)} tensors the model has no place for"] if extra else []
    if shapes:
        key = "conv_proj.weight" if "conv_proj.weight" in shapes else sorted(shapes)[0]
        show = lambda shape: "x".join(map(str, shape))  # noqa: E731
        parts.append(f"{len(shapes)} of another shape, {key} {show(state[key].shape)} in the "
                     f"file against {show(own[key].shape)} here")
    return ", ".join(parts) or "the tensors do not fit"


def load_model_file(model, path):
    """A finetuned model file into `model`, or one line saying what is wrong with it, exit 2."""
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
    except RuntimeError:
        width = state.get("conv_proj.weight", torch.empty(0)).shape[:1]
        kind = ("the small --smoke ViT" if width == (128,) else "ViT-B/16" if width == (768,)
                else "another model")
        fail(f"{path} holds {kind}, which does not fit the model built here ({misfit(model, state)})."
             " Add or drop --smoke to match the run that made it.")
    if state["heads.head.weight"].shape[0] != 10:
        fail(f"{path} has {state['heads.head.weight'].shape[0]} outputs, not 10.")
