"""Files that are whole or absent (written beside their name and renamed into place), records
appended in one write, a run's hold on its folder; a failed write is one line (exit 1). Markdown
tables and reports for the tools. Imports no torch.
"""
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from run_keeping import fail

LOCK = ".lock"  # held by the run in progress in a checkpoint folder, and naming it


def unwritable(path, folder=False):
    """Why `path` cannot be written (a file, or a folder with folder=True), or None; leaves nothing
    behind."""
    path = Path(path).absolute()
    if path.is_dir() and not folder:
        return "it is a folder"
    if path.exists() and not path.is_dir() and folder:
        return "it is a file, not a folder"
    parent = path if path.is_dir() else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a folder"
    target = path if path.exists() else parent
    if os.access(target, os.W_OK):
        if not target.is_dir():
            return None
        try:  # access() answers from the permission bits; some folders (/proc, /sys) refuse all the same
            fd, probe = tempfile.mkstemp(dir=target, prefix=".write-check-")
            os.close(fd)
            os.unlink(probe)
            return None
        except OSError as err:
            if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                return f"{target} takes no new files ({err.strerror})"
    try:
        read_only = os.statvfs(target).f_flag & os.ST_RDONLY
    except OSError:
        read_only = False
    return f"{target} is on a read-only file system" if read_only else f"permission denied on {target}"


def write_error(err, path):
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    try:
        if shutil.disk_usage(Path(path).parent).free < 64 * 2**20:
            return "No space left on device"
    except OSError:
        pass
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def write_atomically(path, data, replace=True, then="nothing else was changed"):
    """`data` to `path`, written beside it and renamed into place (replace=False: to `path` itself). A
    failed write: one line, exit 1, ending in `then` (what was kept, how to go on)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp") if replace else path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
    except OSError as err:
        remove(tmp)
        fail(f"cannot write {path}: {write_error(err, path)}; {then}.", code=1)


def append_record(path, record, then=""):
    """One JSON line appended in one write under a lock, so the file stays valid JSONL (after a half-
    written last line too); a failed write is cut off again."""
    line = (json.dumps(record) + "\n").encode()
    then = f" {then}" if then else ""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as err:
        fail(f"cannot write the run record to {path}: {write_error(err, path)}.{then}", code=1)
    size = None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # appenders in other processes wait here
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        if os.write(fd, line) != len(line):
            raise OSError(28, "No space left on device")
    except OSError as err:
        if size is not None:
            os.ftruncate(fd, size)
        fail(f"cannot write the run record to {path}: {write_error(err, path)}; the earlier "
             f"records are as they were.{then}", code=1)
    finally:
        os.close(fd)  # and with it the lock


def read_records(path, skip=None, numbered=False):
    """The JSON objects of a JSONL file; a bad line raises ValueError, or is passed to
    skip(line_number, why)."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            if skip is None:
                raise
            skip(number, "not a JSON object" if "JSON object" in str(err) else "not JSON")
            continue
        records.append((number, record) if numbered else record)
    return records


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def remove(path):
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_empty_folders(path, up_to):
    path, up_to = Path(path).absolute(), Path(up_to).absolute()
    while up_to in path.parents and path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        path = path.parent


class FolderLock:
    """A run's hold on its folder: an flock on its .lock, which the system lets go of however the
    process ends, naming the holder for the run it refuses."""

    def __init__(self, folder):
        self.path = Path(folder) / LOCK
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(self.fd, 400, 0).decode(errors="replace").strip()
                os.close(self.fd)
                fail(f"a run is in progress in {folder} ({holder or 'another process'}): wait for it to "
                     "finish, or give this one another --checkpoint-dir to run beside it.")
            try:  # not a file the run before removed as this one opened it
                if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(self.fd)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"process {os.getpid()} on {socket.gethostname()}, since "
                          f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC".encode())

    def release(self):
        remove(self.path)
        os.close(self.fd)


def markdown_table(header, rows):
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header),
            *(f"| {' | '.join(str(cell) for cell in row)} |" for row in rows)]


def fmt(value, pattern):
    return "-" if value is None else pattern.format(value)


def write_report(path, text):
    write_atomically(path, (text.rstrip("\n") + "\n").encode(), then="the report is still printed above")
