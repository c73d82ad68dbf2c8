"""Wheels as files, for bench/gpu_carry.py: their names, tags and METADATA; the Requires-Dist
closure of the project's needs over the carried wheels and the device's packages; repacking a
wheel with members trimmed, retagged or LZMA-compressed (RECORD rewritten); and the downloads
of the pins and of the stand-ins for the device's packages. What travels is bench/carry_set.py's.
"""

from __future__ import annotations

import csv
import email.parser
import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path
from typing import NamedTuple

from bench.carry_set import (
    DEVICE_ENV,
    DEVICE_PACKAGES,
    DEVICE_PY,
    DROPPED_EXTRAS,
    LZMA_MIN_BYTES,
    NO_STAND_IN,
    REPO,
    RETAG,
    TRIMS,
    Trim,
)

# -- names, tags, metadata ---------------------------------------------------------------------


def normalize(name: str) -> str:
    """PEP 503's normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


class WheelName(NamedTuple):
    name: str  # normalised
    version: str
    python: str
    abi: str
    platform: str


def parse_wheel_name(filename: str) -> WheelName:
    parts = os.path.basename(filename)[: -len(".whl")].split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        raise ValueError(f"not a wheel's file name: {filename}")
    return WheelName(normalize(parts[0]), parts[1], *parts[-3:])


def tag_problem(filename: str) -> str | None:
    """Why the device's pip would refuse this wheel, or None: CPython 3.12 (cp312, an abi3 of
    3.12 or before, or py3) on x86-64 manylinux (or any platform)."""
    w = parse_wheel_name(filename)
    pythons, abis, platforms = (set(t.split(".")) for t in (w.python, w.abi, w.platform))
    py_ok = "cp312" in pythons or "py3" in pythons or (abis == {"abi3"} and any(_cp_le_312(p) for p in pythons))
    abi_ok = bool(abis & {"cp312", "abi3", "none"})
    plat_ok = platforms == {"any"} or any(re.fullmatch(r"manylinux(1|2010|2014|_2_\d+)_x86_64", p) for p in platforms)
    if py_ok and abi_ok and plat_ok:
        return None
    return f"{os.path.basename(filename)}: tags {w.python}-{w.abi}-{w.platform} do not install on CPython 3.12 x86-64"


def _cp_le_312(tag: str) -> bool:
    m = re.fullmatch(r"cp3(\d+)", tag)
    return bool(m) and int(m.group(1)) <= 12


def dist_info_dir(zf: zipfile.ZipFile) -> str:
    """The wheel's own .dist-info/ (at the root: ray vendors others deeper down)."""
    found = {n.split("/")[0] + "/" for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)}
    if len(found) != 1:
        raise ValueError(f"{zf.filename}: {len(found)} .dist-info folders at the root")
    return found.pop()


def read_metadata(path: str | Path):
    """The wheel's METADATA as an email.message.Message."""
    with zipfile.ZipFile(path) as zf:
        text = zf.read(dist_info_dir(zf) + "METADATA").decode("utf-8")
    return email.parser.Parser().parsestr(text, headersonly=True)


# -- the Requires-Dist closure -----------------------------------------------------------------


def _packaging():
    """packaging (ray requires it, so the venv has it); imported only when needed, so that this
    module imports with the standard library alone."""
    try:
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError as e:  # pragma: no cover - the venv has it
        raise SystemExit(f"bench.gpu_carry needs `packaging` for markers and versions: {e}") from e
    return Requirement, SpecifierSet, Version


def requires(metadata, extras: frozenset[str] = frozenset(), env: dict | None = None) -> list:
    """The metadata's Requires-Dist that apply on the device, asked for with `extras`: a marker
    holds for the device's environment with no extra or with one of `extras`."""
    Requirement, _, _ = _packaging()
    env = env or DEVICE_ENV
    out = []
    for line in metadata.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("", *sorted(extras))):
            out.append(req)
    return out


def walk(
    roots: list[str], carried: dict, device: set[str], env: dict | None = None, device_specs: dict | None = None
) -> tuple[dict, list[str]]:
    """The closure of `roots` (requirement strings) over `carried` ({name: (version, METADATA)})
    and `device` (names, taken as they are: their metadata is not here). Returns ({name: the
    names that need it}, problems): a need met by neither, a carried version outside a
    specifier, a carried wheel whose Requires-Python excludes the device's. `device_specs`, if
    given, gets {device package: {"specifier (who)"}}: versions only the device can check."""
    Requirement, SpecifierSet, Version = _packaging()
    needed: dict[str, set[str]] = {}
    done: dict[str, set[str]] = {}
    problems: list[str] = []
    todo = [("the project", Requirement(r)) for r in roots]
    while todo:
        who, req = todo.pop()
        name = normalize(req.name)
        needed.setdefault(name, set()).add(who)
        if name not in carried:
            if name not in device:
                problems.append(f"{name} (needed by {who}: {req}) is neither carried nor on the device")
            elif req.specifier and device_specs is not None:
                device_specs.setdefault(name, set()).add(f"{req.specifier} ({who})")
            continue
        version, meta = carried[name]
        if not req.specifier.contains(Version(version), prereleases=True):
            problems.append(f"{name} {version} is carried, but {who} needs {req}")
        extras = {normalize(e) for e in req.extras}
        if name in done and extras <= done[name]:
            continue
        if name not in done and not SpecifierSet(meta.get("Requires-Python") or "").contains(env_python(env)):
            problems.append(f"{name} {version} requires Python {meta.get('Requires-Python')}")
        done[name] = done.get(name, set()) | extras
        todo += [(name, r) for r in requires(meta, frozenset(done[name]), env)]
    return {n: sorted(w) for n, w in needed.items()}, problems


def env_python(env: dict | None) -> str:
    return (env or DEVICE_ENV)["python_full_version"]


def project_roots(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The project's needs on the device: its dependencies and its `gpu` extra, less DROPPED_EXTRAS."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip's copy of the same parser
        from pip._vendor import tomli as tomllib

    Requirement, _, _ = _packaging()
    project = tomllib.loads(pyproject.read_text())["project"]
    out = []
    for line in [*project["dependencies"], *project["optional-dependencies"]["gpu"]]:
        req = Requirement(line)
        req.extras -= set(DROPPED_EXTRAS.get(normalize(req.name), {}))
        out.append(str(req))
    return out


def device_packages(path: Path = DEVICE_PACKAGES) -> set[str]:
    """bench/device_packages.txt: one name a line, '#' comments."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {normalize(line) for line in lines if line}


def carried_metadata(folder: Path) -> dict:
    """{name: (version, METADATA)} of the wheels in `folder`."""
    out = {}
    for path in sorted(folder.glob("*.whl")):
        w = parse_wheel_name(path.name)
        out[w.name] = (w.version, read_metadata(path))
    return out


# -- repacking ---------------------------------------------------------------------------------


def _record_row(path: str, data: bytes) -> list[str]:
    digest = urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [path, f"sha256={digest}", str(len(data))]


def _trim_of(path: str, trims) -> Trim | None:
    for t in trims:
        if fnmatch.fnmatchcase(path, t.pattern) and not (t.keep and fnmatch.fnmatchcase(path, t.keep)):
            return t
    return None


def _retagged(filename: str, tag: str) -> str:
    parts = filename[: -len(".whl")].split("-")
    return "-".join([*parts[:-3], *tag.split("-"), parts[-1]]) + ".whl"


def _retag_wheel_file(text: str, tag: str) -> str:
    """WHEEL's Tag lines with the python and abi parts replaced (one line per platform)."""
    lines, seen = [], set()
    for line in text.splitlines():
        if line.startswith("Tag: "):
            line = "Tag: " + tag + "-" + line[len("Tag: ") :].split("-", 2)[2]
            if line in seen:
                continue
            seen.add(line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def _write_member(zout: zipfile.ZipFile, info: zipfile.ZipInfo, data: bytes, lzma_min: int | None) -> None:
    """`data` as `info`'s member: its date and mode bits kept (raylet and gcs_server must stay
    executable), LZMA where large, else deflate at level 9."""
    new = zipfile.ZipInfo(info.filename, date_time=info.date_time)
    new.external_attr, new.create_system = info.external_attr, info.create_system
    if info.is_dir():
        new.compress_type = zipfile.ZIP_STORED
    elif lzma_min is not None and len(data) >= lzma_min:
        new.compress_type = zipfile.ZIP_LZMA
    else:
        new.compress_type = zipfile.ZIP_DEFLATED
    zout.writestr(new, data, compresslevel=9 if new.compress_type == zipfile.ZIP_DEFLATED else None)


def repack(src: Path, dest_dir: Path, trims=(), retag: str | None = None, lzma_min: int | None = LZMA_MIN_BYTES):
    """`src` rewritten into dest_dir without the members `trims` match, RECORD recomputed over
    what stays (signatures of the old RECORD dropped), optionally retagged. Returns (path,
    [{pattern, why, files, bytes}] per trim: bytes uncompressed). A trim matching nothing is
    an error: the wheel's layout is not the one the trim was written for."""
    dest = dest_dir / (_retagged(src.name, retag) if retag else src.name)
    removed = {t.pattern: {"pattern": t.pattern, "why": t.why, "files": 0, "bytes": 0} for t in trims}
    part = dest.with_name(dest.name + ".part")
    try:
        _rewrite(src, part, trims, removed, retag, lzma_min)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    unmatched = [p for p, r in removed.items() if r["files"] == 0]
    if unmatched:
        part.unlink()
        raise ValueError(f"{src.name}: trims match nothing: {unmatched}")
    part.replace(dest)
    return dest, list(removed.values())


def _rewrite(src: Path, dest: Path, trims, removed: dict, retag: str | None, lzma_min: int | None) -> None:
    """repack's work: members copied but the trimmed ones (counted into `removed`), then RECORD."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w") as zout:
        info_dir = dist_info_dir(zin)
        record = info_dir + "RECORD"
        rows = []
        for info in zin.infolist():
            trim = _trim_of(info.filename, trims)
            if trim:
                removed[trim.pattern]["files"] += not info.is_dir()
                removed[trim.pattern]["bytes"] += info.file_size
                continue
            if info.filename in (record, record + ".jws", record + ".p7s"):
                continue
            data = zin.read(info)
            if retag and info.filename == info_dir + "WHEEL":
                data = _retag_wheel_file(data.decode(), retag).encode()
            _write_member(zout, info, data, lzma_min)
            if not info.is_dir():
                rows.append(_record_row(info.filename, data))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*rows, [record, "", ""]])
        _write_member(zout, zin.getinfo(record), text.getvalue().encode(), lzma_min)


def needs_repack(path: Path, trims, lzma_min: int | None) -> bool:
    if trims or RETAG.get(parse_wheel_name(path.name).name):
        return True
    with zipfile.ZipFile(path) as zf:
        return lzma_min is not None and any(i.file_size >= lzma_min for i in zf.infolist())


# -- downloads (the build only) ----------------------------------------------------------------

PIP_PLATFORMS = (
    "manylinux1_x86_64",
    "manylinux2010_x86_64",
    "manylinux2014_x86_64",
    *(f"manylinux_2_{n}_x86_64" for n in range(5, 40)),  # pip matches N exactly; the device README says up to 39
)


def pip_download(requirements: list[str], dest: Path, deps: bool = False) -> None:
    """pip download of cp312 manylinux (or pure) wheels for the device into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--only-binary=:all:"]
    cmd += ["--python-version", DEVICE_PY, "--implementation", "cp", "-d", str(dest)]
    for p in PIP_PLATFORMS:
        cmd += ["--platform", p]
    done = subprocess.run([*cmd, *([] if deps else ["--no-deps"]), *requirements], capture_output=True, text=True)
    if done.returncode != 0:  # pip's output only then: it warns about this machine's extra indexes each time
        print(done.stdout + done.stderr, file=sys.stderr)
        done.check_returncode()


def cached_wheel(cache: Path, name: str, version: str) -> Path | None:
    _, _, Version = _packaging()
    for path in sorted(cache.glob("*.whl")):
        w = parse_wheel_name(path.name)
        if w.name == normalize(name) and Version(w.version) == Version(version) and not tag_problem(path.name):
            return path
    return None


def fetch(carry, cache: Path) -> dict[str, Path]:
    """{name: the original wheel in the cache}, downloading those not there yet."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [c for c in carry if not cached_wheel(cache, c.name, c.version)]
    if missing:
        print(f"downloading {len(missing)} wheels into {cache}", flush=True)
        pip_download([f"{c.name}=={c.version}" for c in missing], cache)
    found = {normalize(c.name): cached_wheel(cache, c.name, c.version) for c in carry}
    lost = [n for n, p in found.items() if p is None]
    if lost:
        raise SystemExit(f"pip gave no cp312 x86-64 wheel for {lost}")
    return found


def fetch_stand_ins(needed: dict, carried: dict, device: set[str], cache: Path) -> Path | None:
    """Wheels for the device's packages that carried ones require (`needed` from walk), and
    their requirements, in cache/stand-ins for --check's imports here; pinned to this venv's
    versions where it has them. None (said) where pip fails: the set is built anyway."""
    from importlib import metadata

    names = sorted(n for n, who in needed.items() if n in device and set(who) & set(carried))
    names = [n for n in names if not NO_STAND_IN.match(n)]
    pins = []
    for n in names:
        try:
            pins.append(f"{n}=={metadata.version(n)}")
        except metadata.PackageNotFoundError:
            pins.append(n)
    dest = cache / "stand-ins"
    stamp = dest / "wanted.txt"
    if stamp.exists() and stamp.read_text().split() == pins:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    try:
        pip_download(pins, dest, deps=True)
    except subprocess.CalledProcessError as e:
        print(f"no stand-ins for --check ({e}); its imports of Ray will be skipped", file=sys.stderr)
        return None
    stamp.write_text("\n".join(pins) + "\n")
    return dest


def trimmed(src: Path, cache: Path, lzma_min: int | None) -> tuple[Path, list]:
    """src repacked with its TRIMS (kept in cache/trimmed under a key of the source and the
    recipe, so that a second build takes seconds), or src itself where nothing would change."""
    name = parse_wheel_name(src.name).name
    trims, retag = TRIMS.get(name, ()), RETAG.get(name)
    if not needs_repack(src, trims, lzma_min):
        return src, []
    recipe = json.dumps([sha256_of(src), [list(t) for t in trims], retag, lzma_min, 1]).encode()
    where = cache / "trimmed" / hashlib.sha256(recipe).hexdigest()[:16]
    done = where / "trims.json"
    if done.exists():
        return where / json.loads(done.read_text())["file"], json.loads(done.read_text())["trimmed"]
    where.mkdir(parents=True, exist_ok=True)
    path, removed = repack(src, where, trims, retag, lzma_min)
    done.write_text(json.dumps({"file": path.name, "trimmed": removed}))
    return path, removed


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
