"""Host time of a whole step: ``step()`` (``begin_step`` + ``set_noise_embed`` + ``run``)
of a single cache at two capacities and of a batch at several lane counts, side by side.

``bench_host`` and ``bench_lanes_host`` time ``begin_step`` alone; this adds what the host
does in the rest of a step: the noise embeddings' validation and staging copy, and ``run()``
(the rings-still-hold check, the ring-write waits, the replay call, the replay event, the
readers' bookkeeping, the next positions). The replay itself is stubbed: after two real
steps (both step graphs captured and replayed once, as in the other host benches) each
captured graph is replaced by ``NoReplay``, whose ``launch`` queues nothing; on the emulator
a replay would execute the whole step on the CPU, on a GPU it is one ``cudaGraphLaunch``
(not counted here). Everything else is the product's own code on the chosen backend. On the
emulated backend the backend calls (stream order, event record, the pinned noise copy and
its hazard checks, which the next steps' waits run) are the emulator's, not CUDA's: the
figures are the package's Python path plus emulator bookkeeping, not a GPU host's.

Steady state: a tiny drafter, every lane active with a full window, ``--accept`` tokens
committed per step (in-graph appends). Each configuration alternates ``step()`` calls with
steps made of ``begin_step``, ``set_noise_embed`` and ``run`` timed one by one, ``--steps``
of each after ``--warmup`` (medians of each). ``--clock thread`` reads this thread's CPU time
instead of the wall clock: on a machine shared with other work, the time the thread waited
for a core is not counted (each reading is a system call, about 1 us, inside the figures).

``--json``: the last line printed is exactly ``{"step_host_us": {"single 2048": ...,
"lanes 1": ..., ...}}`` (medians of ``step()``).

    python -m profiling.bench_run_host --json      # emulated backend unless --backend cuda
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from dflash_cupy import backends
from profiling import common
from profiling.bench_host import steady_cache
from profiling.bench_lanes_host import steady_batch

PARTS = ("begin_step", "set_noise_embed", "run")
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


class NoReplay:
    """Stands in for a captured step graph: ``launch`` queues nothing (counted)."""

    def __init__(self):
        self.launches = 0

    def launch(self, stream=None) -> None:
        self.launches += 1


def stub_replays(engine) -> list:
    """Replace both captured step graphs of ``engine`` by ``NoReplay`` (returned)."""
    if any(g is None for g in engine.graphs.slots):
        raise RuntimeError("both step graphs must be captured before they are stubbed")
    engine.graphs.slots = [NoReplay(), NoReplay()]
    return engine.graphs.slots


def time_steps(step, parts, next_committed, warmup: int, steps: int, clock=time.perf_counter) -> dict:
    """Medians (us) over ``steps`` steps after ``warmup`` of ``step(c)`` and of each of
    ``parts`` (``(name, fn(c))``, called in order as one step), the two kinds of step
    alternating (a load that drifts over the run weighs on both alike).
    ``next_committed()``: the committed count of the next step; ``clock``: seconds."""
    pc = clock
    whole = np.empty(steps)
    each = np.empty((len(parts), steps))
    for i in range(warmup + steps):
        k = i - warmup
        c = next_committed()
        t0 = pc()
        step(c)
        dt = pc() - t0
        c = next_committed()
        for j, (_, fn) in enumerate(parts):
            t1 = pc()
            fn(c)
            if k >= 0:
                each[j, k] = pc() - t1
        if k >= 0:
            whole[k] = dt
    out = {"step_us": float(np.median(whole)) * 1e6, "step_p90_us": float(np.percentile(whole, 90)) * 1e6}
    out.update({f"{name}_us": float(np.median(each[j])) * 1e6 for j, (name, _) in enumerate(parts)})
    return out


def _counter(c: int, accept: int):
    state = [c]

    def nxt():
        state[0] += accept
        return state[0] - accept
    return nxt


def bench_single(be, weights, capacity: int, accept: int, warmup: int, steps: int, seed: int,
                 clock=time.perf_counter) -> dict:
    cache, ring, c = steady_cache(be, weights, capacity, accept, 2 * (warmup + steps), seed)
    try:
        stubs = stub_replays(cache.engine)
        cfg = weights.config
        noise = np.random.default_rng(seed).standard_normal((cfg.q_len, cfg.hidden_size)).astype(np.float32)
        parts = [("begin_step", lambda c: cache.begin_step(ring, c)),
                 ("set_noise_embed", lambda c: cache.set_noise_embed(noise)),
                 ("run", lambda c: cache.run())]
        nxt = _counter(c, accept)
        row = time_steps(lambda c: cache.step(ring, c, noise), parts, nxt, warmup, steps, clock)
        assert sum(s.launches for s in stubs) == 2 * (warmup + steps), "one replay per step"
        assert cache.next_pos == nxt() - accept, "a stubbed step advances as run() does"
    finally:
        cache.close()
        ring.close()
    return row


def bench_lanes(be, weights, lanes: int, capacity: int, accept: int, warmup: int, steps: int, seed: int,
                clock=time.perf_counter) -> dict:
    b, c = steady_batch(be, weights, lanes, capacity, accept)
    try:
        stubs = stub_replays(b.engine)
        cfg = weights.config
        noise = np.random.default_rng(seed).standard_normal(
            (lanes, cfg.q_len, cfg.hidden_size)).astype(np.float32)
        parts = [("begin_step", lambda c: b.begin_step([c] * lanes)),
                 ("set_noise_embed", lambda c: b.set_noise_embed(noise)),
                 ("run", lambda c: b.run())]
        nxt = _counter(c, accept)
        row = time_steps(lambda c: b.step([c] * lanes, noise), parts, nxt, warmup, steps, clock)
        assert sum(s.launches for s in stubs) == 2 * (warmup + steps), "one replay per step"
        assert b.next_pos == [nxt() - accept] * lanes, "a stubbed step advances as run() does"
    finally:
        b.close()
    return row


def parse_args(argv=None):
    p = common.host_bench_parser("python -m profiling.bench_run_host", __doc__,
                                 json_default_name="bench_run_host.json", steps="2000", warmup="200")
    p.add_argument("--capacities", default=None, help="single cache capacities (default 2048,8192; smoke: 32)")
    p.add_argument("--lanes", default=None, help="batch lane counts (default 1,4,16,64; smoke: 1,3)")
    p.add_argument("--lane-capacity", type=int, default=256, help="each lane's capacity (default 256)")
    p.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="wall: perf_counter (default); thread: this thread's CPU time (a loaded machine's "
                        "preemptions not counted; each reading costs a system call)")
    p.add_argument("--json", action="store_true", help="end with the one-line JSON summary")
    a = p.parse_args(argv)
    a.capacities = common.int_list(a.capacities or ("32" if a.smoke else "2048,8192"))
    a.lanes = common.int_list(a.lanes or ("1,3" if a.smoke else "1,4,16,64"))
    a.steps = a.steps if a.steps is not None else (50 if a.smoke else 2000)
    a.warmup = a.warmup if a.warmup is not None else (5 if a.smoke else 200)
    return a


def main(argv=None) -> dict:
    args = parse_args(argv)
    be = backends.get(args.backend)
    out = Path(args.out) if args.out else common.default_out(be, "bench_run_host.json")
    weights = common.RandomDraftWeights(common.drafter_config("tiny"), be, seed=args.seed)
    clock = CLOCKS[args.clock]
    print(f"bench_run_host: backend={be.name} (replay stubbed) steps={args.steps} accept={args.accept} "
          f"clock={args.clock}", flush=True)
    configs = [(f"single {cap}", lambda cap=cap: bench_single(be, weights, cap, args.accept, args.warmup,
                                                               args.steps, args.seed, clock))
               for cap in args.capacities]
    configs += [(f"lanes {n}", lambda n=n: bench_lanes(be, weights, n, args.lane_capacity, args.accept,
                                                        args.warmup, args.steps, args.seed, clock))
                for n in args.lanes]
    rows = []
    print(f"  {'':12s} {'step()':>8s} {'p90':>8s} " + " ".join(f"{p:>15s}" for p in PARTS) + "   (us, medians)")
    for name, fn in configs:
        row = {"config": name, **fn()}
        rows.append(row)
        print(f"  {name:12s} {row['step_us']:8.2f} {row['step_p90_us']:8.2f} "
              + " ".join(f"{row[p + '_us']:15.2f}" for p in PARTS), flush=True)
    result = {"bench": "run_host", "meta": common.meta(be, argv), "args": vars(args), "rows": rows,
              "step_host_us": {r["config"]: round(r["step_us"], 3) for r in rows}}
    common.write_json(out, result)
    print(f"results: {out}")
    if args.json:
        print(json.dumps({"step_host_us": result["step_host_us"]}))
    return result


if __name__ == "__main__":
    main()
