"""The driver's peak memory of `jobs.predict` against the number of images: the rows stream from the
Ray Data pipeline into the output (training/predict/scoring.py), so it must not grow with them. Each size
runs jobs.predict in a process of its own (its own local Ray), on a tree of tiny PNGs (the same few
files repeated under new names), with a freshly initialised model.pt of the trainer's format; the
driver's resident memory is sampled every 0.1 s (its own process, not Ray's workers).

    python -m bench.predict_memory                       # 10,000 and 100,000 images, Parquet out
    python -m bench.predict_memory --images 10000 100000 --out-kind csv --json predict-memory.json

Columns: images, out (parquet folder or csv), seconds, img/s, driver peak RSS (MiB), rows written.
The last line gives the largest size's peak over the smallest's (1.00: flat).
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import write_json

REPO = Path(__file__).resolve().parents[1]


def make_tree(root: Path, images: int) -> None:
    """root/<cat|dog>/NNNNNN.png: `images` files, copies of 8 tiny PNGs."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    blobs = []
    for _ in range(8):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, format="PNG")
        blobs.append(buf.getvalue())
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True, exist_ok=True)
    for i in range(images):
        (root / ("cat", "dog")[i % 2] / f"{i:07d}.png").write_bytes(blobs[i % len(blobs)])


def make_model(path: Path) -> None:
    import torch

    from augment.presets import PRESETS
    from training.config import TrainConfig
    from training.driver.results import model_bytes
    from training.forms.tree import scan_tree
    from training.model import resnet18

    with tempfile.TemporaryDirectory() as tmp:
        make_tree(Path(tmp), 4)
        tree = scan_tree(tmp, 0.0)
    torch.manual_seed(0)
    model = resnet18(tree.num_classes, small_stem=False)  # the ImageNet stem: a tenth of the small one's work
    path.write_bytes(model_bytes(model.state_dict(), tree.class_names, PRESETS["cifar"], TrainConfig(small_stem="off")))


def peak_rss(args: list[str]) -> tuple[float, float, str]:
    """(seconds, peak resident MiB of the process itself, its output) of one run."""
    import psutil

    start, peak = time.time(), 0
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watched = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"jobs.predict failed ({proc.returncode}):\n{out[-3000:]}")
    return time.time() - start, peak / 2**20, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.predict_memory", description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, nargs="+", default=[10_000, 100_000], help="tree sizes to run")
    ap.add_argument("--out-kind", choices=("parquet", "csv"), default="parquet", help="a Parquet folder or one CSV")
    ap.add_argument("--json", metavar="FILE", help="write the figures")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-predict-") as tmp:
        model = Path(tmp) / "model.pt"
        make_model(model)
        print(f"{'images':>8}  {'out':<8} {'seconds':>8} {'img/s':>7} {'peak MiB':>9}  rows")
        for n in args.images:
            data, out = Path(tmp) / f"data-{n}", Path(tmp) / f"out-{n}"
            make_tree(data, n)
            target = str(out) + "/" if args.out_kind == "parquet" else f"{out}.csv"
            cmd = [sys.executable, "-m", "jobs.predict", "--model", str(model), "--data", str(data), "--out", target]
            seconds, peak, printed = peak_rss(cmd)
            wrote = next((line for line in printed.splitlines() if line.startswith("wrote ")), "")
            rows.append({"images": n, "out": args.out_kind, "seconds": round(seconds, 1), "peak_mib": round(peak, 1)})
            rows[-1]["images_per_s"] = round(n / seconds, 1)
            rows[-1]["wrote"] = wrote
            print(f"{n:>8}  {args.out_kind:<8} {seconds:>8.1f} {n / seconds:>7.0f} {peak:>9.1f}  {wrote}", flush=True)
            shutil.rmtree(data)  # the temporary tree of this script's own
    ratio = rows[-1]["peak_mib"] / rows[0]["peak_mib"]
    print(f"peak at {rows[-1]['images']:,} images / at {rows[0]['images']:,}: {ratio:.2f}")
    write_json(args.json, {"runs": rows, "peak_ratio": round(ratio, 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
