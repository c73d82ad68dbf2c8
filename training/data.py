"""Image tree -> the files of each split, with their labels and keys.

The one place that knows the on-disk layout (docs/design.md, "Contracts"):

    DIR/train/<class>/...  +  DIR/val/<class>/...      explicit split
    DIR/<class>/...                                    hash split by relative path

Scanning happens on the driver, before Ray starts work, so every problem with the
tree is reported as a `DataError` (exit 2) naming the path and the fix. A split is held
as columns (numpy arrays, a few tens of bytes per file): an ImageNet-size tree of 1.28 M
files stays small on the driver. Ray Data reads the files (training/ingest.py): the table goes
to the object store once, and each read task takes its own rows of it.

The other forms --data takes (training/formats.py) give the same Split: a manifest's files
(training/manifest.py), or a ShardedSplit of images inside shards, read in units
(training/webdataset.py, training/huggingface.py, training/parquet.py).

    label  position of the class name in the sorted class list
    key    int64, stable hash of the path relative to DIR; seeds per-image augmentation
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path, PurePosixPath

import numpy as np

from training import storage

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class DataError(ValueError):
    """A problem with the user's data that the user can fix; the message says how."""


def stable_hash(text: str) -> int:
    """63-bit hash of a string, identical on every machine and Python process."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
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
        return [f"{self.root}/{r}" for r in self.rel_paths]

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
    """How a read task finds an image, its label and its key in a shard (training/formats.py read_units)."""

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


def label_text(value) -> str:
    """A label as a source gives it, as text: an index (7, "7", "007", 7.0) as its digits, a
    negative one with its sign, a name as it is; "" for none (None, blank)."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    digits = text[1:] if text.startswith("-") else text
    return str(int(text)) if digits.isascii() and digits.isdigit() else text


def _is_index(text: str) -> bool:
    return text.isascii() and text.lstrip("-").isdigit()


def index_labels(train_labels, val_labels, where: str) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """(class names, train labels, val labels as positions) from labels as a source gives them:
    class indices (names "0".."N-1", N the largest + 1) or class names (sorted). A DataError for a
    validation label that is no training class, or fewer than 2 classes."""
    train, val = [label_text(v) for v in train_labels], [label_text(v) for v in val_labels]
    if all(_is_index(t) for t in train + val):
        if any(t.startswith("-") for t in train + val):
            raise DataError(
                f"{where}: label {min(map(int, train + val))} is a negative class index; give indices 0..N-1 or "
                "class names, and leave unlabelled images out"
            )
        names = tuple(str(i) for i in range(max(map(int, train)) + 1)) if train else ()
    else:
        names = tuple(sorted(set(train)))
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(val) - set(index))
    if unknown:
        raise DataError(
            f"{where}: validation label(s) {unknown[:5]} are not among the training labels; fix those labels "
            "or add training images of the classes"
        )
    if len(names) < 2:
        raise DataError(f"{where}: {len(names)} class(es) in the training labels; a classifier needs at least 2")
    return names, np.array([index[t] for t in train], np.int32), np.array([index[t] for t in val], np.int32)


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

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def describe(self) -> str:
        size = f", typically {self.typical_size[0]} x {self.typical_size[1]} px" if self.typical_size else ""
        return (
            f"{self.root}: {self.num_classes} classes, {len(self.train)} train / "
            f"{len(self.val)} val images ({self.layout} split{size})"
        )


def list_images(fs, directory: str, suffixes=IMAGE_EXTENSIONS) -> list[tuple[str, int]]:
    """(path, size) of every image (file of one of `suffixes`) below `directory`, sorted; hidden
    files and folders skipped."""
    import pyarrow.fs as pafs

    out = []
    for info in fs.get_file_info(pafs.FileSelector(directory, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        rel = PurePosixPath(info.path).relative_to(directory)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if rel.suffix.lower() in suffixes:
            out.append((info.path, info.size or 0))
    out.sort()
    return out


def _class_dirs(fs, directory: str) -> list[str]:
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(directory, recursive=False))
    return sorted(
        PurePosixPath(i.path).name
        for i in infos
        if i.type == pafs.FileType.Directory and not PurePosixPath(i.path).name.startswith(".")
    )


def _is_dir(fs, path: str) -> bool:
    import pyarrow.fs as pafs

    return fs.get_file_info(path).type == pafs.FileType.Directory


def scan_tree(root: str, val_fraction: float = 0.2) -> ImageTree:
    """Find classes and files and split them. Raises DataError for anything unusable, and
    storage.StorageError when object storage refuses (credentials, bucket, permissions).
    (training.inputs.scan_data also takes a jobs.prepare directory.)"""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    storage.check_bucket(root)
    with storage.errors(root):
        return _scan(root, val_fraction)


def _scan(root: str, val_fraction: float) -> ImageTree:
    fs, base, uri_prefix = storage.filesystem(root)
    if not _is_dir(fs, base):
        missing = "no objects under this prefix" if storage.is_uri(root) else "no such directory"
        raise DataError(f"{root}: {missing}; pass --data with a folder laid out as <class>/<image>")

    layout = "train/val" if _is_dir(fs, f"{base}/train") and _is_dir(fs, f"{base}/val") else "hash"
    train_root = f"{base}/train" if layout == "train/val" else base
    shown = uri_prefix + train_root  # as the user wrote it: s3://bucket/photos/train
    class_names = _class_dirs(fs, train_root)
    if not class_names:
        raise DataError(
            f"{shown}: no class directories; put each class's images in its own sub-directory (<root>/<class>/<image>)"
        )
    if len(class_names) < 2:
        raise DataError(
            f"{shown}: only one class directory ({class_names[0]!r}); a classifier needs "
            "at least 2 classes, one sub-directory each"
        )
    if layout == "train/val":
        val_root = f"{base}/val"
        unknown = sorted(set(_class_dirs(fs, val_root)) - set(class_names))
        if unknown:
            raise DataError(
                f"{uri_prefix}{val_root}: validation classes {unknown} are not among the training classes "
                f"{list(class_names)}; rename them or add them under {shown}"
            )
        train = _collect(fs, base, "train", class_names, uri_prefix)
        val = _collect(fs, base, "val", class_names, uri_prefix)
    else:
        both = _collect(fs, base, "", class_names, uri_prefix)
        in_val = held_out(both.keys, val_fraction)  # in_validation, for every file at once
        train, val = both.subset(~in_val), both.subset(in_val)

    if len(train) == 0:
        raise DataError(
            f"{shown}: no images in the class directories (looked for "
            f"{', '.join(IMAGE_EXTENSIONS)}); add images or point --data elsewhere"
        )
    return ImageTree(root=root, layout=layout, class_names=tuple(class_names), train=train, val=val)


def _collect(fs, base: str, side: str, class_names, uri_prefix: str) -> Split:
    """The files below base/side, class directory by class directory (so the listing's
    temporary objects never outnumber one class's files)."""
    rel_paths, labels, sizes = [], [], []
    prefix = f"{side}/" if side else ""
    for label, name in enumerate(class_names):
        directory = f"{base}/{prefix}{name}"
        if not _is_dir(fs, directory):
            continue  # a class with no directory on this side (train/val layout)
        for path, size in list_images(fs, directory):
            rel_paths.append(prefix + name + "/" + str(PurePosixPath(path).relative_to(directory)))
            labels.append(label)
            sizes.append(size)
    return make_split(uri_prefix + base, rel_paths, labels, sizes)


class BadFileLog:
    """Collects (path, reason) of files that failed to decode, from every decoder; run as an
    actor with num_cpus=0. Decoders call it only when a batch has a bad file."""

    def __init__(self):
        self.bad: dict[str, str] = {}

    def add(self, rows: list[tuple[str, str]]) -> None:
        for path, reason in rows:
            self.bad.setdefault(path, reason)  # a file fails every epoch; keep it once

    def get(self) -> dict[str, str]:
        return dict(self.bad)


# --------------------------------------------------------------------------- default data


def default_dataset_dir() -> Path:
    """scikit-learn's 1,797 handwritten digit scans as 32x32 RGB PNGs, written once.

    The scans ship inside scikit-learn (no download). They are 8x8 with 17 grey levels;
    we upscale to 32x32 with bicubic resampling so the CIFAR preset applies unchanged.
    """
    cache = Path(os.environ.get("RGA_CACHE", Path.home() / ".cache" / "ray-gpu-augment"))
    root = cache / "digits"
    done = root / ".complete"
    if done.exists():
        return root
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    tmp = cache / f"digits.tmp{os.getpid()}"
    for i, (img, target) in enumerate(zip(digits.images, digits.target, strict=True)):
        side = "val" if in_validation(f"{i:04d}", 0.2) else "train"
        folder = tmp / side / str(target)
        folder.mkdir(parents=True, exist_ok=True)
        gray = Image.fromarray(np.uint8(np.round(img * (255.0 / 16.0))), mode="L")
        gray.resize((32, 32), Image.BICUBIC).convert("RGB").save(folder / f"{i:04d}.png")
    (tmp / ".complete").touch()
    if root.exists():  # another process finished first
        import shutil

        shutil.rmtree(tmp)
    else:
        tmp.rename(root)
    return root
