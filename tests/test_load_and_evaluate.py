"""08: the finished runs' model files, loaded and evaluated again, your own images predicted,
and bad files refused in one line."""
import argparse
import re

import numpy as np
import pytest
import torch

import local_utilities as lu
from run_keeping.reading import load_model_file
from conftest import images_bf16_may_flip, run_script


def run_08(run, *flags):
    return run_script("08_load-and-evaluate.py", "--smoke", *flags, cwd=run.dir)


@pytest.mark.slow
@pytest.mark.parametrize("script, roundings", [
    ("04_fabric-vit-mixed-precision.py", 0),  # one process, bf16-mixed: the same computation
    ("06_fabric-vit-mixed-fsdp.py", 4),       # FSDP2's bf16 parameters vs. autocast's casts
    ("10_fabric-vit-tensor-parallel.py", 4),  # each MLP output: two bf16 halves and their sum
    ("13_fabric-vit-activation-checkpointing.py", 0),  # bf16-true, one process; checkpointed blocks
])
def test_08_finds_the_training_runs_test_accuracy(smoke_runs, script, roundings):
    """08 evaluates the saved model whole, on one process. Where the run evaluated it sharded or
    split, the two round differently: each of those computations rounds at most 3 times where
    08's autocast rounds once, so their logits lie within 4D of each other (D: what one
    rounding does to this model's logits here), and only the digits closer than that between
    their two best classes may differ (conftest.images_bf16_may_flip)."""
    run = smoke_runs(script)
    proc = run_08(run, "--model", run.record["model_file"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"in {run.record['precision']} (saved by {script}" in proc.stdout
    accuracy = float(proc.stdout.split("Test accuracy ")[1].split("%")[0]) / 100
    may_flip = images_bf16_may_flip(run.dir / run.record["model_file"], roundings)[0] if roundings else 0
    # the printed figure has 2 decimals: 0.005 points, 0.018 of an image here
    assert abs(accuracy - run.record["test_acc"]) * lu.SMOKE_SPLIT[1] <= may_flip + 0.02, may_flip


@pytest.mark.slow
def test_08_predicts_image_files(smoke_runs, tmp_path):
    """PNG and JPEG files of any size: each gets a class name and its probability (or its best
    guess, where it is no surer than of noise), mostly the right one."""
    from PIL import Image
    run = smoke_runs("04_fabric-vit-mixed-precision.py")
    images, labels = lu.digits_datasets()[2].tensors
    files = []
    for i in range(6):
        picture = Image.fromarray((images[i].permute(1, 2, 0).numpy() * 255).astype(np.uint8))
        path = tmp_path / (f"digit{i}.png" if i % 2 else f"digit{i}.jpg")
        picture.resize((48 + 16 * i, 40 + 8 * i)).save(path)
        files.append(path)
    proc = run_08(run, "--predict", *map(str, files))
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = dict(line.split(": ", 1) for line in proc.stdout.splitlines()
                   if line.startswith(str(tmp_path)))
    assert list(answers) == list(map(str, files))
    # each answer with its probability; a digit it is no surer of than of noise: its best guess
    best = {path: re.search(r"^(\d) \(\d+%\)$|best guess, (\d), has \d+%", text) for path, text in answers.items()}
    assert all(best.values()), answers
    digits = {path: {int(d) for d in found.groups() if d} for path, found in best.items() if found}
    right = sum(int(labels[i]) in digits[str(f)] for i, f in enumerate(files))
    assert right >= 5, answers


@pytest.mark.slow
def test_08_refuses_a_smoke_model_as_vit_b_16(smoke_runs):
    run = smoke_runs("01_pytorch-vit.py")
    proc = run_script("08_load-and-evaluate.py", "--accelerator", "cpu", "--model",
                      run.record["model_file"], cwd=run.dir)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "holds the small --smoke ViT" in errors[0], proc.stderr
    # the reason in whole words, not torch's header line
    assert "conv_proj.weight 128x3x8x8 in the file against 768x3x16x16 here" in errors[0], errors[0]
    assert errors[0].endswith("Add or drop --smoke to match the run that made it.")


def small_vit():
    model = lu.build_vit(None, argparse.Namespace(smoke=True, synthetic=False))
    model.heads.head = torch.nn.Linear(model.hidden_dim, 10)
    return model


def test_a_model_file_cut_short_is_said_so_in_whole_words(tmp_path, capsys):
    """Half of a real model file (a copy cut off mid-write): the reason is whole, not torch's
    message cut at a character count."""
    buffer = tmp_path / "whole.pt"
    torch.save(small_vit().state_dict(), buffer)
    path = tmp_path / "model.pt"
    path.write_bytes(buffer.read_bytes()[:buffer.stat().st_size // 2])
    with pytest.raises(SystemExit) as exit_info:
        load_model_file(small_vit(), path)
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.endswith(f"{path} is not a readable model file: it is cut short or damaged (not a "
                         "whole file that torch.save wrote)."), line


@pytest.mark.parametrize("content, words", [
    (None, "no model file"),
    (b"PK\x03\x04 truncated", "is not a readable model file"),
    (b"# A README, given as --model by mistake\n", "not a file that torch.save wrote"),
    ({"weights": [1, 2, 3]}, "not a model file of this suite"),
    ({"fc.weight": torch.zeros(10, 512), "fc.bias": torch.zeros(10)}, "holds another model"),
])
def test_bad_model_files(tmp_path, capsys, content, words):
    path = tmp_path / "model.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(SystemExit) as exit_info:
        load_model_file(small_vit(), path)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and words in err, err
    assert "weights_only" not in err  # never advice to load a file of unknown origin unsafely


def test_a_good_model_file_loads(tmp_path):
    model = small_vit()
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    fresh = small_vit()
    load_model_file(fresh, path)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                   model.state_dict().values()))


@pytest.mark.slow
def test_08_checks_the_images_first_and_names_the_smoke_models(smoke_runs, tmp_path):
    from PIL import Image
    missing = run_script("08_load-and-evaluate.py", "--predict", "seven.png", cwd=tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "cannot read the image seven.png" in missing.stderr  # before looking for a model
    seven = tmp_path / "seven.png"
    Image.new("RGB", (20, 20)).save(seven)
    run = smoke_runs("04_fabric-vit-mixed-precision.py")
    only_smoke = run_script("08_load-and-evaluate.py", "--predict", str(seven), cwd=run.dir)
    assert only_smoke.returncode == 2
    assert ("Only --smoke models are there (models/04_fabric-vit-mixed-precision-smoke.pt): add "
            "--smoke") in only_smoke.stderr


def test_the_newest_model_is_a_whole_runs(tmp_path, monkeypatch, capsys):
    """08 without --model: the newest file in models/ of the asked kind from a whole run; a run
    cut short by --max-steps (by its record, or where it has none by its name) is passed over,
    and said so when nothing else is there."""
    import json
    import os
    import runpy
    import time
    from types import SimpleNamespace
    from conftest import ROOT
    newest_model = runpy.run_path(str(ROOT / "08_load-and-evaluate.py"), run_name="08")["newest_model"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    records = []
    for name, whole in (("01_pytorch-vit-smoke.pt", True), ("01_pytorch-vit-smoke-seed2.pt", False),
                        ("01_pytorch-vit-smoke-max-steps3.pt", None)):
        (tmp_path / "models" / name).write_bytes(name.encode())
        time.sleep(0.01)  # each newer than the one before
        if whole is not None:
            records.append({"model_file": f"models/{name}", "kind": "smoke", "max_steps": None if whole else 3})
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = SimpleNamespace(smoke=True, results=str(tmp_path / "runs.jsonl"))
    assert newest_model(args) == "models/01_pytorch-vit-smoke.pt"
    os.remove("models/01_pytorch-vit-smoke.pt")
    with pytest.raises(SystemExit) as exit_info:
        newest_model(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Passed over, as cut short by --max-steps: models/01_pytorch-vit-smoke-max-steps3.pt, " \
           "models/01_pytorch-vit-smoke-seed2.pt" in err
