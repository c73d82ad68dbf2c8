"""A batch of images of different sizes in one flat buffer, and the geometry ops' two
resamplers over it: each image's crop box goes straight to the (B, S, S) output, with no
canvas padded to the batch's largest photo and no kernel launched per image.

    batch = RaggedImages.from_images(images, device)   # one copy of the pixels, one upload
    x = resample(batch, box, resized, offset, (S, S))   # antialiased crop + resize
    x = crop(batch, top, left, (S, S), fill)            # crops that may reach past the edges

Every step is one batched tensor operation over the whole batch, so the number of
operations a batch dispatches does not grow with its images (bench/gpu_path.py counts
them). The cost follows what the output reads, each image's crop box, not the largest
image of the batch. This is the GPU's path; on the CPU the per-image kernels of
augment/ops.py are faster (docs/design.md, "Choices and where they were measured").

How the resampler works: torch's antialiased bilinear weights (augment/ops.py `aa_weights`)
are nonzero for at most K neighbouring source pixels of an output pixel. A window of K
pixels of a row is a strided view of the flat buffer, so the horizontal pass gathers, for
every row of every crop band and every output column, its K pixels in one indexing call
and weights them; the vertical pass then gathers, for every output row, its K rows of
that result. Taps past an image's edge read the buffer's slack or a neighbour's pixels
with weight zero.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import torch

HWC, CHW = "hwc", "chw"  # the layout of each image in the buffer


@dataclasses.dataclass(frozen=True)
class RaggedImages:
    """uint8 pixels of B images back to back (`layout` each), `offsets` (B,) where each
    starts, `sizes` (B, 2) their (h, w); `pixels` ends in `slack` unused elements, which a
    window starting inside the last image may read."""

    pixels: torch.Tensor
    offsets: torch.Tensor
    sizes: torch.Tensor
    layout: str
    slack: int

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def device(self) -> torch.device:
        return self.pixels.device

    @classmethod
    def from_images(cls, images: list, device, shape: str = HWC) -> "RaggedImages":
        """Images on `device` as uint8 tensors of `shape` ((3, H, W) for CHW, as torchvision's
        decoders give them), and any others (numpy arrays, tensors elsewhere) as uint8
        (H, W, 3). The buffer takes the memory layout most of the device tensors have, so
        that they go in as views; the others are packed into one host buffer in that layout
        and uploaded in one copy; then everything is joined in one concatenation. (A device
        tensor in neither layout is copied on its own.)"""
        device = torch.device(device)
        here = [isinstance(a, torch.Tensor) and a.device == device for a in images]
        hw = [_hw(a, shape if ok else HWC) for a, ok in zip(images, here, strict=True)]
        memory = [_memory(a, shape) if ok else None for a, ok in zip(images, here, strict=True)]
        layout = CHW if 2 * memory.count(CHW) > len(images) - here.count(False) else HWC
        parts = [_flat(a, shape, layout) if ok else None for a, ok in zip(images, here, strict=True)]
        sizes = [h * w * 3 for h, w in hw]
        host = [i for i, ok in enumerate(here) if not ok]
        if host:
            uploaded = torch.from_numpy(np.concatenate([_host_flat(images[i], layout) for i in host])).to(device)
            ends = np.cumsum([sizes[i] for i in host])
            for i, start, end in zip(host, np.r_[0, ends[:-1]], ends, strict=True):
                parts[i] = uploaded[int(start) : int(end)]
        slack = 3 * max(max(h, w) for h, w in hw)
        pixels = torch.cat([*parts, torch.zeros(slack, dtype=torch.uint8, device=device)])
        offsets = torch.tensor(np.r_[0, np.cumsum(sizes)[:-1]], dtype=torch.int64).to(device)
        return cls(pixels, offsets, torch.tensor(hw, dtype=torch.int64).view(-1, 2).to(device), layout, slack)

    def strides(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Per image, the element steps between channels and between rows (B,), and the
        step between neighbouring pixels of a row (the same for every image)."""
        h, w = self.sizes[:, 0], self.sizes[:, 1]
        if self.layout == HWC:
            return torch.ones_like(w), 3 * w, 3
        return h * w, w, 1

    def padded(self, before: int, after: int) -> "RaggedImages":
        """The same images with at least `before` elements in front and `after` behind."""
        if before <= 0 and after <= self.slack:
            return self
        before, extra = max(before, 0), max(after - self.slack, 0)
        dev = self.device
        pixels = torch.cat(
            [
                torch.zeros(before, dtype=torch.uint8, device=dev),
                self.pixels,
                torch.zeros(extra, dtype=torch.uint8, device=dev),
            ]
        )
        return dataclasses.replace(self, pixels=pixels, offsets=self.offsets + before, slack=self.slack + extra)


def _hw(image, layout: str) -> tuple[int, int]:
    shape = tuple(image.shape)
    ok = len(shape) == 3 and (shape[2] if layout == HWC else shape[0]) == 3 and image.dtype in (np.uint8, torch.uint8)
    if not ok:
        raise ValueError(f"augment: expected uint8 {layout.upper()} RGB images, got {image.dtype} {shape}")
    return (int(shape[0]), int(shape[1])) if layout == HWC else (int(shape[1]), int(shape[2]))


_TO = {(CHW, HWC): (1, 2, 0), (HWC, CHW): (2, 0, 1)}  # permutes from one shape to the other


def _memory(image: torch.Tensor, shape: str) -> str | None:
    """The layout of a tensor's memory (of `shape`), or None if it is in neither."""
    if image.is_contiguous():
        return shape
    other = HWC if shape == CHW else CHW
    return other if image.permute(*_TO[shape, other]).is_contiguous() else None


def _flat(image: torch.Tensor, shape: str, layout: str) -> torch.Tensor:
    """A device tensor's pixels in `layout`, flat: a view where its memory is in that layout."""
    if shape != layout:
        image = image.permute(*_TO[shape, layout])
    return image.reshape(-1)


def _host_flat(image, layout: str) -> np.ndarray:
    a = image.numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return np.ascontiguousarray(a.transpose(2, 0, 1) if layout == CHW else a).reshape(-1)


def taps(start, length, out_len, offset, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Along one axis, for each image's box [start, start + length) resampled to out_len
    positions of which [offset, offset + count) are kept: the first source position of each
    output position's K taps (B, count) and their weights (B, count, K), K the batch's widest
    filter. The weights are torch's antialiased bilinear ones, as augment/ops.py `aa_weights`
    computes them on a whole canvas (align_corners=False, triangle filter widened by the scale
    when shrinking), in float64 and then float32."""
    dev = start.device
    scale = length.double() / out_len.double()
    support = scale.clamp(min=1.0)
    i = offset[:, None].double() + torch.arange(count, device=dev, dtype=torch.float64)
    center = scale[:, None] * (i + 0.5)
    xmin = (center - support[:, None] + 0.5).trunc().clamp(min=0)  # C++'s int64 cast truncates
    xmax = torch.minimum((center + support[:, None] + 0.5).trunc(), length[:, None].double())
    k = int((xmax - xmin).max())  # host sync, once an axis
    j = xmin[..., None] + torch.arange(k, device=dev, dtype=torch.float64)  # (B, count, K), box coordinates
    w = (1.0 - ((j - center[..., None] + 0.5) / support[:, None, None]).abs()).clamp(min=0.0)
    w = w * (j < xmax[..., None])
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-12)
    return start[:, None] + xmin.long(), w.float()


def resample(batch: RaggedImages, box, resized, offset, out_hw, dtype=None) -> torch.Tensor:
    """Box (top, left, h, w) of every image resampled to resized (rh, rw), the out_hw window
    at offset (oy, ox) kept: float (B, 3, oh, ow) in [0, 1], channels_last, as
    augment/ops.py `resample_boxes` returns it. `dtype`: the weighting's (None: float16 on
    a GPU, float32 elsewhere)."""
    dtype = dtype or (torch.float16 if batch.device.type == "cuda" else torch.float32)
    oh, ow = out_hw
    y0, wy = taps(box[:, 0], box[:, 2], resized[:, 0], offset[:, 0], oh)  # (B, oh), (B, oh, Ky)
    x0, wx = taps(box[:, 1], box[:, 3], resized[:, 1], offset[:, 1], ow)  # (B, ow), (B, ow, Kx)
    # the rows the vertical taps reach, per image a band [lo, hi) of its own rows
    lo = y0[:, 0]
    hi = torch.minimum(y0[:, -1] + wy.shape[2], batch.sizes[:, 0])
    bands = hi - lo
    rows = rows_of(bands)  # (R,) the image of each band row
    band_start = torch.cumsum(bands, 0) - bands
    y = lo[rows] + torch.arange(len(rows), device=batch.device) - band_start[rows]
    h = _horizontal(batch, rows, y, x0, wx, dtype)  # (R, ow, 3)
    # vertical: each output row's Ky rows of its image's band (taps past the band weigh 0)
    ky = wy.shape[2]
    r = (y0 - lo[:, None])[..., None] + torch.arange(ky, device=batch.device)  # (B, oh, Ky)
    r = band_start[:, None, None] + torch.minimum(r, (bands - 1)[:, None, None])
    picked = h.index_select(0, r.reshape(-1)).view(len(batch), oh, ky, ow * 3)
    out = torch.matmul(wy.to(dtype)[:, :, None, :], picked)  # (B, oh, 1, ow * 3)
    return out.view(len(batch), oh, ow, 3).float().div_(255.0).clamp_(0.0, 1.0).permute(0, 3, 1, 2)


def rows_of(counts: torch.Tensor) -> torch.Tensor:
    """(sum(counts),) the index of the image each of `counts`' rows belongs to."""
    return torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)


def _horizontal(batch: RaggedImages, rows, y, x0, wx, dtype) -> torch.Tensor:
    """Every band row (image `rows`, row `y`) resampled to the output's columns: (R, ow, 3)."""
    kx = wx.shape[2]
    ch, row, px = batch.strides()
    base = batch.offsets[rows] + y * row[rows]  # (R,) where each band row starts
    column = (x0 * px)[:, :, None] + (ch[:, None, None] * torch.arange(3, device=batch.device))  # (B, ow, 3)
    start = base[:, None, None] + column[rows]  # (R, ow, 3): the first tap of each output pixel
    index = start.to(torch.int32) if batch.pixels.numel() < 2**31 else start
    n = batch.pixels.numel() - (kx - 1) * px
    windows = batch.pixels.as_strided((n, kx), (1, px))  # every run of kx pixels of a channel
    picked = windows.index_select(0, index.reshape(-1)).view(*start.shape, kx)  # (R, ow, 3, Kx) uint8
    weights = wx.to(dtype)[rows]  # (R, ow, Kx)
    if picked.device.type == "cuda":  # one multiply and one reduction, bound by memory
        return (picked.to(dtype) * weights[:, :, None, :]).sum(-1)
    # a (3, Kx) @ (Kx, 1) product per band row and output column: on a CPU this spares the memory
    # of the (R, ow, 3, Kx) product (docs/design.md, "Choices and where they were measured")
    return torch.matmul(picked.to(dtype), weights[..., None])[..., 0]


def crop(batch: RaggedImages, top, left, out_hw, fill: float = 0.0) -> torch.Tensor:
    """(B, oh, ow) windows whose top-left corners are (top, left) in image coordinates: uint8
    (B, oh, ow, 3), as augment/ops.py `gather_crop` gives them from a canvas. Pixels outside
    an image (padding) take `fill`."""
    oh, ow = out_hw
    dev = batch.device
    h, w = batch.sizes[:, 0], batch.sizes[:, 1]
    ch, row, px = batch.strides()
    ys = top[:, None] + torch.arange(oh, device=dev)  # (B, oh)
    xs = left[:, None] + torch.arange(ow, device=dev)  # (B, ow)
    valid = ((ys >= 0) & (ys < h[:, None]))[:, :, None] & ((xs >= 0) & (xs < w[:, None]))[:, None, :]
    start = batch.offsets[:, None] + ys.clamp(min=0).minimum(h[:, None] - 1) * row[:, None] + (left * px)[:, None]
    start = start[:, :, None] + ch[:, None, None] * torch.arange(3, device=dev)  # (B, oh, 3)
    first, last = int(start.min()), int(start.max()) + (ow - 1) * px + 1  # host sync, once a batch
    batch = batch.padded(-first, last - (batch.pixels.numel() - batch.slack))
    start = start - first if first < 0 else start
    n = batch.pixels.numel() - (ow - 1) * px
    windows = batch.pixels.as_strided((n, ow), (1, px))
    out = windows.index_select(0, start.reshape(-1)).view(len(batch), oh, 3, ow).permute(0, 1, 3, 2)
    if bool(valid.all()):  # host sync: no padding in the batch
        return out
    return torch.where(valid[..., None], out, torch.tensor(round(fill * 255), dtype=torch.uint8, device=dev))
