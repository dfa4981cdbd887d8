"""The real (non-smoke) path, offline, at its smallest: CIFAR-10 downloaded (from a local server)
once per machine while two processes start at once, the ImageNet weights from torch's hub cache,
ViT-B/16 at 224x224 under DDP, one training step."""
import http.server
import os
import tarfile
import threading

import pytest
import torch

from conftest import in_memory, read_records, run_script, script_env, write_fake_cifar10
from run_keeping.reading import whole

POINT_CIFAR10_AT_LOCAL_SERVER = """
import os
import torchvision.datasets.cifar as cifar
import torchvision.datasets.utils as utils
cifar.CIFAR10.url = os.environ["HOOK_FAKE_CIFAR10_URL"]
cifar.CIFAR10.tgz_md5 = None  # a fake archive cannot match the real checksums
cifar.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)
_download_url = utils.download_url
def download_url(*args, **kwargs):  # the real download, noted in a file every process shares
    with open(os.environ["HOOK_DOWNLOAD_LOG"], "a") as log:
        log.write(f"{os.environ.get('LOCAL_RANK', '0')}\\n")
    return _download_url(*args, **kwargs)
utils.download_url = download_url
"""


class CountingServer(http.server.ThreadingHTTPServer):
    requests = 0


def serve(directory):
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(directory), **kwargs)

        def do_GET(self):
            assert isinstance(self.server, CountingServer)
            self.server.requests += 1
            super().do_GET()

        def log_message(self, format, *args):
            pass
    server = CountingServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.slow
def test_cifar10_downloaded_once_and_the_full_model_trains(tmp_path):
    # CIFAR-10's archive, in its real layout, behind a local server that counts downloads
    source = tmp_path / "source"
    write_fake_cifar10(source, per_batch=4, num_test=4)
    (tmp_path / "www").mkdir()
    with tarfile.open(tmp_path / "www" / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(source / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    # the ImageNet weights where torchvision looks for them
    from torchvision.models import ViT_B_16_Weights, vit_b_16
    cache = tmp_path / "torch-home" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(vit_b_16(weights=None).state_dict(),
               cache / os.path.basename(ViT_B_16_Weights.IMAGENET1K_V1.url))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(POINT_CIFAR10_AT_LOCAL_SERVER)

    server = serve(tmp_path / "www")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/cifar-10-python.tar.gz"
        env = script_env(tmp_path, PYTHONPATH=str(site), HOOK_FAKE_CIFAR10_URL=url,
                         HOOK_DOWNLOAD_LOG=str(tmp_path / "downloads.log"),
                         no_proxy="127.0.0.1", NO_PROXY="127.0.0.1")
        with in_memory() as scratch:  # its 1 GB checkpoint, not read here: written to memory
            proc = run_script("05_fabric-vit-mixed-ddp.py", "--accelerator", "cpu", "--devices", "2",
                              "--batch-size", "1", "--max-steps", "1", "--epochs", "1", "--num-workers", "0",
                              "--checkpoint-dir", str(scratch / "checkpoints"), cwd=tmp_path, env=env, timeout=300)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-3000:]
    # two processes started at once; local rank 0 downloaded, the other waited and found it
    assert (tmp_path / "downloads.log").read_text().split() == ["0"]
    assert server.requests >= 1  # torchvision's redirect check is a GET of its own
    assert (tmp_path / "data" / "cifar-10-batches-py" / "data_batch_5").exists()
    record = read_records(tmp_path / "results" / "runs.jsonl")[-1]
    assert (record["kind"], record["world_size"], record["max_steps"]) == ("full", 2, 1)
    assert 0.0 <= record["test_acc"] <= 1.0 and len(record["val_acc"]) == 1
    assert "Parameters held per process: 85,806,346, 85,806,346 of 85,806,346" in proc.stdout  # ViT-B/16, 10 classes

    # the finetuned model: one file that plain PyTorch and torchvision load, as the README shows
    # (named by the settings that differ from the talk's: it is no talk's run, and cut short)
    path = tmp_path / record["model_file"]
    assert record["model_file"] == "models/05_fabric-vit-mixed-ddp-epochs1-batch1-max-steps1-procs2.pt"
    assert not whole(record) and "CUT SHORT by --max-steps 1" in proc.stdout
    model = vit_b_16()
    model.heads.head = torch.nn.Linear(768, 10)
    model.load_state_dict(torch.load(path))
    # 08 takes no cut-short run as "the newest model" (test_load_and_evaluate.py); given it, it
    # loads it with Fabric on one device and finds the training run's test accuracy again
    proc = run_script("08_load-and-evaluate.py", "--accelerator", "cpu", "--no-download",
                      "--num-workers", "0", "--model", record["model_file"], cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Test accuracy {record['test_acc'] * 100:.2f}%" in proc.stdout
    assert f"in {record['precision']} (saved by 05_fabric-vit-mixed-ddp.py" in proc.stdout  # bf16-mixed where it ran
