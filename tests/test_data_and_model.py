"""The CIFAR-10 loader on CIFAR-10's real on-disk format, the --smoke digits, and the
ImageNet weights from torch's hub cache, all offline."""
import argparse
import os

import pytest
import torch

import local_utilities as lu
from conftest import OFFLINE, write_fake_cifar10


@pytest.fixture
def offline(monkeypatch, tmp_path):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    torch.hub.set_dir(str(tmp_path / "torch-home" / "hub"))
    yield
    torch.hub.set_dir(os.path.join(os.path.expanduser("~"), ".cache", "torch", "hub"))


@pytest.fixture
def fake_cifar(tmp_path, monkeypatch):
    """The real file layout and pickles; only torchvision's md5 check is replaced by 'exists'."""
    import torchvision.datasets.cifar as cifar
    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))
    batches = write_fake_cifar10(tmp_path / "data")
    return tmp_path / "data", batches


def loader_args(data_dir, **overrides):
    values = dict(smoke=False, synthetic=False, data_dir=str(data_dir), no_download=True,
                  batch_size=4, num_workers=0, seed=123, world_size=1, max_steps=None,
                  micro_batches=1, accelerator="cpu")
    values.update(overrides)
    values["data_parallel"] = values["world_size"]
    return argparse.Namespace(**values)


def test_cifar10_split_and_transforms(fake_cifar):
    data_dir, batches = fake_cifar
    train, val, test = lu.get_dataloaders(loader_args(data_dir))
    n_train = 5 * 20
    assert (len(train.dataset), len(val.dataset), len(test.dataset)) == (90, 10, 20)
    assert len(train) == 90 // 4 and train.drop_last and not val.drop_last  # drop_last: train only
    features, targets = next(iter(train))
    assert features.shape == (4, 3, 224, 224) and features.dtype == torch.float32
    assert 0.0 <= features.min() and features.max() <= 1.0
    assert targets.dtype == torch.int64
    # validation is the last slice of the training data, in order, not shuffled
    last_batch = batches["data_batch_5"]
    image, label = val.dataset[9]
    assert label == last_batch["labels"][-1]
    colour = torch.tensor(last_batch["data"][-1].reshape(3, 1024)[:, 0], dtype=torch.float32)
    assert torch.allclose(image, (colour / 255).view(3, 1, 1).expand(3, 224, 224), atol=1e-6)
    first_train_image, _ = train.dataset[0]
    first = torch.tensor(batches["data_batch_1"]["data"][0].reshape(3, 1024)[:, 0]) / 255
    assert torch.allclose(first_train_image[:, 0, 0], first.float(), atol=1e-6)
    assert n_train == len(train.dataset) + len(val.dataset)


def test_training_shuffles_and_evaluation_does_not(fake_cifar):
    data_dir, _ = fake_cifar
    train, val, _ = lu.get_dataloaders(loader_args(data_dir))
    assert isinstance(train.sampler, torch.utils.data.RandomSampler)
    assert isinstance(val.sampler, torch.utils.data.SequentialSampler)


def test_cifar10_missing_with_no_download(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lu.get_dataloaders(loader_args(tmp_path / "empty"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "empty") in err and "--no-download" in err and lu.CIFAR10_URL in err
    assert "download=True" not in err  # torchvision's own hint, which our flags don't have
    assert len(err.strip().splitlines()) == 1


def test_cifar10_download_impossible(tmp_path, capsys, offline):
    with pytest.raises(SystemExit) as exit_info:
        lu.get_dataloaders(loader_args(tmp_path / "data", no_download=False))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "could not be downloaded" in err and str(tmp_path / "data") in err
    assert lu.CIFAR10_URL in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "data").exists()  # the folder this run made, removed again


def test_smoke_digits_split_is_fixed_and_learnable_shape():
    train, val, test = lu.digits_datasets()
    assert (len(val), len(test)) == lu.SMOKE_SPLIT and len(train) + len(val) + len(test) == 1797
    image, label = train[0]
    assert image.shape == (3, 32, 32) and 0 <= image.min() and image.max() <= 1
    again = lu.digits_datasets()[2]
    assert torch.equal(test.tensors[0], again.tensors[0])  # the same split every time
    assert set(test.tensors[1].tolist()) == set(range(10))


def test_max_steps_keeps_that_many_batches_per_process(fake_cifar):
    data_dir, _ = fake_cifar
    train, val, test = lu.get_dataloaders(loader_args(data_dir, max_steps=3, world_size=2))
    assert len(train.dataset) == 3 * 4 * 2 and len(val.dataset) == 10 and len(test.dataset) == 20


def test_the_talks_batch_and_workers(fake_cifar):
    data_dir, _ = fake_cifar
    train, val, test = lu.get_dataloaders(loader_args(data_dir, batch_size=16, num_workers=4))
    assert all(loader.batch_size == 16 and loader.num_workers == 4 for loader in (train, val, test))


def test_synthetic_data_has_the_runs_shape():
    args = loader_args("unused", synthetic=True, max_steps=3, batch_size=2)
    train, val, test = lu.get_dataloaders(args)
    features, targets = next(iter(train))
    assert features.shape == (2, 3, 224, 224) and len(train) == 3
    args = loader_args("unused", synthetic=True, smoke=True, max_steps=5, batch_size=4)
    assert next(iter(lu.get_dataloaders(args)[0]))[0].shape == (4, 3, 32, 32)
    # evaluation: one image per data-parallel process (a synthetic run measures no accuracy)
    assert len(val.dataset) == len(test.dataset) == 1


def test_on_a_gpu_synthetic_batches_come_from_its_own_memory():
    """A GPU's synthetic run holds one step's images on the device and cycles through them, so a
    batch is never collated in the CPU's memory and copied over (its images/s would be the
    loader's); a CPU's holds them all, as the memory arithmetic counts. The device here is
    torch's meta device, which takes the place of a GPU's memory."""
    args = loader_args("unused", synthetic=True, max_steps=5, batch_size=4)
    train, val, _ = lu.synthetic_datasets(args, torch.device("meta"))
    held = train.dataset.tensors[0]
    assert len(train) == 20 and held.shape == (4, 3, 224, 224) and held.device.type == "meta"
    assert train[17][0].device.type == "meta" and len(val) == 1
    on_cpu, _, _ = lu.synthetic_datasets(args)
    assert on_cpu.dataset.tensors[0].shape == (20, 3, 224, 224) and on_cpu.dataset.tensors[0].device.type == "cpu"


def test_micro_batches_split_each_batch():
    """12-14's loader: --max-steps 3 batches of 16, handed out as 12 micro-batches of 4."""
    args = loader_args("unused", synthetic=True, smoke=True, max_steps=3, batch_size=16, micro_batches=4)
    train = lu.get_dataloaders(args)[0]
    assert train.batch_size == 4 and len(train) == 12


def test_pretrained_weights_from_the_hub_cache(tmp_path, offline):
    """01's model construction without network: torchvision finds the file it expects."""
    from torchvision.models import ViT_B_16_Weights, vit_b_16
    weights = ViT_B_16_Weights.IMAGENET1K_V1
    torch.manual_seed(0)
    state = vit_b_16(weights=None).state_dict()
    state["class_token"].fill_(0.125)
    cache = tmp_path / "torch-home" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(state, cache / os.path.basename(weights.url))
    model = lu.build_vit("IMAGENET1K_V1", argparse.Namespace(smoke=False, synthetic=False))
    assert torch.all(model.class_token == 0.125)
    assert torch.equal(model.conv_proj.weight, state["conv_proj.weight"])
    assert model.hidden_dim == 768


def test_pretrained_weights_not_downloadable(tmp_path, capsys, offline):
    with pytest.raises(SystemExit) as exit_info:
        lu.build_vit("IMAGENET1K_V1", argparse.Namespace(smoke=False, synthetic=False))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "vit_b_16-c867db91.pth" in err and "could not be loaded" in err
    assert str(tmp_path / "torch-home") in err


def test_smoke_and_synthetic_never_download(tmp_path, offline):
    small = lu.build_vit("IMAGENET1K_V1", argparse.Namespace(smoke=True, synthetic=False))
    assert small.image_size == 32 and small.hidden_dim == 128
    big = lu.build_vit("IMAGENET1K_V1", argparse.Namespace(smoke=False, synthetic=True))
    assert big.hidden_dim == 768
    assert not (tmp_path / "torch-home").exists()
