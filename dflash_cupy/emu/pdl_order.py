"""The emulated backend's check of programmatic dependent launch (PDL).

The emulator runs launches one after another, so a PDL launch cannot go wrong
here by itself. What a GPU allows (cuda_src/pdl.cuh): kernel B launched with
the attribute right after kernel A may start once every block of A has run
``pdl_launch_dependents()`` or exited, and B's ``pdl_wait()`` returns once A
has completed with its memory visible. So whatever a thread of B touches
before its wait may run concurrently with A.

``check_pdl(backend)`` (or ``DFLASH_CUPY_EMU_PDL_CHECK=1`` for the backend
``backends.get`` makes) installs a ``PdlChecker``, which runs every launch in the
counter build (``counting.run_counted``), which records per thread whether
``pdl_wait()`` has run and per 32-byte sector the bytes read and written, and
those touched before the wait (``prefetch_l2`` lines count as pre-wait reads).
For a launch B with ``pdl`` after launch A on the same stream it requires:

* B's pre-wait reads ∩ A's writes = ∅ (B would read a value A has not written yet);
* B's pre-wait writes ∩ (A's reads ∪ A's writes) = ∅ (A would read or keep B's value);
* some block of B waited (a PDL kernel that never waits is a bug: nothing would order
  it after A, and A's completion would no longer imply the completion of the kernel
  before A, on which the next kernel's own ordering rests), and no thread of B
  triggered its dependents before its own wait (the next kernel could then start
  while A still runs, which its pre-wait part is only checked against B for);
* a kernel launch precedes B on the stream (a PDL launch after a copy or at a
  graph's start has no kernel to overlap: the product never issues one).

Blocks of B that exit without waiting are allowed: their accesses are all
pre-wait and checked as such. A violation raises ``PdlOrderError`` when B runs
(like any kernel error: at the next synchronisation), naming both kernels,
B's array and the byte. Checked runs are single-threaded and slower: for tests
on small shapes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..backends import signatures
from ..backends.base import KernelLaunchError

_LO = np.uint64(0xFFFFFFFF)


def check_pdl(backend, on: bool = True):
    """Turn the ordering check on (or off) for the work ``backend`` (an ``EmulatedBackend``)
    queues from now on: every launch then runs in the counter build, and a launch with
    ``pdl`` raises ``PdlOrderError`` when it runs if it could race with the kernel before
    it on its stream. Returns the checker (its ``log`` lists every launch it ran)."""
    if not isinstance(on, (bool, np.bool_)):
        raise TypeError(f"on must be a bool, got {type(on).__name__}")
    if not hasattr(backend, "pdl_checker"):
        raise TypeError(f"backend must be the emulated backend, got {type(backend).__name__}")
    backend.pdl_checker = PdlChecker(backend) if on else None
    return backend.pdl_checker


class PdlOrderError(KernelLaunchError):
    """A programmatic launch could race with the kernel before it (see the module docstring)."""


@dataclass
class Access:
    """What one launch touched: per sector address (sorted, unique), byte masks."""
    kernel: str
    arrays: list          # (parameter name, start address, nbytes) of its array arguments
    addr: np.ndarray
    rd: np.ndarray
    wr: np.ndarray
    prd: np.ndarray       # before the thread's pdl_wait()
    pwr: np.ndarray

    @classmethod
    def from_sectors(cls, kernel, args, sec: np.ndarray) -> "Access":
        arrays = [(p.name, int(a.ctypes.data), int(a.nbytes))
                  for p, a in signatures.leaves(kernel.sig.params, args) if p.is_pointer]
        if sec is None or not len(sec):
            z = np.zeros(0, np.uint64)
            return cls(kernel.name, arrays, z, z, z, z, z)
        addr, inv = np.unique(sec[:, 0], return_inverse=True)

        def merged(col):
            out = np.zeros(len(addr), np.uint64)
            np.bitwise_or.at(out, inv, col)
            return out
        return cls(kernel.name, arrays, addr, merged(sec[:, 1] & _LO), merged(sec[:, 1] >> np.uint64(32)),
                   merged(sec[:, 2] & _LO), merged(sec[:, 2] >> np.uint64(32)))

    def name_of(self, address: int) -> str:
        for name, start, n in self.arrays:
            if start <= address < start + n:
                return f"{name} (byte {address - start})"
        return f"0x{address:x}"

    @property
    def pre_read_bytes(self) -> int:
        return int(sum(bin(int(v)).count("1") for v in self.prd))

    @property
    def pre_write_bytes(self) -> int:
        return int(sum(bin(int(v)).count("1") for v in self.pwr))


def _first_overlap(b_addr, b_mask, a_addr, a_mask):
    """The first byte address both masks hold, or None."""
    keep_b, keep_a = b_mask != 0, a_mask != 0
    common, ib, ia = np.intersect1d(b_addr[keep_b], a_addr[keep_a], assume_unique=True, return_indices=True)
    if not len(common):
        return None
    both = b_mask[keep_b][ib] & a_mask[keep_a][ia]
    hit = np.nonzero(both)[0]
    if not len(hit):
        return None
    i = int(hit[0])
    m = int(both[i])
    return int(common[i]) + ((m & -m).bit_length() - 1)


@dataclass
class Checked:
    """One launch the checker ran (``PdlChecker.log``)."""
    kernel: str
    pdl: bool
    after: str | None          # the kernel before it on its stream (None: a copy or nothing)
    pre_read_bytes: int        # bytes read before pdl_wait() (prefetched lines included)
    pre_write_bytes: int
    waited_blocks: int
    blocks: int


class PdlChecker:
    """Per stream: the latest launch's accesses (reset by a copy); see the module docstring."""

    def __init__(self, backend):
        self._backend = backend
        self._prev: dict = {}      # stream actor -> Access of its latest launch, or None
        self.log: list[Checked] = []

    def wrap(self, stream, kind: str, run, call):
        """The queued operation's run function, as the checker runs it on ``stream``."""
        if kind == "launch":
            return functools.partial(self._launch, stream, call)
        if kind == "copy":
            return functools.partial(self._other, stream, run)
        return run

    def _other(self, stream, run) -> None:
        run()
        self._prev[stream._actor] = None

    def _launch(self, stream, call) -> None:
        from .counting import run_counted
        kernel, g, b, args, smem, pdl = call
        be = self._backend
        counts, sec = run_counted(kernel, g, b, args, smem, None, be.order, be._next_seed(), sectors=True)
        acc = Access.from_sectors(kernel, args, sec)
        prev = self._prev.get(stream._actor)
        self._prev[stream._actor] = acc
        self.log.append(Checked(kernel.name, bool(pdl), prev.kernel if prev else None, acc.pre_read_bytes,
                                acc.pre_write_bytes, counts.pdl_waited_blocks, counts.blocks_total))
        if pdl:
            self.check(prev, acc, counts)

    @staticmethod
    def check(prev: Access | None, acc: Access, counts) -> None:
        """Raise ``PdlOrderError`` if launch ``acc`` (with ``pdl``) may race with ``prev``."""
        k = acc.kernel
        if prev is None:
            raise PdlOrderError(f"kernel {k}: launched with pdl=True but no kernel precedes it on its "
                                "stream (a copy, an event or nothing does): there is nothing to overlap")
        if counts.pdl_waited_blocks == 0:
            raise PdlOrderError(f"kernel {k}: launched with pdl=True after {prev.kernel} but no block ran "
                                "pdl_wait() (pdl.cuh): nothing orders it after the kernel before")
        if counts.pdl_early_triggers:
            raise PdlOrderError(f"kernel {k}: {counts.pdl_early_triggers} thread(s) ran pdl_launch_dependents() "
                                "before pdl_wait(): the next kernel could start while "
                                f"{prev.kernel} still runs")
        hit = _first_overlap(acc.addr, acc.prd, prev.addr, prev.wr)
        if hit is not None:
            raise PdlOrderError(f"kernel {k}: reads {acc.name_of(hit)} before pdl_wait(), which {prev.kernel} "
                                f"(the kernel before it, still running under PDL) writes as {prev.name_of(hit)}")
        hit = _first_overlap(acc.addr, acc.pwr, prev.addr, prev.rd | prev.wr)
        if hit is not None:
            raise PdlOrderError(f"kernel {k}: writes {acc.name_of(hit)} before pdl_wait(), which {prev.kernel} "
                                f"(the kernel before it, still running under PDL) accesses as "
                                f"{prev.name_of(hit)}")
