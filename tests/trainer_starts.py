"""An opt-in pytest plugin that counts Ray Train start-ups (TorchTrainer.fit calls in the pytest
process) per test and prints them after the run, to see what a change to the suite saved:

    python -m pytest -p tests.trainer_starts --durations=0 tests/test_api.py

Runs started as subprocesses (a `python -m jobs.train` that a test starts) are not seen."""

from __future__ import annotations

import collections

import pytest

STARTS: collections.Counter = collections.Counter()  # test id -> TorchTrainer.fit calls
RUNNING = ["(no test)"]  # the test id running now


def pytest_configure(config):
    from ray.train.torch import TorchTrainer

    owner = next(c for c in TorchTrainer.__mro__ if "fit" in c.__dict__)  # the class that defines fit
    fit = owner.fit

    def counted(self, *args, **kwargs):
        STARTS[RUNNING[0]] += 1
        return fit(self, *args, **kwargs)

    owner.fit = counted


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    RUNNING[0] = item.nodeid  # a module's fixture that trains counts for the test that first asked for it
    yield


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"Ray Train start-ups: {sum(STARTS.values())}")
    for test, n in sorted(STARTS.items()):
        terminalreporter.write_line(f"  {n} {test}")
