"""What a newcomer meets in the first half hour, run as they would run it: an oversized batch,
flags a run would ignore, where a run writes, 08 --predict on ordinary pictures of digits."""
import runpy
import sys

import pytest

from conftest import ROOT, run_script


@pytest.mark.slow
@pytest.mark.parametrize("script, batch, largest", [
    ("01_pytorch-vit.py", "2000", "1197"),   # one process: the 1,197 training digits
    ("05_fabric-vit-mixed-ddp.py", "700", "598"),  # two data-parallel processes share them
])
def test_a_batch_larger_than_the_training_set_is_refused(tmp_path, script, batch, largest):
    """drop_last leaves such a run no batch to train on: one line naming the largest batch that
    works, exit 2, before any process starts or any file is written."""
    proc = run_script(script, "--smoke", "--batch-size", batch, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "compute" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"the largest that works is {largest}" in errors[0], proc.stderr
    assert not any((tmp_path / name).exists() for name in ("results", "models", "checkpoints"))


@pytest.mark.slow
def test_flags_a_smoke_run_would_ignore_are_refused(tmp_path):
    proc = run_script("04_fabric-vit-mixed-precision.py", "--smoke", "--num-workers", "50",
                      "--data-dir", "elsewhere", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "--num-workers and --data-dir: a smoke run reads no CIFAR-10" in line, line


@pytest.mark.slow
def test_a_run_writes_under_the_folder_it_runs_from_and_leaves_no_empty_folder(smoke_runs):
    """The fixture runs each script from a scratch folder: the record, the model and nothing
    else land there; the checkpoints, removed at the end, take their folder with them."""
    for script in ("01_pytorch-vit.py", "04_fabric-vit-mixed-precision.py", "06_fabric-vit-mixed-fsdp.py"):
        run = smoke_runs(script)
        assert (run.dir / "results" / "runs.jsonl").exists()
        assert (run.dir / run.record["model_file"]).exists()
        assert not (run.dir / "checkpoints").exists(), script


def drawn_digits(folder):
    """The digits 0-9 as a newcomer draws them: bold, centred on a 200x200 canvas, once dark on
    light and once light on dark."""
    from PIL import Image, ImageDraw, ImageFont
    font = ImageFont.load_default(size=150)
    files = {}
    for polarity, (ground, ink) in {"dark-on-light": (255, 0), "light-on-dark": (0, 255)}.items():
        for digit in range(10):
            picture = Image.new("RGB", (200, 200), (ground,) * 3)
            ImageDraw.Draw(picture).text((100, 100), str(digit), fill=(ink,) * 3, font=font,
                                         anchor="mm", stroke_width=6, stroke_fill=(ink,) * 3)
            path = folder / f"{polarity}-{digit}.png"
            picture.save(path)
            files[path] = (polarity, digit)
    return files


@pytest.mark.slow
def test_08_reads_ordinary_pictures_of_digits(smoke_runs, tmp_path, monkeypatch, capsys):
    """Bold printed digits on a 200x200 canvas, in both polarities: prepared as the smoke digits
    look, they are read the same either way and mostly right (they came back one digit for
    every picture before); the light ones are said to be inverted."""
    run = smoke_runs("04_fabric-vit-mixed-precision.py")
    files = drawn_digits(tmp_path)
    proc = run_script("08_load-and-evaluate.py", "--smoke", "--model", run.record["model_file"],
                      "--predict", *map(str, files), cwd=run.dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "light on dark (a light background is inverted)" in proc.stdout
    answers = {}
    for line in proc.stdout.splitlines():
        path, _, answer = line.partition(": ")
        if path.startswith(str(tmp_path)):
            answers[path] = answer
    assert len(answers) == 20
    said = {polarity: [] for polarity in ("dark-on-light", "light-on-dark")}
    for path, (polarity, digit) in files.items():
        label, inverted = answers[str(path)].split()[0], "inverted" in answers[str(path)]
        assert inverted == (polarity == "dark-on-light"), answers[str(path)]
        said[polarity].append(label)
    assert said["dark-on-light"] == said["light-on-dark"]  # the same picture, either way
    right = sum(label == str(digit) for digit, label in enumerate(said["light-on-dark"]))
    assert right >= 6 and len(set(said["light-on-dark"])) >= 6, said
    monkeypatch.setattr(sys, "argv", ["08_load-and-evaluate.py", "--help"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        runpy.run_path(str(ROOT / "08_load-and-evaluate.py"), run_name="__main__")
    help_text = " ".join(capsys.readouterr().out.split())
    assert "light on dark, centred, filling the frame" in help_text
    assert "every finished training run (00-07, 09, 10)" in help_text
