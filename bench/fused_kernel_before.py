"""The fused kernel as it was before augment/fused_kernel.py became separable and tiled (2026-12-05),
kept for bench/kernel_loads.py to count its loads beside the new one's; not used by the product.
One program per image: for each output pixel the box's ky x kx antialiased taps, all of it twice
for an image that jitters contrast (a first pass for the mean). Column numbers of `meta` are
augment/fused.py FusedPlan's."""

from __future__ import annotations

import triton
import triton.language as tl

GRAY_R, GRAY_G, GRAY_B = 0.2989, 0.587, 0.114  # torchvision's rgb_to_grayscale (augment/ops.py _GRAY)
RINT = 12582912.0  # 1.5 * 2**23: x + RINT - RINT rounds a float32 |x| < 2**22 half to even


@triton.jit
def _axis(pos, scale, support, length):
    """Along one axis, for output positions `pos` of the resized image: the first tap's box
    coordinate, the window's end, and the filter's centre (torch's antialiased bilinear)."""
    center = scale * (pos.to(tl.float32) + 0.5)
    first = tl.maximum((center - support + 0.5).to(tl.int32), 0)  # C++'s cast truncates; then >= 0
    end = tl.minimum((center + support + 0.5).to(tl.int32), length)
    return first, end, center


@triton.jit
def _weight(j, end, center, support):
    w = tl.maximum(1.0 - tl.abs((j.to(tl.float32) - center + 0.5) / support), 0.0)
    return tl.where(j < end, w, 0.0)


@triton.jit
def _resample(src, rs, ps, cs, h, w, top, left, y0, ye, cy, sy, x0, xe, cx, sx, ky, kx, valid, fill):
    """The box's antialiased resample at each output pixel (taps y0.. and x0.., ky x kx of them),
    float32 in [0, 1] per channel; a source pixel outside the image is `fill` (0..255)."""
    r = tl.zeros(y0.shape, tl.float32)
    g = tl.zeros(y0.shape, tl.float32)
    b = tl.zeros(y0.shape, tl.float32)
    wy_sum = tl.zeros(y0.shape, tl.float32)
    wx_sum = tl.zeros(y0.shape, tl.float32)
    for u in range(0, kx):
        wx_sum += _weight(x0 + u, xe, cx, sx)
    for t in range(0, ky):
        jy = y0 + t
        wy = _weight(jy, ye, cy, sy)
        wy_sum += wy
        row = top + jy
        row_in = (row >= 0) & (row < h)
        rr = tl.zeros(y0.shape, tl.float32)
        rg = tl.zeros(y0.shape, tl.float32)
        rb = tl.zeros(y0.shape, tl.float32)
        for u in range(0, kx):
            jx = x0 + u
            wx = _weight(jx, xe, cx, sx)
            col = left + jx
            inside = valid & row_in & (col >= 0) & (col < w) & (wy * wx > 0)
            p = src + row.to(tl.int64) * rs + col.to(tl.int64) * ps
            pr = tl.load(p, mask=inside, other=0).to(tl.float32)
            pg = tl.load(p + cs, mask=inside, other=0).to(tl.float32)
            pb = tl.load(p + 2 * cs, mask=inside, other=0).to(tl.float32)
            outside = (~row_in) | (col < 0) | (col >= w)
            rr += wx * tl.where(outside, fill, pr)
            rg += wx * tl.where(outside, fill, pg)
            rb += wx * tl.where(outside, fill, pb)
        r += wy * rr
        g += wy * rg
        b += wy * rb
    norm = wy_sum * wx_sum * 255.0
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
def augment_kernel(meta_ptr, factors_ptr, out_ptr, fill, OH, OW, FLOAT_OUT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
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
    sy = bh.to(tl.float32) / rh
    sx = bw.to(tl.float32) / rw
    supy, supx = tl.maximum(sy, 1.0), tl.maximum(sx, 1.0)
    # taps an output position may have along each axis (more weigh nothing): 2 x support + 2
    ky, kx = (2.0 * supy).to(tl.int32) + 2, (2.0 * supx).to(tl.int32) + 2
    n = OH * OW
    # contrast's mean grey level, over the image as it stands before the contrast step
    mean = 0.0
    if fc != 1.0:
        before = tl.where(o0 == 1, 0, tl.where(o1 == 1, 1, 2))  # how many steps come first
        acc = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, n, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            valid = idx < n
            oy, ox = idx // OW, idx % OW
            y0, ye, cy = _axis(oy0 + oy, sy, supy, bh)
            x0, xe, cx = _axis(ox0 + ox, sx, supx, bw)
            r, g, b = _resample(
                src, rs, ps, cs, h, w, top, left, y0, ye, cy, supy, x0, xe, cx, supx, ky, kx, valid, fill
            )
            r, g, b = _blend(r, g, b, o0, fb, fc, fs, 0.0, before > 0)
            r, g, b = _blend(r, g, b, o1, fb, fc, fs, 0.0, before > 1)
            acc += tl.where(valid, r * 0.2989 + g * 0.587 + b * 0.114, 0.0)
        mean = tl.sum(acc, axis=0) / n
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        valid = idx < n
        oy, ox = idx // OW, idx % OW
        sx_col = tl.where(flip, OW - 1 - ox, ox)  # the flip: the mirrored column's pixel
        y0, ye, cy = _axis(oy0 + oy, sy, supy, bh)
        x0, xe, cx = _axis(ox0 + sx_col, sx, supx, bw)
        r, g, b = _resample(src, rs, ps, cs, h, w, top, left, y0, ye, cy, supy, x0, xe, cx, supx, ky, kx, valid, fill)
        r, g, b = _blend(r, g, b, o0, fb, fc, fs, mean, True)
        r, g, b = _blend(r, g, b, o1, fb, fc, fs, mean, True)
        r, g, b = _blend(r, g, b, o2, fb, fc, fs, mean, True)
        base = (i.to(tl.int64) * n + idx) * 3
        if FLOAT_OUT:
            tl.store(out_ptr + base, r, mask=valid)
            tl.store(out_ptr + base + 1, g, mask=valid)
            tl.store(out_ptr + base + 2, b, mask=valid)
        else:
            tl.store(out_ptr + base, _to_uint8(r), mask=valid)
            tl.store(out_ptr + base + 1, _to_uint8(g), mask=valid)
            tl.store(out_ptr + base + 2, _to_uint8(b), mask=valid)


@triton.jit
def _to_uint8(x):
    v = x * 255.0
    v = (v + 12582912.0) - 12582912.0  # RINT: half to even, as torch.round
    return tl.minimum(tl.maximum(v, 0.0), 255.0).to(tl.uint8)


def launch(meta, factors, out, fill: float, out_h: int, out_w: int, float_out: bool) -> None:
    # Triton's interpreter (TRITON_INTERPRET=1, the CPU) pays per operation, not per element: one
    # block for a whole small image there
    block = min(4096, triton.next_power_of_2(out_h * out_w)) if meta.device.type == "cpu" else 256
    augment_kernel[(meta.shape[0],)](meta, factors, out, fill, out_h, out_w, FLOAT_OUT=float_out, BLOCK=block)
