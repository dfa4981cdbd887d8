"""NCCL's rules, imitated on a CPU where they can be. On a GPU a process group made by Lightning
for NCCL has no backend for CPU tensors, and NCCL's processes do not notice that another has
stopped: they wait in their next collective until its timeout, holding their GPUs. On gloo a
process that ends closes its sockets and the others notice at once, so a CPU test that ends a
process proves nothing about NCCL. Here a group is made without a CPU backend, and a process is
kept alive but silent, as NCCL's peers would see it."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, descendants, free_port, kill_group, script_env

GATHER = """
import os, sys
sys.path.insert(0, sys.argv[2])
import torch, torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
import local_utilities as lu
from run_keeping.checkpoints import plain_state_dict
dist.init_process_group(sys.argv[1])  # "cuda:gloo": no backend for CPU tensors, as NCCL's
mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("data_parallel",))
torch.manual_seed(0)
model = lu.smoke_vit()
whole = {k: v.clone() for k, v in model.state_dict().items()}
lu.fsdp_each_encoder_block_offloaded(model, mesh)  # 15's: each shard kept in CPU memory
shard = next(iter(model.state_dict().values()))
try:
    shard.full_tensor()
    print("GATHERED ON THE MESH")
except RuntimeError as err:
    print("MESH GATHER FAILED:", err)
state = plain_state_dict(model)
print("PLAIN", all(torch.equal(state[k], whole[k]) for k in whole), len(state) == len(whole), flush=True)
from run_keeping import leave
leave(0)  # as the suite's gloo runs leave: past the interpreter's shutdown, where gloo can abort
"""


@pytest.mark.slow
def test_15s_offloaded_shards_are_gathered_where_nccl_has_no_cpu_backend(tmp_path):
    """Point 3: 15's shards live in CPU memory; on two GPUs Lightning's process group is NCCL's
    alone, and gathering them there fails with NCCL's error. Reproduced with a gloo group for
    CUDA tensors only ("No backend type associated with device type cpu"); the model file's
    gather (model_file.plain_state_dict) still gives the whole, equal model."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-c", GATHER, "cuda:gloo", str(ROOT)], cwd=tmp_path, text=True,
        env=script_env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
        assert "MESH GATHER FAILED: No backend type associated with device type cpu" in out, out[-3000:]
        assert "PLAIN True True" in out, out[-3000:]


# The failing process stays alive and silent where it would have left, as NCCL's peers see one
# that has stopped (a gloo peer that exits closes its sockets, which the others notice at once).
SILENT_AFTER_FAILING = """
import os, time
if os.environ.get("LOCAL_RANK", "0") == "0":
    os._exit = lambda code: time.sleep(3600)
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
    process 0 (run_keeping/processes.py), not from a closed socket, which NCCL would not see."""
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
        waited = time.monotonic() - began
        others = [pid for pid in descendants(proc.pid) if "05_fabric" in open(f"/proc/{pid}/cmdline").read()]
    finally:
        kill_group(proc, signal.SIGKILL)
    assert "cannot write models/" in failed and "No space left on device" in failed, failed[-3000:]
    ours = [line for line in text.splitlines() if "error:" in line]
    assert len(ours) == 2, text[-3000:]  # process 0's reason and process 1's
    assert "05_fabric-vit-mixed-ddp.py: error: process 1 of 2 stops too: process 0 could not go on" in text
    assert "was lost" not in text  # not a closed socket's doing
    assert waited < 15 and not others, (waited, others)  # process 1 is gone, process 0 silent


@pytest.mark.slow
def test_a_process_that_hangs_holds_the_others_only_for_the_collective_timeout(tmp_path):
    """A process stopped outright (SIGSTOP: alive, silent, as a hung GPU is to NCCL) in the
    middle of training: the other leaves once its next collective has waited the run's
    COLLECTIVE_TIMEOUT_S (here 5 s; Lightning's own is 30 minutes), in one line, exit 3."""
    log = tmp_path / "out.txt"
    env = script_env(tmp_path, COLLECTIVE_TIMEOUT_S="5")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "05_fabric-vit-mixed-ddp.py"), "--smoke", "--epochs", "20"],
                                cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output_of(log, "Epoch: 0002/0020 | Batch 0000", proc, 240)
        os.kill(proc.pid, signal.SIGSTOP)  # process 0: Lightning started process 1 from it
        stopped = time.monotonic()
        text = output_of(log, "was lost", proc, 60)
        waited = time.monotonic() - stopped
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        kill_group(proc, signal.SIGKILL)
    ours = [line for line in text.splitlines() if "error: a process of the run was lost" in line]
    assert len(ours) == 1 and "Process 1 of 2 stops too" in ours[0], text[-3000:]
    assert 4 < waited < 30, waited
