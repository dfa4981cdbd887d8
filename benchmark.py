"""What each technique buys, without the data set: runs the numbered scripts on synthetic data
(--synthetic), each beside a bare loop of the same maths, several times, interleaved, and prints
images/s, the speedup over 01, the ratio to the bare loop, each with its spread over the repeats,
peak memory and model FLOP utilisation (MFU); then the rate of the talk's CIFAR-10 input
pipeline; then, in plain words, what this machine showed and what it cannot say.

    python benchmark.py --smoke                              # small ViT, CPU
    python benchmark.py --scripts 01 02 03 04 01@128 04@128  # ViT-B/16 at 224 on a GPU
    python benchmark.py --smoke --scripts 01 03 --repeat 5   # measure longer: 5 rounds
    python benchmark.py --peaks                              # the peak FLOP/s table used for MFU
    python benchmark.py --memory     # memory per process as the model grows: 1 process, DDP,
                                     # FSDP2, TP; ViT-B/16 and ViT-L/16 (docs/benchmarks.md)

Speedup, here and in plot_results.py, is training throughput over 01's: images/s divided by 01's
images/s at the same batch on as many processes, in the same round. "vs bare" is the script's
images/s divided by its bare loop's, which has nothing in its loop but forward, loss,
zero_grad, backward and step on one batch held on the device, in the script's precision,
strategy, micro-batches, activation checkpointing, optimizer and offload: what the harness and
the data loader cost. Each script run appends its record (synthetic: true) to --results, so
`python plot_results.py --synthetic` charts them.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from run_keeping.errors import fail, leave  # first: a Ctrl-C while the libraries load ends in one line
from run_keeping.commands import Parser, check_path, whole_number
import torch
import torch.utils.data as torch_data

from benchmark_memory import (MEMORY_MODELS, SCRIPTS, VIT_OF, make_strategy, memory_report, memory_run,
                              process_range, talk_memory)
from plot_results import fmt
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
# The tensor-core unit each precision Fabric takes computes on (fp16 runs at bf16's rate on these
# GPUs); 64-true has no entry in the data sheets' tables, so no MFU.
UNIT = {"32-true": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "bf16",
        "16-true": "bf16", "64-true": None}
DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
          "16-mixed": torch.float16, "16-true": torch.float16, "64-true": torch.float64}
REPEAT = 3        # rounds of every configuration, interleaved: a median and a spread each
STEPS = {"smoke": 200, "full": 40}  # steps per run: about a second timed, at either size
# Bare loops of one configuration further apart than this: a busy machine. On an idle 2-core
# CPU they vary by up to about 10% from round to round (three runs of --smoke, Intel Xeon,
# 2026-12-03), which the ranking's round-by-round rule absorbs; two busy loops beside the run
# moved them by 170%. Twice the idle variation tells the two apart.
BUSY = 0.20
# Two configurations are told apart in the ranking only where one was the faster in every round
# and by more than this in the median: a few rounds of two equal ones often come out in one order
# by chance, and a margin keeps them tied (at the smoke size Fabric's own work per step costs 03
# some 5-10% against 01, round after round: that is told apart).
TIE = 0.03
SMOKE_SCRIPTS = ["01", "02", "03", "04"]  # --smoke's default: the talk's lessons on one device


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the small ViT at 32x32 (CPU)")
    parser.add_argument("--scripts", nargs="+", default=None, metavar="NN[@B]",
                        help="scripts by number, @B for another batch (default: every one that "
                        f"trains but 00, which is 01 from random init; --smoke: {' '.join(SMOKE_SCRIPTS)}, "
                        "the talk's lessons on one device; --memory --talk: 01-07 and 10; --sequel: "
                        "04 and 11-15)")
    parser.add_argument("--batch-size", type=whole_number(1), default=None, metavar="N",
                        help="per process, where NN@B does not say (default 16; 09: 128)")
    parser.add_argument("--max-steps", type=whole_number(WARMUP_STEPS + 1), default=None, metavar="N",
                        help=f"training steps per run, the first {WARMUP_STEPS} untimed (default "
                        f"{STEPS['full']}; --smoke: {STEPS['smoke']}, whose steps take milliseconds)")
    parser.add_argument("--repeat", type=whole_number(1, 100), default=REPEAT, metavar="N",
                        help=f"rounds of every configuration, interleaved (default {REPEAT}): the "
                        "median and its spread")
    parser.add_argument("--devices", type=whole_number(1, 64), default=1, metavar="N",
                        help="processes for 05-07 (default 1: DDP and FSDP2 still run) and 10 "
                             "(at least its 2 tensor-parallel processes)")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--results", default="results/benchmark.jsonl", metavar="FILE",
                        help="where the scripts append their records")
    parser.add_argument("--keep-models", action="store_true", help="keep each run's model file "
                        "(models/benchmark/; by default they are deleted: ViT-B/16's are 0.3 GB each)")
    parser.add_argument("--report", metavar="FILE", help="also write the report as Markdown")
    parser.add_argument("--peak-tflops", nargs="+", default=[], metavar="PRECISION=T",
                        help="the device's peak TFLOP/s per precision for MFU, e.g. "
                             "32-true=67 bf16-mixed=989 (default: the table, see --peaks)")
    parser.add_argument("--peaks", action="store_true", help="print the peak table and exit")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare-loop rows")
    parser.add_argument("--loader-images", type=whole_number(0), default=2000, metavar="N",
                        help="images for the input-pipeline rate (0 skips it; default 2000)")
    parser.add_argument("--loader-workers", nargs="+", type=whole_number(0, 64), default=[0, 1, 2, 4],
                        metavar="N", help="worker counts to time the loader with (default 0 1 2 4)")
    parser.add_argument("--memory", action="store_true", help="memory per process by model "
                        "and strategy (synthetic steps), beside the arithmetic; a chart too")
    parser.add_argument("--memory-models", nargs="+", default=None,
                        choices=list(MEMORY_MODELS), metavar="MODEL",
                        help="for --memory (default: ViT-B/16 ViT-L/16; ViT-H/14 adds the "
                        f"largest; one of {', '.join(MEMORY_MODELS)}; --talk: ViT-B/16; --sequel: "
                        "ViT-B/16 ViT-L/16)")
    parser.add_argument("--talk", action="store_true", help="with --memory: the talk's memory "
                        "column, each script as it is at 224x224, batch 16 (docs/benchmarks.md)")
    parser.add_argument("--sequel", action="store_true", help="with --memory: the memory "
                        "sequel's chain, 04 and 11-15, on ViT-B/16 and ViT-L/16")
    parser.add_argument("--bare-loop", help=argparse.SUPPRESS)  # internal: one bare run (JSON)
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
    args.scripts = args.scripts or (SMOKE_SCRIPTS if args.smoke else [n for n in SCRIPTS if n != "00"])
    args.max_steps = args.max_steps or STEPS["smoke" if args.smoke else "full"]
    args.runs = []
    for spec in args.scripts:
        number, _, batch = spec.partition("@")
        if number not in SCRIPTS or (batch and not batch.isdigit()) or batch == "0":
            parser.error(f"unknown script {spec}; known: {' '.join(SCRIPTS)} (NN or NN@BATCH)")
        default = 128 if number == "09" else 16  # 09's recipe is batch 128
        args.runs.append((SCRIPTS[number], int(batch) if batch else args.batch_size or default))
    try:
        args.peak_tflops = {k: float(v) for k, v in (p.split("=", 1) for p in args.peak_tflops)}
    except ValueError:
        parser.error("--peak-tflops takes PRECISION=TFLOPS, e.g. 32-true=67 bf16-mixed=989")
    if args.accelerator == "auto":  # the scripts' auto refuses a CPU without --smoke: synthetic runs are short
        args.accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    unknown = sorted(set(args.peak_tflops) - set(UNIT))
    if unknown:
        parser.error(f"--peak-tflops: {', '.join(unknown)} is no precision; one of {', '.join(UNIT)}")
    for flag in ("results", "report"):
        if getattr(args, flag):
            check_path(f"--{flag}", getattr(args, flag))
    return args


def peak_tflops(device_name, precision, given=None):
    """Dense peak TFLOP/s of one device for a precision: --peak-tflops, else the table above,
    else Lightning's table (other GPUs, where this process sees one); None where nobody knows
    (CPUs, 64-true)."""
    if given and precision in given:
        return given[precision]
    if UNIT.get(precision) is None:
        return None
    for part, peaks in PEAKS:
        if part.lower() in device_name.lower():
            return peaks[UNIT[precision]]
    if not torch.cuda.is_available() or torch.cuda.get_device_name() != device_name:
        return None
    from lightning.fabric.utilities.throughput import get_available_flops
    flops = get_available_flops(torch.device("cuda"), DTYPES[precision])
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


def run_script(script, batch, args, scratch):
    """One script on synthetic data; its record. Its model file goes to a scratch folder (or
    models/benchmark/ with --keep-models), its checkpoints too."""
    models = Path("models/benchmark") if args.keep_models else scratch
    flags = ["--synthetic", "--max-steps", str(args.max_steps), "--batch-size", str(batch),
             "--results", args.results, "--save-model", str(models / f"{script[:-3]}.pt"),
             "--checkpoint-dir", str(scratch / "checkpoints" / script[:-3]), *common_flags(args)]
    takes, least = process_range(script)
    if takes:  # 05-07, 10, 15; 10's tensor parallelism needs its 2 processes
        flags += ["--devices", str(max(least, args.devices))]
    before = len(read_lines(args.results))
    print(f"running {script} {' '.join(flags)}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, str(ROOT / script), *flags], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
        fail(f"{script} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(read_lines(args.results)[before:][-1])


def read_lines(path):
    try:
        return Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []


def bare_spec(record):
    """What a script's record says it computed, which its bare loop computes too."""
    return {"precision": record["precision"], "strategy": record["strategy"],
            "processes": record["world_size"], "tensor_parallel": record.get("tensor_parallel_size") or 1,
            "batch": record["batch_size"], "micro_batches": record.get("micro_batches") or 1,
            "checkpointing": bool(record.get("activation_checkpointing")),
            "optimizer": record.get("optimizer") or "Adam", "parallelize": record.get("parallelize")}


def bare_key(record):
    return tuple(bare_spec(record).values())


def run_bare(record, args):
    """The bare loop in a process of its own, as the script's record says it ran."""
    spec = json.dumps(bare_spec(record))
    print(f"running the bare loop {spec}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--bare-loop", spec,
                           "--max-steps", str(args.max_steps), *common_flags(args)],
                          capture_output=True, text=True)
    found = [line for line in proc.stdout.splitlines() if line.startswith("BARE ")]
    if proc.returncode != 0 or not found:
        fail(f"the bare loop failed (exit {proc.returncode}):\n{proc.stderr[-1500:]}")
    return json.loads(found[-1][5:])


def bare_loop(args):
    """Nothing but forward, loss, zero_grad, backward and step, on one batch of random images
    held on the device, in the script's precision, strategy, micro-batches, checkpointing,
    optimizer and offload; timed after 3 steps, with one synchronisation at each end."""
    import lightning as L
    import torch.nn.functional as F
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torchvision.models.vision_transformer import EncoderBlock
    from run_keeping.devices import share_cpu_threads
    from run_keeping.record import peak_memory_gb
    from local_utilities import SMOKE_IMAGE_SIZE, TALK_IMAGE_SIZE, build_vit
    spec, steps = json.loads(args.bare_loop), args.max_steps
    devices, micro = spec["processes"], spec["micro_batches"]
    strategy = make_strategy(spec["strategy"], devices, spec["tensor_parallel"], spec["parallelize"])
    accelerator = "cpu" if args.smoke else args.accelerator
    fabric = L.Fabric(accelerator=accelerator, devices=devices, precision=spec["precision"], strategy=strategy)
    fabric.launch()
    if fabric.device.type == "cpu":
        share_cpu_threads(devices)  # as the scripts' processes do (run_keeping/devices.py)
    torch.manual_seed(123)
    model = build_vit(None, argparse.Namespace(smoke=args.smoke, synthetic=True))
    model.heads.head = torch.nn.Linear(model.hidden_dim, 10)
    if spec["checkpointing"]:
        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, EncoderBlock))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(make_optimizer(spec["optimizer"], model.parameters(), fabric.device))
    size = SMOKE_IMAGE_SIZE if args.smoke else TALK_IMAGE_SIZE
    features = torch.rand(spec["batch"] // micro, 3, size, size, device=fabric.device)
    targets = torch.randint(0, 10, (spec["batch"] // micro,), device=fabric.device)
    cuda = fabric.device.type == "cuda"
    for step in range(steps):
        if step == WARMUP_STEPS:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        optimizer.zero_grad()
        for part in range(micro):
            with fabric.no_backward_sync(model, enabled=part < micro - 1):
                fabric.backward(F.cross_entropy(model(features), targets) / micro)
        optimizer.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = fabric.all_reduce(torch.tensor(time.perf_counter() - start), reduce_op="max")
    images = (steps - WARMUP_STEPS) * spec["batch"] * fabric.world_size // spec["tensor_parallel"]
    memory = fabric.all_reduce(torch.tensor(peak_memory_gb("cuda" if cuda else "cpu")), reduce_op="max")
    fabric.print("BARE " + json.dumps({"images_per_s": images / float(seconds),
                                        "peak_memory_gb": float(memory)}))
    fabric.barrier()
    leave(0)  # run_keeping/errors.py: why a multi-process run ends so


def make_optimizer(name, parameters, device):
    """The optimizer a record names (Adam, AdamW, SGD: any of torch.optim's), as a script makes
    it: the fused kernel on a GPU where it has one (09's AdamW), the learning rate its lessons'."""
    kind = getattr(torch.optim, name)
    fused = {"fused": True} if device.type == "cuda" and name in ("Adam", "AdamW") else {}
    return kind(parameters, lr=0.01 if name == "SGD" else 5e-5, **fused)


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


def measure(args):
    """Every configuration's script and bare loop, round after round, interleaved (drift on the
    machine hits every configuration alike): {(script, batch): {"records": [...], "bares": [...]}}."""
    measured = {run: {"records": [], "bares": []} for run in args.runs}
    with tempfile.TemporaryDirectory(prefix="benchmark-") as scratch:
        for _ in range(args.repeat):
            for script, batch in args.runs:
                record = run_script(script, batch, args, Path(scratch))
                measured[(script, batch)]["records"].append(record)
                if not args.no_bare:
                    measured[(script, batch)]["bares"].append(run_bare(record, args))
    return measured


def spread(values):
    """(median, lowest, highest) of a list, or Nones."""
    return (statistics.median(values), min(values), max(values)) if values else (None, None, None)


def rows_of(measured, flops, args):
    """One row per configuration (and one per bare loop): the median and range over the rounds
    of images/s, of the ratio to 01 of the same batch and processes in the same round, and of
    the ratio to its bare loop; peak memory; MFU; whether its bare loops disagreed (busy) or the
    ratio to 01 cannot be told from 1 (within noise)."""
    base = {(r["records"][0]["batch_size"], r["records"][0]["world_size"]): r for (s, _), r in measured.items()
            if s == "01_pytorch-vit.py" and r["records"]}
    rows = []
    for (script, batch), runs in measured.items():
        records, bares, first = runs["records"], runs["bares"], runs["records"][0]
        peak = peak_tflops(first["device_name"], first["precision"], args.peak_tflops)
        mfu = (lambda ips: ips * flops / (peak * 1e12 * first["world_size"])) if peak else (lambda ips: None)
        ips = [r["images_per_s"] for r in records]
        one = base.get((first["batch_size"], first["world_size"]))
        vs_01 = [a / b["images_per_s"] for a, b in zip(ips, one["records"])] if one else []
        vs_bare = [a / b["images_per_s"] for a, b in zip(ips, bares)]
        bare_ips = [b["images_per_s"] for b in bares]
        row = {"script": script, "batch": batch, "precision": first["precision"], "strategy": first["strategy"],
               "devices": first["world_size"], "n": len(records), "images_per_s": spread(ips),
               "vs_01": spread(vs_01), "vs_01_rounds": vs_01, "vs_bare": spread(vs_bare),
               "memory_gb": max(r["peak_memory_gb"] for r in records), "mfu": mfu(statistics.median(ips)),
               "busy": bool(bare_ips) and max(bare_ips) / min(bare_ips) - 1 > BUSY,
               "spread_bare": max(bare_ips) / min(bare_ips) - 1 if bare_ips else None}
        median, low, high = row["vs_01"]
        row["noise"] = median is not None and script != "01_pytorch-vit.py" and high - low > abs(median - 1)
        rows.append(row)
        if bares:
            rows.append({"script": "bare loop", "batch": batch, "precision": first["precision"],
                         "strategy": first["strategy"], "devices": first["world_size"], "n": len(bares),
                         "images_per_s": spread(bare_ips), "vs_01": spread([]), "vs_01_rounds": [],
                         "vs_bare": (1.0, 1.0, 1.0),
                         "memory_gb": max(b["peak_memory_gb"] for b in bares),
                         "mfu": mfu(statistics.median(bare_ips)), "busy": row["busy"], "noise": False,
                         "spread_bare": row["spread_bare"], "of": script})
    return rows


def ratio(value, pattern="{:.2f}"):
    """A median with its range over the rounds: 1.04 (0.98-1.10)."""
    median, low, high = value
    if median is None:
        return "-"
    return pattern.format(median) + (f" ({pattern.format(low)}-{pattern.format(high)})" if high != low else "")


def markdown_table(rows):
    lines = ["| script | batch | precision | strategy | processes | images/s | vs 01 | vs bare | "
             "peak memory GB | MFU | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = "; ".join([*(["busy: its bare loops differ by "
                             f"{r['spread_bare']:.0%}"] if r["busy"] and r["script"] != "bare loop" else []),
                          *(["within noise of 01"] if r["noise"] else [])]) or "-"
        lines.append(f"| {r['script']} | {r['batch']} | {r['precision']} | {r['strategy']} | "
                     f"{r['devices']} | {ratio(r['images_per_s'], '{:.1f}')} | {ratio(r['vs_01'])} | "
                     f"{ratio(r['vs_bare'])} | {r['memory_gb']:.2f} | "
                     f"{fmt(r['mfu'] and r['mfu'] * 100, '{:.1f}%')} | {note} |")
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
            lines.append(f"| {SCRIPTS[number]} | {ratio(ours[number]['vs_01'], '{:.2f}x')} | "
                         f"{talk01 / talk['time_min']:.2f}x | {ours[number]['memory_gb']:.2f} | "
                         f"{talk['memory_gb']:.2f} |")
    return lines


def ranking(rows):
    """The one-process configurations at batch 16, fastest first by their median ratio to 01,
    as text: "02 > 01 = 03 > 04". Two neighbours are tied (=) unless the faster was faster in
    every round and by more than TIE in the median: with a few rounds, two equal scripts are
    often ordered alike in each by chance."""
    chosen = sorted((r for r in rows if r["script"] != "bare loop" and r["devices"] == 1
                     and r["batch"] == 16 and r["vs_01_rounds"]), key=lambda r: -r["vs_01"][0])
    text = chosen[0]["script"][:2] if chosen else ""
    for faster, slower in zip(chosen, chosen[1:]):
        paired = [a / b for a, b in zip(faster["vs_01_rounds"], slower["vs_01_rounds"])]
        apart = min(paired) > 1 and statistics.median(paired) > 1 + TIE
        text += (" > " if apart else " = ") + slower["script"][:2]
    return chosen, text


def verdict(rows, args, device):
    """The report's last lines, in plain words: what this machine showed at this size, what is
    within noise, whether it was busy, and what it cannot say about a GPU."""
    size = "the smoke size (a 3-layer ViT at 32x32)" if args.smoke else "ViT-B/16 at 224x224"
    scripts = [r for r in rows if r["script"] != "bare loop"]
    lines = [f"What this run shows, on {device} at {size}, {args.repeat} rounds of {args.max_steps} steps:"]
    chosen, order = ranking(rows)
    if chosen:
        lines.append(f"- From fastest to slowest (one process, batch 16; >: faster in every round and by "
                     f"more than {TIE:.0%} in the median; =: not told apart): {order}.")
    noisy = [r["script"][:2] for r in scripts if r["noise"]]
    if noisy:
        lines.append(f"- Within noise of 01 (their rounds spread wider than their difference from 1.00): "
                     f"{', '.join(noisy)}; the ranking above compares them round by round. To measure them "
                     f"more finely: --repeat {2 * args.repeat} or --max-steps {2 * args.max_steps}.")
    least = min(scripts, key=lambda r: r["memory_gb"])
    lines.append(f"- Least peak memory: {least['script'][:2]} ({least['memory_gb']:.2f} GB)"
                 + ("; at this size a process's memory is mostly its libraries (benchmark.py "
                    "--memory --talk measures it at the talk's size)." if args.smoke else "."))
    busy = [r for r in scripts if r["busy"]]
    if busy:
        worst = max(busy, key=lambda r: r["spread_bare"])
        lines.append(f"- BUSY MACHINE: the bare loops of one configuration ran up to "
                     f"{worst['spread_bare']:.0%} apart from round to round ({worst['script'][:2]}): "
                     "something else was using the processor, and the ratios above are not to be "
                     f"trusted. Run again on an idle machine, or measure longer: --repeat "
                     f"{2 * args.repeat} --max-steps {2 * args.max_steps}.")
    if "cuda" not in device.lower() and not device.startswith("NVIDIA"):
        lines.append("- What it cannot say: anything about a GPU. There, bf16 runs on tensor cores, "
                     "several processes mean several GPUs and NCCL, and torch.compile's kernels "
                     "differ; bash gpu_check.sh measures it on one.")
    return lines


def throughput_report(args, measured, flops, rates):
    """The whole report, as text."""
    rows = rows_of(measured, flops, args)
    first = next(iter(measured.values()))["records"][0]
    size = "the 3-layer smoke ViT at 32x32" if args.smoke else "ViT-B/16 at 224x224"
    text = [f"Synthetic-data training throughput, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} "
            f"UTC: {size}, {args.max_steps} steps per run (3 untimed), median of {args.repeat} "
            f"interleaved rounds (their range in brackets), on {first['device_name']}; torch "
            f"{first['torch']}, torchvision {first['torchvision']}, lightning {first['lightning']}.",
            f"Model FLOPs per training image: {flops / 1e9:.3f} GFLOP (Lightning's measure_flops, "
            "forward + backward). vs 01: images/s over 01's at the same batch and processes in the "
            "same round; vs bare: over the bare loop of the same maths.", "", *markdown_table(rows)]
    if not args.smoke:
        from plot_results import load_reference
        text += ["", "Beside the talk's published figures (batch 16, one device; the talk's "
                 "speedup is from training time, ours from images/s on synthetic data):", "",
                 *talk_comparison(rows, load_reference())]
    if rates:
        text += ["", f"The talk's CIFAR-10 input pipeline (PIL Resize to 224 + ToTensor, "
                 f"{args.loader_images} images of 32x32, batch 16), on {torch.get_num_threads()} "
                 "CPU threads:", ""]
        text += [f"- {w} worker{'s' if w != 1 else ''}: {fmt(rate, '{:.0f}')} images/s"
                 for w, rate in rates["workers"].items()]
        text.append(f"- 09's pipeline, uint8 images resized on the {rates['device'].upper()} "
                    f"(batch 128): {rates['resize']:.0f} images/s")
        talk04 = next((r for r in rows if r["script"].startswith("04") and r["batch"] == 16), None)
        workers = rates["workers"].get(4)
        if talk04 and workers and not args.smoke:
            waits = "yes" if workers < talk04["images_per_s"][0] else "no"
            text.append(f"- does the talk's 04 (batch 16, {talk04['images_per_s'][0]:.0f} images/s) "
                        f"wait for its 4 loader workers ({workers:.0f} images/s)? {waits}")
    return "\n".join(text + ["", *verdict(rows, args, first["device_name"])])


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
        print("\n".join(peaks_table()))
        return
    started = time.time()
    measured = measure(args)
    rates = None
    if args.loader_images:
        device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
        rates = {"workers": loader_rates(args.loader_images, args.loader_workers), "device": device.type,
                 "resize": resize_rate(args.loader_images, device)}
    text = throughput_report(args, measured, flops_per_image(args.smoke), rates)
    text += f"\n- The whole measurement took {(time.time() - started) / 60:.1f} min."
    print("\n" + text)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(text + "\n")
        print(f"\nReport written to {args.report}")
    from plot_results import chart_command
    print(f"Records appended to {args.results} (chart them with: "
          f"{chart_command('smoke-synthetic' if args.smoke else 'synthetic', args.results)})")


def peaks_table():
    lines = ["Dense peak TFLOP/s used for MFU (NVIDIA data sheets, sparsity figures halved):",
             f"{'name contains':<14} {'FP32':>6} {'TF32':>7} {'BF16/FP16':>10}"]
    lines += [f"{part:<14} {p['fp32']:>6.1f} {p['tf32']:>7.1f} {p['bf16']:>10.1f}" for part, p in PEAKS]
    lines.append("32-true uses FP32 (no script switches TF32 on); bf16-mixed, bf16-true, 16-mixed "
                 "and 16-true use BF16/FP16. Other GPUs: Lightning's table. --peak-tflops overrides.")
    return lines


if __name__ == "__main__":
    main()
