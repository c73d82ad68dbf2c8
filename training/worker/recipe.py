"""The fine-tuning knobs and recipe staples a learner is built with (docs/guide.md, "Fine-tuning
recipe"): which parameters are the head (head_parameters), the optimiser's parameter groups with
the backbone's learning-rate scale (param_groups), the EMA of the weights (build_ema), the loss's
class weights (class_weights), SyncBatchNorm (sync_batchnorm) and the early-stop rule
(early_stop_line). Each is a few lines around a torch primitive; the learner
(training/worker/learner.py) holds what they build.
"""

from __future__ import annotations

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from training.records import EpochRecord

HEAD_NAMES = ("fc", "classifier", "heads", "head")  # torchvision's (and most hand-written models') heads


def head_module(model: torch.nn.Module) -> torch.nn.Module:
    """The classifier layer(s) of `model`: a timm model's get_classifier(), else the first of
    HEAD_NAMES that is a module with parameters (torchvision: resnet's fc, efficientnet's and
    convnext's classifier, vit's heads), else the last Linear layer."""
    getter = getattr(model, "get_classifier", None)
    if callable(getter):
        head = getter()
        if isinstance(head, torch.nn.Module) and any(True for _ in head.parameters()):
            return head
    for name in HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module) and any(True for _ in head.parameters()):
            return head
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not linear:
        raise ValueError(f"{type(model).__name__} has no classifier layer (fc, classifier, heads) nor a Linear layer")
    return linear[-1]


def head_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The head's parameters (head_module); every other parameter is the backbone's."""
    return list(head_module(model).parameters())


def param_groups(model: torch.nn.Module, weight_decay: float, backbone_lr_scale: float = 1.0) -> list[dict]:
    """Weight decay on conv/linear weights only (decaying BatchNorm scales and biases hurts); with
    a backbone_lr_scale below 1, the head's groups first (the schedule's learning rate: metrics.csv's
    `lr`), then the backbone's at that fraction. Each group's `lr_scale` is its fraction of the
    schedule's rate; the optimiser's state_dict keeps it, so a resumed run has it back."""
    split = backbone_lr_scale != 1.0
    head = {id(p) for p in head_parameters(model)} if split else set()
    groups = []
    for scale, mine in ((1.0, True), (backbone_lr_scale, False)):
        params = [p for p in model.parameters() if (id(p) in head or not split) == mine]
        for decayed, decay in ((True, weight_decay), (False, 0.0)):
            chosen = [p for p in params if (p.ndim > 1) == decayed]
            if chosen or not split:  # unsplit: always the two groups
                groups.append({"params": chosen, "weight_decay": decay, "lr_scale": scale})
        if not split:
            break
    return groups


def build_ema(model: torch.nn.Module, decay: float) -> AveragedModel | None:
    """An exponential moving average of `model`'s weights and buffers (BatchNorm's running
    statistics too: use_buffers), updated after each optimiser step; None where --model-ema is 0."""
    if not decay:
        return None
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def class_weights(counts: tuple[int, ...] | list[int]) -> list[float]:
    """sklearn's "balanced" class weights, n / (k * count) per class, from the training split's
    class counts; a class without training images gets 1 (no target ever weighs it)."""
    n, k = sum(counts), len(counts)
    return [n / (k * c) if c else 1.0 for c in counts]


def sync_batchnorm(model: torch.nn.Module, on: bool) -> torch.nn.Module:
    """`model` with every BatchNorm a SyncBatchNorm (its statistics over all DDP ranks' batches)
    where `on`: --sync-bn on a CUDA run of several ranks (SyncBatchNorm has no CPU kernel)."""
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) if on else model


def early_stop_line(epochs: list[EpochRecord], patience: int) -> str | None:
    """The line that stops a run after `patience` epochs without a better val_acc than the best
    before them (None: go on, or --early-stop off). Every rank has the same records (the metrics
    are reduced over the ranks), so every rank stops at the same epoch, and a resumed run reads it
    from its records."""
    if not patience or not epochs:
        return None
    accs = [e.val.acc for e in epochs]
    best = max(range(len(accs)), key=lambda i: (accs[i], -i))  # the first epoch that reached the best
    if len(accs) - 1 - best < patience:
        return None
    return (
        f"early stop: no better val_acc for {patience} epochs (best {accs[best]:.4f} at epoch "
        f"{epochs[best].epoch}); model_best.pt holds that epoch's weights"
    )
