#!/usr/bin/env bash
# The GPU proof in one command (bench/gpu_kit.py has the steps and their caps, bench/kit_return.py what comes back).
#
#   bash bench/gpu.sh                     # a CUDA machine: install the carry set if Ray is missing, run the kit (<= 480 s)
#   bash bench/gpu.sh --smoke             # the same, its decisive first part only (<= 90 s): install, versions,
#                                         #   the fused kernel and nvImageCodec checked, a 20-step jobs.train
#   bash bench/gpu.sh --rehearse          # this machine: build or check the carry set, every step on the CPU
#   bash bench/gpu.sh --smoke --rehearse  # this machine: the carry set's quick check, the smoke on the CPU
#   OUT=DIR bash bench/gpu.sh             # where feed.json, kit.tar.gz, profile.txt and the traces go
#                                         #   (default: bench/results/<date>-gpu/)
#   KIT_PYTHON=PATH bash bench/gpu.sh ... # the Python to run it with (default: .venv/bin/python where it
#                                         #   exists, else python3; the rehearsal's: .venv/bin/python)
#
# The first line is bench/kit_versions.py's: the versions found, or the refusal of ones the kit is
# known not to work with (exit 2, nothing else run).
#
# On a bare GPU machine with no network (Python 3.12, torch, no Ray): carry .gpu-carry/ (or $CARRY) with
# the working tree (python -m bench.gpu_carry builds it here; docs/benchmarks.md, "The GPU kit", has the
# exact device call). The whole command, install included, keeps to the kit's budget.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
export CARRY=${CARRY:-.gpu-carry}
export PYTHONUNBUFFERED=1
REHEARSE=0
ARGS=()
for arg in "$@"; do
    if [ "$arg" = "--rehearse" ]; then REHEARSE=1; else ARGS+=("$arg"); fi
done
SMOKE=0
for arg in "${ARGS[@]}"; do [ "$arg" = "--smoke" ] && SMOKE=1; done

if [ "$REHEARSE" = 1 ]; then
    PY=${KIT_PYTHON:-.venv/bin/python}
    test -x "$PY" || make venv || exit 1
    "$PY" -m bench.kit_versions --rehearse || exit 2
    if [ ! -f "$CARRY/carry.json" ]; then
        "$PY" -m bench.gpu_carry --out "$CARRY" || exit 1
    fi
    QUICK=()
    [ "$SMOKE" = 1 ] && QUICK=(--quick)  # the smoke's budget has no room for the imports under Python 3.12
    "$PY" -m bench.gpu_carry --check "${QUICK[@]}" --out "$CARRY" || exit 1
    exec "$PY" -m bench.gpu_kit --rehearse --started "$START" "${ARGS[@]}"
fi

PY=python3
test -x .venv/bin/python && PY=.venv/bin/python
PY=${KIT_PYTHON:-$PY}
"$PY" -m bench.kit_versions || exit 2
if ! "$PY" -c "import ray" 2>/dev/null; then
    ls "$CARRY"/*.whl >/dev/null 2>&1 || { echo "error: no Ray here and no $CARRY/*.whl to install; build it with python -m bench.gpu_carry" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$CARRY"/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    echo "installed $(ls "$CARRY"/*.whl | wc -l) wheels from $CARRY in $(( $(date +%s) - START )) s"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec "$PY" -m bench.gpu_kit --started "$START" "${ARGS[@]}"
