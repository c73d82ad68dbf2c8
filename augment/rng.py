"""Counter-based random numbers: one stream per image, keyed by (seed, epoch, op, image key).

Why not a torch.Generator per batch: a batch's composition depends on how Ray Data
bundles blocks, and which actor runs it depends on scheduling. Drawing every image's
parameters from a hash of (seed, epoch, stream, the image's own key) makes an image's
augmentation independent of its batch, its actor and the order of execution, and still
costs only a few vectorised integer ops for the whole batch, on any device.

The mixer is SplitMix64's finaliser on int64 tensors (multiplication wraps modulo 2**64
on CPU and CUDA); tests/rng_twins.py has the same functions in pure Python.
"""

from __future__ import annotations

import functools

import torch

from augment.streams import C1, C2, M64, mix64

_GOLDEN = 0x9E3779B97F4A7C15


def _signed(v: int) -> int:
    v &= M64
    return v - (1 << 64) if v >= 1 << 63 else v


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _signed(C1)
    z = (z ^ _srl(z, 27)) * _signed(C2)
    return z ^ _srl(z, 31)


@functools.lru_cache(maxsize=4096)
def salt(seed: int, epoch: int, stream: int) -> int:
    """A 64-bit value that differs for every (seed, epoch, stream); computed once an epoch for
    each stream (the cache), not once a batch."""
    return mix64(mix64(mix64(seed) + epoch) + stream)


class KeyedRng:
    """Uniform draws for a batch of images, each from its own key.

    `keys` is the int64 key column of the batch (a stable hash of each file's path).
    `uniform(stream, n)` returns an (B, n) float tensor in [0, 1); different streams give
    independent numbers, the same stream always the same numbers.
    """

    def __init__(self, keys: torch.Tensor, seed: int, epoch: int, *, prefetch: dict[int, int] | None = None):
        self.keys = keys.to(torch.int64)
        self.seed = seed
        self.epoch = epoch
        self.drawn: dict[int, torch.Tensor] = {}  # stream -> its draws, from prefetch
        if prefetch:
            self.prefetch(prefetch)

    def prefetch(self, counts: dict[int, int]) -> None:
        """Draw `counts[stream]` uniforms of every stream at once, in one pass of the mixer over
        the batch (the same numbers as uniform's, stream by stream): a handful of operations for
        a whole pipeline's draws instead of as many for each of its ops."""
        counts = {s: n for s, n in counts.items() if n > 0}
        if not counts:
            return
        offsets = [_signed(salt(self.seed, self.epoch, s) + i * _GOLDEN) for s, n in counts.items() for i in range(n)]
        z = _mix(self.keys[:, None] + torch.tensor(offsets, dtype=torch.int64, device=self.keys.device)[None, :])
        u = _srl(z, 40).to(torch.float32) * (1.0 / (1 << 24))
        start = 0
        for s, n in counts.items():
            self.drawn[s], start = u[:, start : start + n], start + n

    def uniform(self, stream: int, n: int = 1) -> torch.Tensor:
        if stream in self.drawn and self.drawn[stream].shape[1] >= n:
            return self.drawn[stream][:, :n]
        base = _signed(salt(self.seed, self.epoch, stream))
        counters = torch.arange(n, device=self.keys.device, dtype=torch.int64) * _signed(_GOLDEN)
        z = _mix(self.keys[:, None] + base + counters[None, :])
        return _srl(z, 40).to(torch.float32) * (1.0 / (1 << 24))

    def seeds(self, stream: int, n: int = 1) -> torch.Tensor:
        """(B, n) int64 seeds in [0, 2**63), one row per image, for code that draws from torch's
        RNG (Kornia's samplers): a second round of the mixer, so they are independent of
        `uniform(stream, n)`."""
        base = _signed(salt(self.seed, self.epoch, stream))
        counters = torch.arange(n, device=self.keys.device, dtype=torch.int64) * _signed(_GOLDEN)
        return _srl(_mix(_mix(self.keys[:, None] + base + counters[None, :])), 1)
