"""Facts of the compiled code, without a GPU: ptxas resources at sm_90 (NVRTC),
resident blocks per SM, and the waves of a launch's grid.

``ptxas_info(file, defines)`` compiles ``cuda_src/<file>`` with NVRTC exactly
as the CUDA backend does (same flags, ``--ptxas-options=-v``) and returns the
registers, static shared memory, stack and spill bytes of each kernel, read
through ``dflash_cupy.backends.nvrtc_info`` (the build the emulator's launch
checks use, cached on disk by source, headers, options, architecture and NVRTC
version), so a second run of the cost model compiles nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dflash_cupy import kernels

ARCH = "sm_90"


def ptxas_info(file: str, defines: dict, arch: str | None = None) -> dict:
    """``{kernel: {registers, smem, stack, spill_stores, spill_loads}}`` of
    ``cuda_src/<file>`` compiled with ``defines`` for ``arch`` (default: the target the
    file declares, ``// nvrtc-arch: sm_90a`` for the wgmma kernels, else ``ARCH``): the
    backends' own NVRTC build (``nvrtc_info.cached_compile_info``, cached on disk)."""
    from dflash_cupy.backends import nvrtc_info
    path = kernels.source_path(file)
    if arch is None:
        arch = nvrtc_info.declared_arch(path.read_text()) or ARCH
    info = nvrtc_info.cached_compile_info(path.read_text(), str(path),
                                          kernels.compile_options(**defines), arch)
    return {name: {"registers": k.registers, "smem": k.static_smem, "stack": k.stack,
                   "spill_stores": k.spill_stores, "spill_loads": k.spill_loads}
            for name, k in info.kernels.items()}


# ---------------------------------------------------------------------------- occupancy
@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    limited_by: str           # "registers" | "shared" | "warps" | "blocks"
    warps_per_sm: int
    smem_per_block: int       # bytes allocated per block (static + dynamic + reserved, rounded)


def occupancy(gpu, threads: int, registers: int, smem_static: int, smem_dynamic: int) -> Occupancy:
    """Resident blocks per SM from the kernel's resources (the Occupancy
    Calculator's arithmetic: registers per warp rounded up to the allocation
    unit, shared memory per block incl. the 1 KB the runtime reserves, rounded
    up to 128 B, the warp and block limits)."""
    if threads < 1 or threads > 1024:
        raise ValueError(f"threads must be in [1, 1024], got {threads}")
    if registers < 0 or registers > gpu.max_regs_per_thread:
        raise ValueError(f"registers must be in [0, {gpu.max_regs_per_thread}], got {registers}")
    warps = -(-threads // 32)
    limits = {"warps": gpu.max_warps_per_sm // warps, "blocks": gpu.max_blocks_per_sm}
    if registers:
        per_warp = -(-registers * 32 // gpu.reg_alloc_unit) * gpu.reg_alloc_unit
        limits["registers"] = (gpu.regs_per_sm // per_warp) // warps
    smem = smem_static + smem_dynamic
    alloc = -(-(smem + gpu.smem_reserved_per_block) // gpu.smem_alloc_unit) * gpu.smem_alloc_unit
    if smem > gpu.smem_per_block_max:
        raise ValueError(f"{smem} bytes of shared memory exceed the {gpu.smem_per_block_max} per block")
    limits["shared"] = gpu.smem_per_sm // alloc
    # ties name the hardware resource, not the scheduler's block cap
    order = ("registers", "shared", "warps", "blocks")
    by = min(order, key=lambda k: (limits.get(k, 1 << 30), order.index(k)))
    return Occupancy(limits[by], by, limits[by] * warps, alloc)


@dataclass(frozen=True)
class Waves:
    slots: int          # resident blocks on the whole GPU
    waves: float        # blocks / slots
    full_waves: int
    tail_blocks: int    # blocks of the last, partial wave (0: none)
    efficiency: float   # blocks / (ceil(waves) * slots): the share of SM-slots the grid uses


def waves(n_blocks: int, blocks_per_sm: int, sm_count: int) -> Waves:
    if n_blocks < 1 or blocks_per_sm < 1 or sm_count < 1:
        raise ValueError(f"n_blocks, blocks_per_sm, sm_count must be >= 1, got "
                         f"{n_blocks}, {blocks_per_sm}, {sm_count}")
    slots = blocks_per_sm * sm_count
    full, tail = divmod(n_blocks, slots)
    return Waves(slots, n_blocks / slots, full, tail, n_blocks / (math.ceil(n_blocks / slots) * slots))


def graph_node_count(n_layer: int, *, aux_norms: bool = False, context_kv_norm: bool = False,
                     attn_gate: bool = False, attn_combine: bool = False, both_masks: bool = False,
                     lm_head: bool = False, fold_norms: bool = True, qkv_fold: bool = True,
                     x_split: bool = True) -> int:
    """Nodes of one captured step (``DraftKvCache._issue_step``), counted by
    hand from the code: descriptor copy, plan_step (reset_slots_if,
    plan_append, the feature gather and the masks in one launch), [aux
    rmsnorm], fc GEMM, [hidden rmsnorm: unless folded into every layer's qkv GEMM
    (``ln_lo``: ``fold_norms`` and ``x_split`` without ``context_kv_norm``)] (no noise copy: the
    first layer reads noise_embed in place, from the qkv GEMM's second input
    pointer); per layer [rmsnorm: unless
    folded into the qkv GEMM, or for the gate GEMM's input], qkv GEMM,
    [qkv_norm_rope: unless folded into the qkv GEMM's epilogue, ``qkv_fold``:
    the wgmma launch, every head inside one column group], [gate GEMM], attention [+ ring_attn_combine:
    ``attn_combine``, split with merge "launch"; one launch with one split or
    merge "fold"], o GEMM,
    [rmsnorm unless folded into gate_up], gate_up GEMM, down GEMM; final
    rmsnorm, [with an LM head: the LM head GEMM, the sampler (the sampling
    knobs and RNG state travel in the descriptor's copy)]. ``fold_norms``: the stream GEMMs normalise their
    input rows (16-bit weights, the default). ``context_kv_norm`` keeps the
    hidden rmsnorm (the context rows are normalised twice) and, without
    ``fold_norms``, normalises the first layer's context and noise rows in two
    launches (the noise rows are noise_embed, read in place); ``both_masks``
    changes nothing (plan_step writes both)."""
    hidden = int(not (fold_norms and x_split and not context_kv_norm))
    pre = 1 + 1 + int(aux_norms) + 1 + hidden + int(context_kv_norm and not fold_norms)
    norms = (int(attn_gate), 0) if fold_norms else (1, 1)
    per_layer = norms[0] + 1 + int(not qkv_fold) + int(attn_gate) + 1 + int(attn_combine) + 1 + norms[1] + 2
    return pre + n_layer * per_layer + 1 + 2 * int(lm_head)
