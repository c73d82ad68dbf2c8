"""JPEGs of a batch decoded by NVIDIA's nvImageCodec, each only in the region the first op reads.

    images, cropped = decode_regions(datas, jpeg, regions, device)

On a GPU the batch goes to the card's hardware JPEG engines where it has them (A100, H100,
H200: the decode then costs the SMs nothing), else to nvImageCodec's CUDA decoder; off a GPU
(the tests, a CPU machine with the package) to its libjpeg-turbo backend, through the same
calls. A region of interest is decoded on its own: the crop of a RandomResizedCrop, not the
whole photo.

Whatever the decoder does not take comes back as None, for the caller's CPU decoders
(augment/decode.py), which decode it whole or name what is wrong with it: a file that is not
a YCbCr or grayscale JPEG (`jpeg` from read_header), a JPEG without its end-of-image marker
(the GPU decoders fill a truncated stream's missing rows without an error), a region that
does not fit the image, a stream the decoder refuses.

Stream ordering is explicit on both sides. Before the call the host waits for an event recorded
on the caller's stream (`wait_for_queued`): nothing the caller queued is still running when the
decoder starts. The decoder writes into buffers of its own, never into memory torch may hand to
kernels still queued, and it is given the caller's stream to order its output against; the
tensors are taken over through DLPack on that same stream. The decoded buffers must outlive the
kernels that read them: the caller synchronises its stream before it lets them go
(augment/batch.py). tests/test_gpu.py runs pytorch/vision#9606's pattern against it, with a
reuse case and checksums queued right after each decode.

Each image's decoder is known (`decode_regions`' third list: augment.decode's ENGINES, GPU_SMS or
ON_CPU): the batch goes to the hardware engines first and what they return nothing for to the CUDA
decoder, in a second call. A GPU without engines (the hardware decoder takes none of the first
batch's images) is said once and the process calls the CUDA decoder alone from then on.

The package is optional (`pip install -e ".[gpu]"`; `available()` says whether it is there).
Where it cannot be loaded or set up on a machine (a missing library, a CUDA or driver error),
it says so in one line and the process decodes with torchvision's nvjpeg from then on
(`usable()`); a batch it fails on goes to nvjpeg alone, and after MAX_BATCH_FAILURES of them
the process leaves it too. (A CUDA error that breaks the process's context breaks nvjpeg too:
no decoder can go on after one.)
It prints one line for each codec library it cannot load when it is imported (JPEG 2000 and
TIFF, which this project does not use): those lines are dropped, and its log is kept to
errors it reports as None anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import sys

import numpy as np

from augment.decode import ENGINES, GPU_SMS, ON_CPU, ends_complete


class EngineFailure(RuntimeError):
    """The library failed on this machine (not a file it refused: those come back as None)."""


@dataclasses.dataclass
class Failures:
    """This process's failures of the library: why it is left alone (`left`, once it is) and the
    batches it failed on (MAX_BATCH_FAILURES at most)."""

    left: list[str] = dataclasses.field(default_factory=list)
    batches: list[str] = dataclasses.field(default_factory=list)
    no_engines: bool = False  # the hardware decoder took none of a batch: the CUDA decoder alone from then on


FAILURES = Failures()
MAX_BATCH_FAILURES = 3


@functools.cache
def available() -> bool:
    """Whether nvImageCodec is installed (its import is not tried: see library); asked once per
    process, as every GPU batch asks it (augment/batch.py default_decoder)."""
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except ModuleNotFoundError:  # no `nvidia` namespace at all
        return False


def usable() -> bool:
    """Installed, and it has not failed in this process."""
    return available() and not FAILURES.left


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _failed(error: Exception, *, setup: bool) -> EngineFailure:
    """The library failed. Where it cannot be loaded or set up (`setup`), or after
    MAX_BATCH_FAILURES batches, it is left alone in this process, said once on one line; a
    batch it fails on before that goes to nvjpeg on its own, the first such said once too."""
    why = f"{type(error).__name__}: {error}"
    if not setup:
        FAILURES.batches.append(why)
        if len(FAILURES.batches) == 1:
            _say(f"nvImageCodec failed on a batch ({why}); that batch decodes with torchvision's nvjpeg")
        if len(FAILURES.batches) < MAX_BATCH_FAILURES:
            return EngineFailure(why)
        why = f"{MAX_BATCH_FAILURES} batches failed, the last with {why}"
    if not FAILURES.left:
        FAILURES.left.append(why)
        _say(
            f"nvImageCodec failed here ({why}); this process decodes with torchvision's nvjpeg "
            "from now on (--gpu-decoder nvjpeg leaves nvImageCodec out)"
        )
    return EngineFailure(FAILURES.left[0])


@contextlib.contextmanager
def _stderr_dropped():
    """File descriptor 2 to /dev/null for the block: the library prints from C, past sys.stderr."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@functools.cache
def library():
    # 0: nothing from its logger; a file it cannot decode comes back as None, and the caller's
    # CPU decoders then say what is wrong with it, in the bad-file log
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    with _stderr_dropped():
        from nvidia import nvimgcodec
    return nvimgcodec


@functools.cache
def decoders_for(device_index: int | None) -> tuple:
    """(the hardware engines' decoder, the CUDA decoder) for a device, once per process (each holds
    the library's handles and threads); (None, the CPU backend's decoder) off a GPU."""
    nv = library()
    if device_index is None:
        return None, nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, backends=[nv.Backend(nv.CPU_ONLY)])
    hardware = nv.Decoder(device_id=device_index, backends=[nv.Backend(nv.HW_GPU_ONLY)])
    return hardware, nv.Decoder(device_id=device_index, backends=[nv.Backend(nv.GPU_ONLY)])


def _code_stream(nv, data: bytes, region):
    """The file's code stream, cut to `region` (top, left, h, w) if one is given; None if the
    library cannot parse its header."""
    try:
        stream = nv.CodeStream(data)
        if region is None:
            return stream
        top, left, h, w = region
        return stream.get_sub_code_stream(region=nv.Region(top, left, top + h, left + w))
    except RuntimeError:
        return None


def decode_regions(datas: list[bytes], jpeg: list[bool], regions, device) -> tuple[list, list[bool], list[int]]:
    """Per file: a uint8 (h, w, 3) RGB image (a tensor on a CUDA `device`, a numpy array on the
    CPU) or None where this decoder does not take the file; per file whether the image is its
    region (`regions[i]`, (top, left, h, w) in the full image; None: the whole image) or the whole
    image; and per file where it was decoded (ENGINES, GPU_SMS, ON_CPU; ON_CPU for the Nones,
    which the caller's CPU decoders take). EngineFailure where the library fails (see _failed:
    it may then be left alone in this process, usable())."""
    import torch

    if FAILURES.left:
        raise EngineFailure(FAILURES.left[0])
    device = torch.device(device)
    index = None if device.type != "cuda" else device.index if device.index is not None else torch.cuda.current_device()
    try:  # the optional library on this machine: a library it cannot load, a CUDA or driver error
        nv, decoders = library(), decoders_for(index)
    except Exception as e:
        raise _failed(e, setup=True) from e
    try:
        return decode_batch(nv, decoders, datas, jpeg, regions, device)
    except Exception as e:  # this batch: out of memory, say, or a call this version does not take
        raise _failed(e, setup=False) from e


def wait_for_queued(device) -> None:
    """The host waits until the work queued on the caller's stream so far has run: an event
    recorded there, then waited for."""
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    event.synchronize()


def decode_batch(nv, decoders, datas, jpeg, regions, device) -> tuple[list, list[bool], list[int]]:
    """decode_regions' work: the engines first, then the CUDA decoder (or the CPU backend) for
    what they returned nothing for; each image checked for its region's (or header's) shape."""
    import torch

    cuda = device.type == "cuda"
    hardware, fallback = decoders
    regions = [None] * len(datas) if regions is None else regions
    take = [i for i, ok in enumerate(jpeg) if ok and ends_complete(datas[i])]
    streams = {i: _code_stream(nv, datas[i], regions[i]) for i in take}
    take = [i for i in take if streams[i] is not None]
    out: list = [None] * len(datas)
    where = [ON_CPU] * len(datas)
    if take:
        params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.SRGB, sample_format=nv.I_RGB)
        stream = torch.cuda.current_stream(device).cuda_stream if cuda else 0
        if cuda:
            wait_for_queued(device)  # explicit: not a side effect of some earlier host sync
        steps = [(hardware, ENGINES), (fallback, GPU_SMS if cuda else ON_CPU)]
        for decoder, place in steps if hardware is not None and not FAILURES.no_engines else steps[1:]:
            todo = [i for i in take if out[i] is None]
            if not todo:
                break
            decoded = decoder.decode([streams[i] for i in todo], params=params, cuda_stream=stream)
            for i, image in zip(todo, decoded, strict=True):
                if image is not None and tuple(image.shape) == _expected(streams[i], regions[i]):  # else the CPU's
                    out[i], where[i] = (torch.from_dlpack(image) if cuda else _host_array(image)), place
            if place == ENGINES and len(todo) >= 8 and all(out[i] is None for i in todo):
                FAILURES.no_engines = True  # this GPU has none (or they take none of these files)
                _say("nvImageCodec: the hardware JPEG engines decoded none of a batch; this process decodes on the SMs")
    cropped = [out[i] is not None and regions[i] is not None for i in range(len(datas))]
    return out, cropped, where


def _expected(stream, region) -> tuple[int, int, int]:
    """The shape a decoded image of `stream` (cut to `region`) must have."""
    return (stream.height, stream.width, 3) if region is None else (region[2], region[3], 3)


def _host_array(image):
    return np.asarray(image)  # a view that keeps the library's buffer alive
