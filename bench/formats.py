"""Images per second scanned and read from WebDataset shards and a Hugging Face Parquet export,
side by side with jobs.prepare shards of the same images, on local disk and on an S3 server.

    python -m bench.formats                                  # 1,000 photo-size JPEGs, 3 rounds
    python -m bench.formats --images 2000 --rounds 5 --json formats.json

Writes one tree of JPEGs (400 x 300 px, ~30-40 KB each, 10 classes) and converts it three ways:
jobs.prepare's shards (16 MB, row groups of 256), WebDataset tar shards (webdataset's member naming,
about 16 MB a shard) and a Hugging Face export (an Image struct column, ClassLabel metadata,
row groups of 100 as the datasets library writes images). Each goes to a local temporary
directory and to a local S3 server (moto's, in a process of its own, as bench/storage.py
starts it). Then, per round, for each format on each side (the order alternates):

  scan   training.forms.formats.scan_data: what the driver reads before training (WebDataset: every
         shard's member headers; Parquet: footers and small columns)
  read   every unit of both splits through the read task's own function
         (training.forms.formats.read_units), one process, a read task's units at a time (the
         train split's in an epoch's order): the encoded images, labels and keys a read
         task hands the augment stage (no decoding)

Every format is written in objects of 16-20 MB: moto's cost per ranged read grows with the
size of the object read from, so objects of one size keep that out of the comparison. moto
serves requests with one core's worth of Python on loopback: the S3 column shows what a
request costs next to a local read, not what AWS S3 or MinIO would give.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tarfile
import tempfile
import time

from bench import write_json

FORMATS = ("prepared", "webdataset", "huggingface")


def write_tree(root: str, images: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:300, 0:400]
    for i in range(images):
        c = i % 10
        folder = os.path.join(root, f"class{c}")
        os.makedirs(folder, exist_ok=True)
        base = np.stack([(x * (c + 1)) % 256, (y * (10 - c)) % 256, (x + y + 25 * c) % 256], axis=-1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f"{i:06d}.jpg"), quality=85)


def write_webdataset(tree, out: str, shard_bytes: int = 16 * 2**20) -> None:
    """The tree's images as tar shards train-NNNN.tar and val-NNNN.tar: <class>/<name>.jpg + .cls."""
    os.makedirs(out, exist_ok=True)
    for side, split in (("train", tree.train), ("val", tree.val)):
        shard, held, tar = 0, 0, None
        for path, label in zip(split.paths, split.labels, strict=True):
            if tar is None or held >= shard_bytes:
                if tar is not None:
                    tar.close()
                tar, held, shard = tarfile.open(os.path.join(out, f"{side}-{shard:04d}.tar"), "w"), 0, shard + 1
            data = open(path, "rb").read()
            key = os.path.splitext(os.path.relpath(path, tree.root))[0]
            for name, payload in ((f"{key}.jpg", data), (f"{key}.cls", str(int(label)).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            held += len(data)
        if tar is not None:
            tar.close()


def write_export(tree, out: str, rows_per_file: int = 500) -> None:
    """The tree's images as a Hugging Face export: data/{train,validation}-NNNNN-of-MMMMM.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    features = {"image": {"_type": "Image"}, "label": {"names": list(tree.class_names), "_type": "ClassLabel"}}
    meta = {"huggingface": json.dumps({"info": {"features": features}})}
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    for side, split in (("train", tree.train), ("validation", tree.val)):
        paths, labels = split.paths, split.labels
        files = max(1, -(-len(paths) // rows_per_file))
        for f in range(files):
            chunk = range(f * rows_per_file, min(len(paths), (f + 1) * rows_per_file))
            images = [{"bytes": open(paths[i], "rb").read(), "path": os.path.basename(paths[i])} for i in chunk]
            table = pa.table(
                {"image": pa.array(images, type=image_type), "label": pa.array(labels[list(chunk)], type=pa.int64())}
            )
            name = os.path.join(out, "data", f"{side}-{f:05d}-of-{files:05d}.parquet")
            pq.write_table(table.replace_schema_metadata(meta), name, row_group_size=100)


def time_scan(root: str) -> tuple[int, float, object]:
    from training.forms.formats import scan_data

    start = time.perf_counter()
    tree = scan_data(root, 0.2)
    return len(tree.train) + len(tree.val), time.perf_counter() - start, tree


def time_read(tree) -> tuple[int, float, int]:
    """(images, seconds, encoded bytes) of every unit of both splits through read_units, a read
    task's units at a time as training.stream.ingest.SplitSource hands them out: the train split's in
    an epoch's order, the validation split's in their own."""
    import numpy as np

    from training.forms.formats import read_units
    from training.stream.ingest import ROWS_PER_TASK, epoch_order, read_plan

    images = nbytes = 0
    start = time.perf_counter()
    for split, shuffled in ((tree.train, True), (tree.val, False)):
        per_task, _ = read_plan(split, ROWS_PER_TASK)
        order = epoch_order(len(split.units), 0, 1) if shuffled else np.arange(len(split.units))
        for first in range(0, len(order), per_task):
            table = read_units(split.units[order[first : first + per_task]], split.root, split.shards, split.form)
            images += table.num_rows
            nbytes += table.column("bytes").nbytes
    return images, time.perf_counter() - start, nbytes


def make_data(tmp: str, images: int, endpoint: str) -> dict:
    """{(where, format): root} of the same images in the three formats, on disk and on S3."""
    import pyarrow.fs as pafs

    from training.forms.parquet import prepare_tree
    from training.forms.tree import scan_tree

    local = os.path.join(tmp, "tree")
    write_tree(local, images)
    tree = scan_tree(local, 0.2)
    roots = {("local", "prepared"): os.path.join(tmp, "prepared")}
    prepare_tree(local, roots["local", "prepared"], shard_mb=16, log=lambda *a: None)
    roots["local", "webdataset"] = os.path.join(tmp, "wds")
    write_webdataset(tree, roots["local", "webdataset"])
    roots["local", "huggingface"] = os.path.join(tmp, "hf")
    write_export(tree, roots["local", "huggingface"])
    pafs.S3FileSystem(endpoint_override=endpoint, allow_bucket_creation=True).create_dir("bench")
    s3, _ = pafs.FileSystem.from_uri("s3://bench")
    for fmt in FORMATS:
        pafs.copy_files(roots["local", fmt], f"bench/{fmt}", destination_filesystem=s3, use_threads=False)
        roots["s3", fmt] = f"s3://bench/{fmt}"
    return roots


def measure(roots: dict, rounds: int) -> list[dict]:
    rows = []
    for r in range(rounds):
        order = [(w, f) for w in ("local", "s3") for f in FORMATS]
        for where, fmt in order if r % 2 == 0 else order[::-1]:
            n, scan_s, tree = time_scan(roots[where, fmt])
            read_n, read_s, nbytes = time_read(tree)
            assert read_n == n, (fmt, where, read_n, n)  # every image once
            rows.append(
                {"round": r + 1, "where": where, "format": fmt, "images": n, "scan_s": scan_s, "read_s": read_s}
                | {"mb": round(nbytes / 2**20, 1)}
            )
            print(
                f"round {r + 1}  {where:<5}  {fmt:<11}  {n:>6} images  scan {scan_s:7.3f} s  read {read_s:7.3f} s  "
                f"{n / read_s:8.0f} img/s  {nbytes / 2**20 / read_s:6.0f} MB/s",
                flush=True,
            )
    return rows


def report(rows: list[dict]) -> dict:
    """Median images/s per format and side, and each format's read rate over the prepared shards'."""
    summary: dict = {}
    print(f"\n{'median img/s':12} {'where':6} {'scan':>9} {'read':>9} {'read / prepared':>16}")
    for where in ("local", "s3"):
        for fmt in FORMATS:
            picked = [x for x in rows if x["where"] == where and x["format"] == fmt]
            base = [x for x in rows if x["where"] == where and x["format"] == "prepared"]
            ratios = [(b["read_s"] / x["read_s"]) for x, b in zip(picked, base, strict=True)]
            entry = {
                "scan_img_per_s": round(statistics.median(x["images"] / x["scan_s"] for x in picked)),
                "read_img_per_s": round(statistics.median(x["images"] / x["read_s"] for x in picked)),
                "read_vs_prepared": [round(v, 2) for v in ratios],
            }
            summary[f"{where}/{fmt}"] = entry
            print(
                f"{fmt:12} {where:6} {entry['scan_img_per_s']:9} {entry['read_img_per_s']:9} "
                f"{statistics.median(ratios):15.2f}x"
            )
    return summary


def main(argv=None) -> dict:
    from bench.storage import moto_server

    ap = argparse.ArgumentParser(prog="python -m bench.formats", description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1000, help="JPEGs in the tree (default: 1000)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the order alternating (default: 3)")
    ap.add_argument("--json", help="also write every round's figures as JSON to this path")
    args = ap.parse_args(argv)
    with moto_server() as endpoint, tempfile.TemporaryDirectory(prefix="bench-formats-") as tmp:
        rows = measure(make_data(tmp, args.images, endpoint), args.rounds)
    return write_json(args.json, {"images": args.images, "rounds": rows, "summary": report(rows)})


if __name__ == "__main__":
    main()
