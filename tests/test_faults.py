"""Faults and bad data: every test first makes sure the fault really happened, then that
the run recovered, lost nothing, and said what happened."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
import shlex
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import TEST_STEM, bar_frames, prepare, registered_checkpoint, write_tree
from tests.test_bad_files import tiff_pillow_breaks_on
from training.config import TrainConfig
from training.driver import job, planning
from training.forms.data import DataError
from training.spec import StallLimits

REPO = Path(__file__).resolve().parents[1]


def _run(**overrides):
    lines = []
    cfg, tree, preset = prepare(TrainConfig(**overrides))
    return job.run(cfg, tree, preset, log=lines.append, own_cluster=True), tree, lines  # see conftest.ray_cluster


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (its data is a 1x1 image's)."""
    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = 8 + 8  # signature, then length + b"IHDR"
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13]))
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


def _no_leaks(ray_cluster, timeout=30.0):
    """Every logical resource is free again: no actor or placement group left behind.
    (object_store_memory counts bytes of live objects, not reservations, so it is not compared.)"""
    deadline = time.time() + timeout
    while time.time() < deadline:
        total, free = ray_cluster.cluster_resources(), ray_cluster.available_resources()
        if all(abs(free.get(k, 0) - v) < 1e-6 for k, v in total.items() if k != "object_store_memory"):
            return
        time.sleep(0.5)
    raise AssertionError(f"resources still held after the run: total {total}, available {free}")


@pytest.fixture(scope="module")
def messy_tree(tmp_path_factory):
    """train/ with good images of every awkward kind and six bad files (among them a TIFF Pillow
    raises TypeError on, a file whose read fails with EIO and a decompression bomb, which
    --preset auto's header sampling meets too); val/ all good."""
    root = tmp_path_factory.mktemp("messy")
    write_tree(root / "train", {"a": 6, "b": 6})
    write_tree(root / "val", {"a": 2, "b": 2}, seed=1)
    rng = np.random.default_rng(0)
    good = root / "train" / "b"
    Image.fromarray((rng.random((30, 28)) * 65535).astype(np.uint16)).save(good / "sixteen_bit.png")
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).convert("CMYK").save(good / "cmyk.jpg")
    frames = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(2)]
    frames[0].save(good / "animated.gif", save_all=True, append_images=frames[1:])
    Image.fromarray(rng.integers(0, 255, (32, 32), dtype=np.uint8), mode="L").save(good / "gray.png")
    Image.fromarray(rng.integers(0, 255, (32, 32, 4), dtype=np.uint8), mode="RGBA").save(good / "rgba.png")
    bad = root / "train" / "a"
    jpeg = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(jpeg, format="JPEG")
    (bad / "truncated.jpg").write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) // 2])
    (bad / "not_an_image.jpg").write_bytes(b"this is a text file with a .jpg name\n" * 10)
    (bad / "empty.jpg").write_bytes(b"")
    (bad / "bomb.png").write_bytes(_png_claiming(20_000, 20_000))  # 400 Mpx claimed: over MAX_IMAGE_PIXELS
    (bad / "typeerror.tif").write_bytes(tiff_pillow_breaks_on())  # its header reads; its pixels raise TypeError
    os.symlink("/proc/self/mem", root / "train" / "b" / "eio.png")  # every read of it fails with EIO
    return root


EXPECTED_BAD = {
    "truncated.jpg": "corrupt image",
    "not_an_image.jpg": "not an image",
    "empty.jpg": "empty file",
    "bomb.png": "decompression bomb",
    "typeerror.tif": "corrupt image",
    "eio.png": "cannot read it: [Errno 5] Input/output error",
}


def test_bad_files_are_listed_and_every_good_file_is_trained_on(ray_cluster, messy_tree, tmp_path):
    """jobs.train's path, end to end: each bad file costs only itself; the run finishes,
    bad_files.csv names each with its reason, and the epoch trained on every other image once."""
    summary, tree, lines = _run(
        data=str(messy_tree),
        epochs=1,
        batch_size=8,
        num_workers=1,
        storage_path=str(tmp_path),
        name="messy",  # 17 good images in batches of 8: the last one is folded into the batch before
    )
    rows = list(csv.DictReader((tmp_path / "messy" / "bad_files.csv").open()))
    reasons = {Path(r["path"]).name: r["reason"] for r in rows}
    assert set(reasons) == set(EXPECTED_BAD)
    for name, reason in EXPECTED_BAD.items():
        assert reasons[name].startswith(reason), (name, reasons[name])
    assert summary["bad_files"] == 6
    assert any("skipped 6 unreadable image(s)" in line for line in lines)
    (cov,) = summary["coverage"]
    assert cov["expected"] == len(tree.train) - 6 == 12 + 5
    assert cov["exactly_once"], cov  # the good neighbours of bad files, and every odd mode, were trained on
    _no_leaks(ray_cluster)


def test_strict_makes_a_bad_file_fatal_before_training(ray_cluster, messy_tree, tmp_path):
    with pytest.raises(DataError, match=r"6 unreadable image\(s\).*drop --strict"):
        _run(
            data=str(messy_tree),
            epochs=1,
            batch_size=8,
            num_workers=1,
            storage_path=str(tmp_path),
            name="strict",
            strict=True,
        )
    assert not (tmp_path / "strict" / "metrics.csv").exists()
    assert len(list(csv.DictReader((tmp_path / "strict" / "bad_files.csv").open()))) == 6
    _no_leaks(ray_cluster)


def _start_in_thread(**overrides):
    box = {}

    def target():
        try:
            box["result"] = _run(**overrides)
        except BaseException as e:  # the test thread re-raises it
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def _wait_for_checkpoint(run_dir: Path, epoch: int, alive, timeout=300):
    """Until epoch `epoch`'s checkpoint (or a later one) is registered, while alive() holds."""
    deadline = time.time() + timeout
    while time.time() < deadline and alive():
        if registered_checkpoint(run_dir) >= f"checkpoint_epoch_{epoch:04d}":
            return
        time.sleep(0.2)
    raise AssertionError(f"epoch {epoch}'s checkpoint was never registered")


def _alive_actor_pids(class_name: str) -> list[int]:
    from ray.util.state import list_actors

    alive = [("class_name", "=", class_name), ("state", "=", "ALIVE")]
    return [a.pid for a in list_actors(address=_state_address(), filters=alive, detail=True)]


@pytest.fixture(scope="module")
def fault_data(tmp_path_factory):
    return write_tree(tmp_path_factory.mktemp("fault-data"), {"a": 48, "b": 48})


def test_a_killed_train_worker_resumes_from_the_last_checkpoint(ray_cluster, fault_data, tmp_path):
    common = dict(
        data=str(fault_data),
        epochs=2,
        batch_size=16,
        num_workers=1,
        deterministic=True,
        val_fraction=0.25,
        storage_path=str(tmp_path),
    )
    baseline, _, _ = _run(name="clean", **common)

    thread, box = _start_in_thread(name="killed", max_failures=2, **common)
    _wait_for_checkpoint(tmp_path / "killed", 1, thread.is_alive)
    pids = _alive_actor_pids("RayTrainWorker")
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)  # the fault
    thread.join(timeout=600)
    assert "error" not in box, box.get("error")
    summary = box["result"][0]

    # one restart, which continued from epoch 1's checkpoint (the kill came as epoch 2 began)
    assert summary["resumed_at_epochs"] == [2], "training restarted from epoch 1 instead of the checkpoint"
    rows = list(csv.DictReader((tmp_path / "killed" / "metrics.csv").open()))
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    # deterministic mode and a full state restore (model, optimizer, scheduler, each rank's
    # random stream): the resumed run is the clean one, metric for metric
    assert (tmp_path / "killed" / "metrics.csv").read_text() == (tmp_path / "clean" / "metrics.csv").read_text()
    assert summary["fingerprints"] == baseline["fingerprints"]
    _no_leaks(ray_cluster)


def test_the_driver_removes_the_placement_group_an_attempt_trained_in(ray_cluster):
    """A rank tells the run's status its placement group (training/status.py tell_group, what
    the train loop calls first); once the attempt has ended, the driver's release_groups removes
    it, whoever else did or did not (after a node loss a worker group's outlived its attempt and
    held a node's CPU for the rest of a sweep: docs/design.md, "Faults"). A group already
    removed, and a second release, change nothing."""
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from training.driver.faults import driver_actor, release_groups
    from training.status import RunStatus, tell_group

    status = driver_actor(RunStatus)
    groups = [placement_group([{"CPU": 1}]) for _ in range(2)]
    ray_cluster.get([g.ready() for g in groups], timeout=120)
    rank = ray_cluster.remote(num_cpus=1)(tell_group)
    in_group = [rank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(g)) for g in groups]
    try:
        ray_cluster.get([r.remote(status) for r in in_group])
        ray_cluster.util.remove_placement_group(groups[1])  # as Ray Train's controller does when all goes well
        assert placement_group_table(groups[0])["state"] == "CREATED"

        release_groups(status)
        assert [placement_group_table(g)["state"] for g in groups] == ["REMOVED", "REMOVED"]
        release_groups(status)  # nothing left to take
    finally:  # a failure here leaves no CPU held for the tests after it
        for group in groups:
            ray_cluster.util.remove_placement_group(group)
        ray_cluster.kill(status)
    _no_leaks(ray_cluster)


# the process title of an augment worker while it runs a call (an idle task worker is "ray::IDLE",
# an idle actor "ray::MapWorker(MapBatches(AugmentStage))", one being made "...AugmentStage)).__init__"):
# the read fused with the augment call, or the actor's method that augments a block
BUSY_TITLES = {
    "tasks": "ray::ReadReadImages->MapBatches(augment_task)",
    "actors": "ray::MapWorker(MapBatches(AugmentStage)).submit",
}


DIED = ("WORKER_DIED", "ACTOR_DIED", "ACTOR_UNAVAILABLE")  # how Ray records a call whose process was killed
# how Ray records the attempt that ran the call again. The process that ran it records RUNNING; only
# the call's owner, Ray Data's executor, records FINISHED, into a buffer it sends to the GCS once a
# second, and Ray keeps task records best-effort. The retry is often the epoch's last call, and the
# executor's actor ends with the run, so that last record can be lost: that the epoch finished is
# the coverage check.
RAN = ("RUNNING", "FINISHED")


def _state_address() -> str:
    """The session cluster's address for Ray's state API, which otherwise asks the cluster on
    this machine that started last (another test run's, maybe)."""
    import ray

    return ray.get_runtime_context().gcs_address


def _cluster_worker_pids() -> list[int]:
    """The worker processes of the session's cluster, not of any other Ray cluster on the
    machine. (The GCS filters them but counts the dead too, which the state API would take
    for a truncated answer.)"""
    from ray.util.state import list_workers

    alive = list_workers(
        address=_state_address(),
        filters=[("worker_type", "=", "WORKER"), ("is_alive", "=", True)],
        detail=True,
        limit=10_000,
        raise_on_missing_output=False,
    )
    return [w.pid for w in alive]


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:  # gone
        return ""


def _kill_a_busy_augment_process(mode: str, alive, timeout=60.0) -> tuple[int, str, float]:
    """SIGKILL to the first of the cluster's worker processes seen running an augment call:
    its pid, the call (its process title, less "ray::") and when (time.time())."""
    deadline, pids, listed = time.time() + timeout, [], 0.0
    while time.time() < deadline and alive():
        if time.time() - listed > 1.0:  # new processes start as the epoch goes on
            pids, listed = _cluster_worker_pids(), time.time()
        for pid in pids:
            title = _title(pid)
            if title.startswith(BUSY_TITLES[mode]):
                os.kill(pid, signal.SIGKILL)  # the fault
                return pid, title.removeprefix("ray::"), time.time()
        time.sleep(0.002)
    raise AssertionError(f"no augment {mode} process of the cluster was seen running a call during epoch 2")


def _retried_calls(name: str, since: float) -> list[list]:
    """The calls `name` that Ray ran again after `since` (its task records), each as its
    attempts in order: the attempt the kill ended, then the retries. A task's process runs one
    call; an actor's may have several in flight."""
    from ray.util.state import list_tasks

    address, limits = _state_address(), {"detail": True, "limit": 10_000, "raise_on_missing_output": False}
    tasks = list_tasks(address=address, filters=[("name", "=", name)], **limits)
    retried = {t.task_id for t in tasks if t.attempt_number > 0 and (t.start_time_ms or 0) >= (since - 1) * 1000}
    calls = [sorted((t for t in tasks if t.task_id == i), key=lambda t: t.attempt_number) for i in sorted(retried)]
    assert calls, f"no {name} call ran again after the kill: the process was idle"
    return calls


@pytest.mark.parametrize("mode", ["tasks", "actors"])
def test_a_killed_augment_worker_is_replaced_and_the_epoch_completes(ray_cluster, fault_data, tmp_path, mode):
    """CPU augmentation runs as Ray Data tasks by default (Ray retries a task whose process
    died) and as an actor pool with --augment-actors (Ray Data restarts the actor). The kill
    hits a process while it runs an augment call, and Ray's task records show that call
    failed there and ran again elsewhere."""
    thread, box = _start_in_thread(
        data=str(fault_data),
        epochs=2,
        batch_size=16,
        num_workers=1,
        val_fraction=0.25,
        augment_batch_size=8,
        augment_actors=1 if mode == "actors" else 0,
        storage_path=str(tmp_path),
        name=mode,
    )
    _wait_for_checkpoint(tmp_path / mode, 1, thread.is_alive)
    killed, call, when = _kill_a_busy_augment_process(mode, thread.is_alive)  # epoch 2's, as soon as one runs
    thread.join(timeout=600)
    assert "error" not in box, box.get("error")
    summary = box["result"][0]
    assert summary["epochs"] == 2 and summary["resumed_at_epochs"] == []  # Ray Data recovered; no train restart
    calls = _retried_calls(call, when)
    assert len(calls) == 1 or mode == "actors", calls
    for first, *again in calls:  # ended by the kill, then run again in another process
        assert (first.attempt_number, first.state) == (0, "FAILED") and first.error_type in DIED, first
        assert first.worker_pid in (killed, None), first  # None: the dead process's own record went with it
        assert again and again[-1].state in RAN and again[-1].worker_pid not in (killed, None), again
    for cov in summary["coverage"]:  # each epoch trained on every image; a redelivered batch may repeat some
        assert cov["every_image"] and cov["missing"] == 0, cov
    _no_leaks(ray_cluster)


def test_a_run_whose_data_tasks_cannot_start_stops_with_a_clear_error(ray_cluster, fault_data, tmp_path, monkeypatch):
    """The planner leaves Ray Data room; here it is bypassed with the kind of plan that hung a
    2-core machine for 10 minutes: the train workers hold every CPU of both nodes, so Ray
    Data cannot start a task. The run stops once no batch has come for `starved_s`."""
    cfg = TrainConfig(data=str(fault_data), epochs=1, batch_size=16, num_workers=2, max_failures=0)
    plan = planning.plan_resources(cfg, planning.cluster_capacity())
    hogs = dataclasses.replace(plan, cpus_per_worker=2)  # the fault
    monkeypatch.setattr(job, "plan_resources", lambda cfg, capacity: hogs)
    cfg, tree, preset = prepare(dataclasses.replace(cfg, storage_path=str(tmp_path), name="starved"))
    limits = StallLimits(starved_s=3, pending_s=600, poll_s=0.5)
    with pytest.raises(job.TrainingFailed) as err:
        job.run(cfg, tree, preset, log=lambda *a: None, stall=limits, own_cluster=True)
    assert re.fullmatch(
        r"training failed: no batch for \d+ s: the 2 train worker\(s\) hold 2 CPU each, which leaves Ray Data "
        rf"0, 0 CPU on the node\(s\), and it needs {hogs.augment_cpus:g} CPU at once; lower --num-workers or "
        r"--cpus-per-worker",
        str(err.value),
    ), str(err.value)
    assert not (tmp_path / "starved" / "metrics.csv").exists()
    _no_leaks(ray_cluster)


def _raylets_of(pid: int) -> set[int]:
    """The raylets a process started (a plain local run's embedded cluster): its descendants, so
    that another Ray cluster on the machine never counts."""
    import psutil

    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True) if p.name() == "raylet"}
    except psutil.NoSuchProcess:
        return set()


def _running(pids: set[int]) -> set[int]:
    import psutil

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return {p for p in pids if alive(p)}


def test_ctrl_c_while_a_checkpoint_goes_to_s3_stops_cleanly_and_the_next_run_resumes(
    ray_cluster, s3, fault_data, tmp_path
):
    """The job as users run it on object storage (tests/test_storage.py has the rest): an s3://
    tree with bad files in it, --storage-path s3://, credentials and endpoint from the
    environment. Ctrl-C comes while epoch 2's checkpoint is being uploaded; the rerun resumes
    from epoch 1's, the last complete one, and removes the local copy the stopped upload left."""
    data = s3.upload(fault_data, "s3://data/fault")
    for name, content in (("empty.png", b""), ("text.jpg", b"a text file with an image's name\n")):
        s3.client.put_object(Bucket="data", Key=f"fault/a/{name}", Body=content)
    args = [
        sys.executable,
        "-m",
        "jobs.train",
        "--data",
        data,
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--val-fraction",
        "0.25",
        "--small-stem",
        TEST_STEM,
        "--storage-path",
        "s3://runs",
        "--name",
        "interrupted",
    ]
    # the machine's temp folder, as the job's processes see it, is the test's own; Ray's folder stays where
    # it was (Ray takes RAY_TMPDIR, else TMPDIR, else /tmp)
    temp = tmp_path / "temp"
    temp.mkdir()
    ray_temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    env = {**os.environ, "RAY_ADDRESS": "", "TMPDIR": str(temp), "RAY_TMPDIR": ray_temp}
    s3.gate.hold("/runs/interrupted/checkpoint_epoch_0002/checkpoint.pt")
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not s3.gate.arrived.wait(timeout=1) and proc.poll() is None:
            pass
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        ours = _raylets_of(proc.pid)
        assert ours  # the run's own cluster
        proc.send_signal(signal.SIGINT)  # the fault: Ctrl-C, while the upload hangs
        out, _ = proc.communicate(timeout=120)
    finally:
        s3.gate.release()
    assert proc.returncode == 130, out[-3000:]
    # the line names the checkpoint, and the command to resume is the same one, --name included
    import contextlib

    from jobs.train import interpreter

    with contextlib.chdir(REPO):  # the run's own directory: the python it names from there
        resume = shlex.join([interpreter(), "-m", "jobs.train", *args[3:]])
    assert (
        "stopped: interrupted; the last checkpoint is checkpoint_epoch_0001 in s3://runs/interrupted; "
        f"to resume: {resume}" in out
    ), out[-2000:]
    # a plain local run starts Ray without the dashboard; Ray Train's cleaner must not warn about it
    assert "Failed to query Ray Train Controller actor state" not in out
    assert not bar_frames(out)  # output to a pipe (a log file): no bar
    deadline = time.time() + 30
    while _running(ours) and time.time() < deadline:  # its embedded cluster went with it
        time.sleep(0.5)
    assert not _running(ours)
    snapshot = json.loads(s3.read("s3://runs/interrupted/checkpoint_manager_snapshot.json"))
    assert snapshot["latest_checkpoint_result"]["checkpoint_dir_name"] == "checkpoint_epoch_0001"
    assert "checkpoint_epoch_0002/checkpoint.pt" not in s3.objects("s3://runs/interrupted")  # never completed
    assert list(temp.rglob("checkpoint.pt")), "no local copy of the stopped upload's checkpoint was left"

    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Reporting training result" not in done.stdout + done.stderr  # Ray Train's per-report INFO dump
    summary = json.loads(s3.read("s3://runs/interrupted/summary.json"))
    assert summary["epochs"] == 2 and summary["resumed_at_epochs"] == [2]  # from the last complete checkpoint
    assert 0 < summary["startup_s"] < summary["wall_s"]  # the rerun's own start-up, not the first run's
    bad = list(csv.DictReader(io.StringIO(s3.read("s3://runs/interrupted/bad_files.csv").decode())))
    assert sorted(r["path"] for r in bad) == [f"{data}/a/empty.png", f"{data}/a/text.jpg"]
    assert summary["bad_files"] == 2 and all(c["exactly_once"] for c in summary["coverage"])
    assert not list(temp.rglob("checkpoint.pt")), "a checkpoint stayed behind in the machine's temp folder"
