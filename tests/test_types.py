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
