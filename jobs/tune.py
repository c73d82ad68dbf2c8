"""Sweep the job's settings with Ray Tune: each trial a normal run under runs/SWEEP/trial-<id>/, poor ones stopped.

    python -m jobs.tune --data ~/photos --epochs 10 --space space.yaml --trials 16 --name photos-lr
    python -m jobs.tune --config configs/cifar-local.yaml --space space.yaml --max-concurrent 4 --scheduler none
    python -m jobs.tune ... (the same command again)     # continues the sweep: finished trials are kept

space.yaml, one setting a line: `lr: loguniform(1e-4, 1e-1)`, `weight_decay: choice([0, 1e-4])`,
`batch_size: choice([32, 64])`, `momentum: uniform(0.8, 0.99)`, `warmup_epochs: randint(0, 3)`,
`model: grid([resnet18, mobilenet_v3_small])` (docs/guide.md, "Sweeps").

Exit codes: 0 the sweep ran (failed trials are listed, with their reasons); 2 bad input; 1 the sweep could not run.
"""

from __future__ import annotations

import sys

from training.config import ConfigError, error_line
from training.driver.api import JobError
from training.driver.flags import FlagParser, add_arguments, parse_config
from training.driver.session import how_stopped, quiet_ray_env
from training.sweep.tuner import SweepOptions, tune


def parser() -> FlagParser:
    ap = FlagParser(prog="python -m jobs.tune", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--space", metavar="FILE", required=True, help="YAML file of the settings to sweep and their ranges"
    )
    ap.add_argument("--trials", type=int, default=8, help="samples drawn from the space (default: 8)")
    ap.add_argument("--max-concurrent", type=int, default=2, help="trials at once, each on its share (default: 2)")
    ap.add_argument("--scheduler", choices=("asha", "none"), default="asha", help="asha: stop poor trials early")
    ap.add_argument("--grace-epochs", type=int, default=1, help="epochs before ASHA may stop a trial (default: 1)")
    ap.add_argument("--metric", default="val_acc", help="what the trials are ranked by (default: val_acc)")
    ap.add_argument("--mode", choices=("max", "min"), default="max", help="higher or lower is better (default: max)")
    ap.add_argument("--search", choices=("random", "optuna"), default="random", help="optuna: needs pip install optuna")
    ap.add_argument("--trial-cpus", type=float, default=0, help="CPUs per trial (default: cluster's / max-concurrent)")
    ap.add_argument("--trial-gpus", type=float, default=0, help="GPUs per trial (default: cluster's / max-concurrent)")
    ap.add_argument("--config", metavar="FILE", help="YAML file of the base settings, as jobs.train takes; flags win")
    add_arguments(ap)
    return ap


def main(argv=None) -> int:
    ap = parser()
    try:
        cfg, _ = parse_config(ap, argv)
    except ConfigError as e:
        print(error_line(e), file=sys.stderr)
        return 2
    args = ap.parse_args(argv)
    options = SweepOptions(
        trials=args.trials,
        max_concurrent=args.max_concurrent,
        scheduler=args.scheduler,
        grace_epochs=args.grace_epochs,
        metric=args.metric,
        mode=args.mode,
        search=args.search,
        trial_cpus=args.trial_cpus,
        trial_gpus=args.trial_gpus,
    )
    quiet_ray_env(cfg.verbose)
    try:
        tune(cfg, args.space, options)
    except JobError as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        how, code = how_stopped(e)
        print(f"stopped: {how}; the same command continues the sweep", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
