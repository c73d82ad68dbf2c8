"""Augmentation strength over epochs: a multiplier in [0, 1] on the preset's magnitudes.

Torch-free, so the config can validate a name without importing the pipeline.

    none                 1 every epoch (the preset as written; the default)
    linear-decay[:END]   1 at the first epoch -> END (default 0) at the last, linearly
    cosine-decay[:END]   the same on a half cosine (strong for longer, then fades)
    linear-ramp[:START]  START (default 0) at the first epoch -> 1 at the last
    cosine-ramp[:START]  the same on a half cosine

What the multiplier scales is each op's choice (Op.set_strength): colour-jitter
factors, the erased-area range of random_erasing, and for random_resized_crop the crop
area range shrinks towards its top and the aspect-ratio range towards 1.
"""

from __future__ import annotations

import math

SCHEDULES = ("none", "linear-decay", "cosine-decay", "linear-ramp", "cosine-ramp")


def parse_schedule(spec: str) -> tuple[str, float]:
    """'cosine-decay:0.3' -> ('cosine-decay', 0.3). ValueError naming the valid forms."""
    name, _, end = str(spec).partition(":")
    if name not in SCHEDULES or (name == "none" and end):
        raise ValueError(
            f"unknown augmentation schedule {spec!r}; valid: {', '.join(SCHEDULES)} (decay/ramp take an optional "
            "':LEVEL' in [0, 1], e.g. cosine-decay:0.3)"
        )
    try:
        level = float(end) if end else 0.0
    except ValueError:
        level = -1.0
    if not 0.0 <= level <= 1.0:
        raise ValueError(f"augmentation schedule {spec!r}: the level after ':' must be a number in [0, 1]")
    return name, level


def strength(spec: str, epoch: int, epochs: int) -> float:
    """Multiplier for `epoch` (0-based) of `epochs`."""
    name, level = parse_schedule(spec)
    if name == "none":
        return 1.0
    t = min(max(epoch / max(epochs - 1, 1), 0.0), 1.0)  # 0 at the first epoch, 1 at the last
    shape = t if name.startswith("linear") else 0.5 * (1.0 - math.cos(math.pi * t))
    if name.endswith("decay"):
        return 1.0 - (1.0 - level) * shape
    return level + (1.0 - level) * shape
