"""What this machine offers a run, checked while a lesson parses its flags: the GPUs torch can use (quoting torch's
own error where it cannot use them), the CPU and whether it computes bfloat16 natively, and so the precision that runs.
Diagnosing why torch does not use a machine's GPUs (nvidia-smi's error, MIG, ROCm, the driver's modules, which build
supports which GPU architectures) is left to `bash gpu_check.sh`, which the errors here name (docs/gpu-setup.md)."""

import os
import warnings
from pathlib import Path

DIAGNOSIS = "bash gpu_check.sh says what this machine has and which torch build runs on it (docs/gpu-setup.md)"


def cuda_gpus():
    """(how many GPUs CUDA gives this torch; torch's message where it cannot use them, else None). CUDA is started
    first, so MIG instances and CUDA_VISIBLE_DEVICES count as CUDA counts them, not as NVML lists the driver's. Starting
    it raises where the driver cannot run this build; where the build has no kernels for a GPU, torch warns of it."""
    import torch

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if not torch.cuda.is_available():  # a CPU build, no driver, no GPU listed by the driver, or a CUDA error
            return 0, " ".join(str(warning.message) for warning in said) or None
        try:
            torch.cuda.init()  # before device_count(): CUDA's count, not NVML's
        except (RuntimeError, AssertionError) as err:
            return 0, str(err)
    count = torch.cuda.device_count()
    names = {torch.cuda.get_device_name(index) for index in range(count)}
    about_a_gpu = [str(warning.message) for warning in said if any(name in str(warning.message) for name in names)]
    return count, about_a_gpu[0] if about_a_gpu else None  # torch warns twice; the first is the fuller


def no_gpu_line(then, diagnose=True):
    """The error when torch sees no GPU here; `then`: what the user can do instead; `diagnose`: name gpu_check.sh."""
    import torch

    why = ""
    if torch.version.cuda is None and torch.version.hip is None:
        why = f" (this torch {torch.__version__} is a CPU build)"
    elif "CUDA_VISIBLE_DEVICES" in os.environ:
        why = f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
    line = f"no CUDA GPU found{why}. {then}"
    return f"{line} Where this machine has a GPU, {DIAGNOSIS}." if diagnose else line


def unusable_gpu_line(words, diagnose=True):
    """The error for GPUs that torch cannot use, quoting torch's own `words`; `diagnose`: name gpu_check.sh."""
    line = f"torch cannot use this machine's GPU: {words}"
    return f"{line} {DIAGNOSIS}." if diagnose else line


def cpu_model_and_flags():
    """The CPU's model name and feature flags from Linux's /proc/cpuinfo; ("", []) where it cannot be read."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
    except OSError:
        return "", []
    info = {key.strip(): value.strip() for key, value in info.items()}
    return info.get("model name", ""), (info.get("flags") or info.get("Features") or "").split()


def native_bf16(device_type):
    """Whether the device computes bfloat16 in hardware: a GPU from Ampere on (torch's check); a CPU with AVX512-BF16
    or AMX (or Arm's bf16) unless oneDNN is capped below them (torch tells this for a CPU only in private APIs, so
    /proc/cpuinfo's flags are read). On an AVX2-only EPYC a 512x512 matrix product ran 110 times slower than float32."""
    if device_type == "cuda":
        import torch

        return torch.cuda.is_bf16_supported(including_emulation=False)
    _, cap = onednn_cap()
    # oneDNN's ISA names that reach the bfloat16 units: AVX512_CORE_BF16, _FP16, _AMX (and _AMX_FP16), AVX10_1_512...
    capped = cap is not None and not any(isa in cap.upper() for isa in ("BF16", "FP16", "AMX", "AVX10"))
    return not capped and bool({"avx512_bf16", "amx_bf16", "bf16"} & set(cpu_model_and_flags()[1]))


def onednn_cap():
    """(name, value) of the variable that caps the instruction set oneDNN uses, as oneDNN reads it: ONEDNN_MAX_CPU_ISA
    unless empty, else the older DNNL_MAX_CPU_ISA; (None, None) if empty, ALL or DEFAULT (oneDNN's own choice)."""
    name = "ONEDNN_MAX_CPU_ISA" if os.environ.get("ONEDNN_MAX_CPU_ISA") else "DNNL_MAX_CPU_ISA"
    cap = os.environ.get(name)
    return (None, None) if not cap or cap.upper() in ("ALL", "DEFAULT") else (name, cap)


def precision_that_runs(asked, accelerator):
    """32-true if `asked` computes in bfloat16 (bf16..., or 16-mixed on a CPU, which Lightning runs as bf16-mixed:
    "AMP with fp16 is not supported on CPU") on a device without native bfloat16; otherwise `asked`, even None."""
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
    """What a run prints when it runs 32-true for want of native bfloat16 (`ran`: Fabric's precision); or None."""
    # no fallback was decided (or the precision is unknown), or Fabric was made outside the block, without LT_PRECISION
    if args.precision == args.precision_asked or ran != args.precision:
        return None
    instead = f"running {ran} instead of {args.precision_asked}"
    if args.accelerator == "cuda":
        return f"This GPU ({device_name('cuda')}) has no native bfloat16: {instead}."
    slow = "emulated bfloat16 runs many times slower than float32; the record says both"
    where = "What bfloat16 saves in time and memory shows on a CPU with AVX512-BF16 or AMX, or a GPU from Ampere on"
    none = f"This {device_name('cpu')} has no native bfloat16 (no AVX512-BF16 or AMX, or oneDNN capped below them)"
    return f"{none}: {instead}, since {slow}. {where} (docs/smoke.md)."
