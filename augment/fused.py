"""The GPU's first geometry op and the pixel ops after it in one pass over each image: crop box,
antialiased resize, horizontal flip, brightness / contrast / saturation, rounding to uint8, for a
whole ragged batch in two kernel launches, each image read where its decoder left it.

    n = fused_prefix(ops)                              # how many leading ops the kernel covers
    plan = FusedPlan.of(ops[:n], draws.first, draws.rest[: n - 1], images)
    out = augment_first_ops(images, plan.meta, plan.factors, out_h, out_w, fill, float_out)

The ragged path before it (augment/ragged.py, then each op on the float batch) makes a dozen
passes over the batch and keeps float intermediates of it (docs/design.md, "The GPU's pixels in
one pass"); this kernel reads each decoded crop once (the tiles' row spans overlap by a filter's
width) and writes the uint8 output once.

Per output tile of each image (a grid of (tile, image): a large crop is spread over as many
programs as a small one): torch's antialiased bilinear taps (the triangle filter widened by the
scale when shrinking, align_corners=False: the weights of augment/ops.py `aa_weights`) as two
passes, a horizontal one over the rows of the tile's vertical span, held on chip, then a vertical
one; the box read through the image's own strides (HWC or CHW, any layout its decoder gave),
pixels outside the image taking `fill` (a crop's padding), the flip as a mirrored output column,
then torchvision's colour jitter in the image's own order of its three steps, each a clamped
blend f*x + (1-f)*m (m: 0, the mean grey level, the pixel's grey), and the round half to even of
`x * 255`. Contrast's mean grey level is over the whole output image as it stands at that step:
for an image that jitters contrast the tiles take the steps before it, sum their grey levels and
leave their pixels in a float32 scratch (the output itself when that is float32), and a second
launch takes the mean from the sums and the steps from contrast on (augment/fused_kernel.py).
Hue is not covered: a preset with hue keeps the torch path.

The launch is a torch custom op (`rga::augment_first_ops`): a dispatch mode sees it with the
tensors it reads and writes (bench/gpu_path.py counts its bytes). Without Triton (or off a GPU
without TRITON_INTERPRET=1) `available()` is False and the pipeline keeps the torch path. Under
TRITON_INTERPRET=1 the same kernel runs on the CPU with numpy: the tests run it that way
(tests/conftest.py sets the variable where there is no GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import torch

META = 20  # int64 columns a program reads about its image (FusedPlan.meta)


@functools.cache
def triton_found() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(device) -> bool:
    """Whether the kernel runs for `device`: Triton is importable, and the device is a GPU or
    Triton's interpreter is on (TRITON_INTERPRET=1, which runs it on the CPU)."""
    device = torch.device(device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return triton_found() and (device.type == "cuda" or (device.type == "cpu" and interpreted))


def fused_prefix(ops) -> int:
    """How many of `ops` (an epoch pipeline's) the kernel covers (covered)."""
    return covered([(getattr(op, "name", None), getattr(op, "hue", 0.0)) for op in ops])


def covered(ops: list[tuple]) -> int:
    """How many leading ops, each (name, hue), the kernel covers: the first where it is one of
    FIRST_OPS (a resample or a crop), then the horizontal flip and colour jitter (without hue)
    that follow it, one of each at most, in any order; 0 where the first op is another."""
    if ops[0][0] not in FIRST_OPS:
        return 0
    n, seen = 1, set()
    for name, hue in ops[1:]:
        if name not in ("horizontal_flip", "color_jitter") or name in seen or (name == "color_jitter" and hue > 0):
            break
        seen.add(name)
        n += 1
    return n


def plan_line(specs) -> str:
    """What the plan line says of a GPU's ops after decoding, from the train ops' specs: the ops the
    kernel covers, or why the torch path runs (Triton missing, a first op it does not take)."""
    names = [next(iter(spec)) for spec in specs]
    if not triton_found():
        return "the ops as torch operations (Triton is not installed)"
    n = covered([(name, float(params.get("hue", 0.0))) for spec in specs for name, params in spec.items()])
    if not n:
        return f"the ops as torch operations (the kernel does not take {names[0]})"
    rest = f", then {', '.join(names[n:])} as torch operations" if names[n:] else ""
    return f"{', '.join(names[:n])} in one Triton kernel{rest}"


# the geometry ops the kernel takes, and how each one's draws become a box, a resized size and an
# offset into it: a crop is a box of the output's size at scale 1 (taps copy the pixels exactly)
FIRST_OPS = ("random_resized_crop", "resize_center_crop", "random_crop", "center_crop")


def geometry(op, params: dict, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(box (B, 4) top, left, h, w; resized (B, 2); offset (B, 2)) of one of FIRST_OPS' draws."""
    if op.name in ("random_resized_crop", "resize_center_crop"):
        return params["box"], params["resized"], params["offset"]
    out = torch.tensor(op.size, device=sizes.device).expand(len(sizes), 2)
    box = torch.stack([params["top"], params["left"], out[:, 0], out[:, 1]], 1)  # random_crop, center_crop
    return box, out, torch.zeros_like(out)


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    """What the kernel reads about each image: `meta` int64 (B, META) (filled in by the op from
    the images' addresses and strides, and here: the geometry, the flip, the jitter's order and
    each axis's number of taps) and `factors` float32 (B, 3): brightness, contrast, saturation
    (1 where an image does not jitter)."""

    meta: torch.Tensor
    factors: torch.Tensor
    fill: float  # what a crop's padding reads, in [0, 1]

    @classmethod
    def of(cls, ops, first: dict, rest, sizes: torch.Tensor) -> "FusedPlan":
        """From the fused ops (fused_prefix's), their draws (the first op's, then each later one's)
        and the images' (h, w) as decoded."""
        box, resized, offset = geometry(ops[0], first, sizes)
        n = len(sizes)
        zeros = sizes.new_zeros((n, 4))
        flip, factors, order = zeros[:, :1], None, zeros[:, :3]  # no flip; no jitter (order unused then)
        for op, params in zip(ops[1:], rest, strict=True):
            if op.name == "horizontal_flip":
                flip = params["flip"][:, None]
            else:
                factors = op.factors_or_identity(params)[:, :3]
                order = params["order"][:, :3]
        factors = sizes.new_ones((n, 3), dtype=torch.float32) if factors is None else factors
        # columns 0-3 (the image's address and strides) are the op's to fill, 15-16 unused
        columns = [zeros, sizes, box, resized, offset, flip, zeros[:, :2], order]
        meta = torch.cat([c.long() for c in columns], 1)
        return cls(meta, factors.float().contiguous(), getattr(ops[0], "fill", 0.0))


def image_meta(images: list[torch.Tensor]) -> torch.Tensor:
    """int64 (B, 4): each (H, W, 3)-shaped image's address and its row, pixel and channel strides."""
    rows = [[im.data_ptr(), *im.stride()] for im in images]
    return torch.tensor(rows, dtype=torch.int64).to(images[0].device, non_blocking=True)


@torch.library.custom_op("rga::augment_first_ops", mutates_args=())
def augment_first_ops(
    images: list[torch.Tensor],
    meta: torch.Tensor,
    factors: torch.Tensor,
    out_h: int,
    out_w: int,
    fill: float,
    float_out: bool,
) -> torch.Tensor:
    """The kernel over `images` ((H, W, 3)-shaped uint8 views, any strides, on one device): uint8
    (B, out_h, out_w, 3), or with `float_out` float32 (B, 3, out_h, out_w) channels_last in
    [0, 1] for ops the kernel does not cover to take on. `meta`, `factors`: FusedPlan's."""
    from augment import fused_kernel

    meta = torch.cat([image_meta(images), meta[:, 4:]], 1).contiguous()
    out = torch.empty((len(images), out_h, out_w, 3), dtype=torch.float32 if float_out else torch.uint8,
                      device=meta.device)  # fmt: skip
    if len(images):
        fused_kernel.launch(meta, factors, out, round(fill * 255), out_h, out_w, float_out)
    return out.permute(0, 3, 1, 2) if float_out else out


def on_device(images, device) -> list[torch.Tensor]:
    """The images as (H, W, 3)-shaped uint8 tensors on `device`: those there already as they
    are (any strides), the others packed into one host buffer and uploaded in one copy (a
    (B, H, W, 3) array whole), each then a view of it."""
    device = torch.device(device)
    if isinstance(images, np.ndarray) and images.ndim == 4:
        return list(torch.from_numpy(np.ascontiguousarray(images)).to(device))
    out = [im if isinstance(im, torch.Tensor) and im.device == device else None for im in images]
    host = [i for i, im in enumerate(out) if im is None]
    if host:
        arrays = [np.ascontiguousarray(images[i]) for i in host]
        flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))
        flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat
        start = 0
        for i, a in zip(host, arrays, strict=True):
            out[i] = flat[start : start + a.size].view(a.shape)
            start += a.size
    return out
