"""What each technique buys, without the data set: runs the numbered scripts on synthetic data
(--synthetic), one after another, beside a bare loop of the same model, precision, strategy and
batch, and prints images/s, the speedup over 01, the ratio to the bare loop, peak memory and
model FLOP utilisation (MFU), then the rate of the talk's CIFAR-10 input pipeline.

    python benchmark.py --smoke                              # small ViT, CPU
    python benchmark.py --scripts 01 02 03 04 01@128 04@128  # ViT-B/16 at 224 on a GPU
    python benchmark.py --smoke --scripts 01 03 --repeat 5   # median of alternating runs
    python benchmark.py --peaks                              # the peak FLOP/s table used for MFU
    python benchmark.py --memory     # memory per process as the model grows: 1 process, DDP,
                                     # FSDP2, TP; ViT-B/16 and ViT-L/16 (docs/benchmarks.md)

Speedup, here and in plot_results.py, is training throughput over 01's: images/s divided by 01's
images/s at the same batch. "vs bare" is the script's images/s divided by the bare loop's, which
has nothing in its loop but forward, loss, zero_grad, backward and step on one batch held on the
device: what the harness and the data loader cost. Each script run appends its record
(synthetic: true) to --results, so `python plot_results.py --synthetic` charts them.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.utils.data as torch_data

from benchmark_memory import (MEMORY_MODELS, SCRIPTS, VIT_OF, make_strategy, memory_report, memory_run,
                              process_range, talk_memory)
from plot_results import fmt
from run_keeping.errors import fail, leave
from run_keeping.files import remove_empty_folders
from run_keeping.timing import WARMUP_STEPS

ROOT = Path(__file__).resolve().parent
# Dense peak TFLOP/s (no sparsity) from NVIDIA's data sheets: A100 (2020; SXM and PCIe alike),
# H100 SXM and PCIe (H100 data sheet, 2023), H100 NVL and H200 SXM / NVL (H200 data sheet, 2024),
# whose tensor-core figures are printed "with sparsity" and are halved here. Lightning's table
# holds the with-sparsity H200 figures and matches only names with "sxm1"/"nvl1" in them, so it
# is used only for other GPUs. "fp32" is what 32-true runs on: no script switches TF32 on.
# Matched on the name CUDA reports, first match wins ("NVIDIA H100 80GB HBM3" is the SXM card).
PEAKS = [  # (name contains, {"fp32", "tf32", "bf16"} TFLOP/s)
    ("H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5}),
    ("H200", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5}),
    ("H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5}),
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0}),
    ("H100", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0}),
]
UNIT = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "bf16"}  # fp16 = bf16 on these


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the small ViT at 32x32 (CPU)")
    parser.add_argument("--scripts", nargs="+", default=None, metavar="NN[@B]",
                        help="scripts by number, @B for another batch (default: every one that "
                        "trains but 00, which is 01 from random init; --memory --talk: 01-07 and "
                        "10; --sequel: 04 and 11-15)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N",
                        help="per process, where NN@B does not say (default 16; 09: 128)")
    parser.add_argument("--max-steps", type=int, default=30, metavar="N",
                        help="training steps per run, the first 3 untimed (default 30)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the scripts N times, alternating, and report the median")
    parser.add_argument("--devices", type=int, default=1, metavar="N",
                        help="processes for 05-07 (default 1: DDP and FSDP2 still run) and 10 "
                             "(at least its 2 tensor-parallel processes)")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--results", default="results/benchmark.jsonl", metavar="FILE",
                        help="where the scripts append their records")
    parser.add_argument("--report", metavar="FILE", help="also write the report as Markdown")
    parser.add_argument("--peak-tflops", nargs="+", default=[], metavar="PRECISION=T",
                        help="the device's peak TFLOP/s per precision for MFU, e.g. "
                             "32-true=67 bf16-mixed=989 (default: the table, see --peaks)")
    parser.add_argument("--peaks", action="store_true", help="print the peak table and exit")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare-loop rows")
    parser.add_argument("--loader-images", type=int, default=2000, metavar="N",
                        help="images for the input-pipeline rate (0 skips it; default 2000)")
    parser.add_argument("--loader-workers", nargs="+", type=int, default=[0, 1, 2, 4],
                        metavar="N", help="worker counts to time the loader with (default 0 1 2 4)")
    parser.add_argument("--memory", action="store_true", help="memory per process by model "
                        "and strategy (synthetic steps), beside the arithmetic; a chart too")
    parser.add_argument("--memory-models", nargs="+", default=None,
                        choices=list(MEMORY_MODELS), metavar="MODEL",
                        help="for --memory (default: ViT-B/16 ViT-L/16, 1 min 52 s on a 2-core "
                             "AMD EPYC, 2026-12-01; ViT-H/14 took 2 min 3 s more; --talk: "
                             "ViT-B/16; --sequel: ViT-B/16 ViT-L/16)")
    parser.add_argument("--talk", action="store_true", help="with --memory: the talk's memory "
                        "column, each script as it is at 224x224, batch 16 (docs/benchmarks.md)")
    parser.add_argument("--sequel", action="store_true", help="with --memory: the memory "
                        "sequel's chain, 04 and 11-15, on ViT-B/16 and ViT-L/16")
    parser.add_argument("--bare-loop", nargs=6, help=argparse.SUPPRESS)  # internal: one bare run
    parser.add_argument("--memory-run", nargs="+", help=argparse.SUPPRESS)  # internal
    args = parser.parse_args(argv)
    if (args.talk or args.sequel) and not args.memory:
        parser.error("--talk and --sequel go with --memory")
    args.memory_models_given = args.memory_models is not None
    args.memory_models = args.memory_models or ["ViT-B/16", "ViT-L/16"]
    if args.talk or args.sequel:
        if any(m not in VIT_OF for m in args.memory_models):
            parser.error(f"--memory --talk builds the scripts' own models: {' '.join(VIT_OF)}")
        if any(spec not in SCRIPTS for spec in args.scripts or []):
            parser.error(f"--memory --talk runs scripts by number at batch 16; known: {' '.join(SCRIPTS)}")
    args.memory_scripts = args.scripts if args.talk or args.sequel else None
    args.scripts = args.scripts or [n for n in SCRIPTS if n != "00"]
    args.runs = []
    for spec in args.scripts:
        number, _, batch = spec.partition("@")
        if number not in SCRIPTS or (batch and not batch.isdigit()):
            parser.error(f"unknown script {spec}; known: {' '.join(SCRIPTS)} (NN or NN@BATCH)")
        default = 128 if number == "09" else 16  # 09's recipe is batch 128
        args.runs.append((SCRIPTS[number], int(batch) if batch else args.batch_size or default))
    for name in ("max_steps", "repeat", "devices"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_steps <= WARMUP_STEPS:
        parser.error("--max-steps must be more than the 3 untimed warm-up steps")
    try:
        args.peak_tflops = {k: float(v) for k, v in (p.split("=", 1) for p in args.peak_tflops)}
    except ValueError:
        parser.error("--peak-tflops takes PRECISION=TFLOPS, e.g. 32-true=67 bf16-mixed=989")
    if args.loader_images < 0 or any(w < 0 for w in args.loader_workers):
        parser.error("--loader-images and --loader-workers must be 0 or more")
    return args


def peak_tflops(device_name, precision, given=None):
    """Dense peak TFLOP/s of one device for a precision: --peak-tflops, else the table above,
    else Lightning's table (other GPUs); None where nobody knows (CPUs)."""
    if given and precision in given:
        return given[precision]
    for part, peaks in PEAKS:
        if part.lower() in device_name.lower():
            return peaks[UNIT[precision]]
    if not torch.cuda.is_available():
        return None
    from lightning.fabric.utilities.throughput import get_available_flops
    dtype = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16}.get(precision, torch.float16)
    flops = get_available_flops(torch.device("cuda"), dtype)
    return flops / 1e12 if flops else None


def flops_per_image(smoke):
    """Training FLOPs (forward and backward) per image of the scripts' model, counted by
    Lightning's measure_flops on the meta device (no memory, no time)."""
    from lightning.fabric.utilities.throughput import measure_flops
    from local_utilities import NUM_CLASSES, SMOKE_IMAGE_SIZE, TALK_IMAGE_SIZE, build_vit
    size = SMOKE_IMAGE_SIZE if smoke else TALK_IMAGE_SIZE
    with torch.device("meta"):
        model = build_vit(None, argparse.Namespace(smoke=smoke, synthetic=True))
        model.heads.head = torch.nn.Linear(model.hidden_dim, NUM_CLASSES)
        x = torch.randn(2, 3, size, size)
    return measure_flops(model, lambda: model(x), lambda y: y.sum()) / 2


def common_flags(args):
    return ["--accelerator", args.accelerator] + (["--smoke"] if args.smoke else [])


def run_script(script, batch, args):
    flags = ["--synthetic", "--max-steps", str(args.max_steps), "--batch-size", str(batch),
             "--results", args.results, "--save-model", str(Path(args.results).parent /
             "benchmark-models" / f"{script[:-3]}.pt"), "--checkpoint-dir",
             str(Path(args.results).parent / "benchmark-checkpoints" / script[:-3]),
             *common_flags(args)]
    takes, least = process_range(script)
    if takes:  # 05-07, 10, 15; 10's tensor parallelism needs its 2 processes
        flags += ["--devices", str(max(least, args.devices))]
    before = len(read_lines(args.results))
    print(f"running {script} {' '.join(flags)}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, str(ROOT / script), *flags], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
        fail(f"{script} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(read_lines(args.results)[before:][-1])


def read_lines(path):
    try:
        return Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []


def run_bare(record, args):
    """The bare loop in a process of its own, as the script's record says it ran."""
    spec = [record["precision"], record["strategy"], str(record["world_size"]),
            str(record.get("tensor_parallel_size") or 1), str(record["batch_size"]),
            str(args.max_steps)]
    print(f"running the bare loop {' '.join(spec)}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--bare-loop", *spec,
                           *common_flags(args)], capture_output=True, text=True)
    found = [line for line in proc.stdout.splitlines() if line.startswith("BARE ")]
    if proc.returncode != 0 or not found:
        fail(f"the bare loop failed (exit {proc.returncode}):\n{proc.stderr[-1500:]}")
    return json.loads(found[-1][5:])


def bare_loop(args):
    """Nothing but forward, loss, zero_grad, backward and step, on one batch of random images
    held on the device; timed after 3 steps, with one synchronisation at each end."""
    import lightning as L
    import torch.nn.functional as F
    from run_keeping.devices import share_cpu_threads
    from run_keeping.record import peak_memory_gb
    from local_utilities import SMOKE_IMAGE_SIZE, TALK_IMAGE_SIZE, build_vit
    precision, strategy, devices, tensor_parallel, batch, steps = args.bare_loop
    devices, tensor_parallel, batch, steps = int(devices), int(tensor_parallel), int(batch), int(steps)
    strategy = make_strategy(strategy, devices, tensor_parallel)
    accelerator = "cpu" if args.smoke else args.accelerator
    fabric = L.Fabric(accelerator=accelerator, devices=devices, precision=precision, strategy=strategy)
    fabric.launch()
    if fabric.device.type == "cpu":
        share_cpu_threads(devices)  # as the scripts' processes do (run_keeping/devices.py)
    torch.manual_seed(123)
    model = build_vit(None, argparse.Namespace(smoke=args.smoke, synthetic=True))
    model.heads.head = torch.nn.Linear(model.hidden_dim, 10)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=5e-5))
    size = SMOKE_IMAGE_SIZE if args.smoke else TALK_IMAGE_SIZE
    features = torch.rand(batch, 3, size, size, device=fabric.device)
    targets = torch.randint(0, 10, (batch,), device=fabric.device)
    cuda = fabric.device.type == "cuda"
    for step in range(steps):
        if step == WARMUP_STEPS:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        loss = F.cross_entropy(model(features), targets)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = fabric.all_reduce(torch.tensor(time.perf_counter() - start), reduce_op="max")
    images = (steps - WARMUP_STEPS) * batch * fabric.world_size // tensor_parallel
    memory = fabric.all_reduce(torch.tensor(peak_memory_gb("cuda" if cuda else "cpu")), reduce_op="max")
    fabric.print("BARE " + json.dumps({"images_per_s": images / float(seconds),
                                        "peak_memory_gb": float(memory)}))
    fabric.barrier()
    leave(0)  # run_keeping/errors.py: why a multi-process run ends so


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
        iterator = iter(torch_data.DataLoader(dataset, batch_size=batch_size, num_workers=w))
        next(iterator)
        start, seen = time.perf_counter(), 0
        for features, _ in iterator:
            seen += len(features)
        rates[w] = seen / (time.perf_counter() - start) if seen else None
    return rates


def resize_rate(num_images, device, batch_size=128):
    """Images/s of 09's input pipeline: uint8 images already on the device, indexed, turned to
    floats and resized to 224 there (local_utilities.resize_on_device)."""
    from local_utilities import resize_on_device
    images = torch.randint(0, 256, (num_images, 3, 32, 32), dtype=torch.uint8, device=device)
    resize_on_device(images[:batch_size])  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, num_images, batch_size):
        resize_on_device(images[i:i + batch_size])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return num_images / (time.perf_counter() - start)


def rows_of(runs, bares, flops, args):
    rows = []
    base = {r["batch_size"]: r["images_per_s"] for r in runs if r["script"].startswith("01")}
    for r in runs:
        bare = bares.get(bare_key(r))
        peak = peak_tflops(r["device_name"], r["precision"], args.peak_tflops)
        rows.append({
            "script": r["script"], "batch": r["batch_size"], "precision": r["precision"],
            "strategy": r["strategy"], "devices": r["world_size"], "images_per_s": r["images_per_s"],
            "vs_01": r["images_per_s"] / base[r["batch_size"]] if base.get(r["batch_size"]) else None,
            "vs_bare": r["images_per_s"] / bare["images_per_s"] if bare else None,
            "memory_gb": r["peak_memory_gb"],
            "mfu": r["images_per_s"] * flops / (peak * 1e12 * r["world_size"]) if peak else None})
        if bare:
            rows.append({"script": "bare loop", "batch": r["batch_size"], "precision": r["precision"],
                         "strategy": r["strategy"], "devices": r["world_size"],
                         "images_per_s": bare["images_per_s"], "vs_01": None, "vs_bare": 1.0,
                         "memory_gb": bare["peak_memory_gb"],
                         "mfu": bare["images_per_s"] * flops / (peak * 1e12 * r["world_size"]) if peak else None})
    seen, unique = set(), []
    for row in rows:  # one bare row per configuration, after the first script that uses it
        key = (row["script"], row["batch"], row["precision"], row["strategy"], row["devices"])
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique


def bare_key(record):
    return (record["precision"], record["strategy"], record["world_size"],
            record.get("tensor_parallel_size") or 1, record["batch_size"])


def markdown_table(rows):
    lines = ["| script | batch | precision | strategy | devices | images/s | vs 01 | vs bare | "
             "peak memory GB | MFU |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['script']} | {r['batch']} | {r['precision']} | {r['strategy']} | "
                     f"{r['devices']} | {r['images_per_s']:.1f} | {fmt(r['vs_01'], '{:.2f}x')} | "
                     f"{fmt(r['vs_bare'], '{:.2f}')} | {r['memory_gb']:.2f} | "
                     f"{fmt(r['mfu'] and r['mfu'] * 100, '{:.1f}%')} |")
    return lines


def talk_comparison(rows, reference):
    """Ours beside the talk's, where comparable without the data set: batch 16, one device."""
    ours = {r["script"][:2]: r for r in rows if r["script"][:2].isdigit() and r["batch"] == 16
            and r["devices"] == 1}
    talk01 = reference["01_pytorch-vit.py"]["time_min"]
    lines = ["| script | speedup over 01 (ours, images/s) | talk (training time) | "
             "peak memory GB (ours) | talk |", "|---|---|---|---|---|"]
    for number in ("01", "02", "03", "04"):
        if number in ours:
            talk = reference[SCRIPTS[number]]
            lines.append(f"| {SCRIPTS[number]} | {fmt(ours[number]['vs_01'], '{:.2f}x')} | "
                         f"{talk01 / talk['time_min']:.2f}x | {ours[number]['memory_gb']:.2f} | "
                         f"{talk['memory_gb']:.2f} |")
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.bare_loop:
        return bare_loop(args)
    if args.memory_run:
        return memory_run(args)
    if args.memory and (args.talk or args.sequel):
        return talk_memory(args)
    if args.memory:
        return memory_report(args)
    if args.peaks:
        print("Dense peak TFLOP/s used for MFU (NVIDIA data sheets, sparsity figures halved):")
        print(f"{'name contains':<14} {'FP32':>6} {'TF32':>7} {'BF16/FP16':>10}")
        for part, p in PEAKS:
            print(f"{part:<14} {p['fp32']:>6.1f} {p['tf32']:>7.1f} {p['bf16']:>10.1f}")
        print("32-true uses FP32 (no script switches TF32 on); bf16-mixed and 16-mixed use "
              "BF16/FP16. Other GPUs: Lightning's table. --peak-tflops overrides.")
        return
    flops = flops_per_image(args.smoke)
    runs = {}
    for _ in range(args.repeat):  # alternating, so drift on the machine hits every script alike
        for script, batch in args.runs:
            runs.setdefault((script, batch), []).append(run_script(script, batch, args))
    records = []
    for group in runs.values():
        record = dict(group[-1])
        record["images_per_s"] = statistics.median(r["images_per_s"] for r in group)
        record["peak_memory_gb"] = max(r["peak_memory_gb"] for r in group)
        records.append(record)
    # each run removed its own checkpoint folder when it finished; their parent goes too
    remove_empty_folders(Path(args.results).parent / "benchmark-checkpoints", up_to=Path(args.results).parent)
    bares = {}
    if not args.no_bare:
        for record in records:
            if bare_key(record) not in bares:
                bares[bare_key(record)] = run_bare(record, args)
    rows = rows_of(records, bares, flops, args)
    first = records[0]
    size = "the 3-layer smoke ViT at 32x32" if args.smoke else "ViT-B/16 at 224x224"
    report = [f"Synthetic-data training throughput, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} "
              f"UTC: {size}, {args.max_steps} steps per run (3 untimed), median of "
              f"{args.repeat}, on {first['device_name']}; torch {first['torch']}, torchvision "
              f"{first['torchvision']}, lightning {first['lightning']}.",
              f"Model FLOPs per training image: {flops / 1e9:.3f} GFLOP (Lightning's "
              "measure_flops, forward + backward). Speedup (vs 01): images/s over 01's at the "
              "same batch; vs bare: over the bare loop's.", "", *markdown_table(rows)]
    if not args.smoke:
        from plot_results import load_reference
        report += ["", "Beside the talk's published figures (batch 16, one device; the talk's "
                   "speedup is from training time, ours from images/s on synthetic data):", "",
                   *talk_comparison(rows, load_reference())]
    if args.loader_images:
        rates = loader_rates(args.loader_images, args.loader_workers)
        fastest = max(rows, key=lambda r: r["images_per_s"])
        talk04 = next((r for r in rows if r["script"].startswith("04") and r["batch"] == 16), None)
        report += ["", f"The talk's CIFAR-10 input pipeline (PIL Resize to 224 + ToTensor, "
                   f"{args.loader_images} images of 32x32, batch 16), on "
                   f"{torch.get_num_threads()} CPU threads:", ""]
        report += [f"- {w} workers: {fmt(rate, '{:.0f}')} images/s" for w, rate in rates.items()]
        device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
        report.append(f"- 09's pipeline, uint8 images resized on the {device.type.upper()} "
                      f"(batch 128): {resize_rate(args.loader_images, device):.0f} images/s")
        report.append(f"- fastest training rate above: {fastest['images_per_s']:.0f} images/s "
                      f"({fastest['script']}, batch {fastest['batch']})")
        if talk04 and 4 in rates and rates[4] and not args.smoke:
            waits = "yes" if rates[4] < talk04["images_per_s"] else "no"
            report.append(f"- does the talk's 04 (batch 16, {talk04['images_per_s']:.0f} images/s) "
                          f"wait for its 4 loader workers ({rates[4]:.0f} images/s)? {waits}")
    fast = {r["batch"]: r for r in rows if r["script"].startswith("09")}
    talk04 = {r["batch"]: r for r in rows if r["script"].startswith("04")}
    for batch, row in fast.items():
        best04 = talk04.get(16) or talk04.get(batch)
        if best04:
            report.append("")
            talks = ", the talk's" if best04["batch"] == 16 else ""
            report.append(f"09 (batch {batch}) against 04 (batch {best04['batch']}{talks}): "
                          f"{row['images_per_s'] / best04['images_per_s']:.2f}x the images/s; "
                          f"{fmt(row['vs_bare'], '{:.2f}')} of its bare loop.")
    text = "\n".join(report)
    print("\n" + text)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(text + "\n")
        print(f"\nReport written to {args.report}")
    from plot_results import chart_command
    print(f"Records appended to {args.results} (chart them with: "
          f"{chart_command('smoke-synthetic' if args.smoke else 'synthetic', args.results)})")


if __name__ == "__main__":
    main()
