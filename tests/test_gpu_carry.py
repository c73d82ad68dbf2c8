"""bench/gpu_carry.py's logic, with bench/wheels.py's and bench/carry_set.py's, on small fake
wheels made here: markers and the Requires-Dist closure, repacking (RECORD, modes, LZMA members)
with pip installing the result, the set's checks and the size limit. No network, no Python 3.12
needed."""

from __future__ import annotations

import csv
import email.parser
import hashlib
import io
import os
import sys
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path

import pytest

from bench import carry_set as cs
from bench import gpu_carry as gc
from bench import wheels as wh

WHEEL = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-manylinux_2_28_x86_64\n"


def metadata(name: str, version: str, *requires: str, python: str = ">=3.9"):
    text = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Python: {python}\n"
    text += "".join(f"Requires-Dist: {r}\n" for r in requires)
    return email.parser.Parser().parsestr(text, headersonly=True)


def make_wheel(folder: Path, name: str, version: str, files: dict, *requires: str, tag="py3-none-any") -> Path:
    """A wheel with `files` ({path: bytes, or (bytes, mode)}), its METADATA, WHEEL and a RECORD."""
    dist = f"{name.replace('-', '_')}-{version}.dist-info/"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    members = dict(files)
    members[dist + "METADATA"] = (meta + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode()
    members[dist + "WHEEL"] = WHEEL.replace("py3-none-manylinux_2_28_x86_64", tag).encode()
    path = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    rows = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for member, value in members.items():
            data, mode = value if isinstance(value, tuple) else (value, 0o644)
            info = zipfile.ZipInfo(member, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | mode) << 16
            zf.writestr(info, data)
            digest = urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{member},sha256={digest},{len(data)}")
        zf.writestr(dist + "RECORD", "\n".join([*rows, f"{dist}RECORD,,"]) + "\n")
    return path


def record_of(path: Path) -> dict[str, tuple[str, str]]:
    with zipfile.ZipFile(path) as zf:
        text = zf.read(wh.dist_info_dir(zf) + "RECORD").decode()
    return {row[0]: (row[1], row[2]) for row in csv.reader(io.StringIO(text))}


def test_markers_are_evaluated_for_the_device_and_the_extras_asked_for():
    meta = metadata(
        "x",
        "1",
        "a>=1",
        'b; extra == "data"',
        'c; python_version < "3.11"',
        'd; sys_platform == "win32"',
        'e; python_version >= "3.12" and extra == "train"',
        "f; platform_system == 'Linux' and platform_machine == 'x86_64'",
        'g; python_version >= "3.13"',
    )
    names = lambda extras: sorted(r.name for r in wh.requires(meta, frozenset(extras)))  # noqa: E731
    assert names(()) == ["a", "f"]
    assert names({"data"}) == ["a", "b", "f"]
    assert names({"data", "train"}) == ["a", "b", "e", "f"]


def test_the_closure_follows_carried_metadata_and_stops_at_device_packages():
    def fake(*top_requires):
        return {
            "top": ("1.0", metadata("top", "1.0", *top_requires)),
            "mid": ("2.1", metadata("mid", "2.1", "pkg-from-x; extra == 'x'")),
            "pkg-from-x": ("0.1", metadata("pkg-from-x", "0.1")),
        }

    plain = fake("mid>=2", "numpy", 'extra-only; extra == "dev"', 'mid[x]; extra == "x"')
    needed, problems = wh.walk(["top"], plain, {"numpy"})
    assert problems == []
    assert needed == {"top": ["the project"], "mid": ["top"], "numpy": ["top"]}  # not pkg-from-x: no extra x
    # mid reached without its extra, then with it (in either order): the extra's needs are followed
    for order in (("mid>=2", 'mid[x]; extra == "x"'), ('mid[x]; extra == "x"', "mid>=2")):
        needed, problems = wh.walk(["top[x]"], fake(*order), set())
        assert problems == [] and needed["pkg-from-x"] == ["mid"], order
    _, problems = wh.walk(["top[dev]"], plain, {"numpy"})
    assert len(problems) == 1 and "extra-only" in problems[0] and "neither carried nor on the device" in problems[0]
    _, problems = wh.walk(["top"], plain, set())
    assert problems == ["numpy (needed by top: numpy) is neither carried nor on the device"]


def test_the_closure_checks_carried_versions_and_requires_python():
    carried = {
        "top": ("1.0", metadata("top", "1.0", "mid>=2")),
        "mid": ("1.5", metadata("mid", "1.5", python=">=3.13")),
    }
    _, problems = wh.walk(["top==1.0"], carried, set())
    assert any("mid 1.5 is carried, but top needs mid>=2" in p for p in problems)
    assert any("mid 1.5 requires Python >=3.13" in p for p in problems)


def test_the_project_roots_leave_ray_default_out_and_keep_the_gpu_extra():
    Requirement, _, _ = wh._packaging()
    roots = {wh.normalize(r.name): r for r in map(Requirement, wh.project_roots())}
    assert roots["ray"].extras == {"data", "train"}
    assert roots["nvidia-nvimgcodec-cu13"].extras == {"nvjpeg"}
    assert {"kornia", "simplejpeg", "torch", "numpy"} <= set(roots)


def test_carried_pins_are_exact_and_meet_the_project_ranges():
    Requirement, _, Version = wh._packaging()
    roots = {wh.normalize(r.name): r for r in map(Requirement, wh.project_roots())}
    for c in cs.CARRY:
        assert str(Version(c.version)) == c.version, c  # one release, written as pip writes it
        if wh.normalize(c.name) in roots:
            assert roots[wh.normalize(c.name)].specifier.contains(c.version), c
    assert len({wh.normalize(c.name) for c in cs.CARRY}) == len(cs.CARRY)


def test_device_packages_list_the_device_and_none_of_the_carried():
    device = wh.device_packages()
    assert {"torch", "torchvision", "numpy", "pyarrow", "pandas", "packaging", "typing-extensions"} <= device
    assert "ray" not in device and "opencv-python-headless" in device  # normalised names
    # only typing-extensions travels although the device has it: a newer one shadows its own (bench/gpu_carry.py)
    assert device & {wh.normalize(c.name) for c in cs.CARRY} == {"typing-extensions"}


def test_trims_spare_what_ray_and_the_jpeg_decoders_run_on():
    def removed(name, path):
        return wh._trim_of(path, cs.TRIMS[name]) is not None

    for path in (
        "ray/core/src/ray/raylet/raylet",
        "ray/core/src/ray/gcs/gcs_server",
        "ray/_raylet.so",
        "ray/dashboard/dashboard.py",
        "ray/_private/runtime_env/agent/main.py",
        "ray/data/dataset.py",
        "ray/train/v2/api/data_parallel_trainer.py",
    ):
        assert not removed("ray", path), path
    assert removed("ray", "ray/jars/ray_dist.jar") and removed("ray", "ray/dashboard/client/build/index.html")
    nv = "nvidia/nvimgcodec/"
    for path in (
        nv + "nvimgcodec_impl.cpython-312-x86_64-linux-gnu.so",
        nv + "libnvimgcodec.so.0",
        nv + "extensions/libnvjpeg_ext.so.0.9.0",
        nv + "extensions/libjpeg_turbo_ext.so.0.9.0",
        nv + "__init__.py",
    ):
        assert not removed("nvidia-nvimgcodec-cu13", path), path
    for path in (nv + "nvimgcodec_impl.cpython-311-x86_64-linux-gnu.so", nv + "extensions/libopencv_ext.so.0.9.0"):
        assert removed("nvidia-nvimgcodec-cu13", path), path


def test_repack_drops_a_folder_rewrites_record_and_pip_installs_it(tmp_path):
    big = os.urandom(1024) * 64  # compressible, over the test's LZMA threshold
    files = {
        "pkg/__init__.py": b"VALUE = 1\n",
        "pkg/tool": (b"#!/bin/sh\necho hi\n", 0o755),
        "pkg/big.bin": big,
        "pkg/jars/a.jar": b"a" * 100,
        "pkg/jars/sub/b.jar": b"b" * 100,
        "pkg/mod.cpython-311-x86_64-linux-gnu.so": b"311",
        "pkg/mod.cpython-312-x86_64-linux-gnu.so": b"312",
    }
    src = make_wheel(tmp_path, "pkg", "1.0", files, tag="py3-none-manylinux_2_28_x86_64")
    trims = (
        cs.Trim("pkg/jars/*", "unused"),
        cs.Trim("pkg/mod.cpython-*.so", "one Python", keep="pkg/mod.cpython-312-*.so"),
    )
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"  # the tag pip here installs (cp312 on the device)
    path, removed = wh.repack(src, out_dir, trims, retag=f"{here}-{here}", lzma_min=4096)
    assert path.name == f"pkg-1.0-{here}-{here}-manylinux_2_28_x86_64.whl"
    assert [(r["files"], r["bytes"]) for r in removed] == [(2, 200), (1, 3)]
    record = record_of(path)
    assert not [p for p in record if p.startswith("pkg/jars") or "311" in p]
    with zipfile.ZipFile(path) as zf:
        for name, (digest, size) in record.items():
            if digest:  # each row matches its member
                data = zf.read(name)
                assert digest == "sha256=" + urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert int(size) == len(data)
        assert set(record) == {n for n in zf.namelist() if not n.endswith("/")}
        assert len(zf.namelist()) == len(set(zf.namelist()))  # one RECORD: the old one is not copied
        assert zf.getinfo("pkg/big.bin").compress_type == zipfile.ZIP_LZMA
        assert zf.getinfo("pkg/__init__.py").compress_type == zipfile.ZIP_DEFLATED
        assert f"Tag: {here}-{here}-manylinux_2_28_x86_64" in zf.read("pkg-1.0.dist-info/WHEEL").decode()
    assert gc.install(sys.executable, [path], tmp_path / "site") == ("ok", "")  # the device's pip command
    site = tmp_path / "site"
    assert not (site / "pkg" / "jars").exists() and not (site / "pkg/mod.cpython-311-x86_64-linux-gnu.so").exists()
    assert (site / "pkg" / "big.bin").read_bytes() == big
    assert os.stat(site / "pkg" / "tool").st_mode & 0o111  # executables stay executable
    assert (site / "pkg-1.0.dist-info" / "RECORD").exists()


def test_a_trim_that_matches_nothing_is_an_error(tmp_path):
    src = make_wheel(tmp_path, "pkg", "1.0", {"pkg/__init__.py": b""})
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="match nothing"):
        wh.repack(src, tmp_path / "out", (cs.Trim("pkg/gone/*", "moved upstream"),))
    assert list((tmp_path / "out").iterdir()) == []


def test_tags_the_device_installs():
    ok = [
        "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl",
        "kornia-0.9.0-py3-none-any.whl",
        "protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl",
        "x-1-py2.py3-none-any.whl",
        "n-1-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    ]
    bad = [
        "ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl",
        "ray-2.60.0-cp312-cp312-manylinux2014_aarch64.whl",
        "ray-2.60.0-cp312-cp312-macosx_11_0_arm64.whl",
        "x-1-cp313-abi3-manylinux2014_x86_64.whl",
    ]
    assert [wh.tag_problem(n) for n in ok] == [None] * len(ok)
    assert all(wh.tag_problem(n) for n in bad)


def test_check_set_names_missing_needs_two_versions_bad_tags_and_the_size(tmp_path):
    make_wheel(tmp_path, "top", "1.0", {"top/__init__.py": b""}, "mid>=2", "numpy")
    make_wheel(tmp_path, "mid", "2.0", {"mid/__init__.py": b""})
    device = {"numpy"}
    assert gc.check_set(tmp_path, device, ["top"]) == []
    assert gc.check_set(tmp_path, set(), ["top"]) == [
        "numpy (needed by top: numpy) is neither carried nor on the device"
    ]
    make_wheel(tmp_path, "extra", "1.0", {"extra/__init__.py": b""}, tag="cp311-cp311-manylinux2014_x86_64")
    make_wheel(tmp_path, "mid", "2.1", {"mid/__init__.py": b""})
    problems = gc.check_set(tmp_path, device, ["top"], tree=100, limit=gc.folder_bytes(tmp_path) + 100)
    assert any(p.startswith("extra-1.0-cp311") and "do not install" in p for p in problems)
    assert any(p.startswith("mid: 2 versions (2.0, 2.1)") for p in problems)
    assert "extra is carried but nothing needs it" in problems
    assert any("over the" in p for p in problems)


def test_the_size_limit():
    assert gc.size_problem(cs.LIMIT_BYTES - 1) is None
    assert "56.00 MiB" in gc.size_problem(cs.LIMIT_BYTES)
    assert gc.size_problem(100, limit=50) is not None


def test_tree_bytes_counts_tracked_files_and_skips_the_carried_folder():
    if not (cs.REPO / ".git").exists():
        pytest.skip("not a git checkout")
    tracked, _ = gc.tree_bytes(cs.REPO)
    assert tracked >= (cs.REPO / "pyproject.toml").stat().st_size
    assert gc.tree_bytes(cs.REPO, skip=cs.REPO / "bench")[0] < tracked


def test_run_code_says_ok_failed_or_skipped(tmp_path):
    assert gc.run_code(sys.executable, "pass", [tmp_path], tmp_path) == ("ok", "")
    status, detail = gc.run_code(sys.executable, "import no_such_module_here", [tmp_path], tmp_path)
    assert status == "skipped" and "no_such_module_here" in detail
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "__init__.py").write_text("import no_such_inner_module\n")
    status, detail = gc.run_code(sys.executable, "import broken", [tmp_path], tmp_path)
    assert status == "skipped"  # broken is here; what it lacks is not (a device package)
    assert gc.run_code(sys.executable, "raise SystemExit('boom')", [tmp_path], tmp_path) == ("failed", "boom")


def test_install_says_what_pip_refused(tmp_path):
    other = "cp39" if sys.version_info[:2] != (3, 9) else "cp38"
    wheel = make_wheel(tmp_path, "pkg", "1.0", {"pkg/__init__.py": b""}, tag=f"{other}-{other}-manylinux_2_28_x86_64")
    status, detail = gc.install(sys.executable, [wheel], tmp_path / "site")
    assert status == "failed" and "is not a supported wheel on this platform" in detail


def test_the_closure_collects_version_needs_on_device_packages():
    carried = {"top": ("1.0", metadata("top", "1.0", "numpy>=1.21", "attrs", 'typing-extensions>=4.16; extra == "t"'))}
    specs: dict = {}
    wh.walk(["top[t]", "numpy<3"], carried, {"numpy", "attrs", "typing-extensions"}, device_specs=specs)
    assert specs == {"numpy": {">=1.21 (top)", "<3 (the project)"}, "typing-extensions": {">=4.16 (top)"}}


def test_the_carried_libnvjpeg_is_of_the_device_drivers_cuda_line():
    """The device's driver is CUDA 13.0's (580): a libnvjpeg of a later CUDA may not load there, and
    nvImageCodec then falls back to other decoders without a word (engine_share 0)."""
    (nvjpeg,) = [c for c in cs.CARRY if c.name == "nvidia-nvjpeg"]
    assert nvjpeg.version.startswith("13.0."), nvjpeg


def test_an_import_check_that_passed_is_not_repeated_for_the_same_bytes(tmp_path):
    gpu_carry = gc
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"one")
    key = gpu_carry.imports_key(tmp_path, "/usr/bin/python3.12", None)
    assert key == gpu_carry.imports_key(tmp_path, "/usr/bin/python3.12", None)
    assert key != gpu_carry.imports_key(tmp_path, "/other/python3.12", None)
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"two")  # the same name, other bytes
    assert key != gpu_carry.imports_key(tmp_path, "/usr/bin/python3.12", None)
    assert gpu_carry.read_stamp(tmp_path / "none.json") == {}
