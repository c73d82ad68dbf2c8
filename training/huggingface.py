"""Hugging Face datasets exported as Parquet (`Dataset.to_parquet`, or the files the Hub
serves for a dataset) -> the rows of each split, read in row groups.

    DIR/data/train-00000-of-00004.parquet ...     or DIR/train/0000.parquet, DIR/train.parquet
    DIR/data/validation-00000-of-00001.parquet    (test files are left out: their labels are -1)

    columns   an Image struct {bytes, path} and a ClassLabel integer (any names: the features say)
    metadata  the schema's "huggingface" key: {"info": {"features": {"image": {"_type": "Image"},
              "label": {"_type": "ClassLabel", "names": ["tench", ...]}}}}

The split is the files' own (train, validation); without validation files the stable hash
split of each row's key, applied inside each row group by the read task. A row is named
`<file>:<row>` (relative to DIR) and keyed by the stable hash of that name. The driver reads
the footers and the label column only, never the images.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import PurePosixPath

import numpy as np

from training import storage
from training.data import (
    DataError,
    ImageTree,
    ShardFormat,
    check_classes,
    concat,
    make_split,
    on_side,
    sharded,
    split_names,
    stable_hash,
)
from training.parquet import empty_rows, parse_errors, read_row_groups

METADATA_KEY = b"huggingface"
DEFAULT_LABEL = "label"  # --label-key's default: a column of that name, else the first ClassLabel


def features(schema) -> dict | None:
    """The `huggingface` metadata's features of a Parquet schema; None without it."""
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        return None
    try:
        return json.loads(raw)["info"]["features"]
    except (ValueError, KeyError, TypeError):
        return None


def _columns(feats: dict, where: str, label_key: str) -> tuple[str, str, tuple[str, ...] | None]:
    """(image column, label column, class names or None) from an export's features: the label is
    the `label_key` column where there is one (--label-key), else the first ClassLabel."""
    images = [name for name, f in feats.items() if isinstance(f, dict) and f.get("_type") == "Image"]
    labels = [name for name, f in feats.items() if isinstance(f, dict) and f.get("_type") == "ClassLabel"]
    if not images:
        raise DataError(f"{where}: no Image feature among {list(feats)}; export a dataset with an image column")
    if label_key in feats:
        label = label_key
    elif label_key != DEFAULT_LABEL:
        raise DataError(f"{where}: --label-key {label_key}: no such column among {list(feats)}; name one of them")
    elif labels:
        label = labels[0]
    else:
        raise DataError(
            f"{where}: no label (a ClassLabel feature, or a column named with --label-key) among {list(feats)}; an "
            "image classifier trains on labelled images"
        )
    names = feats[label].get("names") if isinstance(feats[label], dict) else None
    return images[0], label, tuple(names) if names else None


@dataclasses.dataclass(frozen=True)
class ExportFile:
    """What the driver reads of one file: its features, and per row group the rows' labels and
    keys and the encoded images' bytes."""

    features: dict
    labels: list[np.ndarray]
    keys: list[np.ndarray]
    image_bytes: list[int]


def scan_export(root: str, files: list[str], val_fraction: float, label_key: str = DEFAULT_LABEL) -> ImageTree:
    """The ImageTree of the export `files` (paths relative to `root`). DataError for an export
    without images or labels, files that disagree, or labels outside the class names."""
    fs, base, prefix = storage.filesystem(root)
    sides = split_names(files, root, "train-*.parquet")
    shards = sides["train"] + sides["val"]
    found = {f: _read_file(fs, f"{base}/{f}", f"{root}/{f}", f, label_key) for f in shards}
    form, names = _format(root, found, label_key)
    uris, index = [f"{prefix}{base}/{f}" for f in shards], {f: i for i, f in enumerate(shards)}

    def split(side_files, side):
        return _split(f"{prefix}{base}", [(index[f], f, found[f]) for f in side_files], uris, form, side)

    if sides["val"]:
        train, val, layout = split(sides["train"], None), split(sides["val"], None), "the train/validation files' own"
    else:
        train, val = split(sides["train"], (val_fraction, False)), split(sides["train"], (val_fraction, True))
        layout = f"hash by val_fraction {val_fraction}"
    if not len(train) and not len(val):
        raise DataError(
            f"{root}: no rows in the training files {sides['train'][:3]}; export the dataset with its images"
        )
    for part in (train, val):
        bad = np.flatnonzero((part.labels < 0) | (part.labels >= len(names)))
        if len(bad):
            raise DataError(
                f"{root}/{part.rel_paths[bad[0]]}: label {int(part.labels[bad[0]])} is not one of the {len(names)} "
                "classes; leave unlabelled files (a test split) out of --data"
            )
    tree = ImageTree(root=root, layout=f"Hugging Face Parquet, {layout}", class_names=names, train=train, val=val)
    declared = _columns(next(iter(found.values())).features, root, label_key)[2] is not None  # a ClassLabel's names
    return check_classes(tree, None if sides["val"] else val_fraction, declared=declared)


def scan_for_scoring(root: str, files: list[str], class_names, label_key: str = DEFAULT_LABEL):
    """Every row of every file of the export, test files (labels -1) too, as one split, for
    jobs.predict and jobs.evaluate; DataError where its class names are not `class_names` (a
    model's)."""
    fs, base, prefix = storage.filesystem(root)
    found = {f: _read_file(fs, f"{base}/{f}", f"{root}/{f}", f, label_key) for f in files}
    form, names = _format(root, found, label_key)
    if list(names) != list(class_names):
        raise DataError(f"{root}: holds classes {list(names)[:10]}, the model has {list(class_names)[:10]}")
    uris = [f"{prefix}{base}/{f}" for f in files]
    split = _split(f"{prefix}{base}", [(i, f, found[f]) for i, f in enumerate(files)], uris, form, None)
    outside = (split.labels < 0) | (split.labels >= len(names))
    return dataclasses.replace(split, labels=np.where(outside, -1, split.labels).astype(np.int32))


def _format(root: str, found: dict, label_key: str) -> tuple[ShardFormat, tuple[str, ...]]:
    """The columns every file shares, and the class names (the ClassLabel's, else "0".."N-1")."""
    columns = {f: _columns(info.features, f"{root}/{f}", label_key) for f, info in found.items()}
    first_file, first = next(iter(columns.items()))
    for f, c in columns.items():
        if c != first:
            raise DataError(
                f"{root}/{f}: its image column, label column or class names differ from {first_file}'s; give "
                "--data the files of one export"
            )
    image, label, names = first
    if names is None:
        top = max((int(g.max()) for info in found.values() for g in info.labels if len(g)), default=0)
        names = tuple(str(i) for i in range(top + 1))
    return ShardFormat("huggingface", image=image, label=label), names


def _split(root: str, files: list, uris: list[str], form: ShardFormat, side):
    """One side of the split: the rows of `files` [(shard index, name, ExportFile)] on it, and
    the row groups holding them, (shard, row group, first row, rows on this side)."""
    rel, labels, keys, sizes, units = [], [], [], [], []
    for s, name, info in files:
        first = 0
        for g, (lab, key, nbytes) in enumerate(zip(info.labels, info.keys, info.image_bytes, strict=True)):
            keep = on_side(key, side)
            rows = np.flatnonzero(keep)
            rel += [f"{name}:{first + r}" for r in rows]
            labels.append(lab[keep])
            keys.append(key[keep])
            sizes.append(np.full(len(rows), nbytes // max(1, len(lab)), dtype=np.int64))
            if len(rows):
                units.append((s, g, first, len(rows)))
            first += len(lab)
    split = make_split(root, rel, concat(labels), concat(sizes), keys=concat(keys))
    return sharded(split, uris, np.asarray(units, dtype=np.int64).reshape(-1, 4), form, side)


def _read_file(fs, path: str, shown: str, name: str, label_key: str) -> ExportFile:
    """An export file's features, and per row group its labels, keys and image bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with parse_errors(fs, path, shown, "remove it from --data or write it again"), fs.open_input_file(path) as f:
        try:
            pf = pq.ParquetFile(f)
        except pa.ArrowInvalid as e:  # an empty file, or text named .parquet
            raise DataError(f"{shown}: not a Parquet file ({e}); remove it from --data or write it again") from None
        feats = features(pf.schema_arrow)
        if feats is None:
            raise DataError(
                f"{shown}: no `huggingface` schema metadata; write it with the datasets library's to_parquet, or "
                "give --data a folder of images or a manifest"
            )
        if not isinstance(feats, dict):
            raise DataError(
                f"{shown}: the `huggingface` metadata's features are a {type(feats).__name__}, not a mapping of "
                "column to feature; write the file with the datasets library's to_parquet"
            )
        image, label, _ = _columns(feats, shown, label_key)
        absent = [c for c in (image, label) if c not in pf.schema_arrow.names]
        if absent:
            raise DataError(
                f"{shown}: the `huggingface` metadata names columns the file lacks: {absent}; write the file with "
                "the datasets library's to_parquet"
            )
        kind = pf.schema_arrow.field(label).type
        if not pa.types.is_integer(kind):
            raise DataError(
                f"{shown}: the label column {label!r} holds {kind}, not class indices; name an integer or ClassLabel "
                "column with --label-key"
            )
        columns = [pf.read_row_group(g, columns=[label]).column(0) for g in range(pf.num_row_groups)]
        if any(c.null_count for c in columns):
            raise DataError(f"{shown}: rows without a label in {label!r}; leave unlabelled files out of --data")
        labels = [c.to_numpy() for c in columns]
        meta = pf.metadata
    keys, image_bytes, first = [], [], 0
    for g, lab in enumerate(labels):
        keys.append(np.fromiter((stable_hash(f"{name}:{first + r}") for r in range(len(lab))), np.int64, len(lab)))
        first += len(lab)
        rg = meta.row_group(g)
        chunks = (rg.column(c) for c in range(rg.num_columns))
        image_bytes.append(sum(c.total_compressed_size for c in chunks if c.path_in_schema.endswith(".bytes")))
    return ExportFile(feats, labels, keys, image_bytes)


def read_export_units(units, root: str, shards, form: ShardFormat, bad: list | None = None):
    """A read task's row groups of an export: {bytes, path, label, key}; `units` rows are
    (shard index, row group, first row, rows). A row without embedded bytes reads as empty
    (and is listed as a bad file); a row group that cannot be read goes to `bad`, its rows
    by name where its footer gives their number, else the row group itself."""
    import pyarrow as pa
    import pyarrow.compute as pc

    tables, top = [], storage.filesystem(root)[1]

    def failed(unit, path, pf, error):
        (_, group, first, _), name = (int(v) for v in unit), str(PurePosixPath(path).relative_to(top))
        why = f"cannot read its row group {group}: {storage.first_line(error)}"
        rows = None if pf is None else pf.metadata.row_group(group).num_rows
        whole = [(f"{root}/{name}#row-group-{group}", why)]
        bad.extend([(f"{root}/{name}:{first + r}", why) for r in range(rows)] if rows else whole)

    for (_, _, first, _), path, t in read_row_groups(
        units, shards, [form.image, form.label], None if bad is None else failed
    ):
        image = t.column(form.image)
        data = pc.struct_field(image, "bytes") if pa.types.is_struct(image.type) else image
        name = str(PurePosixPath(path).relative_to(top))
        rel = [f"{name}:{r}" for r in range(int(first), int(first) + t.num_rows)]
        tables.append(
            pa.table(
                {
                    "bytes": pc.fill_null(data.cast(pa.binary()), b""),
                    "path": rel,
                    "label": t.column(form.label).cast(pa.int64()),
                    "key": pa.array([stable_hash(r) for r in rel], pa.int64()),
                }
            )
        )
    return pa.concat_tables(tables) if tables else empty_rows()
