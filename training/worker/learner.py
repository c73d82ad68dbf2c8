"""A train worker's learner: the model, optimizer, schedule, scaler, normalisation and mixing a
step touches (Learner, build_learner), the collectives the epoch's figures go through, and each
rank's own random stream (seed_rank, rng_state, set_rng_state).

The initial weights are identical on every rank (seeded with --seed before the model is built);
right after, each rank seeds torch, Python's `random` and NumPy from a stream of its own, which
a checkpoint saves and a resumed rank restores (docs/design.md, "Randomness per rank").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import random
import warnings
from collections.abc import Callable

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

from augment.mix import MixUpCutMix, mix_generator
from augment.ops import Normalize
from augment.streams import stream_seed
from training.config import TrainConfig
from training.model import initial_model
from training.rows import IMAGE, LABEL
from training.spec import WorkerSpec
from training.worker.recipe import build_ema, class_weights, head_parameters, param_groups, sync_batchnorm


class CheckpointMismatch(RuntimeError):
    """The run's last checkpoint does not fit this version or these settings."""


def build_optimizer(cfg: TrainConfig, model) -> torch.optim.Optimizer:
    """SGD or AdamW over recipe.param_groups: each group at its `lr_scale` of the peak."""
    groups = param_groups(model, cfg.weight_decay, cfg.backbone_lr_scale)
    for group in groups:
        group["lr"] = cfg.peak_lr * group["lr_scale"]
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
            optimizer,
            max_lr=[cfg.peak_lr * g.get("lr_scale", 1.0) for g in optimizer.param_groups],
            total_steps=total + 1,
            pct_start=min(0.5, max(warmup / total, 0.01)),
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


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def all_gather(obj) -> list:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------- random streams per rank


def rank_seed(seed: int, rank: int, after: int = 0) -> int:
    """The seed of one rank's own random stream: distinct per rank, fixed by --seed; `after`: the
    epoch a resumed run starts at where the saved streams do not fit its world size (0: fresh)."""
    return stream_seed("rank", seed, rank, after)


def seed_rank(seed: int, rank: int, after: int = 0) -> None:
    """After the identical initial weights: every later draw on this rank (dropout, random
    tensors, Python's and NumPy's global generators) comes from the rank's own stream."""
    s = rank_seed(seed, rank, after)
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
    ema: torch.optim.swa_utils.AveragedModel | None = None  # --model-ema: the weights' moving average
    class_weight: torch.Tensor | None = None  # --class-weights balanced: (classes,) float32 on the device
    rewrap: Callable | None = None  # the plain module -> what steps call (DDP), again after a freeze changes
    frozen: bool = False  # the backbone's parameters take no gradient (--freeze-epochs)
    pending: int = 0  # micro-batches backpropagated since the last optimiser step (--grad-accum)

    # ----------------------------------------------------------------------- the recipe's step

    def train_step(
        self, batch: dict, *, epoch: int, step: int, rank: int, last: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's forward and backward, and the optimizer step where it closes a group of
        --grad-accum (or is the epoch's `last`); returns the loss and the logits (still on the device).
        The parts below are its steps, so the whole step reads in this file."""
        x, y = self.normalize(batch[IMAGE], self.input_dtype), batch[LABEL]
        target, smoothing = y, self.cfg.label_smoothing
        if self.mix is not None:  # soft targets, replayable from (seed, epoch, step, rank)
            x, target = self.mix(x, y, mix_generator(self.cfg.seed, epoch, step, rank))
            smoothing = 0.0  # already folded into the soft targets
        closing = self.closes_step(last)
        with self.grad_sync(closing):  # DDP reduces the gradients of a closing micro-batch only
            with self.autocast():
                logits = self.model(x)
                loss = F.cross_entropy(logits, target, weight=self.class_weight, label_smoothing=smoothing)
            self.backward(loss)
        if closing:
            self.step()
        return loss, logits

    def freeze_backbone(self, frozen: bool) -> None:
        """Every parameter but the head's (recipe.head_parameters) takes no gradient while `frozen`
        (the optimiser then skips them: their grad stays None). DDP registers the parameters that
        take gradients when it wraps a model, so a change wraps the plain module again (every rank
        at the same epoch). BatchNorm's running statistics still follow the batches."""
        if frozen == self.frozen:
            return
        head = {id(p) for p in head_parameters(self.bare)}
        for p in self.bare.parameters():
            p.requires_grad_(not frozen or id(p) in head)
        self.frozen = frozen
        if self.rewrap is not None:
            self.model = self.rewrap(self.bare)

    def closes_step(self, last: bool) -> bool:
        """Counts a micro-batch in; True where it is the last of a group of --grad-accum (or of
        the epoch: `last`), whose backward the optimiser step follows."""
        self.pending += 1
        return last or self.pending >= self.cfg.grad_accum

    def grad_sync(self, closing: bool):
        """DDP's no_sync on a micro-batch that does not close a step: its gradients add up locally,
        and the closing one's backward reduces the sum over the ranks once."""
        if closing or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """Each micro-batch's loss counts 1 / --grad-accum of the step's (a mean over all its images)."""
        self.scaler.scale(loss / self.cfg.grad_accum).backward()

    def step(self) -> None:
        """The optimiser step on the gradients summed since the last: a group cut short by the
        epoch's end is scaled to its own mean, the norm clipped (--clip-grad-norm, after unscaling
        fp16's), then the schedule moves and the EMA follows the new weights."""
        short, clip = self.pending < self.cfg.grad_accum, self.cfg.clip_grad_norm
        if short or clip:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.bare.parameters() if p.grad is not None]
        if short:
            for p in params:
                p.grad.mul_(self.cfg.grad_accum / self.pending)
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = 0
        if self.ema is not None:
            self.ema.update_parameters(self.bare)

    def reschedule(self, steps_done: int) -> None:
        """The schedule for --epochs as set now, moved on by the steps already taken (the optimizer's
        learning rate with it)."""
        steps_per_epoch = self.scheduler.steps_per_epoch
        for group in self.optimizer.param_groups:  # a new schedule starts from the peak it scales
            group["lr"] = self.cfg.peak_lr * group.get("lr_scale", 1.0)
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
        ema = {"ema": self.ema.module.state_dict(), "ema_updates": int(self.ema.n_averaged)} if self.ema else {}
        return {
            "model": self.bare.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            **ema,  # the EMA's module state, as model.pt's (results write it as model_ema.pt)
        }

    def load_state_dict(self, state: dict, schedule_epochs: int | None = None) -> None:
        """The checkpoint's model, optimizer, scaler and schedule (built for `schedule_epochs`; None:
        this run's --epochs, as the run's records say where they were built for another). A run
        resumed with another --epochs (the only schedule setting a rerun may change:
        training.driver.inputs.SAME_RUN_SETTINGS) gets the schedule of the new length, at the step the
        checkpoint reached."""
        try:
            self.bare.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if schedule_epochs in (None, self.cfg.epochs):
                self.scheduler.load_state_dict(state["scheduler"])
            else:
                self.reschedule(state["scheduler"]["last_epoch"])
            self.scaler.load_state_dict(state["scaler"])
            if self.ema is not None:
                self.ema.module.load_state_dict(state["ema"])
                self.ema.n_averaged.fill_(state["ema_updates"])
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
    model, _ = initial_model(cfg, num_classes, spec.image_size)  # the driver said which tensors it loaded
    init_digest = params_digest(model)
    model = sync_batchnorm(model, cfg.sync_bn and world > 1 and device.type == "cuda")
    wrap = functools.partial(wrap_model, compiled=cfg.compile)
    model = wrap(model)
    bare = model.module if hasattr(model, "module") else model
    bare = getattr(bare, "_orig_mod", bare)
    optimizer = build_optimizer(cfg, model)
    micro = max(1, math.ceil(spec.train_images / world / spec.batch_per_worker))  # micro-batches an epoch
    mix = spec.preset.mix
    weight = class_weights(spec.class_counts) if cfg.class_weights == "balanced" else None
    learner = Learner(
        cfg=cfg,
        device=device,
        model=model,
        bare=bare,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg, optimizer, max(1, math.ceil(micro / cfg.grad_accum))),  # optimiser steps
        scaler=torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16"),
        normalize=Normalize(spec.preset.mean, spec.preset.std).to(device),
        mix=MixUpCutMix(num_classes=num_classes, **({"label_smoothing": cfg.label_smoothing} | mix)) if mix else None,
        ema=build_ema(bare, cfg.model_ema),
        class_weight=torch.tensor(weight, dtype=torch.float32, device=device) if weight else None,
        rewrap=wrap if world > 1 else None,  # one rank: the plain (or compiled) module sees the change itself
    )
    return learner, init_digest


def wrap_model(model: torch.nn.Module, *, compiled: bool) -> torch.nn.Module:
    """What steps call: Ray Train's DDP wrapper (on the device; none for one rank), compiled
    where --compile says."""
    model = ray.train.torch.prepare_model(model)
    return torch.compile(model) if compiled else model
