"""The Fabric scripts: equal to plain PyTorch, FSDP that shards, two nodes on one machine."""
import argparse
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, read_records, script_env


def test_fabric_equals_plain_pytorch(smoke_runs):
    """The talk's claim: converting 01 to Fabric (03) changes nothing about the training."""
    plain, fabric = smoke_runs("01_pytorch-vit.py").record, smoke_runs("03_fabric-vit.py").record
    assert len(plain["train_loss"]) == len(fabric["train_loss"]) > 1
    for a, b in zip(plain["train_loss"], fabric["train_loss"]):
        assert abs(a - b) <= 1e-6 * abs(a)
    assert plain["val_acc"] == fabric["val_acc"]
    assert plain["test_acc"] == fabric["test_acc"]


def smoke_model_parameters():
    import torch
    from local_utilities import build_vit
    model = build_vit(None, argparse.Namespace(smoke=True, synthetic=False))
    model.heads.head = torch.nn.Linear(model.hidden_dim, 10)
    return sum(p.numel() for p in model.parameters())


def test_fsdp_shards_the_model_across_two_processes(smoke_runs):
    record = smoke_runs("06_fabric-vit-mixed-fsdp.py").record
    assert record["strategy"] == "fsdp2-per-block"
    assert (record["devices"], record["num_nodes"], record["world_size"]) == (2, 1, 2)
    held = record["parameters_per_process"]
    total = smoke_model_parameters()
    assert len(held) == 2
    assert abs(sum(held) - total) <= 0.01 * total  # together they hold the model once
    for n in held:
        assert 0.45 * total <= n <= 0.55 * total  # each about half of it
    assert record["test_acc"] >= 0.85


def test_single_process_holds_the_whole_model(smoke_runs):
    assert smoke_runs("04_fabric-vit-mixed-precision.py").record["parameters_per_process"] == \
        [smoke_model_parameters()]


def test_two_nodes_with_torchrun_on_one_machine(tmp_path):
    """06 --smoke as two 'nodes' of one CPU process each, rendezvous on 127.0.0.1."""
    port = free_port()
    results = tmp_path / "runs.jsonl"
    procs = []
    try:
        for node_rank in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--node-rank", str(node_rank), "--nproc-per-node", "1",
                   "--master-addr", "127.0.0.1", "--master-port", str(port),
                   str(ROOT / "06_fabric-vit-mixed-fsdp.py"), "--smoke", "--devices", "1",
                   "--num-nodes", "2", "--results", str(results)]
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=script_env(tmp_path),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                import os
                import signal
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    records = read_records(results)
    assert len(records) == 1  # only global rank 0 writes
    record = records[0]
    assert (record["world_size"], record["num_nodes"], record["devices"]) == (2, 2, 1)
    assert record["test_acc"] >= 0.85
    # only global rank 0 prints the epoch lines
    assert sum(o.count("Train acc.:") for o in outputs) == record["epochs"]
