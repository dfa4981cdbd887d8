"""Files that are whole or absent: written beside their final name and renamed into place,
records appended in one write; a failed write says which file and why in one line (exit 1)."""
import json
import os
import shutil
from pathlib import Path

from run_keeping.errors import fail


def unwritable(path):
    """Why `path` cannot be written, or None; creates nothing (a file, or the folders to come)."""
    path = Path(path).absolute()
    if path.is_dir():
        return "it is a folder"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    target = path if path.exists() else parent
    return None if os.access(target, os.W_OK) else f"permission denied on {target}"


def write_error(err, path):
    """The system's reason a write failed: torch reports a full disk as a RuntimeError."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    try:
        if shutil.disk_usage(Path(path).parent).free < 64 * 2**20:
            return "No space left on device"
    except OSError:
        pass
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def write_atomically(path, data, replace=True):
    """`data` to `path`: written beside it and renamed into place (replace=False: written to
    `path` itself), so the file is whole or absent. A failed write: one line, exit 1."""
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
        fail(f"cannot write {path}: {write_error(err, path)}; nothing else was changed.", code=1)


def append_record(path, record):
    """One JSON line, appended in one write, so the file stays valid JSONL even if the process is
    killed; a failed write is cut off again, leaving the earlier records as they were."""
    line = (json.dumps(record) + "\n").encode()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as err:
        fail(f"cannot write the run record to {path}: {write_error(err, path)}.", code=1)
    size = os.fstat(fd).st_size
    try:
        if os.write(fd, line) != len(line):
            raise OSError(28, "No space left on device")
    except OSError as err:
        os.ftruncate(fd, size)
        fail(f"cannot write the run record to {path}: {write_error(err, path)}; the earlier "
             "records are as they were.", code=1)
    finally:
        os.close(fd)


def read_records(path, skip=None, numbered=False):
    """The JSON objects of a JSONL file (numbered: as (line number, record) pairs). A bad line
    raises ValueError, or with `skip` given is passed to skip(line_number, why) and left out."""
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


def record_of(model_file, results):
    """The newest run record in `results` that saved `model_file`, or None."""
    try:
        records = read_records(results)
    except (OSError, ValueError):
        return None
    wanted = Path(model_file).resolve()
    return next((r for r in reversed(records)
                 if r.get("model_file") and Path(r["model_file"]).resolve() == wanted), None)


def remove(path):
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_empty_folders(path, up_to):
    """Remove `path`, then each parent of it below `up_to`, while it is an empty folder."""
    path, up_to = Path(path).absolute(), Path(up_to).absolute()
    while up_to in path.parents and path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        path = path.parent
