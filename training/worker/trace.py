"""A Chrome trace of a few steady training steps in the trainer, for the GPU kit (bench/gpu_kit.py):
with RGA_TRACE=DIR[:START[:COUNT]] set, rank 0 profiles its steps START+1 to START+COUNT of this
invocation (default 40 and 20) under torch.profiler and writes DIR/trainer_trace.json.gz and
DIR/trainer.json: when its first step ended (time.time()), the steps traced and the peak GPU
memory torch's allocator held over them. Unset, after_step does nothing but count.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time

import torch

TRACE_ENV = "RGA_TRACE"


class StepTrace:
    """The trace's state in one trainer process: the steps done, the profiler while it runs."""

    def __init__(self, spec: str, device: torch.device):
        folder, *rest = spec.split(":")
        self.folder, self.device = folder, device
        self.start = int(rest[0]) if rest else 40
        self.count = int(rest[1]) if len(rest) > 1 else 20
        self.steps, self.profiler, self.info, self.began = 0, None, {}, 0.0

    def after_step(self) -> None:
        self.steps += 1
        if self.steps == 1:
            self.sync()
            self.info["first_step_at"] = time.time()
            self.write()
        if self.steps == self.start:
            self.begin()
        elif self.profiler is not None and self.steps == self.start + self.count:
            self.end()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        cuda = [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
        self.profiler = profile(activities=[ProfilerActivity.CPU, *cuda])
        self.profiler.__enter__()
        self.began = time.perf_counter()

    def end(self) -> None:
        self.sync()
        seconds = time.perf_counter() - self.began
        self.profiler.__exit__(None, None, None)
        path = os.path.join(self.folder, "trainer_trace.json")
        self.profiler.export_chrome_trace(path)
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)
        self.profiler = None
        memory = {"skipped": "no CUDA: torch.cuda's peak counts CUDA memory only"}
        if self.device.type == "cuda":
            memory = {
                "peak_allocated_mib": round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1),
                "peak_reserved_mib": round(torch.cuda.max_memory_reserved(self.device) / 2**20, 1),
            }
        traced = [self.start + 1, self.start + self.count]
        self.info |= {"traced_steps": traced, "traced_s": round(seconds, 3), "peak_memory": memory}
        self.info["trace"] = "trainer_trace.json.gz"
        self.write()

    def write(self) -> None:
        with open(os.path.join(self.folder, "trainer.json"), "w") as f:
            json.dump(self.info, f, indent=2)


ACTIVE: dict = {}  # this process's StepTrace, made at its first step


def after_step(device: torch.device, rank: int) -> None:
    """Called after each training step: the trace's bookkeeping where RGA_TRACE asks for one (rank 0)."""
    spec = os.environ.get(TRACE_ENV)
    if not spec or rank != 0:
        return
    if "trace" not in ACTIVE:
        os.makedirs(spec.split(":")[0], exist_ok=True)
        ACTIVE["trace"] = StepTrace(spec, device)
    ACTIVE["trace"].after_step()
