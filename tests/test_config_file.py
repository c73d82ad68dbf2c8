"""--config files: values, flags over the file, unknown keys and bad values as exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.train import main, parser
from training.config import ConfigError, TrainConfig, load_config_file, parse_config

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
        ("epochs: three\n", "epochs must be int"),
        ("optimizer: lamb\n", "optimizer must be one of sgd, adamw"),
        ("fresh: yes please\n", "fresh must be true or false"),
        ("- epochs\n", "expected a mapping"),
        ("epochs: [\n", "not valid YAML"),
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
    # a value the file gives is checked like the flag's
    assert main(["--config", _write(tmp_path, "epochs: 0\n")]) == 2
    assert "--epochs must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["cifar-local.yaml", "imagenet-cluster.yaml"])
def test_example_configs_load_and_plan_on_the_cluster_they_are_for(name):
    from training.planning import Capacity, plan_resources

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
    ],
)
def test_non_finite_and_out_of_range_numbers_exit_2_before_ray(flags, message, tree, no_ray, capsys):
    """nan fails no comparison (`lr <= 0` is False for it): a run trained on nan weights and said done."""
    from tests.conftest import exits_2

    assert exits_2(["--data", str(tree), *flags], capsys) == f"error: {message}\n"


def test_an_error_is_one_line_with_one_prefix_whatever_its_message_holds():
    from training.config import error_line

    assert error_line(ValueError("error: --data x\nthe rest")) == "error: --data x\\nthe rest"
    assert error_line("error: error: a\tb") == "error: a\\tb"
    assert error_line(ConfigError("--lr must be positive")) == "error: --lr must be positive"
