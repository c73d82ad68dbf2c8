"""A list of op specs as one module, in two phases as Kornia's ops have them:

    pipe = pipeline.at_epoch(epoch)        # the ops at that epoch's size and strength
    draws = pipe.sample(sizes, keys)        # every op's parameters for the batch, drawn once
    out = pipe.apply(canvas, sizes, draws)  # uint8 (B, S, S, 3); CPU chunks inside

The same on the CPU (a chunk of images at a time, which keeps the float intermediates in
the caches) and on a GPU (the whole batch). Each image's parameters come from its own key
(augment/rng.py), so the result of an image depends only on the seed, the epoch, its key
and its size: drawn for a whole batch or for a chunk of it, they are the same.

The runtime half of a preset (augment/presets.py holds presets as data and loads them).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import torch

from augment.errors import PresetError
from augment.kornia_ops import is_kornia
from augment.ops import OPS, KorniaOp, Op, compiled_loops
from augment.presets import scale_geometry, spec_side
from augment.ragged import RaggedImages
from augment.rng import KeyedRng
from augment.schedule import parse_resize, parse_schedule, resize_side, strength

# CPU only: the ops run on chunks of about this many output pixels at a time, so that the
# float intermediates (12 bytes a pixel) stay in the L2/L3 caches (docs/design.md, "Choices
# and where they were measured"). Each image's result is the same either way (its
# parameters come from its own key); the GPU takes the whole batch at once.
CPU_CHUNK_PIXELS = 4 * 224 * 224


def rows(params: dict, sel: torch.Tensor, n: int) -> dict:
    """The per-image entries of `params` (drawn for n images) for the rows `sel`; entries that
    are not per image stay as they are."""
    return {k: v[sel] if isinstance(v, torch.Tensor) and v.dim() and len(v) == n else v for k, v in params.items()}


@dataclasses.dataclass(frozen=True)
class Draws:
    """Every op's parameters for a batch: `first` the geometry op's (for the images' full
    sizes), `rest` each later op's in order (None for an op that draws from the batch it is
    given, as RandomErasing does), all from `keys`."""

    keys: torch.Tensor
    first: dict
    rest: tuple

    def take(self, sel: torch.Tensor) -> "Draws":
        """The draws of the rows `sel` (a chunk, or the images that decoded)."""
        n = len(self.keys)
        rest = tuple(r if r is None else rows(r, sel, n) for r in self.rest)
        return Draws(self.keys[sel], rows(self.first, sel, n), rest)

    def with_first(self, first: dict) -> "Draws":
        return dataclasses.replace(self, first=first)


class EpochPipeline(torch.nn.Module):
    """The pipeline of one epoch: ops built at that epoch's size and strength, which nothing
    changes afterwards (Pipeline.at_epoch makes them once and shares them between the epochs
    that have the same size and strength), and the epoch the draws are keyed on."""

    def __init__(self, ops: torch.nn.ModuleList, *, seed: int, epoch: int):
        super().__init__()
        self.ops, self.seed, self.epoch = ops, seed, epoch
        self.out_hw = tuple(ops[0].size)

    @property
    def cpu_chunk(self) -> int:
        """Images per chunk on the CPU (see CPU_CHUNK_PIXELS)."""
        return max(1, CPU_CHUNK_PIXELS // (self.out_hw[0] * self.out_hw[1]))

    def chunks(self, n: int) -> list[slice]:
        """The CPU's chunks of a batch of n images (see CPU_CHUNK_PIXELS)."""
        return [slice(i, min(n, i + self.cpu_chunk)) for i in range(0, n, self.cpu_chunk)]

    @property
    def takes_image_list(self) -> bool:
        """On the CPU, `apply` may take a list of (H, W, 3) uint8 images in place of a canvas:
        the first op resamples each image on its own, so no copy into a canvas is needed."""
        first = self.ops[0]
        return first.takes_image_list and getattr(first, "method", "auto") != "matmul"

    def empty(self, device) -> torch.Tensor:
        return torch.empty((0, *self.out_hw, 3), dtype=torch.uint8, device=device)

    @torch.no_grad()
    def sample(self, sizes: torch.Tensor, keys: torch.Tensor) -> Draws:
        """Every op's parameters for images of `sizes` (full size, e.g. from the file headers)."""
        rng = KeyedRng(keys, self.seed, self.epoch)
        rest = tuple(op.sample(rng, None) if type(op).forward is Op.forward else None for op in self.ops[1:])
        return Draws(keys, self.ops[0].sample(rng, sizes), rest)

    def decode_scales(self, draws: Draws) -> torch.Tensor:
        """Per image, the factor (augment.decode.SHRINK_FACTORS) by which a decoder may shrink it
        and lose nothing of the output's resolution: 1 where the first op needs it whole."""
        factors = self.ops[0].max_shrink(draws.first)
        return torch.ones(len(draws.keys), dtype=torch.int64, device=draws.keys.device) if factors is None else factors

    def read_regions(self, draws: Draws) -> torch.Tensor | None:
        """Per image, the box (top, left, h, w) of the full-size image that the first op reads
        (a decoder may decode just that: augment/engines.py); None: it reads whole images."""
        return self.ops[0].region(draws.first)

    def in_regions(self, draws: Draws, regions: torch.Tensor, inside: torch.Tensor) -> Draws:
        """The draws for images of which only `regions` were decoded, where `inside`."""
        return draws.with_first(self.ops[0].in_region(draws.first, regions, inside))

    def fit_to_decoded(self, draws: Draws, sizes, decoded, factors) -> Draws:
        """The draws for the images as they were decoded (`sizes` the headers', `decoded` the
        decoded ones'). An image that came back at 1/f of its size gets its box rescaled; one at
        full size (a format without reduced decoding) keeps its parameters; one whose size
        matches neither (a header that lied) gets parameters drawn for the size it has, so no
        crop ever reaches outside an image."""
        scaled = -torch.div(-sizes, factors[:, None], rounding_mode="floor")  # ceil(size / f)
        full = (decoded == sizes).all(1)
        shrunk = (decoded == scaled).all(1) & (factors > 1)
        first = draws.first
        if not bool((full | shrunk).all()):  # host sync, once a chunk
            redrawn = self.ops[0].sample(KeyedRng(draws.keys, self.seed, self.epoch), decoded)
            first = {k: _where(full | shrunk, v, redrawn[k]) for k, v in first.items()}
        if bool(shrunk.any()):
            first = self.ops[0].shrink_params(first, torch.where(shrunk, factors, 1))
        return draws.with_first(first)

    @torch.no_grad()
    def apply(self, canvas, sizes: torch.Tensor, draws: Draws, out: torch.Tensor | None = None) -> torch.Tensor:
        """canvas: uint8 (B, Hmax, Wmax, 3), a RaggedImages (augment/ragged.py: the GPU's), or
        a list of HWC images where takes_image_list;
        sizes: int64 (B, 2) of the images in it -> uint8 (B, S, S, 3), in `out` if given (a
        contiguous uint8 (B, S, S, 3) on the CPU: the rows of a larger batch). A canvas on the
        CPU goes through a chunk of images at a time."""
        b = len(canvas)
        if not isinstance(canvas, torch.Tensor) or canvas.device.type != "cpu" or b <= self.cpu_chunk:
            return self._apply(canvas, sizes, draws, out).contiguous()
        out = torch.empty((b, *self.out_hw, 3), dtype=torch.uint8) if out is None else out
        for c in self.chunks(b):
            self._apply(canvas[c], sizes[c], draws.take(torch.arange(c.start, c.stop)), out[c])
        return out

    def _apply(self, canvas, sizes, draws: Draws, out: torch.Tensor | None) -> torch.Tensor:
        rng = KeyedRng(draws.keys, self.seed, self.epoch)
        x = self.ops[0].apply(canvas, draws.first, sizes)  # float (B, 3, S, S)
        # planar on the CPU: the pixel ops' loops are faster on it there (docs/design.md,
        # "Choices and where they were measured"); the GPU's ragged path stays as on a GPU
        if x.device.type == "cpu" and not isinstance(canvas, RaggedImages):
            x = x.contiguous()
        for op, params in zip(self.ops[1:], draws.rest, strict=True):
            # x is the pipeline's own: each op may overwrite it (apply_)
            x = op(x, rng) if params is None else op.apply_(x, params)
        return to_uint8_nhwc(x, out)

    @torch.no_grad()
    def augment_images(self, images, keys: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Decoded images (a uint8 (B, H, W, 3) array or a ragged object array) -> uint8
        (B, S, S, 3) on `device`. On the CPU a ragged batch goes to canvases a chunk at a time:
        one canvas for a whole batch of photos holds Hmax x Wmax per image, and touching that
        much fresh memory cost more than augmenting it (docs/design.md, "Choices and where
        they were measured"). A GPU gets a ragged batch in one buffer and one copy, without a
        canvas (augment/ragged.py)."""
        fixed = isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.ndim == 4
        if device.type == "cpu" and not fixed:
            return torch.cat([self(*to_canvas(images[c]), keys[c]) for c in self.chunks(len(images))])
        if fixed or device.type == "cpu":
            canvas, sizes = to_canvas(images)
            if device.type == "cuda":  # uint8 over PCIe: a quarter of the bytes of float32
                canvas = canvas.pin_memory().to(device, non_blocking=True)
            return self(canvas, sizes.to(device), keys.to(device))
        batch = RaggedImages.from_images(list(images), device)  # one upload, no canvas (augment/ragged.py)
        return self(batch, batch.sizes, keys.to(device))

    def forward(self, canvas: torch.Tensor, sizes: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """sample, then apply: canvas uint8 (B, Hmax, Wmax, 3); sizes int64 (B, 2); keys int64 (B,)."""
        return self.apply(canvas, sizes, self.sample(sizes, keys))


class Pipeline:
    """A list of op specs, made into each epoch's EpochPipeline on demand (at_epoch).

    `schedule` (augment/schedule.py) scales the ops' magnitudes by epoch out of `epochs`;
    `resize` (progressive resizing, same module) sets the first op's output side by epoch,
    from a lower one up to the side the specs give. Building checks every op (PresetError).
    """

    def __init__(self, specs, *, seed: int, schedule: str = "none", epochs: int = 1, resize: str = "none"):
        self.seed = seed
        try:
            parse_schedule(schedule)
            parse_resize(resize)
        except ValueError as e:
            raise PresetError(str(e)) from None
        self.schedule, self.epochs = schedule, int(epochs)
        self.specs, self.resize, self.full_side = tuple(specs), resize, spec_side(specs[0])
        self.device = torch.device("cpu")
        self._ops: dict[tuple, torch.nn.ModuleList] = {}  # (size, strength) -> the ops built for them
        self.at_epoch(0)  # every op built once now: a spec that does not build fails here

    def to(self, device) -> "Pipeline":
        """Every epoch's ops on `device`."""
        self.device = torch.device(device)
        self._ops = {key: ops.to(self.device) for key, ops in self._ops.items()}
        return self

    def _first_spec(self, epoch: int) -> dict:
        side = resize_side(self.resize, epoch, self.epochs, self.full_side)
        return self.specs[0] if side == self.full_side else scale_geometry(self.specs[0], side, self.full_side)

    def size_at(self, epoch: int) -> tuple[int, int]:
        """(h, w) of the batches this pipeline makes for `epoch`."""
        (params,) = self._first_spec(epoch).values()
        size = params["size"]
        return (int(size), int(size)) if isinstance(size, (int, float)) else (int(size[0]), int(size[1]))

    def at_epoch(self, epoch: int) -> EpochPipeline:
        """The ops at the epoch's size and strength (built once for each such pair), keyed on `epoch`."""
        first, s = self._first_spec(epoch), strength(self.schedule, epoch, self.epochs)
        key = (self.size_at(epoch), s)
        if key not in self._ops:
            ops = []
            for stream, spec in enumerate((first, *self.specs[1:]), start=1):
                ops.append(_build(stream, spec, size=ops[0].size if ops else None))
            for op in ops if s != 1.0 else ():
                op.set_strength(s)
            self._ops[key] = torch.nn.ModuleList(ops).to(self.device)
        return EpochPipeline(self._ops[key], seed=self.seed, epoch=epoch)

    def __call__(self, canvas: torch.Tensor, sizes: torch.Tensor, keys: torch.Tensor, epoch: int) -> torch.Tensor:
        """at_epoch(epoch), then sample and apply."""
        return self.at_epoch(epoch)(canvas, sizes, keys)


def _build(stream: int, spec: dict, size=None) -> Op:
    """One op; `size`: the batch's (H, W) after the first op, which a Kornia op is tried on."""
    ((name, params),) = spec.items()
    try:
        op = KorniaOp(name, params, size=size) if is_kornia(name) else OPS[name](**params)
    except (TypeError, ValueError) as e:
        raise PresetError(f"[{stream - 1}]: {e}") from None
    op.stream = stream  # the op's own random stream: its position in the list
    return op


def _where(mask, a, b):
    if not isinstance(a, torch.Tensor) or not a.dim():
        return a
    return torch.where(mask.view(-1, *[1] * (a.dim() - 1)), a, b)


def to_canvas(images) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded images -> (uint8 canvas (B, Hmax, Wmax, 3), int64 sizes (B, 2)).

    A fixed-shape batch is used as it is (no copy); a ragged one (an object array of HWC
    arrays) is copied into the top-left corners of a canvas. The rest of the canvas is left
    uninitialised: no op reads outside an image's size (crops mask, resampling weights
    are zero there), and zero-filling it would cost as much as the copy (docs/design.md,
    "Choices and where they were measured").
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


def to_uint8_nhwc(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float (B, 3, H, W) in [0, 1] -> uint8 (B, H, W, 3), rounded (half to even), into `out` if
    given. On the CPU (planar float32 x) one compiled loop writes the bytes
    (augment/cpu_kernels.py, where numba is installed); on a GPU x is channels_last and the
    permute already contiguous."""
    loops = compiled_loops() if x.device.type == "cpu" else None
    if loops is not None and loops.takes(x):
        return loops.to_uint8_nhwc(x, out)
    y = x.mul(255.0).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    return y if out is None else out.copy_(y)
