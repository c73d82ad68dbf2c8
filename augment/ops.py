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

import inspect
import math

import torch

from augment.errors import PresetError
from augment.geometry import GeometryOp, first_valid  # importing it registers the geometry ops in OPS
from augment.kornia_ops import KeyedKornia, build_keyed, is_kornia
from augment.op import OPS, Op, as_pair, compiled_loops, constant, register


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
        loops = compiled_loops() if self.hue == 0 and x.device.type == "cpu" else None  # see _compiled
        done = None if loops is None else loops.color_jitter_(x, self.factors_or_identity(params), params["order"])
        return self.apply(x, params) if done is None else done  # None: not a batch the loops take

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
        eh, ew = first_valid(ok, eh), first_valid(ok, ew)
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
        self.kornia = build_keyed(kornia_name, params, (3, *as_pair(size)))

    def sample(self, rng, sizes):
        return {"seeds": rng.seeds(self.stream)[:, 0]}

    def apply(self, x, params, sizes=None):
        return self.kornia(x, params["seeds"].tolist())  # host sync on a GPU, once a batch


def can_shrink(name: str) -> bool:
    """Whether op `name`, first in a preset, lets the CPU decode a JPEG at a reduced size."""
    return name in OPS and issubclass(OPS[name], GeometryOp) and OPS[name].max_shrink is not GeometryOp.max_shrink


def check_params(op_cls: type[Op], params: dict) -> None:
    """Raise a ValueError naming the valid parameters when `params` has an unknown one."""
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


def build_ops(specs) -> list[Op]:
    """A list of op specs as ops, each on its own random stream (its position, from 1); a Kornia op
    is tried on the batch the first op makes. PresetError for a spec that does not build."""
    ops: list[Op] = []
    for stream, spec in enumerate(specs, start=1):
        ((name, params),) = spec.items()
        try:
            op = KorniaOp(name, params, size=ops[0].size if ops else None) if is_kornia(name) else OPS[name](**params)
        except (TypeError, ValueError) as e:
            raise PresetError(f"[{stream - 1}]: {e}") from None
        op.stream = stream  # the op's own random stream: its position in the list
        ops.append(op)
    return ops
