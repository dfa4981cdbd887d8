"""The finetuned model as one file: a plain state dict of torchvision's VisionTransformer (whole
when FSDP2 sharded it, without torch.compile's prefixes), and loading it back with clear errors."""
import logging

import torch

from run_keeping.errors import fail, why_unloadable


def count_local_parameters(model):
    """Parameters this process holds: a sharded parameter counts only its local shard."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
               for p in model.parameters())


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def held_line(held, whole):
    """How many parameters each process holds, of the model's `whole`."""
    if len(set(held)) == 1 and held[0] == whole:
        return f"Parameters held per process: each of the {len(held)} processes holds all {whole:,}"
    return "Parameters held per process: " + ", ".join(f"{n:,}" for n in held) + f" of {whole:,}"


def plain_state_dict(model):
    """The model's whole state dict on the CPU, with the keys of torchvision's model: FSDP2's
    shards gathered (every process must call this), torch.compile's "_orig_mod." dropped."""
    # gathering a 2-D (tensor x data parallel) shard warns that it takes two steps
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    state, cpu_meshes = {}, {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):  # a DTensor: a shard of an FSDP2 parameter
            value = whole(value, cpu_meshes)
        state[key.replace("_orig_mod.", "")] = value.detach().cpu()
    return state


def whole(dtensor, cpu_meshes):
    """A DTensor's whole tensor, gathered from every process. A shard in CPU memory (FSDP2's CPU
    offload, 15) on a mesh whose process group has no backend for the CPU (NCCL takes only GPU
    tensors: "No backend type associated with device type cpu") is gathered where it lies, over
    gloo, in a group of the same processes made for it. torch's own full state dict moves such a
    shard to the GPU instead (torch/distributed/_state_dict_utils.py), holding each whole tensor
    in GPU memory for a moment; a gather in CPU memory needs none."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    mesh = dtensor.device_mesh
    if mesh.ndim == 1 and not has_backend(mesh.get_group(), dtensor.device):
        if id(mesh) not in cpu_meshes:
            ranks = dist.get_process_group_ranks(mesh.get_group())
            cpu_meshes[id(mesh)] = DeviceMesh.from_group(dist.new_group(ranks, backend="gloo"), "cpu")
        dtensor = DTensor.from_local(dtensor.to_local(), cpu_meshes[id(mesh)], dtensor.placements,
                                     shape=dtensor.shape, stride=dtensor.stride(), run_check=False)
    return dtensor.full_tensor()


def has_backend(group, device):
    """Whether a process group can run collectives on `device`'s tensors."""
    try:
        group._get_backend(device)
        return True
    except RuntimeError:
        return False


def load_state_dict(model, state):
    """model.load_state_dict for a plain state dict, also into a torch.compile'd model (whose own
    keys carry "_orig_mod.")."""
    own = {key.replace("_orig_mod.", ""): key for key in model.state_dict()}
    model.load_state_dict({own.get(key, key): value for key, value in state.items()})


def misfit(model, state):
    """How a state dict differs from the model's, in a few whole words."""
    own = {key.replace("_orig_mod.", ""): value for key, value in model.state_dict().items()}
    missing, extra = own.keys() - state.keys(), state.keys() - own.keys()
    shapes = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
    parts = [f"{len(missing)} of the model's tensors missing"] if missing else []
    parts += [f"{len(extra)} tensors the model has no place for"] if extra else []
    if shapes:
        key = "conv_proj.weight" if "conv_proj.weight" in shapes else sorted(shapes)[0]
        show = lambda shape: "x".join(map(str, shape))  # noqa: E731
        parts.append(f"{len(shapes)} of another shape, {key} {show(state[key].shape)} in the "
                     f"file against {show(own[key].shape)} here")
    return ", ".join(parts) or "the tensors do not fit"


def load_model_file(model, path):
    """A finetuned model file (a plain state dict) into `model`, or one line saying what is wrong
    with the file, exit 2."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        fail(f"no model file {path}: a finished training run writes one (see --save-model).")
    except Exception as err:
        fail(f"{path} is not a readable model file: {why_unloadable(err)}.")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        fail(f"{path} is not a model file of this suite (not a state dict of tensors).")
    try:
        load_state_dict(model, state)
    except RuntimeError:
        width = state.get("conv_proj.weight", torch.empty(0)).shape[:1]
        kind = ("the small --smoke ViT" if width == (128,) else "ViT-B/16" if width == (768,)
                else "another model")
        fail(f"{path} holds {kind}, which does not fit the model built here ({misfit(model, state)})."
             " Add or drop --smoke to match the run that made it.")
    if state["heads.head.weight"].shape[0] != 10:
        fail(f"{path} has {state['heads.head.weight'].shape[0]} outputs, not 10.")
