"""--data as the users' own tools write it (issue 45), on files written by those tools: the datasets
library (`Dataset.to_parquet` of embedded images or of paths, `save_to_disk`), webdataset's
ShardWriter (`.tar`, `.tar.gz`, `.cls` indices with a classes.txt), one file given as --data; the
typical image size read from inside shards and exports; and a model.pt that torchvision alone
loads, by the guide's own snippet. One training epoch (gzipped shards, named classes) and its
jobs.predict runs on Ray; the rest is checked before Ray starts."""

from __future__ import annotations

import ast
import csv
import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import webdataset as wds
from PIL import Image

from tests.conftest import exits_2, prepare
from training.config import TrainConfig
from training.driver.inputs import auto_preset, typical_size
from training.forms import webdataset
from training.forms.formats import read_units, scan_data

datasets.disable_progress_bars()  # its bars go to stderr, where a refusal must be the one line
CLASSES = ("ant", "bee", "cow")
REPO = Path(__file__).resolve().parents[1]


def _image(c: int, i: int, size=(48, 40), fmt: str = "JPEG") -> bytes:
    """A (width, height) image in its class's colour, with a little noise: a model can learn the class."""
    rng = np.random.default_rng(c * 1000 + i)
    base = np.array([(c * 97) % 256, (c * 53 + 80) % 256, (c * 31 + 160) % 256])
    pixels = np.clip(base + rng.normal(0, 8, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def _photos(folder: Path, per_class: int, **kw) -> list[tuple[Path, int]]:
    """folder/<class>/<i>.jpg, classes interleaved: (path, class index) of each."""
    out = []
    for i in range(per_class):
        for c, name in enumerate(CLASSES):
            path = folder / name / f"{i}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_image(c, i, **kw))
            out.append((path, c))
    return out


def _dataset(images: list, labels: list[int]) -> datasets.Dataset:
    """What a user builds: images as paths or {bytes, path}, cast to Image; labels a ClassLabel."""
    ds = datasets.Dataset.from_dict({"image": images, "label": labels})
    return ds.cast_column("image", datasets.Image()).cast_column("label", datasets.ClassLabel(names=list(CLASSES)))


def _shards(pattern: Path, per_class: int, maxcount: int = 10, **kw) -> list[bytes]:
    """webdataset's ShardWriter: `<key>.jpg` and `<key>.cls` (the class index) per sample; the images."""
    pattern.parent.mkdir(parents=True, exist_ok=True)
    images = []
    with wds.ShardWriter(str(pattern), maxcount=maxcount, verbose=0) as sink:
        for i in range(per_class * 3):
            images.append(_image(i % 3, i, **kw))
            sink.write({"__key__": f"s{i:04d}", "jpg": images[-1], "cls": i % 3})
    return images


def _rows(split) -> list[bytes]:
    """The image bytes a read task gets for a split's units, in its key order."""
    table = read_units(split.units, split.root, split.shards, split.form)
    by_key = dict(zip(table.column("key").to_pylist(), table.column("bytes").to_pylist(), strict=True))
    return [by_key[k] for k in split.keys.tolist()]


def _refused(tmp_path, capsys, data, *flags) -> str:
    return exits_2(["--data", str(data), "--storage-path", str(tmp_path / "runs"), *flags], capsys)


# --------------------------------------------------------------------------- the datasets library


def test_a_to_parquet_export_of_image_paths_is_read_from_those_files(tmp_path, monkeypatch):
    """Dataset.to_parquet of an Image column cast from paths writes image.bytes empty and the path:
    an absolute path is read as it is, a relative one from the Parquet file's folder (where the
    datasets library reads it from the working directory: the same folder when to_parquet wrote
    there); each read task's rows hold the files' bytes, and the typical size is their headers'."""
    photos = _photos(tmp_path / "photos", 4)
    _dataset([str(p) for p, _ in photos], [c for _, c in photos]).to_parquet(str(tmp_path / "abs" / "train.parquet"))
    monkeypatch.chdir(tmp_path)
    _dataset([str(p.relative_to(tmp_path)) for p, _ in photos], [c for _, c in photos]).to_parquet("train.parquet")
    monkeypatch.chdir(REPO)
    for data in (tmp_path / "abs", tmp_path / "train.parquet"):
        tree = scan_data(str(data), val_fraction=0.0)
        assert tree.class_names == CLASSES and len(tree.train) == 12
        files = {f"train.parquet:{r}": p.read_bytes() for r, (p, _) in enumerate(photos)}
        assert _rows(tree.train) == [files[r] for r in tree.train.rel_paths]
        assert typical_size(tree.train) == (48, 40) and tree.train.mean_file_bytes > 500  # the files' sizes


def test_an_export_of_paths_that_are_not_there_exits_2_naming_the_fix(tmp_path, capsys, no_ray, monkeypatch):
    """Relative paths written from another folder than the Parquet file's are not found: refused
    before Ray, naming the row, the path and how to put the images in the file."""
    photos = _photos(tmp_path / "photos", 2)
    monkeypatch.chdir(tmp_path)
    _dataset([str(p.relative_to(tmp_path)) for p, _ in photos], [c for _, c in photos]).to_parquet("out/train.parquet")
    err = _refused(tmp_path, capsys, tmp_path / "out")
    assert f"error: {tmp_path}/out/train.parquet:0: image.path photos/ant/0.jpg: no such file" in err, err
    assert "embed_table_storage" in err and "push_to_hub" in err, err
    _dataset([None] * 6, [0, 1, 2] * 2).to_parquet("none/train.parquet")  # neither bytes nor a path: no epoch
    err = _refused(tmp_path, capsys, tmp_path / "none")
    assert "none: no row of the training files has an image (bytes or a path)" in err, err


def test_a_save_to_disk_folder_is_read_as_an_export(tmp_path):
    """save_to_disk: Arrow stream files (data-00000-of-00001.arrow) beside dataset_info.json; a
    DatasetDict's splits in folders of their own (its test split left out)."""
    images = [_image(i % 3, i) for i in range(12)]
    ds = _dataset([{"bytes": b, "path": None} for b in images], [i % 3 for i in range(12)])
    ds.save_to_disk(str(tmp_path / "saved"))
    tree = scan_data(str(tmp_path / "saved"), val_fraction=0.0)
    assert tree.class_names == CLASSES and tree.train.rel_paths[0] == "data-00000-of-00001.arrow:0"
    assert _rows(tree.train) == images and typical_size(tree.train) == (48, 40)
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "dict"))
    tree = scan_data(str(tmp_path / "dict"), val_fraction=0.25)
    assert len(tree.train) + len(tree.val) == 12 and tree.train.rel_paths[0].startswith("train/data-")


def test_a_save_to_disk_folder_on_object_storage_exits_2_naming_to_parquet(s3, tmp_path, capsys, no_ray):
    """An Arrow stream has no footer: each read task would read the whole file for its rows."""
    ds = _dataset([{"bytes": _image(i % 3, i), "path": None} for i in range(6)], [i % 3 for i in range(6)])
    ds.save_to_disk(str(tmp_path / "saved"))
    err = _refused(tmp_path, capsys, s3.upload(tmp_path / "saved", "s3://data/saved"))
    assert "s3://data/saved/data-00000-of-00001.arrow: an Arrow file of Dataset.save_to_disk on object" in err, err
    assert "to_parquet" in err, err


# --------------------------------------------------------------------------- webdataset and single files


def test_a_folder_of_gzipped_shards_is_read_one_whole_shard_a_unit(tmp_path):
    images = _shards(tmp_path / "gz" / "train-%04d.tar.gz", 8) + _shards(tmp_path / "gz" / "train-more-%04d.tgz", 1)
    tree = scan_data(str(tmp_path / "gz"), val_fraction=0.0)
    assert tree.class_names == ("0", "1", "2") and len(tree.train) == 27
    assert tree.train.units[:, 0].tolist() == [0, 1, 2, 3] and tree.train.units[:, -1].tolist() == [10, 10, 4, 3]
    assert sorted(_rows(tree.train)) == sorted(images)
    assert typical_size(tree.train) == (48, 40)


def test_one_file_as_data_is_read_as_its_form_and_an_image_is_told_to_give_its_folder(tmp_path, capsys, no_ray):
    images = [_image(i % 3, i) for i in range(9)]
    _dataset([{"bytes": b, "path": None} for b in images], [i % 3 for i in range(9)]).to_parquet(
        str(tmp_path / "one.parquet")
    )
    _shards(tmp_path / "one-%d.tar.gz", 3, maxcount=100)
    _shards(tmp_path / "one-%d.tgz", 3, maxcount=100)
    assert scan_data(str(tmp_path / "one.parquet"), val_fraction=0.0).class_names == CLASSES
    assert len(scan_data(str(tmp_path / "one-0.tar.gz"), val_fraction=0.0).train) == 9
    assert len(scan_data(str(tmp_path / "one-0.tgz"), val_fraction=0.0).train) == 9
    (tmp_path / "cat.jpg").write_bytes(images[0])
    err = _refused(tmp_path, capsys, tmp_path / "cat.jpg")
    assert f"error: {tmp_path}/cat.jpg: an image file, not a folder; give --data the folder that holds it" in err, err
    (tmp_path / "photos.zip").write_bytes(b"PK\x03\x04")
    err = _refused(tmp_path, capsys, tmp_path / "photos.zip")
    assert f"error: {tmp_path}/photos.zip: a file that --data does not read" in err, err


def test_cls_indices_are_named_by_a_classes_txt_beside_the_shards_or_by_class_names(tmp_path, capsys, no_ray):
    _shards(tmp_path / "s" / "train-%04d.tar", 3)
    assert scan_data(str(tmp_path / "s"), val_fraction=0.0).class_names == ("0", "1", "2")
    (tmp_path / "s" / "classes.txt").write_text("ant\nbee\ncow\n")
    tree = scan_data(str(tmp_path / "s"), val_fraction=0.0)
    assert tree.class_names == CLASSES and sorted(set(tree.train.labels.tolist())) == [0, 1, 2]
    (tmp_path / "names.txt").write_text("n01\nn02\nn03\nn04\n")  # a fourth class without images, as a ClassLabel's
    tree = scan_data(str(tmp_path / "s"), val_fraction=0.0, class_names=str(tmp_path / "names.txt"))
    assert tree.class_names == ("n01", "n02", "n03", "n04") and "(1 without training images)" in tree.describe()
    scored = webdataset.scan_for_scoring(str(tmp_path / "s"), CLASSES)  # jobs.predict: the model's classes by index
    assert sorted(scored.labels.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    (tmp_path / "s" / "classes.txt").write_text("ant\nbee\n")
    err = _refused(tmp_path, capsys, tmp_path / "s", "--val-fraction", "0")
    assert f"error: {tmp_path}/s/classes.txt: 2 class names for the class indices 0..2" in err, err
    assert TrainConfig(class_names="names.txt").to_dict()["class_names"] == "names.txt"  # config.json keeps it


# --------------------------------------------------------------------------- --preset auto reads headers


def test_preset_auto_reads_the_headers_of_images_inside_shards_and_exports(tmp_path):
    """Flat 200 x 150 JPEGs are photos by their headers, though smaller than the 8 KB that made
    the mean file size call them thumbnails."""
    from training.forms.parquet import prepare_tree

    big = {"size": (200, 150)}
    _shards(tmp_path / "wds" / "train-%04d.tar", 6, **big)
    _shards(tmp_path / "gz" / "train-%04d.tar.gz", 6, **big)
    photos = _photos(tmp_path / "photos", 6, **big)
    _dataset([str(p) for p, _ in photos], [c for _, c in photos]).to_parquet(str(tmp_path / "paths" / "train.parquet"))
    embedded = _dataset([{"bytes": p.read_bytes(), "path": None} for p, _ in photos], [c for _, c in photos])
    embedded.to_parquet(str(tmp_path / "hf" / "train.parquet"))
    embedded.save_to_disk(str(tmp_path / "saved"))
    prepare_tree(str(tmp_path / "photos"), str(tmp_path / "prepared"), log=lambda *a: None)
    for form in ("wds", "gz", "paths", "hf", "saved", "prepared"):
        tree = scan_data(str(tmp_path / form))
        assert tree.train.mean_file_bytes < 8 * 1024, form
        sized = dataclasses.replace(tree, typical_size=typical_size(tree.train))
        assert auto_preset(sized) == ("imagenet", "photos, typically 200 x 150 px"), form


# --------------------------------------------------------------------------- model.pt without the project


def _guide_snippet() -> str:
    """The torchvision-only snippet of docs/guide.md's "Prediction and evaluation"."""
    guide = (REPO / "docs" / "guide.md").read_text()
    section = guide.split("## Prediction and evaluation", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_a_model_file_loads_and_predicts_with_torchvision_alone_as_the_guide_shows(tmp_path):
    """The guide's snippet (torch, torchvision and PIL only), run in a process that never imports
    the project, reproduces the classes and confidences of training.predict.inference.Predictor (what
    jobs.predict's actors run) on the same files, through the small stem and a resize + crop."""
    import torch

    from augment.decode import decode_image
    from augment.presets import PRESETS
    from training.driver.results import model_bytes
    from training.forms.tree import scan_tree
    from training.model import resnet18
    from training.predict.inference import Predictor, load_model_file

    code = _guide_snippet()
    imported = {a.name.split(".")[0] for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(ast.parse(code)) if isinstance(n, ast.ImportFrom)}
    assert imported == {"sys", "torch", "torchvision", "PIL"}, imported
    sizes = [(90, 120, "PNG"), (100, 80, "PNG"), (73, 73, "JPEG"), (150, 64, "JPEG")]
    files = []
    for i, (w, h, fmt) in enumerate(sizes):
        files.append(tmp_path / "data" / CLASSES[i % 3] / f"{i}.{fmt.lower()}")
        files[-1].parent.mkdir(parents=True, exist_ok=True)
        files[-1].write_bytes(_image(i % 3, i, size=(w, h), fmt=fmt))
    tree = scan_tree(str(tmp_path / "data"), 0.0)
    preset = PRESETS["imagenet"].at_size(64)
    assert preset.eval == ({"resize_center_crop": {"resize": 73, "size": 64}},)
    torch.manual_seed(0)
    model = resnet18(3, small_stem=True)
    cfg = TrainConfig(small_stem="on")
    (tmp_path / "model.pt").write_bytes(model_bytes(model.state_dict(), tree.class_names, preset, cfg))
    (tmp_path / "snippet.py").write_text(code)
    run = (
        "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
        "assert not {'training', 'augment', 'jobs'} & {m.split('.')[0] for m in sys.modules}, 'imported the project'"
    )
    args = [str(tmp_path / "model.pt"), *map(str, files)]
    out = subprocess.run(
        [sys.executable, "-I", "-c", run, str(tmp_path / "snippet.py"), *args],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    printed = [line.split() for line in out.stdout.splitlines()]
    info = load_model_file(str(tmp_path / "model.pt"))
    images = np.empty(len(files), dtype=object)
    images[:] = [decode_image(f.read_bytes()) for f in files]
    ours = Predictor(info)({"image": images, "label": np.zeros(len(files), np.int64), "path": np.array(args[1:])})
    assert [p for p, _, _ in printed] == args[1:]
    assert [n for _, n, _ in printed] == [CLASSES[i] for i in ours["pred"]]
    assert np.abs(np.array([float(p) for _, _, p in printed]) - ours["prob"]).max() < 1e-4
    assert info.torchvision_model["replace"] == {
        "conv1": {"in_channels": 3, "out_channels": 64, "kernel_size": 3, "stride": 1, "padding": 1, "bias": False},
        "maxpool": "identity",
    }
    assert info.torchvision_eval[:2] == [
        ["Resize", {"size": 73, "interpolation": "bilinear", "antialias": True}],
        ["CenterCrop", {"size": 64}],
    ]


# --------------------------------------------------------------------------- one epoch, then jobs.predict


def test_one_epoch_from_gzipped_shards_with_class_names_then_predict_names_them(ray_cluster, tmp_path, capsys):
    """webdataset's .tar.gz shards with .cls indices and --class-names: the run, config.json and
    model.pt carry the names, and jobs.predict labels class-named folders by them."""
    from jobs.predict import main as predict
    from training.driver import job

    _shards(tmp_path / "gz" / "train-%04d.tar.gz", 8)
    (tmp_path / "names.txt").write_text("\n".join(CLASSES) + "\n")
    cfg = TrainConfig(
        data=str(tmp_path / "gz"),
        class_names=str(tmp_path / "names.txt"),
        epochs=1,
        batch_size=6,
        num_workers=1,
        storage_path=str(tmp_path / "runs"),
        name="gz",
    )
    cfg, tree, preset = prepare(cfg)
    summary = job.run(cfg, tree, preset, log=lambda *a: None, own_cluster=True)
    (cov,) = summary["coverage"]
    assert cov["as_expected"] and summary["train_images"] + summary["val_images"] == 24, summary
    config = json.loads((tmp_path / "runs" / "gz" / "config.json").read_text())
    assert config["class_names"] == list(CLASSES) and config["config"]["class_names"] == str(tmp_path / "names.txt")
    model = str(tmp_path / "runs" / "gz" / "model.pt")
    _photos(tmp_path / "folders", 2)
    capsys.readouterr()
    assert predict(["--model", model, "--data", str(tmp_path / "folders"), "--out", str(tmp_path / "p.csv")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "p.csv")))
    assert {r["label"] for r in rows} == set(CLASSES) and {r["predicted"] for r in rows} <= set(CLASSES)
    assert re.search(r"accuracy \d\.\d{4} \(\d+/6 labelled images\)", capsys.readouterr().out)
