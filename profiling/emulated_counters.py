"""Counters of a recorded launch measured by the emulator (its counter mode).

``emulated_counters(launch)`` takes a ``launch_plan.Launch`` (real shapes, the
product's own grid), compiles its kernel variant on the emulated backend,
rebuilds its arrays in emulated memory and runs a sample of its blocks
(``counters.sample_blocks``: the first, the last and seeded others) with
``dflash_cupy.backends.emu_counters.count_launch``; the additive counters are
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
are counted. Distinct bytes per array (``bytes_read``/``bytes_written``) and
``dram_bytes`` are exact when every block ran; a sampled launch scales the
sample's distinct bytes (capped at the array's size) and keeps the static
``dram_bytes``, because blocks share inputs. The latency path (round trips) and
the bytes in flight stay static estimates: the emulator has no clock.
"""
from __future__ import annotations

import time

import numpy as np

from . import counters as ctr

COPY_LIMIT = 1 << 20       # allocations up to this size carry the recording's bytes
DEFAULT_SAMPLE = 6         # blocks per launch (first, last and 4 seeded)
COMPARE = ("gld_requests", "gld_sectors", "gst_requests", "gst_sectors", "l2_bytes", "sector_efficiency",
           "smem_requests", "smem_wavefronts", "bank_conflict_factor", "mma", "barriers", "dram_bytes")


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def emulated_arrays(launch, backend=None) -> list:
    """The launch's arguments on the emulated backend: arrays rebuilt as the module
    docstring says (one allocation per recorded root), scalars as NumPy scalars."""
    from dflash_cupy.backends import emu_memory

    if len(launch.arrays) != len(launch.args):
        raise ValueError(f"launch of {launch.kernel} has no recorded arrays (recorded by an older launch_plan?)")
    roots: dict = {}
    out = []
    for ref, arr in zip(launch.args, launch.arrays):
        if arr is None:
            out.append(ref)
            continue
        root = _root(arr)
        e = roots.get(id(root))
        if e is None:
            e = emu_memory.guarded_empty(root.shape, root.dtype, "device array")
            if root.nbytes <= COPY_LIMIT and root.flags.c_contiguous:
                e.reshape(-1).view(np.uint8)[:] = root.reshape(-1).view(np.uint8)
            roots[id(root)] = e
        off = arr.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        v = np.ndarray(arr.shape, arr.dtype, buffer=e.reshape(-1).view(np.uint8), offset=off,
                       strides=arr.strides)
        out.append(v)
    return out


def _scalar(kernel, args) -> list:
    """Recorded scalars (Python ints/floats) as the NumPy types of the parameters."""
    return [a if p.is_pointer else np.dtype(p.dtype).type(a) for p, a in zip(kernel.sig.params, args)]


def run_counted(launch, *, n: int = DEFAULT_SAMPLE, seed: int = 0, backend=None):
    """``(LaunchCounts, sample, kernel)`` of ``launch`` run in counter mode on ``n`` sampled blocks."""
    from dflash_cupy import backends, kernels
    from dflash_cupy.backends.emu_counters import count_launch

    be = backend or backends.get("emulated")
    mod = kernels.load_module(be, launch.file, **launch.defines)
    k = mod.get_function(launch.kernel)
    args = _scalar(k, emulated_arrays(launch, be))
    sample = ctr.sample_blocks(launch.grid, n=max(2, n), seed=seed)
    lc = count_launch(k, launch.grid, launch.block, args, launch.shared_mem, blocks=sample)
    return lc, sample, k


def to_counters(launch, lc, kernel, static: ctr.KernelCounters | None = None) -> ctr.KernelCounters:
    """A ``KernelCounters`` from the emulator's counts, scaled to the grid; what the
    emulator cannot count comes from ``static`` (module docstring)."""
    static = static if static is not None else ctr.static_counters(launch)
    full = lc.blocks_run == launch.n_blocks
    c = ctr.KernelCounters(launch.kernel, "emulator" if full else f"emulator ({lc.blocks_run} blocks scaled)",
                           launch.n_blocks)
    for k in ("gld_requests", "gld_sectors", "gld_bytes", "gst_requests", "gst_sectors", "gst_bytes",
              "mma", "barriers"):
        setattr(c, k, getattr(lc, k))
    c.smem_requests, c.smem_wavefronts, c.smem_ideal_wavefronts = lc.smem_requests, lc.smem_wavefronts, lc.smem_ideal
    ctr.scale_sample(c, lc.blocks_run)
    f = launch.n_blocks / lc.blocks_run
    names = {p.name: getattr(a, "name", p.name) for p, a in zip(kernel.sig.params, launch.args) if p.is_pointer}
    sizes = {p.name: getattr(a, "nbytes", 0) for p, a in zip(kernel.sig.params, launch.args) if p.is_pointer}
    for pname, ac in lc.arrays.items():
        name = names.get(pname, pname)
        cap = sizes.get(pname, 0) or float("inf")
        if ac.read_distinct:
            c.bytes_read[name] = int(min(cap, round(ac.read_distinct * f)))
        if ac.written_distinct:
            c.bytes_written[name] = int(min(cap, round(ac.written_distinct * f)))
    if full:
        c.dram_bytes = sum(c.bytes_read.values()) + sum(c.bytes_written.values())
    else:
        c.dram_bytes = static.dram_bytes
        c.notes.append("dram_bytes: static (blocks share inputs: distinct bytes of a sample do not scale)")
    c.dram_round_trips_per_block = static.dram_round_trips_per_block
    c.l2_round_trips_per_block = static.l2_round_trips_per_block
    c.inflight_peak_bytes_per_warp = static.inflight_peak_bytes_per_warp
    c.notes += [n for n in static.notes]
    if lc.other_accesses:
        c.notes.append(f"{lc.other_accesses} accesses ({lc.other_bytes} B) outside the arguments, shared "
                       f"memory and the stack (__device__ globals?) not counted")
    c.compare = {k: getattr(static, k) for k in COMPARE}
    c.compare["source"] = static.source
    return c


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

    @staticmethod
    def key(launch) -> tuple:
        return (launch.variant(), launch.grid, launch.block, launch.shared_mem,
                tuple((a.shape, a.dtype) if hasattr(a, "shape") else a for a in launch.args),
                tuple(sorted(launch.known.items())))

    def __call__(self, launch) -> ctr.KernelCounters:
        k = self.key(launch)
        c = self._cache.get(k)
        if c is None:
            t = time.perf_counter()
            c = self._cache[k] = emulated_counters(launch, n=self.n, seed=self.seed, backend=self.backend)
            dt = time.perf_counter() - t
            self.seconds += dt
            self.runs += 1
            if self.log:
                self.log(f"counted {launch.kernel} grid {launch.grid}: {c.blocks_counted} of {c.blocks} "
                         f"blocks in {dt:.1f} s")
        return c
