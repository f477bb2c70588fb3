"""Figures of the stream GEMM's launch plans (``dflash_cupy/ops/gemm_stream.plan``): bytes in
flight per SM, shared-memory bytes read per weight byte, L2 re-reads of x, split-K partials,
wave efficiency, HBM passes over the weights, and the x tile's bank conflicts, computed from
the plan and the kernel's layout (``docs/decisions/gemm.md`` derives each). Analysis, not
product code: tests pin the figures at the drafter shapes.

    python -m profiling.gemm_figures

prints them at the qwen3-8b-like and hidden-5120 shapes.
"""
from __future__ import annotations

from dflash_cupy.ops import gemm_stream as gs

HBM_BPS = 4.8e12          # H200 HBM3e, for the tensor-core pace figure only


def weight_passes(groups: int, mblocks: int, concurrent: int, m_fastest: bool = True) -> float:
    """HBM reads of each weight byte (mean over column groups), modelling that the
    blocks of one wave (``concurrent`` = SMs x resident blocks, in launch order)
    share their weight reads through L2 and nothing survives to a later wave.
    ``m_fastest``: the kernel's order (the M blocks of a column group adjacent);
    False: column group fastest, M block in grid y (what that order would cost)."""
    total = 0
    for cg in range(groups):
        pos = [cg * mblocks + mb if m_fastest else mb * groups + cg for mb in range(mblocks)]
        total += len({p // concurrent for p in pos})
    return total / groups


def stream_figures(N: int, K: int, m: int, nw: int = 1, split: int = 2, dev: gs.Device = gs.H200,
                   raw: bool = False) -> dict:
    """The figures of one call as ``gs.plan`` launches it (``docs/decisions/gemm.md`` derives them)."""
    p = gs.plan(N, K, m, nw, split, dev, raw=raw)
    blocks = p.grid[0] * p.grid[1] * p.grid[2]
    spread, busiest = gs.stream_terms(blocks, gs.cols_per_block(nw) * nw * p.kz * 2, p.mt, dev)
    resident = gs.blocks_per_sm(p.mt, p.smem)
    concurrent = resident * dev.sm_count
    per_sm = min(resident, -(-blocks // dev.sm_count))
    warp_inflight = (gs.DEPTH[p.mt] - 1) * gs.WTILES * 8 * 128  # bytes, while a warp computes one step
    weight_bytes = N * nw * K * 2
    return {
        "plan": p,
        "blocks": blocks,
        "blocks_per_sm_resident": resident,
        "registers": gs.PTXAS_REGS[p.mt],
        "inflight_per_sm": per_sm * gs.WARPS * warp_inflight,
        "smem_read_per_weight_byte": p.tiles * split * 4 * 512 / (gs.WTILES * 1024),
        "smem_conflict_ways": max(xtile_conflict_ways(p.kt)),
        "x_l2_per_weight_byte": p.groups * m * K * 4 / weight_bytes,
        # HBM reads of each weight byte over the M blocks (1 = once), and with column groups fastest
        "weight_hbm_passes": weight_passes(p.groups, p.mblocks, concurrent),
        "weight_hbm_passes_cg_fastest": weight_passes(p.groups, p.mblocks, concurrent, m_fastest=False),
        "partial_per_weight_byte": (2 * p.ks * min(m, 16 * p.mt) * N * nw * 4 / weight_bytes) if p.ks > 1 else 0.0,
        "wave_efficiency": blocks / (-(-blocks // dev.sm_count) * dev.sm_count),
        # the busiest SM's stream by its bytes in flight over the launch's bytes at the SMs'
        # share of HBM (plan's rule): <= 1 streams at the HBM rate
        "inflight_bound_ratio": busiest / spread,
        # tensor-core rate the MMAs need to keep pace with 90% of H200 HBM (4.8 TB/s):
        # 16 rows per live tile, x GS_SPLIT for hi + lo, 2 flops per multiply-add
        "mma_tflops_at_90pct_hbm": 2 * 16 * p.tiles * split / 2 * 0.9 * HBM_BPS / 1e12,
    }


def xtile_conflict_ways(kt: int, pad: int = gs.XPAD) -> list[int]:
    """Shared-memory wavefronts per quarter warp of each 16-byte x-fragment load
    of the kernel (row stride kt + pad halves; lane (g, t) reads row g (+8) at
    byte 16t (+64)): 1 = conflict-free. Computed from the address formula,
    bank by bank (32 banks of 4 bytes)."""
    stride = 2 * (kt + pad)
    ways = []
    for rowoff in (0, 8):
        for half in (0, 64):
            for phase in range(4):  # a 16-byte access is served a quarter warp at a time
                banks: dict[int, set] = {}
                for lane in range(8 * phase, 8 * phase + 8):
                    g, t = lane >> 2, lane & 3
                    addr = (g + rowoff) * stride + 16 * t + half
                    for b in range(4):
                        word = addr // 4 + b
                        banks.setdefault(word % 32, set()).add(word)
                ways.append(max(len(v) for v in banks.values()))
    return ways


# (name, N, K, weight matrices per output column) of a qwen3-8b-like and a hidden-5120 drafter layer
FIGURE_SHAPES = [("8b qkv", 6144, 4096, 1), ("8b o", 4096, 4096, 1), ("8b gate_up", 12288, 4096, 2),
                 ("8b down", 4096, 12288, 1), ("5120 qkv", 7168, 5120, 1), ("5120 o", 5120, 5120, 1),
                 ("5120 gate_up", 17408, 5120, 2), ("5120 down", 5120, 17408, 1),
                 ("5120 gate_up", 25600, 5120, 2), ("5120 down", 5120, 25600, 1)]


def figures_table(ms=(16, 32, 64), dev: gs.Device = gs.H200) -> str:
    """The figures of ``stream_figures``, one line per shape and m."""
    out = [f"device: {dev.sm_count} SMs, {dev.smem_optin} B smem opt-in",
           "shape          m | grid         kz    kt   smem R inflight smemB/wB xL2/wB part/wB wave"]
    for m in ms:
        for name, N, K, nw in FIGURE_SHAPES:
            f = stream_figures(N, K, m, nw, dev=dev)
            p = f["plan"]
            out.append(f"{name:13s} {m:3d} | {str(p.grid):12s} {p.kz:5d} {p.kt:5d} {p.smem // 1024:4d}K "
                       f"{f['blocks_per_sm_resident']} {f['inflight_per_sm'] // 1024:5d}K "
                       f"{f['smem_read_per_weight_byte']:8.2f} {f['x_l2_per_weight_byte']:6.3f} "
                       f"{f['partial_per_weight_byte']:7.3f} {f['wave_efficiency']:4.2f}")
    return "\n".join(out)


if __name__ == "__main__":
    print(figures_table())
