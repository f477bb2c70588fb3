"""Per-launch counters: the interface, the access arithmetic, and static estimates.

``KernelCounters`` is what the cost model reads for one launch. Two producers
fill it:

* **static estimates** (this module, ``static_counters(launch)``): derived by
  hand from each kernel's source (its loops and address expressions, written
  out below per kernel: ``gemm_stream``, ``gemm_wgmma``, the attention) and the
  launch's real shapes, evaluated lane by lane
  for the warp-level accesses that matter (weight and activation loads, the x
  and K/V tiles in shared memory) with the same two functions an emulator
  counter mode would call: ``global_sectors`` and ``smem_wavefronts``. Kernels
  without a written-out access model get their compulsory bytes only
  (``source`` says which);
* **the emulator** (``profiling/emulated_counters.py`` over the counter mode of
  ``dflash_cupy/emu/cuda/cuda_emu.h``, ``dflash_cupy/emu/counting.py``): every
  memory access of kernel code is seen by hooks, grouped into warp-level
  instructions and counted by the rules below (the same arithmetic in C++);
  a sample of blocks of each launch runs at the real shapes and is scaled by
  the grid; ``source`` then reads ``"emulator"`` (all blocks) or
  ``"emulator (n blocks scaled)"`` and ``compare`` holds this module's
  estimate beside it.

Rules (what a "request", a "sector" and a "wavefront" are here):

* global: one request per warp-level load/store instruction with any active
  lane; sectors = distinct 32-byte sectors its active lanes touch; requested
  bytes = the active lanes' access sizes summed. ``sector_efficiency`` =
  requested / (sectors x 32).
* shared: an access of width w bytes is served in phases of 32 / max(1, w/4)
  lanes (all 32 for <= 4 B, 16 for 8 B, 8 for 16 B); in each phase, the
  wavefronts are the largest number of distinct 4-byte words any one of the 32
  banks must deliver (lanes reading the same word share it). A conflict-free
  access needs ceil(32 w / 128) wavefronts.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from dflash_cupy import kernels

SECTOR = 32
BANKS = 32


# ---------------------------------------------------------------------------- access arithmetic
def global_sectors(addrs, width: int) -> tuple[int, int]:
    """``(sectors, requested_bytes)`` of one warp-level global access: ``addrs``
    the byte address of each lane (``None`` = inactive), ``width`` bytes each."""
    if width not in (1, 2, 4, 8, 16):
        raise ValueError(f"width must be 1, 2, 4, 8 or 16 bytes, got {width}")
    secs, req = set(), 0
    for a in addrs:
        if a is None:
            continue
        if a % width:
            raise ValueError(f"address {a:#x} is not aligned to its width {width}")
        secs.update(range(a // SECTOR, (a + width - 1) // SECTOR + 1))
        req += width
    return len(secs), req


def smem_wavefronts(addrs, width: int) -> int:
    """Wavefronts of one warp-level shared-memory access (module docstring)."""
    if width not in (1, 2, 4, 8, 16):
        raise ValueError(f"width must be 1, 2, 4, 8 or 16 bytes, got {width}")
    addrs = list(addrs)
    if len(addrs) != 32:
        raise ValueError(f"addrs must list 32 lanes (None for inactive), got {len(addrs)}")
    per_phase = 32 // max(1, width // 4)
    total = 0
    for p0 in range(0, 32, per_phase):
        banks: dict = {}
        for a in addrs[p0:p0 + per_phase]:
            if a is None:
                continue
            if a % width:
                raise ValueError(f"address {a:#x} is not aligned to its width {width}")
            for word in range(a // 4, (a + width - 1) // 4 + 1):
                banks.setdefault(word % BANKS, set()).add(word)
        if banks:
            total += max(len(s) for s in banks.values())
    return total


def ideal_wavefronts(width: int, active: int = 32) -> int:
    return max(1, math.ceil(active * width / 128))


# ---------------------------------------------------------------------------- the interface
@dataclass
class KernelCounters:
    """Counters of one launch (all blocks). Bytes per array are compulsory
    (distinct) bytes; ``l2_bytes`` is every sector moved between the SMs and L2."""
    kernel: str
    source: str                      # "static estimate" | "static estimate (bytes only)" | "emulator"
    blocks: int
    blocks_counted: int = 0          # emulator: blocks run (sampled), scaled to ``blocks``
    live_blocks: int = 0             # blocks that do the work (0: all); the rest exit at their start
    gld_requests: int = 0
    gld_sectors: int = 0
    gld_bytes: int = 0               # requested by the lanes
    gst_requests: int = 0
    gst_sectors: int = 0
    gst_bytes: int = 0
    bytes_read: dict = field(default_factory=dict)      # array name -> distinct bytes read
    bytes_written: dict = field(default_factory=dict)   # array name -> distinct bytes written
    dram_bytes: int = 0              # compulsory: what must cross HBM (persistent state and first touches)
    smem_requests: int = 0
    smem_wavefronts: int = 0
    smem_ideal_wavefronts: int = 0
    mma: int = 0                     # mma.sync m16n8k16 instructions (warp-level)
    wgmma_mma: int = 0               # wgmma.mma_async work in m16n8k16 equivalents (4 warps x N/8 each)
    wgmma_smem_bytes: int = 0        # B operands wgmma reads from shared memory (N x 16 x 2 B each)
    barriers: int = 0                # __syncthreads executed, summed over blocks
    # Latency path of one block (the longest): dependent round trips of its
    # warps' global loads. A static estimate from the loop structure.
    dram_round_trips_per_block: float = 0.0
    l2_round_trips_per_block: float = 0.0
    # A tail one block adds after its own work, paid once (not per round of
    # blocks): its dependent L2 round trips, and the bytes it alone reads from
    # L2 (bound by one SM's share of the L2 bandwidth). The attention's merge.
    tail_l2_round_trips: float = 0.0
    tail_l2_bytes: int = 0
    # A serial epilogue after a block's stream (gemm_wgmma.cu's qkv epilogue): the busiest
    # block's rounds of (row, head) units, each a dependent chain a warp runs alone (warp sum,
    # angles, sincospif): rounds with RoPE (Q/K heads) and plain ones (V: norm sum, copy).
    # perf_model prices them with hw_params.rope_round_clocks / copy_round_clocks.
    epilogue_rope_rounds: int = 0
    epilogue_copy_rounds: int = 0
    inflight_peak_bytes_per_warp: int = 0   # loads a warp can have issued and not consumed
    notes: list = field(default_factory=list)
    # emulator: the static estimate's figures beside the measured ones (profiling/emulated_counters.py)
    compare: dict = field(default_factory=dict)
    # emulator: the instruction sites furthest above their minimum sectors / wavefronts
    hot_sites: list = field(default_factory=list)

    @property
    def l2_bytes(self) -> int:
        return (self.gld_sectors + self.gst_sectors) * SECTOR

    @property
    def sector_efficiency(self) -> float:
        s = self.gld_sectors + self.gst_sectors
        return (self.gld_bytes + self.gst_bytes) / (s * SECTOR) if s else 1.0

    @property
    def bank_conflict_factor(self) -> float:
        return self.smem_wavefronts / self.smem_ideal_wavefronts if self.smem_ideal_wavefronts else 1.0

    def add_global(self, kind: str, n: int, sectors: int, nbytes: int) -> None:
        """``n`` warp-level requests, each with ``sectors`` sectors and ``nbytes`` requested."""
        if kind == "ld":
            self.gld_requests += n
            self.gld_sectors += n * sectors
            self.gld_bytes += n * nbytes
        else:
            self.gst_requests += n
            self.gst_sectors += n * sectors
            self.gst_bytes += n * nbytes

    def add_smem(self, n: int, addrs, width: int) -> None:
        """``n`` warp-level shared accesses with the lane addresses ``addrs``."""
        active = sum(a is not None for a in addrs)
        self.smem_requests += n
        self.smem_wavefronts += n * smem_wavefronts(addrs, width)
        self.smem_ideal_wavefronts += n * ideal_wavefronts(width, active)

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(l2_bytes=self.l2_bytes, sector_efficiency=self.sector_efficiency,
                 bank_conflict_factor=self.bank_conflict_factor)
        return d


# ---------------------------------------------------------------------------- helpers
def _name(a) -> str:
    return getattr(a, "name", "?")


def _rw(c: KernelCounters, reads=(), writes=()) -> None:
    for name, n in reads:
        c.bytes_read[name] = c.bytes_read.get(name, 0) + int(n)
    for name, n in writes:
        c.bytes_written[name] = c.bytes_written.get(name, 0) + int(n)


def _contig(c: KernelCounters, kind: str, nbytes: int, width: int = 4) -> None:
    """Fully coalesced traffic of ``nbytes`` in 32-lane requests of ``width`` B each."""
    if nbytes <= 0:
        return
    reqs, secs = -(-nbytes // (32 * width)), -(-nbytes // SECTOR)
    if kind == "ld":
        c.gld_requests += reqs
        c.gld_sectors += secs
        c.gld_bytes += nbytes
    else:
        c.gst_requests += reqs
        c.gst_sectors += secs
        c.gst_bytes += nbytes


def _staging_loads(ROWS, KT, K, m_valid, kvalid, elem=4, _cache={}):
    """(requests, sectors, bytes) of one x-tile staging pass of gemm_stream:
    ROWS x KT/4 float4 items, 32 consecutive items per warp-level load, only
    rows < m_valid and columns < kvalid load. ``elem`` = 2: x in 16 bits
    (gemm_stream's GS_X16), KT/8 items of 8 values (16 bytes each)."""
    key = (ROWS, KT, K, m_valid, kvalid, elem)
    if key not in _cache:
        vec = 16 // elem
        i = np.arange(ROWS * (KT // vec))
        row, c4 = i // (KT // vec), (i % (KT // vec)) * vec
        ok = (row < m_valid) & (c4 < kvalid)
        grp = (i // 32)[ok]
        sec = (row[ok] * K + c4[ok]) * elem // SECTOR
        pairs = np.unique(grp.astype(np.int64) * (1 << 40) + sec)
        _cache[key] = (len(np.unique(grp)), len(pairs), int(ok.sum()) * 16)
    return _cache[key]


def splitk_reduce_trips(live: int, rows: int, cols: int, threads: int, ks: int, nw: int,
                        one_block: bool = False) -> int:
    """Dependent L2 round trips of gemm_splitk.cuh's reduction of ``live`` rows: a thread's
    float4 items in chunks of JC (``SPLITK_INFLIGHT[_16] / ZB / nw``, at most a full tile's
    share), each chunk one round trip per ZB slices (``SPLITK_SLICES``, or up to
    ``SPLITK_SS_SLICES`` where a full tile's items leave the loads in flight; a batch's loads are
    in flight together; EPI 1's residual is issued with the chunk's first batch). ``one_block``:
    a kernel built for one block an SM (SPLITK_ONE_BLOCK, gemm_stream.cu's GS_CONV)."""
    k = _splitk_constants()
    c4 = cols // 4
    jmax = -(-rows * c4 // threads)
    loads = (k["SPLITK_INFLIGHT_16_ONE" if one_block else "SPLITK_INFLIGHT_16"] if rows <= 16
             else k["SPLITK_INFLIGHT"])
    zb = max(k["SPLITK_SLICES"], min(loads // (jmax * nw), k["SPLITK_SS_SLICES"]))   # gemm_splitk.cuh's ZB
    jc = min(jmax, max(1, loads // (zb * nw)))
    items = -(-live * c4 // threads)
    return -(-items // jc) * -(-ks // zb)


def splitk_reduce_global(c: KernelCounters, m0: int, rows, c0: int, N: int, COLS: int, gz: int, NW: int,
                         EPI: int, YB: int, _cache={}) -> int:
    """Global traffic of one block's ``splitk_reduce`` (gemm_splitk.cuh) over its local rows
    ``rows`` (``(local row, stored)`` for every row below M): its float4 items (C4 = COLS / 4
    per row, a warp's 32 consecutive ones in one row) load ``gz x NW`` partial vectors each,
    lanes with column >= N or a row not stored idle; the reduced values go to y as 4 scalar
    stores per item (lanes 16 bytes apart: 16 sectors per full 32-lane store); EPI 1 loads the
    residual as one float4 per item when N % 4 == 0 (r 16-byte aligned), else as 4 scalars
    like the stores; EPI 3 keeps them in shared memory (no y traffic). Returns the warp-level
    item instructions with a lane at work (each reads its row's scale with NORM)."""
    # The traffic depends on each stored row's first element modulo 32 (the sectors' pattern),
    # the elements left from c0 (past COLS + 128 every item is full) and N % 4: the model's
    # GEMMs ask for the same few blocks thousands of times (every column group, every layer).
    offs = tuple(((m0 + lrow) * N + c0) % 32 for lrow, stored in rows if stored)
    key = (offs, min(N - c0, COLS + 128), N % 4, COLS, gz * NW, EPI, YB)
    t = _cache.get(key)
    if t is None:
        t = _cache[key] = _splitk_reduce_traffic(*key)
    n_items, (ldr, lds, ldb, sr, ss, sb) = t
    c.gld_requests += ldr
    c.gld_sectors += lds
    c.gld_bytes += ldb
    c.gst_requests += sr
    c.gst_sectors += ss
    c.gst_bytes += sb
    return n_items


def _splitk_reduce_traffic(offs, left: int, n_mod4: int, COLS: int, parts: int, EPI: int, YB: int):
    """``splitk_reduce_global``'s (items, (gld requests, sectors, bytes, gst requests, sectors,
    bytes)) for stored rows starting at ``offs`` (mod 32) with ``left`` elements from c0."""
    c = KernelCounters("splitk_reduce", "static estimate", 1)
    C4 = COLS // 4
    n_items = 0
    for off0 in offs:
        for w0 in range(0, C4, 32):
            lim = min(128, left - 4 * w0)    # elements of the row from the warp's first column
            if lim <= 0:
                continue
            act = -(-lim // 4)
            n_items += 1
            c.add_global("ld", parts, -(-act * 16 // SECTOR), act * 16)
            if EPI == 3:
                continue
            off = (off0 + 4 * w0) % 32
            for e in range(min(4, lim)):
                c.add_global("st", 1, *global_sectors([(off + 4 * ln + e) * YB if 4 * ln + e < lim else None
                                                       for ln in range(32)], YB))
                if EPI == 1 and n_mod4:
                    c.add_global("ld", 1, *global_sectors([(off + 4 * ln + e) * 4 if 4 * ln + e < lim else None
                                                           for ln in range(32)], 4))
            if EPI == 1 and n_mod4 == 0:   # lim is a multiple of 4: every active lane's float4
                c.add_global("ld", 1, *global_sectors([(off + 4 * ln) * 4 for ln in range(act)], 16))
    return n_items, (c.gld_requests, c.gld_sectors, c.gld_bytes, c.gst_requests, c.gst_sectors, c.gst_bytes)


def _splitk_constants() -> dict:
    from dflash_cupy import kernels
    return kernels.constants("gemm_splitk.cuh")


# ---------------------------------------------------------------------------- gemm_stream.cu
def _gs_xpad() -> int:
    from dflash_cupy.ops import gemm_stream as gs
    return gs.XPAD


def _gs_staging_smem(tiles, kt, norm=0, x16=0, _cache={}):
    """(requests, wavefronts, ideal) of one x-chunk staging pass's shared stores
    (per plane): item i -> row i / (kt/4), 8-byte store at (row*(kt+XPAD) + c4)*2;
    with GS_NORM a warp stores one row per request (lanes at c4 = 4*lane + 128j).
    ``x16`` (GS_X16): items of 8 values, 16-byte stores (c8 = 8*lane + 256j with GS_NORM)."""
    key = (tiles, kt, norm, x16)
    if key not in _cache:
        vec = 8 if x16 else 4
        width = 2 * vec
        q4, xs = kt // vec, kt + _gs_xpad()
        items = tiles * 16 * q4
        req = wf = ideal = 0
        seen: dict = {}
        if norm:
            groups = [[(r * xs + c4) * 2 if c4 < kt else None for c4 in range(j, j + 32 * vec, vec)]
                      for r in range(tiles * 16) for j in range(0, kt, 32 * vec)]
        else:
            groups = [[((i // q4) * xs + (i % q4) * vec) * 2 if i < items else None for i in range(i0, i0 + 32)]
                      for i0 in range(0, items, 32)]
        for addrs in groups:
            # the pattern only depends on the byte offsets mod 128 (banks)
            sig = tuple(None if a is None else (a % 128, a // 128 - addrs[0] // 128) for a in addrs)
            if sig not in seen:
                seen[sig] = smem_wavefronts(addrs, width)
            req += 1
            wf += seen[sig]
            ideal += ideal_wavefronts(width, sum(a is not None for a in addrs))
        _cache[key] = (req, wf, ideal)
    return _cache[key]


def _two_inputs(P: dict, x, M: int, norm: int):
    """``(x2, row_split, ln_lo)`` of a stream GEMM launch's struct ``P`` (fields x2,
    row_split, ln_lo, use_ln_lo; x2 None: every row from x; ln_lo None: rows < norm_lo raw)."""
    x2, split, ln_lo, use_lo = (P.get(k) for k in ("x2", "row_split", "ln_lo", "use_ln_lo"))
    if split is None:
        return None, int(M), None
    split = int(split)
    return (None if split >= int(M) else x2), split, (ln_lo if norm and int(use_lo) else None)


def _x_reads(c, x, x2, row_split: int, row_bytes: int, rows) -> None:
    """bytes_read of x (rows < row_split) and x2 (the rest) over ``rows``, the rows read
    (computed tiles' rows below M that are not padding)."""
    rows = set(rows)
    lo = sum(1 for r in rows if r < row_split)
    hi = len(rows) - lo
    if lo or x2 is None:
        c.bytes_read[_name(x)] = (lo + (hi if x2 is None else 0)) * row_bytes
    if x2 is not None and hi:
        c.bytes_read[_name(x2) + (" (x2)" if _name(x2) == _name(x) else "")] = hi * row_bytes


def _tile_rows(a: int, M: int, pad_lo: int, pad_hi: int) -> range | list:
    """The rows a computed 16-row tile starting at ``a`` reads: below M, not padding."""
    rows = range(a, min(a + 16, M))
    return [r for r in rows if not pad_lo <= r < pad_hi] if pad_hi else rows


def _smem_words(c: KernelCounters, n: int) -> None:
    """``n`` warp-level shared accesses of at most 32 lanes x 4 B on distinct banks or one
    word (a lane's own row sum, a broadcast): one wavefront each, the minimum."""
    c.smem_requests += n
    c.smem_wavefronts += n
    c.smem_ideal_wavefronts += n


def _gamma_reads(c: KernelCounters, ln, ln_lo, rows, norm_lo: int, K: int) -> None:
    """Distinct bytes of the folded norm's gammas: ``ln`` [K] if one of ``rows`` (the rows
    that load a gamma) is >= ``norm_lo``, ``ln_lo`` if one is below it (each such row reads
    its gamma over the whole K range, summed over the slices)."""
    if any(r >= norm_lo for r in rows):
        c.bytes_read[_name(ln)] = K * 4
        c.dram_bytes += K * 4
    if ln_lo is not None and any(r < norm_lo for r in rows):
        c.bytes_read[_name(ln_lo) + " (ln_lo)"] = K * 4
        c.dram_bytes += K * 4


def _gemm_stream(L) -> KernelCounters:
    """``cuda_src/gemm_stream.cu`` from its launch: grid (column groups, M
    blocks, K slices), kz, kt and the variant's defines; the launcher's own
    ``plan`` is the cross-check (a mismatch is named in ``notes``)."""
    from dflash_cupy.ops import gemm_stream as gs

    d = L.defines
    K, MT, NT, SPLIT, EPI = d["GS_K"], d["GS_MT"], d["GS_NT"], d.get("GS_SPLIT", 2), d.get("GS_EPI", 0)
    WARPS = d.get("GS_WARPS", 8)
    D = d.get("GS_DEPTH", gs.DEPTH[MT])
    P = L.params()
    x, w, y, r, M, N, kz, kt, ws, pad_hi = (P[k] for k in ("x", "w", "y", "r", "M", "N", "kz", "kt", "ws", "pad_hi"))
    NORM = d.get("GS_NORM", 0)
    X16 = d.get("GS_X16", 0)
    XB = 2 if X16 else 4      # bytes per x element
    YB = 2 if d.get("GS_Y16", 0) else 4   # bytes per y element
    ln, norm_lo = (P["ln"], P["norm_lo"]) if NORM else (None, M)
    x2, row_split, ln_lo = _two_inputs(P, x, M, NORM)
    norm_lo_ln = norm_lo          # rows >= it read ln; with ln_lo every row is normalised
    if ln_lo is not None:
        norm_lo = 0               # the kernel's scale_lo: rows >= it are scaled (and read a gamma)
    gam_rows = set()              # rows that load a gamma (ln or ln_lo) in some block
    NW = 2 if EPI == 2 else 1
    WT, ROWS, COLS, THREADS, KSTEP = NT * NW, 16 * MT, WARPS * 8 * NT, WARPS * 32, gs.KSTEP
    # linear grid: block x = column group * M blocks + M block (the M blocks of a
    # column group adjacent: they share one HBM read of its weights through L2)
    gx = -(-N // COLS)
    gy = L.grid[0] // gx
    gz = L.grid[2]
    c = KernelCounters("gemm_stream", "static estimate", L.n_blocks)
    p = gs.plan(N, K, M, NW, SPLIT, mt=MT, raw=bool(NORM and not X16), conv=bool(d.get("GS_CONV", 0)))
    if (p.grid, p.kz, p.kt) != (tuple(L.grid), kz, kt):
        c.notes.append(f"launch differs from gemm_stream.plan: grid {L.grid} kz {kz} kt {kt} vs "
                       f"{p.grid} {p.kz} {p.kt}")
    # tile_live (device flags per 16-row tile, read at run time): the launch plan may know them;
    # a dead tile is neither staged, computed nor stored, a block of dead tiles exits first
    use_live = int(P.get("use_live", 0)) != 0
    flags = L.known.get("tile_live") if use_live else None
    lo_pad = min(max(L.known.get("pad_lo", pad_hi) if pad_hi else 0, 0), pad_hi)

    def computed(by: int) -> list:
        """Per tile of M block ``by``: rows it computes (0: skipped)."""
        out = []
        for i in range(MT):
            a = by * ROWS + 16 * i
            b = min(a + 16, M)
            dead = a >= M or (pad_hi and a >= lo_pad and b <= pad_hi) or \
                (flags is not None and not flags[a // 16])
            out.append(0 if dead else b - a)
        return out

    def stored_tile(by: int, i: int) -> bool:
        a = by * ROWS + 16 * i
        return a < M and (flags is None or bool(flags[a // 16]))

    block_rows = [computed(by) for by in range(gy)]
    live_blocks = sum(1 for t in block_rows if any(t))
    c.live_blocks = gx * live_blocks * gz
    spc = kt // KSTEP

    # Weights: warp w of column group bx, tile j holds rows n0 + 8(j % NT) + g (+N for up),
    # lane (g, t) loads 16 B at k + 8t + 32h (h = 0, 1) of its row: two requests per
    # (step, tile), each 8 rows x 4 lanes of 16 B (64 contiguous bytes per row). Lanes with n >= N or k >= k_end do
    # not access (their slot reads as zeros).
    rows_per_tile = Counter()
    for bx in range(gx):
        for wp in range(WARPS):
            for j in range(WT):
                rows_per_tile[max(0, min(8, N - (bx * COLS + wp * 8 * NT + 8 * (j % NT))))] += 1
    rows_per_tile.pop(0, None)

    def wreq(vr, lanes_t):   # one request: vr rows, lanes (t, h) active
        return global_sectors([g * K * 2 + 16 * t + 64 * h for g in range(vr) for (t, h) in lanes_t], 16)

    slices = []
    for bz in range(gz):
        k_begin, k_end = bz * kz, min(K, bz * kz + kz)
        span = max(0, k_end - k_begin)
        slices.append((span, -(-span // KSTEP)))
    for span, nsteps in slices:
        full, rem = span // KSTEP, span % KSTEP
        for vr, n_tiles in rows_per_tile.items():
            n = live_blocks * n_tiles
            for h in (0, 1):
                sec, req = wreq(vr, [(t, h) for t in range(4)])
                c.add_global("ld", n * full, sec, req)
                if rem:
                    act = [(t, h) for t in range(4) if 8 * t + 32 * h < rem]
                    if act:
                        sec, req = wreq(vr, act)
                        c.add_global("ld", n, sec, req)
    c.bytes_read[_name(w)] = N * NW * K * 2 if live_blocks else 0

    # Blocks by M: the tiles each computes (rows < M, not wholly padding, live)
    per_block_trips = 0.0
    chunks_max = 0
    x_l2 = 0
    lo = lo_pad
    skipped = 0
    for by in range(gy):
        rows_t = block_rows[by]
        tm = sum(1 for v in rows_t if v)
        live = max(0, min(ROWS, M - by * ROWS))
        skipped += -(-live // 16) - tm
        if tm == 0:
            continue      # the block exits before loading anything
        tiles = max(i + 1 for i, v in enumerate(rows_t) if v)
        rows_ld = 0                     # rows the staging loads: computed tiles' rows, padding rows excepted
        for i, v in enumerate(rows_t):
            if v:
                a = by * ROWS + 16 * i
                rows_ld += v - (max(0, min(pad_hi, a + v) - max(lo_pad, a)) if pad_hi else 0)
        for span, nsteps in slices:
            chunks = -(-nsteps // spc) if nsteps else 0
            chunks_max = max(chunks_max, chunks)
            # x staging: tiles*16 rows x kt/4 float4 items per chunk, only rows loaded and k < k_end
            for ch in range(chunks):
                kvalid = min(kt, span - ch * kt)
                if NORM:   # a warp per row, 32 lanes x 16 B along k per request
                    # f32: every row of a computed tile >= scale_lo loads its gamma, rows past M
                    # and padding rows included (the kernel tests nrm, not rd, before that load)
                    nrm_rows = [r for i, v in enumerate(rows_t) if v
                                for r in range(max(norm_lo, by * ROWS + 16 * i), by * ROWS + 16 * i + 16)]
                    n_nrm = len(nrm_rows)
                    per_row = -(-kvalid * XB // 512)
                    reqs, secs, nb = (rows_ld * per_row, rows_ld * -(-kvalid * XB // SECTOR),
                                      rows_ld * kvalid * XB)
                    if X16:
                        # ln, re-read per normalised row that is read (L1/L2): two coalesced float4
                        # requests per 256 values (then shuffled to the lanes holding x)
                        nrm_rows = [r for r in nrm_rows if r < M and not (pad_hi and lo_pad <= r < pad_hi)]
                        n_nrm = len(nrm_rows)
                    gam_rows.update(nrm_rows)
                    if X16:
                        c.gld_requests += gx * n_nrm * -(-kvalid // 128)
                        c.gld_sectors += gx * n_nrm * -(-kvalid * 4 // SECTOR)
                        c.gld_bytes += gx * n_nrm * kvalid * 4
                    else:
                        # f32: cp.async copies the chunk raw (x as loaded above; ln when a computed
                        # tile has a row >= norm_lo, ln_lo when one is below, once per block and
                        # chunk, a warp per 128 values) into shared memory, where the conversion
                        # reads it: a 16-byte store and load per x item, per gamma item a store
                        # and a load per normalised row
                        first = [by * ROWS + 16 * i for i, v in enumerate(rows_t) if v]
                        n_gam = (any(a + 15 >= norm_lo_ln for a in first)
                                 + (ln_lo is not None and any(a < norm_lo_ln for a in first)))
                        c.gld_requests += gx * n_gam * -(-kvalid // 128)
                        c.gld_sectors += gx * n_gam * -(-kvalid * 4 // SECTOR)
                        c.gld_bytes += gx * n_gam * kvalid * 4
                        full, lanes = divmod(kvalid // 4, 32)
                        for n, a in ((full, 32), (1 if lanes else 0, lanes)):
                            if n:
                                one = [16 * j if j < a else None for j in range(32)]
                                c.add_smem(gx * n * (2 * rows_ld + n_gam + n_nrm), one, 16)
                else:
                    reqs, secs, nb = _staging_loads(tiles * 16, kt, K, live, kvalid, XB)
                    if rows_ld < live:   # rows of skipped tiles load nothing
                        f = rows_ld / live
                        reqs, secs, nb = round(reqs * f), round(secs * f), round(nb * f)
                c.gld_requests += gx * reqs
                c.gld_sectors += gx * secs
                c.gld_bytes += gx * nb
                x_l2 += gx * nb
                sreq, swf, sid = _gs_staging_smem(tm, kt, NORM, X16)
                c.smem_requests += gx * SPLIT * sreq
                c.smem_wavefronts += gx * SPLIT * swf
                c.smem_ideal_wavefronts += gx * SPLIT * sid
                if NORM and X16:   # lane 0 of a row's warp adds its chunk sum: ss_s[row] += ss (load, store)
                    _smem_words(c, gx * 2 * 16 * tm)
                elif NORM:   # each lane's row partial: stored per chunk, loaded from the second on
                    _smem_words(c, gx * 16 * tm * (2 if ch else 1))
            if NORM:
                _smem_words(c, gx * -(-ROWS // 32))      # ss_s zeroed by the first ROWS threads
                if gz == 1:   # (split K: in the reduction, below)
                    # epilogue: per warp, stored tile and half h a broadcast read of 8 rows' ss_s
                    # when one of those rows (below M or not) is >= scale_lo
                    _smem_words(c, gx * WARPS * sum(1 for i in range(MT) for h in (0, 8)
                                                    if stored_tile(by, i) and by * ROWS + 16 * i + h + 7 >= norm_lo))
            c.barriers += gx * 2 * chunks
            if NORM and not X16:   # after the loop: per computed row its warp's butterfly over
                # the lane partials (a load) and lane 0's store of the sum, then one barrier
                if nsteps:
                    _smem_words(c, gx * 16 * tm * 2)
                c.barriers += gx
            # MMA loop: per warp, step, computed tile and plane: 4 x 16-B x loads, WT x 4 MMAs
            n = gx * WARPS * nsteps * tm * SPLIT
            for ro in (0, 8):
                for half in (0, 32):
                    addrs = [((ro + g) * (kt + gs.XPAD) + 8 * t + half) * 2 for g in range(8) for t in range(4)]
                    c.add_smem(n, addrs, 16)
            c.mma += n * WT * 4
            # ring of D steps in flight: one HBM round trip per D steps; one L2 trip per x chunk
            per_block_trips = max(per_block_trips, -(-nsteps // D))

    # Epilogue
    red_l2_trips = 0
    # the fused argmax / top-K (GS_EPI 3 / 4): logits only with GS_LOGITS; per row and column
    # group its best column / TOPK best (key, id) pairs into ws
    SEL = EPI in (3, 4)
    TOPK = d.get("GS_TOPK", 16) if EPI == 4 else 1
    YW = (not SEL) or bool(d.get("GS_LOGITS", 0))   # y written
    if gz == 1:
        # lane (g, t) stores row g (+8), columns 2t, 2t+1 of each 8-column tile below N:
        # the 8-column tiles are numbered bx*WARPS*NT + warp*NT + jn, so ceil(N/8) of them store
        n_ct = min(-(-N // 8), gx * WARPS * NT) if YW else 0
        for by in range(gy):
            for i in range(MT):
                # every stored tile, wholly padding ones too (their rows get the epilogue of 0), in
                # a block with a computed tile (the model's working blocks)
                if not (stored_tile(by, i) and any(block_rows[by])):
                    continue
                for e in range(4):
                    row0 = by * ROWS + 16 * i + (8 if e & 2 else 0)
                    if row0 < M:
                        vr = min(8, M - row0)
                        s_, q_ = global_sectors([(g * N + 2 * t) * YB for g in range(vr) for t in range(4)], YB)
                        c.add_global("st", n_ct, s_, q_)
                        if EPI == 1:
                            c.add_global("ld", n_ct, s_, q_)
    else:
        # per (column group, M block): a block whose tiles are all dead leaves in every slice
        # before the count; the others store the partial rows of their stored tiles (live
        # tiles below M, padding ones included), and the last slice to arrive reduces them
        def stored(by: int) -> list:
            """Per tile of M block ``by``: its rows below M if the tile is stored, else 0."""
            out = []
            for i in range(MT):
                a = by * ROWS + 16 * i
                b = min(a + 16, M)
                out.append(b - a if a < M and (flags is None or flags[a // 16]) else 0)
            return out

        st_rows = [stored(by) for by in range(gy)]
        act = [by for by in range(gy) if any(st_rows[by])]   # blocks past the early exit (tmask != 0)
        part_rows = 0
        for by in act:
            rows_t = st_rows[by]
            # partial tiles: per warp, tile i, weight tile j, half h: 8 rows x 4 lanes of float2
            for i in range(MT):
                for h in (0, 1):
                    vr = max(0, min(8, rows_t[i] - 8 * h))
                    if vr:
                        s_, q_ = global_sectors([(g * COLS + 2 * t) * 4 for g in range(vr) for t in range(4)], 8)
                        c.add_global("st", gx * gz * WARPS * WT, s_, q_)
            srows = sum(rows_t)
            part_rows += srows
            # the last slice of each column group reduces its stored rows
            rows_st = [(lr, True) for i, v in enumerate(rows_t) for lr in range(16 * i, 16 * i + v)]
            items = sum(splitk_reduce_global(c, by * ROWS, rows_st, bx * COLS, N, COLS, gz, NW, EPI, YB)
                        for bx in range(gx))
            live = max(0, min(ROWS, M - by * ROWS))
            red_l2_trips = max(red_l2_trips, splitk_reduce_trips(live, ROWS, COLS, THREADS, gz, NW,
                                                                 one_block=bool(d.get("GS_CONV", 0))))
            # per slice its arrival ticket (an atomic), the reducer's reset of the counter
            c.add_global("st", gx * (gz + 1), 1, 4)
            if NORM:   # each slice's row sums of squares (threads < live), read back by the reducer
                for w0 in range(0, live, 32):
                    lanes = min(32, live - w0)
                    c.add_global("st", gx * gz, -(-lanes * 4 // SECTOR), lanes * 4)
                    c.add_global("ld", gx * gz, -(-lanes * 4 // SECTOR), lanes * 4)
                # shared: the slice's threads < live read ss_s; the reducer stores the row scales
                # (sc_s, threads < live) and each item instruction reads its row's
                _smem_words(c, gx * (gz + 1) * -(-live // 32) + items)
        c.barriers += gx * len(act) * (gz * 2 + NORM)   # NORM: the reducer's row scales
        c.bytes_written[_name(ws)] = gz * NW * part_rows * N * 4
        c.bytes_read[_name(ws)] = gz * NW * part_rows * N * 4
        c.notes.append(f"split-K {gz}: partial tiles ({gz * NW * part_rows * N * 4 / 1e6:.2f} MB) round-trip "
                       f"through L2; the last slice of each (column group, M block) reduces them")
    x_rows = {r for by, t in enumerate(block_rows) for i, v in enumerate(t) if v
              for r in _tile_rows(by * ROWS + 16 * i, M, lo_pad, pad_hi)}
    _x_reads(c, x, x2, row_split, K * XB, x_rows)
    # rows stored: the stored tiles' rows below M in the working blocks
    m_st = sum(min(16, M - by * ROWS - 16 * i) for by, t in enumerate(block_rows) if any(t)
               for i in range(MT) if stored_tile(by, i))
    if YW:
        c.bytes_written[_name(y)] = m_st * N * YB
    part_bytes = 0
    if SEL:
        # per working M block: its rows below M in stored tiles (the threads / warps that store)
        sel_blocks = []
        for by, t in enumerate(block_rows):
            st = [i for i in range(MT) if stored_tile(by, i)]
            if any(t) and st:
                sel_blocks.append((by * ROWS, [lr for i in st for lr in range(16 * i, min(16 * i + 16, M - by * ROWS))],
                                   len(st)))
        part_bytes = _gs_select_epilogue(c, EPI, TOPK, gx, WARPS, NT, MT, COLS, ws, sel_blocks, YW, N)
    if EPI == 1:
        c.bytes_read[_name(r) + " (residual)"] = m_st * N * 4
    if pad_hi:   # every thread of every block reads the padding start: a request per warp
        c.add_global("ld", L.n_blocks * WARPS, 1, 128)
        c.bytes_read[_name(P["pad_lo"])] = 4
    if use_live:   # every thread reads its block's flags of tiles below M: a request per warp each
        flag_loads = gx * gz * sum(1 for by in range(gy) for i in range(MT) if by * ROWS + 16 * i < M)
        c.add_global("ld", flag_loads * WARPS, 1, 128)
        c.bytes_read[_name(P["tile_live"])] = 4 * -(-M // 16)
    c.dram_bytes = ((N * NW * K * 2 if live_blocks else 0) + len(x_rows) * K * XB
                    + (m_st * N * (8 if EPI == 1 else YB) if YW else 0) + part_bytes)
    if d.get("GS_CONV", 0) and int(P.get("conv_lane_rows", 0)) != 0:
        _gemm_conv(c, L, d, P, gx, gy, ROWS, COLS, THREADS, M, N, K, flags)
    if d.get("GS_FIN", 0) and int(P.get("fin_lane_rows", 0)) > 0:
        _gemm_fin(c, d, P, gx, gy, gz, ROWS, COLS, THREADS, MT, NT, M, N, flags)
    if NORM:
        _gamma_reads(c, ln, ln_lo, gam_rows, norm_lo_ln, K)
        c.notes.append(f"RMSNorm of rows >= {norm_lo_ln} folded in: x * ln staged, the row scale applied "
                       "to the accumulators (no normalised copy of x)")
        if ln_lo is not None:
            c.notes.append(f"rows < {norm_lo_ln} normalised with ln_lo the same way")
        if gz > 1:
            c.notes.append("split K: the arrival ticket's shared store and loads are not counted")
    c.dram_round_trips_per_block = per_block_trips
    c.l2_round_trips_per_block = chunks_max + red_l2_trips
    c.inflight_peak_bytes_per_warp = D * WT * 2 * 512
    c.notes.append(f"x staged by each of the {gx} column groups: {x_l2 / 1e6:.2f} MB from L2")
    if SPLIT == 2:
        c.notes.append("activations split hi + lo: 2x the MMAs and x-tile reads")
    if X16:
        c.notes.append("x read in the weight type (GS_X16): half the f32 bytes")
    if use_live:
        c.notes.append(f"tile_live: {skipped} dead 16-row tile(s) skipped" if flags is not None
                       else "tile_live flags unknown to the launch plan: every tile assumed live")
    if pad_hi:
        c.notes.append(f"padding rows [{lo}, {pad_hi}) "
                       + ("(lo = the step's n_new)" if "pad_lo" in L.known else "(lo unknown: none assumed)")
                       + f": {skipped} 16-row tile(s) skipped")
    if -(-M // 16) * 16 > M:
        c.notes.append(f"M={M}: {-(-M // 16) * 16 - M} zero rows in the last live 16-row tile "
                       f"(MMAs and x reads; tiles wholly past M are skipped)")
    return c


def _by_warp(rows: list) -> list:
    """``rows`` (a thread per local row, threadIdx = the row) grouped by warp, empty warps left out."""
    out: dict = {}
    for r in rows:
        out.setdefault(r // 32, []).append(r)
    return list(out.values())


def _gs_select_epilogue(c: KernelCounters, EPI: int, TOPK: int, gx: int, WARPS: int, NT: int, MT: int,
                       COLS: int, ws, blocks: list, logits: bool, N: int) -> int:
    """gemm_stream.cu's fused argmax (GS_EPI 3) / top-K (GS_EPI 4) epilogue, added to ``c`` for
    ``blocks``: per working M block ``(m0, stored local rows, stored tiles)`` of each of ``gx``
    column groups; returns the partials' bytes. EPI 3: per tile, half and warp two 4-byte stores
    of 8 lanes' winners into shared memory, one barrier, then a thread per stored row reads
    2 x WARPS words and stores its (key, column). EPI 4: per stored tile every thread's keys into
    the key tile (NT uint2 stores per half, conflict-free), two barriers, a warp per stored row
    loads its keys below N (one conflict-free request per 32 columns), runs TOPK rounds in
    registers (shuffles: no memory), and lanes < TOPK store one 8-byte pair each."""
    rows = sum(len(r) for _, r, _ in blocks)
    pair_bytes = rows * gx * TOPK * 8
    sectors = Counter()   # (kind, sectors, bytes) of the warp-level partial stores, summed over groups
    for m0, rws, _ in blocks:
        for cg in range(gx):
            if EPI == 3:
                for lanes in _by_warp(rws):
                    for off in (0, 4):
                        sectors[global_sectors([((m0 + lr) * gx + cg) * 8 + off for lr in lanes], 4)] += 1
            else:
                for lr in rws:
                    base = ((m0 + lr) * gx + cg) * TOPK * 8
                    for q0 in range(0, TOPK, 32):
                        sectors[global_sectors([base + 8 * q for q in range(q0, min(TOPK, q0 + 32))], 8)] += 1
    for (sec, nb), n in sectors.items():
        c.add_global("st", n, sec, nb)
    if EPI == 3:
        _smem_words(c, gx * len(blocks) * WARPS * MT * 2 * 2
                    + gx * sum(2 * WARPS * len(_by_warp(r)) for _, r, _ in blocks))
        c.barriers += gx * len(blocks)
    else:
        tiles = sum(t for _, _, t in blocks)
        for h in range(2):
            c.add_smem(gx * tiles * WARPS * NT, [((g + 8 * h) * (COLS + 8) + 2 * t) * 4
                                                 for g in range(8) for t in range(4)], 8)
        reads = sum(-(-max(0, min(COLS, N - bx * COLS)) // 32) for bx in range(gx))
        c.add_smem(rows * reads, [l * 4 for l in range(32)], 4)
        c.barriers += gx * len(blocks) * 2
    c.bytes_written[_name(ws) + " (partials)"] = pair_bytes
    c.notes.append(f"fused {'argmax' if EPI == 3 else f'top-{TOPK}'}: {pair_bytes / 1e6:.2f} MB of (key, id) "
                   f"partials" + ("" if logits else "; no logits written"))
    return pair_bytes


def _gemm_conv(c: KernelCounters, L, d: dict, P: dict, gx: int, gy: int, ROWS: int, COLS: int, THREADS: int,
               M: int, N: int, H: int, flags) -> None:
    """gemm_stream.cu's GS_CONV epilogue (cuda_src/gemm_conv.cuh): the block that holds a column
    group's final d (split K: the reducing slice) convolves the channels of the half-0 groups
    wholly inside it, over its stored rows: per VEC-channel chunk (a thread each, consecutive
    threads on consecutive chunks of a row) its taps' base, then per batch of RB rows the x
    window (RB + TAPS - 1 rows) and each row's TAPS coefficients (one vector load for 2 or 4
    taps), and one store per stored row. Its dependent L2 round trips (the batches in pairs: a
    batch's loads issued before the one ahead's sums) are the tail after the reduction:
    ``tail_l2_round_trips`` (the compiled model reads the SASS loops instead). GS_NORM: also
    the chunk's ln (the row scales from shared memory); conv_lane_rows < 0: the chunk's ln and
    its x rows (2 * RB at a time: one round trip each), the normed rows stored instead of the sums."""
    from dflash_cupy.ops import gemm_stream as gs
    T, G = d["GS_CONV_TAPS"], d["GS_CONV_GROUP"]
    NORM, xonly = d.get("GS_NORM", 0), int(P.get("conv_lane_rows", 0)) < 0
    VEC = 4 if G % 4 == 0 and H % 4 == 0 else 1
    RB = max(1, kernels.constants("gemm_conv.cuh")["GEMM_CONV_ROWS"] // T)
    XW = RB + T - 1
    VW = T * 4 if T in (2, 4) else 4     # a row's coefficients: one access of VW bytes, VN of them
    VN = 1 if T in (2, 4) else T
    trips = tail_bytes = 0
    rows_out = 0
    for bx in range(gx):
        c0 = bx * COLS
        c1 = min(c0 + COLS, N)
        g0, g1 = -(-c0 // (2 * T)), c1 // (2 * T)
        if g1 <= g0:
            continue
        nch = (g1 - g0) * G
        nq = nch // VEC
        warps_q = -(-nq // 32)            # warp-level chunk instructions per row
        span = max(1, min(32 * VEC, nch) // G) * 2 * T * 4   # bytes a warp's d load spans (its groups)
        for by in range(gy):
            live = max(0, min(ROWS, M - by * ROWS))
            st = [lr for lr in range(live) if flags is None or flags[(by * ROWS + lr) // 16]]
            if not st:
                continue
            batches = -(-live // RB)
            passes = -(-nq // THREADS)        # chunks a thread runs
            if NORM:
                _contig(c, "ld", nch * 4, 4 * VEC)                             # ln
            _contig(c, "st", len(st) * nch * 4, 4 * VEC)                       # y
            c.barriers += 1
            rows_out += len(st) * nch
            if xonly:   # the rows that exist, 2 * RB a round trip
                _contig(c, "ld", live * nch * 4, 4 * VEC)                      # x rows
                trips = max(trips, -(-live // (2 * RB)) * passes)
                tail_bytes = max(tail_bytes, (live + NORM + len(st)) * nch * 4)
                continue
            xrows = live + batches * (XW - RB)   # rows that exist: each batch's and the rows before it
            _contig(c, "ld", T * nch * 4, 4 * VEC)                             # base
            _contig(c, "ld", xrows * nch * 4, 4 * VEC)                         # x windows
            c.add_global("ld", warps_q * live * VN, max(1, -(-span // SECTOR)), 32 * VW)   # d
            # work items (a chunk's rows, in parts where a full column block has fewer chunks than
            # threads) x their pairs of batches: the block's own columns [c0, c1)
            trips = max(trips, gs.conv_tail_trips(live, c1 - c0, T, G, COLS, ROWS))
            tail_bytes = max(tail_bytes, (T + xrows + NORM + len(st)) * nch * 4 + live * VN * 32 * VW * warps_q)
    conv_y, base = P.get("conv_y"), P.get("conv_base")
    _rw(c, [] if xonly else [(_name(base), T * H * 4)], [(_name(conv_y), rows_out * 4)])
    c.dram_bytes += rows_out * 4 + (0 if xonly else T * H * 4)
    if xonly:
        c.notes.append(f"the normed rows stored for conv.cu (GS_CONV, lane_rows < 0): {rows_out * 4 / 1e6:.2f} MB, "
                       f"{trips} dependent L2 round trips after the reduction")
        c.tail_l2_round_trips = max(c.tail_l2_round_trips, float(trips))
        c.tail_l2_bytes = max(c.tail_l2_bytes, tail_bytes)
        return
    c.tail_l2_round_trips = max(c.tail_l2_round_trips, float(trips))
    c.tail_l2_bytes = max(c.tail_l2_bytes, tail_bytes)   # one block's share of L2 (the source model)
    c.notes.append(f"prepare convolution fused (GS_CONV, {T} taps{', of the normed x' if NORM else ''}): "
                   f"{rows_out * 4 / 1e6:.2f} MB written by the blocks holding final coefficients, {trips} "
                   f"dependent L2 round trips and {tail_bytes / 1e3:.0f} KB through one SM after the reduction")


def _gemm_fin(c: KernelCounters, d: dict, P: dict, gx: int, gy: int, gz: int, ROWS: int, COLS: int, THREADS: int,
              MT: int, NT: int, M: int, N: int, flags) -> None:
    """gemm_stream.cu's GS_FIN epilogue (cuda_src/gemm_fin.cuh): the block holding a column
    group's final tile (split K: the reducing slice, whose reduction writes the tile instead of
    y) stages it in shared memory (one K slice: each thread's fragments as float2, two
    barriers), then each thread takes VEC channels (4 where GROUP % 4 == 0: 16-byte accesses)
    and batches of RB rows (COLS / VEC threads per batch, the block's threads on THREADS * VEC /
    COLS batches at once): its taps' base, per batch the tile window (RB + TAPS - 1 rows), each
    row's residual and TAPS coefficients (one vector load for 2 or 4 taps; the chunk's channels
    share one group) and a store per stored row. y's stores and the residual's loads replace
    the plain epilogue's (counted there); the coefficients, base, tile traffic and the tail's
    dependent L2 round trips (one per batch a thread runs) are added here."""
    T, G = d["GS_CONV_TAPS"], d["GS_CONV_GROUP"]
    RB = kernels.constants("gemm_fin.cuh")["GEMM_FIN_ROWS"]
    FS = COLS + kernels.constants("gemm_fin.cuh")["GEMM_FIN_PAD"]
    VEC = 4 if G % 4 == 0 else 1
    QN = COLS // VEC
    RG = max(1, THREADS // QN)
    XW = RB + T - 1
    VW = T * 4 if T in (2, 4) else 4
    VN = 1 if T in (2, 4) else T
    ds = 2 * T * (N // G)
    trips = tail_bytes = blocks = 0
    d_bytes = 0
    for bx in range(gx):
        ncol = max(0, min(COLS, N - bx * COLS))
        nq = ncol // VEC
        warps_q = -(-nq // 32)
        sec, nb = global_sectors([((q * VEC // G) * 2 * T + T) * 4 if q < nq else None for q in range(32)], VW)
        for by in range(gy):
            live = max(0, min(ROWS, M - by * ROWS))
            st = [lr for lr in range(live) if flags is None or flags[(by * ROWS + lr) // 16]]
            if not st or ncol == 0:
                continue
            blocks += 1
            sb = [b for b in range(-(-live // RB)) if flags is None or flags[(by * ROWS + b * RB) // 16]]
            _contig(c, "ld", T * ncol * 4 * min(RG, len(sb)), 4 * VEC)                 # base, per batch lane
            c.add_global("ld", warps_q * len(sb) * RB * VN, sec, nb)                   # d
            _contig(c, "ld", len(sb) * RB * ncol * 4, 4 * VEC)                         # residual (clamped rows too)
            c.add_smem(warps_q * len(sb) * XW, [l * 4 * VEC for l in range(32)], 4 * VEC)   # tile windows
            if gz == 1:   # the fragments' float2 stores (row stride 8 mod 32 words: conflict-free)
                for h in range(2):
                    c.add_smem((THREADS // 32) * MT * NT, [((g + 8 * h) * FS + 2 * t) * 4
                                                          for g in range(8) for t in range(4)], 8)
                c.barriers += 2
            else:
                c.barriers += 1
            d_bytes += live * -(-ncol // G) * T * 4
            per_thread = -(-len(sb) // RG)
            trips = max(trips, per_thread)
            tail_bytes = max(tail_bytes, len(sb) * RB * ((1 + T) * ncol * 4) + len(st) * ncol * 4)
    base, dd = P.get("fin_base"), P.get("fin_d")
    _rw(c, [(_name(base), T * N * 4), (_name(dd) + " (finish half)", d_bytes)])
    c.dram_bytes += T * N * 4 + M * ds * 4 // 2
    c.tail_l2_round_trips = max(c.tail_l2_round_trips, float(trips))
    c.tail_l2_bytes = max(c.tail_l2_bytes, tail_bytes)
    c.notes.append(f"finish convolution fused (GS_FIN, {T} taps): {blocks} blocks convolve their final tiles "
                   f"from shared memory, {trips} dependent L2 round trips after the reduction")


# ---------------------------------------------------------------------------- gemm_wgmma.cu
def _gemm_wgmma(L) -> KernelCounters:
    """``cuda_src/gemm_wgmma.cu`` from its launch: grid (column groups x row blocks of BT,
    1, K slices); ``gemm_stream.plan_wgmma`` is the cross-check. Per 64-k step a block
    loads its 256 weight rows (8 16-byte requests per warp: 2 sets x rows g, g + 8 x two
    halves; each request 8 rows x 64 contiguous bytes), stages BT rows x 64 of x (32 bytes
    per token and instruction, stored as 4-byte pairs into conflict-free core matrices) and issues
    2 warpgroups x 2 sets x 4 k16 x GW_SPLIT wgmmas of N = GW_NCH per chunk of rows with a
    computed 16-row tile. Tiles marked 2 (GW_SKIP_COLS) are dead in the column groups below
    it; with GW_SMS and tile_live the K split is the kernel's per-launch choice
    (``gemm_stream.wg_live_split``; tile_live unknown: every tile live)."""
    from dflash_cupy.ops import gemm_stream as gs

    d = L.defines
    K, BT, SPLIT, EPI = d["GW_K"], d["GW_BT"], d.get("GW_SPLIT", 2), d.get("GW_EPI", 0)
    NORM = d.get("GW_NORM", 0)
    X16 = d.get("GW_X16", 0)
    XB = 2 if X16 else 4      # bytes per x element
    YB = 2 if d.get("GW_Y16", 0) else 4   # bytes per y element
    D = d.get("GW_DEPTH", gs.WG_DEPTH[BT])
    NCH = d.get("GW_NCH", 32)
    SMS = d.get("GW_SMS", 0)
    P = L.params()
    x, w, y, r, M, N, kz, _kt, ws, pad_hi = (P[k] for k in ("x", "w", "y", "r", "M", "N", "kz", "kt", "ws", "pad_hi"))
    ln, norm_lo = (P["ln"], P["norm_lo"]) if NORM else (None, M)
    x2, row_split, ln_lo = _two_inputs(P, x, M, NORM)
    norm_lo_ln = norm_lo          # rows >= it read ln; with ln_lo every row is normalised
    if ln_lo is not None:
        norm_lo = 0
    NW = 2 if EPI == 2 else 1
    COLS, THREADS, KSTEP, WARPS = gs.wg_cols(NW), gs.WG_THREADS, gs.KSTEP, gs.WG_THREADS // 32
    gx = -(-N // COLS)
    qg = min(d.get("GW_SKIP_COLS", 0) // COLS, gx)
    c = KernelCounters("gemm_wgmma", "static estimate", L.n_blocks)
    use_live = int(P.get("use_live", 0)) != 0
    dynamic = bool(SMS) and use_live
    # live split: the grid strides over the working items, kt the most K slices; else (tiles, 1, ks)
    gy = -(-M // BT) if dynamic else L.grid[0] // gx
    gz = L.grid[2]
    if not dynamic:
        p = gs.plan_wgmma(N, K, M, NW, SPLIT, variant=f"wg{BT}", ks=gz)
        if (p.grid, p.kz) != (tuple(L.grid), kz):
            c.notes.append(f"launch differs from gemm_stream.plan_wgmma: grid {L.grid} kz {kz} vs {p.grid} {p.kz}")
    flags = L.known.get("tile_live") if use_live else None
    lo_pad = min(max(L.known.get("pad_lo", pad_hi) if pad_hi else 0, 0), pad_hi)

    def tiles_of(by: int, q: bool):
        """(stored, computed) rows per 16-row tile of row block ``by`` in a column group
        below GW_SKIP_COLS (``q``) or not."""
        st, cp = [], []
        for i in range(BT // 16):
            a = by * BT + 16 * i
            b = min(a + 16, M)
            v = 1 if flags is None or a >= M else int(flags[a // 16])
            alive = a < M and v != 0 and not (q and v == 2)
            st.append(b - a if alive else 0)
            pad = alive and pad_hi and a >= lo_pad and b <= pad_hi
            cp.append(0 if (not alive or pad) else b - a - (max(0, min(pad_hi, b) - max(lo_pad, a)) if pad_hi else 0))
        return st, cp

    # column-group classes: (groups, their first column, columns, the row blocks' tiles)
    classes = []
    for q, ng in ((True, qg), (False, gx - qg)):
        if ng:
            blocks = [tiles_of(by, q) for by in range(gy)]
            classes.append((ng, 0 if q else qg, min(N, ng * COLS) if q else N - qg * COLS, blocks,
                            [by for by in range(gy) if any(blocks[by][0])]))
    n_live = sum(ng * len(act) for ng, _, _, _, act in classes)
    if dynamic:
        cap = int(P["kt"])
        c.barriers += 2 * L.n_blocks          # the tile_live scan
        gz = gs.wg_live_split(n_live, K, cap, SMS)
        kz = -(-(-(-K // KSTEP)) // gz) * KSTEP
        c.notes.append(f"K split {gz} chosen on the device for {n_live} working tile(s) (at most {cap}): "
                       f"{n_live * gz} items over {L.n_blocks} resident blocks")
    spans = [max(0, min(K, z * kz + kz) - z * kz) for z in range(gz)]
    steps = [-(-sp // KSTEP) for sp in spans]

    # weights: per working block, slice and step, each warp 8 requests of 8 rows (those below N)
    valid_rows = Counter()
    for ng, g0, _, _, act in classes:
        for bx in range(g0, g0 + ng):
            for wg in range(2):
                for a in range(2):
                    for wq in range(4):
                        for rr in range(2):
                            n0 = bx * COLS + wg * (128 // NW) + (64 * a if NW == 1 else 0) + 16 * wq + 8 * rr
                            valid_rows[max(0, min(8, N - n0))] += len(act)
    valid_rows.pop(0, None)
    for sp, ns in zip(spans, steps):
        full, rem = sp // KSTEP, sp % KSTEP
        for vr, n in valid_rows.items():
            for h in (0, 1):
                sec, req = global_sectors([g * K * 2 + 16 * t + 64 * h for g in range(vr) for t in range(4)], 16)
                c.add_global("ld", n * full, sec, req)
                lanes = [t for t in range(4) if 8 * t + 32 * h < rem]
                if rem and lanes:
                    sec, req = global_sectors([g * K * 2 + 16 * t + 64 * h for g in range(vr) for t in lanes], 16)
                    c.add_global("ld", n, sec, req)
    any_act = any(act for *_, act in classes)
    c.bytes_read[_name(w)] = N * NW * K * 2 if any_act else 0

    x_l2 = 0
    st_elems = 0        # stored outputs (rows x columns)
    rows_union = [0] * gy
    gam_rows = set()    # rows that load a gamma (ln or ln_lo) in some block
    for ng, _, ncols, blocks, act in classes:
        for by in act:
            st, cp = blocks[by]
            rows_ld = sum(cp)
            rows_union[by] = max(rows_union[by], rows_ld)
            tpc = NCH // 16
            chunks_live = sum(1 for ch in range(BT // NCH) if any(cp[ch * tpc:(ch + 1) * tpc]))
            st_elems += sum(st) * ncols
            n_nrm = sum(max(0, min(by * BT + 16 * i + v, M) - max(norm_lo, by * BT + 16 * i))
                        for i, v in enumerate(cp) if v) if NORM else 0
            if NORM:   # rows that load a gamma: computed tiles' rows below M, not padding, >= scale_lo
                gam_rows.update(r for i, v in enumerate(cp) if v
                                for r in range(max(norm_lo, by * BT + 16 * i), min(by * BT + 16 * i + 16, M))
                                if not (pad_hi and lo_pad <= r < pad_hi))
            if X16 and K % 16:
                # 16-bit rows of K % 16 != 0 elements: odd rows start half way into a sector, so each
                # token's 64-byte piece touches 3 sectors there (rows of K % 16 == 0 stay aligned)
                odd = 0
                for i, v in enumerate(cp):
                    if v:
                        a = by * BT + 16 * i
                        odd += sum(1 for rr in range(a, min(a + 16, M)) if rr % 2 and not (pad_hi and lo_pad <= rr < pad_hi))
            for sp, ns in zip(spans, steps):
                nb = ng * rows_ld * sp * XB
                _contig(c, "ld", nb, 16)
                if X16 and K % 16:
                    pieces, rem = sp // 32, sp % 32
                    c.gld_sectors += ng * odd * (pieces + (1 if rem else 0))   # one more sector per piece
                x_l2 += nb
                if NORM and n_nrm:
                    _contig(c, "ld", ng * sp * 4, 16)     # ln: once per block and step (its rows hit L1)
                    if ln_lo is not None and by * BT < norm_lo_ln and by * BT + BT > norm_lo_ln:
                        _contig(c, "ld", ng * sp * 4, 16)   # both ln_lo and ln in this row block
                # staging stores: per step BT x 16 items / 32 per warp, 2 pair stores per plane, one
                # wavefront each (dead and padding rows store zeros too); NORM: the items' sums, read + write.
                # GW_X16: BT x 8 items of 8 values, 4 pair stores each: the same count
                ipw, per_item = (BT * 8 // 32, 4) if X16 else (BT * 16 // 32, 2)
                n_st = ng * ns * ipw * per_item * SPLIT
                c.smem_requests += n_st
                c.smem_wavefronts += n_st
                c.smem_ideal_wavefronts += n_st
                if NORM:
                    n_ss = ng * ns * ipw * per_item
                    c.smem_requests += n_ss
                    c.smem_wavefronts += n_ss
                    c.smem_ideal_wavefronts += n_ss
                # wgmmas per (block, step): 2 WG x 2 sets x 4 k16 x planes x the chunks of NCH rows
                # with a computed tile (the others issue none)
                n_wg = ng * ns * 2 * 2 * 4 * SPLIT * chunks_live
                c.wgmma_mma += n_wg * 4 * (NCH // 8)
                c.wgmma_smem_bytes += n_wg * NCH * 16 * 2
                # one per step + the tile loop's and the first staging's (NORM: + the last sums'; BT 64:
                # + the one between step 0's x loads and their stores)
                c.barriers += ng * (ns + 2 + NORM + (1 if BT < 128 and ns else 0))
    nsteps_max = max(steps) if steps else 0
    # Per step the next step's weights are loaded into registers (L2 hits: they were prefetched
    # into L2 DEPTH steps ahead) and its x staged in batches, the first batch's loads issued
    # with the weights (BT 64): one L2 round trip per batch, the HBM latency hidden behind the
    # prefetch but for the first weights; the prologue's x and the epilogue: L2 trips.
    ipt = BT * (8 if X16 else 16) // THREADS
    xbatch = (2 if BT < 128 else 1) if X16 else (4 if BT < 128 else (1 if NORM else 2))
    c.dram_round_trips_per_block = 1 if nsteps_max else 0
    c.l2_round_trips_per_block = 2 + nsteps_max * (ipt // min(ipt, xbatch)) + (1 if dynamic else 0)   # live split: the tile_live scan
    # a warp's weights requested ahead: 1 step in registers, DEPTH - 1 more as L2 prefetches
    c.inflight_peak_bytes_per_warp = D * 8 * 512

    qkv = _wgmma_qkv_epilogue(c, L, classes, flags, BT, COLS, N, M, gz, lo_pad, pad_hi) if EPI == 3 else None
    # epilogue: one 4-byte store per (set, token, weight row) kept; 8 consecutive columns (g)
    # of one token per 8 lanes: one sector per 8 lanes
    if qkv is not None:   # GW_EPI 3: the tile goes to shared memory, not to y (its stores counted above)
        if gz > 1:
            _wgmma_splitk(c, ws, classes, gz, NW, NORM, BT, M, N, COLS, THREADS, EPI, YB)
    elif gz == 1:
        if YB == 2:   # 2-byte stores: 8 lanes' columns of a token fill half a sector
            c.add_global("st", -(-st_elems // 32), 4, 64)
        else:
            _contig(c, "st", st_elems * YB, YB)
        if EPI == 1:
            _contig(c, "ld", st_elems * 4, 4)
    else:
        _wgmma_splitk(c, ws, classes, gz, NW, NORM, BT, M, N, COLS, THREADS, EPI, YB)
    m_live = sum(rows_union)
    if pad_hi:   # every thread reads the padding start once per item (a block's tile and slice)
        c.add_global("ld", (n_live * gz if dynamic else L.n_blocks) * WARPS, 1, 128)
        c.bytes_read[_name(P["pad_lo"])] = 4
    _x_reads(c, x, x2, row_split, K * XB, (r for *_, blocks, act in classes for by in act
                                           for i, v in enumerate(blocks[by][1]) if v
                                           for r in _tile_rows(by * BT + 16 * i, M, lo_pad, pad_hi)))
    if qkv is None:
        c.bytes_written[_name(y)] = st_elems * YB
    if EPI == 1:
        c.bytes_read[_name(r) + " (residual)"] = st_elems * 4
    c.dram_bytes = (N * NW * K * 2 if any_act else 0) + m_live * K * XB + \
        (qkv if qkv is not None else st_elems * (8 if EPI == 1 else YB))
    c.live_blocks = n_live * gz
    n_act = max((len(act) for *_, act in classes), default=0)
    if n_act < gy:
        c.notes.append(f"{gy - n_act} of {gy} row blocks dead (tile_live): their blocks exit at once")
    if qg and flags is not None:
        c.notes.append(f"{qg} column group(s) below GW_SKIP_COLS skip the tiles marked 2")
    if NORM:
        _gamma_reads(c, ln, ln_lo, gam_rows, norm_lo_ln, K)
    c.notes.append(f"wgmma N={BT}: x staged by the working blocks of {gx} column groups: {x_l2 / 1e6:.2f} MB "
                   f"from L2; weights re-read by {n_act} row block(s)")
    if SPLIT == 2:
        c.notes.append("activations split hi + lo: 2x the wgmmas")
    return c


def _wgmma_splitk(c: KernelCounters, ws, classes, gz: int, NW: int, NORM: int, BT: int, M: int, N: int,
                  COLS: int, THREADS: int, EPI: int, YB: int) -> None:
    """gemm_wgmma.cu's split K, per working tile (column group, row block) and slice: the
    partial tile's stores (per warp and (jn, e, set) one instruction of 4 rows x 8 columns, one
    sector per stored row: every COLS column, past N too), the arrival ticket (an atomic), with
    NORM the slice's row sums (threads < live); the reducer: the counter's reset, the row sums
    read back and ``splitk_reduce_global``'s loads and stores (EPI 3: into shared memory); two
    barriers per slice (NORM: and the reducer's one after the row scales)."""
    WARPS = THREADS // 32
    part = n_live = 0
    for ng, g0, _, blocks, act in classes:
        for by in act:
            st, _cp = blocks[by]
            live = min(BT, M - by * BT)
            stored = {16 * i + r for i, v in enumerate(st) for r in range(v)}
            rows = [sum(1 for t in range(4) if 8 * jn + 2 * t + (e & 1) in stored)
                    for jn in range(BT // 8) for e in range(4)]
            n = ng * gz * WARPS * 2          # (warps, the two sets a) per slice
            c.gst_requests += n * sum(1 for k in rows if k)
            c.gst_sectors += n * sum(rows)
            c.gst_bytes += n * sum(rows) * SECTOR
            c.add_global("st", ng * (gz + 1), 1, 4)
            if NORM:
                for w0 in range(0, live, 32):
                    lanes = min(32, live - w0)
                    c.add_global("st", ng * gz, -(-lanes * 4 // SECTOR), lanes * 4)
                    c.add_global("ld", ng * gz, -(-lanes * 4 // SECTOR), lanes * 4)
            rows_st = [(lt, lt in stored) for lt in range(live)]
            for bx in range(g0, g0 + ng):
                splitk_reduce_global(c, by * BT, rows_st, bx * COLS, N, COLS, gz, NW, EPI, YB)
            part += ng * gz * NW * len(stored) * COLS * 4
            n_live += ng
    c.barriers += n_live * (gz * 2 + NORM)
    c.bytes_written[_name(ws)] = part
    c.bytes_read[_name(ws)] = part
    c.l2_round_trips_per_block += splitk_reduce_trips(min(BT, M), BT, COLS, THREADS, gz, NW)
    c.notes.append(f"split-K {gz}: partial tiles ({part / 1e6:.2f} MB) round-trip through L2")


def _wgmma_qkv_epilogue(c: KernelCounters, L, classes, flags, BT: int, COLS: int, N: int, M: int, gz: int,
                        lo_pad: int, pad_hi: int) -> int:
    """gemm_wgmma.cu's GW_EPI 3 (the qkv GEMM with qkv_norm_rope folded in), added to ``c``:
    the tile's final values staged in shared memory (the K loop's accumulators: 4 conflict-free
    stores per 8 lanes' rows; split K: the reducing block's float4 stores, 4 wavefronts per 32
    items), then the (row, head) units of the rows with outputs (stored tiles' rows outside the
    padding rows [lo_pad, pad_hi)), EPI_U per warp at a time: per block ceil(units / (EPI_U x
    8)) rounds of EPI_U slots per warp. Every slot loads a head's pairs (2 x PAIRS
    conflict-free shared loads). Global reads, once per block and warp before the rounds: per
    32 rows of the block (lanes of the rows with outputs) their ring slots, positions and
    (use_live) tile_live flags; per lane its pairs' norm weights (2 x PAIRS 4-byte loads each
    of q_norm and k_norm) and frequencies (PAIRS 8-byte loads). Stored: Q rows f32 (rows
    of tiles marked 2: none), K rows f16 at the row's ring slot, V f16 as it is (HD/32 shared
    loads, HD/32 stores).
    Ring rows outside [0, kv_rows) are assumed absent. Returns the compulsory bytes it moves
    (Q, K, V written; pos, rows, the weights read)."""
    d = L.defines
    HD, QW, KVW = d["GW_HD"], d["GW_QW"], d["GW_KVW"]
    HALF = HD // 2
    PAIRS = -(-HALF // 32)
    from dflash_cupy.ops import gemm_stream as gs
    WARPS = gs.WG_THREADS // 32
    U = gs.WG_EPI_UNITS
    P = L.params()
    y, pos_a, rows_a = P["y"], P["pos"], P["rows"]
    q_norm, k_norm, freq, kc, vc = P["q_norm"], P["k_norm"], P["inv_freq"], P["k_cache"], P["v_cache"]
    use_live = int(P["use_live"]) != 0
    n_q = n_k = n_v = 0      # stored (row, head) units of each kind
    slots = 0
    st_instr = 0
    for ng, g0, _, blocks, act in classes:
        for bx in range(g0, g0 + ng):
            heads = [bx * COLS + h * HD for h in range(COLS // HD) if bx * COLS + h * HD < N]
            for by in act:
                st, _cp = blocks[by]
                rows_st = [by * BT + 16 * i + r for i, v in enumerate(st) for r in range(v)]
                work = [r for r in rows_st if not (lo_pad <= r < pad_hi)]
                # the rows' values, per warp: one request per 32 rows with a row at work
                for w0 in range(by * BT, by * BT + BT, 32):
                    lts = [r for r in work if w0 <= r < w0 + 32]
                    if not lts:
                        continue
                    if use_live:
                        c.add_global("ld", WARPS, *global_sectors([4 * (r // 16) for r in lts], 4))
                    for _ in range(2):   # rows, pos
                        c.add_global("ld", WARPS, *global_sectors([4 * r for r in lts], 4))
                # the lanes' weights (q_norm, k_norm) and frequencies, per warp
                for j in range(PAIRS):
                    idx = list(range(32 * j, min(32 * j + 32, HALF)))
                    for _ in range(2):
                        c.add_global("ld", WARPS, *global_sectors([4 * i for i in idx], 4))
                        c.add_global("ld", WARPS, *global_sectors([4 * (i + HALF) for i in idx], 4))
                    c.add_global("ld", WARPS, *global_sectors([8 * i for i in idx], 8))
                r_b = -(-len(work) * (COLS // HD) // (U * WARPS))   # a partial group's missing heads too
                slots += r_b * U * WARPS
                if any(col < QW + KVW for col in heads):   # rotated heads: the long chain
                    c.epilogue_rope_rounds = max(c.epilogue_rope_rounds, r_b)
                else:
                    c.epilogue_copy_rounds = max(c.epilogue_copy_rounds, r_b)
                if gz == 1:
                    stored = set(r - by * BT for r in rows_st)
                    st_instr += WARPS * 4 * sum(1 for jn in range(BT // 8) for e1 in range(2)
                                                if any(8 * jn + 2 * t + e1 in stored for t in range(4)))
                else:   # the reducer's float4 stores of the columns below N, 32 items per instruction
                    st_instr += -(-len(rows_st) * -(-min(COLS, N - bx * COLS) // 4) // 32)
                for col in heads:
                    for r in work:
                        tl = 1 if flags is None else int(flags[r // 16])
                        if col < QW:
                            n_q += tl != 2
                        elif col < QW + KVW:
                            n_k += 1
                        else:
                            n_v += 1
    per = 1 if gz == 1 else 4     # wavefronts per store: 4-byte lanes, or 16-byte ones
    c.smem_requests += st_instr
    c.smem_wavefronts += per * st_instr
    c.smem_ideal_wavefronts += per * st_instr
    n_ld = slots * 2 * PAIRS + n_v * -(-HD // 32)
    c.smem_requests += n_ld
    c.smem_wavefronts += n_ld
    c.smem_ideal_wavefronts += n_ld
    # global stores: 2 x PAIRS per rotated unit, HD/32 per V unit
    c.add_global("st", n_q * 2 * PAIRS, 4, 128)
    c.add_global("st", (n_k * 2 * PAIRS + n_v * -(-HD // 32)), 2, 64)
    # two barriers around the staging (K loop's tile), or one after the reduction
    c.barriers += (2 if gz == 1 else 1) * sum(len(act) * ng for ng, _, _, _, act in classes)
    rows_any = sum(1 for r in range(M) if (flags is None or int(flags[r // 16])) and not (lo_pad <= r < pad_hi))
    c.bytes_written[_name(y)] = n_q * HD * 4
    c.bytes_written[_name(kc)] = n_k * HD * 2
    c.bytes_written[_name(vc)] = n_v * HD * 2
    c.bytes_read[_name(pos_a)] = rows_any * 4
    c.bytes_read[_name(rows_a)] = rows_any * 4
    c.bytes_read[_name(freq)] = HALF * 8
    c.bytes_read[_name(q_norm) + " (q_norm)"] = HD * 4
    c.bytes_read[_name(k_norm) + " (k_norm)"] = HD * 4
    c.notes.append(f"qkv epilogue (q/k norm + RoPE + K/V scatter): {n_q} Q, {n_k} K, {n_v} V head rows "
                   f"stored; the [M, N] qkv matrix is never written; after its stream the busiest block "
                   f"runs {c.epilogue_rope_rounds} rounds of rotated heads ({c.epilogue_copy_rounds} of V)")
    return n_q * HD * 4 + (n_k + n_v) * HD * 2 + 2 * rows_any * 4 + HALF * 8 + 2 * HD * 4


# ---------------------------------------------------------------------------- attention_mma.cu
def _attn_mma(L) -> KernelCounters:
    d = L.defines
    D, NH, NKV, B, KVT, SPLITS = d["D"], d["NH"], d["NKV"], d["B"], d["KV_TOTAL"], d["SPLITS"]
    P = L.params()
    q, kc, vc, mask, po, pml, out, gate = (P[k] for k in ("q", "k_cache", "v_cache", "mask", "part_o", "part_ml",
                                                           "out", "gate"))
    TILE, G = 32, NH // NKV
    R = B * G
    MW = -(-R // 16)
    KS, DK, DN = D + 8, D // 16, D // 8
    n_tiles = -(-KVT // TILE)
    tps = -(-n_tiles // SPLITS)
    c = KernelCounters("ring_attn_mma_split", "static estimate", L.n_blocks)
    tiles_total = 0
    max_tiles = 0
    for s in range(SPLITS):
        kb, ke = s * tps * TILE, min(KVT, (s + 1) * tps * TILE)
        t = -(-(ke - kb) // TILE) if ke > kb else 0
        tiles_total += t
        max_tiles = max(max_tiles, t)
    tiles_total *= NKV
    THR = MW * 32
    items = TILE * (D // 8)
    # staging: each item one 16-B K load and one 16-B V load (a key row's D halves are contiguous),
    # stored as they stand into k_s and v_s (row stride KS): two 16-B shared stores
    for it in range(-(-items // THR)):
        for wp in range(MW):
            lanes = [it * THR + wp * 32 + ln for ln in range(32)]
            ga = [((i // (D // 8)) * NKV * D + (i % (D // 8)) * 8) * 2 if i < items else None for i in lanes]
            if all(a is None for a in ga):
                continue
            sec, req = global_sectors(ga, 16)
            c.add_global("ld", 2 * tiles_total, sec, req)
            ka = [((i // (D // 8)) * KS + (i % (D // 8)) * 8) * 2 if i < items else None for i in lanes]
            c.add_smem(2 * tiles_total, ka, 16)
    # key visibility one tile ahead: per tile, one warp-level 2-B load of 32 keys per mask row,
    # kept in m_s [B][MS] (2-B stores): the mask's only global read
    MS = TILE + 8
    sec, req = global_sectors([k * 2 for k in range(32)], 2)
    c.add_global("ld", tiles_total * B, sec, req)
    c.add_smem(tiles_total * B, [k * 2 for k in range(32)], 2)
    # S = Q K^T: per warp per tile 4 n-tiles x DK k-steps: 2 x ld32 of K, 2 MMAs (hi, lo)
    warp_tiles = tiles_total * MW
    ks = [((8 * 0 + g) * KS + 2 * t) * 2 for g in range(8) for t in range(4)]
    c.add_smem(warp_tiles * (TILE // 8) * DK * 2, ks, 4)
    c.mma += warp_tiles * (TILE // 8) * DK * 2
    # mask: per warp per tile 16 shared loads of 2 B (rows g, g+8 -> query row b = row / G)
    ma = [((g // G) * MS + 2 * t) * 2 for g in range(8) for t in range(4)]
    c.add_smem(warp_tiles * 16, ma, 2)
    # O += P V: per warp per tile 2 k-steps x DN/2 ldmatrix.x4.trans of V (lane l: row key
    # (l & 7) + 8 * (l >> 3 & 1), dims 8 * (l >> 4)), 2 n-tiles x 2 MMAs each
    vs = [(((ln & 7) + (8 if ln & 8 else 0)) * KS + (8 if ln & 16 else 0)) * 2 for ln in range(32)]
    c.add_smem(warp_tiles * (TILE // 16) * (DN // 2), vs, 16)
    c.mma += warp_tiles * (TILE // 16) * DN * 2
    c.barriers += 2 * tiles_total
    kv_bytes = KVT * NKV * D * 2
    c.bytes_read.update({_name(kc): kv_bytes, _name(vc): kv_bytes, _name(mask): B * KVT * 2,
                         _name(q): B * NH * D * 4})
    # q: each lane 2 x 4 B per (kk, e): small; counted as its bytes
    _contig(c, "ld", B * NH * D * 4)
    out_b = B * NH * D * 4
    out_w = B * NH * D * (2 if d.get("OUT16", 0) else 4)   # out as written: f32 or 16-bit (OUT16)
    part_b = SPLITS * (out_b + B * NH * 8)
    # FOLD_MERGE 0: the partials are merged by ring_attn_combine, a launch of its own (_small)
    fold = SPLITS > 1 and d.get("FOLD_MERGE", 1) == 1
    if SPLITS == 1 or fold:
        c.bytes_written[_name(out)] = out_w
        _contig(c, "st", out_w)
    if SPLITS > 1:
        c.bytes_written[_name(po)] = SPLITS * out_b
        c.bytes_written[_name(pml)] = SPLITS * B * NH * 8
        _contig(c, "st", part_b)
    if fold:
        # the folded combine: the last of each kv head's SPLITS blocks reads them all back
        # (__ldcg, from L2): per row the maxima and the weighted sums (a thread per row, 4 + 8 B
        # loads), then per 32 four-dim items of a warp (one row at D 128) per split one
        # broadcast 4-B max and four coalesced 128-B part_o loads
        c.bytes_read[_name(po)] = SPLITS * out_b
        c.bytes_read[_name(pml)] = SPLITS * B * NH * 8
        _contig(c, "ld", SPLITS * out_b)
        for w0 in range(0, R, 32):             # the row pass: lane = row r -> qrow (r / G) * NH + r % G
            rows = [((r // G) * NH + r % G) * 8 if r < R else None for r in range(w0, w0 + 32)]
            for width in (4, 8):
                sec, req = global_sectors(rows, width)
                c.add_global("ld", NKV * SPLITS, sec, req)
        item_req = NKV * -(-R * D // 4 // 32) * SPLITS
        c.add_global("ld", item_req, 1, 32 * 4)
        c.barriers += NKV   # the merge's row pass (the arrival's two: below, per block)
    c.dram_bytes = 2 * kv_bytes + B * KVT * 2 + B * NH * D * 4 + (
        out_w + 2 * part_b if fold else part_b if SPLITS > 1 else out_w)
    # the lane's page table (kv_pages.py): one 4-B entry per key tile per block, the same word
    # for every thread (one sector per warp request, a tile ahead); its entries once from DRAM
    table_b = -(-KVT // d.get("PAGE", 32)) * 4
    c.add_global("ld", tiles_total * MW, 1, 4)
    c.bytes_read[_name(P.get("pages"))] = table_b
    c.dram_bytes += table_b
    # a tile's K/V loads and the mask loads of the tile after it are issued together before
    # the math of the tile before, and consumed after it: one round trip per tile
    c.dram_round_trips_per_block = max_tiles
    c.inflight_peak_bytes_per_warp = -(-items // THR) * 2 * 16 * 32 + -(-B // MW) * 2 * 32
    c.notes.append(f"{L.n_blocks} blocks ({NKV} kv heads x {SPLITS} splits), {max_tiles} key tiles each, "
                   f"one K/V round trip per tile (issued a tile ahead)")
    if fold:
        # the merging block's path after its own tiles, once per launch (the merges of units
        # finished earlier overlap the later blocks' tiles): the row pass (two dependent
        # rounds per MERGE_UNROLL splits), then each thread's items, MERGE_UNROLL splits x 5
        # loads in flight per round; bound too by its SM's share of the L2 bandwidth
        per_thread = -(-R * D // 4 // THR)
        steps = -(-SPLITS // kernels.constants("attention_common.cuh")["MERGE_UNROLL"])
        c.tail_l2_round_trips = 2 * steps + per_thread * steps
        c.tail_l2_bytes = part_b // NKV
        c.notes.append(f"splits merged in the same launch: the last block of each kv head reads "
                       f"{c.tail_l2_bytes / 1e3:.0f} KB of partials back from L2 "
                       f"({c.tail_l2_round_trips:.0f} dependent L2 round trips after its tiles)")
    # everything above is one lane's; every lane of a LANES launch assumed live (the
    # descriptors are read at run time)
    lanes = d.get("LANES", 1)
    if lanes > 1:
        for k in ("gld_requests", "gld_sectors", "gld_bytes", "gst_requests", "gst_sectors", "gst_bytes",
                  "smem_requests", "smem_wavefronts", "smem_ideal_wavefronts", "mma", "barriers", "dram_bytes"):
            setattr(c, k, getattr(c, k) * lanes)
        for dct in (c.bytes_read, c.bytes_written):
            for k in dct:
                dct[k] *= lanes
        c.notes.append(f"{lanes} lanes, all assumed live")
    c.barriers += L.n_blocks * (3 if fold else 1)   # the first one; the arrival's two
    return c


# ---------------------------------------------------------------------------- the small kernels
def _bytes_only(L, reads, writes, note="") -> KernelCounters:
    c = KernelCounters(L.kernel, "static estimate (bytes only)", L.n_blocks)
    _rw(c, reads, writes)
    for _, n in reads:
        _contig(c, "ld", n)
    for _, n in writes:
        _contig(c, "st", n)
    c.dram_bytes = sum(n for _, n in reads) + sum(n for _, n in writes)
    c.dram_round_trips_per_block = 1.0
    if note:
        c.notes.append(note)
    return c


def _selector_merge_bytes(n, d: dict, P: dict, rows: int) -> tuple[list, list, str]:
    """selector.cu's merge of ``rows`` rows: (reads, writes, note)."""
    K = d["SEL_K"]
    nb = min(P["nblk"], K)
    return ([(n("part"), rows * (P["nblk"] + nb * K) * 8)], [(n("ids"), rows * K * 4), (n("vals"), rows * K * 4)],
            f"{P['nblk']} first pairs, then the {nb} best blocks' {K} pairs each, per row")


def _selector_project_bytes(n, d: dict, lanes: int) -> tuple[list, list]:
    """selector.cu's hidden projection of ``lanes`` lanes: (reads, writes)."""
    Q, H, rank = d["SEL_Q"], d["SEL_H"], d["SEL_RANK"]
    R, wb = Q - 1, (4 if d.get("SEL_HPT", 2) == 0 else 2)
    return ([(n("hidden"), lanes * R * H * 4), (n("hp_w"), rank * H * wb)], [(n("hp_ws"), lanes * R * rank * 4)])


def _selector_edges_walk_bytes(n, d: dict, lanes: int) -> tuple[list, list, str]:
    """selector.cu's edges and walk of ``lanes`` lanes: (reads, writes, note). Each row's
    blocks read its K candidates' successor rows and their share of the K predecessor rows
    (row 0: the anchor's); the walker reads every row's edges back (L2, counted once)."""
    Q, rank, K = d["SEL_Q"], d["SEL_RANK"], d["SEL_K"]
    R, cb = Q - 1, (4 if d.get("SEL_CBT", 2) == 0 else 2)
    preds = 1 + max(0, R - 1) * K
    reads = [(n("hp_ws"), lanes * R * rank * 4), (n("pred_cb"), lanes * preds * rank * cb),
             (n("succ_cb"), lanes * R * K * rank * cb), (n("ids"), lanes * R * K * 4), (n("vals"), lanes * R * K * 4)]
    writes = [(n("edges"), lanes * R * K * K * 4), (n("tokens"), lanes * Q * 4), (n("choice"), lanes * R * 4),
              (n("q"), lanes * R * K * 4)]
    return reads, writes, ("codebook rows gathered once per row (the successor rows re-read by the row's "
                           "other blocks and the edges read back by the walker come from L2, not counted)")


def _small(L) -> KernelCounters:
    k, d = L.kernel, L.defines
    P = L.params()          # the arguments by the kernel's parameter names
    n = lambda key: _name(P[key])
    if k == "reset_slots_if":
        return _bytes_only(L, [(n("desc"), 4)], [], "steady state: desc says no reset")
    if k == "reset_slots":
        return _bytes_only(L, [], [(n("slot_pos"), d["CAP"] * 4)])
    if k == "plan_append":
        rows, n_q = P["a_rows"], P["n_q"]
        return _bytes_only(L, [(n("desc"), 12)],
                           [(n("ap_pos"), rows * 4), (n("ap_rows"), rows * 4), (n("pos_q"), n_q * 4)],
                           "slot_pos writes (n_new of them) not counted: data-dependent")
    if k == "gather_features":
        rows, fc_in = P["a_rows"], d["FC_IN"]
        item = {0: 4, 1: 2, 2: 2}[d["RING_DTYPE"]]
        return _bytes_only(L, [(n("ring"), rows * fc_in * item)], [(n("ap_feat"), rows * fc_in * 4)],
                           "all rows counted as new (upper bound of the ring read)")
    if k == "plan_lanes":   # step_plan.cu: every lane's planning in one launch (grid x, lanes)
        a_rows, cs, cap, q_len, bs, kvt, mflags, lanes = (P[x] for x in ("a_rows", "cs", "cap", "q_len", "bs",
                                                                         "kv_total", "masks", "lanes"))
        item = {0: 4, 1: 2, 2: 2}[d["RING_DTYPE"]]
        gx = -(-d["FC_IN"] // (256 * 4))
        plan_blocks = L.grid[0] - gx * a_rows
        # each lane's appended rows (the plan may know them; else every lane appends a_rows):
        # the gather blocks of rows past a lane's count, and an idle lane's plan blocks, exit
        # at their start
        app = L.known.get("lanes_app") or (a_rows,) * lanes
        act = [x for x in app if x is not None]
        n_rows = sum(min(x, a_rows) for x in act)
        nm = (mflags & 1) + (mflags >> 1 & 1)
        reads = [(n("desc_all"), lanes * 4 * 16), (n("ring_all"), n_rows * d["FC_IN"] * item),
                 (n("slot_pos_all"), len(act) * cap * 4)]
        writes = [(n("ap_feat_all"), n_rows * d["FC_IN"] * 4), (n("pos_all"), lanes * (cs + bs) * 4),
                  (n("rows_all"), lanes * cs * 4), (n("tile_live"), lanes * (cs + bs) // 16 * 4)]
        writes += [(n(m), len(act) * q_len * kvt * 2) for i, m in enumerate(("mask_full_all", "mask_swa_all"))
                   if mflags >> i & 1]
        c = _bytes_only(L, reads, writes, f"{len(act)} of {lanes} lanes active, {n_rows} rows gathered; "
                        f"{nm} mask(s) rebuilt per active lane" + ("" if L.known.get("lanes_app") else
                                                                    " (every lane assumed active, a_rows each)"))
        c.live_blocks = n_rows * gx + len(act) * plan_blocks
        c.dram_round_trips_per_block = 2.0   # the descriptor, then the ring rows / slot table
        return c
    if k.startswith("build_mask"):
        masks = ("mask_full", "mask_swa") if k == "build_masks" else ("mask_" + k.rsplit("_", 1)[1],)
        writes = [(n(m), d["Q_LEN"] * d["KV_TOTAL"] * 2) for m in masks]
        return _bytes_only(L, [(n("slot_pos"), d["CAP"] * 4)], writes)
    if k == "rmsnorm":
        rows, D = P["rows"], d["NORM_D"]
        flags = L.known.get("tile_live") if int(P.get("use_live", 0)) else None
        live = rows if flags is None else sum(1 for r in range(rows) if flags[r // 16])
        writes = [(n("y"), live * D * (2 if d.get("NORM_Y16", 0) else 4))]   # NORM_Y16: 16-bit y
        return _bytes_only(L, [(n("x"), live * D * 4), (n("w"), P["w_rows"] * D * 4)], writes,
                           f"tile_live: {rows - live} dead row(s) skipped" if flags is not None else "")
    if k == "ring_attn_combine":   # merge="launch": every lane of a LANES launch assumed live
        S, B, NH, D, lanes = d["SPLITS"], d["B"], d["NH"], d["D"], d.get("LANES", 1)
        return _bytes_only(L, [(n("part_o"), lanes * S * B * NH * D * 4), (n("part_ml"), lanes * S * B * NH * 8)],
                           [(n("out"), lanes * B * NH * D * (2 if d.get("OUT16", 0) else 4))],
                           "part_ml is re-read by every thread of a row: L1/L2 hits, not counted"
                           + (f"; {lanes} lanes, all assumed live" if lanes > 1 else ""))
    if k == "qkv_norm_rope":
        M, D, NH, NKV, has_q = P["M"], d["D"], d["NH"], d["NKV"], d.get("HAS_Q", 0)
        # tile_live (lane batches), when the plan knows it: dead tiles' rows skipped, the
        # context tiles' (2) Q heads skipped
        flags = L.known.get("tile_live") if int(P.get("use_live", 0)) else None
        tl = [1 if flags is None else int(flags[m // 16]) for m in range(M)]
        rows = sum(1 for v in tl if v)
        q_rows = sum(1 for v in tl if v and v != 2) if has_q else 0
        reads = [(n("qkv"), (q_rows * NH * D + rows * 2 * NKV * D) * 4), (n("pos"), rows * 4),
                 (n("rows"), rows * 4), (n("inv_freq"), D // 2 * 8)]
        writes = [(n("k_cache"), rows * NKV * D * 2), (n("v_cache"), rows * NKV * D * 2)]
        if has_q:
            writes.append((n("q_out"), q_rows * NH * D * 4))
        return _bytes_only(L, reads, writes, f"tile_live: {M - rows} dead row(s), {rows - q_rows} without Q"
                           if flags is not None else "")
    if k == "grouped_conv":   # conv.cu: DFlash 2's convolution, grid (H / threads, rows)
        rows, H, T, gs = L.grid[1], d["CONV_H"], d["CONV_TAPS"], d["CONV_GROUP"]
        flags = L.known.get("tile_live") if int(P.get("use_live", 0)) else None
        live = rows if flags is None else sum(1 for r in range(rows) if flags[r // 16])
        reads = [(n("x"), live * H * 4), (n("base"), T * H * 4), (n("d"), live * T * (H // gs) * 4)]
        if int(P.get("add_residual", 0)):
            reads.append((n("residual"), live * H * 4))
        return _bytes_only(L, reads, [(n("y"), live * H * 4)],
                           "the taps' earlier rows re-read from L1/L2, not counted"
                           + (f"; tile_live: {rows - live} dead row(s) skipped" if flags is not None else ""))
    if k == "grouped_conv_norm":   # conv.cu: the finish convolution + the next RMSNorm, grid (rows)
        rows, H, T, gs = L.grid[0], d["CONV_H"], d["CONV_TAPS"], d["CONV_GROUP"]
        flags = L.known.get("tile_live") if int(P.get("use_live", 0)) else None
        live = rows if flags is None else sum(1 for r in range(rows) if flags[r // 16])
        reads = [(n("x"), live * H * 4), (n("base"), T * H * 4), (n("d"), live * T * (H // gs) * 4),
                 (n("residual"), live * H * 4), (n("w"), H * 4)]
        return _bytes_only(L, reads, [(n("y"), live * H * 4), (n("yn"), live * H * 4)],
                           "the taps' earlier rows re-read from L1/L2, not counted"
                           + (f"; tile_live: {rows - live} dead row(s) skipped" if flags is not None else ""))
    if k == "selector_topk_blocks":   # selector.cu: each (row, column block)'s best K
        rows, nblk, K = L.grid[1], P["nblk"], d["SEL_K"]
        return _bytes_only(L, [(n("logits"), rows * d["SEL_V"] * 4)], [(n("part"), rows * nblk * K * 8)])
    if k == "selector_topk_merge":   # each block's first pair, then the K best blocks' K pairs
        reads, writes, note = _selector_merge_bytes(n, d, P, L.grid[0])
        c = _bytes_only(L, reads, writes, note)
        c.dram_round_trips_per_block = 2.0   # the chosen blocks' pairs wait for the first pairs' rounds
        return c
    if k == "selector_project_merge":   # the hp slices and (merge_rows) the merge's rows in one grid
        lanes, R, mr = L.grid[1], d["SEL_Q"] - 1, P["merge_rows"]
        reads, writes = _selector_project_bytes(n, d, lanes)
        note = "hp = hidden_projection(hidden)"
        if mr:
            m_reads, m_writes, m_note = _selector_merge_bytes(n, d, P, lanes * R)
            reads, writes, note = reads + m_reads, writes + m_writes, f"{note}; merge: {m_note}"
        c = _bytes_only(L, reads, writes, note)
        c.dram_round_trips_per_block = 2.0 if mr else 1.0   # the merge's first pairs, then its chosen lists'
        return c
    if k == "selector_edges_walk":   # every row's K x K edges, then the lane's last block walks
        reads, writes, note = _selector_edges_walk_bytes(n, d, L.grid[1])
        c = _bytes_only(L, reads, writes, note)
        c.dram_round_trips_per_block = 3.0 if d["SEL_Q"] > 1 else 1.0   # ids, codebook rows; the staged edges
        return c
    return _bytes_only(L, [], [], f"no access model for kernel {k!r}: counters are empty")


def static_counters(launch) -> KernelCounters:
    """A ``KernelCounters`` estimated from the kernel's source and the launch's shapes."""
    if launch.kernel == "gemm_stream":
        return _gemm_stream(launch)
    if launch.kernel == "gemm_wgmma":
        return _gemm_wgmma(launch)
    if launch.kernel == "ring_attn_mma_split":
        return _attn_mma(launch)
    return _small(launch)


def copy_counters(copy) -> KernelCounters:
    """A graph memcpy node: its bytes (read + written)."""
    c = KernelCounters(f"memcpy {copy.kind}", "static estimate (bytes only)", 0)
    c.bytes_read[copy.src.name] = copy.nbytes
    c.bytes_written[copy.dst.name] = copy.nbytes
    c.dram_bytes = 2 * copy.nbytes if copy.kind == "d2d" else copy.nbytes
    return c


def sample_blocks(grid, n: int = 8, seed: int = 0) -> list:
    """The blocks a sampling counter mode runs: the first, the last and
    ``n - 2`` others drawn with ``seed``, one from each of ``n - 2`` equal
    stretches of the blocks between them (stratified: work that varies with a
    slow grid index, e.g. an attention split, is sampled evenly), all of them
    when the grid is small; as (x, y, z) in launch order. Additive counters of the sample are scaled
    by ``blocks / len(sample)``; per-array distinct bytes are not additive
    (blocks re-read shared inputs) and come from the static model or an
    address-only pass over the whole grid."""
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    total = gx * gy * gz
    if n < 2 or total < 1:
        raise ValueError(f"n must be >= 2 and the grid non-empty, got n={n}, grid={grid}")
    if total <= n:
        ids = list(range(total))
    else:
        rng = np.random.default_rng(seed)
        edges = np.linspace(1, total - 1, n - 1).round().astype(np.int64)   # n - 2 stretches of [1, total - 1)
        ids = sorted({0, total - 1, *(int(rng.integers(a, max(a + 1, b))) for a, b in zip(edges[:-1], edges[1:]))})
    return [(i % gx, (i // gx) % gy, i // (gx * gy)) for i in ids]


def scale_sample(c: KernelCounters, blocks_counted: int) -> KernelCounters:
    """Additive counters of ``blocks_counted`` sampled blocks scaled to ``c.blocks``."""
    if not 1 <= blocks_counted <= c.blocks:
        raise ValueError(f"blocks_counted must be in [1, {c.blocks}], got {blocks_counted}")
    f = c.blocks / blocks_counted
    for k in ("gld_requests", "gld_sectors", "gld_bytes", "gst_requests", "gst_sectors", "gst_bytes",
              "smem_requests", "smem_wavefronts", "smem_ideal_wavefronts", "mma", "barriers", "wgmma_mma",
              "wgmma_smem_bytes"):
        setattr(c, k, int(round(getattr(c, k) * f)))
    c.blocks_counted = blocks_counted
    return c


def totals(counters) -> Counter:
    t = Counter()
    for c in counters:
        t["dram_bytes"] += c.dram_bytes
        t["l2_bytes"] += c.l2_bytes
        t["mma"] += c.mma
        t["smem_wavefronts"] += c.smem_wavefronts
        t["barriers"] += c.barriers
    return t
