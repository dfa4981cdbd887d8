"""Every value a user can type: each flag of every script's and tool's --help, given a wrong value
of each kind argparse itself refuses for it, found from the flag's own declaration (a switch given
a value, no value, a choice it does not have, each value its type refuses: a word for a number, a
fraction, a number below its least or outside its range), and of each kind of path or value its
metavar names (a folder where a file goes, a file where a folder goes, a path under a file, a
read-only place), ends in one line and exit 2, before any work: the scripts run in this process up
to their first step past the command line, where a tripwire stops them if a value got through."""
import argparse
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, parse_as

import benchmark
import make_smoke_weights
import plot_results


SCRIPTS = sorted(p.name for p in ROOT.glob("[0-9][0-9]_*.py"))
TOOLS = {"benchmark.py": benchmark.parse_args, "plot_results.py": plot_results.main,
         "make_smoke_weights.py": make_smoke_weights.main}
# Flags a smoke run refuses, so their wrong values are tried on a full run (on the CPU)
FULL_RUN_ONLY = {"--num-workers", "--data-dir", "--no-download", "--vit"}
# Paths a program only reads: a read-only place is right for them, a missing file wrong
READ = {("08_load-and-evaluate.py", "--results"), ("08_load-and-evaluate.py", "--model"),
        ("plot_results.py", "--results"), ("plot_results.py", "--log")}


class Accepted(Exception):
    """Raised where a script goes past its command line: a wrong value was taken."""


@pytest.fixture
def tripwires(monkeypatch):
    import lightning
    import run_keeping.keeper

    def tripped(*args, **kwargs):
        raise Accepted("a wrong value got past the command line")
    monkeypatch.setattr(lightning.Fabric, "__init__", tripped)
    monkeypatch.setattr(run_keeping.keeper.RunKeeper, "__init__", tripped)
    monkeypatch.setattr(make_smoke_weights, "digit_fonts", tripped)


def flags_of(help_text):
    """{flag: what it takes (its metavar or {choices}), or None for a switch}."""
    found = {}
    for line in help_text.splitlines():
        match = re.match(r"^  (--[a-z][\w-]*)(?: (\S+))?", line)
        if match and match[1] != "--help":
            found[match[1]] = match[2]
    return found


@pytest.fixture
def places(tmp_path):
    """Paths of each wrong kind: a file, a folder, a path under a file, one on a read-only
    file system (where this machine can mount one)."""
    a_file, a_folder = tmp_path / "a-file", tmp_path / "a-folder"
    a_file.write_text("not what the flag wants\n")
    a_folder.mkdir()
    found = {"file": str(a_file), "folder": str(a_folder), "under a file": str(a_file / "x")}
    if Path("/proc/self").is_dir():  # Linux's /proc: root's permission bits say yes, yet it takes no file
        found["takes no files"] = "/proc/suite-check"
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)],
                      capture_output=True).returncode == 0:
        found["read-only"] = str(read_only / "x")
    yield found
    subprocess.run(["umount", str(read_only)], capture_output=True)


def elsewhere(places):
    """The places this machine has that no flag can write to: read-only, and taking no files."""
    return [(kind, places[kind]) for kind in ("read-only", "takes no files") if kind in places]


# Values tried on each flag's type: it is given each that its type refuses, one per kind of refusal
PROBES = [("a word", "abc"), ("a fraction", "1.5"), ("below zero", "-1"), ("zero", "0"), ("one", "1"),
          ("very large", "1000000000000"), ("not a number", "nan"), ("infinite", "inf"), ("empty", "")]
NO_VALUE = object()  # the flag given last, without the value it takes


def refused_by_type(action):
    """(why, value) for each kind of value the action's type refuses, as argparse would call it: one value
    per distinct refusal (the type's message with the value left out)."""
    if action.type is None or isinstance(action.type, argparse.FileType):
        return []
    found = {}
    for why, value in PROBES:
        try:
            action.type(value)
        except Exception as error:  # argparse's refusal (or a traceback the test then shows)
            said = re.sub(r"'[^']*'|-?\d[\d.,e+]*|nan|inf", "", str(error))
            found.setdefault((type(error), said), (f"{why}, refused by its type", value))
    return list(found.values())


def not_a_choice(action):
    """A value the action's type takes that is none of its choices."""
    numbers = [c for c in action.choices if isinstance(c, (int, float)) and not isinstance(c, bool)]
    for value in ("bogus", *([str(max(numbers) + 1)] if numbers else [])):
        try:
            converted = action.type(value) if action.type else value
        except Exception:
            continue
        if converted not in action.choices:
            return [("no such choice", value)]
    return []


def wrong_values(action, places, read=False):
    """(why it is wrong, the value) for each kind of wrong value the flag takes: from its declaration
    (a switch, its nargs, choices and type), and the kinds of path or value its metavar names."""
    if action.nargs == 0:
        return [("a switch given a value", None)]
    wrong = [("no value", NO_VALUE)] if action.nargs not in ("?", "*") else []
    if action.choices is not None:
        wrong += not_a_choice(action)
    wrong += refused_by_type(action)
    takes = action.metavar if isinstance(action.metavar, str) else ""
    if read:
        return wrong + [("a folder", places["folder"]), ("under a file", places["under a file"])] + \
            ([("missing", places["folder"] + "/none.jsonl")] if action.dest != "results" else [])
    if takes == "DIR":
        wrong += [("a file", places["file"]), ("under a file", places["under a file"])] + elsewhere(places)
    elif takes in ("FILE", "PATH", "PNG"):
        wrong += [("a folder", places["folder"]), ("under a file", places["under a file"])] + elsewhere(places)
    elif takes.startswith("IMAGE"):
        wrong += [("missing", places["folder"] + "/none.png"), ("not an image", places["file"])]
    elif takes.startswith("NN"):
        wrong += [("no such script", "99"), ("a word for a batch", "01@x")]
    elif takes.startswith("PRECISION"):
        wrong += [("no precision", "bogus=5"), ("a word for a number", "bf16-mixed=abc")]
    return wrong


def help_of(program, capsys, monkeypatch):
    """Its --help, and the parser that printed it (the last that parsed: a program may parse twice)."""
    parsers = []
    parse = argparse.ArgumentParser.parse_known_args

    def parse_and_keep(parser, *args, **kwargs):
        parsers.append(parser)
        return parse(parser, *args, **kwargs)
    monkeypatch.setattr(sys, "argv", [program, "--help"])
    with monkeypatch.context() as patched:
        patched.setattr(argparse.ArgumentParser, "parse_known_args", parse_and_keep)
        with pytest.raises(SystemExit) as exit_info:
            run(program, ["--help"])
    assert exit_info.value.code == 0 and parsers, program
    return capsys.readouterr().out, parsers[-1]


def flags_declared(parser):
    """{flag: its action} for each flag --help shows, by its first long name."""
    return {next(s for s in action.option_strings if s.startswith("--")): action for action in parser._actions
            if action.option_strings and not isinstance(action, argparse._HelpAction)
            and action.help != argparse.SUPPRESS}


def run(program, argv):
    if program in TOOLS:
        return TOOLS[program](argv)
    sys.argv = [str(ROOT / program), *argv]
    runpy.run_path(str(ROOT / program), run_name="__main__")


def base_flags(program, flag):
    """What the wrong value goes with, so that it is what stops the run."""
    if program in TOOLS or program.startswith("08"):
        return ["--smoke"] if program.startswith("08") and flag not in ("--data-dir", "--no-download", "--num-workers") else []
    return ["--accelerator", "cpu"] if flag in FULL_RUN_ONLY else ["--smoke"]


@pytest.mark.parametrize("program", [*SCRIPTS, *TOOLS])
def test_every_wrong_value_of_every_flag_is_one_line(program, tripwires, places, capsys, monkeypatch):
    monkeypatch.chdir(places["folder"])
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    shown, parser = help_of(program, capsys, monkeypatch)
    flags = flags_declared(parser)
    assert flags and set(flags_of(shown)) <= set(flags), (program, set(flags_of(shown)) - set(flags))
    tried = set()
    for flag, action in flags.items():  # a lesson's own flags too: their wrong values from their declaration
        for why, value in wrong_values(action, places, read=(program, flag) in READ):
            argv = [*base_flags(program, flag), f"{flag}=yes" if value is None else flag,
                    *([] if value is None or value is NO_VALUE else [value])]
            if flag == "--predict":
                argv = ["--predict", *([] if value is NO_VALUE else [value])]
            try:
                with pytest.raises(SystemExit) as exit_info:
                    run(program, argv)
            except Accepted:
                pytest.fail(f"{program} {' '.join(argv)}: taken ({why})", pytrace=False)
            err = capsys.readouterr().err
            lines = [line for line in err.splitlines() if line.strip()]
            assert exit_info.value.code == 2, (program, argv, why, err)
            assert len(lines) == 1 and "Traceback" not in err, (program, argv, why, err)
            assert lines[0].startswith(f"{program}: error: "), (program, argv, lines)
            tried.add(flag)
    # a flag that takes any text, or none (nargs "?" or "*", no type, no choices), has no value argparse refuses
    takes_anything = {flag for flag, action in flags.items() if not wrong_values(action, places)}
    assert tried | takes_anything == set(flags), set(flags) - tried - takes_anything


def test_a_read_only_place_is_named_so_before_any_work(tmp_path, places, capsys, monkeypatch):
    """--checkpoint-dir, --results and --save-model on a read-only file system: said so in one
    line, exit 2, before a step is trained (not a traceback at the first checkpoint, nor
    'permission denied')."""
    if "read-only" not in places:
        pytest.skip("this machine cannot mount a read-only file system for the test")
    for flag in ("--checkpoint-dir", "--results", "--save-model"):
        with pytest.raises(SystemExit) as exit_info:
            parse_as("01_pytorch-vit.py", "--smoke", flag, places["read-only"])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"{flag} {places['read-only']} cannot be written: " in err and "is on a read-only file system" in err


def test_a_cifar10_already_on_a_read_only_file_system_is_only_read(tmp_path, capsys):
    """--data-dir on a read-only file system: where CIFAR-10's files all are, the run only reads them (torchvision
    checks them and downloads nothing), so it is not refused; where one is missing (a copy or an unpacking cut short),
    or none is there, its download could not be written: refused in one line, before any work."""
    from torchvision.datasets import CIFAR10

    from run_keeping.config import CIFAR10_FILES

    # the files torchvision checks before it would download, and the list of them the run reads
    assert set(CIFAR10_FILES) == {name for name, _ in CIFAR10.train_list + CIFAR10.test_list} | {CIFAR10.meta["filename"]}

    mounted = tmp_path / "mounted"
    mounted.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mounted)]
    if shutil.which("mount") is None or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("this machine cannot mount a file system for the test")
    try:
        for folder, files in (("downloaded", CIFAR10_FILES), ("cut-short", CIFAR10_FILES[:-1]), ("empty", ())):
            (mounted / folder / "cifar-10-batches-py").mkdir(parents=True)
            for name in files:
                (mounted / folder / "cifar-10-batches-py" / name).write_bytes(b"")
        if subprocess.run(["mount", "-o", "remount,ro", str(mounted)], capture_output=True).returncode:
            pytest.skip("this machine cannot make the test's file system read-only")
        assert parse_as("01_pytorch-vit.py", "--accelerator", "cpu", "--data-dir", str(mounted / "downloaded"))
        for folder in ("cut-short", "empty"):
            with pytest.raises(SystemExit) as exit_info:
                parse_as("01_pytorch-vit.py", "--accelerator", "cpu", "--data-dir", str(mounted / folder))
            err = capsys.readouterr().err.strip()
            assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "read-only file system" in err, err
    finally:
        subprocess.run(["umount", str(mounted)], capture_output=True)


def test_each_place_is_tried_as_the_run_writes_it(tmp_path):
    """The model file is written beside itself and renamed into place, so its folder is what must take a file: a
    writable model file in a folder that takes none is refused before any work, and a read-only one in a folder that
    does is not. The record is appended to the file in place, so an existing --results file is tried by its own
    permission. (As root, run without the capability that passes every permission check.)"""
    import shutil
    closed, open_ = tmp_path / "closed", tmp_path / "open"
    for folder, mode in ((closed, 0o555), (open_, 0o755)):
        folder.mkdir()
        for name, file_mode in (("model.pt", 0o666), ("read-only.pt", 0o444), ("runs.jsonl", 0o666),
                                ("read-only.jsonl", 0o444)):
            (folder / name).touch(mode=file_mode)
            (folder / name).chmod(file_mode)
        folder.chmod(mode)
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("as root, the test needs setpriv (util-linux) to give up passing every permission check")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--inh-caps", "-all"]
    code = "import sys\nsys.argv = ['04_fabric-vit-mixed-precision.py']\nfrom run_keeping.config import check_path\n"
    expected = {("--save-model", closed / "model.pt", False): "Permission denied",
                ("--save-model", open_ / "read-only.pt", False): None,
                ("--results", closed / "runs.jsonl", True): None,
                ("--results", open_ / "read-only.jsonl", True): "Permission denied"}
    try:
        for (flag, path, in_place), refused in expected.items():
            call = f"check_path({flag!r}, {str(path)!r}, in_place={in_place})"
            proc = subprocess.run([*prefix, sys.executable, "-c", f"{code}{call}"], cwd=ROOT, capture_output=True,
                                  text=True, timeout=60)
            if refused:
                assert proc.returncode == 2 and f"{flag} {path} cannot be written: {refused}" in proc.stderr, proc
            else:
                assert proc.returncode == 0 and not proc.stderr, (flag, path, proc.stderr)
    finally:
        closed.chmod(0o755)
