"""Local paths and object storage URIs (s3://, gs://) behind one interface: the pyarrow
filesystem for a path, access checks, and object storage's errors turned into one line that
names the problem and the fix (the entry points exit 2 with it, before training); and the run
directory's files, written and read the same way wherever the run lives (the run marker, --fresh's
clearing, JSON and CSV).

pyarrow's S3 client (the AWS SDK) finds the endpoint and the credentials as every AWS tool
does, so the job's flags carry only URIs: AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) names an
S3-compatible server such as MinIO; the credentials come from AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, from AWS_PROFILE and ~/.aws/credentials, or from the machine's role
(docs/guide.md, "Object storage"). Ray Train (checkpoints) and Ray Data (reads) use the same
client in every process, so each node needs the same settings.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import io
import json
import os
import re
import shutil
import socket
import stat
import tempfile

# (substrings of the SDK's error, what they mean). The AWS SDK names errors in upper case
# (ACCESS_DENIED), S3-compatible servers and GCS in their own words; the first match wins.
_CAUSES = (
    (("INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId"), "credentials"),
    (("SIGNATURE_DOES_NOT_MATCH", "SignatureDoesNotMatch"), "credentials"),
    (("EXPIRED_TOKEN", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"), "credentials"),
    (("NO_SUCH_BUCKET", "NoSuchBucket", "The specified bucket does not exist"), "bucket"),
    (("ACCESS_DENIED", "AccessDenied", "Forbidden"), "denied"),
    (("NETWORK_CONNECTION", "curlCode", "Could not connect", "Could not resolve"), "network"),
)
_PROBE = ".ray-gpu-augment-access-check"  # a key nobody writes: listing it costs one request


class StorageError(ValueError):
    """Object storage refused or cannot find what a path names; the message says how to fix it."""


def is_uri(path: str) -> bool:
    return "://" in path


def local_path(path: str) -> str:
    """A file:// URI as the local path it names (file:///data/x and file://localhost/data/x:
    /data/x), anything else as it is (file://host/x, another machine's, is refused as a URI).
    Ray and pyarrow take both, but this job writes a local path through the OS (folders made as
    needed) and a URI as an object store; the entry points hand every path through here."""
    if path[:7].lower() != "file://":
        return path
    rest = path[len("file://") :]
    if rest[:10].lower() == "localhost/":  # RFC 8089: this machine, named
        return rest[len("localhost") :]
    return rest if rest.startswith("/") else path  # file://host/x names another machine: refused as a URI


def filesystem(path: str):
    """(pyarrow filesystem, the path inside it, the prefix that turns such a path back into a URI)."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    if not is_uri(path):
        local = os.path.abspath(os.path.expanduser(path))
        if shown_name(local) != local:  # pyarrow's local filesystem neither lists nor opens it
            raise StorageError(
                f"{shown_name(path)}: a path that is not UTF-8 text; rename that folder or file, or make a link to it "
                "with a UTF-8 name (ln -s) and give that"
            )
        return pafs.LocalFileSystem(), local, ""
    try:
        with errors(path):  # resolving an AWS bucket's region is already a request
            fs, inner = pafs.FileSystem.from_uri(path)
    except pa.ArrowInvalid as e:  # a scheme pyarrow does not know, no bucket
        raise StorageError(f"{path}: {e}; give a local path, s3://bucket/prefix or gs://bucket/prefix") from None
    if not inner.strip("/") and not isinstance(fs, pafs.LocalFileSystem):
        raise StorageError(f"{path}: no bucket in the URI; give s3://bucket/prefix or gs://bucket/prefix")
    return fs, inner.rstrip("/"), path.split("://", 1)[0] + "://"


def decode_text(raw: bytes) -> str:
    """A text file's bytes as text: UTF-8 (a byte order mark allowed), or UTF-16 with its byte order
    mark (Excel's "Unicode text"). ValueError naming the first byte that is not, for anything else:
    Latin-1, Windows-1252 and the other one-byte encodings read the same bytes as different letters
    and nothing in the file says which, so a guess could name files and classes wrong without a word."""
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return raw.decode("utf-16")
        except UnicodeDecodeError:
            raise ValueError("not UTF-16 text, though it starts with UTF-16's byte order mark") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line})") from None


_ESCAPE = re.compile(r"\\x([89a-fA-F][0-9a-fA-F])")  # shown_name's escape of one byte (never one below 0x80)


def shown_name(path: str) -> str:
    """A local path as text that every file, table and message can hold: where a name on disk is not
    UTF-8 (os.fsdecode keeps each such byte as a lone surrogate, which Arrow, CSV and JSON writers
    refuse), each such byte as \\xNN (Latin-1 "café" -> "caf\\xe9"); any other path as it is."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return path


def disk_path(path: str) -> str:
    """The local path that a shown_name names, for open() and os calls: `path` itself where it has no
    \\xNN or exists as written, else with those escapes turned back into the bytes they stand for."""
    if "\\x" not in path or os.path.lexists(path):
        return path
    return _ESCAPE.sub(lambda m: chr(0xDC00 + int(m.group(1), 16)), path)  # os.fsdecode's surrogate of the byte


def read_file(fs, path: str, limit: int = -1) -> bytes:
    """The bytes of the file at `path` inside `fs` (storage.filesystem's), up to `limit` of them (-1:
    all); a local one through its disk_path, which pyarrow's local filesystem cannot open."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):
        with open(disk_path(path), "rb") as f:
            return f.read(limit)
    with fs.open_input_file(path) as f:
        return f.read() if limit < 0 else f.read(limit)


def parent(path: str) -> str:
    """The directory holding `path` (a URI stays a URI)."""
    if is_uri(path):
        return path.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(os.path.expanduser(path)))


def endpoint(path: str) -> str:
    """Where requests for `path` go, as a user would recognise it in a message."""
    scheme = path.split("://", 1)[0]
    if scheme == "s3":
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
    return {"gs": "Google Cloud Storage", "gcs": "Google Cloud Storage"}.get(scheme, scheme)


def explain(path: str, err: OSError, action: str = "reading") -> str:
    """One line for an error of object storage: what went wrong at which server, and the fix."""
    text = str(err)
    cause = next((c for keys, c in _CAUSES if any(k in text for k in keys)), None)
    where = endpoint(path)
    bucket = path.split("://", 1)[-1].split("/", 1)[0]
    s3 = path.startswith("s3://")
    if cause == "credentials":
        code = next(k for keys, c in _CAUSES if c == cause for k in keys if k in text)
        fix = (
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with ~/.aws/credentials, to a key "
            "that server accepts"
            if s3
            else "check the credentials (GOOGLE_APPLICATION_CREDENTIALS for gs://)"
        )
        return f"{path}: {where} rejected the credentials ({code}); {fix}"
    if cause == "bucket":
        return f"{path}: bucket {bucket!r} does not exist at {where}; create it or correct the name" + (
            " (for MinIO or another S3-compatible server, set AWS_ENDPOINT_URL)" if where == "AWS S3" else ""
        )
    if cause == "denied":
        writing = "s3:PutObject, s3:GetObject and s3:DeleteObject"  # pyarrow's delete reads the object first
        need = {"reading": "s3:ListBucket and s3:GetObject", "writing": writing}[action]
        need = need if s3 else f"permission for {action}"
        return f"{path}: access denied at {where} when {action}; the credentials need {need} there"
    if cause == "network":
        return f"{path}: cannot reach {where} ({_first_line(text)}); check AWS_ENDPOINT_URL and the network"
    return f"{path}: {where} failed when {action}: {_first_line(text)}"


def first_line(error: BaseException) -> str:
    """An error's first line, for a bad-file reason (pyarrow's run to several lines), or its type
    where it says nothing."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _first_line(text: str) -> str:
    """The SDK's own words, without the request it was making ("When listing ... operation: ")."""
    text = text.strip().rsplit("Details: ", 1)[-1]
    return text.splitlines()[0][:300] if text else "no details"


@contextlib.contextmanager
def errors(path: str, action: str = "reading"):
    """Turns an OSError from object storage inside the block into a StorageError with one
    line from `explain`. Local paths keep their own errors (their messages are clear)."""
    try:
        yield
    except StorageError:
        raise
    except OSError as e:
        if not is_uri(path):
            raise
        raise StorageError(explain(path, e, action)) from None


def check_bucket(path: str) -> None:
    """StorageError unless the credentials work and the bucket of `path` exists; nothing for
    a local path. One request, a listing of a key nobody writes, under `path` itself (a policy
    may allow listing only there): it names bad credentials and a missing bucket (an object's
    HEAD request answers both with a bare 403 or 404)."""
    import pyarrow.fs as pafs

    if not is_uri(path):
        return
    fs, inner, _ = filesystem(path)
    with errors(path):
        try:
            fs.get_file_info(pafs.FileSelector(f"{inner.rstrip('/')}/{_PROBE}"))
        except OSError as e:  # the bucket is there, the key is not: as expected
            # pyarrow's S3 raises FileNotFoundError; its GCS a bare OSError with the same words
            if not isinstance(e, FileNotFoundError) and "No such file or directory" not in str(e):
                raise


def check_writable(path: str, flag: str) -> None:
    """StorageError unless a file can be written and deleted in directory `path`; `flag`
    names the setting in the message. Run before work that would otherwise be lost when the
    first write fails. It leaves nothing behind: a local directory it had to create for the
    probe is removed again, so a run that stops at a later check has written nothing."""
    probe = f"{_PROBE}-{os.getpid()}"
    if not is_uri(path) and shown_name(path) != path:  # every file written there would fail in pyarrow
        raise StorageError(
            f"{flag} {shown_name(path)}: a path that is not UTF-8 text; choose a folder whose name is UTF-8"
        )
    if not is_uri(path):
        created = missing_dirs(path)
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, probe), "wb"):
                pass
            os.remove(os.path.join(path, probe))
        except OSError as e:
            raise StorageError(
                f"{flag} {path}: cannot write there ({e.strerror or e}); choose a writable path"
            ) from None
        finally:
            for d in created:  # deepest first; one that is not empty (someone else wrote there) stays
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        return
    try:
        check_bucket(path)
        fs, inner, _ = filesystem(path)
        with errors(path, "writing"):
            with fs.open_output_stream(f"{inner}/{probe}") as f:
                f.write(b"")
            fs.delete_file(f"{inner}/{probe}")
    except StorageError as e:
        raise StorageError(f"{flag} {e}") from None


def missing_dirs(path: str) -> list[str]:
    """The local directory `path` and those of its parents that do not exist yet, deepest first."""
    out, d = [], os.path.abspath(path)
    while not os.path.exists(d) and os.path.dirname(d) != d:
        out.append(d)
        d = os.path.dirname(d)
    return out


# ----------------------------------------------------------------- the run directory's files
def _fs(uri: str):
    fs, path, _ = filesystem(uri)
    return fs, path


def write_bytes(uri: str, data: bytes) -> None:
    """Write a whole file, creating its directory; atomic: readers see the old file or the new one.
    An object store's upload is atomic already (a move there is a copy and a delete)."""
    fs, path = _fs(uri)
    if is_uri(uri):
        with fs.open_output_stream(path) as f:
            f.write(data)
        return
    fs.create_dir(os.path.dirname(path), recursive=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        fs.move(tmp, path)
    except BaseException:  # a full disk, Ctrl-C: no half-written file of ours beside the user's
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
    if not is_uri(uri):
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
# a directory that holds it.
RUN_MARKER = ".ray-gpu-augment-run"


def mark_run_dir(run_dir: str, name: str) -> None:
    """Claim `run_dir` as a run directory of this job (idempotent)."""
    if not exists(join(run_dir, RUN_MARKER)):
        write_json(join(run_dir, RUN_MARKER), {"job": "jobs.train", "name": name})


def is_run_dir(run_dir: str) -> bool:
    """Whether `run_dir` was written by this job as a run directory: it holds the marker."""
    return exists(join(run_dir, RUN_MARKER))


def is_earlier_run_dir(run_dir: str) -> bool:
    """Whether `run_dir` looks like a run directory of an earlier version of this job, written
    before the marker: a config.json of this job's shape ({"config": {..., "name": ...}}) and no
    marker. Such a folder is refused with its own line, never resumed or removed."""
    if is_run_dir(run_dir):
        return False
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
        # every row's columns, in order of appearance: a row may lack one (left empty there)
        writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)
    write_bytes(uri, buf.getvalue().encode())


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


STAGING = "ray-gpu-augment-staging"  # the machine temp folder's subfolder where files wait for the run's storage


@contextlib.contextmanager
def staging_dir():
    """A local folder, removed afterwards, for files on their way to the run's storage (a checkpoint
    Ray Train copies from it, TensorBoard events). A process killed inside one (Ray ends a stopped
    run's workers) cannot remove it: each new one first removes the folders of processes gone, so a
    stopped run's checkpoint does not stay behind in the machine's temp folder."""
    root, host = os.path.join(tempfile.gettempdir(), f"{STAGING}-{os.getuid()}"), socket.gethostname()
    if _own_folder(root):  # not a link, a file or another user's folder of that name in a shared /tmp
        for entry in os.listdir(root):  # PID@HOST-RANDOM; another host's (a container sharing /tmp) stays
            pid, _, rest = entry.partition("@")
            if pid.isdigit() and rest.rsplit("-", 1)[0] == host and not pid_alive(int(pid)):
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    else:
        root = None  # the temp folder itself, as tempfile would
    folder = tempfile.mkdtemp(prefix=f"{os.getpid()}@{host}-", dir=root)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _own_folder(path: str) -> bool:
    """Whether `path` is a folder of this user's, made now if missing."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def pid_alive(pid: int) -> bool:
    """Whether a process of this machine has the pid (a pid reused since is taken as alive: the safe side)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
