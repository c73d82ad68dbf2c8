"""What the train loop's per-step checks cost, next to the step they ride on (not a test).

    python -m bench.loop_checks                 # CPU, 1 torch thread, 3 rounds
    python -m bench.loop_checks --threads 2 --rounds 5

Per batch shape (cifar: 64 x 32 px, imagenet: 32 x 224 px): the ResNet18 training step
(forward, backward, SGD) on the batch; `view_digest` of the batch (the per-epoch digest
of augmented views); the key bookkeeping (`torch.unique` over an epoch's keys, once per
epoch, shown per batch); and handing a batch through `BatchFeed` (the feed thread and its
one-batch queue) against iterating the batches directly. The variants alternate within
each round; every round is printed, then the medians and the share of the step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from augment.ops import Normalize
from training.config import TrainConfig
from training.model import resnet18
from training.worker.feed import BatchFeed
from training.worker.learner import Learner, build_optimizer, build_scheduler
from training.worker.loop import view_digest
from training.worker.recipe import build_ema, class_weights

SHAPES = {"cifar 64 x 32 px": (64, 32, True), "imagenet 32 x 224 px": (32, 224, False)}


def cpu_learner(cfg: TrainConfig, model: torch.nn.Module, steps_per_epoch: int, class_counts: tuple = ()) -> Learner:
    """A single-process CPU learner (no DDP, a mid-grey Normalize): for the benchmarks and tests
    that run steps outside Ray Train; `steps_per_epoch`: optimiser steps."""
    optimizer = build_optimizer(cfg, model)
    weight = class_weights(class_counts) if cfg.class_weights == "balanced" else None
    return Learner(
        cfg=cfg,
        device=torch.device("cpu"),
        model=model,
        bare=model,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg, optimizer, steps_per_epoch),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        normalize=Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
        ema=build_ema(model, cfg.model_ema),
        class_weight=torch.tensor(weight, dtype=torch.float32) if weight else None,
    )


def _learner(size_small: bool) -> Learner:
    torch.manual_seed(0)
    return cpu_learner(TrainConfig(batch_size=64), resnet18(10, small_stem=size_small), 100)


def _time(fn, repeat: int) -> float:
    """Median seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _feed_overhead(batches: list[dict], repeat: int) -> tuple[float, float]:
    direct = _time(lambda: sum(1 for _ in iter(batches)), repeat) / len(batches)
    fed = _time(lambda: sum(1 for _ in BatchFeed(iter(batches))), repeat) / len(batches)
    return direct, fed


def _round(learner: Learner, batch: dict, epoch_keys: list[torch.Tensor]) -> tuple[float, ...]:
    """(train step, view_digest, unique keys per batch, direct hand-over, BatchFeed hand-over) in seconds."""
    step = _time(lambda: learner.train_step(batch, epoch=0, step=0, rank=0), 3)
    digest = _time(lambda: view_digest(batch["image"], batch["key"]), 5)
    unique = _time(lambda: torch.unique(torch.cat(epoch_keys)), 5) / len(epoch_keys)
    return (step, digest, unique, *_feed_overhead([batch] * 200, 5))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a CPU train worker's)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the variants alternate within each")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); ms per batch")
    print("| batch | round | train step | view_digest | unique keys | direct | via BatchFeed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (b, size, small) in SHAPES.items():
        learner = _learner(small)
        g = torch.Generator().manual_seed(0)
        batch = {
            "image": torch.randint(0, 256, (b, size, size, 3), dtype=torch.uint8, generator=g),
            "label": torch.randint(0, 10, (b,), generator=g),
            "key": torch.randint(0, 2**62, (b,), generator=g),
        }
        epoch_keys = [torch.randint(0, 2**62, (b,), generator=g) for _ in range(200)]
        rows = []
        for r in range(1, args.rounds + 1):
            rows.append(_round(learner, batch, epoch_keys))
            cells = " | ".join(f"{1000 * v:.3f}" for v in rows[-1])
            print(f"| {name} | {r} | {cells} |", flush=True)
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        print(f"| {name} | median | " + " | ".join(f"{1000 * v:.3f}" for v in med) + " |")
        share = (med[1] + med[2] + med[4] - med[3]) / med[0]
        print(f"| {name} | checks / step | {100 * share:.2f} % | | | | |")


if __name__ == "__main__":
    main()
