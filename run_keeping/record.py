"""A run's two outputs: the record, one JSON line that a finished run appends to --results (reading.Record's fields,
in its order), and the model file, a state dict of torchvision's VisionTransformer. A failed write prints one line and
exits 1; each file is either whole or absent."""

import fcntl
import importlib.metadata
import io
import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

from run_keeping.config import NO_LOCKS, fail
from run_keeping.device import device_name

VERSION = 5  # 5 added settings by flag, data_parallel, precision_asked (reading.upgrade fills in older records)


def build(args, ran, compiled, measured):
    """A finished run's record: its settings (shared ones as top-level fields, the lesson's own flags under "settings"),
    the precision that ran, whether torch.compile wrapped the model, and what the keeper measured."""
    import torch

    record = {"record_version": VERSION, "script": args.script, "kind": args.kind or "full"}
    record |= {"accelerator": args.accelerator, "device_name": device_name(args.accelerator)}
    record |= {"devices": args.devices, "world_size": args.world_size, "data_parallel": args.data_parallel}
    record |= {"settings": args.own, "precision": ran, "precision_asked": args.precision_asked or ran}
    record |= {"compile_mode": (args.compile_mode or "default") if compiled else None}
    record |= {"model": "smoke ViT" if args.smoke else args.vit, "batch_size": args.batch_size}
    record |= {"micro_batches": args.micro_batches, "seed": args.seed, "max_steps": args.max_steps, **measured}
    record |= {"model_file": str(args.save_model)}
    record |= {"torch": torch.__version__, "lightning": importlib.metadata.version("lightning")}
    return record | {"timestamp": datetime.now(timezone.utc).isoformat()}


def append_record(path, record, then=""):
    """Appends `record` as one JSON line, in one write under a lock (the file stays JSONL); a failed write is undone."""
    line = (json.dumps(record) + "\n").encode()
    then = f" {then}" if then else ""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as err:
        fail(f"cannot write the run record to {path}: {err.strerror}.{then}", code=1)
    size = None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # appenders in other processes wait here
        except OSError as err:  # no locks on this file system: the one O_APPEND write below still adds the line whole
            if err.errno not in NO_LOCKS:  # (unless another machine appends at the same moment)
                raise
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        if os.write(fd, line) != len(line):
            raise OSError(28, "No space left on device")
    except OSError as err:
        if size is not None:
            os.ftruncate(fd, size)
        fail(f"cannot write the run record to {path}: {err.strerror}; the earlier records are as they were.{then}", 1)
    finally:
        os.close(fd)  # and with it the lock


def write_whole(path, data):
    """Writes `data` (bytes, or an object for torch.save) to `path` in full, looping on os.write, then fsyncs it."""
    if not isinstance(data, bytes):
        import torch

        buffer = io.BytesIO()
        torch.save(data, buffer)
        data = buffer.getvalue()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path, data, then="nothing else was changed"):
    """Writes `data` to `path`.tmp, then renames it to `path`; on failure, prints one line ending in `then`, exits 1."""
    path = Path(path)
    partial = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(partial, data)
        os.replace(partial, path)
    except OSError as err:
        partial.unlink(missing_ok=True)
        fail(f"cannot write {path}: {err.strerror}; {then}.", code=1)


def why_unloadable(error):
    """Returns (what torch.load found wrong with a file, minus torch's unsafe advice to pass weights_only=False; whether
    the file is whole: written by torch.save, but with contents that do not fit, rather than truncated or foreign)."""
    text = str(error)
    if "Weights only load failed" in text:
        if found := re.search(r"Unsupported global: GLOBAL ([\w.]+)", text):
            return f"it holds a {found.group(1)} object, not only tensors", True
        return "it is not a file that torch.save wrote", False
    if "failed finding central directory" in text or "PytorchStreamReader" in text:
        return "it is cut short or damaged (not a whole file that torch.save wrote)", False
    return f"{type(error).__name__}: {first_line(text)}", True


def first_line(text, limit=300):
    """The first line of `text`, cut at a word's end past `limit` characters."""
    line = (str(text).strip().splitlines() or [""])[0]
    end = line.rfind(" ", 0, limit)  # a word's end; a line of no spaces (a path, a URL) is cut at the limit
    return line if len(line) <= limit else line[: end if end > 0 else limit] + " ..."


def peak_memory_gb(accelerator):
    """Peak memory in GB. GPU: torch.cuda.max_memory_reserved (the talk's figure); CPU: peak resident memory (VmHWM)."""
    if accelerator == "cuda":
        import torch

        return torch.cuda.max_memory_reserved() / 1e9
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024 / 1e9
