"""What a newcomer meets with a folder of their own photos (issue: "the first hour"): a preset
that fits the data, and the one-line answers that come before Ray starts."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from jobs import preview
from tests.conftest import write_tree
from training.config import TrainConfig
from training.inputs import auto_preset, check_inputs, preset_name


def _photos(root, size=(500, 375), n=6):
    rng = np.random.default_rng(0)
    for cls in ("brick", "moss"):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(img).save(root / cls / f"{i}.jpg", quality=90)
    return root


@pytest.mark.parametrize(
    "make, expected, why",
    [
        (lambda p: _photos(p, (500, 375)), "imagenet", "photos, typically 500 x 375 px"),
        (lambda p: _photos(p, (143, 127)), "imagenet", "photos, typically 143 x 127 px"),
        (lambda p: write_tree(p, {"a": 6, "b": 6}, size=(32, 32)), "cifar", "thumbnails, typically 32 x 32 px"),
        (lambda p: write_tree(p, {"a": 6, "b": 6}, size=(64, 48)), "cifar", "thumbnails, typically 48 x 64 px"),
    ],
    ids=["photos", "small-photos", "cifar-size", "64px"],
)
def test_preset_auto_takes_the_imagenet_recipe_for_photos_and_the_cifar_one_for_thumbnails(
    make, expected, why, tmp_path
):
    root = make(tmp_path / "data")
    cfg, tree = check_inputs(TrainConfig(data=str(root), storage_path=str(tmp_path / "runs")))
    assert cfg.preset == "auto" and preset_name(cfg, tree) == expected and auto_preset(tree)[1] == why
    assert f"typically {tree.typical_size[0]} x {tree.typical_size[1]} px)" in tree.describe()
    explicit, _ = check_inputs(TrainConfig(data=str(root), preset="cifar", storage_path=str(tmp_path / "runs")))
    assert preset_name(explicit, tree) == "cifar"  # a preset named is a preset used


def test_a_tree_whose_headers_cannot_be_read_falls_back_to_its_file_sizes(tmp_path):
    root = _photos(tmp_path / "data", (400, 300))
    for f in root.rglob("*.jpg"):  # not images at all: no header, large files
        f.write_bytes(b"x" * 40_000)
    cfg, tree = check_inputs(TrainConfig(data=str(root), storage_path=str(tmp_path / "runs")))
    assert tree.typical_size is None and auto_preset(tree) == ("imagenet", "files of 39 KB on average")


def test_preview_shows_the_preset_training_would_pick(tmp_path, capsys):
    root = _photos(tmp_path / "data", (300, 200), n=2)
    assert preview.main(["--data", str(root), "--out", str(tmp_path / "p.png"), "--augmentations", "1"]) == 0
    out = capsys.readouterr().out
    assert "preset 'imagenet' (--preset auto: photos, typically 300 x 200 px)" in out
    assert Image.open(io.BytesIO((tmp_path / "p.png").read_bytes())).size[0] > 0
