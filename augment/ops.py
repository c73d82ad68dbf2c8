"""Augmentation ops that run on whole batches.

Every op keeps parameter sampling apart from applying the transform (Kornia's habit), so
a batch can be replayed from its parameters and the sampling can be tested against
torchvision's distributions on its own:

    params = op.sample(rng, sizes)     # per-image parameters, drawn from KeyedRng
    x      = op.apply(x, params)       # the whole batch at once, on x's device

Two kinds of op:

* geometry ops take the decoded batch, a uint8 canvas (B, Hmax, Wmax, 3) holding images
  of possibly different sizes `sizes` (B, 2) = (h, w) in its top-left corners, and
  return one float batch (B, 3, S, S) in [0, 1], laid out channels_last;
* pixel ops take and return that float batch: ours, and any of Kornia's 2D augmentations
  by name (`KorniaOp`, augment/kornia_ops.py).

Semantics follow torchvision's transforms of the same names; the tests compare them. Every
op draws each image's parameters from the image's own key, so an image's augmentation does
not depend on the batch it lands in. Kornia is imported only by the ops that use it.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from augment.decode import SHRINK_FACTORS
from augment.kornia_ops import KeyedKornia, build_keyed
from augment.ragged import RaggedImages, crop, resample
from augment.rng import KeyedRng

OPS: dict[str, type["Op"]] = {}


@functools.cache
def compiled_loops():
    """The CPU path's compiled loops (augment/cpu_kernels.py), imported on first use; None where
    numba is missing (an environment assembled by hand): the torch ops then run on the CPU too."""
    try:
        from augment import cpu_kernels
    except ImportError:
        return None
    return cpu_kernels


def register(cls):
    OPS[cls.name] = cls
    return cls


class Op(torch.nn.Module):
    name = ""
    geometry = False  # True: canvas + sizes in, uniform float batch out
    # True: on the CPU, `apply` also takes a list of (H, W, 3) uint8 images in place of the
    # canvas (each image is resampled on its own there), sparing the copy into a canvas
    takes_image_list = False
    uniforms = 0  # uniforms sample draws per image, where it is known (KeyedRng.prefetch draws them at once)
    scalable: tuple[str, ...] = ()  # parameters that a strength schedule may scale
    # geometry ops: lengths in px besides `size` that scale with it (--image-size, progressive resizing)
    lengths: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.stream = 0  # set by the pipeline: the op's own random stream
        self._base: dict | None = None  # the preset's magnitudes, before any strength scaling

    def set_strength(self, s: float) -> None:
        """Scale the magnitudes in `scalable` by s in [0, 1] (1 = as the preset wrote them)."""
        if self._base is None:
            self._base = {k: getattr(self, k) for k in self.scalable}
        for k, v in self._base.items():
            setattr(self, k, tuple(e * s for e in v) if isinstance(v, tuple) else v * s)

    def sample(self, rng: KeyedRng, sizes: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def apply(self, x, params, sizes=None):
        raise NotImplementedError

    def apply_(self, x, params, sizes=None):
        """`apply`, free to overwrite x: the pipeline hands each op after the first its own
        intermediate batch, which nothing else holds. Ops that can work in place on the CPU do."""
        return self.apply(x, params, sizes)

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

    def forward(self, x, rng: KeyedRng, sizes: torch.Tensor | None = None):
        return self.apply(x, self.sample(rng, sizes), sizes)


@functools.cache
def constant(values, device) -> torch.Tensor:
    """A small constant tensor on `device`, made once (a fresh one would be an upload on a GPU at
    every batch). Never written to: hand out expanded views, or compute from it."""
    return torch.tensor(values, device=device)


def _as_pair(size) -> tuple[int, int]:
    return (int(size), int(size)) if isinstance(size, (int, float)) else (int(size[0]), int(size[1]))


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
class RandomCrop(Op):
    """torchvision.transforms.RandomCrop(size, padding, pad_if_needed=True, fill) on a batch."""

    name = "random_crop"
    uniforms = 2  # what sample draws per image (KeyedRng.prefetch)
    geometry = True
    lengths = ("padding",)

    def __init__(self, *, size, padding: int = 0, fill: float = 0.0):
        super().__init__()
        self.size, self.padding, self.fill = _as_pair(size), int(padding), float(fill)

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
        return _to_float_nchw(gather_crop(canvas, sizes, params["top"], params["left"], self.size, self.fill))


def _center_offset(n: torch.Tensor, crop: int) -> torch.Tensor:
    """torchvision's center_crop along one dimension, as the offset of the window in the image.
    A larger image: int(round((n - crop) / 2.0)), half-to-even like torch.round. A smaller one
    is padded with (crop - n) // 2 in front first, so its offset is minus that."""
    return torch.where(n >= crop, torch.round((n - crop).double() / 2.0).long(), -((crop - n) // 2))


@register
class CenterCrop(Op):
    """torchvision.transforms.CenterCrop(size): the middle window, zero-padded if too small."""

    name = "center_crop"
    geometry = True

    def __init__(self, *, size):
        super().__init__()
        self.size = _as_pair(size)

    def sample(self, rng, sizes):
        th, tw = self.size
        return {"top": _center_offset(sizes[:, 0], th), "left": _center_offset(sizes[:, 1], tw)}

    def apply(self, canvas, params, sizes=None):
        return _to_float_nchw(gather_crop(canvas, sizes, params["top"], params["left"], self.size))


@register
class HorizontalFlip(Op):
    """torchvision.transforms.RandomHorizontalFlip(p)."""

    name = "horizontal_flip"
    uniforms = 1  # what sample draws per image (KeyedRng.prefetch)

    def __init__(self, *, p: float = 0.5):
        super().__init__()
        self.p = float(p)

    def sample(self, rng, sizes):
        return {"flip": rng.uniform(self.stream, 1)[:, 0] < self.p}

    def apply(self, x, params, sizes=None):
        if self._per_image(x):
            return self.apply_(x.clone(), params)
        return torch.where(params["flip"][:, None, None, None], x.flip(-1), x)  # one kernel for the batch

    def apply_(self, x, params, sizes=None):
        if not self._per_image(x):
            return self.apply(x, params)
        for i in params["flip"].nonzero()[:, 0].tolist():
            x[i] = x[i].flip(-1)
        return x

    @staticmethod
    def _per_image(x) -> bool:
        # the CPU's own path (planar), images of 64 px and more: only the images that flip, in
        # place, which is cheaper there than torch.where; on smaller images Python's per-image
        # cost outweighs the saving (docs/design.md, "Choices and where they were measured").
        # The GPU's path run on a CPU (channels_last) takes torch.where, as on a GPU.
        return x.device.type == "cpu" and x.is_contiguous() and x.shape[1:].numel() >= 3 * 64 * 64


@register
class ColorJitter(Op):
    """torchvision.transforms.ColorJitter(brightness, contrast, saturation, hue).

    Like torchvision, each image gets its own factors and its own random order of the
    adjustments. Brightness, contrast and saturation are all `blend(x, m, f)` with a
    different `m` (0, the mean grey level, the grey image), so each of the steps is one
    fused multiply-add over the batch whatever order each image drew.
    """

    name = "color_jitter"
    uniforms = 9  # what sample draws per image (KeyedRng.prefetch)
    scalable = ("brightness", "contrast", "saturation", "hue")

    def __init__(
        self,
        *,
        brightness: float = 0.0,
        contrast: float = 0.0,
        saturation: float = 0.0,
        hue: float = 0.0,
        p: float = 1.0,
    ):
        super().__init__()
        self.brightness, self.contrast, self.saturation, self.hue = map(float, (brightness, contrast, saturation, hue))
        if not 0 <= self.hue <= 0.5:
            raise ValueError(f"color_jitter: hue must be in [0, 0.5], got {hue}")
        self.p = float(p)

    def _ranges(self):
        return [
            (max(0.0, 1 - self.brightness), 1 + self.brightness),
            (max(0.0, 1 - self.contrast), 1 + self.contrast),
            (max(0.0, 1 - self.saturation), 1 + self.saturation),
            (-self.hue, self.hue),
        ]

    def sample(self, rng, sizes):
        u = rng.uniform(self.stream, 9)  # 4 factors, 4 order keys, 1 apply draw
        lo, hi = constant(tuple(self._ranges()), u.device).unbind(1)
        factors = lo + u[:, :4] * (hi - lo)  # (B, 4): brightness, contrast, saturation, hue
        n = 4 if self.hue > 0 else 3  # without hue, only the order of the first three matters
        order = torch.argsort(u[:, 4 : 4 + n], dim=1)  # a uniformly random permutation per image
        return {"factors": factors, "order": order, "apply": u[:, 8] < self.p}

    def apply(self, x, params, sizes=None):
        if self._compiled(x):
            return self.apply_(x.clone(), params)
        factors, order = self.factors_or_identity(params), params["order"]
        w = _GRAY.tolist()
        for step in range(order.shape[1]):
            op = order[:, step].view(-1, 1, 1, 1)  # which adjustment each image makes now
            f = factors.gather(1, order[:, step : step + 1]).view(-1, 1, 1, 1)
            if self.hue > 0:
                x = _adjust_hue_where(x, op.view(-1) == 3, f.view(-1))
                f = torch.where(op == 3, 1.0, f)  # the blend below is then the identity for these
            # Brightness, contrast and saturation are each a blend f*x + (1-f)*m, with m = 0, the
            # mean grey level, or the grey image: m for every image at once from 0/1 selectors,
            # then one fused multiply-add.
            gray = (x[:, 0:1] * w[0]).add_(x[:, 1:2], alpha=w[1]).add_(x[:, 2:3], alpha=w[2])  # (B, 1, H, W)
            is_con, is_sat = (op == 1).to(x.dtype), (op == 2).to(x.dtype)
            m = gray * ((1.0 - f) * is_sat) + gray.mean(dim=(2, 3), keepdim=True) * ((1.0 - f) * is_con)
            x = torch.addcmul(m, x, f).clamp_(0.0, 1.0)
        return x

    def apply_(self, x, params, sizes=None):
        if not self._compiled(x):
            return self.apply(x, params)
        return compiled_loops().color_jitter_(x, self.factors_or_identity(params), params["order"])

    def factors_or_identity(self, params) -> torch.Tensor:
        """(B, 4) factors, the identity's for the images that do not jitter."""
        identity = constant((1.0, 1.0, 1.0, 0.0), params["factors"].device)
        return torch.where(params["apply"][:, None], params["factors"], identity)

    def _compiled(self, x) -> bool:
        # on the CPU's planar batches, numba's loops (augment/cpu_kernels.py): a pass over an
        # image per step, against about ten passes over the batch for the torch ops above
        # (docs/design.md, "Choices and where they were measured"). Hue stays with Kornia's op.
        if self.hue > 0 or x.device.type != "cpu":
            return False
        loops = compiled_loops()
        return loops is not None and loops.takes(x)


def _adjust_hue_where(x: torch.Tensor, where: torch.Tensor, hue: torch.Tensor) -> torch.Tensor:
    """torchvision's adjust_hue(hue) on the images where `where`, one factor per image. Kornia's
    adjust_hue takes a factor per image (torchvision's one per call) and agrees with torchvision's
    to well under a uint8 level (docs/benchmark-log.md). Only the chosen images are converted to
    HSV and back: each image takes its hue step once in four."""
    from kornia.enhance import adjust_hue

    idx = where.nonzero()[:, 0]  # host sync on a GPU, one per step
    if idx.numel() == 0:
        return x
    return x.index_copy(0, idx, adjust_hue(x.index_select(0, idx), hue[idx] * (2 * math.pi)))


_GRAY = torch.tensor([0.2989, 0.587, 0.114])  # torchvision's rgb_to_grayscale weights (ITU-R 601-2)


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


def _first_valid(ok: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values[..., b, first index where ok[b]] (any index if none is ok) for (..., B, tries)
    values: torchvision's 'try 10 times, keep the first that fits', for the whole batch at once."""
    first = ok.to(torch.uint8).argmax(1, keepdim=True)
    return values.gather(-1, first.expand(*values.shape[:-1], 1))[..., 0]


@register
class RandomResizedCrop(Op):
    """torchvision.transforms.RandomResizedCrop(size, scale, ratio), antialiased bilinear.

    The crop box is drawn on each original image (not on a copy resized to one size first)
    with torchvision's get_params: up to 10 tries of (area, log-uniform aspect ratio), the
    first that fits wins, else a central crop clamped to the ratio range.
    """

    name = "random_resized_crop"
    uniforms = 22  # what sample draws per image (KeyedRng.prefetch)
    geometry = True
    takes_image_list = True
    scalable = ("scale", "ratio")

    def __init__(self, *, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), method: str = "auto"):
        super().__init__()
        self.size = _as_pair(size)
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
        cw, ch = _first_valid(ok, sides).unbind(0)
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
class ResizeCenterCrop(Op):
    """torchvision's eval transform: Resize(resize) (shorter side, antialiased bilinear) then
    CenterCrop(size), on each original image. Only the kept window is computed."""

    name = "resize_center_crop"
    geometry = True
    takes_image_list = True
    lengths = ("resize",)

    def __init__(self, *, resize: int, size, method: str = "auto"):
        super().__init__()
        self.resize, self.size, self.method = int(resize), _as_pair(size), method
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
        return resample_boxes(canvas, params["box"], params["resized"], params["offset"], self.size, self.method)


@register
class RandomErasing(Op):
    """torchvision.transforms.RandomErasing(p, scale, ratio, value) on the [0, 1] batch.

    Runs before normalisation, so `value` is a colour in [0, 1]: 0 is black; the dataset mean
    (e.g. [0.485, 0.456, 0.406]) gives torchvision's value=0 after its Normalize.
    """

    name = "random_erasing"
    uniforms = 23  # what sample draws per image (KeyedRng.prefetch)
    scalable = ("scale",)

    def __init__(self, *, p: float = 0.5, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0.0):
        super().__init__()
        self.p = float(p)
        self.scale, self.ratio = (float(scale[0]), float(scale[1])), (float(ratio[0]), float(ratio[1]))
        value = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
        if len(value) != 3 or not all(0 <= v <= 1 for v in value):
            raise ValueError(f"random_erasing: value must be a number or 3 numbers in [0, 1], got {value}")
        self.register_buffer("value", torch.tensor(value).view(1, 3, 1, 1), persistent=False)

    def sample(self, rng, sizes):
        u = rng.uniform(self.stream, 23)  # apply, 10 tries x (area, ratio), (top, left)
        x = u.double()
        img_h, img_w = sizes[:, 0].double(), sizes[:, 1].double()
        img_h, img_w = img_h[:, None], img_w[:, None]
        area = img_h * img_w * (self.scale[0] + x[:, 1:11] * (self.scale[1] - self.scale[0]))
        lr = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        ar = torch.exp(lr[0] + x[:, 11:21] * (lr[1] - lr[0]))
        eh, ew = torch.round(torch.sqrt(area * ar)), torch.round(torch.sqrt(area / ar))
        ok = (eh < img_h) & (ew < img_w)
        eh, ew = _first_valid(ok, eh), _first_valid(ok, ew)
        apply = (u[:, 0] < self.p) & ok.any(1)  # no fit in 10 tries: torchvision leaves the image alone
        top = torch.floor(x[:, 21] * (img_h[:, 0] - eh + 1))
        left = torch.floor(x[:, 22] * (img_w[:, 0] - ew + 1))
        return {"box": torch.stack([top, left, eh, ew], 1).long(), "apply": apply}

    def forward(self, x, rng, sizes=None):
        sizes = torch.tensor(x.shape[-2:], device=x.device).expand(x.shape[0], 2)  # pixel ops see one size
        return self.apply(x, self.sample(rng, sizes))

    def apply(self, x, params, sizes=None):
        top, left, eh, ew = params["box"].unbind(1)
        rows = torch.arange(x.shape[-2], device=x.device)[None, :]
        cols = torch.arange(x.shape[-1], device=x.device)[None, :]
        in_rows = (rows >= top[:, None]) & (rows < (top + eh)[:, None]) & params["apply"][:, None]  # (B, H)
        in_cols = (cols >= left[:, None]) & (cols < (left + ew)[:, None])  # (B, W)
        mask = (in_rows[:, :, None] & in_cols[:, None, :])[:, None]  # (B, 1, H, W)
        return torch.where(mask, self.value.to(x.dtype), x)


class _KorniaPolicy(Op):
    """Kornia's augmentation.auto policies with torchvision's per-image choice of operation.

    Kornia picks one candidate operation per call for the whole batch; torchvision's
    TrivialAugmentWide / RandAugment pick per image. So each image draws its operation(s)
    from its own key, the images are grouped by operation, and each group goes through a
    Kornia policy holding that single candidate, with each image's magnitude drawn by Kornia
    from the image's own seed (augment/kornia_ops.py). The loop is over the ~12-15
    candidates, not over images; on a GPU each group costs a host sync (`nonzero`).
    """

    rounds = 1

    def _candidates(self, policies, make, label: str):
        """One Kornia policy per candidate; `label` names the settings that build them (the probe's cache key)."""
        self.candidates = torch.nn.ModuleList(KeyedKornia(make([p]), f"{label}: {p}") for p in policies)

    def sample(self, rng, sizes):
        u = rng.uniform(self.stream, 1 + self.rounds)
        choice = (u[:, 1:] * len(self.candidates)).long().clamp_(max=len(self.candidates) - 1)  # (B, rounds)
        return {"choice": torch.where((u[:, :1] < self.p), choice, -1), "seeds": rng.seeds(self.stream, self.rounds)}

    def apply(self, x, params, sizes=None):
        seeds = params["seeds"].tolist()  # host sync on a GPU, once a batch: Kornia samples on the CPU
        for r in range(self.rounds):
            choice = params["choice"][:, r]
            for k, policy in enumerate(self.candidates):
                idx = (choice == k).nonzero()[:, 0]  # host sync on a GPU, one per candidate
                if idx.numel():
                    out = policy(x.index_select(0, idx), [seeds[i][r] for i in idx.tolist()])
                    x = x.index_copy(0, idx, out.to(x.dtype))
        return x


@register
class TrivialAugment(_KorniaPolicy):
    """TrivialAugment (Müller & Hutter 2021) with Kornia's default candidates: each image, with
    probability p, gets one operation chosen uniformly at a uniformly random magnitude."""

    name = "trivial_augment"

    def __init__(self, *, p: float = 1.0):
        super().__init__()
        from kornia.augmentation.auto import TrivialAugment as KTA
        from kornia.augmentation.auto.trivial_augment.trivial_augment import default_policy

        self.p = float(p)
        self._candidates(default_policy, lambda policy: KTA(policy=policy), "trivial_augment")


@register
class RandAugment(_KorniaPolicy):
    """RandAugment (Cubuk et al. 2020): each image, with probability p, gets n operations
    chosen uniformly from Kornia's default candidates, each at magnitude m (of 30)."""

    name = "rand_augment"

    def __init__(self, *, n: int = 2, m: int = 9, p: float = 1.0):
        super().__init__()
        from kornia.augmentation.auto import RandAugment as KRA
        from kornia.augmentation.auto.rand_augment.rand_augment import default_policy

        if not (int(n) >= 1 and 0 < int(m) < 30):  # Kornia's RandAugment takes 0 < m < 30
            raise ValueError(f"rand_augment: need n >= 1 and 0 < m < 30, got n={n} m={m}")
        self.p, self.rounds, self.m = float(p), int(n), int(m)
        self._candidates(default_policy, lambda policy: KRA(n=1, m=self.m, policy=policy), f"rand_augment(m={self.m})")


class KorniaOp(Op):
    """Any of Kornia's 2D augmentations by name, `kornia.RandomGaussianBlur: {kernel_size: [5, 5],
    sigma: [0.1, 2.0], p: 0.3}`, with Kornia's own keyword arguments, on the fixed-size float
    batch after the first op. Each image's parameters come from its own key (augment/kornia_ops.py).
    `size` is the batch's (H, W): the op is tried on it when built, so a bad argument is found then."""

    name = "kornia"  # not registered: any `kornia.<Name>` in a preset builds one

    def __init__(self, kornia_name: str, params: dict, *, size):
        super().__init__()
        self.kornia = build_keyed(kornia_name, params, (3, *_as_pair(size)))

    def sample(self, rng, sizes):
        return {"seeds": rng.seeds(self.stream)[:, 0]}

    def apply(self, x, params, sizes=None):
        return self.kornia(x, params["seeds"].tolist())  # host sync on a GPU, once a batch


def can_shrink(name: str) -> bool:
    """Whether op `name`, first in a preset, lets the CPU decode a JPEG at a reduced size."""
    return name in OPS and OPS[name].max_shrink is not Op.max_shrink


def check_params(op_cls: type[Op], params: dict) -> None:
    """Raise a ValueError naming the valid parameters when `params` has an unknown one."""
    import inspect

    valid = [p for p in inspect.signature(op_cls.__init__).parameters if p != "self"]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(f"op {op_cls.name!r}: unknown parameter(s) {unknown}; valid: {valid}")


class Normalize(torch.nn.Module):
    """uint8 (B, H, W, 3) -> float (B, 3, H, W), (x/255 - mean) / std, channels_last.

    Runs where the model runs (docs/design.md: uint8 travels between stages). One operation: the
    cast and the affine map are one addcmul over the uint8 batch (the permute of an NHWC batch *is*
    the channels_last layout, so nothing else is copied), writing `dtype` (the step's: bfloat16
    under bf16 autocast, half the bytes of float32; the same values as float32's, rounded once).
    """

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("scale", 1.0 / (255.0 * torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)))
        self.register_buffer("shift", (-torch.tensor(mean) / torch.tensor(std)).float().view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"Normalize expects uint8 (B, H, W, 3), got {images.dtype} {tuple(images.shape)}")
        out = torch.empty_like(images.permute(0, 3, 1, 2), dtype=dtype)  # channels_last, as the permute
        return torch.addcmul(self.shift, images.permute(0, 3, 1, 2), self.scale, out=out)  # float32 math
