"""conv.cu (DFlash 2's grouped dynamic convolution) against its NumPy reference, which rounds
where the kernel rounds, and against the float64 oracle's ``grouped_conv``."""
import numpy as np
import pytest

from dflash_cupy import reference
from dflash_cupy.ops.conv import GroupedConv, grouped_conv_reference
from dflash_cupy.ops.norm import RmsNorm, rmsnorm_reference
from dflash_cupy.tolerances import assert_close


def _case(rng, rows, H, taps, gs):
    G = H // gs
    x = rng.standard_normal((rows, H)).astype(np.float32)
    base = rng.standard_normal((2, taps, H)).astype(np.float32)
    d = rng.standard_normal((rows, 2 * taps * G)).astype(np.float32)
    res = rng.standard_normal((rows, H)).astype(np.float32)
    return x, base, d, res


@pytest.mark.parametrize("rows,lane_rows,H,taps,gs", [
    (1, 1, 16, 2, 16),      # one row: only tap 0
    (3, 3, 48, 2, 16),      # 3 groups
    (19, 19, 33, 3, 11),    # H not a multiple of the block, 3 taps
    (48, 16, 48, 2, 16),    # three lanes of 16 rows: taps never cross a lane
    (32, 16, 200, 4, 8),    # taps > rows of nothing; 4 taps
])
@pytest.mark.parametrize("half", [0, 1])
def test_conv_matches_reference(backend, rng, rows, lane_rows, H, taps, gs, half):
    be = backend
    x, base, d, res = _case(rng, rows, H, taps, gs)
    conv = GroupedConv(be, H, taps, gs)
    y = be.zeros((rows, H), np.float32)
    conv(be.asarray(x), be.asarray(base[half]), be.asarray(d), half, y, lane_rows=lane_rows)
    want = grouped_conv_reference(x, base[half], d, half, gs, lane_rows=lane_rows)
    assert_close(be.to_numpy(y), want, "f32", "conv")
    # the oracle's definition, per lane block (float64)
    G = H // gs
    for l0 in range(0, rows, lane_rows):
        blk = slice(l0, l0 + lane_rows)
        delta = d[blk].reshape(lane_rows, 2, taps, G)[:, half]
        assert_close(be.to_numpy(y)[blk], reference.grouped_conv(x[blk], base[half], delta, gs), "f32",
                     f"conv vs oracle, lane block at row {l0}")
    # finish: the residual added, in place (y is the residual)
    r = be.asarray(res)
    conv(be.asarray(x), be.asarray(base[half]), be.asarray(d), half, r, residual=r, lane_rows=lane_rows)
    assert_close(be.to_numpy(r), grouped_conv_reference(x, base[half], d, half, gs, residual=res,
                                                        lane_rows=lane_rows), "f32", "conv + residual")


def test_conv_skips_dead_tiles_and_lane_boundaries(emu, rng):
    be = emu
    rows, H, taps, gs = 48, 32, 2, 16
    x, base, d, _ = _case(rng, rows, H, taps, gs)
    conv = GroupedConv(be, H, taps, gs)
    y = be.asarray(np.full((rows, H), 7.0, np.float32))
    live = be.asarray(np.array([1, 0, 1], np.int32))
    conv(be.asarray(x), be.asarray(base[0]), be.asarray(d), 0, y, lane_rows=16, tile_live=live)
    got = be.to_numpy(y)
    want = grouped_conv_reference(x, base[0], d, 0, gs, lane_rows=16)
    assert (got[16:32] == 7.0).all()                       # the dead tile untouched
    assert_close(got[:16], want[:16], "f32", "lane 0")
    assert_close(got[32:], want[32:], "f32", "lane 2")
    # row 32 starts lane 2: tap 1 must not read row 31 (lane 1's)
    assert_close(got[32], (base[0][0] + d[32, np.arange(H) // gs]) * x[32], "f32", "first row of a lane")


def test_conv_bad_input(emu):
    be = emu
    conv = GroupedConv(be, 32, 2, 16)
    x, y = be.zeros((4, 32), np.float32), be.zeros((4, 32), np.float32)
    base, d = be.zeros((2, 32), np.float32), be.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="d must have shape"):
        conv(x, base, be.zeros((4, 7), np.float32), 0, y)
    with pytest.raises(ValueError, match="half"):
        conv(x, base, d, 2, y)
    with pytest.raises(ValueError, match="y must not overlap x"):
        conv(x, base, d, 0, x)
    with pytest.raises(ValueError, match="lane_rows"):
        conv(x, base, d, 0, y, lane_rows=3)
    with pytest.raises(TypeError):
        conv(x, base, be.zeros((4, 8), np.float16), 0, y)
    with pytest.raises(ValueError, match="group_size"):
        GroupedConv(be, 30, 2, 16)


@pytest.mark.parametrize("rows,lane_rows,H,taps,gs", [
    (1, 1, 16, 2, 16),        # one row: tap 0 only; one warp
    (19, 19, 33, 3, 11),      # H % 4 != 0 (norm.cu's scalar chunks), 3 taps
    (48, 16, 48, 2, 16),      # three lanes of 16 rows (q_len 16)
    (30, 5, 200, 4, 8),       # six lanes of q_len 5
    (16, 16, 1300, 2, 20),    # 96 threads per row: three warps' partials, a ragged last chunk pass
])
def test_finish_norm_is_conv_then_rmsnorm(backend, rng, rows, lane_rows, H, taps, gs):
    """grouped_conv_norm: y as the finish convolution writes it and yn as RmsNorm computes
    rmsnorm(y) * w, bit for bit (the engine's outputs do not move), and yn close to the float64
    norm of the reference convolution."""
    be, eps = backend, 1e-6
    x, base, d, res = _case(rng, rows, H, taps, gs)
    w = rng.standard_normal(H).astype(np.float32)
    conv = GroupedConv(be, H, taps, gs, norm_eps=eps)
    xd, bd, dd, wd = be.asarray(x), be.asarray(base[1]), be.asarray(d), be.asarray(w)
    # unfused: the finish convolution in place, then the norm
    r0 = be.asarray(res)
    conv(xd, bd, dd, 1, r0, residual=r0, lane_rows=lane_rows)
    yn0 = be.zeros((rows, H), np.float32)
    RmsNorm(be, H, eps)(r0, wd, yn0)
    # fused, in place as the engine runs it (y is the residual)
    r1, yn1 = be.asarray(res), be.zeros((rows, H), np.float32)
    conv.finish_norm(xd, bd, dd, r1, r1, wd, yn1, lane_rows=lane_rows)
    assert np.array_equal(be.to_numpy(r1), be.to_numpy(r0))
    assert np.array_equal(be.to_numpy(yn1), be.to_numpy(yn0))
    # and out of place (y apart from the residual)
    y2, yn2 = be.zeros((rows, H), np.float32), be.zeros((rows, H), np.float32)
    conv.finish_norm(xd, bd, dd, y2, be.asarray(res), wd, yn2, lane_rows=lane_rows)
    assert np.array_equal(be.to_numpy(y2), be.to_numpy(r0))
    assert np.array_equal(be.to_numpy(yn2), be.to_numpy(yn0))
    want_y = grouped_conv_reference(x, base[1], d, 1, gs, residual=res, lane_rows=lane_rows)
    assert_close(be.to_numpy(y2), want_y, "f32", "finish_norm: y")
    assert_close(be.to_numpy(yn2), rmsnorm_reference(want_y, w, eps=eps), "f32", "finish_norm: yn")


def test_finish_norm_skips_dead_tiles(emu, rng):
    be = emu
    rows, H, taps, gs = 48, 64, 2, 16
    x, base, d, res = _case(rng, rows, H, taps, gs)
    w = rng.standard_normal(H).astype(np.float32)
    conv = GroupedConv(be, H, taps, gs, norm_eps=1e-5)
    y, yn = be.asarray(np.full((rows, H), 7.0, np.float32)), be.asarray(np.full((rows, H), 5.0, np.float32))
    live = be.asarray(np.array([1, 0, 1], np.int32))
    conv.finish_norm(be.asarray(x), be.asarray(base[1]), be.asarray(d), y, be.asarray(res), be.asarray(w), yn,
                     lane_rows=16, tile_live=live)
    got_y, got_n = be.to_numpy(y), be.to_numpy(yn)
    assert (got_y[16:32] == 7.0).all() and (got_n[16:32] == 5.0).all()   # the dead tile untouched
    want_y = grouped_conv_reference(x, base[1], d, 1, gs, residual=res, lane_rows=16)
    for blk in (slice(0, 16), slice(32, 48)):
        assert_close(got_y[blk], want_y[blk], "f32", "live lane: y")
        assert_close(got_n[blk], rmsnorm_reference(want_y[blk], w, eps=1e-5), "f32", "live lane: yn")


def test_finish_norm_bad_input(emu):
    be = emu
    x, y, yn = (be.zeros((4, 32), np.float32) for _ in range(3))
    base, d, w = be.zeros((2, 32), np.float32), be.zeros((4, 8), np.float32), be.zeros((32,), np.float32)
    with pytest.raises(RuntimeError, match="norm_eps"):
        GroupedConv(be, 32, 2, 16).finish_norm(x, base, d, y, y, w, yn)
    conv = GroupedConv(be, 32, 2, 16, norm_eps=1e-6)
    with pytest.raises(ValueError, match="yn must not overlap y"):
        conv.finish_norm(x, base, d, y, y, w, y)
    with pytest.raises(ValueError, match="w must have shape"):
        conv.finish_norm(x, base, d, y, y, be.zeros((31,), np.float32), yn)
    with pytest.raises(ValueError, match="yn must have shape"):
        conv.finish_norm(x, base, d, y, y, w, be.zeros((4, 31), np.float32))
    with pytest.raises(ValueError, match="residual"):
        conv.finish_norm(x, base, d, y, None, w, yn)
    with pytest.raises(ValueError, match="norm_eps"):
        GroupedConv(be, 32, 2, 16, norm_eps=-1.0)
