"""Kornia's augmentations by name in a preset (`kornia.<Name>: {Kornia's keyword arguments}`):
through the real augment stage, keyed per image, and refused with exit 2 before Ray starts."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from augment.kornia_ops import kornia_choices
from augment.pipeline import Pipeline, to_canvas
from augment.presets import PresetError, load_preset, preset_from_dict
from tests.rng_twins import reference_seed
from training.stream.stage import AugmentStage, StageArgs

B = 16
BASE = [{"random_crop": {"size": 32, "padding": 4}}, {"horizontal_flip": {"p": 0.5}}]


def _preset(*extra) -> dict:
    return {"name": "k", "train": [*BASE, *extra], "eval": [{"center_crop": {"size": 32}}]}


def _batch(n=B, seed=0) -> dict:
    """What Ray Data hands the stage: decoded uint8 images, labels, int64 keys and the epoch read for."""
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
        "label": np.arange(n) % 3,
        "key": (np.arange(n, dtype=np.int64) * 7919 + 11),
        "epoch": np.zeros(n, dtype=np.int64),
    }


def _stage(*extra, seed=3) -> AugmentStage:
    return AugmentStage(StageArgs.of(_preset(*extra), train=True, seed=seed), device="cpu")


def _take(batch: dict, idx) -> dict:
    return {k: v[idx] for k, v in batch.items()}


def test_kornia_blur_runs_in_the_stage_on_the_fixed_size_batch_after_the_first_op():
    """With a fixed sigma the blurred batch is Kornia's blur of the same batch without it: the
    op runs after our crop and flip, which keep their draws (each op has its own stream)."""
    from kornia.filters import gaussian_blur2d

    batch = _batch()
    plain = _stage()(batch)["image"]
    blur = {"kornia.RandomGaussianBlur": {"kernel_size": [5, 5], "sigma": [1.5, 1.5], "p": 1.0}}
    out = _stage(blur)(batch)
    x = torch.from_numpy(plain).permute(0, 3, 1, 2).float() / 255
    ref = gaussian_blur2d(x, (5, 5), (1.5, 1.5), border_type="reflect").mul(255).round().permute(0, 2, 3, 1)
    assert out["image"].shape == (B, 32, 32, 3) and out["image"].dtype == np.uint8
    assert np.abs(out["image"].astype(int) - ref.numpy().astype(int)).max() <= 1
    assert list(out["label"]) == list(batch["label"]) and list(out["key"]) == list(batch["key"])


def test_kornia_rotation_in_the_stage_is_keyed_per_image():
    """RandomRotation by exactly 90 degrees with p=0.5: each image is either untouched or
    rot90'd; which ones is decided by the image's key, whatever batch it comes in."""
    batch = _batch()
    plain = _stage()(batch)["image"]
    rot = {"kornia.RandomRotation": {"degrees": [90.0, 90.0], "p": 0.5}}
    out = _stage(rot)(batch)["image"].astype(int)
    turned = np.rot90(plain, k=1, axes=(1, 2)).astype(int)
    same = np.abs(out - plain.astype(int)).reshape(B, -1).max(1) == 0
    rotated = np.abs(out - turned).reshape(B, -1).max(1) <= 1  # bilinear at 90 degrees: exact up to rounding
    assert (same ^ rotated).all() and 0 < same.sum() < B
    perm = np.random.default_rng(1).permutation(B)
    again = _stage(rot)(_take(batch, perm))["image"]  # another stage, other batch order
    assert np.array_equal(again, out[perm])


KORNIA_CASES = {  # a spread of Kornia's list: blurs, geometry, colour, noise, and each way of batching
    "kornia.RandomGaussianBlur": {"kernel_size": [3, 3], "sigma": [0.1, 2.0], "p": 0.5},
    "kornia.RandomMotionBlur": {"kernel_size": [3, 7], "angle": 35.0, "direction": 0.5, "p": 0.5},  # group
    "kornia.RandomPerspective": {"distortion_scale": 0.3, "p": 0.5},
    "kornia.RandomAffine": {"degrees": 15.0, "translate": [0.1, 0.1], "p": 0.5},
    "kornia.RandomElasticTransform": {"kernel_size": [15, 15], "sigma": [4.0, 4.0], "p": 0.5},
    "kornia.ColorJitter": {"brightness": 0.3, "contrast": 0.3, "saturation": 0.3, "hue": 0.1, "p": 0.5},
    "kornia.RandomSolarize": {"p": 0.5},
    "kornia.RandomPosterize": {"bits": 3, "p": 0.5},
    "kornia.RandomGaussianNoise": {"std": 0.1, "p": 0.5},
    "kornia.RandomChannelDropout": {"p": 0.5},  # one image at a time
    "kornia.RandomErasing": {"p": 0.5},
}


def _applied(name: str, params: dict, keys, *, seed: int, epoch: int, stream: int) -> list[bool]:
    """Which images a `kornia.<Name>` op at `stream` transforms, worked out apart from the
    stage: a fresh Kornia module's own sampler, run for each image alone from the image's
    seed (tests/rng_twins.py reference_seed, the pure-Python twin), as the contract says."""
    import kornia.augmentation as K

    module = getattr(K, name.split(".", 1)[1])(**{k: tuple(v) if isinstance(v, list) else v for k, v in params.items()})
    flags = []
    for key in keys:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(reference_seed(int(key), seed, epoch, stream, 0))
            flags.append(bool(module.forward_parameters(torch.Size((1, 3, 32, 32)))["batch_prob"][0]))
    return flags


@pytest.mark.parametrize("name", sorted(KORNIA_CASES))
def test_kornia_op_through_the_stage(name):
    """Shape and dtype; at p=0.5 exactly the images whose own draw says so are changed;
    reproducible from (seed, epoch, key) in a fresh stage; the same per image in a shuffled
    batch and in a smaller one; other epochs draw anew."""
    assert name in kornia_choices()
    spec = {name: KORNIA_CASES[name]}
    batch = _batch()
    out = _stage(spec)(batch)["image"]
    assert out.shape == (B, 32, 32, 3) and out.dtype == np.uint8
    changed = (out != _stage()(batch)["image"]).reshape(B, -1).any(1)
    applied = _applied(name, KORNIA_CASES[name], batch["key"], seed=3, epoch=0, stream=3)
    assert changed.tolist() == applied
    # each of these ops draws its apply flag first, from the same per-image seeds: the same 7
    assert sum(applied) == 7
    assert np.array_equal(_stage(spec)(batch)["image"], out)
    perm = np.random.default_rng(2).permutation(B)
    assert np.array_equal(_stage(spec)(_take(batch, perm))["image"], out[perm])
    assert np.array_equal(_stage(spec)(_take(batch, slice(3, 8)))["image"], out[3:8])
    pipe = Pipeline(preset_from_dict(_preset(spec)).train, seed=3)
    canvas, sizes = to_canvas(batch["image"])
    keys = torch.from_numpy(batch["key"])
    assert np.array_equal(pipe(canvas, sizes, keys, epoch=0).numpy(), out)
    assert not torch.equal(pipe(canvas, sizes, keys, epoch=1), pipe(canvas, sizes, keys, epoch=0))


def test_the_probe_picks_the_cheapest_way_that_keeps_each_image_its_own():
    """Per-call parameters (MotionBlur's kernel size) need groups; position-indexed ones
    (ChannelDropout's batch_idx) one image at a time; the rest stack into one call."""
    pipe = Pipeline(
        preset_from_dict(
            _preset(*({n: KORNIA_CASES[n]} for n in ("kornia.RandomMotionBlur", "kornia.RandomChannelDropout")))
        ).train,
        seed=0,
    )
    assert [op.kornia.modes[3, 32, 32] for op in pipe.at_epoch(0).ops[2:]] == ["group", "one"]
    blur = Pipeline(
        preset_from_dict(_preset({"kornia.RandomGaussianBlur": KORNIA_CASES["kornia.RandomGaussianBlur"]})).train,
        seed=0,
    )
    assert blur.at_epoch(0).ops[2].kornia.modes[3, 32, 32] == "stack"


BAD = {
    "unknown name": ("kornia.RandomGausianBlur: {}", "did you mean kornia.RandomGaussianBlur"),
    "3D op": ("kornia.RandomAffine3D: {degrees: 10}", "is a 3D (volume) augmentation"),
    "mix op": ("kornia.RandomMixUpV2: {}", "top-level `mix:` key"),
    "sized op": ("kornia.RandomResizedCrop: {size: [32, 32]}", "sets its own output size"),
    "unknown argument": (
        "kornia.RandomGaussianBlur: {kernel_size: 3, sigma: [0.1, 2.0], sigmaa: 1}",
        "unknown parameter(s) ['sigmaa']; valid: ['kernel_size', 'sigma'",
    ),
    "bad value, found when built": (
        "kornia.RandomPerspective: {distortion_scale: 3.0}",
        "must be a scalar within [0, 1]",
    ),
    "bad value, found when applied": (
        "kornia.RandomGaussianBlur: {kernel_size: [4, 4], sigma: [0.1, 2.0]}",
        "Kernel size must be an odd integer",
    ),
    "missing argument": ("kornia.RandomMotionBlur: {kernel_size: 3}", "missing 2 required positional arguments"),
    "batch-level draw": ("kornia.RandomAffine: {degrees: 10, same_on_batch: true}", "['same_on_batch'] not supported"),
    "parameters not a mapping": ("kornia.RandomInvert: 0.5", "are a mapping like {p: 0.5}, got 0.5"),
    "first op": (None, "the first op, and only the first, is a geometry op"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_kornia_op_exits_2_with_one_line_before_ray_starts(case, tree, tmp_path, monkeypatch, capsys):
    import jobs.train

    op, message = BAD[case]
    train = "  - kornia.RandomInvert: {}\n" if op is None else f"  - random_crop: {{size: 32}}\n  - {op}\n"
    f = tmp_path / "bad.yaml"
    f.write_text(f"train:\n{train}eval:\n  - center_crop: {{size: 32}}\n")
    monkeypatch.setattr(jobs.train, "connect", lambda *a: pytest.fail("Ray was started"))
    assert jobs.train.main(["--data", str(tree), "--preset", str(f), "--storage-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err


def test_preview_shows_kornia_ops(tree, tmp_path):
    """jobs.preview draws train views through the same pipeline: a Kornia op changes them, the eval view stays."""
    from PIL import Image

    from augment.preview import augment_views
    from jobs.preview import main

    f = tmp_path / "k.yaml"
    f.write_text(
        "train:\n  - random_crop: {size: 32}\n  - kornia.RandomGaussianBlur: {kernel_size: [5, 5], sigma: [2.0, 2.0], "
        "p: 1.0}\neval:\n  - center_crop: {size: 32}\n"
    )
    out = tmp_path / "grid.png"
    assert (
        main(["--data", str(tree), "--preset", str(f), "--out", str(out), "--classes", "1", "--augmentations", "1"])
        == 0
    )
    with Image.open(out) as img:
        assert img.size[0] > img.size[1] > 50
    images = list(_batch(4)["image"])
    keys = [1, 2, 3, 4]
    ev, (tr,) = augment_views(images, keys, load_preset(str(f)), seed=0, augmentations=1)
    plain_ev, (plain_tr,) = augment_views(images, keys, preset_from_dict(_preset()), seed=0, augmentations=1)
    assert np.array_equal(ev, plain_ev) and tr.std() < np.stack(images).std()  # blurred: smoother than the originals


def test_a_preset_file_with_kornia_ops_round_trips(tmp_path):
    f = tmp_path / "k.yaml"
    f.write_text(
        "train:\n  - random_resized_crop: {size: 24}\n  - kornia.RandomGaussianBlur: {kernel_size: [5, 5], "
        "sigma: [0.1, 2.0], p: 0.3}\n  - kornia.RandomPerspective: {distortion_scale: 0.3, p: 0.2}\n"
        "eval:\n  - resize_center_crop: {resize: 28, size: 24}\n"
    )
    p = load_preset(str(f))
    assert p.train[1] == {"kornia.RandomGaussianBlur": {"kernel_size": [5, 5], "sigma": [0.1, 2.0], "p": 0.3}}
    assert preset_from_dict(p.to_dict()) == p
    with pytest.raises(PresetError, match="unknown op 'RandomGaussianBlur'; valid ops: .* or a Kornia augmentation"):
        preset_from_dict(
            {
                "train": [{"random_crop": {"size": 8}}, {"RandomGaussianBlur": {}}],
                "eval": [{"center_crop": {"size": 8}}],
            }
        )


def test_built_in_presets_do_not_import_kornia():
    """A Ray Data task that augments with a built-in preset pays no Kornia import; hue jitter does import it."""
    code = """
import sys, numpy as np
from augment.presets import PRESETS
from training.stream.stage import AugmentStage, StageArgs
batch = {"image": np.zeros((4, 40, 48, 3), np.uint8), "label": np.arange(4), "key": np.arange(4)}
batch["epoch"] = np.zeros(4, np.int64)
for name in PRESETS:
    for train in (True, False):
        AugmentStage(StageArgs(PRESETS[name], train=train, seed=0), device="cpu")(batch)
print("kornia" in sys.modules)
hue = dict(PRESETS["cifar"].to_dict(), train=[{"center_crop": {"size": 32}}, {"color_jitter": {"hue": 0.1}}])
AugmentStage(StageArgs.of(hue, train=True, seed=0), device="cpu")(batch)
print("kornia" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]
