"""The talk's comparison charts from the run records, with the talk's own figures beside ours.

    python plot_results.py                      # results/runs.jsonl -> results/charts.png
    python plot_results.py --smoke              # the --smoke runs instead of full runs
    python plot_results.py --log examples/talk-log.md   # also logs in the talk's text format

The latest record per script and seed; training time, test accuracy, peak memory and throughput
per script (the talk's hatched beside full runs only: a smoke or synthetic run is another model on
other data), and a table with each script's speedup over 01 (images/s over 01's; for the talk and
for logs, which publish no throughput, 01's training time over the script's). Several seeds: the
bar is their mean, the error bar their range.
"""
import json
import os
import re
import sys
import tempfile
import textwrap
from pathlib import Path

from benchmarks.reports import chart_command
from run_keeping.config import Parser, check_path, fail
from run_keeping.reading import tool_run
from run_keeping.reading import lessons
from run_keeping.reading import read_runs, upgrade, whole

ROOT = Path(__file__).resolve().parent
BASELINE = "01_pytorch-vit.py"
NEEDED = ("script", "train_time_s", "peak_memory_gb")
NEW_LESSON = " (a lesson of your own? add its row to lessons.csv: docs/adding-a-lesson.md)"
# (title, record key, the talk's column, how ours converts, value format)
CHARTS = [
    ("Training time (min)", "train_time_s", "time_min", lambda v: v / 60, "{:.2f}"),
    ("Test accuracy (%)", "test_acc", "test_acc_pct", lambda v: v * 100, "{:.2f}"),
    ("Peak memory (GB)", "peak_memory_gb", "memory_gb", lambda v: v, "{:.2f}"),
    ("Training throughput (images/s)", "images_per_s", None, lambda v: v, "{:.0f}"),
]


def warn(message):
    print(f"plot_results.py: {message}", file=sys.stderr)


def usable_records(path, known):
    """The records of a JSONL file that can be charted; bad lines are named and skipped."""
    try:
        records = read_runs(path, skip=lambda number, why: warn(f"{path}:{number}: {why}, skipped"), numbered=True)
    except OSError as err:
        fail(f"cannot read {path}: {err.strerror or err}")
    usable = []
    for number, record in records:
        missing = [key for key in NEEDED if record[key] is None]
        if missing:
            warn(f"{path}:{number}: record lacks {', '.join(missing)}, skipped")
        elif record["script"] not in known:
            warn(f"{path}:{number}: unknown script {record['script']!r}, skipped{NEW_LESSON}")
        else:
            usable.append(record)
    return usable


LOG_PATTERNS = {
    "train_time_s": (re.compile(r"Time elapsed\s+([\d.]+)\s*min"), lambda v: v * 60),
    "peak_memory_gb": (re.compile(r"Memory used:\s*([\d.]+)\s*GB"), lambda v: v),
    "test_acc": (re.compile(r"Test accuracy\s+([\d.]+)\s*%"), lambda v: v / 100),
}


def read_log(path, known):
    """Runs from a log in the talk's text format: a '# NN_name.py' heading, then its time, memory and
    accuracy lines."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        fail(f"cannot read {path}: {err.strerror or err}")
    records = []
    # headings as the talk's logs.md writes them: "# 00_pytorch-vit-random-init.py (finetuning ...)"
    sections = re.split(r"^#+\s*(\d\d_[\w.-]+\.py)\b.*$", text, flags=re.M)
    for script, body in zip(sections[1::2], sections[2::2]):
        if script not in known:
            warn(f"{path}: unknown script {script!r}, skipped{NEW_LESSON}")
            continue
        record = upgrade({"script": script, "device_name": f"log {Path(path).name}", "kind": "full"})
        for key, (pattern, convert) in LOG_PATTERNS.items():
            found = pattern.findall(body)
            record[key] = convert(float(found[-1])) if found else None
        missing = [key for key in NEEDED if record[key] is None]
        if missing:
            warn(f"{path}: {script} lacks {', '.join(missing)}, skipped")
            continue
        records.append(record)
    if not records:
        warn(f"{path}: no run in the talk's log format found")
    return records


KINDS = ("full", "smoke", "synthetic", "smoke-synthetic")
# What a bar of each kind measured, for its legend; only full runs share an axis with the talk's.
MEASURED = {"full": "ViT-B/16 on CIFAR-10", "smoke": "3-layer ViT on 8x8 digits",
            "synthetic": "ViT on random images", "smoke-synthetic": "3-layer ViT on random images"}
SPREAD = ("train_time_s", "test_acc", "peak_memory_gb", "images_per_s")


def configuration(record):
    """What a ratio may be formed across: runs of the same kind, per-process batch, model and
    processes; and what keeps runs apart: the lesson's own settings (its own flags)."""
    own = tuple(sorted((flag, json.dumps(value)) for flag, value in (record.get("settings") or {}).items()))
    return (record["kind"], record["batch_size"], record["model"], record["world_size"], own)


def select(records, kind, everything=False):
    """(kind, runs, what was left out): the runs of the asked kind (or the first that exists), the
    latest per script, configuration and seed, summarised per script and configuration; runs cut
    short by --max-steps only with `everything`."""
    left_out = [] if everything else [r for r in records if not whole(r)]
    records = [r for r in records if everything or whole(r)]
    for chosen in [kind] if kind else KINDS:
        runs = {}
        for record in records:  # later lines are later runs
            if record["kind"] == chosen:
                runs.setdefault((record["script"], configuration(record)), {})[record["seed"]] = record
        if runs:
            if not kind and chosen != "full":
                warn(f"no full runs found: showing {chosen} runs (not comparable to the talk)")
            notes = [f"left out, cut short by --max-steps {r['max_steps']} (a debugging run, not a "
                     f"result; --all includes it): {r['script']} seed {r['seed']}"
                     for r in left_out if r["kind"] == chosen]
            latest = {key: summarise(list(by_seed.values())) for key, by_seed in sorted(runs.items(), key=order)}
            return chosen, latest, notes
    return kind or "full", {}, []


def order(item):
    (script, (kind, batch, model, processes, own)), _ = item
    return script, batch or 0, str(model), processes or 0, own


def summarise(runs):
    """One script's runs (one per seed) as one: the latest's fields, each figure the mean, with n and
    each (min, max) in "range"."""
    ranges = {}
    summary = dict(runs[-1], n=len(runs), range=ranges)
    for key in SPREAD:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            summary[key] = sum(values) / len(values)
            ranges[key] = (min(values), max(values))
    return summary


def hardware(latest):
    names = {}
    for record in latest.values():
        names.setdefault(record["device_name"] or "unknown device", set()).add(record["world_size"])
    parts = []
    for name, counts in names.items():
        counts = sorted(c for c in counts if c)
        processes = " or ".join(map(str, counts))
        parts.append(name + (f", {processes} process{'es' if counts != [1] else ''} per run"
                             if counts else ""))
    return "; ".join(parts)


SPEEDUP = ("speedup: training images/s over 01's of the same kind, batch, model and processes; "
           "for the talk and for runs without a throughput: 01's training time over the script's")


def speedup(record, baseline):
    """Throughput over the baseline's (training time where either lacks one); None without a baseline
    of the same configuration."""
    if not record or not baseline or configuration(record)[:4] != configuration(baseline)[:4]:
        return None
    if record["images_per_s"] and baseline["images_per_s"]:
        return record["images_per_s"] / baseline["images_per_s"]
    if record["train_time_s"] and baseline["train_time_s"]:
        return baseline["train_time_s"] / record["train_time_s"]
    return None


def baseline_of(key, latest):
    return latest.get((BASELINE, (*key[1][:4], ())))  # 01's run of the configuration: 01 has no settings of its own


def differences(record, reference):
    """What a run did otherwise than the talk's run of its script."""
    talk = reference.get(record["script"], {})
    found = []
    if record["precision"] and record["precision"] != record["precision_asked"]:
        found.append(f"ran {record['precision']}")
    if record["batch_size"] and record["batch_size"] != 16:
        found.append(f"batch {record['batch_size']}")
    if record["world_size"] and talk.get("devices") and record["world_size"] != talk["devices"]:
        found.append(f"{record['world_size']} process{'es' if record['world_size'] > 1 else ''}")
    if record["model"] not in (None, "vit_b_16", "smoke ViT"):
        found.append(record["model"])
    for flag, value in (record.get("settings") or {}).items():  # the lesson's own flags, each said
        found.append(flag if value is True else f"no {flag}" if value is False else f"{flag} {value}")
    if record["busy"]:
        found.append("BUSY: shared CPU")
    return found


def table(latest, reference, kind, notes=()):
    """The comparison as text: ours beside the talk's, each speedup over 01, what was left out."""
    def show(value, pattern="{:.2f}x"):
        return pattern.format(value) if value else "-"
    talk01 = reference[BASELINE]["time_min"]
    header = (f"{'script':<34} {'time min':>9} {'talk':>7} {'acc %':>7} {'talk':>7} "
              f"{'mem GB':>7} {'talk':>6} {'img/s':>8} {'speedup':>8} {'talk':>6} {'n':>3} "
              f"{'acc % range':>13}  settings")
    lines = [f"Ours: {kind} runs on {hardware(latest)}. Talk: its published figures.", header]
    unformed = []
    for key in latest:
        script, r, t = key[0], latest[key], reference[key[0]]
        acc = f"{r['test_acc'] * 100:.2f}" if r["test_acc"] is not None else "-"
        ips = f"{r['images_per_s']:.1f}" if r["images_per_s"] is not None else "-"
        low, high = r.get("range", {}).get("test_acc", (None, None))
        spread = f"{low * 100:.2f}-{high * 100:.2f}" if r.get("n", 1) > 1 and low is not None else "-"
        ratio = speedup(r, baseline_of(key, latest))
        if ratio is None and script != BASELINE:
            unformed.append(script[:2])
        settings = ", ".join([init_of(r, reference), *differences(r, reference)]).strip(", ") or "-"
        lines.append(
            f"{script:<34} {r['train_time_s'] / 60:>9.2f} {show(t['time_min'], '{:.2f}'):>7} "
            f"{acc:>7} {show(t['test_acc_pct'], '{:.2f}'):>7} {r['peak_memory_gb']:>7.2f} "
            f"{show(t['memory_gb'], '{:.2f}'):>6} {ips:>8} {show(ratio):>8} "
            f"{show(t['time_min'] and talk01 / t['time_min']):>6} {r.get('n', 1):>3} {spread:>13}  {settings}")
    lines.append(f"({SPEEDUP}; n: runs with different --seed, their mean shown; the range is "
                 "min-max)")
    if unformed:
        lines.append(f"(no speedup for {', '.join(unformed)}: no 01 run of the same kind, batch, "
                     "model and processes to divide by)")
    lines += [f"({note})" for note in notes]
    if kind != "full":
        lines.append(f"({kind} runs: a small model on small data; not a reproduction of the talk)")
    return "\n".join(lines)


def init_of(record, reference):
    """What a run's model started from: random init where it is synthetic or its lesson says so (00), else its
    pretrained weights (ImageNet's, or the smoke ViT's printed digits)."""
    if "synthetic" in record["kind"] or "random init" in reference[record["script"]]["technique"]:
        return "random init"
    return "pretrained on printed digits" if "smoke" in record["kind"] else "ImageNet-pretrained"


def short_label(record, reference):
    script = record["script"]
    technique = reference[script]["technique"].split(", stepped")[0].replace(", ImageNet-pretrained", "")
    init = "" if "random init" in technique else init_of(record, reference)  # 00's technique says it already
    lines = [script[:2], textwrap.fill(technique, 15), *([textwrap.fill(init, 15)] if init else []),
             *differences(record, reference)]
    return "\n".join(lines)


def figure(latest, reference, kind):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(latest)
    labels = [short_label(latest[k], reference) for k in keys]
    fig, axes = plt.subplots(4, 1, figsize=(max(9.0, 1.5 * len(keys) + 2), 16), dpi=100)
    width = 0.38
    xs = list(range(len(keys)))
    for ax, (title, key, talk_key, convert, fmt) in zip(axes, CHARTS):
        ax.set_title(title)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_xlim(-0.6, len(keys) - 0.4)
        ours = [convert(latest[k][key]) if latest[k][key] is not None else None for k in keys]
        if all(value is None for value in ours) and not talk_key:
            ax.set_yticks([])
            ax.text(0.5, 0.5, f"no data: none of these {kind} records has {key}",
                    transform=ax.transAxes, ha="center", va="center", color="#555555")
            continue
        ranges = [latest[k].get("range", {}).get(key) if latest[k].get("n", 1) > 1 else None
                  for k in keys]
        below = [v - convert(r[0]) if r and v is not None else 0 for v, r in zip(ours, ranges)]
        above = [convert(r[1]) - v if r and v is not None else 0 for v, r in zip(ours, ranges)]
        beside = talk_key and kind == "full"  # the talk's figures: on the axis of full runs alone
        bars = ax.bar([x - width / 2 if beside else x for x in xs], [v or 0 for v in ours],
                      width if beside else 2 * width, color="#1f77b4", label=f"ours ({kind}: {MEASURED[kind]}"
                      + ("; several seeds: mean, min-max)" if any(ranges) else ")"),
                      yerr=[below, above] if any(ranges) else None, capsize=3,
                      error_kw={"elinewidth": 1})
        for bar, value, up in zip(bars, ours, above):
            ax.annotate("n/a" if value is None else fmt.format(value),
                        (bar.get_x() + bar.get_width() / 2, bar.get_height() + up),
                        ha="center", va="bottom", fontsize=7)
        if beside:
            talk = [reference[k[0]][talk_key] for k in keys]
            talk_bars = ax.bar([x + width / 2 for x in xs], [t or 0 for t in talk], width,
                               color="white", edgecolor="#888888", hatch="//",
                               label="talk (published)")
            for bar, value in zip(talk_bars, talk):
                ax.annotate("not in talk" if value is None else fmt.format(value),
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7, color="#555555")
        else:
            ax.text(0.99, 0.97, f"talk: not drawn beside {kind} runs (another model, data and machine)"
                    if talk_key else "talk: not published", transform=ax.transAxes, ha="right",
                    va="top", fontsize=8, color="#555555")
        ax.margins(y=0.2)
    title = headline_of(latest, kind, fig)
    fig.suptitle(title, fontsize=9)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=9)
    lines = title.count("\n") + 1
    fig.tight_layout(rect=(0, 0.025, 1, 1 - 0.0085 * lines))  # room for the headline, no more
    return fig


def headline_of(latest, kind, fig):
    """The chart's title: what ran where, that a smoke or synthetic run is not the talk's; wrapped to
    the figure's width."""
    headline = f"Ours: {kind} runs on {hardware(latest)}"
    if kind != "full":
        headline += f"\n{kind.upper()} RUNS, NOT A REPRODUCTION OF THE TALK"
    if kind.startswith("smoke"):
        headline += ("\n(a 3-layer ViT on 8x8 handwritten digits, from what each label says it "
                     "started from; on a CPU, memory is the process's peak resident memory)")
    if kind == "full":
        several = ", ".join(s[:2] for s, row in lessons().items() if row["time_min"] and row["devices"] > 1)
        headline += f"\nTalk (hatched): its published runs on its GPUs (1 GPU; 4 GPUs for {several})"
    busy = sorted(r["script"][:2] for r in latest.values() if r["busy"])
    if busy:
        headline += f"\nBUSY (another program shared the CPU; times not comparable): {', '.join(busy)}"
    # wrapped to the figure's width: at most 7.5 pixels a character at 9 points and 100 dpi
    chars = int(fig.get_figwidth() * fig.dpi / 7.5)
    return "\n".join(textwrap.fill(line, chars) for line in headline.split("\n"))


def save(fig, output):
    """The PNG written beside `output` and renamed into place."""
    import matplotlib.pyplot as plt
    output = Path(output)
    tmp = None
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".charts-", suffix=".png", dir=output.parent)
        os.close(fd)
        fig.savefig(tmp, format="png")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as any file the user writes (mkstemp makes it 0600)
        os.replace(tmp, output)
    except OSError as err:
        fail(f"cannot write {output}: {err.strerror or err}", code=1)
    finally:
        plt.close(fig)
        if tmp and os.path.exists(tmp):
            os.remove(tmp)


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results/runs.jsonl", metavar="FILE",
                        help="run records, one JSON object per line (default results/runs.jsonl)")
    parser.add_argument("--log", action="append", default=[], metavar="FILE",
                        help="also read a log in the talk's text format (repeatable)")
    parser.add_argument("--output", default="results/charts.png", metavar="PNG",
                        help="default results/charts.png (ignored by git)")
    parser.add_argument("--smoke", action="store_true", help="chart the --smoke runs")
    parser.add_argument("--synthetic", action="store_true", help="chart the --synthetic "
                        "(benchmark) runs; with --smoke, the --smoke --synthetic ones")
    parser.add_argument("--all", action="store_true", help="also the runs cut short by "
                        "--max-steps (debugging runs, left out by default)")
    args = parser.parse_args(argv)
    args.kind = "-".join(k for k in ("smoke", "synthetic") if getattr(args, k)) or None
    check_path("--output", args.output)
    return args


def table_and_chart(args):
    reference = lessons()
    records = []
    if Path(args.results).exists() or not args.log:
        records += usable_records(args.results, reference)
    for log in args.log:
        records += read_log(log, reference)
    if not records:
        fail(f"nothing to draw: no usable run in {', '.join([args.results, *args.log])}")
    kind, latest, notes = select(records, args.kind, args.all)
    if not latest:
        there = sorted({r["kind"] for r in records})
        left = f" ({'; '.join(notes)})" if notes else ""
        fail(f"nothing to draw: no {kind} runs in {args.results}{left}; it holds {', '.join(there)} "
             f"runs: chart them with {' or '.join(chart_command(k, args.results) for k in there)}")
    return table(latest, reference, kind, notes), figure(latest, reference, kind)


def main(argv=None):
    args = parse_args(argv)
    text, chart = table_and_chart(args)
    print(text)
    save(chart, args.output)
    print(f"Chart written to {args.output}")


if __name__ == "__main__":
    with tool_run():  # Ctrl-C and SIGTERM: one line; the interpreter as found afterwards
        main()
