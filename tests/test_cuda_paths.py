"""The branches only a CUDA device takes, run on this CPU with the device stood in for: only
torch.cuda's answers are replaced (how many GPUs, their name, their memory figures, their
random state), never the code that asks. (What needs a real GPU: gpu_check.sh.)"""
import json
import signal
import sys

import pytest
import torch

import local_utilities as lu
from run_keeping.keeper import RunKeeper


@pytest.fixture
def gpus(monkeypatch):
    """A machine with `n` CUDA GPUs, as torch.cuda reports them."""
    def machine(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    return machine


@pytest.fixture
def parse(monkeypatch):
    def parse_args(*flags, script="05_fabric-vit-mixed-ddp.py", devices=4):
        monkeypatch.setattr(sys, "argv", [script, *flags])
        return lu.parse_args(epochs=3, devices=devices)
    return parse_args


def test_a_machine_with_gpus_runs_on_them(gpus, parse, capsys):
    gpus(4)
    args = parse()
    assert (args.accelerator, args.devices, args.batch_size) == ("cuda", 4, 16)
    # --smoke takes the GPUs too, all of them (the CPU's cap of 2 processes is the CPU's), and
    # splits the talk's batch of 16 among them
    args = parse("--smoke")
    assert (args.accelerator, args.devices, args.batch_size) == ("cuda", 4, 4)
    gpus(2)
    with pytest.raises(SystemExit) as exit_info:
        parse()
    assert exit_info.value.code == 2
    assert "asked for 4 GPU(s) per machine (--devices 4) but this machine has 2" in capsys.readouterr().err
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
    args = parse("--smoke", "--epochs", "2", script="01_pytorch-vit.py", devices=None)
    args.accelerator = "cuda"  # as parse_args decides on a GPU machine (the test above)
    steps = 10

    def keeper_and_model():
        model = lu.build_vit(None, args)
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-5)
        keeper = RunKeeper(args)
        keeper.resume(model, optimizer, train_loader=[None] * steps)
        return keeper, model, optimizer

    keeper, model, optimizer = keeper_and_model()
    for _ in range(steps):
        keeper.batch_done(torch.tensor(1.0), batch_size=4)
    assert cuda.count("synchronize") == 2 and cuda.count("reset_peak_memory_stats") == 1
    keeper.checkpoint(0, model, optimizer, val_acc=0.5)
    keeper.__exit__(None, None, None)  # as leaving the `with` block does

    args.resume = True
    keeper, model, optimizer = keeper_and_model()
    for _ in range(steps):
        keeper.batch_done(torch.tensor(1.0), batch_size=4)
    assert cuda.count("synchronize") == 4 and cuda.count("reset_peak_memory_stats") == 2
    keeper.checkpoint(1, model, optimizer, val_acc=0.6)
    keeper.finish(1.0, 0.9, model)
    keeper.__exit__(None, None, None)
    record = json.loads((tmp_path / args.results).read_text().splitlines()[-1])
    assert (record["peak_memory_gb"], record["device_name"], record["accelerator"]) == \
        (3.04, "NVIDIA H200", "cuda")


def test_a_gpu_missing_from_the_table_takes_lightnings(monkeypatch):
    """benchmark.py's MFU on a GPU that its own dense-peak table lacks: Lightning's figure."""
    from benchmarks import peaks
    from lightning.fabric.utilities.throughput import _CUDA_FLOPS
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A10G")
    assert peaks.peak_tflops("NVIDIA A10G", "bf16-mixed") == _CUDA_FLOPS["a10g"][torch.bfloat16] / 1e12
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peaks.peak_tflops("NVIDIA A10G", "bf16-mixed") is None
