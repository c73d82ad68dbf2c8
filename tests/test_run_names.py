"""--name and --fresh never touch what is not a run's own: a run name is one folder name inside
--storage-path, and --fresh removes only a run directory this job wrote. Every case runs against
a canary tree (other runs, a folder of someone else's, a file beside the storage path, the storage
path's parent, a symbolic link out of it) and checks every byte of it afterwards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import exits_2
from training import storage
from training.config import TrainConfig
from training.driver import lease
from training.driver.inputs import prepare


def _canary(top: Path) -> Path:
    """top/{beside.txt, elsewhere/precious.txt, runs/{ours, old, foreign, link -> ../elsewhere, file.txt}};
    returns the storage path, top/runs. `ours` has the marker, `old` only an older run's config.json."""
    runs = top / "runs"
    (top / "elsewhere").mkdir(parents=True)
    (top / "elsewhere" / "precious.txt").write_text("not a run\n")
    (top / "beside.txt").write_text("beside the storage path\n")
    for name in ("ours", "old"):
        (runs / name).mkdir(parents=True)
        (runs / name / "metrics.csv").write_text("epoch\n1\n")
    storage.mark_run_dir(str(runs / "ours"), "ours")
    (runs / "old" / "config.json").write_text(json.dumps({"config": {"name": "old", "epochs": 1}}))
    (runs / "foreign").mkdir()
    (runs / "foreign" / "config.json").write_text('{"model_type": "bert"}')  # someone else's config.json
    (runs / "foreign" / "notes.txt").write_text("mine\n")
    (runs / "link").symlink_to(top / "elsewhere")
    (runs / "file.txt").write_text("a file, not a run\n")
    return runs


def _snapshot(top: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(top))
            if path.is_symlink():
                out[rel] = f"-> {os.readlink(path)}"
            else:
                out[rel] = path.read_bytes() if path.is_file() else "/"
    return out


REFUSED = {
    "dot": (["--name", ".", "--fresh"], "a run name is one folder name"),
    "dot dot": (["--name", "..", "--fresh"], "a run name is one folder name"),
    "parent path": (["--name", "../x", "--fresh"], "a run name is one folder name"),
    "parent path, no fresh": (["--name", "../x"], "a run name is one folder name"),
    "nested": (["--name", "a/b"], "a run name is one folder name"),
    "absolute": (["--name", "/tmp/x", "--fresh"], "a run name is one folder name"),
    "someone else's folder": (["--name", "foreign", "--fresh"], "holds files that jobs.train did not write"),
    "someone else's folder, no fresh": (["--name", "foreign"], "holds files that jobs.train did not write"),
    "an earlier version's run": (["--name", "old", "--fresh"], "is a run of an earlier version of jobs.train"),
    "an earlier version's run, no fresh": (["--name", "old"], "is a run of an earlier version of jobs.train"),
    "a symbolic link": (["--name", "link", "--fresh"], "is a symbolic link"),
    "a file": (["--name", "file.txt", "--fresh"], "is a file, not a run directory"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_name_that_would_touch_what_is_not_the_runs_is_refused(case, tree, tmp_path, no_ray, capsys):
    top = tmp_path / "top"
    runs = _canary(top)
    before = _snapshot(tmp_path)
    flags, message = REFUSED[case]
    err = exits_2(["--data", str(tree), "--storage-path", str(runs), *flags], capsys)
    assert message in err, err
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["..", ".", "../x"])
def test_a_name_from_a_config_file_is_checked_the_same(name, tree, tmp_path, no_ray, capsys):
    runs = _canary(tmp_path / "top")
    before = _snapshot(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(f"name: '{name}'\nfresh: true\nstorage_path: {runs}\n")
    err = exits_2(["--data", str(tree), "--config", str(config)], capsys)
    assert "a run name is one folder name" in err, err
    assert _snapshot(tmp_path) == before | {"c.yaml": config.read_bytes()}


@pytest.mark.parametrize("name", ["ours", "new"])
def test_fresh_removes_only_the_runs_own_directory(name, tree, tmp_path):
    """A run directory with the marker and a name not taken yet: only that folder goes; everything
    beside and above it stays (one of an earlier version, config.json only, is refused: REFUSED)."""
    top = tmp_path / "top"
    runs = _canary(top)
    before = _snapshot(tmp_path)
    cfg, *_ = prepare(TrainConfig(data=str(tree), storage_path=str(runs), name=name, fresh=True))
    assert sorted(os.listdir(runs / name)) == [".lease", storage.RUN_MARKER]  # the new run's, under its lease
    lease.release(cfg.run_dir)
    after = _snapshot(tmp_path)
    expected = {k: v for k, v in before.items() if not k.startswith(f"top/runs/{name}")}
    assert {k: v for k, v in after.items() if not k.startswith(f"top/runs/{name}")} == expected
    assert set(after) - set(expected) <= {f"top/runs/{name}", f"top/runs/{name}/{storage.RUN_MARKER}"}


def test_fresh_leaves_an_empty_folder_and_its_storage_path_alone(tree, tmp_path):
    runs = tmp_path / "runs"
    (runs / "empty").mkdir(parents=True)
    prepare(TrainConfig(data=str(tree), storage_path=str(runs), name="empty", fresh=True))
    assert (runs / "empty").is_dir()


def _objects(s3, prefix: str) -> dict:
    """Every object under `prefix` but pyarrow's empty folder markers ("runs/", which it writes
    so that the storage path still lists as a folder once the run inside it is gone)."""
    listed = s3.client.list_objects_v2(Bucket="runs", Prefix=prefix).get("Contents", [])
    keys = [o["Key"] for o in listed if not o["Key"].endswith("/")]
    return {key: s3.client.get_object(Bucket="runs", Key=key)["Body"].read() for key in keys}


def test_on_s3_fresh_removes_only_a_run_directory_of_this_job(s3, tree, no_ray, capsys):
    prefix = "canary-fresh/"
    put = {
        "beside.txt": b"beside",
        "runs/ours/metrics.csv": b"epoch\n1\n",
        "runs/other/metrics.csv": b"epoch\n1\n",
        "runs/foreign/notes.txt": b"mine",
    }
    for key, body in put.items():
        s3.client.put_object(Bucket="runs", Key=prefix + key, Body=body)
    for name in ("ours", "other"):
        storage.mark_run_dir(f"s3://runs/{prefix}runs/{name}", name)
    runs_uri = f"s3://runs/{prefix}runs"
    before = _objects(s3, prefix)
    for flags, message in (
        (["--name", "foreign", "--fresh"], "holds files that jobs.train did not write"),
        (["--name", "..", "--fresh"], "a run name is one folder name"),
        (["--name", ".", "--fresh"], "a run name is one folder name"),
    ):
        assert message in exits_2(["--data", str(tree), "--storage-path", runs_uri, *flags], capsys)
        assert _objects(s3, prefix) == before, flags
    cfg, *_ = prepare(TrainConfig(data=str(tree), storage_path=runs_uri, name="ours", fresh=True))
    lease.release(cfg.run_dir)
    after = {k: v for k, v in _objects(s3, prefix).items() if not k.endswith(f"/ours/{storage.RUN_MARKER}")}
    assert after == {k: v for k, v in before.items() if "/ours/" not in k}
