"""Before a long check on a new machine: is every module the suite's scripts and tools import
there? Imports each and names every missing package at once (the installed packages' own
requirements walked too: watermark, say, lacks IPython), then one line, exit 4, with the commands
that install them, also on a machine without internet (pip download there, carried here). Uses
nothing but Python's own library until it imports the suite's.

    python tools/preflight.py
"""
import ast
import importlib
import importlib.metadata
import re
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MISSING = 4
# Modules whose wheel has another name (pip install <wheel>).
WHEELS = {"IPython": "ipython", "sklearn": "scikit-learn", "PIL": "pillow", "yaml": "pyyaml",
          "lightning_utilities": "lightning-utilities", "google": "protobuf"}


def imported_modules(root=ROOT):
    """The top-level modules the suite's own files import, less Python's library and the suite's."""
    files = [*root.glob("*.py"), *root.glob("run_keeping/*.py"), *root.glob("benchmarks/*.py")]
    ours = {p.stem for p in files} | {"run_keeping", "benchmarks"}
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


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def needed(requirement):
    """A Requires-Dist line's package, or None where its markers leave it out here."""
    name = re.split(r"[^A-Za-z0-9._-]", requirement, maxsplit=1)[0]
    if ";" not in requirement:
        return name
    try:
        from packaging.requirements import Requirement
        marker = Requirement(requirement).marker
        return name if marker is None or marker.evaluate({"extra": ""}) else None
    except ImportError:
        return None


def missing_requirements(wheels):
    """The packages the installed ones among `wheels` require, recursively, that are not installed."""
    seen, todo, absent = set(), list(wheels), set()
    while todo:
        name = todo.pop()
        if canonical(name) in seen:
            continue
        seen.add(canonical(name))
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            absent.add(canonical(name))
            continue
        todo += [n for n in map(needed, requires) if n]
    return absent


def verdict(absent):
    if not absent:
        return None
    first = {canonical(WHEELS.get(name.split(".")[0], name.split(".")[0])) for name in absent.values()}
    wheels = sorted(first | missing_requirements([*first, *{WHEELS.get(m, m) for m in absent}]))
    what = ", ".join(f"{module}" + (f" (it needs {name})" if name.split(".")[0] != module else "")
                     for module, name in sorted(absent.items()))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    platform = sysconfig.get_platform().replace("linux-", "manylinux2014_").replace("-", "_").replace(".", "_")
    names = " ".join(wheels)
    return (f"missing: {what}; the packages to install: {names}. With internet here: pip install {names}. "
            f"Without: on a machine with internet, pip download --only-binary=:all: --python-version {version} "
            f"--platform {platform} -d wheels {names} (it fetches what they need too); carry the wheels "
            f"folder here, then: pip install --no-index --find-links wheels {names}")


def main():
    line = verdict(missing(imported_modules()))
    if line:
        print(f"preflight: error: {line}", file=sys.stderr)
        sys.exit(MISSING)
    print("preflight: every module the scripts import is there.", file=sys.stderr)


if __name__ == "__main__":
    main()
