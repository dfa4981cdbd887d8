"""Everything that is not the lesson: flags, data, model construction, evaluation, run records,
checkpoints and clean exits. The numbered scripts import from here so that each of them shows
its own technique and nothing else.

Contents, in order:
  parse_args              the flags every script takes, checked before any work starts
  get_dataloaders         CIFAR-10 as in the talk, the --smoke digits, or --synthetic data
  build_vit               torchvision's ViT-B/16 (or the small --smoke ViT)
  evaluate                accuracy over a whole data set, synced across processes
  supported_precision     bf16-mixed, or 16-mixed on a GPU without bfloat16
  fsdp_strategy           FSDP2 with each ViT EncoderBlock as its own unit (GPU and CPU)
  Run                     per-step bookkeeping, checkpoints, --resume and the run record
"""
import argparse
import json
import math
import os
import platform
import random
import resource
import shutil
import signal
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torchmetrics
from torch.utils.data import DataLoader, Subset, TensorDataset

# The talk's setup (../shared/talk-reference.md) and the offline --smoke demo's.
NUM_CLASSES = 10
TALK_IMAGE_SIZE = 224
VALIDATION_FRACTION = 0.1        # the last 5,000 of CIFAR-10's 50,000 training images
SMOKE_EPOCHS = 4                 # the small ViT reaches about 0.89 on the digits in 4 epochs
SMOKE_GLOBAL_BATCH = 16          # --smoke splits the talk's batch of 16 across the processes
SMOKE_IMAGE_SIZE = 32
SMOKE_SPLIT = (240, 360)         # digits held out for validation and test (1,197 left to train)
SYNTHETIC_STEPS = 20             # --synthetic runs this many training steps unless --max-steps says
WARMUP_STEPS = 3                 # training steps not timed for images_per_s
LATEST = "latest.json"           # names a checkpoint directory's newest finished epoch

CUDA_BF16_FALLBACK = "16-mixed"


# --------------------------------------------------------------------------------------------
# Errors: one line on stderr and exit 2 (bad input or machine), never a traceback.
# --------------------------------------------------------------------------------------------
def fail(message, code=2):
    message = " ".join(str(message).split())  # always one line
    if len(message) > 600:
        message = message[:600] + " ..."
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


# --------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------
def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def build_parser(epochs, devices=None):
    """The flags every numbered script takes. `devices` given: the Fabric scripts' --devices
    and --num-nodes with that default."""
    script = Path(sys.argv[0]).stem
    parser = argparse.ArgumentParser(
        description="Finetune ViT-B/16 on CIFAR-10 as in the CVPR 2023 talk 'Scaling PyTorch "
                    "Model Training With Minimal Code Changes'. Defaults reproduce the talk.")
    parser.add_argument("--smoke", action="store_true",
                        help="offline demo: a small ViT on scikit-learn's 8x8 digits (32x32), "
                             f"{SMOKE_EPOCHS} epochs, about a minute on a CPU")
    parser.add_argument("--synthetic", action="store_true",
                        help="random images and labels of the run's shape, no download, random "
                             "init; for throughput and memory (records test_acc null)")
    parser.add_argument("--max-steps", type=_positive, default=None, metavar="N",
                        help=f"stop after N training steps (--synthetic: {SYNTHETIC_STEPS})")
    parser.add_argument("--epochs", type=_positive, default=None, metavar="N",
                        help=f"default {epochs} (--smoke: {SMOKE_EPOCHS})")
    parser.add_argument("--batch-size", type=_positive, default=None, metavar="N",
                        help="per process (default 16, the talk's; --smoke: 16 divided among "
                             "the processes, so every world size takes the same steps)")
    parser.add_argument("--num-workers", type=_non_negative, default=4, metavar="N",
                        help="data loader worker processes (default 4)")
    parser.add_argument("--data-dir", default="data", metavar="DIR",
                        help="where CIFAR-10 is, or is downloaded to (default data/)")
    parser.add_argument("--no-download", action="store_true",
                        help="never download CIFAR-10; fail if it is not in --data-dir")
    parser.add_argument("--results", default="results/runs.jsonl", metavar="FILE",
                        help="run records, one JSON object per line, appended (default "
                             "results/runs.jsonl)")
    parser.add_argument("--seed", type=int, default=123, help="default 123, the talk's")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto: the GPU if there is one, else the CPU (--smoke only)")
    if devices is not None:
        parser.add_argument("--devices", type=_positive, default=devices, metavar="N",
                            help=f"processes (GPUs) per node (default {devices})")
        parser.add_argument("--num-nodes", type=_positive, default=1, metavar="N",
                            help="machines (default 1)")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help=f"per-epoch checkpoints (default checkpoints/{script}/, "
                             f"checkpoints/{script}-smoke/ with --smoke)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the checkpoint in --checkpoint-dir")
    return parser


def parse_args(epochs, devices=None):
    """Parse and check the flags before any work starts; `auto` becomes `cuda` or `cpu`."""
    parser = build_parser(epochs, devices)
    args = parser.parse_args()
    args.script = Path(sys.argv[0]).name
    args.default_epochs = epochs
    if args.epochs is None:
        args.epochs = SMOKE_EPOCHS if args.smoke else epochs
    if args.synthetic and args.max_steps is None:
        args.max_steps = SYNTHETIC_STEPS
    if devices is None:
        args.devices, args.num_nodes = 1, 1
    if args.batch_size is None:
        world_size = args.devices * args.num_nodes
        args.batch_size = max(1, SMOKE_GLOBAL_BATCH // world_size) if args.smoke else 16
    if args.checkpoint_dir is None:
        name = Path(args.script).stem + ("-smoke" if args.smoke else "")
        args.checkpoint_dir = os.path.join("checkpoints", name)

    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.accelerator == "auto":
        if cuda_count == 0 and not args.smoke:
            parser.exit(2, f"{parser.prog}: error: no CUDA GPU found. A full run on a CPU takes "
                           "about a day: use --smoke for the one-minute offline demo, or "
                           "--accelerator cpu to insist.\n")
        args.accelerator = "cuda" if cuda_count else "cpu"
    if args.accelerator == "cuda" and args.devices > cuda_count:
        parser.exit(2, f"{parser.prog}: error: asked for {args.devices} GPU(s) per node "
                       f"(--devices {args.devices}) but this machine has {cuda_count}.\n")

    _check_writable(parser, args.results)
    latest = Path(args.checkpoint_dir) / LATEST
    if latest.exists() and not args.resume:
        parser.exit(2, f"{parser.prog}: error: {args.checkpoint_dir} holds the checkpoint of an "
                       "unfinished run: add --resume to continue it, or choose another "
                       "--checkpoint-dir (or delete that one) to start over.\n")
    if args.resume and not latest.exists():
        parser.exit(2, f"{parser.prog}: error: --resume: nothing to resume in "
                       f"{args.checkpoint_dir} (no {LATEST}).\n")
    signal.signal(signal.SIGINT, _on_interrupt)
    return args


def _check_writable(parser, path):
    """A 60-minute run must not be lost at the end: check the records file can be appended."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as err:
        parser.error(f"--results {path} cannot be written: {err.strerror or err}")


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------
def talk_transforms():
    """The talk's transform for every split: resize to 224x224, to a tensor in [0, 1]."""
    from torchvision import transforms
    return transforms.Compose([transforms.Resize((TALK_IMAGE_SIZE, TALK_IMAGE_SIZE)),
                               transforms.ToTensor()])


def get_dataloaders(args):
    """(train, val, test) loaders: CIFAR-10 as in the talk; --smoke the digits; --synthetic
    random data. Batch size, workers and seed come from the flags; only training shuffles and
    drops the last incomplete batch."""
    if args.synthetic:
        train, val, test = synthetic_datasets(args)
    elif args.smoke:
        train, val, test = digits_datasets()
    else:
        train, val, test = cifar10_datasets(args.data_dir, download=not args.no_download)
    workers = 0 if (args.smoke or args.synthetic) else args.num_workers
    common = dict(batch_size=args.batch_size, num_workers=workers)
    return (DataLoader(train, shuffle=True, drop_last=True, **common),
            DataLoader(val, shuffle=False, **common),
            DataLoader(test, shuffle=False, **common))


def cifar10_datasets(data_dir, download=True):
    """torchvision's CIFAR10 under data_dir: 45,000 train / 5,000 validation (the last 5,000
    training images) / 10,000 test, all with the talk's transform."""
    from torchvision.datasets import CIFAR10
    transform = talk_transforms()
    try:
        train_full = CIFAR10(root=data_dir, train=True, transform=transform, download=download)
        test = CIFAR10(root=data_dir, train=False, transform=transform, download=download)
    except RuntimeError as err:  # torchvision: "Dataset not found or corrupted..."
        fail(f"CIFAR-10 is not in {os.path.abspath(data_dir)} ({err}). Run once without "
             "--no-download on a machine with internet, or copy cifar-10-batches-py there.")
    except OSError as err:  # no network: URLError, connection refused, DNS failure
        fail(f"CIFAR-10 is not in {os.path.abspath(data_dir)} and could not be downloaded "
             f"({getattr(err, 'reason', err)}). Download it on a machine with internet and "
             "copy cifar-10-batches-py there, or point --data-dir at it.")
    num_val = int(VALIDATION_FRACTION * len(train_full))
    num_train = len(train_full) - num_val
    return (Subset(train_full, range(num_train)),
            Subset(train_full, range(num_train, len(train_full))),
            test)


def digits_datasets():
    """The --smoke data: scikit-learn's 1,797 8x8 digits, upscaled to 32x32 and 3 channels, in
    [0, 1], split once and for all (independent of --seed) into train / val / test."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = torch.nn.functional.interpolate(images, size=(SMOKE_IMAGE_SIZE,) * 2,
                                             mode="bilinear", align_corners=False)
    images = images.clamp(0, 1).repeat(1, 3, 1, 1)
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.from_numpy(np.random.RandomState(0).permutation(len(labels)))
    images, labels = images[order], labels[order]
    num_val, num_test = SMOKE_SPLIT
    num_train = len(labels) - num_val - num_test
    parts = [slice(0, num_train), slice(num_train, num_train + num_val),
             slice(num_train + num_val, None)]
    return tuple(TensorDataset(images[s], labels[s]) for s in parts)


def synthetic_datasets(args):
    """Random images and labels of the run's shape, enough for --max-steps per process."""
    size = SMOKE_IMAGE_SIZE if args.smoke else TALK_IMAGE_SIZE
    generator = torch.Generator().manual_seed(args.seed)
    num_train = args.max_steps * args.batch_size * args.devices * args.num_nodes
    num_eval = args.batch_size * args.devices * args.num_nodes

    def make(n):
        return TensorDataset(torch.rand(n, 3, size, size, generator=generator),
                             torch.randint(0, NUM_CLASSES, (n,), generator=generator))
    return make(num_train), make(num_eval), make(num_eval)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
def build_vit(weights, args):
    """torchvision's vit_b_16(weights=weights) (None, or a ViT_B_16_Weights name such as
    "IMAGENET1K_V1"), downloading the weights into torch's hub cache
    when they are not there. --smoke: a small ViT for 32x32 images (3 layers, width 128, patch
    16) from random init; --synthetic: random init, nothing downloaded."""
    from torchvision.models import ViT_B_16_Weights, vit_b_16
    from torchvision.models.vision_transformer import VisionTransformer
    weights = ViT_B_16_Weights.verify(weights)
    if args.smoke:
        return VisionTransformer(image_size=SMOKE_IMAGE_SIZE, patch_size=16, num_layers=3,
                                 num_heads=4, hidden_dim=128, mlp_dim=256)
    if args.synthetic or weights is None:
        return vit_b_16(weights=None)
    try:
        return vit_b_16(weights=weights)
    except (OSError, RuntimeError) as err:
        cache = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
        fail(f"the ImageNet weights {weights} could not be loaded ({getattr(err, 'reason', err)})."
             f" Download {weights.url} on a machine with internet and place it at {cache}.")


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, loader, device):
    """Accuracy (a fraction) over the whole loader. Under several processes each sees its own
    shard, and torchmetrics sums the counts of all of them."""
    model.eval()
    accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=NUM_CLASSES).to(device)
    for features, targets in loader:
        features, targets = features.to(device), targets.to(device)
        accuracy.update(torch.argmax(model(features), 1), targets)
    return accuracy.compute().item()


# --------------------------------------------------------------------------------------------
# Precision and FSDP
# --------------------------------------------------------------------------------------------
def supported_precision(precision, args):
    """`precision`, unless it is bf16 on a CUDA GPU without bfloat16: then 16-mixed, said once."""
    if (precision.startswith("bf16") and args.accelerator == "cuda"
            and not torch.cuda.is_bf16_supported()):
        print(f"This GPU ({torch.cuda.get_device_name()}) has no bfloat16: running "
              f"{CUDA_BF16_FALLBACK} instead of {precision}.", flush=True)
        return CUDA_BF16_FALLBACK
    return precision


def shard_each_encoder_block(model, device_mesh):
    """FSDP2: each ViT EncoderBlock becomes its own unit, then the root (embeddings, head)."""
    from torch.distributed.fsdp import fully_shard
    from torchvision.models.vision_transformer import EncoderBlock
    mesh = device_mesh["data_parallel"]
    for module in model.modules():
        if isinstance(module, EncoderBlock):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_strategy(args):
    """Fully sharded data parallel across every process of every node, each EncoderBlock its
    own unit. FSDP2 through Fabric's ModelParallelStrategy serves GPUs (NCCL) and CPUs (gloo)
    alike; Lightning's strategy="fsdp" refuses the CPU."""
    from lightning.fabric.strategies import ModelParallelStrategy
    return ModelParallelStrategy(parallelize_fn=shard_each_encoder_block,
                                 data_parallel_size=args.devices * args.num_nodes,
                                 tensor_parallel_size=1)


def count_local_parameters(model):
    """Parameters this process holds: a sharded parameter counts only its local shard."""
    total = 0
    for p in model.parameters():
        total += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return total


# --------------------------------------------------------------------------------------------
# Runs: bookkeeping, checkpoints, resume, the record
# --------------------------------------------------------------------------------------------
_LAST_CHECKPOINT = {"path": None, "rank": 0}


def _on_interrupt(signum, frame):
    """Ctrl-C: one line saying where the last checkpoint is, exit 130, no traceback."""
    if _LAST_CHECKPOINT["rank"] == 0:
        where = _LAST_CHECKPOINT["path"]
        hint = (f"last checkpoint: {where} (continue with --resume)" if where
                else "no checkpoint yet (one is written at the end of each epoch)")
        print(f"\n{Path(sys.argv[0]).name}: interrupted; {hint}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(130)


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


class Run:
    """One run's bookkeeping, so the scripts keep only the lesson. `fabric` is None for the
    plain-PyTorch scripts, which save with torch.save; the Fabric scripts use fabric.save."""

    def __init__(self, args, fabric=None):
        self.args, self.fabric = args, fabric
        self.rank = fabric.global_rank if fabric else 0
        self.world_size = fabric.world_size if fabric else 1
        _LAST_CHECKPOINT["rank"] = self.rank
        self.ckpt_dir = Path(args.checkpoint_dir)
        self.start_epoch = 0
        self.resumed = False
        self.train_loss, self.val_acc = [], []
        self.earlier_train_time = 0.0      # seconds from before a --resume
        self.images = 0                    # timed training images of this process
        self.step_seconds = 0.0            # timed training-step seconds of this process
        self.steps = 0                     # training steps, over all epochs and resumes
        self._steps_this_session = 0
        self._epoch_losses = []
        self._last_tick = None
        self._earlier_timed = (0.0, 0.0)   # (images, seconds) timed before a --resume

    # -- printing ------------------------------------------------------------------------
    def print(self, *a, **k):
        """print, on global rank 0 only (fabric.print prints once per machine)."""
        if self.rank == 0:
            print(*a, **k, flush=True)

    # -- the epochs and steps ------------------------------------------------------------
    def epochs(self):
        """range(epochs), continuing after the last finished epoch with --resume."""
        for epoch in range(self.start_epoch, self.args.epochs):
            if self.max_steps_reached:
                return
            self._epoch_losses = []
            self._sync()
            self._last_tick = time.perf_counter()
            yield epoch

    def step(self, epoch, batch_idx, loss, batch_size):
        """After each optimizer step: NaN guard, the epoch's mean loss, timed throughput."""
        value = loss.item()  # waits for the GPU, so the tick below times the whole step
        if not math.isfinite(value):
            hint = (" With 16-mixed, the loss scaler skips such steps only when the gradients "
                    "overflow; a NaN loss means the forward pass itself overflowed."
                    if "16-mixed" == self.precision else "")
            fail(f"the loss is {value} at epoch {epoch + 1}, batch {batch_idx}: stopping, no "
                 f"record written.{hint}", code=1)
        self._epoch_losses.append(value)
        now = time.perf_counter()
        self._steps_this_session += 1
        self.steps += 1
        if self._steps_this_session > WARMUP_STEPS:  # warm-up steps are not timed
            self.images += batch_size
            self.step_seconds += now - self._last_tick
        elif self._steps_this_session == WARMUP_STEPS and self.args.accelerator == "cuda":
            torch.cuda.reset_peak_memory_stats()  # the peak of the steady state, not of start-up
        self._last_tick = now

    @property
    def max_steps_reached(self):
        return self.args.max_steps is not None and self.steps >= self.args.max_steps

    def end_epoch(self, epoch, model, optimizer, val_acc, train_time_s):
        """After validation: keep the epoch's figures and save a checkpoint to resume from."""
        mean_loss = torch.tensor(float(np.mean(self._epoch_losses)) if self._epoch_losses else 0.0)
        if self.fabric:
            mean_loss = self.fabric.all_reduce(mean_loss, reduce_op="mean")
        self.train_loss.append(float(mean_loss))
        self.val_acc.append(val_acc)
        self._save_checkpoint(epoch + 1, model, optimizer, train_time_s)

    # -- checkpoints -----------------------------------------------------------------------
    @property
    def _latest_file(self):
        return self.ckpt_dir / LATEST

    def _barrier(self):
        if self.fabric and self.world_size > 1:
            self.fabric.barrier()

    def _sync(self):
        if self.args.accelerator == "cuda":
            torch.cuda.synchronize()

    def _rng_states(self):
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        states = {"torch": torch.get_rng_state(), "python": random.getstate(),
                  "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}  # plain, for weights_only
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.get_rng_state_all()
        return states

    def _save_checkpoint(self, epochs_done, model, optimizer, train_time_s):
        name = f"epoch-{epochs_done:04d}.ckpt"
        final, tmp = self.ckpt_dir / name, self.ckpt_dir / (name + ".tmp")
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            _remove(tmp)
        self._barrier()
        progress = {"epochs_done": epochs_done, "train_loss": self.train_loss,
                    "val_acc": self.val_acc, "steps": self.steps,
                    "train_time_s": self.earlier_train_time + train_time_s,
                    **self._timed_totals()}
        meta = {"script": self.args.script, "world_size": self.world_size,
                "smoke": self.args.smoke, "synthetic": self.args.synthetic}
        if self.fabric:
            state = {"model": model, "optimizer": optimizer, "progress": progress, "meta": meta,
                     "rng": self._rng_states()}
            self.fabric.save(tmp, state)
        else:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "progress": progress, "meta": meta, "rng": self._rng_states()}
            torch.save(state, tmp)
        self._barrier()
        if self.rank == 0:
            os.replace(tmp, final)  # the last good checkpoint is never half-written
            _atomic_write_text(self._latest_file,
                               json.dumps({"checkpoint": name, **meta, **progress}))
            for old in self.ckpt_dir.glob("epoch-*.ckpt"):
                if old.name != name:
                    _remove(old)
        self._barrier()
        _LAST_CHECKPOINT["path"] = str(final)

    def resume(self, model, optimizer, train_loader):
        """With --resume: restore model, optimizer, random states and figures; else nothing."""
        # counted now, as set up: FSDP2 keeps the root's parameters whole after a forward pass
        self.held_parameters = count_local_parameters(model)
        if not self.args.resume:
            return
        try:
            latest = json.loads(self._latest_file.read_text())
            path = self.ckpt_dir / latest["checkpoint"]
            script, world_size = latest["script"], latest["world_size"]
        except FileNotFoundError:
            fail(f"--resume: nothing to resume in {self.ckpt_dir} (no latest.json).")
        except (OSError, ValueError, KeyError, TypeError) as err:
            fail(f"--resume: {self._latest_file} is unreadable or corrupt ({err}).")
        if script != self.args.script or world_size != self.world_size:
            fail(f"--resume: the checkpoint in {self.ckpt_dir} is from {script} with "
                 f"{world_size} process(es); this is {self.args.script} with "
                 f"{self.world_size}.")
        if (latest.get("smoke"), latest.get("synthetic")) != (self.args.smoke, self.args.synthetic):
            fail(f"--resume: the checkpoint in {self.ckpt_dir} is from a run with different "
                 "--smoke/--synthetic flags.")
        try:
            if self.fabric:
                state = {"model": model, "optimizer": optimizer, "progress": {}, "meta": {},
                         "rng": {}}
                self.fabric.load(path, state)
            else:
                state = torch.load(path, map_location="cpu", weights_only=True)
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
        except Exception as err:  # a truncated or foreign file fails in many ways
            first_line = (str(err).strip().splitlines() or [""])[0]
            fail(f"--resume: cannot load {path} ({type(err).__name__}: {first_line})")
        progress, rng = state["progress"], state["rng"]
        torch.set_rng_state(rng["torch"])
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.start_epoch = progress["epochs_done"]
        self.train_loss, self.val_acc = list(progress["train_loss"]), list(progress["val_acc"])
        self.steps = progress["steps"]
        self.earlier_train_time = progress["train_time_s"]
        self._earlier_timed = (progress["timed_images"], progress["timed_seconds"])
        # Fabric's loader sets the distributed sampler's epoch from its own iteration count.
        if hasattr(train_loader, "_num_iter_calls"):
            train_loader._num_iter_calls = self.start_epoch
        self.resumed = True
        _LAST_CHECKPOINT["path"] = str(path)
        self.print(f"Resuming {self.args.script} from {path}: {self.start_epoch} of "
                   f"{self.args.epochs} epochs done.")

    # -- the end -----------------------------------------------------------------------------
    def _timed_totals(self):
        """Timed training images of every process together, and the slowest process's seconds,
        including the part before a --resume."""
        images = torch.tensor(float(self.images))
        seconds = torch.tensor(self.step_seconds)
        if self.fabric and self.world_size > 1:
            images = self.fabric.all_reduce(images, reduce_op="sum")
            seconds = self.fabric.all_reduce(seconds, reduce_op="max")
        return {"timed_images": float(images) + self._earlier_timed[0],
                "timed_seconds": float(seconds) + self._earlier_timed[1]}

    def images_per_s(self):
        """Training images per second of every process together (validation excluded)."""
        timed = self._timed_totals()
        return timed["timed_images"] / timed["timed_seconds"] if timed["timed_seconds"] else None

    @property
    def precision(self):
        return self.fabric.strategy.precision.precision if self.fabric else "32-true"

    @property
    def strategy(self):
        if not self.fabric:
            return "single-device"
        name = type(self.fabric.strategy).__name__
        return {"SingleDeviceStrategy": "single-device", "DDPStrategy": "ddp",
                "ModelParallelStrategy": "fsdp2-per-block", "FSDPStrategy": "fsdp"}.get(name, name)

    def finish(self, train_time_s, test_acc):
        """Print the talk's closing lines, append the run record, remove the resume point."""
        import lightning
        import torchvision
        args = self.args
        images_per_s = self.images_per_s()
        memory = peak_memory_gb(args.accelerator)
        if self.fabric and self.world_size > 1:
            memory = float(self.fabric.all_reduce(torch.tensor(memory), reduce_op="max"))
        total_time = self.earlier_train_time + train_time_s
        held = torch.tensor([self.held_parameters])
        if self.fabric and self.world_size > 1:
            held = self.fabric.all_gather(held).flatten()
        measured = not args.synthetic
        self.print(f"Time elapsed {total_time / 60:.2f} min")
        self.print(f"Memory used: {memory:.02f} GB")
        if measured:
            self.print(f"Test accuracy {test_acc * 100:.2f}%")
        else:
            self.print(f"Throughput {images_per_s:.1f} images/s (synthetic data: no accuracy)")
        if self.rank == 0:
            record = {
                "script": args.script, "smoke": args.smoke, "synthetic": args.synthetic,
                "resumed": self.resumed, "accelerator": args.accelerator,
                "device_name": device_name(args.accelerator), "devices": args.devices,
                "num_nodes": args.num_nodes, "world_size": self.world_size,
                "precision": self.precision, "strategy": self.strategy,
                "epochs": args.epochs, "batch_size": args.batch_size, "seed": args.seed,
                "max_steps": args.max_steps, "steps": self.steps,
                "train_time_s": round(total_time, 3),
                "images_per_s": None if images_per_s is None else round(images_per_s, 2),
                "peak_memory_gb": round(memory, 4),
                "parameters_per_process": [int(n) for n in held],
                "train_loss": self.train_loss,
                "val_acc": self.val_acc if measured else None,
                "test_acc": test_acc if measured else None,
                "torch": torch.__version__, "torchvision": torchvision.__version__,
                "lightning": lightning.__version__, "python": platform.python_version(),
                "hostname": socket.gethostname(),
                "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            append_record(args.results, record)
            _remove(self._latest_file)  # finished: nothing left to resume
            for old in self.ckpt_dir.glob("epoch-*.ckpt"):
                _remove(old)
            if self.ckpt_dir.is_dir() and not any(self.ckpt_dir.iterdir()):
                self.ckpt_dir.rmdir()
            self.print(f"Run record appended to {args.results}")
        self._barrier()


def append_record(path, record):
    """One JSON line, written by a single append, so the file stays valid JSONL even if the
    process is killed."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _atomic_write_text(path, text):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _remove(path):
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
