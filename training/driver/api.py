"""The job driven from Python: a notebook, a pipeline's step or a sweep's trial calls `fit` and gets
a typed result back, with the checks, the run folder and the figures of `python -m jobs.train`.

    from training import fit

    result = fit({"data": "~/photos", "epochs": 10, "name": "photos-r18"},
                 callbacks=[lambda record: print(record.epoch, record.val.acc)])
    print(result.best_val_acc, result.model_path)

`config`: a TrainConfig, a dict of its fields (as a --config file has them), or the path of a YAML
file. A mistake raises JobError with the line the CLI prints (`exit_code` 2 before training, 1 when
training fails, 130/143 when stopped), never SystemExit. Callbacks are called on the driver after
each epoch, in epoch order, with the epoch's typed record (training/records.py EpochRecord); one that
returns STOP ends the run after that epoch, as --stop-after does (the same call resumes it).
"""

from __future__ import annotations

import dataclasses
import os
import time

from augment.errors import PresetError
from augment.presets import load_preset
from training import storage
from training.config import ConfigError, TrainConfig, error_line
from training.driver import lease
from training.driver.epochs import EpochCallback
from training.driver.flags import FlagParser, add_arguments, parse_config
from training.status import STOP
from training.storage import StorageError

__all__ = ["fit", "RunResult", "JobError", "STOP", "EpochCallback"]


class JobError(RuntimeError):
    """The job refused or failed: `str(e)` is the CLI's one line, `exit_code` its exit code."""

    def __init__(self, line: str, exit_code: int):
        super().__init__(line)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class RunResult:
    """A finished (or --stop-after / STOP-ended) run: where it lies and its summary.json."""

    run_dir: str
    config: TrainConfig
    summary: dict  # summary.json's figures
    model_path: str  # model.pt: the last epoch's weights
    best_model_path: str  # model_best.pt: the best validation accuracy's
    ema_model_path: str | None = None  # model_ema.pt: the weights' moving average (--model-ema), else None

    @property
    def epochs(self) -> int:
        return int(self.summary["epochs"])

    @property
    def val_acc(self) -> float:
        return float(self.summary["val_acc"])

    @property
    def best_val_acc(self) -> float:
        return float(self.summary["best_val_acc"])


class _Parser(FlagParser):
    """jobs.train's flags, whose mistakes raise ConfigError instead of exiting."""

    def exit(self, status=0, message=None):
        raise ConfigError((message or "").strip().removeprefix("error: "))


def as_config(config) -> TrainConfig:
    """`config` as a TrainConfig, through the checks the CLI makes (ConfigError for a mistake)."""
    if isinstance(config, TrainConfig):
        return config
    ap = _Parser(prog="training.fit")
    ap.add_argument("--config")
    add_arguments(ap)
    if isinstance(config, (str, os.PathLike)):
        return parse_config(ap, ["--config", os.fspath(config)])[0]
    if not isinstance(config, dict):
        raise ConfigError(f"fit: config is a {type(config).__name__}; give a TrainConfig, a dict or a YAML file's path")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    argv = []
    for key, value in config.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(f"fit: unknown setting {str(key)[:80]!r}; valid settings: {', '.join(sorted(fields))}")
        flag = "--" + name.replace("_", "-")
        value = _one_value(fields[name], key, value)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return parse_config(ap, argv)[0]


def _one_value(field, key, value):
    """A dict's value as one flag's: a list or tuple of names joins with commas where the setting is
    comma-separated (log_to); any other collection is refused in one line, not passed on as its repr."""
    listed = isinstance(value, (list, tuple))
    if listed and field.metadata.get("comma_list"):
        if all(isinstance(v, str) for v in value):
            return ",".join(value)
        raise ConfigError(f"fit: {key} takes names: give a list of strings or one comma-separated string")
    if listed or isinstance(value, (dict, set, frozenset)):
        raise ConfigError(f"fit: {str(key)[:80]} must be one value, got a {type(value).__name__}; give a single value")
    return value


def fit(config, callbacks: list[EpochCallback] | tuple = (), *, log=None, share=None) -> RunResult:
    """Train as `python -m jobs.train` does with `config`; the run's lines go to `log` (default: print).
    `share`: the part of the cluster to plan for (training/driver/planning.py share_of; a sweep's trial)."""
    from training.driver.inputs import prepare
    from training.driver.session import connect  # looked up at the call: the tests replace it
    from training.forms.data import DataError

    log = log or (lambda *a: print(*a, flush=True))
    try:
        cfg, tree, name, preset = prepare(as_config(config))
    except (DataError, ConfigError, PresetError, StorageError) as e:
        raise JobError(error_line(e), 2) from None
    try:
        return _train(cfg, tree, name, preset, list(callbacks), log, connect, share)
    finally:
        lease.release(cfg.run_dir)


def _train(cfg, tree, name, preset, callbacks, log, connect, share=None) -> RunResult:
    from training.driver import job
    from training.driver.session import TerminatedWhileStarting, start_failure
    from training.forms.data import DataError

    started = time.time()
    try:
        own = connect(cfg.verbose, cfg.dashboard)
    except TerminatedWhileStarting:  # ray.init's handler would have exited the caller's process (SystemExit 15)
        raise JobError("stopped: terminated (SIGTERM) while Ray started", 143) from None
    except Exception as e:  # noqa: BLE001  (Ray's own start-up; one line, as the CLI says it)
        raise JobError(error_line(f"Ray did not start: {start_failure(e)}"), 1) from None
    preset = preset or load_preset(name)
    try:
        summary = job.run(
            cfg, tree, preset, log=log, launched_at=started, own_cluster=own, callbacks=callbacks, share=share
        )
    except (ConfigError, DataError, StorageError) as e:
        raise JobError(error_line(e), 2) from None
    except job.Interrupted as e:
        raise JobError(f"stopped: {e}", 130) from None
    except job.TrainingFailed as e:
        raise JobError(error_line(e), 1) from None
    run_dir = cfg.run_dir
    return RunResult(
        run_dir=run_dir,
        config=cfg,
        summary=summary,
        model_path=storage.join(run_dir, "model.pt"),
        best_model_path=storage.join(run_dir, "model_best.pt"),
        ema_model_path=storage.join(run_dir, "model_ema.pt") if cfg.model_ema else None,
    )
