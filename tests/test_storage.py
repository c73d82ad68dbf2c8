"""Object storage for real: the jobs against an S3 server on loopback (conftest's `s3`: moto
with IAM on, reached through AWS_ENDPOINT_URL and a credentials file, as users reach MinIO).

Training runs cost half a minute each here, so few runs cover many things:
- `s3_run`: 2 workers on the 2-node session cluster train from jobs.prepare shards on s3://
  (prepared from an s3:// tree in the train/ + val/ layout, bad files in it) into
  --storage-path s3://; every artifact lands there; jobs.evaluate then reads its model.pt
  and the tree from s3://;
- tests/test_predict.py runs jobs.predict with the model, the files and the CSV on s3://;
- tests/test_faults.py's Ctrl-C test runs `python -m jobs.train` on an s3:// tree (hash
  split, bad files in it) into s3://, interrupts it while it uploads a checkpoint, and
  resumes it under the same --name.
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import prepare, write_tree
from training.config import TrainConfig
from training.driver import job, results
from training.forms.formats import scan_data
from training.forms.tree import scan_tree
from training.storage import staging_dir

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
        assert (a.labels.tolist(), a.keys.tolist(), a.total_bytes) == (
            b.labels.tolist(),
            b.keys.tolist(),
            b.total_bytes,
        )
    assert len(on_s3.train) + len(on_s3.val) == (39 if name == "hash" else 29)  # bad files in, hidden and notes out


@pytest.fixture(scope="module")
def prepared(trees, s3):
    """jobs.prepare from s3:// to s3:// (no Ray: it reads with threads and writes shards)."""
    from jobs.prepare import main

    uri = "s3://data/split-prepared"
    assert main([trees["split"][1], uri, "--shard-mb", "0.02"]) == 0
    return uri


def test_prepare_writes_shards_to_s3_that_hold_the_tree(trees, prepared, s3):
    objects = s3.objects(prepared)
    manifest = json.loads(s3.read(f"{prepared}/_prepared.json"))
    shards = manifest["splits"]["train"]["shards"] + manifest["splits"]["val"]["shards"]
    assert len(manifest["splits"]["train"]["shards"]) > 1 and set(shards) <= set(objects)
    local, uri = trees["split"]
    tree, copy = scan_tree(str(local)), scan_data(prepared)
    assert copy.class_names == tree.class_names
    for a, b in ((tree.train, copy.train), (tree.val, copy.val)):
        pairs = [sorted(zip(x.keys.tolist(), x.labels.tolist(), strict=True)) for x in (a, b)]
        assert pairs[0] == pairs[1]
        assert sorted(p.replace(str(local), uri) for p in a.paths) == sorted(b.paths)


@pytest.mark.parametrize(
    "argv, env, message",
    [
        pytest.param(
            ["--data", "s3://data/hash"],
            lambda keys: {"AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000", "AWS_SECRET_ACCESS_KEY": "x"},
            "rejected the credentials (INVALID_ACCESS_KEY_ID); set AWS_ACCESS_KEY_ID",
            id="unknown-key",
        ),
        pytest.param(
            ["--data", "s3://data/hash"],
            lambda keys: {"AWS_ACCESS_KEY_ID": keys["writer"][0], "AWS_SECRET_ACCESS_KEY": "wrong"},
            "rejected the credentials (SIGNATURE_DOES_NOT_MATCH)",
            id="wrong-secret",
        ),
        pytest.param(
            ["--data", "s3://no-such-bucket/photos"], None, "bucket 'no-such-bucket' does not exist at", id="no-bucket"
        ),
        pytest.param(
            ["--data", "s3://data/nothing-here"],
            None,
            "s3://data/nothing-here: no objects under this prefix",
            id="empty-prefix",
        ),
        pytest.param(["--data", "s3://data/notes"], None, "no images in the class directories", id="no-images"),
        pytest.param(["--data", "s3://"], None, "s3://: no bucket in the URI", id="no-bucket-in-uri"),
        pytest.param(["--data", "sftp://host/photos"], None, "Unrecognized filesystem type", id="unknown-scheme"),
        pytest.param(
            ["--data", "s3://data/hash", "--storage-path", "s3://runs"],
            lambda keys: dict(zip(("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"), keys["reader"], strict=True)),
            "when writing; the credentials need s3:PutObject, s3:GetObject and s3:DeleteObject there",
            id="read-only-storage",
        ),
        pytest.param(
            ["--data", "s3://data/hash", "--storage-path", "s3://no-such-bucket/runs"],
            None,
            "--storage-path s3://no-such-bucket/runs/x: bucket 'no-such-bucket' does not exist",
            id="no-storage-bucket",
        ),
        pytest.param(
            ["--data", "s3://data/hash", "--storage-path", "/dev/null/runs"],
            None,
            "--storage-path /dev/null/runs/x: cannot write there (Not a directory)",
            id="local-storage-not-writable",
        ),
    ],
)
def test_storage_errors_exit_2_with_one_line_before_training(s3, trees, monkeypatch, capsys, argv, env, message):
    from jobs.train import main

    for key, value in (env(s3.keys) if env else {}).items():  # credentials in the environment beat ~/.aws
        monkeypatch.setenv(key, value)
    before = s3.objects("s3://runs")
    assert main([*argv, "--name", "x", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert "Traceback" not in err and s3.objects("s3://runs") == before  # nothing written, nothing lost


def _model_file(path: Path, tree_root: str) -> str:
    """A model.pt in the trainer's format for the classes of `tree_root` (freshly initialised)."""
    from augment.presets import PRESETS
    from training.model import resnet18

    tree = scan_tree(tree_root, 0.2)
    state = resnet18(tree.num_classes, small_stem=True).state_dict()
    path.write_bytes(results.model_bytes(state, tree.class_names, PRESETS["cifar"], TrainConfig()))
    return str(path)


def test_prepare_predict_and_evaluate_refuse_storage_they_cannot_use(s3, trees, monkeypatch, capsys, tmp_path):
    from jobs.evaluate import main as evaluate
    from jobs.predict import main as predict
    from jobs.prepare import main as prepare

    model = _model_file(tmp_path / "model.pt", str(trees["hash"][0]))  # readable: only --out is refused below
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
    # --out where the key may read but not write: refused before Ray starts, nothing written
    before = s3.objects("s3://runs")
    for main, out, where in (
        (predict, "s3://runs/reader/p.csv", "s3://runs/reader"),
        (evaluate, "s3://runs/reader/eval", "s3://runs/reader/eval"),
    ):
        assert main(["--model", model, "--data", trees["hash"][1], "--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith(f"error: --out {where}: access denied at {s3.endpoint} when writing"), err
    assert s3.objects("s3://runs") == before


def test_the_access_check_lists_under_the_users_prefix_and_takes_gcs_not_found(monkeypatch):
    """check_bucket lists a key under the path itself (a policy may allow listing only there)
    and takes a bare OSError "No such file or directory", which is how pyarrow's GCS says the
    key is not there, as an answer; a refusal is still a StorageError."""
    from training import storage

    asked = []

    class Fs:
        def __init__(self, err):
            self.err = err

        def get_file_info(self, selector):
            asked.append(selector.base_dir)
            raise self.err

    for err in (OSError("GetObjectMetadata: No such file or directory"), FileNotFoundError("not there")):
        monkeypatch.setattr(storage, "filesystem", lambda path, err=err: (Fs(err), "bucket/photos/train", "gs://"))
        storage.check_bucket("gs://bucket/photos/train")
    assert asked == ["bucket/photos/train/.ray-gpu-augment-access-check"] * 2
    monkeypatch.setattr(storage, "filesystem", lambda path: (Fs(OSError("403 Forbidden")), "bucket/x", "gs://"))
    with pytest.raises(storage.StorageError, match="access denied at Google Cloud Storage"):
        storage.check_bucket("gs://bucket/x")


# --------------------------------------------------------------------------- a training run


@pytest.fixture(scope="module")
def s3_run(ray_cluster, prepared):
    cfg, tree, preset = prepare(
        TrainConfig(data=prepared, epochs=1, batch_size=8, num_workers=2, storage_path="s3://runs", name="prepared")
    )
    return job.run(cfg, tree, preset, log=lambda *a: None, own_cluster=True), tree


def test_every_artifact_of_a_run_lands_in_s3(s3_run, s3):
    summary, tree = s3_run
    run = "s3://runs/prepared"
    objects = s3.objects(run)
    for name in (
        "config.json",
        "metrics.csv",
        "timings.csv",
        "summary.json",
        "model.pt",
        "checkpoint_manager_snapshot.json",
    ):
        assert name in objects, name
    for name in ("curves.png", "confusion.png"):
        assert s3.read(f"{run}/{name}")[:4] == b"\x89PNG", name
    assert "checkpoint_epoch_0001/checkpoint.pt" in objects
    assert json.loads(s3.read(f"{run}/summary.json")) == summary
    config = json.loads(s3.read(f"{run}/config.json"))
    assert config["class_names"] == ["a", "b"] and config["data_root"] == tree.root
    (row,) = csv.DictReader(io.StringIO(s3.read(f"{run}/metrics.csv").decode()))
    assert int(row["epoch"]) == 1 and float(row["val_acc"]) == summary["val_acc"]
    model = torch.load(io.BytesIO(s3.read(f"{run}/model.pt")), weights_only=True)
    assert model["class_names"] == config["class_names"] and model["state_dict"]["fc.weight"].shape == (2, 512)
    assert len({r["node_id"] for r in summary["ranks"]}) == 2  # one rank on each node of the cluster
    assert not Path("s3:").exists()  # no URI mistaken for a local path


def test_bad_files_of_an_s3_tree_are_skipped_and_listed(s3_run, s3):
    summary, tree = s3_run
    rows = list(csv.DictReader(io.StringIO(s3.read("s3://runs/prepared/bad_files.csv").decode())))
    reasons = {r["path"]: r["reason"] for r in rows}
    assert set(reasons) == {f"s3://data/split/train/b/{name}" for name in BAD}  # named as in the tree
    for name, reason in BAD.items():
        assert reasons[f"s3://data/split/train/b/{name}"].startswith(reason), reasons
    assert summary["bad_files"] == 3 and summary["val_images"] == 6 and summary["train_images"] == 23
    (cov,) = summary["coverage"]  # every good file trained on once, bar a row the equal split may drop
    assert cov["expected"] == 20 and cov["repeated"] == 0 and cov["as_expected"], cov


def test_evaluate_with_model_and_data_on_s3(s3_run, trees, s3, capsys):
    """jobs.predict with all on s3:// is in tests/test_predict.py (against the same files on disk)."""
    from jobs.evaluate import main as evaluate

    # the run's own validation split, read from the tree (the run read the prepared copy); --out beside the model
    assert evaluate(["--model", "s3://runs/prepared/model.pt", "--data", trees["split"][1], "--split", "val"]) == 0
    assert "accuracy" in capsys.readouterr().out
    assert {"confusion.png", "per_class.csv", "predictions.csv"} <= set(s3.objects("s3://runs/prepared/eval"))
    rows = list(csv.DictReader(io.StringIO(s3.read("s3://runs/prepared/eval/predictions.csv").decode())))
    val = sorted(str(p.relative_to(trees["split"][0])) for p in (trees["split"][0] / "val").rglob("*.png"))
    assert [r["path"] for r in rows] == val and all(r["label"] == r["path"].split("/")[1] for r in rows)
    per_class = list(csv.DictReader(io.StringIO(s3.read("s3://runs/prepared/eval/per_class.csv").decode())))
    assert {r["class"]: int(r["images"]) for r in per_class} == {"a": 3, "b": 3}


HOLD_A_STAGING_FOLDER = """
import os, signal, sys
from training.storage import staging_dir
with staging_dir() as folder:
    with open(os.path.join(folder, "checkpoint.pt"), "wb") as f:
        f.write(b"x" * 1000)
    print(folder, flush=True)
    if sys.argv[1] == "killed":
        os.kill(os.getpid(), signal.SIGKILL)  # as Ray ends a stopped run's worker, mid-upload
    sys.stdin.read()  # alive until the test closes its stdin
"""


def test_the_staging_folder_of_a_killed_process_goes_with_the_next_one_and_a_live_ones_stays(tmp_path, monkeypatch):
    """A checkpoint waits in a staging folder while Ray Train copies it to the run's storage; a
    process killed meanwhile leaves it, and the next staging folder on the machine removes it."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    args = [sys.executable, "-c", HOLD_A_STAGING_FOLDER]
    killed = subprocess.run([*args, "killed"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    left = Path(killed.stdout.strip())
    assert killed.returncode == -signal.SIGKILL and (left / "checkpoint.pt").is_file(), killed.stderr  # the fault
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    live = subprocess.Popen([*args, "live"], cwd=repo, env=env, **pipes)
    try:
        held = Path(live.stdout.readline().strip())
        elsewhere = left.parent / f"{left.name.partition('@')[0]}@another-host-x1y2z3"  # a container sharing /tmp
        elsewhere.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        with staging_dir() as mine:
            assert not left.exists(), "the killed process's checkpoint stayed"
            assert (held / "checkpoint.pt").is_file() and Path(mine).is_dir()  # a live process's is kept
            assert elsewhere.is_dir()  # and another host's, whose processes this one cannot see
        assert not Path(mine).exists()
    finally:
        live.communicate("", timeout=60)
    assert live.returncode == 0 and not held.exists()
    assert [p.name for p in tmp_path.iterdir()] == [f"ray-gpu-augment-staging-{os.getuid()}"]  # nothing else
    assert [p.name for p in elsewhere.parent.iterdir()] == [elsewhere.name]


def test_a_staging_folder_name_taken_by_a_file_falls_back_to_the_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / f"ray-gpu-augment-staging-{os.getuid()}").write_text("not a folder")  # another user's, say
    with staging_dir() as folder:
        assert Path(folder).parent == tmp_path and Path(folder).is_dir()
    assert not Path(folder).exists()


def test_a_write_that_fails_leaves_no_temporary_file_beside_the_users(tmp_path):
    """write_bytes writes a temporary file and moves it into place; where the move fails (here the
    name is a folder of the user's) or Ctrl-C comes, the temporary file stayed in the user's folder."""
    import pytest

    from training.storage import write_bytes

    (tmp_path / "model.onnx").mkdir()
    (tmp_path / "model.onnx" / "mine.txt").write_text("mine")
    with pytest.raises(OSError):
        write_bytes(str(tmp_path / "model.onnx"), b"onnx")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["model.onnx", "model.onnx/mine.txt"]
