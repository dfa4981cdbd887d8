"""What nvidia-smi lists against what torch sees, and the one line that says what to do where they differ: GPUs that
CUDA_VISIBLE_DEVICES hides, a torch build the driver cannot run (and the build that runs), a driver too old, fewer
GPUs than a run asks for (docs/gpu-setup.md)."""

import os
import re
import shutil
import subprocess

# The oldest Linux driver a torch build of each CUDA major runs on (CUDA's minor-version compatibility), and the
# newest such build on PyTorch's index. NVIDIA's CUDA Toolkit release notes, table 3: "CUDA Toolkit and Minimum
# Required Driver Version for CUDA Minor Version Compatibility" (docs/gpu-setup.md).
CUDA_BUILDS = {"13": ("580.65.06", "13.0"), "12": ("525.60.13", "12.8"), "11": ("450.80.02", "11.8")}
# A Blackwell GPU (compute capability 10.x or 12.x) has kernels from CUDA 12.8 on, and a driver from R570 on
BLACKWELL = {"compute_cap": (10,), "cuda": (12, 8), "driver": (570,)}
INDEX = "https://download.pytorch.org/whl"
SMI_FIELDS = ("index", "uuid", "name", "driver_version", "compute_cap")  # compute_cap: from driver 510 on


def version(text):
    """'580.65.06' as (580, 65, 6), so that versions compare in full."""
    return tuple(int(part) for part in re.findall(r"\d+", text or ""))


def nvidia_smi(*args):
    """nvidia-smi's output, or None where none is on PATH or it fails (no driver loaded: exit 9; no GPU: exit 6)."""
    smi = shutil.which("nvidia-smi")
    try:
        proc = subprocess.run([smi, *args], capture_output=True, text=True, timeout=30) if smi else None
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc and proc.returncode == 0 else None


def listed():
    """The GPUs nvidia-smi lists, in its order, each {field: value} of SMI_FIELDS (an old driver: no compute_cap)."""
    for fields in (SMI_FIELDS, SMI_FIELDS[:-1]):
        out = nvidia_smi(f"--query-gpu={','.join(fields)}", "--format=csv,noheader")
        if out is not None:
            rows = [line.split(", ") for line in out.splitlines()]
            return [dict(zip(fields, row)) for row in rows if len(row) == len(fields)]
    return []


def shown(gpus, ids):
    """The GPUs CUDA_VISIBLE_DEVICES `ids` shows CUDA, up to the first id that names none or repeats one: indices
    (counted here; CUDA numbers the GPUs in an order of its own), or GPU UUIDs or their beginnings."""
    if ids.startswith("MIG-"):
        return gpus  # MIG instances: nvidia-smi's GPUs cannot say
    seen = []
    for id in (id.strip() for id in ids.split(",")):
        match = [gpus[int(id)]] if id.isdigit() and int(id) < len(gpus) else []
        match = match or [g for g in gpus if id.startswith("GPU-") and g["uuid"].startswith(id)]
        if len(match) != 1 or match[0] in seen:
            break
        seen.append(match[0])
    return seen


def cuda_starts():
    """Whether this torch's CUDA runtime starts on the driver. Lightning's import has torch count the GPUs through the
    driver's NVML (PYTORCH_NVML_BASED_CUDA_CHECK), which lists them where this build cannot use the driver too."""
    import torch

    try:
        torch.cuda.init()
    except (RuntimeError, AssertionError):  # a driver too old for the build; a build without CUDA
        return False
    return True


def usable_gpus():
    """How many GPUs this torch can use: those it counts, where its CUDA runtime starts on the driver."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return count if count and cuda_starts() else 0


def no_kernels_line():
    """Where a GPU torch uses has no kernels in this build (none compiled for its architecture: the CUDA 13.0 build of
    torch 2.14 carries sm_75, Turing, to sm_120), the line that says so; else None (torch.cuda.get_arch_list)."""
    import torch

    archs = torch.cuda.get_arch_list()
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        if archs and not any(has_kernels(arch, major, minor) for arch in archs):
            gpu = f"{torch.cuda.get_device_name(index)} (compute capability {major}.{minor})"
            carries = f"it carries {', '.join(archs)}: install a build that does (docs/gpu-setup.md)"
            return f"this torch {torch.__version__} has no kernels for {gpu}; {carries}."
    return None


def has_kernels(arch, major, minor):
    """Whether `arch` (sm_86, compute_90) runs on a GPU of that capability: a binary of its major and a minor at most
    its, or PTX of an architecture at most its, which the driver compiles for it."""
    kind, number = arch.split("_")[0], re.sub(r"\D", "", arch.split("_")[1])
    built = (int(number[:-1]), int(number[-1]))
    return built[0] == major and built[1] <= minor if kind == "sm" else built <= (major, minor)


def no_gpu_line(then):
    """Where torch sees no GPU, the line that says why and what to do (`then`: the caller's way on a CPU, where
    CUDA_VISIBLE_DEVICES hides the GPUs); None where nvidia-smi lists none, fails or is absent."""
    gpus, ids = listed(), os.environ.get("CUDA_VISIBLE_DEVICES")
    chosen = gpus if ids is None else shown(gpus, ids)
    if gpus and not chosen:
        hides = f"CUDA_VISIBLE_DEVICES={ids!r} {'hides' if ids in ('', '-1') else 'names none of'}"
        return f"no CUDA GPU found: {hides} the {len(gpus)} GPU(s) nvidia-smi lists (unset it to use them). {then}"
    return unusable_gpu_line(chosen) if chosen else None


def unusable_gpu_line(gpus):
    """The line for GPUs that nvidia-smi lists and torch does not see: the build that runs on the driver where this
    one does not, the driver where none does, or the driver and the machine where this build runs."""
    import torch

    driver, build = gpus[0]["driver_version"], torch.version.cuda
    cap = max((g.get("compute_cap") or "" for g in gpus), key=version)
    blackwell = version(cap) >= BLACKWELL["compute_cap"]
    newer = [cuda for floor, cuda in CUDA_BUILDS.values() if version(driver) >= version(floor)]
    runs = [cuda for cuda in newer if not blackwell or version(cuda) >= BLACKWELL["cuda"]]
    floor = CUDA_BUILDS.get((build or "").split(".")[0], (None, None))[0]
    if not build:
        why = "a CPU build uses no GPU"
    elif not floor:
        why = f"a CUDA {build} build runs on no driver this check knows"
    elif version(driver) < version(floor):
        why = f"a CUDA {build} build needs driver {floor} or newer"
    elif blackwell and version(build) < BLACKWELL["cuda"]:
        why = f"a CUDA {build} build has no kernels for a Blackwell GPU (compute capability {cap})"
    else:
        why = None
    if blackwell and version(driver) < BLACKWELL["driver"]:
        cure = f"a Blackwell GPU (compute capability {cap}) needs driver 570 or newer: update the NVIDIA driver"
    elif not runs:
        oldest = ", ".join(f"CUDA {cuda} from {floor}" for floor, cuda in CUDA_BUILDS.values())
        cure = f"the driver is older than any torch build runs on ({oldest}): update the NVIDIA driver"
    elif not why:  # the build runs on this driver: the driver or the machine does not
        cure = "this build fits the driver: check that the driver works (nvidia-smi -q) and that nothing hides the GPU"
    else:
        install = f"pip install --force-reinstall torch torchvision --index-url {INDEX}/cu{runs[0].replace('.', '')}"
        cure = f"{why}; install a CUDA {runs[0]} build, the newest this driver runs: {install}"
    names = [g["name"] for g in gpus]  # a count before each model there are several of
    what = ", ".join(f"{names.count(n)} x {n}" if names.count(n) > 1 else n for n in dict.fromkeys(names))
    torch_build = f"{torch.__version__} ({f'CUDA {build} build' if build else 'CPU build'})"
    it = "it" if len(gpus) == 1 else "them"
    seen = f"nvidia-smi sees {what} (driver {driver}), but this torch {torch_build} cannot use {it}"
    return f"{seen}: {cure} (docs/gpu-setup.md)."


def fewer_gpus_line(count, has, asked, command):
    """Where torch sees `has` GPUs, fewer than the `count` a run asks for (by `asked`): the line, with the `command`
    that runs on those it sees; CUDA_VISIBLE_DEVICES named where it shows torch fewer than nvidia-smi lists."""
    ids, why = os.environ.get("CUDA_VISIBLE_DEVICES"), f"this machine has {has}"
    gpus = listed() if ids is not None else []
    if len(gpus) > has:
        why = f"CUDA_VISIBLE_DEVICES={ids!r} shows torch {has} of the {len(gpus)} GPUs nvidia-smi lists"
    it = "it" if has == 1 else "them"
    return f"asked for {count} GPU(s) per machine ({asked}) but {why}: {command} runs on {it}."


def flags_for(flags, has, group=1, group_flag=None):
    """`flags` with --devices set for the `has` GPUs torch sees: the most that the tensor-parallel `group` divides,
    or, with fewer than a group, all of them as one group (`group_flag`)."""
    regroup = has < group and group_flag
    dropped, kept, values = {"--devices", *([group_flag] if regroup else [])}, [], iter(flags)
    for flag in values:
        if flag.split("=")[0] not in dropped:
            kept.append(flag)
        elif "=" not in flag:
            next(values, None)
    devices = has - has % group if has >= group else has
    return [*kept, "--devices", str(devices), *([group_flag, str(has)] if regroup else [])]
