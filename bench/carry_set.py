"""What the carry set is (bench/gpu_carry.py builds and checks it): the wheels that travel to a
bare GPU machine, each pinned with why (CARRY), the extras left out, what is trimmed from each
wheel (TRIMS) and retagged, the device's Python and environment, the packages that stay the
device's, the imports and smoke tests a --check runs, and the size a device call allows.
"""

from __future__ import annotations

import re
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
    Carried("tensorboardx", "2.6.5", "ray[train]'s; training/driver/plots.py writes event files with it"),
    Carried("kornia", "0.9.0", "the augment ops on the GPU (pyproject)"),
    Carried("kornia-rs", "0.2.0", "kornia's"),
    Carried("simplejpeg", "1.9.0", "JPEG decoding on CPUs (pyproject)"),
    Carried("nvidia-nvimgcodec-cu13", "0.9.0.20", "the GPU's JPEG decoder (pyproject's gpu extra)"),
    Carried(
        "nvidia-nvjpeg",
        "13.0.4.44",
        "nvimgcodec[nvjpeg]'s: libnvjpeg.so.13 for its GPU backends; the 13.0 line, the device's driver's "
        "(580, CUDA 13.0): a build of a later CUDA may not load there, and nvImageCodec then falls back silently",
    ),
)

# Extras of the project's requirements that the device run leaves out, and why.
DROPPED_EXTRAS = {
    "ray": {
        "default": "the dashboard and job server: the job starts its own local cluster with include_dashboard=False"
    },
}


# The project's requirements that the device run leaves out whole, and why.
DROPPED_REQUIREMENTS = {
    "boto3": "training/driver/lease.py's lease on an s3:// run folder (imported there when one is named); "
    "the kit's runs write to a local folder. boto3 and botocore would add 14 MiB to a set near its limit",
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
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never another's cluster
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
