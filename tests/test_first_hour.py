"""What a newcomer meets with a folder of their own photos (issue: "the first hour"): a preset
that fits the data, and the one-line answers that come before Ray starts."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jobs import preview
from tests.conftest import write_tree
from training.config import TrainConfig
from training.driver.inputs import auto_preset, check_inputs, preset_name

REPO = Path(__file__).resolve().parents[1]


def _photos(root, size=(500, 375), n=6):
    rng = np.random.default_rng(0)
    for cls in ("brick", "moss"):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(img).save(root / cls / f"{i}.jpg", quality=90)
    return root


@pytest.mark.parametrize(
    "make, expected, why",
    [
        (lambda p: _photos(p, (500, 375)), "imagenet", "photos, typically 500 x 375 px"),
        (lambda p: _photos(p, (143, 127)), "imagenet", "photos, typically 143 x 127 px"),
        (lambda p: write_tree(p, {"a": 6, "b": 6}, size=(32, 32)), "cifar", "thumbnails, typically 32 x 32 px"),
        (lambda p: write_tree(p, {"a": 6, "b": 6}, size=(64, 48)), "cifar", "thumbnails, typically 48 x 64 px"),
    ],
    ids=["photos", "small-photos", "cifar-size", "64px"],
)
def test_preset_auto_takes_the_imagenet_recipe_for_photos_and_the_cifar_one_for_thumbnails(
    make, expected, why, tmp_path
):
    root = make(tmp_path / "data")
    cfg, tree = check_inputs(TrainConfig(data=str(root), storage_path=str(tmp_path / "runs")))
    assert cfg.preset == "auto" and preset_name(cfg, tree) == expected and auto_preset(tree)[1] == why
    assert f"typically {tree.typical_size[0]} x {tree.typical_size[1]} px)" in tree.describe()
    explicit, _ = check_inputs(TrainConfig(data=str(root), preset="cifar", storage_path=str(tmp_path / "runs")))
    assert preset_name(explicit, tree) == "cifar"  # a preset named is a preset used


def test_a_tree_whose_headers_cannot_be_read_falls_back_to_its_file_sizes(tmp_path):
    root = _photos(tmp_path / "data", (400, 300))
    for f in root.rglob("*.jpg"):  # not images at all: no header, large files
        f.write_bytes(b"x" * 40_000)
    cfg, tree = check_inputs(TrainConfig(data=str(root), storage_path=str(tmp_path / "runs")))
    assert tree.typical_size is None and auto_preset(tree) == ("imagenet", "files of 39 KB on average")


def test_preview_shows_the_preset_training_would_pick(tmp_path, capsys):
    root = _photos(tmp_path / "data", (300, 200), n=2)
    assert preview.main(["--data", str(root), "--out", str(tmp_path / "p.png"), "--augmentations", "1"]) == 0
    out = capsys.readouterr().out
    assert "preset 'imagenet' (--preset auto: photos, typically 300 x 200 px)" in out
    assert Image.open(io.BytesIO((tmp_path / "p.png").read_bytes())).size[0] > 0


def _finished_run(runs, data_root: str, classes, **settings) -> bytes:
    """A run directory as jobs.train leaves it after two epochs: its marker, config.json and metrics.csv."""
    import json

    from training import storage

    run = runs / "mine"
    run.mkdir(parents=True)
    storage.mark_run_dir(str(run), "mine")
    config = {
        "config": TrainConfig(**settings).to_dict(),
        "preset": {"name": settings.get("preset", "cifar")},
        "class_names": list(classes),
        "data_root": data_root,
    }
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.csv").write_text("epoch,val_acc\n1,0.5\n2,0.6\n")
    return (run / "config.json").read_bytes()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"data": "other"}, r"\(--data \S+/data there, \S+/other here\)"),
        ({"lr": 0.5}, r"\(--lr 0.08 there, 0.5 here\)"),
        ({"preset": "imagenet"}, r"\(--preset cifar there, imagenet here\)"),
        ({"batch_size": 32, "seed": 3}, r"\(--batch-size 64 there, 32 here; --seed 0 there, 3 here\)"),
        ({"epochs": 1}, r"--epochs 1: --name mine has trained 2 epochs already; give --epochs 2 or more"),
    ],
    ids=["data", "lr", "preset", "two", "fewer-epochs"],
)
def test_a_rerun_of_a_name_that_holds_another_run_stops_before_ray_and_changes_nothing(
    change, message, tmp_path, capsys, monkeypatch
):
    import re
    import time

    import ray

    from jobs import train as train_job

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    root = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    write_tree(tmp_path / "other", {"a": 4, "b": 4}, seed=1)
    before = _finished_run(tmp_path / "runs", str(root), ("a", "b"), data=str(root), preset="cifar")
    argv = ["--storage-path", str(tmp_path / "runs"), "--name", "mine", "--preset", "cifar", "--data", str(root)]
    for key, value in change.items():
        argv += [f"--{key.replace('_', '-')}", str(tmp_path / value if key == "data" else value)]
    t0 = time.monotonic()
    assert train_job.main(argv) == 2
    assert time.monotonic() - t0 < 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert err.rstrip().endswith("--fresh to start it over, or another --name") or "fewer" not in message
    assert (tmp_path / "runs" / "mine" / "config.json").read_bytes() == before  # the records stay the run's


def test_a_rerun_with_more_epochs_or_other_resources_goes_on(tmp_path, monkeypatch):
    root = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    _finished_run(tmp_path / "runs", str(root), ("a", "b"), data=str(root), preset="cifar")
    monkeypatch.chdir(tmp_path)  # the same folder, named from another place: the same data
    check_inputs(TrainConfig(data="./data", preset="cifar", storage_path=str(tmp_path / "runs"), name="mine"))
    for change in ({"epochs": 40}, {"num_workers": 2, "amp": "bf16", "verbose": True}, {"fresh": True, "lr": 1.0}):
        cfg = TrainConfig(data=str(root), preset="cifar", storage_path=str(tmp_path / "runs"), name="mine", **change)
        check_inputs(cfg)  # no ConfigError


@pytest.mark.parametrize("schedule", ["cosine", "onecycle"])
def test_a_run_resumed_with_more_epochs_follows_the_longer_schedule_from_the_step_it_reached(schedule):
    import torch

    from bench.loop_checks import cpu_learner

    def learner(epochs):
        cfg = TrainConfig(epochs=epochs, schedule=schedule, warmup_epochs=1, lr=0.4, batch_size=64)
        return cpu_learner(cfg, torch.nn.Linear(2, 2), steps_per_epoch=5)

    short = learner(2)
    for _ in range(7):  # 1.4 epochs of the 2-epoch run
        short.optimizer.step()
        short.scheduler.step()
    state = short.state_dict()
    resumed, reference = learner(4), learner(4)
    resumed.load_state_dict(state, schedule_epochs=2)  # the checkpoint's records keep the --epochs it was built for
    for _ in range(7):
        reference.optimizer.step()
        reference.scheduler.step()
    assert resumed.scheduler.last_epoch == reference.scheduler.last_epoch == 7
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(reference.optimizer.param_groups[0]["lr"])
    for _ in range(12):  # and on to the end of the 4-epoch schedule, which the 2-epoch one could not reach
        for x in (resumed, reference):
            x.optimizer.step()
            x.scheduler.step()
        assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(reference.optimizer.param_groups[0]["lr"])
    same = learner(2)
    same.load_state_dict(state)  # the same --epochs: the schedule as saved
    assert same.scheduler.state_dict() == short.scheduler.state_dict()


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--progressive-resize", "40", "--image-size", "32"],
            "error: --progressive-resize 40: starts at 40 px, not below the training size 32 px; give a smaller FROM "
            "or a larger --image-size",
        ),
        (["--progressive-resize", "32"], "error: --progressive-resize 32: starts at 32 px, not below the training"),
        (["--amp", "fp16"], "error: --amp fp16 on CPU: torch's float16 kernels there are many times slower"),
        (["--preset", "nope"], "error: unknown preset 'nope'"),
    ],
    ids=["resize-above-size", "resize-at-preset-size", "fp16-without-gpu", "preset-name"],
)
def test_a_mistake_is_one_line_within_two_seconds_before_ray_and_leaves_nothing(
    argv, line, tmp_path, capsys, monkeypatch
):
    import time

    import ray

    from jobs import train as train_job
    from training.driver import inputs

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    monkeypatch.setattr(inputs, "local_gpus", lambda: 0)  # this machine as CI's: no GPU
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    root = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    t0 = time.monotonic()
    code = train_job.main([*argv, "--data", str(root), "--storage-path", str(tmp_path / "runs"), "--name", "x"])
    assert code == 2 and time.monotonic() - t0 < 2
    out, err = capsys.readouterr()
    assert err.startswith(line) and err.count("\n") == 1 and out == "", (out, err)  # before the config dump
    assert not (tmp_path / "runs").exists()


def test_an_epoch_of_too_few_steps_is_warned_of_with_a_batch_size_that_gives_enough(tmp_path):
    from training.driver.inputs import few_steps_warning

    root = write_tree(tmp_path / "data", {"a": 45, "b": 45})
    cfg, tree = check_inputs(TrainConfig(data=str(root), val_fraction=0.0, storage_path=str(tmp_path / "runs")))
    assert len(tree.train) == 90
    assert "are 1 step(s) an epoch" in few_steps_warning(cfg, tree)  # the default 64
    big = TrainConfig(data=str(root), batch_size=256)
    assert few_steps_warning(big, tree) == (
        "warning: 90 training images at --batch-size 256 are 1 step(s) an epoch, too few for batch norm and the "
        "warm-up; --batch-size 16 gives 5"
    )
    assert few_steps_warning(TrainConfig(batch_size=16), tree) is None
    # 24 images at --batch-size 8: 3 steps, and no batch size of 8 or more gives 4; it used to say "--batch-size 8"
    small = write_tree(tmp_path / "small", {"a": 12, "b": 12})
    cfg, tree = check_inputs(TrainConfig(data=str(small), val_fraction=0.0, batch_size=8))
    line = few_steps_warning(cfg, tree)
    assert (
        line.startswith("warning: 24 training images at --batch-size 8 are 3 step(s) an epoch")
        and "--batch-size 8 " not in line[50:]
    )
    assert line.endswith("more training images would help")


def _guide_block_after(heading: str) -> list[str]:
    """The jobs.train commands of the first ```bash block after HEADING in docs/guide.md, comments dropped."""
    text = (REPO / "docs" / "guide.md").read_text()
    block = text.split(heading, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if "-m jobs.train" in line]


def test_the_guides_config_examples_run_in_order_and_the_second_goes_on_with_the_first(ray_cluster, tmp_path, capsys):
    """docs/guide.md, "Configuration files": the second command continues the first run, its records
    kept. Run as printed with the tree in place of ~/cifar10, and scaled down to fit a test in a
    copy of the config file (30 epochs -> 1, batch 64, torchvision's stem) and --epochs 40 -> 2."""
    import csv
    import json
    import shlex

    import yaml

    from jobs import train as train_job
    from tests.conftest import TEST_STEM, split_coordinators

    first, second = _guide_block_after("### Configuration files")
    config = yaml.safe_load((REPO / "configs" / "cifar-local.yaml").read_text())
    assert config["epochs"] == 30 and "--epochs 40" in second  # what the guide says of them
    config |= {"epochs": 1, "batch_size": 64, "small_stem": TEST_STEM, "storage_path": str(tmp_path / "runs")}
    (tmp_path / "cifar-local.yaml").write_text(yaml.safe_dump(config))
    data = write_tree(tmp_path / "cifar10", {"cat": 40, "dog": 40, "eel": 40})

    def argv(command):
        words = shlex.split(command.replace("~/cifar10", str(data)).replace("--epochs 40", "--epochs 2"))
        words = [str(tmp_path / "cifar-local.yaml") if w == "configs/cifar-local.yaml" else w for w in words]
        assert words[:3] == [".venv/bin/python", "-m", "jobs.train"], words
        return words[3:] + ["--quiet"]

    coordinators = split_coordinators()
    assert train_job.main(argv(first)) == 0, capsys.readouterr().err[-3000:]
    run = tmp_path / "runs" / "cifar-local"
    config_after_first = (run / "config.json").read_bytes()
    rows_after_first = list(csv.DictReader(open(run / "metrics.csv")))
    assert split_coordinators() == coordinators  # one worker takes each dataset whole: no split coordinator
    assert train_job.main(argv(second)) == 0, capsys.readouterr().err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_at_epochs"] == [2] and summary["epochs"] == 2
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [r["epoch"] for r in rows] == ["1", "2"] and rows[:1] == rows_after_first  # the first run's kept
    before, after = json.loads(config_after_first), json.loads((run / "config.json").read_text())
    assert before["class_names"] == after["class_names"] == ["cat", "dog", "eel"]
    assert after["config"]["epochs"] == 2 and before["config"]["data"] == after["config"]["data"] == str(data)
