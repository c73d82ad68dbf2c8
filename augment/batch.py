"""One batch through a preset's pipeline on the CPU or a GPU: from decoded images
(`augment_batch`) or from the encoded files (`decode_augment`: decoding and augmentation in
one call, each image's parameters drawn from its header's size before it is decoded)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from augment import engines
from augment.decode import GPU_SMS, ON_CPU, BadImage, decode_cuda, decode_image, read_header
from augment.pipeline import Pipeline, to_canvas
from augment.ragged import CHW, HWC, RaggedImages


def augment_batch(pipeline: Pipeline, images, keys: torch.Tensor, epoch: int, device: torch.device) -> torch.Tensor:
    """Decoded images (a uint8 (B, H, W, 3) array or a ragged object array) -> uint8 (B, S, S, 3)."""
    return pipeline.at_epoch(epoch).augment_images(images, keys, device)


DECODERS = ("cpu", "nvjpeg", "nvimgcodec", "nvimgcodec-whole")


class Decoded(NamedTuple):
    """decode_augment's batch: the augmented images of the files kept, their rows in the batch,
    the files dropped with the reason, and where each kept image was decoded (augment.decode's
    ENGINES, GPU_SMS, ON_CPU)."""

    images: torch.Tensor  # uint8 (B', S, S, 3)
    kept: list[int]
    bad: list[tuple[int, str]]
    decoded_on: list[int]


def default_decoder(device: torch.device, gpu: str = "auto") -> str:
    """The decoder for `device`: on a GPU `gpu` (--gpu-decoder), or for "auto" nvImageCodec
    where it is installed and has not failed here (the hardware JPEG engines, each crop region
    alone), else torchvision's nvjpeg; libjpeg-turbo on the CPU."""
    if torch.device(device).type != "cuda":
        return "cpu"
    if gpu != "auto":
        return gpu
    return "nvimgcodec" if engines.usable() else "nvjpeg"


def decode_augment(
    pipeline: Pipeline,
    encoded,
    keys: torch.Tensor,
    epoch: int,
    device: torch.device,
    *,
    shrink: bool,
    decoder: str | None = None,
    ragged: bool = True,
):
    """Encoded files -> Decoded: uint8 (B', S, S, 3), the indices of the B' rows kept, [(row, reason)]
    of the rest, and where each kept image was decoded.

    Each image's parameters are drawn from its header's size before it is decoded, so its
    augmentation is the same whatever batch it lands in and however it is decoded.
    `decoder` (DECODERS; default_decoder(device) if None):
    * "cpu": libjpeg-turbo a chunk of images at a time, so that the decoded pixels of a chunk
      are augmented while in the caches. With `shrink` (the CPU train path), a JPEG whose crop
      still covers the output at 1/2, 1/4 or 1/8 scale is decoded at that scale and its draws
      fitted to it (the epoch pipeline's decode_scales and fit_to_decoded).
    * "nvjpeg": the whole batch at full size in one batched torchvision call.
    * "nvimgcodec": the whole batch in one batched nvImageCodec call, each image only in the
      region the first op reads (augment/engines.py), the draws moved into it;
      "nvimgcodec-whole" the same call on whole images (for bench/gpu_path.py to compare).
    The batched decoders run on CPU tensors too: the tests take the GPU path through them on
    a machine without one. Their images go to the first op as one ragged buffer
    (augment/ragged.py), with no canvas and nothing launched per image; everything after the
    first op is the same code on every device. `ragged=False` gives them the canvas of
    earlier versions (a padded batch, the matmul resampler), for bench/gpu_path.py to compare.
    """
    decoder = decoder or default_decoder(device)
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
    batched = decoder != "cpu"
    pipe = pipeline.at_epoch(epoch)
    headers, bad = [], []
    for i, data in enumerate(encoded):
        try:
            headers.append((i, *read_header(data)))
        except BadImage as e:
            bad.append((i, str(e)))
    if not headers:
        return Decoded(pipe.empty(device), [], bad, [])
    n = len(headers)
    all_rows = torch.tensor([h[0] for h in headers], dtype=torch.int64)
    all_sizes = torch.tensor([h[1:3] for h in headers], dtype=torch.int64, device=device).view(-1, 2)
    draws = pipe.sample(all_sizes, keys[all_rows].to(device))  # every image's, once for the batch
    if shrink and not batched:
        factors = pipe.decode_scales(draws)
    else:
        factors = torch.ones(n, dtype=torch.int64, device=device)
    regions = pipe.read_regions(draws) if decoder == "nvimgcodec" else None
    # on the CPU each chunk's pixels are written straight into the batch's rows
    out = torch.empty((n, *pipe.out_hw, 3), dtype=torch.uint8) if device.type == "cpu" else None
    outs, kept, where = [], [], []
    try:
        for c in pipe.chunks(n) if not batched else [slice(0, n)]:
            chunk_regions = None if regions is None else regions[c].tolist()
            images, good, cropped, on = _decode_chunk(
                encoded, headers[c], factors[c], chunk_regions, device, bad, decoder
            )
            if not good:
                continue
            sel = torch.tensor(good, dtype=torch.int64, device=device) + c.start  # the decoded images' rows
            chunk, sizes = draws.take(sel), all_sizes[sel]
            if regions is not None:  # the images decoded as their regions: draws and sizes in the region's terms
                inside = torch.tensor(cropped, dtype=torch.bool, device=device)
                chunk = pipe.in_regions(chunk, regions[sel], inside)
                sizes = torch.where(inside[:, None], regions[sel][:, 2:], sizes)
            canvas, decoded = _to_first_op(pipe, images, device, decoder, ragged)
            chunk = pipe.fit_to_decoded(chunk, sizes, decoded, factors[sel])
            rows = None if out is None else out[len(kept) : len(kept) + len(good)]
            outs.append(pipe.apply(canvas, decoded, chunk, rows))
            kept += all_rows[sel.cpu()].tolist()
            where += on
    finally:
        if decoder.startswith("nvimgcodec") and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # before the decoder's buffers (in `images`) go
    if not outs:
        return Decoded(pipe.empty(device), [], bad, [])
    images = torch.cat(outs) if out is None else out[: len(kept)]
    return Decoded(images, kept, bad, where if device.type == "cuda" else [ON_CPU] * len(kept))


def _to_first_op(pipe, images: list, device, decoder: str, ragged: bool):
    """The decoded images as the first op takes them, and their (h, w)."""
    layout = CHW if decoder == "nvjpeg" else HWC  # torchvision's decoders give (3, H, W)
    if decoder != "cpu" and ragged:  # every image to the first op as it was decoded, in one buffer: no canvas
        canvas = RaggedImages.from_images(images, device, layout)
        return canvas, canvas.sizes
    if decoder != "cpu":
        hwc = [a.permute(1, 2, 0) if isinstance(a, torch.Tensor) and layout == CHW else a for a in images]
        canvas, decoded = to_canvas(hwc)
        return canvas.to(device), decoded.to(device)
    if pipe.takes_image_list:
        return [torch.from_numpy(a) for a in images], torch.tensor([a.shape[:2] for a in images], dtype=torch.int64)
    return to_canvas(images)


def _decode_chunk(encoded, chunk, factors, regions, device, bad, decoder: str):
    """The chunk's images (HWC uint8 arrays or device tensors), their positions in the chunk,
    whether each is its region (`regions`, nvImageCodec only) and where each was decoded; a file
    that fails to decode is added to `bad` as (row, reason)."""
    datas, jpeg = [encoded[h[0]] for h in chunk], [h[3] for h in chunk]
    cropped, where = [False] * len(chunk), [ON_CPU] * len(chunk)
    if decoder == "nvjpeg":
        results = decode_cuda(datas, jpeg, device)
        where = [GPU_SMS if isinstance(r, torch.Tensor) else ON_CPU for r in results]
    elif decoder.startswith("nvimgcodec"):
        try:
            results, cropped, where = engines.decode_regions(datas, jpeg, regions, device)
        except engines.EngineFailure:  # said once: this batch and the next go to nvjpeg, as (H, W, 3) views
            results = [_hwc(r) for r in decode_cuda(datas, jpeg, device)]
            where = [GPU_SMS if isinstance(r, torch.Tensor) else ON_CPU for r in results]
        else:
            results = [_decoded(data, 1) if r is None else r for data, r in zip(datas, results, strict=True)]
    else:
        results = [_decoded(data, int(f)) for data, f in zip(datas, factors, strict=True)]
    images, good, kept_cropped, kept_where = [], [], [], []
    for j, result in enumerate(results):
        if isinstance(result, BadImage):
            bad.append((chunk[j][0], str(result)))
        else:
            images.append(result)
            good.append(j)
            kept_cropped.append(cropped[j])
            kept_where.append(where[j])
    return images, good, kept_cropped, kept_where


def _hwc(image):
    """A (3, H, W) tensor of torchvision's decoders as an (H, W, 3) view; anything else as it is."""
    return image.permute(1, 2, 0) if isinstance(image, torch.Tensor) else image


def _decoded(data: bytes, shrink: int):
    """decode_image's array, or the BadImage that says why there is none."""
    try:
        return decode_image(data, shrink)
    except BadImage as e:
        return e
