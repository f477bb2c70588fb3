"""TokenSampler (cuda_src/sample.cu) against sample_reference: greedy argmax
with ties and NaN, seeded sampling with temperature / top-k / top-p, the
Philox generator against its published answers, determinism, the drawn
distribution, and bad input."""
import numpy as np
import pytest

from dflash_cupy.ops.sample import (SamplingParams, TokenSampler, philox4x32_10, row_uniform64,
                                    sample_reference)


def _run(backend, logits_h, params: SamplingParams, counter: int, vocab=None):
    V = logits_h.shape[1] if vocab is None else vocab
    op = TokenSampler(backend, V)
    logits = backend.asarray(np.ascontiguousarray(logits_h, np.float32))
    tokens = backend.asarray(np.full(logits_h.shape[0], -7, np.int32))
    knobs = backend.asarray(params.knobs())
    rng = backend.asarray(np.array([params.seed, counter], np.uint64))
    op(logits, tokens, knobs, rng, logits_h.shape[0])
    return backend.to_numpy(tokens)


def test_philox_known_answers():
    # Random123's published test vectors for Philox4x32-10.
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6,
                                                                   0x6D5451FD)
    assert philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


@pytest.mark.parametrize("V", [1, 3, 19, 33, 1000, 5003])
def test_greedy_is_first_argmax(backend, rng, V):
    rows = 5
    lg = rng.standard_normal((rows, V)).astype(np.float32)
    if V > 3:
        lg[1, [V // 3, V - 1]] = lg[1].max() + 1.0  # a tie: the lower id wins
        lg[2, 0] = np.nan                           # NaN ranks below everything
        lg[3, :] = -np.inf
        lg[3, V // 2] = np.float32(-3e38)
    got = _run(backend, lg, SamplingParams(), counter=0)
    ref, _ = sample_reference(lg, SamplingParams(), 0)
    np.testing.assert_array_equal(got, ref)
    finite = np.where(np.isnan(lg), -np.inf, lg)
    np.testing.assert_array_equal(got, np.argmax(finite, axis=1))
    if V > 3:
        assert got[1] == V // 3 and got[3] == V // 2


@pytest.mark.parametrize("V,params", [
    (19, SamplingParams(temperature=1.0, seed=1)),
    (33, SamplingParams(temperature=0.7, top_k=5, seed=2)),
    (1000, SamplingParams(temperature=1.3, top_p=0.9, seed=3)),
    (1000, SamplingParams(temperature=0.8, top_k=50, top_p=0.5, seed=2**63 + 5)),
    (5003, SamplingParams(temperature=1.0, top_k=1, seed=4)),
    (3, SamplingParams(temperature=2.0, top_p=0.01, seed=5)),
])
def test_sampling_matches_reference(backend, rng, V, params):
    rows, counter = 9, 2**33 + 17  # a counter past 32 bits: both halves reach the generator
    lg = (2.0 * rng.standard_normal((rows, V))).astype(np.float32)
    lg[0, : min(V, 4)] = lg[0].max()  # ties at the top
    got = _run(backend, lg, params, counter)
    ref, margin = sample_reference(lg, params, counter)
    clear = margin > 1e-6  # a last-bit exp difference can only move draws closer than this
    assert clear.sum() >= rows - 1
    np.testing.assert_array_equal(got[clear], ref[clear])
    assert ((got >= 0) & (got < V)).all()
    if 0 < params.top_k < V:  # every draw is inside the top-k (ties at the threshold allowed)
        kth = np.sort(lg, axis=1)[:, -params.top_k]
        assert (lg[np.arange(rows), got] >= kth).all()
    if params.top_k == 1:  # only the largest logit (any of its ties) can be drawn
        np.testing.assert_array_equal(lg[np.arange(rows), got], lg.max(axis=1))


def test_top_p_keeps_the_nucleus(backend):
    # probabilities 0.5, 0.25, 0.125, ...: top_p = 0.7 keeps exactly the first two
    V = 12
    lg = np.log(0.5 ** np.arange(1, V + 1, dtype=np.float64)).astype(np.float32)[None].repeat(64, 0)
    got = _run(backend, lg, SamplingParams(temperature=1.0, top_p=0.7, seed=9), counter=3)
    assert set(got.tolist()) <= {0, 1} and len(set(got.tolist())) == 2
    ref, _ = sample_reference(lg, SamplingParams(temperature=1.0, top_p=0.7, seed=9), 3)
    np.testing.assert_array_equal(got, ref)


def test_deterministic_for_a_seed_and_counter(backend, rng):
    lg = rng.standard_normal((8, 257)).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=123)
    a = _run(backend, lg, p, counter=40)
    b = _run(backend, lg, p, counter=40)
    np.testing.assert_array_equal(a, b)
    c = _run(backend, lg, SamplingParams(temperature=1.0, seed=124), counter=40)
    d = _run(backend, lg, p, counter=41)
    assert (a != c).any() and (a != d).any()


def test_draws_follow_the_softmax(backend):
    """400 rows of the same logits are 400 independent draws (one Philox counter
    per row): their histogram matches softmax(logits / T) (chi-square, 7 dof)."""
    V, rows, T = 8, 400, 0.9
    base = np.array([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 0.8], np.float32)
    lg = np.repeat(base[None], rows, 0)
    got = _run(backend, lg, SamplingParams(temperature=T, seed=77), counter=0)
    p = np.exp(base / T - (base / T).max())
    p /= p.sum()
    counts = np.bincount(got, minlength=V)
    chi2 = (((counts - rows * p) ** 2) / (rows * p)).sum()
    assert chi2 < 24.3, (counts, rows * p)  # 99.9th percentile of chi-square with 7 dof


def test_row_uniforms_are_distinct():
    u = {row_uniform64(r, 5, 1000) for r in range(64)}
    assert len(u) == 64


def test_bad_input(backend):
    for kw, exc, name in [(dict(temperature=-1.0), ValueError, "temperature"),
                          (dict(temperature=float("nan")), ValueError, "temperature"),
                          (dict(top_p=0.0), ValueError, "top_p"), (dict(top_p=1.5), ValueError, "top_p"),
                          (dict(top_k=-1), ValueError, "top_k"), (dict(top_k=2.5), TypeError, "top_k"),
                          (dict(seed=-1), ValueError, "seed"), (dict(temperature="1"), TypeError, "temperature")]:
        with pytest.raises(exc, match=name):
            SamplingParams(**kw)
    op = TokenSampler(backend, 10)
    lg = backend.asarray(np.zeros((2, 10), np.float32))
    tok = backend.asarray(np.zeros(2, np.int32))
    knobs = backend.asarray(SamplingParams().knobs())
    rng_ = backend.asarray(np.zeros(2, np.uint64))
    with pytest.raises(ValueError, match="logits"):
        op(backend.asarray(np.zeros((2, 9), np.float32)), tok, knobs, rng_, 2)
    with pytest.raises(TypeError, match="tokens"):
        op(lg, backend.asarray(np.zeros(2, np.int64)), knobs, rng_, 2)
    with pytest.raises(ValueError, match="n_rows"):
        op(lg, tok, knobs, rng_, 3)
    with pytest.raises(ValueError, match="rng"):
        op(lg, tok, knobs, backend.asarray(np.zeros(3, np.uint64)), 2)
    with pytest.raises(ValueError, match="vocab"):
        TokenSampler(backend, 0)


def test_lane_blocks_draw_as_one_lane_calls(backend, rng):
    """``lane_rows``: lanes' blocks of rows, each with its own knobs [lanes, 3] and rng
    [lanes, 2], drawn as row r of a one-lane call (so a lane of a batch equals a single cache);
    the padding rows of the last lane are left out by n_rows."""
    V, lanes, lane_rows = 37, 3, 5
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=4), SamplingParams(),
              SamplingParams(temperature=1.4, top_k=6, seed=2**64 - 3)]
    counters = [9, 0, 2**33 + 1]
    lg = (2.0 * rng.standard_normal((lanes * lane_rows, V))).astype(np.float32)
    n_rows = lanes * lane_rows - 2
    op = TokenSampler(backend, V)
    tokens = backend.asarray(np.full(lanes * lane_rows, -7, np.int32))
    knobs = backend.asarray(np.stack([p.knobs() for p in params]))
    rngs = backend.asarray(np.array([[p.seed, c] for p, c in zip(params, counters)], np.uint64))
    op(backend.asarray(lg), tokens, knobs, rngs, n_rows, lane_rows=lane_rows)
    got = backend.to_numpy(tokens)
    for lane, (p, c) in enumerate(zip(params, counters)):
        rows = slice(lane * lane_rows, min((lane + 1) * lane_rows, n_rows))
        one = _run(backend, lg[rows], p, c)
        np.testing.assert_array_equal(got[rows], one, err_msg=f"lane {lane}")
        ref, margin = sample_reference(lg[rows], p, c)
        np.testing.assert_array_equal(got[rows][margin > 1e-6], ref[margin > 1e-6])
    assert (got[n_rows:] == -7).all()
    with pytest.raises(ValueError, match=r"^rng must have shape \[3, 2\]"):
        op(backend.asarray(lg), tokens, knobs, backend.asarray(np.zeros((2, 2), np.uint64)), n_rows,
           lane_rows=lane_rows)
    with pytest.raises(ValueError, match="exceeds 3 lanes of lane_rows=4"):
        op(backend.asarray(lg), tokens, knobs, rngs, n_rows, lane_rows=4)
    with pytest.raises(ValueError, match="^knobs must be 2-D"):
        op(backend.asarray(lg), tokens, backend.asarray(params[0].knobs()), rngs, n_rows, lane_rows=lane_rows)
