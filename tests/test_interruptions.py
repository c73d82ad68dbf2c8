"""Every way a run can stop resumes with the same command: SIGTERM (what `ray job stop` or a
scheduler sends) and `kill -9` of the driver's process group, one after the other on one run, the
same command each time reaching the last epoch with coverage exact and no process of the stopped
attempt left; and a damaged last checkpoint passed over with one line. (Ctrl-C: tests/test_faults.py,
on S3.)"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from bench.interrupt import alive, descendants
from tests.conftest import TEST_STEM, registered_checkpoint, write_tree
from training.config import TrainConfig
from training.worker.report import save_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_tree(tmp_path_factory):
    return write_tree(tmp_path_factory.mktemp("stops"), {"a": 32, "b": 32})


def _args(data: Path, runs: Path, epochs: int = 3) -> list[str]:
    return [
        *(sys.executable, "-m", "jobs.train", "--data", str(data), "--epochs", str(epochs)),
        *("--batch-size", "16", "--small-stem", TEST_STEM, "--storage-path", str(runs), "--name", "stopped"),
    ]


def _start(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _mid_epoch_after_a_checkpoint_newer_than(last: str, proc: subprocess.Popen, run_dir: Path) -> set[int]:
    """Until the run registers a checkpoint newer than `last`, then a random step of the epoch after it
    (the stop may come anywhere in it): the processes the run started (its embedded cluster's)."""
    deadline = time.time() + 300
    while registered_checkpoint(run_dir) <= last and proc.poll() is None:
        assert time.time() < deadline, f"no checkpoint after {last or 'none'} in 300 s"
        time.sleep(0.1)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    time.sleep(random.Random().uniform(0, 1))
    ours = descendants(proc.pid)
    assert ours  # its embedded cluster's processes
    return ours


def _gone(ours: set[int]) -> None:
    """The stopped run's cluster and workers went with it."""
    deadline = time.time() + 60
    while alive(ours) and time.time() < deadline:
        time.sleep(0.5)
    assert not alive(ours), [psutil.Process(p).cmdline()[:3] for p in alive(ours)]


def test_a_run_stopped_by_sigterm_and_then_by_kill_9_resumes_with_the_same_command_each_time(
    ray_cluster, small_tree, tmp_path
):
    """One run stopped twice, each time at a random step after a checkpoint: SIGTERM stops the first
    attempt, `kill -9` of its process group the second (itself a resume), and the same command a third
    time reaches the last epoch with every image trained on exactly once."""
    runs = tmp_path / "runs"
    run_dir = runs / "stopped"
    args = _args(small_tree, runs, epochs=6)  # room after each stop's checkpoint for the next stop to come mid-run
    env = {**os.environ, "RAY_ADDRESS": ""}  # a plain local run: its own cluster
    first = _start(args, env)
    deadline = time.time() + 300
    while not (run_dir / ".lease").exists() and first.poll() is None:  # while it runs, a second run with the
        assert time.time() < deadline, "no lease in 300 s"  # same name, --fresh included, is refused
        time.sleep(0.1)
    second = subprocess.run([*args, "--fresh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"is in use by a running jobs.train (pid {first.pid} on " in second.stderr, second.stderr
    assert "Traceback" not in second.stderr

    ours = _mid_epoch_after_a_checkpoint_newer_than("", first, run_dir)
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=180)
    assert first.returncode == 143, out[-3000:]
    assert "stopped: terminated (SIGTERM); the last checkpoint is checkpoint_epoch_000" in out, out[-2000:]
    assert "to resume: " in out and "SIGTERM received" not in out, out[-2000:]  # no stack dump from Ray
    _gone(ours)

    resumed = _start(args, env)  # the same command
    ours = _mid_epoch_after_a_checkpoint_newer_than(registered_checkpoint(run_dir), resumed, run_dir)
    os.killpg(resumed.pid, signal.SIGKILL)
    out, _ = resumed.communicate(timeout=60)
    assert "took over the lease of pid" not in out, out[-2000:]  # a stopped owner released its lease
    _gone(ours)

    again = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs"] == 6, summary["epochs"]
    first_resume, second_resume = summary["resumed_at_epochs"]  # one resume after each stop
    assert 2 <= first_resume < second_resume <= 6, summary["resumed_at_epochs"]
    assert all(c["exactly_once"] for c in summary["coverage"]), summary["coverage"]
    assert "took over the lease of pid" in again.stdout, again.stdout[-2000:]  # a killed owner never released it


def _as_an_older_version_wrote_it(checkpoint: Path) -> None:
    """The checkpoint's schedule as versions before torch's SequentialLR saved it: a LambdaLR's
    state (tests/test_loop.py has the learner's own check of this)."""
    state = torch.load(checkpoint, weights_only=True)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    state["learner"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0).state_dict()
    save_checkpoint(str(checkpoint.parent), state)  # sealed, as that version would have written it whole


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


def test_a_last_checkpoint_of_another_version_exits_1_and_a_damaged_one_is_passed_over_in_one_line(
    ray_cluster, small_tree, tmp_path, capsys
):
    """The same command after a run stopped at epoch 2 (of 3), its last checkpoint changed in turn.
    Written by an older version (a schedule the learner cannot load), or with records of another
    version: a real training failure, found by the train worker, exit 1 with one line (README.md,
    "Exit codes") and no results written. Cut in half (a crash or a full disk mid-write): the run
    resumes from the newest complete checkpoint, says which one it passed over, and never needs --fresh."""
    from jobs.train import main

    argv = ["--data", str(small_tree), "--epochs", "3", "--batch-size", "16", "--small-stem", TEST_STEM]
    argv += ["--storage-path", str(tmp_path / "runs"), "--name", "torn"]
    assert main([*argv, "--quiet", "--stop-after", "2"]) == 0, capsys.readouterr().err[-3000:]
    summary = (tmp_path / "runs" / "torn" / "summary.json").read_text()
    last = tmp_path / "runs" / "torn" / "checkpoint_epoch_0002"
    written = shutil.copytree(last, tmp_path / "as-written")
    capsys.readouterr()

    _as_an_older_version_wrote_it(last / "checkpoint.pt")
    code, err = main([*argv, "--quiet"]), capsys.readouterr().err
    line = _one_error_line(err)
    assert code == 1, err[-3000:]
    assert line.startswith(
        "error: training failed: the last checkpoint of --name torn was written by another version or other settings ("
    ), line
    assert line.endswith("rerun with --fresh to start over, or with the settings it was written with"), line
    # records of another version of the job (training/records.py): one line too, not a shim per field
    state = torch.load(last / "checkpoint.pt", weights_only=True)
    state["records"]["version"] = 1
    save_checkpoint(str(last), state)
    code, err = main([*argv, "--quiet"]), capsys.readouterr().err
    line = _one_error_line(err)
    assert code == 1 and "written by another version of this job (its records are of version 1" in line, line
    assert (tmp_path / "runs" / "torn" / "summary.json").read_text() == summary  # the failed runs wrote no results

    shutil.rmtree(last)
    shutil.copytree(written, last)
    torn = last / "checkpoint.pt"
    size = torn.stat().st_size
    with open(torn, "r+b") as f:
        f.truncate(size // 2)
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: passed over")]
    assert said == [
        f"note: passed over damaged checkpoint checkpoint_epoch_0002 (checkpoint.pt has {size // 2} of its {size} "
        "bytes); resuming from checkpoint_epoch_0001"
    ], said
    summary = json.loads((tmp_path / "runs" / "torn" / "summary.json").read_text())
    assert summary["epochs"] == 3 and summary["resumed_at_epochs"] == [2]
    assert all(c["exactly_once"] for c in summary["coverage"])
    # epoch 2 trained again into a folder of its own: Ray Train still lists the damaged one
    assert (tmp_path / "runs" / "torn" / "checkpoint_epoch_0002_again1" / "checkpoint.pt").exists()


def test_a_checkpoint_is_read_only_where_it_matches_its_seal(tmp_path):
    """training/worker/report.py: the seal finds a file cut short or changed; a checkpoint of a version
    before seals is read where torch reads it whole."""
    from training.worker.report import CHECKPOINT_SEAL, DamagedCheckpoint, load_checkpoint, save_checkpoint

    save_checkpoint(str(tmp_path), {"learner": {"w": torch.arange(1000)}})
    assert load_checkpoint(str(tmp_path), "cpu")["learner"]["w"].sum() == 499500
    path = tmp_path / "checkpoint.pt"
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit
    with pytest.raises(DamagedCheckpoint, match="changed since it was written"):
        load_checkpoint(str(tmp_path), "cpu")
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DamagedCheckpoint, match=rf"has {len(data) // 2} of its {len(data)} bytes"):
        load_checkpoint(str(tmp_path), "cpu")
    (tmp_path / CHECKPOINT_SEAL).unlink()  # as versions before seals wrote it: torch's own reader decides
    with pytest.raises(DamagedCheckpoint, match="checkpoint.pt does not read: "):
        load_checkpoint(str(tmp_path), "cpu")
    path.write_bytes(data)
    assert load_checkpoint(str(tmp_path), "cpu")["learner"]["w"].sum() == 499500
    path.unlink()
    with pytest.raises(DamagedCheckpoint, match="no checkpoint.pt"):
        load_checkpoint(str(tmp_path), "cpu")


def test_a_run_whose_only_checkpoint_is_damaged_starts_over_with_one_line(tmp_path, monkeypatch):
    import ray.train

    from training.worker import loop
    from training.worker.report import save_checkpoint

    folder = tmp_path / "only" / "checkpoint_epoch_0001"
    folder.mkdir(parents=True)
    save_checkpoint(str(folder), {"records": {}, "learner": {}})
    (folder / "checkpoint.pt").write_bytes(b"")
    monkeypatch.setattr(loop.ray.train, "get_checkpoint", lambda: ray.train.Checkpoint(str(folder)))
    cfg = TrainConfig(storage_path=str(tmp_path), name="only")
    run, state, where, note = loop.restore(cfg, torch.device("cpu"))
    assert run.last_epoch == -1 and state is None and where is None
    assert run.passed_over == ["checkpoint_epoch_0001"]  # epoch 1's next checkpoint gets a folder of its own
    assert note.startswith("note: passed over damaged checkpoint checkpoint_epoch_0001 (checkpoint.pt has 0 of its")
    assert note.endswith("; no complete checkpoint: starting over")


@pytest.fixture()
def small_disk(tmp_path):
    """A filesystem of 150 MB of its own (a tmpfs; mounting one needs root): room for one checkpoint of
    the tests' ResNet18 (about 90 MB with its optimiser state), not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=150m", "tmpfs", str(disk)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"a full disk needs a small filesystem of its own, and mounting a tmpfs failed here: {made.stderr}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_stops_the_run_in_one_line_and_the_same_command_resumes_once_there_is_room(
    ray_cluster, small_tree, small_disk, capsys
):
    from jobs.train import main

    argv = ["--data", str(small_tree), "--epochs", "3", "--batch-size", "16", "--small-stem", TEST_STEM]
    argv += ["--storage-path", str(small_disk / "runs"), "--name", "full", "--quiet", "--max-failures", "1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "Traceback" not in err, err[-3000:]
    assert registered_checkpoint(small_disk / "runs" / "full") == "checkpoint_epoch_0001"
    subprocess.run(["mount", "-o", "remount,size=700m", str(small_disk)], check=True)  # room again
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    summary = json.loads((small_disk / "runs" / "full" / "summary.json").read_text())
    assert summary["epochs"] == 3 and summary["resumed_at_epochs"] == [2]
    assert all(c["exactly_once"] for c in summary["coverage"]), summary["coverage"]


def test_ctrl_c_outside_the_trainer_is_one_line_and_exit_130(small_tree, tmp_path, capsys, monkeypatch):
    """Ctrl-C while the run is planned or its datasets built (bench.interrupt found exit 1 and a
    traceback there): the same line as in training, and the command that goes on."""
    from jobs.train import main
    from training.driver import job, session

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "connect", lambda *a, **k: False)
    monkeypatch.setattr("jobs.train.connect", lambda *a, **k: False)
    monkeypatch.setattr(job, "run", interrupted)
    argv = ["--data", str(small_tree), "--storage-path", str(tmp_path), "--name", "early", "--quiet"]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.startswith("stopped: interrupted outside training; to go on: ") and err.count("\n") == 1, err
    assert "--name early" in err and "Traceback" not in err


@pytest.mark.ray
@pytest.mark.parametrize("after_s", [0.0, 1.5])
def test_sigterm_while_ray_starts_is_one_line_and_exit_143(small_tree, tmp_path, after_s):
    """A scheduler cancels the job as it starts, the job a shell script's background job (SIGINT
    ignored): SIGTERM as `import ray` runs (0 s after the settings are printed) or inside ray.init
    (1.5 s). Ray's handler there exited 15 without a word, and before it Python's default ended the
    process (-15); SIGTERM between the start and the trainer, passed on as an ignored SIGINT, was
    lost and the run trained to its end. Now the same line as Ctrl-C, exit 143, no process left."""
    args = [sys.executable, "-m", "jobs.train", "--data", str(small_tree), "--storage-path", str(tmp_path)]
    ignore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731  (`cmd &` in a script)
    job = subprocess.Popen(
        [*args, "--name", "cancelled", "--epochs", "1", "--small-stem", TEST_STEM],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignore_sigint,
    )  # fmt: skip
    for line in job.stdout:  # the settings' table ends with `sampler`; connect() comes next
        if line.lstrip().startswith("sampler"):
            break
    time.sleep(after_s)
    ours = descendants(job.pid)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 143, out[-2000:] + err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith("stopped: terminated (SIGTERM) while Ray started; to start again: "), err[-3000:]
    rerun = f"-m jobs.train --data {small_tree} --storage-path {tmp_path} --epochs 1 --small-stem {TEST_STEM}"
    assert line.endswith(f"{rerun} --name cancelled"), line
    _gone(ours | descendants(job.pid))


def test_sigterm_or_ctrl_c_while_the_inputs_are_checked_is_one_line(
    small_tree, tmp_path, capsys, monkeypatch, fresh_signals
):
    """A real SIGTERM to this process, and Ctrl-C, while jobs.train lists its data (minutes for a bucket
    of millions of images): Python's default ended the process (-15) and Ctrl-C gave a traceback."""
    from jobs import train as train_job

    def sigterm_while_listing(cfg):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        pytest.fail("SIGTERM did not stop the run")

    def ctrl_c_while_listing(cfg):
        raise KeyboardInterrupt

    argv = ["--data", str(small_tree), "--storage-path", str(tmp_path), "--name", "early"]
    for stop, code, how in (
        (sigterm_while_listing, 143, "terminated (SIGTERM)"),
        (ctrl_c_while_listing, 130, "interrupted"),
    ):
        monkeypatch.setattr(train_job, "prepare", stop)
        assert train_job.main(argv) == code
        said = f"stopped: {how} while the inputs were checked; nothing was trained; run the same command again\n"
        assert capsys.readouterr().err == said
    assert list(tmp_path.iterdir()) == []
