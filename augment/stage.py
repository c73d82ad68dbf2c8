"""The augment stage: a callable class for `Dataset.map_batches` (an actor pool), and
`augment_task`, its function form for Ray Data tasks (the default on CPUs and GPUs).

Each builds its pipeline once per process, on `cuda` when Ray gave it a GPU and on the
CPU otherwise, and then augments whole batches, decoded or still encoded:

    {image: uint8 (B, H, W, 3) or ragged, label, key}  ->  {image: uint8 (B, S, S, 3), label, key, epoch}
    {bytes, path, label, key}                          ->  the same, decoded in the same call
                                                           (augment/batch.py, decode_augment)

A file that fails to decode is dropped from its batch on its own and reported, with its
path, to the run's bad-file log.

The epoch, which the augmentation depends on, comes from a tiny `EpochClock` actor that
rank 0 of the trainer advances before each epoch starts (Ray Data's split coordinator
holds every epoch's execution until all ranks have asked for it, so no batch of epoch e
is augmented before the clock says e). Every row carries the epoch its parameters were
drawn for (`epoch`); the trainer refuses a batch stamped for another epoch, so a change in
that ordering fails loudly instead of reusing an epoch's augmentation.

This module stays light (no torch at import): Ray's coordinator processes unpickle the
dataset plan that names these classes, and only the processes that augment need torch.
"""

from __future__ import annotations

import numpy as np


class EpochClock:
    """Holds the current epoch; run as an actor with num_cpus=0."""

    def __init__(self):
        self.epoch = 0

    def set(self, epoch: int) -> int:
        self.epoch = epoch
        return epoch

    def get(self) -> int:
        return self.epoch


class AugmentStage:
    """map_batches callable. `preset` is Preset.to_dict(); `train` picks its train or eval ops."""

    def __init__(
        self,
        preset: dict,
        *,
        train: bool,
        seed: int,
        clock=None,
        device: str = "auto",
        schedule: str = "none",
        epochs: int = 1,
        shrink: bool = False,
        bad_log=None,
        resize: str = "none",
    ):
        import ray
        import torch

        from augment.presets import Pipeline, preset_from_dict

        if device == "auto":  # an actor: Ray fixed its GPU in CUDA_VISIBLE_DEVICES when it started
            device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self.device = torch.device(device)
        spec = preset_from_dict(preset)
        # the strength and resolution schedules are training-time knobs; evaluation stays fixed,
        # at the final size (docs/design.md)
        ops = spec.train if train else spec.eval
        schedules = {"schedule": schedule, "resize": resize} if train else {}
        self.pipeline = Pipeline(ops, seed=seed, epochs=epochs, **schedules).to(self.device)
        self.clock = clock
        self.shrink = shrink and train  # evaluation decodes at full size (torchvision parity)
        self.bad_log = bad_log

    def __call__(self, batch: dict) -> dict:
        import ray
        import torch

        from augment.batch import augment_batch, decode_augment

        if self.device.index is not None:  # a task's cuda:N: what lands on "the" GPU lands on ours
            torch.cuda.set_device(self.device)
        epoch = ray.get(self.clock.get.remote()) if self.clock is not None else 0
        keys = torch.as_tensor(np.array(batch["key"]))
        if "bytes" in batch:
            out, kept, bad = decode_augment(self.pipeline, batch["bytes"], keys, epoch, self.device, shrink=self.shrink)
            if bad and self.bad_log is not None:  # fire and forget: the driver reads the log later
                self.bad_log.add.remote([(str(batch["path"][i]), reason) for i, reason in bad])
            label, key = np.asarray(batch["label"])[kept], np.asarray(batch["key"])[kept]
        else:
            out = augment_batch(self.pipeline, batch["image"], keys, epoch, self.device)
            label, key = batch["label"], batch["key"]
        # key travels on so the trainer can count which images each rank saw; epoch is the stamp
        return {
            "image": out.cpu().numpy(),  # .cpu() is a sync point on GPU
            "label": label,
            "key": key,
            "epoch": np.full(len(key), epoch, dtype=np.int64),
        }


STAGES: dict[str, AugmentStage] = {}  # per worker process: built once, reused by every task

# Ray's remote env of an augment task on a GPU share (training/ingest.py task_resources): Ray
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


def task_device() -> str:
    """The device of this task: "cuda:N" for the GPU Ray gave it, "cpu" without one (or where
    torch finds no CUDA, as on a test cluster's fake GPU node).

    A task's worker process outlives it (max_calls=0) and may get another GPU of the node in
    its next task; CUDA fixes a process's visible devices when it first starts, so the task
    runs with all of the node's GPUs visible (GPU_TASK_ENV) and picks its own by index."""
    import os

    import ray
    import torch

    ids = ray.get_gpu_ids()
    if not ids or not torch.cuda.is_available():
        return "cpu"
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


def augment_task(
    batch: dict,
    *,
    preset: dict,
    train: bool,
    seed: int,
    clock=None,
    schedule: str = "none",
    epochs: int = 1,
    shrink: bool = False,
    bad_log=None,
    resize: str = "none",
) -> dict:
    """map_batches *function* form of AugmentStage for Ray Data tasks: the worker processes
    outlive the epoch (on a GPU share too: training/ingest.py task_resources), so nothing is
    rebuilt when the next epoch starts, while an actor pool is started afresh for each
    epoch's execution. The task runs on the GPU Ray gave it (task_device), with the
    process's pipeline for that device (drop_other_devices)."""
    import json

    device = task_device()
    key = json.dumps([preset, train, seed, schedule, epochs, shrink, resize, device], sort_keys=True)
    stage = STAGES.get(key)
    if stage is None:
        drop_other_devices(device)
        stage = STAGES[key] = AugmentStage(
            preset,
            train=train,
            seed=seed,
            device=device,
            schedule=schedule,
            epochs=epochs,
            shrink=shrink,
            resize=resize,
        )
    stage.clock, stage.bad_log = clock, bad_log
    return stage(batch)
