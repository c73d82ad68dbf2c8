"""A tree of JPEGs that cost what ImageNet's cost to decode, made in seconds and without a network.

    python -m bench.gpu_data /tmp/imagenet-like                      # 2,000 distinct, 50,000 + 2,000 samples
    python -m bench.gpu_data /tmp/imagenet-like --json /tmp/imagenet-like.json
    python -m bench.gpu_data /tmp/tiny --distinct 24 --train 60 --val 12 --classes 3 --workers 2

    from bench.gpu_data import make_imagenet_like
    stats = make_imagenet_like("/tmp/imagenet-like")      # the same, from Python; returns the stats

A JPEG decoder's cost follows the pixels (IDCT, colour conversion) and the bytes (Huffman
decoding), so the distinct images have ImageNet's geometry (the longer side mostly 500 px,
the shorter 333-500 px; many 500 x 375 or 375 x 500; a few wider and larger) and its bytes
(quality 90, content with a photo's entropy: smooth fields at a few scales, regions of texture,
filled shapes with hard edges, film grain, tuned to ImageNet's mean file size with a wide
spread). A few percent are 4:4:4, progressive, grayscale or CMYK, which ImageNet has too and which
take other paths through a decoder. Each image comes from its own numpy Generator,
seeded by (seed, index): the same arguments give the same bytes with any number of workers
(and the same numpy and Pillow).

Layout, which training.forms.tree.scan_tree and torchvision's ImageFolder (on OUT/train) both read:

    OUT/train/n0000/n0000_000000.JPEG ...   train samples, class i % classes for sample i
    OUT/val/n0000/n0000_000000.JPEG ...     val samples, likewise
    OUT/.distinct/000000.JPEG ...           the distinct files (hidden: scanners skip it)
    OUT/stats.json                          what make_imagenet_like returns
    OUT/.done                               the parameters the tree was made with, written last

Sample i of a split is a hard link to distinct file i % distinct (a copy where linking fails),
so 50,000 samples cost almost no disk, yet each has its own path (the job keys images by path).
Where `classes` divides `distinct`, every distinct file belongs to one class only.

A second call with the same parameters returns the stored stats at once. Otherwise the tree is
built in a temporary sibling of OUT and renamed into place; an OUT that this module did not
make (no .done) is refused, not overwritten.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
from PIL import Image, ImageDraw

from bench import write_json

FORMAT = 1  # raise when the generator's output changes, so that trees made before are rebuilt
QUALITY = 90
DONE, STATS, DISTINCT = ".done", "stats.json", ".distinct"
KINDS = ("420", "444", "progressive", "gray", "cmyk")  # "420" (baseline 4:2:0) is the rest
SHARES = {"444": 0.03, "progressive": 0.03, "gray": 0.01, "cmyk": 0.005}
EVERY_KIND_FROM = 20  # from this many distinct files on, every kind has at least one

# Content amplitudes, in grey levels (see render). Tuned once by measuring the mean file size
# at QUALITY; TEXTURE_SPREAD (the sigma of a log-normal per-image factor) sets the spread.
LARGE = ((160, 25.0), (64, 14.0), (24, 7.5))  # (cell px, amplitude): lighting and large objects
TEXTURE = ((8, 30.0), (3, 54.0), (1.5, 30.0))  # the same, only where the image's mask lets it through
TEXTURE_SPREAD = 1.0
SHAPES = 70.0  # filled polygons and ellipses: hard edges
GRAIN = 4.0  # per-pixel noise (sensor grain, JPEG noise of the originals)
HUE = 0.3  # the texture's share in the chroma: textures have a colour (leaves, fur)


class NotOurTree(FileExistsError):
    """OUT exists and was not made by this module; nothing was changed."""


def make_imagenet_like(
    out: str,
    *,
    distinct: int = 2000,
    train: int = 50000,
    val: int = 2000,
    classes: int = 100,
    seed: int = 0,
    workers: int | None = None,
) -> dict:
    """Make (or find already made) the tree at `out`; returns its stats (also in OUT/stats.json)."""
    if distinct < 1 or classes < 1 or train < 0 or val < 0 or seed < 0 or (workers is not None and workers < 1):
        raise ValueError("distinct, classes and workers must be >= 1; train, val and seed >= 0")
    out = os.path.abspath(out)
    params = {"format": FORMAT, "distinct": distinct, "train": train, "val": val, "classes": classes, "seed": seed}
    done, made = _read_json(os.path.join(out, DONE)), _read_json(os.path.join(out, STATS))
    if done == params and isinstance(made, dict):
        return {**made, "out": out, "reused": True}
    if done is None and os.path.lexists(out) and not _empty_dir(out):
        raise NotOurTree(f"{out} exists and was not made by bench.gpu_data (it has no {DONE}); pass a new path")
    start = time.perf_counter()
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    try:
        stats = {"out": out, **_build(tmp, params, workers or os.cpu_count() or 1)}
        stats["seconds"] = round(time.perf_counter() - start, 2)
        with open(os.path.join(tmp, STATS), "w") as f:
            json.dump(stats, f, indent=2)
        with open(os.path.join(tmp, DONE), "w") as f:  # last: a tree with .done is complete
            json.dump(params, f)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**stats, "reused": False}


def _build(root: str, params: dict, workers: int) -> dict:
    """The whole tree under `root`: distinct files first (in parallel), then the links."""
    distinct, seed = params["distinct"], params["seed"]
    os.makedirs(os.path.join(root, DISTINCT))
    kinds = assign_kinds(distinct, seed)
    rows = _make_distinct(root, kinds, seed, workers)
    copies = sum(_link_split(root, split, params[split], params["classes"], distinct) for split in ("train", "val"))
    sizes = [r[1] for r in rows]
    return {
        **{k: params[k] for k in ("distinct", "train", "val", "classes", "seed")},
        "samples": params["train"] + params["val"],
        "bytes_mean": round(statistics.fmean(sizes)),
        "bytes_median": round(statistics.median(sizes)),
        "bytes_min": min(sizes),
        "bytes_max": max(sizes),
        "bytes_p5": int(np.percentile(sizes, 5)),
        "bytes_p95": int(np.percentile(sizes, 95)),
        "short_side_mean": round(statistics.fmean(min(r[2], r[3]) for r in rows), 1),
        "long_side_mean": round(statistics.fmean(max(r[2], r[3]) for r in rows), 1),
        "kinds": {k: kinds.count(k) for k in KINDS},
        "copies": copies,  # samples copied because a hard link failed
        "workers": workers,
        "quality": QUALITY,
    }


def assign_kinds(distinct: int, seed: int) -> list[str]:
    """The kind of each distinct file: SHARES of it special, at seeded random indices."""
    counts = {k: round(share * distinct) for k, share in SHARES.items()}
    if distinct >= EVERY_KIND_FROM:
        counts = {k: max(1, n) for k, n in counts.items()}
    kinds = [k for k, n in counts.items() for _ in range(n)]
    kinds += ["420"] * (distinct - len(kinds))
    order = np.random.default_rng([seed, 0]).permutation(distinct)
    return [kinds[i] for i in order]


def _make_distinct(root: str, kinds: list[str], seed: int, workers: int) -> list[tuple]:
    """(index, bytes, width, height) of every distinct file, made by `workers` processes."""
    n = len(kinds)
    chunks = min(n, 4 * workers)  # several ranges per worker: the slow ones (wide, progressive) even out
    bounds = [n * c // chunks for c in range(chunks + 1)]
    jobs = [(root, seed, a, kinds[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    if workers == 1:
        parts = [make_range(*job) for job in jobs]
    else:
        context = multiprocessing.get_context(_start_method())
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context) as pool:
            parts = list(pool.map(make_range, *zip(*jobs, strict=True)))
    return [row for part in parts for row in part]


def _start_method() -> str:
    """fork where the caller runs no other Python thread: it starts at once and, unlike spawn
    and forkserver, does not re-run the caller's __main__ (a script without an
    `if __name__ == "__main__"` guard would start over). forkserver where the caller has threads
    (a Ray driver), as a fork can deadlock on a lock another thread held."""
    return "fork" if threading.active_count() == 1 and sys.platform == "linux" else "forkserver"


def make_range(root: str, seed: int, start: int, kinds: list[str]) -> list[tuple]:
    """Distinct files start, start + 1, ... of the given kinds, written to root/.distinct."""
    rows = []
    for index, kind in enumerate(kinds, start):
        rng = np.random.default_rng([seed, 1, index])
        width, height = image_size(rng)
        path = distinct_path(root, index)
        encode(render(rng, width, height), kind, path)
        rows.append((index, os.path.getsize(path), width, height))
    return rows


def distinct_path(root: str, index: int) -> str:
    return os.path.join(root, DISTINCT, f"{index:06d}.JPEG")


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) as ImageNet's come: Flickr's 500 px longer side with the shorter at 375
    (4:3), at 333 (3:2) or anywhere in 333-500 (near-square included); a few wider and larger;
    a quarter of them portrait."""
    r = rng.random()
    if r < 0.45:
        short, long = 375, 500
    elif r < 0.60:
        short, long = 333, 500
    elif r < 0.95:
        short, long = int(rng.integers(333, 501)), 500
    else:
        short = int(rng.integers(333, 501))
        long = round(short * rng.uniform(1.5, 2.0))
    return (short, long) if rng.random() < 0.25 else (long, short)


def render(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """An RGB image with a photo's mix of smooth areas, textured areas, edges and grain."""
    y = sum(amp * _field(rng, width, height, cell) for cell, amp in LARGE)
    # textured where the mask is high, smooth elsewhere (sky, walls); the bias sets how much of
    # the image is textured, and the factor how strong: the two make the spread of sizes
    mask = 1.0 / (1.0 + np.exp(-2.5 * _field(rng, width, height, 96) - rng.uniform(0.5, 3.5)))
    texture = sum(amp * _field(rng, width, height, cell) for cell, amp in TEXTURE)
    texture *= rng.lognormal(0.0, TEXTURE_SPREAD) * mask
    y += texture + SHAPES * _shapes(rng, width, height)
    y += (GRAIN * rng.lognormal(0.0, 0.5)) * rng.standard_normal((height, width), dtype=np.float32)
    y += rng.uniform(60, 190)
    hue = rng.uniform(-1, 1, 2) * HUE
    cb = rng.uniform(-20, 20) + 10 * _field(rng, width, height, 120) + hue[0] * texture
    cr = rng.uniform(-20, 20) + 10 * _field(rng, width, height, 120) + hue[1] * texture
    rgb = np.stack([y + 1.402 * cr, y - 0.344 * cb - 0.714 * cr, y + 1.772 * cb], axis=-1)
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")


def _field(rng: np.random.Generator, width: int, height: int, cell: float) -> np.ndarray:
    """Smooth unit noise with features about `cell` px wide: a coarse grid of normal values
    upsampled by Pillow (much cheaper than filtering full-size noise)."""
    grid = rng.standard_normal((max(2, round(height / cell)) + 1, max(2, round(width / cell)) + 1), dtype=np.float32)
    return np.asarray(Image.fromarray(grid, "F").resize((width, height), Image.Resampling.BICUBIC))


def _shapes(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A few filled ellipses and polygons in [-1, 1]: the hard edges of objects."""
    layer = Image.new("L", (width, height), 128)
    draw = ImageDraw.Draw(layer)
    for _ in range(int(rng.integers(3, 12))):
        x, y = rng.uniform(-0.2, 1.0, 2) * (width, height)
        size = rng.uniform(0.05, 0.5) * min(width, height)
        fill = int(rng.integers(0, 256))
        if rng.random() < 0.5:
            draw.ellipse([x, y, x + size * rng.uniform(0.5, 2.0), y + size], fill=fill)
        else:
            corners = rng.uniform(-1, 1, (int(rng.integers(3, 7)), 2)) * size + (x, y)
            draw.polygon([tuple(c) for c in corners], fill=fill)
    return (np.asarray(layer, np.float32) - 128.0) / 128.0


def encode(image: Image.Image, kind: str, path: str) -> None:
    """`image` saved as a JPEG of `kind` (see KINDS)."""
    if kind == "gray":
        image.convert("L").save(path, "JPEG", quality=QUALITY, subsampling=0)
    elif kind == "cmyk":  # Pillow writes Adobe CMYK JPEGs, as Photoshop does; unsubsampled as theirs are
        image.convert("CMYK").save(path, "JPEG", quality=QUALITY, subsampling=0)
    elif kind == "444":
        image.save(path, "JPEG", quality=QUALITY, subsampling=0)
    elif kind == "progressive":
        image.save(path, "JPEG", quality=QUALITY, subsampling=2, progressive=True)
    else:
        image.save(path, "JPEG", quality=QUALITY, subsampling=2)


def sample_path(root: str, split: str, index: int, classes: int) -> str:
    name = f"n{index % classes:04d}"
    return os.path.join(root, split, name, f"{name}_{index:06d}.JPEG")


def _link_split(root: str, split: str, count: int, classes: int, distinct: int) -> int:
    """root/split/<class>/... : `count` samples, each a hard link to a distinct file; returns
    how many had to be copied instead."""
    os.makedirs(os.path.join(root, split))
    for c in range(min(classes, count)):  # a folder for every class that has samples
        os.makedirs(os.path.join(root, split, f"n{c:04d}"))
    copies = 0
    for i in range(count):
        source, target = distinct_path(root, i % distinct), sample_path(root, split, i, classes)
        try:
            os.link(source, target)
        except OSError:  # another filesystem, no hard links there, or the file's link limit
            shutil.copyfile(source, target)
            copies += 1
    return copies


def _move_into_place(tmp: str, out: str) -> None:
    """Rename the finished tree to `out`. A stale tree of ours there is first moved into a
    temporary sibling and deleted there, so nothing else is ever deleted."""
    if os.path.lexists(out) and not _empty_dir(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
        os.rename(out, os.path.join(old, "tree"))
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)  # replaces an empty directory, as POSIX rename does


def _empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def describe(stats: dict) -> str:
    """The stats on one line."""
    kinds = ", ".join(f"{k} {n}" for k, n in stats["kinds"].items())
    kb = {k: stats[f"bytes_{k}"] / 1e3 for k in ("mean", "median", "min", "max")}
    return (
        f"{stats['distinct']} distinct JPEGs -> {stats['samples']} samples ({stats['train']} train, "
        f"{stats['val']} val, {stats['classes']} classes); KB mean {kb['mean']:.1f}, median {kb['median']:.1f}, "
        f"min {kb['min']:.1f}, max {kb['max']:.1f}; shorter side mean {stats['short_side_mean']:.0f} px; "
        f"kinds: {kinds}; {stats['seconds']:.1f} s with {stats['workers']} workers"
        + (" (made before)" if stats["reused"] else "")
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_data", description=__doc__.split("\n")[0])
    parser.add_argument("out", help="the tree to make (or find made): OUT/train, OUT/val")
    parser.add_argument("--distinct", type=int, default=2000, help="distinct JPEGs (default 2000)")
    parser.add_argument("--train", type=int, default=50000, help="train samples (default 50000)")
    parser.add_argument("--val", type=int, default=2000, help="val samples (default 2000)")
    parser.add_argument("--classes", type=int, default=100, help="classes (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the stats here")
    args = parser.parse_args(argv)
    try:
        stats = make_imagenet_like(
            args.out, distinct=args.distinct, train=args.train, val=args.val, classes=args.classes,
            seed=args.seed, workers=args.workers,
        )  # fmt: skip
    except (NotOurTree, ValueError) as e:
        parser.exit(2, f"bench.gpu_data: {e}\n")
    print(describe(stats))
    return write_json(args.json, stats)


if __name__ == "__main__":
    main()
