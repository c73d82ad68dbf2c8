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
* pixel ops take and return that float batch.

Semantics follow torchvision's transforms of the same names; the tests compare them.
"""

from __future__ import annotations

import math

import kornia
import torch
import torch.nn.functional as F

from augment.rng import KeyedRng

OPS: dict[str, type["Op"]] = {}


def register(cls):
    OPS[cls.name] = cls
    return cls


class Op(torch.nn.Module):
    name = ""
    geometry = False  # True: canvas + sizes in, uniform float batch out
    scalable: tuple[str, ...] = ()  # parameters that a strength schedule may scale

    def __init__(self):
        super().__init__()
        self.stream = 0  # set by the pipeline: the op's own random stream

    def sample(self, rng: KeyedRng, sizes: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def apply(self, x, params, sizes=None):
        raise NotImplementedError

    def forward(self, x, rng: KeyedRng, sizes: torch.Tensor | None = None):
        return self.apply(x, self.sample(rng, sizes), sizes)


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
    geometry = True

    def __init__(self, *, size, padding: int = 0, fill: float = 0.0):
        super().__init__()
        self.size, self.padding, self.fill = _as_pair(size), int(padding), float(fill)

    def sample(self, rng, sizes):
        th, tw = self.size
        # pad_if_needed: an image smaller than the crop is padded up to it (both sides).
        ph = (sizes[:, 0] + 2 * self.padding).clamp(min=th)
        pw = (sizes[:, 1] + 2 * self.padding).clamp(min=tw)
        u = rng.uniform(self.stream, 2)
        top = (u[:, 0] * (ph - th + 1).float()).long()
        left = (u[:, 1] * (pw - tw + 1).float()).long()
        # back to image coordinates: subtract the padding in front of the image
        pad_top = self.padding + ((th - (sizes[:, 0] + 2 * self.padding)).clamp(min=0))
        pad_left = self.padding + ((tw - (sizes[:, 1] + 2 * self.padding)).clamp(min=0))
        return {"top": top - pad_top, "left": left - pad_left}

    def apply(self, canvas, params, sizes=None):
        return _to_float_nchw(gather_crop(canvas, sizes, params["top"], params["left"], self.size, self.fill))


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
        # torchvision: int(round((h - th) / 2.0)); Python's round is half-to-even, as is torch.round
        top = torch.round((sizes[:, 0] - th).double() / 2.0).long()
        left = torch.round((sizes[:, 1] - tw).double() / 2.0).long()
        return {"top": top, "left": left}

    def apply(self, canvas, params, sizes=None):
        return _to_float_nchw(gather_crop(canvas, sizes, params["top"], params["left"], self.size))


@register
class HorizontalFlip(Op):
    """torchvision.transforms.RandomHorizontalFlip(p)."""

    name = "horizontal_flip"

    def __init__(self, *, p: float = 0.5):
        super().__init__()
        self.p = float(p)

    def sample(self, rng, sizes):
        return {"flip": rng.uniform(self.stream, 1)[:, 0] < self.p}

    def apply(self, x, params, sizes=None):
        return torch.where(params["flip"][:, None, None, None], x.flip(-1), x)


@register
class ColorJitter(Op):
    """torchvision.transforms.ColorJitter(brightness, contrast, saturation, hue).

    Like torchvision, each image gets its own factors and its own random order of the
    adjustments. Brightness, contrast and saturation are all `blend(x, m, f)` with a
    different `m` (0, the mean grey level, the grey image), so each of the steps is one
    fused multiply-add over the batch whatever order each image drew.
    """

    name = "color_jitter"
    scalable = ("brightness", "contrast", "saturation", "hue")

    def __init__(self, *, brightness: float = 0.0, contrast: float = 0.0, saturation: float = 0.0, hue: float = 0.0, p: float = 1.0):
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
        lo = torch.tensor([r[0] for r in self._ranges()], device=u.device)
        hi = torch.tensor([r[1] for r in self._ranges()], device=u.device)
        factors = lo + u[:, :4] * (hi - lo)  # (B, 4): brightness, contrast, saturation, hue
        n = 4 if self.hue > 0 else 3  # without hue, only the order of the first three matters
        order = torch.argsort(u[:, 4 : 4 + n], dim=1)  # a uniformly random permutation per image
        return {"factors": factors, "order": order, "apply": u[:, 8] < self.p}

    def apply(self, x, params, sizes=None):
        identity = torch.tensor([1.0, 1.0, 1.0, 0.0], device=x.device)
        factors = torch.where(params["apply"][:, None], params["factors"], identity)
        order = params["order"]
        for step in range(order.shape[1]):
            op = order[:, step].view(-1, 1, 1, 1)  # which adjustment each image makes now
            f = factors.gather(1, order[:, step : step + 1]).view(-1, 1, 1, 1)
            if self.hue > 0:
                x = torch.where(op == 3, kornia.enhance.adjust_hue(x, f.view(-1) * (2 * math.pi)), x)
            gray = kornia.color.rgb_to_grayscale(x)  # (B, 1, H, W), the ITU-R 601 weights torchvision uses
            mean = gray.mean(dim=(2, 3), keepdim=True)
            m = torch.where(op == 2, gray, torch.where(op == 1, mean, torch.zeros_like(mean)))
            x = torch.where(op < 3, (f * x + (1.0 - f) * m).clamp_(0.0, 1.0), x)
        return x


def check_params(op_cls: type[Op], params: dict) -> None:
    """Raise a ValueError naming the valid parameters when `params` has an unknown one."""
    import inspect

    valid = [p for p in inspect.signature(op_cls.__init__).parameters if p != "self"]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(f"op {op_cls.name!r}: unknown parameter(s) {unknown}; valid: {valid}")


class Normalize(torch.nn.Module):
    """uint8 (B, H, W, 3) -> float (B, 3, H, W), (x/255 - mean) / std, channels_last.

    Runs where the model runs (DESIGN.md: uint8 travels between stages). The permute of an
    NHWC batch *is* the channels_last layout, so no copy is made besides the cast.
    """

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("scale", 1.0 / (255.0 * torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)))
        self.register_buffer("shift", (torch.tensor(mean) / torch.tensor(std)).float().view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"Normalize expects uint8 (B, H, W, 3), got {images.dtype} {tuple(images.shape)}")
        return images.permute(0, 3, 1, 2).float() * self.scale - self.shift
