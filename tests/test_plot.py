"""plot_results.py on records from real --smoke runs, on talk-format logs, and on bad input."""
import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT

PNG_SIZE = (1300, 850)  # figsize 13 x 8.5 inches at 100 dpi


def plot(*flags, cwd):
    return subprocess.run([sys.executable, str(ROOT / "plot_results.py"), *flags], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def table_rows(stdout):
    """{script: [columns]} from the printed table."""
    rows = {}
    for line in stdout.splitlines():
        if re.match(r"^\d\d_\S+\.py\s", line):
            name, *columns = line.split()
            rows[name] = columns
    return rows


def png_size(path):
    from PIL import Image
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        return image.format, image.size


@pytest.fixture
def smoke_records(smoke_runs, tmp_path):
    scripts = ["01_pytorch-vit.py", "03_fabric-vit.py", "04_fabric-vit-mixed-precision.py",
               "06_fabric-vit-mixed-fsdp.py"]
    records = [smoke_runs(s).record for s in scripts]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, {r["script"]: r for r in records}


def test_chart_and_table_from_real_smoke_runs(smoke_records, tmp_path):
    path, records = smoke_records
    proc = plot("--results", str(path), "--output", str(tmp_path / "chart.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert png_size(tmp_path / "chart.png") == ("PNG", PNG_SIZE)
    assert "showing smoke runs" in proc.stderr  # no full runs: smoke, and labelled as such
    assert "not a reproduction of the talk" in proc.stdout
    rows = table_rows(proc.stdout)
    assert list(rows) == sorted(records)
    t01 = records["01_pytorch-vit.py"]["train_time_s"]
    for script, r in records.items():
        time_min, talk_time, acc, talk_acc, mem, talk_mem, ips, speedup, talk_speedup = rows[script]
        assert time_min == f"{r['train_time_s'] / 60:.2f}"
        assert acc == f"{r['test_acc'] * 100:.2f}"
        assert mem == f"{r['peak_memory_gb']:.2f}"
        assert ips == f"{r['images_per_s']:.1f}"
        assert speedup == f"{t01 / r['train_time_s']:.2f}x"
    # the talk's figures beside ours, from the reference file
    assert rows["04_fabric-vit-mixed-precision.py"][1] == "6.36"
    assert rows["06_fabric-vit-mixed-fsdp.py"][3] == "96.22"
    assert rows["04_fabric-vit-mixed-precision.py"][8] == f"{18.70 / 6.36:.2f}x"


def test_full_runs_are_preferred_and_the_latest_wins(smoke_records, tmp_path):
    path, records = smoke_records
    full = dict(records["01_pytorch-vit.py"], smoke=False, train_time_s=1122.0)
    newer = dict(full, train_time_s=1100.0, test_acc=0.9537)
    with open(path, "a") as f:
        f.write(json.dumps(full) + "\n" + json.dumps(newer) + "\n")
    proc = plot("--results", str(path), "--output", str(tmp_path / "c.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    assert list(rows) == ["01_pytorch-vit.py"]  # full runs only
    assert rows["01_pytorch-vit.py"][0] == f"{1100 / 60:.2f}" and rows["01_pytorch-vit.py"][2] == "95.37"
    smoke = plot("--results", str(path), "--smoke", "--output", str(tmp_path / "s.png"),
                 cwd=tmp_path)
    assert len(table_rows(smoke.stdout)) == 4


def test_talk_format_log(tmp_path):
    log = tmp_path / "logs.md"
    log.write_text("# 01_pytorch-vit.py (finetuning pretrained)\n\n```\nEpoch: 0003/0003 | Train acc.: 97.11% | Val acc.: "
                   "95.02%\nTime elapsed 18.70 min\nMemory used: 3.71 GB\nTest accuracy 95.37%\n"
                   "```\n\n# 04_fabric-vit-mixed-precision.py\n\nLike 03 but bf16.\n\n```\nTime elapsed 6.36 min\n"
                   "Memory used: 3.04 GB\nTest accuracy 95.24%\n")
    proc = plot("--results", str(tmp_path / "none.jsonl"), "--log", str(log), "--output",
                str(tmp_path / "log.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    assert rows["01_pytorch-vit.py"][:6] == ["18.70", "18.70", "95.37", "95.37", "3.71", "3.71"]
    assert rows["04_fabric-vit-mixed-precision.py"][7] == f"{18.70 / 6.36:.2f}x"
    assert png_size(tmp_path / "log.png")[0] == "PNG"


def test_missing_and_empty_files(tmp_path):
    missing = plot("--results", str(tmp_path / "nope.jsonl"), cwd=tmp_path)
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    (tmp_path / "empty.jsonl").write_text("")
    empty = plot("--results", str(tmp_path / "empty.jsonl"), cwd=tmp_path)
    assert empty.returncode == 2 and "nothing to draw" in empty.stderr
    for proc in (missing, empty):
        assert "Traceback" not in proc.stderr


def test_bad_lines_are_named_and_skipped(smoke_records, tmp_path):
    path, records = smoke_records
    good = path.read_text().splitlines()
    lacking = {k: v for k, v in records["03_fabric-vit.py"].items() if k != "train_time_s"}
    unknown = dict(records["01_pytorch-vit.py"], script="99_mystery.py")
    path.write_text("\n".join([good[0], "{truncated", json.dumps(lacking), json.dumps(unknown),
                               good[2]]) + "\n")
    proc = plot("--results", str(path), "--output", str(tmp_path / "c.png"), cwd=tmp_path)
    assert proc.returncode == 0
    assert f"{path}:2: not JSON, skipped" in proc.stderr
    assert f"{path}:3: record lacks train_time_s, skipped" in proc.stderr
    assert f"{path}:4: unknown script '99_mystery.py', skipped" in proc.stderr
    assert list(table_rows(proc.stdout)) == ["01_pytorch-vit.py",
                                             "04_fabric-vit-mixed-precision.py"]
    assert "Traceback" not in proc.stderr


def test_png_is_whole_or_untouched(tmp_path):
    out = tmp_path / "comparison.png"
    out.write_bytes(b"an earlier chart")
    (tmp_path / "bad.jsonl").write_text("not json\n")
    proc = plot("--results", str(tmp_path / "bad.jsonl"), "--output", str(out), cwd=tmp_path)
    assert proc.returncode == 2 and "nothing to draw" in proc.stderr
    assert out.read_bytes() == b"an earlier chart"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "comparison.png"]
