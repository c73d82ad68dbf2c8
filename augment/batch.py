"""Batches of decoded images as tensors: the canvas for ragged photos, and one preset
pipeline applied to a whole batch on the CPU or a GPU."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from augment.presets import Pipeline


def to_canvas(images) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded images -> (uint8 canvas (B, Hmax, Wmax, 3), int64 sizes (B, 2)).

    A fixed-shape batch is used as it is (no copy); a ragged one (an object array of HWC
    arrays) is copied into the top-left corners of a canvas. The rest of the canvas is left
    uninitialised: no op reads outside an image's size (crops mask, resampling weights
    are zero there), and zero-filling it cost as much as the copy on 2 cores.
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
        if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
            raise ValueError(f"augment: expected uint8 HWC RGB images, got {a.dtype} {a.shape}")
    sizes = torch.tensor([a.shape[:2] for a in arrays], dtype=torch.int64).view(-1, 2)
    canvas = torch.empty((len(arrays), int(sizes[:, 0].max()), int(sizes[:, 1].max()), 3), dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only arrays (decoded by PIL, Arrow's buffers) are only read
        warnings.simplefilter("ignore", UserWarning)
        for i, a in enumerate(arrays):  # a memcpy per image; unavoidable for ragged input
            canvas[i, : a.shape[0], : a.shape[1]] = torch.from_numpy(a)
    return canvas, sizes


def augment_batch(pipeline: Pipeline, images, keys: torch.Tensor, epoch: int, device: torch.device) -> torch.Tensor:
    """Decoded images (a uint8 (B, H, W, 3) array or a ragged object array) -> uint8 (B, S, S, 3).

    On the CPU a ragged batch goes to canvases a chunk at a time: one canvas for a whole
    batch of photos is Hmax x Wmax per image (~1 GB for 1,024 mixed-size photos), and
    touching that much fresh memory cost more than augmenting it. Each image's result is
    the same either way. A GPU gets the whole batch in one copy.
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
