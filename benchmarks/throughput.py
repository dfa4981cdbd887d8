"""What each technique buys, without the data set: the numbered scripts on synthetic data, each
beside a bare loop of the same maths, in interleaved rounds; images/s, the speedup over 01 (images/s
over 01's at the same batch and processes in the same round), the ratio to the bare loop (what the
harness and the data loader cost), each with its spread, peak memory and MFU; the rate of the
talk's input pipeline; then what this machine showed and what it cannot say.
"""
import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import cast  # Fabric's setup_optimizers and all_reduce: one in, one out

import torch
import torch.utils.data as torch_data

from benchmarks.peaks import peak_tflops
from benchmarks.memory import chain
from benchmarks.runs import (SCRIPTS, RunFailed, run_internal_mode, make_strategy, process_range, processes_of, run_script,
                            print_answer)
from benchmarks.reports import fmt, markdown_table
from run_keeping.config import WARMUP_STEPS
from run_keeping.reading import ROOT, lessons
from run_keeping.keeper import BUSY_WAIT

REPEAT = 3        # rounds of every configuration, interleaved: a median and a spread each
STEPS = {"smoke": 200, "full": 40}  # steps per run: about a second timed, at either size
# Bare loops of one setting (one configuration's rounds, or configurations that share a bare
# loop) further apart than this: a busy machine, beside each run's own measure (BUSY_WAIT). On an idle 2-core
# CPU they vary by up to about 10% from round to round (three runs of --smoke, Intel Xeon,
# 2026-12-03), which the ranking's round-by-round rule absorbs; two busy loops beside the run
# moved them by 170%. Twice the idle variation tells the two apart.
BUSY = 0.20
# Two configurations are told apart in the ranking only where one was the faster in every round
# and by more than this in the median: a few rounds of two equal ones often come out in one order
# by chance, and a margin keeps them tied (at the smoke size Fabric's own work per step costs 03
# some 5-10% against 01, round after round: that is told apart).
TIE = 0.03
# --smoke's default: the talk table's lessons of one process (lessons.csv)
SMOKE_SCRIPTS = [n for n in chain("talk") if process_range(SCRIPTS[n]) == (False, 1)]


def common_flags(args):
    return ["--accelerator", args.accelerator] + (["--smoke"] if args.smoke else [])


def run_configuration(script, batch, args, scratch, timeout=None):
    """One script on synthetic data: (its record, wall seconds)."""
    models = Path("models/benchmark") if args.keep_models else Path(scratch)
    flags = ["--synthetic", "--max-steps", str(args.max_steps), "--batch-size", str(batch),
             "--save-model", str(models / f"{script[:-3]}.pt"),
             "--checkpoint-dir", str(Path(scratch) / "checkpoints" / script[:-3]), *common_flags(args)]
    if process_range(script)[0]:  # a lesson of several processes, at least its lessons.csv min_devices
        flags += ["--devices", str(processes_of(script, args.devices))]
    return run_script(script, flags, args.results, timeout=timeout)


def bare_spec(record):
    """What the bare loop rebuilds of a run: the lesson's technique from its row of lessons.csv, what
    ran (precision, processes, sizes, compile mode) from the record."""
    row = lessons()[record["script"]]
    return {"precision": record["precision"], "strategy": row["strategy"],
            "processes": record["world_size"], "tensor_parallel": record["world_size"] // (record["data_parallel"] or record["world_size"]),
            "batch": record["batch_size"], "micro_batches": record["micro_batches"] or 1,
            "checkpointing": bool(row["activation_checkpointing"]), "optimizer": row["optimizer"],
            "compile_mode": record["compile_mode"]}


def bare_key(record):
    return json.dumps(bare_spec(record), sort_keys=True)


def run_bare(record, args, timeout=None):
    spec = json.dumps(bare_spec(record))
    print(f"running the bare loop {spec}", file=sys.stderr, flush=True)
    (answer,), seconds = run_internal_mode("BARE", ["--bare-loop", spec, "--max-steps", str(args.max_steps),
                                      *common_flags(args)], timeout=timeout)
    return answer, seconds


def bare_loop(args):
    """Nothing but forward, loss, zero_grad, backward and step on one batch held on the device, as the
    script's record says it ran (precision, strategy, micro-batches, checkpointing, optimizer and
    its kernel, offload, compile mode); timed after 3 optimizer steps, as the script."""
    import lightning as L
    import torch.nn.functional as F
    # torch keeps its wrapper in a private module (13 and 14 import it so): their smoke runs and the bare
    # loop's test fail where a torch release moves it
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torchvision.models.vision_transformer import EncoderBlock
    from local_utilities import SMOKE_IMAGE_SIZE, TALK_IMAGE_SIZE, build_vit
    from run_keeping.keeper import cpu_times, waiting_share
    from run_keeping.record import peak_memory_gb
    spec, steps = json.loads(args.bare_loop), args.max_steps
    devices, micro = spec["processes"], spec["micro_batches"]
    strategy = make_strategy(spec["strategy"], devices, spec["tensor_parallel"])
    os.environ["LT_PRECISION"] = spec["precision"]  # as the lesson's run had it: Fabric and parallelize.py read it
    fabric = L.Fabric(accelerator=args.accelerator, devices=devices,
                      precision=spec["precision"], strategy=strategy)
    fabric.launch()
    if devices > 1 and "OMP_NUM_THREADS" not in os.environ:  # as Lightning's launcher shares the cores in a run
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    torch.manual_seed(123)
    model = build_vit(None, argparse.Namespace(smoke=args.smoke, synthetic=True))
    model.heads.head = torch.nn.Linear(model.hidden_dim, 10)
    if spec["checkpointing"]:
        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, EncoderBlock))
    if spec.get("compile_mode"):  # before setup, as the scripts compile
        model = torch.compile(model, mode=spec["compile_mode"])
    model = fabric.setup_module(model)
    # 09 steps with the fused AdamW where it compiles (on a GPU, or with --compile-on-cpu)
    fused = spec["optimizer"] == "AdamW" and spec["compile_mode"] is not None
    optimizer = cast(torch.optim.Optimizer, fabric.setup_optimizers(make_optimizer(spec["optimizer"], model.parameters(), fused)))
    size = SMOKE_IMAGE_SIZE if args.smoke else TALK_IMAGE_SIZE
    features = torch.rand(spec["batch"] // micro, 3, size, size, device=fabric.device)
    targets = torch.randint(0, 10, (spec["batch"] // micro,), device=fabric.device)
    cuda = fabric.device.type == "cuda"
    for step in range(steps):
        if step == WARMUP_STEPS:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start, since = time.perf_counter(), cpu_times()
        optimizer.zero_grad()
        for part in range(micro):
            with fabric.no_backward_sync(model, enabled=part < micro - 1):
                fabric.backward(F.cross_entropy(model(features), targets) / micro)
        optimizer.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = float(cast(torch.Tensor, fabric.all_reduce(torch.tensor(time.perf_counter() - start), reduce_op="max")))
    images = (steps - WARMUP_STEPS) * spec["batch"] * fabric.world_size // spec["tensor_parallel"]
    memory = float(cast(torch.Tensor, fabric.all_reduce(torch.tensor(peak_memory_gb("cuda" if cuda else "cpu")), reduce_op="max")))
    waited = float(cast(torch.Tensor, fabric.all_reduce(torch.tensor(waiting_share(since)), reduce_op="max")))
    print_answer("BARE", {"images_per_s": images / seconds, "peak_memory_gb": memory,
                 "cpu_wait_share": waited, "compile_mode": spec["compile_mode"]}, fabric)
    fabric.barrier()
    sys.stdout.flush()
    if fabric.world_size > 1:
        os._exit(0)  # docs/run-keeping.md (Exit): why a multi-process run ends so


def make_optimizer(name, parameters, fused=False):
    """The lesson's optimizer (lessons.csv) at its learning rate; fused as 09 on its GPU path, else
    torch's own choice of kernel, as the lessons make it."""
    return getattr(torch.optim, name)(parameters, lr=0.01 if name == "SGD" else 5e-5,
                                      **({"fused": True} if fused else {}))


class Cifar10Shaped(torch_data.Dataset):
    """What torchvision's CIFAR10 does per image (a stored 32x32x3 uint8 array to PIL, then the
    transform), on random pixels made once."""

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
    """Images/s of the talk's input pipeline at each worker count, after the first batch."""
    import warnings
    from local_utilities import talk_transforms
    dataset = Cifar10Shaped(num_images, talk_transforms())
    rates = {}
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # more workers than cores: asked for
    for w in workers:
        iterator = iter(torch_data.DataLoader(dataset, batch_size=batch_size, num_workers=w))
        next(iterator)
        start, seen = time.perf_counter(), 0
        for features, _ in iterator:
            seen += len(features)
        rates[w] = seen / (time.perf_counter() - start) if seen else None
    return rates


def resize_rate(num_images, device, batch_size=128):
    """Images/s of the fast recipe's input pipeline (the lesson in the GPU check's fast stage, lessons.csv):
    uint8 images on the device, resized to 224 there by its own resize_on_device."""
    import runpy
    fast = next(script for script, row in lessons().items() if row["gpu_check"] == "fast")
    resize_on_device = partial(runpy.run_path(str(ROOT / fast))["resize_on_device"], size=224)
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


def input_rates(args):
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    return {"workers": loader_rates(args.loader_images, args.loader_workers), "device": device.type,
            "resize": resize_rate(args.loader_images, device)}


def new_measurement(runs):
    return {run: {"records": [], "bares": [], "failed": None} for run in runs}


def measure_round(measured, args, scratch, timeout=lambda: None, bare=True):
    """One round of every configuration not yet failed: its script, then its bare loop; a failure is
    kept as the configuration's reason, and it is not run again."""
    for (script, batch), runs in measured.items():
        if runs.get("failed"):
            continue
        try:
            record, _ = run_configuration(script, batch, args, scratch, timeout())
            runs["records"].append(record)
            if bare and not args.no_bare:
                runs["bares"].append(run_bare(record, args, timeout())[0])
        except RunFailed as err:
            runs["failed"] = str(err)


def spread(values):
    return (statistics.median(values), min(values), max(values)) if values else (None, None, None)


def rows_of(measured, flops, args):
    """One row per configuration (and per bare loop): median and range over the rounds of images/s, of
    the ratio to 01 and of the ratio to the bare loop; peak memory; MFU; whether it was busy or
    within noise of 01."""
    base = {(r["records"][0]["batch_size"], r["records"][0]["world_size"]): r for (s, _), r in measured.items()
            if s == "01_pytorch-vit.py" and r["records"]}
    alike = {}  # the bare loops of every configuration of one bare spec, every round
    for runs in measured.values():
        for record, bare in zip(runs["records"], runs["bares"]):
            alike.setdefault(bare_key(record), []).append(bare["images_per_s"])
    rows = []
    for (script, batch), runs in measured.items():
        records, bares = runs["records"], runs["bares"]
        if not records:
            rows.append({"script": script, "batch": batch, "failed": runs.get("failed")})
            continue
        first = records[0]
        peak = peak_tflops(first["device_name"], first["precision"], args.peak_tflops)
        mfu = (lambda ips: ips * flops / (peak * 1e12 * first["world_size"])) if peak else (lambda ips: None)
        ips = [r["images_per_s"] for r in records]
        one = base.get((first["batch_size"], first["world_size"]))
        vs_01 = [a / b["images_per_s"] for a, b in zip(ips, one["records"])] if one else []
        vs_bare = [a / b["images_per_s"] for a, b in zip(ips, bares)]
        bare_ips = [b["images_per_s"] for b in bares]
        row = {"script": script, "batch": batch, "precision": precision_of(first),
               "strategy": lessons()[script]["strategy"],
               "devices": first["world_size"], "n": len(records), "images_per_s": spread(ips),
               "vs_01": spread(vs_01), "vs_01_rounds": vs_01, "vs_bare": spread(vs_bare),
               "memory_gb": max(r["peak_memory_gb"] for r in records), "mfu": mfu(statistics.median(ips)),
               "waited": max([b.get("cpu_wait_share") or 0 for b in bares], default=0),
               "runs_busy": any(r["busy"] for r in records),
               "spread_bare": spread_of(alike.get(bare_key(first), [])), "failed": runs.get("failed")}
        row["busy"] = row["runs_busy"] or row["waited"] > BUSY_WAIT or (row["spread_bare"] or 0) > BUSY
        median, low, high = row["vs_01"]
        row["noise"] = median is not None and script != "01_pytorch-vit.py" and high - low > abs(median - 1)
        rows.append(row)
        if bares:
            rows.append({**row, "script": "bare loop", "n": len(bares), "images_per_s": spread(bare_ips),
                         "vs_01": spread([]), "vs_01_rounds": [], "vs_bare": (1.0, 1.0, 1.0),
                         "memory_gb": max(b["peak_memory_gb"] for b in bares),
                         "mfu": mfu(statistics.median(bare_ips)), "noise": False, "failed": None, "of": script})
    return rows


def spread_of(values):
    return max(values) / min(values) - 1 if len(values) > 1 else None


def precision_of(record):
    asked = record["precision_asked"]
    return record["precision"] + (f" (asked {asked})" if asked and asked != record["precision"] else "")


def ratio(value, pattern="{:.2f}"):
    median, low, high = value
    if median is None:
        return "-"
    return pattern.format(median) + (f" ({pattern.format(low)}-{pattern.format(high)})" if high != low else "")


def busy_note(row):
    return "; ".join([*([f"busy: a run of it waited for a CPU core over {BUSY_WAIT:.0%} of its time"]
                        if row.get("runs_busy") else []),
                      *([f"busy: its bare loops waited for a CPU core {row['waited']:.0%} of their time"]
                        if row["waited"] > BUSY_WAIT else []),
                      *([f"busy: bare loops of its settings differ by {row['spread_bare']:.0%}"]
                        if (row["spread_bare"] or 0) > BUSY else [])])


def rows_table(rows):
    header = ["script", "batch", "precision", "strategy", "processes", "images/s", "vs 01", "vs bare",
              "peak memory GB", "MFU", "note"]
    cells = []
    for r in rows:
        if "n" not in r:  # failed before its first record, or not run
            cells.append([r["script"], r["batch"], *["-"] * 8,
                          f"FAILED: {r['failed']}" if r["failed"] else "not run: the time ran out"])
            continue
        note = "; ".join([*([busy_note(r)] if r["busy"] and r["script"] != "bare loop" else []),
                          *(["within noise of 01"] if r["noise"] else []),
                          *([f"FAILED in a later round: {r['failed']}"] if r["failed"] else [])]) or "-"
        cells.append([r["script"], r["batch"], r["precision"], r["strategy"], r["devices"],
                      ratio(r["images_per_s"], "{:.1f}"), ratio(r["vs_01"]), ratio(r["vs_bare"]),
                      f"{r['memory_gb']:.2f}", fmt(r["mfu"] and r["mfu"] * 100, "{:.1f}%"), note])
    return markdown_table(header, cells)


def talk_comparison(rows, reference):
    ours = {r["script"][:2]: r for r in rows if r["script"][:2].isdigit() and r["batch"] == 16
            and r.get("devices") == 1}
    talk01 = reference["01_pytorch-vit.py"]["time_min"]
    header = ["script", "speedup over 01 (ours, images/s)", "talk (training time)", "peak memory GB (ours)", "talk"]
    return markdown_table(header, [
        [SCRIPTS[n], ratio(ours[n]["vs_01"], "{:.2f}x"), f"{talk01 / reference[SCRIPTS[n]]['time_min']:.2f}x",
         f"{ours[n]['memory_gb']:.2f}", f"{reference[SCRIPTS[n]]['memory_gb']:.2f}"]
        for n in SMOKE_SCRIPTS if n in ours])


def ranking(rows):
    """The one-process configurations at batch 16, fastest first ("02 > 01 = 03 > 04"): tied (=) unless
    the faster was faster in every round and by more than TIE in the median."""
    chosen = sorted((r for r in rows if r["script"] != "bare loop" and r.get("devices") == 1
                     and r["batch"] == 16 and r["vs_01_rounds"]), key=lambda r: -r["vs_01"][0])
    text = chosen[0]["script"][:2] if chosen else ""
    for faster, slower in zip(chosen, chosen[1:]):
        paired = [a / b for a, b in zip(faster["vs_01_rounds"], slower["vs_01_rounds"])]
        apart = min(paired) > 1 and statistics.median(paired) > 1 + TIE
        text += (" > " if apart else " = ") + slower["script"][:2]
    return chosen, text


def verdict(rows, args, device):
    """The report's last lines: what this machine showed at this size, what is within noise, whether it
    was busy, what failed, what it cannot say about a GPU."""
    size = "the smoke size (a 3-layer ViT at 32x32)" if args.smoke else "ViT-B/16 at 224x224"
    scripts = [r for r in rows if r["script"] != "bare loop" and "n" in r]
    rounds = max((r["n"] for r in scripts), default=0)
    lines = [f"What this run shows, on {device} at {size}, {rounds} rounds of {args.max_steps} steps:"]
    chosen, order = ranking(rows)
    if chosen:
        lines.append(f"- From fastest to slowest (one process, batch 16; >: faster in every round and by "
                     f"more than {TIE:.0%} in the median; =: not told apart): {order}.")
    noisy = [r["script"][:2] for r in scripts if r["noise"]]
    if noisy:
        lines.append(f"- Within noise of 01 (their rounds spread wider than their difference from 1.00): "
                     f"{', '.join(noisy)}; the ranking above compares them round by round. To measure them "
                     f"more finely: --repeat {2 * args.repeat} or --max-steps {2 * args.max_steps}.")
    if scripts:
        least = min(scripts, key=lambda r: r["memory_gb"])
        lines.append(f"- Least peak memory: {least['script'][:2]} ({least['memory_gb']:.2f} GB)"
                     + ("; at this size a process's memory is mostly its libraries (benchmark.py "
                        "--memory --talk measures it at the talk's size)." if args.smoke else "."))
    fell_back = sorted({r["script"][:2] for r in scripts if "(asked " in r["precision"]})
    if fell_back:
        lines.append(f"- Not measured in the precision they ask for: {', '.join(fell_back)} (this device has "
                     "no native bfloat16; each row says what ran and what was asked).")
    busy = [r for r in scripts if r["busy"]]
    if busy:
        lines.append(f"- BUSY MACHINE ({', '.join(busy_note(r) + ' (' + r['script'][:2] + ')' for r in busy)}): "
                     "something else was using the processor, and the ratios above are not to be "
                     f"trusted. Run again on an idle machine, or measure longer: --repeat "
                     f"{2 * args.repeat} --max-steps {2 * args.max_steps}.")
    failed = [f"{r['script'][:2]}@{r['batch']}" for r in rows if r.get("failed")]
    if failed:
        lines.append(f"- FAILED: {', '.join(failed)} (each row says why); the others were measured.")
    if "cuda" not in device.lower() and not device.startswith("NVIDIA"):
        lines.append("- What it cannot say: anything about a GPU. There, bf16 runs on tensor cores, "
                     "several processes mean several GPUs and NCCL, and torch.compile's kernels "
                     "differ; bash gpu_check.sh measures it on one.")
    return lines


def first_record(measured):
    return next((r["records"][0] for r in measured.values() if r["records"]), None)


def report(args, measured, flops, rates):
    rows = rows_of(measured, flops, args)
    first = first_record(measured) or {}
    device = first.get("device_name", "this machine")
    size = "the 3-layer smoke ViT at 32x32" if args.smoke else "ViT-B/16 at 224x224"
    text = [f"Synthetic-data training throughput, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} "
            f"UTC: {size}, {args.max_steps} steps per run (3 untimed), median of the interleaved "
            f"rounds (their range in brackets), on {device}; torch {first.get('torch', torch.__version__)}, "
            f"torchvision {first.get('torchvision')}, lightning {first.get('lightning')}.",
            f"Model FLOPs per training image: {flops / 1e9:.3f} GFLOP (Lightning's measure_flops, "
            "forward + backward). vs 01: images/s over 01's at the same batch and processes in the "
            "same round; vs bare: over the bare loop of the same maths.", "", *rows_table(rows)]
    if not args.smoke:
        text += ["", "Beside the talk's published figures (batch 16, one device; the talk's "
                 "speedup is from training time, ours from images/s on synthetic data):", "",
                 *talk_comparison(rows, lessons())]
    if rates:
        text += ["", *input_lines(rates, rows, args)]
    return "\n".join(text + ["", *verdict(rows, args, device)])


def input_lines(rates, rows, args):
    lines = [f"The talk's CIFAR-10 input pipeline (PIL Resize to 224 + ToTensor, {args.loader_images} "
             f"images of 32x32, batch 16), on {torch.get_num_threads()} CPU threads:", ""]
    lines += [f"- {w} worker{'s' if w != 1 else ''}: {fmt(rate, '{:.0f}')} images/s"
              for w, rate in rates["workers"].items()]
    lines.append(f"- 09's pipeline, uint8 images resized on the {rates['device'].upper()} "
                 f"(batch 128): {rates['resize']:.0f} images/s")
    talk04 = next((r for r in rows if r["script"].startswith("04") and r["batch"] == 16 and "n" in r), None)
    workers = rates["workers"].get(4)
    if talk04 and workers and not args.smoke:
        waits = "yes" if workers < talk04["images_per_s"][0] else "no"
        lines.append(f"- does the talk's 04 (batch 16, {talk04['images_per_s'][0]:.0f} images/s) "
                     f"wait for its 4 loader workers ({workers:.0f} images/s)? {waits}")
    return lines
