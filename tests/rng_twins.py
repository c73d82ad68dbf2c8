"""Pure-Python twins of augment/rng.py's KeyedRng, written from its contract (SplitMix64's
finaliser over key + salt(seed, epoch, stream) + i * golden), for the tests to hold it to."""

from __future__ import annotations

from augment.rng import mix64, salt

GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment, as augment/rng.py has it


def reference_uniform(key: int, seed: int, epoch: int, stream: int, i: int) -> float:
    """KeyedRng.uniform(stream)[row with `key`, i]."""
    z = mix64(key + salt(seed, epoch, stream) + i * GOLDEN)
    return (z >> 40) / (1 << 24)


def reference_seed(key: int, seed: int, epoch: int, stream: int, i: int) -> int:
    """KeyedRng.seeds(stream)[row with `key`, i]."""
    return mix64(mix64(key + salt(seed, epoch, stream) + i * GOLDEN)) >> 1
