"""pytorch/vision#9606's pattern against one of the GPU's batched decoders, in a process of its own
(tests/test_gpu.py runs it with the stream-ordered allocator, PYTORCH_CUDA_ALLOC_CONF=
backend:cudaMallocAsync, which hands freed blocks on soonest):

    python -m tests.gpu_ordering nvimgcodec --iterations 200    # prints one JSON line

Each iteration holds the caller's stream busy, queues reads of tensors that are then freed at
once (victims of the caching allocator) and reads of the last iteration's decoded images, which
are freed too (the decoder's own buffers, which it may hand out again), then decodes, and queues a
checksum of every decoded image right after the call, with no sleep and no sync. Each figure is
checked against one computed with the device synchronised: an unordered decoder writes over the
victims or the last outputs before their reads run, or is read before it has written.
"""

from __future__ import annotations

import argparse
import json

import torch


def batched_decode(decoder: str, files: list[bytes], jpeg: list[bool], device) -> list[torch.Tensor]:
    """One batched call of `decoder`: nvjpeg (augment.decode.decode_cuda, whole images) or
    nvimgcodec (augment.engines.decode_regions, the middle quarter of each image)."""
    from augment.decode import decode_cuda, read_header
    from augment.engines import decode_regions

    if decoder == "nvjpeg":
        return decode_cuda(files, jpeg, device)
    regions = [(h // 4, w // 4, h // 2, w // 2) for h, w in (read_header(f)[:2] for f in files)]
    images, cropped, _ = decode_regions(files, jpeg, regions, device)
    if not all(cropped):
        raise RuntimeError("nvImageCodec refused a region of the generated photos")
    return images


def run(decoder: str, iterations: int, stall_cycles: int = 50_000_000) -> dict:
    from augment.decode import read_header
    from bench.decode import encoded_photos

    device = torch.device("cuda")
    files = encoded_photos("imagenet", 8)
    jpeg = [read_header(f)[2] for f in files]
    first = batched_decode(decoder, files, jpeg, device)
    torch.cuda.synchronize(device)
    reference = [int(image.sum(dtype=torch.int64)) for image in first]
    sizes = [int(image.nbytes) for image in first]
    del first
    corrupted = {"victims": 0, "last_outputs": 0, "checksums": 0}
    previous = None
    for _ in range(iterations):
        victims = [torch.full((n // 4,), float(i + 1), device=device) for i, n in enumerate(sizes)]
        expected = [v.numel() * (i + 1) for i, v in enumerate(victims)]
        torch.cuda._sleep(stall_cycles)  # the caller's stream busy for a while (PyTorch's own tests' stall)
        sums = [v.sum() for v in victims]  # queued reads of the victims
        last = [image.sum(dtype=torch.int64) for image in previous] if previous is not None else None
        del victims
        previous = None  # the last outputs freed while their reads still wait
        decoded = batched_decode(decoder, files, jpeg, device)
        checks = [image.sum(dtype=torch.int64) for image in decoded]  # queued right after the call
        corrupted["victims"] += [float(s) for s in sums] != expected
        corrupted["last_outputs"] += last is not None and [int(s) for s in last] != reference
        corrupted["checksums"] += [int(s) for s in checks] != reference
        previous = decoded
    return {"decoder": decoder, "iterations": iterations, "corrupted": corrupted}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu_ordering", description=__doc__.split("\n")[0])
    ap.add_argument("decoder", choices=("nvjpeg", "nvimgcodec"))
    ap.add_argument("--iterations", type=int, default=200)
    args = ap.parse_args(argv)
    print(json.dumps(run(args.decoder, args.iterations)), flush=True)


if __name__ == "__main__":
    main()
