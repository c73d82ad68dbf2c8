"""jobs.predict's --out folder, owned by what it wrote: --overwrite replaces an earlier prediction's
Parquet files (named in the folder's record, training/predict/scoring.py PARTS_RECORD) and nothing
else; a folder with Parquet files of someone else's is refused in one line, each file kept. No Ray:
the record is what scoring.write leaves, written here as it writes it."""

from __future__ import annotations

import json

import pytest

from jobs.predict import check_out
from training import storage
from training.predict import scoring


def _folder(tmp_path, ours=(), theirs=()):
    out = tmp_path / "preds"
    out.mkdir()
    for name in (*ours, *theirs):
        (out / name).write_bytes(b"PAR1")
    if ours:
        (out / scoring.PARTS_RECORD).write_text(json.dumps({"parts": list(ours)}))
    return out


def test_overwrite_removes_the_earlier_predictions_files_and_keeps_the_users(tmp_path):
    out = _folder(tmp_path, ours=("1_000000_000000.parquet",), theirs=("mine.parquet", "notes.txt"))
    check_out(str(out), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["mine.parquet", "notes.txt"]


def test_a_folder_of_someone_elses_parquet_files_is_refused_and_kept(tmp_path):
    out = _folder(tmp_path, theirs=("mine.parquet",))
    with pytest.raises(
        storage.StorageError, match="Parquet files that jobs.predict did not write; nothing was removed"
    ):
        check_out(str(out), overwrite=True)
    assert (out / "mine.parquet").read_bytes() == b"PAR1"


def test_without_overwrite_a_folder_that_holds_files_is_refused(tmp_path):
    out = _folder(tmp_path, ours=("1_000000_000000.parquet",))
    with pytest.raises(storage.StorageError, match="holds files already; nothing was written"):
        check_out(str(out), overwrite=False)
    assert (out / "1_000000_000000.parquet").exists()


def test_as_rows_names_the_classes_and_leaves_unlabelled_rows_blank():
    import numpy as np

    batch = {"path": np.array(["a", "b", "c"]), "pred": np.array([2, 0, 1]), "prob": np.array([0.5, 0.25, 1.0])}
    batch["label"] = np.array([2, -1, 0])
    rows = scoring.as_rows(batch, ["cat", "dog", "emu"])
    assert rows["predicted"].tolist() == ["emu", "cat", "dog"]
    assert rows["label"].tolist() == ["emu", "", "cat"]
