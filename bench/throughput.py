"""Input-pipeline throughput, decoding included, with no model: the datasets exactly as
`jobs.train` builds them, iterated through Ray Data, against the seed's ImageFolder +
DataLoader + torchvision transforms on the same files and cores, side by side (not a test).

    python -m bench.throughput                                # the four cases, 2 rounds, ~8 minutes
    python -m bench.throughput --cases imagenet camera --rounds 3 --json out.json
    python -m bench.throughput --cases cifar --decode augment      # jobs.train's --decode for the ray variant

Cases (trees generated once under --work; building them is not timed):

* imagenet        `imagenet` preset, ImageNet-size JPEGs (quality 90, shorter side 333-500)
* camera          `imagenet` preset, camera-size JPEGs (longer side 3000-4000, quality 90)
* cifar           `cifar` preset, 32x32 PNGs
* cifar-prepared  `cifar` preset, the same PNGs converted by jobs.prepare into Parquet shards
                  (the seed reads the PNG tree: it has no other way)

Variants, each in a fresh process, alternating their order round by round:

* ray   training.forms.formats.scan_data + training.driver.planning.plan_resources on a local cluster of this
        machine's cores + training.stream.ingest.build_datasets (what jobs.train hands its trainer),
        the train split iterated in the driver with iter_torch_batches as the train loop
        does (batch 64; the local shuffle buffer and prefetching from epoch 1 on); Ray
        Data's own stats of the last epoch go to <work>/stats-<case>.txt;
* seed  ImageFolder over the same train files + DataLoader(batch 64, shuffle, workers as
        the seeds advise capped to the cores) + the seed's per-image transforms
        (bench.seed_train), batches iterated, nothing else.

First epoch (process start-up excluded, worker start-up included for both) and steady
state (epochs 2+) are reported apart; `ratio` = ray / seed img/s in the same round.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CASES = {
    "imagenet": {"preset": "imagenet", "tree": "imagenet", "count": 1200},
    "camera": {"preset": "imagenet", "tree": "camera", "count": 80},
    "cifar": {"preset": "cifar", "tree": "cifar", "count": 8000},
    "cifar-prepared": {"preset": "cifar", "tree": "cifar", "count": 8000, "prepared": True},
}


def photo_size(kind: str, i: int) -> tuple[int, int]:
    """(h, w) of photo i: ImageNet-like (shorter side 333-500) or camera-like (longer 3000-4000)."""
    import numpy as np

    rng = np.random.default_rng(i)
    if kind == "camera":
        long = int(rng.integers(3000, 4001))
        short = long * 3 // 4
    else:
        short = int(rng.integers(333, 501))
        long = short * 4 // 3
    return (short, long) if rng.random() < 0.7 else (long, short)  # most photos are landscape


def write_image(kind: str, job: tuple[str, int]) -> None:
    """One file of a generated tree. Camera photos: a smooth photo at 1/8 size, enlarged,
    with grain, so that the JPEG's size and decode time are a camera's (a few MB)."""
    import numpy as np
    from PIL import Image

    from bench.augment import synthetic_photo

    path, i = job
    if kind == "labelled":  # the accuracy check: 1200x900 photos whose class (i % 10) shows
        Image.fromarray(labelled_photo(i)).save(path, quality=90)
        return
    if kind == "cifar":
        Image.fromarray(synthetic_photo(32, 32, i)).save(path)
        return
    h, w = photo_size(kind, i)
    if kind == "camera":
        small = Image.fromarray(synthetic_photo(h // 8, w // 8, i)).resize((w, h), Image.BICUBIC)
        grain = np.random.default_rng(i).integers(-6, 7, (h, w, 1), dtype=np.int16)
        pixels = np.clip(np.asarray(small, dtype=np.int16) + grain, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path, quality=90)
        return
    Image.fromarray(synthetic_photo(h, w, i)).save(path, quality=90)


def labelled_photo(i: int, classes: int = 10):
    """A 900x1200 photo-like image of class i % classes: a smooth random photo (1/4 size,
    enlarged) over stripes whose angle and colour belong to the class, so that a model can
    learn the class from a crop of any size."""
    import numpy as np
    from PIL import Image

    from bench.augment import synthetic_photo

    c, h, w = i % classes, 900, 1200
    photo = np.asarray(Image.fromarray(synthetic_photo(h // 4, w // 4, i)).resize((w, h), Image.BICUBIC), float)
    yy, xx = np.mgrid[0:h, 0:w]
    angle = np.pi * c / classes
    stripes = 0.5 + 0.5 * np.sin((np.cos(angle) * xx + np.sin(angle) * yy) * 2 * np.pi / 40)
    colour = np.array([(c * 97) % 256, (c * 53 + 80) % 256, (c * 31 + 160) % 256], float)
    return np.clip(0.6 * photo + 0.4 * stripes[..., None] * colour, 0, 255).astype(np.uint8)


def make_tree(out: str, kind: str, count: int, classes: int = 10) -> str:
    """OUT/class<k>/<i>.<ext>: `count` generated images of `kind` in `classes` classes, once."""
    from bench.augment import generate_tree

    ext = "png" if kind == "cifar" else "jpg"  # labelled photos: JPEGs too
    return generate_tree(out, count, functools.partial(write_image, kind), classes=classes, ext=ext)


def prepared(tree: str, out: str) -> str:
    if not os.path.exists(os.path.join(out, "_prepared.json")):
        from training.forms.parquet import prepare_tree

        prepare_tree(tree, out, log=lambda *a: None)
    return out


# --------------------------------------------------------------------------- variants (child processes)


def run_ray(
    data: str, preset_name: str, epochs: int, batch: int, stats_path: str, decode: str = "auto", **overrides
) -> dict:
    import ray

    from augment.presets import load_preset
    from training.config import TrainConfig
    from training.driver import planning
    from training.driver.session import connect
    from training.forms.formats import scan_data
    from training.status import BadFileLog
    from training.stream.ingest import build_datasets, choose_decode
    from training.stream.stamp import EpochClock

    connect()
    cfg = TrainConfig(data=data, preset=preset_name, batch_size=batch, epochs=epochs, decode=decode, **overrides)
    tree, preset = scan_data(data, cfg.val_fraction), load_preset(preset_name)
    plan = planning.plan_resources(cfg, planning.cluster_capacity())
    decode = choose_decode(cfg.decode, tree.train, preset.train, plan.use_gpu)
    clock, bad_log = ray.remote(num_cpus=0)(EpochClock).remote(), ray.remote(num_cpus=0)(BadFileLog).remote()
    ds = build_datasets(cfg, tree, preset, plan, clock, bad_log, decode)["train"]
    out = []
    for epoch in range(epochs):
        ray.get(clock.set.remote(epoch))
        first = epoch == 0
        start, cpu, n = time.perf_counter(), time.process_time(), 0
        for b in ds.iter_torch_batches(  # as training/worker/feed.py's train_batches
            batch_size=batch,
            local_shuffle_buffer_size=None if first else min(4 * batch, 2048),
            local_shuffle_seed=epoch,
            prefetch_batches=0 if first else 2,
        ):
            n += len(b["label"])
        # the driver's own CPU per image: what iterating costs the train worker, beside its model
        out.append({"images": n, "s": time.perf_counter() - start, "driver_cpu_s": time.process_time() - cpu})
    with open(stats_path, "w") as f:
        f.write(f"plan: {plan.describe()}; {decode.describe()}\n\n{ds.stats()}\n")
    return {"epochs": out, "plan": plan.describe(), "decode": decode.describe()}


def run_seed(data: str, preset_name: str, epochs: int, batch: int) -> dict:
    import torch

    from bench.seed_train import image_folder, seed_num_workers, seed_transforms

    train_set = image_folder(data, "train", seed_transforms(preset_name, True))
    workers = seed_num_workers(os.cpu_count() or 1)
    loader = torch.utils.data.DataLoader(train_set, batch_size=batch, shuffle=True, num_workers=workers)
    out = []
    for _ in range(epochs):
        start, n = time.perf_counter(), 0
        for x, _ in loader:
            n += x.shape[0]
        out.append({"images": n, "s": time.perf_counter() - start})
    return {"epochs": out, "loader_workers": workers}


def summarize(result: dict) -> dict:
    epochs = result["epochs"]
    steady = epochs[1:] or epochs
    return result | {
        "first_img_s": round(epochs[0]["images"] / epochs[0]["s"], 1),
        "steady_img_s": round(sum(e["images"] for e in steady) / sum(e["s"] for e in steady), 1),
    }


# --------------------------------------------------------------------------- driver


def child(args) -> None:
    if args.variant == "ray":
        pairs = (("augment_actors", args.augment_actors), ("augment_gpus", args.augment_gpus))
        overrides = {k: v for k, v in pairs if v}
        result = run_ray(args.data, args.preset, args.epochs, args.batch_size, args.stats, args.decode, **overrides)
    else:
        result = run_seed(args.data, args.preset, args.epochs, args.batch_size)
    print(json.dumps(summarize(result)), flush=True)


def run_variant(variant: str, case: str, data: str, seed_data: str, args) -> dict:
    cmd = [sys.executable, "-m", "bench.throughput", "--child", variant, "--preset", CASES[case]["preset"]]
    cmd += ["--data", data if variant == "ray" else seed_data, "--epochs", str(args.epochs)]
    cmd += ["--batch-size", str(args.batch_size), "--stats", os.path.join(args.work, f"stats-{case}.txt")]
    cmd += ["--decode", args.decode, "--augment-actors", str(args.augment_actors)]
    cmd += ["--augment-gpus", str(args.augment_gpus)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} on {case} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"variant": variant, "case": case}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), help="which cases (default: all)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both variants per case")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run; steady state = epochs 2+")
    ap.add_argument("--batch-size", type=int, default=64, help="images per batch, both variants")
    ap.add_argument("--work", default="/tmp/bench-throughput", help="generated trees and Ray Data's stats go here")
    ap.add_argument("--json", metavar="FILE", help="write every round's figures here")
    ap.add_argument("--decode", default="auto", help="jobs.train's --decode for the ray variant (default: auto)")
    ap.add_argument("--augment-actors", type=int, default=0, help="jobs.train's --augment-actors for the ray variant")
    ap.add_argument("--augment-gpus", type=float, default=0.0, help="jobs.train's --augment-gpus for the ray variant")
    ap.add_argument("--files", type=int, default=0, help="images per generated tree (default: the case's count)")
    ap.add_argument(
        "--make-tree",
        nargs=3,
        metavar=("KIND", "DIR", "COUNT"),
        help="only write a tree of COUNT images of KIND (imagenet, camera, cifar, labelled) to DIR and exit",
    )
    ap.add_argument("--child", choices=("ray", "seed"), help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--preset", help=argparse.SUPPRESS)
    ap.add_argument("--stats", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.make_tree:
        kind, out, count = args.make_tree
        make_tree(out, kind, int(count))
        return []
    if args.child:
        args.variant = args.child
        child(args)
        return []
    os.makedirs(args.work, exist_ok=True)
    rows = []
    for case in args.cases:
        spec = CASES[case] | ({"count": args.files} if args.files else {})
        tree = make_tree(os.path.join(args.work, f"{spec['tree']}-{spec['count']}"), spec["tree"], spec["count"])
        data = prepared(tree, tree + "-prepared") if spec.get("prepared") else tree
        for r in range(args.rounds):
            order = ("seed", "ray") if r % 2 == 0 else ("ray", "seed")
            got = {v: run_variant(v, case, data, tree, args) for v in order}
            row = {
                "case": case,
                "round": r + 1,
                "order": list(order),
                **{f"{v}_{k}": got[v][k] for v in ("ray", "seed") for k in ("first_img_s", "steady_img_s")},
                "ratio_steady": round(got["ray"]["steady_img_s"] / got["seed"]["steady_img_s"], 2),
                "ratio_first": round(got["ray"]["first_img_s"] / got["seed"]["first_img_s"], 2),
                "images": got["ray"]["epochs"][0]["images"],
                "plan": got["ray"]["plan"] + "; " + got["ray"]["decode"],
                "runs": got,
            }
            rows.append(row)
            print(
                f"{case:<15} round {r + 1} ({order[0]} first): ray {row['ray_steady_img_s']:>7.1f} img/s steady, "
                f"{row['ray_first_img_s']:>7.1f} first | seed {row['seed_steady_img_s']:>7.1f} steady, "
                f"{row['seed_first_img_s']:>7.1f} first | ratio {row['ratio_steady']:.2f} steady, "
                f"{row['ratio_first']:.2f} first",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "epochs": args.epochs, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
