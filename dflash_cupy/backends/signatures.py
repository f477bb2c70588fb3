"""Kernel entry points as both backends see them: the ``extern "C" __global__``
functions of a CUDA C source and their parameters, parsed from the text.

The CuPy backend checks launch arguments against these signatures (CuPy would
pass a Python ``int`` as 64 bits and launch with a wrong argument count); the
emulator also generates one trampoline per kernel from them (``dflash_cupy/emu/build.py``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# C scalar types a kernel may take by value -> the NumPy dtype an argument must have
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
