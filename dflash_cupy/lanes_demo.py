"""``python -m dflash_cupy demo --lanes N``: N requests drafted together by one
``DraftKvBatch``, each checked against the one-shot float64 oracle every step.

The requests differ in prompt length, acceptance (each lane accepts 1..q_len
drafts a step with its own odds), when they join (lane i idles for its first
i steps, then joins with a bulk prefill), one lane rewinds (its target
rejected a stretch: new features from the rewind point), one lane pauses for
a few steps mid-run, and the last lane leaves early."""
from __future__ import annotations

import time

import numpy as np


def _lane_schedules(rng, lanes: int, steps: int, prompt: int, q_len: int, capacity: int):
    """Per lane, per step: committed tokens or None (idle)."""
    out = []
    for i in range(lanes):
        c = prompt + 7 * i                  # different prompt lengths
        accept = 0.3 + 0.6 * rng.random()   # this request's acceptance odds
        sched = []
        for k in range(steps):
            if k < i or (i == 1 and steps // 2 <= k < steps // 2 + 3) or (i == lanes - 1 and lanes > 1
                                                                            and k >= (3 * steps) // 4):
                sched.append(None)           # not joined yet / paused / left
                continue
            if k > i:
                if i == 0 and k == (2 * steps) // 3:
                    c = max(1, c - int(rng.integers(q_len, capacity)))   # rewind
                else:
                    c += 1 + int(rng.binomial(q_len - 1, accept))        # accepted drafts + 1
            sched.append(c)
        out.append(sched)
    return out


def run(args, be, w) -> int:
    """The demo's options ``args`` on backend ``be`` with drafter weights ``w``."""
    from . import reference
    from .kv_batch import DraftKvBatch
    from .memory_plan import bytes_for, side_by_side
    from .tolerances import TOL, within

    lanes = int(args.lanes)
    cfg = w.config
    rng = np.random.default_rng(args.seed + 1)
    vocab = 97
    lm = (rng.standard_normal((vocab, cfg.hidden_size)) / np.sqrt(cfg.hidden_size)).astype(np.float32)
    t0 = time.perf_counter()
    batch = DraftKvBatch(w, args.capacity, lanes, lm_head=lm, backend=be)
    build_s = time.perf_counter() - t0
    scheds = _lane_schedules(rng, lanes, args.steps, args.prompt, batch.q_len, batch.capacity)
    feats = [rng.standard_normal((max(c for c in s if c is not None) + 1, cfg.fc_in)).astype(np.float32)
             for s in scheds]
    written = [0] * lanes
    print(f"backend: {be.name}; drafter: {w}")
    print(f"{lanes} lanes; ring cache per lane: capacity={batch.capacity} q_len={batch.q_len} "
          f"kv_total={batch.kv_total}; built in {build_s:.2f} s")
    planned = bytes_for(cfg, lanes, args.capacity, vocab=vocab, lm_head_dtype=lm.dtype,
                        weight_dtype=w.dtype or np.float32)
    print("device memory by pool, sized before allocating (bytes_for) and held (memory()):")
    print(side_by_side(planned, batch.memory()))
    head = f"{'step':>5} {'active':>6}  {'committed per lane (-: idle)':<48} {'max err':>9} {'host us':>8}"
    print(head)
    print("-" * len(head))
    worst, bad, host_us = 0.0, 0, []
    with batch:
        for k in range(args.steps):
            committed = [s[k] for s in scheds]
            for i, c in enumerate(committed):
                if c is None:
                    continue
                ring = batch.rings[i]
                if c < written[i]:                      # rewind: new features from the rewind point on
                    feats[i][c:] = rng.standard_normal(feats[i][c:].shape)
                    written[i] = max(0, c - ring.capacity)
                lo = max(written[i], c - ring.capacity)
                if c > lo:
                    ring.write(lo, feats[i][lo:c])
                written[i] = c
            noise = rng.standard_normal((lanes, batch.q_len, cfg.hidden_size)).astype(np.float32)
            t = time.perf_counter()
            batch.begin_step(committed)
            dt_us = (time.perf_counter() - t) * 1e6
            batch.set_noise_embed(noise)
            batch.run()
            hs = be.to_numpy(batch.hidden_states)
            toks = be.to_numpy(batch.draft_tokens)
            if not any(p is not None and p.bulk_count for p in batch.last_plan):
                host_us.append(dt_us)
            errs = []
            for i, c in enumerate(committed):
                if c is None:
                    continue
                lo = c - min(c, batch.capacity)
                ref_h, ref_l = reference.draft_forward(w, feats[i][lo:c], noise[i], lm_head=lm)
                ok, err = within(hs[i], ref_h, "step")
                # greedy tokens: the oracle's argmax wherever its top two logits are apart
                top2 = np.sort(ref_l, axis=-1)[:, -2:]
                clear = top2[:, 1] - top2[:, 0] > 1e-3
                ok &= bool(np.array_equal(toks[i][clear], np.argmax(ref_l, axis=-1)[clear]))
                errs.append(err)
                bad += not ok
            worst = max([worst] + errs)
            if k % max(1, args.every) == 0 or k == args.steps - 1:
                lane_s = " ".join("-" if c is None else str(c) for c in committed)
                print(f"{k:>5} {sum(c is not None for c in committed):>6}  {lane_s:<48} "
                      f"{max(errs, default=0.0):>9.2e} {dt_us:>8.1f}")
        captures = batch.captures
    t = TOL["step"]
    med = float(np.median(host_us)) if host_us else float("nan")
    print(f"{args.steps} steps x {lanes} lanes, worst max error {worst:.2e} (tolerance atol={t['atol']} + "
          f"rtol={t['rtol']}*|ref|), step graph captured {captures}x, median host begin_step {med:.1f} us")
    if bad:
        print(f"FAILED: {bad} lane-step(s) outside tolerance or with a wrong draft token")
        return 1
    print("OK: every lane of every step matches the one-shot oracle")
    return 0
