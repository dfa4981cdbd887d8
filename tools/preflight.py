"""Before a long check on a new machine: is every module the suite's scripts and tools import
there? Imports each (torch and Lightning take seconds), and for each that fails names the
module that is missing (watermark, say, lacks IPython) and the wheel that brings it, in one
line: exit 4 if any is missing (gpu_check.sh documents the code), 0 if none.

    python tools/preflight.py                # --count-gpus: then print how many GPUs torch sees

Uses nothing but Python's own library until it imports the suite's.
"""
import ast
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MISSING = 4
# Modules whose wheel has another name (pip install <wheel>).
WHEELS = {"IPython": "ipython", "sklearn": "scikit-learn", "PIL": "pillow", "yaml": "pyyaml",
          "lightning_utilities": "lightning-utilities", "google": "protobuf"}


def imported_modules(root=ROOT):
    """The top-level modules the suite's own Python files import (not its tests), less Python's
    own library and the suite's modules."""
    files = [*root.glob("*.py"), *root.glob("run_keeping/*.py")]
    ours = {p.stem for p in files} | {"run_keeping"}
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return sorted(found - ours - set(sys.stdlib_module_names))


def missing(modules):
    """{module the suite imports: the module that is not there} for each that fails to import."""
    absent = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            absent[module] = err.name or module
    return absent


def verdict(absent):
    """The one line for what is missing, or None."""
    if not absent:
        return None
    wheels = sorted({WHEELS.get(name.split(".")[0], name.split(".")[0]) for name in absent.values()})
    what = ", ".join(f"{module}" + (f" (it needs {name})" if name.split(".")[0] != module else "")
                     for module, name in sorted(absent.items()))
    return (f"missing: {what}. Install the wheels {' '.join(wheels)} (pip install {' '.join(wheels)}, "
            "or carry their wheel files to a machine without internet) and run again.")


def main():
    line = verdict(missing(imported_modules()))
    if line:
        print(f"preflight: error: {line}", file=sys.stderr)
        sys.exit(MISSING)
    print("preflight: every module the scripts import is there.", file=sys.stderr)
    if "--count-gpus" in sys.argv:  # as the scripts count them (CUDA_VISIBLE_DEVICES limits it)
        import torch
        print(torch.cuda.device_count() if torch.cuda.is_available() else 0)


if __name__ == "__main__":
    main()
