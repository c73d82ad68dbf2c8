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

from augment.presets import PresetError
from training import console
from training.config import ConfigError, add_arguments, parse_config
from training.data import DataError


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", metavar="FILE", help="YAML file of settings (keys: the flags below, e.g. batch_size: 256); flags given here override it. Examples in configs/")
    add_arguments(ap)
    return ap


def quiet_ray(verbose: bool = False) -> dict:
    """Keep the console readable: Ray Data logs only warnings and draws no progress bars of
    its own (the trainer's per-epoch bar shows the progress that matters), no deprecation
    noise from Ray's own internals. Environment variables reach the processes of a cluster
    started here. `verbose` keeps Ray's INFO logs and Ray Data's bars."""
    import ray.data

    if verbose:
        return {"logging_level": logging.INFO}
    import training

    os.environ.setdefault("RAY_DATA_LOGGING_CONFIG", os.path.join(os.path.dirname(training.__file__), "ray_data_logging.yaml"))
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    ctx = ray.data.DataContext.get_current()  # datasets copy it when built: their actors see it
    ctx.print_on_execution_start = False
    ctx.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    return {"logging_level": logging.WARNING}


def connect(verbose: bool = False) -> None:
    """Join the cluster of `ray job submit` / RAY_ADDRESS, or start a local one (or keep the
    one this process is already connected to)."""
    import ray

    kwargs = quiet_ray(verbose)
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"):
        ray.init(**kwargs)
    else:
        # a plain local run starts its own embedded cluster (never joins one found on the
        # machine); the dashboard, which Ray Train's state API needs, listens on loopback only
        ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", **kwargs)


def main(argv=None) -> int:
    try:
        from training import job

        cfg, sources = parse_config(parser(), argv)
        cfg, tree, preset = job.prepare(cfg)
    except (DataError, ConfigError, PresetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True))
    log(console.format_config(cfg.to_dict(), sources))
    connect(cfg.verbose)
    try:
        summary = job.run(cfg, tree, preset, log=log)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except job.Interrupted as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 130
    except job.TrainingFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(console.summary_table(summary))
    print(f"done: {artifacts_dir(cfg)} (summary.json has every figure)")
    return 0


def artifacts_dir(cfg) -> str:
    from training import artifacts

    return artifacts.join(cfg.storage_path, cfg.name)


if __name__ == "__main__":
    sys.exit(main())
