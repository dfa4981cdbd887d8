"""Code the numbered scripts share, like the talk's helper module: the data (CIFAR-10 as in the talk, plus the offline
--smoke and --synthetic stand-ins), the model and evaluation. The sharded lessons' own functions: parallelize.py."""

import os
import shutil
from pathlib import Path

import numpy as np
import torch
import torchmetrics
import torchvision.models as vits
from torch.utils.data import DataLoader, Subset, TensorDataset
from torchvision import transforms
from torchvision.datasets import CIFAR10
from torchvision.models.vision_transformer import VisionTransformer

from run_keeping.config import LessonParser, fail

NUM_CLASSES = 10
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
TALK_IMAGE_SIZE = 224
NUM_VALIDATION = 5000  # the last 5,000 of CIFAR-10's 50,000 training images
SMOKE_IMAGE_SIZE = 32
SMOKE_SPLIT = (240, 360)  # of scikit-learn's 1,797 digits, held out for validation and test
SMOKE_TRAIN = 1797 - sum(SMOKE_SPLIT)  # 1,197 digits to train on
SMOKE_WEIGHTS = Path(__file__).with_name("smoke_weights") / "smoke-vit-printed-digits.pt"


def lesson_parser(epochs, devices=None, batch_size=16, num_workers_flag=True, check=None):
    """A config.LessonParser with the shared flags (see its docstring), checking batches against these data's sizes."""
    images = {"full": 50000 - NUM_VALIDATION, "smoke": SMOKE_TRAIN}
    return LessonParser(epochs, devices, batch_size, num_workers_flag, train_images=images, check=check)


def talk_transforms():
    """The talk's transform for every split: resize to 224x224, to a tensor in [0, 1]."""
    return transforms.Compose([transforms.Resize((TALK_IMAGE_SIZE, TALK_IMAGE_SIZE)), transforms.ToTensor()])


def get_dataloaders(args):
    """(train, val, test) loaders of CIFAR-10 as in the talk, the --smoke digits or --synthetic data. --max-steps N
    keeps N batches per replica; the loaders hand out each batch in args.micro_batches parts (gradient accumulation)."""
    if args.synthetic:  # on a GPU, made on this process's own (Fabric's launch made it current)
        gpu = torch.device("cuda", torch.cuda.current_device()) if args.accelerator == "cuda" else None
        train, val, test = synthetic_datasets(args, gpu)
    elif args.smoke:
        train, val, test = digits_datasets()
    else:
        train, val, test = cifar10_datasets(args.data_dir, download=not args.no_download)
    if args.max_steps:
        train = Subset(train, range(min(len(train), args.max_steps * args.batch_size * args.data_parallel)))
    workers = 0 if args.smoke or args.synthetic else args.num_workers  # their data are already in memory
    batch = args.batch_size // args.micro_batches
    train_loader = DataLoader(train, batch_size=batch, shuffle=True, drop_last=True, num_workers=workers)
    val_loader = DataLoader(val, batch_size=batch, num_workers=workers)
    return train_loader, val_loader, DataLoader(test, batch_size=batch, num_workers=workers)


def cifar10_datasets(data_dir, download=True):
    """torchvision's CIFAR10 in data_dir, the talk's transform: 45,000 train / last 5,000 validation / 10,000 test."""
    where = os.path.abspath(data_dir)
    created = [p for p in [Path(where), *Path(where).parents] if not p.exists()]
    try:
        train_full = CIFAR10(root=data_dir, train=True, transform=talk_transforms(), download=download)
        test = CIFAR10(root=data_dir, train=False, transform=talk_transforms(), download=download)
    except RuntimeError:  # torchvision: "Dataset not found or corrupted", "File not found or corrupted."
        if download:
            fail(f"CIFAR-10 in {where} is damaged: remove it, then run again to download {CIFAR10_URL}.")
        missing = f"CIFAR-10 is not in {where} (no complete cifar-10-batches-py folder), and --no-download was given"
        fail(f"{missing}. Download {CIFAR10_URL}, unpack it there, or drop --no-download.")
    except OSError as err:  # no network: URLError, connection refused, DNS failure, full disk
        if created:  # remove the topmost folder this run made, with the partial download in it
            shutil.rmtree(created[-1], ignore_errors=True)
        why = getattr(err, "reason", None) or err.strerror or err
        fetch = f"On a machine with internet, download {CIFAR10_URL} and unpack it into {where}"
        fail(f"CIFAR-10 is not in {where} and could not be downloaded ({why}). {fetch}.")
    num_train = len(train_full) - NUM_VALIDATION * len(train_full) // 50000  # 5,000; a tenth of a test's copy
    return (Subset(train_full, range(num_train)), Subset(train_full, range(num_train, len(train_full))), test)


def digits_datasets():
    """The --smoke data: scikit-learn's 1,797 8x8 digits as 32x32 RGB in [0, 1], split the same way whatever --seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = torch.nn.functional.interpolate(images, size=(SMOKE_IMAGE_SIZE,) * 2, mode="bilinear", align_corners=False)
    order = torch.from_numpy(np.random.RandomState(0).permutation(len(images)))
    images = images.clamp(0, 1).repeat(1, 3, 1, 1)[order]
    labels = torch.tensor(digits.target, dtype=torch.long)[order]
    cuts = [SMOKE_TRAIN, SMOKE_TRAIN + SMOKE_SPLIT[0]]
    return tuple(TensorDataset(x, y) for x, y in zip(images.tensor_split(cuts), labels.tensor_split(cuts)))


def synthetic_datasets(args, device=None):
    """Random images and labels: --max-steps batches per process to train on, one image per process to
    evaluate. With a `device` (a GPU), one step's images are made there and reused, so no batch is
    collated in the CPU's memory and copied over: images/s then measures the model, not the loader."""
    size = SMOKE_IMAGE_SIZE if args.smoke else TALK_IMAGE_SIZE
    g = torch.Generator().manual_seed(args.seed)
    per_step = args.batch_size * args.data_parallel

    def make(n, held):  # n items, cycling through `held` random ones
        images = torch.rand(held, 3, size, size, generator=g).to(device or "cpu")
        labels = torch.randint(0, NUM_CLASSES, (held,), generator=g).to(device or "cpu")
        return Subset(TensorDataset(images, labels), [i % held for i in range(n)])

    train_images = args.max_steps * per_step
    held = train_images if device is None else per_step  # on a GPU, one step's, cycled through
    each = args.data_parallel  # to evaluate: one image a process
    return make(train_images, held), make(each, each), make(each, each)


def smoke_vit():
    """The --smoke model: a small ViT that cuts 32x32 images into 16 patches of 8x8 (with 4 patches of 16x16, random
    init read the digits almost as well as pretrained: docs/smoke.md), with a 10-class head for the digits."""
    size = SMOKE_IMAGE_SIZE
    return VisionTransformer(size, 8, num_layers=3, num_heads=4, hidden_dim=128, mlp_dim=256, num_classes=NUM_CLASSES)


def build_vit(weights, args):
    """torchvision's vit_b_16 (or --vit's model) with weights=None or "IMAGENET1K_V1". --smoke: the small ViT,
    pretrained on printed digits (make_smoke_weights.py, the demo's stand-in for ImageNet) where a full run loads
    IMAGENET1K_V1. --synthetic: always random init. model.init is set to a note of what the model starts from."""
    vit = getattr(args, "vit", "vit_b_16")  # vit_l_16: the memory sequel's; a tool's Namespace may have no vit
    pretrained = weights is not None and not args.synthetic  # --smoke: SMOKE_WEIGHTS in place of ImageNet's
    init = "random init"
    if args.smoke:
        model = smoke_vit()
        if pretrained:
            model.load_state_dict(torch.load(SMOKE_WEIGHTS, map_location="cpu", weights_only=True))
            init = f"pretrained on printed digits, {SMOKE_WEIGHTS.parent.name}/{SMOKE_WEIGHTS.name}"
    elif not pretrained:
        model = vits.get_model(vit, weights=None)
    else:
        weights = vits.get_model_weights(vit).verify(weights)  # the weights' enum, which has their url
        try:  # from torch's hub cache, or downloaded
            model = vits.get_model(vit, weights=weights)
            init = f"ImageNet-pretrained, {weights}"
        except (OSError, RuntimeError) as err:
            cache = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
            fetch = f"On a machine with internet, download {weights.url} and place it at {cache}"
            fail(f"the ImageNet weights {weights} could not be loaded ({getattr(err, 'reason', err)}). {fetch}.")
    setattr(model, "init", init)  # a note beside torchvision's attributes (setattr: the type checker knows no init)
    return model


@torch.no_grad()
def evaluate(model, loader, device):
    """The model's accuracy (a fraction) over the loader; torchmetrics sums the counts over all processes."""
    model.eval()
    accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=NUM_CLASSES).to(device)
    for features, targets in loader:
        accuracy.update(torch.argmax(model(features.to(device)), 1), targets.to(device))
    return accuracy.compute().item()
