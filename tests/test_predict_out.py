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


class Stopped:
    """A dataset whose write is stopped half way (Ctrl-C, SIGTERM): two part files are in its folder
    (made as Ray Data makes it) when the KeyboardInterrupt comes."""

    def _write(self, folder: str, suffix: str) -> None:
        storage.write_bytes(storage.join(folder, f"a_000000-0.{suffix}"), b"path,predicted\n")
        storage.write_bytes(storage.join(folder, f"a_000001-0.{suffix}"), b"path,predicted\n")
        raise KeyboardInterrupt

    def write_csv(self, folder: str) -> None:
        self._write(folder, "csv")

    def write_parquet(self, folder: str) -> None:
        self._write(folder, "parquet")


@pytest.mark.parametrize("name", ["p.csv", "p.parquet", "preds"])
def test_a_write_stopped_half_way_leaves_nothing_of_its_own(tmp_path, name):
    """Ctrl-C in jobs.predict left p.csv.parts behind, which refused the next run ("in the way");
    a new --out folder kept its half-written parts. Both go; the folder made for them too."""
    with pytest.raises(KeyboardInterrupt):
        scoring.write(Stopped(), str(tmp_path / name))
    assert list(tmp_path.iterdir()) == []
    check_out(str(tmp_path / name), overwrite=False)  # the same command goes again


def test_a_stopped_write_keeps_what_was_there_before_it(tmp_path, monkeypatch):
    """An earlier prediction's file stays until the merge starts to replace it (--overwrite); the
    user's files in an --out folder stay, and the folder's earlier parts with them."""
    earlier = tmp_path / "p.csv"
    earlier.write_text("earlier\n")
    with pytest.raises(KeyboardInterrupt):
        scoring.write(Stopped(), str(earlier))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.csv"] and earlier.read_text() == "earlier\n"

    def half_merge(parts, out):
        storage.write_bytes(out, b"path,predicted\nhalf")
        raise KeyboardInterrupt

    monkeypatch.setattr(scoring, "merge_csv", half_merge)
    monkeypatch.setattr(Stopped, "_write", lambda self, folder, suffix: storage.write_bytes(f"{folder}/x.csv", b""))
    with pytest.raises(KeyboardInterrupt):
        scoring.write(Stopped(), str(earlier))
    assert list(tmp_path.iterdir()) == []  # a half-merged file is not a prediction

    out = _folder(tmp_path, ours=("1_000000_000000.parquet",), theirs=("notes.txt",))
    monkeypatch.undo()
    with pytest.raises(KeyboardInterrupt):
        scoring.write(Stopped(), str(out))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["1_000000_000000.parquet", scoring.PARTS_RECORD, "notes.txt"]
    )


@pytest.mark.parametrize("module", ["jobs.predict", "jobs.evaluate"])
def test_sigterm_while_data_is_listed_is_one_line_and_exit_143(module, tmp_path, capsys, monkeypatch, fresh_signals):
    """A real SIGTERM to this process while --data is listed (minutes for a big bucket), before Ray:
    Python's default ended the process (-15) without a word. Now the job's one line, exit 143."""
    import importlib
    import os
    import signal
    import time
    import types

    from training.predict import inference

    def sigterm_while_listing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        pytest.fail("SIGTERM did not stop the job")

    model_file = types.SimpleNamespace(setting=lambda key, default: default)  # what evaluate reads first
    monkeypatch.setattr(inference, "load_model_file", lambda path: model_file)
    monkeypatch.setattr(inference, "input_splits", sigterm_while_listing)
    main = importlib.import_module(module).main
    out = tmp_path / ("p.csv" if module == "jobs.predict" else "eval")
    assert main(["--model", str(tmp_path / "model.pt"), "--data", str(tmp_path), "--out", str(out)]) == 143
    written = out if module == "jobs.predict" else out / "predictions.csv"
    said = f"stopped: terminated (SIGTERM); {written} was not written (its parts so far are removed); run the same"
    assert capsys.readouterr().err == said + " command again\n"
    assert list(tmp_path.iterdir()) == []
