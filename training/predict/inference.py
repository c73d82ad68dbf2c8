"""Batch inference with a saved model.pt: Ray Data reads and decodes the images (full size,
in the read tasks), actors apply the saved eval transform and the model to whole batches.

    info = load_model_file("runs/photos/model.pt")          # a ModelFile; ModelFileError: exit 2
    splits = input_splits("~/photos", info)
    ds = scoring_dataset(info, splits, actors=(1, 4))         # {path, label, pred, prob}, lazily
    # training/predict/scoring.py score_to streams it into the output, with the counts reduced by a tally

A file's label is the position, in the model's class names, of its directory's name
(DIR/<class>/img or DIR/val/<class>/img); -1 when that directory is not a class. Each read
task derives it from the file's own path (training/stream/ingest.py), so no task carries a table
of the files.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import PurePosixPath

import numpy as np
import torch

from augment.batch import augment_batch
from augment.ops import Normalize
from augment.pipeline import Pipeline
from training import storage
from training.config import ConfigError
from training.forms import huggingface, webdataset
from training.forms.data import DataError, Split, label_of, make_split
from training.forms.tree import list_images, scan_tree
from training.model import build_model, check_model, model_names
from training.modelfile import REQUIRED, ModelFile, StaleModelFile, check_version
from training.rows import IMAGE, LABEL, PATH
from training.weights import model_kind


class ModelFileError(ValueError):
    """The --model file is missing or not a model.pt written by jobs.train."""


def _model_source(path: str):
    """What torch.load reads: a local path, or the bytes behind a URI. ModelFileError when
    there is no such file, storage.StorageError when object storage refuses."""
    if storage.is_uri(path):
        import pyarrow.fs as pafs

        storage.check_bucket(path)
        fs, inner, _ = storage.filesystem(path)
        with storage.errors(path):
            if fs.get_file_info(inner).type == pafs.FileType.File:
                with fs.open_input_file(inner) as f:
                    return io.BytesIO(f.read())
    elif os.path.isfile(path):
        return path
    raise ModelFileError(f"--model {path}: no such file; give the model.pt of a run directory (runs/<name>/model.pt)")


def load_model_file(path: str) -> ModelFile:
    source = _model_source(path)
    try:
        with warnings.catch_warnings():  # torch warns of a plain pickle's protocol before it refuses the file
            warnings.simplefilter("ignore")
            info = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle, zip and torch errors alike mean "not a model.pt"
        raise ModelFileError(f"--model {path}: not a model.pt written by jobs.train ({type(e).__name__})") from None
    if isinstance(info, dict) and "eval_transform" in info:  # jobs.train's, of whichever version
        try:
            check_version(info)
        except StaleModelFile as e:
            raise ModelFileError(f"--model {path}: {e}") from None
    missing = [k for k in REQUIRED if not isinstance(info, dict) or k not in info]
    if missing:
        raise ModelFileError(
            f"--model {path}: missing {missing}; give the model.pt of a run directory (runs/<name>/model.pt)"
        )
    check_arch(info["arch"], path)
    check_model_values(info, path)
    return ModelFile.from_state(info, path)


def check_arch(arch, path: str) -> None:
    """ModelFileError where this process cannot build the model.pt's model: a torchvision name this
    torchvision does not have, a timm model without timm or unknown to it, a function of the
    user's that does not import (run from the folder that trained it, or put it on PYTHONPATH)."""
    if not isinstance(arch, str) or arch == "resnet18":  # a bad value: check_model_values says so
        return
    if model_kind(arch) == "torchvision":
        if arch not in model_names():  # torchvision's import: seconds
            raise ModelFileError(
                f"--model {path}: architecture {arch!r}, which this torchvision does not have; run it with the "
                "torchvision that trained it"
            )
        return
    try:
        check_model(arch, small_stem="off")
    except ConfigError as e:
        raise ModelFileError(f"--model {path}: trained as {e}") from None


def check_model_values(info: dict, path: str) -> None:
    """ModelFileError where a value of a model.pt is not what jobs.train writes, or where its weights
    and eval transform do not build (the inference actors would fail on them only after Ray starts)."""
    names, t = info["class_names"], info["eval_transform"]
    problems = [
        "arch is not a name" if not isinstance(info["arch"], str) else "",
        "class_names is not a list of names"
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names)
        else "",
        "image_size is not a positive integer"
        if not isinstance(info["image_size"], int) or isinstance(info["image_size"], bool) or info["image_size"] <= 0
        else "",
        "small_stem is not true or false" if not isinstance(info["small_stem"], bool) else "",
        "state_dict is not a mapping of tensors"
        if not isinstance(info["state_dict"], dict)
        or not all(isinstance(v, torch.Tensor) for v in info["state_dict"].values())
        else "",
        "eval_transform has no ops, mean and std" if not isinstance(t, dict) or {"ops", "mean", "std"} - set(t) else "",
        "config is not the run's flags" if not isinstance(info["config"], dict) else "",
    ]
    problems = [p for p in problems if p]
    if not problems:
        try:
            Predictor(ModelFile.from_state(info, path))
        except Exception as e:  # noqa: BLE001 - whatever its values break: one line, before Ray
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            problems = [f"its weights or eval transform do not build ({why})"]
    if problems:
        raise ModelFileError(f"--model {path}: {'; '.join(problems)}; give the model.pt of a run directory unchanged")


def list_inputs(root: str, class_names, split: str = "all", val_fraction: float = 0.2) -> Split:
    """The images to predict, as a Split whose labels are the model's classes of their
    directories (-1: not a class). split="val": the validation split training used (DIR/val,
    or the hash split by val_fraction); "all": every image below DIR."""
    fs, base, prefix = storage.filesystem(root)
    if split == "val":
        val = scan_tree(root, val_fraction).val
        rel, sizes = list(val.rel_paths), val.sizes
    else:
        import pyarrow.fs as pafs

        storage.check_bucket(root)
        with storage.errors(root):
            if fs.get_file_info(base).type != pafs.FileType.Directory:
                missing = "no objects under this prefix" if storage.is_uri(root) else "no such directory"
                raise DataError(f"{root}: {missing}; pass --data with a folder of images")
            listed = list_images(fs, base)
        rel, sizes = [str(PurePosixPath(p).relative_to(base)) for p, _ in listed], [n for _, n in listed]
    if not rel:
        raise DataError(
            f"{root}: no images found"
            + (" in the validation split" if split == "val" else "")
            + "; point --data at a folder of images"
        )
    index = {name: i for i, name in enumerate(class_names)}
    return make_split(prefix + base, rel, [label_of(r, index, -2) for r in rel], sizes)


def input_splits(root: str, info: ModelFile, split: str = "all", val_fraction: float = 0.2) -> list[Split]:
    """The Splits to score: the listed files of an image tree; every sample of WebDataset shards
    or row of an export (split="all": test and unlabelled ones too, label -1); else the splits
    of data in another form as training scans them (DataError if its classes are not the
    model's)."""
    from training.forms.formats import data_kind, scan_data

    kind, files = data_kind(root)
    label_key = info.setting("label_key", "label")
    if kind == "tree":
        return [list_inputs(root, info.class_names, split, val_fraction)]
    if split == "all" and kind == "webdataset":  # test shards and unlabelled samples too
        return [webdataset.scan_for_scoring(root, info.class_names, label_key)]
    if split == "all" and kind == "huggingface":
        return [huggingface.scan_for_scoring(root, files, info.class_names, label_key)]
    tree = scan_data(root, val_fraction, label_key, info.setting("class_names", ""))
    if list(tree.class_names) != list(info.class_names):
        raise DataError(f"{root}: holds classes {list(tree.class_names)}, the model has {list(info.class_names)}")
    return [tree.val] if split == "val" else [tree.train, tree.val]


class Predictor:
    """map_batches actor: builds the model and the eval transform once, then scores whole
    batches: {image, label, path} -> {path, label, pred, prob}."""

    def __init__(self, info: ModelFile | str, device: str = "cpu", tally=None):
        """`info`: load_model_file's ModelFile, or the model file's path, which each actor reads itself;
        `tally`: training/predict/scoring.py's Tally actor, told each batch's counts (None: not told)."""
        info = load_model_file(info) if isinstance(info, str) else info
        self.device = torch.device(device)
        t = info.eval_transform
        self.pipeline = Pipeline(t["ops"], seed=0).to(self.device)
        self.normalize = Normalize(t["mean"], t["std"]).to(self.device)
        self.model = build_model(info.arch, info.num_classes, small_stem=info.small_stem, image_size=info.image_size)
        self.model.load_state_dict(info.state_dict)
        self.model.to(self.device).eval()
        self.tally, self.num_classes = tally, info.num_classes

    @torch.no_grad()
    def __call__(self, batch: dict) -> dict:
        n = len(batch[LABEL])
        if n == 0:
            return {
                PATH: batch[PATH],
                LABEL: batch[LABEL],
                "pred": np.zeros(0, np.int64),
                "prob": np.zeros(0, np.float32),
            }
        keys = torch.zeros(n, dtype=torch.int64)  # the eval ops draw nothing; keys are unused
        x = augment_batch(self.pipeline, batch[IMAGE], keys, 0, self.device)  # uint8 (B, S, S, 3)
        probs = self.model(self.normalize(x)).float().softmax(1)
        prob, pred = probs.max(1)
        out = {
            PATH: batch[PATH],
            LABEL: batch[LABEL],
            "pred": pred.cpu().numpy(),
            "prob": prob.cpu().numpy(),
        }  # .cpu(): a sync point
        if self.tally is not None:  # the batch's counts, never its rows; waited for, so none is lost at the end
            import ray

            labels, k = np.asarray(batch[LABEL]), self.num_classes
            known = labels >= 0
            counts = np.bincount(labels[known] * k + out["pred"][known], minlength=k * k).astype(np.int64)
            ray.get(self.tally.add.remote(n, counts))
        return out


def scoring_dataset(
    info: ModelFile,
    splits: list[Split],
    *,
    batch_size: int = 256,
    actors: tuple[int, int] | int = 1,
    device: str = "cpu",
    tally=None,
    bad_log=None,
    gpus_per_actor: float = 1.0,
):
    """Ray Dataset {path (relative), label, pred, prob} of every image of `splits`, lazily; `actors`:
    the pool's size, or (min, max) for one that grows and shrinks with the work."""
    import ray.data

    from training.stream.ingest import read_split

    parts = [read_split(s, decode=True, relative_paths=True, rows_per_task=batch_size, bad_log=bad_log) for s in splits]
    ds = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    low, high = (actors, actors) if isinstance(actors, int) else actors
    return ds.map_batches(
        Predictor,
        # the file's path, not its weights: each actor reads the file itself instead of a copy of the weights
        # in the object store
        fn_constructor_kwargs={"info": info.path or info, "device": device, "tally": tally},
        batch_format="numpy",
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(min_size=low, max_size=high),
        num_gpus=gpus_per_actor if device == "cuda" else 0,
        num_cpus=1,
    )


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
