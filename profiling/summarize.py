"""A short text summary of benchmark JSON files (what gpu_check.sh prints last).

    python -m profiling.summarize --dir OUTDIR [--host host.json]
    python -m profiling.summarize profiling/results/bench_step.json ...
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from profiling.common import format_table

STEP_TARGET = 1.15


def _load(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except Exception as e:
        print(f"{path}: unreadable ({type(e).__name__}: {e})")
        return None


def summarize_step(d: dict, title: str) -> str:
    rows = [r for r in d.get("rows", []) if "us_per_step" in r]
    lines = [f"== {title}: drafter step (copy {d['copy']['GBps']:.0f} GB/s; target graph <= "
             f"{STEP_TARGET}x floor, flat in window)"]
    by_key = {}
    for r in rows:
        by_key.setdefault((r["drafter"], r["window"]), {})[r["mode"]] = r
    table = []
    for (drafter, window), modes in sorted(by_key.items()):
        g = modes.get("graph", {})
        table.append({"drafter": drafter, "window": window, "MB": g.get("bytes_total", 0) / 1e6 or None,
                      "floor": g.get("floor_us"), "graph": g.get("us_per_step"),
                      "x": g.get("ratio_to_floor"), "eager": modes.get("eager", {}).get("us_per_step"),
                      "legacy": modes.get("legacy", {}).get("us_per_step"),
                      "ok": ("yes" if g.get("ratio_to_floor", 99) <= STEP_TARGET else "no") if g else None})
    lines.append(format_table(table, [("drafter", "drafter", ""), ("window", "window", "d"),
                                      ("MB", "MB/step", ".0f"), ("floor", "floor us", ".0f"),
                                      ("graph", "graph us", ".0f"), ("x", "x floor", ".2f"),
                                      ("ok", "<=1.15", ""), ("eager", "eager us", ".0f"),
                                      ("legacy", "legacy us", ".0f")]))
    for drafter, modes in d.get("summary", {}).items():
        g = modes.get("graph")
        if g and len(g["windows"]) > 1:
            lines.append(f"{drafter}: graph step grows x{g['growth_last_over_first']:.3f} from window "
                         f"{g['windows'][0]} to {g['windows'][-1]}")
    lines += summarize_kernels(d)
    bad = [r for r in rows if not r.get("hidden_finite", True)]
    if bad:
        lines.append(f"WARNING: non-finite hidden states in {len(bad)} rows")
    return "\n".join(lines)


def summarize_kernels(d: dict) -> list:
    """bench_step --kernel-times rows: each window's nodes summed beside its graph step, and
    (on a GPU) beside the cost model's per-kernel predictions (issue 12: within +-25%)."""
    lines = []
    device = d.get("meta", {}).get("device", {})
    for r in (r for r in d.get("rows", []) if r.get("mode") == "kernels"):
        head = (f"{r['drafter']} window {r['window']}: {r['n_nodes']} nodes, their own times sum to "
                f"{r['sum_us']:.1f} us")
        if "graph_us" in r:
            head += f" (graph step {r['graph_us']:.1f} us: {r['graph_minus_sum_us_per_node']:+.2f} us per node)"
        lines.append(head)
        if device.get("backend") != "cuda":
            lines.append(f"  ({r['method']})")
            continue
        try:
            from profiling import perf_model
            gpu = perf_model.get_gpu("H100" if "H100" in str(device.get("gpu", "")) else "H200")
            m = perf_model.model_step(r["drafter"], r["window"], gpu, accept=r.get("accept", 6))
        except Exception as e:   # the summary must not die on the model
            lines.append(f"  model unavailable: {type(e).__name__}: {e}")
            continue
        agree = perf_model.kernel_agreement(m, r["kernels_us"])
        ok = sum(1 for a in agree if abs(a[3] - 1) <= perf_model.KERNEL_TOLERANCE)
        lines.append(f"  per kernel vs the model ({gpu.name}): {ok} of {len(agree)} groups within "
                     f"+-{perf_model.KERNEL_TOLERANCE:.0%}")
        lines += [f"    {label:28s} measured {meas:8.1f} us  predicted {pred:8.1f} us  x{ratio:.2f}"
                  for label, pred, meas, ratio in agree]
    return lines


def summarize_gemm(d: dict) -> str:
    rows = [r for r in d.get("rows", []) if "us" in r]
    lines = [f"== GEMM ({d.get('drafter')}; copy {d['copy']['GBps']:.0f} GB/s)"]
    lines.append(format_table(rows, [("shape", "shape", ""), ("impl", "impl", ""), ("M", "M", "d"),
                                     ("us", "us", ".1f"), ("GBps", "GB/s", ".0f"),
                                     ("frac_of_copy_bw", "of copy", ".2f")]))
    errs = [r for r in d.get("rows", []) if "error" in r]
    lines += [f"  {r['shape']} {r['impl']}: {r['error']}" for r in errs]
    return "\n".join(lines)


def summarize_attention(d: dict) -> str:
    rows = [r for r in d.get("rows", []) if "us" in r]
    lines = [f"== ring attention ({d.get('drafter')}; copy {d['copy']['GBps']:.0f} GB/s)"]
    lines.append(format_table(rows, [("window", "window", "d"), ("impl", "impl", ""),
                                     ("n_splits", "splits", "d"), ("us", "us", ".1f"),
                                     ("GBps", "GB/s", ".0f"), ("frac_of_copy_bw", "of copy", ".2f")]))
    return "\n".join(lines)


def summarize_host(d: dict) -> str:
    return (f"== host: begin_step us per step {d.get('host_us_per_step')} on {d['meta']['device']['backend']}"
            f" (growth x{d.get('growth_max_over_min', 0):.2f}; target <= {d.get('target_us')} us: "
            f"{'met' if d.get('meets_target') else 'MISSED'})")


def summarize_file(path: Path) -> str:
    d = _load(path)
    if d is None:
        return ""
    kind = d.get("bench")
    if kind == "step":
        return summarize_step(d, Path(path).name)
    if kind == "gemm":
        return summarize_gemm(d)
    if kind == "attention":
        return summarize_attention(d)
    if kind == "host":
        return summarize_host(d)
    return f"{path}: unknown bench {kind!r}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiling.summarize", description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="*", help="result JSON files")
    p.add_argument("--dir", help="a gpu_check.sh OUTDIR: its *.json in a fixed order")
    p.add_argument("--host", help="bench_host JSON kept outside the directory")
    a = p.parse_args(argv)
    files = [Path(f) for f in a.files]
    if a.dir:
        order = ["step_quick.json", "step.json", "gemm.json", "attention.json", "host.json"]
        files += [Path(a.dir) / n for n in order if (Path(a.dir) / n).is_file()]
    if a.host and Path(a.host).is_file():
        files.append(Path(a.host))
    if not files:
        print("summarize: no result files found")
        return 1
    for f in files:
        text = summarize_file(f)
        if text:
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
