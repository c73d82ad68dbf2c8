"""One bad file never ends a run (issue 43): whatever goes wrong with one file (Pillow raising
anything at all on it, its read failing with an I/O error, a WebDataset member whose tar header
is broken) makes it a listed, skipped bad file with its reason; only an error that is not about
the file (the data's folder or bucket gone) ends the run, in one line. One function opens a
user's image for every purpose (augment/decode.py), and each case goes through every entry
point that opens images: decoding (the read task, the augment call), header sampling, the
preview and prediction. Byte-mutated files of every format are in tests/test_fuzz.py."""

from __future__ import annotations

import io
import os
import struct
import tarfile
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from augment.decode import BadImage, decode_image, read_header
from tests.conftest import write_tree
from training.forms.tree import scan_tree


def tiff_pillow_breaks_on() -> bytes:
    """A TIFF whose StripOffsets tag is typed as text (ASCII): Pillow reads its header, and raises
    TypeError while loading its pixels (the kind of file byte-mutating TIFFs turned up)."""
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="TIFF")
    data = bytearray(buf.getvalue())
    ifd = int.from_bytes(data[4:8], "little")  # Pillow writes little-endian TIFFs: II*\0, then the IFD offset
    for i in range(int.from_bytes(data[ifd : ifd + 2], "little")):
        entry = ifd + 2 + 12 * i  # tag (2 bytes), type (2), count (4), value (4)
        if int.from_bytes(data[entry : entry + 2], "little") == 273:  # StripOffsets
            data[entry + 2 : entry + 4] = (2).to_bytes(2, "little")  # ASCII
            return bytes(data)
    raise AssertionError("no StripOffsets tag")


def png_bomb() -> bytes:
    """A PNG whose header claims 20,000 x 20,000 pixels: Pillow's Image.open raises
    DecompressionBombError (over twice its MAX_IMAGE_PIXELS)."""
    buf = io.BytesIO()
    Image.new("L", (8, 8)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = (20000).to_bytes(4, "big") * 2  # IHDR's width and height
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")  # and its CRC
    return bytes(data)


BAD = {"tiff": (tiff_pillow_breaks_on, "corrupt image"), "bomb": (png_bomb, "decompression bomb")}


def _tree_with(tmp_path: Path, name: str) -> Path:
    """train/ and val/ with two classes of 32 px PNGs, and the bad file first (in path order) of
    the training class a."""
    root = tmp_path / "t"
    write_tree(root / "train", {"a": 4, "b": 4})
    write_tree(root / "val", {"a": 2, "b": 2}, seed=1)
    (root / "train" / "a" / f"-bad.{'tif' if name == 'tiff' else 'png'}").write_bytes(BAD[name][0]())
    return root


def _log():
    """A stand-in for the BadFileLog actor's handle: (handle, the rows it was sent)."""
    reported = []
    return SimpleNamespace(add=SimpleNamespace(remote=reported.extend)), reported


def _read_task(split, root, *, decode, log, relative=False) -> list:
    """The blocks of one read task of `split`'s files (training/stream/ingest.py _read_files)."""
    from training.stream import ingest

    rows = pa.table({"path": list(split.rel_paths), "label": split.labels, "key": split.keys})
    return list(ingest._read_files(rows, root=str(root), decode=decode, bad_log=log, relative_paths=relative))


# --------------------------------------------------------------------------- Pillow raising anything


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_file_pillow_breaks_on_is_a_bad_image_with_its_reason(name):
    data, reason = BAD[name][0](), BAD[name][1]
    with pytest.raises(BadImage, match=reason):
        decode_image(data)
    with pytest.raises(BadImage, match=reason):
        decode_image(data, shrink=2)
    if name == "bomb":
        with pytest.raises(BadImage, match=reason):
            read_header(data)


@pytest.mark.parametrize(
    "error", [TypeError("x"), struct.error("x"), IndexError("x"), ZeroDivisionError("x"), MemoryError(), KeyError("x")]
)
def test_any_exception_while_pillow_loads_a_file_is_a_bad_image(monkeypatch, error):
    """Whatever Pillow's loader raises on a file names the file bad, with the exception's type; an
    interrupt is not the file's fault and goes through."""
    from PIL import ImageFile

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")

    def load(self):
        raise error

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    with pytest.raises(BadImage, match=type(error).__name__):
        decode_image(buf.getvalue())
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        decode_image(buf.getvalue())


def test_a_jpeg_simplejpeg_fails_on_in_another_way_goes_to_pillow(monkeypatch):
    import simplejpeg

    buf = io.BytesIO()
    Image.new("RGB", (16, 8), (200, 10, 10)).save(buf, format="JPEG")
    monkeypatch.setattr(simplejpeg, "decode_jpeg", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
    monkeypatch.setattr(simplejpeg, "decode_jpeg_header", lambda *a, **k: (_ for _ in ()).throw(OverflowError()))
    assert decode_image(buf.getvalue()).shape == (8, 16, 3)
    assert read_header(buf.getvalue())[:2] == (8, 16)


# --------------------------------------------------------------------------- every entry point


@pytest.mark.parametrize("name", sorted(BAD))
def test_header_sampling_skips_a_bad_header(tmp_path, name):
    """--preset auto's typical size (jobs.train, jobs.preview): from the good files' headers."""
    from training.driver.inputs import typical_size

    tree = scan_tree(str(_tree_with(tmp_path, name)), 0.0)
    assert typical_size(tree.train) == (32, 32)


@pytest.mark.parametrize("name", sorted(BAD))
def test_the_read_task_and_prediction_skip_and_list_a_bad_file(tmp_path, name):
    """A read task that decodes (thumbnails; jobs.predict and jobs.evaluate read this way): the
    bad file is left out and sent to the bad-file log with its reason, the rest decoded."""

    tree = scan_tree(str(_tree_with(tmp_path, name)), 0.0)
    log, reported = _log()
    blocks = _read_task(tree.train, tree.train.root, decode=True, log=log, relative=True)
    assert sorted(p for b in blocks for p in b.column("path").to_pylist()) == sorted(
        p for p in tree.train.rel_paths if "bad" not in p
    )
    ((path, reason),) = reported
    assert path.endswith("-bad.tif" if name == "tiff" else "-bad.png") and reason.startswith(BAD[name][1])


@pytest.mark.parametrize("name", sorted(BAD))
def test_the_augment_call_skips_and_lists_a_bad_file(name):
    import torch

    from augment.batch import decode_augment
    from augment.pipeline import Pipeline
    from augment.presets import PRESETS

    good = io.BytesIO()
    Image.new("RGB", (40, 40), (10, 200, 10)).save(good, format="PNG")
    encoded = [good.getvalue(), BAD[name][0](), good.getvalue()]
    out = decode_augment(
        Pipeline(PRESETS["cifar"].train, seed=0), encoded, torch.arange(3), 0, torch.device("cpu"), shrink=True
    )
    assert out[1] == [0, 2] and [row for row, _ in out[2]] == [1] and out[2][0][1].startswith(BAD[name][1])


@pytest.mark.parametrize("name", sorted(BAD))
def test_the_preview_passes_over_a_bad_file_and_says_so(tmp_path, capsys, name):
    from jobs.preview import main

    root = _tree_with(tmp_path, name)
    out = tmp_path / "grid.png"
    assert main(["--data", str(root), "--out", str(out), "--classes", "2", "--augmentations", "1"]) == 0
    printed = capsys.readouterr().out
    assert out.exists() and "wrote " in printed and "preset 'cifar'" in printed
    assert f"skipped 1 unreadable file(s), e.g. {root}/train/a/-bad." in printed and BAD[name][1] in printed


def test_jobs_train_samples_headers_past_a_decompression_bomb(tmp_path):
    """jobs.train's checks before Ray (training.driver.inputs.prepare): the bomb is skipped for --preset
    auto's sample; training lists it later, as it lists any bad file."""
    from training.config import TrainConfig
    from training.driver.inputs import prepare

    root = _tree_with(tmp_path, "bomb")
    cfg, tree, name, _ = prepare(TrainConfig(data=str(root), storage_path=str(tmp_path / "runs"), name="r"))
    assert name == "cifar" and tree.typical_size == (32, 32)


# --------------------------------------------------------------------------- a file that cannot be read


def _unreadable_tree(tmp_path: Path) -> Path:
    """Two classes of PNGs, and in class a a file whose every read fails with EIO (a symbolic link
    to /proc/self/mem: its first page is never mapped), as a bad sector or a stale NFS handle fail."""
    root = write_tree(tmp_path / "t", {"a": 3, "b": 3})
    os.symlink("/proc/self/mem", root / "a" / "eio.png")
    with pytest.raises(OSError):
        (root / "a" / "eio.png").read_bytes()  # the control: reading it fails here
    return root


@pytest.mark.parametrize("decode", [False, True, "check"])
def test_a_file_whose_read_fails_is_a_bad_file_and_the_rest_are_read(tmp_path, decode):
    """A read task (each way: the encoded files for the augment call, decoded, --strict's check):
    the file is listed with the error and left out, the task goes on."""

    root = _unreadable_tree(tmp_path)
    tree = scan_tree(str(root), 0.0)
    log, reported = _log()
    blocks = _read_task(tree.train, root, decode=decode, log=log)
    if decode == "check":
        reported = list(zip(*(blocks[0].column(c).to_pylist() for c in ("path", "reason")), strict=True))
    else:
        assert sorted(p for b in blocks for p in b.column("path").to_pylist()) == sorted(
            f"{root}/{p}" for p in tree.train.rel_paths if "eio" not in p
        )
    assert reported == [(f"{root}/a/eio.png", "cannot read it: [Errno 5] Input/output error")]


def test_a_file_gone_from_object_storage_is_a_bad_file(s3, tmp_path):
    """A file deleted from the bucket after the listing: listed, the task's other files read (the
    read task's threaded path, for object storage)."""
    uri = s3.upload(write_tree(tmp_path / "t", {"a": 3, "b": 3}), "s3://data/bad-files/one-gone")
    tree = scan_tree(uri, 0.0)
    s3.client.delete_object(Bucket="data", Key="bad-files/one-gone/a/001.png")
    log, reported = _log()
    blocks = _read_task(tree.train, uri, decode=False, log=log)
    assert sum(b.num_rows for b in blocks) == 5
    ((path, reason),) = reported
    assert path == f"{uri}/a/001.png" and reason.startswith("cannot read it: ") and "\n" not in reason


def test_the_datas_folder_or_prefix_gone_ends_the_run_in_one_line(s3, tmp_path):
    """Not one file's fault: the read task raises DataGone, which names the folder; the driver
    stops the run on it at once (training/driver/job.py worker_error), with that one line."""
    import shutil

    from training.driver.job import worker_error
    from training.stream.gone import DataGone

    root = write_tree(tmp_path / "t", {"a": 3, "b": 3})
    uri = s3.upload(root, "s3://data/bad-files/all-gone")
    for where in (str(root), uri):
        tree = scan_tree(where, 0.0)
        if where == uri:
            for p in tree.train.rel_paths:
                s3.client.delete_object(Bucket="data", Key=f"bad-files/all-gone/{p}")
        else:
            shutil.rmtree(root)
        with pytest.raises(DataGone) as gone:
            _read_task(tree.train, where, decode=False, log=_log()[0])
        line = str(gone.value)
        assert line.startswith(f"{where}: ") and "\n" not in line and "rerun" in line, line
        # as a train worker's failure arrives: Ray's task error, whose text holds the read task's
        text = f"ray::ReadImages()\n  File x\n{DataGone.__module__}.DataGone: {line}\n\nThe above exception ..."
        failure = RuntimeError(text)
        assert worker_error(SimpleNamespace(worker_failures={0: failure}), own_only=True) == line


def test_ray_datas_console_filter_drops_the_records_of_a_data_gone_and_nothing_else():
    """training/ray_data_logging.yaml's filter on Ray Data's console: the task's traceback and the
    notice Ray Data logs while handling it (without exc_info: the error being handled) go; any
    other record stays."""
    import logging

    from training.stream.gone import QuietDataGone

    def record(message, error=None):
        exc_info = (type(error), error, None) if error else None
        return logging.LogRecord("ray.data", logging.ERROR, __file__, 1, message, None, exc_info)

    quiet, gone = (
        QuietDataGone(),
        RuntimeError("ray::ReadImages()\ntraining.stream.gone.DataGone: /d: no such directory"),
    )
    assert not quiet.filter(record("An exception was raised from a task of operator", gone))
    try:
        raise gone
    except RuntimeError:
        assert not quiet.filter(record("Exception occurred in Ray Data or Ray Core internal code."))
        assert quiet.filter(record("An exception was raised from a task of operator", RuntimeError("other")))
    assert quiet.filter(record("a warning"))


# --------------------------------------------------------------------------- WebDataset: a broken member header


def _jpeg(i: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), i * 20 % 256, np.uint8)).save(out, format="JPEG")
    return out.getvalue()


def _shard(path: Path, n: int = 12, *, first: int = 0) -> list[tuple[str, bytes]]:
    """A WebDataset shard of n samples (<key>.jpg, then <key>.cls); [(key, jpeg)]."""
    samples = [(f"{'ab'[i % 2]}/img{first + i:04d}", _jpeg(first + i)) for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, data in samples:
            for name, body in ((f"{key}.jpg", data), (f"{key}.cls", str(int(key[0] == "b")).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return samples


def _header_offset(path: Path, name: str) -> int:
    with tarfile.open(path) as tar:
        return tar.getmember(name).offset


@pytest.mark.parametrize("damage", ["checksum", "zeroed"])
def test_a_broken_member_header_mid_shard_costs_its_sample_only(tmp_path, damage):
    """The 6th sample's image header is broken (a byte of its mode field changed, so its checksum
    fails; or the whole 512-byte block zeroed): the scan goes on at the next valid header,
    lists the sample with the shard and the byte offset, and every sample after it is read
    back by the read task. (Before, the 7 samples from there on were dropped without a word.)"""
    from training.driver.audit import coverage
    from training.forms.formats import scan_data
    from training.forms.webdataset import read_tar_units
    from training.records import KEY_MOD, ShardRecord

    shard = tmp_path / "s" / "0000.tar"
    samples = _shard(shard)
    offset = _header_offset(shard, f"{samples[5][0]}.jpg")
    data = bytearray(shard.read_bytes())
    if damage == "checksum":
        data[offset + 101] ^= 0x01  # the mode field: the name stays readable
    else:
        data[offset : offset + 512] = bytes(512)
    shard.write_bytes(bytes(data))
    tree = scan_data(str(tmp_path / "s"), val_fraction=0.0)
    kept = samples[:5] + samples[6:]
    assert [p.rsplit("/", 1)[-1] for p in tree.train.rel_paths] == [f"{k.split('/')[1]}.jpg" for k, _ in kept]
    ((path, reason),) = tree.unreadable
    assert path == f"{tmp_path}/s/0000.tar/{samples[5][0]}", path
    assert reason.startswith("no image member") and f"broken tar header at byte {offset}" in reason, reason
    table = read_tar_units(tree.train.units, tree.train.root, tree.train.shards, tree.train.form)
    assert table.column("bytes").to_pylist() == [d for _, d in kept]
    assert table.column("key").to_pylist() == tree.train.keys.tolist()
    # the epoch's coverage: every sample read once, and the one lost counted
    keys = tree.train.keys
    seen = [[ShardRecord(len(keys), len(keys), int((keys % KEY_MOD).sum() % KEY_MOD), views=0, rng="")]]
    (cov,) = coverage(seen, tree, dict(tree.unreadable))
    assert (cov["expected"], cov["lost"], cov["as_expected"]) == (11, 1, True), cov
    bad = dict(tree.unreadable) | {f"{tree.train.root}/{tree.train.rel_paths[0]}": "corrupt image"}
    assert coverage(seen, tree, bad)[0]["lost"] == 2  # and a sample that does not decode


def test_a_sample_whose_every_header_broke_is_listed_by_the_key_its_header_still_names(tmp_path):
    from training.forms.formats import scan_data

    shard = tmp_path / "s" / "0000.tar"
    samples = _shard(shard, 6)
    data = bytearray(shard.read_bytes())
    key = samples[2][0]
    offsets = [_header_offset(shard, f"{key}.{ext}") for ext in ("jpg", "cls")]
    for offset in offsets:
        data[offset + 101] ^= 0x01
    shard.write_bytes(bytes(data))
    tree = scan_data(str(tmp_path / "s"), val_fraction=0.0)
    assert len(tree.train) == 5
    ((path, reason),) = tree.unreadable
    assert path == f"{tmp_path}/s/0000.tar/{key}" and f"broken tar header at byte {offsets[0]}" in reason
    assert tree.lost_train == 1


def test_a_shard_cut_off_mid_member_keeps_the_samples_before_the_cut(tmp_path):
    from training.forms.formats import scan_data
    from training.forms.webdataset import read_tar_units

    shard = tmp_path / "s" / "0000.tar"
    samples = _shard(shard, 6)
    cut = _header_offset(shard, f"{samples[4][0]}.jpg") + 700  # inside the 5th sample's image
    shard.write_bytes(shard.read_bytes()[:cut])
    tree = scan_data(str(tmp_path / "s"), val_fraction=0.0)
    assert len(tree.train) == 4 and tree.lost_train == 1
    ((path, reason),) = tree.unreadable
    assert path.endswith(f"0000.tar/{samples[4][0]}") and "cut off" in reason, (path, reason)
    table = read_tar_units(tree.train.units, tree.train.root, tree.train.shards, tree.train.form)
    assert table.column("bytes").to_pylist() == [d for _, d in samples[:4]]


def test_shards_written_one_after_another_into_one_file_read_whole(tmp_path):
    """Two tars concatenated (cat a.tar b.tar): the end-of-archive zeros between them are no
    damage; every sample of both is read, none listed. (Before, reading stopped at the first.)"""
    from training.forms.formats import scan_data
    from training.forms.webdataset import read_tar_units

    first, second = _shard(tmp_path / "a.tar", 3), _shard(tmp_path / "b.tar", 3, first=3)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "0000.tar").write_bytes((tmp_path / "a.tar").read_bytes() + (tmp_path / "b.tar").read_bytes())
    tree = scan_data(str(tmp_path / "s"), val_fraction=0.0)
    assert len(tree.train) == 6 and tree.unreadable == ()
    table = read_tar_units(tree.train.units, tree.train.root, tree.train.shards, tree.train.form)
    assert table.column("bytes").to_pylist() == [d for _, d in first + second]


# --------------------------------------------------------------------------- a training run that meets them
# (each kind of bad file in one run: tests/test_faults.py, test_bad_files_are_listed_and_every_good_file_is_trained_on)


def test_the_data_gone_mid_run_ends_it_with_one_line(ray_cluster, tmp_path, capfd):
    """The tree removed after the scan: the first read task's DataGone stops the run at once
    (no --max-failures retries) with that one line, and the console shows none of Ray Data's
    traceback of it (training/stream/gone.py QuietDataGone); faults.log keeps the detail."""
    import shutil
    import time

    from tests.conftest import prepare
    from training.config import TrainConfig
    from training.driver import job

    root = write_tree(tmp_path / "t", {"a": 8, "b": 8})
    cfg, tree, preset = prepare(
        TrainConfig(data=str(root), epochs=1, batch_size=4, num_workers=1, storage_path=str(tmp_path), name="r")
    )
    shutil.rmtree(root)
    with pytest.raises(job.TrainingFailed) as failed:
        job.run(cfg, tree, preset, log=lambda *a: None, own_cluster=True)
    line = str(failed.value)
    assert line.startswith(f"training failed: {root}: no such directory any more; reading {root}/") and "\n" not in line
    assert "DataGone" in (tmp_path / "r" / "faults.log").read_text()
    time.sleep(2)  # the train worker's console output reaches the driver's stderr through Ray's log monitor
    err = capfd.readouterr().err
    assert "DataGone" not in err and "Traceback" not in err, err[-3000:]
