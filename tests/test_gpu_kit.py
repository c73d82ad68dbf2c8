"""The GPU kit (bench/gpu_kit.py, what comes back from it in bench/kit_return.py) keeps the lent
machine's contract, rehearsed here on the CPU: at most 8 files back with the allowed names,
feed.json with every key, the whole run within its budget, a step past its cap stopped without
losing the others' figures; and its figures are read from the job's own records as the job
writes them."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_kit, kit_return

REPO = Path(__file__).resolve().parents[1]


def test_a_rehearsal_keeps_the_contract_and_brings_back_every_key(tmp_path):
    """The steps that fit in CI's minute (the train step has its own tests: tests/test_train_job.py),
    at toy sizes on the CPU, end to end: the exit status, the files back, every figure of the steps
    that ran a number, the others None, each step's status and time in the provenance."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    args = ["--rehearse", "--steps", "env", "decode", "synthetic", "seed", "--budget", "150"]
    args += ["--out", str(out), "--scratch", str(scratch)]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bench.gpu_kit", *args], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert time.monotonic() - start < 150
    assert sorted(os.listdir(out)) == sorted(kit_return.OUT_FILES)
    assert kit_return.check_contract(str(out), 1.0, 150) == []
    feed = json.loads((out / "feed.json").read_text())
    assert set(kit_return.FEED_KEYS) <= set(feed)
    for key in ("decode_augment_images_per_s", "synthetic_images_per_s", "seed_images_per_s"):
        assert isinstance(feed[key], float) and feed[key] > 0, (key, feed[key])
    assert feed["job_images_per_s"] is None and feed["train_images"] == gpu_kit.Sizes.rehearsal().train
    assert feed["versions"]["torch"] and feed["versions"]["cores"] == os.cpu_count()
    assert feed["engine_share"] == 0.0 and feed["decode"]["decoded_on"]["cpu"] == gpu_kit.Sizes.rehearsal().decode_batch
    steps = {s["name"]: s["status"] for s in feed["kit"]["steps"]}
    assert steps == {"env": "ok", "decode": "ok", "synthetic": "ok", "seed": "ok"}
    assert feed["kit"]["rehearsal"] is True
    # the commit where the tree is a git checkout; a copy without .git (an unpacked tarball) records None
    assert len(feed["kit"]["commit"]) == 40 if (REPO / ".git").exists() else feed["kit"]["commit"] is None
    assert "decode.log" in subprocess.run(["tar", "tzf", out / "kit.tar.gz"], capture_output=True, text=True).stdout
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
    assert figures["job_images_per_s_whole_epochs"] == pytest.approx((9000 + 15000) / 40, abs=0.1)
    assert figures["epoch_start_s"] == 0.5 and figures["steady_s"] == 40.0 and figures["first_step_s"] is None
    assert figures["bound"]["stage"] == "decode + augment" and not figures["job_finished"]
    assert figures["decoded_on"] == {"engines": 27000, "gpu_sms": 0, "cpu": 0}


def test_the_train_steps_epochs_aim_at_a_minute_of_steady_training():
    sizes = gpu_kit.Sizes()
    assert gpu_kit.train_epochs({"steady_img_s": 12_000.0}, sizes) == 1 + 13  # 60 s x 0.9 x 12,000 / 50,000 = 13
    assert gpu_kit.train_epochs({"steady_img_s": 1_000.0}, sizes) == 3  # never fewer than 3
    assert gpu_kit.train_epochs(None, sizes) == 3
    assert gpu_kit.train_epochs({"steady_img_s": 12_000.0}, gpu_kit.Sizes.rehearsal()) == 2  # the CPU's toy run


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
