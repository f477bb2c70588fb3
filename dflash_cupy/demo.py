"""``python -m dflash_cupy demo``: the ring cache on a drafter, checked against the oracle.

Runs a DFlash-like schedule — a prompt prefill, then steps that accept a
random 1..q_len tokens, one jump longer than a step can append, one rewind —
through ``DraftKvCache`` on the chosen backend (CPU emulation when no GPU is
visible), checks every step's hidden states against the float64 one-shot
forward over the window (``reference.draft_forward``), and prints a table:
step, committed, rows appended, bulk?, max error, host µs in ``begin_step``.
Exit status 1 if any step is outside the "step" tolerance.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None


def add_arguments(d: argparse.ArgumentParser) -> None:
    d.add_argument("--checkpoint", default=None,
                   help="a DFlash drafter directory (config.json + model.safetensors); default: random")
    d.add_argument("--backend", default=None, choices=["cuda", "emulated"],
                   help="default: cuda when a GPU is visible, else emulated")
    d.add_argument("--steps", type=int, default=None, help="drafter steps (default 200; 40 with --lanes)")
    d.add_argument("--capacity", type=int, default=48, help="ring capacity (default 48)")
    d.add_argument("--prompt", type=int, default=20, help="prompt length before step 0 (default 20)")
    d.add_argument("--every", type=int, default=10, help="print every N-th step, plus bulk steps (default 10)")
    d.add_argument("--layers", type=int, default=2, help="random drafter: layers (default 2)")
    d.add_argument("--hidden", type=int, default=64, help="random drafter: hidden size (default 64)")
    d.add_argument("--heads", type=int, default=4, help="random drafter: query heads (default 4)")
    d.add_argument("--kv-heads", type=int, default=2, help="random drafter: kv heads (default 2)")
    d.add_argument("--head-dim", type=int, default=32, help="random drafter: head dim (default 32)")
    d.add_argument("--intermediate", type=int, default=128, help="random drafter: FFN size (default 128)")
    d.add_argument("--block-size", type=int, default=8, help="random drafter: q_len (default 8)")
    d.add_argument("--captured", type=int, default=3, help="random drafter: captured layers (default 3)")
    d.add_argument("--sliding", type=_int_list, default=[0],
                   help="random drafter: comma-separated sliding-window layers (default 0)")
    d.add_argument("--window", type=int, default=16, help="random drafter: sliding window (default 16)")
    d.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"],
                   help="random drafter: weight dtype (default bf16)")
    d.add_argument("--dflash2", action="store_true",
                   help="random drafter: DFlash 2 (convolutions and the candidate selector, SPEC §6; "
                        "--vocab tokens, bidirectional per-row sliding window)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--lanes", type=int, default=0,
                   help="draft N requests together in one DraftKvBatch (lanes_demo; 0: one DraftKvCache)")
    d.add_argument("--spec", action="store_true",
                   help="run the whole speculative loop with a small random target model (spec_demo)")
    d.add_argument("--tokens", type=int, default=200, help="--spec: tokens to generate (default 200)")
    d.add_argument("--vocab", type=int, default=512, help="--spec: target vocabulary (default 512)")
    d.add_argument("--no-check", dest="check", action="store_false",
                   help="--spec: skip the per-step oracle check")


def _schedule(rng, steps: int, prompt: int, q_len: int, a_step: int, capacity: int) -> list[int]:
    """Committed length per step: random acceptances, one jump, one rewind."""
    out, c = [], prompt
    jump_at, rewind_at = steps // 3, (2 * steps) // 3
    for i in range(steps):
        if i == jump_at:
            c += a_step + 1 + int(rng.integers(0, q_len))   # more than a step can fold in
        elif i == rewind_at:
            c = max(1, c - int(rng.integers(q_len, capacity + q_len + 1)))  # rewind
        elif i > 0:
            c += int(rng.integers(1, q_len + 1))              # accepted a of q_len drafts, +1
        out.append(c)
    return out


def drafter_weights(args, be):
    """The drafter the options describe: ``--checkpoint`` or a random one."""
    from .config import DraftConfig
    from .weights import DraftWeights
    if args.checkpoint:
        return DraftWeights.from_pretrained(args.checkpoint, backend=be)
    sliding = tuple(i in set(args.sliding) for i in range(args.layers))
    d2 = {}
    if getattr(args, "dflash2", False):   # the published layout's choices at a small size
        from .config import DFlash2Config
        d2 = dict(dflash2=DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=32,
                                        selector_top_k=8, vocab_size=args.vocab, final_logit_softcapping=20.0,
                                        output_multiplier=0.5),
                  mask_token_id=args.vocab - 1, is_causal=False)
    cfg = DraftConfig(n_layer=args.layers, hidden_size=args.hidden, n_head=args.heads,
                      n_head_kv=args.kv_heads, head_dim=args.head_dim,
                      intermediate_size=args.intermediate, block_size=args.block_size,
                      target_layer_ids=tuple(range(args.captured)), layer_sliding=sliding,
                      sliding_window=args.window or None, **d2)
    return DraftWeights.random(cfg, seed=args.seed, dtype=args.dtype)


def run(args) -> int:
    if getattr(args, "spec", False):
        from .spec_demo import run as run_spec
        return run_spec(args)
    if args.steps is None:
        args.steps = 40 if getattr(args, "lanes", 0) else 200
    if getattr(args, "lanes", 0):
        from . import backends
        from .lanes_demo import run as run_lanes
        be = backends.get(args.backend)
        return run_lanes(args, be, drafter_weights(args, be))
    from . import backends, reference
    from .config import DraftConfig
    from .feature_ring import FeatureRing
    from .kv_cache import DraftKvCache
    from .tolerances import TOL, within
    from .weights import DraftWeights

    be = backends.get(args.backend)
    w = drafter_weights(args, be)
    cfg = w.config
    rng = np.random.default_rng(args.seed + 1)
    # DFlash 2: the selector needs the target's LM head; a random one of the drafter's vocabulary
    # (a checkpoint holds no target)
    d2 = cfg.dflash2
    lm = None
    if d2 is not None:
        lm = (rng.standard_normal((d2.vocab_size, cfg.hidden_size)) / np.sqrt(cfg.hidden_size)).astype(np.float32)
    t0 = time.perf_counter()
    kv = DraftKvCache(w, args.capacity, backend=be, lm_head=lm)
    build_s = time.perf_counter() - t0
    sched = _schedule(rng, args.steps, args.prompt, kv.q_len, kv.a_step, kv.capacity)
    n_pos = max(sched) + 1
    features = rng.standard_normal((n_pos, cfg.fc_in)).astype(np.float32)
    ring = FeatureRing(max(kv.capacity, 2 * kv.a_step), cfg.n_captured, cfg.hidden_size, backend=be)

    print(f"backend: {be.name}; drafter: {w}")
    print(f"layers: {' '.join(cfg.layer_types)}; sliding_window={cfg.sliding_window}")
    print(f"ring cache: capacity={kv.capacity} q_len={kv.q_len} a_step={kv.a_step} "
          f"kv_total={kv.kv_total}; built in {build_s:.2f} s")
    head = f"{'step':>5} {'committed':>9} {'appended':>8} {'bulk':>5} {'max err':>9} {'host us':>8}"
    print(head)
    print("-" * len(head))
    worst, host_us, bad, written = 0.0, [], 0, 0
    sel_checked = sel_bad = 0   # DFlash 2: walk decisions clear of f32 rounding, and mismatches
    with kv:
        for i, c in enumerate(sched):
            if c < written:  # rewind: the target re-commits features from the rewind point
                written = max(0, c - ring.capacity)
            lo = max(written, c - ring.capacity)
            if c > lo:
                ring.write(lo, features[lo:c])
            written = c
            noise = rng.standard_normal((kv.q_len, cfg.hidden_size)).astype(np.float32)
            t = time.perf_counter()
            kv.begin_step(ring, c)
            dt_us = (time.perf_counter() - t) * 1e6
            kv.set_noise_embed(noise)
            anchor = int(rng.integers(0, d2.vocab_size)) if d2 is not None else None
            if d2 is not None:
                kv.set_anchor(anchor)
            got = be.to_numpy(kv.run())
            plan = kv.last_plan
            bulk = plan.bulk_count > 0
            if not bulk:
                host_us.append(dt_us)
            win_lo = c - min(c, kv.capacity)
            ref = reference.draft_forward(w, features[win_lo:c], noise)
            ok, err = within(got, ref, "step")
            if d2 is not None and kv.q_len > 1:   # the selector's walk against the oracle's
                sel = reference.select_draft(w, ref, lm, anchor)
                clear = sel.margin > 1e-2
                tokens = be.to_numpy(kv.draft_tokens)[1:]
                sel_checked += int(clear.sum())
                wrong = int((tokens[clear] != sel.draft_tokens[clear]).sum())
                sel_bad += wrong
                ok = ok and not wrong
            worst = max(worst, err)
            bad += not ok
            if i % max(1, args.every) == 0 or bulk or plan.reset or not ok or i == len(sched) - 1:
                appended = plan.bulk_count if bulk else plan.n_new
                flag = "yes" if bulk else "no"
                if plan.reset:
                    flag += "*"
                print(f"{i:>5} {c:>9} {appended:>8} {flag:>5} {err:>9.2e} {dt_us:>8.1f}"
                      + ("" if ok else "  <-- outside tolerance"))
    t = TOL["step"]
    med = float(np.median(host_us)) if host_us else float("nan")
    print(f"(* = rewind: cache reset)  {args.steps} steps, worst max error {worst:.2e} "
          f"(tolerance atol={t['atol']} + rtol={t['rtol']}*|ref|), "
          f"median host begin_step {med:.1f} us (in-graph steps)")
    if d2 is not None:
        print(f"DFlash 2 selector: {sel_checked} walk decisions clear of f32 rounding (oracle margin > 1e-2) "
              f"checked, {sel_bad} differ")
    if bad:
        print(f"FAILED: {bad} step(s) outside tolerance")
        return 1
    print("OK: every step matches the one-shot oracle")
    return 0
