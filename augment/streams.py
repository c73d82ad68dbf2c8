"""How --seed becomes every random stream of a run: one function, one hash.

    stream_seed("file_order", seed, epoch)            # a 63-bit seed for that stream
    stream_rng("unit_order", seed, epoch, task)       # numpy's PCG64 seeded with it

Each stream has a name (STREAMS) and is keyed by the integers that tell its draws apart: the
epoch's file order, the read task's order of its units and rows, the trainer's local shuffle,
each rank's own generators, MixUp's per-step draws, jobs.prepare's order of a split. The hash
is SplitMix64's finaliser (mix64), chained over (seed, the stream's number, the parts), the same
function that keys each image's augmentation (augment/rng.py). A different name or a different
part gives an unrelated seed; the same ones give the same seed on every machine and in every
process. tests/test_golden.py keeps the values: changing a stream changes users' results.

Light (no torch): the driver's checks and Ray's data tasks import it.
"""

from __future__ import annotations

M64 = (1 << 64) - 1
C1, C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's multipliers

# every stream of a run, by name; a number is never reused for another stream
STREAMS = {"file_order": 1, "unit_order": 2, "local_shuffle": 3, "rank": 4, "mix": 5, "prepare_order": 6}


def mix64(z: int) -> int:
    """SplitMix64's finaliser on a Python int (mod 2**64)."""
    z &= M64
    z = ((z ^ (z >> 30)) * C1) & M64
    z = ((z ^ (z >> 27)) * C2) & M64
    return z ^ (z >> 31)


def stream_seed(name: str, seed: int, *parts: int) -> int:
    """A seed in [0, 2**63) for stream `name` of --seed `seed`, at `parts` (epoch, task, rank, ...)."""
    z = mix64(mix64(seed) + STREAMS[name])
    for part in parts:
        z = mix64(z + part)
    return z >> 1


def stream_rng(name: str, seed: int, *parts: int):
    """numpy's Generator (PCG64) for stream `name` at `parts`: the same numbers on every machine."""
    import numpy as np

    return np.random.default_rng(stream_seed(name, seed, *parts))
