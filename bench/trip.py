"""The trip of one steady training batch through the project's files, counted by a profiler.

    python -m bench.trip                     # the table: each file, its call sites, in trip order
    python -m bench.trip --json trip.json

A CPU run of an image tree (80 JPEGs of 160 x 120, the imagenet preset at 64 px), in this
process: a read task of training/stream/ingest.py's SplitSource (planned before the trip, as
an epoch's read tasks are once an epoch), training/stream/stage.py's AugmentStage on
its first 16 rows, then training/worker/'s BatchFeed, learner.py's Learner.train_step and loop.py's EpochMeter.
The batch goes through once to warm up, then once traced: every call of a project function
from a project function in another file is a call site (caller function -> callee function,
counted once however many images call it). docs/design.md, "The trip of one steady training
batch", reads the table. Not a test: the count is a reader's measure, not a promise.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1]) + "/"


def _tree(root: Path) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
        for i in range(40):
            pixels = rng.integers(0, 255, (120, 160, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i}.jpg", quality=90)


def _batch_runner(root: str):
    """One batch, read task to optimiser step, as a function to call twice."""
    import pyarrow as pa
    import torch

    from augment.presets import PRESETS
    from bench.loop_checks import cpu_learner
    from training.config import TrainConfig
    from training.forms.formats import scan_data
    from training.model import build_model
    from training.rows import EPOCH, IMAGE, KEY, LABEL
    from training.stream.ingest import SplitSource
    from training.stream.stage import AugmentStage, StageArgs
    from training.worker.feed import BatchFeed
    from training.worker.loop import EpochMeter

    tree = scan_data(root, 0.2)
    preset = PRESETS["imagenet"].at_size(64)
    # the read tasks are planned once an epoch (the file order, the clock's epoch): not on the trip
    read_task = SplitSource(tree.train).get_read_tasks(1)[0]
    stage = AugmentStage(StageArgs.of(preset, train=True, seed=0, shrink=True), device="cpu")
    learner = cpu_learner(TrainConfig(batch_size=16), build_model("resnet18", 2, small_stem=False, image_size=64), 4)
    cpu = torch.device("cpu")

    def one() -> None:
        table = pa.concat_tables(list(read_task())).slice(0, 16)
        rows = stage({c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names})
        batch = {c: torch.as_tensor(rows[c]) for c in (IMAGE, LABEL, KEY, EPOCH)}
        batch[LABEL] = batch[LABEL].long()
        meter = EpochMeter(cpu, 0)
        with BatchFeed(iter([batch]), None, cpu) as feed:
            for b in meter.timed(feed):
                meter.begin_step()
                loss, logits = learner.train_step(b, epoch=0, step=0, rank=0)
                meter.update(b, loss, logits)

    return one


def trace(one) -> dict[str, list[str]]:
    """{file: [caller@file -> callee, ...]} in the order the trip first enters each file."""

    def ours(frame) -> bool:
        f = frame.f_code.co_filename
        return f.startswith(REPO) and "/.venv/" not in f and f"{REPO}bench/" not in f

    sites: dict[str, list[str]] = collections.OrderedDict()

    def profile(frame, event, arg):
        if event != "call" or not ours(frame):
            return
        caller = frame.f_back
        while caller is not None and not ours(caller):
            caller = caller.f_back
        here = frame.f_code.co_filename[len(REPO) :]
        there = caller.f_code.co_filename[len(REPO) :] if caller else ""
        if here != there:
            site = f"{caller.f_code.co_name if caller else ''}@{Path(there).name or 'bench'} -> {frame.f_code.co_name}"
            if site not in sites.setdefault(here, []):
                sites[here].append(site)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        one()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return dict(sites)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trip", description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write {file: [call sites]}")
    args = ap.parse_args(argv)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # SplitSource puts its table there
    try:
        with tempfile.TemporaryDirectory() as tmp:
            _tree(Path(tmp))
            one = _batch_runner(tmp)
            one()  # imports, caches, compiled loops: the trip is the steady batch's
            sites = trace(one)
    finally:
        ray.shutdown()
    print(f"{'file':34} {'sites':>5}  call sites (caller@file -> callee)")
    for f, s in sites.items():
        print(f"{f:34} {len(s):5d}  {'; '.join(s)}")
    print(f"{len(sites)} files, at most {max(map(len, sites.values()))} call sites into one")
    if args.json:
        Path(args.json).write_text(json.dumps(sites, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
