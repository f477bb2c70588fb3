"""Soak: a long random schedule through one ``DraftKvCache``, checked against
the float64 oracle every ``--check-every`` steps.

    python -m profiling.soak --steps 100000 --check-every 500 --json out.json

Each step draws one event: accept 1..q_len drafts (most steps), a jump longer
than a step can append, a rewind, a ``reset`` (a new request), or a planted bad
input (wrong noise shape or dtype, a position the ring no longer holds, a
non-int count). A bad input must raise and leave the cache as it was: the next
good step is checked against the oracle whatever ``--check-every`` says.
Process RSS and device memory are sampled every ``--sample-every`` steps;
device memory must not grow after the first steps (no allocation per step).
Exit status 1 when a check fails, a bad input is accepted, or memory grows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from dflash_cupy import backends, reference
from dflash_cupy.config import DraftConfig
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.tolerances import TOL, within
from dflash_cupy.weights import DraftWeights

EVENTS = ("accept", "jump", "rewind", "reset", "bad")
WEIGHTS = (0.86, 0.03, 0.04, 0.02, 0.05)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_bytes(be) -> int:
    """Bytes the backend holds for device arrays (CuPy pool in use; emulated: live allocations)."""
    if be.name == "cuda":
        import cupy
        return int(cupy.get_default_memory_pool().used_bytes())
    from dflash_cupy.emu import guarded_memory as emu_memory
    with emu_memory._lock:
        return sum(d1 - d0 for _, d0, d1, desc in emu_memory._regions.values()
                   if desc.startswith("device array"))


def _bad_inputs(kv, ring, committed, cfg):
    """(description, callable) pairs that must each raise and change nothing."""
    B, H = kv.q_len, cfg.hidden_size
    return [
        ("noise shape", lambda: kv.step(ring, committed, np.zeros((B + 1, H), np.float32))),
        ("noise dtype", lambda: kv.step(ring, committed, np.zeros((B, H), np.complex64))),
        ("committed not an int", lambda: kv.step(ring, float(committed), np.zeros((B, H), np.float32))),
        ("position not in the ring", lambda: kv.begin_step(ring, committed + 10 * ring.capacity)),
        ("committed <= 0", lambda: kv.begin_step(ring, 0)),
    ]


def run(steps: int = 1000, check_every: int = 50, sample_every: int = 100, seed: int = 0,
        backend=None, capacity: int = 40, verbose: bool = True, max_seconds: float | None = None) -> dict:
    be = backends.get(backend)
    cfg = DraftConfig(n_layer=2, hidden_size=64, n_head=4, n_head_kv=2, head_dim=32,
                      intermediate_size=96, block_size=4, target_layer_ids=(0, 2),
                      layer_sliding=(True, False), sliding_window=12)
    w = DraftWeights.random(cfg, seed=seed, dtype="bf16")
    rng = np.random.default_rng(seed + 1)
    kv = DraftKvCache(w, capacity, backend=be)
    ring = FeatureRing(capacity + 2 * kv.a_step, cfg.n_captured, cfg.hidden_size, backend=be)
    max_pos = 1 << 20
    feat_cache: dict[int, np.ndarray] = {}

    def features(lo, hi):  # a deterministic feature row per position, generated on demand
        out = np.empty((hi - lo, cfg.fc_in), np.float32)
        for p in range(lo, hi):
            row = feat_cache.get(p)
            if row is None:
                row = np.random.default_rng((seed, p)).standard_normal(cfg.fc_in).astype(np.float32)
                if len(feat_cache) > 4 * ring.capacity:
                    feat_cache.clear()
                feat_cache[p] = row
            out[p - lo] = row
        return out

    stats = dict(steps=steps, checks=0, max_err=0.0, bad_rejected=0, bad_accepted=0, failures=0,
                 events={e: 0 for e in EVENTS}, rss=[], device=[])
    committed, written = 1 + int(rng.integers(0, capacity)), 0
    force_check = False
    t0 = time.perf_counter()
    with kv:
        for i in range(steps):
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                stats["steps"] = steps = i  # out of time: report what ran
                break
            ev = EVENTS[int(rng.choice(len(EVENTS), p=WEIGHTS))] if i else "accept"
            stats["events"][ev] += 1
            if ev == "bad":
                desc, call = _bad_inputs(kv, ring, committed, cfg)[int(rng.integers(0, 5))]
                before = (kv.next_pos, ring.lo, ring.hi)
                try:
                    call()
                except (TypeError, ValueError, KeyError, RuntimeError):
                    stats["bad_rejected"] += 1
                else:
                    stats["bad_accepted"] += 1
                    print(f"step {i}: bad input accepted: {desc}", file=sys.stderr)
                if (kv.next_pos, ring.lo, ring.hi) != before:
                    stats["failures"] += 1
                    print(f"step {i}: bad input ({desc}) changed the state", file=sys.stderr)
                force_check = True
                continue
            if ev == "jump":
                committed += kv.a_step + 1 + int(rng.integers(0, kv.q_len))
            elif ev == "rewind":
                committed = max(1, committed - int(rng.integers(1, capacity + kv.q_len)))
            elif ev == "reset":
                kv.reset()
                committed = 1 + int(rng.integers(0, 2 * capacity))
                written = 0
            elif i:
                committed += int(rng.integers(1, kv.q_len + 1))
            if committed > max_pos:  # stay in int32 and keep the feature generator cheap
                kv.reset()
                committed, written = 1 + int(rng.integers(0, capacity)), 0
            if committed < written:
                written = max(0, committed - ring.capacity)
            lo = max(written, committed - ring.capacity)
            if committed > lo:
                ring.write(lo, features(lo, committed))
            written = committed
            noise = rng.standard_normal((kv.q_len, cfg.hidden_size)).astype(np.float32)
            out = kv.step(ring, committed, noise)
            if force_check or i % check_every == 0 or i == steps - 1:
                force_check = False
                got = be.to_numpy(out)
                win_lo = committed - min(committed, kv.capacity)
                ref = reference.draft_forward(w, features(win_lo, committed), noise)
                ok, err = within(got, ref, "step")
                stats["checks"] += 1
                stats["max_err"] = max(stats["max_err"], err)
                if not ok:
                    stats["failures"] += 1
                    print(f"step {i}: committed={committed} outside tolerance (max err {err:.2e})",
                          file=sys.stderr)
            if i % sample_every == 0 or i == steps - 1:
                stats["rss"].append((i, rss_bytes()))
                stats["device"].append((i, device_bytes(be)))
    stats["seconds"] = time.perf_counter() - t0
    stats["steps_per_s"] = steps / max(stats["seconds"], 1e-9)
    dev = [b for _, b in stats["device"][1:]]  # after the first step's captures
    stats["device_growth"] = (max(dev) - min(dev)) if dev else 0
    rss = [b for _, b in stats["rss"]]
    stats["rss_growth"] = rss[-1] - rss[min(1, len(rss) - 1)] if rss else 0
    stats["ok"] = (stats["failures"] == 0 and stats["bad_accepted"] == 0 and stats["device_growth"] == 0)
    if verbose:
        t = TOL["step"]
        print(f"soak on {be.name}: {steps} steps in {stats['seconds']:.1f} s ({stats['steps_per_s']:.0f}/s); "
              f"events {stats['events']}")
        print(f"  {stats['checks']} oracle checks, max err {stats['max_err']:.2e} "
              f"(tolerance {t['atol']} + {t['rtol']}*|ref|); bad inputs rejected {stats['bad_rejected']}, "
              f"accepted {stats['bad_accepted']}; failures {stats['failures']}")
        print(f"  device memory growth {stats['device_growth']} B; RSS growth "
              f"{stats['rss_growth'] / 2**20:.1f} MiB; {'OK' if stats['ok'] else 'FAILED'}")
    return stats


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.soak", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--check-every", type=int, default=50)
    p.add_argument("--sample-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity", type=int, default=40)
    p.add_argument("--backend", default=None, choices=["cuda", "emulated"])
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop after this long (the steps run so far are reported)")
    p.add_argument("--json", default=None, help="write the figures here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    stats = run(a.steps, a.check_every, a.sample_every, a.seed, a.backend, a.capacity,
                max_seconds=a.max_seconds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(stats, backend=backends.get(a.backend).name), f, indent=1)
    return 0 if stats["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
