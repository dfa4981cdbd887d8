"""09, the fast recipe: the same images as the talk's transform, data shared out on the device,
and its --smoke run."""
import argparse
import os
import re
import runpy
import sys
import types

import pytest
import torch

import local_utilities as lu
from conftest import native_bf16, ROOT, finish, images_bf16_may_flip, read_records, run_script, script_env, \
    start_script, write_fake_cifar10
from conftest import uint8_effect

FAST = "09_fabric-vit-fast.py"
# PIL's bilinear resize rounds to uint8 (ToTensor divides by 255 afterwards); torch's works in
# floats: the two differ by less than one intensity level. Measured on random images: 0.0034.
ONE_LEVEL = 1 / 255


@pytest.fixture
def fast():
    return runpy.run_path(str(ROOT / FAST), run_name="fast_recipe")


@pytest.fixture
def random_cifar(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as cifar
    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))
    write_fake_cifar10(tmp_path / "data", per_batch=10, num_test=10, random_pixels=True)
    return tmp_path / "data"


def test_the_device_side_resize_gives_the_talks_images(fast, random_cifar):
    args = argparse.Namespace(smoke=False, synthetic=False, data_dir=str(random_cifar),
                              no_download=True, max_steps=None, batch_size=16, world_size=1)
    splits = fast["uint8_splits"](args)
    train, val, test = lu.cifar10_datasets(str(random_cifar), download=False)  # the talk's
    for name, talk in (("train", train), ("val", val), ("test", test)):
        images, labels = splits[name]
        assert len(images) == len(talk) and images.dtype == torch.uint8
        ours = fast["resize_on_device"](images, 224)
        theirs = torch.stack([talk[i][0] for i in range(len(talk))])
        assert ours.shape == theirs.shape == (len(talk), 3, 224, 224)
        assert (ours - theirs).abs().max() < ONE_LEVEL, name
        assert labels.tolist() == [talk[i][1] for i in range(len(talk))]


def test_device_data_shares_each_epoch_out_among_the_processes(fast):
    split = (torch.arange(40, dtype=torch.uint8).view(40, 1, 1, 1).expand(40, 3, 32, 32).clone(),
             torch.arange(40))

    def batches(rank, epoch):
        fabric = types.SimpleNamespace(device=torch.device("cpu"), world_size=2, global_rank=rank)
        data = fast["DeviceData"](split, fabric, batch_size=4, size=32, train=True, seed=123)
        assert len(data) == 5
        return [labels.tolist() for _, labels in data.epoch(epoch)]
    ranks = [sum(batches(rank, 0), []) for rank in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == list(range(40))  # each image once, in one process
    assert batches(0, 0) == batches(0, 0) and batches(0, 1) != batches(0, 0)  # seeded by epoch


def test_warm_up_then_cosine(fast):
    schedule = fast["warmup_then_cosine"](100)
    assert schedule(0) == pytest.approx(0.2) and schedule(4) == pytest.approx(1.0)
    assert schedule(52) == pytest.approx(0.5, abs=0.02) and schedule(99) < 0.01


@pytest.mark.slow
def test_the_gpu_path_runs_on_a_cpu(smoke_runs, tmp_path):
    """09 --smoke --compile-on-cpu takes the branch a GPU takes (torch.compile before Fabric's
    setup, the fused AdamW): it learns with its schedule, and its model file loads into plain
    torchvision and into 08. 09's own CPU path, killed after its first checkpoint, resumes to its
    uninterrupted smoke run's numbers (Fabric's checkpoint of a compiled model, loaded back into
    one: test_resume.py)."""
    import signal

    from run_keeping.keeper import LATEST
    from conftest import kill_group, start_script, wait_for
    flags = ["--smoke", "--compile-on-cpu"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    whole.mkdir(), broken.mkdir()
    proc = run_script(FAST, *flags, cwd=whole, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = read_records(whole / "results" / "runs.jsonl")[-1]
    assert record["compile_mode"] == "default" and record["test_acc"] >= 0.85
    assert record["precision"] == ("bf16-mixed" if native_bf16() else "32-true")  # lessons.csv asks bf16-mixed
    lr = record["lr"]  # each epoch's first step: at most one epoch of warm-up, then decaying
    peak = lr.index(max(lr))
    assert peak <= 1 and all(a > b for a, b in zip(lr[peak:], lr[peak + 1:])), lr

    started = start_script(FAST, "--smoke", cwd=broken)
    reached = wait_for(broken / "checkpoints" / "09_fabric-vit-fast-smoke" / LATEST, started, 240)
    kill_group(started, signal.SIGKILL)
    assert reached
    resumed = run_script(FAST, "--smoke", "--resume", cwd=broken, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again, uninterrupted = read_records(broken / "results" / "runs.jsonl")[-1], smoke_runs(FAST).record
    assert "Resuming from" in resumed.stdout and again["compile_mode"] is None
    for a, b in zip(again["train_loss"], uninterrupted["train_loss"], strict=True):
        assert abs(a - b) <= 1e-6 * abs(b)
    assert (again["lr"], again["val_acc"], again["test_acc"]) == \
        (uninterrupted["lr"], uninterrupted["val_acc"], uninterrupted["test_acc"])

    model = lu.smoke_vit()
    model.heads.head = torch.nn.Linear(model.hidden_dim, 10)
    model.load_state_dict(torch.load(whole / record["model_file"], weights_only=True))
    evaluated = run_script("08_load-and-evaluate.py", "--smoke", "--model", record["model_file"],
                           cwd=whole)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    # 08 runs the model eagerly: the compiled kernels round at most once where eager autocast
    # does (2 roundings apart), and 09 held the digits as uint8 where 08 reads floats (what that
    # moves the logits is measured: conftest.uint8_effect), so only digits closer than 2D plus
    # that between their two best logits may change (conftest.images_bf16_may_flip); 08 says so
    assert "compiled then and runs eagerly now" in evaluated.stdout
    accuracy = re.search(r"^Test accuracy (\d+\.\d\d)%$", evaluated.stdout, re.M)
    model_file = whole / record["model_file"]
    may_flip = images_bf16_may_flip(model_file, roundings=2, extra=uint8_effect(model_file))[0]
    assert accuracy and abs(float(accuracy[1]) - record["test_acc"] * 100) * 3.6 <= may_flip + 0.02


def test_the_recipes_settings(fast, monkeypatch):
    """What 09 changes against 04 in its set-up: batch 128, no loader workers, AdamW at the peak
    learning rate scaled by the square root of the batch, fused on the GPU's path."""
    monkeypatch.setattr(sys, "argv", [FAST, "--accelerator", "cpu"])
    args = fast["parse_flags"]()
    assert (args.batch_size, args.epochs, args.devices) == (128, 3, 1)
    model = lu.smoke_vit()
    optimizer = fast["make_optimizer"](model, args, fused=True)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    assert optimizer.defaults["lr"] == pytest.approx(5e-5 * (128 / 16) ** 0.5, rel=1e-12)
    assert fast["make_optimizer"](model, args, fused=False).defaults["fused"] in (False, None)
    monkeypatch.setattr(sys, "argv", [FAST, "--smoke"])
    smoke = fast["parse_flags"]()
    assert (smoke.batch_size, smoke.epochs) == (16, 2)
    assert fast["make_optimizer"](model, smoke, fused=False).defaults["lr"] == pytest.approx(6e-4)
    monkeypatch.setattr(sys, "argv", [FAST, "--smoke", "--num-workers", "2"])
    with pytest.raises(SystemExit):  # 09 has no loader, so no --num-workers to ignore
        fast["parse_flags"]()


def test_the_loop_reads_nothing_back_per_step(fast, tmp_path, monkeypatch):
    """09's loop reads a value off the device only at its print points and once per epoch
    (validation, checkpoint): every tensor-to-Python conversion is counted over 2 epochs."""
    import lightning as L
    from torch.overrides import TorchFunctionMode

    from run_keeping.keeper import RunKeeper
    reads = {"n": 0}
    readers = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__,
               torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__format__}

    ours = (FAST, "run_keeping", "local_utilities.py")

    class CountReads(TorchFunctionMode):  # reads made by the loop and the keeper, not inside torch
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in readers:
                frame = sys._getframe(1)  # the first caller outside torch made the read
                while frame and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                    frame = frame.f_back
                reads["n"] += bool(frame) and any(part in frame.f_code.co_filename for part in ours)
            return func(*args, **(kwargs or {}))
    monkeypatch.setattr(sys, "argv", [FAST, "--smoke", "--checkpoint-dir", str(tmp_path / "ck"),
                                      "--epochs", "2", "--max-steps", "12"])
    args = fast["parse_flags"]()
    with RunKeeper(args) as keeper:
        fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")  # 32-true where the CPU has no bf16
        keeper.start(fabric)
        splits = fast["uint8_splits"](args)
        splits["train"] = tuple(t[:12 * 16] for t in splits["train"])
        train = fast["DeviceData"](splits["train"], fabric, 16, 32, True, 123)
        val = fast["DeviceData"](splits["val"], fabric, 120, 32, False, 123)
        model = fabric.setup_module(lu.smoke_vit())
        optimizer = fast["make_optimizer"](model, args, fused=False)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fast["warmup_then_cosine"](2 * len(train)))
        optimizer = fabric.setup_optimizers(optimizer)
        keeper.keep_in_checkpoints(scheduler)
        keeper.before_training(model, optimizer, train)
        with CountReads():
            fast["train"](2, model, optimizer, scheduler, train, val, fabric, keeper)
    assert len(train) == 12  # 24 steps: a read a step would be more than the handful below
    # per epoch: 1 print point (every 100 steps: step 0) with the loss guard's read at step 1,
    # the validation accuracy, the epoch's mean loss and its print: a handful, not one a step
    assert 0 < reads["n"] <= 2 * 8, reads["n"]  # the print points' reads are seen


@pytest.mark.slow
def test_the_fast_recipe_beats_04_on_the_demo(smoke_runs, tmp_path):
    """Over seeds 123 and 1, 09 --smoke's mean test accuracy is at least 04 --smoke's (the third
    seed of docs/fast-recipe.md's table is in its records, reference/smoke-runs.jsonl)."""
    talk = "04_fabric-vit-mixed-precision.py"
    accuracy = {talk: [smoke_runs(talk).record["test_acc"]], FAST: [smoke_runs(FAST).record["test_acc"]]}
    # the two runs side by side, one thread each: the relation, not the last digit, is tested
    env = script_env(tmp_path, OMP_NUM_THREADS="1")
    runs = {}
    for seed in ("1",):
        for script in accuracy:
            cwd = tmp_path / f"{script[:2]}-{seed}"
            cwd.mkdir()
            runs[script, seed] = (cwd, start_script(script, "--smoke", "--seed", seed, cwd=cwd, env=env))
        for script in accuracy:
            cwd, proc = runs[script, seed]
            output = finish([proc])[0]
            assert proc.returncode == 0, output[-3000:]
            accuracy[script].append(read_records(cwd / "results" / "runs.jsonl")[-1]["test_acc"])
    mean = {script: sum(values) / len(values) for script, values in accuracy.items()}
    assert mean[FAST] >= mean[talk], accuracy
