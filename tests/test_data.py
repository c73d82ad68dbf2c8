"""The tree contract: class map, splits, filtering, and bad input (docs/design.md, "Contracts")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from augment.decode import decode_image
from tests.conftest import write_tree
from training.forms.data import DataError, in_validation, label_of, stable_hash
from training.forms.tree import scan_tree

REPO = Path(__file__).resolve().parents[1]


def _rel(tree, paths):
    return [str(Path(p).relative_to(tree)) for p in paths]


def test_labels_are_sorted_directory_positions(tree):
    t = scan_tree(str(tree), val_fraction=0.25)
    assert t.class_names == ("cat", "dog", "eel")
    for split in (t.train, t.val):
        for path, label in zip(split.paths, split.labels, strict=True):
            assert Path(path).parent.name == t.class_names[label]


def test_hash_split_is_deterministic_disjoint_and_complete(tree):
    a, b = scan_tree(str(tree), 0.25), scan_tree(str(tree), 0.25)
    assert a.train.paths == b.train.paths and a.val.paths == b.val.paths
    train, val = set(_rel(tree, a.train.paths)), set(_rel(tree, a.val.paths))
    assert not train & val, "a validation file is also trained on"
    assert len(train | val) == 36
    assert all(in_validation(r, 0.25) for r in val) and not any(in_validation(r, 0.25) for r in train)
    assert 3 <= len(val) <= 15  # ~9 expected from a 0.25 split of 36


def test_split_does_not_depend_on_where_the_tree_lives(tmp_path):
    one = write_tree(tmp_path / "one", {"a": 20, "b": 20})
    two = write_tree(tmp_path / "elsewhere" / "two", {"a": 20, "b": 20})
    assert _rel(one, scan_tree(str(one), 0.3).val.paths) == _rel(two, scan_tree(str(two), 0.3).val.paths)


def test_train_val_layout(tmp_path):
    write_tree(tmp_path / "train", {"a": 4, "b": 4})
    write_tree(tmp_path / "val", {"a": 2, "b": 1})
    t = scan_tree(str(tmp_path), val_fraction=0.5)
    assert t.layout == "train/val"
    assert len(t.train) == 8 and len(t.val) == 3
    assert all("/val/" in p for p in t.val.paths) and all("/train/" in p for p in t.train.paths)


def test_hidden_and_non_image_files_are_ignored(tree):
    (tree / "cat" / "notes.txt").write_text("not an image")
    (tree / "cat" / ".hidden.png").write_bytes((tree / "cat" / "000.png").read_bytes())
    (tree / ".cache").mkdir()
    (tree / ".cache" / "x.png").write_bytes((tree / "cat" / "000.png").read_bytes())
    t = scan_tree(str(tree), 0.0)
    assert t.class_names == ("cat", "dog", "eel")
    assert len(t.train) == 36
    assert not any("notes" in p or "/." in p for p in t.train.paths)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "missing", "no such directory"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "no class directories"),
        (lambda p: write_tree(p / "one", {"only": 3}), "at least 2 classes"),
        (lambda p: [(p / "noimg" / c).mkdir(parents=True) for c in "ab"] and p / "noimg", "no images"),
    ],
    ids=["missing", "no-classes", "one-class", "no-images"],
)
def test_bad_trees_raise_data_error_naming_the_path(tmp_path, make, message):
    root = make(tmp_path)
    with pytest.raises(DataError, match=message) as err:
        scan_tree(str(root))
    assert str(root) in str(err.value)


def test_validation_classes_must_be_training_classes(tmp_path):
    write_tree(tmp_path / "train", {"a": 2, "b": 2})
    write_tree(tmp_path / "val", {"a": 1, "zebra": 1})
    with pytest.raises(DataError, match="zebra"):
        scan_tree(str(tmp_path))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "/nonexistent/photos"], "/nonexistent/photos: no such directory"),
        (["--epochs", "0"], "--epochs must be positive"),
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--batch-size", "2", "--num-workers", "4"], "smaller than --num-workers"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args, message, tmp_path):
    runs = tmp_path / "runs"  # never the repository's runs/
    out = subprocess.run(
        [sys.executable, "-m", "jobs.train", *args, "--storage-path", str(runs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert not runs.exists()  # and no empty run directory left behind


def test_decode_modes_and_labels_from_the_path(tree, tmp_path):
    from PIL import Image

    gray = tmp_path / "g.png"
    Image.fromarray(np.full((5, 7), 200, np.uint8), mode="L").save(gray)
    rgba = tmp_path / "a.png"
    Image.fromarray(np.zeros((4, 4, 4), np.uint8), mode="RGBA").save(rgba)
    assert decode_image(gray.read_bytes()).shape == (5, 7, 3)
    assert (decode_image(rgba.read_bytes()) == 255).all()  # transparent -> white background
    t = scan_tree(str(tree), 0.0)
    index = {name: i for i, name in enumerate(t.class_names)}
    # each file's label is its class directory's, its key the hash of its path
    assert [label_of(r, index, 0 if t.layout == "hash" else 1) for r in t.train.rel_paths] == list(t.train.labels)
    assert [stable_hash(r) for r in t.train.rel_paths] == list(t.train.keys)
    assert label_of("train/dog/x/1.png", index, 1) == index["dog"] and label_of("dog.png", index, 0) == -1
    assert label_of("a/b/cat/1.png", index, -2) == index["cat"] and label_of("1.png", index, -2) == -1
