"""A read task's word that the data itself went (its folder, prefix or bucket), as opposed to one bad
file: the exception, how the driver finds its line in the text Ray passes on, and the filter that
keeps its traceback off Ray Data's console (training/driver/ray_data_logging.yaml names it)."""

from __future__ import annotations

import logging
import re
import sys


class DataGone(RuntimeError):
    """The data's folder, prefix or bucket cannot be read any more: no one file's fault, so the
    run stops with this one line. Ray hands a read task's exception on as text, in which
    training/driver/job.py worker_error finds it by its name (training.driver.console.data_gone)."""


def data_gone(text: str) -> str | None:
    """The line of a read task's DataGone (the data's folder or bucket went) in the
    text of an error that Ray passed on from the task (Ray hands it on as text); None if none."""
    found = re.search(r"\bDataGone: ([^\n]+)", text)
    return found[1].strip() if found else None


class QuietDataGone(logging.Filter):
    """Ray Data's console records of a read task's DataGone (the task's traceback, and the notice it
    logs while handling the error), dropped: the driver says it in one line (training/driver/job.py
    worker_error); Ray Data's log file keeps them. ray_data_logging.yaml names it."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        return error is None or data_gone(f"{record.getMessage()}\n{error}") is None
