"""The GPU's geometry path without a canvas (augment/ragged.py), run here on the CPU: the
same pixels as the canvas resampler, every layout the decoders hand it, padding at the
buffer's ends, and a batch's dispatched operations that do not grow with its images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import augment.batch
import augment.pipeline
from augment import engines
from augment.batch import augment_batch, decode_augment
from augment.geometry import gather_crop, resample_boxes
from augment.pipeline import Pipeline, to_canvas
from augment.presets import PRESETS
from augment.ragged import CHW, HWC, RaggedImages, crop, resample
from bench.decode import encoded_photos
from bench.gpu_path import OpCounter

SIZES = [(37, 50), (80, 61), (224, 300), (31, 29), (500, 333), (1, 40)]


@pytest.fixture(scope="module")
def images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g) for h, w in SIZES]


def _canvas(images):
    ragged = np.empty(len(images), dtype=object)
    ragged[:] = [a.numpy() for a in images]
    return to_canvas(ragged)


def _inputs(images, how: str):
    """The images as the GPU path gets them: HWC tensors, CHW tensors (planar memory, or a
    CHW view of HWC memory, as torchvision's CPU decoder gives), or host arrays mixed in."""
    if how == "hwc":
        return images, HWC
    if how == "chw planar":
        return [a.permute(2, 0, 1).contiguous() for a in images], CHW
    if how == "chw view":
        return [a.permute(2, 0, 1) for a in images], CHW
    return [a.permute(2, 0, 1).contiguous() if i % 2 else a.numpy() for i, a in enumerate(images)], CHW


@pytest.mark.parametrize("how", ["hwc", "chw planar", "chw view", "mixed with host arrays"])
@pytest.mark.parametrize("op", ["random_resized_crop", "resize_center_crop", "enlarge"])
def test_the_ragged_resampler_gives_the_canvas_resamplers_pixels(images, how, op):
    b = len(images)
    sizes = torch.tensor(SIZES)
    keys = torch.arange(b, dtype=torch.int64) * 31
    if op == "enlarge":  # every box smaller than the output: the filter's support is 1
        box = torch.cat([sizes // 4, (sizes // 2).clamp(min=1)], 1)
        params = {"box": box, "resized": torch.full((b, 2), 96), "offset": torch.zeros(b, 2, dtype=torch.int64)}
        side = 96
    else:
        specs = PRESETS["imagenet"].train if op == "random_resized_crop" else PRESETS["imagenet"].eval
        pipe = Pipeline(specs, seed=3).at_epoch(2)
        params, side = pipe.sample(sizes, keys).first, 224
    canvas, _ = _canvas(images)
    expected = resample_boxes(canvas, params["box"], params["resized"], params["offset"], (side, side), method="matmul")
    batch = RaggedImages.from_images(*_inputs(images, how)[:1], "cpu", _inputs(images, how)[1])
    got = resample(batch, params["box"], params["resized"], params["offset"], (side, side))
    assert got.shape == expected.shape == (b, 3, side, side)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-3 / 255)
    if how in ("chw planar", "hwc"):
        assert batch.layout == (CHW if how == "chw planar" else HWC)  # the tensors went in as views


def test_a_ragged_crop_equals_the_canvas_crop_with_padding_at_both_ends_of_the_buffer(images):
    canvas, sizes = _canvas(images)
    # the first image's window starts before the buffer, the last one's runs past its end
    top = torch.tensor([-4, 10, 100, -2, 480, -3])
    left = torch.tensor([-4, 40, 290, 5, -3, 30])
    for how in ("hwc", "chw planar", "chw view"):
        shaped, shape = _inputs(images, how)
        got = crop(RaggedImages.from_images(shaped, "cpu", shape), top, left, (32, 32), 0.5)
        assert torch.equal(got, gather_crop(canvas, sizes, top, left, (32, 32), 0.5)), how


@pytest.mark.parametrize("decoder", ["nvjpeg", "nvimgcodec"])
def test_a_batch_dispatches_as_many_operations_for_32_images_as_for_8(monkeypatch, decoder):
    """The GPU path on CPU tensors, with either batched decoder: torchvision's loops over the
    images on a CPU (one call each; one for the batch on a GPU), nvImageCodec's is no torch
    operation, views are free, but nothing that computes or copies may be dispatched per
    image. No canvas is made."""
    if decoder == "nvimgcodec" and not engines.available():
        pytest.skip("nvImageCodec is not installed (the test extra installs it: pip install -e '.[test]')")

    def no_canvas(images):
        raise AssertionError("the GPU path made a canvas")

    monkeypatch.setattr(augment.pipeline, "to_canvas", no_canvas)
    files = encoded_photos("imagenet", 8)
    pipeline = Pipeline(PRESETS["imagenet"].train, seed=0)
    counts, cpu = {}, torch.device("cpu")
    for n in (8, 32):
        batch = [files[i % len(files)] for i in range(n)]
        keys = torch.arange(n, dtype=torch.int64)
        decode_augment(pipeline, batch, keys, 1, cpu, shrink=False, decoder=decoder)  # warm-up
        with OpCounter() as counter:
            out, kept, bad, _ = decode_augment(pipeline, batch, keys, 1, cpu, shrink=False, decoder=decoder)
        assert out.shape == (n, 224, 224, 3) and kept == list(range(n)) and not bad
        counts[n] = counter
    per_image = {"nvjpeg": 1, "nvimgcodec": 0}[decoder]
    assert counts[8].kinds["decoder"] == 8 * per_image and counts[32].kinds["decoder"] == 32 * per_image
    assert counts[32].kinds["ops"] == counts[8].kinds["ops"], counts[32].names - counts[8].names


def test_the_ragged_path_takes_the_same_images_as_the_cpu_path():
    """The whole GPU path on CPU tensors against the CPU's own path, from the same decoded
    images (a ragged batch through augment_batch on the CPU), every op of the preset."""
    files = encoded_photos("imagenet", 6)
    from augment.decode import decode_image

    decoded = np.empty(len(files), dtype=object)
    decoded[:] = [decode_image(f) for f in files]
    keys = torch.arange(len(files), dtype=torch.int64) * 7
    pipe = Pipeline(PRESETS["imagenet"].train, seed=1).at_epoch(4)
    cpu = augment_batch(Pipeline(PRESETS["imagenet"].train, seed=1), decoded, keys, 4, torch.device("cpu"))
    batch = RaggedImages.from_images(list(decoded), "cpu")
    ragged = pipe(batch, batch.sizes, keys)
    diff = (ragged.int() - cpu.int()).abs()  # the CPU resamples uint8 per image (rounded), this in float
    assert int(diff.max()) <= 2 and float((diff > 1).float().mean()) < 1e-3
