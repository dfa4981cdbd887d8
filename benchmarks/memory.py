"""benchmark.py --memory: memory per process beside the arithmetic of what a process holds: by
strategy as the model grows (--memory), the talk's memory column (--talk) and the memory sequel's
chain as a staircase (--sequel). A CPU reports peak resident memory less what the libraries hold,
a GPU torch.cuda.max_memory_reserved (the talk's figure). docs/benchmarks.md has the tables.
"""
import functools
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import cast  # Fabric's setup_optimizers and all_gather: one in, one out

import torch

from benchmarks.runs import (SCRIPTS, RunFailed, run_internal_mode, make_strategy, memory_env, process_range, run,
                             run_script, print_answer)
from benchmarks.reports import fmt, markdown_table
from run_keeping.config import VITS, read_script
from run_keeping.device import device_name, native_bf16
from run_keeping.reading import ROOT, lessons
from run_keeping.record import append_record

# --memory: torchvision's ViTs at a small image size (what the strategies divide is the model
# state, not the activations), and the strategies of 01/04, 05, 06 and 10 on 1 or 2 processes.
MEMORY_MODELS = {"ViT-B/16": ("vit_b_16", 32), "ViT-L/16": ("vit_l_16", 32),
                 "ViT-H/14": ("vit_h_14", 28)}
MEMORY_STRATEGIES = {  # name: (processes, the record's strategy name, tensor-parallel size)
    "one process": (1, "single-device", 1), "DDP (05)": (2, "ddp", 1),
    "FSDP2 (06)": (2, "fsdp2", 1), "TP (10)": (2, "tensor-parallel+fsdp2", 2)}
def process_memory(cuda):
    """(current, peak) bytes: the CUDA allocator's reserved memory, or the resident set."""
    if cuda:
        return torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return (int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024)


def reset_peak_memory(cuda):
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:  # Linux: the peak resident set (VmHWM) starts again from the current one
        Path("/proc/self/clear_refs").write_text("5")


def memory_run(args):
    """In each process of one strategy: each model set up, two synthetic Adam steps in bf16-mixed, and
    their peak memory; rank 0 prints one line each."""
    import gc
    import lightning as L
    import torch.nn.functional as F
    import torchvision.models
    from torch.distributed.tensor import DTensor
    strategy, *models = args.memory_run
    processes, record_name, tensor_parallel = MEMORY_STRATEGIES[strategy]
    accelerator = args.accelerator  # auto is resolved by benchmark.parse_args
    fabric = L.Fabric(accelerator=accelerator, devices=processes, precision="bf16-mixed",
                      strategy=make_strategy(record_name, processes, tensor_parallel))
    fabric.launch()
    cuda = fabric.device.type == "cuda"
    libraries = process_memory(cuda)[0]  # before any model: the interpreter and its libraries
    for name in models:
        builder, size = MEMORY_MODELS[name]
        with torch.device("meta"):
            model = getattr(torchvision.models, builder)(image_size=size, num_classes=10)
        model = model.to_empty(device="cpu")
        with torch.no_grad():  # values do not matter for memory; filled, so every page is real
            for p in model.parameters():
                p.normal_(0, 0.02)
        parameters = sum(p.numel() for p in model.parameters())
        model = fabric.setup_module(model)
        optimizer = cast(torch.optim.Optimizer, fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=5e-5)))
        gc.collect()
        reset_peak_memory(cuda)
        features = torch.rand(2, 3, size, size, device=fabric.device)
        targets = torch.randint(0, 10, (2,), device=fabric.device)
        for _ in range(2):  # the first step creates Adam's moments; the second is the steady state
            loss = F.cross_entropy(model(features), targets)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
        after, peak = (torch.tensor([float(b)], device=fabric.device) for b in process_memory(cuda))
        held = torch.tensor([float(sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()))], device=fabric.device)
        afters, peaks, helds = (cast(torch.Tensor, fabric.all_gather(t)).flatten().tolist() for t in (after, peak, held))
        print_answer("MEMORY", {"model": name, "strategy": strategy, "processes": processes, "parameters": parameters,
                       "held": helds, "after_gb": [a / 1e9 for a in afters], "peak_gb": [p / 1e9 for p in peaks],
                       "libraries_gb": libraries / 1e9, "device": fabric.device.type}, fabric)
        del model, optimizer, features, targets, loss
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    fabric.barrier()
    sys.stdout.flush()
    if fabric.world_size > 1:
        os._exit(0)  # docs/run-keeping.md (Exit): why a multi-process run ends so


def state_terms(precision, optimizer, strategy, parameters, held):
    """Model state one process holds (bytes): weights and gradients (4 bytes each, 2 in bf16-true),
    Adam's and AdamW's two moments (SGD without momentum: none), DDP's float32 bucket copy of every gradient."""
    size = 2 if precision == "bf16-true" else 4
    terms = {"weights": size * held, "gradients": size * held,
             "optimizer": 2 * size * held if optimizer in ("Adam", "AdamW") else 0}
    if strategy == "ddp":
        terms["DDP's buckets"] = 4 * parameters
    return terms


def state_bytes(strategy, parameters, held):
    ddp = "ddp" if strategy.startswith("DDP") else None
    return sum(state_terms("bf16-mixed", "Adam", ddp, parameters, held).values())


def available_memory(cuda):
    if cuda:
        return torch.cuda.get_device_properties(0).total_memory
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(meminfo["MemAvailable"].split()[0]) * 1024


def memory_report(args):
    """--memory: each strategy in processes of its own, the models in turn: (the table, the chart's
    path, the strategies that failed or measured nothing)."""
    cuda = args.accelerator == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    budget, rows, notes, failed = available_memory(cuda), [], [], []
    for strategy, (processes, _, _) in MEMORY_STRATEGIES.items():
        if cuda and processes > gpus:
            notes.append(f"{strategy}: skipped, it needs {processes} GPUs and this machine has {gpus}")
            continue
        models = []
        for name in args.memory_models:
            parameters, held = expected_held(name, strategy)
            need = state_bytes(strategy, parameters, held) * (1 if cuda else processes)
            if need > 0.8 * budget:
                notes.append(f"{name} under {strategy}: skipped, its model state alone needs about "
                             f"{need / 1e9:.0f} GB {'per GPU' if cuda else f'for {processes} processes'}, "
                             f"more than 80% of the {budget / 1e9:.0f} GB {'per GPU' if cuda else 'free here'}")
            else:
                models.append(name)
        if not models:
            continue
        print(f"measuring {', '.join(models)} under {strategy}", file=sys.stderr, flush=True)
        try:
            found, _ = run_internal_mode("MEMORY", ["--memory-run", strategy, *models, "--accelerator", args.accelerator],
                           env=memory_env(cuda))
            rows += found
        except RunFailed as err:
            notes.append(f"{strategy}: FAILED ({err})")
            failed.append(strategy)
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for r in rows:  # records, from which strategy_table makes its table again
        r.update(device_name=device_name("cuda" if cuda else "cpu"), timestamp=when, notes=notes)
        append_record(Path(args.results).parent / "memory-strategies.jsonl", r)
    chart, table = Path(args.results).parent / "memory.png", strategy_table(rows, notes)  # the table adds the peaks charted
    if rows:
        memory_chart(rows, chart, rows[0]["device_name"])
    unmeasured = len(MEMORY_STRATEGIES) - len({r["strategy"] for r in rows})
    return table, chart if rows else None, unmeasured if not rows else len(failed)


def strategy_table(rows, notes=None):
    """--memory's table from its records, with FSDP2's and TP's peaks against DDP's on ViT-L/16."""
    notes = (rows[0].get("notes") or []) if notes is None and rows else notes or []
    if not rows:
        return "\n".join(["Memory per process: nothing measured.", *[f"- {note}" for note in notes]])
    cuda = rows[0].get("device") == "cuda"
    figure = "torch.cuda.max_memory_reserved" if cuda else "peak resident memory (VmHWM)"
    header = ["model", "parameters", "strategy", "processes", "parameters held per process",
              "model state by arithmetic GB", "after the steps, less libraries GB", "peak per process GB",
              "peak less libraries GB"]
    cells = []
    for r in rows:
        held = max(r["held"])
        expected = state_bytes(r["strategy"], r["parameters"], held) / 1e9
        libraries = 0 if cuda else r["libraries_gb"]  # CUDA's figures hold no libraries
        peak, after = max(r["peak_gb"]), max(r["after_gb"]) - libraries
        r["expected_gb"], r["peak"], r["peak_less_libraries"] = expected, peak, peak - libraries
        cells.append([r["model"], f"{r['parameters'] / 1e6:.0f} M", r["strategy"], r["processes"],
                      f"{held / 1e6:.0f} M", f"{expected:.2f}", f"{after:.2f}", f"{peak:.2f}",
                      f"{r['peak_less_libraries']:.2f}"])
    lines = [f"Memory per process, {rows[0]['timestamp'][:16].replace('T', ' ')} UTC, on {rows[0]['device_name']}: "
             f"{figure}; two synthetic Adam steps in bf16-mixed at a small image size; arithmetic: 16 bytes "
             "per parameter held (float32 weight and gradient, Adam's two moments), DDP 4 more per "
             "parameter (its gradient buckets).", "", *markdown_table(header, cells), "",
             *[f"- {note}" for note in notes]]
    by = {(r["model"], r["strategy"]): r["peak"] for r in rows}
    ddp, fsdp, tp = (by.get(("ViT-L/16", s)) for s in ("DDP (05)", "FSDP2 (06)", "TP (10)"))
    if ddp and fsdp and tp:
        lines.append(f"- ViT-L/16 on 2 processes: FSDP2's peak is {fsdp / ddp:.2f} of DDP's; TP's "
                     f"{tp / ddp:.2f}, {'between the two' if fsdp <= tp <= ddp else 'NOT between them'}.")
    return "\n".join(lines)


def expected_held(name, strategy):
    """(parameters, parameters one process should hold): FSDP2 halves everything; TP halves each MLP's
    first Linear and second weight; one process and DDP hold it all."""
    import torchvision.models
    builder, size = MEMORY_MODELS[name]
    with torch.device("meta"):
        model = getattr(torchvision.models, builder)(image_size=size, num_classes=10)
    parameters = sum(p.numel() for p in model.parameters())
    if strategy.startswith("FSDP2"):
        return parameters, parameters / 2
    if strategy.startswith("TP"):
        split = sum(layer.mlp[0].weight.numel() + layer.mlp[0].bias.numel() + layer.mlp[3].weight.numel()
                    for layer in model.encoder.layers)
        return parameters, parameters - split / 2
    return parameters, parameters


def memory_chart(rows, path, device):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plot_results import save
    models = list(dict.fromkeys(r["model"] for r in rows))
    strategies = list(MEMORY_STRATEGIES)
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    width = 0.8 / len(strategies)
    for i, strategy in enumerate(strategies):
        for j, model in enumerate(models):
            r = next((r for r in rows if (r["model"], r["strategy"]) == (model, strategy)), None)
            x = j + (i - (len(strategies) - 1) / 2) * width
            if r is None:
                ax.text(x, 0, "skipped", rotation=90, ha="center", va="bottom", fontsize=7)
                continue
            peak = r["peak_less_libraries"]
            ax.bar(x, peak, width, color=f"C{i}", label=strategy if j == 0 else None)
            ax.plot([x - width / 2, x + width / 2], [r["expected_gb"]] * 2, color="black",
                    linewidth=2, label="model state by arithmetic" if (i, j) == (0, 0) else None)
            ax.annotate(f"{peak:.1f}", (x, peak), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels(models)
    ax.set_ylabel("peak memory per process, less libraries (GB)")
    ax.set_title(f"Memory per process as the model grows ({device})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)


# -- --memory --talk and --sequel: the numbered scripts as they are ---------------------------------
TALK_PROCESSES = 4   # the talk's 4 GPUs, for the scripts that take --devices (lessons.csv's devices over 1)
SEQUEL_PROCESSES = 2  # --sequel's sharded lessons: enough to shard, half the time on a CPU
TALK_STEPS = 4      # 3 untimed, 1 timed; Adam's moments exist from the first, so 2-4 are the steady state
VIT_OF = {name: vit for vit, name in VITS.items()}  # "ViT-L/16": "vit_l_16", the scripts' --vit
SMOKE_VIT = "smoke ViT"  # --memory --talk --smoke: the scripts' --smoke --synthetic model, at 32x32
MODEL_NAMES = {**VITS, SMOKE_VIT: "the smoke ViT"}


@functools.lru_cache(maxsize=None)
def vit_shape(vit):
    """(parameters with the 10-class head, blocks, width, MLP width, parameters of one block, image
    size, tokens): the talk's at 224, 196 patches and the class token; the smoke ViT's at 32."""
    import torchvision.models
    from torchvision.models.vision_transformer import EncoderBlock, VisionTransformer

    from local_utilities import smoke_vit
    with torch.device("meta"):
        model = smoke_vit() if vit == SMOKE_VIT else torchvision.models.get_model(vit, num_classes=10)
    assert isinstance(model, VisionTransformer)
    blocks = [m for m in model.modules() if isinstance(m, EncoderBlock)]
    size = model.image_size
    return (sum(p.numel() for p in model.parameters()), len(blocks), model.hidden_dim, model.mlp_dim,
            sum(p.numel() for p in blocks[0].parameters()), size, (size // model.patch_size) ** 2 + 1)


def arithmetic(record):
    """What one process of the run a record describes should hold at its peak, term by term (bytes)."""
    parameters, blocks, width, mlp, per_block, size, tokens = vit_shape(record["model"])
    row = lessons()[record["script"]]  # the lesson's technique
    strategy, replicas = row["strategy"], record.get("data_parallel") or record["world_size"]  # planned: as if 1 a replica
    fsdp, tp = "fsdp2" in strategy, record["world_size"] // replicas
    # parameters one process holds: FSDP2 shards them across the replicas, after TP split each MLP
    held = (parameters - blocks * (2 * width * mlp + mlp) * (1 - 1 / tp)) / replicas if fsdp else parameters
    terms = state_terms(record["precision"], row["optimizer"], strategy, parameters, held)
    if strategy == "fsdp2+cpu-offload" and record["accelerator"] == "cuda":
        terms.update(weights=0, gradients=0, optimizer=0)  # 15: in CPU memory, not the GPU's
    if record["precision"] == "bf16-mixed" and not fsdp:
        terms["autocast's bf16 weights"] = 2 * parameters  # cast once per forward, kept for backward
    if fsdp:  # the block in use and the next (prefetched), gathered in bf16, with float32 gradients
        terms["FSDP2's gathered blocks"] = 2 * (2 + 4) * per_block // tp
    # saved per image and block: 9 values a token of the width, 2 of the MLP's (2 bytes in bf16,
    # 4 in float32); autocast keeps the two LayerNorms' inputs in float32 (2 bytes more each)
    value = 4 if record["precision"] == "32-true" else 2
    one_block = (9 * tokens * width + 2 * tokens * mlp // tp) * value \
        + (2 * tokens * width * 2 if record["precision"] == "bf16-mixed" else 0)
    per_image = blocks * tokens * width * value + one_block if row["activation_checkpointing"] \
        else blocks * one_block                  # checkpointed: each block's input, one block again
    micro = record["batch_size"] // (record.get("micro_batches") or 1)
    terms["activations"] = per_image * micro
    # a CPU's synthetic run holds all its images; a GPU's one step's of them (local_utilities)
    steps = 1 if record.get("accelerator") == "cuda" else record["max_steps"]
    images = (steps * record["batch_size"] + 2) * replicas
    terms["synthetic images"] = images * 3 * size * size * 4
    return terms


def libraries_gb(cuda):
    """What an interpreter holds with torch, torchvision, lightning and torchmetrics imported (0 on a
    GPU)."""
    if cuda:
        return 0.0
    code = ("import torch, torchvision, lightning, torchmetrics\nfrom pathlib import Path\n"
            "print(next(l for l in Path('/proc/self/status').read_text().splitlines() "
            "if l.startswith('VmRSS')).split()[1])")
    out, _ = run([sys.executable, "-c", code], env=memory_env(cuda=False))
    return int(out.split()[-1]) * 1024 / 1e9


def talk_processes(number, vit, cuda, libraries, wanted=TALK_PROCESSES, gpus=None):
    """The processes a script runs with: `wanted` where it takes --devices and the machine has the GPUs
    or the memory, else fewer; and why, when fewer."""
    takes, least = process_range(SCRIPTS[number])
    if not takes:
        return 1, None
    if cuda:
        gpus = torch.cuda.device_count() if gpus is None else gpus
        count = min(wanted, gpus)
        why = f"this machine has {gpus} GPU(s)"
    else:  # what n processes would hold by the arithmetic, with the libraries each imports

        def need(n):
            record = dict(script=SCRIPTS[number], model=vit, precision="bf16-mixed", batch_size=16,
                          accelerator="cpu", max_steps=TALK_STEPS, world_size=n, settings={})
            return n * (libraries * 1e9 + sum(arithmetic(record).values()))
        free = available_memory(False)
        count = next((n for n in range(wanted, 0, -1) if need(n) < 0.85 * free), 1)
        why = f"{wanted} would need about {need(wanted) / 1e9:.0f} GB and {free / 1e9:.0f} GB are free"
    if count < least:
        return None, f"{SCRIPTS[number]} skipped: it needs {least} processes and {why}"
    return count, None if count == wanted else f"{SCRIPTS[number]}: {count} processes, not {wanted}: {why}"


def asks_bf16(number):
    precision = read_script(ROOT / SCRIPTS[number])["precision"] or ""
    return precision if precision.startswith("bf16") else None


def chain(table):
    """The lessons of a memory table (lessons.csv's memory_chain), each after the one it is measured
    against."""
    rows = {script[:2]: row for script, row in lessons().items() if table in row["memory_chain"]}
    before = {n: (row["against"] if row["against"] in rows else None) for n, row in rows.items()}
    ordered = []

    def add(number):
        ordered.append(number)
        for after in sorted(n for n, b in before.items() if b == number):
            add(after)
    for root in sorted(n for n, b in before.items() if b is None):
        add(root)
    return ordered


def memory_plan(args, cuda, libraries, gpus=None):
    """([(vit, number, processes)], notes): --talk's or --sequel's scripts (or --scripts) on each
    model; on a CPU without native bfloat16, none that asks for it."""
    scripts = args.memory_scripts or chain("sequel" if args.sequel else "talk")
    vits = [VIT_OF[m] for m in args.memory_models] if args.memory_models_given else \
        (list(VITS) if args.sequel else ["vit_b_16"])
    vits = [SMOKE_VIT] if args.smoke else vits
    skipped = [n for n in scripts if asks_bf16(n)] if not cuda and not native_bf16("cpu") else []
    notes = [f"{', '.join(skipped)} not measured: this {device_name('cpu')} has no native bfloat16, so "
             "their bf16 precision would run in float32, which is not their lesson; measure them on a CPU "
             "with AVX512-BF16 or AMX, or on a GPU (docs/benchmarks.md)"] if skipped else []
    plan = []
    for vit in vits:
        for number in (n for n in scripts if n not in skipped):
            processes, note = talk_processes(number, vit, cuda, libraries,
                                             SEQUEL_PROCESSES if args.sequel else TALK_PROCESSES, gpus)
            notes += [note] if note else []
            if processes is not None:
                plan.append((vit, number, processes))
    return plan, notes


def run_for_memory(number, vit, processes, args, libraries, timeout=None):
    """One numbered script as it is, on synthetic images at 224, batch 16; its record, appended to the
    memory runs' file too."""
    script, cuda = SCRIPTS[number], args.accelerator == "cuda"
    with tempfile.TemporaryDirectory(prefix="memory-") as scratch:
        folder = Path(scratch)
        flags = ["--synthetic", "--max-steps", str(TALK_STEPS), "--batch-size", "16",
                 *(["--smoke"] if vit == SMOKE_VIT else ["--vit", vit]),
                 "--save-model", str(folder / "model.pt"), "--checkpoint-dir", str(folder / "checkpoints"),
                 "--accelerator", args.accelerator]
        if process_range(script)[0]:  # 1 too, where a script's own default is 4
            flags += ["--devices", str(processes)]
        record, _ = run_script(script, flags, folder / "runs.jsonl", env=memory_env(cuda), timeout=timeout)
    record.update(memory_table="sequel" if args.sequel else "talk", libraries_gb=round(libraries, 4))
    append_record(Path(args.results).parent / "memory-runs.jsonl", record)
    return record


def talk_memory(args):
    """--memory --talk / --sequel: each script as it is, beside the arithmetic and the published
    figures. Returns (the tables, the chart's path or None, the runs that failed)."""
    cuda = args.accelerator == "cuda"
    libraries, reference, rows = libraries_gb(cuda), lessons(), []
    plan, notes = memory_plan(args, cuda, libraries)
    for vit, number, processes in plan:
        try:
            rows.append(row_of(run_for_memory(number, vit, processes, args, libraries), libraries, reference))
        except RunFailed as err:
            rows.append({"number": number, "vit": vit, "failed": str(err), "processes": processes})
    chart = Path(args.results).parent / ("memory-sequel.png" if args.sequel else "memory-talk.png")
    measured = [r for r in rows if "failed" not in r]
    if measured:
        staircase_chart(measured, chart, measured[0]["record"]["device_name"])
    return memory_tables(rows, libraries, notes, cuda), chart if measured else None, len(rows) - len(measured)


def row_of(record, libraries, reference):
    terms = arithmetic(record)
    return {"number": record["script"][:2], "vit": record["model"], "record": record, "terms": terms,
            "peak": record["peak_memory_gb"], "less": record["peak_memory_gb"] - libraries,
            "expected": sum(terms.values()) / 1e9, "reference": reference.get(record["script"], {})}


def memory_tables(rows, libraries, notes, cuda):
    when = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    measured = [r for r in rows if "failed" not in r]
    device = measured[0]["record"]["device_name"] if measured else device_name("cuda" if cuda else "cpu")
    size = vit_shape(rows[0]["vit"])[5] if rows else 224
    figure = "torch.cuda.max_memory_reserved" if cuda else (
        f"peak resident memory (VmHWM) with glibc's thresholds fixed, less the {libraries:.2f} GB an "
        "interpreter holds with torch, torchvision, lightning and torchmetrics imported")
    header = ["script", "model", "processes", "precision", "peak GB", "peak less libraries GB", "arithmetic GB",
              "measured / arithmetic", "talk GB", "vs talk", "sequel GB (ViT-L/16)", "images/s",
              "speedup over 01", "talk's speedup"]
    talk01 = {r["vit"]: r for r in measured if r["number"] == "01"}
    talk01_min = lessons()["01_pytorch-vit.py"]["time_min"]
    cells = []
    for r in rows:
        if "failed" in r:
            cells.append([SCRIPTS[r["number"]], MODEL_NAMES[r["vit"]], r["processes"], f"FAILED: {r['failed']}",
                          *["-"] * 10])
            continue
        rec, ref = r["record"], r["reference"]
        base = talk01.get(r["vit"])
        speed = rec["images_per_s"] / base["record"]["images_per_s"] if base and rec["images_per_s"] else None
        # the talk's figure where the run is the talk's: ViT-B/16 on as many processes as it had
        talk_gb = ref.get("memory_gb") if r["vit"] == "vit_b_16" and rec["world_size"] == ref.get("devices") else None
        talk_speed = talk01_min / ref["time_min"] if talk_gb and ref.get("time_min") else None
        sequel = ref.get("sequel_memory_gb") if r["vit"] == "vit_l_16" else None
        cells.append([rec["script"], MODEL_NAMES[r["vit"]], rec["world_size"], rec["precision"], f"{r['peak']:.2f}",
                      f"{r['less']:.2f}", f"{r['expected']:.2f}", f"{r['less'] / r['expected']:.2f}",
                      fmt(talk_gb, "{:.2f}"), fmt(talk_gb and r["less"] / talk_gb - 1, "{:+.0%}"),
                      fmt(sequel, "{:.2f}"), fmt(rec["images_per_s"], "{:.1f}"), fmt(speed, "{:.2f}x"),
                      fmt(talk_speed, "{:.2f}x")])
    lines = [f"Memory per process, {when}, on {device}: each script as it is, on synthetic images at "
             f"{size}x{size}, batch 16 per process, random init, {TALK_STEPS} steps; {figure}.", "",
             *markdown_table(header, cells), "", "The arithmetic, term by term (GB per process):", "",
             *markdown_table(["script", "model", *TERMS], [
                 [r["record"]["script"], MODEL_NAMES[r["vit"]], *(fmt(r["terms"].get(t) and r["terms"][t] / 1e9, "{:.2f}")
                                                          for t in TERMS)] for r in measured])]
    lines += staircase_lines(measured) + [""]
    talked = [(r["number"], r["less"] / r["reference"]["memory_gb"] - 1) for r in measured
              if r["vit"] == "vit_b_16" and r["reference"].get("memory_gb")
              and r["record"]["world_size"] == r["reference"]["devices"]]
    sequel = [(r["number"], r["less"] / r["reference"]["sequel_memory_gb"] - 1) for r in measured
              if r["vit"] == "vit_l_16" and r["reference"].get("sequel_memory_gb")]
    for what, pairs, goal in (("the talk's figure", talked, 0.10), ("the sequel's figure (ViT-L/16)", sequel, 0.15)):
        if pairs:
            near = " ".join(n for n, d in pairs if abs(d) <= goal) or "none"
            far = ", ".join(f"{n} ({d:+.0%})" for n, d in pairs if abs(d) > goal) or "none"
            lines.append(f"- Within {goal:.0%} of {what}: {near}; not: {far} (docs/benchmarks.md says why).")
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


TERMS = ["weights", "gradients", "optimizer", "autocast's bf16 weights", "DDP's buckets",
         "FSDP2's gathered blocks", "activations", "synthetic images"]


def staircase_lines(rows):
    """Each step of the sequel's chain against the one before it, measured and by arithmetic; and the
    chain's whole saving."""
    against = {script[:2]: row["against"] for script, row in lessons().items() if "sequel" in row["memory_chain"]}
    by = {(r["vit"], r["number"]): r for r in rows}
    cells = []
    for (vit, number), r in by.items():
        before = by.get((vit, against.get(number)))
        if before:
            saved, expected = before["less"] - r["less"], before["expected"] - r["expected"]
            cells.append([f"{before['number']} → {number}", MODEL_NAMES[vit], f"{before['less']:.2f}", f"{r['less']:.2f}",
                          f"{saved:.2f}", f"{expected:.2f}", fmt(saved / expected if expected else None, "{:.2f}")])
    lines = ["", "The chain as a staircase (peak less libraries, GB per process):", "", *markdown_table(
        ["step", "model", "before", "after", "saved", "saved by arithmetic", "saved / arithmetic"], cells)] \
        if cells else []
    if lines:
        steps = [(f"{before['number']}→{r['number']} {MODEL_NAMES[r['vit']]}", (before["less"] - r["less"]) /
                  (before["expected"] - r["expected"])) for (vit, _), r in by.items()
                 if (before := by.get((vit, against.get(r["number"])))) and before["expected"] != r["expected"]]
        off = [(name, ratio) for name, ratio in steps if abs(ratio - 1) > 0.15]
        far = ", ".join(f"{name} ({ratio:.2f})" for name, ratio in off) or "none"
        lines.append(f"\n- Savings within 15% of their arithmetic: {len(steps) - len(off)} of "
                     f"{len(steps)}; not: {far}.")
    for vit in VITS:
        start, end = by.get((vit, "04")), by.get((vit, "14"))
        if start and end:
            lines.append(f"- {MODEL_NAMES[vit]}: 04 to 14 holds {start['less'] / end['less']:.1f}x less "
                         f"per process ({start['less']:.2f} GB to {end['less']:.2f} GB; goal on "
                         f"ViT-L/16: 3x).")
    return lines


def staircase_chart(rows, path, device, when=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plot_results import save
    vits = list(dict.fromkeys(r["vit"] for r in rows))
    fig, axes = plt.subplots(1, len(vits), figsize=(6 * len(vits), 4.5), dpi=100, squeeze=False)
    for ax, vit in zip(axes[0], vits):
        mine = [r for r in rows if r["vit"] == vit]
        x = range(len(mine))
        ax.bar(x, [r["less"] for r in mine], color="C0", label="measured, less libraries")
        ax.scatter(x, [r["expected"] for r in mine], color="black", marker="_", s=400, zorder=3,
                   label="arithmetic")
        for key, marker, label in (("memory_gb", "o", "the talk (ViT-B/16)"),
                                   ("sequel_memory_gb", "s", "the sequel (ViT-L/16)")):
            want = "vit_b_16" if key == "memory_gb" else "vit_l_16"
            points = [(i, r["reference"].get(key)) for i, r in enumerate(mine)  # the talk's: on its 4 GPUs
                      if r["reference"].get(key) and vit == want
                      and (key != "memory_gb" or r["record"]["world_size"] == r["reference"]["devices"])]
            if points:
                ax.scatter(*zip(*points), color="C3", marker=marker, zorder=4, label=label)
                for i, _ in points:  # 14 also checkpoints activations; the sequel's SGD run did not
                    if key == "sequel_memory_gb" and lessons()[mine[i]["record"]["script"]]["activation_checkpointing"]:
                        ax.annotate("sequel: no\ncheckpointing", (i, mine[i]["reference"][key]), fontsize=6,
                                    xytext=(4, 4), textcoords="offset points", color="C3")
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"{r['number']}\n{r['record']['world_size']}p" for r in mine])
        ax.set_title(MODEL_NAMES[vit], fontsize=10)
        ax.set_ylabel("peak memory per process (GB)")
        ax.legend(fontsize=7)
    size = vit_shape(rows[0]["vit"])[5]
    fig.suptitle(f"Memory per process, batch 16 at {size}x{size} ({device}, "
                 f"{when or datetime.now(timezone.utc):%Y-%m-%d})", fontsize=9)
    fig.tight_layout()
    save(fig, path)
