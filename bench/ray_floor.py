"""The start-up floor of Ray Train + Ray Data on this machine: a job that does nothing.

    python -m bench.ray_floor          # prints one JSON line

The same set-up as `jobs.train` on a machine of its own (a local cluster started by
`training.driver.session.connect`, Ray Train without its placement-group cleaner, with one worker on
the plain backend (training/ray_private.py trainer_class) and the job's data config, so no split
coordinator), with no model, no
images and no augmentation: the train loop takes one batch of a trivial Ray Data pipeline (a
range, one map_batches task) and reports. It gives, from the process's start:

* loop_start_s   the train function begins on its worker (ray.init, Ray Train's controller
                 and worker group);
* first_batch_s  the first batch of the trivial pipeline reaches it (plus Ray Train's
                 dataset manager, Ray Data's stats actor and its read and map tasks).

`bench.train` runs it beside `jobs.train` (variant `floor`): whatever `jobs.train` takes
beyond first_batch_s is the project's own start-up.
"""

from __future__ import annotations

import json
import os
import tempfile
import time


def _loop(config: dict) -> None:
    import ray.train

    loop_start = time.time()
    shard = ray.train.get_dataset_shard("train")
    next(iter(shard.iter_batches(batch_size=64, prefetch_batches=0)))
    first_batch = time.time()
    with open(config["out"], "w") as f:  # the cluster is this machine's: a file reaches the driver
        json.dump({"loop_start": loop_start, "first_batch": first_batch}, f)


def _identity(batch):
    return batch


def main() -> dict:
    from training.driver.job import process_started_at

    started = process_started_at()
    from training.driver.session import connect

    own_cluster = connect()
    import ray.data
    from ray.train import RunConfig, ScalingConfig

    from training.ray_private import trainer_class
    from training.stream.ingest import SplitValUnequally

    ds = ray.data.range(1024, override_num_blocks=4).map_batches(_identity, batch_size=64)
    with tempfile.TemporaryDirectory(prefix="ray-floor-") as storage:
        out_path = os.path.join(storage, "times.json")
        trainer = trainer_class(one_worker=True, own_cluster=True)(
            _loop,
            train_loop_config={"out": out_path},
            scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(storage_path=storage, name="floor"),
            datasets={"train": ds},
            dataset_config=SplitValUnequally(1),
        )
        trainer.fit()
        with open(out_path) as f:
            metrics = json.load(f)
    out = {
        "own_cluster": own_cluster,
        "loop_start_s": round(metrics["loop_start"] - started, 1),
        "first_batch_s": round(metrics["first_batch"] - started, 1),
        "wall_s": round(time.time() - started, 1),
    }
    print(json.dumps(out), flush=True)
    return out


def parse(argv=None):
    from training.driver.flags import FlagParser

    ap = FlagParser(prog="python -m bench.ray_floor", description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    return ap.parse_args(argv)


if __name__ == "__main__":
    args = parse()  # --help answers before anything starts
    figures = main()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
