"""The wgmma GEMM (cuda_src/gemm_wgmma.cu): one more launch configuration of the stream path
("wg64" / "wg128", planned by ops/gemm_stream.plan_wgmma), for many rows.

Against gemm_reference with the "f32" tolerance: every weight dtype, epilogue, variant and
activation rounding at awkward M / N / K, split K (uneven slices, in place, repeats bit for
bit, counters reset), padding rows, tile_live and the folded RMSNorm. On the emulator each
wgmma k16 instruction covers the same K values as gemm_stream.cu's mma.sync of the same
step (the same permutation) and both round once per instruction, so the two kernels agree
bit for bit there: a layout or permutation slip shows as an exact mismatch even where it
would hide inside the tolerance. (On a GPU the tensor cores' internal order is theirs: the
tolerance holds, the bits need not.)"""
import numpy as np
import pytest

from dflash_cupy.ops import gemm_stream as gs
from dflash_cupy.ops.gemm import Gemm, gemm_reference
from tests.support.gemm import SENTINEL, by_field, counters_zero, host_weights, live_rows, no_rope, run, tile_flags
from tests.support.tolerances import assert_close

MAX_M = 200


def _one_input(sk, x, m):
    """The trailing two-input / ln_lo arguments of a launch reading every row from x."""
    return (x, np.int32(m), sk._ws, np.int32(0))


def _gemm(backend, N, K, epilogue="none", wkind="bf16", **kw):
    return Gemm(backend, N, K, wkind, epilogue=epilogue, max_m=MAX_M, path="stream", **kw)


@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
@pytest.mark.parametrize("wkind", ["f16", "bf16"])
def test_dtypes_epilogues_variants(backend, rng, wkind, epilogue):
    # N=300: a partial last column group (warpgroups and sets with no valid row); K=520: a
    # 64-wide step with 8 values inside K. m: one row, a partial block, two and three blocks.
    for m, variant, x_split in ((1, "wg64", True), (19, "wg128", False), (65, "wg64", False),
                                (130, "wg128", True), (150, "wg64", True)):
        op = run(backend, rng, N=300, K=520, wkind=wkind, epilogue=epilogue, m=m, max_m=MAX_M, x_rows=m + 3,
                 path="stream", x_split=x_split, config=(variant, 1))
        p = op._stream.plan(m)
        assert p.mt == variant and p.mblocks == -(-m // gs.wg_tokens(variant)) and p.threads == 256


@pytest.mark.parametrize("wkind,epilogue,K", [("bf16", "none", 40), ("f16", "silu_mul", 8),
                                              ("bf16", "residual", 136)])
def test_short_k_and_tails(backend, rng, wkind, epilogue, K):
    for m in (3, 70):
        run(backend, rng, N=37, K=K, wkind=wkind, epilogue=epilogue, m=m, max_m=MAX_M, path="stream",
            config=("wg64", 1))


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_bit_identical_to_the_mma_sync_kernel_on_the_emulator(emu, rng, epilogue, norm):
    """Same K grouping per instruction, one rounding each, and (folded RMSNorm) the row sums
    of squares in gemm_stream.cu's order: the emulated wgmma kernel equals gemm_stream.cu's
    64-row variant exactly (both roundings, split K too)."""
    N, K, m = 200, 456, 100
    nw = 2 if epilogue == "silu_mul" else 1
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, nw * N, K, "bf16")
    rh = rng.standard_normal((m, N)).astype(np.float32) if epilogue == "residual" else None
    ln_h = rng.uniform(0.5, 1.5, K).astype(np.float32)
    x, w, ln = emu.asarray(xh), emu.asarray(wh), emu.asarray(ln_h)
    for x_split in (True, False):
        for ks in (1, 2):
            outs = {}
            for cfg in ((4, ks), ("wg128", ks), ("wg64", ks)):
                op = _gemm(emu, N, K, epilogue, x_split=x_split, norm_eps=1e-6 if norm else None)
                op.use_config(m, cfg)
                y = emu.zeros((m, N), np.float32)
                op(x, w, y, m, residual=None if rh is None else emu.asarray(rh), norm=(ln, 7) if norm else None)
                outs[cfg] = emu.to_numpy(y)
            ref = gemm_reference(xh, wh, epilogue, rh, x_round=op.x_round, norm=(ln_h, 1e-6, 7) if norm else None)
            assert_close(outs[(4, ks)], ref, "f32", "mma.sync")
            for cfg in (("wg128", ks), ("wg64", ks)):
                np.testing.assert_array_equal(outs[cfg], outs[(4, ks)], err_msg=f"{cfg} x_split={x_split}")


@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_split_k(backend, rng, epilogue):
    # K=840: 3 slices of 320, 320, 200 (uneven); in place for residual; repeats bit for bit
    N, K = 260, 840
    for m, variant in ((70, "wg128"), (150, "wg64")):
        for in_place in (False, True):
            op = run(backend, rng, N=N, K=K, wkind="bf16", epilogue=epilogue, m=m, max_m=MAX_M, x_rows=m + 1,
                     path="stream", config=(variant, 3), in_place=in_place and epilogue == "residual")
            assert op._stream.plan(m).ks == 3
        counters_zero(backend, op)
    op = _gemm(backend, N, K, epilogue)
    op.use_config(130, ("wg128", 4))
    xh = rng.standard_normal((130, K)).astype(np.float32)
    w = backend.asarray(host_weights(rng, (2 if epilogue == "silu_mul" else 1) * N, K, "bf16"))
    r = backend.asarray(rng.standard_normal((130, N)).astype(np.float32)) if epilogue == "residual" else None
    outs = []
    for _ in range(3):
        y = backend.zeros((130, N), np.float32)
        op(backend.asarray(xh), w, y, 130, residual=r)
        outs.append(backend.to_numpy(y))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("k_split", [None, 3])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_tile_live_and_padding(backend, rng, epilogue, k_split):
    """Dead 16-row tiles keep the sentinel bit for bit (a wholly dead 128-row block exits);
    padding rows (NaN in x: never read) are the epilogue of 0."""
    N, K, m = 70, 840, 290
    nw = 2 if epilogue == "silu_mul" else 1
    op = _gemm(backend, N, K, epilogue)
    op.use_config(m, ("wg128", k_split or 1))
    wh = host_weights(rng, nw * N, K, "bf16")
    flags = tile_flags(rng, m)
    flags[:8] = 0                   # block 0 (rows 0..127) all dead
    flags[8] = 1                    # block 1 live, with padding rows [lo, hi) inside it
    live = live_rows(flags, m)
    lo, hi = 133, 160
    xh = rng.standard_normal((m, K)).astype(np.float32)
    xh[~live] = np.nan
    xh[lo:hi] = np.nan
    rh = rng.standard_normal((m, N)).astype(np.float32) if epilogue == "residual" else None
    y = backend.asarray(np.full((m, N), SENTINEL, np.float32))
    op(backend.asarray(xh), backend.asarray(wh), y, m, residual=None if rh is None else backend.asarray(rh),
       tile_live=backend.asarray(flags), pad_rows=(backend.asarray(np.array([lo], np.int32)), hi))
    got = backend.to_numpy(y)
    xz = np.where(live[:, None], xh, 0).astype(np.float32)
    xz[lo:hi] = 0
    ref = gemm_reference(xz, wh, epilogue, rh, x_round=op.x_round)
    assert_close(got[live], ref[live], "f32", f"{op!r} flags={flags.tolist()}")
    assert (got[~live].view(np.uint32) == SENTINEL.view(np.uint32)).all()
    counters_zero(backend, op)


@pytest.mark.parametrize("k_split", [None, 3])
@pytest.mark.parametrize("epilogue", ["none", "silu_mul"])
def test_folded_rmsnorm(backend, rng, epilogue, k_split):
    """Rows >= norm_lo normalised inside the GEMM (the row sums of squares in a fixed order:
    bit-identical repeats), x unchanged; a negative control without the norm."""
    N, K = 260, 840
    nw = 2 if epilogue == "silu_mul" else 1
    op = _gemm(backend, N, K, epilogue, norm_eps=1e-6)
    wh = host_weights(rng, nw * N, K, "bf16")
    ln_h = (1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    w, ln = backend.asarray(wh), backend.asarray(ln_h)
    for m, norm_lo, variant in ((70, 5, "wg128"), (150, 64, "wg64"), (3, 3, "wg64")):
        op.use_config(m, (variant, k_split or 1))
        xh = rng.standard_normal((m, K)).astype(np.float32)
        xh[norm_lo:] *= rng.uniform(0.01, 30, (m - norm_lo, 1)).astype(np.float32)
        x = backend.asarray(xh)
        outs = []
        for _ in range(2):
            y = backend.zeros((m, N), np.float32)
            op(x, w, y, m, norm=(ln, norm_lo))
            outs.append(backend.to_numpy(y))
        ref = gemm_reference(xh, wh, epilogue, x_round=op.x_round, norm=(ln_h, 1e-6, norm_lo))
        assert_close(outs[0], ref, "f32", f"{op!r} m={m} norm_lo={norm_lo}")
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(backend.to_numpy(x), xh)
        if norm_lo < m:
            plain = gemm_reference(xh, wh, epilogue, x_round=op.x_round)
            assert not np.allclose(plain[norm_lo:], ref[norm_lo:], rtol=1e-2, atol=1e-2)


# ---- planning and selection (host only) ------------------------------------------

def test_default_rule_and_where_wgmma_is_compiled(emu):
    op = _gemm(emu, 4096, 4096)
    assert op._stream.wg_variants == gs.WG_VARIANTS
    assert op.config(48)[0] == 4 and op.config(gs.WG_MIN_M)[0] == "wg64" and op.config(64)[0] == "wg64"
    assert op.config(65)[0] == "wg128" and op.config(352)[0] == "wg128"
    cands = op.launch_candidates(256)
    assert ("wg128", 1) in cands and ("wg64", 1) in cands and (4, 1) in cands
    assert all(gs.plan_wgmma(4096, 4096, 256, ks=k, variant=v).kz >= gs.MIN_K_SLICE
               for v, k in cands if isinstance(v, str) and k > 1)
    # compiled where the default rule uses them: none below WG_MIN_M rows, "wg64" alone up to
    # 64, both beyond; never for the fused argmax (it reduces within a block)
    assert Gemm(emu, 64, 64, "bf16", max_m=48, path="stream")._stream.wg_variants == ()
    g64 = Gemm(emu, 64, 64, "bf16", max_m=64, path="stream")
    assert g64._stream.wg_variants == ("wg64",) and g64.config(64)[0] == "wg64" and g64.config(100)[0] == "wg64"
    assert Gemm(emu, 64, 64, "bf16", "argmax", max_m=256, path="stream")._stream.wg_variants == ()
    assert Gemm(emu, 64, 64, "bf16", max_m=16, path="stream", wgmma=True)._stream.wg_variants == gs.WG_VARIANTS
    assert Gemm(emu, 64, 64, "bf16", max_m=256, path="stream", wgmma=False)._stream.wg_variants == ()
    with pytest.raises(ValueError, match="argmax"):
        Gemm(emu, 64, 64, "bf16", "argmax", max_m=256, path="stream", wgmma=True)
    with pytest.raises(TypeError, match="wgmma must be"):
        Gemm(emu, 64, 64, "bf16", path="stream", wgmma=1)
    with pytest.raises(ValueError, match="wgmma=True needs path 'stream'"):
        Gemm(emu, 64, 64, "bf16", path="fma", wgmma=True)
    with pytest.raises(ValueError, match="not a launch configuration"):
        op.use_config(256, ("wg96", 1))


def test_wgmma_defaults_follow_the_selfcheck_verdict(emu, monkeypatch, tmp_path):
    """wgmma_verified is the device self-check's gemm.wgmma verdict (dflash_cupy/selfcheck.py,
    which compares the kernel with the NumPy reference): trusted where none is known (the
    emulator runs no check by itself), and a verdict that failed it keeps every default on
    mma.sync with one RuntimeWarning per process."""
    from dflash_cupy import selfcheck_verdict as sv
    monkeypatch.setenv(sv.ENV_CACHE, str(tmp_path / "verdicts.json"))
    monkeypatch.delenv(sv.ENV_MODE, raising=False)
    sv.forget()
    try:
        assert gs.wgmma_verified(emu) is True
        status = {v: "pass" for v in sv.VARIANTS}
        status["gemm.wgmma"] = "fail"
        bad = sv.Check("gemm.wgmma", "bf16 none m=100 wg128", False, 0.31, "f32")
        sv.store(sv.Report(device=sv.device_identity(emu), status=status, checks=[bad]))
        sv.forget()                                   # read back from the file, as a new process would
        with pytest.warns(RuntimeWarning, match=r"gemm\.wgmma .* worst error 0\.31 .* using gemm\.stream"):
            assert gs.wgmma_verified(emu) is False
        assert Gemm(emu, 64, 64, "bf16", max_m=256, path="stream")._stream.wg_variants == ()
        monkeypatch.setenv(sv.ENV_MODE, "off")        # off: every variant trusted
        assert gs.wgmma_verified(emu) is True
    finally:
        sv.forget()


def test_plan_fills_the_sms_in_whole_waves():
    # the split fills the device when the column groups and row blocks alone leave SMs idle;
    # the SM count is a parameter, never assumed
    for dev in (gs.H200, gs.Device(78, 232448), gs.Device(114, 232448)):
        for N, K, nw, m in ((4096, 4096, 1, 256), (4096, 12288, 1, 352), (12288, 4096, 2, 256),
                            (6144, 4096, 1, 64)):
            p = gs.plan_wgmma(N, K, m, nw, dev=dev)
            blocks = p.grid[0] * p.ks
            eff = blocks / (-(-blocks // dev.sm_count) * dev.sm_count)
            assert p.kz >= gs.MIN_K_SLICE and eff >= 0.6, (dev, N, K, m, p, eff)
            assert p.kz * p.ks >= K > p.kz * (p.ks - 1)
    a = gs.plan_wgmma(4096, 4096, 256, dev=gs.H200)
    assert a.grid[0] == 16 * 2 and a.ks == 4            # 32 blocks -> 128 with 4 slices
    assert gs.plan_wgmma(4096, 4096, 256, dev=gs.Device(78, 232448)).ks != a.ks


@pytest.mark.slow
def test_ptxas_registers_within_the_table():
    from tests.support.nvrtc_check import nvrtc_check
    src = gs.kernels.source_path("gemm_wgmma.cu")
    for bt in (64, 128):
        for epi, norm, split in ((0, 0, 2), (2, 1, 1), (1, 0, 1), (2, 0, 2), (0, 1, 2), (3, 1, 2), (3, 0, 1)):
            for lanes in ({}, {"GW_SMS": 132, "GW_SKIP_COLS": 4096 if epi in (0, 3) else 0}):   # live split
                qkv = dict(GW_HD=128, GW_QW=4096, GW_KVW=1024) if epi == 3 else {}   # the fused qkv epilogue
                opts = tuple(gs.kernels.compile_options(GW_WTYPE=2, GW_EPI=epi, GW_K=4096, GW_BT=bt, GW_SPLIT=split,
                                                        GW_DEPTH=gs.WG_DEPTH[bt], **({"GW_NORM": 1} if norm else {}),
                                                        **lanes, **qkv))[1:]
                info = nvrtc_check(src.read_text(), str(src), "sm_90a", opts)["gemm_wgmma"]
                assert info["registers"] <= gs.WG_PTXAS_REGS[bt] and info["spill_stores"] == 0, (bt, epi, lanes, info)


def test_emulator_counts_match_the_static_model(emu, rng):
    """One launch counted by the emulator (every block) against profiling/counters.py's
    static estimate of the same launch: wgmma work and B bytes, barriers and the shared
    stores exactly; every weight byte requested once per row block; the staging stores
    conflict-free; global sectors within 2%."""
    from dflash_cupy.emu.counting import count_launch
    from profiling import counters as ctr
    from profiling.step_trace import RecordingBackend

    N, K, m = 300, 520, 150
    rec = RecordingBackend()
    g = Gemm(rec, N, K, "bf16", max_m=MAX_M, path="stream", x_split=False)
    g.use_config(m, ("wg128", 2))
    xr, yr, wr = rec.empty((m, K), np.float32), rec.empty((m, N), np.float32), rec.empty((N, K), np.uint16)
    g(xr, wr, yr, m)
    st = ctr.static_counters(rec.eager[-1])

    op = _gemm(emu, N, K, x_split=False)
    op.use_config(m, ("wg128", 2))
    sk = op._stream
    p = sk.plan(m)
    x = emu.asarray(rng.standard_normal((m, K)).astype(np.float32))
    w = emu.asarray(host_weights(rng, N, K, "bf16"))
    y = emu.zeros((m, N), np.float32)
    args = (x, w, y, y, np.int32(m), np.int32(N), np.int32(p.kz), np.int32(p.kt), sk._ws, sk._counters,
            sk._counters, np.int32(0), x, np.float32(0), np.int32(m), sk._counters, np.int32(0)) + no_rope(sk) + _one_input(sk, x, m)
    c = count_launch(sk._kernels[p.mt], p.grid, (p.threads, 1, 1), by_field(sk._kernels[p.mt], args), p.smem)
    assert c.wgmma_mma == st.wgmma_mma > 0 and c.wgmma_smem_bytes == st.wgmma_smem_bytes
    assert c.barriers == st.barriers
    assert c.sst_requests == st.smem_requests and c.sst_wavefronts == c.sst_ideal == st.smem_wavefronts
    wc = c.arrays["w"]
    assert wc.read == p.mblocks * N * K * 2 and wc.read_distinct == N * K * 2   # once per row block
    assert abs(c.gld_sectors - st.gld_sectors) <= 0.02 * st.gld_sectors, (c.gld_sectors, st.gld_sectors)


@pytest.mark.parametrize("variant,x_split", [("wg64", True), ("wg128", False)])
def test_folded_norm_shared_memory_is_conflict_free(emu, rng, variant, x_split):
    """The folded RMSNorm's per-row partial sums live in shared memory, read and written by
    every staging item of every 64-k step: swizzled, every shared load and store of the
    launch takes the minimum wavefronts (unswizzled they were 8-way conflicted)."""
    from dflash_cupy.emu.counting import count_launch

    N, K, m = 300, 520, 150
    op = _gemm(emu, N, K, x_split=x_split, norm_eps=1e-6)
    op.use_config(m, (variant, 1))
    sk = op._stream
    p = sk.plan(m)
    x = emu.asarray(rng.standard_normal((m, K)).astype(np.float32))
    w = emu.asarray(host_weights(rng, N, K, "bf16"))
    ln = emu.asarray((1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32))
    y = emu.zeros((m, N), np.float32)
    args = (x, w, y, y, np.int32(m), np.int32(N), np.int32(p.kz), np.int32(p.kt), sk._ws, sk._counters,
            sk._counters, np.int32(0), ln, np.float32(1e-6), np.int32(0), sk._counters, np.int32(0)) + no_rope(sk) + _one_input(sk, x, m)
    c = count_launch(sk._kernels[p.mt], p.grid, (p.threads, 1, 1), by_field(sk._kernels[p.mt], args), p.smem)
    assert c.sld_requests > 0 and c.sld_wavefronts == c.sld_ideal, (c.sld_wavefronts, c.sld_ideal)
    assert c.sst_wavefronts == c.sst_ideal, (c.sst_wavefronts, c.sst_ideal)


def test_chunks_without_a_computed_tile_issue_no_wgmma(emu, rng):
    """The wgmmas run per 32 rows of x: a chunk whose 16-row tiles are dead (tile_live) or
    padding issues none. Emulator counts against the static model's, with the flags known,
    and the outputs still right (dead rows untouched)."""
    from dflash_cupy.emu.counting import count_launch
    from profiling import counters as ctr
    from profiling.step_trace import RecordingBackend

    N, K, m = 256, 256, 150
    flags = np.array([1, 0, 0, 0, 0, 0, 1, 1, 0, 1], np.int32)   # chunks: 0 and 3 of block 0, 0 of block 1
    live = live_rows(flags, m)
    rec = RecordingBackend()
    g = Gemm(rec, N, K, "bf16", max_m=MAX_M, path="stream")
    g(rec.empty((m, K), np.float32), rec.empty((N, K), np.uint16), rec.empty((m, N), np.float32), m,
      tile_live=rec.asarray(flags))
    L = rec.eager[-1]
    assert L.kernel == "gemm_wgmma"
    every = ctr.static_counters(L)
    L.known["tile_live"] = tuple(bool(f) for f in flags)
    st = ctr.static_counters(L)
    assert st.wgmma_mma * 5 == every.wgmma_mma * 3   # 3 of the 5 chunks holding a row < m (4 + 1)

    op = _gemm(emu, N, K)
    sk = op._stream
    p = sk.plan(m)
    xh = rng.standard_normal((m, K)).astype(np.float32)
    xh[~live] = np.nan
    wh = host_weights(rng, N, K, "bf16")
    y = emu.asarray(np.full((m, N), SENTINEL, np.float32))
    x, w, fl = emu.asarray(xh), emu.asarray(wh), emu.asarray(flags)
    args = (x, w, y, y, np.int32(m), np.int32(N), np.int32(p.kz), np.int32(p.kt), sk._ws, sk._counters,
            sk._counters, np.int32(0), x, np.float32(0), np.int32(m), fl, np.int32(1)) + no_rope(sk) + _one_input(sk, x, m)
    c = count_launch(sk._kernels[p.mt], p.grid, (p.threads, 1, 1), by_field(sk._kernels[p.mt], args), p.smem)
    assert c.wgmma_mma == st.wgmma_mma
    got = emu.to_numpy(y)
    ref = gemm_reference(np.where(live[:, None], xh, 0).astype(np.float32), wh, x_round=op.x_round)
    assert_close(got[live], ref[live], "f32", "chunks")
    assert (got[~live].view(np.uint32) == SENTINEL.view(np.uint32)).all()


# ---- lane batches: the K split chosen per launch from tile_live, and tiles marked 2 ---------

SMS_SMALL = 8   # a small device, so that a few live tiles already pick different K splits


def _live_tiles(flags, BT: int, groups: int, qg: int) -> list:
    """Working (column group, row block) pairs of a live-split launch, in block order (their
    workspace slots): ``flags`` the tile_live entries of its ``ceil(m/16)`` tiles (0 dead,
    2 needs only the column groups >= ``qg``, else live)."""
    tb = -(-len(flags) // (BT // 16))
    out = []
    for cg in range(groups):
        for b in range(tb):
            t = flags[b * BT // 16:(b + 1) * BT // 16]
            if any(v != 0 and (v != 2 or cg >= qg) for v in t):
                out.append((cg, b))
    return out


def _small_device(monkeypatch):
    monkeypatch.setattr(gs, "device_of", lambda backend: gs.Device(SMS_SMALL, 232448))


def _flag_sets(rng, n_tiles):
    """tile_live patterns: every tile live, one live tile, context tiles (2) only, and random
    mixes of 0 / 1 / 2 (the lane batch's dead, noise and context tiles)."""
    sets = [np.ones(n_tiles, np.int32), np.eye(1, n_tiles, n_tiles - 1, dtype=np.int32)[0],
            np.full(n_tiles, 2, np.int32)]
    for _ in range(3):
        sets.append(rng.choice([0, 1, 2], n_tiles, p=[0.4, 0.3, 0.3]).astype(np.int32))
    return sets


@pytest.mark.parametrize("variant", ["wg64", "wg128"])
@pytest.mark.parametrize("epilogue,norm", [("none", True), ("residual", False), ("silu_mul", False)])
def test_live_split_equals_the_static_launch_of_its_split(backend, rng, monkeypatch, variant, epilogue, norm):
    """With ``live_split`` the kernel finds the working tiles in tile_live and picks its K
    split as ``gemm_stream.wg_live_split`` says: every output equals, bit for bit, the static
    launch forced to that split (same slices, same z order), rows marked 2 skip the column
    groups below skip_cols (sentinel kept), dead tiles keep the sentinel, the counters end at
    0 and a repeat gives the same bits. The patterns pick at least two different splits."""
    _small_device(monkeypatch)
    nw = 2 if epilogue == "silu_mul" else 1
    cols = gs.wg_cols(nw)
    N, K, m = 600 // nw, 840, 150    # 3 column groups (the first below skip_cols), K split <= 4
    skip = 300 // nw                 # whole groups below it: the first (cols [0, cols))
    eps = 1e-6 if norm else None
    live_op = _gemm(backend, N, K, epilogue, x_split=False, norm_eps=eps, skip_cols=skip, live_split=True)
    stat_op = _gemm(backend, N, K, epilogue, x_split=False, norm_eps=eps)
    live_op.use_config(m, (variant, gs.wg_split_cap(K)))
    bt = gs.wg_tokens(variant)
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, nw * N, K, "bf16")
    rh = rng.standard_normal((m, N)).astype(np.float32) if epilogue == "residual" else None
    ln_h = rng.uniform(0.5, 1.5, K).astype(np.float32)
    x, w, ln = backend.asarray(xh), backend.asarray(wh), backend.asarray(ln_h)
    r = None if rh is None else backend.asarray(rh)
    norm_arg = (ln, 5) if norm else None
    groups, qg = gs.groups_wg(N, nw), skip // cols
    seen = set()
    for flags in _flag_sets(rng, -(-m // 16)):
        n_live = len(_live_tiles(flags.tolist(), bt, groups, qg))
        ks = gs.wg_live_split(n_live, K, gs.wg_split_cap(K), SMS_SMALL)
        seen.add(ks)
        fl = backend.asarray(flags)
        outs = []
        for _ in range(2):
            y = backend.asarray(np.full((m, N), SENTINEL, np.float32))
            live_op(x, w, y, m, residual=r, norm=norm_arg, tile_live=fl)
            outs.append(backend.to_numpy(y))
            counters_zero(backend, live_op)
        np.testing.assert_array_equal(outs[0], outs[1], err_msg="repeat")
        stat_op.use_config(m, (variant, ks))
        ys = backend.asarray(np.full((m, N), SENTINEL, np.float32))
        stat_op(x, w, ys, m, residual=r, norm=norm_arg, tile_live=fl)
        want = backend.to_numpy(ys)
        ctx = np.repeat(flags == 2, 16)[:m]
        want[np.ix_(ctx, np.arange(N) < qg * cols)] = SENTINEL      # the skipped Q columns
        np.testing.assert_array_equal(outs[0], want, err_msg=f"flags={flags.tolist()} ks={ks}")
        live = live_rows(flags, m)
        ref = gemm_reference(xh, wh, epilogue, rh, x_round=live_op.x_round,
                             norm=(ln_h, 1e-6, 5) if norm else None)
        assert_close(outs[0][live][:, qg * cols:], ref[live][:, qg * cols:], "f32", f"flags={flags.tolist()}")
    assert len(seen) >= 2, seen


def test_live_split_rule_matches_the_static_plan():
    """All tiles live, the per-launch rule picks what plan_wgmma plans for the same blocks;
    the workspace bound covers every pattern's working blocks x their split."""
    for N, K, m, nw in ((6144, 4096, 1024, 1), (4096, 12288, 256, 1), (12288, 4096, 256, 2), (300, 840, 150, 1)):
        for v in gs.WG_VARIANTS:
            p = gs.plan_wgmma(N, K, m, nw, 1, variant=v)
            n = p.grid[0]
            assert gs.wg_live_split(n, K, gs.MAX_K_SPLIT, gs.H200.sm_count) == p.ks, (N, K, m, v)
            tb = -(-m // gs.wg_tokens(v))
            slots = gs.wg_live_slots(gs.groups_wg(N, nw), tb, 0, K, gs.wg_split_cap(K), gs.H200.sm_count)
            assert slots >= n * p.ks or p.ks > gs.wg_split_cap(K)


def test_live_split_counts_match_the_static_model(emu, rng, monkeypatch):
    """A live-split launch (the tile loop over fewer resident blocks than items) counted by the
    emulator against profiling/counters.py with the flags known: wgmma work and barriers."""
    from dflash_cupy.emu.counting import count_launch
    from profiling import counters as ctr
    from profiling.step_trace import RecordingBackend

    monkeypatch.setattr(gs, "device_of", lambda backend: gs.Device(4, 232448))
    N, K, m = 600, 840, 150
    # row block 0 (wg128): context tiles only -> column groups 1, 2; row block 1: all 3 groups
    flags = np.array([2, 2, 0, 0, 0, 0, 0, 0, 1, 1], np.int32)
    rec = RecordingBackend()
    g = Gemm(rec, N, K, "bf16", max_m=MAX_M, path="stream", x_split=False, skip_cols=256, live_split=True)
    g(rec.empty((m, K), np.float32), rec.empty((N, K), np.uint16), rec.empty((m, N), np.float32), m,
      tile_live=rec.asarray(flags))
    L = rec.eager[-1]
    L.known["tile_live"] = tuple(int(f) for f in flags)
    st = ctr.static_counters(L)

    op = _gemm(emu, N, K, x_split=False, skip_cols=256, live_split=True)
    y = emu.zeros((m, N), np.float32)
    x = emu.asarray(rng.standard_normal((m, K)).astype(np.float32))
    w = emu.asarray(host_weights(rng, N, K, "bf16"))
    sk = op._stream
    op(x, w, y, m, tile_live=emu.asarray(flags))    # warm: compiled, same launch as recorded
    assert tuple(L.grid) == (4, 1, 1)               # one block per SM of the 4
    args = (x, w, y, y, np.int32(m), np.int32(N), np.int32(L.arg("kz")), np.int32(L.arg("kt")), sk._ws,
            sk._counters, sk._counters, np.int32(0), x, np.float32(0), np.int32(m), emu.asarray(flags), np.int32(1)) \
        + no_rope(sk) + _one_input(sk, x, m)
    c = count_launch(sk._kernels["wg128"], L.grid, (256, 1, 1), by_field(sk._kernels["wg128"], args), L.shared_mem)
    assert c.wgmma_mma == st.wgmma_mma > 0 and c.barriers == st.barriers
    assert st.live_blocks == 5          # 5 working tiles, unsplit: 2 waves of 4 beat 3 waves of 4 split
    assert any("K split 1" in n and "5 items over 4" in n for n in st.notes), st.notes
    got = emu.to_numpy(y)
    assert (got[:32, :256] == 0).all() and (got[:32, 256:] != 0).all() and (got[128:] != 0).all()


def test_live_split_bad_input(backend):
    with pytest.raises(ValueError, match="skip_cols"):
        _gemm(backend, 300, 840, skip_cols=301)
    with pytest.raises(ValueError, match="skip_cols"):
        _gemm(backend, 300, 840, skip_cols=-1)
    with pytest.raises(TypeError, match="live_split"):
        _gemm(backend, 300, 840, live_split=1)
    op = _gemm(backend, 300, 840, live_split=True)
    m = MAX_M
    op._stream._ws = backend.zeros((1,), np.float32)   # as if sized for fewer working tiles
    x, y = backend.zeros((m, 840), np.float32), backend.zeros((m, 300), np.float32)
    w = backend.zeros((300, 840), np.uint16)
    with pytest.raises(ValueError, match="live-split launch"):
        op(x, w, y, m, tile_live=backend.asarray(np.ones(-(-m // 16), np.int32)))
