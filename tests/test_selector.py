"""The DFlash 2 selector kernels (cuda_src/selector.cu, ops/selector.py): the two-stage
top-K and the walk against their NumPy references (exact ids, tokens and choices; values
within the f32 tolerance), ties, non-finite logits, lanes, sampled walks against the
NumPy sampler and a chi-square test, the float64 oracle (reference.select_draft) where
its margin exceeds f32 rounding, and bad input."""
import math

import numpy as np
import pytest

from dflash_cupy import dtypes
from dflash_cupy import reference as ref
from dflash_cupy.config import DFlash2Config, DraftConfig
from dflash_cupy.ops.selector import (TK_TILE, SelectorKernels, partials_reference, selector_uniforms,
                                      topk_reference, walk_reference, warp_dot_reference)
from dflash_cupy.tolerances import assert_close
from dflash_cupy.weights import DraftWeights

SEL = "candidate_selector."


def config(vocab=19, K=3, H=40, rank=16, cap=3.0, mult=0.7, q_len=3):
    d2 = DFlash2Config(conv_kernel_size=2, conv_group_size=4, selector_rank=rank, selector_top_k=K,
                       vocab_size=vocab, final_logit_softcapping=cap, output_multiplier=mult)
    return DraftConfig(n_layer=1, hidden_size=H, n_head=2, n_head_kv=1, head_dim=6, intermediate_size=10,
                       block_size=q_len, target_layer_ids=(0,), mask_token_id=vocab - 1, dflash2=d2)


def _values_match(got, want, what):
    odd = ~np.isfinite(want)                   # NaN and +-inf: exactly (NaN equals NaN here)
    np.testing.assert_array_equal(got[odd], want[odd], err_msg=f"{what}: non-finite values")
    assert_close(np.where(odd, 0, got), np.where(odd, 0, want), "f32", what)


def _run_topk(be, sel, logits_h, row0=1, row_stride=None):
    L, R, K = sel.lanes, sel.R, sel.K
    ids = be.asarray(np.full((L, R, K), -7, np.int32))
    vals = be.asarray(np.full((L, R, K), -7, np.float32))
    sel.topk(be.asarray(logits_h), ids, vals, row0=row0, row_stride=row_stride)
    return be.to_numpy(ids), be.to_numpy(vals)


def _selector_rows(logits_h, lanes, R, row0, stride):
    return np.concatenate([logits_h[l * stride + row0: l * stride + row0 + R] for l in range(lanes)])


# vocab 19, 33, 1007 fit one column block; 2055 = 2 * TK_TILE + 7 leaves a last block of 7
# columns (fewer than K = 16 or 40); K = 40 and 64 exceed every thread's share (4 columns).
@pytest.mark.parametrize("vocab,K,lanes,q_len", [(19, 1, 1, 3), (19, 3, 3, 3), (33, 16, 1, 16), (33, 33, 3, 2),
                                                 (1007, 40, 3, 3), (2 * TK_TILE + 7, 16, 1, 3),
                                                 (2 * TK_TILE + 7, 40, 3, 2), (1007, 64, 1, 2)])
def test_topk_matches_reference(backend, rng, vocab, K, lanes, q_len):
    c = config(vocab=vocab, K=K, q_len=q_len)
    sel = SelectorKernels(backend, c, q_len, lanes)
    lg = (3 * rng.standard_normal((lanes * q_len, vocab + 5))).astype(np.float32)   # ld > vocab
    lg[:, vocab:] = 1e30                                          # past the vocabulary: never a candidate
    r = 1
    lg[r, [vocab - 1, 0, vocab // 2]] = lg[r].max() + 1           # a three-way tie: lowest id first
    if vocab > TK_TILE:
        lg[r, [TK_TILE - 1, TK_TILE, 2 * TK_TILE + 3]] = 50.0      # ties across column blocks
    ids, vals = _run_topk(backend, sel, lg)
    R = q_len - 1
    want_ids, want_vals = topk_reference(_selector_rows(lg, lanes, R, 1, q_len), K, vocab, c.dflash2.output_multiplier,
                                         c.dflash2.final_logit_softcapping)
    np.testing.assert_array_equal(ids.reshape(-1, K), want_ids)
    _values_match(vals.reshape(-1, K), want_vals, "vals")
    assert (ids[0, 0, :min(K, 3)] == [0, vocab // 2, vocab - 1][:min(K, 3)]).all()
    # the float64 oracle's ranking agrees on finite logits
    np.testing.assert_array_equal(want_ids, ref.top_candidates(_selector_rows(lg, lanes, R, 1, q_len)[:, :vocab], K))


@pytest.mark.parametrize("cap", [3.0, None])
def test_topk_non_finite_rule(backend, rng, cap):
    """+inf ranks above every finite logit, -inf below them, NaN below everything (float_order.cuh);
    values: +-inf -> +-cap (or +-inf without a cap), NaN -> NaN."""
    vocab, K = 33, 8
    c = config(vocab=vocab, K=K, q_len=4, cap=cap)
    sel = SelectorKernels(backend, c, 4, 1)
    lg = rng.standard_normal((4, vocab)).astype(np.float32)
    lg[1, [5, 9]] = np.nan
    lg[1, 20] = np.inf
    lg[2, :] = np.nan                       # every logit NaN: ids 0..K-1, values NaN
    lg[2, 30] = -np.inf                     # -inf still ranks above NaN
    lg[3, :] = -np.inf
    lg[3, 7] = np.float32(-3e38)
    ids, vals = _run_topk(backend, sel, lg)
    want_ids, want_vals = topk_reference(lg[1:], K, vocab, 0.7, cap)
    np.testing.assert_array_equal(ids[0], want_ids)
    _values_match(vals[0], want_vals, "vals")
    assert ids[0, 0, 0] == 20 and vals[0, 0, 0] == (np.float32(cap) if cap else np.inf)
    assert 5 not in ids[0, 0] and 9 not in ids[0, 0]
    assert ids[0, 1].tolist() == [30] + list(range(K - 1)) and np.isnan(vals[0, 1, 1:]).all()
    assert ids[0, 2].tolist() == [7, 0, 1, 2, 3, 4, 5, 6]          # -inf ties: lowest id first


def test_topk_row_offsets_and_q_len_1(backend, rng):
    c = config(vocab=33, K=5, q_len=4)
    sel = SelectorKernels(backend, c, 4, 3)
    lg = rng.standard_normal((3 * 3 + 2, 40)).astype(np.float32)
    ids, vals = _run_topk(backend, sel, lg, row0=2, row_stride=3)   # compact rows, 2 leading rows
    want_ids, _ = topk_reference(_selector_rows(lg, 3, 3, 2, 3), 5, 33, 0.7, 3.0)
    np.testing.assert_array_equal(ids.reshape(-1, 5), want_ids)
    one = SelectorKernels(backend, c, 1, 2)                         # no selector rows: nothing to do
    one.topk(backend.asarray(lg), None, None)


@pytest.mark.parametrize("cols", [1, 5, 37, 300])
def test_merge_of_epilogue_partials_is_the_full_top_k(backend, rng, cols):
    """Any column partition, each block's K best first, empty slots: the merge gives the
    top-K of the full row (what a top-K fused into the lm_head GEMM's epilogue relies on),
    also where one block holds all K (the merge keeps the K blocks with the best first pairs)."""
    vocab, K, lanes, q_len = 1007, 16, 3, 3
    nb = -(-vocab // cols)
    c = config(vocab=vocab, K=K, q_len=q_len)
    sel = SelectorKernels(backend, c, q_len, lanes, partial_blocks=nb)
    lg = rng.standard_normal((lanes * 2, vocab)).astype(np.float32)
    lg[0, [3, 500, 1006]] = 9.0                                    # ties across blocks
    lg[1, 7] = np.nan
    lg[2, 600:600 + min(cols, K)] = 5.0 + np.arange(min(cols, K))    # one block's K best lead the row
    lg[3, :] = -np.inf                                             # every pair ties: ids decide
    part = partials_reference(lg, K, vocab, cols)
    ids, vals = backend.zeros((lanes, 2, K), np.int32), backend.zeros((lanes, 2, K), np.float32)
    sel.merge_partials(backend.asarray(part), ids, vals)
    want_ids, want_vals = topk_reference(lg, K, vocab, 0.7, 3.0)
    np.testing.assert_array_equal(backend.to_numpy(ids).reshape(-1, K), want_ids)
    _values_match(backend.to_numpy(vals).reshape(-1, K), want_vals, "vals")
    before = backend.to_numpy(ids).copy()
    with pytest.raises(ValueError, match="^partials must have shape"):
        sel.merge_partials(backend.asarray(part[:, :, :K - 1].copy()), ids, vals)
    # more blocks than the merge was built for: refused, nothing written
    wide = np.concatenate([part, part[:, :1]], axis=1)
    with pytest.raises(ValueError, match=f"partials has {nb + 1} column blocks.*partial_blocks"):
        sel.merge_partials(backend.asarray(wide), ids, vals)
    np.testing.assert_array_equal(backend.to_numpy(ids), before)


def test_topk_and_walk_replay_from_a_graph(emu):
    """Captured once, replayed with new logits, hidden rows, anchors, knobs and seed."""
    be, rng = emu, np.random.default_rng(21)
    vocab, K, lanes, q_len, H, rank = 33, 5, 2, 4, 40, 16
    c = config(vocab=vocab, K=K, H=H, rank=rank, q_len=q_len)
    sel = SelectorKernels(be, c, q_len, lanes)
    inp = _walk_inputs(rng, vocab, K, lanes, q_len, H, rank, "bf16")
    dev = {k: be.asarray(dtypes.device_bits(v)) for k, v in inp.items()}
    logits = be.zeros((lanes * q_len, vocab), np.float32)
    tokens, choice = be.zeros((lanes, q_len), np.int32), be.zeros((lanes, q_len - 1), np.int32)
    q = be.zeros((lanes, q_len - 1, K), np.float32)
    knobs, rngs = be.zeros((3,), np.float32), be.zeros((2,), np.uint64)
    s = be.stream()
    be.synchronize()
    be.begin_capture(s)
    sel.topk(logits, dev["ids"], dev["vals"], stream=s)
    sel.walk(dev["hidden"], dev["hp_w"], dev["pred_cb"], dev["succ_cb"], dev["anchors"], dev["ids"], dev["vals"],
             tokens, choice, q, knobs, rngs, stream=s)
    g = be.end_capture(s)
    for step, T in enumerate((0.0, 1.1, 0.6)):
        lg = rng.standard_normal((lanes * q_len, vocab)).astype(np.float32)
        hid = rng.standard_normal((lanes, q_len, H)).astype(np.float32)
        anchors = rng.integers(0, vocab, lanes).astype(np.int32)
        logits[...], dev["hidden"][...], dev["anchors"][...] = lg, hid, anchors
        knobs[...] = np.array([T, 1, 0], np.float32)
        rngs[...] = np.array([step, 3 * step], np.uint64)
        g.launch(s)
        s.synchronize()
        ids, vals = topk_reference(_selector_rows(lg, lanes, q_len - 1, 1, q_len), K, vocab, 0.7, 3.0)
        want = walk_reference(hid, inp["hp_w"], inp["pred_cb"], inp["succ_cb"], anchors,
                              ids.reshape(lanes, q_len - 1, K), vals.reshape(lanes, q_len - 1, K), vocab,
                              temperature=T, seed=step, counter=3 * step)
        np.testing.assert_array_equal(be.to_numpy(tokens), want["tokens"], err_msg=f"replay {step}")
        np.testing.assert_array_equal(be.to_numpy(choice), want["choice"], err_msg=f"replay {step}")
        assert_close(be.to_numpy(q), want["q"], "f32", f"replay {step} q")


def _walk_inputs(rng, vocab, K, lanes, q_len, H, rank, kind, anchors=None):
    R = q_len - 1
    host = dtypes.HOST[kind]
    hidden = rng.standard_normal((lanes, q_len, H)).astype(np.float32)
    hp_w = (rng.standard_normal((rank, H)) / math.sqrt(H)).astype(host)
    pred = (rng.standard_normal((vocab, rank)) / rank ** 0.25).astype(host)
    succ = (rng.standard_normal((vocab, rank)) / rank ** 0.25).astype(host)
    ids = np.stack([np.stack([rng.permutation(vocab)[:K] for _ in range(R)]) if R else np.zeros((0, K))
                    for _ in range(lanes)]).astype(np.int32).reshape(lanes, R, K)
    vals = np.sort(rng.standard_normal((lanes, R, K)).astype(np.float32), axis=-1)[..., ::-1].copy()
    anchors = rng.integers(0, vocab, lanes).astype(np.int32) if anchors is None else np.asarray(anchors, np.int32)
    return dict(hidden=hidden, hp_w=hp_w, pred_cb=pred, succ_cb=succ, anchors=anchors, ids=ids, vals=vals)


def _run_walk(be, sel, inp, T=0.0, seed=0, counter=0):
    L, Q, R, K = sel.lanes, sel.q_len, sel.R, sel.K
    dev = {k: be.asarray(dtypes.device_bits(v)) if v.size else None for k, v in inp.items()}
    out = dict(tokens=be.asarray(np.full((L, Q), -7, np.int32)),
               choice=be.asarray(np.full((L, R), -7, np.int32)) if R else None,
               q=be.asarray(np.full((L, R, K), -7, np.float32)) if R else None)
    knobs = be.asarray(np.array([T, 1.0, 0.0], np.float32))
    rngs = be.asarray(np.array([seed, counter], np.uint64))
    sel.walk(dev["hidden"], dev["hp_w"], dev["pred_cb"], dev["succ_cb"], dev["anchors"], dev["ids"], dev["vals"],
             out["tokens"], out["choice"], out["q"], knobs, rngs)
    got = {k: be.to_numpy(v) if v is not None else np.zeros((L, 0) + ((K,) if k == "q" else ()))
           for k, v in out.items()}
    got["flags"] = be.to_numpy(sel.flags)
    return got


def test_warp_dot_reference_is_the_kernel_order():
    """The reference's fixed order is not NumPy's own sum (so the exact tests below can fail)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 1000)).astype(np.float32)
    x = rng.standard_normal((2, 1000)).astype(np.float32)
    got = warp_dot_reference(w, x)
    assert_close(got, w.astype(np.float64) @ x.T.astype(np.float64), "f32", "warp_dot")
    assert (got != (w @ x.T)).any()


@pytest.mark.parametrize("vocab,K,lanes,q_len,H,rank,kind", [
    (19, 1, 1, 3, 12, 5, "f32"), (19, 3, 3, 3, 40, 16, "bf16"), (33, 16, 1, 16, 40, 9, "f16"),
    (1007, 40, 3, 4, 264, 33, "bf16"), (33, 3, 3, 1, 40, 16, "bf16"),
    (1007, 16, 1, 3, 40, 300, "bf16"),      # successor rows of 2 chunks per lane, in registers
    (1007, 40, 1, 3, 40, 300, "f16")])      # 5 candidates x 16 values per lane: read in the loop
def test_greedy_walk_is_exact(backend, rng, vocab, K, lanes, q_len, H, rank, kind):
    c = config(vocab=vocab, K=K, H=H, rank=rank, q_len=q_len)
    sel = SelectorKernels(backend, c, q_len, lanes, weight_kind=kind)
    inp = _walk_inputs(rng, vocab, K, lanes, q_len, H, rank, kind)
    for _ in range(2):                        # twice: the arrival counters were reset for the next launch
        got = _run_walk(backend, sel, inp)
        want = walk_reference(**inp, vocab=vocab)
        for k in ("tokens", "choice", "q", "flags"):
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert (got["tokens"][:, 0] == inp["anchors"]).all()
    if q_len > 1:
        np.testing.assert_array_equal(got["tokens"][:, 1:],
                                      np.take_along_axis(inp["ids"], got["choice"][..., None], -1)[..., 0])


def test_greedy_walk_score_ties_take_the_first_candidate(backend, rng):
    vocab, K, q_len, H, rank = 19, 4, 3, 12, 5
    c = config(vocab=vocab, K=K, H=H, rank=rank, q_len=q_len)
    sel = SelectorKernels(backend, c, q_len, 1, weight_kind="f32")
    inp = _walk_inputs(rng, vocab, K, 1, q_len, H, rank, "f32")
    inp["succ_cb"][:] = 0.0                  # no edge term: scores are the values
    inp["vals"][:] = np.float32(1.5)         # all equal: candidate 0 everywhere
    got = _run_walk(backend, sel, inp)
    assert got["choice"].tolist() == [[0, 0]]
    inp["vals"][0, 1] = [0.0, 2.0, 1.0, 2.0]
    got = _run_walk(backend, sel, inp)
    assert got["choice"].tolist() == [[0, 1]]


def test_walk_nan_scores(backend, rng):
    """NaN scores rank below everything greedy and carry no mass sampled; a row of only NaN
    draws candidate 0 with q all 0."""
    c = config(vocab=19, K=4, H=12, rank=5, q_len=3)
    sel = SelectorKernels(backend, c, 3, 1, weight_kind="f32")
    inp = _walk_inputs(rng, 19, 4, 1, 3, 12, 5, "f32")
    inp["vals"][0, 0] = [np.nan, 0.5, np.nan, 0.1]
    inp["vals"][0, 1] = np.nan
    for T in (0.0, 0.8):
        got = _run_walk(backend, sel, inp, T=T, seed=5)
        want = walk_reference(**inp, vocab=19, temperature=T, seed=5)
        for k in ("tokens", "choice"):
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        assert_close(got["q"], want["q"], "f32", "q")      # expf and np.exp may differ in the last bit
        assert got["choice"][0, 0] in (1, 3) and got["choice"][0, 1] == 0
        assert got["q"][0, 0, [0, 2]].tolist() == [0, 0] and (got["q"][0, 1] == (0 if T else [1, 0, 0, 0])).all()


@pytest.mark.parametrize("vocab,K,lanes,q_len,T,seed,counter,rank", [
    (19, 3, 3, 3, 1.0, 1, 0, 16), (33, 16, 1, 16, 0.7, 2**63 + 5, 2**33 + 17, 16),
    (1007, 40, 3, 4, 1.3, 7, 99, 16), (1007, 40, 1, 3, 1.0, 8, 1, 300)])
def test_sampled_walk_reproduces_the_numpy_sampler(backend, rng, vocab, K, lanes, q_len, T, seed, counter, rank):
    H = 40
    c = config(vocab=vocab, K=K, H=H, rank=rank, q_len=q_len)
    sel = SelectorKernels(backend, c, q_len, lanes)
    inp = _walk_inputs(rng, vocab, K, lanes, q_len, H, rank, "bf16")
    got = _run_walk(backend, sel, inp, T=T, seed=seed, counter=counter)
    want = walk_reference(**inp, vocab=vocab, temperature=T, seed=seed, counter=counter)
    # the masses use expf (kernel) and np.exp (reference): a last-bit difference could move a
    # draw only within that rounding of a boundary, which these seeds do not come near
    assert (want["margin"] > 1e-6).all()
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_array_equal(got["choice"], want["choice"])
    assert_close(got["q"], want["q"], "f32", "q")
    np.testing.assert_allclose(got["q"].sum(-1), 1.0, atol=1e-5)
    # the uniforms are a function of (seed, counter, lane * q_len + row): another seed moves the draws
    other = _run_walk(backend, sel, inp, T=T, seed=seed + 1, counter=counter)
    assert (other["choice"] != got["choice"]).any()


# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {3: 16.27, 5: 20.52}


@pytest.mark.parametrize("K,T", [(4, 1.0), (6, 2.0)])
def test_sampled_walk_chi_square(backend, K, T):
    """Every lane draws row 1 from the same scores with its own uniform: the counts follow q."""
    rng = np.random.default_rng(11 + K)
    lanes, vocab, H, rank = 128, 19, 12, 8
    c = config(vocab=vocab, K=K, H=H, rank=rank, q_len=2)
    sel = SelectorKernels(backend, c, 2, lanes, weight_kind="f32")
    one = _walk_inputs(rng, vocab, K, 1, 2, H, rank, "f32")
    inp = {k: (np.repeat(v, lanes, axis=0) if k in ("hidden", "anchors", "ids", "vals") else v)
           for k, v in one.items()}
    counts = np.zeros(K)
    for counter in range(4):
        got = _run_walk(backend, sel, inp, T=T, seed=1234, counter=counter)
        counts += np.bincount(got["choice"][:, 0], minlength=K)
    q = got["q"][0, 0].astype(np.float64)
    assert (q > 0.02).all(), q                 # every cell expects >= 10 draws
    n = counts.sum()
    chi2 = float(((counts - n * q) ** 2 / (n * q)).sum())
    assert chi2 < CHI2_999[K - 1], (chi2, counts, n * q)


@pytest.mark.parametrize("T", [0.0, 0.9])
@pytest.mark.parametrize("kind", ["bf16", "f32"])
def test_kernels_match_the_float64_oracle(backend, T, kind):
    vocab, K, q_len, H, rank, lanes = 1007, 16, 6, 40, 16, 3
    c = config(vocab=vocab, K=K, H=H, rank=rank, q_len=q_len, cap=20.0, mult=0.196)
    w = DraftWeights.random(c, seed=5, dtype=kind)
    rng = np.random.default_rng(6)
    hidden = rng.standard_normal((lanes, q_len, H)).astype(np.float32)
    lm_head = (rng.standard_normal((vocab, H)) / math.sqrt(H) * 20).astype(np.float32)
    anchors = np.array([3, vocab - 1, 500], np.int32)
    sel = SelectorKernels(backend, c, q_len, lanes, weight_kind=kind)
    logits = (hidden.reshape(-1, H).astype(np.float64) @ lm_head.T.astype(np.float64)).astype(np.float32)
    ids, vals = _run_topk(backend, sel, logits)
    inp = dict(hidden=hidden, hp_w=w.tensors[SEL + "hidden_projection.weight"],
               pred_cb=w.tensors[SEL + "predecessor_codebook"], succ_cb=w.tensors[SEL + "successor_codebook"],
               anchors=anchors, ids=ids, vals=vals)
    seed, counter = 77, 5
    got = _run_walk(backend, sel, inp, T=T, seed=seed, counter=counter)
    u = selector_uniforms(seed, counter, lanes, q_len)
    checked = 0
    for lane in range(lanes):
        o = ref.select_draft(w, hidden[lane], lm_head, int(anchors[lane]), temperature=T,
                             uniforms=u[lane] if T else None)
        np.testing.assert_array_equal(ids[lane], o.candidate_ids)
        assert_close(vals[lane], o.candidate_values, "f32", "vals vs oracle")
        for j in range(q_len - 1):
            if o.margin[j] <= 1e-4:            # within f32 rounding of a flip: not comparable
                break
            assert got["choice"][lane, j] == o.choice[j]
            assert got["tokens"][lane, j + 1] == o.draft_tokens[j]
            if T:
                assert_close(got["q"][lane, j], o.q[j], "f32", "q vs oracle")
            checked += 1
    assert checked >= lanes * (q_len - 1) - 2, checked


def test_bad_input_names_the_argument(backend, rng):
    c = config(vocab=19, K=3, H=12, rank=5, q_len=3)
    sel = SelectorKernels(backend, c, 3, 2)
    inp = _walk_inputs(rng, 19, 3, 2, 3, 12, 5, "bf16", anchors=[4, 19])
    with pytest.raises(ValueError, match=r"anchors\[1\]=19 is outside the vocabulary"):
        sel.anchors_to_device([4, 19])
    with pytest.raises(ValueError, match=r"anchors\[0\]=-1"):
        sel.anchors_to_device(np.array([-1, 3]))
    with pytest.raises(ValueError, match="anchors must be 2 token ids"):
        sel.anchors_to_device([4])
    assert backend.to_numpy(sel.anchors_to_device([4, 18])).tolist() == [4, 18]
    # a device anchor out of range: clamped and flagged, nothing read outside the codebook
    got = _run_walk(backend, sel, inp)
    assert got["flags"].tolist() == [0, 1] and got["tokens"][:, 0].tolist() == [4, 18]
    want = walk_reference(**inp, vocab=19)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    inp["anchors"] = np.array([4, 5], np.int32)
    assert _run_walk(backend, sel, inp)["flags"].tolist() == [0, 0]

    dev = {k: backend.asarray(dtypes.device_bits(v)) for k, v in inp.items()}
    outs = [backend.zeros((2, 3), np.int32), backend.zeros((2, 2), np.int32), backend.zeros((2, 2, 3), np.float32),
            backend.zeros((3,), np.float32), backend.zeros((2,), np.uint64)]
    args = [dev[k] for k in ("hidden", "hp_w", "pred_cb", "succ_cb", "anchors", "ids", "vals")] + outs
    names = ["hidden", "hp_w", "pred_cb", "succ_cb", "anchors", "ids", "vals", "tokens", "choice", "q", "knobs", "rng"]
    for i, name in enumerate(names):
        bad = list(args)
        bad[i] = backend.zeros((7,) * args[i].ndim, args[i].dtype)          # wrong shape
        with pytest.raises(ValueError, match=rf"^{name} must have shape"):
            sel.walk(*bad)
        bad[i] = backend.zeros(args[i].shape, np.float64)                   # wrong dtype
        with pytest.raises(TypeError, match=rf"^{name} must have dtype"):
            sel.walk(*bad)
    with pytest.raises(TypeError, match="^hp_w must be a device array"):
        sel.walk(*([args[0], np.zeros((5, 12), np.uint16)] + args[2:]))
    lg = backend.zeros((6, 19), np.float32)
    with pytest.raises(ValueError, match="^ids must have shape"):
        sel.topk(lg, backend.zeros((2, 3, 3), np.int32), dev["vals"])
    with pytest.raises(ValueError, match="logits must have >= 19 columns"):
        sel.topk(backend.zeros((6, 18), np.float32), dev["ids"], dev["vals"])
    with pytest.raises(ValueError, match="logits has 5 rows"):
        sel.topk(backend.zeros((5, 19), np.float32), dev["ids"], dev["vals"])
    with pytest.raises(TypeError, match="^row0 must be an int"):
        sel.topk(lg, dev["ids"], dev["vals"], row0=1.0)
    plain = DraftConfig(n_layer=1, hidden_size=12, n_head=2, n_head_kv=1, head_dim=6, intermediate_size=10,
                        block_size=3, target_layer_ids=(0,))
    with pytest.raises(ValueError, match="^config: .*no dflash2"):
        SelectorKernels(backend, plain, 3)
    with pytest.raises(ValueError, match="selector_top_k=65"):
        SelectorKernels(backend, config(vocab=100, K=65), 3)
    with pytest.raises(ValueError, match="exceed 48 KiB of shared memory"):
        SelectorKernels(backend, config(vocab=100, K=64, rank=8192), 64)
    with pytest.raises(TypeError, match="weight_kind"):
        SelectorKernels(backend, c, 3, weight_kind="int8")


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_per_lane_step_blocks_equal_one_lane_walks(backend, kind):
    """knobs [lanes, 3] / rng [lanes, 2] (a step engine's lanes, each with its own
    SamplingParams): each lane walks exactly as a one-lane walk with its own temperature,
    seed and counter; a greedy lane among sampled ones stays one-hot."""
    rng = np.random.default_rng(23)
    vocab, K, lanes, q_len, H, rank = 33, 5, 3, 6, 40, 16
    c = config(vocab=vocab, K=K, H=H, rank=rank, q_len=q_len)
    inp = _walk_inputs(rng, vocab, K, lanes, q_len, H, rank, kind)
    lane_t, lane_seed, lane_ctr = [0.9, 0.0, 1.7], [3, 2**64 - 1, 3], [11, 11, 2**35 + 1]
    sel = SelectorKernels(backend, c, q_len, lanes, weight_kind=kind)
    dev = {k: backend.asarray(dtypes.device_bits(v)) for k, v in inp.items()}
    out = [backend.asarray(np.full(s, -7, dt)) for s, dt in (((lanes, q_len), np.int32),
                                                              ((lanes, q_len - 1), np.int32),
                                                              ((lanes, q_len - 1, K), np.float32))]
    knobs = backend.asarray(np.array([[t, 1.0, 0.0] for t in lane_t], np.float32))
    rngs = backend.asarray(np.array(list(zip(lane_seed, lane_ctr)), np.uint64))
    sel.walk(*(dev[k] for k in ("hidden", "hp_w", "pred_cb", "succ_cb", "anchors", "ids", "vals")), *out, knobs, rngs)
    got = [backend.to_numpy(a) for a in out]
    one = SelectorKernels(backend, c, q_len, 1, weight_kind=kind)
    for lane in range(lanes):
        lane_inp = {k: v[lane:lane + 1] if k in ("hidden", "anchors", "ids", "vals") else v for k, v in inp.items()}
        single = _run_walk(backend, one, lane_inp, T=lane_t[lane], seed=lane_seed[lane], counter=lane_ctr[lane])
        for name, g in zip(("tokens", "choice", "q"), got):
            np.testing.assert_array_equal(g[lane], single[name][0], err_msg=f"lane {lane} {name}")
        want = walk_reference(**lane_inp, vocab=vocab, temperature=lane_t[lane], seed=lane_seed[lane],
                              counter=lane_ctr[lane])
        assert (want["margin"] > 1e-6).all()
        np.testing.assert_array_equal(got[0][lane], want["tokens"][0], err_msg=f"lane {lane} vs the reference")
    q = got[2]
    assert ((q[1] == 0) | (q[1] == 1)).all() and (q[1].sum(-1) == 1).all()      # the greedy lane
    assert ((q[0] > 0) & (q[0] < 1)).any() and ((q[2] > 0) & (q[2] < 1)).any()  # the sampled ones
    # lanes 0 and 2 share seed and counter yet differ in temperature: the same uniforms,
    # other distributions
    assert not np.array_equal(q[0], q[2])
    with pytest.raises(ValueError, match=r"^rng must have shape \[3, 2\]"):
        sel.walk(*(dev[k] for k in ("hidden", "hp_w", "pred_cb", "succ_cb", "anchors", "ids", "vals")), *out,
                 knobs, backend.zeros((2, 2), np.uint64))


def _fused_vs_separate(be, sel, inp, part, row0, stride, knobs, rngs):
    """merge_partials + walk, then merge_and_walk (twice: the counters were reset), on outputs
    filled with -7: every output as raw bytes."""
    L, Q, R, K = sel.lanes, sel.q_len, sel.R, sel.K
    dev = {k: be.asarray(dtypes.device_bits(v)) if v.size else None for k, v in inp.items()}
    shapes = dict(ids=((L, R, K), np.int32), vals=((L, R, K), np.float32), tokens=((L, Q), np.int32),
                  choice=((L, R), np.int32), q=((L, R, K), np.float32))
    names = ("hidden", "hp_w", "pred_cb", "succ_cb", "anchors")
    runs = []
    for fused in (False, True, True):
        out = {k: be.asarray(np.full(s, -7, dt)) if R or k == "tokens" else None for k, (s, dt) in shapes.items()}
        args = [dev[k] for k in names] + [out[k] for k in ("ids", "vals", "tokens", "choice", "q")] + [knobs, rngs]
        if fused:
            sel.merge_and_walk(part, *args, row0=row0, row_stride=stride)
        else:
            sel.merge_partials(part, out["ids"], out["vals"], row0=row0, row_stride=stride)
            sel.walk(*args)
        got = {k: be.to_numpy(v) for k, v in out.items() if v is not None}
        got["flags"] = be.to_numpy(sel.flags)
        runs.append(got)
    for got in runs[1:]:
        for k, want in runs[0].items():
            np.testing.assert_array_equal(got[k].view(np.uint8), want.view(np.uint8), err_msg=k)
    assert (be.to_numpy(sel.counters) == 0).all()
    return runs[0]


# vocab 2 * TK_TILE + 7 and 1007 / 19 with 256-, 37- and 5-column blocks: last blocks narrower
# than K; lane blocks of q_len + 2 rows (row 0 the anchor's, rows past q_len unread)
@pytest.mark.parametrize("vocab,K,lanes,q_len,cols,temps", [
    (1007, 3, 1, 2, 256, [0.0]), (1007, 5, 3, 4, 37, [0.9]), (19, 5, 3, 4, 5, [1.1]),
    (2 * TK_TILE + 7, 16, 3, 16, 256, [0.0, 1.3, 0.7]),       # per-lane knobs: a greedy lane among sampled
    (1007, 16, 1, 16, 300, [0.0]), (1007, 3, 3, 2, 256, [0.6, 0.0, 2.0]), (33, 5, 3, 1, 5, [0.8])])
def test_merge_and_walk_is_merge_then_walk(backend, vocab, K, lanes, q_len, cols, temps):
    rng = np.random.default_rng(vocab + K + q_len)
    H, rank, stride = 40, 16, q_len + 2
    c = config(vocab=vocab, K=K, H=H, rank=rank, q_len=q_len)
    nb = -(-vocab // cols)
    sel = SelectorKernels(backend, c, q_len, lanes, partial_blocks=nb)
    inp = _walk_inputs(rng, vocab, K, lanes, stride, H, rank, "bf16",
                       anchors=[vocab + 3] + list(rng.integers(0, vocab, lanes - 1)))   # lane 0 clamped, flagged
    lg = (3 * rng.standard_normal((lanes * stride, vocab))).astype(np.float32)
    lg[1, [0, vocab // 2, vocab - 1]] = 50.0                                     # ties across blocks
    part = backend.asarray(partials_reference(lg, K, vocab, cols))
    per_lane = len(temps) > 1
    knobs = np.array([[t, 1.0, 0.0] for t in temps], np.float32)
    seeds = np.array([[7 + l, 2**33 + l] for l in range(len(temps))], np.uint64)
    knobs_d = backend.asarray(knobs if per_lane else knobs[0])
    rng_d = backend.asarray(seeds if per_lane else seeds[0])
    got = _fused_vs_separate(backend, sel, inp, part, 1, stride, knobs_d, rng_d)
    # and both are the references': the merged candidates, the walk's tokens
    R = q_len - 1
    assert got["flags"][0] == 1 and got["tokens"][0, 0] == vocab - 1
    if not R:
        np.testing.assert_array_equal(got["tokens"][:, 0], np.clip(inp["anchors"], 0, vocab - 1))
        return
    want_ids, want_vals = topk_reference(_selector_rows(lg, lanes, R, 1, stride), K, vocab, 0.7, 3.0)
    np.testing.assert_array_equal(got["ids"].reshape(-1, K), want_ids)
    _values_match(got["vals"].reshape(-1, K), want_vals, "vals")
    if per_lane:   # each lane as a one-lane walk with its own knobs and rng
        for lane in range(lanes):
            want = walk_reference(inp["hidden"][lane:lane + 1, :q_len], inp["hp_w"], inp["pred_cb"], inp["succ_cb"],
                                  inp["anchors"][lane:lane + 1], got["ids"][lane:lane + 1], got["vals"][lane:lane + 1],
                                  vocab, temperature=temps[lane], seed=int(seeds[lane, 0]), counter=int(seeds[lane, 1]))
            assert (want["margin"] > 1e-6).all()
            np.testing.assert_array_equal(got["tokens"][lane], want["tokens"][0], err_msg=f"lane {lane}")
            np.testing.assert_array_equal(got["choice"][lane], want["choice"][0], err_msg=f"lane {lane}")
    else:
        want = walk_reference(inp["hidden"][:, :q_len], inp["hp_w"], inp["pred_cb"], inp["succ_cb"], inp["anchors"],
                              got["ids"], got["vals"], vocab, temperature=temps[0], seed=int(seeds[0, 0]),
                              counter=int(seeds[0, 1]))
        assert (want["margin"] > 1e-6).all()
        np.testing.assert_array_equal(got["tokens"], want["tokens"])
        np.testing.assert_array_equal(got["choice"], want["choice"])


def test_merge_and_walk_bad_input_launches_nothing(backend, rng):
    """merge_partials' and walk's checks, each naming its argument, all before the one launch:
    the outputs and the arrival counters stay as they were."""
    c = config(vocab=19, K=3, H=12, rank=5, q_len=3)
    sel = SelectorKernels(backend, c, 3, 2, partial_blocks=4)
    inp = _walk_inputs(rng, 19, 3, 2, 4, 12, 5, "bf16")
    dev = {k: backend.asarray(dtypes.device_bits(v)) for k, v in inp.items()}
    part = backend.asarray(partials_reference(rng.standard_normal((8, 19)).astype(np.float32), 3, 19, 5))
    shapes = [((2, 2, 3), np.int32), ((2, 2, 3), np.float32), ((2, 3), np.int32), ((2, 2), np.int32),
              ((2, 2, 3), np.float32)]
    outs = [backend.asarray(np.full(s, -7, dt)) for s, dt in shapes]
    args = ([part] + [dev[k] for k in ("hidden", "hp_w", "pred_cb", "succ_cb", "anchors")] + outs
            + [backend.zeros((3,), np.float32), backend.zeros((2,), np.uint64)])
    names = ["partials", "hidden", "hp_w", "pred_cb", "succ_cb", "anchors", "ids", "vals", "tokens", "choice", "q",
             "knobs", "rng"]
    for i, name in enumerate(names):
        bad = list(args)
        bad[i] = backend.zeros((7,) * args[i].ndim, args[i].dtype)          # wrong shape
        with pytest.raises(ValueError, match=rf"^{name} must have shape"):
            sel.merge_and_walk(*bad, row0=1, row_stride=4)
        bad[i] = backend.zeros(args[i].shape, np.float64)                   # wrong dtype
        with pytest.raises(TypeError, match=rf"^{name} must have dtype"):
            sel.merge_and_walk(*bad, row0=1, row_stride=4)
    with pytest.raises(ValueError, match="^row_stride=1 must be >= R=2"):
        sel.merge_and_walk(*args, row0=1, row_stride=1)
    with pytest.raises(ValueError, match=r"^partials must have shape \[>= 9"):        # rows past the partials
        sel.merge_and_walk(*args, row0=3, row_stride=4)
    with pytest.raises(ValueError, match="^partials has 5 column blocks"):
        sel.merge_and_walk(backend.zeros((8, 5, 3, 2), np.uint32), *args[1:], row0=1, row_stride=4)
    with pytest.raises(ValueError, match="^q must not overlap vals"):
        sel.merge_and_walk(*args[:10], args[7], *args[11:], row0=1, row_stride=4)
    in_part = part.view(np.float32).reshape(-1)[:12].reshape(2, 2, 3)
    with pytest.raises(ValueError, match="^vals must not overlap partials"):
        sel.merge_and_walk(*args[:7], in_part, *args[8:], row0=1, row_stride=4)
    for o in outs:
        assert (backend.to_numpy(o) == -7).all()
    assert (backend.to_numpy(sel.counters) == 0).all()
    sel.merge_and_walk(*args, row0=1, row_stride=4)                       # the good call writes them
    assert (backend.to_numpy(outs[2]) != -7).all() and (backend.to_numpy(outs[4]) != -7).all()
