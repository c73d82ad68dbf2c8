"""How the train workers and Ray Data share a cluster's CPUs and GPUs (docs/design.md,
"Resources"): where Ray puts the workers, and whether Ray Data's tasks still fit beside them.

Ray Data excludes the train workers' reservations from its own budget, and a Ray task runs
on one node: when no node keeps the CPUs one read/augment task reserves, ingest never
starts and the job waits forever. The planner (training/job.py) checks a plan with these
functions before training; the train loop (training/loop.py) checks the placement Ray
actually made when no batch arrives. Pure arithmetic on (CPUs, GPUs) per node, no Ray calls.
"""

from __future__ import annotations

Node = tuple[float, float]  # (CPUs, GPUs) of one node, or what is left of them
EPS = 1e-9  # Ray keeps resources to 4 decimals; compare with a little slack


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


def left_over(nodes: list[Node], counts: list[int], worker: Node) -> list[Node]:
    """What each node keeps after `counts[i]` workers of size `worker` took their share."""
    return [(c - k * worker[0], g - k * worker[1]) for (c, g), k in zip(nodes, counts, strict=True)]


def tasks_fit(free: list[Node], tasks: list[Node]) -> bool:
    """Whether these tasks (or actors) can all run at once, each on one node (first fit,
    largest first)."""
    room = [list(n) for n in free]
    for cpus, gpus in sorted(tasks, reverse=True):
        node = next((r for r in room if r[0] + EPS >= cpus and r[1] + EPS >= gpus), None)
        if node is None:
            return False
        node[0] -= cpus
        node[1] -= gpus
    return True
