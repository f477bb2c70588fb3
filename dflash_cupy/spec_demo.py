"""``python -m dflash_cupy demo --spec``: the whole DFlash loop end to end.

A small random *target* model written with the array module of the backend
(CuPy on a GPU, NumPy on the emulator) stands in for the LLM: token
embeddings, a few causal layers (each position mixes in the previous
position's hidden state), an LM head. The layers listed in the drafter's
``target_layer_ids`` are captured as feature rows, exactly what a real
pipeline feeds the drafter. The loop:

    prefill the prompt on the target -> ring.write(features) -> first token
    repeat: noise = target embeddings of [last token, mask, ...]
            kv.step(...)            -> draft_tokens (argmax in the graph; with --dflash2 the
                                       candidate selector's walk from the last token)
            target verifies the block (one forward over q_len positions)
            accepted prefix + the target's bonus token are committed,
            their features written to the ring (rejected rows dropped)

Everything is issued on one stream; the only host read per step is the
accepted count (on a GPU). The emulated backend's NumPy target reads the
draft tokens on the host too. Each step's hidden states are also checked
against the float64 oracle (a host read, for the check only).
"""
from __future__ import annotations

import time

import numpy as np

from .tolerances import within

MASK_TOKEN = 0


class RandomTarget:
    """Embeddings ``[V, H]``; layer ``l``: ``h += tanh((h + 0.5*h[p-1]) @ W_l)``;
    ``logits = rmsnorm(h) @ lm_head.T``. ``state`` holds each layer's input at
    the last committed position (the causal context of the next one)."""

    def __init__(self, xp, vocab: int, hidden: int, n_layers: int, captured, seed: int = 0):
        rng = np.random.default_rng(seed)
        f32 = lambda a: xp.asarray(a.astype(np.float32))  # noqa: E731
        self.xp, self.captured = xp, tuple(captured)
        self.embed = f32(rng.standard_normal((vocab, hidden)))
        self.w = [f32(rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)) for _ in range(n_layers)]
        self.lm_head = f32(rng.standard_normal((vocab, hidden)))
        self.state = [xp.zeros((hidden,), xp.float32) for _ in range(n_layers)]

    def forward(self, tokens):
        """Hidden states of ``tokens`` after the committed context: (captured
        features ``[n, n_cap*H]``, greedy next tokens ``[n]``, layer inputs per layer)."""
        xp = self.xp
        h = self.embed[tokens]
        inputs, caps = [], []
        for li, w in enumerate(self.w):
            inputs.append(h)
            prev = xp.concatenate([self.state[li][None], h[:-1]], axis=0)
            h = h + xp.tanh((h + 0.5 * prev) @ w)
            if li in self.captured:
                caps.append(h)
        hn = h / xp.sqrt((h * h).mean(axis=1, keepdims=True) + 1e-6)
        nxt = xp.argmax(hn @ self.lm_head.T, axis=1).astype(xp.int32)
        return xp.concatenate(caps, axis=1), nxt, inputs

    def commit(self, inputs, row: int) -> None:
        """Make position ``row`` of the last forward the latest committed one."""
        self.state = [inp[row] for inp in inputs]


def accepted(xp, drafts, target_next):
    """Draft rows 1.. that the target confirms, as a device scalar: the length of
    the leading run where ``drafts[i] == target_next[i-1]`` (the target's greedy
    token after position i-1 of the verified block)."""
    return xp.cumprod((drafts[1:] == target_next[:-1]).astype(xp.int32)).sum()


def run(args) -> int:
    from . import backends, reference
    from .config import DraftConfig
    from .feature_ring import FeatureRing
    from .kv_cache import DraftKvCache
    from .weights import DraftWeights

    be = backends.get(args.backend)
    if be.name == "cuda":
        import cupy as xp
        host = xp.asnumpy
    else:
        xp = np
        host = np.asarray
    n_target_layers = max(args.captured * 2, 4)
    captured = tuple(range(1, n_target_layers, 2))[:args.captured]
    d2 = {}
    if getattr(args, "dflash2", False):   # the candidate selector over the target's vocabulary
        from .config import DFlash2Config
        d2 = dict(dflash2=DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=32,
                                        selector_top_k=8, vocab_size=args.vocab, final_logit_softcapping=20.0,
                                        output_multiplier=0.5),
                  mask_token_id=MASK_TOKEN, is_causal=False)
    cfg = DraftConfig(n_layer=args.layers, hidden_size=args.hidden, n_head=args.heads, n_head_kv=args.kv_heads,
                      head_dim=args.head_dim, intermediate_size=args.intermediate, block_size=args.block_size,
                      target_layer_ids=captured, layer_sliding=tuple(i in set(args.sliding) for i in range(args.layers)),
                      sliding_window=args.window or None, **d2)
    w = DraftWeights.random(cfg, seed=args.seed, dtype=args.dtype)
    target = RandomTarget(xp, args.vocab, cfg.hidden_size, n_target_layers, captured, seed=args.seed + 1)
    rng = np.random.default_rng(args.seed + 2)
    q = cfg.q_len
    stream = be.stream()
    ring = FeatureRing(args.capacity + 2 * (2 * q + 2), cfg.n_captured, cfg.hidden_size, backend=be)
    feats_host = []            # every committed position's features, for the oracle check
    tokens_host = []
    times = {"target": 0.0, "ring write": 0.0, "draft step": 0.0, "accept": 0.0, "oracle check": 0.0}
    accepts, worst, bad = [], 0.0, 0
    argmax_accepts = []   # DFlash 2: the same step's LM-head argmax drafts, verified as well
    lm_head = target.lm_head if be.name == "cuda" else np.asarray(target.lm_head)
    print(f"backend: {be.name}; drafter {w}; target: {n_target_layers} layers, vocab {args.vocab}, "
          f"captured layers {captured}")
    t_start = time.perf_counter()
    with DraftKvCache(w, args.capacity, lm_head=lm_head, backend=be) as kv, stream:
        prompt = rng.integers(1, args.vocab, args.prompt).astype(np.int32)
        t = time.perf_counter()
        feats, nxt, inputs = target.forward(xp.asarray(prompt))
        target.commit(inputs, len(prompt) - 1)
        times["target"] += time.perf_counter() - t
        t = time.perf_counter()
        ring.write(0, feats)
        times["ring write"] += time.perf_counter() - t
        feats_host.append(host(feats))
        tokens_host.extend(prompt.tolist())
        committed = len(prompt)
        last = nxt[-1:]                      # the target's next token (position `committed`)
        produced = 0
        step = 0
        while produced < args.tokens:
            t = time.perf_counter()
            block = xp.concatenate([last, xp.full((q - 1,), MASK_TOKEN, xp.int32)])
            noise = target.embed[block]
            times["target"] += time.perf_counter() - t
            t = time.perf_counter()
            anchor = (last if be.name == "cuda" else int(last[0])) if cfg.dflash2 else None
            hidden = kv.step(ring, committed, noise, anchor=anchor)
            drafts = kv.draft_tokens if be.name == "cuda" else be.to_numpy(kv.draft_tokens)
            times["draft step"] += time.perf_counter() - t
            # the target verifies [last, d_1 .. d_{q-1}] in one forward
            t = time.perf_counter()
            verify = xp.concatenate([last, drafts[1:]])
            vfeats, vnext, vinputs = target.forward(verify)
            times["target"] += time.perf_counter() - t
            t = time.perf_counter()
            a = int(accepted(xp, drafts, vnext))  # the one host read of the loop
            times["accept"] += time.perf_counter() - t
            if cfg.dflash2:   # what the LM head's argmax would have drafted (not committed)
                h = xp.asarray(be.to_numpy(hidden, stream=stream)) if be.name == "cuda" else be.to_numpy(hidden)
                am = xp.argmax(h @ lm_head.T, axis=1).astype(xp.int32)
                am[0] = last[0]
                argmax_accepts.append(int(accepted(xp, am, target.forward(xp.concatenate([last, am[1:]]))[1])) + 1)
            t = time.perf_counter()
            ring.write(committed, vfeats[:a + 1])   # positions committed .. committed+a
            times["ring write"] += time.perf_counter() - t
            target.commit(vinputs, a)
            if args.check:
                t = time.perf_counter()
                X = np.concatenate(feats_host, axis=0)
                win_lo = committed - min(committed, kv.capacity)
                ref = reference.draft_forward(w, X[win_lo:committed], host(noise))
                ok, err = within(be.to_numpy(hidden, stream=stream), ref, "step")
                worst, bad = max(worst, err), bad + (not ok)
                times["oracle check"] += time.perf_counter() - t
            feats_host.append(host(vfeats[:a + 1]))
            tokens_host.extend(host(verify[:a + 1]).tolist())
            committed += a + 1
            last = vnext[a:a + 1]
            produced += a + 1
            accepts.append(a + 1)
            step += 1
    total = time.perf_counter() - t_start
    acc = np.asarray(accepts)
    print(f"{step} draft steps, {produced} tokens after a {args.prompt}-token prompt; acceptance length "
          f"mean {acc.mean():.2f} (min {acc.min()}, max {acc.max()}; a random drafter agrees with the "
          f"target only by chance)")
    if argmax_accepts:
        print(f"DFlash 2: acceptance length with the candidate selector {acc.mean():.2f}, with the LM head's "
              f"argmax of the same hidden states {np.mean(argmax_accepts):.2f} (verified, not committed)")
    print("time per component (host wall time of issuing it; on the emulator the queued work runs "
          "at the host reads):")
    for k, v in times.items():
        print(f"  {k:<13} {v * 1e3 / max(step, 1):8.2f} ms/step")
    print(f"  {'total':<13} {total * 1e3 / max(step, 1):8.2f} ms/step ({total:.1f} s)")
    if args.check:
        print(f"oracle: worst max error {worst:.2e} over {step} steps"
              + (f"; FAILED: {bad} step(s) outside tolerance" if bad else "; every step within tolerance"))
    return 1 if bad else 0
