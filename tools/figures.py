"""The figures of the README and docs/, made from the project's own records in reference/. Each
passage between `<!-- figures: NAME -->` and `<!-- end of figures -->` is written by the function
NAME below; the charts in reference/ are drawn from the same records. A user's runs never write
reference/: its records are added by hand, from runs made for the purpose.

    python tools/figures.py            # rewrite every block
    python tools/figures.py --charts   # and redraw the charts in reference/
    python tools/figures.py --check    # which blocks differ from their records (exit 1); the tests run it
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.reports import markdown_table  # noqa: E402
from run_keeping.reading import read_records, read_runs, whole  # noqa: E402
from run_keeping.record import write_atomically  # noqa: E402
from run_keeping.config import VITS, fail  # noqa: E402
from run_keeping.reading import lessons

REFERENCE = ROOT / "reference"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- figures: ([\w-]+) -->\n)(.*?)(<!-- end of figures -->)", re.S)


def when(records):
    machines = sorted({r["device_name"].replace("CPU ", "").split(" (")[0]
                       + (f" ({r['device_name'].split('(')[-1]}" if "(" in r["device_name"] else "") for r in records})
    dates = sorted({r["timestamp"][:10] for r in records})
    span = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return f"{' and '.join(machines)}, {span}"


def smoke_runs():
    return [r for r in read_runs(REFERENCE / "smoke-runs.jsonl") if whole(r)]


def seeds_of(script, records):
    return {r["seed"]: r for r in records if r["script"] == script}


def accuracy(values):
    return " / ".join(f"{v * 100:.2f}" for v in values)


def changed_lines(a, b):
    out = subprocess.run(["diff", str(ROOT / a), str(ROOT / b)], capture_output=True, text=True)
    return sum(line[:1] in "<>" for line in out.stdout.splitlines())


def memory_rows(table, vit=None, runs="memory-runs.jsonl"):
    from benchmarks import memory
    reference = lessons()
    records = [r for r in read_runs(REFERENCE / runs) if r["memory_table"] == table
               and (vit is None or r["model"] == vit)]
    return [memory.row_of(r, r["libraries_gb"], reference) for r in records]


# -- the blocks ----------------------------------------------------------------------------------
def published(row):
    """A script's published figures: the talk's, or the sequel's in italics where its step matches."""
    keys = ("time_min", "memory_gb", "test_acc_pct")
    if row["time_min"]:
        return [f"{row[k]:.2f}" for k in keys]
    if row["sequel_memory_gb"]:
        wrap = "(*{:.2f}*)" if row["script"].startswith("14") else "*{:.2f}*"
        return [wrap.format(row["sequel_" + k]) for k in keys]
    return ["—"] * 3


def scripts():
    """README: the one table of the scripts."""
    rows = lessons()
    memory = {r["number"]: r for r in memory_rows("sequel", "vit_b_16") + memory_rows("talk")}  # the talk's first
    smoke = smoke_runs()
    names = {script[:2]: script for script in rows}
    cells = []
    for script, row in rows.items():
        changed = f"{changed_lines(names[row['against']], script)} ({row['budget']})" if row["against"] else "—"
        m = memory.get(script[:2])
        processes = f" ({m['record']['world_size']} processes)" if m and m["record"]["world_size"] > 1 else ""
        mem = f"{m['less']:.2f}{processes}" if m else "—"
        seeds = seeds_of(script, smoke)
        acc = f"{statistics.mean(r['test_acc'] for r in seeds.values()) * 100:.2f}" if seeds else "—"
        if 0 < len(seeds) < 3:
            acc += f" ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})"
        cells.append([f"`{script}`", row["technique"], row["against"] or "—", changed, *published(row), mem, acc])
    return "\n".join([f"Memory measured on {when([m['record'] for m in memory.values()])}; `--smoke` on "
                      f"{when(smoke)} (`reference/`).", "", *markdown_table(
                          ["script", "technique", "against", "changed lines (budget)", "talk: min", "talk: GB",
                           "talk: acc. %", "memory GB (CPU)", "`--smoke` acc. %"], cells)])


def smoke_table(numbers, caption_scripts):
    reference = lessons()
    records, names = smoke_runs(), {s[:2]: s for s in reference}
    chosen = [r for r in records if r["script"][:2] in numbers]
    seeds = sorted({r["seed"] for r in chosen}, key=[123, 1, 2].index)
    cells = []
    for number in numbers:
        runs = seeds_of(names[number], records)
        values = [runs[s]["test_acc"] for s in seeds if s in runs]
        cells.append([f"{number}, {reference[names[number]]['technique']}", runs[seeds[0]]["epochs"], accuracy(values),
                      f"{statistics.mean(values) * 100:.2f}",
                      f"{statistics.mean(r['train_time_s'] for r in runs.values()):.1f}"])
    return "\n".join([f"Measured on {when(chosen)} (`reference/smoke-runs.jsonl`, {caption_scripts}):", "",
                      *markdown_table(["script", "epochs", f"test accuracy %, seeds {' / '.join(map(str, seeds))}",
                                       "mean", "training s, mean"], cells)])


def smoke_seeds():
    return smoke_table(["00", "01", "03", "04"], "charted in `reference/smoke-comparison.png`")


def memory_lessons_smoke():
    return smoke_table(["04", "11", "12", "13", "14", "15"], "the lessons beside 04")


def fast_recipe_smoke():
    return smoke_table(["04", "09"], "09 beside 04")


def memory_table(table, runs="memory-runs.jsonl"):
    from benchmarks import memory
    rows = memory_rows(table, runs=runs)
    records = [r["record"] for r in rows]
    cuda = records[0]["accelerator"] == "cuda"
    libraries = "" if cuda else f"; the libraries held {rows[0]['record']['libraries_gb']:.2f} GB"
    return (f"Measured on {when(records)}, each run's record in `reference/{runs}`{libraries}:\n\n"
            + memory.memory_tables(rows, rows[0]["record"]["libraries_gb"], [], cuda=cuda).split("\n", 2)[2])


def memory_talk_h200():
    return memory_table("talk", "memory-talk-h200.jsonl")


def memory_talk():
    return memory_table("talk")


def memory_sequel():
    return memory_table("sequel")


def memory_strategies():
    from benchmarks import memory
    return memory.strategy_table(read_records(REFERENCE / "memory-strategies.jsonl"))


def throughput_smoke():
    return (REFERENCE / "benchmark-smoke.md").read_text().strip()


def throughput_rows(records, flops):
    """benchmark.py's rows made again from a run's records, in their order."""
    from benchmarks import throughput
    measured = throughput.new_measurement(dict.fromkeys((r["script"], r["batch_size"]) for r in records))
    for record in records:
        measured[(record["script"], record["batch_size"])]["records"].append(record)
    return throughput.rows_of(measured, flops, argparse.Namespace(peak_tflops=None))


def throughput_smoke_repeats():
    """docs/benchmarks.md: the ranking of benchmark.py --smoke's runs one after another."""
    from benchmarks import throughput
    runs = [*sorted((REFERENCE / "benchmark-smoke-runs").glob("*.jsonl"), key=lambda p: int(p.stem)),
            REFERENCE / "benchmark-smoke.jsonl"]
    lines = []
    for path in runs:
        records = read_runs(path)
        rows = throughput_rows(records, 0.0)
        first = min(r["timestamp"] for r in records)
        lines.append(f"- {first[:10]} {first[11:16]} UTC: {throughput.ranking(rows)[1]}")
    return (f"`python benchmark.py --smoke`, {len(runs)} runs on the idle {when(read_runs(runs[-1]))}, "
            "ranked from fastest to slowest:\n\n" + "\n".join(lines))


def run_machine(r):
    """The commit and machine a run of the tests ran on, and how long a process's imports took then."""
    machine = when([r]).rsplit(", ", 1)[0].replace(")", f", {r['capability']} alone)" if r.get("capability") else ")")
    speed = f", where a process's imports took {r['import_s']:.1f} s then" if r.get("import_s") else ""
    capped = ", oneDNN capped at AVX2: no native bfloat16" if r.get("onednn_max_cpu_isa") else ""
    return f"at {r['commit']}, {machine}{speed}{capped}"


def suite_time():
    """The latest run of the whole suite and of the quick tier, and every run of the whole suite at that commit."""
    runs = read_records(REFERENCE / "test-suite-runs.jsonl")
    full, quick = ([r for r in runs if r["tier"] == tier][-1] for tier in ("all", "quick"))
    same = [r for r in runs if r["tier"] == "all" and r["commit"] == full["commit"]]

    def minutes(run):
        return f"{int(run['seconds'] // 60)} min {int(round(run['seconds'] % 60))} s"
    outcome = ", ".join(f"{full[k]} {k}" for k in ("passed", "failed", "skipped") if full.get(k))
    where = "in a virtual environment, " if full.get("install") == "venv" else ""
    green = sum(not r.get("failed") and not r.get("errors") for r in same)
    series = f"; {green} of {len(same)} runs at that commit green, in {', '.join(minutes(r) for r in same)}" if len(same) > 1 else ""
    cache = "as an earlier run left it" if full.get("compile_cache") == "warm" else "empty"
    return (f"The whole suite: {full['tests']} tests in {minutes(full)} ({outcome}{series}), the quick tier in "
            f"{quick['seconds']:.0f} s, {where}from a clean clone with torch.compile's cache {cache}, {run_machine(full)}, "
            f"{full['timestamp'][:10]} (`reference/test-suite-runs.jsonl`).")


def warm_start():
    runs = {r["commit"]: r for r in read_records(REFERENCE / "test-suite-runs.jsonl") if r["tier"] == "all"}
    fresh, forked = runs["360724a"], runs["7b8d8d0"]
    return (f"on {when([fresh]).rsplit(', ', 1)[0]}, the whole suite took {fresh['seconds'] / 60:.1f} min with a "
            f"fresh interpreter for every script ({fresh['commit']}, {fresh['tests']} tests) and "
            f"{forked['seconds'] / 60:.1f} min with them forked ({forked['commit']}, {forked['tests']} tests) "
            "(`reference/test-suite-runs.jsonl`).")


def smoke_weights():
    committed = json.loads((ROOT / "smoke_weights" / "smoke-vit-printed-digits.json").read_text())
    again = json.loads((REFERENCE / "smoke-weights-made-again.json").read_text())
    return (f"The suite's weights read {committed['pretext_test_accuracy'] * 100:.1f}% of 2,000 unseen printed digits. "
            f"Made again on {again['machine'].replace('CPU ', '')} ({again['made'][:10]}; "
            f"`reference/smoke-weights-made-again.json`), in {again['seconds']} s, they read "
            f"{again['pretext_test_accuracy'] * 100:.1f}%, with "
            + ("the same tensors." if again["same_tensors_as_the_suites"] else
               "other tensors: this CPU's kernels round differently over the 1,500 steps."))


def save_time():
    records = read_runs(REFERENCE / "save-time-runs.jsonl")
    cells = [[VITS[r["model"]], f"{r['parameters_per_process'][0] / 1e6:.0f} M",
              f"{12 * r['parameters_per_process'][0] / 1e9:.2f}", ", ".join(f"{s:.1f}" for s in r["checkpoint_s"])]
             for r in records]
    return "\n".join([f"Measured on {when(records)} (`reference/save-time-runs.jsonl`: 04 `--synthetic "
                      "--accelerator cpu --max-steps 4 --epochs 3`, one checkpoint an epoch):", "", *markdown_table(
                          ["model", "parameters", "checkpoint: float32 weights and Adam's two moments, GB",
                           "seconds to write, each epoch's"], cells)])


def epochs():
    from run_keeping.config import SMOKE_EPOCHS
    by = {}
    for script, row in lessons().items():
        if not row["epochs"]:
            continue  # 08 trains nothing
        full = row["epochs"]
        by.setdefault((full, SMOKE_EPOCHS.get(full, 2)), []).append(script[:2])
    return "; ".join(f"{', '.join(numbers)}: {full} (`--smoke`: {smoke})" for (full, smoke), numbers in by.items())


def lesson_flags():
    """docs/flags-records-exit-codes.md: each lesson's own flags, as its script declares them (add_argument)."""
    rows = []
    for script in (script for script, row in lessons().items() if row["epochs"]):  # 08 is a program of its own
        rows += flag_rows(script)
    return "\n".join(markdown_table(["flag", "lesson", "declared with", "default", ""], rows))


def flag_rows(script):
    """The flags table's row of each of a lesson's own flags: its names, the lesson, its declaration, default, help."""
    from run_keeping.reading import lesson_flags
    rows = []
    for names, keywords in lesson_flags(script):
        takes = [f"`{k}={v}`" for k, v in keywords.items() if k in ("type", "choices", "action", "nargs", "dest")]
        action = keywords.get("action", "")
        default = keywords.get("default", "None")
        if "store_true" in action or "store_false" in action:
            default = "off" if "store_true" in action else "on"
        if "BooleanOptionalAction" in action:  # argparse adds --no-NAME to each --NAME; its default is on or off
            names = [*names, *(f"--no-{name[2:]}" for name in names if str(name).startswith("--"))]
            default = "on" if keywords.get("default") == "True" else "off"
        rows.append([f"`{', '.join(map(str, names))}`", Path(script).name[:2], ", ".join(takes), f"`{default}`",
                     " ".join(literal_text(keywords.get("help", "")).split())])
    return rows


def literal_text(source):
    """A keyword's source as its value where it is a literal (a help text), else the source."""
    import ast
    try:
        return str(ast.literal_eval(source))
    except (ValueError, SyntaxError):
        return source


def no_bf16_smoke():
    """docs/smoke.md: the bf16 lessons' smoke runs without native bfloat16 (rehearsed, then on an
    AVX2-only CPU), each beside 03's."""
    probes = read_records(REFERENCE / "bf16-probe.jsonl")
    capped = next(p for p in probes if p["onednn_max_cpu_isa"])
    free = next(p for p in probes if not p["onednn_max_cpu_isa"] and not p["aten_cpu_capability"] and p["native"])
    real = next(p for p in probes if not p["onednn_max_cpu_isa"] and not p["native"])
    records = read_runs(REFERENCE / "no-bf16-smoke-runs.jsonl")
    avx2 = read_runs(REFERENCE / "no-bf16-smoke-runs-avx2.jsonl")
    return "\n".join([
        f"Measured on {when(records)} (`reference/no-bf16-smoke-runs.jsonl`; the products: "
        "`reference/bf16-probe.jsonl`, `python tools/bf16_probe.py`):", "",
        f"- a {capped['size']}x{capped['size']} product on one thread, oneDNN capped at AVX2: bfloat16 "
        f"{capped['bf16_gflops']:.1f} GFLOP/s against float32's {capped['fp32_gflops']:.1f}, "
        f"{capped['fp32_gflops'] / capped['bf16_gflops']:.0f} times slower; without the cap, "
        f"{free['bf16_gflops']:.1f} against {free['fp32_gflops']:.1f};", "",
        *no_bf16_table(records, read_runs(REFERENCE / "bf16-native-smoke-runs.jsonl")), "",
        f"And on {when(avx2)}, whose torch runs its `{real['capability']}` code and whose oneDNN has no "
        f"bfloat16 kernels (`reference/no-bf16-smoke-runs-avx2.jsonl`): the same product, bfloat16 "
        f"{real['bf16_gflops']:.1f} GFLOP/s against float32's {real['fp32_gflops']:.1f}, "
        f"{real['fp32_gflops'] / real['bf16_gflops']:.0f} times slower:", "",
        *no_bf16_table(avx2, [])])


def no_bf16_table(records, native_records):
    three = next(r for r in records if r["script"].startswith("03"))
    native = {r["script"]: r for r in native_records}
    base = native.get(three["script"])
    cells = [[r["script"], r["precision_asked"], r["precision"], f"{r['run_s']:.1f}",
              f"{r['run_s'] / three['run_s']:.2f}", f"{r['train_time_s']:.1f}", f"{r['test_acc'] * 100:.2f}",
              *([f"{native[r['script']]['run_s'] / base['run_s']:.2f}" if r["script"] in native and base else "-"]
                if native else [])]
             for r in records]
    against = ["bfloat16 native: against 03's (`reference/bf16-native-smoke-runs.jsonl`)"] if native else []
    return markdown_table(["script", "asks", "ran", "seconds, start to record", "against 03's", "training s",
                           "test accuracy %", *against], cells)


def h200_rows():
    from benchmarks import peaks
    checks = [read_runs(REFERENCE / f"gpu-check-h200-{n}.jsonl") for n in (1, 2)]
    return checks, [throughput_rows(records, peaks.flops_per_image(smoke=False)) for records in checks]


def gpu_check_h200():
    """README: what gpu_check.sh measured on the H200 beside the talk's figures (with its GPUs where
    ours had fewer processes)."""
    from benchmarks.throughput import ratio
    reference, cells = lessons(), []
    checks, rows = h200_rows()
    for row in (r for check in rows for r in check):
        script, batch = row["script"], row["batch"]
        if script.startswith("01") and any(c[0].startswith("01") and c[1] == batch for c in cells):
            continue  # 01 again as the second check's baseline: the first check's rounds are its figure
        talk = reference[script]
        talk_speedup = reference["01_pytorch-vit.py"]["time_min"] / talk["time_min"] if talk["time_min"] else None
        on = f" ({talk['devices']} GPUs)" if (talk["devices"] or 1) != row["devices"] else ""  # not like with like
        cells.append([f"{script[:2]} {talk['technique'].split(',')[0]}", batch, row["precision"], row["devices"],
                      row["n"], ratio(row["images_per_s"], "{:.0f}"),
                      "1.00" if script.startswith("01") else ratio(row["vs_01"]), f"{row['memory_gb']:.2f}",
                      f"{talk_speedup:.2f}{on}" if talk_speedup and batch == 16 else "—",
                      f"{talk['memory_gb']:.2f}{on}" if talk["memory_gb"] and batch == 16 else "—"])
    cells.sort(key=lambda c: (c[1], c[0][:2]))
    records = [r for check in checks for r in check]
    return "\n".join([
        f"Measured on {when(records)} (torch {records[0]['torch']}, Lightning {records[0]['lightning']}; "
        "`reference/gpu-check-h200-1.md` and `-2.md`): ViT-B/16 at 224 on "
        "synthetic images from random init, 40 steps a run (3 untimed), each ratio against the 01 run of "
        "its own round; rounds in brackets. Throughput, not accuracy: no CIFAR-10 there.", "",
        *markdown_table(["script", "batch", "precision", "processes", "rounds", "images/s", "vs 01",
                         "peak GB", "talk: speedup", "talk: GB"], cells)])


def gpu_check_findings():
    """docs/benchmarks.md: what the checks on the H200 took and showed: minutes, a run's own cost, 02's
    first compile, MFU."""
    checks, rows = h200_rows()
    reports = [(REFERENCE / f"gpu-check-h200-{n}.md").read_text() for n in (1, 2)]
    used = [re.findall(r"Time: ([\d.]+) of the (\d+) min", report)[0] for report in reports]
    own = []  # seconds between two records less the later run's training: a process's own cost
    for rs in [*checks, read_runs(REFERENCE / "memory-talk-h200.jsonl")]:
        for before, r in zip(rs, rs[1:]):
            if not r.get("compiled"):
                own.append((datetime.fromisoformat(r["timestamp"]) - datetime.fromisoformat(before["timestamp"]))
                           .total_seconds() - r["train_time_s"])
    compiled = next(r for r in checks[1] if r["script"].startswith("02"))
    plain = next(r for r in checks[1] if r["script"].startswith("01"))
    first = {(r["script"][:2], r["batch"]): r for r in rows[0]}
    failed = sum(1 for check in rows for r in check if r["failed"])
    (m01, _), (m01b, _), (m04, step04), (m04b, step04b) = [
        (first[key]["mfu"], key[1] / first[key]["images_per_s"][0]) for key in
        (("01", 16), ("01", 128), ("04", 16), ("04", 128))]
    return "\n".join([
        f"- Time: {used[0][0]} and {used[1][0]} of their {used[0][1]} min; "
        + (f"{failed} configuration(s) failed." if failed else "no configuration failed."),
        f"- A run's own cost beside its steps (the time between two records less the later run's "
        f"training: imports, CUDA's set-up, the model, its checkpoint and model file): "
        f"{min(own):.0f}-{max(own):.0f} s, {statistics.median(own):.0f} s in the median. The plan's guess "
        "(above) is fitted to it.",
        f"- 02's first compile: {compiled['train_time_s'] - plain['train_time_s']:.0f} s (its training "
        "time less 01's in the same round).",
        f"- MFU: 01 (float32) {m01:.1%} of FP32's dense peak at batch 16, {m01b:.1%} at 128; 04 "
        f"(bf16-mixed) {m04:.1%} of BF16's at batch 16, {m04b:.1%} at 128. 04's step takes "
        f"{step04 * 1000:.0f} ms at batch 16 and {step04b * 1000:.0f} ms at 128, 8 times the images: at the "
        "talk's batch the GPU mostly waits for the host to launch its kernels, and bf16's speedup shows at "
        "the larger batch."])


def gpu_check_plan():
    from benchmarks import gpu_check
    plan = gpu_check.plan(gpu_check.parse_args([]))  # its titles name the lessons lessons.csv gives each stage
    cells = [[f"{number}. {name}", title, " ".join(s[:2] for s, _ in runs) or "-", settings.get("rounds", "-")]
             for number, (name, kind, title, settings, runs) in enumerate(plan, 1)]
    defaults = ", ".join(f"{kind} {seconds} s" for kind, seconds in gpu_check.DEFAULT_S["full"].items())
    return "\n".join([*markdown_table(["stage", "what it measures", "lessons", "rounds"], cells), "", "Before a "
                      f"run of its kind has run in the check, a run is planned at a plain default: {defaults}."])


def rewritten(text):
    names = []

    def make(match):
        names.append(match[2])
        block = globals().get(match[2].replace("-", "_"))  # a block's NAME is its function's
        if not callable(block):
            raise SystemExit(f"figures.py: error: no block called {match[2]!r}")
        return match[1] + block().strip() + "\n" + match[4]
    return BLOCK.sub(make, text), names


def differing():
    found = []
    for page in PAGES:
        text = page.read_text()
        new, names = rewritten(text)
        if new != text:
            old_blocks = dict((m[2], m[3]) for m in BLOCK.finditer(text))
            new_blocks = dict((m[2], m[3]) for m in BLOCK.finditer(new))
            found.append((page.relative_to(ROOT).as_posix(), [n for n in names if old_blocks[n] != new_blocks[n]]))
    return found


def charts():
    import plot_results
    from benchmarks import memory
    records = smoke_runs()
    kind, latest, _ = plot_results.select(records, "smoke")
    plot_results.save(plot_results.figure(latest, lessons(), kind), REFERENCE / "smoke-comparison.png")
    for table in ("talk", "sequel"):
        rows = memory_rows(table)
        memory.staircase_chart(rows, REFERENCE / f"memory-{table}.png", rows[0]["record"]["device_name"],
                                         when=datetime.fromisoformat(rows[-1]["record"]["timestamp"]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="say which blocks differ; change nothing")
    parser.add_argument("--charts", action="store_true", help="also redraw the charts in reference/")
    args = parser.parse_args(argv)
    if args.check:
        try:
            found = differing()
        except ValueError as err:
            fail(err)
        for page, names in found:
            print(f"{page}: {', '.join(names)} differ from their records (python tools/figures.py makes them again)")
        sys.exit(1 if found else 0)
    try:  # every page made before any is written: all of them, or none
        made = {page: rewritten(page.read_text())[0] for page in PAGES}
    except ValueError as err:  # a row of lessons.csv it cannot read: reading.lessons names it
        fail(f"{err}; no page was written")
    for page, new in made.items():
        if new != page.read_text():
            write_atomically(page, new.encode())
    if args.charts:
        charts()
    print("figures.py: every block made again from reference/" + (", and the charts" if args.charts else ""))


if __name__ == "__main__":
    main()
