"""The stream GEMMs reading x already rounded to the weight type (``Gemm(..., x_split=False,
x16=True)``: gemm_stream.cu's GS_X16, gemm_wgmma.cu's GW_X16).

A single-rounding GEMM rounds its f32 x to the weight type before the MMA, so a producer
may store x in that type instead (half the bytes every column group re-reads from L2). The
claim tested here is exactness: for every kernel variant (mma.sync 16/32/64 rows, wgmma
64/128 tokens), epilogue, folded RMSNorm on and off, split K, padding rows and dead tiles,
at awkward row counts and a K that is not a multiple of 64, the x16 kernel's output equals
the f32 kernel's fed the same (representable) values bit for bit, the norm's row sums of
squares included (same per-lane order). Also: the static counters' x bytes follow the
element size and match what the emulator counts; bad arguments are refused."""
import ml_dtypes
import numpy as np
import pytest

from dflash_cupy.ops import gemm_stream as gs
from dflash_cupy.ops.gemm import Gemm, gemm_reference
from tests.support.gemm import SENTINEL, by_field, host_weights, live_rows, no_conv, no_rope
from tests.support.tolerances import assert_close

MAX_M = 160
N, K = 200, 456          # a partial column group; K = 7 x 64 + 8
X16_DT = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}

# (m, launch configuration): every compiled variant, split K or not, 1 / 3 / 19 / 33 / 100 rows
CASES = [(1, (1, 1)), (3, (1, 2)), (19, (2, 1)), (33, (2, 2)), (33, (4, 1)), (100, (4, 2)),
         (100, ("wg128", 1)), (100, ("wg64", 2)), (33, ("wg64", 1)), (19, ("wg128", 2))]


def _rounded(rng, rows, cols, wkind):
    """(f32 values representable in the weight type, the same values as its device bits)."""
    h = rng.standard_normal((rows, cols)).astype(np.float32).astype(X16_DT[wkind])
    return h.astype(np.float32), (h.view(np.uint16) if wkind == "bf16" else h)


def _pair(be, wkind, epilogue, norm, k=K, **kw):
    mk = dict(epilogue=epilogue, max_m=MAX_M, path="stream", x_split=False, wgmma=True,
              norm_eps=1e-6 if norm else None, **kw)
    return Gemm(be, N, k, wkind, **mk), Gemm(be, N, k, wkind, x16=True, **mk)


def _run_both(be, ops, xs, w, m, cfg, residual=None, **call):
    out = []
    for op, x in zip(ops, xs):
        op.use_config(m, cfg)
        assert op.config(m) == cfg
        y = be.asarray(np.full((m + 2, N), SENTINEL, np.float32))
        r = None if residual is None else be.asarray(residual)
        op(x, w, y, m, residual=r, **call)
        out.append(be.to_numpy(y))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_bit_identical_to_f32_x_every_variant(emu, rng, epilogue, norm):
    nw = 2 if epilogue == "silu_mul" else 1
    f32_op, x16_op = _pair(emu, "bf16", epilogue, norm)
    wh = host_weights(rng, nw * N, K, "bf16")
    w = emu.asarray(wh)
    ln_h = rng.uniform(0.5, 1.5, K).astype(np.float32)
    ln = emu.asarray(ln_h)
    for m, cfg in CASES:
        xf, xb = _rounded(rng, m + 3, K, "bf16")
        rh = rng.standard_normal((m + 2, N)).astype(np.float32) if epilogue == "residual" else None
        norm_lo = min(m, 2)
        call = dict(norm=(ln, norm_lo)) if norm else {}
        a, b = _run_both(emu, (f32_op, x16_op), (emu.asarray(xf), emu.asarray(xb)), w, m, cfg, rh, **call)
        np.testing.assert_array_equal(b, a, err_msg=f"m={m} {cfg}")
        assert (b[m:] == SENTINEL).all()
        ref = gemm_reference(xf[:m], wh, epilogue, None if rh is None else rh[:m], x_round="bf16",
                             norm=(ln_h, 1e-6, norm_lo) if norm else None)
        assert_close(b[:m], ref, "f32", f"m={m} {cfg}")


@pytest.mark.parametrize("epilogue,norm", [("none", True), ("silu_mul", False), ("residual", True)])
def test_f16_weights(emu, rng, epilogue, norm):
    nw = 2 if epilogue == "silu_mul" else 1
    f32_op, x16_op = _pair(emu, "f16", epilogue, norm)
    assert x16_op.x_dtype == np.float16
    w = emu.asarray(host_weights(rng, nw * N, K, "f16"))
    ln = emu.asarray(rng.uniform(0.5, 1.5, K).astype(np.float32))
    for m, cfg in ((3, (1, 1)), (33, (4, 2)), (100, ("wg128", 1)), (19, ("wg64", 2))):
        xf, xh = _rounded(rng, m, K, "f16")
        rh = rng.standard_normal((m + 2, N)).astype(np.float32) if epilogue == "residual" else None
        call = dict(norm=(ln, 0)) if norm else {}
        a, b = _run_both(emu, (f32_op, x16_op), (emu.asarray(xf), emu.asarray(xh)), w, m, cfg, rh, **call)
        np.testing.assert_array_equal(b, a, err_msg=f"m={m} {cfg}")


@pytest.mark.parametrize("k", [40, 8, 136])
def test_short_k(emu, rng, k):
    """K below one 64-wide step, and a partial last step: the zero tail of the staged chunk."""
    f32_op, x16_op = _pair(emu, "bf16", "silu_mul", True, k=k)
    w = emu.asarray(host_weights(rng, 2 * N, k, "bf16"))
    ln = emu.asarray(rng.uniform(0.5, 1.5, k).astype(np.float32))
    for m, cfg in ((3, (1, 1)), (70, (4, 1)), (70, ("wg64", 1))):
        xf, xb = _rounded(rng, m, k, "bf16")
        a, b = _run_both(emu, (f32_op, x16_op), (emu.asarray(xf), emu.asarray(xb)), w, m, cfg, norm=(ln, 1))
        np.testing.assert_array_equal(b, a, err_msg=f"K={k} m={m} {cfg}")


@pytest.mark.parametrize("norm", [False, True])
def test_dead_tiles_and_padding_rows(emu, rng, norm):
    """Rows of dead tiles and padding rows hold NaN in both x's: never read (outputs equal and
    finite where stored, dead rows keep the sentinel)."""
    m = 100
    flags = np.array([1, 0, 1, 1, 0, 0, 1], np.int32)
    live = live_rows(flags, m)
    pad_lo, pad_hi = 70, 90
    f32_op, x16_op = _pair(emu, "bf16", "residual", norm)
    w = emu.asarray(host_weights(rng, N, K, "bf16"))
    ln = emu.asarray(rng.uniform(0.5, 1.5, K).astype(np.float32))
    rh = rng.standard_normal((m + 2, N)).astype(np.float32)
    for cfg in ((4, 1), (4, 2), (2, 1), ("wg128", 1), ("wg64", 2)):
        xf, xb = _rounded(rng, m, K, "bf16")
        xf[~live] = np.nan
        xf[pad_lo:pad_hi] = np.nan
        xb[~live] = 0xFFFF
        xb[pad_lo:pad_hi] = 0xFFFF
        call = dict(tile_live=emu.asarray(flags), pad_rows=(emu.asarray(np.array([pad_lo], np.int32)), pad_hi))
        if norm:
            call["norm"] = (ln, 5)
        a, b = _run_both(emu, (f32_op, x16_op), (emu.asarray(xf), emu.asarray(xb)), w, m, cfg, rh, **call)
        np.testing.assert_array_equal(b, a, err_msg=str(cfg))
        assert np.isfinite(b[:m][live]).all() and (b[:m][~live] == SENTINEL).all(), cfg


def test_bad_arguments(emu):
    with pytest.raises(ValueError, match="x16"):
        Gemm(emu, N, K, "bf16", path="stream", x16=True)                      # x_split=True
    with pytest.raises(ValueError, match="x16"):
        Gemm(emu, N, K, "bf16", path="fma", x_split=False, x16=True)
    with pytest.raises(TypeError, match="x16"):
        Gemm(emu, N, K, "bf16", path="stream", x_split=False, x16=1)
    with pytest.raises(ValueError, match="split=1"):
        gs.GemmVariant(N, K, "bf16", split=2, x16=True)
    op = Gemm(emu, N, K, "bf16", path="stream", x_split=False, x16=True, max_m=16)
    w = emu.zeros((N, K), np.uint16)
    y = emu.asarray(np.full((4, N), SENTINEL, np.float32))
    for bad in (emu.zeros((4, K), np.float32), emu.zeros((4, K), np.float16)):
        with pytest.raises(TypeError, match=r"^x must have dtype uint16"):
            op(bad, w, y, 4)
    assert (emu.to_numpy(y) == SENTINEL).all()
    f16 = Gemm(emu, N, K, "f16", path="stream", x_split=False, x16=True, max_m=16)
    with pytest.raises(TypeError, match=r"^x must have dtype float16"):
        f16(emu.zeros((4, K), np.uint16), emu.zeros((N, K), np.float16), y, 4)
    assert op.bytes_moved(4) == N * K * 2 + 4 * K * 2 + 4 * N * 4


@pytest.mark.parametrize("cfg,norm", [((4, 1), False), ((1, 2), True), (("wg128", 1), False),
                                      (("wg64", 2), True)])
def test_static_counters_follow_the_element_size(emu, rng, cfg, norm):
    """profiling/counters.py's x bytes and sectors for a 16-bit x against the emulator's count
    of the same launch (every block): x bytes exactly (half the f32 kernel's), global sectors
    within 2%, the staging stores conflict-free, and the f32 model's x bytes twice these; with
    y16 the same for y's bytes and the stores' sectors."""
    from dflash_cupy.emu.counting import count_launch
    from profiling import counters as ctr
    from profiling.step_trace import RecordingBackend, _rename

    m = 100 if isinstance(cfg[0], str) or cfg[0] == 4 else 3
    est = {}
    for x16 in (False, True):
        rec = RecordingBackend()
        g = Gemm(rec, N, K, "bf16", max_m=MAX_M, path="stream", x_split=False, wgmma=True, x16=x16,
                 y16=x16, norm_eps=1e-6 if norm else None)
        g.use_config(m, cfg)
        xr = rec.empty((m, K), np.uint16 if x16 else np.float32)
        yr = rec.empty((m, N), np.uint16 if x16 else np.float32)
        g(xr, rec.empty((N, K), np.uint16), yr, m, norm=(rec.asarray(np.ones(K, np.float32)), 0) if norm else None)
        _rename(rec.eager, {(int(xr.ctypes.data), int(xr.nbytes)): "x", (int(yr.ctypes.data), int(yr.nbytes)): "y"})
        est[x16] = ctr.static_counters(rec.eager[-1])
    st = est[True]
    assert st.bytes_read["x"] == m * K * 2 and est[False].bytes_read["x"] == m * K * 4
    assert st.bytes_written["y"] == m * N * 2 and est[False].bytes_written["y"] == m * N * 4
    if not norm:   # (with the norm the f32 kernel copies its gammas once per block and chunk, cp.async,
        # where the x16 kernel re-reads them per normalised row: the totals are not ordered)
        assert est[False].gld_sectors > st.gld_sectors

    op = Gemm(emu, N, K, "bf16", max_m=MAX_M, path="stream", x_split=False, wgmma=True, x16=True, y16=True,
              norm_eps=1e-6 if norm else None)
    op.use_config(m, cfg)
    sk = op._stream
    p = sk.plan(m)
    _, xb = _rounded(rng, m, K, "bf16")
    x = emu.asarray(xb)
    w = emu.asarray(host_weights(rng, N, K, "bf16"))
    y = emu.zeros((m, N), np.uint16)
    ln = emu.asarray(np.ones(K, np.float32))
    args = (x, w, y, y, np.int32(m), np.int32(N), np.int32(p.kz), np.int32(p.kt), sk._ws, sk._counters,
            sk._counters, np.int32(0), ln, np.float32(1e-6), np.int32(0 if norm else m), sk._counters, np.int32(0))
    if isinstance(p.mt, str):   # the wgmma kernel's qkv-epilogue arguments (missing here since that merge)
        args += no_rope(sk)
    args += (x, np.int32(m), ln, np.int32(0))   # one input, no ln_lo
    if not isinstance(p.mt, str):   # gemm_stream.cu's convolution arguments (off)
        args += no_conv(sk)
    c = count_launch(sk._kernels[p.mt], p.grid, (p.threads, 1, 1), by_field(sk._kernels[p.mt], args), p.smem)
    xc = c.arrays["x"]
    assert xc.read_distinct == m * K * 2 == st.bytes_read["x"]
    assert xc.read == p.groups * m * K * 2       # every column group stages x once
    emu_sec, st_sec = c.gld_sectors, st.gld_sectors
    if norm and isinstance(cfg[0], str):
        # the wgmma model counts ln once per block and step (L1 serves its re-reads by the
        # tokens), the emulator every request: both sides without ln
        emu_sec -= c.arrays["ln"].ld_sectors
        st_sec -= p.groups * p.mblocks * sum(-(-min(p.kz, K - z * p.kz) * 4 // 32) for z in range(p.ks))
    assert abs(emu_sec - st_sec) <= 0.02 * st_sec, (emu_sec, st_sec)
    assert c.arrays["y"].written_distinct == m * N * 2
    if cfg[1] == 1:   # (split K: the models' partial-tile stores are rougher, the f32 kernel's alike)
        assert abs(c.gst_sectors - st.gst_sectors) <= 0.02 * st.gst_sectors, (c.gst_sectors, st.gst_sectors)
    # shared memory conflict-free, the wgmma norm's partial sums too (swizzled: 8-way before)
    assert c.sst_wavefronts == c.sst_ideal, (c.sst_wavefronts, c.sst_ideal)
    if isinstance(cfg[0], str):
        assert c.sld_wavefronts == c.sld_ideal, (c.sld_wavefronts, c.sld_ideal)
    if not norm:
        if isinstance(cfg[0], str):   # its static shared accesses are the staging stores alone
            assert c.sst_requests == st.smem_requests and c.sst_wavefronts == st.smem_wavefronts


@pytest.mark.slow
def test_ptxas_registers_within_the_tables():
    """The x16 variants fit the residency arithmetic's register tables (PTXAS_REGS,
    WG_PTXAS_REGS), with no spills and (wgmma) no serialised wgmma (nvrtc_check fails on C7515)."""
    from tests.support.nvrtc_check import nvrtc_check
    for fname, arch, key in (("gemm_stream.cu", "sm_90", "gemm_stream"), ("gemm_wgmma.cu", "sm_90a", "gemm_wgmma")):
        src = gs.kernels.source_path(fname)
        for epi, norm in ((0, 0), (1, 0), (2, 0), (2, 1), (0, 1)):
            for var in ((1, 2, 4) if key == "gemm_stream" else (64, 128)):
                if key == "gemm_stream":
                    d = dict(GS_WTYPE=2, GS_EPI=epi, GS_K=4096, GS_MT=var, GS_NT=2 if epi == 2 else 4,
                             GS_WARPS=gs.WARPS, GS_SPLIT=1, GS_X16=1, GS_DEPTH=gs.DEPTH[var],
                             **({"GS_NORM": 1} if norm else {}))
                    limit = gs.PTXAS_REGS[var]
                else:
                    d = dict(GW_WTYPE=2, GW_EPI=epi, GW_K=4096, GW_BT=var, GW_SPLIT=1, GW_X16=1,
                             GW_DEPTH=gs.WG_DEPTH[var], **({"GW_NORM": 1} if norm else {}))
                    limit = gs.WG_PTXAS_REGS[var]
                opts = tuple(gs.kernels.compile_options(**d))[1:]
                info = nvrtc_check(src.read_text(), str(src), arch, opts)[key]
                assert info["registers"] <= limit and info["spill_stores"] == 0, (fname, var, epi, norm, info)


def _bits(a, wkind):
    h = np.asarray(a, np.float32).astype(X16_DT[wkind])
    return h.view(np.uint16) if wkind == "bf16" else h


@pytest.mark.parametrize("wkind,norm", [("bf16", True), ("f16", False)])
@pytest.mark.parametrize("epilogue", ["none", "silu_mul"])
def test_y16_is_the_f32_output_rounded(emu, rng, epilogue, wkind, norm):
    """y16=True writes exactly the f32 kernel's output rounded to the weight type (nearest
    even), every variant, split K or not (the split-K reduction's epilogue too); rows of dead
    tiles are not written."""
    nw = 2 if epilogue == "silu_mul" else 1
    mk = dict(epilogue=epilogue, max_m=MAX_M, path="stream", x_split=False, wgmma=True,
              norm_eps=1e-6 if norm else None)
    f32_op, y16_op = Gemm(emu, N, K, wkind, **mk), Gemm(emu, N, K, wkind, y16=True, x16=True, **mk)
    assert y16_op.y_dtype == (np.uint16 if wkind == "bf16" else np.float16)
    w = emu.asarray(host_weights(rng, nw * N, K, wkind))
    ln = emu.asarray(rng.uniform(0.5, 1.5, K).astype(np.float32))
    flags = np.array([1, 1, 0, 1, 1, 1, 1], np.int32)
    sentinel = _bits(np.full((1,), SENTINEL), wkind)[0]
    for m, cfg in ((3, (1, 2)), (33, (2, 1)), (100, (4, 2)), (100, ("wg128", 1)), (100, ("wg64", 2))):
        xf, x16 = _rounded(rng, m, K, wkind)
        call = dict(tile_live=emu.asarray(flags[:-(-m // 16)] if m > 16 else np.ones(1, np.int32)))
        if norm:
            call["norm"] = (ln, 1)
        for op in (f32_op, y16_op):
            op.use_config(m, cfg)
        y = emu.asarray(np.full((m, N), SENTINEL, np.float32))
        f32_op(emu.asarray(xf), w, y, m, **call)
        y16 = emu.asarray(np.full((m, N), sentinel, y16_op.y_dtype))
        y16_op(emu.asarray(x16), w, y16, m, **call)
        np.testing.assert_array_equal(emu.to_numpy(y16), _bits(emu.to_numpy(y), wkind), err_msg=f"m={m} {cfg}")
    with pytest.raises(TypeError, match=r"^y must have dtype"):
        y16_op(emu.asarray(x16), w, emu.zeros((m, N), np.float32), m)


def test_y16_bad_arguments(emu):
    for epilogue in ("residual", "argmax"):
        with pytest.raises(ValueError, match="y16"):
            Gemm(emu, N, K, "bf16", epilogue=epilogue, path="stream", x_split=False, y16=True, logits=False)
    with pytest.raises(ValueError, match="y16"):
        Gemm(emu, N, K, "bf16", path="fma", y16=True)
    with pytest.raises(TypeError, match="y16"):
        Gemm(emu, N, K, "bf16", path="stream", y16="yes")
