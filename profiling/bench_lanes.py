"""Measured cost per request of a lane-batched step (``DraftKvBatch``) against
the single-lane ``DraftKvCache`` step, side by side in one run.

For each ``--x-split`` setting one batch of ``max(--lanes)`` lanes is built
(random bf16 weights drawn on the device, each lane's bf16 feature ring
filled with random rows) and, for each active-lane count ``n`` of
``--lanes``, the first ``n`` lanes are prefilled to a full ``--window`` and
then stepped in steady state (each committing ``--accept`` tokens per step,
the other lanes idle: one graph replay per step). The single-lane cache of
the same drafter and window is timed the same way in the same run. Reported
per row: us per step, us per request (step / n), its ratio to the single
step (``vs_single``: 1/n would be perfect sharing) and, for the named
presets, the cost model's prediction of the same step
(``profiling.lanes_model``) and measured / predicted.

    python -m profiling.bench_lanes                      # qwen3-8b, 2K, lanes 1,4,16 (GPU)
    python -m profiling.bench_lanes --lanes 1,8,16 --x-split both
    python -m profiling.bench_lanes --smoke              # tiny drafter (CI, emulator)
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
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_batch import DraftKvBatch
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.nvtx_ranges import nvtx_range
from profiling import common, timer

RING_ALIGN = 256
TABLE = [("x_split", "x", ""), ("active", "lanes", "d"), ("us_per_step", "us/step", ".1f"),
         ("us_per_lane", "us/lane", ".1f"), ("single_us", "single us", ".1f"), ("vs_single", "vs single", ".3f"),
         ("predicted_us", "model us", ".0f"), ("measured_over_model", "meas/model", ".2f")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.bench_lanes", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p, json_default_name="bench_lanes.json")
    p.add_argument("--drafter", default=None, help="preset (default qwen3-8b; smoke: tiny)")
    p.add_argument("--window", default=None, help="each lane's window (default 2K; smoke: 24)")
    p.add_argument("--lanes", default=None, help="active lane counts (default 1,4,16; smoke: 1,3)")
    p.add_argument("--accept", type=int, default=6)
    p.add_argument("--x-split", default="split", choices=("split", "single", "both"))
    p.add_argument("--warmup", type=int, default=None, help="steps before timing (default 3)")
    p.add_argument("--repeats", type=int, default=None, help="timed samples (default 10)")
    p.add_argument("--inner", type=int, default=None, help="steps per sample (default 5)")
    p.add_argument("--budget-s", type=float, default=4.0, help="sampling budget per row")
    p.add_argument("--no-model", action="store_true", help="skip the cost model's prediction")
    a = p.parse_args(argv)
    a.drafter = a.drafter or ("tiny" if a.smoke else "qwen3-8b")
    a.window = common.int_list(a.window or ("24" if a.smoke else "2K"))[0]
    a.lanes = common.int_list(a.lanes or ("1,3" if a.smoke else "1,4,16"))
    if not a.lanes or min(a.lanes) < 1:
        p.error("--lanes: positive counts")
    a.warmup = 1 if a.smoke else 3 if a.warmup is None else a.warmup
    a.repeats = 2 if a.smoke else 10 if a.repeats is None else a.repeats
    a.inner = 1 if a.smoke else 5 if a.inner is None else a.inner
    a.splits = {"split": (True,), "single": (False,), "both": (True, False)}[a.x_split]
    return a


def _steps_needed(a) -> int:
    return a.warmup + a.repeats * a.inner + 4


def _ring_capacity(a) -> int:
    need = a.window + a.accept * (_steps_needed(a) + 1) + 1
    return -(-need // RING_ALIGN) * RING_ALIGN


def _predict(a, active: int, x_split: bool) -> float | None:
    if a.no_model or a.drafter == "tiny":
        return None
    from profiling import lanes_model
    from profiling.hw_params import get_gpu
    r = lanes_model.model_batch(a.drafter, a.window, active, get_gpu("H200"), accept=a.accept, x_split=x_split)
    return r["step_us"]


def time_single(be, cfg, weights, a, x_split: bool) -> float:
    """Seconds per steady-state step of one DraftKvCache at a full window."""
    ring = FeatureRing(_ring_capacity(a), cfg.n_captured, cfg.hidden_size, dtype="bf16", backend=be)
    cache = None
    try:
        common.fill_ring(ring, be, seed=a.seed + 1)
        cache = DraftKvCache(weights, a.window, backend=be, x_split=x_split)
        cache.set_noise_embed(np.zeros((cfg.q_len, cfg.hidden_size), np.float32))
        state = {"c": a.window}
        cache.begin_step(ring, a.window)
        cache.run()

        def step():
            state["c"] += a.accept
            cache.begin_step(ring, state["c"])
            cache.run()
        t = timer.measure(step, be, stream=be.current_stream(), warmup=a.warmup, repeats=a.repeats,
                          inner=a.inner, budget_s=a.budget_s)
        return t.median_s
    finally:
        if cache is not None:
            cache.close()
        ring.close()


def time_batch(be, cfg, weights, a, x_split: bool, log=print) -> list[dict]:
    L = max(a.lanes)
    cap = _ring_capacity(a) * (len(a.lanes) + 1)   # each lane count re-prefills further on
    batch = DraftKvBatch(weights, a.window, L, ring_capacity=cap, ring_dtype="bf16", backend=be, x_split=x_split)
    rows = []
    try:
        for i, r in enumerate(batch.rings):
            common.fill_ring(r, be, seed=a.seed + 10 + i)
        batch.set_noise_embed(np.zeros((L, cfg.q_len, cfg.hidden_size), np.float32))
        base = 0
        for n in a.lanes:
            base += a.window   # a fresh full window for every lane count (a jump: bulk appends)
            committed = [base] * n + [None] * (L - n)
            batch.begin_step(committed)
            batch.run()
            state = {"c": base}

            def step():
                state["c"] += a.accept
                batch.begin_step([state["c"]] * n + [None] * (L - n))
                batch.run()
            with nvtx_range(f"bench lanes {n} active of {L}", "orange"):
                t = timer.measure(step, be, stream=be.current_stream(), warmup=a.warmup, repeats=a.repeats,
                                  inner=a.inner, budget_s=a.budget_s)
            hs = be.to_numpy(batch.hidden_states)[:n]
            rows.append({"active": n, "lanes": L, "x_split": "split" if x_split else "single",
                         "us_per_step": t.median_s * 1e6, "us_per_lane": t.median_s * 1e6 / n,
                         "timing": t.as_dict(), "hidden_finite": bool(np.isfinite(hs).all()),
                         "captures": batch.captures})
            base = state["c"] + a.window
            log(f"  {rows[-1]['x_split']:>6} {n:>3} of {L} lanes: {rows[-1]['us_per_step']:10.1f} us/step "
                f"{rows[-1]['us_per_lane']:9.1f} us/lane")
    finally:
        batch.close()
    return rows


def main(argv=None) -> dict:
    a = parse_args(argv)
    be = backends.get(a.backend)
    out = Path(a.out) if a.out else common.default_out(be, "bench_lanes.json")
    print(f"bench_lanes: backend={be.name} drafter={a.drafter} window={a.window} lanes={a.lanes} "
          f"x_split={a.x_split} -> {out}", flush=True)
    result, _ = common.start_result("lanes", be, a, argv, "")
    cfg = common.drafter_config(a.drafter)
    t0 = time.perf_counter()
    weights = common.RandomDraftWeights(cfg, be, seed=a.seed)
    result["weight_bytes"] = int(weights.device(be).nbytes)
    print(f"{a.drafter}: weights drawn in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    try:
        for xs in a.splits:
            single_s = time_single(be, cfg, weights, a, xs)
            print(f"  single-lane DraftKvCache step (x_split={xs}): {single_s * 1e6:.1f} us", flush=True)
            for r in time_batch(be, cfg, weights, a, xs, log=lambda s: print(s, flush=True)):
                r["single_us"] = single_s * 1e6
                r["vs_single"] = r["us_per_lane"] / r["single_us"]
                pred = _predict(a, r["active"], xs)
                r["predicted_us"] = pred
                r["measured_over_model"] = None if pred is None else r["us_per_step"] / pred
                rows.append(r)
    finally:
        del weights
        common.free_device_memory(be)
    result["rows"] = rows
    common.write_json(out, result)
    print(common.format_table(rows, TABLE))
    print(f"results: {out}")
    return result


if __name__ == "__main__":
    main()
