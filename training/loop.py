"""The per-worker train loop run by Ray Train: restore, build, then per epoch train, evaluate,
record, checkpoint.

Split as torchvision's classification reference splits its script
(references/classification/train.py: `train_one_epoch`, `evaluate`, `main`): `train_epoch`
and `evaluate` take a `Learner` (model, optimizer, scheduler, scaler, normalisation, mixing),
and `train_loop` only strings the named steps together. `train_loop` receives a plain dict
(TrainConfig fields plus what the driver found out: class names, preset, dataset sizes, the
epoch clock, what Ray Data needs). Rank 0 alone writes files. docs/design.md has the
contracts this file keeps: the epoch stamp, the per-rank random streams, the stall checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import random
import tempfile
import time

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

from augment.decode import DECODE_PLACES
from augment.mix import MixUpCutMix, mix_generator
from augment.ops import Normalize
from training import artifacts
from training.audit import KEY_MOD, shard_record, view_digest
from training.bounds import AUGMENT_COST, AUGMENT_GPU_COST, COSTS, DECODED_ON, READ_COST, Bound, DataSlots, epoch_bound
from training.config import TrainConfig
from training.console import EpochProgress, quiet_worker_logs
from training.feed import EpochData, IngestWatch
from training.model import build_model, load_init_weights, uses_small_stem
from training.spec import WorkerSpec
from training.stamp import check_stamp, refuse_stale, stale_rows

CHECKPOINT_FILE = "checkpoint.pt"
# wall-clock, never deterministic: timings.csv's, not metrics.csv's
TIMING_COLUMNS = (
    *("epoch_s", "images_per_s", "data_wait_frac", "steady_s", "steady_wait_frac", "trainer_cpus", *COSTS),
    *("inner_images_per_s", "start_s", "trainer_gpu_s", *(f"decoded_{d}" for d in DECODE_PLACES)),
)
INNER = (0.1, 0.9)  # the part of an epoch its inner rate is measured over: past its start, before its tail


class CheckpointMismatch(RuntimeError):
    """The run's last checkpoint does not fit this version or these settings."""


class RunStopped(RuntimeError):
    """The train loop's own verdict that the run cannot go on (a non-finite loss, an epoch that
    trained no image); the message is the one line the user sees. Nothing of the epoch is kept."""


# --------------------------------------------------------------------------- building blocks


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on conv/linear weights only: decaying BatchNorm scales and biases hurts."""
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.ndim > 1 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: TrainConfig, model) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.peak_lr)
    return torch.optim.SGD(groups, lr=cfg.peak_lr, momentum=cfg.momentum, nesterov=True)


def build_scheduler(cfg: TrainConfig, optimizer, steps_per_epoch: int):
    """Stepped once per optimizer step. cosine: linear warm-up from 1/warmup of the peak over
    `warmup` steps, then cosine to 0 at the last step; onecycle: torch's OneCycleLR."""
    total = cfg.epochs * steps_per_epoch
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    lr = torch.optim.lr_scheduler
    if cfg.schedule == "onecycle":
        scheduler = lr.OneCycleLR(
            optimizer, max_lr=cfg.peak_lr, total_steps=total + 1, pct_start=min(0.5, max(warmup / total, 0.01))
        )
    else:
        warmup = max(1, min(warmup, total))
        rise = lr.LinearLR(optimizer, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
        fall = lr.CosineAnnealingLR(optimizer, T_max=max(1, total - warmup), eta_min=0.0)
        scheduler = lr.SequentialLR(optimizer, [rise, fall], milestones=[warmup])
    scheduler.steps_per_epoch = steps_per_epoch  # Learner.reschedule builds the same schedule for other --epochs
    return scheduler


def params_digest(model: torch.nn.Module) -> str:
    """Hash of every parameter's bytes: equal across ranks iff the weights are identical."""
    h = hashlib.sha256()
    for p in model.state_dict().values():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def _all_gather(obj) -> list:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------- random streams per rank


def rank_seed(seed: int, rank: int) -> int:
    """The seed of one rank's own random stream: distinct per rank, fixed by --seed."""
    digest = hashlib.blake2b(f"{seed}/{rank}".encode(), digest_size=8, person=b"rga-rank").digest()
    return int.from_bytes(digest, "little") >> 1


def seed_rank(seed: int, rank: int) -> None:
    """After the identical initial weights: every later draw on this rank (dropout, random
    tensors, Python's and NumPy's global generators) comes from the rank's own stream."""
    s = rank_seed(seed, rank)
    torch.manual_seed(s)  # also every CUDA device's default generator
    random.seed(s)
    np.random.seed(s % 2**32)


def rng_state(device: torch.device) -> dict:
    """This rank's generators, in types torch.load(weights_only=True) reads back."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
    }


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())  # map_location may have moved it to the device
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))


def rng_digest() -> str:
    """Short hash of this rank's torch generator state: equal iff the streams are at the same place."""
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


# --------------------------------------------------------------------------- the learner


@dataclasses.dataclass
class Learner:
    """Everything a training step touches, built once per attempt by `build_learner`."""

    cfg: TrainConfig
    device: torch.device
    model: torch.nn.Module  # what steps call: DDP- (and compile-) wrapped
    bare: torch.nn.Module  # the plain module: evaluation and state_dict skip DDP's collectives
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    normalize: torch.nn.Module  # uint8 (B, H, W, 3) -> float (B, 3, H, W) channels_last, on the device
    mix: MixUpCutMix | None = None

    @classmethod
    def on_cpu(cls, cfg: TrainConfig, model: torch.nn.Module, steps_per_epoch: int) -> Learner:
        """A single-process CPU learner (no DDP, a mid-grey Normalize): for tests and benchmarks
        that run steps outside Ray Train."""
        optimizer = build_optimizer(cfg, model)
        return cls(
            cfg=cfg,
            device=torch.device("cpu"),
            model=model,
            bare=model,
            optimizer=optimizer,
            scheduler=build_scheduler(cfg, optimizer, steps_per_epoch),
            scaler=torch.amp.GradScaler("cpu", enabled=False),
            normalize=Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
        )

    def reschedule(self, steps_done: int) -> None:
        """The schedule for --epochs as set now, moved on by the steps already taken (the optimizer's
        learning rate with it)."""
        import warnings

        steps_per_epoch = self.scheduler.steps_per_epoch
        for group in self.optimizer.param_groups:  # a new schedule starts from the peak it scales
            group["lr"] = self.cfg.peak_lr
            group.pop("initial_lr", None)
        self.scheduler = build_scheduler(self.cfg, self.optimizer, steps_per_epoch)
        with warnings.catch_warnings():  # steps before any optimizer.step: torch warns of the order
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(steps_done):
                self.scheduler.step()

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype Normalize writes a step's batch in: the autocast's (the model's first layer
        casts to it anyway; half the bytes of float32), float32 where MixUp/CutMix blends it first."""
        if self.cfg.amp == "off" or self.mix is not None:
            return torch.float32
        return torch.bfloat16 if self.cfg.amp == "bf16" else torch.float16

    def autocast(self):
        if self.cfg.amp == "off":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if self.cfg.amp == "bf16" else torch.float16)

    def state_dict(self) -> dict:
        return {
            "model": self.bare.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's model, optimizer, scaler and schedule. A run resumed with another
        --epochs (the only schedule setting a rerun may change: training.inputs.SAME_RUN_SETTINGS)
        gets the schedule of the new length, at the step the checkpoint reached."""
        try:
            self.bare.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if state.get("epochs", self.cfg.epochs) == self.cfg.epochs:
                self.scheduler.load_state_dict(state["scheduler"])
            else:
                self.reschedule(state["scheduler"]["last_epoch"])
            self.scaler.load_state_dict(state["scaler"])
        except (KeyError, ValueError, RuntimeError) as e:  # another model, optimizer or schedule
            raise CheckpointMismatch(
                f"the last checkpoint of --name {self.cfg.name} was written by another version or other settings "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); rerun with --fresh to start over, or "
                "with the settings it was written with"
            ) from None


def build_learner(spec: WorkerSpec, world: int, device: torch.device) -> tuple[Learner, str]:
    """The learner, with initial weights identical on every rank, and their digest."""
    cfg, num_classes = spec.config, spec.num_classes
    torch.manual_seed(cfg.seed)
    small = uses_small_stem(cfg.small_stem, spec.image_size, cfg.model)
    model = build_model(cfg.model, num_classes, small_stem=small, image_size=spec.image_size)
    if cfg.init_weights:
        skipped = load_init_weights(model, cfg.init_weights, cfg.model)
        if ray.train.get_context().get_world_rank() == 0:
            fresh = ", ".join(sorted({k.rsplit(".", 1)[0] for k in skipped}))
            _say(spec, f"init weights from {cfg.init_weights}; fresh: {fresh}")
    init_digest = params_digest(model)
    model = ray.train.torch.prepare_model(model)
    if cfg.compile:
        model = torch.compile(model)
    bare = model.module if hasattr(model, "module") else model
    bare = getattr(bare, "_orig_mod", bare)
    optimizer = build_optimizer(cfg, model)
    per_worker = cfg.batch_size // world
    mix = spec.preset.mix
    learner = Learner(
        cfg=cfg,
        device=device,
        model=model,
        bare=bare,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg, optimizer, max(1, math.ceil(spec.train_images / world / per_worker))),
        scaler=torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16"),
        normalize=Normalize(spec.preset.mean, spec.preset.std).to(device),
        mix=MixUpCutMix(num_classes=num_classes, **({"label_smoothing": cfg.label_smoothing} | mix)) if mix else None,
    )
    return learner, init_digest


# --------------------------------------------------------------------------- epochs


def train_step(learner: Learner, batch: dict, *, epoch: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on one batch; returns the loss and the logits (still on the device)."""
    cfg = learner.cfg
    x, y = learner.normalize(batch["image"], learner.input_dtype), batch["label"]
    target, smoothing = y, cfg.label_smoothing
    if learner.mix is not None:  # soft targets, replayable from (seed, epoch, step, rank)
        x, target = learner.mix(x, y, mix_generator(cfg.seed, epoch, step, rank))
        smoothing = 0.0  # already folded into the soft targets
    with learner.autocast():
        logits = learner.model(x)
        loss = F.cross_entropy(logits, target, label_smoothing=smoothing)
    learner.optimizer.zero_grad(set_to_none=True)
    learner.scaler.scale(loss).backward()
    learner.scaler.step(learner.optimizer)
    learner.scaler.update()
    learner.scheduler.step()
    return loss, logits


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
        y = batch["label"]
        finite = torch.isfinite(loss.detach())  # on the device: no step waits for the host
        self.first_bad = torch.where(~finite & (self.first_bad < 0), self.steps, self.first_bad)
        stale = stale_rows(batch["epoch"], self.epoch).double()
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
        self.views = (self.views + view_digest(batch["image"], batch["key"])) % KEY_MOD
        self.keys.append(batch["key"])
        self.count += y.shape[0]
        self.marks.append((time.perf_counter(), self.count))
        self.steps += 1
        self.side = batch["image"].shape[1]  # the height trained at (progressive resizing changes it)
        if self.first_step_at is None:  # once per epoch: when the first step finished (start-up ends there)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.first_step_at = time.time()

    def summary(self) -> dict:
        """The epoch's figures over all ranks (the epoch's host syncs are here); StaleBatch if any
        batch was augmented for another epoch."""
        elapsed, cpu_s = time.perf_counter() - self.start, time.process_time() - self.cpu_start
        seen = _all_gather(shard_record(self.keys, self.count, int(self.views), self.rng))
        if self.step_events:
            torch.cuda.synchronize(self.device)
        gpu_s = sum(a.elapsed_time(b) for a, b in self.step_events) / 1000
        mine = [self.count, cpu_s, inner_rate(self.marks), self.first_wait_s, gpu_s]
        bad_ranks = (self.first_bad >= 0).double()[None]
        loss_sum, correct, stale, count, cpu_s, inner, start_s, gpu_s, bad_ranks, *rest = _all_reduce(
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


def train_epoch(learner: Learner, batches, *, epoch: int, rank: int, bar=None) -> dict:
    """One pass over this rank's shard (torchvision's train_one_epoch); loss and accuracy summed
    over ranks. Fails (StaleBatch) if any batch was augmented for another epoch."""
    learner.model.train()
    meter = EpochMeter(learner.device, epoch)
    for batch in meter.timed(batches):
        if meter.steps == 0:
            check_stamp(batch["epoch"], epoch)
        meter.begin_step()
        loss, logits = train_step(learner, batch, epoch=epoch, step=meter.steps, rank=rank)
        meter.update(batch, loss, logits)
        if bar is not None:
            bar.update(batch["label"].shape[0], meter.sums)  # reads the loss sum (a host sync) at most once an interval
    return meter.summary()


@torch.no_grad()
def evaluate(learner: Learner, batches, num_classes: int) -> dict:
    """Deterministic validation over this rank's shard (torchvision's evaluate); loss, top-1,
    top-5 and the confusion matrix summed over ranks (every validation image is scored once)."""
    model, device = learner.bare, learner.device  # the bare module: no DDP collectives per batch
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    top5 = torch.zeros((), device=device, dtype=torch.float64)
    confusion = torch.zeros(num_classes * num_classes, device=device, dtype=torch.float64)
    for batch in batches:
        logits = model(learner.normalize(batch["image"])).float()
        y = batch["label"]
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        k = min(5, num_classes)
        top5 += (logits.topk(k, dim=1).indices == y[:, None]).any(1).sum()
        confusion += torch.bincount(y * num_classes + logits.argmax(1), minlength=num_classes**2).double()
    packed = _all_reduce(torch.cat([loss_sum[None], top5[None], confusion])).cpu()
    confusion = packed[2:].view(num_classes, num_classes).long()  # rows: true class, cols: predicted
    n = int(confusion.sum())
    out = {
        "val_loss": float(packed[0]) / n if n else float("nan"),
        "val_acc": float(confusion.diag().sum()) / n if n else float("nan"),
        "confusion": confusion.tolist(),
    }
    if num_classes >= 5:
        out["val_top5"] = float(packed[1]) / n if n else float("nan")
    return out


# --------------------------------------------------------------------------- the data side


# --------------------------------------------------------------------------- the loop


def train_loop(config: dict) -> None:
    """Ray Train's per-worker function: restore, build, then per epoch train, evaluate,
    record and checkpoint."""
    spec: WorkerSpec = config["spec"]
    cfg, ctx = spec.config, ray.train.get_context()
    quiet_worker_logs(cfg.verbose)
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = setup_worker(cfg, spec.threads_per_worker)
    state, resumed_from = restore(device)
    first, last = state["epoch"] + 1, last_epoch(cfg, state["epoch"] + 1)
    data = EpochData(spec, rank, world, device)
    feed = data.feed(first) if first < last else None  # the first batch is on its way while the model builds
    learner, init_digest = build_learner(spec, world, device)
    ranks = _all_gather({"rank": rank, "node_id": ray.get_runtime_context().get_node_id(), "init_digest": init_digest})
    data.watch = IngestWatch(spec.ingest, [r["node_id"] for r in ranks], spec.stall)
    if feed is not None:
        feed.watch = data.watch
    resumed = resume_or_seed(learner, state, resumed_from, rank, world)
    if resumed and rank == 0:
        _say(spec, resumed)
        spec.board.checkpointed.remote(resumed_from)  # what a stop before the next checkpoint resumes from
    state |= {"ranks": ranks, "resumed_at_epochs": state["resumed_at_epochs"] + ([first + 1] if resumed_from else [])}
    for epoch in range(first, last):
        bar = EpochProgress(spec.board.post.remote, rank=rank, epoch=epoch)  # every rank; a fault line names the step
        with feed or data.feed(epoch) as batches:  # the feed's thread stops with the epoch, however it ends
            stats = train_epoch(learner, batches, epoch=epoch, rank=rank, bar=bar)
        bar.close()
        feed = None
        with data.validation() as batches:
            stats |= evaluate(learner, batches, spec.num_classes)
        lr = learner.scheduler.get_last_lr()[0]
        row = record_epoch(state, epoch, stats, lr=lr, first=epoch == first, slots=spec.slots)
        rng = _all_gather(rng_state(device))  # every rank's stream, restored per rank on resume
        if rank == 0:
            write_records(spec, state, row)
        saved = state | learner.state_dict() | {"rng": rng, "epochs": cfg.epochs} if rank == 0 else None
        report(row, saved, epoch)  # rank 0's checkpoint; `epochs`: the length its schedule was built for


def setup_worker(cfg: TrainConfig, threads: int) -> torch.device:
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(threads)
    if cfg.deterministic:
        ray.train.torch.enable_reproducibility(cfg.seed)
    return device


def fresh_state() -> dict:
    return {"epoch": -1, "history": [], "timings": [], "seen": [], "resumed_at_epochs": [], "first_steps": []}


def restore(device: torch.device) -> tuple[dict, str | None]:
    """The last checkpoint's state and where it lies, or a fresh state and None. A resumed
    run knows where to start before anything else: that decides the first epoch's data."""
    checkpoint = ray.train.get_checkpoint()
    if not checkpoint:
        return fresh_state(), None
    with checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, CHECKPOINT_FILE), map_location=device, weights_only=True)
    return fresh_state() | state, checkpoint.path


def last_epoch(cfg: TrainConfig, first: int) -> int:
    return cfg.epochs if not cfg.stop_after else min(cfg.epochs, first + cfg.stop_after)


def resume_or_seed(learner: Learner, state: dict, resumed_from: str | None, rank: int, world: int) -> str | None:
    """A fresh run seeds each rank's own stream; a resumed one loads the learner and puts each
    rank's stream back where the checkpoint left it (a new stream per rank if the world size
    changed, or the checkpoint predates per-rank streams). Returns the line to print on resume."""
    cfg = learner.cfg
    if resumed_from is None:
        seed_rank(cfg.seed, rank)
        return None
    learner.load_state_dict(state)
    for key in ("model", "optimizer", "scheduler", "scaler"):  # the learner holds them now
        del state[key]
    saved = state.get("rng")
    if isinstance(saved, list) and len(saved) == world:
        set_rng_state(saved[rank], learner.device)
    else:
        seed_rank(cfg.seed + state["epoch"] + 1, rank)
    streams = f"{len(saved)} rank streams" if isinstance(saved, list) else "no rank streams"
    note = "" if isinstance(saved, list) and len(saved) == world else f" ({streams} saved: fresh ones)"
    return f"resumed from {resumed_from} at epoch {state['epoch'] + 2}{note}"


def record_epoch(state: dict, epoch: int, stats: dict, *, lr: float, first: bool, slots: DataSlots) -> dict:
    """Adds the epoch to the state's history, timings (with what bounded it: training/bounds.py),
    coverage and start-up records; returns the row printed and reported (metrics and timings)."""
    state["seen"].append(stats.pop("seen"))
    first_step_at = stats.pop("first_step_at")
    if first and first_step_at is not None:  # this attempt's start-up ended there
        state["first_steps"].append(first_step_at)
    state["confusion"] = stats.pop("confusion")
    row = {"epoch": epoch + 1, "lr": round(lr, 8)}
    row |= {k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items() if k not in TIMING_COLUMNS}
    timing = {
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
        gpus=len(state["ranks"]) if slots.on_gpu else 1,
    )
    timing |= bound.to_row()
    state["slots"] = dataclasses.asdict(slots)  # summary.json's steady bound and its hint
    state["history"].append(row)
    state["timings"].append(timing)
    state["epoch"] = epoch
    return row | timing


def write_records(spec: WorkerSpec, state: dict, row: dict) -> None:
    cfg = spec.config
    run_dir = cfg.run_dir
    artifacts.write_csv(artifacts.join(run_dir, "metrics.csv"), state["history"])
    artifacts.write_csv(artifacts.join(run_dir, "timings.csv"), state["timings"])
    verdict = Bound.of_row(row).describe(spec.slots)
    _say(spec, format_row(row, cfg.epochs, spec.sizes is not None) + verdict, row["epoch"] - 1)
    fell_back = cpu_fallback(row) if spec.slots.on_gpu else 0.0
    if fell_back > CPU_FALLBACK and not state.get("said_fallback"):  # once a run
        state["said_fallback"] = True
        _say(
            spec,
            f"note: {100 * fell_back:.1f}% of epoch {row['epoch']}'s images were decoded on the CPU, not the GPU "
            "(files its decoders refuse: other formats, CMYK, progressive JPEGs the engines refuse; or a batch they "
            "failed on); timings.csv's decoded_* columns count them per epoch",
        )


CPU_FALLBACK = 0.01  # a GPU run's share of images decoded on the CPU past which the console says so


def cpu_fallback(row: dict) -> float:
    """An epoch's share of images decoded on the CPU (its timings row's decoded_* counts)."""
    counts = {p: int(row.get(f"decoded_{p}") or 0) for p in DECODE_PLACES}
    return counts["cpu"] / max(sum(counts.values()), 1)


def report(metrics: dict, state: dict | None, epoch: int) -> None:
    """ray.train.report from every rank; rank 0 (the one with a state) attaches the checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if state is not None:
            torch.save(state, os.path.join(tmp, CHECKPOINT_FILE))
            ckpt = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=f"checkpoint_epoch_{epoch + 1:04d}")


def _say(spec: WorkerSpec, line: str, epoch: int = -1) -> None:
    """A line for the run's console: the driver prints it (training/console.py), after closing the
    bar of `epoch` when the line ends one."""
    try:
        ray.get(spec.board.say.remote(epoch, line))
    except ray.exceptions.RayActorError:  # the console's actor is gone: lose the line, not the run
        pass


def format_row(row: dict, epochs: int, show_size: bool = False) -> str:
    """An epoch's line, less the verdict on what bounded it."""
    size = f"  {row['image_size']}px" if show_size else ""
    return (
        f"epoch {row['epoch']:>3}/{epochs}{size}  loss {row['train_loss']:.4f}  acc {row['train_acc']:.4f}  "
        f"val_loss {row['val_loss']:.4f}  val_acc {row['val_acc']:.4f}  "
        f"{row['images_per_s']:.0f} img/s  waiting for data {100 * row['data_wait_frac']:.0f}%"
    )
