"""Decoding in the augment call: the same pixels as Pillow, reduced-size JPEG decoding that
keeps each image's augmentation, bad files reported alone, and the GPU's batched decode
path run through the same code on CPU tensors (docs/design.md, "Decoding")."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from augment.batch import augment_batch, decode_augment
from augment.decode import SHRINK_FACTORS, BadImage, decode_image, read_header
from augment.geometry import RandomResizedCrop
from augment.pipeline import Pipeline
from augment.presets import PRESETS
from augment.rng import KeyedRng
from bench.augment import synthetic_photo

CPU = torch.device("cpu")


def _jpeg(h: int, w: int, seed: int, mode: str = "RGB", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(synthetic_photo(h, w, seed)).convert(mode).save(buf, format="JPEG", quality=90, **kw)
    return buf.getvalue()


def _pillow(data: bytes, shrink: int = 1) -> np.ndarray:
    """The reference: Pillow alone (its draft mode for a reduced scale)."""
    with Image.open(io.BytesIO(data)) as img:
        if shrink > 1:
            img.draft(None, (img.width // shrink, img.height // shrink))
        return np.asarray(img.convert("RGB"))


@pytest.mark.parametrize(
    "mode, kw", [("RGB", {}), ("RGB", {"progressive": True}), ("L", {}), ("RGB", {"subsampling": 0}), ("CMYK", {})]
)
def test_jpegs_decode_to_pillows_pixels_at_every_scale(mode, kw):
    data = _jpeg(301, 437, 1, mode, **kw)
    assert read_header(data)[:2] == (301, 437)
    for s in SHRINK_FACTORS:
        got = decode_image(data, s)
        assert got.shape == (-(-301 // s), -(-437 // s), 3)
        np.testing.assert_array_equal(got, _pillow(data, s))


def _png16(samples: np.ndarray) -> bytes:
    """A 16-bit PNG written by hand (Pillow reads 48- and 64-bit PNGs but does not write them):
    gray (H, W), RGB (H, W, 3) or RGBA (H, W, 4) uint16 samples, big-endian, filter 0."""
    import struct
    import zlib

    h, w = samples.shape[:2]
    color = {1: 0, 3: 2, 4: 6}[1 if samples.ndim == 2 else samples.shape[2]]  # PNG colour types
    raw = b"".join(b"\x00" + samples[y].astype(">u2").tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", w, h, 16, color, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def _to_8_bits(samples: np.ndarray) -> np.ndarray:
    """The reference: 0..65535 onto 0..255, in float64, rounded (no ties: v * 255 / 65535 = v / 257)."""
    return np.round(samples.astype(np.float64) / 257).astype(np.uint8)


def _over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    a = alpha.astype(np.float64)[..., None] / 255
    return rgb.astype(np.float64) * a + 255 * (1 - a)


# 16-bit samples where a wrapped (v & 255), truncated-to-255 or unscaled decode goes wrong
EDGES = np.array([0, 1, 128, 129, 255, 256, 257, 383, 385, 32767, 32896, 65279, 65280, 65534, 65535], np.uint16)


def _samples16(shape, seed=0) -> np.ndarray:
    out = np.random.default_rng(seed).integers(0, 65536, shape, dtype=np.uint16)
    out.flat[: len(EDGES)] = EDGES
    return out


def test_16_bit_images_decode_to_their_values_scaled_to_8_bits():
    gray = _samples16((9, 7))
    assert Image.open(io.BytesIO(_png16(gray))).mode == "I;16"
    got = decode_image(_png16(gray))
    assert got.shape == (9, 7, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, np.repeat(_to_8_bits(gray)[..., None], 3, axis=2))
    # a dark 16-bit image (nothing above 255 of 65535) stays dark: the scale is the format's
    dark = (np.arange(63, dtype=np.uint16) * 4).reshape(9, 7)
    np.testing.assert_array_equal(decode_image(_png16(dark))[..., 0], _to_8_bits(dark))
    assert decode_image(_png16(dark)).max() == 1
    # 48-bit RGB: Pillow keeps each sample's high byte, within one level of the scaled value
    rgb = _samples16((9, 7, 3), seed=1)
    got = decode_image(_png16(rgb)).astype(int)
    assert got.shape == (9, 7, 3) and np.abs(got - _to_8_bits(rgb)).max() <= 1
    # 64-bit RGBA over white, against the 16-bit values composited exactly: the high bytes of
    # colour and alpha are each up to a level low, so up to 2 levels and a rounding apart
    rgba = _samples16((9, 7, 4), seed=2)
    exact = _over_white(rgba[..., :3] / 257, rgba[..., 3] / 257)
    got = decode_image(_png16(rgba)).astype(float)
    assert np.abs(got - exact).max() <= 2.5


def test_palette_and_grayscale_images_decode_to_their_colours():
    rng = np.random.default_rng(3)
    palette = rng.integers(0, 256, (16, 3), dtype=np.uint8)
    index = rng.integers(0, 16, (10, 12), dtype=np.uint8)
    img = Image.fromarray(index, mode="P")
    img.putpalette(palette.tobytes())
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    np.testing.assert_array_equal(decode_image(buf.getvalue()), palette[index])
    # a palette with transparency (tRNS): each entry's colour over white by its alpha
    alpha = rng.integers(0, 256, 16, dtype=np.uint8)
    buf = io.BytesIO()
    img.save(buf, format="PNG", transparency=alpha.tobytes())
    got = decode_image(buf.getvalue()).astype(float)
    assert np.abs(got - _over_white(palette[index], alpha[index])).max() <= 1
    gray = rng.integers(0, 256, (10, 12), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(gray, mode="L").save(buf, format="PNG")
    np.testing.assert_array_equal(decode_image(buf.getvalue()), np.repeat(gray[..., None], 3, axis=2))
    la = np.stack([gray, rng.integers(0, 256, (10, 12), dtype=np.uint8)], -1)
    buf = io.BytesIO()
    Image.fromarray(la, mode="LA").save(buf, format="PNG")
    got = decode_image(buf.getvalue()).astype(float)
    assert np.abs(got - _over_white(np.repeat(gray[..., None], 3, axis=2), la[..., 1])).max() <= 1


def test_bad_files_raise_bad_image_with_the_reason():
    jpeg = _jpeg(64, 64, 0)
    huge = bytearray(jpeg)
    sof = huge.index(b"\xff\xc0") + 5  # baseline frame header: precision, then height and width
    huge[sof : sof + 4] = (30000).to_bytes(2, "big") + (30000).to_bytes(2, "big")
    for data, reason in [
        (jpeg[: len(jpeg) // 2], "corrupt image"),
        (b"\xff\xd8 not a jpeg at all", "not an image"),
        (b"", "empty file"),
        (bytes(huge), "decompression bomb"),
    ]:
        with pytest.raises(BadImage, match=reason):
            read_header(data) and decode_image(data)


def test_shrink_factor_keeps_the_crop_at_least_the_output_and_rescales_the_box():
    op, out = RandomResizedCrop(size=100), 100
    sizes = torch.tensor([[300, 400], [1000, 800], [2500, 2000]] * 2000)
    params = op.sample(KeyedRng(torch.arange(len(sizes)), seed=0, epoch=0), sizes)
    f = op.max_shrink(params)
    h, w = params["box"][:, 2], params["box"][:, 3]
    assert set(f.unique().tolist()) == set(SHRINK_FACTORS)  # every scale occurs for these sizes
    shrunk = f > 1
    assert bool(((h >= f * out) & (w >= f * out))[shrunk].all())  # at scale f the crop still covers the output
    bigger = (h >= 2 * f * out) & (w >= 2 * f * out)
    assert not bool((bigger & (f < 8)).any())  # and f is the largest such scale
    small = op.shrink_params(params, f)["box"]
    top, left = params["box"][:, 0], params["box"][:, 1]
    assert bool((small[shrunk, 2:] >= out).all())
    for edge, small_edge in [(top, small[:, 0]), (left, small[:, 1]), (top + h, small[:, 0] + small[:, 2])]:
        assert bool(((small_edge * f - edge).abs() <= f // 2).all())  # each edge within half a small pixel


def test_a_crop_that_draws_boxes_lets_the_decoder_shrink_and_a_fixed_one_does_not():
    from augment.ops import can_shrink

    assert can_shrink("random_resized_crop")
    assert not any(can_shrink(name) for name in ("random_crop", "center_crop", "resize_center_crop", "nope"))


@pytest.fixture(scope="module")
def encoded():
    sizes = [(300, 400), (1200, 1600), (500, 333), (2000, 1500), (480, 640), (1000, 1000)]
    files = [_jpeg(h, w, i) for i, (h, w) in enumerate(sizes)]
    png = io.BytesIO()
    Image.fromarray(synthetic_photo(700, 900, 7)).save(png, format="PNG")
    return files + [png.getvalue(), b"not an image", files[0][:300]]


# an op with a forward of its own (random_erasing) and a Kornia op after the first; at 224 px
# the CPU takes 4 images a chunk, so the 7 images of `encoded` span two
OTHER_OPS = (
    {"random_resized_crop": {"size": 224}},
    {"random_erasing": {"p": 0.7}},
    {"kornia.RandomGaussianBlur": {"kernel_size": [5, 5], "sigma": [0.1, 2.0], "p": 0.6}},
    {"horizontal_flip": {"p": 0.5}},
)


@pytest.mark.parametrize("specs", ["train", "eval", "other"])
def test_full_size_decode_augment_equals_decoding_then_augmenting(encoded, specs):
    """decode_augment draws every op's parameters once for the batch and applies them a
    chunk at a time; augment_batch draws in each chunk: the same images, to the bit."""
    preset = PRESETS["imagenet"]
    pipeline = Pipeline({"train": preset.train, "eval": preset.eval, "other": OTHER_OPS}[specs], seed=5)
    keys = torch.arange(len(encoded), dtype=torch.int64) * 7919
    out, kept, bad, _ = decode_augment(pipeline, encoded, keys, 3, CPU, shrink=False)
    assert kept == list(range(7)) and sorted(r for r, _ in bad) == [7, 8]
    images = np.empty(7, dtype=object)
    images[:] = [decode_image(d) for d in encoded[:7]]
    torch.testing.assert_close(out, augment_batch(pipeline, images, keys[:7], 3, CPU), rtol=0, atol=0)


def test_reduced_size_decode_stays_close_and_independent_of_the_batch(encoded):
    pipeline = Pipeline(PRESETS["imagenet"].train, seed=5)
    keys = torch.arange(len(encoded), dtype=torch.int64) * 7919
    full = decode_augment(pipeline, encoded, keys, 3, CPU, shrink=False).images
    small, kept, bad, _ = decode_augment(pipeline, encoded, keys, 3, CPU, shrink=True)
    assert kept == list(range(7)) and len(bad) == 2
    pipe = pipeline.at_epoch(3)
    factors = pipe.request(torch.tensor([read_header(d)[:2] for d in encoded[:7]]), keys[:7], shrink=True).scales
    assert int(factors.max()) > 1  # some images were decoded at a reduced size
    diff = (small.float() - full.float()).abs()
    assert float(diff.mean()) < 2.0  # the same crop (edges within half a small pixel), filtered differently
    for i in range(7):  # alone, or in another batch, an image gets the same view
        alone = decode_augment(pipeline, encoded[i : i + 1], keys[i : i + 1], 3, CPU, shrink=True).images
        torch.testing.assert_close(alone[0], small[i], rtol=0, atol=0)


def test_the_gpu_paths_batched_decode_runs_the_same_code_on_cpu_tensors(encoded):
    """decoder="nvjpeg" takes the GPU branch (one batched torchvision.io.decode_jpeg call, then
    per-file fallbacks), which torchvision also runs on the CPU: same images, same bad files."""
    pipeline = Pipeline(PRESETS["imagenet"].train, seed=5)
    keys = torch.arange(len(encoded), dtype=torch.int64) * 7919
    cpu, kept, bad, _ = decode_augment(pipeline, encoded, keys, 1, CPU, shrink=False)
    gpu_path, kept_g, bad_g, _ = decode_augment(pipeline, encoded, keys, 1, CPU, shrink=True, decoder="nvjpeg")
    assert kept_g == kept and sorted(bad_g) == sorted(bad)  # shrink is a CPU-only path: ignored here
    # torchvision's and simplejpeg's decoders differ by a level here and there, which colour
    # jitter's contrast and saturation may widen to two
    diff = (gpu_path.int() - cpu.int()).abs()
    assert int(diff.max()) <= 2 and float((diff > 1).float().mean()) < 1e-3


def test_a_truncated_jpeg_is_not_left_to_nvjpeg(monkeypatch):
    """nvjpeg decodes a cut-off JPEG without an error (seen on an H200: the run trained on it
    and listed no bad file). Here torchvision's decode_jpeg is made as lenient, and the
    truncated file must still come back as a BadImage from the CPU decoder."""
    import torchvision.io

    from augment.decode import decode_cuda, ends_complete

    whole = _jpeg(120, 160, 3)
    cut = whole[: len(whole) // 2]
    assert ends_complete(whole) and ends_complete(whole + b"\x00\x00") and not ends_complete(cut)
    given = []

    def lenient(tensors, mode, device):
        given.extend(bytes(t.numpy()) for t in tensors)
        return [torch.zeros((3, 120, 160), dtype=torch.uint8) for _ in tensors]

    monkeypatch.setattr(torchvision.io, "decode_jpeg", lenient)
    good, bad = decode_cuda([whole, cut], [True, True], CPU)
    assert given == [whole]  # only the complete file went to the batched call
    assert good.shape == (3, 120, 160) and isinstance(bad, BadImage) and "truncated" in str(bad)


def test_the_stage_decodes_bytes_and_reports_bad_files_by_path(encoded):
    from training.stream.stage import AugmentStage, StageArgs

    class Log:
        def __init__(self):
            self.rows, self.add = [], self

        def remote(self, rows):
            self.rows += rows

    log = Log()
    stage = AugmentStage(StageArgs(PRESETS["imagenet"], train=True, seed=0, shrink=True), device="cpu", bad_log=log)
    n = len(encoded)
    batch = {
        "bytes": np.array(encoded, dtype=object),
        "path": np.array([f"/data/c/{i}.jpg" for i in range(n)], dtype=object),
        "label": np.arange(n),
        "key": np.arange(n) * 31,
        "epoch": np.zeros(n, dtype=np.int64),
    }
    out = stage(batch)
    assert out["image"].shape == (n - 2, 224, 224, 3) and list(out["label"]) == list(range(n - 2))
    assert list(out["key"]) == [i * 31 for i in range(n - 2)]
    assert sorted(p for p, _ in log.rows) == ["/data/c/7.jpg", "/data/c/8.jpg"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvjpeg needs a CUDA device; this machine has none")
def test_nvjpeg_decodes_a_batch_like_the_cpu(encoded):
    from augment.decode import decode_cuda

    flags = [read_header(d)[2] if d[:2] == b"\xff\xd8" and len(d) > 1000 else False for d in encoded[:7]]
    images = decode_cuda(encoded[:7], flags, torch.device("cuda"))
    for data, image in zip(encoded[:7], images, strict=True):
        ref = torch.from_numpy(decode_image(data))
        image = image.permute(1, 2, 0)  # nvjpeg's (3, H, W)
        assert image.shape == ref.shape and image.device.type == "cuda"
        # nvjpeg's IDCT and chroma upsampling differ from libjpeg-turbo's (docs/benchmark-log.md, "GPU")
        assert float((image.cpu().float() - ref.float()).abs().mean()) < 2.0
    pipeline = Pipeline(PRESETS["imagenet"].train, seed=5).to("cuda")
    keys = torch.arange(len(encoded), dtype=torch.int64)
    out, kept, bad, _ = decode_augment(pipeline, encoded, keys, 1, torch.device("cuda"), shrink=False, decoder="nvjpeg")
    assert kept == list(range(7)) and len(bad) == 2 and out.device.type == "cuda"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvImageCodec's GPU decoders need a CUDA device; none here")
def test_nvimgcodec_decodes_crop_regions_on_the_gpu_like_the_cpu(encoded, monkeypatch):
    """The job's GPU decoder where nvImageCodec is installed: the regions decoded on the device
    (its hardware engines or CUDA decoder), then the whole train preset, against the CPU path."""
    from augment import batch, engines

    if not engines.available():
        pytest.skip("nvImageCodec is not installed (pip install -e '.[gpu]')")
    decode_regions, regions = engines.decode_regions, []

    def spy(*args):
        images, cropped, where = decode_regions(*args)
        regions.append(sum(cropped))
        return images, cropped, where

    pipeline = Pipeline(PRESETS["imagenet"].train, seed=5)
    keys = torch.arange(len(encoded), dtype=torch.int64) * 7919
    cpu, kept, bad, _ = decode_augment(pipeline, encoded, keys, 1, CPU, shrink=False)
    pipeline.to("cuda")
    monkeypatch.setattr(batch.engines, "decode_regions", spy)
    cuda = torch.device("cuda")
    gpu, kept_g, bad_g, _ = decode_augment(pipeline, encoded, keys, 1, cuda, shrink=False, decoder="nvimgcodec")
    assert engines.usable(), engines.FAILURES  # it ran on the GPU, not fell back to nvjpeg
    assert regions == [6], regions  # the six complete JPEGs of `encoded`, each as its crop box
    assert kept_g == kept and sorted(bad_g) == sorted(bad) and gpu.device.type == "cuda"
    # the GPU's JPEG decoders differ from libjpeg-turbo by a level or two (docs/benchmark-log.md, "GPU")
    assert float((gpu.cpu().float() - cpu.float()).abs().mean()) < 2.0


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP"])
def test_every_decoder_hands_on_writable_arrays(fmt):
    """torch.from_numpy warns of a read-only array ("The given NumPy array is not writable"),
    once per process, on a user's console: no decoder may hand one on."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 20, 3), dtype=np.uint8)).save(buf, format=fmt)
    image = decode_image(buf.getvalue())
    assert image.shape == (24, 20, 3) and image.dtype == np.uint8 and image.flags.writeable
