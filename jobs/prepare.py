"""Convert an image tree into Parquet shards that read fast from object storage.

    python -m jobs.prepare ~/photos /data/photos-prepared
    python -m jobs.prepare s3://bucket/photos s3://bucket/photos-prepared --shard-mb 256
    python -m jobs.train --data /data/photos-prepared      # same split, labels and images

Each row keeps the encoded file as it was (no re-encoding), its label, its key, its size and
its path relative to DIR; OUT/_prepared.json records the class names, the split and the
counts. Exit codes: 0 written; 2 bad input (unusable tree, OUT not empty or not writable, storage
that refuses the credentials), one line on stderr, before any file is read.
"""

from __future__ import annotations

import sys

from training.config import error_line
from training.driver.flags import FlagParser
from training.storage import StorageError


def parse(argv=None):
    ap = FlagParser(prog="python -m jobs.prepare", description=__doc__.split("\n")[0])
    ap.add_argument(
        "data",
        metavar="DIR",
        help="image tree: DIR/<class>/<img> or DIR/{train,val}/<class>/<img>; local path or s3://, gs://",
    )
    ap.add_argument(
        "out",
        metavar="OUT",
        help="new (or empty) directory for the shards and _prepared.json; local path or s3://, gs://",
    )
    ap.add_argument(
        "--val-fraction",
        type=float,
        default=0.2,
        help=(
            "fraction of DIR/<class>/ files held out for validation by path hash, as jobs.train --val-fraction "
            "(ignored with train/ + val/; default: 0.2)"
        ),
    )
    ap.add_argument(
        "--shard-mb", type=float, default=128.0, help="target size of one shard, in MB of encoded images (default: 128)"
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the one-time shuffle of the train rows across shards (default: 0)"
    )
    ap.add_argument(
        "--threads", type=int, default=16, help="files read at once (object storage is latency-bound; default: 16)"
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from training.driver.session import stop_on_sigterm, stopped
    from training.forms.data import DataError
    from training.forms.parquet import prepare_tree

    if args.shard_mb <= 0 or args.threads <= 0:
        print("error: --shard-mb and --threads must be positive", file=sys.stderr)
        return 2
    terminated = stop_on_sigterm()  # as Ctrl-C: prepare_tree removes what it wrote
    try:
        manifest = prepare_tree(
            args.data,
            args.out,
            val_fraction=args.val_fraction,
            shard_mb=args.shard_mb,
            seed=args.seed,
            threads=args.threads,
        )
    except (DataError, StorageError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return stopped(args.out, terminated=terminated)
    splits = manifest["splits"]
    print(
        f"prepared {args.out}: {len(manifest['class_names'])} classes, {splits['train']['images']} train / "
        f"{splits['val']['images']} val images in {len(splits['train']['shards']) + len(splits['val']['shards'])} "
        "shards; "
        f"train with: python -m jobs.train --data {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
