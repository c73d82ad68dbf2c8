"""An image tree -> an ImageTree: the classes from the folders, the split from split folders or
the path hash (training/forms/data.py holds what a scan gives, and the layouts)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path, PurePosixPath

import numpy as np

from training import storage
from training.forms.data import (
    SPLIT_NAMES,
    DataError,
    ImageTree,
    Split,
    check_classes,
    check_root_name,
    held_out,
    in_validation,
    make_split,
)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
METADATA_FILES = ("metadata.csv", "metadata.jsonl")  # the datasets library's imagefolder: labels by file, not folder


def is_hidden(name: str) -> bool:
    """A file or folder no listing takes: a hidden one (.DS_Store, macOS's ._photo.jpg AppleDouble files
    beside a zip's images), or the __MACOSX/ folder of resource forks that unzipping a macOS archive
    leaves beside the class folders."""
    return name.startswith(".") or name == "__MACOSX"


@dataclasses.dataclass
class Seen:
    """What the list_images calls for one tree listed: each real folder once, each file by its identity."""

    root: str = ""  # the tree's real path: links to files inside it are looked at (twin_pairs), others not
    folders: dict = dataclasses.field(default_factory=dict)  # real folder -> the path it was listed as
    linked: dict = dataclasses.field(default_factory=dict)  # (device, inode) of a hard-linked file -> first path
    twins: list = dataclasses.field(default_factory=list)  # (path, path) of one file listed under two names
    symlinks: list = dataclasses.field(default_factory=list)  # (path, real path) of each linked file

    def twin_pairs(self, suffixes=IMAGE_EXTENSIONS) -> list[tuple[str, str]]:
        """`twins`, and the linked files whose real file a listing took too (its folder was listed)."""
        pairs = list(self.twins)
        for path, real in self.symlinks:
            folder, name = os.path.split(real)
            if folder in self.folders and os.path.splitext(name)[1].lower() in suffixes and not is_hidden(name):
                pairs.append((storage.shown_name(f"{self.folders[folder]}/{name}"), path))
        return pairs


def list_images(fs, directory: str, suffixes=IMAGE_EXTENSIONS, seen: Seen | None = None) -> list[tuple[str, int]]:
    """(path, size) of every image (file of one of `suffixes`) below `directory`, sorted; hidden
    files and folders skipped (is_hidden). On local disk links to folders are followed, each real
    folder once (`seen`, shared by calls for one tree); DataError for a folder that another call's
    directory listed already (its images would have two labels). A local name that is not UTF-8
    comes as its storage.shown_name."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):  # pyarrow's listing follows a loop (cat/again -> .) until ELOOP
        return _list_local(directory, suffixes, Seen() if seen is None else seen)
    out = []
    for info in fs.get_file_info(pafs.FileSelector(directory, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        rel = PurePosixPath(info.path).relative_to(directory)
        if any(is_hidden(part) for part in rel.parts):
            continue
        if rel.suffix.lower() in suffixes:
            out.append((info.path, info.size or 0))
    out.sort()
    return out


def check_utf8_names(paths: list[str], what: str) -> None:
    """DataError for a listed local file whose name is not UTF-8 text (list_images escapes it) where
    pyarrow reads the file (a shard, an export's file), which cannot open such a name."""
    odd = next((p for p in paths if "\\x" in p and storage.disk_path(p) != p), None)
    if odd is not None:
        raise DataError(f"{odd}: a {what} whose name is not UTF-8 text; rename it (names inside it may be anything)")


def _list_local(directory: str, suffixes, seen: Seen) -> list[tuple[str, int]]:
    directory = storage.disk_path(directory)  # os.scandir's names, as the disk has them, until shown
    out, folders = [], [directory]
    while folders:
        folder = folders.pop()
        first = seen.folders.setdefault(os.path.realpath(folder), folder)
        if first != folder:  # listed already: by this call (a loop) it adds nothing; by another, two labels
            if first != directory and not first.startswith(directory + "/"):
                raise DataError(
                    f"{storage.shown_name(folder)}: the same folder as {storage.shown_name(first)} (a symbolic "
                    "link); its images would be in two classes or splits; remove the link"
                )
            continue
        with os.scandir(folder) as entries:
            for entry in entries:
                if is_hidden(entry.name):
                    continue
                if entry.is_dir():
                    folders.append(f"{folder}/{entry.name}")
                elif entry.is_file() and os.path.splitext(entry.name)[1].lower() in suffixes:
                    path = storage.shown_name(f"{folder}/{entry.name}")
                    out.append((path, _note_links(entry, path, seen)))
    out.sort()
    return out


def _note_links(entry, path: str, seen: Seen) -> int:
    """The file's size; a file with other names (a hard link, a symbolic link) goes into `seen`."""
    st = entry.stat()
    if entry.is_symlink():
        real = os.path.realpath(entry.path)
        if seen.root and real.startswith(seen.root + "/"):  # a link farm into another folder is no twin
            seen.symlinks.append((path, real))
    elif st.st_nlink > 1:  # only those: a dict of every file's inode would cost the driver 200 bytes a file
        first = seen.linked.setdefault((st.st_dev, st.st_ino), path)
        if first != path:
            seen.twins.append((first, path))
    return st.st_size


def entries(fs, folder: str) -> list[tuple[str, object]]:
    """(path, pyarrow FileType) of what `folder` holds (links followed; none where it is not there),
    hidden ones (is_hidden) left out; a local name that is not UTF-8 as its storage.shown_name."""
    import pyarrow.fs as pafs

    if not isinstance(fs, pafs.LocalFileSystem):
        infos = fs.get_file_info(pafs.FileSelector(folder, recursive=False, allow_not_found=True))
        return [(i.path, i.type) for i in infos if not is_hidden(PurePosixPath(i.path).name)]
    out = []  # pyarrow's local listing raises UnicodeDecodeError on a name that is not UTF-8
    try:
        with os.scandir(storage.disk_path(folder)) as found:
            for e in found:
                kind = pafs.FileType.Directory if e.is_dir() else pafs.FileType.File if e.is_file() else None
                if not is_hidden(e.name):
                    out.append((f"{folder}/{storage.shown_name(e.name)}", kind or pafs.FileType.Unknown))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return out


def _class_dirs(fs, directory: str) -> list[str]:
    import pyarrow.fs as pafs

    return sorted(PurePosixPath(p).name for p, kind in entries(fs, directory) if kind == pafs.FileType.Directory)


def _is_dir(fs, path: str) -> bool:
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):
        return os.path.isdir(storage.disk_path(path))
    return fs.get_file_info(path).type == pafs.FileType.Directory


def scan_tree(root: str, val_fraction: float = 0.2) -> ImageTree:
    """Find classes and files and split them. Raises DataError for anything unusable, and
    storage.StorageError when object storage refuses (credentials, bucket, permissions).
    (training.forms.formats.scan_data also takes a jobs.prepare directory.)"""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    check_root_name(root)
    storage.check_bucket(root)
    with storage.errors(root):
        return _scan(root, val_fraction)


def _scan(root: str, val_fraction: float) -> ImageTree:
    fs, base, uri_prefix = storage.filesystem(root)
    if not _is_dir(fs, base):
        missing = "no objects under this prefix" if storage.is_uri(root) else "no such directory"
        raise DataError(f"{root}: {missing}; give a folder laid out as <class>/<image>")

    sides = _split_folders(fs, base, uri_prefix + base)  # (train, val) folder names; None: a hash split
    train_root = f"{base}/{sides[0]}" if sides else base
    shown = uri_prefix + train_root  # as the user wrote it: s3://bucket/photos/train
    class_names = _classes(fs, train_root, shown)
    seen = Seen(os.path.realpath(storage.disk_path(base)) if not uri_prefix else "")  # each real folder once
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
    notes = _twins_note(seen.twin_pairs(), base, shown)
    tree = ImageTree(root=root, layout=layout, class_names=tuple(class_names), train=train, val=val, notes=notes)
    return check_classes(tree, None if sides else val_fraction)


def _twins_note(pairs: list[tuple[str, str]], base: str, shown: str) -> tuple[str, ...]:
    """The warning for image files listed under two names (hard or symbolic links): each name is an
    image of its own folder's class and split, so one photo in two class folders trains under both
    labels. A warning, not a refusal: links are how some tools file one photo under two classes on
    purpose, and the run can go on; the user who did not mean it learns of it before training."""
    if not pairs:
        return ()
    a, b = (p[len(base) + 1 :] if p.startswith(base + "/") else p for p in pairs[0])
    return (
        f"warning: {shown}: {len(pairs)} image file(s) are listed under two names (hard or symbolic links), e.g. "
        f"{a} and {b}; each name trains as an image of its own folder's class; remove the extra links unless that "
        "is meant",
    )


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


def _collect(fs, base: str, side: str, class_names, uri_prefix: str, seen: Seen) -> Split:
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
