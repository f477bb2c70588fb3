"""Drafter step time against the window, three ways side by side:

* ``graph``: the ring cache, each step ``begin_step`` + ``run()`` (one graph replay);
* ``eager``: the same steps with ``run(eager=True)`` (every kernel launched from Python);
* ``legacy``: recompute the whole window every step with the same kernels,
  implemented as ``reset()`` before every ``begin_step``: the whole window
  ``[committed - window, committed)`` is then bulk-appended (chunks of
  ``--bulk-chunk`` rows through the same fc / k,v / RoPE kernels) before the
  step's graph replays. Skipped above ``--legacy-max-window`` (it costs
  ~window x the append stage).

Steady state: the window is full (``committed >= window``), each step
commits ``--accept`` new tokens (an in-graph append of that many rows; the
append stage always runs ``a_step`` rows, padding to the trash slot).
Random bf16 weights are drawn on the device (``common.RandomDraftWeights``);
feature rows come from a bf16 ``FeatureRing`` filled once with random rows.

Reported per (drafter, window, mode): us per step (median of samples of
``--inner`` steps, CUDA events on a GPU), compulsory bytes per step by
category (``step_model``), achieved GB/s, and the ratio to the floor
bytes / copy bandwidth (a device-to-device copy measured in the same run).
Writes JSON (``--out``) after every window and a PNG plot of latency
against window (``--plot``; skipped with a message without matplotlib).

    python -m profiling.bench_step                    # both drafters, all windows (GPU)
    python -m profiling.bench_step --drafters qwen3.5-27b --windows 256,4K,32K
    python -m profiling.bench_step --smoke            # tiny drafter (CI, emulator)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from dflash_cupy import backends
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.nvtx_ranges import nvtx_range
from profiling import common, kernel_times, step_model, timer

MODES = ("graph", "eager", "legacy")
DEFAULT_WINDOWS = "256,1K,2K,4K,8K,16K,32K"
RING_ALIGN = 1024
RING_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.bench_step", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p, json_default_name="bench_step.json")
    p.add_argument("--drafters", default=None,
                   help=f"comma-separated presets from {list(common.DRAFTERS)} "
                        "(default qwen3.5-27b,h4096; smoke: tiny)")
    p.add_argument("--windows", default=None, help=f"default {DEFAULT_WINDOWS} (smoke: 32,64)")
    p.add_argument("--modes", default=",".join(MODES), help="subset of graph,eager,legacy")
    p.add_argument("--legacy-max-window", type=int, default=4096,
                   help="skip the legacy mode above this window (default 4096)")
    p.add_argument("--warmup", type=int, default=None, help="steps before timing (default 5)")
    p.add_argument("--repeats", type=int, default=None, help="timed samples (default 15)")
    p.add_argument("--inner", type=int, default=None, help="steps per sample (default 10)")
    p.add_argument("--legacy-repeats", type=int, default=None, help="legacy samples (default 5)")
    p.add_argument("--budget-s", type=float, default=8.0,
                   help="stop sampling a (window, mode) after this many seconds (min 3 samples)")
    p.add_argument("--accept", type=int, default=6, help="tokens committed per step (default 6)")
    p.add_argument("--lm-head", type=int, default=0, metavar="VOCAB",
                   help="add a random bf16 LM head of this vocabulary (default: none)")
    p.add_argument("--ring-dtype", default="bf16", choices=sorted(RING_ITEMSIZE))
    p.add_argument("--bulk-chunk", type=int, default=256, help="DraftKvCache bulk_chunk (legacy path)")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--kernel-times", type=int, default=0, metavar="N",
                   help="also time every node of the step (profiling/kernel_times.py: the eager step "
                        "behind a hold, an event per node), median of N steps: a 'kernels' row per "
                        "window that perf_model compares with its per-kernel predictions (default 0: off)")
    p.add_argument("--merge", default=None, metavar="JSON",
                   help="an earlier bench_step JSON: (drafter, window) pairs it has timed are taken "
                        "from it instead of measured again (gpu_check's full sweep reuses its quick run)")
    a = p.parse_args(argv)
    smoke = a.smoke
    a.drafters = common.str_list(a.drafters or ("tiny" if smoke else "qwen3.5-27b,h4096"))
    for d in a.drafters:
        common.drafter_config(d)  # validates the name
    a.windows = common.int_list(a.windows or ("32,64" if smoke else DEFAULT_WINDOWS))
    a.modes = common.str_list(a.modes)
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {MODES}")
    a.warmup = a.warmup if a.warmup is not None else (3 if smoke else 5)
    a.repeats = a.repeats if a.repeats is not None else (3 if smoke else 15)
    a.inner = a.inner if a.inner is not None else (2 if smoke else 10)
    a.legacy_repeats = a.legacy_repeats if a.legacy_repeats is not None else (2 if smoke else 5)
    if a.accept < 1:
        p.error("--accept must be >= 1")
    if a.kernel_times < 0:
        p.error("--kernel-times must be >= 0")
    return a


def _runs(args, window: int):
    """(mode, warmup, repeats, inner) per mode that runs at this window."""
    out = []
    for m in args.modes:
        if m == "legacy":
            if window > args.legacy_max_window:
                continue
            out.append((m, 1, args.legacy_repeats, 1))
        else:
            out.append((m, args.warmup, args.repeats, args.inner))
    return out


def bench_window(be, name, cfg, weights, lm_head, window, args, bw_Bps, log=print) -> list[dict]:
    runs = _runs(args, window)
    max_steps = sum(w + r * i for _, w, r, i in runs) + 2
    if args.kernel_times:   # one unmeasured step, then up to HOLD_TRIES per measured one
        max_steps += 1 + kernel_times.HOLD_TRIES * args.kernel_times
    ring_cap = -(-(window + args.accept * max_steps + 1) // RING_ALIGN) * RING_ALIGN
    ring = FeatureRing(ring_cap, cfg.n_captured, cfg.hidden_size, dtype=args.ring_dtype, backend=be)
    cache = None
    rows = []
    try:
        common.fill_ring(ring, be, seed=args.seed + window)
        cache = DraftKvCache(weights, window, lm_head=lm_head, backend=be, bulk_chunk=args.bulk_chunk)
        noise = np.random.default_rng(args.seed + 7).standard_normal(
            (cfg.q_len, cfg.hidden_size)).astype(np.float32)
        cache.set_noise_embed(noise)
        state = {"committed": window}
        t0 = time.perf_counter()
        cache.begin_step(ring, window)  # prefill: bulk-append the whole window once
        cache.run()
        cache.synchronize()
        prefill_s = time.perf_counter() - t0
        itemsize = RING_ITEMSIZE[ring.kind]

        def advance():
            c = state["committed"] + args.accept
            if c > ring.hi:
                raise RuntimeError(f"bench_step: ring margin exhausted (committed {c} > ring.hi {ring.hi})")
            state["committed"] = c
            return c

        def step_graph():
            cache.begin_step(ring, advance())
            cache.run()

        def step_eager():
            cache.begin_step(ring, advance())
            cache.run(eager=True)

        def step_legacy():
            c = advance()
            cache.reset()
            cache.begin_step(ring, c)
            cache.run()

        fns = {"graph": step_graph, "eager": step_eager, "legacy": step_legacy}
        for mode, warmup, repeats, inner in runs:
            with nvtx_range(f"bench {name} window={window} {mode}", "orange"):
                t = timer.measure(fns[mode], be, stream=be.current_stream(), warmup=warmup, repeats=repeats,
                                  inner=inner, budget_s=args.budget_s)
            hidden = be.to_numpy(cache.hidden_states)
            by = (step_model.legacy_bytes(cache, window, itemsize) if mode == "legacy"
                  else step_model.step_bytes(cache, min(args.accept, cache.a_step), itemsize))
            med = t.median_s
            floor_s = by["total"] / bw_Bps
            row = {"drafter": name, "window": window, "mode": mode, "capacity": cache.capacity,
                   "kv_total": cache.kv_total, "accept": args.accept,
                   "us_per_step": med * 1e6, "timing": t.as_dict(), "bytes": by,
                   "bytes_total": by["total"], "GBps": by["total"] / med / 1e9,
                   "floor_us": floor_s * 1e6, "ratio_to_floor": med / floor_s,
                   "prefill_s": prefill_s, "hidden_finite": bool(np.isfinite(hidden).all())}
            rows.append(row)
            log(f"  {name:>12} window={window:>6} {mode:>6}: {med * 1e6:10.1f} us/step  "
                f"{row['GBps']:8.1f} GB/s  floor {row['floor_us']:9.1f} us  "
                f"x{row['ratio_to_floor']:.2f}  ({t.as_dict()['samples']} x {inner} steps)")
        if args.kernel_times:
            rows.append(_kernel_row(cache, ring, advance, name, window, args.kernel_times, args.accept, rows, log))
        for m in args.modes:
            if m == "legacy" and window > args.legacy_max_window:
                rows.append({"drafter": name, "window": window, "mode": "legacy",
                             "skipped": f"window > --legacy-max-window {args.legacy_max_window}"})
    finally:
        if cache is not None:
            cache.close()
        ring.close()
        del cache, ring
        common.free_device_memory(be)
    return rows


def _kernel_row(cache, ring, advance, name, window, repeats, accept, rows, log) -> dict:
    """Every node of the step timed (``kernel_times``), beside this window's graph step."""
    with nvtx_range(f"bench {name} window={window} kernels", "orange"):
        t = kernel_times.step_kernel_times(cache, ring, advance, repeats=repeats)
    row = {"drafter": name, "window": window, "mode": "kernels", "accept": accept, "n_nodes": len(t.labels),
           **t.as_dict()}
    graph = next((r for r in rows if r.get("mode") == "graph"), None)
    msg = f"  {name:>12} window={window:>6} kernels: {t.total_us:10.1f} us over {len(t.labels)} nodes"
    if graph is not None:
        row["graph_us"] = graph["us_per_step"]
        row["graph_minus_sum_us_per_node"] = (graph["us_per_step"] - t.total_us) / len(t.labels)
        msg += (f" (graph step {graph['us_per_step']:.1f} us: {row['graph_minus_sum_us_per_node']:+.2f} us "
                f"per node beyond the nodes' own times)")
    log(msg)
    for label, us in sorted(t.by_label().items(), key=lambda kv: -kv[1]):
        log(f"  {'':12} {'':13} {label:28s} {us:9.1f} us")
    return row


def _merge_rows(path) -> dict:
    """(drafter, window) -> rows of an earlier run that timed that pair."""
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        print(f"--merge {path}: no such file; measuring everything", flush=True)
        return {}
    try:
        rows = json.loads(p.read_text()).get("rows", [])
    except Exception as e:
        print(f"--merge {path}: unreadable ({type(e).__name__}: {e}); measuring everything", flush=True)
        return {}
    out = {}
    for r in rows:
        out.setdefault((r.get("drafter"), r.get("window")), []).append(r)
    return {k: v for k, v in out.items() if any("us_per_step" in r for r in v)}


def plot(result: dict, path: Path, log=print) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        log(f"plot skipped: matplotlib is not importable ({type(e).__name__}: {e})")
        return None
    rows = [r for r in result["rows"] if "us_per_step" in r]
    if not rows:
        log("plot skipped: no timed rows")
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"graph": "-o", "eager": "--s", "legacy": ":^"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for di, name in enumerate(dict.fromkeys(r["drafter"] for r in rows)):
        col = colors[di % len(colors)]
        for mode in MODES:
            rs = sorted((r for r in rows if r["drafter"] == name and r["mode"] == mode),
                        key=lambda r: r["window"])
            if rs:
                ax.plot([r["window"] for r in rs], [r["us_per_step"] for r in rs], styles[mode],
                        color=col, label=f"{name} {mode}")
        fl = sorted((r for r in rows if r["drafter"] == name and r["mode"] == "graph"),
                    key=lambda r: r["window"])
        if fl:
            ax.plot([r["window"] for r in fl], [r["floor_us"] for r in fl], "-", color=col, alpha=0.35,
                    linewidth=4, label=f"{name} floor (bytes / copy bw)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("window (context rows)")
    ax.set_ylabel("us per drafter step")
    dev = result["meta"]["device"]
    ax.set_title(f"drafter step vs window ({dev.get('gpu', dev['backend'])}, "
                 f"copy {result['copy']['GBps']:.0f} GB/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"plot written: {path}")
    return path


def summarize(rows: list[dict]) -> dict:
    """Per drafter and mode: growth of step time from the smallest to the largest window."""
    out = {}
    for r in rows:
        if "us_per_step" not in r:
            continue
        out.setdefault(r["drafter"], {}).setdefault(r["mode"], []).append(
            (r["window"], r["us_per_step"], r["ratio_to_floor"]))
    summary = {}
    for d, modes in out.items():
        for m, pts in modes.items():
            pts.sort()
            summary.setdefault(d, {})[m] = {
                "windows": [p[0] for p in pts], "us_per_step": [p[1] for p in pts],
                "ratio_to_floor": [p[2] for p in pts],
                "growth_last_over_first": pts[-1][1] / pts[0][1]}
    return summary


TABLE = [("drafter", "drafter", ""), ("window", "window", "d"), ("mode", "mode", ""),
         ("us_per_step", "us/step", ".1f"), ("GBps", "GB/s", ".0f"), ("floor_us", "floor us", ".1f"),
         ("ratio_to_floor", "x floor", ".2f"), ("bytes_MB", "MB/step", ".1f")]


def main(argv=None) -> dict:
    args = parse_args(argv)
    be = backends.get(args.backend)
    out = Path(args.out) if args.out else common.default_out(be, "bench_step.json")
    print(f"bench_step: backend={be.name} drafters={args.drafters} windows={args.windows} "
          f"modes={args.modes} -> {out}", flush=True)
    result, bw = common.start_result("step", be, args, argv, "")
    result.update({"drafters": {}, "rows": []})
    merged = _merge_rows(args.merge)
    for name in args.drafters:
        cfg = common.drafter_config(name)
        todo = []
        for window in args.windows:
            old = merged.get((name, window))
            if old:
                result["rows"].extend(dict(r, merged_from=str(args.merge)) for r in old)
                print(f"{name} window={window}: taken from {args.merge}", flush=True)
            else:
                todo.append(window)
        if not todo:
            continue
        t0 = time.perf_counter()
        weights = common.RandomDraftWeights(cfg, be, seed=args.seed)
        lm_head = (common.random_bf16(be, (args.lm_head, cfg.hidden_size),
                                      scale=cfg.hidden_size ** -0.5, seed=args.seed + 99)
                   if args.lm_head else None)
        result["drafters"][name] = {"config": common.config_summary(cfg), "weight_bytes": weights.nbytes,
                                    "lm_head_vocab": args.lm_head, "setup_s": time.perf_counter() - t0}
        print(f"{name}: {weights} (drawn in {time.perf_counter() - t0:.1f} s)", flush=True)
        try:
            for window in todo:
                rows = bench_window(be, name, cfg, weights, lm_head, window, args, bw,
                                    log=lambda s: print(s, flush=True))
                result["rows"].extend(rows)
                result["summary"] = summarize(result["rows"])
                common.write_json(out, result)
        finally:
            del weights, lm_head
            common.free_device_memory(be)
    result["summary"] = summarize(result["rows"])
    common.write_json(out, result)
    if not args.no_plot:
        plot(result, Path(args.plot) if args.plot else out.with_suffix(".png"))
    timed = [dict(r, bytes_MB=r["bytes_total"] / 1e6) for r in result["rows"] if "us_per_step" in r]
    print(common.format_table(timed, TABLE))
    print(f"results: {out}")
    return result


if __name__ == "__main__":
    main()
