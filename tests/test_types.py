"""The type checker (ty, ty.toml): every Python file of the project, tests included, at 0 errors.
It is the one check the GPU-only branches get on a machine without a GPU (docs/tests.md)."""
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_ty_finds_no_error():
    ty = shutil.which("ty") or str(Path(sys.executable).parent / "ty")
    # warnings are shown, not failed: the sharded lessons' L.fabric.strategies, imported by `import lightning`
    proc = subprocess.run([ty, "check", "--exit-zero-on-warning", "--output-format", "concise"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stdout.splitlines() if "error[" in line]
    assert proc.returncode == 0 and not errors, "\n".join(errors) or proc.stdout[-3000:] + proc.stderr[-2000:]


PLANTED = "\n\ndef _planted() -> int:\n    return 'not a number'  # a type error ty must report\n"


def test_ty_checks_every_file_of_the_project(tmp_path):
    """ty.toml leaves no file out: in a copy of the project with a type error planted in one file of each
    folder (a lesson, 08, the tools, the benchmarks, run_keeping, the tests), ty reports every one."""
    copy = tmp_path / "project"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", "results", "models", "checkpoints",
                                                              "reference", "smoke_weights", "docs"))
    files = ["04_fabric-vit-mixed-precision.py", "08_load-and-evaluate.py", "plot_results.py", "tools/figures.py",
             "benchmarks/memory.py", "run_keeping/keeper.py", "tests/test_types.py", "tests/conftest.py"]
    for name in files:
        with open(copy / name, "a") as f:
            f.write(PLANTED)
    ty = shutil.which("ty") or str(Path(sys.executable).parent / "ty")
    proc = subprocess.run([ty, "check", "--exit-zero-on-warning", "--output-format", "concise"], cwd=copy,
                          capture_output=True, text=True, timeout=120)
    reported = {line.split(":")[0] for line in proc.stdout.splitlines() if "error[" in line}
    assert reported == set(files), (set(files) - reported, proc.stdout[-2000:])
