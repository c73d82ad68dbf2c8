#!/usr/bin/env bash
# The GPU checks and benchmarks, one script for one H200 (16 cores): 4 min 37 s in its last
# run (before the gpu_path step); its steps' time limits add up to 11 min 15 s (photos 45 s, train
# 240, decode 120, gpu_path 90, tests 180):
# end-to-end ResNet18 at 224 px in bf16 (jobs.train vs the seed's plain script vs synthetic
# batches on the device), decode (nvjpeg) + augment from JPEG bytes, the gpu-marked tests,
# and with PIPELINES=1 the augment stage against the seed's pipelines on the device.
#
#   bash bench/gpu.sh [OUT]        # OUT (default bench-gpu/) gets logs and JSON
#   PY=/path/to/python bash bench/gpu.sh
#
# Needs a Python whose torch sees CUDA, with this project's dependencies importable. Every
# step has its own time limit and the script goes on after a failed step, so one run
# returns whatever could be measured. Targets (docs/benchmark-log.md, "GPU"): stage >= 100,000
# img/s for imagenet and >= 500,000 img/s for cifar; decode (nvjpeg) + augment at 224 px >=
# 20,000 img/s; input-bound ratio (jobs.train / synthetic) >= 0.95.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-bench-gpu}
PHOTOS=${PHOTOS:-/tmp/bench-photos}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
step() { echo "=== $* ($(date +%T))"; }

{
    step environment
    "$PY" -c 'import torch, torchvision, ray, kornia; print("torch", torch.__version__, "torchvision", torchvision.__version__,
"ray", ray.__version__, "kornia", kornia.__version__); print(torch.cuda.get_device_name(0))'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. a photo tree for the imagenet preset: JPEGs of 300x400 .. 427x640 (at most 45 s)
step photos
test -f "$PHOTOS/.done" || { timeout 45 "$PY" -m bench.train --make-photos "$PHOTOS" --photos 6000 && touch "$PHOTOS/.done"; }

# 2. end to end, bf16, global batch 256, 3 epochs (steady state = epochs 2-3) (at most 240 s);
# the runs' logs (jobs.train's plan line, Ray Data's warnings) go to $OUT/train-work, and the job's
# timings.csv and summary.json there say what bounded it and how many of its planned CPUs the
# trainer kept busy (trainer_cpus against trainer_cpus_planned): the GPU node's plan, measured
step train
timeout 240 "$PY" -m bench.train --data "$PHOTOS" --train-images 0 --preset imagenet --device cuda --amp bf16 \
    --batch-size 256 --epochs 3 --synthetic-steps 60 --variants plain job synthetic --json "$OUT/train-cuda.json" \
    --work "$OUT/train-work" 2>&1 | tee "$OUT/train-cuda.txt"

# 3. decode + augment from encoded JPEGs at 224 px: one batched call per batch of the job's GPU
# decoder (nvImageCodec where installed, else nvjpeg), each batched decoder's call alone (nvImageCodec
# on crop regions and on whole images, nvjpeg), and 4 processes at once as the job's augment tasks
# share a GPU (at most 120 s)
step decode
timeout 120 "$PY" -m bench.decode --device cuda --batch-sizes 256 1024 --processes 4 --seconds 3 \
    --json "$OUT/decode-cuda.json" 2>&1 | tee "$OUT/decode-cuda.txt"

# 3b. the GPU path without a canvas (augment/ragged.py) against the canvas before it, side by
# side, with each batched decoder: operations dispatched per batch and img/s, batches of 256 and
# 1,024 (at most 90 s)
step gpu_path
DECODERS=$("$PY" -c 'from augment import engines; print("nvimgcodec nvimgcodec-whole nvjpeg" if engines.available() else "nvjpeg")')
timeout 90 "$PY" -m bench.gpu_path --batch-sizes 256 1024 --seconds 2 --paths ragged canvas --decoders $DECODERS \
    --json "$OUT/gpu-path-cuda.json" 2>&1 | tee "$OUT/gpu-path-cuda.txt"

# 4. correctness on CUDA, the decoder's stream ordering included (at most 180 s)
step tests
timeout 180 "$PY" -m pytest -m gpu -rs -q -p no:cacheprovider tests/test_gpu.py tests/test_decode.py 2>&1 | tee "$OUT/tests.txt"

# 5. the augment stage alone against the seed's pipelines (at most 80 s; only with PIPELINES=1)
if [ "${PIPELINES:-0}" = 1 ]; then
    step pipelines
    timeout 80 "$PY" -m bench.pipelines --device cuda --batch-sizes 1024 4096 --repeat 1 \
        --json "$OUT/pipelines-cuda.json" 2>&1 | tee "$OUT/pipelines-cuda.txt"
fi
step done
