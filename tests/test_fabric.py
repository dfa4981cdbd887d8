"""The Fabric scripts: equal to plain PyTorch, FSDP that shards, two nodes on one machine."""
import argparse

from conftest import read_records


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
    assert record["world_size"] == 2
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


def test_two_nodes_with_torchrun_on_one_machine(smoke_runs):
    """06 --smoke as two torchrun 'nodes' on 127.0.0.1: exactly one record, world size 2, that
    learned, and only global rank 0 printed the epoch lines (fabric.print prints per machine)."""
    run = smoke_runs("06_fabric-vit-mixed-fsdp.py")
    assert run.proc.returncode == 0, run.proc.stdout[-3000:]
    records = read_records(run.dir / "results" / "runs.jsonl")
    assert len(records) == 1
    record = records[0]
    assert (record["world_size"], record["num_nodes"], record["devices"]) == (2, 2, 1)
    assert record["test_acc"] >= 0.85
    assert [o.count("Train acc.:") for o in run.proc.outputs] == [record["epochs"], 0]


def test_bf16_falls_back_to_16_mixed_on_a_gpu_without_bf16(monkeypatch, capsys):
    """The decision and its one line; only the GPU's answers are stood in for (no GPU here)."""
    import torch
    from local_utilities import supported_precision
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-16GB")
    cuda = argparse.Namespace(accelerator="cuda")
    assert supported_precision("bf16-mixed", cuda) == "16-mixed"
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["This GPU (Tesla V100-SXM2-16GB) has no bfloat16: running 16-mixed instead "
                   "of bf16-mixed."]
    assert supported_precision("32-true", cuda) == "32-true"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert supported_precision("bf16-mixed", cuda) == "bf16-mixed"
    assert supported_precision("bf16-mixed", argparse.Namespace(accelerator="cpu")) == "bf16-mixed"
    assert capsys.readouterr().out == ""
