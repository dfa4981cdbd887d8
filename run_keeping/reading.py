"""Reading a run's outputs back, for 08 and the tools: the records of a --results file (read_runs
brings an older record up to this version), the record that saved a model file, and the model file
itself, each with one line for what is wrong with it; and a tool's run (tool_run).
"""

import contextlib
import csv
import functools
import json
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from run_keeping.config import EXIT_ON_SIGNAL, fail, read_script
from run_keeping.record import VERSION, why_unloadable

ROOT = Path(__file__).resolve().parent.parent

WHOLE_COLUMNS = ("budget", "epochs", "devices", "min_devices")  # of lessons.csv; the other columns
FIGURE_COLUMNS = ("time_min", "memory_gb", "test_acc_pct")  # and sequel_*: numbers; but for the lists, the others
LIST_COLUMNS = ("memory_chain", "measured_with")  # are text


CHOICES = {"memory_chain": {"talk", "sequel"}, "gpu_check": {"headline", "fast", "sequel"}}


def lesson_rows():
    """lessons.csv: [(its line number, its row)], as text; a row without the header's fields raises
    ValueError naming it."""
    with open(ROOT / "lessons.csv") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip() and not line.startswith("#")]
    rows = csv.DictReader(line for _, line in lines)
    found = [(number, row) for (number, _), row in zip(lines[1:], rows)]
    for number, row in found:
        if None in row or None in row.values():  # csv's marks of a field too many, or too few
            more = "more" if None in row else "fewer"
            header = len(rows.fieldnames or [])
            raise ValueError(f"lessons.csv line {number} ({row['script']}): {more} fields than the header's {header}")
    return found


def lessons():
    """{script: its row of lessons.csv}, each column typed (None where empty). A value of the wrong
    kind raises ValueError naming the row, the column and what it takes."""
    rows = {}
    for number, row in lesson_rows():
        try:
            rows[row["script"]] = {column: typed(column, value) for column, value in row.items()}
            given = {c: rows[row["script"]][c] for c in CHOICES}
            wrong = [
                c
                for c, allowed in CHOICES.items()
                if set(given[c] if isinstance(given[c], list) else [given[c]]) - allowed - {None}
            ]
            if wrong:
                raise ValueError(f"{wrong[0]} takes {' or '.join(sorted(CHOICES[wrong[0]]))}")
            if not (ROOT / row["script"]).is_file() or row["against"] and not list(ROOT.glob(f"{row['against']}_*.py")):
                raise ValueError(f"no script {row['script']} or {row['against']}_*.py in {ROOT}")
        except ValueError as err:
            raise ValueError(f"lessons.csv line {number} ({row['script']}): {err}") from None
    return rows


def typed(column, value):
    """A column's value as the tools read it; ValueError saying what it takes."""
    try:
        if column in LIST_COLUMNS:
            return shlex.split(value)
        if not value:
            return None
        if column in WHOLE_COLUMNS:
            return int(value)
        return float(value) if column.removeprefix("sequel_") in FIGURE_COLUMNS else value
    except ValueError:
        kind = "a whole number" if column in WHOLE_COLUMNS else "a number" if column not in LIST_COLUMNS else "flags"
        raise ValueError(f"{column} is {value!r}, not {kind}") from None


# The record's fields and types: record.build makes them, in this order; docs/flags-records-exit-codes.md
# says what each means; the smoke tests hold every record a script writes to them (tests/test_scripts.py).
class Record(TypedDict):
    record_version: int
    # what ran
    script: str
    kind: str  # full, smoke, synthetic or smoke-synthetic
    accelerator: str
    device_name: str
    devices: int
    world_size: int
    data_parallel: int  # the processes over those that hold one replica between them (10's --tensor-parallel)
    settings: dict[
        str, bool | int | float | str | list | None
    ]  # the lesson's own flags, as JSON has them, defaults included
    precision: str  # as it ran
    precision_asked: str  # what the script's Fabric(...) asks for
    compile_mode: str | None
    model: str
    batch_size: int
    micro_batches: int
    seed: int
    max_steps: int | None
    # what it measured
    train_time_s: float
    images_per_s: float | None
    peak_memory_gb: float
    train_loss: list[float]
    lr: list[float]  # each epoch's first step's
    val_acc: list[float] | None
    test_acc: float | None
    busy: bool
    cpu_s: float  # the process's CPU seconds, start to record: what the machine's load does not change
    # where the model went, the libraries and the time
    model_file: str
    torch: str
    lightning: str | None
    timestamp: str
    # benchmark.py --memory's own file of runs adds the table a run is for and the libraries' share
    memory_table: NotRequired[str]
    libraries_gb: NotRequired[float]


FIELDS = list(Record.__annotations__)
REQUIRED = [f for f in FIELDS if f in Record.__required_keys__]


def whole(record):
    """A result, not a debugging run: not cut short by --max-steps (a synthetic run always is)."""
    return record["max_steps"] is None or "synthetic" in record["kind"]


def lesson_flags(script):
    """A lesson's own flags as its script declares them: [(its names, {keyword: its source})], for the tools."""
    import ast

    calls = [n for n in ast.walk(ast.parse(Path(ROOT / script).read_text())) if isinstance(n, ast.Call)]
    own = [c for c in calls if ast.unparse(c.func).endswith("add_argument") and c.args]
    return [
        ([getattr(a, "value", None) for a in c.args], {k.arg: ast.unparse(k.value) for k in c.keywords}) for c in own
    ]


@functools.cache
def said_of(script):
    """What a project lesson's script says of itself (config.read_script), for a record before version 5."""
    return read_script(ROOT / str(script))


def upgrade(record) -> dict[str, Any]:
    """A record as this version writes it: the fields it kept under their names, None for each it
    lacks; an older record's other fields stay."""
    old = dict(record)
    if "steps" in old:  # version 1 counted the batches loaded as "steps"
        old["batches_loaded"] = old.pop("steps")
    if not old.get("kind"):  # the first records: the kind from the flags
        old["kind"] = "-".join(k for k in ("smoke", "synthetic") if old.get(k)) or "full"
    if "compile_mode" not in old:  # version 1 compiled with torch.compile's default, or not
        old["compile_mode"] = "default" if old.get("compiled") else None
    if "settings" not in old:  # to version 3, 10's --tensor-parallel was a field of every record
        tp = old.pop("tensor_parallel_size", None)
        declared = (
            [names[0] for names, _ in lesson_flags(old["script"])] if (ROOT / str(old.get("script"))).is_file() else []
        )
        old["settings"] = {"tensor_parallel": tp} if "--tensor-parallel" in declared else {}
    if (old.get("record_version") or 0) < 5:  # to version 4, settings were by dest, and these not kept
        old["settings"] = {"--" + key.replace("_", "-"): value for key, value in (old["settings"] or {}).items()}
        tp = old["settings"].get("--tensor-parallel") or 1
        old.setdefault("data_parallel", (old.get("world_size") or 1) // tp)
        old.setdefault("precision_asked", said_of(old.get("script"))["precision"] or old.get("precision"))
    return {**dict.fromkeys(REQUIRED), **old, "record_version": VERSION}


def read_records(path, skip=None, numbered=False):
    """The JSON objects of a JSONL file; a bad line raises ValueError, or is passed to skip(line, why)."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            if skip is None:
                raise
            skip(number, "not a JSON object" if "JSON object" in str(err) else "not JSON")
            continue
        records.append((number, record) if numbered else record)
    return records


def read_runs(path, skip=None, numbered=False):
    return [(n, upgrade(r)) if numbered else upgrade(r) for n, r in read_records(path, skip, numbered=True)]


def record_of(model_file, results):
    """The newest record in `results` that saved its model to `model_file`, or None."""
    try:
        records = read_runs(results)
    except (OSError, ValueError):
        return None
    wanted = Path(model_file).resolve()
    return next((r for r in reversed(records) if r["model_file"] and Path(r["model_file"]).resolve() == wanted), None)


def load_model_file(model, path):
    """A finetuned model file into `model`, or one line saying what is wrong with it, exit 2."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        fail(f"no model file {path}: a finished training run writes one (see --save-model).")
    except Exception as err:
        fail(f"{path} is not a readable model file: {why_unloadable(err)[0]}.")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        fail(f"{path} is not a model file of this suite (not a state dict of tensors).")
    own = model.state_dict()
    missing = own.keys() - state.keys()
    extra = state.keys() - own.keys()
    shapes = sorted(k for k in own.keys() & state.keys() if own[k].shape != state[k].shape)
    if missing or extra or shapes:
        width = state.get("conv_proj.weight", torch.empty(0)).shape[:1]
        kind = {(128,): "the small --smoke ViT", (768,): "ViT-B/16"}.get(tuple(width), "another model")
        parts = [f"{len(missing)} of the model's tensors missing"] if missing else []
        parts += [f"{len(extra)} tensors the model has no place for"] if extra else []
        if shapes:
            key = "conv_proj.weight" if "conv_proj.weight" in shapes else shapes[0]
            show = "x".join(map(str, state[key].shape)), "x".join(map(str, own[key].shape))
            parts.append(f"{len(shapes)} of another shape, {key} {show[0]} in the file against {show[1]} here")
        fail(
            f"{path} holds {kind}, which does not fit the model built here ({', '.join(parts)}). Add or drop "
            "--smoke to match the run that made it."
        )
    if state["heads.head.weight"].shape[0] != 10:
        fail(f"{path} has {state['heads.head.weight'].shape[0]} outputs, not 10.")
    model.load_state_dict(state)


@contextlib.contextmanager
def tool_run():
    """A tool's run (08, benchmark.py, plot_results.py, make_smoke_weights.py): Ctrl-C and SIGTERM end it in one
    line (130, 143), and their handlers are as found however it ends."""
    found = {signum: signal.getsignal(signum) or signal.SIG_DFL for signum in EXIT_ON_SIGNAL}

    def put_back():
        for signum, handler in found.items():
            signal.signal(signum, handler)

    def stop(signum, frame):
        put_back()
        print(f"\n{Path(sys.argv[0]).name}: interrupted ({signal.Signals(signum).name}).", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_ON_SIGNAL[signum])

    for signum in found:
        signal.signal(signum, stop)
    try:
        yield
    finally:
        put_back()
