"""The CPU path's per-pixel loops, compiled by numba: one pass over an image does all the
arithmetic of a step, where torch's eager ops make a pass over the batch per arithmetic
operation and allocate a buffer for most of them (docs/design.md, "Choices and where they
were measured").

* `color_jitter_(x, factors, order)`: torchvision's brightness, contrast and saturation
  blends in each image's own order, in place: one pass over an image per step, and one that
  sums its grey levels before a contrast step.
* `to_uint8_nhwc(x, out)`: float planar (B, 3, H, W) in [0, 1] -> uint8 (B, H, W, 3), rounded
  half to even as torch.round is, written straight into `out` (a slice of the batch).

They take what `takes(x)` accepts: float32 planar (contiguous) batches on the CPU, which is
what the CPU path makes, and return None for any other batch (a caller asks once); the GPU
(and the GPU's path run on a CPU, channels_last) keeps the batched torch ops. The torch ops'
float32 formulas (where torch fuses a multiply-add, the last bit may differ), the contrast
mean summed in float64; tests/test_cpu_kernels.py holds them to the torch ops and to
torchvision. numba compiles them on first use in a process and caches the machine code
beside this file (or in its user cache where that is read-only). augment/ops.py
(`compiled_loops`) imports this module only when a CPU batch first reaches an op that uses
it, and where numba is missing runs the torch ops instead.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

GRAY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights (ITU-R 601-2)
BRIGHTNESS, CONTRAST, SATURATION = 0, 1, 2  # ColorJitter's factor columns and order codes

_W0, _W1, _W2 = (np.float32(v) for v in GRAY)
_jit = numba.njit(cache=True, nogil=True, boundscheck=False)


def takes(x: torch.Tensor) -> bool:
    """Whether the kernels take x: a float32 planar (B, 3, H, W) batch on the CPU, no autograd."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 4
        and x.shape[1] == 3
        and x.is_contiguous()
        and not x.requires_grad
    )


@numba.njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})  # reassoc: a vectorised sum
def _gray_sum(r, g, b):
    s = 0.0
    for i in range(r.shape[0]):
        s += np.float64(_W0 * r[i] + _W1 * g[i] + _W2 * b[i])
    return s


# Each loop reads and writes one array: one that reads an array and writes another that may be
# the same memory fails LLVM's alias check at run time and runs unvectorised.
@_jit
def _blend_const(x, f, c):
    """x = clamp(f * x + c, 0, 1): brightness (c = 0) and contrast (c = (1 - f) * mean grey)."""
    one, zero = np.float32(1.0), np.float32(0.0)
    for ch in range(3):
        a = x[ch]
        for i in range(a.shape[0]):
            a[i] = min(max(f * a[i] + c, zero), one)


@_jit
def _blend_gray(x, f):
    """x = clamp(f * x + (1 - f) * grey, 0, 1): saturation."""
    one, zero, g = np.float32(1.0), np.float32(0.0), np.float32(1.0) - f
    r, gr, b = x[0], x[1], x[2]
    for i in range(r.shape[0]):
        c = g * (_W0 * r[i] + _W1 * gr[i] + _W2 * b[i])
        r[i] = min(max(f * r[i] + c, zero), one)
        gr[i] = min(max(f * gr[i] + c, zero), one)
        b[i] = min(max(f * b[i] + c, zero), one)


@_jit
def _color_jitter(x, factors, order):
    n = x.shape[2]
    for k in range(x.shape[0]):
        img = x[k]
        for step in range(order.shape[1]):
            kind = order[k, step]
            f = factors[k, kind]
            if kind == SATURATION:
                _blend_gray(img, f)
            elif kind == CONTRAST:
                mean = np.float32(_gray_sum(img[0], img[1], img[2]) / n)
                _blend_const(img, f, (np.float32(1.0) - f) * mean)
            else:
                _blend_const(img, f, np.float32(0.0))


@_jit
def _to_uint8_nhwc(x, out):
    # v + 1.5 * 2**23 - 1.5 * 2**23 rounds a float32 in [0, 2**22) to the nearest integer, ties
    # to even, as torch.round does, and vectorises (np.rint is a call per pixel). `out` is
    # (B, H * W * 3): indexed flat, the interleaved stores vectorise too
    lo, hi, scale, magic = np.float32(0.0), np.float32(255.0), np.float32(255.0), np.float32(12582912.0)
    for k in range(x.shape[0]):
        img, dst = x[k], out[k]
        for i in range(img.shape[1]):
            for c in range(3):
                dst[3 * i + c] = np.uint8(np.int32(min(max(img[c, i] * scale, lo), hi) + magic - magic))


def _flat(x: torch.Tensor) -> np.ndarray:
    b, c, h, w = x.shape
    return x.view(b, c, h * w).numpy()


def color_jitter_(x: torch.Tensor, factors: torch.Tensor, order: torch.Tensor) -> torch.Tensor | None:
    """x in place: image b's adjustments order[b, step] (BRIGHTNESS, CONTRAST, SATURATION), each
    with factors[b, that adjustment], one after the other. Returns x; None where not takes(x)."""
    if not takes(x):
        return None
    _color_jitter(_flat(x), factors.to(torch.float32).contiguous().numpy(), order.to(torch.int64).contiguous().numpy())
    return x


def to_uint8_nhwc(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x -> uint8 (B, H, W, 3): round(x * 255) clamped to 0..255, into `out` (a contiguous uint8
    (B, H, W, 3), e.g. the batch's rows for this chunk) or a new tensor; None where not takes(x)."""
    if not takes(x):
        return None
    b, c, h, w = x.shape
    if out is None:
        out = torch.empty((b, h, w, c), dtype=torch.uint8)
    _to_uint8_nhwc(_flat(x), out.view(b, h * w * c).numpy())
    return out
