"""The smoke ViT's pretrained weights (the demo's ImageNet): made by make_smoke_weights.py from
printed digits, kept in the repository with their provenance, loaded where a full run loads
IMAGENET1K_V1."""
import argparse
import hashlib
import json
import subprocess
import sys

import pytest
import torch

import local_utilities as lu
import make_smoke_weights as msw
from conftest import ROOT, script_env


def test_the_weights_file_is_what_its_provenance_says():
    provenance = json.loads(lu.SMOKE_WEIGHTS.with_suffix(".json").read_text())
    assert provenance["sha256"] == hashlib.sha256(lu.SMOKE_WEIGHTS.read_bytes()).hexdigest()
    assert lu.SMOKE_WEIGHTS.stat().st_size <= 3 * 2**20
    assert "never seen" in provenance["not_used"] and provenance["steps"] > 0


def test_the_weights_read_printed_digits_and_random_init_does_not():
    """Unseen printed digits (another seed than the script's): the pretrained smoke ViT reads
    most of them, a random one a tenth."""
    grids, labels = msw.render_digits(300, seed=7)
    images, labels = msw.as_smoke_images(grids), torch.as_tensor(labels)
    pretrained = lu.build_vit("IMAGENET1K_V1", argparse.Namespace(smoke=True, synthetic=False))
    torch.manual_seed(0)
    random = lu.build_vit(None, argparse.Namespace(smoke=True, synthetic=False))
    assert msw.accuracy(pretrained, images, labels) >= 0.5
    assert msw.accuracy(random, images, labels) <= 0.25


def test_only_full_smoke_runs_load_them():
    args = argparse.Namespace(smoke=True, synthetic=False)
    assert lu.build_vit("IMAGENET1K_V1", args).init.startswith("pretrained on printed digits")
    assert vars(args) == {"smoke": True, "synthetic": False}  # the flags are read, never written
    for weights, synthetic in ((None, False), ("IMAGENET1K_V1", True)):
        args = argparse.Namespace(smoke=True, synthetic=synthetic)
        assert lu.build_vit(weights, args).init == "random init"


def test_the_printed_digits_look_like_the_handwritten_ones():
    """The pretext data in the smoke data's own form: 8x8 grids of 0..16, about as much ink."""
    grids, labels = msw.render_digits(500, seed=3)
    handwritten = lu.digits_datasets()[0].tensors[0]
    assert grids.shape == (500, 8, 8) and grids.min() == 0 and grids.max() == 16
    assert set(labels.tolist()) == set(range(10))
    ink = msw.as_smoke_images(grids).mean().item()
    assert abs(ink - handwritten.mean().item()) < 0.1


@pytest.mark.slow
def test_the_script_writes_weights_and_provenance(tmp_path):
    out = tmp_path / "w.pt"
    proc = subprocess.run([sys.executable, str(ROOT / "make_smoke_weights.py"), "--images", "300",
                           "--steps", "3", "--output", str(out)], cwd=tmp_path,
                          env=script_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = lu.smoke_vit()
    model.load_state_dict(torch.load(out, weights_only=True))
    provenance = json.loads(out.with_suffix(".json").read_text())
    assert provenance["steps"] == 3 and provenance["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
