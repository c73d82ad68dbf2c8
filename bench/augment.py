"""Augment-stage throughput against the seed's torchvision per-image PIL pipeline.

    python -m bench.augment                         # CPU, 1 thread, both presets, ~1.5 minutes
    python -m bench.augment --threads 2 --json out.json
    make bench ARGS="--images 2048 --batch-sizes 256 1024"

Both sides get the same decoded photos (smooth synthetic photos of mixed sizes, 300x400,
375x500, 500x333, ... for `imagenet`; 32x32 for `cifar`) and produce the same thing: a
normalised float batch for the model.

* this stage: ragged uint8 arrays -> `augment_batch` (the actor's work) -> Normalize (the
  trainer's), whole batches;
* torchvision: per image, PIL transforms.Compose([...ToTensor(), Normalize()]) in the
  same process, then torch.stack: the seed's DataLoader work without the worker processes.

`stage` is the augment actor's work (uint8 out); `stage+norm` adds the trainer's Normalize,
so that it and torchvision's column both end in the float batch the model takes; `ratio` is
stage+norm over torchvision. One thread by default: an augment actor gets one CPU
(`--threads` to change). On a machine with CUDA the stage is also timed on the GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

PHOTO_SIZES = [(300, 400), (375, 500), (500, 333), (333, 500), (400, 300), (427, 640)]


def synthetic_photo(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth, photo-like uint8 RGB image: low-frequency colour waves, a gradient, an
    ellipse and mild noise. Smooth matters: resampling errors hide in pure noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    img = np.zeros((h, w, 3))
    for c in range(3):
        for _ in range(3):
            fy, fx, ph = rng.uniform(0.5, 4), rng.uniform(0.5, 4), rng.uniform(0, 2 * np.pi)
            img[..., c] += rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * (fy * yy + fx * xx) + ph)
        img[..., c] += rng.uniform(-0.3, 0.3) * (yy - 0.5) + 0.5
    cy, cx, ry, rx = rng.uniform(0.3, 0.7), rng.uniform(0.3, 0.7), rng.uniform(0.1, 0.3), rng.uniform(0.1, 0.3)
    inside = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
    img[inside] = img[inside] * 0.5 + rng.uniform(0, 1, 3) * 0.5
    img += rng.normal(0, 0.01, img.shape)
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


def generate_tree(out: str, count: int, write, *, classes=10, ext="jpg", names=(2, 6), chunksize=16) -> str:
    """OUT/class<k>/<i>.<ext>: `count` images in `classes` classes, each written by
    `write((path, i))` in a process pool (so a module-level function, or a partial of one);
    nothing is written again once OUT/.complete exists. `names`: the digits of the class and
    file numbers."""
    import os
    from multiprocessing import Pool

    done = os.path.join(out, ".complete")
    if os.path.exists(done):
        return out
    jobs = []
    for i in range(count):
        folder = os.path.join(out, f"class{i % classes:0{names[0]}d}")
        os.makedirs(folder, exist_ok=True)
        jobs.append((os.path.join(folder, f"{i:0{names[1]}d}.{ext}"), i))
    with Pool() as pool:
        pool.map(write, jobs, chunksize=chunksize)
    open(done, "w").close()
    return out


def torchvision_pipeline(preset: str, train: bool):
    """The seed's per-image pipelines (torchvision's CIFAR recipe and classification reference)."""
    import torchvision.transforms as T

    from augment.presets import PRESETS

    p = PRESETS[preset]
    tail = [T.ToTensor(), T.Normalize(p.mean, p.std)]
    if preset == "cifar":
        head = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ColorJitter(0.2, 0.2, 0.2)] if train else []
    else:
        head = (
            [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ColorJitter(0.2, 0.2, 0.2)]
            if train
            else [T.Resize(256), T.CenterCrop(224)]
        )
    return T.Compose(head + tail)


def photos(preset: str, n: int) -> list[np.ndarray]:
    if preset == "cifar":
        return [synthetic_photo(32, 32, i) for i in range(n)]
    return [synthetic_photo(*PHOTO_SIZES[i % len(PHOTO_SIZES)], i) for i in range(n)]


def _ragged(arrays: list[np.ndarray]) -> np.ndarray:
    out = np.empty(len(arrays), dtype=object)
    out[:] = arrays
    return out


def time_stage(
    preset: str, train: bool, images: list[np.ndarray], batch: int, total: int, device: str, repeat: int = 1
) -> tuple[float, float]:
    """img/s over `total` images in batches of `batch`: (augment_batch alone, the actor's work
    with uint8 out; augment_batch + Normalize, the float batch the model gets)."""
    from augment.batch import augment_batch
    from augment.ops import Normalize
    from augment.pipeline import Pipeline
    from augment.presets import PRESETS

    p = PRESETS[preset]
    pipe = Pipeline(p.train if train else p.eval, seed=0).to(device)
    norm = Normalize(p.mean, p.std).to(device)
    batches = [_ragged([images[(s + i) % len(images)] for i in range(batch)]) for s in range(0, total, batch)]
    keys = torch.arange(batch, dtype=torch.int64)
    rates = []
    for normalize in (False, True):

        def one(b, step, normalize=normalize):
            out = augment_batch(pipe, b, keys + step * batch, 0, torch.device(device))
            return norm(out) if normalize else out

        one(batches[0], 0)  # warm-up: first-call allocations, Kornia's lazy imports, CUDA context
        if device == "cuda":
            torch.cuda.synchronize()
        best = 0.0
        for _ in range(repeat):  # best of `repeat`: other processes only ever slow a pass down
            start = time.perf_counter()
            for step, b in enumerate(batches):
                out = one(b, step)
            if device == "cuda":
                torch.cuda.synchronize()
            assert out.shape[0] == batch
            best = max(best, len(batches) * batch / (time.perf_counter() - start))
        rates.append(best)
    return rates[0], rates[1]


def time_torchvision(preset: str, train: bool, images: list[np.ndarray], total: int, repeat: int = 1) -> float:
    from PIL import Image

    tf = torchvision_pipeline(preset, train)
    pil = [Image.fromarray(a) for a in images]
    torch.manual_seed(0)
    torch.stack([tf(pil[i % len(pil)]) for i in range(8)])  # warm-up
    best = 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        out = torch.stack([tf(pil[i % len(pil)]) for i in range(total)])
        assert out.shape[0] == total
        best = max(best, total / (time.perf_counter() - start))
    return best


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m bench.augment", description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["imagenet", "cifar"], help="built-in presets to time")
    ap.add_argument(
        "--batch-sizes", nargs="+", type=int, default=[64, 256, 1024], help="augment batch sizes (images per call)"
    )
    ap.add_argument(
        "--images",
        type=int,
        default=512,
        help="images timed per measurement (at least one batch); more = steadier, slower",
    )
    ap.add_argument("--repeat", type=int, default=2, help="passes per measurement; the fastest counts (default: 2)")
    ap.add_argument("--photos", type=int, default=96, help="distinct photos generated and cycled through")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads on the CPU (an augment actor has 1 CPU)"
    )
    ap.add_argument("--no-gpu", action="store_true", help="skip the CUDA rows even when a GPU is present")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and not args.no_gpu else [])

    rows = []
    print(
        f"torch {torch.__version__}, {args.threads} CPU thread(s), {platform.processor() or platform.machine()}; "
        "img/s, higher is better"
    )
    print(
        f"{'preset':<9} {'split':<5} {'batch':>5} {'device':<6} {'stage':>8} {'stage+norm':>11} "
        f"{'torchvision PIL':>16} {'ratio':>6}"
    )
    for preset in args.presets:
        images = photos(preset, args.photos)
        for train in (True, False):
            tv = time_torchvision(preset, train, images, args.images, args.repeat)
            for device in devices:
                for batch in args.batch_sizes:
                    total = max(batch, args.images // batch * batch)
                    stage, ours = time_stage(preset, train, images, batch, total, device, args.repeat)
                    row = {
                        "preset": preset,
                        "split": "train" if train else "eval",
                        "batch": batch,
                        "device": device,
                        "stage_img_s": round(stage, 1),
                        "stage_normalize_img_s": round(ours, 1),
                        "torchvision_pil_img_s": round(tv, 1),
                        "ratio": round(ours / tv, 2),
                        "threads": args.threads,
                        "images": total,
                    }
                    rows.append(row)
                    print(
                        f"{preset:<9} {row['split']:<5} {batch:>5} {device:<6} {stage:>8.0f} {ours:>11.0f} "
                        f"{tv:>16.0f} {ours / tv:>5.1f}x",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": args.threads, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
