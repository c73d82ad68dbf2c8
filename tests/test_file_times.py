"""tests/file_times.py: the slowest test files after a run, slowest first, with their tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_slowest_file_comes_first_with_its_seconds_and_tests(tmp_path):
    (tmp_path / "test_quick.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_c():\n    time.sleep(0.5)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.file_times", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    rows = re.findall(r"^\s+([\d.]+)s\s+[\d.]+%\s+(\d+) tests\s+(\S+)$", out, re.M)
    assert [(name, int(n)) for _, n, name in rows] == [("test_slow.py", 1), ("test_quick.py", 2)], out
    assert float(rows[0][0]) >= 0.5 and "slowest 2 test files of 2" in out
