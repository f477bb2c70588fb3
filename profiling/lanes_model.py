"""Cost model of a lane-batched step (``DraftKvBatch``): step time and cost per
request at 1, 4, 16, 64 active lanes, against the single-lane step.

    python -m profiling.lanes_model --drafter qwen3-8b --window 2K --lanes 1,4,16,64
    python -m profiling.lanes_model --json

The batch's step graph is recorded at real shapes exactly as the product
captures it (``step_trace.RecordingBackend``: the batch's own launchers pick
every grid), with ``active`` lanes each appending ``--accept`` rows and the
rest idle; each launch is timed by ``perf_model.kernel_time`` from its
counters (the GEMMs' dead row tiles, known from the plan, are skipped as the
kernel skips them). ``per_lane_us = step_us / active`` is what one request
pays; ``vs_single`` is that over the single-lane ``DraftKvCache`` step of the
same drafter and window (``perf_model.model_step``): 1/16 would be perfect
sharing at 16 lanes. The floor of a batch step: the weights once plus each
active lane's own compulsory bytes (its K/V window, masks, features,
activations), at the achievable HBM bandwidth.

Timed by the source model (``compiled=False``: the max of the source-intended bounds);
moving the lanes model to the compiled phases (``perf_model --model compiled``) is open.

The attention's split count follows the batch's lane capacity
(``ops/attention.py``: ``default_splits`` counts every lane's kv heads, down
to a floor of ``n_tiles // BATCH_TILES_PER_SPLIT``), and its counters assume
every lane live: with ``active < lanes`` the attention row is the full
batch's, not what the idle lanes' early exit leaves (see the table above
``BATCH_TILES_PER_SPLIT`` for one live lane at each capacity).

The model knows what ``perf_model`` knows (see profiling/README.md); at many
lanes the GEMMs leave the weight stream and become bound by shared-memory
reads of the activations and by MMA issue, which is where the per-lane cost
stops falling.
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

from profiling import counters as ctr
from profiling.common import drafter_config, int_list
from profiling.hw_params import get_gpu
from profiling.step_trace import RecordingBackend, ShapeOnlyWeights, _rename, mark_live_tiles, name_arrays
from profiling.perf_model import model_step, resolve_drafter, time_nodes


def trace_batch_step(config, window: int, lanes: int, active: int, *, accept: int = 6,
                    lm_head_vocab: int | None = None, x_split: bool = True, pdl: bool = False):
    """(batch, graph nodes) of a steady-state batch step: ``active`` lanes (the
    first ones) each committing ``accept`` more rows at a full ``window`` (``pdl``: the
    batch's ``pdl=True`` graph, its launches after a launch marked ``.pdl``)."""
    from dflash_cupy.kv_batch import DraftKvBatch

    if not 0 <= active <= lanes:
        raise ValueError(f"active={active} must be in [0, lanes={lanes}]")
    be = RecordingBackend()
    w = ShapeOnlyWeights(config, be, np.uint16)
    lm = be.empty((int(lm_head_vocab), config.hidden_size), np.uint16) if lm_head_vocab else None
    # feature rings of at most 1024 rows (a step reads only the rows it appends: the same
    # launches), so 64 lanes at a 32K window fit in this machine's address space
    b = DraftKvBatch(w, int(window), lanes, ring_capacity=min(int(window), 1024), ring_dtype=ml_dtypes.bfloat16,
                     backend=be, lm_head=lm, logits=False, x_split=x_split, pdl=pdl)
    for r in b.rings:   # the rings "hold" every position the plans read; rows never looked at
        r.hi = int(window) + 2 * accept
        r.lo = max(0, r.hi - r.capacity)
    b.next_pos = [int(window)] * lanes
    for c in (int(window) + accept // 2, int(window) + accept):   # both step graphs captured
        b.begin_step([c] * active + [None] * (lanes - active))
        b.run()
    b.next_pos = [int(window)] * lanes
    b.begin_step([int(window) + accept] * active + [None] * (lanes - active))
    b.run()
    nodes = b._graphs[b._slot].nodes
    mark_live_tiles(b, nodes, active, accept)
    _rename(nodes, name_arrays(b))
    return b, nodes


def floor_bytes(single_bytes: dict, active: int) -> int:
    """Weights (and lm_head) once, everything else once per active lane."""
    shared = single_bytes["weights"] + single_bytes["lm_head"]
    return shared + active * (single_bytes["total"] - shared)


def model_batch(drafter: str, window: int, active: int, gpu, *, lanes: int | None = None, accept: int = 6,
                lm_head_vocab: int | None = None, single: dict | None = None, x_split: bool = True,
                pdl: bool = False) -> dict:
    """One batch step's prediction (``pdl``: programmatic edges cost ``gpu.pdl_gap_s``, a
    labelled guess, as in ``perf_model --pdl``; the single-lane reference step is modelled
    the same way unless ``single`` is given)."""
    name = resolve_drafter(drafter)
    cfg = drafter_config(name)
    lanes = active if lanes is None else lanes
    b, nodes = trace_batch_step(cfg, window, lanes, active, accept=accept, lm_head_vocab=lm_head_vocab,
                               x_split=x_split, pdl=pdl)
    times = time_nodes(nodes, gpu, ctr.static_counters, compiled=False)
    n_pdl = sum(1 for n in nodes if getattr(n, "pdl", False))
    gap_us = (gpu.node_gap_s * (len(nodes) - n_pdl) + gpu.pdl_gap_s * n_pdl) * 1e6
    step_us = sum(t.predicted_us for t in times) + gap_us
    single = single or model_step(drafter, window, gpu, accept=accept, lm_head_vocab=lm_head_vocab, pdl=pdl,
                                  compiled=False)
    fb = floor_bytes(single["bytes"], active)
    floor_us = fb / gpu.hbm_Bps * 1e6
    by_bound: dict = {}
    for t in times:
        by_bound[t.bound] = by_bound.get(t.bound, 0.0) + t.predicted_us
    gemm_us = sum(t.predicted_us for t in times if t.kernel.startswith("gemm"))
    attn_us = sum(t.predicted_us for t in times if "attn" in t.kernel)
    return {"drafter": drafter, "preset": name, "window": window, "lanes": lanes, "active": active,
            "x_split": bool(x_split),
            "gpu": gpu.name, "n_nodes": len(nodes), "n_pdl_edges": n_pdl, "step_us": step_us, "gaps_us": gap_us,
            "gemm_us": gemm_us, "attention_us": attn_us,
            "per_lane_us": step_us / max(active, 1), "single_step_us": single["step_us"],
            "vs_single": step_us / max(active, 1) / single["step_us"],
            "floor_us": floor_us, "ratio": step_us / floor_us, "time_by_bound_us": by_bound}


def format_table(rows: list) -> str:
    r0 = rows[0]
    out = [f"{r0['preset']} window {r0['window']} on {r0['gpu']}: single-lane DraftKvCache step "
           f"{r0['single_step_us']:.0f} us",
           f"{'x':>6} {'lanes':>5} {'nodes':>5} {'step us':>8} {'gemm us':>8} {'attn us':>8} {'floor us':>8} "
           f"{'x floor':>7} {'us/lane':>8} {'vs single':>9}  bound (us)"]
    for r in rows:
        bounds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["time_by_bound_us"].items(), key=lambda kv: -kv[1]))
        out.append(f"{'split' if r['x_split'] else 'single':>6} {r['active']:>5} {r['n_nodes']:>5} {r['step_us']:>8.0f} {r['gemm_us']:>8.0f} "
                   f"{r['attention_us']:>8.0f} {r['floor_us']:>8.0f} {r['ratio']:>7.2f} {r['per_lane_us']:>8.1f} "
                   f"{r['vs_single']:>9.3f}  {bounds}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiling.lanes_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="qwen3-8b")
    p.add_argument("--window", default="2K", help="each lane's window (K suffix allowed)")
    p.add_argument("--lanes", default="1,4,16,64", help="active lane counts, comma-separated")
    p.add_argument("--gpu", default="H200")
    p.add_argument("--accept", type=int, default=6)
    p.add_argument("--lm-head", type=int, default=None, metavar="VOCAB")
    p.add_argument("--x-split", default="split", choices=("split", "single", "both"),
                   help="the batch's activation rounding (DraftKvBatch x_split): hi + lo (default), one "
                        "rounding, or both side by side; the single-lane reference step is always the default")
    p.add_argument("--pdl", action="store_true",
                   help="model the pdl=True graphs (batch and single-lane reference): programmatic edges "
                        "cost pdl_gap_s, a labelled guess")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    gpu = get_gpu(a.gpu)
    window = int_list(a.window)[0]
    single = model_step(a.drafter, window, gpu, accept=a.accept, lm_head_vocab=a.lm_head, pdl=a.pdl,
                        compiled=False)
    splits = {"split": (True,), "single": (False,), "both": (True, False)}[a.x_split]
    rows = [model_batch(a.drafter, window, n, gpu, accept=a.accept, lm_head_vocab=a.lm_head, single=single,
                        x_split=xs, pdl=a.pdl)
            for xs in splits for n in int_list(a.lanes)]
    if a.json:
        json.dump({"rows": rows}, sys.stdout, indent=1, default=float)
        print()
    else:
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
