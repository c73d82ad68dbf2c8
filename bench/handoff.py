"""The hand-off: augmented 224 px blocks from a Ray Data map stage to a trainer's batches (not a test).

    python -m bench.handoff                          # 16,384 images an epoch, batches of 256
    python -m bench.handoff --epochs 5 --json handoff.json
    python -m bench.handoff --block-rows 1024 --cold         # blocks of 1,024, the object store as Ray starts it

Ray Data tasks make uint8 (--block-rows, 224, 224, 3) blocks with the augment stage's columns (image,
label, key, epoch), as the augment tasks hand them on; the trainer's side takes them through
`training.worker.feed.train_batches`, the call the train workers make, on the CPU. Three feeds side
by side, epoch by epoch in turn (these machines are noisy):

* job      what the job does for an image tree: no local shuffle buffer;
* shuffle  with the local shuffle buffer (what the job keeps for prepared shards' row groups);
* made     the job's feed over the same blocks made beforehand (materialized): the trainer's
           side alone, where a copy of the pixels would show.

Columns: img/s (best of --epochs); host CPU per image, in µs: the whole machine's busy CPU
time over the epoch (every Ray process, the block's making included) per image, median over
the epochs; and of that, the trainer's process (this one: Ray Data's executor runs in it).
Target (the GPU stage's issue): at most 150 µs of host CPU per image.

Before any epoch, most of the object store's pages are written once (`warm_store`, timed and
printed): a page of the store's shared memory costs a fault and its zeroing the first time
anything writes it, then no more. A job is past that after a few store-fuls of blocks; the
warm-up keeps the figures from depending on how much the store was written before
(docs/benchmark-log.md, "Hand-off"). `--cold` leaves the store as Ray starts it.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import numpy as np
import psutil
import torch

from bench import write_json

SIDE = 224


def busy_s() -> float:
    """The machine's CPU time spent busy so far, all cores (s)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


@functools.lru_cache(maxsize=2)
def template(rows: int) -> np.ndarray:
    """A block's pixels, made once per worker process and block size."""
    return np.random.default_rng(0).integers(0, 256, (rows, SIDE, SIDE, 3), dtype=np.uint8)


def make_block(batch: dict) -> dict:
    """A map task's output block: a copy of a template batch, as an augment task writes its
    output (no random numbers: their cost is not the hand-off's)."""
    n = len(batch["id"])
    image = np.empty((n, SIDE, SIDE, 3), dtype=np.uint8)
    image[:] = template(n)
    ids = batch["id"].astype(np.int64)
    return {"image": image, "label": ids % 10, "key": ids * 7919, "epoch": np.ones(n, np.int64)}


def dataset(images: int, block_rows: int):
    """Blocks made by Ray Data tasks, as the job's augment tasks make them."""
    import ray

    blocks = max(1, images // block_rows)
    return ray.data.range(images, override_num_blocks=blocks).map_batches(make_block, batch_size=block_rows)


def warm_store(chunk_mb: int = 256, fill: float = 0.75) -> float:
    """Write the object store's pages once: puts of a zeroed chunk, held until `fill` of the
    store is taken, then freed (past Ray's spilling threshold, 0.8 by default, Ray would move
    them to disk instead); the seconds it took."""
    import ray

    start, chunk = time.perf_counter(), np.zeros(chunk_mb << 20, dtype=np.uint8)
    held = [ray.put(chunk) for _ in range(int(fill * ray.cluster_resources()["object_store_memory"]) // chunk.nbytes)]
    del held
    return time.perf_counter() - start


def epoch(ds, batch_size: int, shuffle: bool, number: int) -> tuple[float, float, float]:
    """(img/s, busy µs per image, this process's µs per image) of one epoch through train_batches."""
    from training.worker.feed import train_batches

    busy, own, start, n = busy_s(), time.process_time(), time.perf_counter(), 0
    for batch in train_batches(ds.iterator(), batch_size, torch.device("cpu"), number, seed=0, rank=0, shuffle=shuffle):
        n += len(batch["image"])
    wall, cpu, mine = time.perf_counter() - start, busy_s() - busy, time.process_time() - own
    return n / wall, cpu / n * 1e6, mine / n * 1e6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.handoff", description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=16384, help="images an epoch")
    ap.add_argument("--batch-size", type=int, default=256, help="the trainer's batch")
    ap.add_argument("--block-rows", type=int, default=256, help="rows a map task hands on")
    ap.add_argument("--epochs", type=int, default=4, help="measured epochs per feed (after one warm-up each)")
    ap.add_argument("--cold", action="store_true", help="leave the object store's pages unwritten (see above)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    from bench.handoff import dataset as by_name  # pickled by module name, not as __main__'s

    warm = None if args.cold else round(warm_store(), 1)
    if warm is not None:
        print(f"object store pages written once in {warm} s")
    ds = by_name(args.images, args.block_rows)
    made = ds.materialize()
    feeds = {"job": (ds, False), "shuffle": (ds, True), "made": (made, False)}
    runs = {name: [] for name in feeds}
    for source, shuffle in feeds.values():
        epoch(source, args.batch_size, shuffle, 1)  # warm-up: the map stage's workers start
    for _ in range(args.epochs):
        for name, (source, shuffle) in feeds.items():
            runs[name].append(epoch(source, args.batch_size, shuffle, 1))  # epoch 1: the buffer applies
    result = {"cpus": os.cpu_count(), "images": args.images, "batch_size": args.batch_size}
    result |= {"block_rows": args.block_rows, "store_warmed_s": warm, "feeds": {}}
    print(f"{'feed':<8} {'img/s':>8} {'host CPU µs/img':>16} {'trainer process µs/img':>23}")
    for name, measured in runs.items():
        rate = max(r for r, _, _ in measured)
        cpu, mine = (statistics.median(m[i] for m in measured) for i in (1, 2))
        result["feeds"][name] = {
            "images_per_s": round(rate, 1),
            "host_cpu_us_per_image": round(cpu, 1),
            "trainer_process_us_per_image": round(mine, 1),
        }
        print(f"{name:<8} {rate:>8.1f} {cpu:>16.1f} {mine:>23.1f}")
    result |= result["feeds"]["job"]  # the job's own figures at the top level
    ray.shutdown()
    return write_json(args.json, result)


if __name__ == "__main__":
    main()
