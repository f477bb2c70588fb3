"""The prepare convolution fused into the kernel_projection GEMM (gemm_stream.cu's GS_CONV,
cuda_src/gemm_conv.cuh): bit for bit the GEMM followed by ``GroupedConv(layout="group")``,
against the NumPy reference, at awkward sizes; the group-major layout against the published one."""
import numpy as np
import pytest

from dflash_cupy.ops import gemm_stream as gs
from dflash_cupy.ops.conv import GroupedConv, d_column, group_major_rows, grouped_conv_reference
from dflash_cupy.ops.gemm import Gemm
from dflash_cupy.tolerances import assert_close


def _case(rng, rows, H, taps, group):
    G = H // group
    N = 2 * taps * G
    x = rng.standard_normal((rows, H)).astype(np.float32)
    w = (rng.standard_normal((N, H)) / np.sqrt(H)).astype(np.float16)
    base = rng.standard_normal((taps, H)).astype(np.float32)
    return x, w, base, G, N


def _run(be, rows, H, taps, group, lane_rows, k_split, rng, tile_live=None, max_m=None):
    """The fused call and the two-launch path on the same inputs: (d, out, d_plain, out_plain)."""
    x, w, base, G, N = _case(rng, rows, H, taps, group)
    wp = w[group_major_rows(taps, G)]
    kw = dict(max_m=max_m or rows, k_split=k_split, wgmma=False, x_split=True)
    fused = Gemm(be, N, H, np.float16, conv=(taps, group), **kw)
    plain = Gemm(be, N, H, np.float16, **kw)
    assert fused.fuses_conv(rows)
    assert fused.config(rows) == plain.config(rows)
    xd, wd, bd = be.asarray(x), be.asarray(wp), be.asarray(base)
    live = None if tile_live is None else be.asarray(np.asarray(tile_live, np.int32))
    d = be.asarray(np.full((rows, N), 5.0, np.float32))
    out = be.asarray(np.full((rows, H), 7.0, np.float32))
    fused(xd, wd, d, rows, tile_live=live, conv=(bd, out, lane_rows))
    d2 = be.asarray(np.full((rows, N), 5.0, np.float32))
    out2 = be.asarray(np.full((rows, H), 7.0, np.float32))
    plain(xd, wd, d2, rows, tile_live=live)
    GroupedConv(be, H, taps, group, layout="group")(xd, bd, d2, 0, out2, lane_rows=lane_rows, tile_live=live)
    return x, w, base, be.to_numpy(d), be.to_numpy(out), be.to_numpy(d2), be.to_numpy(out2)


@pytest.mark.parametrize("rows,lane_rows,H,taps,group,k_split", [
    (1, 1, 64, 2, 16, None),     # one row: tap 0 only; one column block
    (3, 3, 48, 3, 8, 1),         # 3 taps (whole groups: N inside one column block)
    (19, 19, 544, 2, 4, 1),      # no split: the groups over three column blocks, H not a multiple
    (20, 5, 544, 2, 4, 3),       # split K, lanes of 5 rows straddling 16-row tiles
    (19, 19, 288, 2, 2, 2),      # group 2: scalar channels (no 16-byte chunks)
    (32, 16, 200, 4, 8, 2),      # 4 taps, two lanes
    (80, 16, 64, 2, 16, 2),      # two M blocks of 64 rows: a lane's taps cross the block edge
    (80, 40, 64, 2, 16, 1),
])
def test_fused_prepare_is_gemm_then_conv(emu, rng, monkeypatch, rows, lane_rows, H, taps, group, k_split):
    monkeypatch.setattr(gs, "CONV_FUSE_MAX_TRIPS", 10**6)   # the kernel at every size, not the policy's
    x, w, base, d, out, d2, out2 = _run(emu, rows, H, taps, group, lane_rows, k_split, rng)
    np.testing.assert_array_equal(d, d2)
    np.testing.assert_array_equal(out, out2)
    assert_close(out, grouped_conv_reference(x, base, d, 0, group, lane_rows=lane_rows, layout="group"),
                 "f32", "fused prepare")


def test_group_major_layout_is_a_column_permutation(emu, rng):
    """The permuted rows give the published layout's coefficients, moved (bit for bit), and the
    group-major convolution of them equals the published one's."""
    be = emu
    rows, H, taps, group = 19, 544, 2, 4
    x, w, base, G, N = _case(rng, rows, H, taps, group)
    perm = group_major_rows(taps, G)
    g = Gemm(be, N, H, np.float16, max_m=rows, k_split=2, wgmma=False)
    d_pub, d_grp = be.zeros((rows, N), np.float32), be.zeros((rows, N), np.float32)
    g(be.asarray(x), be.asarray(w), d_pub, rows)
    g(be.asarray(x), be.asarray(w[perm]), d_grp, rows)
    d_pub, d_grp = be.to_numpy(d_pub), be.to_numpy(d_grp)
    np.testing.assert_array_equal(d_grp, d_pub[:, perm])
    for half, t, gg in ((0, 0, 0), (0, 1, 7), (1, 0, 135), (1, 1, 3)):
        assert d_grp[0, d_column(half, t, gg, taps, G, "group")] == d_pub[0, d_column(half, t, gg, taps, G)]
    for half in (0, 1):
        a = grouped_conv_reference(x, base, d_pub, half, group, lane_rows=rows)
        b = grouped_conv_reference(x, base, d_grp, half, group, lane_rows=rows, layout="group")
        np.testing.assert_array_equal(a, b)


def test_fused_prepare_skips_dead_tiles(emu, rng, monkeypatch):
    be = emu
    monkeypatch.setattr(gs, "CONV_FUSE_MAX_TRIPS", 10**6)
    rows, H, taps, group = 48, 544, 2, 4
    x, w, base, d, out, d2, out2 = _run(be, rows, H, taps, group, 16, 2, rng, tile_live=[1, 0, 1])
    assert (out[16:32] == 7.0).all() and (d[16:32] == 5.0).all()     # the dead tile untouched
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(d, d2)
    ref = grouped_conv_reference(x, base, d, 0, group, lane_rows=16, layout="group")
    assert_close(out[32:], ref[32:], "f32", "lane 2")
    # row 32 starts lane 2: tap 1 must not read row 31
    G = H // group
    dcol = d[32, d_column(0, 0, np.arange(H) // group, taps, G, "group")]
    assert_close(out[32], (base[0] + dcol) * x[32], "f32", "first row of a lane")


def test_fuses_conv_only_where_whole_groups_fit_and_the_tail_is_short(emu, monkeypatch):
    be = emu
    # DFlash 2 at hidden 5120: 16, 32 and 48 rows fuse (batches of 4 rows in pairs; a GS_CONV
    # column block of 128 holds 128 chunks of 4 channels, so its 256 threads take each chunk's
    # rows in two parts: 1, 2, 4 round trips, the parts of the 64-row variant 32 rows whatever
    # lives; 256 columns, a chunk's rows a thread: 2, 4, 6), a tail over CONV_FUSE_MAX_TRIPS does not
    g = Gemm(be, 1280, 5120, np.uint16, max_m=48, conv=(2, 16), wgmma=False)
    assert gs.cols_per_block(1, conv=True) == 128
    assert [g.fuses_conv(m) for m in (16, 32, 48)] == [True, True, True]
    assert [gs.conv_tail_trips(r, 1280, 2, 16, 128, 16 * gs.bucket(r)) for r in (16, 32, 48, 64)] == [1, 2, 4, 4]
    assert [gs.conv_tail_trips(r, 1280, 2, 16, 256) for r in (16, 32, 48, 64)] == [2, 4, 6, 8]
    with monkeypatch.context() as mp:
        mp.setattr(gs, "CONV_FUSE_MAX_TRIPS", 2)
        assert [g.fuses_conv(m) for m in (16, 32, 48)] == [True, True, False]
    # 3 taps, N beyond one column block (COLS % 6 != 0): a group would straddle two
    H, group, taps = 688, 8, 3
    N = 2 * taps * (H // group)
    assert N > gs.cols_per_block(1, conv=True) and gs.cols_per_block(1, conv=True) % (2 * taps)
    g = Gemm(be, N, H, np.float16, max_m=16, conv=(taps, group), wgmma=False)
    assert not g.fuses_conv(16)
    x, y = be.zeros((16, H), np.float32), be.zeros((16, N), np.float32)
    with pytest.raises(ValueError, match="cannot fuse"):
        g(x, be.zeros((N, H), np.float16), y, 16, conv=(be.zeros((taps, H), np.float32),
                                                        be.zeros((16, H), np.float32), 16))
    # a wgmma launch does not fuse either
    w = Gemm(be, 64, 64, np.float16, max_m=64, conv=(2, 4), wgmma=True)
    assert not w.fuses_conv(64) and w.fuses_conv(16)


def test_fused_prepare_bad_input(emu):
    be = emu
    H, taps, group, m = 64, 2, 16, 16
    N = 2 * taps * H // group
    with pytest.raises(ValueError, match="N = 2"):
        Gemm(be, N + 8, H, np.float16, conv=(taps, group))
    with pytest.raises(ValueError, match="epilogue 'none'"):
        Gemm(be, N, H, np.float16, epilogue="residual", conv=(taps, group))
    g = Gemm(be, N, H, np.float16, max_m=m, conv=(taps, group), wgmma=False)
    x, w = be.zeros((m, H), np.float32), be.zeros((N, H), np.float16)
    y = be.asarray(np.full((m, N), 3.0, np.float32))
    base, out = be.zeros((taps, H), np.float32), be.asarray(np.full((m, H), 3.0, np.float32))
    bad = [((be.zeros((taps + 1, H), np.float32), out, m), "conv base must have shape"),
           ((base, be.zeros((m, H + 4), np.float32), m), "conv out must have shape"),
           ((base, out, 5), "must divide"),
           ((base, x, m), "must not overlap x"),
           ((base, out), "conv must be")]
    for conv, msg in bad:
        with pytest.raises(ValueError, match=msg):
            g(x, w, y, m, conv=conv)
    with pytest.raises(ValueError, match="pad_rows or x2"):
        g(x, w, y, m, conv=(base, out, m), pad_rows=(be.zeros((1,), np.int32), 4))
    assert (be.to_numpy(y) == 3.0).all() and (be.to_numpy(out) == 3.0).all()   # nothing launched
