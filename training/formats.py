"""What `--data` names, told apart by what is there (docs/guide.md, "Data formats"):

    prepared      DIR/_prepared.json                 jobs.prepare's shards (training/parquet.py)
    manifest      a .csv or .jsonl file               path,label lines (training/manifest.py)
    webdataset    a .tar, a brace pattern, or a folder with .tar files (training/webdataset.py)
    huggingface   a folder with .parquet files        a Hugging Face export (training/huggingface.py)
    tree          anything else: DIR/<class>/<img>    (training/data.py)

A folder is judged by the files a short walk from its top finds (its own, then those of a
few sub-folders, two levels down at most): images anywhere make it a tree (a stray .tar or
.parquet beside class folders does not), else .tar files shards, else .parquet files an
export. Telling a tree of a million files from a folder of shards costs a handful of
listings, not a listing of everything.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from training import storage
from training.data import IMAGE_EXTENSIONS, list_images, on_side
from training.huggingface import read_export_units
from training.manifest import is_manifest
from training.parquet import is_prepared, read_prepared_units
from training.webdataset import is_shard_pattern, read_tar_units, shard_names

WALK_DEPTH, WALK_WIDTH = 2, 4  # folder levels below the top, sub-folders looked into per folder
READERS = {"prepared": read_prepared_units, "huggingface": read_export_units, "webdataset": read_tar_units}


def read_units(units, root: str, shards, form, bad: list | None = None):
    """The rows of a sharded split's `units` as an Arrow table {bytes, path (below root), label, key}.
    What cannot be read of them (a shard gone, a row group or a run of tar members that does not
    parse) goes to `bad` as (path, reason), with the rows it held; without `bad`, it raises."""
    return READERS[form.kind](units, root, shards, form, bad)


def data_kind(root: str) -> tuple[str, list[str] | None]:
    """(kind, for a Hugging Face export its .parquet files relative to `root`)."""
    if is_shard_pattern(root):  # a URI with braces is none to pyarrow: its folder is
        storage.check_bucket(shard_names(root)[0])
        return "webdataset", None
    storage.check_bucket(root)  # the first request to --data: bad credentials are named here
    if is_manifest(root):
        return "manifest", None
    if is_prepared(root):
        return "prepared", None
    fs, base, _ = storage.filesystem(root)
    with storage.errors(root):
        kind = _walk(fs, base)
        if kind != "parquet":
            return kind, None
        return "huggingface", _parquet_files(fs, base)


def _walk(fs, base: str) -> str:
    import pyarrow.fs as pafs

    level, found = [base], set()
    for _ in range(WALK_DEPTH + 1):
        below = []
        for folder in level:
            infos = fs.get_file_info(pafs.FileSelector(folder, recursive=False, allow_not_found=True))
            shown = [i for i in infos if not PurePosixPath(i.path).name.startswith(".")]
            found |= {PurePosixPath(i.path).suffix.lower() for i in shown if i.type == pafs.FileType.File}
            if found & set(IMAGE_EXTENSIONS):  # images win: a stray archive beside class folders stays a tree
                return "tree"
            below += sorted(i.path for i in shown if i.type == pafs.FileType.Directory)[:WALK_WIDTH]
        level = below
    return "webdataset" if ".tar" in found else "parquet" if ".parquet" in found else "tree"


def _parquet_files(fs, base: str) -> list[str]:
    return [str(PurePosixPath(p).relative_to(base)) for p, _ in list_images(fs, base, (".parquet",))]


def shard_examples(split, *, classes: int, per_class: int, skipped: list | None = None) -> tuple[list, list, list]:
    """augment.preview.read_examples for a sharded split: the first `per_class` images of each of
    the first `classes` labels, in the order of its units, decoded; what fails to read or decode
    is passed over, and added to `skipped` as (path, reason)."""
    from augment.decode import BadImage, decode_image

    chosen: dict[int, list] = {}
    skipped = [] if skipped is None else skipped
    for unit in split.units:
        table = read_units(unit[None], split.root, split.shards, split.form, skipped)
        columns = (table.column(c).to_pylist() for c in ("bytes", "label", "key", "path"))
        for data, label, key, path in zip(*columns, strict=True):
            if on_side(key, split.side) and label < classes and len(chosen.setdefault(label, [])) < per_class:
                try:
                    chosen[label].append((decode_image(data), label, key))
                except BadImage as e:
                    skipped.append((f"{split.root}/{path}", str(e)))
        if len(chosen) == classes and all(len(v) == per_class for v in chosen.values()):
            break
    picks = [p for label in sorted(chosen) for p in chosen[label]]
    return [p[0] for p in picks], [p[1] for p in picks], [p[2] for p in picks]
