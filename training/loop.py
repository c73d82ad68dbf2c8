"""The per-worker train loop run by Ray Train: shard -> model -> step -> report.

`train_loop` receives a plain dict (TrainConfig fields plus what the driver found out:
class names, preset, dataset sizes, the epoch clock). Rank 0 alone writes files.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import tempfile
import threading
import time

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

from augment.mix import MixUpCutMix, mix_generator
from augment.ops import Normalize
from training import artifacts
from training.config import TrainConfig
from training.console import EpochProgress, quiet_worker_logs
from training.model import load_init_weights, resnet18, uses_small_stem

CHECKPOINT_FILE = "checkpoint.pt"
KEY_MOD = (1 << 31) - 1  # per-epoch key digests are kept modulo this (int64 math never overflows)
TIMING_COLUMNS = ("epoch_s", "images_per_s", "data_wait_frac")  # wall-clock, never deterministic


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


def warmup_cosine(total_steps: int, warmup_steps: int):
    """LR multiplier per step: linear warm-up, then cosine decay to 0 at total_steps."""
    warmup = max(1, min(warmup_steps, total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return factor


def build_scheduler(cfg: TrainConfig, optimizer, steps_per_epoch: int):
    total = cfg.epochs * steps_per_epoch
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    if cfg.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=cfg.peak_lr, total_steps=total + 1, pct_start=min(0.5, max(warmup / total, 0.01))
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total, warmup))


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


# --------------------------------------------------------------------------- epochs


def train_epoch(
    model,
    batches,
    optimizer,
    scheduler,
    scaler,
    normalize,
    cfg: TrainConfig,
    device,
    *,
    epoch: int,
    rank: int,
    mix=None,
    bar=None,
) -> dict:
    """One pass over this rank's shard; loss and accuracy summed over ranks."""
    model.train()
    amp = (
        torch.autocast(device.type, dtype=torch.bfloat16 if cfg.amp == "bf16" else torch.float16)
        if cfg.amp != "off"
        else contextlib.nullcontext()
    )
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # loss*n, correct: stays on device, no per-step sync
    local_count = 0  # images this rank trained on (a host-side int: no device tensor per step)
    digest = torch.zeros(2, device=device, dtype=torch.int64)  # sum of keys, order hash (mod KEY_MOD)
    wait_s, start, step, first_step_at, side = 0.0, time.perf_counter(), 0, None, None
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        batch = next(it, None)  # time blocked here is time the model waited for input
        wait_s += time.perf_counter() - t0
        if batch is None:
            break
        x, y = normalize(batch["image"]), batch["label"]  # uint8 (B,H,W,3) -> float (B,3,H,W) channels_last
        side = x.shape[-1]  # the resolution trained at (progressive resizing changes it by epoch)
        target, smoothing = y, cfg.label_smoothing
        if (
            mix is not None
        ):  # MixUp/CutMix where the labels are: soft targets, replayable from (seed, epoch, step, rank)
            x, target = mix(x, y, mix_generator(cfg.seed, epoch, step, rank))
            smoothing = 0.0  # already folded into the soft targets
        step += 1
        with amp:
            logits = model(x)
            loss = F.cross_entropy(logits, target, label_smoothing=smoothing)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        sums += torch.stack([loss.detach().double() * y.shape[0], (logits.argmax(1) == y).sum().double()])
        local_count += y.shape[0]
        if first_step_at is None:  # once per epoch: when the first step finished (start-up ends there)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_step_at = time.time()
        if bar is not None:
            bar.update(y.shape[0], sums)  # reads the loss sum (a host sync) at most once an interval
        keys = batch["key"] % KEY_MOD
        digest = torch.stack([(digest[0] + keys.sum()) % KEY_MOD, (digest[1] * 1_000_003 + keys[0]) % KEY_MOD])
    elapsed = time.perf_counter() - start
    key_sum, order_hash = digest.tolist()  # the epoch's host syncs are here, after the last step
    # which images this rank trained on: the driver checks that the ranks' union is the dataset
    seen = _all_gather({"count": local_count, "key_sum": key_sum, "order_hash": order_hash})
    loss_sum, correct, count = _all_reduce(torch.cat([sums, sums.new_tensor([local_count])])).tolist()
    return {
        "train_loss": loss_sum / max(count, 1),
        "train_acc": correct / max(count, 1),
        "train_images": int(count),
        "epoch_s": elapsed,
        "data_wait_frac": wait_s / max(elapsed, 1e-9),  # this rank's share of time waiting for input
        "seen": seen,
        "first_step_at": first_step_at,
        "image_size": side,
    }


@torch.no_grad()
def evaluate(model, batches, normalize, num_classes: int, device) -> dict:
    """Deterministic validation over this rank's shard; loss, top-1, top-5 and the confusion
    matrix summed over ranks (every validation image is scored exactly once)."""
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    top5 = torch.zeros((), device=device, dtype=torch.float64)
    confusion = torch.zeros(num_classes * num_classes, device=device, dtype=torch.float64)
    for batch in batches:
        logits = model(normalize(batch["image"])).float()
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


# --------------------------------------------------------------------------- the loop


class FirstBatchEarly:
    """An iterable of batches whose first batch is fetched in a thread from the moment it is
    made. The train loop makes the first epoch's one before it builds the model, so Ray
    Data's start (split coordinator, read, decode and augment workers and their imports)
    overlaps the model's build instead of following it."""

    _END = object()

    def __init__(self, batches):
        self._box: dict = {}
        self._thread = threading.Thread(target=self._pull, args=(batches,), daemon=True, name="first-batch")
        self._thread.start()

    def _pull(self, batches) -> None:
        try:
            it = iter(batches)
            self._box["first"], self._box["rest"] = next(it, self._END), it
        except BaseException as e:  # re-raised in the training thread
            self._box["error"] = e

    def __iter__(self):
        self._thread.join()
        if "error" in self._box:
            raise self._box["error"]
        if self._box["first"] is not self._END:
            yield self._box["first"]
            yield from self._box["rest"]


def train_loop(job: dict) -> None:
    cfg = TrainConfig(**job["config"])
    quiet_worker_logs(cfg.verbose)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    master = rank == 0  # gates console output and file writes
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(job["threads_per_worker"])
    if cfg.deterministic:
        ray.train.torch.enable_reproducibility(cfg.seed)

    checkpoint = ray.train.get_checkpoint()  # a resumed run: where to start decides the first epoch's data
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, CHECKPOINT_FILE), map_location=device, weights_only=True)
    else:
        state = {"epoch": -1, "history": [], "timings": [], "seen": [], "resumed_at_epochs": [], "first_steps": []}
    start_epoch, history, timings, seen_per_epoch = (
        state["epoch"] + 1,
        state["history"],
        state["timings"],
        state["seen"],
    )
    resumed_at = state["resumed_at_epochs"] + ([start_epoch + 1] if checkpoint else [])
    first_steps = state.get(
        "first_steps", []
    )  # time.time() when each attempt's first step ended (Ray Train restarts, reruns)
    last_epoch = cfg.epochs if not cfg.stop_after else min(cfg.epochs, start_epoch + cfg.stop_after)
    per_worker = cfg.batch_size // world
    train_shard = ray.train.get_dataset_shard("train")  # "val" at the first validation: with several
    val_shard = None  # workers, its split coordinator (one more process) starts after the first steps

    def epoch_batches(epoch: int):
        if master:  # before this rank asks for the epoch's data: the split barrier holds the others
            ray.get(job["clock"].set.remote(epoch))
        # Every epoch reads the files in a permutation of its own (training/ingest.py), so at
        # epoch 0 a local shuffle adds little, and Ray Data's would hold back the first batch until
        # batch + 1.5 x buffer rows had arrived; block prefetch would wait for the second
        # block. Without both, the first step starts on the first block.
        first = epoch == 0
        return train_shard.iter_torch_batches(
            batch_size=per_worker,
            device=device,
            local_shuffle_buffer_size=None if first else min(4 * per_worker, 2048),
            local_shuffle_seed=cfg.seed * 1_000_003 + epoch * 1009 + rank,  # fresh every epoch, distinct per rank
            prefetch_batches=0 if first else 2,
        )

    first_epoch_batches = FirstBatchEarly(epoch_batches(start_epoch)) if start_epoch < last_epoch else None

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    num_classes = len(job["class_names"])
    model = resnet18(num_classes, small_stem=uses_small_stem(cfg.small_stem, job["image_size"]))
    if cfg.init_weights:
        skipped = load_init_weights(model, cfg.init_weights)
        if master:
            _say(
                job,
                f"init weights from {cfg.init_weights}; fresh: "
                f"{', '.join(sorted({k.rsplit('.', 1)[0] for k in skipped}))}",
            )
    init_digest = params_digest(model)
    model = ray.train.torch.prepare_model(model)
    if cfg.compile:
        model = torch.compile(model)
    bare = model.module if hasattr(model, "module") else model  # eval and saving skip DDP's collectives
    bare = getattr(bare, "_orig_mod", bare)

    steps_per_epoch = max(1, math.ceil(job["train_size"] / world / per_worker))
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")
    normalize = Normalize(job["preset"]["mean"], job["preset"]["std"]).to(device)
    mix_cfg = job["preset"].get("mix")
    mix = (
        MixUpCutMix(num_classes=num_classes, **({"label_smoothing": cfg.label_smoothing} | mix_cfg))
        if mix_cfg
        else None
    )
    ranks = _all_gather({"rank": rank, "node_id": ray.get_runtime_context().get_node_id(), "init_digest": init_digest})
    if checkpoint:
        bare.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"]["cpu"].cpu())  # map_location moved it to the device
        if master:
            _say(job, f"resumed from {checkpoint.path} at epoch {start_epoch + 1}")

    run_dir = artifacts.join(cfg.storage_path, cfg.name)
    for epoch in range(start_epoch, last_epoch):
        batches = first_epoch_batches if epoch == start_epoch else epoch_batches(epoch)
        bar = EpochProgress(job["board"].post.remote, rank=rank, epoch=epoch, enabled=job["progress"])  # every rank
        stats = train_epoch(
            model,
            batches,
            optimizer,
            scheduler,
            scaler,
            normalize,
            cfg,
            device,
            epoch=epoch,
            rank=rank,
            mix=mix,
            bar=bar,
        )
        bar.close()
        if val_shard is None:  # every rank asks at once: a barrier
            val_shard = ray.train.get_dataset_shard("val")
        stats |= evaluate(
            bare, val_shard.iter_torch_batches(batch_size=per_worker, device=device), normalize, num_classes, device
        )
        seen_per_epoch.append(stats.pop("seen"))
        epoch_first_step_at = stats.pop("first_step_at")
        if epoch == start_epoch and epoch_first_step_at is not None:
            first_steps.append(epoch_first_step_at)
        confusion = stats.pop("confusion")
        row = {"epoch": epoch + 1, "lr": round(scheduler.get_last_lr()[0], 8)}
        row |= {k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items() if k not in TIMING_COLUMNS}
        timing = {
            "epoch": epoch + 1,
            "epoch_s": round(stats["epoch_s"], 3),
            "images_per_s": round(stats["train_images"] / stats["epoch_s"], 1),
            "data_wait_frac": round(stats["data_wait_frac"], 4),
        }
        history.append(row)
        timings.append(timing)
        if master:
            artifacts.write_csv(artifacts.join(run_dir, "metrics.csv"), history)
            artifacts.write_csv(artifacts.join(run_dir, "timings.csv"), timings)
            _say(job, format_row(row | timing, cfg.epochs, job["sizes"] is not None), epoch)
        state = (
            {
                "model": bare.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "rng": {"cpu": torch.get_rng_state()},
                "epoch": epoch,
                "history": history,
                "timings": timings,
                "confusion": confusion,
                "seen": seen_per_epoch,  # per epoch, per rank: images trained on and their key sum
                "resumed_at_epochs": resumed_at,  # epochs a restart or a rerun continued from
                "ranks": ranks,
                "first_steps": first_steps,
            }
            if master
            else None
        )
        report(row | timing, state, epoch)


def report(metrics: dict, state: dict | None, epoch: int) -> None:
    """ray.train.report from every rank; rank 0 (the one with a state) attaches the checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if state is not None:
            torch.save(state, os.path.join(tmp, CHECKPOINT_FILE))
            ckpt = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=f"checkpoint_epoch_{epoch + 1:04d}")


def _say(job: dict, line: str, epoch: int = -1) -> None:
    """A line for the run's console: the driver prints it (training/console.py), after closing the
    bar of `epoch` when the line ends one."""
    ray.get(job["board"].say.remote(epoch, line))


def format_row(row: dict, epochs: int, show_size: bool = False) -> str:
    waiting = row["data_wait_frac"]
    verdict = "  << input-bound: the model waited for data; add augment actors or CPUs" if waiting > 0.3 else ""
    size = f"  {row['image_size']}px" if show_size else ""
    return (
        f"epoch {row['epoch']:>3}/{epochs}{size}  loss {row['train_loss']:.4f}  acc {row['train_acc']:.4f}  "
        f"val_loss {row['val_loss']:.4f}  val_acc {row['val_acc']:.4f}  "
        f"{row['images_per_s']:.0f} img/s  waiting for data {100 * waiting:.0f}%{verdict}"
    )
