"""What the workers hand the driver (training/records.py): typed, loadable with
torch.load(weights_only=True) after a round trip through a checkpoint, and versioned: records of
another version are one StaleRecords, not read field by field."""

from __future__ import annotations

import io

import pytest
import torch

from training.records import RECORDS_VERSION, EpochRecord, RunRecord, ShardRecord, StaleRecords


def _run() -> RunRecord:
    run = RunRecord.fresh()
    for epoch in (1, 2):
        seen = (ShardRecord(8, 8, 123, 456, "abc"), ShardRecord(8, 7, 11, 22, "def"))
        metrics, timings = {"epoch": epoch, "val_acc": 0.5 * epoch}, {"epoch": epoch, "epoch_s": 1.5}
        run.add(EpochRecord(epoch, metrics, timings, seen, [[3, 1], [0, 4]], 1e9 + epoch if epoch == 1 else None))
    run.ranks, run.slots, run.rng, run.schedule_epochs = [{"rank": 0}], {"read": 2.0}, [{"torch": torch.ones(3)}], 4
    run.resumed_at_epochs = [2]
    return run


def test_records_survive_a_checkpoint_loaded_with_weights_only():
    run = _run()
    buf = io.BytesIO()
    torch.save({"records": run.to_state()}, buf)
    back = RunRecord.from_state(torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["records"])
    assert back.epochs == run.epochs and back.ranks == run.ranks and back.slots == run.slots
    assert torch.equal(back.rng[0]["torch"], run.rng[0]["torch"]) and back.schedule_epochs == 4
    assert back.last_epoch == 1 and back.history == [{"epoch": 1, "val_acc": 0.5}, {"epoch": 2, "val_acc": 1.0}]
    assert back.first_steps == [1e9 + 1] and back.seen[1][1].distinct == 7 and back.resumed_at_epochs == [2]


@pytest.mark.parametrize("version", [None, RECORDS_VERSION - 1, RECORDS_VERSION + 1])
def test_records_of_another_version_are_refused_whole(version):
    state = _run().to_state() | {"version": version}
    if version is None:
        del state["version"]
    with pytest.raises(StaleRecords, match=f"its records are of version {version} of this job's"):
        RunRecord.from_state(state)
    with pytest.raises(StaleRecords):
        RunRecord.from_state(None)  # a checkpoint with no records at all (an older layout)
