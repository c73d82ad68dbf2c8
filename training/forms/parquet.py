"""Prepared datasets: an image tree converted once into Parquet shards.

Millions of small files read slowly from object storage (one request per file); a few
hundred shards of ~128 MB read at full bandwidth. `python -m jobs.prepare DIR OUT` writes

    OUT/train/part-00000.parquet ...   rows: bytes (the encoded file, unchanged), label,
    OUT/val/part-00000.parquet ...           key, height, width, path (relative to DIR)
    OUT/_prepared.json                 the manifest, written last: class names, the split,
                                       counts and shard names

The split, the labels and the keys are those `training.forms.tree.scan_tree` gives for DIR, so
training on OUT sees the same images with the same labels, and (augmentation being keyed by
`key`) the same augmentations. Train rows are stored in an order shuffled once, so that
every shard mixes classes; validation rows in path order. Shards are written in row groups
of 256 images: the unit that training reads in a new order every epoch (training/stream/ingest.py).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath

import numpy as np

from augment.decode import BadImage, read_header
from augment.streams import stream_rng
from training import storage
from training.forms.data import DataError, ImageTree, ShardFormat, check_classes, concat, make_split, sharded
from training.forms.tree import scan_tree
from training.rows import BYTES, HEIGHT, KEY, LABEL, PATH, READ_COLUMNS, WIDTH, read_types

MANIFEST = "_prepared.json"
FORMAT = "ray-gpu-augment/prepared/1"
SPLITS = ("train", "val")


ROW_GROUP = 256  # images per Parquet row group
FIRST_ROWS_BUFFER = 256 * 1024  # first_rows reads a column chunk in steps of this size


def is_prepared(root: str) -> bool:
    """Is `root` the output of jobs.prepare (has its manifest)?"""
    import pyarrow.fs as pafs

    storage.check_bucket(root)  # the first request to --data: bad credentials are named here
    fs, base, _ = storage.filesystem(root)
    with storage.errors(root):
        return fs.get_file_info(f"{base}/{MANIFEST}").type == pafs.FileType.File


def _image_size(data: bytes) -> tuple[int | None, int | None]:
    """(height, width) from the image header, read as decoding reads it (augment/decode.py
    read_header); (None, None) for a bad header (training then drops and reports the file, as it
    does for a bad file in a tree)."""
    try:
        return read_header(data)[:2]
    except BadImage:
        return None, None


def _read_all(fs, paths: list[str], threads: int) -> list[bytes]:
    def read(path: str) -> bytes:
        return storage.read_file(fs, path.split("://", 1)[-1])

    with ThreadPoolExecutor(max_workers=threads) as pool:  # object storage: latency-bound, so threads
        return list(pool.map(read, paths))


def _check_out(out: str, root: str):
    """OUT must be new or empty, writable, and outside the tree ROOT. Returns storage.filesystem(out)."""
    import pyarrow.fs as pafs

    if not root.strip() or not out.strip():  # an unset shell variable: not the working folder
        raise DataError(f"{'DIR' if not root.strip() else 'OUT'} is empty; give the image tree and a new directory")
    inside = storage.is_uri(out) == storage.is_uri(root) and _within(out, root)
    if inside:  # its shards would land among the images it reads, and in the tree of every later scan
        raise DataError(f"{out}: inside the tree {root}; give a directory outside it for the prepared shards")
    storage.check_bucket(out)
    fs, base, prefix = storage.filesystem(out)
    with storage.errors(out):
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.File:
            raise DataError(f"{out}: is a file; give a directory for the prepared shards")
        if info.type == pafs.FileType.Directory and fs.get_file_info(pafs.FileSelector(base, recursive=False)):
            raise DataError(f"{out}: already exists and is not empty; choose a new directory or delete it")
    storage.check_writable(out, "OUT")
    return fs, base, prefix


def _within(path: str, root: str) -> bool:
    """Whether `path` is `root` or lies under it (local paths resolved, links followed; URIs as written)."""
    if not storage.is_uri(path):
        path, root = os.path.realpath(path), os.path.realpath(root)
    path, root = path.rstrip("/"), root.rstrip("/")
    return path == root or path.startswith(root + "/")


def prepare_tree(
    root: str,
    out: str,
    *,
    val_fraction: float = 0.2,
    shard_mb: float = 128.0,
    seed: int = 0,
    threads: int = 16,
    log=print,
) -> dict:
    """Convert the image tree `root` into Parquet shards under `out`; returns the manifest.

    Raises DataError for an unusable tree (as training would) or an `out` that already holds
    files (prepared data is never overwritten in place), storage.StorageError for storage
    that refuses either; all before the first file is read.
    """

    fs, base, prefix = _check_out(out, root)  # before listing the tree, which can take minutes on object storage
    tree = scan_tree(root, val_fraction)
    for note in tree.notes:  # one file under two names: said before the shards are written
        log(note)
    src_fs, src_base, _ = storage.filesystem(root)
    shard_bytes = max(1, int(shard_mb * 2**20))
    manifest = {
        "format": FORMAT,
        "source": tree.root,
        "layout": tree.layout,
        "val_fraction": val_fraction,
        "seed": seed,
        "class_names": list(tree.class_names),
        "splits": {},
    }
    new = not storage.exists(out)
    try:
        for name, split in (("train", tree.train), ("val", tree.val)):
            folder = f"{base}/{name}"
            shards = _write_split(fs, folder, split, (src_fs, src_base), (shard_bytes, seed, threads), prefix, log)
            files = [f"{name}/{shard}" for shard in shards]
            manifest["splits"][name] = {"images": len(split), "bytes": split.total_bytes, "shards": files}
        with fs.open_output_stream(f"{base}/{MANIFEST}") as f:  # last: a half-written OUT has no manifest
            f.write((json.dumps(manifest, indent=2) + "\n").encode())
    except BaseException:  # Ctrl-C, SIGTERM, a failed read
        _remove_written(out, new)
        raise
    return manifest


def _remove_written(out: str, new: bool) -> None:
    """Remove what prepare_tree wrote into `out` (its splits' folders and the manifest), and `out`
    itself where this run made it and nothing else came into it meanwhile: a file someone put
    there during a long scan stays."""
    for name in ("train", "val", MANIFEST):
        path = storage.join(out, name)
        if storage.is_dir(path):
            storage.remove_tree(path)
        elif storage.exists(path):
            storage.remove_file(path)
    if new and storage.exists(out) and storage.is_empty_dir(out):
        storage.remove_tree(out)


def _write_split(fs, folder: str, split, source, sizing: tuple[int, int, int], prefix: str, log) -> list[str]:
    """Write the shards of one split under `folder` (OUT/train or OUT/val on `fs`; `prefix` makes it
    a URI again), each said through `log` as it lands; their file names. `source`: (filesystem,
    base path) of the tree; `sizing`: (bytes a shard, the seed of the train order, threads that read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (src_fs, src_base), (shard_bytes, seed, threads) = source, sizing
    train = folder.endswith("/train")
    order = stream_rng("prepare_order", seed).permutation(len(split)) if train else np.arange(len(split))
    fs.create_dir(folder, recursive=True)
    # at least one image a shard, however small --shard-mb: no empty shard files
    n_shards = min(len(split), max(1, math.ceil(split.total_bytes / shard_bytes)))
    shards, split_paths = [], split.paths
    for s, rows in enumerate(np.array_split(order, n_shards) if n_shards else []):
        paths = [split_paths[i] for i in rows]
        data = _read_all(src_fs, paths, threads)
        sizes = [_image_size(b) for b in data]
        table = pa.table(
            {
                BYTES: pa.array(data, type=pa.binary()),
                LABEL: pa.array(split.labels[rows], type=pa.int64()),
                KEY: pa.array(split.keys[rows], type=pa.int64()),
                HEIGHT: pa.array([h for h, _ in sizes], type=pa.int32()),
                WIDTH: pa.array([w for _, w in sizes], type=pa.int32()),
                PATH: pa.array(
                    [str(PurePosixPath(p.split("://", 1)[-1]).relative_to(src_base)) for p in paths],
                    type=pa.string(),
                ),
            }
        )
        shard = f"part-{s:05d}.parquet"
        # row groups: the units training reads in a new order every epoch (training/stream/ingest.py)
        pq.write_table(table, f"{folder}/{shard}", filesystem=fs, row_group_size=ROW_GROUP)
        shards.append(shard)
        log(f"{folder.rsplit('/', 1)[-1]}: wrote {prefix}{folder}/{shard} ({len(rows)} images)")
    return shards


def read_manifest(root: str) -> dict:
    fs, base, _ = storage.filesystem(root)
    with fs.open_input_file(f"{base}/{MANIFEST}") as f:
        try:
            manifest = json.loads(f.read())
        except ValueError as e:  # not UTF-8, not JSON
            raise DataError(f"{root}/{MANIFEST}: not JSON ({e}); prepare it again (python -m jobs.prepare)") from None
    written = manifest.get("format") if isinstance(manifest, dict) else None
    if written != FORMAT:
        raise DataError(
            f"{root}/{MANIFEST}: format {written!r}, expected {FORMAT!r}; prepare it again with python -m jobs.prepare"
        )
    return manifest


def scan_prepared(root: str) -> ImageTree:
    """The ImageTree of a prepared directory: paths, labels and keys read from the shards'
    small columns (not the image bytes), and each shard's row groups from its footer. The
    split is the one fixed by jobs.prepare. DataError for a broken directory,
    storage.StorageError for object storage that refuses."""
    with storage.errors(root):
        return _scan_prepared(root)


def _scan_prepared(root: str) -> ImageTree:
    import pyarrow as pa
    import pyarrow.parquet as pq

    manifest = read_manifest(root)
    fs, base, prefix = storage.filesystem(root)
    source = manifest["source"].rstrip("/")
    splits = {}
    for name in SPLITS:
        meta = manifest["splits"][name]
        rel, labels, keys, sizes, groups = [], [], [], [], []
        for s, shard in enumerate(meta["shards"]):
            with (
                parse_errors(fs, f"{base}/{shard}", f"{root}/{shard}", "prepare it again"),
                fs.open_input_file(f"{base}/{shard}") as f,
            ):
                try:
                    pf = pq.ParquetFile(f)
                except pa.ArrowInvalid as e:  # an empty file, or text named .parquet
                    raise DataError(f"{root}/{shard}: not a Parquet file ({e}); prepare it again") from None
                t = pf.read(columns=[PATH, LABEL, KEY])
                groups += [(s, g, pf.metadata.row_group(g).num_rows) for g in range(pf.num_row_groups)]
            rel += t.column(PATH).to_pylist()
            labels.append(t.column(LABEL).to_numpy())
            keys.append(t.column(KEY).to_numpy())
        if len(rel) != meta["images"]:
            raise DataError(
                f"{root}: {name} shards hold {len(rel)} images, the manifest says {meta['images']}; prepare it again"
            )
        # the manifest keeps only the total: spread it over the files, to the byte
        sizes = np.full(len(rel), meta["bytes"] // max(1, len(rel)), dtype=np.int64)
        sizes[: meta["bytes"] - int(sizes.sum())] += 1
        split = make_split(source, rel, concat(labels), sizes, keys=concat(keys))
        shards = [f"{prefix}{base}/{s}" for s in meta["shards"]]
        splits[name] = sharded(split, shards, np.asarray(groups).reshape(-1, 3), ShardFormat("prepared"))
    layout = f"{manifest['layout']}" + (
        f" by val_fraction {manifest['val_fraction']}" if manifest["layout"] == "hash" else ""
    )
    tree = ImageTree(
        root=root,
        layout=f"{layout}, prepared",
        class_names=tuple(manifest["class_names"]),
        train=splits["train"],
        val=splits["val"],
    )
    return check_classes(tree)  # as the tree's scan checked it, for shards an older jobs.prepare wrote


@contextlib.contextmanager
def parse_errors(fs, path: str, shown: str, fix: str):
    """A DataError naming `shown` for a Parquet file (`path` in `fs`) that does not parse, where
    pyarrow's error is not the storage's: its OSError says both, so the file is looked up, and
    the error goes on unchanged where that fails too (storage.errors names it)."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    try:
        yield
    except (DataError, storage.StorageError):
        raise
    except (OSError, ValueError, pa.ArrowException) as e:  # ValueError: ArrowInvalid, a footer's bad UTF-8
        try:
            there = fs.get_file_info(path).type == pafs.FileType.File
        except OSError:
            there = False
        if not there:
            raise
        raise DataError(f"{shown}: not a readable Parquet file ({storage.first_line(e)}); {fix}") from None


def read_row_groups(units, shards, columns: list[str], failed=None):
    """(unit, the shard's path, the row group's table) of each of a read task's units (shard
    index, row group, ...), shard by shard: each shard opened, and its footer read, once. A unit
    that cannot be read (its shard, its footer or its pages) goes to `failed(unit, path, pf,
    error)`, pf the ParquetFile where the footer was read (else None); without `failed`, the
    error is raised."""
    import pyarrow.parquet as pq

    order = sorted(range(len(units)), key=lambda i: (int(units[i][0]), int(units[i][1])))
    for shard, picks in itertools.groupby(order, key=lambda i: int(units[i][0])):
        fs, path, _ = storage.filesystem(shards[shard])
        pending = list(picks)
        try:
            with fs.open_input_file(path) as f:
                pf = pq.ParquetFile(f)
                while pending:
                    i = pending.pop(0)
                    try:
                        table = pf.read_row_group(int(units[i][1]), columns=columns)
                    except Exception as e:  # its pages do not parse, or cannot be read: this unit's
                        if failed is None:
                            raise
                        failed(units[i], path, pf, e)
                        continue
                    yield units[i], path, table
        except Exception as e:  # the shard or its footer: every unit of it not read yet
            if failed is None:
                raise
            for i in pending:
                failed(units[i], path, None, e)


def read_prepared_units(units, root: str, shards, form: ShardFormat, bad: list | None = None):
    """A read task's row groups of prepared shards: {bytes, path, label, key}; `units` rows are
    (shard index, row group, rows). A row group that cannot be read goes to `bad`: its images
    by their paths where its path column still reads, else the row group itself."""
    import pyarrow as pa

    def failed(unit, path, pf, error):
        shard, group = shards[int(unit[0])], int(unit[1])
        why = f"cannot read row group {group} of {shard}: {storage.first_line(error)}"
        try:
            names = None if pf is None else pf.read_row_group(group, columns=[PATH]).column(0).to_pylist()
        except Exception:  # the path column is damaged too: the row group, by its place
            names = None
        bad.extend([(f"{root}/{n}", why) for n in names] if names else [(f"{shard}#row-group-{group}", why)])

    columns = list(READ_COLUMNS)
    tables = [t for _, _, t in read_row_groups(units, shards, columns, None if bad is None else failed)]
    return pa.concat_tables(tables) if tables else empty_rows()


def first_rows(shard: str, group: int, columns: list[str], count: int):
    """The first `count` rows of a row group of a Parquet file, read in buffered steps only as far as
    those rows go (the column chunks' first pages; a dictionary page, where there is one, whole), not
    whole column chunks: the few images a header sample needs cost a few requests on object
    storage, not a row group (as the datasets library writes image bytes: without a dictionary)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, path, _ = storage.filesystem(shard)
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f, pre_buffer=False, buffer_size=FIRST_ROWS_BUFFER)
        batch = next(pf.iter_batches(batch_size=count, row_groups=[group], columns=columns), None)
    return pa.Table.from_batches([batch]) if batch is not None else pa.table({c: [] for c in columns})


def first_prepared_sizes(unit, shards, count: int) -> list[tuple[int, int]]:
    """(width, height) of the first `count` images of a prepared row group, from the columns jobs.prepare
    wrote them in (training.forms.formats.sample_sizes): its image bytes may be one dictionary page, whole."""
    table = first_rows(shards[int(unit[0])], int(unit[1]), [WIDTH, HEIGHT], count)
    return [(w, h) for w, h in zip(*(table.column(c).to_pylist() for c in (WIDTH, HEIGHT)), strict=True) if w]


def empty_rows():
    """A read task's table without rows: {bytes, path, label, key}."""
    import pyarrow as pa

    types = read_types()
    return pa.table({k: pa.array([], type=t) for k, t in types.items()})
