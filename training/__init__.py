"""The Ray side of the job. From Python: `from training import fit` (training/api.py), which trains as
`python -m jobs.train` does and returns a RunResult. Imported lazily: `import training` stays light."""

__all__ = ["fit", "RunResult", "JobError", "STOP"]


def __getattr__(name: str):
    if name in __all__:
        from training import api

        return getattr(api, name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")
