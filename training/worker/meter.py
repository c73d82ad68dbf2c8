"""One training epoch's figures on a train worker: the per-step bookkeeping kept on the device
(EpochMeter, as torchvision's MetricLogger keeps a train_one_epoch's), the epoch's rate within it
(inner_rate), the run's own stops (RunStopped), and the epoch's record for the driver
(epoch_record: metrics.csv's row, timings.csv's with what bounded it, the ranks' shard records).
"""

from __future__ import annotations

import time

import torch

from augment.decode import DECODE_PLACES
from training.audit import KEY_MOD, shard_record, view_digest
from training.bounds import AUGMENT_COST, AUGMENT_GPU_COST, COSTS, DECODED_ON, READ_COST, DataSlots, epoch_bound
from training.records import EpochRecord, ShardRecord
from training.rows import EPOCH, IMAGE, KEY, LABEL
from training.stamp import refuse_stale, stale_rows
from training.worker.learner import all_gather, all_reduce, rng_digest

# wall-clock, never deterministic: timings.csv's, not metrics.csv's
TIMING_COLUMNS = (
    *("epoch_s", "images_per_s", "data_wait_frac", "steady_s", "steady_wait_frac", "trainer_cpus", *COSTS),
    *("inner_images_per_s", "start_s", "trainer_gpu_s", *(f"decoded_{d}" for d in DECODE_PLACES)),
)
INNER = (0.1, 0.9)  # the part of an epoch its inner rate is measured over: past its start, before its tail
CPU_FALLBACK = 0.01  # a GPU run's share of images decoded on the CPU past which the console says so


class RunStopped(RuntimeError):
    """The train loop's own verdict that the run cannot go on (a non-finite loss, an epoch that
    trained no image); the message is the one line the user sees. Nothing of the epoch is kept."""


class EpochMeter:
    """The per-step bookkeeping of one training epoch (as torchvision's MetricLogger keeps a
    train_one_epoch's): the loss and accuracy sums and the stale rows, kept on the device so
    that no step waits for the host; the audit's view digest and keys (training/audit.py);
    the time spent waiting for input, the first step's end and the side trained at."""

    def __init__(self, device: torch.device, epoch: int):
        self.device, self.epoch = device, epoch
        self.sums = torch.zeros(3, device=device, dtype=torch.float64)  # loss*n, correct, stale rows
        self.costs = torch.zeros(len(COSTS), device=device, dtype=torch.float64)  # the stages' seconds (bounds.py)
        self.views = torch.zeros((), device=device, dtype=torch.int64)
        self.keys, self.count, self.steps, self.rng = [], 0, 0, rng_digest()  # the stream where the epoch starts
        self.wait_s, self.start, self.first_step_at, self.side = 0.0, time.perf_counter(), None, None
        self.cpu_start = time.process_time()  # the process's CPU, every thread (the feed, Ray Data's executor)
        self.first_wait_s = 0.0  # the wait for the first batch: the data tasks' start-up
        self.decoded = torch.zeros(len(DECODE_PLACES), device=device, dtype=torch.int64)  # rows by where decoded
        self.marks: list[tuple[float, int]] = []  # (time, images) after each step: the inner rate
        self.step_events: list = []  # CUDA events around each steady step: the trainer's GPU time
        self.first_bad = torch.full((), -1, device=device, dtype=torch.int64)  # the first non-finite loss's step

    def begin_step(self) -> None:
        """A steady step starts (past the first): its start on the device's stream, on a GPU."""
        if self.device.type == "cuda" and self.steps:
            self.step_events.append([torch.cuda.Event(enable_timing=True)])
            self.step_events[-1][0].record()

    def timed(self, batches):
        """The batches, with the time blocked on each (the model waiting for input) counted."""
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            self.wait_s += time.perf_counter() - t0
            if not self.steps and batch is not None:
                self.first_wait_s = self.wait_s
            if batch is None:
                return
            yield batch

    def update(self, batch: dict, loss: torch.Tensor, logits: torch.Tensor) -> None:
        y = batch[LABEL]
        finite = torch.isfinite(loss.detach())  # on the device: no step waits for the host
        self.first_bad = torch.where(~finite & (self.first_bad < 0), self.steps, self.first_bad)
        stale = stale_rows(batch[EPOCH], self.epoch).double()
        self.sums += torch.stack([loss.detach().double() * y.shape[0], (logits.argmax(1) == y).sum().double(), stale])
        # past the first batch (the epoch's steady part), the stages' seconds on the rows trained on
        # (rows from the augment stage: a test's batches may have none)
        if self.steps and all(c in batch for c in COSTS):
            self.costs += torch.stack([batch[c].sum(dtype=torch.float64) for c in COSTS])
        if DECODED_ON in batch:
            self.decoded += torch.bincount(batch[DECODED_ON].long(), minlength=len(DECODE_PLACES))
        if self.step_events and len(self.step_events[-1]) == 1:  # begin_step's: the step's end
            self.step_events[-1].append(torch.cuda.Event(enable_timing=True))
            self.step_events[-1][1].record()
        self.views = (self.views + view_digest(batch[IMAGE], batch[KEY])) % KEY_MOD
        self.keys.append(batch[KEY])
        self.count += y.shape[0]
        self.marks.append((time.perf_counter(), self.count))
        self.steps += 1
        self.side = batch[IMAGE].shape[1]  # the height trained at (progressive resizing changes it)
        if self.first_step_at is None:  # once per epoch: when the first step finished (start-up ends there)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.first_step_at = time.time()

    def summary(self) -> dict:
        """The epoch's figures over all ranks (the epoch's host syncs are here); StaleBatch if any
        batch was augmented for another epoch."""
        elapsed, cpu_s = time.perf_counter() - self.start, time.process_time() - self.cpu_start
        seen = all_gather(shard_record(self.keys, self.count, int(self.views), self.rng))
        if self.step_events:
            torch.cuda.synchronize(self.device)
        gpu_s = sum(a.elapsed_time(b) for a, b in self.step_events) / 1000
        mine = [self.count, cpu_s, inner_rate(self.marks), self.first_wait_s, gpu_s]
        bad_ranks = (self.first_bad >= 0).double()[None]
        loss_sum, correct, stale, count, cpu_s, inner, start_s, gpu_s, bad_ranks, *rest = all_reduce(
            torch.cat([self.sums, self.sums.new_tensor(mine), bad_ranks, self.costs, self.decoded.double()])
        ).tolist()
        costs, decoded = rest[: len(COSTS)], rest[len(COSTS) :]
        refuse_stale(stale, self.epoch)
        self.refuse_no_images(int(count))
        if bad_ranks:  # every rank stops alike: one whose loss stayed finite would wait for the others
            self.refuse_non_finite(int(self.first_bad))
        steady_s = elapsed - self.first_wait_s
        return {
            "train_loss": loss_sum / max(count, 1),
            "train_acc": correct / max(count, 1),
            "train_images": int(count),
            "epoch_s": elapsed,
            "data_wait_frac": self.wait_s / max(elapsed, 1e-9),  # this rank's share of time waiting for input
            # past its first batch: its time, its share of it waiting for input, and every rank's
            # rows' seconds in each stage: what bounds the epoch (training/bounds.py)
            "steady_s": steady_s,
            "steady_wait_frac": (self.wait_s - self.first_wait_s) / max(steady_s, 1e-9),
            **dict(zip(COSTS, costs, strict=True)),
            "trainer_gpu_s": gpu_s,  # every rank's steady steps on its CUDA stream
            "inner_images_per_s": inner,  # the ranks' rates summed, each between INNER's marks of its epoch
            "start_s": start_s / len(seen),  # the wait for an epoch's first batch, the ranks' mean
            **{f"decoded_{d}": int(n) for d, n in zip(DECODE_PLACES, decoded, strict=True)},
            "trainer_cpus": cpu_s / len(seen) / max(elapsed, 1e-9),  # CPUs a rank's process kept busy
            "seen": seen,
            "first_step_at": self.first_step_at,
            "image_size": self.side,
        }

    def refuse_no_images(self, count: int) -> None:
        if not count:
            raise RunStopped(
                f"epoch {self.epoch + 1} trained no image: every file of the training split that reached the "
                "trainers failed to decode (the skipped-files line names where they are listed); no model was written"
            )

    def refuse_non_finite(self, step: int) -> None:
        where = f"at step {step + 1} of epoch {self.epoch + 1}" if step >= 0 else f"in epoch {self.epoch + 1}"
        raise RunStopped(
            f"the training loss became non-finite (nan or inf) {where}; nothing of that epoch was kept. "
            "Usually the learning rate is too high for the model and batch size: lower --lr (it scales with "
            "--batch-size), give --warmup-epochs, or train with --amp bf16 or off instead of fp16"
        )


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
