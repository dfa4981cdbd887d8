"""bash gpu_check.sh: what the talk's lessons do on today's GPU, without CIFAR-10 or the ImageNet
weights (ViT-B/16 at 224 on synthetic images), within --minutes (default 7): STAGES below, in order
of value, each measuring lessons.csv's gpu_check column.

Each run is planned at what a run of its kind cost so far in this check, else at DEFAULT_S: a run
that would not end in the time left is not started. After every run the report
(results/gpu-check/gpu-check.md, or --out) is written again whole, so a kill at any moment leaves
a whole report. A configuration that fails is a row saying why; the rest go on (exit 6).

    python -m benchmarks.gpu_check --help   # what gpu_check.sh runs, with the suite on the path
"""
import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

# (name, kind, title, settings): the check, in order of value.
# A title's {lessons} are the lessons lessons.csv gives the stage (its gpu_check column).
STAGES = [
    ("headline", "throughput", "The talk's speed lesson at its batch: {lessons}, each beside its bare loop",
     {"batch": 16, "rounds": 2}),
    ("fast", "throughput", "The fast recipe: {lessons} at batch 128 beside its bare loop (images/s, MFU)",
     {"batch": 128, "rounds": 1}),
    ("input", "input", "The talk's input pipeline: its PIL loader at 4, 8 and 16 workers",
     {"workers": [4, 8, 16], "images": {"smoke": 400, "full": 4000}}),
    ("sequel", "memory", "The memory sequel's chain: {lessons} on ViT-L/16, each beside the sequel's published GB where it has one", {"vit": "ViT-L/16"}),
]
# Seconds a run is planned at before any run of its kind has run in this check: a process's
# imports, set-up, steps and checkpoint (a compile adds its own), on a 2-core CPU at smoke size
# and on one H200 at full size (reference/gpu-check-h200-*.jsonl: 13-24 s beside the steps).
DEFAULT_S = {"smoke": {"run": 12, "compiled run": 60, "bare loop": 10, "memory run": 12, "input": 10},
             "full": {"run": 30, "compiled run": 90, "bare loop": 25, "memory run": 40, "input": 60}}
MARGIN_S = 5.0  # kept back for writing the report at the end


def parse_args(argv=None):
    from run_keeping.config import WARMUP_STEPS, Parser, whole_number
    from benchmarks import throughput
    parser = Parser(prog="gpu_check.sh", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--minutes", type=whole_number(1, 600), default=7, metavar="N", help="the minutes it may take "
        "(default 7): the stages that fit, in order of value")
    add("--smoke", action="store_true", help="the same at smoke size, on a CPU (the tests run this)")
    add("--max-steps", type=whole_number(WARMUP_STEPS + 1), default=None, metavar="N", help="training steps "
        f"per run, the first {WARMUP_STEPS} untimed (default {throughput.STEPS['full']}; --smoke: "
        f"{throughput.STEPS['smoke']})")
    add("--scripts", nargs="+", default=None, metavar="NN[@B]", help="these lessons (at batch 16, or B) "
        "beside their bare loops, in place of the throughput stages")
    add("--repeat", type=whole_number(1, 100), default=None, metavar="N", help="rounds of a throughput "
        "stage (default: the stage's)")
    add("--out", default="results/gpu-check", metavar="DIR", help="the report and records (default "
        "results/gpu-check under the folder it runs from)")
    add("--plan", action="store_true", help="print each stage and the runs it would make, and the memory tables' "
        "(benchmark.py --memory --talk, --sequel), on this machine's GPUs (or one); nothing runs")
    args = parser.parse_args(argv)
    from benchmarks.runs import SCRIPTS
    unknown = [n for n in args.scripts or [] if n.partition("@")[0] not in SCRIPTS or not n.partition("@")[2].isdigit()
               and n.partition("@")[1]]
    if unknown:
        parser.error(f"unknown script {' '.join(unknown)}; known: {' '.join(SCRIPTS)}")
    # what the throughput measurement reads (benchmark.py's flags, at their defaults)
    args.max_steps = args.max_steps or throughput.STEPS["smoke" if args.smoke else "full"]
    args.results = str(Path(args.out) / "gpu-check.jsonl")
    args.accelerator, args.devices, args.keep_models, args.no_bare, args.peak_tflops = (
        "cpu" if args.smoke else "cuda", 1, False, False, {})
    return args


class Check:
    """The check in progress: the time left, the costs so far, each stage's state, the report."""

    def __init__(self, args, gpus=None):
        self.args, self.size = args, "smoke" if args.smoke else "full"
        self.started = time.monotonic()
        self.deadline = self.started + 60 * args.minutes - MARGIN_S
        self.out = Path(args.out)
        self.torch_says = None
        if gpus is None:
            from run_keeping.device import cuda_gpus
            gpus, self.torch_says = cuda_gpus()
        self.gpus, self.gpu = gpus, gpu_line(args.smoke, gpus)
        self.machine = [] if args.plan else machine_lines(gpus, self.torch_says)
        self.costs = {}    # kind: {key: [seconds of each run]}
        self.stages = []   # (name, title, state, text) of each stage done
        self.failed = 0

    def left(self):
        return self.deadline - time.monotonic()

    def timeout(self):
        return max(1.0, self.left())

    def estimate(self, kind, key):
        """Seconds a run is planned at: the last run of the same key, else the mean of its kind's so
        far, else the kind's default."""
        seen = self.costs.get(kind, {})
        if seen.get(key):
            return seen[key][-1]
        if kind == "run" and compiles(key[0], self.size):
            return DEFAULT_S[self.size]["compiled run"]
        times = [s for runs in seen.values() for s in runs]
        return statistics.mean(times) if times else DEFAULT_S[self.size][kind]

    def keep(self, kind, key, seconds):
        self.costs.setdefault(kind, {}).setdefault(key, []).append(seconds)

    def write(self, current=None):
        from benchmarks.reports import write_report
        write_report(self.out / "gpu-check.md", report_text(self, current))


def compiles(script, size):
    """Whether a run of `script` compiles at this size, to plan it: its torch.compile line, on a GPU; on a
    CPU, unless that line is under an `if` (09 compiles on a CPU only when asked)."""
    from run_keeping.config import read_script
    from run_keeping.reading import ROOT
    text = (ROOT / script).read_text()
    conditional = re.search(r"^ +if .*:\n +model = torch\.compile", text, re.M)
    return read_script(ROOT / script)["compile_mode"] is not None and (size == "full" or not conditional)


def gpu_line(smoke, gpus):
    """The GPU the check measures, CUDA's first (the first the scripts see), its name, driver and memory as
    nvidia-smi gives them, asked by the UUID torch gives it: nvidia-smi numbers the GPUs in PCI order, CUDA fastest
    first unless CUDA_DEVICE_ORDER=PCI_BUS_ID. At --smoke, or where torch sees no GPU, that none is used."""
    import torch
    if smoke or not gpus:
        return "no NVIDIA GPU used: a CPU run"
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    listed, code = nvidia_smi("-i", uuid, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
    listed = listed.strip().split("\n")[0] if code == 0 and listed else ""
    return listed or f"{torch.cuda.get_device_name(0)} (nvidia-smi does not list {uuid})"


def nvidia_smi(*args):
    """(nvidia-smi's output, its exit code); (None, None) where there is none on PATH."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, None
    try:
        proc = subprocess.run([smi, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return str(err), None
    return (proc.stdout + proc.stderr).strip(), proc.returncode


def machine_lines(gpus, torch_says):
    """What this machine has, each in its own tool's words: torch's build, what torch says as CUDA starts, the GPUs
    nvidia-smi lists (and its MIG devices) with their driver, compute capability, MIG and compute modes, or
    nvidia-smi's own error and exit code; the NVIDIA kernel module; CUDA_VISIBLE_DEVICES; and, where this torch keeps
    it, which of PyTorch's CUDA builds carries kernels for which compute capabilities."""
    import torch
    if torch.version.cuda:
        build = f"a CUDA {torch.version.cuda} build"
    else:
        build = f"a ROCm build (HIP {torch.version.hip})" if torch.version.hip else "a CPU build"
    lines = [f"torch {torch.__version__}: {build}, with kernels for {' '.join(torch.cuda.get_arch_list()) or 'no GPU'}",
             f"torch, as CUDA starts: {gpus} GPU(s) it can use" + (f"; it says: {torch_says}" if torch_says else "")]
    for ask in (["-L"], ["--query-gpu=index,name,driver_version,compute_cap,mig.mode.current,compute_mode",
                         "--format=csv"]):
        out, code = nvidia_smi(*ask)
        if out is None:
            lines.append("nvidia-smi: none on PATH (no NVIDIA driver installed here)")
            break
        said = out.splitlines() or [""]
        lines += [f"nvidia-smi {ask[0]}: {line}" for line in said[:-1]]
        lines.append(f"nvidia-smi {ask[0]}: {said[-1]}" + (f" (exit {code})" if code else ""))
        if code:
            break
    module = Path("/proc/driver/nvidia/version")  # the kernel module: "Open Kernel Module", or the proprietary one
    if module.exists():
        lines.append(f"NVIDIA kernel module: {' '.join(module.read_text().split(chr(10))[0].split())}")
    lines.append(f"CUDA_VISIBLE_DEVICES: {os.environ.get('CUDA_VISIBLE_DEVICES', 'not set')}")
    releases = getattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", {})  # torch's own table, where it has one
    for cuda, by_arch in releases.items():
        kept = sorted(by_arch.get(platform.machine().lower(), set()))
        lines.append(f"PyTorch's CUDA {cuda} builds carry kernels for compute capabilities "
                     f"{', '.join(f'{cc // 10}.{cc % 10}' for cc in kept)}")
    return lines


def stage_scripts(name):
    from run_keeping.reading import lessons
    return [script for script, row in lessons().items() if row["gpu_check"] == name]


def plan(args):
    """[(name, kind, title, settings, runs)]: STAGES with their (lesson, batch) runs; --scripts: those
    in one throughput stage in place of the throughput stages."""
    from benchmarks.runs import SCRIPTS
    stages = []
    for name, kind, title, settings in STAGES:
        scripts = stage_scripts(name)
        lessons = ", ".join(script[:2] for script in scripts)
        stages.append((name, kind, title.format(lessons=lessons), settings, [(s, settings.get("batch")) for s in scripts]))
    if not args.scripts:
        return stages
    runs = [(SCRIPTS[n], int(b or 16)) for n, _, b in (spec.partition("@") for spec in args.scripts)]
    asked = ("lessons", "throughput", f"{' '.join(args.scripts)}, each beside its bare loop", {"rounds": 1}, runs)
    return [asked, *(stage for stage in stages if stage[1] != "throughput")]


def run_throughput(check, name, title, settings, runs, scratch):
    """Round after round, each lesson and then its bare loop, each started only if it fits (01, the
    baseline, only if the next lesson fits beside it). Returns (its state, its report)."""
    from benchmarks import peaks, throughput
    from benchmarks.runs import OutOfTime, RunFailed
    rounds = check.args.repeat or settings["rounds"]
    args = argparse.Namespace(**{**vars(check.args), "repeat": rounds})  # as the report reads it
    measured = throughput.new_measurement(runs)
    items, flops, why_not = list(measured.items()), peaks.flops_per_image(args.smoke), None
    for round_number in range(1, rounds + 1):
        for index, ((script, batch), result) in enumerate(items):
            if result["failed"]:
                continue
            partner = next((run for run, r in items[index + 1:] if not r["failed"] and run[1] == batch), None) \
                if script.startswith("01") else None  # 01 alone is no comparison
            cost = sum(check.estimate("run", run) + check.estimate("bare loop", run)
                       for run in [(script, batch)] + ([partner] if partner else []))
            if cost > check.left():
                beside = f" and {partner[0][:2]} beside it" if partner else ""
                why_not = (f"round {round_number} stopped before {script[:2]}{beside}, planned at {cost:.0f} s "
                           f"with {max(0.0, check.left()):.0f} s left")
                break
            try:
                record, seconds = throughput.run_configuration(script, batch, args, scratch, check.timeout())
                result["records"].append(record)
                check.keep("run", (script, batch), seconds)
                answer, seconds = throughput.run_bare(record, args, check.timeout())
                result["bares"].append(answer)
                check.keep("bare loop", (script, batch), seconds)
            except OutOfTime as err:
                why_not = f"round {round_number} stopped in {script[:2]}: {err}"
            except RunFailed as err:
                result["failed"] = str(err)
                check.failed += 1
            check.write((name, title, f"round {round_number} of up to {rounds} under way",
                         throughput.report(args, measured, flops, None)))
            if why_not:
                break
        if why_not:
            break
    done = max((len(r["records"]) for r in measured.values()), default=0)
    text = throughput.report(args, measured, flops, None) if done else ""
    if not done:
        return f"not run: {why_not}", text
    return f"{done} round(s) of {len(measured)} lesson(s)" + (f"; {why_not}" if why_not else ""), text


def run_input(check, settings):
    from benchmarks import throughput
    args = check.args
    args.loader_images, args.loader_workers = settings["images"][check.size], settings["workers"]
    cost = check.estimate("input", "input")
    if cost > check.left():
        return f"not run: planned at {cost:.0f} s with {max(0, check.left()):.0f} s left", ""
    began = time.monotonic()
    rates = throughput.input_rates(args)
    check.keep("input", "input", time.monotonic() - began)
    return "done", "\n".join(throughput.input_lines(rates, [], args))


def run_memory(check, name, settings, runs):
    """The memory sequel's chain on its model, started only if every run fits."""
    from benchmarks import memory
    from benchmarks.runs import OutOfTime, RunFailed
    if check.args.smoke:
        return ("skipped at smoke size: the smoke ViT is 0.4 M parameters, nothing to measure; "
                "docs/benchmarks.md has the tables measured on a CPU"), ""
    args, libraries = memory_args(check.args, settings, runs), memory.libraries_gb(cuda=True)
    planned, notes = memory.memory_plan(args, True, libraries, gpus=check.gpus)
    cost = sum(check.estimate("memory run", (n, vit)) for vit, n, _ in planned)
    if cost > check.left():
        return f"not run: its {len(planned)} runs planned at {cost:.0f} s with {max(0, check.left()):.0f} s left", ""
    rows, reference = [], memory.lessons()
    for vit, number, processes in planned:
        began = time.monotonic()
        try:
            rows.append(memory.row_of(memory.run_for_memory(number, vit, processes, args, libraries, check.timeout()),
                                      libraries, reference))
        except RunFailed as err:
            rows.append({"number": number, "vit": vit, "failed": str(err), "processes": processes})
            check.failed += not isinstance(err, OutOfTime)
        check.keep("memory run", (number, vit), time.monotonic() - began)
        check.write((name, "", "under way", memory.memory_tables(rows, libraries, notes, True)))
    measured = [r for r in rows if "failed" not in r]
    if measured:
        memory.staircase_chart(measured, check.out / "memory-sequel.png", measured[0]["record"]["device_name"])
    return f"{len(measured)} of {len(planned)} runs", memory.memory_tables(rows, libraries, notes, True)


def memory_args(args, settings, runs):
    """benchmark.py --memory --sequel's settings for a memory stage: its lessons on its model."""
    return argparse.Namespace(**{**vars(args), "sequel": True, "talk": False, "memory_models_given": True,
                                 "memory_models": [settings["vit"]], "memory_scripts": [s[:2] for s, _ in runs]})


def print_plan(args, gpus):
    """--plan: each stage and the runs it would make, then the memory tables' runs; nothing runs."""
    from benchmarks import memory
    from benchmarks.runs import SCRIPTS, measured_with

    def memory_runs(planned):
        return [f"{n} on {memory.MODEL_NAMES[vit]}, {count} process(es){measured_with(SCRIPTS[n])[1]}" for vit, n, count in planned]
    for number, (name, kind, title, settings, runs) in enumerate(plan(args), 1):
        if kind == "memory":
            planned, notes = memory.memory_plan(memory_args(args, settings, runs), True, 0.0, gpus=gpus)
            runs = memory_runs(planned) + notes
        else:
            runs = [f"{script[:2]}{f' at batch {batch}' if batch else ''}{measured_with(script)[1]}" for script, batch in runs]
        print(f"{number}. {name}: {title}\n   " + ("; ".join(runs) or "no lesson"))
    for table in ("talk", "sequel"):
        tables = argparse.Namespace(memory_scripts=None, sequel=table == "sequel", memory_models_given=False, memory_models=[],
                                    smoke=False)
        planned, notes = memory.memory_plan(tables, True, 0.0, gpus=gpus)
        print(f"benchmark.py --memory --{table}: " + "; ".join(memory_runs(planned) + notes))


def report_text(check, current=None):
    used = (time.monotonic() - check.started) / 60
    lines = [f"## GPU check, {datetime.now(timezone.utc):%Y-%m-%d}", "",
             f"GPU (name, driver, memory): {check.gpu}; GPUs the scripts see: {check.gpus}", "",
             "The machine:", "", *(f"- {line}" for line in check.machine),
             f"Time: {used:.1f} of the {check.args.minutes} min allowed (--minutes); the stages in order of "
             "value, each run planned from what the runs before it cost (docs/benchmarks.md).", ""]
    for number, (name, title, state, text) in enumerate(check.stages, 1):
        lines += [f"### {number}. {title} ({name}): {state}", "", *([text, ""] if text else [])]
    if current:
        name, title, state, text = current
        lines += [f"### Under way: {title or name}: {state}", "", *([text, ""] if text else []),
                  "### Not run yet", "",
                  "- the stages after the one under way (this report is rewritten as each run ends)"]
    else:
        missed = [f"- {name}: {state}" for name, _, state, _ in check.stages
                  if state.startswith(("not run", "skipped")) or "stopped" in state]
        lines += ["### Not run", "", *(missed or ["- nothing: every stage ran"])]
    return "\n".join(lines)


def main(argv=None):
    """The check: every stage of plan() in order. Exit 0, 2 (no GPU without --smoke) or 6 (some
    configurations failed)."""
    from run_keeping.config import fail
    from run_keeping.device import no_gpu_line, unusable_gpu_line
    args = parse_args(argv)
    check = Check(args)
    if args.plan:
        print(f"On {check.gpus or 1} GPU(s):")
        return print_plan(args, check.gpus or 1)
    print("\n".join(["The machine:", *(f"  {line}" for line in check.machine)]), flush=True)
    if check.torch_says and not args.smoke:  # the lessons' line, after what the machine has
        fail(unusable_gpu_line(check.torch_says, diagnose=False))
    if check.gpus == 0 and not args.smoke:
        fail(no_gpu_line("On a CPU, run the same check at smoke size: bash gpu_check.sh --smoke.", diagnose=False))
    check.out.mkdir(parents=True, exist_ok=True)
    check.write()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for name, kind, title, settings, runs in plan(args):
            if kind == "throughput":
                state, text = run_throughput(check, name, title, settings, runs, scratch)
            elif kind == "input":
                state, text = run_input(check, settings)
            else:
                state, text = run_memory(check, name, settings, runs)
            check.stages.append((name, title, state, text))
            check.write()
    from benchmarks.runs import SOME_FAILED
    from benchmarks.reports import chart_command
    print(f"gpu_check.sh: report written to {check.out / 'gpu-check.md'}; records appended to {args.results} "
          f"(chart them with: {chart_command('smoke-synthetic' if args.smoke else 'synthetic', args.results)})",
          file=sys.stderr)
    if check.failed:
        fail(f"{check.failed} configuration(s) failed; their rows say why, the others were measured.", code=SOME_FAILED)


if __name__ == "__main__":
    main()
