"""A pytest plugin (`make test` and `make test-fast` load it: `-p tests.file_times`) that prints,
after the run, the test files that took longest: each file's seconds (set-up, call and tear-down
of its tests together) and its number of tests, slowest first. Where the suite's time goes, a
file at a time: the place to look before a change to the suite and after it."""

from __future__ import annotations

import collections

SECONDS: collections.Counter = collections.Counter()  # file -> seconds
TESTS: collections.Counter = collections.Counter()  # file -> tests run
SHOWN = 15


def pytest_runtest_logreport(report):
    where = report.nodeid.split("::", 1)[0]
    SECONDS[where] += report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        TESTS[where] += 1


def pytest_terminal_summary(terminalreporter):
    if not SECONDS:
        return
    total = sum(SECONDS.values())
    terminalreporter.write_sep("=", f"slowest {min(SHOWN, len(SECONDS))} test files of {len(SECONDS)}")
    for where, seconds in SECONDS.most_common(SHOWN):
        share = seconds / total if total else 0.0
        terminalreporter.write_line(f"{seconds:8.1f}s {share:6.1%} {TESTS[where]:4d} tests  {where}")
