"""What each epoch trained on: every rank's record of its shard (how many rows, which images
by the sum of their keys, a digest of the augmented views it saw, its random stream's
digest), and the driver's verdicts on the records of all ranks: `coverage` (every good image
exactly once?) and `fingerprints` (the same views in two runs, other views in two epochs).
Sums are kept modulo KEY_MOD, so int64 arithmetic never overflows."""

from __future__ import annotations

import functools

import numpy as np
import torch

from training.forms.data import ImageTree
from training.records import ShardRecord


def good_images(split, bad: dict[str, str]) -> np.ndarray:
    """The keys of the split's images that are not among the `bad` files ({path: reason})."""
    bad_rel = [p[len(split.root) + 1 :] for p in bad if p.startswith(split.root + "/")]
    return split.keys[~np.isin(split.rel_paths, bad_rel)] if bad_rel else split.keys


def coverage(seen_per_epoch: list[list[ShardRecord]], tree: ImageTree, bad: dict[str, str]) -> list[dict]:
    """Per epoch: did the ranks together train on every good image exactly once?

    Each rank reports the rows it trained on, how many distinct images they were, and the
    sum of those images' keys (mod KEY_MOD). `exactly_once`: as many rows as images, all
    distinct, and the key sums agree. `every_image`: each image at least once (repeats
    aside). An equal split may drop up to world_size - 1 rows: `as_expected` is True when
    the epoch was exactly once or lost only such rows (a single one is checked to be an
    image of the split by its key), None when several were dropped (the sum cannot tell
    which), False otherwise (a restarted augment actor can redeliver a batch). `lost`: the
    training images of the data that could not be used, all listed in bad_files.csv: the
    split's files that did not read or decode, and the samples a damaged shard lost
    (ImageTree.lost_train, which the split does not hold).
    """
    good = good_images(tree.train, bad) % KEY_MOD
    lost = len(tree.train) - len(good) + tree.lost_train
    expected_sum = int(good.sum() % KEY_MOD)
    out = []
    for epoch, ranks in enumerate(seen_per_epoch, start=1):
        rows = sum(r.count for r in ranks)
        distinct = sum(r.distinct for r in ranks)
        short = (expected_sum - sum(r.key_sum for r in ranks)) % KEY_MOD  # keys of the images not seen
        missing = max(0, len(good) - distinct)
        every_image = distinct == len(good) and short == 0
        as_expected = every_image and rows == distinct
        if rows == distinct and 0 < missing < len(ranks):
            as_expected = bool((good == short).any()) if missing == 1 else None
        out.append(
            {
                "epoch": epoch,
                "expected": len(good),
                "lost": lost,
                "seen": rows,
                "distinct": distinct,
                "exactly_once": every_image and rows == distinct,
                "every_image": every_image,
                "as_expected": as_expected,
                "repeated": rows - distinct,
                "missing": missing,
                "dropped_for_equal_split": len(ranks) - 1,
                "per_rank": [r.count for r in ranks],
            }
        )
    return out


def fingerprints(seen_per_epoch: list[list[ShardRecord]]) -> list[dict]:
    """Per epoch: a digest of every augmented view trained on (equal for two runs that trained
    on the same views; different for two epochs that did not reuse an augmentation) and
    each rank's random-stream digest where the epoch began."""
    return [
        {
            "epoch": e,
            "views": sum(r.views for r in ranks) % KEY_MOD,
            "rng_per_rank": [r.rng for r in ranks],
        }
        for e, ranks in enumerate(seen_per_epoch, start=1)
    ]


KEY_MOD = (1 << 31) - 1  # per-epoch key and view digests are kept modulo this (int64 math never overflows)


DIGEST_STRIDE = 32  # one byte of every 32 of each image goes into its view digest


def view_digest(images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Sum over the batch of hash(key, the image's augmented pixels), mod KEY_MOD, on the
    device: order-free, so two epochs or runs that trained on the same views of the same
    images have the same sum, and a reused augmentation shows as an equal sum. It reads one
    byte in DIGEST_STRIDE of each image (every channel and every row in turn: 32 is not a
    multiple of 3, nor a divisor of a row's bytes at the sizes trained): a 32nd of the bytes
    that weighing all of them moved, for the same two guarantees."""
    flat = images.reshape(images.shape[0], -1)[:, ::DIGEST_STRIDE]
    weights = _view_weights(flat.shape[1], str(images.device))
    pixels = (flat.to(torch.int32) * weights).sum(1)  # each product < 2**23, the sum in int64
    return ((pixels % KEY_MOD) * (keys % KEY_MOD + 1) % KEY_MOD).sum() % KEY_MOD


@functools.lru_cache(maxsize=8)
def _view_weights(n: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)  # the same weights in every process and run
    return torch.randint(1, 1 << 15, (n,), generator=g, dtype=torch.int32).to(device)


def shard_record(keys: list[torch.Tensor], count: int, views: int, rng: str) -> dict:
    """What this rank trained on in one epoch, for the driver's coverage check: rows, distinct
    images and the sum of their keys, the digest of the views, the random stream's state."""
    distinct = torch.unique(torch.cat(keys)) if keys else torch.zeros(0, dtype=torch.int64)
    key_sum = int((distinct % KEY_MOD).sum()) % KEY_MOD
    return {"count": count, "distinct": int(distinct.numel()), "key_sum": key_sum, "views": views, "rng": rng}
