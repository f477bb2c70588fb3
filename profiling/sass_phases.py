"""A launch's phases as compiled: the SASS reader's loops with trip counts from the emulator.

The SASS reader (``profiling.sass``) knows what one iteration of each loop does
(round trips, loads and bytes in flight, issue slots) but not how often a loop
runs when its bound is a run-time value. The emulator knows that: its counter
mode counts every warp-level execution of each global-load site of the g++ build
(``dflash_cupy.emu.counting``), and ``-lineinfo`` names the same source lines in the SASS.
So, per launch:

* the blocks of one z column are run one by one in counter mode (split K's last
  slice reduces, so the reducing block is among them) and each source line's
  load executions per warp are taken in the busiest block (the critical path);
* a SASS loop's trips = the executions of a source line whose loads sit only in
  that loop (copies of a loop that ptxas duplicated share them equally) / the
  loop's loads of that line per iteration;
* a phase is a loop (trips x its round trips per iteration, its peak bytes in
  flight, its issue slots) or the straight-line code between loops.

``launch_phases(launch)`` returns them, cached on disk by the launch's variant,
shape and the sources' digest (``nvrtc_info.cache_key``), so a model run
recounts nothing. What it cannot see: data-dependent trip counts beyond the
recorded step's data, and anything the compiler decides at run time (nothing).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dflash_cupy import kernels
from dflash_cupy.backends import nvrtc_info

from . import sass

_VERSION = "7"   # 3: phases counted before the site-resolution fix (emulator frames by name) are recounted;
#                  4: the key names the launch's known device values (tile_live, pad_lo);
#                  5: an arrival kernel's blocks are all counted (the last one's work, e.g. the walk)
#                  6, 7: every small one-slice grid's blocks are counted; the busiest warp's executions too;
#                     executions in bytes a lane
# A grid of one z slice with at most this many blocks a row has every block of its first row
# counted, in index order: an arrival kernel's last block (the serial work after the arrival) and
# a grid of blocks with different roles (e.g. the selector's projection slices and merge rows)
# are among them; wider grids count their middle block only.
ARRIVAL_SCAN_MAX = 64
_WHERE = re.compile(r"^(\S+?):(\d+)")


@dataclass
class Phase:
    kind: str                 # "loop" | "straight"
    where: str                # "0x43f0-0xa8f0" or "outside loops"
    depth: int = 0
    trips: float = 1.0        # per thread of the busiest block (None-free: 0 when never run)
    round_trips: int = 0      # per iteration
    chain: float = 0.0        # the busiest warp's trips x round_trips: the dependent global-load chain
    global_loads: int = 0     # per iteration
    global_bytes: int = 0     # per iteration
    peak_inflight_bytes: int = 0
    instructions: int = 0     # per iteration (issue slots)
    barriers: int = 0
    fences: int = 0
    atomics: int = 0
    lines: list = field(default_factory=list)
    trips_from: str = ""      # "sass" (an immediate bound), "emulator: file:line", or "unknown"
    # a loop with inner loops: the round trips of each run of its own code between them (the
    # inner loops' loads separate the runs, as loops cut straight-line code into phases)
    run_round_trips: list = field(default_factory=list)
    warp_trips: float | None = None   # the busiest warp's trips (None: as trips): one warp issues at
    #                                   most one instruction a clock, so a loop one warp runs alone
    #                                   costs its instructions x these trips at least
    coherent_bytes: int = 0   # of global_bytes: L2-coherent loads (ld.cg), e.g. a split K's partials
    evict_first_bytes: int = 0   # of global_bytes: evict-first loads (ld.cs), a weight stream

    def longest_chain(self) -> float:
        """The longest dependent chain with nothing between its loads: the whole phase for
        straight code and innermost loops, the longest run between inner loops (x trips) else."""
        wt = self.trips if self.warp_trips is None else max(self.trips, self.warp_trips)
        return wt * max(self.run_round_trips) if self.run_round_trips else self.chain


def _line_key(src: tuple) -> str:
    return f"{src[0]}:{src[1]}"


_KIND = {"LDG": "global load", "LD": "global load", "LDGSTS": "global load", "STG": "global store",
         "ST": "global store", "LDS": "shared load", "LDSM": "shared load", "STS": "shared store"}


def _witness(ins) -> str | None:
    """The emulator's key of a memory instruction: ``file:line|kind`` (None: not one)."""
    kind = _KIND.get(ins.base)
    return f"{_line_key(ins.src)}|{kind}" if kind and ins.src[0] else None


def line_executions(launch, backend=None, scan_row: bool = False) -> dict[str, float]:
    """``{"file:line|kind": executions per warp}`` (and ``{"file:line|kind|warp": the busiest
    warp's executions}``), in bytes a lane (executions x access width), of each source line's
    global and shared loads and stores ("global load", "global store", "shared load", "shared store") in the busiest
    block of one z column of ``launch`` (``step_trace.Launch``), run in counter mode.
    ``scan_row``: every block of the first grid row instead (each line its most in one block),
    counted one after another on the same arrays, so an arrival kernel's last block does the
    work that follows its arrival."""
    from dflash_cupy import backends
    from dflash_cupy.emu.counting import count_launch, resolve_sites

    from .emulated_counters import _scalar, emulated_arrays

    be = backend or backends.get("emulated")
    mod = kernels.load_module(be, launch.file, **launch.defines)
    k = mod.get_function(launch.kernel)
    args = _scalar(k, emulated_arrays(launch, be))
    gx, gy, gz = launch.grid
    warps = max(1, -(-launch.threads // 32))
    best: dict[str, float] = {}
    # a middle column group; GS_CONV: the first, whose blocks convolve the most channels
    x = 0 if launch.defines.get("GS_CONV", 0) else gx // 2
    cells = [(b, 0, 0) for b in range(gx)] if scan_row else [(x, 0, z) for z in range(gz)]
    for cell in cells:
        lc = count_launch(k, launch.grid, launch.block, args, launch.shared_mem, blocks=[cell])
        resolve_sites(lc)
        per: dict[str, float] = {}
        for s in lc.sites:
            m = _WHERE.match(s.where or "")
            if m:
                key = f"{m.group(1)}:{m.group(2)}|{s.kind}"
                # bytes a lane (phases_of counts the SASS's in bytes too)
                per[key] = per.get(key, 0.0) + s.requests * max(1, s.width) / warps
                per[key + "|warp"] = per.get(key + "|warp", 0.0) + s.warp_requests * max(1, s.width)
        for key, v in per.items():
            best[key] = max(best.get(key, 0.0), v)
    return best


def phases_of(ks: sass.KernelSass, executions: dict[str, float] | None) -> list[Phase]:
    """The kernel's phases; loop trips from ``executions`` (``line_executions``) where the
    loop's bound is not an immediate."""
    loops = ks.loops
    # each memory instruction's innermost loop (None: straight-line code): the emulator counts
    # every global and shared access per source line, so each is a witness of its loop's trips
    home: dict[int, sass.Loop | None] = {}
    for ins in ks.instrs:
        if _witness(ins):
            inner = [l for l in loops if ins.addr in l.addrs]
            home[ins.addr] = min(inner, key=lambda l: len(l.addrs)) if inner else None
    per_line: dict[str, dict] = {}
    for ins in ks.instrs:
        if ins.addr in home:
            # counted in bytes a lane: ptxas may merge a line's accesses into wider ones (two
            # 8-byte shared reads into one LDS.128) or split them; the bytes stay the same
            d = per_line.setdefault(_witness(ins), {})
            d[id(home[ins.addr])] = d.get(id(home[ins.addr]), 0) + max(1, sass.access_bytes(ins))
    # global loads first: the most direct witnesses; then shared loads, then stores (a store is
    # often one thread's result, e.g. a top-K round's winner, which counts a loop's trips short)
    _rank = {"global load": 0, "shared load": 1, "global store": 2, "shared store": 3}
    per_line = dict(sorted(per_line.items(), key=lambda kv: _rank.get(kv[0].rsplit("|", 1)[1], 4)))
    # Trips (total iterations per warp): each source line's executions are its straight-line
    # loads (once each) plus, per loop holding some, the loop's loads of it per iteration x the
    # loop's trips. Solved line by line while a line leaves one loop unknown; copies of a loop
    # that ptxas duplicated (several unknowns on one line) then share what is left equally.
    trips: dict[int, tuple[float, str]] = {id(l): (float(l.trips), "sass") for l in loops if l.trips is not None}
    if executions and per_line and not any(k in executions for k in per_line):
        # every counted access resolved outside the kernel's lines (e.g. to an emulator
        # header): the loops would silently keep one trip each
        raise ValueError(f"{ks.name}: none of the emulator's counted sites ({sorted(executions)[:4]} ...) "
                         f"is a source line of the kernel's SASS ({sorted(per_line)[:4]} ...)")
    if executions is not None:
        for _ in range(len(loops) + 1):
            progress = False
            for key, d in per_line.items():
                e = executions.get(key)
                unknown = [lid for lid in d if lid != id(None) and lid not in trips]
                if e is None or len(unknown) != 1:
                    continue
                rest = e - d.get(id(None), 0) - sum(n * trips[lid][0] for lid, n in d.items()
                                                    if lid != id(None) and lid in trips)
                trips[unknown[0]] = (max(0.0, rest / d[unknown[0]]), f"emulator: {key}")
                progress = True
            if not progress:
                break
        for key, d in per_line.items():
            e = executions.get(key)
            unknown = [lid for lid in d if lid != id(None) and lid not in trips]
            if e is None or not unknown:
                continue
            rest = e - d.get(id(None), 0) - sum(n * trips[lid][0] for lid, n in d.items()
                                                if lid != id(None) and lid in trips)
            share = max(0.0, rest) / sum(d[lid] for lid in unknown)
            for lid in unknown:
                trips[lid] = (share, f"emulator: {key}, shared by {len(unknown)} copies")
        # an immediate bound is a loop's most: one with a second exit (a run-time count of
        # items) or that some warps skip (a walk one warp runs) runs fewer trips on average,
        # which its loads witness (a load is every thread's that runs the loop)
        for key, d in per_line.items():
            e = executions.get(key)
            lids = [lid for lid in d if lid != id(None)]
            if e is None or len(lids) != 1 or not key.endswith("load"):
                continue
            t, src = trips.get(lids[0], (None, ""))
            seen = max(0.0, (e - d.get(id(None), 0)) / d[lids[0]])
            if src == "sass" and seen < t:
                trips[lids[0]] = (seen, f"emulator: {key} (below the immediate bound {t:g})")
        # a loop none of whose memory accesses ran in the busiest block did not run there
        for l in loops:
            lines = {_witness(i) for i in ks.instrs if home.get(i.addr) is l}
            if id(l) not in trips and lines:
                if not any(executions.get(k) for k in lines):
                    trips[id(l)] = (0.0, "emulator: not run")
    # the busiest warp's trips of each loop: the same solve with that warp's executions, from
    # the lines whose accesses sit in one loop only (a loop some warps skip, e.g. a walk one
    # warp runs, runs more often in the busiest warp than on average)
    warp_trips: dict[int, float] = {}
    if executions is not None:
        for key, d in per_line.items():
            e = executions.get(key + "|warp")
            lids = [lid for lid in d if lid != id(None)]
            if e is None or len(lids) != 1:
                continue
            t = max(0.0, (e - d.get(id(None), 0)) / d[lids[0]])
            warp_trips[lids[0]] = max(warp_trips.get(lids[0], 0.0), t)
    # Code that did not run is not issued: a basic block of a loop's own code whose every
    # memory access the emulator saw none of (the sampled branch of a greedy walk), in a loop
    # that ran and has lines that did, is left out of the loop's issue slots.
    dead: dict[int, int] = {}
    if executions:
        own = {}
        for l in loops:
            inner = set().union(*[c.addrs for c in loops if c is not l and c.addrs < l.addrs])
            own[id(l)] = l.addrs - inner
        ran = {lid for lid, d in ((lid, [k for k, dd in per_line.items() if lid in dd]) for lid in own)
               if any(executions.get(k, 0) > 0 for k in d)}
        blocks, _ = sass.basic_blocks(ks.instrs)
        for first, last in blocks:
            run = ks.instrs[first:last + 1]
            keys = [_witness(i) for i in run if _witness(i)]
            if not keys or any(executions.get(k, 0) > 0 for k in keys):
                continue
            holder = [lid for lid, a in own.items() if run[0].addr in a and run[-1].addr in a]
            if holder and holder[0] in ran:
                dead[holder[0]] = dead.get(holder[0], 0) + len(run)
    out = []
    for l in loops:
        t, src = trips.get(id(l), (1.0, "unknown"))
        # a dependent chain is one warp's: the busiest warp's trips of it (a loop half the warps
        # skip is as long for the others as if all ran it; its issue is the average's)
        wt = max(t, warp_trips.get(id(l)) or 0.0)
        out.append(Phase("loop", f"{l.head:#06x}-{l.tail:#06x}", l.depth, t, l.round_trips, wt * l.round_trips,
                         l.global_loads, l.global_bytes, l.peak_inflight_bytes,
                         max(1, l.instructions - dead.get(id(l), 0)), l.barriers,
                         l.fences, l.atomics, [f"{f}:{n}" for f, n in l.lines], src,
                         _own_runs(ks, l, loops), warp_trips.get(id(l)), l.coherent_bytes,
                         l.evict_first_bytes))
    # straight-line code, cut where loops sit: each run between two loops is a phase of its own
    in_loop = {i.addr for l in loops for i in ks.instrs if i.addr in l.addrs}
    for run in _runs(ks.instrs, in_loop):
        r, _, _ = sass.replay(run)
        if not r.global_loads and not r.fences and not r.atomics and not r.barriers:
            continue
        out.append(Phase("straight", f"{run[0].addr:#06x}-{run[-1].addr:#06x}", 0, 1.0, r.round_trips,
                         float(r.round_trips), r.global_loads, r.global_bytes, r.peak_inflight_bytes,
                         r.instructions, r.barriers, r.fences, r.atomics,
                         sorted({_line_key(x) for x in r.lines}), "sass", coherent_bytes=r.coherent_bytes))
    return out


def _own_runs(ks, loop, loops) -> list:
    """Round trips of each run of ``loop``'s own instructions between its inner loops (empty:
    it has none, its body is one run)."""
    inner = {a for l in loops if l is not loop and l.addrs < loop.addrs for a in l.addrs}
    if not inner:
        return []
    body = [i for i in ks.instrs if i.addr in loop.addrs]
    return [sass.replay(run)[0].round_trips for run in _runs(body, inner)] or [0]


def _runs(instrs, cut) -> list:
    """``instrs`` in runs of consecutive instructions whose addresses are not in ``cut``."""
    runs, cur = [], []
    for ins in instrs:
        if ins.addr in cut:
            if cur:
                runs.append(cur)
                cur = []
        else:
            cur.append(ins)
    if cur:
        runs.append(cur)
    return runs


def _cache_path(launch) -> Path:
    path = kernels.source_path(launch.file)
    source = path.read_text()
    arch = nvrtc_info.declared_arch(source) or nvrtc_info.ARCH
    key = nvrtc_info.cache_key(source, str(path), kernels.compile_options(**launch.defines), arch)
    shape = "_".join(str(v) for v in (*launch.grid, *launch.block, launch.shared_mem))
    # the values the kernel reads from device memory at run time (which row tiles are live,
    # where padding starts) decide its loops' trips as much as the shape does
    known = hashlib.sha256(repr(sorted(launch.known.items())).encode()).hexdigest()[:16]
    d = nvrtc_info.cache_root().parent / "sass_phases"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{key}-{shape}-{known}-{_VERSION}.json"


def launch_phases(launch, *, emulate: bool = True, backend=None) -> tuple[sass.KernelSass, list[Phase]]:
    """The SASS facts and phases of one recorded launch (cached on disk)."""
    ks = sass.launch_facts(launch)
    execs = None
    if emulate and any(l.trips is None for l in ks.loops):
        p = _cache_path(launch)
        try:
            execs = json.loads(p.read_text())
        except (OSError, ValueError):
            gx, _, gz = launch.grid
            scan = gz == 1 and 1 < gx <= ARRIVAL_SCAN_MAX
            execs = line_executions(launch, backend, scan_row=scan)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=p.stem, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(execs, f)
            os.replace(tmp, p)
    return ks, phases_of(ks, execs)


def describe(phases: list[Phase]) -> str:
    rows = []
    for p in phases:
        rows.append(f"  {'  ' * p.depth}{p.kind:8} {p.where:17} trips {p.trips:7.1f} ({p.trips_from})  "
                    f"chain {p.chain:6.1f} round trips  {p.global_loads} LDG/iter  "
                    f"peak {p.peak_inflight_bytes} B in flight  {p.instructions} instr/iter  "
                    f"{p.barriers} BAR {p.fences} fence {p.atomics} atom  [{', '.join(p.lines[:3])}]")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- time
# A fence (MEMBAR.SC.GPU) waits until the SM's outstanding writes are visible at the L2: about
# one L2 round trip; an atomic's result comes back from the L2: one more. Labelled estimates.
FENCE_L2_TRIPS = 1.0
ATOMIC_L2_TRIPS = 1.0
ISSUE_PER_CLK_SM = 4.0     # four warp schedulers per SM, one instruction each per clock


def stream_phase(phases: list[Phase]) -> Phase | None:
    """The phase that moves the most global bytes (trips x bytes per iteration) with 16-byte
    loads: the weight stream of a GEMM, the K/V tiles of the attention. A loop of evict-first
    loads (ld.global.cs, how gemm_stream.cu streams its weights) is that stream before any
    other; L2-coherent loads (ld.cg) never are: they read what other blocks of the launch
    wrote. In a thin K slice's reducing block the partial tiles, or the prepare convolution's
    rows, may outweigh the slice's own weights, yet every block streams its weights and only
    a few reduce."""
    cands = [p for p in phases if p.kind == "loop" and p.global_bytes > p.coherent_bytes and p.global_loads]
    return max(cands, key=lambda p: (p.trips * p.evict_first_bytes, p.trips * (p.global_bytes - p.coherent_bytes)),
               default=None)


@dataclass
class CompiledTime:
    """One launch's time as its compiled phases run one after another (seconds)."""
    stream_s: float = 0.0         # the stream: its bytes at the bandwidth its bytes in flight allow
    stream_bound: str = ""        # "hbm" (the chip's bandwidth) or "in flight" (Little's law per SM)
    stream_hbm_s: float = 0.0     # the same bytes at the chip's bandwidth (the stream's loss: the rest)
    inflight_per_sm: float = 0.0  # bytes
    phases_s: float = 0.0         # the other phases' dependent chains (or issue), per block, x rounds
    fences_s: float = 0.0
    total_s: float = 0.0
    terms: list = field(default_factory=list)   # (seconds, what, where) largest first

    def largest(self) -> tuple:
        return self.terms[0] if self.terms else (0.0, "", "")


def compiled_time(phases: list[Phase], *, gpu, threads: int, resident: int, per_sm_max: int, rounds: int,
                  blocks: int, dram_bytes: float) -> CompiledTime:
    """``resident``: blocks of this launch on one SM at once; ``per_sm_max``: blocks the
    busiest SM runs; ``rounds``: ceil(blocks / slots); ``dram_bytes``: the launch's compulsory
    bytes."""
    ct = CompiledTime()
    st = stream_phase(phases)
    warps = max(1, threads // 32)
    if st is not None:
        ct.inflight_per_sm = st.peak_inflight_bytes * threads * resident
        bytes_sm = dram_bytes * per_sm_max / max(1, blocks)
        hbm = dram_bytes / gpu.hbm_Bps
        little = bytes_sm * gpu.hbm_latency_s / ct.inflight_per_sm if ct.inflight_per_sm else hbm
        ct.stream_hbm_s = hbm
        ct.stream_s, ct.stream_bound = (hbm, "hbm") if hbm >= little else (little, "in flight")
        ct.terms.append((ct.stream_s, f"stream ({ct.stream_bound}: {ct.inflight_per_sm / 1024:.1f} KB in flight "
                         f"per SM, {st.trips:.1f} trips x {st.round_trips} round trips)", st.where, st.lines))
    clk = gpu.clock_hz
    for p in phases:
        if p is st:
            continue
        chain = p.chain * gpu.l2_latency_s
        issue = p.instructions * p.trips * warps * resident / ISSUE_PER_CLK_SM / clk
        # one warp issues at most one instruction a clock: a loop its busiest warp runs alone
        # (the walk of one warp) costs that warp's instruction stream at least
        wt = p.trips if p.warp_trips is None else max(p.trips, p.warp_trips)
        issue = max(issue, p.instructions * wt / clk)
        fences = p.trips * (p.fences * FENCE_L2_TRIPS + p.atomics * ATOMIC_L2_TRIPS) * gpu.l2_latency_s
        t = (max(chain, issue)) * rounds
        ct.phases_s += t
        ct.fences_s += fences * rounds
        if t + fences > 0:
            what = (f"{p.kind} chain {p.chain:.1f} round trips" if chain >= issue else
                    f"{p.kind} issue {p.instructions * p.trips:.0f} instr/warp")
            if fences:
                what += f" + {p.fences} fences / {p.atomics} atomics"
            ct.terms.append((t + fences * rounds, what, p.where, p.lines))
    ct.total_s = ct.stream_s + ct.phases_s + ct.fences_s
    ct.terms.sort(key=lambda x: -x[0])
    return ct
