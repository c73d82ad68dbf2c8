"""Running where users run: `ray job submit` to a real head node, an autoscaling cluster,
`cluster.yaml` against Ray's own schema, and the storage rule for multi-machine clusters.

The `own_cluster` tests start whole clusters with `ray start` and stop them with `ray stop`;
conftest runs them last, after the shared session cluster is stopped.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from tests.conftest import TEST_STEM, bar_frames, registered_checkpoint, write_tree
from training.config import ConfigError, TrainConfig
from training.driver.planning import Capacity, check_storage, plan_resources

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = str(Path(sys.executable).parent)  # `ray` and the `python` of job entrypoints


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "RAY_DATA_LOG_LEVEL": "WARNING"}
    env.update(extra)
    return env


def _ray(*args, env, timeout=180, check=True):
    out = subprocess.run([f"{VENV_BIN}/ray", *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(
            f"ray {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return out


# --------------------------------------------------------------------------- no cluster needed


def test_cluster_yaml_passes_rays_autoscaler_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((REPO / "cluster.yaml").read_text())
    config = prepare_config(raw)  # fills Ray's defaults; no cloud call
    validate_config(config)  # Ray's JSON schema; raises on any unknown or mistyped field

    assert config["provider"]["type"] == "aws"
    assert config["available_node_types"][config["head_node_type"]]["resources"].get("GPU", 0) == 0
    gpu_types = {k: v for k, v in config["available_node_types"].items() if v["resources"].get("GPU")}
    assert len(gpu_types) >= 2
    assert all(t["min_workers"] == 0 and t["max_workers"] > 0 for t in gpu_types.values())
    spot = {k for k, t in gpu_types.items() if t["node_config"].get("InstanceMarketOptions") == {"MarketType": "spot"}}
    on_demand = {k for k, t in gpu_types.items() if "InstanceMarketOptions" not in t["node_config"]}
    assert spot and {f"{k}_spot" for k in on_demand} == spot  # each GPU type in both markets
    for name in spot:  # the same machine in both markets
        assert gpu_types[name]["node_config"]["InstanceType"] == gpu_types[name[:-5]]["node_config"]["InstanceType"]
    # object storage through an instance profile on every worker: no keys on the nodes
    assert all(t["node_config"]["IamInstanceProfile"] == {"Name": "ray-gpu-augment-worker"} for t in gpu_types.values())
    assert "aws_access_key_id" not in (REPO / "cluster.yaml").read_text().lower()
    assert config["idle_timeout_minutes"] > 0
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "RAY_AUTH_MODE=token" in head_start
    assert all(
        "RAY_AUTH_MODE=token" in " ".join(config[k]) for k in ("head_start_ray_commands", "worker_start_ray_commands")
    )
    assert "~/.ray/auth_token" in config["file_mounts"]  # the token travels as a file
    assert "RAY_AUTH_TOKEN=" not in (REPO / "cluster.yaml").read_text()  # never on a command line


def test_cluster_yaml_schema_check_can_fail():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((REPO / "cluster.yaml").read_text())
    raw["available_node_types"]["gpu_a10g_1x"]["min_workerz"] = 0
    with pytest.raises(Exception, match="min_workerz"):
        validate_config(prepare_config(raw))


def test_local_storage_on_a_multi_machine_cluster_is_refused():
    with pytest.raises(ConfigError, match="local path but the cluster spans 2 machines; use storage every node sees"):
        check_storage("/home/me/runs", Capacity(cpus=16, gpus=2, hosts=2, autoscaling=False))
    check_storage("s3://bucket/runs", Capacity(cpus=16, gpus=2, hosts=2, autoscaling=False))
    check_storage("/home/me/runs", Capacity(cpus=16, gpus=2, hosts=1, autoscaling=False))  # one machine: fine


def test_an_autoscaler_without_published_limits_is_not_refused():
    cap = Capacity(cpus=1, gpus=0, hosts=1, autoscaling=True, bounded=False)
    plan = plan_resources(TrainConfig(device="cuda", num_workers=4), cap)
    assert plan.use_gpu and plan.num_workers == 4 and "wait for new nodes" in cap.note()
    with pytest.raises(ConfigError):  # a static cluster of the same size is refused
        plan_resources(TrainConfig(device="cuda", num_workers=4), Capacity(cpus=1, gpus=0, hosts=1))


def test_a_joined_cluster_refuses_gpu_flags_without_gpus_and_a_worker_bigger_than_its_biggest_node():
    """Issue 53: --augment-gpus on a cluster without GPUs was dropped without a word, and
    --cpus-per-worker beyond every node (but within their sum) reached Ray."""
    no_gpus = Capacity(cpus=8, gpus=0, hosts=2, nodes=((4.0, 0.0), (4.0, 0.0)))
    with pytest.raises(ConfigError, match=r"^--augment-gpus 1: the Ray cluster has no GPUs and cannot get any; drop"):
        plan_resources(TrainConfig(augment_gpus=1), no_gpus)
    with pytest.raises(ConfigError, match=r"^--cpus-per-worker 6: the cluster's biggest node has 4 CPUs and a worker"):
        plan_resources(TrainConfig(cpus_per_worker=6), no_gpus)
    assert plan_resources(TrainConfig(cpus_per_worker=3), no_gpus).cpus_per_worker == 3
    growing = Capacity(cpus=8, gpus=0, hosts=2, autoscaling=True, bounded=False, nodes=((4.0, 0.0), (4.0, 0.0)))
    assert plan_resources(TrainConfig(cpus_per_worker=6), growing).cpus_per_worker == 6  # a bigger node may join


GPU4 = Capacity(cpus=32, gpus=4, hosts=1, autoscaling=False)


def test_gpu_plans_share_or_dedicate_gpus():
    shared = plan_resources(TrainConfig(), GPU4)
    # 4 augment tasks of 1/16 GPU beside each trainer (a quarter of its GPU), or an actor of 1/4 each
    assert (shared.num_workers, shared.gpus_per_worker, shared.augment_actors, shared.augment_gpus) == (
        4,
        0.75,
        0,
        0.0625,
    )
    assert shared.placement == "PACK" and shared.ingest_tasks() == [(1.0, 0.0), (1.0, 0.0625)]
    assert shared.augment_concurrency == 16 and shared.describe().endswith("per split, at most 16 at once")
    actors = plan_resources(TrainConfig(augment_actors=4), GPU4)
    assert (actors.gpus_per_worker, actors.augment_gpus, actors.augment_concurrency) == (0.75, 0.25, 0)
    own = plan_resources(TrainConfig(num_workers=4, augment_gpus=1), Capacity(cpus=64, gpus=8, hosts=1))
    assert (own.gpus_per_worker, own.augment_concurrency) == (1.0, 4)  # a GPU each, on the 4 the trainers leave
    dedicated = plan_resources(TrainConfig(num_workers=2, augment_actors=2, augment_gpus=1), GPU4)
    assert (dedicated.gpus_per_worker, dedicated.augment_gpus) == (1.0, 1.0)
    cpu = plan_resources(TrainConfig(num_workers=2), Capacity(cpus=4, gpus=0, hosts=2, autoscaling=False))
    assert cpu.placement == "SPREAD" and cpu.threads_per_worker == 2


def test_torch_threads_never_outnumber_the_machines_cores(ray_cluster):
    """Nodes that claim more CPUs than their machine has (the shared test cluster: two nodes of 2
    CPUs on one machine) get as many torch threads per worker as the machine has cores for it:
    threads beyond the cores spin against each other and the augment tasks (docs/design.md,
    "Choices and where they were measured")."""
    from training.driver.planning import cluster_capacity, machine_cores

    one_machine = Capacity(cpus=4, gpus=0, hosts=1, nodes=((2.0, 0.0), (2.0, 0.0)), host_cores=2)
    assert [plan_resources(TrainConfig(num_workers=n), one_machine).threads_per_worker for n in (1, 2)] == [2, 1]
    unknown = dataclasses.replace(one_machine, host_cores=0)  # another machine's cores: Ray's CPUs are its cores
    assert [plan_resources(TrainConfig(num_workers=n), unknown).threads_per_worker for n in (1, 2)] == [4, 2]
    given = plan_resources(TrainConfig(num_workers=2, threads_per_worker=3), one_machine)
    assert given.threads_per_worker == 3  # --threads-per-worker is the user's
    here = cluster_capacity()  # this machine's two nodes
    assert (here.cpus, here.hosts, here.host_cores) == (4, 1, machine_cores())
    assert plan_resources(TrainConfig(num_workers=2), here).threads_per_worker == max(1, machine_cores() // 2)


ASK_FROM_A_JOINED_DRIVER = """
import json, os, sys, ray
from ray.train.v2._internal.state.util import is_actor_alive
from training.driver.session import joined_runtime_env

ray.init(address=sys.argv[1], log_to_driver=False, **joined_runtime_env(sys.argv[3] == "verbose"))

@ray.remote(num_cpus=0)
def alive(actor_id):
    return is_actor_alive(actor_id=actor_id, timeout=10), os.environ.get("RAY_ADDRESS", "")

print(json.dumps(ray.get(alive.remote(sys.argv[2]), timeout=120)))
"""


A_NEWER_CLUSTER = """
import sys
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": True, "dashboard_port": 0})
print("up", flush=True)
sys.stdin.read()
cluster.shutdown()
"""


def test_a_joined_runs_workers_ask_their_own_cluster_where_a_newer_one_runs_beside_it(ray_cluster):
    """The question Ray Train's placement-group cleaner asks in a joined run (is the run's controller
    alive?), asked from a worker of the session's cluster while a newer cluster with a dashboard runs
    on the same machine. Ray's state API then asks the newer cluster, finds no such actor, and the
    cleaner removed the placement group of a run that was training (reproduced with `jobs.train` and
    RAY_ADDRESS beside a newer cluster). A joined driver's setup hook (training/driver/session.py
    joined_runtime_env, with --verbose too) makes each worker ask its own cluster."""
    import ray
    from ray.train.v2._internal.state.util import is_actor_alive

    @ray.remote(num_cpus=0)
    def alive(actor_id: str) -> tuple[bool, str]:  # a worker of a driver that joined without the hook
        return is_actor_alive(actor_id=actor_id, timeout=10), os.environ.get("RAY_ADDRESS", "")

    @ray.remote(num_cpus=0)
    class Controller:
        def id(self) -> str:
            return ray.get_runtime_context().get_actor_id()

    controller = Controller.remote()
    actor_id = ray.get(controller.id.remote())
    own = ray.get_runtime_context().gcs_address
    # the newer cluster in a process of its own: ray.cluster_utils' shutdown resets the internal
    # KV client of the process it runs in, which would cut this one off from the session's cluster
    newer = subprocess.Popen(
        [sys.executable, "-c", A_NEWER_CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert newer.stdout.readline().strip() == "up"
        assert not ray.get(alive.remote(actor_id), timeout=120)[0]  # the fault, where nothing says which cluster
        for mode in ("quiet", "verbose"):
            joined = subprocess.run(
                [sys.executable, "-c", ASK_FROM_A_JOINED_DRIVER, own, actor_id, mode],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert joined.returncode == 0, joined.stderr[-3000:]
            assert json.loads(joined.stdout.splitlines()[-1]) == [True, own], (mode, joined.stdout[-2000:])
    finally:
        ray.kill(controller)
        newer.communicate("", timeout=120)  # its stdin closes: it shuts its cluster down


@pytest.mark.parametrize("share,per_gpu,trainer", [(0.125, 2, 0.75), (0.25, 1, 0.75), (0.3, 1, 0.7), (0.02, 12, 0.76)])
def test_augment_gpus_sets_a_tasks_share_and_as_many_run_as_fit_in_a_quarter(share, per_gpu, trainer):
    plan = plan_resources(TrainConfig(augment_gpus=share), GPU4)
    assert (plan.augment_gpus, plan.augment_concurrency) == (share, 4 * per_gpu)
    assert plan.gpus_per_worker == pytest.approx(trainer)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"num_workers": 2, "augment_actors": 8, "augment_gpus": 0.3}, "--augment-actors 8 x 0.3 GPU leave no GPU"),
        ({"augment_gpus": 1}, "--num-workers 4 \\+ 1 augment task\\(s\\) of 1 GPU need 5 GPUs"),
        ({"num_workers": 4, "augment_actors": 2, "augment_gpus": 1}, "need 6 GPUs but the cluster has at most 4"),
        ({"num_workers": 8}, "need 8 GPUs but the cluster has at most 4"),
    ],
)
def test_gpu_plans_that_do_not_fit_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        plan_resources(TrainConfig(**settings), GPU4)


SMALL_CLUSTERS = {  # (CPUs, GPUs) per node
    "1 cpu": [(1, 0)],
    "2 cpus": [(2, 0)],
    "3 cpus": [(3, 0)],
    "4 cpus": [(4, 0)],
    "8 cpus": [(8, 0)],
    "2 nodes x 1 cpu": [(1, 0)] * 2,
    "2 nodes x 2 cpus": [(2, 0)] * 2,
    "3 nodes x 2 cpus": [(2, 0)] * 3,
    "1 gpu, 4 cpus": [(4, 1)],
    "4 gpus, 4 cpus": [(4, 4)],
    "4 gpus, 8 cpus": [(8, 4)],
}


def _workers_per_node(nodes, plan) -> list[int]:
    """Where Ray puts the train workers on these clusters: PACK on the one node; SPREAD one
    per node in turn (the nodes are equal)."""
    if plan.placement == "PACK":
        assert len(nodes) == 1
        return [plan.num_workers]
    return [len(range(i, plan.num_workers, len(nodes))) for i in range(len(nodes))]


def _all_run_at_once(free, tasks) -> bool:
    """Some assignment of the tasks to nodes fits them all (every assignment is tried)."""
    for where in itertools.product(range(len(free)), repeat=len(tasks)):
        use = [[0.0, 0.0] for _ in free]
        for node, (c, g) in zip(where, tasks, strict=True):
            use[node][0] += c
            use[node][1] += g
        if all(u[0] <= f[0] + 1e-9 and u[1] <= f[1] + 1e-9 for u, f in zip(use, free, strict=True)):
            return True
    return False


@pytest.mark.parametrize("cluster", sorted(SMALL_CLUSTERS))
def test_every_plan_the_planner_accepts_leaves_ray_data_room_to_run(cluster):
    """Over worker counts, CPUs per worker and augment actors: a plan either leaves every node's
    workers room and, beside them, room for what Ray Data must run at once (a read/augment
    task, plus an actor pool's actors), or is refused with the numbers and a fix."""
    nodes = SMALL_CLUSTERS[cluster]
    capacity = Capacity(
        cpus=sum(c for c, _ in nodes), gpus=sum(g for _, g in nodes), hosts=1, nodes=tuple(map(tuple, nodes))
    )
    accepted = 0
    for workers, cpus_per_worker, actors in itertools.product(range(5), (0, 1, 2), (0, 2)):
        cfg = TrainConfig(num_workers=workers, cpus_per_worker=cpus_per_worker, augment_actors=actors)
        try:
            plan = plan_resources(cfg, capacity)
        except ConfigError as e:
            assert re.search(r"\d", str(e)) and "lower --" in str(e), str(e)
            continue
        accepted += 1
        counts = _workers_per_node(nodes, plan)
        gpu_share = plan.gpus_per_worker if plan.use_gpu else 0.0
        free = [(c - k * plan.cpus_per_worker, g - k * gpu_share) for (c, g), k in zip(nodes, counts, strict=True)]
        assert all(c >= -1e-9 and g >= -1e-9 for c, g in free), (cluster, cfg, plan.describe())
        on_gpu = plan.augment_actors or (1 if plan.use_gpu else 0)  # actors, or one GPU augment task
        tasks = [(plan.augment_cpus, 0.0)] + [(plan.augment_cpus, plan.augment_gpus)] * on_gpu
        assert _all_run_at_once(free, tasks), (cluster, cfg, plan.describe())
        assert min(plan.cpus_per_worker, plan.augment_cpus) >= 0.25
        assert plan.cpus_per_worker == (cpus_per_worker or plan.cpus_per_worker)  # a given share is kept
    assert accepted


def test_two_workers_on_two_cores_leave_ray_data_half_a_cpu():
    """The plan that hung: 2 workers x 1 CPU on a 2-core machine left Ray Data no CPU."""
    two_cores = Capacity(cpus=2, gpus=0, hosts=1, nodes=((2.0, 0.0),))
    plan = plan_resources(TrainConfig(num_workers=2), two_cores)
    assert (
        plan.describe() == "2 train worker(s) x (0.75 CPU, 1 torch threads), SPREAD; augment tasks x 0.5 CPU per split"
    )
    with pytest.raises(
        ConfigError,
        match=r"^--num-workers 2 x --cpus-per-worker 1 leave Ray Data 0 of the cluster's 2 CPUs, .*"
        r"lower --cpus-per-worker or --num-workers, or drop --cpus-per-worker",
    ):
        plan_resources(TrainConfig(num_workers=2, cpus_per_worker=1), two_cores)
    one = plan_resources(TrainConfig(), two_cores)  # one worker keeps a whole CPU and uses both cores
    assert (one.num_workers, one.cpus_per_worker, one.threads_per_worker, one.augment_cpus) == (1, 1, 2, 0.5)
    with pytest.raises(ConfigError, match="needs 8 CPUs but the cluster has at most 4"):
        plan_resources(TrainConfig(num_workers=4, cpus_per_worker=2), Capacity(cpus=4, gpus=0, hosts=1))


# --------------------------------------------------------------------------- real clusters


@pytest.mark.own_cluster
def test_ray_job_submit_to_a_token_protected_head(own_cluster, tmp_path):
    data = write_tree(tmp_path / "data", {"a": 12, "b": 12})
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = _env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    for quieting in ("RAY_DATA_LOG_LEVEL", "RAY_DATA_LOGGING_CONFIG", "PYTHONWARNINGS"):  # a cluster as Ray starts it
        env.pop(quieting, None)
    port, dash = _free_port(), _free_port()
    _ray(
        "start",
        "--head",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        "--num-cpus=3",
        "--disable-usage-stats",
        env=env,
    )
    try:
        address = f"http://127.0.0.1:{dash}"
        # the head refuses a client without the token, and one with another token, for that reason
        unauthenticated = _ray("job", "list", "--address", address, env=_env(RAY_AUTH_MODE="disabled"), check=False)
        said = unauthenticated.stdout + unauthenticated.stderr
        assert unauthenticated.returncode != 0 and "Unauthorized: Missing authentication token" in said, said[-3000:]
        (tmp_path / "other_token").write_text(secrets.token_hex(32))
        wrong = _env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path / "other_token"))
        wrong_token = _ray("job", "list", "--address", address, env=wrong, check=False)
        said = wrong_token.stdout + wrong_token.stderr
        assert wrong_token.returncode != 0 and "Forbidden: Invalid authentication token" in said, said[-3000:]
        train = ["python", "-m", "jobs.train", "--data", str(data), "--epochs", "20", "--batch-size", "8"]
        train += ["--small-stem", TEST_STEM]
        train += ["--storage-path", str(tmp_path / "runs"), "--name", "submitted", "--val-fraction", "0.25"]
        run_dir = tmp_path / "runs" / "submitted"

        def submit(job_id, *extra):
            said = _ray(
                "job", "submit", "--address", address, "--working-dir", str(REPO), "--entrypoint-num-cpus", "0",
                "--submission-id", job_id, "--no-wait", "--", *train, *extra, env=env,
            )  # fmt: skip
            assert job_id in said.stdout + said.stderr

        def wait_for(job_id, until, timeout=420) -> str:
            """Until `until()` holds or the job ends: its status, "SUCCEEDED", "STOPPED", "FAILED"
            once it ended. The status comes from the head's Jobs REST API, with the token, in this
            process: a `ray job status` every poll is a Python process that imports Ray, which on
            two cores slows the job it watches."""
            request = urllib.request.Request(
                f"{address}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {token.read_text()}"}
            )
            status, deadline = "", time.time() + timeout
            while time.time() < deadline and not until():
                with urllib.request.urlopen(request, timeout=30) as reply:
                    status = json.load(reply)["status"]
                if status in ("SUCCEEDED", "STOPPED", "FAILED"):
                    break
                time.sleep(0.5)
            return status

        def logs(job_id) -> str:
            return _ray("job", "logs", "--address", address, job_id, env=env).stdout

        # docs/guide.md, "`ray job submit` to a running cluster": stop the job once it has a checkpoint,
        # and rerun it to resume
        submit("rga-test")
        status = wait_for("rga-test", lambda: registered_checkpoint(run_dir))  # one a rerun resumes from
        assert registered_checkpoint(run_dir), f"{status}\n{logs('rga-test')[-4000:]}"
        _ray("job", "stop", "--address", address, "rga-test", env=env)
        status = wait_for("rga-test", lambda: False)
        assert status == "STOPPED", f"{status}\n{logs('rga-test')[-4000:]}"
        submit("rga-test-2", "--stop-after", "1")  # the same command: it goes on from the last checkpoint
        status, said = wait_for("rga-test-2", lambda: False), logs("rga-test-2")
        assert status == "SUCCEEDED", f"{status}\n{said[-4000:]}"
        summary = json.loads((run_dir / "summary.json").read_text())
        (resumed,) = summary["resumed_at_epochs"]
        assert resumed >= 2 and summary["epochs"] == resumed and summary["num_classes"] == 2, summary
        assert f"epoch {resumed:3d}/20" in said and "done:" in said and not bar_frames(said)  # `ray job logs`: no bar
        epochs = [line.split(",")[0] for line in (run_dir / "metrics.csv").read_text().splitlines()[1:]]
        assert epochs == [str(e) for e in range(1, resumed + 1)]  # each epoch once: none lost, none twice
        # the cluster's processes were started without the job's quiet settings: the job's setup hook
        # keeps Ray's notices about what it does by design off the console
        noisy = [
            line
            for line in said.splitlines()
            if re.search(r"WARNING|Warning|Traceback|Progress bars|execution finished|\(raylet\)", line)
        ]
        assert not noisy, noisy
    finally:
        _ray("stop", "--force", env=env, check=False)


def _fake_autoscaling_config(head_cpus: int, worker_cpus: int, max_workers: int) -> dict:
    """A cluster for Ray's fake multi-node provider: worker nodes are `ray start` processes
    on this machine, launched and removed by the real autoscaler. (The example file that
    ray.cluster_utils.AutoscalingCluster reads is not shipped in Ray 2.60's wheel.)"""
    return {
        "cluster_name": "rga-autoscaling-test",
        "max_workers": max_workers,
        "provider": {
            # the fake provider through "external": its default-config file is missing from the wheel
            "type": "external",
            "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
            "cpu_node": {
                "resources": {"CPU": worker_cpus},
                "node_config": {},
                "min_workers": 0,
                "max_workers": max_workers,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 1,
        "docker": {},
        **{
            k: []
            for k in (
                "initialization_commands",
                "setup_commands",
                "head_setup_commands",
                "worker_setup_commands",
                "head_start_ray_commands",
                "worker_start_ray_commands",
                "cluster_synced_files",
                "rsync_exclude",
                "rsync_filter",
            )
        },
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
    }


@pytest.mark.own_cluster
def test_autoscaling_cluster_adds_a_node_for_the_job(own_cluster, tmp_path):
    import ray

    data = write_tree(tmp_path / "data", {"a": 12, "b": 12})
    config = tmp_path / "autoscaling.json"
    # the 1-CPU head alone cannot hold a 2-CPU train worker: the autoscaler must add a node
    config.write_text(json.dumps(_fake_autoscaling_config(head_cpus=1, worker_cpus=2, max_workers=2)))
    env = _env(AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1", RAY_AUTH_MODE="disabled")
    _ray(
        "start",
        "--head",
        f"--autoscaling-config={config}",
        "--num-cpus=1",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        "--disable-usage-stats",
        env=env,
    )
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "jobs.train",
                "--data",
                str(data),
                "--epochs",
                "1",
                "--batch-size",
                "8",
                "--cpus-per-worker",
                "2",
                "--storage-path",
                str(tmp_path / "runs"),
                "--name",
                "scaled",
                "--val-fraction",
                "0.25",
                "--small-stem",
                TEST_STEM,
            ],
            cwd=REPO,
            env=_env(RAY_ADDRESS="auto", RAY_AUTH_MODE="disabled"),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        # the 1-CPU head cannot hold the plan, but an autoscaler runs: the plan waits for it instead of refusing
        assert "; 1 train worker(s) x (2 CPU" in out.stdout and "note: an autoscaler runs" in out.stdout
        summary = json.loads((tmp_path / "runs" / "scaled" / "summary.json").read_text())
        ray.init(address="auto", logging_level="ERROR")
        nodes = [n for n in ray.nodes() if n["Alive"]]
        head = next(n["NodeID"] for n in nodes if n["Resources"].get("CPU") == 1)
        ray.shutdown()
        assert len(nodes) >= 2, "no worker node was added"
        assert summary["ranks"][0]["node_id"] != head, "the train worker ran on the head"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _ray("stop", "--force", env=env, check=False)


def _cluster_pss(gcs_port: int, job_pid: int) -> int:
    """Proportional set size of this test's cluster and job: the processes `ray start` left
    (found by the GCS port on their command lines), the job's, and all their children. PSS
    splits the shared object-store pages between the processes mapping them, so the sum
    counts each page once; other clusters on the machine are left out."""
    import psutil

    roots = [psutil.Process(job_pid)]
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if f"127.0.0.1:{gcs_port}" in cmd or f"--gcs_server_port={gcs_port}" in cmd:
            roots.append(p)
    procs = {p.pid: p for root in roots for p in [root, *root.children(recursive=True)]}
    total = 0
    for p in procs.values():
        try:
            total += p.memory_full_info().pss
        except psutil.Error:  # ended meanwhile
            continue
    return total


@pytest.mark.own_cluster
def test_a_dataset_several_times_the_object_store_completes(own_cluster, tmp_path):
    """Object store capped at 200 MB; ~720 MB of decoded photos: the run must stream them, not hold them."""

    rng = np.random.default_rng(0)
    data = tmp_path / "photos"
    for cls in ("a", "b"):
        (data / cls).mkdir(parents=True)
        for i in range(20):  # smooth 640x640 photos: small PNGs, 1.2 MB each once decoded (720 MB in all)
            base = rng.integers(0, 255, (5, 5, 3)).astype(np.uint8)
            png = io.BytesIO()
            Image.fromarray(base).resize((640, 640), Image.BICUBIC).save(png, format="PNG")
            for copy in range(15):  # 300 files a class; encoding each anew took 45 s of the test
                (data / cls / f"{i:02d}-{copy:02d}.png").write_bytes(png.getvalue())
    port, dash = _free_port(), _free_port()
    env = _env(RAY_AUTH_MODE="disabled")
    _ray(
        "start",
        "--head",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        "--num-cpus=2",
        f"--object-store-memory={200 * 2**20}",
        "--disable-usage-stats",
        env=env,
    )
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jobs.train",
                "--data",
                str(data),
                "--preset",
                "imagenet",
                "--image-size",
                "64",  # the photos decode at 640 px all the same; training at 64 px keeps the test short
                "--epochs",
                "1",
                "--batch-size",
                "32",
                "--augment-batch-size",
                "32",
                "--storage-path",
                str(tmp_path / "runs"),
                "--name",
                "big",
            ],
            cwd=REPO,
            env=_env(RAY_ADDRESS=f"127.0.0.1:{port}", RAY_AUTH_MODE="disabled"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        peak = 0
        while proc.poll() is None:  # the peak memory of this cluster and job, sampled each second
            peak = max(peak, _cluster_pss(port, proc.pid))
            time.sleep(1)
        out = proc.stdout.read()
        assert proc.returncode == 0, out[-3000:]
        memory = _ray("memory", "--stats-only", f"--address=127.0.0.1:{port}", env=env, check=False)
        stats = memory.stdout
        # Ray prints a "Spilled N MiB" line only when something spilled; the plasma line always
        assert memory.returncode == 0 and "Plasma memory usage" in stats, stats + memory.stderr
        spilled = int(m.group(1)) if (m := re.search(r"Spilled (\d+) MiB", stats)) else 0
        print(
            f"\npeak PSS of the cluster and job: {peak / 2**20:.0f} MiB; object store: 200 MiB; spilled: {spilled} MiB"
        )
        summary = json.loads((tmp_path / "runs" / "big" / "summary.json").read_text())
        assert summary["epochs"] == 1 and summary["coverage"][0]["exactly_once"]
        decoded = 600 * 640 * 640 * 3
        # streamed: the decoded photos never enter the object store, only the encoded files and the
        # 64 px views, which together stay under its 200 MiB: nothing spills (a pipeline that held
        # the decoded photos there would spill most of their 720 MiB); and the processes' memory stays
        # below twice the decoded photos (Ray's and torch's own, plus batches)
        assert spilled == 0, spilled
        assert peak < 2 * decoded, peak
    finally:
        _ray("stop", "--force", env=env, check=False)
