"""The parallelize functions that Fabric's ModelParallelStrategy applies to the model in the sharded
lessons, one concern each, as torchtitan keeps them: FSDP2, FSDP2 offloaded to the CPU, tensor
parallelism then FSDP2."""

import os

import torch


def fsdp_each_encoder_block(model, device_mesh, offload=False):
    """FSDP2 for Fabric's ModelParallelStrategy: each ViT EncoderBlock its own unit, sharded across
    every process, then the root (embeddings, head). Parameters are gathered in bfloat16, as the
    talk's strategy="fsdp" with bf16-mixed did; gradients are reduced in float32, where Lightning's
    reduces them in bfloat16 (plugins/precision/fsdp.py): twice the talk's gradient traffic, for
    the float32 sums DDP makes too. float32 throughout where the run's precision is not a bfloat16
    one: the precision that runs, which RunKeeper gives Fabric as LT_PRECISION (32-true on a device
    without native bfloat16: run_keeping/device.py). offload: see the next function."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torchvision.models.vision_transformer import EncoderBlock

    cuda = device_mesh.device_type == "cuda"
    bf16 = os.environ.get("LT_PRECISION", "32-true").startswith("bf16")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    place = CPUOffloadPolicy(pin_memory=cuda) if offload else OffloadPolicy()  # OffloadPolicy(): none
    for module in [*(m for m in model.modules() if isinstance(m, EncoderBlock)), model]:
        fully_shard(module, mesh=device_mesh["data_parallel"], mp_policy=policy, offload_policy=place)
    return model


def fsdp_each_encoder_block_offloaded(model, device_mesh):
    """FSDP2 as above, with CPUOffloadPolicy. Each process's shards of the parameters, gradients
    and Adam's state stay in CPU memory; a unit's shards go to the GPU just to compute, and the
    optimizer steps on the CPU. On a CPU run everything is there already: it saves nothing."""
    return fsdp_each_encoder_block(model, device_mesh, offload=True)


def tensor_parallel_mlps_then_fsdp(model, device_mesh):
    """Tensor parallelism as the talk's figure splits a matrix multiplication: in each
    EncoderBlock the MLP's first Linear split by columns and its second by rows across the
    tensor-parallel processes (each computes its share of the hidden units; one all-reduce joins
    the outputs), then FSDP2 across the data-parallel replicas as above. Attention stays whole:
    torchvision's MultiheadAttention packs q, k and v into one in_proj_weight, which a column
    split would cut across q, k and v instead of between heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchvision.models.vision_transformer import EncoderBlock

    for block in model.modules():
        if isinstance(block, EncoderBlock):  # block.mlp: Linear, GELU, Dropout, Linear, Dropout
            parallelize_module(
                block.mlp, device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "3": RowwiseParallel()}
            )
    return fsdp_each_encoder_block(model, device_mesh)
