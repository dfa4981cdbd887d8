"""Never lose a run: kill and resume, Ctrl-C, the NaN guard, unloadable checkpoints."""
import json
import os
import signal
import sys

import pytest
import torch

import local_utilities as lu
from conftest import finish, kill_group, read_records, run_script, script_env, start, \
    start_script, wait_for

EARLIER = '{"script": "00_pytorch-vit-random-init.py", "test_acc": 0.6285}\n'


@pytest.mark.parametrize("script", ["01_pytorch-vit.py", "03_fabric-vit.py",
                                    "06_fabric-vit-mixed-fsdp.py"])
def test_killed_then_resumed_equals_uninterrupted(smoke_runs, tmp_path, script):
    """SIGKILL after the first epoch's checkpoint, then --resume, launched as the smoke run was
    (06: two torchrun nodes): the same losses and accuracies as the uninterrupted run."""
    results = tmp_path / "results" / "runs.jsonl"
    results.parent.mkdir()
    results.write_text(EARLIER)
    ckpt_dir = tmp_path / "checkpoints" / (script[:-3] + "-smoke")

    procs = start(script, "--smoke", cwd=tmp_path)
    reached = wait_for(ckpt_dir / lu.LATEST, procs[0])
    outputs = [kill_group(p, signal.SIGKILL) for p in procs]
    assert reached, outputs[0][-3000:]
    # killed mid-training: the records file is as it was, and valid JSONL
    assert results.read_text() == EARLIER
    assert json.loads((ckpt_dir / lu.LATEST).read_text())["epochs_done"] >= 1

    procs = start(script, "--smoke", "--resume", cwd=tmp_path)
    outputs = finish(procs)
    assert [p.returncode for p in procs] == [0] * len(procs), outputs[0][-3000:]
    assert "Resuming" in outputs[0]
    records = read_records(results)
    assert len(records) == 2 and records[0] == json.loads(EARLIER)
    record, baseline = records[1], smoke_runs(script).record
    assert record["resumed"] is True and baseline["resumed"] is False
    assert len(record["train_loss"]) == len(baseline["train_loss"]) == record["epochs"]
    for a, b in zip(record["train_loss"], baseline["train_loss"]):
        assert abs(a - b) <= 1e-6 * abs(b)
    assert record["val_acc"] == baseline["val_acc"]
    assert record["test_acc"] == baseline["test_acc"]
    assert record["steps"] == baseline["steps"]
    assert record["train_time_s"] > 0
    assert not ckpt_dir.exists()  # finished: nothing left to resume


def test_ctrl_c_stops_cleanly(tmp_path):
    results = tmp_path / "results" / "runs.jsonl"
    results.parent.mkdir()
    results.write_text(EARLIER)
    ckpt_dir = tmp_path / "checkpoints" / "01_pytorch-vit-smoke"
    proc = start_script("01_pytorch-vit.py", "--smoke", cwd=tmp_path)
    reached = wait_for(ckpt_dir / lu.LATEST, proc)
    out = kill_group(proc, signal.SIGINT)
    assert reached, out[-3000:]
    assert proc.returncode == 130
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and "epoch-0001.ckpt" in lines[0] and "--resume" in lines[0]
    assert results.read_text() == EARLIER
    assert (ckpt_dir / "epoch-0001.ckpt").exists()


NAN_AT_THIRD_STEP = """
import torch, torch.nn.functional as F
_calls = [0]
_cross_entropy = F.cross_entropy
def cross_entropy(*args, **kwargs):
    _calls[0] += 1
    loss = _cross_entropy(*args, **kwargs)
    return loss * float("nan") if _calls[0] == 3 else loss
F.cross_entropy = cross_entropy
"""


def test_nan_loss_stops_the_run(tmp_path):
    """A NaN loss (injected into the 3rd training step) stops at that step, exit 1, no record."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NAN_AT_THIRD_STEP)
    env = script_env(tmp_path, PYTHONPATH=str(site))
    proc = run_script("04_fabric-vit-mixed-precision.py", "--smoke", cwd=tmp_path, env=env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "the loss is nan at epoch 1, batch 2" in proc.stderr
    assert not (tmp_path / "results" / "runs.jsonl").read_text()


@pytest.fixture
def parse(monkeypatch, tmp_path):
    handler = signal.getsignal(signal.SIGINT)

    def parse_args(*flags, script="01_pytorch-vit.py"):
        monkeypatch.setattr(sys, "argv", [script, "--smoke", "--results",
                                          str(tmp_path / "runs.jsonl"), *flags])
        return lu.parse_args(epochs=3)
    yield parse_args
    signal.signal(signal.SIGINT, handler)


def model_and_optimizer(args):
    model = lu.build_vit(None, args)
    return model, torch.optim.Adam(model.parameters(), lr=5e-5)


def test_resume_with_nothing_to_resume(parse, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--resume", "--checkpoint-dir", str(tmp_path / "none"))
    assert exit_info.value.code == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_fresh_run_refuses_to_overwrite_an_unfinished_one(parse, tmp_path, capsys):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / lu.LATEST).write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        parse("--checkpoint-dir", str(tmp_path / "ck"))
    assert exit_info.value.code == 2
    assert "--resume" in capsys.readouterr().err
    assert (tmp_path / "ck" / lu.LATEST).read_text() == "{}"


def write_checkpoint(args, epochs_done=1, **meta):
    """A real checkpoint of the smoke model, written by Run's own save."""
    model, optimizer = model_and_optimizer(args)
    run = lu.Run(args)
    run.resume(model, optimizer, train_loader=None)
    run._epoch_losses = [1.0]
    run.end_epoch(epochs_done - 1, model, optimizer, val_acc=0.5, train_time_s=1.0)
    latest = os.path.join(args.checkpoint_dir, lu.LATEST)
    if meta:
        data = json.load(open(latest))
        data.update(meta)
        json.dump(data, open(latest, "w"))
    return latest


@pytest.mark.parametrize("meta, words", [
    ({"script": "03_fabric-vit.py"}, ["from 03_fabric-vit.py with 1 process"]),
    ({"world_size": 2}, ["with 2 process(es)", "with 1"]),
])
def test_resume_from_another_script_or_world_size(parse, tmp_path, capsys, meta, words):
    ck = str(tmp_path / "ck")
    write_checkpoint(parse("--checkpoint-dir", ck), **meta)
    before = {p: open(os.path.join(ck, p), "rb").read() for p in os.listdir(ck)}
    args = parse("--resume", "--checkpoint-dir", ck)
    model, optimizer = model_and_optimizer(args)
    with pytest.raises(SystemExit) as exit_info:
        lu.Run(args).resume(model, optimizer, train_loader=None)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert {p: open(os.path.join(ck, p), "rb").read() for p in os.listdir(ck)} == before


def test_resume_from_a_corrupt_checkpoint(parse, tmp_path, capsys):
    ck = tmp_path / "ck"
    write_checkpoint(parse("--checkpoint-dir", str(ck)))
    checkpoint = ck / "epoch-0001.ckpt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])  # truncated, as by a full disk
    corrupt = checkpoint.read_bytes()
    args = parse("--resume", "--checkpoint-dir", str(ck))
    model, optimizer = model_and_optimizer(args)
    with pytest.raises(SystemExit) as exit_info:
        lu.Run(args).resume(model, optimizer, train_loader=None)
    assert exit_info.value.code == 2
    assert "cannot load" in capsys.readouterr().err
    assert checkpoint.read_bytes() == corrupt
    (ck / lu.LATEST).write_text("{not json")
    with pytest.raises(SystemExit):
        lu.Run(args).resume(model, optimizer, train_loader=None)
    assert "corrupt" in capsys.readouterr().err


def test_checkpoint_restores_model_and_optimizer(parse, tmp_path):
    ck = str(tmp_path / "ck")
    args = parse("--checkpoint-dir", ck)
    model, optimizer = model_and_optimizer(args)
    model(torch.rand(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    run = lu.Run(args)
    run.resume(model, optimizer, train_loader=None)
    run._epoch_losses = [2.0, 4.0]
    run.end_epoch(0, model, optimizer, val_acc=0.5, train_time_s=3.0)
    args = parse("--resume", "--checkpoint-dir", ck)
    fresh, fresh_optimizer = model_and_optimizer(args)
    resumed = lu.Run(args)
    resumed.resume(fresh, fresh_optimizer, train_loader=None)
    assert torch.equal(fresh.conv_proj.weight, model.conv_proj.weight)
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1
    assert (resumed.start_epoch, resumed.train_loss, resumed.val_acc) == (1, [3.0], [0.5])
    assert resumed.earlier_train_time == 3.0
