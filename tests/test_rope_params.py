"""RoPE parameters (dflash_cupy.rope_params), the table the kernels' host side
and the oracle share: plain, linear and YaRN against hand derivations."""
import math

import numpy as np
import pytest

from dflash_cupy.config import DraftConfig
from dflash_cupy.rope_params import rope_parameters


def cfg(**kw):
    base = dict(n_layer=2, hidden_size=32, n_head=4, n_head_kv=2, head_dim=8,
                intermediate_size=48, block_size=5, target_layer_ids=(1, 4, 7),
                rope_theta=10000.0)
    base.update(kw)
    return DraftConfig(**base)


def test_rope_plain_and_linear_frequencies():
    c = cfg(head_dim=8, rope_theta=10000.0)
    inv, scale = rope_parameters(c)
    assert scale == 1.0
    np.testing.assert_allclose(inv, [1.0, 0.1, 0.01, 0.001], rtol=1e-15)
    inv2, scale2 = rope_parameters(c.replace(rope_scaling={"rope_type": "linear", "factor": 4}))
    np.testing.assert_allclose(inv2, inv / 4, rtol=1e-15)
    assert scale2 == 1.0


def test_rope_yarn_matches_hand_derivation():
    # d=128, theta=1e6, original context 32768, factor 4: the correction dims are
    # 128*ln(32768/(32*2pi))/(2 ln 1e6) = 23.60 -> floor 23 and
    # 128*ln(32768/(1*2pi))/(2 ln 1e6) = 39.65 -> ceil 40.
    c = cfg(hidden_size=128, n_head=1, n_head_kv=1, head_dim=128, rope_theta=1_000_000,
            rope_scaling={"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 32768},
            max_position_embeddings=131072)
    inv, scale = rope_parameters(c)
    plain = 1e6 ** (-np.arange(64) * 2 / 128)
    np.testing.assert_allclose(inv[:24], plain[:24], rtol=1e-14)       # extrapolated as is
    np.testing.assert_allclose(inv[40:], plain[40:] / 4, rtol=1e-14)   # fully interpolated
    for i in (24, 31, 39):
        t = (i - 23) / 17
        np.testing.assert_allclose(inv[i], plain[i] * (1 - t) + plain[i] / 4 * t, rtol=1e-14)
    assert scale == pytest.approx(0.1 * math.log(4) + 1.0, rel=1e-15)
    # explicit attention_factor, and the mscale / mscale_all_dim ratio
    rs = dict(c.rope_scaling, attention_factor=0.7)
    assert rope_parameters(c.replace(rope_scaling=rs))[1] == 0.7
    rs = dict(c.rope_scaling, mscale=1.0, mscale_all_dim=0.5)
    want = (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1)
    assert rope_parameters(c.replace(rope_scaling=rs))[1] == pytest.approx(want, rel=1e-15)
    # beta overrides move the ramp: beta_fast=64 lowers the first blended dim
    rs = dict(c.rope_scaling, beta_fast=64)
    inv_b = rope_parameters(c.replace(rope_scaling=rs))[0]
    assert inv_b[22] != plain[22] and inv[22] == pytest.approx(plain[22], rel=1e-14)


def test_rope_yarn_factor_from_max_positions():
    c = cfg(hidden_size=128, n_head=1, n_head_kv=1, head_dim=128,
            rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 4096},
            max_position_embeddings=4096 * 8)
    assert rope_parameters(c)[1] == pytest.approx(0.1 * math.log(8) + 1.0)
