"""Ingest at scale: read -> decode -> augment through Ray Data with no training, on trees of
growing size (not a test).

    python -m bench.ingest                                   # 10,000 and 100,000 files, ~6 minutes
    python -m bench.ingest --files 10000 100000 --json ingest.json
    python -m bench.ingest --files 1000 10000 --preset imagenet

Each tree is DIR/class<k>/<i>.jpg, photo-like JPEGs of 64-160 px in 100 classes, written once
under --work (100,000 of them take about 0.5 GB; building a tree is not part of any figure).
Each size runs in a fresh process with a fresh local Ray, as jobs.train does:
training.forms.formats.scan_data, then the datasets exactly as jobs.train builds them
(training.stream.ingest.build_datasets, with the job's plan for this machine), the train split
iterated in the driver for two epochs. Per tree size:

* scan_s         the driver's scan of the tree (listing, split, keys);
* first_batch_s  from building the datasets to the first batch of epoch 0;
* images_per_s   epoch 1 (the second: worker processes already started), images / seconds;
* driver_rss_mb  the driver's peak resident memory (ru_maxrss), start-up included;
* map_fn_bytes   the pickled bytes of every map function and its arguments: what each task
                 unpickles;
* source_bytes   the pickled read source (its file table is in the object store: only its
                 counts grow, by their digits), unpickled by each process that runs an execution.

Targets on the 2-core machine (the issue): images_per_s at the largest size >= 0.9x the
smallest's; map_fn_bytes equal; driver_rss_mb growing by under 300 bytes per file;
first_batch_s at the largest size within 2x of the smallest's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FIELDS = ("files", "scan_s", "first_batch_s", "images_per_s", "driver_rss_mb", "map_fn_bytes", "source_bytes")


def _write_small_photo(job: tuple[str, int]) -> None:
    import numpy as np
    from PIL import Image

    from bench.augment import synthetic_photo

    path, i = job
    rng = np.random.default_rng(i)
    h, w = (int(v) for v in rng.integers(64, 161, 2))
    Image.fromarray(synthetic_photo(h, w, i)).save(path, quality=90)


def make_tree(out: str, count: int, classes: int = 100) -> str:
    from bench.augment import generate_tree

    return generate_tree(out, count, _write_small_photo, classes=classes, names=(3, 7), chunksize=256)


def _record_pickles(sizes: dict) -> None:
    """Count the pickled bytes of what the datasets' builder hands Ray Data."""
    import ray.data
    from ray import cloudpickle

    original_map, original_read = ray.data.Dataset.map_batches, ray.data.read_datasource

    def map_batches(ds, fn, *args, **kwargs):
        sizes["map_fn"] += len(cloudpickle.dumps((fn, [kwargs.get(k) for k in sorted(kwargs) if k.startswith("fn_")])))
        return original_map(ds, fn, *args, **kwargs)

    def read_datasource(source, **kwargs):
        sizes["source"] += len(cloudpickle.dumps(source))
        return original_read(source, **kwargs)

    ray.data.Dataset.map_batches, ray.data.read_datasource = map_batches, read_datasource


def child(data: str, preset_name: str, batch: int) -> dict:
    import ray

    from augment.presets import load_preset
    from training.config import TrainConfig
    from training.driver import planning
    from training.driver.session import connect
    from training.forms.formats import scan_data
    from training.status import BadFileLog
    from training.stream.ingest import build_datasets, choose_decode
    from training.stream.stamp import EpochClock

    connect()
    cfg = TrainConfig(data=data, preset=preset_name, batch_size=batch)
    start = time.perf_counter()
    tree = scan_data(data, cfg.val_fraction)
    scan_s = time.perf_counter() - start
    preset = load_preset(preset_name)
    plan = planning.plan_resources(cfg, planning.cluster_capacity())
    decode = choose_decode(cfg.decode, tree.train, preset.train, plan.use_gpu)
    clock, bad_log = ray.remote(num_cpus=0)(EpochClock).remote(), ray.remote(num_cpus=0)(BadFileLog).remote()
    pickles = {"map_fn": 0, "source": 0}
    _record_pickles(pickles)
    start = time.perf_counter()
    ds = build_datasets(cfg, tree, preset, plan, clock, bad_log, decode)["train"]
    first_batch_s, rates = None, []
    for epoch in range(2):
        ray.get(clock.set.remote(epoch))
        t0, n = time.perf_counter(), 0
        for b in ds.iter_batches(batch_size=batch, batch_format="numpy", prefetch_batches=0 if epoch == 0 else 2):
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - start
            n += len(b["key"])
        rates.append(n / (time.perf_counter() - t0))
    return {
        "files": len(tree.train) + len(tree.val),
        "train_files": len(tree.train),
        "scan_s": round(scan_s, 2),
        "first_batch_s": round(first_batch_s, 2),
        "images_per_s": round(rates[1], 1),
        "first_epoch_images_per_s": round(rates[0], 1),
        "driver_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "map_fn_bytes": pickles["map_fn"],
        "source_bytes": pickles["source"],
        "plan": f"{plan.describe()}; {decode.describe()}",
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, nargs="+", default=[10_000, 100_000], help="tree sizes, smallest first")
    ap.add_argument("--preset", default="cifar", help="augmentation preset (default: cifar, so that ingest dominates)")
    ap.add_argument("--batch-size", type=int, default=256, help="images per batch the driver takes")
    ap.add_argument("--work", default="/tmp/bench-ingest", help="the generated trees go here")
    ap.add_argument("--json", metavar="FILE", help="write one record per tree size here")
    ap.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.preset, args.batch_size)), flush=True)
        return []
    rows = []
    for n in args.files:
        tree = make_tree(os.path.join(args.work, f"jpegs-{n}"), n)
        cmd = [sys.executable, "-m", "bench.ingest", "--child", tree, "--preset", args.preset]
        out = subprocess.run(cmd + ["--batch-size", str(args.batch_size)], cwd=REPO, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{n} files failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{n} files done: {rows[-1]}", flush=True)
    print("\n| " + " | ".join(FIELDS) + " |\n|" + " ---: |" * len(FIELDS))
    for r in rows:
        print("| " + " | ".join(str(r[f]) for f in FIELDS) + " |")
    small, large = rows[0], rows[-1]
    per_file = (large["driver_rss_mb"] - small["driver_rss_mb"]) * 2**20 / max(1, large["files"] - small["files"])
    print(
        f"\nimages_per_s {large['images_per_s'] / small['images_per_s']:.2f}x (target >= 0.9); "
        f"first_batch_s {large['first_batch_s'] / small['first_batch_s']:.2f}x (target <= 2); "
        f"driver RSS +{per_file:.0f} bytes per file (target < 300); "
        f"map_fn_bytes {'equal' if small['map_fn_bytes'] == large['map_fn_bytes'] else 'DIFFER'}\nplan: {large['plan']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "preset": args.preset, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
