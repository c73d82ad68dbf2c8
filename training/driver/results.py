"""What a finished run leaves in its directory: model.pt and model_best.pt (everything
inference needs), the plots, TensorBoard files, bad_files.csv and summary.json."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import time

import ray
import torch

from augment.decode import DECODE_PLACES
from augment.presets import Preset
from training import storage
from training.bounds import steady_verdict
from training.config import TrainConfig
from training.driver import plots
from training.driver.audit import coverage, fingerprints, good_images, sampled_coverage
from training.driver.planning import ResourcePlan
from training.driver.tracking import parse_log_to
from training.forms.data import ImageTree
from training.model import model_source, torchvision_model, uses_small_stem
from training.modelfile import ModelFile
from training.records import RunRecord
from training.weights import model_kind, weights_record


@dataclasses.dataclass(frozen=True)
class BestEpoch:
    """model_best.pt's weights and their epoch (1-based: the best validation accuracy among the
    checkpoints kept), and model_ema.pt's (the last checkpoint's EMA; None without --model-ema)."""

    model: dict
    epoch: int
    ema: dict | None = None


def report_bad_files(bad_log, run_dir: str, log) -> None:
    bad = ray.get(bad_log.get.remote())
    if bad:
        write_bad_files(run_dir, bad)
        where = storage.join(run_dir, "bad_files.csv")
        log(f"skipped {len(bad)} unreadable image(s), listed with reasons in {where}")


def write_results(
    cfg, tree, preset, plan, run: RunRecord, model: dict, bad: dict, *, start: float, log, faults=(), best=None
) -> dict:
    """model.pt (`model`: the last epoch's weights), model_best.pt (the best validation accuracy's:
    `best`, a BestEpoch from _fit; the last epoch's where None), model_ema.pt (best.ema, with --model-ema),
    the plots, TensorBoard files and summary.json
    from the last checkpoint's records; `faults`: FaultLog.records() of the faults this invocation
    survived."""
    run_dir = cfg.run_dir
    best = best or BestEpoch(model, run.last_epoch + 1)
    names = tree.class_names
    storage.write_bytes(storage.join(run_dir, "model.pt"), model_bytes(model, names, preset, cfg))
    storage.write_bytes(storage.join(run_dir, "model_best.pt"), model_bytes(best.model, names, preset, cfg))
    if best.ema is not None:  # --model-ema: the weights' average, in model.pt's format
        storage.write_bytes(storage.join(run_dir, "model_ema.pt"), model_bytes(best.ema, names, preset, cfg))
    storage.write_bytes(storage.join(run_dir, "curves.png"), plots.curves_png(run.epochs))
    confusion = plots.confusion_png(run.epochs[-1].val.confusion, list(tree.class_names))
    storage.write_bytes(storage.join(run_dir, "confusion.png"), confusion)
    live = "tensorboard" in parse_log_to(cfg.log_to)  # the run wrote its event files as it went
    if live or plots.write_tensorboard(run_dir, run.epochs):
        logdir = storage.join(run_dir, "tensorboard")
        # tensorboardX writes the files without TensorBoard itself, which has the viewer
        viewer = "" if shutil.which("tensorboard") else "pip install tensorboard, then "
        log(f"tensorboard: {viewer}tensorboard --logdir {logdir}")
    sampled = cfg.seed if cfg.sampler == "balanced" else None
    summary = summarize(run, start, plan, tree, bad, sampled) | {"faults": list(faults), "best_epoch": best.epoch}
    for c in summary["coverage"]:
        if c["as_expected"] is False and c.get("sampled"):
            log(f"warning: epoch {c['epoch']} trained on {c['seen']} rows, its balanced draw held {c['drawn']}")
        elif c["as_expected"] is False:
            log(
                f"warning: epoch {c['epoch']} trained on {c['seen']} rows of {c['distinct']} distinct images, "
                f"expected each of {c['expected']} once ({c['repeated']} repeated, {c['missing']} missing)"
            )
    storage.write_json(storage.join(run_dir, "summary.json"), summary)
    return summary


def model_bytes(state_dict, class_names, preset: Preset, cfg: TrainConfig) -> bytes:
    """model.pt: everything inference needs, loadable with torch.load(weights_only=True)."""
    buf = io.BytesIO()
    small_stem = uses_small_stem(cfg.small_stem, preset.image_size, cfg.model)
    width = state_dict["conv1.weight"].shape[0] if small_stem else 64
    model = ModelFile(
        arch=cfg.model,
        state_dict=state_dict,
        class_names=tuple(class_names),
        image_size=preset.image_size,
        small_stem=small_stem,
        eval_transform={"ops": json.loads(json.dumps(preset.eval)), "mean": list(preset.mean), "std": list(preset.std)},
        # the same model and eval steps for torchvision alone (docs/guide.md, "Prediction and evaluation")
        torchvision_model=torchvision_model(
            cfg.model, len(class_names), small_stem=small_stem, image_size=preset.image_size, width=width
        )
        if model_kind(cfg.model) == "torchvision"
        else None,
        model_source=model_source(
            cfg.model, len(class_names), small_stem=small_stem, image_size=preset.image_size, width=width
        ),
        weights=weights_record(cfg),
        torchvision_eval=torchvision_eval(preset),
        config=cfg.to_dict(),
    )
    torch.save(model.to_state(), buf)
    return buf.getvalue()


def models_of_a_stopped_run(run_dir: str, checkpoints: list[str]) -> int | None:
    """model.pt (the last checkpoint's weights) and model_best.pt (the kept checkpoint of the best
    val_acc) of a run that was ended between epochs without writing them (a sweep's trial that the
    scheduler stopped), from its `checkpoints` (their folders, the job's and Ray Train's own format)
    and its config.json, as a finished run writes them; the last epoch, None where none is complete."""
    from augment.presets import preset_from_dict
    from training.worker.report import DamagedCheckpoint, load_checkpoint

    saved = json.loads(storage.read_bytes(storage.join(run_dir, "config.json")))
    cfg = TrainConfig(**saved["config"])
    preset = preset_from_dict(saved["preset"])
    kept = []  # (epoch, val_acc, weights)
    for folder in checkpoints:
        with ray.train.Checkpoint(folder).as_directory() as d:
            try:
                state = load_checkpoint(d, map_location="cpu")
            except DamagedCheckpoint:
                continue
        run = RunRecord.from_state(state["records"])
        kept.append((run.last_epoch + 1, run.epochs[-1].val.acc, state["learner"]["model"]))
    if not kept:
        return None
    last, best = max(kept, key=lambda k: k[0]), max(kept, key=lambda k: (k[1], k[0]))
    names = saved["class_names"]
    storage.write_bytes(storage.join(run_dir, "model.pt"), model_bytes(last[2], names, preset, cfg))
    storage.write_bytes(storage.join(run_dir, "model_best.pt"), model_bytes(best[2], names, preset, cfg))
    return last[0]


def torchvision_eval(preset: Preset) -> list | None:
    """The preset's eval transform as torchvision.transforms.v2 steps after PILToTensor (model.pt's
    `torchvision_eval`, plain data: [class name, keyword arguments]; an interpolation and a dtype by
    name). resize_center_crop is Resize (shorter side, antialiased bilinear: torch's, which the eval
    ops use) then CenterCrop. None where an eval op has no such step."""
    steps = []
    for spec in json.loads(json.dumps(preset.eval)):
        ((name, args),) = spec.items()
        if name == "resize_center_crop":
            steps.append(["Resize", {"size": args["resize"], "interpolation": "bilinear", "antialias": True}])
        elif name != "center_crop":
            return None
        steps.append(["CenterCrop", {"size": args["size"]}])
    normalize = {"mean": list(preset.mean), "std": list(preset.std)}
    return [*steps, ["ToDtype", {"dtype": "float32", "scale": True}], ["Normalize", normalize]]


def write_bad_files(run_dir: str, bad: dict[str, str]) -> None:
    storage.write_csv(
        storage.join(run_dir, "bad_files.csv"), [{"path": p, "reason": r} for p, r in sorted(bad.items())]
    )


def summarize(
    run: RunRecord, start: float, plan: ResourcePlan, tree: ImageTree, bad: dict[str, str], sampled=None
) -> dict:
    """summary.json's figures; `sampled`: the seed of a --sampler balanced run (its coverage is
    checked against each epoch's draw)."""
    epochs, last = run.epochs, run.epochs[-1]
    steady = epochs[1:] or epochs  # skip the first epoch (actor start-up) when there is more than one
    this_run = [t for t in run.first_steps if t >= start]  # first steps of this invocation's attempts
    confusion = last.val.confusion
    seconds = sum(e.train.epoch_s for e in steady)

    def steady_mean(figure) -> float:  # over the steady epochs, weighed by their seconds
        return sum(figure(e.train) * e.train.epoch_s for e in steady) / seconds

    summary = {
        "epochs": last.epoch,
        "val_acc": last.val.acc,
        "val_loss": last.val.loss,
        "best_val_acc": max(e.val.acc for e in epochs),
        "train_loss": last.train.loss,
        "train_acc": last.train.acc,
        "train_images_per_s": round(steady_mean(lambda t: t.images_per_s), 1),
        "data_wait_frac": round(steady_mean(lambda t: t.data_wait_frac), 4),
        # within epochs, their start and tail left out (timings.csv)
        "train_images_per_s_inner": round(steady_mean(lambda t: t.inner_images_per_s), 1),
        "decoded_on": {p: sum(e.train.decoded_on(p) for e in epochs) for p in DECODE_PLACES},
        "wall_s": round(time.time() - start, 1),
        "bound": steady_verdict(run.slots, [(e.train.steady_s, e.bound) for e in epochs]),  # the steady epochs'
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
        "coverage": coverage(run.seen, tree, bad)
        if sampled is None
        else sampled_coverage(run.seen, tree, bad, sampled),
        "fingerprints": fingerprints(run.seen),
        "bad_files": len(bad),
        "resumed_at_epochs": run.resumed_at_epochs,
        "ranks": run.ranks,
    }
    if last.val.top5 is not None:
        summary["val_top5"] = last.val.top5
    return summary
