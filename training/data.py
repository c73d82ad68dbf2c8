"""Image tree -> the files of each split, with their labels and keys.

The one place that knows the on-disk layout (docs/design.md, "Contracts"):

    DIR/train/<class>/...  +  DIR/val/<class>/...      explicit split (val/: or validation/,
                                                       valid/, dev/, as shards name it; test/ left out)
    DIR/<class>/...                                    hash split by relative path

Scanning happens on the driver, before Ray starts work, so every problem with the
tree is reported as a `DataError` (exit 2) naming the path and the fix: split folders that
make no split, a class folder without images, a class without training images, a folder
reached twice through a link (each real folder is listed once). A split is held
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
METADATA_FILES = ("metadata.csv", "metadata.jsonl")  # the datasets library's imagefolder: labels by file, not folder


class DataError(ValueError):
    """A problem with the user's data that the user can fix; the message says how."""


def below(root: str, rel: str) -> str:
    """The path of `rel` below `root` ("/" and roots ending in "/" too: never a doubled slash)."""
    return f"{root.rstrip('/')}/{rel}"


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
    """A label as a source gives it, as text: an index (7, "7", "007", 7.0, "7.0": pandas writes an
    integer column with a gap as floats) as its digits, a negative one with its sign, a name as it
    is; "" for none (None, blank)."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    whole, dot, fraction = text.partition(".")
    digits = whole[1:] if whole.startswith("-") else whole
    if digits.isascii() and digits.isdigit() and (not dot or not fraction.strip("0")):
        return str(int(whole))
    return text


def _is_index(text: str) -> bool:
    return text.isascii() and text.lstrip("-").isdigit()


def index_labels(train_labels, val_labels, where: str, at=None) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """(class names, train labels, val labels as positions) from labels as a source gives them, whose
    kind is decided once for the whole source: all class indices (names "0".."N-1", N the largest
    + 1) or all class names (sorted). `at(i)` names the i-th label (train, then val: FILE:LINE, a
    sample) in a DataError: for a mix of indices and names, a negative index, two names that differ
    only in case, indices that leave a class without training labels (0, 1, 999), a validation label
    that is no training class, or fewer than 2 classes."""
    known: dict = {}  # a source repeats a few labels many times; each is made text once

    def text(value) -> str:
        key = (type(value), value)  # True is no 1
        try:
            return known[key]
        except KeyError:
            known[key] = label_text(value)
            return known[key]
        except TypeError:  # unhashable: a JSON list
            return label_text(value)

    texts = [text(v) for v in (*train_labels, *val_labels)]
    at = at or (lambda i: f"label {i + 1}")
    _check_kind(texts, where, at)
    train, val = texts[: len(train_labels)], texts[len(train_labels) :]
    names = _index_names(train, where, at) if train and _is_index(train[0]) else tuple(sorted(set(train)))
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


def _check_kind(texts: list[str], where: str, at) -> None:
    """DataError for labels of more than one kind (indices beside names, a negative index, names
    that differ only in case); the labels are looked at one by one only once one is found."""
    kinds = {t: _is_index(t) for t in set(texts)}
    negative = next((t for t, is_index in kinds.items() if is_index and t.startswith("-")), None)
    if negative is not None:
        raise DataError(
            f"{where}: label {negative} ({at(texts.index(negative))}) is a negative class index; give indices "
            "0..N-1 or class names, and leave unlabelled images out"
        )
    if len(set(kinds.values())) > 1:
        i = next(i for i, t in enumerate(texts) if kinds[t])
        j = next(j for j, t in enumerate(texts) if not kinds[t])
        raise DataError(
            f"{where}: the labels mix class indices ({at(i)}: {texts[i]!r}) and class names ({at(j)}: "
            f"{texts[j]!r}); give every label as an index 0..N-1, or every one as a name"
        )
    folded: dict[str, str] = {}
    for name in kinds:
        other = folded.setdefault(name.casefold(), name)
        if other != name:
            i, j = sorted((texts.index(other), texts.index(name)))
            raise DataError(
                f"{where}: labels {texts[i]!r} ({at(i)}) and {texts[j]!r} ({at(j)}) differ only in case; write "
                "each class's name one way"
            )


def _index_names(train: list[str], where: str, at) -> tuple[str, ...]:
    """The names "0".."N-1" of training labels that are indices; DataError where one of them has no label."""
    used = set(train)
    top = max(int(t) for t in used)
    empty = [str(i) for i in range(top + 1) if str(i) not in used]
    if empty:
        raise DataError(
            f"{where}: class indices run to {top} ({at(train.index(str(top)))}) but {len(empty)} of those {top + 1} "
            f"classes have no training image ({', '.join(empty[:3])}{', ...' if len(empty) > 3 else ''}); number "
            "the classes 0..N-1 without gaps, or give class names"
        )
    return tuple(str(i) for i in range(top + 1))


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

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

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


def list_images(fs, directory: str, suffixes=IMAGE_EXTENSIONS, seen: dict | None = None) -> list[tuple[str, int]]:
    """(path, size) of every image (file of one of `suffixes`) below `directory`, sorted; hidden
    files and folders skipped. On local disk links to folders are followed, each real folder once
    (`seen`, shared by calls for one tree: {real folder: the path it was listed as}); DataError for a
    folder that another call's directory listed already (its images would have two labels)."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):  # pyarrow's listing follows a loop (cat/again -> .) until ELOOP
        return _list_local(directory, suffixes, {} if seen is None else seen)
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


def _list_local(directory: str, suffixes, seen: dict) -> list[tuple[str, int]]:
    out, folders = [], [directory]
    while folders:
        folder = folders.pop()
        first = seen.setdefault(os.path.realpath(folder), folder)
        if first != folder:  # listed already: by this call (a loop) it adds nothing; by another, two labels
            if first != directory and not first.startswith(directory + "/"):
                raise DataError(
                    f"{folder}: the same folder as {first} (a symbolic link); its images would be in two classes "
                    "or splits; remove the link"
                )
            continue
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir():
                    folders.append(f"{folder}/{entry.name}")
                elif entry.is_file() and os.path.splitext(entry.name)[1].lower() in suffixes:
                    out.append((f"{folder}/{entry.name}", entry.stat().st_size))
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

    sides = _split_folders(fs, base, uri_prefix + base)  # (train, val) folder names; None: a hash split
    train_root = f"{base}/{sides[0]}" if sides else base
    shown = uri_prefix + train_root  # as the user wrote it: s3://bucket/photos/train
    class_names = _classes(fs, train_root, shown)
    seen: dict = {}  # the real folders listed: each once, and in one class of one split
    if sides:
        val_root = f"{base}/{sides[1]}"
        unknown = sorted(set(_class_dirs(fs, val_root)) - set(class_names))
        if unknown:
            raise DataError(
                f"{uri_prefix}{val_root}: validation classes {unknown} are not among the training classes "
                f"{list(class_names)}; rename them or add them under {shown}"
            )
        train = _collect(fs, base, sides[0], class_names, uri_prefix, seen)
        val = _collect(fs, base, sides[1], class_names, uri_prefix, seen)
    else:
        both = _collect(fs, base, "", class_names, uri_prefix, seen)
        in_val = held_out(both.keys, val_fraction)  # in_validation, for every file at once
        train, val = both.subset(~in_val), both.subset(in_val)

    counts = np.bincount(np.concatenate([train.labels, val.labels]), minlength=len(class_names))
    if not counts.any():
        raise DataError(
            f"{shown}: no images in the class directories (looked for "
            f"{', '.join(IMAGE_EXTENSIONS)}); add images or point --data elsewhere"
        )
    if not counts.all():  # torchvision's ImageFolder refuses an empty class folder too
        name = class_names[int(np.flatnonzero(counts == 0)[0])]
        raise DataError(
            f"{shown}/{name}: no images in class directory {name!r} (looked for {', '.join(IMAGE_EXTENSIONS)}); "
            "add images or remove the directory"
        )
    layout = "train/val" if sides else "hash"
    tree = ImageTree(root=root, layout=layout, class_names=tuple(class_names), train=train, val=val)
    return check_classes(tree, None if sides else val_fraction)


def _split_folders(fs, base: str, shown: str) -> tuple[str, str] | None:
    """(train folder, validation folder) where `base`'s folders name a split by split_of's words
    (train/, val/, validation/, valid/, dev/; test/ is left out, as test shards are); None where
    none does: class folders, split by hash. DataError for split folders that make no split, or
    that sit beside class folders (the datasets library's imagefolder would drop those; ImageFolder
    would train `validation` as a class)."""
    folders = _class_dirs(fs, base)
    splits: dict[str, list[str]] = {}
    for name in folders:
        if name.lower() in SPLIT_NAMES:
            splits.setdefault(SPLIT_NAMES[name.lower()], []).append(name)
    if not splits:
        return None
    for side, word in (("train", "training"), ("val", "validation")):
        if len(splits.get(side, [])) > 1:
            a, b = splits[side][:2]
            raise DataError(f"{shown}: both {a}/ and {b}/ name the {word} split; keep one")
    if "train" in splits and "val" in splits:
        return splits["train"][0], splits["val"][0]
    named = sorted(n for names in splits.values() for n in names)
    others = [f for f in folders if f.lower() not in SPLIT_NAMES]
    if others:
        raise DataError(
            f"{shown}: split folder(s) {named} beside the class folders {others[:3]}; put every class under "
            "train/<class> and val/<class>, or rename those folders if they are classes"
        )
    if "train" not in splits:
        raise DataError(
            f"{shown}: split folder(s) {named} but no train/ folder; put the training images in train/<class>/"
        )
    train = f"{shown}/{splits['train'][0]}"
    raise DataError(
        f"{train}: no val/ folder beside it (nor validation/, valid/ or dev/); add one, or give --data {train} to "
        "split it by --val-fraction"
    )


def _classes(fs, train_root: str, shown: str) -> list[str]:
    """The class folders of a tree's training side; DataError for fewer than 2, or for labels the
    datasets library's imagefolder would take from a metadata file instead."""
    import pyarrow.fs as pafs

    for name in METADATA_FILES:
        if fs.get_file_info(f"{train_root}/{name}").type == pafs.FileType.File:
            raise DataError(
                f"{shown}/{name}: the labels are in the datasets library's metadata file, not in class folders; give "
                f"--data {shown}/{name} (or rename it to label by folder)"
            )
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
    return class_names


def _collect(fs, base: str, side: str, class_names, uri_prefix: str, seen: dict) -> Split:
    """The files below base/side, class directory by class directory (so the listing's
    temporary objects never outnumber one class's files); `seen`: list_images's."""
    rel_paths, labels, sizes = [], [], []
    prefix = f"{side}/" if side else ""
    for label, name in enumerate(class_names):
        directory = f"{base}/{prefix}{name}"
        if not _is_dir(fs, directory):
            continue  # a class with no directory on this side (train/val layout)
        for path, size in list_images(fs, directory, seen=seen):
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
