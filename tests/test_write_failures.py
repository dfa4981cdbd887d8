"""A full disk or a refused write: one line naming the file and the system's reason, exit 1,
the half-written file removed, and everything written before untouched."""
import errno
import os
import subprocess

import pytest

from run_keeping.keeper import LATEST
from run_keeping.record import append_record, write_atomically
from conftest import ROOT, read_records, run_script, script_env

EARLIER = '{"script": "00_pytorch-vit-random-init.py", "test_acc": 0.6285}\n'


def failing_write(monkeypatch, after_bytes=10):
    """os.write that writes `after_bytes`, then fails as a full disk does."""
    real = os.write
    written = [0]

    def write(fd, data):
        if written[0] >= after_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real(fd, bytes(data)[:after_bytes - written[0]])
        written[0] += n
        return n
    monkeypatch.setattr(os, "write", write)


def test_a_failed_file_write_leaves_the_old_file_and_no_part(tmp_path, monkeypatch, capsys):
    path = tmp_path / "models" / "m.pt"
    path.parent.mkdir()
    path.write_bytes(b"the model from before")
    failing_write(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        write_atomically(path, b"x" * 1000)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"cannot write {path}: No space left on device" in err
    assert path.read_bytes() == b"the model from before"
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.pt"]


def test_a_failed_record_append_leaves_the_earlier_records(tmp_path, monkeypatch, capsys):
    path = tmp_path / "runs.jsonl"
    path.write_text(EARLIER)
    failing_write(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        append_record(path, {"script": "01_pytorch-vit.py", "losses": list(range(100))})
    assert exit_info.value.code == 1
    assert "cannot write the run record" in capsys.readouterr().err
    assert path.read_text() == EARLIER  # the half-written line is cut off again


def test_a_folder_lock_taken_as_the_run_before_lets_go_holds_the_file_that_is_there(tmp_path, monkeypatch):
    """The run before removes its .lock as it lets go of it: a run that opened that file just
    before and locks it then would hold a file no longer in the folder. It opens the folder's
    .lock again, so the run after it finds the folder held, and by whom."""
    from run_keeping import keeper as files
    flock, locked = files.fcntl.flock, []

    def as_the_run_before_lets_go(fd, operation):
        flock(fd, operation)
        if not locked:  # the first lock taken: on the file the run before removes now
            locked.append(fd)
            os.unlink(tmp_path / ".lock")
    monkeypatch.setattr(files.fcntl, "flock", as_the_run_before_lets_go)
    held = files.FolderLock(tmp_path)
    monkeypatch.undo()
    assert locked and f"process {os.getpid()} on " in (tmp_path / ".lock").read_text()
    with pytest.raises(SystemExit):  # the next run is refused: another open file, the same lock
        files.FolderLock(tmp_path)
    held.release()
    assert not (tmp_path / ".lock").exists()


def test_a_record_waits_for_the_lock_of_another_appender(tmp_path):
    """Appending takes the file's lock first: while another appender holds it (a run in another
    process), the record waits, and goes in after the lock is let go."""
    import fcntl
    import threading
    path = tmp_path / "runs.jsonl"
    path.write_text(EARLIER)
    with open(path, "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)  # a separate open file: flock holds it against this process too
        appending = threading.Thread(target=append_record, args=(path, {"script": "01_pytorch-vit.py"}))
        appending.start()
        appending.join(timeout=0.5)
        assert appending.is_alive() and path.read_text() == EARLIER  # still waiting for the lock
        fcntl.flock(other, fcntl.LOCK_UN)
    appending.join(timeout=10)
    assert not appending.is_alive()
    assert path.read_text() == EARLIER + '{"script": "01_pytorch-vit.py"}\n'


def test_a_record_is_one_write(tmp_path, monkeypatch):
    path = tmp_path / "runs.jsonl"
    path.write_text(EARLIER)
    writes = []
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(len(data)) or real(fd, data))
    append_record(path, {"script": "x", "values": list(range(1000))})
    assert len(writes) == 1 and path.read_text().count("\n") == 2


FULL_DISK_AT = """
import errno, os
_write = os.write
def write(fd, data):
    if os.readlink(f"/proc/self/fd/{fd}").endswith(os.environ["HOOK_FULL_DISK_AT"]):
        _write(fd, bytes(data)[:100])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _write(fd, data)
os.write = write
"""


@pytest.mark.slow
@pytest.mark.parametrize("target, names, kept", [
    ("epoch-0002.ckpt.tmp", "checkpoints/01_pytorch-vit-smoke-max-steps10/epoch-0002.ckpt.tmp",
     "the last good checkpoint (checkpoints/01_pytorch-vit-smoke-max-steps10/epoch-0001.ckpt) is untouched"),
    ("01_pytorch-vit-smoke-max-steps10.pt.tmp", "models/01_pytorch-vit-smoke-max-steps10.pt",
     "the checkpoint of the finished training is kept in checkpoints/01_pytorch-vit-smoke-max-steps10"),
    ("runs.jsonl", "the run record to results/runs.jsonl",
     "The model is saved in models/01_pytorch-vit-smoke-max-steps10.pt, and the checkpoint of the finished training is kept"),
])
def test_full_disk_during_a_run(tmp_path, target, names, kept):
    """01 --smoke with the disk 'full' at the second checkpoint, the model file or the record:
    one line naming the file, the reason, what was kept and the command that goes on; that
    command, run as printed once there is room, finishes the run with its record."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FULL_DISK_AT)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "runs.jsonl").write_text(EARLIER)
    env = script_env(tmp_path, PYTHONPATH=str(site), HOOK_FULL_DISK_AT=target)
    proc = run_script("01_pytorch-vit.py", "--smoke", "--max-steps", "10", cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"cannot write {names}" in errors[0]
    assert "No space left on device" in errors[0] and kept in errors[0], errors[0]
    assert (tmp_path / "results" / "runs.jsonl").read_text() == EARLIER
    assert not list(tmp_path.rglob("*.tmp"))
    ckpt = tmp_path / "checkpoints" / "01_pytorch-vit-smoke-max-steps10"
    if target.startswith("epoch"):  # the last good checkpoint stays, to resume from
        assert sorted(p.name for p in ckpt.iterdir()) == ["epoch-0001.ckpt", LATEST]
    else:  # the run finished training; its last checkpoint stays until the files are written
        assert (ckpt / LATEST).exists()
    command = errors[0].rsplit(": ", 1)[1].rstrip(".")
    assert command == f"python {ROOT / '01_pytorch-vit.py'} --smoke --max-steps 10 --resume", errors[0]
    if not target.endswith(".pt.tmp"):
        return  # a checkpoint's is a plain --resume, and the record's the model file's (run below)
    went_on = subprocess.run(["bash", "-c", command],
                             cwd=tmp_path, env=script_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert went_on.returncode == 0, went_on.stderr[-3000:]
    record = read_records(tmp_path / "results" / "runs.jsonl")[-1]
    assert "Resuming from" in went_on.stdout and len(record["train_loss"]) == 2 and not ckpt.exists()


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 9 MB filesystem (tmpfs; needs root, as here and in CI): room for one smoke
    checkpoint (about 6 MB) and not for the next beside it."""
    import subprocess
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["01_pytorch-vit.py", "03_fabric-vit.py"])  # torch / fabric.save
def test_a_full_filesystem_at_the_second_checkpoint(tmp_path, small_filesystem, script):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "runs.jsonl").write_text(EARLIER)
    ckpt = small_filesystem / "ck"
    proc = run_script(script, "--smoke", "--max-steps", "10", "--checkpoint-dir", str(ckpt), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"{ckpt}/epoch-0002.ckpt.tmp: No space left on device" in errors[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch-0001.ckpt", LATEST]  # disk freed
    assert (tmp_path / "results" / "runs.jsonl").read_text() == EARLIER
