"""Encoded image files -> uint8 RGB pixels: on the CPU at full or reduced size, or on a GPU.

One contract for every way in: uint8 (H, W, 3) RGB out; grayscale, RGBA (over white),
palette, CMYK and 16-bit images become RGB; an animated image gives its first frame;
anything that is not a whole, sane image raises `BadImage` with the reason, whatever the
decoder raised on it. This module opens every image a user gives (decoding, header sampling
for --preset auto, jobs.prepare's sizes, the preview, prediction).

* `decode_image(data)`: the whole image. Evaluation always decodes this way, so it stays
  within 1/255 of torchvision's pipeline.
* `decode_image(data, shrink=s)`: a JPEG at 1/s of its size, s in (1, 2, 4, 8), straight
  out of libjpeg-turbo's scaled inverse DCT: the CPU train path, when the crop that
  training takes from the image is still at least the output size at that scale
  (augment/batch.py decides per image). Other formats come back at full size.

JPEGs (YCbCr or grayscale) are decoded by simplejpeg, a thin binding of libjpeg-turbo that
writes straight into a numpy array: the same pixels as Pillow (the same library and
settings; tests/test_decode.py holds them equal at every scale), faster, as Pillow's path
copies the image twice more (docs/benchmark-log.md, "Ingest"). Pillow decodes every other
format and every JPEG simplejpeg refuses, and names what is wrong.
* `decode_cuda(datas, headers, device)`: the JPEGs of a batch in one batched nvjpeg call
  (torchvision.io.decode_jpeg on the device), ordered against the caller's stream; every
  file nvjpeg does not take (other formats, CMYK, a stream it refuses) is decoded on the
  CPU, for the caller to upload with the rest.

`read_header(data)` gives (height, width, jpeg) from the file's header without decoding
it: crop parameters are drawn from it before the decode (docs/design.md, "Decoding").

Light on purpose (Pillow and numpy; torch only inside decode_cuda): Ray Data's read tasks
import it.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np

SHRINK_FACTORS = (1, 2, 4, 8)  # the scales libjpeg's IDCT produces directly

# Where an image was decoded: the code each augmented row carries (`decoded_on`), counted per epoch
# in timings.csv and summary.json. On a GPU a CPU decode is a fall-back: a file the GPU's decoders
# refuse (another format, CMYK, progressive where the engines refuse it) or a batch they failed on.
ENGINES, GPU_SMS, ON_CPU = 0, 1, 2  # the hardware JPEG engines; CUDA kernels on the SMs; the CPU
DECODE_PLACES = ("engines", "gpu_sms", "cpu")


class BadImage(ValueError):
    """A file that cannot be used as an image; the message is the reason."""


@contextlib.contextmanager
def _opened(data: bytes):
    """Pillow's image for `data`, with every way of failing turned into BadImage."""
    from PIL import Image

    if not data:
        raise BadImage("empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            # Pillow only warns between MAX_IMAGE_PIXELS and twice that; either way we refuse
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                yield img
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise BadImage(f"decompression bomb: {e}") from None
    except Image.UnidentifiedImageError:
        raise BadImage("not an image Pillow can read (wrong extension or corrupt header)") from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated data, broken chunks, bad palettes
        if isinstance(e, BadImage):
            raise
        raise BadImage(f"corrupt image: {e}") from None
    except Exception as e:  # anything else Pillow's plugins raise on odd bytes (TypeError, struct.error, ...)
        # is about this file too; an interrupt (BaseException) is not, and goes through
        raise BadImage(f"corrupt image: {type(e).__name__}" + (f": {e}" if str(e) else "")) from None


def _jpeg_header(data: bytes) -> tuple[int, int] | None:
    """(height, width) of a JPEG that simplejpeg decodes (YCbCr or grayscale), else None."""
    if data[:2] != b"\xff\xd8":
        return None
    import simplejpeg

    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:  # its ValueError, or anything else: Pillow reads the file, or names what is wrong
        return None
    if colorspace not in ("YCbCr", "Gray"):
        return None  # CMYK, YCCK: Pillow converts them
    from PIL import Image

    if h * w > Image.MAX_IMAGE_PIXELS:  # what Pillow refuses, refused here too
        raise BadImage(f"decompression bomb: {h * w} pixels, over the limit of {Image.MAX_IMAGE_PIXELS}")
    return h, w


def read_header(data: bytes) -> tuple[int, int, bool]:
    """(height, width, nvjpeg_can_take_it) from the header alone; BadImage if unreadable.
    The size is the size `decode_image(data)` returns."""
    size = _jpeg_header(data)
    if size is not None:
        return size[0], size[1], True
    with _opened(data) as img:
        return img.height, img.width, img.format == "JPEG" and img.mode in ("RGB", "L")


def decode_image(data: bytes, shrink: int = 1) -> np.ndarray:
    """Encoded bytes -> uint8 (H, W, 3) RGB; a JPEG at ceil(H/shrink) x ceil(W/shrink) when
    shrink > 1 (other formats ignore it: check the shape). BadImage for a bad file."""
    size = _jpeg_header(data)
    if size is not None:
        import simplejpeg

        try:  # min_factor: libjpeg-turbo's 1/s scale exactly (k/8 scales have no SIMD IDCT)
            h, w = -(-size[0] // shrink), -(-size[1] // shrink)
            return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=h, min_width=w, min_factor=shrink)
        except Exception:  # a truncated or corrupt stream (ValueError), or anything else: Pillow decides, and says why
            pass
    with _opened(data) as img:
        if shrink > 1:
            # Pillow picks the largest scale that leaves the image at least this size: exactly `shrink`
            img.draft(None, (max(1, img.width // shrink), max(1, img.height // shrink)))
        return _to_rgb(img)


def _to_rgb(img) -> np.ndarray:
    from PIL import Image

    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit grayscale: 0..65535 scaled to 0..255 whatever the image holds (a dark 16-bit
        # image stays dark). A 32-bit integer image ("I") has no fixed range: values up to
        # 255 are taken as 8-bit ones, larger ones as 16-bit (and clipped above 65535)
        arr = np.asarray(img, dtype=np.float32)
        sixteen = img.mode != "I" or arr.max() > 255
        gray = np.clip(arr * (255.0 / 65535.0 if sixteen else 1.0) + 0.5, 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        img = Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)), img.convert("RGBA"))
    # a copy: Pillow's array view is read-only, and torch.from_numpy warns of one (augment/batch.py
    # takes the decoded images as they are); simplejpeg's arrays are writable already
    return np.array(img.convert("RGB"))


def stack_images(images: list[np.ndarray]) -> np.ndarray:
    """One (N, H, W, 3) array when the sizes agree, else an object array of HWC arrays."""
    if not images:
        return np.zeros((0, 1, 1, 3), dtype=np.uint8)
    if all(im.shape == images[0].shape for im in images):
        return np.stack(images)
    out = np.empty(len(images), dtype=object)
    out[:] = images
    return out


def decode_cuda(datas: list[bytes], jpeg: list[bool], device) -> list:
    """Full-size decode of a batch for a GPU: per file a uint8 (3, H, W) tensor on `device`
    (what nvjpeg decoded), a uint8 (H, W, 3) numpy array (what the CPU decoded; the caller
    uploads these together, augment/ragged.py), or a BadImage for a file no decoder reads.
    The JPEGs nvjpeg takes (`jpeg`, from read_header) go in one batched call; if nvjpeg
    refuses the batch, they go one by one; what it refuses then, and every other file, is
    decoded on the CPU.

    The call is ordered against the caller's stream on both sides. torchvision decodes on a
    stream of its own that nothing orders against the caller's (pytorch/vision#9606): its
    output may take memory that kernels still queued on the caller's stream read, and the
    caller's next kernels may read the output before it is written. So the caller's stream
    is drained before the call, and the device synchronised after it (two host syncs a
    batch; tests/test_gpu.py runs the reproducer's pattern).

    nvjpeg decodes a truncated stream without an error (the missing rows come back grey),
    where the CPU decoders report it: a JPEG that does not end in its end-of-image marker
    is decoded on the CPU, so that a cut-off file is skipped and listed on every device."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    device = torch.device(device)
    out: list = [None] * len(datas)
    idx = [i for i, ok in enumerate(jpeg) if ok and ends_complete(datas[i])]
    if idx:
        with warnings.catch_warnings():  # bytes are read-only; nvjpeg only reads them
            warnings.simplefilter("ignore", UserWarning)
            encoded = [torch.frombuffer(datas[i], dtype=torch.uint8) for i in idx]
        with _ordered(device):
            try:
                decoded = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
            except RuntimeError:  # one bad stream fails the whole call: retry each alone
                decoded = [_nvjpeg_one(t, device) for t in encoded]
        for i, image in zip(idx, decoded, strict=True):
            out[i] = image
    for i, image in enumerate(out):
        if image is None:
            try:
                out[i] = decode_image(datas[i])
            except BadImage as e:
                out[i] = e
    return out


@contextlib.contextmanager
def _ordered(device):
    """Work queued on `device` before the block is finished when it starts, and the block's
    own (on any stream) when it ends. A no-op off CUDA."""
    import torch

    if device.type != "cuda":
        yield
        return
    torch.cuda.current_stream(device).synchronize()
    try:
        yield
    finally:
        torch.cuda.synchronize(device)


def ends_complete(data: bytes) -> bool:
    """Whether a JPEG ends in its end-of-image marker (FF D9), trailing zero padding allowed."""
    return data[-2:] == b"\xff\xd9" or bytes(data).rstrip(b"\x00")[-2:] == b"\xff\xd9"


def _nvjpeg_one(encoded, device):
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        return None
