"""Fit the cost model's estimated GPU parameters to a GPU run's per-kernel times.

    python -m profiling.calibrate profiling/results/<run>/step_quick.json [step.json ...]
    python -m profiling.calibrate RUN.json --write profiling/results/calibration.json

Reads ``bench_step`` results of a CUDA run (``gpu_check.sh``: ``--kernel-times``
rows, every node's own time, and the graph step of the same window), models each
measured (drafter, window) with the current parameters (``perf_model.model_step``)
and fits the three that are estimates and that those rows determine:

* ``hbm_Bps``: the achievable HBM bandwidth, from the GEMM groups the model holds
  HBM-bound (the qkv GEMM aside: its epilogue): their counted DRAM bytes over their
  measured time, all windows together;
* ``node_gap_s``: the graph step minus the sum of its nodes' own times, per node
  (the median over windows; graphs without PDL, as ``gpu_check`` measures them);
* ``rope_round_clocks``: the qkv GEMM's measured time beyond its HBM time at the
  fitted bandwidth, over the epilogue rounds the counters give it, in SM clocks.

Prints each group's measured / predicted before and after, and with ``--write``
merges the fit into a calibration file (``hw_params.get_gpu`` reads
``profiling/results/calibration.json`` by default), so ``perf_model`` predicts with
the measured parameters from then on. Emulated runs are refused: their times are
the host's, not a GPU's. (The model plans each launch by its cost rule; a run whose
caches tuned their GEMMs may have timed other launch configurations of the same
nodes: ``gpu_check``'s summary lists the tuned choices.)

It fits the source model (``compiled=False``); fitting the compiled model's latencies is open.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from profiling import perf_model as pm
from profiling.hw_params import GPU, GPUS

FITTED = ("hbm_Bps", "node_gap_s", "rope_round_clocks")


@dataclass
class Fit:
    gpu: str
    overrides: dict                 # parameter -> fitted value (only those the rows determine)
    evidence: dict = field(default_factory=dict)    # parameter -> how it was fitted
    pairs: list = field(default_factory=list)       # (drafter, window, row) measured


def kernel_rows(docs) -> list:
    """The ``--kernel-times`` rows of CUDA ``bench_step`` documents that carry their graph
    step (``graph_us``); ValueError when there is none (or only emulated runs)."""
    rows, skipped = [], []
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("bench") != "step":
            continue
        backend = doc.get("meta", {}).get("device", {}).get("backend")
        for r in doc.get("rows", []):
            if r.get("mode") != "kernels" or not isinstance(r.get("kernels_us"), dict):
                continue
            if backend != "cuda":
                skipped.append(backend)
            elif "graph_us" in r and r.get("n_nodes"):
                rows.append(r)
    if not rows:
        why = f" (only {sorted(set(map(str, skipped)))} runs: not GPU times)" if skipped else ""
        raise ValueError(f"no kernel-time rows of a CUDA run with their graph step{why}")
    return rows


def fit(docs, gpu: GPU) -> Fit:
    """The fitted parameters (see the module docstring) of ``gpu`` from ``docs``."""
    rows = kernel_rows(docs)
    models = [(r, pm.model_step(r["drafter"], int(r["window"]), gpu, accept=int(r.get("accept", 6)),
                                 compiled=False))
              for r in rows]
    out = Fit(gpu.name, {}, pairs=[(r["drafter"], int(r["window"]), r) for r in rows])

    dram_bytes = meas_us = 0.0
    used = set()
    for r, m in models:
        for label, e in m["groups"].items():
            rope = e["first"].counters.epilogue_rope_rounds > 0
            if (label in r["kernels_us"] and e["first"].kernel.startswith("gemm") and not rope
                    and set(e["binding"]) == {"dram"}):
                dram_bytes += sum(t.counters.dram_bytes for t in m["nodes"] if t.label == label)
                meas_us += float(r["kernels_us"][label])
                used.add(label)
    if meas_us > 0:
        bw = dram_bytes / (meas_us * 1e-6)
        out.overrides["hbm_Bps"] = bw
        out.evidence["hbm_Bps"] = (f"{dram_bytes / 1e9:.3f} GB in {meas_us:.1f} us over "
                                   f"{', '.join(sorted(used))} ({len(models)} window(s))")
    bw = out.overrides.get("hbm_Bps", gpu.hbm_Bps)

    gaps = [(float(r["graph_us"]) - sum(float(v) for v in r["kernels_us"].values())) / int(r["n_nodes"])
            for r, _ in models]
    if statistics.median(gaps) > 0:
        out.overrides["node_gap_s"] = statistics.median(gaps) * 1e-6
        out.evidence["node_gap_s"] = "graph step minus the nodes' own times, per node: " + \
            ", ".join(f"{g:.2f}" for g in gaps) + " us (median)"
    else:
        out.evidence["node_gap_s"] = f"not fitted: the nodes' times add up to the graph step or more ({gaps})"

    # the epilogue after the stream: max(RoPE rounds x rope_round_clocks, K/V copy rounds x
    # copy_round_clocks) per node (perf_model.kernel_time); the RoPE clocks are determined only
    # where the time beyond HBM exceeds what the copy rounds take
    epi_us = rounds = copy_us = 0.0
    for r, m in models:
        for label, e in m["groups"].items():
            if label in r["kernels_us"] and e["first"].counters.epilogue_rope_rounds > 0:
                nodes = [t for t in m["nodes"] if t.label == label]
                epi_us += float(r["kernels_us"][label]) - sum(t.counters.dram_bytes for t in nodes) / bw * 1e6
                rounds += sum(t.counters.epilogue_rope_rounds for t in nodes)
                copy_us += sum(t.counters.epilogue_copy_rounds for t in nodes) * gpu.copy_round_clocks / gpu.clock_hz * 1e6
    if rounds and epi_us > copy_us * 1.001:
        out.overrides["rope_round_clocks"] = epi_us * 1e-6 * gpu.clock_hz / rounds
        out.evidence["rope_round_clocks"] = (f"{epi_us:.1f} us beyond the qkv GEMM's HBM time over "
                                             f"{rounds:.0f} epilogue rounds")
    elif rounds:
        out.evidence["rope_round_clocks"] = (f"not fitted: the qkv GEMM's {epi_us:.1f} us beyond its HBM time "
                                             f"is no more than its K/V copy rounds take ({copy_us:.1f} us): "
                                             f"the RoPE rounds are hidden")
    return out


def report(result: Fit, gpu: GPU) -> str:
    """The fit, and per measured window the step and each group, measured / predicted with
    the parameters before and after."""
    after = gpu.with_overrides(result.overrides)
    lines = [f"calibration of {gpu.name} from {len(result.pairs)} measured window(s):"]
    for k in FITTED:
        if k in result.overrides:
            lines.append(f"  {k:18s} {getattr(gpu, k):.4g} -> {result.overrides[k]:.4g}   ({result.evidence[k]})")
        elif k in result.evidence:
            lines.append(f"  {k:18s} {getattr(gpu, k):.4g} kept   ({result.evidence[k]})")
    for drafter, window, r in result.pairs:
        b, a = (pm.model_step(drafter, window, g, accept=int(r.get("accept", 6)), compiled=False)
                for g in (gpu, after))
        lines.append(f"  {drafter} window {window}: graph step measured {float(r['graph_us']):.1f} us, "
                     f"predicted {b['step_us']:.1f} -> {a['step_us']:.1f}")
        ka = {lab: ratio for lab, _, _, ratio in pm.kernel_agreement(a, r["kernels_us"])}
        for lab, pred, meas, ratio in pm.kernel_agreement(b, r["kernels_us"]):
            lines.append(f"    {lab:28s} meas {meas:8.1f} us  meas/pred {ratio:5.2f} -> {ka[lab]:5.2f}")
        within = sum(1 for v in ka.values() if abs(v - 1) <= pm.KERNEL_TOLERANCE)
        lines.append(f"    after: {within} of {len(ka)} groups within +-{pm.KERNEL_TOLERANCE:.0%}")
    return "\n".join(lines)


def write(result: Fit, path: Path) -> dict:
    """Merge the fit into the calibration file at ``path`` (other GPUs' and other parameters'
    entries kept); returns what was written."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {path}: expected a JSON object keyed by GPU name")
    data.setdefault(result.gpu, {}).update(result.overrides)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiling.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench_step JSON files of a CUDA run (--kernel-times)")
    p.add_argument("--gpu", default="H200")
    p.add_argument("--write", metavar="CALIBRATION_JSON", default=None,
                   help="merge the fitted parameters into this file (e.g. profiling/results/calibration.json)")
    a = p.parse_args(argv)
    gpu = _uncalibrated(a.gpu)   # as published: a calibration file already there is fitted anew
    docs = [json.loads(Path(f).read_text()) for f in a.results]
    try:
        result = fit(docs, gpu)
    except ValueError as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return 2
    print(report(result, gpu))
    if a.write:
        write(result, Path(a.write))
        print(f"wrote {a.write}")
    return 0


def _uncalibrated(name: str) -> GPU:
    key = name.upper()
    if key not in GPUS:
        raise SystemExit(f"calibrate: gpu {name!r}: expected one of {', '.join(GPUS)}")
    return GPUS[key]


if __name__ == "__main__":
    raise SystemExit(main())
