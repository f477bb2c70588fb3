"""Facts of the compiled code, without a GPU: ptxas resources at sm_90 (NVRTC),
resident blocks per SM, and the waves of a launch's grid.

``ptxas_info(file, defines)`` compiles ``cuda_src/<file>`` with NVRTC exactly
as the CUDA backend does (same flags, ``--ptxas-options=-v``) and returns the
registers, static shared memory, stack and spill bytes of each kernel. Results
are cached in memory and on disk (``~/.cache/dflash_cupy/ptxas.json``, keyed
by a hash of the source tree, the options and the architecture), so a second
run of the cost model compiles nothing.

(The NVRTC reader duplicates a little of ``tests/test_nvrtc.py``; another
branch is moving that into ``dflash_cupy/backends/``: this one should then
call it.)
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from dflash_cupy import kernels

ARCH = "sm_90"
_CACHE_FILE = Path(os.environ.get("DFLASH_CUPY_PTXAS_CACHE",
                                  Path.home() / ".cache" / "dflash_cupy" / "ptxas.json"))
_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_mem: dict = {}


def parse_ptxas(log: str) -> dict:
    """Per entry function: registers, smem (static bytes), stack, spill_stores, spill_loads."""
    out: dict = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = out.setdefault(m.group(1), {"registers": 0, "smem": 0, "stack": 0,
                                              "spill_stores": 0, "spill_loads": 0})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame", line)
        if m:
            cur["stack"] = max(cur["stack"], int(m.group(1)))
        m = _SPILL_RE.search(line)
        if m:
            cur["spill_stores"] += int(m.group(1))
            cur["spill_loads"] += int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    return out


def _tree_hash() -> str:
    h = hashlib.sha256()
    for p in sorted(kernels.CUDA_SRC.glob("*.cu*")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _load_disk() -> dict:
    try:
        return json.loads(_CACHE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def _save_disk(d: dict) -> None:
    try:
        _CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
        tmp = _CACHE_FILE.with_name(_CACHE_FILE.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(d, indent=0, sort_keys=True))
        os.replace(tmp, _CACHE_FILE)
    except OSError:
        pass  # a cache, nothing more


def ptxas_info(file: str, defines: dict, arch: str = ARCH) -> dict:
    """``{kernel: {registers, smem, stack, spill_stores, spill_loads}}`` of
    ``cuda_src/<file>`` compiled with ``defines`` for ``arch``."""
    opts = kernels.compile_options(**defines)
    key = f"{_tree_hash()}|{arch}|{file}|{' '.join(opts)}"
    if key in _mem:
        return _mem[key]
    disk = _load_disk()
    if key in disk:
        _mem[key] = disk[key]
        return disk[key]
    from cupy_backends.cuda.libs import nvrtc
    from dflash_cupy.backends.cuda import NVRTC_FLAGS, cuda_include_dirs, with_line_directive
    path = kernels.source_path(file)
    flags = [f"--gpu-architecture={arch}", *NVRTC_FLAGS, "--device-as-default-execution-space",
             "--ptxas-options=-v", *opts, *("-I" + d for d in cuda_include_dirs())]
    prog = nvrtc.createProgram(with_line_directive(path.read_text(), str(path)), str(path), [], [])
    try:
        try:
            nvrtc.compileProgram(prog, flags)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"{file} {' '.join(opts)}: NVRTC error {e}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from None
        info = parse_ptxas(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)
    _mem[key] = info
    disk = _load_disk()
    disk[key] = info
    _save_disk(disk)
    return info


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
                     attn_gate: bool = False, attn_splits: int = 1, both_masks: bool = False,
                     lm_head: bool = False, fold_norms: bool = True) -> int:
    """Nodes of one captured step (``DraftKvCache._issue_step``), counted by
    hand from the code: descriptor copy, plan_step (reset_slots_if,
    plan_append, the feature gather and the masks in one launch), [aux
    rmsnorm], fc GEMM, rmsnorm; the noise copy; per layer [rmsnorm: unless
    folded into the qkv GEMM, or for the gate GEMM's input], qkv GEMM,
    qkv_norm_rope, [gate GEMM], attention split (+ combine if split), o GEMM,
    [rmsnorm unless folded into gate_up], gate_up GEMM, down GEMM; final
    rmsnorm, [with an LM head: the sampling knobs and RNG copies, the LM head
    GEMM, the sampler]. ``fold_norms``: the stream GEMMs normalise their
    input rows (16-bit weights, the default). ``context_kv_norm`` changes what
    the per-layer rmsnorm covers, not the count; ``both_masks`` neither
    (plan_step writes both)."""
    pre = 1 + 1 + int(aux_norms) + 2 + 1
    norms = (int(attn_gate), 0) if fold_norms else (1, 1)
    per_layer = norms[0] + 2 + int(attn_gate) + 1 + int(attn_splits > 1) + 1 + norms[1] + 2
    return pre + n_layer * per_layer + 1 + 4 * int(lm_head)
