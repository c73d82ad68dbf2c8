"""Schedules over epochs: the augmentation's strength, and the training resolution.

Torch-free, so the config can validate a spec without importing the pipeline.

Strength (--augment-schedule) is a multiplier in [0, 1] on the preset's magnitudes:

    none                 1 every epoch (the preset as written; the default)
    linear-decay[:END]   1 at the first epoch -> END (default 0) at the last, linearly
    cosine-decay[:END]   the same on a half cosine (strong for longer, then fades)
    linear-ramp[:START]  START (default 0) at the first epoch -> 1 at the last
    cosine-ramp[:START]  the same on a half cosine

What the multiplier scales is each op's choice (Op.set_strength): colour-jitter
factors, the erased-area range of random_erasing, and for random_resized_crop the crop
area range shrinks towards its top and the aspect-ratio range towards 1.

Resolution (--progressive-resize, FFCV's progressive resizing) is the side of the training
crops, growing from a lower one to the full --image-size on the same ramp:

    none                 the full size every epoch (the default)
    FROM                 FROM px at the first epoch -> the full size at the last, linearly
    FROM:FIRST-LAST      FROM px up to epoch FIRST, the full size from epoch LAST (1-based),
                         linearly in between (FFCV's start_ramp / end_ramp)

Sizes between the ends are rounded to multiples of RESIZE_STEP px. Evaluation always runs
at the full size.
"""

from __future__ import annotations

import math
import re

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


def ramp(epoch: int, first: int, last: int) -> float:
    """0 up to epoch `first`, 1 from epoch `last` (after `first` when they are one), linear in
    between (0-based epochs; FFCV's rule for its resolution ramp)."""
    if epoch <= first:
        return 0.0
    if epoch >= last:
        return 1.0
    return (epoch - first) / (last - first)


def strength(spec: str, epoch: int, epochs: int) -> float:
    """Multiplier for `epoch` (0-based) of `epochs`."""
    name, level = parse_schedule(spec)
    if name == "none":
        return 1.0
    t = ramp(epoch, 0, epochs - 1)  # 0 at the first epoch, 1 at the last
    shape = t if name.startswith("linear") else 0.5 * (1.0 - math.cos(math.pi * t))
    if name.endswith("decay"):
        return 1.0 - (1.0 - level) * shape
    return level + (1.0 - level) * shape


# Intermediate training sizes are multiples of this: ResNet18's small stem halves the image
# three times, so its feature maps stay whole; FFCV rounds to 32 for the ImageNet stem.
RESIZE_STEP = 8
MIN_IMAGE_SIZE = 8  # px; below this ResNet18's downsampling leaves nothing


def parse_resize(spec: str, epochs: int | None = None) -> tuple[int, int, int] | None:
    """'none' -> None; 'FROM' -> (FROM, 1, epochs or 0); 'FROM:FIRST-LAST' -> (FROM, FIRST, LAST),
    epochs 1-based. ValueError naming the valid forms (and `epochs`, when given, bounds LAST)."""
    spec = str(spec).strip()
    if spec in ("", "none"):
        return None
    m = re.fullmatch(r"(\d+)(?::(\d+)-(\d+))?", spec)
    if not m:
        raise ValueError(
            f"progressive resize {spec!r}: expected none, FROM (px) or FROM:FIRST-LAST (epochs, 1-based), "
            "e.g. 160 or 160:11-13"
        )
    start = int(m.group(1))
    first, last = (int(m.group(2)), int(m.group(3))) if m.group(2) else (1, epochs or 0)
    if start < MIN_IMAGE_SIZE:
        raise ValueError(f"progressive resize {spec!r}: FROM must be at least {MIN_IMAGE_SIZE} px")
    if m.group(2) and not 1 <= first <= last:
        raise ValueError(f"progressive resize {spec!r}: need 1 <= FIRST <= LAST")
    if m.group(2) and epochs is not None and last > epochs:
        raise ValueError(f"progressive resize {spec!r}: LAST ({last}) is past the last epoch ({epochs})")
    return start, first, last


def resize_side(spec: str, epoch: int, epochs: int, full: int) -> int:
    """Training crop side at `epoch` (0-based) of `epochs`, growing to `full`."""
    parsed = parse_resize(spec)
    if parsed is None:
        return full
    start, first, last = parsed
    t = ramp(epoch, first - 1, (last or epochs) - 1)
    if t <= 0.0:
        return start
    if t >= 1.0:
        return full
    side = RESIZE_STEP * round((start + (full - start) * t) / RESIZE_STEP)
    return min(max(side, start), full)
