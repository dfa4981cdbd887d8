"""The Fabric scripts: equal to plain PyTorch, DDP and FSDP2 that shard and cast as they should,
two nodes on one machine, and the bf16 fallback on GPUs without bfloat16."""
import argparse
import os
import subprocess
import sys

import pytest
import torch

import local_utilities as lu
import parallelize
from run_keeping.config import read_script
from run_keeping.device import fallback_line, precision_that_runs
from conftest import native_bf16, ROOT, free_port, read_records


@pytest.mark.slow
def test_fabric_equals_plain_pytorch(smoke_runs):
    """The talk's claim: converting 01 to Fabric (03) changes nothing about the training."""
    plain, fabric = smoke_runs("01_pytorch-vit.py").record, smoke_runs("03_fabric-vit.py").record
    assert len(plain["train_loss"]) == len(fabric["train_loss"]) > 1
    for a, b in zip(plain["train_loss"], fabric["train_loss"]):
        assert abs(a - b) <= 1e-6 * abs(a)
    assert plain["val_acc"] == fabric["val_acc"]
    assert plain["test_acc"] == fabric["test_acc"]


def smoke_model():
    model = lu.build_vit(None, argparse.Namespace(smoke=True, synthetic=False))
    model.heads.head = torch.nn.Linear(model.hidden_dim, 10)
    return model


def smoke_model_parameters():
    return sum(p.numel() for p in smoke_model().parameters())


@pytest.mark.slow
def test_fsdp_and_ddp_run_two_processes_that_learn(smoke_runs):
    """06 (FSDP2) and 05 (DDP) on Fabric's 2 processes: each says who started it, no warning is
    printed once per process, and the run learns. (What each process holds: the two-process
    FSDP2 check below, and benchmark.py --memory.)"""
    for script in ("05_fabric-vit-mixed-ddp.py", "06_fabric-vit-mixed-fsdp.py"):
        run = smoke_runs(script)
        assert run.record["world_size"] == 2 and run.record["test_acc"] >= 0.85
    run = smoke_runs("05_fabric-vit-mixed-ddp.py")
    for rank in (0, 1):
        assert f"Process {rank} of 2, started by Lightning, which started this machine's processes itself." in run.out
    assert "deprecated" not in run.out


@pytest.mark.slow
def test_two_nodes_with_torchrun_on_one_machine(smoke_runs):
    """06 --smoke as two torchrun 'nodes' on 127.0.0.1: exactly one record, world size 2, that
    learned; each node prints its progress once (fabric.print: once per machine)."""
    run = smoke_runs("06_fabric-vit-mixed-fsdp.py")
    records = read_records(run.dir / "results" / "runs.jsonl")
    assert len(records) == 1
    record = records[0]
    assert (record["world_size"], record["devices"]) == (2, 1)  # two machines of one process
    assert record["test_acc"] >= 0.85
    assert [o.count("Train acc.:") for o in run.outputs] == [len(record["train_loss"])] * 2
    assert [o.count("Run record appended") for o in run.outputs] == [1, 0]


@pytest.fixture
def one_process_group():
    """A one-process gloo group on 127.0.0.1 and the 2-D mesh Fabric's ModelParallelStrategy
    builds (data_parallel x tensor_parallel)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    dist.destroy_process_group()


def test_fsdp2_makes_every_encoder_block_a_unit_and_gathers_bf16(one_process_group, monkeypatch):
    from torch.distributed.fsdp import FSDPModule
    monkeypatch.setenv("LT_PRECISION", "bf16-mixed" if native_bf16() else "32-true")  # as RunKeeper sets it
    from torchvision.models.vision_transformer import EncoderBlock
    model = parallelize.fsdp_each_encoder_block(smoke_model(), one_process_group)
    blocks = [m for m in model.modules() if isinstance(m, EncoderBlock)]
    assert len(blocks) == 3 and all(isinstance(b, FSDPModule) for b in blocks)
    assert isinstance(model, FSDPModule)
    seen = []
    for block in blocks:
        block.mlp.register_forward_hook(lambda m, i, o: seen.append(m[0].weight.dtype))
    model(torch.rand(2, 3, 32, 32)).sum().backward()
    # parameters gathered in bfloat16 for the forward pass, where the CPU has it (else float32, as 06 runs)
    assert seen == [torch.bfloat16 if native_bf16() else torch.float32] * 3
    assert all(p.dtype == torch.float32 for p in model.parameters())  # kept in float32
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # reduced in float32



@pytest.mark.parametrize("precision, gathered", [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16),
                                                 (None, torch.float32)])
def test_fsdp2_gathers_in_the_precision_that_runs(one_process_group, monkeypatch, precision, gathered):
    """FSDP2's policy gathers parameters in bfloat16 only where the run's precision, as RunKeeper gives it to Fabric
    (LT_PRECISION), is a bfloat16 one: a device without native bfloat16 runs 06-07 in 32-true, and gathers float32;
    without a run's precision, float32 (Fabric's default)."""
    from torchvision.models.vision_transformer import EncoderBlock
    if precision is None:
        monkeypatch.delenv("LT_PRECISION", raising=False)
    else:
        monkeypatch.setenv("LT_PRECISION", precision)
    model = parallelize.fsdp_each_encoder_block(smoke_model(), one_process_group)
    seen = []
    for block in (m for m in model.modules() if isinstance(m, EncoderBlock)):
        block.mlp.register_forward_hook(lambda m, i, o: seen.append(m[0].weight.dtype))
    model(torch.rand(2, 3, 32, 32))
    assert seen == [gathered] * 3


TWO_PROCESS_CHECK = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torchvision.models.vision_transformer import EncoderBlock
sys.path.insert(0, sys.argv[1])
import local_utilities as lu
import parallelize
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
torch.manual_seed(0)
from torchvision.models.vision_transformer import VisionTransformer
model = VisionTransformer(image_size=32, patch_size=16, num_layers=3, num_heads=4, hidden_dim=128, mlp_dim=256)
model = parallelize.fsdp_each_encoder_block(model, mesh)
seen = []
for m in model.modules():
    if isinstance(m, EncoderBlock):
        m.mlp.register_forward_hook(lambda mod, i, o: seen.append((mod[0].weight.dtype, tuple(mod[0].weight.shape))))
model(torch.rand(2, 3, 32, 32)).sum().backward()
local = [p.to_local().shape[0] for n, p in model.named_parameters() if n.endswith("layer_0.mlp.0.weight")]
print("RESULT", rank, seen, local, flush=True)
dist.barrier()  # both done before either leaves: a peer gone mid-teardown made gloo abort (seen once)
dist.destroy_process_group()  # as RunKeeper ends a run: no gloo thread left for the interpreter's shutdown
"""


@pytest.mark.slow
def test_fsdp2_in_two_processes_gathers_whole_bf16_parameters(tmp_path):
    """Two gloo processes on 127.0.0.1: each holds half of a weight, and the forward pass sees
    the whole weight, gathered in bfloat16."""
    script = tmp_path / "check.py"
    script.write_text(TWO_PROCESS_CHECK)
    port = str(free_port())
    env = dict(os.environ, LT_PRECISION="bf16-mixed")  # 06's, as RunKeeper gives it to Fabric
    procs = [subprocess.Popen([sys.executable, str(script), str(ROOT), str(rank), port],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for rank in (0, 1)]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    for output in outputs:
        line = next(line for line in output.splitlines() if line.startswith("RESULT"))
        assert line.count("torch.bfloat16") == 3 and "(256, 128)" in line  # whole
        assert line.endswith("[128]")  # the process's own half of that 256-row weight


@pytest.mark.parametrize("script", ["04_fabric-vit-mixed-precision.py", "06_fabric-vit-mixed-fsdp.py"])
def test_bf16_falls_back_on_a_gpu_without_bf16(monkeypatch, script):
    """The decision, its one line, and Fabric running it: on a GPU without native bfloat16 every bf16 precision runs
    as 32-true (one rule: no 16-mixed, which FSDP2's strategy refuses), and the lesson's Fabric(precision=
    "bf16-mixed") made with LT_PRECISION set, as RunKeeper sets it, runs it. Only the GPU's answers are stood in
    for (no GPU here)."""
    import argparse

    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    said = read_script(ROOT / script)
    assert said["precision"] == "bf16-mixed" and precision_that_runs("bf16-mixed", "cuda") == "32-true"
    assert precision_that_runs("bf16-true", "cuda") == "32-true" and precision_that_runs("32-true", "cuda") == "32-true"
    fell_back = argparse.Namespace(precision_asked="bf16-mixed", precision="32-true", accelerator="cuda")
    line = fallback_line(fell_back, "32-true")
    assert line == "This GPU (Tesla T4) has no native bfloat16: running 32-true instead of bf16-mixed."
    monkeypatch.setenv("LT_PRECISION", "32-true")
    made = ModelParallelStrategy(parallelize.fsdp_each_encoder_block, 1, 1) if "fsdp" in script else "auto"
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed", strategy=made)
    assert fabric.strategy.precision.precision == "32-true"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert precision_that_runs("bf16-mixed", "cuda") == "bf16-mixed"
