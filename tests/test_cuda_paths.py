"""The branches only a CUDA device takes, run on this CPU with the device stood in for: only
torch.cuda's answers are replaced (how many GPUs, their name, their memory figures, their
random state), never the code that asks. (What needs a real GPU: gpu_check.sh.)"""
import json
import signal

import pytest
import torch

import local_utilities as lu
from run_keeping.reading import lessons
from conftest import parse_as
from gpu_machine.machine import stand_in
from run_keeping.keeper import RunKeeper


@pytest.fixture
def gpus(monkeypatch):
    """A machine with `n` H100s on a driver this torch's build runs on, as its nvidia-smi lists them and
    torch.cuda reports them (tests/gpu_machine/machine.py)."""
    def machine(n):
        stand_in(monkeypatch, f"{n} x NVIDIA H100 80GB HBM3, driver 580.82.07", build="13.0")
    return machine


@pytest.fixture
def parse(monkeypatch):
    def parse_args(*flags, script="05_fabric-vit-mixed-ddp.py"):
        return parse_as(script, *flags)
    return parse_args


TRAINING = {script: row for script, row in lessons().items() if row["epochs"]}  # lessons.csv: all but 08


@pytest.mark.parametrize("count", [1, 4])
@pytest.mark.parametrize("script", TRAINING)
def test_on_a_gpu_machine_each_lesson_runs_where_it_says(gpus, parse, capsys, restore_signals, script, count):
    """With 1 GPU and with 4 (torch.cuda's answers stood in for): --smoke runs on the CPU, as its
    help says, in its CPU processes; a full run takes its processes on the GPUs where there are
    enough, or says in one line that there are not (exit 2); --smoke --accelerator cuda likewise."""
    gpus(count)
    row = TRAINING[script]
    smoke = parse("--smoke", script=script)
    assert (smoke.accelerator, smoke.devices) == ("cpu", min(row["devices"], 2))
    for flags in ([], ["--smoke", "--accelerator", "cuda"]):
        if row["devices"] <= count:
            args = parse(*flags, script=script)
            assert (args.accelerator, args.devices) == ("cuda", row["devices"])
        else:
            with pytest.raises(SystemExit) as exit_info:
                parse(*flags, script=script)
            err = capsys.readouterr().err.strip()
            assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
            assert f"asked for {row['devices']} GPU(s) per machine (--devices {row['devices']}) but this machine has {count}" in err


@pytest.mark.parametrize("count", [1, 4])
def test_the_default_benchmark_runs_what_the_gpus_can_and_names_the_rest(gpus, restore_signals, count):
    """benchmark.py with its default lessons: each it keeps fits the GPUs, each it drops is named
    with the GPUs it needs; --smoke runs the scripts, and so their bare loops, on the CPU."""
    import benchmark
    from benchmarks.runs import processes_of
    gpus(count)
    args = benchmark.parse_args([])
    assert args.accelerator == "cuda" and args.runs
    assert all(processes_of(script, args.devices) <= count for script, _ in args.runs)
    kept = {script for script, _ in args.runs}
    dropped = [s for s in TRAINING if s[:2] != "00" and s not in kept]
    assert [line.split(" needs ")[0] for line in args.skipped] == dropped
    assert all(f"needs {processes_of(s, 1)} GPUs and this machine has {count}" in line
               for s, line in zip(dropped, args.skipped))
    assert benchmark.parse_args(["--smoke"]).accelerator == "cpu"


def test_the_gpus_too_few_for_a_lesson_are_one_line(gpus, parse, capsys):
    gpus(2)
    with pytest.raises(SystemExit) as exit_info:
        parse()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "asked for 4 GPU(s) per machine (--devices 4) but this machine has 2: python " in err
    assert err.strip().endswith("05_fabric-vit-mixed-ddp.py --devices 2 runs on them.")  # the command that runs there
    assert parse("--devices", "2").devices == 2


class CudaStandIn:
    """torch.cuda's timing, memory and name calls, counted."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name, result in (("synchronize", None), ("reset_peak_memory_stats", None),
                             ("max_memory_reserved", 3.04e9), ("get_device_name", "NVIDIA H200")):
            monkeypatch.setattr(torch.cuda, name, self.recorder(name, result))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def recorder(self, name, result):
        def call(*args, **kwargs):
            self.calls.append(name)
            return result
        return call

    def count(self, name):
        return sum(call == name for call in self.calls)


@pytest.fixture
def restore_signals():
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in handlers.items():
        signal.signal(s, handler)


def test_on_a_gpu_the_keeper_waits_for_it_only_to_time(monkeypatch, parse, restore_signals, tmp_path):
    """RunKeeper with accelerator cuda: two synchronisations an epoch (the timer's start and end),
    never one per step; the peak reset once, after the untimed warm-up; the record's memory
    and device name from torch.cuda."""
    cuda = CudaStandIn(monkeypatch)
    args = parse("--smoke", "--epochs", "2", script="01_pytorch-vit.py")
    args.accelerator = "cuda"  # as parse_args decides on a GPU machine (the test above)
    steps = 10

    def keeper_and_model():
        model = lu.build_vit(None, args)
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-5)
        keeper = RunKeeper(args)
        keeper.__enter__()  # as the lesson's `with` block does; left below as a run that got to its end
        keeper.start()
        keeper.before_training(model, optimizer, train_loader=[None] * steps)
        return keeper, model, optimizer

    keeper, model, optimizer = keeper_and_model()
    for _ in range(steps):
        keeper.batch_done(torch.tensor(1.0), batch_size=4)
    assert cuda.count("synchronize") == 2 and cuda.count("reset_peak_memory_stats") == 1
    keeper.checkpoint(val_acc=0.5)
    keeper.__exit__(None, None, None)

    args.resume = True
    keeper, model, optimizer = keeper_and_model()
    for _ in range(steps):
        keeper.batch_done(torch.tensor(1.0), batch_size=4)
    assert cuda.count("synchronize") == 4 and cuda.count("reset_peak_memory_stats") == 2
    keeper.checkpoint(val_acc=0.6)
    keeper.finish(1.0, 0.9, model)
    keeper.__exit__(None, None, None)
    record = json.loads((tmp_path / args.results).read_text().splitlines()[-1])
    assert (record["peak_memory_gb"], record["device_name"], record["accelerator"]) == \
        (3.04, "NVIDIA H200", "cuda")


def test_a_gpus_peak_leaves_out_the_warm_up_where_an_epoch_is_shorter(monkeypatch, parse, restore_signals, tmp_path):
    """Epochs of 2 steps: the first checkpoint comes before the peak's reset (after the warm-up's 3rd step), so the
    peak it would read, the warm-up's, is not the record's."""
    CudaStandIn(monkeypatch)
    peak = {"bytes": 9e9}  # the warm-up's (compilation's, say), until torch.cuda's peak is reset
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: peak.update(bytes=3.04e9))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: peak["bytes"])
    args = parse("--smoke", "--epochs", "2", script="01_pytorch-vit.py")
    args.accelerator = "cuda"
    model = lu.build_vit(None, args)
    keeper = RunKeeper(args)
    keeper.__enter__()
    keeper.start()
    keeper.before_training(model, torch.optim.Adam(model.parameters(), lr=5e-5), train_loader=[None] * 2)
    for _ in range(2):
        for _ in range(2):
            keeper.batch_done(torch.tensor(1.0), batch_size=4)
        keeper.checkpoint(val_acc=0.5)
    keeper.finish(1.0, 0.9, model)
    keeper.__exit__(None, None, None)
    assert json.loads((tmp_path / args.results).read_text().splitlines()[-1])["peak_memory_gb"] == 3.04


def test_a_gpu_missing_from_the_table_takes_lightnings(monkeypatch):
    """benchmark.py's MFU on a GPU that its own dense-peak table lacks: Lightning's figure."""
    from benchmarks import peaks
    from lightning.fabric.utilities.throughput import _CUDA_FLOPS
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A10G")
    assert peaks.peak_tflops("NVIDIA A10G", "bf16-mixed") == _CUDA_FLOPS["a10g"][torch.bfloat16] / 1e12
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peaks.peak_tflops("NVIDIA A10G", "bf16-mixed") is None
