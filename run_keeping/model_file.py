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


def plain_state_dict(model):
    """The model's whole state dict on the CPU, with the keys of torchvision's model: FSDP2's
    shards gathered (every process must call this), torch.compile's "_orig_mod." dropped."""
    # gathering a 2-D (tensor x data parallel) shard warns that it takes two steps
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    state = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):  # a DTensor: a shard of an FSDP2 parameter
            value = value.full_tensor()
        state[key.replace("_orig_mod.", "")] = value.detach().cpu()
    return state


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
