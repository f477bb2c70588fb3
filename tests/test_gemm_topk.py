"""The lm_head GEMM with each column block's top-K fused (Gemm epilogue "topk",
gemm_stream.cu GS_EPI 4): its partials against the top-K of the GEMM's own logits, exactly
(keys and ids, best first, empty slots past a block's columns), at vocabularies that are not
a multiple of the column block, with ties, K above a block's columns and non-finite logits;
merged by SelectorKernels.merge_partials into the selector's candidates (rows mapped per
lane); and in the DFlash 2 step, where the candidates do not depend on ``logits``."""
import ml_dtypes
import numpy as np
import pytest

from dflash_cupy import dtypes
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_batch import DraftKvBatch
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.ops import gemm_stream
from dflash_cupy.ops.gemm import Gemm
from dflash_cupy.ops.sample import SamplingParams, _order_keys
from dflash_cupy.ops.selector import SelectorKernels, topk_reference, walk_reference
from dflash_cupy.tolerances import assert_close
from tests.support.drafters import BF16, built
from tests.support.gemm import host_weights
from tests.test_selector import _values_match, config

COLS = gemm_stream.cols_per_block(1)


def partials_of(y, k, cols=COLS):
    """The partials GS_EPI 4 writes for logits ``y`` [m, N]: per row and ``cols``-wide block
    its k best (order key, id), best first (key descending, then id ascending), then empty
    slots (0, 0xffffffff)."""
    m, N = y.shape
    nb = -(-N // cols)
    out = np.zeros((m, nb, k, 2), np.uint32)
    out[..., 1] = 0xFFFFFFFF
    for r in range(m):
        for b in range(nb):
            seg = y[r, b * cols:(b + 1) * cols]
            keys = _order_keys(seg)
            best = np.lexsort((np.arange(seg.size), -keys.astype(np.int64)))[:k]
            out[r, b, :best.size, 0] = keys[best]
            out[r, b, :best.size, 1] = best + b * cols
    return out


def _run(be, xh, wh, N, K, m, k, logits, wkind="bf16"):
    op = Gemm(be, N, K, wkind, "topk", max_m=64, logits=logits, top_k=k)
    part = be.asarray(np.full(op.partials_shape(m), 0x5A5A5A5A, np.uint32))   # every slot written
    y = be.zeros((m, N), np.float32) if logits else None
    op(be.asarray(xh), be.asarray(wh), y, m, partials=part)
    return op, be.to_numpy(part), (be.to_numpy(y) if logits else None)


def _plain(be, xh, wh, N, K, m, wkind="bf16"):
    y = be.zeros((m, N), np.float32)
    Gemm(be, N, K, wkind, max_m=64)(be.asarray(xh), be.asarray(wh), y, m)
    return be.to_numpy(y)


# N: one partial block, a vocabulary past whole blocks (44 columns in the last), 3 blocks;
# k: above the last block's columns (37 < 50; 44 < 50), at the bound 64
@pytest.mark.parametrize("N,K,m,k", [(37, 40, 1, 50), (300, 64, 3, 50), (600, 136, 19, 5), (531, 72, 33, 64)])
def test_fused_topk_is_the_top_k_of_the_logits(backend, rng, N, K, m, k):
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, N, K, "bf16")
    wh[N // 2] = wh[N // 5]                     # duplicated rows: equal logits, the lower id first
    wh[N - 1] = wh[3]                           # a tie across column blocks
    _, part, y = _run(backend, xh, wh, N, K, m, k, True)
    np.testing.assert_array_equal(y, _plain(backend, xh, wh, N, K, m))   # the plain GEMM's logits
    np.testing.assert_array_equal(part, partials_of(y, k))
    _, part0, y0 = _run(backend, xh, wh, N, K, m, k, False)              # no logits: same partials
    assert y0 is None
    np.testing.assert_array_equal(part0, part)


def test_non_finite_logits_rank_by_the_order_key(backend):
    """+inf first, then the finite values, -inf, NaN last (float_order.cuh), ties to the lowest
    id. x rounded once (x_split=False): an infinite x then gives +-inf where w > 0 / w < 0 and
    NaN where w = 0 (inf * 0), on any IEEE hardware; a NaN x gives a row of NaN."""
    N, K, m, k = 290, 64, 4, 20
    r = np.random.default_rng(3)
    xh = r.standard_normal((m, K)).astype(np.float32)
    xh[0, 0], xh[2, 0] = np.inf, np.nan        # rows 1 and 3 finite
    w = (r.standard_normal((N, K)) * 0.1).astype(np.float32)
    w[:, 0] = np.where(r.random(N) < 0.3, 0.0, np.sign(r.standard_normal(N)))
    w[[5, 260, 7], 0] = 1.0                     # +inf in row 0 (in two column blocks)
    w[[9, 270], 0] = -1.0                       # -inf
    w[[11, 280], 0] = 0.0                       # NaN
    wh = dtypes.device_bits(w.astype(ml_dtypes.bfloat16))
    op = Gemm(backend, N, K, "bf16", "topk", max_m=64, logits=True, top_k=k, x_split=False)
    pdev, ydev = backend.zeros(op.partials_shape(m), np.uint32), backend.zeros((m, N), np.float32)
    op(backend.asarray(xh), backend.asarray(wh), ydev, m, partials=pdev)
    part, y = backend.to_numpy(pdev), backend.to_numpy(ydev)
    assert np.isposinf(y[0, [5, 7, 260]]).all() and np.isneginf(y[0, [9, 270]]).all()
    assert np.isnan(y[0, [11, 280]]).all() and np.isnan(y[2]).all() and np.isfinite(y[[1, 3]]).all()
    np.testing.assert_array_equal(part, partials_of(y, k))
    pos = np.flatnonzero(np.isposinf(y[0, :COLS]))
    np.testing.assert_array_equal(part[0, 0, :min(k, pos.size), 1], pos[:k])   # +inf first, lowest ids
    np.testing.assert_array_equal(part[2, 0, :, 1], np.arange(k))               # all NaN: by id
    # merged: the selector's candidates are topk_reference of the logits (NaN last)
    c = config(vocab=N, K=k, q_len=m + 1)
    sel = SelectorKernels(backend, c, m + 1, 1, partial_blocks=part.shape[1])
    ids, vals = backend.zeros((1, m, k), np.int32), backend.zeros((1, m, k), np.float32)
    sel.merge_partials(backend.asarray(part), ids, vals)
    want_ids, want_vals = topk_reference(y, k, N, 0.7, 3.0)
    np.testing.assert_array_equal(backend.to_numpy(ids)[0], want_ids)
    _values_match(backend.to_numpy(vals)[0], want_vals, "vals")


@pytest.mark.parametrize("lanes,q_len,stride", [(3, 4, 16), (2, 16, 16), (1, 2, 5)])
def test_merged_with_the_row_mapping_per_lane(backend, rng, lanes, q_len, stride):
    """Partials of every GEMM row (lanes' blocks of ``stride`` rows); lane l's selector row j is
    GEMM row l * stride + 1 + j: the candidates equal the selector's own top-K of the logits."""
    N, K, k = 700, 48, 6
    m = lanes * stride
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, N, K, "bf16")
    wh[400] = wh[2]
    _, part, y = _run(backend, xh, wh, N, K, m, k, True)
    c = config(vocab=N, K=k, q_len=q_len)
    sel = SelectorKernels(backend, c, q_len, lanes, partial_blocks=part.shape[1])
    R = q_len - 1
    ids, vals = backend.zeros((lanes, R, k), np.int32), backend.zeros((lanes, R, k), np.float32)
    sel.merge_partials(backend.asarray(part), ids, vals, row0=1, row_stride=stride)
    ids2, vals2 = backend.zeros((lanes, R, k), np.int32), backend.zeros((lanes, R, k), np.float32)
    sel.topk(backend.asarray(y), ids2, vals2, row0=1, row_stride=stride)   # the unfused path
    np.testing.assert_array_equal(backend.to_numpy(ids), backend.to_numpy(ids2))
    np.testing.assert_array_equal(backend.to_numpy(vals), backend.to_numpy(vals2))
    rows = np.concatenate([y[l * stride + 1:l * stride + q_len] for l in range(lanes)])
    want_ids, _ = topk_reference(rows, k, N, 0.7, 3.0)
    np.testing.assert_array_equal(backend.to_numpy(ids).reshape(-1, k), want_ids)
    with pytest.raises(ValueError, match="partials must have shape"):
        sel.merge_partials(backend.asarray(part[:(lanes - 1) * stride + R].copy()), ids, vals, row0=1,
                           row_stride=stride)   # one row short


def test_topk_arguments_are_checked(backend):
    with pytest.raises(ValueError, match="'topk' needs the 'stream' path"):
        Gemm(backend, 64, 64, "f32", "topk", top_k=4)
    with pytest.raises(ValueError, match="top_k=65 must be <= 64"):
        Gemm(backend, 64, 64, "bf16", "topk", top_k=65)
    with pytest.raises(TypeError, match="top_k must be an int"):
        Gemm(backend, 64, 64, "bf16", "topk")
    with pytest.raises(ValueError, match="only 'topk' takes it"):
        Gemm(backend, 64, 64, "bf16", "argmax", top_k=4)
    with pytest.raises(ValueError, match="does not fold an RMSNorm"):
        Gemm(backend, 64, 64, "bf16", "topk", top_k=4, norm_eps=1e-6)
    op = Gemm(backend, 300, 64, "bf16", "topk", top_k=4, logits=False)
    assert op.partials_shape(5) == (5, 2, 4, 2) and op.launch_candidates(5) and \
        {ks for _, ks in op.launch_candidates(5)} == {1}          # no split K
    x, w = backend.zeros((5, 64), np.float32), backend.zeros((300, 64), np.uint16)
    with pytest.raises(ValueError, match="partials is required"):
        op(x, w, None, 5)
    with pytest.raises(ValueError, match="partials must have shape"):
        op(x, w, None, 5, partials=backend.zeros((5, 2, 3, 2), np.uint32))
    with pytest.raises(ValueError, match="y must be None"):
        op(x, w, backend.zeros((5, 300), np.float32), 5, partials=backend.zeros((5, 2, 4, 2), np.uint32))


# --------------------------------------------------------------------------- in the DFlash 2 step
OUTS = ("candidate_ids", "candidate_values", "draft_tokens", "selector_choice", "selector_q")


def _lm16(w, seed=3):
    r = np.random.default_rng(seed)
    lm = (r.standard_normal((19, w.config.hidden_size)) / np.sqrt(w.config.hidden_size)).astype(BF16)
    lm[11] = lm[4]                                          # equal logits: the lower id first
    return dtypes.device_bits(lm)


def _step(be, w, lm, logits, feats, committed, noise, anchor):
    ring = FeatureRing(25, w.config.n_captured, w.config.hidden_size, BF16, backend=be)
    ring.write(0, feats)
    with DraftKvCache(w, 23, lm_head=lm, logits=logits, backend=be) as kv:
        assert kv.engine._lm_part is not None and kv.engine.g_lm.epilogue == "topk"   # the fused path
        kv.step(ring, committed, noise, anchor=anchor)
        out = {k: be.to_numpy(getattr(kv, k)) for k in OUTS + ("hidden_states",)}
        out["logits"] = None if kv.logits is None else be.to_numpy(kv.logits)
    ring.close()
    return out


def test_step_candidates_do_not_depend_on_logits(emu):
    """A 16-bit lm_head: the fused top-K with and without logits gives the same outputs, bit for
    bit, and the candidates are the top-K of the logits written (the unfused path's input)."""
    be = emu
    w, _ = built("g")
    lm = _lm16(w)
    rng = np.random.default_rng(12)
    feats = rng.standard_normal((15, w.config.fc_in)).astype(np.float32)
    noise = rng.standard_normal((w.config.q_len, w.config.hidden_size)).astype(np.float32)
    a = _step(be, w, lm, True, feats, 15, noise, 6)
    b = _step(be, w, lm, False, feats, 15, noise, 6)
    assert b["logits"] is None
    for k in OUTS + ("hidden_states",):
        assert np.array_equal(a[k], b[k]), k
    d2 = w.config.dflash2
    ids, vals = topk_reference(a["logits"][1:], d2.selector_top_k, 19, d2.output_multiplier,
                               d2.final_logit_softcapping)
    np.testing.assert_array_equal(a["candidate_ids"], ids)
    _values_match(a["candidate_values"], vals, "candidate_values")


def test_step_lanes_equal_single_caches_fused(emu):
    be = emu
    w, _ = built("g")
    lm = _lm16(w, seed=5)
    H, B = w.config.hidden_size, w.config.q_len
    rng = np.random.default_rng(13)
    committed, anchors = [9, None, 17], [3, None, 18]
    noise = rng.standard_normal((3, B, H)).astype(np.float32)
    feats = [rng.standard_normal((c or 1, w.config.fc_in)).astype(np.float32) for c in committed]
    with DraftKvBatch(w, 23, 3, ring_capacity=25, ring_dtype=BF16, lm_head=lm, logits=False, backend=be) as batch:
        assert batch.engine._lm_part is not None
        for i, f in enumerate(feats):
            batch.rings[i].write(0, f)
        batch.step(committed, noise, anchors=anchors)
        got = {k: be.to_numpy(getattr(batch, k)) for k in OUTS}
    for i, c in enumerate(committed):
        if c is not None:
            one = _step(be, w, lm, False, feats[i], c, noise[i], anchors[i])
            for k in OUTS:
                assert np.array_equal(got[k][i], one[k]), (i, k)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_step_walks_the_merged_candidates(emu, temperature):
    """The fused path merges and walks in one launch (SelectorKernels.merge_and_walk): the
    step's tokens, choices and q are the walk's NumPy reference from the step's own hidden
    states and merged candidates."""
    be = emu
    w, _ = built("g")
    lm = _lm16(w, seed=7)
    c = w.config
    rng = np.random.default_rng(14)
    feats = rng.standard_normal((11, c.fc_in)).astype(np.float32)
    noise = rng.standard_normal((c.q_len, c.hidden_size)).astype(np.float32)
    ring = FeatureRing(25, c.n_captured, c.hidden_size, BF16, backend=be)
    ring.write(0, feats)
    sp = SamplingParams(temperature=temperature, seed=3)
    with DraftKvCache(w, 23, lm_head=lm, logits=False, backend=be, sampling=sp) as kv:
        assert kv.engine._lm_part is not None                   # the fused path
        kv.step(ring, 11, noise, anchor=5)
        got = {k: be.to_numpy(getattr(kv, k)) for k in OUTS + ("hidden_states",)}
        dw = w.device(be)
        ref = walk_reference(got["hidden_states"][None], be.to_numpy(dw.selector_hp), be.to_numpy(dw.selector_pred),
                             be.to_numpy(dw.selector_succ), np.array([5], np.int32), got["candidate_ids"][None],
                             got["candidate_values"][None], 19, temperature=temperature, seed=3, counter=11)
    ring.close()
    assert (ref["margin"] > 1e-6).all()
    np.testing.assert_array_equal(got["draft_tokens"], ref["tokens"][0])
    np.testing.assert_array_equal(got["selector_choice"], ref["choice"][0])
    assert_close(got["selector_q"], ref["q"][0], "f32", "q")


# --------------------------------------------------------------------------- the cost model's counters
@pytest.mark.parametrize("epi,N,K,M,k", [("topk", 600, 64, 19, 16), ("topk", 531, 64, 40, 5),
                                         ("topk", 300, 128, 16, 64), ("argmax", 600, 64, 19, 0)])
def test_static_counters_of_the_fused_select_match_the_emulator(epi, N, K, M, k):
    """profiling/counters.py's access model of the fused top-K (and argmax) epilogue against the
    emulator's counts of the same launch (every block run): requests, sectors, shared-memory
    wavefronts and barriers exactly (argmax: its partial stores' sectors aside)."""
    from profiling import counters as ctr
    from profiling.emulated_counters import emulated_counters
    from profiling.step_trace import RecordingBackend
    be = RecordingBackend()
    op = Gemm(be, N, K, "bf16", epi, max_m=64, logits=False, **({"top_k": k} if k else {}))
    part = be.empty(op.partials_shape(M), np.uint32)
    op(be.empty((M, K), np.float32), be.empty((N, K), np.uint16), None, M, partials=part)
    launch = be.eager[-1]
    s, e = ctr.static_counters(launch), emulated_counters(launch, n=10**6)
    fields = ["gld_requests", "gst_requests", "smem_requests", "smem_wavefronts", "barriers", "mma"]
    if epi == "topk":
        fields += ["gst_sectors", "gst_bytes"]
        assert s.bytes_written[next(n for n in s.bytes_written if "partials" in n)] == M * -(-N // COLS) * k * 8
    for f in fields:
        assert getattr(s, f) == getattr(e, f), (f, getattr(s, f), getattr(e, f))
    assert not any("logits" == n for n in s.bytes_written)
