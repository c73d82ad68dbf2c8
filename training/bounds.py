"""What bounds an epoch (docs/design.md, "What bounds an epoch"): the stage that limits the
trainer's input, named on the epoch line, in timings.csv and in summary.json, with the flags
that would help.

The figures are the stages' own timing, carried by the rows: each read task and each augment
call time themselves and stamp every row they make with its share of that time (training/rows.py
COSTS, seconds per image). The trainer sums the stamps of the rows it trains on (over the ranks) and times its
own waits for input. Each epoch is judged on its steady part, from its first batch on (the wait
for that batch is the data tasks' start-up):

- a stage's busy fraction is its seconds over (its slots x those seconds), its slots being the
  tasks or actors the plan lets run at once (DataSlots); on CPUs one task reads, decodes and
  augments, so the read and decode + augment share the same slots, and the tasks' busy
  fraction is the sum of the two;
- the epoch is input-bound when the trainer waited for data INPUT_BOUND of that time or more;
- an input-bound epoch names the busier of the read and decode + augment if the tasks doing
  it were busy BUSY of the time or more, else the hand-off: what lies between the augmented
  blocks and the step (Ray Data's delivery of the blocks and the batches made from them);
- any other epoch is bound by the trainer.

On a GPU the augment tasks and the trainer take turns on the same SMs (kernels of different
processes are time-sliced), so an augment stage that keeps up can still slow the trainer without
making it wait. Each augment call times itself on its CUDA stream (AUGMENT_GPU_COST) and the
trainer times its steps the same way; where the two add up to more than the GPU's time, the GPU
is shared, and `gpu_shared` is the augment calls' share of it: named on the epoch line, and the
hint then asks for less GPU work, never for more augment tasks (they add CUDA contexts, not SMs).

Light (no torch, no Ray): training/spec.py, which Ray Train's controller unpickles, holds a
DataSlots.
"""

from __future__ import annotations

import dataclasses
import math

INPUT_BOUND = 0.3  # the trainer's share of an epoch spent waiting for data (past the first batch)
BUSY = 0.75  # a stage whose slots were this busy is the bound of an input-bound epoch


STAGES = ("read", "read + decode", "decode + augment", "hand-off", "trainer")


@dataclasses.dataclass(frozen=True)
class DataSlots:
    """How many read tasks and augment calls the plan lets run at once, and how they share them:
    `fused` (CPU tasks) when one task reads, decodes and augments its files; `decode_in_read`
    when the read decodes (then the read's figure holds the decode); `on_gpu` when the augment
    calls hold GPU shares."""

    read: float
    augment: float
    fused: bool
    decode_in_read: bool = False
    on_gpu: bool = False
    trainer_cpus: float = 0.0  # the CPUs the plan gives each train worker (0: not recorded)

    @classmethod
    def of(cls, plan, cpus: float, *, decode_in_read: bool) -> "DataSlots":
        """From a ResourcePlan (training/driver/planning.py) and the cluster's CPUs: what the train
        workers leave Ray Data, in tasks of plan.augment_cpus."""
        left = max(cpus - plan.num_workers * plan.cpus_per_worker, plan.augment_cpus)
        tasks = max(1.0, math.floor(left / plan.augment_cpus + 1e-9))
        held = float(plan.cpus_per_worker)
        if plan.augment_tasks and not plan.augment_gpus:
            return cls(read=tasks, augment=tasks, fused=True, decode_in_read=decode_in_read, trainer_cpus=held)
        augment = plan.augment_actors or plan.augment_concurrency or 1
        return cls(
            read=max(1.0, tasks - augment),
            augment=float(augment),
            fused=False,
            decode_in_read=decode_in_read,
            on_gpu=bool(plan.augment_gpus),
            trainer_cpus=held,
        )


@dataclasses.dataclass(frozen=True)
class Bound:
    """An epoch's (or a run's steady epochs') verdict: the stage that bounds it (STAGES, or "read
    + decode" where the read decodes); how busy the read and the decode + augment were, each as
    a share of its slots' time; how busy the tasks of the stage named were (read and decode +
    augment together where one task does both); whether the trainer waited for its input;
    the CPUs a train worker's process kept busy, on average over the ranks (0: not measured)."""

    stage: str
    read_busy: float
    augment_busy: float
    tasks_busy: float
    input_bound: bool
    trainer_cpus: float = 0.0
    wait: float = 0.0  # the trainer's share of the time waiting for input (not a timings.csv column of its own)
    gpu_shared: float = 0.0  # the augment calls' share of the trainer GPU's time, where the two contend (0: not)

    def rounded(self) -> "Bound":
        """As timings.csv keeps it: the epoch line and summary.json's verdict read these."""
        r = round
        return dataclasses.replace(
            self,
            read_busy=r(self.read_busy, 4),
            augment_busy=r(self.augment_busy, 4),
            tasks_busy=r(self.tasks_busy, 4),
            trainer_cpus=r(self.trainer_cpus, 2),
            wait=r(self.wait, 4),
            gpu_shared=r(self.gpu_shared, 4),
        )

    def to_row(self) -> dict:
        """timings.csv's columns."""
        return {
            "bound": self.stage,
            "read_busy": round(self.read_busy, 4),
            "augment_busy": round(self.augment_busy, 4),
            "tasks_busy": round(self.tasks_busy, 4),
            "trainer_cpus": round(self.trainer_cpus, 2),
            "gpu_shared": round(self.gpu_shared, 4),
        }

    def describe(self, slots: DataSlots) -> str:
        """The epoch line's verdict; "" when the trainer is the bound and has its GPU to itself."""
        shared = ""
        if self.gpu_shared:
            shared = f"  GPU shared: the augment calls took {100 * self.gpu_shared:.0f}% of its time"
        if not self.input_bound:
            return shared
        how = hint(self.stage, slots, self.fed_cpus(), self.gpu_shared)
        if self.stage == "hand-off":
            return f"  << input-bound by the hand-off: {how}{shared}"
        return f"  << input-bound by {self.stage} (tasks {100 * self.tasks_busy:.0f}% busy): {how}{shared}"

    def fed_cpus(self) -> float:
        """The CPUs a train worker would keep busy if its input kept up: what it used over the
        share of the time it was not waiting (0: not measured)."""
        return self.trainer_cpus / max(1.0 - self.wait, 0.1)

    def to_dict(self, slots: DataSlots) -> dict:
        """summary.json's "bound"."""
        busy = {k: v for k, v in self.to_row().items() if k != "bound"}
        how = hint(self.stage, slots, self.fed_cpus(), self.gpu_shared)
        planned = {"trainer_cpus_planned": slots.trainer_cpus}
        return {"stage": self.stage, **busy, **planned, "input_bound": self.input_bound, "hint": how}


def hint(stage: str, slots: DataSlots, fed_cpus: float = 0.0, gpu_shared: float = 0.0) -> str:
    """The flags that would help where `stage` bounds the run. On GPUs, where the train workers
    would keep less than half of the CPUs they hold busy even with their input keeping up
    (`fed_cpus`, from the measured use), the share to give them; not on CPUs, where a worker's
    share also sets its torch threads. Where the augment calls share the trainer's GPU
    (`gpu_shared`), more of them would only add CUDA contexts: lighter work or a GPU of their own."""
    more_cpus = "leave Ray Data more CPUs (lower --cpus-per-worker or --num-workers, or add nodes)"
    share = max(1, math.ceil(1.5 * fed_cpus))
    if slots.on_gpu and 0 < fed_cpus < slots.trainer_cpus / 2 and share < slots.trainer_cpus:
        more_cpus = (
            f"leave Ray Data more CPUs: the train workers would keep about {fed_cpus:.1f} of their "
            f"{slots.trainer_cpus:g} CPUs busy, so --cpus-per-worker {share} gives it the rest"
        )
    if stage in ("read", "read + decode"):
        return more_cpus + "; for many small files or object storage, pack the tree with jobs.prepare"
    if stage == "decode + augment":
        if slots.on_gpu and gpu_shared:
            return (
                "the augment calls already share the trainer's GPU, so more of them add CUDA contexts, not SMs: "
                "a lighter preset, or augment actors on GPUs of their own (--augment-actors N --augment-gpus 1)"
            )
        if slots.on_gpu:
            return "run more augment tasks beside each trainer (a smaller --augment-gpus) or --augment-actors N"
        return more_cpus + ", or augment on GPUs (--device cuda)"
    if stage == "hand-off":
        return "fewer, larger blocks (a larger --augment-batch-size) or a larger --batch-size"
    return "the input keeps up"


def busy(seconds: float, slots: float, window_s: float) -> float:
    """The share of `slots` x `window_s` that `seconds` of work filled."""
    return seconds / max(slots * window_s, 1e-9)


def epoch_bound(
    slots: DataSlots,
    *,
    read_s: float,
    augment_s: float,
    steady_s: float,
    steady_wait: float,
    trainer_cpus: float = 0.0,
    augment_gpu_s: float = 0.0,
    trainer_gpu_s: float = 0.0,
    gpus: int = 1,
) -> Bound:
    """The bound of one epoch's steady part, from its first batch on (the wait for that batch is
    the data tasks' start-up): the stages' seconds on the rows trained on over all ranks, its
    seconds, the trainer's share of them waiting for input, the CPUs a train worker kept busy,
    and the augment calls' and the steps' seconds on CUDA streams over all ranks (`gpus` of them)."""
    read_busy = busy(read_s, slots.read, steady_s)
    augment_busy = busy(augment_s, slots.read if slots.fused else slots.augment, steady_s)
    tasks_busy = read_busy + augment_busy if slots.fused else max(read_busy, augment_busy)
    shared = gpu_shared(slots, augment_gpu_s, trainer_gpu_s, steady_s * gpus)
    return judge(slots, read_busy, augment_busy, tasks_busy, steady_wait, trainer_cpus, shared)


def gpu_shared(slots: DataSlots, augment_gpu_s: float, trainer_gpu_s: float, gpu_s: float) -> float:
    """The augment calls' share of the trainer GPUs' `gpu_s` seconds, where they run on those GPUs
    and the two together took more than there was (they took turns); else 0."""
    if not slots.on_gpu or gpu_s <= 0 or augment_gpu_s + trainer_gpu_s <= gpu_s:
        return 0.0
    return augment_gpu_s / gpu_s


def judge(
    slots: DataSlots,
    read_busy: float,
    augment_busy: float,
    tasks_busy: float,
    steady_wait: float,
    trainer_cpus: float = 0.0,
    shared: float = 0.0,
) -> Bound:
    """The stage named for these busy fractions and this wait (the module's docstring)."""
    if steady_wait < INPUT_BOUND:
        stage = "trainer"
    elif tasks_busy < BUSY:
        stage = "hand-off"
    elif read_busy > augment_busy:
        stage = "read + decode" if slots.decode_in_read else "read"
    else:
        stage = "decode + augment"
    input_bound = steady_wait >= INPUT_BOUND
    return Bound(stage, read_busy, augment_busy, tasks_busy, input_bound, trainer_cpus, steady_wait, shared)


def steady_bound(slots: DataSlots, epochs: list[tuple[float, Bound]]) -> Bound | None:
    """The bound of a run's steady epochs (all but the first, where there are more), from each
    epoch's steady seconds and bound: the busy fractions and waits weighted by those seconds."""
    epochs = epochs[1:] or epochs
    total = sum(s for s, _ in epochs)
    if not total:
        return None

    def mean(field):
        return sum(getattr(b, field) * s for s, b in epochs) / total

    fields = ("read_busy", "augment_busy", "tasks_busy", "wait", "trainer_cpus", "gpu_shared")
    return judge(slots, *(mean(f) for f in fields))


def steady_verdict(slots: DataSlots, epochs: list[tuple[float, Bound]]) -> dict | None:
    """summary.json's "bound": the steady epochs' (steady_bound)."""
    bound = steady_bound(slots, epochs)
    return bound.to_dict(slots) if bound else None
