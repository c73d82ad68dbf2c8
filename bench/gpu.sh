#!/usr/bin/env bash
# The GPU half of the benchmarks, one script, about 7 minutes on one H200 (16 cores): the
# augment stage against the seed's pipelines on the device, decode + augment from JPEG
# bytes, then end-to-end ResNet18 at 224 px in bf16 (jobs.train vs the seed's plain script
# vs synthetic batches on the device).
#
#   bash bench/gpu.sh [OUT]        # OUT (default bench-gpu/) gets the JSON and the logs
#   PY=/path/to/python bash bench/gpu.sh
#
# Needs a venv whose torch sees CUDA (torch==2.14.1 + torchvision==0.29.1 built for the
# node's CUDA, then `pip install -e .`). Targets (the issues): stage >= 100,000 img/s for
# imagenet and >= 500,000 img/s for cifar; decode (nvjpeg) + augment at 224 px >= 20,000
# img/s; input-bound ratio (jobs.train / synthetic) >= 0.95.
# Not yet run: no GPU machine was available when it was written.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-bench-gpu}
PHOTOS=${PHOTOS:-/tmp/bench-photos}
mkdir -p "$OUT"
"$PY" -c 'import torch; assert torch.cuda.is_available(), "torch does not see a GPU"; print(torch.__version__, torch.cuda.get_device_name(0))'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt" || true

# 1. augment stage vs the seed's pipelines, batches of 1024 and 4096 (~2 min; at most 210 s)
timeout 210 "$PY" -m bench.pipelines --device cuda --batch-sizes 1024 4096 --json "$OUT/pipelines-cuda.json" | tee "$OUT/pipelines-cuda.txt"

# 1b. decode + augment from encoded JPEGs at 224 px: one batched nvjpeg call per batch (~1 min; at most 150 s)
timeout 150 "$PY" -m bench.decode --device cuda --batch-sizes 256 1024 --json "$OUT/decode-cuda.json" | tee "$OUT/decode-cuda.txt"

# 2. a photo tree for the imagenet preset: 12,000 JPEGs of 300x400 .. 427x640 (~30 s)
test -f "$PHOTOS/.done" || { timeout 90 "$PY" -m bench.train --make-photos "$PHOTOS" --photos 12000 && touch "$PHOTOS/.done"; }

# 3. end to end, bf16, global batch 256, 4 epochs (steady state = epochs 2-4) (~3 min)
timeout 300 "$PY" -m bench.train --data "$PHOTOS" --train-images 0 --preset imagenet --device cuda --amp bf16 \
    --batch-size 256 --epochs 4 --synthetic-steps 100 --variants plain job synthetic --work "$OUT/train" --json "$OUT/train-cuda.json" \
    ${JOB_ARGS:+--job-args $JOB_ARGS} | tee "$OUT/train-cuda.txt"
