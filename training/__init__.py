"""The Ray side of the job. From Python: `from training import fit` (training/driver/api.py), which trains as
`python -m jobs.train` does and returns a RunResult, and `from training import tune`, a sweep of such
runs on Ray Tune (training/sweep/tuner.py). Loaded on first use (importlib, not an import
statement): `import training` stays light, and no module of the package imports the API but the
sweep's (training/sweep/tuner.py, whose trials are runs)."""

import importlib

__all__ = ["fit", "RunResult", "JobError", "STOP", "tune"]


def __getattr__(name: str):
    if name == "tune":  # a sweep of runs (training/sweep/tuner.py)
        return importlib.import_module("training.sweep.tuner").tune
    if name in __all__:
        return getattr(importlib.import_module("training.driver.api"), name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")
