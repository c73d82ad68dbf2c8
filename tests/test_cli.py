"""The entry points' flags: a mistake is one line with the closest valid flags, and nothing
is guessed from an abbreviation."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import evaluate, export, predict, prepare, preview
from jobs import train as train_job

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--epcohs", "1"], "--epcohs: did you mean --epochs?"),
        (["--epoch", "1"], "--epoch: did you mean --epochs?"),  # argparse's prefix match would take it
        (["--batch", "8"], "--batch: did you mean --batch-size?"),
    ],
)
def test_a_misspelled_flag_is_one_line_with_the_closest_flags(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_job.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unrecognized arguments: ")
    assert hint in err and "usage:" not in err and err.endswith("see python -m jobs.train --help\n")


@pytest.mark.parametrize(
    "module, argv",
    [
        (predict, ["--model", "m.pt", "--data", "d", "--batch", "8"]),
        (evaluate, ["--model", "m.pt", "--data", "d", "--batch", "8"]),
        (prepare, ["src", "out", "--shard", "8"]),
        (preview, ["--data", "d", "--pre", "cifar"]),
        (export, ["--model", "m.pt", "--format", "onnx", "--out", "m.onnx", "--over"]),
    ],
    ids=["predict", "evaluate", "prepare", "preview", "export"],
)
def test_every_entry_point_refuses_abbreviations(module, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        module.parse(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "did you mean" in err, err


def test_the_one_line_comes_before_anything_heavy_starts():
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "jobs.train", "--epcohs", "1"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "error: unrecognized arguments: --epcohs 1 (--epcohs: did you mean --epochs?); "
        "see python -m jobs.train --help\n"
    )
    assert time.monotonic() - t0 < 5  # an interpreter and the argument parser, no Ray, no torch


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--epochs", "5"], "python -m jobs.train --epochs 5 --name run-1"),  # the default name is a timestamp
        (["--fresh", "--name", "x", "--stop-after", "1"], "python -m jobs.train --name run-1"),  # neither again
        (["--name=x", "--stop-after=2", "--data", "my photos"], "python -m jobs.train --data 'my photos' --name run-1"),
    ],
)
def test_the_command_to_resume_is_the_same_one_with_the_runs_name(argv, expected, monkeypatch):
    from training.config import TrainConfig

    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")  # a Python outside the current directory
    assert train_job.rerun_command(argv, TrainConfig(name="run-1")) == expected


def test_the_command_to_resume_names_the_venvs_python_from_the_repository_root(monkeypatch, tmp_path):
    from training.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", os.path.join(os.getcwd(), ".venv", "bin", "python"))
    assert train_job.rerun_command(["--epochs", "5"], TrainConfig(name="r")) == (
        ".venv/bin/python -m jobs.train --epochs 5 --name r"
    )


def test_settings_a_config_file_gave_are_turned_off_in_the_command_to_resume(monkeypatch):
    from training.config import TrainConfig

    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    cfg = TrainConfig(name="run-1", fresh=True, stop_after=3)  # as from a --config file
    assert train_job.rerun_command(["--config", "c.yaml"], cfg) == (
        "python -m jobs.train --config c.yaml --name run-1 --no-fresh --stop-after 0"
    )
