"""A node lost under a running job, on clusters of several nodes (ray.cluster_utils.Cluster), the
job run as a user runs it against a cluster: `python -m jobs.train` with RAY_ADDRESS. Each test
first checks that the fault hit what it is meant to hit, then what the run did and said."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TEST_STEM, registered_checkpoint, write_tree

REPO = Path(__file__).resolve().parents[1]
# what the console of a clean run, or of one that survived a fault, must not show
NOISE = re.compile(
    r"WARNING|Warning|Traceback|\(raylet\)|\(pid=gcs_server\)|state-dump|RayTrainWorker|Progress bars|"
    r"execution finished"
)

pytestmark = pytest.mark.own_cluster


@pytest.fixture()
def cluster(own_cluster):
    """A cluster of this test's own; the test adds its nodes."""
    from ray.cluster_utils import Cluster

    made = []

    def make(head_cpus: int):
        # the GCS declares a node that stopped answering dead after 3 missed checks of 1 s (Ray's
        # default: 5 of 3 s), so a killed node is named as lost sooner
        checks = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
        made.append(Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "_system_config": checks}))
        return made[-1]

    yield make
    import ray

    ray.shutdown()  # the test's own connection, for Ray's state API
    for c in made:
        c.shutdown()


class Job:
    """`python -m jobs.train --FLAG VALUE ...` (or another of the jobs: `module`) against `address`,
    flags as keywords (epochs=2), its output in a file (a pipe could fill up)."""

    def __init__(self, address: str, tmp: Path, module: str = "jobs.train", name: str = "lost", **flags):
        args = [str(a) for flag, value in flags.items() for a in (f"--{flag.replace('_', '-')}", value)]
        self.out = tmp / "console.txt"
        self.runs = tmp / "runs"
        env = {**os.environ, "RAY_ADDRESS": address}
        cmd = [sys.executable, "-m", module, "--storage-path", str(self.runs), "--name", name, *args]
        with self.out.open("w") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the job did not end within {timeout:.0f} s:\n{self.text()[-3000:]}") from None

    def text(self) -> str:
        return self.out.read_text()

    def summary(self) -> dict:
        return json.loads((self.runs / "lost" / "summary.json").read_text())


def _start(cluster, tmp_path, *, head_cpus: int, node_cpus: int, per_class: int, **flags):
    """A head and one more node (the one the test removes), a tree of two classes, and the job
    on them: (head, node, job)."""
    head = cluster(head_cpus)
    doomed = head.add_node(num_cpus=node_cpus)
    head.wait_for_nodes()
    data = write_tree(tmp_path / "data", {"a": per_class, "b": per_class})
    flags.pop("before", lambda: None)()  # changes to the tree before the job starts
    flags = {"batch_size": 16, "val_fraction": 0.25, "small_stem": TEST_STEM} | flags
    return head, doomed, Job(head.address, tmp_path, data=str(data), **flags)


def _connect(address: str):
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    return ray


def _actors_by_class(address: str) -> dict[str, str]:
    """{class name: node id} of the alive actors."""
    from ray.util.state import list_actors

    _connect(address)
    return {
        a.class_name: a.node_id for a in list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True)
    }


def _wait_until(condition, what: str, job: Job, timeout: float = 240):
    deadline = time.time() + timeout
    while time.time() < deadline and job.alive():
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} never happened:\n{job.text()[-3000:]}")


def _train_worker_on(address: str, node_id: str) -> bool:
    from ray.util.state import list_actors

    _connect(address)
    workers = list_actors(
        address=address, filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")], detail=True
    )
    return any(w.node_id == node_id for w in workers)


def test_a_lost_worker_node_is_told_in_one_line_and_the_run_completes_on_its_replacement(cluster, tmp_path):
    """A spot node taken back: killed (no shutdown), a new node 5 s later. The job's own actors
    live with the driver, so the node that goes holds none of them."""
    broken = tmp_path / "data" / "a" / "broken.png"  # reported before the loss: still listed after it
    head, doomed, job = _start(
        cluster,
        tmp_path,
        head_cpus=2,
        node_cpus=2,
        per_class=48,
        epochs=2,
        num_workers=2,
        max_failures=2,
        before=lambda: broken.write_bytes(b"not a png"),
    )
    run_dir = job.runs / "lost"
    _wait_until(lambda: registered_checkpoint(run_dir) >= "checkpoint_epoch_0001", "epoch 1's checkpoint", job)
    actors = _actors_by_class(head.address)
    driver_node = head.head_node.node_id
    for name in ("EpochClock", "BadFileLog", "RunStatus"):
        assert actors.get(name) == driver_node, (name, actors)  # with the driver: the lost node cannot take them
    assert _train_worker_on(head.address, doomed.node_id)  # the fault hits a train worker
    head.remove_node(doomed, allow_graceful=False)  # the fault: the machine is gone
    time.sleep(5)
    head.add_node(num_cpus=2)
    code = job.wait(600)
    text = job.text()
    assert code == 0, text[-4000:]

    summary = job.summary()
    (fault,) = summary["faults"]
    assert fault["kind"] == "node lost" and doomed.node_id[:8] in fault["node"], fault
    assert fault["checkpoint"].endswith("checkpoint_epoch_0001") and fault["epoch"] == 2, fault
    (line,) = [line for line in text.splitlines() if line.startswith("fault:")]
    assert re.fullmatch(
        rf"fault: node lost: \S+ \(node {doomed.node_id[:8]}\) at epoch 2, step \d+; resuming from "
        r"checkpoint_epoch_0001 \(1 more allowed by --max-failures\)",
        line,
    ), line
    assert doomed.node_id in (run_dir / "faults.log").read_text()  # the detail, with Ray's word on the node
    assert summary["epochs"] == 2 and summary["resumed_at_epochs"] == [2]
    assert all(c["exactly_once"] for c in summary["coverage"]), summary["coverage"]
    assert summary["bad_files"] == 1 and "broken.png" in (run_dir / "bad_files.csv").read_text()
    after = text.split(line, 1)[1]  # a plan made again says so, and differs from the first
    replans = [p for p in after.splitlines() if p.startswith("plan: ")]
    assert all(p.endswith("(made again for the nodes alive now)") for p in replans), replans
    noisy = [line for line in text.splitlines() if NOISE.search(line)]
    assert not noisy, noisy  # a joined cluster: only what the user can act on


def test_a_lost_node_that_nothing_replaces_stops_the_run_with_what_is_missing(cluster, tmp_path):
    """The two train workers need a CPU each; after the loss the cluster has one CPU left."""
    head, doomed, job = _start(
        cluster,
        tmp_path,
        head_cpus=1,
        node_cpus=2,
        per_class=48,
        epochs=2,
        num_workers=2,
        cpus_per_worker=1,
        node_wait_s=5,
    )
    _wait_until(lambda: _train_worker_on(head.address, doomed.node_id), "a train worker on the node", job)
    head.remove_node(doomed)  # the fault, and no node comes
    gone = time.time()
    code = job.wait(180)
    text = job.text()
    assert code == 1, text[-4000:]
    assert time.time() - gone < 120  # bounded: the wait, Ray's word on the node, a few seconds more
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"error: training failed: node lost: \S+ \(node {doomed.node_id[:8]}\) (before the first step|at epoch 1, "
        r"step \d+), and for 5 s no plan fitted the nodes left: --num-workers 2 x 1 CPU each needs 2 CPUs but the "
        r"cluster has at most 1; lower --num-workers or --cpus-per-worker, or add a node \(--node-wait-s: how long "
        r"to wait for one\); details in \S+/faults\.log",
        last,
    ), last
    assert "Traceback" not in text


def _data_tasks_on(address: str, node_id: str) -> int:
    """Ray Data tasks (reads fused with the augment call) that ran or run on the node."""
    from ray.util.state import list_tasks

    _connect(address)
    tasks = list_tasks(address=address, filters=[("node_id", "=", node_id)], detail=True, limit=10_000)
    return sum("ReadImages" in t.name for t in tasks)


def test_losing_the_node_that_augments_trains_on_nothing_twice_unreported(cluster, tmp_path):
    """The train worker holds the whole head, so every read and augment task, and the blocks they
    make, are on the other node, which goes in epoch 2 (of 2); a new one joins 5 s later. Ray Data's
    lineage rebuilds what was lost, or the run restarts from the checkpoint: either way each
    epoch trains on every image, and a repeat shows in summary.json and on the console."""
    head, doomed, job = _start(
        cluster,
        tmp_path,
        head_cpus=2,
        node_cpus=1,
        per_class=64,
        epochs=2,
        num_workers=1,
        cpus_per_worker=2,
        augment_batch_size=16,
    )
    run_dir = job.runs / "lost"
    _wait_until(lambda: registered_checkpoint(run_dir) >= "checkpoint_epoch_0001", "epoch 1's checkpoint", job)
    assert not _train_worker_on(head.address, doomed.node_id) and _data_tasks_on(head.address, doomed.node_id) > 0
    head.remove_node(doomed)  # the fault
    time.sleep(5)
    head.add_node(num_cpus=1)
    code = job.wait(600)
    text = job.text()
    assert code == 0, text[-4000:]
    summary = job.summary()
    assert summary["epochs"] == 2
    for cov in summary["coverage"]:
        assert cov["every_image"] and cov["missing"] == 0, cov
        if not cov["exactly_once"]:  # a redelivered block: reported, never silent
            assert f"warning: epoch {cov['epoch']} trained on {cov['seen']} rows" in text, text[-3000:]
    for fault in summary["faults"]:  # where Ray Data could not rebuild, a restart said so
        assert fault["checkpoint"].endswith("checkpoint_epoch_0001"), fault
    noisy = [line for line in text.splitlines() if NOISE.search(line)]
    assert not noisy, noisy


def test_a_lost_node_inside_a_sweep_costs_at_most_its_trial_and_the_sweep_ends(cluster, tmp_path):
    """`python -m jobs.tune` against a cluster of two nodes, two trials at once, one node each; the
    node of one trial's train worker goes and nothing replaces it. The trials' drivers live on the
    head, so the loss reaches the trial's run, not Tune's: the run resumes or stops in its own line
    (--node-wait-s 5) within its share of the nodes left, never in the other trial's; the other trial
    runs out, and the sweep ends listing both."""
    head = cluster(2)
    doomed = head.add_node(num_cpus=2)
    head.wait_for_nodes()
    data = write_tree(tmp_path / "data", {"a": 32, "b": 32})
    space = tmp_path / "space.yaml"
    space.write_text("lr: grid([0.05, 0.1])\n")
    job = Job(
        head.address,
        tmp_path,
        module="jobs.tune",
        name="sw",
        data=data,
        space=space,
        trials=1,
        max_concurrent=2,
        scheduler="none",
        epochs=4,
        batch_size=16,
        val_fraction=0.25,
        small_stem=TEST_STEM,
        node_wait_s=5,
    )
    _wait_until(lambda: _train_worker_on(head.address, doomed.node_id), "a train worker on the node", job)
    trial_drivers = _trial_drivers(head.address)
    head.remove_node(doomed, allow_graceful=False)  # the fault, and no node comes
    code = job.wait(300)
    text = job.text()
    assert code == 0, text[-4000:]
    assert len(trial_drivers) == 2 and set(trial_drivers) == {head.head_node.node_id}, trial_drivers
    with open(job.runs / "sw" / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and {float(r["lr"]) for r in rows} == {0.05, 0.1}, rows
    assert any(r["status"] == "finished" and r["epochs"] == "4" for r in rows), rows
    hit = [r for r in rows if int(r["faults"]) or r["status"] == "failed"]
    assert hit, rows  # the node held a trial's train worker
    for row in hit:  # resumed to the end, its fault on the console; or failed, with the job's own line
        if row["status"] == "finished":
            fault = rf"^{row['trial']} fault: node lost: .+; (resuming|restarting) from .+ by --max-failures\)$"
            assert re.search(fault, text, re.M), text
        else:
            assert row["status"] == "failed" and "node lost" in row["error"], row
            assert re.search(rf"^{row['trial']} failed: .*node lost", text, re.M), text
    assert "Traceback" not in text and "ERROR" not in text, text[-4000:]
    assert text.strip().splitlines()[-1].startswith("sweep: "), text[-2000:]


def _trial_drivers(address: str) -> list[str]:
    """The nodes of the alive Tune trials' own actors (a function trainable's class)."""
    from ray.util.state import list_actors

    _connect(address)
    alive = list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True)
    return [a.node_id for a in alive if a.class_name in ("ImplicitFunc", "run_trial")]
