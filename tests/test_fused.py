"""The fused kernel (augment/fused.py) against the torch path it replaces on a GPU, run on the CPU
through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU):
the same draws, the same pixels (eval within a level of torchvision), every geometry op and edge
case it takes, the ops it does not cover on its float output, and one operation a batch that a
dispatch mode sees with the tensors it reads and writes. Small images: the interpreter is slow."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from augment import fused
from augment.pipeline import Pipeline
from augment.presets import PRESETS
from bench.augment import synthetic_photo

CPU = torch.device("cpu")

fused_kernel = pytest.importorskip("augment.fused_kernel", reason="needs Triton")

pytestmark = pytest.mark.skipif(
    not fused.available(CPU), reason="needs Triton and TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)"
)


def _images(sizes, seed: int = 0, gray: int | None = None, chw: int | None = None) -> list:
    """Photo-like images of `sizes`: HWC numpy arrays, image `gray` with three equal channels (a
    grayscale JPEG decoded), image `chw` an (H, W, 3) view of a planar tensor (nvjpeg's layout)."""
    out = [synthetic_photo(h, w, seed + i) for i, (h, w) in enumerate(sizes)]
    if gray is not None:
        out[gray] = np.repeat(out[gray][:, :, :1], 3, axis=2)
    if chw is not None:
        out[chw] = torch.from_numpy(out[chw]).permute(2, 0, 1).contiguous().permute(1, 2, 0)
    return out


def _small(specs, side: int, resize: int | None = None) -> list:
    """The preset's ops with the first at `side` px (and its eval resize at `resize`)."""
    ((name, params),) = specs[0].items()
    params = dict(params, size=side) | ({"resize": resize} if resize else {})
    return [{name: params}, *specs[1:]]


def _both(specs, images, seed: int = 3, epoch: int = 1, request=None):
    """(the kernel's output, the torch path's) for the same draws."""
    pipe = Pipeline(specs, seed=seed).at_epoch(epoch)
    sizes = torch.tensor([im.shape[:2] for im in images], dtype=torch.int64)
    request = request or pipe.request(sizes, torch.arange(len(images)) * 7919)
    return pipe.finish(request, images, path="fused"), pipe.finish(request, images, path="ragged")


def _close(got, expected, packed: bool = True) -> None:
    """Within a level everywhere; the share of pixels a level off: but for a rounding tie (the
    kernel computes in float32 as the torch path does on a CPU), or where images that jitter
    contrast keep a packed scratch (an eighth of a level before the steps from contrast on), about
    1 pixel in 30 of them."""
    diff = (got.int() - expected.int()).abs()
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert int(diff.max()) <= 1
    assert float((diff > 0).float().mean()) < (0.06 if packed else 1e-3)


CASES = {
    "imagenet train": (_small(PRESETS["imagenet"].train, 40), [(90, 130), (61, 47), (40, 40), (123, 77)]),
    "imagenet eval": (_small(PRESETS["imagenet"].eval, 40, resize=46), [(90, 130), (61, 47), (50, 50), (47, 93)]),
    "cifar train (padded crops)": (PRESETS["cifar"].train, [(32, 32), (28, 36), (32, 32)]),
}


@pytest.mark.parametrize("scratch", ["packed", "float32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kernel_gives_the_torch_paths_pixels(case, scratch, monkeypatch):
    """Odd sizes, a grayscale image, one in nvjpeg's planar layout: the kernel computes in float32
    as the torch path does on a CPU, so with a float32 scratch (no image may pack it: PACK_GAIN
    0) the bytes agree but for a rounding tie, and with the packed one within a level."""
    if scratch == "float32":
        monkeypatch.setattr(fused_kernel, "PACK_GAIN", 0.0)
    specs, sizes = CASES[case]
    got, expected = _both(specs, _images(sizes, gray=1, chw=2))
    assert got.dtype == torch.uint8
    _close(got, expected, packed=scratch == "packed")


def test_crops_touching_every_edge_and_the_scales_extremes():
    """Boxes in each corner and along each edge, the whole image, one pixel (the resize enlarges
    it 40 times), a 2-pixel sliver, a box 9 times the output (a wide filter)."""
    from augment.pipeline import DecodeRequest

    specs = _small(PRESETS["imagenet"].train, 40)
    images = _images([(360, 60), (97, 83), (97, 83), (97, 83), (97, 83), (50, 51)])
    boxes = [[0, 0, 360, 60], [0, 0, 1, 1], [96, 82, 1, 1], [0, 81, 97, 2], [95, 0, 2, 83], [10, 20, 40, 31]]
    pipe = Pipeline(specs, seed=0).at_epoch(0)
    sizes = torch.tensor([im.shape[:2] for im in images])
    draws = pipe.sample(sizes, torch.arange(len(images)))
    first = draws.first | {"box": torch.tensor(boxes)}
    request = DecodeRequest(draws.with_first(first), sizes)
    got, expected = _both(specs, images, request=request)
    assert int((got.int() - expected.int()).abs().max()) <= 1


def test_eval_through_the_kernel_is_within_a_level_of_torchvision():
    import torchvision.transforms.v2.functional as TF

    from augment.batch import augment_batch

    images = _images([(75, 100), (100, 66), (64, 64)])
    specs = _small(PRESETS["imagenet"].eval, 56, resize=64)
    pipe = Pipeline(specs, seed=0)
    sizes = torch.tensor([im.shape[:2] for im in images])
    got = pipe.at_epoch(0).finish(pipe.at_epoch(0).request(sizes, torch.arange(3)), images, path="fused")
    for image, out in zip(images, got, strict=True):
        t = torch.from_numpy(image).permute(2, 0, 1)
        ref = TF.center_crop(TF.resize(t, [64], antialias=True), [56, 56]).permute(1, 2, 0)
        assert int((out.int() - ref.int()).abs().max()) <= 1
    cpu_path = augment_batch(pipe, images, torch.arange(3), 0, CPU)  # per-image F.interpolate, uint8
    assert int((got.int() - cpu_path.int()).abs().max()) <= 1


def test_ops_the_kernel_does_not_cover_run_after_it_on_its_float_output():
    """Random erasing and a Kornia op after the jitter: the kernel hands them float32, and the
    whole pipeline's bytes agree with the torch path's."""
    specs = [
        *_small(PRESETS["imagenet"].train, 32),
        {"random_erasing": {"p": 1.0}},
        {"kornia.RandomGrayscale": {"p": 0.5}},
    ]
    pipe = Pipeline(specs, seed=0).at_epoch(0)
    assert fused.fused_prefix(pipe.ops) == 3
    got, expected = _both(specs, _images([(70, 90), (64, 40)]))
    assert int((got.int() - expected.int()).abs().max()) <= 1


def test_the_kernel_takes_the_first_op_and_the_flip_and_jitter_after_it_only():
    def prefix(specs):
        return fused.fused_prefix(Pipeline(specs, seed=0).at_epoch(0).ops)

    rrc = {"random_resized_crop": {"size": 32}}
    flip, jitter = {"horizontal_flip": {}}, {"color_jitter": {"brightness": 0.2}}
    assert prefix([rrc, flip, jitter]) == 3 and prefix([rrc, jitter, flip]) == 3
    assert prefix([rrc, {"color_jitter": {"hue": 0.1}}, flip]) == 1  # hue: the torch path (Kornia's)
    assert prefix([rrc, flip, flip]) == 2 and prefix([rrc, {"random_erasing": {}}, flip]) == 1
    assert prefix([{"center_crop": {"size": 32}}]) == 1


def test_a_dispatch_mode_sees_one_operation_with_the_images_it_reads():
    """As a torch custom op the kernel is one operation to a TorchDispatchMode (bench/gpu_path.py
    counts operations and bytes so), its inputs the decoded images, its output the batch."""
    from bench.gpu_path import OpCounter

    specs = _small(PRESETS["imagenet"].train, 24)
    pipe = Pipeline(specs, seed=0).at_epoch(0)
    images = [torch.from_numpy(im) for im in _images([(50, 60), (40, 30)])]
    sizes = torch.tensor([im.shape[:2] for im in images])
    request = pipe.request(sizes, torch.arange(2))
    with OpCounter() as counter:
        pipe.finish(request, images, path="fused")
    assert counter.names["rga.augment_first_ops"] == 1, counter.names


def test_the_plan_line_names_the_ops_the_kernel_runs_and_why_the_rest_do_not():
    from augment.fused import plan_line

    expected = "random_resized_crop, horizontal_flip, color_jitter in one Triton kernel"
    assert plan_line(PRESETS["imagenet"].train) == expected
    with_hue = [{"random_resized_crop": {"size": 224}}, {"color_jitter": {"hue": 0.1}}, {"horizontal_flip": {}}]
    assert plan_line(with_hue).endswith("then color_jitter, horizontal_flip as torch operations")


def _small_tiles(monkeypatch, tile=(16, 16), chunk=2):
    """The kernel's launch at `tile` output pixels a program and `chunk` images a pair of launches
    (the GPU's shapes are 32 x 32 and 32 images; the interpreter's default, one tile an image)."""
    from augment import fused_kernel

    monkeypatch.setattr(fused_kernel, "launch_shape", lambda device_type: (tile, chunk), raising=False)


def _with_boxes(specs, images, boxes):
    from augment.pipeline import DecodeRequest

    pipe = Pipeline(specs, seed=1).at_epoch(0)
    sizes = torch.tensor([im.shape[:2] for im in images])
    draws = pipe.sample(sizes, torch.arange(len(images)))
    request = DecodeRequest(draws.with_first(draws.first | {"box": torch.tensor(boxes)}), sizes)
    return _both(specs, images, request=request)


def test_tiles_of_images_of_very_different_crops_in_one_batch(monkeypatch):
    """Nine 16 x 16 tiles an image (the last row and column partly outside it), in chunks of two
    images: a 400 x 300 box, a 3 x 3 one (enlarged), a sliver, a box 5 times the output; the
    preset's flip and jitter with contrast, whose mean is the sum of every tile's; then cifar's
    padded crops."""
    _small_tiles(monkeypatch)
    specs = _small(PRESETS["imagenet"].train, 40)
    images = _images([(300, 400), (50, 60), (97, 83), (210, 160), (64, 64)], chw=3)
    boxes = [[0, 0, 300, 400], [20, 30, 3, 3], [0, 81, 97, 2], [5, 0, 200, 160], [1, 2, 40, 60]]
    got, expected = _with_boxes(specs, images, boxes)
    _close(got, expected)
    specs, sizes = CASES["cifar train (padded crops)"]  # a crop's padding read across four tiles
    got, expected = _both(specs, _images(sizes, chw=1))
    assert int((got.int() - expected.int()).abs().max()) <= 1


def test_float_output_in_tiles_and_chunks_keeps_contrast_in_place(monkeypatch):
    """With an op the kernel does not cover after it, the output is float32 and is its own scratch:
    tiles leave the pixels before contrast there, the second launch rewrites them, chunk by chunk."""
    _small_tiles(monkeypatch, tile=(16, 16), chunk=2)
    specs = [*_small(PRESETS["imagenet"].train, 36), {"random_erasing": {"p": 0.5}}]
    got, expected = _both(specs, _images([(70, 90), (64, 40), (120, 100)], chw=0))
    assert int((got.int() - expected.int()).abs().max()) <= 1


def test_a_crop_of_a_4000_by_3000_photo(monkeypatch):
    """A box of 2,000 x 1,500 pixels of a 4000 x 3000 photo to 40 px (50 and 38 taps a column and
    a row), in 32 x 64 tiles (their vertical spans 16-row runs of a many-run span), with a small
    crop beside it: within a level of the torch path."""
    _small_tiles(monkeypatch, tile=(32, 64), chunk=2)
    specs = _small(PRESETS["imagenet"].train, 40)
    images = [synthetic_photo(3000, 4000, 0), synthetic_photo(90, 120, 1)]
    got, expected = _with_boxes(specs, images, [[700, 1100, 1500, 2000], [10, 10, 60, 90]])
    _close(got, expected)


def test_a_packed_scratch_stays_within_a_level_up_to_the_largest_gain_it_is_kept_for(monkeypatch):
    """Jitter of 0.6 each: the steps from contrast on scale a scratch pixel's error up to 1.6 x
    2.2 x 1.6 = 5.6 times, under PACK_GAIN, so every image packs its scratch, in tiles and
    chunks; the output still within a level of the torch path's."""
    _small_tiles(monkeypatch, tile=(16, 16), chunk=2)
    specs = [{"random_resized_crop": {"size": 40}}, {"color_jitter": dict.fromkeys(JITTER, 0.6)}]
    pipe = Pipeline(specs, seed=5).at_epoch(0)
    images = _images([(90, 130), (61, 47), (123, 77), (64, 64), (100, 100)])
    sizes = torch.tensor([im.shape[:2] for im in images])
    request = pipe.request(sizes, torch.arange(len(images)))
    factors = request.draws.rest[0]["factors"][:, :3]
    assert bool(fused_kernel.packable(factors).all()) and float(factors[:, 1].sub(1).abs().min()) > 0
    got, expected = pipe.finish(request, images, path="fused"), pipe.finish(request, images, path="ragged")
    _close(got, expected)


JITTER = ("brightness", "contrast", "saturation")


def test_an_image_whose_jitter_could_scale_the_packing_error_past_a_level_keeps_float32():
    factors = torch.tensor([[1.4, 1.4, 1.4], [1.8, 1.8, 1.8], [0.2, 1.9, 1.0], [2.5, 1.0, 2.5]])
    assert fused_kernel.packable(factors).tolist() == [True, False, True, False]  # gains 3.5, 8.4, 0.4, 10
    pixels = 2 * 224 * 224  # each written once and read once
    assert fused_kernel.scratch_bytes(factors, 224, 224, False) == pixels * (4 + 12 + 4)  # the last: no contrast
    assert fused_kernel.scratch_bytes(factors, 224, 224, True) == pixels * 12 * 3  # a float32 output is its own


def test_the_loads_an_output_pixel_grow_with_the_source_rows_not_rows_times_columns(monkeypatch):
    """A 800 x 600 photo's full frame to 32 px with contrast on (25 and 19 source pixels an output
    pixel along each axis), in one of the GPU's 32 x 32 tiles: the separable resample reads the
    tile's source rows once, at each output column's 52 taps (3 channels), and contrast's mean
    needs no second pass over the photo; every load counted through the interpreter
    (bench/kernel_loads.py). The kernel before loaded ky x kx taps for every output pixel, twice:
    12,168 an output pixel."""
    from augment.pipeline import DecodeRequest
    from bench.kernel_loads import counting_loads

    _small_tiles(monkeypatch, tile=(32, 32), chunk=32)

    specs = _small(PRESETS["imagenet"].train, 32)
    pipe = Pipeline(specs, seed=0).at_epoch(0)
    images = [synthetic_photo(600, 800, 0)]
    sizes = torch.tensor([[600, 800]])
    draws = pipe.sample(sizes, torch.arange(1))
    request = DecodeRequest(draws.with_first(draws.first | {"box": torch.tensor([[0, 0, 600, 800]])}), sizes)
    assert float(draws.rest[1]["factors"][0, 1]) != 1.0  # the preset jitters contrast (p = 1)
    with counting_loads() as counts:
        pipe.finish(request, images, path="fused")
    sy, kx = 600 / 32, int(2 * 800 / 32) + 2
    assert counts["issued"] / 32**2 <= 1.25 * sy * kx * 3, counts


def test_the_kernels_compile_for_a_hopper_gpu_without_spills():
    """Triton's interpreter runs code a GPU would not compile: bench/kernel_compile.py compiles the
    kernels for sm_90 here (Triton's compiler and ptxas, no GPU needed), at the GPU's tiles."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = Path(__file__).resolve().parents[1]
    args = [sys.executable, "-m", "bench.kernel_compile"]
    done = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = json.loads(done.stdout)
    assert len(kernels) == 4
    for name, usage in kernels.items():
        assert usage["spill_instructions"] == 0 and usage["stack"] == 0 and 0 < usage["registers"] <= 255, name
