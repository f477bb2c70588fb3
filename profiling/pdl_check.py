"""The step replayed with programmatic dependent launch (``DraftKvCache(pdl=True)``) against
the same step without it: bit-identical outputs, then both timed (graph replays).

    python -m profiling.pdl_check                 # on a GPU: h4096 at windows 2048, 8192
    python -m profiling.pdl_check --smoke         # tiny drafter, emulated (CI / dry run)

Two caches share the weights and the feature ring and are driven through the same
schedule (``accept`` rows per step, one shared noise). After every step their
``hidden_states`` must be equal bit for bit (``SystemExit`` naming the step otherwise): a
kernel that touched data before its ``pdl_wait()`` that the kernel before it writes would
show here as a difference on a GPU, where the emulator's check (``emu/pdl_order.py``)
only proves it cannot on the CPU. Then ``us/step`` of each (``timer.measure``): the
measured saving calibrates ``hw_params.pdl_gap_s``
(``(us_off - us_on) / n_pdl_edges = node_gap_s - pdl_gap_s``). On the emulator the times
mean nothing; the run checks the code path and, with ``--check``, the ordering too.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from dflash_cupy import DraftKvCache, FeatureRing, backends
from dflash_cupy.emu import pdl_order as emu_pdl

from . import common, timer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(p, json_default_name="pdl_check.json")
    p.add_argument("--drafter", default=None, help="preset (default h4096; smoke: tiny)")
    p.add_argument("--windows", default=None, help="default 2048,8192 (smoke: 32)")
    p.add_argument("--accept", type=int, default=6)
    p.add_argument("--steps", type=int, default=None, help="compared steps per window (default 8; smoke 3)")
    p.add_argument("--repeats", type=int, default=None, help="timed samples (default 15; smoke 2)")
    p.add_argument("--check", action="store_true", help="emulated: run the PDL ordering check as well")
    a = p.parse_args(argv)
    a.drafter = a.drafter or ("tiny" if a.smoke else "h4096")
    a.windows = common.int_list(a.windows or ("32" if a.smoke else "2048,8192"))
    a.steps = a.steps if a.steps is not None else (3 if a.smoke else 8)
    a.repeats = a.repeats if a.repeats is not None else (2 if a.smoke else 15)
    return a


def check_window(be, cfg, weights, window: int, a, log=print) -> dict:
    timed = 2 * (a.repeats + 3) * 4
    ring_cap = window + a.accept * (a.steps + timed + 2) + 1
    ring = FeatureRing(ring_cap, cfg.n_captured, cfg.hidden_size, dtype=np.float16, backend=be)
    common.fill_ring(ring, be, seed=a.seed + window)
    caches = {p: DraftKvCache(weights, window, backend=be, pdl=p) for p in (False, True)}
    noise = np.random.default_rng(a.seed + 7).standard_normal((cfg.q_len, cfg.hidden_size)).astype(np.float32)
    try:
        for kv in caches.values():
            kv.set_noise_embed(noise)
        committed = window
        for i in range(a.steps + 1):      # step 0: the prefill's bulk append (outside the graph)
            out = {}
            for p, kv in caches.items():
                kv.begin_step(ring, committed)
                kv.run()
                out[p] = be.to_numpy(kv.hidden_states)
            if not np.array_equal(out[False], out[True]):
                bad = np.argwhere(out[False] != out[True])[0]
                raise SystemExit(f"pdl_check: {cfg.hidden_size} window {window} step {i}: pdl=True differs "
                                 f"from pdl=False at {tuple(int(v) for v in bad)}")
            committed += a.accept
        n_pdl = caches[True]._graphs[caches[True]._slot].n_pdl
        row = {"window": window, "steps_compared": a.steps, "bit_identical": True, "pdl_edges": n_pdl}
        state = {"c": committed}

        def stepper(kv):
            def step():
                kv.begin_step(ring, state["c"])
                kv.run()
                state["c"] += a.accept
            return step
        for p, kv in caches.items():
            t = timer.measure(stepper(kv), be, stream=be.current_stream(), warmup=1 if a.smoke else 3,
                              repeats=a.repeats, inner=1 if a.smoke else 4)
            row["us_pdl" if p else "us_plain"] = t.median_s * 1e6
        row["saved_us"] = row["us_plain"] - row["us_pdl"]
        row["saved_us_per_edge"] = row["saved_us"] / n_pdl if n_pdl else float("nan")
        log(f"  window={window:>6}: bit-identical over {a.steps} steps; {n_pdl} PDL edges; "
            f"graph {row['us_plain']:9.1f} us/step plain, {row['us_pdl']:9.1f} with PDL "
            f"(saved {row['saved_us']:7.1f} us, {row['saved_us_per_edge']:.2f} us per edge)"
            + ("  [emulated: times mean nothing]" if be.name != "cuda" else ""))
        return row
    finally:
        for kv in caches.values():
            kv.close()
        ring.close()


def main(argv=None) -> list:
    a = parse_args(argv)
    be = backends.get(a.backend)
    if a.check:
        if be.name != "emulated":
            raise SystemExit("pdl_check: --check is the emulator's ordering check (DFLASH_CUPY_BACKEND=emulated)")
        emu_pdl.check_pdl(be)
    cfg = common.drafter_config(a.drafter)
    t0 = time.perf_counter()
    weights = common.RandomDraftWeights(cfg, be, seed=a.seed)
    print(f"pdl_check: backend={be.name} drafter={a.drafter} windows={a.windows} "
          f"(weights in {time.perf_counter() - t0:.1f} s)", flush=True)
    rows = []
    try:
        for w in a.windows:
            rows.append(check_window(be, cfg, weights, w, a, log=lambda s: print(s, flush=True)))
    finally:
        del weights
        common.free_device_memory(be)
    print("pdl_check: OK (pdl=True bit-identical to pdl=False)")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
