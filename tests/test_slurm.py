"""The cluster path on a real SLURM (Debian's slurm-wlm, one node, started by
tools/local_slurm.sh): the README's job script as printed (but --smoke, CPUs and the task counts)
submitted with sbatch; the same job requeued in the middle of an epoch by `scontrol requeue`,
continuing by itself to the same finished run; a launch whose task counts differ from the
flags; and `srun --pty bash`'s job name, under which Lightning ignores SLURM."""
import json
import os
import subprocess
import time

import pytest

from conftest import ROOT, parse_as, read_records, script_env

TOOL = ROOT / "tools" / "local_slurm.sh"
# In process 0 of the first run only: after the 80th optimizer step (the second epoch's 6th
# batch), say so and wait until told to go on, so that the requeue lands in the middle of an
# epoch whatever the machine's speed.
PAUSE = """
import os, time
from pathlib import Path
from torch.optim.optimizer import register_optimizer_step_post_hook
_steps = [0]
def _pause(*args):
    _steps[0] += 1
    if _steps[0] == 80 and os.environ.get("SLURM_PROCID") == "0" and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        Path(os.environ["HOOK_PAUSED"]).touch()
        while not Path(os.environ["HOOK_GO_ON"]).exists():
            time.sleep(0.05)
register_optimizer_step_post_hook(_pause)
"""


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    pytest.fail(f"waited {timeout} s for {what}", pytrace=False)


def state(job, env):
    found = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return next((part.split("=")[1] for part in found.split() if part.startswith("JobState=")), None)


@pytest.fixture
def slurm(tmp_path):
    """A one-node SLURM for this test: its environment, and a folder whose scripts are the
    project's (the job script names them as the README does)."""
    folder = tmp_path / "slurm"
    started = subprocess.run(["bash", str(TOOL), "start", str(folder)], capture_output=True, text=True, timeout=300)
    if started.returncode == 5:
        pytest.skip(started.stderr.strip())  # this machine cannot run the daemons: said in one line
    assert started.returncode == 0, started.stderr
    env = script_env(tmp_path, SLURM_CONF=str(folder / "slurm.conf"))
    work = tmp_path / "work"
    work.mkdir()
    for script in ROOT.glob("[0-9][0-9]_*.py"):
        (work / script.name).symlink_to(script)
    try:
        yield env, work
    finally:
        subprocess.run(["bash", str(TOOL), "stop", str(folder)], capture_output=True, timeout=120)
    # stopped: no daemon of its left, and its folder gone
    assert not folder.exists()
    for name in ("run/slurmctld.pid", "run/slurmd.pid", "munge/munged.pid"):
        assert not (folder / name).exists()


def submit(job_script, env, work, output):
    return subprocess.run(["sbatch", "--parsable", f"--output={output}", str(job_script)], cwd=work, env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.slow
def test_the_readme_job_on_a_real_slurm_continues_after_a_requeue(slurm, smoke_runs, tmp_path):
    """The README's job script, submitted with sbatch (--smoke, CPUs and 2 tasks on the one
    node): its two processes say SLURM started them. `scontrol requeue` in the middle of its
    second epoch: SLURM sends SIGTERM, the run saves where it is, the job is requeued and starts
    again with no edit, continues from that batch, and finishes as the same run uninterrupted
    (06 --smoke on 2 processes: the same maths whoever starts them). Then a launch whose task
    counts are not the flags', and one under srun --pty bash's job name for several machines:
    one line each, exit 2; a one-process lesson as one task (srun -n 1): it runs."""
    env, work = slurm
    job = work / "job.sh"
    job.write_text(subprocess.run(["bash", str(TOOL), "job", "2"], capture_output=True, text=True, check=True).stdout)
    readme = {line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(("#SBATCH", "srun"))}
    ours = {line for line in job.read_text().splitlines() if line.startswith(("#SBATCH", "srun"))}
    counts = ("#SBATCH --nodes=", "#SBATCH --ntasks-per-node=", "#SBATCH --gpus-per-node=", "srun ")
    assert all(line.startswith(counts) for line in readme ^ ours), readme ^ ours  # the README's job

    # the job, requeued in the middle of its second epoch
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PAUSE)
    paused, go_on = tmp_path / "paused", tmp_path / "go-on"
    requeued_env = dict(env, PYTHONPATH=str(site), HOOK_PAUSED=str(paused), HOOK_GO_ON=str(go_on))
    again = submit(job, requeued_env, work, tmp_path / "requeued.out")
    wait_until(paused.exists, 300, "the second epoch")
    subprocess.run(["scontrol", "requeue", again], env=env, check=True)
    out_file = tmp_path / "requeued.out"
    wait_until(lambda: "interrupted (SIGTERM)" in out_file.read_text(), 120, "the SIGTERM to stop the paused run")
    go_on.touch()
    wait_until(lambda: state(again, env) == "PENDING", 120, "the requeued job to wait")
    latest = json.loads(next((work / "checkpoints").glob("*/latest.json")).read_text())
    assert latest["epochs_done"] == 1 and latest["checkpoint"] == "epoch-0001.ckpt", latest  # the first epoch's
    # it starts again by itself, once the credential of its first start has expired (local_slurm.sh: cred_expire); a
    # start before that is refused ("Job credential revoked") and the job fails
    wait_until(lambda: state(again, env) in ("COMPLETED", "FAILED", "CANCELLED"), 300, "the requeued job")
    out = (tmp_path / "requeued.out").read_text()
    assert state(again, env) == "COMPLETED", out[-3000:]
    for rank in (0, 1):
        assert f"Process {rank} of 2, started by SLURM (job {again}, srun task {rank})." in out
    assert "interrupted (SIGTERM); the last checkpoint, checkpoints/" in out and "Traceback" not in out
    assert f"SLURM requeued job {again} (restart 1): continuing the run in checkpoints/" in out
    assert "1 of 2 epochs done" in out
    continued, uninterrupted = read_records(work / "results" / "runs.jsonl")[-1], smoke_runs("06_fabric-vit-mixed-fsdp.py").record
    assert continued["world_size"] == 2
    assert continued["train_loss"] == pytest.approx(uninterrupted["train_loss"], rel=1e-6)
    for key in ("val_acc", "test_acc", "lr"):
        assert continued[key] == uninterrupted[key], key

    # task counts that are not the flags': one line from the first task, exit 2
    mismatch = subprocess.run(["srun", "-N1", "-n2", "--ntasks-per-node=2", "python", "06_fabric-vit-mixed-fsdp.py",
                               "--smoke", "--devices", "1"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in mismatch.stderr.splitlines() if line.startswith("06_fabric-vit-mixed-fsdp.py: error:")]
    assert mismatch.returncode == 2 and len(lines) == 1, mismatch.stderr
    assert ("SLURM started 2 task(s) per machine on 1 machine(s) (--ntasks-per-node 2, --nodes 1), but the "
            "flags ask for --devices 1 --num-nodes 1") in lines[0]

    # one task (srun -n 1, sbatch --ntasks=1, which set no SLURM_NTASKS_PER_NODE) runs a lesson of one process
    one = subprocess.run(["srun", "-N1", "-n1", "python", "04_fabric-vit-mixed-precision.py", "--smoke", "--epochs", "1",
                          "--max-steps", "1"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 and "Run record appended" in one.stdout, one.stderr[-2000:]
    # and is refused for a lesson of two, in the words that started it
    one = subprocess.run(["srun", "-N1", "-n1", "python", "06_fabric-vit-mixed-fsdp.py", "--smoke"], cwd=work, env=env,
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 2 and "SLURM started 1 task(s) per machine on 1 machine(s) (--ntasks-per-node 1, --nodes " \
        "1), but the flags ask for --devices 2 --num-nodes 1" in one.stderr, one.stderr[-2000:]

    # srun --pty bash's job name, for several machines: what to do instead
    nodes = subprocess.run(["srun", "-N1", "-n1", "--job-name", "bash", "python", "06_fabric-vit-mixed-fsdp.py",
                            "--smoke", "--num-nodes", "2"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in nodes.stderr.splitlines() if line.startswith("06_fabric-vit-mixed-fsdp.py: error:")]
    assert nodes.returncode == 2 and len(lines) == 1, nodes.stderr
    assert "Inside `srun --pty bash` (SLURM job name 'bash') Lightning does not use SLURM: submit the job script with sbatch" in lines[0]


def test_under_srun_pty_bash_a_run_says_lightning_started_it(monkeypatch):
    """Inside `srun --pty bash` (SLURM's job name "bash"), Lightning ignores SLURM and starts the
    processes of one machine itself: the run works and its opening line says so."""
    from types import SimpleNamespace
    from run_keeping.keeper import opening_line
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    fabric = SimpleNamespace(strategy=SimpleNamespace(cluster_environment=type("LightningEnvironment", (), {})()))
    assert opening_line(fabric, 1, 2) == ("Process 1 of 2, started by Lightning, which started this machine's "
                                          "processes itself, inside SLURM job 41, whose name 'bash' makes "
                                          "Lightning ignore SLURM.")


@pytest.mark.parametrize("slurm, refused", [
    ({"SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}, None),  # srun -n 1, sbatch --ntasks=1: one process anywhere
    ({"SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, "SLURM started 2 tasks with --ntasks, which does not say how many "
                                                  "run on each machine: use #SBATCH --ntasks-per-node"),
    ({"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2"}, "SLURM gave this job 2 tasks, but this process was started "
                                                          "without srun, so it would wait for the others forever"),
    ({"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_ID": "0"},
     "SLURM started 2 task(s) per machine on 1 machine(s) (--ntasks-per-node 2, --nodes 1), but the flags ask for "
     "--devices 1 --num-nodes 1 (one process): make the two agree"),
])
def test_slurms_task_counts_against_a_lesson_of_one_process(slurm, refused, monkeypatch, capsys):
    """What SLURM's variables say it started, read as the flags are (the real SLURM above runs two of these rows):
    one task runs a lesson of one process; every other count is one line, exit 2, naming what to change."""
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    if refused is None:
        assert parse_as("04_fabric-vit-mixed-precision.py", "--smoke").world_size == 1
        return
    with pytest.raises(SystemExit) as stop:
        parse_as("04_fabric-vit-mixed-precision.py", "--smoke")
    assert stop.value.code == 2 and refused in capsys.readouterr().err
