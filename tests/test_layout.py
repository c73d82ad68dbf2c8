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
    "training.userfiles": ("torch", "ray", "yaml"),
    "training.spec": ("torch", "ray"),
    "training.driver.session": ("torch", "ray"),
    "training.driver.inputs": ("torch", "ray.train"),
    "training.ray_private": ("torch", "ray.train"),
    "training.stream.ingest": ("torch",),
    "training.stream.stage": ("torch",),
    "training.stream.stamp": ("torch",),
    "training.stream.gone": ("torch", "ray"),
    "training.records": ("torch", "ray"),
    "training.rows": ("torch", "ray", "pyarrow"),
    "training.modelfile": ("torch", "ray"),
    "training.status": ("torch", "ray"),
    "augment.streams": ("torch", "numpy"),
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


def _modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name (sub-packages too)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import of the project's own modules in `path`, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] in PACKAGES]
    return found


def test_no_module_imports_a_private_name_of_another():
    found = [
        f"{path.relative_to(REPO)}: {module}.{name}"
        for path in _modules().values()
        for module, names in _imports(path)
        for name in names
        if name.startswith("_")
    ]
    assert not found, found


def _graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a `from package import module` names the module)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for module, names in _imports(path):
            targets |= {f"{module}.{n}" for n in names if f"{module}.{n}" in modules} or {module}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_no_import_cycle_in_the_tree():
    """Lazy imports count too: a cycle is one however late it closes."""
    graph, state, cycles = _graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


@pytest.mark.parametrize("package", ["augment", "training", "jobs", "bench"])
def test_no_module_is_over_500_lines(package):
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / package).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


DRIVER = "training.driver."  # the driver's room: the run, its plan, its checks, its console
FORMS = "training.forms"  # the data forms' wing: the driver scans, the read tasks read; never a train worker


def _reached_from(graph: dict, prefix: str) -> set[str]:
    """Every module that a module under `prefix` imports, however indirectly (itself included)."""
    seen, todo = set(), [m for m in graph if m.startswith(prefix)]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph[module]
    return seen


@pytest.mark.parametrize("room", ["training.worker.", "training.stream."])
def test_the_worker_and_the_stream_import_nothing_of_the_drivers(room):
    """The rule by prefix: a train worker and a Ray Data task run far from the driver, so nothing
    under training/worker/ or training/stream/ imports anything under training/driver/."""
    theirs = {m for m in _reached_from(_graph(), room) if m.startswith(DRIVER)}
    assert not theirs, sorted(theirs)


def test_the_worker_imports_none_of_the_data_forms():
    seen = _reached_from(_graph(), "training.worker.")
    assert not {m for m in seen if m == FORMS or m.startswith(FORMS + ".")}


def test_the_driver_reads_the_workers_through_the_records_only():
    """What crosses back from the workers is training/records.py's; of the worker's modules the
    driver imports the loop to hand to Ray Train, the errors that name its own verdicts, and the
    checkpoint's reader (its seal checked)."""
    allowed = {"train_loop", "load_checkpoint", "DamagedCheckpoint", "CheckpointMismatch", "RunStopped"}
    allowed |= {"IngestStalled"}
    taken = {
        (module, name)
        for driver, path in _modules().items()
        if driver.startswith(DRIVER)
        for module, names in _imports(path)
        if module.startswith("training.worker")
        for name in names
    }
    assert {name for _, name in taken} <= allowed, taken
