"""The trainer's input: Ray Datasets that read, decode and augment each split, and how
they are split between the ranks.

Light on purpose (no torch at import): Ray Train's controller and dataset manager and, with
more than one worker, Ray Data's split coordinators unpickle what this module defines, and
each is a process of its own; importing torch there would cost seconds of start-up apiece
on a small machine.
"""

from __future__ import annotations

import ray
import ray.data
import ray.train

from augment.stage import AugmentStage, augment_task
from training.data import read_split


def build_datasets(cfg, tree, preset, plan, clock, bad_log=None) -> dict:
    """{"train", "val"}: read -> decode -> augment, lazily; each epoch streams them anew.

    Where the augmentation runs (plan.augment_gpus, plan.augment_actors):
    - GPU: an actor pool per split; each actor keeps its pipeline on its GPU share.
    - CPU, the default: Ray Data tasks. Ray starts a fresh actor pool for every epoch's
      execution (3-5 s of process start and imports on a small machine, each epoch); task
      worker processes stay alive between epochs and keep their pipeline (augment_task).
    - CPU with --augment-actors N: an actor pool of N, as on a GPU.
    Nothing is decoded up front: the first training step waits only for the first batch.
    """
    out = {}
    for split_name, split in (("train", tree.train), ("val", tree.val)):
        train = split_name == "train"
        ds = read_split(split, seed=cfg.seed, shuffle=train, bad_log=bad_log, num_cpus=plan.augment_cpus)
        if cfg.strict:
            ds.count()  # --strict: decode every file once now, so a bad one stops the run before training
        kwargs = {
            "preset": preset.to_dict(),
            "train": train,
            "seed": cfg.seed,
            "clock": clock if train else None,
            "schedule": cfg.augment_schedule,  # the stage applies it to train only
            "epochs": cfg.epochs,
        }
        common = {"batch_format": "numpy", "batch_size": cfg.augment_batch_size, "num_cpus": plan.augment_cpus}
        if plan.augment_tasks:
            out[split_name] = ds.map_batches(augment_task, fn_kwargs=kwargs, **common)
        else:
            out[split_name] = ds.map_batches(
                AugmentStage,
                fn_constructor_kwargs=kwargs,
                compute=ray.data.ActorPoolStrategy(size=plan.augment_actors),
                num_gpus=plan.augment_gpus,
                **common,
            )
    return out


class SplitValUnequally(ray.train.DataConfig):
    """Train is split equally (every DDP rank takes the same number of steps); validation is
    split without dropping rows, so every validation image is scored exactly once.

    A single worker gets each dataset whole: it runs the dataset's execution itself, and no
    split coordinator starts (an actor process of its own per split, before the first step)."""

    def __init__(self, world_size: int):
        super().__init__(datasets_to_split=[] if world_size == 1 else "all")

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        # Ray Train 2.60 configures one dataset per call
        if set(datasets) != {"val"} or self._datasets_to_split != "all":
            return super().configure(datasets, world_size, worker_handles, worker_node_ids, **kwargs)
        splits = datasets["val"].streaming_split(world_size, equal=False, locality_hints=worker_node_ids)
        return [{"val": split} for split in splits]
