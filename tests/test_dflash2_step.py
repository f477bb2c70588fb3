"""DFlash 2 in the cached step (SPEC §6): the convolutions around every sublayer, checked
step by step against the float64 oracle by ``tests/support/drafters.py`` (drafters "g" and "h"
in test_kv_cache's schedules, "g" in test_kv_batch's lanes); here the negative control, and the
candidate selector in the step: its outputs against the kernels' NumPy references and the
float64 oracle, lanes against single caches, and bad input."""
import numpy as np
import pytest

from dflash_cupy import reference
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_batch import DraftKvBatch
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.ops.sample import SamplingParams
from dflash_cupy.ops.selector import topk_reference, walk_reference
from dflash_cupy.tolerances import assert_close, within
from dflash_cupy.weights import DraftWeights
from tests.support import dflash2_reference as ind
from tests.support.drafters import BF16, Driver, built


def test_step_runs_the_convolutions(emu):
    """One step matches the DFlash 2 oracle, and is outside the step tolerance of the same
    weights without the convolutions: the check has teeth."""
    d = Driver(emu, "g", seed=5)
    try:
        noise = d.step(11)                                   # checked against the oracle inside
        c = d.spec.config
        X = d.features(0, 11).astype(d.ring.dtype)
        v1 = DraftWeights(c.replace(dflash2=None), {k: v for k, v in d.w.items() if "_conv." not in k
                                                     and not k.startswith("candidate_selector.")})
        ok, err = within(emu.to_numpy(d.kv.hidden_states), reference.draft_forward(v1, X, noise), "step")
        assert not ok and err > 1e-2, err
        assert d.kv.recipe.conv and not d.kv.recipe.fold_norms
    finally:
        d.close()


# --------------------------------------------------------------------------- the selector in the step
V = 19   # drafter "g"'s vocabulary (its codebooks' rows)


def _lm(seed=3):
    w, _ = built("g")
    r = np.random.default_rng(seed)
    return (r.standard_normal((V, w.config.hidden_size)) / np.sqrt(w.config.hidden_size)).astype(np.float32)


def _ring(be, w, n, seed):
    c = w.config
    ring = FeatureRing(64, c.n_captured, c.hidden_size, BF16, backend=be)
    feats = np.random.default_rng(seed).standard_normal((n, c.fc_in)).astype(np.float32)
    ring.write(0, feats)
    return ring, feats.astype(BF16)


def _kernel_refs(kv, dw, lm, anchors, temperature=0.0, seed=0, counter=0):
    """The selector's NumPy kernel references on the step's own logits and hidden states."""
    be, c = kv.backend, kv.config
    d2 = c.dflash2
    logits = be.to_numpy(kv.logits).reshape(-1, kv.q_len, V)
    ids, vals = topk_reference(logits[:, 1:].reshape(-1, V), d2.selector_top_k, V, d2.output_multiplier,
                               d2.final_logit_softcapping)
    L = logits.shape[0]
    ids, vals = ids.reshape(L, -1, d2.selector_top_k), vals.reshape(L, -1, d2.selector_top_k)
    hidden = be.to_numpy(kv.hidden_states).reshape(L, kv.q_len, -1)
    ref = walk_reference(hidden, be.to_numpy(dw.selector_hp), be.to_numpy(dw.selector_pred),
                         be.to_numpy(dw.selector_succ), np.asarray(anchors, np.int32), ids, vals, V,
                         temperature=temperature, seed=seed, counter=counter)
    return ids, vals, ref


def test_selector_in_the_step_greedy(emu):
    """draft_tokens are the walk from the anchor: the kernels' NumPy references on the step's
    own logits/hidden states exactly, and the float64 oracle's walk wherever its decisions are
    clear of f32 rounding."""
    be = emu
    w, _ = built("g")
    lm = _lm()
    ring, X = _ring(be, w, 13, seed=1)
    with DraftKvCache(w, 23, lm_head=lm, backend=be) as kv:
        noise = np.random.default_rng(2).standard_normal((kv.q_len, w.config.hidden_size)).astype(np.float32)
        kv.step(ring, 13, noise, anchor=7)
        dw = w.device(be)
        ids, vals, ref = _kernel_refs(kv, dw, lm, [7])
        tokens = be.to_numpy(kv.draft_tokens)
        assert tokens.shape == (kv.q_len,) and tokens[0] == 7
        np.testing.assert_array_equal(be.to_numpy(kv.candidate_ids), ids[0])
        np.testing.assert_array_equal(tokens, ref["tokens"][0])
        np.testing.assert_array_equal(be.to_numpy(kv.selector_choice), ref["choice"][0])
        q = be.to_numpy(kv.selector_q)
        assert ((q == 0) | (q == 1)).all() and (q.sum(-1) == 1).all()     # greedy: one-hot
        # the float64 oracle of the whole block
        h_ref, _ = reference.draft_forward(w, X[:13], noise, lm_head=lm)
        sel = reference.select_draft(w, h_ref, lm, 7)
        clear = sel.margin > 1e-2
        assert clear.sum() >= 1
        np.testing.assert_array_equal(tokens[1:][clear], sel.draft_tokens[clear])
        # the next step needs its own anchor
        with pytest.raises(ValueError, match="anchor"):
            kv.step(ring, 14, noise)
        assert kv.next_pos == 13


def test_step_against_the_independent_reference(emu):
    """Through the documented API (``step(..., anchor=)``; ``hidden_states``, ``candidate_ids``,
    ``draft_tokens``), a step against tests/support/dflash2_reference.py, the loop-style
    DFlash 2 reference written apart from the oracle: hidden states within the step tolerance,
    candidates and walk wherever the oracle's decisions are clear of f32 rounding."""
    be = emu
    w, _ = built("g")
    c = w.config
    lm = _lm(seed=9)
    ring, X = _ring(be, w, 17, seed=10)
    with DraftKvCache(w, 23, lm_head=lm, backend=be) as kv:
        noise = np.random.default_rng(11).standard_normal((kv.q_len, c.hidden_size)).astype(np.float32)
        kv.step(ring, 17, noise, anchor=12)
        B, C = kv.q_len, 17
        vis = [reference.layer_visibility(C, B, c.layer_sliding[l], c.mask_rule) for l in range(c.n_layer)]
        hidden = ind.forward(dict(w.tensors), c, X[:C], noise, np.arange(C), C + np.arange(B), vis)
        got = be.to_numpy(kv.hidden_states)
        assert_close(got, hidden, "step", "hidden vs the independent reference")
        tokens, ids, _, _ = ind.select(dict(w.tensors), c, hidden, lm, 12)
        sel = reference.select_draft(w, hidden, lm, 12)
        clear = sel.margin > 1e-2
        assert clear[0], "the first decision is clear (this drafter and seed)"
        first_unclear = int(np.argmin(clear)) if not clear.all() else len(clear)
        # rows up to the first unclear decision walk from the same predecessors
        np.testing.assert_array_equal(be.to_numpy(kv.draft_tokens)[1:1 + first_unclear],
                                      np.array(tokens[:first_unclear]))
        np.testing.assert_array_equal(be.to_numpy(kv.candidate_ids)[:first_unclear],
                                      np.array(ids[:first_unclear]))


def test_selector_sampled_reproduces_the_numpy_sampler(emu):
    be = emu
    w, _ = built("g")
    lm = _lm()
    ring, _ = _ring(be, w, 9, seed=4)
    sp = SamplingParams(temperature=0.7, seed=11)
    with DraftKvCache(w, 23, lm_head=lm, backend=be, sampling=sp) as kv:
        noise = np.random.default_rng(5).standard_normal((kv.q_len, w.config.hidden_size)).astype(np.float32)
        anchor = be.asarray(np.array([4], np.int32))       # a device anchor: never read back
        kv.step(ring, 9, noise, anchor=anchor)
        _, _, ref = _kernel_refs(kv, w.device(be), lm, [4], temperature=0.7, seed=11, counter=9)
        np.testing.assert_array_equal(be.to_numpy(kv.draft_tokens), ref["tokens"][0])
        assert_close(be.to_numpy(kv.selector_q), ref["q"][0], "f32", "q")


def test_lanes_equal_single_caches(emu):
    """A batch's selector outputs per lane are the single cache's, bit for bit (idle lane too)."""
    be = emu
    w, _ = built("g")
    lm = _lm()
    H, B = w.config.hidden_size, w.config.q_len
    rng = np.random.default_rng(8)
    committed, anchors = [9, None, 17], [3, None, 18]
    noise = rng.standard_normal((3, B, H)).astype(np.float32)
    feats = [rng.standard_normal((c or 1, w.config.fc_in)).astype(np.float32) for c in committed]
    with DraftKvBatch(w, 23, 3, ring_capacity=25, ring_dtype=BF16, lm_head=lm, backend=be) as batch:
        for i, f in enumerate(feats):
            batch.rings[i].write(0, f)
        batch.step(committed, noise, anchors=anchors)
        got = {k: be.to_numpy(getattr(batch, k)) for k in ("hidden_states", "draft_tokens", "candidate_ids",
                                                            "candidate_values", "selector_q")}
    for i, c in enumerate(committed):
        if c is None:
            continue
        ring = FeatureRing(25, w.config.n_captured, H, BF16, backend=be)
        ring.write(0, feats[i])
        with DraftKvCache(w, 23, lm_head=lm, backend=be) as kv:
            kv.step(ring, c, noise[i], anchor=anchors[i])
            for k, v in got.items():
                assert np.array_equal(v[i], be.to_numpy(getattr(kv, k))), (i, k)
        ring.close()


def test_bad_selector_input_changes_nothing(emu):
    be = emu
    w, _ = built("g")
    lm = _lm()
    ring, _ = _ring(be, w, 9, seed=6)
    with pytest.raises(ValueError, match="vocab_size=19"):
        DraftKvCache(w, 23, lm_head=lm[:18], backend=be)
    with pytest.raises(ValueError, match="top_k"):
        DraftKvCache(w, 23, lm_head=lm, backend=be, sampling=SamplingParams(temperature=1.0, top_k=3))
    with DraftKvCache(w, 23, lm_head=lm, backend=be) as kv:
        noise = np.zeros((kv.q_len, w.config.hidden_size), np.float32)
        for bad, err in ((19, ValueError), (-1, ValueError), (2.0, TypeError), (None, ValueError)):
            with pytest.raises(err, match="anchor"):
                kv.step(ring, 9, noise, anchor=bad)
            assert kv.next_pos == 0 and not kv.engine._planned
        kv.begin_step(ring, 9)
        with pytest.raises(RuntimeError, match="anchor"):
            kv.run()
        kv.set_anchor(2)
        kv.run()
        assert int(be.to_numpy(kv.draft_tokens)[0]) == 2
    with DraftKvBatch(w, 23, 2, ring_capacity=25, ring_dtype=BF16, lm_head=lm, backend=be) as batch:
        noise = np.zeros((2, 4, w.config.hidden_size), np.float32)
        batch.rings[0].write(0, np.zeros((5, w.config.fc_in), np.float32))
        with pytest.raises(TypeError, match=r"anchors\[1\]"):
            batch.step([5, 5], noise, anchors=[1, None])        # lane 1 is active: it needs one
        with pytest.raises(ValueError, match=r"anchors\[0\]=40"):
            batch.step([5, None], noise, anchors=[40, None])
        assert batch.next_pos == [0, 0]
        batch.step([5, None], noise, anchors=[1, None])
        assert batch.next_pos == [5, 0]


_SEL_OUT = ("hidden_states", "draft_tokens", "candidate_ids", "candidate_values", "selector_choice", "selector_q")


def test_sampled_lanes_equal_single_caches(emu):
    """At temperature > 0 each lane draws with its own SamplingParams and its own first noise
    position as the counter: lane i equals a single cache built with the same SamplingParams
    bit for bit (walk, candidates, q), over steps with an idle lane, a rewind and a jump; one
    SamplingParams for every lane, then a per-lane list (a greedy lane among them) set between
    steps without recapture."""
    be = emu
    w, _ = built("g")
    lm = _lm()
    c = w.config
    H, B, L = c.hidden_size, c.q_len, 3
    rng = np.random.default_rng(31)
    shared = SamplingParams(temperature=0.9, seed=77)
    per_lane = [SamplingParams(temperature=1.4, seed=5), SamplingParams(), SamplingParams(temperature=0.6, seed=5)]
    schedule = [[9, None, 17], [13, 5, 19], [None, 8, 12],      # lane 2 rewinds (19 -> 12)
                "set", [15, 11, 14], [16, None, 40], [17, 12, 41]]   # lane 2 jumps past its window
    batch = DraftKvBatch(w, 23, L, ring_capacity=25, ring_dtype=BF16, lm_head=lm, backend=be, sampling=shared)
    singles = [DraftKvCache(w, 23, lm_head=lm, backend=be, sampling=shared) for _ in range(L)]
    rings = [FeatureRing(25, c.n_captured, H, BF16, backend=be) for _ in range(L)]
    try:
        assert batch.sampling == (shared,) * L
        graphs = None
        sampled_q = 0
        for k, committed in enumerate(schedule):
            if committed == "set":
                graphs = list(batch._graphs)
                batch.set_sampling(per_lane)
                for kv, sp in zip(singles, per_lane):
                    kv.set_sampling(sp)
                assert batch.sampling == tuple(per_lane)
                continue
            noise = rng.standard_normal((L, B, H)).astype(np.float32)
            anchors = [None if x is None else int(rng.integers(0, V)) for x in committed]
            for i, x in enumerate(committed):
                if x is not None:   # the window's rows, new ones each step (a rewind's too)
                    lo = max(0, x - 23)
                    f = rng.standard_normal((x - lo, c.fc_in)).astype(np.float32)
                    batch.rings[i].write(lo, f)
                    rings[i].write(lo, f)
            batch.step(committed, noise, anchors=anchors)
            got = {name: be.to_numpy(getattr(batch, name)) for name in _SEL_OUT}
            for i, x in enumerate(committed):
                if x is None:
                    continue
                singles[i].step(rings[i], x, noise[i], anchor=anchors[i])
                for name in _SEL_OUT:
                    assert np.array_equal(got[name][i], be.to_numpy(getattr(singles[i], name))), (k, i, name)
                q = got["selector_q"][i]
                sampled_q += int(((q > 0) & (q < 1)).any())
        assert sampled_q >= 8, sampled_q           # the draws were sampled, not one-hot
        assert batch._graphs == graphs and batch.captures == 2   # knobs as data: never recaptured
        # the greedy lane's q is one-hot (per-lane temperatures reached the walk)
        q1 = be.to_numpy(batch.selector_q)[1]
        assert ((q1 == 0) | (q1 == 1)).all()
    finally:
        batch.close()
        for kv, r in zip(singles, rings):
            kv.close()
            r.close()


def test_bad_batch_sampling_changes_nothing(emu):
    """Bad ``sampling`` (type, per-lane length, an entry's type, top-k/top-p for the selector,
    temperature > 0 without an lm_head) raises naming it; set_sampling leaves the lanes'
    sampling as it was."""
    be = emu
    w, _ = built("g")
    lm = _lm()
    kw = dict(ring_capacity=25, ring_dtype=BF16, backend=be)
    hot = SamplingParams(temperature=1.0, seed=1)
    cases = [({"temperature": 1.0}, TypeError,
              r"^sampling must be a SamplingParams or a sequence of one per lane \(3\)"),
             ([hot, hot], ValueError, r"^sampling has 2 entries, expected one per lane \(3\)"),
             ([hot, 0.5, hot], TypeError, r"^sampling\[1\] must be a SamplingParams, got float"),
             ([hot, hot, SamplingParams(temperature=1.0, top_p=0.9)], ValueError, r"^sampling\[2\]: a DFlash 2"),
             (SamplingParams(temperature=1.0, top_k=2), ValueError, r"^sampling: a DFlash 2")]
    for bad, err, msg in cases:
        with pytest.raises(err, match=msg):
            DraftKvBatch(w, 23, 3, lm_head=lm, sampling=bad, **kw)
    with pytest.raises(ValueError, match=r"^sampling with temperature > 0 needs an lm_head"):
        DraftKvBatch(w, 23, 3, sampling=hot, **kw)
    with pytest.raises(ValueError, match=r"^sampling with temperature > 0 needs an lm_head"):
        DraftKvCache(w, 23, sampling=hot, backend=be)
    with DraftKvBatch(w, 23, 3, lm_head=lm, sampling=[hot, SamplingParams(), hot], **kw) as batch:
        before = batch.sampling
        for bad, err, msg in cases:
            with pytest.raises(err, match=msg):
                batch.set_sampling(bad)
            assert batch.sampling == before
        with pytest.raises(TypeError, match="^sampling must be a SamplingParams or a sequence"):
            batch.set_sampling(None)
        assert batch.sampling == before
    with DraftKvBatch(w, 23, 2, **kw) as batch:        # no lm_head: nothing to sample
        with pytest.raises(ValueError, match="needs an lm_head"):
            batch.set_sampling(hot)
        assert batch.sampling == (SamplingParams(),) * 2
    with DraftKvCache(w, 23, lm_head=lm, backend=be) as kv:   # a single cache takes no per-lane list
        with pytest.raises(TypeError, match=r"^sampling must be a SamplingParams, got list"):
            kv.set_sampling([hot])
        assert kv.sampling == SamplingParams()


def test_step_finish_fused_or_not_is_bit_identical(emu, monkeypatch):
    """The finish convolutions in the o / down GEMMs' epilogue (gemm_fin.cuh, then an rms
    launch) and the fallback a launch that cannot fuse takes (the plain product through a zero
    residual, then finish_norm): the same step outputs bit for bit."""
    from dflash_cupy.ops.gemm import Gemm
    out = []
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(Gemm, "fuses_finish", lambda self, m, lane_rows=None: False)
        d = Driver(emu, "g", seed=5)
        try:
            eng = d.kv.engine
            assert eng.g_o.finish is not None and eng.g_down.finish is not None
            assert eng.g_o.fuses_finish(eng.n_noise, eng.lane_rows) == fuse
            d.step(11)                                       # checked against the oracle inside
            out.append(emu.to_numpy(d.kv.hidden_states).copy())
        finally:
            d.close()
    np.testing.assert_array_equal(out[0], out[1])
