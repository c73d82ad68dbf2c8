"""jobs.tune / training.tune (training/sweep/tuner.py): the search-space syntax and its refusals (no Ray),
and one sweep on the shared test cluster: 4 trials of up to 3 epochs, 2 at a time, under ASHA."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import write_tree
from training.config import ConfigError, TrainConfig
from training.storage import RUN_MARKER
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


def test_trial_gpus_and_cpus_beyond_this_machine_are_refused_before_ray(tmp_path, capsys, monkeypatch):
    from jobs import tune as tune_job

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this machine shows no GPU, whatever it has
    data = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    args = ["--data", str(data), "--storage-path", str(tmp_path / "runs"), "--name", "s", "--device", "cpu"]
    args += ["--space", _space(tmp_path, "lr: choice([0.1, 0.01])\n")]
    assert tune_job.main([*args, "--trial-gpus", "0.5"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --trial-gpus 0.5: a trial's train workers take whole GPUs; give 1, 2, ..., or lower --max-concurrent "
        "so that each trial gets one"
    )
    assert tune_job.main([*args, "--trial-gpus", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --trial-gpus 1: this machine has 0 GPU(s) that CUDA shows, and a sweep without RAY_ADDRESS starts "
        "its cluster here; give 0 or less (0: an equal share), or set RAY_ADDRESS to join a bigger cluster"
    )
    assert tune_job.main([*args, "--trial-cpus", str(os.cpu_count() + 1)]) == 2
    assert f"error: --trial-cpus {os.cpu_count() + 1}: this machine has " in capsys.readouterr().err
    assert tune_job.main([*args, "--trial-cpus", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --trial-cpus and --trial-gpus must be 0 (an equal share) or more"
    assert not (tmp_path / "runs").exists()


def test_a_second_sweep_of_the_same_name_is_refused_while_the_first_holds_it(tmp_path, capsys):
    import subprocess
    import sys

    from jobs import tune as tune_job

    data = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    sweep_dir = tmp_path / "runs" / "s"
    holder = subprocess.Popen(  # a first jobs.tune, as far as the lease goes
        [
            sys.executable,
            "-c",
            "import sys; from training.driver import lease; "
            f"lease.acquire({str(sweep_dir)!r}, 's', job='jobs.tune'); print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        args = ["--data", str(data), "--storage-path", str(tmp_path / "runs"), "--name", "s"]
        assert tune_job.main([*args, "--space", _space(tmp_path, "lr: choice([0.1, 0.01])\n")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --name s: {sweep_dir} is in use by a running jobs.tune (pid {holder.pid} on ")
        assert err.endswith("wait for it to end or stop it, or give another --name") and "\n" not in err
        assert sorted(os.listdir(sweep_dir)) == sorted([".lease", RUN_MARKER]), "the refused sweep wrote there"
    finally:
        holder.communicate("")


POOR, FAILS = 1e-6, 1e30  # a learning rate that learns nothing in 3 epochs; one whose loss turns inf at once


def test_a_sweep_of_four_trials_under_asha_interrupted_and_continued(ray_cluster, tmp_path, capfd):
    """4 trials of up to 3 epochs, 2 at a time, under ASHA (grace 1 epoch, reduction factor 2): lr 3
    and 2 learn the two colours at once, 1e-6 cannot and starts third, once a trial has ended (and so
    reported its first epoch): ASHA stops it at its first epoch, whatever the timing. 1e30 fails (its
    loss turns non-finite): that costs the trial, not the sweep. SIGTERM once the poor trial is
    stopped, which the sweep takes as Ctrl-C (Tune's SIGINT handler; Ray's own dumped the stack and
    aborted), exit 143; the same call again continues without running the
    ended trials again, its event lines going where the first call's went."""
    import ray

    from training import JobError, tune
    from training.predict.inference import load_model_file
    from training.sweep.tuner import TRIAL_DRIVER_CPUS, SweepOptions

    data = write_tree(tmp_path / "data", {"a": 16, "b": 16})
    space = _space(tmp_path, f"lr: grid([3.0, 2.0, {POOR}, {FAILS}])\n")  # Tune starts them in this order
    base = {"data": str(data), "epochs": 3, "batch_size": 8, "model": "tests.user_model:build", "warmup_epochs": 0}
    base |= {"storage_path": str(tmp_path / "runs"), "name": "sw"}
    options = SweepOptions(trials=1, max_concurrent=2, grace_epochs=1)
    lines, lr_of = [], {}
    began_ms = time.time() * 1000
    before = signal.getsignal(signal.SIGTERM)

    def log(line):
        lines.append(line)
        trial = line.split(" ")[0]
        if " started: lr=" in line:
            lr_of[trial] = float(line.split("lr=")[1])
        if " stopped early after epoch" in line and lr_of.get(trial) == POOR:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends: Ctrl-C's way from here

    try:
        tune(base, space, options, log=log)
        pytest.fail("ASHA did not stop the poor trial:\n" + "\n".join(lines))
    except JobError as stopped:
        assert stopped.exit_code == 143 and str(stopped).startswith("stopped: terminated (SIGTERM) with "), str(stopped)
        assert "the same command continues the sweep" in str(stopped), str(stopped)
    assert signal.getsignal(signal.SIGTERM) is before, "the sweep kept its SIGTERM handler"
    sweep_dir = tmp_path / "runs" / "sw"
    with open(sweep_dir / "trials.csv") as f:
        first = {float(r["lr"]): r for r in csv.DictReader(f)}
    poor = first[POOR]
    assert (poor["status"], poor["epochs"], poor["stopped_early"]) == ("stopped early", "1", "True"), first
    ended = [r for r in first.values() if r["status"] in ("finished", "stopped early")]
    kept = {r["trial"]: Path(r["run_dir"], "metrics.csv") for r in ended}
    kept_before = {t: (p.read_bytes(), p.stat().st_mtime_ns) for t, p in kept.items()}

    again = []

    def log_again(line):
        again.append(line)
        if " started: lr=" in line:
            lr_of[line.split(" ")[0]] = float(line.split("lr=")[1])

    sweep = tune(base, space, options, log=log_again)
    assert "sweep sw: continuing from " + str(sweep_dir / "tune") + " (finished trials are kept)" in again
    assert {t: (p.read_bytes(), p.stat().st_mtime_ns) for t, p in kept.items()} == kept_before, "ran again"
    events = lines + again  # the restored sweep's lines go to its log too
    started = {float(line.split("lr=")[1]) for line in events if " started: lr=" in line}
    assert started == {3.0, 2.0, POOR, FAILS}, events
    # the failing trial's line (twice where it failed as the first call was interrupted, before Tune
    # saved that: the continued sweep runs it again)
    fails = {line for line in events if re.match(r"trial-\S+ failed: ", line)}  # not the end table's lines
    assert len(fails) == 1 and lr_of.get(next(iter(fails)).split(" ")[0]) == FAILS, events
    assert "failed: error: training failed: the training loss became non-finite" in next(iter(fails)), fails
    console = capfd.readouterr()
    assert "Configuration for experiment" not in console.out + console.err  # Tune's box, at neither start
    with open(sweep_dir / "trials.csv") as f:
        rows = {float(r["lr"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [POOR, 2.0, 3.0, FAILS], rows
    assert rows[FAILS]["status"] == "failed" and rows[FAILS]["error"].startswith(
        "error: training failed: the training loss became non-finite"
    ), rows[FAILS]
    assert rows[POOR] == poor, "the stopped trial's row changed"
    for lr in (3.0, 2.0, POOR):
        row = rows[lr]
        assert row["status"] in ("finished", "stopped early"), row
        assert 1 <= int(row["epochs"]) <= 3 and (row["stopped_early"] == "True") == (int(row["epochs"]) < 3)
        assert 0 <= float(row["best_val_acc"]) <= 1 and Path(row["run_dir"], "metrics.csv").is_file()
        assert load_model_file(str(Path(row["run_dir"], "model.pt"))).class_names == ("a", "b"), row
    assert (sweep_dir / "trials.png").stat().st_size > 0
    best = sweep.best
    assert best is not None and float(best["best_val_acc"]) == max(float(r["best_val_acc"] or 0) for r in rows.values())
    assert float(best["lr"]) in (3.0, 2.0) and sweep.best_command.startswith("python -m jobs.train ")
    assert f"--lr {best['lr']}" in sweep.best_command and sweep.best_command.endswith("--name sw-best")

    # no two trials held more CPUs than the cluster has: by their own plans, and by Ray's task records
    share = ray.cluster_resources()["CPU"] / 2
    for lr in (3.0, 2.0, POOR):
        plan = json.loads(Path(rows[lr]["run_dir"], "config.json").read_text())["plan"]
        reserved = plan["num_workers"] * plan["cpus_per_worker"] + plan["augment_cpus"] + TRIAL_DRIVER_CPUS
        assert reserved <= share, plan
    held, side_by_side = cpus_held_at_once(began_ms)
    nodes = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]}
    assert side_by_side >= 2, "the trials never ran at the same time"
    assert held and max(held.values()) > 0, held
    for node, most in held.items():
        assert most <= nodes[node] + 1e-6, (node, most, nodes)
    deadline = time.monotonic() + 60  # a stopped trial's actors go at once; Ray's tables lag a little
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] - 0.01:
        assert time.monotonic() < deadline, "a trial still holds CPUs after the sweep"
        time.sleep(0.5)


def cpus_held_at_once(since_ms: float) -> tuple[dict, int]:
    """From Ray's task records since `since_ms`: per node, the most CPUs held at one moment (a task
    holds its CPUs while it runs; an actor its own from its first task's start to its last's end),
    and the most Tune trials (their ImplicitFunc actors) alive at one moment."""
    from ray.util.state import list_actors, list_tasks

    actors = {a.actor_id: a for a in list_actors(detail=True, limit=10_000, raise_on_missing_output=False)}
    now, spans = time.time() * 1000, {}
    for task in list_tasks(detail=True, limit=10_000, raise_on_missing_output=False):
        if not task.start_time_ms or task.start_time_ms < since_ms or not task.node_id:
            continue  # before the sweep, or never placed on a node (no node's CPUs held)
        actor = actors.get(task.actor_id) if task.actor_id else None
        key = task.actor_id or (task.task_id, task.attempt_number)
        needs = (actor.required_resources if actor else None) or task.required_resources or {}
        start, end = task.start_time_ms, task.end_time_ms or now
        was = spans.get(key, (start, end, task.node_id, needs.get("CPU", 0), actor and actor.class_name))
        spans[key] = (min(was[0], start), max(was[1], end), *was[2:])
    held, trials = {}, 0
    for start, _, node, _, _ in spans.values():
        at_start = [s for s in spans.values() if s[0] <= start < s[1]]
        held[node] = max(held.get(node, 0), sum(s[3] for s in at_start if s[2] == node))
        trials = max(trials, sum(s[4] == "ImplicitFunc" for s in at_start))
    return held, trials


def test_a_restored_sweeps_event_lines_go_to_the_callers_log(tmp_path):
    """Tune pickles its callbacks into the experiment and unpickles them on a restore: the restored
    TrialEvents still writes to the log the sweep was called with, not to another stream."""
    import pickle
    import types

    from training.sweep.report import EVENT_LOGS, TrialEvents

    restored = pickle.loads(pickle.dumps(TrialEvents(str(tmp_path / "sw"), 3, "val_acc")))
    lines = []
    EVENT_LOGS[str(tmp_path / "sw")] = lines.append
    try:
        trial = types.SimpleNamespace(trial_id="t0", config={"lr": 0.1}, last_result={"epoch": 1})
        restored.on_trial_start(0, [], trial)
        restored.on_trial_complete(0, [], trial)
    finally:
        del EVENT_LOGS[str(tmp_path / "sw")]
    assert lines == ["trial-t0 started: lr=0.1", "trial-t0 stopped early after epoch 1 (the scheduler's decision)"]


def test_trial_events_pickled_by_an_earlier_version_restore_and_tell_a_fault(capsys):
    """A sweep begun before TrialEvents kept its folder and the faults it showed, continued by this
    version: its events still print (to the console), and a fault survived is told once."""
    import pickle
    import types

    from training.sweep.report import TrialEvents

    events = TrialEvents("unused", 3, "val_acc")
    del events.sweep_dir, events.faults_shown  # as that version pickled it
    restored = pickle.loads(pickle.dumps(events))
    trial = types.SimpleNamespace(trial_id="t0", config={"lr": 0.1}, last_result={"epoch": 2})
    fault = {"faults": 1, "fault": "fault: node lost", "epoch": 2, "val_acc": 0.5}
    restored.on_trial_result(0, [], trial, fault)
    restored.on_trial_result(0, [], trial, fault | {"epoch": 3})
    assert capsys.readouterr().out.splitlines() == [
        "trial-t0 fault: node lost",
        "trial-t0 epoch 2: val_acc 0.5",
        "trial-t0 epoch 3: val_acc 0.5",
    ]


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


def test_a_trial_that_failed_before_its_first_report_has_its_row_and_settings(tmp_path):
    """Tune's Result of a trial that failed before it reported (a continued sweep's restored trial: its
    metrics are empty, so Result.config is None) still gets its row, its settings read from the
    params.json that Tune's JSON logger wrote into the trial's folder when the trial started. Before,
    the sweep's end crashed on it with an AttributeError, trials.csv unwritten."""
    from ray.tune import Result
    from ray.tune.logger.json import JsonLoggerCallback

    from training.config import TrainConfig
    from training.sweep.report import trial_row

    folder = tmp_path / "sw" / "tune" / "t9"
    folder.mkdir(parents=True)

    class Started:  # what the logger reads of Tune's Trial
        local_path = str(folder)

    JsonLoggerCallback().update_config(Started(), {"lr": 1e30, "epochs": 2})  # as Tune writes it when the trial starts
    error = RuntimeError("Traceback ...\nTrialFailed: error: nan")
    failed = Result(metrics={}, checkpoint=None, error=error, path=str(folder))
    assert failed.config is None
    cfg = TrainConfig(epochs=3, storage_path=str(tmp_path), name="sw")
    row = trial_row(failed, ["lr"], cfg, "val_acc", "max")
    assert (row["trial"], row["lr"], row["status"], row["epochs"]) == ("trial-t9", 1e30, "failed", 0), row
    assert row["best_val_acc"] is None and row["error"] == "error: nan"
    gone = Result(metrics={}, checkpoint=None, error=None, path=str(tmp_path / "sw" / "tune" / "t10"))
    assert trial_row(gone, ["lr"], cfg, "val_acc", "max")["lr"] is None  # no folder: the row without its settings


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


def test_a_trial_that_lost_a_node_plans_for_its_part_of_the_nodes_left():
    """After a lost node a trial plans again (training/driver/job.py): for its part of each node alive
    now, so it never counts on what the other trials hold there."""
    from training.driver.planning import Capacity, share_now, share_of

    cluster = Capacity(cpus=4, gpus=0, hosts=2, nodes=((2.0, 0.0), (2.0, 0.0)))
    half = share_of(cluster, 2)
    left = share_now(half, Capacity(cpus=2, gpus=0, hosts=1, nodes=((2.0, 0.0),)))
    assert (left.cpus, left.nodes, left.hosts) == (1, ((1.0, 0.0),), 1)
    grown = share_now(half, Capacity(cpus=8, gpus=0, hosts=3, nodes=((2.0, 0.0),) * 4))
    assert grown.cpus == 2 and grown.nodes == ((1.0, 0.0),) * 4  # never more than the share it began with
    autoscaled = dataclasses.replace(cluster, autoscaling=True)
    assert share_now(half, autoscaled) == half  # nodes come back there: the share as first planned


@pytest.mark.ray  # jobs.tune starts its own local cluster
def test_a_sweep_beside_another_ray_cluster_finishes_its_trials_and_a_failed_one_is_one_line(ray_cluster, tmp_path):
    """`python -m jobs.tune` as a user runs it, on a machine where another Ray cluster with a
    dashboard runs (the test session's): the sweep starts its own cluster, whose trials must not
    take the other for theirs (Ray Train's placement-group cleaner asked the other's state API
    whether the trial's controller lived, heard "no such actor", and ended the trial's workers).
    One trial trains; the other's loss turns non-finite at once: exit 0, the failure one line and
    a row, and neither Tune's traceback of a failed trial nor its "Trials did not complete"."""
    import subprocess
    import sys

    data = write_tree(tmp_path / "data", {"a": 12, "b": 12})
    args = ["--data", str(data), "--storage-path", str(tmp_path / "runs"), "--name", "s", "--epochs", "2"]
    args += ["--space", _space(tmp_path, f"lr: grid([{FAILS}, 0.01])\n"), "--trials", "1", "--batch-size", "8"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TUNE_PRINT_ALL_TRIAL_ERRORS")}
    done = subprocess.run(
        [sys.executable, "-m", "jobs.tune", *args],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    console = done.stdout + done.stderr
    assert done.returncode == 0, console
    line = r"^trial-\S+ failed: error: training failed: the training loss became non-finite"
    failed = re.findall(line, console, re.M)
    assert len(failed) == 1, console
    assert "Traceback" not in console and "ERROR" not in console and "did not complete" not in console, console
    with open(tmp_path / "runs" / "s" / "trials.csv") as f:
        rows = sorted((float(r["lr"]), r["status"]) for r in csv.DictReader(f))
    assert rows == [(0.01, "finished"), (FAILS, "failed")], console


def test_sigterm_while_a_sweeps_ray_starts_is_one_line_and_exit_143(tmp_path, capsys, monkeypatch, fresh_signals):
    """A real SIGTERM to this process while the sweep connects (before Tune): Ray's handler in ray.init
    exited 15 without a word, and after it, before the sweep's own handler was set, so did any
    SIGTERM. Now one line, exit 143, and the same command starts the sweep."""
    from jobs import tune as tune_job
    from training.driver import session

    def sigterm_while_connecting(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        pytest.fail("SIGTERM did not stop the sweep")

    monkeypatch.setattr(session, "connect", sigterm_while_connecting)
    data = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    args = ["--data", str(data), "--storage-path", str(tmp_path / "runs"), "--name", "s"]
    before = signal.getsignal(signal.SIGTERM)
    assert tune_job.main([*args, "--space", _space(tmp_path, "lr: choice([0.1, 0.01])\n")]) == 143
    said = "stopped: terminated (SIGTERM) before the sweep began; the same command starts it"
    assert capsys.readouterr().err == said + "\n"
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back
