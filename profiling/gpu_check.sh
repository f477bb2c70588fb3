#!/usr/bin/env bash
# The one GPU measurement: self-check, tests + benchmarks, everything written to OUTDIR.
#
#   profiling/gpu_check.sh OUTDIR                    # on a machine with a GPU (about 8 minutes at most)
#   profiling/gpu_check.sh OUTDIR --quick            # 4 minutes at most: self-check, differential, one step
#                                                    # timing per drafter preset with per-kernel times
#   profiling/gpu_check.sh OUTDIR [--quick] --dry-run  # the same commands, tiny shapes, emulated backend (CPU)
#
# Runs from the checkout with PYTHONPATH=<repo root>; needs only python3 with
# numpy + cupy (+ pytest for the tests) and coreutils.
# Order = value: the device self-check first (python -m dflash_cupy selfcheck: every kernel
# variant against its NumPy reference and a drafter step per weight type against the oracle;
# its report goes into gpu_check.log and selfcheck.json before anything else runs, and the
# later steps' caches obey its verdict), then the test log, then the CPU/GPU differential (the kernel
# tests' emulated launches re-run on the GPU and compared, appended to tests.log
# with its per-kernel table), then the default drafter's step at a few
# windows, then the GEMM and attention kernels, then the full sweep (reusing
# the first step results), then the host-overhead check. Each step has its own
# timeout, shortened so that the whole script ends within GPU_CHECK_BUDGET_S
# (default 470 s, --quick 235 s on a GPU); a failed or timed-out step is reported and the next one
# still runs. A broken environment (no GPU, CuPy or NVRTC not working) stops
# the script at once (exit 2) before any long step. Every step writes its results into
# OUTDIR as it ends, so a run cut off at any point keeps what it measured (a kill is logged).
#
# OUTDIR receives at most 8 files (what one device call brings back):
#   gpu_check.log   this script's log: environment, nvidia-smi, the self-check's report, step
#                   status, summary (with the GEMM autotuning report: default vs chosen launch
#                   and each candidate's time)
#   selfcheck.json  the self-check's report for tools (every check, its worst error, the verdicts)
#   tests.log       pytest output (the GPU half of the suite, then the differential run)
#   bench.log       every benchmark's output (bench_lanes' table among them: its JSON stays outside OUTDIR;
#                   pdl_check's: the step with and without programmatic dependent launch)
#   step_quick.json bench_step, qwen3.5-27b, windows 256/4K/32K, graph/eager/legacy, and every node's
#                   own time (--kernel-times: profiling/kernel_times.py; nsys does not run there), which
#                   the summary and perf_model set beside the per-kernel predictions
#   gemm.json       bench_gemm (dflash GEMM and cuBLAS)
#   attention.json  bench_attention
#   step.json       bench_step, both drafters, all windows (plot it with profiling.bench_step.plot)
# The bench_host result is printed into gpu_check.log (its JSON is kept outside OUTDIR).
# --quick writes gpu_check.log, selfcheck.json, tests.log (the differential) and step_quick.json
# (both drafter presets at a 4K window, graph mode, every node's own time).
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S (default 470),
# GPU_CHECK_PYTEST_ARGS (default: --maxfail=25 -k "not emulated"; the emulated half of the
# suite is CI's job).
set -uo pipefail

usage() { echo "usage: $0 OUTDIR [--quick] [--dry-run]" >&2; exit 2; }
[[ $# -ge 1 && $1 != -* ]] || usage
OUTDIR=$1
shift
DRY=0
QUICK=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        --quick) QUICK=1 ;;
        *) usage ;;
    esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$OUTDIR" || { echo "gpu_check: cannot create $OUTDIR" >&2; exit 2; }
OUTDIR=$(cd "$OUTDIR" && pwd)
PY=${PYTHON:-python3}
# (a dry run keeps the full budget: its emulator builds are slower than any GPU step)
BUDGET=${GPU_CHECK_BUDGET_S:-$( ((QUICK && !DRY)) && echo 235 || echo 470)}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
# the caches built by the benchmarks tune their GEMM launches on the GPU (dflash_cupy/tuning.py):
# a fresh cache file, reported in the summary (every candidate's measured time)
export DFLASH_CUPY_TUNE_CACHE=$WORK/tuning.json
# the self-check's verdict (its first step) in a fresh file: every later step's caches obey it
export DFLASH_CUPY_SELFCHECK_CACHE=$WORK/selfcheck_verdicts.json
export DFLASH_CUPY_SELFCHECK=auto
LOG=$OUTDIR/gpu_check.log
BLOG=$OUTDIR/bench.log
: >"$LOG"
: >"$BLOG"
START=$SECONDS
FAILED=()

say() { printf '[gpu_check %4ds] %s\n' $((SECONDS - START)) "$*" | tee -a "$LOG"; }
die() { say "FATAL: $*"; say "stopping: the environment is not usable (nothing else was run)"; exit 2; }
CURRENT=preflight
# killed (a device call's limit, ^C): say so and keep everything written so far
trap 'say "INTERRUPTED during $CURRENT: the results of the steps before it are in $OUTDIR"; rm -rf "$WORK"; exit 130' TERM INT HUP

if ((DRY)); then
    export DFLASH_CUPY_BACKEND=emulated
    SMOKE=(--smoke)
    PYTEST_ARGS=(--collect-only -q -x -k "not emulated")
    DIFF_ARGS=(--collect-only -q -k emulated)
    # the runner's plumbing on one file: the tests step collects every file, and
    # tests/test_differential.py runs the runner itself on real tests
    DIFF_FILES=(tests/test_norm.py)
    HOST_BACKEND=emulated
    say "DRY RUN: emulated backend, tiny shapes (--smoke); pytest only collects"
    # the plumbing only: the emulated self-check in full is CI's (tests/test_selfcheck.py)
    SELFCHECK_ONLY=(--only plan,norm,rope,sample)
else
    unset DFLASH_CUPY_BACKEND
    SMOKE=()
    if [[ -n ${GPU_CHECK_PYTEST_ARGS:-} ]]; then
        read -r -a PYTEST_ARGS <<<"$GPU_CHECK_PYTEST_ARGS"
    else
        PYTEST_ARGS=(--maxfail=25 -k "not emulated")  # first contact: see many failures, not one
    fi
    DIFF_ARGS=(--maxfail=40 -k emulated)
    DIFF_FILES=(tests/test_norm.py tests/test_rope.py tests/test_plan.py tests/test_mma.py
                tests/test_gemm.py tests/test_attention.py)
    HOST_BACKEND=cuda
    SELFCHECK_ONLY=()
fi
((QUICK)) && say "QUICK: self-check, differential, one step timing per drafter preset (budget ${BUDGET}s)"

# ---------------------------------------------------------------- preflight (fail early)
command -v timeout >/dev/null || die "coreutils 'timeout' not found"
command -v "$PY" >/dev/null || die "python '$PY' not found (set PYTHON=...)"
say "repo $ROOT; python $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
say "outdir $OUTDIR; budget ${BUDGET}s"
if command -v nvidia-smi >/dev/null; then
    say "nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu,power.draw,pstate --format=csv,noheader 2>&1 | head -n 4)"
elif ((!DRY)); then
    say "WARNING: nvidia-smi not found"
fi

timeout -k 5 120 "$PY" - "$DRY" >>"$LOG" 2>&1 <<'EOF'
import sys, time
t0 = time.perf_counter()
dry = sys.argv[1] == "1"
import numpy as np
print("numpy", np.__version__)
from dflash_cupy import backends
if not dry:
    import cupy
    print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount())
    if not backends.gpu_available():
        sys.exit("CuPy sees no CUDA GPU")
be = backends.get()
want = "emulated" if dry else "cuda"
if be.name != want:
    sys.exit(f"backend is {be.name!r}, expected {want!r} (DFLASH_CUPY_BACKEND={__import__('os').environ.get('DFLASH_CUPY_BACKEND')})")
# one kernel end to end: NVRTC (or g++) compile, launch, read back, compare
from dflash_cupy.ops.norm import RmsNorm, rmsnorm_reference
from profiling import common, timer
x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
w = np.linspace(0.5, 1.5, 64).astype(np.float32)
xd, wd, yd = be.asarray(x), be.asarray(w), be.zeros((5, 64), np.float32)
RmsNorm(be, 64)(xd, wd, yd)
y = be.to_numpy(yd)
ref = rmsnorm_reference(x, w)
err = float(np.max(np.abs(y - ref)))
print(f"rmsnorm on {be.name}: max abs err {err:.2e}")
if not err < 1e-4:
    sys.exit(f"rmsnorm result wrong on {be.name} (max abs err {err})")
print("device:", common.device_info(be))
try:
    import matplotlib  # noqa: F401
    print("matplotlib", matplotlib.__version__)
except Exception as e:
    print("WARNING: matplotlib not importable, no plot:", e)
from dflash_cupy import nvtx_ranges
print("nvtx python package:", "yes" if nvtx_ranges.available() else "no (NVTX ranges are no-ops)")
print(f"preflight ok in {time.perf_counter() - t0:.1f} s")
EOF
rc=$?
tail -n 12 "$LOG"
((rc == 0)) || die "preflight failed (rc=$rc); see $LOG"

# ---------------------------------------------------------------- steps
# run_step NAME LIMIT_S LOGFILE CMD...
run_step() {
    local name=$1 limit=$2 logf=$3
    shift 3
    local left=$((BUDGET - (SECONDS - START) - 10))
    if ((left < 20)); then
        say "SKIP $name: ${left}s of the budget left"
        FAILED+=("$name(skipped)")
        return
    fi
    ((limit > left)) && limit=$left
    CURRENT=$name
    say "START $name (timeout ${limit}s): $*"
    printf '\n===== %s: %s\n' "$name" "$*" >>"$logf"
    local t0=$SECONDS before
    before=$(wc -l <"$logf")
    timeout -k 10 "$limit" "$@" >>"$logf" 2>&1
    local rc=$?
    tail -n +"$((before + 1))" "$logf" | tail -n 8
    if ((rc == 0)); then
        say "DONE $name in $((SECONDS - t0))s"
    else
        if ((rc == 124 || rc == 137)); then
            say "TIMEOUT $name after $((SECONDS - t0))s (limit ${limit}s)"
        else
            say "FAILED $name rc=$rc after $((SECONDS - t0))s (see $(basename "$logf"))"
        fi
        FAILED+=("$name")
    fi
}

# The self-check first: its report (the text into this log, the JSON into selfcheck.json) is the
# first thing a cut-off run keeps; a failed variant fails this step (exit 1 at the end) and the
# later steps' caches fall back as its verdict says.
# (limits: a dry run's cold g++ builds; --quick's 4 minutes: self-check 80 s, differential 80 s, step 60 s)
run_step selfcheck "$( ((DRY)) && echo 150 || { ((QUICK)) && echo 80 || echo 120; })" "$LOG" "$PY" -m dflash_cupy selfcheck \
    --out "$OUTDIR/selfcheck.json" ${SELFCHECK_ONLY[@]+"${SELFCHECK_ONLY[@]}"}

TLOG=$OUTDIR/tests.log
: >"$TLOG"
((QUICK)) || run_step tests 180 "$TLOG" "$PY" -m pytest -q -p no:cacheprovider tests "${PYTEST_ARGS[@]}"

# Kernel-level tests only (the drafter-level ones add emulator minutes, not kernels), one
# pytest per file in parallel: most of the time is the emulator's g++ builds (a cold cache on a
# fresh machine, ~140 modules). A mismatch beyond the kernel's tolerance fails its test; each
# file's table says which kernels differ at all.
run_step differential "$( ((QUICK && !DRY)) && echo 80 || echo 110)" "$TLOG" "$PY" -m profiling.run_differential \
    --timeout-s "$( ((QUICK && !DRY)) && echo 70 || echo 95)" \
    "${DIFF_FILES[@]}" -- "${DIFF_ARGS[@]}"

if ((QUICK)); then
    # one step timing per drafter preset (4K window, the graph replay) with every node's own time
    run_step step_quick "$( ((DRY)) && echo 200 || echo 60)" "$BLOG" "$PY" -m profiling.bench_step ${SMOKE[@]+"${SMOKE[@]}"} \
        --drafters "$( ((DRY)) && echo tiny || echo qwen3.5-27b,h4096)" \
        --windows "$( ((DRY)) && echo 32 || echo 4096)" --modes graph \
        --budget-s 2 --kernel-times "$( ((DRY)) && echo 2 || echo 3)" --no-plot --out "$OUTDIR/step_quick.json"
fi

# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over quick kernel tests, where the
# tool works on this machine's driver; its reports go to tests.log.
if ((QUICK)); then
    :
elif ((DRY)); then
    say "SKIP sanitizers: no GPU in a dry run"
elif command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck synccheck initcheck; do
        run_step "sanitizer_$tool" 30 "$TLOG" compute-sanitizer --tool "$tool" --error-exitcode 3 \
            "$PY" -m pytest -q -p no:cacheprovider tests/test_norm.py tests/test_plan.py tests/test_sample.py \
            -k "not emulated"
    done
else
    say "SKIP sanitizers: compute-sanitizer not on PATH"
fi

if ((!QUICK)); then
    run_step step_quick 90 "$BLOG" "$PY" -m profiling.bench_step ${SMOKE[@]+"${SMOKE[@]}"} \
        --drafters "$( ((DRY)) && echo tiny || echo qwen3.5-27b)" \
        --windows "$( ((DRY)) && echo 32 || echo 256,4K,32K)" \
        --budget-s 5 --kernel-times "$( ((DRY)) && echo 2 || echo 5)" --no-plot --out "$OUTDIR/step_quick.json"

    # PDL: the step graph captured with programmatic dependent launch (DraftKvCache(pdl=True)) must be
    # bit-identical to the plain one over several steps (a kernel touching dependent data before its
    # pdl_wait() would show here); their replay times calibrate hw_params.pdl_gap_s. Table in bench.log.
    run_step pdl 40 "$BLOG" "$PY" -m profiling.pdl_check ${SMOKE[@]+"${SMOKE[@]}"} \
        --windows "$( ((DRY)) && echo 32 || echo 2048,8192)" --repeats "$( ((DRY)) && echo 2 || echo 10)"

    # lanes: the batch step at 1/4/16 active lanes against the single-lane step, measured side by side
    # (issue 13's per-request cost), each row beside the cost model's prediction; the table is in bench.log
    # (the dry run's limit allows for its cold emulator builds: both roundings' kernels at 1 and 3 lanes)
    run_step lanes "$( ((DRY)) && echo 200 || echo 60)" "$BLOG" "$PY" -m profiling.bench_lanes ${SMOKE[@]+"${SMOKE[@]}"} \
        --lanes "$( ((DRY)) && echo 1,3 || echo 1,4,16)" --x-split both --budget-s 3 --out "$WORK/lanes.json"

    run_step gemm 50 "$BLOG" "$PY" -m profiling.bench_gemm ${SMOKE[@]+"${SMOKE[@]}"} --out "$OUTDIR/gemm.json"

    run_step attention 40 "$BLOG" "$PY" -m profiling.bench_attention ${SMOKE[@]+"${SMOKE[@]}"} --merges both \
        --out "$OUTDIR/attention.json"

    run_step step_full 100 "$BLOG" "$PY" -m profiling.bench_step ${SMOKE[@]+"${SMOKE[@]}"} --budget-s 4 \
        --kernel-times "$( ((DRY)) && echo 2 || echo 5)" --merge "$OUTDIR/step_quick.json" --out "$OUTDIR/step.json" --no-plot

    run_step host 45 "$BLOG" "$PY" -m profiling.bench_host ${SMOKE[@]+"${SMOKE[@]}"} --backend "$HOST_BACKEND" --json \
        --out "$WORK/host.json"

    # Soak last: as many random steps (accept, jump, rewind, reset, planted bad input) as the budget
    # leaves, up to 10^5, oracle-checked every 500; max error, allocations and memory in bench.log.
    run_step soak 150 "$BLOG" "$PY" -m profiling.soak \
        --steps "$( ((DRY)) && echo 30 || echo 100000)" --check-every "$( ((DRY)) && echo 10 || echo 500)" \
        --sample-every 1000 --max-seconds "$( ((DRY)) && echo 60 || echo 130)" --json "$WORK/soak.json"
fi

# ---------------------------------------------------------------- summary
CURRENT=summary
say "summary:"
"$PY" -c 'import sys; from dflash_cupy import tuning; print(tuning.report(sys.argv[1]))' "$WORK/tuning.json" 2>&1 | tee -a "$LOG"
HOST_ARGS=()
[[ -f $WORK/host.json ]] && HOST_ARGS=(--host "$WORK/host.json")
"$PY" -m profiling.summarize --dir "$OUTDIR" ${HOST_ARGS[@]+"${HOST_ARGS[@]}"} 2>&1 | tee -a "$LOG"
n_files=$(find "$OUTDIR" -maxdepth 1 -type f | wc -l)
say "files in $OUTDIR: $n_files ($(cd "$OUTDIR" && ls | tr '\n' ' '))"
rm -rf "$WORK"
if ((${#FAILED[@]})); then
    say "FINISHED with failures: ${FAILED[*]} (total $((SECONDS - START))s)"
    exit 1
fi
say "FINISHED ok (total $((SECONDS - START))s)"
