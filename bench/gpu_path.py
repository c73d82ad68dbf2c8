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

Under TRITON_INTERPRET=1, `loads_per_output_pixel`: the fused kernel's loads, and its
predecessor's, counted through the interpreter (bench/kernel_loads.py).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from augment import engines, fused
from augment.batch import decode_augment
from augment.decode import BadImage, decode_cuda, read_header
from augment.pipeline import Pipeline, to_canvas
from augment.presets import PRESETS
from bench import kernel_loads, write_json
from bench.decode import encoded_photos


class OpCounter(TorchDispatchMode):
    """Counts dispatched torch operations by kind (see the module's docstring), and the bytes the
    operations that are not views read and write: the tensors they are given (in lists too) and
    return, and the fused op's scratch (its own row of `bytes`). `run_kernel=False` leaves the
    fused kernel's launch out and returns its output's shape unfilled: its bytes are the same,
    and Triton's interpreter on a CPU takes minutes for a batch of 1,024 photos."""

    def __init__(self, run_kernel: bool = True):
        super().__init__()
        self.kinds: collections.Counter = collections.Counter()
        self.names: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()  # operation -> bytes read and written
        self.run_kernel = run_kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace
        kind = "decoder" if namespace == "image" else "views" if func.is_view else "ops"
        self.kinds[kind] += 1
        self.names[str(func.overloadpacket)] += 1
        kwargs = kwargs or {}
        if str(func.overloadpacket) == "rga.augment_first_ops" and not self.run_kernel:
            out = output_like(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if kind != "views" and str(func.overloadpacket) not in ALLOCATIONS:
            given = {k: v for k, v in kwargs.items() if k != "out"}  # an out= tensor is the output, counted once
            self.bytes[str(func.overloadpacket)] += tensor_bytes(args) + tensor_bytes(given) + tensor_bytes(out)
        if str(func.overloadpacket) == "rga.augment_first_ops":
            self.bytes["rga.augment_first_ops scratch"] += fused_scratch_bytes(*args, **kwargs)
        return out

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def fused_scratch_bytes(images, meta, factors, out_h, out_w, fill, float_out) -> int:
    """What the fused op's two launches write to their scratch and read back, beyond its inputs
    and output (augment/fused_kernel.py scratch_bytes)."""
    from augment import fused_kernel

    return fused_kernel.scratch_bytes(factors, out_h, out_w, float_out)


def output_like(images, meta, factors, out_h, out_w, fill, float_out):
    """augment/fused.py's augment_first_ops output, unfilled: its shape, dtype and strides (the
    byte count without the launch)."""
    out = meta.new_empty((len(images), out_h, out_w, 3), dtype=torch.float32 if float_out else torch.uint8)
    return out.permute(0, 3, 1, 2) if float_out else out


ALLOCATIONS = ("aten.empty", "aten.empty_like", "aten.new_empty", "aten.empty_strided")  # no byte moved


def trainer_bytes(batch: int, side: int, amp: str) -> dict:
    """The bytes a trainer's step moves per image before the model: the batch's copy to the device
    (a clone here, the same bytes), Normalize into the step's dtype, the view digest
    (training/worker/learner.py Learner.train_step, loop.py EpochMeter.update), by operation."""
    from augment.ops import Normalize
    from augment.presets import IMAGENET_MEAN, IMAGENET_STD
    from training.worker.loop import view_digest

    host = torch.randint(0, 256, (batch, side, side, 3), dtype=torch.uint8)
    keys = torch.arange(batch, dtype=torch.int64)
    normalize = Normalize(IMAGENET_MEAN, IMAGENET_STD)
    dtype = {"off": torch.float32, "bf16": torch.bfloat16}[amp]
    with OpCounter() as counter:
        on_device = host.clone()
        normalize(on_device, dtype)
        view_digest(on_device, keys)
    return {"bytes_per_image": round(counter.total_bytes / batch), "ops": counter.kinds["ops"]} | {
        name: round(n / batch) for name, n in counter.bytes.most_common()
    }


def tensor_bytes(value) -> int:
    """The bytes of every tensor in `value` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def one_batch(pipeline: Pipeline, files: list[bytes], device, epoch: int, decoder: str, path: str) -> torch.Tensor:
    keys = torch.arange(len(files), dtype=torch.int64) * 7919 + epoch
    if decoder == "nvimgcodec-whole" or path == "canvas":
        return earlier_batch(pipeline, files, keys, epoch, device, decoder, path)
    out, kept, bad, _ = decode_augment(pipeline, files, keys, epoch, device, shrink=False, decoder=decoder, path=path)
    if bad or len(kept) != len(files):
        raise RuntimeError(f"bench: {len(bad)} of the generated files did not decode: {bad[:3]}")
    return out


def earlier_batch(pipeline: Pipeline, files: list[bytes], keys, epoch: int, device, decoder: str, path: str):
    """The ways of earlier versions, kept here to compare with the job's: nvImageCodec on whole
    images (`nvimgcodec-whole`) and the padded canvas before augment/ragged.py (`canvas`: the
    batch copied into one (B, Hmax, Wmax, 3) tensor, the matmul resampler). The generated files
    all decode at their headers' sizes, so the draws need no fitting to what was decoded."""
    pipe = pipeline.at_epoch(epoch)
    headers = [read_header(f) for f in files]
    sizes = torch.tensor([h[:2] for h in headers], dtype=torch.int64, device=device)
    jpeg = [h[2] for h in headers]
    request = pipe.request(sizes, keys.to(device))
    if decoder == "nvimgcodec-whole":
        images, _, _ = engines.decode_regions(files, jpeg, None, device)
    else:  # nvjpeg's (3, H, W) tensors as (H, W, 3) views
        decoded = decode_cuda(files, jpeg, device)
        images = [im.permute(1, 2, 0) if isinstance(im, torch.Tensor) else im for im in decoded]
    if any(im is None or isinstance(im, BadImage) for im in images):
        raise RuntimeError("bench: a generated file did not decode")
    if path != "canvas":
        return pipe.finish(request, images, path=path)
    canvas, _ = to_canvas(images)
    return pipe.apply(canvas.to(device), sizes, request.draws)


def count(pipeline: Pipeline, files: list[bytes], device, decoder: str, path: str, run_kernel: bool) -> OpCounter:
    with OpCounter(run_kernel):  # warm-up: lazy imports, the allocator
        one_batch(pipeline, files, device, 0, decoder, path)
    with OpCounter(run_kernel) as counter:
        one_batch(pipeline, files, device, 1, decoder, path)
    return counter


def images_per_s(pipeline: Pipeline, files: list[bytes], device, seconds: float, decoder: str, path: str) -> float:
    start, n, epoch = time.perf_counter(), 0, 2
    while time.perf_counter() - start < seconds or n == 0:
        one_batch(pipeline, files, device, epoch, decoder, path)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        n, epoch = n + len(files), epoch + 1
    return n / (time.perf_counter() - start)


FIGURES = ("ops_per_batch", "views_per_batch", "decoder_calls_per_batch", "bytes_per_image", "images_per_s")


def measure(pipeline, distinct, device, batch_sizes, seconds: float, decoder: str, path: str) -> dict:
    """One decoder and path's counts, bytes and img/s for each batch size, printed as they come.
    The fused kernel on a CPU (Triton's interpreter) is counted, not run or timed."""
    figures = {name: {} for name in FIGURES}
    run_kernel = not (path == "fused" and device.type == "cpu")
    for batch in batch_sizes:
        files = [distinct[i % len(distinct)] for i in range(batch)]
        counter = count(pipeline, files, device, decoder, path, run_kernel)
        kinds = counter.kinds
        rate = images_per_s(pipeline, files, device, seconds, decoder, path) if run_kernel else None
        per_image = counter.total_bytes / batch
        values = (kinds["ops"], kinds["views"], kinds["decoder"], round(per_image), rate and round(rate, 1))
        for name, value in zip(FIGURES, values, strict=True):
            figures[name][str(batch)] = value
        figures["bytes_by_operation"] = {k: round(v / batch) for k, v in counter.bytes.most_common(8)}
        counts = f"{kinds['ops']:>6} {kinds['views']:>6} {kinds['decoder']:>8} {per_image / 1e6:>9.2f}"
        print(f"{decoder:<11} {path:<7} {batch:>6} {counts} {'-' if rate is None else f'{rate:.1f}':>9}")
    figures["nothing_per_image"] = len(set(figures["ops_per_batch"].values())) == 1
    return figures


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_path", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--images", type=int, default=256, help="distinct JPEGs, cycled to fill a batch")
    ap.add_argument("--seconds", type=float, default=10.0, help="timing per batch size")
    ap.add_argument(
        "--paths",
        nargs="+",
        default=["fused" if fused.triton_found() else "ragged"],
        choices=("ragged", "fused", "canvas"),
        help="fused: augment/fused.py's kernel (a CPU: TRITON_INTERPRET=1 only); canvas: the padded batch before",
    )
    ap.add_argument(
        "--decoders",
        nargs="+",
        choices=("nvimgcodec", "nvimgcodec-whole", "nvjpeg"),
        default=["nvimgcodec" if engines.available() else "nvjpeg"],
        help="the batched decoders to run (default: the one the job takes on a GPU here)",
    )
    ap.add_argument(
        "--loads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count the fused kernel's loads an output pixel, before and after (TRITON_INTERPRET=1: minutes)",
    )
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    distinct = encoded_photos("imagenet", args.images)
    pipeline = Pipeline(PRESETS["imagenet"].train, seed=0).to(device)
    result = {"device": str(device), "preset": "imagenet", "torch_threads": 1, "decoder": args.decoders[0]}
    head = f"{'decoder':<11} {'path':<7} {'batch':>6} {'ops':>6} {'views':>6} {'decoder':>8}"
    print(f"{head} {'MB/image':>9} {'img/s':>9}")
    for decoder in args.decoders:
        for path in args.paths:
            figures = measure(pipeline, distinct, device, args.batch_sizes, args.seconds, decoder, path)
            top = decoder == args.decoders[0] and path == args.paths[0]
            result |= figures if top else {f"{decoder}_{path}": figures}  # the job's path at the top level
    result["trainer"] = {amp: trainer_bytes(256, 224, amp) for amp in ("bf16", "off")}
    loads = kernel_loads.loads_per_output_pixel() if args.loads else {}
    result["loads_per_output_pixel"] = loads or None
    for which in ("before", "after"):
        for size, counts in loads.get(which, {}).items():
            print(f"fused kernel {which}, {size} full frame to 224 px: {counts['issued']} loads an output pixel")
    for size, moved in loads.get("traffic_bytes_an_image", {}).items():
        print(
            f"fused kernel after, {size} full frame to 224 px: {moved['source'] / 1e6:.2f} MB of the photo read, "
            f"{moved['beyond_source'] / 1e6:.2f} MB beyond it (output, scratch, sums)"
        )
    for amp, figures in result["trainer"].items():
        print(f"trainer, amp {amp}: {figures['bytes_per_image'] / 1e6:.2f} MB an image, {figures['ops']} operations")
    same = result["nothing_per_image"]
    print(f"{args.decoders[0]} {args.paths[0]}: operations a batch the same for every batch size: {same}")
    return write_json(args.json, result)


if __name__ == "__main__":
    main()
