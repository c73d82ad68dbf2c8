"""Batch inference with a saved model.pt: Ray Data reads and decodes the images, actors
apply the saved eval transform and the model to whole batches.

    info = load_model_file("runs/photos/model.pt")          # ModelFileError: exit 2
    rows = predict(info, "~/photos", split="all")           # [{path, label, pred, prob}], by path
    write_predictions_csv(rows, "predictions.csv", info["class_names"])

A file's label is the position, in the model's class names, of its directory's name
(DIR/<class>/img or DIR/val/<class>/img); -1 when that directory is not a class.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import PurePosixPath

import numpy as np
import torch

from training.data import DataError, _filesystem, _list_images, decode_image, scan_tree, stack_images

MODEL_KEYS = ("arch", "state_dict", "class_names", "image_size", "small_stem", "eval_transform")


class ModelFileError(ValueError):
    """The --model file is missing or not a model.pt written by jobs.train."""


def load_model_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise ModelFileError(
            f"--model {path}: no such file; give the model.pt of a run directory (runs/<name>/model.pt)"
        )
    try:
        info = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle, zip and torch errors alike mean "not a model.pt"
        raise ModelFileError(f"--model {path}: not a model.pt written by jobs.train ({type(e).__name__})") from None
    missing = [k for k in MODEL_KEYS if not isinstance(info, dict) or k not in info]
    if missing:
        raise ModelFileError(
            f"--model {path}: missing {missing}; give the model.pt of a run directory (runs/<name>/model.pt)"
        )
    if info["arch"] != "resnet18":
        raise ModelFileError(f"--model {path}: architecture {info['arch']!r}; only resnet18 is supported")
    return info


def list_inputs(root: str, class_names, split: str = "all", val_fraction: float = 0.2):
    """(paths, labels, rel_paths) of the images to predict. split="val": the validation split
    training used (DIR/val, or the hash split by val_fraction); "all": every image below DIR."""
    index = {name: i for i, name in enumerate(class_names)}
    fs, base, prefix = _filesystem(root)
    if split == "val":
        tree = scan_tree(root, val_fraction)
        paths = list(tree.val.paths)
    else:
        import pyarrow.fs as pafs

        if fs.get_file_info(base).type != pafs.FileType.Directory:
            raise DataError(f"{root}: no such directory; pass --data with a folder of images")
        paths = [prefix + p for p, _ in _list_images(fs, base)]
    if not paths:
        raise DataError(
            f"{root}: no images found"
            + (" in the validation split" if split == "val" else "")
            + "; point --data at a folder of images"
        )
    rel = [str(PurePosixPath(p.split("://", 1)[-1]).relative_to(base)) for p in paths]
    labels = [index.get(PurePosixPath(r).parent.name, -1) for r in rel]
    return paths, labels, rel


class _Decode:
    """{bytes, path} -> {image, label, path}; an unreadable file is dropped (the driver
    names the files that did not come back)."""

    def __init__(self, meta: dict):
        self._meta = meta  # path without scheme -> (relative path, label)

    def __call__(self, batch: dict) -> dict:
        images, labels, rels = [], [], []
        for path, data in zip(batch["path"], batch["bytes"], strict=True):
            try:
                images.append(decode_image(data))
            except (ValueError, OSError):
                continue
            rel, label = self._meta[path]
            rels.append(rel)
            labels.append(label)
        return {
            "image": stack_images(images),
            "label": np.array(labels, dtype=np.int64),
            "path": np.array(rels, dtype=object),
        }


class Predictor:
    """map_batches actor: builds the model and the eval transform once, then scores whole
    batches: {image, label, path} -> {path, label, pred, prob}."""

    def __init__(self, info: dict, device: str = "cpu"):
        from augment.ops import Normalize
        from augment.presets import Pipeline
        from training.model import resnet18

        self.device = torch.device(device)
        t = info["eval_transform"]
        self.pipeline = Pipeline(t["ops"], seed=0).to(self.device)
        self.normalize = Normalize(t["mean"], t["std"]).to(self.device)
        self.model = resnet18(len(info["class_names"]), small_stem=info["small_stem"])
        self.model.load_state_dict(info["state_dict"])
        self.model.to(self.device).eval()

    @torch.no_grad()
    def __call__(self, batch: dict) -> dict:
        from augment.batch import augment_batch

        n = len(batch["label"])
        if n == 0:
            return {
                "path": batch["path"],
                "label": batch["label"],
                "pred": np.zeros(0, np.int64),
                "prob": np.zeros(0, np.float32),
            }
        keys = torch.zeros(n, dtype=torch.int64)  # the eval ops draw nothing; keys are unused
        x = augment_batch(self.pipeline, batch["image"], keys, 0, self.device)  # uint8 (B, S, S, 3)
        probs = self.model(self.normalize(x)).float().softmax(1)
        prob, pred = probs.max(1)
        return {
            "path": batch["path"],
            "label": batch["label"],
            "pred": pred.cpu().numpy(),
            "prob": prob.cpu().numpy(),
        }  # .cpu(): a sync point


def _dataset(root: str, info: dict, split: str, val_fraction: float):
    """Ray Dataset {image, label, path} from an image tree or a prepared (Parquet) directory,
    and the relative paths expected back."""
    import ray.data

    from training import parquet

    if parquet.is_prepared(root):
        tree = parquet.scan_prepared(root)
        splits = [tree.val] if split == "val" else [tree.train, tree.val]
        shards = [s for sp in splits for s in sp.shards]
        if list(tree.class_names) != list(info["class_names"]):
            raise DataError(
                f"{root}: prepared with classes {list(tree.class_names)}, the model has {list(info['class_names'])}"
            )

        expected = [
            str(PurePosixPath(p).relative_to(PurePosixPath(tree.train.source))) for sp in splits for p in sp.paths
        ]
        ds = ray.data.read_parquet(shards).select_columns(["bytes", "label", "key", "path"])
        return ds.map_batches(
            parquet.PreparedDecoder(tree.train.source, keep_path=True), batch_format="numpy", batch_size=64
        ), expected
    paths, labels, rel = list_inputs(root, info["class_names"], split, val_fraction)
    meta = {p.split("://", 1)[-1]: (r, lab) for p, r, lab in zip(paths, rel, labels, strict=True)}
    ds = ray.data.read_binary_files(paths, include_paths=True).map_batches(
        _Decode(meta), batch_format="numpy", batch_size=64
    )
    return ds, rel


def predict(
    info: dict,
    root: str,
    *,
    split: str = "all",
    val_fraction: float = 0.2,
    batch_size: int = 256,
    actors: int = 1,
    device: str = "auto",
) -> tuple[list[dict], list[str]]:
    """Score every image; returns (rows sorted by path, relative paths that could not be read)."""
    import ray

    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    ds, expected = _dataset(root, info, split, val_fraction)
    ds = ds.map_batches(
        Predictor,
        fn_constructor_kwargs={"info": info, "device": device},
        batch_format="numpy",
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_gpus=1 if device == "cuda" else 0,
        num_cpus=1,
    )
    rows = []
    for batch in ds.iter_batches(batch_format="numpy", batch_size=None):
        rows += [
            {"path": str(p), "label": int(lab), "pred": int(pr), "prob": float(pb)}
            for p, lab, pr, pb in zip(batch["path"], batch["label"], batch["pred"], batch["prob"], strict=True)
        ]
    rows.sort(key=lambda r: r["path"])
    unread = sorted(set(expected) - {r["path"] for r in rows})
    return rows, unread


def write_predictions_csv(rows: list[dict], out: str, class_names) -> None:
    """path, predicted, confidence, label (empty when the file's directory is not a class)."""
    from training import artifacts

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["path", "predicted", "confidence", "label"])
    for r in rows:
        w.writerow(
            [r["path"], class_names[r["pred"]], f"{r['prob']:.6f}", class_names[r["label"]] if r["label"] >= 0 else ""]
        )
    artifacts.write_bytes(out, buf.getvalue().encode())


def accuracy(rows: list[dict]) -> tuple[int, int]:
    """(correct, labelled) over the rows whose label is known."""
    labelled = [r for r in rows if r["label"] >= 0]
    return sum(r["pred"] == r["label"] for r in labelled), len(labelled)


def confusion_matrix(rows: list[dict], num_classes: int) -> list[list[int]]:
    """Rows: true class, columns: predicted; unlabelled rows are left out."""
    m = np.zeros((num_classes, num_classes), dtype=np.int64)
    for r in rows:
        if r["label"] >= 0:
            m[r["label"], r["pred"]] += 1
    return m.tolist()


def per_class(confusion: list[list[int]], class_names) -> list[dict]:
    """Precision, recall and F1 per class; None where undefined (nothing predicted / present)."""
    m = np.asarray(confusion)
    out = []
    for i, name in enumerate(class_names):
        tp, predicted, present = int(m[i, i]), int(m[:, i].sum()), int(m[i].sum())
        p = tp / predicted if predicted else None
        r = tp / present if present else None
        f1 = 2 * p * r / (p + r) if p is not None and r is not None and p + r > 0 else None
        out.append({"class": name, "images": present, "predicted": predicted, "precision": p, "recall": r, "f1": f1})
    return out


def per_class_table(stats: list[dict]) -> str:
    def f(v):
        return "-" if v is None else f"{v:.3f}"

    width = max([5] + [len(s["class"]) for s in stats])
    lines = [f"{'class':<{width}}  {'images':>7}  {'precision':>9}  {'recall':>6}  {'f1':>5}"]
    lines += [
        f"{s['class']:<{width}}  {s['images']:>7}  {f(s['precision']):>9}  {f(s['recall']):>6}  {f(s['f1']):>5}"
        for s in stats
    ]
    return "\n".join(lines)
