"""The GPU proof in one command: everything a lent GPU machine is for, measured within one
10-minute command, its results brought back in at most 8 files.

    bash bench/gpu.sh                         # a CUDA machine: install the carry set, then this, <= 480 s
    bash bench/gpu.sh --smoke                 # only the decisive first part, <= 90 s
    bash bench/gpu.sh --rehearse [--smoke]    # here, no GPU: the carry set checked, every step at toy sizes
    python -m bench.gpu_kit --out DIR [--rehearse] [--smoke] [--budget S] [--steps env tests ...]

The steps, cheapest and most decisive first, each in a process of its own with a cap of its own
(Sizes.caps, 405 of the 480 s), each writing its JSON into the scratch folder as it goes, so that
a step that fails or runs out of time loses only its own figures. The first three are the smoke
(SMOKE): where one does not pass, the kit stops there and returns what it has.

    env          versions, GPU, driver, cores, the carry set installed ($CARRY)
    smoke        bench/kit_smoke.py: the fused kernel compiled and within a level of the CPU's pixels
                 at three sizes (a 4000x3000 photo among them), nvImageCodec decoding, the ordering test
    smoke_train  jobs.train for 20 steps on a small tree made first (bench/gpu_data.py)
    tests        the other `gpu`-marked tests (tests/test_gpu.py, tests/test_decode.py) but the
                 whole jobs.train run, which the train step repeats; meanwhile the ImageNet-like
                 data is made in the background
    decode       decode + augment alone (bench/kit_steps.py: the `imagenet` train preset at 224 px)
                 on the data's distinct JPEGs: img/s twice and per batched decoder, one call of
                 1,024 under torch.profiler (the SMs' time and the copies' apart, its Chrome trace,
                 its peak memory), where its images were decoded, nvidia-smi dmon's jpg column
    kernel       the fused kernel alone (bench/kit_probe.py): do_bench at 256 and 1,024 images,
                 twice; registers and spills; one ncu summary where ncu answers within 30 s
    synthetic    ResNet18 on random batches already on the GPU (bench/seed_train.py --synthetic)
    train        jobs.train on the data, bf16, 224 px, epochs of 50 steps, as many as the cap
                 allows; the rate within each steady epoch from timings.csv, a Chrome trace of 20
                 steps of its second epoch in the trainer (training/worker/trace.py)
    seed         the seeds' plain script (ImageFolder + DataLoader with 16 workers) on the same
                 data: 40 steps timed after 10, in two windows (one epoch of the data)
    NVML is sampled at 10 Hz from the train step to the end (bench/kit_probe.py).

This file holds the sizes of the steps (Sizes), their running (run_step, each in its own process
group), the plan (commands, train_epochs, make_data) and the run itself (run, settle, main). What
comes back ($OUT, or --out) is bench/kit_return.py's: feed.json (the figures, FEED_KEYS, with
their provenance), kit.tar.gz (every log, JSON and CSV of the scratch folder, no model or
checkpoint), profile.txt (the profiler's table) and the two traces. `--rehearse` runs every step
on the CPU at toy sizes and checks the same contract (kit_return.check_contract): the time, the
files and their names, every key of feed.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import time

from bench.kit_return import FEED_KEYS, REPO, StepResult, check_contract, feed, last_json, pack, read_json
from bench.kit_steps import decode_step, dmon_jpg, env_step, unmet_needs

__all__ = ["dmon_jpg", "unmet_needs"]  # the steps' helpers, where tests/test_gpu_kit.py reaches them

STEADY_S = 60  # seconds of steady training the train step's epochs are chosen for
PACK_S = 15  # kept back from the budget to write what comes back
SMOKE = ("env", "smoke", "smoke_train")  # the decisive first part: if one fails, the kit stops there
TRACED = {"cuda": (10, 20), "cpu": (1, 3)}  # the trainer's trace: steps past the first epoch, then how many


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How large each step runs: the device's sizes, or the rehearsal's toy ones. The caps add up
    to 405 of the 480 s: the install (about 10 s), packing (PACK_S) and a margin stay free."""

    device: str = "cuda"
    amp: str = "bf16"
    distinct: int = 2000  # JPEGs of ImageNet's sizes and bytes (bench/gpu_data.py)
    train: int = 12_800  # training samples, each a link to one of them: 50 steps an epoch, so epochs finish
    val: int = 512
    classes: int = 100
    batch: int = 256  # the global batch of the train, seed and synthetic steps
    smoke_distinct: int = 128  # the smoke tree's distinct JPEGs; its train split is smoke_steps batches
    smoke_steps: int = 20
    decode_batch: int = 1024  # images per decode_augment call in the decode step
    decode_files: int = 256  # distinct files the decode step cycles through
    seconds: float = 2.0  # timing per decode column
    synthetic_steps: int = 200
    synthetic_warmup: int = 10
    seed_steps: int = 40  # the seed script's timed steps (two windows), after seed_warmup: one epoch in all
    seed_warmup: int = 10
    seed_seconds: float = 20.0
    loader_workers: int = 16  # the seed script's DataLoader workers
    image_size: int = 0  # jobs.train --image-size (0: the preset's 224)
    baseline_preset: str = "imagenet"  # the seed script's and the synthetic ceiling's (cifar: 32 px)
    caps: tuple = (
        ("env", 10), ("smoke", 28), ("smoke_train", 42), ("tests", 50), ("decode", 45), ("kernel", 45),
        ("synthetic", 25), ("train", 120), ("seed", 40),
    )  # fmt: skip
    budget: float = 480.0
    smoke_budget: float = 90.0

    @classmethod
    def rehearsal(cls) -> "Sizes":
        # the 2-core machine is shared: its budget, not these caps, binds
        caps = (
            ("env", 30), ("smoke", 45), ("smoke_train", 90), ("tests", 40), ("decode", 40), ("kernel", 30),
            ("synthetic", 40), ("train", 120), ("seed", 60),
        )  # fmt: skip
        return cls(
            device="cpu", amp="off", distinct=24, train=48, val=16, classes=4, batch=8, smoke_distinct=16,
            smoke_steps=20, decode_batch=16, decode_files=16, seconds=0.3, synthetic_steps=2, synthetic_warmup=1,
            seed_steps=4, seed_warmup=1, seed_seconds=10.0, loader_workers=2, image_size=64, caps=caps,
            budget=300.0, smoke_budget=120.0, baseline_preset="cifar",
        )  # fmt: skip


# --------------------------------------------------------------------------- running steps


def run_step(name: str, cmd: list[str], cap: float, scratch: str, grace: float = 10.0, env=None) -> StepResult:
    """`cmd` in its own process group with its output in scratch/NAME.log; `grace` seconds before
    its `cap` it gets SIGINT (jobs.train stops cleanly on it), then SIGKILL at the cap. `env`:
    variables added to step_env's."""
    log_path = os.path.join(scratch, f"{name}.log")
    began, start = time.time(), time.monotonic()
    print(f"=== {name} (at most {cap:.0f} s): {' '.join(cmd[1:])}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=step_env() | (env or {}), start_new_session=True
        )
        try:
            rc = proc.wait(timeout=max(cap - grace, cap / 2))
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = "timed out"
            stop_group(proc, min(grace, cap / 2))
        except BaseException:  # the kit itself stopped (Ctrl-C, SIGTERM): its step's group goes too
            stop_group(proc, 1.0)
            raise
    result = StepResult(name, status, round(time.monotonic() - start, 1), cap, round(began, 3))
    print(f"    {name}: {status} in {result.seconds:.0f} s; log {log_path}", flush=True)
    return result


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 5)):
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


# --------------------------------------------------------------------------- the plan


def commands(step: str, scratch: str, data: dict, sizes: Sizes, rehearse: bool, epochs: int = 3) -> list[str]:
    """The command line of each step; `data`: the trees, {"full": ..., "smoke": ...}."""
    py, kit = sys.executable, [sys.executable, "-m", "bench.gpu_kit"]
    flags = ["--scratch", scratch, "--data", data["full"]] + (["--rehearse"] if rehearse else [])
    model = ["--batch-size", str(sizes.batch), "--amp", sizes.amp, "--device", sizes.device]
    baseline = ["--preset", sizes.baseline_preset, *model] + (["--threads", "1"] if rehearse else [])
    size = ["--image-size", str(sizes.image_size)] if sizes.image_size else []
    train = [
        py,
        "-m",
        "jobs.train",
        "--preset",
        "imagenet",
        *model,
        *size,
        "--storage-path",
        os.path.join(scratch, "runs"),
    ]
    if step == "env":
        return [*kit, "env", *flags]
    if step == "smoke":
        return [py, "-m", "bench.kit_smoke", "--scratch", scratch, "--data", data["smoke"]] + flags[4:]
    if step == "smoke_train":
        return [*train, "--data", data["smoke"], "--name", "smoke", "--epochs", "1"]
    if step == "tests":  # what the smoke and the train step do already are left to them
        tests = ["tests/test_gpu.py", "tests/test_decode.py"]
        skip = ["test_a_cuda_bf16_run", "never_writes_over_memory and nvimgcodec"]
        return [py, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", *tests, "-k", NOT(skip)]
    if step == "decode":
        return [*kit, "decode", *flags]
    if step == "kernel":
        return [py, "-m", "bench.kit_probe", "kernel", os.path.join(scratch, "kernel.json")]
    if step == "synthetic":
        steps = ["--steps", str(sizes.synthetic_steps), "--warmup-steps", str(sizes.synthetic_warmup)]
        return [py, "-m", "bench.seed_train", "--synthetic", *steps, *baseline]
    if step == "seed":
        steps = ["--steady-steps", str(sizes.seed_steps), "--warmup-steps", str(sizes.seed_warmup)]
        steps += ["--seconds", str(sizes.seed_seconds), "--loader-workers", str(sizes.loader_workers)]
        return [py, "-m", "bench.seed_train", "--data", data["full"], "--no-val", *steps, *baseline]
    if step == "train":
        return [*train, "--data", data["full"], "--name", "kit", "--epochs", str(epochs)]
    raise ValueError(f"no step {step!r}")


def NOT(names: list[str]) -> str:  # noqa: N802  (pytest's -k expression: none of these)
    return " and ".join(f"not ({n})" for n in names)


def step_extra_env(step: str, scratch: str, sizes: Sizes) -> dict:
    """The train step's trainer traces TRACED's steps of its second epoch (training/worker/trace.py);
    the rehearsal runs Triton's kernels in its interpreter."""
    env = {"TRITON_INTERPRET": "1"} if sizes.device != "cuda" else {}
    if step == "train":
        past, count = TRACED[sizes.device]
        env["RGA_TRACE"] = f"{scratch}:{sizes.train // sizes.batch + past}:{count}"
    return env


def train_epochs(synthetic: dict | None, sizes: Sizes) -> int:
    """Epochs for about STEADY_S of steady training had jobs.train reached 0.9 of the synthetic rate,
    after a first epoch; 3 at least (the step's cap stops it sooner where it runs slower: each
    epoch finished is in timings.csv). The rehearsal's CPU trains 3 (two steady epochs, each
    rate kept), whatever its rate."""
    rate = (synthetic or {}).get("steady_img_s")
    if sizes.device != "cuda":
        return 3
    if not rate:
        return 3
    return max(3, 1 + round(STEADY_S * 0.9 * rate / sizes.train + 0.5))


def make_data(data: str, sizes: Sizes, smoke: bool = False) -> subprocess.Popen:
    """bench/gpu_data.py in the background (the tests step needs few CPUs); its log beside the data.
    `smoke`: the smoke tree, smoke_steps batches to train and one to validate."""
    distinct, train, val = (sizes.smoke_distinct, sizes.smoke_steps * sizes.batch, sizes.batch) if smoke else (
        sizes.distinct, sizes.train, sizes.val)  # fmt: skip
    cmd = [sys.executable, "-m", "bench.gpu_data", data, "--distinct", str(distinct), "--train"]
    cmd += [str(train), "--val", str(val), "--classes", str(min(sizes.classes, distinct))]
    log = open(data + ".log", "w")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=step_env())


# --------------------------------------------------------------------------- the run


def run(out: str, scratch: str, sizes: Sizes, steps: list[str], started: float) -> tuple[dict, list[str]]:
    """Every step in `steps` within the budget (from `started`, time.time()), stopping after a
    smoke step that did not pass; NVML sampled through the train and seed steps; then what comes back."""
    os.makedirs(scratch, exist_ok=True)
    data = {"full": os.path.join(scratch, "data"), "smoke": os.path.join(scratch, "smoke-data")}
    caps, results, rehearse = dict(sizes.caps), [], sizes.device != "cuda"
    makers = {"smoke": make_data(data["smoke"], sizes, smoke=True)}  # the full tree once the smoke is done
    budget = sizes.budget if set(steps) - set(SMOKE) else min(sizes.budget, sizes.smoke_budget)
    sampler = NvmlSampler(scratch)
    for step in steps:
        left = budget - (time.time() - started) - PACK_S
        if step in ("smoke", "smoke_train"):
            wait_for(makers["smoke"], min(left, 60))
        elif "full" not in makers:  # its 16 processes would slow the smoke's steps
            makers["full"] = make_data(data["full"], sizes)
        if step in ("decode", "train", "seed"):
            wait_for(makers["full"], min(left, 120))
        left = budget - (time.time() - started) - PACK_S  # after the waits
        if left < min(caps[step], 10):
            results.append(StepResult(step, f"skipped ({left:.0f} s left)", cap=caps[step]))
            continue
        if step == "train":
            sampler.start()
        synthetic = last_json(os.path.join(scratch, "synthetic.log"))
        cmd = commands(step, scratch, data, sizes, rehearse, train_epochs(synthetic, sizes))
        env = step_extra_env(step, scratch, sizes)
        grace = 10.0 if step in ("train", "smoke_train") else 3.0  # jobs.train stops cleanly on SIGINT
        results.append(settle(run_step(step, cmd, min(caps[step], left), scratch, grace, env), scratch))
        if step in SMOKE and results[-1].status != "ok":
            print(f"the smoke step {step} did not pass: the kit stops here", flush=True)
            break
    sampler.stop()
    for maker in makers.values():
        wait_for(maker, 1)
    figures = feed(scratch, data["full"], results, sizes, started, nvml=sampler.missing)
    return figures, pack(scratch, out, figures)


def settle(result: StepResult, scratch: str) -> StepResult:
    """A step that exited 0 with errors in its JSON (a failed column) reads partial, with them; one
    that failed (the smoke's checks) names them after its exit status."""
    own = read_json(os.path.join(scratch, f"{result.name}.json")) or {}
    if not own.get("errors"):
        return result
    errors = "; ".join(f"{k}: {v}" for k, v in own["errors"].items())[:300]
    status = f"partial ({errors})" if result.status == "ok" else f"{result.status}: {errors}"
    return dataclasses.replace(result, status=status)


class NvmlSampler:
    """`python -m bench.kit_probe nvml` in the background from the train step to the end; where
    NVML cannot be read, `missing` says why and nothing runs."""

    def __init__(self, scratch: str):
        from bench.kit_probe import nvml_missing

        self.csv, self.proc = os.path.join(scratch, "nvml.csv"), None
        self.missing = nvml_missing()

    def start(self) -> None:
        if self.missing is None and self.proc is None:
            cmd = [sys.executable, "-m", "bench.kit_probe", "nvml", self.csv, "--hz", "10"]
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=step_env())

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            wait_for(self.proc, 5)


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
    ap.add_argument("--smoke", action="store_true", help=f"only the decisive first part ({', '.join(SMOKE)})")
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
    steps = list(SMOKE) if args.smoke else args.steps or [c for c, _ in Sizes.caps]
    budget = sizes.budget if set(steps) - set(SMOKE) else min(sizes.budget, sizes.smoke_budget)
    started = args.started or time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds run_step, which stops its step's group
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    scratch = args.scratch or f"/tmp/gpu-kit-{stamp}"
    out = args.out or os.path.join(REPO, "bench", "results", f"{stamp[:8]}-{'rehearsal' if args.rehearse else 'gpu'}")
    figures, files = run(out, scratch, sizes, steps, started)
    seconds = time.time() - started
    print("\n" + summary_table(figures))
    problems = check_contract(out, seconds, budget)
    print(f"\n{seconds:.0f} s of {budget:.0f}; back in {out}: {', '.join(files)}")
    for problem in problems:
        print(f"contract: {problem}")
    failed = [s.name for s in map(lambda d: StepResult(**d), figures["kit"]["steps"]) if s.status != "ok"]
    if args.rehearse and failed:
        print(f"rehearsal: steps that did not pass: {', '.join(failed)} (their logs are in {scratch})")
    smoke_failed = [name for name in failed if name in SMOKE]
    if smoke_failed:
        print(f"smoke: {', '.join(smoke_failed)} did not pass; fix, then run again (logs in kit.tar.gz)")
    return 1 if problems or smoke_failed or (args.rehearse and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
