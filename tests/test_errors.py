"""Bad input and hostile machines: one clear line, exit 2, no traceback, records untouched."""

import json
import pytest

from run_keeping.config import SMOKE_EPOCHS
from conftest import ROOT, on_a_gpu_host, parse_as, run_script, script_env

ACCUMULATING = "12_fabric-vit-grad-accumulation.py"  # its parser sets micro_batches=4


@pytest.fixture
def argv(monkeypatch):
    """The script's own command line, as if it were run with these flags (conftest.parse_as)."""
    def parse(*flags, script="01_pytorch-vit.py"):
        return parse_as(script, *flags)
    return parse


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "0"], "argument --epochs: must be 1 or more, got 0"),
    (["--batch-size", "0"], "argument --batch-size: must be 1 or more, got 0"),
    (["--num-workers", "-1"], "argument --num-workers: must be 0 or more, got -1"),
    (["--max-steps", "x"], "argument --max-steps: must be a whole number, got 'x'"),
    (["--epochs", "abc"], "argument --epochs: must be a whole number, got 'abc'"),
    (["--accelerator", "tpu"], "argument --accelerator: invalid choice: 'tpu'"),
    (["--resum"], "unrecognized arguments: --resum"),  # a flag as written whole: the commands a run prints repeat it
])
def test_bad_flag_values(argv, capsys, flags, message):
    """One line, not argparse's usage block: the program, the flag, what is wrong, where --help is."""
    with pytest.raises(SystemExit) as exit_info:
        argv("--smoke", *flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("01_pytorch-vit.py: error: ") and message in err
    assert err.strip().endswith(f"python {ROOT / '01_pytorch-vit.py'} --help lists the flags")


def test_results_path_that_cannot_be_written(argv, capsys, tmp_path):
    (tmp_path / "a-directory").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        argv("--smoke", "--results", str(tmp_path / "a-directory"))
    assert exit_info.value.code == 2
    assert "--results" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(SystemExit):
        argv("--smoke", "--results", str(blocker / "runs.jsonl"))
    assert blocker.read_text() == "x"
    with pytest.raises(SystemExit):
        argv("--smoke", "--save-model", str(blocker / "m.pt"))
    assert "--save-model" in capsys.readouterr().err


def test_parsing_creates_nothing(argv, tmp_path):
    """parse_args only parses and checks: no results folder, no handlers, no files."""
    import signal
    handler = signal.getsignal(signal.SIGINT)
    argv("--smoke", "--results", str(tmp_path / "deep" / "runs.jsonl"))
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is handler


def test_no_gpu_without_smoke(argv, capsys, monkeypatch):
    from gpu_machine.machine import stand_in
    stand_in(monkeypatch, "0")  # a machine without a GPU, whatever the host has
    with pytest.raises(SystemExit) as exit_info:
        argv()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "about a day" in err and "--smoke" in err and "--accelerator cpu" in err
    with pytest.raises(SystemExit):
        argv("--resume", script="04_fabric-vit-mixed-precision.py")
    assert "04_fabric-vit-mixed-precision.py --smoke --resume" in capsys.readouterr().err


def test_accelerator_cpu_insists(argv):
    args = argv("--accelerator", "cpu")
    assert (args.accelerator, args.smoke, args.epochs, args.batch_size) == ("cpu", False, 3, 16)


def test_defaults_reproduce_the_talk(argv):
    args = argv("--accelerator", "cpu", script="06_fabric-vit-mixed-fsdp.py")
    assert (args.epochs, args.batch_size, args.num_workers, args.seed, args.devices,
            args.num_nodes, args.data_dir, args.results, args.max_steps) == \
        (3, 16, 4, 123, 4, 1, "data", "results/runs.jsonl", None)
    assert args.save_model == "models/06_fabric-vit-mixed-fsdp.pt"


def test_smoke_keeps_the_global_batch_on_two_processes(argv):
    args = argv("--smoke", script="06_fabric-vit-mixed-fsdp.py")
    assert (args.devices, args.batch_size, args.epochs, args.accelerator) == \
        (2, 8, SMOKE_EPOCHS[3], "cpu")
    assert args.checkpoint_dir.endswith("06_fabric-vit-mixed-fsdp-smoke")
    assert args.save_model == "models/06_fabric-vit-mixed-fsdp-smoke.pt"
    assert argv("--smoke", "--devices", "4", script="06_fabric-vit-mixed-fsdp.py").batch_size == 4


@pytest.fixture
def earlier_records(tmp_path):
    path = tmp_path / "results" / "runs.jsonl"
    path.parent.mkdir()
    path.write_text('{"script": "00_pytorch-vit-random-init.py", "test_acc": 0.6285}\n')
    return path


@on_a_gpu_host
@pytest.mark.slow
@pytest.mark.parametrize("script, flags, words", [
    ("01_pytorch-vit.py", [], ["no CUDA GPU", "about a day"]),
    ("06_fabric-vit-mixed-fsdp.py", ["--accelerator", "cuda"], ["4 GPU", "has 0"]),
])
def test_scripts_fail_cleanly(tmp_path, earlier_records, script, flags, words):
    before = earlier_records.read_bytes()
    proc = run_script(script, *flags, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    error_lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and all(w in error_lines[0] for w in words), proc.stderr
    assert earlier_records.read_bytes() == before


@pytest.mark.slow
def test_torch_compile_without_a_cpp_compiler(tmp_path, earlier_records):
    """02 on a machine whose C++ compiler is missing: one line saying so and how to run without
    compiling, exit 2, no traceback, nothing written."""
    env = script_env(tmp_path, CXX="/nonexistent/g++",
                     TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    before = earlier_records.read_bytes()
    proc = run_script("02_pytorch-vit-compile.py", "--smoke", cwd=tmp_path, env=env, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "No working C++ compiler" in errors[0]
    assert "or run the script without its torch.compile line" in errors[0]
    assert earlier_records.read_bytes() == before and not (tmp_path / "models").exists()


@pytest.mark.parametrize("flags, processes", [([], 2), (["--devices", "3"], 3), (["--devices=3"], 3)])
def test_devices_given_in_any_spelling_are_taken(argv, flags, processes):
    """Only a smoke run that names no --devices is capped to 2 processes on a CPU. (An abbreviation, --device, is
    refused: the commands a run prints repeat its flags as written: test_bad_flag_values.)"""
    args = argv("--smoke", *flags, script="05_fabric-vit-mixed-ddp.py")
    assert args.devices == processes


def test_a_smoke_batch_that_16_does_not_divide_is_said(argv):
    from run_keeping.keeper import kind_line
    args = argv("--smoke", "--devices", "3", script="05_fabric-vit-mixed-ddp.py")
    assert (args.batch_size, args.data_parallel) == (5, 3)
    assert "The batch is 5 per data-parallel process, 15 in all, not the talk's 16" in kind_line(args, "random init")


def test_a_gpu_asked_for_on_a_machine_without_one(argv, capsys, monkeypatch):
    from gpu_machine.machine import stand_in
    stand_in(monkeypatch, "0")  # a machine without a GPU, whatever the host has
    with pytest.raises(SystemExit) as exit_info:
        argv("--smoke", "--accelerator", "cuda", script="04_fabric-vit-mixed-precision.py")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "(--accelerator cuda) but this machine has 0" in err and "--devices" not in err


def test_each_kind_of_run_has_its_own_folder_and_file(argv):
    kinds = {}
    for flags in ([], ["--smoke"], ["--synthetic"], ["--smoke", "--synthetic"]):
        args = argv("--accelerator", "cpu", *flags, script="04_fabric-vit-mixed-precision.py")
        kinds[args.kind] = (args.checkpoint_dir, args.save_model)
    assert list(kinds) == ["", "smoke", "synthetic", "smoke-synthetic"]
    assert len({c for c, _ in kinds.values()}) == len({m for _, m in kinds.values()}) == 4
    assert kinds["smoke-synthetic"] == ("checkpoints/04_fabric-vit-mixed-precision-smoke-synthetic",
                                        "models/04_fabric-vit-mixed-precision-smoke-synthetic.pt")


@on_a_gpu_host
@pytest.mark.slow
def test_gpu_check_without_a_gpu_points_at_its_smoke_size(tmp_path):
    import subprocess
    from conftest import ROOT
    proc = subprocess.run(["bash", str(ROOT / "gpu_check.sh"), "--out", str(tmp_path / "out")], cwd=tmp_path,
                          env=script_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "about a day" not in proc.stderr
    assert "error: no CUDA GPU found. On a CPU, run the same check at smoke size: bash gpu_check.sh --smoke." in proc.stderr
    assert not (tmp_path / "out").exists()


def test_smoke_epochs_take_the_talks_shape(argv):
    """The talk: 10 epochs from random init (00), 3 finetuning; --smoke: 00 more, 01 half."""
    scratch = argv("--smoke", script="00_pytorch-vit-random-init.py").epochs
    finetune = argv("--smoke", script="01_pytorch-vit.py").epochs
    assert finetune >= 2 and 2 * finetune <= scratch  # 2: the kill-and-resume tests need it


def test_the_memory_lessons_flags(argv, capsys):
    """--vit builds the sequel's ViT-L/16 where a full or synthetic run would, and is refused
    with --smoke (which trains its own small ViT); 12-14's batch must split into 4 micro-batches."""
    assert argv("--synthetic", "--accelerator", "cpu", "--vit", "vit_l_16").vit == "vit_l_16"
    assert argv("--smoke").vit == "vit_b_16"
    for flags, kwargs, message in [
            (["--smoke", "--vit", "vit_l_16"], {}, "--vit: a smoke run trains its own small ViT"),
            (["--smoke", "--batch-size", "6"], {"script": ACCUMULATING}, "the batch of 6 (--batch-size) is trained on in 4 micro-batches, so it must divide it")]:
        with pytest.raises(SystemExit) as exit_info:
            argv(*flags, **kwargs)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert argv("--smoke", "--batch-size", "8", script=ACCUMULATING).micro_batches == 4


@pytest.mark.parametrize("accelerator, words", [
    ("cpu", "here it needs a C++ compiler (install g++)"),
    ("cuda", "here it needs Triton and a C compiler (install gcc)"),
])
def test_torch_compile_without_its_compiler_names_what_the_device_lacks(accelerator, words):
    """A GPU machine without a C compiler fails 02 and 09 in torch.compile too, but what it lacks
    is not a CPU's C++ compiler: the line names what the run's device needs, exit 2."""
    from types import SimpleNamespace
    from run_keeping.keeper import explain
    config = SimpleNamespace(accelerator=accelerator, script="02_pytorch-vit-compile.py", batch_size=16)
    failure = type("InductorError", (RuntimeError,), {"__module__": "torch._inductor.exc"})
    message, code = explain(failure("Failed to find C compiler"), config, 0, 1, None)
    assert code == 2 and "\n" not in message and words in message, message
    assert message.endswith("or run the script without its torch.compile line.")


def test_another_compile_error_is_said_as_itself():
    """A torch.compile error that is not a missing compiler (Dynamo wraps the backend's own in
    BackendCompilerFailed, whose text begins "backend='inductor' raised:"): the line names the
    backend's error and its reason, not a compiler, exit 1."""
    from types import SimpleNamespace
    from run_keeping.keeper import explain
    config = SimpleNamespace(accelerator="cuda", script="02_pytorch-vit-compile.py", batch_size=16)
    wrapper = type("BackendCompilerFailed", (RuntimeError,), {"__module__": "torch._dynamo.exc"})
    inner = AssertionError("the graph's output has no strides")
    err = wrapper("backend='inductor' raised:\nAssertionError: the graph's output has no strides")
    setattr(err, "inner_exception", inner)  # as Dynamo's BackendCompilerFailed holds it
    message, code = explain(err, config, 0, 1, None)
    assert code == 1 and "AssertionError: the graph's output has no strides" in message, message
    assert "compiler" not in message.split(";")[0] and "install" not in message


@pytest.mark.slow  # it measures the libraries' memory first, in a process of its own
def test_a_benchmark_that_measured_nothing_exits_6_in_one_line(tmp_path, monkeypatch, capsys):
    """benchmark.py --memory --sequel on a CPU without native bfloat16 (every lesson of the chain asks for it):
    nothing measured, so one line saying why, exit 6 (not 0 with an empty table)."""
    import benchmark
    from benchmarks import memory
    monkeypatch.setattr(memory, "native_bf16", lambda device: False)
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--memory", "--sequel", "--smoke", "--scripts", "04", "--results", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 6 and ": error: nothing was measured: " in err and "no native bfloat16" in err, err


@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_loaded_ends_the_run_with_2(tmp_path):
    """An error inside the `with` block keeps its documented code through it (docs/flags-records-exit-codes.md):
    --resume from a damaged checkpoint is one line and exit 2, not 1."""
    args = parse_as("01_pytorch-vit.py", "--smoke", "--max-steps", "2", "--checkpoint-dir", str(tmp_path / "ck"))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "epoch-0001.ckpt").write_bytes(b"not a checkpoint")
    settings = {key: getattr(args, key) for key in ("vit", "batch_size", "seed", "epochs", "max_steps", "world_size", "precision")}
    (tmp_path / "ck" / "latest.json").write_text(json.dumps({"checkpoint": "epoch-0001.ckpt", "script": args.script,
                                                             "kind": args.kind, "settings": settings | args.own}))
    proc = run_script("01_pytorch-vit.py", "--smoke", "--max-steps", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
                      cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "cannot load" in lines[0] and "start over" in lines[0], proc.stderr[-2000:]


def test_a_long_line_is_cut_at_a_words_end_or_at_its_limit():
    """An error's first line, cut past its limit at a word's end; a line of no spaces (a path, a URL) at the limit."""
    from run_keeping.record import first_line
    assert first_line("first\nsecond") == "first"
    assert first_line("word " * 100) == " ".join(["word"] * 60) + " ..."
    assert first_line("x" * 305) == "x" * 300 + " ..."
