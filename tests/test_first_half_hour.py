"""What a newcomer meets in the first half hour, run as they would run it: an oversized batch,
flags a run would ignore, where a run writes, 08 --predict on ordinary pictures of digits."""
import re
import runpy
import sys

import pytest

from conftest import ROOT, parse_as, run_script


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


@pytest.mark.parametrize("flags", [("--num-workers", "0"), ("--num-workers", "1"), ("--no-download",)])
def test_a_smoke_run_refuses_each_cifar10_flag_whatever_its_value(flags, capsys):
    """0 workers is given all the same (argparse's 0 is no default's None)."""
    with pytest.raises(SystemExit) as stop:
        parse_as("04_fabric-vit-mixed-precision.py", "--smoke", *flags)
    assert stop.value.code == 2 and f"{flags[0]}: a smoke run reads no CIFAR-10" in capsys.readouterr().err


def test_fabric_run_is_refused_in_one_line(monkeypatch, capsys):
    """Under `fabric run` (LT_CLI_USED), Fabric refuses an argument that differs from its flags, the precision that
    runs among them: a lesson, whose flags set them, says so before any work, and names what runs it."""
    monkeypatch.setenv("LT_CLI_USED", "1")
    with pytest.raises(SystemExit) as stop:
        parse_as("04_fabric-vit-mixed-precision.py", "--smoke")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "`fabric run` sets Fabric's arguments" in err
    assert "run it with python or torchrun" in err


def test_fabric_arguments_exported_in_the_shell_are_refused_in_one_line(monkeypatch, capsys):
    """Fabric takes LT_ACCELERATOR, LT_PRECISION ... over its arguments, silently outside `fabric run`: one exported
    in the shell is refused before any work. The LT_PRECISION a run hands the processes Lightning starts, the one
    each decides itself, is not."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the fallback's 32-true, on any CPU
    for exported in ("LT_ACCELERATOR=cuda", "LT_PRECISION=bf16-mixed", "LT_DEVICES=4"):
        monkeypatch.setenv(*exported.split("="))
        with pytest.raises(SystemExit) as stop:
            parse_as("04_fabric-vit-mixed-precision.py", "--smoke")
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"{exported} in the environment would set Fabric's arguments over this lesson's flags" in err
        monkeypatch.delenv(exported.split("=")[0])
    monkeypatch.setenv("LT_PRECISION", "32-true")
    assert parse_as("04_fabric-vit-mixed-precision.py", "--smoke").precision == "32-true"


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
    """Bold printed digits on a 200x200 canvas, in both polarities, a blank picture and one of
    noise: prepared as the smoke digits look, the digits are read the same either way, each
    answer with its probability; the blank one holds no digit; for the noise, and for any digit
    it is no surer of than of noise, it says it cannot tell, and the digits it does name are
    right at least as often as its best guesses are (the answers it holds back are the less
    reliable ones); the light ones are said to be inverted."""
    from PIL import Image
    import numpy as np
    run = smoke_runs("04_fabric-vit-mixed-precision.py")
    files = drawn_digits(tmp_path)
    blank, noise = tmp_path / "blank.png", tmp_path / "noise.png"
    Image.new("RGB", (120, 90), (255, 255, 255)).save(blank)
    Image.fromarray(np.random.RandomState(5).randint(0, 256, (80, 80, 3), dtype=np.uint8)).save(noise)
    proc = run_script("08_load-and-evaluate.py", "--smoke", "--model", run.record["model_file"],
                      "--predict", *map(str, files), str(blank), str(noise), cwd=run.dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "light on dark (a light background is inverted)" in proc.stdout
    answers = {}
    for line in proc.stdout.splitlines():
        path, _, answer = line.partition(": ")
        if path.startswith(str(tmp_path)):
            answers[path] = answer
    assert len(answers) == 22
    assert answers[str(blank)] == "no digit: the image is blank"
    assert answers[str(noise)].startswith("cannot tell: its best guess, ")
    said = {polarity: [] for polarity in ("dark-on-light", "light-on-dark")}
    guessed = []
    for path, (polarity, digit) in files.items():
        text = answers[str(path)]
        named = re.match(r"^(\d) \((\d+)%\)", text)
        guess = re.match(r"^cannot tell: its best guess, (\d), has (\d+)%, no more than random noise gets", text)
        assert named or guess, text
        assert ("inverted" in text) == (polarity == "dark-on-light"), text
        said[polarity].append(named[1] if named else None)
        found = named or guess
        assert found is not None
        guessed.append((digit, found.group(1)))
    assert said["dark-on-light"] == said["light-on-dark"]  # the same picture, either way
    light = said["light-on-dark"]
    named_right = [label == str(digit) for digit, label in enumerate(light) if label is not None]
    guesses_right = [label == str(digit) for digit, label in guessed[10:]]
    assert named_right and sum(named_right) / len(named_right) >= sum(guesses_right) / len(guesses_right), (said, guessed)
    monkeypatch.setattr(sys, "argv", ["08_load-and-evaluate.py", "--help"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        runpy.run_path(str(ROOT / "08_load-and-evaluate.py"), run_name="__main__")
    help_text = " ".join(capsys.readouterr().out.split())
    assert "light on dark, centred, filling the frame" in help_text
    assert "every finished training run saves its finetuned model" in help_text
