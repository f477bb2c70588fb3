"""Counters of a recorded launch measured by the emulator (its counter mode).

``emulated_counters(launch)`` takes a ``step_trace.Launch`` (real shapes, the
product's own grid), compiles its kernel variant on the emulated backend,
rebuilds its arrays in emulated memory and runs a sample of its blocks
(``counters.sample_blocks``: the first, the last and seeded others) with
``dflash_cupy.emu.counting.count_launch``; the additive counters are
scaled by the grid (``counters.scale_sample``). The outputs of blocks that do
not run are not written: nothing reads them.

Arrays: each argument's whole allocation (the recording's root array, so a view
keeps its offset and neighbours) is a fresh zero-filled emulated allocation
(pages are mapped lazily: a 400 MB weight costs what the sampled blocks touch);
allocations of at most ``COPY_LIMIT`` bytes get the recording's bytes, i.e. what
the host sent by the time of the step (the step descriptor: ``n_new``, positions)
and zeros for what kernels would have written. Data-dependent paths therefore
follow the step's descriptor, not real activations (no kernel branches on those).

What is measured and what is not (``KernelCounters.notes`` says it per launch):
global requests, sectors and requested bytes, shared-memory requests and
wavefronts (and the conflict-free count), ``mma.sync`` and ``__syncthreads``
are counted; a sample is scaled as ``run_counted`` says (edge blocks counted
once, the seeded others scaled). Distinct bytes per array
(``bytes_read``/``bytes_written``) are exact when every block ran, else the
sample's scaled the same way and capped at the array's size. ``dram_bytes``
(compulsory HBM bytes) stays the static model's: which arrays stay in L2 (split-K
partials, activations) is a cache question, not a count. The latency path
(round trips) and the bytes in flight stay static estimates: the emulator has
no clock. ``compare`` holds the static estimate's figures beside them.
"""
from __future__ import annotations

import time

import numpy as np

from dflash_cupy.backends import signatures

from . import counters as ctr

COPY_LIMIT = 1 << 20       # allocations up to this size carry the recording's bytes
DEFAULT_SAMPLE = 8         # blocks per launch (first, last and 6 seeded; z columns: see run_counted)
COMPARE = ("gld_requests", "gld_sectors", "gst_requests", "gst_sectors", "l2_bytes", "sector_efficiency",
           "smem_requests", "smem_wavefronts", "bank_conflict_factor", "mma", "wgmma_mma", "barriers", "dram_bytes")


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def emulated_arrays(launch, backend=None) -> list:
    """The launch's arguments on the emulated backend: arrays rebuilt as the module
    docstring says (one allocation per recorded root), scalars as NumPy scalars."""
    from dflash_cupy.emu import guarded_memory as emu_memory

    if len(launch.arrays) != len(launch.args):
        raise ValueError(f"launch of {launch.kernel} has no recorded arrays (recorded by an older step_trace?)")
    roots: dict = {}

    def rebuilt(ref, arr):
        if arr is None:
            return ref
        root = _root(arr)
        e = roots.get(id(root))
        if e is None:
            e = emu_memory.guarded_empty(root.shape, root.dtype, "device array")
            if root.nbytes <= COPY_LIMIT and root.flags.c_contiguous:
                e.reshape(-1).view(np.uint8)[:] = root.reshape(-1).view(np.uint8)
            roots[id(root)] = e
        off = arr.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        return np.ndarray(arr.shape, arr.dtype, buffer=e.reshape(-1).view(np.uint8), offset=off,
                          strides=arr.strides)
    # a struct argument (a dict of fields) field by field
    return [{k: rebuilt(ref[k], arr[k]) for k in ref} if isinstance(ref, dict) else rebuilt(ref, arr)
            for ref, arr in zip(launch.args, launch.arrays)]


def _scalar(kernel, args) -> list:
    """Recorded scalars (Python ints/floats) as the NumPy types of the parameters."""
    def typed(p, a):
        return a if p.is_pointer else np.dtype(p.dtype).type(a)
    return [{f.name: typed(f, a[f.name]) for f in p.fields} if p.is_struct else typed(p, a)
            for p, a in zip(kernel.sig.params, args)]


_ADDITIVE = ("gld_requests", "gld_sectors", "gld_bytes", "gst_requests", "gst_sectors", "gst_bytes",
             "sld_requests", "sld_wavefronts", "sld_ideal", "sst_requests", "sst_wavefronts", "sst_ideal",
             "mma", "barriers", "other_accesses", "other_bytes", "wgmma", "wgmma_mma", "wgmma_smem_bytes")


def _combine(edge, inner, f: float):
    """``edge + f * inner`` for the additive counts (``inner`` may be None)."""
    if inner is None:
        return edge
    for k in _ADDITIVE:
        setattr(edge, k, getattr(edge, k) + int(round(f * getattr(inner, k))))
    for name, ac in inner.arrays.items():
        e = edge.arrays.setdefault(name, type(ac)())
        for k in vars(ac):
            setattr(e, k, getattr(e, k) + int(round(f * getattr(ac, k))))
    by = {(x.addr, x.kind): x for x in edge.sites}
    for x in inner.sites:
        e = by.get((x.addr, x.kind))
        if e is None:
            e = by[(x.addr, x.kind)] = type(x)(x.addr, x.kind, x.width, 0, 0, 0, 0)
            edge.sites.append(e)
        e.width = max(e.width, x.width)
        for k in ("requests", "units", "ideal", "bytes"):
            setattr(e, k, getattr(e, k) + int(round(f * getattr(x, k))))
    return edge


def run_counted(launch, *, n: int = DEFAULT_SAMPLE, seed: int = 0, backend=None):
    """``(LaunchCounts, sample, kernel)`` of ``launch`` run in counter mode on about ``n``
    blocks picked by ``counters.sample_blocks`` (whole z columns when the grid has
    z > 1). When that is not the whole grid, the counts come back already scaled to
    the whole grid, without bias from the edge blocks (first and last, often the
    short ones): first + last + (columns - 2) x the mean of the seeded others;
    ``blocks_run`` is the number of blocks that ran."""
    from dflash_cupy import backends, kernels
    from dflash_cupy.emu.counting import count_launch

    be = backend or backends.get("emulated")
    mod = kernels.load_module(be, launch.file, **launch.defines)
    k = mod.get_function(launch.kernel)
    args = _scalar(k, emulated_arrays(launch, be))
    gx, gy, gz = launch.grid
    total = launch.n_blocks
    # A grid with z > 1 is sampled by whole z columns: split K's last slice of a column
    # reduces the partials, which a sample of lone blocks would never run.
    cols = ctr.sample_blocks((gx, gy, 1), n=max(2, -(-max(2, n) // gz), 3 if gz > 1 else 2), seed=seed)
    if len(cols) == gx * gy:
        sample = [(x, y, z) for z in range(gz) for y in range(gy) for x in range(gx)]
        return count_launch(k, launch.grid, launch.block, args, launch.shared_mem, blocks=sample), sample, k
    last = (gx - 1, gy - 1, 0)
    edge_cols = [c for c in cols if c in ((0, 0, 0), last)]
    inner_cols = [c for c in cols if c not in ((0, 0, 0), last)]
    blocks = lambda cs: [(x, y, z) for (x, y, _) in cs for z in range(gz)]  # noqa: E731
    lc = count_launch(k, launch.grid, launch.block, args, launch.shared_mem, blocks=blocks(edge_cols))
    if inner_cols:
        inner = count_launch(k, launch.grid, launch.block, args, launch.shared_mem, blocks=blocks(inner_cols))
        lc = _combine(lc, inner, (gx * gy - len(edge_cols)) / len(inner_cols))
    else:   # only the two edge columns were drawn (n = 2): scale them as they are
        zero = type(lc)(lc.kernel, lc.grid, lc.block, lc.blocks_total)
        lc = _combine(zero, lc, gx * gy / len(edge_cols))
    sample = blocks(edge_cols) + blocks(inner_cols)
    lc.blocks_run = len(sample)
    lc.scaled = True
    return lc, sample, k


def to_counters(launch, lc, kernel, static: ctr.KernelCounters | None = None) -> ctr.KernelCounters:
    """A ``KernelCounters`` from the emulator's counts, scaled to the grid; what the
    emulator cannot count comes from ``static`` (module docstring)."""
    static = static if static is not None else ctr.static_counters(launch)
    full = lc.blocks_run == launch.n_blocks
    c = ctr.KernelCounters(launch.kernel, "emulator" if full else f"emulator ({lc.blocks_run} blocks scaled)",
                           launch.n_blocks)
    for k in ("gld_requests", "gld_sectors", "gld_bytes", "gst_requests", "gst_sectors", "gst_bytes",
              "mma", "barriers", "wgmma_mma", "wgmma_smem_bytes"):
        setattr(c, k, getattr(lc, k))
    c.smem_requests, c.smem_wavefronts, c.smem_ideal_wavefronts = lc.smem_requests, lc.smem_wavefronts, lc.smem_ideal
    if getattr(lc, "scaled", False) or full:
        c.blocks_counted = lc.blocks_run   # run_counted scaled them already
    else:
        ctr.scale_sample(c, lc.blocks_run)
    flat = [(p, a) for p, a in signatures.leaves(kernel.sig.params, launch.args) if p.is_pointer]
    names = {p.name: getattr(a, "name", p.name) for p, a in flat}
    sizes = {p.name: getattr(a, "nbytes", 0) for p, a in flat}
    for pname, ac in lc.arrays.items():
        name = names.get(pname, pname)
        cap = sizes.get(pname, 0) or float("inf")
        if ac.read_distinct:
            c.bytes_read[name] = int(min(cap, ac.read_distinct))
        if ac.written_distinct:
            c.bytes_written[name] = int(min(cap, ac.written_distinct))
    # Compulsory HBM bytes stay the static model's: which arrays stay in L2 (split-K
    # partials, activations) is a cache question, not a count.
    c.dram_bytes = static.dram_bytes
    measured = sum(c.bytes_read.values()) + sum(c.bytes_written.values())
    c.notes.append(f"distinct bytes touched{'' if full else ' (sample scaled, capped at each array)'}: "
                   f"{measured / 1e6:.2f} MB (static compulsory: {static.dram_bytes / 1e6:.2f} MB)")
    c.dram_round_trips_per_block = static.dram_round_trips_per_block
    c.l2_round_trips_per_block = static.l2_round_trips_per_block
    c.tail_l2_round_trips = static.tail_l2_round_trips
    c.tail_l2_bytes = static.tail_l2_bytes
    c.epilogue_rope_rounds = static.epilogue_rope_rounds
    c.epilogue_copy_rounds = static.epilogue_copy_rounds
    c.inflight_peak_bytes_per_warp = static.inflight_peak_bytes_per_warp
    c.notes += [n for n in static.notes]
    c.hot_sites = hot_sites(lc)
    for h in c.hot_sites:
        c.notes.append(f"{h['kind']} of {h['width']} B at {h['where']}: {h['waste']:.2f}x the minimum "
                       f"{'sectors' if h['kind'].startswith('global') else 'wavefronts'} "
                       f"({100 * h['share']:.0f}% of the kernel's)")
    if lc.other_accesses:
        c.notes.append(f"{lc.other_accesses} accesses ({lc.other_bytes} B) outside the arguments, shared "
                       f"memory and the stack (__device__ globals?) not counted")
    c.compare = {k: getattr(static, k) for k in COMPARE}
    c.compare["source"] = static.source
    return c


def hot_sites(lc, waste: float = 1.25, share: float = 0.05, top: int = 3) -> list:
    """The instruction sites that cost the most above their minimum (uncoalesced
    global accesses, bank-conflicted shared ones): ``waste`` = units / ideal at
    least ``waste`` and at least ``share`` of the kernel's sectors (global) or
    wavefronts (shared); the ``top`` largest excesses, resolved to file:line."""
    from dflash_cupy.emu.counting import resolve_sites

    tot = {"global": sum(x.units for x in lc.sites if x.kind.startswith("global")),
           "shared": sum(x.units for x in lc.sites if x.kind.startswith("shared"))}
    bad = [x for x in lc.sites if x.waste >= waste and tot[x.kind.split()[0]]
           and x.units >= share * tot[x.kind.split()[0]]]
    bad.sort(key=lambda x: -(x.units - x.ideal))
    bad = bad[:top]
    if bad:
        resolve_sites(type(lc)(lc.kernel, lc.grid, lc.block, lc.blocks_total, sites=bad,
                               module_path=lc.module_path))
    return [{"where": x.where, "kind": x.kind, "width": x.width, "requests": x.requests, "units": x.units,
             "ideal": x.ideal, "waste": x.waste, "share": x.units / tot[x.kind.split()[0]]} for x in bad]


def emulated_counters(launch, *, n: int = DEFAULT_SAMPLE, seed: int = 0, backend=None) -> ctr.KernelCounters:
    """Measured counters of one recorded launch (module docstring)."""
    lc, _, k = run_counted(launch, n=n, seed=seed, backend=backend)
    return to_counters(launch, lc, k)


class EmulatedSource:
    """``counter_source`` for ``perf_model.model_step``: emulated counters, one
    counted run per distinct launch (kernel variant, grid, block, shared memory,
    scalars, array shapes, what the plan knows): the layers repeat. ``seconds``
    accumulates the time spent counting (and compiling)."""

    def __init__(self, n: int = DEFAULT_SAMPLE, seed: int = 0, backend=None, log=None):
        self.n, self.seed, self.backend, self.log = n, seed, backend, log
        self._cache: dict = {}
        self.seconds = 0.0
        self.runs = 0
        self.failures: list = []   # (kernel, message) of launches that kept their static estimate

    @staticmethod
    def key(launch) -> tuple:
        return (launch.variant(), launch.grid, launch.block, launch.shared_mem,
                tuple((a.shape, a.dtype) if hasattr(a, "shape") else a for a in launch.leaves()),
                tuple(sorted(launch.known.items())))

    def __call__(self, launch) -> ctr.KernelCounters:
        k = self.key(launch)
        c = self._cache.get(k)
        if c is None:
            from dflash_cupy.backends.base import BackendError, KernelLaunchError

            t = time.perf_counter()
            try:
                c = emulated_counters(launch, n=self.n, seed=self.seed, backend=self.backend)
            except (BackendError, KernelLaunchError) as e:
                # a launch the emulator cannot run as recorded keeps its static estimate, said so
                c = ctr.static_counters(launch)
                c.notes.append(f"emulator counter run failed, static estimate kept: {str(e)[:300]}")
                self.failures.append((launch.kernel, str(e)))
            self._cache[k] = c
            dt = time.perf_counter() - t
            self.seconds += dt
            self.runs += 1
            if self.log:
                self.log(f"counted {launch.kernel} grid {launch.grid}: {c.blocks_counted} of {c.blocks} "
                         f"blocks in {dt:.1f} s")
        return c
