"""What a finished run leaves in its directory: model.pt and model_best.pt (everything
inference needs), the plots, TensorBoard files, bad_files.csv and summary.json."""

from __future__ import annotations

import json
import shutil
import time

import ray
import torch

from augment.decode import DECODE_PLACES
from augment.presets import Preset
from training import artifacts, plots
from training.audit import coverage, fingerprints, good_images
from training.bounds import steady_verdict
from training.config import TrainConfig
from training.data import ImageTree
from training.model import uses_small_stem
from training.planning import ResourcePlan


def report_bad_files(bad_log, run_dir: str, log) -> None:
    bad = ray.get(bad_log.get.remote())
    if bad:
        write_bad_files(run_dir, bad)
        where = artifacts.join(run_dir, "bad_files.csv")
        log(f"skipped {len(bad)} unreadable image(s), listed with reasons in {where}")


def write_results(
    cfg, tree, preset, plan, state: dict, bad: dict, *, start: float, log, faults=(), best: dict | None = None
) -> dict:
    """model.pt (the last epoch's weights), model_best.pt (the best validation accuracy's: `best`,
    from _fit; the last epoch's where None), the plots, TensorBoard files and summary.json from
    the last checkpoint; `faults`: FaultLog.records() of the faults this invocation survived."""
    run_dir = cfg.run_dir
    best = best or {"model": state["model"], "epoch": state["epoch"] + 1, "val_acc": state["history"][-1]["val_acc"]}
    artifacts.write_bytes(artifacts.join(run_dir, "model.pt"), model_bytes(state["model"], tree, preset, cfg))
    artifacts.write_bytes(artifacts.join(run_dir, "model_best.pt"), model_bytes(best["model"], tree, preset, cfg))
    artifacts.write_bytes(artifacts.join(run_dir, "curves.png"), plots.curves_png(state["history"]))
    artifacts.write_bytes(
        artifacts.join(run_dir, "confusion.png"), plots.confusion_png(state["confusion"], list(tree.class_names))
    )
    if plots.write_tensorboard(run_dir, state["history"], state["timings"]):
        logdir = artifacts.join(run_dir, "tensorboard")
        # tensorboardX writes the files without TensorBoard itself, which has the viewer
        viewer = "" if shutil.which("tensorboard") else "pip install tensorboard, then "
        log(f"tensorboard: {viewer}tensorboard --logdir {logdir}")
    summary = summarize(state, start, plan, tree, bad) | {"faults": list(faults), "best_epoch": best["epoch"]}
    for c in summary["coverage"]:
        if c["as_expected"] is False:
            log(
                f"warning: epoch {c['epoch']} trained on {c['seen']} rows of {c['distinct']} distinct images, "
                f"expected each of {c['expected']} once ({c['repeated']} repeated, {c['missing']} missing)"
            )
    artifacts.write_json(artifacts.join(run_dir, "summary.json"), summary)
    return summary


def model_bytes(state_dict, tree: ImageTree, preset: Preset, cfg: TrainConfig) -> bytes:
    """model.pt: everything inference needs, loadable with torch.load(weights_only=True)."""
    import io

    buf = io.BytesIO()
    torch.save(
        {
            "arch": cfg.model,
            "state_dict": state_dict,
            "class_names": list(tree.class_names),
            "image_size": preset.image_size,
            "small_stem": uses_small_stem(cfg.small_stem, preset.image_size, cfg.model),
            "eval_transform": {
                "ops": json.loads(json.dumps(preset.eval)),
                "mean": list(preset.mean),
                "std": list(preset.std),
            },
            "config": cfg.to_dict(),
        },
        buf,
    )
    return buf.getvalue()


def write_bad_files(run_dir: str, bad: dict[str, str]) -> None:
    artifacts.write_csv(
        artifacts.join(run_dir, "bad_files.csv"), [{"path": p, "reason": r} for p, r in sorted(bad.items())]
    )


def summarize(state: dict, start: float, plan: ResourcePlan, tree: ImageTree, bad: dict[str, str]) -> dict:
    history, timings = state["history"], state["timings"]
    last = history[-1]
    steady = timings[1:] or timings  # skip the first epoch (actor start-up) when there is more than one
    this_run = [t for t in state.get("first_steps", []) if t >= start]  # first steps of this invocation's attempts
    confusion = state["confusion"]
    summary = {
        "epochs": last["epoch"],
        "val_acc": last["val_acc"],
        "val_loss": last["val_loss"],
        "best_val_acc": max(r["val_acc"] for r in history),
        "train_loss": last["train_loss"],
        "train_acc": last["train_acc"],
        "train_images_per_s": round(
            sum(t["images_per_s"] * t["epoch_s"] for t in steady) / sum(t["epoch_s"] for t in steady), 1
        ),
        "data_wait_frac": round(
            sum(t["data_wait_frac"] * t["epoch_s"] for t in steady) / sum(t["epoch_s"] for t in steady), 4
        ),
        "train_images_per_s_inner": round(  # within epochs, their start and tail left out (timings.csv)
            sum(float(t.get("inner_images_per_s") or 0) * t["epoch_s"] for t in steady)
            / sum(t["epoch_s"] for t in steady),
            1,
        ),
        "decoded_on": {p: sum(int(t.get(f"decoded_{p}") or 0) for t in timings) for p in DECODE_PLACES},
        "wall_s": round(time.time() - start, 1),
        "bound": steady_verdict(state.get("slots"), timings),  # what bounded the steady epochs
        # launch to the end of this invocation's first training step: imports, Ray, the trainer
        # and the data pipeline starting (a rerun that resumes counts its own)
        "startup_s": round(min(this_run) - start, 1) if this_run else None,
        "world_size": plan.num_workers,
        "device": "cuda" if plan.use_gpu else "cpu",
        "num_classes": tree.num_classes,
        "train_images": len(tree.train),  # files found
        "train_images_trained": int(good_images(tree.train, bad).size),  # those that decode
        "val_images": len(tree.val),
        "per_class_val_acc": {
            name: round(row[i] / sum(row), 6) if sum(row) else None
            for i, (name, row) in enumerate(zip(tree.class_names, confusion, strict=True))
        },
        "coverage": coverage(state["seen"], tree, bad),
        "fingerprints": fingerprints(state["seen"]),
        "bad_files": len(bad),
        "resumed_at_epochs": state["resumed_at_epochs"],
        "ranks": state["ranks"],
    }
    if "val_top5" in last:
        summary["val_top5"] = last["val_top5"]
    return summary
