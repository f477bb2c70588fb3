"""The stream GEMMs' second input pointer (``x2=(a, row_split)``: rows >= row_split from ``a``)
and the folded norm's ``ln_lo`` (rows < norm_lo normalised with it), in both kernels
(gemm_stream.cu, gemm_wgmma.cu incl. its qkv epilogue and live split).

A two-pointer launch must be bit-identical to the one-pointer launch of the same
configuration on a concatenated copy: the kernels only choose a row's base address, so any
difference is a wrong row (or a sum of squares taken over the wrong values)."""
import ml_dtypes
import numpy as np
import pytest

from dflash_cupy import dtypes
from dflash_cupy.ops.gemm import Gemm, gemm_reference
from tests.support.gemm import SENTINEL, host_weights, qkv_setup, tile_flags
from tests.support.tolerances import assert_close

N, K = 260, 840


def _run(be, op, x_parts, wh, m, split, norm, tile_live=None, epilogue="none"):
    """y of the one-pointer launch on concat(x_parts) and of the two-pointer launch."""
    xa, xb = x_parts
    w = be.asarray(wh)
    nw = 2 if epilogue == "silu_mul" else 1
    outs = []
    for two in (False, True):
        y = be.asarray(np.full((m, N), SENTINEL, np.float32))
        kw = dict(norm=norm, tile_live=None if tile_live is None else be.asarray(tile_live))
        if two:
            a, b = be.asarray(xa), be.asarray(xb)
            op(a, w, y, m, x2=(b, split), **kw)
            np.testing.assert_array_equal(be.to_numpy(a), xa)   # inputs read only
            np.testing.assert_array_equal(be.to_numpy(b), xb)
        else:
            op(be.asarray(np.concatenate([xa[:split], xb[:m - split]])), w, y, m, **kw)
        outs.append(be.to_numpy(y))
    assert nw * N == wh.shape[0]
    return outs


def _x(rng, rows, x16=False):
    x = rng.standard_normal((rows, K)).astype(np.float32) * rng.uniform(0.05, 20, (rows, 1)).astype(np.float32)
    return dtypes.device_bits(x.astype(ml_dtypes.bfloat16)) if x16 else x


CONFIGS = [  # (mt or wgmma variant, k split, m, row_split)
    (1, 1, 13, 5), (2, 1, 30, 16), (4, 3, 61, 7), (4, 1, 64, 0),
    ("wg64", 1, 70, 33), ("wg128", 2, 150, 64), ("wg64", 3, 100, 100),
]


@pytest.mark.parametrize("x16", [False, True])
@pytest.mark.parametrize("norm_kind", ["none", "ln", "ln_lo"])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_two_pointers_equal_one_concatenated_input(emu, rng, cfg, norm_kind, x16):
    variant, ks, m, split = cfg
    op = Gemm(emu, N, K, "bf16", max_m=200, path="stream", x_split=not x16, x16=x16,
              norm_eps=None if norm_kind == "none" else 1e-6)
    op.use_config(m, (variant, ks))
    wh = host_weights(rng, N, K, "bf16")
    xa, xb = _x(rng, split + 3, x16), _x(rng, m - split + 2, x16)
    ln = emu.asarray((1 + 0.5 * rng.standard_normal(K)).astype(np.float32))
    ln_lo = emu.asarray((1 + 0.5 * rng.standard_normal(K)).astype(np.float32))
    norm_lo = min(m, split + 2)
    norm = {"none": None, "ln": (ln, norm_lo), "ln_lo": (ln, norm_lo, ln_lo)}[norm_kind]
    one, two = _run(emu, op, (xa, xb), wh, m, split, norm)
    np.testing.assert_array_equal(two, one)
    assert not (one == SENTINEL).any()


@pytest.mark.parametrize("cfg", [(2, 1, 30), (4, 2, 61), ("wg64", 1, 90), ("wg128", 3, 150)])
def test_ln_lo_matches_the_reference(backend, rng, cfg):
    """Rows < norm_lo as rmsnorm(x) * ln_lo, rows >= norm_lo as rmsnorm(x) * ln; a negative
    control: without ln_lo the low rows differ."""
    variant, ks, m = cfg
    op = Gemm(backend, N, K, "bf16", max_m=200, path="stream", norm_eps=1e-6)
    try:
        op.use_config(m, (variant, ks))
    except ValueError:
        pytest.skip(f"{variant} is not compiled on this backend")
    wh = host_weights(rng, N, K, "bf16")
    xh = _x(rng, m)
    lnh = (1 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    lnlh = (1 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    norm_lo = m // 3
    y = backend.zeros((m, N), np.float32)
    op(backend.asarray(xh), backend.asarray(wh), y, m, norm=(backend.asarray(lnh), norm_lo, backend.asarray(lnlh)))
    ref = gemm_reference(xh, wh, x_round=op.x_round, norm=(lnh, 1e-6, norm_lo, lnlh))
    got = backend.to_numpy(y)
    assert_close(got, ref, "f32", f"ln_lo {cfg}")
    raw = gemm_reference(xh, wh, x_round=op.x_round, norm=(lnh, 1e-6, norm_lo))
    assert not np.allclose(raw[:norm_lo], got[:norm_lo], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("variant", ["wg64", "wg128"])
def test_live_split_two_pointers(emu, rng, variant):
    """The lane batch's launch: tile_live (dead tiles untouched), the per-launch K split, the
    folded norm with ln_lo; bit-identical to the concatenated copy."""
    m, split = 150, 48
    op = Gemm(emu, N, K, "bf16", max_m=200, path="stream", norm_eps=1e-6, live_split=True)
    op.use_config(m, (variant, 1))
    wh = host_weights(rng, N, K, "bf16")
    xa, xb = _x(rng, split), _x(rng, m - split)
    ln, ln_lo = (emu.asarray((1 + 0.5 * rng.standard_normal(K)).astype(np.float32)) for _ in range(2))
    flags = tile_flags(rng, m)
    one, two = _run(emu, op, (xa, xb), wh, m, split, (ln, split, ln_lo), tile_live=flags)
    np.testing.assert_array_equal(two, one)
    dead = ~np.repeat(flags != 0, 16)[:m]
    assert dead.any() and (two[dead] == SENTINEL).all() and not (two[~dead] == SENTINEL).any()


@pytest.mark.parametrize("variant,ks", [("wg64", 1), ("wg128", 2)])
def test_qkv_epilogue_two_pointers(emu, rng, variant, ks):
    """GW_EPI 3 (q/k norm + RoPE + K/V scatter) reading [x rows; x2 rows] with ln_lo equals
    the concatenated launch: Q and both caches bit for bit."""
    from dflash_cupy.ops.rope import RopeSpec
    spec = RopeSpec(128, 3, 1, 1e-6, 1.0)
    Kq, m, split = 520, 150, 37
    d = qkv_setup(emu, rng, spec, Kq, m, "bf16", 200)
    g = Gemm(emu, d["N"], Kq, "bf16", max_m=300, path="stream", norm_eps=1e-6, rope=spec)
    g.use_config(m, (variant, ks))
    ln_lo = emu.asarray(rng.uniform(0.5, 1.5, Kq).astype(np.float32))
    xh = emu.to_numpy(d["x"])
    res = []
    for two in (False, True):
        kc, vc = emu.asarray(d["k0"]), emu.asarray(d["v0"])
        q = emu.asarray(np.full((m, spec.q_width), SENTINEL, np.float32))
        rope = (d["qn"], d["kn"], d["freq"], d["pos"], d["rows"], kc, vc)
        kw = dict(norm=(d["ln"], split, ln_lo), rope=rope)
        if two:
            g(emu.asarray(xh[:split]), d["w"], q, m, x2=(emu.asarray(xh[split:]), split), **kw)
        else:
            g(d["x"], d["w"], q, m, **kw)
        res.append([emu.to_numpy(a).copy() for a in (q, kc, vc)])
    for a, b in zip(*res):
        np.testing.assert_array_equal(a, b)
    assert not (res[1][0] == SENTINEL).any()


def test_bad_x2_refused_and_nothing_written(backend, rng):
    op = Gemm(backend, N, K, "bf16", max_m=200, path="stream", norm_eps=1e-6)
    m = 20
    x, x2 = backend.asarray(_x(rng, 8)), backend.asarray(_x(rng, 12))
    w = backend.asarray(host_weights(rng, N, K, "bf16"))
    y = backend.asarray(np.full((m, N), SENTINEL, np.float32))
    ln = backend.asarray(np.ones(K, np.float32))
    cases = [
        ((x2, 9), ValueError, r"^x must hold row_split=9 rows"),
        ((x2, 7), ValueError, r"^x2\[0\] must hold m - row_split = 13 rows"),
        ((x2, 21), ValueError, r"^x2\[1\] \(row_split\) must be an int in \[0, m=20\]"),
        ((x2, 8.0), ValueError, r"^x2\[1\] \(row_split\) must be an int"),
        ((backend.zeros((12, K), np.float16), 8), TypeError, r"^x2\[0\] "),
        ((backend.zeros((12, K + 8), np.float32), 8), ValueError, r"^x2\[0\] must have K=840 columns"),
        (x2, ValueError, r"^x2 must be \(array, row_split\)"),
    ]
    for arg, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            op(x, w, y, m, x2=arg, norm=(ln, 8))
    yk = backend.zeros((m + 12, K), np.float32)   # x2 overlapping y
    opk = Gemm(backend, K, K, "bf16", max_m=200, path="stream")
    wk = backend.asarray(host_weights(rng, K, K, "bf16"))
    with pytest.raises(ValueError, match=r"^x2\[0\] and y share memory"):
        opk(x, wk, yk[:m], m, x2=(yk[m - 12 + 4:], 8))
    with pytest.raises(ValueError, match=r"norm\[2\] \(ln_lo\) must have shape"):
        op(x, w, y, m, x2=(x2, 8), norm=(ln, 8, backend.zeros((K - 8,), np.float32)))
    with pytest.raises(ValueError, match="x2 needs path 'stream'"):
        Gemm(backend, 8, 64, "f32", path="fma")(backend.zeros((4, 64), np.float32), backend.zeros((8, 64), np.float32),
                                                 backend.zeros((4, 8), np.float32), 4,
                                                 x2=(backend.zeros((4, 64), np.float32), 2))
    assert (backend.to_numpy(y) == SENTINEL).all()
    assert not backend.to_numpy(yk).any()
