"""The GPU path against the CPU path (`pytest -m gpu`; each test skips, saying why, where
torch sees no CUDA device): the keyed generator, every built-in preset, and a whole
`jobs.train --device cuda --amp bf16` run with its augment actors on shares of the GPU.
nvjpeg's batched decode is tested in tests/test_decode.py, and here its ordering against
the caller's stream."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from augment.batch import augment_batch
from augment.pipeline import Pipeline
from augment.presets import PRESETS
from augment.rng import KeyedRng
from bench.augment import synthetic_photo

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none on this machine"),
]


def _photos(n: int, seed: int = 0) -> np.ndarray:
    """A ragged batch of photo-like images, 40 to 300 px a side."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(40, 300, size=(n, 2))
    images = np.empty(n, dtype=object)
    images[:] = [synthetic_photo(int(h), int(w), i) for i, (h, w) in enumerate(sizes)]
    return images


def test_the_keyed_generator_draws_the_same_numbers_on_cuda():
    keys = torch.tensor([0, 1, -1, 2**62, -(2**63), 123456789], dtype=torch.int64)
    for stream in (1, 2, 7):
        cpu, gpu = KeyedRng(keys, 11, 3), KeyedRng(keys.cuda(), 11, 3)
        assert torch.equal(cpu.uniform(stream, 5), gpu.uniform(stream, 5).cpu())
        assert torch.equal(cpu.seeds(stream, 3), gpu.seeds(stream, 3).cpu())


def _as_cpu(params):
    """A draw (a dict of tensors and numbers, a list of them, or None) with every tensor on the CPU."""
    if isinstance(params, dict):
        return {k: _as_cpu(v) for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return [_as_cpu(v) for v in params]
    return params.cpu() if isinstance(params, torch.Tensor) else params


def _same_draws(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same_draws(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_draws(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def compare_presets(name: str, device: torch.device) -> None:
    """Every op's draws equal on DEVICE and the CPU; eval pixels within 1/255 everywhere, train
    pixels within a mean of 1/255 in every image (resampling arithmetic only)."""
    preset = PRESETS[name]
    images, keys = _photos(24), torch.arange(24, dtype=torch.int64) * 7919
    sizes = torch.tensor([im.shape[:2] for im in images], dtype=torch.int64)
    for specs in (preset.eval, preset.train):
        cpu_pipe, dev_pipe = Pipeline(specs, seed=5), Pipeline(specs, seed=5).to(device)
        cpu_drawn = cpu_pipe.at_epoch(2).sample(sizes, keys)
        dev_drawn = dev_pipe.at_epoch(2).sample(sizes.to(device), keys.to(device))
        cpu_draws, dev_draws = ([d.first, list(d.rest)] for d in (cpu_drawn, dev_drawn))
        _same_draws(_as_cpu(cpu_draws), _as_cpu(dev_draws), f"{name} {'eval' if specs is preset.eval else 'train'}")
        on_cpu = augment_batch(cpu_pipe, images, keys, 2, CPU)
        on_dev = augment_batch(dev_pipe, images, keys, 2, device)
        assert on_dev.device.type == device.type and on_dev.shape == on_cpu.shape
        diff = (on_dev.cpu().int() - on_cpu.int()).abs()
        if specs is preset.eval:
            assert int(diff.max()) <= 1, f"{name} eval differs by {int(diff.max())}/255"
        else:
            per_image = diff.float().mean(dim=(1, 2, 3))
            assert float(per_image.max()) < 1.0, f"{name} train: images differ by {per_image.tolist()}/255 on average"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_gives_the_cpus_output_on_cuda(name):
    compare_presets(name, torch.device("cuda"))


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_the_augment_stage_runs_on_cuda_named_with_or_without_an_index(device):
    """An actor pool's stage says "cuda" (Ray fixed its GPU), a task's "cuda:N"."""
    from training.stream.stage import AugmentStage, StageArgs

    stage = AugmentStage(StageArgs(PRESETS["cifar"], train=True, seed=0), device=device)
    images = np.stack([synthetic_photo(32, 32, i) for i in range(8)])
    batch = {"image": images, "label": np.zeros(8, np.int64), "key": np.arange(8, dtype=np.int64)}
    out = stage(batch | {"epoch": np.zeros(8, np.int64)})
    assert out["image"].shape == (8, 32, 32, 3) and stage.device.type == "cuda"


@pytest.fixture(scope="module")
def jpeg_tree(tmp_path_factory):
    """4 classes x 40 JPEGs of 160-320 px, plus a corrupt one that the run must skip."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for c in range(4):
        (root / f"c{c}").mkdir()
        for i in range(40):
            h, w = (int(v) for v in rng.integers(160, 320, size=2))
            tint = np.array([60 * c, 255 - 60 * c, 128], dtype=np.float32)
            img = np.clip(synthetic_photo(h, w, c * 100 + i) * 0.5 + tint * 0.5, 0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / f"c{c}" / f"{i:03d}.jpg", quality=90)
    good = io.BytesIO()
    Image.fromarray(synthetic_photo(200, 200, 9)).save(good, format="JPEG")
    (root / "c0" / "truncated.jpg").write_bytes(good.getvalue()[: len(good.getvalue()) // 2])
    return root


def test_a_cuda_bf16_run_augments_on_gpu_shares_and_covers_every_image(jpeg_tree, tmp_path):
    from augment import engines

    args = [sys.executable, "-m", "jobs.train", "--data", str(jpeg_tree), "--preset", "imagenet"]
    args += ["--device", "cuda", "--amp", "bf16", "--epochs", "2", "--batch-size", "32", "--val-fraction", "0.25"]
    args += ["--storage-path", str(tmp_path), "--name", "gpu"]
    done = subprocess.run(
        args, cwd=REPO, env={**os.environ, "RAY_ADDRESS": ""}, capture_output=True, text=True, timeout=600
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    # a share of the trainer's GPU; a task given one where torch finds no CUDA fails the run
    # (training.stream.stage.task_device), so a run that finishes augmented on the GPU
    assert "augment tasks x (0.0625 GPU + 1 CPU)" in out, out[-4000:]
    (plan,) = [line for line in out.splitlines() if line.startswith("plan: ")]
    named = "nvImageCodec" if engines.available() else "nvjpeg"  # the decoder this environment has (ingest.gpu_decoder)
    assert named in plan, plan
    summary = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["epochs"] == 2 and summary["bad_files"] == 1
    assert all(c["exactly_once"] for c in summary["coverage"]), summary["coverage"]
    assert summary["train_images"] + summary["val_images"] == 161  # the split counts the bad file too
    assert summary["val_acc"] > 0.25  # four tinted classes: better than chance after two epochs
    # every trained image decoded on the GPU (the truncated one is a bad file, not a CPU decode)
    decoded = summary["decoded_on"]
    assert decoded["cpu"] == 0 and decoded["engines"] + decoded["gpu_sms"] > 0, decoded


@pytest.mark.parametrize("decoder", ["nvjpeg", "nvimgcodec"])
def test_the_batched_decoder_never_writes_over_memory_the_callers_queued_kernels_read(decoder):
    """pytorch/vision#9606's reproducer through each batched decoder (augment.decode.decode_cuda,
    augment.engines.decode_regions), in a process of its own with the stream-ordered allocator
    (tests/gpu_ordering.py): freed victims and the last batch's freed outputs with reads queued
    behind a stalled stream, and checksums queued right after each decode. Unordered, the
    decoder writes them before those reads run (199 of 200 iterations corrupted on an H100 in
    #9606's report), or is read before it has written."""
    from augment import engines

    if decoder == "nvimgcodec" and not engines.available():
        pytest.skip("nvImageCodec is not installed (pip install -e '.[gpu]')")
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    args = [sys.executable, "-m", "tests.gpu_ordering", decoder, "--iterations", "200"]
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["iterations"] == 200
    assert result["corrupted"] == {"victims": 0, "last_outputs": 0, "checksums": 0}, result


@pytest.mark.parametrize("name", ["imagenet", "cifar"])
def test_the_fused_kernel_compiles_and_gives_the_cpus_pixels_on_cuda(name):
    """augment/fused.py's kernel compiled for this GPU (the CPU tests run it through Triton's
    interpreter): images on the device in both layouts its decoders give, the same draws as the
    CPU's float32 torch path, its bytes within a level; eval too."""
    from augment import fused
    from augment.pipeline import Pipeline as Pipe

    if not fused.available(torch.device("cuda")):
        pytest.skip("Triton is not installed with this torch")
    images = list(_photos(12))
    on_gpu = [torch.from_numpy(im).cuda() for im in images]
    on_gpu[1::2] = [im.permute(2, 0, 1).contiguous().permute(1, 2, 0) for im in on_gpu[1::2]]  # nvjpeg's CHW
    for specs in (PRESETS[name].train, PRESETS[name].eval):
        cpu_pipe, gpu_pipe = Pipe(specs, seed=5).at_epoch(1), Pipe(specs, seed=5).to("cuda").at_epoch(1)
        sizes, keys = torch.tensor([im.shape[:2] for im in images]), torch.arange(12) * 7919
        expected = cpu_pipe.finish(cpu_pipe.request(sizes, keys), images, path="ragged")
        got = gpu_pipe.finish(gpu_pipe.request(sizes.cuda(), keys.cuda()), on_gpu, path="fused")
        torch.cuda.synchronize()
        assert got.device.type == "cuda" and got.shape == expected.shape
        assert int((got.cpu().int() - expected.int()).abs().max()) <= 1, name


def test_the_feed_copies_pinned_batches_to_the_gpu_on_its_own_stream():
    from training.worker.feed import BatchFeed

    batches = [
        {"image": torch.full((4, 8, 8, 3), i, dtype=torch.uint8).pin_memory(), "key": torch.arange(4)} for i in range(5)
    ]
    with BatchFeed(iter(batches), device=torch.device("cuda")) as feed:
        got = [(b["image"].device.type, int(b["image"].float().mean())) for b in feed]
    assert got == [("cuda", i) for i in range(5)]
