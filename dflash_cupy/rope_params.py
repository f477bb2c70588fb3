"""RoPE frequency tables and attention scaling from a drafter config (plain,
HF ``linear`` and ``yarn``): the one definition both the kernels' host side
(``kv_cache``) and the float64 oracle (``reference``) use.
"""
from __future__ import annotations

import math

import numpy as np

from .config import DraftConfig


def rope_parameters(config: DraftConfig) -> tuple[np.ndarray, float]:
    """``(inv_freq [head_dim/2], attention_scaling)`` as Hugging Face computes them.

    Plain RoPE: ``inv_freq[i] = theta ** (-2i/d)``, scaling 1.
    ``linear``: ``inv_freq / factor``, scaling 1.
    ``yarn`` (HF ``_compute_yarn_parameters``): per-frequency blend of the
    interpolated (``/ factor``) and extrapolated (plain) frequencies with a
    linear ramp between the correction dims of ``beta_fast`` (default 32) and
    ``beta_slow`` (default 1) over ``original_max_position_embeddings``, and
    ``attention_scaling = attention_factor`` if given, else
    ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`` when both
    are set, else ``0.1 * ln(factor) + 1`` (1 for factor <= 1). HF multiplies
    cos and sin by it, i.e. both q and k.
    ``factor`` defaults to ``max_position_embeddings / original_max_position_embeddings``
    and ``original_max_position_embeddings`` to ``max_position_embeddings``
    (transformers v5 reading). HF computes these in float32; here they are
    float64, which changes nothing that matters (a rotation by ``p * f`` for any
    fixed ``f`` still makes scores depend on position differences only).
    """
    d = config.head_dim
    base = config.rope_theta
    exponents = np.arange(0, d, 2, dtype=np.float64) / d      # 2i/d
    pos_freqs = base ** exponents
    inv_freq = 1.0 / pos_freqs
    rs = config.rope_scaling
    if rs is None:
        return inv_freq, 1.0
    if rs["rope_type"] == "linear":
        return inv_freq / float(rs["factor"]), 1.0
    assert rs["rope_type"] == "yarn", rs
    return _yarn(rs, d, base, pos_freqs, config.max_position_embeddings)


def _yarn(rs: dict, d: int, base: float, pos_freqs: np.ndarray, max_pos):
    orig = rs.get("original_max_position_embeddings") or max_pos
    factor = rs.get("factor")
    if factor is None:
        factor = max_pos / orig
    factor = float(factor)

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(num_rotations):
        # the dimension index whose wavelength makes num_rotations turns over `orig` tokens
        return (d * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (inv_freq_interpolation * (1.0 - extrapolation_weight)
                + inv_freq_extrapolation * extrapolation_weight)
    return inv_freq, float(attention_factor)
