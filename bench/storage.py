"""Files per second listed and read from an S3 server against the same files on local disk.

    python -m bench.storage                                   # 2,000 files, 3 rounds
    python -m bench.storage --files 5000 --rounds 5 --json storage.json

Writes one image tree (32x32 PNGs in <class>/<image>, CIFAR-like) to a local temporary
directory and the same tree to a local S3 server (moto's, in a process of its own on a loopback
port, reached through AWS_ENDPOINT_URL as the jobs reach MinIO), converts each with jobs.prepare's
code, then times three things, local and S3 alternating within every round:

  list    training.forms.tree.scan_tree: classes, split and sizes, what every job does first
  read    every file's bytes on 16 threads, as jobs.prepare reads a tree
  shards  the prepared copy: its manifest and small columns (scan_prepared), then every
          shard whole, as training from prepared data reads it

and, on S3 only, one 45 MB object (a model.pt's size) read whole as an input stream and as an
input file (training/storage.py reads the second way).

Needs the test extras (moto, Flask). moto is a Python server: on loopback it adds no network
latency, but it serves requests with one core's worth of Python, so the ratios show what a
request costs next to opening a file, not what AWS S3 or MinIO would give.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from bench import write_json


@contextlib.contextmanager
def moto_server():
    """start_server's server for the body of a with block, this process's AWS_* environment
    pointed at it; yields its endpoint, and stops it after."""
    proc, endpoint = start_server()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_EC2_METADATA_DISABLED="true",
    )
    try:
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def start_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process on a free loopback port; (process, endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto's server did not start within 60 s")


def write_data(local: str, files: int) -> None:
    """`files` 32x32 PNGs in 10 class folders under `local`."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(files):
        folder = os.path.join(local, f"class{i % 10}")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(os.path.join(folder, f"{i:06d}.png"))


def time_list(root: str) -> tuple[int, float]:
    from training.forms.tree import scan_tree

    start = time.perf_counter()
    tree = scan_tree(root, 0.2)
    return len(tree.train) + len(tree.val), time.perf_counter() - start


def time_read(root: str, threads: int = 16) -> tuple[int, float]:
    from training import storage
    from training.forms.tree import scan_tree

    tree = scan_tree(root, 0.2)
    paths = [p.split("://", 1)[-1] for p in tree.train.paths + tree.val.paths]
    fs, _, _ = storage.filesystem(root)

    def read(path: str) -> int:
        with fs.open_input_file(path) as f:
            return len(f.read())

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        sum(pool.map(read, paths))
    return len(paths), time.perf_counter() - start


def time_shards(prepared: str) -> tuple[int, float]:
    import pyarrow.parquet as pq

    from training import storage
    from training.forms.parquet import scan_prepared

    start = time.perf_counter()
    tree = scan_prepared(prepared)
    fs, _, _ = storage.filesystem(prepared)
    rows = sum(
        pq.read_table(s.split("://", 1)[-1], filesystem=fs).num_rows for s in tree.train.shards + tree.val.shards
    )
    return rows, time.perf_counter() - start


BIG = "bench/big.bin"


def time_big(how: str) -> tuple[int, float]:
    """One large object read whole from S3, as an input stream or an input file."""
    from training import storage

    fs, _, _ = storage.filesystem("s3://bench")
    start = time.perf_counter()
    with (fs.open_input_stream if how == "stream" else fs.open_input_file)(BIG) as f:
        f.read()
    return 1, time.perf_counter() - start


def make_data(tmp: str, files: int, endpoint: str) -> tuple[dict, float]:
    """The tree on disk and on the server, each prepared beside it: ({where: (tree, prepared)},
    seconds the upload took)."""
    import pyarrow.fs as pafs

    from training.forms.parquet import prepare_tree

    local = os.path.join(tmp, "tree")
    write_data(local, files)
    pafs.S3FileSystem(endpoint_override=endpoint, allow_bucket_creation=True).create_dir("bench")
    s3, _ = pafs.FileSystem.from_uri("s3://bench")
    start = time.perf_counter()
    pafs.copy_files(local, "bench/tree", destination_filesystem=s3, use_threads=False)
    upload_s = time.perf_counter() - start
    with s3.open_output_stream(BIG) as f:
        f.write(os.urandom(45 * 2**20))
    roots = {"local": (local, os.path.join(tmp, "prepared")), "s3": ("s3://bench/tree", "s3://bench/prepared")}
    for tree_root, prepared in roots.values():
        prepare_tree(tree_root, prepared, log=lambda *a: None)
    return roots, upload_s


def measure(roots: dict, rounds: int) -> list[dict]:
    """Every op on both sides per round; the side that goes first alternates."""
    rows = []
    for r in range(rounds):
        for where in ("local", "s3") if r % 2 == 0 else ("s3", "local"):
            tree_root, prepared = roots[where]
            for op, fn, root in (
                ("list", time_list, tree_root),
                ("read", time_read, tree_root),
                ("shards", time_shards, prepared),
            ):
                n, seconds = fn(root)
                rows.append({"round": r + 1, "where": where, "op": op, "files": n, "s": round(seconds, 4)})
                print(
                    f"round {r + 1}  {where:<5}  {op:<6}  {n:>6} files  {seconds:8.3f} s  {n / seconds:10.0f} files/s",
                    flush=True,
                )
        for how in ("stream", "file") if r % 2 == 0 else ("file", "stream"):
            _, seconds = time_big(how)
            rows.append({"round": r + 1, "where": "s3", "op": f"45 MB as {how}", "files": 1, "s": round(seconds, 4)})
            print(f"round {r + 1}  s3     45 MB as input {how}: {seconds:.3f} s", flush=True)
    return rows


def report(rows: list[dict]) -> dict:
    """Median files/s per side and op, and local/S3 per round."""
    summary = {}
    print(f"\n{'median files/s':14} {'local':>10} {'s3':>10} {'local / s3':>11}   per round")
    for op in ("list", "read", "shards"):
        rate = {w: [x["files"] / x["s"] for x in rows if x["op"] == op and x["where"] == w] for w in ("local", "s3")}
        ratios = [a / b for a, b in zip(rate["local"], rate["s3"], strict=True)]
        summary[op] = {w: round(statistics.median(v)) for w, v in rate.items()} | {
            "ratios": [round(x, 1) for x in ratios]
        }
        print(
            f"{op:14} {statistics.median(rate['local']):10.0f} {statistics.median(rate['s3']):10.0f} "
            f"{statistics.median(ratios):10.1f}x   {', '.join(f'{x:.1f}x' for x in ratios)}"
        )
    stream, file = ([x["s"] for x in rows if x["op"] == f"45 MB as {how}"] for how in ("stream", "file"))
    summary["45 MB object"] = {"stream_s": stream, "file_s": file}
    print(
        f"45 MB object from S3, median s: input stream {statistics.median(stream):.2f}, input file "
        f"{statistics.median(file):.2f} ({statistics.median(a / b for a, b in zip(stream, file, strict=True)):.1f}x)"
    )
    return summary


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.storage", description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000, help="images in the tree (default: 2000)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, local and S3 alternating in each (default: 3)")
    ap.add_argument("--json", help="also write every round's figures as JSON to this path")
    args = ap.parse_args(argv)

    with moto_server() as endpoint, tempfile.TemporaryDirectory(prefix="bench-storage-") as tmp:
        roots, upload_s = make_data(tmp, args.files, endpoint)
        print(f"{args.files} files, {args.rounds} rounds; upload to the server took {upload_s:.1f} s")
        rows = measure(roots, args.rounds)
    result = {"files": args.files, "upload_s": round(upload_s, 1), "rounds": rows, "summary": report(rows)}
    return write_json(args.json, result)


if __name__ == "__main__":
    main()
