"""One owner for a run folder: a live jobs.train holds a lease on STORAGE_PATH/NAME for its whole
life, so a second run with the same name (a colleague's, a retried `ray job submit`, a second
terminal), `--fresh` included, stops before Ray with one line naming the owner. A live jobs.tune
holds one on its sweep's folder the same way (each trial's run holds its own, in its folder).

- A local or shared disk (NFS): an exclusive `flock` on `NAME/.lease`, which the kernel drops when
  the owner's process ends, however it ends (`kill -9` too). The file says who holds it.
- Object storage: the `.lease` object, created only where none exists (S3's conditional write,
  `If-None-Match: *`) and rewritten every HEARTBEAT_S by the owner (`If-Match` its last version).
  A lease the store has not seen rewritten for TTL_S (by the store's own clock, so no two
  machines' clocks are compared), or one of a process on this host that is gone, is taken over
  with one line. gs://: the same object without a conditional write (pyarrow has none): two
  starts within the same second could both take it.

`acquire` is re-entrant within one process (the tests prepare the same run more than once) and
`release` drops the lease (the process's exit drops it too). `--fresh` clears the folder but its
lease (training/storage.py clear_dir).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import email.utils
import fcntl
import getpass
import json
import os
import socket
import sys
import threading

from training import storage
from training.config import ConfigError

LEASE_FILE = ".lease"
HEARTBEAT_S = 15.0  # how often an owner on object storage rewrites its lease
TTL_S = 60.0  # a lease on object storage not rewritten for this long has lost its owner


class LeaseHeld(ConfigError):
    """Another live run owns the run folder (exit 2, before Ray)."""


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who holds a lease, as written into it."""

    host: str
    pid: int
    user: str
    since: str  # UTC, ISO 8601
    command: str
    job: str = "jobs.train"  # what holds it: a run (jobs.train) or a sweep (jobs.tune)

    @classmethod
    def me(cls, job: str = "jobs.train") -> "Owner":
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return cls(socket.gethostname(), os.getpid(), _user(), now, " ".join(sys.argv)[:300], job)

    @classmethod
    def parse(cls, raw: bytes) -> "Owner | None":
        try:
            d = json.loads(raw)
            fields = (str(d["host"]), int(d["pid"]), str(d["user"]), str(d["since"]), str(d.get("command", "")))
            return cls(*fields, str(d.get("job", "jobs.train")))
        except (ValueError, KeyError, TypeError):
            return None

    def to_bytes(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self), sort_keys=True) + "\n").encode()

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} (user {self.user}, since {self.since})"

    def gone(self) -> bool:
        """This host's process that is no more (a pid reused since is taken as alive: the safe side)."""
        return self.host == socket.gethostname() and not storage.pid_alive(self.pid)


_HELD: dict[str, "RunLease"] = {}  # run folder -> this process's lease on it
_LOCK = threading.Lock()


def held_message(run_dir: str, name: str, owner: Owner | None) -> str:
    who = owner.describe() if owner else "another process"
    job = owner.job if owner else "jobs.train"
    return (
        f"--name {name}: {run_dir} is in use by a running {job} ({who}); wait for it to end or stop it, "
        "or give another --name"
    )


class RunLease:
    """This process's lease on one run folder; `took_over`: the owner it replaced, who was gone."""

    def __init__(self, run_dir: str, name: str, job: str = "jobs.train"):
        self.run_dir, self.name, self.job, self.took_over = run_dir, name, job, None
        self.created = not storage.exists(run_dir)
        self._fd: int | None = None
        self._store: _ObjectLease | None = None

    def _acquire(self) -> None:
        if storage.is_uri(self.run_dir):
            self._store = _ObjectLease(self.run_dir, self.name, self.job)
            self.took_over = self._store.acquire()
        else:
            self._fd, self.took_over = _lock_local(self.run_dir, self.name, self.job)
        storage.mark_run_dir(self.run_dir, self.name)  # --fresh removes only a folder that holds it

    def release(self) -> None:
        """Drop the lease and delete its file; a folder this lease created and nothing else wrote to
        goes too (a run that stopped before it wrote anything leaves nothing)."""
        with _LOCK:
            if _HELD.get(self.run_dir) is self:
                del _HELD[self.run_dir]
        path = storage.join(self.run_dir, LEASE_FILE)
        with contextlib.suppress(OSError, storage.StorageError):
            if self._store is not None:
                self._store.release()
            elif self._fd is not None:
                os.remove(path)  # while still locked: a waiter re-checks the file it locked (_lock_local)
            if self.created and _only_marker(self.run_dir):
                storage.remove_tree(self.run_dir)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def acquire(run_dir: str, name: str, log=print, job: str = "jobs.train") -> RunLease:
    """This process's lease on `run_dir` (the one it holds already, if any); LeaseHeld naming the
    owner where another live process holds it. Says in one line when it takes over a lease whose
    owner is gone. `job`: what the lease says holds the folder (a sweep's is jobs.tune)."""
    with _LOCK:
        lease = _HELD.get(run_dir)
        if lease is not None:
            return lease
        lease = RunLease(run_dir, name, job)
        with storage.errors(run_dir, "writing"):
            lease._acquire()
        _HELD[run_dir] = lease
    if lease.took_over:
        log(f"note: {run_dir}: took over the lease of {lease.took_over.describe()}, which is gone")
    return lease


def check_free(run_dir: str, name: str) -> None:
    """LeaseHeld where another live process owns `run_dir`; writes nothing (the checks before a
    run do not), so a run that a later check stops leaves the folder as it was."""
    if run_dir in _HELD:
        return
    if storage.is_uri(run_dir):
        with storage.errors(run_dir, "reading"):
            _ObjectLease(run_dir, name).check_free()
        return
    try:
        fd = os.open(os.path.join(run_dir, LEASE_FILE), os.O_RDONLY)
    except OSError:  # no lease file: nobody holds it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LeaseHeld(held_message(run_dir, name, Owner.parse(os.pread(fd, 4096, 0)))) from None
    finally:
        os.close(fd)


def release(run_dir: str) -> None:
    """Release this process's lease on `run_dir`, if it holds one."""
    lease = _HELD.get(run_dir)
    if lease is not None:
        lease.release()


@atexit.register
def _release_all() -> None:
    for lease in list(_HELD.values()):
        lease.release()


def _only_marker(run_dir: str) -> bool:
    import pyarrow.fs as pafs

    fs, path, _ = storage.filesystem(run_dir)
    names = {info.base_name for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))}
    return names <= {storage.RUN_MARKER}


def _lock_local(run_dir: str, name: str, job: str) -> tuple[int, Owner | None]:
    """(the locked lease file's descriptor, the gone owner it names); LeaseHeld where it is locked."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LEASE_FILE)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = Owner.parse(os.pread(fd, 4096, 0))
            os.close(fd)
            raise LeaseHeld(held_message(run_dir, name, owner)) from None
        try:  # the owner may have released (and deleted) it between our open and our lock: lock the new one
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    before = Owner.parse(os.pread(fd, 4096, 0))  # a file left by an owner that died holding it
    os.ftruncate(fd, 0)
    os.pwrite(fd, Owner.me(job).to_bytes(), 0)
    os.fsync(fd)
    return fd, before


class _ObjectLease:
    """The lease object on s3:// (conditional writes through boto3) or gs:// (pyarrow, unconditional)."""

    def __init__(self, run_dir: str, name: str, job: str = "jobs.train"):
        self.run_dir, self.name, self.job = run_dir, name, job
        self.uri = storage.join(run_dir, LEASE_FILE)
        self.scheme, rest = self.uri.split("://", 1)
        self.bucket, self.key = rest.split("/", 1)
        self.etag: str | None = None
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> Owner | None:
        took_over = self._put_s3() if self.scheme == "s3" else self._put_gs()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="run-lease")
        self._beat.start()
        return took_over

    def check_free(self) -> None:
        if self.scheme == "s3":
            from botocore.exceptions import ClientError

            try:
                got = _s3().get_object(Bucket=self.bucket, Key=self.key)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return
                raise OSError(str(e)) from None
            owner = Owner.parse(got["Body"].read())
            if not (owner is None or owner.gone() or _age_s(got) > TTL_S):
                raise LeaseHeld(held_message(self.run_dir, self.name, owner))
        else:
            self._judge_gs()

    def release(self) -> None:
        self._stop.set()
        if self.scheme == "s3":
            with contextlib.suppress(Exception):
                _s3().delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)
        else:
            fs, path, _ = storage.filesystem(self.uri)
            fs.delete_file(path)

    # -- s3: conditional writes
    def _put_s3(self) -> Owner | None:
        from botocore.exceptions import ClientError

        client, body = _s3(), Owner.me(self.job).to_bytes()
        try:
            self.etag = client.put_object(Bucket=self.bucket, Key=self.key, Body=body, IfNoneMatch="*")["ETag"]
            return None
        except ClientError as e:
            if not _precondition(e):
                raise OSError(str(e)) from None
        got = client.get_object(Bucket=self.bucket, Key=self.key)
        owner = Owner.parse(got["Body"].read())
        if not (owner is None or owner.gone() or _age_s(got) > TTL_S):
            raise LeaseHeld(held_message(self.run_dir, self.name, owner))
        try:  # only the version we judged gone: two takers cannot both win
            self.etag = client.put_object(Bucket=self.bucket, Key=self.key, Body=body, IfMatch=got["ETag"])["ETag"]
        except ClientError as e:
            if _precondition(e):
                raise LeaseHeld(held_message(self.run_dir, self.name, None)) from None
            raise OSError(str(e)) from None
        return owner or Owner("?", 0, "?", "?", "")

    # -- gs: no conditional write through pyarrow
    def _put_gs(self) -> Owner | None:
        found, owner = self._judge_gs()
        storage.write_bytes(self.uri, Owner.me(self.job).to_bytes())
        return (owner or Owner("?", 0, "?", "?", "")) if found else None

    def _judge_gs(self) -> tuple[bool, Owner | None]:
        """(whether a lease is there, its owner); LeaseHeld where that owner is alive."""
        import pyarrow.fs as pafs

        fs, path, _ = storage.filesystem(self.uri)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            return False, None
        with fs.open_input_file(path) as f:
            owner = Owner.parse(f.read())
        age = (datetime.datetime.now(datetime.timezone.utc) - info.mtime).total_seconds() if info.mtime else TTL_S
        if not (owner is None or owner.gone() or age >= TTL_S):
            raise LeaseHeld(held_message(self.run_dir, self.name, owner))
        return True, owner

    def _heartbeat(self) -> None:
        """Rewrite the lease every HEARTBEAT_S; where another process has taken it (this one was
        judged gone: a stall longer than TTL_S), say so once and stop beating."""
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self.scheme == "s3":
                    body = Owner.me(self.job).to_bytes()
                    self.etag = _s3().put_object(Bucket=self.bucket, Key=self.key, Body=body, IfMatch=self.etag)["ETag"]
                else:
                    storage.write_bytes(self.uri, Owner.me(self.job).to_bytes())
            except Exception as e:  # a lost lease or an unreachable store: never the training's end
                if getattr(e, "response", {}).get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                    print(f"warning: {self.run_dir}: another run took over this run's lease", file=sys.stderr)
                    self.lost.set()
                    return


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no such user in a container's passwd
        return str(os.getuid())


def _s3():
    import boto3

    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return boto3.client("s3", region_name=region)


def _precondition(error) -> bool:
    return error.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412") or (
        error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
    )


def _age_s(got: dict) -> float:
    """How long ago the store last saw the lease written, by the store's clock (its Date header)."""
    date = got.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    now = email.utils.parsedate_to_datetime(date) if date else datetime.datetime.now(datetime.timezone.utc)
    return (now - got["LastModified"]).total_seconds()
