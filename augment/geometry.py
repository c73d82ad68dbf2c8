"""The geometry ops: each takes the decoded images (a uint8 canvas (B, Hmax, Wmax, 3) holding
images of possibly different sizes `sizes` (B, 2) in its top-left corners, a RaggedImages on the
GPU's path, or on the CPU a list of images) and returns one float batch (B, 3, S, S) in [0, 1],
channels_last: the crops (RandomCrop, CenterCrop) and the resamples (RandomResizedCrop,
ResizeCenterCrop), with torchvision's semantics. The first op of every preset is one of them,
and their base, GeometryOp, answers the pipeline's two questions about decoding (draw, fit).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from augment.decode import SHRINK_FACTORS
from augment.op import Op, as_pair, constant, register
from augment.ragged import RaggedImages, crop, resample
from augment.rng import KeyedRng


class GeometryOp(Op):
    """The first op of a preset. Beside the op contract (sample, apply on the decoded images, in
    any of the forms above), it answers the pipeline's two questions about decoding:

        params, scales, regions = op.draw(rng, sizes, shrink=..., regions=...)   # before
        params = op.fit(request, decoded, cropped, seed=..., epoch=...)          # after

    `draw`: its parameters for images of `sizes` (full size, from the headers), and what it asks
    of a decoder: per image the factor it may decode smaller by (max_shrink) and the box the op
    reads (region), where asked. `fit`: those parameters for the images as they were decoded.
    The hooks behind them are this class's; RandomResizedCrop is the op that implements them."""

    geometry = True

    def draw(self, rng: KeyedRng, sizes: torch.Tensor, *, shrink: bool = False, regions: bool = False):
        """(params, scales or None, regions or None) for images of `sizes` (see the class)."""
        params = self.sample(rng, sizes)
        return params, self.max_shrink(params) if shrink else None, self.region(params) if regions else None

    def fit(self, request, decoded: torch.Tensor, cropped, *, seed: int, epoch: int) -> dict:
        """The op's draws of `request` (augment.pipeline.DecodeRequest: drawn for the images' full
        sizes) for the images as decoded (`decoded` their sizes; `cropped` per image whether it was
        decoded as its request's region): moved into the regions decoded alone, the boxes rescaled
        for JPEGs decoded smaller, and drawn afresh (from (seed, epoch) and the keys) for an image
        whose size matches neither its header nor its scale (a header that lied), so no crop ever
        reaches outside an image."""
        params, sizes = request.draws.first, request.sizes
        if request.regions is not None and cropped is not None:
            inside = torch.tensor(list(cropped), dtype=torch.bool, device=sizes.device)
            params = self.in_region(params, request.regions, inside)
            sizes = torch.where(inside[:, None], request.regions[:, 2:], sizes)
        full = (decoded == sizes).all(1)
        if request.scales is None:  # decoded at full size (the GPU's decoders): one check, one host sync
            if bool(full.all()):
                return params
            factors = torch.ones_like(sizes[:, 0])
        else:
            factors = request.scales
        scaled = -torch.div(-sizes, factors[:, None], rounding_mode="floor")  # ceil(size / f)
        shrunk = (decoded == scaled).all(1) & (factors > 1)
        if not bool((full | shrunk).all()):  # host sync, once a chunk
            redrawn = self.sample(KeyedRng(request.draws.keys, seed, epoch), decoded)
            params = {k: _where(full | shrunk, v, redrawn[k]) for k, v in params.items()}
        if bool(shrunk.any()):
            params = self.shrink_params(params, torch.where(shrunk, factors, 1))
        return params

    def max_shrink(self, params) -> torch.Tensor | None:
        """Per image, the largest factor in augment.decode.SHRINK_FACTORS by which a decoder may
        shrink the image before `apply` (with `shrink_params`) and lose nothing of the output's
        resolution; None: the op needs the image at full size."""
        return None

    def shrink_params(self, params: dict, factors: torch.Tensor) -> dict:
        """`params` (drawn for the full-size image) in the coordinates of the image decoded at
        1/factors of its size."""
        raise NotImplementedError

    def region(self, params: dict) -> torch.Tensor | None:
        """Per image, the box (top, left, h, w) of the full-size image that `apply` reads, for a
        decoder that can decode that region alone (augment/engines.py); None: the whole image."""
        return None

    def in_region(self, params: dict, region: torch.Tensor, inside: torch.Tensor) -> dict:
        """`params` in the coordinates of `region` (from `region`) of each image where `inside`,
        unchanged elsewhere."""
        raise NotImplementedError


def _where(mask, a, b):
    if not isinstance(a, torch.Tensor) or not a.dim():
        return a
    return torch.where(mask.view(-1, *[1] * (a.dim() - 1)), a, b)


def as_canvas(images):
    """The images as a canvas where they came as a list (the CPU's path; see to_canvas)."""
    return to_canvas(images)[0] if isinstance(images, list) else images


def _to_float_nchw(hwc_uint8: torch.Tensor) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float in [0, 1], channels_last (no copy of layout)."""
    return hwc_uint8.permute(0, 3, 1, 2).float().div_(255.0)


def gather_crop(canvas: torch.Tensor, sizes: torch.Tensor, top, left, out_hw, fill: float = 0.0) -> torch.Tensor:
    """Crop (B, out_h, out_w) windows whose top-left corners are (top, left) in image coordinates.

    Windows may reach outside an image (negative or past its size): those pixels take
    `fill`, which is how padding works without materialising a padded copy.
    One advanced-indexing gather for the whole batch; returns uint8 (B, out_h, out_w, 3).
    """
    if isinstance(canvas, RaggedImages):
        return crop(canvas, top, left, out_hw, fill)
    out_h, out_w = out_hw
    dev = canvas.device
    rows = top[:, None] + torch.arange(out_h, device=dev)  # (B, out_h)
    cols = left[:, None] + torch.arange(out_w, device=dev)  # (B, out_w)
    valid = ((rows >= 0) & (rows < sizes[:, :1]))[:, :, None] & ((cols >= 0) & (cols < sizes[:, 1:]))[:, None, :]
    b = torch.arange(canvas.shape[0], device=dev)[:, None, None]
    out = canvas[b, rows.clamp(0, canvas.shape[1] - 1)[:, :, None], cols.clamp(0, canvas.shape[2] - 1)[:, None, :]]
    if bool(valid.all()):  # host sync, once per batch: skip the masking in the common case
        return out
    return torch.where(valid[..., None], out, torch.tensor(round(fill * 255), dtype=out.dtype, device=dev))


@register
class RandomCrop(GeometryOp):
    """torchvision.transforms.RandomCrop(size, padding, pad_if_needed=True, fill) on a batch."""

    name = "random_crop"
    uniforms = 2  # what sample draws per image (KeyedRng.prefetch)
    lengths = ("padding",)

    def __init__(self, *, size, padding: int = 0, fill: float = 0.0):
        super().__init__()
        self.size, self.padding, self.fill = as_pair(size), int(padding), float(fill)

    def sample(self, rng, sizes):
        th, tw = self.size
        # torchvision pads `padding` on every side, then, where the result is still smaller than
        # the crop (pad_if_needed), the shortfall on *both* sides of that dimension, so a small
        # image can land anywhere in a window twice the shortfall wide
        h, w = sizes[:, 0] + 2 * self.padding, sizes[:, 1] + 2 * self.padding
        extra_h, extra_w = (th - h).clamp(min=0), (tw - w).clamp(min=0)
        u = rng.uniform(self.stream, 2)
        top = (u[:, 0] * (h + 2 * extra_h - th + 1).float()).long()  # get_params: randint(0, H - th + 1)
        left = (u[:, 1] * (w + 2 * extra_w - tw + 1).float()).long()
        # back to image coordinates: subtract all the padding in front of the image
        return {"top": top - self.padding - extra_h, "left": left - self.padding - extra_w}

    def apply(self, canvas, params, sizes=None):
        canvas = as_canvas(canvas)
        return _to_float_nchw(gather_crop(canvas, sizes, params["top"], params["left"], self.size, self.fill))


def _center_offset(n: torch.Tensor, crop: int) -> torch.Tensor:
    """torchvision's center_crop along one dimension, as the offset of the window in the image.
    A larger image: int(round((n - crop) / 2.0)), half-to-even like torch.round. A smaller one
    is padded with (crop - n) // 2 in front first, so its offset is minus that."""
    return torch.where(n >= crop, torch.round((n - crop).double() / 2.0).long(), -((crop - n) // 2))


@register
class CenterCrop(GeometryOp):
    """torchvision.transforms.CenterCrop(size): the middle window, zero-padded if too small."""

    name = "center_crop"

    def __init__(self, *, size):
        super().__init__()
        self.size = as_pair(size)

    def sample(self, rng, sizes):
        th, tw = self.size
        return {"top": _center_offset(sizes[:, 0], th), "left": _center_offset(sizes[:, 1], tw)}

    def apply(self, canvas, params, sizes=None):
        return _to_float_nchw(gather_crop(as_canvas(canvas), sizes, params["top"], params["left"], self.size))


# --------------------------------------------------------------------------- resampling
#
# RandomResizedCrop and Resize + CenterCrop both come down to "resample a box of each
# original image to a fixed grid", with torch's antialiased bilinear filter (what
# torchvision uses for tensors, antialias=True). Two formulations of the same thing:
#
# * CPU: one `F.interpolate(uint8, antialias=True)` per image. Each call is a whole-image
#   kernel (torch's separable AVX2 uint8 path), and it beats the batched matmuls below
#   there because it skips the zero weights (docs/design.md, "Choices and where they were
#   measured"); so here a loop over images is the right tool.
# * CUDA (or any device, method="matmul"): two batched matmuls with per-image weight
#   matrices that reproduce torch's antialiased bilinear weights, so every box of every
#   size is resampled in one pass over the whole batch. tests/test_augment.py checks that
#   the two agree.


def aa_weights(start, length, out_len, offset, count: int, canvas_len: int) -> torch.Tensor:
    """(B, count, canvas_len) weights of torch's antialiased bilinear resampling.

    Image b's box covers canvas positions [start, start + length), resampled to out_len
    positions of which rows [offset, offset + count) are kept (a crop after the resize).
    Mirrors aten's `_compute_indices_min_size_weights_aa` (align_corners=False, scale =
    in / out, triangle filter widened by the scale when shrinking); computed in float64.
    """
    dev = start.device
    scale = length.double() / out_len.double()  # (B,)
    support = scale.clamp(min=1.0)  # interp_size / 2 * max(scale, 1); 1/support is invscale
    i = offset[:, None].double() + torch.arange(count, device=dev, dtype=torch.float64)  # (B, count)
    center = scale[:, None] * (i + 0.5)
    xmin = (center - support[:, None] + 0.5).trunc().clamp(min=0)  # C++ int64 cast truncates
    xmax = torch.minimum((center + support[:, None] + 0.5).trunc(), length[:, None].double())
    j = torch.arange(canvas_len, device=dev, dtype=torch.float64)[None, None, :] - start[:, None, None].double()
    w = (1.0 - ((j - center[..., None] + 0.5) / support[:, None, None]).abs()).clamp(min=0.0)
    w = w * ((j >= xmin[..., None]) & (j < xmax[..., None]))
    return (w / w.sum(-1, keepdim=True).clamp(min=1e-12)).float()


def resample_boxes(canvas, box, resized, offset, out_hw, method: str = "auto", dtype=None) -> torch.Tensor:
    """Resample box (top, left, h, w) of every image to resized (rh, rw), keep the out_hw
    window at offset (oy, ox). canvas: uint8 (B, Hmax, Wmax, 3), or on the CPU a list of
    (H, W, 3) images; box, resized, offset: int64. `dtype`: the matmuls' (None: float16 on
    a GPU, float32 on the CPU).
    Returns float (B, 3, oh, ow) in [0, 1]: planar from the CPU loop, channels_last otherwise."""
    if isinstance(canvas, RaggedImages):  # the GPU path: no canvas (augment/ragged.py)
        return resample(canvas, box, resized, offset, out_hw, dtype)
    if isinstance(canvas, list):
        method = "loop"
    elif method == "auto":
        method = "loop" if canvas.device.type == "cpu" else "matmul"
    oh, ow = out_hw
    if method == "loop":
        # planar output: the CPU's pixel ops are fastest on it (see ColorJitter.apply)
        out = torch.empty((len(canvas), 3, oh, ow), dtype=torch.uint8)
        for b, ((t, left, h, w), (rh, rw), (oy, ox)) in enumerate(
            zip(box.tolist(), resized.tolist(), offset.tolist(), strict=True)
        ):
            crop = canvas[b][t : t + h, left : left + w].permute(2, 0, 1)[None]  # a channels_last view, no copy
            if (h, w) != (rh, rw):
                crop = F.interpolate(crop, size=(rh, rw), mode="bilinear", antialias=True, align_corners=False)
            out[b] = crop[0, :, oy : oy + oh, ox : ox + ow]
        return out.float().div_(255.0)
    # on a GPU in float16 (tensor cores): in float32 these two matmuls were a large share of the
    # GPU's decode + augment time. Pixels 0-255 are exact in it; the weights and the rows pass
    # are rounded, so the result is off by a fraction of a level, and some pixels land on the
    # neighbouring uint8 level (tests/test_augment.py holds the bounds; docs/design.md,
    # "Choices and where they were measured")
    dtype = dtype or (torch.float16 if canvas.device.type == "cuda" else torch.float32)
    wy = aa_weights(box[:, 0], box[:, 2], resized[:, 0], offset[:, 0], oh, canvas.shape[1]).to(dtype)  # (B, oh, Hmax)
    wx = aa_weights(box[:, 1], box[:, 3], resized[:, 1], offset[:, 1], ow, canvas.shape[2]).to(dtype)  # (B, ow, Wmax)
    x = canvas.to(dtype)  # (B, Hmax, Wmax, 3)
    x = torch.einsum("byh,bhwc->bywc", wy, x)  # rows first: (B, oh, Wmax, 3)
    x = torch.einsum("bxw,bywc->byxc", wx, x)  # (B, oh, ow, 3)
    return x.float().div_(255.0).clamp_(0.0, 1.0).permute(0, 3, 1, 2)


def first_valid(ok: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values[..., b, first index where ok[b]] (any index if none is ok) for (..., B, tries)
    values: torchvision's 'try 10 times, keep the first that fits', for the whole batch at once."""
    first = ok.to(torch.uint8).argmax(1, keepdim=True)
    return values.gather(-1, first.expand(*values.shape[:-1], 1))[..., 0]


@register
class RandomResizedCrop(GeometryOp):
    """torchvision.transforms.RandomResizedCrop(size, scale, ratio), antialiased bilinear.

    The crop box is drawn on each original image (not on a copy resized to one size first)
    with torchvision's get_params: up to 10 tries of (area, log-uniform aspect ratio), the
    first that fits wins, else a central crop clamped to the ratio range.
    """

    name = "random_resized_crop"
    uniforms = 22  # what sample draws per image (KeyedRng.prefetch)
    scalable = ("scale", "ratio")

    def __init__(self, *, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), method: str = "auto"):
        super().__init__()
        self.size = as_pair(size)
        self.scale, self.ratio = (float(scale[0]), float(scale[1])), (float(ratio[0]), float(ratio[1]))
        if not (0 < self.scale[0] <= self.scale[1] <= 1 and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(
                "random_resized_crop: need 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1], got "
                f"scale={scale} ratio={ratio}"
            )
        if method not in ("auto", "loop", "matmul"):
            raise ValueError(f"random_resized_crop: method must be auto, loop or matmul, got {method!r}")
        self.method = method

    def set_strength(self, s):
        # strength s shrinks the area range towards its top and the aspect-ratio range towards 1
        # (log scale); s = 0 leaves (almost) the whole image, squared off as in the fallback.
        if self._base is None:
            self._base = {"scale": self.scale, "ratio": self.ratio}
        lo, hi = self._base["scale"]
        self.scale = (hi - s * (hi - lo), hi)
        self.ratio = tuple(math.exp(s * math.log(r)) for r in self._base["ratio"])

    def sample(self, rng, sizes):
        h, w = sizes[:, 0].double(), sizes[:, 1].double()
        u = rng.uniform(self.stream, 22).double()  # 10 tries x (area, ratio), then (top, left)
        area = (h * w)[:, None] * (self.scale[0] + u[:, :10] * (self.scale[1] - self.scale[0]))
        lr = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        ar = torch.exp(lr[0] + u[:, 10:20] * (lr[1] - lr[0]))
        sides = torch.round(torch.sqrt(torch.stack([area * ar, area / ar])))  # (2, B, 10): widths, heights
        ok = (sides > 0).all(0) & (sides[0] <= w[:, None]) & (sides[1] <= h[:, None])
        cw, ch = first_valid(ok, sides).unbind(0)
        found = ok.any(1)
        # fallback: the whole image, clamped to the ratio range, centred
        in_ratio = w / h
        fw = torch.where(in_ratio > self.ratio[1], torch.round(h * self.ratio[1]), w)
        fh = torch.where(in_ratio < self.ratio[0], torch.round(w / self.ratio[0]), h)
        cw, ch = torch.where(found, cw, fw), torch.where(found, ch, fh)
        top = torch.where(found, torch.floor(u[:, 20] * (h - ch + 1)), torch.div(h - ch, 2, rounding_mode="floor"))
        left = torch.where(found, torch.floor(u[:, 21] * (w - cw + 1)), torch.div(w - cw, 2, rounding_mode="floor"))
        box = torch.stack([top, left, ch, cw], 1).long()
        out = constant(self.size, sizes.device).expand(len(sizes), 2)
        return {"box": box, "resized": out, "offset": constant((0, 0), sizes.device).expand(len(sizes), 2)}

    def apply(self, canvas, params, sizes=None):
        canvas = as_canvas(canvas) if self.method == "matmul" else canvas  # a list: resampled image by image
        return resample_boxes(canvas, params["box"], params["resized"], params["offset"], self.size, self.method)

    def max_shrink(self, params):
        # the crop box, shrunk by s, must stay at least the output size on both sides: the
        # resize that follows then still only shrinks (antialiased), never enlarges
        box, (oh, ow) = params["box"], self.size
        factors = torch.ones(len(box), dtype=torch.int64, device=box.device)
        for s in SHRINK_FACTORS[1:]:
            factors = torch.where((box[:, 2] >= s * oh) & (box[:, 3] >= s * ow), s, factors)
        return factors

    def shrink_params(self, params, factors):
        # libjpeg's scaled IDCT maps pixel i of the small image to pixels [s*i, s*(i+1)) of the
        # full one: each edge of the box goes to the nearest small-pixel edge (at most s/2 full
        # pixels off). The box keeps at least floor(h / s) >= the output's rows, so the resize
        # still only shrinks.
        top, left, h, w = params["box"].unbind(1)
        half = torch.div(factors, 2, rounding_mode="floor")

        def edge(x):
            return torch.div(x + half, factors, rounding_mode="floor")

        t0, l0, t1, l1 = edge(top), edge(left), edge(top + h), edge(left + w)
        return params | {"box": torch.stack([t0, l0, t1 - t0, l1 - l0], 1)}

    def region(self, params):
        return params["box"]  # the resampler reads nothing outside the box

    def in_region(self, params, region, inside):
        box = params["box"]
        corner = box[:, :2] - torch.where(inside[:, None], region[:, :2], 0)
        return params | {"box": torch.cat([corner, box[:, 2:]], 1)}


@register
class ResizeCenterCrop(GeometryOp):
    """torchvision's eval transform: Resize(resize) (shorter side, antialiased bilinear) then
    CenterCrop(size), on each original image. Only the kept window is computed."""

    name = "resize_center_crop"
    lengths = ("resize",)

    def __init__(self, *, resize: int, size, method: str = "auto"):
        super().__init__()
        self.resize, self.size, self.method = int(resize), as_pair(size), method
        if min(self.size) > self.resize:
            raise ValueError(
                f"resize_center_crop: size {size} is larger than resize {resize}; the crop would need padding"
            )
        if method not in ("auto", "loop", "matmul"):
            raise ValueError(f"resize_center_crop: method must be auto, loop or matmul, got {method!r}")

    def sample(self, rng, sizes):
        h, w = sizes[:, 0], sizes[:, 1]
        short, long = torch.minimum(h, w), torch.maximum(h, w)
        # torchvision: new_long = int(size * long / short), computed in Python floats
        new_long = torch.floor(self.resize * long.double() / short.double()).long()
        rh = torch.where(h <= w, torch.full_like(h, self.resize), new_long)
        rw = torch.where(h <= w, new_long, torch.full_like(w, self.resize))
        th, tw = self.size
        oy = torch.round((rh - th).double() / 2.0).long()  # CenterCrop's int(round(...))
        ox = torch.round((rw - tw).double() / 2.0).long()
        box = torch.stack([torch.zeros_like(h), torch.zeros_like(w), h, w], 1)
        return {"box": box, "resized": torch.stack([rh, rw], 1), "offset": torch.stack([oy, ox], 1)}

    def apply(self, canvas, params, sizes=None):
        canvas = as_canvas(canvas) if self.method == "matmul" else canvas  # a list: resampled image by image
        return resample_boxes(canvas, params["box"], params["resized"], params["offset"], self.size, self.method)


def to_canvas(images) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded images -> (uint8 canvas (B, Hmax, Wmax, 3), int64 sizes (B, 2)).

    A fixed-shape batch is used as it is (no copy); a ragged one (an object array of HWC
    arrays) is copied into the top-left corners of a canvas. The rest of the canvas is left
    uninitialised: no op reads outside an image's size (crops mask, resampling weights
    are zero there), and zero-filling it would cost as much as the copy (docs/design.md,
    "Choices and where they were measured").
    """
    if isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.ndim == 4:
        b, h, w, c = images.shape
        if c != 3:
            raise ValueError(f"augment: expected RGB images (B, H, W, 3), got shape {images.shape}")
        with warnings.catch_warnings():  # Arrow's buffers are read-only; nothing here writes to them
            warnings.simplefilter("ignore", UserWarning)
            canvas = torch.from_numpy(images)
        return canvas, torch.tensor([[h, w]], dtype=torch.int64).expand(b, 2)
    arrays = list(images)
    for a in arrays:
        if a.dtype not in (np.uint8, torch.uint8) or a.ndim != 3 or a.shape[2] != 3:
            raise ValueError(f"augment: expected uint8 HWC RGB images, got {a.dtype} {tuple(a.shape)}")
    device = arrays[0].device if isinstance(arrays[0], torch.Tensor) else torch.device("cpu")
    sizes = torch.tensor([a.shape[:2] for a in arrays], dtype=torch.int64).view(-1, 2)
    canvas = torch.empty(
        (len(arrays), int(sizes[:, 0].max()), int(sizes[:, 1].max()), 3), dtype=torch.uint8, device=device
    )
    with warnings.catch_warnings():  # read-only arrays (decoded by PIL, Arrow's buffers) are only read
        warnings.simplefilter("ignore", UserWarning)
        for i, a in enumerate(arrays):  # a memcpy per image; unavoidable for ragged input
            canvas[i, : a.shape[0], : a.shape[1]] = torch.as_tensor(a)
    return canvas, sizes.to(device)
