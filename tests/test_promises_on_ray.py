"""Promises of the README and docs/guide.md that need the session's Ray cluster: a rerun resumes from the latest
checkpoint even where an earlier one scored better, and evaluation (validation and
jobs.predict) decodes photos at full size where training may decode them at a reduced one."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image

from augment.presets import PRESETS
from training.config import TrainConfig
from training.forms.tree import scan_tree


def test_a_rerun_resumes_from_the_latest_checkpoint_when_an_earlier_one_scored_better(ray_cluster, tmp_path):
    """README.md, "What a run writes": the best checkpoint by validation accuracy and the latest
    are kept, and a rerun of the name goes on from the latest. Ray Train with the job's own
    CheckpointConfig (training/driver/job.py checkpoint_config) over reports whose scores fall and rise."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from training.driver.job import checkpoint_config

    def train_fn(config):
        import os
        import tempfile

        start, checkpoint = 0, ray.train.get_checkpoint()
        if checkpoint:
            with checkpoint.as_directory() as d, open(os.path.join(d, "epoch.json")) as f:
                start = json.load(f)
        with open(config["seen"], "a") as f:
            f.write(f"{start}\n")
        for epoch in range(start + 1, config["epochs"] + 1):
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "epoch.json"), "w") as f:
                    json.dump(epoch, f)
                checkpoint = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"val_acc": config["val_acc"][epoch - 1]}, checkpoint=checkpoint)

    def fit(epochs):
        loop = {"epochs": epochs, "val_acc": [0.9, 0.5, 0.7], "seen": str(tmp_path / "seen")}
        run = ray.train.RunConfig(name="r", storage_path=str(tmp_path), checkpoint_config=checkpoint_config())
        TorchTrainer(
            train_fn, train_loop_config=loop, scaling_config=ray.train.ScalingConfig(num_workers=1), run_config=run
        ).fit()
        return sorted(json.loads(p.read_text()) for p in (tmp_path / "r").glob("checkpoint_*/epoch.json"))

    assert fit(2) == [1, 2]  # epoch 1 the best (0.9), epoch 2 the latest (0.5)
    assert fit(3) == [1, 3]  # the rerun went on from epoch 2; epoch 3 (0.7) replaced it as the latest
    assert (tmp_path / "seen").read_text().split() == ["0", "2"]


def _photos(root, n=6) -> None:
    """Detailed 1024 x 768 JPEGs: a reduced-size decode of them gives other pixels."""
    rng = np.random.default_rng(0)
    for cls in ("bark", "sand"):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            coarse = Image.fromarray(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8)).resize((1024, 768))
            fine = rng.integers(-40, 40, (768, 1024, 3))
            pixels = np.clip(np.asarray(coarse, dtype=np.int64) + fine, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / cls / f"{i}.jpg", quality=92)


def _decoded(path, scale: int = 1) -> np.ndarray:
    """The file decoded whole (scale 1), or at 1/scale with libjpeg's scaled DCT."""
    with Image.open(path) as img:
        if scale > 1:
            img.draft("RGB", (img.width // scale, img.height // scale))
        return np.asarray(img.convert("RGB"))


def _eval_views(paths, preset, scale: int = 1) -> torch.Tensor:
    """The preset's eval ops on each file's decode: uint8 (B, S, S, 3)."""
    from augment.batch import augment_batch
    from augment.pipeline import Pipeline

    images = np.empty(len(paths), dtype=object)
    images[:] = [_decoded(p, scale) for p in paths]
    keys = torch.zeros(len(paths), dtype=torch.int64)
    return augment_batch(Pipeline(preset.eval, seed=0), images, keys, 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("full-size") / "photos"
    _photos(root)
    return root


def test_validation_decodes_photos_at_full_size_where_training_shrinks_them(ray_cluster, photos):
    import ray

    from training.driver import planning
    from training.stream.ingest import build_datasets, choose_decode
    from training.stream.stamp import EpochClock

    cfg = TrainConfig(data=str(photos), preset="imagenet", val_fraction=0.5)
    tree, preset = scan_tree(str(photos), 0.5), PRESETS["imagenet"]
    assert len(tree.val) >= 3
    decode = choose_decode(cfg.decode, tree.train, preset.train, use_gpu=False)
    assert decode.where == "augment" and decode.shrink  # training decodes these JPEGs at a reduced size
    clock = ray.remote(num_cpus=0)(EpochClock).remote()
    plan = planning.plan_resources(cfg, planning.Capacity(cpus=2, gpus=0, hosts=1))
    val = build_datasets(cfg, tree, preset, plan, clock, decode=decode)["val"]
    got = {
        int(k): img
        for b in val.iter_batches(batch_size=None, batch_format="numpy")
        for k, img in zip(b["key"], b["image"], strict=True)
    }
    paths = [f"{photos}/{p}" for p in tree.val.rel_paths]
    assert sorted(got) == sorted(int(k) for k in tree.val.keys)
    full, half = _eval_views(paths, preset), _eval_views(paths, preset, scale=2)
    served = torch.stack([torch.from_numpy(got[int(k)]) for k in tree.val.keys])
    assert torch.equal(served, full)
    assert (half.int() - full.int()).abs().float().mean() > 0.5  # a reduced-size decode would not pass


def test_predict_decodes_photos_at_full_size(ray_cluster, photos, tmp_path):
    """jobs.predict's confidences are the model's on the eval view of the full decode."""
    from augment.ops import Normalize
    from jobs.predict import main
    from training.driver.results import model_bytes
    from training.model import resnet18

    tree, preset = scan_tree(str(photos), 0.2), PRESETS["imagenet"]
    torch.manual_seed(0)
    model = resnet18(tree.num_classes, small_stem=False).eval()
    (tmp_path / "model.pt").write_bytes(model_bytes(model.state_dict(), tree.class_names, preset, TrainConfig()))
    out = tmp_path / "p.csv"
    assert main(["--model", str(tmp_path / "model.pt"), "--data", str(photos), "--out", str(out)]) == 0
    with open(out, newline="") as f:
        rows = {r["path"]: float(r["confidence"]) for r in csv.DictReader(f)}
    paths = sorted(rows)
    normalize = Normalize(preset.mean, preset.std)

    def confidences(scale):
        with torch.no_grad():
            return model(normalize(_eval_views([photos / p for p in paths], preset, scale))).softmax(1).amax(1)

    full, half = confidences(1), confidences(2)
    got = torch.tensor([rows[p] for p in paths])
    assert torch.allclose(got, full, atol=2e-6)  # the CSV has 6 decimals
    assert (half - full).abs().max() > 1e-4  # a reduced-size decode would not pass
