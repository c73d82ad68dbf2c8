"""MixUp and CutMix with soft labels, on the trainer's device (they need the labels).

    mix = MixUpCutMix(num_classes=10, **preset.mix)       # once, before the loop
    g = mix_generator(seed, epoch, step, rank)            # per step: replayable, per rank
    x, target = mix(x, y, g)                              # x float (B, C, H, W); target (B, K)
    loss = F.cross_entropy(logits, target)                # soft-label cross-entropy

Like torchvision.transforms.v2.MixUp/CutMix and timm's Mixup in its default "batch"
mode: one mixing weight per batch, each image paired with its neighbour in the batch
(`roll(1)`), with probability `switch_prob` CutMix instead of MixUp when both are on.
The few parameters are drawn on the host from a CPU torch.Generator, so nothing here
waits on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from augment.streams import stream_seed

MIX_KEYS = ("mixup_alpha", "cutmix_alpha", "prob", "switch_prob", "label_smoothing")


def check_mix(settings) -> dict:
    """A preset's `mix:` mapping, checked; ValueError naming the valid keys or the bad value."""
    if not isinstance(settings, dict):
        raise ValueError(f"mix: expected a mapping like {{mixup_alpha: 0.2, cutmix_alpha: 1.0}}, got {settings!r}")
    unknown = sorted(set(settings) - set(MIX_KEYS))
    if unknown:
        raise ValueError(f"mix: unknown key(s) {unknown}; valid: {list(MIX_KEYS)}")
    out = {k: float(v) for k, v in settings.items()}
    if out.get("mixup_alpha", 0) < 0 or out.get("cutmix_alpha", 0) < 0:
        raise ValueError(f"mix: alphas must be >= 0 (0 turns one off), got {settings}")
    if out.get("mixup_alpha", 0) == 0 and out.get("cutmix_alpha", 0) == 0:
        raise ValueError("mix: set mixup_alpha and/or cutmix_alpha above 0 (e.g. 0.2 and 1.0), or drop the mix key")
    for k in ("prob", "switch_prob", "label_smoothing"):
        if k in out and not 0 <= out[k] <= 1:
            raise ValueError(f"mix: {k} must be in [0, 1], got {out[k]}")
    return out


def mix_generator(seed: int, epoch: int, step: int, rank: int) -> torch.Generator:
    """A CPU generator that differs for every (seed, epoch, step, rank) and replays exactly."""
    return torch.Generator().manual_seed(stream_seed("mix", seed, epoch, step, rank))


class MixUpCutMix:
    def __init__(
        self,
        *,
        num_classes: int,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        label_smoothing: float = 0.0,
    ):
        check_mix(
            {
                "mixup_alpha": mixup_alpha,
                "cutmix_alpha": cutmix_alpha,
                "prob": prob,
                "switch_prob": switch_prob,
                "label_smoothing": label_smoothing,
            }
        )
        self.num_classes, self.prob, self.switch_prob, self.smoothing = (
            int(num_classes),
            float(prob),
            float(switch_prob),
            float(label_smoothing),
        )
        self.mixup_alpha, self.cutmix_alpha = float(mixup_alpha), float(cutmix_alpha)

    def _beta(self, alpha: float, g: torch.Generator) -> float:
        gam = torch._standard_gamma(torch.full((2,), alpha, dtype=torch.float64), generator=g)
        return float(gam[0] / (gam[0] + gam[1]))

    def sample(self, hw: tuple[int, int], g: torch.Generator) -> dict:
        """The batch's parameters: mode ('none', 'mixup', 'cutmix'), lam, and the CutMix box."""
        u = torch.rand(4, generator=g, dtype=torch.float64).tolist()
        if u[0] >= self.prob:
            return {"mode": "none", "lam": 1.0}
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha == 0 or u[1] < self.switch_prob)
        if not use_cutmix:
            return {"mode": "mixup", "lam": self._beta(self.mixup_alpha, g)}
        lam = self._beta(self.cutmix_alpha, g)
        h, w = hw
        # torchvision v2 CutMix: box centre uniform, half-sides r*H, r*W with r = sqrt(1 - lam)/2,
        # clipped to the image; lam is then the share of pixels that were kept
        cy, cx = int(u[2] * h), int(u[3] * w)
        r = 0.5 * (1.0 - lam) ** 0.5
        rh, rw = int(r * h), int(r * w)
        y1, y2, x1, x2 = max(cy - rh, 0), min(cy + rh, h), max(cx - rw, 0), min(cx + rw, w)
        return {"mode": "cutmix", "lam": 1.0 - (y2 - y1) * (x2 - x1) / (h * w), "box": (y1, y2, x1, x2)}

    def __call__(self, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator):
        """x float (B, C, H, W), y int64 (B,) -> (mixed x, soft targets (B, num_classes) float)."""
        if not x.is_floating_point() or x.ndim != 4 or y.ndim != 1 or y.shape[0] != x.shape[0]:
            raise ValueError(
                f"MixUpCutMix expects float (B, C, H, W) and int (B,) labels, got {x.dtype} {tuple(x.shape)} and "
                f"{tuple(y.shape)}"
            )
        p = self.sample(tuple(x.shape[-2:]), generator)
        off = self.smoothing / self.num_classes
        target = F.one_hot(y, self.num_classes).to(x.dtype) * (1.0 - self.smoothing) + off
        if p["mode"] == "none":
            return x, target
        lam = p["lam"]
        if p["mode"] == "mixup":
            x = x * lam + x.roll(1, 0) * (1.0 - lam)
        else:
            y1, y2, x1, x2 = p["box"]
            rows = torch.arange(x.shape[-2], device=x.device)
            cols = torch.arange(x.shape[-1], device=x.device)
            box = ((rows >= y1) & (rows < y2))[:, None] & ((cols >= x1) & (cols < x2))[None, :]  # (H, W)
            x = torch.where(box, x.roll(1, 0), x)
        return x, target * lam + target.roll(1, 0) * (1.0 - lam)
