"""A train worker's epoch, told: the epoch's record for the driver (epoch_record: metrics.csv's
row, timings.csv's with what bounded it, the ranks' shard records), its rate within the epoch
(inner_rate), rank 0's files and console lines (write_records) and the checkpoint handed to Ray
Train (report). Per epoch, never per batch: the batch's bookkeeping is loop.py's EpochMeter.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import ray.train
import torch

from augment.decode import DECODE_PLACES
from training import storage
from training.bounds import Bound, DataSlots, epoch_bound
from training.records import EpochRecord, RunRecord, ShardRecord
from training.rows import AUGMENT_COST, AUGMENT_GPU_COST, COSTS, READ_COST
from training.spec import WorkerSpec
from training.status import say

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_SEAL = "checkpoint.json"  # the size and digest of CHECKPOINT_FILE, written after it


class DamagedCheckpoint(ValueError):
    """A checkpoint whose file is missing, cut short or changed since it was written."""


# wall-clock, never deterministic: timings.csv's, not metrics.csv's
TIMING_COLUMNS = (
    *("epoch_s", "images_per_s", "data_wait_frac", "steady_s", "steady_wait_frac", "trainer_cpus", *COSTS),
    *("inner_images_per_s", "start_s", "trainer_gpu_s", *(f"decoded_{d}" for d in DECODE_PLACES)),
)
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


def epoch_record(epoch: int, stats: dict, *, lr: float, first: bool, slots: DataSlots, gpus: int) -> EpochRecord:
    """The epoch's record from its figures over all ranks (EpochMeter.summary, evaluate): metrics.csv's
    row, timings.csv's with what bounded it (training/bounds.py), the ranks' shard records; when its
    first step ended where it is an attempt's `first` epoch."""
    metrics = {"epoch": epoch + 1, "lr": round(lr, 8)}
    skip = {*TIMING_COLUMNS, "seen", "first_step_at", "confusion"}
    metrics |= {k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items() if k not in skip}
    timings = {
        "epoch": epoch + 1,
        "epoch_s": round(stats["epoch_s"], 3),
        "images_per_s": round(stats["train_images"] / stats["epoch_s"], 1),
        "data_wait_frac": round(stats["data_wait_frac"], 4),
        "steady_s": round(stats["steady_s"], 3),
        "steady_wait_frac": round(stats["steady_wait_frac"], 4),
        "inner_images_per_s": round(stats["inner_images_per_s"], 1),
        "start_s": round(stats["start_s"], 3),
        **{k: stats[k] for k in TIMING_COLUMNS if k.startswith("decoded_")},
    }
    bound = epoch_bound(
        slots,
        read_s=stats[READ_COST],
        augment_s=stats[AUGMENT_COST],
        steady_s=stats["steady_s"],
        steady_wait=stats["steady_wait_frac"],
        trainer_cpus=stats["trainer_cpus"],
        augment_gpu_s=stats[AUGMENT_GPU_COST],
        trainer_gpu_s=stats["trainer_gpu_s"],
        gpus=gpus,
    )
    seen = tuple(ShardRecord(**r) for r in stats["seen"])
    first_step = stats["first_step_at"] if first else None
    return EpochRecord(epoch + 1, metrics, timings | bound.to_row(), seen, stats["confusion"], first_step)


def cpu_fallback(timings: dict) -> float:
    """An epoch's share of images decoded on the CPU (its timings row's decoded_* counts)."""
    counts = {p: int(timings.get(f"decoded_{p}") or 0) for p in DECODE_PLACES}
    return counts["cpu"] / max(sum(counts.values()), 1)


def write_records(spec: WorkerSpec, run: RunRecord) -> None:
    """Rank 0: metrics.csv and timings.csv, and the epoch's line (and, once a run, a GPU's CPU
    decoding said) for the driver's console."""
    cfg, last = spec.config, run.epochs[-1]
    storage.write_csv(storage.join(cfg.run_dir, "metrics.csv"), run.history)
    storage.write_csv(storage.join(cfg.run_dir, "timings.csv"), run.timings)
    row = last.metrics | last.timings
    verdict = Bound.of_row(row).describe(spec.slots)
    say(spec.status, format_row(row, cfg.epochs, spec.sizes is not None) + verdict, last.epoch - 1)
    fell_back = cpu_fallback(last.timings) if spec.slots.on_gpu else 0.0
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
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if learner_state is not None:
            save_checkpoint(tmp, {"records": run.to_state(), "learner": learner_state})
            ckpt = ray.train.Checkpoint.from_directory(tmp)
        metrics = last.metrics | last.timings
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=checkpoint_name(epoch, tuple(run.passed_over)))


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


def format_row(row: dict, epochs: int, show_size: bool = False) -> str:
    """An epoch's line, less the verdict on what bounded it."""
    size = f"  {row['image_size']}px" if show_size else ""
    ema = f"  val_acc_ema {row['val_acc_ema']:.4f}" if "val_acc_ema" in row else ""  # --model-ema
    return (
        f"epoch {row['epoch']:>3}/{epochs}{size}  loss {row['train_loss']:.4f}  acc {row['train_acc']:.4f}  "
        f"val_loss {row['val_loss']:.4f}  val_acc {row['val_acc']:.4f}{ema}  "
        f"{row['images_per_s']:.0f} img/s  waiting for data {100 * row['data_wait_frac']:.0f}%"
    )
