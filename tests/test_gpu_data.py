"""bench.gpu_data: the ImageNet-like JPEG tree the GPU benchmarks train on, at tiny sizes."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import time

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from bench import gpu_data
from bench.gpu_data import NotOurTree, make_imagenet_like
from training.forms.tree import scan_tree

TINY = {"distinct": 24, "train": 60, "val": 12, "classes": 3}  # 24 >= EVERY_KIND_FROM: every kind appears


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_data") / "imagenet-like"
    return out, make_imagenet_like(str(out), **TINY, workers=1)


def samples(out, split: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(out / split) for f in files)


def kind_of(path: str) -> str:
    """The kind of a JPEG as Pillow reads it back (gpu_data.KINDS)."""
    with Image.open(path) as im:
        if im.mode == "CMYK":
            return "cmyk"
        if im.mode == "L":
            return "gray"
        if im.info.get("progressive"):
            return "progressive"
        return {2: "420", 0: "444"}[JpegImagePlugin.get_sampling(im)]


def digests(out) -> list[str]:
    folder = out / gpu_data.DISTINCT
    return [hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in sorted(os.listdir(folder))]


def test_layout_is_an_image_folder_per_split(tree):
    out, stats = tree
    assert sorted(os.listdir(out)) == sorted([".distinct", ".done", "stats.json", "train", "val"])
    for split, per_class in (("train", 20), ("val", 4)):
        assert sorted(os.listdir(out / split)) == ["n0000", "n0001", "n0002"]
        for c in ("n0000", "n0001", "n0002"):
            names = os.listdir(out / split / c)
            assert len(names) == per_class
            assert all(n.startswith(f"{c}_") and n.endswith(".JPEG") for n in names)
    assert len(set(map(os.path.basename, samples(out, "train")))) == 60  # every sample its own name
    assert stats["samples"] == 72 and stats["reused"] is False
    assert {**json.loads((out / "stats.json").read_text()), "reused": False} == stats


def test_samples_are_hard_links_to_distinct_files(tree):
    out, stats = tree
    distinct = sorted(os.listdir(out / gpu_data.DISTINCT))
    assert len(distinct) == 24 and len(set(digests(out))) == 24  # all different images
    uses = collections.Counter()
    for split in ("train", "val"):
        for path in samples(out, split):
            index = int(os.path.basename(path)[6:12])
            source = out / gpu_data.DISTINCT / distinct[index % 24]
            assert os.stat(path).st_ino == os.stat(source).st_ino
            uses[index % 24] += 1
    for i, name in enumerate(distinct):
        assert os.stat(out / gpu_data.DISTINCT / name).st_nlink == 1 + uses[i]
    assert stats["copies"] == 0


def test_every_kind_and_imagenet_geometry(tree):
    out, stats = tree
    paths = [str(out / gpu_data.DISTINCT / n) for n in sorted(os.listdir(out / gpu_data.DISTINCT))]
    found = collections.Counter(kind_of(p) for p in paths)
    assert found == stats["kinds"]
    assert all(found[k] >= 1 for k in gpu_data.KINDS)
    sizes = [os.path.getsize(p) for p in paths]
    assert stats["bytes_min"] == min(sizes) and stats["bytes_max"] == max(sizes)
    assert 30_000 < stats["bytes_mean"] < 250_000  # photo-like, neither flat nor noise
    for p in paths:
        with Image.open(p) as im:
            assert 333 <= min(im.size) <= 500 and max(im.size) <= 1000
            im.load()  # decodes in full


def test_kinds_follow_the_shares_at_scale():
    kinds = collections.Counter(gpu_data.assign_kinds(2000, seed=0))
    assert kinds == {"420": 1850, "444": 60, "progressive": 60, "gray": 20, "cmyk": 10}
    assert gpu_data.assign_kinds(10, seed=0) == ["420"] * 10  # too few for every kind: none forced


def test_same_seed_same_bytes_with_any_workers(tree, tmp_path):
    out, _ = tree
    again = make_imagenet_like(str(tmp_path / "again"), **TINY, workers=2)
    assert digests(tmp_path / "again") == digests(out)
    assert again["workers"] == 2
    other = np.asarray(gpu_data.render(np.random.default_rng([1, 1, 0]), 500, 375))
    assert not np.array_equal(other, np.asarray(gpu_data.render(np.random.default_rng([0, 1, 0]), 500, 375)))


def test_second_call_returns_at_once_without_rewriting(tree):
    out, stats = tree
    before = {p: os.stat(p).st_mtime_ns for p in (out / ".done", out / "stats.json", out / "train" / "n0000")}
    start = time.perf_counter()
    again = make_imagenet_like(str(out), **TINY, workers=1)
    assert time.perf_counter() - start < 0.5
    assert again == {**stats, "reused": True}
    assert {p: os.stat(p).st_mtime_ns for p in before} == before


def test_other_parameters_rebuild_in_place(tmp_path):
    out = tmp_path / "small"
    make_imagenet_like(str(out), distinct=4, train=8, val=4, classes=2, workers=1)
    stats = make_imagenet_like(str(out), distinct=4, train=8, val=2, classes=2, workers=1)
    assert stats["reused"] is False and len(samples(out, "val")) == 2
    assert os.listdir(tmp_path) == ["small"]  # no temporary sibling left behind


def test_copies_where_hard_links_fail(tmp_path, monkeypatch):
    def no_links(source, target):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    out = tmp_path / "copied"
    stats = make_imagenet_like(str(out), distinct=2, train=4, val=2, classes=2, workers=1)
    assert stats["copies"] == 6
    first = out / "train" / "n0000" / "n0000_000000.JPEG"
    assert os.stat(first).st_nlink == 1 and first.read_bytes() == (out / gpu_data.DISTINCT / "000000.JPEG").read_bytes()


def test_refuses_a_folder_it_did_not_make(tmp_path, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "mine.jpg").write_bytes(b"precious")
    with pytest.raises(NotOurTree, match="no .done"):
        make_imagenet_like(str(out), distinct=2, train=2, val=2, classes=2, workers=1)
    with pytest.raises(SystemExit) as exit_info:
        gpu_data.main([str(out), "--distinct", "2", "--train", "2", "--val", "2", "--classes", "2"])
    assert exit_info.value.code == 2 and "not made by bench.gpu_data" in capsys.readouterr().err
    assert os.listdir(out) == ["mine.jpg"] and (out / "mine.jpg").read_bytes() == b"precious"
    assert os.listdir(tmp_path) == ["photos"]
    (tmp_path / "empty").mkdir()  # an empty folder holds nothing to lose: it is used
    make_imagenet_like(str(tmp_path / "empty"), distinct=2, train=2, val=2, classes=2, workers=1)
    assert os.path.exists(tmp_path / "empty" / ".done")


def test_the_projects_scanner_reads_the_tree(tree):
    out, _ = tree
    scanned = scan_tree(str(out), 0.2)
    assert scanned.layout == "train/val"
    assert len(scanned.train) == 60 and len(scanned.val) == 12
    assert scanned.class_names == ("n0000", "n0001", "n0002")
    assert np.bincount(scanned.train.labels).tolist() == [20, 20, 20]


def test_cli_prints_one_line_and_writes_json(tree, tmp_path, capsys):
    out, stats = tree
    args = [str(out), "--distinct", "24", "--train", "60", "--val", "12", "--classes", "3", "--workers", "1"]
    result = gpu_data.main([*args, "--json", str(tmp_path / "stats.json")])
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and "24 distinct JPEGs -> 72 samples" in line and "(made before)" in line
    assert json.loads((tmp_path / "stats.json").read_text()) == result == {**stats, "reused": True}
