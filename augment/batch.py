"""One batch through a preset's pipeline on the CPU or a GPU: from decoded images
(`augment_batch`) or from the encoded files (`decode_augment`: decoding and augmentation in
one call, each image's parameters drawn from its header's size before it is decoded)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from augment import engines, fused
from augment.decode import GPU_SMS, ON_CPU, BadImage, decode_cuda, decode_image, read_header
from augment.pipeline import Pipeline


def augment_batch(pipeline: Pipeline, images, keys: torch.Tensor, epoch: int, device: torch.device) -> torch.Tensor:
    """Decoded images (a uint8 (B, H, W, 3) array or a ragged object array) -> uint8 (B, S, S, 3).
    On the CPU a chunk at a time (the pipeline's CPU_CHUNK_PIXELS); a GPU takes the batch whole."""
    device = torch.device(device)
    pipe = pipeline.at_epoch(epoch)
    sizes = torch.tensor([im.shape[:2] for im in images], dtype=torch.int64).view(-1, 2).to(device)
    request = pipe.request(sizes, keys.to(device))
    if device.type != "cpu":
        return pipe.finish(request, images, path=gpu_path(pipe, device))
    out = torch.empty((len(images), *pipe.out_hw, 3), dtype=torch.uint8)
    for c in cpu_chunks(len(images), pipe.cpu_chunk):
        pipe.finish(request.take(c), images[c], path="cpu", out=out[c])
    return out


def cpu_chunks(n: int, size: int) -> list[slice]:
    """The CPU's chunks of a batch of n images, `size` each (the pipeline's cpu_chunk: see
    CPU_CHUNK_PIXELS): the chunk loops of this file are the only ones."""
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


DECODERS = ("cpu", "nvjpeg", "nvimgcodec")


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


def gpu_path(pipe, device) -> str:
    """The GPU's way to the first op (augment.pipeline.PATHS): on a GPU the fused kernel where Triton
    runs it and it covers the pipeline's first op, else the ragged buffer and the torch ops (the
    kernel runs on a CPU only when asked for: Triton's interpreter is slow)."""
    usable = torch.device(device).type == "cuda" and fused.available(device) and fused.fused_prefix(pipe.ops)
    return "fused" if usable else "ragged"


def decode_augment(
    pipeline: Pipeline,
    encoded,
    keys: torch.Tensor,
    epoch: int,
    device: torch.device,
    *,
    shrink: bool,
    decoder: str | None = None,
    path: str | None = None,
) -> Decoded:
    """Encoded files -> Decoded: uint8 (B', S, S, 3), the indices of the B' rows kept, [(row, reason)]
    of the rest, and where each kept image was decoded.

    Each image's parameters are drawn from its header's size before it is decoded (the pipeline's
    DecodeRequest), so its augmentation is the same whatever batch it lands in and however it is
    decoded. `decoder` (DECODERS; default_decoder(device) if None):
    * "cpu": libjpeg-turbo a chunk of images at a time, so that the decoded pixels of a chunk
      are augmented while in the caches. With `shrink` (the CPU train path), a JPEG whose crop
      still covers the output at 1/2, 1/4 or 1/8 scale is decoded at that scale.
    * "nvjpeg": the whole batch at full size in one batched torchvision call.
    * "nvimgcodec": the whole batch in one batched nvImageCodec call, each image only in the
      region the first op reads (augment/engines.py).
    The batched decoders run on CPU tensors too: the tests take the GPU path through them on a
    machine without one. `path` (augment.pipeline.PATHS; default: gpu_path's for the batched
    decoders) is how their images reach the first op.
    """
    decoder = decoder or default_decoder(device)
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
    pipe = pipeline.at_epoch(epoch)
    path = "cpu" if decoder == "cpu" else path or gpu_path(pipe, device)
    headers, bad = [], []
    for i, data in enumerate(encoded):
        try:
            headers.append((i, *read_header(data)))
        except BadImage as e:
            bad.append((i, str(e)))
    if not headers:
        return Decoded(pipe.empty(device), [], bad, [])
    sizes = torch.tensor([h[1:3] for h in headers], dtype=torch.int64, device=device).view(-1, 2)
    rows = torch.tensor([h[0] for h in headers], dtype=torch.int64)
    shrink = shrink and path == "cpu"
    request = pipe.request(sizes, keys[rows].to(device), shrink=shrink, regions=decoder == "nvimgcodec")
    # on the CPU's path each chunk's pixels are written straight into the batch's rows
    out = torch.empty((len(headers), *pipe.out_hw, 3), dtype=torch.uint8) if path == "cpu" else None
    outs, kept, where = [], [], []
    try:
        for c in cpu_chunks(len(headers), pipe.cpu_chunk) if path == "cpu" else [slice(0, len(headers))]:
            part = request.take(c)
            images, good, cropped, on = _decode_chunk(encoded, headers[c], part, device, bad, decoder)
            if not good:
                continue
            into = None if out is None else out[len(kept) : len(kept) + len(good)]
            outs.append(pipe.finish(part.take(good), images, path=path, cropped=cropped, out=into))
            kept += rows[c][good].tolist()
            where += on
    finally:
        if decoder == "nvimgcodec" and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # before the decoder's buffers (in `images`) go
    if not outs:
        return Decoded(pipe.empty(device), [], bad, [])
    images = (outs[0] if len(outs) == 1 else torch.cat(outs)) if out is None else out[: len(kept)]
    return Decoded(images, kept, bad, where if device.type == "cuda" else [ON_CPU] * len(kept))


def _decode_chunk(encoded, chunk, request, device, bad, decoder: str):
    """The chunk's images ((H, W, 3)-shaped uint8 arrays or device tensors), their positions in the
    chunk, whether each is its request's region and where each was decoded; a file that fails to
    decode is added to `bad` as (row, reason)."""
    datas, jpeg = [encoded[h[0]] for h in chunk], [h[3] for h in chunk]
    cropped, where = [False] * len(chunk), [ON_CPU] * len(chunk)
    if decoder == "nvjpeg":
        results = [_hwc(r) for r in decode_cuda(datas, jpeg, device)]
        where = [GPU_SMS if isinstance(r, torch.Tensor) else ON_CPU for r in results]
    elif decoder == "nvimgcodec":
        regions = None if request.regions is None else request.regions.tolist()  # host sync, once a batch
        try:
            results, cropped, where = engines.decode_regions(datas, jpeg, regions, device)
        except engines.EngineFailure:  # said once: this batch and the next go to nvjpeg, as (H, W, 3) views
            results = [_hwc(r) for r in decode_cuda(datas, jpeg, device)]
            where = [GPU_SMS if isinstance(r, torch.Tensor) else ON_CPU for r in results]
        else:
            results = [_decoded(data, 1) if r is None else r for data, r in zip(datas, results, strict=True)]
    else:
        factors = [1] * len(chunk) if request.scales is None else request.scales.tolist()
        results = [_decoded(data, int(f)) for data, f in zip(datas, factors, strict=True)]
    good = [j for j, r in enumerate(results) if not isinstance(r, BadImage)]
    bad += [(chunk[j][0], str(r)) for j, r in enumerate(results) if isinstance(r, BadImage)]
    return [results[j] for j in good], good, [cropped[j] for j in good], [where[j] for j in good]


def _hwc(image):
    """A (3, H, W) tensor of torchvision's decoders as an (H, W, 3) view; anything else as it is."""
    return image.permute(1, 2, 0) if isinstance(image, torch.Tensor) else image


def _decoded(data: bytes, shrink: int):
    """decode_image's array, or the BadImage that says why there is none."""
    try:
        return decode_image(data, shrink)
    except BadImage as e:
        return e
