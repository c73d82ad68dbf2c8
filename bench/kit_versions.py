"""The versions the GPU kit is known not to work with, refused in the kit's first line of output:
bench/gpu.sh runs this before anything else (the carry set's install included), so a machine
that cannot pass is told so at once, with the fix, instead of minutes later.

    python -m bench.kit_versions [--rehearse]   # exit 2 with one line naming the problem and the fix;
                                                # else one line of the versions found, exit 0

The packages' versions are read from their metadata (nothing is imported: a second, not torch's
start). Refused (docs/benchmark-log.md, "The device's versions rehearsed here"):

* torch, torchvision or Triton older than the device's that the kit was rehearsed with
  (REHEARSED: torch 2.11, torchvision 0.26, Triton 3.6, under Python 3.12), or Triton missing;
* a torchvision that is not torch's pair (torch 2.N goes with torchvision 0.(N + 15); another
  fails at import with "operator torchvision::nms does not exist");
* on the device, a Python other than the carry set's (its wheels are built for 3.12) where Ray
  is not installed and the set has to be.

Newer versions than the rehearsed ones are not refused: nothing is known against them.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import platform
import re
import sys

REHEARSED = {"python": "3.12", "torch": "2.11", "torchvision": "0.26", "triton": "3.6"}
FIX = 'docs/benchmarks.md, "The GPU kit"'


def release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '2.11.0+cu130' or '3.6.0'; None for none."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


def refusal(found: dict, device: bool, carry_needed: bool, carry_python: str = REHEARSED["python"]) -> str | None:
    """The one line that refuses `found` ({"python", "torch", "torchvision", "triton"}: version
    strings, None where missing), or None where nothing is known against it. `device`: the GPU
    machine (not the rehearsal); `carry_needed`: Ray is missing there, so the carry set installs."""
    for name in ("torch", "torchvision", "triton"):
        have, floor = release(found.get(name)), release(REHEARSED[name] + ".0")
        if have is None:
            return f"error: {name} is not installed here; the kit needs {name} >= {REHEARSED[name]} ({FIX})"
        if have < floor:
            return (
                f"error: {name} {found[name]} is older than the {REHEARSED[name]} the kit was rehearsed with; "
                f"use a Python whose {name} is >= {REHEARSED[name]} (KIT_PYTHON=...) ({FIX})"
            )
    torch_minor, vision = release(found["torch"])[1], release(found["torchvision"])
    if vision != (0, torch_minor + 15):
        return (
            f"error: torchvision {found['torchvision']} is not torch {found['torch']}'s pair "
            f"(0.{torch_minor + 15}): install that pair together ({FIX})"
        )
    python = release(found.get("python"))
    if device and carry_needed and python != release(carry_python + ".0"):
        return (
            f"error: Python {found.get('python')} cannot install the carry set, built for Python {carry_python}; "
            f"run the kit with python{carry_python} (KIT_PYTHON=...) or install Ray there first ({FIX})"
        )
    return None


def installed() -> dict:
    """This Python's version and its torch, torchvision and Triton's (None where missing)."""
    found = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "triton"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kit_versions", description=__doc__.split("\n")[0])
    ap.add_argument("--rehearse", action="store_true", help="this machine's rehearsal: no carry set to install")
    args = ap.parse_args(argv)
    found = installed()
    carry_needed = importlib.util.find_spec("ray") is None
    line = refusal(found, device=not args.rehearse, carry_needed=carry_needed)
    if line:
        print(line, flush=True)
        return 2
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
