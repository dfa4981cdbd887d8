"""Every numbered script's --smoke run, end to end, and the diff budgets between them."""
import re
import subprocess

import pytest

from conftest import ROOT, SCRIPTS

RECORD_KEYS = {"script", "smoke", "accelerator", "device_name", "devices", "num_nodes",
               "world_size", "precision", "strategy", "epochs", "batch_size", "seed",
               "train_time_s", "images_per_s", "peak_memory_gb", "train_loss", "val_acc",
               "test_acc", "torch", "torchvision", "lightning", "python", "timestamp"}
BATCH_LINE = re.compile(r"^Epoch: \d{4}/\d{4} \| Batch \d{4}/\d{4} \| Loss: \d+\.\d{4}$", re.M)
EPOCH_LINE = re.compile(r"^Epoch: \d{4}/\d{4} \| Train acc\.: \d+\.\d{2}% \| Val acc\.: \d+\.\d{2}%$",
                        re.M)
WALL_LIMIT_S = {"06_fabric-vit-mixed-fsdp.py": 150}


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_run_learns_and_records(smoke_runs, script):
    run = smoke_runs(script)
    assert run.proc.returncode == 0, run.proc.stdout[-3000:]
    out = run.proc.stdout
    record = run.record
    assert RECORD_KEYS <= record.keys()
    assert record["script"] == script and record["smoke"] is True
    assert record["accelerator"] == "cpu" and record["device_name"].startswith("CPU")
    assert record["test_acc"] >= 0.85
    assert len(record["train_loss"]) == len(record["val_acc"]) == record["epochs"]
    assert record["train_loss"][-1] < record["train_loss"][0]
    assert record["peak_memory_gb"] > 0 and record["images_per_s"] > 0
    assert 0 < record["train_time_s"] < run.proc.wall_s
    # the talk's log lines, once per epoch each (the smoke epoch has under 300 batches)
    assert len(BATCH_LINE.findall(out)) == record["epochs"]
    assert len(EPOCH_LINE.findall(out)) == record["epochs"]
    assert re.search(r"^Time elapsed \d+\.\d{2} min$", out, re.M)
    assert re.search(r"^Memory used: \d+\.\d{2} GB$", out, re.M)
    assert f"Test accuracy {record['test_acc'] * 100:.2f}%" in out
    assert run.proc.wall_s <= WALL_LIMIT_S.get(script, 60), f"took {run.proc.wall_s:.0f} s"


def test_records_say_what_ran(smoke_runs):
    expected = {  # script: (precision, strategy, world size)
        "01_pytorch-vit.py": ("32-true", "single-device", 1),
        "03_fabric-vit.py": ("32-true", "single-device", 1),
        "04_fabric-vit-mixed-precision.py": ("bf16-mixed", "single-device", 1),
        "06_fabric-vit-mixed-fsdp.py": ("bf16-mixed", "fsdp2-per-block", 2),
    }
    for script, (precision, strategy, world_size) in expected.items():
        record = smoke_runs(script).record
        assert (record["precision"], record["strategy"], record["world_size"]) == \
               (precision, strategy, world_size), script


def changed_lines(a, b):
    out = subprocess.run(["diff", str(ROOT / a), str(ROOT / b)], capture_output=True, text=True)
    return sum(1 for line in out.stdout.splitlines() if line[:1] in "<>")


@pytest.mark.parametrize("a, b, budget", [
    ("00_pytorch-vit-random-init.py", "01_pytorch-vit.py", 4),
    ("01_pytorch-vit.py", "03_fabric-vit.py", 30),
    ("03_fabric-vit.py", "04_fabric-vit-mixed-precision.py", 2),
    ("04_fabric-vit-mixed-precision.py", "06_fabric-vit-mixed-fsdp.py", 4),
])
def test_the_diff_is_the_lesson(a, b, budget):
    assert 0 < changed_lines(a, b) <= budget


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_tf32_switch(script):
    text = (ROOT / script).read_text()
    assert "set_float32_matmul_precision" not in text and "allow_tf32" not in text
