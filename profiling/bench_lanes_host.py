"""Host time of ``DraftKvBatch.begin_step`` per step against the lane count.

``begin_step`` of a batch validates and plans every lane and writes one
descriptor row per lane into pinned memory (host O(lanes)); the target is
``<= 10 us + 0.5 us per lane``. Steady state per lane count: a tiny drafter,
every lane active with a full window and ``--accept`` rows appended in the
graph; both step graphs captured and replayed once, then ``begin_step`` timed
alone (``next_pos`` advanced as ``run()`` would, without replaying: on the
emulator a replay executes the step on the CPU). Medians of ``--steps``.

    python -m profiling.bench_lanes_host --lanes 1,4,8,16,64
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from dflash_cupy import backends
from dflash_cupy.kv_batch import DraftKvBatch
from profiling import common


def target_us(lanes: int) -> float:
    return 10.0 + 0.5 * lanes


def steady_batch(be, weights, lanes: int, capacity: int, accept: int):
    """(batch, committed) ready for in-graph steps of every lane with a full window: both
    step graphs captured and replayed once."""
    b = DraftKvBatch(weights, capacity, lanes, backend=be)
    for r in b.rings:   # rows are never read by the host path: claim every position
        r.lo, r.hi = 0, 2**30
    c = capacity
    b.engine._next[:] = [c - accept] * lanes
    for _ in range(2):
        b.begin_step([c] * lanes)
        b.run()
        c += accept
    b.synchronize()
    return b, c


def time_lanes(be, weights, lanes: int, capacity: int, accept: int, warmup: int, steps: int) -> np.ndarray:
    b, c = steady_batch(be, weights, lanes, capacity, accept)
    try:
        out = np.empty(steps)
        pc = time.perf_counter
        for i in range(warmup + steps):
            cs = [c] * lanes
            t0 = pc()
            b.begin_step(cs)
            dt = pc() - t0
            b.engine._next[:] = cs   # what run() sets
            b.engine._planned = False
            c += accept
            if i >= warmup:
                out[i - warmup] = dt * 1e6
        return out
    finally:
        b.close()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m profiling.bench_lanes_host", description=__doc__.split("\n")[0])
    common.add_common_args(p, json_default_name="bench_lanes_host.json")
    p.set_defaults(backend="emulated")
    p.add_argument("--lanes", default="1,4,8,16,64")
    p.add_argument("--capacity", type=int, default=256)
    p.add_argument("--accept", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="default 1000 (smoke: 100)")
    a = p.parse_args(argv)
    be = backends.get(a.backend)
    weights = common.RandomDraftWeights(common.drafter_config("tiny"), be, seed=a.seed)
    steps = a.steps or (100 if a.smoke else 1000)
    rows = []
    for n in common.int_list(a.lanes):
        s = time_lanes(be, weights, n, a.capacity, a.accept, steps // 10, steps)
        row = {"lanes": n, "median_us": float(np.median(s)), "p90_us": float(np.percentile(s, 90)),
               "target_us": target_us(n)}
        row["meets_target"] = row["median_us"] <= row["target_us"]
        rows.append(row)
        print(f"  lanes={n:>3}: median {row['median_us']:7.2f} us  p90 {row['p90_us']:7.2f}  target "
              f"{row['target_us']:.1f}  {'met' if row['meets_target'] else 'MISSED'}", flush=True)
    out = Path(a.out) if a.out else common.default_out(be, "bench_lanes_host.json")
    result = {"bench": "lanes_host", "meta": common.meta(be, argv), "rows": rows}
    common.write_json(out, result)
    print(f"results: {out}")
    return result


if __name__ == "__main__":
    main()
