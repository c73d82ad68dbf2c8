"""The driver side of a training job: check inputs, plan resources, build the data
pipeline, run the TorchTrainer, write the run directory.

Call order (jobs/train.py):

    cfg, tree, preset = prepare(cfg)   # no Ray yet: every user error surfaces here (exit 2)
    ray.init(...)                      # the entry point joins or starts a cluster
    (jobs/train.py splits prepare: the light training.inputs.check_inputs runs first, the
    preset loads while Ray starts)
    summary = run(cfg, tree, preset)   # TrainingFailed (exit 1) if training breaks
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import time

import numpy as np
import psutil
import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer

from augment.presets import Preset, load_preset
from augment.schedule import parse_resize
from augment.stage import EpochClock
from training import artifacts, plots, ray_private
from training.config import ConfigError, TrainConfig, check_amp
from training.console import ConsoleFollower, ProgressBoard
from training.data import BadFileLog, DataError, ImageTree
from training.faults import CheckpointNotice, FaultLog, alive_nodes, describe, driver_actor, lost_nodes
from training.ingest import DecodePlan, SplitValUnequally, augment_rows, build_datasets, choose_decode
from training.inputs import (
    auto_preset,
    check_inputs,
    check_sizes_and_device,
    data_place,
    few_steps_warning,
    preset_name,
    start_fresh,
)
from training.loop import (
    CHECKPOINT_FILE,
    KEY_MOD,
    CheckpointMismatch,
    IngestStalled,
    StaleBatch,
    StallLimits,
    train_loop,
)
from training.model import uses_small_stem
from training.resources import Node, left_over, place_workers, tasks_fit
from training.sizing import sized_preset, train_sizes


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


def prepare(cfg: TrainConfig) -> tuple[TrainConfig, ImageTree, Preset]:
    """Everything that needs no cluster: resolve defaults, scan the tree, load the preset."""
    cfg, tree = check_inputs(cfg)
    name = preset_name(cfg, tree)
    preset = load_preset(name)
    check_sizes_and_device(cfg, name, preset)
    start_fresh(cfg)  # --fresh: the old run goes only once every input has passed
    return cfg, tree, preset


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What the cluster has now, or can grow to when it autoscales."""

    cpus: int
    gpus: int
    hosts: int  # distinct machines among the alive nodes (nodes on one host share its disk)
    autoscaling: bool = False
    bounded: bool = True  # False: an autoscaler runs whose limits Ray does not publish
    nodes: tuple[Node, ...] = ()  # (CPUs, GPUs) of each alive node; () = unknown: `hosts` equal nodes

    def note(self) -> str:
        if not self.bounded:
            return (
                "an autoscaler runs but does not publish its limits: requests beyond the current "
                f"{self.cpus} CPU / {self.gpus} GPU wait for new nodes (pass --device cuda --num-workers N "
                "when the cluster starts without GPU nodes)"
            )
        return ""

    def node_list(self) -> list[Node]:
        if self.nodes and not self.autoscaling:
            return list(self.nodes)
        hosts = max(1, self.hosts)
        return [(self.cpus / hosts, self.gpus / hosts)] * hosts


def cluster_capacity() -> Capacity:
    """Current resources, raised to the autoscaler's ceiling where Ray publishes one (autoscaler
    v2, KubeRay); Ray Train checks its workers against the same ceiling."""
    now = ray.cluster_resources()
    ceiling = ray_private.autoscaler_ceiling() or {}
    autoscaler_v1 = not ceiling and ray_private.v1_autoscaler_runs()
    alive = [n for n in ray.nodes() if n["Alive"]]
    return Capacity(
        cpus=max(int(now.get("CPU", 0)), int(ceiling.get("CPU", 0))),
        gpus=max(int(now.get("GPU", 0)), int(ceiling.get("GPU", 0))),
        hosts=len({n["NodeManagerAddress"] for n in alive}),
        autoscaling=bool(ceiling) or autoscaler_v1,
        bounded=not autoscaler_v1,
        nodes=tuple((n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0)) for n in alive),
    )


def check_storage(storage_path: str, capacity: Capacity, log=print) -> None:
    """Checkpoints from every node must land in one place (Ray Train persists them there)."""
    if "://" in storage_path:
        return
    if capacity.hosts > 1:
        raise ConfigError(
            f"--storage-path {storage_path} is a local path but the cluster spans {capacity.hosts} machines; "
            "use storage every node sees: s3://bucket/runs, gs://bucket/runs or a shared mount such as NFS"
        )
    if capacity.autoscaling:
        log(
            f"warning: --storage-path {storage_path} is local; if the autoscaler adds machines, use s3://, gs:// or "
            "a shared mount"
        )


# On GPUs each trainer's GPU keeps GPU_INGEST_SHARE for augmentation: by default GPU_TASKS_PER_GPU
# Ray Data tasks at once, each a process that decodes (nvjpeg) and augments a batch and outlives
# the epoch (docs/benchmarks.md, "GPU"); with --augment-actors, the share per actor.
GPU_INGEST_SHARE, GPU_TASKS_PER_GPU = 0.25, 4


@dataclasses.dataclass(frozen=True)
class ResourcePlan:
    use_gpu: bool
    num_workers: int
    cpus_per_worker: float  # below 1 only where whole CPUs would leave Ray Data none
    gpus_per_worker: float  # < 1 when augment tasks or actors share the trainers' GPUs
    threads_per_worker: int
    augment_actors: int  # per split; 0: Ray Data tasks instead (the default)
    augment_gpus: float  # per augment task or actor; 0 on a CPU-only plan
    augment_cpus: float  # per read/augment task and per augment actor
    placement: str  # PACK keeps GPU ranks together (NVLink); SPREAD gives CPU ranks their own cores
    augment_concurrency: int = 0  # GPU augment tasks at once per split; 0: as many as Ray Data starts

    def describe(self) -> str:
        where = f"{self.gpus_per_worker:g} GPU + " if self.use_gpu else ""
        aug = (
            f"({self.augment_gpus:g} GPU + {self.augment_cpus:g} CPU)"
            if self.augment_gpus
            else f"{self.augment_cpus:g} CPU"
        )
        who = "augment tasks" if self.augment_tasks else f"{self.augment_actors} augment actor(s)"
        cap = f", at most {self.augment_concurrency} at once" if self.augment_concurrency else ""
        return (
            f"{self.num_workers} train worker(s) x ({where}{self.cpus_per_worker:g} CPU, "
            f"{self.threads_per_worker} torch threads), {self.placement}; {who} x {aug} per split{cap}"
        )

    @property
    def augment_tasks(self) -> bool:
        return self.augment_actors == 0

    @property
    def worker(self) -> Node:
        return (self.cpus_per_worker, self.gpus_per_worker if self.use_gpu else 0.0)

    def ingest_tasks(self) -> list[Node]:
        """What Ray Data must run at once to make progress: one read task (on CPUs it augments
        too), plus an augment task on a GPU share, or the augment actors of an actor pool (a
        pool starts all of its actors)."""
        on_gpu = (self.augment_cpus, self.augment_gpus)
        augment = [on_gpu] * (self.augment_actors or (1 if self.augment_gpus else 0))
        return [(self.augment_cpus, 0.0)] + augment


def tasks_per_gpu(augment_gpus: float) -> int:
    """Augment tasks beside each trainer: as many of `augment_gpus` as fit in GPU_INGEST_SHARE
    of its GPU, and at least one (--augment-gpus 0.25 gives one task a quarter, 0.0625 four)."""
    return max(1, math.floor(GPU_INGEST_SHARE / augment_gpus + 1e-9))


def gpu_shares(cfg: TrainConfig, workers: int, capacity: Capacity) -> dict:
    """The GPU fields of a GPU plan: each trainer's share, each augment task's or actor's,
    and how many augment tasks run at once per split; a ConfigError where they do not fit."""
    actors = cfg.augment_actors
    augment_gpus = cfg.augment_gpus or (GPU_INGEST_SHARE / GPU_TASKS_PER_GPU if not actors else GPU_INGEST_SHARE)
    dedicated = augment_gpus >= 1
    needed = workers + ((actors or 1) * augment_gpus if dedicated else 0)  # dedicated: room for one task at least
    if needed > capacity.gpus and capacity.bounded:
        who = f"{actors or 1} augment {'actor' if actors else 'task'}(s) of {augment_gpus:g} GPU"
        raise ConfigError(
            f"--num-workers {workers}"
            + (f" + {who}" if dedicated else "")
            + f" need {needed:g} GPUs but the cluster has at most {capacity.gpus}; lower --num-workers"
        )
    gpus_per_worker = 1.0
    if not dedicated:  # each GPU keeps room for the augment actors or tasks beside its trainer
        beside = math.ceil(actors / max(workers, 1)) if actors else tasks_per_gpu(augment_gpus)
        gpus_per_worker = 1.0 - augment_gpus * beside
        if gpus_per_worker <= 0:
            raise ConfigError(
                f"--augment-actors {actors} x {augment_gpus:g} GPU leave no GPU for {workers} train worker(s); "
                "lower --augment-gpus"
            )
    if actors:
        concurrency = 0  # the pool's size
    elif dedicated:  # every GPU the trainers leave (that Ray knows of now, where an autoscaler hides its limits)
        concurrency = max(1, int((capacity.gpus - workers) // augment_gpus))
    else:
        concurrency = tasks_per_gpu(augment_gpus) * workers
    return {"gpus_per_worker": gpus_per_worker, "augment_gpus": augment_gpus, "augment_concurrency": concurrency}


def plan_resources(cfg: TrainConfig, capacity: Capacity) -> ResourcePlan:
    """Split the cluster between train workers and Ray Data (docs/design.md, "Resources").

    On GPUs the augment tasks (or actors) share the trainers' GPUs (a quarter of each, the
    trainer the rest) unless --augment-gpus says otherwise; a whole GPU per actor only pays
    when augmentation is heavy next to the model. On CPUs one worker uses all cores by
    default: two workers on two cores fight over them. Every plan returned leaves Ray Data
    room for its tasks on the nodes the workers leave (leave_room_for_ingest).
    """
    cpus, gpus = capacity.cpus, capacity.gpus
    use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and gpus > 0)
    if use_gpu and gpus == 0 and capacity.bounded:
        raise ConfigError("--device cuda: the Ray cluster has no GPUs and cannot get any; use --device cpu or auto")
    check_amp(cfg.amp, on_gpu=use_gpu)
    workers = cfg.num_workers or (max(gpus, 1) if use_gpu else 1)
    shares = gpu_shares(cfg, workers, capacity) if use_gpu else {"gpus_per_worker": 1.0, "augment_gpus": 0.0}
    cpus_per_worker = cfg.cpus_per_worker or max(1, cpus // 2 // workers)
    if cfg.cpus_per_worker and workers * cpus_per_worker > cpus and capacity.bounded:
        raise ConfigError(
            f"--num-workers {workers} x {cpus_per_worker} CPU each needs {workers * cpus_per_worker} CPUs "
            f"but the cluster has at most {cpus}; lower --num-workers or --cpus-per-worker"
        )
    plan = ResourcePlan(
        use_gpu=use_gpu,
        num_workers=workers,
        cpus_per_worker=cpus_per_worker,
        threads_per_worker=0,
        augment_actors=cfg.augment_actors,  # 0: Ray Data tasks, on CPUs and GPUs (see training.ingest)
        augment_cpus=1.0 if use_gpu or cpus > 2 else 0.5,
        placement="PACK" if use_gpu else "SPREAD",
        **shares,
    )
    if capacity.bounded:
        plan = leave_room_for_ingest(plan, capacity, fixed=bool(cfg.cpus_per_worker))
    # CPU training: a worker's torch threads may use its host's cores that Ray Data leaves idle
    # between batches (SPREAD puts ceil(workers / hosts) workers on each host).
    cores_per_worker = cpus // capacity.hosts // math.ceil(workers / capacity.hosts) if cpus else cpus_per_worker
    whole_cpus = max(1, int(plan.cpus_per_worker))
    threads = cfg.threads_per_worker or (whole_cpus if use_gpu else max(1, cores_per_worker))
    return dataclasses.replace(plan, threads_per_worker=threads)


MIN_CPUS = 0.25  # the least a train worker, a read/augment task or an augment actor is planned with
CPU_STEP = 0.05  # fractional shares are multiples of this


def _shares(start: float, *, whole: bool) -> list[float]:
    """Candidate CPU shares from `start` down: whole CPUs, then fractions down to MIN_CPUS."""
    out = [float(c) for c in range(int(start), 0, -1)] if whole else [start]
    steps = round((1 - MIN_CPUS) / CPU_STEP)
    return out + [round(1 - CPU_STEP * k, 2) for k in range(1, steps + 1) if 1 - CPU_STEP * k < out[-1]]


def leave_room_for_ingest(plan: ResourcePlan, capacity: Capacity, *, fixed: bool) -> ResourcePlan:
    """The plan, with CPU shares lowered until, with the train workers placed as Ray places
    them, the nodes they leave can run what Ray Data needs at once; else a ConfigError naming
    the numbers. GPU plans lower the augment actors' CPUs first (a GPU trainer's CPU feeds
    its GPU), CPU plans the trainers' (their torch threads are set apart from the share);
    --cpus-per-worker fixes the trainers'."""
    nodes = capacity.node_list()
    trainer_shares = [plan.cpus_per_worker] if fixed else _shares(plan.cpus_per_worker, whole=True)
    augment_shares = _shares(plan.augment_cpus, whole=False)
    pairs = (
        [(t, a) for t in trainer_shares for a in augment_shares]
        if plan.use_gpu
        else [(t, a) for a in augment_shares for t in trainer_shares]
    )
    for cpw, aug in pairs:
        candidate = dataclasses.replace(plan, cpus_per_worker=cpw, augment_cpus=aug)
        counts = place_workers(nodes, plan.num_workers, candidate.worker, spread=plan.placement == "SPREAD")
        if counts is not None and tasks_fit(left_over(nodes, counts, candidate.worker), candidate.ingest_tasks()):
            return candidate
    left = capacity.cpus - plan.num_workers * plan.cpus_per_worker
    need = sum(c for c, _ in plan.ingest_tasks())
    if fixed:
        raise ConfigError(
            f"--num-workers {plan.num_workers} x --cpus-per-worker {plan.cpus_per_worker:g} leave Ray Data "
            f"{max(left, 0):g} of the cluster's {capacity.cpus} CPUs, but reading and augmenting need at least "
            f"{MIN_CPUS * len(plan.ingest_tasks()):g} on a node beside the workers; lower --cpus-per-worker or "
            "--num-workers, or drop --cpus-per-worker to let the plan share the CPUs"
        )
    raise ConfigError(
        f"{plan.num_workers} train worker(s) at {MIN_CPUS:g} CPU or more each leave Ray Data too little of the "
        f"cluster's {capacity.cpus} CPUs: reading and augmenting need {need:g} ({MIN_CPUS:g} at the least) on a "
        "node beside the workers; lower --num-workers" + (" or --augment-actors" if plan.augment_actors else "")
    )


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
) -> dict:
    """Train on a connected Ray cluster; returns the summary written to summary.json.
    `launched_at` (a time.time() value, e.g. process_started_at()) is when start-up began;
    summary.json's startup_s and wall_s count from it (default: now). `own_cluster`: the
    cluster was started by this process and ends with it. `stall`: how long a train worker
    waits for a batch before it asks Ray why (training/loop.py, IngestWatch). `bar_stream`: where
    the per-epoch progress bar is drawn (a terminal; None: no bar); the epoch lines go to `log`."""
    start = launched_at or time.time()
    preset = sized_preset(cfg, preset)
    run_dir = artifacts.join(cfg.storage_path, cfg.name)
    if cfg.deterministic:  # rows reach the trainer in file order, so batches are the same every run
        ray.data.DataContext.get_current().execution_options.preserve_order = True
    capacity = cluster_capacity()
    check_storage(cfg.storage_path, capacity, log)
    plan = plan_resources(cfg, capacity)
    if capacity.note():
        log(f"note: {capacity.note()}")
    if cfg.batch_size < plan.num_workers:
        raise ConfigError(f"--batch-size {cfg.batch_size} is smaller than the {plan.num_workers} workers; raise it")
    decode = choose_decode(cfg.decode, tree.train, preset.train, plan.use_gpu)
    log(f"data: {tree.describe()}")
    warning = few_steps_warning(cfg, tree)
    if warning:
        log(warning)
    rows = augment_rows(cfg.augment_batch_size, tree.train, decode)
    chosen = f" (--preset auto: {auto_preset(tree)[1]})" if cfg.preset == "auto" else ""
    log(
        f"plan: preset {preset.name}{chosen}; {plan.describe()}; {decode.describe()}; "
        f"at most {rows} images per augment call"
    )
    # with the driver: a lost node cannot take them (training/faults.py)
    actors = {
        "clock": driver_actor(EpochClock),
        "bad_log": driver_actor(BadFileLog),
        "board": driver_actor(ProgressBoard),
    }
    attempt = Attempt(
        cfg,
        tree,
        preset,
        actors,
        decode=decode,
        autoscaling=capacity.autoscaling or not capacity.bounded,
        stall=stall or StallLimits(),
        own_cluster=own_cluster,
    )
    try:
        datasets = attempt.datasets(plan, strict=cfg.strict)
        # only now: a start that fails earlier leaves the records of the run NAME holds as they were
        write_config(run_dir, attempt, plan, rows)
        state, best, bad, faults = _fit(attempt, plan, datasets, log=log, bar_stream=bar_stream)
    finally:
        for actor in actors.values():  # nothing of this run may hold cluster resources afterwards
            ray.kill(actor)
    return write_results(cfg, tree, preset, plan, state, bad, start=start, log=log, faults=faults, best=best)


def write_config(run_dir: str, attempt: "Attempt", plan: ResourcePlan, rows: int) -> None:
    """config.json: every setting, the plan, the preset, the classes, the commit and the data."""
    cfg, preset, tree = attempt.cfg, attempt.preset, attempt.tree
    artifacts.write_json(
        artifacts.join(run_dir, "config.json"),
        {
            "config": cfg.to_dict(),
            "plan": dataclasses.asdict(plan)
            | {"decode": dataclasses.asdict(attempt.decode), "augment_batch_size": rows},
            "preset": preset.to_dict(),
            "image_size": preset.image_size,  # evaluation's, and training's at the end
            "train_image_sizes": train_sizes(cfg, preset),  # per epoch
            "class_names": list(tree.class_names),
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
    actors: dict  # the run's driver-side actors: clock, bad_log, board
    decode: DecodePlan
    autoscaling: bool  # the cluster may grow: the ingest watch only waits
    stall: StallLimits
    own_cluster: bool

    def job(self, plan: ResourcePlan) -> dict:
        """What train_loop receives: the config, what the driver found out, and the run's helper
        actors (the epoch clock, and the console's progress board)."""
        cfg, preset = self.cfg, self.preset
        return {
            "config": cfg.to_dict(),
            "class_names": list(self.tree.class_names),
            "preset": preset.to_dict(),
            "image_size": preset.image_size,
            "train_size": len(self.tree.train),
            "threads_per_worker": plan.threads_per_worker,
            "clock": self.actors["clock"],
            "board": self.actors["board"],  # the console's: progress and epoch lines go to the driver through it
            "sizes": train_sizes(cfg, preset) if parse_resize(cfg.progressive_resize) else None,
            "ingest": {"worker": plan.worker, "tasks": plan.ingest_tasks(), "autoscaling": self.autoscaling},
            "stall": self.stall,
        }

    def trainer(self, plan: ResourcePlan, datasets: dict):
        """The TorchTrainer for the plan: workers and their resources, the run directory with one
        checkpoint kept (the best val_acc), and the datasets split as SplitValUnequally says.
        Ray Train restarts nothing itself (max_failures=0): _fit does, with a plan made again."""
        cfg = self.cfg
        return (ray_private.trainer_without_placement_group_cleaner() if self.own_cluster else TorchTrainer)(
            train_loop,
            train_loop_config=self.job(plan),
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
                checkpoint_config=ray.train.CheckpointConfig(
                    num_to_keep=1, checkpoint_score_attribute="val_acc", checkpoint_score_order="max"
                ),
                callbacks=[CheckpointNotice(self.actors["board"])],
            ),
            datasets=datasets,
            dataset_config=SplitValUnequally(plan.num_workers),
        )

    def datasets(self, plan: ResourcePlan, *, strict: bool) -> dict:
        """The plan's datasets; `strict` (the first attempt's, with --strict): every file decoded
        first, and a bad one stops the run with DataError."""
        cfg, bad_log = self.cfg, self.actors["bad_log"]
        run_dir = artifacts.join(cfg.storage_path, cfg.name)
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
            _write_bad_files(run_dir, bad)
            first = next(iter(sorted(bad.items())))
            raise DataError(
                f"{len(bad)} unreadable image(s), e.g. {first[0]}: {first[1]}; see "
                f"{artifacts.join(run_dir, 'bad_files.csv')}; drop --strict to skip them"
            )
        return datasets


def _fit(
    attempt: Attempt, plan: ResourcePlan, datasets: dict, *, log, bar_stream
) -> tuple[dict, dict, dict, list[dict]]:
    """Run the TorchTrainer on `datasets` (the first plan's) while the console follows its progress;
    after a fault, say so in one line and run it again from the last checkpoint, on a plan made
    again, with datasets built for it where it changed (training/faults.py). Returns the last
    checkpoint's state, the best epoch's ({"model", "epoch", "val_acc"}), the files that failed to
    decode, and the faults survived."""
    cfg, board = attempt.cfg, attempt.actors["board"]
    run_dir = artifacts.join(cfg.storage_path, cfg.name)
    faults = FaultLog(run_dir, cfg.max_failures)
    follower = ConsoleFollower(
        lambda seen: ray.get(board.read.remote(seen)),
        total=len(attempt.tree.train),
        epochs=cfg.epochs,
        log=log,
        stream=bar_stream,
        sizes=train_sizes(cfg, attempt.preset) if parse_resize(cfg.progressive_resize) else None,
    )
    built_for = plan
    try:
        with follower:
            while True:
                if plan != built_for:
                    datasets, built_for = attempt.datasets(plan, strict=False), plan
                ray.get(board.new_attempt.remote())
                nodes = alive_nodes()
                result, error = _attempt(attempt.trainer(plan, datasets), board, run_dir)
                if error is None:
                    break
                plan = _after_fault(attempt, plan, error, nodes, faults)
    finally:
        _report_bad_files(attempt.actors["bad_log"], run_dir, log)
    if result.checkpoint is None:
        raise TrainingFailed("training ended without a checkpoint")
    state = _load(result.checkpoint)
    best_checkpoint, best = max(result.best_checkpoints or [(result.checkpoint, {})], key=_val_acc)
    best_model = state["model"] if best_checkpoint.path == result.checkpoint.path else _load(best_checkpoint)["model"]
    best = {"model": best_model, "epoch": best.get("epoch", state["epoch"] + 1), "val_acc": best.get("val_acc")}
    return state, best, ray.get(attempt.actors["bad_log"].get.remote()), faults.records()


def _val_acc(checkpoint_and_metrics) -> float:
    return checkpoint_and_metrics[1].get("val_acc", float("-inf"))


def _load(checkpoint) -> dict:
    with checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, CHECKPOINT_FILE), map_location="cpu", weights_only=True)


def _attempt(trainer, board, run_dir: str):
    """(result, None) of a trainer that finished, or (None, the error) of one that failed."""
    try:
        result = trainer.fit()
    except (KeyboardInterrupt, SystemExit):  # Ray Train's SIGINT handler aborts the run, then sys.exit(0)
        raise Interrupted(ray.get(board.last_checkpoint.remote()), run_dir) from None
    except Exception as e:  # Ray wraps worker errors: _after_fault names the cause
        return None, e
    return (None, result.error) if result.error else (result, None)


def _after_fault(attempt: Attempt, plan: ResourcePlan, error, nodes: dict, faults: FaultLog) -> ResourcePlan:
    """Record the fault; TrainingFailed where the run stops, else the plan to restart on (the
    line said on the console first)."""
    cfg, board = attempt.cfg, attempt.actors["board"]
    lost = lost_nodes(nodes, error)
    progress, _ = ray.get(board.read.remote(1 << 30))
    checkpoint = ray.get(board.last_checkpoint.remote())
    fault = describe(error, lost, progress, checkpoint, cfg.batch_size // plan.num_workers)
    faults.add(fault, error, lost)
    own = worker_error(error, own_only=True)
    if own:  # the train loop's own verdict (a stall, a stale batch, a checkpoint that does not fit)
        raise TrainingFailed(f"training failed: {own}")
    stop = faults.give_up(fault)
    if stop:
        raise TrainingFailed(f"training failed: {stop}")
    ray.get(board.say.remote(-1, fault.line(faults.left)))  # the console prints it in turn with the bar
    try:
        new = wait_for_a_plan(cfg, cfg.node_wait_s)
    except ConfigError as e:
        raise TrainingFailed(
            f"training failed: {fault.summary()}, and for {cfg.node_wait_s:g} s no plan fitted the nodes left: {e}, "
            "or add a node (--node-wait-s: how long to wait for one); details in " + faults.path
        ) from None
    if new != plan:
        ray.get(board.say.remote(-1, f"plan: {new.describe()} (made again for the nodes alive now)"))
    return new


def wait_for_a_plan(cfg: TrainConfig, wait_s: float, poll_s: float = 2.0) -> ResourcePlan:
    """A plan for the nodes alive now, waiting up to `wait_s` for nodes to join where none
    fits; the last ConfigError after that (it names what is missing and the flags that help)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return plan_resources(cfg, cluster_capacity())
        except ConfigError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(poll_s)


def _report_bad_files(bad_log, run_dir: str, log) -> None:
    bad = ray.get(bad_log.get.remote())
    if bad:
        _write_bad_files(run_dir, bad)
        where = artifacts.join(run_dir, "bad_files.csv")
        log(f"skipped {len(bad)} unreadable image(s), listed with reasons in {where}")


def worker_error(error: BaseException, *, own_only: bool = False) -> str:
    """One line for a failed run: the train loop's own error (a stalled or stale input, a
    checkpoint that does not fit) where Ray Train wraps one, else Ray's message (`own_only`:
    "" instead)."""
    for failure in (getattr(error, "worker_failures", None) or {}).values():
        cause = ray_private.worker_exception(failure)
        if isinstance(cause, (IngestStalled, StaleBatch, CheckpointMismatch)):
            return str(cause)
    return "" if own_only else f"{type(error).__name__}: {error}"


def write_results(
    cfg, tree, preset, plan, state: dict, bad: dict, *, start: float, log, faults=(), best: dict | None = None
) -> dict:
    """model.pt (the last epoch's weights), model_best.pt (the best validation accuracy's: `best`,
    from _fit; the last epoch's where None), the plots, TensorBoard files and summary.json from
    the last checkpoint; `faults`: FaultLog.records() of the faults this invocation survived."""
    run_dir = artifacts.join(cfg.storage_path, cfg.name)
    best = best or {"model": state["model"], "epoch": state["epoch"] + 1, "val_acc": state["history"][-1]["val_acc"]}
    artifacts.write_bytes(artifacts.join(run_dir, "model.pt"), model_bytes(state["model"], tree, preset, cfg))
    artifacts.write_bytes(artifacts.join(run_dir, "model_best.pt"), model_bytes(best["model"], tree, preset, cfg))
    artifacts.write_bytes(artifacts.join(run_dir, "curves.png"), plots.curves_png(state["history"]))
    artifacts.write_bytes(
        artifacts.join(run_dir, "confusion.png"), plots.confusion_png(state["confusion"], list(tree.class_names))
    )
    if plots.write_tensorboard(run_dir, state["history"], state["timings"]):
        logdir = artifacts.join(run_dir, "tensorboard")
        # tensorboardX writes the files without TensorBoard itself, which has the viewer
        viewer = "" if shutil.which("tensorboard") else "pip install tensorboard, then "
        log(f"tensorboard: {viewer}tensorboard --logdir {logdir}")
    summary = summarize(state, start, plan, tree, bad) | {"faults": list(faults), "best_epoch": best["epoch"]}
    for c in summary["coverage"]:
        if c["as_expected"] is False:
            log(
                f"warning: epoch {c['epoch']} trained on {c['seen']} rows of {c['distinct']} distinct images, "
                f"expected each of {c['expected']} once ({c['repeated']} repeated, {c['missing']} missing)"
            )
    artifacts.write_json(artifacts.join(run_dir, "summary.json"), summary)
    return summary


def model_bytes(state_dict, tree: ImageTree, preset: Preset, cfg: TrainConfig) -> bytes:
    """model.pt: everything inference needs, loadable with torch.load(weights_only=True)."""
    import io

    buf = io.BytesIO()
    torch.save(
        {
            "arch": "resnet18",
            "state_dict": state_dict,
            "class_names": list(tree.class_names),
            "image_size": preset.image_size,
            "small_stem": uses_small_stem(cfg.small_stem, preset.image_size),
            "eval_transform": {
                "ops": json.loads(json.dumps(preset.eval)),
                "mean": list(preset.mean),
                "std": list(preset.std),
            },
            "config": cfg.to_dict(),
        },
        buf,
    )
    return buf.getvalue()


def _write_bad_files(run_dir: str, bad: dict[str, str]) -> None:
    artifacts.write_csv(
        artifacts.join(run_dir, "bad_files.csv"), [{"path": p, "reason": r} for p, r in sorted(bad.items())]
    )


def good_images(split, bad: dict[str, str]) -> np.ndarray:
    """The keys of the split's images that are not among the `bad` files ({path: reason})."""
    bad_rel = [p[len(split.root) + 1 :] for p in bad if p.startswith(split.root + "/")]
    return split.keys[~np.isin(split.rel_paths, bad_rel)] if bad_rel else split.keys


def coverage(seen_per_epoch: list[list[dict]], tree: ImageTree, bad: dict[str, str]) -> list[dict]:
    """Per epoch: did the ranks together train on every good image exactly once?

    Each rank reports the rows it trained on, how many distinct images they were, and the
    sum of those images' keys (mod KEY_MOD). `exactly_once`: as many rows as images, all
    distinct, and the key sums agree. `every_image`: each image at least once (repeats
    aside). An equal split may drop up to world_size - 1 rows: `as_expected` is True when
    the epoch was exactly once or lost only such rows (a single one is checked to be an
    image of the split by its key), None when several were dropped (the sum cannot tell
    which), False otherwise (a restarted augment actor can redeliver a batch).
    """
    good = good_images(tree.train, bad) % KEY_MOD
    expected_sum = int(good.sum() % KEY_MOD)
    out = []
    for epoch, ranks in enumerate(seen_per_epoch, start=1):
        rows = sum(r["count"] for r in ranks)
        distinct = sum(r.get("distinct", r["count"]) for r in ranks)  # records before distinct keys: rows
        short = (expected_sum - sum(r["key_sum"] for r in ranks)) % KEY_MOD  # keys of the images not seen
        missing = max(0, len(good) - distinct)
        every_image = distinct == len(good) and short == 0
        as_expected = every_image and rows == distinct
        if rows == distinct and 0 < missing < len(ranks):
            as_expected = bool((good == short).any()) if missing == 1 else None
        out.append(
            {
                "epoch": epoch,
                "expected": len(good),
                "seen": rows,
                "distinct": distinct,
                "exactly_once": every_image and rows == distinct,
                "every_image": every_image,
                "as_expected": as_expected,
                "repeated": rows - distinct,
                "missing": missing,
                "dropped_for_equal_split": len(ranks) - 1,
                "per_rank": [r["count"] for r in ranks],
            }
        )
    return out


def fingerprints(seen_per_epoch: list[list[dict]]) -> list[dict]:
    """Per epoch: a digest of every augmented view trained on (equal for two runs that trained
    on the same views; different for two epochs that did not reuse an augmentation) and
    each rank's random-stream digest where the epoch began."""
    return [
        {
            "epoch": e,
            "views": sum(r.get("views", 0) for r in ranks) % KEY_MOD,  # 0: recorded before view digests
            "rng_per_rank": [r.get("rng") for r in ranks],
        }
        for e, ranks in enumerate(seen_per_epoch, start=1)
    ]


def summarize(state: dict, start: float, plan: ResourcePlan, tree: ImageTree, bad: dict[str, str]) -> dict:
    history, timings = state["history"], state["timings"]
    last = history[-1]
    steady = timings[1:] or timings  # skip the first epoch (actor start-up) when there is more than one
    this_run = [t for t in state.get("first_steps", []) if t >= start]  # first steps of this invocation's attempts
    confusion = state["confusion"]
    summary = {
        "epochs": last["epoch"],
        "val_acc": last["val_acc"],
        "val_loss": last["val_loss"],
        "best_val_acc": max(r["val_acc"] for r in history),
        "train_loss": last["train_loss"],
        "train_acc": last["train_acc"],
        "train_images_per_s": round(
            sum(t["images_per_s"] * t["epoch_s"] for t in steady) / sum(t["epoch_s"] for t in steady), 1
        ),
        "data_wait_frac": round(
            sum(t["data_wait_frac"] * t["epoch_s"] for t in steady) / sum(t["epoch_s"] for t in steady), 4
        ),
        "wall_s": round(time.time() - start, 1),
        # launch to the end of this invocation's first training step: imports, Ray, the trainer
        # and the data pipeline starting (a rerun that resumes counts its own)
        "startup_s": round(min(this_run) - start, 1) if this_run else None,
        "world_size": plan.num_workers,
        "device": "cuda" if plan.use_gpu else "cpu",
        "num_classes": tree.num_classes,
        "train_images": len(tree.train),  # files found
        "train_images_trained": int(good_images(tree.train, bad).size),  # those that decode
        "val_images": len(tree.val),
        "per_class_val_acc": {
            name: round(row[i] / sum(row), 6) if sum(row) else None
            for i, (name, row) in enumerate(zip(tree.class_names, confusion, strict=True))
        },
        "coverage": coverage(state["seen"], tree, bad),
        "fingerprints": fingerprints(state["seen"]),
        "bad_files": len(bad),
        "resumed_at_epochs": state["resumed_at_epochs"],
        "ranks": state["ranks"],
    }
    if "val_top5" in last:
        summary["val_top5"] = last["val_top5"]
    return summary
