"""Runs stopped at random moments, then resumed by the same command: each trial starts a plain
local `jobs.train` (its own Ray), stops it at a random time with a random one of Ctrl-C, SIGTERM
or `kill -9` of its process group, checks that no process of it is left, runs the same command
again and checks that the run reached its last epoch with every image trained on exactly once
per epoch. Not a test (tests/test_interruptions.py runs one SIGTERM and one kill -9 trial).

    python -m bench.interrupt --trials 10                 # seed 0, 3 epochs of 80 images each
    python -m bench.interrupt --trials 30 --seed 4 --json interrupt.json

Columns: trial, how, after_s (when the stop came, from the start), first_rc, left (processes of
the first attempt alive 60 s after the stop), rerun_rc, resumed_at, exact (coverage exact in
every epoch). Exit 1 if any trial has left > 0, rerun_rc != 0 or exact false.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import write_json

HOW = ("sigint", "sigterm", "kill-9-group")


def _tree(root: Path) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(40):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / c / f"{i:03d}.png")
    return root


def alive(pids: set[int]) -> set[int]:
    """The processes of `pids` still running (a zombie is not)."""
    import psutil

    def up(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return {p for p in pids if up(p)}


def descendants(pid: int) -> set[int]:
    """Every process `pid` started, and theirs (a plain local run's embedded cluster among them)."""
    import psutil

    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def trial(i: int, rng: random.Random, data: Path, work: Path) -> dict:
    runs = work / f"runs-{i}"
    args = [sys.executable, "-m", "jobs.train", "--data", str(data), "--epochs", "3", "--batch-size", "16"]
    args += ["--small-stem", "off", "--storage-path", str(runs), "--name", "r", "--quiet"]
    env = {**os.environ, "RAY_ADDRESS": ""}
    how, after = rng.choice(HOW), rng.uniform(10, 60)  # from the start: Ray starting, or any epoch
    start = time.time()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    first = subprocess.Popen(args, env=env, start_new_session=True, **quiet)
    while time.time() - start < after and first.poll() is None:
        time.sleep(0.1)
    ours = descendants(first.pid)
    if first.poll() is None:
        if how == "kill-9-group":
            os.killpg(first.pid, signal.SIGKILL)
        else:
            first.send_signal(signal.SIGINT if how == "sigint" else signal.SIGTERM)
    first_rc = first.wait(timeout=300)
    deadline = time.time() + 60
    while alive(ours) and time.time() < deadline:
        time.sleep(0.5)
    rerun = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    summary = runs / "r" / "summary.json"
    s = json.loads(summary.read_text()) if summary.exists() else {}
    return {
        "trial": i,
        "how": how,
        "after_s": round(after, 1),
        "first_rc": first_rc,
        "left": len(alive(ours)),
        "rerun_rc": rerun.returncode,
        "resumed_at": s.get("resumed_at_epochs"),
        "exact": bool(s.get("coverage")) and all(c["exactly_once"] for c in s["coverage"]) and s["epochs"] == 3,
        "rerun_tail": "" if rerun.returncode == 0 else (rerun.stdout + rerun.stderr)[-2000:],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.interrupt", description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5, help="runs to stop and resume (default: 5)")
    ap.add_argument("--seed", type=int, default=0, help="the stops' seed: how and when (default: 0)")
    ap.add_argument("--json", metavar="FILE", help="write every trial's figures")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-interrupt-") as tmp:
        data = _tree(Path(tmp) / "data")
        head = f"{'trial':>5}  {'how':<13} {'after_s':>7}  {'first_rc':>8}  {'left':>4}  {'rerun_rc':>8}"
        print(f"{head}  resumed_at  exact")
        for i in range(args.trials):
            rows.append(trial(i, rng, data, Path(tmp)))
            r = rows[-1]
            print(
                f"{r['trial']:>5}  {r['how']:<13} {r['after_s']:>7.1f}  {r['first_rc']!s:>8}  {r['left']:>4}  "
                f"{r['rerun_rc']:>8}  {r['resumed_at']!s:<10}  {r['exact']}",
                flush=True,
            )
    if args.json:
        write_json(args.json, {"seed": args.seed, "trials": rows})
    bad = [r for r in rows if r["left"] or r["rerun_rc"] or not r["exact"]]
    for r in bad:
        print(f"trial {r['trial']} ({r['how']} at {r['after_s']} s): {r['rerun_tail']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
