"""Bad input to jobs.train is found before Ray starts: exit 2, one `error:` line and no
traceback, within seconds, and nothing written under --storage-path. And the files the job
loads back (--init-weights, model.pt, checkpoints) are read with torch.load(weights_only=True):
a pickled object in one is refused and never runs. No Ray cluster: `connect` fails the test."""

from __future__ import annotations

import os

import pytest
import torch
import torchvision  # noqa: F401  (imported here so that the timings below measure the checks, not the import)

from tests.conftest import exits_2
from training import artifacts
from training.config import TrainConfig
from training.inputs import check_inputs, start_fresh


class Trap:
    """Pickled, it creates the directory `marker` when it is unpickled: the code a hostile file runs."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _trap_file(path, marker, wrap=lambda obj: obj):
    torch.save(wrap({"layer1.0.conv1.weight": Trap(marker)}), path)
    return path


def _sprung(path, marker) -> bool:
    """The control: loading without weights_only runs the trap (so the file is a live one)."""
    assert not os.path.exists(marker)
    torch.load(path, weights_only=False)
    return os.path.isdir(marker)


# --------------------------------------------------------------------------- preset files


PARSE_ERRORS = {
    "yaml": ("bad.yaml", "train: [", "bad.yaml: not valid YAML (expected the node content, but found '<stream end>'"),
    "json": ("bad.json", '{"train": [', "bad.json: not valid JSON (Expecting value at line 1, column 12)"),
    "empty json": ("empty.json", "", "empty.json: not valid JSON (Expecting value at line 1, column 1)"),
    "yaml tag": ("tag.yml", "train: !!python/object/apply:os.system [id]\n", "tag.yml: not valid YAML (could not"),
    "binary": ("photo.yaml", b"\xff\xd8\xff\xe0 a JPEG", "photo.yaml: not UTF-8 text; a preset file is YAML or JSON"),
}


@pytest.mark.parametrize("case", sorted(PARSE_ERRORS))
def test_a_preset_file_that_does_not_parse_exits_2_with_one_line(case, tree, tmp_path, no_ray, capsys):
    name, text, message = PARSE_ERRORS[case]
    f = tmp_path / name
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    runs = tmp_path / "runs"
    err = exits_2(["--data", str(tree), "--preset", str(f), "--storage-path", str(runs)], capsys)
    assert message in err and str(f) in err, err
    assert not runs.exists()  # no empty run directory left behind


# --------------------------------------------------------------------------- --init-weights


def _no_resnet(path, marker):
    # the right name with ResNet50's shape (a 1x1 conv), and the weights of some other net
    torch.save({"layer1.0.conv1.weight": torch.zeros(64, 64, 1, 1), "0.weight": torch.zeros(4, 3)}, path)
    return path


INIT_WEIGHTS = {
    "pickled object": (_trap_file, "refuses it: it holds a pickled object (posix.mkdir), which may run code"),
    "pickled object in a model.pt": (
        lambda p, m: _trap_file(p, m, lambda sd: {"state_dict": sd}),
        "refuses it: it holds a pickled object",
    ),
    "no ResNet18 weights": (
        _no_resnet,
        "no resnet18 weights found (0 of its 120 tensors, expected keys like 'conv1.weight'",
    ),
    "not a torch file": (lambda p, m: p.write_text("layer1: 0\n") and p, "not a file torch.load reads"),
    "a list": (lambda p, m: torch.save([torch.zeros(3)], p) or p, "holds a list, not a state_dict"),
}


@pytest.mark.parametrize("case", sorted(INIT_WEIGHTS))
def test_a_bad_init_weights_file_exits_2_before_ray_starts(case, tree, tmp_path, no_ray, capsys):
    make, message = INIT_WEIGHTS[case]
    marker = tmp_path / "trap-sprung"
    path = make(tmp_path / "weights.pt", marker)
    runs = tmp_path / "runs"
    err = exits_2(["--data", str(tree), "--init-weights", str(path), "--storage-path", str(runs)], capsys)
    assert err.startswith(f"error: --init-weights {path}: ") and message in err, err
    assert "torch.save(model.state_dict(), path)" in err  # the fix
    assert not runs.exists() and not marker.exists()
    if "pickled" in case:
        assert _sprung(path, marker)


def test_a_good_init_weights_file_passes_the_drivers_check(tree, tmp_path):
    path = tmp_path / "r18.pt"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    cfg, _ = check_inputs(TrainConfig(data=str(tree), init_weights=str(path), storage_path=str(tmp_path / "runs")))
    assert cfg.init_weights == str(path) and not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- the run directory


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--init-weights", "missing.pt"], "--init-weights missing.pt: no such file"),
        (["--progressive-resize", "big"], "--progressive-resize: progressive resize 'big'"),
        (["--data", "/nonexistent/photos"], "/nonexistent/photos: no such directory"),
    ],
)
def test_an_early_error_writes_nothing_under_the_storage_path(flags, message, tree, tmp_path, no_ray, capsys):
    """Neither the directories the write probe needed (created, then removed) nor a run directory."""
    existing = tmp_path / "existing"
    existing.mkdir()
    for storage in (tmp_path / "new" / "deeper", existing):
        args = ["--data", str(tree), "--storage-path", str(storage), "--name", "r", *flags]
        assert message in exits_2(args, capsys)
    assert sorted(os.listdir(tmp_path)) == ["data", "existing"] and os.listdir(existing) == []


def test_fresh_removes_the_old_run_only_once_every_input_has_passed(tree, tmp_path, no_ray, capsys):
    old = tmp_path / "runs" / "r"
    old.mkdir(parents=True)
    (old / "metrics.csv").write_text("epoch\n1\n")
    artifacts.mark_run_dir(str(old), "r")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [")
    common = ["--data", str(tree), "--storage-path", str(tmp_path / "runs"), "--name", "r", "--fresh"]
    for flags in (["--preset", str(bad)], ["--init-weights", str(bad)], ["--preset", "nope"]):
        exits_2(common + flags, capsys)
        assert (old / "metrics.csv").read_text() == "epoch\n1\n", flags
    cfg, _ = check_inputs(TrainConfig(data=str(tree), storage_path=str(tmp_path / "runs"), name="r", fresh=True))
    assert old.exists()  # checking removes nothing
    start_fresh(cfg)
    assert os.listdir(old) == [artifacts.RUN_MARKER]  # the old run's files gone; the folder is the new run's


# --------------------------------------------------------------------------- the files the job loads back


def test_a_model_pt_holding_a_pickled_object_is_refused_and_never_runs(tree, tmp_path, no_ray, capsys):
    from jobs.predict import main

    marker = tmp_path / "trap-sprung"
    model = _trap_file(tmp_path / "model.pt", marker, lambda sd: {"arch": "resnet18", "state_dict": sd})
    assert main(["--model", str(model), "--data", str(tree), "--out", str(tmp_path / "p.csv")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --model {model}: not a model.pt written by jobs.train (UnpicklingError)\n"
    assert not marker.exists() and _sprung(model, marker)


def test_a_checkpoint_holding_a_pickled_object_is_refused_and_never_runs(tmp_path, monkeypatch):
    """What a train worker loads when it resumes (training.worker.loop.restore)."""
    import pickle

    import ray.train

    from training.worker import loop, report

    marker = tmp_path / "trap-sprung"
    (tmp_path / "ckpt").mkdir()
    path = _trap_file(tmp_path / "ckpt" / report.CHECKPOINT_FILE, marker, lambda sd: {"learner": {"model": sd}})
    checkpoint = ray.train.Checkpoint.from_directory(str(tmp_path / "ckpt"))
    monkeypatch.setattr(loop.ray.train, "get_checkpoint", lambda: checkpoint)
    with pytest.raises(pickle.UnpicklingError, match="(?s)Weights only load failed.*GLOBAL posix.mkdir"):
        loop.restore(TrainConfig(), torch.device("cpu"))
    assert not marker.exists() and _sprung(path, marker)
