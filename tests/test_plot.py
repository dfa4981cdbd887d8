"""plot_results.py on records from real --smoke runs, on talk-format logs, and on bad input."""
import contextlib
import io
import json
import os
import re
import stat
import subprocess
import sys

import pytest

from conftest import ROOT

import plot_results
from run_keeping.reading import lessons
from run_keeping.reading import upgrade
from conftest import SCRIPTS


def plot(*flags, cwd):
    """`python plot_results.py FLAGS` run in `cwd` as a subprocess: what subprocess.run gives."""
    return subprocess.run([sys.executable, str(ROOT / "plot_results.py"), *flags], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def plot_here(*flags, cwd):
    """plot_results.py's main with these flags, in this process (matplotlib loaded once, not each
    time), in `cwd`: its exit code and what it printed, as plot() gives them."""
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                plot_results.main(list(flags))
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["plot_results.py", *flags], code, out.getvalue(), err.getvalue())


def table_rows(stdout):
    """{script: [columns]} from the printed table: its 11 figures, then its settings (one string);
    a script with runs of several settings: {script [settings]: ...} for each."""
    rows = {}
    for line in stdout.splitlines():
        if re.match(r"^\d\d_\S+\.py\s", line):
            name, *columns = line.split(maxsplit=12)
            columns[-1:] = [columns[-1]] if len(columns) == 12 else columns[-1:] + ["-"]
            key = name if name not in rows else f"{name} [{columns[11]}]"
            rows[key] = columns
    return rows


def png_size(path):
    from PIL import Image
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        return image.format, image.size


@pytest.fixture
def smoke_records(smoke_runs, tmp_path):
    records = [smoke_runs(s).record for s in SCRIPTS]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, {r["script"]: r for r in records}


@pytest.mark.slow
def test_chart_and_table_from_real_smoke_runs(smoke_records, tmp_path):
    path, records = smoke_records
    proc = plot("--results", str(path), "--output", str(tmp_path / "chart.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert png_size(tmp_path / "chart.png")[0] == "PNG"
    assert "showing smoke runs" in proc.stderr  # no full runs: smoke, and labelled as such
    assert "not a reproduction of the talk" in proc.stdout
    rows = table_rows(proc.stdout)
    assert list(rows) == sorted(records)
    ips01 = records["01_pytorch-vit.py"]["images_per_s"]
    for script, r in records.items():
        time_min, talk_time, acc, talk_acc, mem, talk_mem, ips, speedup, talk_speedup, n, spread, settings = rows[script]
        assert (n, spread) == ("1", "-")  # one seed each
        assert time_min == f"{r['train_time_s'] / 60:.2f}"
        assert acc == f"{r['test_acc'] * 100:.2f}"
        assert mem == f"{r['peak_memory_gb']:.2f}"
        assert ips == f"{r['images_per_s']:.1f}"
        assert settings.startswith(plot_results.init_of(r, lessons()))  # what its model started from
        if r["world_size"] == 1:  # one meaning, as benchmark.py's: over 01 of the same settings
            assert speedup == f"{r['images_per_s'] / ips01:.2f}x"
        else:  # 2 processes, where 01 ran on 1: no ratio, and the table says why
            assert speedup == "-" and f"{r['world_size']} processes" in settings
    several = ", ".join(s[:2] for s, r in records.items() if r["world_size"] > 1)  # lessons.csv's devices over 1
    assert several and f"no speedup for {several}: no 01 run of the same kind, batch, model and processes" in proc.stdout
    # the talk's figures beside ours, from the reference file
    assert rows["04_fabric-vit-mixed-precision.py"][1] == "6.36"
    assert rows["06_fabric-vit-mixed-fsdp.py"][3] == "96.22"
    assert rows["04_fabric-vit-mixed-precision.py"][8] == f"{18.70 / 6.36:.2f}x"


@pytest.mark.slow
def test_full_runs_are_preferred_and_the_latest_wins(smoke_records, tmp_path):
    path, records = smoke_records
    full = dict(records["01_pytorch-vit.py"], kind="full", smoke=False, train_time_s=1122.0)
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
    assert len(table_rows(smoke.stdout)) == len(SCRIPTS)


def test_talk_format_log(tmp_path):
    log = tmp_path / "logs.md"
    log.write_text("# 01_pytorch-vit.py (finetuning pretrained)\n\n```\nEpoch: 0003/0003 | Train acc.: 97.11% | Val acc.: "
                   "95.02%\nTime elapsed 18.70 min\nMemory used: 3.71 GB\nTest accuracy 95.37%\n"
                   "```\n\n# 04_fabric-vit-mixed-precision.py\n\nLike 03 but bf16.\n\n```\nTime elapsed 6.36 min\n"
                   "Memory used: 3.04 GB\nTest accuracy 95.24%\n")
    proc = plot_here("--results", str(tmp_path / "none.jsonl"), "--log", str(log), "--output",
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


@pytest.mark.slow
def test_bad_lines_are_named_and_skipped(smoke_records, tmp_path):
    path, records = smoke_records
    good = path.read_text().splitlines()
    lacking = {k: v for k, v in records["03_fabric-vit.py"].items() if k != "train_time_s"}
    unknown = dict(records["01_pytorch-vit.py"], script="99_mystery.py")
    path.write_text("\n".join([good[1], "{truncated", json.dumps(lacking), json.dumps(unknown),
                               good[4]]) + "\n")
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


def test_the_readmes_example_log(tmp_path):
    """`python plot_results.py --log examples/talk-log.md`, as the README writes it."""
    proc = plot_here("--log", "examples/talk-log.md", "--results", str(tmp_path / "none.jsonl"),
                "--output", str(tmp_path / "log.png"), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    assert list(rows) == ["01_pytorch-vit.py", "04_fabric-vit-mixed-precision.py"]
    assert rows["04_fabric-vit-mixed-precision.py"][7] == f"{18.70 / 6.36:.2f}x"


def fake_records(with_throughput=True):
    """{(script, configuration): record}, as plot_results.select keys them."""
    records = {}
    for i, script in enumerate(SCRIPTS):
        record = upgrade({"script": script, "train_time_s": 1000.0 + 111 * i,
                  "peak_memory_gb": 3.0 + 0.1 * i, "test_acc": 0.9 + 0.001 * i,
                  "images_per_s": (350.0 + 10 * i) if with_throughput else None,
                  "device_name": "NVIDIA H200", "world_size": 1, "batch_size": 16, "model": "vit_b_16",
                  "kind": "full"})  # through the schema
        records[(script, plot_results.configuration(record))] = record
    return records


def overlapping(texts, renderer):
    boxes = [t.get_window_extent(renderer) for t in texts if t.get_text()]
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]


def test_eight_scripts_without_overlaps():
    fig = plot_results.figure(fake_records(), lessons(), "full")
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    for ax in fig.axes:
        assert len(ax.get_xticklabels()) == len(SCRIPTS)
        assert not overlapping(ax.get_xticklabels(), renderer), ax.get_title()
        assert not overlapping(ax.texts, renderer), ax.get_title()  # the value labels


@pytest.mark.parametrize("count", [1, 3, len(SCRIPTS)])
def test_the_title_and_legend_fit_and_say_only_what_is_drawn(count):
    """A smoke chart of one script is 900 pixels wide: its title lines wrap to fit inside the
    figure, and a legend of single runs promises no spread across seeds."""
    records = {key: dict(r, smoke=True, kind="smoke") for key, r in
               list(fake_records().items())[4:4 + count] or list(fake_records().items())[:count]}
    fig = plot_results.figure(records, lessons(), "smoke")
    fig.canvas.draw()
    figure_box = fig.bbox
    title = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    assert figure_box.x0 <= title.x0 and title.x1 <= figure_box.x1, (title, figure_box)
    assert title.y1 <= figure_box.y1
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["ours (smoke: 3-layer ViT on 8x8 digits)"]  # one run each, no talk bars
    axes_top = max(ax.get_window_extent().y1 for ax in fig.axes)
    assert axes_top <= title.y0 + 1  # the panels start below the title


@pytest.mark.parametrize("kind", ["smoke", "synthetic", "smoke-synthetic"])
def test_only_full_runs_share_an_axis_with_the_talk(kind):
    """A smoke or synthetic bar (another model, data and machine) is never drawn beside the talk's
    GPU bars; each panel with a talk column says why it is not drawn; full runs have them."""
    full = plot_results.figure(fake_records(), lessons(), "full")
    hatched = [ax.get_title() for ax in full.axes if any(p.get_hatch() for p in ax.patches)]
    assert len(hatched) == 3  # time, accuracy, memory: the talk publishes no throughput
    records = {key: dict(r, kind=kind) for key, r in fake_records().items()}
    fig = plot_results.figure(records, lessons(), kind)
    assert not any(p.get_hatch() for ax in fig.axes for p in ax.patches)
    notes = [t.get_text() for ax in fig.axes for t in ax.texts if t.get_text().startswith("talk:")]
    assert notes.count(f"talk: not drawn beside {kind} runs (another model, data and machine)") == 3
    assert "Talk (hatched)" not in fig._suptitle.get_text()


def test_a_busy_run_is_marked_in_the_chart_and_the_table(tmp_path):
    """A run whose record says another program shared the CPU is marked in its label, the title
    and the table's settings."""
    records = fake_records()
    busy = next(r for r in records.values() if r["script"].startswith("04"))
    busy["busy"] = True
    assert "BUSY: shared CPU" in plot_results.short_label(busy, lessons())
    fig = plot_results.figure(records, lessons(), "full")
    assert "BUSY (another program shared the CPU; times not comparable): 04" in fig._suptitle.get_text()
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    proc = plot_here("--results", str(path), "--output", str(tmp_path / "c.png"), cwd=tmp_path)
    assert table_rows(proc.stdout)["04_fabric-vit-mixed-precision.py"][-1].endswith("BUSY: shared CPU")


def test_a_panel_without_data_says_so():
    fig = plot_results.figure(fake_records(with_throughput=False), lessons(),
                              "full")
    throughput = next(ax for ax in fig.axes if "throughput" in ax.get_title())
    assert [t.get_text() for t in throughput.texts] == [
        "no data: none of these full records has images_per_s"]
    assert list(throughput.get_yticks()) == []


def test_the_default_chart_goes_to_a_path_git_ignores(tmp_path):
    import subprocess
    records = tmp_path / "results" / "runs.jsonl"
    records.parent.mkdir()
    records.write_text("".join(json.dumps(r) + "\n" for r in fake_records().values()))
    from run_keeping.record import append_record, write_atomically
    umask = os.umask(0o002)  # a umask other than the usual 022: a fixed 0o644 would differ
    try:
        proc = plot_here(cwd=tmp_path)
        append_record(tmp_path / "record.jsonl", {"script": "01_pytorch-vit.py"})
        write_atomically(tmp_path / "model.pt", b"a model")
    finally:
        os.umask(umask)
    assert proc.returncode == 0, proc.stderr
    chart = tmp_path / "results" / "charts.png"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in
             (chart, tmp_path / "record.jsonl", tmp_path / "model.pt")}
    assert modes == dict.fromkeys(modes, 0o664), modes  # as any file the user writes
    ignored = subprocess.run(["git", "check-ignore", "-q", "results/charts.png"], cwd=ROOT)
    assert ignored.returncode == 0
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "results/charts.png"],
                             cwd=ROOT, capture_output=True)
    assert tracked.returncode != 0


def test_a_failed_chart_write_leaves_the_old_chart(tmp_path, monkeypatch, capsys):
    from matplotlib.figure import Figure
    out = tmp_path / "comparison.png"
    out.write_bytes(b"an earlier chart")

    def half_written(self, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Figure, "savefig", half_written)
    fig = plot_results.figure(fake_records(), lessons(), "full")
    with pytest.raises(SystemExit) as exit_info:
        plot_results.save(fig, out)
    assert exit_info.value.code == 1
    assert f"cannot write {out}: No space left on device" in capsys.readouterr().err
    assert out.read_bytes() == b"an earlier chart"
    assert [p.name for p in tmp_path.iterdir()] == ["comparison.png"]


def test_spread_across_seeds_in_the_table_and_the_chart(tmp_path):
    """Three seeds of 00 and 01, one of 03: means with min-max error bars, n and the range."""
    records = []
    for script, accuracies in (("00_pytorch-vit-random-init.py", [0.90, 0.93, 0.96]),
                               ("01_pytorch-vit.py", [0.95, 0.97, 0.96]),
                               ("03_fabric-vit.py", [0.96])):
        for seed, acc in enumerate(accuracies):
            records.append(upgrade({"script": script, "seed": seed, "kind": "smoke", "smoke": True,
                                    "train_time_s": 10.0 + seed, "peak_memory_gb": 1.0, "test_acc": acc,
                                    "images_per_s": 100.0 + 10 * seed, "device_name": "CPU", "world_size": 1}))
    records.append(dict(records[0], test_acc=0.5, seed=9, kind="smoke-synthetic"))  # another kind
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = plot_here("--results", str(path), "--smoke", "--output", str(tmp_path / "c.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    assert rows["00_pytorch-vit-random-init.py"][2] == "93.00"  # the mean
    assert rows["00_pytorch-vit-random-init.py"][9:11] == ["3", "90.00-96.00"]
    assert rows["03_fabric-vit.py"][9:11] == ["1", "-"]
    assert rows["01_pytorch-vit.py"][7] == "1.00x"  # speedup of the means
    kind, latest, _ = plot_results.select(records, "smoke")
    fig = plot_results.figure(latest, lessons(), kind)
    accuracy = next(ax for ax in fig.axes if "accuracy" in ax.get_title())
    errorbars = next(c for c in accuracy.containers if type(c).__name__ == "ErrorbarContainer")
    lines = errorbars.lines[2][0].get_segments()  # the bars from min to max
    assert [(round(s[0][1], 2), round(s[1][1], 2)) for s in lines] == \
        [(90.0, 96.0), (95.0, 97.0), (96.0, 96.0)]


def test_the_headline_says_how_many_processes_and_each_label_what_ran():
    records = fake_records()
    next(r for r in records.values() if r["script"].startswith("05"))["world_size"] = 2
    assert plot_results.hardware(records) == "NVIDIA H200, 1 or 2 processes per run"
    reference = lessons()
    smoke = upgrade({"script": "01_pytorch-vit.py", "kind": "smoke", "batch_size": 16, "world_size": 1,
                     "model": "smoke ViT"})
    label = plot_results.short_label(smoke, reference)
    assert "printed digits" in label and "ImageNet" not in label
    synthetic = dict(smoke, kind="smoke-synthetic")  # a synthetic run starts from random init
    label = plot_results.short_label(synthetic, reference)
    assert "random init" in label and "printed" not in label and "pretrained" not in label.lower()
    big = dict(smoke, script="05_fabric-vit-mixed-ddp.py", batch_size=128, world_size=2)
    assert plot_results.short_label(big, reference).endswith("batch 128\n2 processes")


def test_every_numbered_training_script_can_be_charted():
    """09 and 10 are not in the talk: both are charted (the talk's bars say "not in talk")."""
    known = lessons()
    training = sorted(p.name for p in ROOT.glob("[0-9][0-9]_*.py") if not p.name.startswith("08"))
    rowless = [s for s in training if s not in known]
    assert not rowless, f"{rowless}: add each one's row to lessons.csv (docs/adding-a-lesson.md)"
    assert known["09_fabric-vit-fast.py"]["time_min"] is None


def gpu_check_like_records():
    """Records as gpu_check.sh leaves them: synthetic, most at batch 16 on one process, 01 and
    04 also at batch 128, 09 at 128, 05 on 2 processes."""
    def run(script, batch, processes, images_per_s, **more):
        return upgrade({"script": script, "kind": "synthetic", "batch_size": batch,
                        "world_size": processes, "model": "vit_b_16",
                        "images_per_s": images_per_s, "train_time_s": 10.0, "peak_memory_gb": 3.0,
                        "test_acc": None, "device_name": "NVIDIA H200", "seed": 123, **more})
    return [run("01_pytorch-vit.py", 16, 1, 300.0), run("02_pytorch-vit-compile.py", 16, 1, 330.0),
            run("01_pytorch-vit.py", 128, 1, 800.0), run("04_fabric-vit-mixed-precision.py", 128, 1, 2000.0),
            run("09_fabric-vit-fast.py", 128, 1, 2400.0), run("05_fabric-vit-mixed-ddp.py", 16, 2, 1100.0)]


def test_ratios_only_between_runs_of_the_same_settings(tmp_path):
    """02 (batch 16) against 01 at batch 16, 09 and 04 (batch 128) against 01 at 128, none for 05
    (2 processes; no 01 on 2); each of 01's two batches its own bar."""
    path = tmp_path / "gpu-check.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in gpu_check_like_records()))
    proc = plot_here("--results", str(path), "--synthetic", "--output", str(tmp_path / "c.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    speedups = {name: columns[7] for name, columns in rows.items()}
    assert speedups == {"01_pytorch-vit.py": "1.00x", "01_pytorch-vit.py [random init, batch 128]": "1.00x",
                        "02_pytorch-vit-compile.py": "1.10x", "04_fabric-vit-mixed-precision.py": "2.50x",
                        "05_fabric-vit-mixed-ddp.py": "-", "09_fabric-vit-fast.py": "3.00x"}, speedups
    assert "no speedup for 05: no 01 run of the same kind, batch, model and processes" in proc.stdout
    kind, latest, _ = plot_results.select(gpu_check_like_records(), "synthetic")
    labels = [plot_results.short_label(r, lessons()) for r in latest.values()]
    assert all("random init" in label for label in labels)
    assert sum("batch 128" in label for label in labels) == 3 and sum("2 processes" in label for label in labels) == 1


def test_a_run_cut_short_is_left_out_and_said_so_unless_all(tmp_path):
    """A --smoke run cut short by --max-steps is a debugging run: plot_results.py leaves it out, says
    which and why, and charts it with --all."""
    def run(script, **more):
        return upgrade({"script": script, "kind": "smoke", "batch_size": 16, "world_size": 1, "model": "smoke ViT",
                        "images_per_s": 500.0, "train_time_s": 10.0, "peak_memory_gb": 1.0, "test_acc": 0.9,
                        "device_name": "CPU AMD EPYC (2 cores)", "seed": 123, **more})
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [run("01_pytorch-vit.py"), run("03_fabric-vit.py", max_steps=3)]))
    proc = plot_here("--results", str(path), "--smoke", "--output", str(tmp_path / "c.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "03_fabric-vit.py" not in table_rows(proc.stdout)
    assert "left out, cut short by --max-steps 3" in proc.stdout and "03_fabric-vit.py seed 123" in proc.stdout
    everything = plot_here("--results", str(path), "--smoke", "--all", "--output", str(tmp_path / "a.png"), cwd=tmp_path)
    assert "03_fabric-vit.py" in table_rows(everything.stdout) and "left out" not in everything.stdout
