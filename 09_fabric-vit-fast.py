"""09, the fast recipe (not in the talk): the talk's finetune (ViT-B/16 from the same ImageNet
weights, CIFAR-10 at 224x224, the same split and test set) as one would write it today for one
GPU: batch 128 with AdamW, a warm-up and a cosine decay, the data decoded once and resized on
the device, torch.compile and the fused AdamW on a GPU. Each change, why, and what was measured:
docs/fast-recipe.md.

    python 09_fabric-vit-fast.py            # one GPU; downloads CIFAR-10 and the weights
    python 09_fabric-vit-fast.py --smoke    # the offline demo on a CPU (digits, small ViT)

Measured: --smoke only, on the CPU (docs/fast-recipe.md); no GPU figure yet.
"""
import math
import time

import lightning as L
import torch
import torch.nn.functional as F
from watermark import watermark

from local_utilities import NUM_CLASSES
from local_utilities import SMOKE_IMAGE_SIZE
from local_utilities import TALK_IMAGE_SIZE
from local_utilities import build_vit
from local_utilities import cifar10_datasets
from local_utilities import digits_datasets
from local_utilities import evaluate
from local_utilities import lesson_parser
from run_keeping.keeper import RunKeeper

WARMUP_FRACTION = 0.05
# The peak learning rate at the talk's batch of 16, scaled by the square root of the batch: the
# talk's 5e-5 for ViT-B/16 on CIFAR-10; for the small smoke ViT on the digits, 12 times that,
# chosen on the validation split (docs/fast-recipe.md).
PEAK_LR = {"full": 5e-5, "smoke": 6e-4}
PRINT_EVERY = 100


def uint8_splits(args):
    """{split: (uint8 images N x 3 x 32 x 32, labels)} on the CPU: CIFAR-10 decoded once, the
    digits, or random images."""
    if args.smoke:
        parts = [d.tensors for d in digits_datasets()]
        return {name: ((x * 255).round().to(torch.uint8), y)
                for name, (x, y) in zip(("train", "val", "test"), parts)}
    if args.synthetic:
        g = torch.Generator().manual_seed(args.seed)
        step = args.batch_size * args.world_size
        return {name: (torch.randint(0, 256, (size, 3, 32, 32), generator=g, dtype=torch.uint8),
                       torch.randint(0, NUM_CLASSES, (size,), generator=g))
                for name, size in (("train", args.max_steps * step), ("val", step), ("test", step))}
    train, val, test = cifar10_datasets(args.data_dir, download=not args.no_download)
    images = torch.from_numpy(train.dataset.data).permute(0, 3, 1, 2)  # N x 32 x 32 x 3 on disk
    labels = torch.tensor(train.dataset.targets)
    splits = {"train": train.indices, "val": val.indices}
    splits = {name: (images[list(i)], labels[list(i)]) for name, i in splits.items()}
    splits["test"] = (torch.from_numpy(test.data).permute(0, 3, 1, 2), torch.tensor(test.targets))
    if args.max_steps:
        n = args.max_steps * args.batch_size * args.world_size
        train_images, train_labels = splits["train"]
        splits["train"] = (train_images[:n], train_labels[:n])
    return splits


def resize_on_device(images, size):
    """The talk's transform on a batch already on the device: uint8 N x 3 x 32 x 32 to floats in
    [0, 1], bilinear to size x size; within 1/255 of Resize + ToTensor (PIL rounds)."""
    images = images.float().div_(255)
    if images.shape[-1] == size:
        return images
    return torch.nn.functional.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)


class DeviceData:
    """One split held on the device as uint8; each batch is indexed and resized there. Training
    batches are a fresh permutation each epoch (seeded by seed and epoch, so --resume repeats
    it), shared out among the processes; evaluation batches keep the order."""

    def __init__(self, split, fabric, batch_size, size, train, seed):
        self.images, self.labels = (t.to(fabric.device) for t in split)
        self.fabric, self.batch_size, self.size, self.train, self.seed = fabric, batch_size, size, train, seed
        share = len(self.labels) // fabric.world_size if train else None
        self.num_batches = share // batch_size if train else math.ceil(
            len(range(fabric.global_rank, len(self.labels), fabric.world_size)) / batch_size)

    def __len__(self):
        return self.num_batches

    def epoch(self, number):
        if self.train:
            order = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(self.seed + number))
        else:
            order = torch.arange(len(self.labels))
        mine = order[self.fabric.global_rank::self.fabric.world_size].to(self.images.device)
        for i in range(self.num_batches):
            index = mine[i * self.batch_size:(i + 1) * self.batch_size]
            yield resize_on_device(self.images[index], self.size), self.labels[index]

    def __iter__(self):  # evaluation
        return self.epoch(0)


def warmup_then_cosine(total_steps):
    warmup = max(1, int(WARMUP_FRACTION * total_steps))
    return lambda step: (step + 1) / warmup if step < warmup else \
        0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))


def train(num_epochs, model, optimizer, scheduler, train_data, val_data, fabric, keeper):
    start = time.time()
    for epoch in range(keeper.start_epoch, num_epochs):
        model.train()
        for batch_idx, (features, targets) in enumerate(train_data.epoch(epoch)):
            logits = model(features)
            loss = F.cross_entropy(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
            scheduler.step()
            keeper.batch_done(loss, len(targets))  # no GPU sync: the loss guard reads every 300 steps
            if not batch_idx % PRINT_EVERY:
                fabric.print(f"Epoch: {epoch+1:04d}/{num_epochs:04d} | Batch {batch_idx:04d}/{len(train_data):04d} | Loss: {loss:.4f}")
        val_acc = evaluate(model, val_data, fabric.device)
        fabric.print(f"Epoch: {epoch+1:04d}/{num_epochs:04d} | Val acc.: {val_acc*100:.2f}%")
        keeper.checkpoint(val_acc)
    return time.time() - start


def parse_flags():
    parser = lesson_parser(epochs=3, devices=1, batch_size=128, num_workers_flag=False)
    parser.add_argument("--compile-on-cpu", action="store_true", help="on a CPU too, take the path a GPU takes: "
                        "torch.compile and the fused AdamW")
    return parser.parse_args()


def make_optimizer(model, args, fused):
    """AdamW at the peak learning rate scaled by the square root of the global batch."""
    lr = PEAK_LR["smoke" if args.smoke else "full"] * math.sqrt(args.batch_size * args.world_size / 16)
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)


if __name__ == "__main__":
    args = parse_flags()
    with RunKeeper(args) as keeper:  # owns what the run changes in this process and undoes it: run_keeping/keeper.py
        fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                          precision="bf16-mixed", strategy="ddp" if args.world_size > 1 else "auto")
        fabric.launch()
        keeper.start(fabric)
        fabric.print(watermark(packages="torch,torchvision,lightning", python=True))
        torch.manual_seed(args.seed)

        # 1 The data, on the device
        with fabric.rank_zero_first(local=True):
            splits = uint8_splits(args)
        size = SMOKE_IMAGE_SIZE if args.smoke else TALK_IMAGE_SIZE
        eval_batch = 120 if args.smoke else 250  # divides the splits: no odd last batch to compile
        train_data = DeviceData(splits["train"], fabric, args.batch_size, size, True, args.seed)
        val_data = DeviceData(splits["val"], fabric, eval_batch, size, False, args.seed)
        test_data = DeviceData(splits["test"], fabric, eval_batch, size, False, args.seed)

        # 2 The model, optimizer and schedule
        model = build_vit(weights="IMAGENET1K_V1", args=args)
        model.heads.head = torch.nn.Linear(in_features=model.hidden_dim, out_features=10)
        gpu_path = fabric.device.type == "cuda" or args.compile_on_cpu
        if gpu_path:  # before setup, as Fabric's docs ask: setup compiles again around DDP's wrapper
            model = torch.compile(model)
        model = fabric.setup_module(model)
        optimizer = make_optimizer(model, args, fused=gpu_path)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine(args.epochs * len(train_data)))
        optimizer = fabric.setup_optimizers(optimizer)

        # 3 Finetuning, 4 evaluation
        keeper.keep_in_checkpoints(scheduler)
        keeper.before_training(model, optimizer, train_data)
        train_time = train(args.epochs, model, optimizer, scheduler, train_data, val_data, fabric, keeper)
        test_acc = evaluate(model, test_data, fabric.device)
        keeper.finish(train_time, test_acc, model)
