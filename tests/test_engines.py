"""nvImageCodec's batched decode (augment/engines.py) through its CPU backend, the calls the
GPU makes: the same pixels as libjpeg-turbo, whole or as a region; every file it does not
take left to the CPU decoders, so the same files are kept and listed; the job's choice of
decoder; and no line of the library's on stderr."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from augment import batch as augment_batch_module
from augment import engines
from augment.batch import decode_augment, default_decoder
from augment.decode import decode_image, read_header
from augment.pipeline import Pipeline
from augment.presets import PRESETS
from bench.augment import synthetic_photo

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    not engines.available(),
    reason="nvImageCodec is not installed (the test extra installs it: pip install -e '.[test]')",
)


def _encode(array: np.ndarray, fmt: str = "JPEG", **kw) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt, **kw)
    return out.getvalue()


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    """4:4:4, 4:2:2, 4:2:0, progressive and grayscale JPEGs of odd sizes."""
    photo = synthetic_photo(427, 641, 3)
    return [
        _encode(photo, quality=90, subsampling=0),
        _encode(photo[:301, :333], quality=85, subsampling=1),
        _encode(photo[:255, :379], quality=80, subsampling=2),
        _encode(photo, quality=85, progressive=True),
        _encode(photo[:200, :150, 0]),
    ]


def test_whole_images_and_regions_are_libjpeg_turbos_pixels(jpegs):
    regions = [(37, 51, 201, 173), None, (0, 0, 255, 379), (426, 640, 1, 1), (199, 0, 1, 150)]
    images, cropped, _ = engines.decode_regions(jpegs, [True] * len(jpegs), regions, CPU)
    assert cropped == [r is not None for r in regions]
    for data, region, image in zip(jpegs, regions, images, strict=True):
        ref = decode_image(data)
        if region is not None:
            top, left, h, w = region
            ref = ref[top : top + h, left : left + w]
        assert image.dtype == np.uint8 and image.shape == ref.shape
        assert np.array_equal(image, ref)


def test_what_it_does_not_take_comes_back_as_none(jpegs):
    whole = jpegs[2]
    png = _encode(synthetic_photo(40, 60, 1), "PNG")
    files = [whole, whole[: len(whole) // 2], b"\xff\xd8\xff not a jpeg \xff\xd9", png, whole, whole]
    jpeg = [True, True, True, False, False, True]  # read_header's flag: the PNG and a file it refused
    regions = [None, None, None, None, None, (200, 300, 100, 100)]  # the last one past the image's edge
    images, cropped, _ = engines.decode_regions(files, jpeg, regions, CPU)
    assert [image is not None for image in images] == [True, False, False, False, False, False]
    assert cropped == [False] * 6


def test_decode_augment_through_it_gives_the_full_decodes_images_and_bad_files(monkeypatch):
    """The region decode with the draws moved into the region against the batch decoded
    whole (torchvision's batched call, the same CPU resampler): the same images to a level,
    the same files kept and listed, whichever files the library leaves to the CPU."""
    photos = [synthetic_photo(h, w, i) for i, (h, w) in enumerate([(300, 400), (500, 333), (64, 64), (480, 640)])]
    good = [_encode(p, quality=90) for p in photos]
    cmyk = _cmyk_jpeg(photos[0])
    files = [*good[:2], b"not an image", cmyk, _encode(photos[2], "PNG"), good[3], good[0][:500], *good]
    assert not read_header(cmyk)[2]
    keys = torch.arange(len(files), dtype=torch.int64) * 7919
    decode_regions, regions_decoded = engines.decode_regions, []

    def spy(*args):
        images, cropped, where = decode_regions(*args)
        regions_decoded.append(sum(cropped))
        return images, cropped, where

    monkeypatch.setattr(augment_batch_module.engines, "decode_regions", spy)
    for preset in ("imagenet", "cifar"):
        pipeline = Pipeline(PRESETS[preset].train, seed=3)
        whole, kept, bad, _ = decode_augment(pipeline, files, keys, 2, CPU, shrink=False, decoder="nvjpeg")
        regions, kept_r, bad_r, _ = decode_augment(pipeline, files, keys, 2, CPU, shrink=False, decoder="nvimgcodec")
        assert kept_r == kept == [0, 1, 3, 4, 5, 7, 8, 9, 10] and bad_r == bad
        assert [row for row, _ in bad] == [2, 6]
        # the same pixels decoded (torchvision's CPU decoder is libjpeg-turbo too), the same boxes
        assert int((regions.int() - whole.int()).abs().max()) <= 1, preset
    # the complete JPEGs as their crop boxes for imagenet's random_resized_crop; cifar's
    # random_crop (padding) reads the whole image
    assert regions_decoded == [7, 0]


def _cmyk_jpeg(photo: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(photo).convert("CMYK").save(out, format="JPEG", quality=90)
    return out.getvalue()


def test_the_gpu_takes_nvimgcodec_where_it_is_installed_and_nvjpeg_where_not(monkeypatch):
    assert default_decoder(torch.device("cuda")) == "nvimgcodec"
    assert default_decoder(CPU) == "cpu"
    monkeypatch.setattr(augment_batch_module.engines, "available", lambda: False)
    assert default_decoder(torch.device("cuda:1")) == "nvjpeg"
    with pytest.raises(ValueError, match="decoder must be one of"):
        pipeline = Pipeline(PRESETS["cifar"].train, seed=0)
        decode_augment(pipeline, [b"x"], torch.zeros(1), 0, CPU, shrink=False, decoder="dali")


def test_the_library_prints_nothing_when_imported_or_given_bad_files():
    """Its import prints a line for each codec library it cannot load, and its log names
    every file it cannot parse; the job lists bad files itself, in one place."""
    code = (
        "from augment import engines; import torch\n"
        "files = [b'\\xff\\xd8 junk \\xff\\xd9', b'']\n"
        "images, _, _ = engines.decode_regions(files, [True, True], None, torch.device('cpu'))\n"
        "assert images == [None, None]\n"
        "print('done')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    assert done.stderr == ""


def test_a_library_that_fails_here_is_said_once_and_the_batches_go_to_nvjpeg(monkeypatch, capfd):
    """A CUDA or driver error inside nvImageCodec (here: its decoder cannot be made) is one line
    on stderr, once per process; that batch and every later one decode with torchvision's nvjpeg,
    the same files kept and listed, and the default decoder on a GPU turns to nvjpeg."""

    def broken(device_index):
        raise RuntimeError("CUDA Runtime failure: '#35'")

    monkeypatch.setattr(engines, "decoders_for", broken)
    monkeypatch.setattr(engines, "FAILURES", engines.Failures())
    photos = [synthetic_photo(h, w, i) for i, (h, w) in enumerate([(300, 400), (64, 80)])]
    files = [_encode(photos[0], quality=90), b"not an image", _encode(photos[1], "PNG")]
    keys = torch.arange(len(files), dtype=torch.int64)
    pipeline = Pipeline(PRESETS["imagenet"].train, seed=1)
    expected, kept, bad, _ = decode_augment(pipeline, files, keys, 0, CPU, shrink=False, decoder="nvjpeg")
    for _ in range(2):
        got, kept_f, bad_f, _ = decode_augment(pipeline, files, keys, 0, CPU, shrink=False, decoder="nvimgcodec")
        assert torch.equal(got, expected) and kept_f == kept == [0, 2] and bad_f == bad
    said = capfd.readouterr().err.splitlines()
    assert said == [
        "nvImageCodec failed here (RuntimeError: CUDA Runtime failure: '#35'); this process decodes with "
        "torchvision's nvjpeg from now on (--gpu-decoder nvjpeg leaves nvImageCodec out)"
    ]
    assert not engines.usable() and default_decoder(torch.device("cuda")) == "nvjpeg"
    assert default_decoder(torch.device("cuda"), "nvimgcodec") == "nvimgcodec"  # as asked: it falls back per batch


def test_a_batch_it_fails_on_goes_to_nvjpeg_alone_and_three_leave_it_for_good(monkeypatch, capfd):
    """An error inside one batch's call (out of memory, say) sends that batch to nvjpeg and is
    said once; the library is tried again on the next batch, and left alone after three."""

    def out_of_memory(*args):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(engines, "decode_batch", out_of_memory)
    monkeypatch.setattr(engines, "FAILURES", engines.Failures())
    files = [_encode(synthetic_photo(120, 160, 0), quality=90)]
    pipeline = Pipeline(PRESETS["imagenet"].train, seed=1)
    keys = torch.zeros(1, dtype=torch.int64)
    usable = []
    for _ in range(4):
        out, kept, bad, _ = decode_augment(pipeline, files, keys, 0, CPU, shrink=False, decoder="nvimgcodec")
        assert out.shape == (1, 224, 224, 3) and kept == [0] and not bad
        usable.append(engines.usable())
    assert usable == [True, True, False, False] and len(engines.FAILURES.batches) == 3
    assert capfd.readouterr().err.splitlines() == [
        "nvImageCodec failed on a batch (RuntimeError: CUDA out of memory); that batch decodes with "
        "torchvision's nvjpeg",
        "nvImageCodec failed here (3 batches failed, the last with RuntimeError: CUDA out of memory); this process "
        "decodes with torchvision's nvjpeg from now on (--gpu-decoder nvjpeg leaves nvImageCodec out)",
    ]


def test_gpu_decoder_nvimgcodec_without_the_package_stops_before_ray(monkeypatch):
    from training.config import ConfigError
    from training.driver.inputs import check_gpu_decoder

    check_gpu_decoder("nvimgcodec")  # installed here
    monkeypatch.setattr(engines, "available", lambda: False)
    check_gpu_decoder("auto")
    check_gpu_decoder("nvjpeg")
    with pytest.raises(ConfigError, match=r"--gpu-decoder nvimgcodec: nvImageCodec is not installed here; .*\[gpu\]"):
        check_gpu_decoder("nvimgcodec")
    check_gpu_decoder("nvimgcodec", device="cpu")  # a CPU run decodes on the CPU whatever the flag says


class _Decoder:
    """A stand-in for one of the GPU's nvImageCodec decoders: the CPU backend's pixels, each call
    logged in `log`; `refuse(data)` says which files it returns nothing for (the engines refuse
    progressive JPEGs, say)."""

    def __init__(self, name: str, log: list, refuse=lambda stream: False):
        self.name, self.log, self.refuse = name, log, refuse
        self.cpu = engines.decoders_for(None)[1]

    def decode(self, streams, *, params, cuda_stream):
        self.log.append(f"decode:{self.name}:{len(streams)}:stream {cuda_stream}")
        images = self.cpu.decode(streams, params=params)
        return [None if self.refuse(s) else image for s, image in zip(streams, images, strict=True)]


def _on_a_fake_gpu(monkeypatch, log: list) -> torch.device:
    """decode_batch as on a GPU: the caller's stream a fake one (id 7), the host's wait and the
    DLPack hand-over logged instead of run."""

    class Stream:
        cuda_stream = 7

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(engines, "wait_for_queued", lambda device: log.append("wait"))
    monkeypatch.setattr(torch, "from_dlpack", lambda image: log.append("dlpack") or torch.from_numpy(np.asarray(image)))
    monkeypatch.setattr(engines, "FAILURES", engines.Failures())
    return torch.device("cuda", 0)


def test_the_host_waits_for_the_callers_stream_before_the_decoder_runs_and_each_image_says_where(jpegs, monkeypatch):
    """On a GPU: first the wait for the work queued on the caller's stream, then the engines'
    call, then the CUDA decoder's for what they returned nothing for (here the progressive
    JPEG), every output taken over by DLPack after its call; each image's place recorded."""
    from augment.decode import ENGINES, GPU_SMS

    log: list = []
    device = _on_a_fake_gpu(monkeypatch, log)
    progressive, streams_of = jpegs[3], {}

    def code_stream(nv, data, region, original=engines._code_stream):
        stream = original(nv, data, region)
        streams_of[id(stream)] = data
        return stream

    monkeypatch.setattr(engines, "_code_stream", code_stream)  # which file each stream is: the engines refuse one
    hardware = _Decoder("engines", log, refuse=lambda s: streams_of[id(s)] is progressive)
    decoders = (hardware, _Decoder("sms", log))
    images, cropped, where = engines.decode_batch(engines.library(), decoders, jpegs, [True] * 5, None, device)
    assert log == ["wait", "decode:engines:5:stream 7", *["dlpack"] * 4, "decode:sms:1:stream 7", "dlpack"]
    assert where == [ENGINES, ENGINES, ENGINES, GPU_SMS, ENGINES] and cropped == [False] * 5
    for data, image in zip(jpegs, images, strict=True):
        assert torch.equal(image, torch.from_numpy(decode_image(data)))


def test_a_gpu_whose_engines_take_nothing_is_said_once_and_left_to_the_sms(jpegs, monkeypatch, capfd):
    from augment.decode import GPU_SMS

    log: list = []
    device = _on_a_fake_gpu(monkeypatch, log)
    decoders = (_Decoder("engines", log, refuse=lambda s: True), _Decoder("sms", log))
    files = [jpegs[0]] * 8
    for _ in range(2):
        images, _, where = engines.decode_batch(engines.library(), decoders, files, [True] * 8, None, device)
        assert where == [GPU_SMS] * 8 and all(image is not None for image in images)
    assert [entry for entry in log if entry.startswith("decode")] == [
        "decode:engines:8:stream 7",
        "decode:sms:8:stream 7",
        "decode:sms:8:stream 7",  # the second batch: the engines are not asked again
    ]
    assert capfd.readouterr().err.splitlines() == [
        "nvImageCodec: the hardware JPEG engines decoded none of a batch; this process decodes on the SMs"
    ]
