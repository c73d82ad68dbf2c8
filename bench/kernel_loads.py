"""Loads per output pixel of the fused kernel (augment/fused_kernel.py) and of the kernel before it
(bench/fused_kernel_before.py), counted, not assumed: both run through Triton's interpreter
(TRITON_INTERPRET=1, on the CPU) with every `tl.load` counted, element by element.

    TRITON_INTERPRET=1 python -m bench.kernel_loads        # or through python -m bench.gpu_path

One photo's full frame to 224 x 224 (the `imagenet` preset's random_resized_crop with its box the
whole photo, its flip and its colour jitter with contrast on), for a 500 x 375 photo and a
4000 x 3000 one, each kernel at its GPU launch's block shape. Two counts per output pixel:

* issued: the elements of every load the kernels' loops make (each tap, channel and pass, and the
  few scalars a program reads about its image), masked lanes included: what the loop bounds cost;
* read: the elements whose mask is on, the bytes that are read.

And the kernel after's memory traffic an image (`traffic`), its loads and stores counted by where
they point: the photo's distinct bytes read (each read from memory at least once, however often
its taps share it), the output's distinct bytes written, and the rest, each lane's bytes (the
scratch of an image that jitters contrast, written once and read once, and the tiles' sums),
the few scalars a program reads about its image apart.

The kernel before, one program per image, runs here as one block of 65,536 lanes (its GPU launch:
196 blocks of 256), the lanes past the 50,176 output pixels not counted: the same count as its
GPU launch's, in one block's steps instead of 196. The kernel after runs at its GPU tiles.
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import torch

SIZES = {"500x375": (375, 500), "4000x3000": (3000, 4000)}  # name -> (h, w) of the photo
SIDE = 224


@contextlib.contextmanager
def counting_loads(lanes: int | None = None):
    """Counts the elements of every load the interpreter makes: {"issued": n, "read": n}; with
    `lanes`, a load's first `lanes` elements only (a block's lanes past the output's pixels)."""
    from triton.runtime.interpreter import InterpreterBuilder

    counts = {"issued": 0, "read": 0}
    load = InterpreterBuilder.create_masked_load

    def counted(self, ptrs, mask, *args):
        on = np.ravel(mask.data)[:lanes]
        counts["issued"] += int(on.size)
        counts["read"] += int(np.count_nonzero(on))
        return load(self, ptrs, mask, *args)

    InterpreterBuilder.create_masked_load = counted
    try:
        yield counts
    finally:
        InterpreterBuilder.create_masked_load = load


@contextlib.contextmanager
def counting_traffic(source: torch.Tensor, out: torch.Tensor):
    """Bytes the interpreter's loads and stores move, with their masks on: {"source": distinct
    bytes of `source` read, "output": distinct bytes of `out` written, "scratch": every other
    vector load's and store's bytes, "scalars": scalar loads' bytes}."""
    from triton.runtime.interpreter import InterpreterBuilder

    spans = {name: (t.data_ptr(), t.data_ptr() + t.nbytes) for name, t in (("source", source), ("output", out))}
    seen = {name: np.zeros(hi - lo, dtype=bool) for name, (lo, hi) in spans.items()}
    counts = {"scratch": 0, "scalars": 0}
    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

    def tally(ptrs, mask, itemsize: int) -> None:
        where = np.ravel(ptrs.data)[np.ravel(mask.data)].astype(np.int64)
        if ptrs.data.size == 1:
            counts["scalars"] += where.size * itemsize
            return
        rest = np.ones(where.size, dtype=bool)
        for name, (lo, hi) in spans.items():
            inside = (where >= lo) & (where < hi)
            for byte in range(itemsize):
                seen[name][where[inside] - lo + byte] = True
            rest &= ~inside
        counts["scratch"] += int(rest.sum()) * itemsize

    def loaded(self, ptrs, mask, *args):
        ret = load(self, ptrs, mask, *args)
        tally(ptrs, mask, ret.data.dtype.itemsize)
        return ret

    def stored(self, ptrs, value, mask, *args):
        tally(ptrs, mask, value.data.dtype.itemsize)
        return store(self, ptrs, value, mask, *args)

    InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = loaded, stored
    try:
        yield counts
    finally:
        InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = load, store
        counts |= {name: int(bits.sum()) for name, bits in seen.items()}


def full_frame_plan(h: int, w: int):
    """(image, meta, factors, fill) for the imagenet train preset's first three ops on one (h, w)
    photo with its box the whole frame and contrast jittered (factor 1.1)."""
    from augment.fused import FusedPlan, image_meta
    from augment.pipeline import Pipeline
    from augment.presets import PRESETS
    from bench.augment import synthetic_photo

    pipe = Pipeline(PRESETS["imagenet"].train, seed=0).at_epoch(0)
    sizes = torch.tensor([[h, w]])
    draws = pipe.sample(sizes, torch.arange(1))
    first = draws.first | {"box": torch.tensor([[0, 0, h, w]]), "resized": torch.tensor([[SIDE, SIDE]])}
    jitter = dict(draws.rest[1], apply=torch.tensor([True]))
    jitter["factors"] = jitter["factors"].clone()
    jitter["factors"][:, 1] = 1.1  # contrast on: its mean taken
    plan = FusedPlan.of(pipe.ops[:3], first, [draws.rest[0], jitter], sizes)
    image = torch.from_numpy(synthetic_photo(h, w, 0))
    meta = torch.cat([image_meta([image]), plan.meta[:, 4:]], 1).contiguous()
    return image, meta, plan.factors, round(plan.fill * 255)


def count_after(h: int, w: int) -> dict:
    """The kernel's loads, and its traffic (counting_traffic's bytes) as "traffic"."""
    from augment import fused_kernel

    image, meta, factors, fill = full_frame_plan(h, w)
    out = torch.empty((1, SIDE, SIDE, 3), dtype=torch.uint8)
    with counting_loads() as counts, counting_traffic(image, out) as traffic:
        tile, _ = fused_kernel.launch_shape("cuda")
        fused_kernel.launch(meta, factors, out, fill, SIDE, SIDE, False, tile=tile)
    del image
    return counts | {"traffic": traffic}


def count_before(h: int, w: int) -> dict:
    from bench import fused_kernel_before

    image, meta, factors, fill = full_frame_plan(h, w)
    out = torch.empty((1, SIDE, SIDE, 3), dtype=torch.uint8)
    # its GPU launch takes blocks of 256 output pixels, 196 of them here; the interpreter takes one
    # of 65,536 (each step's cost is per operation), its lanes past the 50,176 pixels not counted
    with counting_loads(lanes=SIDE * SIDE) as counts:
        fused_kernel_before.augment_kernel[(1,)](meta, factors, out, fill, SIDE, SIDE, FLOAT_OUT=False, BLOCK=65536)
    del image
    return counts


def loads_per_output_pixel() -> dict:
    """{"before": {size: {"issued", "read"}}, "after": ..., "after_over_before": {size: issued ratio}}."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return {"error": "counted through Triton's interpreter only: run with TRITON_INTERPRET=1"}
    pixels = SIDE * SIDE
    result = {"before": {}, "after": {}}
    traffic = {}
    for name, (h, w) in SIZES.items():
        for which, count in (("before", count_before), ("after", count_after)):
            counts = count(h, w)
            if "traffic" in counts:
                moved = counts.pop("traffic")
                beyond = moved["output"] + moved["scratch"] + moved["scalars"]
                traffic[name] = moved | {"beyond_source": beyond, "all": beyond + moved["source"]}
            result[which][name] = {k: round(v / pixels, 1) for k, v in counts.items()}
    result["after_over_before"] = {
        name: round(result["after"][name]["issued"] / result["before"][name]["issued"], 3) for name in SIZES
    }
    return result | {"traffic_bytes_an_image": traffic, "scratch": scratch_bytes()}


def scratch_bytes() -> dict:
    """The scratch the kernel writes and reads back for an image that jitters contrast (uint8
    output), packed and in float32 (an image whose jitter could scale the packing's error past a
    level, augment/fused_kernel.py packable), and the chunk of images that shares one scratch on a GPU."""
    from augment import fused_kernel

    _, chunk = fused_kernel.launch_shape("cuda")
    packed, wide = (fused_kernel.scratch_bytes(torch.tensor([f]), SIDE, SIDE, False) for f in ([1, 1.1, 1], [2, 2, 2]))
    return {"written_and_read_per_contrast_image": {"packed": packed, "float32": wide}, "images_a_chunk": chunk}


if __name__ == "__main__":
    print(json.dumps(loads_per_output_pixel(), indent=1))
