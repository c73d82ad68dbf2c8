"""What each epoch trained on, the driver's verdicts on the records of all ranks (each rank's
ShardRecord, kept by training/worker/loop.py's EpochMeter: how many rows, which images by the
sum of their keys, a digest of the augmented views it saw, its random stream's digest):
`coverage` (every good image exactly once?) and `fingerprints` (the same views in two runs,
other views in two epochs). Sums are kept modulo records.KEY_MOD, so int64 arithmetic never
overflows."""

from __future__ import annotations

import numpy as np

from training.forms.data import ImageTree
from training.records import KEY_MOD, ShardRecord
from training.stream.ingest import epoch_order


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


def sampled_coverage(seen_per_epoch: list[list[ShardRecord]], tree: ImageTree, bad: dict[str, str], seed: int):
    """coverage's verdicts for --sampler balanced, whose epochs draw images with replacement: each
    epoch is checked against its own draw (training/stream/ingest.py epoch_order, replayed from the seed
    and the labels), not against every image once. `as_expected`: the rows are the draw's (its
    good images, repeats included) and the distinct images and their key sum are the draw's; None
    where an equal split dropped a few rows (which ones the sums cannot tell)."""
    good = good_images(tree.train, bad) % KEY_MOD
    keys = tree.train.keys % KEY_MOD
    out = []
    for epoch, ranks in enumerate(seen_per_epoch, start=1):
        drawn = keys[epoch_order(len(keys), seed, epoch - 1, np.asarray(tree.train.labels))]
        drawn = drawn[np.isin(drawn, good)]
        unique = np.unique(drawn)
        rows, distinct = sum(r.count for r in ranks), sum(r.distinct for r in ranks)
        short = (int(unique.sum() % KEY_MOD) - sum(r.key_sum for r in ranks)) % KEY_MOD
        the_draw = rows == len(drawn) and distinct == len(unique) and short == 0
        dropped = 0 < len(drawn) - rows < len(ranks)
        out.append(
            {
                "epoch": epoch,
                "sampled": True,  # drawn with replacement: not every image once, by design
                "drawn": len(drawn),
                "drawn_distinct": len(unique),
                "expected": len(good),
                "seen": rows,
                "distinct": distinct,
                "exactly_once": False,
                "every_image": distinct == len(good),
                "as_expected": True if the_draw else (None if dropped else False),
                "repeated": rows - distinct,
                "missing": max(0, len(unique) - distinct),
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
