"""The fine-tuning knobs and recipe staples (training/worker/recipe.py, the Learner's step), each
shown by its effect on a learner stepped in process without Ray: the head alone trains while the
backbone is frozen, the backbone's learning rate is its fraction of the head's through the
schedule and a resume, N micro-batches equal one batch N times larger, the clipped norm, the EMA's
weights, the class weights in the loss, the early-stop rule, the balanced draw and its audit."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision

from bench.loop_checks import cpu_learner
from tests.conftest import an_epoch_record
from training.config import ConfigError, TrainConfig
from training.driver.audit import sampled_coverage
from training.forms.data import ImageTree, make_split
from training.records import KEY_MOD, ShardRecord
from training.stream.ingest import epoch_order
from training.worker import recipe
from training.worker.learner import Learner
from training.worker.loop import evaluate, train_epoch


def _tiny_model() -> torch.nn.Module:
    """No BatchNorm: the equalities below hold for any batch split (BN's batch statistics would not)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 3),
    )


def _images(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 16, 16, 3), dtype=torch.uint8, generator=g), torch.arange(n) % 3


def _batches(images: torch.Tensor, labels: torch.Tensor, size: int, epoch: int = 0) -> list[dict]:
    return [
        {
            "image": images[i : i + size],
            "label": labels[i : i + size],
            "key": torch.arange(i, i + len(labels[i : i + size])),
            "epoch": torch.full((len(labels[i : i + size]),), epoch),
        }
        for i in range(0, len(labels), size)
    ]


def _learner(steps_per_epoch: int = 2, counts: tuple = (), **settings) -> Learner:
    cfg = TrainConfig(**({"batch_size": 8, "warmup_epochs": 0.0, "epochs": 3} | settings))
    return cpu_learner(cfg, _tiny_model(), steps_per_epoch, class_counts=counts)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------- the head and the backbone


class _TimmLike(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def get_classifier(self):
        return self.last


@pytest.mark.parametrize(
    "build, head",
    [
        (lambda: torchvision.models.resnet18(num_classes=3), lambda m: m.fc),
        (lambda: torchvision.models.mobilenet_v3_small(num_classes=3), lambda m: m.classifier),
        (lambda: torchvision.models.vit_b_16(num_classes=3, image_size=32), lambda m: m.heads),
        (_TimmLike, lambda m: m.last),
        (_tiny_model, lambda m: m[4]),  # no named head: the last Linear layer
    ],
)
def test_the_head_is_the_classifier_of_any_model(build, head):
    model = build()
    assert {id(p) for p in recipe.head_parameters(model)} == {id(p) for p in head(model).parameters()}


def test_frozen_epochs_train_the_head_alone_then_everything():
    learner = _learner(freeze_epochs=1, epochs=2)
    images, labels = _images(16)
    conv, head = learner.bare[0], learner.bare[4]
    before = _params(learner.bare)
    train_epoch(learner, _batches(images, labels, 8, epoch=0), epoch=0, rank=0)
    assert torch.equal(conv.weight, before[0]) and torch.equal(conv.bias, before[1])  # the backbone stood still
    assert not torch.equal(head.weight, before[2])  # the head trained
    train_epoch(learner, _batches(images, labels, 8, epoch=1), epoch=1, rank=0)
    assert not torch.equal(conv.weight, before[0])  # epoch 2: everything trains
    # a run resumed at epoch 2 (a fresh learner) is unfrozen there; at epoch 1 it freezes alike
    resumed = _learner(freeze_epochs=1, epochs=2)
    resumed.load_state_dict(learner.state_dict())
    kept = _params(resumed.bare)
    train_epoch(resumed, _batches(images, labels, 8, epoch=0), epoch=0, rank=0)
    assert torch.equal(resumed.bare[0].weight, kept[0])


@pytest.mark.parametrize("schedule", ["cosine", "onecycle"])
def test_the_backbones_learning_rate_is_its_fraction_of_the_heads_and_survives_a_resume(schedule):
    learner = _learner(backbone_lr_scale=0.1, schedule=schedule, warmup_epochs=1.0, steps_per_epoch=4)
    groups = learner.optimizer.param_groups
    head = {id(p) for p in learner.bare[4].parameters()}
    assert [g["lr_scale"] for g in groups] == [1.0, 1.0, 0.1, 0.1]
    assert {id(p) for g in groups[:2] for p in g["params"]} == head  # the head's groups first: metrics.csv's lr
    images, labels = _images(32)
    for step in range(5):
        assert groups[2]["lr"] == pytest.approx(0.1 * groups[0]["lr"], rel=1e-9), step
        assert groups[0]["lr"] > 0
        train_epoch(learner, _batches(images[:8], labels[:8], 8), epoch=0, rank=0)
    resumed = _learner(backbone_lr_scale=0.1, schedule=schedule, warmup_epochs=1.0, steps_per_epoch=4, epochs=4)
    resumed.load_state_dict(learner.state_dict(), schedule_epochs=3)  # another --epochs: rescheduled
    again = resumed.optimizer.param_groups
    assert [g["lr_scale"] for g in again] == [1.0, 1.0, 0.1, 0.1]
    assert again[2]["lr"] == pytest.approx(0.1 * again[0]["lr"], rel=1e-9) and again[0]["lr"] > 0


# --------------------------------------------------------------------------- accumulation and clipping


@pytest.mark.parametrize("images_n, big", [(64, 32), (48, 32)])
def test_n_micro_batches_equal_one_batch_n_times_larger(images_n, big):
    """Batch 8 with --grad-accum 4 against batch 32 with 1, from the same weights on the same
    images (a model without BatchNorm: its batch statistics would differ by design). 48 images:
    the epoch's last group is 2 micro-batches, stepped on its own mean as a batch of 16 is."""
    images, labels = _images(images_n)
    steps = -(-images_n // big)
    accumulated = _learner(steps_per_epoch=steps, batch_size=8, grad_accum=4)
    whole = _learner(steps_per_epoch=steps, batch_size=32, grad_accum=1)
    assert accumulated.cfg.peak_lr == whole.cfg.peak_lr  # --lr scales with the step's batch
    train_epoch(accumulated, _batches(images, labels, 8), epoch=0, rank=0)
    train_epoch(whole, _batches(images, labels, big), epoch=0, rank=0)
    assert accumulated.scheduler.last_epoch == whole.scheduler.last_epoch == steps  # optimiser steps
    moved = False
    for a, b, start in zip(
        accumulated.bare.parameters(), whole.bare.parameters(), _tiny_model().parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        moved |= not torch.allclose(a, start)
    assert moved
    one_step_each = _learner(steps_per_epoch=steps, batch_size=8, grad_accum=1)
    train_epoch(one_step_each, _batches(images, labels, 8), epoch=0, rank=0)
    assert not torch.allclose(one_step_each.bare[4].weight, whole.bare[4].weight, atol=1e-4)  # the test can tell


def test_gradients_are_clipped_to_the_norm_before_the_step():
    norms = {}
    for clip in (0.0, 0.01):
        learner = _learner(clip_grad_norm=clip, lr=1.0)
        seen = []
        learner.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, seen=seen: seen.append(
                float(
                    torch.linalg.vector_norm(
                        torch.stack([p.grad.norm() for g in opt.param_groups for p in g["params"]])
                    )
                )
            )
        )
        images, labels = _images(16)
        train_epoch(learner, _batches(images, labels, 8), epoch=0, rank=0)
        norms[clip] = seen
    assert all(n > 0.05 for n in norms[0.0])  # unclipped, the gradients are larger than the bound
    assert norms[0.01] == pytest.approx([0.01, 0.01], rel=1e-4)


# --------------------------------------------------------------------------- EMA, class weights, early stop


def test_the_ema_averages_the_weights_after_each_step_and_is_validated_and_saved():
    learner = _learner(model_ema=0.5)
    after = []
    learner.optimizer.register_step_post_hook(lambda opt, args, kwargs: after.append(_params(learner.bare)))
    images, labels = _images(16)
    train_epoch(learner, _batches(images, labels, 8), epoch=0, rank=0)
    assert len(after) == 2
    for ema, first, second in zip(learner.ema.module.parameters(), *after, strict=True):
        torch.testing.assert_close(ema, 0.5 * first + 0.5 * second)  # the first update copies, then lerp
    scored = evaluate(learner, _batches(*_images(12, seed=1), 6), num_classes=3)
    assert 0 <= scored.acc_ema <= 1 and scored.loss_ema != scored.loss and scored.top5 is None  # 3 classes
    state = learner.state_dict()
    assert state["ema_updates"] == 2 and set(state["ema"]) == set(state["model"])  # model.pt's keys
    resumed = _learner(model_ema=0.5)
    resumed.load_state_dict(state)
    for a, b in zip(resumed.ema.module.parameters(), learner.ema.module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert int(resumed.ema.n_averaged) == 2


def test_balanced_class_weights_weigh_the_loss_a_step_trains_on():
    assert recipe.class_weights([120, 12, 60]) == pytest.approx([192 / 360, 192 / 36, 192 / 180])  # n / (k count)
    learner = _learner(class_weights="balanced", counts=(120, 12, 60))
    images, labels = _images(8)
    batch = _batches(images, labels, 8)[0]
    model = copy.deepcopy(learner.bare)

    loss = learner.train_step(batch, epoch=0, step=0, rank=0)[0].item()
    logits = model(learner.normalize(images))
    weight = torch.tensor(recipe.class_weights([120, 12, 60]))
    assert loss == pytest.approx(float(F.cross_entropy(logits, labels, weight=weight)), rel=1e-5)
    assert loss != pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-3)


def test_early_stop_after_patience_epochs_without_a_better_val_acc():
    history = [an_epoch_record(e, a) for e, a in enumerate([0.5, 0.7, 0.7, 0.65, 0.69], start=1)]
    assert recipe.early_stop_line(history[:4], 3) is None
    assert recipe.early_stop_line(history, 3) == (
        "early stop: no better val_acc for 3 epochs (best 0.7000 at epoch 2); model_best.pt holds that epoch's weights"
    )
    assert recipe.early_stop_line(history, 0) is None and recipe.early_stop_line(history, 4) is None


def test_sync_bn_converts_batchnorm_only_where_asked():
    model = torchvision.models.resnet18(num_classes=3)
    converted = recipe.sync_batchnorm(copy.deepcopy(model), True)
    assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in converted.modules())
    assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in recipe.sync_batchnorm(model, False).modules())


# --------------------------------------------------------------------------- the balanced draw


def _imbalanced_tree() -> ImageTree:
    labels = [0] * 120 + [1] * 12 + [2] * 60
    paths = [f"c{label}/{i}.png" for i, label in enumerate(labels)]
    train = make_split("/data", paths, labels, [100] * len(labels))
    val = make_split("/data", ["c0/v.png"], [0], [100])
    return ImageTree("/data", "hash", ("a", "b", "c"), train, val)


def test_the_balanced_sampler_draws_the_classes_about_equally_from_seed_and_epoch():
    labels = np.asarray(_imbalanced_tree().train.labels)
    order = epoch_order(len(labels), 0, 3, labels)
    assert len(order) == len(labels) and np.array_equal(order, epoch_order(len(labels), 0, 3, labels))
    assert not np.array_equal(order, epoch_order(len(labels), 0, 4, labels))
    drawn = np.bincount(labels[order], minlength=3)
    assert drawn.min() > 0.6 * len(labels) / 3 and drawn.max() < 1.4 * len(labels) / 3, drawn  # shuffled: 120/12/60
    assert len(np.unique(order)) < len(labels)  # with replacement
    assert np.array_equal(np.sort(epoch_order(10, 0, 1)), np.arange(10))  # without labels: a permutation still


def test_the_audit_checks_a_sampled_epoch_against_its_draw():
    tree = _imbalanced_tree()
    keys = tree.train.keys % KEY_MOD
    drawn = keys[epoch_order(len(keys), 7, 0, np.asarray(tree.train.labels))]
    unique = np.unique(drawn)
    right = ShardRecord(len(drawn), len(unique), int(unique.sum() % KEY_MOD), 0, "")
    (ok,) = sampled_coverage([[right]], tree, {}, seed=7)
    assert ok["sampled"] and ok["as_expected"] is True and ok["drawn"] == len(tree.train)
    permutation = ShardRecord(len(keys), len(keys), int(keys.sum() % KEY_MOD), 0, "")  # every image once instead
    (wrong,) = sampled_coverage([[permutation]], tree, {}, seed=7)
    assert wrong["as_expected"] is False


def test_the_imbalance_of_the_training_split_is_said():
    assert _imbalanced_tree().imbalance() == "classes: 3, largest 120 / smallest 12 images (10.0x)"


# --------------------------------------------------------------------------- bad values, one line each


@pytest.mark.parametrize(
    "settings, line",
    [
        ({"freeze_epochs": 5, "epochs": 5}, "--freeze-epochs 5 leaves no epoch of --epochs 5"),
        ({"backbone_lr_scale": 0.0}, r"--backbone-lr-scale must be in \(0, 1\], got 0.0"),
        ({"model_ema": 1.0}, "--model-ema must be 0 .off. or a decay in .0, 1."),
        ({"grad_accum": 0}, "--grad-accum must be 1 or more"),
        ({"clip_grad_norm": -1.0}, "--clip-grad-norm must be 0 .off. or positive"),
        ({"early_stop": -2}, "--early-stop must be 0 .off. or positive"),
        ({"class_weights": "balanced", "sampler": "balanced"}, "together they over-correct it"),
    ],
)
def test_bad_recipe_values_are_one_line(settings, line):
    with pytest.raises(ConfigError, match=line):
        TrainConfig(**settings)


def test_sync_bn_on_cpus_is_refused_before_ray(tree, tmp_path, capsys, no_ray):
    from tests.conftest import exits_2

    err = exits_2(["--data", str(tree), "--storage-path", str(tmp_path), "--device", "cpu", "--sync-bn"], capsys)
    assert "--sync-bn: SyncBatchNorm runs on CUDA GPUs only" in err


def test_the_recipe_is_recorded_in_config_json_fields():
    cfg = dataclasses.asdict(TrainConfig(model_ema=0.99, grad_accum=2, sampler="balanced"))
    assert (cfg["model_ema"], cfg["grad_accum"], cfg["sampler"]) == (0.99, 2, "balanced")
