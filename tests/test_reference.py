"""The float64 oracle (dflash_cupy.reference): a hand-written scalar re-implementation,
RoPE and its scalings, masks (one-shot visibility and the ring masks of SPEC §3),
position invariance, GQA, the optional variants and the LM head."""
import math

import ml_dtypes
import numpy as np
import pytest

from dflash_cupy import reference as R
from dflash_cupy.config import DraftConfig
from dflash_cupy.geometry import RingGeometry
from dflash_cupy.mask_rule import MaskRule
from dflash_cupy.weights import DraftWeights


def cfg(**kw):
    base = dict(n_layer=2, hidden_size=32, n_head=4, n_head_kv=2, head_dim=8,
                intermediate_size=48, block_size=5, target_layer_ids=(1, 4, 7),
                rope_theta=10000.0, layer_sliding=(True, False), sliding_window=4)
    base.update(kw)
    return DraftConfig(**base)


def inputs(c, C, seed=0, B=None):
    rng = np.random.default_rng(seed)
    B = c.block_size if B is None else B
    return rng.standard_normal((C, c.fc_in)), rng.standard_normal((B, c.hidden_size))


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# =========================================================== scalar re-implementation
def s_rmsnorm(v, w, eps):
    r = 1.0 / math.sqrt(sum(x * x for x in v) / len(v) + eps)
    return [x * r * wi for x, wi in zip(v, w)]


def s_matvec(W, v):
    return [sum(W[i][j] * v[j] for j in range(len(v))) for i in range(len(W))]


def s_rope(v, p, theta):
    d = len(v)
    half = d // 2
    out = [0.0] * d
    for i in range(half):
        a = p * theta ** (-2.0 * i / d)
        out[i] = v[i] * math.cos(a) - v[i + half] * math.sin(a)
        out[i + half] = v[i + half] * math.cos(a) + v[i] * math.sin(a)
    return out


def scalar_forward(c, W, X, E, pos0):
    """SPEC §2 with Python floats and loops only (no NumPy math)."""
    H, nh, nkv, d, eps = c.hidden_size, c.n_head, c.n_head_kv, c.head_dim, c.rms_norm_eps
    rep = nh // nkv
    C, B = len(X), len(E)
    pos = [pos0 + k for k in range(C + B)]
    T = [s_rmsnorm(s_matvec(W["fc.weight"], x), W["hidden_norm.weight"], eps) for x in X]
    h = [list(e) for e in E]
    for l in range(c.n_layer):
        def w(n):
            return W[f"layers.{l}.{n}.weight"]
        hn = [s_rmsnorm(r, w("input_layernorm"), eps) for r in h]
        src = T + hn
        K, V = [], []
        for s in range(C + B):
            kr = s_matvec(w("self_attn.k_proj"), src[s])
            vr = s_matvec(w("self_attn.v_proj"), src[s])
            K.append([s_rope(s_rmsnorm(kr[g * d:(g + 1) * d], w("self_attn.k_norm"), eps),
                             pos[s], c.rope_theta) for g in range(nkv)])
            V.append([vr[g * d:(g + 1) * d] for g in range(nkv)])
        sw = c.sliding_window or 0
        eff = sw if 0 < sw < C else C
        sliding = c.layer_sliding[l]
        causal = (sliding if c.is_causal is None else c.is_causal)
        new_h = []
        for b in range(B):
            qr = s_matvec(w("self_attn.q_proj"), hn[b])
            attn_row = []
            for i in range(nh):
                q = s_rope(s_rmsnorm(qr[i * d:(i + 1) * d], w("self_attn.q_norm"), eps),
                           pos[C + b], c.rope_theta)
                g = i // rep
                keys = []
                for s in range(C + B):
                    qpos, kpos = pos[C + b], pos[s]
                    ok = not (causal and kpos > qpos)
                    if sliding and c.window_rule == "anchored":    # SPEC §3.5
                        ok = ok and (s >= C - eff)
                    elif sliding and sw:                           # SPEC §6: per row
                        ok = ok and abs(qpos - kpos) < sw
                    if ok:
                        keys.append(s)
                scores = [sum(q[e] * K[s][g][e] for e in range(d)) / math.sqrt(d) for s in keys]
                m = max(scores)
                ex = [math.exp(x - m) for x in scores]
                z = sum(ex)
                attn_row += [sum(ex[t] / z * V[s][g][e] for t, s in enumerate(keys))
                             for e in range(d)]
            o = s_matvec(w("self_attn.o_proj"), attn_row)
            hb = [h[b][j] + o[j] for j in range(H)]
            hf = s_rmsnorm(hb, w("post_attention_layernorm"), eps)
            gt, up = s_matvec(w("mlp.gate_proj"), hf), s_matvec(w("mlp.up_proj"), hf)
            act = [gi / (1.0 + math.exp(-gi)) * ui for gi, ui in zip(gt, up)]
            dn = s_matvec(w("mlp.down_proj"), act)
            new_h.append([hb[j] + dn[j] for j in range(H)])
        h = new_h
    return [s_rmsnorm(r, W["norm.weight"], eps) for r in h]


@pytest.mark.parametrize("kw,C,B", [
    # the smallest drafter: H=2, one head of d=2, one full layer
    (dict(n_layer=1, hidden_size=2, n_head=1, n_head_kv=1, head_dim=2, intermediate_size=3,
          block_size=2, target_layer_ids=(0,), layer_sliding=(), sliding_window=None), 1, 2),
    # GQA, two captured layers, a sliding layer whose window cuts the context, then a full one
    (dict(n_layer=2, hidden_size=4, n_head=2, n_head_kv=1, head_dim=2, intermediate_size=5,
          block_size=3, target_layer_ids=(0, 3), layer_sliding=(True, False),
          sliding_window=2), 4, 3),
    # the seed's anchored window
    (dict(n_layer=2, hidden_size=4, n_head=2, n_head_kv=1, head_dim=2, intermediate_size=5,
          block_size=3, target_layer_ids=(0, 3), layer_sliding=(True, False),
          sliding_window=2, window_rule="anchored"), 4, 3),
    # is_causal: False (DFlash 2's published config): a bidirectional sliding window, a
    # window of 3 reaching past the block's next row
    (dict(n_layer=2, hidden_size=4, n_head=2, n_head_kv=1, head_dim=2, intermediate_size=5,
          block_size=3, target_layer_ids=(0, 3), layer_sliding=(True, False),
          sliding_window=2, is_causal=False), 4, 3),
    # is_causal: True makes the full layer causal inside the block too
    (dict(n_layer=2, hidden_size=4, n_head=2, n_head_kv=1, head_dim=2, intermediate_size=5,
          block_size=3, target_layer_ids=(0, 3), layer_sliding=(False, True),
          sliding_window=3, is_causal=True), 4, 3),
])
def test_matches_scalar_loops(kw, C, B):
    c = cfg(**kw)
    w = DraftWeights.random(c, seed=21)
    X, E = inputs(c, C, seed=22, B=B)
    W = {k: R.f64(v).tolist() for k, v in w.items()}
    ref = scalar_forward(c, W, X.tolist(), E.tolist(), pos0=7)
    got = R.draft_forward(w, X, E, pos_offset=7)
    assert got.shape == (B, c.hidden_size) and got.dtype == np.float64
    assert max_err(got, ref) < 1e-12


# =========================================================== RoPE
def test_apply_rope_is_complex_rotation():
    rng = np.random.default_rng(1)
    c = cfg()
    x = rng.standard_normal((6, 3, 8))
    pos = np.array([0, 1, 5, 1000, 2**20, 2**20 + 17])
    got = R.apply_rope(x, pos, c)
    inv, _ = R.rope_parameters(c)
    z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * pos[:, None, None] * inv[None, None, :])
    np.testing.assert_allclose(got[..., :4], z.real, atol=1e-12)
    np.testing.assert_allclose(got[..., 4:], z.imag, atol=1e-12)
    np.testing.assert_array_equal(R.apply_rope(x, np.zeros(6, int), c), x)
    # YaRN: the attention scaling multiplies q and k (HF scales cos and sin)
    cy = cfg(rope_scaling={"rope_type": "yarn", "factor": 8.0,
                           "original_max_position_embeddings": 64}, max_position_embeddings=512)
    scale = R.rope_parameters(cy)[1]
    assert scale == pytest.approx(0.1 * math.log(8) + 1)
    np.testing.assert_allclose(np.linalg.norm(R.apply_rope(x, pos, cy), axis=-1),
                               scale * np.linalg.norm(x, axis=-1), rtol=1e-13)


def test_rope_scores_depend_on_differences_only():
    rng = np.random.default_rng(2)
    c = cfg(rope_scaling={"rope_type": "yarn", "factor": 2.0,
                          "original_max_position_embeddings": 64}, max_position_embeddings=128)
    q, k = rng.standard_normal((1, 1, 8)), rng.standard_normal((1, 1, 8))
    s = [float(np.sum(R.apply_rope(q, [p + 9], c) * R.apply_rope(k, [p], c)))
         for p in (0, 1000, 2**20, 2**24)]
    assert max(s) - min(s) < 1e-8


# =========================================================== masks
def anchored(w):
    return MaskRule(w or 0, per_row=False)


def test_layer_visibility_tables():
    T, F = True, False
    full = R.layer_visibility(3, 2, False, 2)
    assert full.all() and full.shape == (2, 5)
    # anchored, window 2 < C=3: last two context rows, causal noise
    np.testing.assert_array_equal(R.layer_visibility(3, 2, True, anchored(2)),
                                  [[F, T, T, T, F],
                                   [F, T, T, T, T]])
    # per row (the default), window 2: keys less than 2 positions behind each row
    np.testing.assert_array_equal(R.layer_visibility(3, 2, True, 2),
                                  [[F, F, T, T, F],
                                   [F, F, F, T, T]])
    # per row, not causal (is_causal: false), window 2: one row ahead as well
    np.testing.assert_array_equal(R.layer_visibility(3, 3, True, MaskRule(2, causal_sliding=False)),
                                  [[F, F, T, T, T, F],
                                   [F, F, F, T, T, T],
                                   [F, F, F, F, T, T]])
    # causal full layers (is_causal: true)
    np.testing.assert_array_equal(R.layer_visibility(2, 2, False, MaskRule(0, causal_full=True)),
                                  [[T, T, T, F],
                                   [T, T, T, T]])
    # anchored window >= C, or none: the whole context; per row, none
    for w in (3, 10, 0, None):
        np.testing.assert_array_equal(R.layer_visibility(3, 3, True, anchored(w)),
                                      [[T, T, T, T, F, F],
                                       [T, T, T, T, T, F],
                                       [T, T, T, T, T, T]])
    np.testing.assert_array_equal(R.layer_visibility(3, 3, True, None),
                                  R.layer_visibility(3, 3, True, anchored(0)))


def _visible_cols(mask_row):
    assert set(np.unique(mask_row.astype(np.float64)).tolist()) <= {0.0, -np.inf}
    return sorted(np.nonzero(mask_row == 0)[0].tolist())


RING_CASES = [
    # capacity, q_len, committed, swa_window, slot_pos,
    #   full ctx cols, swa ctx cols (ring slots visible)
    # partially filled ring, no window limit
    (4, 2, 3, 0, [0, 1, 2, -1], [0, 1, 2], [0, 1, 2]),
    # window 2 < win=3
    (4, 2, 3, 2, [0, 1, 2, -1], [0, 1, 2], [1, 2]),
    # window >= win: same as full
    (4, 2, 3, 5, [0, 1, 2, -1], [0, 1, 2], [0, 1, 2]),
    # wrapped: positions 2..5 sit in slots 2,3,0,1
    (4, 2, 6, 0, [4, 5, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]),
    (4, 2, 6, 2, [4, 5, 2, 3], [0, 1, 2, 3], [0, 1]),
    (4, 2, 6, 3, [4, 5, 2, 3], [0, 1, 2, 3], [0, 1, 3]),
    # stale and future rows stay hidden: slot 1 holds 1 < lo=2, slot 2 holds 6 = committed
    (4, 3, 6, 3, [4, 1, 6, 3], [0, 3], [0, 3]),
    # window win+1 and larger behave as no window: the stale row lo-1 stays hidden
    (4, 2, 6, 5, [4, 5, 1, 3], [0, 1, 3], [0, 1, 3]),
    (4, 2, 6, 4, [4, 5, 1, 3], [0, 1, 3], [0, 1, 3]),
    # capacity 1
    (1, 1, 9, 0, [8], [0], [0]),
    (1, 1, 9, 1, [8], [0], [0]),
]


@pytest.mark.parametrize("cap,q,committed,w,slot_pos,full_ctx,swa_ctx", RING_CASES)
def test_ring_masks_hand_written(cap, q, committed, w, slot_pos, full_ctx, swa_ctx):
    geom = RingGeometry(capacity=cap, q_len=q)
    mf, ms = R.ring_masks(np.array(slot_pos), committed, geom, anchored(w))
    assert mf.dtype == np.float16 and ms.dtype == np.float16
    assert mf.shape == ms.shape == (q, geom.kv_total) == (q, 32)
    noise = [cap + j for j in range(q)]
    for row in range(q):
        assert _visible_cols(mf[row]) == full_ctx + noise
        assert _visible_cols(ms[row]) == swa_ctx + noise[:row + 1]
    # trash slot and padding are hidden, -inf exactly
    assert np.all(np.isneginf(mf[:, cap + q:])) and np.all(np.isneginf(ms[:, cap + q:]))


PER_ROW_CASES = [
    # capacity, q_len, committed, rule, slot_pos, per block row: (swa visible ring slots,
    #   swa visible noise slots j), full's noise slots j
    # wrapped: positions 2..5 in slots 2,3,0,1; window 3: row 0 (position 6) sees 4, 5
    (4, 2, 6, MaskRule(3), [4, 5, 2, 3], [([0, 1], [0]), ([1], [0, 1])], [[0, 1], [0, 1]]),
    # window 1: each row sees itself only
    (4, 2, 6, MaskRule(1), [4, 5, 2, 3], [([], [0]), ([], [1])], [[0, 1], [0, 1]]),
    # not causal, window 2: one block row ahead too
    (4, 3, 6, MaskRule(2, causal_sliding=False), [4, 5, 2, 3],
     [([1], [0, 1]), ([], [0, 1, 2]), ([], [1, 2])], [[0, 1, 2]] * 3),
    # causal full layers; a window past the ring's start: lo = 2 bounds it (slot 2 holds 1)
    (4, 2, 6, MaskRule(9, causal_full=True), [4, 5, 1, 3], [([0, 1, 3], [0]), ([0, 1, 3], [0, 1])],
     [[0], [0, 1]]),
    # capacity 1, a window as large as a position: no limit reached
    (1, 1, 2**20, MaskRule(2**20), [2**20 - 1], [([0], [0])], [[0]]),
]


@pytest.mark.parametrize("cap,q,committed,rule,slot_pos,swa_rows,full_noise", PER_ROW_CASES)
def test_ring_masks_per_row_hand_written(cap, q, committed, rule, slot_pos, swa_rows, full_noise):
    geom = RingGeometry(capacity=cap, q_len=q)
    sp = np.array(slot_pos)
    mf, ms = R.ring_masks(sp, committed, geom, rule)
    live = [s for s in range(cap) if committed - min(committed, cap) <= sp[s] < committed]
    for row in range(q):
        ring_cols, noise = swa_rows[row]
        assert _visible_cols(ms[row]) == ring_cols + [cap + j for j in noise]
        assert _visible_cols(mf[row]) == live + [cap + j for j in full_noise[row]]
    assert np.all(np.isneginf(mf[:, cap + q:])) and np.all(np.isneginf(ms[:, cap + q:]))


def test_ring_masks_literal_arrays():
    # capacity 3, q_len 2, committed 5, anchored window 2: slots hold 3, 4, 2
    geom = RingGeometry(capacity=3, q_len=2)
    mf, ms = R.ring_masks(np.array([3, 4, 2]), 5, geom, anchored(2))
    n = -np.inf
    want_full = np.full((2, 32), n)
    want_full[:, :5] = [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    want_swa = np.full((2, 32), n)
    want_swa[:, :5] = [[0, 0, n, 0, n], [0, 0, n, 0, 0]]
    np.testing.assert_array_equal(mf.astype(np.float64), want_full)
    np.testing.assert_array_equal(ms.astype(np.float64), want_swa)


@pytest.mark.parametrize("rule", [MaskRule, anchored, lambda w: MaskRule(w, causal_sliding=False,
                                                                         causal_full=True)])
@pytest.mark.parametrize("committed,cap,w", [(1, 8, 3), (5, 8, 3), (8, 8, 0), (13, 8, 3),
                                             (29, 8, 8), (29, 8, 9), (100, 33, 19), (100, 33, 2)])
def test_ring_masks_agree_with_one_shot_visibility(committed, cap, w, rule):
    """On a contiguously filled ring, the masks show the one-shot window's keys."""
    q = 3
    w = rule(w)
    geom = RingGeometry(capacity=cap, q_len=q)
    sp = R.contiguous_slot_pos(committed, cap)
    mf, ms = R.ring_masks(sp, committed, geom, w)
    C = min(committed, cap)
    lo = committed - C
    for mask, sliding in ((mf, False), (ms, True)):
        vis = R.layer_visibility(C, q, sliding, w)
        for row in range(q):
            got = sorted(int(sp[s]) - lo for s in _visible_cols(mask[row]) if s < cap)
            got += [C + s - cap for s in _visible_cols(mask[row]) if s >= cap]
            assert got == np.nonzero(vis[row])[0].tolist()


def test_ring_masks_bad_input():
    geom = RingGeometry(capacity=4, q_len=2)
    with pytest.raises(ValueError, match="slot_pos"):
        R.ring_masks(np.zeros(3, int), 2, geom, 0)
    with pytest.raises(ValueError, match="committed"):
        R.ring_masks(np.zeros(4, int), 0, geom, 0)
    with pytest.raises(ValueError, match="swa_window"):
        R.ring_masks(np.zeros(4, int), 2, geom, -1)


# =========================================================== forward properties
@pytest.mark.parametrize("offset", [12345, 2**20, 2**20 + 3])
def test_position_offset_invariance(offset):
    c = cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 64}, max_position_embeddings=256)
    w = DraftWeights.random(c, seed=3)
    X, E = inputs(c, 9, seed=4)
    assert max_err(R.draft_forward(w, X, E), R.draft_forward(w, X, E, pos_offset=offset)) < 1e-9


def test_positions_matter():
    c = cfg()
    w = DraftWeights.random(c, seed=3)
    X, E = inputs(c, 6, seed=4)
    C, B = 6, c.block_size
    base = R.draft_forward(w, X, E)
    shifted = R.draft_forward_positions(w, X, E, np.arange(C), C + 1 + np.arange(B))
    assert max_err(base, shifted) > 1e-3


def test_sliding_layer_is_full_context_with_causal_noise():
    C, B = 6, 5
    full_vis = np.ones((B, C + B), bool)
    causal_vis = np.concatenate([np.ones((B, C), bool), np.tril(np.ones((B, B), bool))], 1)
    X, E = inputs(cfg(), C, seed=5)
    # per row, key distances reach C + B - 1; anchored, a window of C is the whole context
    for window, rule in ((None, "per_row"), (C + B, "per_row"), (C + 10, "per_row"), (C, "anchored")):
        c = cfg(layer_sliding=(True, False), sliding_window=window, window_rule=rule)
        w = DraftWeights.random(c, seed=6)
        got = R.draft_forward(w, X, E)
        manual = R.draft_forward_positions(w, X, E, np.arange(C), C + np.arange(B),
                                           visible=[causal_vis, full_vis])
        assert max_err(got, manual) < 1e-13
        all_full = R.draft_forward_positions(w, X, E, np.arange(C), C + np.arange(B),
                                             visible=full_vis)
        assert max_err(got, all_full) > 1e-3  # the causal block matters
    c_full = cfg(layer_sliding=(False, False))
    w_full = DraftWeights(c_full, DraftWeights.random(cfg(), seed=6).tensors)
    assert max_err(R.draft_forward(w_full, X, E), all_full) < 1e-13


@pytest.mark.parametrize("rule", ["per_row", "anchored"])
def test_sliding_window_cuts_old_context(rule):
    C, B, win = 9, 5, 3
    c = cfg(layer_sliding=(True, True), sliding_window=win, window_rule=rule)
    w = DraftWeights.random(c, seed=7)
    X, E = inputs(c, C, seed=8)
    base = R.draft_forward(w, X, E)
    # anchored: rows older than C - win are invisible to every sliding layer; per row,
    # block row 0 (position C) sees positions > C - win only
    cut = C - win if rule == "anchored" else C - win + 1
    X2 = X.copy()
    X2[:cut] = np.random.default_rng(9).standard_normal((cut, c.fc_in))
    assert max_err(base, R.draft_forward(w, X2, E)) < 1e-13
    X3 = X.copy()
    X3[cut] += 1.0
    out3 = R.draft_forward(w, X3, E)
    assert max_err(base, out3) > 1e-3
    if rule == "per_row":   # ... and block row 1 no longer sees it (after the first layer,
        # row 1 reads row 0's output, so only a one-layer drafter isolates it: the
        # masks say it directly)
        vis = R.layer_visibility(C, B, True, c.mask_rule)
        assert vis[0, cut] and not vis[1, cut] and not vis[0, cut - 1]
    # causal noise: changing noise row 3 leaves rows 0..2 untouched
    E2 = E.copy()
    E2[3] += 1.0
    out2 = R.draft_forward(w, X, E2)
    assert max_err(base[:3], out2[:3]) < 1e-13 and max_err(base[3:], out2[3:]) > 1e-3
    # a full model sees everything
    wf = DraftWeights(c.replace(layer_sliding=(False, False)), w.tensors)
    bf = R.draft_forward(wf, X, E)
    assert max_err(bf, R.draft_forward(wf, X2, E)) > 1e-3
    assert max_err(bf[:3], R.draft_forward(wf, X, E2)[:3]) > 1e-3


def test_gqa_equals_mha_with_repeated_kv_heads():
    c = cfg(n_head=4, n_head_kv=2, layer_sliding=(True, False))
    w = DraftWeights.random(c, seed=10)
    X, E = inputs(c, 7, seed=11)
    c_mha = c.replace(n_head_kv=4)
    t = dict(w.tensors)
    H, d = c.hidden_size, c.head_dim
    for l in range(c.n_layer):
        for p in ("k_proj", "v_proj"):
            name = f"layers.{l}.self_attn.{p}.weight"
            t[name] = np.repeat(w[name].reshape(2, d, H), 2, axis=0).reshape(4 * d, H)
    w_mha = DraftWeights(c_mha, t)
    assert max_err(R.draft_forward(w, X, E), R.draft_forward(w_mha, X, E)) < 1e-12
    # and the head -> kv head map matters: pairing kv heads the other way changes the output
    t_bad = dict(t)
    for l in range(c.n_layer):
        for p in ("k_proj", "v_proj"):
            name = f"layers.{l}.self_attn.{p}.weight"
            t_bad[name] = np.tile(w[name].reshape(2, d, H), (2, 1, 1)).reshape(4 * d, H)
    w_bad = DraftWeights(c_mha, t_bad)
    assert max_err(R.draft_forward(w, X, E), R.draft_forward(w_bad, X, E)) > 1e-3


def test_weight_dtypes_are_widened_exactly():
    c = cfg()
    w16 = DraftWeights.random(c, seed=12, dtype="bf16")
    w32 = w16.astype("f32")  # the same values, exactly
    X, E = inputs(c, 5, seed=13)
    np.testing.assert_array_equal(R.draft_forward(w16, X, E), R.draft_forward(w32, X, E))
    X16 = X.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(R.draft_forward(w16, X16, E),
                                  R.draft_forward(w16, X16.astype(np.float64), E))


def test_lm_head_logits():
    c = cfg()
    w = DraftWeights.random(c, seed=14)
    X, E = inputs(c, 5, seed=15)
    lm = np.random.default_rng(16).standard_normal((50, c.hidden_size)).astype(ml_dtypes.bfloat16)
    hidden, logits = R.draft_forward(w, X, E, lm_head=lm)
    assert logits.shape == (c.block_size, 50)
    np.testing.assert_array_equal(hidden, R.draft_forward(w, X, E))
    np.testing.assert_allclose(logits, hidden @ lm.astype(np.float64).T, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="lm_head"):
        R.draft_forward(w, X, E, lm_head=lm.T)


def test_bad_inputs_name_the_argument():
    c = cfg()
    w = DraftWeights.random(c, seed=0)
    X, E = inputs(c, 4)
    with pytest.raises(ValueError, match="feat_rows"):
        R.draft_forward(w, X[:, :-1], E)
    with pytest.raises(ValueError, match="feat_rows"):
        R.draft_forward(w, X[:0], E)
    with pytest.raises(ValueError, match="noise_embed"):
        R.draft_forward(w, X, E[:, :5])
    with pytest.raises(ValueError, match="pos_noise"):
        R.draft_forward_positions(w, X, E, np.arange(4), np.arange(2))
    with pytest.raises(ValueError, match="visible"):
        R.draft_forward_positions(w, X, E, np.arange(4), np.arange(5), visible=[np.ones((5, 9))])


# =========================================================== variants
def test_aux_hidden_norms_equal_prenormalised_slices():
    c = cfg(aux_hidden_norms=True)
    w = DraftWeights.random(c, seed=19)
    X, E = inputs(c, 6, seed=20)
    base_t = {k: v for k, v in w.items() if not k.startswith("aux_hidden_norms")}
    w_base = DraftWeights(c.replace(aux_hidden_norms=False), base_t)
    H = c.hidden_size
    Xn = np.concatenate([R.rmsnorm(X[:, j * H:(j + 1) * H], w[f"aux_hidden_norms.{j}.weight"],
                                   c.rms_norm_eps) for j in range(c.n_captured)], axis=1)
    got = R.draft_forward(w, X, E)
    assert got.shape == (c.block_size, H)
    assert max_err(got, R.draft_forward(w_base, Xn, E)) < 1e-12
    assert max_err(got, R.draft_forward(w_base, X, E)) > 1e-3


def test_context_kv_layer_norm():
    # one layer, tiny eps: with hidden_norm = 1 the fused rows are already unit-rms, so
    # rmsnorm(T) * input_layernorm == T with hidden_norm := input_layernorm
    c = cfg(n_layer=1, layer_sliding=(False,), context_kv_layer_norm=True, rms_norm_eps=1e-12)
    w = DraftWeights.random(c, seed=23)
    X, E = inputs(c, 6, seed=24)
    t_on = dict(w.tensors, **{"hidden_norm.weight": np.ones(c.hidden_size, np.float32)})
    t_off = dict(w.tensors, **{"hidden_norm.weight": w["layers.0.input_layernorm.weight"]})
    on = R.draft_forward(DraftWeights(c, t_on), X, E)
    off = R.draft_forward(DraftWeights(c.replace(context_kv_layer_norm=False), t_off), X, E)
    assert on.shape == (c.block_size, c.hidden_size)
    assert max_err(on, off) < 1e-9
    plain = R.draft_forward(DraftWeights(c.replace(context_kv_layer_norm=False), w.tensors), X, E)
    assert max_err(R.draft_forward(w, X, E), plain) > 1e-3


@pytest.mark.parametrize("gate", ["head", "element"])
def test_attn_gate(gate):
    c = cfg(attn_gate=gate)
    w = DraftWeights.random(c, seed=25)
    X, E = inputs(c, 6, seed=26)
    rows = c.n_head if gate == "head" else c.n_head * c.head_dim
    assert w["layers.0.self_attn.gate_proj.weight"].shape == (rows, c.hidden_size)
    plain_t = {k: v for k, v in w.items() if "self_attn.gate_proj" not in k}
    c_plain = c.replace(attn_gate="none")
    gated = R.draft_forward(w, X, E)
    assert gated.shape == (c.block_size, c.hidden_size)
    assert max_err(gated, R.draft_forward(DraftWeights(c_plain, plain_t), X, E)) > 1e-3
    # zero gate weights: softplus(0) = ln 2 on every head, the same as scaling o_proj by ln 2
    # (up to the f32 rounding of the scaled o_proj; a sigmoid gate would give 0.5 instead)
    zero_t = dict(w.tensors)
    scaled_t = dict(plain_t)
    for l in range(c.n_layer):
        zero_t[f"layers.{l}.self_attn.gate_proj.weight"] = np.zeros((rows, c.hidden_size),
                                                                    np.float32)
        o = f"layers.{l}.self_attn.o_proj.weight"
        scaled_t[o] = (w[o].astype(np.float64) * math.log(2.0)).astype(np.float32)
    assert max_err(R.draft_forward(DraftWeights(c, zero_t), X, E),
                   R.draft_forward(DraftWeights(c_plain, scaled_t), X, E)) < 1e-6


def test_gate_element_with_head_constant_rows_equals_head_gate():
    # an element gate whose rows repeat each head's row d times is the head gate
    ch, ce = cfg(attn_gate="head"), cfg(attn_gate="element")
    wh = DraftWeights.random(ch, seed=27)
    X, E = inputs(ch, 6, seed=28)
    t = dict(wh.tensors)
    for l in range(ch.n_layer):
        name = f"layers.{l}.self_attn.gate_proj.weight"
        t[name] = np.repeat(wh[name], ch.head_dim, axis=0)
    assert max_err(R.draft_forward(wh, X, E), R.draft_forward(DraftWeights(ce, t), X, E)) < 1e-12
