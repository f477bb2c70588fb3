"""The CPU/GPU differential: every eager launch runs on the emulator and on a
reference backend, and the two sets of outputs are compared.

``DifferentialBackend`` is an ``EmulatedBackend`` (tests and launchers use it
unchanged: arrays are the emulator's) whose kernels, when called outside
capture, also

1. copy every allocation a pointer argument points into, as it is just before
   the launch, to the reference backend (one copy per allocation, so views of
   one buffer keep aliasing each other there too);
2. run the launch on the emulator, then the same launch (grid, block, shared
   memory, scalars, views at the same offsets) on the reference;
3. compare each allocation byte for byte. Where bytes differ, each argument
   view over them is compared by its dtype: integer data must match exactly;
   floating-point data must match bit for bit when the kernel is in
   ``EXACT_KERNELS`` or the backend is ``exact=True``, else lie within the
   tolerance of its dtype (``dflash_cupy.tolerances.TOL``: f32, f16) or of
   the kernel's entry in ``KERNEL_TOLERANCE``. Failures raise
   ``DifferentialMismatch`` naming the kernel, launch, argument and worst
   element; every comparison is tallied in ``stats`` (bit-identical or not,
   worst error) for the end-of-run report.

On a GPU the reference is the CuPy backend (``tests/support/differential_mode.py`` turns
it on for the test suite: ``DFLASH_CUPY_DIFFERENTIAL=1``); on the CPU a second
emulator with another fiber schedule exercises the same machinery.
Launches recorded during capture and graph replays are not compared.
"""
from __future__ import annotations

from collections.abc import Mapping
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..tolerances import TOL
from ..backends.base import Backend, KernelLaunchError
from .device_array import raw
from .backend import EmulatedBackend, _raw_arg

# Kernels whose outputs do not depend on floating-point evaluation details: any
# difference is a bug. (plan.cu: integer planning, constant 0/-inf f16 masks, and a
# feature gather that only copies or widens f16/bf16 to f32, which is exact.)
EXACT_KERNELS: frozenset[str] = frozenset({
    "reset_slots", "reset_slots_if", "plan_append", "gather_features",
    "build_masks", "build_mask_full", "build_mask_swa"})
# Kernels whose float outputs carry more than one rounding of their storage type;
# by default a buffer's tolerance is that of its dtype.
KERNEL_TOLERANCE: dict[str, str] = {}
_DTYPE_TOLERANCE = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
                    np.dtype(np.float64): "f32"}



def _array_args(args):
    """(index, array) of a launch's array arguments; a struct argument's arrays as
    ((index, field name), array)."""
    for i, a in enumerate(args):
        if isinstance(a, Mapping):
            for k, v in a.items():
                if isinstance(v, np.ndarray) and not isinstance(v, np.generic):
                    yield (i, k), v
        elif isinstance(a, np.ndarray) and not isinstance(a, np.generic):
            yield i, a

class DifferentialMismatch(AssertionError):
    """The emulator and the reference backend disagree about a launch."""


@dataclass
class KernelStats:
    launches: int = 0
    bit_identical: int = 0
    worst_abs_err: float = 0.0
    worst_arg: str = ""


@dataclass
class DifferentialStats:
    kernels: dict[str, KernelStats] = field(default_factory=lambda: defaultdict(KernelStats))
    mismatches: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"{'kernel':<36} {'launches':>8} {'bit-identical':>13} {'worst abs err':>14}  arg"]
        for name, s in sorted(self.kernels.items()):
            lines.append(f"{name:<36} {s.launches:>8} {s.bit_identical:>13} {s.worst_abs_err:>14.3e}  "
                         f"{s.worst_arg}")
        lines.append(f"{len(self.mismatches)} mismatching launch(es)")
        lines += ["  " + m.splitlines()[0] for m in self.mismatches[:20]]
        return "\n".join(lines)


def _root(a: np.ndarray) -> np.ndarray:
    """The outermost ndarray owning ``a``'s memory (the whole allocation)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    if not a.flags.c_contiguous:
        raise ValueError(f"differential: an argument's allocation is not contiguous ({a.shape}, "
                         f"strides {a.strides})")
    return a


def _bytes(root: np.ndarray) -> np.ndarray:
    return root.reshape(-1).view(np.uint8) if root.ndim else root.reshape(1).view(np.uint8)


def _compare_float(got: np.ndarray, ref: np.ndarray, kind: str) -> tuple[bool, float, tuple]:
    """(within tolerance, max abs error, index of the worst element); NaN matches NaN,
    an infinity matches the same infinity."""
    g = got.astype(np.float64)
    r = ref.astype(np.float64)
    t = TOL[kind]
    same = (g == r) | (np.isnan(g) & np.isnan(r))
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.where(same, 0.0, np.abs(g - r))
        err = np.where(np.isnan(err), np.inf, err)
        ok = err <= t["atol"] + t["rtol"] * np.abs(np.where(np.isfinite(r), r, 0.0))
    worst = np.unravel_index(int(np.argmax(err)), err.shape) if err.size else ()
    return bool(ok.all()), float(err.max(initial=0.0)), worst


class DiffKernel:
    def __init__(self, module: "DiffModule", name: str):
        self._module = module
        self.name = name
        self._emu = module.emu.get_function(name)
        self._ref = None

    def __getattr__(self, item):  # sig, _launch_limits, ... of the emulated kernel
        return getattr(self._emu, item)

    def __call__(self, grid, block, args: Sequence[Any], shared_mem: int = 0, stream=None,
                 pdl=None) -> None:
        be = self._module.backend
        if be.is_capturing():
            return self._emu(grid, block, args, shared_mem=shared_mem, stream=stream, pdl=pdl)
        ref_be = be.reference
        args = tuple(_raw_arg(a) for a in args)   # the ndarrays behind device arrays (struct fields too; synchronised below)
        # Emulated streams run deferred: let queued work produce the inputs first, and run
        # this launch before comparing (this mode is synchronous; stream hazards are the
        # plain emulated backend's business).
        be.synchronize()
        # Snapshot the inputs on the reference before the emulator writes the outputs.
        roots: dict[int, tuple[np.ndarray, Any]] = {}
        views: list[tuple[Any, Any]] = []   # (arg index or (index, field), reference view)
        for i, a in _array_args(args):
            root = _root(a)
            if id(root) not in roots:
                roots[id(root)] = (root, ref_be.asarray(_bytes(root).copy()))
            views.append((i, self._ref_view(roots[id(root)][1], root, a)))
        self._emu(grid, block, args, shared_mem=shared_mem, stream=stream, pdl=pdl)
        be.synchronize()
        ref_args = [dict(a) if isinstance(a, Mapping) else a for a in args]
        for i, v in views:
            if isinstance(i, tuple):     # a struct argument's field
                ref_args[i[0]][i[1]] = v
            else:
                ref_args[i] = v
        if self._ref is None:
            self._ref = self._module.ref.get_function(self.name)
        where = f"kernel {self.name} grid={grid} block={block} shared_mem={shared_mem}"
        try:
            self._ref(grid, block, tuple(ref_args), shared_mem=shared_mem)
            ref_be.synchronize()
        except Exception as e:
            self._fail(f"{where}: the emulator ran it but the {ref_be.name} backend failed: "
                       f"{type(e).__name__}: {e}")
        self._compare(where, args, roots)

    @staticmethod
    def _ref_view(ref_root, root: np.ndarray, a: np.ndarray):
        ref_root = raw(ref_root)
        off = a.ctypes.data - root.ctypes.data
        if isinstance(ref_root, np.ndarray):
            return np.ndarray(a.shape, a.dtype, buffer=ref_root, offset=off, strides=a.strides)
        import cupy  # the reference is the CuPy backend
        return cupy.ndarray(a.shape, a.dtype, memptr=ref_root.data + off, strides=a.strides)

    def _fail(self, msg: str) -> None:
        self._module.backend.stats.mismatches.append(msg)
        raise DifferentialMismatch(msg)

    def _compare(self, where: str, args, roots) -> None:
        be = self._module.backend
        st = be.stats.kernels[self.name]
        st.launches += 1
        identical = True
        params = self._emu.sig.params
        for root, ref_root in roots.values():
            ref_host = be.reference.to_numpy(ref_root)
            emu_bytes = _bytes(root)
            if np.array_equal(emu_bytes, ref_host):
                continue
            identical = False
            diff_bytes = np.flatnonzero(emu_bytes != ref_host)
            covered = np.zeros(root.nbytes, bool)
            for i, a in _array_args(args):
                if _root(a) is not root or a.nbytes == 0:
                    continue
                off = a.ctypes.data - root.ctypes.data
                covered[off:off + a.nbytes] = True  # (contiguous views, as launchers pass)
                ref_view = np.ndarray(a.shape, a.dtype, buffer=ref_host, offset=off, strides=a.strides)
                pname = i[1] if isinstance(i, tuple) else params[i].name
                arg = f"{pname} ({a.dtype}{list(a.shape)})"
                if a.dtype.kind == "f" and not (be.exact or self.name in EXACT_KERNELS):
                    kind = KERNEL_TOLERANCE.get(self.name, _DTYPE_TOLERANCE.get(a.dtype, "f32"))
                    ok, err, idx = _compare_float(a, ref_view, kind)
                    if err > st.worst_abs_err:
                        st.worst_abs_err, st.worst_arg = err, arg
                    if not ok:
                        self._fail(f"{where}: argument {arg} differs beyond the {kind} tolerance "
                                   f"{TOL[kind]}: max abs err {err:.3e} at {idx} "
                                   f"(emulated {a[idx]!r}, {be.reference.name} {ref_view[idx]!r})")
                else:
                    bits = f"u{a.dtype.itemsize}"  # compare bit patterns (NaN payloads, -0.0 too)
                    bad = np.argwhere(a.view(bits) != ref_view.view(bits))
                    if not len(bad):
                        continue
                    idx = tuple(int(j) for j in bad[0])
                    self._fail(f"{where}: argument {arg} is not bit-identical: {len(bad)} element(s) "
                               f"differ, first at {idx} (emulated {a[idx]!r}, "
                               f"{be.reference.name} {ref_view[idx]!r})")
            outside = diff_bytes[~covered[diff_bytes]]
            if outside.size:
                self._fail(f"{where}: {outside.size} byte(s) differ outside every argument's view "
                           f"of an allocation of {root.nbytes} bytes (first at byte {int(outside[0])})")
        if identical:
            st.bit_identical += 1


class DiffModule:
    def __init__(self, backend: "DifferentialBackend", emu_mod, ref_mod):
        self.backend = backend
        self.emu = emu_mod
        self.ref = ref_mod
        self._kernels: dict[str, DiffKernel] = {}

    def __getattr__(self, item):  # resources, ... of the emulated module
        return getattr(self.emu, item)

    def get_function(self, name: str) -> DiffKernel:
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = DiffKernel(self, name)
        return k


class DifferentialBackend(EmulatedBackend):
    """The emulated backend, with every eager launch re-run on ``reference`` and compared."""
    name = "emulated"   # what the arrays are; tests parametrized on "emulated" get this

    def __init__(self, reference: Backend, exact: bool = False):
        super().__init__()
        if not isinstance(reference, Backend):
            raise TypeError(f"reference must be a Backend, got {type(reference).__name__}")
        self.reference = reference
        self.exact = bool(exact)
        self.stats = DifferentialStats()

    def compile(self, source: str, options: Sequence[str] = (), filename: str | None = None):
        emu_mod = super().compile(source, options, filename)
        try:
            ref_mod = self.reference.compile(source, options, filename)
        except Exception as e:
            raise KernelLaunchError(f"{filename or '<source>'}: compiles on the emulator but not on the "
                                    f"{self.reference.name} backend: {e}") from e
        return DiffModule(self, emu_mod, ref_mod)
