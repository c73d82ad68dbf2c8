"""The per-worker train loop run by Ray Train: restore, build, then per epoch train, evaluate,
record and checkpoint.

Split as torchvision's classification reference splits its script
(references/classification/train.py: `train_one_epoch`, `evaluate`, `main`): `train_epoch` and
`evaluate` take a Learner (training/worker/learner.py), the epoch's per-step bookkeeping is an
EpochMeter (here, as the step's other half), the batches come from the feed
(training/worker/feed.py), and `train_loop` strings the named steps together. It receives a
WorkerSpec (training/spec.py: the config and what the driver found out) and hands back a
RunRecord (training/records.py) in each checkpoint (training/worker/report.py); rank 0 alone
writes files. docs/design.md has the contracts this room keeps: the epoch stamp, the per-rank
random streams, the stall checks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import warnings

import pyarrow.fs as pafs
import ray
import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F

from augment.decode import DECODE_PLACES
from training import storage
from training.config import TrainConfig
from training.records import KEY_MOD, RunRecord, ShardRecord, StaleRecords, TrainFigures, ValFigures
from training.rows import COSTS, DECODED_ON, EPOCH, IMAGE, KEY, LABEL
from training.spec import WorkerSpec
from training.status import STOP, EpochProgress, StepLog, driver_verdict, say, tell_group
from training.stream.stamp import check_stamp, refuse_stale, stale_rows
from training.worker import trace
from training.worker.feed import EpochData, IngestWatch
from training.worker.learner import (
    CheckpointMismatch,
    Learner,
    all_gather,
    all_reduce,
    build_learner,
    rng_digest,
    rng_state,
    seed_rank,
    set_rng_state,
)
from training.worker.recipe import early_stop_line
from training.worker.report import DamagedCheckpoint, epoch_record, inner_rate, load_checkpoint, report, write_records


def quiet_worker_logs(verbose: bool = False) -> None:
    """Ray Train 2.60 sets a train worker's root logger to INFO whatever LoggingConfig says, and
    logs every ray.train.report there (a whole TrainingReport). Call in the train worker: the
    root logger then passes warnings only, as the run's LoggingConfig asks; `verbose` keeps INFO."""
    if not verbose:
        logging.getLogger().setLevel(logging.WARNING)
    # Ray Data hands torch the object store's read-only arrays and silences torch's warning about
    # them inside warnings.catch_warnings(), which is not thread-safe: with its conversion threads
    # and the loop's feed thread, one thread's exit restores the filters while another converts,
    # and the warning reached a user's console about once in 30 runs. The batches are only read.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


# --------------------------------------------------------------------------- a step, an epoch


def train_epoch(learner: Learner, batches, *, epoch: int, rank: int, bar=None) -> TrainFigures:
    """One pass over this rank's shard (torchvision's train_one_epoch); loss and accuracy summed
    over ranks. Fails (StaleBatch) if any batch was augmented for another epoch. The backbone is
    frozen for the first --freeze-epochs (the epoch decides: a resumed run freezes alike)."""
    learner.freeze_backbone(epoch < learner.cfg.freeze_epochs)
    learner.model.train()
    meter = EpochMeter(learner.device, epoch)
    ahead = learner.cfg.grad_accum > 1  # then each batch must know whether it is the epoch's last
    for batch, last in with_last(meter.timed(batches), ahead):
        if meter.steps == 0:
            check_stamp(batch[EPOCH], epoch)
        meter.begin_step()
        loss, logits = learner.train_step(batch, epoch=epoch, step=meter.steps, rank=rank, last=last)
        meter.update(batch, loss, logits)
        trace.after_step(learner.device, rank)  # RGA_TRACE: the GPU kit's trace of a few steps
        if bar is not None:
            bar.update(batch[LABEL].shape[0], meter.sums)  # reads the loss sum (a host sync) at most once an interval
    return meter.summary()


def with_last(items, ahead: bool = True):
    """(item, whether it is the last), one item read ahead; without `ahead`, (item, False)."""
    if not ahead:
        yield from ((item, False) for item in items)
        return
    it = iter(items)
    held = next(it, None)
    while held is not None:
        ahead = next(it, None)
        yield held, ahead is None
        held = ahead


@torch.no_grad()
def evaluate(learner: Learner, batches, num_classes: int) -> ValFigures:
    """Deterministic validation over this rank's shard (torchvision's evaluate); loss, top-1,
    top-5 and the confusion matrix summed over ranks (every validation image is scored once).
    With --model-ema, the EMA's weights are scored on the same batches too (loss_ema, acc_ema)."""
    models = {"": learner.bare}  # the bare module: no DDP collectives per batch
    if learner.ema is not None:
        models["_ema"] = learner.ema.module
    scores = {tag: Scores(learner.device, num_classes) for tag in models}
    for model in models.values():
        model.eval()
    for batch in batches:
        x = learner.normalize(batch[IMAGE])
        for tag, model in models.items():
            scores[tag].add(model(x).float(), batch[LABEL])
    out = scores[""].summary()
    if "_ema" in scores:
        ema = scores["_ema"].summary()
        out = dataclasses.replace(out, loss_ema=ema.loss, acc_ema=ema.acc)
    return out


class Scores:
    """One model's validation sums on the device: the loss, the top-5 hits, the confusion matrix."""

    def __init__(self, device: torch.device, num_classes: int):
        self.num_classes = num_classes
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.top5 = torch.zeros((), device=device, dtype=torch.float64)
        self.confusion = torch.zeros(num_classes * num_classes, device=device, dtype=torch.float64)

    def add(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        k = self.num_classes
        self.loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        self.top5 += (logits.topk(min(5, k), dim=1).indices == y[:, None]).any(1).sum()
        self.confusion += torch.bincount(y * k + logits.argmax(1), minlength=k**2).double()

    def summary(self) -> ValFigures:
        """The figures over all ranks (a collective: every rank calls it)."""
        packed = all_reduce(torch.cat([self.loss_sum[None], self.top5[None], self.confusion])).cpu()
        confusion = packed[2:].view(self.num_classes, self.num_classes).long()  # rows: true class, cols: predicted
        n = int(confusion.sum())
        share = lambda hits: float(hits) / n if n else float("nan")  # noqa: E731
        top5 = share(packed[1]) if self.num_classes >= 5 else None
        return ValFigures(share(packed[0]), share(confusion.diag().sum()), confusion.tolist(), top5)


# --------------------------------------------------------------------------- an epoch's bookkeeping


class RunStopped(RuntimeError):
    """The train loop's own verdict that the run cannot go on (a non-finite loss, an epoch that
    trained no image); the message is the one line the user sees. Nothing of the epoch is kept."""


class EpochMeter:
    """The per-step bookkeeping of one training epoch (as torchvision's MetricLogger keeps a
    train_one_epoch's): the loss and accuracy sums and the stale rows, kept on the device so
    that no step waits for the host; the views' digest and the keys (view_digest, then
    shard_record: the ShardRecord that training/driver/audit.py checks); the time spent waiting for
    input, the first step's end and the side trained at."""

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

    def summary(self) -> TrainFigures:
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
        read_s, augment_s, augment_gpu_s = costs  # every rank's rows' seconds in each stage (training/bounds.py)
        return TrainFigures(
            loss=loss_sum / max(count, 1),
            acc=correct / max(count, 1),
            images=int(count),
            image_size=self.side,
            epoch_s=elapsed,
            images_per_s=count / max(elapsed, 1e-9),
            data_wait_frac=self.wait_s / max(elapsed, 1e-9),  # this rank's share of time waiting for input
            steady_s=steady_s,  # past its first batch: its time, its share of it waiting for input
            steady_wait_frac=(self.wait_s - self.first_wait_s) / max(steady_s, 1e-9),
            inner_images_per_s=inner,  # the ranks' rates summed, each between INNER's marks of its epoch
            start_s=start_s / len(seen),  # the wait for an epoch's first batch, the ranks' mean
            trainer_cpus=cpu_s / len(seen) / max(elapsed, 1e-9),  # CPUs a rank's process kept busy
            read_s=read_s,
            augment_s=augment_s,
            augment_gpu_s=augment_gpu_s,
            trainer_gpu_s=gpu_s,  # every rank's steady steps on its CUDA stream
            decoded=tuple(int(n) for n in decoded),  # in DECODE_PLACES' order
            seen=tuple(seen),
            first_step_at=self.first_step_at,
        )

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


DIGEST_STRIDE = 32  # one byte of every 32 of each image goes into its view digest


def view_digest(images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Sum over the batch of hash(key, the image's augmented pixels), mod KEY_MOD, on the
    device: order-free, so two epochs or runs that trained on the same views of the same
    images have the same sum, and a reused augmentation shows as an equal sum. It reads one
    byte in DIGEST_STRIDE of each image (every channel and every row in turn: 32 is not a
    multiple of 3, nor a divisor of a row's bytes at the sizes trained): a 32nd of the bytes
    that weighing all of them moved, for the same two guarantees."""
    flat = images.reshape(images.shape[0], -1)[:, ::DIGEST_STRIDE]
    weights = view_weights(flat.shape[1], str(images.device))
    pixels = (flat.to(torch.int32) * weights).sum(1)  # each product < 2**23, the sum in int64
    return ((pixels % KEY_MOD) * (keys % KEY_MOD + 1) % KEY_MOD).sum() % KEY_MOD


@functools.lru_cache(maxsize=8)
def view_weights(n: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)  # the same weights in every process and run
    return torch.randint(1, 1 << 15, (n,), generator=g, dtype=torch.int32).to(device)


def shard_record(keys: list[torch.Tensor], count: int, views: int, rng: str) -> ShardRecord:
    """What this rank trained on in one epoch, for the driver's coverage check: rows, distinct
    images and the sum of their keys, the digest of the views, the random stream's state."""
    distinct = torch.unique(torch.cat(keys)) if keys else torch.zeros(0, dtype=torch.int64)
    key_sum = int((distinct % KEY_MOD).sum()) % KEY_MOD
    return ShardRecord(count, int(distinct.numel()), key_sum, views, rng)


# --------------------------------------------------------------------------- the loop


def train_loop(config: dict) -> None:
    """Ray Train's per-worker function: restore, build, then per epoch train, evaluate,
    record and checkpoint."""
    spec: WorkerSpec = config["spec"]
    cfg, ctx = spec.config, ray.train.get_context()
    quiet_worker_logs(cfg.verbose)
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    tell_group(spec.status)  # the driver removes the worker group's placement group after the attempt
    device = setup_worker(cfg, spec.threads_per_worker)
    run, learner_state, resumed_from, passed_over = restore(cfg, device)
    stopped = early_stop_line(run.epochs, cfg.early_stop)  # a run resumed after its early stop stays stopped
    first = run.last_epoch + 1
    last = first if stopped else last_epoch(cfg, first)
    data = EpochData(spec, rank, device)
    feed = data.feed(first) if first < last else None  # the first batch is on its way while the model builds
    learner, init_digest = build_learner(spec, world, device)
    node = ray.get_runtime_context().get_node_id()
    run.ranks = all_gather({"rank": rank, "node_id": node, "init_digest": init_digest})
    data.watch = IngestWatch(spec.ingest, [r["node_id"] for r in run.ranks], spec.stall)
    if feed is not None:
        feed.watch = data.watch
    resumed = resume_or_seed(learner, run, learner_state, resumed_from, rank, world)
    if passed_over and rank == 0:
        say(spec.status, passed_over)
    if resumed and rank == 0:
        say(spec.status, resumed)
        spec.status.checkpointed.remote(resumed_from)  # what a stop before the next checkpoint resumes from
    run.resumed_at_epochs += [first + 1] if resumed_from else []
    steps = step_log(spec, learner, first) if rank == 0 else None  # --log-every: rank 0's figures for the trackers
    if stopped and rank == 0:
        say(spec.status, stopped)
    for epoch in range(first, last):
        bar = EpochProgress(spec.status.post.remote, rank=rank, epoch=epoch, steps=steps)  # every rank
        with feed or data.feed(epoch) as batches:  # the feed's thread stops with the epoch, however it ends
            trained = train_epoch(learner, batches, epoch=epoch, rank=rank, bar=bar)
        bar.close()
        feed = None
        with data.validation() as batches:
            scored = evaluate(learner, batches, spec.num_classes)
        lr, gpus = learner.scheduler.get_last_lr()[0], world if spec.slots.on_gpu else 1
        run.add(epoch_record(epoch, trained, scored, lr=lr, first=epoch == first, slots=spec.slots, gpus=gpus))
        run.slots, run.rng, run.schedule_epochs = spec.slots, all_gather(rng_state(device)), cfg.epochs
        if rank == 0:
            write_records(spec, run)
        report(run, learner.state_dict() if rank == 0 else None, epoch)  # rank 0's checkpoint
        if spec.follow_epochs and driver_verdict(spec.status, run.epochs[-1], rank=rank) == STOP:
            if rank == 0:
                say(spec.status, f"stopped after epoch {epoch + 1} by an epoch callback")
            break
        stopped = early_stop_line(run.epochs, cfg.early_stop)  # the reduced metrics: every rank stops alike
        if stopped:
            if rank == 0:
                say(spec.status, stopped)
            break


def step_log(spec: WorkerSpec, learner: Learner, first_epoch: int) -> StepLog | None:
    cfg = spec.config
    if not (cfg.log_every and spec.follow_epochs):
        return None
    per_epoch = -(-spec.train_images // cfg.batch_size)  # steps an epoch, about: the trackers' step axis
    lr = lambda: learner.scheduler.get_last_lr()[0]  # noqa: E731
    return StepLog(spec.status.step.remote, cfg.log_every, lr, steps_per_epoch=per_epoch, first_epoch=first_epoch)


def setup_worker(cfg: TrainConfig, threads: int) -> torch.device:
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(threads)
    elif device.type == "cuda":  # as TorchTrainer's context does: one worker trains without it (trainer_class)
        torch.cuda.set_device(device)
    if cfg.deterministic:
        ray.train.torch.enable_reproducibility(cfg.seed)
    return device


def restore(cfg: TrainConfig, device: torch.device) -> tuple[RunRecord, dict | None, str | None, str | None]:
    """The newest complete checkpoint's records and learner state and where it lies, or a fresh
    record, None and None; and the line that names the damaged checkpoints passed over (None: none).
    A resumed run knows where to start before anything else: that decides the first epoch's data.
    A checkpoint of another version of this job is CheckpointMismatch, one line."""
    damaged, state, where = [], None, None
    for checkpoint in resume_candidates(cfg.run_dir):
        try:
            with checkpoint.as_directory() as d:
                state = load_checkpoint(d, map_location=device)
            where = checkpoint.path
            break
        except DamagedCheckpoint as e:
            damaged.append((checkpoint.path.rstrip("/").rsplit("/", 1)[-1], str(e)))
    note = passed_over_line(damaged, where)
    if state is None:
        run = RunRecord.fresh()
        run.passed_over += [name for name, _ in damaged]
        return run, None, None, note
    try:
        run = RunRecord.from_state(state.get("records") if isinstance(state, dict) else None)
    except StaleRecords as e:
        raise CheckpointMismatch(
            f"the last checkpoint of --name {cfg.name} was written by another version of this job ({e}); rerun "
            "with --fresh to start over"
        ) from None
    run.passed_over += [name for name, _ in damaged]
    return run, state["learner"], where, note


def resume_candidates(run_dir: str):
    """Ray Train's checkpoint to resume from first, then the other checkpoint folders of the run,
    newest epoch first (where the latest is damaged, the next one)."""
    latest = ray.train.get_checkpoint()
    if not latest:
        return
    yield latest
    fs, path, _ = storage.filesystem(run_dir)
    found = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    names = sorted((i.base_name for i in found if i.base_name.startswith("checkpoint_epoch_")), reverse=True)
    for name in names:
        candidate = f"{path}/{name}"
        if candidate.rstrip("/") != latest.path.rstrip("/"):
            yield ray.train.Checkpoint(candidate, filesystem=fs)


def passed_over_line(damaged: list[tuple[str, str]], where: str | None) -> str | None:
    if not damaged:
        return None
    names = "; ".join(f"{name} ({why})" for name, why in damaged)
    then = f"resuming from {where.rstrip('/').rsplit('/', 1)[-1]}" if where else "no complete checkpoint: starting over"
    return f"note: passed over damaged checkpoint {names}; {then}"


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
