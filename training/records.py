"""What the train workers hand back to the driver, typed and versioned: each epoch's record and the
run's, the one thing read across the worker-driver boundary (tests/test_layout.py holds it so).

    run = RunRecord.fresh()                          # a worker, at a fresh start
    run.add(EpochRecord(...))                        # rank 0, after each epoch
    checkpoint = {"records": run.to_state(), ...}    # torch.save: primitives, weights_only=True reads them
    run = RunRecord.from_state(checkpoint["records"])   # the driver (results), or a resumed worker

A checkpoint whose records are of another RECORDS_VERSION is one line (StaleRecords), not a shim
per field: a run resumes from checkpoints of the version that wrote it. Light: no torch, no Ray.
"""

from __future__ import annotations

import dataclasses

RECORDS_VERSION = 2  # raise when a field's meaning or type changes: older checkpoints are refused


KEY_MOD = (1 << 31) - 1  # per-epoch key and view digests are kept modulo this (int64 math never overflows)


class StaleRecords(ValueError):
    """A checkpoint's records are of another version of this job."""


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """What one rank trained on in one epoch (training/worker/loop.py shard_record): its rows, the
    distinct images among them and the sum of their keys (mod KEY_MOD), the digest of the views,
    the digest of its random stream where the epoch began."""

    count: int
    distinct: int
    key_sum: int
    views: int
    rng: str


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """One epoch: its metrics.csv row (deterministic), its timings.csv row (wall-clock), every
    rank's ShardRecord, its validation confusion matrix, and when its first step ended (time.time()
    on rank 0; None but for an attempt's first epoch: the start-up ends there)."""

    epoch: int  # 1-based
    metrics: dict
    timings: dict
    seen: tuple[ShardRecord, ...]
    confusion: list
    first_step_at: float | None = None


@dataclasses.dataclass
class RunRecord:
    """The run so far: its epochs, the epochs at which attempts resumed, the ranks (node, initial
    weights' digest), the data slots its verdicts were judged on (training/bounds.py DataSlots, as
    a dict), whether the console said the GPU's decoders fell back to the CPU, every rank's random
    generators (training/worker/learner.py rng_state), the --epochs its schedule was built for, and
    the damaged checkpoints a resume passed over."""

    epochs: list[EpochRecord]
    resumed_at_epochs: list[int]
    ranks: list[dict]
    slots: dict | None = None
    said_fallback: bool = False
    rng: list = dataclasses.field(default_factory=list)
    schedule_epochs: int = 0
    passed_over: list = dataclasses.field(default_factory=list)  # damaged checkpoints' folders, passed over on resume

    @classmethod
    def fresh(cls) -> RunRecord:
        return cls(epochs=[], resumed_at_epochs=[], ranks=[])

    @property
    def last_epoch(self) -> int:
        """The last epoch done, 0-based (-1: none)."""
        return self.epochs[-1].epoch - 1 if self.epochs else -1

    @property
    def history(self) -> list[dict]:
        return [e.metrics for e in self.epochs]

    @property
    def timings(self) -> list[dict]:
        return [e.timings for e in self.epochs]

    @property
    def seen(self) -> list[list[ShardRecord]]:
        return [list(e.seen) for e in self.epochs]

    @property
    def first_steps(self) -> list[float]:
        return [e.first_step_at for e in self.epochs if e.first_step_at is not None]

    def add(self, epoch: EpochRecord) -> None:
        self.epochs.append(epoch)

    def to_state(self) -> dict:
        """Primitives only (dicts, lists, numbers, strings): what torch.load(weights_only=True) reads."""
        return {"version": RECORDS_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_state(cls, state: dict) -> RunRecord:
        version = state.get("version") if isinstance(state, dict) else None
        if version != RECORDS_VERSION:
            raise StaleRecords(f"its records are of version {version} of this job's, this one reads {RECORDS_VERSION}")
        fields = {k: v for k, v in state.items() if k != "version"}
        epochs = [
            EpochRecord(**(e | {"seen": tuple(ShardRecord(**s) for s in e["seen"])})) for e in fields.pop("epochs")
        ]
        return cls(epochs=epochs, **fields)
