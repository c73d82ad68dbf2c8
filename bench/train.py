"""End-to-end training throughput: `jobs.train` against the seed's plain script and the
synthetic-batch ceiling, side by side in one run (not a test).

    python -m bench.train                                   # CPU, digits subset, 3 epochs: 5-10 minutes
    python -m bench.train --train-images 0 --rounds 2       # the whole digits train set, twice
    python -m bench.train --json bench-train.json
    make bench-train ARGS="--epochs 4"
    # one GPU (bench/gpu.sh): ResNet18 at 224 px in bf16 on a generated photo tree
    python -m bench.train --make-photos /tmp/photos --photos 20000
    python -m bench.train --data /tmp/photos --preset imagenet --device cuda --amp bf16 --batch-size 256 --epochs 4

Three variants on the same data, model, global batch and epochs, each in a fresh process:

* plain      the seed's script (bench/seed_train.py): ImageFolder + DataLoader(workers as the
             seeds advise, capped to the cores) + per-image torchvision transforms + ResNet18
             + SGD, one process, torch threads = cores;
* jobs.train `python -m jobs.train ... --storage-path <tmp>` (a fresh local Ray each time);
             its summary.json gives steady img/s (epochs 2+) and timings.csv the epochs;
* synthetic  the project's model and optimizer on random batches already on the device;
* floor      bench/ray_floor.py: the same local Ray and trainer set-up as jobs.train with no
             model and no images, one batch of a trivial Ray Data pipeline. Its first batch
             is the start-up Ray Train + Ray Data cost before any of the project's work.

Steady-state img/s counts epochs 2+ (training steps only, validation excluded) for both
plain and jobs.train. Wall time is the process's, launch to exit. Start-up before the first
step is measured by both: time.time() when the first training step finished, less the
launch (jobs.train: summary.json's startup_s, counted from the process's start). An
estimate is printed beside it for both: when the epoch-1 line appeared, less epoch 1's
images at the steady rate. The time to jobs.train's "plan:" line (Python imports +
ray.init + cluster check) is reported too. `--rounds` alternates the variants'
order, and the best round of each counts: other processes only ever slow a run down.

The digits set's 32 px images with the small-image stem make ResNet18 heavy for 2 cores
(tens of img/s), so by default a class-balanced subset of the digits (`--train-images`,
linked, not copied) keeps one round near 5 minutes; `--train-images 0` uses every image.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EPOCH1 = re.compile(r"\bepoch\s+1/\d+\b")  # jobs.train's epoch-1 line: "epoch   1/3  loss ..."


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- data


def subset_tree(root: str, train_images: int, out: str, val_fraction: float = 0.2) -> str:
    """A class-balanced subset of ROOT's split as OUT/train/<class>/ + OUT/val/<class>/, as
    symlinks: the first files of each class in path order, round-robin over classes."""
    from training.forms.tree import scan_tree

    tree = scan_tree(root, val_fraction)
    for split_name, split, n in (("train", tree.train, train_images), ("val", tree.val, max(1, train_images // 4))):
        by_class: dict[int, list[str]] = {}
        for path, label in sorted(zip(split.paths, split.labels, strict=True)):
            by_class.setdefault(label, []).append(path)
        picked, i = [], 0
        while len(picked) < min(n, len(split)):
            for label in sorted(by_class):
                if i < len(by_class[label]) and len(picked) < n:
                    picked.append((by_class[label][i], label))
            i += 1
        for path, label in picked:
            folder = os.path.join(out, split_name, tree.class_names[label])
            os.makedirs(folder, exist_ok=True)
            os.symlink(os.path.abspath(path), os.path.join(folder, os.path.basename(path)))
    return out


def _write_photo(job: tuple[str, int]) -> None:
    from PIL import Image

    from bench.augment import PHOTO_SIZES, synthetic_photo

    path, i = job
    Image.fromarray(synthetic_photo(*PHOTO_SIZES[i % len(PHOTO_SIZES)], i)).save(path, quality=90)


def make_photos(out: str, count: int, classes: int = 10) -> str:
    """COUNT smooth synthetic JPEG photos (300x400 .. 427x640) as OUT/<class>/<i>.jpg, for
    the imagenet preset where no photo tree is at hand (the GPU benchmark)."""
    from bench.augment import generate_tree

    return generate_tree(out, count, _write_photo, classes=classes, chunksize=64)


# --------------------------------------------------------------------------- variants


def launch(cmd: list[str], log_path: str) -> tuple[float, float, list[tuple[float, str]], int]:
    """Run CMD, timestamping each output line; (launch time, exit time, lines, return code)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    with open(log_path, "w", buffering=1) as log:  # line-buffered: follow it with tail -f
        for line in proc.stdout:
            lines.append((time.time() - t0, line.rstrip("\n")))
            log.write(f"{lines[-1][0]:8.2f}  {line}")
    rc = proc.wait()
    return t0, time.time(), lines, rc


def _startup_estimate(lines, epoch1_images: int, steady_img_s: float) -> float | None:
    """When the epoch-1 line appeared, less epoch 1's images at the steady rate."""
    at = next((t for t, line in lines if EPOCH1.search(line)), None)
    return round(at - epoch1_images / steady_img_s, 1) if at is not None and steady_img_s else None


def common_flags(args) -> list[str]:
    return [
        "--preset",
        args.preset,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--amp",
        args.amp,
        "--device",
        args.device,
    ]


def run_plain(args, data: str, work: str, tag: str) -> dict:
    cmd = [sys.executable, "-m", "bench.seed_train", "--data", data, *common_flags(args)]
    if args.loader_workers:
        cmd += ["--loader-workers", str(args.loader_workers)]
    t0, t1, lines, rc = launch(cmd, os.path.join(work, f"plain-{tag}.log"))
    if rc != 0:
        raise RuntimeError(
            f"plain script failed (exit {rc}); see {work}/plain-{tag}.log:\n"
            + "\n".join(text for _, text in lines[-15:])
        )
    res = json.loads(lines[-1][1])
    return {
        "variant": "plain",
        "steady_img_s": res["steady_img_s"],
        "wall_s": round(t1 - t0, 1),
        "first_step_s": round(res["t_first_step"] - t0, 1),  # measured
        "startup_est_s": _startup_estimate(lines, res["epochs"][0]["images"], res["steady_img_s"]),
        "epochs": res["epochs"],
        "loader_workers": res["loader_workers"],
        "threads": res["threads"],
    }


def run_job(args, data: str, work: str, tag: str) -> dict:
    name = f"bench-{tag}"
    cmd = [
        sys.executable,
        "-m",
        "jobs.train",
        "--data",
        data,
        *common_flags(args),
        "--name",
        name,
        "--storage-path",
        work,
    ]
    cmd += args.job_args
    t0, t1, lines, rc = launch(cmd, os.path.join(work, f"job-{tag}.log"))
    if rc != 0:
        raise RuntimeError(
            f"jobs.train failed (exit {rc}); see {work}/job-{tag}.log:\n" + "\n".join(text for _, text in lines[-15:])
        )
    run_dir = os.path.join(work, name)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    timings = read_timings(os.path.join(run_dir, "timings.csv"))
    steady = summary["train_images_per_s"]
    epoch1_images = round(timings[0]["epoch_s"] * timings[0]["images_per_s"])
    plan_at = next((t for t, line in lines if line.startswith("plan:")), None)
    return {
        "variant": "jobs.train",
        "steady_img_s": steady,
        "wall_s": round(t1 - t0, 1),
        "first_step_s": summary.get("startup_s"),  # measured by the job: process start to the end of its first step
        "startup_est_s": _startup_estimate(lines, epoch1_images, steady),
        "to_plan_line_s": round(plan_at, 1) if plan_at is not None else None,  # imports + ray.init
        "summary_wall_s": summary["wall_s"],  # jobs.train's own figure: from after ray.init to the end
        "epoch_s_sum": round(sum(t["epoch_s"] for t in timings), 1),
        "data_wait_frac": summary.get("data_wait_frac"),
        "timings": timings,
    }


def read_timings(path: str) -> list[dict]:
    """A run's timings.csv, a dict an epoch: its figures as numbers, its words (`bound`) as they are."""

    def cell(value: str):
        try:
            return float(value)
        except ValueError:
            return value

    with open(path) as f:
        return [{k: cell(v) for k, v in row.items()} for row in csv.DictReader(f)]


def run_synthetic(args, work: str, tag: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.seed_train",
        "--synthetic",
        "--steps",
        str(args.synthetic_steps),
        "--preset",
        args.preset,
        "--batch-size",
        str(args.batch_size),
        "--amp",
        args.amp,
        "--device",
        args.device,
    ]
    t0, t1, lines, rc = launch(cmd, os.path.join(work, f"synthetic-{tag}.log"))
    if rc != 0:
        raise RuntimeError(f"synthetic run failed (exit {rc}):\n" + "\n".join(text for _, text in lines[-15:]))
    res = json.loads(lines[-1][1])
    return {
        "variant": "synthetic",
        "steady_img_s": res["steady_img_s"],
        "wall_s": round(t1 - t0, 1),
        "first_step_s": round(res["t_first_step"] - t0, 1),
        "startup_est_s": None,
    }


def run_floor(args, work: str, tag: str) -> dict:
    cmd = [sys.executable, "-m", "bench.ray_floor"]
    t0, t1, lines, rc = launch(cmd, os.path.join(work, f"floor-{tag}.log"))
    if rc != 0:
        raise RuntimeError(f"floor run failed (exit {rc}):\n" + "\n".join(text for _, text in lines[-15:]))
    res = json.loads(lines[-1][1])
    return {
        "variant": "floor",
        "steady_img_s": None,
        "wall_s": round(t1 - t0, 1),
        "first_step_s": res["first_batch_s"],
        "loop_start_s": res["loop_start_s"],
        "startup_est_s": None,
    }


# --------------------------------------------------------------------------- report


def best(rows: list[dict], variant: str) -> dict:
    return max((r for r in rows if r["variant"] == variant), key=lambda r: r["steady_img_s"])


def table(rows: list[dict]) -> tuple[str, dict]:
    plain, job, synth = best(rows, "plain"), best(rows, "jobs.train"), best(rows, "synthetic")
    ratios = {
        "job_over_plain_steady": round(job["steady_img_s"] / plain["steady_img_s"], 3),
        "input_bound_ratio": round(job["steady_img_s"] / synth["steady_img_s"], 3),  # jobs.train / ceiling
        "plain_over_ceiling": round(plain["steady_img_s"] / synth["steady_img_s"], 3),
        "job_over_plain_wall": round(job["wall_s"] / plain["wall_s"], 3),
    }
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    out = [
        f"{'variant':<12} {'steady img/s':>12} {'wall s':>8} {'first step s':>13} {'start-up est s':>15} "
        f"{'/ plain':>8} {'/ ceiling':>10}"
    ]
    for r in (plain, job, synth):
        out.append(
            f"{r['variant']:<12} {r['steady_img_s']:>12.1f} {r['wall_s']:>8.1f} {fmt(r['first_step_s']):>13} "
            f"{fmt(r['startup_est_s']):>15} "
            f"{r['steady_img_s'] / plain['steady_img_s']:>7.2f}x {r['steady_img_s'] / synth['steady_img_s']:>9.2f}x"
        )
    out.append(
        f"jobs.train: {fmt(job['to_plan_line_s'])} s to its plan line (imports + ray.init), data wait "
        f"{100 * (job['data_wait_frac'] or 0):.0f}% of epochs 2+, "
        f"{job['wall_s'] - job['epoch_s_sum']:.1f} s of its wall outside training epochs"
    )
    floors = [r for r in rows if r["variant"] == "floor"]
    if floors:
        floor = min(floors, key=lambda r: r["first_step_s"])
        ratios["job_first_step_over_floor"] = (
            round(job["first_step_s"] / floor["first_step_s"], 3) if job["first_step_s"] else None
        )
        out.append(
            f"floor (Ray Train + Ray Data, no work): train loop starts at {floor['loop_start_s']:.1f} s, first "
            f"batch at {floor['first_step_s']:.1f} s; "
            f"jobs.train's first step {fmt(job['first_step_s'])} s"
        )
    return "\n".join(out), ratios


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="image tree; default: the bundled digits (32 px PNGs)")
    ap.add_argument(
        "--train-images",
        type=int,
        default=448,
        help="use a class-balanced subset of this many training images (+1/4 as many for validation); 0 = all",
    )
    ap.add_argument(
        "--preset",
        default="cifar",
        choices=("cifar", "imagenet"),
        help="augmentation preset on both sides (cifar: 32 px, small stem; imagenet: 224 px)",
    )
    ap.add_argument("--epochs", type=int, default=3, help="epochs per training run; steady state counts epochs 2+")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch size, the same for every variant")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where every variant trains")
    ap.add_argument(
        "--amp", default="off", choices=("off", "bf16", "fp16"), help="autocast on every variant (bf16 on a GPU)"
    )
    ap.add_argument(
        "--loader-workers",
        type=int,
        default=0,
        help="the plain script's DataLoader workers; 0 = the seeds' advice capped to the cores",
    )
    ap.add_argument("--synthetic-steps", type=int, default=12, help="timed steps of the synthetic ceiling")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every variant this many times, alternating the order; the best of each counts",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["plain", "job", "synthetic", "floor"],
        choices=("plain", "job", "synthetic", "floor"),
        help="which to run",
    )
    ap.add_argument(
        "--job-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="further flags for jobs.train (must come last), e.g. --job-args --augment-actors 2",
    )
    ap.add_argument("--work", help="keep logs and run directories here (default: a temporary directory, removed)")
    ap.add_argument("--json", help="also write every measurement and the ratios as JSON to this path")
    ap.add_argument(
        "--make-photos", metavar="DIR", help="only write --photos synthetic JPEG photos as DIR/<class>/ and exit"
    )
    ap.add_argument("--photos", type=int, default=20000, help="--make-photos: how many")
    args = ap.parse_args(argv)
    if args.make_photos:
        make_photos(args.make_photos, args.photos)
        print(f"wrote {args.photos} photos under {args.make_photos}")
        return {}

    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="bench-train-")
    work = args.work or tmp.name
    os.makedirs(work, exist_ok=True)
    from training.forms.tree import default_dataset_dir

    data = args.data or str(default_dataset_dir())
    if args.train_images:
        data = subset_tree(data, args.train_images, os.path.join(work, "data"))
    machine = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_start": os.getloadavg(),
    }
    print(
        f"{machine['cpu']}, {machine['cores']} cores, load {machine['load_avg_start'][0]:.1f}; data {data}; "
        f"{args.preset}, batch {args.batch_size}, {args.epochs} epochs, device {args.device}, amp {args.amp}",
        flush=True,
    )

    runners = {
        "plain": lambda tag: run_plain(args, data, work, tag),
        "job": lambda tag: run_job(args, data, work, tag),
        "synthetic": lambda tag: run_synthetic(args, work, tag),
        "floor": lambda tag: run_floor(args, work, tag),
    }
    rows = []
    for r in range(args.rounds):
        order = args.variants if r % 2 == 0 else list(reversed(args.variants))
        for variant in order:
            row = runners[variant](f"{variant}-{r}") | {"round": r + 1, "load_avg": os.getloadavg()[0]}
            rows.append(row)
            if args.json:  # after every variant: a run stopped part-way keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(
                        {
                            "machine": machine,
                            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "work")},
                            "data": data,
                            "rows": rows,
                        },
                        f,
                        indent=2,
                    )
            rate = (
                f"first batch at {row['first_step_s']:.1f} s"
                if row["variant"] == "floor"
                else f"{row['steady_img_s']:>8.1f} img/s steady"
            )
            print(
                f"round {r + 1}: {row['variant']:<11} {rate}, {row['wall_s']:.1f} s wall (load {row['load_avg']:.1f})",
                flush=True,
            )
    result = {
        "machine": machine | {"load_avg_end": os.getloadavg()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "work")},
        "data": data,
        "rows": rows,
    }
    if {"plain", "job", "synthetic"} <= set(args.variants):
        text, ratios = table(rows)
        print("\n" + text)
        result["ratios"] = ratios
        print(
            f"jobs.train / plain (steady): {ratios['job_over_plain_steady']:.2f}x; input-bound ratio (jobs.train / "
            f"synthetic): {ratios['input_bound_ratio']:.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if tmp:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
