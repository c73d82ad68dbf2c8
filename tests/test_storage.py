"""Object storage for real: the jobs against an S3 server on loopback (conftest's `s3`: moto
with IAM on, reached through AWS_ENDPOINT_URL and a credentials file, as users reach MinIO).

Training runs cost half a minute each here, so few runs cover many things:
- `resumed_run`: 2 workers on the 2-node session cluster train from an s3:// tree (hash
  split, bad files in it) into --storage-path s3://; the test kills the workers while epoch
  2's checkpoint is being uploaded; the same --name then resumes from epoch 1's checkpoint,
  reading the jobs.prepare copy of the tree on s3:// (the same split, labels and keys);
- `split_run`: 1 worker trains from an s3:// tree in the train/ + val/ layout;
- jobs.predict and jobs.evaluate read the resumed run's model.pt and the data from s3://.
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import write_tree
from training import job
from training.config import TrainConfig
from training.data import scan_tree

BAD = {"truncated.jpg": "corrupt image", "text.jpg": "not an image", "empty.png": "empty file"}


def _add_bad_files(folder: Path) -> None:
    jpeg = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(jpeg, format="JPEG")
    (folder / "truncated.jpg").write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) // 2])
    (folder / "text.jpg").write_bytes(b"a text file with an image's name\n")
    (folder / "empty.png").write_bytes(b"")


@pytest.fixture(scope="module")
def trees(s3, tmp_path_factory):
    """The same trees on disk and on s3://data: `hash` (<class>/<img>, with bad files, a
    hidden file and a note that are no images), `split` (train/ + val/, with bad files),
    `notes` (class folders without images)."""
    for bucket in ("data", "runs"):
        s3.client.create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("trees")
    hash_tree = write_tree(root / "hash", {"red": 12, "green": 12, "blue": 12})
    _add_bad_files(hash_tree / "red")
    (hash_tree / "red" / ".hidden.png").write_bytes((hash_tree / "red" / "000.png").read_bytes())
    (hash_tree / "green" / "notes.txt").write_text("not an image\n")
    split = root / "split"
    write_tree(split / "train", {"a": 10, "b": 10})
    write_tree(split / "val", {"a": 3, "b": 3}, seed=1)
    _add_bad_files(split / "train" / "b")
    notes = root / "notes"
    for name in ("a", "b"):
        (notes / name).mkdir(parents=True)
        (notes / name / "readme.md").write_text("no images here\n")
    return {
        name: (path, s3.upload(path, f"s3://data/{name}"))
        for name, path in [("hash", hash_tree), ("split", split), ("notes", notes)]
    }


@pytest.mark.parametrize("name", ["hash", "split"])
def test_a_tree_on_s3_scans_as_it_does_on_disk(trees, name):
    local, uri = trees[name]
    on_disk, on_s3 = scan_tree(str(local), 0.25), scan_tree(uri, 0.25)
    assert on_s3.layout == on_disk.layout == ("hash" if name == "hash" else "train/val")
    assert on_s3.class_names == on_disk.class_names
    for a, b in ((on_disk.train, on_s3.train), (on_disk.val, on_s3.val)):
        assert [p.replace(str(local), uri) for p in a.paths] == list(b.paths)
        assert (a.labels, a.keys, a.total_bytes) == (b.labels, b.keys, b.total_bytes)
    assert len(on_s3.train) + len(on_s3.val) == (39 if name == "hash" else 29)  # bad files in, hidden and notes out


@pytest.fixture(scope="module")
def prepared(trees, s3):
    """jobs.prepare from s3:// to s3:// (no Ray: it reads with threads and writes shards)."""
    from jobs.prepare import main

    uri = "s3://data/hash-prepared"
    assert main([trees["hash"][1], uri, "--val-fraction", "0.25", "--shard-mb", "0.02"]) == 0
    return uri


def test_prepare_writes_shards_to_s3_that_hold_the_tree(trees, prepared, s3):
    objects = s3.objects(prepared)
    manifest = json.loads(s3.read(f"{prepared}/_prepared.json"))
    shards = manifest["splits"]["train"]["shards"] + manifest["splits"]["val"]["shards"]
    assert len(manifest["splits"]["train"]["shards"]) > 1 and set(shards) <= set(objects)
    local, uri = trees["hash"]
    tree, copy = scan_tree(str(local), 0.25), scan_tree(prepared)
    for a, b in ((tree.train, copy.train), (tree.val, copy.val)):
        assert sorted(zip(a.keys, a.labels, strict=True)) == sorted(zip(b.keys, b.labels, strict=True))
        assert sorted(p.replace(str(local), uri) for p in a.paths) == sorted(b.paths)


def _jobs_train(argv: list[str]) -> int:
    from jobs.train import main

    return main(argv)


@pytest.mark.parametrize(
    "argv, env, message",
    [
        pytest.param(
            ["--data", "s3://data/hash"],
            {"AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000", "AWS_SECRET_ACCESS_KEY": "x"},
            "rejected the credentials (INVALID_ACCESS_KEY_ID); set AWS_ACCESS_KEY_ID",
            id="unknown-key",
        ),
        pytest.param(
            ["--data", "s3://data/hash"],
            {"AWS_ACCESS_KEY_ID": "writer", "AWS_SECRET_ACCESS_KEY": "wrong"},
            "rejected the credentials (SIGNATURE_DOES_NOT_MATCH)",
            id="wrong-secret",
        ),
        pytest.param(
            ["--data", "s3://no-such-bucket/photos"], {}, "bucket 'no-such-bucket' does not exist at", id="no-bucket"
        ),
        pytest.param(
            ["--data", "s3://data/nothing-here"],
            {},
            "s3://data/nothing-here: no objects under this prefix",
            id="empty-prefix",
        ),
        pytest.param(["--data", "s3://data/notes"], {}, "no images in the class directories", id="no-images"),
        pytest.param(
            ["--data", "s3://data/hash", "--storage-path", "s3://runs"],
            {"AWS_ACCESS_KEY_ID": "reader", "AWS_SECRET_ACCESS_KEY": "reader"},
            "--storage-path s3://runs/x: access denied at http://127.0.0.1:",
            id="read-only-storage",
        ),
        pytest.param(
            ["--data", "s3://data/hash", "--storage-path", "s3://no-such-bucket/runs"],
            {},
            "--storage-path s3://no-such-bucket/runs/x: bucket 'no-such-bucket' does not exist",
            id="no-storage-bucket",
        ),
    ],
)
def test_storage_errors_exit_2_with_one_line_before_training(s3, trees, monkeypatch, capsys, argv, env, message):
    for key, value in env.items():  # "writer"/"reader": that IAM user's real key or secret
        user = s3.keys.get(value)
        monkeypatch.setenv(key, (user[0] if key.endswith("KEY_ID") else user[1]) if user else value)
    before = s3.objects("s3://runs")
    assert _jobs_train([*argv, "--name", "x", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert "Traceback" not in err and s3.objects("s3://runs") == before  # nothing written, nothing lost


def test_prepare_predict_and_evaluate_refuse_storage_they_cannot_use(s3, trees, monkeypatch, capsys):
    from jobs.evaluate import main as evaluate
    from jobs.predict import main as predict
    from jobs.prepare import main as prepare

    reader, secret = s3.keys["reader"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", reader)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    assert prepare([trees["hash"][1], "s3://data/reader-prepared"]) == 2
    assert "OUT s3://data/reader-prepared: access denied" in capsys.readouterr().err
    assert predict(["--model", "s3://runs/none/model.pt", "--data", trees["hash"][1]]) == 2
    assert "--model s3://runs/none/model.pt: no such file" in capsys.readouterr().err
    assert evaluate(["--model", "s3://no-such-bucket/model.pt", "--data", trees["hash"][1]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bucket 'no-such-bucket' does not exist" in err


# --------------------------------------------------------------------------- training runs


def _run(**overrides):
    cfg, tree, preset = job.prepare(TrainConfig(**overrides))
    return job.run(cfg, tree, preset, log=lambda *a: None), tree


def _train_worker_pids() -> list[int]:
    from ray.util.state import list_actors

    actors = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")], detail=True)
    return [a.pid for a in actors]


@pytest.fixture(scope="module")
def resumed_run(ray_cluster, s3, trees, prepared):
    """An s3:// run interrupted while writing epoch 2's checkpoint, then rerun under its name."""
    common = dict(epochs=2, batch_size=16, num_workers=2, val_fraction=0.25, storage_path="s3://runs", name="shared")
    s3.gate.hold("/runs/shared/checkpoint_epoch_0002/checkpoint.pt")
    box = {}

    def first_run():
        try:
            _run(data=trees["hash"][1], max_failures=0, **common)
        except Exception as e:  # noqa: BLE001 - the test thread checks it
            box["error"] = e

    thread = threading.Thread(target=first_run, daemon=True)
    thread.start()
    arrived = s3.gate.arrived.wait(timeout=400)
    pids = _train_worker_pids() if arrived else []
    for pid in pids:  # the fault: both workers die mid-upload
        os.kill(pid, signal.SIGKILL)
    s3.gate.release()
    thread.join(timeout=300)
    assert arrived and len(pids) == 2, "the run never wrote epoch 2's checkpoint"
    interrupted = {
        "error": box.get("error"),
        "objects": s3.objects("s3://runs/shared"),
        "snapshot": json.loads(s3.read("s3://runs/shared/checkpoint_manager_snapshot.json")),
    }
    summary, tree = _run(data=prepared, **common)  # the same --name: resumes
    return interrupted, summary, tree


def test_a_run_interrupted_while_writing_a_checkpoint_resumes_from_the_last_complete_one(resumed_run):
    interrupted, summary, _ = resumed_run
    assert isinstance(interrupted["error"], job.TrainingFailed), interrupted["error"]
    latest = interrupted["snapshot"]["latest_checkpoint_result"]["checkpoint_dir_name"]
    assert latest == "checkpoint_epoch_0001"  # the half-written epoch 2 was never registered
    assert "checkpoint_epoch_0001/checkpoint.pt" in interrupted["objects"]
    assert "checkpoint_epoch_0002/checkpoint.pt" not in interrupted["objects"]
    assert summary["resumed_at_epochs"] == [2] and summary["epochs"] == 2


def test_every_artifact_of_an_s3_run_lands_in_s3(resumed_run, s3):
    _, summary, tree = resumed_run
    objects = s3.objects("s3://runs/shared")
    for name in ("config.json", "metrics.csv", "timings.csv", "summary.json", "model.pt", "curves.png"):
        assert name in objects, name
    assert s3.read("s3://runs/shared/confusion.png")[:4] == b"\x89PNG"
    assert any(k.startswith("checkpoint_epoch_0002/") for k in objects)
    assert json.loads(s3.read("s3://runs/shared/summary.json")) == summary
    config = json.loads(s3.read("s3://runs/shared/config.json"))
    assert config["class_names"] == ["blue", "green", "red"] and config["data_root"] == tree.root
    rows = list(csv.DictReader(io.StringIO(s3.read("s3://runs/shared/metrics.csv").decode())))
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    model = torch.load(io.BytesIO(s3.read("s3://runs/shared/model.pt")), weights_only=True)
    assert model["class_names"] == config["class_names"] and model["state_dict"]["fc.weight"].shape == (3, 512)
    assert len({r["node_id"] for r in summary["ranks"]}) == 2  # one rank on each node of the cluster
    assert not Path("s3:").exists()  # no URI mistaken for a local path


def test_bad_files_in_an_s3_tree_are_skipped_and_listed(resumed_run, s3):
    _, summary, tree = resumed_run
    rows = list(csv.DictReader(io.StringIO(s3.read("s3://runs/shared/bad_files.csv").decode())))
    reasons = {r["path"]: r["reason"] for r in rows}
    assert set(reasons) == {f"s3://data/hash/red/{name}" for name in BAD}
    for name, reason in BAD.items():
        assert reasons[f"s3://data/hash/red/{name}"].startswith(reason), reasons
    assert summary["bad_files"] == 3
    for cov in summary["coverage"]:  # both epochs: every good file trained on once, bar the equal split's drop
        assert cov["expected"] == len(tree.train) - sum(p.endswith(tuple(BAD)) for p in tree.train.paths)
        assert cov["duplicated"] == 0 and cov["missing"] <= cov["dropped_for_equal_split"], cov


@pytest.fixture(scope="module")
def split_run(ray_cluster, trees):
    return _run(data=trees["split"][1], epochs=1, batch_size=8, num_workers=1, storage_path="s3://runs", name="split")


def test_training_from_a_train_val_tree_on_s3(split_run, s3):
    summary, tree = split_run
    assert tree.layout == "train/val" and summary["val_images"] == 6 and summary["train_images"] == 23
    (cov,) = summary["coverage"]
    assert cov["exactly_once"] and cov["expected"] == 20, cov  # the 3 bad files skipped
    rows = list(csv.DictReader(io.StringIO(s3.read("s3://runs/split/bad_files.csv").decode())))
    assert sorted(r["path"] for r in rows) == sorted(f"s3://data/split/train/b/{n}" for n in BAD)


def test_predict_and_evaluate_with_model_and_data_on_s3(resumed_run, trees, prepared, s3, capsys):
    from jobs.evaluate import main as evaluate
    from jobs.predict import main as predict

    model = "s3://runs/shared/model.pt"
    out = "s3://runs/shared/predictions.csv"
    assert predict(["--model", model, "--data", trees["hash"][1], "--out", out, "--batch-size", "16"]) == 0
    assert "skipped 3 unreadable file(s)" in capsys.readouterr().out
    rows = list(csv.DictReader(io.StringIO(s3.read(out).decode())))
    local = trees["hash"][0]
    good = sorted(
        str(p.relative_to(local)) for p in local.rglob("*.png") if p.stat().st_size and ".hidden" not in p.name
    )
    assert [r["path"] for r in rows] == good
    assert all(r["label"] == r["path"].split("/")[0] for r in rows)

    assert evaluate(["--model", model, "--data", prepared, "--split", "val"]) == 0  # default --out: beside the model
    evaluated = s3.objects("s3://runs/shared/eval")
    assert {"confusion.png", "per_class.csv", "predictions.csv"} <= set(evaluated)
    rows = list(csv.DictReader(io.StringIO(s3.read("s3://runs/shared/eval/predictions.csv").decode())))
    _, summary, tree = resumed_run
    assert len(rows) == summary["val_images"] - sum(p.endswith(tuple(BAD)) for p in tree.val.paths)
