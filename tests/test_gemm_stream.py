"""The weight-streaming GEMM (cuda_src/gemm_stream.cu, planned by
dflash_cupy/ops/gemm_stream.py): every weight dtype, epilogue and compiled M
variant against gemm_reference with the "f32" tolerance, awkward M/N/K, split
K (uneven slices, bit-identical repeats, counters reset; with one M block or
several, with tile_live and the folded RMSNorm), and the figures of its launch
plans (profiling/gemm_figures.py), pinned at the qwen3-8b-like and hidden-5120
shapes."""
import ml_dtypes
import numpy as np
import pytest

from dflash_cupy.ops import gemm_stream as gs
from profiling import gemm_figures as gf
from dflash_cupy.ops.gemm import Gemm, gemm_reference
from tests.support.gemm import SENTINEL, counters_zero, host_weights, live_rows, run, tile_flags
from tests.support.tolerances import assert_close

# (name, N, K, weight matrices per output column): q;k;v, o, gate;up, down
QWEN3_8B = [("qkv", 4096 + 2 * 1024, 4096, 1), ("o", 4096, 4096, 1), ("gate_up", 12288, 4096, 2),
            ("down", 4096, 12288, 1)]
HIDDEN_5120 = [("qkv", 5120 + 2 * 1024, 5120, 1), ("o", 5120, 5120, 1), ("gate_up", 17408, 5120, 2),
               ("down", 5120, 17408, 1), ("gate_up", 25600, 5120, 2), ("down", 5120, 25600, 1)]


@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
@pytest.mark.parametrize("wkind", ["f16", "bf16"])
def test_dtypes_epilogues_every_variant(backend, rng, wkind, epilogue):
    # N=300: a partial last column group (and warps with no valid column);
    # K=520: a 64-wide step with only its first 8 elements inside K. m covers the
    # 16-, 32- and 64-row variants (m=33: a variant with a dead tile skipped) and
    # m=100: two 64-row tiles in grid y.
    used = set()
    for m in (1, 3, 19, 33, 64, 100):
        op = run(backend, rng, N=300, K=520, wkind=wkind, epilogue=epilogue, m=m, x_rows=103, path="stream",
                 wgmma=False)
        assert op.path == "stream" and op.x_round == wkind + "x2"
        used.add(op._stream.plan(m).mt)
    assert used == {1, 2, 4}


@pytest.mark.parametrize("wkind,epilogue,K", [("bf16", "none", 40), ("f16", "silu_mul", 8),
                                              ("bf16", "residual", 136)])
def test_short_k_and_tails(backend, rng, wkind, epilogue, K):
    # K shorter than one 64-wide step, and K = 2 steps + 8
    for m in (1, 17):
        run(backend, rng, N=37, K=K, wkind=wkind, epilogue=epilogue, m=m, x_rows=20, path="stream")


@pytest.mark.parametrize("wkind", ["f16", "bf16"])
def test_rounded_activations(backend, rng, wkind):
    for m in (2, 30):
        op = run(backend, rng, N=70, K=200, wkind=wkind, epilogue="silu_mul", m=m, path="stream",
                 x_split=False)
        assert op.x_round == wkind and op.split == 1


@pytest.mark.parametrize("k_split", [2, 3, 7])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_split_k(backend, rng, k_split, epilogue):
    # Uneven slices (K=840: 7 slices of 128 leave 72 for the last), N=260: a
    # partial column group; run twice (the counters reset themselves), in place for
    # residual; m beyond one tile (and beyond max_m) splits too: 2 M blocks.
    for m in (1, 19):
        for in_place in (False, True):
            op = run(backend, rng, N=260, K=840, wkind="bf16", epilogue=epilogue, m=m, max_m=32, x_rows=40,
                     path="stream", k_split=k_split, in_place=in_place and epilogue == "residual")
            assert op._stream.plan(m).ks == k_split
    counters_zero(backend, op)
    op = run(backend, rng, N=260, K=840, wkind="bf16", epilogue=epilogue, m=40, max_m=32, x_rows=40,
             path="stream", k_split=k_split)
    assert op._stream.plan(40).ks == k_split and op._stream.plan(40).mblocks == 2
    counters_zero(backend, op)


@pytest.mark.parametrize("epilogue", ["none", "silu_mul"])
def test_split_k_repeats_bit_for_bit(backend, rng, epilogue):
    N, K, m = 300, 2048, 16
    op = Gemm(backend, N, K, "bf16", epilogue=epilogue, max_m=16, path="stream", k_split=6)
    x = backend.asarray(rng.standard_normal((m, K)).astype(np.float32))
    w = backend.asarray(host_weights(rng, 2 * N if epilogue == "silu_mul" else N, K, "bf16"))
    outs = []
    for _ in range(3):
        y = backend.zeros((m, N), np.float32)
        op(x, w, y, m)
        outs.append(backend.to_numpy(y))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    assert not np.array_equal(outs[0], np.zeros_like(outs[0]))


@pytest.mark.parametrize("k_split", [None, 4])
def test_exact_small_integers(backend, rng, k_split):
    # Integer data: every partial sum is exact in f32, so a wrong row, column,
    # k permutation or dropped step is an exact mismatch.
    N, K = 300, 712
    op = Gemm(backend, N, K, "bf16", max_m=64, path="stream", k_split=k_split)
    for m in (9, 40):
        xh = rng.integers(-3, 4, (m, K)).astype(np.float32)
        wf = rng.integers(-3, 4, (N, K)).astype(np.float32)
        wh = wf.astype(ml_dtypes.bfloat16).view(np.uint16)
        y = backend.zeros((m, N), np.float32)
        op(backend.asarray(xh), backend.asarray(wh), y, m)
        np.testing.assert_array_equal(backend.to_numpy(y), xh @ wf.T)


def test_split_activations_are_f32_accurate(backend, rng):
    N, K, m = 33, 512, 16
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, N, K, "bf16")
    y = backend.zeros((m, N), np.float32)
    Gemm(backend, N, K, "bf16", max_m=16, path="stream")(backend.asarray(xh), backend.asarray(wh), y, m)
    assert float(np.abs(backend.to_numpy(y) - gemm_reference(xh, wh)).max()) < 1e-4


def test_bad_k_split(backend):
    with pytest.raises(ValueError, match="k_split must be"):
        Gemm(backend, 8, 64, "bf16", path="stream", k_split=0)


# ---- the figures (no kernel runs) ------------------------------------------

@pytest.mark.parametrize("name,N,K,nw", QWEN3_8B + HIDDEN_5120)
def test_figures_at_drafter_shapes(name, N, K, nw):
    for m in (16, 32):
        f = gf.stream_figures(N, K, m, nw)
        p = f["plan"]
        assert f["inflight_per_sm"] >= gs.INFLIGHT_TARGET, (name, m, f)
        assert f["smem_read_per_weight_byte"] <= (1.0 if m <= 16 else 2.0)
        assert f["smem_conflict_ways"] == 1
        assert f["x_l2_per_weight_byte"] <= 2 * m / 256 + 1e-9       # 12.5% at m = 16
        assert f["wave_efficiency"] >= 0.84, (name, m, f)
        assert f["partial_per_weight_byte"] <= 0.25
        assert p.smem <= gs.H200.smem_optin and f["blocks_per_sm_resident"] >= 1
        # hi + lo at m <= 32 asks the tensor cores for <= ~280 TFLOP/s at 90% of HBM
        assert f["mma_tflops_at_90pct_hbm"] == pytest.approx(138.24 * p.tiles)
        assert -(-p.kz // p.kt) <= (2 if m <= 16 else 4)             # x staged in at most 2 chunks at m = 16


def test_folded_norm_launches_by_bytes_in_flight():
    """A GS_NORM launch with an f32 x (raw: x staged by cp.async) is planned by bytes in flight,
    not by rounds of blocks: h4096's gate_up at m = 16 takes 2 slices (192 blocks, one round of
    resident blocks) where the rule by rounds takes 8 (768 blocks: 3 rounds), and each busiest SM
    streams at its share of HBM; the raw chunk and gammas fit 2 blocks per SM at MT 1."""
    old = gs.plan(12288, 4096, 16, 2)
    new = gs.plan(12288, 4096, 16, 2, raw=True)
    assert (old.ks, new.ks) == (8, 2) and new.kt == 768 and -(-new.kz // new.kt) == 3
    assert new.smem == gs.smem_bytes(1, 768, 2) + (16 + 2) * 768 * 4 and gs.blocks_per_sm(1, new.smem) == 2
    for mt in (1, 2, 4):   # whole 128-k rows of the lanes' row sums per chunk
        assert gs.plan(12288, 4096, 16 * mt, 2, raw=True, ks=1).kt % gs.RAW_KT == 0
    for name, N, K, nw in QWEN3_8B + HIDDEN_5120:
        if nw != 2:
            continue
        for m in (16, 32, 64):
            f = gf.stream_figures(N, K, m, nw, raw=True)
            p = f["plan"]
            if m == 16:   # one round of resident blocks
                assert f["blocks"] <= f["blocks_per_sm_resident"] * gs.H200.sm_count, (name, m, p)
            assert f["inflight_bound_ratio"] <= 1.05 and f["partial_per_weight_byte"] <= 0.25, (name, m, f)
            assert p.smem <= gs.H200.smem_optin and gs.blocks_per_sm(p.mt, p.smem) == gs.blocks_per_sm(p.mt, 0)
    # without raw (x staged through registers) the rule by rounds stands: a thicker slice would
    # be a longer dependent chain of x loads
    assert gs.plan(4096, 20480, 50, 1).ks == 8


def test_figures_table_covers_every_shape():
    lines = gf.figures_table(ms=(16,)).splitlines()
    assert len(lines) == 2 + len(gf.FIGURE_SHAPES) and "132 SMs" in lines[0]


def test_no_lone_tail_wave():
    # hidden 5120, intermediate 17408 (a launch of 544 blocks on 528 slots would leave a lone
    # tail wave): the plan fills its waves
    assert gf.stream_figures(17408, 5120, 16, 2)["wave_efficiency"] >= 0.9


def test_grid_follows_the_device_sm_count():
    # the SM count is a launch parameter (queried on a GPU), never assumed
    a = gs.plan(4096, 4096, 16, dev=gs.H200)
    b = gs.plan(4096, 4096, 16, dev=gs.Device(sm_count=78, smem_optin=232448))
    assert a.ks != b.ks
    for dev in (gs.H200, gs.Device(78, 232448), gs.Device(108, 166912)):
        f = gf.stream_figures(4096, 12288, 16, 1, dev=dev)
        assert f["wave_efficiency"] >= 0.85 and f["plan"].smem <= dev.smem_optin


def test_plans_fit_for_every_m():
    for N, K, nw in [(6144, 4096, 1), (12288, 4096, 2), (300, 520, 1), (37, 40, 2)]:
        for m in range(1, 130):
            p = gs.plan(N, K, m, nw)
            assert p.kz % 64 == 0 and p.kt % 64 == 0 and (p.ks - 1) * p.kz < K
            # several M blocks split only inside one wave of resident blocks
            assert p.ks == 1 or p.mblocks == 1 or p.grid[0] * p.ks <= gs.H200.sm_count * gs.blocks_per_sm(p.mt, 0)
            assert p.smem <= gs.H200.smem_optin and gs.blocks_per_sm(p.mt, p.smem) >= 1
            assert p.groups * gs.cols_per_block(nw) >= N and p.mblocks * 16 * p.mt >= m
            assert p.grid == (p.groups * p.mblocks, 1, p.ks)


def test_xtile_layout_is_conflict_free_and_the_check_can_fail():
    for kt in (64, 128, 512, 832, 1792):
        assert gf.xtile_conflict_ways(kt) == [1] * 16
    # without the 8-element pad rows 0 and 1 share banks: the counter sees it
    assert max(gf.xtile_conflict_ways(512, pad=0)) == 2


def test_ptxas_registers_within_the_table():
    # The residency arithmetic uses PTXAS_REGS; a kernel edit that grows them fails here.
    from tests.support.nvrtc_check import nvrtc_check
    src = gs.kernels.source_path("gemm_stream.cu")
    for mt in gs.MT_BUCKETS:
        for epi in ("none", "silu_mul", "topk"):   # the options the launcher compiles (GemmVariant)
            variant = gs.GemmVariant(256, 4096, "bf16", epi, split=2, **({"logits": False, "top_k": 64}
                                                                        if epi == "topk" else {}))
            opts = tuple(gs.kernels.compile_options(**variant.stream_defines(mt)))[1:]
            info = nvrtc_check(src.read_text(), str(src), "sm_90", opts)["gemm_stream"]
            assert info["registers"] <= gs.PTXAS_REGS[mt] and info["spill_stores"] == 0, (mt, epi, info)


def test_conv_variant_registers_within_its_table():
    # GS_CONV (kernel_projection + its prepare convolution) is built for one block an SM: the
    # planner's residency for it (PTXAS_REGS_CONV) and no spills with the split-K reduction's
    # doubled loads in flight (gemm_splitk.cuh SPLITK_ONE_BLOCK)
    from tests.support.nvrtc_check import nvrtc_check
    src = gs.kernels.source_path("gemm_stream.cu")
    for mt in gs.MT_BUCKETS:
        for norm in (False, True):
            variant = gs.GemmVariant(1280, 5120, "bf16", "none", split=2, norm=norm, conv=(2, 16))
            opts = tuple(gs.kernels.compile_options(**variant.stream_defines(mt)))[1:]
            info = nvrtc_check(src.read_text(), str(src), "sm_90", opts)["gemm_stream"]
            assert info["registers"] <= gs.PTXAS_REGS_CONV[mt] and info["spill_stores"] == 0, (mt, norm, info)
            assert gs.blocks_per_sm(mt, 0, conv=True) == 1


# ---- padding rows read from device memory ------------------------------------

def _pad_case(backend, rng, N, K, epilogue, m):
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, 2 * N if epilogue == "silu_mul" else N, K, "bf16")
    rh = rng.standard_normal((m, N)).astype(np.float32) if epilogue == "residual" else None
    return xh, wh, rh


@pytest.mark.parametrize("k_split", [None, 3])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_padding_rows_count_as_zero_rows(backend, rng, epilogue, k_split):
    # m = 50 on the 64-row variant, padding [lo, 34): lo = 3 leaves tile 1 (rows
    # 16..31) all padding (skipped), lo = 20 a partial one, lo = 34 (and lo > hi,
    # clamped) none, lo < 0 clamps to 0. The padding rows of x hold NaN: they must
    # never be read, and their outputs are the epilogue of 0.
    N, K, m, hi = 70, 200, 50, 34
    op = Gemm(backend, N, K, "bf16", epilogue=epilogue, max_m=64, path="stream", k_split=k_split)
    xh, wh, rh = _pad_case(backend, rng, N, K, epilogue, m)
    w = backend.asarray(wh)
    for lo in (3, 20, 0, 34, 40, -5):
        c = min(max(lo, 0), hi)
        xn = xh.copy()
        xn[c:hi] = np.nan
        xz = xh.copy()
        xz[c:hi] = 0.0
        y = backend.asarray(np.full((m, N), 7.5, np.float32))
        op(backend.asarray(xn), w, y, m, residual=None if rh is None else backend.asarray(rh),
           pad_rows=(backend.asarray(np.array([lo], np.int32)), hi))
        ref = gemm_reference(xz, wh, epilogue, rh, x_round=op.x_round)
        assert_close(backend.to_numpy(y), ref, "f32", f"{op!r} pad [{lo}, {hi})")


@pytest.mark.parametrize("m,hi,kernel", [(40, 32, 4), (140, 132, "wg128")])
def test_padding_rows_follow_device_memory_in_a_graph(backend, rng, m, hi, kernel):
    # captured once; the padding start changes between replays through a pinned copy; on the
    # mma.sync kernel and (140 rows, by default on sm_90a) the wgmma one
    N, K = 40, 128
    op = Gemm(backend, N, K, "bf16", max_m=max(64, m), path="stream")
    if kernel == "wg128" and not op._stream.wg_variants:
        pytest.skip("no sm_90a: the wgmma kernel is not built here")
    assert op.config(m)[0] == kernel
    xh, wh, _ = _pad_case(backend, rng, N, K, "none", m)
    x, w = backend.asarray(xh), backend.asarray(wh)
    y = backend.zeros((m, N), np.float32)
    lo_dev = backend.zeros((1,), np.int32)
    lo_host = backend.pinned_empty((1,), np.int32)
    s = backend.stream()
    backend.synchronize()  # the zeros above were memset on the current stream
    backend.begin_capture(s)
    backend.copy_h2d_async(lo_dev, lo_host, stream=s)
    op(x, w, y, m, stream=s, pad_rows=(lo_dev, hi))
    g = backend.end_capture(s)
    for lo in (hi, 5, hi - 15, 0):
        backend.host_write(lo_host)  # the previous replay's copy has run (synchronised below)
        lo_host[0] = lo
        g.launch(s)
        s.synchronize()
        xz = xh.copy()
        xz[lo:hi] = 0.0
        assert_close(backend.to_numpy(y), gemm_reference(xz, wh, x_round=op.x_round), "f32", f"lo={lo}")


def test_padding_rows_bad_input(backend):
    op = Gemm(backend, 8, 64, "bf16", max_m=16, path="stream")
    x, w = backend.zeros((4, 64), np.float32), backend.zeros((8, 64), np.uint16)
    y = backend.zeros((4, 8), np.float32)
    lo = backend.zeros((1,), np.int32)
    with pytest.raises(ValueError, match=r"pad_rows\[1\]"):
        op(x, w, y, 4, pad_rows=(lo, 5))
    with pytest.raises(TypeError, match=r"pad_rows\[0\]"):
        op(x, w, y, 4, pad_rows=(backend.zeros((1,), np.float32), 2))
    with pytest.raises(ValueError, match="needs path 'stream'"):
        Gemm(backend, 8, 64, "bf16", path="fma")(x, w, y, 4, pad_rows=(lo, 2))


# ---- RMSNorm folded into the GEMM (GS_NORM) ------------------------------------

@pytest.mark.parametrize("k_split", [None, 3])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_folded_rmsnorm_matches_norm_then_gemm(backend, rng, epilogue, k_split):
    """Rows >= norm_lo normalised inside the GEMM: against rmsnorm_reference then
    gemm_reference, for m in one tile and across tiles, norm_lo at 0, inside and
    past a tile, unsplit and split K (K=840: uneven slices); x is not modified; the
    split-K result repeats bit for bit."""
    N, K = 260, 840
    nw = 2 if epilogue == "silu_mul" else 1
    op = Gemm(backend, N, K, "bf16", epilogue=epilogue, max_m=64, path="stream", k_split=k_split,
              norm_eps=1e-6)
    wh = host_weights(rng, nw * N, K, "bf16")
    ln_h = (1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    w, ln = backend.asarray(wh), backend.asarray(ln_h)
    for m, norm_lo in ((16, 0), (19, 5), (40, 16), (3, 3)):
        xh = rng.standard_normal((m, K)).astype(np.float32)
        xh[norm_lo:] *= rng.uniform(0.01, 30, (m - norm_lo, 1)).astype(np.float32)  # the norm removes it
        rh = rng.standard_normal((m, N)).astype(np.float32) if epilogue == "residual" else None
        x = backend.asarray(xh)
        outs = []
        for _ in range(2):
            y = backend.zeros((m, N), np.float32)
            op(x, w, y, m, residual=None if rh is None else backend.asarray(rh), norm=(ln, norm_lo))
            outs.append(backend.to_numpy(y))
        ref = gemm_reference(xh, wh, epilogue, rh, x_round=op.x_round, norm=(ln_h, 1e-6, norm_lo))
        assert_close(outs[0], ref, "f32", f"{op!r} m={m} norm_lo={norm_lo}")
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(backend.to_numpy(x), xh)
        # the unfused order (normalise, then round) differs by one rounding of x only
        from dflash_cupy.ops.norm import rmsnorm_reference
        xn = xh.copy()
        xn[norm_lo:] = rmsnorm_reference(xh[norm_lo:], ln_h, eps=1e-6) if norm_lo < m else xn[norm_lo:]
        unfused = gemm_reference(xn, wh, epilogue, rh, x_round=op.x_round)
        assert np.allclose(unfused, ref, rtol=1e-4, atol=1e-4)
        # negative control: the unnormalised product is far from it
        if norm_lo < m:
            plain = gemm_reference(xh, wh, epilogue, rh, x_round=op.x_round)
            assert not np.allclose(plain[norm_lo:], ref[norm_lo:], rtol=1e-2, atol=1e-2)


def test_folded_rmsnorm_variant_with_every_row_raw(backend, rng):
    """norm_lo = m: every row enters raw (the step's DFlash 2 gate_up: StepRecipe.gate_up_async,
    the folded-norm variant for its cp.async staging). ln is NaN: never read, never applied; the
    result is the plain GEMM's, through the stream kernel and (m >= 49) the wgmma one, with
    and without dead tiles."""
    N, K = 260, 840
    op = Gemm(backend, N, K, "bf16", epilogue="silu_mul", max_m=128, path="stream", norm_eps=1e-6)
    wh = host_weights(rng, 2 * N, K, "bf16")
    w, ln = backend.asarray(wh), backend.asarray(np.full(K, np.nan, np.float32))
    for m in (5, 16, 37, 64, 80):
        xh = rng.standard_normal((m, K)).astype(np.float32)
        ref = gemm_reference(xh, wh, "silu_mul", x_round=op.x_round)
        y = backend.zeros((m, N), np.float32)
        op(backend.asarray(xh), w, y, m, norm=(ln, m))
        assert_close(backend.to_numpy(y), ref, "f32", f"{op!r} m={m} norm_lo=m ({op._stream.plan(m).mt})")
        flags = tile_flags(rng, m)
        live = live_rows(flags, m)
        y = backend.asarray(np.full((m, N), SENTINEL, np.float32))
        op(backend.asarray(xh), w, y, m, norm=(ln, m), tile_live=backend.asarray(flags))
        got = backend.to_numpy(y)
        assert_close(got[live], ref[live], "f32", f"m={m} flags={flags.tolist()}")
        assert (got[~live] == SENTINEL).all()


def test_folded_rmsnorm_with_padding_rows(backend, rng):
    """The step's qkv: rows [lo, 34) padding, rows >= 34 normalised."""
    N, K, m = 96, 256, 50
    op = Gemm(backend, N, K, "bf16", max_m=64, path="stream", norm_eps=1e-6)
    xh = rng.standard_normal((m, K)).astype(np.float32)
    xh[6:34] = np.nan            # padding rows are never read
    wh = host_weights(rng, N, K, "bf16")
    ln_h = rng.uniform(0.5, 1.5, K).astype(np.float32)
    y = backend.zeros((m, N), np.float32)
    op(backend.asarray(xh), backend.asarray(wh), y, m, pad_rows=(backend.asarray(np.array([6], np.int32)), 34),
       norm=(backend.asarray(ln_h), 34))
    xz = np.where(np.isnan(xh), 0, xh).astype(np.float32)
    ref = gemm_reference(xz, wh, x_round=op.x_round, norm=(ln_h, 1e-6, 34))
    assert_close(backend.to_numpy(y), ref, "f32", "padded + normalised")


def test_folded_rmsnorm_bad_arguments(backend):
    with pytest.raises(ValueError, match="norm_eps needs path 'stream'"):
        Gemm(backend, 8, 64, "f32", norm_eps=1e-6)
    with pytest.raises(ValueError, match="norm_eps must be"):
        Gemm(backend, 8, 64, "bf16", path="stream", norm_eps=0.0)
    op = Gemm(backend, 8, 64, "bf16", path="stream")
    x, w, y = backend.zeros((4, 64), np.float32), backend.zeros((8, 64), np.uint16), backend.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="built without norm_eps"):
        op(x, w, y, 4, norm=(backend.zeros((64,), np.float32), 0))
    opn = Gemm(backend, 8, 64, "bf16", path="stream", norm_eps=1e-6)
    with pytest.raises(ValueError, match=r"norm\[0\] must have shape"):
        opn(x, w, y, 4, norm=(backend.zeros((63,), np.float32), 0))
    with pytest.raises(ValueError, match=r"norm\[1\] must be an int"):
        opn(x, w, y, 4, norm=(backend.zeros((64,), np.float32), 5))


# ---- tiles skipped by a device flag array (tile_live) ----------------------------


@pytest.mark.parametrize("k_split", [None, 3])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_tile_live_skips_dead_tiles(backend, rng, epilogue, k_split):
    """Live rows match gemm_reference; every row of a dead tile keeps the sentinel
    bit for bit (no store, the residual epilogue included). m = 19, 33: one M
    block (split K where asked); 100, 272: several 64-row blocks, one of them
    wholly dead (it exits before loading anything)."""
    N, K = 70, 392
    nw = 2 if epilogue == "silu_mul" else 1
    op = Gemm(backend, N, K, "bf16", epilogue=epilogue, max_m=64, path="stream", k_split=k_split)
    wh = host_weights(rng, nw * N, K, "bf16")
    w = backend.asarray(wh)
    for m in (19, 33, 100, 272):
        flags = tile_flags(rng, m, force_dead_block=m == 272)
        live = live_rows(flags, m)
        xh = rng.standard_normal((m, K)).astype(np.float32)
        xh[~live] = np.nan  # a dead tile's x is never read
        rh = rng.standard_normal((m, N)).astype(np.float32) if epilogue == "residual" else None
        y = backend.asarray(np.full((m, N), SENTINEL, np.float32))
        # the flags as a slice of a longer array (a row range's share of the step's flags)
        fl = backend.asarray(np.concatenate([np.zeros(3, np.int32), flags]))[3:]
        op(backend.asarray(xh), w, y, m, residual=None if rh is None else backend.asarray(rh), tile_live=fl)
        got = backend.to_numpy(y)
        ref = gemm_reference(np.where(live[:, None], xh, 0).astype(np.float32), wh, epilogue, rh,
                             x_round=op.x_round)
        assert_close(got[live], ref[live], "f32", f"{op!r} m={m} flags={flags.tolist()}")
        assert (got[~live].view(np.uint32) == SENTINEL.view(np.uint32)).all(), (m, flags.tolist())
        if k_split is not None:   # several M blocks split too (m = 272: 5 blocks x 3 slices)
            assert op._stream.plan(m).ks == k_split
    counters_zero(backend, op)


def test_tile_live_in_place_residual_and_padding(backend, rng):
    """y is the residual (h += ...): dead rows keep the residual; with pad_rows
    too, padding rows of live tiles are the epilogue of 0 and dead tiles stay."""
    N, K, m = 40, 128, 64
    op = Gemm(backend, N, K, "bf16", epilogue="residual", max_m=64, path="stream")
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, N, K, "bf16")
    rh = rng.standard_normal((m, N)).astype(np.float32)
    flags = np.array([1, 0, 1, 0], np.int32)  # rows 16..31 and 48..63 dead
    lo, hi = 20, 40                            # padding [20, 40): tile 2 partly
    y = backend.asarray(rh)
    xn = xh.copy()
    xn[lo:hi] = np.nan
    op(backend.asarray(xn), backend.asarray(wh), y, m, residual=y, tile_live=backend.asarray(flags),
       pad_rows=(backend.asarray(np.array([lo], np.int32)), hi))
    got = backend.to_numpy(y)
    xz = xh.copy()
    xz[lo:hi] = 0
    ref = gemm_reference(xz, wh, "residual", rh, x_round=op.x_round)
    live = live_rows(flags, m)
    assert_close(got[live], ref[live], "f32", "in place, padded")
    np.testing.assert_array_equal(got[~live], rh[~live])


@pytest.mark.parametrize("k_split", [None, 3])
def test_tile_live_with_folded_rmsnorm(backend, rng, k_split):
    N, K = 96, 256
    op = Gemm(backend, N, K, "bf16", max_m=64, path="stream", norm_eps=1e-6, k_split=k_split)
    wh = host_weights(rng, N, K, "bf16")
    ln_h = rng.uniform(0.5, 1.5, K).astype(np.float32)
    for m, norm_lo in ((33, 5), (100, 40)):
        flags = tile_flags(rng, m)
        live = live_rows(flags, m)
        xh = rng.standard_normal((m, K)).astype(np.float32)
        xh[~live] = np.nan
        y = backend.asarray(np.full((m, N), SENTINEL, np.float32))
        op(backend.asarray(xh), backend.asarray(wh), y, m, norm=(backend.asarray(ln_h), norm_lo),
           tile_live=backend.asarray(flags))
        got = backend.to_numpy(y)
        ref = gemm_reference(np.where(live[:, None], xh, 0).astype(np.float32), wh, x_round=op.x_round,
                             norm=(ln_h, 1e-6, norm_lo))
        assert_close(got[live], ref[live], "f32", f"norm m={m} flags={flags.tolist()}")
        assert (got[~live] == SENTINEL).all()


@pytest.mark.parametrize("logits", [False, True])
def test_tile_live_fused_argmax(backend, rng, logits):
    from dflash_cupy.ops.sample import TokenSampler
    N, K, m = 600, 64, 100
    op = Gemm(backend, N, K, "bf16", "argmax", max_m=64, logits=logits)
    flags = np.array([1, 0, 0, 1, 0, 1, 1], np.int32)   # 7 tiles; rows 96..99 in the last
    live = live_rows(flags, m)
    xh = rng.standard_normal((m, K)).astype(np.float32)
    xh[~live] = np.nan
    wh = host_weights(rng, N, K, "bf16")
    part0 = np.full(op.partials_shape(m), 0xdeadbeef, np.uint32)
    part = backend.asarray(part0)
    y = backend.asarray(np.full((m, N), SENTINEL, np.float32)) if logits else None
    op(backend.asarray(xh), backend.asarray(wh), y, m, partials=part, tile_live=backend.asarray(flags))
    ph = backend.to_numpy(part)
    np.testing.assert_array_equal(ph[~live], part0[~live])
    assert not (ph[live] == 0xdeadbeef).any()
    tok = backend.zeros((m,), np.int32)
    TokenSampler(backend, N).reduce_partials(part, tok, m)
    ref = gemm_reference(np.where(live[:, None], xh, 0).astype(np.float32), wh, x_round=op.x_round)
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = live & (top2[:, 1] - top2[:, 0] > 1e-3)
    np.testing.assert_array_equal(backend.to_numpy(tok)[clear], np.argmax(ref, axis=1)[clear])
    if logits:
        got = backend.to_numpy(y)
        assert_close(got[live], ref[live], "f32", "argmax logits")
        assert (got[~live] == SENTINEL).all()


def test_tile_live_follows_device_memory_in_a_graph(backend, rng):
    # captured once; the flags change between replays through a pinned copy
    N, K, m = 40, 128, 40
    op = Gemm(backend, N, K, "bf16", max_m=64, path="stream")
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, N, K, "bf16")
    x, w = backend.asarray(xh), backend.asarray(wh)
    y = backend.asarray(np.full((m, N), SENTINEL, np.float32))
    f_dev = backend.zeros((3,), np.int32)
    f_host = backend.pinned_empty((3,), np.int32)
    s = backend.stream()
    backend.synchronize()
    backend.begin_capture(s)
    backend.copy_h2d_async(f_dev, f_host, stream=s)
    op(x, w, y, m, stream=s, tile_live=f_dev)
    g = backend.end_capture(s)
    ref = gemm_reference(xh, wh, x_round=op.x_round)
    done = np.zeros(m, bool)   # rows some replay computed; the others still hold the sentinel
    for flags in ([0, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]):
        backend.host_write(f_host)
        f_host[:] = flags
        g.launch(s)
        s.synchronize()
        done |= live_rows(np.array(flags), m)
        got = backend.to_numpy(y)
        assert_close(got[done], ref[done], "f32", f"flags={flags}")
        assert (got[~done] == SENTINEL).all(), flags


@pytest.mark.parametrize("path,wkind", [("fma", "bf16"), ("fma", "f32")])
def test_tile_live_fallback_paths_compute_every_row(backend, rng, path, wkind):
    N, K, m = 37, 96, 33
    op = Gemm(backend, N, K, wkind, max_m=64, path=path)
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, N, K, wkind)
    y = backend.zeros((m, N), np.float32)
    op(backend.asarray(xh), backend.asarray(wh), y, m, tile_live=backend.asarray(np.array([0, 1, 0], np.int32)))
    assert_close(backend.to_numpy(y), gemm_reference(xh, wh, x_round=op.x_round), "f32", path)


def test_tile_live_bad_input(backend):
    op = Gemm(backend, 8, 64, "bf16", max_m=64, path="stream")
    x, w = backend.zeros((40, 64), np.float32), backend.zeros((8, 64), np.uint16)
    y = backend.zeros((40, 8), np.float32)
    y0 = backend.to_numpy(y).copy()
    with pytest.raises(ValueError, match=r"tile_live must hold >= ceil\(m/16\) = 3"):
        op(x, w, y, 40, tile_live=backend.zeros((2,), np.int32))
    with pytest.raises(TypeError, match="tile_live must have dtype int32"):
        op(x, w, y, 40, tile_live=backend.zeros((3,), np.float32))
    with pytest.raises(TypeError, match="tile_live must be a device array"):
        op(x, w, y, 40, tile_live=np.ones(3, np.int32))
    np.testing.assert_array_equal(backend.to_numpy(y), y0)


# ---- M beyond one block: the M blocks of a column group adjacent in launch order ----

def test_m_blocks_of_a_column_group_are_adjacent():
    # grid x = column group * mblocks + M block; y = 1, so no grid limit binds at any m
    p = gs.plan(12288, 4096, 256, 2)
    assert (p.grid, p.groups, p.mblocks, p.ks) == ((96 * 4, 1, 1), 96, 4, 1)
    f = gf.stream_figures(12288, 4096, 256, 2)
    # the 4 M blocks of a group share one wave (one HBM read); with the M block in
    # grid y (column group fastest) 96 groups x 4 blocks span 3 waves of 132: 3 HBM reads
    assert f["weight_hbm_passes"] == 1.0 and f["weight_hbm_passes_cg_fastest"] == 3.0
    for name, N, K, nw in QWEN3_8B + HIDDEN_5120:
        for m in (256, 1024, 4096):   # up to 64 lanes x 64 rows
            f = gf.stream_figures(N, K, m, nw)
            p = f["plan"]
            assert p.grid[0] == p.groups * p.mblocks < gs.GRID_X_MAX and p.grid[1:] == (1, p.ks)
            assert p.mblocks == -(-m // 64) and p.mt == 4
            assert f["weight_hbm_passes"] <= 1.5 < f["weight_hbm_passes_cg_fastest"] or m == 256, (name, m, f)
    # 3 groups x 5 M blocks, waves of 4: blocks 0..4, 5..9, 10..14 touch 2 waves each; the
    # other order puts group 0 at 0, 3, 6, 9, 12 (4 waves)
    assert gf.weight_passes(3, 5, 4) == 2.0
    assert gf.weight_passes(3, 5, 4, m_fastest=False) == 4.0


@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_many_m_blocks_match_the_reference(backend, rng, epilogue):
    # m = 256, 4 M blocks and (N = 300) 2 or 3 column groups: every (group, M block) of
    # the linear index lands on its own rows and columns; rows >= m stay untouched.
    # max_m = 4096 (64 lanes x 64 rows) is accepted and needs no larger workspace.
    op = run(backend, rng, N=300, K=136, wkind="bf16", epilogue=epilogue, m=256, max_m=4096, x_rows=260,
             path="stream", wgmma=False)
    p = op._stream.plan(256)
    assert p.mblocks == 4 and p.groups == (3 if epilogue == "silu_mul" else 2) and p.grid == (p.groups * 4, 1, 1)
    assert op._stream._ws.size == 1


def test_many_m_blocks_exact_integers(backend, rng):
    # integer data: a row or column landing in the wrong block is an exact mismatch
    N, K, m = 300, 200, 200
    op = Gemm(backend, N, K, "bf16", max_m=4096, path="stream", wgmma=False)
    xh = rng.integers(-3, 4, (m, K)).astype(np.float32)
    wf = rng.integers(-3, 4, (N, K)).astype(np.float32)
    y = backend.zeros((m, N), np.float32)
    op(backend.asarray(xh), backend.asarray(wf.astype(ml_dtypes.bfloat16).view(np.uint16)), y, m)
    np.testing.assert_array_equal(backend.to_numpy(y), xh @ wf.T)


def test_many_m_blocks_fused_argmax(backend, rng):
    # the partials index (row, column group) from the linear block index
    from dflash_cupy.ops.sample import TokenSampler
    N, K, m = 600, 64, 130
    op = Gemm(backend, N, K, "bf16", "argmax", max_m=4096, logits=False)
    assert op._stream.plan(m).mblocks == 3 and op.partials_shape(m) == (m, 3, 2)
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, N, K, "bf16")
    part = backend.zeros(op.partials_shape(m), np.uint32)
    op(backend.asarray(xh), backend.asarray(wh), None, m, partials=part)
    tok = backend.zeros((m,), np.int32)
    TokenSampler(backend, N).reduce_partials(part, tok, m)
    ref = gemm_reference(xh, wh, x_round=op.x_round)
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3
    assert clear.sum() > m // 2
    np.testing.assert_array_equal(backend.to_numpy(tok)[clear], np.argmax(ref, axis=1)[clear])


@pytest.mark.parametrize("path,wkind", [("fma", "bf16"), ("fma", "f32")])
def test_large_max_m_on_the_fallback_paths(backend, rng, path, wkind):
    # max_m beyond 64 keeps the 64-row tile there (larger m: more tiles)
    op = run(backend, rng, N=37, K=96, wkind=wkind, epilogue="none", m=70, max_m=4096, x_rows=72, path=path)
    assert op.tile_m == 64


# ---- split K with several M blocks: workspace and counters per (column group, M block) ----


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_split_k_several_m_blocks(backend, rng, epilogue, norm):
    """K split 3 ways (K=840: uneven slices) with 2..5 M blocks of 64 rows at awkward
    m, N=300 (2 or 3 column groups, the last partial), each (group, M block) reducing
    its own slices: against gemm_reference (folded RMSNorm too), first without flags,
    then with random tile_live flags (m=272: the first M block wholly dead, it leaves
    in every slice before the count); dead rows keep the sentinel bit for bit; a
    second launch repeats bit for bit (the counters reset themselves to 0)."""
    N, K, ks = 300, 840, 3
    nw = 2 if epilogue == "silu_mul" else 1
    op = Gemm(backend, N, K, "bf16", epilogue=epilogue, max_m=512, path="stream", k_split=ks, wgmma=False,
              norm_eps=1e-6 if norm else None)
    wh = host_weights(rng, nw * N, K, "bf16")
    w = backend.asarray(wh)
    ln_h = rng.uniform(0.5, 1.5, K).astype(np.float32)
    for m, use_flags in ((100, False), (130, False), (272, False), (100, True), (130, True), (272, True)):
        p = op._stream.plan(m)
        assert p.ks == ks and p.mblocks == -(-m // 64) >= 2 and p.grid == (p.groups * p.mblocks, 1, ks)
        flags = tile_flags(rng, m, force_dead_block=m == 272) if use_flags else np.ones(-(-m // 16), np.int32)
        live = live_rows(flags, m)
        xh = rng.standard_normal((m, K)).astype(np.float32)
        norm_lo = m // 3
        if norm:
            xh[norm_lo:] *= rng.uniform(0.01, 30, (m - norm_lo, 1)).astype(np.float32)
        xh[~live] = np.nan
        rh = rng.standard_normal((m, N)).astype(np.float32) if epilogue == "residual" else None
        kw = dict(residual=None if rh is None else backend.asarray(rh),
                  tile_live=backend.asarray(flags) if use_flags else None,
                  norm=(backend.asarray(ln_h), norm_lo) if norm else None)
        outs = []
        for _ in range(2):
            y = backend.asarray(np.full((m, N), SENTINEL, np.float32))
            op(backend.asarray(xh), w, y, m, **kw)
            outs.append(backend.to_numpy(y))
            counters_zero(backend, op)
        ref = gemm_reference(np.where(live[:, None], xh, 0).astype(np.float32), wh, epilogue, rh,
                             x_round=op.x_round, norm=(ln_h, 1e-6, norm_lo) if norm else None)
        what = f"{op!r} m={m} flags={flags.tolist()}"
        assert_close(outs[0][live], ref[live], "f32", what)
        assert (outs[0][~live].view(np.uint32) == SENTINEL.view(np.uint32)).all(), what
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), what


def test_split_k_several_m_blocks_exact_integers(backend, rng):
    # integer data: every partial sum is exact, so a slice reduced into the wrong (group,
    # M block) or a missing slice is an exact mismatch; 4 M blocks x 2 groups x 4 slices
    N, K, m = 300, 712, 200
    op = Gemm(backend, N, K, "bf16", max_m=256, path="stream", k_split=4, wgmma=False)
    assert op._stream.plan(m).grid == (2 * 4, 1, 4)
    xh = rng.integers(-3, 4, (m, K)).astype(np.float32)
    wf = rng.integers(-3, 4, (N, K)).astype(np.float32)
    y = backend.zeros((m, N), np.float32)
    op(backend.asarray(xh), backend.asarray(wf.astype(ml_dtypes.bfloat16).view(np.uint16)), y, m)
    np.testing.assert_array_equal(backend.to_numpy(y), xh @ wf.T)
    counters_zero(backend, op)


def test_split_k_several_m_blocks_in_a_graph(backend, rng):
    # captured once, replayed with other flags: each replay matches the reference and
    # a replay with the same flags repeats bit for bit
    N, K, m = 70, 392, 130
    op = Gemm(backend, N, K, "bf16", epilogue="residual", max_m=256, path="stream", k_split=3, wgmma=False)
    assert op._stream.plan(m).mblocks == 3 and op._stream.plan(m).ks == 3
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, N, K, "bf16")
    rh = rng.standard_normal((m, N)).astype(np.float32)
    x, w, r = backend.asarray(xh), backend.asarray(wh), backend.asarray(rh)
    y = backend.asarray(np.full((m, N), SENTINEL, np.float32))
    f_dev = backend.zeros((9,), np.int32)
    f_host = backend.pinned_empty((9,), np.int32)
    s = backend.stream()
    backend.synchronize()
    backend.begin_capture(s)
    backend.copy_h2d_async(f_dev, f_host, stream=s)
    op(x, w, y, m, residual=r, stream=s, tile_live=f_dev)
    g = backend.end_capture(s)
    ref = gemm_reference(xh, wh, "residual", rh, x_round=op.x_round)
    done = np.zeros(m, bool)   # rows some replay computed; the others still hold the sentinel
    seen = {}
    for flags in ([0, 0, 0, 0, 1, 0, 1, 1, 0], [1] * 9, [0, 0, 0, 0, 1, 0, 1, 1, 0], [1] * 9):
        backend.host_write(f_host)
        f_host[:] = flags
        g.launch(s)
        s.synchronize()
        live = live_rows(np.array(flags), m)
        done |= live
        got = backend.to_numpy(y)
        assert_close(got[live], ref[live], "f32", f"replay flags={flags}")
        assert (got[~done] == SENTINEL).all(), flags
        key = tuple(flags)
        if key in seen:   # the same flags: bit for bit
            assert np.array_equal(seen[key][live].view(np.uint32), got[live].view(np.uint32)), flags
        seen[key] = got
        counters_zero(backend, op)


def test_split_k_plans_for_several_m_blocks():
    # the qwen3-8b-like (h4096) o and down at 256 rows: 16 groups x 4 M blocks fill half the
    # SMs; 2 slices fill 128 of 132. qkv (96 blocks) and gate_up (384) gain nothing.
    expect = {("o", 256): 2, ("down", 256): 2, ("qkv", 256): 1, ("gate_up", 256): 1}
    for name, N, K, nw in QWEN3_8B:
        for m in (64, 256, 1024):
            p = gs.plan(N, K, m, nw)
            if (name, m) in expect:
                assert p.ks == expect[name, m], (name, m, p)
            if m == 1024:
                assert p.ks == 1, (name, m, p)
    # the cap: several M blocks split only while the split grid fits one wave (bounded
    # workspace); a forced split beyond it runs unsplit
    for name, N, K, nw in QWEN3_8B + HIDDEN_5120:
        for m in range(65, 4097, 37):
            p = gs.plan(N, K, m, nw)
            assert p.ks == 1 or p.grid[0] * p.ks <= gs.H200.sm_count * gs.blocks_per_sm(p.mt, 0), (name, m, p)
    assert gs.plan(4096, 4096, 256, 1, ks=3).ks == 1          # 64 x 3 > 132
    assert gs.plan(4096, 4096, 128, 1, ks=4).ks == 4          # 32 x 4 = 128


def test_split_k_workspace_covers_every_m(backend):
    # the workspace and counters are sized for the largest split any m plans (m beyond
    # max_m included): each planned split fits, and past m_split_max nothing splits
    op = Gemm(backend, 300, 840, "bf16", "silu_mul", max_m=64, path="stream", norm_eps=1e-6, k_split=3)
    sk = op._stream
    per_row = 2 * gs.cols_per_block(2) + 1
    assert sk.m_split_max > 64
    for m in range(1, 2 * sk.m_split_max + 2):
        p = sk.plan(m)
        if p.ks > 1:
            assert m <= sk.m_split_max
            assert p.grid[0] * p.ks * 16 * p.mt * per_row <= sk._ws.size and p.grid[0] <= sk._counters.size
    assert sk.plan(sk.m_split_max).ks == 3 and sk.plan(sk.m_split_max).mblocks > 1
    # bounded by one wave of 64-row partial tiles (plus the row sums of squares)
    assert sk._ws.size <= gs.H200.sm_count * 64 * per_row


@pytest.mark.parametrize("N,K,nw,max_m", [(40, 32, 1, 64), (64, 96, 2, 200), (300, 840, 1, 300), (19, 520, 1, 49)])
def test_plan_representatives_give_every_distinct_default_plan(emu, N, K, nw, max_m):
    """The constructor sizes the workspace from representative row counts only: their default
    plans are exactly the set of every m's up to m_hi (wgmma plans depend on m only through
    the variant and its row blocks)."""
    op = Gemm(emu, N, K, "bf16", "silu_mul" if nw == 2 else "none", max_m=max_m, path="stream")
    sk = op._stream
    assert sk.wg_variants                      # the collapsed case
    m_hi = sk.m_hi
    reps = sk.plan_representatives(m_hi)
    assert len(reps) < m_hi / 4 and max(reps) == m_hi
    assert {sk.default_plan(m) for m in reps} == {sk.default_plan(m) for m in range(1, m_hi + 1)}


def test_split_k_static_counters_per_m_block():
    # profiling.counters counts split K per (column group, M block): partial tiles of the
    # stored rows only, a wholly dead M block leaves before the count (no partials)
    from profiling import counters as ctr
    from tests.support.launches import arr, gs_launch
    L, p = gs_launch(256, 256, 1024, ks=2)
    assert p.grid == (4, 1, 2) and p.mblocks == 4
    L = L.with_args(ln=None, eps=0.0, norm_lo=0, tile_live=arr("tl", (16,), np.int32), use_live=1)
    every = ctr.static_counters(L)   # (a forced split: its notes name the difference from plan's)
    ws = next(k for k in every.bytes_written if k.startswith("ws"))
    assert every.bytes_written[ws] == every.bytes_read[ws] == 2 * 256 * 256 * 4
    L.known["tile_live"] = tuple([True] * 8 + [False] * 4 + [True, False, False, False])
    c = ctr.static_counters(L)
    assert c.bytes_written[ws] == 2 * 9 * 16 * 256 * 4          # 9 live tiles of 16 rows
    assert c.mma * 16 == every.mma * 9 and c.gst_bytes < every.gst_bytes
    assert c.barriers < every.barriers                            # block 2 never reaches the count
