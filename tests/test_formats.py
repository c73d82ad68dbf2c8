"""--data in the forms users already have, on real files the tests write: WebDataset tar shards
(Python's tarfile, webdataset's member naming), a Hugging Face Parquet export (pyarrow, the
datasets library's schema and metadata), CSV and JSON Lines manifests. The scans are checked
without Ray; one training epoch per form (the WebDataset one from the S3 server) checks class
names, counts, coverage exactly once and the bad member listed."""

from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from jobs.predict import main as predict
from tests.conftest import exits_2, prepare
from training.config import TrainConfig
from training.driver import job
from training.forms.data import DataError, split_of
from training.forms.formats import data_kind, scan_data
from training.forms.webdataset import expand_braces, read_tar_units

CLASSES = ("ant", "bee", "cow")
BAD = b"\xff\xd8 not a jpeg at all"  # a JPEG's first bytes, then nothing decodable


def _jpeg(class_index: int, i: int) -> bytes:
    """A 32 px JPEG in its class's colour, with noise: a model can learn the class."""
    rng = np.random.default_rng(class_index * 1000 + i)
    base = np.array([(class_index * 97) % 256, (class_index * 53 + 80) % 256, (class_index * 31 + 160) % 256])
    pixels = np.clip(base + rng.normal(0, 20, (32, 32, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _samples(per_class: int, offset: int = 0) -> list[tuple[str, int, bytes]]:
    """(key, class index, JPEG) per image, classes interleaved."""
    return [(f"{CLASSES[c]}/img{offset + i:04d}", c, _jpeg(c, offset + i)) for i in range(per_class) for c in range(3)]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shard(path: Path, samples, *, label: str = "cls") -> Path:
    """A WebDataset shard: per sample `<key>.jpg` and `<key>.cls` (the class index as text), or
    `<key>.json` with the class name under "label"."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, c, data in samples:
            _add(tar, f"{key}.jpg", data)
            if label == "cls":
                _add(tar, f"{key}.cls", str(c).encode())
            elif label == "json":
                _add(tar, f"{key}.json", json.dumps({"label": CLASSES[c], "width": 32}).encode())
    return path


def write_export(folder: Path, files: dict[str, list], *, row_group: int = 8) -> Path:
    """A Hugging Face Parquet export: per file an `image` {bytes, path} struct column and a
    ClassLabel `label`, with the `huggingface` schema metadata the datasets library writes."""
    features = {"image": {"_type": "Image"}, "label": {"names": list(CLASSES), "_type": "ClassLabel"}}
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for name, samples in files.items():
        table = pa.table(
            {
                "image": pa.array([{"bytes": d, "path": f"{k}.jpg"} for k, _, d in samples], type=image_type),
                "label": pa.array([c for _, c, _ in samples], type=pa.int64()),
            }
        )
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, folder / name, row_group_size=row_group)
    return folder


def write_files(folder: Path, samples) -> list[str]:
    """The samples as files below `folder`; their paths relative to it."""
    rel = []
    for key, _, data in samples:
        (folder / key).parent.mkdir(parents=True, exist_ok=True)
        (folder / f"{key}.jpg").write_bytes(data)
        rel.append(f"{key}.jpg")
    return rel


# --------------------------------------------------------------------------- telling them apart


def test_brace_patterns_expand_as_webdataset_writes_them():
    assert expand_braces("train-{0000..0002}.tar") == ["train-0000.tar", "train-0001.tar", "train-0002.tar"]
    assert expand_braces("{train,val}-{0..1}.tar") == ["train-0.tar", "train-1.tar", "val-0.tar", "val-1.tar"]
    assert expand_braces("s-{8..10}.tar") == ["s-8.tar", "s-9.tar", "s-10.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"]


@pytest.mark.parametrize(
    "path, split",
    [
        ("data/train-00000-of-00004.parquet", "train"),
        ("data/validation-00000-of-00001.parquet", "val"),
        ("default/test/0000.parquet", "test"),
        ("train.parquet", "train"),
        ("imagenet-val-0003.tar", "val"),
        ("shards/0001.tar", None),
        ("training-data/part-1.tar", "train"),
        ("val_images/0001.tar", "val"),
        ("trainval-0000.tar", None),  # a word that only starts like a split's is none
    ],
)
def test_a_shards_split_comes_from_its_folder_or_its_names_words(path, split):
    assert split_of(path) == split


def test_data_kind_is_told_by_what_is_there(tmp_path):
    write_shard(tmp_path / "wds" / "train" / "0000.tar", _samples(1))
    write_export(tmp_path / "hf", {"data/train-00000-of-00001.parquet": _samples(1)})
    write_files(tmp_path / "tree", _samples(1))
    (tmp_path / "m.csv").write_text("path,label\n")
    assert data_kind(str(tmp_path / "wds"))[0] == "webdataset"
    assert data_kind(str(tmp_path / "wds" / "train-{0000..0001}.tar"))[0] == "webdataset"
    assert data_kind(str(tmp_path / "hf")) == ("huggingface", ["data/train-00000-of-00001.parquet"])
    assert data_kind(str(tmp_path / "tree"))[0] == "tree"
    assert data_kind(str(tmp_path / "m.csv"))[0] == "manifest"


# --------------------------------------------------------------------------- WebDataset


def test_webdataset_scan_takes_the_shards_split_labels_and_keys(tmp_path):
    train = _samples(4)
    write_shard(tmp_path / "train-0000.tar", train[:6])
    write_shard(tmp_path / "train-0001.tar", train[6:])
    write_shard(tmp_path / "val-0000.tar", _samples(2, offset=100))
    tree = scan_data(str(tmp_path / "{train-{0000..0001},val-0000}.tar"))
    assert tree.class_names == ("0", "1", "2")  # .cls indices: the names are the indices
    assert (len(tree.train), len(tree.val)) == (12, 6) and tree.layout == "WebDataset, the train/val shards' own"
    assert sorted(tree.train.labels.tolist()) == sorted(c for _, c, _ in train)
    assert len(set(tree.train.keys.tolist()) | set(tree.val.keys.tolist())) == 18
    assert tree.train.rel_paths[0] == "train-0000.tar/ant/img0000.jpg"


def test_webdataset_runs_of_samples_read_back_whole_with_long_member_names(tmp_path, monkeypatch):
    """A unit is a byte range of the shard; names beyond tar's 100 characters (a PAX header
    before the member) and runs cut mid-shard still read back every sample once."""
    from training.forms import webdataset

    monkeypatch.setattr(webdataset, "RUN_SAMPLES", 4)
    samples = [(f"{'deep/' * 30}{k}", c, d) for k, c, d in _samples(5)]
    write_shard(tmp_path / "s" / "0000.tar", samples, label="json")
    tree = scan_data(str(tmp_path / "s"), val_fraction=0.0)
    assert tree.class_names == CLASSES and len(tree.train.units) == 4  # 15 samples in runs of 4
    table = read_tar_units(tree.train.units, tree.train.root, tree.train.shards, tree.train.form)
    assert table.column("key").to_pylist() == tree.train.keys.tolist()
    assert table.column("bytes").to_pylist() == [d for _, _, d in samples]
    assert table.column("label").to_pylist() == [c for _, c, _ in samples]


def test_webdataset_samples_without_a_label_or_image_are_listed_not_trained(tmp_path):
    samples = _samples(3)
    write_shard(tmp_path / "s" / "0000.tar", samples)
    with tarfile.open(tmp_path / "s" / "0001.tar", "w") as tar:
        _add(tar, "bee/lonely.jpg", _jpeg(1, 50))  # no label
        _add(tar, "bee/nothing.cls", b"1")  # no image
    tree = scan_data(str(tmp_path / "s"), val_fraction=0.0)
    assert len(tree.train) == 9
    assert {p.rsplit("/", 2)[-1]: r for p, r in tree.unreadable} == {
        "lonely": "no label (.cls, or .json 'label')",
        "nothing": "no image member",
    }


def test_webdataset_without_labels_exits_2_naming_the_fix(tmp_path, capsys, no_ray):
    write_shard(tmp_path / "s" / "train-0000.tar", _samples(2), label="none")
    err = exits_2(["--data", str(tmp_path / "s"), "--name", "x", "--storage-path", str(tmp_path / "runs")], capsys)
    assert "no sample has a label" in err and "--label-key" in err


def test_a_missing_shard_of_a_pattern_exits_2(tmp_path, capsys, no_ray):
    write_shard(tmp_path / "train-0000.tar", _samples(2))
    pattern = str(tmp_path / "train-{0000..0001}.tar")
    err = exits_2(["--data", pattern, "--storage-path", str(tmp_path / "runs")], capsys)
    assert "no shard train-0001.tar" in err


# --------------------------------------------------------------------------- Hugging Face Parquet


def test_a_hugging_face_export_scans_with_its_class_names_and_split(tmp_path):
    train = _samples(6)
    write_export(
        tmp_path / "hf",
        {
            "data/train-00000-of-00002.parquet": train[:9],
            "data/train-00001-of-00002.parquet": train[9:],
            "data/validation-00000-of-00001.parquet": _samples(2, offset=100),
            "data/test-00000-of-00001.parquet": _samples(1, offset=200),
        },
    )
    tree = scan_data(str(tmp_path / "hf"))
    assert tree.class_names == CLASSES and (len(tree.train), len(tree.val)) == (18, 6)
    assert tree.train.units.tolist()[:2] == [[0, 0, 0, 8], [0, 1, 8, 1]]  # row groups of 8
    assert tree.train.rel_paths[9] == "data/train-00001-of-00002.parquet:0"


def test_a_hugging_face_export_without_validation_is_hash_split_inside_row_groups(tmp_path):
    from training.forms.formats import read_units

    write_export(tmp_path / "hf", {"train.parquet": _samples(10)})
    tree = scan_data(str(tmp_path / "hf"), val_fraction=0.3)
    assert len(tree.train) + len(tree.val) == 30 and 0 < len(tree.val) < 20
    assert not set(tree.train.keys.tolist()) & set(tree.val.keys.tolist())
    for split in (tree.train, tree.val):  # the units' rows before the task's own filter: the whole groups
        table = read_units(split.units, split.root, split.shards, split.form)
        keep = (table.column("key").to_numpy() / 2**63 < 0.3) == (split is tree.val)
        assert sorted(table.column("key").to_numpy()[keep].tolist()) == sorted(split.keys.tolist())


def test_the_label_key_picks_the_label_column_of_an_export_with_two(tmp_path, capsys, no_ray):
    """CIFAR-100's layout: an `img` column and two ClassLabels; the first unless --label-key says."""
    features = {
        "img": {"_type": "Image"},
        "fine_label": {"names": ["apple", "bee", "cloud", "dog"], "_type": "ClassLabel"},
        "coarse_label": {"names": ["insects", "plants", "sky"], "_type": "ClassLabel"},
    }
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "img": pa.array([{"bytes": _jpeg(i % 3, i), "path": None} for i in range(12)], type=image_type),
            "fine_label": pa.array([i % 4 for i in range(12)], pa.int64()),
            "coarse_label": pa.array([i % 3 for i in range(12)], pa.int64()),
        }
    ).replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    (tmp_path / "c").mkdir()
    pq.write_table(table, tmp_path / "c" / "train.parquet")
    assert scan_data(str(tmp_path / "c")).class_names == ("apple", "bee", "cloud", "dog")
    assert scan_data(str(tmp_path / "c"), label_key="coarse_label").class_names == ("insects", "plants", "sky")
    err = exits_2(["--data", str(tmp_path / "c"), "--label-key", "nope", "--storage-path", str(tmp_path / "r")], capsys)
    assert "--label-key nope: no such column among ['img', 'fine_label', 'coarse_label']" in err


def test_parquet_without_hugging_face_metadata_exits_2(tmp_path, capsys, no_ray):
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"image": [b"x"], "label": [0]}), tmp_path / "p" / "train.parquet")
    err = exits_2(["--data", str(tmp_path / "p"), "--storage-path", str(tmp_path / "runs")], capsys)
    assert "no `huggingface` schema metadata" in err and "train.parquet" in err


def test_preview_shows_the_first_image_of_each_class_of_an_export(tmp_path, capsys):
    from jobs.preview import main

    write_export(tmp_path / "hf", {"train.parquet": _samples(3)})
    assert main(["--data", str(tmp_path / "hf"), "--out", str(tmp_path / "p.png"), "--classes", "3"]) == 0
    assert ": 3 images x" in capsys.readouterr().out and Image.open(tmp_path / "p.png").size[0] > 100


# --------------------------------------------------------------------------- manifests


def test_a_csv_manifest_with_a_validation_sibling(tmp_path):
    rel = write_files(tmp_path / "photos", _samples(4))
    with open(tmp_path / "photos" / "train.csv", "w", newline="") as f:
        csv.writer(f).writerows([["path", "label"], *[[r, r.split("/")[0]] for r in rel[:9]]])
    with open(tmp_path / "photos" / "val.csv", "w", newline="") as f:
        csv.writer(f).writerows([[r, r.split("/")[0]] for r in rel[9:]])  # no header
    tree = scan_data(str(tmp_path / "photos" / "train.csv"))
    assert tree.class_names == CLASSES and (len(tree.train), len(tree.val)) == (9, 3)
    assert "train.csv + val.csv" in tree.layout


def test_a_jsonl_manifest_reaches_files_outside_its_folder_and_is_hash_split(tmp_path):
    rel = write_files(tmp_path / "photos", _samples(10))
    lines = [json.dumps({"path": f"../photos/{r}", "label": CLASSES.index(r.split("/")[0])}) for r in rel]
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "all.jsonl").write_text("\n".join(lines) + "\n")
    tree = scan_data(str(tmp_path / "lists" / "all.jsonl"), val_fraction=0.25)
    assert tree.class_names == ("0", "1", "2") and len(tree.train) + len(tree.val) == 30 and len(tree.val)
    assert tree.train.root == str(tmp_path / "photos")
    assert all((tmp_path / "photos" / r).is_file() for r in tree.train.rel_paths)


@pytest.mark.parametrize(
    "lines, message",
    [
        (["path,label", "ant/img0000.jpg,ant", "ant/gone.jpg,ant"], "train.csv:3: "),
        (["path,label", "ant/img0000.jpg,ant", "ant/img0000.jpg,ant"], "is listed already"),
        (["path,label", "ant/img0000.jpg"], "train.csv:2: no path and label"),
    ],
)
def test_a_manifest_mistake_exits_2_naming_the_line(tmp_path, capsys, no_ray, lines, message):
    write_files(tmp_path, _samples(1))
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    err = exits_2(["--data", str(tmp_path / "train.csv"), "--storage-path", str(tmp_path / "runs")], capsys)
    assert message in err


def test_an_unknown_validation_label_exits_2(tmp_path, capsys, no_ray):
    rel = write_files(tmp_path, _samples(2))
    (tmp_path / "train.csv").write_text("".join(f"{r},{r.split('/')[0]}\n" for r in rel[:3]))
    (tmp_path / "val.csv").write_text(f"{rel[3]},wasp\n")
    err = exits_2(["--data", str(tmp_path / "train.csv"), "--storage-path", str(tmp_path / "runs")], capsys)
    assert "['wasp'] are not among the training labels" in err


# --------------------------------------------------------------------------- one epoch each


def _train(data: str, tmp_path: Path, name: str):
    cfg, tree, preset = prepare(
        TrainConfig(data=data, epochs=1, batch_size=6, num_workers=1, storage_path=str(tmp_path), name=name)
    )
    summary = job.run(cfg, tree, preset, log=lambda *a: None, own_cluster=True)
    return summary, tree


def _check(summary, tree, run_dir: Path, *bad_paths: str) -> None:
    """24 train and 6 val images, each good train image trained on once, the bad ones listed
    by their names, the classes in config.json."""
    assert (summary["train_images"], summary["val_images"], summary["bad_files"]) == (24, 6, len(bad_paths))
    (cov,) = summary["coverage"]
    assert cov["expected"] == 23 and cov["repeated"] == 0 and cov["as_expected"], cov
    assert json.loads((run_dir / "config.json").read_text())["class_names"] == list(tree.class_names)
    assert sorted(row["path"] for row in csv.DictReader(open(run_dir / "bad_files.csv"))) == sorted(bad_paths)


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """Each form of the same 3 classes, 8 train + 2 val images each, one bad image among the train ones."""
    root = tmp_path_factory.mktemp("formats")
    train, val = _samples(8), _samples(2, offset=100)
    train[4] = (train[4][0], train[4][1], BAD)
    write_shard(root / "wds" / "train-0000.tar", train[:12])
    write_shard(root / "wds" / "train-0001.tar", train[12:])
    with tarfile.open(root / "wds" / "train-0001.tar", "a") as tar:  # a sample without its label
        _add(tar, "cow/unlabelled.jpg", _jpeg(2, 99))
    write_shard(root / "wds" / "val-0000.tar", val)
    write_export(root / "hf", {"data/train-0.parquet": train, "data/validation-0.parquet": val})
    rel = write_files(root / "photos", train + val)
    with open(root / "photos" / "train.csv", "w", newline="") as f:
        csv.writer(f).writerows([["path", "label"], *[[r, r.split("/")[0]] for r in rel[:24]]])
    with open(root / "photos" / "val.csv", "w", newline="") as f:
        csv.writer(f).writerows([["path", "label"], *[[r, r.split("/")[0]] for r in rel[24:]]])
    for name, rows in (("train.jsonl", rel[:24]), ("val.jsonl", rel[24:])):
        (root / "photos" / name).write_text("".join(json.dumps({"path": r, "label": r[:3]}) + "\n" for r in rows))
    return root, rel[4]


def test_one_epoch_from_webdataset_shards_on_s3(ray_cluster, s3, formats, tmp_path):
    root, _ = formats
    summary, tree = _train(s3.upload(root / "wds", "s3://data/wds"), tmp_path, "wds")
    assert tree.class_names == ("0", "1", "2")
    bad = "s3://data/wds/train-0000.tar/bee/img0001.jpg", "s3://data/wds/train-0001.tar/cow/unlabelled"
    _check(summary, tree, tmp_path / "wds", *bad)
    # jobs.predict scores every sample, the unlabelled one too (no label in the CSV), all but the bad one
    out = tmp_path / "predictions.csv"
    assert predict(["--model", str(tmp_path / "wds" / "model.pt"), "--data", "s3://data/wds", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == 30 and [r["path"] for r in rows if not r["label"]] == ["train-0001.tar/cow/unlabelled.jpg"]


def test_one_epoch_from_a_hugging_face_export(ray_cluster, formats, tmp_path):
    root, _ = formats
    summary, tree = _train(str(root / "hf"), tmp_path, "hf")
    assert tree.class_names == CLASSES
    _check(summary, tree, tmp_path / "hf", f"{root}/hf/data/train-0.parquet:4")
    # jobs.predict follows the saved model over the export's rows: all but the bad one, by name
    out = tmp_path / "predictions.csv"
    assert predict(["--model", str(tmp_path / "hf" / "model.pt"), "--data", str(root / "hf"), "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == 29 and {r["path"].split(":")[0] for r in rows} == {
        "data/train-0.parquet",
        "data/validation-0.parquet",
    }
    assert {r["label"] for r in rows} == set(CLASSES)


def test_one_epoch_from_a_manifest(ray_cluster, formats, tmp_path):
    """A CSV manifest trains; a JSON Lines one of the same files scans to the same splits, which
    is all that differs between the two forms once scanned."""
    root, bad = formats
    summary, tree = _train(str(root / "photos" / "train.csv"), tmp_path, "m")
    assert tree.class_names == CLASSES and "manifests' own" in tree.layout
    _check(summary, tree, tmp_path / "m", f"{root}/photos/{bad}")
    jsonl = scan_data(str(root / "photos" / "train.jsonl"))
    assert jsonl.class_names == tree.class_names
    for x, y in ((tree.train, jsonl.train), (tree.val, jsonl.val)):
        assert (x.keys.tolist(), x.labels.tolist(), list(x.rel_paths)) == (
            y.keys.tolist(),
            y.labels.tolist(),
            list(y.rel_paths),
        )


def test_shards_are_read_in_a_new_order_every_epoch_from_seed_and_epoch(ray_cluster, tmp_path, monkeypatch):
    """The order of the runs of samples, then of the rows within each read task: every sample
    once an epoch, another order the next epoch, and the same order again for a fresh
    dataset at that epoch (a resumed run)."""
    import ray

    from training.forms import webdataset
    from training.stream.ingest import read_split
    from training.stream.stamp import EpochClock

    monkeypatch.setattr(webdataset, "RUN_SAMPLES", 8)
    samples = _samples(30)
    for s in range(3):
        write_shard(tmp_path / f"train-{s}.tar", samples[s * 30 : (s + 1) * 30])
    tree = scan_data(str(tmp_path), val_fraction=0.0)
    assert len(tree.train.units) == 12
    context = ray.data.DataContext.get_current()
    before, context.execution_options.preserve_order = context.execution_options.preserve_order, True
    clock = ray.remote(num_cpus=0)(EpochClock).remote()

    def keys(ds, epoch):
        ray.get(clock.set.remote(epoch))
        return [int(k) for b in ds.iter_batches(batch_size=None, batch_format="numpy") for k in b["key"]]

    try:
        ds = read_split(tree.train, seed=0, shuffle=True, clock=clock, num_cpus=0.5)
        first, second = keys(ds, 0), keys(ds, 1)
        resumed = keys(read_split(tree.train, seed=0, shuffle=True, clock=clock, num_cpus=0.5), 1)
    finally:
        context.execution_options.preserve_order = before
        ray.kill(clock)
    assert sorted(first) == sorted(second) == sorted(tree.train.keys.tolist())
    assert first != second and resumed == second
    assert first[:8] != tree.train.keys[:8].tolist()  # not the shards' own order


def test_an_export_and_a_manifest_on_s3_scan_as_on_disk(s3, formats, tmp_path):
    from training.driver.inputs import check_inputs
    from training.forms.formats import read_units

    root, _ = formats
    for local, remote in (
        (str(root / "hf"), s3.upload(root / "hf", "s3://data/hf")),
        (str(root / "photos" / "train.csv"), s3.upload(root / "photos", "s3://data/photos") + "/train.csv"),
    ):
        a, b = scan_data(local), scan_data(remote)
        assert a.class_names == b.class_names and b.root == remote
        for x, y in ((a.train, b.train), (a.val, b.val)):
            assert (x.keys.tolist(), x.labels.tolist(), list(x.rel_paths)) == (
                y.keys.tolist(),
                y.labels.tolist(),
                list(y.rel_paths),
            )
    hf = scan_data("s3://data/hf")
    table = read_units(hf.train.units, hf.train.root, hf.train.shards, hf.train.form)
    assert table.column("key").to_pylist() == hf.train.keys.tolist()
    # a brace pattern on S3 names the shards the folder holds
    folder = scan_data(s3.upload(root / "wds", "s3://data/wds-pattern"))
    uri = "s3://data/wds-pattern/{train-{0000..0001},val-0000}.tar"
    _, pattern = check_inputs(TrainConfig(data=uri, storage_path=str(tmp_path)))  # every check jobs.train makes
    assert pattern.train.keys.tolist() == folder.train.keys.tolist() and len(pattern.val) == len(folder.val) == 6


# --------------------------------------------------------------------------- edge cases users hit


def test_a_tree_with_a_stray_archive_or_braces_in_its_path_stays_a_tree(tmp_path):
    tree = tmp_path / "{project}" / "photos"
    write_files(tree, _samples(2))
    write_shard(tree / "backup.tar", _samples(1))
    write_export(tree, {"metadata.parquet": _samples(1)})
    assert data_kind(str(tree))[0] == "tree"
    assert scan_data(str(tree)).class_names == CLASSES


def test_a_pattern_or_shard_named_without_a_folder_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    write_shard(tmp_path / "train-0.tar", _samples(2))
    write_shard(tmp_path / "train-1.tar", _samples(2, offset=50))
    monkeypatch.chdir(tmp_path)
    assert len(scan_data("train-{0..1}.tar", val_fraction=0.0).train) == 12
    assert len(scan_data("train-0.tar", val_fraction=0.0).train) == 6
    assert expand_braces("s-{3..1}") == ["s-3", "s-2", "s-1"] and expand_braces("{a}-{0,1}") == ["{a}-0", "{a}-1"]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"path": "ant/img0000.jpg", "label": null}'], "all.jsonl:1: no label"),
        (['{"path": "ant/img0000.jpg", "label": 0}', '{"path": "bee/img0000.jpg", "label": -1}'], "negative class"),
    ],
)
def test_a_jsonl_label_that_is_none_or_negative_exits_2(tmp_path, capsys, no_ray, lines, message):
    write_files(tmp_path, _samples(1))
    (tmp_path / "all.jsonl").write_text("\n".join(lines) + "\n")
    assert message in exits_2(["--data", str(tmp_path / "all.jsonl"), "--storage-path", str(tmp_path / "r")], capsys)


def test_a_manifest_with_other_header_names_old_mac_line_ends_and_a_word_train(tmp_path):
    rel = write_files(tmp_path, _samples(3))
    rows = "".join(f"{r},{r[:3]}\r" for r in rel[:6])
    (tmp_path / "constrained_train.csv").write_text("filepath,category\r" + rows, newline="")
    (tmp_path / "constrained_val.csv").write_text("".join(f"{r},{r[:3]}\n" for r in rel[6:]))
    tree = scan_data(str(tmp_path / "constrained_train.csv"))
    assert (len(tree.train), len(tree.val), tree.class_names) == (6, 3, CLASSES)


def test_an_export_with_text_labels_or_no_rows_exits_2(tmp_path, capsys, no_ray):
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    features = {"image": {"_type": "Image"}, "label": {"dtype": "string", "_type": "Value"}}
    meta = {"huggingface": json.dumps({"info": {"features": features}})}
    (tmp_path / "text").mkdir()
    table = pa.table({"image": pa.array([{"bytes": _jpeg(0, 0), "path": "a"}], image_type), "label": ["ant"]})
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "text" / "train.parquet")
    err = exits_2(["--data", str(tmp_path / "text"), "--storage-path", str(tmp_path / "r")], capsys)
    assert "the label column 'label' holds string, not class indices" in err
    write_export(tmp_path / "empty", {"train.parquet": []})
    err = exits_2(["--data", str(tmp_path / "empty"), "--storage-path", str(tmp_path / "r")], capsys)
    assert "no rows in the training files" in err


def test_scoring_reads_test_shards_and_unlabelled_samples_and_test_files(tmp_path):
    """jobs.predict's scan: every image, labelled by the model's classes, -1 where there is none."""
    from training.forms import huggingface, webdataset
    from training.forms.formats import read_units

    write_shard(tmp_path / "wds" / "train-0000.tar", _samples(2))
    write_shard(tmp_path / "wds" / "test-0000.tar", _samples(1, offset=10), label="none")
    split = webdataset.scan_for_scoring(str(tmp_path / "wds"), ("0", "1", "2"))
    assert len(split) == 9 and sorted(split.labels.tolist()) == [-1, -1, -1, 0, 0, 1, 1, 2, 2]
    table = read_units(split.units, split.root, split.shards, split.form)
    assert table.column("label").to_pylist() == split.labels.tolist()
    test = [(k, -1, d) for k, _, d in _samples(1, offset=20)]
    write_export(tmp_path / "hf", {"data/train-0.parquet": _samples(2), "data/test-0.parquet": test})
    files = ["data/test-0.parquet", "data/train-0.parquet"]
    split = huggingface.scan_for_scoring(str(tmp_path / "hf"), files, CLASSES)
    assert sorted(split.labels.tolist()) == [-1, -1, -1, 0, 0, 1, 1, 2, 2]
    with pytest.raises(DataError, match="the model has"):
        huggingface.scan_for_scoring(str(tmp_path / "hf"), files, ("x", "y"))
