"""The talk's comparison charts from the run records, with the talk's own figures beside ours.

    python plot_results.py                      # results/runs.jsonl -> results/comparison.png
    python plot_results.py --smoke              # the --smoke runs instead of full runs
    python plot_results.py --log my-runs.md     # also logs in the talk's text format

Keeps the latest record per script, draws training time, test accuracy, peak memory and
throughput per script (ours solid, the talk's hatched), and prints the same as a table with each
script's speedup over 01.
"""
import argparse
import csv
import json
import os
import re
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent
REFERENCE = ROOT / "talk_reference.csv"
PROG = "plot_results.py"
BASELINE = "01_pytorch-vit.py"
NEEDED = ("script", "train_time_s", "peak_memory_gb")
# (title, record key, the talk's column, how ours converts, value format)
CHARTS = [
    ("Training time (min)", "train_time_s", "time_min", lambda v: v / 60, "{:.2f}"),
    ("Test accuracy (%)", "test_acc", "test_acc_pct", lambda v: v * 100, "{:.2f}"),
    ("Peak memory (GB)", "peak_memory_gb", "memory_gb", lambda v: v, "{:.2f}"),
    ("Training throughput (images/s)", "images_per_s", None, lambda v: v, "{:.0f}"),
]


def warn(message):
    print(f"{PROG}: {message}", file=sys.stderr)


def fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def load_reference(path=REFERENCE):
    """The talk's table: {script: {technique, epochs, devices, time_min, memory_gb, ...}}."""
    with open(path) as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return {row["script"]: {k: (v if k in ("script", "technique") else float(v))
                                for k, v in row.items()} for row in rows}


def kind_of(record):
    if record.get("synthetic"):
        return "synthetic"
    return "smoke" if record.get("smoke") else "full"


def read_records(path, known):
    """Records from a JSONL file; bad lines are named, skipped and reported."""
    records = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        fail(f"cannot read {path}: {err.strerror or err}")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            warn(f"{path}:{number}: not JSON, skipped")
            continue
        if not isinstance(record, dict):
            warn(f"{path}:{number}: not a JSON object, skipped")
            continue
        missing = [key for key in NEEDED if record.get(key) is None]
        if missing:
            warn(f"{path}:{number}: record lacks {', '.join(missing)}, skipped")
            continue
        if record["script"] not in known:
            warn(f"{path}:{number}: unknown script {record['script']!r}, skipped")
            continue
        records.append(record)
    return records


LOG_PATTERNS = {
    "train_time_s": (re.compile(r"Time elapsed\s+([\d.]+)\s*min"), lambda v: v * 60),
    "peak_memory_gb": (re.compile(r"Memory used:\s*([\d.]+)\s*GB"), lambda v: v),
    "test_acc": (re.compile(r"Test accuracy\s+([\d.]+)\s*%"), lambda v: v / 100),
}


def read_log(path, known):
    """Runs from a log in the talk's text format: a '# NN_name.py' heading, then its
    'Time elapsed … min', 'Memory used: … GB' and 'Test accuracy …%' lines."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        fail(f"cannot read {path}: {err.strerror or err}")
    records = []
    # headings as the talk's logs.md writes them: "# 00_pytorch-vit-random-init.py (finetuning ...)"
    sections = re.split(r"^#+\s*(\d\d_[\w.-]+\.py)\b.*$", text, flags=re.M)
    for script, body in zip(sections[1::2], sections[2::2]):
        if script not in known:
            warn(f"{path}: unknown script {script!r}, skipped")
            continue
        record = {"script": script, "device_name": f"log {Path(path).name}", "world_size": None,
                  "images_per_s": None, "smoke": False, "synthetic": False}
        for key, (pattern, convert) in LOG_PATTERNS.items():
            found = pattern.findall(body)
            record[key] = convert(float(found[-1])) if found else None
        missing = [key for key in NEEDED if record.get(key) is None]
        if missing:
            warn(f"{path}: {script} lacks {', '.join(missing)}, skipped")
            continue
        records.append(record)
    if not records:
        warn(f"{path}: no run in the talk's log format found")
    return records


def select(records, kind):
    """The latest record per script of the asked kind, or of whatever kind exists."""
    kinds = [kind] if kind else ["full", "smoke", "synthetic"]
    for chosen in kinds:
        latest = {}
        for record in records:  # later lines are later runs
            if kind_of(record) == chosen:
                latest[record["script"]] = record
        if latest:
            if not kind and chosen != "full":
                warn(f"no full runs found: showing {chosen} runs (not comparable to the talk)")
            return chosen, latest
    return kind or "full", {}


def hardware(latest):
    names = {}
    for record in latest.values():
        count = record.get("world_size")
        label = record.get("device_name") or "unknown device"
        names.setdefault(label, set()).add(count)
    parts = []
    for name, counts in names.items():
        counts = sorted(c for c in counts if c)
        parts.append(name + (f" x {'/'.join(map(str, counts))}" if counts else ""))
    return "; ".join(parts)


def table(latest, reference, kind):
    """The comparison as text: ours beside the talk's, and each script's speedup over 01."""
    def speedup(t01, t):
        return f"{t01 / t:.2f}x" if t01 and t else "-"
    ours01 = latest.get(BASELINE, {}).get("train_time_s")
    talk01 = reference[BASELINE]["time_min"]
    header = (f"{'script':<34} {'time min':>9} {'talk':>7} {'acc %':>7} {'talk':>7} "
              f"{'mem GB':>7} {'talk':>6} {'img/s':>8} {'speedup':>8} {'talk':>6}")
    lines = [f"Ours: {kind} runs on {hardware(latest)}. Talk: its published figures.", header]
    for script in sorted(latest):
        r, t = latest[script], reference[script]
        acc = f"{r['test_acc'] * 100:.2f}" if r.get("test_acc") is not None else "-"
        ips = f"{r['images_per_s']:.1f}" if r.get("images_per_s") is not None else "-"
        lines.append(
            f"{script:<34} {r['train_time_s'] / 60:>9.2f} {t['time_min']:>7.2f} {acc:>7} "
            f"{t['test_acc_pct']:>7.2f} {r['peak_memory_gb']:>7.2f} {t['memory_gb']:>6.2f} "
            f"{ips:>8} {speedup(ours01, r['train_time_s']):>8} "
            f"{speedup(talk01, t['time_min']):>6}")
    if kind != "full":
        lines.append(f"({kind} runs: a small model on small data; not a reproduction of the talk)")
    return "\n".join(lines)


def draw(latest, reference, kind, output):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scripts = sorted(latest)
    labels = [s.split("_")[0] + "\n" + textwrap.fill(reference[s]["technique"], 16)
              for s in scripts]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), dpi=100)
    width = 0.38
    for ax, (title, key, talk_key, convert, fmt) in zip(axes.flat, CHARTS):
        ours = [convert(latest[s][key]) if latest[s].get(key) is not None else 0 for s in scripts]
        xs = range(len(scripts))
        bars = ax.bar([x - width / 2 for x in xs], ours, width, color="#1f77b4",
                      label=f"ours ({kind})")
        for bar, s, value in zip(bars, scripts, ours):
            text = fmt.format(value) if latest[s].get(key) is not None else "n/a"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        if talk_key:
            talk = [reference[s][talk_key] for s in scripts]
            talk_bars = ax.bar([x + width / 2 for x in xs], talk, width, color="white",
                               edgecolor="#888888", hatch="//", label="talk (published)")
            for bar, value in zip(talk_bars, talk):
                ax.annotate(fmt.format(value), (bar.get_x() + bar.get_width() / 2,
                                                bar.get_height()),
                            ha="center", va="bottom", fontsize=8, color="#555555")
        else:
            ax.text(0.99, 0.97, "talk: not published", transform=ax.transAxes, ha="right",
                    va="top", fontsize=8, color="#555555")
        ax.set_title(title)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.margins(y=0.15)
    headline = f"Ours: {kind} runs on {hardware(latest)}"
    if kind != "full":
        headline += f" -- {kind.upper()} RUNS, NOT A REPRODUCTION OF THE TALK"
    if kind == "smoke":
        headline += ("\n(smoke: a 3-layer ViT from random init on 8x8 digits in every script; "
                     "memory on a CPU is the peak resident memory of the process)")
    fig.suptitle(headline + "\nTalk (hatched): its published runs on its GPUs "
                 "(1 GPU; 4 GPUs for 05-07)", fontsize=10)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".comparison-", suffix=".png", dir=output.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, output)  # whole or not at all
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results/runs.jsonl", metavar="FILE",
                        help="run records, one JSON object per line (default results/runs.jsonl)")
    parser.add_argument("--log", action="append", default=[], metavar="FILE",
                        help="also read a log in the talk's text format (repeatable)")
    parser.add_argument("--output", default="results/comparison.png", metavar="PNG",
                        help="default results/comparison.png")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--smoke", action="store_const", const="smoke", dest="kind",
                       help="chart the --smoke runs")
    which.add_argument("--synthetic", action="store_const", const="synthetic", dest="kind",
                       help="chart the --synthetic (benchmark) runs")
    args = parser.parse_args(argv)

    reference = load_reference()
    records = []
    if Path(args.results).exists() or not args.log:
        records += read_records(args.results, reference)
    for log in args.log:
        records += read_log(log, reference)
    if not records:
        fail(f"nothing to draw: no usable run in {', '.join([args.results, *args.log])}")
    kind, latest = select(records, args.kind)
    if not latest:
        fail(f"nothing to draw: no {kind} runs (drop --{kind} to chart what there is)")
    print(table(latest, reference, kind))
    draw(latest, reference, kind, args.output)
    print(f"Chart written to {args.output}")


if __name__ == "__main__":
    main()
