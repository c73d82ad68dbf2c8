"""--config files: values, flags over the file, unknown keys and bad values as exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.train import main, parser
from training.config import ConfigError, TrainConfig
from training.driver.flags import load_config_file, parse_config

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_file_values_are_used_and_flags_override_them(tmp_path):
    path = _write(tmp_path, "epochs: 7\nbatch-size: 32\nlr: 1\noptimizer: adamw\nfresh: true\n")
    cfg, sources = parse_config(parser(), ["--config", path, "--epochs", "3", "--no-fresh"])
    assert (cfg.epochs, cfg.batch_size, cfg.lr, cfg.optimizer, cfg.fresh) == (3, 32, 1.0, "adamw", False)
    assert isinstance(cfg.lr, float)
    assert sources["batch_size"] == "file" and sources["epochs"] == "flag"
    assert "seed" not in sources  # defaults are not marked


def test_without_a_file_the_defaults_stand(tmp_path):
    cfg, sources = parse_config(parser(), [])
    assert cfg == TrainConfig() and sources == {}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("epochz: 3\n", "unknown key 'epochz'; valid keys: amp, augment_actors"),
        ("epochs: three\n", "epochs must be a whole number such as 30, got 'three'"),
        ("optimizer: lamb\n", "optimizer must be one of sgd, adamw"),
        ("fresh: yes please\n", "fresh must be true or false"),
        ("- epochs\n", "expected a mapping"),
        ("epochs: [\n", "not valid YAML"),
        ('{"epochs": 2,\n', "not valid JSON (did not find expected node content at line 2"),  # was "not valid YAML"
    ],
)
def test_bad_files_are_config_errors(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        load_config_file(_write(tmp_path, text))
    assert fragment in str(e.value)


def test_cli_exits_2_with_one_line(tmp_path, capsys):
    assert main(["--config", _write(tmp_path, "epochz: 3\n")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --config") and "unknown key 'epochz'" in err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    # a value the file gives is checked like the flag's, and the line names the file
    path = _write(tmp_path, "epochs: 0\n")
    assert main(["--config", path]) == 2
    assert f"--config {path}: epochs must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["cifar-local.yaml", "imagenet-cluster.yaml"])
def test_example_configs_load_and_plan_on_the_cluster_they_are_for(name):
    from training.driver.planning import Capacity, plan_resources

    cfg, _ = parse_config(parser(), ["--config", str(REPO / "configs" / name)])
    assert cfg.epochs > 1 and cfg.name
    gpus = 8 if cfg.device == "cuda" else 0  # imagenet-cluster.yaml: 8 GPUs of cluster.yaml's nodes
    plan = plan_resources(cfg, Capacity(cpus=64 if gpus else 2, gpus=gpus, hosts=1, autoscaling=False))
    assert plan.num_workers == (cfg.num_workers or 1) and plan.use_gpu == bool(gpus)


def test_help_lists_config_and_every_field():
    text = parser().format_help()
    assert "--config FILE" in text
    for field in TrainConfig.__dataclass_fields__:
        assert "--" + field.replace("_", "-") in text


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--lr", "inf"], "--lr must be a finite number, got inf"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number, got nan"),
        (["--momentum", "nan"], "--momentum must be a finite number, got nan"),
        (["--warmup-epochs", "inf"], "--warmup-epochs must be a finite number, got inf"),
        (["--weight-decay", "-0.1"], "--weight-decay must be 0 or more, got -0.1"),
        (["--momentum", "1.5"], "--momentum must be in [0, 1], got 1.5"),
        # an unset shell variable (`--data "$DATA"`): not the bundled digits, not runs in the working folder
        (["--data", ""], "--data is empty; give the data's path, or leave --data out for the bundled digits"),
        (["--storage-path", " "], "--storage-path is empty; give a folder or bucket, or leave it out for ./runs"),
    ],
)
def test_non_finite_and_out_of_range_numbers_exit_2_before_ray(flags, message, tree, no_ray, capsys):
    """nan fails no comparison (`lr <= 0` is False for it): a run trained on nan weights and said done."""
    from tests.conftest import exits_2

    assert exits_2(["--data", str(tree), *flags], capsys) == f"error: {message}\n"


@pytest.mark.parametrize(
    "text, message",
    [
        ("lr: .nan\n", "lr must be a finite number, got nan"),
        ("momentum: 1.5\n", "momentum must be in [0, 1], got 1.5"),
        ("storage_path: ' '\n", "storage_path is empty; give a folder or bucket, or leave it out for ./runs"),
    ],
)
def test_a_refused_value_from_the_config_file_names_the_file(tmp_path, text, message, tree, no_ray, capsys):
    """TrainConfig's checks named the flag (`--lr must be ...`), which the command did not give: the
    line names the file and its key; a flag that overrides the file's value is checked as a flag."""
    from tests.conftest import exits_2

    path = _write(tmp_path, text)
    assert exits_2(["--data", str(tree), "--config", path], capsys) == f"error: --config {path}: {message}\n"
    key = text.split(":")[0]
    flag = ["--" + key.replace("_", "-"), "1e-3" if key == "lr" else "0.5" if key == "momentum" else ""]
    if key == "storage_path":
        assert exits_2(["--data", str(tree), "--config", path, *flag], capsys).startswith("error: --storage-path is")
    else:
        assert exits_2(["--data", str(tree), "--config", path, *flag, "--epochs", "0"], capsys).startswith(
            "error: --epochs"
        )


def test_an_error_is_one_line_with_one_prefix_whatever_its_message_holds():
    from training.config import error_line

    assert error_line(ValueError("error: --data x\nthe rest")) == "error: --data x\\nthe rest"
    assert error_line("error: error: a\tb") == "error: a\\tb"
    assert error_line(ConfigError("--lr must be positive")) == "error: --lr must be positive"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: 0123\n", {"name": "0123"}),  # YAML 1.1: the octal 83
        ("name: 1.10\n", {"name": "1.10"}),  # the float 1.1
        ("name: 2024\ndata: 007\nstorage_path: 1e3\n", {"name": "2024", "data": "007", "storage_path": "1e3"}),
        ("name: '0123'\n", {"name": "0123"}),
        ('{"name": "0123", "lr": 1e-3}\n', {"name": "0123", "lr": 0.001}),  # JSON is YAML too
        ("lr: 1e-3\n", {"lr": 0.001}),  # YAML 1.1: text, having no dot
        ("lr: 1E5\nmomentum: .5\nweight_decay: 5.\n", {"lr": 1e5, "momentum": 0.5, "weight_decay": 5.0}),
        ("lr: 1\nwarmup_epochs: 1_000.5\n", {"lr": 1.0, "warmup_epochs": 1000.5}),
        ("epochs: 010\nbatch_size: 1e3\n", {"epochs": 10, "batch_size": 1000}),  # YAML 1.1: octal 8; a float
        ("fresh: yes\nstrict: off\nquiet: True\n", {"fresh": True, "strict": False, "quiet": True}),
        ("amp: off\ndata: null\n", {"amp": "off", "data": None}),  # YAML 1.1: the bool False
    ],
)
def test_settings_are_read_as_written(tmp_path, text, expected):
    values = load_config_file(_write(tmp_path, text))
    assert values == expected and all(type(values[k]) is type(v) for k, v in expected.items()), values


@pytest.mark.parametrize(
    "text, message",
    [
        ("epochs: 3\nlr: 0.1\nepochs: 5\n", "line 3: epochs is given twice; give each setting once"),
        ("batch_size: 8\nbatch-size: 16\n", "batch_size is given twice (as batch-size too); give each setting once"),
        ("base: &b 0.1\nlr: *b\n", "line 1: an anchor (&b); anchors are not read, write the value"),
        ("lr: !!float 1\n", "line 1: a tag (!!float); tags are not read, write a plain value"),
        ("name: !!python/object/apply:os.system [id]\n", "line 1: a tag (!!python/object/apply:os.system); tags"),
        ("epochs: 1.5\n", "epochs must be a whole number such as 30, got '1.5'"),
        ("lr: fast\n", "lr must be a number such as 0.1 or 1e-3, got 'fast'"),
        ("epochs:\n", "epochs has no value; give a whole number such as 30, or leave the key out"),
        ("epochs: [1, 2]\n", "epochs must be one value, got a list"),
        ("epochs: 1\n---\nepochs: 2\n", "not valid YAML (but found another document at line 2, column 1)"),
    ],
)
def test_duplicates_aliases_tags_and_bad_numbers_are_refused_by_their_rule(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config_file(path)
    assert str(e.value) == f"--config {path}: {message}" or str(e.value).startswith(f"--config {path}: {message}")


def test_an_alias_bomb_is_refused_at_once_in_one_short_line(tmp_path, capsys, no_ray):
    """A 300-byte file whose `data:` expands to 9**9 items: its "must be str" message took the
    machine's memory for 35-50 s and ended in a MemoryError traceback."""
    import time

    from bench.fuzz_yaml import ALIAS_BOMB
    from tests.conftest import exits_2

    path = _write(tmp_path, ALIAS_BOMB)
    start = time.monotonic()
    err = exits_2(["--config", path], capsys)
    assert time.monotonic() - start < 1
    assert err == f"error: --config {path}: line 1: an anchor (&a); anchors are not read, write the value\n"


def test_a_long_value_is_shown_cut_short(tmp_path):
    path = _write(tmp_path, f"epochs: {'x' * 100_000}\n")
    with pytest.raises(ConfigError) as e:
        load_config_file(path)
    assert len(str(e.value)) < len(path) + 200 and str(e.value).endswith("...")
    path = _write(tmp_path, f"{'k' * 1000}: 1\n")  # YAML's longest key
    with pytest.raises(ConfigError) as e:
        load_config_file(path)
    assert "unknown key 'kkkk" in str(e.value) and "k" * 100 not in str(e.value)


def test_a_config_that_is_a_folder_says_so_and_one_from_a_pipe_is_read(tmp_path, capsys, no_ray):
    """`--config somedir/` and `--config <(...)` were "no such file": the first is refused for
    what it is, the second (the shell's process substitution: a pipe) is read."""
    import os
    import threading

    from tests.conftest import exits_2

    err = exits_2(["--config", str(tmp_path)], capsys)
    assert (
        err == f"error: --config {tmp_path} is a folder, not a file; give a YAML file of settings such as "
        "configs/cifar-local.yaml\n"
    )
    read_end, write_end = os.pipe()  # as the shell's <(...) makes it: /dev/fd/63, the writer there first
    writer = threading.Thread(target=lambda: os.write(write_end, b"epochs: 3\nname: 0123\n") and os.close(write_end))
    writer.start()
    cfg, sources = parse_config(parser(), ["--config", f"/proc/self/fd/{read_end}"])
    writer.join()
    os.close(read_end)
    assert (cfg.epochs, cfg.name, sources["name"]) == (3, "0123", "file")
    fifo = tmp_path / "settings"
    os.mkfifo(fifo)
    # a named pipe nobody writes to is refused, not waited on for ever
    err = exits_2(["--config", str(fifo)], capsys)
    assert err == f"error: --config {fifo}: a pipe with nothing written to it\n"
