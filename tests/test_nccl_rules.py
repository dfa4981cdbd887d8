"""NCCL's rules, imitated on a CPU where they can be. NCCL's processes do not notice that another
has stopped: they wait in their next collective until its timeout (Lightning's 30 minutes),
holding their GPUs. On gloo a process that ends closes its sockets and the others notice at
once, so a CPU test that ends a process proves nothing about NCCL. Here a process is kept alive
but silent, as NCCL's peers would see it."""
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, descendants, kill_group, script_env

# The failing process stays alive and silent where it would close its sockets (RunKeeper destroys
# the process group as the run ends), as NCCL's peers see one that has stopped (a gloo peer that
# exits closes its sockets, which the others notice at once).
SILENT_AFTER_FAILING = """
import os, time
if os.environ.get("LOCAL_RANK", "0") == "0":
    import torch.distributed
    _destroy = torch.distributed.destroy_process_group  # Lightning's barriers destroy groups of their own
    torch.distributed.destroy_process_group = lambda group=None: time.sleep(3600) if group is None else _destroy(group)
"""
FULL_DISK_AT_THE_MODEL_FILE = """
import errno, os
_write = os.write
def write(fd, data):
    if os.readlink(f"/proc/self/fd/{fd}").endswith(".pt.tmp") and os.environ.get("LOCAL_RANK", "0") == "0":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _write(fd, data)
os.write = write
"""


def output_of(path, until, proc, timeout):
    """The text in `path` once it holds `until` (or the process ends, or time runs out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        text = path.read_text() if path.exists() else ""
        if until in text:
            return text
        time.sleep(0.2)
    return path.read_text() if path.exists() else ""


@pytest.mark.slow
def test_a_failure_in_process_0_alone_stops_every_process_at_once(tmp_path):
    """Point 4: process 0 alone cannot write the model file (its disk is full) and then stays
    alive and silent, as a stopped NCCL peer looks to the others. Process 1 stops within
    seconds, in one line of its own, with process 0's exit code: it learnt of the failure from
    process 0 (RunKeeper.agree), not from a closed socket, which NCCL would not see."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SILENT_AFTER_FAILING + FULL_DISK_AT_THE_MODEL_FILE)
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "05_fabric-vit-mixed-ddp.py"), "--smoke", "--max-steps", "10"],
                                cwd=tmp_path, env=script_env(tmp_path, PYTHONPATH=str(site)),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        failed = output_of(log, "cannot write models/", proc, 240)
        began = time.monotonic()
        text = output_of(log, "stops too", proc, 30)

        def running():  # process 1, while it runs
            return [pid for pid in descendants(proc.pid) if "05_fabric" in open(f"/proc/{pid}/cmdline").read()]
        while running() and time.monotonic() - began < 15:
            time.sleep(0.2)
        waited, others = time.monotonic() - began, running()
    finally:
        kill_group(proc, signal.SIGKILL)
    assert "cannot write models/" in failed and "No space left on device" in failed, failed[-3000:]
    ours = [line for line in text.splitlines() if "error:" in line]
    assert len(ours) == 2, text[-3000:]  # process 0's reason and process 1's
    assert "05_fabric-vit-mixed-ddp.py: error: process 1 of 2 stops too: another process could not go on" in text
    assert "was lost" not in text  # not a closed socket's doing
    assert waited < 15 and not others, (waited, others)  # process 1 is gone, process 0 silent
