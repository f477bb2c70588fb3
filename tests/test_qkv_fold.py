"""The qkv GEMM with the q/k norm + RoPE + K/V ring scatter folded into its epilogue
(gemm_wgmma.cu GW_EPI 3, ``Gemm(rope=RopeSpec(...))``): bit for bit what the qkv GEMM
followed by ``QkvNormRope`` (rope.cu) writes — Q rows, the K/V ring rows at their slots, and
nothing else — on the emulator, for both wgmma variants, split K or not, hi + lo or one
rounding, x16, the folded input norm, padding rows, ring rows out of range, large positions,
and a lane batch's tile_live (dead rows, context rows without Q) with the per-launch K split.
Also: where the fold does not apply (a gemm_stream.cu launch, heads straddling column
groups) the call refuses ``rope`` and the step issuer runs the separate kernel."""
import numpy as np
import pytest

from dflash_cupy.kv_pages import physical_rows
from dflash_cupy.ops import gemm_stream as gs
from dflash_cupy.ops.gemm import Gemm
from dflash_cupy.ops.rope import QkvNormRope, RopeSpec
from tests.support.gemm import host_weights, qkv_setup
from tests.support.rope import plain_table

MAX_M = 300


def _both(be, spec, d, m, g_plain, g_fused, gemm_kw, tile_live=None):
    """(separate, fused) outputs: q_out, k_cache, v_cache as bits."""
    outs = []
    rope = QkvNormRope(be, spec.head_dim, spec.n_head, spec.n_head_kv, True, spec.eps, spec.attn_scale_factor)
    for fused in (False, True):
        kc, vc = be.asarray(d["k0"]), be.asarray(d["v0"])
        q = be.asarray(np.full((m, spec.q_width), 7.5, np.float32))
        if fused:
            assert g_fused.fuses_rope(m)
            g_fused(d["x"], d["w"], q, m, rope=(d["qn"], d["kn"], d["freq"], d["pos"], d["rows"], kc, vc),
                    tile_live=tile_live, **gemm_kw)
        else:
            qkv = be.zeros((m, d["N"]), np.float32)
            g_plain(d["x"], d["w"], qkv, m, tile_live=tile_live, **gemm_kw)
            rope(qkv, d["kn"], d["freq"], d["pos"], d["rows"], kc, vc, q_norm=d["qn"], q_out=q,
                 tile_live=tile_live)
        outs.append((be.to_numpy(q).view(np.uint32), be.to_numpy(kc).view(np.uint16),
                     be.to_numpy(vc).view(np.uint16)))
    return outs


def _assert_same(outs, what):
    (q0, k0, v0), (q1, k1, v1) = outs
    np.testing.assert_array_equal(q1, q0, err_msg=f"{what}: Q")
    np.testing.assert_array_equal(k1, k0, err_msg=f"{what}: K ring")
    np.testing.assert_array_equal(v1, v0, err_msg=f"{what}: V ring")


# head_dim 128: groups [Q0 Q1] [Q2 K0] [V0 + nothing] (a partial last group);
# head_dim 64: [Q0..Q3] [Q4 K0 V0] (Q, K and V in one partial group)
SPECS = [RopeSpec(128, 3, 1, 1e-6, 1.0), RopeSpec(64, 5, 1, 1e-5, 1.25)]


@pytest.mark.parametrize("spec", SPECS, ids=["d128", "d64"])
@pytest.mark.parametrize("variant,ks", [("wg64", 1), ("wg128", 1), ("wg64", 2), ("wg128", 2)])
def test_fused_equals_gemm_then_rope(emu, rng, spec, variant, ks):
    """Bit for bit, bf16 weights, hi + lo and one rounding, folded input norm or not."""
    K, m, kv_rows = 520, 150, 200
    d = qkv_setup(emu, rng, spec, K, m, "bf16", kv_rows)
    for x_split in (True, False):
        for norm in (False, True):
            kw = dict(max_m=MAX_M, path="stream", x_split=x_split, norm_eps=1e-6 if norm else None)
            g_plain = Gemm(emu, d["N"], K, "bf16", **kw)
            g_fused = Gemm(emu, d["N"], K, "bf16", rope=spec, **kw)
            for g in (g_plain, g_fused):
                g.use_config(m, (variant, ks))
            gemm_kw = dict(norm=(d["ln"], 9)) if norm else {}
            outs = _both(emu, spec, d, m, g_plain, g_fused, gemm_kw)
            _assert_same(outs, f"{variant} ks={ks} x_split={x_split} norm={norm}")
            q, k, _ = outs[1]
            assert not (q == np.float32(7.5).view(np.uint32)).any()       # every Q row written
            kept = np.setdiff1d(np.arange(kv_rows), emu.to_numpy(d["rows"])[:m])
            assert (k[kept] == d["k0"].view(np.uint16)[kept]).all()       # other ring rows untouched

def test_fused_f16_x16_and_padding_rows(emu, rng):
    """f16 weights with x already in the weight type (x16), padding rows (zeros, as the
    single cache's unused append rows) and a split: the same bits on every other row; the
    fused epilogue leaves the padding rows' Q and ring rows alone (their Q is never read, and
    the single cache sends their K/V to the trash slot), where the separate kernel writes a
    rotated zero."""
    spec = SPECS[0]
    K, m, kv_rows = 520, 70, 120
    d = qkv_setup(emu, rng, spec, K, m, "f16", kv_rows, x16=True)
    plo, phi = 20, 40
    pad = (emu.asarray(np.array([plo], np.int32)), phi)
    keep = np.r_[0:plo, phi:m]
    ring = emu.to_numpy(d["rows"])
    pad_ring = [r for r in ring[plo:phi] if 0 <= r < kv_rows]
    for variant, ks in (("wg64", 1), ("wg128", 2)):
        kw = dict(max_m=MAX_M, path="stream", x_split=False, x16=True)
        g_plain = Gemm(emu, d["N"], K, "f16", **kw)
        g_fused = Gemm(emu, d["N"], K, "f16", rope=spec, **kw)
        for g in (g_plain, g_fused):
            g.use_config(m, (variant, ks))
        (q0, k0, v0), (q1, k1, v1) = _both(emu, spec, d, m, g_plain, g_fused, dict(pad_rows=pad))
        what = f"{variant} ks={ks}"
        np.testing.assert_array_equal(q1[keep], q0[keep], err_msg=f"{what}: Q")
        assert (q1[plo:phi] == np.float32(7.5).view(np.uint32)).all(), what   # untouched
        others = np.setdiff1d(np.arange(kv_rows), pad_ring)
        np.testing.assert_array_equal(k1[others], k0[others], err_msg=f"{what}: K ring")
        np.testing.assert_array_equal(v1[others], v0[others], err_msg=f"{what}: V ring")
        assert (k1[pad_ring] == d["k0"].view(np.uint16)[pad_ring]).all(), what
        assert (v1[pad_ring] == d["v0"].view(np.uint16)[pad_ring]).all(), what
        assert (k0[pad_ring] != d["k0"].view(np.uint16)[pad_ring]).any()   # the separate kernel wrote them


@pytest.mark.parametrize("spec", SPECS, ids=["d128", "d64"])
def test_lane_batch_tile_live(emu, rng, spec):
    """A lane batch's qkv: live split (the K split chosen on the device), tiles marked 0
    (idle lanes: nothing written) and 2 (context rows: K and V, no Q), the Q column groups
    skipped for them: the fused launch writes exactly what GEMM + qkv_norm_rope(tile_live) do."""
    K, m, kv_rows = 520, 290, 400
    d = qkv_setup(emu, rng, spec, K, m, "bf16", kv_rows)
    kw = dict(max_m=MAX_M, path="stream", x_split=False, norm_eps=1e-6, live_split=True,
              skip_cols=spec.q_width)
    g_plain = Gemm(emu, d["N"], K, "bf16", **kw)
    g_fused = Gemm(emu, d["N"], K, "bf16", rope=spec, **kw)
    n_t = -(-m // 16)
    patterns = [np.ones(n_t, np.int32), np.full(n_t, 2, np.int32)]
    for _ in range(2):
        patterns.append(rng.choice([0, 1, 2], n_t, p=[0.3, 0.35, 0.35]).astype(np.int32))
    for flags in patterns:
        tl = emu.asarray(flags)
        outs = _both(emu, spec, d, m, g_plain, g_fused, dict(norm=(d["ln"], 0)), tile_live=tl)
        _assert_same(outs, f"flags={flags.tolist()}")
        q = outs[1][0]
        rows_tl = np.repeat(flags, 16)[:m]
        untouched = np.float32(7.5).view(np.uint32)
        assert (q[rows_tl != 1] == untouched).all()   # dead and context rows: no Q
        assert not (q[rows_tl == 1] == untouched).any()


def test_where_the_fold_does_not_apply(emu, rng):
    spec = SPECS[0]
    N, K = spec.q_width + 2 * spec.kv_width, 264
    g = Gemm(emu, N, K, "bf16", max_m=MAX_M, path="stream", rope=spec)
    assert g.fuses_rope(100) and not g.fuses_rope(20)     # m < WG_MIN_M: gemm_stream.cu
    g.use_config(100, (4, 1))                              # a tuned gemm_stream.cu launch: no fold
    assert not g.fuses_rope(100)
    x = emu.asarray(rng.standard_normal((100, K)).astype(np.float32))
    w = emu.asarray(host_weights(rng, N, K, "bf16"))
    q = emu.zeros((100, spec.q_width), np.float32)
    kc, vc = emu.zeros((128, spec.kv_width), np.float16), emu.zeros((128, spec.kv_width), np.float16)
    ints = emu.zeros((100,), np.int32)
    args = (emu.asarray(np.ones(128, np.float32)), emu.asarray(np.ones(128, np.float32)),
            emu.asarray(plain_table(128)), ints, ints, kc, vc)
    with pytest.raises(ValueError, match="cannot fold"):
        g(x, w, q, 100, rope=args)
    # a head straddling two column groups (head_dim 96 does not divide 256): never fused
    s96 = RopeSpec(96, 4, 2)
    g96 = Gemm(emu, s96.q_width + 2 * s96.kv_width, K, "bf16", max_m=MAX_M, path="stream", rope=s96)
    assert not g96.fuses_rope(100) and gs.qkv_fold_problem(768, 1, 96, 384, 192) is not None
    with pytest.raises(ValueError, match="N = q_width"):
        Gemm(emu, N + 8, K, "bf16", max_m=MAX_M, path="stream", rope=spec)
    with pytest.raises(TypeError, match="RopeSpec"):
        Gemm(emu, N, K, "bf16", max_m=MAX_M, path="stream", rope=(128, 3, 1))
    g2 = Gemm(emu, N, K, "bf16", max_m=MAX_M, path="stream", rope=spec)
    with pytest.raises(ValueError, match="q_out must have shape"):
        g2(x, w, emu.zeros((100, spec.q_width + 1), np.float32), 100, rope=args)
    with pytest.raises(ValueError, match="k_norm must have shape"):
        g2(x, w, q, 100, rope=(args[0], emu.zeros((64,), np.float32)) + args[2:])


@pytest.mark.parametrize("ks,flags", [(1, None), (2, None), (1, "lanes")])
def test_emulator_counts_match_the_static_model(ks, flags):
    """A fused launch counted by the emulator (every block) against profiling/counters.py's
    static model of GW_EPI 3: wgmma work, barriers, shared-memory requests and wavefronts
    (the tile's staging and the epilogue's loads; not with the live split) and the bytes
    stored (Q, K, V, split-K partials) exactly; global load sectors within 3%."""
    from profiling import counters as ctr
    from profiling.emulated_counters import run_counted
    from profiling.step_trace import RecordingBackend

    rng = np.random.default_rng(5)
    spec = SPECS[0]
    N, K, m, kv_rows = spec.q_width + 2 * spec.kv_width, 520, 150, 200
    rec = RecordingBackend()
    lanes = flags == "lanes"
    g = Gemm(rec, N, K, "bf16", max_m=MAX_M, path="stream", x_split=False, rope=spec, live_split=lanes,
             skip_cols=spec.q_width if lanes else 0)
    if not lanes:
        g.use_config(m, ("wg128", ks))
    tl = None
    if lanes:
        f = np.array([2, 2, 0, 1, 0, 0, 0, 0, 1, 2], np.int32)
        tl = rec.asarray(f)
    kc, vc = rec.zeros((kv_rows, spec.kv_width), np.float16), rec.zeros((kv_rows, spec.kv_width), np.float16)
    g(rec.asarray(rng.standard_normal((m, K)).astype(np.float32)), rec.asarray(host_weights(rng, N, K, "bf16")),
      rec.zeros((m, spec.q_width), np.float32), m, tile_live=tl,
      rope=(rec.asarray(np.ones(128, np.float32)), rec.asarray(np.ones(128, np.float32)),
            rec.asarray(plain_table(128)), rec.asarray(rng.integers(0, 2**20, m).astype(np.int32)),
            rec.asarray(rng.permutation(kv_rows)[:m].astype(np.int32)), kc, vc))
    L = rec.eager[-1]
    assert L.kernel == "gemm_wgmma" and L.defines["GW_EPI"] == 3
    if lanes:
        L.known["tile_live"] = tuple(int(v) for v in f)
    st = ctr.static_counters(L)
    lc, _, _ = run_counted(L, n=10**6)
    assert lc.wgmma_mma == st.wgmma_mma > 0
    assert lc.barriers == st.barriers
    if not lanes:   # (the live split's tile_live scan in shared memory has no static model)
        assert lc.sst_requests + lc.sld_requests == st.smem_requests
        assert lc.sst_wavefronts + lc.sld_wavefronts == st.smem_wavefronts
    assert lc.gst_bytes == st.gst_bytes, (lc.gst_bytes, st.gst_bytes)
    assert abs(lc.gld_sectors - st.gld_sectors) <= 0.03 * st.gld_sectors, (lc.gld_sectors, st.gld_sectors)


@pytest.mark.parametrize("drafter", ["h4096", "qwen3.5-27b"])
def test_recorded_steps_have_no_separate_rope(drafter):
    """The recorded step graphs (profiling.step_trace) at real shapes: one lane
    (DraftKvCache) and a 16-lane batch run the qkv GEMM with the fold (GW_EPI 3) in every
    layer and no qkv_norm_rope node."""
    from profiling.common import drafter_config
    from profiling.lanes_model import trace_batch_step
    from profiling.step_trace import trace_step

    c = drafter_config(drafter)
    single = trace_step(c, 2048).launches
    _, batch = trace_batch_step(c, 2048, 16, 16)
    for nodes in (single, batch):
        kernels = [getattr(n, "kernel", None) for n in nodes]
        assert "qkv_norm_rope" not in kernels
        assert sum(1 for n in nodes if getattr(n, "kernel", None) == "gemm_wgmma"
                   and n.defines.get("GW_EPI") == 3) == c.n_layer


@pytest.mark.parametrize("drafter", ["h4096", "qwen3.5-27b"])
def test_recorded_steps_fold_the_hidden_norm(drafter):
    """One lane and a 16-lane batch: no rmsnorm node but the final norm (the hidden norm is
    folded into every layer's qkv GEMM as ln_lo, the input norms as ln); every qkv launch
    reads the context rows from x and the noise rows from its second pointer (noise_embed
    in the first layer, h after), with ln_lo set; the fc GEMM writes the qkv GEMMs' x."""
    from profiling.common import drafter_config
    from profiling.lanes_model import trace_batch_step
    from profiling.step_trace import trace_step

    c = drafter_config(drafter)
    single = trace_step(c, 2048).launches
    _, batch = trace_batch_step(c, 2048, 16, 16)
    for nodes in (single, batch):
        kernels = [getattr(n, "kernel", None) for n in nodes]
        qkv = [i for i, n in enumerate(nodes) if getattr(n, "kernel", None) == "gemm_wgmma"
               and n.defines.get("GW_EPI") == 3]
        assert len(qkv) == c.n_layer
        assert kernels.count("rmsnorm") == 1 and kernels.index("rmsnorm") > qkv[-1]   # the final norm only
        qkv = [nodes[i] for i in qkv]
        splits = {int(n.arg("row_split")) for n in qkv}
        assert len(splits) == 1 and 0 < splits.pop() < int(qkv[0].arg("M"))     # context rows, then noise rows
        assert all(int(n.arg("use_ln_lo")) == 1 for n in qkv)                   # ln_lo used
        x2s = [n.arg("x2").name for n in qkv]
        assert "noise_embed" in x2s[0] and all("noise_embed" not in x for x in x2s[1:]), x2s
        assert len({n.arg("x").name for n in qkv}) == 1


def test_cache_steps_fused_equal_unfused_and_the_oracle(monkeypatch):
    """A DraftKvCache whose qkv GEMM folds the rope (q_len 16: 50 step rows, the wgmma kernel;
    head_dim 32: Q, K and V heads in one column group) against the same cache with the fold
    turned off, over growth, a slide past the capacity (ring wraparound), a rewind and
    positions past 2^20: hidden states and every layer's K/V rows bit for bit, and each step
    against the float64 oracle (tests/support/drafters.Driver)."""
    from dflash_cupy import backends
    from tests.support.drafters import BF16, SPECS, Driver, Spec, small_config

    monkeypatch.setitem(SPECS, "Q", Spec(
        small_config(n_layer=2, hidden_size=64, n_head=4, n_head_kv=2, head_dim=32, intermediate_size=48,
             block_size=16, target_layer_ids=(0, 2), layer_sliding=(False, True), sliding_window=20),
        BF16, capacity=40, ring_capacity=48, ring_dtype=BF16))
    be = backends.get("emulated")
    base = 2**20 + 3
    d, d0 = Driver(be, "Q", base=base, seed=3), Driver(be, "Q", base=base, seed=3)
    d0.kv.g_qkv.fuses_rope = lambda m: False      # the separate qkv_norm_rope launch
    try:
        A, B = d.kv.a_step, d.kv.q_len
        assert d.kv.g_qkv.fuses_rope(A + B)
        for c in (5, 20, 33, 60, 61, 95, 45, 46):     # 45: a rewind (reset + bulk append)
            c += base
            if c < d.valid_hi:
                d.forget_from(c)
                d0.forget_from(c)
            d.step(c)
            d0.step(c)
            np.testing.assert_array_equal(be.to_numpy(d.kv.hidden_states), be.to_numpy(d0.kv.hidden_states),
                                          err_msg=f"hidden c={c}")
            # every cache row but the trash slot, which the padding rows of a live context
            # tile write (stale features: what lands there is never read, and differs)
            # (logical rows, read through the lane's page table: the same in both caches)
            assert np.array_equal(d.kv.engine.kv_pages.table, d0.kv.engine.kv_pages.table)
            keep = physical_rows(d.kv.engine.kv_pages.table[0], d.kv.page, d.kv.kv_total)[
                np.arange(d.kv.kv_total) != d.kv.trash_slot]
            for li in range(2):
                for name in ("k_cache", "v_cache"):
                    np.testing.assert_array_equal(be.to_numpy(getattr(d.kv, name)[li]).view(np.uint16)[keep],
                                                  be.to_numpy(getattr(d0.kv, name)[li]).view(np.uint16)[keep],
                                                  err_msg=f"{name}[{li}] c={c}")
    finally:
        d.close()
        d0.close()
