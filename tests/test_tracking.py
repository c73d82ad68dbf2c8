"""Live tracking (--log-to, training/driver/tracking.py) read back by each tracker's own library or files, no
network: TensorBoard's events while the run goes, MLflow's local store (search_runs,
get_metric_history, the artifacts), W&B's offline run file; a resumed run adds to the same MLflow
and W&B runs; a tracker that cannot be reached costs one warning line. The tracked run
(tests/conftest.py) carries the checks of tests/test_api.py and tests/test_recipe_on_ray.py too."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from tests.conftest import an_epoch_record, event_scalars
from training import fit
from training.config import ConfigError, TrainConfig
from training.driver.tracking import Tracking, parse_log_to


def _wandb_records(run_dir: Path) -> list[tuple[str, dict]]:
    """(run id, {"history": [...], "config": {...}}) of each offline W&B run under RUN_DIR/wandb, read
    from its .wandb file: W&B's header, then LevelDB's log format (32 KiB blocks of records: CRC (4),
    length (2), type (1), data) holding wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, at, chunks, records = path.read_bytes(), 7, b"", []  # ":W&B", a magic number, a version
        while at + 7 <= len(data):
            if (at % 32768) + 7 > 32768:  # the rest of a block is padding
                at += 32768 - at % 32768
                continue
            length, kind = struct.unpack("<H", data[at + 4 : at + 6])[0], data[at + 6]
            if length == 0 and kind == 0:
                break
            chunks += data[at + 7 : at + 7 + length]
            at += 7 + length
            if kind in (1, 4):  # FULL, LAST
                records.append(pb.Record.FromString(chunks))
                chunks = b""
        found = {"history": [], "config": {}, "id": None}
        for r in records:
            kind = r.WhichOneof("record_type")
            if kind == "history":
                found["history"].append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                )
            elif kind == "config":
                found["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
            elif kind == "run":  # the id, and the config as the run began
                found["id"] = r.run.run_id
                found["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        runs.append((found["id"], found))
    return runs


def test_a_run_logs_live_to_tensorboard_mlflow_and_wandb_and_its_resume_continues_them(tracked_run):
    import mlflow
    from mlflow.tracking import MlflowClient

    config, first, run_dir, lines, _, during = tracked_run  # tests/conftest.py
    assert first.epochs == 2 and not [line for line in lines if line.startswith("warning: --log-to")], lines
    assert [step for step, _ in during["val/acc"]] == [1], during.keys()  # epoch 1's, read during epoch 2
    assert any(tag.startswith("step/") for tag in during)  # --log-every: the steps' loss, lr, img/s

    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["ray-gpu-augment"])
    assert (
        len(runs) == 1 and runs["params.lr"][0] == str(first.config.lr) and runs["tags.mlflow.runName"][0] == "tracked"
    )
    run_id = runs["run_id"][0]
    assert [m.step for m in client.get_metric_history(run_id, "val_acc")] == [1, 2]
    assert client.get_metric_history(run_id, "step_loss")  # every step of rank 0
    wandb_runs = _wandb_records(run_dir)
    assert len(wandb_runs) == 1 and wandb_runs[0][1]["config"]["lr"] == first.config.lr
    assert [h["epoch"] for h in wandb_runs[0][1]["history"] if "epoch/val_acc" in h] == [1, 2]

    fit(config, log=lines.append)  # the same call, less the stop rule: the run resumed to its third epoch
    runs = mlflow.search_runs(experiment_names=["ray-gpu-augment"])
    assert list(runs["run_id"]) == [run_id] and runs["status"][0] == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "val_acc")] == [1, 2, 3]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"model.pt", "model_best.pt", "curves.png", "confusion.png"} <= artifacts, artifacts
    wandb_runs = _wandb_records(run_dir)
    assert len(wandb_runs) == 2 and wandb_runs[0][0] == wandb_runs[1][0]  # the same W&B run, resumed
    assert [h["epoch"] for h in wandb_runs[1][1]["history"] if "epoch/val_acc" in h] == [3]
    events = event_scalars(run_dir / "tensorboard")
    assert sorted(step for step, _ in events["val/acc"]) == [1, 2, 3]


def test_a_tracker_that_cannot_be_reached_costs_one_warning_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    cfg = TrainConfig(storage_path=str(tmp_path), name="away")
    lines = []
    tracking = Tracking(cfg, ("mlflow",), lines.append)
    started = time.monotonic()
    tracking.start(cfg.to_dict())
    tracking.on_epoch_end(an_epoch_record())
    tracking.finish([], ok=True)
    assert len(lines) == 1 and lines[0].startswith("warning: --log-to mlflow: start failed ("), lines
    assert lines[0].endswith("); the run goes on without it") and time.monotonic() - started < 60


def test_unknown_or_missing_trackers_are_one_line_before_ray(monkeypatch):
    with pytest.raises(ConfigError, match=r"--log-to tensorboard,comet: unknown tracker 'comet'; give any of"):
        parse_log_to("tensorboard,comet")
    assert parse_log_to(" MLflow , wandb,mlflow ") == ("mlflow", "wandb")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"--log-to wandb: wandb is not installed; pip install -e '\.\[wandb\]'"):
        parse_log_to("wandb")
