"""Peak FLOP/s for MFU (model FLOP utilisation), and the model's training FLOPs per image.

    python benchmark.py --peaks    # the table
"""
import argparse
import functools

import torch

# Dense peak TFLOP/s (no sparsity) from NVIDIA's data sheets: A100 (2020; SXM and PCIe alike),
# H100 SXM and PCIe (H100 data sheet, 2023), H100 NVL and H200 SXM / NVL (H200 data sheet, 2024),
# whose tensor-core figures are printed "with sparsity" and are halved here. Lightning's table
# holds the with-sparsity H200 figures and matches only names with "sxm1"/"nvl1" in them, so it
# is used only for other GPUs. "fp32" is what 32-true runs on: no script switches TF32 on.
# Matched on the name CUDA reports, first match wins ("NVIDIA H100 80GB HBM3" is the SXM card).
PEAKS = [  # (name contains, {"fp32", "tf32", "bf16"} TFLOP/s)
    ("H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5}),
    ("H200", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5}),
    ("H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5}),
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0}),
    ("H100", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0}),
]
# The tensor-core unit each precision Fabric takes computes on (fp16 runs at bf16's rate on these
# GPUs); 64-true has no entry in the data sheets' tables, so no MFU.
UNIT = {"32-true": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "bf16",
        "16-true": "bf16", "64-true": None}
DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
          "16-mixed": torch.float16, "16-true": torch.float16, "64-true": torch.float64}


def peak_tflops(device_name, precision, given=None):
    """Dense peak TFLOP/s of a device for a precision: --peak-tflops, the table, else Lightning's
    table; None where nobody knows."""
    if given and precision in given:
        return given[precision]
    unit = UNIT.get(precision)
    if unit is None:
        return None
    for part, peaks in PEAKS:
        if part.lower() in device_name.lower():
            return peaks[unit]
    if not torch.cuda.is_available() or torch.cuda.get_device_name() != device_name:
        return None
    from lightning.fabric.utilities.throughput import get_available_flops
    flops = get_available_flops(torch.device("cuda"), DTYPES[precision])
    return flops / 1e12 if flops else None


@functools.lru_cache(maxsize=None)
def flops_per_image(smoke):
    """Training FLOPs per image, by Lightning's measure_flops on the meta device."""
    from lightning.fabric.utilities.throughput import measure_flops
    from local_utilities import NUM_CLASSES, SMOKE_IMAGE_SIZE, TALK_IMAGE_SIZE, build_vit
    size = SMOKE_IMAGE_SIZE if smoke else TALK_IMAGE_SIZE
    with torch.device("meta"):
        model = build_vit(None, argparse.Namespace(smoke=smoke, synthetic=True))
        model.heads.head = torch.nn.Linear(model.hidden_dim, NUM_CLASSES)
        x = torch.randn(2, 3, size, size)
    return measure_flops(model, lambda: model(x), lambda y: y.sum()) / 2


def peaks_table():
    lines = ["Dense peak TFLOP/s used for MFU (NVIDIA data sheets, sparsity figures halved):",
             f"{'name contains':<14} {'FP32':>6} {'TF32':>7} {'BF16/FP16':>10}"]
    lines += [f"{part:<14} {p['fp32']:>6.1f} {p['tf32']:>7.1f} {p['bf16']:>10.1f}" for part, p in PEAKS]
    lines.append("32-true uses FP32 (no script switches TF32 on); bf16-mixed, bf16-true, 16-mixed "
                 "and 16-true use BF16/FP16. Other GPUs: Lightning's table. --peak-tflops overrides.")
    return lines
