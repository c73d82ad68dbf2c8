"""One run owns its folder (training/driver/lease.py): a second jobs.train with the same name, --fresh
included, is refused before Ray with one line naming the owner, and leaves the owner's files as they
were; a lease whose owner is gone is taken over with one line. On a local disk and on S3."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import exits_2, write_tree
from training.driver import lease
from training.driver.lease import LeaseHeld, Owner

REPO = Path(__file__).resolve().parents[1]
HOLD = (
    "import sys, time; from training.driver import lease; lease.acquire(sys.argv[1], 'r'); print('held', flush=True); "
    "time.sleep(600)"
)


def _holder(run_dir: str) -> subprocess.Popen:
    """Another process that holds the lease on `run_dir`, as a running jobs.train does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, run_dir], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def test_a_live_owner_keeps_its_folder_and_a_gone_one_is_taken_over_in_one_line(tmp_path):
    run_dir = str(tmp_path / "runs" / "r")
    holder = _holder(run_dir)
    try:
        with pytest.raises(LeaseHeld, match=rf"in use by a running jobs.train \(pid {holder.pid} on "):
            lease.check_free(run_dir, "r")
        with pytest.raises(LeaseHeld, match=rf"\(pid {holder.pid} on {socket.gethostname()}"):
            lease.acquire(run_dir, "r")
    finally:
        _stop(holder)  # kill -9: it never released
    lines = []
    held = lease.acquire(run_dir, "r", log=lines.append)
    assert len(lines) == 1 and lines[0].startswith(f"note: {run_dir}: took over the lease of pid {holder.pid} on ")
    assert lines[0].endswith(", which is gone")
    held.release()
    assert os.listdir(run_dir) == [".ray-gpu-augment-run"]  # the lease file goes with its release


def test_a_second_run_with_the_same_name_is_refused_before_ray_and_fresh_removes_nothing(tmp_path, capsys, no_ray):
    tree = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    runs = tmp_path / "runs"
    run_dir = runs / "shared"
    holder = _holder(str(run_dir))
    try:
        (run_dir / "metrics.csv").write_text("epoch\n1\n")  # the running run's records
        for extra in ([], ["--fresh"]):
            err = exits_2(["--data", str(tree), "--storage-path", str(runs), "--name", "shared", *extra], capsys)
            assert f"--name shared: {run_dir} is in use by a running jobs.train (pid {holder.pid} on " in err, err
            assert "wait for it to end or stop it, or give another --name" in err
        assert (run_dir / "metrics.csv").read_text() == "epoch\n1\n"  # --fresh removed nothing
        assert (run_dir / lease.LEASE_FILE).exists()
    finally:
        _stop(holder)


def test_fresh_clears_a_run_under_its_lease_and_keeps_the_lease(tmp_path):
    """--fresh removes the old run's files, not the lease the new run holds (training.driver.inputs.start_fresh)."""
    from tests.conftest import prepare
    from training import storage
    from training.config import TrainConfig

    tree = write_tree(tmp_path / "data", {"a": 4, "b": 4})
    run_dir = tmp_path / "runs" / "again"
    (run_dir / "checkpoint_epoch_0001").mkdir(parents=True)
    (run_dir / "config.json").write_text('{"config": {"name": "again"}}')
    storage.mark_run_dir(str(run_dir), "again")
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (run_dir / "link").symlink_to(outside)
    cfg, _, _ = prepare(TrainConfig(data=str(tree), storage_path=str(tmp_path / "runs"), name="again", fresh=True))
    try:
        assert sorted(os.listdir(run_dir)) == [".lease", ".ray-gpu-augment-run"]
        assert outside.read_text() == "keep"  # a link inside the folder went as a link
    finally:
        lease.release(cfg.run_dir)


def test_on_s3_a_live_lease_is_refused_and_a_gone_one_taken_over(s3):
    run_dir = "s3://runs/leased"
    holder = _holder(run_dir)
    try:
        key = "leased/.lease"
        owner = Owner.parse(s3.client.get_object(Bucket="runs", Key=key)["Body"].read())
        assert owner and owner.pid == holder.pid
        with pytest.raises(LeaseHeld, match=rf"s3://runs/leased is in use by a running jobs.train \(pid {holder.pid} "):
            lease.acquire(run_dir, "r")
    finally:
        _stop(holder)
    lines = []
    held = lease.acquire(run_dir, "r", log=lines.append)  # the owner's process on this host is gone
    assert len(lines) == 1 and f"took over the lease of pid {holder.pid} on " in lines[0], lines
    ours = Owner.parse(s3.client.get_object(Bucket="runs", Key=key)["Body"].read())
    assert ours.pid == os.getpid()
    # someone else's live lease on another machine, written just now: refused
    held.release()
    other = Owner("elsewhere", 1, "colleague", "now", "jobs.train")
    s3.client.put_object(Bucket="runs", Key=key, Body=other.to_bytes())
    with pytest.raises(LeaseHeld, match=r"\(pid 1 on elsewhere \(user colleague"):
        lease.acquire(run_dir, "r")
