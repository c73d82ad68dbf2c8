"""Every private Ray API the project uses, in one place, with why no public one does the job.

Tested with Ray 2.60 (pyproject.toml pins that range). `CHECKS` lists what each function
relies on; tests/test_ray_private.py runs them, so after a Ray upgrade it names what
changed, which function here needs a new source and who calls it. Where Ray grows a
public API for one of these, use it and delete the entry.

Light at import (no torch, no Ray Train): training/driver/console.py imports it in the entry
point's process. Each function imports what it needs.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import time


def autoscaler_ceiling() -> dict | None:
    """The most of each resource the cluster's autoscaler may reach (autoscaler v2, KubeRay),
    or None. Ray Train checks its workers against the same figure; no public API has it.
    Used by training/driver/planning.py, cluster_capacity."""
    from ray._private.state import state

    return state.get_max_resources_from_cluster_config()


def head_node_resource() -> str:
    """The resource only the cluster's head node has (Ray Train pins its state actor by it). A Tune
    trial's own actor asks for a sliver of it, so a lost worker node never takes a trial's driver
    (the head's loss ends the cluster anyway), also where the head offers no CPU (cluster.yaml).
    No public API names it. Used by training/sweep/tuner.py run_tuner."""
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME

    return HEAD_NODE_RESOURCE_NAME


def v1_autoscaler_runs() -> bool:
    """True when `ray up`'s (v1) autoscaler manages this cluster. Every cluster's monitor
    writes a status; without an autoscaling config its read-only provider names each node's
    type "node_<node id>", while a real autoscaler uses the config's node types. `ray status`
    reads the same key; no public API exposes it. Used by training/driver/planning.py, cluster_capacity."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    if not raw:
        return False
    mapping = json.loads(raw).get("autoscaler_report", {}).get("node_type_mapping") or {}
    return any(node_type != f"node_{node_id}" for node_id, node_type in mapping.items())


def pending_demands() -> list[tuple[dict, int]]:
    """(resources, count) of the tasks and actors that wait for a node with room, as the
    GCS reports them to the autoscaler (what `ray status` shows as "Pending"). The public
    state API needs the dashboard, which a local run does not start. Used by
    training/worker/feed.py, IngestWatch."""
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status

    status = get_cluster_status(ray.get_runtime_context().gcs_address)
    return [
        (dict(req.bundle), int(req.count))
        for demand in status.resource_demands.ray_task_actor_demand
        for req in demand.bundles_by_count
    ]


def trainer_class(*, one_worker: bool, own_cluster: bool):
    """The trainer class job.py runs, called as TorchTrainer is (less `torch_config`).

    `one_worker`: Ray Train's DataParallelTrainer with its plain `BackendConfig` instead of
    TorchTrainer. TorchTrainer's `TorchConfig` lives in a module that imports torch, and Ray
    Train's controller unpickles it before it starts the workers: 1-3 s of imports on the way to
    the first step; its backend then sets up a gloo (or NCCL) process group, which one worker
    never uses. The worker sets its CUDA device itself (training/worker/loop.py setup_worker), as
    TorchConfig's context would. Several workers train with TorchTrainer (DDP).

    `own_cluster`: less Ray Train's placement-group cleaner, a detached actor that frees the
    run's placement group should the controller die. A cluster a job started on this machine
    (this process, or the sweep whose trial this is: training/driver/session.py owns_cluster)
    ends with that job, so the cleaner has nothing to outlive; it would cost one more process at
    start-up, and it finds the state API through RAY_ADDRESS or the machine's latest `ray start`:
    with no dashboard of its own cluster to ask, it warns every few seconds, or asks another
    cluster's, hears "no such actor" and ends the live run's workers. Ray Train has no switch
    for it (the preemption watcher has an environment variable; the cleaner has none), so this
    overrides the private hook that builds the default callbacks.

    Used by training/driver/job.py, Attempt.trainer (docs/design.md, "Choices and where they
    were measured")."""
    from ray.train import BackendConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    base = TorchTrainer
    if one_worker:

        class OneWorkerTrainer(DataParallelTrainer):
            def __init__(self, train_loop_per_worker, **kwargs):
                super().__init__(train_loop_per_worker, backend_config=BackendConfig(), **kwargs)

        base = OneWorkerTrainer
    if not own_cluster:
        return base

    class OwnClusterTrainer(base):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            return [c for c in callbacks if type(c).__name__ != "PlacementGroupCleanerCallback"]

    return OwnClusterTrainer


def worker_exception(failure: BaseException) -> BaseException:
    """The exception a train worker's function raised, from the wrapper Ray Train 2.60 puts in
    `WorkerGroupError.worker_failures` (it keeps the original only as a private attribute).
    Used by training/driver/job.py, worker_error."""
    return getattr(failure, "_base_exc", failure)


def worker_traceback(failure: BaseException) -> str | None:
    """The traceback string Ray Train 2.60 keeps beside a train worker's exception (the
    exception itself arrives without its traceback). Used by training/driver/faults.py, error_detail."""
    return getattr(failure, "_traceback_str", None)


def configure_ray_data_logging() -> None:
    """Ray Data configures its loggers when it is imported, from RAY_DATA_LOGGING_CONFIG; this
    does it again in a process that imported it before the variable was set. Used by
    training/driver/session.py quiet_worker_process."""
    from ray.data._internal.logging import configure_logging

    configure_logging()


def job_runtime_env() -> dict:
    """The runtime env that `ray job submit` gave this driver ({} when it was started otherwise):
    ray.init refuses a runtime env of its own that sets the same fields. Used by
    training/driver/session.py connect."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    raw = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    return (json.loads(raw).get("runtime_env") or {}) if raw else {}


def filter_worker_output(keep) -> None:
    """Pass the lines of other processes that this driver prints (ray.init's log_to_driver) through
    `keep` (a list of lines in, the lines to print out) first. Ray's own filter,
    RAY_DEDUP_LOGS_SKIP_REGEX, sees one line at a time, and a traceback is several; Ray 2.60 hands
    the driver each process's output in batches through its stdstream dispatcher, whose printing
    handler this wraps. Idempotent; nothing where ray.init had log_to_driver=False, and ray.shutdown
    removes the wrapper with Ray's handler. Used by training/driver/session.py connect."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    for name, handler in list(dispatcher.handlers):
        if name != "ray_print_logs" or getattr(handler, "filtered", False):
            continue

        def filtered(data, handler=handler):
            lines = keep(data["lines"])
            if lines:
                handler({**data, "lines": lines})

        filtered.filtered = True
        dispatcher.remove_handler(name)
        dispatcher.add_handler(name, filtered)


ASK_AGAIN_S = 5.0  # data_limits_from_the_start: the reply takes milliseconds; a second is what it saves


def data_limits_from_the_start() -> None:
    """Ray Data 2.60's executor learns what the cluster lends it from the autoscaling
    coordinator actor, asynchronously: its first ask answers nothing (the reply comes with
    the next ask), and ResourceManager.get_global_limits keeps that answer for a second
    (GLOBAL_LIMITS_UPDATE_INTERVAL_S). Every execution (each epoch's, each split's) therefore
    starts with limits of zero and runs one task at a time for its first second, which on
    short epochs is a fifth of the epoch or more (docs/benchmark-log.md, "Ingest"). This asks
    again at each scheduling step while the limits are still zero, for the execution's first
    ASK_AGAIN_S at most (limits that stay zero, e.g. a cluster that other work holds, are
    then refreshed each second as Ray does), and keeps Ray's one-second refresh once they are
    known. Idempotent; it must run in the process that executes the dataset (the train
    worker, or with several workers the split coordinator), so SplitSource.get_read_tasks
    calls it (training/stream/ingest.py). No setting of Ray's does this."""
    from ray.data._internal.execution.resource_manager import ResourceManager

    original = ResourceManager.get_global_limits
    if getattr(original, "asks_until_known", False):
        return

    @functools.wraps(original)
    def get_global_limits(self):
        limits = original(self)
        if not limits.cpu and not limits.gpu:  # no answer yet: ask again at the next step
            first = self.__dict__.setdefault("_first_asked", time.monotonic())
            if time.monotonic() - first < ASK_AGAIN_S:
                self._global_limits_last_update_time = 0
        return limits

    get_global_limits.asks_until_known = True
    ResourceManager.get_global_limits = get_global_limits


# --------------------------------------------------------------------------- checks


def _has(module: str, *names: str) -> str | None:
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        return f"module {module} is gone ({e})"
    path = module
    for name in names:
        path += f".{name}"
        if not hasattr(obj, name):
            return f"{path} is gone"
        obj = getattr(obj, name)
    return None


def _check_ceiling():
    return _has("ray._private.state", "state", "get_max_resources_from_cluster_config")


def _check_v1_status():
    return _has("ray._private.ray_constants", "DEBUG_AUTOSCALING_STATUS") or _has(
        "ray.experimental.internal_kv", "_internal_kv_get"
    )


def _check_demands():
    problem = _has("ray.autoscaler.v2.sdk", "get_cluster_status")
    if problem:
        return problem
    from ray.autoscaler.v2.schema import RayTaskActorDemand, ResourceDemandSummary, ResourceRequestByCount

    fields = {
        ResourceDemandSummary: "ray_task_actor_demand",
        RayTaskActorDemand: "bundles_by_count",
        ResourceRequestByCount: "bundle",
    }
    for cls, field in fields.items():
        if field not in cls.__dataclass_fields__:
            return f"ray.autoscaler.v2.schema.{cls.__name__} has no field {field!r}"
    return None


def _check_trainer_hook():
    from ray.train.torch import TorchTrainer

    problem = _has("ray.train.v2.api.data_parallel_trainer", "DataParallelTrainer")
    if problem:
        return problem
    if not hasattr(TorchTrainer, "_create_default_callbacks"):
        return "ray.train.torch.TorchTrainer._create_default_callbacks is gone"
    return _has("ray.train.v2._internal.callbacks.placement_group_callback", "PlacementGroupCleanerCallback")


def _check_worker_exception():
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    wrapped = UserExceptionWithTraceback(ValueError("x"), traceback_str="")
    if not isinstance(worker_exception(wrapped), ValueError):
        return "ray.train.v2._internal.exceptions.UserExceptionWithTraceback no longer keeps _base_exc"
    return None


def _check_worker_traceback():
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    if worker_traceback(UserExceptionWithTraceback(ValueError("x"), traceback_str="tb")) != "tb":
        return "ray.train.v2._internal.exceptions.UserExceptionWithTraceback no longer keeps _traceback_str"
    return None


def _check_job_runtime_env():
    return _has("ray._private.runtime_env.constants", "RAY_JOB_CONFIG_JSON_ENV_VAR")


def _check_data_limits():
    problem = _has("ray.data._internal.execution.resource_manager", "ResourceManager", "get_global_limits")
    if problem:
        return problem
    from ray.data._internal.execution.resource_manager import ResourceManager

    source = inspect.getsource(ResourceManager)
    for name in ("_global_limits_last_update_time", "GLOBAL_LIMITS_UPDATE_INTERVAL_S"):
        if name not in source:
            return f"ray.data's ResourceManager no longer has {name}"
    return None


def _check_worker_output():
    problem = _has("ray._private.ray_logging", "global_worker_stdstream_dispatcher", "handlers")
    if problem:
        return problem
    from ray._private import worker

    if "ray_print_logs" not in inspect.getsource(worker.connect):
        return "ray._private.worker.connect no longer adds the handler named ray_print_logs"
    return None


# (function here, its callers, check): a check returns None or what changed
def _check_head_resource() -> str | None:
    name = head_node_resource()
    return None if name.startswith("node:") else f"the head's resource is named {name!r}, not node:..."


CHECKS = [
    ("autoscaler_ceiling", "training/driver/planning.py cluster_capacity", _check_ceiling),
    ("head_node_resource", "training/sweep/tuner.py run_tuner", _check_head_resource),
    ("v1_autoscaler_runs", "training/driver/planning.py cluster_capacity", _check_v1_status),
    ("pending_demands", "training/worker/feed.py IngestWatch", _check_demands),
    ("trainer_class", "training/driver/job.py Attempt.trainer", _check_trainer_hook),
    ("worker_exception", "training/driver/job.py worker_error", _check_worker_exception),
    ("worker_traceback", "training/driver/faults.py error_detail", _check_worker_traceback),
    (
        "configure_ray_data_logging",
        "training/driver/session.py quiet_worker_process",
        lambda: _has("ray.data._internal.logging", "configure_logging"),
    ),
    ("job_runtime_env", "training/driver/session.py connect", _check_job_runtime_env),
    ("filter_worker_output", "training/driver/session.py connect", _check_worker_output),
    ("data_limits_from_the_start", "training/stream/ingest.py SplitSource.get_read_tasks", _check_data_limits),
]
