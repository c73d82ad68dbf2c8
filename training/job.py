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
import subprocess
import time

import numpy as np
import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer

from augment.presets import Preset, load_preset
from augment.schedule import parse_resize, resize_side
from augment.stage import EpochClock
from training import artifacts, plots
from training.config import ConfigError, TrainConfig, check_amp
from training.console import ConsoleFollower, ProgressBoard
from training.data import BadFileLog, DataError, ImageTree
from training.ingest import SplitValUnequally, build_datasets, choose_decode
from training.inputs import check_inputs
from training.loop import CHECKPOINT_FILE, KEY_MOD, train_loop
from training.model import uses_small_stem


class OwnClusterTorchTrainer(TorchTrainer):
    """TorchTrainer for a cluster that this process started and that ends with it, less Ray
    Train's placement-group cleaner: a detached actor that frees the run's placement group
    should the controller die, which has nothing to outlive here. It would cost one more
    process at start-up, and without the dashboard it polls a state API that is not there,
    warning every few seconds. (On a Ray Train without this hook the override is never
    called, and the trainer is the plain one.)"""

    def _create_default_callbacks(self):
        callbacks = super()._create_default_callbacks()
        return [c for c in callbacks if type(c).__name__ != "PlacementGroupCleanerCallback"]


class TrainingFailed(RuntimeError):
    """Training started but did not finish."""


class Interrupted(RuntimeError):
    """The user stopped the run (Ctrl-C); its last checkpoint stays usable."""


def prepare(cfg: TrainConfig) -> tuple[TrainConfig, ImageTree, Preset]:
    """Everything that needs no cluster: resolve defaults, scan the tree, load the preset."""
    cfg, tree = check_inputs(cfg)
    return cfg, tree, load_preset(cfg.preset)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What the cluster has now, or can grow to when it autoscales."""

    cpus: int
    gpus: int
    hosts: int  # distinct machines among the alive nodes (nodes on one host share its disk)
    autoscaling: bool = False
    bounded: bool = True  # False: an autoscaler runs whose limits Ray does not publish

    def note(self) -> str:
        if not self.bounded:
            return (
                "an autoscaler runs but does not publish its limits: requests beyond the current "
                f"{self.cpus} CPU / {self.gpus} GPU wait for new nodes (pass --device cuda --num-workers N "
                "when the cluster starts without GPU nodes)"
            )
        return ""


def _v1_autoscaler_runs() -> bool:
    """True when `ray up`'s (v1) autoscaler manages this cluster. Every cluster's monitor
    writes a status; without an autoscaling config its read-only provider names each node's
    type "node_<node id>", while a real autoscaler uses the config's node types."""
    import json

    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    if not raw:
        return False
    mapping = json.loads(raw).get("autoscaler_report", {}).get("node_type_mapping") or {}
    return any(node_type != f"node_{node_id}" for node_id, node_type in mapping.items())


def cluster_capacity() -> Capacity:
    """Current resources, raised to the autoscaler's ceiling where Ray publishes one (autoscaler
    v2, KubeRay); Ray Train checks its workers against the same ceiling."""
    from ray._private.state import state

    now = ray.cluster_resources()
    ceiling = state.get_max_resources_from_cluster_config() or {}
    autoscaler_v1 = not ceiling and _v1_autoscaler_runs()
    return Capacity(
        cpus=max(int(now.get("CPU", 0)), int(ceiling.get("CPU", 0))),
        gpus=max(int(now.get("GPU", 0)), int(ceiling.get("GPU", 0))),
        hosts=len({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}),
        autoscaling=bool(ceiling) or autoscaler_v1,
        bounded=not autoscaler_v1,
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


@dataclasses.dataclass(frozen=True)
class ResourcePlan:
    use_gpu: bool
    num_workers: int
    cpus_per_worker: int
    gpus_per_worker: float  # < 1 when augment actors share the trainers' GPUs
    threads_per_worker: int
    augment_actors: int  # per split; 0: Ray Data tasks instead (the CPU default)
    augment_gpus: float  # per augment actor; 0 on a CPU-only plan
    augment_cpus: float
    placement: str  # PACK keeps GPU ranks together (NVLink); SPREAD gives CPU ranks their own cores

    def describe(self) -> str:
        where = f"{self.gpus_per_worker:g} GPU + " if self.use_gpu else ""
        aug = f"{self.augment_gpus:g} GPU" if self.augment_gpus else f"{self.augment_cpus:g} CPU"
        who = "augment tasks" if self.augment_tasks else f"{self.augment_actors} augment actor(s)"
        return (
            f"{self.num_workers} train worker(s) x ({where}{self.cpus_per_worker} CPU, "
            f"{self.threads_per_worker} torch threads), {self.placement}; {who} x {aug} per split"
        )

    @property
    def augment_tasks(self) -> bool:
        return self.augment_actors == 0


def plan_resources(cfg: TrainConfig, capacity: Capacity) -> ResourcePlan:
    """Split the cluster between train workers and Ray Data (docs/design.md: leave CPUs for ingest).

    On GPUs the augment actors share the trainers' GPUs (each takes a quarter of one, the
    trainer the rest) unless --augment-gpus says otherwise; a whole GPU per actor only pays
    when augmentation is heavy next to the model. On CPUs one worker uses all cores by
    default: two workers on two cores fight over them.
    """
    cpus, gpus = capacity.cpus, capacity.gpus
    use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and gpus > 0)
    if use_gpu and gpus == 0 and capacity.bounded:
        raise ConfigError("--device cuda: the Ray cluster has no GPUs and cannot get any; use --device cpu or auto")
    check_amp(cfg.amp, on_gpu=use_gpu)
    workers = cfg.num_workers or (max(gpus, 1) if use_gpu else 1)
    actors = cfg.augment_actors or (workers if use_gpu else 0)  # CPU: tasks (see training.ingest)
    augment_gpus = (cfg.augment_gpus or 0.25) if use_gpu else 0.0
    gpus_per_worker = 1.0
    if use_gpu:
        dedicated = augment_gpus >= 1
        needed = workers + (actors * augment_gpus if dedicated else 0)
        if needed > gpus and capacity.bounded:
            raise ConfigError(
                f"--num-workers {workers}"
                + (f" + {actors} dedicated augment GPUs" if dedicated else "")
                + f" need {needed:g} GPUs but the cluster has at most {gpus}; lower --num-workers"
            )
        if not dedicated:  # each GPU keeps room for the augment actors placed on it
            gpus_per_worker = 1.0 - augment_gpus * math.ceil(actors / max(workers, 1))
            if gpus_per_worker <= 0:
                raise ConfigError(
                    f"--augment-actors {actors} x {augment_gpus:g} GPU leave no GPU for {workers} train worker(s)"
                )
    cpus_per_worker = cfg.cpus_per_worker or max(1, cpus // 2 // workers)
    if workers * cpus_per_worker > cpus and capacity.bounded:
        raise ConfigError(
            f"--num-workers {workers} x {cpus_per_worker} CPU each needs {workers * cpus_per_worker} CPUs "
            f"but the cluster has at most {cpus}; lower --num-workers or --cpus-per-worker"
        )
    # CPU training: a worker's torch threads may use its host's cores that Ray Data leaves idle
    # between batches (SPREAD puts ceil(workers / hosts) workers on each host).
    cores_per_worker = cpus // capacity.hosts // math.ceil(workers / capacity.hosts) if cpus else cpus_per_worker
    threads = cfg.threads_per_worker or (cpus_per_worker if use_gpu else max(1, cores_per_worker))
    return ResourcePlan(
        use_gpu=use_gpu,
        num_workers=workers,
        cpus_per_worker=cpus_per_worker,
        gpus_per_worker=gpus_per_worker,
        threads_per_worker=threads,
        augment_actors=actors,
        augment_gpus=augment_gpus,
        augment_cpus=1.0 if use_gpu or cpus > 2 else 0.5,
        placement="PACK" if use_gpu else "SPREAD",
    )


def sized_preset(cfg: TrainConfig, preset: Preset) -> Preset:
    """The preset at --image-size, with --progressive-resize checked against its training size."""
    if cfg.image_size:
        preset = preset.at_size(cfg.image_size)
    resize = parse_resize(cfg.progressive_resize, cfg.epochs)
    if resize and resize[0] >= preset.train_size:
        raise ConfigError(
            f"--progressive-resize {cfg.progressive_resize}: starts at {resize[0]} px, not below the training size "
            f"{preset.train_size} px; give a smaller FROM or a larger --image-size"
        )
    return preset


def train_sizes(cfg: TrainConfig, preset: Preset) -> list[int]:
    """The training crops' side, epoch by epoch (progressive resizing), for config.json and the console."""
    return [resize_side(cfg.progressive_resize, e, cfg.epochs, preset.train_size) for e in range(cfg.epochs)]


def git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def process_started_at() -> float:
    """Wall-clock time this process started (Linux: from /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def run(
    cfg: TrainConfig,
    tree: ImageTree,
    preset: Preset,
    *,
    log=print,
    launched_at: float | None = None,
    own_cluster: bool = False,
    bar_stream=None,
) -> dict:
    """Train on a connected Ray cluster; returns the summary written to summary.json.
    `launched_at` (a time.time() value, e.g. process_started_at()) is when start-up began;
    summary.json's startup_s and wall_s count from it (default: now). `own_cluster`: the
    cluster was started by this process and ends with it. `bar_stream`: where the per-epoch
    progress bar is drawn (a terminal; None: no bar); the epoch lines go to `log`."""
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
    log(f"plan: {plan.describe()}; {decode.describe()}")
    artifacts.write_json(
        artifacts.join(run_dir, "config.json"),
        {
            "config": cfg.to_dict(),
            "plan": dataclasses.asdict(plan) | {"decode": dataclasses.asdict(decode)},
            "preset": preset.to_dict(),
            "image_size": preset.image_size,  # evaluation's, and training's at the end
            "train_image_sizes": train_sizes(cfg, preset),  # per epoch
            "class_names": list(tree.class_names),
            "git_commit": git_commit(),
            "data_root": tree.root,
        },
    )

    helpers = [ray.remote(num_cpus=0)(cls).remote() for cls in (EpochClock, BadFileLog, ProgressBoard)]
    console = {"log": log, "bar_stream": bar_stream}
    try:
        return _fit(
            cfg,
            tree,
            preset,
            plan,
            *helpers,
            decode=decode,
            run_dir=run_dir,
            start=start,
            console=console,
            own_cluster=own_cluster,
        )
    finally:
        for actor in helpers:  # nothing of this run may hold cluster resources afterwards
            ray.kill(actor)


def _fit(cfg, tree, preset, plan, clock, bad_log, board, *, decode, run_dir, start, console, own_cluster) -> dict:
    log = console["log"]
    datasets = build_datasets(cfg, tree, preset, plan, clock, bad_log, decode)
    bad = ray.get(bad_log.get.remote()) if cfg.strict else {}  # --strict decoded every file above
    if bad:
        _write_bad_files(run_dir, bad)
        first = next(iter(sorted(bad.items())))
        raise DataError(
            f"{len(bad)} unreadable image(s), e.g. {first[0]}: {first[1]}; see "
            f"{artifacts.join(run_dir, 'bad_files.csv')}; drop --strict to skip them"
        )
    job = {
        "config": cfg.to_dict(),
        "class_names": list(tree.class_names),
        "preset": preset.to_dict(),
        "image_size": preset.image_size,
        "train_size": len(tree.train),
        "threads_per_worker": plan.threads_per_worker,
        "clock": clock,
        "board": board,  # the console's: progress and epoch lines go to the driver through it
        "progress": console["bar_stream"] is not None,  # ranks post progress only when a bar is drawn
        "sizes": train_sizes(cfg, preset) if parse_resize(cfg.progressive_resize) else None,
    }
    trainer = (OwnClusterTorchTrainer if own_cluster else TorchTrainer)(
        train_loop,
        train_loop_config=job,
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
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=1, checkpoint_score_attribute="val_acc", checkpoint_score_order="max"
            ),
        ),
        datasets=datasets,
        dataset_config=SplitValUnequally(plan.num_workers),
    )
    follower = ConsoleFollower(
        lambda seen: ray.get(board.read.remote(seen)),
        total=len(tree.train),
        epochs=cfg.epochs,
        log=log,
        stream=console["bar_stream"],
        sizes=job["sizes"],
    )
    try:
        with follower:
            result = trainer.fit()
    except (KeyboardInterrupt, SystemExit):  # Ray Train's SIGINT handler aborts the run, then sys.exit(0)
        raise Interrupted(
            f"interrupted; the last checkpoint is in {run_dir}: rerun with the same --name to resume"
        ) from None
    except Exception as e:  # Ray wraps worker errors; keep the cause, drop the stack
        raise TrainingFailed(f"training failed: {type(e).__name__}: {e}") from e
    finally:
        bad = ray.get(bad_log.get.remote())
        if bad:
            _write_bad_files(run_dir, bad)
            log(
                f"skipped {len(bad)} unreadable image(s), listed with reasons in "
                f"{artifacts.join(run_dir, 'bad_files.csv')}"
            )
    if result.error:
        raise TrainingFailed(f"training failed: {result.error}")
    if result.checkpoint is None:
        raise TrainingFailed("training ended without a checkpoint")
    with result.checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, CHECKPOINT_FILE), map_location="cpu", weights_only=True)
    artifacts.write_bytes(artifacts.join(run_dir, "model.pt"), _model_bytes(state["model"], tree, preset, cfg))
    artifacts.write_bytes(artifacts.join(run_dir, "curves.png"), plots.curves_png(state["history"]))
    artifacts.write_bytes(
        artifacts.join(run_dir, "confusion.png"), plots.confusion_png(state["confusion"], list(tree.class_names))
    )
    if plots.write_tensorboard(run_dir, state["history"], state["timings"]):
        log(f"tensorboard: tensorboard --logdir {artifacts.join(run_dir, 'tensorboard')}")
    summary = summarize(state, start, plan, tree, bad)
    for problem in (c for c in summary["coverage"] if c["duplicated"] or c["missing"] > c["dropped_for_equal_split"]):
        log(
            f"warning: epoch {problem['epoch']} trained on {problem['seen']} images, expected {problem['expected']} "
            f"({problem['duplicated']} duplicated, {problem['missing']} missing)"
        )
    artifacts.write_json(artifacts.join(run_dir, "summary.json"), summary)
    return summary


def _model_bytes(state_dict, tree: ImageTree, preset: Preset, cfg: TrainConfig) -> bytes:
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


def coverage(seen_per_epoch: list[list[dict]], tree: ImageTree, bad: dict[str, str]) -> list[dict]:
    """Per epoch: did the ranks together train on every good image exactly once?

    Each rank reports how many images it trained on and the sum of their keys (mod KEY_MOD).
    Equal splits may drop up to world_size - 1 rows; more missing, or any surplus, is
    reported (a restarted augment actor can redeliver a batch).
    """
    split = tree.train
    bad_rel = [p[len(split.root) + 1 :] for p in bad if p.startswith(split.root + "/")]
    good = split.keys[~np.isin(split.rel_paths, bad_rel)] if bad_rel else split.keys
    expected_sum = int((good % KEY_MOD).sum() % KEY_MOD)
    out = []
    for epoch, ranks in enumerate(seen_per_epoch, start=1):
        count = sum(r["count"] for r in ranks)
        out.append(
            {
                "epoch": epoch,
                "expected": len(good),
                "seen": count,
                "exactly_once": count == len(good) and sum(r["key_sum"] for r in ranks) % KEY_MOD == expected_sum,
                "duplicated": max(0, count - len(good)),
                "missing": max(0, len(good) - count),
                "dropped_for_equal_split": len(ranks) - 1,
                "per_rank": [r["count"] for r in ranks],
            }
        )
    return out


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
        "train_images": len(tree.train),
        "val_images": len(tree.val),
        "per_class_val_acc": {
            name: round(row[i] / sum(row), 6) if sum(row) else None
            for i, (name, row) in enumerate(zip(tree.class_names, confusion, strict=True))
        },
        "coverage": coverage(state["seen"], tree, bad),
        "bad_files": len(bad),
        "resumed_at_epochs": state["resumed_at_epochs"],
        "ranks": state["ranks"],
    }
    if "val_top5" in last:
        summary["val_top5"] = last["val_top5"]
    return summary
