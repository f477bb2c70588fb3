"""Launch planning for ``cuda_src/gemm_stream.cu`` (the weight-streaming
tensor-core GEMM) and ``cuda_src/gemm_wgmma.cu`` (its many-row variant).

``plan(N, K, m, ...)`` picks, for one call over ``m`` rows, the M-tile
variant (16/32/64 rows), the split-K count, the slice and the staged x chunk,
from the device's SM count and shared-memory opt-in limit (a ``Device``; the
emulator uses the explicit H200 profile ``H200``); ``plan_wgmma`` the same for
the wgmma kernel. ``GemmVariant`` is what one GEMM is compiled for (its ``-D``
options and tuning key). ``StreamKernels`` compiles the variants and launches
them; ``ops.gemm.Gemm(path="stream")`` is the public entry. The figures these
plans imply (bytes in flight, shared-memory reads per weight byte, waves):
``profiling/gemm_figures.py``.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from .. import device_props, dtypes, kernels

WARPS = 8                 # warps per block (GS_WARPS)
DEPTH = {1: 2, 2: 3, 4: 3}  # ring depth in 64-k steps (GS_DEPTH) per M variant
KSTEP = 64                # k per ring step
RAW_KT = 128              # a raw (cp.async) variant's chunks: whole 128-k rows of the lanes' row sums
XPAD = 32                 # x tile row padding in elements: a row stride of 64 (mod 128) bytes
WTILES = 4                # 8-row weight tiles per warp: GS_NT = 4 (or 2 per matrix for silu_mul)
MT_BUCKETS = (1, 2, 4)    # 16-row M tiles per block: the compiled variants
MAX_K_SPLIT = 16
MIN_K_SLICE = 256         # a thinner slice is not worth its partial-sum traffic
PARTIAL_COST = 0.5        # L2 bytes (split-K partials) cost vs HBM weight bytes, spread over all SMs
REDUCE_COST = 0.33        # the last block's serial read of the partials: one SM's L2 rate (~110 GB/s)
                          # vs its share of HBM (4.8 TB/s / 132 ~ 36 GB/s)
INFLIGHT_TARGET = 24 * 1024

# ptxas (NVRTC, sm_90) registers per thread of each M variant, with GS_MINB
# from the kernel (2 blocks for MT 1, else 1); tests/test_gemm_stream.py
# recompiles and checks these are not exceeded. Rounded up to the allocation
# granularity of 8 they set the register-limited residency.
PTXAS_REGS = {1: 128, 2: 208, 4: 240}   # max over f16/bf16, the epilogues, hi+lo or not (MT 4:
                                        # the fused top-K at K 4096, 239; history: docs/decisions/gemm.md)
# GS_CONV (kernel_projection, its prepare convolution fused) is built for one block an SM at every
# MT (GS_MINB 1): its grids stay under a wave, and its split-K reduction keeps twice the partial
# loads in flight in the room (gemm_splitk.cuh SPLITK_ONE_BLOCK); held by tests/test_gemm_stream.py
PTXAS_REGS_CONV = {1: 255, 2: 255, 4: 255}
REGS_PER_SM = 65536
THREADS_PER_SM = 2048
SMEM_RESERVED = 1024      # per block, by the driver
SMEM_PER_SM = 233472      # 228 KiB on Hopper


@dataclass(frozen=True)
class Device:
    sm_count: int
    smem_optin: int       # max dynamic shared memory per block


H200 = Device(device_props.H200.sm_count, device_props.H200.smem_optin)  # the emulator's profile


def device_of(backend) -> Device:
    """The device's SM count and shared-memory opt-in limit (``device_props``:
    queried on a GPU, the H200 profile on the emulator)."""
    p = device_props.of(backend)
    return Device(p.sm_count, p.smem_optin)


def bucket(m: int) -> int:
    """16-row tiles of the variant that serves ``m`` rows (the top one beyond 64)."""
    for mt in MT_BUCKETS:
        if m <= 16 * mt:
            return mt
    return MT_BUCKETS[-1]


def cols_per_block(nw: int, conv: bool = False) -> int:
    return WARPS * 8 * tiles_per_warp(nw, conv)


def tiles_per_warp(nw: int, conv: bool = False) -> int:
    """GS_NT: 8-row weight tiles per warp and weight matrix (CONV_NT for a GS_CONV variant)."""
    return CONV_NT if conv else WTILES // nw


def smem_bytes(tiles: int, kt: int, split: int, raw: bool = False) -> int:
    """Dynamic shared memory: the hi (and lo) planes of the staged x chunk; ``raw`` (GS_NORM with
    an f32 x): also the raw f32 chunk and its two gammas, which cp.async fills a chunk ahead."""
    return split * 16 * tiles * (kt + XPAD) * 2 + (raw_bytes(tiles, kt) if raw else 0)


def raw_bytes(tiles: int, kt: int) -> int:
    """The raw chunk [16 * tiles][kt] f32, then ln and ln_lo [kt] f32 each."""
    return (16 * tiles + 2) * kt * 4


def blocks_per_sm(mt: int, smem: int, conv: bool = False) -> int:
    regs = -(-(PTXAS_REGS_CONV if conv else PTXAS_REGS)[mt] // 8) * 8
    by_regs = REGS_PER_SM // (regs * WARPS * 32)
    by_smem = SMEM_PER_SM // (smem + SMEM_RESERVED)
    return max(0, min(by_regs, by_smem, THREADS_PER_SM // (WARPS * 32)))


def block_inflight(mt: int, conv: bool = False) -> int:
    """Weight bytes a block keeps in flight as compiled: one ring slot per warp (128 B per
    thread in every variant's steady-state loop, profiling/sass.py; the source's DEPTH - 1
    slots would be twice that for MT 2 and 4)."""
    return WARPS * (CONV_NT if conv else WTILES) * 8 * 128


def stream_terms(blocks: int, block_bytes: int, mt: int, dev: Device, conv: bool = False) -> tuple:
    """``(spread, busiest)``: a launch's weight stream in bytes at one SM's share of HBM, its
    bytes spread over the SMs, and the busiest SM's bytes (its blocks one after another, as many
    at once as fit) slowed by Little's law where it keeps less than INFLIGHT_TARGET in flight."""
    per_sm = -(-blocks // dev.sm_count)
    inflight = min(max(1, blocks_per_sm(mt, 0, conv)), per_sm) * block_inflight(mt, conv)
    return blocks * block_bytes / dev.sm_count, per_sm * block_bytes * INFLIGHT_TARGET / inflight


GRID_X_MAX = 2**31 - 1

# GS_CONV (the prepare convolution after the kernel_projection GEMM, cuda_src/gemm_conv.cuh): the
# blocks holding final coefficients convolve their groups' channels after the GEMM, a serial tail
# of conv_tail_trips dependent L2 round trips; fused while that stays within CONV_FUSE_MAX_TRIPS
# (8 x ~280 ns: below a conv.cu launch plus its graph-node gap, ~1.1 + 1.5 us), else the caller
# runs conv.cu's grouped_conv (docs/decisions/dflash2.md)
CONV_FUSE_MAX_TRIPS = 8
# A GS_CONV variant's column block: CONV_NT weight tiles a warp (128 columns, not 256). Its grids
# stay under a wave, so narrower blocks spread the same weights over more SMs (h5120's
# kernel_projection: 10 column groups x 12 slices = 120 blocks, where 256 columns gave 5 x 16 =
# 80) and halve what each reducing block does alone after the stream: the split-K reduction (its
# 12 slices' loads at once, one round trip) and the prepare convolution (gemm_conv.cuh: a
# chunk's rows in two parts, every thread busy). docs/decisions/dflash2.md.
CONV_NT = 2


def conv_tail_trips(rows: int, N: int, taps: int, group: int, cols: int, block_rows: int | None = None) -> int:
    """gemm_conv.cuh's dependent L2 round trips in a block of ``block_rows`` (16 * MT; default
    ``rows`` rounded up to 16) with ``rows`` live, holding ``cols`` output columns of ``N``
    ([group][half][tap]): a thread's work items x the pairs of row batches of each (a batch's
    x window and d loads issued before the batch ahead's sums and stores: two batches' loads in
    flight together). A work item is a chunk's rows or, where a full column block has fewer
    chunks than threads, one of PARTS parts of them."""
    rb = max(1, kernels.constants("gemm_conv.cuh")["GEMM_CONV_ROWS"] // taps)
    vec = 4 if group % 4 == 0 else 1
    block_rows = -(-rows // 16) * 16 if block_rows is None else block_rows
    chunks = min(cols, N) // (2 * taps) * group // vec
    full = max(1, cols // (2 * taps) * group // vec)
    npairs = -(-block_rows // (2 * rb))
    parts = max(1, min(WARPS * 32 // full, npairs))
    part_rows = -(-npairs // parts) * 2 * rb
    return -(-min(part_rows, rows) // (2 * rb)) * -(-chunks * parts // (WARPS * 32))


@dataclass(frozen=True)
class Plan:
    mt: int | str         # compiled variant: 16-row tiles per block (mma.sync), or "wg64"/"wg128" (wgmma)
    tiles: int            # live tiles of a full block
    grid: tuple           # (groups * mblocks, 1, ks): block x = column group * mblocks + M block
    ks: int               # K slices (grid z)
    kz: int               # K per slice, multiple of 64
    kt: int               # x chunk staged at once, multiple of 64
    smem: int             # dynamic shared memory per block
    groups: int = 1       # column groups (COLS output columns each)
    mblocks: int = 1      # M blocks (rows each)

    @property
    def rows(self) -> int:
        """Rows of x per block: 16 * mt, or the wgmma variant's tokens."""
        return wg_tokens(self.mt) if isinstance(self.mt, str) else 16 * self.mt

    @property
    def threads(self) -> int:
        return WG_THREADS if isinstance(self.mt, str) else WARPS * 32


def _kt_for(kz: int, mt: int, tiles: int, split: int, dev: Device, raw: bool = False) -> int:
    # The whole slice at once when it fits (x staged once per block, overlapped
    # with the first weight loads); the chunk leaves room for the variant's
    # register-limited residency (raw: for the raw chunk and gammas too, chunks of whole
    # RAW_KT; MT 1 at 2 blocks per SM: kt <= 768, MT 4 at 1: kt <= 384).
    resident = blocks_per_sm(mt, 0)
    budget = min(dev.smem_optin, SMEM_PER_SM // resident - SMEM_RESERVED)
    if raw:   # the raw chunk, its gammas and (static) the lanes' row partials, 16 x MT x 32 f32
        per_k = split * 16 * tiles * 2 + (16 * tiles + 2) * 4
        cap = (budget - split * 16 * tiles * XPAD * 2 - 16 * mt * 32 * 4) // per_k // RAW_KT * RAW_KT
        return max(KSTEP, kz if kz <= cap else cap)
    cap = (budget - split * 16 * tiles * XPAD * 2) // (split * 16 * tiles * 2) // KSTEP * KSTEP
    return max(KSTEP, min(kz, cap))


def plan(N: int, K: int, m: int, nw: int = 1, split: int = 2, dev: Device = H200, mt: int | None = None,
         ks: int | None = None, raw: bool = False, conv: bool = False) -> Plan:
    """Launch of one call over ``m`` rows (``mt``: force a compiled variant;
    ``ks``: force the K split, at most what K's 64-wide steps allow and, with
    several M blocks, what one wave holds; ``raw``: the variant stages a raw
    f32 chunk too, GS_NORM with an f32 x, ``smem_bytes``).

    Split K with several M blocks is planned only while the split grid fits
    one wave of resident blocks (``groups * mblocks * ks <= SMs x blocks per
    SM``): its purpose is filling an under-filled device, and the cap bounds
    the partial-tile workspace of such splits by one wave's tiles whatever
    ``m`` is (at most 132 x 64 rows x 256 columns x 2 matrices x 4 B = 17 MB,
    silu_mul at GS_MT 4 on an H200; 8.7 MB for one matrix). One M block keeps
    the rule it had (its split grid may exceed a wave). ``conv``: a GS_CONV variant (one
    block an SM, PTXAS_REGS_CONV)."""
    mt = bucket(m) if mt is None else mt
    rows = 16 * mt
    gy = -(-m // rows)
    tiles = -(-min(m, rows) // 16)
    cols = cols_per_block(nw, conv)
    nblk = -(-N // cols)
    k64 = -(-K // KSTEP) * KSTEP
    best = None
    forced = ks
    for ks in range(1, MAX_K_SPLIT + 1):
        if forced is not None and ks not in (1, forced):
            continue
        if ks > 1 and gy > 1 and nblk * gy * ks > dev.sm_count * blocks_per_sm(mt, 0, conv):
            break  # several M blocks: split K only inside one wave (see above)
        kz = -(-(-(-K // ks)) // KSTEP) * KSTEP
        ks_eff = -(-K // kz)
        if ks_eff != ks or (ks > 1 and kz < MIN_K_SLICE and forced is None):
            continue
        blocks = nblk * gy * ks
        block_bytes = cols * nw * kz * 2
        if raw:
            # x staged by cp.async (a chunk's copies all in flight, whatever its size): the
            # stream by bytes in flight (stream_terms), not by rounds of blocks. A slice costs
            # its partials and its share of the reduction, and buys bytes in flight only where
            # an SM lacks them (docs/decisions/gemm.md: the folded norm's launch rule).
            stream = max(stream_terms(blocks, block_bytes, mt, dev, conv))
        else:
            # x staged through registers (GS_XB items per thread per L2 round trip): a thicker
            # slice is a longer dependent chain (tests/test_sass_kernels.py: CHAIN_MAX), so the
            # busiest SM's blocks x their bytes; past one wave of resident blocks a partial
            # last wave is priced whole (its few blocks run alone: latency- not bandwidth-bound;
            # h5120 gate_up: 10 slices left a 40-block tail on 264 slots, 9 none)
            slots = dev.sm_count * max(1, blocks_per_sm(mt, 0, conv))
            rounds = (-(-blocks // slots) * (slots // dev.sm_count) if blocks > slots
                      else -(-blocks // dev.sm_count))
            stream = rounds * block_bytes
        live = min(m, rows)
        partial = 2 * ks * m * N * nw * 4 if ks > 1 else 0    # every M block's partial tiles, written and read
        tail = ks * live * cols * nw * 4 if ks > 1 else 0   # a reducing block's reads
        cost = stream + PARTIAL_COST * partial / dev.sm_count + REDUCE_COST * tail
        if forced is not None and ks == forced:
            cost = -1.0
        if best is None or cost < best[0]:
            best = (cost, ks, kz)
    _, ks, kz = best
    kt = _kt_for(kz, mt, tiles, split, dev, raw)
    if nblk * gy > GRID_X_MAX:
        raise ValueError(f"m={m}, N={N}: {nblk} column groups x {gy} M blocks exceed the grid's x limit")
    return Plan(mt=mt, tiles=tiles, grid=(nblk * gy, 1, ks), ks=ks, kz=kz, kt=kt,
                smem=smem_bytes(tiles, kt, split, raw), groups=nblk, mblocks=gy)


# ---- the wgmma variants (cuda_src/gemm_wgmma.cu): "wg<BT>", BT rows of x per block
WG_VARIANTS = ("wg64", "wg128")
WG_THREADS = 256          # two warpgroups (GW_WG 2)
WG_WEIGHT_ROWS = 256      # weight rows per block: 2 warpgroups x 2 sets of 64
WG_DEPTH = {64: 3, 128: 2}
# The default rule takes wgmma from WG_MIN_M rows ("wg64" up to 64, "wg128" beyond): the
# 64-row mma.sync variant is mma-issue bound there with hi + lo (profiling/gemm_model.py,
# H200: 74-84% of HBM at m = 64 vs 86-98% with wgmma), and at m <= 48 both stream at the floor.
WG_MIN_M = 49
# ptxas (NVRTC, sm_90a) registers per thread, max over dtypes, epilogues, hi + lo and the folded
# norm (tests/test_gemm_wgmma.py holds the kernel to them); one block of 256 threads per SM
# either way (history: docs/decisions/gemm.md).
WG_PTXAS_REGS = {64: 248, 128: 255}
WG_EPI_UNITS = kernels.constants("gemm_wgmma.cu")["GW_EPI_UNITS"]   # qkv epilogue units per warp at once
WG_BLOCK_STEPS = 2        # a block's fixed cost in 64-k steps: its first loads, the epilogue
WG_SPLIT_STEPS = 3        # a split block's partial tile and the last slice's reduction, in steps


def wg_tokens(variant: str) -> int:
    if variant not in WG_VARIANTS:
        raise ValueError(f"wgmma variant {variant!r}: expected one of {WG_VARIANTS}")
    return int(variant[2:])


def wg_cols(nw: int) -> int:
    """Output columns per block of the wgmma kernel (128 for silu_mul: gate and up rows)."""
    return WG_WEIGHT_ROWS // nw


def wg_smem(bt: int, split: int) -> int:
    """Dynamic shared memory: two buffers of one 64-k step of x per plane, each of its four
    k16 instructions padded by 64 bytes (gemm_wgmma.cu's Q_B)."""
    return 2 * split * 4 * (bt * 32 + 64)


def wg_qkv_smem(bt: int) -> int:
    """Dynamic shared memory the qkv epilogue (GW_EPI 3) stages a tile's final values in:
    [BT][COLS + 4] f32 over the x buffers (gemm_wgmma.cu's TS)."""
    return bt * (WG_WEIGHT_ROWS + 4) * 4


def qkv_fold_problem(N: int, nw: int, head_dim: int, q_width: int, kv_width: int) -> str | None:
    """Why the qkv epilogue (GW_EPI 3) cannot serve a GEMM of these shapes, or None: every head
    must lie inside one column group of the wgmma kernel."""
    cols = wg_cols(nw)
    if nw != 1:
        return "the epilogue is silu_mul (two weight matrices per column)"
    if head_dim < 2 or head_dim % 2:
        return f"head_dim {head_dim} is not even"
    if cols % head_dim:
        return f"head_dim {head_dim} does not divide the wgmma column group of {cols}: a head would straddle two"
    if q_width % head_dim or kv_width % head_dim or N != q_width + 2 * kv_width:
        return f"N={N} is not q_width {q_width} + 2 * kv_width {kv_width} in whole heads of {head_dim}"
    return None


def plan_wgmma(N: int, K: int, m: int, nw: int = 1, split: int = 2, dev: Device = H200, variant: str = "wg128",
               ks: int | None = None) -> Plan:
    """Launch of ``gemm_wgmma.cu`` for ``m`` rows: column groups x row blocks of BT,
    one block per SM (its registers), and the K split (slices of >= ``MIN_K_SLICE``
    unless forced) that minimises whole waves x (steps per block + its fixed part), i.e.
    fills the SMs when the groups alone do not, without slicing so thin that the fixed
    parts dominate."""
    bt = wg_tokens(variant)
    groups = groups_wg(N, nw)
    tb = -(-m // bt)
    base = groups * tb
    if base > GRID_X_MAX:
        raise ValueError(f"m={m}, N={N}: {groups} column groups x {tb} row blocks exceed the grid's x limit")
    best = None
    for k in range(1, MAX_K_SPLIT + 1):
        if ks is not None and k != ks:
            continue
        c = _wg_split_cost(base, K, k, dev.sm_count)
        if c is None or (k > 1 and c[1] < MIN_K_SLICE and ks is None):
            continue
        if best is None or c[0] < best[0]:
            best = (c[0], k, c[1])
    if best is None:
        raise ValueError(f"ks={ks} does not split K={K} into slices of whole 64-wide steps")
    _, k, kz = best
    return Plan(mt=variant, tiles=bt // 16, grid=(base, 1, k), ks=k, kz=kz, kt=KSTEP,
                smem=wg_smem(bt, split), groups=groups, mblocks=tb)


def _wg_split_cost(n_blocks: int, K: int, k: int, sms: int):
    """``(cost, kz)`` of ``k`` K slices over ``n_blocks`` (column group, row block) tiles, or
    ``None`` where ``k`` does not cut K's 64-wide steps into ``k`` non-empty slices: whole waves
    x each block's steps plus its fixed part (first loads, epilogue; a split's partial tile and
    reduction)."""
    kz = -(-(-(-K // KSTEP)) // k) * KSTEP
    if -(-K // kz) != k:
        return None
    return -(-n_blocks * k // sms) * (kz // KSTEP + WG_BLOCK_STEPS + (WG_SPLIT_STEPS if k > 1 else 0)), kz


def groups_wg(N: int, nw: int) -> int:
    """Column groups of the wgmma kernel."""
    return -(-N // wg_cols(nw))


@functools.lru_cache(maxsize=256)
def wg_split_cap(K: int) -> int:
    """The most K slices a live-split launch offers its blocks (its grid z): slices of at
    least ``MIN_K_SLICE``, at most ``MAX_K_SPLIT``."""
    best = 1
    for k in range(2, MAX_K_SPLIT + 1):
        c = _wg_split_cost(1, K, k, 1)
        if c is not None and c[1] >= MIN_K_SLICE:
            best = k
    return best


def wg_live_split(n_live: int, K: int, cap: int, sms: int) -> int:
    """The K split gemm_wgmma.cu's ``live_split`` chooses on the device (GW_SMS = ``sms``) for
    ``n_live`` working blocks, at most ``cap`` (the grid's z): the cost rule of ``plan_wgmma``
    over slices of >= ``MIN_K_SLICE``, the least k on ties."""
    best = None
    for k in range(1, cap + 1):
        c = _wg_split_cost(n_live, K, k, sms)
        if c is None or (k > 1 and c[1] < MIN_K_SLICE):
            continue
        if best is None or c[0] < best[0]:
            best = (c[0], k)
    return 1 if best is None else best[1]


@functools.lru_cache(maxsize=1024)
def wg_live_slots(groups: int, tblocks: int, qg: int, K: int, cap: int, sms: int) -> int:
    """The most workspace slots (working blocks x their K split) any tile_live of up to
    ``tblocks`` row blocks makes a live-split launch use."""
    qg = min(qg, groups)
    best = 0
    for b in range(1, tblocks + 1):          # row blocks with a live tile
        for a in range(0, b + 1):            # ... of which hold a tile that needs every column
            n = qg * a + (groups - qg) * b
            if n:
                best = max(best, n * wg_live_split(n, K, cap, sms))
    return best


def wgmma_available(backend) -> bool:
    """Whether ``backend``'s device runs sm_90a code (wgmma): Hopper, or the emulator."""
    try:
        kernels.arch_options(backend, "sm_90a")
    except RuntimeError:
        return False
    return True


def wgmma_verified(backend) -> bool:
    """``wgmma_available`` and not disabled by the device's self-check (``dflash_cupy.selfcheck``,
    variant ``gemm.wgmma``: on a GPU run on first use and cached per device; it compares the
    wgmma kernel with the NumPy reference, never only with another GPU kernel). The operand
    layouts of gemm_wgmma.cu were read from the PTX ISA and checked only against the emulator,
    which implements that same reading; where the hardware disagrees, every default stays on
    gemm_stream.cu and one RuntimeWarning says so, rather than drafts silently going wrong."""
    if not wgmma_available(backend):
        return False
    from .. import selfcheck_verdict
    return selfcheck_verdict.variant_usable(backend, "gemm.wgmma")


ARGMAX_EPI = 3  # gemm_stream.cu GS_EPI 3: the lm_head GEMM with the greedy token fused
TOPK_EPI = 4    # GS_EPI 4: the lm_head GEMM with each column block's top-K fused (stream only)
EPILOGUES = {"none": 0, "residual": 1, "silu_mul": 2, "argmax": 3, "topk": 4}   # GS_EPI / GW_EPI / GEMM_EPI
SELECTS = ("argmax", "topk")   # the fused selections: per-block partials, no split K, no wgmma
TOPK_MAX = 64                  # GS_TOPK's bound


def topk_smem(mt: int, nw: int = 1) -> int:
    """Dynamic shared memory GS_EPI 4 needs at least (its key tile of 16 * mt rows, GS_TK_SMEM)."""
    return 16 * mt * (cols_per_block(nw) + 8) * 4


def fin_smem(mt: int) -> int:
    """Dynamic shared memory GS_FIN needs at least (the staged tile of 16 * mt rows, GS_FIN_SMEM)."""
    return 16 * mt * (cols_per_block(1) + kernels.constants("gemm_fin.cuh")["GEMM_FIN_PAD"]) * 4


@dataclass(frozen=True)
class GemmVariant:
    """What one stream GEMM is compiled for, once: its ``key()`` is the tuning key's
    variant part (``tuning.gemm_key``) and its ``*_defines`` the ``-D`` options of
    gemm_stream.cu and gemm_wgmma.cu (NVRTC checks compile the same). ``rope``:
    (head_dim, q_width, kv_width) of the qkv epilogue, or None. ``conv``: (taps, group_size) of
    DFlash 2's prepare convolution fused after the kernel_projection GEMM (gemm_stream.cu's
    GS_CONV; its mma.sync variants only; with ``norm`` it convolves the normed x), or None. ``finish``:
    (taps, group_size) of DFlash 2's finish convolution fused into a residual GEMM's epilogue (GS_FIN, gemm_fin.cuh), or None."""
    N: int
    K: int
    wkind: str                 # dtypes.CODE key: the weights' type
    epilogue: str = "none"     # EPILOGUES key
    split: int = 2             # x as hi + lo halves (2) or one (1)
    norm: bool = False
    logits: bool = True        # argmax / topk: the logits stored too
    x16: bool = False
    y16: bool = False
    live_split: bool = False
    skip_cols: int = 0
    rope: tuple | None = None
    top_k: int = 0             # topk: K (1..TOPK_MAX), else 0
    conv: tuple | None = None
    finish: tuple | None = None

    def __post_init__(self):
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue {self.epilogue!r}: expected one of {tuple(EPILOGUES)}")
        if self.x16 and self.split != 1:
            raise ValueError("x16=True (x stored in the weight type) needs split=1: a 16-bit x has no lo half")
        if self.y16 and self.epilogue in SELECTS:
            raise ValueError(f"y16=True does not apply to the fused {self.epilogue} (its logits stay f32)")
        if (self.epilogue == "topk") != (1 <= self.top_k <= TOPK_MAX) or (self.epilogue != "topk" and self.top_k):
            raise ValueError(f"top_k={self.top_k}: epilogue 'topk' needs 1 <= top_k <= {TOPK_MAX}, others 0")
        if self.epilogue == "topk" and self.norm:
            raise ValueError("the fused top-K does not apply a folded RMSNorm (norm=True)")
        if self.conv is not None:
            taps, group = self.conv
            if self.epilogue != "none" or self.x16 or self.y16:
                raise ValueError("conv (the fused prepare convolution) needs epilogue 'none' and an f32 x and y")
            if self.K % group or self.N != 2 * taps * (self.K // group):
                raise ValueError(f"conv=(taps={taps}, group={group}) needs N = 2 * taps * K / group "
                                 f"(K={self.K}, N={self.N})")
        if self.finish is not None:
            taps, group = self.finish
            if self.epilogue != "residual" or self.norm or self.y16 or self.conv is not None:
                raise ValueError("finish (the fused finish convolution) needs epilogue 'residual', an f32 y, "
                                 "no folded norm and no conv")
            if self.N % group:
                raise ValueError(f"finish=(taps={taps}, group={group}): group must divide N={self.N}")

    @property
    def nw(self) -> int:
        """Weight matrices per output column (silu_mul: gate and up)."""
        return 2 if self.epilogue == "silu_mul" else 1

    @property
    def argmax(self) -> bool:
        """A fused selection (argmax or top-K): per-block partials, one K slice, no wgmma."""
        return self.epilogue in SELECTS

    def key(self) -> str:
        return (f"N{self.N}|K{self.K}|{self.wkind}|{self.epilogue}|split{self.split}|norm{int(self.norm)}"
                f"|logits{int(self.logits)}|x16{int(self.x16)}|y16{int(self.y16)}"
                f"|rope{int(self.rope is not None)}|live{int(self.live_split)}|skip{self.skip_cols}"
                + (f"|topk{self.top_k}" if self.top_k else "")
                + ("" if self.conv is None else f"|conv{self.conv[0]}x{self.conv[1]}")
                + ("" if self.finish is None else f"|fin{self.finish[0]}x{self.finish[1]}"))

    def _common(self) -> dict:
        return dict(WTYPE=dtypes.CODE[self.wkind], EPI=EPILOGUES[self.epilogue], K=self.K, SPLIT=self.split,
                    **({"NORM": 1} if self.norm else {}), **({"X16": 1} if self.x16 else {}),
                    **({"Y16": 1} if self.y16 else {}))

    def stream_defines(self, mt: int) -> dict:
        """gemm_stream.cu's options for M tiles ``mt``."""
        return dict(**{"GS_" + k: v for k, v in self._common().items()}, GS_MT=mt, GS_NT=tiles_per_warp(self.nw, self.conv is not None),
                    GS_WARPS=WARPS, GS_DEPTH=DEPTH[mt],
                    **({"GS_LOGITS": int(self.logits)} if self.argmax else {}),
                    **({"GS_TOPK": self.top_k} if self.top_k else {}),
                    **({} if self.conv is None else {"GS_CONV": 1, "GS_CONV_TAPS": self.conv[0],
                                                     "GS_CONV_GROUP": self.conv[1]}),
                    **({} if self.finish is None else {"GS_FIN": 1, "GS_CONV_TAPS": self.finish[0],
                                                       "GS_CONV_GROUP": self.finish[1]}))

    def wgmma_defines(self, bt: int, sms: int = 0, skip_cols: int = 0, qkv: bool = False) -> dict:
        """gemm_wgmma.cu's options for row blocks of ``bt``; ``sms``: the live split's SM
        count (0: none); ``skip_cols``: columns skipped by tiles marked 2; ``qkv``: the
        qkv epilogue (GW_EPI 3) compiled in."""
        d = {"GW_" + k: v for k, v in self._common().items()}
        if qkv:
            hd, qw, kvw = self.rope
            d.update(GW_EPI=3, GW_HD=hd, GW_QW=qw, GW_KVW=kvw)
        d.update(GW_BT=bt, GW_DEPTH=WG_DEPTH[bt])
        if sms:
            d["GW_SMS"] = sms
        if skip_cols:
            d["GW_SKIP_COLS"] = skip_cols
        return d


class StreamKernels:
    """The compiled variants of one ``Gemm`` (``variant``; all buckets up to ``max_m``,
    compiled now: nothing compiles during graph capture) and their launches."""

    def __init__(self, backend, variant: GemmVariant, max_m: int, k_split: int | None = None,
                 wgmma: bool | None = None):
        v = self.variant = variant
        N, K, nw, split, rope = v.N, v.K, v.nw, v.split, v.rope
        self.x16, self.y16 = v.x16, v.y16
        self._argmax = v.argmax
        if self._argmax:  # the fused argmax / top-K reduces within a block: no split K
            k_split = 1
        self._tk = bool(v.top_k)   # GS_EPI 4: its key tile in the x staging's shared memory
        self._fin = v.finish is not None   # GS_FIN: the staged tile there too
        self.backend = backend
        self.N, self.K, self.nw, self.split, self.k_split = N, K, nw, split, k_split
        self.norm = v.norm
        self.dev = device_of(backend)
        self._choice: dict = {}        # m -> (variant, ks) set by use() (autotuning: dflash_cupy/tuning.py)
        self._captured = False         # a graph holds this object's workspace pointers: no regrowth
        top = self.top = bucket(max_m)
        self.buckets = tuple(b for b in MT_BUCKETS if b <= top)
        self._kernels = {}
        for mt in self.buckets:
            mod = kernels.load_module(backend, "gemm_stream.cu", **v.stream_defines(mt))
            self._kernels[mt] = mod.get_function("gemm_stream")
        # wgmma variants (gemm_wgmma.cu) where rows beyond one 64-row block are expected, the
        # device runs sm_90a and the epilogue is not the fused argmax; wgmma=True insists.
        self.max_m = int(max_m)
        if wgmma and (self._argmax or not wgmma_available(backend)):
            raise ValueError("wgmma=True needs an sm_90a device (or the emulator) and an epilogue other than argmax")
        if wgmma is None:   # the variants the default rule uses up to max_m
            auto = self.max_m >= WG_MIN_M and not self._argmax and wgmma_verified(backend)
            self.wg_variants = tuple(v for v in WG_VARIANTS if auto and (v == "wg64" or self.max_m > 64))
        else:
            self.wg_variants = WG_VARIANTS if wgmma else ()
        # Lane-batched launches (tile_live given) of the wgmma variants: with live_split the
        # kernel picks its K split from the live row blocks (up to split_cap slices, the
        # grid's z); tiles marked 2 skip the column groups wholly below skip_cols.
        self.live_split = bool(v.live_split) and bool(self.wg_variants)
        self.split_cap = wg_split_cap(K)
        self.skip_groups = int(v.skip_cols) // wg_cols(nw) if self.wg_variants else 0
        wg_opts = dict(sms=self.dev.sm_count if self.live_split else 0, skip_cols=self.skip_groups * wg_cols(nw))
        for name in self.wg_variants:
            mod = kernels.load_module(backend, "gemm_wgmma.cu", **v.wgmma_defines(wg_tokens(name), **wg_opts))
            self._kernels[name] = mod.get_function("gemm_wgmma")
        # The qkv epilogue (GW_EPI 3, ``rope=(head_dim, q_width, kv_width)``): the same wgmma
        # variants with rope.cu's qkv_norm_rope folded in, where every head lies in one column
        # group; a launch that plans a gemm_stream.cu variant cannot fold (``fuses_rope``).
        self.rope = None if rope is None else tuple(int(r) for r in rope)
        self._fused = {}
        if self.rope is not None and self.wg_variants and v.epilogue == "none" and not self.y16 \
                and qkv_fold_problem(N, nw, *self.rope) is None:
            for name in self.wg_variants:
                mod = kernels.load_module(backend, "gemm_wgmma.cu",
                                          **v.wgmma_defines(wg_tokens(name), qkv=True, **wg_opts))
                self._fused[name] = mod.get_function("gemm_wgmma")
        # the qkv epilogue's arguments when it is not compiled in: arrays of this object's own
        # (a shared one would look written to the stream-hazard checks)
        self._no_kv = backend.zeros((1,), np.float16) if self.wg_variants else None
        self._no_freq = backend.zeros((1,), np.float64) if self.wg_variants else None
        # Workspace for the largest split any m plans (m beyond max_m is accepted: more M
        # blocks): per block x (column group, M block) and slice a partial tile (rows of
        # its variant), then (GS_NORM) each slice's row sums of squares. plan() splits
        # several M blocks only while groups * mblocks * ks fits one wave, so no m past
        # m_hi (2 slices of its M blocks would not fit) splits, and the workspace stays
        # one wave's tiles at most. The wgmma default splits only while the groups alone
        # leave SMs idle (whole waves), so its row blocks up to max_m bound it too.
        # Counters: one per block x of a split launch.
        ws = 0
        groups = -(-N // cols_per_block(nw, v.conv is not None))
        nbx = groups
        wave = self.dev.sm_count * blocks_per_sm(top, 0)
        m_hi = self.m_hi = 16 * top * max(1, wave // (2 * groups))
        self.m_split_max = 0     # the largest m that splits K (mma.sync variants)
        sizes = self.plan_representatives(m_hi)
        if self.wg_variants:
            sizes += [WG_MIN_M, 64] + [max(65, min(self.max_m, 128 * tb)) for tb in range(1, -(-self.max_m // 128) + 1)]
        for m in sizes:
            p = self.default_plan(m)
            if p.ks > 1:
                nbx = max(nbx, p.grid[0])
                ws = max(ws, self._ws_len(p))
                if not isinstance(p.mt, str):
                    self.m_split_max = max(self.m_split_max, m)
        if self.live_split:   # every tile_live of up to max_m rows: its working blocks' slots
            for v in self.wg_variants:
                bt = wg_tokens(v)
                tb = -(-self.max_m // bt)
                nbx = max(nbx, groups_wg(N, nw) * tb)
                ws = max(ws, self._live_slots(bt, tb, self.split_cap) * bt * (nw * wg_cols(nw) + int(self.norm)))
        self._ws = backend.zeros((max(ws, 1),), np.float32)
        self._counters = backend.zeros((nbx,), np.int32)

    def plan_representatives(self, m_hi: int) -> list[int]:
        """Row counts whose default plans are every distinct default plan of ``m`` in
        ``[1, m_hi]``: all of them below ``WG_MIN_M`` (or where the wgmma rule does not
        apply), and above it one per (variant, row blocks), on which alone a wgmma plan
        depends (``plan_wgmma``). m_hi reaches thousands for narrow GEMMs: planning each
        row count cost ~50 ms per construction."""
        if not (self.wg_variants and self.k_split is None) or m_hi < WG_MIN_M:
            return list(range(1, m_hi + 1))
        sizes = list(range(1, WG_MIN_M)) + [min(m_hi, 64)]    # wg64, one row block: 49..64
        if m_hi > 64:
            bt = wg_tokens("wg128" if "wg128" in self.wg_variants else "wg64")
            sizes += [min(m_hi, tb * bt) for tb in range(-(-65 // bt), -(-m_hi // bt) + 1)]
        return sizes

    def _live_slots(self, bt: int, tblocks: int, cap: int) -> int:
        return wg_live_slots(groups_wg(self.N, self.nw), tblocks, self.skip_groups, self.K, cap,
                             self.dev.sm_count)

    def _ws_len(self, p: Plan) -> int:
        """f32 workspace a split launch ``p`` needs: per block x and slice a partial
        tile, then (GS_NORM) each slice's row sums of squares."""
        cols = wg_cols(self.nw) if isinstance(p.mt, str) else cols_per_block(self.nw, self.variant.conv is not None)
        return p.grid[0] * p.ks * p.rows * (self.nw * cols + int(self.norm))

    def _plan(self, m: int, mt, ks) -> Plan:
        if isinstance(mt, str):
            return plan_wgmma(self.N, self.K, m, self.nw, self.split, self.dev, variant=mt, ks=ks)
        p = plan(self.N, self.K, m, self.nw, self.split, self.dev, mt=mt, ks=ks,
                 raw=self.norm and not self.x16, conv=self.variant.conv is not None)
        if self._tk and topk_smem(mt, self.nw) > p.smem:
            return dataclasses.replace(p, smem=topk_smem(mt, self.nw))
        return dataclasses.replace(p, smem=fin_smem(mt)) if self._fin and fin_smem(mt) > p.smem else p

    def plan(self, m: int) -> Plan:
        c = self._choice.get(m)
        if c is not None:
            return self._plan(m, c[0], c[1])
        return self.default_plan(m)

    def default_plan(self, m: int) -> Plan:
        """What ``plan(m)`` returns without a tuned choice: the wgmma kernel from ``WG_MIN_M``
        rows where it is compiled (64-row blocks up to 64 rows, 128 beyond) and no
        ``k_split`` was forced, else the cost rule above."""
        if self.wg_variants and m >= WG_MIN_M and self.k_split is None:   # a forced k_split: gemm_stream.cu
            v = "wg64" if m <= 64 or "wg128" not in self.wg_variants else "wg128"
            return self._plan(m, v, self.k_split)
        return self._plan(m, min(bucket(m), self.top), self.k_split)

    def candidates(self, m: int) -> list:
        """Every launch configuration ``(mt, ks)`` this object can run ``m`` rows
        with: each compiled M variant (a smaller one runs more M blocks) and
        each K split the 64-wide K steps allow (slices of >= 64, not only the
        >= MIN_K_SLICE the cost rule keeps; with several M blocks, only splits
        whose grid fits one wave, as plan() requires). The cost rule's choice
        is among them. All of them compute the same numbers (the K slices are
        summed in a fixed order, but where they split differs, so results may
        differ from the default's in the last bits)."""
        m = int(m)
        out = []
        splits = (1,) if self.k_split is not None or self._argmax else tuple(range(1, MAX_K_SPLIT + 1))
        for mt in self.buckets + self.wg_variants:
            for ks in splits:
                try:
                    p = self._plan(m, mt, ks)
                except ValueError:   # a split the K steps do not allow
                    continue
                if isinstance(mt, str) and ks > 1 and p.kz < MIN_K_SLICE:
                    continue   # wgmma: one block per SM already; thinner slices only add partials
                if p.ks == ks and (mt, ks) not in out:
                    out.append((mt, ks))
        d = self.default_plan(m)
        if (d.mt, d.ks) not in out:
            out.append((d.mt, d.ks))
        return out

    def use(self, m: int, mt: int, ks: int) -> None:
        """Run ``m`` rows with configuration ``(mt, ks)`` (one of
        ``candidates(m)``) from now on, growing the split-K workspace if it
        needs more. Before any graph captures this GEMM only: a captured graph
        holds the workspace's address."""
        mt = mt if isinstance(mt, str) else int(mt)
        if (mt, int(ks)) not in self.candidates(m):
            raise ValueError(f"(mt={mt!r}, ks={ks}) is not a launch configuration for m={m}: "
                             f"candidates {self.candidates(m)}")
        if self._captured:
            raise RuntimeError("use() after a graph captured this GEMM: tune before the first capture")
        p = self._plan(m, mt, int(ks))
        if p.ks > 1:
            need = self._ws_len(p)
            if need > self._ws.size:
                self._ws = self.backend.zeros((need,), np.float32)
            if p.grid[0] > self._counters.size:
                self._counters = self.backend.zeros((p.grid[0],), np.int32)
        self._choice[int(m)] = (mt, int(ks))

    def fuses_rope(self, m: int) -> bool:
        """Whether a launch over ``m`` rows runs the qkv epilogue (compiled, and the plan for
        ``m``, tuned or not, is a wgmma variant)."""
        return isinstance(self.plan(m).mt, str) and self.plan(m).mt in self._fused

    def fuses_conv(self, m: int) -> bool:
        """Whether a launch over ``m`` rows runs the prepare convolution (``conv`` compiled, the
        plan for ``m`` an mma.sync variant, every group's columns inside one column block, and
        its tail within ``CONV_FUSE_MAX_TRIPS``)."""
        if self.variant.conv is None or isinstance(self.plan(m).mt, str):
            return False
        taps, group = self.variant.conv
        cols, p = cols_per_block(self.nw, True), self.plan(m)
        if cols % (2 * taps) and self.N > cols:
            return False
        return conv_tail_trips(min(m, p.rows), self.N, taps, group, cols, p.rows) <= CONV_FUSE_MAX_TRIPS

    def fin_problem(self, m: int, lane_rows: int) -> str | None:
        """Why a call over ``m`` rows in lane blocks of ``lane_rows`` cannot take ``finish=``, or
        None: ``finish`` compiled, the plan for ``m`` an mma.sync variant, and no lane block
        straddling two of its row blocks (the taps read the block's own staged tile)."""
        if self.variant.finish is None:
            return "this GEMM was built without finish"
        p = self.plan(m)
        if isinstance(p.mt, str):
            return f"the launch for m={m} is a wgmma variant ({p.mt})"
        if p.mblocks > 1 and p.rows % lane_rows:
            return f"lane blocks of {lane_rows} rows straddle the launch's row blocks of {p.rows}"
        return None

    def launch_config(self, m: int):
        """``(grid, block, shared_mem)``; grid ``(groups * mblocks, 1, ks)``."""
        p = self.plan(m)
        return p.grid, (p.threads, 1, 1), p.smem

    def __call__(self, x, w, y, r, m: int, stream=None, pad_rows=None, norm=None, partials=None,
                 tile_live=None, rope=None, x2=None, conv=None, finish=None):
        """``pad_rows=(lo, hi)``: rows ``[lo[0], hi)`` are zero rows, ``lo`` a
        device int32 array read at run time (``None``: no padding rows).
        ``tile_live``: device int32, entry ``t`` for rows ``[16t, 16t + 16)``,
        read at run time; 0 = the tile is neither computed nor stored.
        ``norm=(ln, eps, norm_lo)`` (a ``norm=True`` kernel): rows ``>= norm_lo``
        of x are RMS-normalised with scale ``ln`` [K] f32 inside the GEMM.
        ``partials`` (the argmax / topk epilogue): u32 ``[>= m, blocks, 2]`` /
        ``[>= m, blocks, top_k, 2]`` written in place of the split-K workspace.
        ``rope=(q_norm, k_norm, inv_freq, pos, rows, k_cache, v_cache, kv_rows, eps, scale)``
        (``fuses_rope(m)`` only): the qkv epilogue, y the Q output.
        ``norm`` may carry a fourth element ``ln_lo`` [K] f32: rows ``< norm_lo`` are then
        RMS-normalised with it (else used raw).
        ``x2=(a, row_split)``: rows ``>= row_split`` are read from ``a`` (its row 0 first),
        rows below from x (checked by ``ops.gemm.Gemm``).
        ``conv=(base, out, lane_rows)`` (``fuses_conv(m)`` only): the prepare convolution of x
        (with ``norm``: of the normed x) into ``out`` (gemm_conv.cuh; checked by ``ops.gemm.Gemm``);
        ``lane_rows < 0``: that x itself into ``out`` (any mma.sync launch of a GS_CONV variant).
        ``finish=(base, d, lane_rows)`` (``fin_problem`` None only): y = r + the finish
        convolution of the product (gemm_fin.cuh; checked by ``ops.gemm.Gemm``)."""
        p = self.plan(m)
        if finish is not None and self.fin_problem(m, int(finish[2])) is not None:
            raise ValueError(f"m={m}: the fused finish cannot run: {self.fin_problem(m, int(finish[2]))}")
        if conv is not None and conv[2] < 0 and (self.variant.conv is None or isinstance(p.mt, str)):
            raise ValueError(f"m={m}: the normed rows' store needs a gemm_stream.cu launch with GS_CONV "
                             f"(plan {p.mt!r})")
        if conv is not None and conv[2] > 0 and not self.fuses_conv(m):
            raise ValueError(f"m={m}: the fused convolution needs a gemm_stream.cu launch with it compiled "
                             f"(plan {p.mt!r}, conv {self.variant.conv})")
        if rope is not None and not self.fuses_rope(m):
            raise ValueError(f"m={m}: the qkv epilogue needs a wgmma launch with it compiled (plan {p.mt!r})")
        if tile_live is not None and self.live_split and isinstance(p.mt, str):
            # the kernel splits K per launch, up to the tuned split or split_cap
            c = self._choice.get(m)
            cap = c[1] if c is not None else self.split_cap
            bt = wg_tokens(p.mt)
            tb = -(-m // bt)
            if tb > WG_THREADS:
                raise ValueError(f"m={m}: a live-split launch scans at most {WG_THREADS} row blocks of {bt}")
            slots = self._live_slots(bt, tb, cap)
            need = slots * bt * (self.nw * wg_cols(self.nw) + int(self.norm))
            if need > self._ws.size or p.grid[0] > self._counters.size:
                raise ValueError(f"m={m}: a live-split launch of {p.mt} needs {need} workspace floats, "
                                 f"this GEMM holds {self._ws.size} (sized for max_m={self.max_m})")
            # the kernel finds the working tiles and their split and strides over them: one
            # block per SM (their registers) or fewer; kt carries the most K slices
            p = dataclasses.replace(p, grid=(min(slots, self.dev.sm_count), 1, 1), kt=cap)
        if self.backend.is_capturing():
            self._captured = True
        lo, hi = (self._counters, 0) if pad_rows is None else pad_rows
        ln, eps, norm_lo = (x, 0.0, m) if norm is None else norm[:3]
        ln_lo = norm[3] if norm is not None and len(norm) > 3 and norm[3] is not None else None
        xb, row_split = (x, m) if x2 is None else x2
        # the kernel's arguments by name (gemm_wgmma: its one struct, GemmWgmmaParams)
        params = dict(x=x, w=w, y=y, r=r, M=np.int32(m), N=np.int32(self.N), kz=np.int32(p.kz),
                      kt=np.int32(p.kt), ws=self._ws if partials is None else partials,
                      counters=self._counters, pad_lo=lo, pad_hi=np.int32(hi),
                      ln=ln, eps=np.float32(eps), norm_lo=np.int32(norm_lo),
                      tile_live=self._counters if tile_live is None else tile_live,
                      use_live=np.int32(tile_live is not None),
                      x2=xb, row_split=np.int32(row_split), ln_lo=ln if ln_lo is None else ln_lo,
                      use_ln_lo=np.int32(ln_lo is not None))
        if not isinstance(p.mt, str):   # gemm_stream.cu's GS_CONV arguments (lane_rows 0: off; unused without it)
            params.update(conv_base=self._ws if conv is None else conv[0], conv_y=self._ws if conv is None else conv[1],
                          conv_lane_rows=np.int32(0 if conv is None else conv[2]),
                          fin_base=self._ws if finish is None else finish[0],
                          fin_d=self._ws if finish is None else finish[1],
                          fin_lane_rows=np.int32(0 if finish is None else finish[2]))
        kernel = self._kernels[p.mt]
        if isinstance(p.mt, str):   # the wgmma kernel's qkv-epilogue fields
            if rope is None:
                rope = (self._ws, self._ws, self._no_freq, self._counters, self._counters, self._no_kv,
                        self._no_kv, 0, 0.0, 1.0)
            else:
                kernel = self._fused[p.mt]
                p = dataclasses.replace(p, smem=max(p.smem, wg_qkv_smem(wg_tokens(p.mt))))
            qn, kn, freq, pos, rows, kc, vc, kv_rows, reps, rscale = rope
            params.update(q_norm=qn, k_norm=kn, inv_freq=freq, pos=pos, rows=rows, k_cache=kc, v_cache=vc,
                          kv_rows=np.int32(kv_rows), rope_eps=np.float32(reps), rope_scale=np.float32(rscale))
        kernel(p.grid, (p.threads, 1, 1), launch_args(kernel, params), shared_mem=p.smem, stream=stream)


def launch_args(kernel, params: dict) -> tuple:
    """A kernel's arguments from ``params`` (name -> value): its one struct argument
    (gemm_wgmma's GemmWgmmaParams) or its parameters by name (gemm_stream's; kept
    positional: a struct parameter grew ptxas's registers there, 238 -> 244 at MT=4)."""
    sig = kernel.sig.params
    if len(sig) == 1 and sig[0].is_struct:
        return (params,)
    return tuple(params[p.name] for p in sig)
