"""Running processes for the benchmarks: the one runner of a numbered script (its record back) and
the one protocol of the benchmark's own child processes (tagged JSON lines). A process that fails
or runs out of time raises RunFailed with the one line that says why.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from run_keeping.reading import lessons
from run_keeping.reading import upgrade
from run_keeping.record import first_line

ROOT = Path(__file__).resolve().parent.parent


def training_lessons():
    return {script[:2]: script for script, row in lessons().items() if row["epochs"]}


SCRIPTS = training_lessons()
# glibc raises its mmap threshold after each large free, so later large buffers come from its heap
# and stay resident once freed (measured: 0.7-1.3 GB a process on ViT-L/16 after two Adam steps).
# Fixed thresholds (glibc's documented tunables) hand each freed buffer back at once, so a CPU
# process's resident memory follows what it holds. A GPU's caching allocator keeps freed blocks
# too, and max_memory_reserved (the talk's figure) counts them.
SOME_FAILED = 6  # benchmark.py's and gpu_check.sh's exit code: measured, but some configurations failed
EXACT_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


class RunFailed(Exception):
    """A process that did not finish its work: str() is the one line that says why."""


class OutOfTime(RunFailed):
    """A process stopped at its time limit: not a failure of what it runs."""


def process_range(script):
    """(whether the script runs several processes by default, the fewest it runs on)."""
    row = lessons()[script]
    return row["devices"] > 1, row["min_devices"]


def processes_of(script, devices):
    """The processes benchmark.py runs a script in: --devices for a lesson of several, at least its least."""
    takes, least = process_range(script)
    return max(least, devices) if takes else 1


def memory_env(cuda):
    return dict(os.environ, **({} if cuda else EXACT_MALLOC))


def run(command, env=None, timeout=None):
    """A process and all it starts, in a session of its own so a time limit stops them all: (its
    stdout, wall seconds), or RunFailed."""
    began = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise OutOfTime(f"stopped after {timeout:.0f} s, when the time left ran out") from None
    finally:
        if proc.poll() is None:  # a Ctrl-C here: the child's whole session goes too
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise RunFailed(why(proc.returncode, err))
    return out, time.monotonic() - began


def why(code, stderr):
    """The one line that says why a process failed: its own error line, else its last."""
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    said = [line for line in lines if ": error: " in line] or lines[-1:] or ["no output"]
    return f"exit {code}: {first_line(said[-1], 240)}"


def measured_with(script):
    """The flags every table and stage runs `script` with (its row's measured_with), and how a plan says them."""
    flags = lessons()[script]["measured_with"] or []
    return flags, f" (with {' '.join(flags)})" if flags else ""


def run_script(script, flags, results, env=None, timeout=None):
    """A numbered script with `flags`, and those its row's measured_with names: (the record it appended
    to `results`, wall seconds), or RunFailed."""
    flags = [*flags, *measured_with(script)[0]]
    def lines():
        try:
            return Path(results).read_text().splitlines()
        except FileNotFoundError:
            return []
    before = len(lines())
    print(f"running {script} {' '.join(flags)}", file=sys.stderr, flush=True)
    _, seconds = run([sys.executable, str(ROOT / script), *flags, "--results", str(results)], env, timeout)
    new = lines()[before:]
    if not new:
        raise RunFailed("it ended without appending its record")
    return upgrade(json.loads(new[-1])), seconds


# -- the benchmark's own child processes ----------------------------------------------------------
def print_answer(tag, answer, fabric=None):
    """An internal mode's answer, one line `TAG {json}` on process 0's stdout, for run_internal_mode."""
    (fabric.print if fabric is not None else print)(f"{tag} {json.dumps(answer)}", flush=True)


def run_internal_mode(tag, flags, env=None, timeout=None):
    """benchmark.py in one of its internal modes: (every answer it said under `tag`, wall seconds), or
    RunFailed."""
    out, seconds = run([sys.executable, str(ROOT / "benchmark.py"), *flags], env, timeout)
    answers = [json.loads(line[len(tag) + 1:]) for line in out.splitlines() if line.startswith(tag + " ")]
    if not answers:
        raise RunFailed(f"it ended without its {tag} answer")
    return answers, seconds


PARALLELIZE = {"fsdp2": "fsdp_each_encoder_block", "fsdp2+cpu-offload": "fsdp_each_encoder_block_offloaded",
               "tensor-parallel+fsdp2": "tensor_parallel_mlps_then_fsdp"}  # lessons.csv's strategies


def make_strategy(name, devices, tensor_parallel=1):
    """The strategy lessons.csv names, for `devices` processes."""
    from lightning.fabric.strategies import ModelParallelStrategy
    import parallelize
    if name in ("single-device", "ddp"):
        return {"single-device": "auto", "ddp": "ddp"}[name]
    return ModelParallelStrategy(getattr(parallelize, PARALLELIZE[name]), devices // tensor_parallel, tensor_parallel)
