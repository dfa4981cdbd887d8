"""The first line a GPU user sees, on every shape of machine (docs/gpu-setup.md): the GPUs the driver lists, what
torch sees of them, its build, the driver, CUDA_VISIBLE_DEVICES and the lesson, each machine stood in whole
(tests/gpu_machine/machine.py: its nvidia-smi and torch.cuda's answers agree, torch's own checks and words as CUDA
starts) and decided in this process by the lesson's own parser, as conftest.parse_as builds it; each row names its
line and exit code. What torch cannot say, gpu_check.sh says from nvidia-smi's own words; a sample runs end to end."""
import contextlib
import functools
import io
import itertools
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
BUILDS = ["cpu", "12.6", "12.8", "13.0"]
DRIVERS = ["450.80.02", "525.60.13", "550.54.15", "570.124.06", "580.82.07"]
VISIBLE = [None, "", "0", "0,1"]  # CUDA_VISIBLE_DEVICES: unset, empty, one id, two ids
NO_GPU = "no CUDA GPU found. A full run on a CPU takes about a day"
DIAGNOSIS = "bash gpu_check.sh says what this machine has and which torch build runs on it (docs/gpu-setup.md)."
TOO_OLD = "torch cannot use this machine's GPU: The NVIDIA driver on your system is too old (found version "


def expected(script, count, sees, build, driver, visible):
    """(a fragment of the line, the exit code) by the rules; (None, 0) where the lesson runs on the GPUs."""
    asked, group = LESSONS[script]
    if build == "cpu":
        return "no CUDA GPU found (this torch 2.14.1+cpu is a CPU build). A full run", 2
    shown = count if visible is None else 0 if visible == "" else min(count, len(visible.split(",")))
    listed = shown if sees == "all" else 0
    if not listed:
        return (f"no CUDA GPU found (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else NO_GPU), 2
    if version(driver) < FLOORS[build.split(".")[0]]:
        return TOO_OLD, 2
    if listed >= asked:
        return None, 0
    devices, regroup = (listed - listed % group, "") if listed >= group else (listed, f" --tensor-parallel {listed}")
    return f"{script} --devices {devices}{regroup} runs on {'it' if listed == 1 else 'them'}.", 2


def rows():
    return itertools.product(COUNTS, SEES, BUILDS, DRIVERS, VISIBLE)


@pytest.fixture
def lesson_parser(monkeypatch):
    """lesson_parser(script): the script's parser, built once as conftest.parse_as builds it (the script run as a
    module not __main__, then its lines from `parser = lesson_parser(` to `parser.parse_args()` in its namespace),
    with sys.argv as `python SCRIPT` sets it."""
    import runpy

    def build(script):
        text = (ROOT / script).read_text()
        start = text.rindex("\n", 0, text.index("parser = lesson_parser(")) + 1
        end = text.rindex("\n", 0, text.index("parser.parse_args()", start)) + 1
        monkeypatch.setattr(sys, "argv", [str(ROOT / script)])
        made = runpy.run_path(str(ROOT / script), run_name="lesson_parsed_by_the_tests")
        exec(textwrap.dedent(text[start:end]), made)
        return made["parser"]
    return build


def decide(parser, row):
    """(the line, the exit code) that `parser`'s lesson gives on the machine of `row`, decided in this process."""
    count, sees, build, driver, visible = row
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(io.StringIO()) as err:
        stand_in(patch, f"{count} x {H100}, driver {driver}", sees, build)
        if visible is None:
            patch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            patch.setenv("CUDA_VISIBLE_DEVICES", visible)
        try:
            settings = parser.parse_args()
        except SystemExit as stop:
            return err.getvalue().strip(), stop.code
        return f"runs on {settings.accelerator} x {settings.devices}", 0


@pytest.mark.parametrize("script", LESSONS)
def test_every_machine_shape_gets_its_line(script, lesson_parser, monkeypatch):
    """Every row of the table, crossing the GPUs the driver lists, what torch sees, the build, the driver and
    CUDA_VISIBLE_DEVICES, for one lesson: its line holds the rule's fragment (the run goes on where CUDA gives torch
    enough GPUs), in one line, exit 2; each line names what to do (a command, torch's own words, gpu_check.sh)."""
    from run_keeping import config
    monkeypatch.setattr(config, "read_script", functools.cache(config.read_script))  # the script's text, read once
    parser, wrong = lesson_parser(script), []
    for row in rows():
        line, code = decide(parser, row)
        fragment, expected_code = expected(script, *row)
        names_a_way = code == 0 or "runs on" in line or line.endswith(DIAGNOSIS)
        if code != expected_code or (fragment or "runs on cuda") not in line or len(line.splitlines()) != 1 \
                or not names_a_way:
            wrong.append(f"{row}: exit {code}, {line!r}; expected exit {expected_code}, {fragment!r}")
    assert not wrong, f"{len(wrong)} of {len(list(rows()))} rows:\n" + "\n".join(wrong[:20])


def kernels_line(gpu, cc, build, fits):
    """The beginning and the install of torch's own words for a GPU this build has no kernels for (torch 2.14.1)."""
    return (f"torch cannot use this machine's GPU: Found GPU0 {gpu} which is of compute capability (CC) {cc}. The "
            "following list shows the CCs this version of PyTorch was built for",
            f"Your installed torch==2.14.1+cu{build.replace('.', '')} does not include kernels for this GPU. Reinstall "
            f"the same version against a CUDA build that does, e.g.: For CUDA {fits} use pip install torch==2.14.1 "
            f"--index-url https://download.pytorch.org/whl/cu{fits.replace('.', '')}")


# Rows written by hand, each its line's fragments: the shapes the table does not cross (Blackwell GPUs, on a driver
# before them or without the open kernel modules, a driver under every floor or just under one, no driver, a driver
# whose library does not match its module, ids that name no GPU, mixed GPUs, MIG, ROCm, an odd count for tensor
# parallelism, a GPU a build has no kernels for)
HAND = [  # (machine, torch sees, build, CUDA_VISIBLE_DEVICES, script, flags, fragments)
    (f"1 x {H100}, driver 570.124.06", "all", "12.8", None, "05_fabric-vit-mixed-ddp.py", [],
     ["asked for 4 GPU(s) per machine (--devices 4) but this machine has 1: python "
      f"{ROOT / '05_fabric-vit-mixed-ddp.py'} --devices 1 runs on it."]),
    (f"3 x {H100}, driver 580.82.07", "all", "13.0", None, "10_fabric-vit-tensor-parallel.py", ["--resume"],
     [f"but this machine has 3: python {ROOT / '10_fabric-vit-tensor-parallel.py'} --devices 2 --resume runs on them."]),
    (f"1 x {H100}, driver 580.82.07", "all", "13.0", None, "10_fabric-vit-tensor-parallel.py", ["--devices=4"],
     ["--devices 1 --tensor-parallel 1 runs on it."]),
    (f"8 x {H100}, driver 580.82.07", "all", "13.0", "3", "06_fabric-vit-mixed-fsdp.py", [],
     ["asked for 4 GPU(s) per machine (--devices 4) but CUDA_VISIBLE_DEVICES='3' shows torch 1: python"]),
    (f"1 x {H100}, driver 580.82.07", "none", "12.6", None, "04_fabric-vit-mixed-precision.py", [], [NO_GPU]),
    (f"1 x {H100}, driver 580.82.07", "all", "12.6", None, "04_fabric-vit-mixed-precision.py", [], None),
    (f"1 x {H100}, driver 525.60.12", "all", "12.6", None, "04_fabric-vit-mixed-precision.py", [],
     [TOO_OLD + "12000). Please update your GPU driver", "Alternatively, go to: https://pytorch.org"]),
    (f"1 x {H100}, driver 450.80.01", "all", "13.0", None, "04_fabric-vit-mixed-precision.py", [],
     [TOO_OLD + "11000)."]),
    (f"1 x {H100}, driver 450.80.01", "all", "13.0", None, "04_fabric-vit-mixed-precision.py", ["--accelerator", "cuda"],
     [TOO_OLD + "11000)."]),  # asked for: the bf16 question goes unasked of a CUDA that cannot start
    ("1 x NVIDIA B200, driver 575.57.08", "all", "12.6", None, "04_fabric-vit-mixed-precision.py", [],
     list(kernels_line("NVIDIA B200", "10.0", "12.6", "13.0"))),
    ("1 x NVIDIA B200, driver 575.57.08", "all", "cpu", None, "04_fabric-vit-mixed-precision.py", [],
     ["no CUDA GPU found (this torch 2.14.1+cpu is a CPU build)."]),
    ("4 x NVIDIA B200, driver 575.57.08", "all", "13.0", None, "05_fabric-vit-mixed-ddp.py", [],
     [TOO_OLD + "12090)."]),
    ("1 x NVIDIA GeForce RTX 5090, driver 565.57.01", "all", "12.8", None, "04_fabric-vit-mixed-precision.py", [],
     [NO_GPU, DIAGNOSIS]),
    ("1 x NVIDIA B200, driver 580.82.07, modules proprietary", "all", "13.0", None, "04_fabric-vit-mixed-precision.py",
     [], [NO_GPU, f"Where this machine has a GPU, {DIAGNOSIS}"]),
    (f"1 x NVIDIA A100-SXM4-80GB + 1 x {H100}, driver 550.54.15", "all", "cpu", None,
     "04_fabric-vit-mixed-precision.py", [], ["(this torch 2.14.1+cpu is a CPU build)"]),
    (f"4 x {H100}, driver 580.82.07", "all", "13.0", "-1", "05_fabric-vit-mixed-ddp.py", [],
     ["no CUDA GPU found (CUDA_VISIBLE_DEVICES='-1'). A full"]),
    (f"4 x {H100}, driver 580.82.07", "all", "13.0", "7", "05_fabric-vit-mixed-ddp.py", [],
     ["no CUDA GPU found (CUDA_VISIBLE_DEVICES='7')"]),
    (f"4 x {H100}, driver 580.82.07", "all", "13.0", "", "05_fabric-vit-mixed-ddp.py", ["--accelerator", "cuda"],
     ["no CUDA GPU found (CUDA_VISIBLE_DEVICES=''). Asked for 4 GPU(s) per machine (--devices 4) but this machine "
      "has 0."]),
    ("no driver", "all", "13.0", None, "04_fabric-vit-mixed-precision.py", [], [NO_GPU]),
    ("mismatch", "all", "13.0", None, "04_fabric-vit-mixed-precision.py", [],
     ["torch cannot use this machine's GPU: CUDA initialization: Unexpected error from cudaGetDeviceCount().",
      "Error 803: system has unsupported display driver / cuda driver combination", DIAGNOSIS]),
    ("1 x Tesla V100-SXM2-16GB, driver 580.82.07", "all", "13.0", None, "04_fabric-vit-mixed-precision.py", [],
     list(kernels_line("Tesla V100-SXM2-16GB", "7.0", "13.0", "12.6"))),
    ("1 x Tesla V100-SXM2-16GB, driver 580.82.07", "all", "12.6", None, "04_fabric-vit-mixed-precision.py", [], None),
    ("0", "all", "13.0", None, "06_fabric-vit-mixed-fsdp.py", ["--accelerator", "cuda"],
     ["no CUDA GPU found. Asked for 4 GPU(s) per machine (--devices 4) but this machine has 0."]),
    ("8 x NVIDIA A100-SXM4-80GB, driver 580.82.07, mig", "all", "13.0", None, "05_fabric-vit-mixed-ddp.py", [],
     [f"asked for 4 GPU(s) per machine (--devices 4) but this machine has 1: python {ROOT / '05_fabric-vit-mixed-ddp.py'}"
      " --devices 1 runs on it."]),
    ("8 x NVIDIA A100-SXM4-80GB, driver 580.82.07, mig", "all", "13.0", None, "04_fabric-vit-mixed-precision.py", [],
     None),
    ("2 x AMD Instinct MI300X, rocm", "all", "rocm", None, "04_fabric-vit-mixed-precision.py", [], None),
    ("2 x AMD Instinct MI300X, rocm", "all", "rocm", None, "05_fabric-vit-mixed-ddp.py", [],
     ["asked for 4 GPU(s) per machine (--devices 4) but this machine has 2: python", "--devices 2 runs on them."]),
    ("2 x AMD Instinct MI300X, rocm", "all", "13.0", None, "04_fabric-vit-mixed-precision.py", [], [NO_GPU]),
]


@pytest.mark.parametrize("description, sees, build, visible, script, flags, fragments", HAND)
def test_a_machine_written_by_hand_gets_its_line(description, sees, build, visible, script, flags, fragments,
                                                  monkeypatch, capsys):
    """Each row by hand, parsed as the script parses it: its fragments in the one line, exit 2 (None: the run goes
    on, on the GPUs, in 04's case in bfloat16 where the GPU has it: ROCm's MI300X, MIG's A100)."""
    stand_in(monkeypatch, description, sees, build)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    if fragments is None:
        import torch
        settings = parse_as(script, *flags)
        bf16 = torch.cuda.get_device_capability() >= (8, 0)  # as the stand-in's GPU says
        assert settings.accelerator == "cuda" and settings.precision == ("bf16-mixed" if bf16 else "32-true")
        return
    with pytest.raises(SystemExit) as stop:
        parse_as(script, *flags)
    line = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(line.splitlines()) == 1 and all(f in line for f in fragments), line


# gpu_check.sh's diagnosis of the machines a lesson can only point to: nvidia-smi's own words and exit code
DIAGNOSED = [
    ("mismatch", "13.0", ["nvidia-smi -L: Failed to initialize NVML: Driver/library version mismatch",
                          "nvidia-smi -L: NVML library version: 580.95 (exit 18)"]),
    ("1 x NVIDIA B200, driver 580.82.07, modules proprietary", "13.0", ["nvidia-smi -L: No devices were found (exit 6)"]),
    ("8 x NVIDIA A100-SXM4-80GB, driver 580.82.07, mig", "13.0",
     ["nvidia-smi -L:   MIG 1g.10gb     Device  0: (UUID: MIG-", "torch, as CUDA starts: 1 GPU(s) it can use",
      "nvidia-smi --query-gpu=index,name,driver_version,compute_cap,mig.mode.current,compute_mode: 0, NVIDIA "
      "A100-SXM4-80GB, 580.82.07, 8.0, Enabled, Default"]),
    ("2 x AMD Instinct MI300X, rocm", "rocm", ["a ROCm build (HIP 6.4.43484), with kernels for gfx90a gfx942",
                                                "torch, as CUDA starts: 2 GPU(s) it can use", "(exit 9)"]),
    ("1 x Tesla V100-SXM2-16GB, driver 580.82.07", "13.0",
     ["torch, as CUDA starts: 1 GPU(s) it can use; it says: Found GPU0 Tesla V100-SXM2-16GB",
      "a CUDA 13.0 build, with kernels for sm_75 sm_80 sm_86 sm_90 sm_100 sm_120",
      "PyTorch's CUDA 12.6 builds carry kernels for compute capabilities 5.0, 6.0, 7.0, 7.5, 8.0, 8.6, 9.0"]),
]


@pytest.mark.parametrize("description, build, said", DIAGNOSED)
def test_gpu_check_says_what_the_machine_has_in_its_tools_words(description, build, said, monkeypatch, capsys,
                                                                tmp_path):
    """bash gpu_check.sh (benchmarks/gpu_check.py's main) on the machines whose diagnosis a lesson leaves to it: the
    machine in its tools' own words (nvidia-smi's error and exit code, its MIG devices, torch's build and what it
    says as CUDA starts, PyTorch's builds), then, where torch cannot use a GPU, the lessons' line, exit 2."""
    from benchmarks import gpu_check
    monkeypatch.setattr(gpu_check, "nvidia_smi", in_process_smi)
    stand_in(monkeypatch, description, build=build)
    try:
        gpu_check.main(["--out", str(tmp_path / "out"), "--minutes", "1", "--scripts", "04"])
    except SystemExit as stop:
        assert stop.code == 2
    out = capsys.readouterr().out
    assert all(fragment in out for fragment in said), out


def in_process_smi(*args):
    """The stand-in nvidia-smi's answer without its process (machine.answer, the code it runs), as
    benchmarks/gpu_check.py's nvidia_smi gives it: (its output, its exit code)."""
    out, code = machine.answer(args)
    return out, code


def test_gpu_check_gives_the_lessons_line(monkeypatch, capsys, tmp_path):
    """bash gpu_check.sh's last line on machines whose torch uses no GPU: the lessons' own line, but for the way on
    without a GPU (gpu_check.sh's --smoke, not the lesson's)."""
    from benchmarks import gpu_check
    monkeypatch.setattr(gpu_check, "nvidia_smi", in_process_smi)
    machines = [(f"1 x {H100}, driver 550.54.15", "13.0", None), ("1 x NVIDIA B200, driver 565.57.01", "12.8", None),
                (f"4 x {H100}, driver 580.82.07", "cpu", None), (f"2 x {H100}, driver 525.60.13", "13.0", "0,1"),
                (f"2 x {H100}", "12.8", ""), ("no driver", "13.0", None), ("0", "13.0", None),
                ("mismatch", "13.0", None), ("1 x Tesla V100-SXM2-16GB, driver 580.82.07", "13.0", None)]
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
        no_gpu = lesson.startswith("no CUDA GPU found")
        assert stop.value.code == 2 and lesson.endswith(DIAGNOSIS) and DIAGNOSIS not in check, (check, lesson)
        assert ("gpu_check.sh --smoke" in check) == no_gpu, check
        if no_gpu:  # the same line, but for the way on without a GPU
            assert check.split(". ")[0] == lesson.split(". ")[0], (check, lesson)
        else:  # the lessons' line, torch's words, but for gpu_check.sh, which this is
            assert lesson == f"{check} {DIAGNOSIS}", (check, lesson)
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
    assert gpu_check.gpu_line(smoke=False, gpus=2) == f"{named}, 570.124.06, {memory} MiB"
    assert gpu_check.gpu_line(smoke=True, gpus=2) == "no NVIDIA GPU used: a CPU run"


# End to end, as a user runs them: the stand-in nvidia-smi on PATH, torch really seeing no GPU (this host's): the
# lesson says what torch says, no GPU, and names gpu_check.sh, whose first lines quote nvidia-smi's own words
SAMPLE = [("mismatch", "01_pytorch-vit.py"), ("1 x NVIDIA B200, driver 565.57.01", "10_fabric-vit-tensor-parallel.py")]


@on_a_gpu_host
@pytest.mark.slow
@pytest.mark.parametrize("description, script", SAMPLE)
def test_a_sample_of_machines_end_to_end(tmp_path, description, script):
    """The script as a user starts it on the machine: one line, exit 2, nothing written."""
    proc = run_script(script, cwd=tmp_path, env=script_env(tmp_path, HOOK_GPU_MACHINE=description), timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and NO_GPU in lines[0] and DIAGNOSIS in lines[0], proc.stderr
    assert not list(tmp_path.iterdir())


@on_a_gpu_host
@pytest.mark.slow
def test_gpu_check_sh_end_to_end_quotes_nvidia_smi(tmp_path):
    """bash gpu_check.sh where the driver's library and module differ, as a user starts it: after its check of the
    modules, the machine with nvidia-smi's own error and exit code, then the lessons' line, exit 2."""
    import subprocess
    env = script_env(tmp_path, HOOK_GPU_MACHINE="mismatch")
    proc = subprocess.run(["bash", str(ROOT / "gpu_check.sh")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert proc.returncode == 2 and len(errors) == 1 and errors == proc.stderr.strip().splitlines()[-1:], proc.stderr
    assert "nvidia-smi -L: Failed to initialize NVML: Driver/library version mismatch" in proc.stdout, proc.stdout
    assert "(exit 18)" in proc.stdout and errors[0] == ("gpu_check.py: error: no CUDA GPU found. On a CPU, run the same "
                                                     "check at smoke size: bash gpu_check.sh --smoke.")
