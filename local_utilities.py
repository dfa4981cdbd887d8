"""What the numbered scripts share, as in the talk's helper module: the flags, the data (CIFAR-10
as in the talk, and the offline --smoke and --synthetic stand-ins), the model and evaluation.
Run records, timing, checkpoints, --resume and signals live in run_keeping.py."""
import argparse
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torchmetrics
from torch.utils.data import DataLoader, Subset, TensorDataset

from run_keeping import WARMUP_STEPS, fail, unwritable

NUM_CLASSES = 10
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
TALK_IMAGE_SIZE = 224
NUM_VALIDATION = 5000        # the last 5,000 of CIFAR-10's 50,000 training images
# The talk trains 10 epochs from random init (00) and 3 finetuning (01-07); --smoke keeps that
# shape: 4 from random init, 2 finetuning the pretrained smoke ViT.
SMOKE_EPOCHS = {10: 4, 3: 2}
SMOKE_GLOBAL_BATCH = 16      # --smoke splits the talk's batch of 16 across data-parallel replicas
SMOKE_IMAGE_SIZE = 32
SMOKE_SPLIT = (240, 360)     # digits held out for validation and test (1,197 left to train)
SYNTHETIC_STEPS = 20         # --synthetic trains this many steps (one epoch) unless --max-steps


# -- Flags ----------------------------------------------------------------------------------------
def _at_least(minimum):
    def check(text):
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
        return value
    return check


def parse_args(epochs, devices=None, batch_size=16, smoke_epochs=None):
    """The flags, checked before any work starts; `auto` becomes `cuda` or `cpu`. `devices`
    given: the Fabric scripts' --devices and --num-nodes with that default."""
    script = Path(sys.argv[0]).name
    smoke_epochs = smoke_epochs or SMOKE_EPOCHS.get(epochs, 2)
    parser = argparse.ArgumentParser(description=describe(script))
    add = parser.add_argument
    add("--smoke", action="store_true", help="offline demo: a small ViT (pretrained on printed "
        "digits where the full run loads ImageNet weights) on scikit-learn's 8x8 handwritten "
        "digits (32x32), on the CPU; under a minute on 2 cores (02 spends about 40 s compiling)")
    add("--synthetic", action="store_true", help="random images and labels of the run's shape, "
        "random init, nothing downloaded: for throughput and memory (no accuracy)")
    add("--max-steps", type=_at_least(1), metavar="N",
        help=f"train N batches per epoch (--synthetic: {SYNTHETIC_STEPS}, one epoch; more than "
             f"{WARMUP_STEPS}, the untimed warm-up steps)")
    add("--epochs", type=_at_least(1), metavar="N", help=f"default {epochs} (--synthetic: 1, "
        f"--smoke: {smoke_epochs})")
    add("--batch-size", type=_at_least(1), metavar="N", help=f"per process (default {batch_size}"
        f"{', the talk' + chr(39) + 's' if batch_size == 16 else ''}; --smoke: 16 divided among "
        "the data-parallel processes)")
    add("--num-workers", type=_at_least(0), default=4, metavar="N",
        help="data loader processes (default 4)")
    add("--data-dir", default="data", metavar="DIR", help="where CIFAR-10 is, or goes")
    add("--no-download", action="store_true", help="fail instead of downloading CIFAR-10")
    add("--results", default="results/runs.jsonl", metavar="FILE",
        help="run records, one JSON line per run, appended (default results/runs.jsonl)")
    add("--save-model", metavar="PATH", help="where the finetuned model goes (default "
        "models/<script>.pt, -smoke/-synthetic before .pt)")
    add("--seed", type=int, default=123, help="default 123, the talk's")
    add("--accelerator", default="auto", choices=["auto", "cuda", "cpu"],
        help="auto: the GPU if there is one, else the CPU with --smoke")
    if devices is not None:
        add("--devices", type=_at_least(1), metavar="N",
            help=f"processes (GPUs) per machine (default {devices}; --smoke on a CPU: 2)")
        add("--num-nodes", type=_at_least(1), default=1, metavar="N", help="machines")
    if script.startswith("10_"):  # the one flag only one script has: its technique's size
        add("--tensor-parallel", type=_at_least(1), default=2, metavar="N", help="processes that "
            "split each MLP between them (default 2); the rest of --devices x --num-nodes is "
            "data parallel")
    if script.startswith("09_"):
        add("--compile-on-cpu", action="store_true", help="on a CPU too, take the path a GPU "
            "takes: torch.compile and the fused AdamW (compiling costs about 40 s)")
    add("--checkpoint-dir", metavar="DIR", help="per-epoch checkpoints (default "
        "checkpoints/<script>/, -smoke/-synthetic suffix); every machine must see it")
    add("--resume", action="store_true", help="continue the run in --checkpoint-dir")
    args = parser.parse_args()

    # each kind of run has its own checkpoint folder, model file and recorded kind
    args.script, args.kind = script, "-".join(k for k in ("smoke", "synthetic") if getattr(args, k))
    suffix = f"-{args.kind}" if args.kind else ""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.accelerator == "auto":
        if cuda_count == 0 and not args.smoke:
            hint = " --smoke --resume to continue a smoke run" if args.resume else " --smoke"
            parser.exit(2, f"{parser.prog}: error: no CUDA GPU found. A full run on a CPU takes "
                           f"about a day: try python {script}{hint}, or add --accelerator cpu "
                           "to insist.\n")
        args.accelerator = "cuda" if cuda_count else "cpu"
    if devices is None:
        args.devices, args.num_nodes = 1, 1
    elif args.devices is None:
        args.devices = devices
        if args.smoke and args.accelerator == "cpu":
            args.devices = min(devices, 2)  # 2 CPU processes show the technique on a laptop
    if args.accelerator == "cuda" and args.devices > cuda_count:
        asked = f"--devices {args.devices}" if devices else "--accelerator cuda"
        parser.exit(2, f"{parser.prog}: error: asked for {args.devices} GPU(s) per machine "
                       f"({asked}) but this machine has {cuda_count}.\n")
    args.world_size = args.devices * args.num_nodes
    args.tensor_parallel = getattr(args, "tensor_parallel", 1)
    if args.world_size % args.tensor_parallel:
        parser.error(f"--tensor-parallel {args.tensor_parallel} does not divide the "
                     f"{args.world_size} processes (--devices x --num-nodes)")
    args.data_parallel = args.world_size // args.tensor_parallel  # replicas that split the batch
    if args.epochs is None:
        args.epochs = 1 if args.synthetic else smoke_epochs if args.smoke else epochs
    if args.synthetic and args.max_steps is None:
        args.max_steps = SYNTHETIC_STEPS
    if args.synthetic and args.max_steps <= WARMUP_STEPS and args.epochs == 1:
        parser.error(f"--synthetic measures throughput after {WARMUP_STEPS} untimed warm-up "
                     f"steps: give --max-steps {WARMUP_STEPS + 1} or more")
    if args.batch_size is None:
        args.batch_size = max(1, SMOKE_GLOBAL_BATCH // args.data_parallel) if args.smoke else batch_size
    args.checkpoint_dir = args.checkpoint_dir or os.path.join("checkpoints", Path(script).stem + suffix)
    args.save_model = args.save_model or os.path.join("models", Path(script).stem + suffix + ".pt")
    for flag, path in (("--results", args.results), ("--save-model", args.save_model)):
        problem = unwritable(path)
        if problem:
            parser.error(f"{flag} {path} cannot be written: {problem}")
    return args


def describe(script):
    """--help's opening: the script's technique and change (talk_reference.csv), else the first
    paragraph of its docstring."""
    import csv
    with open(Path(__file__).with_name("talk_reference.csv")) as f:
        for row in csv.DictReader(line for line in f if not line.startswith("#")):
            if row["script"] == script:
                return f"{script}: {row['technique']}. Changes {row['change']}."
    return " ".join((sys.modules["__main__"].__doc__ or "").strip().split("\n\n")[0].split())


# -- Data -----------------------------------------------------------------------------------------
def talk_transforms():
    """The talk's transform for every split: resize to 224x224, to a tensor in [0, 1]."""
    from torchvision import transforms
    return transforms.Compose([transforms.Resize((TALK_IMAGE_SIZE, TALK_IMAGE_SIZE)),
                               transforms.ToTensor()])


def resize_on_device(images, size=TALK_IMAGE_SIZE):
    """The talk's transform on a batch already on the device (09): uint8 N x 3 x 32 x 32 to
    floats in [0, 1], bilinear to size x size; within 1/255 of Resize + ToTensor (PIL rounds)."""
    images = images.float().div_(255)
    if images.shape[-1] == size:
        return images
    return torch.nn.functional.interpolate(images, size=(size, size), mode="bilinear",
                                           align_corners=False)


def get_dataloaders(args):
    """(train, val, test) loaders: CIFAR-10 as in the talk, the --smoke digits or --synthetic
    data; training shuffles and drops its last partial batch; --max-steps N keeps N batches."""
    if args.synthetic:
        train, val, test = synthetic_datasets(args)
    elif args.smoke:
        train, val, test = digits_datasets()
    else:
        train, val, test = cifar10_datasets(args.data_dir, download=not args.no_download)
    if args.max_steps:
        train = Subset(train, range(min(len(train), args.max_steps * args.batch_size * args.data_parallel)))
    common = dict(batch_size=args.batch_size,
                  num_workers=0 if (args.smoke or args.synthetic) else args.num_workers)
    return (DataLoader(train, shuffle=True, drop_last=True, **common),
            DataLoader(val, shuffle=False, **common),
            DataLoader(test, shuffle=False, **common))


def cifar10_datasets(data_dir, download=True):
    """torchvision's CIFAR10 in data_dir: 45,000 train / 5,000 validation (the last 5,000
    training images) / 10,000 test, all with the talk's transform."""
    from torchvision.datasets import CIFAR10
    where = os.path.abspath(data_dir)
    created = [p for p in [Path(where), *Path(where).parents] if not p.exists()]
    try:
        train_full = CIFAR10(root=data_dir, train=True, transform=talk_transforms(), download=download)
        test = CIFAR10(root=data_dir, train=False, transform=talk_transforms(), download=download)
    except RuntimeError:  # torchvision: "Dataset not found or corrupted"
        fail(f"CIFAR-10 is not in {where} (no complete cifar-10-batches-py folder), and "
             f"--no-download was given. Download {CIFAR10_URL}, unpack it there, or drop "
             "--no-download.")
    except OSError as err:  # no network: URLError, connection refused, DNS failure, full disk
        if created:  # the folders this run made (and the partial download in them): gone again
            shutil.rmtree(created[-1], ignore_errors=True)
        fail(f"CIFAR-10 is not in {where} and could not be downloaded "
             f"({getattr(err, 'reason', None) or err.strerror or err}). On a machine with "
             f"internet, download {CIFAR10_URL} and unpack it into {where}.")
    num_train = len(train_full) - NUM_VALIDATION * len(train_full) // 50000
    return (Subset(train_full, range(num_train)),
            Subset(train_full, range(num_train, len(train_full))), test)


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
    cut = len(labels) - num_val - num_test
    parts = [slice(0, cut), slice(cut, cut + num_val), slice(cut + num_val, None)]
    return tuple(TensorDataset(images[s], labels[s]) for s in parts)


def synthetic_datasets(args):
    """Random images and labels of the run's shape: --max-steps batches per process to train on,
    one batch per process to evaluate."""
    size = SMOKE_IMAGE_SIZE if args.smoke else TALK_IMAGE_SIZE
    g, per_step = torch.Generator().manual_seed(args.seed), args.batch_size * args.data_parallel
    make = lambda n: TensorDataset(torch.rand(n, 3, size, size, generator=g),  # noqa: E731
                                   torch.randint(0, NUM_CLASSES, (n,), generator=g))
    return make(args.max_steps * per_step), make(per_step), make(per_step)


# -- Model ----------------------------------------------------------------------------------------
SMOKE_WEIGHTS = Path(__file__).with_name("smoke_weights") / "smoke-vit-printed-digits.pt"


def smoke_vit():
    """The --smoke model: a small ViT for 32x32 images in 16 patches of 8 pixels (with 4 of 16, random
    init read the digits as well as pretrained: README), 3 layers, width 128; a head for the 10
    printed digits it is pretrained on, replaced by the scripts as ImageNet's 1,000 classes are."""
    from torchvision.models.vision_transformer import VisionTransformer
    return VisionTransformer(image_size=SMOKE_IMAGE_SIZE, patch_size=8, num_layers=3,
                             num_heads=4, hidden_dim=128, mlp_dim=256, num_classes=NUM_CLASSES)


def build_vit(weights, args):
    """torchvision's vit_b_16(weights=None or "IMAGENET1K_V1"; downloaded into torch's hub cache).
    --smoke: the small ViT, pretrained where the full run loads IMAGENET1K_V1 (on printed digits,
    by make_smoke_weights.py: the demo's ImageNet); --synthetic: random init. Notes in
    args.init what the model starts from (for the run's output and record)."""
    from torchvision.models import ViT_B_16_Weights, vit_b_16
    weights = None if args.synthetic else ViT_B_16_Weights.verify(weights)
    args.init = "random init"
    if args.smoke:
        model = smoke_vit()
        if weights is not None:
            model.load_state_dict(torch.load(SMOKE_WEIGHTS, map_location="cpu", weights_only=True))
            args.init = f"pretrained on printed digits, {SMOKE_WEIGHTS.parent.name}/{SMOKE_WEIGHTS.name}"
        return model
    if weights is None:
        return vit_b_16(weights=None)
    args.init = f"ImageNet-pretrained, {weights}"
    try:
        return vit_b_16(weights=weights)
    except (OSError, RuntimeError) as err:
        cache = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
        fail(f"the ImageNet weights {weights} could not be loaded ({getattr(err, 'reason', err)})."
             f" On a machine with internet, download {weights.url} and place it at {cache}.")


def fsdp_each_encoder_block(model, device_mesh):
    """FSDP2 for Fabric's ModelParallelStrategy: each ViT EncoderBlock its own unit, sharded across
    every process, then the root (embeddings, head). As Lightning's strategy="fsdp" with bf16-mixed,
    parameters are gathered in bfloat16 and gradients reduced in float32 (float32 throughout on a
    GPU without native bfloat16; run_keeping.py says so)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchvision.models.vision_transformer import EncoderBlock
    bf16 = device_mesh.device_type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, EncoderBlock):
            fully_shard(module, mesh=device_mesh["data_parallel"], mp_policy=policy)
    return fully_shard(model, mesh=device_mesh["data_parallel"], mp_policy=policy)


def tensor_parallel_mlps_then_fsdp(model, device_mesh):
    """10's parallelize function, as the talk's figure splits a matrix multiplication: in each
    EncoderBlock the MLP's first Linear split by columns and its second by rows across the
    tensor-parallel processes (each computes its share of the hidden units; one all-reduce joins
    the outputs), then FSDP2 across the data-parallel replicas as in 06. Attention stays whole:
    torchvision's MultiheadAttention packs q, k and v into one in_proj_weight, which a column
    split would cut across q, k and v instead of between heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchvision.models.vision_transformer import EncoderBlock
    for block in model.modules():
        if isinstance(block, EncoderBlock):  # block.mlp: Linear, GELU, Dropout, Linear, Dropout
            parallelize_module(block.mlp, device_mesh["tensor_parallel"],
                               {"0": ColwiseParallel(), "3": RowwiseParallel()})
    return fsdp_each_encoder_block(model, device_mesh)


# -- Evaluation -----------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, loader, device):
    """Accuracy (a fraction) over the loader; torchmetrics sums the counts of all processes."""
    model.eval()
    accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=NUM_CLASSES).to(device)
    for features, targets in loader:
        features, targets = features.to(device), targets.to(device)
        accuracy.update(torch.argmax(model(features), 1), targets)
    return accuracy.compute().item()
