"""Kernel entry points as both backends see them: the ``extern "C" __global__``
functions of a CUDA C source and their parameters, parsed from the text.

The CuPy backend checks launch arguments against these signatures (CuPy would
pass a Python ``int`` as 64 bits and launch with a wrong argument count); the
emulator also generates one trampoline per kernel from them (``dflash_cupy/emu/build.py``).

A kernel may also take a plain struct by value (``struct GemmStreamParams {...};``
defined in the source, fields pointers and scalars as above): its ``Param`` has
``fields``, the argument is a mapping from field name to value, and ``leaves``
yields every (pointer or scalar parameter, argument) pair of a launch, struct
fields included, so access intent (``const T*``), hazard tracking and launch
checks see a struct's pointers as they see plain pointer parameters.
``pack_struct`` lays the value out as C does (a NumPy aligned structured
scalar, which CuPy and ``cuLaunchKernelEx`` pass as bytes).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

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
    fields: tuple["Param", ...] | None = None   # a struct passed by value: its members, in order

    @property
    def is_struct(self) -> bool:
        return self.fields is not None

    @property
    def read_only(self) -> bool:
        """A ``const T*`` pointer (const before the ``*``): the kernel only reads it."""
        return self.is_pointer and "const" in self.ctype.split("*")[0].split()

    def struct_dtype(self) -> np.dtype:
        """The struct's C layout: pointers as uint64, scalars their dtype, C alignment."""
        if self.fields is None:
            raise TypeError(f"parameter {self.name!r} is not a struct")
        return np.dtype([(f.name, np.uint64 if f.is_pointer else np.dtype(f.dtype)) for f in self.fields],
                        align=True)


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


_STRUCT_RE = re.compile(r"\bstruct\s+([A-Za-z_]\w*)\s*\{([^{}]*)\}\s*;", re.S)


def parse_structs(clean: str) -> dict:
    """``struct NAME { members; };`` definitions (no nested braces) of a comment-free
    source: name -> the text of its members (parsed when a kernel takes the struct)."""
    return {m.group(1): m.group(2) for m in _STRUCT_RE.finditer(clean)}


def struct_fields(name: str, body: str) -> tuple:
    """A kernel parameter struct's members: pointers and plain scalars, one per declaration."""
    members = [d.strip() for d in body.split(";") if d.strip()]
    if not members:
        raise ValueError(f"struct {name}: a kernel parameter struct needs members")
    return tuple(parse_param(d, f"struct {name}") for d in members)


def parse_param(text: str, kernel: str, structs: dict | None = None) -> Param:
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
    if structs and base in structs:
        return Param(ctype, name, False, None, struct_fields(base, structs[base]))
    if base not in SCALAR_TYPES:
        raise ValueError(f"kernel {kernel}: parameter {name!r} has type {ctype!r}; entry points take "
                         f"pointers, plain scalars ({', '.join(sorted(SCALAR_TYPES))}) and structs of "
                         f"them defined in the source")
    return Param(ctype, name, False, SCALAR_TYPES[base])


def parse_kernels(src: str) -> list[KernelSig]:
    clean = strip_comments(src)
    structs = parse_structs(clean)
    out = []
    for m in _KERNEL_RE.finditer(clean):
        name, plist = m.group(1), m.group(2).strip()
        params = () if plist in ("", "void") else tuple(parse_param(p, name, structs) for p in plist.split(","))
        out.append(KernelSig(name, params))
    return out


def leaves(params, args):
    """(parameter, argument) pairs of a launch with each struct argument expanded into its
    fields' pairs (a missing field yields None; ``check_struct_arg`` rejects that first)."""
    for p, a in zip(params, args):
        if p.fields is None:
            yield p, a
        else:
            for f in p.fields:
                yield f, a.get(f.name) if isinstance(a, Mapping) else None


def arg(params, args, name: str):
    """The argument of parameter or struct field ``name`` (struct fields by their own name)."""
    for p, a in leaves(params, args):
        if p.name == name:
            return a
    raise KeyError(f"no parameter or struct field named {name!r}")


def by_name(params, args) -> dict:
    """A launch's arguments keyed by parameter name (a struct argument under its
    parameter's name, as given): what launch observers see."""
    return {p.name: a for p, a in zip(params, args)}


def pack_struct(param: Param, value: Mapping, address) -> np.void:
    """``value`` (field name -> argument) as the struct's bytes: pointers as
    ``address(array)``, scalars as their NumPy value (checked before by
    ``base.check_kernel_args``)."""
    rec = np.zeros((), param.struct_dtype())
    for f in param.fields:
        v = value[f.name]
        rec[f.name] = address(v) if f.is_pointer else v
    return rec[()]
