"""Compulsory bytes of one drafter step, by category, from the cache's own ops.

Each kernel is charged what it must read and write once (the GEMMs' and the
attention's ``bytes_moved``; the small kernels counted here). Categories:

* ``weights``: every GEMM's weight matrix, once per call (a step reads ``fc``
  and each layer's ``qkv`` (for the appended and the noise rows together),
  ``o``, ``gate_up``, ``down``; a bulk append chunk ``fc`` and each layer's
  ``[k; v]`` rows);
* ``lm_head``: the LM head's weight matrix, if the cache has one;
* ``kv_cache_read``: the attention's K and V reads, all ``kv_total`` rows of
  every layer (masked rows are read too: the kernel streams the whole ring);
* ``kv_cache_write``: the K/V rows the RoPE launch scatters per layer
  (``a_step`` append rows, trash padding included, plus ``q_len`` noise rows);
* ``masks``: the mask builder's ``slot_pos`` read and mask writes, plus each
  layer's attention reading its mask;
* ``features``: feature rows gathered from the ring (ring dtype) and written
  as f32 for the ``fc`` GEMM;
* ``activations``: everything else (GEMM inputs/outputs/residuals, norms,
  q/k/v staging, attention q/out/partials, descriptors, planning arrays).

``Gemm.bytes_moved(0)`` is a GEMM's weight bytes alone (its other terms scale
with ``m``); for ``m > max_m`` the extra M tiles' weight re-reads (mostly L2)
are not counted, as in ``Gemm.bytes_moved``.
"""
from __future__ import annotations

from collections import Counter

from dflash_cupy.ops.step_descriptor import DESC_LEN, bulk_chunks

CATEGORIES = ("weights", "lm_head", "kv_cache_read", "kv_cache_write", "masks", "features",
              "activations")
DESC_BYTES = DESC_LEN * 4


def _gemm(b: Counter, g, m: int, weight_key: str = "weights") -> None:
    w = g.bytes_moved(0) - (g.K * 4 if getattr(g, "norm_eps", None) is not None else 0)  # the norm scale: activations
    b[weight_key] += w
    b["activations"] += g.bytes_moved(m) - w


def _rope(b: Counter, rope, m: int) -> None:
    """``QkvNormRope`` over ``m`` rows: reads the qkv rows, pos, rows, the norm
    scales and the inv_freq table; writes K and V f16 rows (and q f32)."""
    D = rope.D
    b["activations"] += m * rope.qkv_width * 4 + 2 * m * 4 + D * 4 * (2 if rope.has_q else 1) \
        + (D // 2) * 8 + m * rope.q_width * 4
    b["kv_cache_write"] += 2 * m * rope.kv_width * 2


def _qkv_folded(b: Counter, g, rope, m: int) -> None:
    """The qkv GEMM with ``QkvNormRope`` in its epilogue over ``m`` rows: the GEMM's reads,
    then what the rope writes (q f32, K and V f16 rows) and its small reads; the ``[m, N]``
    qkv matrix is neither written nor read back."""
    _gemm(b, g, m)
    b["activations"] -= m * g.N * 4
    _rope(b, rope, m)
    b["activations"] -= m * rope.qkv_width * 4


def append_bytes(cache, m: int, n_new: int, ring_itemsize: int, *, noise_positions: bool,
                 layers: bool = True) -> Counter:
    """``plan_append`` + feature gather + feature fusion over ``m`` rows of which
    ``n_new`` are real (the rest go to the trash slot), and with ``layers`` the
    bulk append's per-layer ``[k; v]`` GEMM and RoPE (a step does those inside
    its layers, together with the noise rows)."""
    c, b = cache.config, Counter()
    b["activations"] += DESC_BYTES + 2 * m * 4 + n_new * 4
    if noise_positions:
        b["activations"] += cache.q_len * 4
    b["features"] += n_new * c.fc_in * ring_itemsize + m * c.fc_in * 4
    if cache.dw.aux_norms is not None:
        b["activations"] += cache.rms.bytes_moved(m * c.n_captured, c.n_captured)
    _gemm(b, cache.g_fc, m)
    b["activations"] += cache.rms.bytes_moved(m)
    for _ in range(c.n_layer if layers else 0):
        if cache.ctx_kv_in is not None:
            b["activations"] += cache.rms.bytes_moved(m)
        _gemm(b, cache.g_kv, m)
        _rope(b, cache.rope_ctx, m)
    return b


def _finish(b: Counter) -> dict:
    out = {k: int(b.get(k, 0)) for k in CATEGORIES}
    out["total"] = sum(out.values())
    return out


def step_bytes(cache, n_new: int, ring_itemsize: int) -> dict:
    """One in-graph step appending ``n_new`` rows (``0 <= n_new <= a_step``)."""
    c, B, A = cache.config, cache.q_len, cache.a_step
    b = Counter()
    b["activations"] += 2 * DESC_BYTES  # descriptor copy; reset_slots_if reads it
    b.update(append_bytes(cache, A, n_new, ring_itemsize, noise_positions=True, layers=False))
    n_masks = (cache.mask_full is not None) + (cache.mask_swa is not None)
    b["masks"] += DESC_BYTES + cache.capacity * 4 + n_masks * B * cache.kv_total * 2
    H = c.hidden_size
    b["activations"] += 2 * B * H * 4  # h <- noise_embed
    att = cache.attention
    kv_read = 2 * att.kv_total * att.NKV * att.D * 2
    mask_read = att.B * att.kv_total * 2
    fold = getattr(getattr(cache, "recipe", None), "fold_norms", False)   # norms inside the qkv / gate_up GEMMs
    for _ in range(c.n_layer):
        if not fold:
            b["activations"] += cache.rms.bytes_moved(A + B if c.context_kv_layer_norm else B)
        elif cache.g_attn_gate is not None:   # the gate GEMM's input
            b["activations"] += cache.rms.bytes_moved(B)
        if cache.g_qkv.fuses_rope(A + B):
            _qkv_folded(b, cache.g_qkv, cache.rope_step, A + B)
        else:
            _gemm(b, cache.g_qkv, A + B)
            _rope(b, cache.rope_step, A + B)
        if cache.g_attn_gate is not None:
            _gemm(b, cache.g_attn_gate, B)
        total = att.bytes_moved()
        b["kv_cache_read"] += kv_read
        b["masks"] += mask_read
        b["activations"] += total - kv_read - mask_read
        _gemm(b, cache.g_o, B)
        if not fold:
            b["activations"] += cache.rms.bytes_moved(B)
        _gemm(b, cache.g_gate_up, B)
        _gemm(b, cache.g_down, B)
    b["activations"] += cache.rms.bytes_moved(B)
    if cache.g_lm is not None:
        _gemm(b, cache.g_lm, B, "lm_head")
    return _finish(b)


def legacy_bytes(cache, window: int, ring_itemsize: int) -> dict:
    """``reset()`` + a bulk append of the whole window (chunks of
    ``cache.bulk_chunk``) + the step (which then appends nothing)."""
    b = Counter()
    b["activations"] += cache.capacity * 4  # reset_slots
    for _, count in bulk_chunks(0, window, cache.bulk_chunk):
        b.update(append_bytes(cache, count, count, ring_itemsize, noise_positions=False))
    step = step_bytes(cache, 0, ring_itemsize)
    for k in CATEGORIES:
        b[k] += step[k]
    return _finish(b)
