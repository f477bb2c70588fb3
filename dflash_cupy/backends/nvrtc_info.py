"""What NVRTC + ptxas say about a source: compile errors and per-kernel resources.

Runs without a GPU (NVRTC is a plain library, loaded through
``cupy_backends.cuda.libs.nvrtc``). Used by

* the emulated backend, which compiles every module once more with NVRTC for
  ``sm_90`` so that a kernel ptxas rejects (too much static shared memory, a
  bad PTX constraint, ...) fails to compile there too, and so that each
  launch can be checked against the registers, static shared memory and
  ``__launch_bounds__`` the GPU build really has (``launch_limits``);
* ``tests/test_nvrtc.py`` (no warnings, no spills on sm_80/sm_90);
* the CuPy backend's compile cache key (``include_digest``).

Results are cached on disk beside the emulator's build cache
(``build_cache.cache_dir()/nvrtc``), keyed by the source, its options, the
content of every header it includes, the architecture and the NVRTC version,
so a warm run costs a hash and a small JSON read per module. Each record's build
keeps its cubin beside it (``-lineinfo`` added: line tables only, the same code and
resources), which ``profiling.sass`` disassembles: one NVRTC compile per variant
serves the resource check and the SASS.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from . import cuda_headers
from ..build_cache import key_lock
from .signatures import strip_comments

ARCH = "sm_90"  # the architecture whose resource usage the emulator enforces (Hopper)
# Always added by the CuPy backend (which takes NVRTC_FLAGS from here; this module does not
# import CuPy) and by CuPy's RawModule itself (cupy/cuda/compiler.py).
NVRTC_FLAGS = ("--std=c++17", "-ftz=true")
CUPY_IMPLIED_FLAGS = ("--device-as-default-execution-space",)
_CACHE_VERSION = "1"

_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.M)


class NvrtcUnavailable(RuntimeError):
    """NVRTC cannot be loaded (no nvidia-cuda-nvrtc wheel / CUDA toolkit)."""


class NvrtcCompileError(RuntimeError):
    """NVRTC or ptxas rejected the source; the message is the compiler log."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class KernelResources:
    """One entry function as ptxas built it."""
    name: str
    registers: int
    static_smem: int           # bytes of __shared__ arrays with a compile-time size
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    max_threads: int | None = None   # __launch_bounds__ (PTX .maxntid), None if unbounded


@dataclass(frozen=True)
class CompileInfo:
    arch: str
    log: str                                  # NVRTC front end + ptxas -v output
    kernels: dict[str, KernelResources]
    cubin: bytes | None = None                # the ELF (with line info), when asked for and loadable


# ---------------------------------------------------------------------------
# options and headers
# ---------------------------------------------------------------------------
def normalise_options(options: Sequence[str]) -> tuple[str, ...]:
    """One token per option, ``-I dir`` joined to ``-Idir`` (as NVRTC wants them)."""
    out: list[str] = []
    opts = [str(o) for o in options]
    i = 0
    while i < len(opts):
        o = opts[i].strip()
        if o in ("-I", "-D") and i + 1 < len(opts):
            o = o + opts[i + 1].strip()
            i += 1
        elif o.startswith("-I ") or o.startswith("-D "):
            o = o[:2] + o[2:].strip()
        out.append(o)
        i += 1
    return tuple(out)


def include_dirs_of(options: Sequence[str]) -> list[str]:
    dirs = []
    for o in normalise_options(options):
        if o.startswith("-I"):
            dirs.append(o[2:])
        elif o.startswith("--include-path="):
            dirs.append(o.split("=", 1)[1])
    return dirs


_digests: dict[Path, tuple[int, int, str, list]] = {}


def _includes_of(text: str) -> list[tuple[str, str]]:
    return _INCLUDE_RE.findall(strip_comments(text))


def _file_digest(path: Path) -> tuple[str, list[tuple[str, str]]]:
    """(sha256 of the file, its #include directives), memoised on (mtime, size) only for
    files last modified over 2 s before they were read: an edit after that gets a different
    mtime, while a file written within the same timestamp tick as its read could be edited
    again without one (hence re-read every time while fresh). Saves re-reading and
    re-scanning the CUDA headers (~1 MB) at every compile."""
    st = path.stat()
    hit = _digests.get(path)
    if hit is not None and hit[:2] == (st.st_mtime_ns, st.st_size):
        return hit[2], hit[3]
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    incs = _includes_of(data.decode("utf-8", errors="replace"))
    if time.time_ns() - st.st_mtime_ns > 2_000_000_000:
        _digests[path] = (st.st_mtime_ns, st.st_size, digest, incs)
    return digest, incs


def included_headers(source: str, filename: str | None, include_dirs: Iterable[str]) -> list[Path]:
    """Every header ``source`` includes, transitively, that resolves to a file: quoted
    includes against the including file's directory first, then ``include_dirs``;
    angle includes against ``include_dirs``. Conservative: ``#include`` lines inside
    inactive ``#if`` branches count too (a spurious recompile, never a stale one)."""
    return list(_scan_headers(source, filename, include_dirs))


def _scan_headers(source: str, filename: str | None, include_dirs: Iterable[str]) -> dict[Path, str]:
    dirs = [Path(d) for d in include_dirs]
    seen: dict[Path, str] = {}   # header -> sha256, in discovery order
    todo = [(_includes_of(source), Path(filename).parent if filename else None)]
    while todo:
        incs, here = todo.pop()
        for kind, name in incs:
            cands = ([here] if kind == '"' and here is not None else []) + dirs
            for d in cands:
                p = d / name
                if p.is_file():
                    p = p.resolve()
                    if p not in seen:
                        digest, sub = _file_digest(p)
                        seen[p] = digest
                        todo.append((sub, p.parent))
                    break
    return seen


def include_digest(source: str, filename: str | None, include_dirs: Iterable[str]) -> str:
    """sha256 over the path and content of every header ``source`` includes."""
    h = hashlib.sha256()
    for p, digest in sorted(_scan_headers(source, filename, include_dirs).items()):
        h.update(str(p).encode() + b"\0" + digest.encode())
    return h.hexdigest()


def cache_tag(source: str, filename: str, options: Sequence[str]) -> str:
    """A trailing comment naming the digest of every header ``source`` includes, for the
    CuPy backend's code string.

    CuPy's kernel cache key covers the code string, the options and the NVRTC version
    but not the content of ``#include``d files, so after an edit of ``mma.cuh`` it
    would reuse the stale cubin; with the digest in the code, it recompiles. Headers
    are searched as NVRTC does (``-I`` dirs, including the CUDA runtime headers).
    Appended, not prepended, so ``#line`` numbering is unchanged."""
    digest = include_digest(source, filename, include_dirs_of(options))
    return f"\n// dflash_cupy include digest {digest}\n"


# ---------------------------------------------------------------------------
# NVRTC
# ---------------------------------------------------------------------------
def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception as e:  # ImportError, or the shared library is missing
        raise NvrtcUnavailable(f"NVRTC cannot be loaded ({type(e).__name__}: {e}); install "
                               "nvidia-cuda-nvrtc-cu12") from None


def nvrtc_version() -> tuple[int, int]:
    return tuple(int(x) for x in _nvrtc().getVersion())


def cuda_header_dirs() -> tuple[str, ...]:
    """The runtime header directory (cuda_fp16.h, ...) matching the NVRTC CuPy loads, as a
    0- or 1-tuple: what the CuPy backend, this module and the profiling tools compile with."""
    try:
        major = nvrtc_version()[0]
    except NvrtcUnavailable:
        major = None
    return cuda_headers.cuda_include_dirs(major)


_ARCH_LINE = re.compile(r"^[ \t]*//[ \t]*nvrtc-arch:[ \t]*(\S+)[ \t]*$", re.M)


def declared_arch(source: str) -> str | None:
    """The target a source says it needs on a line of its own, ``// nvrtc-arch: sm_90a``
    (wgmma and other arch-specific instructions exist only for ``sm_90a``), or None."""
    m = _ARCH_LINE.search(source)
    return m.group(1) if m else None


def emulator_arch(source: str) -> str:
    """The target whose build bounds the emulator's launches: ``ARCH``, or the source's
    declared ``sm_90`` variant (``sm_90a``: the same resources, more instructions)."""
    arch = declared_arch(source)
    if arch is None:
        return ARCH
    if not arch.startswith(ARCH):
        raise NvrtcCompileError(f"the source declares nvrtc-arch {arch}; the emulator models {ARCH} "
                                f"(an H200) and runs {ARCH} or {ARCH}a code only", "")
    return arch


def nvrtc_options(arch: str, options: Sequence[str]) -> list[str]:
    """The CuPy backend's NVRTC options for ``options``, plus ``ptxas -v``."""
    return [f"--gpu-architecture={arch}", *NVRTC_FLAGS, *CUPY_IMPLIED_FLAGS, "--ptxas-options=-v",
            *normalise_options(options), *("-I" + d for d in cuda_header_dirs())]


def with_line_directive(source: str, filename: str) -> str:
    """Prefix ``#line 1 "filename"`` so diagnostics name the original file and line."""
    escaped = filename.replace("\\", "\\\\").replace('"', '\\"')
    return f'#line 1 "{escaped}"\n' + source


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per entry function: registers, smem (static bytes), stack, spill_stores, spill_loads."""
    out: dict[str, dict[str, int]] = {}
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


def parse_maxntid(ptx: str) -> dict[str, int]:
    """Entry name -> x*y*z of its ``.maxntid`` (what ``__launch_bounds__`` compiles to),
    or of ``.reqntid``; entries without either are absent."""
    out: dict[str, int] = {}
    for m in re.finditer(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\((.*?)\)\s*(.*?)\{", ptx, re.S):
        d = re.search(r"\.(?:maxntid|reqntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", m.group(3))
        if d:
            out[m.group(1)] = int(d.group(1)) * int(d.group(2) or 1) * int(d.group(3) or 1)
    return out


@functools.lru_cache(maxsize=1)
def _cubin_lib():
    """libnvrtc itself, for the cubin calls (``cupy_backends``' ``getCUBIN`` cuts the ELF at
    its first NUL byte): the library CuPy loads, found by ``cuda.pathfinder``; None if not."""
    try:
        import ctypes
        from cuda.pathfinder import load_nvidia_dynamic_lib
        lib = ctypes.CDLL(load_nvidia_dynamic_lib("nvrtc").abs_path)
        for fn in (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN):
            fn.restype = ctypes.c_int
        return lib
    except Exception:  # pathfinder missing or finds nothing: resources only
        return None


def _program_cubin(prog) -> bytes | None:
    import ctypes
    lib = _cubin_lib()
    if lib is None:
        return None
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)) != 0 or not size.value:
        return None
    buf = ctypes.create_string_buffer(size.value)
    return buf.raw if lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), buf) == 0 else None


def compile_info(source: str, filename: str, options: Sequence[str] = (), arch: str = ARCH, *,
                 cubin: bool = False) -> CompileInfo:
    """Compile with NVRTC (uncached). Raises ``NvrtcCompileError`` naming ``filename`` when
    NVRTC or ptxas reports an error; warnings are left in ``log``. With ``cubin``, the build
    adds ``-lineinfo`` (line tables only: ptxas makes the same code) and keeps the ELF, so
    one compile serves both the resource check and ``profiling.sass``."""
    nvrtc = _nvrtc()
    opts = nvrtc_options(arch, options) + (["-lineinfo"] if cubin else [])
    prog = nvrtc.createProgram(with_line_directive(source, filename), filename, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise NvrtcCompileError(f"{filename} [{arch} {' '.join(normalise_options(options))}]: "
                                    f"NVRTC error {e}:\n{log}", log) from None
        log = nvrtc.getProgramLog(prog)
        ptx = nvrtc.getPTX(prog)
        elf = _program_cubin(prog) if cubin else None
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode(errors="replace") if isinstance(ptx, bytes) else str(ptx)
    bounds = parse_maxntid(ptx)
    kernels = {name: KernelResources(name, r["registers"], r["smem"], r["stack"], r["spill_stores"],
                                     r["spill_loads"], bounds.get(name))
               for name, r in parse_ptxas(log).items()}
    return CompileInfo(arch, log, kernels, elf)


# ---------------------------------------------------------------------------
# disk cache
# ---------------------------------------------------------------------------
def cache_root() -> Path:
    from ..build_cache import cache_dir
    d = cache_dir() / "nvrtc"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cache_key(source: str, filename: str, options: Sequence[str], arch: str = ARCH) -> str:
    opts = normalise_options(options)
    parts = [_CACHE_VERSION, arch, ".".join(map(str, nvrtc_version())), filename, source, *opts,
             include_digest(source, filename, include_dirs_of(opts))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def cached_compile_info(source: str, filename: str | None, options: Sequence[str] = (),
                        arch: str = ARCH) -> CompileInfo:
    """``compile_info`` through the disk cache. A rejected source is cached too (its log),
    so a failing module costs one NVRTC run, not one per test. A miss compiles under the
    cache's per-key lock: a process (or thread) asking for a source another one is
    compiling waits for that record instead of compiling it again."""
    rec, _ = _cached_record(source, filename, options, arch)
    return CompileInfo(arch, rec["log"], {k["name"]: KernelResources(**k) for k in rec["kernels"]})


def cached_cubin(source: str, filename: str | None, options: Sequence[str] = (),
                 arch: str = ARCH) -> bytes | None:
    """The cubin of the build ``cached_compile_info`` checks (the same compile: a record
    written by this version keeps its ELF beside it), or None when libnvrtc's cubin calls
    cannot be loaded. Raises ``NvrtcCompileError`` for a rejected source."""
    if _cubin_lib() is None:
        return None
    _, path = _cached_record(source, filename, options, arch, cubin=True)
    return _read_cubin(path)


def _cached_record(source: str, filename: str | None, options: Sequence[str], arch: str,
                   cubin: bool = False) -> tuple[dict, Path]:
    """The record (and its path) of a build, compiled on a miss under the key's lock; with
    ``cubin``, a successful record without its cubin (written before cubins were kept) is a
    miss too. Raises ``NvrtcCompileError`` for a rejected source."""
    fname = filename or "<source>.cu"
    key = cache_key(source, fname, options, arch)
    path = cache_root() / (key + ".json")

    def ready() -> dict | None:
        rec = _read_record(path)
        if rec is not None and cubin and rec["ok"] and not path.with_suffix(".cubin").exists():
            return None
        return rec
    rec = ready()
    if rec is None:
        with key_lock("nvrtc-" + key):
            rec = ready()   # written while this one waited
            if rec is None:
                rec = _compile_record(source, fname, options, arch, path)
    if not rec["ok"]:
        raise NvrtcCompileError(rec["message"], rec["log"])
    return rec, path


def _read_cubin(path: Path) -> bytes | None:
    try:
        return path.with_suffix(".cubin").read_bytes()
    except OSError:
        return None


def _read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _compile_record(source: str, fname: str, options: Sequence[str], arch: str, path: Path) -> dict:
    """Compile and write the cache record ``path`` (atomically: readers see all or nothing)."""
    t0 = time.perf_counter()
    try:
        info = compile_info(source, fname, options, arch, cubin=True)
        rec = {"ok": True, "log": info.log, "kernels": [asdict(k) for k in info.kernels.values()]}
        if info.cubin is not None:   # before the record: a reader that sees the record sees it
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(info.cubin)
            os.replace(tmp, path.with_suffix(".cubin"))
    except NvrtcCompileError as e:
        rec = {"ok": False, "message": str(e), "log": e.log}
    rec["seconds"] = round(time.perf_counter() - t0, 4)  # what the cache saves (cold-cost audits)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)  # atomic: concurrent test processes see all or nothing
    return rec


_warned = False
_pool = None
_pool_lock = threading.Lock()


class _Done:
    def __init__(self, fn):
        try:
            self._value, self._error = fn(), None
        except BaseException as e:  # re-raised by result(), as a Future would
            self._value, self._error = None, e

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


def resources_for_emulator_async(source: str, filename: str | None, options: Sequence[str]):
    """``resources_for_emulator`` as a future (``.result()``): on a cache miss NVRTC runs on
    a worker thread (it releases the GIL) while the caller runs g++ for the emulator, so a
    cold build costs max(g++, NVRTC) rather than the sum."""
    global _pool
    fn = functools.partial(resources_for_emulator, source, filename, options)
    try:
        hit = (cache_root() / (cache_key(source, filename or "<source>.cu", options, emulator_arch(source))
                               + ".json")).exists()
    except (NvrtcUnavailable, NvrtcCompileError):
        hit = True  # resources_for_emulator warns and returns None at once
    if hit or os.environ.get("DFLASH_CUPY_EMU_NVRTC", "1").strip() == "0":
        return _Done(fn)
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor
            _pool = ThreadPoolExecutor(2, thread_name_prefix="dflash-nvrtc")
    return _pool.submit(fn)


def resources_for_emulator(source: str, filename: str | None, options: Sequence[str]
                           ) -> dict[str, KernelResources] | None:
    """Per-kernel resources of the sm_90 build, for the emulated backend's launch checks.
    Raises ``NvrtcCompileError`` when ptxas/NVRTC rejects the source. None (after one
    warning) when NVRTC is not installed: then only the resource-free limits are checked.
    ``DFLASH_CUPY_EMU_NVRTC=0`` turns the check off."""
    global _warned
    if os.environ.get("DFLASH_CUPY_EMU_NVRTC", "1").strip() == "0":
        return None
    try:
        return cached_compile_info(source, filename, options, emulator_arch(source)).kernels
    except NvrtcUnavailable as e:
        if not _warned:
            _warned = True
            warnings.warn(f"{e}: the emulator cannot check launches against register and shared "
                          "memory use", RuntimeWarning, stacklevel=3)
        return None
