"""bash gpu_check.sh: everything that compares with the talk without CIFAR-10 or the ImageNet
weights, on one GPU machine, within --minutes (default 8). Stages in order of value:

    1 headline       01 against 04 at batch 16 and 128: the talk's speedup (up to 2 rounds)
    2 memory-talk    the talk's memory column: 01-07 (and 10 on 2 GPUs) at 224, batch 16
    3 talk-lessons   03, 05, 06, 07, 02 beside 01 at batch 16 (up to 2 rounds)
    4 memory-sequel  the memory sequel's chain, 04 and 11-15, on ViT-B/16 and ViT-L/16
    5 beyond         09, 10 (2 GPUs) and 11-15 beside 01 (up to 2 rounds)
    6 bare-loops     a bare loop of the same maths beside each configuration measured
    7 input          the talk's CIFAR-10 input pipeline and 09's

Each run is planned at what a run like it cost so far (the seconds of each process, kept as it
goes): a run that would not end in the time left is not started, a throughput stage runs as many
of its rounds as fit, and a memory stage or the bare loops start only if all their runs fit.
Every process is stopped when the time is up. After every run the
report, results/gpu-check/gpu-check.md (GPU_CHECK_DIR elsewhere), is written again whole: what
finished, and what did not run and why, so a kill at any moment leaves a valid report. A
configuration that fails is a row saying why, and the rest go on (exit 6). At smoke size (--smoke,
on a CPU) the memory stages are skipped, saying so: the smoke ViT has nothing to measure.
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks import memory, peaks, throughput
from benchmarks.runs import SCRIPTS, SOME_FAILED, OutOfTime, RunFailed
from run_keeping import fail
from run_keeping.files import write_report

# At smoke size (a CPU), a first process is planned at PRIOR_S before any has been measured: its
# imports, set-up, steps and checkpoint write (about 9 s on a 2-core CPU); a first compile adds
# COMPILE_S (02 at smoke size: about 50 s). On a GPU a run is planned by GUESS until one like it
# has run in this check, fitted to the first checks on an H200 (reference/gpu-check-h200-*.jsonl):
# a process's own cost (imports, CUDA's set-up, the model, its checkpoint and model file: 13-24 s
# of wall time beside its steps, 18 s in the median), each step at a share of the dense peak for the script's
# precision (01: 46-59% of FP32's; 04 at batch 128: 22% of BF16's), never under the floor of an
# eager ViT-B/16 step's kernel launches (04 at batch 16: 35 ms a step, 5% of the peak), and a
# first compile (02's: 38 s; 09's, at batch 128, not yet measured on a GPU).
PRIOR_S = {"smoke": 12.0}
COMPILE_S = {"smoke": 60.0, "full": 40.0}
GUESS = {"process_s": 18.0, "share": {"fp32": 0.5, "bf16": 0.22}, "floor_s": 0.035, "gpu": "H200"}
COMPILES = {"02": ("smoke", "full"), "09": ("full",)}  # who calls torch.compile, at which size (09: on a GPU)
MARGIN_S = 5.0  # left unplanned for writing the report at the end


class Check:
    """The check in progress: the plan, what each stage did, the costs so far, the report."""

    def __init__(self, args, gpus=None):
        self.args, self.size = args, "smoke" if args.smoke else "full"
        # from gpu_check.sh's start (its preflight and this process's imports count too)
        self.started = time.monotonic() - max(0.0, time.time() - float(os.environ.get("GPU_CHECK_STARTED", time.time())))
        self.deadline = self.started + 60 * args.minutes - MARGIN_S
        self.out = Path(os.environ.get("GPU_CHECK_DIR", "results/gpu-check"))
        self.gpus = gpus if gpus is not None else torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.costs = {}    # (script, batch, vit) or a tag: [seconds of each run]
        self.stages = []   # (name, title, state, text) of each stage done
        self.failed = 0
        self.gpu = gpu_line()

    def left(self):
        return self.deadline - time.monotonic()

    def timeout(self):
        return max(1.0, self.left())

    def estimate(self, script, batch=16, vit="vit_b_16", steps=None):
        """Seconds a run of `script` is planned at: what it took the last time (a compile's cache
        is warm after the first); else, at smoke size, what the runs so far took (more for a larger
        batch), on a GPU the guess; and a first compile where it compiles."""
        seen = self.costs.get((script, batch, vit))
        if seen:
            return seen[-1]
        compiles = self.size in COMPILES.get(script[:2], ()) and \
            not any(k[0] == script for k in self.costs if isinstance(k, tuple))
        if self.size == "full":
            return guess(script, batch, vit, steps or self.args.max_steps, compiles)
        runs = [s for key, times in self.costs.items() if isinstance(key, tuple) for s in times]
        base = statistics.mean(runs) if runs else PRIOR_S[self.size]
        return base * (1.5 if batch > 16 else 1.0) + (COMPILE_S[self.size] if compiles else 0.0)

    def keep(self, key, seconds):
        self.costs.setdefault(key, []).append(seconds)

    def write(self, current=None):
        """gpu-check.md as things stand: every finished stage, the one under way, what did not run."""
        write_report(self.out / "gpu-check.md", report_text(self, current))


def guess(script, batch, vit, steps, compiles):
    """A run's seconds on one GPU by GUESS (see there): not a measurement."""
    peak = dict(peaks.PEAKS)[GUESS["gpu"]]
    unit = "bf16" if memory.asks_bf16(script[:2]) else "fp32"
    flops = peaks.flops_per_image(smoke=False) * memory.vit_shape(vit)[0] / memory.vit_shape("vit_b_16")[0]
    step = max(GUESS["floor_s"], batch * flops / (peak[unit] * 1e12 * GUESS["share"][unit]))
    return GUESS["process_s"] + (COMPILE_S["full"] if compiles else 0.0) + steps * step


def guessed_minutes(args):
    """[(stage, runs, minutes)] of the whole check on one H200 by GUESS, as docs/benchmarks.md
    states it: an estimate to plan a lease by, not a measurement."""
    check = Check(args, gpus=1)
    rows, configurations = [], []
    for kind, name, title, *spec in plan(check):
        if kind == "throughput":
            runs_of, most = spec
            configurations += runs_of
            units = [(s, b, "vit_b_16", args.max_steps) for s, b in runs_of] * most
        elif kind == "memory":
            sequel = name == "memory-sequel"
            memory_args = type(args)(**{**vars(args), "talk": not sequel, "sequel": sequel, "memory_scripts": None,
                                        "memory_models_given": False})
            units = [(SCRIPTS[n], 16, vit, memory.TALK_STEPS)
                     for vit, n, _ in memory.memory_plan(memory_args, True, 0.0, gpus=1)[0]]
        elif kind == "bare-loops":
            units = [(s, b, "vit_b_16", args.max_steps) for s, b in dict.fromkeys(configurations)]
        else:
            units = []
        seconds = []
        for script, batch, vit, steps in units:  # each as the check plans it, then as if it had run
            seconds.append(check.estimate(script, batch, vit, steps) * (0.8 if kind == "bare-loops" else 1))
            check.keep((script, batch, vit), guess(script, batch, vit, steps, compiles=False))
        if kind == "input":
            seconds = [len(args.loader_workers) * (args.loader_images / 2000 + 2.0)]
        rows.append((name, len(seconds), sum(seconds) / 60))
    return rows


def gpu_line():
    """The GPU's name, driver and memory as nvidia-smi gives them, or that there is none."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        line = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        line = ""
    return line or "no NVIDIA GPU: a CPU run"


def plan(check):
    """The stages in order of value: ("throughput", name, title, configurations, most rounds),
    ("memory", name, title), ("bare-loops",), ("input",). --scripts given: one throughput stage
    of those in place of the three. 10 needs 2 GPUs, counted as the scripts count them."""
    args = check.args
    most = args.repeat if args.repeat_given else None
    if args.scripts_given:
        throughputs = [("throughput", "throughput", "Throughput of the scripts asked for", args.runs,
                        most or throughput.REPEAT)]
    else:
        two = check.gpus >= 2 or args.smoke
        beyond = ["01", "09", *(["10"] if two else []), "11", "12", "13", "14", "15"]
        left_out = "" if two else (f" (10 left out: tensor parallelism splits each MLP across 2 GPUs, "
                                   f"and the scripts see {check.gpus})")
        throughputs = [
            ("throughput", "headline", "The talk's headline: 01 against 04 at batch 16 and 128",
             runs(["01", "04", "01@128", "04@128"]), most or 2),
            ("throughput", "talk-lessons", "The talk's other lessons beside 01 at batch 16",
             runs(["01", "03", "05", "06", "07", "02"]), most or 2),  # 02's first compile last: the dearest
            ("throughput", "beyond", "Beyond the talk: the fast recipe, tensor parallelism and the memory "
             f"lessons{left_out}", runs(beyond), most or 2)]
    return [throughputs[0], ("memory", "memory-talk", "The talk's memory column"), *throughputs[1:2],
            ("memory", "memory-sequel", "The memory sequel's chain"), *throughputs[2:],
            ("bare-loops", "bare-loops", "A bare loop beside each configuration"),
            ("input", "input", "The input pipeline")]


def runs(specs):
    found = []
    for spec in specs:
        number, _, batch = spec.partition("@")
        found.append((SCRIPTS[number], int(batch) if batch else 128 if number == "09" else 16))
    return found


def run_throughput(check, name, title, configurations, most, scratch):
    """One throughput stage: round after round (at most `most`), each configuration once a round,
    each run started only if what it is planned at fits in the time left; the report rewritten
    after each run. Returns (its state, its report, the measurement)."""
    measured = throughput.new_measurement(configurations)
    items = list(measured.items())
    flops, done, why_not = peaks.flops_per_image(check.args.smoke), 0, None
    for round_number in range(1, most + 1):
        for index, ((script, batch), result) in enumerate(items):
            if result["failed"] or why_not:
                continue
            cost, partner = check.estimate(script, batch), measured_against(items, index)
            if partner:  # 01 alone is no comparison: it starts only where the next one fits too
                cost += check.estimate(*partner)
            if cost > check.left():
                with_ = f" and {partner[0][:2]}@{partner[1]} beside it" if partner else ""
                why_not = (f"round {round_number} stopped before {script[:2]}@{batch}{with_}, planned at "
                           f"{cost:.0f} s with {max(0.0, check.left()):.0f} s left")
                break
            try:
                record, seconds = throughput.run_configuration(script, batch, check.args, scratch, check.timeout())
                result["records"].append(record)
                check.keep((script, batch, "vit_b_16"), seconds)
            except OutOfTime as err:
                why_not = f"round {round_number} stopped in {script[:2]}@{batch}: {err}"
            except RunFailed as err:
                result["failed"] = str(err)
                check.failed += 1
            done += 1
            check.write((name, title, f"round {round_number} of up to {most} under way",
                         throughput.report(check.args, measured, flops, None)))
        if why_not:
            break
    rounds = max((len(r["records"]) for r in measured.values()), default=0)
    text = throughput.report(check.args, measured, flops, None) if done else ""
    state = (f"{rounds} round(s) of {len(measured)} configurations" + (f"; {why_not}" if why_not else "")) \
        if done else f"not run: {why_not}"
    return state, text, measured


def measured_against(items, index):
    """(script, batch) of the configuration measured against the baseline (01) at `index`: the
    next one at its batch not yet failed; None where `index` is no baseline or none is left."""
    script, batch = items[index][0]
    if not script.startswith("01"):
        return None
    return next((run for run, result in items[index + 1:] if run[1] == batch and not result["failed"]
                 and not run[0].startswith("01")), None)


def run_memory(check, sequel):
    """--memory --talk or --sequel as one stage: started only if every run fits."""
    args = type(check.args)(**{**vars(check.args), "talk": not sequel, "sequel": sequel, "memory_scripts": None,
                               "memory_models_given": False})
    cuda = args.accelerator == "cuda"
    libraries = memory.libraries_gb(cuda)
    plan, notes = memory.memory_plan(args, cuda, libraries)
    cost = sum(check.estimate(SCRIPTS[n], 16, vit) for vit, n, _ in plan)
    if not plan:
        return "nothing to run: " + "; ".join(notes), memory.memory_tables([], libraries, notes, cuda)
    if cost > check.left():
        return (f"not run: its {len(plan)} runs would take about {cost / 60:.1f} min and "
                f"{max(0, check.left()) / 60:.1f} min are left"), ""
    rows, reference = [], memory.lessons()
    for vit, number, processes in plan:
        began = time.monotonic()
        try:
            record = memory.run_for_memory(number, vit, processes, args, libraries, check.timeout())
            rows.append(memory.row_of(record, libraries, reference))
        except RunFailed as err:
            rows.append({"number": number, "vit": vit, "failed": str(err), "processes": processes})
            check.failed += not isinstance(err, OutOfTime)
        check.keep((SCRIPTS[number], 16, vit), time.monotonic() - began)
        check.write(("memory-sequel" if sequel else "memory-talk", "", "under way",
                     memory.memory_tables(rows, libraries, notes, cuda)))
    measured = [r for r in rows if "failed" not in r]
    if measured:
        name = "memory-sequel.png" if sequel else "memory-talk.png"
        memory.staircase_chart(measured, check.out / name, measured[0]["record"]["device_name"])
    return f"{len(measured)} of {len(plan)} runs", memory.memory_tables(rows, libraries, notes, cuda)


def run_bare_loops(check, measured_stages):
    """A bare loop beside each configuration measured, one round: started only if all fit."""
    records = [r["records"][0] for measured in measured_stages for r in measured.values() if r["records"]]
    specs = {throughput.bare_key(r): r for r in records}
    cost = 0.8 * sum(check.estimate(r["script"], r["batch_size"]) for r in specs.values())
    if not specs:
        return "nothing to run: no configuration was measured", ""
    if cost > check.left():
        return (f"not run: its {len(specs)} loops would take about {cost / 60:.1f} min and "
                f"{max(0, check.left()) / 60:.1f} min are left"), ""
    for measured in measured_stages:
        for result in measured.values():
            if not result["records"]:
                continue
            try:
                answer, seconds = throughput.run_bare(result["records"][0], check.args, check.timeout())
                result["bares"].append(answer)
                check.keep("bare", seconds)
            except OutOfTime:
                break
            except RunFailed as err:
                result["failed"] = f"its bare loop: {err}"
                check.failed += 1
    return f"{len(specs)} loops", ""  # the throughput stages' tables show them


def run_input(check):
    """The input pipeline's rates: started only if its estimate fits."""
    args = check.args
    cost = len(args.loader_workers) * (args.loader_images / 400 + 2.0)
    if not args.loader_images:
        return "not asked for (--loader-images 0)", ""
    if cost > check.left():
        return f"not run: it would take about {cost:.0f} s and {max(0, check.left()):.0f} s are left", ""
    rates = throughput.input_rates(args)
    return "done", "\n".join(throughput.input_lines(rates, [], args))


def report_text(check, current=None):
    """The whole report: the machine, the budget, each stage's state and text, what did not run."""
    used = (time.monotonic() - check.started) / 60
    lines = [f"## GPU check, {datetime.now(timezone.utc):%Y-%m-%d}", "",
             f"GPU (name, driver, memory): {check.gpu}; GPUs the scripts see: {check.gpus}",
             f"Time: {used:.1f} of the {check.args.minutes} min allowed (--minutes); the stages in order of "
             "value, each planned from what the ones before it cost (docs/benchmarks.md).", ""]
    for number, (name, title, state, text) in enumerate(check.stages, 1):
        lines += [f"### {number}. {title} ({name}): {state}", "", *([text, ""] if text else [])]
    if current:
        name, title, state, text = current
        lines += [f"### Under way: {title or name}: {state}", "", *([text, ""] if text else [])]
    missed = [f"- {name}: {state}" for name, _, state, _ in check.stages
              if state.startswith(("not run", "nothing"))]
    lines += ["### Not run", "", *(missed or ["- nothing: every stage ran"])] if not current else \
        ["### Not run yet", "", "- the stages after the one under way (this report is rewritten as each run ends)"]
    return "\n".join(lines)


def main(args):
    """The check; its exit code (0, or SOME_FAILED where a configuration failed)."""
    check = Check(args)
    if check.gpus == 0 and not args.smoke:
        fail("no CUDA GPU found (torch sees none). On a CPU, run the same check at smoke size: "
             "bash gpu_check.sh --smoke")
    check.out.mkdir(parents=True, exist_ok=True)
    args.results = str(check.out / "gpu-check.jsonl")
    check.write()
    measured_stages = []  # (where in check.stages, its measurement) of each throughput stage
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for kind, name, title, *spec in plan(check):
            if kind == "throughput":
                state, text, measured = run_throughput(check, name, title, *spec, scratch)
                measured_stages.append((len(check.stages), measured))
            elif kind == "memory":
                state, text = ("skipped at smoke size: the smoke ViT is 0.4 M parameters, nothing to "
                               "measure; docs/benchmarks.md has the tables measured on a CPU", "") \
                    if args.smoke else run_memory(check, sequel=name == "memory-sequel")
            elif kind == "bare-loops":
                state, text = ("not asked for (--no-bare)", "") if args.no_bare else \
                    run_bare_loops(check, [m for _, m in measured_stages])
                flops = peaks.flops_per_image(args.smoke)
                for index, measured in measured_stages:  # their tables again, with the bare loops
                    old = check.stages[index]
                    if old[3]:
                        check.stages[index] = (*old[:3], throughput.report(args, measured, flops, None))
            else:
                state, text = run_input(check)
            check.stages.append((name, title, state, text))
            check.write()
    check.write()
    from plot_results import chart_command
    print(f"gpu_check.sh: report written to {check.out / 'gpu-check.md'}; records appended to {args.results} "
          f"(chart them with: {chart_command('smoke-synthetic' if args.smoke else 'synthetic', args.results)})",
          file=sys.stderr)
    return SOME_FAILED if check.failed else 0
