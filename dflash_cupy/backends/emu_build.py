"""Launcher generator for the emulated backend.

Parses the ``extern "C" __global__`` entry points of a CUDA C source, emits a
C++ translation unit that includes the source after ``cuda_emu.h`` plus one
trampoline per kernel (``void** args`` like ``cudaLaunchKernel``) and the
definitions of its ``extern __shared__`` buffers, and compiles it with g++
into a shared library, cached by a hash of everything that goes into it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

EMU_DIR = Path(__file__).resolve().parent.parent.parent / "cuda_src" / "emu"
SMEM_BYTES = 232448  # 227 KiB: the most dynamic shared memory a Hopper block may opt into
STACK_BYTES = 64 * 1024  # per fiber (the generated code passes it to cuda_emu.h)

CXX = os.environ.get("DFLASH_CUPY_CXX", "g++")
CXXFLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing",
            "-ffp-contract=off", "-fstack-clash-protection", "-Wno-unknown-pragmas",
            "-fno-omit-frame-pointer", "-Wl,-z,defs")  # unresolved symbols fail the build, not the load
# Every load and store of kernel code calls __asan_{load,store}N_noabort, which
# cuda_emu.h defines (byte-exact bounds of the launch's arrays, shared-memory
# interleaving; no shadow memory, no ASan runtime). DFLASH_CUPY_EMU_CHECKS=0
# builds without them (faster kernels; only guard pages catch overruns).
CHECK_FLAGS = ("-fsanitize=kernel-address", "--param", "asan-instrumentation-with-call-threshold=0",
               "--param", "asan-stack=0", "--param", "asan-globals=0")


def _flags() -> tuple[str, ...]:
    v = os.environ.get("DFLASH_CUPY_EMU_CHECKS", "1").strip().lower()
    if v not in ("0", "1"):
        raise ValueError(f"DFLASH_CUPY_EMU_CHECKS={v!r}: expected 0 or 1")
    return CXXFLAGS + (CHECK_FLAGS if v == "1" else ())


# Bumped whenever the generated translation unit changes shape (part of the cache key).
GEN_VERSION = "3"
STATIC_SMEM_FILE = "static_shared.txt"  # beside module.so: TLS offset and size of each static __shared__

# C scalar types a kernel may take by value -> (NumPy dtype name, ctypes name)
SCALAR_TYPES = {
    "int": "int32", "signed int": "int32", "unsigned": "uint32", "unsigned int": "uint32",
    "long long": "int64", "long long int": "int64", "unsigned long long": "uint64",
    "unsigned long long int": "uint64", "float": "float32", "double": "float64",
    "short": "int16", "unsigned short": "uint16", "char": "int8", "signed char": "int8",
    "unsigned char": "uint8", "bool": "bool",
    "size_t": "uint64", "long": "int64", "unsigned long": "uint64",
}


@dataclass(frozen=True)
class Param:
    ctype: str         # as written, without the name
    name: str
    is_pointer: bool
    dtype: str | None  # NumPy dtype name for scalars


@dataclass(frozen=True)
class KernelSig:
    name: str
    params: tuple[Param, ...]


def strip_comments(src: str) -> str:
    def blank(m):  # keep newlines so line numbers survive
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r"//[^\n]*|/\*.*?\*/", blank, src, flags=re.S)


_KERNEL_RE = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
    r'(?:__launch_bounds__\s*\([^)]*\)\s*)?([A-Za-z_]\w*)\s*\(([^)]*)\)', re.S)
_SMEM_RE = re.compile(
    r'extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_][\w\s]*?)\s*'
    r'(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_]\w*)\s*\[\s*\]')


def parse_param(text: str, kernel: str) -> Param:
    t = " ".join(text.replace("*", " * ").split())
    m = re.match(r"(.*?)\s*([A-Za-z_]\w*)$", t)
    if not m or not m.group(1):
        raise ValueError(f"kernel {kernel}: cannot parse parameter {text.strip()!r}")
    ctype, name = m.group(1).strip(), m.group(2)
    if "*" in ctype:
        return Param(ctype, name, True, None)
    if "&" in ctype or "[" in ctype:
        raise ValueError(f"kernel {kernel}: parameter {name!r} must be a pointer or a plain scalar")
    base = " ".join(w for w in ctype.split() if w not in ("const", "volatile", "__restrict__"))
    if base not in SCALAR_TYPES:
        raise ValueError(f"kernel {kernel}: parameter {name!r} has type {ctype!r}; entry points take "
                         f"pointers and plain scalars ({', '.join(sorted(SCALAR_TYPES))})")
    return Param(ctype, name, False, SCALAR_TYPES[base])


def parse_kernels(src: str) -> list[KernelSig]:
    clean = strip_comments(src)
    out = []
    for m in _KERNEL_RE.finditer(clean):
        name, plist = m.group(1), m.group(2).strip()
        params = () if plist in ("", "void") else tuple(parse_param(p, name) for p in plist.split(","))
        out.append(KernelSig(name, params))
    return out


def parse_extern_shared(src: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for m in _SMEM_RE.finditer(strip_comments(src)):
        ctype, name = " ".join(m.group(1).split()), m.group(2)
        if found.setdefault(name, ctype) != ctype:
            raise ValueError(f"extern __shared__ {name!r} is declared with two types: "
                             f"{found[name]!r} and {ctype!r}")
    return found


def generate_tu(src_path: Path, kernels: list[KernelSig], smem: dict[str, str]) -> str:
    lines = [f"#define EMU_STACK_BYTES {STACK_BYTES}", '#include "cuda_emu.h"', f'#include "{src_path}"', "",
             "// ---- generated by dflash_cupy.backends.emu_build"]
    for name, ctype in smem.items():
        lines.append(f"thread_local __attribute__((aligned(16))) {ctype} {name}"
                     f"[{SMEM_BYTES} / sizeof({ctype})];")
    # Static __shared__ arrays are block-scope thread_locals: the loader reads their
    # offsets in this module's TLS block from the symbol table (see static_shared) and
    # hands them over once; the anchor's address locates the block on each OS thread.
    lines += [
        'extern "C" __attribute__((visibility("hidden"))) thread_local char emu_tls_anchor;',
        "thread_local char emu_tls_anchor;",
        "static unsigned long long emu_static_smem[512];",
        "static int emu_n_static_smem;",
        "static unsigned long long emu_anchor_off;",
        'extern "C" void emu_set_static_smem(const unsigned long long* t, int n, unsigned long long anchor) {',
        "    if (n > 256) n = 256;",
        "    for (int i = 0; i < 2 * n; i++) emu_static_smem[i] = t[i];",
        "    emu_anchor_off = anchor;",
        "    emu_n_static_smem = n;",
        "}",
        "EMU_INTERNAL static void emu_poison_smem(unsigned n) {",
        "    if (n > %d) n = %d;" % (SMEM_BYTES, SMEM_BYTES),
    ]
    for name in smem:
        lines.append(f"    __builtin_memset((void*){name}, 0xff, n);")
        lines.append(f"    emu::note_shared((const void*){name}, n);")
    lines += [
        "    char* tls = &emu_tls_anchor - emu_anchor_off;",
        "    for (int i = 0; i < emu_n_static_smem; i++) {",
        "        __builtin_memset(tls + emu_static_smem[2 * i], 0xff, emu_static_smem[2 * i + 1]);",
        "        emu::note_shared(tls + emu_static_smem[2 * i], emu_static_smem[2 * i + 1]);",
        "    }",
        "}",
    ]
    for i, k in enumerate(kernels):
        args = ", ".join(f"*({p.ctype}*)a[{j}]" for j, p in enumerate(k.params))
        lines.append(f"static void emu_tramp_{i}(void** a) {{ (void)a; {k.name}({args}); }}")
    lines.append("static void (*const emu_tramps[])(void**) = {"
                 + ", ".join(f"emu_tramp_{i}" for i in range(len(kernels))) + "};")
    lines.append('extern "C" int emu_launch(int k, void** args, const unsigned* grid, const unsigned* block,')
    lines.append("        unsigned shmem, unsigned long long seed, int order, unsigned long long first,")
    lines.append("        unsigned long long stride, void* stack_base, int stack_count, unsigned long long stack_stride,")
    lines.append("        const unsigned long long* ranges, const char* const* names, int nranges,")
    lines.append("        char* err, int errlen, void** fault_addr, int* fault_sig) {")
    lines.append("    return emu::launch(emu_tramps[k], args, grid, block, emu_poison_smem, shmem, seed, order,")
    lines.append("                       first, stride, stack_base, stack_count, stack_stride, ranges, names,")
    lines.append("                       nranges, err, errlen, fault_addr, fault_sig);")
    lines.append("}")
    return "\n".join(lines) + "\n"


def static_shared(so_path: Path) -> tuple[int, list[tuple[int, int, str]]]:
    """(anchor offset, [(offset, size, symbol)]) of the static ``__shared__`` arrays in
    a built module: block-scope thread_locals (``_ZZ`` symbols of type TLS), except the
    emulator's own (``_ZZN3emu``)."""
    r = subprocess.run([os.environ.get("DFLASH_CUPY_READELF", "readelf"), "-sW", str(so_path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise CompileError(f"readelf failed on {so_path}: {r.stderr.strip()}")
    anchor, out = None, []
    for line in r.stdout.splitlines():
        f = line.split()
        if len(f) < 8 or f[3] != "TLS" or f[6] == "UND":
            continue
        value, size, name = int(f[1], 16), int(f[2], 0), f[7]
        if name == "emu_tls_anchor":
            anchor = value
        elif name.startswith("_ZZ") and not name.startswith("_ZZN3emu") and size > 0:
            out.append((value, size, name))
    if anchor is None:
        raise CompileError(f"{so_path}: no emu_tls_anchor symbol (built by another emu_build?)")
    return anchor, sorted(set(out))


def load_static_shared(lib, so_path: Path) -> None:
    """Hands the module its static ``__shared__`` table, so they are poisoned before each block."""
    lines = (Path(so_path).parent / STATIC_SMEM_FILE).read_text().split()
    anchor, vals = int(lines[0]), [int(v) for v in lines[1:]]
    arr = (ctypes.c_ulonglong * max(1, len(vals)))(*vals)
    lib.emu_set_static_smem.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong)
    lib.emu_set_static_smem(arr, len(vals) // 2, anchor)


def cache_dir() -> Path:
    d = Path(os.environ.get("DFLASH_CUPY_EMU_CACHE",
                            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                            / "dflash_cupy" / "emu"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _header_digest(include_dirs: list[str]) -> str:
    h = hashlib.sha256()
    for d in [str(EMU_DIR), str(EMU_DIR / "include")] + include_dirs:
        p = Path(d)
        if p.is_dir():
            for f in sorted(p.iterdir()):
                if f.suffix in (".h", ".cuh", ".hpp") and f.is_file():
                    h.update(f.name.encode())
                    h.update(f.read_bytes())
    return h.hexdigest()


class CompileError(RuntimeError):
    pass


def build(source: str, options, filename: str | None):
    """Compile ``source`` for the emulator; returns (path of .so, kernel signatures)."""
    defines, includes = [], []
    opts = list(options)
    i = 0
    while i < len(opts):
        o = opts[i]
        if o in ("-D", "-I") and i + 1 < len(opts):
            o = o + opts[i + 1]
            i += 1
        if o.startswith("-D"):
            defines.append(o)
        elif o.startswith("-I"):
            includes.append(o[2:])
        elif o.startswith("--include-path="):
            includes.append(o.split("=", 1)[1])
        i += 1  # NVRTC-only flags (-ftz, --std, arch) have no meaning here
    kernels = parse_kernels(source)
    smem = parse_extern_shared(source)
    fname = filename or "<source>.cu"
    flags = _flags()
    key = hashlib.sha256("\0".join([source, fname, *defines, *includes, CXX, *flags, GEN_VERSION,
                                    _header_digest(includes)]).encode()).hexdigest()[:24]
    d = cache_dir() / key
    so = d / "module.so"
    if so.exists():
        return so, kernels
    tmp = Path(tempfile.mkdtemp(prefix=key + ".", dir=cache_dir()))
    src_copy = tmp / (Path(fname).name or "source.cu")
    # #line makes g++ name the original file and line in its messages.
    src_copy.write_text(f'#line 1 "{fname}"\n' + source)
    tu = tmp / "launch.cpp"
    tu.write_text(generate_tu(src_copy, kernels, smem))
    cmd = [CXX, *flags, f"-I{EMU_DIR}", f"-I{EMU_DIR / 'include'}",
           *[f"-I{p}" for p in includes], *defines, str(tu), "-o", str(tmp / "module.so")]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        msg = r.stderr.strip()
        raise CompileError(f"g++ failed to compile {fname} for the emulator:\n{msg}\n"
                           f"(command: {' '.join(shlex.quote(c) for c in cmd)})")
    try:
        anchor, smem_vars = static_shared(tmp / "module.so")
    except CompileError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / STATIC_SMEM_FILE).write_text(" ".join(str(v) for v in
                                                 [anchor, *(x for off, size, _ in smem_vars for x in (off, size))]))
    try:
        os.replace(tmp, d)
    except OSError:  # another process built the same module first
        shutil.rmtree(tmp, ignore_errors=True)
    return so, kernels
