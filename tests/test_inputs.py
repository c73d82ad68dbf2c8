"""Bad input to jobs.train is found before Ray starts: exit 2, one `error:` line and no
traceback, within seconds, and nothing written under --storage-path. And the files the job
loads back (--init-weights, model.pt, checkpoints) are read with torch.load(weights_only=True):
a pickled object in one is refused and never runs. No Ray cluster: `connect` fails the test."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torchvision  # noqa: F401  (imported here so that the timings below measure the checks, not the import)

from tests.conftest import exits_2
from training import storage
from training.config import ConfigError, TrainConfig
from training.driver.inputs import check_inputs, start_fresh


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
    "yaml tag": (
        "tag.yml",
        "train: !!python/object/apply:os.system [id]\n",
        "tag.yml: line 1: a tag (!!python/object/apply:os.system); tags are not read, write a plain value",
    ),
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
    # a plain pickle (no torch zip): torch warns of its protocol before it refuses it
    "a plain pickle": (lambda p, m: p.write_bytes(pickle.dumps(os.getcwd, protocol=4)) and p, "not a file torch.load"),
}


@pytest.mark.parametrize("case", sorted(INIT_WEIGHTS))
def test_a_bad_init_weights_file_exits_2_before_ray_starts(case, tree, tmp_path, no_ray, capsys):
    make, message = INIT_WEIGHTS[case]
    marker = tmp_path / "trap-sprung"
    path = make(tmp_path / "weights.pt", marker)
    runs = tmp_path / "runs"
    with warnings.catch_warnings(record=True) as warned:  # what a console would show above the line
        warnings.simplefilter("always")
        err = exits_2(["--data", str(tree), "--init-weights", str(path), "--storage-path", str(runs)], capsys)
    assert err.startswith(f"error: --init-weights {path}: ") and message in err, err
    assert not [w for w in warned if "pickle" in str(w.message)], [str(w.message) for w in warned]
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
    for where in (tmp_path / "new" / "deeper", existing):
        args = ["--data", str(tree), "--storage-path", str(where), "--name", "r", *flags]
        assert message in exits_2(args, capsys)
    assert sorted(os.listdir(tmp_path)) == ["data", "existing"] and os.listdir(existing) == []


def test_fresh_removes_the_old_run_only_once_every_input_has_passed(tree, tmp_path, no_ray, capsys):
    old = tmp_path / "runs" / "r"
    old.mkdir(parents=True)
    (old / "metrics.csv").write_text("epoch\n1\n")
    storage.mark_run_dir(str(old), "r")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [")
    common = ["--data", str(tree), "--storage-path", str(tmp_path / "runs"), "--name", "r", "--fresh"]
    for flags in (["--preset", str(bad)], ["--init-weights", str(bad)], ["--preset", "nope"]):
        exits_2(common + flags, capsys)
        assert (old / "metrics.csv").read_text() == "epoch\n1\n", flags
    cfg, _ = check_inputs(TrainConfig(data=str(tree), storage_path=str(tmp_path / "runs"), name="r", fresh=True))
    assert old.exists()  # checking removes nothing
    start_fresh(cfg)
    assert os.listdir(old) == [storage.RUN_MARKER]  # the old run's files gone; the folder is the new run's


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


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--seed", str(2**64)],
            f"--seed {2**64}: must be 0 .. 2**64 - 1 (torch.manual_seed's range); give another seed",
        ),
        (["--seed", "-1"], "--seed -1: must be 0 .. 2**64 - 1 (torch.manual_seed's range); give another seed"),
        (
            ["--seed", str(2**32), "--deterministic"],
            f"--seed {2**32}: must be 0 .. 2**32 - 1 with --deterministic (NumPy's seeds); give another seed",
        ),
        (
            ["--epochs", "1000000000"],
            "--epochs 1000000000: more than 100000, the most this job takes (training/config.py LIMITS); give a "
            "smaller value",
        ),
        (["--image-size", "100000"], "--image-size 100000: more than 8192, the most this job takes"),
        (["--batch-size", "100000000"], "--batch-size 100000000: more than 1048576, the most this job takes"),
        (["--num-workers", "100000"], "--num-workers 100000: more than 4096, the most this job takes"),
        (["--stop-after", "1000000"], "--stop-after 1000000: more than 100000, the most this job takes"),
        (["--node-wait-s", "1e9"], "--node-wait-s 1e+09: more than 604800, the most this job takes"),
        (
            ["--device", "cuda"],
            "--device cuda: this machine has no GPU that CUDA shows, and a run without RAY_ADDRESS starts its cluster "
            "here; use --device cpu or auto, or set RAY_ADDRESS to join a cluster with GPUs",
        ),
        (
            ["--augment-gpus", "1"],
            "--augment-gpus 1: this machine has no GPU that CUDA shows, and a run without RAY_ADDRESS starts its "
            "cluster here; drop --augment-gpus, or set RAY_ADDRESS",
        ),
        (["--augment-gpus", "0.25", "--device", "cpu"], "--augment-gpus 0.25 with --device cpu: augmenting on GPUs"),
        (
            ["--cpus-per-worker", "64"],
            "--cpus-per-worker 64: this machine has 2 CPUs, and a run without RAY_ADDRESS starts its cluster here; "
            "give 2 or less, or 0 for the plan's share",
        ),
    ],
)
def test_flags_that_passed_every_check_and_failed_later_exit_2_before_ray(
    flags, line, tree, tmp_path, capsys, no_ray, monkeypatch
):
    """Issue 53: a --seed torch.manual_seed refuses on the workers, GPU flags on a machine without
    one, more CPUs per worker than the machine has, sizes and counts beyond sense."""
    from training.driver import inputs

    monkeypatch.setattr(inputs, "local_gpus", lambda: 0)  # this machine as CI's: no GPU
    monkeypatch.setattr(inputs, "cuda_devices", lambda: 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for name in ("RAY_ADDRESS", "RAY_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    err = exits_2(["--data", str(tree), "--storage-path", str(tmp_path / "runs"), *flags], capsys)
    assert err.startswith(f"error: {line}"), err
    assert not (tmp_path / "runs").exists()


def test_the_largest_seed_and_the_most_cpus_the_machine_has_are_taken(tree, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    from training.driver.inputs import check_local_machine

    cfg = TrainConfig(data=str(tree), seed=2**64 - 1, cpus_per_worker=2, epochs=100_000, image_size=8192)
    check_local_machine(cfg)
    with pytest.raises(ConfigError, match=r"^--cpus-per-worker 3: this machine has 2 CPUs"):
        check_local_machine(TrainConfig(cpus_per_worker=3))


def test_a_folder_or_a_pipe_named_as_a_file_is_refused_for_what_it_is(tree, tmp_path, capsys, no_ray):
    """Issue 53: a folder or a pipe given for a file was "no such file" (or "not found"). A pipe is
    refused, not read: the run records these paths and a resume reads them again."""
    folder, pipe = tmp_path / "weights.pt", tmp_path / "names.txt"
    folder.mkdir()
    os.mkfifo(pipe)
    base = ["--data", str(tree), "--storage-path", str(tmp_path / "runs")]
    cases = [
        (["--init-weights", str(folder)], f"--init-weights {folder} is a folder, not a file; give a torchvision"),
        (["--init-weights", str(pipe)], f"--init-weights {pipe} is a pipe, not a file; give a torchvision resnet18"),
        (
            ["--class-names", str(folder)],
            f"--class-names {folder} is a folder, not a file; give a text file with one class name",
        ),
        (
            ["--class-names", str(pipe)],
            f"--class-names {pipe} is a pipe, not a file; give a text file with one class name a line",
        ),
        (["--preset", str(tmp_path / "p.yaml")], f"{tmp_path / 'p.yaml'} is a folder, not a file; give a .yaml/.json"),
    ]
    (tmp_path / "p.yaml").mkdir()
    for flags, line in cases:
        assert exits_2([*base, *flags], capsys).startswith(f"error: {line}"), flags
    assert not (tmp_path / "runs").exists()


def test_a_file_uri_is_the_local_path_it_names(tmp_path):
    """file:///data (Ray's docs write local storage so) is the local /data, through every entry point's
    flags and the Python API's TrainConfig: the checks before Ray refused --storage-path file://NEW/runs,
    naming their own probe file, because a URI's folders are not made as a local path's are."""
    from jobs import predict
    from jobs import train as train_job
    from tests.conftest import write_tree
    from training.driver import lease
    from training.driver.flags import parse_config

    data = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    runs = tmp_path / "new" / "runs"
    argv = ["--data", f"file://{data}", "--storage-path", f"file://{runs}", "--name", "r"]
    cfg, _ = parse_config(train_job.parser(), argv)
    assert (cfg.data, cfg.storage_path) == (str(data), str(runs))
    train_job.prepare(cfg)  # the checks before Ray pass, and the run's lease is taken in the local folder
    assert (runs / "r" / lease.LEASE_FILE).is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["data", "new"]
    assert TrainConfig(data=f"FILE://{data}").data == str(data)
    args = predict.parse(["--model", f"file://{tmp_path}/model.pt", "--data", f"file://{data}", "--out", "p.csv"])
    assert (args.model, args.data, args.out) == (f"{tmp_path}/model.pt", str(data), "p.csv")


def test_a_file_uri_of_localhost_is_local_and_one_of_another_host_is_refused(tmp_path, capsys, no_ray):
    """RFC 8089: file://localhost/data is this machine's /data; file://host/data names another
    machine's, which was read as the relative folder host/data here."""
    from tests.conftest import exits_2, write_tree

    data = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    assert TrainConfig(data=f"file://localhost{data}").data == str(data)
    err = exits_2(["--data", f"file://nas{data}", "--storage-path", str(tmp_path / "runs")], capsys)
    assert err.startswith(f"error: file://nas{data}: ") and "give a local path" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
