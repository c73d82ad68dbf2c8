"""The driver side of a training job, once its inputs have passed (training/driver/inputs.py
prepare) and Ray is connected (training/driver/session.py connect): plan resources, build the data
pipeline, run the TorchTrainer attempt after attempt through faults, write the run directory.

    cfg, tree, name, preset = inputs.prepare(cfg)   # no Ray yet: every user error (exit 2)
    session.connect()                               # joins or starts a cluster
    summary = job.run(cfg, tree, load_preset(name) if preset is None else preset)
                                                    # TrainingFailed (exit 1) if training breaks

jobs/train.py runs these with the preset (torch) loading while Ray starts.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time

import psutil
import ray
import ray.train

from augment.presets import Preset
from augment.schedule import parse_resize
from training import ray_private, storage
from training.bounds import DataSlots
from training.config import ConfigError, TrainConfig, check_sync_bn
from training.driver import lease
from training.driver.console import ConsoleFollower
from training.driver.epochs import EpochFollower
from training.driver.faults import (
    FULL,
    CheckpointNotice,
    FaultLog,
    alive_nodes,
    describe,
    driver_actor,
    full_storage_line,
    lost_nodes,
    release_groups,
    storage_full,
)
from training.driver.inputs import auto_preset, data_place, few_steps_warning, sized_preset
from training.driver.planning import (
    Capacity,
    ResourcePlan,
    check_storage,
    cluster_capacity,
    plan_resources,
    wait_for_a_plan,
)
from training.driver.results import BestEpoch, report_bad_files, write_bad_files, write_results
from training.driver.session import sigint_kept
from training.driver.tracking import Tracking, parse_log_to
from training.forms.data import DataError, ImageTree
from training.records import RunRecord
from training.spec import IngestNeeds, StallLimits, WorkerSpec
from training.status import BadFileLog, RunStatus
from training.stream.gone import data_gone
from training.stream.ingest import DecodePlan, SplitValUnequally, augment_rows, build_datasets, choose_decode
from training.stream.stamp import EpochClock, StaleBatch
from training.weights import weights_record
from training.worker.feed import IngestStalled
from training.worker.learner import CheckpointMismatch
from training.worker.loop import RunStopped, train_loop
from training.worker.report import DamagedCheckpoint, load_checkpoint

TRACKED_FILES = ("model.pt", "model_best.pt", "curves.png", "confusion.png", "metrics.csv", "summary.json")
HEALTH_CHECK_ENV, HEALTH_CHECK_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 0.5


class TrainingFailed(RuntimeError):
    """Training started but did not finish."""


class Interrupted(RuntimeError):
    """The user stopped the run (Ctrl-C); its last checkpoint stays usable. `checkpoint`: that
    checkpoint's directory, None where the run had none yet."""

    def __init__(self, checkpoint: str | None, run_dir: str):
        self.checkpoint = checkpoint
        name = checkpoint.rstrip("/").rsplit("/", 1)[-1] if checkpoint else None  # Ray's path: no s3:// scheme
        where = (
            f"the last checkpoint is {name} in {run_dir}" if name else "before the first checkpoint: nothing to resume"
        )
        super().__init__(f"interrupted; {where}")


def cluster_cpus() -> float:
    return ray.cluster_resources().get("CPU", 0.0)


def git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def process_started_at() -> float:
    """Wall-clock time this process started."""
    return psutil.Process().create_time()


def run(
    cfg: TrainConfig,
    tree: ImageTree,
    preset: Preset,
    *,
    log=print,
    launched_at: float | None = None,
    own_cluster: bool = False,
    stall: StallLimits | None = None,
    bar_stream=None,
    callbacks: tuple | list = (),
    share: Capacity | None = None,
) -> dict:
    """Train on a connected Ray cluster; returns the summary written to summary.json.
    `launched_at` (a time.time() value, e.g. process_started_at()) is when start-up began;
    summary.json's startup_s and wall_s count from it (default: now). `own_cluster`: the
    cluster was started by this process and ends with it. `stall`: how long a train worker
    waits for a batch before it asks Ray why (training/worker/feed.py, IngestWatch). `bar_stream`: where
    the per-epoch progress bar is drawn (a terminal; None: no bar); the epoch lines go to `log`.
    `callbacks`: called on the driver with each epoch's record (training/driver/epochs.py). `share`: the
    part of the cluster this run plans for (a sweep's trial: training/driver/planning.py share_of); None:
    all of it."""
    try:
        start = launched_at or time.time()
        return _run(cfg, tree, preset, log, start, own_cluster, stall, bar_stream, tuple(callbacks), share)
    except OSError as e:  # the driver's own files (faults.log, the results) on a full disk: one line too
        words = next((w for w in FULL if w in str(e)), None)
        if words is None:
            raise
        raise TrainingFailed(
            f"training failed: {cfg.storage_path}: {words} ({e}); make room there, then the same command resumes "
            "from the run's last checkpoint"
        ) from None
    finally:
        lease.release(cfg.run_dir)  # however the run ends, its folder is free for the next (training/driver/lease.py)


def _run(cfg, tree, preset, log, start, own_cluster, stall, bar_stream, callbacks, share) -> dict:
    preset = sized_preset(cfg, preset)
    run_dir = cfg.run_dir
    if cfg.deterministic:  # rows reach the trainer in file order, so batches are the same every run
        ray.data.DataContext.get_current().execution_options.preserve_order = True
    capacity = share or cluster_capacity()
    check_storage(cfg.storage_path, capacity, log)
    plan = plan_resources(cfg, capacity)
    if capacity.note():
        log(f"note: {capacity.note()}")
    if cfg.sync_bn and not plan.use_gpu:  # a cluster's: a local run's is refused before Ray (inputs.py)
        check_sync_bn(cfg.sync_bn, on_gpu=False)
    if cfg.batch_size < plan.num_workers:
        raise ConfigError(f"--batch-size {cfg.batch_size} is smaller than the {plan.num_workers} workers; raise it")
    decode = choose_decode(cfg.decode, tree.train, preset.train, plan.use_gpu, cfg.gpu_decoder)
    log(f"data: {tree.describe()}")
    warning = few_steps_warning(cfg, tree)
    if warning:
        log(warning)
    rows = augment_rows(cfg.augment_batch_size, tree.train, decode, plan.use_gpu)
    if cfg.weights or cfg.init_weights:  # which tensors the first weights give: built here as the workers will
        from training.model import initial_model

        log(initial_model(cfg, len(tree.class_names), preset.image_size)[1].describe())
    chosen = f" (--preset auto: {auto_preset(tree)[1]})" if cfg.preset == "auto" else ""
    log(
        f"plan: preset {preset.name}{chosen}; {plan.describe()}; {decode.describe()}; "
        f"at most {rows} images per augment call; {tree.imbalance()}{balancing(cfg)}"
    )
    # with the driver: a lost node cannot take them (training/driver/faults.py)
    actors = {
        "clock": driver_actor(EpochClock),
        "bad_log": driver_actor(BadFileLog),
        "status": driver_actor(RunStatus),
    }
    if tree.unreadable:  # found by the listing (a shard's sample without an image or a label)
        actors["bad_log"].add.remote(list(tree.unreadable))
    names = parse_log_to(cfg.log_to)
    tracking = Tracking(cfg, names, log) if names else None  # --log-to (training/driver/tracking.py)
    attempt = Attempt(
        cfg,
        tree,
        preset,
        actors,
        decode=decode,
        autoscaling=capacity.autoscaling or not capacity.bounded,
        stall=stall or StallLimits(),
        own_cluster=own_cluster,
        callbacks=callbacks + ((tracking,) if tracking else ()),
        share=share,
    )
    ok = False
    try:
        datasets = attempt.datasets(plan, strict=cfg.strict)
        # only now: a start that fails earlier leaves the records of the run NAME holds as they were
        write_config(run_dir, attempt, plan, rows)
        if tracking:
            tracking.start(cfg.to_dict())
        run, model, best, bad, faults = _fit(attempt, plan, datasets, log=log, bar_stream=bar_stream)
        summary = write_results(
            cfg, tree, preset, plan, run, model, bad, start=start, log=log, faults=faults, best=best
        )
        ok = True
    finally:
        for actor in actors.values():  # nothing of this run may hold cluster resources afterwards
            ray.kill(actor)
        if tracking:
            tracking.finish([storage.join(run_dir, f) for f in TRACKED_FILES] if ok else [], ok=ok)
    return summary


def balancing(cfg: TrainConfig) -> str:
    """What corrects the imbalance the plan line shows, if anything."""
    if cfg.class_weights == "balanced":
        return " (--class-weights balanced: the loss weighs each class by n / (classes x its count))"
    if cfg.sampler == "balanced":
        return " (--sampler balanced: each epoch draws the classes about equally)"
    return ""


def write_config(run_dir: str, attempt: "Attempt", plan: ResourcePlan, rows: int) -> None:
    """config.json: every setting, the plan, the preset, the classes, the commit and the data."""
    cfg, preset, tree = attempt.cfg, attempt.preset, attempt.tree
    storage.mark_run_dir(run_dir, cfg.name)  # first: --fresh removes only a folder that holds it
    storage.write_json(
        storage.join(run_dir, "config.json"),
        {
            "config": cfg.to_dict(),
            "plan": dataclasses.asdict(plan)
            | {"decode": dataclasses.asdict(attempt.decode), "augment_batch_size": rows},
            "preset": preset.to_dict(),
            "image_size": preset.image_size,  # evaluation's, and training's at the end
            "train_image_sizes": preset.train_sides(cfg.progressive_resize, cfg.epochs),  # per epoch
            "class_names": list(tree.class_names),
            "weights": weights_record(cfg),
            "git_commit": git_commit(),
            "data_root": data_place(tree.root),
        },
    )


@dataclasses.dataclass(frozen=True)
class Attempt:
    """What every attempt of a run trains with; the plan may change between attempts."""

    cfg: TrainConfig
    tree: ImageTree
    preset: Preset
    actors: dict  # the run's driver-side actors: clock, bad_log, status
    decode: DecodePlan
    autoscaling: bool  # the cluster may grow: the ingest watch only waits
    stall: StallLimits
    own_cluster: bool
    callbacks: tuple = ()  # the driver's epoch callbacks (training/driver/epochs.py)
    share: Capacity | None = None  # the part of the cluster the run plans for (a sweep's trial); None: all

    @property
    def resizes(self) -> bool:
        """--progressive-resize is on: each epoch's side is shown and recorded."""
        return bool(parse_resize(self.cfg.progressive_resize))

    def worker_spec(self, plan: ResourcePlan) -> WorkerSpec:
        """What train_loop receives: the config, what the driver found out, and the run's helper
        actors (the epoch clock, and the run's status)."""
        cfg, preset = self.cfg, self.preset
        return WorkerSpec(
            config=cfg,
            class_names=tuple(self.tree.class_names),
            preset=preset,
            train_images=len(self.tree.train),
            rows_grouped=self.tree.train.grouped,
            threads_per_worker=plan.threads_per_worker,
            batch_per_worker=plan.batch_per_worker(cfg.batch_size),
            sizes=tuple(preset.train_sides(cfg.progressive_resize, cfg.epochs)) if self.resizes else None,
            ingest=IngestNeeds(worker=plan.worker, tasks=tuple(plan.ingest_tasks()), autoscaling=self.autoscaling),
            slots=DataSlots.of(
                plan, self.share.cpus if self.share else cluster_cpus(), decode_in_read=self.decode.where == "read"
            ),
            stall=self.stall,
            clock=self.actors["clock"],
            status=self.actors["status"],
            follow_epochs=bool(self.callbacks),
            class_counts=self.tree.class_counts,
        )

    def trainer(self, plan: ResourcePlan, datasets: dict):
        """The Ray Train trainer for the plan (TorchTrainer for several workers; one worker needs no
        process group: ray_private.trainer_class): workers and their resources, the run directory
        with one checkpoint kept (the best val_acc), and the datasets split as SplitValUnequally says.
        Ray Train restarts nothing itself (max_failures=0): _fit does, with a plan made again."""
        cfg = self.cfg
        # how often Ray Train's controller polls the workers, which it reads from the driver's
        # environment when the trainer starts: it notices the end of a run (and a dead worker)
        # at its next poll (docs/design.md, "Choices and where they were measured"); a value the
        # user set is kept
        os.environ.setdefault(HEALTH_CHECK_ENV, str(HEALTH_CHECK_S))
        trainer = ray_private.trainer_class(one_worker=plan.num_workers == 1, own_cluster=self.own_cluster)
        return trainer(
            train_loop,
            train_loop_config={"spec": self.worker_spec(plan)},
            scaling_config=ray.train.ScalingConfig(
                num_workers=plan.num_workers,
                use_gpu=plan.use_gpu,
                resources_per_worker={
                    "CPU": plan.cpus_per_worker,
                    **({"GPU": plan.gpus_per_worker} if plan.use_gpu else {}),
                },
                placement_strategy=plan.placement,
            ),
            run_config=ray.train.RunConfig(
                name=cfg.name,
                storage_path=cfg.storage_path,
                # the job tells each fault in one line; Ray Train's tracebacks go to faults.log
                logging_config=ray.train.LoggingConfig(log_level="INFO" if cfg.verbose else "CRITICAL"),
                # every failure comes back to _fit: of the workers, of their start (Ray Train retries
                # those without end by default, 60 s of waiting each) and of a preempted node
                failure_config=ray.train.FailureConfig(
                    max_failures=0, controller_failure_limit=0, max_preemption_failures=0
                ),
                checkpoint_config=checkpoint_config(),
                callbacks=[CheckpointNotice(self.actors["status"])],
            ),
            datasets=datasets,
            dataset_config=SplitValUnequally(plan.num_workers),
        )

    def datasets(self, plan: ResourcePlan, *, strict: bool) -> dict:
        """The plan's datasets; `strict` (the first attempt's, with --strict): every file decoded
        first, and a bad one stops the run with DataError."""
        cfg, bad_log = self.cfg, self.actors["bad_log"]
        run_dir = cfg.run_dir
        datasets = build_datasets(
            dataclasses.replace(cfg, strict=strict),
            self.tree,
            self.preset,
            plan,
            self.actors["clock"],
            bad_log,
            self.decode,
        )
        bad = ray.get(bad_log.get.remote()) if strict else {}
        if bad:
            storage.mark_run_dir(run_dir, self.cfg.name)  # the run directory is this job's (--fresh may remove it)
            write_bad_files(run_dir, bad)
            first = next(iter(sorted(bad.items())))
            raise DataError(
                f"{len(bad)} unreadable image(s), e.g. {first[0]}: {first[1]}; see "
                f"{storage.join(run_dir, 'bad_files.csv')}; drop --strict to skip them"
            )
        return datasets


def _fit(
    attempt: Attempt, plan: ResourcePlan, datasets: dict, *, log, bar_stream
) -> tuple[dict, dict, dict, list[dict]]:
    """Run the TorchTrainer on `datasets` (the first plan's) while the console follows its progress;
    after a fault, say so in one line and run it again from the last checkpoint, on a plan made
    again, with datasets built for it where it changed (training/driver/faults.py). Returns the last
    checkpoint's records (training/records.py) and model weights, the best epoch's (BestEpoch, with
    the last checkpoint's EMA weights, None without --model-ema),
    the files that failed to decode, and the faults survived."""
    cfg, status = attempt.cfg, attempt.actors["status"]
    run_dir = cfg.run_dir
    faults = FaultLog(run_dir, cfg.max_failures)
    follower = ConsoleFollower(
        lambda seen: ray.get(status.read.remote(seen)),
        total=len(attempt.tree.train),
        epochs=cfg.epochs,
        log=log,
        stream=bar_stream,
        sizes=attempt.preset.train_sides(cfg.progressive_resize, cfg.epochs) if attempt.resizes else None,
    )
    epochs = EpochFollower(
        lambda seen: ray.get(status.records_since.remote(seen)),
        lambda epoch, verdict: status.decide.remote(epoch, verdict),
        attempt.callbacks,
        warn=follower.say,
        read_steps=lambda seen: ray.get(status.steps_since.remote(seen)),
    )
    built_for = plan
    try:
        with follower, epochs:
            while True:
                if plan != built_for:
                    datasets, built_for = attempt.datasets(plan, strict=False), plan
                ray.get(status.new_attempt.remote())
                nodes = alive_nodes()
                result, error = _attempt(attempt.trainer(plan, datasets), status, run_dir)
                release_groups(status)
                if error is None:
                    break
                plan = _after_fault(attempt, plan, error, nodes, faults, follower.say)
    finally:
        report_bad_files(attempt.actors["bad_log"], run_dir, log)
    if result.checkpoint is None:
        raise TrainingFailed("training ended without a checkpoint")
    run, last = _load(result.checkpoint)
    model = last["model"]
    damaged, by_epoch = set(run.passed_over), {e.epoch: e for e in run.epochs}
    complete = [  # each kept checkpoint with its epoch's record (Ray Train lists them with the epoch reported)
        (c, by_epoch[m.get("epoch")])
        for c, m in result.best_checkpoints or []
        if c.path.rstrip("/").rsplit("/", 1)[-1] not in damaged and m.get("epoch") in by_epoch
    ]
    best_checkpoint, record = max(complete or [(result.checkpoint, run.epochs[-1])], key=lambda k: k[1].val.acc)
    best_model = model if best_checkpoint.path == result.checkpoint.path else _load(best_checkpoint)[1]["model"]
    best = BestEpoch(best_model, record.epoch, last.get("ema"))  # the EMA: the last epoch's average (model_ema.pt)
    return run, model, best, ray.get(attempt.actors["bad_log"].get.remote()), faults.records()


def _load(checkpoint) -> tuple[RunRecord, dict]:
    """A checkpoint's records and learner state (the worker wrote them: training/worker/loop.py report)."""
    with checkpoint.as_directory() as d:
        try:
            state = load_checkpoint(d, map_location="cpu")
        except DamagedCheckpoint as e:
            raise TrainingFailed(f"training failed: the checkpoint {checkpoint.path} is damaged ({e})") from None
    return RunRecord.from_state(state["records"]), state["learner"]


def _attempt(trainer, status, run_dir: str):
    """(result, None) of a trainer that finished, or (None, the error) of one that failed."""
    try:
        with sigint_kept():
            result = trainer.fit()
    except (KeyboardInterrupt, SystemExit):  # Ray Train's SIGINT handler aborts the run, then sys.exit(0)
        raise Interrupted(ray.get(status.last_checkpoint.remote()), run_dir) from None
    except Exception as e:  # Ray wraps worker errors: _after_fault names the cause
        return None, e
    return (None, result.error) if result.error else (result, None)


def _after_fault(attempt: Attempt, plan: ResourcePlan, error, nodes: dict, faults: FaultLog, say) -> ResourcePlan:
    """Record the fault; TrainingFailed where the run stops, else the plan to restart on (the
    line said first, through `say`: the console's, which closes the bar before it prints)."""
    cfg, status = attempt.cfg, attempt.actors["status"]
    lost = lost_nodes(nodes, error)
    progress, _ = ray.get(status.read.remote(1 << 30))
    checkpoint = ray.get(status.last_checkpoint.remote())
    fault = describe(error, lost, progress, checkpoint, plan.batch_per_worker(cfg.batch_size))
    faults.add(fault, error, lost)
    full = storage_full(error)
    if full:  # every restart would fail writing the same way
        raise TrainingFailed(full_storage_line(cfg.storage_path, full, checkpoint))
    own = worker_error(error, own_only=True)
    if own:  # the train loop's own verdict (a stall, a stale batch, a checkpoint that does not fit), or the data gone
        raise TrainingFailed(f"training failed: {own}")
    stop = faults.give_up(fault)
    if stop:
        raise TrainingFailed(f"training failed: {stop}")
    say(fault.line(faults.left))
    try:
        new = wait_for_a_plan(cfg, cfg.node_wait_s, share=attempt.share)
    except ConfigError as e:
        raise TrainingFailed(
            f"training failed: {fault.summary()}, and for {cfg.node_wait_s:g} s no plan fitted the nodes left: {e}, "
            "or add a node (--node-wait-s: how long to wait for one); details in " + faults.path
        ) from None
    if new != plan:
        say(f"plan: {new.describe()} (made again for the nodes alive now)")
    return new


def worker_error(error: BaseException, *, own_only: bool = False) -> str:
    """One line for a failed run: the train loop's own error (a stalled or stale input, a
    checkpoint that does not fit, a non-finite loss, an epoch with no image) where Ray Train
    wraps one, or a read task's DataGone (the data's folder or bucket went), else Ray's message
    (`own_only`: "" instead)."""
    for failure in (getattr(error, "worker_failures", None) or {}).values():
        cause = ray_private.worker_exception(failure)
        if isinstance(cause, (IngestStalled, StaleBatch, CheckpointMismatch, RunStopped)):
            return str(cause)
        gone = data_gone(f"{cause}\n{ray_private.worker_traceback(failure) or ''}")  # a read task's, as text
        if gone:
            return gone
    return "" if own_only else f"{type(error).__name__}: {error}"


def checkpoint_config() -> ray.train.CheckpointConfig:
    """The two best checkpoints by validation accuracy and the latest are kept; a rerun resumes from the
    latest, or where that one is damaged from the newest complete one (training/worker/loop.py restore):
    two kept means there is always another once two epochs are done."""
    return ray.train.CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="val_acc", checkpoint_score_order="max")
