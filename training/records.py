"""What the train workers hand back to the driver, typed and versioned: each epoch's record and the
run's, the one thing read across the worker-driver boundary (tests/test_layout.py holds it so).
An epoch's figures are fields (TrainFigures, ValFigures, training/bounds.py's Bound), never a
dict read by key: metrics.csv's and timings.csv's rows are made from them (EpochRecord's
metrics_row and timings_row), as are the figures handed to Ray Train, Tune and the trackers.

    run = RunRecord.fresh()                          # a worker, at a fresh start
    run.add(EpochRecord(...))                        # rank 0, after each epoch
    checkpoint = {"records": run.to_state(), ...}    # torch.save: primitives, weights_only=True reads them
    run = RunRecord.from_state(checkpoint["records"])   # the driver (results), or a resumed worker

A checkpoint whose records are of another RECORDS_VERSION is one line (StaleRecords), not a shim
per field: a run resumes from checkpoints of the version that wrote it. Light: no torch, no Ray.
"""

from __future__ import annotations

import dataclasses

from augment.decode import DECODE_PLACES
from training.bounds import Bound, DataSlots

RECORDS_VERSION = 3  # raise when a field's meaning or type changes: older checkpoints are refused


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
class TrainFigures:
    """One training epoch over all ranks, as the meter sums it (training/worker/loop.py EpochMeter):
    what it learned (metrics.csv), how long it took and what fed it (timings.csv, training/bounds.py),
    what each rank trained on (the driver's audit)."""

    loss: float  # mean cross-entropy over the images trained on
    acc: float  # top-1 on the augmented images
    images: int  # images trained on, all ranks
    image_size: int | None  # the side trained at (progressive resizing changes it)
    epoch_s: float  # seconds, rank 0's epoch
    images_per_s: float  # images over epoch_s
    data_wait_frac: float  # rank 0's share of epoch_s waiting for input
    steady_s: float  # seconds past the first batch (the wait for it is the data tasks' start-up)
    steady_wait_frac: float  # the share of steady_s waiting for input
    inner_images_per_s: float  # the ranks' rates summed, each within INNER's share of its epoch
    start_s: float  # the wait for the first batch, the ranks' mean
    trainer_cpus: float  # CPUs a rank's process kept busy, the ranks' mean
    read_s: float  # every rank's rows' seconds in the read (training/rows.py COSTS), past the first batch
    augment_s: float  # ... in decode + augment
    augment_gpu_s: float  # ... of augment calls on their CUDA stream
    trainer_gpu_s: float  # every rank's steady steps on its CUDA stream
    decoded: tuple[int, ...]  # images decoded in each of augment.decode.DECODE_PLACES, in its order
    seen: tuple[ShardRecord, ...]  # each rank's
    first_step_at: float | None = None  # time.time() when rank 0's first step ended

    def rounded(self) -> TrainFigures:
        """As the files keep them (metrics.csv and timings.csv print these)."""
        r = round
        return dataclasses.replace(
            self,
            loss=r(self.loss, 6),
            acc=r(self.acc, 6),
            epoch_s=r(self.epoch_s, 3),
            images_per_s=r(self.images_per_s, 1),
            data_wait_frac=r(self.data_wait_frac, 4),
            steady_s=r(self.steady_s, 3),
            steady_wait_frac=r(self.steady_wait_frac, 4),
            inner_images_per_s=r(self.inner_images_per_s, 1),
            start_s=r(self.start_s, 3),
        )

    def decoded_on(self, place: str) -> int:
        return self.decoded[DECODE_PLACES.index(place)]


@dataclasses.dataclass(frozen=True)
class ValFigures:
    """One validation over all ranks (training/worker/loop.py evaluate): every image scored once."""

    loss: float  # mean cross-entropy (nan: no image)
    acc: float  # top-1
    confusion: list  # counts, [true class][predicted class]
    top5: float | None = None  # None under 5 classes
    loss_ema: float | None = None  # --model-ema: the average's weights on the same images
    acc_ema: float | None = None

    def rounded(self) -> ValFigures:
        """As metrics.csv keeps them."""
        r = lambda v: None if v is None else round(v, 6)  # noqa: E731
        return dataclasses.replace(
            self,
            loss=r(self.loss),
            acc=r(self.acc),
            top5=r(self.top5),
            loss_ema=r(self.loss_ema),
            acc_ema=r(self.acc_ema),
        )


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """One epoch: its learning rate, its training and validation figures (rounded as the files keep
    them), what bounded it (training/bounds.py). Its metrics.csv row (deterministic) and timings.csv
    row (wall-clock) are made from these fields, as are the figures handed to Ray Train and Tune."""

    epoch: int  # 1-based
    lr: float
    train: TrainFigures  # first_step_at: None but for an attempt's first epoch (the start-up ends there)
    val: ValFigures
    bound: Bound

    @property
    def seen(self) -> tuple[ShardRecord, ...]:
        return self.train.seen

    def metrics_row(self) -> dict:
        """metrics.csv's row: deterministic for a seed (the figures are reduced over the ranks)."""
        t, v = self.train, self.val
        row = {"epoch": self.epoch, "lr": self.lr, "train_loss": t.loss, "train_acc": t.acc}
        row |= {"train_images": t.images, "image_size": t.image_size, "val_loss": v.loss, "val_acc": v.acc}
        row |= {"val_top5": v.top5} if v.top5 is not None else {}
        row |= {"val_loss_ema": v.loss_ema, "val_acc_ema": v.acc_ema} if v.acc_ema is not None else {}
        return row

    def timings_row(self) -> dict:
        """timings.csv's row: wall-clock figures and what bounded the epoch."""
        t = self.train
        row = {"epoch": self.epoch, "epoch_s": t.epoch_s, "images_per_s": t.images_per_s}
        row |= {"data_wait_frac": t.data_wait_frac, "steady_s": t.steady_s, "steady_wait_frac": t.steady_wait_frac}
        row |= {"inner_images_per_s": t.inner_images_per_s, "start_s": t.start_s}
        row |= {f"decoded_{p}": n for p, n in zip(DECODE_PLACES, t.decoded, strict=True)}
        return row | self.bound.to_row()

    @classmethod
    def from_state(cls, state: dict) -> EpochRecord:
        """From to_state's primitives (RunRecord.from_state)."""
        train = state["train"]
        seen = tuple(ShardRecord(**s) for s in train["seen"])
        return cls(
            epoch=state["epoch"],
            lr=state["lr"],
            train=TrainFigures(**(train | {"seen": seen, "decoded": tuple(train["decoded"])})),
            val=ValFigures(**state["val"]),
            bound=Bound(**state["bound"]),
        )


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """Rank 0's figures every --log-every steps (training/status.py StepLog), for the driver's trackers
    and the callbacks' on_step."""

    step: int  # the run's steps so far, the trackers' step axis
    epoch: int  # 1-based
    loss: float  # mean over the images since the last
    lr: float
    images_per_s: float  # since the last

    def scalars(self) -> dict:
        """The figures a tracker logs against `step`, by their names there."""
        return {"loss": self.loss, "lr": self.lr, "images_per_s": self.images_per_s}


@dataclasses.dataclass
class RunRecord:
    """The run so far: its epochs, the epochs at which attempts resumed, the ranks (node, initial
    weights' digest), the data slots its verdicts were judged on (training/bounds.py DataSlots),
    whether the console said the GPU's decoders fell back to the CPU, every rank's random
    generators (training/worker/learner.py rng_state), the --epochs its schedule was built for, and
    the damaged checkpoints a resume passed over."""

    epochs: list[EpochRecord]
    resumed_at_epochs: list[int]
    ranks: list[dict]
    slots: DataSlots | None = None
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
    def seen(self) -> list[list[ShardRecord]]:
        return [list(e.seen) for e in self.epochs]

    @property
    def first_steps(self) -> list[float]:
        return [e.train.first_step_at for e in self.epochs if e.train.first_step_at is not None]

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
        epochs = [EpochRecord.from_state(e) for e in fields.pop("epochs")]
        slots = fields.pop("slots", None)
        return cls(epochs=epochs, slots=DataSlots(**slots) if slots else None, **fields)
