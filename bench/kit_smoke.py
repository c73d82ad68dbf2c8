"""The GPU kit's decisive checks (bench/gpu_kit.py's `smoke` step; `bash bench/gpu.sh --smoke` runs
them with env and a 20-step jobs.train, and stops): one process, smoke.json written after each.

    python -m bench.kit_smoke --scratch DIR --data SMOKE_TREE [--rehearse]

* fused    the fused kernel compiled for the device (Triton's interpreter on a CPU) against the
           CPU's torch path on the same draws, at three source sizes (SIZES; the device's include
           a 4000x3000 photo): the largest difference in levels, at most 1;
* decode   nvImageCodec's batched call on the smoke tree's JPEGs: how many it decoded, where,
           and how many it left to the CPU (CMYK and kin: counted, not an error); on a GPU none
           on the hardware JPEG engines is an error (a libnvjpeg that did not load), and the
           ordering test runs (tests/gpu_ordering.py, the stream-ordered allocator).

A check that fails is recorded in "errors" (the kit then reads the step as partial and stops);
one that cannot run here is recorded as {"skipped": why}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (h, w) of the sources the fused kernel is checked at, SIDE px out. The CPU's interpreter pays per
# tap and per block: today's kernel takes about a minute there for a 4000x3000 photo to 224 px, so
# the rehearsal checks smaller ones with the same code.
SIZES = {"cuda": ((375, 500), (1080, 1440), (3000, 4000)), "cpu": ((48, 64), (120, 160), (240, 320))}
PER_SIZE = {"cuda": 4, "cpu": 1}
SIDE = {"cuda": 224, "cpu": 64}  # the output's side: the interpreter on the CPU runs one block of 64 x 64
ORDERING_ITERATIONS = 50


def photo(h: int, w: int, seed: int):
    """A smooth photo-like uint8 (h, w, 3) array, made quickly at any size (bench.augment's
    synthetic photo at an eighth, enlarged)."""
    import numpy as np
    import torch

    from bench.augment import synthetic_photo

    small = torch.from_numpy(synthetic_photo(max(h // 8, 8), max(w // 8, 8), seed)).permute(2, 0, 1)[None].float()
    big = torch.nn.functional.interpolate(small, size=(h, w), mode="bilinear", align_corners=False)
    return np.ascontiguousarray(big[0].permute(1, 2, 0).round().clamp(0, 255).byte().numpy())


def fused_check(device) -> dict:
    """The largest level difference between the fused kernel on `device` and the CPU's path, per size."""
    import torch

    from augment import fused
    from augment.pipeline import Pipeline
    from augment.presets import PRESETS

    if not fused.available(device):
        return {"skipped": f"the fused kernel does not run on {device} here (Triton missing, or no interpreter)"}
    out = {}
    for h, w in SIZES[device.type]:
        n = PER_SIZE[device.type]
        images = [photo(h, w, i) for i in range(n)]
        sizes, keys = torch.tensor([[h, w]] * n), torch.arange(n) * 7919
        specs = PRESETS["imagenet"].at_size(SIDE[device.type]).train
        cpu_pipe = Pipeline(specs, seed=5).at_epoch(1)
        dev_pipe = Pipeline(specs, seed=5).to(device).at_epoch(1)
        start = time.perf_counter()
        expected = cpu_pipe.finish(cpu_pipe.request(sizes, keys), images, path="ragged")
        on_dev = [torch.from_numpy(im).to(device) for im in images]
        got = dev_pipe.finish(dev_pipe.request(sizes.to(device), keys.to(device)), on_dev, path="fused")
        diff = int((got.cpu().int() - expected.int()).abs().max())
        out[f"{w}x{h}"] = {"images": n, "max_level_diff": diff, "seconds": round(time.perf_counter() - start, 2)}
    return out


def smoke_files(data: str, count: int = 64) -> list[bytes]:
    from bench.kit_steps import distinct_files

    return distinct_files(data, count)


def decode_check(files: list[bytes], device) -> dict:
    """nvImageCodec's batched call on `files`: decoded, where, and refused (left to the CPU)."""
    from augment import engines
    from augment.decode import DECODE_PLACES, read_header

    if not engines.available():
        return {"skipped": "nvImageCodec is not installed"}
    jpeg = [read_header(f)[2] for f in files]
    start = time.perf_counter()
    images, _, where = engines.decode_regions(files, jpeg, [None] * len(files), device)
    refused = sum(image is None for image in images)
    decoded_on = {p: sum(1 for i, w in enumerate(where) if w == k and images[i] is not None)
                  for k, p in enumerate(DECODE_PLACES)}  # fmt: skip
    return {
        "files": len(files),
        "decoded": len(files) - refused,
        "refused": refused,
        "decoded_on": decoded_on,
        "seconds": round(time.perf_counter() - start, 2),
    }


def ordering_check(device) -> dict:
    """tests/gpu_ordering.py through nvImageCodec with the stream-ordered allocator."""
    if device.type != "cuda":
        return {"skipped": "no CUDA: the ordering test needs a GPU's streams"}
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    args = [sys.executable, "-m", "tests.gpu_ordering", "nvimgcodec", "--iterations", str(ORDERING_ITERATIONS)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"tests.gpu_ordering exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def judge(result: dict) -> list[str]:
    """The failures among the checks' results."""
    errors = []
    for size, row in (result.get("fused") or {}).items():
        if isinstance(row, dict) and row.get("max_level_diff", 0) > 1:
            errors.append(f"fused kernel at {size}: {row['max_level_diff']} levels from the CPU's pixels")
    decode = result.get("decode") or {}
    if decode.get("files") and decode["decoded"] < 0.9 * decode["files"]:
        errors.append(f"nvImageCodec decoded {decode['decoded']} of {decode['files']} files")
    if result.get("device") == "cuda" and decode.get("files") and not decode["decoded_on"].get("engines"):
        # a libnvjpeg that does not load leaves nvImageCodec to its other decoders without a word
        errors.append(f"nvImageCodec decoded none on the hardware JPEG engines: {decode['decoded_on']}")
    corrupted = (result.get("ordering") or {}).get("corrupted") or {}
    if any(corrupted.values()):
        errors.append(f"ordering: {corrupted}")
    return errors


def run(scratch: str, data: str, device_name: str) -> int:
    import torch

    from bench import write_json

    device = torch.device(device_name)
    path, result = os.path.join(scratch, "smoke.json"), {"device": device_name, "errors": {}}
    checks = (
        ("fused", lambda: fused_check(device)),
        ("decode", lambda: decode_check(smoke_files(data), device)),
        ("ordering", lambda: ordering_check(device)),
    )
    for name, check in checks:
        try:
            result[name] = check()
        except Exception as error:  # noqa: BLE001  (recorded; the kit stops after this step)
            result[name] = None
            result["errors"][name] = f"{type(error).__name__}: {error}"
        write_json(path, result)
        print(f"{name}: {json.dumps(result[name])}", flush=True)
    result["errors"] |= {f"check {i}": e for i, e in enumerate(judge(result))}
    write_json(path, result)
    print(json.dumps(result), flush=True)
    return 1 if result["errors"] else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kit_smoke", description=__doc__.split("\n")[0])
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--data", required=True, help="the smoke tree (bench/gpu_data.py)")
    ap.add_argument("--rehearse", action="store_true", help="on the CPU, Triton's interpreter for the kernel")
    args = ap.parse_args(argv)
    return run(args.scratch, args.data, "cpu" if args.rehearse else "cuda")


if __name__ == "__main__":
    sys.exit(main())
