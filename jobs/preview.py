"""Preview a preset: a grid of originals beside several augmentations each, with class names.

    python -m jobs.preview --out grid.png                          # bundled digits, the preset auto picks (cifar)
    python -m jobs.preview --data ~/photos --out grid.png          # photos: imagenet, as jobs.train picks
    python -m jobs.preview --data ~/photos --preset my.yaml --per-class 2 --augmentations 6

Exit codes: 0 written; 2 bad input (unknown preset, unreadable data), one line on stderr.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

from augment.presets import PresetError, load_preset
from training import storage
from training.config import error_line
from training.driver.flags import FlagParser
from training.storage import StorageError, read_file


def parse(argv=None):
    ap = FlagParser(prog="python -m jobs.preview", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data",
        help="what jobs.train's --data takes: an image tree, WebDataset shards, a Hugging Face Parquet export, a "
        "manifest or jobs.prepare shards; default: the bundled digits dataset",
    )
    ap.add_argument(
        "--preset",
        default="auto",
        help="cifar, imagenet, a .yaml/.json preset file, or auto: the one jobs.train's --preset auto picks for the "
        "tree (default: auto)",
    )
    ap.add_argument(
        "--out", default="preview.png", help="image to write, .png, .jpg, .pdf or .svg, local (default: preview.png)"
    )
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists (default: refused)")
    ap.add_argument("--classes", type=int, default=4, help="how many classes to show, in label order (default: 4)")
    ap.add_argument("--per-class", type=int, default=1, help="training images per class (default: 1)")
    ap.add_argument("--augmentations", type=int, default=5, help="train views per image, one per epoch (default: 5)")
    ap.add_argument("--seed", type=int, default=0, help="the training seed whose augmentations to show (default: 0)")
    ap.add_argument("--dpi", type=int, default=80, help="resolution of the image (default: 80)")
    args = ap.parse_args(argv)
    if args.data is not None and not args.data.strip():  # an unset shell variable: not the bundled digits
        ap.error("--data is empty; give the data's path, or leave --data out for the bundled digits")
    for flag, low, high in LIMITS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if not low <= value <= high:
            ap.error(f"{flag} {value}: give a whole number from {low} to {high}")
    return args


# how big a grid may be asked for: rows are classes x images per class, columns an original and its views
LIMITS = (("--classes", 1, 100), ("--per-class", 1, 20), ("--augmentations", 1, 30), ("--dpi", 10, 600))
KINDS = (".png", ".jpg", ".jpeg", ".pdf", ".svg")  # what the grid is written as, by --out's suffix


def check_out(out: str, overwrite: bool) -> None:
    """StorageError unless `out` names an image file that may be written: local, of a kind the grid is
    written as, not a folder, not there already without --overwrite (its folder is made when it is written)."""
    if storage.is_uri(out):
        raise StorageError(f"--out {out}: the preview is written to local disk only; give a local path")
    if os.path.isdir(out):
        raise StorageError(f"--out {out.rstrip('/')}: a folder; give a file to write, e.g. {out.rstrip('/')}/grid.png")
    if os.path.splitext(out)[1].lower() not in KINDS:
        raise StorageError(f"--out {out}: give a file name ending in {', '.join(KINDS)}, e.g. grid.png")
    if os.path.lexists(out) and not overwrite:
        raise StorageError(f"--out {out}: exists already; nothing was written; give another --out, or --overwrite")
    storage.check_writable(os.path.dirname(out) or ".", "--out")


def main(argv=None) -> int:
    args = parse(argv)
    from augment.preview import read_examples, render_grid
    from training.driver.inputs import auto_preset, typical_size
    from training.forms.data import DataError
    from training.forms.formats import scan_data, shard_examples
    from training.forms.tree import default_dataset_dir

    try:
        check_out(args.out, args.overwrite)
        tree = scan_data(args.data or str(default_dataset_dir()))
        chosen = ""
        if args.preset == "auto":  # as jobs.train chooses
            name, why = auto_preset(dataclasses.replace(tree, typical_size=typical_size(tree.train)))
            chosen = f" (--preset auto: {why})"
        preset = load_preset(name if args.preset == "auto" else args.preset)
        files = functools.partial(read_examples, read=read_file)  # a name that is not UTF-8 too
        examples, skipped = shard_examples if tree.train.grouped else files, []
        images, labels, keys = examples(tree.train, classes=args.classes, per_class=args.per_class, skipped=skipped)
    except (PresetError, DataError, StorageError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    try:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        out = render_grid(
            images,
            labels,
            tree.class_names,
            preset,
            args.out,
            keys=keys,
            seed=args.seed,
            augmentations=args.augmentations,
            dpi=args.dpi,
        )
    except OSError as e:  # the disk filled, or the folder went, while the grid was written
        print(error_line(f"--out {args.out}: cannot write it ({e.strerror or e})"), file=sys.stderr)
        return 1
    print(f"wrote {out}: {len(images)} images x {args.augmentations} augmentations, preset {preset.name!r}{chosen}")
    if skipped:  # as jobs.predict says it
        print(f"skipped {len(skipped)} unreadable file(s), e.g. {skipped[0][0]} ({skipped[0][1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
