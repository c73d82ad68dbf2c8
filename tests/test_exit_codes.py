"""The exit codes jobs.train promises once Ray has started (its docstring; README.md, "Exit
codes"), through the CLI as a user meets them: 2 for bad input found on the cluster (a
--strict tree with a bad file, a plan the cluster cannot hold), 1 for training that failed;
each is one `error:` line on stderr and no traceback. (A last checkpoint another version wrote, exit 1:
tests/test_interruptions.py, on the run whose damaged checkpoint is passed over.)"""

from __future__ import annotations

import pytest

from tests.conftest import TEST_STEM, write_tree


@pytest.fixture(scope="module")
def small_tree(tmp_path_factory):
    return write_tree(tmp_path_factory.mktemp("exit-data"), {"a": 8, "b": 8})


def _main(argv, capsys) -> tuple[int, str]:
    """jobs.train.main's exit code and its stderr, on the session's cluster (connect keeps it)."""
    from jobs.train import main

    code = main(argv)
    return code, capsys.readouterr().err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


def test_strict_on_a_tree_with_a_bad_file_exits_2_with_one_line(ray_cluster, small_tree, tmp_path, capsys):
    tree = tmp_path / "tree"
    write_tree(tree, {"a": 4, "b": 4})
    (tree / "a" / "bro\nken.png").write_bytes(b"no image in here\n")  # a newline in its name, as Linux allows
    argv = ["--data", str(tree), "--strict", "--epochs", "1", "--batch-size", "4", "--storage-path", str(tmp_path)]
    code, err = _main([*argv, "--name", "strict", "--quiet"], capsys)
    line = _one_error_line(err)
    assert code == 2, err[-3000:]
    assert line.startswith("error: 1 unreadable image(s), e.g. ") and "drop --strict" in line
    assert "bro\\nken.png" in line
    assert err.count("\n") == 1, err  # the name's newline is written as \n: the error stays one line
    assert not (tmp_path / "strict" / "metrics.csv").exists()  # nothing was trained
    # the folder that bad_files.csv went to is the run's: a --fresh rerun may remove it
    from training import storage

    assert storage.is_run_dir(str(tmp_path / "strict"))


def test_a_plan_the_cluster_cannot_hold_exits_2_with_one_line(ray_cluster, small_tree, tmp_path, capsys):
    """The session's cluster has 4 CPUs: 3 workers of 2 CPUs each are refused once Ray says so."""
    argv = ["--data", str(small_tree), "--num-workers", "3", "--cpus-per-worker", "2", "--epochs", "1"]
    code, err = _main([*argv, "--storage-path", str(tmp_path), "--name", "big", "--quiet"], capsys)
    line = _one_error_line(err)
    assert code == 2, err[-3000:]
    assert line == (
        "error: --num-workers 3 x 2 CPU each needs 6 CPUs but the cluster has at most 4; lower --num-workers or "
        "--cpus-per-worker"
    )
    assert not (tmp_path / "big" / "config.json").exists()  # refused before the run began


def test_a_loss_that_turns_non_finite_exits_1_with_one_line_and_no_model(ray_cluster, small_tree, tmp_path, capsys):
    """--lr 1e30: before this check the run trained its epochs on nan weights and exited 0 "done"."""
    argv = ["--data", str(small_tree), "--epochs", "1", "--batch-size", "4", "--lr", "1e30", "--warmup-epochs", "0"]
    argv += ["--small-stem", TEST_STEM]
    code, err = _main([*argv, "--storage-path", str(tmp_path), "--name", "nan", "--quiet"], capsys)
    line = _one_error_line(err)
    assert code == 1, err[-3000:]
    assert line.startswith("error: training failed: the training loss became non-finite (nan or inf) at step "), line
    assert "lower --lr" in line and not (tmp_path / "nan" / "model.pt").exists()


def test_ray_that_does_not_start_is_one_line_and_exit_1(small_tree, tmp_path, capsys, monkeypatch):
    """ray.init's own failures (a node that timed out starting on a loaded machine, an address with no
    cluster) are a fault outside the job: one line naming what was asked and where to look."""
    from training.driver import session

    def fails(*args, **kwargs):
        raise Exception("The current node timed out during startup. This could happen because ...\nmore")

    monkeypatch.setattr(session, "connect", fails)
    monkeypatch.setattr("jobs.train.connect", fails)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, err = _main(["--data", str(small_tree), "--storage-path", str(tmp_path), "--name", "r", "--quiet"], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err == (
        "error: Ray did not start: The current node timed out during startup. This could happen because ...; its "
        "logs are in /tmp/ray/session_latest/logs; on a busy machine a second try often starts\n"
    )
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    code, err = _main(["--data", str(small_tree), "--storage-path", str(tmp_path), "--name", "r", "--quiet"], capsys)
    assert code == 1 and "Ray did not start: joining RAY_ADDRESS=10.0.0.9:6379: The current node" in err, err
