"""Torch threads per CPU worker on nodes that claim more CPUs than their machine has: the
threads the planner gave before it knew the machine's cores, against what it gives now,
side by side in one run (not a test).

    python -m bench.threads                      # 2 nodes x 2 CPUs on this machine, 2 workers: ~5 minutes
    python -m bench.threads --rounds 3 --json bench/results/threads.json

The cluster is the tests' kind (ray.cluster_utils.Cluster: `--nodes` nodes of `--node-cpus`
CPUs, all on this machine). Every run is `python -m jobs.train --num-workers W` joined to it
through RAY_ADDRESS, on the same subset of the bundled digits, epochs, batch and seed:

* claimed  `--threads-per-worker` = the node CPUs per worker (the rule before the planner
           capped threads at the machine's cores: nodes x CPUs / workers);
* planned  no flag: what the plan line says now.

The table gives each variant's best round: wall time (process start to exit, from
summary.json), start-up to the end of the first step, and steady img/s (epochs 2+).
`--rounds` alternates the order; other processes only ever slow a run down.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from bench import write_json
from bench.train import cpu_model, launch, subset_tree


def one_run(args, data: str, work: str, tag: str, threads: int) -> dict:
    name = f"{tag}-{len(os.listdir(work))}"
    cmd = [sys.executable, "-m", "jobs.train", "--data", data, "--num-workers", str(args.workers)]
    cmd += ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--small-stem", "off"]
    cmd += ["--storage-path", work, "--name", name]
    cmd += ["--threads-per-worker", str(threads)] if threads else []
    _, _, lines, rc = launch(cmd, os.path.join(work, f"{name}.log"))
    if rc != 0:
        sys.exit(f"{tag} run failed (exit {rc}):\n" + "\n".join(line for _, line in lines[-20:]))
    with open(os.path.join(work, name, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(work, name, "config.json")) as f:
        threads = json.load(f)["plan"]["threads_per_worker"]
    return {"variant": tag, "wall_s": s["wall_s"], "startup_s": s["startup_s"], "img_s": s["train_images_per_s"],
            "threads": threads}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--node-cpus", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--train-images", type=int, default=480)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="write the rows and the machine here")
    args = p.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    from training.driver.planning import machine_cores
    from training.forms.tree import default_dataset_dir

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.node_cpus, "include_dashboard": False})
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=args.node_cpus)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    claimed = max(1, args.nodes * args.node_cpus // args.workers)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as work:
            data = subset_tree(str(default_dataset_dir()), args.train_images, os.path.join(work, "data"))
            runs = os.path.join(work, "runs")
            os.makedirs(runs)
            for r in range(args.rounds):
                order = [("claimed", claimed), ("planned", 0)]
                for tag, threads in order if r % 2 == 0 else order[::-1]:
                    rows.append(one_run(args, data, runs, tag, threads) | {"round": r + 1})
                    print(f"round {r + 1} {tag}: {rows[-1]}", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    best = {
        tag: min((row for row in rows if row["variant"] == tag), key=lambda row: row["wall_s"])
        for tag in ("claimed", "planned")
    }
    print(f"\n{args.nodes} nodes x {args.node_cpus} CPUs on {machine_cores()} cores, {args.workers} workers")
    print(f"{'variant':8} {'threads':>7} {'wall s':>7} {'start-up s':>10} {'img/s':>7}   (best round)")
    for tag, row in best.items():
        print(f"{tag:8} {row['threads']:7d} {row['wall_s']:7.1f} {row['startup_s']:10.1f} {row['img_s']:7.1f}")
    ratio = best["claimed"]["wall_s"] / best["planned"]["wall_s"]
    print(f"wall time, claimed / planned: {ratio:.2f}")
    result = {"args": vars(args), "cores": machine_cores(), "cpu": cpu_model(), "rows": rows, "wall_ratio": ratio}
    return write_json(args.json, result)


if __name__ == "__main__":
    main()
