"""conv.cu (DFlash 2's grouped dynamic convolution) against its NumPy reference, which rounds
where the kernel rounds, and against the float64 oracle's ``grouped_conv``."""
import numpy as np
import pytest

from dflash_cupy import reference
from dflash_cupy.ops.conv import GroupedConv, grouped_conv_reference
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
