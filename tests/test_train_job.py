"""The whole job on the shared Ray cluster: tiny real PNG trees, 2 CPU workers, DDP on gloo."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from tests.conftest import write_tree
from training import job
from training.config import ConfigError, TrainConfig


@pytest.fixture(scope="module")
def one_epoch_run(ray_cluster, tmp_path_factory):
    base = tmp_path_factory.mktemp("job")
    data = write_tree(base / "data", {"red": 24, "green": 24, "blue": 24})
    cfg = TrainConfig(data=str(data), epochs=1, batch_size=16, num_workers=2, storage_path=str(base / "runs"), name="tiny", val_fraction=0.25)
    cfg, tree, preset = job.prepare(cfg)
    summary = job.run(cfg, tree, preset, log=lambda *a: None)
    return base / "runs" / "tiny", summary, tree


def test_run_directory_has_sane_contents(one_epoch_run):
    run_dir, summary, tree = one_epoch_run
    for name in ("config.json", "metrics.csv", "summary.json", "model.pt"):
        assert (run_dir / name).is_file(), name

    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["num_workers"] == 2 and config["class_names"] == ["blue", "green", "red"]

    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [int(r["epoch"]) for r in rows] == [1]
    # equal=True split may drop up to world_size-1 rows so that both ranks take the same steps
    assert len(tree.train) - 1 <= int(rows[0]["train_images"]) <= len(tree.train)
    assert 0.0 <= float(rows[0]["data_wait_frac"]) <= 1.0

    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk == summary
    assert summary["world_size"] == 2 and summary["device"] == "cpu" and summary["num_classes"] == 3
    assert summary["epochs"] == 1 and summary["val_images"] == len(tree.val) > 0
    assert 0.0 <= summary["val_acc"] <= 1.0 and summary["best_val_acc"] == summary["val_acc"]
    assert summary["train_images_per_s"] > 0 and summary["wall_s"] > 0

    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert model["class_names"] == ["blue", "green", "red"]
    assert model["state_dict"]["fc.weight"].shape == (3, 512)
    assert model["state_dict"]["conv1.weight"].shape == (64, 3, 3, 3)  # small-image stem at 32 px


def test_validation_scores_every_image_once(one_epoch_run):
    """val is split across ranks without dropping rows: the accuracy is k / len(val)."""
    _, summary, tree = one_epoch_run
    n = len(tree.val)
    assert any(abs(summary["val_acc"] - k / n) < 1e-5 for k in range(n + 1))


def test_more_gpus_than_the_cluster_has_is_a_config_error(ray_cluster):
    with pytest.raises(ConfigError, match="no GPUs"):
        job.plan_resources(TrainConfig(device="cuda"), ray_cluster.cluster_resources())


def test_cpu_plan_leaves_cpus_for_ray_data():
    plan = job.plan_resources(TrainConfig(), {"CPU": 2})
    assert (plan.num_workers, plan.cpus_per_worker, plan.threads_per_worker) == (1, 1, 2)
    with pytest.raises(ConfigError, match="needs 8 CPUs but the cluster has 4"):
        job.plan_resources(TrainConfig(num_workers=4, cpus_per_worker=2), {"CPU": 4})
    gpu = job.plan_resources(TrainConfig(), {"CPU": 16, "GPU": 2})
    assert gpu.use_gpu and gpu.num_workers == 2 and 0 < gpu.augment_gpus < 1
