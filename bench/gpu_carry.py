"""The wheels a bare GPU machine lacks, trimmed so that one device call can carry them (not a test).

    python -m bench.gpu_carry [--out .gpu-carry] [--cache ~/.cache/ray-gpu-augment/wheels]
    python -m bench.gpu_carry --check [--out .gpu-carry] [--cache ~/.cache/ray-gpu-augment/wheels]
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
not here). Exit 1 on a problem or a failed import. It also lists the versions the carried
wheels and the project need of device packages (carry.json's device_needs): the device's
list has names only, so only the device can check them.
"""

from __future__ import annotations

import argparse
import csv
import email.parser
import fnmatch
import glob
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
DEVICE_PACKAGES = Path(__file__).with_name("device_packages.txt")
DEFAULT_CACHE = Path("~/.cache/ray-gpu-augment/wheels").expanduser()
LIMIT_BYTES = 56 * 2**20  # the bound for the set plus the tree (a device call carries 64 MiB)
LZMA_MIN_BYTES = 2**20  # members this large (the native libraries) are LZMA-compressed: deflate alone does not fit
DEVICE_PY = "3.12"
INSTALL = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
    "--target /tmp/site {out}/*.whl && export PYTHONPATH=/tmp/site"
)


class Carried(NamedTuple):
    name: str
    version: str
    why: str


# What travels, exact pins (the venv's versions, so that device and CI run the same code).
CARRY = (
    Carried(
        "ray", "2.60.0", "the cluster, Ray Data and Ray Train (pyproject: ray[data,train]; [default] stays behind)"
    ),
    Carried("jsonschema", "4.26.0", "ray's core requirement"),
    Carried("jsonschema-specifications", "2025.9.1", "jsonschema's"),
    Carried("referencing", "0.37.0", "jsonschema's"),
    Carried("rpds-py", "2026.9.1", "jsonschema's and referencing's"),
    Carried("pydantic", "2.14.4", "ray[train]'s"),
    Carried("pydantic-core", "2.50.5", "pydantic's (pinned by it)"),
    Carried("annotated-types", "0.8.0", "pydantic's"),
    Carried("typing-inspection", "0.4.5", "pydantic's"),
    Carried(
        "typing-extensions",
        "4.16.0",
        "pydantic's needs >=4.16 and the device's list gives no versions: carried, it shadows an older one "
        "(later releases keep every earlier name, so the device's torch takes it too)",
    ),
    Carried("tensorboardx", "2.6.5", "ray[train]'s; training/plots.py writes event files with it"),
    Carried("kornia", "0.9.0", "the augment ops on the GPU (pyproject)"),
    Carried("kornia-rs", "0.2.0", "kornia's"),
    Carried("simplejpeg", "1.9.0", "JPEG decoding on CPUs (pyproject)"),
    Carried("nvidia-nvimgcodec-cu13", "0.9.0.20", "the GPU's JPEG decoder (pyproject's gpu extra)"),
    Carried("nvidia-nvjpeg", "13.3.2.43", "nvimgcodec[nvjpeg]'s: libnvjpeg.so.13 for its GPU backends"),
)

# Extras of the project's requirements that the device run leaves out, and why.
DROPPED_EXTRAS = {
    "ray": {
        "default": "the dashboard and job server: the job starts its own local cluster with include_dashboard=False"
    },
}


class Trim(NamedTuple):
    pattern: str  # fnmatch over the member's path ('*' crosses '/')
    why: str
    keep: str = ""  # members the pattern matches that stay


TRIMS = {
    "ray": (
        Trim("ray/jars/*", "Java workers' jar: the job runs Python workers only"),
        Trim(
            "ray/dashboard/client/build/*",
            "the dashboard's web page: the job starts Ray with include_dashboard=False, and without "
            "ray[default]'s packages the dashboard runs --minimal, which serves no page",
        ),
        Trim("ray/rllib/*", "RLlib: Ray Data, Train and Tune never import it (tune/registry.py tolerates its absence)"),
    ),
    "nvidia-nvimgcodec-cu13": (
        Trim(
            "nvidia/nvimgcodec/nvimgcodec_impl.cpython-*.so",
            "one extension module per CPython; the device's is 3.12",
            keep="nvidia/nvimgcodec/nvimgcodec_impl.cpython-312-*.so",
        ),
        Trim(
            "nvidia/nvimgcodec/extensions/libopencv_ext.so*",
            "OpenCV's CPU codecs: JPEGs decode through libnvjpeg_ext (GPU) and libjpeg_turbo_ext (CPU)",
        ),
        Trim(
            "nvidia/nvimgcodec/extensions/libnvjpeg2k_ext.so*",
            "JPEG 2000 on the GPU: needs nvidia-nvjpeg2k-cu13, not carried, so it could not load",
        ),
        Trim(
            "nvidia/nvimgcodec/extensions/libnvtiff_ext.so*",
            "TIFF on the GPU: needs nvidia-nvtiff-cu13, not carried, so it could not load",
        ),
        Trim(
            "nvidia/nvimgcodec/extensions/libtiff_ext.so*",
            "TIFF on CPUs: the job gives nvImageCodec JPEGs only (augment/engines.py)",
        ),
    ),
}
# A wheel whose trimmed form works on one CPython only says so in its tags.
RETAG = {"nvidia-nvimgcodec-cu13": "cp312-cp312"}

# Device packages never installed as stand-ins for --check's imports: large, and only
# kornia's import needs them (it is then reported as skipped).
NO_STAND_IN = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")

# The device's marker environment (PEP 508): Python 3.12.3 on x86-64 Linux.
DEVICE_ENV = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}

IMPORTS = (
    "ray",
    "ray.data",
    "ray.train",
    "jsonschema",
    "pydantic",
    "tensorboardX",
    "kornia",
    "kornia_rs",
    "simplejpeg",
    "nvidia.nvimgcodec",
)
SMOKES = {
    "nvImageCodec's CPU backend decodes a JPEG, whole and a region, as simplejpeg does": """
import numpy as np, simplejpeg
from nvidia import nvimgcodec as nv
y, x = np.mgrid[0:48, 0:64]
rgb = np.stack([x * 4, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)
data = simplejpeg.encode_jpeg(rgb, quality=95, colorsubsampling="444")
dec = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, backends=[nv.Backend(nv.CPU_ONLY)])
params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.SRGB, sample_format=nv.I_RGB)
region = nv.CodeStream(data).get_sub_code_stream(region=nv.Region(8, 16, 40, 48))
whole, part = dec.decode([nv.CodeStream(data), region], params=params)
ref = simplejpeg.decode_jpeg(data)
assert np.array_equal(np.asarray(whole), ref) and np.array_equal(np.asarray(part), ref[8:40, 16:48])
""",
    "nvImageCodec's nvjpeg extension finds the carried libnvjpeg.so.13 and registers its CUDA decoder": """
import os, tempfile
os.environ["PYNVIMGCODEC_VERBOSITY"] = "3"  # its log says which decoders registered (C code: fds 1 and 2)
log, saved = tempfile.TemporaryFile(), (os.dup(1), os.dup(2))
os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
from nvidia import nvimgcodec as nv
nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, backends=[nv.Backend(nv.CPU_ONLY)])
os.dup2(saved[0], 1), os.dup2(saved[1], 2)
log.seek(0)
text = log.read().decode(errors="replace")
errors = " | ".join(line for line in text.splitlines() if "ERROR" in line)
assert "nvJPEG version: 13" in text and "nvjpeg_cuda_decoder" in text, "not registered: " + errors[-300:]
""",
    "a local Ray cluster runs a Ray Data pipeline and a one-worker Ray Train run": """
import os
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
import ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
import ray.data
total = ray.data.range(1000).map_batches(lambda b: {"id": b["id"] * 2}).sum("id")
assert total == 999000, total
import ray.train
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
def loop(config):
    ray.train.report({"rank": ray.train.get_context().get_world_rank()})
run = ray.train.RunConfig(storage_path=os.path.abspath("train-runs"))
result = DataParallelTrainer(loop, scaling_config=ray.train.ScalingConfig(num_workers=1), run_config=run).fit()
assert result.error is None, result.error
ray.shutdown()
""",
}


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
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


def check(out: Path, cache: Path) -> int:
    """--check: no network; problems and imports said, exit 1 on either."""
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
    python = python312()
    if python is None:
        print("no Python 3.12 here: imports not tried")
        return 1 if problems else 0
    stand_ins = cache / "stand-ins" if (cache / "stand-ins" / "wanted.txt").exists() else None
    print(f"imports under {python}" + (f", with stand-ins from {stand_ins}" if stand_ins else ", no stand-ins"))
    results = import_check(out, python, stand_ins)
    for what, status, detail in results:
        print(f"  {status:<8} {what}" + (f": {detail}" if detail else ""))
    return 1 if problems or any(s == "failed" for _, s, _ in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-carry", help="the carried folder (default .gpu-carry)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="downloads and trimmed wheels")
    parser.add_argument("--check", action="store_true", help="check an existing set; no network")
    parser.add_argument("--deflate-only", action="store_true", help="no LZMA members (larger; for comparison)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if out == REPO or REPO.is_relative_to(out):
        parser.error("--out must be a folder of its own, not the repository or above it")
    if args.check:
        return check(out, args.cache.expanduser())
    return build(out, args.cache.expanduser(), None if args.deflate_only else LZMA_MIN_BYTES)


if __name__ == "__main__":
    sys.exit(main())
