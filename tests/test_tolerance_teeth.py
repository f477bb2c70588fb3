"""Negative controls for the step tolerances (dflash_cupy/tolerances.py):
the tight "step_kv16" bound against the f16-K/V oracle must fail for the bugs
it exists to catch — K/V stored as bf16, one RoPE position off by one, one
mask slot off by one — while the real cache passes it (and the plain "step"
bound against the rebased exact-K/V oracle)."""
import numpy as np
import pytest

from dflash_cupy import reference
from dflash_cupy.config import DraftConfig
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.tolerances import within
from dflash_cupy.weights import DraftWeights


@pytest.mark.parametrize("wdtype,head_dim,layers", [("f32", 32, 2), ("bf16", 64, 2), ("f16", 128, 1)])
def test_tight_tolerance_catches_what_the_loose_one_misses(emu, wdtype, head_dim, layers):
    cfg = DraftConfig(n_layer=layers, hidden_size=64, n_head=4, n_head_kv=2, head_dim=head_dim,
                      intermediate_size=96, block_size=4, target_layer_ids=(0, 1),
                      layer_sliding=(True,) + (False,) * (layers - 1), sliding_window=10,
                      rms_norm_eps=1e-6, rope_theta=10000.0)
    w = DraftWeights.random(cfg, seed=5, dtype=wdtype)
    F = np.random.default_rng(6).standard_normal((2100, cfg.fc_in)).astype(np.float32)
    ring = FeatureRing(64, cfg.n_captured, cfg.hidden_size, backend=emu)
    cap, B = 24, cfg.q_len
    with DraftKvCache(w, cap, backend=emu) as kv:
        for c in (2000, 2003, 2007):
            lo = c - cap
            ring.write(lo, F[lo:c])
            noise = np.random.default_rng(c).standard_normal((B, cfg.hidden_size)).astype(np.float32)
            h = emu.to_numpy(kv.step(ring, c, noise))
    X = F[lo:c]
    C = X.shape[0]
    pos_ctx, pos_noise = lo + np.arange(C), lo + C + np.arange(B)
    tight = reference.draft_forward(w, X, noise, pos_offset=lo, kv_round="f16")
    plain = reference.draft_forward(w, X, noise)
    assert within(h, tight, "step_kv16")[0] and within(h, plain, "step")[0]   # the real cache passes

    as_bf16 = reference.draft_forward(w, X, noise, pos_offset=lo, kv_round="bf16")
    ok, err = within(as_bf16, tight, "step_kv16")
    assert not ok and err > 2 * within(h, tight, "step_kv16")[1]  # bf16 K/V storage: caught, with margin

    shifted = pos_ctx.copy()
    shifted[-1] += 1                                       # the newest context row (visible in every layer)
    rope_bug = reference.draft_forward_positions(w, X, noise, shifted, pos_noise, kv_round="f16")
    assert not within(rope_bug, tight, "step_kv16")[0]

    vis = [reference.layer_visibility(C, B, cfg.layer_sliding[l], cfg.mask_rule) for l in range(layers)]
    for v in vis:
        v[:, np.flatnonzero(v[0, :C])[0]] = False          # the oldest visible slot hidden
    mask_bug = reference.draft_forward_positions(w, X, noise, pos_ctx, pos_noise, visible=vis, kv_round="f16")
    assert not within(mask_bug, tight, "step_kv16")[0]
