"""The per-worker train loop run by Ray Train: shard -> model -> step -> report.

`train_loop` receives a plain dict (TrainConfig fields plus what the driver found out:
class names, preset, dataset sizes, the epoch clock). Rank 0 alone writes files.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

from augment.ops import Normalize
from training import artifacts
from training.config import TrainConfig
from training.model import resnet18

CHECKPOINT_FILE = "checkpoint.pt"


def _all_reduce(values: list[float], device) -> list[float]:
    """Sum scalars over ranks (one collective; a host sync)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def warmup_cosine(total_steps: int, warmup_steps: int):
    """LR multiplier per step: linear warm-up, then cosine decay to 0 at total_steps."""
    warmup = max(1, min(warmup_steps, total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return factor


def train_epoch(model, batches, optimizer, scheduler, normalize, device) -> dict:
    """One pass over this rank's shard. Returns global sums (loss, correct, count) and timings."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.int64)
    count, wait_s, start = 0, 0.0, time.perf_counter()
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        batch = next(it, None)  # time blocked here is time the model waited for data
        wait_s += time.perf_counter() - t0
        if batch is None:
            break
        x = normalize(batch["image"])  # uint8 (B, H, W, 3) -> float (B, 3, H, W), channels_last
        y = batch["label"]
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        loss_sum += loss.detach() * y.shape[0]
        correct += (logits.argmax(1) == y).sum()
        count += y.shape[0]
    elapsed = time.perf_counter() - start
    loss_total, correct_total, count_total = _all_reduce([loss_sum.item(), correct.item(), count], device)
    return {
        "train_loss": loss_total / max(count_total, 1),
        "train_acc": correct_total / max(count_total, 1),
        "train_images": int(count_total),
        "epoch_s": elapsed,
        "data_wait_frac": wait_s / max(elapsed, 1e-9),  # rank 0's share of time waiting for input
    }


@torch.no_grad()
def evaluate(model, batches, normalize, device) -> dict:
    """Deterministic validation over this rank's shard, summed over ranks."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for batch in batches:
        logits = model(normalize(batch["image"]))
        y = batch["label"]
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(1) == y).sum())
        count += y.shape[0]
    loss_total, correct_total, count_total = _all_reduce([loss_sum, correct, count], device)
    if count_total == 0:
        return {"val_loss": float("nan"), "val_acc": float("nan")}
    return {"val_loss": loss_total / count_total, "val_acc": correct_total / count_total}


def train_loop(job: dict) -> None:
    cfg = TrainConfig(**job["config"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    master = rank == 0  # gates logging and file writes
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(job["threads_per_worker"])

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = ray.train.torch.prepare_model(resnet18(len(job["class_names"]), image_size=job["image_size"]))
    bare = model.module if hasattr(model, "module") else model  # eval and saving skip DDP's collectives
    per_worker = cfg.batch_size // world
    steps_per_epoch = max(1, math.ceil(job["train_size"] / world / per_worker))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.peak_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.epochs * steps_per_epoch, round(cfg.warmup_epochs * steps_per_epoch))
    )
    normalize = Normalize(job["preset"]["mean"], job["preset"]["std"]).to(device)

    start_epoch, history = 0, []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, CHECKPOINT_FILE), map_location=device, weights_only=True)
        bare.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, history = state["epoch"] + 1, state["history"]

    train_shard, val_shard = ray.train.get_dataset_shard("train"), ray.train.get_dataset_shard("val")
    run_dir = artifacts.join(cfg.storage_path, cfg.name)
    for epoch in range(start_epoch, cfg.epochs):
        if master:  # before this rank asks for the epoch's data: the split barrier holds the others
            ray.get(job["clock"].set.remote(epoch))
        batches = train_shard.iter_torch_batches(
            batch_size=per_worker,
            device=device,
            drop_last=False,
            local_shuffle_buffer_size=min(4 * per_worker, 2048),
            local_shuffle_seed=cfg.seed * 1_000_003 + epoch * 1009 + rank,  # fresh every epoch, distinct per rank
            prefetch_batches=2,
        )
        stats = train_epoch(model, batches, optimizer, scheduler, normalize, device)
        stats |= evaluate(bare, val_shard.iter_torch_batches(batch_size=per_worker, device=device), normalize, device)
        row = {
            "epoch": epoch + 1,
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items()},
            "images_per_s": round(stats["train_images"] / stats["epoch_s"], 1),
            "lr": round(scheduler.get_last_lr()[0], 6),
        }
        history.append(row)
        if master:
            artifacts.write_csv(artifacts.join(run_dir, "metrics.csv"), history)
            if not cfg.quiet:  # not print(): Ray Train's print patch would log the line twice
                sys.stdout.write(format_row(row, cfg.epochs) + "\n")
                sys.stdout.flush()
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            if master:
                state = {
                    "model": bare.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "epoch": epoch,
                    "history": history,
                }
                torch.save(state, os.path.join(tmp, CHECKPOINT_FILE))
                ckpt = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report({**row, "node_id": ray.get_runtime_context().get_node_id()}, checkpoint=ckpt, checkpoint_dir_name=f"checkpoint_epoch_{epoch + 1:04d}")


def format_row(row: dict, epochs: int) -> str:
    bottleneck = "  << input-bound" if row["data_wait_frac"] > 0.3 else ""
    return (
        f"epoch {row['epoch']:>3}/{epochs}  loss {row['train_loss']:.4f}  acc {row['train_acc']:.4f}  "
        f"val_loss {row['val_loss']:.4f}  val_acc {row['val_acc']:.4f}  "
        f"{row['images_per_s']:.0f} img/s  waiting for data {100 * row['data_wait_frac']:.0f}%{bottleneck}"
    )
