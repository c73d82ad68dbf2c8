"""The augment stage: a callable class for `Dataset.map_batches` with an actor pool.

Each actor builds its pipeline once in `__init__`, on `cuda` when Ray gave it a GPU and
on the CPU otherwise, and then augments whole batches:

    {image: uint8 (B, H, W, 3) or ragged, label, key}  ->  {image: uint8 (B, S, S, 3), label}

The epoch, which the augmentation depends on, comes from a tiny `EpochClock` actor that
rank 0 of the trainer advances before each epoch starts (Ray Data's split coordinator
holds every epoch's execution until all ranks have asked for it, so no batch of epoch e
is augmented before the clock says e).

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
    ):
        import ray
        import torch

        from augment.presets import Pipeline, preset_from_dict

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self.device = torch.device(device)
        spec = preset_from_dict(preset)
        # the strength schedule is a training-time knob; evaluation stays fixed (docs/design.md)
        ops = spec.train if train else spec.eval
        self.pipeline = Pipeline(ops, seed=seed, schedule=schedule if train else "none", epochs=epochs).to(self.device)
        self.clock = clock

    def __call__(self, batch: dict) -> dict:
        import ray
        import torch

        from augment.batch import augment_batch

        epoch = ray.get(self.clock.get.remote()) if self.clock is not None else 0
        out = augment_batch(self.pipeline, batch["image"], torch.as_tensor(np.array(batch["key"])), epoch, self.device)
        # key travels on so the trainer can count which images each rank saw
        return {
            "image": out.cpu().numpy(),
            "label": batch["label"],
            "key": batch["key"],
        }  # .cpu() is a sync point on GPU


_STAGES: dict[str, AugmentStage] = {}  # per worker process: built once, reused by every task


def augment_task(
    batch: dict, *, preset: dict, train: bool, seed: int, clock=None, schedule: str = "none", epochs: int = 1
) -> dict:
    """map_batches *function* form of AugmentStage for Ray Data tasks (CPU): the worker
    processes outlive the epoch, so nothing is rebuilt when the next epoch starts, while an
    actor pool is started afresh for each epoch's execution."""
    import json

    key = json.dumps([preset, train, seed, schedule, epochs], sort_keys=True)
    stage = _STAGES.get(key)
    if stage is None:
        stage = _STAGES[key] = AugmentStage(
            preset, train=train, seed=seed, device="cpu", schedule=schedule, epochs=epochs
        )
    stage.clock = clock
    return stage(batch)
