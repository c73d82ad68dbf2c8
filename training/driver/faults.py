"""When part of the cluster fails under a run: the driver names the fault in one line, keeps
the detail in faults.log, and restarts training from the last checkpoint on the cluster as it
is now (docs/design.md, "Faults").

Ray Train's own restarts (FailureConfig.max_failures) keep the plan made at the start and tell
a fault only as the workers' tracebacks. So the job restarts the trainer itself: every attempt
is a TorchTrainer with max_failures=0 on the same RunConfig(storage_path, name), which resumes
from the last registered checkpoint (ray.train.get_checkpoint). Between two attempts the
driver (training/driver/job.py, _fit):

    fault = describe(error, lost, progress, checkpoint, per_worker)  # what failed, where, when
    faults.add(fault, error, lost)  # the detail in faults.log; then the line, or the reason to stop
    plan = wait_for_a_plan(...)  # on the nodes alive now; up to --node-wait-s for one that fits

The run's own actors (epoch clock, bad-file log, run status) live on the driver's node
(`driver_actor`), as Ray Train's controller and dataset manager do: a lost node cannot take
them, and a lost driver ends the run anyway.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import traceback

import ray
import ray.train
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from training import ray_private, storage


def driver_actor(cls, *args):
    """An actor of `cls(*args)` with no CPU, on the node of this process (the driver)."""
    here = ray.get_runtime_context().get_node_id()
    strategy = NodeAffinitySchedulingStrategy(node_id=here, soft=False)
    return ray.remote(num_cpus=0)(cls).options(scheduling_strategy=strategy).remote(*args)


class CheckpointNotice(ray.train.UserCallback):
    """Runs in Ray Train's controller: tells the run's status (training/status.py) each checkpoint that the
    controller has registered, the one a restart resumes from."""

    def __init__(self, status):
        self.status = status

    def after_report(self, run_context, metrics, checkpoint):
        if checkpoint is not None:
            self.status.checkpointed.remote(checkpoint.path)


def release_groups(status) -> None:
    """Remove the placement groups an attempt's ranks said they trained in (training/status.py
    tell_group), once the attempt has ended. Ray Train's controller removes its worker group's
    when it shuts the workers down, but once, after a node loss, a group outlived its attempt:
    the GCS moved it to a node left, where it held a CPU for as long as the job lived, and
    neither the attempt after it nor a sweep's other trial could start there (docs/design.md,
    "Faults"). Removing a group already removed does nothing."""
    for group in ray.get(status.take_groups.remote()):
        ray.util.remove_placement_group(group)


def alive_nodes() -> dict[str, str]:
    """{node id: address} of the alive nodes."""
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


# A rank whose peer went fails at once (gloo, NCCL), Ray finds a worker it cannot reach
# "unavailable", and a worker group whose actor was on the node fails to start, while the GCS
# marks a node dead only once its health checks have failed for a while (docs/design.md,
# "Faults"; a node that shuts down says so at once).
PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|NCCL|is unavailable|temporarily unavailable|"
    r"WorkerGroupStartup(Failed|Timeout)Error"
)
NODE_DEATH_WAIT_S = 45.0


def failures(error: BaseException) -> list[BaseException]:
    """What failed under a failed attempt: each rank's exception where ranks failed, the
    controller's own where Ray Train's controller did (a worker group that could not start),
    else the error itself."""
    ranks = [ray_private.worker_exception(f) for f in (getattr(error, "worker_failures", None) or {}).values()]
    inner = getattr(error, "controller_failure", None)
    return ranks or [inner if isinstance(inner, BaseException) else error]


def failure_text(error: BaseException) -> str:
    """Each of `failures(error)` as "Type: message", one after another."""
    return "\n".join(f"{type(f).__name__}: {f}" for f in failures(error))


def lost_nodes(nodes: dict[str, str], error: BaseException, wait_s: float = NODE_DEATH_WAIT_S) -> dict[str, str]:
    """The nodes of `nodes` ({id: address}, alive when the attempt began) that are gone now.
    Where every failure says only that a peer went or cannot be reached, or that the workers did
    not start, wait up to wait_s for Ray to declare a node dead: the fault is then named right,
    and the next plan leaves the node out (a plan made while the dead node still counts puts a
    worker where a sweep's other trial reads its data: docs/design.md, "Faults")."""
    texts = [f"{type(f).__name__}: {f}" for f in failures(error)]
    only_peers = all(PEER_GONE.search(f) and "worker process has died" not in f for f in texts)
    deadline = time.monotonic() + (wait_s if only_peers else 0)
    while True:
        alive = alive_nodes()
        lost = {n: a for n, a in nodes.items() if n not in alive}
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(1.0)


def node_deaths(ids) -> str:
    """What Ray says of the death of each node of `ids`, for faults.log."""
    dead = [n for n in ray.nodes() if n["NodeID"] in ids]
    return "\n".join(
        f"node {n['NodeID']} at {n['NodeManagerAddress']}: {n.get('DeathReason')} {n.get('DeathReasonMessage') or ''}"
        for n in dead
    )


@dataclasses.dataclass(frozen=True)
class Fault:
    """One failed attempt, as summary.json lists it."""

    time: float  # time.time() when the driver saw it
    kind: str  # node lost, train worker died, out of memory, data task failed, workers did not start, error
    node: str | None  # "ADDRESS (node ID8)" of the lost node, None where no node was lost
    epoch: int | None  # the epoch (1-based) that was training, None before the first step
    step: int | None  # the last step a rank had posted in that epoch
    checkpoint: str | None  # where the next attempt resumes: the last registered checkpoint, None = the start
    message: str  # one line: the error, shortened

    def where(self) -> str:
        if self.epoch is None:
            return "before the first step"
        return f"at epoch {self.epoch}, step {self.step}"

    def summary(self) -> str:
        """What failed, and when: "node lost: 10.0.0.7 (node 1f2e3d4c) at epoch 2, step 37"; an
        error of no other kind by itself ("RuntimeError: ... at epoch 2, step 37"): the line it
        ends in already begins "error: "."""
        what = self.node or self.message
        return f"{what if self.kind == 'error' else f'{self.kind}: {what}'} {self.where()}"

    def line(self, left: int) -> str:
        """The console's line for a fault the run survives; left: failures --max-failures still allows (-1: any)."""
        resume = f"resuming from {self.checkpoint.rsplit('/', 1)[-1]}" if self.checkpoint else "restarting from epoch 1"
        budget = "--max-failures -1: no limit" if left < 0 else f"{left} more allowed by --max-failures"
        return f"fault: {self.summary()}; {resume} ({budget})"


OUT_OF_MEMORY = re.compile(r"low on memory|memory pressure|OutOfMemoryError|OOM killer")
WORKER_DIED = re.compile(r"The actor (died|is dead)|worker process has died|WorkerCrashedError")


def describe(error: BaseException, lost: dict[str, str], progress: dict, checkpoint: str | None, per_worker: int):
    """The Fault of a failed attempt. `lost`: {node id: address} of the nodes that were alive when
    the attempt started and are not now; `progress`: the run status's {rank: (epoch, images, loss sum)}."""
    causes = failures(error)
    text = failure_text(error)
    node = None
    if lost:
        kind, (node_id, address) = "node lost", min(lost.items(), key=lambda kv: kv[1])
        node = f"{address} (node {node_id[:8]})"
    elif OUT_OF_MEMORY.search(text):
        kind = "out of memory"
    elif WORKER_DIED.search(text):
        kind = "train worker died"
    elif "ray.data" in text or any(isinstance(c, ray.exceptions.ObjectLostError) for c in causes):
        kind = "data task failed"
    elif "WorkerGroupStartup" in text:
        kind = "workers did not start"
    else:
        kind = "error"
    epoch, step = None, None
    if progress:
        epoch0, images, _ = max(progress.values())  # the rank furthest on
        epoch, step = epoch0 + 1, math.ceil(images / max(1, per_worker))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    why = next((line for line in lines if "because" in line), lines[0] if lines else type(error).__name__)
    return Fault(time.time(), kind, node, epoch, step, checkpoint, why[:200])


def error_detail(error: BaseException) -> str:
    """Everything known of a failed attempt: each rank's exception with its traceback."""
    failures = getattr(error, "worker_failures", None) or {}
    parts = []
    for rank, failure in sorted(failures.items()):
        cause = ray_private.worker_exception(failure)
        tb = ray_private.worker_traceback(failure) or "".join(traceback.format_exception(cause))
        parts.append(f"--- rank {rank}: {type(cause).__name__}\n{tb.rstrip()}")
    if not parts:
        parts.append("".join(traceback.format_exception(error)).rstrip())
    return "\n".join(parts)


FULL = ("No space left on device", "Disk quota exceeded")  # ENOSPC's and EDQUOT's words, in any layer's message


def storage_full(error: BaseException) -> str | None:
    """The words of a full disk or quota in a failed attempt (its ranks' exceptions and tracebacks),
    or None: a run whose checkpoint cannot be written fails the same way on every restart."""
    text = f"{error}\n{error_detail(error)}"
    return next((words for words in FULL if words in text), None)


def full_storage_line(storage_path: str, words: str, checkpoint: str | None) -> str:
    resume = (
        f"the same command resumes from {checkpoint.rstrip('/').rsplit('/', 1)[-1]}"
        if checkpoint
        else "the same command starts it again"
    )
    return f"training failed: {storage_path}: {words} (writing the run's files); make room there, then {resume}"


class FaultLog:
    """The faults of this invocation: the console's lines, faults.log in the run directory (each
    fault with its full detail, after those of earlier invocations) and summary.json's list."""

    def __init__(self, run_dir: str, max_failures: int):
        self.path, self.max_failures = storage.join(run_dir, "faults.log"), max_failures
        self.faults: list[Fault] = []
        self._last_message = None

    @property
    def left(self) -> int:
        """Restarts --max-failures still allows; -1: no limit."""
        return -1 if self.max_failures < 0 else max(0, self.max_failures - len(self.faults))

    def add(self, fault: Fault, error: BaseException, lost: dict[str, str]) -> None:
        """Record a fault: in this invocation's list, and with its detail (the ranks' tracebacks,
        Ray's word on each lost node) at the end of faults.log."""
        self.faults.append(fault)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(fault.time))
        entry = f"=== {stamp} {fault.summary()}\n"
        if lost:
            entry += node_deaths(lost) + "\n"
        entry += error_detail(error) + "\n\n"
        old = storage.read_bytes(self.path).decode() if storage.exists(self.path) else ""
        try:
            storage.write_bytes(self.path, (old + entry).encode())
        except OSError as e:  # a full disk: the fault is still told, on the console
            if not any(words in str(e) for words in FULL):
                raise

    def give_up(self, fault: Fault) -> str | None:
        """Why the run stops after `fault` (one line), or None: restart. An error that comes back
        the same twice in a row is not a passing fault."""
        repeated = fault.kind == "error" and fault.message == self._last_message
        self._last_message = fault.message
        if repeated:
            why = "the same error twice in a row, so not a passing fault"
        elif self.max_failures < 0 or len(self.faults) <= self.max_failures:
            return None
        else:
            why = f"--max-failures {self.max_failures} used up"
        return f"{fault.summary()}; {why}; details in {self.path}"

    def records(self) -> list[dict]:
        return [dataclasses.asdict(f) for f in self.faults]
