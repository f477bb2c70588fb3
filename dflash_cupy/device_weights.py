"""The drafter's weights on a backend, in the layout the step's GEMMs read.

Large matrices keep their checkpoint dtype (bf16 as uint16 bit patterns, since
CuPy has no bfloat16); the projections that read the same input are fused
into one matrix so one weight-streaming GEMM serves them: ``[q; k; v]``
(noise rows), whose ``[k; v]`` rows double as the append stage's matrix, and
``[gate; up]`` for the SiLU·up epilogue. One GEMM, compiled for one weight
dtype, serves a role in every layer, so a role whose tensors differ in dtype
(between layers or inside a fused group) is widened to f32 rather than
rounded. Norm scales are f32 (tiny).

DFlash 2 (SPEC §6): each layer's two ``kernel_projection`` matrices (role ``conv``, one
GEMM for both), their rows permuted to ``ops.conv``'s ``layout="group"`` (coefficients
``[group][half][tap]``: a GEMM column block holds whole groups, so the GEMM runs the prepare
convolution itself; host weights and the oracle keep the published order), and its
``base_kernel`` tensors (f32 ``[2, taps, H]``, tiny); the candidate selector's
``hidden_projection`` and codebooks in their checkpoint dtype.
"""
from __future__ import annotations

import numpy as np

from . import dtypes
from .ops.conv import group_major_rows


def device_dtype(dt) -> np.dtype:
    """The device dtype of a stored weight dtype (bf16 -> uint16 bits)."""
    return dtypes.DEVICE[dtypes.kind_of(dt, "weight dtype")]


def to_device_matrix(backend, a: np.ndarray):
    return backend.asarray(dtypes.device_bits(a))


# The matrices each step GEMM reads, by role; one Gemm (compiled for one
# weight dtype) serves a role in every layer.
ROLES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
         "down": ("mlp.down_proj",), "attn_gate": ("self_attn.gate_proj",),
         "conv": ("attention_conv.kernel_projection", "mlp_conv.kernel_projection")}


def role_dtypes(w) -> dict:
    """The stored dtype of each role, f32 where layers (or a fused group) disagree."""
    c = w.config
    out = {}
    for role, names in ROLES.items():
        if (role == "attn_gate" and c.attn_gate == "none") or (role == "conv" and c.dflash2 is None):
            continue
        dts = {w.layer(i, n).dtype for i in range(c.n_layer) for n in names}
        out[role] = dts.pop() if len(dts) == 1 else np.dtype(np.float32)
    return out


class LayerWeights:
    def __init__(self, backend, w, i: int, dtypes: dict | None = None):
        c = w.config
        dtypes = role_dtypes(w) if dtypes is None else dtypes
        f32 = lambda name: backend.asarray(np.asarray(w.layer(i, name), dtype=np.float32))  # noqa: E731
        mat = lambda role: to_device_matrix(backend, np.concatenate(  # noqa: E731
            [w.layer(i, n).astype(dtypes[role], copy=False) for n in ROLES[role]], axis=0))
        self.input_layernorm = f32("input_layernorm")
        self.post_attention_layernorm = f32("post_attention_layernorm")
        self.q_norm = f32("self_attn.q_norm")
        self.k_norm = f32("self_attn.k_norm")
        self.w_qkv = mat("qkv")
        self.w_kv = self.w_qkv[c.q_dim:]            # [k; v]: the append stage's matrix
        self.w_o = mat("o")
        self.w_gate_up = mat("gate_up")
        self.w_down = mat("down")
        self.w_attn_gate = mat("attn_gate") if c.attn_gate != "none" else None
        self.sliding = c.is_sliding(i)
        # DFlash 2: [kernel_projection; base_kernel] per convolution (attention, mlp)
        self.conv_a_kp = self.conv_a_base = self.conv_m_kp = self.conv_m_base = None
        if c.dflash2 is not None:
            d2 = c.dflash2
            perm = group_major_rows(d2.conv_kernel_size, c.hidden_size // d2.conv_group_size)
            one = lambda n: to_device_matrix(backend, w.layer(i, n).astype(dtypes["conv"], copy=False)[perm])  # noqa: E731
            base = lambda n: backend.asarray(np.asarray(w[f"layers.{i}.{n}.base_kernel"], np.float32))  # noqa: E731
            self.conv_a_kp, self.conv_m_kp = one("attention_conv.kernel_projection"), one("mlp_conv.kernel_projection")
            self.conv_a_base, self.conv_m_base = base("attention_conv"), base("mlp_conv")


class DeviceWeights:
    """``DeviceWeights(weights, backend)`` from host ``DraftWeights`` (which
    calls it from ``DraftWeights.device``): see the module docstring."""

    def __init__(self, weights, backend):
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
        dtypes = role_dtypes(weights)
        self.layers = [LayerWeights(backend, weights, i, dtypes) for i in range(c.n_layer)]
        self.selector_hp = self.selector_pred = self.selector_succ = None
        if c.dflash2 is not None:
            sel = lambda n: to_device_matrix(backend, weights[f"candidate_selector.{n}"])  # noqa: E731
            self.selector_hp = sel("hidden_projection.weight")
            self.selector_pred, self.selector_succ = sel("predecessor_codebook"), sel("successor_codebook")
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
            if L.conv_a_kp is not None:
                yield from (L.conv_a_kp, L.conv_a_base, L.conv_m_kp, L.conv_m_base)
        if self.selector_hp is not None:
            yield from (self.selector_hp, self.selector_pred, self.selector_succ)
