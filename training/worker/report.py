"""A train worker's epoch, told: the epoch's record for the driver (epoch_record: the meter's and the
evaluation's figures, rounded as the files keep them, with what bounded it), its rate within the epoch
(inner_rate), rank 0's files and console lines (write_records) and the checkpoint handed to Ray
Train (report). Per epoch, never per batch: the batch's bookkeeping is loop.py's EpochMeter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import ray.train
import torch

from training import storage
from training.bounds import DataSlots, epoch_bound
from training.records import EpochRecord, RunRecord, TrainFigures, ValFigures
from training.spec import WorkerSpec
from training.status import say

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_SEAL = "checkpoint.json"  # the size and digest of CHECKPOINT_FILE, written after it


class DamagedCheckpoint(ValueError):
    """A checkpoint whose file is missing, cut short or changed since it was written."""


INNER = (0.1, 0.9)  # the part of an epoch its inner rate is measured over: past its start, before its tail
CPU_FALLBACK = 0.01  # a GPU run's share of images decoded on the CPU past which the console says so


def inner_rate(marks: list[tuple[float, int]]) -> float:
    """Images per second between the steps that reached INNER's shares of the epoch's images (its
    start and its tail left out); over the whole list where too few steps lie between."""
    if len(marks) < 2:
        return 0.0
    total = marks[-1][1]
    lo = next(i for i, (_, n) in enumerate(marks) if n >= INNER[0] * total)
    hi = next(i for i, (_, n) in enumerate(marks) if n >= INNER[1] * total)
    if hi - lo < 2:
        lo, hi = 0, len(marks) - 1
    (t0, n0), (t1, n1) = marks[lo], marks[hi]
    return (n1 - n0) / max(t1 - t0, 1e-9)


def epoch_record(
    epoch: int, train: TrainFigures, val: ValFigures, *, lr: float, first: bool, slots: DataSlots, gpus: int
) -> EpochRecord:
    """The epoch's record from its figures over all ranks (EpochMeter.summary, evaluate), rounded as the
    files keep them, with what bounded it (training/bounds.py); when its first step ended where it is
    an attempt's `first` epoch."""
    bound = epoch_bound(
        slots,
        read_s=train.read_s,
        augment_s=train.augment_s,
        steady_s=train.steady_s,
        steady_wait=train.steady_wait_frac,
        trainer_cpus=train.trainer_cpus,
        augment_gpu_s=train.augment_gpu_s,
        trainer_gpu_s=train.trainer_gpu_s,
        gpus=gpus,
    )
    train = dataclasses.replace(train.rounded(), first_step_at=train.first_step_at if first else None)
    return EpochRecord(epoch + 1, round(lr, 8), train, val.rounded(), bound.rounded())


def cpu_fallback(train: TrainFigures) -> float:
    """An epoch's share of images decoded on the CPU."""
    return train.decoded_on("cpu") / max(sum(train.decoded), 1)


def write_records(spec: WorkerSpec, run: RunRecord) -> None:
    """Rank 0: metrics.csv and timings.csv, and the epoch's line (and, once a run, a GPU's CPU
    decoding said) for the driver's console."""
    cfg, last = spec.config, run.epochs[-1]
    storage.write_csv(storage.join(cfg.run_dir, "metrics.csv"), [e.metrics_row() for e in run.epochs])
    storage.write_csv(storage.join(cfg.run_dir, "timings.csv"), [e.timings_row() for e in run.epochs])
    verdict = last.bound.describe(spec.slots)
    say(spec.status, epoch_line(last, cfg.epochs, spec.sizes is not None) + verdict, last.epoch - 1)
    fell_back = cpu_fallback(last.train) if spec.slots.on_gpu else 0.0
    if fell_back > CPU_FALLBACK and not run.said_fallback:  # once a run
        run.said_fallback = True
        say(
            spec.status,
            f"note: {100 * fell_back:.1f}% of epoch {last.epoch}'s images were decoded on the CPU, not the GPU "
            "(files its decoders refuse: other formats, CMYK, progressive JPEGs the engines refuse; or a batch they "
            "failed on); timings.csv's decoded_* columns count them per epoch",
        )


def report(run: RunRecord, learner_state: dict | None, epoch: int) -> None:
    """ray.train.report from every rank (the epoch's rows as its metrics); rank 0 (the one with the
    learner's state) attaches the checkpoint: the records and the learner."""
    last = run.epochs[-1]
    metrics = last.metrics_row() | last.timings_row()  # Ray Train keeps the best by its val_acc
    name = checkpoint_name(epoch, tuple(run.passed_over))
    if learner_state is None:
        ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
        return
    with storage.staging_dir() as tmp:
        save_checkpoint(tmp, {"records": run.to_state(), "learner": learner_state})
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=name)


def checkpoint_name(epoch: int, passed_over: tuple[str, ...] = ()) -> str:
    """The folder of epoch `epoch`'s checkpoint (0-based). An epoch trained again after its checkpoint
    was found damaged gets a folder of its own: Ray Train still lists the damaged one, and removes
    its folder when it drops it."""
    name = f"checkpoint_epoch_{epoch + 1:04d}"
    again = sum(1 for p in passed_over if p == name or p.startswith(f"{name}_again"))
    return f"{name}_again{again}" if again else name


def save_checkpoint(folder: str, state: dict) -> None:
    """CHECKPOINT_FILE, then its seal (size and SHA-256): a file cut short by a crash or a full disk, or
    a seal missing, is found on load instead of failing deep inside torch.load."""
    path = os.path.join(folder, CHECKPOINT_FILE)
    torch.save(state, path)
    seal = {"file": CHECKPOINT_FILE, "bytes": os.path.getsize(path), "sha256": file_digest(path)}
    with open(os.path.join(folder, CHECKPOINT_SEAL), "w") as f:
        json.dump(seal, f)


def load_checkpoint(folder: str, map_location) -> dict:
    """The state in a checkpoint folder, once its file matches its seal; DamagedCheckpoint (why) if not.
    A checkpoint of a version before seals is taken where torch reads it whole."""
    path = os.path.join(folder, CHECKPOINT_FILE)
    try:
        size = os.path.getsize(path)
        with open(os.path.join(folder, CHECKPOINT_SEAL)) as f:
            seal = json.load(f)
    except FileNotFoundError as e:
        if e.filename != os.path.join(folder, CHECKPOINT_SEAL):
            raise DamagedCheckpoint(f"no {CHECKPOINT_FILE}") from None
        seal = None
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(f"its seal does not read: {getattr(e, 'strerror', None) or e}") from None
    if seal is not None and size != seal.get("bytes"):
        raise DamagedCheckpoint(f"{CHECKPOINT_FILE} has {size} of its {seal.get('bytes')} bytes")
    if seal is not None and file_digest(path) != seal.get("sha256"):
        raise DamagedCheckpoint(f"{CHECKPOINT_FILE} changed since it was written (its SHA-256 differs)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, ValueError, OSError) as e:  # torch's zip reader, the unpickler
        raise DamagedCheckpoint(f"{CHECKPOINT_FILE} does not read: {str(e).splitlines()[0][:120]}") from None


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def epoch_line(record: EpochRecord, epochs: int, show_size: bool = False) -> str:
    """An epoch's line, less the verdict on what bounded it."""
    t, v = record.train, record.val
    size = f"  {t.image_size}px" if show_size else ""
    ema = f"  val_acc_ema {v.acc_ema:.4f}" if v.acc_ema is not None else ""  # --model-ema
    return (
        f"epoch {record.epoch:>3}/{epochs}{size}  loss {t.loss:.4f}  acc {t.acc:.4f}  "
        f"val_loss {v.loss:.4f}  val_acc {v.acc:.4f}{ema}  "
        f"{t.images_per_s:.0f} img/s  waiting for data {100 * t.data_wait_frac:.0f}%"
    )
