"""What a scan of --data gives, whatever the form: an ImageTree of two Splits (the files of each
split, with their labels and keys), the split words, and the checks every form shares.

Scanning happens on the driver, before Ray starts work, so every problem is reported as a
`DataError` (exit 2) naming the path and the fix. A split is held as columns (numpy arrays, a
few tens of bytes per file): an ImageNet-size tree of 1.28 M files stays small on the driver.
Ray Data reads the files (training/stream/ingest.py): the table goes to the object store once, and each
read task takes its own rows of it.

Image folders (training/forms/tree.py) and manifests (training/forms/manifest.py) give a Split
of files; shards give a ShardedSplit of images inside them, read in units
(training/forms/webdataset.py, huggingface.py, parquet.py); training/forms/formats.py tells the
forms apart.

    label  position of the class name in the class list
    key    int64, stable hash of the path relative to DIR; seeds per-image augmentation

A name on local disk that is not UTF-8 is carried as its storage.shown_name (each such byte as
\\xNN: "caf\\xe9.jpg"), in paths, class names and every file the jobs write; reading turns it back
into the name on disk (storage.disk_path).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import numpy as np

from training import storage


class DataError(ValueError):
    """A problem with the user's data that the user can fix; the message says how."""


def below(root: str, rel: str) -> str:
    """The path of `rel` below `root` ("/" and roots ending in "/" too: never a doubled slash)."""
    return f"{root.rstrip('/')}/{rel}"


def check_root_name(root: str) -> None:
    """DataError for a --data whose own path is not UTF-8 (the shell handed over bytes that os.fsdecode
    keeps as surrogates): every path the jobs write begins with it. Names below it may be any bytes."""
    shown = storage.shown_name(root)
    if shown != root:
        raise DataError(
            f"{shown}: the path of --data is not UTF-8 text; rename that folder, or make a link to it with a UTF-8 "
            "name (ln -s) and give that"
        )


def stable_hash(text: str) -> int:
    """63-bit hash of a string, identical on every machine and Python process: of its UTF-8 bytes (a
    name os.fsdecode read from disk that is not UTF-8: of the bytes the disk has)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def in_validation(rel_path: str, val_fraction: float) -> bool:
    """The hash split: a file is in validation iff its path hash falls below the fraction."""
    return bool(held_out(stable_hash(rel_path), val_fraction))


def held_out(keys, val_fraction: float) -> np.ndarray:
    """The hash split of images by their keys: true where a key falls in validation."""
    return np.asarray(keys) / 2**63 < val_fraction


def on_side(keys, side: tuple[float, bool] | None) -> np.ndarray:
    """True where a key is on `side` of a hash split, (val_fraction, is val); everywhere for None."""
    keys = np.asarray(keys)
    return np.ones(keys.shape, bool) if side is None else held_out(keys, side[0]) == side[1]


def concat(arrays: list) -> np.ndarray:
    """numpy arrays end to end; an empty int64 array for none."""
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)


def label_of(rel_path: str, class_index: dict, part: int) -> int:
    """The label of a file from its own relative path: the position of its `part`-th path
    component (the class directory) among the class names; -1 if that is not a class."""
    parts = rel_path.split("/")
    is_dir = part < len(parts) - 1 if part >= 0 else -len(parts) <= part < -1  # never the file's own name
    return class_index.get(parts[part], -1) if is_dir else -1


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """One side of the split: its files as columns, one entry per file."""

    root: str  # the tree's root as Ray Data reads it: an absolute path or a URI (s3://bucket/photos)
    rel_paths: np.ndarray  # str (object array), relative to root: "cat/001.jpg", "train/cat/001.jpg"
    labels: np.ndarray  # int32: the class's position in the sorted class names
    keys: np.ndarray  # int64: stable_hash of the relative path
    sizes: np.ndarray  # int64: encoded bytes on storage

    def __len__(self) -> int:
        return len(self.rel_paths)

    @property
    def grouped(self) -> bool:
        """Read in fixed groups of rows (a prepared split's row groups), not file by file."""
        return False

    @property
    def paths(self) -> list[str]:
        """Every file's absolute path or URI (built on demand: the split keeps relative paths)."""
        return [below(self.root, r) for r in self.rel_paths]

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def mean_file_bytes(self) -> float:
        return self.total_bytes / max(1, len(self))

    def subset(self, mask: np.ndarray) -> "Split":
        """The files where `mask` is true."""
        columns = ("rel_paths", "labels", "keys", "sizes")
        return dataclasses.replace(self, **{c: getattr(self, c)[mask] for c in columns})


@dataclasses.dataclass(frozen=True)
class ShardFormat:
    """How a read task finds an image, its label and its key in a shard (training/forms/formats.py read_units)."""

    kind: str  # "prepared" (jobs.prepare), "huggingface" (a Parquet export), "webdataset" (tar shards)
    image: str = "bytes"  # Parquet: the column of the encoded image (a Hugging Face Image struct's `bytes`)
    label: str = "label"  # Parquet: the label column; WebDataset: the key of a .json member's label
    class_names: tuple[str, ...] = ()  # WebDataset: a member's label (a name, or an index as text) -> position
    scoring: bool = False  # WebDataset: samples without a label are read too, as label -1 (jobs.predict)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedSplit(Split):
    """A Split whose images live inside shards (Parquet files or tar archives), read in fixed
    units (row groups, runs of tar members) in a new order every epoch. `paths` name each image
    as the job reports it: the original file (prepared shards), or `shard:row` and `shard/member`."""

    shards: tuple[str, ...] = ()  # shard URIs
    units: np.ndarray | None = None  # int64 (n, k): a unit's shard index, its place in the shard, ..., its rows (last)
    form: ShardFormat = ShardFormat("prepared")
    side: tuple[float, bool] | None = None  # the hash split inside each unit: (val_fraction, is val); None: all rows

    @property
    def grouped(self) -> bool:
        return self.units is not None


def sharded(split: Split, shards, units, form: ShardFormat, side=None) -> ShardedSplit:
    """`split`'s files as a ShardedSplit read from `shards` in `units`."""
    fields = {f.name: getattr(split, f.name) for f in dataclasses.fields(Split)}
    units = np.asarray(units, dtype=np.int64)
    return ShardedSplit(**fields, shards=tuple(shards), units=units, form=form, side=side)


SPLIT_NAMES = {
    **dict.fromkeys(("train", "training"), "train"),
    **dict.fromkeys(("val", "valid", "validation", "dev"), "val"),
    **dict.fromkeys(("test", "testing"), "test"),
}


def split_of(rel_path: str) -> str | None:
    """The split a shard's path names ("train", "val", "test"; None: none), as Hugging Face and
    WebDataset name them: a word of a folder's name or of the file's (train/0000.parquet,
    val_images/0001.tar, validation-00000-of-00004.parquet, imagenet-train-0001.tar); the word
    nearest the file wins. "trainval" names none."""
    parts = rel_path.lower().split("/")
    parts[-1] = parts[-1].rsplit(".", 1)[0]  # not the extension
    words = [w for part in parts for w in re.split(r"[-_. ]", part) if w]
    found = [SPLIT_NAMES[w] for w in words if w in SPLIT_NAMES]
    return found[-1] if found else None


def split_names(names: list[str], where: str, hint: str) -> dict[str, list[str]]:
    """{"train": names, "val": names} of a set of shards or files by split_of (test ones left
    out); where none names a split, all are the training pool. DataError where none is left
    for training (`hint`: how to name them)."""
    sides = {side: [n for n in names if split_of(n) == side] for side in ("train", "val")}
    if not sides["train"]:
        sides["train"] = [n for n in names if split_of(n) is None]
    if not sides["train"]:
        raise DataError(f"{where}: no training data among {names[:3]}; name them {hint}")
    return sides


def make_split(root: str, rel_paths, labels, sizes, *, keys=None) -> Split:
    """A Split from relative paths, labels and file sizes; keys are the paths' stable hashes
    unless given."""
    rel = np.empty(len(rel_paths), dtype=object)
    rel[:] = list(rel_paths)
    if keys is None:
        keys = np.fromiter((stable_hash(r) for r in rel), dtype=np.int64, count=len(rel))
    return Split(
        root,
        rel,
        np.asarray(labels, dtype=np.int32),
        np.asarray(keys, dtype=np.int64),
        np.asarray(sizes, dtype=np.int64),
    )


@dataclasses.dataclass(frozen=True)
class ImageTree:
    root: str
    layout: str  # "train/val" or "hash"
    class_names: tuple[str, ...]
    train: Split
    val: Split
    typical_size: tuple[int, int] | None = None  # median (width, height) of a sample of train headers; None: unread
    unreadable: tuple[tuple[str, str], ...] = ()  # (path, reason) of images the listing already found unusable
    lost_train: int = 0  # training images among them (a shard's samples that its damage cost), for coverage
    notes: tuple[str, ...] = ()  # warning lines the scan has for the user (one file under two names), shown before Ray

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def class_counts(self) -> tuple[int, ...]:
        """The training split's images per class, in class order."""
        labels = self.train.labels
        return tuple(int(c) for c in np.bincount(labels[labels >= 0], minlength=self.num_classes))

    def imbalance(self) -> str:
        """The training split's class balance, as the plan line shows it."""
        counts = [c for c in self.class_counts if c]
        if not counts:
            return f"classes: {self.num_classes}, no training images"
        ratio = max(counts) / min(counts)
        return f"classes: {self.num_classes}, largest {max(counts)} / smallest {min(counts)} images ({ratio:.1f}x)"

    def describe(self) -> str:
        size = f", typically {self.typical_size[0]} x {self.typical_size[1]} px" if self.typical_size else ""
        empty = self.num_classes - len(np.unique(self.train.labels))  # a ClassLabel's names may outnumber them
        classes = f"{self.num_classes} classes" + (f" ({empty} without training images)" if empty > 0 else "")
        return (
            f"{self.root}: {classes}, {len(self.train)} train / {len(self.val)} val images ({self.layout} split{size})"
        )


def check_classes(tree: ImageTree, val_fraction: float | None = None, declared: bool = False) -> ImageTree:
    """`tree`, or a DataError where it would train other than its user meant: on no image at all, or
    with a class that no training image has (its output learns nothing; its validation images all
    count as wrong). `val_fraction`: the hash split's, which the fix names (None: the source's own
    split). `declared`: the class names are the source's own list (a ClassLabel's), which may name
    classes without images (describe() counts them)."""
    hashed = f" at --val-fraction {val_fraction:g}" if val_fraction is not None else ""
    if not len(tree.train):
        if hashed and len(tree.val):
            raise DataError(
                f"{tree.root}: all {len(tree.val)} images fell into validation{hashed}; lower --val-fraction"
            )
        raise DataError(f"{tree.root}: the training split has no images ({len(tree.val)} in validation); add some")
    if declared:
        return tree
    labels = tree.train.labels
    if len(labels) and int(labels.max()) >= tree.num_classes:  # a damaged shard's label column, say
        raise DataError(
            f"{tree.root}: a training label is {int(labels.max())}, past the {tree.num_classes} classes it names; "
            "write the data again"
        )
    empty = np.flatnonzero(np.bincount(labels[labels >= 0], minlength=tree.num_classes) == 0)
    if len(empty):
        name, more = tree.class_names[empty[0]], f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        in_val = int((tree.val.labels == empty[0]).sum())
        hashed = hashed if in_val else ""  # the split put them there: a lower fraction may keep one for training
        raise DataError(
            f"{tree.root}: class {name!r}{more} has no training images ({in_val} in validation{hashed}); add "
            f"training images of it{', or lower --val-fraction' if hashed else ''}"
        )
    return tree
