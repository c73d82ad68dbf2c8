"""Decode + augment in one call, from encoded JPEGs to the augmented uint8 batch (not a test).

    python -m bench.decode                          # CPU, one thread: ImageNet- and camera-size JPEGs
    python -m bench.decode --device cuda --batch-sizes 256 1024 --processes 4 8 --json decode-cuda.json  # bench/gpu.sh

The `imagenet` train preset at 224 px on photo-like JPEGs (quality 90) held in memory:
ImageNet-size (shorter side 333-500) and, with --camera, camera-size (longer side
3000-4000, fewer of them). Columns, img/s:

* decode+augment     augment.batch.decode_augment, what the augment stage runs on encoded
                     rows: on the CPU with reduced-size JPEG decoding, on a GPU with one
                     batched call per batch of the decoder the job takes there (nvImageCodec
                     where installed, else nvjpeg; the files are uploaded inside the timing);
* full-size decode   the same call with reduced-size decoding off (CPU only);
* decode only        each batched decoder's call alone: nvImageCodec's on each image's crop
                     box (nvimgcodec) and on whole images (nvimgcodec_whole), where it is
                     installed (on the CPU its libjpeg-turbo backend, with its own threads),
                     and torchvision's nvjpeg (GPU only);
* N processes        decode+augment in N processes at once on the one GPU, img/s summed
                     (--processes; the job runs 4 augment tasks per GPU);
* seed (PIL)         the seed's per image work in this process: PIL decode, then
                     RandomResizedCrop(224), flip, ColorJitter(0.2, 0.2, 0.2), ToTensor,
                     Normalize (bench.seed_train.seed_transforms), CPU only.

One torch thread on the CPU (what an augment task gets). Goal on one H200 (the issue):
>= 20,000 img/s for decode+augment at 224 px.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import queue
import time

import torch

from bench import write_json


def encoded_photos(kind: str, n: int) -> list[bytes]:
    from PIL import Image

    from bench.augment import synthetic_photo
    from bench.throughput import photo_size

    out = []
    for i in range(n):
        h, w = photo_size(kind, i)
        if kind == "camera":  # enlarge a small photo: a camera's size, generated quickly
            img = Image.fromarray(synthetic_photo(h // 8, w // 8, i)).resize((w, h), Image.BICUBIC)
        else:
            img = Image.fromarray(synthetic_photo(h, w, i))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def time_decode_augment(files, batch: int, device: torch.device, shrink: bool, seconds: float) -> float:
    from augment.batch import decode_augment
    from augment.pipeline import Pipeline
    from augment.presets import PRESETS

    pipeline = Pipeline(PRESETS["imagenet"].train, seed=0).to(device)
    keys = torch.arange(len(files), dtype=torch.int64)

    def one(i: int) -> int:
        idx = [(i * batch + j) % len(files) for j in range(batch)]
        out = decode_augment(pipeline, [files[j] for j in idx], keys[idx], 0, device, shrink=shrink).images
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return len(out)

    one(0)  # warm-up: kernels, allocator, nvjpeg handles
    start, n, i = time.perf_counter(), 0, 1
    while time.perf_counter() - start < seconds:
        n, i = n + one(i), i + 1
    return n / (time.perf_counter() - start)


def time_decode_only(
    files, batch: int, device: torch.device, seconds: float, decoder: str, refused: dict | None = None
) -> float:
    """One batched decode call alone, files uploaded inside the timing: nvjpeg
    (augment.decode.decode_cuda), nvimgcodec (augment.engines.decode_regions, each image's
    crop box as the imagenet train preset draws it) or nvimgcodec-whole (whole images). img/s
    counts the images decoded; files nvImageCodec leaves to the CPU (CMYK JPEGs, say: the job's
    CPU decoders take them) are counted in `refused` (per_call, of_files) instead of failing."""
    from augment.decode import decode_cuda, read_header
    from augment.engines import decode_regions

    headers = [read_header(f) for f in files]
    jpeg = [h[2] for h in headers]
    regions = [None] * len(files)
    if decoder == "nvimgcodec":
        from augment.pipeline import Pipeline
        from augment.presets import PRESETS

        pipe = Pipeline(PRESETS["imagenet"].train, seed=0).at_epoch(0)
        sizes = torch.tensor([h[:2] for h in headers])
        regions = pipe.request(sizes, torch.arange(len(files)), regions=True).regions.tolist()

    def one(i: int) -> int:
        idx = [(i * batch + j) % len(files) for j in range(batch)]
        if decoder == "nvjpeg":
            out = decode_cuda([files[j] for j in idx], [jpeg[j] for j in idx], device)
            done = len(out)
        else:
            picked = ([files[j] for j in idx], [jpeg[j] for j in idx], [regions[j] for j in idx])
            out = decode_regions(*picked, device)[0]
            left = sum(image is None for image in out)
            if refused is not None:
                refused.update(per_call=left, of_files=len(out))
            done = len(out) - left
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return done

    one(0)
    start, n, i = time.perf_counter(), 0, 1
    while time.perf_counter() - start < seconds:
        n, i = n + one(i), i + 1
    return n / (time.perf_counter() - start)


def _process(files, batch, device, seconds, barrier, results):
    """One of --processes: warm up, wait for the others, then time decode_augment."""
    torch.set_num_threads(1)
    time_decode_augment(files, batch, torch.device(device), True, 0.5)  # warm-up
    barrier.wait(timeout=120)  # a sibling that died in its warm-up breaks it for all
    results.put(time_decode_augment(files, batch, torch.device(device), True, seconds))


def time_processes(files, batch: int, device: str, seconds: float, processes: int) -> float:
    """decode_augment in `processes` processes at once on one device (as the job's augment
    tasks share a GPU): the sum of their img/s."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(target=_process, args=(files, batch, device, seconds, barrier, results), daemon=True)
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    rates, deadline = [], time.monotonic() + seconds + 240
    try:  # a process that fails leaves its traceback on stderr: this row fails instead of hanging
        while len(rates) < processes:
            with contextlib.suppress(queue.Empty):
                rates.append(results.get(timeout=1))
                continue
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"decode+augment in {processes} processes: a process failed or stalled")
    finally:
        for p in procs:
            if len(rates) < processes:
                p.terminate()
            p.join(timeout=10)
    return sum(rates)


def time_seed(files, seconds: float) -> float:
    from PIL import Image

    from bench.seed_train import seed_transforms

    transform = seed_transforms("imagenet", True)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        with Image.open(io.BytesIO(files[n % len(files)])) as img:
            transform(img.convert("RGB"))
        n += 1
    return n / (time.perf_counter() - start)


def column(row: dict, name: str, rate, *args) -> None:
    """row[name] = rate(*args) in img/s, rounded; where it fails, None and the reason in row["errors"]
    (said on one line): one failed column never loses the others."""
    try:
        row[name] = round(rate(*args), 1)
    except Exception as error:  # noqa: BLE001  (any failure of one column: the table goes on)
        row[name] = None
        row["errors"][name] = f"{type(error).__name__}: {error}"
        print(f"{name}: failed ({row['errors'][name]})", flush=True)


def decoders(device: torch.device) -> list[str]:
    """The batched decoders timed alone here: nvImageCodec's where it is installed (its CPU
    backend on the CPU), torchvision's nvjpeg on a GPU."""
    from augment import engines

    found = ["nvimgcodec", "nvimgcodec-whole"] if engines.available() else []
    return found + (["nvjpeg"] if device.type == "cuda" else [])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[256], help="images per decode_augment call")
    ap.add_argument("--images", type=int, default=256, help="distinct ImageNet-size JPEGs (cycled)")
    ap.add_argument("--camera", type=int, default=12, help="distinct camera-size JPEGs (0: skip that row)")
    ap.add_argument("--seconds", type=float, default=10.0, help="timing per column")
    ap.add_argument(
        "--processes",
        type=int,
        nargs="*",
        default=[],
        help="cuda: also decode+augment in N processes at once (img/s summed)",
    )
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    rows: list[dict] = []
    for kind, n in (("imagenet", args.images), ("camera", args.camera)):
        if not n:
            continue
        files = encoded_photos(kind, n)
        for batch in args.batch_sizes if kind == "imagenet" else [min(args.batch_sizes)]:
            row = {"photos": kind, "batch": batch, "device": args.device, "errors": {}}
            rows.append(row)
            column(row, "decode_augment", time_decode_augment, files, batch, device, True, args.seconds)
            for decoder in decoders(device):
                name = f"decode_only_{decoder.replace('-', '_')}"
                refused = row.setdefault("refused", {}).setdefault(name, {})
                column(row, name, time_decode_only, files, batch, device, args.seconds, decoder, refused)
            if device.type == "cuda":
                for p in args.processes if kind == "imagenet" else []:
                    name = f"decode_augment_{p}_processes"
                    column(row, name, time_processes, files, batch, args.device, args.seconds, p)
            if device.type == "cpu":
                column(row, "full_size_decode", time_decode_augment, files, batch, device, False, args.seconds)
                column(row, "seed_pil", time_seed, files, args.seconds)
            print(json.dumps(row), flush=True)
            write_json(args.json, {"torch_threads": 1, "rows": rows})  # as it goes: a later failure loses nothing
    return rows


if __name__ == "__main__":
    main()
