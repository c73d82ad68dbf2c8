"""The whole job on the shared Ray cluster: tiny real PNG trees, CPU workers, DDP on gloo."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest
import torch
import torchvision

from tests.conftest import Terminal, bar_frames, write_tree
from training import job
from training.config import ConfigError, TrainConfig


def _run(bar_stream=None, log=lambda *a: None, **overrides):
    cfg, tree, preset = job.prepare(TrainConfig(**overrides))
    return job.run(cfg, tree, preset, log=log, bar_stream=bar_stream), tree


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_tree(tmp_path_factory.mktemp("data"), {"red": 24, "green": 24, "blue": 24, "cyan": 24, "gray": 24})


@pytest.fixture(scope="module")
def two_worker_run(ray_cluster, data, tmp_path_factory):
    """At 40 px (--image-size) from 32 px files, with the console's bar drawn on a fake terminal."""
    runs, screen, lines = tmp_path_factory.mktemp("runs"), Terminal(), []
    summary, tree = _run(
        data=str(data),
        epochs=1,
        batch_size=16,
        num_workers=2,
        storage_path=str(runs),
        name="tiny",
        val_fraction=0.25,
        image_size=40,
        bar_stream=screen,
        log=lines.append,
    )
    return runs / "tiny", summary, tree, (screen.getvalue(), lines)


def _split_coordinators() -> set[str]:
    from ray.util.state import list_actors

    return {a.actor_id for a in list_actors(filters=[("class_name", "=", "SplitCoordinator")], limit=10_000)}


def _rows(path):
    return list(csv.DictReader(path.open()))


def test_run_directory_has_sane_contents(two_worker_run):
    run_dir, summary, tree, _ = two_worker_run
    for name in (
        "config.json",
        "metrics.csv",
        "timings.csv",
        "summary.json",
        "model.pt",
        "curves.png",
        "confusion.png",
    ):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"

    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["num_workers"] == 2 and config["class_names"] == ["blue", "cyan", "gray", "green", "red"]
    assert len(config["git_commit"] or "0" * 40) == 40

    (row,) = _rows(run_dir / "metrics.csv")
    assert int(row["epoch"]) == 1 and {"val_top5", "val_loss", "lr", "train_loss"} <= set(row)
    (timing,) = _rows(run_dir / "timings.csv")
    assert 0.0 <= float(timing["data_wait_frac"]) <= 1.0 and float(timing["images_per_s"]) > 0

    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert summary["world_size"] == 2 and summary["device"] == "cpu" and summary["num_classes"] == 5
    assert summary["epochs"] == 1 and summary["val_images"] == len(tree.val) > 0
    assert 0.0 <= summary["val_acc"] <= summary["val_top5"] <= 1.0
    assert summary["train_images_per_s"] > 0 and 0 < summary["startup_s"] < summary["wall_s"]
    assert set(summary["per_class_val_acc"]) == set(config["class_names"])

    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert model["class_names"] == config["class_names"] and model["small_stem"] is True
    assert model["state_dict"]["fc.weight"].shape == (5, 512)
    assert model["state_dict"]["conv1.weight"].shape == (64, 3, 3, 3)  # small-image stem at 40 px


def test_image_size_is_trained_recorded_and_followed_by_inference(two_worker_run):
    """--image-size 40 on 32 px files: the batches, config.json, model.pt and jobs.predict agree."""
    import numpy as np

    from augment.decode import decode_image
    from training.inference import Predictor, load_model_file

    run_dir, _, tree, _ = two_worker_run
    config = json.loads((run_dir / "config.json").read_text())
    assert config["image_size"] == 40 and config["train_image_sizes"] == [40]
    assert config["preset"]["train"][0] == {"random_crop": {"size": 40, "padding": 5}}
    assert [int(r["image_size"]) for r in _rows(run_dir / "metrics.csv")] == [40]  # what the ranks trained on
    info = load_model_file(str(run_dir / "model.pt"))
    assert info["image_size"] == 40 and info["eval_transform"]["ops"] == [{"center_crop": {"size": 40}}]
    predictor, seen = Predictor(info), []
    predictor.model.conv1.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    images = np.empty(2, dtype=object)
    images[:] = [decode_image(open(p, "rb").read()) for p in tree.val.paths[:2]]
    predictor({"image": images, "label": np.zeros(2, np.int64), "path": np.array(["a", "b"], dtype=object)})
    assert seen == [(2, 3, 40, 40)]  # jobs.predict and jobs.evaluate score at the size model.pt names


def test_the_bar_counts_both_ranks_and_the_driver_prints_the_epoch_line(two_worker_run):
    _, summary, _, (screen, lines) = two_worker_run
    frames = bar_frames(screen)
    (cov,) = summary["coverage"]
    assert frames and max(n for _, n, _ in frames) == sum(cov["per_rank"]) > max(cov["per_rank"])
    assert sum(bool(re.match(r"epoch +1/1  loss", line)) for line in lines) == 1  # from the driver, once


def test_ranks_start_from_identical_weights_and_see_different_images(two_worker_run):
    _, summary, tree, _ = two_worker_run
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["init_digest"] == ranks[1]["init_digest"]
    assert ranks[0]["node_id"] != ranks[1]["node_id"], "CPU workers should spread over the 2 nodes"
    (cov,) = summary["coverage"]
    # streaming_split(equal=True) may drop up to world_size-1 rows so both ranks take the same steps
    assert cov["expected"] == len(tree.train) and cov["duplicated"] == 0 and cov["missing"] <= 1
    assert cov["per_rank"][0] == cov["per_rank"][1] > 0
    if cov["seen"] == len(tree.train):
        assert cov["exactly_once"], "the ranks' images overlap or miss some"


def test_validation_scores_every_image_once(two_worker_run):
    """val is split across ranks without dropping rows: the accuracy is k / len(val)."""
    _, summary, tree, _ = two_worker_run
    n = len(tree.val)
    assert any(abs(summary["val_acc"] - k / n) < 1e-5 for k in range(n + 1))
    assert _split_coordinators(), "two workers split their datasets through coordinator actors"


def test_deterministic_runs_repeat_and_resume_continues(ray_cluster, data, tmp_path):
    # the cifar preset plus two of Kornia's ops by name: they run in Ray Data's tasks and stay reproducible
    preset = tmp_path / "cifar-kornia.yaml"
    preset.write_text(
        "train:\n  - random_crop: {size: 32, padding: 4}\n  - horizontal_flip: {p: 0.5}\n"
        "  - kornia.RandomGaussianBlur: {kernel_size: [3, 3], sigma: [0.1, 1.5], p: 0.5}\n"
        "  - kornia.RandomAffine: {degrees: 10, translate: [0.1, 0.1], p: 0.5}\n"
        "eval:\n  - center_crop: {size: 32}\n"
    )
    common = dict(
        data=str(data),
        epochs=2,
        batch_size=16,
        num_workers=1,
        deterministic=True,
        storage_path=str(tmp_path),
        val_fraction=0.25,
        preset=str(preset),
        progressive_resize="24",  # epoch 1 at 24 px, epoch 2 at 32: the resumed run must pick up the size
    )
    coordinators_before = _split_coordinators()
    _run(name="a", **common)
    assert [int(r["image_size"]) for r in _rows(tmp_path / "a" / "metrics.csv")] == [24, 32]
    # one worker takes each dataset whole, so no split coordinator starts before its first step
    assert _split_coordinators() == coordinators_before
    _run(name="b", **common)
    a, b = (tmp_path / "a" / "metrics.csv").read_text(), (tmp_path / "b" / "metrics.csv").read_text()
    assert a == b, "same seed and world size must give identical metrics"
    train_ops = json.loads((tmp_path / "a" / "config.json").read_text())["preset"]["train"]
    assert [next(iter(op)) for op in train_ops][2:] == ["kornia.RandomGaussianBlur", "kornia.RandomAffine"]

    first, _ = _run(name="c", stop_after=1, **common)
    assert first["epochs"] == 1
    second, _ = _run(name="c", **common)  # same name: resumes at epoch 2, not from scratch
    assert second["resumed_at_epochs"] == [2]
    rows = _rows(tmp_path / "c" / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert (tmp_path / "c" / "metrics.csv").read_text() == a
    assert second["val_acc"] == json.loads((tmp_path / "a" / "summary.json").read_text())["val_acc"]

    fresh, _ = _run(name="c", fresh=True, stop_after=1, **common)
    assert [r["epoch"] for r in _rows(tmp_path / "c" / "metrics.csv")] == ["1"] and fresh["epochs"] == 1


def test_init_weights_from_a_torchvision_state_dict(ray_cluster, data, tmp_path):
    torch.manual_seed(123)
    source = torchvision.models.resnet18(weights=None)  # 1000 classes, ImageNet stem
    torch.save(source.state_dict(), tmp_path / "r18.pt")
    _run(
        data=str(data),
        epochs=1,
        batch_size=16,
        num_workers=1,
        storage_path=str(tmp_path),
        name="ft",
        init_weights=str(tmp_path / "r18.pt"),
        small_stem="off",
        lr=1e-6,
        val_fraction=0.25,
    )
    model = torch.load(tmp_path / "ft" / "model.pt", weights_only=True)["state_dict"]
    assert model["fc.weight"].shape == (5, 512)
    # a tiny lr barely moves the loaded weights away from the source's
    assert torch.allclose(model["layer3.0.conv1.weight"], source.state_dict()["layer3.0.conv1.weight"], atol=1e-4)
    assert torch.allclose(model["conv1.weight"], source.state_dict()["conv1.weight"], atol=1e-4)


def test_missing_init_weights_is_a_config_error(data, tmp_path):
    with pytest.raises(ConfigError, match="--init-weights .*no such file"):
        job.prepare(TrainConfig(data=str(data), init_weights=str(tmp_path / "nope.pt"), storage_path=str(tmp_path)))


def test_asking_for_gpus_on_a_cpu_cluster_is_a_config_error(ray_cluster):
    capacity = job.cluster_capacity()
    assert (capacity.cpus, capacity.gpus, capacity.hosts) == (4, 0, 1)  # 2 nodes, one machine
    with pytest.raises(ConfigError, match="no GPUs"):
        job.plan_resources(TrainConfig(device="cuda"), capacity)


def test_cpu_plan_leaves_cpus_for_ray_data():
    one_host = job.Capacity(cpus=2, gpus=0, hosts=1, autoscaling=False)
    plan = job.plan_resources(TrainConfig(), one_host)
    assert (plan.num_workers, plan.cpus_per_worker, plan.threads_per_worker) == (1, 1, 2)
    with pytest.raises(ConfigError, match="needs 8 CPUs but the cluster has at most 4"):
        job.plan_resources(
            TrainConfig(num_workers=4, cpus_per_worker=2), job.Capacity(cpus=4, gpus=0, hosts=1, autoscaling=False)
        )


def test_fp16_autocast_on_cpu_is_a_config_error(data, tmp_path):
    with pytest.raises(ConfigError, match="--amp fp16 on CPU.*--amp bf16"):  # before Ray starts
        job.prepare(TrainConfig(data=str(data), device="cpu", amp="fp16", storage_path=str(tmp_path)))
    with pytest.raises(ConfigError, match="--amp fp16 on CPU"):  # --device auto on a cluster without GPUs
        job.plan_resources(TrainConfig(amp="fp16"), job.Capacity(cpus=2, gpus=0, hosts=1, autoscaling=False))
    assert job.plan_resources(TrainConfig(amp="fp16"), job.Capacity(cpus=8, gpus=1, hosts=1, autoscaling=False)).use_gpu


def test_amp_bf16_trains_in_bfloat16_on_cpu():
    from augment.ops import Normalize
    from training.loop import build_optimizer, build_scheduler, train_epoch
    from training.model import resnet18

    torch.manual_seed(0)
    cfg = TrainConfig(amp="bf16", batch_size=8)
    model = resnet18(3, small_stem=True)
    dtypes = []
    model.fc.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    optimizer = build_optimizer(cfg, model)
    before = model.fc.weight.detach().clone()
    batches = [
        {
            "image": torch.randint(0, 256, (8, 32, 32, 3), dtype=torch.uint8),
            "label": torch.arange(8) % 3,
            "key": torch.arange(8) + 8 * i,
        }
        for i in range(2)
    ]
    stats = train_epoch(
        model,
        batches,
        optimizer,
        build_scheduler(cfg, optimizer, 2),
        torch.amp.GradScaler("cpu", enabled=False),
        Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
        cfg,
        torch.device("cpu"),
        epoch=0,
        rank=0,
    )
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # the forward ran under bf16 autocast
    assert model.fc.weight.dtype == torch.float32 and not torch.equal(
        model.fc.weight, before
    )  # fp32 master weights, updated
    assert stats["train_images"] == 16 and math.isfinite(stats["train_loss"])


def test_weight_decay_skips_batchnorm_and_biases():
    from training.loop import param_groups
    from training.model import resnet18

    model = resnet18(10, small_stem=True)
    decay, no_decay = param_groups(model, 5e-4)
    assert decay["weight_decay"] == 5e-4 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(
        "bn" in names[id(p)] or "downsample.1" in names[id(p)] or names[id(p)].endswith("bias")
        for p in no_decay["params"]
    )
    assert all(p.ndim > 1 for p in decay["params"])


def test_a_cluster_the_job_owns_runs_ray_train_without_the_placement_group_cleaner(tmp_path):
    import ray.train
    from ray.train.torch import TorchTrainer

    kwargs = {
        "scaling_config": ray.train.ScalingConfig(num_workers=1),
        "run_config": ray.train.RunConfig(name="owned", storage_path=str(tmp_path)),
    }
    plain = {type(c).__name__ for c in TorchTrainer(lambda: None, **kwargs)._create_default_callbacks()}
    owned = {type(c).__name__ for c in job.OwnClusterTorchTrainer(lambda: None, **kwargs)._create_default_callbacks()}
    assert "PlacementGroupCleanerCallback" in plain  # else the filter below has nothing to do on this Ray
    assert owned == plain - {"PlacementGroupCleanerCallback"}
