"""jobs.tune / training.tune (training/sweep/tuner.py): the search-space syntax and its refusals (no Ray),
and one sweep on the shared test cluster: 4 trials of up to 3 epochs, 2 at a time, under ASHA."""

from __future__ import annotations

import csv
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import TEST_STEM, write_tree
from training.config import ConfigError, TrainConfig
from training.sweep.space import check_space, parse_dimension, read_space


def _space(tmp_path: Path, text: str) -> str:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return str(path)


def test_the_space_syntax_gives_tunes_own_objects(tmp_path):
    from ray.tune.search.sample import Categorical, Float, Integer

    dims = read_space(
        _space(
            tmp_path,
            "lr: loguniform(1e-4, 1e-1)\nmomentum: uniform(0.8, 0.99)\nwarmup-epochs: randint(0, 3)\n"
            "weight_decay: choice([0, 1e-4])\nmodel: grid([resnet18, 'mobilenet_v3_small'])\nepochs: 2\n",
        )
    )
    domains = {d.key: d.tune_domain() for d in dims}
    assert isinstance(domains["lr"], Float) and (domains["lr"].lower, domains["lr"].upper) == (1e-4, 1e-1)
    assert isinstance(domains["momentum"], Float) and isinstance(domains["warmup_epochs"], Integer)
    assert isinstance(domains["weight_decay"], Categorical) and domains["weight_decay"].categories == [0, 1e-4]
    assert domains["model"] == {"grid_search": ["resnet18", "mobilenet_v3_small"]}
    assert domains["epochs"] == 2 and [d.swept for d in dims] == [True] * 5 + [False]


@pytest.mark.parametrize(
    "text, words",
    [
        ("lrr: choice([1])\n", "unknown setting 'lrr'; valid: "),
        ("name: choice([a, b])\n", "name is set by the sweep for each trial"),
        ("lr: logunifrm(1, 2)\n", "lr: unknown distribution logunifrm(); use one of loguniform()"),
        ("lr: loguniform(0, 1)\n", "both bounds must be above 0"),
        ("lr: uniform(2, 1)\n", "low must be below high"),
        ("lr: uniform(1)\n", "uniform() takes two numbers"),
        ("lr: choice(0.1, 0.2)\n", "choice() takes a list of values"),
        ("lr: choice([0.1, __import__('os')])\n", "is not a number or a plain name; quote it"),
        ("epochs: 3\n", "nothing to sweep"),
    ],
)
def test_a_bad_space_is_one_line_naming_the_fix(tmp_path, text, words):
    with pytest.raises(ConfigError) as err:
        read_space(_space(tmp_path, text))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_each_value_is_checked_as_its_flag_would_be():
    from training.driver.api import as_config

    with pytest.raises(ConfigError, match=r"--space: batch_size = 'big': argument --batch-size: invalid int"):
        check_space([parse_dimension("batch_size", "choice([32, big])", "--space f")], {}, as_config)
    with pytest.raises(ConfigError, match=r"--space: optimizer = 'adamw2'"):
        check_space([parse_dimension("optimizer", "grid([sgd, adamw2])", "--space f")], {}, as_config)


def test_the_cli_refuses_before_ray(tmp_path, capsys):
    from jobs import tune as tune_job

    data = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    args = ["--data", str(data), "--storage-path", str(tmp_path / "runs"), "--name", "s"]
    space = _space(tmp_path, "lr: choice([0.1, 0.01])\n")
    try:
        import optuna  # noqa: F401

        pytest.skip("Optuna is installed here")
    except ImportError:
        pass
    assert tune_job.main([*args, "--space", space, "--search", "optuna"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --search optuna: Optuna is not installed; pip install optuna, or use --search random"
    )
    assert tune_job.main([*args, "--space", str(tmp_path / "nowhere.yaml")]) == 2
    assert "--space" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_sweep_of_four_trials_under_asha_interrupted_and_continued(ray_cluster, tmp_path):
    """4 trials of up to 3 epochs, 2 at a time, ASHA with grace 1; Ctrl-C (Tune's SIGUSR1, the same
    handler) once the first trial has ended; the same call again continues without running it again."""
    import ray

    from training import JobError, tune
    from training.predict.inference import load_model_file
    from training.sweep.tuner import TRIAL_DRIVER_CPUS, SweepOptions

    data = write_tree(tmp_path / "data", {"a": 8, "b": 8})
    space = _space(tmp_path, "lr: grid([0.3, 0.03, 0.003, 0.0003])\n")  # 4 trials with known values
    base = {"data": str(data), "epochs": 3, "batch_size": 8, "small_stem": TEST_STEM}
    base |= {"storage_path": str(tmp_path / "runs"), "name": "sw"}
    options = SweepOptions(trials=1, max_concurrent=2, grace_epochs=1)
    lines, ended = [], []

    def log(line):
        lines.append(line)
        if (" finished: " in line or " stopped early after epoch" in line) and not ended:
            ended.append(line.split(" ")[0])
            os.kill(os.getpid(), signal.SIGUSR1)  # Tune's interrupt, as Ctrl-C

    with pytest.raises(JobError) as stopped:
        tune(base, space, options, log=log)
    assert stopped.value.exit_code == 130 and "the same command continues the sweep" in str(stopped.value)
    sweep_dir = tmp_path / "runs" / "sw"
    assert sum(" started: lr=" in line for line in lines) >= 2, lines
    with open(sweep_dir / "trials.csv") as f:
        first = {r["trial"]: r for r in csv.DictReader(f)}
    assert first[ended[0]]["status"] in ("finished", "stopped early") and "interrupted" in [
        r["status"] for r in first.values()
    ], first
    kept = sweep_dir / ended[0] / "metrics.csv"
    kept_before = (kept.read_bytes(), kept.stat().st_mtime_ns)

    sweep = tune(base, space, options, log=lines.append)
    assert "sweep sw: continuing from " + str(sweep_dir / "tune") + " (finished trials are kept)" in lines
    assert (kept.read_bytes(), kept.stat().st_mtime_ns) == kept_before, "the ended trial ran again"
    with open(sweep_dir / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(float(r["lr"]) for r in rows) == [0.0003, 0.003, 0.03, 0.3], rows
    for row in rows:
        assert row["status"] in ("finished", "stopped early"), row
        assert 1 <= int(row["epochs"]) <= 3 and (row["stopped_early"] == "True") == (int(row["epochs"]) < 3)
        assert 0 <= float(row["best_val_acc"]) <= 1 and Path(row["run_dir"], "metrics.csv").is_file()
    assert (sweep_dir / "trials.png").stat().st_size > 0
    share = ray.cluster_resources()["CPU"] / 2  # each trial's plan fits its half: two never crowd the cluster
    for row in rows:
        plan = json.loads(Path(row["run_dir"], "config.json").read_text())["plan"]
        reserved = plan["num_workers"] * plan["cpus_per_worker"] + plan["augment_cpus"] + TRIAL_DRIVER_CPUS
        assert reserved <= share, plan
    best = sweep.best
    assert best is not None and float(best["best_val_acc"]) == max(float(r["best_val_acc"]) for r in rows)
    assert load_model_file(str(Path(best["run_dir"]) / "model.pt")) is not None
    assert sweep.best_command.startswith("python -m jobs.train ") and "--lr " in sweep.best_command
    assert sweep.best_command.endswith("--name sw-best")
    deadline = time.monotonic() + 20  # a stopped trial's actors go at once; Ray's tables lag a little
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] - 0.01:
        assert time.monotonic() < deadline, "a trial still holds CPUs after the sweep"
        time.sleep(0.5)


def test_each_trials_row_says_how_it_ended(tmp_path):
    import types

    import pandas as pd

    from training.config import TrainConfig
    from training.sweep.report import trial_row

    cfg = TrainConfig(epochs=3, storage_path=str(tmp_path), name="sw")

    def result(trial, epochs, done=True, error=None):
        frame = pd.DataFrame({"epoch": list(range(1, epochs + 1)), "val_acc": [0.5 + e / 10 for e in range(epochs)]})
        metrics = {"done": done, "time_total_s": 12.34}
        return types.SimpleNamespace(
            path=f"{tmp_path}/sw/tune/{trial}",
            metrics_dataframe=frame,
            config={"lr": 0.1},
            metrics=metrics,
            error=error,
        )

    failed = RuntimeError("Traceback ...\ntraining.sweep.TrialFailed: error: 3 unreadable image(s), e.g. a/1.png")
    rows = [
        trial_row(result("t0", 3), ["lr"], cfg, "val_acc", "max"),
        trial_row(result("t1", 1), ["lr"], cfg, "val_acc", "max"),
        trial_row(result("t2", 2, done=False), ["lr"], cfg, "val_acc", "max"),
        trial_row(result("t3", 1, done=False, error=failed), ["lr"], cfg, "val_acc", "max"),
    ]
    assert [r["status"] for r in rows] == ["finished", "stopped early", "interrupted", "failed"]
    assert [r["stopped_early"] for r in rows] == [False, True, False, False]
    assert rows[0]["best_val_acc"] == 0.7 and rows[0]["epochs"] == 3 and rows[0]["wall_s"] == 12.3
    assert rows[3]["error"] == "error: 3 unreadable image(s), e.g. a/1.png"
    assert rows[1]["trial"] == "trial-t1" and rows[1]["run_dir"] == f"{tmp_path}/sw/trial-t1"


def test_a_trials_share_of_the_cluster_and_the_refusal_when_one_cannot_fit():
    from training.driver.planning import Capacity, plan_resources, share_of

    cluster = Capacity(cpus=4, gpus=2, hosts=2, nodes=((2.0, 1.0), (2.0, 1.0)))
    half = share_of(cluster, 2)
    assert (half.cpus, half.gpus, half.nodes) == (2, 1, ((1.0, 0.5), (1.0, 0.5)))
    assert share_of(cluster, 2, cpus=1).cpus == 1
    plan = plan_resources(TrainConfig(device="cpu"), share_of(cluster, 2))
    assert plan.num_workers * plan.cpus_per_worker + plan.augment_cpus <= 2
    for parts, cpus, gpus in ((8, 0, 0), (1, 6, 0), (1, 0, 3)):
        with pytest.raises(ConfigError, match=r"one trial's share \(.*\) does not fit the cluster's 4 CPU and 2 GPU"):
            share_of(cluster, parts, cpus, gpus)
