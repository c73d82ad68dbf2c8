"""The layout's rules (docs/design.md, "Layout"), held where a reader cannot see them: the
augment package imports no Ray, the modules documented as light import neither torch nor
what else their docstrings rule out, and no module imports another's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("augment", "training", "jobs", "bench", "tests")

# module -> what importing it must not import: the entry points check a user's inputs before
# torch or Ray Train load, and Ray's coordinator processes unpickle what the data modules define
LIGHT = {
    "augment.errors": ("torch",),
    "augment.presets": ("torch",),
    "augment.schedule": ("torch",),
    "augment.decode": ("torch",),
    "training.bounds": ("torch", "ray"),
    "training.config": ("torch", "ray"),
    "training.spec": ("torch", "ray"),
    "training.session": ("torch", "ray"),
    "training.inputs": ("torch", "ray.train"),
    "training.ray_private": ("torch", "ray.train"),
    "training.ingest": ("torch",),
    "training.stage": ("torch",),
    "training.stamp": ("torch",),
}


def _imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_augment_package_imports_no_ray():
    modules = sorted(p.stem for p in (REPO / "augment").glob("*.py") if p.stem != "__init__")
    assert len(modules) >= 10
    loaded = _imported_after(", ".join(f"augment.{m}" for m in modules))
    assert {f"augment.{m}" for m in modules} <= loaded
    assert not {m for m in loaded if m == "ray" or m.startswith("ray.")}


@pytest.mark.parametrize("module", sorted(LIGHT))
def test_a_light_module_imports_nothing_heavy(module):
    loaded = _imported_after(module)
    assert module in loaded
    assert not [heavy for heavy in LIGHT[module] if heavy in loaded], loaded & set(LIGHT[module])


def test_no_module_imports_a_private_name_of_another():
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                    found += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, found
