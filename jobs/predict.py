"""Predict classes for a folder of images with a trained model (batch inference on Ray).

    python -m jobs.predict --model runs/photos/model.pt --data ~/new-photos --out predictions.csv
    python -m jobs.predict --model runs/photos/model.pt --data /data/photos-prepared   # a jobs.prepare dir

    python -m jobs.predict --model runs/photos/model.pt --data s3://bucket/10M-photos --out s3://bucket/preds/ \
        --actors 1-32                                   # Parquet files, written as they are scored

The model's own eval transform (saved in model.pt) prepares each image. One row per image:
path (relative to --data), predicted, confidence, label, streamed from the Ray Data pipeline
into the output (training/predict/scoring.py): no process holds every row. When images sit in
directories named after the model's classes, the label is that name and the accuracy is
printed. Exit codes: 0 done; 2 bad input (model file, data folder, --out), one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

from training import storage
from training.config import error_line
from training.driver.flags import FlagParser


def add_inference_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags jobs.predict and jobs.evaluate share."""
    ap.add_argument("--model", required=True, help="model.pt of a training run (runs/<name>/model.pt)")
    ap.add_argument(
        "--data",
        required=True,
        help=(
            "folder of images (any depth; DIR/<class>/<img> gives labels), or a jobs.prepare directory; local "
            "path or s3://, gs://"
        ),
    )
    ap.add_argument("--batch-size", type=int, default=256, help="images per inference call (default: 256)")
    ap.add_argument(
        "--actors",
        default="auto",
        help=(
            "inference actors, each with the model loaded once: N, or MIN-MAX for a pool that grows with the work "
            "(default: auto, 1 up to one per GPU, or per CPU on a cluster without GPUs)"
        ),
    )
    ap.add_argument(
        "--gpus-per-actor",
        type=float,
        default=1.0,
        help="GPUs each actor takes on a cluster with GPUs: 1, or a share such as 0.25 (default: 1)",
    )
    ap.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: cuda if the cluster has GPUs (one GPU per actor), else cpu (default: auto)",
    )
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace output files that exist already (default: an existing output is refused, nothing written)",
    )


def parse(argv=None):
    ap = FlagParser(prog="python -m jobs.predict", description=__doc__.split("\n")[0])
    add_inference_arguments(ap)
    ap.add_argument(
        "--out",
        default="predictions.csv",
        help=(
            "where the rows go, as they are scored: FILE.csv or FILE.parquet (one file), or a folder of Parquet "
            "files (local path or s3://, gs://; default: predictions.csv)"
        ),
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from training.driver.session import quiet_ray_env, stop_on_sigterm, stopped

    quiet_ray_env()  # before Ray is imported below: it reads the console's settings then (training/driver/session.py)
    terminated = stop_on_sigterm()  # while --data is listed: one line, as later
    from training.forms.data import DataError
    from training.predict import inference

    try:  # bad flags, --model, --data or --out: exit 2 before Ray starts
        actors = check_numbers(args)
        info = inference.load_model_file(args.model)
        splits = inference.input_splits(args.data, info)
        check_out(args.out, args.overwrite)
    except (inference.ModelFileError, DataError, storage.StorageError, ValueError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while a big --data is listed
        return stopped(args.out, terminated=terminated)
    report = score(args, info, splits, actors, args.out)
    if isinstance(report, int):
        return report
    print(f"wrote {args.out}: {report.scored} predictions")
    if report.unread:
        first = sorted(report.unread)[0]
        print(f"skipped {len(report.unread)} unreadable file(s), e.g. {first}: {report.unread[first]}")
    if report.labelled:
        print(f"accuracy {report.correct / report.labelled:.4f} ({report.correct}/{report.labelled} labelled images)")
    return 0


def score(args, info, splits, actors: tuple[int, int] | None, out: str):
    """Join or start Ray, size the actor pool (pool_size) and score `splits` into `out`
    (training/predict/scoring.py score_to): its ScoreReport, or the exit code once its one line
    is said (1: Ray did not start; 2: more actors than the cluster holds). jobs.evaluate scores
    through it too."""
    from training.driver import session  # looked up at the call: the tests replace session.connect
    from training.predict import scoring

    terminated = session.stop_on_sigterm()  # connect() keeps it past ray.init's own
    try:
        session.connect()
    except KeyboardInterrupt as e:
        return session.stopped(out, e, terminated)
    except Exception as e:  # noqa: BLE001  (Ray's own start-up or join: one line, as jobs.train says it)
        print(error_line(f"Ray did not start: {session.start_failure(e)}"), file=sys.stderr)
        return 1
    try:
        try:
            actors = pool_size(actors, args.device, args.gpus_per_actor)
        except ValueError as e:  # more actors than the cluster holds
            print(error_line(e), file=sys.stderr)
            return 2
        with session.driver_notices_skipped():  # Ray's C++ notice about its actor pool, from this process
            return scoring.score_to(
                info,
                splits,
                out,
                batch_size=args.batch_size,
                actors=actors,
                device=args.device,
                gpus_per_actor=args.gpus_per_actor,
            )
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: scoring.write removed what it had written
        return session.stopped(out, terminated=terminated)


def check_numbers(args) -> tuple[int, int] | None:
    """--data, --batch-size, --gpus-per-actor and --actors ((min, max); None: auto), or ValueError with the line."""
    from training.predict import scoring

    if not args.data.strip():  # an unset shell variable: not the working folder
        raise ValueError("--data is empty; give the images' folder or a jobs.prepare directory")
    if args.batch_size <= 0:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
    if not 0 < args.gpus_per_actor <= 64:
        raise ValueError(f"--gpus-per-actor must be above 0 and at most 64, got {args.gpus_per_actor}")
    return None if args.actors == "auto" else scoring.parse_actors(args.actors)


def pool_size(actors: tuple[int, int] | None, device: str, gpus_per_actor: float = 1.0) -> tuple[int, int]:
    """The actor pool's (min, max): --actors, or auto (None): 1 up to one actor per GPU (a cluster with GPUs,
    unless --device cpu), else per CPU but one, which the reads take. ValueError where the cluster cannot
    hold --actors' minimum beside the reads: Ray Data would wait for room that never comes."""
    from training.driver.planning import cluster_capacity

    capacity = cluster_capacity()
    on_gpu = capacity.gpus and device != "cpu"
    if actors is None:
        return (1, max(1, capacity.gpus if on_gpu else capacity.cpus - 1))
    room = max(1, capacity.cpus - 1)  # an actor takes a CPU (and its GPUs)
    if on_gpu:
        room = min(room, max(1, int(capacity.gpus // gpus_per_actor)))
    low, high = actors
    if capacity.bounded and low > room:
        what = f"{capacity.cpus} CPUs" + (f" and {capacity.gpus} GPUs" if on_gpu else "")
        raise ValueError(
            f"--actors {low if low == high else f'{low}-{high}'}: the cluster ({what}) holds at most {room} "
            f"inference actor(s) beside the reads; give --actors {room}, or a range 1-{max(high, room)}"
        )
    return actors


# names of files of another format: a mistake, not the name of a folder for Parquet files
OTHER_FORMATS = (".json", ".jsonl", ".txt", ".tsv", ".xlsx", ".xls", ".npy", ".npz", ".pkl", ".pt", ".feather")


def check_out(out: str, overwrite: bool) -> None:
    """StorageError unless `out` can be written: CSV or Parquet (a name of another format's file is a
    mistake), its folder writable, and what is there already replaced only with --overwrite (a
    folder: the Parquet files an earlier jobs.predict wrote there, by its record; a folder with
    Parquet files of someone else's is refused)."""
    from training.predict import scoring

    if not out.strip():  # an unset shell variable: not the working folder
        raise storage.StorageError("--out is empty; give FILE.csv, FILE.parquet or a folder for Parquet files")
    kind = scoring.out_kind(out)
    target = out.rstrip("/")
    suffix = os.path.splitext(target)[1].lower()
    if kind == "dir" and not out.endswith("/") and suffix in OTHER_FORMATS:  # not a folder for Parquet files
        raise storage.StorageError(
            f"--out {target}: jobs.predict writes CSV or Parquet, not {suffix}; give "
            f"{target[: -len(suffix)]}.csv or .parquet, or a folder"
        )
    storage.check_writable(storage.parent(target) if kind != "dir" else target, "--out")
    if kind != "dir" and storage.is_dir(out):  # else found only after the whole inference
        raise storage.StorageError(f"--out {target}: a folder; give a file to write, e.g. {target}/predictions.csv")
    if kind == "dir" and storage.exists(target) and not storage.is_dir(target):
        raise storage.StorageError(f"--out {target}: a file; give a folder, or a name ending in .csv or .parquet")
    if storage.exists(f"{target}.parts"):
        raise storage.StorageError(f"--out {target}: {target}.parts is in the way (an earlier run's parts); remove it")
    there = storage.exists(target) and not (kind == "dir" and storage.is_empty_dir(target))
    if there and not overwrite:
        what = "holds files already" if kind == "dir" else "exists already"
        raise storage.StorageError(
            f"--out {target} {what}; nothing was written; give another --out, or --overwrite to replace it"
        )
    if there and kind == "dir":
        ours = scoring.earlier_parts(target)
        if ours is None and scoring.part_files(target, ".parquet"):
            raise storage.StorageError(
                f"--out {target} holds Parquet files that jobs.predict did not write; nothing was removed; "
                "give another --out"
            )
        for old in ours or []:  # an earlier prediction's files, and only those
            storage.remove_file(old)
        if ours is not None:
            storage.remove_file(storage.join(target, scoring.PARTS_RECORD))


if __name__ == "__main__":
    sys.exit(main())
