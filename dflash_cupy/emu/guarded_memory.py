"""Emulated device memory: NumPy arrays whose bytes sit flush against a
PROT_NONE guard page, so a kernel that reads or writes past the end faults
at once; the fault address is mapped back to the array it overran."""
from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
import weakref

import numpy as np

PAGE = mmap.PAGESIZE
ALIGN = 16  # kernels may use 16-byte vector loads on any array base
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_PROT_NONE = 0

_lock = threading.Lock()
_starts: list[int] = []          # sorted mapping start addresses
_regions: dict[int, tuple] = {}  # start -> (map_end, data_start, data_end, description)
_serials: dict[int, int] = {}    # start -> allocation serial (never reused, unlike addresses)
_next_serial = iter(range(1, 1 << 62))


def _forget(start: int, serial: int) -> None:
    with _lock:
        # The mapping may be gone before this runs, and its address reused by a newer
        # allocation (another thread's): that one's registration stays.
        if _serials.get(start) != serial:
            return
        i = bisect.bisect_left(_starts, start)
        if i < len(_starts) and _starts[i] == start:
            _starts.pop(i)
        _regions.pop(start, None)
        _serials.pop(start, None)


def _register(start: int, map_end: int, d0: int, d1: int, desc: str) -> int:
    """Record a live mapping; returns its serial (``_forget`` needs it)."""
    with _lock:
        i = bisect.bisect_left(_starts, start)
        if not (i < len(_starts) and _starts[i] == start):  # (an address reused before its _forget ran)
            _starts.insert(i, start)
        _regions[start] = (map_end, d0, d1, desc)
        serial = _serials[start] = next(_next_serial)
    return serial


def guarded_empty(shape, dtype, what: str = "array") -> np.ndarray:
    """An uninitialised C-contiguous array with guard pages on both sides."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    if any(s < 0 for s in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    data_pages = max(1, -(-(nbytes + ALIGN) // PAGE))
    total = (data_pages + 2) * PAGE
    mm = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    probe = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(probe)
    del probe
    for guard in (base, base + (data_pages + 1) * PAGE):
        if _libc.mprotect(guard, PAGE, _PROT_NONE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect of a guard page failed")
    data_end = base + (data_pages + 1) * PAGE
    off = (data_end - nbytes) // ALIGN * ALIGN - base
    arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=off)
    arr = arr.view(dtype).reshape(shape) if nbytes else np.empty(shape, dtype)
    desc = f"{what} shape={shape} dtype={dtype.name}"
    serial = _register(base, base + total, base + off, base + off + nbytes, desc)
    weakref.finalize(mm, _forget, base, serial)
    return arr


class StackArena:
    """Fiber stacks of one OS thread, shared by every emulated module: ``count``
    stacks of ``emu_build.STACK_BYTES``, each above a PROT_NONE guard page."""

    def __init__(self, count: int, stack_bytes: int):
        self.count = count
        self.stride = PAGE + stack_bytes
        self._map = mmap.mmap(-1, count * self.stride, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        probe = ctypes.c_char.from_buffer(self._map)
        self.base = ctypes.addressof(probe)
        del probe
        for i in range(count):
            if _libc.mprotect(self.base + i * self.stride, PAGE, _PROT_NONE) != 0:
                raise OSError(ctypes.get_errno(), "mprotect of a fiber stack guard page failed")
        _all_arenas.add(self)


_all_arenas = weakref.WeakSet()  # for fault reports: an address in a stack guard page is an overflow


_arenas = threading.local()


def stack_arena(nthreads: int) -> StackArena:
    """This OS thread's fiber stacks, grown to hold ``nthreads`` (one per thread of a block)."""
    from .build import STACK_BYTES
    arena = getattr(_arenas, "arena", None)
    if arena is None or arena.count < nthreads:
        count = 128
        while count < nthreads:
            count *= 2
        _arenas.arena = arena = StackArena(count, STACK_BYTES)  # the old one is unmapped when dropped
    return arena


def is_inside(arr: np.ndarray, what: str) -> bool:
    """True when all of ``arr`` lies inside one live allocation made as ``what``."""
    a0 = arr.ctypes.data
    a1 = a0 + arr.nbytes
    with _lock:
        i = bisect.bisect_right(_starts, a0) - 1
        if i < 0:
            return False
        _, d0, d1, desc = _regions[_starts[i]]
        return d0 <= a0 and a1 <= d1 and desc.startswith(what + " ")


def region(arr: np.ndarray):
    """``(serial, data_start, description)`` of the live allocation holding
    ``arr``'s first byte, or None (not guarded memory). Serials are unique
    for the life of the process, so state keyed by them dies with the array."""
    a0 = arr.ctypes.data
    alloc = allocation_of(a0)
    if alloc is None:
        return None
    start, _, d0, d1, desc = alloc
    if not d0 <= a0 < max(d1, d0 + 1):
        return None
    with _lock:
        serial = _serials.get(start)
    return None if serial is None else (serial, d0, desc)


def live_serials() -> set[int]:
    with _lock:
        return set(_serials.values())


def allocation_of(addr: int):
    """(mapping start, mapping end, data start, data end, description) of the live
    allocation whose mapping holds ``addr``, or None."""
    with _lock:
        i = bisect.bisect_right(_starts, addr) - 1
        if i < 0:
            return None
        start = _starts[i]
        map_end, d0, d1, desc = _regions[start]
        return (start, map_end, d0, d1, desc) if addr < map_end else None


def launch_ranges(params, args) -> tuple:
    """The ``(ranges, names, count)`` arguments of ``emu_launch``: for each pointer
    argument inside a guarded allocation, its mapping and data bounds
    ``[lo, hi, d0, d1]`` and a name for messages (the parameter, shape, dtype).
    A pointer may move anywhere inside its allocation, as on the GPU."""
    ranges, names = [], []
    for p, a in zip(params, args):
        alloc = allocation_of(a.ctypes.data) if p.is_pointer and a.nbytes else None
        if alloc is not None:
            ranges += alloc[:4]
            names.append(f"`{p.name}` ({alloc[4]})".encode())
    return ((ctypes.c_ulonglong * max(1, len(ranges)))(*ranges),
            (ctypes.c_char_p * max(1, len(names)))(*names), len(names))


def poison_enabled() -> bool:
    """Whether ``empty`` fills new device arrays with 0xFF bytes (NaN for floats, -1 for
    ints), so a kernel that reads what nobody wrote shows up: on unless
    ``DFLASH_CUPY_EMU_POISON=0``."""
    v = os.environ.get("DFLASH_CUPY_EMU_POISON", "1").strip().lower()
    if v not in ("0", "1", "false", "true", "off", "on", "no", "yes"):
        raise ValueError(f"DFLASH_CUPY_EMU_POISON={v!r}: expected 0 or 1")
    return v in ("1", "true", "on", "yes")


def describe_address(addr: int | None) -> str:
    """Which emulated array an address falls next to, for fault reports."""
    if addr is None:
        return "at an unknown address"
    with _lock:
        i = bisect.bisect_right(_starts, addr) - 1
        if i >= 0:
            start = _starts[i]
            map_end, d0, d1, desc = _regions[start]
            if start <= addr < map_end:
                if addr >= d1:
                    return f"at 0x{addr:x}, {addr - d1} bytes past the end of {desc}"
                if addr < d0:
                    return f"at 0x{addr:x}, {d0 - addr} bytes before the start of {desc}"
                return f"at 0x{addr:x}, inside {desc}"
    for arena in list(_all_arenas):
        off = addr - arena.base
        if 0 <= off < arena.count * arena.stride and off % arena.stride < PAGE:
            return (f"at 0x{addr:x}, in the guard page below fiber stack {off // arena.stride}: "
                    f"a stack overflow (kernel locals beyond {arena.stride - PAGE} bytes?)")
    return f"at 0x{addr:x}, outside every emulated device array"
