"""A run ends as a Python program ends (docs/run-keeping.md, "Exit"): after the `with` block, finished,
refused or failed, control returns to whoever ran the script (IPython's %run, `python -i`, the code after
the block), with the documented exit code, an exit handler registered before the run run; Ctrl-C after an
unexpected error still ends the process; a NaN in one process stops them all."""
import signal
import subprocess
import sys
import time

import pytest

from conftest import BUG_AT_THE_SECOND_STEP, ROOT, kill_group, native_bf16, run_script, script_env

LESSON = "04_fabric-vit-mixed-precision.py"
SHORT = ["--smoke", "--max-steps", "2", "--epochs", "1"]


# In one IPython session: a refused %run, 05 (whose processes Lightning cannot start at a prompt), 04 on a CPU
# without bfloat16 units (oneDNN capped: it falls back), then 03 and 04 with the cap as found (04 runs what it asks
# again where the CPU has bfloat16 units); the interpreter's state is compared after each with what it was after the
# first finished run (the libraries' imports change it once).
CELL = """
import os, signal, warnings, json, torch
def state():
    return (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), dict(os.environ), list(warnings.filters),
            torch.get_num_threads())
%run {lesson} --smoke --resume
cap = os.environ.pop("ONEDNN_MAX_CPU_ISA", None)
os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
%run {lesson} {short}
del os.environ["ONEDNN_MAX_CPU_ISA"]
if cap is not None:
    os.environ["ONEDNN_MAX_CPU_ISA"] = cap
found = state()
%run {lesson} --smoke --epochs 0
print("AFTER A REFUSAL", state() == found)
%run {ddp} --smoke
print("AFTER 05", state() == found)
%run {fabric} {short}
print("AFTER 03", state() == found, "LT_PRECISION" in os.environ)
%run {lesson} {short}
print("AFTER 04 AGAIN", state() == found)
print("PYTHON'S CTRL-C", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
print("PRECISIONS", [json.loads(line)["precision"] for line in open("results/runs.jsonl")][::2])
"""


@pytest.mark.slow
def test_ipython_and_python_i_get_control_back(tmp_path):
    """In IPython, a %run refused in one line (exit 2), 05 refused in one line that names the shell command, and
    %runs that train to their end each hand back the interpreter as they found it (handlers, environment,
    warnings, threads): a fallback's precision does not outlive its run. `python -i` reaches its prompt after a
    run, and after a refused run Ctrl-C at the prompt is Python's KeyboardInterrupt again."""
    cell = CELL.format(lesson=ROOT / LESSON, short=" ".join(SHORT), ddp=ROOT / "05_fabric-vit-mixed-ddp.py",
                       fabric=ROOT / "03_fabric-vit.py")
    ipython = subprocess.run([sys.executable, "-m", "IPython", "--no-banner", "--quick", "--colors=NoColor", "-c", cell],
                             cwd=tmp_path, env=script_env(tmp_path), capture_output=True, text=True, timeout=300)
    out = ipython.stdout + ipython.stderr
    assert "SystemExit: 2" in out and "nothing to resume" in out, out[-3000:]
    assert "AFTER A REFUSAL True" in out and "AFTER 05 True" in out and "AFTER 03 True False" in out, out[-3000:]
    assert "AFTER 04 AGAIN True" in out, out[-3000:]
    assert "PYTHON'S CTRL-C True" in out, out[-3000:]
    assert ("05_fabric-vit-mixed-ddp.py: error: this lesson's processes are started by Lightning's subprocess "
            f"launcher, which cannot run at a prompt: run it from a shell: python {ROOT / '05_fabric-vit-mixed-ddp.py'} --smoke") in out
    assert f"PRECISIONS ['32-true', '{'bf16-mixed' if native_bf16() else '32-true'}']" in out, out[-3000:]
    interactive = subprocess.run([sys.executable, "-i", str(ROOT / LESSON), *SHORT], cwd=tmp_path, env=script_env(tmp_path),
                                 input="print('the prompt was reached')\n", capture_output=True, text=True, timeout=300)
    assert "the prompt was reached" in interactive.stdout and "Run record appended" in interactive.stdout, interactive.stderr
    ask = "import signal; print('PYTHON HANDLER', signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
    refused = subprocess.run([sys.executable, "-i", str(ROOT / LESSON), "--smoke", "--epochs", "0"], cwd=tmp_path,
                             env=script_env(tmp_path), input=ask, capture_output=True, text=True, timeout=300)
    assert "PYTHON HANDLER True" in refused.stdout, refused.stdout + refused.stderr


# An exit handler registered before the run, as `coverage run` registers its own: it must run as the process ends
EARLIER_EXIT_HANDLER = """
import atexit, os
atexit.register(lambda: open(os.path.join(os.getcwd(), "exit-handler-ran"), "w").close())
"""
AFTER_THE_BLOCK = """
    import signal
    print("after the block", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    raise SystemExit(5)
"""


@pytest.mark.slow
@pytest.mark.parametrize("flags, code", [(SHORT, 5), (["--smoke", "--resume"], 2)])
def test_code_after_the_block_runs_and_the_program_ends_as_it_says(tmp_path, flags, code):
    """A copy of 04 with lines after its `with` block: they run, with Python's own Ctrl-C handler back (the run hands
    back, it does not end the process), and the program's own exit code and an exit handler it registered before the
    run are kept; a run refused as its flags are read ends 2, that exit handler run too."""
    copy = tmp_path / "project" / LESSON
    copy.parent.mkdir()
    for name in ("local_utilities.py", "run_keeping", "smoke_weights"):
        (copy.parent / name).symlink_to(ROOT / name)
    copy.write_text((ROOT / LESSON).read_text() + AFTER_THE_BLOCK.lstrip("\n"))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(EARLIER_EXIT_HANDLER)
    proc = run_script(str(copy), *flags, cwd=tmp_path, env=script_env(tmp_path, PYTHONPATH=str(site)), fresh=True)
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert ("after the block True" in proc.stdout) == (code == 5) and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (tmp_path / "exit-handler-ran").exists()


# An error nobody can act on (a bug in the lesson: cross_entropy raises at the second step), and a shutdown
# that hangs afterwards (an exit handler that sleeps, registered first so that it runs last).
UNEXPECTED_THEN_HANG = """
import atexit, os, time
def _hang():
    open(os.environ["HOOK_HANGING"], "w").close()
    time.sleep(120)
atexit.register(_hang)
""" + BUG_AT_THE_SECOND_STEP


@pytest.mark.slow
def test_ctrl_c_after_an_unexpected_error_ends_the_process(tmp_path):
    """An unexpected error is Python's traceback; Ctrl-C afterwards, while the shutdown hangs, ends the
    process within seconds (it is not noted and forgotten)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(UNEXPECTED_THEN_HANG)
    log, hanging = tmp_path / "err.txt", tmp_path / "hanging"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, str(ROOT / LESSON), *SHORT], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                stderr=err, env=script_env(tmp_path, PYTHONPATH=str(site), HOOK_HANGING=str(hanging)),
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not hanging.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "ValueError: a bug in the lesson" in log.read_text() and hanging.exists(), log.read_text()[-2000:]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    assert proc.returncode not in (None, -9), log.read_text()[-2000:]


# Process 1's loss is NaN from its second step; process 0's stays finite.
NAN_IN_PROCESS_1 = """
import os
if os.environ.get("LOCAL_RANK") == "1":
    import torch.nn.functional as F
    _calls, _cross_entropy = [], F.cross_entropy
    def cross_entropy(*args, **kwargs):
        _calls.append(1)
        loss = _cross_entropy(*args, **kwargs)
        return loss * float("nan") if len(_calls) >= 2 else loss
    F.cross_entropy = cross_entropy
"""


@pytest.mark.slow
def test_a_nan_in_one_process_stops_every_process_in_one_line(tmp_path):
    """05's two processes, the loss NaN in process 1 alone: every process stops with exit 1 at the same
    check, and process 0 says so in one line; nothing is written for the epoch."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NAN_IN_PROCESS_1)
    proc = run_script("05_fabric-vit-mixed-ddp.py", "--smoke", "--max-steps", "6", cwd=tmp_path, timeout=240,
                      env=script_env(tmp_path, PYTHONPATH=str(site)), fresh=True)
    lines = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1 and "the loss is not finite in another process at epoch 1, batch 1" in lines[0], lines
    assert not (tmp_path / "results").exists() and not list(tmp_path.glob("checkpoints/*/*.ckpt"))
