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


# what a train worker that Ray Train stopped with SIGTERM while it imported printed on a joined
# run's console after a node loss (tests/test_node_loss.py, seen once in a suite run)
STOPPED_WHILE_IMPORTING = [
    "Exception ignored in: <function _get_module_lock.<locals>.cb at 0x7facc3e37920>",
    "Traceback (most recent call last):",
    '  File "<frozen importlib._bootstrap>", line 198, in cb',
    '  File "/venv/lib/python3.11/site-packages/ray/_private/worker.py", line 1063, in sigterm_handler',
    "    raise_sys_exit_with_custom_error_message(",
    '  File "python/ray/_raylet.pyx", line 712, in ray._raylet.raise_sys_exit_with_custom_error_message',
    "SystemExit: 1",
]
A_REAL_ERROR = [
    "Traceback (most recent call last):",
    '  File "/work/augment/ops.py", line 12, in apply',
    "    raise ValueError('bad size')",
    "ValueError: bad size",
]


def test_only_the_tracebacks_of_rays_sigterm_handler_leave_the_console():
    from training.driver.session import without_stop_tracebacks

    lines = ["before", *STOPPED_WHILE_IMPORTING, *A_REAL_ERROR, *STOPPED_WHILE_IMPORTING[1:], "after"]
    assert without_stop_tracebacks(lines) == ["before", *A_REAL_ERROR, "after"]
    exit_elsewhere = [*A_REAL_ERROR[:3], "SystemExit: 1"]  # a SystemExit that Ray's handler did not raise
    assert without_stop_tracebacks(exit_elsewhere) == exit_elsewhere
    cut_short = STOPPED_WHILE_IMPORTING[:4]  # a batch that ends inside the traceback: printed as it came
    assert without_stop_tracebacks(cut_short) == cut_short


def test_the_driver_prints_a_workers_output_without_rays_sigterm_traceback(monkeypatch, capsys):
    """Through Ray's own printing handler, as ray.init(log_to_driver=True) installs it (a dispatcher of
    the test's own, so the session's cluster keeps its handler)."""
    import functools

    from ray._private import ray_logging, worker

    from training import ray_private
    from training.driver.session import without_stop_tracebacks

    dispatcher = ray_logging.WorkerStandardStreamDispatcher()
    dispatcher.add_handler("ray_print_logs", functools.partial(worker.print_to_stdstream, ignore_prefix=False))
    monkeypatch.setattr(ray_logging, "global_worker_stdstream_dispatcher", dispatcher)
    batch = {"ip": "192.0.2.1", "pid": 4810, "is_err": True, "actor_name": "", "task_name": ""}
    ray_private.filter_worker_output(without_stop_tracebacks)
    ray_private.filter_worker_output(without_stop_tracebacks)  # twice: one filter
    dispatcher.emit(batch | {"lines": STOPPED_WHILE_IMPORTING})
    dispatcher.emit(batch | {"lines": ["a line of the worker's own", *A_REAL_ERROR]})
    err = capsys.readouterr().err
    assert "sigterm_handler" not in err and "SystemExit" not in err and "Exception ignored" not in err, err
    printed = [line for line in err.splitlines() if "(pid=4810" in line]  # with Ray's prefix, as Ray prints them
    assert [line.split("m ", 1)[1] for line in printed] == ["a line of the worker's own", *A_REAL_ERROR], err
    assert len(dispatcher.handlers) == 1


def test_once_the_job_stops_rays_teardown_lines_are_not_printed(monkeypatch, capsys):
    """A predict stopped by SIGTERM printed its `stopped:` line, then the GCS's "Failed to kill actor
    ... Socket closed" as its cluster went down. From the stop on, the driver prints none of Ray's
    lines; a Python caller's sweep span, or the next job's connect in this process, ends the mute."""
    import functools

    from ray._private import ray_logging, worker

    from training import ray_private
    from training.driver.session import mute_ray_output, shown_lines, sigterm_as_interrupt

    dispatcher = ray_logging.WorkerStandardStreamDispatcher()
    dispatcher.add_handler("ray_print_logs", functools.partial(worker.print_to_stdstream, ignore_prefix=False))
    monkeypatch.setattr(ray_logging, "global_worker_stdstream_dispatcher", dispatcher)
    ray_private.filter_worker_output(shown_lines)
    gcs = {"ip": "192.0.2.1", "pid": "gcs_server", "is_err": True, "actor_name": "", "task_name": ""}
    teardown = "gcs_actor_scheduler.cc:538: Failed to kill actor 05e6, return status: Invalid: Socket closed"
    with sigterm_as_interrupt():
        dispatcher.emit(gcs | {"lines": ["before the stop"]})
        mute_ray_output()
        dispatcher.emit(gcs | {"lines": [teardown]})
        err = capsys.readouterr().err
        assert "before the stop" in err and "Failed to kill" not in err, err
    dispatcher.emit(gcs | {"lines": ["a later run's line"]})
    assert "a later run's line" in capsys.readouterr().err
    # a job stopped in this process (a test's, a notebook's): the next job's connect shows Ray's lines again
    import ray

    from training.driver import session

    mute_ray_output()
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(session, "owns_cluster", lambda: True)
    session.connect()
    dispatcher.emit(gcs | {"lines": ["the next job's line"]})
    assert "the next job's line" in capsys.readouterr().err
