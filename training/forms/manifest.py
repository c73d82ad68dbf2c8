"""A manifest file -> the files of each split with the labels it gives them.

    --data DIR/train.csv      path,label              (a header naming the two columns, or none:
                              cat/001.jpg,cat          then the first two columns are path, label)
    --data DIR/train.jsonl    {"path": "cat/001.jpg", "label": "cat"}

Paths are relative to the manifest's folder (`..` allowed, on object storage too), or s3:// and gs://
URIs, read from that storage (one storage for all the files of a manifest; http(s):// refused); a
local name that is not UTF-8 as storage.shown_name writes it (cat/caf\\xe9.jpg). Labels are
class names, or class indices (then the names are "0".."N-1"), one kind for the whole source
(training.forms.labels.index_labels); --label-key names another label column. The datasets library's
imagefolder `metadata.csv` (a `file_name` column) is a manifest too. UTF-8, or UTF-16 with its
byte order mark (Excel's "Unicode text", tab-separated). The split: a sibling manifest
named as this one with `val`, `validation` or `valid` for its last word `train` (train.csv ->
val.csv, imagenet_train.jsonl -> imagenet_validation.jsonl), or in a folder so named beside its
folder `train` (train/metadata.csv -> validation/metadata.csv), is the validation split; without
one, the stable hash split of each path. A file's key is the stable hash of its path as the
manifest writes it, normalised (a validation manifest in another folder: relative to the training
one's folder, so that the two splits' keys differ). Every listed file must exist: the driver looks each one up
(up to LOOKUP_PATHS files), or lists the folder they share once (one request per 1,000 files
on object storage), and names the first line whose file it does not find.
"""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
import re
import stat

import pyarrow.fs as pafs

from training import storage
from training.forms.data import DataError, ImageTree, check_classes, held_out, make_split, stable_hash
from training.forms.labels import index_labels, label_text

SUFFIXES = (".csv", ".jsonl")
PATH_COLUMNS = ("path", "file", "filename", "file_name", "filepath", "file_path", "image", "image_path", "image_id")
LABEL_COLUMNS = ("label", "class", "class_name", "class_id", "label_id", "category", "target")
VAL_NAMES = ("val", "validation", "valid")
DEFAULT_LABEL = "label"  # --label-key's default: then any of LABEL_COLUMNS
URI_SCHEMES = ("s3", "gs", "gcs")  # what a manifest's path may name besides local files (training/storage.py)
LOOKUP_PATHS = 2_000  # a manifest of at most this many files looks each one up instead of listing their folder


def is_manifest(root: str) -> bool:
    return root.lower().endswith(SUFFIXES)


def read_rows(text: str, where: str, label_key: str = DEFAULT_LABEL) -> list[tuple[int, str, str]]:
    """(line number, path, label) of every entry of a manifest's text; the label is the `label_key`
    column (--label-key) where it is not the default. DataError naming the first line that has no
    path or no label, or a header without the label's column."""
    if where.lower().endswith(".jsonl"):
        return _jsonl_rows(text, where, label_key)
    first = text.splitlines()[0] if text else ""
    separator = "\t" if "\t" in first and "," not in first else ","  # Excel's "Unicode text" is tab-separated
    lines = list(csv.reader(io.StringIO(text, newline=""), delimiter=separator))  # \n, \r\n and a lone \r alike
    cols, skip = _columns(lines[0] if lines else [], where, label_key)
    rows = []
    for n, line in enumerate(lines[skip:], skip + 1):
        if not any(c.strip() for c in line):
            continue
        if len(line) <= max(cols) or not line[cols[0]].strip() or not line[cols[1]].strip():
            raise DataError(f"{where}:{n}: no path and label; write each line as path,label")
        rows.append((n, line[cols[0]].strip(), line[cols[1]].strip()))
    return rows


def _columns(header: list[str], where: str, label_key: str) -> tuple[tuple[int, int], int]:
    """((path column, label column), header lines) of a CSV manifest by its first line: a header names
    a path column (PATH_COLUMNS: the datasets library's imagefolder writes `file_name`); without one
    the first two columns are path and label."""
    names = [c.strip().lower() for c in header]
    wanted = LABEL_COLUMNS if label_key == DEFAULT_LABEL else (label_key.lower(),)
    path = next((i for i, c in enumerate(names) if c in PATH_COLUMNS), None)
    label = next((i for i, c in enumerate(names) if c in wanted), None)
    if path is not None and label is not None:
        return (path, label), 1
    if path is not None and label_key != DEFAULT_LABEL:
        raise DataError(f"{where}:1: --label-key {label_key}: no such column in the header {header}; name one of them")
    if path is not None:
        raise DataError(
            f"{where}:1: the header names no label column ({', '.join(LABEL_COLUMNS)}); name the column that holds "
            "the labels with --label-key"
        )
    if label_key != DEFAULT_LABEL:
        raise DataError(
            f"{where}: --label-key {label_key}: no header line names the columns; add one (path,{label_key})"
        )
    return (0, 1), 0


def _jsonl_rows(text: str, where: str, label_key: str) -> list[tuple[int, str, str]]:
    rows = []
    labels = LABEL_COLUMNS if label_key == DEFAULT_LABEL else (label_key,)
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            path = next(str(entry[c]) for c in PATH_COLUMNS if c in entry)
            label = next((entry[c] for c in labels if c in entry), None)
        except (ValueError, TypeError, StopIteration):
            raise DataError(f'{where}:{n}: not a JSON object with "path" and "label"; write one per line') from None
        if not label_text(label):
            raise DataError(f"{where}:{n}: no label; give each file a class name or index, or drop the line")
        rows.append((n, path, label))
    return rows


def sibling(root: str) -> str | None:
    """The validation manifest beside a training one: `train` in its file name -> val, validation
    (train.csv -> val.csv); else, in a folder named train, the same name in a folder val, validation
    (the datasets library's imagefolder: train/metadata.csv -> validation/metadata.csv)."""
    folder, _, name = root.rpartition("/")
    words = list(re.finditer(r"(?<![a-z])train(?![a-z])", name, flags=re.IGNORECASE))
    if words:
        at = words[-1]  # the last: imagenet_train.csv, constrained_train.csv
        candidates = [f"{folder}/{name[: at.start()]}{v}{name[at.end() :]}" for v in VAL_NAMES]
    elif folder.rpartition("/")[2].lower() == "train":
        candidates = [f"{folder.rpartition('/')[0]}/{v}/{name}" for v in VAL_NAMES]
    else:
        return None
    fs, _, _ = storage.filesystem(root)
    for candidate in candidates:
        if fs.get_file_info(storage.filesystem(candidate)[1]).type == pafs.FileType.File:
            return candidate
    return None


def _load(path: str, label_key: str) -> list[tuple[int, str, str]]:
    fs, inner, _ = storage.filesystem(path)
    info = fs.get_file_info(inner)
    if info.type != pafs.FileType.File:
        raise DataError(f"{path}: no such manifest; give --data a .csv or .jsonl of path,label")
    with fs.open_input_file(inner) as f:
        raw = f.read()
    try:
        text = storage.decode_text(raw)
    except ValueError as e:
        raise DataError(f"{path}: {e}; save it as UTF-8 (in Excel: CSV UTF-8)") from None
    rows = read_rows(text, path, label_key)
    if not rows:
        raise DataError(f"{path}: no entries; write one path,label per line")
    return rows


def scan_manifest(root: str, val_fraction: float, label_key: str = DEFAULT_LABEL) -> ImageTree:
    """The ImageTree of a manifest (and its validation sibling). DataError for a manifest or a
    listed file that does not exist, a file listed twice, labels that are not one kind (index_labels),
    or a split that leaves a class without training images."""
    with storage.errors(root):
        val_path = sibling(root)
        manifests = {"train": root, "val": val_path}
        resolved = {  # (line, the path inside the files' filesystem, label, the URI given or "")
            side: _resolve(path, label_key) if path else [] for side, path in manifests.items()
        }
    folder = posixpath.dirname(storage.filesystem(root)[1])  # keys: paths relative to it
    files = _files_storage(root, manifests, resolved)  # the manifest's own storage, or the one its URIs name
    storage.check_bucket(files)
    with storage.errors(files):
        _, _, prefix = storage.filesystem(files)
        top = _common_folder([p for rows in resolved.values() for _, p, _, _ in rows])
        sizes = _sizes(files, top, prefix, [p for rows in resolved.values() for _, p, _, _ in rows])
    _check_listed(resolved, sizes, manifests, prefix)
    shown = {
        "train": posixpath.basename(root),
        "val": val_path and posixpath.relpath(val_path, posixpath.dirname(root)),
    }
    entries = len(resolved["train"])

    def line(i: int) -> str:  # FILE:LINE of the i-th label, train then val: only a refusal asks
        side, i = ("train", i) if i < entries else ("val", i - entries)
        return f"{shown[side]}:{resolved[side][i][0]}"

    train_labels, val_labels = ([lab for _, _, lab, _ in resolved[side]] for side in ("train", "val"))
    names, *labels = index_labels(train_labels, val_labels, root, line)
    train, val = (
        make_split(
            prefix + top,
            [posixpath.relpath(p, top) for _, p, _, _ in resolved[side]],
            side_labels,
            [sizes[p] for _, p, _, _ in resolved[side]],
            keys=[stable_hash(uri or posixpath.relpath(p, folder)) for _, p, _, uri in resolved[side]],
        )
        for side, side_labels in zip(("train", "val"), labels, strict=True)
    )
    if val_path:
        layout = f"{shown['train']} + {shown['val']}: the manifests' own"
    else:
        in_val = held_out(train.keys, val_fraction)
        layout, train, val = (
            f"manifest, hash by val_fraction {val_fraction}",
            train.subset(~in_val),
            train.subset(in_val),
        )
    tree = ImageTree(root=root, layout=layout, class_names=names, train=train, val=val)
    return check_classes(tree, None if val_path else val_fraction)


def _resolve(path: str, label_key: str) -> list[tuple[int, str, str, str]]:
    """(line, the listed file's path inside its filesystem, label, the URI it gives: "" for a path
    relative to the manifest's folder) of each entry of a manifest. A URI
    is taken as one, never joined to the folder: s3:// and gs:// are read as the manifest's own
    storage is; DataError for any other (a web address)."""
    fs_path = storage.filesystem(path)[1]
    folder = posixpath.dirname(fs_path)
    rows = []
    for n, p, label in _load(path, label_key):
        if storage.is_uri(p):
            scheme = p.split("://", 1)[0].lower()
            if scheme not in URI_SCHEMES:
                raise DataError(
                    f"{path}:{n}: {p}: a {scheme}:// address; a manifest's files are read from local disk, s3:// or "
                    "gs:// only: copy them there and list those paths"
                )
            inner = posixpath.normpath(p.split("://", 1)[1])
            rows.append((n, inner, label, f"{scheme}://{inner}"))
        else:
            inner = posixpath.normpath(posixpath.join(folder, p))
            rows.append((n, inner, label, ""))
    return rows


def _files_storage(root: str, manifests: dict, resolved: dict) -> str:
    """Where the listed files are: `root` (the manifest; paths relative to it), or the URI its entries
    give. DataError for entries on two storages (a local path beside an s3:// one, s3:// beside gs://)."""
    first, where = None, root
    for side, rows in resolved.items():
        for n, _, _, given in rows:
            uri = given or root
            scheme = uri.split("://", 1)[0] if storage.is_uri(uri) else "local disk"
            if first is None:
                first, where = (f"{manifests[side]}:{n}", scheme), uri
            elif scheme != first[1]:
                raise DataError(
                    f"{manifests[side]}:{n}: a file on {scheme}, but {first[0]} lists one on {first[1]}; list the "
                    "files of one manifest on one storage"
                )
    return where


def _common_folder(paths: list[str]) -> str:
    """The deepest folder that holds every path."""
    top = posixpath.commonpath(paths) if len(paths) > 1 else posixpath.dirname(paths[0])
    return posixpath.dirname(top) if top in set(paths) else top


def _check_listed(resolved: dict, sizes: dict, manifests: dict, prefix: str) -> None:
    """DataError naming FILE:LINE for a listed file that is not there, or one listed before."""
    seen: dict[str, str] = {}
    for side, rows in resolved.items():
        for n, path, _, _ in rows:
            where = f"{manifests[side]}:{n}"
            if path not in sizes:
                raise DataError(
                    f"{where}: {prefix}{path}: no such file; fix the path (relative to the manifest) or drop it"
                )
            if path in seen:
                raise DataError(f"{where}: {path} is listed already ({seen[path]}); list each file once, in one split")
            seen[path] = where


def _sizes(root: str, top: str, prefix: str, paths: list[str]) -> dict[str, int]:
    """{path: bytes} of the files the manifest lists that exist: a listing of `top` (the folder
    they share: one request per 1,000 files on object storage) where they are many, each one
    looked up where they are few or share no folder but the root."""
    from concurrent.futures import ThreadPoolExecutor

    fs, _, _ = storage.filesystem(root)
    if isinstance(fs, pafs.LocalFileSystem):  # pyarrow's: no name that is not UTF-8, listed or looked up
        with ThreadPoolExecutor(16) as pool:
            return {p: size for p, size in zip(paths, pool.map(_local_size, paths), strict=True) if size is not None}
    if len(paths) <= LOOKUP_PATHS or top in ("", "/") or (prefix and "/" not in top):  # a root or a whole bucket
        with ThreadPoolExecutor(16) as pool:  # object storage: a request each
            infos = list(pool.map(fs.get_file_info, paths))
    elif fs.get_file_info(top).type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(top, recursive=True))
    else:
        raise DataError(f"{root}: {prefix}{top}: no such folder; the manifest's paths are relative to its own folder")
    return {i.path: i.size or 0 for i in infos if i.type == pafs.FileType.File}


def _local_size(path: str) -> int | None:
    """The bytes of a local file (a name that is not UTF-8 given as its storage.shown_name); None for none."""
    try:
        st = os.stat(storage.disk_path(path))
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None
