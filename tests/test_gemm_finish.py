"""The finish convolution fused into a residual GEMM's epilogue (gemm_stream.cu's GS_FIN,
cuda_src/gemm_fin.cuh): bit for bit the plain GEMM followed by ``GroupedConv``'s finish (half 1,
residual added), against the NumPy reference, at awkward sizes; refusals. Every case shares
K = 128 and max_m = 32 (the M variants 1 and 2), so the emulator compiles few variants."""
import numpy as np
import pytest

from dflash_cupy.ops import gemm_stream as gs
from dflash_cupy.ops.conv import GroupedConv, grouped_conv_reference
from dflash_cupy.ops.gemm import Gemm
from dflash_cupy.tolerances import assert_close

K, MAX_M = 128, 32


def _case(rng, rows, H, taps, group):
    G = H // group
    x = rng.standard_normal((rows, K)).astype(np.float32)
    w = (rng.standard_normal((H, K)) / np.sqrt(K)).astype(np.float16)
    base = rng.standard_normal((taps, H)).astype(np.float32)
    d = rng.standard_normal((rows, 2 * taps * G)).astype(np.float32)
    res = rng.standard_normal((rows, H)).astype(np.float32)
    return x, w, base, d, res


def _run(be, rows, lane_rows, H, taps, group, k_split, rng, tile_live=None, in_place=False):
    """The fused call and the two-launch path on the same inputs: (inputs, y, y_plain, product)."""
    x, w, base, d, res = _case(rng, rows, H, taps, group)
    kw = dict(max_m=MAX_M, k_split=k_split, wgmma=False, x_split=True)
    fused = Gemm(be, H, K, np.float16, "residual", finish=(taps, group), **kw)
    plain = Gemm(be, H, K, np.float16, **kw)
    assert fused.fuses_finish(rows, lane_rows)
    assert fused.config(rows) == plain.config(rows) and fused.config(rows)[1] == k_split
    xd, wd, bd, dd = be.asarray(x), be.asarray(w), be.asarray(base), be.asarray(d)
    live = None if tile_live is None else be.asarray(np.asarray(tile_live, np.int32))
    y = be.asarray(res.copy())
    r = y if in_place else be.asarray(res)
    if not in_place:
        y = be.asarray(np.full((rows, H), 7.0, np.float32))
    fused(xd, wd, y, rows, residual=r, tile_live=live, finish=(bd, dd, lane_rows))
    p = be.asarray(np.full((rows, H), 5.0, np.float32))
    plain(xd, wd, p, rows, tile_live=live)
    y2 = be.asarray(res.copy())
    r2 = y2 if in_place else be.asarray(res)
    if not in_place:
        y2 = be.asarray(np.full((rows, H), 7.0, np.float32))
    GroupedConv(be, H, taps, group, layout="group")(p, bd, dd, 1, y2, residual=r2, lane_rows=lane_rows,
                                                     tile_live=live)
    return (x, w, base, d, res), be.to_numpy(y), be.to_numpy(y2), be.to_numpy(p)


@pytest.mark.parametrize("rows,lane_rows,H,taps,group,k_split", [
    (1, 1, 544, 2, 16, 1),       # one row: tap 0 only; H over three column blocks, the last partial
    (3, 3, 288, 3, 8, 2),        # 3 taps, split K
    (19, 19, 544, 2, 16, 2),     # two 16-row tiles, the second partial; split K
    (20, 5, 544, 2, 16, 1),      # lanes of 5 rows straddling the 16-row tiles
    (32, 16, 288, 4, 8, 1),      # 4 taps, two lanes
    (32, 16, 288, 4, 8, 2),
    (19, 19, 288, 3, 8, 1),
    (48, 16, 288, 3, 8, 1),      # two row blocks of 32: lanes of 16 inside them
    (48, 16, 544, 2, 16, 2),
    (19, 19, 288, 6, 8, 1),      # 6 taps: the taps before a batch reach past the previous batch
    (20, 5, 288, 2, 2, 2),       # group 2: one channel per thread (no 16-byte chunks)
])
def test_fused_finish_is_gemm_then_conv(emu, rng, rows, lane_rows, H, taps, group, k_split):
    (x, w, base, d, res), y, y2, p = _run(emu, rows, lane_rows, H, taps, group, k_split, rng)
    np.testing.assert_array_equal(y, y2)
    assert_close(y, grouped_conv_reference(p, base, d, 1, group, residual=res, lane_rows=lane_rows,
                                           layout="group"), "f32", "fused finish")


def test_fused_finish_in_place_and_dead_tiles(emu, rng):
    """y is the residual itself; the dead tile's rows stay as they were, and lane 1's first row
    takes no tap from lane 0's last."""
    rows, H, taps, group = 32, 544, 2, 16
    for k_split in (1, 2):
        (x, w, base, d, res), y, y2, p = _run(emu, rows, 16, H, taps, group, k_split, rng, in_place=True)
        np.testing.assert_array_equal(y, y2)
        G = H // group
        dcol = d[16, (np.arange(H) // group) * 2 * taps + taps]
        np.testing.assert_array_equal(y[16], res[16] + np.float32(base[0] + dcol) * p[16])
        (x, w, base, d, res), y, y2, p = _run(emu, rows, 16, H, taps, group, k_split, rng, tile_live=[0, 1],
                                              in_place=True)
        np.testing.assert_array_equal(y[:16], res[:16])       # the dead tile untouched
        np.testing.assert_array_equal(y, y2)
        ref = grouped_conv_reference(p, base, d, 1, group, residual=res, lane_rows=16, layout="group")
        assert_close(y[16:], ref[16:], "f32", "live lane")
        assert G == 34


def test_fuses_finish_only_where_lane_blocks_stay_in_a_row_block(emu):
    be = emu
    g = Gemm(be, 544, K, np.float16, "residual", max_m=MAX_M, wgmma=False, finish=(2, 16))
    assert g.fuses_finish(32, 16) and g.fuses_finish(20, 5) and g.fuses_finish(19)
    # 48 rows run two 32-row blocks: lanes of 16 fit them, lanes of 24 straddle
    assert g.fuses_finish(48, 16) and not g.fuses_finish(48, 24)
    x, y = be.zeros((48, K), np.float32), be.zeros((48, 544), np.float32)
    fin = (be.zeros((2, 544), np.float32), be.zeros((48, 2 * 2 * 34), np.float32), 24)
    with pytest.raises(ValueError, match="straddle"):
        g(x, be.zeros((544, K), np.float16), y, 48, residual=y, finish=fin)
    # without finish at the call the same object is a plain residual GEMM
    assert not Gemm(be, 544, K, np.float16, "residual", max_m=MAX_M, wgmma=False).fuses_finish(16)


def test_fused_finish_bad_input(emu):
    be = emu
    H, taps, group, m = 544, 2, 16, 16
    dw = 2 * taps * H // group
    with pytest.raises(ValueError, match="epilogue 'residual'"):
        Gemm(be, H, K, np.float16, finish=(taps, group))
    with pytest.raises(ValueError, match="must divide N"):
        Gemm(be, H, K, np.float16, "residual", finish=(taps, 5))
    with pytest.raises(ValueError, match="finish must be"):
        Gemm(be, H, K, np.float16, "residual", finish=(taps,))
    g = Gemm(be, H, K, np.float16, "residual", max_m=MAX_M, wgmma=False, finish=(taps, group))
    x, w = be.zeros((m, K), np.float32), be.zeros((H, K), np.float16)
    y = be.asarray(np.full((m, H), 3.0, np.float32))
    base, d = be.zeros((taps, H), np.float32), be.zeros((m, dw), np.float32)
    bad = [((be.zeros((taps + 1, H), np.float32), d, m), "finish base must have shape"),
           ((base, be.zeros((m, dw + 4), np.float32), m), "finish d must have shape"),
           ((base, be.zeros((m - 1, dw), np.float32), m), "finish d must have shape"),
           ((base, d.astype(np.float16), m), "finish d"),
           ((base, d, 5), "must divide"),
           ((base, d, 0), "lane_rows"),
           ((base, y.reshape(-1)[:m * dw].reshape(m, dw), m), "must not overlap"),
           ((base, d), "finish must be"),
           ((base, be.zeros((m * dw + 1,), np.float32)[1:].reshape(m, dw), m), "aligned")]
    for fin, msg in bad:
        with pytest.raises((ValueError, TypeError), match=msg):
            g(x, w, y, m, residual=y, finish=fin)
    with pytest.raises(ValueError, match="residual is required"):
        g(x, w, y, m, finish=(base, d, m))
    ln = be.zeros((K,), np.float32)
    for extra, name in ((dict(norm=(ln, 0)), "norm"), (dict(partials=be.zeros((m, 3, 2), np.uint32)), "partials")):
        with pytest.raises(ValueError, match=f"finish does not combine with {name}"):
            g(x, w, y, m, residual=y, finish=(base, d, m), **extra)
    plain = Gemm(be, H, K, np.float16, "residual", max_m=MAX_M, wgmma=False)
    with pytest.raises(ValueError, match="without finish"):
        plain(x, w, y, m, residual=y, finish=(base, d, m))
    assert (be.to_numpy(y) == 3.0).all()   # nothing launched
    assert gs.fin_smem(2) == 32 * (gs.cols_per_block(1) + 8) * 4


@pytest.mark.parametrize("mt", gs.MT_BUCKETS)
def test_finish_variants_fit_the_register_table(mt):
    """The DFlash 2 presets' o and down GEMMs with the finish (hidden 5120 and 6656, hi + lo and
    16-bit x): within ``PTXAS_REGS`` and no spills (nvrtc_check fails on a spill)."""
    from tests.support.nvrtc_check import nvrtc_check
    src = gs.kernels.source_path("gemm_stream.cu")
    for v in (gs.GemmVariant(5120, 4096, "bf16", "residual", finish=(2, 16)),
              gs.GemmVariant(6656, 17920, "bf16", "residual", split=1, x16=True, finish=(2, 16)),
              gs.GemmVariant(288, 128, "f16", "residual", finish=(4, 8))):
        opts = tuple(gs.kernels.compile_options(**v.stream_defines(mt)))[1:]
        info = nvrtc_check(src.read_text(), str(src), "sm_90", opts)["gemm_stream"]
        assert info["registers"] <= gs.PTXAS_REGS[mt] and info["spill_stores"] == 0, (v.key(), mt, info)


@pytest.mark.parametrize("k_split", [1, 2])
def test_finish_gemm_without_finish_is_the_residual_gemm(emu, rng, k_split):
    """A call without ``finish=`` (the step's fallback) is the plain residual GEMM bit for bit,
    split K too (the finish variant reduces through its tile then), dead tiles untouched."""
    be, rows, H = emu, 19, 544
    x, w, base, d, res = _case(rng, rows, H, 2, 16)
    kw = dict(max_m=MAX_M, k_split=k_split, wgmma=False)
    fused = Gemm(be, H, K, np.float16, "residual", finish=(2, 16), **kw)
    plain = Gemm(be, H, K, np.float16, "residual", **kw)
    live = be.asarray(np.asarray([0, 1], np.int32))
    out = []
    for g in (fused, plain):
        y = be.asarray(res.copy())
        g(be.asarray(x), be.asarray(w), y, rows, residual=y, tile_live=live)
        out.append(be.to_numpy(y))
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0][:16], res[:16])
    assert (out[0][16:] != res[16:]).any()
