"""What a sweep shows and writes (training/sweep/tuner.py): one console line per trial event while it runs
(TrialEvents, a Tune callback on the driver), and at the end SWEEP/trials.csv (one row a trial),
SWEEP/trials.png (the metric against each swept setting), a table, and the best trial's command.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

from ray import tune as ray_tune

from training import storage
from training.config import TrainConfig
from training.driver.plots import sweep_png


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """A finished (or partly failed) sweep: its folder, one row a trial, the best trial's command."""

    sweep_dir: str
    rows: list[dict]  # trials.csv's rows
    best: dict | None  # the best trial's row; None where no trial reported
    best_command: str  # `python -m jobs.train ...` for the long run with the best trial's settings


def trial_label(trial) -> str:
    return f"trial-{trial.trial_id}"


def params_text(config: dict) -> str:
    return ", ".join(f"{k}={shown(v)}" for k, v in config.items())


def shown(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def last_line(error) -> str:
    """The one line of a trial's error: the job's own (TrialFailed's), else the exception's last line."""
    text = str(error).strip().splitlines() or [type(error).__name__]
    line = text[-1]
    for prefix in ("training.sweep.tuner.TrialFailed: ", "TrialFailed: "):
        line = line.split(prefix, 1)[-1]
    return line[:400]


# Tune pickles its callbacks into the experiment (tuner.pkl) and a restore unpickles them, so a
# TrialEvents cannot carry the caller's log function across: it finds it here, by its sweep's folder
# (training/sweep/tuner.py run_tuner sets it for the Tuner's fit), and a restored sweep's lines go
# where the first run's went.
EVENT_LOGS: dict = {}


class TrialEvents(ray_tune.Callback):
    """One line per trial event: started, epoch k reported, stopped early, finished, failed."""

    def __init__(self, sweep_dir: str, epochs: int, metric: str):
        self.sweep_dir, self.epochs, self.metric = sweep_dir, epochs, metric
        self.faults_shown = {}  # trial id: the fault lines shown so far

    def __setstate__(self, state: dict) -> None:
        """Restored from a sweep's experiment state: one pickled by an earlier version lacks the
        fields it did not keep yet."""
        self.__dict__.update({"sweep_dir": None, "faults_shown": {}} | state)

    def log(self, line: str) -> None:
        EVENT_LOGS.get(self.sweep_dir, say)(line)

    def on_trial_start(self, iteration, trials, trial, **info):
        self.log(f"{trial_label(trial)} started: {params_text(trial.config)}")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        figure = result.get(self.metric)
        if result.get("faults", 0) > self.faults_shown.get(trial.trial_id, 0):  # it survived a fault (a lost node)
            self.log(f"{trial_label(trial)} {result.get('fault')}")
            self.faults_shown[trial.trial_id] = result["faults"]
        self.log(f"{trial_label(trial)} epoch {result.get('epoch')}: {self.metric} {shown(figure)}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        epoch = (trial.last_result or {}).get("epoch", 0)
        if epoch < trial.config.get("epochs", self.epochs):
            self.log(f"{trial_label(trial)} stopped early after epoch {epoch} (the scheduler's decision)")
        else:
            self.log(f"{trial_label(trial)} finished: {epoch} epoch(s)")

    def on_trial_error(self, iteration, trials, trial, **info):
        self.log(f"{trial_label(trial)} failed: {error_of(trial)}")


def say(*parts) -> None:
    print(*parts, flush=True)


def error_of(trial) -> str:
    """The last line of the trial's error file (Tune writes the trial's traceback there)."""
    path = getattr(trial, "error_file", None) or ""
    try:
        with open(path) as f:
            return last_line(f.read())
    except OSError:
        return "see the trial's error.txt"


def trial_row(result, params: list[str], cfg: TrainConfig, metric: str, mode: str) -> dict:
    """trials.csv's row of one of Tune's Results."""
    trial_id = result.path.rstrip("/").rsplit("/", 1)[-1]
    frame = result.metrics_dataframe
    history = [] if frame is None or metric not in frame else [float(v) for v in frame[metric].dropna()]
    epochs = int(frame["epoch"].max()) if frame is not None and "epoch" in frame and len(frame) else 0
    faults = int(frame["faults"].max()) if frame is not None and "faults" in frame and len(frame) else 0
    config = trial_config(result)
    planned = int(config.get("epochs", cfg.epochs))
    best = (max if mode == "max" else min)(history) if history else None
    if result.error:
        status = "failed"
    elif not (result.metrics or {}).get("done"):  # Tune marks the last result of a finished or stopped trial
        status = "interrupted"
    else:
        status = "stopped early" if epochs < planned else "finished"
    wall = result.metrics.get("time_total_s") if result.metrics else None
    return {
        "trial": f"trial-{trial_id}",
        **{p: config.get(p) for p in params},
        f"best_{metric}": best,
        "epochs": epochs,
        "stopped_early": status == "stopped early",
        "status": status,
        "faults": faults,  # faults the trial's run survived (its faults.log has each)
        "wall_s": round(float(wall), 1) if wall is not None else None,
        "error": last_line(result.error) if result.error else "",
        "run_dir": storage.join(cfg.run_dir, f"trial-{trial_id}"),
    }


def trial_config(result) -> dict:
    """A trial's settings: its last result's, or where that has none, the params.json that Tune wrote
    into the trial's folder when the trial started; {} where neither is left. A trial that failed before
    its first report has a result only while Tune can ask its process for one: restored by a continued
    sweep, its Result's metrics are empty and Result.config is None."""
    if result.config is not None:
        return result.config
    try:
        with result.filesystem.open_input_stream(f"{result.path.rstrip('/')}/params.json") as f:
            config = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def finish(cfg: TrainConfig, dims, options, grid, log):
    """trials.csv, trials.png, the end table and the best trial's command; the SweepResult."""
    params = [d.key for d in dims if d.swept]
    metric = options.metric
    rows = sorted((trial_row(r, params, cfg, metric, options.mode) for r in grid), key=lambda r: r["trial"])
    for row in rows:
        if row["status"] == "stopped early" and not storage.exists(storage.join(row["run_dir"], "model.pt")):
            try:
                write_stopped_models(row["run_dir"])
            except Exception as e:  # noqa: BLE001  (the sweep's table comes first; the trial's folder says the rest)
                log(f"warning: {row['trial']}: no model.pt written from its checkpoints ({storage.first_line(e)})")
    storage.write_csv(storage.join(cfg.run_dir, "trials.csv"), rows)
    scored = [r for r in rows if r[f"best_{metric}"] is not None]
    if scored:
        storage.write_bytes(storage.join(cfg.run_dir, "trials.png"), sweep_png(scored, params, f"best_{metric}"))
    best = (max if options.mode == "max" else min)(scored, key=lambda r: r[f"best_{metric}"]) if scored else None
    command = best_command(cfg, {d.key: d.args[0] for d in dims if not d.swept} | pick(best, params)) if best else ""
    log(table(rows, params, metric))
    if best:
        log(f"best: {best['trial']} ({metric} {shown(best[f'best_{metric}'])}); for the long run:\n  {command}")
    log(f"sweep: {cfg.run_dir} (trials.csv, trials.png; each trial's run in its trial-* folder)")
    return SweepResult(sweep_dir=cfg.run_dir, rows=rows, best=best, best_command=command)


def write_stopped_models(run_dir: str) -> None:
    """A trial the scheduler stopped ends between epochs, before its run writes model.pt (Tune ends
    the trial's process at once): its model.pt and model_best.pt are written here from the trial's
    checkpoints, so jobs.predict takes any trial's model.pt."""
    import pyarrow.fs as pafs

    from training.driver.results import models_of_a_stopped_run

    fs, path, _ = storage.filesystem(run_dir)
    found = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    folders = sorted(i.base_name for i in found if i.type == pafs.FileType.Directory)
    models_of_a_stopped_run(run_dir, [storage.join(run_dir, f) for f in folders if f.startswith("checkpoint_epoch_")])


def pick(row: dict, keys: list[str]) -> dict:
    return {k: row[k] for k in keys}


def table(rows: list[dict], params: list[str], metric: str) -> str:
    columns = ["trial", *params, f"best_{metric}", "epochs", "status", "wall_s"]
    cells = [[shown(r[c]) if r[c] is not None else "-" for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    lines += [f"{r['trial']}: {r['error']}" for r in rows if r["error"]]
    return "\n".join(lines)


def best_command(cfg: TrainConfig, values: dict) -> str:
    """`python -m jobs.train` with the base config's settings that differ from the defaults, the
    best trial's values, and a name of its own beside the sweep's."""
    defaults = TrainConfig()
    settings = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)}
    settings = {k: v for k, v in settings.items() if v != getattr(defaults, k) and k not in ("name", "fresh")}
    settings |= values
    args = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            args += [flag, repr(value) if isinstance(value, float) else str(value)]
    return shlex.join(["python", "-m", "jobs.train", *args, "--name", f"{cfg.name}-best"])
