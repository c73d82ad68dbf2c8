"""The train loop's parts without Ray: the epoch stamp, the learning-rate curve, the random
streams per rank, the view digest, and the stall watch that ends a wait for data that
cannot come."""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from augment.presets import PRESETS
from bench.loop_checks import cpu_learner
from tests.conftest import an_epoch_record
from training import records
from training.bounds import DataSlots
from training.config import TrainConfig
from training.model import resnet18
from training.spec import IngestNeeds, StallLimits, WorkerSpec
from training.stream.stamp import StaleBatch
from training.worker import feed, loop, report
from training.worker import learner as learn
from training.worker.feed import BatchFeed, IngestStalled, IngestWatch
from training.worker.learner import Learner, build_optimizer, build_scheduler
from training.worker.loop import train_epoch


def _tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)
    )


def _learner(cfg: TrainConfig, model: torch.nn.Module | None = None, steps_per_epoch: int = 2) -> Learner:
    torch.manual_seed(0)
    return cpu_learner(cfg, model or resnet18(3, small_stem=True), steps_per_epoch)


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
    trained = train_epoch(learner, _batches(2, epoch=0), epoch=0, rank=0)
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # the forward ran under bf16 autocast
    weight = learner.model.fc.weight
    assert weight.dtype == torch.float32 and not torch.equal(weight, before)  # fp32 master weights, updated
    assert trained.images == 16 and math.isfinite(trained.loss) and trained.image_size == 32
    (seen,) = trained.seen
    assert (seen.count, seen.distinct) == (16, 16)
    assert seen.key_sum == sum(range(16))


def test_weight_decay_skips_batchnorm_and_biases():
    from training.worker.learner import param_groups

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


@pytest.mark.parametrize(
    "epochs, steps, warmup_epochs, batch_size, peak",
    [(5, 7, 1.0, 64, 0.025), (3, 10, 0.0, 512, 0.2), (2, 4, 2.0, 256, 0.1), (4, 100, 0.5, 96, 0.0375)],
)
def test_warmup_cosine_is_the_closed_form_curve(epochs, steps, warmup_epochs, batch_size, peak):
    """torch's LinearLR + CosineAnnealingLR in a SequentialLR give, step for step: a linear
    rise to the peak over `warmup` steps, then a half cosine to 0 at the last step. The peak
    is --lr 0.1 scaled by batch_size / 256, written out here (not cfg.peak_lr)."""
    cfg = TrainConfig(epochs=epochs, warmup_epochs=warmup_epochs, batch_size=batch_size, lr=0.1)
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, steps)
    total = epochs * steps
    warmup = max(1, min(round(warmup_epochs * steps), total))
    for k in range(total + 1):
        if k < warmup:
            expected = peak * (k + 1) / warmup
        else:
            expected = peak * 0.5 * (1 + math.cos(math.pi * (k - warmup) / max(1, total - warmup)))
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-9, abs=1e-12), k
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_learning_rate_curve_in_literal_values_at_batch_128_and_512(optimizer):
    """--lr 0.1 is quoted per 256 images of global batch (Goyal et al.): 2 epochs of 4 steps,
    1 of warm-up. Worked by hand at batch 128 (peak 0.05): 4 warm-up steps of 0.05 / 4, then
    0.05 * (1 + cos(pi * j / 4)) / 2 for j = 0..4; batch 512 gives four times as much."""
    at_128 = [0.0125, 0.025, 0.0375, 0.05, 0.05, 0.0426776695, 0.025, 0.0073223305, 0.0]
    for batch_size, scale in ((128, 1), (512, 4)):
        cfg = TrainConfig(epochs=2, warmup_epochs=1.0, batch_size=batch_size, lr=0.1, optimizer=optimizer)
        opt = build_optimizer(cfg, torch.nn.Linear(2, 2))
        scheduler = build_scheduler(cfg, opt, 4)
        curve = []
        for _ in range(9):
            curve.append(opt.param_groups[0]["lr"])
            opt.step()
            scheduler.step()
        assert curve == pytest.approx([scale * v for v in at_128], rel=1e-8, abs=1e-12), batch_size


def _draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), np.random.rand()


def test_each_rank_has_its_own_stream_and_a_checkpoint_restores_it():
    learn.seed_rank(7, 0)
    rank0 = _draws()
    learn.seed_rank(7, 1)
    rank1 = _draws()
    assert all(a != b for a, b in zip(rank0, rank1, strict=True))  # torch, Python and NumPy alike
    learn.seed_rank(7, 0)
    assert _draws() == rank0  # fixed by --seed

    learn.seed_rank(7, 1)
    _draws()
    saved = learn.rng_state(torch.device("cpu"))
    ahead = _draws()
    _draws()
    import io

    buf = io.BytesIO()
    torch.save([saved], buf)  # as a checkpoint holds it, read back the way the loop reads it
    (restored,) = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    learn.set_rng_state(restored, torch.device("cpu"))
    assert _draws() == ahead


def test_view_digest_ignores_order_and_tells_other_views_apart():
    """Order-free and additive over batches; another view of an image (flipped, shifted by a pixel,
    a level brighter) or the same views on other images changes it. It reads one byte in
    loop.DIGEST_STRIDE: a change of one byte it does not read goes unseen, and the test says so."""
    images = torch.randint(0, 256, (6, 24, 24, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    keys = torch.arange(6, dtype=torch.int64) * 7919
    digest = loop.view_digest(images, keys)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(2))
    assert loop.view_digest(images[perm], keys[perm]) == digest
    split = (loop.view_digest(images[:2], keys[:2]) + loop.view_digest(images[2:], keys[2:])) % records.KEY_MOD
    assert split == digest
    for other in (images[3].flip(1), images[3].roll(1, 1), (images[3].int() + 1).clamp(max=255).to(torch.uint8)):
        changed = images.clone()
        changed[3] = other
        assert loop.view_digest(changed, keys) != digest
    unread = images.clone()
    unread.view(6, -1)[0, 1] ^= 1  # byte 1 of image 0: not one the digest reads
    assert loop.view_digest(unread, keys) == digest
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


def test_batch_feed_thread_stops_when_its_consumer_is_done_or_fails():
    """A consumer that leaves early (a stale batch, a non-finite loss) used to leave the feed's
    daemon thread blocked on its full queue, holding the iterator, for the rest of the process."""
    pulled = []

    def endless():
        for i in range(10**9):
            pulled.append(i)
            yield i

    with BatchFeed(endless()) as batches:
        assert next(iter(batches)) == 0
    assert not batches._thread.is_alive()  # noqa: SLF001 - the thread itself is what the test checks
    count = len(pulled)
    time.sleep(0.2)
    assert len(pulled) == count  # nothing pulled after the stop
    feed_ = BatchFeed(endless())
    with pytest.raises(RuntimeError, match="step failed"):
        for _ in feed_:
            raise RuntimeError("step failed")
    assert not feed_._thread.is_alive()  # noqa: SLF001


def test_a_lone_last_image_joins_the_batch_before_it_and_trains_under_the_imagenet_stem():
    """17 images in batches of 8 end with a batch of one, which batch norm refuses at 1 x 1
    (torchvision's stem at 32 px): it is folded into the batch before, nothing lost."""
    batches = _batches(3, epoch=0)
    batches[2] = {k: v[:1] for k, v in batches[2].items()}
    folded = list(feed.fold_lone_last(iter(batches), 8))
    assert [len(b["label"]) for b in folded] == [8, 9]
    assert torch.equal(folded[1]["key"], torch.cat([batches[1]["key"], batches[2]["key"]]))
    assert torch.equal(folded[1]["image"][8], batches[2]["image"][0])
    # batches that are all of one image (a batch size of one per rank) stay as they are
    ones = [{k: v[:1] for k, v in b.items()} for b in batches]
    assert [len(b["label"]) for b in feed.fold_lone_last(iter(ones), 1)] == [1, 1, 1]

    learner = _learner(TrainConfig(data="unused"), resnet18(3, small_stem=False))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        train_epoch(learner, batches, epoch=0, rank=0)  # the bug the fold prevents
    assert train_epoch(learner, folded, epoch=0, rank=0).images == 17


def test_batch_feed_asks_the_watch_while_no_batch_comes_and_stops_on_its_error():
    stalled = threading.Event()

    def silent():  # no batch until the watch gave up; then the feed's thread ends at once, not at close's 10 s
        stalled.wait()
        yield 0

    class Releasing(_Watch):
        def check(self, waited_s):
            try:
                super().check(waited_s)
            except IngestStalled:
                stalled.set()
                raise

    watch = Releasing()
    with pytest.raises(IngestStalled, match="no batch for"):
        next(iter(BatchFeed(silent(), watch)))
    assert len(watch.waits) >= 3 and watch.waits == sorted(watch.waits) and watch.waits[-1] >= 0.2


def _ingest_watch(monkeypatch, nodes, worker_nodes, *, cpus_per_worker, tasks, autoscaling=False, pending=()):
    monkeypatch.setattr(
        feed.ray,
        "nodes",
        lambda: [
            {"NodeID": f"n{i}", "Alive": True, "Resources": {"CPU": c, "GPU": g}} for i, (c, g) in enumerate(nodes)
        ],
    )
    monkeypatch.setattr(feed.ray_private, "pending_demands", lambda: list(pending))
    ingest = IngestNeeds(worker=(cpus_per_worker, 0.0), tasks=tuple(tasks), autoscaling=autoscaling)
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
    learner.load_state_dict(state, cfg.epochs)  # its own state loads
    old = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda step: 1.0)
    with pytest.raises(learn.CheckpointMismatch, match=r"--name old-run .*rerun with --fresh to start over"):
        learner.load_state_dict(state | {"scheduler": old.state_dict()}, cfg.epochs)


# --------------------------------------------------------------------------- what a step trains on

MEAN, STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)


def _built_learner(monkeypatch, cfg: TrainConfig, mix: dict | None) -> Learner:
    """The learner a train worker builds (build_learner) for 3 classes at 32 px, outside Ray
    Train (prepare_model is DDP's wrapper there), with a head that gives confident logits:
    at a fresh init's near-uniform ones every target would give about the same loss."""
    monkeypatch.setattr(learn.ray.train.torch, "prepare_model", lambda model: model)
    spec = WorkerSpec(
        config=cfg,
        class_names=("a", "b", "c"),
        preset=dataclasses.replace(PRESETS["cifar"], mean=MEAN, std=STD, mix=mix),
        train_images=64,
        rows_grouped=False,
        threads_per_worker=1,
        batch_per_worker=cfg.batch_size,
        sizes=None,
        ingest=IngestNeeds(worker=(1.0, 0.0), tasks=((0.5, 0.0),), autoscaling=False),
        slots=DataSlots(read=2, augment=2, fused=True),
        stall=StallLimits(),
        clock=None,
        status=None,
    )
    learner, _ = learn.build_learner(spec, world=1, device=torch.device("cpu"))
    with torch.no_grad():
        learner.bare.fc.weight.mul_(40)
    return learner


def _normalised(images: torch.Tensor) -> torch.Tensor:
    x = images.permute(0, 3, 1, 2).float() / 255
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def _soft_loss(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(-(targets * torch.log_softmax(logits, 1)).sum(1).mean())


def _step(learner: Learner, batch: dict, **where) -> tuple[float, torch.nn.Module]:
    """train_step's loss, and a copy of the model as it was before the step."""
    import copy

    before = copy.deepcopy(learner.bare).requires_grad_(False)  # in train mode still, as the step ran it
    loss, _ = learner.train_step(batch, **where)
    return loss.item(), before


def test_label_smoothing_reaches_the_loss_a_step_trains_on(monkeypatch):
    batch = _batches(1, epoch=0)[0]
    x, y = _normalised(batch["image"]), batch["label"]
    losses = {}
    for smoothing in (0.0, 0.2):
        learner = _built_learner(monkeypatch, TrainConfig(batch_size=8, label_smoothing=smoothing), None)
        assert learner.mix is None
        losses[smoothing], before = _step(learner, batch, epoch=0, step=0, rank=0)
        logits = before(x)
        assert losses[smoothing] == pytest.approx(
            float(F.cross_entropy(logits, y, label_smoothing=smoothing)), rel=1e-5
        )
        by_hand = F.one_hot(y, 3).float() * (1 - smoothing) + smoothing / 3  # [0.8, 0, 0] + 0.2 / 3
        assert losses[smoothing] == pytest.approx(_soft_loss(logits, by_hand), rel=1e-5)
    assert abs(losses[0.2] - losses[0.0]) > 0.05  # the check can tell the two apart


@pytest.mark.parametrize("mix", [{"mixup_alpha": 0.4}, {"cutmix_alpha": 1.0}, {"mixup_alpha": 0.2, "prob": 0.0}])
def test_a_step_trains_on_the_mixers_images_and_soft_targets(monkeypatch, mix):
    """MixUp or CutMix from a preset's `mix:`, with --label-smoothing 0.1 folded into the soft
    targets: the loss train_step reports is the soft-target cross-entropy of the images mixed
    with the parameters the step's own generator draws (epoch 2, step 3, rank 1), mixed and
    weighted here by hand."""
    from augment.mix import mix_generator

    cfg = TrainConfig(batch_size=8, label_smoothing=0.1, seed=5)
    learner = _built_learner(monkeypatch, cfg, mix)
    batch = _batches(1, epoch=2)[0]
    loss, before = _step(learner, batch, epoch=2, step=3, rank=1)
    drawn = learner.mix.sample((32, 32), mix_generator(5, 2, 3, 1))
    x, lam = _normalised(batch["image"]), drawn["lam"]
    if drawn["mode"] == "mixup":
        mixed = lam * x + (1 - lam) * x.roll(1, 0)
    elif drawn["mode"] == "cutmix":
        y1, y2, x1, x2 = drawn["box"]
        mixed = x.clone()
        mixed[:, :, y1:y2, x1:x2] = x.roll(1, 0)[:, :, y1:y2, x1:x2]  # the neighbour's patch
        assert lam == pytest.approx(1 - (y2 - y1) * (x2 - x1) / 32**2) and 0 < lam < 1
    else:
        mixed = x
    assert drawn["mode"] == ("none" if mix.get("prob") == 0 else "mixup" if "mixup_alpha" in mix else "cutmix")
    smoothed = F.one_hot(batch["label"], 3).float() * 0.9 + 0.1 / 3
    targets = lam * smoothed + (1 - lam) * smoothed.roll(1, 0)
    logits = before(mixed)
    assert loss == pytest.approx(_soft_loss(logits, targets), rel=1e-5)
    if drawn["mode"] != "none":  # neither the unmixed images nor the unmixed targets give that loss
        assert abs(loss - _soft_loss(before(x), targets)) > 0.01
        assert abs(loss - _soft_loss(logits, smoothed)) > 0.01


def test_the_feed_mixes_rows_only_where_they_come_in_fixed_groups(ray_cluster):
    """A tree's files are read in a new permutation every epoch, so the feed adds no local
    shuffle buffer there and a batch is a run of rows as read; a prepared split's row groups
    are fixed, so from epoch 1 on its rows are mixed across blocks."""
    import ray

    ds = ray.data.range(512, override_num_blocks=8)

    def batches(shuffle: bool, epoch: int) -> list[list[int]]:
        it = feed.train_batches(ds.iterator(), 32, torch.device("cpu"), epoch, seed=0, rank=0, shuffle=shuffle)
        return [b["id"].tolist() for b in it]

    def runs(got):  # batches that are one run of consecutive rows
        return sum(b == list(range(b[0], b[0] + len(b))) for b in got)

    for shuffle, epoch in ((False, 0), (False, 3), (True, 0)):
        got = batches(shuffle, epoch)
        assert sorted(sum(got, [])) == list(range(512)) and runs(got) == len(got) == 16, (shuffle, epoch)
    mixed = batches(True, 1)
    assert sorted(sum(mixed, [])) == list(range(512)) and runs(mixed) == 0


def test_the_inner_rate_leaves_out_an_epochs_start_and_tail():
    """Steps every 0.1 s of 10 images, but a first batch 5 s late and a last one 3 s late: the rate
    between the steps at 10 % and 90 % of the images is the steady 100 img/s, where the whole
    epoch's would be about 55."""
    times = [5.0 + 0.1 * i for i in range(99)] + [5.0 + 9.8 + 3.0]
    marks = [(t, 10 * (i + 1)) for i, t in enumerate(times)]
    assert report.inner_rate(marks) == pytest.approx(100.0)
    assert report.inner_rate(marks[:2]) == pytest.approx(100.0)  # too few steps between the marks: all of them
    assert report.inner_rate(marks[:1]) == 0.0


def test_a_gpu_runs_share_of_images_decoded_on_the_cpu_is_counted_from_its_figures():
    fell_back = _figures(decoded=(950, 30, 20))  # in DECODE_PLACES' order: engines, gpu_sms, cpu
    assert (
        report.cpu_fallback(fell_back) == pytest.approx(0.02) and report.cpu_fallback(fell_back) > report.CPU_FALLBACK
    )
    assert report.cpu_fallback(_figures(decoded=(0, 0, 0))) == 0.0


def _figures(decoded: tuple[int, ...]) -> records.TrainFigures:
    return dataclasses.replace(an_epoch_record().train, decoded=decoded)


def test_a_loss_that_turns_non_finite_stops_the_run_naming_the_epoch_and_step():
    """A learning rate far too high sends the weights to inf within a few steps: the epoch ends in
    RunStopped, one line naming the step and the flag, and nothing of it is returned to record."""
    learner = _learner(TrainConfig(batch_size=8, lr=1e30, warmup_epochs=0.0), _tiny_model(), steps_per_epoch=4)
    with pytest.raises(loop.RunStopped, match=r"non-finite \(nan or inf\) at step [2-4] of epoch 1; .*lower --lr"):
        train_epoch(learner, _batches(4, epoch=0), epoch=0, rank=0)
    fine = _learner(TrainConfig(batch_size=8), _tiny_model(), steps_per_epoch=4)
    assert math.isfinite(train_epoch(fine, _batches(4, epoch=0), epoch=0, rank=0).loss)


def test_an_epoch_that_trained_no_image_stops_the_run():
    learner = _learner(TrainConfig(batch_size=8), _tiny_model())
    with pytest.raises(loop.RunStopped, match="epoch 3 trained no image: every file of the training split"):
        train_epoch(learner, [], epoch=2, rank=0)


def test_a_stalled_feed_stops_at_once_without_waiting_for_its_source():
    """The watch gave up: the feed's thread still waits inside the source (Ray Data's iterator, for a
    batch that will not come). Leaving the epoch's `with` block, as the train loop does, must not
    wait for that thread (it waited 10 s per close, twice: 20 s more on every stalled run)."""
    never = threading.Event()

    def silent():
        never.wait()
        yield 0

    began = time.monotonic()
    with pytest.raises(IngestStalled, match="no batch for"):
        with BatchFeed(silent(), _Watch()) as batches:
            for _ in batches:
                pass
    assert time.monotonic() - began < 3
    never.set()
