"""With ``x_split=False`` the caches store the attention output (read only by the o
projection) and the silu * up activations (read only by the down projection) in the weight
type: the attention rounds its output (``RingAttention(out_kind=...)``), the gate_up GEMM
writes rounded values (``y16``) and o / down read them with ``x16``. Those GEMMs round
their f32 inputs to the same type anyway, so the drafts must not change by a bit: each
cache (and each lane of a batch) is compared with one built with f32 activations
(``StepRecipe.attn16`` / ``act16`` forced off) over the same schedule, hidden states, logits and draft
tokens bit for bit; both are also checked against the oracle by the drivers. x_split=True
keeps f32 activations."""
import dataclasses

import numpy as np
import pytest

from dflash_cupy import backends
from dflash_cupy.ops.attention import RingAttention, ring_attention_reference
from dflash_cupy.step_recipe import StepRecipe
from tests.support.drafters import Driver
from tests.support.lanes import IDLE, make, play

KIND16 = {"b": np.uint16, "c": np.float16}   # bf16 / f16 weights


def _f32_activations(monkeypatch):
    derive = StepRecipe.derive
    monkeypatch.setattr(StepRecipe, "derive", classmethod(
        lambda cls, *a, **k: dataclasses.replace(derive(*a, **k), attn16=None, act16=None)))


@pytest.mark.parametrize("name", ["b", "c"])
def test_cache_bit_identical_to_f32_activations(name, monkeypatch):
    be = backends.get("emulated")
    d16 = Driver(be, name, seed=11, x_split=False)
    with monkeypatch.context() as mp:
        _f32_activations(mp)
        d32 = Driver(be, name, seed=11, x_split=False)
    try:
        assert d16.kv.attn.dtype == d16.kv.act.dtype == KIND16[name]
        assert d16.kv.g_o.x16 and d16.kv.g_down.x16 and d16.kv.g_gate_up.y16
        assert d32.kv.attn.dtype == d32.kv.act.dtype == np.float32 and not d32.kv.g_o.x16
        for c in (3, 4, 9, 10, 17, 6, 12):        # growth, a jump, a rewind
            if c < d16.valid_hi:
                d16.forget_from(c)
                d32.forget_from(c)
            d16.step(c)
            d32.step(c)
            for attr in ("hidden_states", "logits", "draft_tokens"):
                a, b = getattr(d16.kv, attr), getattr(d32.kv, attr)
                if a is not None:
                    np.testing.assert_array_equal(be.to_numpy(a), be.to_numpy(b), err_msg=f"{attr} c={c}")
    finally:
        d16.close()
        d32.close()


def test_x_split_keeps_f32_activations():
    be = backends.get("emulated")
    d = Driver(be, "b", seed=1)
    try:
        assert d.kv.attn.dtype == d.kv.act.dtype == np.float32
        assert not (d.kv.g_o.x16 or d.kv.g_down.x16 or d.kv.g_gate_up.y16)
        assert d.kv.attention.out_kind is None
    finally:
        d.close()


def test_batch_lanes_bit_identical_to_f32_activations(monkeypatch):
    """A 3-lane batch with 16-bit activations: every active lane equals its single-cache twin
    (also 16-bit) and the same batch built with f32 activations, bit for bit."""
    be, batch, twins = make("b", 3, x_split=False)
    with monkeypatch.context() as mp:
        _f32_activations(mp)
        _, ref, ref_twins = make("b", 3, be=be, x_split=False)
    assert batch.attn.dtype == batch.act.dtype == np.uint16 and ref.act.dtype == np.float32
    schedule = [[5, IDLE, 30], [9, 3, 31], [IDLE, 6, 33], [12, ("rewind", 4), 20]]
    for ops in schedule:
        play(be, batch, twins, ops)
        play(be, ref, ref_twins, ops)
        for attr in ("hidden_states", "draft_tokens"):
            a, b = getattr(batch, attr), getattr(ref, attr)
            if a is not None:
                for i, op in enumerate(ops):
                    if op is not IDLE:
                        np.testing.assert_array_equal(be.to_numpy(a)[i], be.to_numpy(b)[i], err_msg=f"{attr} {ops}")


@pytest.mark.parametrize("path,splits,merge", [("mma", 1, None), ("mma", 3, "fold"), ("mma", 3, "launch"),
                                               ("fma", 1, None), ("fma", 3, "fold"), ("fma", 3, "launch")])
@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_attention_out16_is_the_f32_output_rounded(rng, path, splits, merge, kind):
    """out_kind: the f32 output rounded to nearest even, every kernel and merge; a wrong out
    dtype is refused naming ``out``."""
    import ml_dtypes
    be = backends.get("emulated")
    D, NH, NKV, B, KV = 32, 4, 2, 3, 100   # test_attention's LANE_CASES single-lane shape: f32 variants shared
    q = be.asarray(rng.standard_normal((B, NH * D)).astype(np.float32))
    k = be.asarray(rng.standard_normal((KV, NKV * D)).astype(np.float16))
    v = be.asarray(rng.standard_normal((KV, NKV * D)).astype(np.float16))
    mask = np.zeros((B, KV), np.float16)
    mask[:, 90:] = -np.inf
    mask = be.asarray(mask)
    outs = {}
    for ok in (None, kind):
        att = RingAttention(be, D, NH, NKV, B, KV, n_splits=splits, merge=merge, path=path, out_kind=ok)
        out = be.zeros((B, NH * D), att.out_dtype)
        att(q, k, v, mask, out)
        outs[ok] = be.to_numpy(out)
        if ok is not None:
            with pytest.raises(TypeError, match=r"^out must have dtype"):
                att(q, k, v, mask, be.zeros((B, NH * D), np.float32))
    dt = ml_dtypes.bfloat16 if kind == "bf16" else np.float16
    want = outs[None].astype(dt)
    np.testing.assert_array_equal(outs[kind], want.view(np.uint16) if kind == "bf16" else want)
    ref = ring_attention_reference(be.to_numpy(q), be.to_numpy(k), be.to_numpy(v), be.to_numpy(mask), n_head_kv=NKV)
    assert np.abs(outs[None] - ref).max() < 1e-3
    with pytest.raises(ValueError, match="out_kind"):
        RingAttention(be, D, NH, NKV, B, KV, out_kind="f32")
