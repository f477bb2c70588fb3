"""The driver's launch checks (sm_90), applied by both backends: ``launch_config``
before every launch, ``KernelLimits`` per kernel on the emulator
(``emu/backend.py``), so a launch the GPU would refuse does not run there. Limits are those
of an sm_90 device (H100/H200); per-kernel numbers (registers, static shared
memory, ``__launch_bounds__``) come from the NVRTC + ptxas build of the same
source and options (``nvrtc_info``). The rules, in the order checked:

1. block: each of x, y <= 1024, z <= 64, x*y*z <= 1024; grid: x <= 2^31-1,
   y, z <= 65535  -> ``invalid configuration argument``.
2. threads per block <= the kernel's ``__launch_bounds__`` (PTX ``.maxntid``)
   -> ``too many resources requested for launch``.
3. registers: the register file (65536 32-bit registers per SM, 64K per block)
   is handed out per warp, in units of 256 registers, i.e. a warp of a kernel
   using R registers per thread holds ceil(R*32/256)*256; a block's warps are
   spread over the SM's 4 sub-partitions and the hardware check counts the
   warps rounded up to a multiple of 4. The launch fits iff
   ``ceil(R*32/256)*256 * ceil(warps/4)*4 <= 65536``
   -> ``too many resources requested for launch``. (The "hardware check" of
   ``cudaOccMaxBlocksPerSMRegsLimit`` in CUDA's ``cuda_occupancy.h``; e.g.
   130 registers x 480 threads = 62400 naively fits, but is charged
   136*32 x 16 warps = 69632 and refused.)
4. shared memory: static <= 48 KiB (ptxas already refuses more at compile
   time); dynamic <= the kernel's ``MaxDynamicSharedMemorySize`` attribute,
   which is 48 KiB until raised by the opt-in call (``cudaFuncSetAttribute``;
   the CuPy backend sets ``RawKernel.max_dynamic_shared_size_bytes`` whenever a
   launch asks for more than the current value, and ``KernelLimits`` does the
   same, so the same launcher code passes on both); the opt-in itself fails
   when static + requested dynamic > 227 KiB -> ``invalid argument``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..device_props import DEFAULT_SMEM, H200
from .base import KernelLaunchError, dim3
from .nvrtc_info import KernelResources

MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK_DIM = (1024, 1024, 64)
MAX_GRID_DIM = (2**31 - 1, 65535, 65535)
REGS_PER_BLOCK = 65536
REG_ALLOC_UNIT = 256           # registers, per warp
WARP_ALLOC_GRANULARITY = 4     # sub-partitions per SM
STATIC_SMEM_MAX = 48 * 1024
DEFAULT_DYNAMIC_SMEM = DEFAULT_SMEM
SMEM_OPTIN_MAX = H200.smem_optin  # 227 KiB: cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90

INVALID_CONFIG = "invalid configuration argument (cudaErrorInvalidConfiguration)"
OUT_OF_RESOURCES = "too many resources requested for launch (cudaErrorLaunchOutOfResources)"
INVALID_VALUE = "invalid argument (cudaErrorInvalidValue)"


class LaunchResourceError(KernelLaunchError, ValueError):
    """A launch the CUDA driver would refuse. Also a ``ValueError``: the argument values
    (grid, block, shared_mem) are what is wrong."""


def registers_per_block(registers: int, threads: int) -> int:
    """Registers the hardware check charges a block with (see rule 3)."""
    per_warp = -(-registers * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    warps = -(-threads // 32)
    return per_warp * (-(-warps // WARP_ALLOC_GRANULARITY) * WARP_ALLOC_GRANULARITY)


def max_threads_for_registers(registers: int) -> int:
    """The largest block (a multiple of 32 threads) whose registers fit, per rule 3."""
    best = 0
    for t in range(32, MAX_THREADS_PER_BLOCK + 1, 32):
        if registers_per_block(registers, t) <= REGS_PER_BLOCK:
            best = t
    return best


def _fail(name: str, what: str, g, b, shared_mem: int, why: str):
    raise LaunchResourceError(f"kernel {name}: launch grid={g} block={b} shared_mem={shared_mem} "
                              f"failed: {what}: {why}")


def check_configuration(name: str, g: tuple[int, int, int], b: tuple[int, int, int],
                        shared_mem: int) -> None:
    """Rule 1 and a non-negative dynamic shared memory size: the checks that need
    nothing of the kernel, made by both backends before a launch."""
    for axis, (v, cap) in enumerate(zip(b, MAX_BLOCK_DIM)):
        if v > cap:
            _fail(name, INVALID_CONFIG, g, b, shared_mem, f"block.{'xyz'[axis]}={v} > {cap}")
    nthreads = b[0] * b[1] * b[2]
    if nthreads > MAX_THREADS_PER_BLOCK:
        _fail(name, INVALID_CONFIG, g, b, shared_mem,
              f"{nthreads} threads per block > {MAX_THREADS_PER_BLOCK} (max 1024)")
    for axis, (v, cap) in enumerate(zip(g, MAX_GRID_DIM)):
        if v > cap:
            _fail(name, INVALID_CONFIG, g, b, shared_mem, f"grid.{'xyz'[axis]}={v} > {cap}")
    if int(shared_mem) < 0:
        _fail(name, INVALID_VALUE, g, b, shared_mem, "negative dynamic shared memory")


def launch_config(name: str, grid, block, shared_mem) -> tuple[tuple[int, int, int],
                                                               tuple[int, int, int], int]:
    """``(grid, block, shared_mem)`` of a launch as the backends pass them on (three
    positive ints each, an int), after ``check_configuration``. Both backends' kernels
    call this first, so a shape one refuses the other refuses with the same message."""
    g, b = dim3(grid, f"kernel {name}: grid"), dim3(block, f"kernel {name}: block")
    shared_mem = int(shared_mem)
    check_configuration(name, g, b, shared_mem)
    return g, b, shared_mem


@dataclass
class KernelLimits:
    """Launch checks for one kernel; holds its dynamic shared memory attribute."""
    name: str
    resources: KernelResources | None   # None: NVRTC unavailable, check only rules 1 and 4's caps
    max_dynamic_smem: int = DEFAULT_DYNAMIC_SMEM

    def _fail(self, what: str, g, b, shared_mem: int, why: str):
        _fail(self.name, what, g, b, shared_mem, why)

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        """``cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, nbytes)``."""
        static = self.resources.static_smem if self.resources else 0
        if nbytes < 0 or static + nbytes > SMEM_OPTIN_MAX:
            raise LaunchResourceError(
                f"kernel {self.name}: cannot allow {nbytes} bytes of dynamic shared memory: "
                f"{INVALID_VALUE}: static {static} + dynamic {nbytes} bytes exceeds the "
                f"{SMEM_OPTIN_MAX}-byte opt-in limit of sm_90")
        self.max_dynamic_smem = int(nbytes)

    def check(self, g: tuple[int, int, int], b: tuple[int, int, int], shared_mem: int,
              opt_in: bool = True) -> None:
        """Raise ``LaunchResourceError`` as the driver would refuse the launch.
        ``opt_in``: raise the dynamic shared memory attribute first when the launch asks
        for more, as the CuPy backend does (False models a launcher that never opts in)."""
        check_configuration(self.name, g, b, shared_mem)
        shared_mem = int(shared_mem)
        nthreads = b[0] * b[1] * b[2]
        r = self.resources
        if r is not None:
            if r.max_threads is not None and nthreads > r.max_threads:
                self._fail(OUT_OF_RESOURCES, g, b, shared_mem,
                           f"{nthreads} threads per block > __launch_bounds__({r.max_threads})")
            need = registers_per_block(r.registers, nthreads)
            if need > REGS_PER_BLOCK:
                self._fail(OUT_OF_RESOURCES, g, b, shared_mem,
                           f"{r.registers} registers/thread x {nthreads} threads needs {need} registers "
                           f"(allocated per warp in units of {REG_ALLOC_UNIT}, warps rounded up to "
                           f"{WARP_ALLOC_GRANULARITY}) > {REGS_PER_BLOCK}; at most "
                           f"{max_threads_for_registers(r.registers)} threads fit")
            if r.static_smem > STATIC_SMEM_MAX:  # ptxas refuses this first; kept for hand-made resources
                self._fail(OUT_OF_RESOURCES, g, b, shared_mem,
                           f"{r.static_smem} bytes of static shared memory > {STATIC_SMEM_MAX}")
        if shared_mem > self.max_dynamic_smem and opt_in:
            self.set_max_dynamic_smem(shared_mem)
        if shared_mem > self.max_dynamic_smem:
            self._fail(INVALID_VALUE, g, b, shared_mem,
                       f"{shared_mem} bytes of dynamic shared memory > the kernel's "
                       f"MaxDynamicSharedMemorySize attribute ({self.max_dynamic_smem}); above "
                       f"{DEFAULT_DYNAMIC_SMEM} bytes a launch needs the opt-in "
                       "cudaFuncSetAttribute(..., cudaFuncAttributeMaxDynamicSharedMemorySize, n)")
        static = r.static_smem if r is not None else 0
        if static + shared_mem > SMEM_OPTIN_MAX:
            self._fail(INVALID_VALUE, g, b, shared_mem,
                       f"static {static} + dynamic {shared_mem} bytes of shared memory > {SMEM_OPTIN_MAX}")

