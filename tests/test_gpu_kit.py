"""The GPU kit (bench/gpu_kit.py, what comes back from it in bench/kit_return.py) keeps the lent
machine's contract, rehearsed here on the CPU: at most 8 files back with the allowed names,
feed.json with every key, the whole run within its budget, a step past its cap stopped without
losing the others' figures; and its figures are read from the job's own records as the job
writes them."""

from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_kit, kit_probe, kit_return

REPO = Path(__file__).resolve().parents[1]


def test_a_rehearsal_keeps_the_contract_and_brings_back_every_key(tmp_path):
    """The steps that fit in CI's minute (the train steps have their own tests: tests/test_train_job.py),
    at toy sizes on the CPU, end to end: the exit status, the files back, every figure of the steps
    that ran a number, the others None, what cannot run on a CPU recorded as skipped with why, each
    step's status and time in the provenance."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    args = ["--rehearse", "--steps", "env", "decode", "kernel", "synthetic", "seed", "--budget", "150"]
    args += ["--out", str(out), "--scratch", str(scratch)]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bench.gpu_kit", *args], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert time.monotonic() - start < 150
    assert sorted(os.listdir(out)) == sorted(["feed.json", "kit.tar.gz", "profile.txt", "decode_trace.json.gz"])
    assert kit_return.check_contract(str(out), 1.0, 150) == []
    feed = json.loads((out / "feed.json").read_text())
    assert set(kit_return.FEED_KEYS) <= set(feed)
    for key in ("decode_augment_images_per_s", "synthetic_images_per_s", "seed_images_per_s"):
        assert isinstance(feed[key], float) and feed[key] > 0, (key, feed[key])
    # each main figure measured twice, both kept
    for key in ("decode_augment_images_per_s", "synthetic_images_per_s", "seed_images_per_s"):
        assert len(feed["runs"][key]) == 2 and all(r > 0 for r in feed["runs"][key]), (key, feed["runs"])
    assert feed["job_images_per_s"] is None and feed["train_images"] is None
    assert feed["sm_us_per_image"] is None and feed["copy_us_per_image"] is None  # no CUDA rows on a CPU
    assert feed["nvml"]["skipped"].startswith("no NVML")
    assert feed["fused_kernel_us_per_image"] is None and "no CUDA" in feed["fused_kernel"]["skipped"]
    assert set(feed["peak_memory"]) == {"trainer", "augment_call", "fused_kernel"}
    assert "no CUDA" in feed["peak_memory"]["augment_call"]["skipped"]
    assert feed["versions"]["torch"] and feed["versions"]["cores"] == os.cpu_count()
    assert feed["engine_share"] == 0.0 and feed["decode"]["decoded_on"]["cpu"] == gpu_kit.Sizes.rehearsal().decode_batch
    steps = {s["name"]: s["status"] for s in feed["kit"]["steps"]}
    assert steps == {"env": "ok", "decode": "ok", "kernel": "ok", "synthetic": "ok", "seed": "ok"}
    assert feed["kit"]["rehearsal"] is True
    # the commit where the tree is a git checkout; a copy without .git (an unpacked tarball) records None
    assert len(feed["kit"]["commit"]) == 40 if (REPO / ".git").exists() else feed["kit"]["commit"] is None
    listed = subprocess.run(["tar", "tzf", out / "kit.tar.gz"], capture_output=True, text=True).stdout
    assert "decode.log" in listed and "kernel.json" in listed
    with gzip.open(out / "decode_trace.json.gz") as f:  # a Chrome trace of the profiled call
        assert json.load(f)["traceEvents"]
    assert "decode_augment_images_per_s" in done.stdout  # the table printed last


def test_a_copy_without_git_records_the_commit_it_was_given_and_changes_unknown(tmp_path, monkeypatch):
    """The device machine runs a copy of the tree without .git (and perhaps without git): the
    commit comes from $KIT_COMMIT, and whether the tree had changes is not guessed."""
    here = kit_return.source()
    assert (
        here["commit"]
        == subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    )
    assert isinstance(here["uncommitted_changes"], bool)
    monkeypatch.setattr(kit_return, "REPO", str(tmp_path))  # a folder outside any checkout
    monkeypatch.delenv(kit_return.KIT_COMMIT, raising=False)
    assert kit_return.source() == {"commit": None, "uncommitted_changes": None}
    monkeypatch.setenv(kit_return.KIT_COMMIT, "0123abcd" * 5)
    assert kit_return.source() == {"commit": "0123abcd" * 5, "uncommitted_changes": None}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all: the same, not a crash at the end of the run
    assert kit_return.source() == {"commit": "0123abcd" * 5, "uncommitted_changes": None}


def test_the_contract_names_every_breach(tmp_path):
    (tmp_path / "feed.json").write_text(json.dumps({k: None for k in kit_return.FEED_KEYS if k != "bound"}))
    (tmp_path / "model.pt").write_bytes(b"x")
    for i in range(8):
        (tmp_path / f"log{i}.txt").write_text("x")
    problems = kit_return.check_contract(str(tmp_path), 500.0, 480.0)
    assert "10 files in" in problems[0] and any(p.startswith("model.pt: not one of") for p in problems)
    assert "feed.json has no bound" in problems and problems[-1] == "took 500 s, over the budget of 480 s"


def test_a_step_past_its_cap_is_stopped_even_if_it_ignores_sigint(tmp_path):
    """Its whole process group: a child that ignores SIGINT gets SIGKILL; the kit goes on."""
    code = "import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    started = time.monotonic()
    result = gpu_kit.run_step("slow", [sys.executable, "-c", code], 1.0, str(tmp_path), grace=1.0)
    assert result.status == "timed out" and time.monotonic() - started < 10
    assert gpu_kit.run_step("quick", [sys.executable, "-c", "print(1)"], 10.0, str(tmp_path)).status == "ok"
    assert (tmp_path / "quick.log").read_text() == "1\n"
    failed = gpu_kit.run_step("bad", [sys.executable, "-c", "raise SystemExit(3)"], 10.0, str(tmp_path))
    assert failed.status == "failed (exit 3)"


def _timings(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    with open(run_dir / "timings.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_the_jobs_figures_are_its_steady_epochs_from_its_timings(tmp_path):
    """Epochs 2+ weighted by their time: within epochs from inner_images_per_s, whole epochs from
    images_per_s; a run stopped at its cap (no summary.json) takes its bound from the last row."""
    row = {"epoch_s": 10.0, "images_per_s": 900.0, "inner_images_per_s": 1000.0, "start_s": 0.5}
    row |= {"data_wait_frac": 0.1, "bound": "trainer", "gpu_shared": 0.0, "read_busy": 0.1, "augment_busy": 0.2}
    row |= {"tasks_busy": 0.2, "decoded_engines": 9000, "decoded_gpu_sms": 0, "decoded_cpu": 0}
    first = row | {"epoch_s": 30.0, "images_per_s": 300.0, "inner_images_per_s": 400.0, "start_s": 9.0}
    slow = row | {"epoch_s": 30.0, "images_per_s": 500.0, "inner_images_per_s": 600.0, "bound": "decode + augment"}
    _timings(tmp_path / "kit", [first, row, slow])
    figures = kit_return.job_figures(str(tmp_path / "kit"), str(tmp_path / "train.log"))
    assert figures["job_images_per_s"] == pytest.approx((1000 * 10 + 600 * 30) / 40, abs=0.1)
    assert figures["job_images_per_s_runs"] == [1000.0, 600.0]  # each steady epoch's, kept
    assert figures["job_images_per_s_whole_epochs"] == pytest.approx((9000 + 15000) / 40, abs=0.1)
    assert figures["epoch_start_s"] == 0.5 and figures["steady_s"] == 40.0 and figures["first_step_s"] is None
    assert figures["bound"]["stage"] == "decode + augment" and not figures["job_finished"]
    assert figures["decoded_on"] == {"engines": 27000, "gpu_sms": 0, "cpu": 0}


def test_a_run_stopped_at_its_cap_says_what_it_trained_and_when_its_first_step_ended(tmp_path):
    """No summary.json (the run was stopped): the images trained are metrics.csv's, epoch by
    epoch as written, not the tree's size; the first step's time is the trainer's own record
    (training/worker/trace.py's trainer.json) less the step's start."""
    row = {"epoch_s": 10.0, "images_per_s": 1280.0, "inner_images_per_s": 1300.0, "start_s": 0.5}
    row |= {"data_wait_frac": 0.1, "bound": "trainer", "decoded_engines": 12800, "decoded_gpu_sms": 0}
    _timings(tmp_path / "kit", [row, row])
    with open(tmp_path / "kit" / "metrics.csv", "w") as f:
        f.write("epoch,lr,train_loss,train_images\n1,0.1,4.5,12800\n2,0.1,4.4,12544\n")
    trainer = {"first_step_at": 1000.0 + 23.4}
    figures = kit_return.job_figures(str(tmp_path / "kit"), str(tmp_path / "train.log"), trainer, 1000.0)
    assert figures["train_images"] == 12800 + 12544 and figures["first_step_s"] == 23.4
    assert figures["job_epochs"] == 2 and figures["first_epoch_s"] == 10.0
    # nothing trained: no images, no first step
    assert kit_return.job_figures(str(tmp_path / "none"), str(tmp_path / "train.log")) == {
        "first_step_s": None, "train_images": None, "job_epochs": 0, "job_finished": False,
    }  # fmt: skip


def test_the_train_steps_epochs_aim_at_a_minute_of_steady_training():
    sizes = gpu_kit.Sizes()
    # epochs of 12,800 samples (50 steps), so that each one finishes: 60 s x 0.9 x 12,000 / 12,800 = 50.6
    assert gpu_kit.train_epochs({"steady_img_s": 12_000.0}, sizes) == 1 + 51
    assert gpu_kit.train_epochs({"steady_img_s": 1_000.0}, sizes) == 1 + 5  # 4.2, rounded up
    assert gpu_kit.train_epochs({"steady_img_s": 100.0}, sizes) == 3  # never fewer than 3
    assert gpu_kit.train_epochs(None, sizes) == 3
    assert gpu_kit.train_epochs({"steady_img_s": 12_000.0}, gpu_kit.Sizes.rehearsal()) == 3  # the CPU's toy run


def test_dmons_jpg_column_is_averaged(tmp_path):
    text = (
        "# gpu    sm   mem   enc   dec   jpg   ofa\n# Idx     %     %     %     %     %     %\n"
        "    0    10     5     0     0    40     0\n    0    12     5     0     0    60     0\n"
    )
    (tmp_path / "dmon.txt").write_text(text)
    assert gpu_kit.dmon_jpg(str(tmp_path / "dmon.txt")) == 50.0
    (tmp_path / "old.txt").write_text("# gpu sm mem enc dec\n 0 1 2 3 4\n")
    assert gpu_kit.dmon_jpg(str(tmp_path / "old.txt")) is None


def test_a_failed_decode_column_is_recorded_and_the_others_go_on(tmp_path, monkeypatch):
    """bench/decode.py: one column's failure (nvImageCodec returning nothing, say) is its row's
    None and reason; the JSON is on disk after each row."""
    from bench import decode

    def refuses(*args):
        raise RuntimeError("nvImageCodec returned nothing for 8 of 8 generated photos")

    monkeypatch.setattr(decode, "time_decode_only", refuses)
    path = tmp_path / "decode.json"
    args = ["--camera", "0", "--images", "8", "--batch-sizes", "8", "--seconds", "0.1", "--json", str(path)]
    rows = decode.main(args)
    (row,) = json.loads(path.read_text())["rows"]
    assert row == rows[0] and row["decode_augment"] > 0 and row["seed_pil"] > 0
    assert row["decode_only_nvimgcodec"] is None and "returned nothing" in row["errors"]["decode_only_nvimgcodec"]


def test_the_env_step_names_the_machines_packages_that_the_carried_wheels_outgrow():
    """carry.json's device_needs, checked against what is installed (the device's list has no versions)."""
    needs = {"numpy": [">=1.20 (ray)", ">=99 (a future kornia)"], "no-such-package": [">=1 (ray)"]}
    import numpy

    assert gpu_kit.unmet_needs({"device_needs": needs}) == [
        f"numpy {numpy.__version__}: >=99 (a future kornia)",
        "no-such-package: missing (>=1 (ray))",
    ]
    assert gpu_kit.unmet_needs(None) == []


def _row(key: str, device: str, self_device_us: float, *, annotation: bool = False):
    """One row of key_averages() as torch.profiler gives it, with the fields the sum reads."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    kind = {"cpu": DeviceType.CPU, "cuda": DeviceType.CUDA}[device]
    return SimpleNamespace(
        key=key, device_type=kind, self_device_time_total=self_device_us, is_user_annotation=annotation
    )


def test_the_sms_time_counts_each_kernel_once_and_the_copies_apart():
    """A profiler table recorded with CUDA activity: torch charges a kernel to the op that launched
    it (the CPU op's row: its self_device_time_total) and lists it as a CUDA row of its own; a copy
    is a Memcpy row (a DMA engine's, not the SMs'). torch's own total counts the CUDA rows only."""
    rows = [
        _row("rga::augment_first_ops", "cpu", 700.0),  # the fused kernel under its op
        _row("augment_kernel", "cuda", 700.0),  # the same kernel's own row
        _row("aten::to", "cpu", 300.0),  # the copy under aten::to
        _row("Memcpy HtoD (Pinned -> Device)", "cuda", 300.0),
        _row("Memset (Device)", "cuda", 5.0),
        _row("aten::add_", "cpu", 40.0),
        _row("void at::native::vectorized_elementwise_kernel<4>", "cuda", 40.0),
        _row("decode", "cuda", 999.0, annotation=True),  # a user's range: not device work of its own
    ]
    spent = kit_probe.device_us(rows)
    assert spent == {"kernel_us": 740.0, "copy_us": 305.0}
    assert sum(r.self_device_time_total for r in rows) == 3084.0  # the old sum: every kernel and copy twice


def test_a_step_with_a_failed_column_reads_partial_with_the_error(tmp_path):
    (tmp_path / "decode.json").write_text(json.dumps({"errors": {"decode_only_nvjpeg": "RuntimeError: boom"}}))
    result = gpu_kit.settle(kit_return.StepResult("decode", "ok", 12.0, 45.0), str(tmp_path))
    assert result.status == "partial (decode_only_nvjpeg: RuntimeError: boom)"
    (tmp_path / "seed.json").write_text(json.dumps({"errors": {}}))
    assert gpu_kit.settle(kit_return.StepResult("seed", "ok"), str(tmp_path)).status == "ok"
    assert gpu_kit.settle(kit_return.StepResult("env", "failed (exit 1)"), str(tmp_path)).status == "failed (exit 1)"
    (tmp_path / "smoke.json").write_text(json.dumps({"errors": {"check 0": "fused kernel at 4000x3000: 2 levels"}}))
    failed = gpu_kit.settle(kit_return.StepResult("smoke", "failed (exit 1)"), str(tmp_path))
    assert failed.status == "failed (exit 1): check 0: fused kernel at 4000x3000: 2 levels"


def test_nvidia_smi_samples_are_summarised_over_each_steps_steady_window(tmp_path):
    """nvml.csv as kit_probe's sampler writes it, at 10 Hz: mean, p50 and p90 inside the window only,
    empty columns (a figure the driver does not expose) None, each process's largest memory."""
    path = tmp_path / "nvml.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=kit_probe.NVML_COLUMNS)
        writer.writeheader()
        for i in range(100):  # 10 s; the steady window is its last 5 s, SM 50-99 % there
            row = {"t": 100 + i / 10, "sm_pct": i, "mem_bw_pct": 20, "jpg_pct": "", "mem_used_mib": 1000 + i}
            row |= {"sm_mhz": 1980, "mem_mhz": 3201, "power_w": 400.0, "procs": f"11={i}|12=7"}
            writer.writerow(row)
    summary = kit_probe.nvml_summary(str(path), {"train": (105.0, 109.95), "seed": (300.0, 310.0)})
    train = summary["steps"]["train"]
    assert train["samples"] == 50 and train["hz"] == pytest.approx(10.0, abs=0.1)
    assert train["sm_pct"] == {"mean": 74.5, "p50": 75.0, "p90": 95.0}
    assert train["jpg_pct"] is None and train["mem_used_mib_by_process"] == {"11": 99, "12": 7}
    assert summary["steps"]["seed"] == {"samples": 0, "window_s": 10.0}
    assert kit_return.FEED_KEYS[-3:] == ("nvml", "peak_memory", "fused_kernel_us_per_image")


def test_files_nvimagecodec_leaves_to_the_cpu_are_counted_not_an_error(monkeypatch):
    """bench/decode.py's decode-only column: a CMYK JPEG comes back empty (the job's CPU decoders
    take it); the column keeps its rate over the images decoded and says how many were left."""
    import numpy as np
    import torch

    from augment import engines
    from bench import decode

    files = decode.encoded_photos("imagenet", 4)

    def leaves_one(datas, jpeg, regions, device):
        images = [np.zeros((8, 8, 3), np.uint8) for _ in datas]
        images[0] = None
        return images, [True] * len(datas), [2] * len(datas)

    monkeypatch.setattr(engines, "decode_regions", leaves_one)
    refused = {}
    rate = decode.time_decode_only(files, 4, torch.device("cpu"), 0.05, "nvimgcodec", refused)
    assert rate > 0 and refused == {"per_call": 1, "of_files": 4}


def test_the_caps_leave_a_minute_free_and_the_smoke_fits_its_90_seconds():
    sizes = gpu_kit.Sizes()
    caps = dict(sizes.caps)
    assert sum(caps.values()) <= sizes.budget - 60
    assert sum(caps[s] for s in gpu_kit.SMOKE) <= sizes.smoke_budget - 10  # the install's seconds
    assert list(caps)[: len(gpu_kit.SMOKE)] == list(gpu_kit.SMOKE)  # the smoke first
    rehearsal = gpu_kit.Sizes.rehearsal()
    assert [c for c, _ in rehearsal.caps] == list(caps)


def test_the_tests_step_leaves_the_whole_training_run_to_the_train_step(tmp_path):
    data = {"full": str(tmp_path / "data"), "smoke": str(tmp_path / "smoke-data")}
    cmd = gpu_kit.commands("tests", str(tmp_path), data, gpu_kit.Sizes(), False)
    expression = cmd[cmd.index("-k") + 1]
    assert "not (test_a_cuda_bf16_run)" in expression  # tests/test_gpu.py's jobs.train run
    smoke = gpu_kit.commands("smoke_train", str(tmp_path), data, gpu_kit.Sizes(), False)
    assert smoke[smoke.index("--data") + 1] == data["smoke"] and smoke[smoke.index("--epochs") + 1] == "1"


def test_the_triton_interpreter_is_for_machines_without_cuda_only():
    from tests.conftest import interpreter_wanted

    assert interpreter_wanted(False) and not interpreter_wanted(True)


def test_the_env_step_reads_the_carry_set_where_carry_names_it(tmp_path, monkeypatch):
    from bench import kit_steps

    monkeypatch.setattr(kit_steps, "REPO", str(tmp_path))
    monkeypatch.setenv("CARRY", "elsewhere")
    assert kit_steps.carry_folder() == str(tmp_path / "elsewhere")
    monkeypatch.delenv("CARRY")
    assert kit_steps.carry_folder() == str(tmp_path / ".gpu-carry")


def test_the_trainer_traces_the_steps_it_is_asked_for(tmp_path, monkeypatch):
    """training/worker/trace.py: with RGA_TRACE=DIR:START:COUNT, rank 0 writes its first step's time
    at once, then a gzipped Chrome trace of steps START+1..START+COUNT and what it traced; other
    ranks, and a trainer without the variable, write nothing."""
    import torch

    from training.worker import trace

    monkeypatch.setattr(trace, "ACTIVE", {})
    monkeypatch.setenv(trace.TRACE_ENV, f"{tmp_path}:2:3")
    x = torch.randn(64, 64)
    for step in range(8):
        trace.after_step(torch.device("cpu"), rank=1)  # not rank 0: nothing
        x = x @ x.T / 64
        trace.after_step(torch.device("cpu"), rank=0)
        if step == 0:
            assert set(json.loads((tmp_path / "trainer.json").read_text())) == {"first_step_at"}
    info = json.loads((tmp_path / "trainer.json").read_text())
    assert info["traced_steps"] == [3, 5] and info["trace"] == "trainer_trace.json.gz"
    assert "no CUDA" in info["peak_memory"]["skipped"] and abs(info["first_step_at"] - time.time()) < 60
    with gzip.open(tmp_path / "trainer_trace.json.gz") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "aten::mm" in names  # the traced steps' matrix products
    monkeypatch.setattr(trace, "ACTIVE", {})
    monkeypatch.delenv(trace.TRACE_ENV)
    trace.after_step(torch.device("cpu"), rank=0)
    assert trace.ACTIVE == {}


def test_registers_and_spills_are_read_off_each_compiled_kernel_of_the_module():
    """kit_probe.compiled_kernels walks the JITFunctions' device_caches as Triton 3.x lays them out
    ((kernel_cache, kernel_key_cache, target, backend, binder) per device), loading each binary's
    handles first: Triton sets n_regs and n_spills only then."""
    from types import SimpleNamespace

    class Compiled:
        metadata = SimpleNamespace(shared=4096)

        def _init_handles(self):
            self.n_regs, self.n_spills = 40, 0

    kernel = SimpleNamespace(device_caches={0: ({"key": Compiled()}, {}, "cuda:90", None, None)})
    helper = SimpleNamespace(device_caches={})  # a @triton.jit helper: never compiled alone
    module = SimpleNamespace(augment_kernel=kernel, _axis=helper, BLOCK=256)
    assert kit_probe.compiled_kernels(module) == {"augment_kernel": {"n_regs": 40, "n_spills": 0, "shared_bytes": 4096}}
    assert kit_probe.compiled_kernels(SimpleNamespace()) == {}


def test_the_kernel_steps_inputs_are_the_fused_ops_own(monkeypatch):
    """kit_probe.kernel_inputs builds what augment/fused.py's op takes for random ImageNet-size
    photos; one launch of it (Triton's interpreter here) writes the preset's output."""
    import torch

    from augment import fused

    if not fused.available(torch.device("cpu")):
        pytest.skip("Triton's interpreter is not on (TRITON_INTERPRET=1)")
    views, meta, factors, (oh, ow), fill, float_out = kit_probe.kernel_inputs(1, torch.device("cpu"))
    assert len(views) == 1 and 333 <= views[0].shape[0] <= 500 and views[0].dtype == torch.uint8
    out = fused.augment_first_ops(views, meta, factors, oh, ow, fill, float_out)
    assert tuple(out.shape)[1:] == ((3, oh, ow) if float_out else (oh, ow, 3)) and (oh, ow) == (224, 224)
    assert float(out.float().std()) > 1  # random photos in, not a constant out


def test_the_smoke_fails_on_pixels_off_by_more_than_a_level_and_on_engines_left_idle():
    from bench import kit_smoke

    decode = {"files": 64, "decoded": 63, "refused": 1, "decoded_on": {"engines": 60, "gpu_sms": 3, "cpu": 0}}
    good = {"device": "cuda", "fused": {"500x375": {"max_level_diff": 1}}, "decode": decode}
    assert kit_smoke.judge(good | {"ordering": {"corrupted": {"victims": 0, "checksums": 0}}}) == []
    off = good | {"fused": {"4000x3000": {"max_level_diff": 2}}}
    assert kit_smoke.judge(off) == ["fused kernel at 4000x3000: 2 levels from the CPU's pixels"]
    idle = good | {"decode": decode | {"decoded_on": {"engines": 0, "gpu_sms": 63, "cpu": 0}}}
    assert "none on the hardware JPEG engines" in kit_smoke.judge(idle)[0]
    assert kit_smoke.judge(idle | {"device": "cpu"}) == []  # the CPU's rehearsal has no engines
    assert "ordering" in kit_smoke.judge(good | {"ordering": {"corrupted": {"victims": 3}}})[0]
