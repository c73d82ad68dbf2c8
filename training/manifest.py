"""A manifest file -> the files of each split with the labels it gives them.

    --data DIR/train.csv      path,label              (a header naming the two columns, or none:
                              cat/001.jpg,cat          then the first two columns are path, label)
    --data DIR/train.jsonl    {"path": "cat/001.jpg", "label": "cat"}

Paths are relative to the manifest's folder (`..` allowed, on object storage too). Labels are
class names, or class indices (then the names are "0".."N-1"). The split: a sibling manifest
named as this one with `val`, `validation` or `valid` for its last word `train` (train.csv ->
val.csv, imagenet_train.jsonl -> imagenet_validation.jsonl) is the validation split; without
one, the stable hash split of each path. A file's key is the stable hash of its path as the
manifest writes it, normalised. Every listed file must exist: the driver looks each one up
(up to LOOKUP_PATHS files), or lists the folder they share once (one request per 1,000 files
on object storage), and names the first line whose file it does not find.
"""

from __future__ import annotations

import csv
import io
import json
import posixpath
import re

import pyarrow.fs as pafs

from training import storage
from training.data import DataError, ImageTree, held_out, index_labels, label_text, make_split, stable_hash

SUFFIXES = (".csv", ".jsonl")
PATH_COLUMNS = ("path", "file", "filename", "filepath", "file_path", "image", "image_path", "image_id")
LABEL_COLUMNS = ("label", "class", "class_name", "class_id", "label_id", "category", "target")
VAL_NAMES = ("val", "validation", "valid")
LOOKUP_PATHS = 2_000  # a manifest of at most this many files looks each one up instead of listing their folder


def is_manifest(root: str) -> bool:
    return root.lower().endswith(SUFFIXES)


def read_rows(text: str, where: str) -> list[tuple[int, str, str]]:
    """(line number, path, label) of every entry of a manifest's text; DataError naming the
    first line that has no path or no label."""
    rows = []
    if where.lower().endswith(".jsonl"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                path, label = str(entry["path"]), entry["label"]
            except (ValueError, KeyError, TypeError):
                raise DataError(f'{where}:{n}: not a JSON object with "path" and "label"; write one per line') from None
            if not label_text(label):
                raise DataError(f"{where}:{n}: no label; give each file a class name or index, or drop the line")
            rows.append((n, path, label))
        return rows
    lines = list(csv.reader(io.StringIO(text, newline="")))  # \n, \r\n and a lone \r alike
    header = [c.strip().lower() for c in lines[0]] if lines else []
    cols = (0, 1)
    if any(c in PATH_COLUMNS for c in header) and any(c in LABEL_COLUMNS for c in header):
        cols = (
            next(i for i, c in enumerate(header) if c in PATH_COLUMNS),
            next(i for i, c in enumerate(header) if c in LABEL_COLUMNS),
        )
        lines = [None, *lines[1:]]
    for n, line in enumerate(lines, 1):
        if line is None or not any(c.strip() for c in line or [""]):
            continue
        if len(line) <= max(cols) or not line[cols[0]].strip() or not line[cols[1]].strip():
            raise DataError(f"{where}:{n}: no path and label; write each line as path,label")
        rows.append((n, line[cols[0]].strip(), line[cols[1]].strip()))
    return rows


def sibling(root: str) -> str | None:
    """The validation manifest beside a training one: `train` in its file name -> val, validation."""
    folder, _, name = root.rpartition("/")
    words = list(re.finditer(r"(?<![a-z])train(?![a-z])", name, flags=re.IGNORECASE))
    if not words:
        return None
    at = words[-1]  # the last: imagenet_train.csv, constrained_train.csv
    fs, _, _ = storage.filesystem(root)
    for candidate in (f"{folder}/{name[: at.start()]}{v}{name[at.end() :]}" for v in VAL_NAMES):
        if fs.get_file_info(storage.filesystem(candidate)[1]).type == pafs.FileType.File:
            return candidate
    return None


def _load(path: str) -> list[tuple[int, str, str]]:
    fs, inner, _ = storage.filesystem(path)
    info = fs.get_file_info(inner)
    if info.type != pafs.FileType.File:
        raise DataError(f"{path}: no such manifest; give --data a .csv or .jsonl of path,label")
    with fs.open_input_file(inner) as f:
        text = f.read().decode("utf-8-sig")
    rows = read_rows(text, path)
    if not rows:
        raise DataError(f"{path}: no entries; write one path,label per line")
    return rows


def scan_manifest(root: str, val_fraction: float) -> ImageTree:
    """The ImageTree of a manifest (and its validation sibling). DataError for a manifest or a
    listed file that does not exist, a file listed twice, or a validation label training lacks."""
    with storage.errors(root):
        val_path = sibling(root)
        _, inner, prefix = storage.filesystem(root)
        folder = posixpath.dirname(inner)
        listed = {"train": _load(root), "val": _load(val_path) if val_path else []}
        resolved = {  # (line, the path inside the filesystem, label)
            side: [(n, posixpath.normpath(posixpath.join(folder, p)), lab) for n, p, lab in rows]
            for side, rows in listed.items()
        }
        top = _common_folder([p for rows in resolved.values() for _, p, _ in rows])
        sizes = _sizes(root, top, prefix, [p for rows in resolved.values() for _, p, _ in rows])
    _check_listed(resolved, sizes, {"train": root, "val": val_path}, prefix)
    train_labels, val_labels = ([lab for _, _, lab in resolved[side]] for side in ("train", "val"))
    names, *labels = index_labels(train_labels, val_labels, root)
    train, val = (
        make_split(
            prefix + top,
            [posixpath.relpath(p, top) for _, p, _ in resolved[side]],
            side_labels,
            [sizes[p] for _, p, _ in resolved[side]],
            keys=[stable_hash(posixpath.relpath(p, folder)) for _, p, _ in resolved[side]],
        )
        for side, side_labels in zip(("train", "val"), labels, strict=True)
    )
    if val_path:
        layout = f"{posixpath.basename(root)} + {posixpath.basename(val_path)}: the manifests' own"
    else:
        in_val = held_out(train.keys, val_fraction)
        layout, train, val = (
            f"manifest, hash by val_fraction {val_fraction}",
            train.subset(~in_val),
            train.subset(in_val),
        )
    return ImageTree(root=root, layout=layout, class_names=names, train=train, val=val)


def _common_folder(paths: list[str]) -> str:
    """The deepest folder that holds every path."""
    top = posixpath.commonpath(paths) if len(paths) > 1 else posixpath.dirname(paths[0])
    return posixpath.dirname(top) if top in set(paths) else top


def _check_listed(resolved: dict, sizes: dict, manifests: dict, prefix: str) -> None:
    """DataError naming FILE:LINE for a listed file that is not there, or one listed before."""
    seen: dict[str, str] = {}
    for side, rows in resolved.items():
        for n, path, _ in rows:
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
    if len(paths) <= LOOKUP_PATHS or top in ("", "/") or (prefix and "/" not in top):  # a root or a whole bucket
        with ThreadPoolExecutor(16) as pool:  # object storage: a request each
            infos = list(pool.map(fs.get_file_info, paths))
    elif fs.get_file_info(top).type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(top, recursive=True))
    else:
        raise DataError(f"{root}: {prefix}{top}: no such folder; the manifest's paths are relative to its own folder")
    return {i.path: i.size or 0 for i in infos if i.type == pafs.FileType.File}
