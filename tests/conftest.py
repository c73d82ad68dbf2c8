"""Shared fixtures: one Ray cluster for the whole test session, tiny real image trees."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from PIL import Image


def interpreter_wanted(cuda_available: bool) -> bool:
    """Triton's interpreter runs the kernels on the CPU (augment/fused.py's tests) only where torch
    sees no CUDA device: where one is present, the kernels compile for it (an interpreted kernel
    would read device pointers on the host). /proc/driver/nvidia/gpus is no test: some GPU
    machines lack it."""
    return not cuda_available


# Triton reads the variable when it is imported, which torchvision and Kornia do: set it first
# (torch alone does not import Triton).
if interpreter_wanted(torch.cuda.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests' Ray clusters, and those of the jobs they start as subprocesses, collect no usage
# statistics: otherwise Ray Data starts its usage-collection actor (one more process that imports
# Ray, in every cluster's first run, on the way to its first batch) and polls Prometheus from the
# process that runs each execution (docs/benchmark-log.md, "Ray Train's start-up, part by part")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Ray's raylet warns on every console of a cluster whose disk is over 95% full (its
# file_system_monitor), which the tests' console checks would take for the job's own words. The
# suite's verdict should not depend on how full a shared CI disk is: the tests' clusters, and
# their subprocesses', warn only past 99%. pyproject.toml's tmp_path_retention_policy keeps the
# suite's own share of the disk to the tests that failed.
os.environ["RAY_local_fs_capacity_threshold"] = "0.99"

# A Ray node ends a worker process that has been idle for 1 s once it runs more workers than it has
# CPUs, which the tests' small nodes, holding a run's actors, always do: every Ray Data execution a
# test starts after a pause then waits for fresh processes to import torch again, many times the
# execution's own time (docs/benchmark-log.md, "The suite on a clean clone"). The tests' clusters
# keep idle workers for a minute.
os.environ.setdefault("RAY_idle_worker_killing_time_threshold_ms", "60000")


def write_tree(root: Path, classes: dict[str, int], *, size=(32, 32), seed: int = 0, sizes=None) -> Path:
    """root/<class>/<i>.png with `classes[name]` images each. Each class has its own colour
    (so a model can learn it) plus noise. `sizes`, if given, cycles through (h, w) pairs."""
    rng = np.random.default_rng(seed)
    for ci, (name, n) in enumerate(sorted(classes.items())):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        base = np.array([(ci * 97) % 256, (ci * 53 + 80) % 256, (ci * 31 + 160) % 256])
        for i in range(n):
            h, w = sizes[i % len(sizes)] if sizes else size
            img = np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(folder / f"{i:03d}.png")
    return root


# one frame of the bar: "epoch 1/2 24px:  40%|####   | 64.0/160 [00:01<00:02, 45.1img/s, loss 2.3012]"
BAR = re.compile(
    r"epoch (\d+)/\d+(?: \d+px)?: +\d+%\|[^|]*\| *([\d.]+)k?/[\d.]+[kMG]? "
    r"\[\d\d:\d\d<(?:\d\d:\d\d|\?), (?:[\d.]+[kMG]?|\?)img/s, loss (\d+\.\d+)\]"
)


class Terminal(io.StringIO):
    """A stream that says it is a terminal (and has no size: the bar falls back to 80 x 24)."""

    def isatty(self) -> bool:
        return True


def bar_frames(text: str) -> list[tuple[int, float, float]]:
    """(epoch, images, loss) of every bar frame drawn, in order."""
    return [(int(e), float(n), float(loss)) for e, n, loss in BAR.findall(text)]


_shared: dict = {}  # the session's cluster, so that `own_cluster` tests can stop it first


# the tests' runs train with torchvision's ImageNet stem unless a test asks for another:
# `--small-stem auto` takes the small-image stem for their 32 px images, whose steps cost about
# five times as much on the 2-core machine (docs/benchmarks.md, "Small-image stem"); the stem
# rule has tests of its own (tests/test_train_job.py)
TEST_STEM = "off"


def prepare(cfg):
    """training.driver.inputs.prepare with a built-in preset loaded too: (cfg, tree, preset), what
    jobs.train hands training.driver.job.run; a config that leaves --small-stem at auto trains with
    TEST_STEM."""
    from augment.presets import load_preset
    from training.driver.inputs import prepare as check

    if cfg.small_stem == "auto":
        cfg = dataclasses.replace(cfg, small_stem=TEST_STEM)
    cfg, tree, name, preset = check(cfg)
    return cfg, tree, preset or load_preset(name)


def split_coordinators() -> set[str]:
    """The ids of the connected cluster's split-coordinator actors (Ray Train starts one per split dataset)."""
    import ray
    from ray.util.state import list_actors

    address = ray.get_runtime_context().gcs_address  # else the state API asks the cluster that started last
    coordinators = list_actors(address=address, filters=[("class_name", "=", "SplitCoordinator")], limit=10_000)
    return {a.actor_id for a in coordinators}


def _stop_shared_cluster():
    import ray

    from training.driver.session import PREEMPTION_WATCHER_ENV

    if ray.is_initialized():
        ray.shutdown()
    cluster = _shared.pop("cluster", None)
    if cluster is not None:
        cluster.shutdown()
        os.environ.pop(PREEMPTION_WATCHER_ENV, None)  # the `own_cluster` tests' clusters are as users start them


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 server on loopback for the whole session (tests/s3server.py) with buckets
    `data` and `runs`, and this process's environment pointing at it as a user's would point
    at MinIO. The Ray cluster starts after it (ray_cluster depends on it), so every Ray
    process, and every job a test starts as a subprocess, has the same settings."""
    from tests.s3server import S3Server, without_aws_settings

    saved = without_aws_settings()
    server = S3Server()
    for bucket in ("data", "runs"):  # tests use prefixes of their own inside these
        server.client.create_bucket(Bucket=bucket)
    os.environ.update(server.environment(tmp_path_factory.mktemp("aws")))
    yield server
    server.stop()
    without_aws_settings()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def ray_cluster(s3):
    """One Ray cluster for the whole test session: two nodes (ray.cluster_utils.Cluster), so
    the same runs that test training also test placement across nodes, and their storage
    may be the session's S3 server. It ends with this process, as a plain local run's
    cluster does, and the runs in this process are set up as theirs (`own_cluster=True`
    in job.run, no preemption watcher): two fewer processes for Ray Train to start per run.
    The runs that join a cluster through RAY_ADDRESS (tests/test_node_loss.py,
    tests/test_cluster.py) run with the placement-group cleaner, as joined runs do."""
    import ray
    from ray.cluster_utils import Cluster

    from training.driver.session import quiet_ray_data, quiet_ray_env, without_preemption_watcher

    kwargs = quiet_ray_env()
    quiet_ray_data()
    without_preemption_watcher()
    # 2 logical CPUs per node on a 2-core machine: a train worker per node plus Ray Data's actors
    import socket

    with socket.socket() as sock:  # a free dashboard port: another Ray on this machine may hold 8265
        sock.bind(("127.0.0.1", 0))
        dashboard_port = sock.getsockname()[1]
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": dashboard_port,
        },
    )
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    _shared["cluster"] = cluster
    ray.init(address=cluster.address, **kwargs)
    yield ray
    _stop_shared_cluster()


@pytest.fixture()
def gpu_node(ray_cluster, request):
    """A node with one GPU, for Ray to schedule by, added to the shared cluster for one test
    (torch sees no CUDA here). Indirect parametrization
    passes other `add_node` arguments (num_gpus, env_vars). The node says its GPUs are fake
    (training.stream.stage.FAKE_GPUS_ENV), so its GPU tasks may run on the CPU."""
    from training.stream.stage import FAKE_GPUS_ENV

    cluster = _shared["cluster"]
    args = {"num_cpus": 2, "num_gpus": 1} | getattr(request, "param", {})
    args["env_vars"] = {FAKE_GPUS_ENV: "1"} | args.get("env_vars", {})
    node = cluster.add_node(**args)
    cluster.wait_for_nodes()
    yield node
    cluster.remove_node(node)
    cluster.wait_for_nodes()


RAY_FIXTURES = {"ray_cluster", "own_cluster", "gpu_node"}  # a test that asks for one of these runs Ray


def pytest_collection_modifyitems(config, items):
    """Tests marked `own_cluster` start and stop whole Ray clusters (`ray start`, `ray stop`),
    which would take the shared cluster down with them: they run last, after it is stopped.
    A test that needs a Ray cluster is marked `ray` (`make test-fast` leaves those out); one whose
    subprocess starts a cluster of its own carries the mark by hand (under `-m "not ray"`, pytest_configure's
    RAY_TMPDIR stops one that does not)."""
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("own_cluster"):
            item.add_marker(pytest.mark.ray)
    items.sort(key=lambda item: item.get_closest_marker("own_cluster") is not None)


NO_RAY = "this test starts Ray: mark it `ray`"
_no_ray_folder: list[str] = []  # the RAY_TMPDIR of a run that leaves the `ray` tests out, removed after it


def ray_left_out(config) -> bool:
    """Whether this run deselects the `ray` tests (`-m "not ray"`, as `make test-fast` runs)."""
    return re.search(r"\bnot\s+ray\b", config.option.markexpr or "") is not None


def pytest_configure(config):
    """Where the `ray` tests are left out, no Ray starts in a job a test runs as a subprocess either:
    RAY_TMPDIR (which the subprocesses inherit) is a folder whose `ray` is a file, so `ray.init` and
    `ray start` fail within seconds at the cluster's session folder, with a path that says why."""
    if not ray_left_out(config):
        return
    folder = tempfile.mkdtemp(prefix="no-ray-")
    guard = Path(folder) / NO_RAY.replace("`", "")
    guard.mkdir()
    (guard / "ray").write_text(NO_RAY + "\n")
    os.environ["RAY_TMPDIR"] = str(guard)
    _no_ray_folder.append(folder)


def pytest_unconfigure(config):
    for folder in _no_ray_folder:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def ray_only_where_marked(request, monkeypatch):
    """Where the `ray` tests are left out, a test that calls ray.init in this process fails there
    with one line (a BaseException, which the jobs' `except Exception` lets through). Before the
    first import of Ray, RAY_TMPDIR (pytest_configure) stops it instead."""
    if ray_left_out(request.config) and "ray" in sys.modules:
        monkeypatch.setattr(sys.modules["ray"], "init", lambda *a, **k: pytest.fail(NO_RAY, pytrace=False))
    yield


@pytest.fixture()
def own_cluster():
    """No other Ray cluster may run while an `own_cluster` test starts its own."""
    _stop_shared_cluster()
    yield


@pytest.fixture()
def fresh_signals():
    """SIGINT as a fresh `python -m` process has it (Python's KeyboardInterrupt, whatever an earlier
    test left), and SIGTERM failing the test should the job under test not take it; both put back
    after. For tests that send this process a real SIGTERM."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *a: pytest.fail("SIGTERM reached the test's handler: the job set none"))
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@pytest.fixture()
def tree(tmp_path) -> Path:
    return write_tree(tmp_path / "data", {"cat": 12, "dog": 12, "eel": 12})


def registered_checkpoint(run_dir: Path) -> str:
    """The checkpoint Ray Train's controller registered last: it rewrites this snapshot after
    registering one, and a restart resumes from it. The files of a checkpoint appear earlier,
    while the worker uploads them."""
    try:
        state = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):  # not written yet, or read while being written
        return ""
    return (state.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name") or ""


@pytest.fixture()
def no_ray(monkeypatch):
    """jobs.train.main may neither start nor join a Ray cluster."""
    import ray

    from jobs import train as train_job

    was = ray.is_initialized()
    calls = []
    monkeypatch.setattr(train_job, "connect", lambda *a, **k: calls.append(a) or pytest.fail("Ray was started"))
    yield
    assert not calls and ray.is_initialized() == was


def exits_2(args: list[str], capsys) -> str:
    """main(args) returns 2 within seconds with one `error:` line on stderr; that line."""
    from jobs import train as train_job

    start = time.monotonic()
    code = train_job.main(args)
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    assert code == 2, captured.err
    err = captured.err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert elapsed < 5, f"{elapsed:.1f} s"  # a run that reached the cluster took 37-54 s
    return err


def event_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of the TFRecord event files in LOGDIR, read with tensorboardX's protos."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.iterdir()):
        data, at = path.read_bytes(), 0
        while at < len(data):  # a record: length (8 bytes), its CRC (4), the event, the event's CRC (4)
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 16 + length
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def an_epoch_record(epoch: int = 1, val_acc: float = 0.5):
    """A training.records.EpochRecord with plain figures and the given val_acc."""
    from training.bounds import Bound
    from training.records import EpochRecord, TrainFigures, ValFigures

    zero = {f.name: 0.0 for f in dataclasses.fields(TrainFigures)}
    train = TrainFigures(**(zero | {"images": 8, "image_size": 32, "decoded": (0, 0, 8), "seen": ()}))
    val = ValFigures(loss=1.0, acc=val_acc, confusion=[[1, 0], [0, 1]])
    return EpochRecord(epoch, 0.1, train, val, Bound("trainer", 0.0, 0.0, 0.0, False))


class TrackedRun(NamedTuple):
    """What the `tracked_run` fixture hands its tests."""

    config: dict  # training.fit's config; the same without the callbacks resumes the run
    result: object  # training.RunResult of the first call
    run_dir: Path
    lines: list[str]  # what the driver logged
    seen: list  # the EpochRecords an epoch callback received
    during: dict  # TensorBoard's scalars as read while epoch 2 ended, before the trackers saw it


@pytest.fixture(scope="session")
def tracked_run(ray_cluster, tmp_path_factory) -> TrackedRun:
    """One run of training.fit for the checks of three files (a Ray Train start-up costs 12-15 s):
    one worker with the balanced sampler on imbalanced classes (tests/test_recipe_on_ray.py),
    logging live to every tracker (tests/test_tracking.py, which resumes it to its third epoch),
    and stopped after 2 of its 3 epochs by the last of four epoch callbacks, one of which fails
    (tests/test_api.py)."""
    from training import STOP, fit

    root = tmp_path_factory.mktemp("tracked")
    data = write_tree(root / "data", {"many": 40, "few": 8})
    run_dir = root / "runs" / "tracked"
    during, seen, lines = {}, [], []

    def read_tensorboard_while_running(record):  # before the trackers see this epoch: the one before is there
        if record.epoch == 2:
            during.update(event_scalars(run_dir / "tensorboard"))

    class Tracker:
        def on_epoch_end(self, record):
            seen.append(record)

    def broken(record):
        raise ValueError("the tracker's server is down")

    def stop_at_two(record):
        return STOP if record.epoch == 2 else None

    config = {"data": str(data), "epochs": 3, "batch_size": 8, "num_workers": 1, "sampler": "balanced"}
    config |= {"small_stem": TEST_STEM, "storage_path": str(root / "runs"), "name": "tracked"}
    config |= {"log_to": ["tensorboard", "mlflow", "wandb"], "log_every": 1}  # a list, as Python callers write it
    callbacks = [read_tensorboard_while_running, Tracker(), broken, stop_at_two]
    result = fit(config, callbacks=callbacks, log=lines.append)
    return TrackedRun(config, result, run_dir, lines, seen, during)
