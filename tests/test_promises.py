"""Promises of the README and docs/guide.md held without a Ray cluster: how a local run starts Ray (no dashboard unless
--dashboard, then on loopback only), the console flags and the configuration printout, the
inputs read from local disk only, --val-fraction on prepared shards, and --amp bf16's
validation in float32. jobs.train.main runs up to ray.init, which a test replaces."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import jobs.train
from jobs.prepare import main as prepare
from training.config import ConfigError, TrainConfig
from training.driver import session

RAY_ENV = (  # what connect() and quiet_ray_env() may set in this process
    "RAY_ADDRESS",
    "RAY_JOB_ID",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
    "RAY_DEDUP_LOGS_SKIP_REGEX",
    "RAY_DATA_LOGGING_CONFIG",
    "PYTHONWARNINGS",
    "RAY_AUTH_MODE",
)


@pytest.fixture()
def until_ray_init(monkeypatch, capsys, tmp_path):
    """Runs jobs.train.main as a plain local run (no RAY_ADDRESS, Ray not started) until it calls
    ray.init, which records its arguments and stops the run there as a Ctrl-C would (exit 130).
    Returns (exit code, stdout, stderr, ray.init's keyword arguments or None)."""
    import ray

    for name in RAY_ENV:  # each put back as it was after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if name in ("RAY_ADDRESS", "RAY_JOB_ID") or not os.environ[name]:
            monkeypatch.delenv(name)
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)

    def run(argv):
        code = jobs.train.main([*argv, "--storage-path", str(tmp_path / "runs"), "--name", "r"])
        out, err = capsys.readouterr()
        assert len(calls) <= 1
        return code, out, err, (calls.pop() if calls else None)

    return run


def test_a_local_run_starts_no_dashboard_unless_asked_and_then_on_loopback_only(tree, until_ray_init):
    code, _, err, init = until_ray_init(["--data", str(tree)])
    assert code == 130 and err.startswith("stopped: interrupted while Ray started"), err
    assert init["address"] == "local" and init["include_dashboard"] is False and "dashboard_host" not in init
    code, _, _, init = until_ray_init(["--data", str(tree), "--dashboard"])
    assert code == 130 and init["address"] == "local"
    assert init["include_dashboard"] is True and init["dashboard_host"] == "127.0.0.1"


def _printed_config(out: str) -> dict[str, tuple[str, str]]:
    """{setting: (value, where it came from: "file", "flag" or "")} of the configuration printout."""
    lines = out.split("config:\n", 1)[1].splitlines()
    settings = {}
    for line in lines[: len(TrainConfig.__dataclass_fields__)]:
        key, value, *mark = line.split()
        settings[key] = (value, mark[0].strip("()") if mark else "")
    return settings


def test_the_configuration_printout_marks_what_came_from_the_file_and_the_flags(tree, tmp_path, until_ray_init):
    config = tmp_path / "run.yaml"
    config.write_text("epochs: 7\nbatch_size: 32\nlabel-smoothing: 0.1\n")
    argv = ["--data", str(tree), "--config", str(config), "--batch-size", "16", "--lr", "0.1"]
    code, out, _, _ = until_ray_init(argv)
    assert code == 130
    printed = _printed_config(out)
    assert set(printed) == set(TrainConfig.__dataclass_fields__)
    assert printed["epochs"] == ("7", "file") and printed["label_smoothing"] == ("0.1", "file")
    assert printed["batch_size"] == ("16", "flag") and printed["lr"] == ("0.1", "flag")  # a flag beats the file
    assert printed["data"] == (str(tree), "flag")
    assert printed["seed"] == ("0", "") and printed["optimizer"] == ("sgd", "")  # defaults: unmarked


def test_quiet_prints_no_configuration_and_verbose_keeps_rays_info_logs(tree, until_ray_init):
    code, out, _, init = until_ray_init(["--data", str(tree)])
    assert code == 130 and "config:\n" in out and init["logging_level"] == logging.WARNING
    code, out, err, init = until_ray_init(["--data", str(tree), "--quiet"])
    assert code == 130 and out == "" and init["logging_level"] == logging.WARNING
    assert err.startswith("stopped: ") and err.count("\n") == 1  # errors still print
    code, out, _, init = until_ray_init(["--data", str(tree), "--verbose"])
    assert code == 130 and "config:\n" in out and init["logging_level"] == logging.INFO


def test_verbose_keeps_ray_datas_progress_bars_which_a_plain_run_turns_off(monkeypatch):
    import ray.data

    ctx = ray.data.DataContext.get_current()
    for name in ("enable_progress_bars", "print_on_execution_start"):
        monkeypatch.setattr(ctx, name, True)  # Ray Data's defaults, put back after the test
    session.quiet_ray_data(verbose=True)
    assert ctx.enable_progress_bars and ctx.print_on_execution_start
    session.quiet_ray_data(verbose=False)
    assert not ctx.enable_progress_bars and not ctx.print_on_execution_start


@pytest.mark.parametrize(
    "flag, uri, message",
    [
        ("--config", "s3://bucket/run.yaml", "--config s3://bucket/run.yaml: read from local disk only"),
        ("--init-weights", "s3://bucket/r18.pt", "--init-weights s3://bucket/r18.pt: read from local disk only"),
        ("--preset", "s3://bucket/p.yaml", "s3://bucket/p.yaml: a preset file is read from local disk only"),
        ("--preset", "gs://bucket/p.json", "gs://bucket/p.json: a preset file is read from local disk only"),
    ],
)
def test_local_only_inputs_given_as_uris_are_one_line_before_ray(tree, tmp_path, until_ray_init, flag, uri, message):
    code, out, err, init = until_ray_init(["--data", str(tree), flag, uri])
    assert code == 2 and init is None, err  # Ray was not started
    assert err.startswith(f"error: {message}, not object storage; copy ") and err.count("\n") == 1, err
    assert err.endswith(" to this machine and give its path\n") and out == "" and not (tmp_path / "runs").exists()


def test_prepared_shards_keep_the_val_fraction_they_were_prepared_with(tree, tmp_path, until_ray_init):
    """jobs.prepare fixes the split: the run uses and records (config.json is cfg.to_dict(), as
    printed) the shards' fraction, and one that asks for another is told so before Ray starts."""
    from training.driver.inputs import check_inputs

    shards = str(tmp_path / "prepared")
    assert prepare([str(tree), shards, "--val-fraction", "0.1"]) == 0
    cfg, _ = check_inputs(TrainConfig(data=shards, storage_path=str(tmp_path / "runs")))
    assert cfg.val_fraction == 0.1  # not the default 0.2
    code, out, _, init = until_ray_init(["--data", shards])
    assert code == 130 and _printed_config(out)["val_fraction"] == ("0.1", "")
    code, out, err, init = until_ray_init(["--data", shards, "--val-fraction", "0.3"])
    assert code == 2 and init is None and out == ""
    assert err == (
        f"error: --val-fraction 0.3: {shards} was prepared with --val-fraction 0.1, which fixed its split; drop "
        "--val-fraction, or prepare the tree again with jobs.prepare --val-fraction 0.3\n"
    )
    assert until_ray_init(["--data", shards, "--val-fraction", "0.1"])[0] == 130  # the same one: fine
    with pytest.raises(ConfigError, match="prepared with --val-fraction 0.1"):
        check_inputs(TrainConfig(data=shards, val_fraction=0.5, storage_path=str(tmp_path / "runs")))


def test_amp_bf16_trains_in_bfloat16_and_validates_in_float32():
    """docs/guide.md: validation stays in float32. evaluate() on a --amp bf16 learner computes every
    layer in float32 and gives, to the bit, the figures of the same weights at --amp off; the
    control: the learner's training autocast does compute in bfloat16, which the hooks see."""
    from bench.loop_checks import cpu_learner
    from training.model import resnet18
    from training.worker import loop

    torch.manual_seed(0)
    model = resnet18(3, small_stem=True)
    seen = []
    for module in model.modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
            module.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    images = torch.randint(0, 256, (6, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    batch = {"image": images, "label": torch.tensor([0, 1, 2, 0, 1, 2])}
    bf16 = cpu_learner(TrainConfig(amp="bf16"), model, steps_per_epoch=4)
    with torch.no_grad(), bf16.autocast():
        bf16.model(bf16.normalize(images))
    assert set(seen) == {torch.bfloat16}  # the control
    seen.clear()
    with torch.no_grad():
        got = loop.evaluate(bf16, [batch], num_classes=3)
    assert seen and set(seen) == {torch.float32}
    with torch.no_grad():
        full = loop.evaluate(cpu_learner(TrainConfig(amp="off"), model, steps_per_epoch=4), [batch], 3)
    assert got == full
