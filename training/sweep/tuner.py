"""A sweep: Ray Tune over the job. Each Tune trial is a small driver function that trains one normal
run (training.driver.api.fit) under STORAGE_PATH/SWEEP/trial-<id>/, planned for its share of the cluster
(training/driver/planning.py share_of), and reports each epoch's figures to Tune from an epoch callback;
Tune's own schedulers (ASHA), searchers (random, Optuna) and experiment restore do the rest.

    from training import tune
    sweep = tune({"data": "~/photos", "epochs": 10, "name": "photos-lr"}, "space.yaml",
                 trials=16, max_concurrent=2)
    print(sweep.best_command)

Layout: SWEEP/tune/ is Tune's experiment (what restore reads), SWEEP/trial-<id>/ each trial's run,
SWEEP/trials.csv and SWEEP/trials.png the sweep's table and plot (training/sweep/report.py).
A trial that ASHA stops is ended by Tune (its actor exits): the trial's TorchTrainer, helper
actors and placement groups are owned by that actor's process and go with it, as does its lease.
The trials of a sweep that started its own cluster run Ray Train as a local run does
(training/driver/session.py owns_cluster).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

from augment.errors import PresetError
from training import ray_private
from training.config import ConfigError, TrainConfig, error_line
from training.driver import lease
from training.driver.api import JobError, as_config, fit
from training.driver.session import how_stopped, sigint_kept, sigterm_as_interrupt
from training.storage import RUN_MARKER, StorageError
from training.sweep.space import Dimension, check_space, read_space

TRIAL_DRIVER_CPUS = 0  # the Tune trial itself only waits on its TorchTrainer; its workers take the share
METRICS = ("val_acc", "val_loss", "val_top5", "train_acc", "train_loss")


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """How the sweep runs (jobs.tune's flags beside the base config's)."""

    trials: int = 8  # samples drawn from the space (each grid() value gets this many)
    max_concurrent: int = 2  # trials at once; each plans for 1/max_concurrent of the cluster
    scheduler: str = "asha"  # asha: Tune's ASHAScheduler stops poor trials early; none: every trial runs out
    grace_epochs: int = 1  # ASHA never stops a trial before this many epochs
    metric: str = "val_acc"
    mode: str = "max"
    search: str = "random"  # random: Tune's variant generator; optuna: Tune's OptunaSearch
    trial_cpus: float = 0  # CPUs each trial plans for; 0: the cluster's / max_concurrent
    trial_gpus: float = 0  # GPUs each trial plans for; 0: the cluster's / max_concurrent

    def check(self, dims: list[Dimension]) -> None:
        """ConfigError for a mistake (before Ray)."""
        if self.trials < 1 or self.max_concurrent < 1 or self.grace_epochs < 1:
            raise ConfigError("--trials, --max-concurrent and --grace-epochs must be 1 or more")
        if self.metric not in METRICS:
            raise ConfigError(f"--metric {self.metric}: use one of {', '.join(METRICS)}")
        if self.mode not in ("max", "min") or self.scheduler not in ("asha", "none"):
            raise ConfigError("--mode takes max or min; --scheduler asha or none")
        if self.search == "optuna":
            try:
                import optuna  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "--search optuna: Optuna is not installed; pip install optuna, or use --search random"
                ) from None
            if any(d.kind == "grid" for d in dims):
                raise ConfigError("--search optuna draws every setting itself; use choice() instead of grid()")
        elif self.search != "random":
            raise ConfigError(f"--search {self.search}: use random or optuna")


def trial_run_name(trial_id: str) -> str:
    return f"trial-{trial_id}"


def run_trial(params: dict, *, base: dict, share) -> None:
    """A Tune trial: the base config with the trial's values, trained as one run named after the
    trial, each epoch's figures reported to Tune. A run that fails raises its one line: Tune
    records it as the trial's error, and the sweep goes on."""
    from ray import tune as ray_tune

    config = base | params | {"name": trial_run_name(ray_tune.get_context().get_trial_id()), "fresh": False}
    last = []  # the last epoch's figures: reported once the run has written its files (below)
    faults = []  # the run's fault lines (a lost node it resumed after): they travel with its next report

    def heard(*parts):
        line = " ".join(str(p) for p in parts)
        if line.startswith("fault: "):
            faults.append(line)

    def report(record):
        numbers = {k: float(v) for k, v in record.metrics_row().items() if isinstance(v, (int, float))}
        numbers |= {"epoch": record.epoch, "faults": len(faults), "fault": faults[-1] if faults else ""}
        if record.epoch >= int(config["epochs"]):
            last.append(numbers)
        else:
            ray_tune.report(numbers)

    try:
        fit(config, [report], log=heard, share=share)
    except JobError as e:
        raise TrialFailed(str(e)) from None
    if last:  # reported after fit: the scheduler ends a trial at its last epoch, before model.pt is written
        ray_tune.report(last[-1])


class TrialFailed(RuntimeError):
    """A trial's run refused or failed: its message is the job's own line."""


def base_config(config, name: str | None, storage_path: str | None) -> TrainConfig:
    """The sweep's base TrainConfig (through the CLI's checks), with the sweep's name and an
    absolute storage path: trials run in Tune's processes, whose working folder is not this one's."""
    cfg = as_config(config)
    cfg = dataclasses.replace(cfg, name=name or cfg.name, storage_path=storage_path or cfg.storage_path)
    if not cfg.name:
        cfg = dataclasses.replace(cfg, name=time.strftime("sweep-%Y%m%d-%H%M%S"))
    return cfg.with_defaults_resolved()


def check_sweep(cfg: TrainConfig, space: str, options: SweepOptions) -> list[Dimension]:
    """Every check that needs no Ray: the space, the options, the base config's data and files,
    and the sweep's folder; the dimensions. ConfigError/DataError/... (exit 2) for a mistake."""
    from training.driver.inputs import check_inputs

    dims = read_space(space)
    options.check(dims)
    base = trial_base(cfg)
    check_space(dims, base, as_config)
    # the data, the preset and the files named: once, not in every trial (as a trial's run, whose
    # folder lies inside the sweep's)
    check_inputs(dataclasses.replace(cfg, storage_path=cfg.run_dir, name="trial-check"))
    check_trial_resources(options)
    sweep_dir = cfg.run_dir
    lease.check_free(sweep_dir, cfg.name)
    if "://" not in sweep_dir and os.path.isdir(sweep_dir):
        files = set(os.listdir(sweep_dir)) - {lease.LEASE_FILE, RUN_MARKER}  # a sweep stopped before Tune began
        if files and not os.path.isdir(os.path.join(sweep_dir, "tune")):
            raise ConfigError(
                f"--name {cfg.name}: {sweep_dir} holds files that are not a sweep's; choose another --name"
            )
    return dims


def check_trial_resources(options: SweepOptions) -> None:
    """--trial-cpus/--trial-gpus against this machine, for a sweep that starts its cluster here (a
    joined cluster's are checked once connected: training/driver/planning.py share_of)."""
    from training.driver.inputs import cuda_devices, local_gpus
    from training.driver.planning import machine_cores
    from training.driver.session import starts_local_cluster

    if options.trial_cpus < 0 or options.trial_gpus < 0:
        raise ConfigError("--trial-cpus and --trial-gpus must be 0 (an equal share) or more")
    if options.trial_gpus != int(options.trial_gpus):  # the planner gives each train worker whole GPUs
        raise ConfigError(
            f"--trial-gpus {options.trial_gpus:g}: a trial's train workers take whole GPUs; give 1, 2, ..., "
            "or lower --max-concurrent so that each trial gets one"
        )
    if not starts_local_cluster():
        return
    for flag, asked, have, what in (
        ("--trial-gpus", options.trial_gpus, lambda: local_gpus() or cuda_devices(), "GPU(s) that CUDA shows"),
        ("--trial-cpus", options.trial_cpus, machine_cores, "CPU(s)"),
    ):
        if asked and asked > (found := have()):
            raise ConfigError(
                f"{flag} {asked:g}: this machine has {found} {what}, and a sweep without RAY_ADDRESS starts its "
                f"cluster here; give {found} or less (0: an equal share), or set RAY_ADDRESS to join a bigger cluster"
            )


def trial_base(cfg: TrainConfig) -> dict:
    """The base config as a dict every trial starts from: its run goes under the sweep's folder."""
    data = cfg.to_dict() | {"storage_path": cfg.run_dir}
    if data["data"] and "://" not in data["data"]:
        data["data"] = os.path.abspath(os.path.expanduser(data["data"]))
    return {k: v for k, v in data.items() if v is not None}


def tune(config, space: str, options: SweepOptions | None = None, *, name=None, storage_path=None, log=None):
    """Run (or continue) a sweep of `config` (as training.fit takes it) over the --space file
    `space`; a SweepResult. JobError with the CLI's line for a mistake (exit_code 2) or a sweep
    that could not run (1); a failed trial is a row with its reason, not an error."""
    from training.forms.data import DataError

    options = options or SweepOptions()
    log = log or (lambda *a: print(*a, flush=True))
    try:
        cfg = base_config(config, name, storage_path)
        dims = check_sweep(cfg, space, options)
        held = lease.acquire(cfg.run_dir, cfg.name, log, job="jobs.tune")  # until the sweep ends
    except (ConfigError, DataError, PresetError, StorageError) as e:
        raise JobError(error_line(e), 2) from None
    try:
        with sigterm_as_interrupt() as terminated:  # SIGTERM stops the sweep as Ctrl-C does (Tune saves it)
            try:
                share = connect_and_share(cfg, options, log)
            except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM while Ray starts: no trial began
                how, code = how_stopped(e, terminated)
                raise JobError(f"stopped: {how} before the sweep began; the same command starts it", code) from None
            grid = run_tuner(cfg, dims, options, share, log)
        from training.sweep.report import finish

        result = finish(cfg, dims, options, grid, log)
    finally:
        held.release()
    # the grid lists the trials made so far: those Tune had not drawn yet are unfinished too
    expected = options.trials * math.prod(len(d.args) for d in dims if d.kind == "grid")
    unfinished = sum(r["status"] == "interrupted" for r in result.rows) + max(0, expected - len(result.rows))
    if unfinished:  # Ctrl-C or SIGTERM (Tune saves the experiment and returns)
        how, code = how_stopped(terminated=terminated)
        line = f"stopped: {how} with {unfinished} trial(s) unfinished; the same command continues the sweep"
        raise JobError(line, code)
    return result


def connect_and_share(cfg: TrainConfig, options: SweepOptions, log):
    """Join or start Ray; one trial's share of the cluster, checked by planning the base config
    for it (JobError 2 where one trial cannot fit)."""
    from training.driver.planning import cluster_capacity, plan_resources, share_of  # as connect, below
    from training.driver.session import connect, start_failure  # looked up at the call: the tests replace it

    try:
        # the trials' own processes print to Ray's logs (their runs' files keep what matters), not
        # between the sweep's lines; --verbose shows them
        connect(cfg.verbose, cfg.dashboard, worker_logs=cfg.verbose)
    except Exception as e:  # noqa: BLE001  (Ray's own start-up)
        raise JobError(error_line(f"Ray did not start: {start_failure(e)}"), 1) from None
    try:
        capacity = cluster_capacity()
        share = share_of(capacity, options.max_concurrent, options.trial_cpus, options.trial_gpus)
    except ConfigError as e:
        raise JobError(error_line(e), 2) from None
    if capacity.gpus and not share.gpus and cfg.device != "cpu":
        log(
            f"note: {capacity.gpus} GPU(s) among {options.max_concurrent} trials at once leaves each trial none: "
            f"the trials train on CPUs; --max-concurrent {capacity.gpus} gives each one a GPU"
        )
    try:
        plan_resources(cfg, share)
    except ConfigError as e:
        where = f"one trial's share ({share.cpus} CPU, {share.gpus} GPU)"
        raise JobError(error_line(f"{where} cannot hold its run: {e}; lower --max-concurrent"), 2) from None
    return share


def run_tuner(cfg: TrainConfig, dims: list[Dimension], options: SweepOptions, share, log):
    """Tune's Tuner over the trials, restored from SWEEP/tune where an earlier run of the same
    sweep left it (finished trials kept, unfinished ones run again: their runs resume from their
    own checkpoints); Tune's ResultGrid."""
    from ray import tune as ray_tune

    from training.sweep.report import EVENT_LOGS, TrialEvents

    # each trial's driver on the head: a lost worker node costs a trial's run (which may resume), not its driver
    pinned = {"CPU": TRIAL_DRIVER_CPUS, ray_private.head_node_resource(): 0.001}
    trainable = ray_tune.with_resources(ray_tune.with_parameters(run_trial, base=trial_base(cfg), share=share), pinned)
    param_space = {d.key: d.tune_domain() for d in dims}
    path = cfg.run_dir.rstrip("/") + "/tune"
    if ray_tune.Tuner.can_restore(path):
        log(f"sweep {cfg.name}: continuing from {path} (finished trials are kept)")
        tuner = ray_tune.Tuner.restore(path, trainable, resume_unfinished=True, param_space=param_space)
    else:
        tuner = ray_tune.Tuner(
            trainable,
            param_space=param_space,
            tune_config=ray_tune.TuneConfig(
                metric=options.metric,
                mode=options.mode,
                num_samples=options.trials,
                max_concurrent_trials=options.max_concurrent,
                scheduler=scheduler(cfg, options),
                search_alg=searcher(options),
                trial_dirname_creator=lambda trial: trial.trial_id,
                trial_name_creator=lambda trial: trial_run_name(trial.trial_id),
            ),
            run_config=ray_tune.RunConfig(
                name="tune",
                storage_path=cfg.run_dir,
                verbose=0,
                callbacks=[TrialEvents(cfg.run_dir, cfg.epochs, options.metric)],
                failure_config=ray_tune.FailureConfig(max_failures=0),
            ),
        )
    # Tune's new console output prints its configuration box even at verbose=0; its legacy one,
    # at 0, prints nothing: TrialEvents' lines are the sweep's console (a user's setting stays)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # a failed trial's traceback goes to its error.txt; TrialEvents' line gives its reason on the console
    os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
    EVENT_LOGS[cfg.run_dir] = log
    tune_log = logging.getLogger("ray.tune.tune")  # its "Trials did not complete: [...]": the end table lists them
    tune_log.addFilter(said_by_the_table)
    try:
        with sigint_kept():  # Tune leaves its SIGINT handler set after a stopped sweep, as Ray Train's fit does
            return tuner.fit()
    finally:
        EVENT_LOGS.pop(cfg.run_dir, None)
        tune_log.removeFilter(said_by_the_table)


def said_by_the_table(record: logging.LogRecord) -> bool:
    """A logging filter: False for Tune's closing list of the trials that did not complete."""
    return not record.getMessage().startswith("Trials did not complete")


def scheduler(cfg: TrainConfig, options: SweepOptions):
    if options.scheduler == "none":
        return None
    from ray.tune.schedulers import ASHAScheduler

    grace = min(options.grace_epochs, cfg.epochs)
    return ASHAScheduler(time_attr="epoch", max_t=cfg.epochs, grace_period=grace, reduction_factor=2)


def searcher(options: SweepOptions):
    if options.search != "optuna":
        return None  # Tune's BasicVariantGenerator
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch()
