"""Prepared datasets: an image tree converted once into Parquet shards.

Millions of small files read slowly from object storage (one request per file); a few
hundred shards of ~128 MB read at full bandwidth. `python -m jobs.prepare DIR OUT` writes

    OUT/train/part-00000.parquet ...   rows: bytes (the encoded file, unchanged), label,
    OUT/val/part-00000.parquet ...           key, height, width, path (relative to DIR)
    OUT/_prepared.json                 the manifest, written last: class names, the split,
                                       counts and shard names

The split, the labels and the keys are those `training.data.scan_tree` gives for DIR, so
training on OUT sees the same images with the same labels, and (augmentation being keyed by
`key`) the same augmentations. Train rows are stored in an order shuffled once, so that
every shard mixes classes; validation rows in path order.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath

import numpy as np

from training.data import DataError, ImageTree, Split, _filesystem, scan_tree, stack_images

MANIFEST = "_prepared.json"
FORMAT = "ray-gpu-augment/prepared/1"
SPLITS = ("train", "val")


@dataclasses.dataclass(frozen=True)
class PreparedSplit(Split):
    """A Split whose images live in Parquet shards (paths name the original files)."""

    shards: tuple[str, ...] = ()  # shard URIs, in the order they were written
    source: str = ""  # the tree jobs.prepare read; paths are below it


def is_prepared(root: str) -> bool:
    """Is `root` the output of jobs.prepare (has its manifest)?"""
    import pyarrow.fs as pafs

    fs, base, _ = _filesystem(root)
    return fs.get_file_info(f"{base}/{MANIFEST}").type == pafs.FileType.File


def _image_size(data: bytes) -> tuple[int | None, int | None]:
    """(height, width) from the image header; (None, None) when Pillow cannot read it
    (training then drops and reports the file, as it does for a bad file in a tree)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.height, img.width
    except Exception:  # noqa: BLE001 - any unreadable file: decided again when decoding
        return None, None


def _read_all(fs, paths: list[str], threads: int) -> list[bytes]:
    def read(path: str) -> bytes:
        with fs.open_input_stream(path.split("://", 1)[-1]) as f:
            return f.read()

    with ThreadPoolExecutor(max_workers=threads) as pool:  # object storage: latency-bound, so threads
        return list(pool.map(read, paths))


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
    files (prepared data is never overwritten in place).
    """
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    tree = scan_tree(root, val_fraction)
    src_fs, src_base, _ = _filesystem(root)
    fs, base, prefix = _filesystem(out)
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.File:
        raise DataError(f"{out}: is a file; give a directory for the prepared shards")
    if info.type == pafs.FileType.Directory and fs.get_file_info(pafs.FileSelector(base, recursive=False)):
        raise DataError(f"{out}: already exists and is not empty; choose a new directory or delete it")
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
    for name, split in (("train", tree.train), ("val", tree.val)):
        order = np.random.default_rng(seed).permutation(len(split)) if name == "train" else np.arange(len(split))
        fs.create_dir(f"{base}/{name}", recursive=True)
        n_shards = max(1, math.ceil(split.total_bytes / shard_bytes)) if len(split) else 0
        shards = []
        for s, rows in enumerate(np.array_split(order, n_shards) if n_shards else []):
            paths = [split.paths[i] for i in rows]
            data = _read_all(src_fs, paths, threads)
            sizes = [_image_size(b) for b in data]
            table = pa.table(
                {
                    "bytes": pa.array(data, type=pa.binary()),
                    "label": pa.array([split.labels[i] for i in rows], type=pa.int64()),
                    "key": pa.array([split.keys[i] for i in rows], type=pa.int64()),
                    "height": pa.array([h for h, _ in sizes], type=pa.int32()),
                    "width": pa.array([w for _, w in sizes], type=pa.int32()),
                    "path": pa.array(
                        [str(PurePosixPath(p.split("://", 1)[-1]).relative_to(src_base)) for p in paths],
                        type=pa.string(),
                    ),
                }
            )
            shard = f"{name}/part-{s:05d}.parquet"
            # row groups of 256 images: Ray Data can split a shard between readers
            pq.write_table(table, f"{base}/{shard}", filesystem=fs, row_group_size=256)
            shards.append(shard)
            log(f"{name}: wrote {prefix}{base}/{shard} ({len(rows)} images)")
        manifest["splits"][name] = {"images": len(split), "bytes": split.total_bytes, "shards": shards}
    with fs.open_output_stream(f"{base}/{MANIFEST}") as f:  # last: a half-written OUT has no manifest
        f.write((json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


def read_manifest(root: str) -> dict:
    fs, base, _ = _filesystem(root)
    with fs.open_input_stream(f"{base}/{MANIFEST}") as f:
        manifest = json.loads(f.read())
    if manifest.get("format") != FORMAT:
        raise DataError(
            f"{root}/{MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}; prepare it again with "
            "python -m jobs.prepare"
        )
    return manifest


def scan_prepared(root: str) -> ImageTree:
    """The ImageTree of a prepared directory: labels and keys read from the shards' small
    columns (not the image bytes). The split is the one fixed by jobs.prepare."""
    import pyarrow.parquet as pq

    manifest = read_manifest(root)
    fs, base, prefix = _filesystem(root)
    source = manifest["source"].rstrip("/")
    splits = {}
    for name in SPLITS:
        meta = manifest["splits"][name]
        shards = tuple(f"{prefix}{base}/{s}" for s in meta["shards"])
        paths, labels, keys = [], [], []
        for shard in meta["shards"]:
            t = pq.read_table(f"{base}/{shard}", columns=["path", "label", "key"], filesystem=fs)
            paths += [f"{source}/{p}" for p in t.column("path").to_pylist()]
            labels += t.column("label").to_pylist()
            keys += t.column("key").to_pylist()
        if len(paths) != meta["images"]:
            raise DataError(
                f"{root}: {name} shards hold {len(paths)} images, the manifest says {meta['images']}; prepare it again"
            )
        splits[name] = PreparedSplit(
            tuple(paths), tuple(labels), tuple(keys), meta["bytes"], shards=shards, source=source
        )
    layout = f"{manifest['layout']}" + (
        f" by val_fraction {manifest['val_fraction']}" if manifest["layout"] == "hash" else ""
    )
    return ImageTree(
        root=root,
        layout=f"{layout}, prepared",
        class_names=tuple(manifest["class_names"]),
        train=splits["train"],
        val=splits["val"],
    )


class PreparedDecoder:
    """map_batches function: Parquet rows {bytes, label, key, path} -> {image, label, key}.
    An undecodable image is dropped and reported to `bad_log`, as training.data.Decoder does."""

    def __init__(self, source: str, bad_log=None, *, keep_path: bool = False):
        self._source, self._bad_log, self._keep_path = source.rstrip("/"), bad_log, keep_path

    def __call__(self, batch: dict) -> dict:
        from training.data import decode_image

        images, keep, bad = [], [], []
        for i, data in enumerate(batch["bytes"]):
            try:
                images.append(decode_image(data))
            except ValueError as e:  # training.data.BadImage
                bad.append((f"{self._source}/{batch['path'][i]}", str(e)))
                continue
            keep.append(i)
        if bad and self._bad_log is not None:
            self._bad_log.add.remote(bad)
        out = {
            "image": stack_images(images),
            "label": np.asarray(batch["label"], dtype=np.int64)[keep],
            "key": np.asarray(batch["key"], dtype=np.int64)[keep],
        }
        if self._keep_path:  # relative to the source tree (jobs.predict names files by it)
            out["path"] = np.asarray(batch["path"], dtype=object)[keep]
        return out


def read_prepared_split(split: PreparedSplit, *, seed: int, shuffle: bool, bad_log=None, num_cpus: float = 1.0):
    """Ray Dataset of decoded images for one prepared split: the same {image, label, key}
    columns as training.data.read_split. Shards are read in an order shuffled by `seed`
    (their rows were shuffled once by jobs.prepare); from epoch 1 on, the trainer's buffer
    reshuffles every epoch."""
    import ray.data

    shards = list(split.shards)
    if shuffle:
        shards = [shards[i] for i in np.random.default_rng(seed).permutation(len(shards))]
    ds = ray.data.read_parquet(shards, num_cpus=num_cpus).select_columns(["bytes", "label", "key", "path"])
    return ds.map_batches(
        PreparedDecoder(split.source, bad_log), batch_format="numpy", batch_size=64, num_cpus=num_cpus
    )
