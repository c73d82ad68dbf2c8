"""The CPU path's compiled loops (augment/cpu_kernels.py) against the torch ops they replace
and against torchvision; and the in-place contract of the ops that use them."""

from __future__ import annotations

import sys

import pytest
import torch

from augment import ops
from augment.ops import OPS
from augment.pipeline import Pipeline, to_uint8_nhwc
from augment.presets import PRESETS
from augment.rng import KeyedRng
from bench.augment import synthetic_photo

cpu_kernels = pytest.importorskip(
    "augment.cpu_kernels",
    reason="numba, a dependency in pyproject.toml, is not installed here: the CPU path runs torch's ops",
)


def _keys(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64) * 7919 + 11


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    """Float32 planar photos in [0, 1], with saturated pixels that the clamps act on."""
    imgs = [torch.from_numpy(synthetic_photo(96, 128, seed=i)).permute(2, 0, 1) for i in range(12)]
    x = torch.stack(imgs).float() / 255
    x[0, :, :10] = 1.0  # white rows: brightness > 1 and contrast push them past the clamp
    x[1, :, -10:] = 0.0
    return x.contiguous()


def test_color_jitter_kernel_matches_torchvision_and_the_torch_ops(batch):
    import torchvision.transforms.v2.functional as TF

    op = OPS["color_jitter"](brightness=0.4, contrast=0.4, saturation=0.4)
    p = op.sample(KeyedRng(_keys(len(batch)), 0, 0), None)
    assert cpu_kernels.takes(batch)
    got = op.apply(batch, p)  # planar float32 on the CPU: the compiled loops
    torch_ops = op.apply(batch.contiguous(memory_format=torch.channels_last), p)  # the GPU's ops
    assert not cpu_kernels.takes(batch.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(got, torch_ops.contiguous(), atol=1e-6, rtol=0)
    fns = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation]
    for img, f, order, out in zip(batch, p["factors"], p["order"], got, strict=True):
        ref = img
        for k in order.tolist():
            ref = fns[k](ref, float(f[k]))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert not torch.equal(got, batch)  # it did jitter


def test_color_jitter_kernel_leaves_images_that_do_not_jitter_as_they_were(batch):
    op = OPS["color_jitter"](brightness=0.4, contrast=0.4, saturation=0.4, p=0.5)
    p = op.sample(KeyedRng(_keys(len(batch)), 0, 0), None)
    assert 0 < int(p["apply"].sum()) < len(batch)
    got = op.apply(batch, p)
    assert torch.equal(got[~p["apply"]], batch[~p["apply"]])


@pytest.mark.parametrize("name", ["color_jitter", "horizontal_flip"])
def test_apply_keeps_its_input_and_apply_in_place_overwrites_it(batch, name):
    op = OPS[name](**({"brightness": 0.4, "contrast": 0.4, "saturation": 0.4} if name == "color_jitter" else {}))
    p = op.sample(KeyedRng(_keys(len(batch)), 0, 0), None)
    before = batch.clone()
    out = op.apply(batch, p)
    assert torch.equal(batch, before)
    mine = batch.clone()
    in_place = op.apply_(mine, p)
    assert in_place.data_ptr() == mine.data_ptr()
    assert torch.equal(in_place, out)


def test_to_uint8_matches_torch_round_half_to_even_and_clamps():
    levels = torch.arange(-3, 260, dtype=torch.float32)
    ties = (levels + 0.5) / 255  # every .5 tie, and values past both ends
    rest = torch.rand(3 * 16 * 16 * 2 - 2 * len(levels), generator=torch.Generator().manual_seed(0)) * 1.2 - 0.1
    x = torch.cat([ties, levels / 255, rest]).view(2, 3, 16, 16).contiguous()
    ref = x.mul(255.0).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(to_uint8_nhwc(x), ref)  # the compiled loop
    out = torch.zeros((5, 16, 16, 3), dtype=torch.uint8)
    to_uint8_nhwc(x, out[1:3])  # into rows of a larger batch
    assert torch.equal(out[1:3], ref) and not out[0].any() and not out[3:].any()


def test_pipeline_writes_the_same_pixels_into_given_rows():
    pipe = Pipeline(PRESETS["imagenet"].train, seed=3).at_epoch(1)
    images = [torch.from_numpy(synthetic_photo(300 + 17 * i, 400 - 9 * i, seed=i)) for i in range(9)]
    sizes = torch.tensor([im.shape[:2] for im in images])
    draws = pipe.sample(sizes, _keys(len(images)))
    alone = pipe.apply(images, sizes, draws)
    rows = torch.zeros((11, 224, 224, 3), dtype=torch.uint8)
    into = pipe.apply(images, sizes, draws, rows[2:])
    assert into.data_ptr() == rows[2:].data_ptr()
    assert torch.equal(rows[2:], alone) and not rows[:2].any()
    assert alone.shape == (9, 224, 224, 3) and alone.float().std() > 10  # photos, not a blank batch


def test_without_numba_the_cpu_path_runs_the_torch_ops(batch, monkeypatch):
    op = OPS["color_jitter"](brightness=0.4, contrast=0.4, saturation=0.4)
    p = op.sample(KeyedRng(_keys(len(batch)), 0, 0), None)
    compiled, compiled_u8 = op.apply(batch, p), to_uint8_nhwc(batch)
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.delitem(sys.modules, "augment.cpu_kernels")
    monkeypatch.delattr(sys.modules["augment"], "cpu_kernels")  # else `from augment import` finds it
    assert ops.compiled_loops.__wrapped__() is None
    monkeypatch.setattr(ops, "compiled_loops", ops.compiled_loops.__wrapped__)
    monkeypatch.setattr("augment.pipeline.compiled_loops", ops.compiled_loops)

    def refuse(*args):
        raise AssertionError("the compiled loops ran with numba missing")

    monkeypatch.setattr(cpu_kernels, "color_jitter_", refuse)
    monkeypatch.setattr(cpu_kernels, "to_uint8_nhwc", refuse)
    torch.testing.assert_close(op.apply(batch, p), compiled, atol=1e-6, rtol=0)
    assert torch.equal(to_uint8_nhwc(batch), compiled_u8)
