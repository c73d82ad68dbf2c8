"""Batches of images as tensors: the canvas for ragged photos, and one preset pipeline
applied to a whole batch on the CPU or a GPU, from decoded images (`augment_batch`) or
from the encoded files (`decode_augment`: decoding and augmentation in one call)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from augment.decode import BadImage, decode_cuda, decode_image, read_header
from augment.pipeline import Pipeline


def to_canvas(images) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded images -> (uint8 canvas (B, Hmax, Wmax, 3), int64 sizes (B, 2)).

    A fixed-shape batch is used as it is (no copy); a ragged one (an object array of HWC
    arrays) is copied into the top-left corners of a canvas. The rest of the canvas is left
    uninitialised: no op reads outside an image's size (crops mask, resampling weights
    are zero there), so zero-filling it would be a second pass over the canvas for nothing
    (docs/design.md, "Choices and where they were measured").
    """
    if isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.ndim == 4:
        b, h, w, c = images.shape
        if c != 3:
            raise ValueError(f"augment: expected RGB images (B, H, W, 3), got shape {images.shape}")
        with warnings.catch_warnings():  # Arrow's buffers are read-only; nothing here writes to them
            warnings.simplefilter("ignore", UserWarning)
            canvas = torch.from_numpy(images)
        return canvas, torch.tensor([[h, w]], dtype=torch.int64).expand(b, 2)
    arrays = list(images)
    for a in arrays:
        if a.dtype not in (np.uint8, torch.uint8) or a.ndim != 3 or a.shape[2] != 3:
            raise ValueError(f"augment: expected uint8 HWC RGB images, got {a.dtype} {tuple(a.shape)}")
    device = arrays[0].device if isinstance(arrays[0], torch.Tensor) else torch.device("cpu")
    sizes = torch.tensor([a.shape[:2] for a in arrays], dtype=torch.int64).view(-1, 2)
    canvas = torch.empty(
        (len(arrays), int(sizes[:, 0].max()), int(sizes[:, 1].max()), 3), dtype=torch.uint8, device=device
    )
    with warnings.catch_warnings():  # read-only arrays (decoded by PIL, Arrow's buffers) are only read
        warnings.simplefilter("ignore", UserWarning)
        for i, a in enumerate(arrays):  # a memcpy per image; unavoidable for ragged input
            canvas[i, : a.shape[0], : a.shape[1]] = torch.as_tensor(a)
    return canvas, sizes.to(device)


def augment_batch(pipeline: Pipeline, images, keys: torch.Tensor, epoch: int, device: torch.device) -> torch.Tensor:
    """Decoded images (a uint8 (B, H, W, 3) array or a ragged object array) -> uint8 (B, S, S, 3).

    On the CPU a ragged batch goes to canvases a chunk at a time: one canvas for a whole
    batch of photos is Hmax x Wmax per image, and touching that much fresh memory costs
    more than augmenting it (docs/design.md, "Choices and where they were measured"). Each
    image's result is the same either way. A GPU gets the whole batch in one copy.
    """
    fixed = isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.ndim == 4
    if device.type == "cpu" and not fixed:
        step = pipeline.cpu_chunk
        return torch.cat(
            [pipeline(*to_canvas(images[i : i + step]), keys[i : i + step], epoch) for i in range(0, len(images), step)]
        )
    canvas, sizes = to_canvas(images)
    if device.type == "cuda":  # uint8 over PCIe: a quarter of the bytes of float32
        canvas = canvas.pin_memory().to(device, non_blocking=True)
    return pipeline(canvas, sizes.to(device), keys.to(device), epoch)


def decode_augment(
    pipeline: Pipeline,
    encoded,
    keys: torch.Tensor,
    epoch: int,
    device: torch.device,
    *,
    shrink: bool,
    nvjpeg: bool | None = None,
):
    """Encoded files -> (uint8 (B', S, S, 3), indices of the B' rows kept, [(row, reason)] of the rest).

    Each image's geometry is drawn from its header's size before it is decoded, so its
    augmentation is the same whatever batch it lands in and however it is decoded. With
    `shrink` (the CPU train path), a JPEG whose crop still covers the output at 1/2, 1/4 or
    1/8 scale is decoded at that scale and the crop box rescaled (the op's max_shrink and
    shrink_params). On a GPU the batch is decoded at full size by nvjpeg; everything after
    the decode call is the same code on both devices. Work goes in chunks on the CPU (as
    augment_batch does), the whole batch at once on a GPU. `nvjpeg` (default: on a CUDA
    device) picks the batched decode call, which torchvision also runs on CPU tensors: the
    tests take the GPU path through it on a machine without one.
    """
    nvjpeg = device.type == "cuda" if nvjpeg is None else nvjpeg
    shrink = shrink and not nvjpeg
    headers, bad = [], []
    for i, data in enumerate(encoded):
        try:
            headers.append((i, *read_header(data)))
        except BadImage as e:
            bad.append((i, str(e)))
    if not headers:
        return _empty(pipeline, epoch, device), [], bad
    step = pipeline.cpu_chunk if not nvjpeg else max(1, len(headers))
    n = len(headers)
    all_rows = torch.tensor([h[0] for h in headers], dtype=torch.int64)
    all_sizes = torch.tensor([h[1:3] for h in headers], dtype=torch.int64, device=device).view(-1, 2)
    all_keys = keys[all_rows].to(device)
    # every image's parameters drawn once for the batch, then taken a chunk at a time
    all_params, rest = pipeline.geometry(all_sizes, all_keys, epoch), pipeline.draw_rest(all_keys, epoch)
    all_factors = pipeline.ops[0].max_shrink(all_params) if shrink else None
    if all_factors is None:
        all_factors = torch.ones(n, dtype=torch.int64, device=device)
    outs, kept = [], []
    for c in range(0, n, step):
        chunk = headers[c : c + step]
        images, good = _decode_chunk(encoded, chunk, all_factors[c : c + step], device, bad, nvjpeg)
        if not good:
            continue
        sel = torch.tensor(good, dtype=torch.int64, device=device) + c  # the decoded images' rows among the n
        if not nvjpeg and pipeline.ops[0].takes_image_list and pipeline.ops[0].method != "matmul":
            # each image is resampled on its own: no copy into a canvas
            canvas = [torch.from_numpy(a) for a in images]
            decoded = torch.tensor([a.shape[:2] for a in images], dtype=torch.int64)
        else:
            canvas, decoded = to_canvas(images)
        keys_sel = all_keys[sel]
        params = _fit_to_decoded(
            pipeline, _rows(all_params, sel, n), all_sizes[sel], decoded, all_factors[sel], keys_sel, epoch
        )
        chunk_rest = [r if r is None else _rows(r, sel, n) for r in rest]
        outs.append(pipeline.augment(canvas, decoded, keys_sel, epoch, params, chunk_rest))
        kept += all_rows[sel.cpu()].tolist()
    if not outs:
        return _empty(pipeline, epoch, device), [], bad
    return torch.cat(outs), kept, bad


def _empty(pipeline: Pipeline, epoch: int, device) -> torch.Tensor:
    out_h, out_w = pipeline.size_at(epoch)  # the epoch's size (progressive resizing)
    return torch.empty((0, out_h, out_w, 3), dtype=torch.uint8, device=device)


def _rows(params: dict, sel: torch.Tensor, n: int) -> dict:
    """The per-image entries of `params` for the rows `sel` (entries not per image stay)."""
    return {k: v[sel] if isinstance(v, torch.Tensor) and v.dim() and len(v) == n else v for k, v in params.items()}


def _fit_to_decoded(pipeline, params, sizes, decoded, factors, keys, epoch) -> dict:
    """Geometry for the images as they were decoded. An image that came back at 1/f of its
    size gets its box rescaled; one at full size (a format without reduced decoding) keeps
    its parameters; one whose size matches neither (a header that lied) gets parameters
    drawn for the size it has, so no crop ever reaches outside an image."""
    scaled = -torch.div(-sizes, factors[:, None], rounding_mode="floor")  # ceil(size / f)
    full = (decoded == sizes).all(1)
    shrunk = (decoded == scaled).all(1) & (factors > 1)
    if not bool((full | shrunk).all()):  # host sync, once a chunk
        redrawn = pipeline.geometry(decoded, keys, epoch)
        keep = full | shrunk
        params = {k: _where(keep, v, redrawn[k]) for k, v in params.items()}
    if bool(shrunk.any()):
        params = pipeline.ops[0].shrink_params(params, torch.where(shrunk, factors, 1))
    return params


def _where(mask, a, b):
    if not isinstance(a, torch.Tensor) or not a.dim():
        return a
    return torch.where(mask.view(-1, *[1] * (a.dim() - 1)), a, b)


def _decode_chunk(encoded, chunk, factors, device, bad, nvjpeg: bool) -> tuple[list, list[int]]:
    """The chunk's images (HWC uint8 arrays or device tensors) and their positions in the
    chunk; a file that fails to decode is added to `bad` as (row, reason)."""
    if nvjpeg:
        results = decode_cuda([encoded[h[0]] for h in chunk], [h[3] for h in chunk], device)
    else:
        results = []
        for j, h in enumerate(chunk):
            try:
                results.append(decode_image(encoded[h[0]], int(factors[j])))
            except BadImage as e:
                results.append(e)
    images, good = [], []
    for j, result in enumerate(results):
        if isinstance(result, BadImage):
            bad.append((chunk[j][0], str(result)))
        else:
            images.append(result)
            good.append(j)
    return images, good
