#!/usr/bin/env bash
# A short bench_step under Nsight Systems, with the library's NVTX ranges
# (domain "dflash_cupy"); see profiling/README.md "Reading the timeline".
#
#   profiling/nsys_step.sh [--dry-run] [OUT_PREFIX] [-- extra bench_step args]
#
# Writes OUT_PREFIX.nsys-rep (open it in the Nsight Systems GUI),
# OUT_PREFIX.json (the bench's own numbers) and OUT_PREFIX.stats.txt (NVTX,
# kernel and CUDA API summaries). Default OUT_PREFIX: profiling/results/nsys_step.
# Default bench: the Qwen3.5-27B drafter at window 4K, graph and eager, a few
# steps (the timeline, not the statistics, is the point).
# --dry-run: print the nsys command and run the bench alone, tiny shapes on
# the emulated backend (checks everything but nsys on a CPU machine).
#
# Environment: NSYS (path to nsys; default: nsys on PATH, then the usual
# install locations), PYTHON (default python3).
# NVTX ranges need the Python package "nvtx" (pip install nvtx); without it the
# ranges are no-ops and the timeline shows CUDA API calls and kernels only.
set -euo pipefail

DRY=0
if [[ ${1:-} == --dry-run ]]; then
    DRY=1
    shift
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=profiling/results/nsys_step
if [[ $# -gt 0 && $1 != -- ]]; then
    OUT=$1
    shift
fi
[[ ${1:-} == -- ]] && shift
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$(dirname "$OUT")"

BENCH=("$PY" -m profiling.bench_step --drafters qwen3.5-27b --windows 4K --modes graph,eager
       --warmup 3 --repeats 3 --inner 5 --no-plot --out "$OUT.json")
if ((DRY)); then
    BENCH=("$PY" -m profiling.bench_step --smoke --backend emulated --windows 32 --modes graph,eager
           --warmup 2 --repeats 1 --inner 1 --no-plot --out "$OUT.json")
fi
BENCH+=("$@")

if ! "$PY" -c "import nvtx" 2>/dev/null; then
    echo "WARNING: the Python package 'nvtx' is missing: the dflash_cupy NVTX ranges will not appear" >&2
fi

find_nsys() {
    if [[ -n ${NSYS:-} ]]; then echo "$NSYS"; return; fi
    command -v nsys 2>/dev/null && return
    local c
    for c in /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys \
             /usr/local/cuda/nsight-systems-*/bin/nsys /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys; do
        [[ -x $c ]] && { echo "$c"; return; }
    done
    echo ""
}
NSYS_BIN=$(find_nsys)
NSYS_CMD=("${NSYS_BIN:-nsys}" profile --trace=cuda,nvtx,osrt --sample=none --cpuctxsw=none
          --force-overwrite=true -o "$OUT")

if ((DRY)); then
    echo "dry run: would run: ${NSYS_CMD[*]} ${BENCH[*]}"
    echo "dry run: nsys is ${NSYS_BIN:-not found}"
    DFLASH_CUPY_BACKEND=emulated "${BENCH[@]}"
    exit 0
fi

[[ -n $NSYS_BIN && -x $NSYS_BIN ]] || { echo "nsys not found: set NSYS=/path/to/nsys" >&2; exit 2; }
echo "running: ${NSYS_CMD[*]} ${BENCH[*]}"
"${NSYS_CMD[@]}" "${BENCH[@]}"
# report names changed across nsys versions: new names first, then the old ones
if ! "$NSYS_BIN" stats --force-export=true --report nvtx_sum,cuda_gpu_kern_sum,cuda_api_sum \
        "$OUT.nsys-rep" >"$OUT.stats.txt" 2>&1; then
    "$NSYS_BIN" stats --report nvtxsum,gpukernsum,cudaapisum "$OUT.nsys-rep" >"$OUT.stats.txt" 2>&1 || true
fi
echo "wrote $OUT.nsys-rep, $OUT.json, $OUT.stats.txt"
