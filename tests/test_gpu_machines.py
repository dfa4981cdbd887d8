"""The first line a GPU user sees, on every shape of machine (docs/gpu-setup.md): the GPUs nvidia-smi lists, what
torch sees of them, its build, the driver, CUDA_VISIBLE_DEVICES and the lesson, each machine stood in whole
(tests/gpu_machine/machine.py: its nvidia-smi and torch.cuda's answers agree) and decided in this process by the
lesson's own parser, as conftest.parse_as builds it; each row names its line and exit code. A sample runs end to end
as the scripts, on this host whose torch sees no GPU, and gpu_check.sh gives the lessons' line on the same machines."""
import contextlib
import functools
import io
import itertools
import signal
import sys
import textwrap

import pytest

from conftest import ROOT, on_a_gpu_host, parse_as, run_script, script_env
from gpu_machine import machine
from gpu_machine.machine import FLOORS, stand_in, version

H100 = "NVIDIA H100 80GB HBM3"
# The lessons of the table: (processes asked for, the tensor-parallel group): one process, DDP's four, 10's
LESSONS = {"04_fabric-vit-mixed-precision.py": (1, 1), "05_fabric-vit-mixed-ddp.py": (4, 1),
           "10_fabric-vit-tensor-parallel.py": (4, 2)}
COUNTS, SEES = [0, 1, 2, 4, 8], ["all", "none"]
BUILDS = ["cpu", "11.8", "12.6", "12.8", "13.0"]
DRIVERS = ["450.80.02", "525.60.13", "550.54.15", "570.124.06", "580.82.07"]
VISIBLE = [None, "", "0", "0,1"]  # CUDA_VISIBLE_DEVICES: unset, empty, one id, two ids
# The rules: the oldest Linux driver for each CUDA major, by minor-version compatibility, as NVIDIA states them
# (machine.FLOORS: CUDA Toolkit release notes, table 3), and the newest build of each on PyTorch's index
NEWEST = {"13": ("13.0", "cu130"), "12": ("12.8", "cu128"), "11": ("11.8", "cu118")}
NO_GPU = "no CUDA GPU found. A full run on a CPU takes about a day"
FITS = "this build fits the driver: check that the driver works (nvidia-smi -q) and that nothing hides the GPU"


def install(cuda, tag):
    return f"install a CUDA {cuda} build, the newest this driver runs: pip install --force-reinstall torch torchvision " \
           f"--index-url https://download.pytorch.org/whl/{tag}"


def expected(script, count, sees, build, driver, visible):
    """(a fragment of the line, the exit code) by the rules; (None, 0) where the lesson runs on the GPUs."""
    asked, group = LESSONS[script]
    shown = count if visible is None else 0 if visible == "" else min(count, len(visible.split(",")))
    runs = build != "cpu" and version(driver) >= FLOORS[build.split(".")[0]]
    has = shown if sees == "all" and runs else 0
    if has >= asked:
        return None, 0
    if has:  # fewer than asked: how many, and the command that runs on them
        devices, regroup = (has - has % group, "") if has >= group else (has, f" --tensor-parallel {has}")
        return f"{script} --devices {devices}{regroup} runs on {'it' if has == 1 else 'them'}.", 2
    if count == 0:
        return NO_GPU, 2
    if visible == "":
        return f"no CUDA GPU found: CUDA_VISIBLE_DEVICES='' hides the {count} GPU(s) nvidia-smi lists", 2
    if runs:
        return FITS, 2
    newest = next(major for major in ("13", "12", "11") if version(driver) >= FLOORS[major])
    return install(*NEWEST[newest]), 2


def rows():
    return itertools.product(COUNTS, SEES, BUILDS, DRIVERS, VISIBLE)


def in_process_smi(*args):
    """The stand-in nvidia-smi's answer without its process (machine.answer, the code it runs), as
    run_keeping/gpu.py's nvidia_smi gives it: its output, or None where it fails."""
    out, code = machine.answer(args)
    return out + "\n" if code == 0 else None


@pytest.fixture
def lesson_parser(monkeypatch):
    """lesson_parser(script): the script's parser, built once as conftest.parse_as builds it (the script run as a
    module not __main__, then its lines from `parser = lesson_parser(` to `parser.parse_args()` in its namespace),
    with sys.argv as `python SCRIPT` sets it."""
    import runpy
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def build(script):
        text = (ROOT / script).read_text()
        start = text.rindex("\n", 0, text.index("parser = lesson_parser(")) + 1
        end = text.rindex("\n", 0, text.index("parser.parse_args()", start)) + 1
        monkeypatch.setattr(sys, "argv", [str(ROOT / script)])
        made = runpy.run_path(str(ROOT / script), run_name="lesson_parsed_by_the_tests")
        exec(textwrap.dedent(text[start:end]), made)
        return made["parser"]
    yield build
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def decide(parser, row):
    """(the line, the exit code) that `parser`'s lesson gives on the machine of `row`, decided in this process."""
    from run_keeping import gpu
    count, sees, build, driver, visible = row
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(io.StringIO()) as err:
        stand_in(patch, f"{count} x {H100}, driver {driver}", sees, build)
        patch.setattr(gpu, "nvidia_smi", in_process_smi)
        if visible is None:
            patch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            patch.setenv("CUDA_VISIBLE_DEVICES", visible)
        patch.setenv("LT_PRECISION", "")  # what parse_args sets is put back with the rest
        try:
            settings = parser.parse_args()
        except SystemExit as stop:
            return err.getvalue().strip(), stop.code
        put_back = getattr(getattr(settings, "as_found", None), "put_back", None)
        if put_back:
            put_back()
        return f"runs on {settings.accelerator} x {settings.devices}", 0


@pytest.mark.parametrize("script", LESSONS)
def test_every_machine_shape_gets_its_line(script, lesson_parser, monkeypatch):
    """Every row of the table, crossing the GPUs nvidia-smi lists, what torch sees, the build, the driver and
    CUDA_VISIBLE_DEVICES, for one lesson: its line holds the rule's fragment (the run goes on where torch sees
    enough GPUs), in one line, exit 2; each line names what to do (a command, an install, a driver, a check)."""
    from run_keeping import config
    monkeypatch.setattr(config, "read_script", functools.cache(config.read_script))  # the script's text, read once
    parser, wrong = lesson_parser(script), []
    for row in rows():
        line, code = decide(parser, row)
        fragment, expected_code = expected(script, *row)
        if code != expected_code or (fragment or "runs on cuda") not in line or len(line.splitlines()) != 1:
            wrong.append(f"{row}: exit {code}, {line!r}; expected exit {expected_code}, {fragment!r}")
    assert not wrong, f"{len(wrong)} of {len(list(rows()))} rows:\n" + "\n".join(wrong[:20])


# Rows written by hand, each its line's fragment: the shapes the table does not cross (Blackwell GPUs, a driver under
# every floor or just under one, no driver, ids that name no GPU, mixed GPUs, an odd count for tensor parallelism)
HAND = [  # (machine, torch sees, build, CUDA_VISIBLE_DEVICES, script, flags, fragment)
    (f"1 x {H100}, driver 570.124.06", "all", "12.8", None, "05_fabric-vit-mixed-ddp.py", [],
     "asked for 4 GPU(s) per machine (--devices 4) but this machine has 1: python "
     f"{ROOT / '05_fabric-vit-mixed-ddp.py'} --devices 1 runs on it."),
    (f"3 x {H100}, driver 580.82.07", "all", "13.0", None, "10_fabric-vit-tensor-parallel.py", ["--resume"],
     f"but this machine has 3: python {ROOT / '10_fabric-vit-tensor-parallel.py'} --devices 2 --resume runs on them."),
    (f"1 x {H100}, driver 580.82.07", "all", "13.0", None, "10_fabric-vit-tensor-parallel.py", ["--devices=4"],
     "--devices 1 --tensor-parallel 1 runs on it."),
    (f"8 x {H100}, driver 580.82.07", "all", "13.0", "3", "06_fabric-vit-mixed-fsdp.py", [],
     "but CUDA_VISIBLE_DEVICES='3' shows torch 1 of the 8 GPUs nvidia-smi lists: python"),
    (f"1 x {H100}, driver 580.82.07", "none", "12.6", None, "04_fabric-vit-mixed-precision.py", [],
     f"nvidia-smi sees {H100} (driver 580.82.07), but this torch 2"),
    (f"1 x {H100}, driver 580.82.07", "all", "12.6", None, "04_fabric-vit-mixed-precision.py", [], None),
    (f"1 x {H100}, driver 525.60.12", "all", "12.6", None, "04_fabric-vit-mixed-precision.py", [],
     "a CUDA 12.6 build needs driver 525.60.13 or newer; " + install("11.8", "cu118")),
    (f"2 x {H100}, driver 580.65.05", "all", "13.0", None, "04_fabric-vit-mixed-precision.py", [],
     f"nvidia-smi sees 2 x {H100} (driver 580.65.05)"),
    (f"1 x {H100}, driver 450.80.01", "all", "11.8", None, "04_fabric-vit-mixed-precision.py", [],
     "the driver is older than any torch build runs on (CUDA 13.0 from 580.65.06, CUDA 12.8 from 525.60.13, CUDA 11.8 "
     "from 450.80.02): update the NVIDIA driver (docs/gpu-setup.md)."),
    ("1 x NVIDIA B200, driver 575.57.08", "all", "12.6", None, "04_fabric-vit-mixed-precision.py", [],
     "has no kernels for NVIDIA B200 (compute capability 10.0); it carries sm_50, sm_60, sm_70, sm_75, sm_80, sm_86, "
     "sm_90: install a build that does"),
    ("1 x NVIDIA B200, driver 575.57.08", "all", "cpu", None, "04_fabric-vit-mixed-precision.py", [],
     "a CPU build uses no GPU; " + install("12.8", "cu128")),
    ("4 x NVIDIA B200, driver 575.57.08", "all", "13.0", None, "05_fabric-vit-mixed-ddp.py", [],
     "a CUDA 13.0 build needs driver 580.65.06 or newer; " + install("12.8", "cu128")),
    ("1 x NVIDIA GeForce RTX 5090, driver 565.57.01", "all", "12.8", None, "04_fabric-vit-mixed-precision.py", [],
     "a Blackwell GPU (compute capability 12.0) needs driver 570 or newer: update the NVIDIA driver"),
    ("1 x NVIDIA B200, driver 580.82.07", "none", "12.8", None, "04_fabric-vit-mixed-precision.py", [], FITS),
    (f"1 x NVIDIA A100-SXM4-80GB + 1 x {H100}, driver 550.54.15", "all", "cpu", None,
     "04_fabric-vit-mixed-precision.py", [], f"nvidia-smi sees NVIDIA A100-SXM4-80GB, {H100} (driver 550.54.15), but"),
    (f"4 x {H100}, driver 580.82.07", "all", "13.0", "-1", "05_fabric-vit-mixed-ddp.py", [],
     "no CUDA GPU found: CUDA_VISIBLE_DEVICES='-1' hides the 4 GPU(s) nvidia-smi lists (unset it to use them). A full"),
    (f"4 x {H100}, driver 580.82.07", "all", "13.0", "7", "05_fabric-vit-mixed-ddp.py", [],
     "no CUDA GPU found: CUDA_VISIBLE_DEVICES='7' names none of the 4 GPU(s) nvidia-smi lists"),
    (f"4 x {H100}, driver 580.82.07", "all", "13.0", "", "05_fabric-vit-mixed-ddp.py", ["--accelerator", "cuda"],
     "hides the 4 GPU(s) nvidia-smi lists (unset it to use them). Asked for 4 GPU(s) per machine (--devices 4)"),
    ("no driver", "all", "13.0", None, "04_fabric-vit-mixed-precision.py", [], NO_GPU),
    ("1 x Tesla V100-SXM2-16GB, driver 580.82.07", "all", "13.0", None, "04_fabric-vit-mixed-precision.py", [],
     "has no kernels for Tesla V100-SXM2-16GB (compute capability 7.0); it carries sm_75, sm_80, sm_86, sm_90, sm_100,"),
    ("1 x Tesla V100-SXM2-16GB, driver 580.82.07", "all", "12.6", None, "04_fabric-vit-mixed-precision.py", [], None),
    ("0", "all", "13.0", None, "06_fabric-vit-mixed-fsdp.py", ["--accelerator", "cuda"],
     "asked for 4 GPU(s) per machine (--devices 4) but this machine has 0."),
]


@pytest.mark.parametrize("description, sees, build, visible, script, flags, fragment", HAND)
def test_a_machine_written_by_hand_gets_its_line(description, sees, build, visible, script, flags, fragment,
                                                  monkeypatch, capsys):
    """Each row by hand, parsed as the script parses it, its nvidia-smi the stand-in's answer (its own process:
    the end-to-end sample below): the fragment in the one line, exit 2 (None: the run goes on, on the GPUs)."""
    from run_keeping import gpu
    monkeypatch.setattr(gpu, "nvidia_smi", in_process_smi)
    stand_in(monkeypatch, description, sees, build)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    if fragment is None:
        assert parse_as(script, *flags).accelerator == "cuda"
        return
    with pytest.raises(SystemExit) as stop:
        parse_as(script, *flags)
    line = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(line.splitlines()) == 1 and fragment in line, line


def test_gpu_check_gives_the_lessons_line(monkeypatch, capsys, tmp_path):
    """bash gpu_check.sh's first line (benchmarks/gpu_check.py's main) on machines whose torch sees no GPU: where
    nvidia-smi lists one, the lessons' own line (what hides it, the build, the driver), not only "run --smoke"."""
    from benchmarks import gpu_check
    from run_keeping import gpu
    monkeypatch.setattr(gpu, "nvidia_smi", in_process_smi)
    machines = [(f"1 x {H100}, driver 550.54.15", "13.0", None), ("1 x NVIDIA B200, driver 565.57.01", "12.8", None),
                (f"4 x {H100}, driver 580.82.07", "cpu", None), (f"2 x {H100}, driver 525.60.13", "13.0", "0,1"),
                (f"2 x {H100}", "12.8", ""), ("no driver", "13.0", None), ("0", "13.0", None)]
    for description, build, visible in machines:
        with monkeypatch.context() as patch:
            stand_in(patch, description, build=build)
            if visible is not None:
                patch.setenv("CUDA_VISIBLE_DEVICES", visible)
            with pytest.raises(SystemExit):
                parse_as("04_fabric-vit-mixed-precision.py")
            lesson = capsys.readouterr().err.split(": error: ", 1)[1].strip()
            with pytest.raises(SystemExit) as stop:
                gpu_check.main(["--out", str(tmp_path / "out")])
            check = capsys.readouterr().err.split(": error: ", 1)[1].strip()
        hidden_or_none = description in ("0", "no driver") or visible == ""
        assert stop.value.code == 2 and check.startswith(lesson.split(" A full run")[0].rstrip(".")), (check, lesson)
        assert (check == lesson) != hidden_or_none and ("gpu_check.sh --smoke" in check) == hidden_or_none, check
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("order, visible, named", [(None, None, H100), ("PCI_BUS_ID", None, "NVIDIA A100-SXM4-80GB"),
                                                    (None, "1", "NVIDIA A100-SXM4-80GB"), (None, "0", H100)])
def test_the_report_names_the_gpu_cuda_uses(monkeypatch, tmp_path, order, visible, named):
    """An A100 first in PCI order (nvidia-smi's index 0) and an H100 after it, which CUDA numbers first (fastest
    first): the report names CUDA's device 0, asked of nvidia-smi by its UUID, under either order and any
    CUDA_VISIBLE_DEVICES."""
    from benchmarks import gpu_check
    stand_in(monkeypatch, f"1 x NVIDIA A100-SXM4-80GB + 1 x {H100}, driver 570.124.06", build="12.8")
    for name, value in (("CUDA_DEVICE_ORDER", order), ("CUDA_VISIBLE_DEVICES", visible)):
        if value is not None:
            monkeypatch.setenv(name, value)
    memory = dict(machine.MODELS)[named][0]
    assert gpu_check.gpu_line(smoke=False) == f"{named}, 570.124.06, {memory} MiB"
    assert gpu_check.gpu_line(smoke=True) == "no NVIDIA GPU used: a CPU run"


# End to end, as a user runs them: the stand-in nvidia-smi on PATH, torch really seeing no GPU (this host's)
# (CUDA_VISIBLE_DEVICES set would start each fresh, not forked: tests/warm_start.py; the table has those rows)
SAMPLE = [  # (machine, CUDA_VISIBLE_DEVICES, script, the line's fragment)
    (f"1 x {H100}, driver 550.54.15", None, "04_fabric-vit-mixed-precision.py",
     "a CUDA 13.0 build needs driver 580.65.06 or newer; " + install("12.8", "cu128")),
    (f"4 x {H100}, driver 580.82.07", None, "05_fabric-vit-mixed-ddp.py", FITS),
    ("8 x NVIDIA B200, driver 565.57.01", None, "10_fabric-vit-tensor-parallel.py",
     "a Blackwell GPU (compute capability 10.0) needs driver 570 or newer: update the NVIDIA driver"),
    ("no driver", None, "01_pytorch-vit.py", NO_GPU),
]


@on_a_gpu_host
@pytest.mark.slow
@pytest.mark.parametrize("description, visible, script, fragment", SAMPLE)
def test_a_sample_of_machines_end_to_end(tmp_path, description, visible, script, fragment):
    """The script as a user starts it on the machine: one line, exit 2, nothing written. (This torch's build is
    CUDA 13.0; where the host's build is another, only the rows that do not depend on it are run.)"""
    import torch
    if "CUDA 13.0 build" in fragment and torch.version.cuda != "13.0":
        pytest.skip(f"this torch is a {torch.version.cuda or 'CPU'} build")
    extra = {"HOOK_GPU_MACHINE": description, **({"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {})}
    proc = run_script(script, cwd=tmp_path, env=script_env(tmp_path, **extra), timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and fragment in lines[0], proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())


@on_a_gpu_host
@pytest.mark.slow
def test_gpu_check_sh_end_to_end_gives_the_lessons_line(tmp_path):
    """bash gpu_check.sh on a Blackwell GPU whose driver predates it, as a user starts it: after its check of the
    modules, the lessons' line, exit 2."""
    import subprocess
    env = script_env(tmp_path, HOOK_GPU_MACHINE="1 x NVIDIA B200, driver 565.57.01")
    proc = subprocess.run(["bash", str(ROOT / "gpu_check.sh")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert proc.returncode == 2 and len(errors) == 1 and errors == proc.stderr.strip().splitlines()[-1:], proc.stderr
    assert errors[0].startswith("gpu_check.py: error: nvidia-smi sees NVIDIA B200 (driver 565.57.01)")
    assert errors[0].endswith("needs driver 570 or newer: update the NVIDIA driver (docs/gpu-setup.md).")
