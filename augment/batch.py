"""One batch through a preset's pipeline on the CPU or a GPU: from decoded images
(`augment_batch`) or from the encoded files (`decode_augment`: decoding and augmentation in
one call, each image's parameters drawn from its header's size before it is decoded)."""

from __future__ import annotations

import torch

from augment.decode import BadImage, decode_cuda, decode_image, read_header
from augment.pipeline import Pipeline, to_canvas
from augment.ragged import CHW, RaggedImages


def augment_batch(pipeline: Pipeline, images, keys: torch.Tensor, epoch: int, device: torch.device) -> torch.Tensor:
    """Decoded images (a uint8 (B, H, W, 3) array or a ragged object array) -> uint8 (B, S, S, 3)."""
    return pipeline.at_epoch(epoch).augment_images(images, keys, device)


def decode_augment(
    pipeline: Pipeline,
    encoded,
    keys: torch.Tensor,
    epoch: int,
    device: torch.device,
    *,
    shrink: bool,
    nvjpeg: bool | None = None,
    ragged: bool = True,
):
    """Encoded files -> (uint8 (B', S, S, 3), indices of the B' rows kept, [(row, reason)] of the rest).

    Each image's parameters are drawn from its header's size before it is decoded, so its
    augmentation is the same whatever batch it lands in and however it is decoded. With
    `shrink` (the CPU train path), a JPEG whose crop still covers the output at 1/2, 1/4 or
    1/8 scale is decoded at that scale and its draws fitted to it (the epoch pipeline's
    decode_scales and fit_to_decoded). On a GPU the batch is decoded at full size by nvjpeg
    and goes to the first op as one ragged buffer (augment/ragged.py), with no canvas and
    nothing launched per image; everything after the first op is the same code on both
    devices. Work goes in chunks
    on the CPU, so that the decoded pixels of a chunk are augmented while in the caches, the
    whole batch at once on a GPU. `nvjpeg` (default: on a CUDA device) picks the batched
    decode call, which torchvision also runs on CPU tensors: the tests take the GPU path
    through it on a machine without one. `ragged=False` gives that path the canvas it had
    before (a padded batch, the matmul resampler), for bench/gpu_path.py to compare.
    """
    nvjpeg = device.type == "cuda" if nvjpeg is None else nvjpeg
    pipe = pipeline.at_epoch(epoch)
    headers, bad = [], []
    for i, data in enumerate(encoded):
        try:
            headers.append((i, *read_header(data)))
        except BadImage as e:
            bad.append((i, str(e)))
    if not headers:
        return pipe.empty(device), [], bad
    n = len(headers)
    all_rows = torch.tensor([h[0] for h in headers], dtype=torch.int64)
    all_sizes = torch.tensor([h[1:3] for h in headers], dtype=torch.int64, device=device).view(-1, 2)
    draws = pipe.sample(all_sizes, keys[all_rows].to(device))  # every image's, once for the batch
    if shrink and not nvjpeg:
        factors = pipe.decode_scales(draws)
    else:
        factors = torch.ones(n, dtype=torch.int64, device=device)
    outs, kept = [], []
    for c in pipe.chunks(n) if not nvjpeg else [slice(0, n)]:
        images, good = _decode_chunk(encoded, headers[c], factors[c], device, bad, nvjpeg)
        if not good:
            continue
        sel = torch.tensor(good, dtype=torch.int64, device=device) + c.start  # the decoded images' rows among the n
        if nvjpeg and ragged:  # every image to the first op as it was decoded, in one buffer: no canvas
            canvas = RaggedImages.from_images(images, device, CHW)
            decoded = canvas.sizes
        elif nvjpeg:
            canvas, decoded = to_canvas([a.permute(1, 2, 0) if isinstance(a, torch.Tensor) else a for a in images])
            canvas, decoded = canvas.to(device), decoded.to(device)
        elif pipe.takes_image_list:
            canvas = [torch.from_numpy(a) for a in images]
            decoded = torch.tensor([a.shape[:2] for a in images], dtype=torch.int64)
        else:
            canvas, decoded = to_canvas(images)
        chunk = pipe.fit_to_decoded(draws.take(sel), all_sizes[sel], decoded, factors[sel])
        outs.append(pipe.apply(canvas, decoded, chunk))
        kept += all_rows[sel.cpu()].tolist()
    if not outs:
        return pipe.empty(device), [], bad
    return torch.cat(outs), kept, bad


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
