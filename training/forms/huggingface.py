"""Hugging Face datasets exported as Parquet (`Dataset.to_parquet`, or the files the Hub
serves for a dataset), or saved by `Dataset.save_to_disk` -> the rows of each split, read in row
groups (an Arrow file's record batches).

    DIR/data/train-00000-of-00004.parquet ...     or DIR/train/0000.parquet, DIR/train.parquet,
    DIR/data/validation-00000-of-00001.parquet    or one .parquet file (test files are left out:
                                                  their labels are -1)
    DIR/data-00000-of-00002.arrow ...             save_to_disk: Arrow stream files (a DatasetDict's
                                                  in DIR/train/, DIR/test/), on local disk only

    columns   an Image struct {bytes, path} and a ClassLabel integer (any names: the features say)
    metadata  the schema's "huggingface" key: {"info": {"features": {"image": {"_type": "Image"},
              "label": {"_type": "ClassLabel", "names": ["tench", ...]}}}}

The split is the files' own (train, validation); without validation files the stable hash
split of each row's key, applied inside each row group by the read task. A row is named
`<file>:<row>` (relative to DIR) and keyed by the stable hash of that name. The driver reads
the footers and the label column only, never the images.

A row's image is its bytes, or where those are empty (to_parquet of an Image column cast from
paths writes only image.path; push_to_hub and save_to_disk embed the bytes) the file at its
image.path: an absolute path as it is, a relative one below the export file's folder (the
datasets library reads it from the working directory: the same where to_parquet wrote there).
The driver looks each such file up once and refuses a row whose file is not there.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import posixpath
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath

import numpy as np

from training import storage
from training.forms.data import (
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
from training.forms.parquet import empty_rows, first_rows, parse_errors, read_row_groups
from training.rows import BYTES, KEY, LABEL, PATH

METADATA_KEY = b"huggingface"
DEFAULT_LABEL = "label"  # --label-key's default: a column of that name, else the first ClassLabel
EXPORT_SUFFIXES = (".parquet", ".arrow")  # to_parquet's files, save_to_disk's (Arrow IPC streams)
HEADER_BYTES = 256 * 1024  # of a file a row holds by path, for its image's size (training.driver.inputs.typical_size)
EMBED = (
    "embed the images before exporting (ds.with_format('arrow').map(datasets.table.embed_table_storage, "
    "batched=True)), or use push_to_hub, which embeds them"
)


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
    """What the driver reads of one file: its features, and per row group the rows' labels, keys
    and images' sizes; and how many rows have no image (neither bytes nor a path)."""

    features: dict
    labels: list[np.ndarray]
    keys: list[np.ndarray]
    sizes: list[np.ndarray]
    empty: int = 0


def export_files(root: str, files: list[str] | None) -> tuple[str, list[str]]:
    """(the folder an export's files are named relative to, their names): `root` and `files`, or for
    one file as --data (data_kind's files None) its folder and its name."""
    if files is not None:
        return root.rstrip("/"), files
    return storage.parent(root), [root.rstrip("/").rsplit("/", 1)[-1]]


def scan_export(root: str, files: list[str], val_fraction: float, label_key: str = DEFAULT_LABEL) -> ImageTree:
    """The ImageTree of the export `files` (paths relative to `root`; None: `root` is one file).
    DataError for an export without images or labels, files that disagree, labels outside the class
    names, or a row held by a path with no file there."""
    folder, files = export_files(root, files)
    fs, base, prefix = storage.filesystem(folder)
    sides = split_names(files, folder, "train-*.parquet")
    shards = sides["train"] + sides["val"]
    found = {f: _read_file(fs, f"{base}/{f}", f"{folder}/{f}", f, label_key) for f in shards}
    form, names = _format(folder, found, label_key)
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
    if sum(found[f].empty for f in sides["train"]) == sum(sum(map(len, found[f].labels)) for f in sides["train"]):
        raise DataError(f"{root}: no row of the training files has an image (bytes or a path); export them with it")
    for part in (train, val):
        bad = np.flatnonzero((part.labels < 0) | (part.labels >= len(names)))
        if len(bad):
            raise DataError(
                f"{folder}/{part.rel_paths[bad[0]]}: label {int(part.labels[bad[0]])} is not one of the {len(names)} "
                "classes; leave unlabelled files (a test split) out of --data"
            )
    written = "Arrow (save_to_disk)" if shards[0].endswith(".arrow") else "Parquet"
    tree = ImageTree(root=root, layout=f"Hugging Face {written}, {layout}", class_names=names, train=train, val=val)
    declared = _columns(next(iter(found.values())).features, folder, label_key)[2] is not None  # a ClassLabel's names
    return check_classes(tree, None if sides["val"] else val_fraction, declared=declared)


def scan_for_scoring(root: str, files: list[str], class_names, label_key: str = DEFAULT_LABEL):
    """Every row of every file of the export, test files (labels -1) too, as one split, for
    jobs.predict and jobs.evaluate; DataError where its class names are not `class_names` (a
    model's)."""
    folder, files = export_files(root, files)
    fs, base, prefix = storage.filesystem(folder)
    found = {f: _read_file(fs, f"{base}/{f}", f"{folder}/{f}", f, label_key) for f in files}
    form, names = _format(folder, found, label_key)
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
        for g, (lab, key, size) in enumerate(zip(info.labels, info.keys, info.sizes, strict=True)):
            keep = on_side(key, side)
            rows = np.flatnonzero(keep)
            rel += [f"{name}:{first + r}" for r in rows]
            labels.append(lab[keep])
            keys.append(key[keep])
            sizes.append(size[keep])
            if len(rows):
                units.append((s, g, first, len(rows)))
            first += len(lab)
    split = make_split(root, rel, concat(labels), concat(sizes), keys=concat(keys))
    return sharded(split, uris, np.asarray(units, dtype=np.int64).reshape(-1, 4), form, side)


def _read_file(fs, path: str, shown: str, name: str, label_key: str) -> ExportFile:
    """An export file's features, and per row group (record batch) its labels, keys and images'
    sizes; DataError for a row held by a path with no file there (linked_sizes)."""
    read = _arrow_groups if path.endswith(".arrow") else _parquet_groups
    feats, groups = read(fs, path, shown, label_key)
    keys, linked, first = [], [], 0
    for lab, _, paths, _ in groups:
        keys.append(np.fromiter((stable_hash(f"{name}:{first + r}") for r in range(len(lab))), np.int64, len(lab)))
        linked += [(first + r, p) for r, p in paths]
        first += len(lab)
    found, first = linked_sizes(fs, path, shown, linked), 0
    for lab, sizes, paths, _ in groups:
        sizes[[r for r, _ in paths]] = [found[first + r] for r, _ in paths]
        first += len(lab)
    return ExportFile(feats, [g[0] for g in groups], keys, [g[1] for g in groups], sum(g[3] for g in groups))


def _schema_columns(schema, shown: str, label_key: str) -> tuple[dict, str, str]:
    """(features, image column, label column) of an export file's schema; DataError where it is no
    export of the datasets library's, or its label column holds no class indices."""
    import pyarrow as pa

    feats = features(schema)
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
    absent = [c for c in (image, label) if c not in schema.names]
    if absent:
        raise DataError(
            f"{shown}: the `huggingface` metadata names columns the file lacks: {absent}; write the file with "
            "the datasets library's to_parquet"
        )
    kind = schema.field(label).type
    if not pa.types.is_integer(kind):
        raise DataError(
            f"{shown}: the label column {label!r} holds {kind}, not class indices; name an integer or ClassLabel "
            "column with --label-key"
        )
    return feats, image, label


def _parquet_groups(fs, path: str, shown: str, label_key: str) -> tuple[dict, list]:
    """(features, per row group (labels, sizes, [(row, image.path)] of the rows held by path, rows
    without an image)) of a Parquet export file. Only rows whose bytes the footer's statistics
    count as empty are looked at: their paths (or, in a group that mixes both, the image column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with parse_errors(fs, path, shown, "remove it from --data or write it again"), fs.open_input_file(path) as f:
        try:
            pf = pq.ParquetFile(f)
        except pa.ArrowInvalid as e:  # an empty file, or text named .parquet
            raise DataError(f"{shown}: not a Parquet file ({e}); remove it from --data or write it again") from None
        feats, image, label = _schema_columns(pf.schema_arrow, shown, label_key)
        struct = pa.types.is_struct(pf.schema_arrow.field(image).type)
        groups = []
        for g in range(pf.num_row_groups):
            lab = pf.read_row_group(g, columns=[label]).column(0)
            if lab.null_count:
                raise DataError(f"{shown}: rows without a label in {label!r}; leave unlabelled files out of --data")
            rg = pf.metadata.row_group(g)
            leaves = [rg.column(c) for c in range(rg.num_columns)]
            stored = [c for c in leaves if c.path_in_schema in (image, f"{image}.bytes")]
            nulls = sum(c.statistics.null_count for c in stored if c.statistics and c.statistics.has_null_count)
            paths, empty = [], nulls
            if nulls and struct:  # all empty: their paths alone; some: the bytes too, to tell which
                column = pf.read_row_group(g, columns=[image if nulls < len(lab) else f"{image}.path"]).column(0)
                paths, empty = unembedded(column)
            each = sum(c.total_compressed_size for c in stored) // max(1, len(lab) - nulls)  # the embedded ones'
            groups.append((lab.to_numpy(), np.full(len(lab), each, np.int64), paths, empty))
    return feats, groups


def _arrow_groups(fs, path: str, shown: str, label_key: str) -> tuple[dict, list]:
    """_parquet_groups of an Arrow stream file (save_to_disk's), its record batches for row groups;
    memory-mapped, so that the driver reads the label column, not the images. On local disk only:
    a stream has no footer to range-read it by."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if storage.is_uri(shown):
        raise DataError(
            f"{shown}: an Arrow file of Dataset.save_to_disk on object storage, which would be read whole for any of "
            "its rows; write Parquet instead (datasets.load_from_disk(...).to_parquet(...)), or give a local copy"
        )
    try:
        with pa.memory_map(path) as source, pa.ipc.open_stream(source) as reader:
            feats, image, label = _schema_columns(reader.schema, shown, label_key)
            groups = []
            for batch in reader:
                lab, column = batch.column(label), batch.column(image)
                if lab.null_count:
                    raise DataError(f"{shown}: rows without a label in {label!r}; leave unlabelled files out of --data")
                stored = pc.struct_field(column, "bytes") if pa.types.is_struct(column.type) else column
                paths, empty = unembedded(column) if stored.null_count else ([], 0)
                sizes = pc.fill_null(pc.binary_length(stored), 0).to_numpy().astype(np.int64)
                groups.append((lab.to_numpy(), sizes, paths, empty))
    except pa.ArrowInvalid as e:
        raise DataError(f"{shown}: not an Arrow stream file ({e}); remove it from --data or save it again") from None
    return feats, groups


def unembedded(column) -> tuple[list[tuple[int, str]], int]:
    """([(row, image.path)] of an image column's rows whose bytes are empty and that name a path, and
    how many rows have neither); the column is an Image struct {bytes, path}, or its path alone."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_struct(column.type):
        return [], column.null_count
    fields = {column.type.field(i).name for i in range(column.type.num_fields)}
    no_bytes = pc.is_null(pc.struct_field(column, "bytes")).to_pylist() if "bytes" in fields else [True] * len(column)
    paths = pc.struct_field(column, "path").to_pylist() if "path" in fields else [None] * len(column)
    linked = [(r, p) for r, (none, p) in enumerate(zip(no_bytes, paths, strict=True)) if none and p]
    return linked, sum(no_bytes) - len(linked)


@functools.cache
def _local():
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()


def image_place(path: str, fs, folder: str):
    """(filesystem, path inside it) of a row's image.path: a URI as it is, an absolute path on local
    disk, a relative one below `folder` (the export file's, in `fs`). StorageError for a URI that
    storage does not read (https://, hf://)."""
    if storage.is_uri(path):
        return storage.filesystem(path)[:2]
    if posixpath.isabs(path):
        return _local(), path
    return fs, posixpath.normpath(f"{folder}/{path}")


def linked_sizes(fs, path: str, shown: str, linked: list[tuple[int, str]]) -> dict[int, int]:
    """{row: bytes} of an export file's rows held by path (`linked`: (row, image.path)); DataError
    naming the first whose file is not there. Local files are looked up in one call, others in threads."""
    import pyarrow.fs as pafs

    places = []
    for row, p in linked:
        try:
            places.append(image_place(p, fs, posixpath.dirname(path)))
        except storage.StorageError:
            raise DataError(f"{shown}:{row}: image.path {p}: not a path or URI this job reads; {EMBED}") from None
    infos = []
    for _, group in itertools.groupby(places, key=lambda place: id(place[0])):
        group = list(group)
        found, inner = group[0][0], [p for _, p in group]
        if isinstance(found, pafs.LocalFileSystem):
            infos += found.get_file_info(inner)
        else:
            with ThreadPoolExecutor(16) as pool:  # object storage: a request each
                infos += pool.map(found.get_file_info, inner)
    for (row, p), info in zip(linked, infos, strict=True):
        if info.type != pafs.FileType.File:
            raise DataError(
                f"{shown}:{row}: image.path {p}: no such file (the export holds the images' paths, not the images; a "
                f"relative path is read from the export file's folder); {EMBED}"
            )
    return {row: info.size for (row, _), info in zip(linked, infos, strict=True)}


def read_export_units(units, root: str, shards, form: ShardFormat, bad: list | None = None):
    """A read task's row groups (record batches) of an export: {bytes, path, label, key}; `units`
    rows are (shard index, row group, first row, rows). A row without bytes is read from the file
    its image.path names (image_place), else reads as empty (and is listed as a bad file); a file
    or a row group that cannot be read goes to `bad`, a row group's rows by name where its footer
    gives their number, else the row group itself."""
    import pyarrow as pa
    import pyarrow.compute as pc

    tables, top = [], storage.filesystem(root)[1]

    def failed(unit, path, pf, error):
        (_, group, first, _), name = (int(v) for v in unit), str(PurePosixPath(path).relative_to(top))
        why = f"cannot read its row group {group}: {storage.first_line(error)}"
        rows = None if pf is None else pf.metadata.row_group(group).num_rows
        whole = [(f"{root}/{name}#row-group-{group}", why)]
        bad.extend([(f"{root}/{name}:{first + r}", why) for r in range(rows)] if rows else whole)

    read = read_batches if str(shards[0]).endswith(".arrow") else read_row_groups
    for unit, path, t in read(units, shards, [form.image, form.label], None if bad is None else failed):
        image, first = t.column(form.image), int(unit[2])
        data = pc.struct_field(image, "bytes") if pa.types.is_struct(image.type) else image
        name = str(PurePosixPath(path).relative_to(top))
        rel = [f"{name}:{r}" for r in range(first, first + t.num_rows)]
        data, keep = pc.fill_null(data.cast(pa.binary()), b""), None
        if pa.types.is_struct(image.type) and unembedded(image)[0]:
            data, keep = _read_linked(image, shards[int(unit[0])], rel, root, bad)
        table = pa.table(
            {
                BYTES: data,
                PATH: rel,
                LABEL: t.column(form.label).cast(pa.int64()),
                KEY: pa.array([stable_hash(r) for r in rel], pa.int64()),
            }
        )
        tables.append(table if keep is None else table.filter(keep))
    return pa.concat_tables(tables) if tables else empty_rows()


def _read_linked(image, shard: str, rel: list[str], root: str, bad: list | None):
    """(a row group's image bytes, the rows kept) where some rows hold their image by path: those read
    from their files (image_place). A file that cannot be read goes to `bad` and its row is left
    out; without `bad`, its error is raised."""
    import pyarrow as pa
    import pyarrow.compute as pc

    fs, inner, _ = storage.filesystem(shard)
    datas = pc.struct_field(image, "bytes").to_pylist()
    keep = np.ones(len(datas), dtype=bool)
    for r, p in unembedded(image)[0]:
        try:
            where, at = image_place(p, fs, posixpath.dirname(inner))
            with where.open_input_file(at) as f:
                datas[r] = f.read()
        except Exception as e:  # the storage's or the path's error: this row's
            if bad is None:
                raise
            bad.append((f"{root}/{rel[r]}", f"cannot read its image.path {p}: {storage.first_line(e)}"))
            keep[r] = False
    return pa.array([d or b"" for d in datas], pa.binary()), pa.array(keep)


def first_images(unit, shards, form: ShardFormat, count: int, mean_bytes: float = 0) -> list[bytes]:
    """The first `count` images of a unit's row group (record batch), for their sizes
    (training.driver.inputs.typical_size): the rows' bytes, read only as far as those rows go
    (training.forms.parquet.first_rows), or the first HEADER_BYTES of the file a row names by path."""
    import pyarrow as pa
    import pyarrow.compute as pc

    fs, path, _ = storage.filesystem(shards[int(unit[0])])
    if path.endswith(".arrow"):
        table = next(t for _, _, t in read_batches(np.asarray(unit)[None], shards, [form.image])).slice(0, count)
    else:
        table = first_rows(shards[int(unit[0])], int(unit[1]), [form.image], count)
    column = table.column(form.image)
    if not pa.types.is_struct(column.type):
        return [b for b in column.to_pylist() if b]
    datas = pc.struct_field(column, "bytes").to_pylist()
    for r, p in unembedded(column)[0]:
        where, at = image_place(p, fs, posixpath.dirname(path))
        with where.open_input_file(at) as f:
            datas[r] = f.read(HEADER_BYTES)
    return [d for d in datas if d]


def read_batches(units, shards, columns: list[str], failed=None):
    """training.forms.parquet.read_row_groups for the Arrow stream files of save_to_disk: a unit's row
    group is a record batch. Memory-mapped, so that the batches before it cost their metadata only."""
    import pyarrow as pa

    order = sorted(range(len(units)), key=lambda i: (int(units[i][0]), int(units[i][1])))
    for shard, picks in itertools.groupby(order, key=lambda i: int(units[i][0])):
        path = storage.filesystem(shards[shard])[1]
        pending = {int(units[i][1]): i for i in picks}
        try:
            with pa.memory_map(path) as source, pa.ipc.open_stream(source) as reader:
                for g, batch in enumerate(reader):
                    if g in pending:
                        yield units[pending.pop(g)], path, pa.Table.from_batches([batch.select(columns)])
                    if not pending:
                        break
        except Exception as e:  # the file or a batch: every unit of it not read yet
            if failed is None:
                raise
            for i in pending.values():
                failed(units[i], path, None, e)
