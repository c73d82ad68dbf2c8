"""The seeds' pipelines, ours against torchvision's.

* Deterministic transforms (eval: Resize(256) + CenterCrop(224), and RandomResizedCrop for
  a given box) match torchvision.transforms.v2.functional on real-size photos of mixed
  sizes, written to disk and decoded like training data, within 1/255.
* Random transforms draw their parameters from the same distributions as torchvision's:
  two-sample Kolmogorov-Smirnov tests over thousands of draws (both sides seeded, so the
  test is deterministic; p > 0.01 for every statistic).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import ks_2samp

from augment.decode import decode_image
from augment.ops import OPS
from augment.pipeline import Pipeline, to_canvas
from augment.presets import PRESETS
from augment.rng import KeyedRng
from bench.augment import synthetic_photo

N = 4000  # draws per distribution test
SIZES = [(300, 400), (375, 500), (500, 333), (333, 500), (480, 640)]


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[np.ndarray]:
    """Smooth synthetic photos as JPEGs on disk, decoded the way training data is."""
    root = tmp_path_factory.mktemp("photos")
    out = []
    for i, (h, w) in enumerate(SIZES * 2):
        path = root / f"{i}.jpg"
        Image.fromarray(synthetic_photo(h, w, seed=i)).save(path, quality=92)
        out.append(decode_image(path.read_bytes()))
    return out


def _ragged(arrays):
    out = np.empty(len(arrays), dtype=object)
    out[:] = arrays
    return out


def _tv_eval(img: np.ndarray) -> torch.Tensor:
    import torchvision.transforms.v2.functional as TF

    t = torch.from_numpy(img).permute(2, 0, 1)
    return TF.center_crop(TF.resize(t, [256], antialias=True), [224, 224]).float() / 255


@pytest.mark.parametrize("method", ["loop", "matmul"])
def test_eval_matches_torchvision_resize_then_center_crop(photos, method):
    op = OPS["resize_center_crop"](resize=256, size=224, method=method)
    canvas, sizes = to_canvas(_ragged(photos))
    out = op(canvas, KeyedRng(torch.arange(len(photos)), 0, 0), sizes)
    ref = torch.stack([_tv_eval(p) for p in photos])
    assert out.shape == ref.shape == (len(photos), 3, 224, 224)
    assert (out - ref).abs().max() <= 1 / 255 + 1e-6


def test_imagenet_eval_pipeline_is_torchvisions_eval_in_uint8(photos):
    canvas, sizes = to_canvas(_ragged(photos))
    out = Pipeline(PRESETS["imagenet"].eval, seed=0)(canvas, sizes, torch.arange(len(photos)), epoch=3)
    ref = torch.stack([_tv_eval(p) for p in photos]).mul(255).round().permute(0, 2, 3, 1)
    assert out.dtype == torch.uint8 and (out.float() - ref).abs().max() <= 1


@pytest.mark.parametrize("method", ["loop", "matmul"])
def test_random_resized_crop_is_torchvisions_resized_crop_of_its_box(photos, method):
    import torchvision.transforms.v2.functional as TF

    op = OPS["random_resized_crop"](size=224, method=method)
    op.stream = 5
    canvas, sizes = to_canvas(_ragged(photos))
    params = op.sample(KeyedRng(torch.arange(len(photos)), 1, 2), sizes)
    out = op.apply(canvas, params, sizes)
    for img, (top, left, h, w), got in zip(photos, params["box"].tolist(), out, strict=True):
        t = torch.from_numpy(img).permute(2, 0, 1)
        ref = TF.resized_crop(t, top, left, h, w, [224, 224], antialias=True).float() / 255
        assert (got - ref).abs().max() <= 1 / 255 + 1e-6


def _keys(n=N):
    return torch.arange(n, dtype=torch.int64) * 7919 + 12345


@pytest.mark.parametrize("hw", [(375, 500), (500, 333), (32, 32)])
def test_random_resized_crop_boxes_have_torchvisions_distribution(hw):
    from torchvision.transforms import RandomResizedCrop

    op = OPS["random_resized_crop"](size=224)
    sizes = torch.tensor(hw).expand(N, 2)
    box = op.sample(KeyedRng(_keys(), 0, 0), sizes)["box"].double()
    torch.manual_seed(0)
    img = torch.empty(3, *hw)
    ref = torch.tensor([RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(N)]).double()
    H, W = hw
    for name, f in {
        "area": lambda b: b[:, 2] * b[:, 3] / (H * W),
        "aspect": lambda b: b[:, 3] / b[:, 2],
        "top": lambda b: b[:, 0] / H,
        "left": lambda b: b[:, 1] / W,
    }.items():
        assert ks_2samp(f(box).numpy(), f(ref).numpy()).pvalue > 0.01, name
    assert (box[:, 0] + box[:, 2] <= H).all() and (box[:, 1] + box[:, 3] <= W).all() and (box[:, :2] >= 0).all()


def test_random_resized_crop_falls_back_like_torchvision_on_extreme_shapes():
    """A 20x400 strip never fits a 3/4..4/3 crop of >= 8 % area in 10 tries: the central
    crop clamped to ratio 4/3, as torchvision's fallback."""
    from torchvision.transforms import RandomResizedCrop

    op = OPS["random_resized_crop"](size=224)
    box = op.sample(KeyedRng(_keys(50), 0, 0), torch.tensor([20, 400]).expand(50, 2))["box"]
    ref = RandomResizedCrop.get_params(torch.empty(3, 20, 400), [0.08, 1.0], [3 / 4, 4 / 3])
    assert tuple(box[0].tolist()) == tuple(ref) and (box == box[0]).all()


def test_flip_rate_matches_torchvision():
    op = OPS["horizontal_flip"](p=0.5)
    ours = op.sample(KeyedRng(_keys(), 0, 0), None)["flip"].double().numpy()
    g = torch.Generator().manual_seed(0)
    ref = (torch.rand(N, generator=g) < 0.5).double().numpy()  # RandomHorizontalFlip: torch.rand(1) < p
    assert ks_2samp(ours, ref).pvalue > 0.01
    assert abs(ours.mean() - 0.5) < 3 * math.sqrt(0.25 / N)


def test_color_jitter_factors_and_order_match_torchvision():
    from torchvision.transforms import ColorJitter

    op = OPS["color_jitter"](brightness=0.2, contrast=0.3, saturation=0.4, hue=0.1)
    p = op.sample(KeyedRng(_keys(), 0, 0), None)
    torch.manual_seed(0)
    ref = [ColorJitter.get_params([0.8, 1.2], [0.7, 1.3], [0.6, 1.4], [-0.1, 0.1]) for _ in range(N)]
    for i, name in enumerate(["brightness", "contrast", "saturation", "hue"]):
        theirs = np.array([r[1 + i] for r in ref])
        assert ks_2samp(p["factors"][:, i].numpy(), theirs).pvalue > 0.01, name
    for step in range(4):  # which adjustment comes at each position of the random order
        theirs = np.array([int(r[0][step]) for r in ref])
        assert ks_2samp(p["order"][:, step].numpy(), theirs).pvalue > 0.01, step


def test_color_jitter_pixels_match_torchvision_for_given_factors(photos):
    """Same factors, same order -> same image as torchvision's tensor functionals."""
    import torchvision.transforms.v2.functional as TF

    x = torch.stack([torch.from_numpy(p[:64, :64]).permute(2, 0, 1) for p in photos]).float() / 255
    op = OPS["color_jitter"](brightness=0.4, contrast=0.4, saturation=0.4, hue=0.2)  # hue: Kornia's adjust_hue
    p = op.sample(KeyedRng(_keys(len(x)), 0, 0), None)
    out = op.apply(x.contiguous(memory_format=torch.channels_last), p)
    fns = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue]
    for img, f, order, got in zip(x, p["factors"], p["order"], out, strict=True):
        ref = img
        for k in order.tolist():
            ref = fns[k](ref, float(f[k]))
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_random_erasing_boxes_have_torchvisions_distribution():
    from torchvision.transforms import RandomErasing

    op = OPS["random_erasing"](p=1.0)
    p = op.sample(KeyedRng(_keys(), 0, 0), torch.tensor([224, 224]).expand(N, 2))
    box = p["box"][p["apply"]].double()
    torch.manual_seed(0)
    img = torch.empty(3, 224, 224)
    ref = torch.tensor(
        [RandomErasing.get_params(img, (0.02, 0.33), (0.3, 3.3), value=[0.0])[:4] for _ in range(N)]
    ).double()
    ref = ref[ref[:, 2] < 224]  # torchvision returns the whole image when nothing fits: not erased
    for name, f in {
        "area": lambda b: b[:, 2] * b[:, 3],
        "aspect": lambda b: b[:, 2] / b[:, 3],
        "top": lambda b: b[:, 0],
    }.items():
        assert ks_2samp(f(box).numpy(), f(ref).numpy()).pvalue > 0.01, name


# --------------------------------------------------------------------------- images smaller than the crop


def _small(h, w, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    "hw,size,padding",
    [((20, 20), (32, 32), 0), ((21, 26), (32, 30), 0), ((20, 23), (32, 32), 2), ((36, 18), (32, 31), 1)],
    ids=["even-shortfall", "odd-shortfall", "padding-then-shortfall", "one-dimension-short"],
)
def test_random_crop_of_a_small_image_lands_where_torchvisions_can(hw, size, padding):
    """torchvision's RandomCrop(pad_if_needed=True) pads the shortfall on both sides, so a small
    image can land at shortfall + 1 places per dimension: ours reaches exactly the same outputs."""
    from torchvision.transforms import RandomCrop

    n = 3000
    img = _small(*hw)
    op = OPS["random_crop"](size=size, padding=padding)
    canvas = torch.from_numpy(img)[None].expand(n, *img.shape)
    out = op(canvas, KeyedRng(_keys(n), 0, 0), torch.tensor(hw).expand(n, 2))
    ours = {bytes(v) for v in out.mul(255).round().to(torch.uint8).flatten(1).numpy()}
    tv = RandomCrop(size, padding=padding or None, pad_if_needed=True)
    torch.manual_seed(0)
    chw = torch.from_numpy(img).permute(2, 0, 1)
    theirs = {bytes(tv(chw).flatten().numpy()) for _ in range(n)}
    (h, w), (th, tw) = (hw[0] + 2 * padding, hw[1] + 2 * padding), size
    places = (abs(th - h) + 1) * (abs(tw - w) + 1)  # a short dimension has shortfall + 1 places, a long one h - th + 1
    assert ours == theirs and len(ours) == places


def test_center_crop_of_small_images_matches_torchvision():
    """Odd and even shortfalls in each dimension, one dimension short, and an exact fit."""
    import torchvision.transforms.v2.functional as TF

    sizes = [(20, 20), (21, 19), (31, 40), (40, 27), (32, 30), (33, 29)]
    images = [_small(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    canvas, hw = to_canvas(_ragged(images))
    out = OPS["center_crop"](size=(32, 30))(canvas, KeyedRng(_keys(len(images)), 0, 0), hw)
    for img, got in zip(images, out, strict=True):
        ref = TF.center_crop(torch.from_numpy(img).permute(2, 0, 1), [32, 30]).float() / 255
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["loop", "matmul"])
def test_resampling_ops_upsample_small_images_like_torchvision(method):
    """resize_center_crop and random_resized_crop never pad: a small image is upsampled, as in torchvision."""
    import torchvision.transforms.v2.functional as TF

    images = [_small(20, 30, 1), _small(17, 13, 2), _small(9, 40, 3)]
    canvas, hw = to_canvas(_ragged(images))
    rng = KeyedRng(_keys(len(images)), 0, 0)
    out = OPS["resize_center_crop"](resize=64, size=56, method=method)(canvas, rng, hw)
    rrc = OPS["random_resized_crop"](size=48, method=method)
    params = rrc.sample(rng, hw)
    boxes = rrc.apply(canvas, params, hw)
    for img, got, box, cropped in zip(images, out, params["box"].tolist(), boxes, strict=True):
        t = torch.from_numpy(img).permute(2, 0, 1)
        ref = TF.center_crop(TF.resize(t, [64], antialias=True), [56, 56]).float() / 255
        assert (got - ref).abs().max() <= 1 / 255 + 1e-6
        ref = TF.resized_crop(t, *box, [48, 48], antialias=True).float() / 255
        assert (cropped - ref).abs().max() <= 1 / 255 + 1e-6


# --------------------------------------------------------------------------- through the fused kernel


def _fused_run(specs, images, *, first=None, seed=0):
    """The fused kernel's uint8 output (augment/fused.py: the GPU's path), run here through Triton's
    interpreter; `first`: the first op's draws to use instead of its own."""
    from augment.pipeline import DecodeRequest

    pipe = Pipeline(specs, seed=seed).at_epoch(0)
    sizes = torch.tensor([im.shape[:2] for im in images])
    draws = pipe.sample(sizes, torch.arange(len(images)))
    draws = draws if first is None else draws.with_first(draws.first | first)
    return pipe.finish(DecodeRequest(draws, sizes), images, path="fused")


def _kernel_runs() -> bool:
    from augment import fused

    return fused.available(torch.device("cpu"))


needs_kernel = pytest.mark.skipif(not _kernel_runs(), reason="needs Triton and TRITON_INTERPRET=1 (tests/conftest.py)")


@needs_kernel
def test_the_fused_kernels_eval_is_torchvisions_in_uint8(photos):
    """Three of the photos at full size (the interpreter is slow): within a level, as on the CPU."""
    out = _fused_run(PRESETS["imagenet"].eval, photos[:3])
    ref = torch.stack([_tv_eval(p) for p in photos[:3]]).mul(255).round().permute(0, 2, 3, 1)
    assert out.dtype == torch.uint8 and (out.float() - ref).abs().max() <= 1


@needs_kernel
def test_the_fused_kernels_resized_crop_is_torchvisions_of_its_box(photos):
    import torchvision.transforms.v2.functional as TF

    images = photos[:3]
    op = OPS["random_resized_crop"](size=224)
    op.stream = 1
    params = op.sample(KeyedRng(torch.arange(3), 1, 2), torch.tensor([im.shape[:2] for im in images]))
    out = _fused_run([{"random_resized_crop": {"size": 224}}], images, first=params)
    for img, (top, left, h, w), got in zip(images, params["box"].tolist(), out, strict=True):
        ref = TF.resized_crop(torch.from_numpy(img).permute(2, 0, 1), top, left, h, w, [224, 224], antialias=True)
        assert (got.permute(2, 0, 1).int() - ref.int()).abs().max() <= 1


@needs_kernel
def test_the_fused_kernel_upsamples_small_images_like_torchvision():
    import torchvision.transforms.v2.functional as TF

    images = [_small(20, 30, 1), _small(17, 13, 2), _small(9, 40, 3)]
    out = _fused_run([{"resize_center_crop": {"resize": 64, "size": 56}}], images)
    for img, got in zip(images, out, strict=True):
        ref = TF.center_crop(TF.resize(torch.from_numpy(img).permute(2, 0, 1), [64], antialias=True), [56, 56])
        assert (got.permute(2, 0, 1).int() - ref.int()).abs().max() <= 1


@needs_kernel
def test_the_fused_kernels_color_jitter_is_torchvisions_for_given_factors(photos):
    """Brightness, contrast and saturation in each image's own order, on 64 px crops taken at scale
    1 (the kernel copies them): torchvision's functionals of the same factors, to a level."""
    import torchvision.transforms.v2.functional as TF

    images = [p[:64, :64] for p in photos[:6]]
    specs = [{"center_crop": {"size": 64}}, {"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4}}]
    pipe = Pipeline(specs, seed=0).at_epoch(0)
    draws = pipe.sample(torch.tensor([im.shape[:2] for im in images]), torch.arange(6))
    out = _fused_run(specs, images)
    fns = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation]
    jitter = draws.rest[0]
    for img, f, order, ok, got in zip(images, jitter["factors"], jitter["order"], jitter["apply"], out, strict=True):
        ref = torch.from_numpy(img).permute(2, 0, 1).float() / 255
        for k in order.tolist() if ok else []:
            ref = fns[k](ref, float(f[k]))
        assert (got.permute(2, 0, 1).int() - ref.mul(255).round().int()).abs().max() <= 1
