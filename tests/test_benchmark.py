"""Synthetic mode and benchmark.py: the table is the records' numbers, FLOPs are ViT-B/16's."""
import re
import subprocess
import sys

import pytest

import benchmark
from conftest import ROOT, read_records, script_env

ROW = re.compile(r"^(\d\d_\S+\.py)\s+(\d+)\s+(\S+)\s+(\d+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)\s+(\S+)$",
                 re.M)


def test_vit_b_16_training_flops_match_the_known_figure():
    # torchvision's 17.56 GFLOPS are multiply-adds: 35.1 GFLOP forward, x3 with backward
    assert 104e9 < benchmark.flops_per_image(smoke=False) < 106e9


def test_benchmark_smoke_table_comes_from_the_synthetic_records(tmp_path):
    results = tmp_path / "bench.jsonl"
    cmd = [sys.executable, str(ROOT / "benchmark.py"), "--smoke", "--scripts", "01", "04",
           "--max-steps", "8", "--peak-tflops", "1", "--loader-images", "96",
           "--loader-workers", "0", "1", "--results", str(results)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=script_env(tmp_path), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_records(results)
    assert [r["script"] for r in records] == ["01_pytorch-vit.py",
                                              "04_fabric-vit-mixed-precision.py"]
    for r in records:
        assert r["synthetic"] is True and r["test_acc"] is None and r["val_acc"] is None
        assert r["steps"] == 8 and r["images_per_s"] > 0 and r["peak_memory_gb"] > 0
    rows = {m[0]: m[1:] for m in ROW.findall(proc.stdout)}
    assert list(rows) == [r["script"] for r in records]
    flops = benchmark.flops_per_image(smoke=True)
    base = records[0]["images_per_s"]
    for r in records:
        batch, precision, devices, ips, speedup, memory, mfu = rows[r["script"]]
        assert (int(batch), precision, int(devices)) == (r["batch_size"], r["precision"], 1)
        assert float(ips) == pytest.approx(r["images_per_s"], abs=0.05)
        assert speedup == f"{r['images_per_s'] / base:.2f}x"
        assert memory == f"{r['peak_memory_gb']:.2f}"
        assert mfu == f"{r['images_per_s'] * flops / 1e12 * 100:.1f}%"
    assert "0 workers:" in proc.stdout and "1 workers:" in proc.stdout
    assert not (tmp_path / "data").exists()  # synthetic: nothing downloaded or read


def test_benchmark_rejects_unknown_scripts(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--scripts", "09"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown script number(s) 09" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_loader_rate_is_measured():
    rates = benchmark.loader_rates(48, [0])
    assert rates[0] > 0
