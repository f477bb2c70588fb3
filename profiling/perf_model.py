"""Cost model of the drafter step on a GPU, computed on the CPU from the kernels as they are.

    python -m profiling.perf_model --drafter qwen3-8b --windows 2K,8K,32K
    python -m profiling.perf_model --drafter qwen3.5-27b --gpu H100 --json

For each drafter preset and window: the step graph is recorded at the real
shapes (``step_trace``: the product's own launchers decide every grid), each
launch gets counters (``--counters emulated``, the default: measured by the
emulator's counter mode on sampled blocks, ``emulated_counters``; ``static``:
the hand-written access models of ``counters``), ptxas resources at sm_90 and occupancy
(``static_facts``), and a time that is the largest of its bounds:

* ``dram``: compulsory bytes / achievable HBM bandwidth;
* ``l2``: every sector between SMs and L2 / L2 bandwidth;
* ``smem``: shared-memory wavefronts of the busiest SM / one per clock;
* ``mma``: mma.sync instructions of the busiest SM / the mma.sync rate;
* ``latency``: Little's law per block: its dependent global-load round trips
  x latency, once per round of resident blocks (``ceil(blocks / slots)``),
  plus a tail one block adds once (the attention's split merge: its L2 round
  trips, or its bytes at one SM's share of the L2 bandwidth, the larger);
* ``wave``: when the grid ends in a partial wave: the full waves at the
  whole GPU's rates, plus the tail's blocks alone (their own latency path and
  their SMs' shared memory and tensor cores);
* ``sass`` (the default, ``--model compiled``; it replaces ``latency`` and
  ``wave``): the launch's phases as ptxas compiled them, added one after
  another (``sass_phases.compiled_time``: the stream at HBM or Little's-law
  speed, then each other phase's dependent chain, fences and atomics).

The step's time is the sum over its graph nodes plus one ``node_gap`` per
node (``--pdl``: the cache's ``pdl=True`` graph, where a launch right after a
launch carries a programmatic edge and costs ``pdl_gap`` instead, a labelled
guess in ``hw_params``); the floor is the step's compulsory bytes (``step_model.step_bytes``) at
the achievable HBM bandwidth, so ``ratio`` is the figure ``bench_step``
measures on a GPU (``ratio_to_floor``). See ``profiling/README.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from . import counters as ctr
from . import static_facts as sf
from .common import DRAFTERS, drafter_config, int_list, str_list
from .hw_params import get_gpu
from .step_trace import Copy, node_label, trace_step
from .step_model import step_bytes

ALIASES = {"qwen3-8b": "h4096", "h5120": "qwen3.5-27b"}
BOUNDS = ("dram", "l2", "smem", "mma", "latency", "wave", "sass")
RESULTS = Path(__file__).resolve().parent / "results"
MEASURED_FILE = RESULTS / "perf_measured.json"


def resolve_drafter(name: str) -> str:
    n = ALIASES.get(name, name)
    if n not in DRAFTERS:
        raise ValueError(f"drafter {name!r}: expected one of {', '.join(sorted(set(DRAFTERS) | set(ALIASES)))}")
    return n


@dataclass
class NodeTime:
    label: str                    # "gemm_stream[gate_up]", "ring_attn_mma_split", "memcpy h2d"
    kernel: str
    grid: tuple = (0, 0, 0)
    threads: int = 0
    registers: int = 0
    smem_block: int = 0
    blocks_per_sm: int = 0
    occ_limited_by: str = ""
    waves: float = 0.0
    tail_blocks: int = 0
    wave_efficiency: float = 1.0
    inflight_kb_per_sm: float = 0.0   # static peak: per-warp peak x warps resident on the busiest SM
    bounds_us: dict = field(default_factory=dict)
    predicted_us: float = 0.0
    bound: str = ""
    epilogue_us: float = 0.0          # of predicted_us: the serial epilogue after the stream
    counters: ctr.KernelCounters | None = None
    compiled: object = None           # sass_phases.CompiledTime: the phases as compiled (model "compiled")


def kernel_time(n, c: ctr.KernelCounters, gpu, compiled: bool = True) -> NodeTime:
    """Bounds and predicted time of one launch (module docstring). ``compiled``: the launch's
    phases as ptxas compiled them run one after another (``sass``, replacing the
    source-intended ``latency`` and ``wave`` bounds); False: the source model (max of bounds)."""
    us = 1e6
    if isinstance(n, Copy):
        t = NodeTime(node_label(n), "memcpy", counters=c)
        t.bounds_us = {"dram": c.dram_bytes / gpu.hbm_Bps * us, "latency": gpu.hbm_latency_s * us}
    else:
        info = sf.ptxas_info(n.file, n.defines)[n.kernel]
        occ = sf.occupancy(gpu, n.threads, info["registers"], info["smem"], n.shared_mem)
        # blocks that exit at their start (dead row blocks of a lane-batched GEMM) free their
        # slot at once: the waves are those of the live blocks; a live-split wgmma GEMM's
        # resident blocks stride over its work items: the waves are those of the items
        blocks = c.live_blocks if 0 < c.live_blocks else n.n_blocks
        wv = sf.waves(blocks, occ.blocks_per_sm, gpu.sm_count)
        t = NodeTime(node_label(n), n.kernel, n.grid, n.threads, info["registers"], info["smem"] + n.shared_mem,
                     occ.blocks_per_sm, occ.limited_by, wv.waves, wv.tail_blocks, wv.efficiency,
                     counters=c)
        per_sm_max = math.ceil(blocks / gpu.sm_count)     # blocks the busiest SM runs
        t.inflight_kb_per_sm = (c.inflight_peak_bytes_per_warp * (n.threads // 32)
                                * min(occ.blocks_per_sm, per_sm_max) / 1024)
        clk = gpu.clock_hz
        # wgmma reads its B operand from shared memory: 128-byte wavefronts too
        smem_wf = c.smem_wavefronts + c.wgmma_smem_bytes / 128
        # tensor-core clocks: mma.sync and wgmma at their own rates
        mma_clk = c.mma / gpu.mma_per_clk_sm + c.wgmma_mma / gpu.wgmma_per_clk_sm
        smem = smem_wf / blocks * per_sm_max / (gpu.smem_wavefronts_per_clk_sm * clk)
        mma = mma_clk / blocks * per_sm_max / clk
        rounds = math.ceil(blocks / wv.slots)
        lat = rounds * (c.dram_round_trips_per_block * gpu.hbm_latency_s
                        + c.l2_round_trips_per_block * gpu.l2_latency_s)
        # one block's tail after the grid's work (the attention's merge): once, not per round
        lat += max(c.tail_l2_round_trips * gpu.l2_latency_s, c.tail_l2_bytes / (gpu.l2_Bps / gpu.sm_count))
        dram = c.dram_bytes / gpu.hbm_Bps
        l2 = c.l2_bytes / gpu.l2_Bps
        wave = 0.0
        if wv.full_waves and wv.tail_blocks:
            # full waves at the whole GPU's rates, then the tail's blocks alone:
            # their SMs' shared memory and tensor cores, their latency path
            even = max(dram, l2, smem_wf / (gpu.sm_count * gpu.smem_wavefronts_per_clk_sm * clk),
                       mma_clk / (gpu.sm_count * clk))
            per_sm_tail = math.ceil(wv.tail_blocks / gpu.sm_count)
            tail = max(lat / rounds, dram * wv.tail_blocks / blocks,
                       smem_wf / blocks * per_sm_tail / (gpu.smem_wavefronts_per_clk_sm * clk),
                       mma_clk / blocks * per_sm_tail / clk)
            wave = even * (blocks - wv.tail_blocks) / blocks + tail
        # a serial epilogue after the stream (the qkv GEMM's RoPE): the last block's follows
        # whatever bound its stream had, so it adds to each
        epi = max(c.epilogue_rope_rounds * gpu.rope_round_clocks, c.epilogue_copy_rounds * gpu.copy_round_clocks) / clk
        t.bounds_us = {"dram": (dram + epi) * us, "l2": (l2 + epi) * us, "smem": (smem + epi) * us,
                       "mma": (mma + epi) * us, "latency": (lat + epi) * us, "wave": (wave + epi) * us if wave else 0.0}
        t.epilogue_us = epi * us
        if compiled:
            from . import sass_phases
            _, phases = sass_phases.launch_phases(n)
            ct = sass_phases.compiled_time(phases, gpu=gpu, threads=n.threads,
                                           resident=min(occ.blocks_per_sm, per_sm_max), per_sm_max=per_sm_max,
                                           rounds=rounds, blocks=blocks, dram_bytes=c.dram_bytes)
            t.compiled = ct
            t.inflight_kb_per_sm = ct.inflight_per_sm / 1024
            # the source's latency and wave bounds are what the SASS replaces
            t.bounds_us = {k: v for k, v in t.bounds_us.items() if k not in ("latency", "wave")}
            # the epilogue is in the SASS phases (its rounds' issue slots): not added twice
            t.bounds_us["sass"] = ct.total_s * us
    t.bound = max(t.bounds_us, key=t.bounds_us.get)
    t.predicted_us = t.bounds_us[t.bound]
    return t


def _counter_key(n):
    if isinstance(n, Copy):
        return None
    return (n.variant(), n.grid, n.block, n.shared_mem,
            tuple(a if not hasattr(a, "name") else a.name for a in n.leaves()), tuple(sorted(n.known.items())))


def time_nodes(graph_nodes, gpu, source, compiled: bool = True) -> list:
    """``kernel_time`` of each node, counters from ``source(launch)`` (once per
    distinct launch: the layers repeat) or, for copies, their bytes."""
    cache: dict = {}
    out = []
    for n in graph_nodes:
        if isinstance(n, Copy):
            c = ctr.copy_counters(n)
        else:
            k = _counter_key(n)
            c = cache.get(k)
            if c is None:
                c = cache[k] = source(n)
        out.append(kernel_time(n, c, gpu, compiled))
    return out


def model_step(drafter: str, window: int, gpu, *, accept: int = 6, lm_head_vocab: int | None = None,
               counter_source=None, attn_config=None, pdl: bool = False, compiled: bool = True,
               plain: bool = False, logits: bool = True) -> dict:
    """The model of one step: per node times, totals, floor, ratio, losses.
    ``counter_source(launch) -> KernelCounters`` defaults to the static estimates.
    ``attn_config``: the attention's ``(n_splits, merge)`` (``trace_step``;
    ``None``: the cost rule's). ``pdl``: the graph captured with programmatic dependent
    launch (each launch that follows a launch: ``gpu.pdl_gap_s`` instead of ``node_gap_s``).
    ``plain``: a DFlash 2 preset as the same drafter without its convolutions and selector.
    ``logits``: the cache's switch (False: no logits written; the LM head's fused argmax, or
    DFlash 2's fused top-K)."""
    name = resolve_drafter(drafter)
    cfg = drafter_config(name)
    if plain:   # a DFlash 2 preset without its convolutions and selector (the LM head's argmax instead)
        cfg = cfg.replace(dflash2=None)
    plan = trace_step(cfg, window, accept=accept, lm_head_vocab=lm_head_vocab, attn_config=attn_config,
                     pdl=pdl, logits=logits)
    nodes = time_nodes(plan.nodes, gpu, counter_source or ctr.static_counters, compiled)
    n_pdl = sum(1 for n in plan.launches if n.pdl)
    gap_us = (gpu.node_gap_s * (plan.n_nodes - n_pdl) + gpu.pdl_gap_s * n_pdl) * 1e6
    kern_us = sum(t.predicted_us for t in nodes)
    sb = step_bytes(plan.cache, accept, 2)
    floor_us = sb["total"] / gpu.hbm_Bps * 1e6
    step_us = kern_us + gap_us
    groups = _groups(nodes)
    return {"drafter": drafter, "preset": name, "window": window, "gpu": gpu.name,
            "model": "compiled" if compiled else "source",
            "n_nodes": plan.n_nodes, "n_launches": len(plan.launches), "n_copies": len(plan.copies),
            "pdl": bool(pdl), "n_pdl_edges": n_pdl,
            "attn_config": plan.cache.attention.config(),
            "kv_total": plan.kv_total, "q_len": plan.q_len, "a_step": plan.a_step,
            "bytes": sb, "floor_us": floor_us, "kernels_us": kern_us, "gaps_us": gap_us,
            "step_us": step_us, "ratio": step_us / floor_us,
            "inflight_needed_kb_per_sm": gpu.hbm_Bps * gpu.hbm_latency_s / gpu.sm_count / 1024,
            "counted_dram_bytes": sum(t.counters.dram_bytes for t in nodes),
            "counted_l2_bytes": sum(t.counters.l2_bytes for t in nodes),
            "groups": groups, "losses": _losses(groups, gap_us), "nodes": nodes}


def _groups(nodes) -> "OrderedDict[str, dict]":
    """Nodes with the same label summed (a role's launch in every layer)."""
    g: OrderedDict = OrderedDict()
    for t in nodes:
        e = g.setdefault(t.label, {"count": 0, "predicted_us": 0.0, "bounds_us": dict.fromkeys(t.bounds_us, 0.0),
                                   "binding": {}, "first": t})
        e["count"] += 1
        e["predicted_us"] += t.predicted_us
        for k, v in t.bounds_us.items():
            e["bounds_us"][k] = e["bounds_us"].get(k, 0.0) + v
        e["binding"][t.bound] = e["binding"].get(t.bound, 0) + 1
    return g


_WHY = {
    "smem": "shared-memory wavefronts",
    "mma": "mma.sync issue rate / wgmma rate",
    "latency": "too few loads in flight (latency x round trips)",
    "wave": "wave quantisation (a partial tail wave)",
    "l2": "L2 traffic",
    "dram": "HBM bytes",
}


def _losses(groups, gap_us) -> list:
    """Time above each group's own HBM bound, largest first, plus the node gaps."""
    out = []
    for label, e in groups.items():
        loss = e["predicted_us"] - e["bounds_us"].get("dram", 0.0)
        if loss > 0.05:
            bound = max(e["binding"], key=e["binding"].get)
            c = e["first"].counters
            why = _WHY.get(bound, bound)
            if bound == "smem" and c.bank_conflict_factor > 1.05:
                why += f" ({c.bank_conflict_factor:.2f}x bank conflicts)"
            t = e["first"]
            if t.waves > 1 and t.tail_blocks:
                why += (f"; grid of {t.grid[0] * t.grid[1] * t.grid[2]} blocks for "
                        f"{round(t.waves and (t.grid[0] * t.grid[1] * t.grid[2]) / t.waves)} slots: "
                        f"a tail wave of {t.tail_blocks}")
            out.append({"label": label, "loss_us": loss, "bound": bound, "why": why,
                        "notes": list(c.notes)})
    out.append({"label": "graph node gaps", "loss_us": gap_us, "bound": "gap",
                "why": "one gap per graph node (a shorter one per PDL edge with --pdl)", "notes": []})
    out.sort(key=lambda d: -d["loss_us"])
    return out


def compiled_losses(m: dict) -> list:
    """``(us per step, label, what, SASS range, source lines)`` of each group's largest term as
    compiled beyond its stream at HBM speed (a stream short of bytes in flight counts its excess),
    largest first."""
    out = []
    for label, e in m["groups"].items():
        ct = e["first"].compiled
        if ct is None:
            continue
        k = e["count"]
        for sec, what, where, src in ct.terms:
            loss = sec - ct.stream_hbm_s if what.startswith("stream") else sec
            if loss * k * 1e6 > 0.5:
                out.append((loss * k * 1e6, label, what, where, list(src)))
    out.sort(key=lambda r: -r[0])
    return out


# ---------------------------------------------------------------------------- measured results
def load_measured(path: Path = MEASURED_FILE) -> dict:
    """``{preset: {window: {"step_us": x, "kernels": {label: us}}}}`` from a
    GPU run (format in the README), or {} when there is none."""
    data: dict = {}
    if path.is_file():
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object keyed by drafter preset")
    # bench_step results of GPU runs (profiling/results/*.json): the graph rows' step time
    for f in sorted(path.parent.glob("*.json")) if path.parent.is_dir() else ():
        try:
            doc = json.loads(f.read_text())
        except ValueError:
            continue
        if not isinstance(doc, dict) or doc.get("bench") != "step":
            continue
        if doc.get("meta", {}).get("device", {}).get("backend") != "cuda":
            continue
        for r in doc.get("rows", []):
            if r.get("mode") == "graph" and "us_per_step" in r:
                e = data.setdefault(r["drafter"], {}).setdefault(str(r["window"]), {})
                e.setdefault("step_us", r["us_per_step"])
            elif r.get("mode") == "kernels" and isinstance(r.get("kernels_us"), dict):
                # bench_step --kernel-times: every node's own time (profiling/kernel_times.py)
                e = data.setdefault(r["drafter"], {}).setdefault(str(r["window"]), {})
                e.setdefault("kernels", r["kernels_us"])
    return data


KERNEL_TOLERANCE = 0.25   # issue 12: per-kernel predictions within +-25% of measured


def kernel_agreement(m: dict, measured_kernels: dict) -> list:
    """``(label, predicted_us, measured_us, measured / predicted)`` per group of the model
    that was measured, worst first (the ratio furthest from 1)."""
    out = [(label, e["predicted_us"], float(measured_kernels[label]),
            float(measured_kernels[label]) / e["predicted_us"] if e["predicted_us"] > 0 else math.inf)
           for label, e in m["groups"].items() if label in measured_kernels]
    return sorted(out, key=lambda r: -abs(math.log(r[3])) if 0 < r[3] < math.inf else -math.inf)


# ---------------------------------------------------------------------------- output
def format_report(m: dict, measured: dict | None = None, losses_shown: int = 5) -> str:
    meas = (measured or {}).get(m["preset"], {}).get(str(m["window"]), {})
    mk = meas.get("kernels", {})
    lines = [f"== {m['drafter']} ({m['preset']}) window {m['window']} on {m['gpu']}: "
             f"{m['n_nodes']} graph nodes ({m['n_launches']} launches, {m['n_copies']} copies)"]
    hdr = (f"{'kernel':24s} {'n':>2s} {'grid':>13s} {'reg':>4s} {'blk/SM':>6s} {'waves':>5s} {'tail':>4s} "
           f"{'DRAM MB':>8s} {'L2 MB':>7s} {'sect':>5s} {'smem wf':>9s} {'confl':>5s} {'mma':>8s} "
           f"{'KB/SM':>5s} | " + " ".join(f"{b:>7s}" for b in BOUNDS) + f" | {'pred us':>8s} bound")
    if mk:
        hdr += "   meas us  meas/pred"
    lines.append(hdr)
    for label, e in m["groups"].items():
        t, c, k = e["first"], e["first"].counters, e["count"]
        b = e["bounds_us"]
        grid = "x".join(str(v) for v in t.grid) if t.grid[0] else "-"
        row = (f"{label[:24]:24s} {k:2d} {grid:>13s} {t.registers:4d} {t.blocks_per_sm:6d} {t.waves:5.2f} "
               f"{t.tail_blocks if t.waves > 1 else 0:4d} {c.dram_bytes * k / 1e6:8.2f} {c.l2_bytes * k / 1e6:7.1f} "
               f"{c.sector_efficiency:5.2f} {c.smem_wavefronts * k:9.3g} {c.bank_conflict_factor:5.2f} "
               f"{c.mma * k:8.3g} {t.inflight_kb_per_sm:5.1f} | "
               + " ".join(f"{b.get(x, 0.0):7.1f}" for x in BOUNDS)
               + f" | {e['predicted_us']:8.1f} {max(e['binding'], key=e['binding'].get)}")
        if mk:
            row += (f"   {mk[label]:7.1f}  {mk[label] / e['predicted_us']:9.2f}" if label in mk and e["predicted_us"] > 0
                    else "         -          -")
        lines.append(row)
    lines.append(f"kernels {m['kernels_us']:.1f} us + node gaps {m['gaps_us']:.1f} us"
                 + (f" ({m['n_pdl_edges']} PDL edges)" if m.get("pdl") else "") + " = step "
                 f"{m['step_us']:.1f} us; floor {m['floor_us']:.1f} us ({m['bytes']['total'] / 1e9:.3f} GB "
                 f"compulsory); ratio {m['ratio']:.2f}x (goal 1.15x)"
                 + (f"; measured step {meas['step_us']:.1f} us ({meas['step_us'] / m['floor_us']:.2f}x)"
                    if "step_us" in meas else ""))
    losses = compiled_losses(m)
    if losses:
        lines.append("largest losses as compiled (per step, above each group's HBM time):")
        for us_, label, what, where, src in losses[:losses_shown]:
            lines.append(f"  {us_:7.1f} us  {label}: {what} at SASS {where} [{', '.join(src[:3])}]")
    if mk:
        agree = kernel_agreement(m, mk)
        ok = [a for a in agree if abs(a[3] - 1) <= KERNEL_TOLERANCE]
        line = (f"measured per kernel: {len(ok)} of {len(agree)} groups within +-{KERNEL_TOLERANCE:.0%} of the "
                f"prediction (issue 12)")
        if agree and len(ok) < len(agree):
            line += "; furthest: " + ", ".join(f"{a[0]} x{a[3]:.2f}" for a in agree[:3] if a not in ok)
        missing = [k for k in mk if k not in m["groups"]]
        if missing:
            line += f"; measured but not in the model: {', '.join(missing)}"
        lines.append(line)
        if "step_us" in meas:
            lines.append(f"measured graph step - sum of measured nodes = "
                         f"{(meas['step_us'] - sum(mk.values())) / m['n_nodes']:+.2f} us per node "
                         f"(model: node_gap_s {m['gaps_us'] / m['n_nodes']:.2f} us per node)")
    lines.append(f"L2 traffic {m['counted_l2_bytes'] / 1e9:.2f} GB, counted DRAM {m['counted_dram_bytes'] / 1e9:.3f} GB; "
                 f"loads in flight needed per SM at this GPU's bandwidth x latency: "
                 f"{m['inflight_needed_kb_per_sm']:.1f} KB (KB/SM column: static peak)")
    lines.append("where the time goes:")
    total = m["step_us"]
    parts = [(label, e["predicted_us"]) for label, e in m["groups"].items()] + [("node gaps", m["gaps_us"])]
    for label, v in sorted(parts, key=lambda p: -p[1]):
        if v >= 0.005 * total:
            lines.append(f"  {label[:24]:24s} {v:8.1f} us {100 * v / total:5.1f}% " + "#" * round(50 * v / total))
    cmp_lines = format_compare(m)
    if cmp_lines:
        lines += cmp_lines
    lines.append("largest losses (time above each kernel's own HBM bound):")
    for d in m["losses"][:5]:
        lines.append(f"  {d['loss_us']:8.1f} us  {d['label']}: {d['why']}")
        for note in d["notes"]:
            if not note.startswith("in-flight") and "x the minimum" not in note:   # sites: listed above
                lines.append(f"{'':14s}- {note}")
    return "\n".join(lines)


def _ratio(a, b) -> str:
    if not b:
        return "   -  " if not a else "  new "
    r = a / b
    return f"{r:6.2f}" if abs(r - 1) > 0.005 else "  =   "


def format_compare(m: dict) -> list:
    """Measured (emulator) beside static counters per kernel role, when measured."""
    rows = []
    for label, e in m["groups"].items():
        c, k = e["first"].counters, e["count"]
        if not c.compare:
            continue
        s = c.compare
        rows.append(
            f"{label[:24]:24s} {c.blocks_counted:>4d}/{c.blocks:<5d} "
            f"{c.gld_requests * k:>10.4g} {s['gld_requests'] * k:>10.4g} {_ratio(c.gld_requests, s['gld_requests'])} "
            f"{c.l2_bytes * k / 1e6:>8.2f} {s['l2_bytes'] * k / 1e6:>8.2f} {_ratio(c.l2_bytes, s['l2_bytes'])} "
            f"{c.sector_efficiency:5.2f} {s['sector_efficiency']:5.2f} "
            f"{c.smem_wavefronts * k:>9.4g} {s['smem_wavefronts'] * k:>9.4g} {_ratio(c.smem_wavefronts, s['smem_wavefronts'])} "
            f"{c.bank_conflict_factor:5.2f} {s['bank_conflict_factor']:5.2f} "
            f"{c.mma * k:>9.4g} {_ratio(c.mma, s['mma'])} {c.barriers * k:>7d} {_ratio(c.barriers, s['barriers'])}")
    if not rows:
        return []
    hot = []
    for label, e in m["groups"].items():
        for h in e["first"].counters.hot_sites:
            hot.append(f"  {label[:24]:24s} {h['kind']} {h['width']:2d} B at {h['where']}: {h['waste']:.2f}x the "
                       f"minimum {'sectors' if h['kind'].startswith('global') else 'wavefronts'} "
                       f"({100 * h['share']:.0f}% of the kernel's)")
    if hot:
        rows.append("instruction sites furthest above their minimum (emulator; >= 1.25x and >= 5% of the kernel's):")
        rows += hot
    hdr = (f"{'counters: emulator vs static':24s} {'blocks':>10s} {'gld req':>10s} {'static':>10s} {'ratio':>6s} "
           f"{'L2 MB':>8s} {'static':>8s} {'ratio':>6s} {'sect':>5s} {'stat':>5s} {'smem wf':>9s} {'static':>9s} "
           f"{'ratio':>6s} {'confl':>5s} {'stat':>5s} {'mma':>9s} {'ratio':>6s} {'barr':>7s} {'ratio':>6s}")
    return [hdr] + rows


def to_json(m: dict) -> dict:
    out = {k: v for k, v in m.items() if k not in ("nodes", "groups")}
    out["groups"] = {
        label: {"count": e["count"], "predicted_us": e["predicted_us"], "bounds_us": e["bounds_us"],
                "binding": e["binding"], "registers": e["first"].registers,
                "blocks_per_sm": e["first"].blocks_per_sm, "occ_limited_by": e["first"].occ_limited_by,
                "grid": list(e["first"].grid), "waves": e["first"].waves,
                "tail_blocks": e["first"].tail_blocks, "counters": e["first"].counters.to_json()}
        for label, e in m["groups"].items()}
    out["nodes"] = [{"label": t.label, "predicted_us": t.predicted_us, "bound": t.bound,
                     "bounds_us": t.bounds_us} for t in m["nodes"]]
    return out


def plot(models: list, path: Path) -> Path | None:
    """Stacked bars: where each step's time goes, by kernel group, with its floor."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return None
    labels = []
    for m in models:
        for k in m["groups"]:
            if k not in labels:
                labels.append(k)
    labels.append("node gaps")
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(models) + 3), 5))
    xs = range(len(models))
    bottom = [0.0] * len(models)
    cmap = plt.get_cmap("tab20")
    for i, lab in enumerate(labels):
        vals = [m["gaps_us"] if lab == "node gaps" else m["groups"].get(lab, {}).get("predicted_us", 0.0)
                for m in models]
        if max(vals) < 0.5:
            continue
        ax.bar(xs, vals, bottom=bottom, label=lab, color=cmap(i % 20))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, m in zip(xs, models):
        ax.plot([x - 0.4, x + 0.4], [m["floor_us"]] * 2, "k-", lw=2)
        ax.plot([x - 0.4, x + 0.4], [1.15 * m["floor_us"]] * 2, "k:", lw=1)
        ax.text(x, bottom[x] * 1.01, f"{m['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{m['preset']}\n{m['window']}" for m in models], fontsize=8)
    ax.set_ylabel(f"predicted us per step ({models[0]['gpu']})")
    ax.set_title("where the step's time goes (solid: HBM floor, dotted: 1.15x goal)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiling.perf_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="qwen3-8b",
                   help="preset(s), comma-separated: " + ", ".join(sorted(set(DRAFTERS) | set(ALIASES))))
    p.add_argument("--windows", default="2K,8K,32K", help="comma-separated, K suffix allowed")
    p.add_argument("--gpu", default="H200", help="H200 or H100")
    p.add_argument("--calibration", default=None,
                   help="JSON of parameter overrides per GPU (default profiling/results/calibration.json if present)")
    p.add_argument("--measured", default=None, help=f"measured per-kernel times (default {MEASURED_FILE})")
    p.add_argument("--accept", type=int, default=6, help="rows appended per step (as bench_step)")
    p.add_argument("--lm-head", type=int, default=None, metavar="VOCAB")
    p.add_argument("--pdl", action="store_true",
                   help="model the pdl=True step graph (programmatic edges: pdl_gap_s, a labelled guess)")
    p.add_argument("--plot", default=None, help="PNG path (default: none; 'auto' = profiling/results/cpu/perf_model.png)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    p.add_argument("--counters", default="emulated", choices=("emulated", "static"),
                   help="emulated: each distinct launch run in the emulator's counter mode on sampled "
                        "blocks at the real shapes (default); static: the hand-written access models only")
    p.add_argument("--sample", type=int, default=None,
                   help="blocks counted per launch with --counters emulated (first, last, seeded others; "
                        "default 8)")
    p.add_argument("--attn-merge", default="default", choices=("default", "launch", "fold"),
                   help="the attention's split merge (default: ops/attention.py's default_merge rule)")
    p.add_argument("--attn-splits", type=int, default=None, metavar="N",
                   help="the attention's split count (default: default_splits)")
    p.add_argument("--losses", type=int, default=5, metavar="N",
                   help="the largest N losses as compiled to print (default 5)")
    p.add_argument("--model", default="compiled", choices=("compiled", "source"),
                   help="compiled: each launch's phases as ptxas built them, one after another (the SASS "
                        "reader, profiling/sass.py; default); source: the max of the source-intended bounds")
    a = p.parse_args(argv)
    attn = None
    if a.attn_merge != "default" or a.attn_splits is not None:
        attn = (a.attn_splits, None if a.attn_merge == "default" else a.attn_merge)
    gpu = get_gpu(a.gpu, a.calibration)
    windows = int_list(a.windows)
    measured = load_measured(Path(a.measured)) if a.measured else load_measured()
    source = None
    if a.counters == "emulated":
        from .emulated_counters import DEFAULT_SAMPLE, EmulatedSource
        n = DEFAULT_SAMPLE if a.sample is None else a.sample
        if n < 2:
            raise SystemExit(f"--sample must be >= 2 (the first and the last block), got {n}")
        source = EmulatedSource(n=n)
    t0 = time.perf_counter()
    models = [model_step(d, w, gpu, accept=a.accept, lm_head_vocab=a.lm_head, counter_source=source,
                         attn_config=attn, pdl=a.pdl, compiled=a.model == "compiled")
              for d in str_list(a.drafter) for w in windows]
    if source is not None:
        print(f"emulated counters: {source.runs} distinct launches counted in {source.seconds:.1f} s "
              f"(compiles included); model {time.perf_counter() - t0:.1f} s in all", file=sys.stderr)
        for kernel, msg in source.failures:
            print(f"emulated counters: {kernel} kept its static estimate: {msg}", file=sys.stderr)
    if a.json:
        json.dump({"gpu": gpu.name, "gpu_params": {k: v for k, v in vars(gpu).items() if k != "sources"},
                   "gpu_sources": gpu.sources, "models": [to_json(m) for m in models]},
                  sys.stdout, indent=1, default=float)
        print()
    else:
        for m in models:
            print(format_report(m, measured, a.losses))
            print()
        print("summary: " + "; ".join(f"{m['preset']} {m['window']}: {m['step_us']:.0f} us, "
                                      f"{m['ratio']:.2f}x floor, attention {m['attn_config']}, "
                                      f"{m['n_nodes']} nodes" + (f" ({m['n_pdl_edges']} PDL edges)" if m["pdl"] else "")
                                      for m in models))
    if a.plot:
        path = RESULTS / "cpu" / "perf_model.png" if a.plot == "auto" else Path(a.plot)
        if plot(models, path):
            print(f"plot: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
