"""Host time of ``DraftKvCache.begin_step`` per step, against the capacity.

``begin_step`` is everything the host does per step besides the one graph
launch (``run()``): validate, plan (``decide_lanes``), wait for the replay two
steps back, write the step descriptor into pinned memory. The target is
<= 10 us per step at every capacity, not growing with it (O(1) planning).

Steady state, per capacity: a tiny drafter (hidden 32: setup is fast, and
nothing in ``begin_step`` depends on the model size), the window full, each
step committing ``--accept`` (<= a_step) tokens, so every step is an
in-graph append. The cache starts at ``next_pos = capacity - accept`` (the
host state of a cache that has been stepping: the prefill's bulk append would
only cost setup time, its device contents do not matter to the host), runs
two real steps (both step graphs captured, both replay events used), then
times ``begin_step`` alone over ``--steps`` steps after ``--warmup``;
between calls it sets ``next_pos`` as ``run()`` would, without replaying
(on the emulator a replay executes the whole step on the CPU).

``--json``: the last line printed is exactly
``{"host_us_per_step": {"2048": ..., "8192": ..., "32768": ...}}`` (medians).
``--profile``: cProfile of the timed loop at the largest capacity, printed
before the JSON line (function-level costs inside ``begin_step``).

    python -m profiling.bench_host --json          # emulated backend unless --backend cuda
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from dflash_cupy import backends
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import DraftKvCache
from profiling import common

TARGET_US = 10.0


def parse_args(argv=None):
    p = common.host_bench_parser("python -m profiling.bench_host", __doc__, json_default_name="bench_host.json",
                                 steps="3000", warmup="300")
    p.add_argument("--capacities", default=None, help="default 2048,8192,32768 (smoke: 32,64)")
    p.add_argument("--drafter", default="tiny", help="preset (default tiny)")
    p.add_argument("--json", action="store_true", help="end with the one-line JSON summary")
    p.add_argument("--profile", action="store_true", help="cProfile the loop at the largest capacity")
    a = p.parse_args(argv)
    a.capacities = common.int_list(a.capacities or ("32,64" if a.smoke else "2048,8192,32768"))
    a.steps = a.steps if a.steps is not None else (200 if a.smoke else 3000)
    a.warmup = a.warmup if a.warmup is not None else (20 if a.smoke else 300)
    common.drafter_config(a.drafter)
    return a


def steady_cache(be, weights, capacity: int, accept: int, n_steps: int, seed: int = 0):
    """(cache, ring, committed) ready for in-graph steps with a full window."""
    cfg = weights.config
    if not 1 <= accept <= 2 * cfg.q_len + 2:
        raise ValueError(f"accept={accept} must be in [1, a_step={2 * cfg.q_len + 2}]")
    ring_cap = -(-(capacity + accept * (n_steps + 4) + 1) // 1024) * 1024
    ring = FeatureRing(ring_cap, cfg.n_captured, cfg.hidden_size, dtype="bf16", backend=be)
    common.fill_ring(ring, be, seed=seed)
    cache = DraftKvCache(weights, capacity, backend=be)
    c = capacity
    cache.engine._next[0] = c - accept  # see the module docstring: no prefill bulk append
    for _ in range(2):  # capture both step graphs, use both replay events
        cache.begin_step(ring, c)
        cache.run()
        c += accept
    cache.synchronize()
    return cache, ring, c


def time_begin_step(cache, ring, committed: int, accept: int, warmup: int, steps: int,
                    profiler: cProfile.Profile | None = None) -> tuple[np.ndarray, int]:
    """(seconds per ``begin_step`` call, ``steps`` values; the next committed)."""
    out = np.empty(steps, np.float64)
    pc = time.perf_counter
    begin = cache.begin_step
    c = committed
    for i in range(warmup + steps):
        if profiler is not None and i == warmup:
            profiler.enable()
        t0 = pc()
        begin(ring, c)
        dt = pc() - t0
        cache.engine._next[0] = c  # what run() sets
        c += accept
        if i >= warmup:
            out[i - warmup] = dt
    if profiler is not None:
        profiler.disable()
    return out, c


def component_costs(cache, ring, committed: int, n: int = 20000) -> dict:
    """us per call of the pieces ``begin_step`` is made of (timed one by one
    on the same cache; no state changes)."""
    import timeit
    from dflash_cupy.nvtx_ranges import nvtx_range
    from dflash_cupy.ops.step_descriptor import DESC_LEN, decide_lanes, pack_descriptors
    g, sw = cache.geom, cache.config.swa_window
    plan = decide_lanes((committed,), (committed - 3,), (ring,), g, sw, single=True)
    buf = np.zeros(DESC_LEN, np.int32)
    ev = cache._events[0]

    def nvtx():
        with nvtx_range("dflash plan", "green"):
            pass

    parts = {"decide_lanes (one lane)": lambda: decide_lanes((committed,), (committed - 3,), (ring,), g, sw,
                                                              single=True),
             "pack_descriptors": lambda: pack_descriptors(buf, plan.vals),
             "nvtx_range enter+exit": nvtx,
             "event.synchronize (done)": ev.synchronize,
             "ring.holds": lambda: ring.holds(committed - 3, committed),
             "empty lambda (call overhead)": lambda: None}
    return {k: min(timeit.repeat(f, number=n, repeat=3)) / n * 1e6 for k, f in parts.items()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    be = backends.get(args.backend)
    out = Path(args.out) if args.out else common.default_out(be, "bench_host.json")
    cfg = common.drafter_config(args.drafter)
    weights = common.RandomDraftWeights(cfg, be, seed=args.seed)
    print(f"bench_host: backend={be.name} drafter={args.drafter} capacities={args.capacities} "
          f"steps={args.steps} accept={args.accept}", flush=True)
    rows = []
    prof_text = None
    for cap in args.capacities:
        t0 = time.perf_counter()
        profile = args.profile and cap == max(args.capacities)
        n = (args.warmup + args.steps) * (2 if profile else 1)
        cache, ring, c = steady_cache(be, weights, cap, args.accept, n, args.seed)
        setup_s = time.perf_counter() - t0
        try:
            s, c = time_begin_step(cache, ring, c, args.accept, args.warmup, args.steps)
            s = s * 1e6
            if profile:  # a second, profiled pass (cProfile inflates every call)
                prof = cProfile.Profile()
                time_begin_step(cache, ring, c, args.accept, args.warmup, args.steps, prof)
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
                prof_text = buf.getvalue()
                parts = component_costs(cache, ring, c)
                prof_text += "component costs (us per call, timeit, no profiler):\n" + "".join(
                    f"  {k:32s} {v:7.3f}\n" for k, v in parts.items())
        finally:
            cache.close()
            ring.close()
        row = {"capacity": cap, "median_us": float(np.median(s)), "min_us": float(s.min()),
               "p10_us": float(np.percentile(s, 10)), "p90_us": float(np.percentile(s, 90)),
               "p99_us": float(np.percentile(s, 99)), "mean_us": float(s.mean()), "steps": len(s),
               "setup_s": setup_s}
        rows.append(row)
        print(f"  capacity={cap:>6}: median {row['median_us']:6.2f} us  p10 {row['p10_us']:6.2f}  "
              f"p90 {row['p90_us']:6.2f}  p99 {row['p99_us']:7.2f}  (setup {setup_s:.1f} s)", flush=True)
    med = [r["median_us"] for r in rows]
    growth = max(med) / min(med)
    ok = all(m <= TARGET_US for m in med)
    result = {"bench": "host", "meta": common.meta(be, argv), "args": vars(args), "rows": rows,
              "growth_max_over_min": growth, "target_us": TARGET_US, "meets_target": ok,
              "host_us_per_step": {str(r["capacity"]): round(r["median_us"], 3) for r in rows}}
    if prof_text:
        result["profile"] = prof_text
    common.write_json(out, result)
    print(f"growth (max/min median): {growth:.2f}; target <= {TARGET_US} us: "
          f"{'met' if ok else 'MISSED'}; results: {out}")
    if prof_text:
        print(prof_text)
    if args.json:
        print(json.dumps({"host_us_per_step": result["host_us_per_step"]}))
    return result


if __name__ == "__main__":
    main()
