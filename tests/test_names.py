"""Names as the disk has them (issue 53): file and folder names that are not UTF-8 are read by
their bytes and shown escaped (storage.shown_name); macOS's __MACOSX/ is skipped; one file under
two names is said before Ray; a URI in a manifest is taken as a URI. No Ray here: the read task
runs in-process (training/stream/ingest.py _read_files)."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import exits_2, write_tree
from training.forms.data import stable_hash
from training.forms.formats import scan_data

CAFE = b"caf\xe9.png"  # Latin-1, as older cameras and Windows tools write it
CLASS = b"\xff\xfecls"


def _byte_tree(tmp_path: Path) -> Path:
    """d/cat/ and d/<CLASS>/, 4 PNGs each; in each class one file named CAFE, and one more in a
    sub-folder whose name is not UTF-8 either."""
    root = write_tree(tmp_path / "d", {"cat": 4, "dog": 4})
    raw = os.fsencode(root)
    os.rename(raw + b"/dog", raw + b"/" + CLASS)
    for folder in (b"cat", CLASS):
        os.rename(raw + b"/" + folder + b"/000.png", raw + b"/" + folder + b"/" + CAFE)
        os.mkdir(raw + b"/" + folder + b"/\xe9t\xe9")
        os.rename(raw + b"/" + folder + b"/001.png", raw + b"/" + folder + b"/\xe9t\xe9/" + CAFE)
    return root


def _read(split, root, decode=True) -> list[str]:
    """The paths one in-process read task yields for `split`, and (via the bad-file log) none lost."""
    from types import SimpleNamespace

    from training.stream import ingest

    bad: list = []
    log = SimpleNamespace(add=SimpleNamespace(remote=bad.extend))
    rows = pa.table({"path": list(split.rel_paths), "label": split.labels, "key": split.keys})
    blocks = ingest._read_files(rows, root=str(root), decode=decode, bad_log=log, relative_paths=True)
    paths = [p for b in blocks for p in (b.column("path").to_pylist() if hasattr(b, "column") else b["path"])]
    assert bad == []
    return paths


def test_a_tree_with_names_that_are_not_utf8_is_scanned_and_read(tmp_path):
    root = _byte_tree(tmp_path)
    tree = scan_data(str(root), 0.0)
    assert tree.class_names == ("\\xff\\xfecls", "cat")  # text every file can hold, sorted as shown
    rel = sorted(tree.train.rel_paths)
    assert "cat/caf\\xe9.png" in rel and "\\xff\\xfecls/\\xe9t\\xe9/caf\\xe9.png" in rel and len(rel) == 8
    assert list(tree.train.keys) == [stable_hash(r) for r in tree.train.rel_paths]
    assert sorted(_read(tree.train, root)) == rel  # every file read by its bytes, none a bad file
    json.dumps(list(tree.class_names)).encode("utf-8")  # config.json, model.pt, the CSVs take them
    from training.driver.inputs import typical_size

    assert typical_size(tree.train) == (32, 32)


def test_stable_hash_takes_a_name_as_the_disk_has_it():
    """os.fsdecode's surrogates: hashed as the bytes they stand for, the same in every process."""
    name = os.fsdecode(b"cat/" + CAFE)
    assert stable_hash(name) == stable_hash(name) and stable_hash(name) != stable_hash("cat/caf\\xe9.png")
    assert stable_hash("cat/café.png") == stable_hash(os.fsdecode("cat/café.png".encode()))


def test_a_manifest_names_such_a_file_by_its_escaped_name(tmp_path):
    """As predictions.csv and bad_files.csv write it; the folder of the files also holds such names
    (a listing of it, pyarrow's, raised UnicodeDecodeError)."""
    root = _byte_tree(tmp_path)
    manifest = root / "train.csv"
    manifest.write_text("path,label\ncat/caf\\xe9.png,cat\ncat/002.png,cat\n\\xff\\xfecls/caf\\xe9.png,x\n")
    manifest.write_text(manifest.read_text() + "\\xff\\xfecls/002.png,x\ncat/003.png,cat\n\\xff\\xfecls/003.png,x\n")
    tree = scan_data(str(manifest), 0.0)
    assert tree.class_names == ("cat", "x") and "cat/caf\\xe9.png" in list(tree.train.rel_paths)
    assert sorted(_read(tree.train, tree.train.root)) == sorted(tree.train.rel_paths)


def test_jobs_prepare_over_such_names_writes_them_escaped_and_trains_from_them(tmp_path, capsys):
    from jobs.prepare import main

    root, out = _byte_tree(tmp_path), tmp_path / "p"
    assert main([str(root), str(out)]) == 0, capsys.readouterr().err
    written = json.loads((out / "_prepared.json").read_text())
    assert written["class_names"] == ["\\xff\\xfecls", "cat"]
    paths = [p for f in sorted(out.rglob("*.parquet")) for p in pq.read_table(f, columns=["path"])["path"].to_pylist()]
    assert len(paths) == 8 and "\\xff\\xfecls/\\xe9t\\xe9/caf\\xe9.png" in paths
    assert scan_data(str(out)).class_names == ("\\xff\\xfecls", "cat")


def test_jobs_preview_over_such_names(tmp_path, capsys):
    from jobs.preview import main

    root = _byte_tree(tmp_path)
    out = tmp_path / "grid.png"
    assert main(["--data", str(root), "--out", str(out), "--classes", "2", "--augmentations", "1"]) == 0
    printed = capsys.readouterr()
    assert out.read_bytes()[:4] == b"\x89PNG" and "skipped" not in printed.out, printed


def test_a_data_path_that_is_not_utf8_is_one_line(tmp_path, capsys, no_ray):
    raw = os.fsencode(write_tree(tmp_path / "d", {"cat": 2, "dog": 2}))
    os.rename(raw, raw[:-1] + b"\xe9")
    err = exits_2(["--data", os.fsdecode(raw[:-1] + b"\xe9")], capsys)
    assert "\\xe9: the path of --data is not UTF-8 text" in err


# --------------------------------------------------------------------------- macOS zips, links


def test_an_unzipped_macosx_folder_and_appledouble_files_are_skipped(tmp_path):
    root = write_tree(tmp_path / "d", {"cat": 3, "dog": 3})
    for cls in ("cat", "dog"):
        (root / "__MACOSX" / cls).mkdir(parents=True)
        (root / "__MACOSX" / cls / "._000.png").write_bytes(b"\0\5\26\7" + bytes(60))  # AppleDouble
        (root / cls / "._000.png").write_bytes(b"\0\5\26\7" + bytes(60))
    tree = scan_data(str(root), 0.0)
    assert tree.class_names == ("cat", "dog") and len(tree.train) == 6


def test_one_file_under_two_class_folders_is_said_before_ray(tmp_path, capsys, monkeypatch):
    """A hard link and a symbolic link: one line with the count and one pair, printed before Ray
    starts (here Ray's start is interrupted), and the run goes on: a warning, not a refusal."""
    from jobs import train as train_job

    root = write_tree(tmp_path / "d", {"cat": 3, "dog": 3})
    os.link(root / "cat" / "000.png", root / "dog" / "linked.png")
    os.symlink(root / "cat" / "001.png", root / "dog" / "symlinked.png")
    tree = scan_data(str(root), 0.0)
    (note,) = tree.notes
    assert note.startswith(f"warning: {root}: 2 image file(s) are listed under two names") and "e.g. cat/" in note
    assert not scan_data(str(write_tree(tmp_path / "e", {"cat": 2, "dog": 2})), 0.0).notes

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_job, "connect", interrupted)
    assert train_job.main(["--data", str(root), "--storage-path", str(tmp_path / "runs"), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert err.count("listed under two names") == 1 and err.index("listed under") < err.index("stopped:")


# --------------------------------------------------------------------------- URIs in manifests


@pytest.mark.parametrize("uri", ["https://host/x.png", "http://host/x.png", "ftp://host/x.png"])
def test_a_web_address_in_a_manifest_is_one_line_not_a_path_below_its_folder(tmp_path, capsys, no_ray, uri):
    root = write_tree(tmp_path / "d", {"cat": 2, "dog": 2})
    (root / "train.csv").write_text(f"path,label\ncat/000.png,cat\n{uri},dog\n")
    err = exits_2(["--data", str(root / "train.csv")], capsys)
    scheme = uri.split(":")[0]
    assert f"train.csv:3: {uri}: a {scheme}:// address; a manifest's files are read from local disk, s3:// or" in err
    assert str(root / scheme) not in err


def test_an_s3_uri_in_a_manifest_is_read_from_s3(s3, tmp_path):
    """A local manifest listing s3:// files: their storage is S3's, and the read task reads them there."""
    uri = s3.upload(write_tree(tmp_path / "t", {"cat": 2, "dog": 2}), "s3://data/names/manifest-uris")
    manifest = tmp_path / "train.csv"
    with open(manifest, "w", newline="") as f:
        rows = [(f"{uri}/{c}/{i:03d}.png", c) for c in ("cat", "dog") for i in (0, 1)]
        csv.writer(f).writerows([("path", "label"), *rows])
    tree = scan_data(str(manifest), 0.0)
    assert tree.train.root.startswith("s3://data/names/manifest-uris") and len(tree.train) == 4
    assert sorted(_read(tree.train, tree.train.root)) == sorted(tree.train.rel_paths)
    mixed = tmp_path / "mixed.csv"
    mixed.write_text(f"path,label\n{uri}/cat/000.png,cat\nt/dog/000.png,dog\n")
    with pytest.raises(ValueError, match="mixed.csv:3: a file on local disk, but .*mixed.csv:2 lists one on s3"):
        scan_data(str(mixed), 0.0)


# --------------------------------------------------------------------------- shards


def _shard(path: Path, keys: list[bytes]) -> None:
    """A WebDataset shard (GNU tar: member names are bytes) of a PNG and a .cls per key, labels 0, 1, 0, ..."""
    import io
    import tarfile

    from PIL import Image

    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, errors="surrogateescape") as tar:
        for i, key in enumerate(keys):
            buf = io.BytesIO()
            Image.new("RGB", (16, 16), (i * 30, 0, 0)).save(buf, format="PNG")
            for ext, data in ((b".png", buf.getvalue()), (b".cls", str(i % 2).encode())):
                info = tarfile.TarInfo(os.fsdecode(key + ext))
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_shard_members_named_in_bytes_are_read_and_a_shard_so_named_is_one_line(tmp_path):
    from training.forms.formats import read_units

    root = tmp_path / "wds"
    root.mkdir()
    _shard(root / "train-0000.tar", [b"s0", b"caf\xe91", b"s2", b"caf\xe93"])
    tree = scan_data(str(root), 0.0)
    table = read_units(tree.train.units, tree.train.root, tree.train.shards, tree.train.form)
    shown = ("s0", "caf\\xe91", "s2", "caf\\xe93")
    assert table.column("path").to_pylist() == [f"train-0000.tar/{k}.png" for k in shown]
    os.rename(os.fsencode(root / "train-0000.tar"), os.fsencode(root) + b"/train-\xe9.tar")
    with pytest.raises(ValueError, match=r"wds/train-\\xe9.tar: a shard whose name is not UTF-8 text; rename it"):
        scan_data(str(root), 0.0)


def test_an_output_or_input_path_that_is_not_utf8_is_one_line_before_ray(tmp_path, capsys, no_ray):
    """pyarrow, which writes every output, takes no such path: refused before anything is written."""
    from jobs.prepare import main as prepare

    root = str(_byte_tree(tmp_path))
    odd = os.fsdecode(os.fsencode(tmp_path) + b"/\xe9")
    err = exits_2(["--data", root, "--storage-path", odd], capsys)
    assert f"{tmp_path}/\\xe9/run-" in err and "a path that is not UTF-8 text" in err
    err = exits_2(["--data", root, "--class-names", odd], capsys)
    assert f"{tmp_path}/\\xe9: a path that is not UTF-8 text" in err
    assert prepare([root, odd]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path}/\\xe9: a path that is not UTF-8 text" in err
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"d"]  # nothing written
