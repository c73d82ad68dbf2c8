"""The recipe staples through the whole job on the shared Ray cluster, two runs in all (a Ray Train
start-up costs 12-15 s): one of two DDP ranks with most flags folded in (the EMA saved and
validated, the early stop, the class weights and the plan line's imbalance, accumulation, the
frozen epoch's re-wrap, the backbone's rate, clipping), and one with the balanced sampler, whose
coverage the audit checks against each epoch's draw (tests/conftest.py's tracked_run, which
other files' checks share)."""

from __future__ import annotations

import csv
import json

import numpy as np
import torch

from tests.conftest import prepare, write_tree
from training.config import TrainConfig
from training.driver import job


def _run(log, **overrides):
    cfg, tree, preset = prepare(TrainConfig(**overrides))
    return job.run(cfg, tree, preset, log=log, own_cluster=True), tree


def test_ema_early_stop_class_weights_and_accumulation_on_two_ranks(ray_cluster, tmp_path):
    from augment.decode import decode_image
    from training.predict.inference import Predictor, load_model_file

    data = write_tree(tmp_path / "data", {"many": 40, "few": 8, "some": 16})
    lines = []
    summary, tree = _run(
        lines.append,
        data=str(data),
        storage_path=str(tmp_path / "runs"),
        name="staples",
        epochs=4,
        batch_size=8,
        num_workers=2,
        lr=1e-7,  # the weights barely move: epoch 2's val_acc is epoch 1's, no better: the early stop
        early_stop=1,
        model_ema=0.9,
        class_weights="balanced",
        grad_accum=2,
        freeze_epochs=1,
        backbone_lr_scale=0.5,
        clip_grad_norm=1.0,
    )
    run_dir = tmp_path / "runs" / "staples"
    counts = tree.class_counts
    plan = next(line for line in lines if line.startswith("plan: "))
    ratio = max(counts) / min(counts)
    assert f"classes: 3, largest {max(counts)} / smallest {min(counts)} images ({ratio:.1f}x)" in plan
    assert "--class-weights balanced" in plan
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [r["epoch"] for r in rows] == ["1", "2"] and summary["epochs"] == 2  # stopped before --epochs 4
    assert rows[0]["val_acc"] == rows[1]["val_acc"]
    stop = f"early stop: no better val_acc for 1 epochs (best {float(rows[0]['val_acc']):.4f} at epoch 1)"
    assert any(line.startswith(stop) for line in lines), lines
    assert all(0 <= float(r["val_acc_ema"]) <= 1 for r in rows)
    assert any(f"val_acc_ema {float(rows[1]['val_acc_ema']):.4f}" in line for line in lines if "epoch   2/4" in line)
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert (config["model_ema"], config["grad_accum"], config["early_stop"]) == (0.9, 2, 1)
    (checkpoint,) = sorted(run_dir.glob("checkpoint_epoch_0002*/checkpoint.pt"))
    learner = torch.load(checkpoint, weights_only=True)["learner"]
    assert [g["lr_scale"] for g in learner["optimizer"]["param_groups"]] == [1.0, 1.0, 0.5, 0.5]
    ema = load_model_file(str(run_dir / "model_ema.pt"))  # model.pt's format: jobs.predict takes it
    for name, value in learner["ema"].items():
        assert torch.equal(ema.state_dict[name], value), name
    assert any(not torch.equal(ema.state_dict[k], learner["model"][k]) for k in learner["model"])
    images = np.empty(2, dtype=object)
    images[:] = [decode_image(open(p, "rb").read()) for p in tree.val.paths[:2]]
    out = Predictor(ema)({"image": images, "label": np.zeros(2, np.int64), "path": np.array(["a", "b"], dtype=object)})
    assert len(out["pred"]) == 2


def test_the_balanced_sampler_trains_each_epochs_draw_and_the_audit_knows(tracked_run):
    """One worker, --sampler balanced on 40 + 8 images: the run of tests/conftest.py (tracked_run), whose two
    epochs before its stop rule are this test's."""
    _, result, _, lines, _, _ = tracked_run
    summary = result.summary
    assert any("--sampler balanced" in line for line in lines if line.startswith("plan: "))
    assert [c["sampled"] for c in summary["coverage"]] == [True, True]
    assert [c["as_expected"] for c in summary["coverage"]] == [True, True], summary["coverage"]
    assert all(c["repeated"] > 0 for c in summary["coverage"])  # drawn with replacement
