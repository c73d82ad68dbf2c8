"""What bounds an epoch (training/bounds.py): the slots a plan gives Ray Data, the verdict on an
epoch's figures, the steady epochs' verdict, and a run on the test cluster whose augmentation
is slow enough to bound it, named on its epoch line and in summary.json."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest

from training.bounds import BUSY, INPUT_BOUND, Bound, DataSlots, epoch_bound, steady_bound, steady_verdict
from training.config import TrainConfig
from training.driver.planning import Capacity, plan_resources


def _plan(cpus: int, gpus: int = 0, **flags):
    cfg = TrainConfig(data="unused", **flags)
    return plan_resources(cfg, Capacity(cpus=cpus, gpus=gpus, hosts=1, nodes=((float(cpus), float(gpus)),)))


def test_a_cpu_plan_gives_its_fused_tasks_the_cpus_the_trainers_leave():
    plan = _plan(2)  # 1 trainer x 1 CPU, tasks of 0.5 CPU
    assert (plan.cpus_per_worker, plan.augment_cpus) == (1, 0.5)
    slots = DataSlots.of(plan, 2, decode_in_read=True)
    assert slots == DataSlots(read=2, augment=2, fused=True, decode_in_read=True, trainer_cpus=1.0)
    plan = _plan(16, num_workers=2)  # 2 trainers x 4 CPUs, tasks of 1 CPU: 8 left
    assert DataSlots.of(plan, 16, decode_in_read=False).read == 16 - 2 * plan.cpus_per_worker == 8


def test_a_gpu_plan_counts_its_augment_tasks_and_the_reads_beside_them():
    plan = _plan(16, gpus=1)  # 1 trainer x 8 CPUs; 4 augment tasks of 1 CPU on the GPU's quarter
    slots = DataSlots.of(plan, 16, decode_in_read=False)
    assert (slots.augment, slots.fused, slots.on_gpu) == (plan.augment_concurrency, False, True) == (4, False, True)
    assert slots.read == 16 - plan.cpus_per_worker - 4  # the CPUs left once the augment tasks hold theirs
    actors = DataSlots.of(_plan(16, gpus=1, augment_actors=2), 16, decode_in_read=False)
    assert actors.augment == 2


CPU = DataSlots(read=2, augment=2, fused=True)
GPU = DataSlots(read=4, augment=4, fused=False, on_gpu=True)


@pytest.mark.parametrize(
    "slots, read_s, augment_s, wait, stage",
    [
        (CPU, 1.0, 15.0, 0.6, "decode + augment"),  # 2 tasks x 10 s, 16 of them busy: 80 %
        (CPU, 12.0, 4.0, 0.6, "read"),  # the same tasks, mostly reading
        (DataSlots(2, 2, True, decode_in_read=True), 12.0, 4.0, 0.6, "read + decode"),
        (CPU, 2.0, 4.0, 0.6, "hand-off"),  # the tasks idle 70 % of the time, yet the trainer waits
        (CPU, 2.0, 17.0, 0.1, "trainer"),  # busy tasks, but the trainer hardly waits
        (GPU, 4.0, 38.0, 0.5, "decode + augment"),  # 4 GPU tasks x 10 s, 95 % busy
        (GPU, 38.0, 4.0, 0.5, "read"),
        (GPU, 20.0, 20.0, 0.5, "hand-off"),  # neither stage past 75 %
    ],
)
def test_an_epoch_names_the_stage_its_figures_point_to(slots, read_s, augment_s, wait, stage):
    bound = epoch_bound(slots, read_s=read_s, augment_s=augment_s, steady_s=10.0, steady_wait=wait)
    assert bound.stage == stage
    assert bound.input_bound is (wait >= INPUT_BOUND)
    assert bound.read_busy == pytest.approx(read_s / (slots.read * 10))
    assert bound.augment_busy == pytest.approx(augment_s / ((slots.read if slots.fused else slots.augment) * 10))
    if stage not in ("hand-off", "trainer"):
        assert bound.tasks_busy >= BUSY
    line = bound.describe(slots)
    if stage == "trainer":
        assert line == ""
    else:
        assert line.startswith(f"  << input-bound by {'the ' if stage == 'hand-off' else ''}{stage}")
        assert ("--" in line) or ("jobs.prepare" in line)  # the flags that would help
    kept = bound.rounded()  # as the record and timings.csv keep it
    assert (kept.stage, kept.input_bound, kept.to_row()) == (stage, bound.input_bound, bound.to_row())
    assert bound_fields(kept) == tuple(round(f, 4) for f in bound_fields(bound))


def bound_fields(bound: Bound) -> tuple[float, float, float]:
    return bound.read_busy, bound.augment_busy, bound.tasks_busy


def test_the_hints_name_flags_for_the_device_that_augments():
    cpu = epoch_bound(CPU, read_s=0, augment_s=18, steady_s=10, steady_wait=0.5).describe(CPU)
    gpu = epoch_bound(GPU, read_s=0, augment_s=38, steady_s=10, steady_wait=0.5).describe(GPU)
    assert "--cpus-per-worker" in cpu and "--device cuda" in cpu
    assert "--augment-gpus" in gpu and "--augment-actors" in gpu
    assert "(tasks 90% busy)" in cpu and "(tasks 95% busy)" in gpu


def test_a_hint_gives_the_trainers_the_cpus_they_were_measured_to_use():
    """On a GPU node a trainer holds half the CPUs by plan; where the trainers, fed, would keep
    less than half of theirs busy and the data tasks bound the run, the hint names the share
    that would do. Their use while waiting half the time counts double."""
    held = dataclasses.replace(GPU, trainer_cpus=8.0)

    def read_bound(slots, used, wait=0.5):
        return epoch_bound(slots, read_s=38, augment_s=4, steady_s=10, steady_wait=wait, trainer_cpus=used)

    idle = read_bound(held, 0.9)
    line = idle.describe(held)
    assert line.startswith("  << input-bound by read") and "would keep about 1.8 of their 8 CPUs busy" in line
    assert "--cpus-per-worker 3 gives it the rest" in line
    busy = read_bound(held, 2.5).describe(held)  # 5 of 8, fed: not under half
    assert "would keep" not in busy and "lower --cpus-per-worker or --num-workers" in busy
    two = dataclasses.replace(held, trainer_cpus=2.0)  # fed 0.8 of 2: the share would stay 2
    assert "would keep" not in read_bound(two, 0.4).describe(two)
    cpu = dataclasses.replace(CPU, trainer_cpus=8.0)  # on CPUs the share sets the torch threads: no such hint
    assert "would keep" not in read_bound(cpu, 0.9).describe(cpu)
    assert idle.to_row()["trainer_cpus"] == 0.9 and idle.rounded().fed_cpus() == idle.fed_cpus()
    verdict = idle.to_dict(held)
    assert (verdict["trainer_cpus"], verdict["trainer_cpus_planned"]) == (0.9, 8.0)
    assert steady_bound(held, [(10.0, idle)] * 2).trainer_cpus == pytest.approx(0.9)  # the run's, from its epochs


def test_augment_calls_that_share_the_trainers_gpu_are_named_and_never_answered_with_more_tasks():
    """On one GPU an epoch of 10 s whose steps took 8.5 s on their stream and whose augment calls
    took 2.5 s on theirs: 11 s of work in 10, so they took turns; the epoch line says the GPU is
    shared and by how much, whether the trainer waited or not, and the hint asks for less GPU
    work, not for more augment tasks (more CUDA contexts on the same SMs)."""

    def bound(wait, augment_gpu_s=2.5, slots=GPU):
        return epoch_bound(
            slots,
            read_s=4,
            augment_s=38,
            steady_s=10,
            steady_wait=wait,
            augment_gpu_s=augment_gpu_s,
            trainer_gpu_s=8.5,
            gpus=1,
        )

    busy = bound(0.1)
    assert busy.stage == "trainer" and busy.gpu_shared == pytest.approx(0.25)
    assert busy.describe(GPU) == "  GPU shared: the augment calls took 25% of its time"
    starved = bound(0.5)
    line = starved.describe(GPU)
    assert starved.stage == "decode + augment" and "more augment tasks" not in line and "--augment-gpus" in line
    assert "share the trainer's GPU" in line and line.endswith("GPU shared: the augment calls took 25% of its time")
    assert "run more augment tasks" in bound(0.5, augment_gpu_s=1.0).describe(GPU)  # 9.5 s of 10: no turns taken
    assert bound(0.1, slots=CPU).gpu_shared == 0  # augment calls on CPUs share no GPU
    assert steady_bound(GPU, [(10.0, busy)] * 2).gpu_shared == 0.25
    assert steady_bound(GPU, [(10.0, starved)] * 2).describe(GPU) == line  # the run's verdict, from its epochs


def test_the_run_verdict_weighs_the_steady_epochs_by_their_time_and_skips_the_first():
    def row(read, augment, wait, seconds):
        return seconds, epoch_bound(CPU, read_s=read, augment_s=augment, steady_s=seconds, steady_wait=wait)

    first = row(40.0, 0.0, 0.9, 20.0)  # a first epoch, read-bound as its caches warm: left out
    short = row(1.0, 1.0, 0.9, 2.0)  # a short input-bound epoch with idle tasks
    long = row(1.0, 32.0, 0.6, 20.0)  # a long one bound by decode + augment
    assert (short[1].stage, long[1].stage) == ("hand-off", "decode + augment")
    assert steady_bound(CPU, [first, short, long]).stage == "decode + augment"  # weighed by seconds
    assert steady_bound(CPU, [first]).stage == "read"  # one epoch only: that one
    verdict = steady_verdict(CPU, [first, short, long])
    assert verdict["stage"] == "decode + augment" and verdict["input_bound"] and "--device cuda" in verdict["hint"]


def test_a_run_whose_augmentation_is_slow_says_decode_and_augment_bound_it(ray_cluster, tmp_path):
    """A 33 x 33 median blur (Kornia's, by name) after the crop costs far more CPU an image
    than a step of ResNet18 at 32 px (docs/benchmark-log.md, "The suite's time"): the trainer
    waits, the augment tasks are busy, and the epoch line and summary.json name decode +
    augment, with the flags. Calls of 16 images stream the epoch in blocks, and the blur of
    the whole epoch takes longer than the train worker's start-up, so it cannot all be ready
    before the first step (a 25 x 25 blur in one call could, once start-up got lighter)."""
    from tests.conftest import prepare, write_tree
    from training.driver import job

    data = write_tree(tmp_path / "data", {"a": 64, "b": 64})
    preset = tmp_path / "slow.yaml"
    preset.write_text(
        "train:\n  - random_crop: {size: 32, padding: 4}\n"
        "  - kornia.RandomMedianBlur: {kernel_size: [33, 33], p: 1.0}\n"
        "eval:\n  - center_crop: {size: 32}\n"
    )
    cfg = TrainConfig(
        data=str(data),
        epochs=1,
        batch_size=16,
        val_fraction=0.25,
        preset=str(preset),
        augment_batch_size=16,
        storage_path=str(tmp_path / "runs"),
        name="slow",
    )
    lines = []
    summary = job.run(*prepare(cfg), log=lines.append, own_cluster=True)
    (timing,) = list(csv.DictReader(open(tmp_path / "runs" / "slow" / "timings.csv")))
    assert timing["bound"] == "decode + augment", timing
    assert float(timing["tasks_busy"]) >= BUSY and float(timing["steady_wait_frac"]) >= INPUT_BOUND, timing
    (epoch_line,) = [line for line in lines if line.startswith("epoch ")]
    assert "<< input-bound by decode + augment (tasks " in epoch_line, epoch_line
    assert "--cpus-per-worker" in epoch_line
    saved = json.loads((tmp_path / "runs" / "slow" / "summary.json").read_text())
    assert saved["bound"] == summary["bound"] and saved["bound"]["stage"] == "decode + augment", saved["bound"]
