"""The per-worker train loop run by Ray Train: restore, build, then per epoch train, evaluate,
record and checkpoint.

Split as torchvision's classification reference splits its script
(references/classification/train.py: `train_one_epoch`, `evaluate`, `main`): `train_epoch` and
`evaluate` take a Learner (training/worker/learner.py), the epoch's bookkeeping is an EpochMeter
(training/worker/meter.py), the batches come from the feed (training/worker/feed.py), and
`train_loop` strings the named steps together. It receives a WorkerSpec (training/spec.py: the
config and what the driver found out) and hands back a RunRecord (training/records.py) in each
checkpoint; rank 0 alone writes files. docs/design.md has the contracts this room keeps: the
epoch stamp, the per-rank random streams, the stall checks.
"""

from __future__ import annotations

import os
import tempfile

import ray
import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F

from augment.mix import mix_generator
from training import artifacts
from training.bounds import Bound
from training.config import TrainConfig
from training.console import quiet_worker_logs
from training.records import RunRecord, StaleRecords
from training.rows import EPOCH, IMAGE, LABEL
from training.spec import WorkerSpec
from training.stamp import check_stamp
from training.status import EpochProgress, say
from training.worker.feed import EpochData, IngestWatch
from training.worker.learner import (
    CheckpointMismatch,
    Learner,
    all_gather,
    all_reduce,
    build_learner,
    rng_state,
    seed_rank,
    set_rng_state,
)
from training.worker.meter import CPU_FALLBACK, EpochMeter, cpu_fallback, epoch_record

CHECKPOINT_FILE = "checkpoint.pt"


# --------------------------------------------------------------------------- a step, an epoch


def train_step(learner: Learner, batch: dict, *, epoch: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on one batch; returns the loss and the logits (still on the device)."""
    cfg = learner.cfg
    x, y = learner.normalize(batch[IMAGE], learner.input_dtype), batch[LABEL]
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


def train_epoch(learner: Learner, batches, *, epoch: int, rank: int, bar=None) -> dict:
    """One pass over this rank's shard (torchvision's train_one_epoch); loss and accuracy summed
    over ranks. Fails (StaleBatch) if any batch was augmented for another epoch."""
    learner.model.train()
    meter = EpochMeter(learner.device, epoch)
    for batch in meter.timed(batches):
        if meter.steps == 0:
            check_stamp(batch[EPOCH], epoch)
        meter.begin_step()
        loss, logits = train_step(learner, batch, epoch=epoch, step=meter.steps, rank=rank)
        meter.update(batch, loss, logits)
        if bar is not None:
            bar.update(batch[LABEL].shape[0], meter.sums)  # reads the loss sum (a host sync) at most once an interval
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
        logits = model(learner.normalize(batch[IMAGE])).float()
        y = batch[LABEL]
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        k = min(5, num_classes)
        top5 += (logits.topk(k, dim=1).indices == y[:, None]).any(1).sum()
        confusion += torch.bincount(y * num_classes + logits.argmax(1), minlength=num_classes**2).double()
    packed = all_reduce(torch.cat([loss_sum[None], top5[None], confusion])).cpu()
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


# --------------------------------------------------------------------------- the loop


def train_loop(config: dict) -> None:
    """Ray Train's per-worker function: restore, build, then per epoch train, evaluate,
    record and checkpoint."""
    spec: WorkerSpec = config["spec"]
    cfg, ctx = spec.config, ray.train.get_context()
    quiet_worker_logs(cfg.verbose)
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = setup_worker(cfg, spec.threads_per_worker)
    run, learner_state, resumed_from = restore(cfg, device)
    first, last = run.last_epoch + 1, last_epoch(cfg, run.last_epoch + 1)
    data = EpochData(spec, rank, device)
    feed = data.feed(first) if first < last else None  # the first batch is on its way while the model builds
    learner, init_digest = build_learner(spec, world, device)
    node = ray.get_runtime_context().get_node_id()
    run.ranks = all_gather({"rank": rank, "node_id": node, "init_digest": init_digest})
    data.watch = IngestWatch(spec.ingest, [r["node_id"] for r in run.ranks], spec.stall)
    if feed is not None:
        feed.watch = data.watch
    resumed = resume_or_seed(learner, run, learner_state, resumed_from, rank, world)
    if resumed and rank == 0:
        say(spec.status, resumed)
        spec.status.checkpointed.remote(resumed_from)  # what a stop before the next checkpoint resumes from
    run.resumed_at_epochs += [first + 1] if resumed_from else []
    for epoch in range(first, last):
        bar = EpochProgress(spec.status.post.remote, rank=rank, epoch=epoch)  # every rank; a fault line names the step
        with feed or data.feed(epoch) as batches:  # the feed's thread stops with the epoch, however it ends
            stats = train_epoch(learner, batches, epoch=epoch, rank=rank, bar=bar)
        bar.close()
        feed = None
        with data.validation() as batches:
            stats |= evaluate(learner, batches, spec.num_classes)
        lr, gpus = learner.scheduler.get_last_lr()[0], world if spec.slots.on_gpu else 1
        run.add(epoch_record(epoch, stats, lr=lr, first=epoch == first, slots=spec.slots, gpus=gpus))
        run.slots, run.rng, run.schedule_epochs = spec.slots.to_state(), all_gather(rng_state(device)), cfg.epochs
        if rank == 0:
            write_records(spec, run)
        report(run, learner.state_dict() if rank == 0 else None, epoch)  # rank 0's checkpoint


def setup_worker(cfg: TrainConfig, threads: int) -> torch.device:
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(threads)
    if cfg.deterministic:
        ray.train.torch.enable_reproducibility(cfg.seed)
    return device


def restore(cfg: TrainConfig, device: torch.device) -> tuple[RunRecord, dict | None, str | None]:
    """The last checkpoint's records and learner state and where it lies, or a fresh record, None
    and None. A resumed run knows where to start before anything else: that decides the first
    epoch's data. A checkpoint of another version of this job is CheckpointMismatch, one line."""
    checkpoint = ray.train.get_checkpoint()
    if not checkpoint:
        return RunRecord.fresh(), None, None
    with checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, CHECKPOINT_FILE), map_location=device, weights_only=True)
    try:
        run = RunRecord.from_state(state.get("records") if isinstance(state, dict) else None)
    except StaleRecords as e:
        raise CheckpointMismatch(
            f"the last checkpoint of --name {cfg.name} was written by another version of this job ({e}); rerun "
            "with --fresh to start over"
        ) from None
    return run, state["learner"], checkpoint.path


def last_epoch(cfg: TrainConfig, first: int) -> int:
    return cfg.epochs if not cfg.stop_after else min(cfg.epochs, first + cfg.stop_after)


def resume_or_seed(learner: Learner, run: RunRecord, state, resumed_from: str | None, rank: int, world: int):
    """A fresh run seeds each rank's own stream; a resumed one loads the learner (`state`: the
    checkpoint's learner state) and puts each rank's stream back where the checkpoint left it (a
    new stream per rank if the world size changed). Returns the line to print on resume."""
    cfg = learner.cfg
    if resumed_from is None:
        seed_rank(cfg.seed, rank)
        return None
    learner.load_state_dict(state, schedule_epochs=run.schedule_epochs)
    if len(run.rng) == world:
        set_rng_state(run.rng[rank], learner.device)
    else:
        seed_rank(cfg.seed, rank, after=run.last_epoch + 1)
    note = "" if len(run.rng) == world else f" ({len(run.rng)} rank streams saved: fresh ones)"
    return f"resumed from {resumed_from} at epoch {run.last_epoch + 2}{note}"


def write_records(spec: WorkerSpec, run: RunRecord) -> None:
    """Rank 0: metrics.csv and timings.csv, and the epoch's line (and, once a run, a GPU's CPU
    decoding said) for the driver's console."""
    cfg, last = spec.config, run.epochs[-1]
    artifacts.write_csv(artifacts.join(cfg.run_dir, "metrics.csv"), run.history)
    artifacts.write_csv(artifacts.join(cfg.run_dir, "timings.csv"), run.timings)
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
            torch.save({"records": run.to_state(), "learner": learner_state}, os.path.join(tmp, CHECKPOINT_FILE))
            ckpt = ray.train.Checkpoint.from_directory(tmp)
        metrics = last.metrics | last.timings
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=f"checkpoint_epoch_{epoch + 1:04d}")


def format_row(row: dict, epochs: int, show_size: bool = False) -> str:
    """An epoch's line, less the verdict on what bounded it."""
    size = f"  {row['image_size']}px" if show_size else ""
    return (
        f"epoch {row['epoch']:>3}/{epochs}{size}  loss {row['train_loss']:.4f}  acc {row['train_acc']:.4f}  "
        f"val_loss {row['val_loss']:.4f}  val_acc {row['val_acc']:.4f}  "
        f"{row['images_per_s']:.0f} img/s  waiting for data {100 * row['data_wait_frac']:.0f}%"
    )
