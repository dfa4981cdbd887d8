"""What each technique buys, without the data set: runs the numbered scripts one after another
on synthetic data (--synthetic) and prints images/s, speedup over 01, peak memory and model FLOP
utilisation, then the rate of the talk's CIFAR-10 input pipeline beside it.

    python benchmark.py --smoke                         # small ViT, CPU, about two minutes
    python benchmark.py --batch-size 16 128             # ViT-B/16 at 224 on a GPU
    python benchmark.py --smoke --scripts 01 03 --repeat 5   # median of alternating runs

Each script run appends its own record (synthetic: true) to --results, so
`python plot_results.py --synthetic` charts them.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch.utils.data as torch_data

ROOT = Path(__file__).resolve().parent
SCRIPTS = {path.name[:2]: path.name for path in sorted(ROOT.glob("[0-9][0-9]_*.py"))}
PROG = "benchmark.py"
DTYPES = {"32-true": "float32", "bf16-mixed": "bfloat16", "16-mixed": "float16"}


def fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the small ViT at 32x32 (CPU)")
    parser.add_argument("--scripts", nargs="+", default=["01", "03", "04", "06"], metavar="NN",
                        help=f"scripts by number (default 01 03 04 06; known: {' '.join(SCRIPTS)})")
    parser.add_argument("--batch-size", nargs="+", type=int, default=None, metavar="N",
                        help="per process; several values run each script once per value "
                             "(default 16)")
    parser.add_argument("--max-steps", type=int, default=30, metavar="N",
                        help="training steps per run, the first 3 untimed (default 30)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the scripts N times, alternating, and report the median")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="processes for the Fabric scripts (default: 1; 2 for 06 with --smoke)")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--results", default="results/runs.jsonl", metavar="FILE",
                        help="where the scripts append their records (default results/runs.jsonl)")
    parser.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                        help="the device's peak TFLOP/s for MFU, where Lightning does not know it "
                             "(CPUs, new GPUs)")
    parser.add_argument("--loader-images", type=int, default=2000, metavar="N",
                        help="images for the input-pipeline rate (0 skips it; default 2000)")
    parser.add_argument("--loader-workers", nargs="+", type=int, default=[0, 1, 2, 4],
                        metavar="N", help="worker counts to time the loader with (default 0 1 2 4)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.scripts if s not in SCRIPTS]
    if unknown:
        parser.error(f"unknown script number(s) {' '.join(unknown)}; known: {' '.join(SCRIPTS)}")
    for name in ("max_steps", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_steps <= 3:
        parser.error("--max-steps must be more than the 3 untimed warm-up steps")
    if any(b < 1 for b in args.batch_size or []):
        parser.error("--batch-size must be at least 1")
    if args.loader_images < 0 or any(w < 0 for w in args.loader_workers):
        parser.error("--loader-images and --loader-workers must be 0 or more")
    return args


def flops_per_image(smoke):
    """Training FLOPs (forward and backward) per image of the model the scripts build, counted
    by Lightning's measure_flops on the meta device (no memory, no time)."""
    import torch
    from lightning.fabric.utilities.throughput import measure_flops
    from local_utilities import NUM_CLASSES, SMOKE_IMAGE_SIZE, TALK_IMAGE_SIZE, build_vit
    size = SMOKE_IMAGE_SIZE if smoke else TALK_IMAGE_SIZE
    with torch.device("meta"):
        model = build_vit(None, argparse.Namespace(smoke=smoke, synthetic=True))
        model.heads.head = torch.nn.Linear(model.hidden_dim, NUM_CLASSES)
        x = torch.randn(2, 3, size, size)
    return measure_flops(model, lambda: model(x), lambda y: y.sum()) / 2


def peak_flops(record, peak_tflops):
    """The device's peak FLOP/s for the record's precision: --peak-tflops, else Lightning's table
    (GPUs it knows); None where neither knows it."""
    if peak_tflops:
        return peak_tflops * 1e12
    if record["accelerator"] != "cuda":
        return None
    import torch
    from lightning.fabric.utilities.throughput import get_available_flops
    dtype = getattr(torch, DTYPES.get(record["precision"], "float32"))
    per_device = get_available_flops(torch.device("cuda"), dtype)
    return per_device * record["world_size"] if per_device else None


def run_one(script, batch_size, args):
    flags = ["--synthetic", "--max-steps", str(args.max_steps), "--results", args.results,
             "--accelerator", args.accelerator, "--checkpoint-dir",
             str(Path(args.results).parent / "benchmark-checkpoints" / script[:-3])]
    if args.smoke:
        flags.append("--smoke")
    if batch_size:
        flags += ["--batch-size", str(batch_size)]
    fabric = "fabric" in script
    devices = args.devices or (2 if args.smoke and "fsdp" in script else 1)
    if fabric:
        flags += ["--devices", str(devices)]
    before = _count_lines(args.results)
    print(f"running {script} {' '.join(flags)}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, str(ROOT / script), *flags], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
        fail(f"{script} failed (exit {proc.returncode}):\n{tail}")
    lines = Path(args.results).read_text().splitlines()[before:]
    return json.loads(lines[-1])


def _count_lines(path):
    try:
        return len(Path(path).read_text().splitlines())
    except FileNotFoundError:
        return 0


class Cifar10Shaped(torch_data.Dataset):
    """What torchvision's CIFAR10 does per image: a stored 32x32x3 uint8 array to a PIL image,
    then the transform. Random pixels, made once, so no download and no generation is timed."""

    def __init__(self, num_images, transform):
        import numpy as np
        self.images = np.random.RandomState(0).randint(0, 256, (num_images, 32, 32, 3), "uint8")
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        from PIL import Image
        return self.transform(Image.fromarray(self.images[index])), 0


def loader_rates(num_images, workers, batch_size=16):
    """Images/s of the talk's input pipeline (PIL Resize to 224, ToTensor) on images of
    CIFAR-10's shape; timed after the first batch (worker start-up excluded)."""
    from local_utilities import talk_transforms
    dataset = Cifar10Shaped(num_images, talk_transforms())
    rates = {}
    for w in workers:
        loader = torch_data.DataLoader(dataset, batch_size=batch_size, num_workers=w)
        iterator = iter(loader)
        next(iterator)
        start, seen = time.perf_counter(), 0
        for features, _ in iterator:
            seen += len(features)
        rates[w] = seen / (time.perf_counter() - start) if seen else None
    return rates


def table(rows, flops, args):
    lines = [f"{'script':<34} {'batch':>5} {'precision':>10} {'devices':>7} {'images/s':>9} "
             f"{'vs 01':>6} {'memory GB':>9} {'MFU':>6}"]
    base = {r["batch_size"]: r["images_per_s"] for r in rows if r["script"].startswith("01")}
    for r in rows:
        peak = peak_flops(r, args.peak_tflops)
        mfu = f"{r['images_per_s'] * flops / peak * 100:.1f}%" if peak else "n/a"
        speedup = (f"{r['images_per_s'] / base[r['batch_size']]:.2f}x"
                   if base.get(r["batch_size"]) else "-")
        lines.append(f"{r['script']:<34} {r['batch_size']:>5} {r['precision']:>10} "
                     f"{r['world_size']:>7} {r['images_per_s']:>9.1f} {speedup:>6} "
                     f"{r['peak_memory_gb']:>9.2f} {mfu:>6}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    scripts = [SCRIPTS[s] for s in args.scripts]
    flops = flops_per_image(args.smoke)
    runs = {}  # (script, batch) -> [records]
    for _ in range(args.repeat):  # alternating, so drift on the machine hits every script alike
        for batch in args.batch_size or [None]:
            for script in scripts:
                runs.setdefault((script, batch), []).append(run_one(script, batch, args))
    rows = []
    for records in runs.values():
        row = dict(records[-1])
        row["images_per_s"] = statistics.median(r["images_per_s"] for r in records)
        row["peak_memory_gb"] = max(r["peak_memory_gb"] for r in records)
        rows.append(row)
    first = rows[0]
    size = "32x32 smoke ViT" if args.smoke else "ViT-B/16 at 224x224"
    print(f"\nSynthetic-data training throughput: {size}, {args.max_steps} steps per run "
          f"(3 untimed), median of {args.repeat}, on {first['device_name']}, "
          f"torch {first['torch']}, lightning {first['lightning']}")
    print(f"Model FLOPs per training image: {flops / 1e9:.3f} GFLOP "
          "(Lightning's measure_flops, forward + backward)")
    print(table(rows, flops, args))
    if args.loader_images:
        rates = loader_rates(args.loader_images, args.loader_workers)
        print(f"\nThe talk's CIFAR-10 input pipeline (PIL Resize to 224 + ToTensor), "
              f"{args.loader_images} images of 32x32:")
        for workers, rate in rates.items():
            print(f"  {workers} workers: {rate:8.1f} images/s" if rate else
                  f"  {workers} workers: too few images to time")
        fastest = max(r["images_per_s"] for r in rows)
        print(f"  fastest training rate above: {fastest:.1f} images/s"
              + (" (the smoke model does not use this pipeline)" if args.smoke else ""))
    print(f"\nRecords appended to {args.results} (plot with: python plot_results.py "
          f"--synthetic --results {args.results})")


if __name__ == "__main__":
    main()
