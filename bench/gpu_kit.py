"""The GPU proof in one command: everything a lent GPU machine is for, measured within one
10-minute command, its results brought back in at most 8 files.

    bash bench/gpu.sh                         # a CUDA machine: install the carry set, then this, <= 480 s
    bash bench/gpu.sh --rehearse              # here, no GPU: the carry set checked, every step at toy sizes
    python -m bench.gpu_kit --out DIR [--rehearse] [--budget S] [--steps env tests ...]

The steps, cheapest and most decisive first, each in a process of its own with a cap of its own
(STEPS), each writing its JSON into the scratch folder as it goes, so that a step that fails or
runs out of time loses only its own figures:

    env        versions, GPU, driver, cores, the carry set installed
    tests      the `gpu`-marked tests (tests/test_gpu.py, tests/test_decode.py); meanwhile the
               ImageNet-like data is made in the background (bench/gpu_data.py)
    decode     decode + augment alone (augment.batch.decode_augment, the `imagenet` train preset
               at 224 px) on the data's distinct JPEGs: img/s per batched decoder, the SMs' time
               per image from torch.profiler's CUDA time of one call of 1,024, the share of
               images the hardware JPEG engines decoded, and nvidia-smi dmon's jpg column
    synthetic  ResNet18 on random batches already on the GPU (bench/seed_train.py --synthetic)
    train      jobs.train on the data, bf16, 224 px, its epochs chosen for about STEADY_S of steady
               training at the synthetic rate; the rate within epochs (10-90 % of each) and over
               whole epochs, from its timings.csv
    seed       the seeds' plain script (ImageFolder + DataLoader with 16 workers) on the same data

This file holds the sizes of the steps (Sizes), their running (run_step, each in its own process
group), the steps' own work (env_step, decode_step and their helpers), the plan (commands,
train_epochs, make_data) and the run itself (run, main). What comes back ($OUT, or --out) is
bench/kit_return.py's: feed.json (the figures, FEED_KEYS, with their provenance), kit.tar.gz
(every log and JSON of the scratch folder, no model or checkpoint) and profile.txt (the
profiler's table). `--rehearse` runs every step on the CPU at toy sizes and checks the same
contract (kit_return.check_contract): the time, the files and their names, every key of feed.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time

from bench.kit_return import FEED_KEYS, REPO, StepResult, check_contract, feed, last_json, pack, read_json

STEADY_S = 60  # seconds of steady training the train step's epochs are chosen for
PACK_S = 15  # kept back from the budget to write what comes back


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How large each step runs: the device's sizes, or the rehearsal's toy ones."""

    device: str = "cuda"
    amp: str = "bf16"
    distinct: int = 2000  # JPEGs of ImageNet's sizes and bytes (bench/gpu_data.py)
    train: int = 50_000  # training samples, each a link to one of them
    val: int = 2000
    classes: int = 100
    batch: int = 256  # the global batch of the train, seed and synthetic steps
    decode_batch: int = 1024  # images per decode_augment call in the decode step
    decode_files: int = 256  # distinct files the decode step cycles through
    seconds: float = 2.0  # timing per decode column
    synthetic_steps: int = 200
    synthetic_warmup: int = 10
    loader_workers: int = 16  # the seed script's DataLoader workers
    image_size: int = 0  # jobs.train --image-size (0: the preset's 224)
    baseline_preset: str = "imagenet"  # the seed script's and the synthetic ceiling's (cifar: 32 px)
    caps: tuple = (("env", 20), ("tests", 110), ("decode", 50), ("synthetic", 30), ("train", 170), ("seed", 70))
    budget: float = 480.0

    @classmethod
    def rehearsal(cls) -> "Sizes":
        caps = (("env", 30), ("tests", 60), ("decode", 40), ("synthetic", 40), ("train", 150), ("seed", 60))
        return cls(
            device="cpu", amp="off", distinct=24, train=48, val=16, classes=4, batch=8, decode_batch=16,
            decode_files=16, seconds=0.3, synthetic_steps=2, synthetic_warmup=1, loader_workers=2, image_size=64,
            caps=caps, budget=300.0,
            baseline_preset="cifar",
        )  # fmt: skip


# --------------------------------------------------------------------------- running steps


def run_step(name: str, cmd: list[str], cap: float, scratch: str, grace: float = 10.0) -> StepResult:
    """`cmd` in its own process group with its output in scratch/NAME.log; past `cap` seconds it
    gets SIGINT (jobs.train stops cleanly on it), then SIGKILL `grace` seconds later."""
    log_path = os.path.join(scratch, f"{name}.log")
    start = time.monotonic()
    print(f"=== {name} (at most {cap:.0f} s): {' '.join(cmd[1:])}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=step_env(), start_new_session=True
        )
        try:
            rc = proc.wait(timeout=cap)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = "timed out"
            stop_group(proc, grace)
        except BaseException:  # the kit itself stopped (Ctrl-C, SIGTERM): its step's group goes too
            stop_group(proc, 1.0)
            raise
    result = StepResult(name, status, round(time.monotonic() - start, 1), cap)
    print(f"    {name}: {status} in {result.seconds:.0f} s; log {log_path}", flush=True)
    return result


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def step_env() -> dict:
    """The steps' environment: the repository on PYTHONPATH (Ray's workers import the project
    from it where it is not installed), unbuffered output."""
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, path) if p), PYTHONUNBUFFERED="1")


# --------------------------------------------------------------------------- the steps' own work


def versions() -> dict:
    """What this run ran on: the packages' versions (or "missing"), the GPU and driver, the cores."""
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version(), "cores": os.cpu_count()}
    names = ("torch", "torchvision", "triton", "ray", "kornia", "kornia_rs", "simplejpeg", "numpy", "pyarrow", "numba")
    for name in (*names, "nvidia-nvimgcodec-cu13", "nvidia-nvjpeg"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "missing"
    import torch

    out["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out |= {"gpu": props.name, "gpu_memory_mib": props.total_memory // 2**20, "sms": props.multi_processor_count}
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
    ) if _has("nvidia-smi") else None  # fmt: skip
    out["driver"] = smi.stdout.strip() if smi is not None and smi.returncode == 0 else None
    return out


def _has(program: str) -> bool:
    import shutil

    return shutil.which(program) is not None


def unmet_needs(carry: dict | None) -> list[str]:
    """The versions the carried wheels and the project need of the machine's own packages
    (carry.json's device_needs) that its installed ones do not meet: the device's package list
    has names only, so only the device can check them."""
    import importlib.metadata as md

    from packaging.specifiers import SpecifierSet

    unmet = []
    for name, needs in ((carry or {}).get("device_needs") or {}).items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            unmet.append(f"{name}: missing ({'; '.join(needs)})")
            continue
        for need in needs:
            if have not in SpecifierSet(need.split(" (")[0]):
                unmet.append(f"{name} {have}: {need}")
    return unmet


def env_step(scratch: str) -> None:
    carry = read_json(os.path.join(REPO, ".gpu-carry", "carry.json"))
    found = versions() | {"carry": carry, "unmet_needs": unmet_needs(carry)}
    for line in found["unmet_needs"]:
        print(f"warning: {line}", flush=True)
    with open(os.path.join(scratch, "env.json"), "w") as f:
        json.dump(found, f, indent=2)
    print(json.dumps({k: v for k, v in found.items() if k != "carry"}), flush=True)


def distinct_files(data: str, count: int) -> list[bytes]:
    """The first `count` distinct JPEGs of a bench/gpu_data.py tree; generated photos where there
    is no tree (bench.decode.encoded_photos)."""
    folder = os.path.join(data, ".distinct")
    names = sorted(os.listdir(folder))[:count] if os.path.isdir(folder) else []
    if not names:
        from bench.decode import encoded_photos

        return encoded_photos("imagenet", count)
    out = []
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            out.append(f.read())
    return out


def decode_step(scratch: str, data: str, sizes: Sizes) -> None:
    """decode.json, written after each part: img/s per decoder, then the profile of one call
    (profile.txt) and where its images were decoded."""
    import torch

    from bench import write_json
    from bench.decode import column, decoders, time_decode_augment, time_decode_only

    torch.set_num_threads(1)  # what an augment task gets
    device = torch.device(sizes.device)
    files = distinct_files(data, sizes.decode_files)
    result = {"batch": sizes.decode_batch, "files": len(files), "mean_file_bytes": sum(map(len, files)) // len(files)}
    result |= {"errors": {}, "device": sizes.device}
    path = os.path.join(scratch, "decode.json")
    dmon = Dmon(scratch) if device.type == "cuda" and _has("nvidia-smi") else None
    column(result, "decode_augment", time_decode_augment, files, sizes.decode_batch, device, True, sizes.seconds)
    write_json(path, result)
    for decoder in decoders(device):
        name = f"decode_only_{decoder.replace('-', '_')}"
        column(result, name, time_decode_only, files, sizes.decode_batch, device, sizes.seconds, decoder)
        write_json(path, result)
    result["dmon_jpg_util"] = dmon.stop() if dmon else None
    result |= profile_call(files, sizes.decode_batch, device, os.path.join(scratch, "profile.txt"))
    write_json(path, result)
    print(json.dumps(result), flush=True)


def profile_call(files: list[bytes], batch: int, device, table_path: str) -> dict:
    """One decode_augment call of `batch` images under torch.profiler (after a warm-up call): the
    kernels' time per image on a GPU (or the CPU's time off one), and where its images were decoded."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from augment.batch import decode_augment
    from augment.decode import DECODE_PLACES
    from augment.pipeline import Pipeline
    from augment.presets import PRESETS

    pipeline = Pipeline(PRESETS["imagenet"].train, seed=0).to(device)
    chosen = [files[i % len(files)] for i in range(batch)]
    keys = torch.arange(batch, dtype=torch.int64)
    decode_augment(pipeline, chosen, keys, 0, device, shrink=True)  # warm-up: kernels, handles, the allocator
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        decoded = decode_augment(pipeline, chosen, keys, 1, device, shrink=True)
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    with open(table_path, "w") as f:
        f.write(events.table(sort_by=sort, row_limit=40))
    kernels_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events) if cuda else None
    cpu_us = sum(e.self_cpu_time_total for e in events)
    counts = {place: decoded.decoded_on.count(i) for i, place in enumerate(DECODE_PLACES)}
    return {
        "sm_us_per_image": round(kernels_us / batch, 2) if cuda else None,
        "cpu_us_per_image": round(cpu_us / batch, 2),
        "decoded_on": counts,
        "engine_share": round(counts["engines"] / max(sum(counts.values()), 1), 4),
    }


class Dmon:
    """`nvidia-smi dmon -s u` sampled each second while the decode step runs: its jpg column is the
    hardware JPEG engines' use."""

    def __init__(self, scratch: str):
        self.path = os.path.join(scratch, "dmon.txt")
        self.file = open(self.path, "w")
        self.proc = subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-d", "1"], stdout=self.file, text=True)

    def stop(self) -> float | None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.file.close()
        return dmon_jpg(self.path)


def dmon_jpg(path: str) -> float | None:
    """The mean of dmon's jpg column (%), None where it has none."""
    with open(path) as f:
        lines = f.read().splitlines()
    header = next((line.lstrip("#").split() for line in lines if line.startswith("#") and "jpg" in line), None)
    if header is None:
        return None
    col = header.index("jpg")
    values = [line.split()[col] for line in lines if line.strip() and not line.startswith("#")]
    numbers = [float(v) for v in values if v.replace(".", "", 1).isdigit()]
    return round(sum(numbers) / len(numbers), 1) if numbers else None


# --------------------------------------------------------------------------- the plan


def commands(step: str, scratch: str, data: str, sizes: Sizes, rehearse: bool, epochs: int = 3) -> list[str]:
    """The command line of each step."""
    py, kit = sys.executable, [sys.executable, "-m", "bench.gpu_kit"]
    flags = ["--scratch", scratch, "--data", data] + (["--rehearse"] if rehearse else [])
    model = ["--batch-size", str(sizes.batch), "--amp", sizes.amp, "--device", sizes.device]
    baseline = ["--preset", sizes.baseline_preset, *model]
    if step == "env":
        return [*kit, "env", *flags]
    if step == "tests":
        tests = ["tests/test_gpu.py", "tests/test_decode.py"]
        return [py, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", *tests]
    if step == "decode":
        return [*kit, "decode", *flags]
    if step == "synthetic":
        steps = ["--steps", str(sizes.synthetic_steps), "--warmup-steps", str(sizes.synthetic_warmup)]
        return [py, "-m", "bench.seed_train", "--synthetic", *steps, *baseline]
    if step == "seed":
        workers = ["--loader-workers", str(sizes.loader_workers)]
        return [py, "-m", "bench.seed_train", "--data", data, "--epochs", "2", "--no-val", *workers, *baseline]
    if step == "train":
        size = ["--image-size", str(sizes.image_size)] if sizes.image_size else []
        run = ["--storage-path", os.path.join(scratch, "runs"), "--name", "kit", "--epochs", str(epochs)]
        return [py, "-m", "jobs.train", "--data", data, "--preset", "imagenet", *model, *size, *run]
    raise ValueError(f"no step {step!r}")


def train_epochs(synthetic: dict | None, sizes: Sizes) -> int:
    """Epochs for about STEADY_S of steady training had jobs.train reached 0.9 of the synthetic rate,
    after a first epoch; 3 at least. The rehearsal's CPU trains 2, whatever its rate."""
    rate = (synthetic or {}).get("steady_img_s")
    if sizes.device != "cuda":
        return 2
    if not rate:
        return 3
    return max(3, 1 + round(STEADY_S * 0.9 * rate / sizes.train + 0.5))


def make_data(data: str, sizes: Sizes) -> subprocess.Popen:
    """bench/gpu_data.py in the background (the tests step needs few CPUs); its log beside the data."""
    cmd = [sys.executable, "-m", "bench.gpu_data", data, "--distinct", str(sizes.distinct), "--train"]
    cmd += [str(sizes.train), "--val", str(sizes.val), "--classes", str(sizes.classes)]
    log = open(data + ".log", "w")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=step_env())


# --------------------------------------------------------------------------- the run


def run(out: str, scratch: str, sizes: Sizes, steps: list[str], started: float) -> tuple[dict, list[str]]:
    """Every step in `steps` within the budget (from `started`, time.time()), then what comes back."""
    os.makedirs(scratch, exist_ok=True)
    data, rehearse = os.path.join(scratch, "data"), sizes.device != "cuda"
    caps, results = dict(sizes.caps), []
    maker = make_data(data, sizes)
    for step in steps:
        left = sizes.budget - (time.time() - started) - PACK_S
        if step in ("decode", "train", "seed"):
            wait_for(maker, min(left, 120))
        if left < min(caps[step], 10):
            results.append(StepResult(step, f"skipped ({left:.0f} s left)", cap=caps[step]))
            continue
        synthetic = last_json(os.path.join(scratch, "synthetic.log"))
        cmd = commands(step, scratch, data, sizes, rehearse, train_epochs(synthetic, sizes))
        results.append(run_step(step, cmd, min(caps[step], left), scratch))
    wait_for(maker, 1)
    figures = feed(scratch, data, results, sizes, started)
    return figures, pack(scratch, out, figures)


def wait_for(proc: subprocess.Popen, seconds: float) -> None:
    try:
        proc.wait(timeout=max(seconds, 0.1))
    except subprocess.TimeoutExpired:
        if seconds <= 1:
            proc.kill()


def summary_table(figures: dict) -> str:
    """The figures that matter, one line each, for the end of the command's output."""
    ratios = figures.get("ratios", {})
    rows = [(k, figures.get(k)) for k in FEED_KEYS if k not in ("versions", "bound")]
    rows += [("bound", (figures.get("bound") or {}).get("stage") or (figures.get("bound") or {}).get("bound"))]
    rows += list(ratios.items())
    rows += [(s["name"], f"{s['status']}, {s['seconds']:.0f} of {s['cap']:.0f} s") for s in figures["kit"]["steps"]]
    return "\n".join(f"{name:<32} {value}" for name, value in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_kit", description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs="?", default="all", choices=("all", "env", "decode"), help="all: the whole kit")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="what comes back (default: $OUT, else the results)")
    ap.add_argument("--scratch", help="logs, data and run directories (default: a new folder under /tmp)")
    ap.add_argument("--data", help="the decode step's data tree")
    ap.add_argument("--rehearse", action="store_true", help="every step on the CPU at toy sizes")
    ap.add_argument("--steps", nargs="+", choices=[c for c, _ in Sizes.caps], help="a subset of the steps, in order")
    ap.add_argument("--budget", type=float, help="seconds for the whole kit (default: 480, rehearsal 300)")
    ap.add_argument("--started", type=float, help="time.time() when the command began (the carry set's install)")
    args = ap.parse_args(argv)
    sizes = Sizes.rehearsal() if args.rehearse else Sizes()
    if args.budget:
        sizes = dataclasses.replace(sizes, budget=args.budget)
    if args.command == "env":
        return env_step(args.scratch) or 0
    if args.command == "decode":
        return decode_step(args.scratch, args.data, sizes) or 0
    started = args.started or time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds run_step, which stops its step's group
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    scratch = args.scratch or f"/tmp/gpu-kit-{stamp}"
    out = args.out or os.path.join(REPO, "bench", "results", f"{stamp[:8]}-{'rehearsal' if args.rehearse else 'gpu'}")
    figures, files = run(out, scratch, sizes, args.steps or [c for c, _ in Sizes.caps], started)
    seconds = time.time() - started
    print("\n" + summary_table(figures))
    problems = check_contract(out, seconds, sizes.budget)
    print(f"\n{seconds:.0f} s of {sizes.budget:.0f}; back in {out}: {', '.join(files)}")
    for problem in problems:
        print(f"contract: {problem}")
    failed = [s.name for s in map(lambda d: StepResult(**d), figures["kit"]["steps"]) if s.status != "ok"]
    if args.rehearse and failed:
        print(f"rehearsal: steps that did not pass: {', '.join(failed)} (their logs are in {scratch})")
    return 1 if problems or (args.rehearse and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
