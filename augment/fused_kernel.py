"""The Triton kernels of augment/fused.py (imported only where they run: Triton's import costs every
process that merely augments on a CPU). The module docstring of augment/fused.py says what they
compute; column numbers of `meta` are FusedPlan's.

Two launches over a grid of (output tile, image), for `chunk` images at a time (launch_shape):

* `tile_kernel`: the tile's separable resample. For each run of RB source rows of the tile's
  vertical span, a horizontal pass (each output column's taps, `kx` of them) gives an (RB, TW)
  block per channel held in registers, and the vertical pass folds it into the tile at once,
  (TH, RB) weights @ (RB, TW) in float32 (the flip: each output column takes its mirror's taps).
  Then the jitter: all of it for an image
  that does not jitter contrast (the tile is final), only the steps before contrast for one that
  does (the tile goes to `scratch`, its grey level's sum to `partial`). For a uint8 output a
  scratch pixel is packed in 32 bits (_pack: 11, 11 and 10 bits of fixed point, within 1/8 of a
  level; 4 bytes where float32 took 12) where the image's factors allow it (packable), else
  float32; for a float32 output the output itself is the scratch.
* `contrast_kernel`: for an image that jitters contrast, the mean grey level from its tiles' sums,
  then contrast and the steps after it on the scratch's pixels, into the output.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

GRAY_R, GRAY_G, GRAY_B = 0.2989, 0.587, 0.114  # torchvision's rgb_to_grayscale (augment/ops.py _GRAY)
RINT = 12582912.0  # 1.5 * 2**23: x + RINT - RINT rounds a float32 |x| < 2**22 half to even
ROWS = 32  # source rows a horizontal pass takes at once (RB)
# The largest factor by which the jitter's steps from contrast on may scale an error in the pixels
# before contrast for an image's scratch to be packed: a packed pixel is within 1/8 of a level,
# so the output stays within 6/8 of a level of the float32 path's (packable).
PACK_GAIN = 6.0


def interpreter_loop_bounds_fixed() -> bool:
    """Triton's interpreter before 3.8 reads a loop bound held in a tensor as int(array), which
    NumPy 2.4 and later refuse for the interpreter's scalars, arrays of shape (1,) ("only
    0-dimensional arrays can be converted to Python scalars"): every loop of these kernels has
    such a bound. Under TRITON_INTERPRET=1 with such a Triton, the interpreter's tensors get 3.8's
    reading (the array squeezed first). Whether it was needed."""
    if os.environ.get("TRITON_INTERPRET") != "1" or tuple(map(int, triton.__version__.split(".")[:2])) >= (3, 8):
        return False
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "squeezes", False):
        return True

    def squeezing(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    squeezing.squeezes = True
    interpreter._patch_lang_tensor = squeezing
    return True


interpreter_loop_bounds_fixed()


@triton.jit
def _axis(pos, scale, support, length):
    """Along one axis, for output positions `pos` of the resized image: the first tap's box
    coordinate, the window's end, and the filter's centre (torch's antialiased bilinear)."""
    center = scale * (pos.to(tl.float32) + 0.5)
    first = tl.maximum((center - support + 0.5).to(tl.int32), 0)  # C++'s cast truncates; then >= 0
    end = tl.minimum((center + support + 0.5).to(tl.int32), length)
    return first, end, center


@triton.jit
def _weight(j, first, end, center, support):
    """The triangle filter's weight of box coordinate `j` in the window [first, end)."""
    w = tl.maximum(1.0 - tl.abs((j.to(tl.float32) - center + 0.5) / support), 0.0)
    return tl.where((j >= first) & (j < end), w, 0.0)


@triton.jit
def _weight_sum(first, end, center, support, k):
    total = tl.zeros(first.shape, tl.float32)
    for t in range(0, k):
        total += _weight(first + t, first, end, center, support)
    return total


@triton.jit
def _rows(src, rs, ps, cs, h, w, top, left, j, row_end, x0, xe, cx, supx, kx, fill, cols_ok):
    """Horizontal pass: box rows `j` (RB,) at the output columns' taps (TW,): (RB, TW) per channel,
    unnormalised; a source pixel outside the image is `fill` (0..255). A lane whose tap weighs
    nothing, whose row is past the span (no output row weighs it) or whose column is past the
    output's (a last tile's) reads nothing."""
    row = top + j
    rows_ok = ((row >= 0) & (row < h) & (j < row_end))[:, None]
    rows_at = src + row.to(tl.int64)[:, None] * rs
    hr = tl.zeros((j.shape[0], x0.shape[0]), tl.float32)
    hg = tl.zeros((j.shape[0], x0.shape[0]), tl.float32)
    hb = tl.zeros((j.shape[0], x0.shape[0]), tl.float32)
    for u in range(0, kx):
        jx = x0 + u
        wx = tl.where(jx < xe, tl.maximum(1.0 - tl.abs((jx.to(tl.float32) - cx + 0.5) / supx), 0.0), 0.0)
        col = left + jx
        inside = rows_ok & (cols_ok & (col >= 0) & (col < w) & (wx > 0))[None, :]
        p = rows_at + (col.to(tl.int64) * ps)[None, :]
        wx = wx[None, :]
        hr += wx * tl.load(p, mask=inside, other=fill).to(tl.float32)
        hg += wx * tl.load(p + cs, mask=inside, other=fill).to(tl.float32)
        hb += wx * tl.load(p + 2 * cs, mask=inside, other=fill).to(tl.float32)
    return hr, hg, hb


@triton.jit
def _resample(src, rs, ps, cs, h, w, top, left, bh, bw, sy, sx, ry, rx, rows, cols_ok, fill, RB: tl.constexpr):
    """The box's antialiased resample at output rows `ry` (TH,), ascending from the first to the
    last of `rows` (two scalars), and columns `rx` (TW,) of the resized image (`cols_ok`: those of
    the output): float32 (TH, TW) per channel in [0, 1]."""
    supy, supx = tl.maximum(sy, 1.0), tl.maximum(sx, 1.0)
    # taps an output position may have along each axis (more weigh nothing): 2 x support + 2
    ky, kx = (2.0 * supy).to(tl.int32) + 2, (2.0 * supx).to(tl.int32) + 2
    y0, ye, cy = _axis(ry, sy, supy, bh)
    x0, xe, cx = _axis(rx, sx, supx, bw)
    r = tl.zeros((ry.shape[0], rx.shape[0]), tl.float32)
    g = tl.zeros((ry.shape[0], rx.shape[0]), tl.float32)
    b = tl.zeros((ry.shape[0], rx.shape[0]), tl.float32)
    # the tile's vertical span, from its first row's window to its last's (a row's window moves
    # down with it): scalars, as Triton 3.6's interpreter takes no reduction's result as a loop bound
    row_first, _, _ = _axis(rows[0], sy, supy, bh)
    _, row_end, _ = _axis(rows[1], sy, supy, bh)
    for start in range(row_first, row_end, RB):
        j = start + tl.arange(0, RB)
        hr, hg, hb = _rows(src, rs, ps, cs, h, w, top, left, j, row_end, x0, xe, cx, supx, kx, fill, cols_ok)
        wy = _weight(j[None, :], y0[:, None], ye[:, None], cy[:, None], supy)  # (TH, RB)
        r += tl.dot(wy, hr, input_precision="ieee")
        g += tl.dot(wy, hg, input_precision="ieee")
        b += tl.dot(wy, hb, input_precision="ieee")
    norm = _weight_sum(y0, ye, cy, supy, ky)[:, None] * _weight_sum(x0, xe, cx, supx, kx)[None, :] * 255.0
    norm = tl.where(norm > 0, norm, 1.0)
    r = tl.minimum(tl.maximum(r / norm, 0.0), 1.0)
    g = tl.minimum(tl.maximum(g / norm, 0.0), 1.0)
    b = tl.minimum(tl.maximum(b / norm, 0.0), 1.0)
    return r, g, b


@triton.jit
def _blend(r, g, b, op, fb, fc, fs, mean, active):
    """One jitter step (op 0 brightness, 1 contrast, 2 saturation): x = clamp(f x + (1 - f) m)."""
    f = tl.where(op == 0, fb, tl.where(op == 1, fc, fs))
    f = tl.where(active, f, 1.0)
    gray = r * 0.2989 + g * 0.587 + b * 0.114
    m = tl.where(op == 1, mean, tl.where(op == 2, gray, 0.0)) * (1.0 - f)
    r = tl.minimum(tl.maximum(r * f + m, 0.0), 1.0)
    g = tl.minimum(tl.maximum(g * f + m, 0.0), 1.0)
    b = tl.minimum(tl.maximum(b * f + m, 0.0), 1.0)
    return r, g, b


@triton.jit
def _to_uint8(x):
    v = x * 255.0
    v = (v + 12582912.0) - 12582912.0  # RINT: half to even, as torch.round
    return tl.minimum(tl.maximum(v, 0.0), 255.0).to(tl.uint8)


@triton.jit
def _store(ptr, base, r, g, b, valid, FLOAT_OUT: tl.constexpr):
    if FLOAT_OUT:
        tl.store(ptr + base, r, mask=valid)
        tl.store(ptr + base + 1, g, mask=valid)
        tl.store(ptr + base + 2, b, mask=valid)
    else:
        tl.store(ptr + base, _to_uint8(r), mask=valid)
        tl.store(ptr + base + 1, _to_uint8(g), mask=valid)
        tl.store(ptr + base + 2, _to_uint8(b), mask=valid)


@triton.jit
def _pack(r, g, b):
    """r, g, b in [0, 1] as one int32: 11, 11 and 10 bits of fixed point, rounded (b's error the
    largest: 1 / 2046, an eighth of a uint8 level)."""
    qr = (r * 2047.0 + 0.5).to(tl.uint32)
    qg = (g * 2047.0 + 0.5).to(tl.uint32)
    qb = (b * 1023.0 + 0.5).to(tl.uint32)
    return (qr | (qg << 11) | (qb << 22)).to(tl.int32, bitcast=True)


@triton.jit
def _load3(ptr, base, valid):
    return (
        tl.load(ptr + base, mask=valid, other=0.0),
        tl.load(ptr + base + 1, mask=valid, other=0.0),
        tl.load(ptr + base + 2, mask=valid, other=0.0),
    )


@triton.jit
def _unpack(p):
    p = p.to(tl.uint32, bitcast=True)
    r = (p & 2047).to(tl.float32) / 2047.0
    g = ((p >> 11) & 2047).to(tl.float32) / 2047.0
    b = (p >> 22).to(tl.float32) / 1023.0
    return r, g, b


@triton.jit
def _packable(fb, fc, fs, pack_gain):
    return fc * (fs + tl.abs(1.0 - fs)) * fb <= pack_gain


def packable(factors):
    """Per image (`factors` (B, 3): brightness, contrast, saturation), whether the kernel packs its
    scratch: the steps from contrast on scale an error at most by contrast x (saturation +
    |1 - saturation|) x brightness (saturation mixes in the grey level), whatever their order;
    at most PACK_GAIN. The `imagenet` preset's jitter (0.4 each) reaches 3.5."""
    b, c, s = factors.float().unbind(1)
    return c * (s + (1 - s).abs()) * b <= PACK_GAIN


@triton.jit
def _tile(t, OH, OW, TH: tl.constexpr, TW: tl.constexpr):
    """Tile t's output rows and columns, clamped into the image, which of its pixels are in it, and
    its first and last row (scalars)."""
    tiles_x = tl.cdiv(OW, TW)
    first = (t // tiles_x) * TH
    oy = first + tl.arange(0, TH)
    ox = (t % tiles_x) * TW + tl.arange(0, TW)
    valid = (oy < OH)[:, None] & (ox < OW)[None, :]
    return tl.minimum(oy, OH - 1), tl.minimum(ox, OW - 1), valid, ox < OW, (first, tl.minimum(first + TH - 1, OH - 1))


@triton.jit
def tile_kernel(
    meta_ptr, factors_ptr, out_ptr, scratch_ptr, partial_ptr, fill, pack_gain, OH, OW, TILES,
    FLOAT_OUT: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr, RB: tl.constexpr,
):  # fmt: skip
    t, i = tl.program_id(0), tl.program_id(1)
    m = meta_ptr + i * 20
    src = tl.load(m).to(tl.pointer_type(tl.uint8))
    rs, ps, cs = tl.load(m + 1), tl.load(m + 2), tl.load(m + 3)
    h, w = tl.load(m + 4).to(tl.int32), tl.load(m + 5).to(tl.int32)
    top, left = tl.load(m + 6).to(tl.int32), tl.load(m + 7).to(tl.int32)
    bh, bw = tl.load(m + 8).to(tl.int32), tl.load(m + 9).to(tl.int32)
    rh, rw = tl.load(m + 10).to(tl.float32), tl.load(m + 11).to(tl.float32)
    oy0, ox0 = tl.load(m + 12).to(tl.int32), tl.load(m + 13).to(tl.int32)
    flip = tl.load(m + 14) != 0
    o0, o1, o2 = tl.load(m + 17), tl.load(m + 18), tl.load(m + 19)
    fb, fc, fs = tl.load(factors_ptr + i * 3), tl.load(factors_ptr + i * 3 + 1), tl.load(factors_ptr + i * 3 + 2)
    oy, ox, valid, cols_ok, rows = _tile(t, OH, OW, TH, TW)
    col = tl.where(flip, OW - 1 - ox, ox)  # the flip: the mirrored column's pixel
    sy, sx = bh.to(tl.float32) / rh, bw.to(tl.float32) / rw
    rows = (oy0 + rows[0], oy0 + rows[1])
    r, g, b = _resample(src, rs, ps, cs, h, w, top, left, bh, bw, sy, sx, oy0 + oy, ox0 + col, rows, cols_ok, fill, RB)
    pix = (i.to(tl.int64) * OH + oy[:, None]) * OW + ox[None, :]
    base = pix * 3
    if fc != 1.0:
        # contrast's mean grey level is the whole image's as it stands before the contrast step:
        # the steps before it here, the rest in contrast_kernel once every tile has its sum
        before = tl.where(o0 == 1, 0, tl.where(o1 == 1, 1, 2))  # how many steps come first
        r, g, b = _blend(r, g, b, o0, fb, fc, fs, 0.0, before > 0)
        r, g, b = _blend(r, g, b, o1, fb, fc, fs, 0.0, before > 1)
        grey = tl.where(valid, r * 0.2989 + g * 0.587 + b * 0.114, 0.0)
        tl.store(partial_ptr + i * TILES + t, tl.sum(tl.sum(grey, axis=1), axis=0))
        if FLOAT_OUT:
            _store(scratch_ptr, base, r, g, b, valid, True)
        elif _packable(fb, fc, fs, pack_gain):
            tl.store(scratch_ptr.to(tl.pointer_type(tl.int32)) + pix, _pack(r, g, b), mask=valid)
        else:
            _store(scratch_ptr, base, r, g, b, valid, True)
    else:
        r, g, b = _blend(r, g, b, o0, fb, fc, fs, 0.0, True)  # contrast, at factor 1, is the identity
        r, g, b = _blend(r, g, b, o1, fb, fc, fs, 0.0, True)
        r, g, b = _blend(r, g, b, o2, fb, fc, fs, 0.0, True)
        _store(out_ptr, base, r, g, b, valid, FLOAT_OUT)


@triton.jit
def contrast_kernel(
    factors_ptr, meta_ptr, out_ptr, scratch_ptr, partial_ptr, pack_gain, OH, OW, TILES,
    FLOAT_OUT: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr, TILES_P2: tl.constexpr,
):  # fmt: skip
    t, i = tl.program_id(0), tl.program_id(1)
    fb, fc, fs = tl.load(factors_ptr + i * 3), tl.load(factors_ptr + i * 3 + 1), tl.load(factors_ptr + i * 3 + 2)
    if fc != 1.0:
        m = meta_ptr + i * 20
        o0, o1, o2 = tl.load(m + 17), tl.load(m + 18), tl.load(m + 19)
        packed = _packable(fb, fc, fs, pack_gain)
        k = tl.arange(0, TILES_P2)
        mean = tl.sum(tl.load(partial_ptr + i * TILES + k, mask=k < TILES, other=0.0), axis=0) / (OH * OW)
        oy, ox, valid, _, _ = _tile(t, OH, OW, TH, TW)
        pix = (i.to(tl.int64) * OH + oy[:, None]) * OW + ox[None, :]
        base = pix * 3
        if FLOAT_OUT:
            r, g, b = _load3(scratch_ptr, base, valid)
        elif packed:
            r, g, b = _unpack(tl.load(scratch_ptr.to(tl.pointer_type(tl.int32)) + pix, mask=valid, other=0))
        else:
            r, g, b = _load3(scratch_ptr, base, valid)
        before = tl.where(o0 == 1, 0, tl.where(o1 == 1, 1, 2))
        r, g, b = _blend(r, g, b, o0, fb, fc, fs, mean, before <= 0)
        r, g, b = _blend(r, g, b, o1, fb, fc, fs, mean, before <= 1)
        r, g, b = _blend(r, g, b, o2, fb, fc, fs, mean, True)
        _store(out_ptr, base, r, g, b, valid, FLOAT_OUT)


def scratch_bytes(factors, out_h: int, out_w: int, float_out: bool) -> int:
    """The bytes the two launches write to the scratch and read back (beyond the op's inputs and
    output) for `factors` (FusedPlan's): an image that jitters contrast, a pixel's 4 bytes packed
    or 12 in float32 (a float32 output: written twice and read once), each twice."""
    contrast = factors[:, 1] != 1.0
    packed = packable(factors) & contrast & (not float_out)
    pixels = 2 * out_h * out_w
    return int(packed.sum()) * pixels * 4 + int((contrast & ~packed).sum()) * pixels * 12


def launch_shape(device_type: str) -> tuple[tuple[int, int], int]:
    """((TH, TW) output pixels a program computes, images a pair of launches takes). On a GPU
    32 x 32 tiles: many programs a batch, and a source row span that the taps of 32 output rows
    share; and 32 images at a time, whose scratch (6.4 MB at 224 px packed, 19 MB in float32;
    reused by the next 32) fits in a Hopper GPU's L2 between the two launches. Triton's interpreter (the CPU) pays per
    operation, not per element: 64 x 64 tiles and the whole batch there."""
    return ((64, 64), 1 << 30) if device_type == "cpu" else ((32, 32), 32)


def launch(meta, factors, out, fill: float, out_h: int, out_w: int, float_out: bool, tile=None, chunk=None) -> None:
    """Both kernels over `out` ((B, out_h, out_w, 3), uint8 or float32), `chunk` images at a time;
    `tile` (TH, TW) powers of two >= 16. Both launch_shape's by default. The scratch is the output
    itself when that is float32."""
    import torch

    (th, tw), images = launch_shape(meta.device.type)
    th, tw = tile or (th, tw)
    chunk = min(chunk or images, len(meta))
    tiles = triton.cdiv(out_h, th) * triton.cdiv(out_w, tw)
    shape = (chunk, out_h, out_w, 3)
    scratch = None if float_out else torch.empty(shape, dtype=torch.float32, device=out.device)  # packed: a third
    partial = torch.empty((chunk, tiles), dtype=torch.float32, device=out.device)
    for start in range(0, len(meta), chunk):
        m, f, o = meta[start : start + chunk], factors[start : start + chunk], out[start : start + chunk]
        grid = (tiles, len(m))
        s = o if float_out else scratch
        gain = PACK_GAIN
        tile_kernel[grid](
            m, f, o, s, partial, fill, gain, out_h, out_w, tiles, FLOAT_OUT=float_out, TH=th, TW=tw, RB=ROWS
        )
        contrast_kernel[grid](
            f, m, o, s, partial, gain, out_h, out_w, tiles,
            FLOAT_OUT=float_out, TH=th, TW=tw, TILES_P2=triton.next_power_of_2(tiles),
        )  # fmt: skip
