"""The train loop's parts without Ray: the epoch stamp, the learning-rate curve, the random
streams per rank, the view digest, and the stall watch that ends a wait for data that
cannot come."""

from __future__ import annotations

import math
import random
import threading

import numpy as np
import pytest
import torch

from training import loop
from training.config import TrainConfig
from training.loop import (
    BatchFeed,
    IngestStalled,
    IngestWatch,
    Learner,
    StaleBatch,
    StallLimits,
    build_optimizer,
    build_scheduler,
    train_epoch,
)
from training.model import resnet18


def _tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)
    )


def _learner(cfg: TrainConfig, model: torch.nn.Module | None = None, steps_per_epoch: int = 2) -> Learner:
    torch.manual_seed(0)
    return Learner.on_cpu(cfg, model or resnet18(3, small_stem=True), steps_per_epoch)


def _batches(n: int, *, epoch: int, stale_at: int | None = None) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "image": torch.randint(0, 256, (8, 32, 32, 3), dtype=torch.uint8, generator=g),
            "label": torch.arange(8) % 3,
            "key": torch.arange(8) + 8 * i,
            "epoch": torch.full((8,), epoch + (i == stale_at)),
        }
        for i in range(n)
    ]


def test_amp_bf16_trains_in_bfloat16_on_cpu():
    learner = _learner(TrainConfig(amp="bf16", batch_size=8))
    dtypes = []
    learner.model.fc.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    before = learner.model.fc.weight.detach().clone()
    stats = train_epoch(learner, _batches(2, epoch=0), epoch=0, rank=0)
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # the forward ran under bf16 autocast
    weight = learner.model.fc.weight
    assert weight.dtype == torch.float32 and not torch.equal(weight, before)  # fp32 master weights, updated
    assert stats["train_images"] == 16 and math.isfinite(stats["train_loss"])
    (seen,) = stats["seen"]
    assert (seen["count"], seen["distinct"]) == (16, 16)
    assert seen["key_sum"] == sum(range(16))


def test_weight_decay_skips_batchnorm_and_biases():
    from training.loop import param_groups

    model = resnet18(10, small_stem=True)
    decay, no_decay = param_groups(model, 5e-4)
    assert decay["weight_decay"] == 5e-4 and no_decay["weight_decay"] == 0.0
    exempt = {id(p) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()}
    exempt |= {id(m.bias) for m in model.modules() if getattr(m, "bias", None) is not None}
    assert {id(p) for p in no_decay["params"]} == exempt
    assert {id(p) for p in decay["params"]} == {id(p) for p in model.parameters()} - exempt


def test_a_batch_augmented_for_another_epoch_stops_the_epoch():
    learner = _learner(TrainConfig(batch_size=8), _tiny_model())
    with pytest.raises(StaleBatch, match="epoch 2: the first batch was augmented for epoch 1"):
        train_epoch(learner, _batches(2, epoch=0), epoch=1, rank=0)
    with pytest.raises(StaleBatch, match=r"epoch 1: 8 image\(s\) were augmented for another epoch"):
        train_epoch(learner, _batches(3, epoch=0, stale_at=2), epoch=0, rank=0)


@pytest.mark.parametrize("epochs, steps, warmup_epochs", [(5, 7, 1.0), (3, 10, 0.0), (2, 4, 2.0), (4, 100, 0.5)])
def test_warmup_cosine_is_the_closed_form_curve(epochs, steps, warmup_epochs):
    """torch's LinearLR + CosineAnnealingLR in a SequentialLR give, step for step: a linear
    rise to the peak over `warmup` steps, then a half cosine to 0 at the last step."""
    cfg = TrainConfig(epochs=epochs, warmup_epochs=warmup_epochs, batch_size=256, lr=0.1)
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, steps)
    total = epochs * steps
    warmup = max(1, min(round(warmup_epochs * steps), total))
    for k in range(total + 1):
        if k < warmup:
            expected = cfg.peak_lr * (k + 1) / warmup
        else:
            expected = cfg.peak_lr * 0.5 * (1 + math.cos(math.pi * (k - warmup) / max(1, total - warmup)))
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-9, abs=1e-12), k
        optimizer.step()
        scheduler.step()


def _draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), np.random.rand()


def test_each_rank_has_its_own_stream_and_a_checkpoint_restores_it():
    loop.seed_rank(7, 0)
    rank0 = _draws()
    loop.seed_rank(7, 1)
    rank1 = _draws()
    assert all(a != b for a, b in zip(rank0, rank1, strict=True))  # torch, Python and NumPy alike
    loop.seed_rank(7, 0)
    assert _draws() == rank0  # fixed by --seed

    loop.seed_rank(7, 1)
    _draws()
    saved = loop.rng_state(torch.device("cpu"))
    ahead = _draws()
    _draws()
    import io

    buf = io.BytesIO()
    torch.save([saved], buf)  # as a checkpoint holds it, read back the way the loop reads it
    (restored,) = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    loop.set_rng_state(restored, torch.device("cpu"))
    assert _draws() == ahead


def test_view_digest_ignores_order_and_sees_every_pixel():
    images = torch.randint(0, 256, (6, 4, 5, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    keys = torch.arange(6, dtype=torch.int64) * 7919
    digest = loop.view_digest(images, keys)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(2))
    assert loop.view_digest(images[perm], keys[perm]) == digest
    split = (loop.view_digest(images[:2], keys[:2]) + loop.view_digest(images[2:], keys[2:])) % loop.KEY_MOD
    assert split == digest
    for i, y, x, c in [(0, 0, 0, 0), (5, 3, 4, 2), (2, 1, 3, 1)]:
        changed = images.clone()
        changed[i, y, x, c] ^= 1
        assert loop.view_digest(changed, keys) != digest
    swapped = keys.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same views on other images
    assert loop.view_digest(images, swapped) != digest


# --------------------------------------------------------------------------- waiting for data


class _Watch:
    limits = StallLimits(starved_s=0.2, pending_s=10, poll_s=0.05)

    def __init__(self):
        self.waits = []

    def check(self, waited_s):
        self.waits.append(waited_s)
        if waited_s >= self.limits.starved_s:
            raise IngestStalled(f"no batch for {waited_s:.1f} s")


def test_batch_feed_hands_over_every_batch_and_the_source_error():
    assert list(BatchFeed(iter(range(5)), _Watch())) == list(range(5))

    def broken():
        yield 1
        raise ValueError("decoder fell over")

    feed = iter(BatchFeed(broken()))
    assert next(feed) == 1
    with pytest.raises(ValueError, match="decoder fell over"):
        next(feed)


def test_batch_feed_asks_the_watch_while_no_batch_comes_and_stops_on_its_error():
    never = threading.Event()

    def silent():
        never.wait()
        yield 0

    watch = _Watch()
    with pytest.raises(IngestStalled, match="no batch for"):
        next(iter(BatchFeed(silent(), watch)))
    assert len(watch.waits) >= 3 and watch.waits == sorted(watch.waits) and watch.waits[-1] >= 0.2
    never.set()


def _ingest_watch(monkeypatch, nodes, worker_nodes, *, cpus_per_worker, tasks, autoscaling=False, pending=()):
    monkeypatch.setattr(
        loop.ray,
        "nodes",
        lambda: [
            {"NodeID": f"n{i}", "Alive": True, "Resources": {"CPU": c, "GPU": g}} for i, (c, g) in enumerate(nodes)
        ],
    )
    monkeypatch.setattr(loop.ray_private, "pending_demands", lambda: list(pending))
    ingest = {"worker": (cpus_per_worker, 0.0), "tasks": tasks, "autoscaling": autoscaling}
    return IngestWatch(ingest, worker_nodes, StallLimits(starved_s=30, pending_s=600, poll_s=5))


def test_the_watch_stops_a_wait_when_the_train_workers_leave_ray_data_no_room(monkeypatch):
    """The plan that hung a 2-core machine: 2 workers x 1 CPU, read/augment tasks of 0.5 CPU."""
    watch = _ingest_watch(monkeypatch, [(2, 0)], ["n0", "n0"], cpus_per_worker=1, tasks=[(0.5, 0.0)])
    watch.check(29)  # not yet: Ray Data gets time to start
    with pytest.raises(IngestStalled) as err:
        watch.check(31)
    assert str(err.value) == (
        "no batch for 31 s: the 2 train worker(s) hold 1 CPU each, which leaves Ray Data 0 CPU on the node(s), "
        "and it needs 0.5 CPU at once; lower --num-workers or --cpus-per-worker"
    )
    roomy = _ingest_watch(monkeypatch, [(2, 0)], ["n0", "n0"], cpus_per_worker=0.75, tasks=[(0.5, 0.0)])
    assert roomy.starved() is None
    spread = _ingest_watch(monkeypatch, [(2, 0), (2, 0)], ["n0", "n1"], cpus_per_worker=1.75, tasks=[(0.5, 0.0)])
    assert "0.25, 0.25 CPU" in spread.starved()  # 0.5 free in all, but on no single node
    growing = _ingest_watch(
        monkeypatch, [(2, 0)], ["n0", "n0"], cpus_per_worker=1, tasks=[(0.5, 0.0)], autoscaling=True
    )
    growing.check(10_000)  # an autoscaler may add a node for Ray Data: keep waiting


def test_the_watch_stops_a_long_wait_when_ray_reports_data_tasks_it_cannot_place(monkeypatch):
    pending = [({"CPU": 0.5}, 3), ({"CPU": 4.0}, 1)]  # the second: someone else's task
    watch = _ingest_watch(monkeypatch, [(4, 0)], ["n0"], cpus_per_worker=1, tasks=[(0.5, 0.0)], pending=pending)
    watch.check(599)  # room by the plan, and not yet long enough to blame other work
    with pytest.raises(IngestStalled, match=r"no batch for 600 s: Ray reports 3 data task\(s\) waiting"):
        watch.check(600)
    other = _ingest_watch(monkeypatch, [(4, 0)], ["n0"], cpus_per_worker=1, tasks=[(0.5, 0.0)], pending=pending[1:])
    other.check(10_000)  # nothing of ours waits: a slow source, not a stuck one


def test_a_checkpoint_from_the_old_schedule_asks_for_fresh_not_a_traceback():
    """Checkpoints written before the schedule became torch's SequentialLR hold a LambdaLR
    state; resuming one names the run and the fix."""
    cfg = TrainConfig(batch_size=8, name="old-run")
    learner = _learner(cfg, _tiny_model())
    state = learner.state_dict()
    learner.load_state_dict(state)  # its own state loads
    old = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda step: 1.0)
    with pytest.raises(loop.CheckpointMismatch, match=r"--name old-run .*rerun with --fresh to start over"):
        learner.load_state_dict(state | {"scheduler": old.state_dict()})
