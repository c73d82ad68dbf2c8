"""What `--data` names, told apart by what is there (docs/guide.md, "Other forms of data"):

    prepared      DIR/_prepared.json                 jobs.prepare's shards (training/forms/parquet.py)
    manifest      a .csv or .jsonl file               path,label lines (training/forms/manifest.py)
    webdataset    a .tar (.tar.gz, .tgz), a brace pattern, or a folder with such files
                                                      (training/forms/webdataset.py)
    huggingface   a folder with .parquet files, or with .arrow files (Dataset.save_to_disk), or one
                  such file                           a Hugging Face export (training/forms/huggingface.py)
    tree          anything else: DIR/<class>/<img>    (training/forms/tree.py)

A folder is judged by the files a short walk from its top finds (its own, then those of a
few sub-folders, two levels down at most): images anywhere make it a tree (a stray .tar or
.parquet beside class folders does not), else shards, else .parquet files an export, else
.arrow files one. Telling a tree of a million files from a folder of shards costs a handful of
listings, not a listing of everything. Any other file is refused on one line (an image: give
its folder).
"""

from __future__ import annotations

import tarfile
from pathlib import PurePosixPath

import numpy as np
import pyarrow.fs as pafs

from augment.decode import BadImage, decode_image, read_header
from training import storage
from training.forms import huggingface, webdataset
from training.forms.data import DataError, ImageTree, check_root_name, on_side
from training.forms.huggingface import EXPORT_SUFFIXES, read_export_units, scan_export
from training.forms.labels import by_index, name_classes, read_class_names
from training.forms.manifest import is_manifest, scan_manifest
from training.forms.parquet import first_prepared_sizes, is_prepared, read_prepared_units, scan_prepared
from training.forms.tree import IMAGE_EXTENSIONS, check_utf8_names, entries, list_images, scan_tree
from training.forms.webdataset import (
    classes_file,
    is_shard,
    is_shard_pattern,
    read_tar_units,
    scan_webdataset,
    shard_names,
)
from training.rows import BYTES, KEY, LABEL, PATH

WALK_DEPTH, WALK_WIDTH = 2, 4  # folder levels below the top, sub-folders looked into per folder
READERS = {"prepared": read_prepared_units, "huggingface": read_export_units, "webdataset": read_tar_units}
SAMPLERS = {"huggingface": huggingface.first_images, "webdataset": webdataset.first_images}


def scan_data(root: str, val_fraction: float = 0.2, label_key: str = "label", class_names: str = "") -> ImageTree:
    """The images `root` holds, by what is there (data_kind, below): an image tree,
    WebDataset shards, a Hugging Face export (Parquet, or save_to_disk's Arrow files), a manifest,
    or the Parquet shards `python -m jobs.prepare` wrote (its split is the one fixed when
    preparing). Class indices take their names from `class_names` (--class-names: a file, line i
    naming class i), else from a classes.txt beside WebDataset shards. DataError for anything
    unusable, storage.StorageError for object storage that refuses."""
    kind, files = data_kind(root)
    with storage.errors(root):
        if kind == "prepared":
            tree = scan_prepared(root)
        elif kind == "manifest":
            tree = scan_manifest(root, val_fraction, label_key)
        elif kind == "webdataset":
            tree = scan_webdataset(root, val_fraction, label_key)
        elif kind == "huggingface":
            tree = scan_export(root, files, val_fraction, label_key)
        else:
            tree = scan_tree(root, val_fraction)
        beside = classes_file(root) if kind == "webdataset" and not class_names else None
        if beside and by_index(tree.class_names):  # labels that are names keep them
            return name_classes(tree, read_class_names(beside), beside)
    return (
        name_classes(tree, read_class_names(class_names, "--class-names"), f"--class-names {class_names}")
        if class_names
        else tree
    )


def read_units(units, root: str, shards, form, bad: list | None = None):
    """The rows of a sharded split's `units` as an Arrow table {bytes, path (below root), label, key}.
    What cannot be read of them (a shard gone, a row group or a run of tar members that does not
    parse) goes to `bad` as (path, reason), with the rows it held; without `bad`, it raises."""
    return READERS[form.kind](units, root, shards, form, bad)


def sample_sizes(split, count: int) -> list[tuple[int, int]]:
    """(width, height) of up to `count` images of a sharded split, from their headers (training.driver.inputs.
    typical_size): the first images of evenly spaced units, as many of each as spread `count` over
    them; each read stops after those (a ranged read of a tar run's start, a row group's first
    pages; prepared shards: their width and height columns), so that it stays cheap on object
    storage. A unit that cannot be read, or a header that does not, gives none: those images fail,
    and are listed, when training meets them."""
    from concurrent.futures import ThreadPoolExecutor

    units = split.units
    picks = np.unique(np.linspace(0, len(units) - 1, min(count, len(units))).round().astype(int))
    each = -(-count // max(1, len(picks)))

    def first(unit) -> list[tuple[int, int]]:
        try:
            if split.form.kind == "prepared":
                return first_prepared_sizes(unit, split.shards, each)
            datas = SAMPLERS[split.form.kind](unit, split.shards, split.form, each, split.mean_file_bytes)
        except (OSError, ValueError, tarfile.TarError, EOFError):  # storage's, Arrow's (ArrowInvalid), tar's
            return []
        return [size for size in map(header_size, datas) if size]

    with ThreadPoolExecutor(8) as pool:  # object storage: a request or a few each
        return [size for found in pool.map(first, units[picks]) for size in found][:count]


def header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from an image's first bytes, read as decoding reads headers; None for a bad one."""
    try:
        height, width, _ = read_header(data)
    except BadImage:
        return None
    return width, height


def data_kind(root: str) -> tuple[str, list[str] | None]:
    """(kind, for a Hugging Face export its files relative to `root`: None where `root` is one).
    DataError for a file that is none of the forms."""
    check_root_name(root)
    if is_shard_pattern(root):  # a URI with braces is none to pyarrow: its folder is
        storage.check_bucket(shard_names(root)[0])
        return "webdataset", None
    storage.check_bucket(root)  # the first request to --data: bad credentials are named here
    if is_manifest(root):
        return "manifest", None
    fs, base, _ = storage.filesystem(root)
    with storage.errors(root):
        if fs.get_file_info(base).type == pafs.FileType.File:
            return _one_file(root), None
    if is_prepared(root):
        return "prepared", None
    with storage.errors(root):
        kind = _walk(fs, base)
        if kind in EXPORT_SUFFIXES:
            return "huggingface", _export_files(fs, base, kind)
        return kind, None


def _one_file(root: str) -> str:
    """The kind of one file given as --data (a shard or a manifest is told by its name before)."""
    suffix = PurePosixPath(root).suffix.lower()
    if suffix in EXPORT_SUFFIXES:
        return "huggingface"
    if suffix in IMAGE_EXTENSIONS:
        raise DataError(
            f"{root}: an image file, not a folder; give --data the folder that holds it (to train: the folder of "
            "its class folder, DIR/<class>/<image>)"
        )
    raise DataError(
        f"{root}: a file that --data does not read; give a folder of images, WebDataset shards (.tar, .tar.gz), a "
        "Hugging Face export (.parquet, or a save_to_disk folder) or a manifest (.csv, .jsonl)"
    )


def _walk(fs, base: str) -> str:
    level, found = [base], set()
    for _ in range(WALK_DEPTH + 1):
        below = []
        for folder in level:
            shown = entries(fs, folder)  # hidden ones left out
            found |= {_suffix(p) for p, kind in shown if kind == pafs.FileType.File}
            if found & set(IMAGE_EXTENSIONS):  # images win: a stray archive beside class folders stays a tree
                return "tree"
            below += sorted(p for p, kind in shown if kind == pafs.FileType.Directory)[:WALK_WIDTH]
        level = below
    return "webdataset" if ".tar" in found else next((s for s in EXPORT_SUFFIXES if s in found), "tree")


def _suffix(path: str) -> str:
    """A file's suffix, a shard's (.tar.gz, .tgz) as .tar."""
    return ".tar" if is_shard(path) else PurePosixPath(path).suffix.lower()


def _export_files(fs, base: str, suffix: str) -> list[str]:
    found = [p for p, _ in list_images(fs, base, (suffix,))]
    check_utf8_names(found, f"{suffix} file")
    return [str(PurePosixPath(p).relative_to(base)) for p in found]


def shard_examples(split, *, classes: int, per_class: int, skipped: list | None = None) -> tuple[list, list, list]:
    """augment.preview.read_examples for a sharded split: the first `per_class` images of each of
    the first `classes` labels, in the order of its units, decoded; what fails to read or decode
    is passed over, and added to `skipped` as (path, reason)."""
    chosen: dict[int, list] = {}
    skipped = [] if skipped is None else skipped
    for unit in split.units:
        table = read_units(unit[None], split.root, split.shards, split.form, skipped)
        columns = (table.column(c).to_pylist() for c in (BYTES, LABEL, KEY, PATH))
        for data, label, key, path in zip(*columns, strict=True):
            if on_side(key, split.side) and label < classes and len(chosen.setdefault(label, [])) < per_class:
                try:
                    chosen[label].append((decode_image(data), label, key))
                except BadImage as e:
                    skipped.append((f"{split.root}/{path}", str(e)))
        if len(chosen) == classes and all(len(v) == per_class for v in chosen.values()):
            break
    picks = [p for label in sorted(chosen) for p in chosen[label]]
    return [p[0] for p in picks], [p[1] for p in picks], [p[2] for p in picks]
