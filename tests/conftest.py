"""Shared helpers: run the real scripts as subprocesses, offline, in a scratch directory."""
import contextlib
import fcntl
import functools
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The suite runs on a machine stood in for whatever the host has: the nvidia-smi first on PATH, here and for every
# program it starts, is the machine HOOK_GPU_MACHINE describes (tests/gpu_machine/machine.py), so that a check
# reading the host's GPU tools fails on any machine, this one included. By default it has a driver and no GPU, as
# torch here sees none; a test that stands in another gives torch.cuda the same machine's answers (stand_in).
# Nothing hides the GPUs from the code under test: a test that must run on the CPU says so (--smoke, --accelerator
# cpu), and one that needs torch to see no GPU where the host has one is skipped there (on_a_gpu_host).
GPU_MACHINE = ROOT / "tests" / "gpu_machine"
os.environ["PATH"] = f"{GPU_MACHINE}{os.pathsep}{os.environ['PATH']}"
os.environ["HOOK_GPU_MACHINE"] = "0"
# Every Python process a test starts that runs a script (a documented command's `python`, Lightning's second process,
# benchmark.py's runs) is a copy from this pytest process's warm-start server where its environment lets it be
# (tests/warm_start.py): `python` and `python3` first on the PATH, which ask the server at this address.
WARM_FOLDER = Path(tempfile.gettempdir()) / f"warm-start-{os.getpid()}"
os.environ["PATH"] = f"{ROOT / 'tests' / 'warm_python'}{os.pathsep}{os.environ['PATH']}"
os.environ["HOOK_WARM_START"] = str(WARM_FOLDER / "warm-start.sock")
if Path(sys.executable).parent.name != "warm_python":  # not where pytest itself is a copy: its `python` is the shim
    os.environ["HOOK_PYTHON"] = sys.executable  # the interpreter the shim runs where no copy can be made
# Whether the host has NVIDIA GPUs of its own (its driver lists each here), which torch in the scripts sees
GPU_HOST = any(Path("/proc/driver/nvidia/gpus").glob("*"))
on_a_gpu_host = pytest.mark.skipif(GPU_HOST, reason="torch sees this host's GPU: no machine whose torch sees none")
from run_keeping.config import read_script
from run_keeping.reading import lessons
from run_keeping.reading import read_records  # noqa: E402  (the records as the scripts wrote them)


def pytest_configure(config):
    """Where tests run (each xdist worker, or pytest's own process with -n 0), not in the xdist
    controller, which runs none and would only wait 5 s for the imports: Lightning gives its
    loggers a handler on sys.stderr when first imported, so it is imported before any test
    captures stderr (a handler never writes to a test's closed capture); and the tests that
    compute in pytest's process use one CPU thread, as script_env gives the scripts."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        import lightning  # noqa: F401
        import torch
        torch.set_num_threads(1)

@functools.lru_cache(maxsize=None)
def native_bf16():
    """Whether this CPU has native bfloat16 (run_keeping/config.py), as the scripts run here see
    it (ONEDNN_MAX_CPU_ISA in the environment rehearses a CPU without)."""
    from run_keeping.device import native_bf16 as native
    return native("cpu")


# What each lesson's own text asks for (its precision, torch.compile mode, flags), as its run reads it
SAID = {script: read_script(ROOT / script) for script in lessons()}
# The lessons whose smoke runs the suite shares: the first and each one that is a diff against
# another (lessons.csv); 09, a recipe of its own, has its tests in test_fast_recipe.py.
SCRIPTS = [script for script, row in lessons().items() if row["against"] or script.startswith("00")]
# 06 runs its smoke test as two torchrun 'nodes' of one CPU process each; 05 and 07 run as
# Fabric launches them (--smoke on a CPU: 2 processes).
TWO_NODES = "06_fabric-vit-mixed-fsdp.py"
# Nothing in the tests may reach the network: every download goes to a closed local port.
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "no_proxy": "", "NO_PROXY": ""}


# This pytest process's environment as it started. The libraries that tests call in this process
# add to os.environ (torch's TORCHINDUCTOR_CACHE_DIR and PYTORCH_NVML_BASED_CUDA_CHECK, the
# KMP_ settings of scikit-learn's OpenMP), which a script's environment does not inherit: what a
# script gets does not depend on which tests ran before it in the same worker.
ENVIRON = dict(os.environ)


def script_env(tmp, **extra):
    """A script's environment in a test: offline, its own torch hub cache, and one CPU thread a
    process (pytest.ini runs tests side by side, one per core: more threads than cores wait on
    each other, as torchrun's OMP_NUM_THREADS=1 avoids), on the environment pytest started with."""
    env = dict(ENVIRON, PYTHONUNBUFFERED="1", TORCH_HOME=str(tmp / "torch-home"),
               OMP_NUM_THREADS="1", **OFFLINE)
    env.update(extra)
    return env


_warm = []  # this pytest process's WarmStarts (warm_start.py), made at its first script


def warm_starts():
    if not _warm:
        from warm_start import WarmStarts
        WARM_FOLDER.mkdir(exist_ok=True)
        _warm.append(WarmStarts(script_env(WARM_FOLDER), str(WARM_FOLDER)))
    return _warm[0]


def pytest_runtest_setup(item):
    """A slow test's processes (a script, a tool's `python`, a bash command's) find the server up: started here, at
    this pytest process's first slow test (the quick tier starts no script, and no server)."""
    if item.get_closest_marker("slow"):
        warm_starts().ready()


def pytest_unconfigure(config):
    if _warm:
        _warm[0].stop()
        shutil.rmtree(Path(_warm[0].address).parent, ignore_errors=True)


def parse_as(script, *flags):
    """The settings `script`'s own command line makes of `flags`, in this process, as a run makes them:
    the script runs first as a module under a name other than __main__ (its imports, constants and
    functions, a type function of its own included; a lesson does its work under `if __name__ ==
    "__main__":`, which then does not run), then its lines from `parser = lesson_parser(` to
    `parser.parse_args()` run in that namespace, parsed with sys.argv as `python SCRIPT FLAGS` sets it
    (put back after the test); a refusal is its SystemExit, as in the script. The script's imports are
    cached in sys.modules after the first."""
    import runpy

    path = ROOT / script
    text = path.read_text()
    start = text.rindex("\n", 0, text.index("parser = lesson_parser(")) + 1
    end = text.rindex("\n", 0, text.index("parser.parse_args()", start)) + 1
    sys.argv = [str(path), *flags]  # as the run sees it; run_in_tmp puts it back after the test
    made = runpy.run_path(str(path), run_name="lesson_parsed_by_the_tests")
    # the parser's lines keep their line numbers, so a traceback points into the script
    lines = "\n" * text.count("\n", 0, start) + textwrap.dedent(text[start:end])
    exec(compile(lines, str(path), "exec"), made)
    return made["parser"].parse_args()


class Ran(subprocess.CompletedProcess):
    """A finished script: subprocess's fields, and its wall-clock seconds."""

    def __init__(self, args, returncode, stdout, stderr, wall_s):
        super().__init__(args, returncode, stdout, stderr)
        self.wall_s = wall_s


def run_script(script, *flags, cwd, timeout=240, env=None, fresh=False):
    """Run a numbered script from the project (or the script at a path) in `cwd`; results, data
    and checkpoints land there (relative defaults). Started as start_script starts it; at the
    time-out, it and all it started are killed."""
    start = time.monotonic()
    started = start_script(script, *flags, cwd=cwd, env=env, fresh=fresh, merged=False)
    try:
        out, err = started.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(started)
        raise
    return Ran(started.args, started.returncode, out, err, wall_s=time.monotonic() - start)


def start_script(script, *flags, cwd, env=None, fresh=False, merged=True):
    """Start a script (`-m` and its flags: a module, as `python -m`) in its own session (so a test can kill it and all
    it started), its output and errors in one stream unless not `merged`: a fresh interpreter where the environment
    asks for one, or `fresh`; else forked from one that has imported the libraries (warm_start.py)."""
    target = script if script == "-m" else str(ROOT / script)
    cmd, env = [sys.executable, target, *flags], env or script_env(Path(cwd))
    if fresh or not warm_starts().fits(env):
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, text=True,
                                stderr=subprocess.STDOUT if merged else subprocess.PIPE, start_new_session=True)
    return warm_starts().start(cmd, cwd, env, merged)


def start_two_nodes(script, *flags, cwd):
    """`script` as two torchrun 'nodes' of one CPU process each, rendezvous on 127.0.0.1: each torchrun a forked copy
    where it can be (warm_start.py), which starts its worker with the `python` the tests give every program (by
    PYTHON_EXEC, torchrun's own setting), a copy too. kill_group's signal to a node's torchrun and what it started
    reaches the worker's stand-in, whose death the server answers by killing the worker's copy."""
    port = free_port()
    env = script_env(Path(cwd), PYTHON_EXEC=str(ROOT / "tests" / "warm_python" / "python"))
    nodes = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(ROOT / script), "--devices", "1", "--num-nodes", "2", *flags]
        if warm_starts().fits(env):  # torchrun's agent forked too
            nodes.append(warm_starts().start(cmd, cwd, env, merged=True))
        else:
            nodes.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))
    return nodes


def start(script, *flags, cwd, fresh=False):
    """The script's smoke-test launch: a list of processes (two nodes for 06)."""
    if script == TWO_NODES:
        return start_two_nodes(script, *flags, cwd=cwd)
    return [start_script(script, *flags, cwd=cwd, fresh=fresh)]


def finish(procs, timeout=240):
    """Wait for every process; on time-out or error kill them all. The outputs, in order; a
    time-out fails with the end of each process's output."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        outputs = [kill_group(p) if p.poll() is None else p.communicate()[0] for p in procs]
        tails = "\n".join(f"--- process {i}:\n" + "\n".join((o or "").splitlines()[-25:])
                          for i, o in enumerate(outputs))
        pytest.fail(f"timed out after {timeout} s\n{tails}", pytrace=False)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)


def check_ok(procs, outputs, what):
    """Fail loudly unless every process exited 0 (a signal's negative code fails too), showing
    the end of each process's output."""
    codes = [p.returncode for p in procs]
    if any(code != 0 for code in codes):
        tails = "\n".join(f"--- process {i} (exit {c}):\n" + "\n".join(o.splitlines()[-25:])
                          for i, (c, o) in enumerate(zip(codes, outputs)))
        pytest.fail(f"{what} failed with exit codes {codes}\n{tails}", pytrace=False)


def descendants(pid):
    """The pids of every process below `pid` (psutil: torchrun starts its workers in sessions of
    their own, so killing a process group is not enough)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_group(proc, sig=signal.SIGKILL):
    """Send `sig` to a started script and everything it started; return its output."""
    def send(signum):
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
    send(sig)
    try:
        return proc.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        return proc.communicate()[0]


def wait_for(path, proc, timeout=180):
    """Wait until `path` exists (or the process ends, or time runs out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Path(path).exists():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def git_status():
    """The checkout's changed, new and ignored files, less Python's own byte-code caches."""
    proc = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return "\n".join(line for line in proc.stdout.splitlines() if "__pycache__" not in line)


def pytest_sessionstart(session):
    session.config.status_before = git_status()


def pytest_sessionfinish(session, exitstatus):
    """The suite leaves the checkout as it found it, ignored files included."""
    before, after = session.config.status_before, git_status()
    if before is not None and after != before:
        new = sorted(set(after.splitlines()) - set(before.splitlines()))
        print(f"\nThe test suite changed the checkout {ROOT}: {new}", file=sys.stderr)
        session.exitstatus = 1


# The longest tests first, in this order (about 2 minutes down to 30 s on 2 cores), then the
# smoke runs other tests read, then the other slow tests, then the quick ones: pytest.ini hands
# out one test at a time to whichever worker is free, so the workers finish together instead of
# one running a long test alone at the end.
LONGEST = ("test_the_readme_job_on_a_real_slurm", "test_a_new_lesson_is_its_script_and_one_row",
           "test_each_lesson_saves_what_its_arithmetic_says",
           "test_the_gpu_path_runs_on_a_cpu", "test_every_documented_command_leaves_the_checkout_clean",
           "test_killed_then_resumed_equals_uninterrupted", "test_a_lost_machine_stops_the_other",
           "test_smoke_run_learns_and_records[02", "test_the_fast_recipe_beats_04_on_the_demo",
           "test_cifar10_downloaded_once", "test_gpu_check_at_smoke_size",
           "test_a_signal_mid_epoch_keeps_the_last_epochs_checkpoint", "test_every_printed_command_runs_as_printed",
           "test_runs_started_together", "test_smoke_run_learns_and_records")


def pytest_collection_modifyitems(items):
    def rank(item):
        first = [i for i, name in enumerate(LONGEST) if item.name.startswith(name)]
        return first[0] if first else len(LONGEST) + (item.get_closest_marker("slow") is None)
    items.sort(key=rank)


@pytest.fixture(autouse=True)
def run_in_tmp(tmp_path, monkeypatch):
    """Every test runs in its own empty folder: nothing lands in the checkout, and nothing lying
    in it (records, checkpoints) changes what a test sees; sys.argv as it was, after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))


@contextlib.contextmanager
def in_memory():
    """A scratch folder in memory (/dev/shm, where the machine has it) for a run's large files
    that a test does not read (a ViT-B/16 checkpoint is 1 GB: seconds to write to disk), removed
    afterwards. A tmpfs file's pages are no process's resident memory, so memory figures are not
    touched."""
    import shutil
    import tempfile
    folder = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# A test's hook (sitecustomize.py): a bug in the lesson, cross_entropy raising at the second step
BUG_AT_THE_SECOND_STEP = """
import torch.nn.functional as F
_calls, _cross_entropy = [], F.cross_entropy
def cross_entropy(*args, **kwargs):
    _calls.append(1)
    if len(_calls) == 2:
        raise ValueError("a bug in the lesson")
    return _cross_entropy(*args, **kwargs)
F.cross_entropy = cross_entropy
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_fake_cifar10(root, per_batch=20, num_test=20, seed=0, random_pixels=False):
    """A small CIFAR-10 in its real on-disk format: cifar-10-batches-py with five pickled
    training batches, a test batch and batches.meta (uint8 rows of 3x32x32, labels 0-9). Each
    image is one flat colour, or random pixels (for comparing resizes)."""
    rng = np.random.RandomState(seed)
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    batches = {}
    for name, n in [*[(f"data_batch_{i}", per_batch) for i in range(1, 6)],
                    ("test_batch", num_test)]:
        # each image one flat colour, which a resize keeps, so images can be told apart after it
        colours = rng.randint(0, 256, size=(n, 3, 1), dtype=np.uint8)
        pixels = (rng.randint(0, 256, size=(n, 3072), dtype=np.uint8) if random_pixels
                  else np.repeat(colours, 1024, axis=2).reshape(n, 3072))
        batch = {"data": pixels,
                 "labels": [int(v) for v in rng.randint(0, 10, size=n)],
                 "batch_label": name}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
        batches[name] = batch
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog",
                                     "frog", "horse", "ship", "truck"]}, f)
    return batches


def shared_folder(tmp_path_factory, config):
    """A folder every worker of this test run sees: pytest-xdist gives each worker a base
    folder of its own, side by side in the run's; without xdist, the session's own. (Whether this
    process is an xdist worker is its config's, not the environment's: a pytest that a test starts
    inherits a worker's PYTEST_XDIST_WORKER.)"""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


@contextlib.contextmanager
def locked(path):
    """One process at a time, across the test run's workers (an advisory lock on `path`)."""
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory, pytestconfig):
    """once_per_run(name, make): make(folder)'s result (a dict), made once per test run however
    many tests and workers ask for it: the first makes it in `folder`, the others wait for it and
    read it. If make fails, every test that asks fails with its message, and it is not made twice."""
    shared = shared_folder(tmp_path_factory, pytestconfig) / "once-per-run"
    shared.mkdir(exist_ok=True)

    def get(name, make):
        folder, saved = shared / name, shared / name / "result.json"
        with locked(shared / f"{name}.lock"):
            if not saved.exists():
                folder.mkdir(parents=True, exist_ok=True)
                try:
                    result = make(folder)
                except (AssertionError, pytest.fail.Exception) as err:  # said once, kept
                    result = {"failure": str(err)}
                saved.write_text(json.dumps(result))
        result = json.loads(saved.read_text())
        if result.get("failure"):
            pytest.fail(result["failure"], pytrace=False)
        return result
    return get


class SmokeRun:
    """A finished --smoke run: .out (the first process's output), .outputs, .wall_s, .record
    (its run record) and .dir (where it ran)."""

    def __init__(self, saved):
        self.dir, self.outputs, self.wall_s = Path(saved["dir"]), saved["outputs"], saved["wall_s"]
        self.out, self.record = saved["outputs"][0], saved["record"]


# The run test_precision.py measures others' CPU seconds against, as a user starts it: fresh, its
# record's CPU seconds counting the libraries' loading, as those of the runs measured alone in
# reference/ do (a forked run's count from the fork)
YARDSTICK = "03_fabric-vit.py"


def smoke_run(folder, script, flags):
    """Run `script --smoke *flags` in folder/run; what SmokeRun reads. A run that failed, hung or
    wrote no record fails, with its output."""
    began, run = time.monotonic(), folder / "run"
    run.mkdir()
    procs = start(script, "--smoke", *flags, cwd=run, fresh=script == YARDSTICK)
    outputs = finish(procs)
    check_ok(procs, outputs, f"{script} --smoke {' '.join(flags)}")
    records = run / "results" / "runs.jsonl"
    if not records.exists():
        pytest.fail(f"{script} --smoke wrote no record:\n{outputs[0][-3000:]}", pytrace=False)
    # the run's own record, read before a test runs 08 beside it
    return {"dir": str(run), "outputs": outputs, "wall_s": time.monotonic() - began,
            "record": read_records(records)[-1]}


@pytest.fixture(scope="session")
def smoke_runs(once_per_run):
    """smoke_runs(script, *flags): the script's --smoke run (a SmokeRun), once per test run."""
    def get(script, *flags):
        name = "-".join([Path(script).stem, *(f.strip("-") for f in flags)])
        return SmokeRun(once_per_run(name, lambda folder: smoke_run(folder, script, flags)))
    return get


def smoke_logits(model_file, bf16, uint8=False):
    """The smoke test digits' logits of a saved smoke model: in float32, or under bf16-mixed
    autocast as the training runs and 08 evaluate; uint8: the digits held as 09 holds its data
    (uint8, as CIFAR-10's are), not as the floats 08 reads."""
    import argparse
    import torch
    import local_utilities as lu
    model = lu.build_vit(None, argparse.Namespace(smoke=True, synthetic=False))
    model.heads.head = torch.nn.Linear(model.hidden_dim, 10)
    model.load_state_dict(torch.load(model_file, map_location="cpu", weights_only=True))
    model.eval()
    images = lu.digits_datasets()[2].tensors[0]
    if uint8:
        images = (images * 255).round() / 255
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model(images).float()


def uint8_effect(model_file):
    """The most that holding the test digits as uint8 (09) instead of floats (08) moves any of
    this model's float32 logits: a difference of inputs, which no rounding bound covers."""
    return float((smoke_logits(model_file, False, uint8=True) - smoke_logits(model_file, False)).abs().max())


def images_bf16_may_flip(model_file, roundings=4, extra=0.0):
    """How many test digits two bfloat16 evaluations of this model may classify differently,
    derived on this machine (its CPU's bf16 kernels) rather than fitted to one run: D is the
    largest difference bf16-mixed autocast makes to any logit against float32. A computation
    that rounds k times where autocast rounds once lies within about k*D of float32, so two of
    them within `roundings`*D of each other; only a digit whose two best float32 logits are
    closer than that can change its prediction; `extra`: what the two computations' inputs add
    to that. Returns (that count, D)."""
    exact, rounded = smoke_logits(model_file, False), smoke_logits(model_file, True)
    bound = float((rounded - exact).abs().max())
    best_two = exact.topk(2, dim=1).values
    return int(((best_two[:, 0] - best_two[:, 1]) < roundings * bound + extra).sum()), bound
