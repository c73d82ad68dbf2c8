"""The epoch stamp: which epoch every augmented row was drawn for, from the clock to the check.

The augmentation of an image depends on the epoch, which the read takes from a tiny
EpochClock actor once an execution, for its file order and for every row it reads (their
`epoch` column, training/stream/ingest.py), so the augment stage draws for the rows' epoch and
asks no actor; rank 0 of the trainer advances the clock before it asks for the epoch's data
(Ray Data's split coordinator holds every epoch's execution until all ranks have asked for it,
so no batch of epoch e is read before the clock says e). Every row the stage returns carries
the epoch it was drawn for (its `epoch` column, `stamp`); the trainer checks the
first batch's stamp at once and counts stale rows for the rest (`check_stamp`, `stale_rows`),
and refuses an epoch that held any (StaleBatch), so a change in that ordering fails loudly
instead of reusing an epoch's augmentation (docs/design.md, "Epoch stamp").

Light (numpy and Ray; no torch at import): the data side's processes import it too.
"""

from __future__ import annotations

import numpy as np
import ray


class StaleBatch(RuntimeError):
    """A batch whose augmentation was drawn for another epoch than the one being trained."""


class EpochClock:
    """Holds the current epoch; run as an actor with num_cpus=0."""

    def __init__(self):
        self.epoch = 0

    def set(self, epoch: int) -> int:
        self.epoch = epoch
        return epoch

    def get(self) -> int:
        return self.epoch


def advance(clock, epoch: int) -> None:
    """Rank 0, before it asks for the epoch's data: the epoch every batch of it is drawn for."""
    ray.get(clock.set.remote(epoch))


def current_epoch(clock) -> int:
    """The epoch to draw for now (0 without a clock: validation, which is fixed)."""
    return ray.get(clock.get.remote()) if clock is not None else 0


def stamp(rows: int, epoch: int) -> np.ndarray:
    """The `epoch` column of a batch of `rows` drawn for `epoch`."""
    return np.full(rows, epoch, dtype=np.int64)


def check_stamp(stamps, epoch: int) -> None:
    """StaleBatch unless the first row of an epoch's first batch was drawn for `epoch`."""
    first = int(stamps[0])  # a host sync: once per epoch
    if first != epoch:
        raise StaleBatch(
            f"epoch {epoch + 1}: the first batch was augmented for epoch {first + 1}; the read took the epoch "
            "from the clock before rank 0 advanced it (docs/design.md, 'Epoch stamp')"
        )


def stale_rows(stamps, epoch: int):
    """How many rows of a batch were drawn for another epoch, as a tensor on the batch's device
    (no host sync: the epoch's total is checked once, at its end)."""
    return (stamps != epoch).sum()


def refuse_stale(count: int, epoch: int) -> None:
    if count:
        raise StaleBatch(f"epoch {epoch + 1}: {int(count)} image(s) were augmented for another epoch")
