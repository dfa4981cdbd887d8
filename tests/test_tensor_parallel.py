"""10, tensor parallelism: each MLP split across processes, the same maths as one process, each
training image counted once, the model file whole; TP 2 x DP 2 on 4 processes."""
import argparse

import pytest
import torch

import local_utilities as lu
from run_keeping.config import SMOKE_GLOBAL_BATCH
from conftest import read_records, run_script

TP = "10_fabric-vit-tensor-parallel.py"
# Per-epoch mean losses of a TP=2 run against a TP=1 run of the same script and data order. The
# split changes only where sums are rounded: RowwiseParallel adds the two halves of each MLP's
# output in an all-reduce, under bf16-mixed autocast the halves are bfloat16 (8 significant
# bits, a relative rounding step of 2**-8 = 0.4%), and Adam follows the slightly different
# gradients for 148 steps. Measured here: 0.2% apart at most; a wrong split (each process
# seeing half a batch, or a missing all-reduce) is off by far more than 1%.
LOSS_TOLERANCE = 0.01


def smoke_parameters():
    """(all parameters, those a tensor-parallel split of 2 leaves each process) of the smoke ViT
    with 10 classes: each MLP's first Linear (weight, bias) and second weight are halved."""
    model = lu.build_vit(None, argparse.Namespace(smoke=True, synthetic=False))
    model.heads.head = torch.nn.Linear(model.hidden_dim, 10)
    total = sum(p.numel() for p in model.parameters())
    split = sum(layer.mlp[0].weight.numel() + layer.mlp[0].bias.numel() + layer.mlp[3].weight.numel()
                for layer in model.encoder.layers)
    return total, total - split // 2


@pytest.fixture
def one_process_run(smoke_runs):
    """10 --smoke with --tensor-parallel 1 on one process: the same script without the split."""
    return smoke_runs(TP, "--devices", "1", "--tensor-parallel", "1").record


@pytest.mark.slow
def test_the_split_is_the_same_maths(smoke_runs, one_process_run):
    tp2, tp1 = smoke_runs(TP).record, one_process_run
    assert (tp2["settings"], tp2["world_size"]) == ({"--tensor-parallel": 2}, 2)  # 10's own flag, from its script
    assert (tp1["settings"], tp1["world_size"]) == ({"--tensor-parallel": 1}, 1)
    assert tp1["model_file"].endswith("-tensor-parallel1.pt") and tp2["model_file"].endswith("-smoke.pt")
    # both processes of the pair train on the same batch of 16: as many steps as one process
    assert tp2["batch_size"] == tp1["batch_size"] == SMOKE_GLOBAL_BATCH
    assert f"Batch 0000/{1197 // SMOKE_GLOBAL_BATCH:04d}" in smoke_runs(TP).out
    assert len(tp2["train_loss"]) == len(tp1["train_loss"]) == 2
    for a, b in zip(tp2["train_loss"], tp1["train_loss"]):
        assert abs(a - b) <= LOSS_TOLERANCE * b, (tp2["train_loss"], tp1["train_loss"])
    assert abs(tp2["test_acc"] - tp1["test_acc"]) <= 0.02 and tp2["test_acc"] >= 0.85


@pytest.mark.slow
def test_each_process_holds_half_of_each_mlp(smoke_runs):
    run = smoke_runs(TP)
    total, held = smoke_parameters()
    assert f"Parameters held per process: {held:,}, {held:,} of {total:,}" in run.out


@pytest.mark.slow
def test_the_model_file_is_whole_and_plain(smoke_runs):
    """The split gathered: torchvision's model loads the file as it is."""
    run = smoke_runs(TP)
    model = lu.smoke_vit()
    model.heads.head = torch.nn.Linear(model.hidden_dim, 10)
    state = torch.load(run.dir / run.record["model_file"], weights_only=True)
    model.load_state_dict(state)
    assert state["encoder.layers.encoder_layer_0.mlp.0.weight"].shape == (256, 128)
    assert not any(type(v) is not torch.Tensor for v in state.values())


@pytest.mark.slow
def test_two_tensor_parallel_pairs_split_the_batch_between_them(tmp_path):
    """--devices 4: TP 2 x DP 2. The batch of 16 is split over the 2 data-parallel replicas only
    (8 each; both processes of a pair see the same 8), so each replica takes --max-steps steps
    of 8 (split over all 4 processes it would take half as many); each image is counted once;
    each pair holds one FSDP2 shard of the model, whose MLPs are halved again by the split."""
    proc = run_script(TP, "--smoke", "--devices", "4", "--max-steps", "8", "--epochs", "1",
                      cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = read_records(tmp_path / "results" / "runs.jsonl")[-1]
    assert (record["settings"], record["world_size"], record["batch_size"]) == ({"--tensor-parallel": 2}, 4, 8)
    assert "Batch 0000/0008" in proc.stdout  # 8 steps of 8 per replica
    said = next(line for line in proc.stdout.splitlines() if line.startswith("Parameters held per process: "))
    held = [int(n.replace(",", "")) for n in said.split(": ")[1].split(" of ")[0].split(", ")]
    total, held_tp2 = smoke_parameters()
    split = 2 * (total - held_tp2)  # the MLP parameters that tensor parallelism splits
    assert held[0] == held[1] and held[2] == held[3] and max(held) < held_tp2
    assert sum(held) == 2 * (total - split) + split  # the rest held twice (once per pair)


def test_a_tensor_parallel_size_that_does_not_divide_the_processes_is_one_line(capsys):
    """10 --smoke runs 2 processes: --tensor-parallel 3 does not divide them, and 0 makes no group; each is refused
    in one line naming the flag (exit 2), before any work; 2 and 1 are taken."""
    from conftest import parse_as
    for size in ("3", "0"):
        with pytest.raises(SystemExit) as stopped:
            parse_as(TP, "--smoke", "--tensor-parallel", size)
        err = capsys.readouterr().err.strip()
        assert stopped.value.code == 2 and err.count("\n") == 0, err
        assert f"--tensor-parallel {size} does not divide the 2 processes" in err, err
    assert [parse_as(TP, "--smoke", "--tensor-parallel", size).data_parallel for size in ("2", "1")] == [1, 2]
