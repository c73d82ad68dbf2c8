"""jobs.prepare: Parquet shards hold the same split, labels, keys and pixels as the tree."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq

from jobs.prepare import main
from tests.conftest import write_tree
from training.forms.parquet import MANIFEST, is_prepared, scan_prepared
from training.forms.tree import scan_tree
from training.stream.ingest import read_split


def _rows(ds) -> dict:
    """key -> (label, image) of every row of a dataset of {image, label, key}."""
    out = {}
    for batch in ds.iter_batches(batch_format="numpy", batch_size=None):
        for image, label, key in zip(batch["image"], batch["label"], batch["key"], strict=True):
            out[int(key)] = (int(label), np.asarray(image))
    return out


def test_prepared_shards_read_back_as_the_tree(ray_cluster, tmp_path, capsys):
    # mixed sizes: ragged batches come out of both readers alike
    tree_dir = write_tree(tmp_path / "data", {"cat": 9, "dog": 8, "eel": 7}, sizes=[(32, 32), (24, 40)])
    (tree_dir / "dog" / "broken.png").write_bytes(b"not a png")  # kept as bytes; dropped when decoded
    out = tmp_path / "prepared"
    assert main([str(tree_dir), str(out), "--val-fraction", "0.25", "--shard-mb", "0.004"]) == 0
    assert "train with: python -m jobs.train --data" in capsys.readouterr().out
    manifest = json.loads((out / MANIFEST).read_text())
    assert is_prepared(str(out)) and not is_prepared(str(tree_dir))
    assert len(manifest["splits"]["train"]["shards"]) > 1  # several shards at this tiny size

    tree, prepared = scan_tree(str(tree_dir), 0.25), scan_prepared(str(out))
    assert prepared.class_names == tree.class_names
    for a, b in ((tree.train, prepared.train), (tree.val, prepared.val)):
        assert sorted(zip(a.paths, a.labels, a.keys, strict=True)) == sorted(
            zip(b.paths, b.labels, b.keys, strict=True)
        )
        assert a.total_bytes == b.total_bytes

    # a shard row: the file's bytes unchanged, its size and its relative path
    table = pq.read_table(out / manifest["splits"]["val"]["shards"][0])
    row = table.slice(0, 1).to_pylist()[0]
    assert (tree_dir / row["path"]).read_bytes() == row["bytes"]
    assert (row["height"], row["width"]) in ((32, 32), (24, 40))

    # the train split (the val split goes through the same reader): same rows, same pixels;
    # the broken file, wherever it landed, is dropped by both readers
    from_tree = _rows(read_split(tree.train, seed=0, shuffle=True, decode=True))
    from_parquet = _rows(read_split(prepared.train, seed=0, shuffle=True, decode=True))
    broken_in_train = any(p.endswith("dog/broken.png") for p in tree.train.paths)
    assert from_tree.keys() == from_parquet.keys() and len(from_tree) == len(tree.train) - broken_in_train
    for key, (label, image) in from_tree.items():
        assert from_parquet[key][0] == label
        np.testing.assert_array_equal(from_parquet[key][1], image)
    assert len(tree.train) + len(tree.val) == 25


def test_a_shard_size_below_one_image_writes_a_shard_an_image_and_no_empty_ones(tmp_path, capsys):
    tree_dir = write_tree(tmp_path / "data", {"cat": 5, "dog": 4})
    out = tmp_path / "prepared"
    assert main([str(tree_dir), str(out), "--val-fraction", "0.25", "--shard-mb", "1e-9"]) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    for split in ("train", "val"):
        rows = [pq.read_metadata(out / shard).num_rows for shard in manifest["splits"][split]["shards"]]
        assert rows and set(rows) == {1}, (split, rows)  # as many shards as images, each with one
    assert len(list(out.rglob("*.parquet"))) == 9


def test_prepare_refuses_a_non_empty_out_and_a_bad_tree(tmp_path, capsys):
    tree_dir = write_tree(tmp_path / "data", {"a": 2, "b": 2})
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("someone's file")
    assert main([str(tree_dir), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "already exists and is not empty" in err
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "out2")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "out2" / MANIFEST).exists()


def test_prepare_refuses_an_out_inside_the_tree_and_empty_paths_and_writes_nothing(tmp_path, capsys):
    """Shards written among the images would pollute the user's tree and every later scan of it; an
    empty DIR or OUT (an unset shell variable) is not the working folder."""
    tree_dir = write_tree(tmp_path / "data", {"a": 2, "b": 2})
    before = sorted(p.relative_to(tree_dir) for p in tree_dir.rglob("*"))
    for out in (tree_dir / "a" / "prepared", tree_dir, tree_dir / ".." / "data" / "x"):
        assert main([str(tree_dir), str(out)]) == 2
        assert capsys.readouterr().err == (
            f"error: {out}: inside the tree {tree_dir}; give a directory outside it for the prepared shards\n"
        )
    for args, word in (([str(tree_dir), ""], "OUT"), (["", str(tmp_path / "out")], "DIR")):
        assert main(args) == 2
        assert capsys.readouterr().err == f"error: {word} is empty; give the image tree and a new directory\n"
    assert sorted(p.relative_to(tree_dir) for p in tree_dir.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_a_prepare_stopped_half_way_leaves_out_as_it_found_it(tmp_path):
    """Ctrl-C (or SIGTERM, which jobs.prepare takes as Ctrl-C) after the first shard: it gave a
    traceback and left OUT with shards and no manifest, which the next run refused ("already exists
    and is not empty; ... delete it"). OUT, new or empty before, is so again; the same call then works."""
    import pytest

    from training.forms.parquet import prepare_tree

    data = write_tree(tmp_path / "data", {"a": 12, "b": 12})

    def stop_after_a_shard(line):
        if "wrote" in line:
            raise KeyboardInterrupt

    new, empty = tmp_path / "new", tmp_path / "empty"
    empty.mkdir()
    for out in (new, empty):
        with pytest.raises(KeyboardInterrupt):
            prepare_tree(str(data), str(out), shard_mb=0.001, log=stop_after_a_shard)
    assert not new.exists() and list(empty.iterdir()) == []
    manifest = prepare_tree(str(data), str(new), shard_mb=0.001, log=lambda line: None)
    assert manifest["splits"]["train"]["images"] + manifest["splits"]["val"]["images"] == 24 and is_prepared(str(new))


def test_a_stopped_prepare_keeps_a_file_someone_put_into_out_meanwhile(tmp_path):
    """A long scan: someone saves a file into OUT (new or empty before) while it runs, then the run
    stops. Only the run's own splits and manifest go; the file, and so OUT, stay."""
    import pytest

    from training.forms.parquet import prepare_tree

    data = write_tree(tmp_path / "data", {"a": 12, "b": 12})
    new, empty = tmp_path / "new", tmp_path / "empty"
    empty.mkdir()
    for out in (new, empty):

        def a_file_arrives_then_stop(line, out=out):
            if "wrote" in line:
                (out / "notes.txt").write_text("mine")
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            prepare_tree(str(data), str(out), shard_mb=0.001, log=a_file_arrives_then_stop)
        assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
