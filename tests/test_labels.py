"""What is trained is what the user meant (issue 43, part 3; issue 45): a source's labels are all
class indices or all class names, every class has training images, each real folder is listed
once, split folders are told from class folders, and the files users bring in other encodings
or the datasets library's layouts are read or refused on one line. All before Ray: `no_ray`."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.conftest import exits_2, write_tree
from training.forms.data import DataError, stable_hash
from training.forms.formats import scan_data


def _png(i: int = 0) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), i * 40 % 256, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _files(folder: Path, names) -> list[str]:
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(_png(len(name)))
    return list(names)


def _shard(path: Path, members) -> Path:
    """A tar of (member name, bytes), as webdataset's TarWriter writes a sample: `<key>.<ext>` each."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _refused(tmp_path, capsys, data, *flags) -> str:
    return exits_2(["--data", str(data), "--storage-path", str(tmp_path / "runs"), *flags], capsys)


def _all_in_validation(keys) -> float:
    """A --val-fraction below 1 that puts every one of `keys` in validation (the hash split)."""
    top = max(int(k) for k in keys) / 2**63
    return round((top + 1) / 2, 6)


# --------------------------------------------------------------------------- one kind of label a source


@pytest.mark.parametrize(
    "labels, message",
    [
        (["0", "1", "cat", "dog"], "labels mix class indices (train.csv:2: '0') and class names (train.csv:4: 'cat')"),
        (["cat", "dog", "-1", "cat"], "label -1 (train.csv:4) is a negative class index"),
        (["cat", "dog", "CAT", "dog"], "labels 'cat' (train.csv:2) and 'CAT' (train.csv:4) differ only in case"),
        (
            ["0", "1", "999", "1"],
            "class indices run to 999 (train.csv:4) but 997 of those 1000 classes have no training image",
        ),
    ],
    ids=["mix", "negative-beside-names", "case", "gap"],
)
def test_a_manifests_labels_are_one_kind_and_every_class_has_images(tmp_path, capsys, no_ray, labels, message):
    names = _files(tmp_path, [f"{i}.png" for i in range(len(labels))])
    rows = "".join(f"{n},{lab}\n" for n, lab in zip(names, labels, strict=True))
    (tmp_path / "train.csv").write_text("path,label\n" + rows)
    err = _refused(tmp_path, capsys, tmp_path / "train.csv", "--val-fraction", "0")
    assert message in err, err


def test_integral_decimals_are_the_indices_they_write(tmp_path):
    """pandas writes an integer column with a gap as floats: 0.0 and 1 are classes 0 and 1, not two kinds."""
    names = _files(tmp_path, [f"{i}.png" for i in range(4)])
    rows = "".join(f"{n},{lab}\n" for n, lab in zip(names, ["0.0", "1", "1.0", "0"], strict=True))
    (tmp_path / "train.csv").write_text(rows)
    tree = scan_data(str(tmp_path / "train.csv"), 0.0)
    assert tree.class_names == ("0", "1") and tree.train.labels.tolist() == [0, 1, 1, 0]


@pytest.mark.parametrize(
    "cls, message",
    [
        (b"abc", "s/0000.tar/b.cls: 'abc' is not a class index; a .cls member holds an integer"),
        (b"1.0", "s/0000.tar/b.cls: '1.0' is not a class index"),
        (b"999", "class indices run to 999 (0000.tar/b) but 998 of those 1000 classes have no training image"),
        (b"-1", "label -1 (0000.tar/b) is a negative class index"),
    ],
    ids=["text", "decimal", "gap", "negative"],
)
def test_a_cls_member_is_an_integer_and_indices_leave_no_class_empty(tmp_path, capsys, no_ray, cls, message):
    members = [("a.png", _png(1)), ("a.cls", b"0"), ("b.png", _png(2)), ("b.cls", cls)]
    members += [("c.png", _png(3)), ("c.cls", b"0"), ("d.png", _png(4)), ("d.cls", b"0")]
    _shard(tmp_path / "s" / "0000.tar", members)
    err = _refused(tmp_path, capsys, tmp_path / "s", "--val-fraction", "0")
    assert message in err, err


def test_sample_keys_with_dots_keep_their_numbers(tmp_path):
    """cat.train.001.jpg is the sample cat.train.001 (webdataset's first dot would make it `cat`
    with the extension train.001.jpg, which is no image); img.seg.png stays webdataset's img + seg.png."""
    members = []
    for i in range(3):
        for c, name in enumerate(("cat", "dog")):
            members += [(f"{name}.train.{i:03d}.jpg", _png(i)), (f"{name}.train.{i:03d}.cls", str(c).encode())]
    members += [("img.png", _png(9)), ("img.cls", b"1"), ("img.seg.png", _png(8))]
    _shard(tmp_path / "s" / "0000.tar", members)
    tree = scan_data(str(tmp_path / "s"), 0.0)
    assert len(tree.train) == 7 and not tree.unreadable
    assert sorted(tree.train.labels.tolist()) == [0, 0, 0, 1, 1, 1, 1]
    assert "0000.tar/dog.train.002.jpg" in tree.train.rel_paths and "0000.tar/img.png" in tree.train.rel_paths


# --------------------------------------------------------------------------- trees: classes and folders


def test_a_class_folder_without_images_exits_2(tmp_path, capsys, no_ray):
    write_tree(tmp_path / "d", {"cat": 3, "dog": 3})
    (tmp_path / "d" / "eel").mkdir()
    (tmp_path / "d" / "eel" / "notes.txt").write_text("no images")
    err = _refused(tmp_path, capsys, tmp_path / "d")
    assert f"{tmp_path / 'd' / 'eel'}: no images in class directory 'eel'" in err, err


def test_a_class_only_in_validation_exits_2(tmp_path, capsys, no_ray):
    write_tree(tmp_path / "d" / "train", {"cat": 3, "dog": 3})
    (tmp_path / "d" / "train" / "eel").mkdir()
    write_tree(tmp_path / "d" / "val", {"cat": 1, "eel": 2})
    err = _refused(tmp_path, capsys, tmp_path / "d")
    assert "class 'eel' has no training images (2 in validation)" in err, err


def test_a_class_the_hash_split_puts_wholly_in_validation_exits_2(tmp_path, capsys, no_ray):
    root = write_tree(tmp_path / "d", {"cat": 4, "dog": 4})
    name = next(f"eel/{i}.png" for i in range(1000) if stable_hash(f"eel/{i}.png") / 2**63 < 0.05)
    _files(root, [name])
    assert all(stable_hash(f"{c}/{i:03d}.png") / 2**63 >= 0.1 for c in ("cat", "dog") for i in range(1))
    err = _refused(tmp_path, capsys, root, "--val-fraction", "0.1")
    assert "class 'eel' has no training images (1 in validation at --val-fraction 0.1); add training images" in err
    assert err.endswith("or lower --val-fraction\n"), err


def test_a_symbolic_link_loop_lists_each_real_folder_once(tmp_path):
    root = write_tree(tmp_path / "d", {"cat": 6, "dog": 6})
    os.symlink(".", root / "cat" / "again")  # cat/again/again/... is cat
    tree = scan_data(str(root), 0.0)
    assert len(tree.train) == 12 and sorted(tree.train.labels.tolist()) == [0] * 6 + [1] * 6


@pytest.mark.parametrize("target, first", [("../dog", "cat/more"), ("..", "cat/more/dog")], ids=["class", "root"])
def test_a_link_to_another_class_folder_exits_2(tmp_path, capsys, no_ray, target, first):
    """A loop through the root (cat/more -> ..) reaches dog/ from inside cat/ too: its images would be cats."""
    root = write_tree(tmp_path / "d", {"cat": 3, "dog": 3})
    os.symlink(target, root / "cat" / "more")
    err = _refused(tmp_path, capsys, root)
    assert f"{root}/dog: the same folder as {root}/{first} (a symbolic link)" in err, err


@pytest.mark.parametrize("name", ["validation", "valid", "dev"])
def test_a_validation_folder_by_any_split_word_is_the_validation_split(tmp_path, name):
    write_tree(tmp_path / "train", {"cat": 4, "dog": 4})
    write_tree(tmp_path / name, {"cat": 1, "dog": 2})
    write_tree(tmp_path / "test", {"cat": 5, "dog": 5})  # left out, as test shards are
    tree = scan_data(str(tmp_path), 0.5)
    assert tree.class_names == ("cat", "dog") and tree.layout == "train/val"
    assert (len(tree.train), len(tree.val)) == (8, 3) and all(r.startswith(f"{name}/") for r in tree.val.rel_paths)


@pytest.mark.parametrize(
    "folders, message",
    [
        (["train"], "{d}/train: no val/ folder beside it (nor validation/, valid/ or dev/); add one, or give --data"),
        (["train", "test"], "{d}/train: no val/ folder beside it"),
        (["validation", "test"], "{d}: split folder(s) ['test', 'validation'] but no train/ folder"),
        (["cat", "dog", "test"], "{d}: split folder(s) ['test'] beside the class folders ['cat', 'dog']"),
        (["train", "val", "validation"], "{d}: both val/ and validation/ name the validation split; keep one"),
    ],
    ids=["train-alone", "train-test", "no-train", "test-among-classes", "two-val"],
)
def test_split_folders_that_do_not_make_a_split_exit_2(tmp_path, capsys, no_ray, folders, message):
    for f in folders:
        if f in ("train", "val", "validation", "test"):
            write_tree(tmp_path / "d" / f, {"cat": 2, "dog": 2})
        else:
            write_tree(tmp_path / "d", {f: 2})
    err = _refused(tmp_path, capsys, tmp_path / "d")
    assert message.replace("{d}", str(tmp_path / "d")) in err, err


# --------------------------------------------------------------------------- an empty training split


def test_a_tree_hashed_wholly_into_validation_exits_2(tmp_path, capsys, no_ray):
    root = write_tree(tmp_path / "d", {"cat": 2, "dog": 2})
    fraction = _all_in_validation(stable_hash(f"{c}/{i:03d}.png") for c in ("cat", "dog") for i in range(2))
    err = _refused(tmp_path, capsys, root, "--val-fraction", str(fraction))
    assert f"{root}: all 4 images fell into validation at --val-fraction {fraction:g}; lower --val-fraction" in err


def test_a_manifest_hashed_wholly_into_validation_exits_2(tmp_path, capsys, no_ray):
    names = _files(tmp_path, ["a.png", "b.png", "c.png", "d.png"])
    (tmp_path / "all.csv").write_text("".join(f"{n},{'cat' if i % 2 else 'dog'}\n" for i, n in enumerate(names)))
    fraction = _all_in_validation(stable_hash(n) for n in names)
    err = _refused(tmp_path, capsys, tmp_path / "all.csv", "--val-fraction", str(fraction))
    assert "all 4 images fell into validation" in err, err


def test_shards_hashed_wholly_into_validation_exit_2(tmp_path, capsys, no_ray):
    members = [m for k in "abcd" for m in ((f"{k}.png", _png()), (f"{k}.cls", str("abcd".index(k) % 2).encode()))]
    _shard(tmp_path / "s" / "0000.tar", members)
    fraction = _all_in_validation(stable_hash(f"0000.tar/{k}") for k in "abcd")
    err = _refused(tmp_path, capsys, tmp_path / "s", "--val-fraction", str(fraction))
    assert "all 4 images fell into validation" in err, err


def _export(path: Path, labels, features=None) -> Path:
    features = features or {"image": {"_type": "Image"}, "label": {"names": ["a", "b"], "_type": "ClassLabel"}}
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "image": pa.array([{"bytes": _png(i), "path": f"{i}.png"} for i in range(len(labels))], image_type),
            "label": pa.array(labels, pa.int64()),
        }
    ).replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def test_an_export_hashed_wholly_into_validation_exits_2(tmp_path, capsys, no_ray):
    _export(tmp_path / "hf" / "train.parquet", [0, 1, 0, 1])
    fraction = _all_in_validation(stable_hash(f"train.parquet:{r}") for r in range(4))
    err = _refused(tmp_path, capsys, tmp_path / "hf", "--val-fraction", str(fraction))
    assert "all 4 images fell into validation" in err, err


def test_an_exports_classes_without_training_rows_pass_if_named_and_exit_2_if_numbered(tmp_path, capsys, no_ray):
    """A ClassLabel names its classes (a subset's export keeps them all): said on the data line.
    A plain integer column's classes are 0..N-1 by its largest label: a gap is a mistake."""
    named = {"image": {"_type": "Image"}, "label": {"names": ["a", "b", "c"], "_type": "ClassLabel"}}
    _export(tmp_path / "named" / "train.parquet", [0, 1, 0, 1], named)
    tree = scan_data(str(tmp_path / "named"), 0.0)
    assert tree.class_names == ("a", "b", "c") and ": 3 classes (1 without training images), 4 train" in tree.describe()
    numbered = {"image": {"_type": "Image"}, "label": {"dtype": "int64", "_type": "Value"}}
    _export(tmp_path / "numbered" / "train.parquet", [0, 1, 3, 1], numbered)
    err = _refused(tmp_path, capsys, tmp_path / "numbered", "--val-fraction", "0")
    assert "class '2' has no training images (0 in validation); add training images of it" in err, err


# --------------------------------------------------------------------------- the datasets library's imagefolder


def _imagefolder(root: Path, header: str = "file_name,label") -> Path:
    """The datasets library's imagefolder with metadata: DIR/<split>/metadata.csv naming the split's
    files (`file_name`) beside them, the images flat."""
    for split, n in (("train", 6), ("validation", 2)):
        names = _files(root / split, [f"{split[0]}{i}.png" for i in range(n)])
        rows = "".join(f"{f},{'cat' if i % 2 else 'dog'}\n" for i, f in enumerate(names))
        (root / split / "metadata.csv").write_text(f"{header}\n{rows}")
    return root


def test_an_imagefolder_metadata_csv_is_a_manifest_with_its_validation_beside(tmp_path):
    root = _imagefolder(tmp_path / "d")
    tree = scan_data(str(root / "train" / "metadata.csv"))
    assert tree.class_names == ("cat", "dog") and (len(tree.train), len(tree.val)) == (6, 2)
    assert all(r.startswith("validation/") for r in tree.val.rel_paths) and "manifests' own" in tree.layout


def test_an_imagefolder_with_metadata_given_as_a_tree_names_the_manifest(tmp_path, capsys, no_ray):
    root = _imagefolder(tmp_path / "d")
    err = _refused(tmp_path, capsys, root)
    assert f"{root}/train/metadata.csv: the labels are in the datasets library's metadata file" in err, err
    assert f"--data {root}/train/metadata.csv" in err


def test_a_metadata_csv_without_a_label_column_names_label_key(tmp_path, capsys, no_ray):
    root = _imagefolder(tmp_path / "d", header="file_name,species")
    err = _refused(tmp_path, capsys, root / "train" / "metadata.csv")
    assert "metadata.csv:1: the header names no label column" in err and "--label-key" in err, err
    tree = scan_data(str(root / "train" / "metadata.csv"), label_key="species")
    assert tree.class_names == ("cat", "dog") and len(tree.train) == 6


# --------------------------------------------------------------------------- encodings and broken files


def _manifest_rows(tmp_path, sep=","):
    names = _files(tmp_path, ["café/1.png", "café/2.png", "thé/1.png", "thé/2.png"])
    return "".join(f"{n}{sep}{n.split('/')[0]}\r\n" for n in names)


@pytest.mark.parametrize("sep", [",", "\t"], ids=["comma", "tab"])
def test_a_utf16_manifest_with_its_bom_is_read(tmp_path, sep):
    """Excel's "Unicode text": UTF-16 with a byte order mark, tab-separated."""
    (tmp_path / "train.csv").write_bytes(("path" + sep + "label\r\n" + _manifest_rows(tmp_path, sep)).encode("utf-16"))
    tree = scan_data(str(tmp_path / "train.csv"), 0.0)
    assert tree.class_names == ("café", "thé") and len(tree.train) == 4


def test_a_latin1_manifest_exits_2_naming_the_encoding(tmp_path, capsys, no_ray):
    (tmp_path / "train.csv").write_bytes(_manifest_rows(tmp_path).encode("latin-1"))
    err = _refused(tmp_path, capsys, tmp_path / "train.csv")
    assert f"{tmp_path / 'train.csv'}: not UTF-8 text (byte 0xe9 on line 1); save it as UTF-8" in err, err


@pytest.mark.parametrize(
    "raw, message",
    [
        ("epochs: 1\nname: café\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 on line 2); save it as UTF-8"),
        (_png(), "not UTF-8 text (byte 0x89 on line 1)"),
    ],
    ids=["latin-1", "binary"],
)
def test_a_config_file_that_is_not_utf8_exits_2(tmp_path, capsys, no_ray, raw, message):
    (tmp_path / "run.yaml").write_bytes(raw)
    err = exits_2(["--config", str(tmp_path / "run.yaml")], capsys)
    assert f"error: --config {tmp_path / 'run.yaml'}: {message}" in err, err


def test_a_utf16_config_file_is_read(tmp_path):
    from jobs.train import parser
    from training.driver.flags import parse_config

    (tmp_path / "run.yaml").write_bytes("# thé\nepochs: 3\n".encode("utf-16"))
    cfg, _ = parse_config(parser(), ["--config", str(tmp_path / "run.yaml")])
    assert cfg.epochs == 3


@pytest.mark.parametrize("content", [b"", b"path,label\ncat/1.png,cat\n"], ids=["empty", "text"])
def test_a_file_named_parquet_that_is_none_exits_2(tmp_path, capsys, no_ray, content):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "train.parquet").write_bytes(content)
    err = _refused(tmp_path, capsys, tmp_path / "p")
    assert f"{tmp_path / 'p' / 'train.parquet'}: not a Parquet file" in err, err


@pytest.mark.parametrize(
    "features, message",
    [
        ([{"name": "image", "_type": "Image"}], "the `huggingface` metadata's features are a list"),
        (
            {"img": {"_type": "Image"}, "label": {"names": ["a", "b"], "_type": "ClassLabel"}},
            "the `huggingface` metadata names columns the file lacks: ['img']",
        ),
    ],
    ids=["list", "absent-column"],
)
def test_an_exports_features_that_do_not_fit_its_columns_exit_2(tmp_path, capsys, no_ray, features, message):
    _export(tmp_path / "hf" / "train.parquet", [0, 1, 0, 1], features)
    err = _refused(tmp_path, capsys, tmp_path / "hf")
    assert message in err, err


def test_the_scans_refuse_with_data_errors_not_tracebacks(tmp_path):
    """The same refusals reach jobs.preview and jobs.prepare, which call the scans directly."""
    root = write_tree(tmp_path / "d", {"cat": 2})
    (root / "dog").mkdir()
    with pytest.raises(DataError, match="no images in class directory 'dog'"):
        scan_data(str(root))
