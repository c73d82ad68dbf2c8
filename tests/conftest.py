"""Shared fixtures: one Ray cluster for the whole test session, tiny real image trees."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")


def write_tree(root: Path, classes: dict[str, int], *, size=(32, 32), seed: int = 0, sizes=None) -> Path:
    """root/<class>/<i>.png with `classes[name]` images each. Each class has its own colour
    (so a model can learn it) plus noise. `sizes`, if given, cycles through (h, w) pairs."""
    rng = np.random.default_rng(seed)
    for ci, (name, n) in enumerate(sorted(classes.items())):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        base = np.array([(ci * 97) % 256, (ci * 53 + 80) % 256, (ci * 31 + 160) % 256])
        for i in range(n):
            h, w = sizes[i % len(sizes)] if sizes else size
            img = np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(folder / f"{i:03d}.png")
    return root


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster shared by every test that needs one."""
    import ray

    from jobs.train import quiet_ray

    kwargs = quiet_ray()
    # 4 logical CPUs on a 2-core machine: 2 train workers plus Ray Data's actors fit at once
    ray.init(num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", **kwargs)
    yield ray
    ray.shutdown()


@pytest.fixture()
def tree(tmp_path) -> Path:
    return write_tree(tmp_path / "data", {"cat": 12, "dog": 12, "eel": 12})
