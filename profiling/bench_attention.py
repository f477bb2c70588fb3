"""The masked split-KV ring attention alone, against the window.

For each window: ``RingAttention`` over ``kv_total`` cache rows of one layer
(``q_len`` noise rows, the drafter's heads), time per call, compulsory bytes
(``RingAttention.bytes_moved``: K and V once, mask, q, out, split partials),
GB/s and the fraction of the copy bandwidth measured in the same run.
Graph-amortised: one captured graph runs the attention over ``copies``
different K/V caches (together > 4x the L2), replay time / ``copies``.

``--merges both`` adds, per window, the same split count with the other merge
(the folded last-block merge against the separate combine launch: which one
the default rule picks changes at 24K keys, a crossover only the model has
seen so far).

On a GPU an unfused CuPy version of the same math (cuBLAS batched matmuls in
f16 + softmax; allocates, so timed eagerly) runs side by side for scale.

    python -m profiling.bench_attention                 # Qwen3.5-27B heads, windows 256..32K (GPU)
    python -m profiling.bench_attention --smoke         # tiny shapes (CI, emulator)
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from dflash_cupy import backends
from dflash_cupy.geometry import RingGeometry
from dflash_cupy.ops.attention import RingAttention
from profiling import common, timer

MAX_COPIES = 256


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.bench_attention",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p, json_default_name="bench_attention.json")
    p.add_argument("--drafter", default=None, help="preset (default qwen3.5-27b; smoke: tiny)")
    p.add_argument("--windows", default=None, help="default 256,1K,2K,4K,8K,16K,32K (smoke: 32,64)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=3.0, help="per-window sampling budget")
    p.add_argument("--no-cupy", action="store_true", help="skip the unfused CuPy comparison")
    p.add_argument("--merges", default="default", choices=("default", "both"),
                   help="both: also time the other merge (fold / launch) at the default split count")
    a = p.parse_args(argv)
    a.drafter = a.drafter or ("tiny" if a.smoke else common.DEFAULT_DRAFTER)
    common.drafter_config(a.drafter)
    a.windows = common.int_list(a.windows or ("32,64" if a.smoke else "256,1K,2K,4K,8K,16K,32K"))
    a.warmup = a.warmup if a.warmup is not None else (1 if a.smoke else 3)
    a.repeats = a.repeats if a.repeats is not None else (3 if a.smoke else 20)
    return a


def n_copies(be, nbytes: int) -> int:
    l2 = timer.l2_bytes(be)
    if l2 <= 0:
        return 1
    return int(max(1, min(MAX_COPIES, -(-4 * l2 // max(nbytes, 1)))))


def bench_ours(be, cfg, window, args, bw_Bps, seed, merge=None) -> dict:
    """``merge``: force that merge at the default split count (None: the default config)."""
    geom = RingGeometry(window, cfg.q_len)
    S, B, NKV, D, NH = geom.kv_total, cfg.q_len, cfg.n_head_kv, cfg.head_dim, cfg.n_head
    att = RingAttention(be, D, NH, NKV, B, S, gate=None)
    if merge is not None:
        att.use_config(None, (att.n_splits, merge))
    kv_bytes = 2 * S * NKV * D * 2
    copies = n_copies(be, kv_bytes)
    ks = [common.random_f16(be, (S, NKV * D), seed=seed + 2 * i) for i in range(copies)]
    vs = [common.random_f16(be, (S, NKV * D), seed=seed + 2 * i + 1) for i in range(copies)]
    q = common.random_f32(be, (B, NH * D), seed=seed + 999)
    mask = be.zeros((B, S), np.float16)  # 0 = visible: every row is read either way
    out = be.zeros((B, NH * D), np.float32)
    stream = be.stream()

    def launch_all():
        for k, v in zip(ks, vs):
            att(q, k, v, mask, out, stream=stream)

    graph = timer.capture(be, stream, launch_all)
    t = timer.measure(lambda: graph.launch(stream), be, stream=stream, warmup=args.warmup,
                      repeats=args.repeats, budget_s=args.budget_s)
    per = t.median_s / copies
    by = att.bytes_moved()
    o = be.to_numpy(out)
    return {"impl": "dflash" if merge is None else f"dflash {merge}", "merge": att.merge,
            "window": window, "kv_total": S, "n_splits": att.n_splits,
            "copies": copies, "us": per * 1e6, "bytes": by, "kv_bytes": kv_bytes,
            "GBps": by / per / 1e9, "frac_of_copy_bw": by / per / bw_Bps, "timing": t.as_dict(),
            "out_finite": bool(np.isfinite(o).all()), "config": repr(att)}


def bench_cupy(be, cfg, window, args, bw_Bps, seed) -> dict:
    """softmax(q K^T * scale + mask) V per kv head with CuPy ops (f16 matmuls, f32 softmax)."""
    import cupy
    geom = RingGeometry(window, cfg.q_len)
    S, B, NKV, D, NH = geom.kv_total, cfg.q_len, cfg.n_head_kv, cfg.head_dim, cfg.n_head
    G = NH // NKV
    kv_bytes = 2 * S * NKV * D * 2
    copies = n_copies(be, kv_bytes)
    # head-major copies [NKV, S, D] so cuBLAS reads them without a transpose copy
    ks = [common.random_f16(be, (NKV, S, D), seed=seed + 2 * i) for i in range(copies)]
    vs = [common.random_f16(be, (NKV, S, D), seed=seed + 2 * i + 1) for i in range(copies)]
    q = common.random_f16(be, (NKV, G * B, D), seed=seed + 999)
    mask = cupy.zeros((1, 1, S), cupy.float32)
    scale = 1.0 / math.sqrt(D)
    stream = cupy.cuda.Stream(non_blocking=True)

    def launch_all():
        for k, v in zip(ks, vs):
            s = cupy.matmul(q, k.transpose(0, 2, 1)).astype(cupy.float32) * scale + mask
            s -= s.max(axis=-1, keepdims=True)
            p = cupy.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            cupy.matmul(p.astype(cupy.float16), v)

    with stream:
        t = timer.measure(launch_all, be, stream=stream, warmup=args.warmup, repeats=args.repeats,
                          budget_s=args.budget_s)
    per = t.median_s / copies
    by = kv_bytes + B * S * 2 + 2 * B * NH * D * 2  # the same compulsory traffic, f16 q/out
    return {"impl": "cupy_unfused", "window": window, "kv_total": S, "copies": copies,
            "us": per * 1e6, "bytes": by, "kv_bytes": kv_bytes, "GBps": by / per / 1e9,
            "frac_of_copy_bw": by / per / bw_Bps, "timing": t.as_dict(), "method": "eager"}


TABLE = [("window", "window", "d"), ("impl", "impl", ""), ("kv_total", "kv_total", "d"),
         ("n_splits", "splits", "d"), ("merge", "merge", ""), ("us", "us", ".2f"), ("GBps", "GB/s", ".0f"),
         ("frac_of_copy_bw", "of copy bw", ".2f"), ("copies", "copies", "d")]


def main(argv=None) -> dict:
    args = parse_args(argv)
    be = backends.get(args.backend)
    out = Path(args.out) if args.out else common.default_out(be, "bench_attention.json")
    cfg = common.drafter_config(args.drafter)
    print(f"bench_attention: backend={be.name} drafter={args.drafter} windows={args.windows} -> {out}",
          flush=True)
    result, bw = common.start_result("attention", be, args, argv, "")
    result.update({"drafter": args.drafter, "config": common.config_summary(cfg), "rows": []})
    for window in args.windows:
        rows = [bench_ours(be, cfg, window, args, bw, args.seed + window)]
        if args.merges == "both" and rows[0]["merge"] is not None:
            other = "fold" if rows[0]["merge"] == "launch" else "launch"
            rows.append(bench_ours(be, cfg, window, args, bw, args.seed + window, merge=other))
        if be.name == "cuda" and not args.no_cupy:
            try:
                rows.append(bench_cupy(be, cfg, window, args, bw, args.seed + window))
            except Exception as e:
                rows.append({"impl": "cupy_unfused", "window": window, "error": f"{type(e).__name__}: {e}"})
        common.print_rows(f"window={window:>6}", rows)
        common.add_rows(result, rows, out, be)
    return common.finish(result, out, TABLE)


if __name__ == "__main__":
    main()
