"""The small-image stem's trade-off: accuracy and training img/s at 32, 48 and 64 px with
`--small-stem on` and `off`, side by side in one run (not a test).

    python -m bench.small_stem                               # CPU, digits subset: ~10 minutes
    python -m bench.small_stem --sizes 32 64 --epochs 6 --json small-stem.json

The data is a class-balanced subset of the bundled digits (`--train-images`, +1/4 as many for
validation), written once per size as S x S PNGs (bicubic from the 32 px scans), so that each
size is a tree of thumbnails of that size, as a user's would be. Every run is
`python -m jobs.train --preset cifar --image-size S --small-stem on|off` in a fresh process,
on the same images, epochs, batch and seed; the table gives the best and last validation
accuracy and the steady training img/s (epochs 2+, from summary.json). `--rounds` alternates
the order of the runs; the best round of each counts for speed, the first for accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from bench.train import cpu_model, launch, subset_tree


def sized_tree(src: str, side: int, out: str) -> str:
    """SRC's tree with every image resized to SIDE x SIDE (bicubic), as PNGs under OUT."""
    from PIL import Image

    for dirpath, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".png"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), src)
            os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
            with Image.open(os.path.join(dirpath, name)) as img:
                img.convert("RGB").resize((side, side), Image.BICUBIC).save(os.path.join(out, rel))
    return out


def run(args, data: str, side: int, stem: str, work: str, tag: str) -> dict:
    name = f"stem-{side}-{stem}-{tag}"
    cmd = [sys.executable, "-m", "jobs.train", "--data", data, "--preset", "cifar", "--image-size", str(side)]
    cmd += ["--small-stem", stem, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
    cmd += ["--name", name, "--storage-path", work, "--quiet"]
    t0, t1, lines, rc = launch(cmd, os.path.join(work, f"{name}.log"))
    if rc != 0:
        tail = "\n".join(text for _, text in lines[-15:])
        raise RuntimeError(f"jobs.train failed (exit {rc}); see {work}/{name}.log:\n{tail}")
    with open(os.path.join(work, name, "summary.json")) as f:
        summary = json.load(f)
    return {
        "image_size": side,
        "small_stem": stem,
        "best_val_acc": summary["best_val_acc"],
        "last_val_acc": summary["val_acc"],
        "steady_img_s": summary["train_images_per_s"],
        "startup_s": summary.get("startup_s"),
        "wall_s": round(t1 - t0, 1),
    }


def table(rows: list[dict]) -> str:
    out = [f"{'px':>4} {'stem':>5} {'best val_acc':>13} {'last val_acc':>13} {'img/s':>8} {'on / off speed':>15}"]
    for side in sorted({r["image_size"] for r in rows}):
        pick = {s: [r for r in rows if r["image_size"] == side and r["small_stem"] == s] for s in ("on", "off")}
        fastest = {s: max(rs, key=lambda r: r["steady_img_s"]) for s, rs in pick.items() if rs}
        for stem, rs in pick.items():
            if not rs:
                continue
            first, speed = rs[0], fastest[stem]["steady_img_s"]
            ratio = speed / fastest["off"]["steady_img_s"] if stem == "on" and "off" in fastest else None
            out.append(
                f"{side:>4} {stem:>5} {first['best_val_acc']:>13.4f} {first['last_val_acc']:>13.4f} {speed:>8.1f} "
                f"{'' if ratio is None else f'{ratio:.3f}x':>15}"
            )
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.small_stem", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 48, 64], help="image sides to train at")
    ap.add_argument("--train-images", type=int, default=480, help="class-balanced training subset of the digits")
    ap.add_argument("--epochs", type=int, default=4, help="epochs per run; speed counts epochs 2+")
    ap.add_argument("--batch-size", type=int, default=32, help="global batch size of every run")
    ap.add_argument("--rounds", type=int, default=1, help="run each setting this many times, alternating the order")
    ap.add_argument("--work", help="keep logs and run directories here (default: a temporary directory, removed)")
    ap.add_argument("--json", help="also write every measurement as JSON to this path")
    args = ap.parse_args(argv)

    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="bench-stem-")
    work = args.work or tmp.name
    from training.forms.tree import default_dataset_dir

    base = subset_tree(str(default_dataset_dir()), args.train_images, os.path.join(work, "digits"))
    trees = {s: sized_tree(base, s, os.path.join(work, f"digits-{s}")) for s in args.sizes}
    print(
        f"{cpu_model()}, {os.cpu_count()} cores; {args.train_images} train images, {args.epochs} epochs, "
        f"batch {args.batch_size}",
        flush=True,
    )
    settings = [(s, stem) for s in args.sizes for stem in ("on", "off")]
    rows = []
    for r in range(args.rounds):
        for side, stem in settings if r % 2 == 0 else list(reversed(settings)):
            row = run(args, trees[side], side, stem, work, str(r)) | {"round": r + 1, "load_avg": os.getloadavg()[0]}
            rows.append(row)
            print(
                f"round {r + 1}: {side} px, stem {stem}: val_acc {row['best_val_acc']:.4f}, "
                f"{row['steady_img_s']:.1f} img/s (load {row['load_avg']:.1f})",
                flush=True,
            )
            if args.json:  # after every run: a benchmark stopped part-way keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"settings": vars(args), "cpu": cpu_model(), "rows": rows}, f, indent=2)
    print(table(rows))
    if tmp:
        tmp.cleanup()
    return {"rows": rows}


if __name__ == "__main__":
    main()
