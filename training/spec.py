"""What the driver hands each train worker, as one typed, frozen object (Ray Train passes it
to train_loop inside its config dict): the settings, what the driver found out about the
data, the run's helper actors, and what the worker's feed watches for. TrainConfig and
Preset travel as themselves. Light (no torch, no Ray): Ray Train's controller unpickles it
too."""

from __future__ import annotations

import dataclasses
from typing import Any

from augment.presets import Preset
from training.bounds import DataSlots
from training.config import TrainConfig

Node = tuple[float, float]  # (CPUs, GPUs) of one node, a worker, or a task


@dataclasses.dataclass(frozen=True)
class StallLimits:
    """How long a train worker waits for a batch before it asks Ray why (IngestWatch)."""

    starved_s: float = 30.0  # then stop if the train workers leave Ray Data no room for a task
    pending_s: float = 600.0  # then stop if Ray reports data tasks that wait for resources
    poll_s: float = 5.0  # how often it looks again while the wait goes on


@dataclasses.dataclass(frozen=True)
class IngestNeeds:
    """What the plan reserved, for the feed's watch (training/worker/feed.py IngestWatch): one train
    worker's (CPUs, GPUs), what Ray Data must run at once to make progress, and whether the
    cluster may grow (then the watch only waits)."""

    worker: Node
    tasks: tuple[Node, ...]
    autoscaling: bool


# the resource arithmetic the plan (training/driver/planning.py) and the feed's watch share
EPS = 1e-9  # Ray keeps resources to 4 decimals; compare with a little slack


def left_over(nodes: list[Node], counts: list[int], worker: Node) -> list[Node]:
    """What each node keeps after `counts[i]` workers of size `worker` took their share."""
    return [(c - k * worker[0], g - k * worker[1]) for (c, g), k in zip(nodes, counts, strict=True)]


def tasks_fit(free: list[Node], tasks: list[Node]) -> bool:
    """Whether these tasks (or actors) can all run at once, each on one node (first fit,
    largest first)."""
    room = [list(n) for n in free]
    for cpus, gpus in sorted(tasks, reverse=True):
        node = next((r for r in room if r[0] + EPS >= cpus and r[1] + EPS >= gpus), None)
        if node is None:
            return False
        node[0] -= cpus
        node[1] -= gpus
    return True


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything train_loop reads, built once per attempt by the driver (training/driver/job.py
    Attempt.worker_spec)."""

    config: TrainConfig
    class_names: tuple[str, ...]
    preset: Preset  # at the run's size: its normalisation and MixUp/CutMix apply on the worker
    train_images: int  # the split's files: steps per epoch for the schedule
    rows_grouped: bool  # a prepared split, read in fixed row groups: the feed mixes them (training/worker/feed.py)
    threads_per_worker: int
    batch_per_worker: int  # ResourcePlan.batch_per_worker: each rank's share of --batch-size
    sizes: tuple[int, ...] | None  # --progressive-resize: each epoch's training side; None: fixed
    ingest: IngestNeeds
    slots: DataSlots  # what Ray Data may run at once: what bounds an epoch (training/bounds.py)
    stall: StallLimits
    clock: Any  # the EpochClock actor (training/stream/stage.py): rank 0 advances it before each epoch
    status: Any  # the RunStatus actor (training/status.py): progress and lines go to the driver through it
    follow_epochs: bool = False  # the driver has epoch callbacks (training/driver/epochs.py): wait for its verdict
    class_counts: tuple[int, ...] = ()  # the training split's images per class: --class-weights balanced's weights

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_size(self) -> int:
        """The side the model sees (eval), which picks the stem."""
        return self.preset.image_size
