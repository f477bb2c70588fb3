"""Draft tokens in the step graph (DraftKvCache with an lm_head): greedy and
seeded sampling against the NumPy reference sampler on the step's own
logits, knobs changed between steps without recapture, outputs into the
caller's buffers, foreign (DLPack) inputs used in place, and bad input."""
import numpy as np
import pytest

from dflash_cupy import backends, reference
from dflash_cupy.config import DraftConfig
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.ops.sample import SamplingParams, sample_reference
from dflash_cupy.weights import DraftWeights

VOCAB = 37


class _DLPack:
    """A CPU tensor that speaks only DLPack (as a PyTorch/JAX CPU tensor would)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return (1, 0)


@pytest.fixture(scope="module")
def drafter():
    cfg = DraftConfig(n_layer=1, hidden_size=32, n_head=2, n_head_kv=1, head_dim=32, intermediate_size=48,
                      block_size=4, target_layer_ids=(0, 1), rms_norm_eps=1e-6, rope_theta=10000.0)
    w = DraftWeights.random(cfg, seed=11, dtype="bf16")
    lm = np.random.default_rng(12).standard_normal((VOCAB, cfg.hidden_size)).astype(np.float32)
    feats = np.random.default_rng(13).standard_normal((200, cfg.fc_in)).astype(np.float32)
    return cfg, w, lm, feats


def _steps(kv, ring, feats, cfg, commits, rng, **kw):
    be = kv.backend
    out = []
    for c in commits:
        ring.write(max(0, c - ring.capacity), feats[max(0, c - ring.capacity):c])
        noise = rng.standard_normal((kv.q_len, cfg.hidden_size)).astype(np.float32)
        kv.step(ring, c, noise, **kw)
        out.append((c, noise, be.to_numpy(kv.logits), be.to_numpy(kv.draft_tokens)))
    return out


def test_greedy_tokens_are_the_argmax_of_the_step_logits(emu, drafter):
    cfg, w, lm, feats = drafter
    ring = FeatureRing(64, cfg.n_captured, cfg.hidden_size, backend=emu)
    with DraftKvCache(w, 24, lm_head=lm, backend=emu) as kv:
        for c, noise, logits, tokens in _steps(kv, ring, feats, cfg, [5, 9, 12, 40], np.random.default_rng(1)):
            np.testing.assert_array_equal(tokens, np.argmax(logits, axis=1))
            ref = reference.draft_forward(w, feats[max(0, c - 24):c], noise, lm_head=lm)[1]
            top2 = np.sort(ref, axis=1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 1e-2  # the oracle's argmax is unambiguous there
            np.testing.assert_array_equal(tokens[clear], np.argmax(ref, axis=1)[clear])


def test_sampled_tokens_follow_the_reference_and_knobs_change_without_recapture(emu, drafter):
    cfg, w, lm, feats = drafter
    ring = FeatureRing(64, cfg.n_captured, cfg.hidden_size, backend=emu)
    p1 = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    p2 = SamplingParams(temperature=0.5, top_k=4, seed=8)
    with DraftKvCache(w, 24, lm_head=lm, sampling=p1, backend=emu) as kv:
        runs = _steps(kv, ring, feats, cfg, [6, 10, 13], np.random.default_rng(2))
        graphs = list(kv._graphs)
        kv.set_sampling(p2)
        runs2 = _steps(kv, ring, feats, cfg, [16, 19, 22], np.random.default_rng(3))
        assert kv._graphs == graphs  # same graph objects: the knobs travel as data
    for params, rs in ((p1, runs), (p2, runs2)):
        for c, _, logits, tokens in rs:
            ref, margin = sample_reference(logits, params, counter=c)
            ok = margin > 1e-6
            np.testing.assert_array_equal(tokens[ok], ref[ok])
            assert ok.sum() >= len(ok) - 1
    # the same seed reproduces the run in another cache; another seed does not
    ring2 = FeatureRing(64, cfg.n_captured, cfg.hidden_size, backend=emu)
    with DraftKvCache(w, 24, lm_head=lm, sampling=p1, backend=emu) as kv2:
        again = _steps(kv2, ring2, feats, cfg, [6, 10, 13], np.random.default_rng(2))
    for a, b in zip(runs, again):
        np.testing.assert_array_equal(a[3], b[3])


def test_outputs_into_the_callers_buffers(emu, drafter):
    cfg, w, lm, feats = drafter
    ring = FeatureRing(64, cfg.n_captured, cfg.hidden_size, backend=emu)
    rng = np.random.default_rng(4)
    with DraftKvCache(w, 24, lm_head=lm, backend=emu) as kv:
        mine_h = emu.zeros((kv.q_len, cfg.hidden_size), np.float32)
        mine_t = emu.zeros((kv.q_len,), np.int32)
        ring.write(0, feats[:8])
        kv.step(ring, 8, rng.standard_normal((kv.q_len, cfg.hidden_size)).astype(np.float32),
                out=mine_h, tokens_out=mine_t)
        first_h, first_t = emu.to_numpy(kv.hidden_states), emu.to_numpy(kv.draft_tokens)
        ring.write(8, feats[8:11])
        kv.step(ring, 11, rng.standard_normal((kv.q_len, cfg.hidden_size)).astype(np.float32))
        np.testing.assert_array_equal(emu.to_numpy(mine_h), first_h)  # kept past the next step
        np.testing.assert_array_equal(emu.to_numpy(mine_t), first_t)
        assert not np.array_equal(emu.to_numpy(kv.hidden_states), first_h)
        with pytest.raises(TypeError, match="out must be a device array"):
            kv.step(ring, 11, np.zeros((kv.q_len, cfg.hidden_size), np.float32),
                    out=np.zeros((kv.q_len, cfg.hidden_size), np.float32))
        with pytest.raises(TypeError, match="tokens_out must have dtype int32"):
            kv.step(ring, 11, np.zeros((kv.q_len, cfg.hidden_size), np.float32),
                    tokens_out=emu.zeros((kv.q_len,), np.int64))
        assert kv.next_pos == 11  # the refused calls changed nothing


def test_foreign_inputs_are_used_in_place(emu, drafter):
    cfg, w, lm, feats = drafter
    ring = FeatureRing(64, cfg.n_captured, cfg.hidden_size, backend=emu)
    lm_foreign = _DLPack(lm)
    with DraftKvCache(w, 24, lm_head=lm_foreign, backend=emu) as kv:
        # (the emulated backend copies foreign CPU memory into its guarded device memory once;
        # on CUDA the caller's matrix is used in place, see test_interop)
        np.testing.assert_array_equal(emu.to_numpy(kv.lm_head), lm)
        ring.write(0, _DLPack(feats[:9]))          # foreign rows: copied device to device
        noise = np.random.default_rng(5).standard_normal((kv.q_len, cfg.hidden_size)).astype(np.float32)
        h = emu.to_numpy(kv.step(ring, 9, _DLPack(noise)))
        ref_h, ref_l = reference.draft_forward(w, feats[:9], noise, lm_head=lm)
        assert np.abs(h - ref_h).max() < 2e-3
        assert np.abs(emu.to_numpy(kv.logits) - ref_l).max() < 2e-3 * (1 + np.abs(ref_l).max())
        with pytest.raises(TypeError, match="noise_embed must have dtype float32"):
            kv.step(ring, 9, _DLPack(noise.astype(np.float64)))


def test_torch_tensors(emu, drafter):
    torch = pytest.importorskip("torch")
    cfg, w, lm, feats = drafter
    ring = FeatureRing(64, cfg.n_captured, cfg.hidden_size, backend=emu)
    with DraftKvCache(w, 24, lm_head=torch.from_numpy(lm), backend=emu) as kv:
        ring.write(0, torch.from_numpy(feats[:7]))
        kv.step(ring, 7, torch.zeros((kv.q_len, cfg.hidden_size)))
        kv.synchronize()
        tokens = torch.from_dlpack(kv.draft_tokens)  # zero-copy out
        assert tokens.dtype == torch.int32 and tokens.shape == (kv.q_len,)
        np.testing.assert_array_equal(tokens.numpy(), emu.to_numpy(kv.draft_tokens))


def test_bad_sampling_input(emu, drafter):
    cfg, w, lm, _ = drafter
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        DraftKvCache(w, 24, lm_head=lm, sampling={"temperature": 1.0}, backend=emu)
    with pytest.raises(ValueError, match="lm_head must have at least one row"):
        DraftKvCache(w, 24, lm_head=np.zeros((0, cfg.hidden_size), np.float32), backend=emu)
    with DraftKvCache(w, 24, backend=emu) as kv:
        assert kv.draft_tokens is None
        with pytest.raises(ValueError, match="needs an lm_head"):
            kv.set_sampling(SamplingParams(temperature=1.0))
    with DraftKvCache(w, 24, lm_head=lm, backend=emu) as kv:
        with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
            kv.set_sampling(0.5)
        assert kv.sampling == SamplingParams()


def test_fused_greedy_tokens_without_logits(emu, drafter):
    """logits=False: the greedy token comes out of the lm_head GEMM itself (no
    [q_len, vocab] logits written or read) and equals the logits path's token."""
    import ml_dtypes
    cfg, w, lm, feats = drafter
    lm16 = lm.astype(ml_dtypes.bfloat16)   # the fused path streams f16/bf16 weights
    ring = FeatureRing(64, cfg.n_captured, cfg.hidden_size, backend=emu)
    with DraftKvCache(w, 24, lm_head=lm16, backend=emu) as full, \
            DraftKvCache(w, 24, lm_head=lm16, logits=False, backend=emu) as fused:
        assert fused.logits is None and fused.draft_tokens is not None
        rng1, rng2 = np.random.default_rng(6), np.random.default_rng(6)
        a = _steps(full, ring, feats, cfg, [7, 11, 30], rng1)
        for c, _, logits, tokens in a:
            noise = rng2.standard_normal((fused.q_len, cfg.hidden_size)).astype(np.float32)
            fused.step(ring, c, noise)
            got = emu.to_numpy(fused.draft_tokens)
            np.testing.assert_array_equal(got, tokens)
            np.testing.assert_array_equal(got, np.argmax(logits, axis=1))
        with pytest.raises(ValueError, match="needs logits=True"):
            fused.set_sampling(SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="needs logits=True"):
        DraftKvCache(w, 24, lm_head=lm16, logits=False, sampling=SamplingParams(temperature=0.5), backend=emu)
    with pytest.raises(ValueError, match="'stream' path"):
        DraftKvCache(w, 24, lm_head=lm, logits=False, backend=emu)  # f32 lm_head: no fused path
