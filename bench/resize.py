"""Progressive resizing against a fixed size: wall time and final accuracy, side by side (not a test).

    python -m bench.resize --make-shapes /tmp/shapes                 # the photo tree, once
    python -m bench.resize --data /tmp/shapes --rounds 2 --json resize.json
    python -m bench.resize --data /tmp/shapes --variant progressive --json resize.json   # one run, appended
    python -m bench.resize --json resize.json --table                 # the table of what the file holds

Two variants of `python -m jobs.train` on the same data, preset, seed, batch and epochs, each in
a fresh process (its own local Ray): **fixed** trains every epoch at --image-size; **progressive**
adds --progressive-resize (FFCV's late ramp: the low size for the first half, the full size for
the last third). Evaluation runs at --image-size in both. `--rounds` alternates their order;
every run is reported, with wall time (launch to exit), steady img/s and the final val_acc.

The photo tree (`--make-shapes`): photo-sized JPEGs (300x400 .. 427x640, the smooth synthetic
backgrounds of bench/augment.py) each with one shape whose kind is the class (ellipse,
rectangle, triangle, cross, ring) at a random place, size and colour: a task a ResNet18 learns
in a few epochs on a CPU, where telling the shapes apart needs some resolution.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SHAPES = ("ellipse", "rectangle", "triangle", "cross", "ring")


def _write_shape(job: tuple[str, int, int]) -> None:
    import numpy as np
    from PIL import Image, ImageDraw

    from bench.augment import PHOTO_SIZES, synthetic_photo

    path, i, label = job
    h, w = PHOTO_SIZES[i % len(PHOTO_SIZES)]
    rng = np.random.default_rng(10_000 + i)
    img = Image.fromarray(synthetic_photo(h, w, i))
    draw = ImageDraw.Draw(img)
    r = rng.uniform(0.12, 0.3) * min(h, w)
    cy, cx = rng.uniform(r, h - r), rng.uniform(r, w - r)
    colour = tuple(int(c) for c in rng.integers(0, 256, 3))
    box = (cx - r, cy - r, cx + r, cy + r)
    kind = SHAPES[label]
    if kind == "ellipse":
        draw.ellipse((cx - r, cy - 0.6 * r, cx + r, cy + 0.6 * r), fill=colour)
    elif kind == "rectangle":
        draw.rectangle((cx - r, cy - 0.6 * r, cx + r, cy + 0.6 * r), fill=colour)
    elif kind == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    elif kind == "cross":
        draw.rectangle((cx - r, cy - r / 4, cx + r, cy + r / 4), fill=colour)
        draw.rectangle((cx - r / 4, cy - r, cx + r / 4, cy + r), fill=colour)
    else:
        draw.ellipse(box, outline=colour, width=max(2, int(r / 4)))
    img.save(path, quality=90)


def make_shapes(out: str, count: int) -> str:
    """COUNT photos as OUT/<shape>/<i>.jpg, the classes in turn."""
    from multiprocessing import Pool

    jobs = []
    for i in range(count):
        label = i % len(SHAPES)
        folder = os.path.join(out, SHAPES[label])
        os.makedirs(folder, exist_ok=True)
        jobs.append((os.path.join(folder, f"{i:05d}.jpg"), i, label))
    with Pool() as pool:
        pool.map(_write_shape, jobs, chunksize=32)
    return out


def run_variant(args, variant: str) -> dict:
    """One jobs.train run; its figures from summary.json and the wall clock."""
    flags = ["--preset", args.preset, "--image-size", str(args.image_size), "--epochs", str(args.epochs)]
    flags += ["--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", "0", "--quiet"]
    if variant == "progressive":
        flags += ["--progressive-resize", args.progressive]
    with tempfile.TemporaryDirectory() as runs:
        cmd = [sys.executable, "-m", "jobs.train", "--data", args.data, "--storage-path", runs, "--name", variant]
        t0 = time.time()
        out = subprocess.run(cmd + flags, cwd=REPO, capture_output=True, text=True)
        wall = time.time() - t0
        if out.returncode != 0:
            raise SystemExit(f"{variant} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        with open(os.path.join(runs, variant, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(runs, variant, "config.json")) as f:
            sizes = json.load(f)["train_image_sizes"]
    return {
        "variant": variant,
        "flags": " ".join(flags),
        "train_image_sizes": sizes,
        "wall_s": round(wall, 1),
        "train_images_per_s": summary["train_images_per_s"],
        "val_acc": summary["val_acc"],
        "best_val_acc": summary["best_val_acc"],
        "startup_s": summary["startup_s"],
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
        "load": os.getloadavg()[0],
    }


def table(runs: list[dict]) -> str:
    lines = [
        "| run | variant | train sizes | wall s | steady img/s | val_acc | best val_acc |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for i, r in enumerate(runs, 1):
        sizes = "→".join(str(s) for s in dict.fromkeys(r["train_image_sizes"]))
        lines.append(
            f"| {i} | {r['variant']} | {sizes} | {r['wall_s']:.1f} | {r['train_images_per_s']:.1f} | "
            f"{r['val_acc']:.4f} | {r['best_val_acc']:.4f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.resize", description=__doc__.split("\n")[0])
    ap.add_argument("--make-shapes", metavar="DIR", help="write the photo tree to DIR and exit")
    ap.add_argument("--photos", type=int, default=1000, help="photos for --make-shapes (default: 1000)")
    ap.add_argument("--data", help="the photo tree to train on")
    ap.add_argument("--preset", default="imagenet", help="a built-in preset or a preset file (default: imagenet)")
    ap.add_argument("--image-size", type=int, default=128, help="the full (and eval) size, px (default: 128)")
    ap.add_argument("--progressive", default="96:3-5", help="--progressive-resize of the progressive variant")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.08, help="jobs.train's --lr (per 256 images; default: 0.08)")
    ap.add_argument("--rounds", type=int, default=1, help="each round runs both variants, alternating the order")
    ap.add_argument("--variant", choices=("fixed", "progressive"), help="run this one variant once")
    ap.add_argument("--json", help="append each run to this JSON file")
    ap.add_argument("--table", action="store_true", help="print the table of --json's runs and exit")
    args = ap.parse_args(argv)
    if args.make_shapes:
        print(f"wrote {make_shapes(args.make_shapes, args.photos)}: {args.photos} photos, {len(SHAPES)} classes")
        return 0
    runs = json.load(open(args.json)) if args.json and os.path.exists(args.json) else []
    if not args.table:
        if not args.data:
            ap.error("--data is required (make one with --make-shapes DIR)")
        order = (
            [[args.variant]]
            if args.variant
            else [["fixed", "progressive"] if i % 2 == 0 else ["progressive", "fixed"] for i in range(args.rounds)]
        )
        for variants in order:
            for variant in variants:
                runs.append(run_variant(args, variant))
                print(json.dumps(runs[-1]), flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(runs, f, indent=1)
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
