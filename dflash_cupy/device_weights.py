"""The drafter's weights on a backend, in the layout the step's GEMMs read.

Large matrices keep their checkpoint dtype (bf16 as uint16 bit patterns, since
CuPy has no bfloat16); the projections that read the same input are fused
into one matrix so one weight-streaming GEMM serves them: ``[q; k; v]``
(noise rows), whose ``[k; v]`` rows double as the append stage's matrix, and
``[gate; up]`` for the SiLU·up epilogue. Norm scales are f32 (tiny).
"""
from __future__ import annotations

import numpy as np

from .weights import BF16, DraftWeights


def device_dtype(dt) -> np.dtype:
    dt = np.dtype(dt)
    if dt == BF16:
        return np.dtype(np.uint16)
    if dt in (np.float32, np.float16):
        return dt
    raise TypeError(f"unsupported weight dtype {dt}")


def to_device_matrix(backend, a: np.ndarray):
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        a = a.view(np.uint16)
    return backend.asarray(a)


def _fuse(parts: list[np.ndarray]) -> np.ndarray:
    dts = {p.dtype for p in parts}
    # Mixed dtypes inside one fused group: widen to f32 rather than round anything.
    dt = dts.pop() if len(dts) == 1 else np.dtype(np.float32)
    return np.concatenate([p.astype(dt, copy=False) for p in parts], axis=0)


class LayerWeights:
    def __init__(self, backend, w: DraftWeights, i: int):
        c = w.config
        f32 = lambda name: backend.asarray(np.asarray(w.layer(i, name), dtype=np.float32))  # noqa: E731
        self.input_layernorm = f32("input_layernorm")
        self.post_attention_layernorm = f32("post_attention_layernorm")
        self.q_norm = f32("self_attn.q_norm")
        self.k_norm = f32("self_attn.k_norm")
        qkv = _fuse([w.layer(i, "self_attn.q_proj"), w.layer(i, "self_attn.k_proj"),
                     w.layer(i, "self_attn.v_proj")])
        self.w_qkv = to_device_matrix(backend, qkv)
        self.w_kv = self.w_qkv[c.q_dim:]            # [k; v]: the append stage's matrix
        self.w_o = to_device_matrix(backend, w.layer(i, "self_attn.o_proj"))
        self.w_gate_up = to_device_matrix(backend, _fuse([w.layer(i, "mlp.gate_proj"),
                                                          w.layer(i, "mlp.up_proj")]))
        self.w_down = to_device_matrix(backend, w.layer(i, "mlp.down_proj"))
        self.w_attn_gate = (to_device_matrix(backend, w.layer(i, "self_attn.gate_proj"))
                            if c.attn_gate != "none" else None)
        self.sliding = c.is_sliding(i)


class DeviceWeights:
    """``DeviceWeights(weights, backend)``: see the module docstring."""

    def __init__(self, weights: DraftWeights, backend):
        c = weights.config
        self.config = c
        self.backend = backend
        self.fc = to_device_matrix(backend, weights["fc.weight"])
        self.hidden_norm = backend.asarray(np.asarray(weights["hidden_norm.weight"], np.float32))
        self.norm = backend.asarray(np.asarray(weights["norm.weight"], np.float32))
        self.aux_norms = None
        if c.aux_hidden_norms:
            self.aux_norms = backend.asarray(np.stack(
                [np.asarray(weights[f"aux_hidden_norms.{j}.weight"], np.float32)
                 for j in range(c.n_captured)]))
        self.layers = [LayerWeights(backend, weights, i) for i in range(c.n_layer)]
        self.nbytes = sum(int(a.nbytes) for a in self._arrays())

    def _arrays(self):
        yield from (self.fc, self.hidden_norm, self.norm)
        if self.aux_norms is not None:
            yield self.aux_norms
        for L in self.layers:
            yield from (L.input_layernorm, L.post_attention_layernorm, L.q_norm, L.k_norm, L.w_qkv,
                        L.w_o, L.w_gate_up, L.w_down)
            if L.w_attn_gate is not None:
                yield L.w_attn_gate
