"""Command line: ``python -m dflash_cupy demo [options]``.

``demo`` builds a small random drafter and runs the float64 oracle
(``reference.draft_window``) over a few committed lengths, printing one row
per length: the window, what the ring masks let through, and the output.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash_cupy",
                                description="DFlash drafter ring-cache tools")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the float64 oracle on a small random drafter")
    d.add_argument("--layers", type=int, default=2, help="drafter layers (default 2)")
    d.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    d.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    d.add_argument("--kv-heads", type=int, default=2, help="kv heads (default 2)")
    d.add_argument("--head-dim", type=int, default=16, help="head dim (default 16)")
    d.add_argument("--intermediate", type=int, default=128, help="FFN size (default 128)")
    d.add_argument("--block-size", type=int, default=8, help="noise block q_len (default 8)")
    d.add_argument("--captured", type=int, default=3, help="captured target layers (default 3)")
    d.add_argument("--capacity", type=int, default=48, help="ring capacity (default 48)")
    d.add_argument("--sliding", type=_int_list, default=[0],
                   help="comma-separated indices of sliding-window layers (default 0)")
    d.add_argument("--window", type=int, default=16, help="sliding window (0: none; default 16)")
    d.add_argument("--committed", type=_int_list, default=[1, 5, 17, 48, 49, 100, 1000],
                   help="committed lengths to run (default 1,5,17,48,49,100,1000)")
    d.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"],
                   help="weight storage dtype (default f32)")
    d.add_argument("--seed", type=int, default=0)
    return p


def demo(argv=None) -> int:
    """Run the demo; ``argv`` excludes the program name (``["demo", ...]`` or just options)."""
    from .config import DraftConfig
    from .geometry import RingGeometry
    from .reference import contiguous_slot_pos, draft_window, ring_masks
    from .weights import DraftWeights

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "demo":
        argv = ["demo"] + argv
    a = _parser().parse_args(argv)

    sliding = tuple(i in set(a.sliding) for i in range(a.layers))
    cfg = DraftConfig(n_layer=a.layers, hidden_size=a.hidden, n_head=a.heads,
                      n_head_kv=a.kv_heads, head_dim=a.head_dim,
                      intermediate_size=a.intermediate, block_size=a.block_size,
                      target_layer_ids=tuple(range(a.captured)), layer_sliding=sliding,
                      sliding_window=a.window or None)
    w = DraftWeights.random(cfg, seed=a.seed, dtype=a.dtype)
    geom = RingGeometry(capacity=a.capacity, q_len=cfg.q_len)
    rng = np.random.default_rng(a.seed + 1)
    n_pos = max(a.committed)
    features = rng.standard_normal((n_pos, cfg.fc_in)).astype(np.float32)
    noise = rng.standard_normal((cfg.q_len, cfg.hidden_size)).astype(np.float32)

    print(f"drafter: {w}")
    print(f"layers: {' '.join(cfg.layer_types)}; sliding_window={cfg.sliding_window}")
    print(f"ring: capacity={geom.capacity} q_len={geom.q_len} a_step={geom.a_step} "
          f"trash_slot={geom.trash_slot} kv_total={geom.kv_total}")
    head = (f"{'committed':>9} {'window':>13} {'full ctx':>8} {'swa ctx':>7} "
            f"{'rms(hidden)':>11} {'max|hidden|':>11} {'ms':>7}")
    print(head)
    print("-" * len(head))
    for committed in a.committed:
        if committed <= 0:
            print(f"{committed:>9} skipped (committed must be > 0)")
            continue
        lo = committed - min(committed, geom.capacity)
        mf, ms = ring_masks(contiguous_slot_pos(committed, geom.capacity), committed, geom,
                            cfg.swa_window)
        t0 = time.perf_counter()
        hidden = draft_window(w, features, committed, geom.capacity, noise)
        dt = (time.perf_counter() - t0) * 1e3
        n_full = int((mf[0, :geom.capacity] == 0).sum())
        n_swa = int((ms[0, :geom.capacity] == 0).sum())
        rms = float(np.sqrt(np.mean(hidden ** 2)))
        print(f"{committed:>9} {f'[{lo},{committed})':>13} {n_full:>8} {n_swa:>7} "
              f"{rms:>11.5f} {float(np.abs(hidden).max()):>11.5f} {dt:>7.2f}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        return demo(argv)
    _parser().parse_args(argv)  # prints usage / errors for anything else
    return 2


if __name__ == "__main__":
    sys.exit(main())
