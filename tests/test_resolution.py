"""--image-size and progressive resizing, without Ray. The training runs that use them end to
end are in tests/test_train_job.py (the two-worker run at 40 px, the deterministic runs with
a progressive resize that one of them resumes)."""

from __future__ import annotations

import pytest
import torch

from augment.pipeline import Pipeline, to_canvas
from augment.presets import PRESETS, PresetError, preset_from_dict
from augment.schedule import parse_resize, resize_side
from training.config import ConfigError, TrainConfig
from training.stream.stage import AugmentStage, StageArgs


def _canvas(b=6, h=32, w=32):
    images = torch.randint(0, 256, (b, h, w, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return (*to_canvas(images.numpy()), torch.arange(b, dtype=torch.int64))


def test_image_size_scales_a_presets_crops_and_keeps_the_eval_ratio():
    imagenet = PRESETS["imagenet"].at_size(160)
    assert imagenet.train[0] == {"random_resized_crop": {"size": 160, "scale": [0.08, 1.0], "ratio": [3 / 4, 4 / 3]}}
    assert imagenet.eval == ({"resize_center_crop": {"resize": 182, "size": 160}},)  # 256/224, floored as timm does
    assert imagenet.train[1:] == PRESETS["imagenet"].train[1:] and imagenet.image_size == 160
    assert PRESETS["imagenet"].at_size(224) == PRESETS["imagenet"]
    cifar = PRESETS["cifar"].at_size(40)
    assert cifar.train[0] == {"random_crop": {"size": 40, "padding": 5}}  # the padding scales with the crop
    assert cifar.eval == ({"center_crop": {"size": 40}},)
    # a file preset that trains below its eval size (FixRes) keeps that ratio too
    fixres = preset_from_dict(
        {
            "train": [{"random_resized_crop": {"size": 176}}],
            "eval": [{"resize_center_crop": {"resize": 256, "size": 224}}],
        }
    ).at_size(112)
    assert fixres.train_size == 88 and fixres.eval[0] == {"resize_center_crop": {"resize": 128, "size": 112}}
    canvas, sizes, keys = _canvas()
    for specs in (cifar.train, cifar.eval):
        assert Pipeline(specs, seed=0)(canvas, sizes, keys, 0).shape == (6, 40, 40, 3)
    with pytest.raises(PresetError, match="at least 8"):
        PRESETS["cifar"].at_size(4)


def test_progressive_resize_ramps_over_its_epochs_in_multiples_of_8():
    assert [resize_side("none", e, 3, 192) for e in range(3)] == [192] * 3
    assert [resize_side("160", e, 10, 192) for e in range(10)] == [160, 160, 168, 168, 176, 176, 184, 184, 192, 192]
    # FFCV's form: FROM until epoch FIRST, the full size from epoch LAST (1-based), linear between
    assert [resize_side("160:5-8", e, 10, 192) for e in range(10)] == [160] * 5 + [168, 184] + [192] * 3
    assert resize_side("24", 0, 1, 32) == 24 and resize_side("24:1-1", 1, 2, 32) == 32  # FFCV's ends win
    assert parse_resize("160:11-13", 16) == (160, 11, 13) and parse_resize("none") is None


@pytest.mark.parametrize(
    "spec, message",
    [
        ("big", "expected none, FROM"),
        ("160:8-5", "1 <= FIRST <= LAST"),
        ("4", "at least 8 px"),
        ("160:5-20", "past the last epoch"),
    ],
)
def test_a_bad_progressive_resize_names_the_valid_forms(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_resize(spec, 10)


def test_the_train_stage_makes_each_epochs_size_and_eval_stays_at_the_full_one():
    preset = PRESETS["cifar"].to_dict()
    train = AugmentStage(StageArgs.of(preset, train=True, seed=0, resize="16", epochs=3), device="cpu")
    canvas, sizes, keys = _canvas()
    sides = [train.pipeline(canvas, sizes, keys, e).shape[1] for e in (0, 1, 2, 0)]
    assert sides == [train.pipeline.size_at(e)[0] for e in (0, 1, 2, 0)] == [16, 24, 32, 16]
    assert train.pipeline.at_epoch(0).ops[0].padding == 2  # at 16 px, the padding is scaled too
    again = AugmentStage(StageArgs.of(preset, train=True, seed=0, resize="16", epochs=3), device="cpu")
    assert torch.equal(again.pipeline(canvas, sizes, keys, 1), train.pipeline(canvas, sizes, keys, 1))  # replayable
    val = AugmentStage(StageArgs.of(preset, train=False, seed=0, resize="16", epochs=3), device="cpu")
    assert val.pipeline.resize == "none" and val.pipeline(canvas, sizes, keys, 0).shape == (6, 32, 32, 3)


def test_progressive_resize_and_strength_schedules_compose():
    pipe = Pipeline(PRESETS["imagenet"].train, seed=0, epochs=3, resize="96", schedule="linear-decay")
    canvas, sizes, keys = _canvas(h=300, w=400)
    for epoch, side, scale in ((0, 96, 0.08), (1, 160, 0.54), (2, 224, 1.0)):
        assert pipe(canvas, sizes, keys, epoch).shape == (6, side, side, 3)
        assert pipe.at_epoch(epoch).ops[0].scale == pytest.approx((scale, 1.0))  # the crop op at the epoch's strength
    assert pipe(canvas, sizes, keys, 0).shape == (6, 96, 96, 3)
    assert pipe.at_epoch(0).ops[0].scale == pytest.approx((0.08, 1.0))


def test_resolution_mistakes_exit_2_before_ray_starts(tree, tmp_path, capsys, monkeypatch):
    import ray

    import jobs.train
    from training.driver.inputs import sized_preset

    connected, was = [], ray.is_initialized()
    monkeypatch.setattr(jobs.train, "connect", lambda *a, **k: connected.append(a) or pytest.fail("Ray was started"))
    common = ["--data", str(tree), "--storage-path", str(tmp_path / "runs"), "--epochs", "3"]
    for flags, message in (
        (["--progressive-resize", "big"], "--progressive-resize: progressive resize 'big': expected none, FROM"),
        (["--progressive-resize", "24:2-9"], "LAST (9) is past the last epoch (3)"),
        (["--image-size", "4"], "--image-size must be 0 (the preset's) or at least 8 px"),
    ):
        assert jobs.train.main(common + flags) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not connected and ray.is_initialized() == was and not (tmp_path / "runs").exists()
    # FROM must be below the training size, which the preset (loaded while Ray starts) decides
    with pytest.raises(ConfigError, match="starts at 32 px, not below the training size 32 px"):
        sized_preset(TrainConfig(progressive_resize="32"), PRESETS["cifar"])
    assert sized_preset(TrainConfig(progressive_resize="32", image_size=48), PRESETS["cifar"]).train_size == 48


def test_a_kornia_op_that_does_not_fit_a_runs_size_is_a_config_error_before_training():
    """A blur that fits the preset's 64 px but not the 8 px a progressive resize starts at: one
    line from training.driver.inputs.sized_preset (called before Ray Data starts), not a failed Ray task."""
    from training.driver.inputs import sized_preset

    blur = {"kornia.RandomGaussianBlur": {"kernel_size": [31, 31], "sigma": [0.1, 2.0], "p": 1.0}}
    train = [{"random_resized_crop": {"size": 64}}, blur]
    preset = preset_from_dict({"name": "blur", "train": train, "eval": [{"center_crop": {"size": 64}}]})
    assert sized_preset(TrainConfig(image_size=16), preset).train_size == 16  # 16 px still fits a 31-px kernel
    with pytest.raises(ConfigError, match=r"train ops at 8 px: .*RandomGaussianBlur.*cannot filter an image this"):
        sized_preset(TrainConfig(progressive_resize="8", epochs=3), preset)
