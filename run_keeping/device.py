"""What this machine gives a run, read as a lesson parses its flags: the GPUs torch can use, in torch's own words
where it cannot use them; the CPU and whether it computes bfloat16; the precision that runs. Diagnosing a machine
whose GPUs torch does not use (nvidia-smi's own error, MIG, ROCm, the driver's modules, which build carries which
architectures) is `bash gpu_check.sh`'s, which the lines here name (docs/gpu-setup.md)."""

import os
import warnings
from pathlib import Path

DIAGNOSIS = "bash gpu_check.sh says what this machine has and which torch build runs on it (docs/gpu-setup.md)"


def cuda_gpus():
    """(how many GPUs CUDA gives this torch, torch's words where it cannot use them, or None). CUDA is started first,
    so that MIG instances and CUDA_VISIBLE_DEVICES count as CUDA counts them: until then torch asks the driver (NVML,
    as Lightning has it do). Starting CUDA raises torch's words where the driver cannot run this build; where the build
    has no kernels for a GPU, torch warns, naming the GPU."""
    import torch

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if not torch.cuda.is_available():  # a CPU build, no driver or no GPU the driver lists, or CUDA's own error
            return 0, " ".join(str(warning.message) for warning in said) or None
        try:
            torch.cuda.init()  # before device_count(): CUDA's count, not NVML's
        except (RuntimeError, AssertionError) as err:
            return 0, str(err)
    count = torch.cuda.device_count()
    names = {torch.cuda.get_device_name(index) for index in range(count)}
    about_a_gpu = [str(warning.message) for warning in said if any(name in str(warning.message) for name in names)]
    return count, about_a_gpu[0] if about_a_gpu else None  # the first: torch says it twice, this the fuller


def no_gpu_line(then, diagnose=True):
    """The line for a machine where torch sees no GPU; `then`: the way on without one; `diagnose`: name gpu_check.sh."""
    import torch

    why = ""
    if torch.version.cuda is None and torch.version.hip is None:
        why = f" (this torch {torch.__version__} is a CPU build)"
    elif "CUDA_VISIBLE_DEVICES" in os.environ:
        why = f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
    line = f"no CUDA GPU found{why}. {then}"
    return f"{line} Where this machine has a GPU, {DIAGNOSIS}." if diagnose else line


def unusable_gpu_line(words, diagnose=True):
    """The line for GPUs torch cannot use, in `words`, torch's own; `diagnose`: name gpu_check.sh."""
    line = f"torch cannot use this machine's GPU: {words}"
    return f"{line} {DIAGNOSIS}." if diagnose else line


def cpu_model_and_flags():
    """The CPU's model and flags, as Linux's /proc/cpuinfo gives them; elsewhere none."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
    except OSError:
        return "", []
    info = {key.strip(): value.strip() for key, value in info.items()}
    return info.get("model name", ""), (info.get("flags") or info.get("Features") or "").split()


def native_bf16(device_type):
    """Whether the device computes bfloat16 in hardware: a GPU from Ampere on (torch says); a CPU with AVX512-BF16 or
    AMX (or Arm's bf16) unless oneDNN is capped below them (torch says it of a CPU only in private names, so Linux's
    flags are read). With AVX2 alone a 512x512 product ran 110 times slower than in float32."""
    if device_type == "cuda":
        import torch

        return torch.cuda.is_bf16_supported(including_emulation=False)
    _, cap = onednn_cap()
    # oneDNN's ISA names that reach the bfloat16 units: AVX512_CORE_BF16, _FP16, _AMX (and _AMX_FP16), AVX10_1_512...
    capped = cap is not None and not any(isa in cap.upper() for isa in ("BF16", "FP16", "AMX", "AVX10"))
    return not capped and bool({"avx512_bf16", "amx_bf16", "bf16"} & set(cpu_model_and_flags()[1]))


def onednn_cap():
    """(the variable, its value) that caps the instructions oneDNN uses, as oneDNN reads them: ONEDNN_MAX_CPU_ISA, else
    the older DNNL_MAX_CPU_ISA; (None, None) where neither caps (ALL and DEFAULT: oneDNN's own choice)."""
    name = "ONEDNN_MAX_CPU_ISA" if "ONEDNN_MAX_CPU_ISA" in os.environ else "DNNL_MAX_CPU_ISA"
    cap = os.environ.get(name)
    return (None, None) if cap is None or cap.upper() in ("ALL", "DEFAULT") else (name, cap)


def precision_that_runs(asked, accelerator):
    """32-true where `asked` computes in bfloat16 (bf16..., or 16-mixed on a CPU, which Lightning runs as bf16-mixed:
    "AMP with fp16 is not supported on CPU") on a device without native bfloat16; otherwise, or None, as asked."""
    in_bf16 = asked and (asked.startswith("bf16") or (accelerator == "cpu" and asked in ("16-mixed", "16")))
    return "32-true" if in_bf16 and not native_bf16(accelerator) else asked


def device_name(accelerator):
    """The GPU's name, or the CPU's model, cores, bfloat16 units and oneDNN's cap if one is set."""
    if accelerator == "cuda":
        import torch

        return torch.cuda.get_device_name()
    model, flags = cpu_model_and_flags()
    units = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    name, cap = onednn_cap()
    if cap:
        units.append(f"oneDNN capped at {cap} by {name}")
    details = "".join(", " + unit for unit in units)
    return f"CPU {model or 'unknown'} ({os.cpu_count()} cores{details})"


def fallback_line(args, ran):
    """What a run says where it runs 32-true for want of native bfloat16 (`ran`: Fabric's precision), or None."""
    # no fallback decided (or no precision known); or a Fabric made outside the run's block, which set no LT_PRECISION
    if args.precision == args.precision_asked or ran != args.precision:
        return None
    instead = f"running {ran} instead of {args.precision_asked}"
    if args.accelerator == "cuda":
        return f"This GPU ({device_name('cuda')}) has no native bfloat16: {instead}."
    slow = "emulated bfloat16 runs many times slower than float32; the record says both"
    where = "What bfloat16 saves in time and memory shows on a CPU with AVX512-BF16 or AMX, or a GPU from Ampere on"
    none = f"This {device_name('cpu')} has no native bfloat16 (no AVX512-BF16 or AMX, or oneDNN capped below them)"
    return f"{none}: {instead}, since {slow}. {where} (docs/smoke.md)."
