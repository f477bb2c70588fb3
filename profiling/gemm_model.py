"""Predicted bandwidth of each drafter GEMM alone at M = 16, 32, 64 rows
(issue 12's "GEMMs at M = 16, 32, 64 predicted >= 85% of HBM bandwidth"),
with the hi + lo activation split and with one rounding (``x_split``).

Each GEMM is launched exactly as the product plans it (``ops.gemm.Gemm`` on
the recording backend: the same variant, split K and grid) and timed by
``perf_model.time_nodes`` from its static counters; the percentage is the
weight bytes over that time against the achievable HBM rate
(``hw_params.GPU.hbm_Bps``).

    python -m profiling.gemm_model --drafter qwen3-8b,h5120
    python -m profiling.gemm_model --json

Timed by the source model (``compiled=False``, the max of the source-intended bounds):
its HBM fractions are what the source intends, not what ptxas made (``perf_model`` reads
the SASS).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ml_dtypes
import numpy as np

from dflash_cupy.ops.gemm import Gemm
from profiling import counters as ctr
from profiling.common import drafter_config, int_list, str_list
from profiling.hw_params import get_gpu
from profiling.step_trace import RecordingBackend
from profiling.perf_model import resolve_drafter, time_nodes

GOAL = 0.85


def drafter_gemms(cfg) -> list:
    """(name, N, K, epilogue) of one layer's GEMMs and the feature fusion."""
    H = cfg.hidden_size
    return [("qkv", cfg.q_dim + 2 * cfg.kv_dim, H, "none"), ("o", H, cfg.q_dim, "residual"),
            ("gate_up", cfg.intermediate_size, H, "silu_mul"), ("down", H, cfg.intermediate_size, "residual"),
            ("fc", H, cfg.fc_in, "none")]


def gemm_row(name, N, K, epilogue, m, x_split, gpu, config=None) -> dict:
    """One GEMM's predicted time and share of HBM bandwidth, as the product plans it
    (``config``: a launch configuration of ``Gemm.launch_candidates`` instead)."""
    be = RecordingBackend()
    g = Gemm(be, N, K, ml_dtypes.bfloat16, epilogue, max_m=max(64, m), x_split=x_split)
    if config is not None:
        g.use_config(m, config)
    x, y = be.empty((m, K), np.float32), be.empty((m, N), np.float32)
    w = be.empty((g.w_rows, K), np.uint16)
    n0 = len(be.eager)
    g(x, w, y, m, residual=y if epilogue == "residual" else None)
    times = time_nodes(be.eager[n0:], gpu, ctr.static_counters, compiled=False)
    us = sum(t.predicted_us for t in times)
    frac = w.nbytes / (us * 1e-6) / gpu.hbm_Bps
    return {"gemm": name, "N": N, "K": K, "m": m, "x_split": x_split, "us": us,
            "weight_MB": w.nbytes / 1e6, "frac_hbm": frac, "bound": times[0].bound, "config": g.config(m),
            "meets_goal": frac >= GOAL}


def model(drafter: str, ms=(16, 32, 64), gpu_name: str = "H200") -> list:
    gpu = get_gpu(gpu_name)
    cfg = drafter_config(resolve_drafter(drafter))
    return [dict(gemm_row(n, N, K, e, m, xs, gpu), drafter=drafter)
            for xs in (True, False) for m in ms for n, N, K, e in drafter_gemms(cfg)]


def format_table(rows: list) -> str:
    out = [f"{'drafter':>10} {'x':>6} {'m':>3} " + " ".join(f"{r['gemm']:>16}" for r in rows[:5])]
    for i in range(0, len(rows), 5):
        grp = rows[i:i + 5]
        r0 = grp[0]
        cells = " ".join(f"{r['frac_hbm'] * 100:5.0f}% {r['us']:6.1f}us{'' if r['meets_goal'] else '*'}"
                         .rjust(16) for r in grp)
        out.append(f"{r0['drafter']:>10} {'split' if r0['x_split'] else 'single':>6} {r0['m']:>3} {cells}")
    out.append(f"(% of achievable HBM bandwidth, the weight bytes over the predicted time; * below {GOAL:.0%})")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiling.gemm_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="qwen3-8b,h5120")
    p.add_argument("--ms", default="16,32,64")
    p.add_argument("--gpu", default="H200")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = [r for d in str_list(a.drafter) for r in model(d, tuple(int_list(a.ms)), a.gpu)]
    if a.json:
        json.dump({"goal": GOAL, "rows": rows}, sys.stdout, indent=1, default=str)
        print()
    else:
        for d in str_list(a.drafter):
            print(format_table([r for r in rows if r["drafter"] == d]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
