"""An independent DFlash 2 reference for the tests (SPEC §6), written apart from
``dflash_cupy.reference`` on purpose: explicit loops over rows, channels, heads and
candidates, every weight read by its checkpoint name from a plain ``{name: array}``
dict, the conv's (half, tap, group) layout decoded index by index. Slow; tiny sizes
only. No masks of its own: the caller passes each layer's visibility."""
from __future__ import annotations

import math

import numpy as np


def _f(a):
    return np.asarray(a, dtype=np.float64)


def _rms(v, w, eps):
    """One row: v / sqrt(mean(v^2) + eps) * w."""
    v = _f(v)
    return v / math.sqrt(sum(x * x for x in v) / len(v) + eps) * _f(w)


def conv_rows(x, base_half, delta_rows, half, taps, group_size):
    """``x [B, H]`` convolved with ``base_half [taps, H]`` plus the dynamic taps of
    ``half`` read from the raw projection rows ``delta_rows [B, 2*taps*G]`` at
    column ``(half*taps + t)*G + g``; rows before the block read as zero."""
    x = _f(x)
    B, H = x.shape
    G = H // group_size
    y = np.zeros((B, H))
    for i in range(B):
        for c in range(H):
            g = c // group_size
            acc = 0.0
            for t in range(taps):
                if i - t < 0:
                    continue
                k = base_half[t][c] + delta_rows[i][(half * taps + t) * G + g]
                acc += k * x[i - t][c]
            y[i][c] = acc
    return y


def _rope_row(v, pos, theta):
    d = len(v)
    out = np.array(v, dtype=np.float64)
    for i in range(d // 2):
        a = pos * theta ** (-2.0 * i / d)
        x1, x2 = v[i], v[i + d // 2]
        out[i] = x1 * math.cos(a) - x2 * math.sin(a)
        out[i + d // 2] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


def forward(t, cfg, feat_rows, noise_embed, pos_ctx, pos_noise, visible):
    """The DFlash 2 forward (no aux norms, no context norm, no gate, no RoPE scaling):
    ``t`` the checkpoint dict, ``visible[l] [B, C+B]`` bool. Returns ``hidden [B, H]``."""
    assert cfg.rope_scaling is None and not cfg.aux_hidden_norms
    assert not cfg.context_kv_layer_norm and cfg.attn_gate == "none"
    d2, eps = cfg.dflash2, cfg.rms_norm_eps
    nh, nkv, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    X, h = _f(feat_rows), _f(noise_embed).copy()
    C, B, H = X.shape[0], h.shape[0], h.shape[1]
    ctx = np.array([_rms(_f(t["fc.weight"]) @ X[k], t["hidden_norm.weight"], eps) for k in range(C)])
    for l in range(cfg.n_layer):
        p = f"layers.{l}."

        def W(name):
            return _f(t[p + name])

        def sublayer(x_norm, conv, body):
            kp = W(conv + ".kernel_projection.weight")
            delta = np.array([kp @ x_norm[i] for i in range(B)])
            base = W(conv + ".base_kernel")
            x_in = conv_rows(x_norm, base[0], delta, 0, d2.conv_kernel_size, d2.conv_group_size)
            return conv_rows(body(x_in), base[1], delta, 1, d2.conv_kernel_size, d2.conv_group_size)

        def attention(x):
            q = [[_rope_row(_rms((W("self_attn.q_proj.weight") @ x[i])[j * d:(j + 1) * d],
                                 W("self_attn.q_norm.weight"), eps), pos_noise[i], cfg.rope_theta)
                  for j in range(nh)] for i in range(B)]
            src = [ctx[k] for k in range(C)] + [x[i] for i in range(B)]
            pos = list(pos_ctx) + list(pos_noise)
            K = [[_rope_row(_rms((W("self_attn.k_proj.weight") @ s)[j * d:(j + 1) * d],
                                 W("self_attn.k_norm.weight"), eps), pos[n], cfg.rope_theta)
                  for j in range(nkv)] for n, s in enumerate(src)]
            V = [[(W("self_attn.v_proj.weight") @ s)[j * d:(j + 1) * d] for j in range(nkv)]
                 for s in src]
            out = np.zeros((B, nh * d))
            for i in range(B):
                for j in range(nh):
                    kv = j // (nh // nkv)
                    keys = [n for n in range(C + B) if visible[l][i][n]]
                    sc = [float(np.dot(q[i][j], K[n][kv])) / math.sqrt(d) for n in keys]
                    m = max(sc)
                    e = [math.exp(s - m) for s in sc]
                    out[i, j * d:(j + 1) * d] = sum(w * V[n][kv] for w, n in zip(e, keys)) / sum(e)
            return np.array([W("self_attn.o_proj.weight") @ out[i] for i in range(B)])

        def mlp(x):
            rows = []
            for i in range(B):
                g = W("mlp.gate_proj.weight") @ x[i]
                u = W("mlp.up_proj.weight") @ x[i]
                rows.append(W("mlp.down_proj.weight") @ (g / (1 + np.exp(-g)) * u))
            return np.array(rows)

        xn = np.array([_rms(h[i], W("input_layernorm.weight"), eps) for i in range(B)])
        h = h + sublayer(xn, "attention_conv", attention)
        xn = np.array([_rms(h[i], W("post_attention_layernorm.weight"), eps) for i in range(B)])
        h = h + sublayer(xn, "mlp_conv", mlp)
    return np.array([_rms(h[i], t["norm.weight"], eps) for i in range(B)])


def _top_k(row, k):
    """Repeated scans: the largest remaining logit, the lowest id among equals."""
    taken, out = set(), []
    for _ in range(k):
        best = None
        for v in range(len(row)):
            if v not in taken and (best is None or row[v] > row[best]):
                best = v
        taken.add(best)
        out.append(best)
    return out


def select(t, cfg, hidden, lm_head, anchor, temperature=0.0, uniforms=None):
    """The selector on block rows 1..B-1: ``(tokens, candidate ids, values, q)`` as lists.
    Walk: greedy takes the first maximum; sampled takes the first candidate whose
    running mass exceeds ``u * total`` of ``exp((s - max) / T)``."""
    d2 = cfg.dflash2
    hidden, lm_head = _f(hidden), _f(lm_head)
    hp_w = _f(t["candidate_selector.hidden_projection.weight"])
    pred_cb = _f(t["candidate_selector.predecessor_codebook"])
    succ_cb = _f(t["candidate_selector.successor_codebook"])
    tokens, all_ids, all_vals, qs = [], [], [], []
    prev_tok = anchor
    for r in range(1, hidden.shape[0]):
        logits = [float(np.dot(lm_head[v], hidden[r])) for v in range(lm_head.shape[0])]
        ids = _top_k(logits, d2.selector_top_k)
        vals = []
        for v in ids:
            x = logits[v] * d2.output_multiplier
            cap = d2.final_logit_softcapping
            vals.append(math.tanh(x / cap) * cap if cap else x)
        hp = hp_w @ hidden[r]
        scores = []
        for c, v in enumerate(ids):
            s = vals[c]
            for k in range(d2.selector_rank):
                s += pred_cb[prev_tok][k] * hp[k] * succ_cb[v][k]
            scores.append(s)
        if temperature > 0:
            m = max(scores)
            w = [math.exp((s - m) / temperature) for s in scores]
            total = sum(w)
            target, acc, j = uniforms[r - 1] * total, 0.0, len(w) - 1
            for c, x in enumerate(w):
                acc += x
                if acc > target:
                    j = c
                    break
            q = [x / total for x in w]
        else:
            j = 0
            for c in range(1, len(scores)):
                if scores[c] > scores[j]:
                    j = c
            q = [1.0 if c == j else 0.0 for c in range(len(scores))]
        prev_tok = ids[j]
        tokens.append(prev_tok)
        all_ids.append(ids)
        all_vals.append(vals)
        qs.append(q)
    return tokens, all_ids, all_vals, qs
