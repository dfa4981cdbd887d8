"""What each technique buys, without the data set: the numbered scripts on synthetic data, each
beside a bare loop of the same maths, in interleaved rounds: images/s, the speedup over 01, the
ratio to the bare loop, their spread, peak memory and MFU; the talk's input pipeline; a verdict.

    python benchmark.py --smoke                              # small ViT, CPU
    python benchmark.py --scripts 01 02 03 04 01@128 04@128  # ViT-B/16 at 224 on a GPU
    python benchmark.py --smoke --scripts 01 03 --repeat 5   # measure longer: 5 rounds
    python benchmark.py --peaks                              # the peak FLOP/s table used for MFU
    python benchmark.py --memory     # memory per process as the model grows: 1 process, DDP,
                                     # FSDP2, TP; ViT-B/16 and ViT-L/16 (docs/benchmarks.md)
    python benchmark.py --memory --talk    # the talk's memory column; --sequel: the memory sequel's

The measurements are in benchmarks/. Each script run appends its record to --results, which
`python plot_results.py --synthetic` charts. A configuration that fails is a row saying why; the
others go on, and the exit code is 6.
"""
import argparse
import tempfile
import time

from benchmarks import memory, peaks, throughput
from benchmarks.runs import SCRIPTS, SOME_FAILED, process_range, processes_of
from benchmarks.reports import chart_command, write_report
from run_keeping.config import WARMUP_STEPS, Parser, check_path, fail, whole_number
from run_keeping.reading import tool_run
from run_keeping.device import cuda_gpus, no_gpu_line, unusable_gpu_line


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="the small ViT at 32x32 (CPU); --memory: ViT-B/16 alone; --talk and --sequel: the smoke ViT")
    talk, sequel = (" ".join(memory.chain(table)) for table in ("talk", "sequel"))  # lessons.csv's memory_chain
    several = " ".join(n for n, script in SCRIPTS.items() if process_range(script)[0])  # lessons.csv's devices
    add("--scripts", nargs="+", default=None, metavar="NN[@B]", help="scripts by number, @B for "
        "another batch (default: every one that trains but 00, which is 01 from random init; --smoke: "
        f"{' '.join(throughput.SMOKE_SCRIPTS)}, the talk's lessons on one device; --memory --talk: {talk}; "
        f"--sequel: {sequel})")
    add("--batch-size", type=whole_number(1), default=None, metavar="N",
        help="per process, where NN@B does not say (default 16; 09: 128)")
    add("--max-steps", type=whole_number(WARMUP_STEPS + 1), default=None, metavar="N",
        help=f"training steps per run, the first {WARMUP_STEPS} untimed (default "
        f"{throughput.STEPS['full']}; --smoke: {throughput.STEPS['smoke']}, whose steps take milliseconds)")
    add("--repeat", type=whole_number(1, 100), default=None, metavar="N",
        help=f"rounds of every configuration, interleaved (default {throughput.REPEAT}): the median and its spread")
    add("--devices", type=whole_number(1, 64), default=1, metavar="N", help=f"processes for {several} "
        "(default 1: DDP and FSDP2 still run; a lesson that needs more, as 10's tensor parallelism, takes its least)")
    add("--accelerator", default="auto", choices=["auto", "cuda", "cpu"])
    add("--results", default="results/benchmark.jsonl", metavar="FILE",
        help="where the scripts append their records")
    add("--keep-models", action="store_true", help="keep each run's model file (models/benchmark/; "
        "by default they are deleted: ViT-B/16's are 0.3 GB each)")
    add("--report", metavar="FILE", help="also write the report as Markdown")
    add("--peak-tflops", nargs="+", default=[], metavar="PRECISION=T", help="the device's peak TFLOP/s "
        "per precision for MFU, e.g. 32-true=67 bf16-mixed=989 (default: the table, see --peaks)")
    add("--peaks", action="store_true", help="print the peak table and exit")
    add("--no-bare", action="store_true", help="skip the bare-loop rows")
    add("--loader-images", type=whole_number(0), default=None, metavar="N",
        help="images for the input-pipeline rate (0 skips it; default 2000)")
    add("--loader-workers", nargs="+", type=whole_number(0, 64), default=None, metavar="N",
        help="worker counts to time the loader with (default 0 1 2 4)")
    add("--memory", action="store_true", help="memory per process by model and strategy (synthetic "
        "steps), beside the arithmetic; a chart too")
    add("--memory-models", nargs="+", default=None, choices=list(memory.MEMORY_MODELS), metavar="MODEL",
        help="for --memory (default: ViT-B/16 ViT-L/16; ViT-H/14 adds the largest; one of "
        f"{', '.join(memory.MEMORY_MODELS)}; --talk: ViT-B/16; --sequel: ViT-B/16 ViT-L/16)")
    add("--talk", action="store_true", help="with --memory: the talk's memory column, each script "
        "as it is at 224x224, batch 16 (docs/benchmarks.md)")
    add("--sequel", action="store_true", help="with --memory: the memory sequel's chain, 04 and "
        "11-15, on ViT-B/16 and ViT-L/16")
    add("--bare-loop", help=argparse.SUPPRESS)  # internal: one bare run (JSON)
    add("--memory-run", nargs="+", help=argparse.SUPPRESS)  # internal
    return settle(parser.parse_args(argv), parser)


def settle(args, parser):
    if (args.talk or args.sequel) and not args.memory:
        parser.error("--talk and --sequel go with --memory")
    args.memory_models_given = args.memory_models is not None
    args.memory_models = args.memory_models or (["ViT-B/16"] if args.smoke else ["ViT-B/16", "ViT-L/16"])
    if args.talk or args.sequel:
        if any(m not in memory.VIT_OF for m in args.memory_models):
            parser.error(f"--memory --talk builds the scripts' own models: {' '.join(memory.VIT_OF)}")
        if any(spec not in SCRIPTS for spec in args.scripts or []):
            parser.error(f"--memory --talk runs scripts by number at batch 16; known: {' '.join(SCRIPTS)}")
    args.memory_scripts = args.scripts if args.talk or args.sequel else None
    args.scripts = args.scripts or (throughput.SMOKE_SCRIPTS if args.smoke else [n for n in SCRIPTS if n != "00"])
    args.repeat = args.repeat or throughput.REPEAT
    args.max_steps = args.max_steps or throughput.STEPS["smoke" if args.smoke else "full"]
    args.loader_images = 2000 if args.loader_images is None else args.loader_images
    args.loader_workers = args.loader_workers or [0, 1, 2, 4]
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
    unknown = sorted(set(args.peak_tflops) - set(peaks.UNIT))
    if unknown:
        parser.error(f"--peak-tflops: {', '.join(unknown)} is no precision; one of {', '.join(peaks.UNIT)}")
    args.chose_device = args.accelerator == "auto"
    on_the_cpu = args.accelerator == "cpu" or (args.smoke and args.chose_device)  # CUDA not started
    args.gpus, args.torch_says = (0, None) if on_the_cpu else cuda_gpus()
    if args.accelerator == "auto":
        args.accelerator = "cuda" if not args.smoke and args.gpus else "cpu"  # --smoke: as the scripts
    gpus = args.gpus if args.accelerator == "cuda" else None
    args.skipped = [f"{script} needs {needed} GPUs and this machine has {gpus}" for script, _ in args.runs
                    if gpus is not None and (needed := processes_of(script, args.devices)) > gpus]
    args.runs = [(s, b) for s, b in args.runs if gpus is None or processes_of(s, args.devices) <= gpus]
    if not args.runs and not (args.memory or args.peaks or args.bare_loop or args.memory_run):
        fail("nothing to measure: " + "; ".join(args.skipped), code=SOME_FAILED)
    for flag in ("results", "report"):
        if getattr(args, flag):
            check_path(f"--{flag}", getattr(args, flag), in_place=flag == "results")  # records are appended
    return args


def measure_throughput(args):
    """The throughput report: every configuration's rounds, then the input pipeline: (the report,
    configurations failed)."""
    started = time.time()
    measured = throughput.new_measurement(args.runs)
    with tempfile.TemporaryDirectory(prefix="benchmark-") as scratch:
        for _ in range(args.repeat):
            throughput.measure_round(measured, args, scratch)
    rates = throughput.input_rates(args) if args.loader_images else None
    text = throughput.report(args, measured, peaks.flops_per_image(args.smoke), rates)
    text += "".join(f"\n- Skipped: {why}." for why in args.skipped)
    text += f"\n- The whole measurement took {(time.time() - started) / 60:.1f} min."
    return text, sum(1 for runs in measured.values() if runs["failed"])


def main(argv=None):
    args = parse_args(argv)
    if args.bare_loop:
        return throughput.bare_loop(args)
    if args.memory_run:
        return memory.memory_run(args)
    if args.peaks:
        return print("\n".join(peaks.peaks_table()))
    if args.torch_says and (args.accelerator == "cuda" or not (args.smoke or args.memory)):  # the scripts' lines
        fail(unusable_gpu_line(args.torch_says))
    if args.chose_device and args.accelerator == "cpu" and not (args.smoke or args.memory):
        cpu = "Try python benchmark.py --smoke (the small ViT), or add --accelerator cpu to insist."
        fail(no_gpu_line(f"Without --smoke this measures ViT-B/16 at 224, hours on a CPU. {cpu}"))
    if args.memory:
        text, chart, failed = memory.talk_memory(args) if args.talk or args.sequel else memory.memory_report(args)
    else:
        (text, failed), chart = measure_throughput(args), None
    print("\n" + text)
    if args.report:
        write_report(args.report, text)
        print(f"\nReport written to {args.report}")
    if chart:
        print(f"Chart written to {chart}")
    if not args.memory:
        print(f"Records appended to {args.results} (chart them with: "
              f"{chart_command('smoke-synthetic' if args.smoke else 'synthetic', args.results)})")
    if args.memory and chart is None:  # the tables' notes say why
        why = "; ".join(line[2:] for line in text.splitlines() if line.startswith("- ")) or "no run"
        fail(f"nothing was measured: {why}", code=SOME_FAILED)
    if failed:
        fail(f"{failed} configuration(s) failed; their rows say why, the others were measured.", code=SOME_FAILED)


if __name__ == "__main__":
    with tool_run():  # Ctrl-C and SIGTERM: one line; the interpreter as found afterwards
        main()
