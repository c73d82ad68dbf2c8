"""Writing run-directory files to local disk or to object storage (s3://, gs://)."""

from __future__ import annotations

import csv
import io
import json
import os

from training import storage


def _fs(uri: str):
    fs, path, _ = storage.filesystem(uri)
    return fs, path


def write_bytes(uri: str, data: bytes) -> None:
    """Write a whole file, creating its directory; atomic: readers see the old file or the new one.
    An object store's upload is atomic already (a move there is a copy and a delete)."""
    fs, path = _fs(uri)
    if storage.is_uri(uri):
        with fs.open_output_stream(path) as f:
            f.write(data)
        return
    fs.create_dir(os.path.dirname(path), recursive=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


def read_bytes(uri: str) -> bytes:
    """The whole file. An input file, not a stream: on object storage a stream's read() fetches
    256 KiB per request, the file one range for all of it."""
    fs, path = _fs(uri)
    with fs.open_input_file(path) as f:
        return f.read()


def exists(uri: str) -> bool:
    import pyarrow.fs as pafs

    fs, path = _fs(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def is_dir(uri: str) -> bool:
    import pyarrow.fs as pafs

    fs, path = _fs(uri)
    return fs.get_file_info(path).type == pafs.FileType.Directory


def remove_tree(uri: str) -> None:
    fs, path = _fs(uri)
    fs.delete_dir(path)


def remove_file(uri: str) -> None:
    fs, path = _fs(uri)
    fs.delete_file(path)


def clear_dir(uri: str, keep: tuple[str, ...] = ()) -> None:
    """Remove everything inside the folder `uri` but the entries named in `keep` (its lease). A
    local link is removed as a link: nothing outside the folder is touched."""
    import pyarrow.fs as pafs

    fs, path = _fs(uri)
    if not storage.is_uri(uri):
        import shutil

        for entry in os.scandir(path):
            if entry.name in keep:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        return
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        if info.base_name in keep:
            continue
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(info.path)
        else:
            fs.delete_file(info.path)


# Written into every run directory this job creates, before anything else: `--fresh` removes only
# a directory that holds it (or the config.json of a run written before the marker existed).
RUN_MARKER = ".ray-gpu-augment-run"


def mark_run_dir(run_dir: str, name: str) -> None:
    """Claim `run_dir` as a run directory of this job (idempotent)."""
    if not exists(join(run_dir, RUN_MARKER)):
        write_json(join(run_dir, RUN_MARKER), {"job": "jobs.train", "name": name})


def is_run_dir(run_dir: str) -> bool:
    """Whether `run_dir` was written by this job as a run directory: its marker, or a config.json
    of this job's shape ({"config": {..., "name": ...}}), which older runs have without a marker."""
    if exists(join(run_dir, RUN_MARKER)):
        return True
    try:
        config = json.loads(read_bytes(join(run_dir, "config.json")))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("config"), dict) and "name" in config["config"]


def is_empty_dir(uri: str) -> bool:
    import pyarrow.fs as pafs

    fs, path = _fs(uri)
    return not fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))


def write_json(uri: str, obj) -> None:
    write_bytes(uri, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_csv(uri: str, rows: list[dict]) -> None:
    buf = io.StringIO()
    if rows:
        # every row's columns, in order of appearance: a run resumed from an older version's
        # checkpoint has rows without the columns added since (left empty there)
        writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)
    write_bytes(uri, buf.getvalue().encode())


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])
