"""What a GPU engineer looks at first, for the GPU kit (bench/gpu_kit.py): the SMs' time of a
profiled call counted once (device_us), the card sampled through NVML while the job trains
(`python -m bench.kit_probe nvml CSV`, summarised by nvml_summary), the fused kernel alone
(`python -m bench.kit_probe kernel JSON`: triton.testing.do_bench at 256 and 1,024 images, its
registers and spills, one ncu summary), and a Chrome trace gzipped (gzip_trace).

Each part that cannot run here (no CUDA, no NVML, no ncu) says so in its JSON as
{"skipped": why}, never by crashing: the rehearsal on a CPU records the same keys.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

COPY_PREFIXES = ("Memcpy", "Memset")  # the profiler's rows for DMA copies and memsets: no SM work
NVML_COLUMNS = ("t", "sm_pct", "mem_bw_pct", "jpg_pct", "mem_used_mib", "sm_mhz", "mem_mhz", "power_w", "procs")
NVML_FIGURES = ("sm_pct", "mem_bw_pct", "jpg_pct", "mem_used_mib", "sm_mhz", "mem_mhz", "power_w")
KERNEL_SIZES = (256, 1024)  # images per launch in the kernel's own timing


# --------------------------------------------------------------------------- the profiler's table


def device_us(events) -> dict:
    """The device time of torch.profiler's key_averages() rows as torch's own total counts it: the
    rows whose device_type is CUDA only (a kernel launched inside an op is also charged to that
    op's CPU row, so summing every row counts it twice), with the copies and memsets apart
    (kernel_us: the SMs' work; copy_us: DMA engines' and memsets')."""
    kernel_us = copy_us = 0.0
    for event in events:
        if str(getattr(event, "device_type", "")).rsplit(".", 1)[-1] != "CUDA":
            continue
        if getattr(event, "is_user_annotation", False):
            continue
        if str(event.key).startswith(COPY_PREFIXES):
            copy_us += event.self_device_time_total
        else:
            kernel_us += event.self_device_time_total
    return {"kernel_us": kernel_us, "copy_us": copy_us}


def gzip_trace(path: str) -> str:
    """`path` (a Chrome trace) gzipped beside it as PATH.gz, the plain file removed; the new path."""
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
    return path + ".gz"


# --------------------------------------------------------------------------- NVML


def nvml_missing() -> str | None:
    """Why NVML cannot be read here (None where it can): pynvml (nvidia-ml-py) missing, or no driver."""
    try:
        import pynvml
    except ImportError:
        return "no NVML: pynvml (nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
        pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception as error:  # noqa: BLE001  (NVMLError_LibraryNotFound, _DriverNotLoaded, ...)
        return f"no NVML: {type(error).__name__}: {error}"
    return None


def nvml_sample(nv, handle) -> dict:
    """One row of NVML_COLUMNS; a figure this driver does not expose reads ''."""

    def read(fn):
        try:
            return fn()
        except Exception:  # noqa: BLE001  (NVMLError_NotSupported and kin: that column stays empty)
            return ""

    util = read(lambda: nv.nvmlDeviceGetUtilizationRates(handle))
    procs = read(lambda: nv.nvmlDeviceGetComputeRunningProcesses(handle)) or []
    return {
        "t": round(time.time(), 3),
        "sm_pct": util.gpu if util != "" else "",
        "mem_bw_pct": util.memory if util != "" else "",
        "jpg_pct": read(lambda: nv.nvmlDeviceGetJpgUtilization(handle)[0]),
        "mem_used_mib": read(lambda: nv.nvmlDeviceGetMemoryInfo(handle).used // 2**20),
        "sm_mhz": read(lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)),
        "mem_mhz": read(lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM)),
        "power_w": read(lambda: round(nv.nvmlDeviceGetPowerUsage(handle) / 1000, 1)),
        "procs": "|".join(f"{p.pid}={(p.usedGpuMemory or 0) // 2**20}" for p in procs),
    }


def sample_nvml(path: str, hz: float) -> int:
    """NVML_COLUMNS at `hz` into the CSV at `path` until SIGTERM or SIGINT (the kit's sampler)."""
    import pynvml as nv

    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=NVML_COLUMNS)
        writer.writeheader()
        next_t = time.monotonic()
        while not stop:
            writer.writerow(nvml_sample(nv, handle))
            f.flush()
            next_t += 1 / hz
            time.sleep(max(next_t - time.monotonic(), 0))
    return 0


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean": round(statistics.fmean(ordered), 1), "p50": at(0.5), "p90": at(0.9)}


def nvml_summary(path: str, windows: dict) -> dict:
    """The CSV's figures over each step's steady window (windows: step -> (start, end), time.time()):
    mean, p50 and p90 of each NVML_FIGURES column it has, the samples' rate, and each process's
    largest memory in the window (MiB)."""
    try:
        with open(path) as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return {"skipped": f"no samples: {path} was not written"}
    out = {"csv": os.path.basename(path), "samples": len(rows), "steps": {}}
    for step, (start, end) in windows.items():
        inside = [r for r in rows if start <= float(r["t"]) <= end]
        if len(inside) < 2:
            out["steps"][step] = {"samples": len(inside), "window_s": round(end - start, 1)}
            continue
        span = float(inside[-1]["t"]) - float(inside[0]["t"])
        figures = {"samples": len(inside), "window_s": round(span, 1), "hz": round((len(inside) - 1) / span, 1)}
        for col in NVML_FIGURES:
            values = [float(r[col]) for r in inside if r.get(col) not in ("", None)]
            figures[col] = percentiles(values) if values else None
        peaks: dict = {}
        for r in inside:
            for item in filter(None, (r.get("procs") or "").split("|")):
                pid, mib = item.split("=")
                peaks[pid] = max(peaks.get(pid, 0), int(mib))
        out["steps"][step] = figures | {"mem_used_mib_by_process": peaks}
    return out


# --------------------------------------------------------------------------- the fused kernel alone


def kernel_inputs(count: int, device, seed: int = 0):
    """`count` random ImageNet-size photos (sides 333-500) on `device` and the `imagenet` train
    preset's fused plan for them: (views, meta, factors, out_hw, fill, float_out)."""
    import torch

    from augment.fused import FusedPlan, fused_prefix, on_device
    from augment.pipeline import Pipeline
    from augment.presets import PRESETS

    gen = torch.Generator().manual_seed(seed)
    sides = torch.randint(333, 501, (count, 2), generator=gen)
    on_dev = torch.Generator(device=device).manual_seed(seed)  # made where they are read: no upload
    photos = [torch.randint(0, 256, (int(h), int(w), 3), dtype=torch.uint8, generator=on_dev, device=device)
              for h, w in sides]  # fmt: skip
    pipe = Pipeline(PRESETS["imagenet"].train, seed=seed).to(device).at_epoch(0)
    sizes = sides.to(device)
    draws = pipe.request(sizes, torch.arange(count, device=device)).draws
    n = fused_prefix(pipe.ops)
    plan = FusedPlan.of(pipe.ops[:n], draws.first, draws.rest[: n - 1], sizes)
    views = on_device(photos, device)
    return views, plan.meta, plan.factors, pipe.out_hw, plan.fill, n < len(pipe.ops)


def compiled_kernels(module) -> dict:
    """{kernel name: {n_regs, n_spills}} of every compiled Triton kernel of `module` (its
    JITFunctions' caches, whichever layout this Triton keeps them in)."""
    found = {}
    for name, fn in vars(module).items():
        caches = getattr(fn, "device_caches", None) or {}
        for entry in caches.values():
            for part in entry if isinstance(entry, tuple) else (entry,):
                for kernel in part.values() if isinstance(part, dict) else ():
                    if not hasattr(kernel, "_init_handles"):  # not a CompiledKernel
                        continue
                    kernel._init_handles()  # Triton reads n_regs and n_spills as it loads the binary
                    shared = getattr(getattr(kernel, "metadata", None), "shared", None)
                    found[name] = {"n_regs": kernel.n_regs, "n_spills": kernel.n_spills, "shared_bytes": shared}
    return found


def kernel_figures(device: str = "cuda") -> dict:
    """The fused op alone (its launch and its per-image table's upload) under do_bench's median,
    at KERNEL_SIZES images, twice each, in µs per image; the compiled kernels' registers and spills."""
    import torch

    if device != "cuda" or not torch.cuda.is_available():
        return {"skipped": "no CUDA: do_bench times CUDA events and the interpreter has no registers"}
    import triton.testing

    from augment import fused, fused_kernel

    runs = {str(count): time_kernel(count, triton.testing.do_bench, fused) for count in KERNEL_SIZES}
    return {
        "us_per_image": {k: round(statistics.fmean(v), 3) for k, v in runs.items()},
        "runs": runs,
        "kernels": compiled_kernels(fused_kernel),
        "peak_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
    }


def time_kernel(count: int, do_bench, fused) -> list[float]:
    """µs per image of the fused op at `count` photos, do_bench's median, twice."""
    import torch

    args = kernel_inputs(count, torch.device("cuda"))
    views, meta, factors, (oh, ow), fill, float_out = args
    times = []
    for _ in range(2):
        call = lambda: fused.augment_first_ops(views, meta, factors, oh, ow, fill, float_out)  # noqa: E731
        ms = do_bench(call, warmup=50, rep=300, return_mode="median")
        times.append(round(1000 * ms / count, 3))
    return times


def ncu_summary(out_path: str, timeout: float = 30.0) -> dict:
    """One launch of the fused kernel under `ncu --clock-control none` (its text into out_path),
    if ncu answers within `timeout` seconds."""
    ncu = shutil.which("ncu")
    if ncu is None:
        return {"skipped": "no ncu on PATH"}
    cmd = [ncu, "--clock-control", "none", "--launch-count", "1", "-k", "regex:augment|resample|pass"]
    cmd += [sys.executable, "-m", "bench.kit_probe", "launch"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"ncu gave no answer in {timeout:.0f} s"}
    with open(out_path, "w") as f:
        f.write(done.stdout + done.stderr)
    return {"exit": done.returncode, "file": os.path.basename(out_path), "lines": len(done.stdout.splitlines())}


def one_launch() -> int:
    """A single launch of the fused op at 256 images (what ncu profiles)."""
    import torch

    from augment import fused

    views, meta, factors, (oh, ow), fill, float_out = kernel_inputs(256, torch.device("cuda"))
    fused.augment_first_ops(views, meta, factors, oh, ow, fill, float_out)
    torch.cuda.synchronize()
    return 0


def kernel_step(path: str, ncu_path: str) -> int:
    """kernel.json: kernel_figures, then the ncu summary; written after each."""
    import torch

    from bench import write_json

    result = {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    try:
        result |= kernel_figures()
    except Exception as error:  # noqa: BLE001  (recorded: the kit reads the step as partial)
        result["errors"] = {"kernel": f"{type(error).__name__}: {error}"}
    write_json(path, result)
    result["ncu"] = ncu_summary(ncu_path) if "skipped" not in result else {"skipped": result["skipped"]}
    write_json(path, result)
    print(json.dumps(result), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kit_probe", description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("nvml", "kernel", "launch"))
    ap.add_argument("path", nargs="?", help="nvml: the CSV; kernel: the JSON (ncu's text beside it)")
    ap.add_argument("--hz", type=float, default=10.0)
    args = ap.parse_args(argv)
    if args.command == "nvml":
        return sample_nvml(args.path, args.hz)
    if args.command == "launch":
        return one_launch()
    return kernel_step(args.path, os.path.join(os.path.dirname(args.path) or ".", "ncu.txt"))


if __name__ == "__main__":
    sys.exit(main())
