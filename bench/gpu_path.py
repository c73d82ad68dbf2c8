"""Decode + augment through the GPU's code path, counting what a batch dispatches (not a test).

    python -m bench.gpu_path                               # on whatever device there is
    python -m bench.gpu_path --batch-sizes 256 1024 --json gpu-path.json

`augment.batch.decode_augment` with a batched decoder (`--decoders`: nvimgcodec, one
nvImageCodec call for the batch's JPEGs, each decoding only its crop region, where the
package is installed, else nvjpeg, one torchvision.io.decode_jpeg call; nvimgcodec-whole,
nvImageCodec on whole images), then
augment/ragged.py's resampler over one flat buffer, then the preset's other ops on the
(B, 3, S, S) batch; the
`imagenet` train preset at 224 px, on ImageNet-size JPEGs (shorter side 333-500, quality
90) held in memory. On a machine without CUDA the same Python and torch calls run on the
CPU.

A `TorchDispatchMode` counts the torch operations one batch dispatches, in three kinds:

* ops        every operation that computes or copies: on a GPU each launches kernels;
* views      operations that only make a view (reshape, slice, permute): no kernel;
* decoder    torchvision's decode calls: on a GPU one for the batch; on the CPU
             torchvision loops over the images inside it, so there it counts one per image.
             nvImageCodec's call is not a torch operation: 0 for it.

Target (the GPU stage's issue): the same `ops` for a batch of 256 and of 1,024, that is,
nothing launched per image. Columns: ops, views, decoder per batch size, and img/s over
`--seconds` of repeated batches (on the CPU, one torch thread: a slow path there, since the
CPU's own path resamples per image; see docs/design.md). `--paths ragged canvas` also runs
the path as it was before augment/ragged.py (the batch copied into a padded canvas, the
matmul resampler), side by side.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from augment import engines
from augment.batch import decode_augment
from augment.pipeline import Pipeline
from augment.presets import PRESETS
from bench import write_json
from bench.decode import encoded_photos


class OpCounter(TorchDispatchMode):
    """Counts dispatched torch operations by kind (see the module's docstring)."""

    def __init__(self):
        super().__init__()
        self.kinds: collections.Counter = collections.Counter()
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace
        kind = "decoder" if namespace == "image" else "views" if func.is_view else "ops"
        self.kinds[kind] += 1
        self.names[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def one_batch(pipeline: Pipeline, files: list[bytes], device, epoch: int, decoder: str, ragged: bool) -> torch.Tensor:
    keys = torch.arange(len(files), dtype=torch.int64) * 7919 + epoch
    out, kept, bad, _ = decode_augment(
        pipeline, files, keys, epoch, device, shrink=False, decoder=decoder, ragged=ragged
    )
    if bad or len(kept) != len(files):
        raise RuntimeError(f"bench: {len(bad)} of the generated files did not decode: {bad[:3]}")
    return out


def count(pipeline: Pipeline, files: list[bytes], device, decoder: str, ragged: bool) -> OpCounter:
    one_batch(pipeline, files, device, 0, decoder, ragged)  # warm-up: lazy imports, the allocator
    with OpCounter() as counter:
        one_batch(pipeline, files, device, 1, decoder, ragged)
    return counter


def images_per_s(pipeline: Pipeline, files: list[bytes], device, seconds: float, decoder: str, ragged: bool) -> float:
    start, n, epoch = time.perf_counter(), 0, 2
    while time.perf_counter() - start < seconds or n == 0:
        one_batch(pipeline, files, device, epoch, decoder, ragged)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        n, epoch = n + len(files), epoch + 1
    return n / (time.perf_counter() - start)


def measure(pipeline, distinct, device, batch_sizes, seconds: float, decoder: str, path: str) -> dict:
    """One decoder and path's counts and img/s for each batch size, printed as they come."""
    figures = {"ops_per_batch": {}, "views_per_batch": {}, "decoder_calls_per_batch": {}, "images_per_s": {}}
    for batch in batch_sizes:
        files = [distinct[i % len(distinct)] for i in range(batch)]
        kinds = count(pipeline, files, device, decoder, path == "ragged").kinds
        rate = images_per_s(pipeline, files, device, seconds, decoder, path == "ragged")
        for name, value in (
            ("ops_per_batch", kinds["ops"]),
            ("views_per_batch", kinds["views"]),
            ("decoder_calls_per_batch", kinds["decoder"]),
            ("images_per_s", round(rate, 1)),
        ):
            figures[name][str(batch)] = value
        counts = f"{kinds['ops']:>6} {kinds['views']:>6} {kinds['decoder']:>8}"
        print(f"{decoder:<11} {path:<7} {batch:>6} {counts} {rate:>9.1f}")
    figures["nothing_per_image"] = len(set(figures["ops_per_batch"].values())) == 1
    return figures


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_path", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--images", type=int, default=256, help="distinct JPEGs, cycled to fill a batch")
    ap.add_argument("--seconds", type=float, default=10.0, help="timing per batch size")
    ap.add_argument(
        "--paths", nargs="+", default=["ragged"], choices=("ragged", "canvas"), help="canvas: the padded batch before"
    )
    ap.add_argument(
        "--decoders",
        nargs="+",
        choices=("nvimgcodec", "nvimgcodec-whole", "nvjpeg"),
        default=["nvimgcodec" if engines.available() else "nvjpeg"],
        help="the batched decoders to run (default: the one the job takes on a GPU here)",
    )
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    distinct = encoded_photos("imagenet", args.images)
    pipeline = Pipeline(PRESETS["imagenet"].train, seed=0).to(device)
    result = {"device": str(device), "preset": "imagenet", "torch_threads": 1, "decoder": args.decoders[0]}
    print(f"{'decoder':<11} {'path':<7} {'batch':>6} {'ops':>6} {'views':>6} {'decoder':>8} {'img/s':>9}")
    for decoder in args.decoders:
        for path in args.paths:
            figures = measure(pipeline, distinct, device, args.batch_sizes, args.seconds, decoder, path)
            top = decoder == args.decoders[0] and path == "ragged"
            result |= figures if top else {f"{decoder}_{path}": figures}  # the job's path at the top level
    if "ragged" in args.paths:
        print(f"{args.decoders[0]} ragged: ops per batch the same for every batch size: {result['nothing_per_image']}")
    return write_json(args.json, result)


if __name__ == "__main__":
    main()
