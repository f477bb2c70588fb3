"""The SASS reader (profiling/sass.py) on kernels whose compiled answer is known by hand,
and the facts of the product's compiled kernels that the cost model's speed rests on.

The probes (tests/cuda/sass_probe.cu) are built with NVRTC exactly as the product's kernels
(sm_90, the backends' flags) and read through nvdisasm; each also runs on the emulator
against NumPy, so what they compute is what their comments say.
"""
from pathlib import Path

import numpy as np
import pytest

from profiling import sass

PROBE = Path(__file__).resolve().parent / "cuda" / "sass_probe.cu"


@pytest.fixture(scope="module")
def probes():
    try:
        text = sass.sass_of_source(PROBE.read_text(), str(PROBE), ())
    except sass.SassUnavailable as e:   # the test extras install nvdisasm; say so, never pass silently
        pytest.fail(f"the SASS reader cannot run here: {e}")
    return sass.analyse_text(text)


def only_loop(k: sass.KernelSass) -> sass.Loop:
    assert len(k.loops) == 1, sass.describe(k)
    return k.loops[0]


def test_control_words_decoded(probes):
    """Every wait names a scoreboard that an earlier variable-latency instruction set, and the
    first use of a global load's destination waits on the load's scoreboard."""
    for k in probes.values():
        set_so_far = set()
        for ins in k.instrs:
            for sb in range(6):
                if ins.wait >> sb & 1:
                    assert sb in set_so_far or any(i.wbar == sb or i.rbar == sb for i in k.instrs
                                                   if i.addr > ins.addr), (k.name, hex(ins.addr))
            if ins.wbar < 6:
                set_so_far.add(ins.wbar)
            if ins.rbar < 6:
                set_so_far.add(ins.rbar)
    chain = probes["probe_chain8"].instrs
    loads = [i for i in chain if sass.is_global_load(i)]
    for a, b in zip(loads, loads[1:]):
        between = [i for i in chain if a.addr < i.addr <= b.addr]
        assert any(i.wait >> a.wbar & 1 for i in between), "the next address waits for the last load"


def test_eight_independent_loads_in_flight(probes):
    """Eight 16-byte loads, then eight stores: all eight in flight at once, one round trip."""
    l = only_loop(probes["probe_independent8_store"])
    assert (l.global_loads, l.wide_loads, l.global_bytes) == (8, 8, 128)
    assert l.peak_inflight_loads == 8 and l.peak_inflight_bytes == 128
    assert l.round_trips == 1
    assert l.trips is None   # bounded by a run-time n


def test_eight_loads_summed_as_compiled(probes):
    """The same eight loads summed: ptxas starts the sum before the last loads issue, so the
    reader sees fewer in flight and a second round trip (what the code does, not the source)."""
    l = only_loop(probes["probe_independent8"])
    assert l.global_loads == 8
    assert 8 * 16 > l.peak_inflight_bytes >= 3 * 16
    assert l.round_trips == 2


def test_dependent_chain(probes):
    """A pointer chase: each address is the previous load's value, eight round trips."""
    k = probes["probe_chain8"]
    assert k.loops == []
    assert k.straight.global_loads == 8
    assert k.straight.round_trips == 8
    assert k.straight.peak_inflight_loads == 1


def test_reduction_one_quad_against_separate_registers(probes):
    """z-ordered sums of 8 partials: into one register quad inside a rolled loop (8 trips, one
    round trip each: a chain of 8) against 8 separate registers (all issued together)."""
    one = only_loop(probes["probe_reduce_one_quad"])
    assert one.trips == 8
    assert one.round_trips == 1 and one.peak_inflight_loads == 1
    assert one.trips * one.round_trips == 8
    sep = probes["probe_reduce_separate"]
    assert sep.loops == []
    assert sep.straight.global_loads == 8
    assert sep.straight.round_trips <= 2 < one.trips * one.round_trips
    assert sep.straight.peak_inflight_bytes >= 4 * 16


def test_probes_compute_what_they_say(emu, rng):
    mod = emu.compile(PROBE.read_text(), [], filename=str(PROBE))
    n, threads = 8 * 64, 64
    x = rng.standard_normal((n, 4)).astype(np.float32)
    y = np.zeros_like(x)
    mod.get_function("probe_independent8_store")((1,), (threads,), (x, y, np.int32(n)))
    emu.synchronize()
    assert np.array_equal(y, x)
    y[:] = 0
    mod.get_function("probe_independent8")((1,), (threads,), (x, y, np.int32(n)))
    emu.synchronize()
    ref = x.reshape(8, threads, 4).astype(np.float64).sum(0)
    np.testing.assert_allclose(y[:threads], ref, rtol=1e-5, atol=1e-5)
    nxt = rng.permutation(32).astype(np.int32)
    out = np.zeros(32, np.int32)
    mod.get_function("probe_chain8")((1,), (32,), (nxt, out))
    emu.synchronize()
    p = np.arange(32)
    for _ in range(8):
        p = nxt[p]
    assert np.array_equal(out, p)
    ws = rng.standard_normal((8, 32, 4)).astype(np.float32)
    for name in ("probe_reduce_one_quad", "probe_reduce_separate"):
        y = np.zeros((32, 4), np.float32)
        mod.get_function(name)((1,), (32,), (ws, y, np.int32(32)))
        emu.synchronize()
        ref = np.zeros((32, 4), np.float32)
        for z in range(8):   # z order, rounding as the kernel does
            ref = (ref + ws[z]).astype(np.float32)
        assert np.array_equal(y, ref), name


def test_loops_nest(probes):
    """Loop bodies nest: an inner loop's addresses are inside its outer loop's, or two loops
    share none."""
    for k in probes.values():
        for a in k.loops:
            for b in k.loops:
                assert a is b or a.addrs < b.addrs or b.addrs < a.addrs or not (a.addrs & b.addrs)


def test_phases_refuse_counts_that_name_no_line_of_the_kernel(probes):
    """The emulator's counted sites must name the kernel's own source lines: counts that all
    resolved elsewhere (an emulator header) would leave every run-time loop at one trip."""
    from profiling import sass_phases

    k = next(k for k in probes.values() if any(l.trips is None for l in k.loops))
    lines = {sass_phases._witness(i) for i in k.instrs if sass_phases._witness(i)}
    assert lines, sass.describe(k)
    ok = sass_phases.phases_of(k, {key: 8.0 for key in lines})
    assert any(p.trips_from.startswith("emulator") for p in ok)
    with pytest.raises(ValueError, match="none of the emulator's counted sites"):
        sass_phases.phases_of(k, {"emu_language.h:158|global load": 64.0})
    assert sass_phases.phases_of(k, {})  # nothing counted at all: the loops keep their static trips


def test_one_warps_loop_costs_that_warps_instruction_stream():
    """The issue of a phase is its warps' instructions over the SM's four schedulers, but never
    less than its busiest warp's own stream at one instruction a clock: a walk that one warp of
    eight runs (15 rows, 1.875 a warp on average) costs 15 rows of that warp's code."""
    from profiling import sass_phases
    from profiling.hw_params import get_gpu

    gpu = get_gpu("H200")
    args = dict(gpu=gpu, threads=256, resident=1, per_sm_max=1, rounds=1, blocks=1, dram_bytes=0.0)
    even = sass_phases.Phase("loop", "0x0-0x10", trips=15.0, instructions=310, warp_trips=15.0)
    lone = sass_phases.Phase("loop", "0x0-0x10", trips=15.0 / 8, instructions=310, warp_trips=15.0)
    unknown = sass_phases.Phase("loop", "0x0-0x10", trips=15.0 / 8, instructions=310)
    t_even = sass_phases.compiled_time([even], **args).phases_s
    t_lone = sass_phases.compiled_time([lone], **args).phases_s
    t_unknown = sass_phases.compiled_time([unknown], **args).phases_s
    assert t_even == pytest.approx(310 * 15 * 8 / sass_phases.ISSUE_PER_CLK_SM / gpu.clock_hz)
    assert t_lone == pytest.approx(310 * 15 / gpu.clock_hz)                  # the one warp's stream
    assert t_unknown == pytest.approx(310 * 15 / 8 * 8 / sass_phases.ISSUE_PER_CLK_SM / gpu.clock_hz)
    assert t_unknown < t_lone < t_even


def test_a_loops_chain_is_its_busiest_warps(probes):
    """A loop's trips (its issue) are the average warp's, but its dependent chain is one warp's:
    where the busiest warp runs the loop twice as often as the average (half the warps skip
    it, e.g. a tail whose chunks fill half the block), the chain is that warp's trips x the
    loop's round trips."""
    from profiling import sass_phases

    k = next(k for k in probes.values() if any(l.trips is None and l.round_trips for l in k.loops))
    loop = next(l for l in k.loops if l.trips is None and l.round_trips)
    keys = [sass_phases._witness(i) for i in k.instrs if i.addr in loop.addrs and sass_phases._witness(i)
            and sass_phases._witness(i).endswith("global load")]
    assert keys, sass.describe(k)
    lines = {sass_phases._witness(i) for i in k.instrs if sass_phases._witness(i)}
    counts = {key: 8.0 for key in lines}

    def phase(ex):
        return next(p for p in sass_phases.phases_of(k, ex) if p.where == f"{loop.head:#06x}-{loop.tail:#06x}")

    even = phase(counts)
    lone = phase({**counts, **{key + "|warp": 16.0 for key in keys}})
    assert lone.trips == even.trips > 0
    assert lone.warp_trips == pytest.approx(2 * even.trips)
    assert even.chain == pytest.approx(even.trips * loop.round_trips)
    assert lone.chain == pytest.approx(2 * even.trips * loop.round_trips)


def test_the_stream_is_the_weight_loop_not_a_reduction_of_partials():
    """The stream phase is the loop of evict-first loads (gemm_stream's weights) even where a
    reducing block's ld.cg partial reads (or its other loads) move more bytes; L2-coherent loads
    alone are never the stream."""
    from profiling import sass_phases

    P = sass_phases.Phase
    weights = P("loop", "w", trips=1.5, global_loads=2, global_bytes=32, evict_first_bytes=32)
    partials = P("loop", "p", trips=4.0, global_loads=32, global_bytes=512, coherent_bytes=512)
    tail = P("loop", "t", trips=2.2, global_loads=8, global_bytes=128)
    assert sass_phases.stream_phase([partials, tail, weights]) is weights
    assert sass_phases.stream_phase([partials, tail]) is tail
    assert sass_phases.stream_phase([partials]) is None


def test_phase_cache_names_the_launchs_known_device_values(tmp_path, monkeypatch):
    """The phases' disk cache is keyed by what decides a loop's trips: the variant, the launch
    shape and the device values the plan knows (``known``: which row tiles are live). A count
    made with every tile dead must not be reused for a launch whose tiles are live."""
    from profiling import sass_phases
    from profiling.step_trace import Launch

    monkeypatch.setattr(sass_phases.nvrtc_info, "cache_root", lambda: tmp_path / "nvrtc")
    base = dict(kernel="gather_features", file="step_plan.cu", defines={"FC_IN": 19}, grid=(1, 3, 1),
                block=(256, 1, 1), shared_mem=0, args=[])
    dead, live, again = (Launch(**base, known=k) for k in ({"tile_live": (0,)}, {"tile_live": (1,)},
                                                            {"tile_live": (1,)}))
    assert sass_phases._cache_path(dead) != sass_phases._cache_path(live)
    assert sass_phases._cache_path(live) == sass_phases._cache_path(again)
    assert sass_phases._cache_path(Launch(**base)) not in (sass_phases._cache_path(dead),
                                                           sass_phases._cache_path(live))
