"""How fast this CPU multiplies matrices in bfloat16 against float32, on one thread, and whether
the suite takes it for native bfloat16 (run_keeping/config.py): one JSON line. Run it with
ONEDNN_MAX_CPU_ISA=AVX2 to see a CPU without AVX512-BF16 or AMX, on any CPU.

    python tools/bf16_probe.py          # {"native": true, "bf16_gflops": ..., "fp32_gflops": ...}
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from run_keeping.device import device_name, native_bf16  # noqa: E402

SIZE = 512


def gflops(dtype, seconds=0.3):
    """GFLOP/s of SIZE x SIZE products in `dtype`, after one untimed."""
    a, b = torch.randn(SIZE, SIZE).to(dtype), torch.randn(SIZE, SIZE).to(dtype)
    a @ b
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or n < 3:
        a @ b
        n += 1
    return n * 2 * SIZE ** 3 / (time.perf_counter() - start) / 1e9


def main():
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    print(json.dumps({"native": native_bf16("cpu"), "bf16_gflops": round(gflops(torch.bfloat16), 2),
                      "fp32_gflops": round(gflops(torch.float32), 2), "size": SIZE,
                      "capability": torch.backends.cpu.get_cpu_capability(), "device_name": device_name("cpu"),
                      "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
                      "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY")}))


if __name__ == "__main__":
    main()
