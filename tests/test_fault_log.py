"""How the driver names a fault and decides to go on (training/driver/faults.py), from the errors
Ray Train 2.60 hands back; no cluster needed. tests/test_node_loss.py has the real faults."""

from __future__ import annotations

import time

import pytest
import ray
from ray.train import ControllerError, WorkerGroupError
from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
from ray.train.v2._internal.util import construct_user_exception_with_traceback

from training.driver.faults import Fault, FaultLog, describe


def _wrapped(exc: BaseException):
    """A worker's exception as Ray Train wraps it, with its traceback."""
    try:
        raise exc
    except BaseException as e:
        return construct_user_exception_with_traceback(e)


def _group(*excs) -> WorkerGroupError:
    return WorkerGroupError("failed", {rank: _wrapped(e) for rank, e in enumerate(excs)})


GLOO = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:24258")
# what Ray Train's controller hands back when a worker actor died while its group started (its node went)
NOT_STARTED = ControllerError(WorkerGroupStartupFailedError("At least one of the worker actors failed to initialize."))


@pytest.mark.parametrize(
    "error, lost, kind, node",
    [
        (_group(GLOO, GLOO), {"5d175dc4cbb2ab21": "10.0.0.7"}, "node lost", "10.0.0.7 (node 5d175dc4)"),
        (
            _group(ray.exceptions.ActorDiedError(), GLOO),
            {},
            "train worker died",
            None,
        ),
        (_group(RuntimeError("Task was killed due to the node running low on memory.")), {}, "out of memory", None),
        (_group(ValueError("a bug")), {}, "error", None),
        (NOT_STARTED, {}, "workers did not start", None),
        (NOT_STARTED, {"5d175dc4cbb2ab21": "10.0.0.7"}, "node lost", "10.0.0.7 (node 5d175dc4)"),
    ],
    ids=["node", "worker", "oom", "error", "not-started", "not-started-node"],
)
def test_a_fault_is_named_by_what_failed(error, lost, kind, node):
    progress = {0: (1, 40, 3.0), 1: (1, 32, 2.0)}  # 0-based epoch 1, images so far per rank
    fault = describe(error, lost, progress, "/runs/r/checkpoint_epoch_0001", per_worker=8)
    assert (fault.kind, fault.node, fault.epoch, fault.step) == (kind, node, 2, 5)
    assert fault.checkpoint.endswith("checkpoint_epoch_0001")
    assert "\n" not in fault.message and len(fault.message) <= 200


def test_the_fault_line_names_the_node_the_step_the_checkpoint_and_the_failures_left():
    fault = Fault(0.0, "node lost", "10.0.0.7 (node 5d175dc4)", 2, 37, "/runs/r/checkpoint_epoch_0001", "gone")
    assert fault.line(1) == (
        "fault: node lost: 10.0.0.7 (node 5d175dc4) at epoch 2, step 37; resuming from checkpoint_epoch_0001 "
        "(1 more allowed by --max-failures)"
    )
    early = Fault(0.0, "train worker died", None, None, None, None, "The actor is dead because its worker died")
    assert early.line(-1) == (
        "fault: train worker died: The actor is dead because its worker died before the first step; restarting "
        "from epoch 1 (--max-failures -1: no limit)"
    )


def test_the_run_goes_on_until_max_failures_are_used_up_and_never_after_the_same_error_twice(tmp_path):
    log = FaultLog(str(tmp_path), max_failures=2)
    node = Fault(0.0, "node lost", "10.0.0.7 (node 5d175dc4)", 2, 3, None, "gone")
    for expected_left in (1, 0):
        log.add(node, _group(GLOO), {})
        assert log.give_up(node) is None and log.left == expected_left
    log.add(node, _group(GLOO), {})
    stop = log.give_up(node)
    assert stop.startswith("node lost: 10.0.0.7 (node 5d175dc4) at epoch 2, step 3; --max-failures 2 used up")
    assert stop.endswith(f"details in {tmp_path}/faults.log")
    text = (tmp_path / "faults.log").read_text()
    assert text.count("=== ") == 3 and "Connection closed by peer" in text and "Traceback" in text

    bug = FaultLog(str(tmp_path / "b"), max_failures=-1)
    error = Fault(0.0, "error", None, 1, 1, None, "ValueError: a bug")
    bug.add(error, _group(ValueError("a bug")), {})
    assert bug.give_up(error) is None  # once may be a passing fault
    bug.add(error, _group(ValueError("a bug")), {})
    assert "the same error twice in a row" in bug.give_up(error)
    assert [f["kind"] for f in bug.records()] == ["error", "error"]


def test_only_a_fault_where_every_rank_lost_a_peer_waits_for_ray_to_declare_a_node_dead(monkeypatch):
    from training.driver import faults

    monkeypatch.setattr(faults, "alive_nodes", lambda: {"a": "10.0.0.1", "b": "10.0.0.2"})
    nodes = {"a": "10.0.0.1", "b": "10.0.0.2"}
    t0 = time.monotonic()
    assert faults.lost_nodes(nodes, _group(ValueError("a bug"), GLOO), wait_s=30) == {}  # a bug: no wait
    assert time.monotonic() - t0 < 1
    assert faults.lost_nodes(nodes, _group(GLOO, GLOO), wait_s=1.5) == {}  # only peers gone: waited for Ray
    assert time.monotonic() - t0 >= 1.5
    monkeypatch.setattr(faults, "alive_nodes", lambda: {"a": "10.0.0.1"})
    assert faults.lost_nodes(nodes, _group(GLOO, GLOO), wait_s=30) == {"b": "10.0.0.2"}


def test_a_controller_error_is_named_by_the_controller_failure_inside_it():
    """The CI failure of stop 66: ControllerError's own first line is the same for every cause, so two
    different controller failures counted as "the same error twice in a row"."""
    fault = describe(NOT_STARTED, {}, {}, None, per_worker=8)
    assert fault.message == "WorkerGroupStartupFailedError: At least one of the worker actors failed to initialize."
    other = describe(ControllerError(RuntimeError("a callback failed")), {}, {}, None, per_worker=8)
    assert (other.kind, other.message) == ("error", "RuntimeError: a callback failed")


def test_workers_that_did_not_start_wait_for_ray_to_declare_their_node_dead(monkeypatch):
    """A worker group that fails to start because its node went reaches the driver before the GCS
    has missed enough health checks: the wait names the node, and the next plan leaves it out."""
    from training.driver import faults

    answers = iter([{"a": "10.0.0.1", "b": "10.0.0.2"}])  # the first look; b is dead at the next, 1 s on
    monkeypatch.setattr(faults, "alive_nodes", lambda: next(answers, {"a": "10.0.0.1"}))
    nodes = {"a": "10.0.0.1", "b": "10.0.0.2"}
    assert faults.lost_nodes(nodes, NOT_STARTED, wait_s=30) == {"b": "10.0.0.2"}


def test_a_run_stopped_by_an_error_says_error_training_failed_once(tmp_path):
    """Issue 53: "error: training failed: error: RuntimeError: PytorchStreamReader failed ..."."""
    from training.config import error_line

    log = FaultLog(str(tmp_path), max_failures=-1)
    cause = RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")
    for _ in range(2):
        fault = describe(_group(cause), {}, {0: (0, 8, 1.0)}, None, per_worker=8)
        log.add(fault, _group(cause), {})
        stop = log.give_up(fault)
    line = error_line(f"training failed: {stop}")
    assert line.startswith(
        "error: training failed: RuntimeError: PytorchStreamReader failed reading zip archive: failed finding "
        "central directory at epoch 1, step 1; the same error twice in a row"
    ), line
    assert line.count("error:") == 1 and fault.line(-1).startswith("fault: RuntimeError: PytorchStreamReader")
