"""Evaluate a trained model on labelled images: confusion matrix and per-class precision/recall.

    python -m jobs.evaluate --model runs/photos/model.pt --data ~/photos-test
    python -m jobs.evaluate --model runs/photos/model.pt --data ~/photos --split val   # the run's own validation split

Labels come from the directory names (DIR/<class>/<img>, DIR/val/<class>/<img>) matched to
the model's classes. Writes OUT/confusion.png, OUT/per_class.csv and OUT/predictions.csv
and prints the accuracy and the per-class table. Exit codes: 0 done; 2 bad input.
"""

from __future__ import annotations

import sys

from jobs.predict import add_inference_arguments, check_numbers, score
from training import storage
from training.config import error_line
from training.driver import plots
from training.driver.flags import FlagParser

OUTPUTS = ("confusion.png", "per_class.csv", "predictions.csv")  # what an evaluation writes into --out


def parse(argv=None):
    ap = FlagParser(prog="python -m jobs.evaluate", description=__doc__.split("\n")[0])
    add_inference_arguments(ap)
    ap.add_argument(
        "--split",
        default="all",
        choices=("all", "val"),
        help=(
            "all: every image below --data (a held-out test folder); val: the validation split training used, "
            "DIR/val or the hash split by the run's --val-fraction (default: all)"
        ),
    )
    ap.add_argument(
        "--out",
        default=None,
        help="directory for confusion.png, per_class.csv, predictions.csv (default: eval/ beside the model file)",
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from training.driver.session import quiet_ray_env, stop_on_sigterm, stopped

    quiet_ray_env()  # before Ray is imported below: it reads the console's settings then (training/driver/session.py)
    terminated = stop_on_sigterm()  # while --data is listed: one line, as later
    from training.forms.data import DataError
    from training.predict import inference

    out = storage.join(storage.parent(args.model), "eval") if args.out is None else args.out
    try:
        actors = check_numbers(args)
        if not out.strip():  # an unset shell variable: not the working folder
            raise ValueError("--out is empty; give a folder for the evaluation's files, or drop --out for eval/")
        info = inference.load_model_file(args.model)
        val_fraction = float(info.setting("val_fraction", 0.2))
        splits = inference.input_splits(args.data, info, args.split, val_fraction)
        if all((s.labels < 0).all() for s in splits):
            raise DataError(
                f"{args.data}: no image sits in a directory named after one of the model's classes "
                f"{list(info.class_names)[:10]}; evaluation needs labels "
                "(use jobs.predict for unlabelled images)"
            )
        storage.check_writable(out, "--out")
        there = [f for f in OUTPUTS if storage.exists(storage.join(out, f))]
        if there and not args.overwrite:
            raise storage.StorageError(
                f"--out {out} holds {', '.join(there)} already (an earlier evaluation's?); nothing was written; give "
                "another --out, or --overwrite to replace them"
            )
    except (inference.ModelFileError, DataError, storage.StorageError, ValueError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while a big --data is listed
        return stopped(storage.join(out, "predictions.csv"), terminated=terminated)
    made = not storage.exists(out)
    report = score(args, info, splits, actors, storage.join(out, "predictions.csv"))
    if isinstance(report, int):
        if made and storage.exists(out) and storage.is_empty_dir(out):  # the folder Ray Data made for the parts
            storage.remove_tree(out)
        return report
    names = list(info.class_names)
    stats = inference.per_class(report.confusion, names)
    storage.write_bytes(storage.join(out, "confusion.png"), plots.confusion_png(report.confusion, names))
    storage.write_csv(storage.join(out, "per_class.csv"), stats)
    print(inference.per_class_table(stats))
    if report.unread:
        first = sorted(report.unread)[0]
        print(f"skipped {len(report.unread)} unreadable file(s), e.g. {first}: {report.unread[first]}")
    print(
        f"accuracy {report.correct / max(report.labelled, 1):.4f} ({report.correct}/{report.labelled} labelled "
        f"images); wrote {out}/confusion.png, per_class.csv, predictions.csv"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
