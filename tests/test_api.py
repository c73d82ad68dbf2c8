"""training.fit, the job driven from Python (training/driver/api.py): the guide's example as written, epoch
callbacks (a stop rule, one that fails: on the run tests/conftest.py's tracked_run shares with two other
files), and bad input raising the CLI's own line."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from tests.conftest import exits_2, write_tree
from training import JobError, fit
from training.bounds import STAGES
from training.records import EpochRecord

REPO = Path(__file__).resolve().parents[1]


def _guide_example() -> str:
    guide = (REPO / "docs" / "guide.md").read_text()
    section = guide.split("### From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_the_guides_example_runs_as_written(ray_cluster, tmp_path, capsys, monkeypatch):
    """The guide's example, which the README shows too (the same text, so this run covers both)."""
    data = write_tree(tmp_path / "photos", {"cat": 10, "dog": 10})
    code = _guide_example()
    readme = (REPO / "README.md").read_text().split("callbacks see every epoch", 1)[1]
    assert re.search(r"```python\n(.*?)```", readme, re.S)[1] == code
    assert '"~/photos"' in code
    monkeypatch.setenv("HOME", str(tmp_path))  # ~/photos is the tree above; runs/ goes under tmp_path
    with contextlib.chdir(tmp_path):
        exec(compile(code, "guide.md", "exec"), {})
    printed = capsys.readouterr().out
    epochs = re.findall(r"^epoch (\d): val_acc (\d\.\d{3})$", printed, re.M)
    assert [int(e) for e, _ in epochs] == list(range(1, len(epochs) + 1)) and 1 <= len(epochs) <= 3, printed
    result_line = printed.strip().splitlines()[-1]
    best, model = result_line.split(" ", 1)
    assert 0 <= float(best) <= 1 and model == str(tmp_path / "runs" / "photos-r18" / "model.pt")
    assert Path(model).is_file() and data.is_dir()


def test_callbacks_get_typed_records_a_stop_rule_ends_the_run_and_a_failing_one_costs_a_line(tracked_run):
    """Four callbacks on the run of tests/conftest.py (tracked_run): a tracker of its own, one that fails, and a
    stop rule that ends the run after epoch 2 of 3."""
    _, result, run_dir, lines, seen, _ = tracked_run
    assert [r.epoch for r in seen] == [1, 2] and all(isinstance(r, EpochRecord) for r in seen)
    assert seen[-1].val.acc == result.val_acc and result.epochs == 2
    assert seen[-1].train.images == sum(r.count for r in seen[-1].seen) > 0 and seen[-1].bound.stage in STAGES
    warned = [line for line in lines if line.startswith("warning: epoch callback")]
    assert warned == [
        "warning: epoch callback tracked_run.<locals>.broken failed at epoch 1 (ValueError: the tracker's server is "
        "down); the run goes on without it"
    ], lines
    assert "stopped after epoch 2 by an epoch callback" in lines
    assert Path(result.model_path).is_file() and Path(result.best_model_path).is_file()
    assert result.ema_model_path is None  # no --model-ema: no model_ema.pt
    assert result.summary["epochs"] == 2 and result.run_dir == str(run_dir)


def test_a_run_leaves_the_callers_ctrl_c_handler_as_it_was(tracked_run):
    """Ray Train's fit sets a SIGINT handler of its own (it aborts that run's controller) and left it
    set: in the caller's process (a notebook, a pipeline's step, this test process, which ran
    `tracked_run` in it) a later Ctrl-C, or a SIGTERM a later job hands to SIGINT, went to a finished
    run's controller and was lost. Python's own handler is back once fit returns."""
    import signal

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_bad_input_raises_the_clis_line_never_exits(tmp_path, capsys, no_ray):
    tree = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    args = {"data": str(tmp_path / "nowhere"), "storage_path": str(tmp_path / "runs"), "name": "r"}
    with pytest.raises(JobError) as err:
        fit(args)
    assert err.value.exit_code == 2
    cli = exits_2(["--data", args["data"], "--storage-path", args["storage_path"], "--name", "r"], capsys)
    assert str(err.value) == cli.strip()
    for config, words in (
        ({"data": str(tree), "epoch": 3}, "fit: unknown setting 'epoch'; valid settings: "),
        ({"data": str(tree), "epochs": "three"}, "--epochs: invalid int value: 'three'"),
        (42, "fit: config is a int; give a TrainConfig, a dict or a YAML file's path"),
        ({"data": [str(tree), str(tree)]}, "fit: data must be one value, got a list; give a single value"),
        ({"data": str(tree), "log_to": ["tensorboard", 3]}, "fit: log_to takes names: give a list of strings"),
        (str(tmp_path / "missing.yaml"), "--config"),
    ):
        with pytest.raises(JobError) as err:
            fit(config)
        assert err.value.exit_code == 2 and words in str(err.value), str(err.value)
        assert str(err.value).startswith("error: ") and "\n" not in str(err.value)


def test_a_trainconfig_built_in_python_refuses_a_value_of_the_wrong_type_in_one_line():
    """A TrainConfig a caller builds is checked as the command line's flags are: a value of another type
    is one line naming the flag at construction, not a TypeError from a comparison later."""
    from training.config import ConfigError, TrainConfig

    for settings, line in (
        ({"epochs": "3"}, "--epochs must be a whole number, got '3' (a str)"),
        ({"batch_size": 8.0}, "--batch-size must be a whole number, got 8.0 (a float)"),
        ({"epochs": True}, "--epochs must be a whole number, got True (a bool)"),
        ({"lr": "0.1"}, "--lr must be a number, got '0.1' (a str)"),
        ({"strict": "yes"}, "--strict must be True or False, got 'yes' (a str)"),
        ({"data": 3}, "--data must be a string or None, got 3 (a int)"),
        ({"image_size": None}, "--image-size must be a whole number, got None (a NoneType)"),
    ):
        with pytest.raises(ConfigError) as err:
            TrainConfig(**settings)
        assert str(err.value) == line
    cfg = TrainConfig(lr=1, data=None, momentum=0)  # a whole number where a float goes, None where one may
    assert (cfg.lr, cfg.data, cfg.momentum) == (1, None, 0)


def test_the_guides_json_lines_callback_writes_each_epochs_metrics_row(tmp_path, monkeypatch, no_ray):
    """docs/guide.md's simplest tracker, its callback run on typed records as training.fit calls it (the run
    itself faked: what is checked is the callback the user copies)."""
    import json

    import training
    from tests.conftest import an_epoch_record

    guide = (REPO / "docs" / "guide.md").read_text()
    code = re.search(r"```python\n(import json\nfrom training import fit\n.*?)```", guide, re.S)[1]
    records = [an_epoch_record(1, 0.5), an_epoch_record(2, 0.75)]
    monkeypatch.setattr(training, "fit", lambda config, callbacks: [cb(r) for r in records for cb in callbacks])
    with contextlib.chdir(tmp_path):
        exec(compile(code, "guide.md", "exec"), {})
    lines = [json.loads(line) for line in (tmp_path / "epochs.jsonl").read_text().splitlines()]
    assert [(row["epoch"], row["val_acc"]) for row in lines] == [(1, 0.5), (2, 0.75)]
