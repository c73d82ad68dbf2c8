"""Benchmarks: scripts that print a table and, with --json FILE, write their figures."""

from __future__ import annotations


def write_json(path: str | None, result: dict) -> dict:
    """`result` written to `path` as indented JSON (nothing where `path` is None); returns it."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result
