"""The GPU kit's steps that run in its own code (bench/gpu_kit.py runs each in a process of its
own): env (versions, the carry set against the device's packages) and decode (decode + augment
alone: img/s twice, one call under torch.profiler with its Chrome trace, where its images were
decoded, its peak GPU memory, nvidia-smi dmon's jpg column).
"""

from __future__ import annotations

import json
import os
import subprocess

from bench.kit_probe import device_us, gzip_trace
from bench.kit_return import REPO, read_json


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


def carry_folder() -> str:
    """The carry set's folder: $CARRY (relative to the repository, as bench/gpu.sh takes it), else .gpu-carry."""
    return os.path.join(REPO, os.environ.get("CARRY") or ".gpu-carry")


def env_step(scratch: str) -> None:
    carry = read_json(os.path.join(carry_folder(), "carry.json"))
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


def decode_step(scratch: str, data: str, sizes) -> None:
    """decode.json, written after each part: img/s of decode + augment twice (both kept), of each
    decoder alone, then one call under the profiler (profile.txt, decode_trace.json.gz) and where
    its images were decoded. `sizes`: the run's bench.gpu_kit.Sizes."""
    import torch

    from bench import write_json
    from bench.decode import column, decoders, time_decode_augment, time_decode_only

    torch.set_num_threads(1)  # what an augment task gets
    device = torch.device(sizes.device)
    files = distinct_files(data, sizes.decode_files)
    result = {"batch": sizes.decode_batch, "files": len(files), "mean_file_bytes": sum(map(len, files)) // len(files)}
    result |= {"errors": {}, "device": sizes.device, "refused": {}}
    path = os.path.join(scratch, "decode.json")
    dmon = Dmon(scratch) if device.type == "cuda" and _has("nvidia-smi") else None
    for run in ("decode_augment", "decode_augment_again"):
        column(result, run, time_decode_augment, files, sizes.decode_batch, device, True, sizes.seconds)
        write_json(path, result)
    runs = [result[r] for r in ("decode_augment", "decode_augment_again") if result[r]]
    result["decode_augment_runs"] = runs
    result["decode_augment"] = round(sum(runs) / len(runs), 1) if runs else None
    for decoder in decoders(device):
        name = f"decode_only_{decoder.replace('-', '_')}"
        column(result, name, time_decode_only, files, sizes.decode_batch, device, sizes.seconds, decoder,
               result["refused"].setdefault(name, {}))  # fmt: skip
        write_json(path, result)
    result["dmon_jpg_util"] = dmon.stop() if dmon else None
    result |= profile_call(files, sizes.decode_batch, device, scratch)
    write_json(path, result)
    print(json.dumps(result), flush=True)


def profile_call(files: list[bytes], batch: int, device, scratch: str) -> dict:
    """One decode_augment call of `batch` images under torch.profiler (after a warm-up call): the
    SMs' time per image and the copies' apart on a GPU (kit_probe.device_us; the CPU's time off
    one), where its images were decoded, its peak GPU memory; the table into profile.txt and the
    Chrome trace into decode_trace.json.gz."""
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
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        decoded = decode_augment(pipeline, chosen, keys, 1, device, shrink=True)
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    with open(os.path.join(scratch, "profile.txt"), "w") as f:
        f.write(events.table(sort_by=sort, row_limit=40))
    trace = os.path.join(scratch, "decode_trace.json")
    prof.export_chrome_trace(trace)
    gzip_trace(trace)
    spent = device_us(events) if cuda else None
    cpu_us = sum(e.self_cpu_time_total for e in events)
    counts = {place: decoded.decoded_on.count(i) for i, place in enumerate(DECODE_PLACES)}
    memory = {"skipped": "no CUDA: torch.cuda's peak counts CUDA memory only"}
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        memory = {"peak_allocated_mib": round(peak / 2**20, 1), "call_mib": round((peak - before) / 2**20, 1)}
        memory["reserved_mib"] = round(torch.cuda.max_memory_reserved(device) / 2**20, 1)
    return {
        "sm_us_per_image": round(spent["kernel_us"] / batch, 2) if cuda else None,
        "copy_us_per_image": round(spent["copy_us"] / batch, 2) if cuda else None,
        "cpu_us_per_image": round(cpu_us / batch, 2),
        "decoded_on": counts,
        "engine_share": round(counts["engines"] / max(sum(counts.values()), 1), 4),
        "peak_memory": memory,
        "trace": "decode_trace.json.gz",
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
