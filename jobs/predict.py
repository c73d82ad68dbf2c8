"""Predict classes for a folder of images with a trained model (batch inference on Ray).

    python -m jobs.predict --model runs/photos/model.pt --data ~/new-photos --out predictions.csv
    python -m jobs.predict --model runs/photos/model.pt --data /data/photos-prepared   # a jobs.prepare dir

The model's own eval transform (saved in model.pt) prepares each image. The CSV has one
row per image: path (relative to --data), predicted, confidence, label. When images sit
in directories named after the model's classes, the label is that name and the accuracy
is printed. Exit codes: 0 done; 2 bad input (model file, data folder), one line on stderr.
"""

from __future__ import annotations

import argparse
import sys

from training.config import FlagParser, error_line


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
        "--actors", type=int, default=1, help="inference actors, each with the model loaded once (default: 1)"
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
        "--out", default="predictions.csv", help="CSV to write (local path or s3://, gs://; default: predictions.csv)"
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from training import artifacts, inference, storage
    from training.forms.data import DataError
    from training.session import connect

    if args.batch_size <= 0 or args.actors <= 0:
        print("error: --batch-size and --actors must be positive", file=sys.stderr)
        return 2
    try:  # bad --model, --data or --out: exit 2 before Ray starts
        info = inference.load_model_file(args.model)
        splits = inference.input_splits(args.data, info)
        storage.check_writable(storage.parent(args.out), "--out")
        if artifacts.is_dir(args.out):  # else found only after the whole inference, a temporary file left behind
            out = args.out.rstrip("/")
            raise storage.StorageError(f"--out {out}: a folder; give a file to write, e.g. {out}/predictions.csv")
        if artifacts.exists(args.out) and not args.overwrite:
            raise storage.StorageError(
                f"--out {args.out} exists already; nothing was written; give another --out, or --overwrite to "
                "replace it"
            )
    except (inference.ModelFileError, DataError, storage.StorageError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    connect()
    rows, unread = inference.predict(info, splits, batch_size=args.batch_size, actors=args.actors, device=args.device)
    inference.write_predictions_csv(rows, args.out, info.class_names)
    print(f"wrote {args.out}: {len(rows)} predictions")
    if unread:
        print(f"skipped {len(unread)} unreadable file(s), e.g. {unread[0]}")
    correct, labelled = inference.accuracy(rows)
    if labelled:
        print(f"accuracy {correct / labelled:.4f} ({correct}/{labelled} labelled images)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
