"""Runs that share a machine or a folder: started together, they never trample each other;
every command the suite prints runs as printed from the folder it was printed in, whatever the
paths; appends from many processes stay whole."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, read_records, run_script, script_env, start_script


def started_together(*flag_lists, cwd):
    """01 --smoke with each list of flags, started at the same moment in one folder."""
    return [start_script("01_pytorch-vit.py", "--smoke", *flags, cwd=cwd) for flags in flag_lists]


@pytest.mark.slow
def test_runs_started_together_keep_their_own_files_or_are_told_a_run_is_in_progress(tmp_path):
    """--seed 1, --seed 2 and --seed 1 again, started at the same moment in one folder: the two
    seeds each train with their own checkpoint folder and model file (named by the setting that
    differs), and each record names the file that holds its model; of the two runs of seed 1,
    one trains and the other is refused in one line saying that a run is in progress in its
    folder (not that one is unfinished), exit 2, writing nothing. (A run killed outright holds
    nothing: test_resume.py's killed runs are continued in their folders.)"""
    procs = started_together(["--seed", "1"], ["--seed", "2"], ["--seed", "1"], cwd=tmp_path)
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert codes[1] == 0 and sorted([codes[0], codes[2]]) == [0, 2], [o[-2000:] for o in outputs]
    refused = outputs[0] if codes[0] == 2 else outputs[2]
    lines = [line for line in refused.splitlines() if "error:" in line]
    assert len(lines) == 1 and "a run is in progress in checkpoints/01_pytorch-vit-smoke-seed1 (process " in lines[0], refused
    assert "unfinished" not in lines[0] and "Traceback" not in refused
    records = {r["seed"]: r for r in read_records(tmp_path / "results" / "runs.jsonl")}
    assert sorted(records) == [1, 2] and len(read_records(tmp_path / "results" / "runs.jsonl")) == 2
    assert records[1]["model_file"] == "models/01_pytorch-vit-smoke-seed1.pt"
    assert records[2]["model_file"] == "models/01_pytorch-vit-smoke-seed2.pt"
    models = [(tmp_path / record["model_file"]).read_bytes() for record in records.values()]
    assert models[0] != models[1]  # each its own run's
    assert records[1]["train_loss"] != records[2]["train_loss"]
    assert not (tmp_path / "checkpoints").exists()


APPEND = """
import sys
sys.path.insert(0, sys.argv[1])
from run_keeping.record import append_record
for i in range(int(sys.argv[3])):
    append_record(sys.argv[2], {"writer": int(sys.argv[4]), "i": i, "padding": "x" * 3000})
"""


def test_a_run_taking_the_folder_as_the_last_one_lets_go_of_it_holds_it(tmp_path, monkeypatch):
    """Two runs of one default folder, the second opening its .lock just as the first lets go (which removes the
    .lock and the folder, its own and empty): the second makes them again and holds the folder, saying so in .lock;
    letting go, it leaves nothing."""
    import fcntl
    import os

    from run_keeping.keeper import FolderLock

    folder = tmp_path / "checkpoints" / "01_pytorch-vit-smoke"
    first = FolderLock(folder, [folder, folder.parent])
    flock, calls = fcntl.flock, []

    def first_lets_go_meanwhile(fd, operation):  # between the second's open and its flock, once
        if not calls:
            first.release()
        calls.append(fd)
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", first_lets_go_meanwhile)
    second = FolderLock(folder, [folder, folder.parent])
    assert len(calls) == 2 and f"process {os.getpid()} on " in (folder / ".lock").read_text()
    second.release()
    assert list(tmp_path.iterdir()) == []


def test_many_processes_appending_at_once_leave_every_record_whole(tmp_path):
    """8 processes, started together, each appending 40 records of 3 kB to one file whose last
    line was left half-written (no newline) by a run killed mid-write: every new record is a
    whole line of its own, and the lines before are as they were."""
    path = tmp_path / "runs.jsonl"
    earlier = '{"script": "00_pytorch-vit-random-init.py"}\n{"script": "01_pytorch-vit.py", "test_'
    path.write_text(earlier)
    procs = [subprocess.Popen([sys.executable, "-c", APPEND, str(ROOT), str(path), "40", str(w)])
             for w in range(8)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 8
    lines = path.read_text().split("\n")
    assert lines[:2] == earlier.split("\n") and lines[-1] == ""
    written = [json.loads(line) for line in lines[2:-1]]
    assert sorted((r["writer"], r["i"]) for r in written) == [(w, i) for w in range(8) for i in range(40)]


@pytest.mark.slow
def test_every_printed_command_runs_as_printed_from_another_folder(smoke_runs, tmp_path):
    """The script run by a path with a space, from another folder, with a checkpoint folder
    with spaces in it: "continue with" (after a Ctrl-C in the middle of the second epoch, which
    keeps the first epoch's checkpoint), "start over" (a fresh run refused over the unfinished one) and
    plot_results.py's "chart them with", each run as printed from the folder it was printed in,
    do what they say; the continued run equals an uninterrupted one."""
    project, here = tmp_path / "my proj", tmp_path / "run here"
    project.mkdir()
    here.mkdir()
    for path in [*ROOT.glob("[0-9][0-9]_*.py"), ROOT / "plot_results.py"]:
        (project / path.name).symlink_to(path)
    script = project / "01_pytorch-vit.py"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, signal\nfrom torch.optim.optimizer import register_optimizer_step_post_hook\n"
        "_n = [0]\ndef _stop(*a):\n    _n[0] += 1\n"
        "    if _n[0] == 90: os.kill(os.getpid(), signal.SIGINT)\n"
        "register_optimizer_step_post_hook(_stop)\n")
    env = script_env(here)
    interrupted = dict(env, PYTHONPATH=str(site))

    def printed(text, after):
        """The command after `after` in the one line that says it."""
        line = next(line for line in text.splitlines() if after in line)
        return line.split(after, 1)[1].strip().rstrip(".").split("; or start")[0]

    def run_printed(command, env=env):
        return subprocess.run(["bash", "-c", command],
                              cwd=here, env=env, capture_output=True, text=True, timeout=240)

    first = subprocess.run([sys.executable, str(script), "--smoke", "--checkpoint-dir", "ck pts/a b"],
                           cwd=here, env=interrupted, capture_output=True, text=True, timeout=240)
    assert first.returncode == 130, first.stderr[-2000:]
    go_on = printed(first.stderr, "continue with: ")
    assert go_on == f"python '{script}' --smoke --checkpoint-dir 'ck pts/a b' --resume", go_on
    fresh = run_script(script, "--smoke", "--checkpoint-dir", "ck pts/a b", cwd=here, env=env)
    assert fresh.returncode == 2 and "holds the checkpoint of an unfinished run" in fresh.stderr
    assert printed(fresh.stderr, "continue it with: ") == go_on
    over = fresh.stderr.split("or start over with: ")[1].strip()
    assert over == f"rm -rf 'ck pts/a b'; python '{script}' --smoke --checkpoint-dir 'ck pts/a b'", over

    resumed = run_printed(go_on)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "1 of 2 epochs done" in resumed.stdout  # stopped at step 90, in the second epoch
    record, baseline = read_records(here / "results" / "runs.jsonl")[-1], smoke_runs("01_pytorch-vit.py").record
    assert record["train_loss"] == pytest.approx(baseline["train_loss"], rel=1e-6)  # one process: exact
    assert (record["val_acc"], record["test_acc"]) == (baseline["val_acc"], baseline["test_acc"])
    started_over = run_printed(over)  # after the run it would have dropped has finished: a fresh one
    assert started_over.returncode == 0, started_over.stderr[-2000:]
    assert "Resuming" not in started_over.stdout

    plot = subprocess.run([sys.executable, str(project / "plot_results.py"), "--synthetic"], cwd=here,
                          env=env, capture_output=True, text=True, timeout=120)
    assert plot.returncode == 2 and "no synthetic runs" in plot.stderr
    chart = printed(plot.stderr, "chart them with ")
    assert chart == f"python '{project / 'plot_results.py'}' --smoke", chart
    charted = run_printed(chart)
    assert charted.returncode == 0 and (here / "results" / "charts.png").exists(), charted.stderr[-2000:]
