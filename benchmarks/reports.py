"""What the tools print and write beside the runs: Markdown tables, reports, the chart command."""
import shlex
import sys
from pathlib import Path

from run_keeping.reading import ROOT
from run_keeping.record import write_atomically


def markdown_table(header, rows):
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header),
            *(f"| {' | '.join(str(cell) for cell in row)} |" for row in rows)]


def fmt(value, pattern):
    return "-" if value is None else pattern.format(value)


def write_report(path, text):
    write_atomically(path, (text.rstrip("\n") + "\n").encode(), then="the report is still printed above")


def chart_command(kind, results):
    """The command that charts the `kind` runs in `results`, beside the program that prints it."""
    flags = "".join(f" --{k}" for k in kind.split("-") if k != "full")
    where = "" if str(results) == "results/runs.jsonl" else f" --results {shlex.quote(str(results))}"
    beside = Path(sys.argv[0]).with_name("plot_results.py")  # as the program was invoked
    return f"python {shlex.quote(str(beside if beside.exists() else ROOT / 'plot_results.py'))}{flags}{where}"
