"""The augment stage on Ray Data: a callable class for `Dataset.map_batches` (an actor pool),
`augment_task`, its function form for Ray Data tasks (the default on CPUs and GPUs), the
arguments both are built from (StageArgs), their resources (task_resources) and the
mapping itself (add_augment). The augmentation it runs is the augment package's, which
knows nothing of Ray.

Each builds its pipeline once per process, on `cuda` when Ray gave it a GPU and on the
CPU otherwise, and then augments whole batches, decoded or still encoded:

    {image: uint8 (B, H, W, 3) or ragged, label, key, epoch}  ->  {image: uint8 (B, S, S, 3), label, key, epoch}
    {bytes, path, label, key, epoch}                          ->  the same, decoded in the same call
                                                           (augment/batch.py, decode_augment)

A file that fails to decode is dropped from its batch on its own and reported, with its
path, to the run's bad-file log.

The epoch, which the augmentation depends on, comes with the rows: the read task writes the
epoch it read for (training/stream/ingest.py, from the run's epoch clock, once an execution),
so no augment call asks an actor; every row leaves with the epoch its parameters were drawn
for (training/stream/stamp.py: the epoch stamp). The stage's Pipeline keeps the epoch's
pipeline (Pipeline.at_epoch) from the epoch's first batch to its last.

This module imports no torch at import: Ray's coordinator processes unpickle the dataset
plan that names these classes, and only the processes that augment need torch.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import ray
import ray.data

from augment.presets import Preset, preset_from_dict
from training.rows import (
    AUGMENT_COST,
    AUGMENT_GPU_COST,
    BYTES,
    DECODED_ON,
    EPOCH,
    IMAGE,
    KEY,
    LABEL,
    PATH,
    READ_COST,
)
from training.stream.stamp import stamp


def seconds_per_row(started: float, rows: int) -> np.ndarray:
    """A stage's stamp for the `rows` rows it made (READ_COST, AUGMENT_COST): each one's share of
    the seconds since `started` (time.perf_counter())."""
    return np.full(rows, (time.perf_counter() - started) / max(rows, 1), dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class StageArgs:
    """What an augment stage is built from, one per split: hashable, so it is also the key of a
    task process's pipeline cache (STAGES). Light to unpickle in Ray's coordinator processes
    (augment/presets.py imports no torch)."""

    preset: Preset
    train: bool  # the preset's train ops (and the schedules); else its eval ops, fixed
    seed: int
    schedule: str = "none"  # --augment-schedule: strength by epoch (train only)
    epochs: int = 1
    shrink: bool = False  # the CPU train path decodes each JPEG at the smallest scale its crop allows
    resize: str = "none"  # --progressive-resize (train only)
    gpu_decoder: str = "auto"  # --gpu-decoder (augment/batch.py default_decoder)

    @classmethod
    def of(cls, preset: Preset | dict, **fields) -> "StageArgs":
        """From a preset, or a preset's mapping (Preset.to_dict, a file's contents), checked."""
        return cls(preset=preset if isinstance(preset, Preset) else preset_from_dict(preset), **fields)


class AugmentStage:
    """map_batches callable (an actor pool's, or augment_task's per-process stage): `args` fix
    the pipeline; the epoch comes with the rows (EPOCH; evaluation's may have none), bad files
    go to `bad_log`."""

    def __init__(self, args: StageArgs, *, device: str = "auto", bad_log=None):
        import torch

        from augment.pipeline import Pipeline

        if device == "auto":  # an actor: Ray fixed its GPU in CUDA_VISIBLE_DEVICES when it started
            device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self.device = torch.device(device)
        spec = args.preset
        # the strength and resolution schedules are training-time knobs; evaluation stays fixed,
        # at the final size (docs/design.md)
        ops = spec.train if args.train else spec.eval
        schedules = {"schedule": args.schedule, "resize": args.resize} if args.train else {}
        self.pipeline = Pipeline(ops, seed=args.seed, epochs=args.epochs, **schedules).to(self.device)
        self.shrink = args.shrink and args.train  # evaluation decodes at full size (torchvision parity)
        self.gpu_decoder = args.gpu_decoder
        self.bad_log = bad_log
        self.train = args.train

    def epoch_of(self, batch: dict) -> int:
        """The epoch the rows were read for (an execution reads for one). Evaluation and prediction
        draw nothing, so their rows may come without one; a training batch without it would be
        augmented for epoch 0 in every epoch, unseen: that is an error."""
        if EPOCH in batch and len(batch[EPOCH]):
            return int(batch[EPOCH][0])
        if self.train:
            raise ValueError(f"a training batch without its {EPOCH!r} column: the read task stamps every row")
        return 0

    def __call__(self, batch: dict) -> dict:
        import torch

        from augment.batch import augment_batch, decode_augment, default_decoder
        from augment.decode import ON_CPU

        started = time.perf_counter()
        if self.device.index is not None:  # a task's cuda:N: what lands on "the" GPU lands on ours
            torch.cuda.set_device(self.device)
        clock = StreamClock(self.device)
        epoch = self.epoch_of(batch)
        keys = torch.as_tensor(np.array(batch[KEY]))
        if BYTES in batch:
            decoder = default_decoder(self.device, self.gpu_decoder)
            out, kept, bad, where = decode_augment(
                self.pipeline, batch[BYTES], keys, epoch, self.device, shrink=self.shrink, decoder=decoder
            )
            if bad and self.bad_log is not None:  # fire and forget: the driver reads the log later
                self.bad_log.add.remote([(str(batch[PATH][i]), reason) for i, reason in bad])
        else:
            out = augment_batch(self.pipeline, batch[IMAGE], keys, epoch, self.device)
            kept, where = slice(None), [ON_CPU] * len(out)
        clock.stop()
        image = out.cpu().numpy()  # .cpu() is a sync point on GPU
        rows = len(image)
        # key travels on so the trainer can count which images each rank saw; epoch is the stamp;
        # each stage's seconds per image, for what bounds the epoch (training/bounds.py)
        read = np.asarray(batch[READ_COST])[kept] if READ_COST in batch else np.zeros(rows, np.float32)
        return {
            IMAGE: image,
            LABEL: np.asarray(batch[LABEL])[kept],
            KEY: np.asarray(batch[KEY])[kept],
            EPOCH: stamp(rows, epoch),
            READ_COST: read,
            AUGMENT_COST: seconds_per_row(started, rows),
            AUGMENT_GPU_COST: np.full(rows, clock.seconds() / max(rows, 1), dtype=np.float32),
            DECODED_ON: np.asarray(where, dtype=np.int8),
        }


class StreamClock:
    """CUDA events around an augment call on its device's current stream (nothing off a GPU):
    seconds() is the time from its first queued operation to its last, read after a sync."""

    def __init__(self, device):
        import torch

        self.events = None
        if device.type == "cuda":
            self.events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.events[0].record()

    def stop(self) -> None:
        if self.events:
            self.events[1].record()

    def seconds(self) -> float:
        if not self.events:
            return 0.0
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1000


STAGES: dict[tuple[StageArgs, str], AugmentStage] = {}  # per worker process: (args, device) -> its stage

# Ray's remote env of an augment task on a GPU share (training/stream/ingest.py task_resources): Ray
# leaves CUDA_VISIBLE_DEVICES as the node has it, instead of narrowing it to the task's GPU.
GPU_TASK_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def cuda_index(gpu_id, visible: str | None) -> int:
    """torch's index of the GPU that Ray calls `gpu_id`, in a process that sees `visible`
    (its CUDA_VISIBLE_DEVICES, None when unset): Ray's ids are the entries of the node's
    CUDA_VISIBLE_DEVICES where it has one, and 0..N-1 otherwise."""
    gpu_id = str(gpu_id).strip()
    if not visible:
        return int(gpu_id)
    entries = [v.strip() for v in visible.split(",")]
    if gpu_id not in entries:
        raise RuntimeError(f"Ray gave this task GPU {gpu_id}, which CUDA_VISIBLE_DEVICES={visible} does not list")
    return entries.index(gpu_id)


FAKE_GPUS_ENV = "RGA_FAKE_GPUS"  # "1" on a node whose GPUs are a resource only: GPU tasks run on its CPU


def task_device() -> str:
    """The device of this task: "cuda:N" for the GPU Ray gave it, "cpu" without one. A GPU that
    torch cannot see is an error, not a quiet fall-back to the CPU, but on a node whose GPUs
    are declared fake (FAKE_GPUS_ENV=1: a test cluster's, where the GPU is only a resource to
    schedule by).

    A task's worker process outlives it (max_calls=0) and may get another GPU of the node in
    its next task; CUDA fixes a process's visible devices when it first starts, so the task
    runs with all of the node's GPUs visible (GPU_TASK_ENV) and picks its own by index."""
    import os

    import torch

    ids = ray.get_gpu_ids()
    if not ids or (not torch.cuda.is_available() and os.environ.get(FAKE_GPUS_ENV) == "1"):
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"Ray gave this task GPU {ids[0]}, but torch {torch.__version__} finds no CUDA device on this node "
            f"(a CPU-only torch build, or no NVIDIA driver): install a CUDA build of torch there, or train with "
            "--device cpu"
        )
    index = cuda_index(ids[0], os.environ.get("CUDA_VISIBLE_DEVICES"))
    if index >= torch.cuda.device_count():
        raise RuntimeError(
            f"Ray gave this task GPU {ids[0]}, but torch sees {torch.cuda.device_count()} GPU(s) in this process "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}): the node's Ray says it has more GPUs "
            "than it has (--num-gpus), or they are MIG instances, of which CUDA shows a process one; there, "
            "run jobs.train with --augment-actors N"
        )
    return f"cuda:{index}"


def drop_other_devices(device: str) -> None:
    """Forget this process's pipelines on other devices than `device`, and hand the memory
    torch cached on those GPUs back to them: a process that Ray has moved to another GPU of
    its node keeps one pipeline at a time (its CUDA context on the old GPU stays)."""
    import torch

    for key in [k for k, stage in STAGES.items() if str(stage.device) != device]:
        old = STAGES.pop(key).device
        if old.type == "cuda":
            with torch.cuda.device(old):
                torch.cuda.empty_cache()


def augment_task(batch: dict, *, args: StageArgs, bad_log=None) -> dict:
    """map_batches *function* form of AugmentStage for Ray Data tasks: the worker processes
    outlive the epoch (on a GPU share too: task_resources), so nothing is rebuilt when the
    next epoch starts, while an actor pool is started afresh for each epoch's execution.
    The task runs on the GPU Ray gave it (task_device), with the process's pipeline for that
    device (drop_other_devices)."""
    device = task_device()
    stage = STAGES.get((args, device))
    if stage is None:
        drop_other_devices(device)
        stage = STAGES[(args, device)] = AugmentStage(args, device=device)
    stage.bad_log = bad_log
    return stage(batch)


def task_resources(plan, inputs: int | None = None) -> dict:
    """map_batches arguments of an augment task beyond its function: Ray's remote args, and on
    a GPU share also a cap on the tasks at once: plan.augment_concurrency, the planned number
    beside the trainers, where Ray Data would start up to 16 on each GPU the trainers leave;
    no more than the blocks the read hands the map (`inputs`: one per read task; 0, an empty
    split: no cap), as Ray Data warns of a cap it cannot reach.

    - `max_calls=0`: Ray ends a GPU task's worker process after each task by default, and a
      fresh process pays the CUDA context, nvjpeg and kernel loading in its first block
      (docs/design.md, "Choices and where they were measured"); with 0 the processes outlive
      the epoch and keep their pipeline on the device (augment_task), as CPU tasks do.
    - GPU_TASK_ENV: a process that outlives its task may get another GPU of the node in its
      next one; Ray then leaves CUDA_VISIBLE_DEVICES alone and the task picks its device by
      the id Ray gave it (task_device).
    - A GPU task's 1 CPU is Ray Data's default, left unsaid: Ray Data warns when both are given
      (the plan may lower the share below 1 on a small node, and then gives it)."""
    if not plan.augment_gpus:
        return {"num_cpus": plan.augment_cpus}
    cpus = {} if plan.augment_cpus == 1 else {"num_cpus": plan.augment_cpus}
    size = plan.augment_concurrency if inputs is None else min(plan.augment_concurrency, inputs)
    cap = {"compute": ray.data.TaskPoolStrategy(size=size)} if size else {}
    return {"num_gpus": plan.augment_gpus, "max_calls": 0, "runtime_env": {"env_vars": GPU_TASK_ENV}} | cpus | cap


def add_augment(ds, plan, args: StageArgs, *, bad_log, rows: int, inputs: int):
    """ds with the augment stage mapped over it where the plan puts it (training/stream/ingest.py
    build_datasets): `rows` images per call, `inputs` the read's blocks."""
    kwargs = {"bad_log": bad_log}
    if not plan.augment_tasks:
        return ds.map_batches(
            AugmentStage,
            fn_constructor_args=(args,),
            fn_constructor_kwargs=kwargs,
            compute=ray.data.ActorPoolStrategy(size=plan.augment_actors),
            num_gpus=plan.augment_gpus,
            batch_format="numpy",
            batch_size=rows,
            num_cpus=plan.augment_cpus,
        )
    # CPU: one call per read task's block, so Ray Data fuses read and augment. GPU: Ray fuses no
    # read with a map that holds GPUs (it wants a batch size there), so read tasks pass the
    # encoded files to augment tasks, a batch at a time
    batch = rows if plan.augment_gpus else None
    resources = task_resources(plan, inputs=inputs)
    kwargs["args"] = args
    return ds.map_batches(augment_task, fn_kwargs=kwargs, batch_format="numpy", batch_size=batch, **resources)
