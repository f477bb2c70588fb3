"""Facts of the product's compiled kernels (NVRTC, sm_90 / sm_90a, read by profiling/sass.py),
at the step's real launches: what the cost model's speed rests on, pinned so that a kernel
change that serialises its loads fails here, on the CPU.

* every weight-streaming GEMM the step launches (gemm_stream, gemm_wgmma; every preset's qkv,
  o, gate_up, down, fc and the LM head) keeps >= 24 KB of loads in flight per SM in its
  steady-state loop, at the step's occupancy (an H200 needs ~21 KB: HBM bandwidth x latency
  / SMs), and the attention's K/V tile loop likewise;
* no other phase of those launches (staging, split-K reduction, epilogue) has a dependent
  chain of more than 4 global loads per thread (loop trips from the emulator's counts).
"""
import math

import pytest

from profiling import sass_phases, static_facts
from profiling.common import drafter_config
from profiling.hw_params import get_gpu
from profiling.step_trace import Launch, node_label, trace_step

INFLIGHT_MIN_KB = 24.0
CHAIN_MAX = 4.0
STREAMING = ("gemm_stream", "gemm_wgmma", "ring_attn_mma_split")
CASES = [("h4096", 2048, None), ("h4096", 32768, None), ("h4096", 2048, 151936),
         ("qwen3.5-27b", 2048, None), ("qwen3.5-27b", 2048, 151936)]

_traces: dict = {}


def launches(drafter, window, vocab):
    key = (drafter, window, vocab)
    if key not in _traces:
        trace = trace_step(drafter_config(drafter), window, lm_head_vocab=vocab)
        seen, out = set(), []
        for n in trace.nodes:
            if isinstance(n, Launch) and n.kernel in STREAMING and n.variant() not in seen:
                seen.add(n.variant())
                out.append(n)
        _traces[key] = out
    return _traces[key]


def facts(n):
    gpu = get_gpu("H200")
    _, phases = sass_phases.launch_phases(n)
    info = static_facts.ptxas_info(n.file, n.defines)[n.kernel]
    occ = static_facts.occupancy(gpu, n.threads, info["registers"], info["smem"], n.shared_mem)
    resident = min(occ.blocks_per_sm, math.ceil(n.n_blocks / gpu.sm_count))
    st = sass_phases.stream_phase(phases)
    return phases, st, resident


@pytest.mark.slow
@pytest.mark.parametrize("drafter,window,vocab", CASES)
def test_streams_keep_enough_in_flight(drafter, window, vocab):
    bad = []
    for n in launches(drafter, window, vocab):
        phases, st, resident = facts(n)
        assert st is not None, f"{node_label(n)}: no streaming loop found"
        kb = st.peak_inflight_bytes * n.threads * resident / 1024
        if kb < INFLIGHT_MIN_KB:
            bad.append(f"{node_label(n)}: {kb:.1f} KB in flight per SM ({st.peak_inflight_bytes} B per thread x "
                       f"{n.threads} threads x {resident} blocks) in its loop at SASS {st.where} "
                       f"[{', '.join(st.lines[:3])}]")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("drafter,window,vocab", CASES)
def test_no_long_dependent_chains(drafter, window, vocab):
    bad = []
    for n in launches(drafter, window, vocab):
        phases, st, _ = facts(n)
        for p in phases:
            # (a loop with inner loops: each run of its own code between them, as straight
            # code is cut where loops sit)
            if p is st or p.longest_chain() <= CHAIN_MAX:
                continue
            bad.append(f"{node_label(n)}: {p.kind} at SASS {p.where}: {p.longest_chain():.1f} dependent round trips "
                       f"({p.trips:.1f} trips x {p.round_trips}, {p.trips_from}) [{', '.join(p.lines[:3])}]")
    assert not bad, "\n".join(bad)


def test_folded_norm_staging_keeps_a_whole_chunk_in_flight():
    """gemm_stream with the RMSNorm folded in and an f32 x (the step's gate_up): cp.async copies
    each x chunk and its gammas raw into shared memory, every copy of a chunk in flight at once,
    a chunk ahead of its conversion. So even one slice over the whole K (h4096: 6 chunks of 768)
    has no phase besides the weight stream with a dependent chain of more than 2 global loads.
    The kernel before (a warp per row, 2 (x, ln) pairs per lane in registers, a round trip each)
    had 8.5 per copy of its staging loop here (two copies)."""
    import dataclasses

    from dflash_cupy.ops import gemm_stream as gs

    n = next(n for n in launches("h4096", 2048, None) if node_label(n) == "gemm_stream[gate_up]")
    assert n.defines.get("GS_NORM") == 1 and not n.defines.get("GS_X16")
    K = n.defines["GS_K"]
    p = gs.plan(n.arg("N"), K, n.arg("M"), 2, n.defines["GS_SPLIT"], mt=n.defines["GS_MT"], ks=1, raw=True)
    assert (p.ks, p.kz) == (1, K) and -(-K // p.kt) >= 4
    one = dataclasses.replace(n.with_args(kz=p.kz, kt=p.kt), grid=p.grid, shared_mem=p.smem)
    phases, st, _ = facts(one)
    chains = sorted((p.chain, p.where, p.lines[:2]) for p in phases if p is not st)
    assert chains and chains[-1][0] <= 2.0, chains[-3:]


def test_kernel_projection_reducing_block_one_round_trip_a_phase():
    """DFlash 2's kernel_projection (gemm_stream's GS_CONV, 128-column blocks) at hidden 5120:
    after the weight stream its reducing block's phases (the rows' sums of squares of the
    folded norm, the split-K reduction of 12 slices, the prepare convolution) are one dependent
    L2 round trip each in the busiest warp: the 12 slices' loads at once (2 items a thread) and
    the convolution's 16 rows in two parts of one batch pair (every thread a chunk). With 256
    columns the reduction took 2 and the convolution's 128 busy threads 2 each."""
    n = next(n for n in launches("dflash2-h5120", 2048, None) if node_label(n).startswith("gemm_stream[conv_"))
    assert n.defines["GS_NT"] == 2 and n.grid[2] == 12, (n.defines, n.grid)
    phases, st, _ = facts(n)
    tail = [p for p in phases if p is not st and p.kind == "loop" and p.round_trips
            and any(l.startswith(("gemm_splitk.cuh", "gemm_conv.cuh")) for l in p.lines)]
    assert len(tail) >= 2, [(p.where, p.lines) for p in phases]
    for p in tail:   # (1.25: the x window's row before a part reads as a tenth of a trip more)
        assert p.chain <= 1.25, (p.where, p.lines[:3], p.trips, p.warp_trips, p.round_trips)
