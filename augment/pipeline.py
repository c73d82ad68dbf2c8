"""A list of op specs as one module, in two phases as Kornia's ops have them:

    pipe = pipeline.at_epoch(epoch)                  # the ops at that epoch's size and strength
    request = pipe.request(sizes, keys, ...)         # every op's draws for the batch, drawn once, and
                                                     # what they ask of a decoder (scales, regions)
    out = pipe.finish(request, images, path=...)     # the images as decoded -> uint8 (B, S, S, 3)

A decoder (augment/batch.py) asks one question per batch, the DecodeRequest, and hands back
what it decoded; the pipeline fits the draws to it and runs the ops: on the CPU a chunk of
images at a time (the caller's chunks, which keep the float intermediates in the caches), on a
GPU the whole batch, through the fused kernel (augment/fused.py) where it covers the first ops,
else the ragged buffer (augment/ragged.py) and the torch ops. Each image's parameters come
from its own key (augment/rng.py), so the result of an image depends only on the seed, the
epoch, its key and its size: drawn for a whole batch or for a chunk of it, they are the same.

The runtime half of a preset (augment/presets.py holds presets as data and loads them).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from augment.errors import PresetError
from augment.fused import FusedPlan, augment_first_ops, fused_prefix, on_device
from augment.geometry import to_canvas
from augment.ops import Op, build_ops, compiled_loops
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
        self.cpu_chunk = max(1, CPU_CHUNK_PIXELS // (self.out_hw[0] * self.out_hw[1]))  # images a CPU chunk
        self.uniforms = {op.stream: op.uniforms for op in ops}  # what sample draws, stream by stream
        # the later ops that sample through the contract (the rest draw from the batch they are given)
        self.sampled = tuple(type(op).forward is Op.forward for op in ops[1:])

    def empty(self, device) -> torch.Tensor:
        return torch.empty((0, *self.out_hw, 3), dtype=torch.uint8, device=device)

    @torch.no_grad()
    def sample(self, sizes: torch.Tensor, keys: torch.Tensor) -> Draws:
        """Every op's parameters for images of `sizes` (full size, e.g. from the file headers)."""
        return self.request(sizes, keys).draws

    @torch.no_grad()
    def request(self, sizes: torch.Tensor, keys: torch.Tensor, *, shrink: bool = False, regions: bool = False):
        """The batch's DecodeRequest: every op's draws for images of `sizes` (full size, from the
        headers), and from the first op's (its `draw`), where asked, the factor each JPEG may be
        decoded smaller by and the region of each image the first op reads."""
        rng = KeyedRng(keys, self.seed, self.epoch, prefetch=self.uniforms)
        first, scales, boxes = self.ops[0].draw(rng, sizes, shrink=shrink, regions=regions)
        rest = tuple(op.sample(rng, None) if own else None for op, own in zip(self.ops[1:], self.sampled, strict=True))
        return DecodeRequest(Draws(keys, first, rest), sizes, scales, boxes)

    @torch.no_grad()
    def finish(self, request: "DecodeRequest", images, *, path: str, cropped=None, out=None) -> torch.Tensor:
        """The request's images as decoded (uint8 (H, W, 3)-shaped: numpy arrays, or tensors of any
        strides, or one (B, H, W, 3) array) -> uint8 (B, S, S, 3), in `out` if given. `cropped`:
        per image whether it was decoded as its request's region. `path` (PATHS): the CPU's
        per-image first op; the GPU's ragged buffer; the fused kernel (augment/fused.py)."""
        device = request.sizes.device
        decoded = torch.tensor([im.shape[:2] for im in images], dtype=torch.int64).view(-1, 2).to(device)
        # the first op's draws for the images as decoded (GeometryOp.fit): the rest stay as drawn
        first = self.ops[0].fit(request, decoded, cropped, seed=self.seed, epoch=self.epoch)
        draws = request.draws.with_first(first)
        if path == "fused":
            return self._fused(images, decoded, draws, out)
        return self.apply(self._first_input(images, path, device), decoded, draws, out)

    def _first_input(self, images, path: str, device):
        """The decoded images as the first op takes them on `path` (see finish)."""
        if path == "ragged":  # every image as it was decoded, in one buffer: no canvas (augment/ragged.py)
            return RaggedImages.from_images(list(images), device)
        if path == "cpu" and not (isinstance(images, np.ndarray) and images.ndim == 4):
            return [torch.as_tensor(a) for a in images]  # ragged: the first op makes a canvas only where it needs one
        canvas, _ = to_canvas(images)
        return canvas.to(device)

    def _fused(self, images, decoded: torch.Tensor, draws: Draws, out) -> torch.Tensor:
        """The fused kernel for the first op and the flip and jitter after it, then the ops it does
        not cover on its float output as apply runs them."""
        n = fused_prefix(self.ops)
        plan = FusedPlan.of(self.ops[:n], draws.first, draws.rest[: n - 1], decoded)
        views = on_device(images, decoded.device)
        later = list(zip(self.ops[n:], draws.rest[n - 1 :], strict=True))
        x = augment_first_ops(views, plan.meta, plan.factors, *self.out_hw, plan.fill, bool(later))
        if later:
            x = self._later(x, draws, later)
            return to_uint8_nhwc(x, out)
        return x if out is None else out.copy_(x)

    @torch.no_grad()
    def apply(self, first_input, sizes: torch.Tensor, draws: Draws, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ops on the first op's input (a uint8 (B, Hmax, Wmax, 3) canvas, a RaggedImages, or
        on the CPU a list of (H, W, 3) images); sizes int64 (B, 2) of the images in it -> uint8
        (B, S, S, 3), in `out` if given (a contiguous uint8 (B, S, S, 3) on the CPU: the rows of a
        larger batch). Whole batches: the CPU's callers hand it a chunk at a time (batch.py)."""
        x = self.ops[0].apply(first_input, draws.first, sizes)  # float (B, 3, S, S)
        # planar on the CPU: the pixel ops' loops are faster on it there (docs/design.md,
        # "Choices and where they were measured"); the GPU's ragged path stays as on a GPU
        if x.device.type == "cpu" and not isinstance(first_input, RaggedImages):
            x = x.contiguous()
        x = self._later(x, draws, list(zip(self.ops[1:], draws.rest, strict=True)))
        return to_uint8_nhwc(x, out).contiguous()

    def _later(self, x: torch.Tensor, draws: Draws, ops) -> torch.Tensor:
        """The ops after the first on the float batch, each with its draws (None: it draws itself)."""
        rng = KeyedRng(draws.keys, self.seed, self.epoch)
        for op, params in ops:
            # x is the pipeline's own: each op may overwrite it (apply_)
            x = op(x, rng) if params is None else op.apply_(x, params)
        return x

    def forward(self, canvas: torch.Tensor, sizes: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """sample, then apply: canvas uint8 (B, Hmax, Wmax, 3); sizes int64 (B, 2); keys int64 (B,)."""
        return self.apply(canvas, sizes, self.sample(sizes, keys))


PATHS = ("cpu", "ragged", "fused")  # EpochPipeline.finish's ways to the first op


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """The one question a batch's decoder asks the pipeline, answered from the draws: per image its
    header's (h, w), the factor its JPEG may be decoded smaller by (`scales`, the CPU's scaled
    IDCT; None: full size) and the box of it the first op reads (`regions`, top, left, h, w, which
    nvImageCodec decodes alone; None: whole images)."""

    draws: Draws
    sizes: torch.Tensor
    scales: torch.Tensor | None = None
    regions: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.sizes)

    def take(self, sel) -> "DecodeRequest":
        """The request for the rows `sel` (a slice, a list or an index tensor: a chunk, or the
        images that decoded)."""
        if isinstance(sel, slice):
            if (sel.start or 0) == 0 and sel.stop >= len(self):
                return self  # the whole batch: nothing to index (a GPU's batch, whole)
            sel = torch.arange(sel.start or 0, sel.stop, device=self.sizes.device)
        elif list(sel) == list(range(len(self))):
            return self  # every image decoded
        sel = torch.as_tensor(sel, dtype=torch.int64, device=self.sizes.device)
        pick = [None if v is None else v[sel] for v in (self.scales, self.regions)]
        return DecodeRequest(self.draws.take(sel), self.sizes[sel], *pick)


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
        self.current: EpochPipeline | None = None  # the last epoch's, kept: an epoch's batches share it
        self.at_epoch(0)  # every op built once now: a spec that does not build fails here

    def to(self, device) -> "Pipeline":
        """Every epoch's ops on `device`."""
        self.device = torch.device(device)
        self._ops = {key: ops.to(self.device) for key, ops in self._ops.items()}
        self.current = None
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
        """The ops at the epoch's size and strength (built once for each such pair), keyed on `epoch`:
        made at the epoch's first batch and kept for the rest (the schedules are read once an epoch)."""
        if self.current is not None and self.current.epoch == epoch:
            return self.current
        first, s = self._first_spec(epoch), strength(self.schedule, epoch, self.epochs)
        key = (self.size_at(epoch), s)
        if key not in self._ops:
            ops = build_ops((first, *self.specs[1:]))
            for op in ops if s != 1.0 else ():
                op.set_strength(s)
            self._ops[key] = torch.nn.ModuleList(ops).to(self.device)
        self.current = EpochPipeline(self._ops[key], seed=self.seed, epoch=epoch)
        return self.current

    def __call__(self, canvas: torch.Tensor, sizes: torch.Tensor, keys: torch.Tensor, epoch: int) -> torch.Tensor:
        """at_epoch(epoch), then sample and apply."""
        return self.at_epoch(epoch)(canvas, sizes, keys)


def check_sides(preset, train_sides) -> None:
    """Builds a preset's pipelines at every side a run uses (each of `train_sides`, and the eval
    size), so that an op that does not fit one of them (a Kornia kernel larger than the image) is
    a PresetError now, not a failed task later."""
    full = preset.train_size
    for side in sorted(set(train_sides)):
        first = preset.train[0] if side == full else scale_geometry(preset.train[0], side, full)
        try:
            Pipeline((first, *preset.train[1:]), seed=0)
        except PresetError as e:
            raise PresetError(f"its train ops at {side} px: {e}") from None
    try:
        Pipeline(preset.eval, seed=0)
    except PresetError as e:
        raise PresetError(f"its eval ops at {preset.image_size} px: {e}") from None


def to_uint8_nhwc(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float (B, 3, H, W) in [0, 1] -> uint8 (B, H, W, 3), rounded (half to even), into `out` if
    given. On the CPU (planar float32 x) one compiled loop writes the bytes
    (augment/cpu_kernels.py, where numba is installed); on a GPU x is channels_last and the
    permute already contiguous."""
    loops = compiled_loops() if x.device.type == "cpu" else None
    done = None if loops is None else loops.to_uint8_nhwc(x, out)  # None: not a batch the loops take
    if done is not None:
        return done
    y = x.mul(255.0).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    return y if out is None else out.copy_(y)
