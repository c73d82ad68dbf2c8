"""The private Ray APIs of training/ray_private.py are still there and behave as used. After a
Ray upgrade, a failure here names what changed and the function that needs a new source."""

from __future__ import annotations

import pytest
import ray

from training import ray_private


@pytest.mark.parametrize("name, users, check", ray_private.CHECKS, ids=[c[0] for c in ray_private.CHECKS])
def test_private_ray_api_is_still_there(name, users, check):
    problem = check()
    assert problem is None, (
        f"Ray {ray.__version__}: {problem}; training/ray_private.py {name}() needs a new source (used by {users})"
    )


@pytest.mark.parametrize("one_worker", [True, False])
def test_a_cluster_the_job_owns_runs_ray_train_without_the_placement_group_cleaner(tmp_path, one_worker):
    import ray.train
    from ray.train.torch import TorchTrainer

    kwargs = {
        "scaling_config": ray.train.ScalingConfig(num_workers=1),
        "run_config": ray.train.RunConfig(name="owned", storage_path=str(tmp_path)),
    }
    owned_cls = ray_private.trainer_class(one_worker=one_worker, own_cluster=True)
    plain = {type(c).__name__ for c in TorchTrainer(lambda: None, **kwargs)._create_default_callbacks()}
    owned = {type(c).__name__ for c in owned_cls(lambda: None, **kwargs)._create_default_callbacks()}
    joined = ray_private.trainer_class(one_worker=one_worker, own_cluster=False)
    assert "PlacementGroupCleanerCallback" in plain  # else the filter has nothing to do on this Ray
    assert owned == plain - {"PlacementGroupCleanerCallback"}
    assert {type(c).__name__ for c in joined(lambda: None, **kwargs)._create_default_callbacks()} == plain


def test_one_worker_reaches_ray_trains_controller_without_torch(tmp_path):
    """Ray Train's controller unpickles the trainer's backend config before it starts the workers:
    a one-worker run's must not import torch there (TorchTrainer's does, seconds on the way to the
    first step); several workers keep TorchTrainer's, for DDP."""
    import subprocess
    import sys

    import ray.cloudpickle
    import ray.train

    kwargs = {
        "scaling_config": ray.train.ScalingConfig(num_workers=1),
        "run_config": ray.train.RunConfig(name="one", storage_path=str(tmp_path)),
    }

    def torch_on_load(one_worker: bool) -> bool:
        trainer = ray_private.trainer_class(one_worker=one_worker, own_cluster=True)(lambda: None, **kwargs)
        (tmp_path / "config.pkl").write_bytes(ray.cloudpickle.dumps(trainer.backend_config))
        code = "import pickle, sys; pickle.load(open(sys.argv[1], 'rb')); print('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "config.pkl")], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip() == "True"

    assert torch_on_load(one_worker=False)  # else there is nothing to spare on this Ray
    assert not torch_on_load(one_worker=True)


def test_the_train_loops_own_error_is_found_inside_ray_trains_wrapper():
    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    from training.driver.job import worker_error
    from training.worker.feed import IngestStalled

    try:
        raise IngestStalled("no batch for 31 s: the train workers hold every CPU")
    except IngestStalled as e:
        wrapped = construct_user_exception_with_traceback(e)
    error = ray.train.WorkerGroupError("rank 0 failed", {0: wrapped})
    assert worker_error(error) == "no batch for 31 s: the train workers hold every CPU"
    assert worker_error(RuntimeError("boom")) == "RuntimeError: boom"


@pytest.mark.ray  # the first subprocess starts a local Ray cluster of its own
def test_a_cluster_connect_started_is_owned_by_its_process_and_workers_and_a_joined_one_is_not(ray_cluster):
    """The gate of trainer_class's `own_cluster` (training/driver/session.py owns_cluster): a local
    cluster that connect() started counts as owned in the process that started it, on a second
    connect() there (a notebook's second fit), and in its workers (a sweep's trials, whose
    placement-group cleaner would ask another cluster's dashboard); a joined cluster nowhere."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import ray\n"
        "from training.driver.session import connect, owns_cluster\n"
        "first, second = connect(), connect()\n"
        "in_worker = ray.get(ray.remote(num_cpus=0)(owns_cluster).remote())\n"
        "print(first, second, in_worker)\n"
    )

    def owned(address: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RGA_OWN_CLUSTER")}
        env |= {"RAY_ADDRESS": address} if address else {}
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    assert owned(None) == "True True True"
    assert owned(ray.get_runtime_context().gcs_address) == "False False False"
