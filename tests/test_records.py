"""What the workers hand the driver (training/records.py): typed, loadable with
torch.load(weights_only=True) after a round trip through a checkpoint, and versioned: records of
another version are one StaleRecords, not read field by field. An epoch's figures are fields; the
files' rows are made from them, in the columns users' files have always had."""

from __future__ import annotations

import ast
import io
import pathlib

import pytest
import torch

from training.bounds import DataSlots
from training.records import RECORDS_VERSION, RunRecord, ShardRecord, StaleRecords, TrainFigures, ValFigures
from training.status import StepLog
from training.worker.report import cpu_fallback, epoch_line, epoch_record

SLOTS = DataSlots(read=2.0, augment=2.0, fused=True, trainer_cpus=1.0)
METRICS_COLUMNS = ["epoch", "lr", "train_loss", "train_acc", "train_images", "image_size", "val_loss", "val_acc"]
TIMINGS_COLUMNS = [
    *("epoch", "epoch_s", "images_per_s", "data_wait_frac", "steady_s", "steady_wait_frac", "inner_images_per_s"),
    *("start_s", "decoded_engines", "decoded_gpu_sms", "decoded_cpu", "bound", "read_busy", "augment_busy"),
    *("tasks_busy", "trainer_cpus", "gpu_shared"),
]


def _train(epoch: int = 0, **changes) -> TrainFigures:
    seen = (ShardRecord(8, 8, 123, 456, "abc"), ShardRecord(8, 7, 11, 22, "def"))
    figures = dict(loss=1.23456789 / (epoch + 1), acc=1 / 3, images=16, image_size=32, epoch_s=12.3456789 + epoch)
    figures |= dict(images_per_s=16 / (12.3456789 + epoch), data_wait_frac=0.123456, steady_s=10.98765 + epoch)
    figures |= dict(steady_wait_frac=0.4123456, inner_images_per_s=9.87654, start_s=1.234567, trainer_cpus=0.8765)
    figures |= dict(read_s=3.3333, augment_s=17.7777, augment_gpu_s=0.0, trainer_gpu_s=0.0, decoded=(0, 1, 15))
    return TrainFigures(**(figures | {"seen": seen, "first_step_at": 1e9 + epoch} | changes))


def _val(**changes) -> ValFigures:
    return ValFigures(**(dict(loss=2 / 3, acc=2 / 7, confusion=[[3, 1], [0, 4]], top5=None) | changes))


def _run() -> RunRecord:
    run = RunRecord.fresh()
    for epoch in (0, 1):
        run.add(
            epoch_record(
                epoch, _train(epoch), _val(acc=0.5 * (epoch + 1)), lr=0.1, first=epoch == 0, slots=SLOTS, gpus=1
            )
        )
    run.ranks, run.slots, run.rng, run.schedule_epochs = [{"rank": 0}], SLOTS, [{"torch": torch.ones(3)}], 4
    run.resumed_at_epochs = [2]
    return run


def test_records_survive_a_checkpoint_loaded_with_weights_only():
    run = _run()
    buf = io.BytesIO()
    torch.save({"records": run.to_state()}, buf)
    back = RunRecord.from_state(torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["records"])
    assert back.epochs == run.epochs and back.ranks == run.ranks and back.slots == SLOTS
    assert torch.equal(back.rng[0]["torch"], run.rng[0]["torch"]) and back.schedule_epochs == 4
    assert back.last_epoch == 1 and [e.val.acc for e in back.epochs] == [0.5, 1.0]
    assert back.epochs[1].bound == run.epochs[1].bound and back.epochs[1].train.decoded == (0, 1, 15)
    assert back.first_steps == [1e9] and back.seen[1][1].distinct == 7 and back.resumed_at_epochs == [2]


@pytest.mark.parametrize("version", [None, RECORDS_VERSION - 1, RECORDS_VERSION + 1])
def test_records_of_another_version_are_refused_whole(version):
    state = _run().to_state() | {"version": version}
    if version is None:
        del state["version"]
    with pytest.raises(StaleRecords, match=f"its records are of version {version} of this job's"):
        RunRecord.from_state(state)
    with pytest.raises(StaleRecords):
        RunRecord.from_state(None)  # a checkpoint with no records at all (an older layout)


def test_an_epochs_figures_are_fields_rounded_as_the_files_keep_them():
    record = epoch_record(2, _train(2), _val(top5=0.9), lr=1 / 30, first=False, slots=SLOTS, gpus=1)
    assert (record.epoch, record.lr, record.train.first_step_at) == (3, 0.03333333, None)  # not an attempt's first
    assert (record.train.loss, record.train.acc, record.train.images) == (0.411523, 0.333333, 16)
    assert (record.val.loss, record.val.acc, record.val.top5, record.val.acc_ema) == (0.666667, 0.285714, 0.9, None)
    assert (record.train.epoch_s, record.train.images_per_s, record.train.steady_wait_frac) == (14.346, 1.1, 0.4123)
    assert record.bound.stage == "decode + augment" and record.bound.trainer_cpus == 0.88
    assert record.bound.tasks_busy == round(3.3333 / (2 * 12.98765) + 17.7777 / (2 * 12.98765), 4)
    assert cpu_fallback(record.train) == 15 / 16
    line = epoch_line(record, 5, show_size=True)
    assert line == (
        "epoch   3/5  32px  loss 0.4115  acc 0.3333  val_loss 0.6667  val_acc 0.2857  1 img/s  waiting for data 12%"
    )


def test_the_files_rows_are_made_from_the_fields_in_the_columns_users_have():
    plain = epoch_record(0, _train(), _val(), lr=0.1, first=True, slots=SLOTS, gpus=1)
    assert list(plain.metrics_row()) == METRICS_COLUMNS and list(plain.timings_row()) == TIMINGS_COLUMNS
    assert plain.metrics_row()["val_acc"] == plain.val.acc and plain.timings_row()["decoded_cpu"] == 15
    assert plain.timings_row()["bound"] == plain.bound.stage and plain.timings_row()["epoch_s"] == 12.346
    full = epoch_record(
        0, _train(), _val(top5=0.75, loss_ema=0.5, acc_ema=0.25), lr=0.1, first=True, slots=SLOTS, gpus=1
    )
    assert list(full.metrics_row()) == [*METRICS_COLUMNS, "val_top5", "val_loss_ema", "val_acc_ema"]
    assert full.metrics_row()["val_acc_ema"] == 0.25 and "val_acc_ema 0.2500" in epoch_line(full, 1)


# between the worker and the files, every figure is read from a field: none by its column's name
# (records.py itself reads a checkpoint's primitives back into fields; the API's RunResult reads
# summary.json, a file)
TYPED = (
    "training/worker/loop.py",
    "training/worker/report.py",
    "training/worker/recipe.py",
    "training/bounds.py",
    "training/driver/results.py",
    "training/driver/audit.py",
    "training/driver/epochs.py",
    "training/driver/job.py",
    "training/driver/tracking.py",
    "training/driver/plots.py",
    "training/sweep/tuner.py",
)


def test_no_figure_is_read_by_its_column_name_between_the_worker_and_the_files():
    record = epoch_record(
        0, _train(), _val(top5=0.75, loss_ema=0.5, acc_ema=0.25), lr=0.1, first=True, slots=SLOTS, gpus=1
    )
    columns = (set(record.metrics_row()) | set(record.timings_row()) | {"confusion", "first_step_at"}) - {"epoch"}
    root = pathlib.Path(__file__).resolve().parent.parent
    reads = []
    for path in TYPED:
        for node in ast.walk(ast.parse((root / path).read_text())):
            key = None
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.ctx, ast.Load)
                and isinstance(node.slice, ast.Constant)
            ):
                key = node.slice.value
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args:
                key = getattr(node.args[0], "value", None)
            if key in columns:
                reads.append(f"{path}:{node.lineno} [{key!r}]")
    assert not reads, "figures read by key: " + ", ".join(reads)


def test_the_step_log_posts_typed_figures_every_n_steps():
    """--log-every 2 from the second epoch on (10 steps an epoch before it): the run's step, the epoch,
    the loss over the images since the last post (from the running loss sum), the learning rate."""
    posted = []
    log = StepLog(posted.append, 2, lambda: 0.05, steps_per_epoch=10, first_epoch=1)
    for sums in ([8.0], [12.0], [14.0], [20.0]):
        log.update(1, 4, sums)
    assert [(p.step, p.epoch, p.lr) for p in posted] == [(12, 2, 0.05), (14, 2, 0.05)]
    assert [p.loss for p in posted] == [12.0 / 8, (20.0 - 12.0) / 8] and posted[0].images_per_s > 0
    assert list(posted[0].scalars()) == ["loss", "lr", "images_per_s"]  # the trackers' step/* names
