"""The memory lessons: the arithmetic benchmark.py --memory --talk and --sequel print beside what
they measure, its relations along the sequel's chain, and the chain measured on real runs."""
import subprocess
import sys

import pytest

from benchmarks import memory, runs
from conftest import native_bf16, ROOT, in_memory, read_records, script_env

# what each script's record says it ran (run_keeping/record.py); its optimizer, checkpointing
# and strategy the arithmetic takes from lessons.csv
CHAIN = {
    "04": dict(precision="bf16-mixed", micro_batches=1),
    "11": dict(precision="bf16-true", micro_batches=1),
    "12": dict(precision="bf16-true", micro_batches=4),
    "13": dict(precision="bf16-true", micro_batches=4),
    "14": dict(precision="bf16-true", micro_batches=4),
}


def record(number, vit, batch=16, **over):
    values = dict(script=runs.SCRIPTS[number], model=vit, settings={}, world_size=1, data_parallel=None, batch_size=batch,
                  max_steps=5, **CHAIN.get(number, CHAIN["04"]))
    values.update(over)
    return values


@pytest.mark.parametrize("vit", ["vit_b_16", "vit_l_16"])
def test_each_lesson_of_the_chain_shrinks_the_term_it_names(vit):
    parameters = memory.vit_shape(vit)[0]
    terms = {n: memory.arithmetic(record(n, vit)) for n in CHAIN}
    total = {n: sum(t.values()) for n, t in terms.items()}
    # bf16-true: weights, gradients and Adam's moments at 2 bytes instead of 4, no autocast copy
    assert total["11"] < total["04"]
    state = lambda n: sum(terms[n][k] for k in ("weights", "gradients", "optimizer", "autocast's bf16 weights") if k in terms[n])  # noqa: E731
    assert state("04") == 18 * parameters and state("11") == 8 * parameters
    # accumulation: a quarter of the batch at a time, so a quarter of the activations
    assert terms["12"]["activations"] * 4 == terms["11"]["activations"]
    # checkpointing: each block's input (1/17 of a block's worth: a token's width against 9 of
    # them and 2 of the MLP's 4x) and one block again, instead of every block: 1/17 + 1/blocks
    blocks = memory.vit_shape(vit)[1]
    assert terms["13"]["activations"] <= terms["12"]["activations"] * (1 / 17 + 1 / blocks)
    # SGD without momentum: Adam's two moments (2 bytes each here) gone, nothing else
    assert terms["13"]["optimizer"] == 4 * parameters and terms["14"]["optimizer"] == 0
    assert total["13"] - total["14"] == 4 * parameters
    assert all(total[a] > total[b] for a, b in zip(CHAIN, list(CHAIN)[1:]))


def test_the_talks_arithmetic_adds_what_each_strategy_holds():
    """01: 16 bytes a parameter and float32 activations; 04 adds autocast's bf16 copies and
    halves most activations; 05 adds DDP's float32 buckets; 06 holds a quarter on 4 processes."""
    vit = "vit_b_16"
    p = memory.vit_shape(vit)[0]
    one = memory.arithmetic(record("04", vit, precision="32-true"))
    mixed = memory.arithmetic(record("04", vit))
    ddp = memory.arithmetic(record("05", vit, world_size=4))
    fsdp = memory.arithmetic(record("06", vit, world_size=4))
    assert one["weights"] + one["gradients"] + one["optimizer"] == 16 * p
    assert memory.state_terms("32-true", "AdamW", "single-device", p, p) == memory.state_terms("32-true", "Adam", "single-device", p, p)
    assert mixed["autocast's bf16 weights"] == 2 * p and ddp["DDP's buckets"] == 4 * p
    assert 0.5 < mixed["activations"] / one["activations"] < 0.6  # bf16, but LayerNorm inputs
    assert fsdp["weights"] + fsdp["gradients"] + fsdp["optimizer"] == pytest.approx(16 * p / 4)
    assert "autocast's bf16 weights" not in fsdp  # FSDP2 gathers bf16 weights itself, a block at a time
    # every process makes the whole synthetic set: 4 processes hold 4 times the images
    assert ddp["synthetic images"] == 4 * mixed["synthetic images"]


def saved_for_backward(model, images, **autocast):
    """Bytes autograd keeps for backward in one forward pass of `model` (each storage once)."""
    import torch
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", **autocast):
        model(images).sum()
    return sum(seen.values())


@pytest.mark.slow
def test_the_activation_term_is_what_autograd_saves():
    """The arithmetic's activations per image against what autograd keeps for backward in one
    forward pass of ViT-B/16 at 224, in float32 (01), under bf16-mixed autocast (04) and in
    bfloat16 (11). The arithmetic counts 9 values a token of the width and 2 of the MLP's per
    block, as if every saved tensor were separate; some are views of one another, and it leaves
    out the attention's per-head statistics: within 10% either way."""
    import torch
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.vit_b_16(num_classes=10)
    params = sum(p.numel() for p in model.parameters())
    image = torch.rand(1, 3, 224, 224)
    arithmetic = lambda **over: memory.arithmetic(record("04", "vit_b_16", batch=1, **over))["activations"]  # noqa: E731
    # a Linear saves its weight too: the parameters themselves, or autocast's bf16 copies of them
    plain = saved_for_backward(model, image, enabled=False) - 4 * params
    mixed = saved_for_backward(model, image, dtype=torch.bfloat16) - 2 * params
    true16 = saved_for_backward(model.bfloat16(), image.bfloat16(), enabled=False) - 2 * params
    assert plain == pytest.approx(arithmetic(precision="32-true"), rel=0.10)
    assert mixed == pytest.approx(arithmetic(), rel=0.10)
    assert true16 == pytest.approx(arithmetic(precision="bf16-true"), rel=0.10)
    assert true16 < mixed < plain


# 04, 11, 13 and 14 (12 is 13 less its checkpointing: 11 to 13 shows both activation lessons,
# and one run less keeps the suite within its time)
MEASURED = ["04", "11", "13", "14"]


def run_the_chain(cwd):
    env = script_env(cwd, **runs.EXACT_MALLOC)
    records = {}
    for number in MEASURED:
        with in_memory() as scratch:  # its 1 GB checkpoint and model file: written to memory
            proc = subprocess.run([sys.executable, str(ROOT / runs.SCRIPTS[number]), "--synthetic",
                                   "--accelerator", "cpu", "--batch-size", "4", "--max-steps", "4",
                                   "--save-model", str(scratch / f"{number}.pt"), "--checkpoint-dir",
                                   str(scratch / "checkpoints")], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records[number] = read_records(cwd / "results" / "runs.jsonl")[-1]
    return {"records": records, "libraries": memory.libraries_gb(False)}


@pytest.fixture
def chain_at_batch_4(once_per_run):
    """04, 11, 13 and 14 as they are, on ViT-B/16 at 224 with synthetic images, batch 4 (13-14:
    4 micro-batches of 1), 4 steps, with glibc's thresholds fixed as benchmarks/runs.py's; their
    records and what the libraries alone hold. Run once for the tests that read it. On a CPU
    without native bfloat16 the chain's bf16 lessons would all run float32 (or, emulated, for
    minutes a step): skipped, saying why."""
    if not native_bf16():
        pytest.skip("this CPU has no native bfloat16 (no AVX512-BF16 or AMX, or oneDNN capped below them): "
                    "04, 11, 13 and 14 run float32 here and show no bfloat16 saving; a CPU with either, or a GPU, "
                    "measures them (python benchmark.py --memory --sequel)")
    chain = once_per_run("memory-chain-at-batch-4", run_the_chain)
    return chain["records"], chain["libraries"]


# What the arithmetic leaves out, and so what a measured saving may differ from its arithmetic
# by: the transient buffers at the peak (on a CPU Adam steps one parameter at a time, so its
# temporaries are the size of the largest weight, 768 x 3,072; backward's are one MLP
# activation of the batch, 4 x 197 x 3,072 values; float32 at most: 9.4 and 9.7 MB), each run's
# own, so twice; and the activation count's error, at most 10% of each run's activations
# (test_the_activation_term_is_what_autograd_saves).
TRANSIENTS_GB = 2 * (768 * 3072 * 4 + 4 * 197 * 3072 * 4) / 1e9


@pytest.mark.slow
def test_each_lesson_saves_what_its_arithmetic_says(chain_at_batch_4):
    """bf16-true below bf16-mixed, accumulation and checkpointing shrinking the activations, SGD
    without Adam's two moments: each measured saving within the arithmetic's tolerance."""
    records, _ = chain_at_batch_4
    for a, b in zip(MEASURED, MEASURED[1:]):
        before, after = memory.arithmetic(records[a]), memory.arithmetic(records[b])
        expected = (sum(before.values()) - sum(after.values())) / 1e9
        measured = records[a]["peak_memory_gb"] - records[b]["peak_memory_gb"]
        slack = TRANSIENTS_GB + 0.10 * (before["activations"] + after["activations"]) / 1e9
        assert measured > 0, (a, b)
        assert abs(measured - expected) <= slack, (a, b, measured, expected, slack)


@pytest.mark.slow
def test_a_talk_shaped_run_holds_its_arithmetic(chain_at_batch_4):
    """11 (bf16-true, Adam) on ViT-B/16 at 224: its peak less the libraries within 10% of the
    arithmetic, plus the transients above. The 10% holds the activation count's own error
    (at most 10% of the activations, a quarter of the total here) and what the arithmetic does
    not count at all: the project's own modules (22 MB measured with glibc's thresholds fixed,
    2026-12-02) and the CPU kernels' first-use buffers, a few tens of MB."""
    records, libraries = chain_at_batch_4
    expected = sum(memory.arithmetic(records["11"]).values()) / 1e9
    measured = records["11"]["peak_memory_gb"] - libraries
    assert abs(measured - expected) <= 0.10 * expected + TRANSIENTS_GB / 2, (measured, expected)


@pytest.mark.slow
def test_cpu_offload_on_a_cpu_is_06(smoke_runs):
    """15 keeps the shards in CPU memory; on a CPU they are there already, so it does 06's maths
    exactly (06's smoke run: two torchrun nodes; 15's: Fabric's 2 processes) and learns as 06."""
    fsdp, offload = (smoke_runs(s).record for s in ("06_fabric-vit-mixed-fsdp.py", "15_fabric-vit-fsdp-cpu-offload.py"))
    assert offload["train_loss"] == fsdp["train_loss"] and offload["test_acc"] == fsdp["test_acc"]


def test_15s_parallelize_offloads_every_unit_and_06s_none():
    """What a CPU cannot show by its figures (the line above would pass for a 15 whose offload was
    dropped): each FSDP2 unit of 15's parallelize function carries the CPU offload policy, of 06's
    none. FSDP2 says a unit's policy only through a private name (_get_fsdp_state): this test, off
    every lesson's run, is where a torch release that renames it shows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    import local_utilities as lu
    import parallelize
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
        for apply, offloaded in ((parallelize.fsdp_each_encoder_block_offloaded, 4), (parallelize.fsdp_each_encoder_block, 0)):
            units = [m for m in apply(lu.smoke_vit(), mesh).modules() if isinstance(m, FSDPModule)]
            policies = [m._get_fsdp_state()._fsdp_param_group.offload_policy for m in units]
            assert (len(units), sum(isinstance(p, CPUOffloadPolicy) for p in policies)) == (4, offloaded)
    finally:
        dist.destroy_process_group()
