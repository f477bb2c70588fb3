"""qkv_norm_rope (cuda_src/rope.cu): q/k RMSNorm, NEOX RoPE at absolute
positions (2^20 and far beyond), f16 K/V scatter into the ring caches."""
import numpy as np
import pytest

from dflash_cupy.ops.rope import QkvNormRope, qkv_norm_rope_reference
from tests.support.rope import plain_table
from tests.support.tolerances import assert_close

LARGE_POS = [0, 1, 2, 4095, 2**20 - 1, 2**20, 2**20 + 12345, 2**24 + 1, 2**27 + 3, 2**30 + 7,
             2**31 - 100]


def assert_f16_rounding(got16, ref_mag, what):
    """``got16`` is the f16 rounding of the float64 reference up to the kernel's
    f32 error: a different f16 neighbour is accepted only where the reference
    sits within that error of the midpoint between the two. ``ref_mag =
    (ref, mag)``: the error scales with ``mag = (|x_i| + |x_{i+d/2}|) * mscale``
    of the rotated pair, not with the (possibly cancelled) result."""
    ref64, mag = ref_mag
    got = np.asarray(got16, dtype=np.float16).astype(np.float64)
    ref = np.asarray(ref64, dtype=np.float64)
    r16 = ref.astype(np.float16).astype(np.float64)
    slack = 1e-6 * mag + 1e-9
    ok = (got == r16) | (np.abs(got - ref) <= np.abs(r16 - ref) + slack)
    if not ok.all():
        i = np.unravel_index(np.argmin(ok), ok.shape)
        raise AssertionError(f"{what}: {int((~ok).sum())} values are not the f16 rounding of the "
                             f"reference; first at {i}: got {got[i]!r}, ref {ref[i]!r}")


def run_rope(be, rng, D, NH, NKV, has_q, pos, rows, kv_rows, *, eps=1e-6, mscale=1.0,
             table=None, n_rows=None, extra_rows=0):
    M = len(pos)
    op = QkvNormRope(be, D, NH, NKV, has_q, eps=eps, attn_scale_factor=mscale)
    qkv = (rng.standard_normal((M + extra_rows, op.qkv_width)) * 2.0).astype(np.float32)
    qn = rng.uniform(0.5, 1.5, D).astype(np.float32)
    kn = rng.uniform(0.5, 1.5, D).astype(np.float32)
    table = plain_table(D) if table is None else table
    k0 = rng.standard_normal((kv_rows, NKV * D)).astype(np.float16)   # previous cache content
    v0 = rng.standard_normal((kv_rows, NKV * D)).astype(np.float16)
    kc, vc = be.asarray(k0), be.asarray(v0)
    pos_a = np.concatenate([np.asarray(pos, np.int32), np.zeros(extra_rows, np.int32)])
    rows_a = np.concatenate([np.asarray(rows, np.int32), np.zeros(extra_rows, np.int32)])
    kw = {}
    if has_q:
        q_out = be.asarray(np.full((M + extra_rows, NH * D), np.nan, np.float32))
        kw = dict(q_norm=be.asarray(qn), q_out=q_out)
    op(be.asarray(qkv), be.asarray(kn), be.asarray(table), be.asarray(pos_a), be.asarray(rows_a),
       kc, vc, n_rows=n_rows, **kw)
    q, k, v = qkv_norm_rope_reference(qkv[:M], qn, kn, table, pos, head_dim=D, n_head=NH,
                                      n_head_kv=NKV, has_q=has_q, eps=eps, attn_scale_factor=mscale)
    got_q = be.to_numpy(kw["q_out"]) if has_q else None
    return dict(q=got_q, k=be.to_numpy(kc), v=be.to_numpy(vc), k0=k0, v0=v0, qkv=qkv, qn=qn, kn=kn,
                table=table, ref_q=q, ref_k=k, ref_v=v)


def ref_k64(r, pos, D, NKV, eps=1e-6, mscale=1.0, NH=0, has_q=False):
    """float64 K before its f16 rounding, and the magnitude its error scales with."""
    x = r["qkv"][:len(pos)].astype(np.float64)
    qw = NH * D if has_q else 0
    k = x[:, qw:qw + NKV * D].reshape(len(pos), NKV, D)
    k = k / np.sqrt(np.mean(k * k, -1, keepdims=True) + eps) * r["kn"].astype(np.float64)
    ang = np.asarray(pos, np.float64)[:, None] * r["table"][None, :]
    c, s = (np.cos(ang) * mscale)[:, None], (np.sin(ang) * mscale)[:, None]
    a, b = k[..., :D // 2], k[..., D // 2:]
    mag = np.abs(a) + np.abs(b)
    return (np.concatenate([a * c - b * s, b * c + a * s], -1).reshape(len(pos), NKV * D),
            np.concatenate([mag, mag], -1).reshape(len(pos), NKV * D) * abs(mscale))


@pytest.mark.parametrize("D,NH,NKV,has_q", [(64, 4, 2, True), (128, 2, 1, False),
                                            (32, 3, 3, True), (80, 2, 1, True)])
def test_matches_reference_at_large_positions(backend, rng, D, NH, NKV, has_q):
    kv_rows = 40
    pos = LARGE_POS + list(rng.integers(0, 2**31 - 1, 8))
    rows = rng.permutation(kv_rows)[:len(pos)]
    r = run_rope(backend, rng, D, NH, NKV, has_q, pos, rows, kv_rows)
    if has_q:
        assert_close(r["q"], r["ref_q"], "f32", "q_out")
    assert_f16_rounding(r["k"][rows], ref_k64(r, pos, D, NKV, NH=NH, has_q=has_q), "k_cache rows")
    assert np.array_equal(r["v"][rows].view(np.uint16), r["ref_v"].view(np.uint16)), "v_cache rows"
    others = np.setdiff1d(np.arange(kv_rows), rows)
    assert np.array_equal(r["k"][others].view(np.uint16), r["k0"][others].view(np.uint16)), \
        "k_cache rows not in `rows` were modified"
    assert np.array_equal(r["v"][others].view(np.uint16), r["v0"][others].view(np.uint16)), \
        "v_cache rows not in `rows` were modified"


def test_scaled_table_mscale_eps(backend, rng):
    """Linear-scaled table, YaRN-style magnitude factor and a larger eps."""
    D, NH, NKV = 64, 4, 1
    pos = [3, 2**20 + 5, 2**26 + 11, 77]
    rows = [5, 0, 2, 7]
    table = plain_table(D, 1e4) / 4.0
    r = run_rope(backend, rng, D, NH, NKV, True, pos, rows, 8, eps=1e-3, mscale=1.2345, table=table)
    assert_close(r["q"], r["ref_q"], "f32", "q_out")
    assert_f16_rounding(r["k"][rows], ref_k64(r, pos, D, NKV, eps=1e-3, mscale=1.2345, NH=NH,
                                              has_q=True), "k_cache rows")


def test_rebased_positions_give_same_scores(backend, rng):
    """q.k depends on position differences only: a window at offset 0 and the
    same window at 2^20+777 / 2^30+3 give the same scores (up to f16 K)."""
    D, NH, NKV = 64, 2, 1
    C, B = 12, 4
    rel_k = np.arange(C)
    rel_q = C + np.arange(B)
    qkv_k = rng.standard_normal((C, 2 * NKV * D)).astype(np.float32)
    qkv_q = rng.standard_normal((B, NH * D + 2 * NKV * D)).astype(np.float32)
    kn = rng.uniform(0.5, 1.5, D).astype(np.float32)
    qn = rng.uniform(0.5, 1.5, D).astype(np.float32)
    be = backend
    op_k = QkvNormRope(be, D, NH, NKV, False)
    op_q = QkvNormRope(be, D, NH, NKV, True)
    table = be.asarray(plain_table(D))

    def scores(offset, q_shift=0):
        kc = be.zeros((C + B + 1, NKV * D), np.float16)
        vc = be.zeros((C + B + 1, NKV * D), np.float16)
        op_k(be.asarray(qkv_k), be.asarray(kn), table, be.asarray((rel_k + offset).astype(np.int32)),
             be.asarray(np.arange(C, dtype=np.int32)), kc, vc)
        q_out = be.zeros((B, NH * D), np.float32)
        op_q(be.asarray(qkv_q), be.asarray(kn), table,
             be.asarray((rel_q + offset + q_shift).astype(np.int32)),
             be.asarray((C + np.arange(B)).astype(np.int32)), kc, vc, q_norm=be.asarray(qn), q_out=q_out)
        q = be.to_numpy(q_out).astype(np.float64).reshape(B, NH, D)
        k = be.to_numpy(kc)[:C + B].astype(np.float64).reshape(C + B, NKV, D)
        s = np.einsum("bhd,sd->bhs", q, k[:, 0])
        mag = np.einsum("bhd,sd->bhs", np.abs(q), np.abs(k[:, 0]))
        return s, mag

    s0, mag = scores(0)
    bound = 2 * 2.0**-11 * mag + 1e-5     # two independent f16 roundings of K
    for off in (2**20 + 777, 2**30 + 3):
        s1, _ = scores(off)
        assert (np.abs(s1 - s0) <= bound).all(), \
            f"offset {off}: max score diff {np.abs(s1 - s0).max():.3e}"
    # the check can fail: a one-position shift of Q alone changes the scores
    s2, _ = scores(2**20 + 777, q_shift=1)
    assert (np.abs(s2 - s0) > bound).any()


def test_invalid_rows_skipped_and_n_rows_prefix(backend, rng):
    """Rows outside [0, kv_rows) are not written; only the first n_rows rows run."""
    D, NH, NKV, kv_rows = 32, 2, 2, 10
    pos = [1, 2, 3, 4]
    rows = [-1, 3, kv_rows, 6]
    r = run_rope(backend, rng, D, NH, NKV, True, pos, rows, kv_rows, extra_rows=3, n_rows=4)
    assert_close(r["q"][:4], r["ref_q"], "f32", "q_out")
    assert np.isnan(r["q"][4:]).all(), "q_out rows beyond n_rows were written"
    for row, m in ((3, 1), (6, 3)):
        assert np.array_equal(r["v"][row].view(np.uint16), r["ref_v"][m].view(np.uint16))
    untouched = [i for i in range(kv_rows) if i not in (3, 6)]
    assert np.array_equal(r["k"][untouched].view(np.uint16), r["k0"][untouched].view(np.uint16))
    assert np.array_equal(r["v"][untouched].view(np.uint16), r["v0"][untouched].view(np.uint16))


def test_capture_replay(emu, rng):
    """The launch records into a graph and replays with new data in the same buffers."""
    be = emu
    D, NH, NKV, M = 32, 2, 1, 3
    op = QkvNormRope(be, D, NH, NKV, True)
    qkv = be.zeros((M, op.qkv_width), np.float32)
    kn, qn = be.asarray(np.ones(D, np.float32)), be.asarray(np.ones(D, np.float32))
    table = be.asarray(plain_table(D))
    pos, rows = be.zeros((M,), np.int32), be.asarray(np.arange(M, dtype=np.int32))
    kc, vc = be.zeros((M, NKV * D), np.float16), be.zeros((M, NKV * D), np.float16)
    q_out = be.zeros((M, NH * D), np.float32)
    s = be.stream()
    be.synchronize()  # the zeros are memset on the default stream; the graph runs on s
    be.begin_capture(s)
    op(qkv, kn, table, pos, rows, kc, vc, q_norm=qn, q_out=q_out, stream=s)
    g = be.end_capture(s)
    for step in range(2):
        x = rng.standard_normal((M, op.qkv_width)).astype(np.float32)
        p = rng.integers(0, 2**30, M).astype(np.int32)
        qkv[...] = x
        pos[...] = p
        g.launch(s)
        s.synchronize()  # (the next iteration's host writes into qkv/pos must wait for the replay)
        q, k, v = qkv_norm_rope_reference(x, np.ones(D), np.ones(D), plain_table(D), p, head_dim=D,
                                          n_head=NH, n_head_kv=NKV, has_q=True)
        assert_close(be.to_numpy(q_out), q, "f32", f"replay {step} q_out")
        assert np.array_equal(be.to_numpy(vc), v)


def test_bad_arguments_raise(emu):
    be = emu
    D, NH, NKV = 32, 2, 1
    op = QkvNormRope(be, D, NH, NKV, True)
    args = dict(qkv=be.zeros((2, op.qkv_width), np.float32), k_norm=be.zeros((D,), np.float32),
                inv_freq=be.zeros((D // 2,), np.float64), pos=be.zeros((2,), np.int32),
                rows=be.zeros((2,), np.int32), k_cache=be.zeros((4, NKV * D), np.float16),
                v_cache=be.zeros((4, NKV * D), np.float16), q_norm=be.zeros((D,), np.float32),
                q_out=be.zeros((2, NH * D), np.float32))
    op(**args)
    bad = [("pos", be.zeros((2,), np.int64), TypeError), ("inv_freq", be.zeros((D // 2,), np.float32), TypeError),
           ("k_cache", be.zeros((4, NKV * D + 1), np.float16), ValueError),
           ("qkv", be.zeros((2, op.qkv_width - 1), np.float32), ValueError),
           ("rows", be.zeros((1,), np.int32), ValueError),
           ("q_out", be.zeros((2, NH * D), np.float16), TypeError),
           ("q_norm", be.zeros((D + 2,), np.float32), ValueError)]
    for name, val, exc in bad:
        with pytest.raises(exc, match=name):
            op(**{**args, name: val})
    with pytest.raises(ValueError, match="q_out"):
        op(**{**args, "q_out": None})
    with pytest.raises(ValueError, match="even"):
        QkvNormRope(be, 33, 1, 1, True)


@pytest.mark.parametrize("has_q", [True, False])
def test_tile_live_skips_dead_rows_and_context_q(backend, rng, has_q):
    """tile_live (a lane batch's flags): rows of a 0 tile write nothing (cache rows and q_out
    keep their bits), rows of a 2 tile (context rows) write K and V but no Q, rows of a 1 tile
    all three, bit-identical to the launch without flags."""
    D, NH, NKV, M, kv_rows = 64, 4, 2, 53, 70
    op = QkvNormRope(backend, D, NH, NKV, has_q)
    qkv = backend.asarray((rng.standard_normal((M, op.qkv_width)) * 2).astype(np.float32))
    qn, kn = (backend.asarray(rng.uniform(0.5, 1.5, D).astype(np.float32)) for _ in range(2))
    tab = backend.asarray(plain_table(D))
    pos = backend.asarray(rng.integers(0, 2**20, M).astype(np.int32))
    rows_h = rng.permutation(kv_rows)[:M].astype(np.int32)
    rows = backend.asarray(rows_h)
    flags = np.array([2, 0, 1, 2], np.int32)              # 4 tiles for 53 rows
    k0 = rng.standard_normal((kv_rows, NKV * D)).astype(np.float16)
    outs = []
    for fl in (None, backend.asarray(flags)):
        kc, vc = backend.asarray(k0), backend.asarray(k0)
        kw = {}
        if has_q:
            kw = dict(q_norm=qn, q_out=backend.asarray(np.full((M, NH * D), np.nan, np.float32)))
        op(qkv, kn, tab, pos, rows, kc, vc, stream=None, tile_live=fl, **kw)
        outs.append((backend.to_numpy(kc), backend.to_numpy(vc), backend.to_numpy(kw["q_out"]) if has_q else None))
    (k_all, v_all, q_all), (k_fl, v_fl, q_fl) = outs
    tl = np.repeat(flags, 16)[:M]
    live_rows, dead_rows = rows_h[tl != 0], rows_h[tl == 0]
    np.testing.assert_array_equal(k_fl[live_rows].view(np.uint16), k_all[live_rows].view(np.uint16))
    np.testing.assert_array_equal(v_fl[live_rows].view(np.uint16), v_all[live_rows].view(np.uint16))
    np.testing.assert_array_equal(k_fl[dead_rows].view(np.uint16), k0[dead_rows].view(np.uint16))
    np.testing.assert_array_equal(v_fl[dead_rows].view(np.uint16), k0[dead_rows].view(np.uint16))
    if has_q:
        np.testing.assert_array_equal(q_fl[tl == 1].view(np.uint32), q_all[tl == 1].view(np.uint32))
        assert np.isnan(q_fl[tl != 1]).all()
    with pytest.raises(ValueError, match="tile_live must hold"):
        op(qkv, kn, tab, pos, rows, backend.asarray(k0), backend.asarray(k0),
           tile_live=backend.asarray(flags[:3]), **({"q_norm": qn, "q_out": backend.asarray(np.zeros((M, NH * D), np.float32))} if has_q else {}))
