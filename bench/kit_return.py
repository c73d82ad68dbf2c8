"""What comes back from the GPU kit (bench/gpu_kit.py runs its steps): the figures read from
the steps' logs and JSON into feed.json, and the files packed for the lent machine to return.

feed.json holds every FEED_KEYS figure (None where its step gave none): jobs.train's from its
timings.csv and metrics.csv, written as each epoch ends, and the trainer's trainer.json
(job_figures: a run stopped at its cap has no summary.json), the seed script's from its log
(seed_rate), NVML's over each step's steady window (steady_windows, kit_probe.nvml_summary), the
others from the JSON the steps wrote (last_json, read_json); with them the ratios, every
measurement of each main figure (`runs`) and the provenance (the commit from git, or in a copy
without .git from $KIT_COMMIT; the date, the sizes, each step's StepResult). pack writes
OUT_FILES: feed.json, kit.tar.gz (every log, JSON and CSV of the scratch folder, no model or
checkpoint), profile.txt and the two Chrome traces; check_contract names every breach of what
the lent machine allows: the time, the files and their names, every key of feed.json.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# what comes back: at most 8 files of 16 MiB (the traces are gzipped; kit.tar.gz holds nvml.csv and the logs)
OUT_FILES = ("feed.json", "kit.tar.gz", "profile.txt", "trainer_trace.json.gz", "decode_trace.json.gz")
TRACES = ("trainer_trace.json.gz", "decode_trace.json.gz")
MAX_OUT_FILES, MAX_OUT_BYTES = 8, 16 * 2**20
FEED_KEYS = (
    "job_images_per_s",
    "job_images_per_s_whole_epochs",
    "epoch_start_s",
    "synthetic_images_per_s",
    "seed_images_per_s",
    "data_wait_frac",
    "decode_augment_images_per_s",
    "sm_us_per_image",
    "copy_us_per_image",
    "engine_share",
    "first_step_s",
    "train_images",
    "steady_s",
    "versions",
    "bound",
    "nvml",
    "peak_memory",
    "fused_kernel_us_per_image",
)
KIT_COMMIT = "KIT_COMMIT"  # the commit a copied tree (no .git: the device machine's copy) was copied at


@dataclasses.dataclass
class StepResult:
    """How one step of the kit ended, as feed.json's kit.steps records it."""

    name: str
    status: str  # ok, partial (the errors its JSON records), failed (exit N), timed out, skipped (why)
    seconds: float = 0.0
    cap: float = 0.0
    began: float = 0.0  # time.time() when it started


# --------------------------------------------------------------------------- the steps' output


def last_json(path: str) -> dict | None:
    """The last line of a log that parses as a JSON object (the benchmarks print their result last)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- the figures


def read_csv(run_dir: str, name: str) -> list[dict]:
    """One of the run's CSVs (timings.csv, metrics.csv: a row per finished epoch, written as it ends)."""
    import csv

    try:
        with open(os.path.join(run_dir, name)) as f:
            return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]
    except OSError:
        return []


def read_timings(run_dir: str) -> list[dict]:
    return read_csv(run_dir, "timings.csv")


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def job_figures(run_dir: str, log_path: str, trainer: dict | None = None, began: float | None = None) -> dict:
    """jobs.train's figures over its steady epochs (all but the first), from timings.csv, each
    epoch's rate kept (job_images_per_s_runs); the images trained from metrics.csv, both written as
    each epoch ends; the first step's time from the trainer's own record (training/worker/trace.py,
    `trainer`) less the step's start (`began`, time.time()), else summary.json's. A run stopped at
    its cap has no summary.json: its bound is then the last epoch's row's."""
    timings = read_timings(run_dir)
    steady = timings[1:] or timings
    summary = read_json(os.path.join(run_dir, "summary.json")) or {}
    first_at = (trainer or {}).get("first_step_at")
    first_step = round(first_at - began, 1) if first_at and began else summary.get("startup_s")
    trained = [m.get("train_images") for m in read_csv(run_dir, "metrics.csv")]
    if not all(isinstance(n, float) for n in trained):  # an older metrics.csv: from the rates and times
        trained = [t["images_per_s"] * t["epoch_s"] for t in timings]
    base = {"first_step_s": first_step, "train_images": int(round(sum(trained))) if timings else None}
    if not steady:
        return base | {"job_epochs": 0, "job_finished": bool(summary)}
    seconds = sum(t["epoch_s"] for t in steady)
    images = sum(t["images_per_s"] * t["epoch_s"] for t in steady)
    last = steady[-1]
    row = {k: last.get(k) for k in ("gpu_shared", "read_busy", "augment_busy", "tasks_busy")}
    bound = summary.get("bound") or {"stage": last.get("bound"), **row, "from": "the last epoch (stopped at its cap)"}
    return base | {
        "job_images_per_s": round(sum(t["inner_images_per_s"] * t["epoch_s"] for t in steady) / seconds, 1),
        "job_images_per_s_runs": [t["inner_images_per_s"] for t in steady],
        "job_images_per_s_whole_epochs": round(images / seconds, 1),
        "epoch_start_s": round(sum(t["start_s"] for t in steady) / len(steady), 3),
        "data_wait_frac": round(sum(t["data_wait_frac"] * t["epoch_s"] for t in steady) / seconds, 4),
        "steady_s": round(seconds, 1),
        "bound": bound,
        "decoded_on": summary.get("decoded_on") or {p: sum(t.get(f"decoded_{p}", 0) for t in timings) for p in
                                                     ("engines", "gpu_sms", "cpu")},
        "job_epochs": len(timings),
        "first_epoch_s": timings[0]["epoch_s"],
        "job_finished": bool(summary),
        "plan": next((line for line in _lines(log_path) if line.startswith("plan: ")), None),
    }  # fmt: skip


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def seed_rate(log_path: str) -> float | None:
    """The seed script's steady img/s: its result line, or where it was stopped, its timed windows'
    lines ("plain window 1: 4321.0 img/s over 7680 images")."""
    result = last_json(log_path)
    if result and result.get("steady_img_s"):
        return result["steady_img_s"]
    rates = [float(line.split(": ")[1].split()[0]) for line in _lines(log_path) if line.startswith("plain window ")]
    return round(sum(rates) / len(rates), 1) if rates else None


def seed_first_step(log_path: str) -> float | None:
    """When the seed script's first step ended (time.time()), from its line."""
    found = [line.split(" at ")[1] for line in _lines(log_path) if line.startswith("plain first step at ")]
    return float(found[0]) if found else None


def steady_windows(steps: list[StepResult], job: dict, trainer: dict, seed_log: str) -> dict:
    """Each sampled step's steady window (time.time() from, to): the train step's from the end of its
    first epoch (the trainer's first step plus the first epoch's time), the seed step's from its
    first step (its warm-up steps then run inside the window's first seconds)."""
    ran = {s.name: s for s in steps if s.began}
    windows = {}
    if "train" in ran and trainer.get("first_step_at"):
        windows["train"] = (
            trainer["first_step_at"] + job.get("first_epoch_s", 0.0),
            ran["train"].began + ran["train"].seconds,
        )
    if "seed" in ran:
        windows["seed"] = (seed_first_step(seed_log) or ran["seed"].began, ran["seed"].began + ran["seed"].seconds)
    return windows


def feed(scratch: str, data: str, steps: list[StepResult], sizes, started: float, nvml: str | None = None) -> dict:
    """feed.json: every FEED_KEYS figure (None where its step gave none), the ratios, and the
    provenance: the commit, the date, the machine, each step's status and time. `sizes` is the
    run's bench.gpu_kit.Sizes; `nvml`: why NVML was not sampled (None where it was)."""
    from bench.kit_probe import nvml_summary

    env = read_json(os.path.join(scratch, "env.json")) or {}
    decode = read_json(os.path.join(scratch, "decode.json")) or {}
    kernel = read_json(os.path.join(scratch, "kernel.json")) or {}
    trainer = read_json(os.path.join(scratch, "trainer.json")) or {}
    synthetic = last_json(os.path.join(scratch, "synthetic.log")) or {}
    stats = read_json(os.path.join(data, "stats.json")) or {}
    began = next((s.began for s in steps if s.name == "train"), None)
    job = job_figures(os.path.join(scratch, "runs", "kit"), os.path.join(scratch, "train.log"), trainer, began)
    seed_log = os.path.join(scratch, "seed.log")
    windows = steady_windows(steps, job, trainer, seed_log)
    out = dict.fromkeys(FEED_KEYS) | {k: v for k, v in job.items() if k in FEED_KEYS}
    out |= {
        "synthetic_images_per_s": synthetic.get("steady_img_s"),
        "seed_images_per_s": seed_rate(seed_log),
        "decode_augment_images_per_s": decode.get("decode_augment"),
        "sm_us_per_image": decode.get("sm_us_per_image"),
        "copy_us_per_image": decode.get("copy_us_per_image"),
        "engine_share": decode.get("engine_share"),
        "versions": {k: v for k, v in env.items() if k != "carry"},
        "nvml": {"skipped": nvml} if nvml else nvml_summary(os.path.join(scratch, "nvml.csv"), windows),
        "peak_memory": {
            "trainer": trainer.get("peak_memory") or {"skipped": "the trainer traced no steps (trainer.json)"},
            "augment_call": decode.get("peak_memory") or {"skipped": "the decode step profiled no call"},
            "fused_kernel": kernel.get("peak_memory_mib") or {"skipped": kernel.get("skipped", "no kernel step")},
        },
        "fused_kernel_us_per_image": kernel.get("us_per_image"),
    }
    runs = {
        "job_images_per_s": job.get("job_images_per_s_runs"),
        "synthetic_images_per_s": synthetic.get("runs"),
        "decode_augment_images_per_s": decode.get("decode_augment_runs"),
        "seed_images_per_s": (last_json(seed_log) or {}).get("runs"),
        "fused_kernel_us_per_image": kernel.get("runs"),
    }
    ratios = {}
    if out["job_images_per_s"] and out["synthetic_images_per_s"]:
        ratios["job_over_synthetic"] = round(out["job_images_per_s"] / out["synthetic_images_per_s"], 3)
    if out["job_images_per_s"] and out["seed_images_per_s"]:
        ratios["job_over_seed"] = round(out["job_images_per_s"] / out["seed_images_per_s"], 3)
    return out | {
        "ratios": ratios,
        "runs": runs,
        "windows": {k: [round(a, 3), round(b, 3)] for k, (a, b) in windows.items()},
        "job": {k: v for k, v in job.items() if k not in FEED_KEYS},
        "decode": decode,
        "fused_kernel": kernel or {"skipped": "the kernel step did not run"},
        "smoke": read_json(os.path.join(scratch, "smoke.json")),
        "traces": {name: os.path.exists(os.path.join(scratch, name)) for name in TRACES},
        "data": {
            k: stats.get(k) for k in ("distinct", "bytes_mean", "bytes_median", "short_side_mean", "kinds", "seconds")
        },
        "kit": provenance(steps, sizes, started),
    }


def source() -> dict:
    """The commit the tree is at and whether it has uncommitted changes, from git; in a copy without
    .git, or where git is missing, the commit $KIT_COMMIT names (None without it) and the changes
    unknown (None)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
            return {"commit": head.stdout.strip(), "uncommitted_changes": bool(dirty.stdout.strip())}
    except OSError:  # no git on the machine
        pass
    return {"commit": os.environ.get(KIT_COMMIT) or None, "uncommitted_changes": None}


def provenance(steps: list[StepResult], sizes, started: float) -> dict:
    """feed.json's `kit`: the source, the date, the command, the sizes (bench.gpu_kit.Sizes), each
    step's StepResult and the seconds since `started` (time.time())."""
    return {
        **source(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "rehearsal": sizes.device != "cuda",
        "sizes": dataclasses.asdict(sizes),
        "steps": [dataclasses.asdict(s) for s in steps],
        "seconds": round(time.time() - started, 1),
    }


# --------------------------------------------------------------------------- what comes back


def pack(scratch: str, out: str, figures: dict) -> list[str]:
    """OUT_FILES into `out`: feed.json, the scratch folder's logs and JSONs (no model, checkpoint
    or image) as kit.tar.gz, and the profiler's table. Returns the files written."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "feed.json"), "w") as f:
        json.dump(figures, f, indent=2)
    keep = (".json", ".log", ".txt", ".csv", ".xml")  # nvml.csv and ncu.txt among them; the traces apart
    with tarfile.open(os.path.join(out, "kit.tar.gz"), "w:gz") as tar:
        for folder, dirs, files in os.walk(scratch):
            dirs[:] = [d for d in dirs if not d.startswith(("checkpoint_", "data", "smoke-data", "tensorboard"))]
            for name in files:
                if name.endswith(keep):
                    path = os.path.join(folder, name)
                    tar.add(path, arcname=os.path.relpath(path, scratch))
    for name in ("profile.txt", *TRACES):
        if os.path.exists(os.path.join(scratch, name)):
            shutil.copyfile(os.path.join(scratch, name), os.path.join(out, name))
    return sorted(os.listdir(out))


def check_contract(out: str, seconds: float, budget: float) -> list[str]:
    """What the lent machine allows: the problems, none when the run kept to it."""
    problems = []
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if len(names) > MAX_OUT_FILES:
        problems.append(f"{len(names)} files in {out}, more than {MAX_OUT_FILES}")
    for name in names:
        path = os.path.join(out, name)
        if name not in OUT_FILES:
            problems.append(f"{name}: not one of {', '.join(OUT_FILES)}")
        elif os.path.getsize(path) > MAX_OUT_BYTES:
            problems.append(f"{name}: {os.path.getsize(path)} bytes, over {MAX_OUT_BYTES}")
    figures = read_json(os.path.join(out, "feed.json"))
    if figures is None:
        problems.append("no feed.json")
    else:
        problems += [f"feed.json has no {key}" for key in FEED_KEYS if key not in figures]
    if seconds > budget:
        problems.append(f"took {seconds:.0f} s, over the budget of {budget:.0f} s")
    return problems
