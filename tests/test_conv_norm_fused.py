"""The RMSNorm folded into the kernel_projection GEMM that fuses the prepare convolution
(gemm_stream.cu's GS_CONV with GS_NORM, cuda_src/gemm_conv.cuh): the GEMM reads the un-normed
rows, its tail convolves the normed x = (h * ln) * s (each product rounded to f32, s the row
scale the GEMM multiplies its sums by). Checked bit for bit against the unfused path on the same
x (the plain folded-norm GEMM, then GroupedConv of x computed in NumPy), and against the NumPy
references with the tolerance table.

The row scale is read off the GEMM itself, exactly: x[:, 0] = 1, ln[0] = 1 and the projection's
first row e_0 make d[:, 0] = 1.0 * s (normed rows) or 1.0 (raw rows)."""
import numpy as np
import pytest

from dflash_cupy.ops import gemm_stream as gs
from dflash_cupy.ops.conv import GroupedConv, group_major_rows, grouped_conv_reference
from dflash_cupy.ops.gemm import Gemm
from dflash_cupy.tolerances import assert_close

EPS = 1e-6


def _case(rng, rows, H, taps, group):
    G = H // group
    N = 2 * taps * G
    h = (rng.standard_normal((rows, H)) * rng.uniform(0.2, 5.0, (rows, 1))).astype(np.float32)
    h[:, 0] = 1.0
    ln = rng.uniform(0.5, 1.5, H).astype(np.float32)
    ln[0] = 1.0
    w = (rng.standard_normal((N, H)) / np.sqrt(H)).astype(np.float16)[group_major_rows(taps, G)]
    w[0] = 0.0
    w[0, 0] = 1.0                      # d[:, 0] = the row scale (module docstring)
    base = rng.standard_normal((taps, H)).astype(np.float32)
    return h, ln, w, base, N


def _run(be, rows, H, taps, group, lane_rows, k_split, rng, norm_lo=0, tile_live=None):
    h, ln, w, base, N = _case(rng, rows, H, taps, group)
    kw = dict(max_m=rows, k_split=k_split, wgmma=False, x_split=True, norm_eps=EPS)
    fused = Gemm(be, N, H, np.float16, conv=(taps, group), **kw)
    plain = Gemm(be, N, H, np.float16, **kw)
    assert fused.fuses_conv(rows) and fused.config(rows) == plain.config(rows)
    hd, wd, bd, lnd = be.asarray(h), be.asarray(w), be.asarray(base), be.asarray(ln)
    live = None if tile_live is None else be.asarray(np.asarray(tile_live, np.int32))
    d = be.asarray(np.full((rows, N), 5.0, np.float32))
    out = be.asarray(np.full((rows, H), 7.0, np.float32))
    h_before = be.to_numpy(hd).copy()
    fused(hd, wd, d, rows, tile_live=live, norm=(lnd, norm_lo), conv=(bd, out, lane_rows))
    np.testing.assert_array_equal(be.to_numpy(hd), h_before)            # x read, never written
    d2 = be.asarray(np.full((rows, N), 5.0, np.float32))
    plain(hd, wd, d2, rows, tile_live=live, norm=(lnd, norm_lo))
    d, d2 = be.to_numpy(d), be.to_numpy(d2)
    np.testing.assert_array_equal(d, d2)                                 # the coefficients unchanged
    s = d[:, 0].copy()
    normed = np.arange(rows) >= norm_lo
    s[~normed] = 1.0
    x = np.where(normed[:, None], (h * ln) * s[:, None], h).astype(np.float32)   # f32 products
    conv = GroupedConv(be, H, taps, group, layout="group")
    out2 = be.asarray(np.full((rows, H), 7.0, np.float32))
    conv(be.asarray(x), bd, be.asarray(d), 0, out2, lane_rows=lane_rows, tile_live=live)
    # the unfused launch of the step (norm_out): the GEMM stores x, GroupedConv convolves it
    d3 = be.asarray(np.full((rows, N), 5.0, np.float32))
    cx = be.asarray(np.full((rows, H), 7.0, np.float32))
    fused(hd, wd, d3, rows, tile_live=live, norm=(lnd, norm_lo), norm_out=cx)
    np.testing.assert_array_equal(be.to_numpy(d3), d)
    cx = be.to_numpy(cx)
    stored = np.repeat(np.asarray([1] * -(-rows // 16) if tile_live is None else tile_live) != 0, 16)[:rows]
    np.testing.assert_array_equal(cx[stored], x[stored])
    assert (cx[~stored] == 7.0).all()
    out3 = be.asarray(np.full((rows, H), 7.0, np.float32))
    conv(be.asarray(cx), bd, be.asarray(d), 0, out3, lane_rows=lane_rows, tile_live=live)
    np.testing.assert_array_equal(be.to_numpy(out3), be.to_numpy(out2))
    return h, ln, base, d, x, s, be.to_numpy(out), be.to_numpy(out2)


def _rms64(h, ln, eps=EPS):
    h = h.astype(np.float64)
    return h / np.sqrt((h * h).mean(axis=1, keepdims=True) + eps) * ln


# few shapes (each -D set compiles): H 544 (groups over three column blocks, group 4) and 288
# (one block, group 16); M tiles 1 and 2
@pytest.mark.parametrize("rows,lane_rows,H,group,k_split", [
    (1, 1, 544, 4, 1),       # one row, unsplit
    (3, 3, 288, 16, None),   # the cost rule's split (one slice at K 288)
    (19, 19, 544, 4, 2),     # split K, an odd block in two tiles
    (20, 5, 288, 16, 1),     # lanes of 5 straddling the 16-row tiles (one row block)
    (32, 16, 544, 4, 3),     # two lanes of 16, three slices
])
def test_folded_norm_prepare_is_norm_gemm_then_conv(emu, rng, monkeypatch, rows, lane_rows, H, group, k_split):
    monkeypatch.setattr(gs, "CONV_FUSE_MAX_TRIPS", 10**6)
    taps = 2
    h, ln, base, d, x, s, out, out2 = _run(emu, rows, H, taps, group, lane_rows, k_split, rng)
    np.testing.assert_array_equal(out, out2)
    # the scale the GEMM used is rmsnorm's (f32 sums, rsqrt): x is the normed row to f32 rounding
    assert_close(x, _rms64(h, ln), "f32", "normed x")
    assert_close(out, grouped_conv_reference(x, base, d, 0, group, lane_rows=lane_rows, layout="group"),
                 "f32", "fused prepare")
    assert_close(out, grouped_conv_reference(_rms64(h, ln), base, d, 0, group, lane_rows=lane_rows,
                                             layout="group"), "f32", "against the f64 norm")


def test_folded_norm_prepare_raw_rows_and_dead_tiles(emu, rng, monkeypatch):
    """Rows below norm_lo are convolved raw; a dead tile's d and out rows are untouched."""
    monkeypatch.setattr(gs, "CONV_FUSE_MAX_TRIPS", 10**6)
    rows, lane_rows, H, group = 32, 16, 288, 16
    h, ln, base, d, x, s, out, out2 = _run(emu, rows, H, 2, group, lane_rows, 2, rng, norm_lo=5,
                                           tile_live=[0, 1])
    assert (out[:16] == 7.0).all() and (d[:16] == 5.0).all()
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(x[16:], ((h[16:] * ln) * s[16:, None]).astype(np.float32))
    ref = grouped_conv_reference(_rms64(h, ln), base, d, 0, group, lane_rows=lane_rows, layout="group")
    assert_close(out[16:], ref[16:], "f32", "live lane")


def test_folded_norm_prepare_is_the_same_for_any_row_count(emu, rng, monkeypatch):
    """A lane's rows give the same bits alone and among others (the batch / single-cache rule):
    the same split, so the same sums of squares; a 1-row block and 3 lanes of 1 at once."""
    monkeypatch.setattr(gs, "CONV_FUSE_MAX_TRIPS", 10**6)
    be, H, taps, group = emu, 544, 2, 4
    h, ln, w, base, N = _case(rng, 3, H, taps, group)
    outs = {}
    for m in (1, 3):
        g = Gemm(be, N, H, np.float16, max_m=m, k_split=2, wgmma=False, norm_eps=EPS, conv=(taps, group))
        d, out = be.zeros((m, N), np.float32), be.zeros((m, H), np.float32)
        g(be.asarray(h[:m]), be.asarray(w), d, m, norm=(be.asarray(ln), 0), conv=(be.asarray(base), out, 1))
        outs[m] = (be.to_numpy(d), be.to_numpy(out))
    np.testing.assert_array_equal(outs[1][0], outs[3][0][:1])
    np.testing.assert_array_equal(outs[1][1], outs[3][1][:1])


def test_folded_norm_prepare_bad_input(emu, monkeypatch):
    monkeypatch.setattr(gs, "CONV_FUSE_MAX_TRIPS", 10**6)
    be = emu
    H, taps, group, m = 64, 2, 16, 20
    N = 2 * taps * H // group
    g = Gemm(be, N, H, np.float16, max_m=m, conv=(taps, group), wgmma=False, norm_eps=EPS)
    plain = Gemm(be, N, H, np.float16, max_m=m, conv=(taps, group), wgmma=False)
    x, w = be.zeros((m, H), np.float32), be.zeros((N, H), np.float16)
    ln = be.asarray(np.ones(H, np.float32))
    y = be.asarray(np.full((m, N), 3.0, np.float32))
    base, out = be.zeros((taps, H), np.float32), be.asarray(np.full((m, H), 3.0, np.float32))
    with pytest.raises(ValueError, match="no ln_lo"):
        g(x, w, y, m, norm=(ln, 4, ln), conv=(base, out, m))
    with pytest.raises(ValueError, match=r"norm\[0\] must have shape"):
        g(x, w, y, m, norm=(be.asarray(np.ones(H + 8, np.float32)), 0), conv=(base, out, m))
    with pytest.raises(ValueError, match="built without norm_eps"):
        plain(x, w, y, m, norm=(ln, 0), conv=(base, out, m))
    with pytest.raises(ValueError, match="norm_out takes norm= and no conv="):
        g(x, w, y, m, norm=(ln, 0), conv=(base, out, m), norm_out=out)
    with pytest.raises(ValueError, match="norm_out takes norm="):
        g(x, w, y, m, norm_out=out)
    with pytest.raises(ValueError, match="norm_out must not overlap x"):
        g(x, w, y, m, norm=(ln, 0), norm_out=x)
    with pytest.raises(ValueError, match="norm_out must have shape"):
        g(x, w, y, m, norm=(ln, 0), norm_out=be.zeros((m - 1, H), np.float32))
    with pytest.raises(ValueError, match="built without norm_eps"):
        plain(x, w, y, m, norm_out=out, norm=(ln, 0))
    wg = Gemm(be, N, H, np.float16, max_m=64, conv=(taps, group), wgmma=True, norm_eps=EPS)
    assert wg.stores_norm(16) and not wg.stores_norm(64) and not wg.fuses_conv_norm(64, 16)
    xw, yw = be.zeros((64, H), np.float32), be.zeros((64, N), np.float32)
    with pytest.raises(ValueError, match="norm_out needs a Gemm built with conv and norm_eps on a gemm_stream"):
        wg(xw, w, yw, 64, norm=(ln, 0), norm_out=be.zeros((64, H), np.float32))
    assert (be.to_numpy(y) == 3.0).all() and (be.to_numpy(out) == 3.0).all()   # nothing launched
    # a lane straddling two row blocks would need the other block's row scales
    big = Gemm(be, N, H, np.float16, max_m=80, k_split=1, wgmma=False, norm_eps=EPS, conv=(taps, group))
    assert big._stream.plan(80).rows == 64
    xb, yb = be.zeros((80, H), np.float32), be.zeros((80, N), np.float32)
    outb = be.asarray(np.full((80, H), 3.0, np.float32))
    with pytest.raises(ValueError, match="must divide the launch's 64-row"):
        big(xb, w, yb, 80, norm=(ln, 0), conv=(base, outb, 40))
    assert (be.to_numpy(outb) == 3.0).all()
