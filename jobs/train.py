"""Train a torchvision classifier (ResNet18 by default) on an image folder on Ray, augmenting on GPUs or CPUs.

    python -m jobs.train                                  # bundled digits data, local Ray
    python -m jobs.train --data ~/photos --epochs 30      # your folder: <class>/<image>
    python -m jobs.train --data ~/photos --model efficientnet_b0   # another torchvision classifier
    python -m jobs.train --config configs/cifar-local.yaml --epochs 2   # a file; flags win
    ray job submit --working-dir . -- python -m jobs.train --data s3://bucket/photos \\
        --storage-path s3://bucket/runs --name photos-r18

Exit codes: 0 done; 2 bad input (found before training starts); 1 training failed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading

from augment.errors import PresetError
from training.config import ConfigError, error_line
from training.driver import console
from training.driver.flags import FlagParser, add_arguments, parse_config
from training.driver.inputs import prepare
from training.driver.session import (
    connect,
    how_stopped,
    mute_ray_output,
    quiet_ray_env,
    start_failure,
    stop_on_sigterm,
)
from training.forms.data import DataError
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


class _Preload(threading.Thread):
    """Imports torch and Ray Train and loads a built-in preset (`preset` is None until
    then) while the main thread starts Ray: on a small machine both are slow (docs/design.md,
    "Choices and where they were measured"), and neither needs the other.
    (Kornia is imported only by a preset that uses it.)"""

    def __init__(self, preset_name: str, preset=None):
        super().__init__(daemon=True, name="preload")
        self.preset_name, self.preset, self.error = preset_name, preset, None

    def run(self) -> None:
        try:
            from augment.presets import load_preset

            self.preset = self.preset or load_preset(self.preset_name)
            import training.driver.job  # noqa: F401  (torch, Ray Train)
        except BaseException as e:  # handed to the main thread, which reports it
            self.error = e

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.preset


def main(argv=None) -> int:
    terminated = stop_on_sigterm()  # connect() keeps it past ray.init's own
    try:
        cfg, sources = parse_config(parser(), argv)
        cfg, tree, name, preset = prepare(cfg)  # light but for a preset file: no Ray, no torch yet
    except (DataError, ConfigError, PresetError, StorageError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # a long listing (a bucket of millions of images): no traceback
        how, code = how_stopped(e, terminated)
        print(f"stopped: {how} while the inputs were checked; nothing was trained; run the same command again",
              file=sys.stderr)  # fmt: skip
        return code
    # Two threads import at once below. Safe: the preload thread's torch imports no Ray module
    # (a preset file, and Kornia if it uses it, loaded above), and Ray Data (main thread,
    # below) imports neither torch nor Ray Train; the preload thread's Ray Train waits for
    # the main thread's Ray Data, never the reverse.
    quiet_ray_env(cfg.verbose)  # before the preload thread imports Ray
    preload = _Preload(name, preset)
    preload.start()
    log = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True))
    log(console.format_config(cfg.to_dict(), sources))
    for note in tree.notes:  # the scan's warnings (one file under two names): before Ray, even with --quiet
        print(note, file=sys.stderr, flush=True)
    try:
        own_cluster = connect(cfg.verbose, cfg.dashboard)
    except KeyboardInterrupt as e:
        how, code = how_stopped(e, terminated)
        print(f"stopped: {how} while Ray started; to start again: {rerun_command(argv, cfg)}", file=sys.stderr)
        return code
    except Exception as e:  # Ray's own start-up or join failed: no traceback for a fault outside the job
        print(error_line(f"Ray did not start: {start_failure(e)}"), file=sys.stderr)
        return 1
    preset = preload.result()  # a file preset was checked above; a built-in one cannot fail
    from training.driver import job

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
        print(error_line(e), file=sys.stderr)
        return 2
    except job.Interrupted as e:
        mute_ray_output()
        again = "to resume" if e.checkpoint else "to start it again"
        how, code = how_stopped(terminated=terminated)
        where = str(e).removeprefix("interrupted")
        print(f"stopped: {how}{where}; {again}: {rerun_command(argv, cfg)}", file=sys.stderr)
        return code
    except job.TrainingFailed as e:
        print(error_line(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # outside the trainer's fit: planning, the datasets, the results
        mute_ray_output()
        how, code = how_stopped(e, terminated)
        print(f"stopped: {how} outside training; to go on: {rerun_command(argv, cfg)}", file=sys.stderr)
        return code
    print(console.summary_table(summary))
    print(f"done: {cfg.run_dir} (summary.json has every figure)")
    if summary["epochs"] < cfg.epochs:  # --stop-after
        print(f"stopped after epoch {summary['epochs']} of {cfg.epochs}; to continue: {rerun_command(argv, cfg)}")
    return 0


def rerun_command(argv, cfg) -> str:
    """The command that continues this run: the same flags, with --name (the default name is a
    new timestamp every time) and without --fresh or --stop-after (which would start it over,
    or stop it again; turned off where a --config file sets them)."""
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
    return shlex.join([interpreter(), "-m", "jobs.train", *args])


def interpreter() -> str:
    """The Python that runs this job as the user would type it here: a path inside the current
    directory (the repository's .venv/bin/python) relative to it, else `python` (a cluster's
    own, under `ray job submit`)."""
    here, exe = os.getcwd(), sys.executable
    inside = bool(exe) and os.path.commonpath([here, os.path.abspath(exe)]) == here
    return os.path.relpath(exe, here) if inside else "python"


if __name__ == "__main__":
    sys.exit(main())
