"""Train ResNet18 on an image folder with GPU (Kornia) augmentation on Ray.

    python -m jobs.train                                  # bundled digits data, local Ray
    python -m jobs.train --data ~/photos --epochs 30      # your folder: <class>/<image>
    python -m jobs.train --config configs/cifar-local.yaml --epochs 2   # a file; flags win
    ray job submit --working-dir . -- python -m jobs.train --data s3://bucket/photos \\
        --storage-path s3://bucket/runs --name photos-r18

Exit codes: 0 done; 2 bad input (found before training starts); 1 training failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from augment.errors import PresetError, check_preset_name
from training import console
from training.config import ConfigError, FlagParser, add_arguments, parse_config
from training.data import DataError
from training.inputs import check_inputs, check_sizes_and_device, preset_name, start_fresh
from training.storage import StorageError


def parser() -> argparse.ArgumentParser:
    ap = FlagParser(prog="python -m jobs.train", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--config",
        metavar="FILE",
        help=(
            "YAML file of settings (keys: the flags below, e.g. batch_size: 256); flags given here override it. "
            "Examples in configs/"
        ),
    )
    add_arguments(ap)
    return ap


# Ray's own notices about what this job does by design, which a user cannot act on (docs/design.md,
# "Console"), matched on what the driver prints of other processes' output:
# - Ray Data's augment actors take their constructor arguments from the object store and restart
#   when they die (ray-project/ray#57733);
# - a node that went: the raylet's death notice (with its last 20 log lines), the GCS's "marked
#   dead", a placement group's bundle it cannot free there; the job's fault line names the node
#   and faults.log keeps Ray's word on it (training/faults.py);
# - the worker processes that a restart starts at once.
RAY_NOTICES_SKIPPED = "|".join(
    (
        r"has constructor arguments in the object store and max_restarts > 0",
        r"Raylet is terminated\. Termination is unexpected",
        r"has been marked dead because the detector has missed too many heartbeats",
        r"gcs_placement_group_scheduler\.cc:\d+: Failed to remove",
        r"PYTHON worker processes have been started on node",
    )
)


def quiet_ray_env(verbose: bool = False) -> dict:
    """Keep the console readable: Ray Data logs only warnings, no deprecation noise from
    Ray's own internals, none of RAY_NOTICES_SKIPPED. Environment variables reach the
    processes of a cluster started here, and Ray reads the skip pattern when it is imported,
    so this runs before `import ray`; it imports nothing heavy. Returns ray.init's logging
    arguments. `verbose` keeps Ray's INFO logs (and its notices)."""
    if verbose:
        return {"logging_level": logging.INFO}
    import training

    skip = os.environ.get("RAY_DEDUP_LOGS_SKIP_REGEX")
    if not skip or RAY_NOTICES_SKIPPED not in skip:  # the user's own pattern stays
        os.environ["RAY_DEDUP_LOGS_SKIP_REGEX"] = f"{skip}|{RAY_NOTICES_SKIPPED}" if skip else RAY_NOTICES_SKIPPED
    os.environ.setdefault(
        "RAY_DATA_LOGGING_CONFIG", os.path.join(os.path.dirname(training.__file__), "ray_data_logging.yaml")
    )
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    if "ray" not in sys.modules and not (os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID")):
        # connect() will start a local cluster. Token authentication stays on, as Ray 2.60 turns it on
        # for a new one; saying so spares the console Ray's warning that it did (RAY_AUTH_MODE=disabled
        # opts out). Only before `import ray`: Ray's client reads the mode then, and a cluster started
        # in token mode would refuse a client that read another.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    return {"logging_level": logging.WARNING}


def quiet_ray_data(verbose: bool = False) -> None:
    """Ray Data draws no progress bars of its own (the trainer's per-epoch bar shows the
    progress that matters) and logs warnings only. Set before the datasets are built: they
    copy the context, and their actors see the copy. `verbose` keeps Ray Data's bars."""
    import ray.data

    if verbose:
        return
    ctx = ray.data.DataContext.get_current()
    ctx.print_on_execution_start = False
    ctx.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)


def quiet_ray(verbose: bool = False) -> dict:
    """Both of the above, for a caller that starts its own cluster (the tests)."""
    kwargs = quiet_ray_env(verbose)
    quiet_ray_data(verbose)
    return kwargs


def connect(verbose: bool = False, dashboard: bool = False) -> bool:
    """Join the cluster of `ray job submit` / RAY_ADDRESS, or start a local one (or keep the
    one this process is already connected to). True when it started a local cluster, which
    lives and dies with this process."""
    kwargs = quiet_ray_env(verbose)
    import ray

    started = False
    if ray.is_initialized():
        pass
    elif os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"):
        ray.init(**kwargs, **joined_runtime_env(verbose))
    else:
        # No node of a cluster that ends with this process can be drained by an autoscaler:
        # Ray Train's preemption watcher (one more actor process to start) has nothing to watch.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        if dashboard:  # it listens on loopback only
            ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", **kwargs)
        else:
            ray.init(address="local", include_dashboard=False, **kwargs)
        started = True
    quiet_ray_data(verbose)  # after ray.init: importing Ray Data first would delay the cluster's start
    return started


def joined_runtime_env(verbose: bool = False) -> dict:
    """ray.init's runtime env for a cluster the job joins: the processes there were started
    without this job's environment, so quiet_ray_env's settings reach them through Ray's worker
    setup hook (training/console.py quiet_worker_process). A hook of the user's own, in the
    runtime env of `ray job submit`, is kept, and then Ray's notices print as Ray has them."""
    from training import ray_private

    if verbose or "worker_process_setup_hook" in ray_private.job_runtime_env():
        return {}
    return {"runtime_env": {"worker_process_setup_hook": "training.console.quiet_worker_process"}}


class _Preload(threading.Thread):
    """Imports torch and Ray Train and loads a built-in preset (`preset` is None until
    then) while the main thread starts Ray: on a small machine both take seconds
    (docs/benchmarks.md, "Figures that were in code comments"), and neither needs the other.
    (Kornia is imported only by a preset that uses it.)"""

    def __init__(self, preset_name: str, preset=None):
        super().__init__(daemon=True, name="preload")
        self.preset_name, self.preset, self.error = preset_name, preset, None

    def run(self) -> None:
        try:
            from augment.presets import load_preset

            self.preset = self.preset or load_preset(self.preset_name)
            import training.job  # noqa: F401  (torch, Ray Train)
        except BaseException as e:  # handed to the main thread, which reports it
            self.error = e

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.preset


def main(argv=None) -> int:
    try:
        cfg, sources = parse_config(parser(), argv)
        cfg, tree = check_inputs(cfg)  # light: a mistake is reported before anything heavy starts
        preset, name = None, preset_name(cfg, tree)  # --preset auto: the tree's header sizes chose it
        if check_preset_name(name):  # a file: loaded and checked before Ray starts too
            from augment.presets import load_preset

            preset = load_preset(name)
        check_sizes_and_device(cfg, name, preset)
        start_fresh(cfg)  # --fresh: the old run goes only once every input has passed
    except (DataError, ConfigError, PresetError, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Two threads import at once below. Safe: the preload thread's torch imports no Ray module
    # (a preset file, and Kornia if it uses it, loaded above), and Ray Data (main thread,
    # below) imports neither torch nor Ray Train; the preload thread's Ray Train waits for
    # the main thread's Ray Data, never the reverse.
    quiet_ray_env(cfg.verbose)  # before the preload thread imports Ray
    preload = _Preload(name, preset)
    preload.start()
    log = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True))
    log(console.format_config(cfg.to_dict(), sources))
    try:
        own_cluster = connect(cfg.verbose, cfg.dashboard)
    except KeyboardInterrupt:
        print(f"stopped: interrupted while Ray started; to start again: {rerun_command(argv, cfg)}", file=sys.stderr)
        return 130
    preset = preload.result()  # a file preset was checked above; a built-in one cannot fail
    from training import job

    try:
        bar = sys.stderr if not cfg.quiet and sys.stderr.isatty() else None  # no bar in log files or `ray job logs`
        summary = job.run(
            cfg,
            tree,
            preset,
            log=log,
            launched_at=job.process_started_at(),
            own_cluster=own_cluster,
            bar_stream=bar,
        )
    except (ConfigError, DataError, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except job.Interrupted as e:
        again = "to resume" if e.checkpoint else "to start it again"
        print(f"stopped: {e}; {again}: {rerun_command(argv, cfg)}", file=sys.stderr)
        return 130
    except job.TrainingFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(console.summary_table(summary))
    print(f"done: {artifacts_dir(cfg)} (summary.json has every figure)")
    if summary["epochs"] < cfg.epochs:  # --stop-after
        print(f"stopped after epoch {summary['epochs']} of {cfg.epochs}; to continue: {rerun_command(argv, cfg)}")
    return 0


def rerun_command(argv, cfg) -> str:
    """The command that continues this run: the same flags, with --name (the default name is a
    new timestamp every time) and without --fresh or --stop-after (which would start it over,
    or stop it again; turned off where a --config file sets them)."""
    import shlex

    args, given, skip = [], set(), False
    for arg in sys.argv[1:] if argv is None else argv:
        flag = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif flag in ("--fresh", "--no-fresh", "--stop-after", "--name"):
            given.add(flag)
            skip = flag in ("--stop-after", "--name") and "=" not in arg  # its value follows
        else:
            args.append(arg)
    args += ["--name", cfg.name]
    if cfg.fresh and "--fresh" not in given:  # from the --config file
        args.append("--no-fresh")
    if cfg.stop_after and "--stop-after" not in given:
        args += ["--stop-after", "0"]
    return shlex.join(["python", "-m", "jobs.train", *args])


def artifacts_dir(cfg) -> str:
    from training import artifacts

    return artifacts.join(cfg.storage_path, cfg.name)


if __name__ == "__main__":
    sys.exit(main())
