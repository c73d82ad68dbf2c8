"""`make test-fast` (`pytest -m "not ray"`) leaves out every test that starts Ray: under it, tests/conftest.py
stops one that is not marked `ray`, whether it calls ray.init itself or starts a job that would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBES = """
import subprocess, sys

import ray


def test_ray_in_this_process():
    ray.init(address="local", include_dashboard=False)


def test_ray_in_a_subprocess():
    code = "import ray; ray.init(address='local', include_dashboard=False)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1]
"""


def test_without_the_ray_tests_a_test_that_starts_ray_fails_saying_so(tmp_path):
    (tmp_path / "test_probes.py").write_text(PROBES)
    args = [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "-p", "tests.conftest"]
    args += ["-p", "no:cacheprovider", "-q", "-m", "not ray", str(tmp_path / "test_probes.py")]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert "2 failed" in out, out[-3000:]
    assert "test_ray_in_this_process - Failed: this test starts Ray: mark it `ray`" in out, out[-3000:]
    subprocess_failure = out.split("_ test_ray_in_a_subprocess _")[-1]  # its traceback: what the job said
    assert "File exists: '" in subprocess_failure and "this test starts Ray: mark it ray/ray'" in subprocess_failure, (
        out[-3000:]
    )
