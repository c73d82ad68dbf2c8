"""The wheels a bare GPU machine lacks, trimmed so that one device call can carry them (not a test).

    python -m bench.gpu_carry [--out .gpu-carry] [--cache ~/.cache/ray-gpu-augment/wheels]
    python -m bench.gpu_carry --check [--quick] [--out .gpu-carry] [--cache ~/.cache/ray-gpu-augment/wheels]
    python -m bench.gpu_carry --deflate-only --out /tmp/deflated   # no LZMA members: what deflate alone gives

then, first thing in the device's command (the call names `.gpu-carry` in `carry`):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .gpu-carry/*.whl && export PYTHONPATH=/tmp/site

The device (an H200 machine, /work/.library/device/KINDS.md) has Python 3.12.3 with torch,
numpy, pyarrow, pandas and the rest of bench/device_packages.txt, no network, and no Ray,
Kornia, simplejpeg or nvImageCodec. One call carries at most 64 MiB, the working tree
included; the issue keeps the set and the tree under LIMIT_BYTES.

The build downloads CARRY's exact pins into --cache (a second run needs no network), walks
the Requires-Dist closure of the project's needs (pyproject's dependencies and its `gpu`
extra, ray without its `default` extra) from the wheels' METADATA, repacks the wheels with
TRIMS removed (RECORD rewritten; members of at least LZMA_MIN_BYTES LZMA-compressed, which
pip reads through zipfile like deflate), writes them and OUT/carry.json, and prints each
wheel's size before and after, the tree's, and the sum against the limit: exit 1 if over, or
if the closure needs a package that is neither carried nor on the device. It also keeps, in
the cache and never in OUT, stand-ins for the device's packages the carried ones import
(numpy, pandas, pyarrow, ...): --check installs them beside the set so that Ray can start.

--check needs no network: wheel tags (cp312 or py3; manylinux x86_64 or any), one version per
distribution, the closure covered by the set and the device's list, the size, and, where a
Python 3.12 is found here, the device's pip command into a temporary --target and IMPORTS and
SMOKES under that Python, each said as ok, failed or skipped (a device package it needs is
not here). Exit 1 on a problem or a failed import. A set whose imports passed is stamped
(OUT/imports-ok.json: its wheels' hashes, the Python, the stand-ins): the same bytes are not
tried again (about a minute and a half on the 2-core machine); any change tries them. It also
lists the versions the carried wheels and the project need of device packages (carry.json's
device_needs): the device's list has names only, so only the device can check them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.carry_set import CARRY, DEFAULT_CACHE, DEVICE_PY, IMPORTS, INSTALL, LIMIT_BYTES, LZMA_MIN_BYTES, REPO, SMOKES
from bench.wheels import (
    carried_metadata,
    device_packages,
    fetch,
    fetch_stand_ins,
    normalize,
    parse_wheel_name,
    project_roots,
    read_metadata,
    sha256_of,
    tag_problem,
    trimmed,
    walk,
)

# -- sizes -------------------------------------------------------------------------------------


def tree_bytes(repo: Path = REPO, skip: Path | None = None) -> tuple[int, int]:
    """(tracked files, untracked files git does not ignore): what a device call sends beside the
    carried folder. Files under `skip` (the carried folder) are not counted here."""

    def listed(*args: str) -> list[Path]:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", *args], capture_output=True, check=True)
        return [repo / p for p in out.stdout.decode().split("\0") if p]

    def size(paths: list[Path]) -> int:
        inside = [p for p in paths if not (skip and p.resolve().is_relative_to(skip.resolve()))]
        return sum(os.lstat(p).st_size for p in inside if os.path.lexists(p))

    return size(listed()), size(listed("--others", "--exclude-standard"))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def size_problem(total: int, limit: int = LIMIT_BYTES) -> str | None:
    if total < limit:
        return None
    return f"the set and the tree are {mib(total)} MiB, over the {mib(limit)} MiB limit"


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


# -- the checks --------------------------------------------------------------------------------


def check_set(folder: Path, device: set[str], roots: list[str], tree: int = 0, limit: int = LIMIT_BYTES) -> list[str]:
    """Problems of the set in `folder` ([] when none): (a) a wheel's tags, (b) two versions of
    one distribution, (c) the closure of `roots` not covered by the set and `device`, or a
    carried wheel nothing needs, (d) the set (every file in the folder) plus `tree` bytes
    at or over `limit`."""
    wheels = sorted(folder.glob("*.whl"))
    problems = [p for p in map(tag_problem, (w.name for w in wheels)) if p]
    versions: dict[str, list[str]] = {}
    for w in wheels:
        parsed = parse_wheel_name(w.name)
        versions.setdefault(parsed.name, []).append(parsed.version)
    problems += [
        f"{n}: {len(v)} versions ({', '.join(v)}): pip stops at two" for n, v in versions.items() if len(v) > 1
    ]
    if not wheels:
        problems.append(f"no wheels in {folder}")
    carried = carried_metadata(folder)
    needed, closure = walk(roots, carried, device)
    problems += closure
    problems += [f"{n} is carried but nothing needs it" for n in carried if n not in needed]
    size = size_problem(folder_bytes(folder) + tree, limit)
    return problems + ([size] if size else [])


def python312() -> str | None:
    """A Python 3.12 on this machine (PATH, then pyenv's), as a path, or None."""
    candidates = [shutil.which("python3.12")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")), reverse=True)
    for c in filter(None, candidates):
        try:
            out = subprocess.run([c, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"], capture_output=True)
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip() == b"True":
            return c
    return None


def install(python: str, wheels: list[Path], target: Path) -> tuple[str, str]:
    """The device's pip command (--target, no index, no deps) under `python`: ('ok', '') or
    ('failed', pip's last line)."""
    cmd = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps"]
    cmd += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    errors = [line for line in out.stderr.splitlines() if line.startswith("ERROR")] or out.stderr.splitlines()[-1:]
    return ("ok", "") if out.returncode == 0 else ("failed", " ".join(errors))


def run_code(python: str, code: str, path: list[Path], cwd: Path, timeout: int = 300) -> tuple[str, str]:
    """('ok' | 'failed' | 'skipped', detail) of `code` under `python` with `path` alone on
    PYTHONPATH. Skipped: a module it imports is on none of `path` (a device package with no
    stand-in here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "RAY_"))}
    env.update(PYTHONPATH=os.pathsep.join(map(str, path)), PYTHONNOUSERSITE="1", PYNVIMGCODEC_VERBOSITY="0")
    try:
        out = subprocess.run([python, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "failed", f"no answer in {timeout} s"
    if out.returncode == 0:
        return "ok", ""
    last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    missing = re.search(r"No module named '([^'.]+)", last)
    if missing and not any(glob.glob(str(p / missing.group(1)) + "*") for p in path):
        return "skipped", f"needs {missing.group(1)}, a device package with no stand-in here"
    return "failed", last


def import_check(folder: Path, python: str, stand_ins: Path | None) -> list[tuple[str, str, str]]:
    """[(what, status, detail)]: the set installed with the device's command into a fresh
    --target, stand-ins for device packages into another, then IMPORTS and SMOKES."""
    with tempfile.TemporaryDirectory(prefix="gpu-carry-") as tmp:
        site, others = Path(tmp, "site"), Path(tmp, "stand-ins")
        results = [("the device's pip install of the set", *install(python, sorted(folder.glob("*.whl")), site))]
        if results[0][1] != "ok":
            return results
        path = [site]
        carried = {parse_wheel_name(w.name).name for w in folder.glob("*.whl")}
        extra = [
            w for w in sorted((stand_ins or Path(tmp)).glob("*.whl")) if parse_wheel_name(w.name).name not in carried
        ]
        if extra:
            results.append(("pip install of the stand-ins", *install(python, extra, others)))
            path.append(others)
        results += [(f"import {m}", *run_code(python, f"import {m}", path, Path(tmp))) for m in IMPORTS]
        results += [(what, *run_code(python, code, path, Path(tmp))) for what, code in SMOKES.items()]
    return results


# -- the command -------------------------------------------------------------------------------


def build(out: Path, cache: Path, lzma_min: int | None) -> int:
    """Download, walk the closure, trim, write OUT and its carry.json, print the table."""
    sources = fetch(CARRY, cache)
    carried = {n: (parse_wheel_name(p.name).version, read_metadata(p)) for n, p in sources.items()}
    device = device_packages()
    specs: dict[str, set[str]] = {}
    needed, problems = walk(project_roots(), carried, device, device_specs=specs)
    problems += [f"{n} is carried but nothing needs it" for n in carried if n not in needed]
    if problems:
        print("the closure is not covered:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.whl"), out / "carry.json"]:  # this command's own files only
        old.unlink(missing_ok=True)
    rows, entries = [], []
    why = {normalize(c.name): c.why for c in CARRY}
    for name, src in sources.items():
        path, removed = trimmed(src, cache, lzma_min)
        dest = out / path.name
        shutil.copyfile(path, dest)
        rows.append((path.name, carried[name][0], src.stat().st_size, dest.stat().st_size))
        entry = {"name": name, "version": carried[name][0], "file": path.name, "bytes": dest.stat().st_size}
        entry |= {"sha256": sha256_of(dest), "source_sha256": sha256_of(src), "why": why[name], "trimmed": removed}
        entries.append(entry)
    carry = {"python": DEVICE_PY, "limit_bytes": LIMIT_BYTES, "install": INSTALL.format(out=out.name)}
    carry["device_needs"] = {n: sorted(v) for n, v in sorted(specs.items())}  # versions to check there
    (out / "carry.json").write_text(json.dumps(carry | {"wheels": entries}, indent=2) + "\n")
    stand_ins = fetch_stand_ins(needed, carried, device, cache)
    print_table(rows, out)
    if stand_ins:
        print(f"stand-ins for --check's imports (never carried): {stand_ins}")
    return 0 if size_problem(folder_bytes(out) + sum(tree_bytes(REPO, out))) is None else 1


def print_table(rows: list[tuple[str, str, int, int]], out: Path) -> None:
    tracked, untracked = tree_bytes(REPO, out)
    width = max(len(r[0]) for r in rows)
    print(f"{'wheel':<{width}}  {'version':<12} {'before MiB':>10} {'after MiB':>10}")
    for file, version, before, after in rows:
        print(f"{file:<{width}}  {version:<12} {mib(before):>10} {mib(after):>10}")
    others = folder_bytes(out) - sum(r[3] for r in rows)
    total = folder_bytes(out) + tracked + untracked
    lines = [
        ("wheels", sum(r[2] for r in rows), sum(r[3] for r in rows)),
        ("carry.json and other files in " + out.name, None, others),
        ("tracked tree (git ls-files)", None, tracked),
        ("untracked, not ignored (travels too)", None, untracked),
        (f"sum, against the limit of {mib(LIMIT_BYTES)} MiB", None, total),
    ]
    for label, before, after in lines:
        print(f"{label:<{width + 14}} {'' if before is None else mib(before):>10} {mib(after):>10}")
    print("fits" if size_problem(total) is None else size_problem(total))
    inside = out.is_relative_to(REPO)
    if inside and subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(out / "carry.json")]).returncode:
        print(f"{out} is not ignored by git: add /{out.name}/ to .git/info/exclude, else it travels twice")


def check(out: Path, cache: Path, quick: bool = False) -> int:
    """--check: no network; problems and imports said, exit 1 on either (--quick: no imports)."""
    tracked, untracked = tree_bytes(REPO, out)
    problems = check_set(out, device_packages(), project_roots(), tracked + untracked)
    for w in sorted(out.glob("*.whl")):
        print(f"{w.name:<80} {mib(w.stat().st_size):>8} MiB")
    total = folder_bytes(out) + tracked + untracked
    print(
        f"{out.name} {mib(folder_bytes(out))} MiB + tree {mib(tracked + untracked)} MiB = {mib(total)} MiB "
        f"(limit {mib(LIMIT_BYTES)} MiB)"
    )
    print("problems:\n  " + "\n  ".join(problems) if problems else "problems: none")
    specs: dict[str, set[str]] = {}
    walk(project_roots(), carried_metadata(out), device_packages(), device_specs=specs)
    print("versions only the device can check (carry.json's device_needs):")
    for name, needs in sorted(specs.items()):
        print(f"  {name}: {', '.join(sorted(needs))}")
    python = None if quick else python312()
    if quick:
        print("--quick: imports not tried")
        return 1 if problems else 0
    if python is None:
        print("no Python 3.12 here: imports not tried")
        return 1 if problems else 0
    stand_ins = cache / "stand-ins" if (cache / "stand-ins" / "wanted.txt").exists() else None
    key, stamp = imports_key(out, python, stand_ins), out / IMPORTS_OK
    passed = read_stamp(stamp)
    if passed.get("key") == key:
        print(f"imports: these very wheels passed under {python} on {passed['date']} ({stamp.name}); not tried again")
        return 1 if problems else 0
    print(f"imports under {python}" + (f", with stand-ins from {stand_ins}" if stand_ins else ", no stand-ins"))
    results = import_check(out, python, stand_ins)
    for what, status, detail in results:
        print(f"  {status:<8} {what}" + (f": {detail}" if detail else ""))
    failed = any(s == "failed" for _, s, _ in results)
    if not failed:
        stamp.write_text(json.dumps({"key": key, "date": time.strftime("%Y-%m-%d %H:%M")}) + "\n")
    return 1 if problems or failed else 0


IMPORTS_OK = "imports-ok.json"  # the key of a set whose imports passed: --check does not try them again


def imports_key(folder: Path, python: str, stand_ins: Path | None) -> str:
    """What an import check's outcome depends on: every wheel's bytes, the Python, the stand-ins."""
    import hashlib

    parts = [f"{w.name}={sha256_of(w)}" for w in sorted(folder.glob("*.whl"))]
    parts += [python, *(sorted(p.name for p in stand_ins.glob("*.whl")) if stand_ins else [])]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def read_stamp(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-carry", help="the carried folder (default .gpu-carry)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="downloads and trimmed wheels")
    parser.add_argument("--check", action="store_true", help="check an existing set; no network")
    parser.add_argument("--quick", action="store_true", help="--check without the imports under Python 3.12")
    parser.add_argument("--deflate-only", action="store_true", help="no LZMA members (larger; for comparison)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if out == REPO or REPO.is_relative_to(out):
        parser.error("--out must be a folder of its own, not the repository or above it")
    if args.check:
        return check(out, args.cache.expanduser(), args.quick)
    return build(out, args.cache.expanduser(), None if args.deflate_only else LZMA_MIN_BYTES)


if __name__ == "__main__":
    sys.exit(main())
