"""The GPU kit refuses, in its first line, the versions it is known not to work with
(bench/kit_versions.py): fake version strings, and fake installed packages under bench/gpu.sh."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kit_versions import refusal

REPO = Path(__file__).resolve().parents[1]
DEVICE = {"python": "3.12.3", "torch": "2.11.0+cu130", "torchvision": "0.26.0+cu130", "triton": "3.6.0"}


@pytest.mark.parametrize(
    "changed, words",
    [
        ({"torch": "2.10.1+cu128", "torchvision": "0.25.1+cu128"}, ["torch 2.10.1+cu128 is older than the 2.11"]),
        ({"triton": "3.5.1"}, ["triton 3.5.1 is older than the 3.6"]),
        ({"triton": None}, ["triton is not installed"]),
        ({"torchvision": "0.27.0"}, ["torchvision 0.27.0 is not torch 2.11.0+cu130's pair (0.26)"]),
        ({"python": "3.11.7"}, ["Python 3.11.7 cannot install the carry set, built for Python 3.12"]),
    ],
)
def test_versions_known_not_to_work_are_refused_in_one_line_with_the_fix(changed, words):
    line = refusal(DEVICE | changed, device=True, carry_needed=True)
    assert line is not None and line.startswith("error: ") and "\n" not in line
    for word in words:
        assert word in line, line
    assert "docs/benchmarks.md" in line


def test_the_rehearsed_versions_and_newer_ones_pass():
    assert refusal(DEVICE, device=True, carry_needed=True) is None
    newer = {"python": "3.11.7", "torch": "2.14.1", "torchvision": "0.29.1", "triton": "3.8.0"}
    assert refusal(newer, device=False, carry_needed=True) is None  # the rehearsal installs no carry set
    assert refusal(newer, device=True, carry_needed=False) is None  # Ray there already: no carry set
    assert refusal(newer | {"torch": "2.14.0a0+git1234", "torchvision": "0.29.0a0"}, False, False) is None


def fake_site(root: Path, versions: dict) -> Path:
    """A folder of dist-info metadata only, read first on PYTHONPATH: what importlib.metadata sees."""
    for name, version in versions.items():
        info = root / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


@pytest.mark.parametrize("mode", [["--smoke"], ["--smoke", "--rehearse"]])
def test_gpu_sh_refuses_an_old_torch_in_its_first_line_and_runs_nothing(tmp_path, mode):
    site = fake_site(tmp_path / "site", {"torch": "2.10.0", "torchvision": "0.25.0", "triton": "3.5.0"})
    env = dict(os.environ, KIT_PYTHON=sys.executable, PYTHONPATH=str(site), CARRY=str(tmp_path / "no-carry"))
    cmd = ["bash", "bench/gpu.sh", *mode]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2, lines
    assert lines[0].startswith("error: torch 2.10.0 is older than the 2.11 the kit was rehearsed with"), lines
    assert len(lines) == 1, lines  # no install, no carry set check, no step
