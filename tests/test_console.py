"""What a user sees: the progress bar (ranks -> board -> the driver's terminal) and the console
of a clean run under a pseudo-terminal. The bar with several workers is checked on the
two-worker run in tests/test_train_job.py; its absence from logs in the Ctrl-C test
(tests/test_faults.py) and the `ray job submit` test (tests/test_cluster.py)."""

from __future__ import annotations

import io
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import Terminal, bar_frames, write_tree
from training.driver.console import ConsoleFollower, terminal_size
from training.status import EpochProgress, RunStatus

REPO = Path(__file__).resolve().parents[1]


def test_the_driver_sums_the_ranks_and_closes_the_bar_before_the_epoch_line():
    board, screen, lines = RunStatus(), Terminal(), []
    follower = ConsoleFollower(board.read, total=64, epochs=2, log=lines.append, stream=screen, sizes=[24, 32])
    ranks = [EpochProgress(board.post, rank=r, epoch=0, interval_s=0) for r in (0, 1)]
    for step in range(1, 4):
        for r, bar in enumerate(ranks):
            bar.update(8, [float(step * 8 * (r + 1))])  # rank 1's loss is twice rank 0's
        follower.poll()
    board.say(0, "epoch   1/2  24px  loss 1.5000")
    board.post(1, 0, 32, 64.0)  # a rank's last count can arrive with the line; the bar shows it, then closes
    follower.poll()
    board.post(0, 0, 32, 32.0)  # and later: the epoch's line is out, no bar comes back for it
    follower.poll()
    frames = bar_frames(screen.getvalue())
    assert [n for _, n, _ in frames if n] == [16, 32, 48, 56]  # both ranks' images: the global count
    assert frames[-1] == (1, 56, round((24 + 64) / 56, 4)) and frames[0][2] == 1.5  # running loss, both ranks
    assert " 24px:" in screen.getvalue() and lines == ["epoch   1/2  24px  loss 1.5000"]
    assert screen.getvalue().endswith("\r")  # leave=False: the bar line is cleared for the epoch line
    EpochProgress(board.post, rank=0, epoch=1, interval_s=0).update(8, [4.0])
    follower.poll()
    assert bar_frames(screen.getvalue())[-1] == (2, 8, 0.5) and " 32px:" in screen.getvalue()


def test_a_terminal_without_a_size_gets_80_columns():
    primary, secondary = os.openpty()  # a pseudo-terminal reports 0 x 0 until someone sets its size
    try:
        with open(secondary, "w", closefd=False) as tty:
            assert os.get_terminal_size(secondary) == (0, 0) and terminal_size(tty) == (80, 24)
    finally:
        os.close(primary), os.close(secondary)
    assert terminal_size(io.StringIO()) == (80, 24)


def run_in_pty(args: list[str], timeout: float = 300) -> tuple[int, list[tuple[float, str]]]:
    """Run a command with a pseudo-terminal as its stdin, stdout and stderr, as a user's shell
    would (with no window size, as `script` makes one from a non-terminal); returns its exit
    code and what it wrote, in the chunks the terminal received, with their arrival times."""
    primary, secondary = os.openpty()
    proc = subprocess.Popen(args, cwd=REPO, stdin=secondary, stdout=secondary, stderr=secondary, close_fds=True)
    os.close(secondary)
    chunks, start = [], time.monotonic()
    try:
        while time.monotonic() - start < timeout:
            ready, _, _ = select.select([primary], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(primary, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append((time.monotonic() - start, data.decode(errors="replace")))
        return proc.wait(timeout=60), chunks
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(primary)


@pytest.mark.ray  # its subprocess starts a local Ray cluster, which no fixture says
def test_a_clean_run_on_a_terminal_shows_a_live_bar_and_no_warnings(tmp_path):
    """The job as a user starts it (its own local Ray cluster), on a terminal."""
    data = write_tree(tmp_path / "data", {"a": 50, "b": 50, "c": 50})  # ~120 train images: seconds an epoch
    # batch 4: a 30-step epoch, over which the board posts every 0.5 s whatever the machine's speed
    args = [sys.executable, "-m", "jobs.train", "--data", str(data), "--epochs", "1", "--batch-size", "4"]
    args += ["--augment-actors", "1"]  # an actor pool, whose every start Ray would comment on
    env_address = os.environ.pop("RAY_ADDRESS", None)  # a run of its own, not one joining the tests' cluster
    try:
        code, chunks = run_in_pty(args + ["--storage-path", str(tmp_path / "runs"), "--name", "pty"])
    finally:
        if env_address is not None:
            os.environ["RAY_ADDRESS"] = env_address
    text = "".join(c for _, c in chunks)
    assert code == 0, text[-3000:]
    epoch_line = next(t for t, c in chunks if "epoch   1/1  loss" in c)
    updates = {}  # images -> when the terminal first showed that count, during the epoch
    for t, chunk in chunks:
        for _, images, _ in bar_frames(chunk):
            if t < epoch_line:
                updates.setdefault(images, t)
    assert len(updates) >= 2, f"bar updates during the epoch: {updates}\n{text[-3000:]}"
    assert sorted(updates) == sorted(updates, key=updates.get)  # counts only grow
    # drawn over the epoch, not all at its end: the updates span a good part of the time from the
    # first one to the epoch line (a share of the epoch, so a fast machine or a slow one passes alike)
    assert max(updates.values()) - min(updates.values()) >= 0.25 * (epoch_line - min(updates.values())), updates
    lines = text.replace("\r", "\n").splitlines()
    noisy = [line for line in lines if re.search(r"WARNING|Warning|\] W |\[.* W \d+ \d+\]", line)]
    assert not noisy, noisy  # token auth on without Ray's warning; no notice about the job's own actors
    assert "RayTrainWorker" not in text  # the epoch line comes from the driver, without a worker's prefix
    assert "done: " in text and "validation accuracy" in text


def test_a_train_worker_never_warns_of_the_object_stores_read_only_arrays():
    """Ray Data silences torch's warning about read-only arrays in a way that is not thread-safe;
    the train worker's own filter holds in every thread (training/worker/loop.py quiet_worker_logs)."""
    code = (
        "import numpy as np, torch\n{setup}\na = np.zeros(4, np.uint8); a.setflags(write=False)\ntorch.as_tensor(a)\n"
    )
    runs = {
        setup: subprocess.run(
            [sys.executable, "-W", "error::UserWarning", "-c", code.format(setup=setup)], cwd=REPO, capture_output=True
        )
        for setup in ("from training.worker.loop import quiet_worker_logs; quiet_worker_logs()", "pass")
    }
    quiet, control = runs.values()
    assert quiet.returncode == 0, quiet.stderr.decode()[-2000:]
    assert control.returncode != 0 and b"not writable" in control.stderr  # the warning, where nothing filters it
