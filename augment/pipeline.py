"""A list of op specs as one module: canvas + keys in, uint8 (B, S, S, 3) out, the same
on the CPU (a chunk of images at a time) and on a GPU (the whole batch). Each image's
parameters come from its own key (augment/rng.py), so the result of an image depends only
on the seed, the epoch, its key and its size.

The runtime half of a preset (augment/presets.py holds presets as data and loads them).
"""

from __future__ import annotations

import numpy as np
import torch

from augment.errors import PresetError
from augment.kornia_ops import is_kornia
from augment.ops import OPS, KorniaOp, Op
from augment.presets import scale_geometry, spec_side
from augment.rng import KeyedRng
from augment.schedule import parse_resize, parse_schedule, resize_side, strength

# CPU only: the ops run on chunks of about this many output pixels at a time, so that the
# float intermediates (12 bytes a pixel) stay in the L2/L3 caches (docs/design.md, "Choices
# and where they were measured"). Each image's result is the same either way (its
# parameters come from its own key); the GPU takes the whole batch at once.
CPU_CHUNK_PIXELS = 4 * 224 * 224


class Pipeline(torch.nn.Module):
    """One module for a list of op specs: canvas + keys in, uint8 (B, S, S, 3) out.

    `schedule` (augment/schedule.py) scales the ops' magnitudes by epoch out of `epochs`;
    `resize` (progressive resizing, same module) sets the first op's output side by epoch,
    from a lower one up to the side the specs give.
    """

    def __init__(self, specs, *, seed: int, schedule: str = "none", epochs: int = 1, resize: str = "none"):
        super().__init__()
        self.seed = seed
        try:
            parse_schedule(schedule)
            parse_resize(resize)
        except ValueError as e:
            raise PresetError(str(e)) from None
        self.schedule, self.epochs, self._strength = schedule, int(epochs), 1.0
        self.specs, self.resize, self.full_side = tuple(specs), resize, spec_side(specs[0])
        ops = []
        for stream, spec in enumerate(self.specs, start=1):
            ops.append(self._build(stream, spec, size=ops[0].size if ops else None))
        self.ops = torch.nn.ModuleList(ops)
        self.out_hw = self.ops[0].size

    @property
    def cpu_chunk(self) -> int:
        """Images per chunk on the CPU (see CPU_CHUNK_PIXELS)."""
        return max(1, CPU_CHUNK_PIXELS // (self.out_hw[0] * self.out_hw[1]))

    @staticmethod
    def _build(stream: int, spec: dict, size=None):
        """One op; `size`: the batch's (H, W) after the first op, which a Kornia op is tried on."""
        ((name, params),) = spec.items()
        try:
            op = KorniaOp(name, params, size=size) if is_kornia(name) else OPS[name](**params)
        except (TypeError, ValueError) as e:
            raise PresetError(f"[{stream - 1}]: {e}") from None
        op.stream = stream  # the op's own random stream: its position in the list
        return op

    def _first_spec(self, epoch: int) -> dict:
        side = resize_side(self.resize, epoch, self.epochs, self.full_side)
        return self.specs[0] if side == self.full_side else scale_geometry(self.specs[0], side, self.full_side)

    def size_at(self, epoch: int) -> tuple[int, int]:
        """(h, w) of the batches this pipeline makes for `epoch`."""
        (params,) = self._first_spec(epoch).values()
        size = params["size"]
        return (int(size), int(size)) if isinstance(size, (int, float)) else (int(size[0]), int(size[1]))

    def _set_epoch(self, epoch: int) -> None:
        """The first op at the epoch's size, every op at the epoch's strength."""
        if self.size_at(epoch) != tuple(self.out_hw):
            self.ops[0] = self._build(1, self._first_spec(epoch))  # geometry ops hold no tensors to move
            self.ops[0].set_strength(self._strength)  # where the other ops are; the new one starts as written
            self.out_hw = self.ops[0].size
        s = strength(self.schedule, epoch, self.epochs)
        if s != self._strength:
            for op in self.ops:
                op.set_strength(s)
            self._strength = s

    @torch.no_grad()
    def geometry(self, sizes: torch.Tensor, keys: torch.Tensor, epoch: int) -> dict:
        """The first (geometry) op's parameters for images of `sizes` (their full size, e.g.
        from the file headers): what `augment` applies, and what tells a decoder how far it may
        shrink each image (the op's max_shrink)."""
        self._set_epoch(epoch)
        return self.ops[0].sample(KeyedRng(keys, self.seed, epoch), sizes)

    @torch.no_grad()
    def draw_rest(self, keys: torch.Tensor, epoch: int) -> list[dict]:
        """The parameters of every op after the first, for a whole batch at once: `augment`
        then applies them a chunk at a time. Each image's come from its own key, so they are
        those a chunk would draw; drawing once saves the per-call cost of many small tensor
        ops in every chunk (docs/benchmark-log.md, "Ingest"). An op with a `forward` of its own
        (one that samples from the batch it is given) gets None and draws in each chunk."""
        self._set_epoch(epoch)
        rng = KeyedRng(keys, self.seed, epoch)
        return [op.sample(rng, None) if type(op).forward is Op.forward else None for op in self.ops[1:]]

    @torch.no_grad()
    def augment(self, canvas, sizes, keys, epoch: int, geometry: dict, rest: list[dict] | None = None) -> torch.Tensor:
        """`forward` for one chunk whose geometry parameters are given (by `geometry`, then
        perhaps the op's shrink_params for images decoded at a reduced size), and perhaps the
        other ops' too (`draw_rest`'s rows for the chunk): uint8 (B, S, S, 3)."""
        self._set_epoch(epoch)
        return self._run(canvas, sizes, keys, epoch, geometry, rest).contiguous()

    def _run(self, canvas, sizes, keys, epoch, geometry=None, rest=None) -> torch.Tensor:
        rng = KeyedRng(keys, self.seed, epoch)
        first = self.ops[0]
        x = first(canvas, rng, sizes) if geometry is None else first.apply(canvas, geometry, sizes)  # (B, 3, S, S)
        # planar on the CPU: the pixel ops' broadcasts are faster on it there (docs/design.md,
        # "Choices and where they were measured")
        if x.device.type == "cpu":
            x = x.contiguous()
        for i, op in enumerate(self.ops[1:]):
            x = op(x, rng) if rest is None or rest[i] is None else op.apply(x, rest[i])
        return _to_uint8_nhwc(x)

    @torch.no_grad()
    def forward(self, canvas: torch.Tensor, sizes: torch.Tensor, keys: torch.Tensor, epoch: int) -> torch.Tensor:
        """canvas: uint8 (B, Hmax, Wmax, 3); sizes: int64 (B, 2); keys: int64 (B,)."""
        self._set_epoch(epoch)
        if canvas.device.type != "cpu":
            return self._run(canvas, sizes, keys, epoch).contiguous()
        b, (oh, ow), chunk = canvas.shape[0], self.out_hw, self.cpu_chunk
        out = torch.empty((b, oh, ow, 3), dtype=torch.uint8)
        for i in range(0, b, chunk):
            out[i : i + chunk] = self._run(canvas[i : i + chunk], sizes[i : i + chunk], keys[i : i + chunk], epoch)
        return out


def _to_uint8_nhwc(x: torch.Tensor) -> torch.Tensor:
    """float (B, 3, H, W) in [0, 1] -> uint8 (B, H, W, 3), rounded. On a GPU x is channels_last
    and the permute already contiguous. On the CPU (planar x) the values go into a float NHWC
    buffer and numpy casts them: torch's float-to-uint8 cast and its uint8 transpose are slower
    there, for the same bytes (docs/design.md, "Choices and where they were measured")."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad:
        return x.mul(255.0).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    b, c, h, w = x.shape
    nhwc = torch.empty((b, h, w, c), dtype=x.dtype)
    torch.mul(x, 255.0, out=nhwc.permute(0, 3, 1, 2)).round_().clamp_(0, 255)
    return torch.from_numpy(nhwc.numpy().astype(np.uint8))
