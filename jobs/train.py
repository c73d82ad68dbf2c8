"""Train ResNet18 on an image folder with GPU (Kornia) augmentation on Ray.

    python -m jobs.train                                  # bundled digits data, local Ray
    python -m jobs.train --data ~/photos --epochs 30      # your folder: <class>/<image>
    ray job submit --working-dir . -- python -m jobs.train --data s3://bucket/photos \\
        --storage-path s3://bucket/runs --name photos-r18

Exit codes: 0 done; 2 bad input (found before training starts); 1 training failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from augment.presets import PresetError
from training.config import ConfigError, add_arguments, from_args
from training.data import DataError


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jobs.train", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def quiet_ray() -> dict:
    """Keep the console readable: Ray Data logs only warnings (its progress then shows as
    tqdm bars on a terminal and not at all in a log file), no deprecation noise from Ray's
    own internals. Environment variables reach the processes of a cluster started here."""
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    import ray.data

    ray.data.DataContext.get_current().print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    return {"logging_level": logging.WARNING}


def connect() -> None:
    """Join the cluster of `ray job submit` / RAY_ADDRESS, or start a local one."""
    import ray

    kwargs = quiet_ray()
    if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"):
        ray.init(**kwargs)
    else:
        # a local run: the dashboard (needed by Ray Train's state API) listens on loopback only
        ray.init(include_dashboard=True, dashboard_host="127.0.0.1", **kwargs)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        from training import job

        cfg, tree, preset = job.prepare(from_args(args))
    except (DataError, ConfigError, PresetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True))
    log(f"config: {json.dumps(cfg.to_dict())}")
    connect()
    try:
        summary = job.run(cfg, tree, preset, log=log)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except job.TrainingFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"done: {artifacts_dir(cfg)}")
    print(json.dumps(summary, indent=2))
    return 0


def artifacts_dir(cfg) -> str:
    from training import artifacts

    return artifacts.join(cfg.storage_path, cfg.name)


if __name__ == "__main__":
    sys.exit(main())
