"""The float64 NumPy oracle of the drafter step (SPEC §2) and its ring masks (SPEC §3).

This file is the living definition of what the kernels compute. It is
written to be read, not to be fast: every step of SPEC §2 is one small
function, all arithmetic is float64, and weights of any stored dtype (f32,
f16, bf16 via ml_dtypes) are widened to float64 first.

Entry points:

* ``draft_forward(weights, feat_rows, noise_embed, *, lm_head=None, pos_offset=0)``:
  the legacy one-shot forward over a rebased window (context rows at
  positions ``pos_offset + 0..C-1``, noise rows at ``pos_offset + C..C+B-1``).
  Returns ``hidden [B, H]`` float64, or ``(hidden, logits)`` when ``lm_head``
  is given (``logits = hidden @ lm_head.T``, ``[B, V]``).
* ``draft_forward_positions(...)``: the same with explicit absolute positions
  and, optionally, explicit per-layer visibility masks.
* ``ring_masks(slot_pos, committed, geom, rule)``: the f16 ``0 / -inf``
  masks of SPEC §3 step 5 / §6 over the ``kv_total`` cache rows; ``block_visibility``
  is the mask rule itself (``mask_rule.py``), shared with ``layer_visibility``.

DFlash 2 (SPEC §6, ``config.dflash2``): the same forward, with ``decoder_layer``
wrapping each sublayer in its grouped dynamic convolution (``conv_prepare``);
``noise_embedding`` forms the noise rows; ``select_draft(weights, hidden, lm_head,
anchor, temperature=, uniforms=)`` runs the candidate selector on the block's
``hidden`` and returns a ``SelectorResult``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .config import DraftConfig
from .geometry import RingGeometry
from .mask_rule import MaskRule
from .rope_params import rope_parameters

__all__ = [
    "rmsnorm", "silu", "softplus", "rope_parameters", "rope_cos_sin", "apply_rope",
    "fuse_features", "layer_visibility", "attention", "decoder_layer",
    "draft_forward", "draft_forward_positions",
    "ring_masks", "contiguous_slot_pos", "block_visibility",
    "grouped_conv", "conv_prepare", "noise_embedding", "softcap", "top_candidates",
    "selector_scores", "selector_walk", "select_draft", "SelectorResult",
]


# --------------------------------------------------------------------------- basics
def f64(a) -> np.ndarray:
    """Any float array (f32, f16, ml_dtypes.bfloat16, ...) as float64."""
    return np.asarray(a).astype(np.float64)


def rmsnorm(x, weight=None, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(mean(x**2) + eps)`` over the last axis, times ``weight`` if given."""
    x = f64(x)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * f64(weight)


def silu(x) -> np.ndarray:
    """``x * sigmoid(x)``."""
    with np.errstate(over="ignore"):  # exp(-x) -> inf for x << 0 gives the right limit, -0
        return x / (1.0 + np.exp(-x))


def softplus(x) -> np.ndarray:
    """``log(1 + exp(x))``, without overflow."""
    return np.logaddexp(0.0, x)


# --------------------------------------------------------------------------- RoPE
def rope_cos_sin(positions, config: DraftConfig) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin`` of ``p * inv_freq``, ``[n, head_dim/2]``, already multiplied by
    the attention scaling. Angles are formed in float64 from integer positions,
    so positions up to 2^20 and beyond keep ~1e-10 absolute accuracy."""
    inv_freq, scaling = rope_parameters(config)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles) * scaling, np.sin(angles) * scaling


def apply_rope(x, positions, config: DraftConfig) -> np.ndarray:
    """NEOX / rotate_half RoPE on ``x [n, heads, d]`` at ``positions [n]``:
    ``(x_i, x_{i+d/2}) -> (x_i cos - x_{i+d/2} sin, x_{i+d/2} cos + x_i sin)``."""
    x = f64(x)
    half = x.shape[-1] // 2
    cos, sin = rope_cos_sin(positions, config)
    cos, sin = cos[:, None, :], sin[:, None, :]          # broadcast over heads
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# --------------------------------------------------------------------------- blocks
def fuse_features(weights, feat_rows) -> np.ndarray:
    """SPEC §2.1: feature rows ``[C, fc_in]`` -> fused context rows ``T [C, H]``.
    With ``aux_hidden_norms`` each captured layer's slice is rms-normalised
    with its own weight first."""
    c = weights.config
    X = f64(feat_rows)
    if c.aux_hidden_norms:
        H = c.hidden_size
        X = np.concatenate(
            [rmsnorm(X[:, j * H:(j + 1) * H], weights[f"aux_hidden_norms.{j}.weight"],
                     c.rms_norm_eps) for j in range(c.n_captured)], axis=1)
    return rmsnorm(X @ f64(weights["fc.weight"]).T, weights["hidden_norm.weight"], c.rms_norm_eps)


def block_visibility(rule, sliding: bool, n_rows: int, key_pos, key_ok, key_ctx,
                     committed: int, win: int) -> np.ndarray:
    """The mask rule (``mask_rule.py``; a ``MaskRule`` or a bare sliding window) as bool
    ``[n_rows, S]``: block row ``i`` sits at position ``committed + i``; key ``s``, at
    absolute position ``key_pos[s]``, is visible when ``key_ok[s]`` (a key of the window or
    of the block) and the rule allows it. ``key_ctx[s]`` marks context keys; ``win`` is the
    window's length (the anchored rule's bound)."""
    rule = MaskRule.of(rule)
    qp = committed + np.arange(n_rows, dtype=np.int64)[:, None]
    k = np.asarray(key_pos, dtype=np.int64)[None, :]
    ctx = np.asarray(key_ctx, dtype=bool)[None, :]
    vis = np.broadcast_to(np.asarray(key_ok, dtype=bool)[None, :], (n_rows, k.shape[1])).copy()
    if rule.causal_sliding if sliding else rule.causal_full:
        vis &= k <= qp                       # context keys (< committed) always pass
    w = rule.window
    if sliding and w:
        if rule.per_row:
            vis &= (qp - k < w) & (k - qp < w)
        elif w < win:
            vis &= ~ctx | (k >= committed - w)
    return vis


def layer_visibility(n_ctx: int, n_noise: int, sliding: bool, rule) -> np.ndarray:
    """Which keys each noise row sees in the one-shot forward: bool ``[B, C+B]``
    over keys ordered context rows ``0..C-1`` (positions ``0..C-1``, the whole window)
    then noise rows (positions ``C..C+B-1``), under ``rule`` (``block_visibility``).

    Full layers see every context row; sliding layers, per row, the keys less than
    ``W`` positions away (the per-row rule) or the last ``min(W, C)`` context rows (the
    anchored rule). Inside the block, a causal layer shows row ``j`` to row ``q`` iff
    ``j <= q``.
    """
    C, B = n_ctx, n_noise
    pos = np.arange(C + B)
    ctx = pos < C
    return block_visibility(rule, sliding, B, pos, np.ones(C + B, dtype=bool), ctx, C, C)


def attention(Q, K, V, visible) -> np.ndarray:
    """Masked softmax attention with GQA.

    ``Q [B, nh, d]``, ``K, V [S, nkv, d]``, ``visible`` bool ``[B, S]``;
    query head ``i`` reads kv head ``i // (nh/nkv)``; scale ``1/sqrt(d)``.
    Returns ``[B, nh, d]``.
    """
    B, nh, d = Q.shape
    nkv = K.shape[1]
    rep = nh // nkv
    Kh = np.repeat(K, rep, axis=1)                       # [S, nh, d]: head i <- kv head i//rep
    Vh = np.repeat(V, rep, axis=1)
    scores = np.einsum("bhd,shd->hbs", Q, Kh) / math.sqrt(d)
    scores = np.where(visible[None, :, :], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hbs,shd->bhd", p, Vh)


_KV_ROUND = {None: None, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def _round_kv(x, kv_round):
    """K/V as a cache storing them in ``kv_round`` holds them (round to nearest even)."""
    dt = _KV_ROUND[kv_round]
    return x if dt is None else x.astype(np.float32).astype(dt).astype(np.float64)


def grouped_conv(x, base, delta, group_size: int) -> np.ndarray:
    """SPEC §6's block-local grouped dynamic causal convolution over the block's rows:
    ``y[i, c] = sum_{t < taps} (base[t, c] + delta[i, t, c // group_size]) * x[i - t, c]``,
    a tap before the block's first row reading zero. ``x [B, H]``, ``base [taps, H]``,
    ``delta [B, taps, G]``."""
    x, base, delta = f64(x), f64(base), f64(delta)
    B = x.shape[0]
    coef = base[None, :, :] + np.repeat(delta, group_size, axis=2)     # [B, taps, H]
    y = np.zeros_like(x)
    for t in range(min(base.shape[0], B)):                                # taps past row 0 read zeros
        y[t:] += coef[t:, t] * x[:B - t]
    return y


def conv_prepare(weights, layer: int, conv: str, x):
    """DFlash 2's ``prepare`` for ``layers.{layer}.{conv}`` (``attention_conv`` or
    ``mlp_conv``) on the sublayer's normed input ``x [B, H]``: returns the convolved
    input and ``finish``, the function that convolves the sublayer's output. Both
    halves of ``delta = x @ kernel_projection.T``, read as ``[B, 2, taps, G]`` (half,
    tap, group: z-lab and vLLM), come from this same ``x``. A DFlash drafter
    (``dflash2`` None) gets ``x`` back and the identity."""
    d2 = weights.config.dflash2
    if d2 is None:
        return x, lambda y: y
    p = f"layers.{layer}.{conv}."
    base = f64(weights[p + "base_kernel"])                                # [2, taps, H]
    B, H = x.shape
    delta = (x @ f64(weights[p + "kernel_projection.weight"]).T).reshape(
        B, 2, d2.conv_kernel_size, d2.n_groups(H))
    gs = d2.conv_group_size
    return (grouped_conv(x, base[0], delta[:, 0], gs),
            lambda y: grouped_conv(y, base[1], delta[:, 1], gs))


def decoder_layer(weights, layer: int, h, T, pos_ctx, pos_noise, visible, kv_round=None) -> np.ndarray:
    """SPEC §2.2 for one layer: noise rows ``h [B, H]`` attend over the fused
    context ``T [C, H]`` and themselves; returns the new ``h``. ``kv_round``
    ("f16", "bf16" or None) rounds K (after norm and RoPE) and V where a cache
    stores them.

    DFlash 2 (SPEC §6): the attention sublayer's input is ``input_layernorm``'s
    output convolved (``conv_prepare``), and that convolved row is what q, k, v
    (and the attention gate, if any) of the noise rows read; ``o_proj``'s output is
    convolved before the residual add. The MLP likewise around
    ``post_attention_layernorm``'s output and ``down_proj``'s. Context rows never
    pass through a convolution."""
    c = weights.config
    eps, nh, nkv, d = c.rms_norm_eps, c.n_head, c.n_head_kv, c.head_dim
    B, C = h.shape[0], T.shape[0]

    def w(name):
        return f64(weights[f"layers.{layer}.{name}.weight"])

    hn, attn_finish = conv_prepare(weights, layer, "attention_conv",
                                   rmsnorm(h, w("input_layernorm"), eps))
    Q = (hn @ w("self_attn.q_proj").T).reshape(B, nh, d)
    Q = apply_rope(rmsnorm(Q, w("self_attn.q_norm"), eps), pos_noise, c)

    Tk = rmsnorm(T, w("input_layernorm"), eps) if c.context_kv_layer_norm else T
    src = np.concatenate([Tk, hn], axis=0)                # keys: context rows, then noise rows
    pos_kv = np.concatenate([pos_ctx, pos_noise])
    K = (src @ w("self_attn.k_proj").T).reshape(C + B, nkv, d)
    K = apply_rope(rmsnorm(K, w("self_attn.k_norm"), eps), pos_kv, c)
    V = (src @ w("self_attn.v_proj").T).reshape(C + B, nkv, d)
    K, V = _round_kv(K, kv_round), _round_kv(V, kv_round)

    attn = attention(Q, K, V, visible)                    # [B, nh, d]
    if c.attn_gate == "head":
        attn = attn * softplus(hn @ w("self_attn.gate_proj").T)[:, :, None]
    elif c.attn_gate == "element":
        attn = attn * softplus(hn @ w("self_attn.gate_proj").T).reshape(B, nh, d)
    h = h + attn_finish(attn.reshape(B, nh * d) @ w("self_attn.o_proj").T)

    hf, mlp_finish = conv_prepare(weights, layer, "mlp_conv",
                                  rmsnorm(h, w("post_attention_layernorm"), eps))
    ffn = silu(hf @ w("mlp.gate_proj").T) * (hf @ w("mlp.up_proj").T)
    return h + mlp_finish(ffn @ w("mlp.down_proj").T)


# --------------------------------------------------------------------------- forward
def _check_inputs(weights, feat_rows, noise_embed):
    c = weights.config
    X, E = np.asarray(feat_rows), np.asarray(noise_embed)
    if X.ndim != 2 or X.shape[1] != c.fc_in or X.shape[0] < 1:
        raise ValueError(f"feat_rows: shape {X.shape}, expected [C >= 1, fc_in={c.fc_in}]")
    if E.ndim != 2 or E.shape[1] != c.hidden_size or E.shape[0] < 1:
        raise ValueError(f"noise_embed: shape {E.shape}, expected [B >= 1, "
                         f"hidden_size={c.hidden_size}] (B is normally block_size={c.block_size})")
    return X, E


def _logits(weights, hidden, lm_head):
    W = np.asarray(lm_head)
    if W.ndim != 2 or W.shape[1] != weights.config.hidden_size:
        raise ValueError(f"lm_head: shape {W.shape}, expected [vocab, "
                         f"hidden_size={weights.config.hidden_size}]")
    return hidden @ f64(W).T


def draft_forward_positions(weights, feat_rows, noise_embed, pos_ctx, pos_noise, *,
                            visible=None, lm_head=None, kv_round=None):
    """The drafter forward with explicit absolute positions.

    ``pos_ctx [C]`` and ``pos_noise [B]`` are the RoPE positions of the
    context and noise rows. ``visible`` overrides the masks: one bool
    ``[B, C+B]`` array for every layer, or a list of ``n_layer`` of them;
    None uses ``layer_visibility`` per layer from the config.
    Returns ``hidden [B, H]`` float64, or ``(hidden, logits)`` with ``lm_head``.
    """
    c = weights.config
    X, E = _check_inputs(weights, feat_rows, noise_embed)
    C, B = X.shape[0], E.shape[0]
    pos_ctx = np.asarray(pos_ctx, dtype=np.int64).reshape(-1)
    pos_noise = np.asarray(pos_noise, dtype=np.int64).reshape(-1)
    if pos_ctx.shape != (C,):
        raise ValueError(f"pos_ctx: {pos_ctx.shape[0]} positions for C={C} context rows")
    if pos_noise.shape != (B,):
        raise ValueError(f"pos_noise: {pos_noise.shape[0]} positions for B={B} noise rows")
    if visible is None:
        masks = [layer_visibility(C, B, c.layer_sliding[l], c.mask_rule)
                 for l in range(c.n_layer)]
    else:
        masks = list(visible) if isinstance(visible, (list, tuple)) else [visible] * c.n_layer
        if len(masks) != c.n_layer:
            raise ValueError(f"visible: {len(masks)} masks for n_layer={c.n_layer}")
        masks = [np.asarray(m, dtype=bool) for m in masks]
        for m in masks:
            if m.shape != (B, C + B):
                raise ValueError(f"visible: mask shape {m.shape}, expected {(B, C + B)}")

    T = fuse_features(weights, X)
    h = f64(E)
    for l in range(c.n_layer):
        h = decoder_layer(weights, l, h, T, pos_ctx, pos_noise, masks[l], kv_round)
    hidden = rmsnorm(h, weights["norm.weight"], c.rms_norm_eps)
    if lm_head is None:
        return hidden
    return hidden, _logits(weights, hidden, lm_head)


def draft_forward(weights, feat_rows, noise_embed, *, lm_head=None, pos_offset: int = 0, kv_round=None):
    """The legacy one-shot forward (SPEC §2) over a rebased window.

    ``feat_rows [C, fc_in]`` (C >= 1) are the raw feature rows of the window,
    oldest first; ``noise_embed [B, H]`` the embedded noise block (B is
    normally ``block_size``). Context row ``k`` sits at position
    ``pos_offset + k``, noise row ``q`` at ``pos_offset + C + q``; the result
    does not depend on ``pos_offset`` (RoPE scores see differences only).
    Returns ``hidden [B, H]`` float64, or ``(hidden, logits [B, V])`` when
    ``lm_head [V, H]`` is given (``logits = hidden @ lm_head.T``).
    ``kv_round="f16"`` with ``pos_offset`` = the window's first absolute
    position is the ring cache's own arithmetic in float64: K rounded after
    RoPE at the positions where the cache rounds it (the tight oracle).
    """
    X, E = _check_inputs(weights, feat_rows, noise_embed)
    C, B = X.shape[0], E.shape[0]
    base = int(pos_offset)
    return draft_forward_positions(weights, X, E, base + np.arange(C), base + C + np.arange(B),
                                   lm_head=lm_head, kv_round=kv_round)


# --------------------------------------------------------------------------- DFlash 2 selector
def noise_embedding(embed_table, anchor: int, config: DraftConfig, q_len: int | None = None):
    """The noise rows ``embed([anchor, mask, ..., mask]) * input_embedding_scale``
    ``[q_len, H]`` float64 (the scale is 1 for DFlash), from the target's
    ``embed_table [vocab, H]``; ``q_len`` defaults to ``block_size``."""
    E = np.asarray(embed_table)
    B = config.q_len if q_len is None else int(q_len)
    if config.mask_token_id is None:
        raise ValueError("config.mask_token_id is None: the noise rows need a mask token")
    for name, tok in (("anchor", anchor), ("mask_token_id", config.mask_token_id)):
        if not 0 <= int(tok) < E.shape[0]:
            raise ValueError(f"{name}={tok}: outside the embedding table's {E.shape[0]} rows")
    scale = 1.0 if config.dflash2 is None else config.dflash2.input_embedding_scale
    return f64(E[[int(anchor)] + [config.mask_token_id] * (B - 1)]) * scale


def softcap(x, cap):
    """``tanh(x / cap) * cap``; ``cap`` None: ``x`` unchanged."""
    return x if cap is None else np.tanh(x / cap) * cap


def top_candidates(logits, k: int) -> np.ndarray:
    """The top-``k`` token ids of each row of ``logits [R, V]``, ``[R, k]`` int64, best
    first, ties to the lowest id. Non-finite logits are refused (no rank is defined
    for them yet)."""
    lg = f64(logits)
    bad = ~np.isfinite(lg)
    if bad.any():
        r, v = np.argwhere(bad)[0]
        raise ValueError(f"logits[{r}, {v}]={lg[r, v]}: non-finite logits have no candidate rank")
    ids = np.arange(lg.shape[1])
    return np.stack([np.lexsort((ids, -row))[:k] for row in lg]).reshape(lg.shape[0], k) \
        .astype(np.int64)


@dataclass(frozen=True)
class SelectorResult:
    """The candidate selector on a block's rows 1..q_len-1 (``R = q_len - 1`` rows,
    ``K = selector_top_k``): ``draft_tokens [R]`` int64 (the walk: the token drafted at
    block row ``r + 1``), ``choice [R]`` (its index among the row's candidates),
    ``candidate_ids [R, K]`` int64 (best raw logit first), ``candidate_values [R, K]``
    (the unary values), ``scores [R, K, K]`` (``scores[r, p, c]``: candidate ``c`` after
    the previous row's candidate ``p``; every ``p`` of row 0 is the anchor), ``q [R, K]``
    (the distribution each row was drawn from: softmax(scores / T); one-hot at T = 0)
    and ``margin [R]`` (greedy: best score minus the runner-up, inf for K = 1; sampled:
    the uniform's distance to the nearest boundary of its candidate's CDF interval,
    as a fraction of the row's mass): a kernel rounding in f32 must agree where the
    margin exceeds its rounding."""
    draft_tokens: np.ndarray
    choice: np.ndarray
    candidate_ids: np.ndarray
    candidate_values: np.ndarray
    scores: np.ndarray
    q: np.ndarray
    margin: np.ndarray


def selector_scores(weights, hidden_rows, ids, values, anchor: int) -> np.ndarray:
    """Edge scores ``[R, K, K]`` (SPEC §6): ``values[r, c] + < predecessor_codebook[pred]
    * (hidden_projection @ hidden_rows[r]), successor_codebook[ids[r, c]] >``, ``pred`` =
    ``anchor`` on row 0, else ``ids[r - 1, p]``."""
    h, ids = f64(hidden_rows), np.asarray(ids, dtype=np.int64)
    hp = h @ f64(weights["candidate_selector.hidden_projection.weight"]).T     # [R, rank]
    pred_ids = np.concatenate([np.full((1, ids.shape[1]), int(anchor)), ids[:-1]])[:len(ids)]
    P = f64(weights["candidate_selector.predecessor_codebook"])[pred_ids]      # [R, K, rank]
    S = f64(weights["candidate_selector.successor_codebook"])[ids]             # [R, K, rank]
    return f64(values)[:, None, :] + np.einsum("rpk,rk,rck->rpc", P, hp, S)


def selector_walk(scores, temperature: float = 0.0, uniforms=None):
    """The walk over ``scores [R, K, K]`` from the anchor: ``(choice [R], q [R, K],
    margin [R])`` (see ``SelectorResult``). Greedy (T = 0): the first maximum of the
    row given the previous choice. T > 0: ``q = softmax(scores / T)``, and ``uniforms
    [R]`` in [0, 1) pick by inverse CDF: the first candidate whose cumulative mass
    exceeds ``u * total`` (``ops/sample.py``'s rule, and SGLang's)."""
    sc = f64(scores)
    R, K = sc.shape[0], sc.shape[2]
    choice, q, margin = np.zeros(R, np.int64), np.zeros((R, K)), np.full(R, np.inf)
    prev = 0                                   # row 0's predecessor rows are all the anchor
    for r in range(R):
        s = sc[r, prev]
        if temperature > 0:
            z = s / temperature
            p = np.exp(z - z.max())
            cum = np.cumsum(p)
            target = float(uniforms[r]) * cum[-1]
            j = min(int(np.searchsorted(cum, target, side="right")), K - 1)
            lo = cum[j - 1] if j else 0.0
            margin[r] = min(target - lo, cum[j] - target) / cum[-1]
            q[r] = p / cum[-1]
        else:
            j = int(np.argmax(s))                          # first maximum
            if K > 1:
                margin[r] = s[j] - np.max(np.delete(s, j))
            q[r, j] = 1.0
        choice[r] = prev = j
    return choice, q, margin


def select_draft(weights, hidden, lm_head, anchor: int, *, temperature: float = 0.0,
                 uniforms=None) -> SelectorResult:
    """SPEC §6's candidate selector on the block's final hidden states ``hidden [q_len,
    H]`` (after the final norm, as ``draft_forward`` returns them), rows 1..q_len-1:
    top-K of the raw logits ``hidden @ lm_head.T`` (ties to the lowest id), unary
    values ``softcap(logit * output_multiplier)``, edge scores, and the walk from
    ``anchor`` (the block's first token). ``uniforms [q_len - 1]`` in [0, 1) are
    required when ``temperature > 0``. All in float64 (the kernels round the values
    and scores in f32)."""
    c = weights.config
    d2 = c.dflash2
    if d2 is None:
        raise ValueError(f"select_draft: {c.architecture} has no candidate selector")
    h = f64(hidden)
    if h.ndim != 2 or h.shape[1] != c.hidden_size or h.shape[0] < 1:
        raise ValueError(f"hidden: shape {h.shape}, expected [q_len >= 1, {c.hidden_size}]")
    W = np.asarray(lm_head)
    if W.shape != (d2.vocab_size, c.hidden_size):
        raise ValueError(f"lm_head: shape {W.shape}, expected [vocab_size={d2.vocab_size}, "
                         f"{c.hidden_size}]")
    if isinstance(anchor, bool) or not isinstance(anchor, (int, np.integer)) \
            or not 0 <= anchor < d2.vocab_size:
        raise ValueError(f"anchor={anchor!r}: must be a token id in [0, {d2.vocab_size})")
    if not (isinstance(temperature, (int, float, np.floating)) and math.isfinite(temperature)
            and temperature >= 0):
        raise ValueError(f"temperature={temperature!r}: must be a finite number >= 0")
    R, K = h.shape[0] - 1, d2.selector_top_k
    if temperature > 0 and R:
        u = None if uniforms is None else np.asarray(uniforms, dtype=np.float64)
        if u is None or u.shape != (R,) or not ((u >= 0) & (u < 1)).all():
            raise ValueError(f"uniforms: {R} values in [0, 1) are needed at temperature > 0, "
                             f"got {None if u is None else u.shape}")
    rows = h[1:]
    logits = rows @ f64(W).T
    ids = top_candidates(logits, K) if R else np.zeros((0, K), np.int64)
    values = softcap(np.take_along_axis(logits, ids, axis=1) * d2.output_multiplier,
                     d2.final_logit_softcapping)
    scores = selector_scores(weights, rows, ids, values, int(anchor))
    choice, q, margin = selector_walk(scores, float(temperature), uniforms)
    return SelectorResult(draft_tokens=np.take_along_axis(ids, choice[:, None], 1)[:, 0],
                          choice=choice, candidate_ids=ids, candidate_values=values,
                          scores=scores, q=q, margin=margin)


# --------------------------------------------------------------------------- ring masks
def contiguous_slot_pos(committed: int, capacity: int) -> np.ndarray:
    """``slot_pos`` of a ring that has appended positions ``0..committed-1`` in
    order: slot ``p % capacity`` holds the newest ``p`` that maps to it, -1 if none."""
    sp = np.full(capacity, -1, dtype=np.int64)
    for p in range(max(0, committed - capacity), committed):
        sp[p % capacity] = p
    return sp


def ring_masks(slot_pos, committed: int, geom: RingGeometry, rule) -> tuple[np.ndarray, np.ndarray]:
    """SPEC §3 step 5 / §6: ``(mask_full, mask_swa)``, float16 ``[q_len, kv_total]``,
    0 where visible and -inf where hidden, under ``rule`` (a ``MaskRule``, or a bare
    sliding window for the default rule: ``MaskRule.of``).

    ``slot_pos [slots]`` (``geom.slots``: the window plus the rewind slack) is the
    absolute position held by each ring slot (-1: empty; a rewind within the slack leaves
    positions >= committed there); noise slot ``slots + j`` holds position
    ``committed + j``. With ``win = min(committed, capacity)``, ``lo = committed - win``,
    ring slot ``s`` is a key of the window iff ``lo <= slot_pos[s] < committed``, every
    noise slot is a key of the block, and ``block_visibility`` decides per row; the trash
    slot and the padding rows are hidden in both.
    """
    if not isinstance(geom, RingGeometry):
        raise TypeError(f"geom must be a RingGeometry, got {type(geom).__name__}")
    cap, B, total = geom.slots, geom.q_len, geom.kv_total
    sp = np.asarray(slot_pos)
    if sp.shape != (cap,) or not np.issubdtype(sp.dtype, np.integer):
        raise ValueError(f"slot_pos: shape {sp.shape} dtype {sp.dtype}, expected integer "
                         f"[slots={cap}]")
    committed = int(committed)
    if committed <= 0:
        raise ValueError(f"committed={committed}: must be > 0")
    rule = MaskRule.of(rule)

    win = min(committed, geom.capacity)
    lo = committed - win
    key_pos = np.full(total, -1, dtype=np.int64)
    key_pos[:cap] = sp
    key_pos[cap:cap + B] = committed + np.arange(B)
    key_ok = np.zeros(total, dtype=bool)
    key_ok[:cap] = (sp >= lo) & (sp < committed)
    key_ok[cap:cap + B] = True
    key_ctx = np.arange(total) < cap
    zero, ninf = np.float16(0.0), np.float16(-np.inf)
    return tuple(np.where(block_visibility(rule, sliding, B, key_pos, key_ok, key_ctx, committed, win),
                          zero, ninf) for sliding in (False, True))
