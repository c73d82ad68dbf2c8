"""The base of every augmentation op: the Op contract (sample, then apply; apply_ in place), the
registry of ops by name (OPS, register), and small helpers the ops share. augment/geometry.py
holds the geometry ops, augment/ops.py the pixel ops (and imports the geometry ops, so that
OPS, taken from there, names them all)."""

from __future__ import annotations

import functools

import torch

from augment.rng import KeyedRng

OPS: dict[str, type["Op"]] = {}


@functools.cache
def compiled_loops():
    """The CPU path's compiled loops (augment/cpu_kernels.py), imported on first use; None where
    numba is missing (an environment assembled by hand): the torch ops then run on the CPU too."""
    try:
        from augment import cpu_kernels
    except ImportError:
        return None
    return cpu_kernels


def register(cls):
    OPS[cls.name] = cls
    return cls


class Op(torch.nn.Module):
    name = ""
    geometry = False  # True: a GeometryOp (augment/geometry.py): decoded images in, uniform float batch out
    uniforms = 0  # uniforms sample draws per image, where it is known (KeyedRng.prefetch draws them at once)
    scalable: tuple[str, ...] = ()  # parameters that a strength schedule may scale
    # geometry ops: lengths in px besides `size` that scale with it (--image-size, progressive resizing)
    lengths: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.stream = 0  # set by the pipeline: the op's own random stream
        self._base: dict | None = None  # the preset's magnitudes, before any strength scaling

    def set_strength(self, s: float) -> None:
        """Scale the magnitudes in `scalable` by s in [0, 1] (1 = as the preset wrote them)."""
        if self._base is None:
            self._base = {k: getattr(self, k) for k in self.scalable}
        for k, v in self._base.items():
            setattr(self, k, tuple(e * s for e in v) if isinstance(v, tuple) else v * s)

    def sample(self, rng: KeyedRng, sizes: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def apply(self, x, params, sizes=None):
        raise NotImplementedError

    def apply_(self, x, params, sizes=None):
        """`apply`, free to overwrite x: the pipeline hands each op after the first its own
        intermediate batch, which nothing else holds. Ops that can work in place on the CPU do."""
        return self.apply(x, params, sizes)

    def forward(self, x, rng: KeyedRng, sizes: torch.Tensor | None = None):
        return self.apply(x, self.sample(rng, sizes), sizes)


@functools.cache
def constant(values, device) -> torch.Tensor:
    """A small constant tensor on `device`, made once (a fresh one would be an upload on a GPU at
    every batch). Never written to: hand out expanded views, or compute from it."""
    return torch.tensor(values, device=device)


def as_pair(size) -> tuple[int, int]:
    return (int(size), int(size)) if isinstance(size, (int, float)) else (int(size[0]), int(size[1]))
