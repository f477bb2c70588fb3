"""Counter mode of the emulated backend: what one launch does to memory, counted.

``count_launch(kernel, grid, block, args)`` runs a kernel of an ``EmuModule``
(synchronously, on the calling thread, after the backend's queued work) with
``cuda_emu.h``'s counters on and returns ``LaunchCounts``: global requests,
32-byte sectors and requested bytes (loads, stores), shared-memory requests,
wavefronts and the conflict-free wavefronts, ``mma.sync`` instructions,
``wgmma.mma_async`` instructions (per warpgroup), their m16n8k16 equivalents and
the bytes of B they read from shared memory, ``__syncthreads`` (once per block), and per pointer argument the bytes
requested and the distinct bytes read and written. The rules (what a request,
a sector, a wavefront is, how the lanes of one warp-level instruction are
grouped) are written beside the C++ in ``cuda_emu.h`` ("counters") and match
``profiling/counters.py``.

``blocks`` (linear block numbers, ``x + gx * (y + gy * z)``) runs only those
blocks: the sample a cost model scales by the grid. The outputs of blocks not
run are simply not written (whatever the arrays held stays). The counted run
uses the module's counting twin (``counting_module``: the same source built
with ``-DEMU_COUNTERS=1``), so ordinary launches carry no counting code.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..backends import launch_limits, signatures
from . import guarded_memory as emu_memory
from ..backends.base import BackendError, KernelLaunchError

# Layout of the counts buffer (cuda_emu.h: CNT_* and CNT_TOTALS / CNT_PER_RANGE).
_TOTALS = ("gld_requests", "gld_sectors", "gld_bytes", "gst_requests", "gst_sectors", "gst_bytes",
           "sld_requests", "sld_wavefronts", "sld_ideal", "sst_requests", "sst_wavefronts", "sst_ideal",
           "mma", "barriers", "blocks_run", "other_accesses", "other_bytes")
# after CNT_SITES_MERGED (17, internal): the wgmma counts, then programmatic dependent launch's
_TOTALS_AT = {18: "wgmma", 19: "wgmma_mma", 20: "wgmma_smem_bytes", 21: "pdl_waited_blocks",
              22: "pdl_waits", 23: "pdl_early_triggers"}
_N_TOTALS, _PER_RANGE, _MAX_RANGES = 24, 8, 128
_SITE_VALS, _MAX_SITES = 8, 2048
_KINDS = {0: "global load", 1: "global store", 2: "shared load", 3: "shared store"}
_ERRLEN = 1024
_ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2}


@dataclass
class ArrayCounts:
    read: int = 0               # bytes requested by loads (every access, re-reads included)
    written: int = 0            # bytes requested by stores
    read_distinct: int = 0      # distinct bytes loaded (over the blocks run)
    written_distinct: int = 0   # distinct bytes stored
    ld_requests: int = 0        # warp-level loads (counted for the array of their first lane)
    ld_sectors: int = 0
    st_requests: int = 0
    st_sectors: int = 0


@dataclass
class SiteCounts:
    """One instruction site of the g++ build (every warp-level execution of it)."""
    addr: int                   # address in the counting module (see ``resolve_sites``)
    kind: str                   # "global load" | "global store" | "shared load" | "shared store"
    width: int                  # bytes per lane (the widest seen)
    requests: int               # warp-level executions
    units: int                  # sectors (global) or wavefronts (shared)
    ideal: int                  # the minimum: ceil(bytes / 32) sectors, ceil(bytes / 128) wavefronts
    bytes: int                  # requested by the lanes
    warp_requests: int = 0      # the busiest warp's executions (of requests)
    where: str = ""             # "file:line (function)" once resolved

    @property
    def waste(self) -> float:
        """units / ideal: 1.0 for a coalesced / conflict-free access."""
        return self.units / self.ideal if self.ideal else 1.0


@dataclass
class LaunchCounts:
    """Counts of one counted launch (over ``blocks_run`` of ``blocks_total`` blocks)."""
    kernel: str
    grid: tuple
    block: tuple
    blocks_total: int
    blocks_run: int = 0
    gld_requests: int = 0
    gld_sectors: int = 0
    gld_bytes: int = 0
    gst_requests: int = 0
    gst_sectors: int = 0
    gst_bytes: int = 0
    sld_requests: int = 0
    sld_wavefronts: int = 0
    sld_ideal: int = 0
    sst_requests: int = 0
    sst_wavefronts: int = 0
    sst_ideal: int = 0
    mma: int = 0
    wgmma: int = 0              # wgmma.mma_async, once per warpgroup instruction
    wgmma_mma: int = 0          # their m16n8k16 equivalents (4 warps x N / 8 each)
    wgmma_smem_bytes: int = 0   # B read from shared memory: N x 16 x 2 bytes per wgmma
    barriers: int = 0
    pdl_waited_blocks: int = 0  # blocks with a thread past pdl_wait() (cuda_src/pdl.cuh)
    pdl_waits: int = 0          # threads that ran pdl_wait()
    pdl_early_triggers: int = 0  # threads that ran pdl_launch_dependents() before pdl_wait()
    other_accesses: int = 0     # neither an argument's array, shared memory nor the lane's stack
    other_bytes: int = 0
    arrays: dict = field(default_factory=dict)   # parameter name -> ArrayCounts
    sites: list = field(default_factory=list, compare=False)   # SiteCounts, unresolved (resolve_sites)
    module_path: str = field(default="", compare=False)        # the counting twin's .so

    @property
    def smem_requests(self) -> int:
        return self.sld_requests + self.sst_requests

    @property
    def smem_wavefronts(self) -> int:
        return self.sld_wavefronts + self.sst_wavefronts

    @property
    def smem_ideal(self) -> int:
        return self.sld_ideal + self.sst_ideal


def counting_module(module):
    """The counter-mode twin of an ``EmuModule``: the same source and options built
    with ``-DEMU_COUNTERS=1`` (``build.py``; cached like every build)."""
    from . import build as emu_build
    from .backend import EmuModule

    twin = getattr(module, "_counting_twin", None)
    if twin is None:
        args = getattr(module, "build_args", None)
        if args is None:
            raise BackendError("this emulated module does not know its source (compiled before "
                               "counter mode existed?)")
        try:
            so, kernels = emu_build.build(*args, counters=True)
        except (emu_build.CompileError, ValueError) as e:
            raise BackendError(str(e)) from None
        twin = EmuModule(module.backend, so, kernels)
        twin.so_path = str(so)
        twin.resources = getattr(module, "resources", None)
        twin.build_args = args
        module._counting_twin = twin
    return twin


def _linear_ids(blocks, grid) -> list:
    gx, gy, gz = grid
    total = gx * gy * gz
    out = []
    for b in blocks:
        if isinstance(b, (tuple, list)):
            x, y, z = (tuple(int(v) for v in b) + (0, 0))[:3]
            if not (0 <= x < gx and 0 <= y < gy and 0 <= z < gz):
                raise ValueError(f"blocks: {tuple(b)} is outside the grid {grid}")
            i = x + gx * (y + gy * z)
        else:
            i = int(b)
            if not 0 <= i < total:
                raise ValueError(f"blocks: linear block {i} is outside the grid {grid} ({total} blocks)")
        out.append(i)
    if len(set(out)) != len(out):
        raise ValueError(f"blocks: a block is listed twice in {list(blocks)}")
    return out


def count_launch(kernel, grid, block, args: Sequence[Any], shared_mem: int = 0, *, blocks=None,
                 order: str = "forward", seed: int = 0) -> LaunchCounts:
    """Run ``kernel`` (an ``EmuKernel``) with counting on; ``blocks``: the blocks
    to run, as (x, y, z) or linear numbers (default: all). ``order``: the fiber
    schedule (``forward`` by default: counts do not depend on it, time does)."""
    from .backend import EmuKernel, check_launch_limits

    if not isinstance(kernel, EmuKernel):
        raise TypeError(f"kernel must be a kernel of the emulated backend, got {type(kernel).__name__}")
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {tuple(_ORDERS)}, got {order!r}")
    g, b, shared_mem = launch_limits.launch_config(kernel.name, grid, block, shared_mem)
    check_launch_limits(kernel, g, b, shared_mem)
    total = g[0] * g[1] * g[2]
    ids = list(range(total)) if blocks is None else _linear_ids(blocks, g)
    if not ids:
        raise ValueError("blocks: an empty list runs nothing")
    backend = kernel._module.backend
    backend._no_capture("count_launch")
    backend.synchronize()   # the launch reads what queued work writes
    return run_counted(kernel, g, b, args, shared_mem, ids, _ORDERS[order], seed)[0]


def run_counted(kernel, g, b, args: Sequence[Any], shared_mem: int, ids=None, order: int = 0,
                seed: int = 0, sectors: bool = False):
    """The counted run itself, now, on this thread (``count_launch`` without its checks and
    without waiting for queued work: the caller orders it). ``g``, ``b``: checked dim3s;
    ``ids``: linear blocks (None: all); ``order``: the schedule's number. Returns
    ``(LaunchCounts, sectors)``: with ``sectors``, an ``[n, 3]`` uint64 array, one row per
    (argument, 32-byte sector) touched: the sector's address, the bytes read | written << 32,
    and the bytes read | written << 32 before the thread's ``pdl_wait()`` (prefetch_l2
    lines among those reads); else None."""
    from .backend import _raw_arg
    args = [_raw_arg(a) for a in args]   # the arrays behind device arrays (struct fields too)
    total = g[0] * g[1] * g[2]
    if ids is None:
        ids = list(range(total))
    module = counting_module(kernel._module)
    kernel = module.get_function(kernel.name)
    f = module._lib.emu_launch_counted
    ptrs, keep = kernel._pack(args)
    ranges, names, nranges = keep[2]
    if nranges > _MAX_RANGES:
        raise ValueError(f"kernel {kernel.name}: {nranges} array arguments, counter mode handles {_MAX_RANGES}")
    out = (ctypes.c_ulonglong * (_N_TOTALS + _PER_RANGE * _MAX_RANGES))()
    id_arr = (ctypes.c_ulonglong * len(ids))(*ids)
    nthreads = b[0] * b[1] * b[2]
    arena = emu_memory.stack_arena(nthreads)
    err = ctypes.create_string_buffer(_ERRLEN)
    fault_addr, fault_sig = ctypes.c_void_p(), ctypes.c_int()
    f.restype = ctypes.c_int
    f.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint,
                  ctypes.c_ulonglong, ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong,
                  ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                  ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.c_void_p, ctypes.c_int)
    sites = (ctypes.c_ulonglong * (1 + _SITE_VALS * _MAX_SITES))()
    sec_buf, cap = None, 0
    if sectors:
        # at most one entry per (argument, sector) of the arrays passed
        cap = 16 + sum(a.nbytes // 32 + 2 for p, a in signatures.leaves(kernel.sig.params, args) if p.is_pointer)
        sec_buf = np.zeros(1 + 3 * cap, np.uint64)
        module._lib.emu_pdl_export.restype = None
        module._lib.emu_pdl_export.argtypes = (ctypes.c_void_p, ctypes.c_ulonglong)
        module._lib.emu_pdl_export(sec_buf.ctypes.data, cap)
    rc = f(kernel._index, ptrs, (ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem,
           seed & 0xFFFFFFFFFFFFFFFF, order, id_arr, len(ids), arena.base, arena.count, arena.stride,
           ranges, names, nranges, err, _ERRLEN, ctypes.byref(fault_addr), ctypes.byref(fault_sig), out,
           sites, _MAX_SITES)
    if rc == 2:
        from .backend import _SIGNAMES
        what = _SIGNAMES.get(fault_sig.value, f"signal {fault_sig.value}")
        raise KernelLaunchError(f"kernel {kernel.name} (counted): {what} "
                                f"{emu_memory.describe_address(fault_addr.value)} in {err.value.decode(errors='replace')}")
    if rc:
        raise KernelLaunchError(f"kernel {kernel.name} (counted): {err.value.decode(errors='replace')}")
    vals = list(out)
    c = LaunchCounts(kernel.name, g, b, total, **{k: int(vals[i]) for i, k in enumerate(_TOTALS)},
                     **{k: int(vals[i]) for i, k in _TOTALS_AT.items()})
    c.module_path = getattr(module, "so_path", "")
    sv = list(sites)
    for i in range(min(int(sv[0]), _MAX_SITES)):
        v = sv[1 + _SITE_VALS * i:1 + _SITE_VALS * (i + 1)]
        c.sites.append(SiteCounts(int(v[0]), _KINDS.get(int(v[1]), "?"), *(int(x) for x in v[2:])))
    # ranges are listed for the pointer arguments inside guarded allocations, in order
    params = [p for p, a in signatures.leaves(kernel.sig.params, args)
              if p.is_pointer and a.nbytes and emu_memory.allocation_of(a.ctypes.data) is not None]
    for r, p in enumerate(params[:nranges]):
        v = vals[_N_TOTALS + _PER_RANGE * r:_N_TOTALS + _PER_RANGE * (r + 1)]
        ac = c.arrays.setdefault(p.name, ArrayCounts())
        ac.read += int(v[0])
        ac.written += int(v[1])
        ac.read_distinct += int(v[2])
        ac.written_distinct += int(v[3])
        ac.ld_requests += int(v[4])
        ac.ld_sectors += int(v[5])
        ac.st_requests += int(v[6])
        ac.st_sectors += int(v[7])
    sec = None
    if sec_buf is not None:
        n = int(sec_buf[0])
        if n > cap:
            raise BackendError(f"kernel {kernel.name} (counted): {n} sectors touched, room for {cap}")
        sec = sec_buf[1:1 + 3 * n].reshape(n, 3).copy()
    return c, sec


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def resolve_sites(c: LaunchCounts) -> list:
    """Fill ``where`` of each site with the kernel source's ``file:line (function)``
    (the first frame of its inline chain outside the emulator's headers), from the
    counting twin's line tables (``addr2line``); returns ``c.sites``. Sites stay
    unresolved (``where`` = "?") where addr2line is missing."""
    import os
    import shutil
    import subprocess

    from .build import EMU_DIR

    todo = [s for s in c.sites if not s.where]
    tool = shutil.which(os.environ.get("DFLASH_CUPY_ADDR2LINE", "addr2line"))
    if not todo or not c.module_path or tool is None:
        for s in todo:
            s.where = "?"
        return c.sites
    info = _DlInfo()
    dl = ctypes.CDLL(None)
    offs = []
    for s in todo:
        ok = dl.dladdr(ctypes.c_void_p(s.addr), ctypes.byref(info))
        offs.append(s.addr - 1 - (info.dli_fbase or 0) if ok else 0)   # the call, not the return address
    # one marker address after each site separates the inline chains in the output
    args = [tool, "-e", c.module_path, "-f", "-C", "-i", "-a"] + [hex(o) for o in offs]
    r = subprocess.run(args, capture_output=True, text=True)
    chains, cur = [], None
    for line in r.stdout.splitlines():
        if line.startswith("0x"):
            cur = []
            chains.append(cur)
        elif cur is not None:
            cur.append(line.strip())
    emu_names = {f.name for d in (EMU_DIR, EMU_DIR / "include") if d.is_dir() for f in d.iterdir()}
    for s, ch in zip(todo, chains + [[]] * (len(todo) - len(chains))):
        frames = [(ch[i], ch[i + 1]) for i in range(0, len(ch) - 1, 2)]
        pick = kernel_frame(frames, emu_names)
        s.where = f"{os.path.basename(pick[1].split(' ')[0])} ({pick[0].split('(')[0]})" if pick else "?"
    return c.sites


def kernel_frame(frames: list, emu_names: set):
    """The first ``(function, "file:line")`` of an inline chain (innermost first, as
    ``addr2line -i`` lists it) that is not in an emulator header, else the outermost.
    A header is known by its file name, not its directory: line tables may name it by
    another path (a precompiled header built elsewhere, an installed copy)."""
    def in_emu(loc: str) -> bool:
        return os.path.basename(loc.split(":")[0]) in emu_names
    pick = next(((fn, loc) for fn, loc in frames if "??" not in loc and not in_emu(loc)), None)
    return pick if pick is not None or not frames else frames[-1]
