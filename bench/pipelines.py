"""Augment-stage throughput against the seed's pipelines as the seed runs them (not a test).

    python -m bench.pipelines                          # CPU, both presets, ~2 minutes
    python -m bench.pipelines --json pipelines.json
    python -m bench.pipelines --device cuda --batch-sizes 1024 4096      # bench/gpu.sh

Per preset (train split), on the same decoded photos (bench.augment.photos: mixed-size
synthetic photos for `imagenet`, 32x32 for `cifar`), every column ends in the normalised
float batch the model takes, img/s:

* stage 1t / stage Nt  this project's augment stage (bench.augment.time_stage: augment_batch
                       + the trainer's Normalize) with 1 torch thread (what an augment actor
                       gets) and with every core;
* stage Np             the stage as Ray Data runs it on CPUs: N processes of 1 thread side by
                       side (one per augment task or actor; N = the DataLoader's workers),
                       started together after a barrier, their rates summed;
* tv PIL               the seed's per-image PIL torchvision pipeline in this process
                       (bench.augment.time_torchvision), no workers;
* tv DataLoader        the same pipeline in a DataLoader with the seeds' worker count
                       (capped to the cores), batch 64, timed from the iterator's creation
                       (worker start-up included, as in every epoch of the seed's script);
* tv v2 batch          torchvision.transforms.v2 on uint8 tensors: one call per batch for
                       crop (cifar), flip, jitter, dtype and normalise. v2 draws ONE set of
                       random parameters per call, so a whole batch shares its crop, flip and
                       jitter: cheaper and weaker augmentation than the others. For
                       `imagenet` the photos differ in size, so RandomResizedCrop runs per
                       image (v2, on tensors) before the batched rest.

`ratio` = stage Np / tv DataLoader: the same number of processes on the same cores (the
issue's target: >= 1.0 on the 2-core CPU). `1t ratio` = stage 1t / tv DataLoader, one core
against all of them.
On a GPU (`--device cuda`) the stage and v2 run on the device (the photos are uploaded per
batch, inside the timing); the PIL and DataLoader columns are CPU-only by nature.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from bench.augment import photos, time_stage, time_torchvision
from bench.seed_train import CIFAR_MEAN, CIFAR_STD, IMAGENET_MEAN, IMAGENET_STD, seed_num_workers, seed_transforms


class _PilImages(torch.utils.data.Dataset):
    def __init__(self, images: list, total: int, transform):
        from PIL import Image

        self.pil = [Image.fromarray(a) for a in images]
        self.total, self.transform = total, transform

    def __len__(self):
        return self.total

    def __getitem__(self, i):
        return self.transform(self.pil[i % len(self.pil)]), 0


def time_dataloader(
    preset: str, images: list[np.ndarray], total: int, workers: int, batch: int = 64, repeat: int = 1
) -> float:
    """img/s of the seed's per-image pipeline in DataLoader(num_workers=workers), one epoch
    from the creation of the iterator (worker start-up included) to the last batch."""
    loader = torch.utils.data.DataLoader(
        _PilImages(images, total, seed_transforms(preset, True)), batch_size=batch, shuffle=True, num_workers=workers
    )
    best = 0.0
    for _ in range(repeat):
        start, n = time.perf_counter(), 0
        for x, _ in loader:
            n += x.shape[0]
        best = max(best, n / (time.perf_counter() - start))
    return best


def _stage_process(preset: str, batch: int, n: int, repeat: int, barrier, results) -> None:
    torch.set_num_threads(1)
    images = photos(preset, 96)
    from augment.presets import PRESETS  # noqa: F401  (imports done before the barrier)

    barrier.wait()
    results.put(time_stage(preset, True, images, batch, n, "cpu", repeat)[1])


def time_stage_processes(preset: str, batch: int, n: int, procs: int, repeat: int) -> float:
    """Summed img/s of `procs` processes of 1 thread each running the stage at once."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # not fork: this process has already run torch's thread pools
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(target=_stage_process, args=(preset, batch, n, repeat, barrier, results)) for _ in range(procs)
    ]
    for w in workers:
        w.start()
    rates = [results.get(timeout=600) for _ in workers]
    for w in workers:
        w.join()
    return sum(rates)


def v2_pipeline(preset: str):
    """(per-image head or None, batched tail): torchvision v2 ops on uint8 CHW tensors."""
    import torchvision.transforms.v2 as v2

    mean, std = (CIFAR_MEAN, CIFAR_STD) if preset == "cifar" else (IMAGENET_MEAN, IMAGENET_STD)
    tail = [
        v2.RandomHorizontalFlip(),
        v2.ColorJitter(0.2, 0.2, 0.2),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean, std),
    ]
    if preset == "cifar":
        return None, v2.Compose([v2.RandomCrop(32, padding=4)] + tail)
    return v2.RandomResizedCrop(224, antialias=True), v2.Compose(tail)


def time_v2_batched(
    preset: str, images: list[np.ndarray], total: int, batch: int, device: str, repeat: int = 1
) -> float:
    head, tail = v2_pipeline(preset)
    tensors = [torch.from_numpy(a).permute(2, 0, 1).contiguous() for a in images]  # uint8 (3,H,W)
    dev = torch.device(device)

    def one(start: int) -> torch.Tensor:
        chunk = [tensors[(start + i) % len(tensors)] for i in range(batch)]
        if head is None:  # same-size images: one upload, one call for the batch
            return tail(torch.stack(chunk).to(dev, non_blocking=True))
        return tail(torch.stack([head(t.to(dev, non_blocking=True)) for t in chunk]))

    one(0)  # warm-up
    best = 0.0
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for s in range(0, total, batch):
            out = one(s)
        if device == "cuda":
            torch.cuda.synchronize()
        best = max(best, (total // batch) * batch / (time.perf_counter() - start))
    assert out.dtype == torch.float32
    return best


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m bench.pipelines", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--presets", nargs="+", default=["imagenet", "cifar"], help="built-in presets to time (train split)"
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the stage and v2 run")
    ap.add_argument(
        "--batch-sizes", nargs="+", type=int, default=[256], help="stage and v2 batch sizes (images per call)"
    )
    ap.add_argument(
        "--images",
        type=int,
        default=0,
        help="images per measurement; 0 = 512 for imagenet, 4096 for cifar (x16 on a GPU)",
    )
    ap.add_argument("--repeat", type=int, default=2, help="passes per measurement; the fastest counts")
    ap.add_argument(
        "--loader-workers", type=int, default=0, help="DataLoader workers; 0 = the seeds' advice capped to the cores"
    )
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    workers = args.loader_workers or seed_num_workers(cores)
    rows = []
    print(
        f"torch {torch.__version__}, {cores} cores, device {args.device}, DataLoader workers {workers}; img/s "
        "(train split), higher is better"
    )
    print(
        f"{'preset':<9} {'batch':>6} {'stage 1t':>9} {f'stage {cores}t':>9} {f'stage {workers}p':>9} {'tv PIL':>8} "
        f"{'tv DataLoader':>14} {'tv v2 batch':>12} {'ratio':>6} {'1t ratio':>9}"
    )
    for preset in args.presets:
        images = photos(preset, 96)
        total = args.images or (512 if preset == "imagenet" else 4096) * (16 if args.device == "cuda" else 1)
        torch.set_num_threads(1)
        pil = time_torchvision(preset, True, images, min(total, 2048), args.repeat)
        loader = time_dataloader(preset, images, min(total, 8192), workers, repeat=args.repeat)
        for batch in args.batch_sizes:
            n = max(batch, total // batch * batch)
            torch.set_num_threads(1)
            stage1 = time_stage(preset, True, images, batch, n, args.device, args.repeat)[1]
            v2 = time_v2_batched(preset, images, n, batch, args.device, args.repeat)
            torch.set_num_threads(cores)
            stage_n = (
                time_stage(preset, True, images, batch, n, args.device, args.repeat)[1]
                if args.device == "cpu"
                else stage1
            )
            stage_p = time_stage_processes(preset, batch, n, workers, args.repeat) if args.device == "cpu" else stage1
            row = {
                "preset": preset,
                "device": args.device,
                "batch": batch,
                "images": n,
                "stage_1t_img_s": round(stage1, 1),
                f"stage_{cores}t_img_s": round(stage_n, 1),
                f"stage_{workers}p_img_s": round(stage_p, 1),
                "tv_pil_img_s": round(pil, 1),
                "tv_dataloader_img_s": round(loader, 1),
                "tv_v2_batch_img_s": round(v2, 1),
                "loader_workers": workers,
                "ratio_stage_over_dataloader": round(stage_p / loader, 2),
                "ratio_stage_1t_over_dataloader": round(stage1 / loader, 2),
            }
            rows.append(row)
            print(
                f"{preset:<9} {batch:>6} {stage1:>9.0f} {stage_n:>9.0f} {stage_p:>9.0f} {pil:>8.0f} {loader:>14.0f} "
                f"{v2:>12.0f} "
                f"{stage_p / loader:>5.2f}x {stage1 / loader:>8.2f}x",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "cores": cores,
                    "device": args.device,
                    "load_avg": os.getloadavg(),
                    "rows": rows,
                },
                f,
                indent=2,
            )
    return rows


if __name__ == "__main__":
    main()
