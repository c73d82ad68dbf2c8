"""Live experiment tracking (`--log-to tensorboard,mlflow,wandb`): the driver logs the whole config as
parameters at the start, each epoch's figures as rank 0 makes them (training/driver/epochs.py hands them
on), with `--log-every N` the loss, learning rate and images/s every N steps of rank 0, and the
run's files as artifacts at the end. The driver logs, not the workers: it has the credentials and
the network, and a tracker then costs the training nothing.

- tensorboard: event files under RUN_DIR/tensorboard, flushed every epoch (torch's SummaryWriter
  where `tensorboard` is installed, else tensorboardX);
- mlflow: to MLFLOW_TRACKING_URI where set, else a SQLite store under the run directory
  (RUN_DIR/mlflow.db, artifacts in RUN_DIR/mlartifacts; `mlflow ui --backend-store-uri
  sqlite:///RUN_DIR/mlflow.db` shows it);
- wandb: online where the user is logged in (WANDB_API_KEY or `wandb login`), else offline under
  RUN_DIR/wandb (`wandb sync` uploads it later).

A resumed run continues the same MLflow and W&B run: their ids are kept in RUN_DIR/trackers.json.
A tracker that cannot be imported is refused before Ray (one line naming the extra); one that cannot
be reached, or fails mid-run, costs one warning line and is left out, never the training.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import netrc
import os
import secrets
import time

from training import storage
from training.config import ConfigError
from training.driver.plots import scalar_tag
from training.records import StepFigures

TRACKERS = ("tensorboard", "mlflow", "wandb")
IDS_FILE = "trackers.json"


def parse_log_to(value: str) -> tuple[str, ...]:
    """--log-to's names (comma-separated, any order); ConfigError for an unknown one or a library that
    is not installed. Light: the libraries are looked for, not imported."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in (value or "").split(",") if n.strip()))
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"--log-to {value}: unknown tracker {name[:40]!r}; give any of {', '.join(TRACKERS)}")
        module = {"tensorboard": ("torch.utils.tensorboard", "tensorboardX")}.get(name, (name,))
        if not any(_findable(m, importlib.util) for m in module):
            extra = "tensorboard" if name == "tensorboard" else name
            raise ConfigError(f"--log-to {name}: {module[-1]} is not installed; pip install -e '.[{extra}]'")
    return names


def _findable(module: str, util) -> bool:
    try:
        if module == "torch.utils.tensorboard":  # needs `tensorboard` itself
            return util.find_spec("tensorboard") is not None
        return util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class Tracking:
    """The run's trackers, as an epoch callback (training/driver/epochs.py) with start and finish."""

    def __init__(self, cfg, names: tuple[str, ...], warn):
        self.cfg, self.warn = cfg, warn
        self.ids = self._saved_ids()
        self.sinks = [SINKS[name](cfg, self.ids) for name in names]

    def _saved_ids(self) -> dict:
        path = storage.join(self.cfg.run_dir, IDS_FILE)
        try:
            return json.loads(storage.read_bytes(path)) if storage.exists(path) else {}
        except (OSError, ValueError):
            return {}

    def _each(self, what: str, *args) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, what)(*args)
            except Exception as e:  # noqa: BLE001  (a tracker's library or server: whatever it raises)
                self.sinks.remove(sink)
                self.warn(
                    f"warning: --log-to {sink.name}: {what} failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    f"); the run goes on without it"
                )

    def start(self, config: dict) -> None:
        self._each("start", config)
        with_ids = {s.name: s.run_id for s in self.sinks if getattr(s, "run_id", None)}
        if with_ids and with_ids != self.ids:
            storage.write_json(storage.join(self.cfg.run_dir, IDS_FILE), self.ids | with_ids)

    def on_epoch_end(self, record) -> None:
        row = record.metrics_row() | record.timings_row()  # made from the record's fields, named as the files name them
        figures = {k: float(v) for k, v in row.items() if _number(v) and k != "epoch"}
        self._each("epoch", record.epoch, figures)

    def on_step(self, point: StepFigures) -> None:
        self._each("step", point)

    def finish(self, files: list[str], ok: bool = True) -> None:
        """The run's files as artifacts (those that exist), and each tracker's run ended (failed: not `ok`)."""
        self._each("finish", [f for f in files if storage.exists(f)], ok)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _flat(config: dict) -> dict:
    return {k: ("" if v is None else str(v))[:500] for k, v in config.items()}


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, cfg, ids):
        self.cfg, self.writer = cfg, None

    def start(self, config: dict) -> None:
        if storage.is_uri(self.cfg.run_dir):
            raise OSError("event files are written live only to a local run directory; the run's end writes them")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from tensorboardX import SummaryWriter
        self.writer = SummaryWriter(log_dir=os.path.join(self.cfg.run_dir, "tensorboard"))
        self.writer.add_text("config", json.dumps(config, indent=1, default=str))

    def epoch(self, epoch: int, figures: dict) -> None:
        for key, value in figures.items():
            self.writer.add_scalar(scalar_tag(key), value, epoch)  # the tags the run's end writes otherwise
        self.writer.flush()  # readable while the run goes

    def step(self, point: StepFigures) -> None:
        for key, value in point.scalars().items():
            self.writer.add_scalar(f"step/{key}", value, point.step)

    def finish(self, files: list[str], ok: bool) -> None:
        self.writer.close()


class MlflowSink:
    name = "mlflow"

    def __init__(self, cfg, ids):
        self.cfg, self.run_id, self.client = cfg, ids.get("mlflow"), None

    def start(self, config: dict) -> None:
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # an unreachable server: a line soon
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        local = not uri
        if local:
            if storage.is_uri(self.cfg.run_dir):
                raise OSError("a run on object storage needs MLFLOW_TRACKING_URI (a server) for MLflow")
            uri = f"sqlite:///{os.path.join(self.cfg.run_dir, 'mlflow.db')}"
        self.client = MlflowClient(tracking_uri=uri)
        if self.run_id is None:
            experiment = self.client.get_experiment_by_name("ray-gpu-augment")
            if experiment is None:
                where = {"artifact_location": f"file://{self.cfg.run_dir}/mlartifacts"} if local else {}
                experiment_id = self.client.create_experiment("ray-gpu-augment", **where)
            else:
                experiment_id = experiment.experiment_id
            self.run_id = self.client.create_run(experiment_id, run_name=self.cfg.name).info.run_id
            from mlflow.entities import Param

            params = [Param(k, v) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def epoch(self, epoch: int, figures: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, epoch) for k, v in figures.items()])

    def step(self, point: StepFigures) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"step_{k}", v, now, point.step) for k, v in point.scalars().items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, files: list[str], ok: bool) -> None:
        for path in files:
            if not storage.is_uri(path):
                self.client.log_artifact(self.run_id, path)
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


class WandbSink:
    name = "wandb"

    def __init__(self, cfg, ids):
        self.cfg, self.run_id, self.run = cfg, ids.get("wandb"), None

    def start(self, config: dict) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        logged_in = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has_wandb()
        mode = os.environ.get("WANDB_MODE") or ("online" if logged_in else "offline")
        if storage.is_uri(self.cfg.run_dir) and mode == "offline":
            raise OSError("offline W&B writes to a local run directory; `wandb login` for a run on object storage")
        self.run_id = self.run_id or secrets.token_hex(4)  # W&B's own ids are 8 characters of [0-9a-z]
        where = {} if storage.is_uri(self.cfg.run_dir) else {"dir": self.cfg.run_dir}
        project = os.environ.get("WANDB_PROJECT", "ray-gpu-augment")
        self.run = wandb.init(
            project=project, name=self.cfg.name, id=self.run_id, resume="allow", mode=mode, config=config, **where
        )
        self.run.define_metric("epoch")
        self.run.define_metric("epoch/*", step_metric="epoch")
        self.run.define_metric("train_step")
        self.run.define_metric("step/*", step_metric="train_step")

    def epoch(self, epoch: int, figures: dict) -> None:
        self.run.log({"epoch": epoch, **{f"epoch/{k}": v for k, v in figures.items()}})

    def step(self, point: StepFigures) -> None:
        self.run.log({"train_step": point.step, **{f"step/{k}": v for k, v in point.scalars().items()}})

    def finish(self, files: list[str], ok: bool) -> None:
        import wandb

        local = [f for f in files if not storage.is_uri(f)]
        if local:
            artifact = wandb.Artifact(f"{self.cfg.name}-files", type="model")
            for path in local:
                artifact.add_file(path)
            self.run.log_artifact(artifact)
        self.run.finish(exit_code=0 if ok else 1)


def _netrc_has_wandb() -> bool:
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


SINKS = {"tensorboard": TensorBoardSink, "mlflow": MlflowSink, "wandb": WandbSink}
