"""Never lose a run: kill and resume, Ctrl-C, the NaN guard, unloadable checkpoints."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import local_utilities as lu
from run_keeping.keeper import LATEST, RunKeeper
from conftest import ROOT, TWO_NODES, parse_as, check_ok, finish, images_bf16_may_flip, kill_group, read_records, \
    run_script, script_env, smoke_logits, start, wait_for

EARLIER = '{"script": "00_pytorch-vit-random-init.py", "test_acc": 0.6285}\n'


def started_until_its_first_checkpoint(script, tmp_path):
    """`script --smoke` started as its smoke run is (with an earlier record in its records file),
    once its first epoch's checkpoint is there: (records file, checkpoint folder, processes,
    whether the checkpoint came)."""
    results = tmp_path / "results" / "runs.jsonl"
    results.parent.mkdir()
    results.write_text(EARLIER)
    ckpt_dir = tmp_path / "checkpoints" / (script[:-3] + "-smoke")
    procs = start(script, "--smoke", cwd=tmp_path)
    return results, ckpt_dir, procs, wait_for(ckpt_dir / LATEST, procs[0])


@pytest.mark.slow
def test_a_lost_machine_stops_the_other_with_one_line(tmp_path):
    """06 on two torchrun nodes, node 1's agent and worker SIGKILLed after the first epoch's
    checkpoint, as when its machine dies: node 0 stops within seconds, saying so in one line of
    its own, with a documented code, and the records file is as it was. (06's two processes
    continuing to the uninterrupted run's numbers: test_slurm.py's requeue.)"""
    script = TWO_NODES
    results, ckpt_dir, procs, reached = started_until_its_first_checkpoint(script, tmp_path)
    began = time.monotonic()
    kill_group(procs[1], signal.SIGKILL)
    try:
        survivor = procs[0].communicate(timeout=30)[0]
    finally:
        kill_group(procs[0])
    assert reached, survivor[-3000:]
    assert time.monotonic() - began < 15, survivor[-3000:]
    ours = [line for line in survivor.splitlines() if f"{script}: error:" in line]
    assert len(ours) == 1, survivor[-3000:]
    assert "a process of the run stopped (the one at 127.0.0.1:" in ours[0] and "epoch-0001.ckpt" in ours[0]
    assert "it was lost (a machine died, a process was killed) or it failed (its own output says which" in ours[0]
    assert "the same torchrun/srun launch with --resume added" in ours[0]
    assert "exitcode  : 3" in survivor  # torchrun's summary names the worker's exit code
    assert "Read error" not in survivor and "gloo" not in survivor.replace(
        "distributed_backend=gloo", "")  # no traceback from the worker
    assert results.read_text() == EARLIER  # killed mid-training: the records file as it was
    assert json.loads((ckpt_dir / LATEST).read_text())["epochs_done"] >= 1


@pytest.mark.slow
def test_killed_then_resumed_equals_uninterrupted(smoke_runs, tmp_path):
    """10 (its 2-D shards, on Fabric's 2 processes) SIGKILLed after the first epoch's checkpoint,
    then --resume: the same losses, learning rates and accuracies as the uninterrupted run, within
    its rounding. (One process, DDP, a schedule and micro-batches resume in the tests of a stop
    mid-epoch below; FSDP in test_slurm.py's requeue; 09's compiled run in test_fast_recipe.py.)"""
    script = "10_fabric-vit-tensor-parallel.py"
    results, ckpt_dir, procs, reached = started_until_its_first_checkpoint(script, tmp_path)
    outputs = [kill_group(p, signal.SIGKILL) for p in procs]
    assert reached, outputs[0][-3000:]
    # killed mid-training: the records file is as it was, and valid JSONL
    assert results.read_text() == EARLIER
    assert json.loads((ckpt_dir / LATEST).read_text())["epochs_done"] >= 1

    procs = start(script, "--smoke", "--resume", cwd=tmp_path)
    outputs = finish(procs)
    check_ok(procs, outputs, f"{script} --smoke --resume")
    assert "Resuming" in outputs[0]
    records = read_records(results)
    assert len(records) == 2 and records[0] == json.loads(EARLIER)
    record, baseline = records[1], smoke_runs(script).record
    assert len(record["train_loss"]) == len(baseline["train_loss"]) == 2
    # 10 resumes within rounding, not bit for bit: its split MLP sums bfloat16 halves, and the
    # resumed run re-rounds. Derived bounds: the two finished models' float32 logits differ by
    # less than one bfloat16 rounding of them (D, measured on this machine's kernels); the
    # epoch losses by less than bf16's relative rounding step (2**-8); and only digits whose
    # two best logits are closer than two split evaluations (3 roundings each, 3D) plus the
    # models' difference (at most D) can change: 7D.
    ours, theirs = tmp_path / record["model_file"], smoke_runs(script).dir / baseline["model_file"]
    may_flip, bound = images_bf16_may_flip(theirs, roundings=7)
    apart = float((smoke_logits(ours, False) - smoke_logits(theirs, False)).abs().max())
    assert apart <= bound, (apart, bound)
    assert record["train_loss"] == pytest.approx(baseline["train_loss"], rel=2**-8)
    assert all(abs(a - b) * 240 <= may_flip + 1e-9 for a, b in zip(record["val_acc"], baseline["val_acc"]))
    assert abs(record["test_acc"] - baseline["test_acc"]) * 360 <= may_flip + 1e-9, may_flip
    assert record["train_time_s"] > 0
    assert not ckpt_dir.exists()  # finished: nothing left to resume


@pytest.mark.slow
def test_each_kind_of_run_keeps_its_own_files(tmp_path):
    """An unfinished --smoke --synthetic run neither blocks --smoke nor is continued as one: each
    kind has its own checkpoint folder, model file and recorded kind."""
    script = "03_fabric-vit.py"  # the README's first command is 04: the same RunKeeper, slower here
    mixed = ["--smoke", "--synthetic", "--max-steps", "6", "--epochs", "2"]
    ckpt_dir = tmp_path / "checkpoints" / "03_fabric-vit-smoke-synthetic-epochs2-max-steps6"
    stopped = run_script(script, *mixed, cwd=tmp_path, env=signalled_at_step(tmp_path, 8, "SIGTERM"))
    assert stopped.returncode == 143 and (ckpt_dir / LATEST).exists(), stopped.stderr[-3000:]
    smoke = run_script(script, "--smoke", cwd=tmp_path)  # the README's first command
    assert smoke.returncode == 0, smoke.stderr[-3000:]
    smoke_model = tmp_path / "models" / "03_fabric-vit-smoke.pt"
    model_bytes = smoke_model.read_bytes()
    wrong = run_script(script, "--smoke", "--resume", cwd=tmp_path)  # nothing of its kind
    assert wrong.returncode == 2
    assert (f"{ckpt_dir.relative_to(tmp_path)} holds one, made with kind smoke-synthetic (now smoke), max_steps 6 (now "
            f"unset): continue it with python {ROOT / script} {' '.join(mixed)} --resume.") in wrong.stderr, wrong.stderr
    right = run_script(script, *mixed, "--resume", cwd=tmp_path)
    assert right.returncode == 0, right.stderr[-3000:]
    records = read_records(tmp_path / "results" / "runs.jsonl")
    assert [r["kind"] for r in records] == ["smoke", "smoke-synthetic"]
    assert "Resuming from" in right.stdout
    assert records[1]["model_file"] == "models/03_fabric-vit-smoke-synthetic-epochs2-max-steps6.pt"
    assert smoke_model.read_bytes() == model_bytes


@pytest.mark.slow
def test_synthetic_with_nothing_to_time_is_refused(tmp_path):
    """--synthetic --max-steps 3: every step would be an untimed warm-up step."""
    proc = run_script("04_fabric-vit-mixed-precision.py", "--smoke", "--synthetic", "--max-steps",
                      "3", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "give --max-steps 4 or more" in proc.stderr.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


SIGNAL_AT_STEP = """
import os, signal
from torch.optim.optimizer import register_optimizer_step_post_hook
_steps = [0]
def _signal(optimizer, args, kwargs):
    _steps[0] += 1
    if _steps[0] == int(os.environ["HOOK_SIGNAL_AT_STEP"]):
        os.kill(os.getpid(), getattr(signal, os.environ["HOOK_SIGNAL_NAME"]))
register_optimizer_step_post_hook(_signal)
"""


def signalled_at_step(tmp_path, step, name):
    """An environment whose scripts send themselves signal `name` after their `step`-th
    optimizer step, in every process (as a terminal's Ctrl-C and SLURM's SIGTERM reach them)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SIGNAL_AT_STEP)
    return script_env(tmp_path, PYTHONPATH=str(site), HOOK_SIGNAL_AT_STEP=str(step), HOOK_SIGNAL_NAME=name)


@pytest.mark.slow
@pytest.mark.parametrize("script, name, code", [
    ("05_fabric-vit-mixed-ddp.py", "SIGTERM", 143),  # Fabric's 2 processes, a distributed sampler
    ("14_fabric-vit-sgd-cosine.py", "SIGTERM", 143),  # micro-batches and a cosine schedule stepped with them
])  # one process, after Ctrl-C: test_together.py's printed commands
def test_a_signal_mid_epoch_keeps_the_last_epochs_checkpoint(smoke_runs, tmp_path, script, name, code):
    """SIGTERM after the 100th optimizer step (in the middle of the second epoch): the run ends in
    one line naming the last epoch's checkpoint, how many batches since are lost and the exact
    command that continues the run, with the documented exit code, no traceback, the records
    untouched. That command, run as printed, redoes the second epoch: the finished run equals an
    uninterrupted one, its schedule too (docs/resume-save-load.md: why a whole epoch)."""
    baseline = smoke_runs(script).record
    micro = baseline["micro_batches"]
    results = tmp_path / "results" / "runs.jsonl"
    results.parent.mkdir()
    results.write_text(EARLIER)
    ckpt_dir = tmp_path / "checkpoints" / (script[:-3] + "-smoke")
    proc = run_script(script, "--smoke", cwd=tmp_path, env=signalled_at_step(tmp_path, 100, name))
    assert proc.returncode == code, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and ": error:" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "interrupted" in line]
    assert len(lines) == 1, out[-3000:]
    latest = json.loads((ckpt_dir / LATEST).read_text())
    assert latest["epochs_done"] == 1 and latest["checkpoint"] == "epoch-0001.ckpt", latest
    per_epoch = int(out.split("Batch 0000/")[1][:4])  # batches (14: micro-batches) an epoch
    # the epoch's batches the keeper saw end: the signal comes inside the 100th optimizer step,
    # before that step's last batch reaches keeper.batch_done (14 steps on each 4th micro-batch)
    lost = (100 - per_epoch // micro) * micro - 1
    assert (f"interrupted ({name}); the last checkpoint, {ckpt_dir.relative_to(tmp_path)}/epoch-0001.ckpt, "
            f"holds 1 of 2 epochs; the {lost} batches of epoch 2 trained since are not kept") in lines[0], lines[0]
    command = f"python {ROOT / script} --smoke --resume"
    assert lines[0].endswith(f"continue with: {command}"), lines[0]
    assert results.read_text() == EARLIER
    resumed = subprocess.run(["bash", "-c", command], cwd=tmp_path,
                             env=script_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "1 of 2 epochs done" in resumed.stdout and "Epoch: 0002/0002 | Batch 0000/" in resumed.stdout
    record = read_records(results)[-1]
    assert not ckpt_dir.exists()
    # the same maths in the same order: the epoch's data order comes from the random state and
    # the sampler's epoch the checkpoint keeps (05: two processes' mean loss, rounded a few ulps)
    assert record["train_loss"] == pytest.approx(baseline["train_loss"], rel=1e-6)
    for key in ("val_acc", "test_acc"):
        assert record[key] == baseline[key], key


SIGNAL_AT_THE_END = """
import os, signal, sys, time
def _signal():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # the handler runs here, at the next bytecode
if os.environ["HOOK_SIGNAL_WHEN"] == "record":  # as the record file is opened to append the run's record
    sys.addaudithook(lambda event, args: event == "open" and str(args[0]).endswith("runs.jsonl")
                     and isinstance(args[2], int) and args[2] & os.O_APPEND and _signal())
elif os.environ["HOOK_SIGNAL_WHEN"] == "setup":  # as the smoke ViT's weights load: after the flags, before training
    sys.addaudithook(lambda event, args: event == "open" and str(args[0]).endswith("smoke-vit-printed-digits.pt")
                     and _signal())
"""


@pytest.mark.slow
def test_ctrl_c_at_any_moment_is_one_line(tmp_path):
    """Ctrl-C from the run's start on (its flags parsed): while the run is set up, in training and in
    its last evaluation: one line each, exit 130, no traceback, and nothing written unless a
    checkpoint of where it was. While the finished run writes its record: the model and record
    written, the checkpoints gone, one line saying so, exit 130. (The runs that get as far as
    training train 10 steps an epoch: each moment comes as in a whole run, sooner.)"""
    site = tmp_path / "site-end"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SIGNAL_AT_THE_END)
    # While the libraries load, a Ctrl-C is Python's and the libraries' to handle; what is ours, that
    # importing run_keeping installs nothing, test_layout.py's test_importing_run_keeping_does_nothing
    # checks directly (a signal sent at an import here was seen lost in the whole suite on an AVX2 CPU).
    short = ["--max-steps", "10"]  # 2 epochs of 10 steps
    folder = tmp_path / "setup"
    folder.mkdir()
    proc = run_script("01_pytorch-vit.py", "--smoke", *short, cwd=folder,
                      env=script_env(folder, PYTHONPATH=str(site), HOOK_SIGNAL_WHEN="setup"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 130 and "Traceback" not in out, out[-2000:]
    lines = [line for line in out.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and "01_pytorch-vit.py: interrupted (SIGINT)" in lines[0], out[-2000:]
    assert not (folder / "results").exists() and not (folder / "models").exists()
    for moment, step in (("training", 5), ("evaluation", 20)):  # 20: the last step, then the test set
        folder = tmp_path / moment
        folder.mkdir()
        proc = run_script("01_pytorch-vit.py", "--smoke", *short, cwd=folder,
                          env=signalled_at_step(folder, step, "SIGINT"))
        out = proc.stdout + proc.stderr
        assert proc.returncode == 130 and "Traceback" not in out, (moment, out[-2000:])
        assert len([line for line in out.splitlines() if "interrupted (SIGINT)" in line]) == 1, out[-2000:]
        assert not (folder / "results").exists()
    # while the finished run writes its record: it is whole and written, and the line says so, with
    # nothing to continue (no interpreter shutdown follows: the process ends with its `with` block)
    for moment in ("record",):
        folder = tmp_path / moment
        folder.mkdir()
        proc = run_script("01_pytorch-vit.py", "--smoke", *short, cwd=folder,
                          env=script_env(folder, PYTHONPATH=str(site), HOOK_SIGNAL_WHEN=moment))
        out = proc.stdout + proc.stderr
        assert proc.returncode == 130 and "Traceback" not in out, (moment, out[-2000:])
        lines = [line for line in out.splitlines() if "interrupted (SIGINT)" in line]
        assert lines == ["01_pytorch-vit.py: interrupted (SIGINT) after the run finished: its record is in "
                         "results/runs.jsonl and its model in models/01_pytorch-vit-smoke-max-steps10.pt."], \
            (moment, out[-2000:])
        assert len(read_records(folder / "results" / "runs.jsonl")) == 1
        assert (folder / "models" / "01_pytorch-vit-smoke-max-steps10.pt").exists() and not (folder / "checkpoints").exists()


SIGTERM_WHILE_STARTING = """
import os, signal, sys, time
_sent = []
def _at_the_weights(event, args):  # as the smoke ViT's weights load: Fabric made, the folder taken, no training yet
    if event == "open" and str(args[0]).endswith("smoke-vit-printed-digits.pt") and not _sent:
        _sent.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the handler runs here
sys.addaudithook(_at_the_weights)
"""


@pytest.mark.slow
def test_a_signal_while_a_run_is_starting_is_one_line(tmp_path):
    """SIGTERM as the run is set up (its Fabric made, its folder taken, before training): one line saying so, exit
    143, no traceback, nothing written (the folder it took is gone again)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SIGTERM_WHILE_STARTING)
    proc = run_script("04_fabric-vit-mixed-precision.py", "--smoke", cwd=tmp_path,
                      env=script_env(tmp_path, PYTHONPATH=str(site)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 143 and "Traceback" not in out, out[-2000:]
    assert out.strip().splitlines()[-1] == ("04_fabric-vit-mixed-precision.py: interrupted (SIGTERM) while starting; "
                                           "no checkpoint, model or record was written."), out[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]


NAN_AT_THIRD_STEP = """
import torch, torch.nn.functional as F
_calls = [0]
_cross_entropy = F.cross_entropy
def cross_entropy(*args, **kwargs):
    _calls[0] += 1
    loss = _cross_entropy(*args, **kwargs)
    return loss * float("nan") if _calls[0] == 3 else loss
F.cross_entropy = cross_entropy
"""


@pytest.mark.slow
def test_nan_loss_stops_the_run(tmp_path):
    """A NaN loss (injected into the 3rd training step) stops the run before its first
    checkpoint, naming that step: exit 1, no record, no checkpoint."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NAN_AT_THIRD_STEP)
    env = script_env(tmp_path, PYTHONPATH=str(site))
    proc = run_script("04_fabric-vit-mixed-precision.py", "--smoke", cwd=tmp_path, env=env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "the loss is nan at epoch 1, batch 2" in proc.stderr
    assert not (tmp_path / "results" / "runs.jsonl").exists()
    assert not list(tmp_path.glob("checkpoints/*/*.ckpt"))


@pytest.fixture
def parse(monkeypatch, tmp_path):
    """The real parse_args, as if 01 were run with --smoke and these flags; restores the signal
    handlers a RunKeeper installs."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def parse_args(*flags, script="01_pytorch-vit.py"):
        args = parse_as(script, "--smoke", *flags)
        sys.argv[0] = script  # the keeper's lines name the command as typed in the project's folder
        return args
    yield parse_args
    for s, handler in handlers.items():
        signal.signal(s, handler)


def model_and_optimizer(args):
    model = lu.build_vit(None, args)
    return model, torch.optim.Adam(model.parameters(), lr=5e-5)


def resume_in_process(args, model, optimizer, train_loader):
    """A keeper entered, started and resumed in this process, in a `with` block as a script's."""
    with RunKeeper(args) as keeper:
        keeper.start()
        keeper.before_training(model, optimizer, train_loader=train_loader)


def started(args, fabric=None):
    """A RunKeeper entered and started, as a script's `with` block does, to leave with ended()."""
    keeper = RunKeeper(args)
    keeper.__enter__()
    keeper.start(fabric)
    return keeper


def ended(keeper):
    """What leaving the `with` block does for a RunKeeper that ran to its end: its folder let go of, the
    process as found."""
    keeper.__exit__(None, None, None)


def keeper_after_steps(args, losses, model=None, optimizer=None):
    """A RunKeeper that has seen one epoch of these step losses (as tensors)."""
    if model is None:
        model, optimizer = model_and_optimizer(args)
    keeper = started(args)
    keeper.before_training(model, optimizer, train_loader=[None] * len(losses))
    for loss in losses:
        keeper.batch_done(torch.tensor(loss), batch_size=4)
    return keeper, model, optimizer


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_loss_guard_stops_on_nan_and_inf(parse, capsys, bad):
    keeper, model, optimizer = keeper_after_steps(parse(), [2.0, 1.5, bad, 1.0])
    with pytest.raises(SystemExit) as exit_info:
        keeper.checkpoint(val_acc=0.5)
    assert exit_info.value.code == 1
    assert f"the loss is {bad} at epoch 1, batch 2" in capsys.readouterr().err
    ended(keeper)
    assert not os.path.exists(keeper.folder)


@pytest.mark.parametrize("bad_at, stops_at", [(0, 0), (2, 300), (300, 300), (301, 600)])
def test_the_loss_guard_looks_where_the_lesson_prints(parse, capsys, bad_at, stops_at):
    """Within an epoch the loss guard looks where the lesson prints its loss (batch_idx 0, 300, 600, ...), where the
    lesson waits for the device anyway: a loss that is not finite stops the run there, naming its batch."""
    model, optimizer = model_and_optimizer(parse())
    keeper = started(parse())
    keeper.before_training(model, optimizer, train_loader=[None] * 700)
    with pytest.raises(SystemExit) as exit_info:
        for batch_idx in range(700):
            keeper.batch_done(torch.tensor(float("nan") if batch_idx == bad_at else 1.0), batch_size=4)
    assert exit_info.value.code == 1 and batch_idx == stops_at
    assert f"the loss is nan at epoch 1, batch {bad_at}" in capsys.readouterr().err
    ended(keeper)


def test_the_epoch_loss_is_the_mean_of_its_steps(parse):
    keeper, model, optimizer = keeper_after_steps(parse(), [2.0, 4.0, 3.0, 7.0])
    time.sleep(0.5)  # the validation, which images_per_s leaves out
    keeper.checkpoint(val_acc=0.5)
    assert keeper.timed_seconds < 0.25
    assert keeper.train_loss == [4.0] and keeper.val_acc == [0.5]
    # images_per_s counts neither the run's first 3 steps nor validation: 1 timed step of 4
    assert keeper.timed_images == 4 and keeper.timed_seconds > 0
    ended(keeper)


def test_the_warm_up_counts_optimizer_steps_of_micro_batches(parse):
    """12-14 call the keeper once a micro-batch, 4 to an optimizer step: the untimed warm-up is
    the run's first 3 optimizer steps (12 micro-batches), and timing starts at a step's end, so
    Adam's first step, which makes its state, is never timed."""
    args = parse()
    args.micro_batches = 4
    keeper, _, _ = keeper_after_steps(args, [1.0] * 24)
    assert keeper.timed_images == (24 - 12) * 4 and keeper.steps_this_session == 6
    ended(keeper)


def test_resume_with_nothing_to_resume_names_the_command(parse, tmp_path, capsys):
    """The README's `python 04... --resume` after a --smoke run: the error names the -smoke
    folder and the command that continues it."""
    (tmp_path / "checkpoints" / "01_pytorch-vit-smoke").mkdir(parents=True)
    settings = {"vit": "vit_b_16", "batch_size": 16, "seed": 123, "epochs": 2, "max_steps": None, "world_size": 1,
                "precision": "32-true"}
    (tmp_path / "checkpoints" / "01_pytorch-vit-smoke" / LATEST).write_text(json.dumps(
        {"flags": ["--smoke"], "script": "01_pytorch-vit.py", "kind": "smoke", "settings": settings}))
    with pytest.raises(SystemExit) as exit_info:
        parse_as("01_pytorch-vit.py", "--resume", "--accelerator", "cpu")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "nothing to resume in checkpoints/01_pytorch-vit (no latest.json)" in err
    assert ("checkpoints/01_pytorch-vit-smoke holds one, made with kind smoke (now full), epochs 2 (now 3): continue it"
            f" with python {ROOT / '01_pytorch-vit.py'} --smoke --resume.") in err, err


def test_fresh_run_refuses_to_overwrite_an_unfinished_one(parse, tmp_path, capsys):
    (tmp_path / "ck").mkdir()
    latest = '{"checkpoint": "epoch-0001.ckpt", "flags": ["--smoke"]}'
    (tmp_path / "ck" / LATEST).write_text(latest)
    with pytest.raises(SystemExit) as exit_info:
        parse("--checkpoint-dir", str(tmp_path / "ck"))
    assert exit_info.value.code == 2
    assert "--resume" in capsys.readouterr().err
    assert (tmp_path / "ck" / LATEST).read_text() == latest


def test_a_fresh_run_in_the_default_folder_is_offered_the_next_free_one(tmp_path, capsys):
    """The default folder holds an unfinished run: the line offers the folder beside it, its name and -2 (-3 where
    that is taken), and how to continue and how to start over, in that one line, exit 2."""
    folder = tmp_path / "checkpoints" / "01_pytorch-vit-smoke"
    folder.mkdir(parents=True)
    (folder / LATEST).write_text('{"flags": ["--smoke"]}')
    script = ROOT / "01_pytorch-vit.py"
    for taken, offered in ((False, "checkpoints/01_pytorch-vit-smoke-2"), (True, "checkpoints/01_pytorch-vit-smoke-3")):
        if taken:
            (tmp_path / "checkpoints" / "01_pytorch-vit-smoke-2").mkdir()
        with pytest.raises(SystemExit) as exit_info:
            parse_as("01_pytorch-vit.py", "--smoke")
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
        assert err == (f"01_pytorch-vit.py: error: checkpoints/01_pytorch-vit-smoke holds the checkpoint of an "
                       f"unfinished run: continue it with: python {script} --smoke --resume; or start this one in a "
                       f"folder of its own: python {script} --smoke --checkpoint-dir {offered}; or start over with: "
                       f"rm -rf checkpoints/01_pytorch-vit-smoke && rmdir checkpoints 2>/dev/null; python {script} "
                       "--smoke"), err


@pytest.mark.parametrize("error, says", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "error: the GPU ran out of memory"),
    (RuntimeError("[../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"), None),
])
def test_a_known_error_in_another_process_is_said_by_that_process(parse, capsys, error, says):
    """Process 1 of 2 meets a known error of its own (out of memory): it says it, prefixed with its number, and its
    code; a lost peer's error is process 0's to say, so process 1 says nothing."""
    keeper = RunKeeper(parse())
    keeper.rank, keeper.world_size = 1, 2
    line, code = keeper.ending(error)
    keeper.say_the_end(line, error)
    err = capsys.readouterr().err.strip()
    if says:
        assert code == 1 and err.startswith(f"01_pytorch-vit.py: process 1: {says}"), err
    else:
        assert code == 3 and err == "", err


def write_checkpoint(args, **meta):
    """A real checkpoint of the smoke model, written by RunKeeper's own save."""
    keeper, model, optimizer = keeper_after_steps(args, [1.0])
    keeper.checkpoint(val_acc=0.5)
    ended(keeper)
    latest = os.path.join(args.checkpoint_dir, LATEST)
    if meta:
        data = json.load(open(latest))
        data["settings"].update(meta.pop("settings", {}))
        data.update(meta)
        json.dump(data, open(latest, "w"))
    return latest


@pytest.mark.parametrize("flags, difference", [
    (["--batch-size", "8"], "batch_size 16 (now 8)"),
    (["--seed", "7"], "seed 123 (now 7)"),
    (["--epochs", "5"], "epochs 2 (now 5)"),
    (["--max-steps", "3"], "max_steps unset (now 3)"),
])
def test_resume_refuses_changed_settings(parse, tmp_path, capsys, flags, difference):
    """Each setting that shapes a run, changed on --resume: one line naming it and the command
    that continues the run as it started, exit 2, the checkpoint untouched."""
    ck = str(tmp_path / "ck")
    write_checkpoint(parse("--checkpoint-dir", ck))
    before = {p: open(os.path.join(ck, p), "rb").read() for p in os.listdir(ck)}
    with pytest.raises(SystemExit) as exit_info:  # as the flags are read, before any work
        parse("--resume", "--checkpoint-dir", ck, *flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and difference in err, err
    script = ROOT / "01_pytorch-vit.py"  # as the flags were read
    assert f"; continue it as started: python {script} --smoke --checkpoint-dir {ck} --resume;" in err
    elsewhere = " ".join([f"python {script} --smoke", *flags, "--checkpoint-dir", f"{ck}-2"])
    assert err.endswith(f"; or start this one in a folder of its own: {elsewhere}") and "rm -rf" not in err, err
    assert {p: open(os.path.join(ck, p), "rb").read() for p in os.listdir(ck)} == before


def test_the_steps_are_those_the_loader_hands_out_and_any_max_steps_marks_a_debugging_run(parse):
    """args.steps (what a schedule counts to) is the optimizer steps each process's loader hands out: its share of the
    digits as torch's DistributedSampler pads it (Fabric's), in whole batches. --max-steps, cutting or not, marks the
    run as a debugging one: not whole, named by it (an N of an epoch's steps or more trains what the run would)."""
    from torch.utils.data import DistributedSampler, TensorDataset

    for processes in (1, 2, 3, 4):
        args = parse("--accelerator", "cpu", "--devices", str(processes), script="05_fabric-vit-mixed-ddp.py")
        share = len(DistributedSampler(TensorDataset(torch.zeros(lu.SMOKE_TRAIN)), num_replicas=processes, rank=0))
        assert args.steps == args.epochs * (share // args.batch_size), (processes, args.batch_size)
    per_epoch = lu.SMOKE_TRAIN // 16
    for steps in (per_epoch - 1, per_epoch, per_epoch + 1):
        cut = parse("--max-steps", str(steps))
        assert (cut.whole, cut.max_steps, cut.steps) == (False, steps, cut.epochs * min(steps, per_epoch))
        assert f"max-steps{steps}" in cut.save_model


@pytest.mark.parametrize("steps, epochs, timed", [(1, 3, False), (1, 4, False), (2, 1, False), (3, 1, False),
                                                   (2, 2, True), (4, 1, True)])
def test_a_synthetic_run_with_no_step_to_time_is_refused(parse, capsys, steps, epochs, timed):
    """--synthetic measures the steps after the run's first WARMUP_STEPS (3) and after each epoch's first: where none
    is left (one step an epoch, or 3 in all), refused in one line as the flags are read; otherwise accepted."""
    flags = ["--synthetic", "--max-steps", str(steps), "--epochs", str(epochs)]
    if timed:
        assert parse(*flags).steps == steps * epochs
        return
    with pytest.raises(SystemExit) as exit_info:
        parse(*flags)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    least = int(err.split("give --max-steps ")[1].split()[0])  # the fewest that time a step: accepted, one fewer not
    assert parse("--synthetic", "--max-steps", str(least), "--epochs", str(epochs)).steps == least * epochs
    with pytest.raises(SystemExit):
        parse("--synthetic", "--max-steps", str(least - 1), "--epochs", str(epochs))


@pytest.mark.parametrize("meta, words", [
    ({"script": "03_fabric-vit.py"}, ["script 03_fabric-vit.py (now 01_pytorch-vit.py)"]),
    ({"kind": "smoke-synthetic"}, ["kind smoke-synthetic (now smoke)"]),
    ({"settings": {"world_size": 2}}, ["world_size 2 (now 1)"]),
    ({"settings": {"precision": "bf16-mixed"}}, ["precision bf16-mixed (now 32-true)"]),  # made where bf16 ran
])
def test_resume_from_another_script_kind_or_world_size(parse, tmp_path, capsys, meta, words):
    """Refused in one line that names the difference and the way on: the command as it started, where the precision
    differs (the device's, no flag's) on a device that runs the checkpoint's."""
    ck = str(tmp_path / "ck")
    write_checkpoint(parse("--checkpoint-dir", ck), **meta)
    before = {p: open(os.path.join(ck, p), "rb").read() for p in os.listdir(ck)}
    with pytest.raises(SystemExit) as exit_info:
        parse("--resume", "--checkpoint-dir", ck)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    the_device_s = "precision" in meta.get("settings", {})
    assert ("; continue it as started: python" in err) != the_device_s, err
    assert ("; continue it as started on a machine whose device runs bf16-mixed: python" in err) == the_device_s, err
    assert {p: open(os.path.join(ck, p), "rb").read() for p in os.listdir(ck)} == before


def test_resume_of_a_run_that_fell_back_names_how_this_cpu_runs_it_so(parse, tmp_path, capsys, monkeypatch):
    """04 run where it fell back to 32-true (oneDNN capped, say), resumed where bf16-mixed runs: refused in one line
    whose way on is the cap under which a CPU with bfloat16 units runs it as it started (no flag sets a precision)."""
    import run_keeping.config as config

    ck = str(tmp_path / "ck")
    write_checkpoint(parse("--checkpoint-dir", ck, script="04_fabric-vit-mixed-precision.py"),
                     settings={"precision": "32-true"})
    monkeypatch.setattr(config, "precision_that_runs", lambda asked, accelerator: asked)  # a machine with bfloat16
    with pytest.raises(SystemExit) as exit_info:
        parse("--resume", "--checkpoint-dir", ck, script="04_fabric-vit-mixed-precision.py")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "made with precision 32-true (now bf16-mixed); continue it as started on a " \
        "machine whose device runs 32-true (on a CPU with bfloat16 units: ONEDNN_MAX_CPU_ISA=AVX2 before the " \
        "command): python " in err and f"--checkpoint-dir {ck} --resume; or start this one in" in err, err


def test_resume_from_a_corrupt_checkpoint(parse, tmp_path, capsys):
    ck = tmp_path / "ck"
    write_checkpoint(parse("--checkpoint-dir", str(ck)))
    checkpoint = ck / "epoch-0001.ckpt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])  # truncated, as by a full disk
    corrupt = checkpoint.read_bytes()
    args = parse("--resume", "--checkpoint-dir", str(ck))
    model, optimizer = model_and_optimizer(args)
    with pytest.raises(SystemExit) as exit_info:
        resume_in_process(args, model, optimizer, train_loader=[])
    assert exit_info.value.code == 2
    assert "cannot load" in capsys.readouterr().err
    assert checkpoint.read_bytes() == corrupt
    checkpoint.unlink()  # the file latest.json names is gone: as damaged, never "made by another script"
    with pytest.raises(SystemExit) as exit_info:
        resume_in_process(args, model, optimizer, train_loader=[])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "(it is not there); start over with: rm -rf" in err, err
    (ck / LATEST).write_text("{not json")
    with pytest.raises(SystemExit):
        parse("--resume", "--checkpoint-dir", str(ck))
    assert "corrupt" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a fresh run in that folder: told the same, never offered to continue it
        parse("--checkpoint-dir", str(ck))
    err = capsys.readouterr().err
    assert "is unreadable or corrupt" in err and "--resume" not in err, err


@pytest.mark.slow
def test_a_damaged_checkpoint_names_the_start_over_that_leaves_no_empty_folder(parse, tmp_path, capsys):
    """A truncated checkpoint in the default folder: the one line gives the command that starts
    over; where that new run stops before its first checkpoint (here: exits at once), nothing of
    checkpoints/ is left; run as printed, it starts the run afresh."""
    args = parse("--max-steps", "2")
    write_checkpoint(args)
    folder = tmp_path / "checkpoints" / "01_pytorch-vit-smoke-max-steps2"
    checkpoint = next(folder.glob("epoch-*.ckpt"))
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    args = parse("--max-steps", "2", "--resume")
    with pytest.raises(SystemExit) as exit_info:
        resume_in_process(args, *model_and_optimizer(args), train_loader=[])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    command = err.split("; start over with: ")[1]
    assert command == ("rm -rf checkpoints/01_pytorch-vit-smoke-max-steps2 && rmdir checkpoints 2>/dev/null; "
                       "python 01_pytorch-vit.py --smoke --max-steps 2"), command
    stopped = subprocess.run(["bash", "-c", command.replace("python ", "exit 130 #", 1)], cwd=tmp_path)
    assert stopped.returncode == 130 and not (tmp_path / "checkpoints").exists()
    started = subprocess.run(["bash", "-c", command.replace("python 01", f"python {ROOT}/01", 1)],
                             cwd=tmp_path, env=script_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert started.returncode == 0, started.stderr[-2000:]
    assert "Resuming" not in started.stdout and len(read_records(tmp_path / "results" / "runs.jsonl")) == 1
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("restart, run_id, continues", [
    ("1", "run-a", True),    # torchrun restarted the run's workers: it goes on from its checkpoint
    ("0", "run-a", False),   # its first start: a fresh run is refused over an unfinished one
    ("1", "run-b", False),   # another torchrun job's restart is not this run's
])
def test_a_torchrun_restart_continues_its_run(parse, tmp_path, monkeypatch, capsys, restart, run_id, continues):
    """Workers that torchrun starts again (TORCHELASTIC_RESTART_COUNT over 0, the same run id as
    the checkpoint's) continue the run without --resume; anything else is refused in one line."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    write_checkpoint(parse())  # after one epoch, by a process torchrun started as run-a
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    if not continues:
        with pytest.raises(SystemExit) as exit_info:
            parse()
        assert exit_info.value.code == 2 and "holds the checkpoint of an unfinished run" in capsys.readouterr().err
        return
    args = parse()
    keeper = started(args)
    keeper.before_training(*model_and_optimizer(args), train_loader=[None] * 4)
    assert keeper.start_epoch == 1  # epoch 2 is next
    out = capsys.readouterr().out
    assert f"torchrun restarted its workers (restart 1): continuing the run in {args.checkpoint_dir}" in out
    ended(keeper)


def test_checkpoint_restores_model_optimizer_and_figures(parse, tmp_path):
    ck = str(tmp_path / "ck")
    args = parse("--checkpoint-dir", ck)
    model, optimizer = model_and_optimizer(args)
    model(torch.rand(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    keeper, _, _ = keeper_after_steps(args, [2.0, 4.0], model, optimizer)
    keeper.checkpoint(val_acc=0.5)
    ended(keeper)
    args = parse("--resume", "--checkpoint-dir", ck)
    fresh, fresh_optimizer = model_and_optimizer(args)
    resumed = started(args)
    resumed.before_training(fresh, fresh_optimizer, train_loader=[None] * 2)
    assert torch.equal(fresh.conv_proj.weight, model.conv_proj.weight)
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1
    assert (resumed.start_epoch, resumed.train_loss, resumed.val_acc) == (1, [3.0], [0.5])
    assert resumed.earlier["train_time_s"] > 0
    ended(resumed)


def test_a_scheduler_handed_over_is_kept_and_restored(parse, tmp_path):
    """07's and 14's line: keep_in_checkpoints(scheduler). Its state (the epoch count, the rate)
    goes in each checkpoint and --resume restores it."""
    ck = str(tmp_path / "ck")
    args = parse("--checkpoint-dir", ck)
    model, optimizer = model_and_optimizer(args)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    optimizer.step()
    scheduler.step()
    keeper = started(args)
    keeper.keep_in_checkpoints(scheduler)
    keeper.before_training(model, optimizer, train_loader=[None])
    keeper.batch_done(torch.tensor(1.0), batch_size=4)
    keeper.checkpoint(val_acc=0.5)
    ended(keeper)
    args = parse("--resume", "--checkpoint-dir", ck)
    fresh, fresh_optimizer = model_and_optimizer(args)
    fresh_scheduler = torch.optim.lr_scheduler.ExponentialLR(fresh_optimizer, gamma=0.9)
    resumed = started(args)
    resumed.keep_in_checkpoints(fresh_scheduler)
    resumed.before_training(fresh, fresh_optimizer, train_loader=[None])
    assert fresh_scheduler.last_epoch == 1 and fresh_optimizer.param_groups[0]["lr"] == pytest.approx(5e-5 * 0.9)
    ended(resumed)


def test_fabric_saves_and_loads_a_compiled_models_checkpoint(parse, tmp_path):
    """09's GPU path: torch.compile before Fabric's setup. The keeper's checkpoint of that model
    (Fabric's save) loads back into a compiled model set up the same way, its weights as saved (no
    forward is run: nothing is compiled)."""
    import lightning as L
    args = parse("--checkpoint-dir", str(tmp_path / "ck"))
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = fabric.setup_module(torch.compile(lu.build_vit(None, args)))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=5e-5))
    model.get_parameter("conv_proj.weight").data.fill_(0.25)
    keeper = started(args, fabric)
    keeper.before_training(model, optimizer, train_loader=[None])
    keeper.batch_done(torch.tensor(1.0), batch_size=4)
    keeper.checkpoint(val_acc=0.5)
    ended(keeper)
    args = parse("--resume", "--checkpoint-dir", str(tmp_path / "ck"))
    fresh = fabric.setup_module(torch.compile(lu.build_vit(None, args)))
    fresh_optimizer = fabric.setup_optimizers(torch.optim.Adam(fresh.parameters(), lr=5e-5))
    resumed = started(args, fabric)
    resumed.before_training(fresh, fresh_optimizer, train_loader=[None])
    assert resumed.start_epoch == 1 and bool((fresh.get_parameter("conv_proj.weight") == 0.25).all())
    ended(resumed)


def test_a_checkpoint_killed_mid_write_never_replaces_the_last_good_one(parse, monkeypatch):
    """The checkpoint is written beside its final name and renamed: a process killed halfway
    through the write leaves the last good checkpoint, and latest.json naming it; the next run
    removes the half-written file."""
    args = parse("--checkpoint-dir", "ck")
    keeper, model, optimizer = keeper_after_steps(args, [1.0])
    keeper.checkpoint(val_acc=0.5)
    real = os.write

    def killed_halfway(fd, data):
        real(fd, bytes(data)[:len(data) // 2])
        raise KeyboardInterrupt  # not an error the writer handles: as if the process died
    monkeypatch.setattr(os, "write", killed_halfway)
    keeper.batch_done(torch.tensor(1.0), batch_size=4)
    with pytest.raises(KeyboardInterrupt):
        keeper.checkpoint(val_acc=0.6)
    monkeypatch.setattr(os, "write", real)
    ended(keeper)
    assert json.loads((keeper.folder / LATEST).read_text())["checkpoint"] == "epoch-0001.ckpt"
    assert not (keeper.folder / "epoch-0002.ckpt").exists() and (keeper.folder / "epoch-0002.ckpt.tmp").exists()
    theirs = [keeper.folder / "notes.tmp", keeper.folder / "cache.tmp"]  # a user's, in a --checkpoint-dir shared
    theirs[0].write_text("mine")
    theirs[1].mkdir()
    (keeper.folder / f"{LATEST}.tmp").write_text("{")  # as a write of latest.json cut off leaves it
    args = parse("--resume", "--checkpoint-dir", "ck")
    fresh, fresh_optimizer = model_and_optimizer(args)
    resumed = started(args)
    resumed.before_training(fresh, fresh_optimizer, train_loader=[None])
    assert resumed.start_epoch == 1 and not (keeper.folder / "epoch-0002.ckpt.tmp").exists()
    assert not (keeper.folder / f"{LATEST}.tmp").exists() and all(path.exists() for path in theirs)
    ended(resumed)


def test_a_refused_start_leaves_no_lock_and_no_folder(parse, tmp_path, capsys):
    """`--resume` with nothing to resume, in a folder of no run: one line, exit 2, and no checkpoints/ folder
    and no .lock left behind (the lock is taken before the refusal and let go with it); one machine is not
    told to share its folder with others."""
    with pytest.raises(SystemExit) as exit_info:
        parse("--resume")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "nothing to resume" in err and "machine" not in err, err
    assert not (tmp_path / "checkpoints").exists()
    held = tmp_path / "held"
    held.mkdir()
    (held / "notes.txt").write_text("the user's")  # a folder that holds something of the user's: kept as it was
    with pytest.raises(SystemExit):
        parse("--resume", "--checkpoint-dir", str(held))
    assert [p.name for p in held.iterdir()] == ["notes.txt"]
    holder = RunKeeper(parse("--checkpoint-dir", str(held)))  # a run that takes the folder, then is refused
    with pytest.raises(SystemExit) as exit_info, holder:
        holder.start()
        raise SystemExit(2)
    assert exit_info.value.code == 2 and [p.name for p in held.iterdir()] == ["notes.txt"]
    with pytest.raises(SystemExit), RunKeeper(parse()) as keeper:  # the default folder: none left behind
        keeper.start()
        raise SystemExit(2)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("script, flags, saved, difference", [
    ("01_pytorch-vit.py", ["--synthetic", "--accelerator", "cpu", "--vit", "vit_l_16"], {"vit": "vit_b_16"},
     "vit vit_b_16 (now vit_l_16)"),
    ("10_fabric-vit-tensor-parallel.py", ["--smoke", "--devices", "1", "--tensor-parallel", "1"], {"--tensor-parallel": 2},
     "--tensor-parallel 2 (now 1)"),
])
def test_resume_refuses_another_model_or_another_value_of_a_lessons_own_flag(script, flags, saved, difference, tmp_path,
                                                                             capsys):
    """What changes what a checkpoint holds, --vit and a lesson's own flags among it, is refused in one line
    that names it and continues the run as it started, before the checkpoint is read."""
    ck = tmp_path / "ck"
    args = parse_as(script, *flags, "--checkpoint-dir", str(ck))
    ck.mkdir()
    settings = {key: getattr(args, key) for key in ("vit", "batch_size", "seed", "epochs", "max_steps", "world_size",
                                                     "precision")} | args.own | saved
    (ck / LATEST).write_text(json.dumps({"checkpoint": "epoch-0001.ckpt", "script": args.script, "kind": args.kind,
                                         "settings": settings, "flags": ["--first", "flags"]}))
    with pytest.raises(SystemExit) as exit_info:
        parse_as(script, *flags, "--resume", "--checkpoint-dir", str(ck))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and difference in err, err
    assert f"continue it as started: python {ROOT / script} --first flags --resume" in err


def test_resume_in_the_default_folder_names_the_run_of_another_value_of_a_lessons_own_flag(tmp_path, capsys):
    """Without --checkpoint-dir a changed value of a lesson's own flag names another folder (the run's name holds it):
    --resume is refused in one line, before any work, that names the folder of the value the run started with and
    the command that continues it."""
    script, flags = "10_fabric-vit-tensor-parallel.py", ["--smoke", "--devices", "2"]
    started = parse_as(script, *flags, "--tensor-parallel", "2")
    folder = tmp_path / started.checkpoint_dir
    folder.mkdir(parents=True)
    settings = {key: getattr(started, key) for key in ("vit", "batch_size", "seed", "epochs", "max_steps", "world_size",
                                                        "precision")} | started.own
    (folder / LATEST).write_text(json.dumps({"checkpoint": "epoch-0001.ckpt", "script": started.script,
                                             "kind": started.kind, "settings": settings, "flags": ["--first", "flags"]}))
    with pytest.raises(SystemExit) as exit_info:
        parse_as(script, *flags, "--tensor-parallel", "1", "--resume")
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    held = f"{started.checkpoint_dir} holds one, made with "  # and the batch a process takes, which it sets
    assert held in err and "--tensor-parallel 2 (now 1): continue it with python " in err.split(held)[1], err


def test_a_checkpoint_that_does_not_fit_is_not_called_damaged(parse, tmp_path, capsys):
    """A whole checkpoint that the model built now does not take (another version of the script): one line,
    exit 2, that says so and how to continue as it started, never to delete it."""
    args = parse()
    write_checkpoint(args)
    args = parse("--resume")
    model = lu.build_vit(None, args)
    model.heads.head = torch.nn.Linear(model.hidden_dim, 11)  # a head of another shape than the checkpoint's
    with pytest.raises(SystemExit) as exit_info:
        resume_in_process(args, model, torch.optim.Adam(model.parameters()), train_loader=[None])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "does not fit what this script builds" in err, err
    assert "rm -rf" not in err and "continue it as started" in err and list((tmp_path / "checkpoints").rglob("*.ckpt"))


def test_a_resumed_runs_peak_is_the_peak_of_all_its_sessions(parse):
    """The peak memory of the session before a --resume is kept in the checkpoint, and the record takes the
    largest of every session's."""
    args = parse()
    keeper, model, optimizer = keeper_after_steps(args, [1.0])
    keeper.peak_gb = 123.0  # a first session's peak, above any this process reaches
    keeper.checkpoint(val_acc=0.5)
    ended(keeper)
    resumed = started(parse("--resume"))
    resumed.before_training(model, optimizer, train_loader=[None])
    assert resumed.peak_gb == 123.0 and resumed.start_epoch == 1
    ended(resumed)


# Session 1 holds 1.5 GB for a moment of its first batch, then is interrupted once its first checkpoint is named.
HOG_THEN_STOP = """
import os, signal, sys
import torch.nn.functional as F
_calls, _cross_entropy = [], F.cross_entropy
def cross_entropy(*args, **kwargs):
    _calls.append(1)
    if len(_calls) == 1:
        hog = bytearray(1536 * 2**20)
        hog[::4096] = b"x" * len(hog[::4096])  # every page touched: resident
        del hog
    return _cross_entropy(*args, **kwargs)
F.cross_entropy = cross_entropy
def _at(event, args):
    if event == "os.rename" and str(args[1]).endswith("epoch-0001.ckpt"):
        os.kill(os.getpid(), signal.SIGINT)
sys.addaudithook(_at)
"""


@pytest.mark.slow
def test_the_records_peak_is_the_highest_of_every_session(tmp_path):
    """A run whose first session peaked 1.5 GB above the rest, interrupted after its first epoch and resumed:
    the record's peak memory is that session's, not the last one's (a smoke run's is about 1 GB)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOG_THEN_STOP)
    flags = ["--smoke", "--epochs", "2", "--max-steps", "2"]
    first = run_script("04_fabric-vit-mixed-precision.py", *flags, cwd=tmp_path,
                       env=script_env(tmp_path, PYTHONPATH=str(site)), fresh=True)
    assert first.returncode == 130 and "holds 1 of 2 epochs" in first.stderr, first.stderr[-2000:]
    second = run_script("04_fabric-vit-mixed-precision.py", *flags, "--resume", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    record = read_records(tmp_path / "results" / "runs.jsonl")[-1]
    assert record["peak_memory_gb"] > 1.5 * 2**30 / 1e9, record["peak_memory_gb"]
