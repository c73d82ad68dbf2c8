"""Who gets which CPU and GPU (docs/design.md, "Resources"): what the cluster has
(Capacity), the plan that splits it between the train workers and Ray Data (ResourcePlan,
plan_resources), and the arithmetic that checks a plan: where Ray puts the workers, and
whether Ray Data's tasks still fit beside them.

Ray Data excludes the train workers' reservations from its own budget, and a Ray task runs
on one node: when no node keeps the CPUs one read/augment task reserves, ingest never
starts and the job waits forever. The planner checks every plan with place_workers,
left_over and tasks_fit (pure arithmetic on (CPUs, GPUs) per node) before training; the
train worker's feed (training/worker/feed.py) checks the placement Ray actually made when no
batch arrives.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import ray

from training import ray_private
from training.config import ConfigError, TrainConfig, check_amp
from training.spec import EPS, Node, left_over, tasks_fit


def place_workers(nodes: list[Node], workers: int, worker: Node, *, spread: bool) -> list[int] | None:
    """Train workers per node as a placement group puts its bundles: SPREAD gives each the
    node with the most CPUs free, PACK fills the node it used last before the next one.
    None when they do not fit."""
    free = [list(n) for n in nodes]
    counts = [0] * len(nodes)
    for _ in range(workers):
        fits = [i for i, (c, g) in enumerate(free) if c + EPS >= worker[0] and g + EPS >= worker[1]]
        if not fits:
            return None
        if spread:
            i = max(fits, key=lambda j: (free[j][0], -counts[j], -j))
        else:
            i = max(fits, key=lambda j: (counts[j], free[j][0], -j))
        free[i][0] -= worker[0]
        free[i][1] -= worker[1]
        counts[i] += 1
    return counts


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What the cluster has now, or can grow to when it autoscales."""

    cpus: int
    gpus: int
    hosts: int  # distinct machines among the alive nodes (nodes on one host share its disk)
    autoscaling: bool = False
    bounded: bool = True  # False: an autoscaler runs whose limits Ray does not publish
    nodes: tuple[Node, ...] = ()  # (CPUs, GPUs) of each alive node; () = unknown: `hosts` equal nodes
    host_cores: int = 0  # the cores of the one machine all nodes run on, when it is this process's; 0: unknown
    fractions: tuple[float, float] = (1.0, 1.0)  # a share's part of each node's CPUs and GPUs (share_of)

    def note(self) -> str:
        if not self.bounded:
            return (
                "an autoscaler runs but does not publish its limits: requests beyond the current "
                f"{self.cpus} CPU / {self.gpus} GPU wait for new nodes (pass --device cuda --num-workers N "
                "when the cluster starts without GPU nodes)"
            )
        return ""

    def node_list(self) -> list[Node]:
        if self.nodes and not self.autoscaling:
            return list(self.nodes)
        hosts = max(1, self.hosts)
        return [(self.cpus / hosts, self.gpus / hosts)] * hosts


def cluster_capacity() -> Capacity:
    """Current resources, raised to the autoscaler's ceiling where Ray publishes one (autoscaler
    v2, KubeRay); Ray Train checks its workers against the same ceiling."""
    now = ray.cluster_resources()
    ceiling = ray_private.autoscaler_ceiling() or {}
    autoscaler_v1 = not ceiling and ray_private.v1_autoscaler_runs()
    alive = [n for n in ray.nodes() if n["Alive"]]
    hosts = {n["NodeManagerAddress"] for n in alive}
    return Capacity(
        cpus=max(int(now.get("CPU", 0)), int(ceiling.get("CPU", 0))),
        gpus=max(int(now.get("GPU", 0)), int(ceiling.get("GPU", 0))),
        hosts=len(hosts),
        autoscaling=bool(ceiling) or autoscaler_v1,
        bounded=not autoscaler_v1,
        nodes=tuple((n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0)) for n in alive),
        host_cores=machine_cores() if hosts == {ray.util.get_node_ip_address()} else 0,
    )


def share_of(capacity: Capacity, parts: int, cpus: float = 0, gpus: float = 0) -> Capacity:
    """The part of `capacity` one of `parts` runs side by side plans for (a sweep's trials): `cpus`
    and `gpus` where given, else an equal share; each node shrunk in proportion. A ConfigError
    where a share is more than the cluster has, or no CPU."""
    want_cpus = cpus or capacity.cpus // max(parts, 1)
    want_gpus = gpus or capacity.gpus // max(parts, 1)
    if want_cpus < 1 or (capacity.bounded and (want_cpus > capacity.cpus or want_gpus > capacity.gpus)):
        raise ConfigError(
            f"one trial's share ({want_cpus:g} CPU, {want_gpus:g} GPU) does not fit the cluster's {capacity.cpus} CPU "
            f"and {capacity.gpus} GPU; lower --max-concurrent, or --trial-cpus/--trial-gpus"
        )
    fraction = want_cpus / capacity.cpus if capacity.cpus else 1.0
    gpu_fraction = want_gpus / capacity.gpus if capacity.gpus else 0.0
    nodes = tuple((c * fraction, g * gpu_fraction) for c, g in capacity.nodes)
    return dataclasses.replace(
        capacity,
        cpus=int(want_cpus),
        gpus=int(want_gpus),
        nodes=nodes,
        host_cores=0,
        fractions=(fraction, gpu_fraction),
    )


def share_now(share: Capacity, now: Capacity) -> Capacity:
    """A share made by share_of, of the nodes alive `now`: the same part of each, so a trial that
    lost a node plans for its part of what is left, never for the part other trials hold."""
    fraction, gpu_fraction = share.fractions
    if now.autoscaling or not now.nodes:  # the cluster may grow back: the share as planned first
        return share
    nodes = tuple((c * fraction, g * gpu_fraction) for c, g in now.nodes)
    cpus, gpus = sum(c for c, _ in nodes), sum(g for _, g in nodes)
    return dataclasses.replace(
        share,
        cpus=min(share.cpus, int(cpus + 1e-6)),
        gpus=min(share.gpus, int(gpus + 1e-6)),
        nodes=nodes,
        hosts=now.hosts,
    )


def machine_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def check_storage(storage_path: str, capacity: Capacity, log=print) -> None:
    """Checkpoints from every node must land in one place (Ray Train persists them there)."""
    if "://" in storage_path:
        return
    if capacity.hosts > 1:
        raise ConfigError(
            f"--storage-path {storage_path} is a local path but the cluster spans {capacity.hosts} machines; "
            "use storage every node sees: s3://bucket/runs, gs://bucket/runs or a shared mount such as NFS"
        )
    if capacity.autoscaling:
        log(
            f"warning: --storage-path {storage_path} is local; if the autoscaler adds machines, use s3://, gs:// or "
            "a shared mount"
        )


# On GPUs each trainer's GPU keeps GPU_INGEST_SHARE for augmentation: by default GPU_TASKS_PER_GPU
# Ray Data tasks at once, each a process that decodes (nvjpeg) and augments a batch and outlives
# the epoch (docs/design.md, "Choices and where they were measured"); with --augment-actors,
# the share per actor.
GPU_INGEST_SHARE, GPU_TASKS_PER_GPU = 0.25, 4


@dataclasses.dataclass(frozen=True)
class ResourcePlan:
    use_gpu: bool
    num_workers: int
    cpus_per_worker: float  # below 1 only where whole CPUs would leave Ray Data none
    gpus_per_worker: float  # < 1 when augment tasks or actors share the trainers' GPUs
    threads_per_worker: int
    augment_actors: int  # per split; 0: Ray Data tasks instead (the default)
    augment_gpus: float  # per augment task or actor; 0 on a CPU-only plan
    augment_cpus: float  # per read/augment task and per augment actor
    placement: str  # PACK keeps GPU ranks together (NVLink); SPREAD gives CPU ranks their own cores
    augment_concurrency: int = 0  # GPU augment tasks at once per split; 0: as many as Ray Data starts

    def describe(self) -> str:
        where = f"{self.gpus_per_worker:g} GPU + " if self.use_gpu else ""
        aug = (
            f"({self.augment_gpus:g} GPU + {self.augment_cpus:g} CPU)"
            if self.augment_gpus
            else f"{self.augment_cpus:g} CPU"
        )
        who = "augment tasks" if self.augment_tasks else f"{self.augment_actors} augment actor(s)"
        cap = f", at most {self.augment_concurrency} at once" if self.augment_concurrency else ""
        return (
            f"{self.num_workers} train worker(s) x ({where}{self.cpus_per_worker:g} CPU, "
            f"{self.threads_per_worker} torch threads), {self.placement}; {who} x {aug} per split{cap}"
        )

    @property
    def augment_tasks(self) -> bool:
        return self.augment_actors == 0

    @property
    def worker(self) -> Node:
        return (self.cpus_per_worker, self.gpus_per_worker if self.use_gpu else 0.0)

    def batch_per_worker(self, batch_size: int) -> int:
        """Each train worker's share of --batch-size (the one place it is worked out: WorkerSpec
        carries it to the feed and the schedule, a fault's step count reads it)."""
        return batch_size // self.num_workers

    def ingest_tasks(self) -> list[Node]:
        """What Ray Data must run at once to make progress: one read task (on CPUs it augments
        too), plus an augment task on a GPU share, or the augment actors of an actor pool (a
        pool starts all of its actors)."""
        on_gpu = (self.augment_cpus, self.augment_gpus)
        augment = [on_gpu] * (self.augment_actors or (1 if self.augment_gpus else 0))
        return [(self.augment_cpus, 0.0)] + augment


def tasks_per_gpu(augment_gpus: float) -> int:
    """Augment tasks beside each trainer: as many of `augment_gpus` as fit in GPU_INGEST_SHARE
    of its GPU, and at least one (--augment-gpus 0.25 gives one task a quarter, 0.0625 four)."""
    return max(1, math.floor(GPU_INGEST_SHARE / augment_gpus + 1e-9))


def gpu_shares(cfg: TrainConfig, workers: int, capacity: Capacity) -> dict:
    """The GPU fields of a GPU plan: each trainer's share, each augment task's or actor's,
    and how many augment tasks run at once per split; a ConfigError where they do not fit."""
    actors = cfg.augment_actors
    augment_gpus = cfg.augment_gpus or (GPU_INGEST_SHARE / GPU_TASKS_PER_GPU if not actors else GPU_INGEST_SHARE)
    dedicated = augment_gpus >= 1
    needed = workers + ((actors or 1) * augment_gpus if dedicated else 0)  # dedicated: room for one task at least
    if needed > capacity.gpus and capacity.bounded:
        who = f"{actors or 1} augment {'actor' if actors else 'task'}(s) of {augment_gpus:g} GPU"
        raise ConfigError(
            f"--num-workers {workers}"
            + (f" + {who}" if dedicated else "")
            + f" need {needed:g} GPUs but the cluster has at most {capacity.gpus}; lower --num-workers"
        )
    gpus_per_worker = 1.0
    if not dedicated:  # each GPU keeps room for the augment actors or tasks beside its trainer
        beside = math.ceil(actors / max(workers, 1)) if actors else tasks_per_gpu(augment_gpus)
        gpus_per_worker = 1.0 - augment_gpus * beside
        if gpus_per_worker <= 0:
            raise ConfigError(
                f"--augment-actors {actors} x {augment_gpus:g} GPU leave no GPU for {workers} train worker(s); "
                "lower --augment-gpus"
            )
    if actors:
        concurrency = 0  # the pool's size
    elif dedicated:  # every GPU the trainers leave (that Ray knows of now, where an autoscaler hides its limits)
        concurrency = max(1, int((capacity.gpus - workers) // augment_gpus))
    else:
        concurrency = tasks_per_gpu(augment_gpus) * workers
    return {"gpus_per_worker": gpus_per_worker, "augment_gpus": augment_gpus, "augment_concurrency": concurrency}


def plan_resources(cfg: TrainConfig, capacity: Capacity) -> ResourcePlan:
    """Split the cluster between train workers and Ray Data (docs/design.md, "Resources").

    On GPUs the augment tasks (or actors) share the trainers' GPUs (a quarter of each, the
    trainer the rest) unless --augment-gpus says otherwise; a whole GPU per actor only pays
    when augmentation is heavy next to the model. On CPUs one worker uses all cores by
    default: two workers on two cores fight over them. Every plan returned leaves Ray Data
    room for its tasks on the nodes the workers leave (leave_room_for_ingest).
    """
    cpus, gpus = capacity.cpus, capacity.gpus
    use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and gpus > 0)
    if use_gpu and gpus == 0 and capacity.bounded:
        raise ConfigError("--device cuda: the Ray cluster has no GPUs and cannot get any; use --device cpu or auto")
    if cfg.augment_gpus and not use_gpu and capacity.bounded:
        raise ConfigError(
            f"--augment-gpus {cfg.augment_gpus:g}: the Ray cluster has no GPUs and cannot get any; drop --augment-gpus"
        )
    check_amp(cfg.amp, on_gpu=use_gpu)
    workers = cfg.num_workers or (max(gpus, 1) if use_gpu else 1)
    shares = gpu_shares(cfg, workers, capacity) if use_gpu else {"gpus_per_worker": 1.0, "augment_gpus": 0.0}
    cpus_per_worker = cfg.cpus_per_worker or max(1, cpus // 2 // workers)
    if cfg.cpus_per_worker and workers * cpus_per_worker > cpus and capacity.bounded:
        raise ConfigError(
            f"--num-workers {workers} x {cpus_per_worker} CPU each needs {workers * cpus_per_worker} CPUs "
            f"but the cluster has at most {cpus}; lower --num-workers or --cpus-per-worker"
        )
    biggest = max((c for c, _ in capacity.nodes), default=0) if not capacity.autoscaling else 0
    if biggest and cfg.cpus_per_worker > biggest:
        raise ConfigError(
            f"--cpus-per-worker {cfg.cpus_per_worker}: the cluster's biggest node has {biggest:g} CPUs and a worker "
            f"runs on one node; lower --cpus-per-worker to {int(biggest)} or less (0: the plan's share)"
        )
    plan = ResourcePlan(
        use_gpu=use_gpu,
        num_workers=workers,
        cpus_per_worker=cpus_per_worker,
        threads_per_worker=0,
        augment_actors=cfg.augment_actors,  # 0: Ray Data tasks, on CPUs and GPUs (see training.stream.ingest)
        augment_cpus=1.0 if use_gpu or cpus > 2 else 0.5,
        placement="PACK" if use_gpu else "SPREAD",
        **shares,
    )
    if capacity.bounded:
        plan = leave_room_for_ingest(plan, capacity, fixed=bool(cfg.cpus_per_worker))
    # CPU training: a worker's torch threads may use its host's cores that Ray Data leaves idle
    # between batches (SPREAD puts ceil(workers / hosts) workers on each host), but no more cores
    # than the machine has: nodes that claim more CPUs than it (`ray start --num-cpus`, several
    # nodes on one machine) would have the workers' threads spin against each other
    host_cpus = cpus // capacity.hosts if cpus else 0
    if capacity.host_cores:
        host_cpus = min(host_cpus, capacity.host_cores)
    cores_per_worker = host_cpus // math.ceil(workers / capacity.hosts) if cpus else cpus_per_worker
    whole_cpus = max(1, int(plan.cpus_per_worker))
    threads = cfg.threads_per_worker or (whole_cpus if use_gpu else max(1, cores_per_worker))
    return dataclasses.replace(plan, threads_per_worker=threads)


MIN_CPUS = 0.25  # the least a train worker, a read/augment task or an augment actor is planned with


def _shares(start: float, *, whole: bool) -> list[float]:
    """Candidate CPU shares from `start` down: whole CPUs, then fractions down to MIN_CPUS."""
    out = [float(c) for c in range(int(start), 0, -1)] if whole else [start]
    steps = round((1 - MIN_CPUS) / CPU_STEP)
    return out + [round(1 - CPU_STEP * k, 2) for k in range(1, steps + 1) if 1 - CPU_STEP * k < out[-1]]


def leave_room_for_ingest(plan: ResourcePlan, capacity: Capacity, *, fixed: bool) -> ResourcePlan:
    """The plan, with CPU shares lowered until, with the train workers placed as Ray places
    them, the nodes they leave can run what Ray Data needs at once; else a ConfigError naming
    the numbers. GPU plans lower the augment actors' CPUs first (a GPU trainer's CPU feeds
    its GPU), CPU plans the trainers' (their torch threads are set apart from the share);
    --cpus-per-worker fixes the trainers'."""
    nodes = capacity.node_list()
    trainer_shares = [plan.cpus_per_worker] if fixed else _shares(plan.cpus_per_worker, whole=True)
    augment_shares = _shares(plan.augment_cpus, whole=False)
    pairs = (
        [(t, a) for t in trainer_shares for a in augment_shares]
        if plan.use_gpu
        else [(t, a) for a in augment_shares for t in trainer_shares]
    )
    for cpw, aug in pairs:
        candidate = dataclasses.replace(plan, cpus_per_worker=cpw, augment_cpus=aug)
        counts = place_workers(nodes, plan.num_workers, candidate.worker, spread=plan.placement == "SPREAD")
        if counts is not None and tasks_fit(left_over(nodes, counts, candidate.worker), candidate.ingest_tasks()):
            return candidate
    left = capacity.cpus - plan.num_workers * plan.cpus_per_worker
    need = sum(c for c, _ in plan.ingest_tasks())
    if fixed:
        raise ConfigError(
            f"--num-workers {plan.num_workers} x --cpus-per-worker {plan.cpus_per_worker:g} leave Ray Data "
            f"{max(left, 0):g} of the cluster's {capacity.cpus} CPUs, but reading and augmenting need at least "
            f"{MIN_CPUS * len(plan.ingest_tasks()):g} on a node beside the workers; lower --cpus-per-worker or "
            "--num-workers, or drop --cpus-per-worker to let the plan share the CPUs"
        )
    raise ConfigError(
        f"{plan.num_workers} train worker(s) at {MIN_CPUS:g} CPU or more each leave Ray Data too little of the "
        f"cluster's {capacity.cpus} CPUs: reading and augmenting need {need:g} ({MIN_CPUS:g} at the least) on a "
        "node beside the workers; lower --num-workers" + (" or --augment-actors" if plan.augment_actors else "")
    )


def wait_for_a_plan(
    cfg: TrainConfig, wait_s: float, poll_s: float = 2.0, share: Capacity | None = None
) -> ResourcePlan:
    """A plan for the nodes alive now (`share`: for that part of the cluster, a sweep trial's),
    waiting up to `wait_s` for nodes to join where none fits; the last ConfigError after that
    (it names what is missing and the flags that help)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            now = cluster_capacity()
            return plan_resources(cfg, share_now(share, now) if share else now)
        except ConfigError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(poll_s)


CPU_STEP = 0.05  # fractional shares are multiples of this
