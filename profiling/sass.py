"""What ptxas made: the SASS of a kernel, read for the facts that decide its speed.

    python -m profiling.sass --drafter h4096 --window 2048            # every launch of the step
    python -m profiling.sass --file gemm_stream.cu -D GS_K=4096 ...   # one build
    python -m profiling.sass ... --dump DIR                           # the annotated SASS too

A source is compiled to a cubin with the NVRTC the product uses (the CuPy
backend's flags, ``nvrtc_info.nvrtc_options``, plus ``-lineinfo``, which does
not change the code), disassembled with ``nvdisasm`` (the
``nvidia-cuda-nvdisasm`` wheel, found by ``cuda.pathfinder``) and parsed with
each instruction's control word. The control word is what the hardware obeys:
a variable-latency instruction (a global or shared load, ``LDC``, ``S2R``)
sets a write scoreboard (0-5), and the first instruction that needs its result
waits on that scoreboard. So, per kernel, without a GPU:

* **loops**: back edges; a loop's body is the address range of the jump back
  (ptxas lays loops out contiguously); the innermost loops are the steady states;
* **loads in flight**: the body is replayed in address order (two passes, so
  a load issued for the next iteration stays in flight across the back edge)
  with a set of outstanding global loads; each wait retires the loads of its
  scoreboards (``DEPBAR.LE SBk, n`` the oldest until n remain). The peak bytes
  outstanding per thread is what Little's law needs; a wait that retires a
  global load is a **round trip** (a dependent chain is a run of them);
* **trip counts** where the loop compares its counter with an immediate
  (``ISETP ... Rc, imm`` feeding the back edge, ``Rc`` stepped by an immediate
  in the body and set by an immediate before it), else None;
* barriers (``BAR``), fences (``MEMBAR``/``FENCE``), atomics, issue slots.

``facts(file, defines)`` returns a ``KernelSass`` per kernel; the cubin and its
disassembly are cached on disk beside the NVRTC resources (keyed as those are:
source, headers, options, architecture, NVRTC version). What it cannot see:
anything decided at run time (a data-dependent branch is read as taken in
address order), and the memory system's answer (latency and bandwidth are
``hw_params``'s).
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from dflash_cupy import kernels
from dflash_cupy.backends import nvrtc_info

_SASS_VERSION = "1"


class SassUnavailable(RuntimeError):
    """nvdisasm or NVRTC's cubin output is not available on this machine."""


# ----------------------------------------------------------------------------- build
@functools.lru_cache(maxsize=1)
def nvdisasm_path() -> str:
    env = os.environ.get("DFLASH_CUPY_NVDISASM")
    if env:
        return env
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
        p = find_nvidia_binary_utility("nvdisasm")
    except Exception:
        p = None
    if not p:
        raise SassUnavailable("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the 'test' / "
                              "'bench' extras), or set DFLASH_CUPY_NVDISASM")
    return p


def compile_cubin(source: str, filename: str, options: Sequence[str], arch: str) -> bytes:
    """NVRTC's cubin of ``source`` (the backends' options, ``-lineinfo`` added): the very
    compile whose resources the emulator checks, shared through ``nvrtc_info``'s cache."""
    elf = nvrtc_info.cached_cubin(source, filename, options, arch)
    if elf is None:
        raise SassUnavailable(f"{filename}: libnvrtc's cubin calls cannot be loaded (cuda-pathfinder "
                              "finds no libnvrtc)")
    return elf


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([nvdisasm_path(), "-c", "-hex", "-g", f.name], capture_output=True, text=True)
    if r.returncode != 0:
        raise SassUnavailable(f"nvdisasm failed: {r.stderr.strip()[:500]}")
    return r.stdout


def sass_of_source(source: str, filename: str, options: Sequence[str] = (), arch: str | None = None) -> str:
    """The annotated disassembly of ``source`` built with ``options`` (cached on disk)."""
    arch = arch or nvrtc_info.declared_arch(source) or nvrtc_info.ARCH
    key = nvrtc_info.cache_key(source, filename, options, arch)
    cache = nvrtc_info.cache_root().parent / "sass"
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{key}-{_SASS_VERSION}.sass"
    try:
        return out.read_text()
    except OSError:
        pass
    text = disassemble(compile_cubin(source, filename, options, arch))
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=out.stem, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, out)  # atomic: concurrent test workers see all or nothing
    return text


def sass_text(file: str, defines: dict, arch: str | None = None) -> str:
    """The annotated disassembly of ``cuda_src/<file>`` built with ``defines``."""
    path = kernels.source_path(file)
    return sass_of_source(path.read_text(), str(path), kernels.compile_options(**defines), arch)


# ----------------------------------------------------------------------------- parse
@dataclass(frozen=True)
class Instr:
    addr: int
    pred: str            # "@P0", "@!P1" or ""
    op: str              # with its modifiers: "LDG.E.128.CONSTANT"
    operands: str
    stall: int
    wbar: int            # write scoreboard set (7: none)
    rbar: int            # read scoreboard set (7: none)
    wait: int            # scoreboards waited on (bit mask)
    src: tuple           # (file name, line) of the source, or ("", 0)
    target: int | None = None   # a branch's target address

    @property
    def base(self) -> str:
        return self.op.split(".", 1)[0]

    @property
    def mods(self) -> tuple:
        return tuple(self.op.split(".")[1:])


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;\s*/\*\s*0x([0-9a-f]{16})\s*\*/")
_HI = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
_LINE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
_FUNC = re.compile(r"^//-+ \.text\.(\S+)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def parse(text: str) -> dict[str, list[Instr]]:
    """Kernel name -> its instructions in address order, control words decoded
    (bits 105-127: stall 4, yield 1, write barrier 3, read barrier 3, wait mask 6, reuse 4)."""
    funcs: dict[str, list] = {}
    labels: dict[str, dict[str, int]] = {}
    cur = None
    src = ("", 0)
    pending = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            labels[cur] = {}
            continue
        if cur is None:
            continue
        m = _LINE.match(line)
        if m:
            src = (Path(m.group(1)).name, int(m.group(2)))
            continue
        m = _LABEL.match(line)
        if m:
            labels[cur][m.group(1)] = None  # resolved to the next instruction's address
            pending = (pending or []) + [m.group(1)]
            continue
        m = _INSTR.match(line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending or ():
                labels[cur][lab] = addr
            pending = None
            funcs[cur].append([addr, (m.group(2) or "").strip(), m.group(3), m.group(4), src])
            continue
        m = _HI.match(line)
        if m and funcs[cur] and len(funcs[cur][-1]) == 5:
            funcs[cur][-1].append(int(m.group(1), 16))
    out: dict[str, list[Instr]] = {}
    for name, rows in funcs.items():
        end = (rows[-1][0] + 16) if rows else 0
        instrs = []
        for row in rows:
            addr, pred, op, operands, s = row[:5]
            hi = row[5] if len(row) > 5 else 0
            ctrl = hi >> 41
            t = _TARGET.search(operands)
            target = None
            if t:
                target = labels[name].get(t.group(1))
                if target is None:
                    target = end
            instrs.append(Instr(addr, pred, op, operands, ctrl & 0xF, (ctrl >> 5) & 7, (ctrl >> 8) & 7,
                                (ctrl >> 11) & 0x3F, s, target))
        out[name] = instrs
    return out


# ----------------------------------------------------------------------------- classify
_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def access_bytes(ins: Instr) -> int:
    for m in ins.mods:
        if m in _WIDTH:
            return _WIDTH[m]
    return 4


def is_global_load(ins: Instr) -> bool:
    return ins.base in ("LDG", "LD") or (ins.base == "LDGSTS")


def is_shared_load(ins: Instr) -> bool:
    return ins.base in ("LDS", "LDSM")


def is_atomic(ins: Instr) -> bool:
    """A global (or generic) atomic: its result, or its ordering, comes back from the L2.
    Shared-memory atomics (ATOMS) stay in the SM: issue slots only."""
    return ins.base in ("ATOM", "ATOMG", "RED", "REDG")


def is_fence(ins: Instr) -> bool:
    """A fence that waits on the L2: MEMBAR at GPU or system scope (``__threadfence``,
    ``fence.acq_rel.gpu``, the release half of ``atom.acq_rel.gpu``). A CTA-scope MEMBAR
    (``__threadfence_block``, the generic half of ``fence.proxy.async``) and the proxy
    fences (FENCE.VIEW.ASYNC) order within the SM: issue slots only."""
    return ins.base == "MEMBAR" and ("GPU" in ins.mods or "SYS" in ins.mods)


def is_barrier(ins: Instr) -> bool:
    return ins.base == "BAR"


_DEPBAR = re.compile(r"SB(\d)\s*,\s*(0x[0-9a-f]+|\d+)")


# ----------------------------------------------------------------------------- loops
_ENDS = ("BRA", "EXIT", "RET", "BRX", "JMP", "JMX", "KILL")


def basic_blocks(instrs: list[Instr]) -> tuple[list[tuple[int, int]], dict[int, list[int]]]:
    """Blocks as (first, last) indexes into ``instrs`` and the successors of each block."""
    if not instrs:
        return [], {}
    index = {ins.addr: k for k, ins in enumerate(instrs)}
    leaders = {0}
    for k, ins in enumerate(instrs):
        if ins.base in _ENDS:
            if k + 1 < len(instrs):
                leaders.add(k + 1)
            if ins.target is not None and ins.target in index:
                leaders.add(index[ins.target])
    starts = sorted(leaders)
    blocks = [(s, (starts[n + 1] - 1) if n + 1 < len(starts) else len(instrs) - 1) for n, s in enumerate(starts)]
    block_of = {s: n for n, (s, _) in enumerate(blocks)}
    succ: dict[int, list[int]] = {}
    for n, (s, e) in enumerate(blocks):
        last = instrs[e]
        out = []
        if last.base == "BRA" and last.target in index:
            out.append(block_of[index[last.target]])
        conditional = bool(last.pred) and last.pred not in ("@PT", "@UPT")
        if (last.base not in _ENDS or conditional) and n + 1 < len(blocks):
            out.append(n + 1)
        succ[n] = out
    return blocks, succ


def _sccs(nodes: set, succ: dict[int, list[int]]) -> list[set]:
    """Strongly connected components of the subgraph on ``nodes`` (iterative Tarjan)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on.add(v)
            nxt = [w for w in succ.get(v, ()) if w in nodes]
            if i < len(nxt):
                work.append((v, i + 1))
                w = nxt[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                out.append(comp)
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
    return out


@dataclass
class Loop:
    head: int            # address of the header block's first instruction
    tail: int            # address of the last branch back to it
    addrs: frozenset = frozenset()   # every instruction address of the natural loop
    depth: int = 0       # 0: outermost
    inner: bool = True   # contains no other loop
    trips: int | None = None
    # per iteration of the steady state (the body's second replay)
    instructions: int = 0
    global_loads: int = 0
    global_bytes: int = 0
    coherent_bytes: int = 0      # of global_bytes: L2-coherent loads (ld.cg: LDG.STRONG.GPU)
    evict_first_bytes: int = 0   # of global_bytes: evict-first loads (ld.cs: LDG.EF), a weight stream
    wide_loads: int = 0          # 16-byte global loads
    shared_loads: int = 0
    round_trips: int = 0         # waits that retire a global load
    peak_inflight_bytes: int = 0  # per thread, global loads issued and not yet waited on
    peak_inflight_loads: int = 0
    barriers: int = 0
    fences: int = 0
    atomics: int = 0
    lines: tuple = ()            # the source lines of its global loads

    def body(self, instrs):
        return [i for i in instrs if i.addr in self.addrs]

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "addrs"}
        d["lines"] = [f"{f}:{n}" for f, n in self.lines]
        return d


def find_loops(instrs: list[Instr]) -> list[Loop]:
    """The loop forest: each strongly connected region of the control-flow graph is a loop
    (irreducible ones too: ptxas rotates loops and enters some in the middle), its header
    the lowest-addressed block entered from outside; its inner loops are the regions left
    once the edges back to the header are cut."""
    blocks, succ = basic_blocks(instrs)
    preds = {k: [] for k in range(len(blocks))}
    for a, bs in succ.items():
        for b in bs:
            preds[b].append(a)
    loops = []

    def visit(nodes: set, cut: set, depth: int):
        sub = {a: [b for b in succ[a] if (a, b) not in cut] for a in nodes}
        for comp in _sccs(nodes, sub):
            if len(comp) == 1:
                (v,) = comp
                if v not in sub[v]:
                    continue
            entries = [v for v in comp if any(p not in comp for p in preds[v])] or list(comp)
            h = min(entries)
            back = {(a, h) for a in comp if h in sub[a]}
            tail = max(instrs[blocks[a][1]].addr for a, _ in back) if back else instrs[blocks[h][1]].addr
            addrs = frozenset(instrs[k].addr for b in comp for k in range(blocks[b][0], blocks[b][1] + 1))
            loops.append(Loop(instrs[blocks[h][0]].addr, tail, addrs, depth))
            visit(comp, cut | back | {(a, b) for a in comp for b in sub[a] if b == h}, depth + 1)

    visit(set(range(len(blocks))), set(), 0)
    # the trap after EXIT (a branch to itself) is no loop of the kernel's
    loops = [l for l in loops if any(i.addr in l.addrs and i.base not in ("BRA", "NOP") for i in instrs)]
    loops.sort(key=lambda l: (l.head, l.depth))
    for a in loops:
        a.inner = not any(b is not a and b.addrs < a.addrs for b in loops)
    return loops


@dataclass
class Replay:
    """What one pass over a straight run of instructions saw."""
    instructions: int = 0
    global_loads: int = 0
    global_bytes: int = 0
    coherent_bytes: int = 0
    evict_first_bytes: int = 0
    wide_loads: int = 0
    shared_loads: int = 0
    round_trips: int = 0
    peak_inflight_bytes: int = 0
    peak_inflight_loads: int = 0
    barriers: int = 0
    fences: int = 0
    atomics: int = 0
    lines: list = field(default_factory=list)


def replay(run: list[Instr], outstanding: list | None = None, t0: int = 0) -> tuple[Replay, list, int]:
    """Replay ``run`` in order with ``outstanding`` global loads ([(scoreboard, bytes, issued at)],
    oldest first) in flight at its start, on a clock that counts memory round trips: a load
    issued at time t completes at t + 1, a wait moves the clock to the completion of the loads
    it retires, nothing else moves it. Returns what it saw, what is still in flight, and the
    clock at the end (``round_trips`` = end - ``t0``: the dependent chain of the run)."""
    out = list(outstanding or [])
    r = Replay()
    t = t0

    def retire(keep_if):
        nonlocal out, t
        done = [o for o in out if not keep_if(o)]
        if done:
            t = max(t, max(o[2] for o in done) + 1)
        out = [o for o in out if keep_if(o)]

    for ins in run:
        r.instructions += 1
        if ins.wait:
            retire(lambda o: not (ins.wait >> o[0] & 1))
        if ins.base == "DEPBAR":
            m = _DEPBAR.search(ins.operands)
            if m:   # DEPBAR.LE SBk, n: the oldest of scoreboard k until n remain (cp.async groups: k = 0)
                sb, n = int(m.group(1)), int(m.group(2), 0)
                mine = [o for o in out if o[0] == sb or (sb == 0 and o[0] == 6)]
                drop = {id(o) for o in mine[:max(0, len(mine) - n)]}
                retire(lambda o: id(o) not in drop)
        if is_global_load(ins):
            nbytes = access_bytes(ins)
            r.global_loads += 1
            r.global_bytes += nbytes
            r.coherent_bytes += nbytes if "STRONG" in ins.mods else 0
            r.evict_first_bytes += nbytes if "EF" in ins.mods else 0
            r.wide_loads += nbytes == 16
            r.lines.append(ins.src)
            if ins.wbar < 6:
                out.append((ins.wbar, nbytes, t))
            elif ins.base == "LDGSTS":
                out.append((6, nbytes, t))  # retired by DEPBAR.LE SB0 on its commit group
        elif is_shared_load(ins):
            r.shared_loads += 1
        elif is_barrier(ins):
            r.barriers += 1
        elif is_fence(ins):
            r.fences += 1
        elif is_atomic(ins):
            r.atomics += 1
        inflight = sum(o[1] for o in out)
        r.peak_inflight_bytes = max(r.peak_inflight_bytes, inflight)
        r.peak_inflight_loads = max(r.peak_inflight_loads, len(out))
    # what is still in flight at the end is waited for by whatever follows (EXIT waits for all)
    r.round_trips = t - t0
    return r, out, t


def _imm(x: str) -> int | None:
    if x == "RZ":
        return 0
    return int(x, 0) if re.fullmatch(r"-?0x[0-9a-f]+|-?\d+", x) else None


def _trip_count(instrs: list[Instr], loop: Loop) -> int | None:
    """Trips of a loop whose back edge tests a counter against an immediate, the counter
    stepped by an immediate in the body and set by an immediate (or RZ) before the head."""
    body = loop.body(instrs)
    br = body[-1]
    if br.base != "BRA" or not br.pred:
        return None
    p = br.pred.lstrip("@!")
    setp = next((i for i in reversed(body[:-1]) if i.base in ("ISETP",) and i.operands.startswith(p + ",")), None)
    if setp is None:
        return None
    ops = [o.strip() for o in setp.operands.split(",")]
    if len(ops) < 4:
        return None
    reg, bound = ops[2].replace(".reuse", ""), ops[3]
    if not re.fullmatch(r"R\d+", reg) or not re.fullmatch(r"-?0x[0-9a-f]+|-?\d+", bound):
        return None
    bound = int(bound, 0)
    step = None
    for i in body:
        if i.base in ("IADD3", "VIADD") and i.operands.split(",")[0].strip() == reg:
            o = [x.strip().replace(".reuse", "") for x in i.operands.split(",")]
            imms = [x for x in o[1:] if re.fullmatch(r"-?0x[0-9a-f]+|-?\d+", x)]
            if reg in o[1:] and len(imms) == 1:
                step = int(imms[0], 0)
    if not step:
        return None
    init = None
    for i in instrs:   # the last write of the counter before the loop's head, in address order
        if i.addr >= loop.head:
            break
        o = [x.strip().replace(".reuse", "") for x in i.operands.split(",")]
        if not o or not o[0]:
            continue
        dst = o[0]
        writes = dst == reg or (i.base == "CS2R" and re.fullmatch(r"R\d+", dst)
                                and int(reg[1:]) in (int(dst[1:]), int(dst[1:]) + 1))
        if not writes:
            continue
        init = None
        if i.base == "CS2R" and o[1:] == ["SRZ"]:
            init = 0
        elif i.base == "MOV" and len(o) == 2:
            init = _imm(o[1])
        elif i.op.startswith("IMAD.MOV") and len(o) == 4 and o[1] == "RZ" and o[2] == "RZ":
            init = _imm(o[3])
    if init is None:
        return None
    cmp = setp.mods
    if (bound - init) / step <= 0:
        return None
    if "NE" in cmp or "LT" in cmp or "GT" in cmp:
        trips = -(-(bound - init) // step)
    elif "LE" in cmp or "GE" in cmp:
        trips = (bound - init) // step + 1
    else:
        return None
    return int(trips) if trips > 0 else None


# ----------------------------------------------------------------------------- per kernel
@dataclass
class KernelSass:
    name: str
    instructions: int
    loops: list
    straight: Replay      # everything outside loops, replayed once in address order
    global_loads: int     # static count
    wide_loads: int
    barriers: int
    fences: int
    atomics: int
    instrs: list = field(repr=False, default_factory=list)

    def as_dict(self) -> dict:
        return {"name": self.name, "instructions": self.instructions, "global_loads": self.global_loads,
                "wide_loads": self.wide_loads, "barriers": self.barriers, "fences": self.fences,
                "atomics": self.atomics, "straight": {k: v for k, v in self.straight.__dict__.items()
                                                      if k != "lines"},
                "loops": [l.as_dict() for l in self.loops]}


def analyse(name: str, instrs: list[Instr]) -> KernelSass:
    """Per loop, per iteration of its steady state: the loop's own instructions (not those of
    the loops inside it, which count as their own iterations) replayed twice for round trips,
    loads and issue slots; the whole body (inner loops once) for the peak bytes in flight."""
    loops = find_loops(instrs)
    for l in loops:
        inner = set().union(*[c.addrs for c in loops if c is not l and c.addrs < l.addrs])
        own = [i for i in instrs if i.addr in l.addrs and i.addr not in inner]
        first, carry, t1 = replay(own)
        steady, _, _ = replay(own, carry, t1)
        for k in ("instructions", "global_loads", "global_bytes", "coherent_bytes", "evict_first_bytes",
                  "wide_loads", "shared_loads", "round_trips",
                  "barriers", "fences", "atomics"):
            setattr(l, k, getattr(steady, k))
        body = l.body(instrs)
        b1, carry, t1 = replay(body)
        b2, _, _ = replay(body, carry, t1)
        l.peak_inflight_bytes = max(b1.peak_inflight_bytes, b2.peak_inflight_bytes)
        l.peak_inflight_loads = max(b1.peak_inflight_loads, b2.peak_inflight_loads)
        l.lines = tuple(sorted(set(steady.lines)))
        l.trips = _trip_count(instrs, l)
    in_loop = [any(i.addr in l.addrs for l in loops) for i in instrs]
    straight, _, _ = replay([i for i, inl in zip(instrs, in_loop) if not inl])
    return KernelSass(name, len(instrs), loops, straight,
                      sum(is_global_load(i) for i in instrs), sum(is_global_load(i) and access_bytes(i) == 16
                                                                  for i in instrs),
                      sum(is_barrier(i) for i in instrs), sum(is_fence(i) for i in instrs),
                      sum(is_atomic(i) for i in instrs), instrs)


def analyse_text(text: str) -> dict[str, KernelSass]:
    return {name: analyse(name, ins) for name, ins in parse(text).items()}


# The analyses of the last disassemblies read, by their text: a step's layers launch the same
# few builds again and again (the model table's 136 launches are 18 builds), and the parse
# and replays are pure functions of the text. Callers only read a KernelSass.
_analysed = functools.lru_cache(maxsize=24)(analyse_text)


def facts(file: str, defines: dict, arch: str | None = None) -> dict[str, KernelSass]:
    """``{kernel: KernelSass}`` of ``cuda_src/<file>`` built with ``defines``."""
    return _analysed(sass_text(file, defines, arch))


def launch_facts(launch) -> KernelSass:
    """The SASS facts of one recorded launch (``step_trace.Launch``)."""
    return facts(launch.file, launch.defines)[launch.kernel]


# ----------------------------------------------------------------------------- report
def describe(k: KernelSass) -> str:
    lines = [f"{k.name}: {k.instructions} instructions, {k.global_loads} global loads "
             f"({k.wide_loads} x 16 B), {k.barriers} BAR, {k.fences} fences, {k.atomics} atomics",
             f"  outside loops: {k.straight.global_loads} global loads in {k.straight.round_trips} round trips, "
             f"peak {k.straight.peak_inflight_bytes} B in flight"]
    for l in k.loops:
        where = ", ".join(f"{f}:{n}" for f, n in l.lines[:4]) + (" ..." if len(l.lines) > 4 else "")
        lines.append(f"  {'  ' * l.depth}loop {l.head:#06x}-{l.tail:#06x}{' (inner)' if l.inner else ''}: "
                     f"trips {l.trips if l.trips is not None else '?'}, {l.instructions} instr, "
                     f"{l.global_loads} LDG ({l.global_bytes} B), {l.round_trips} round trips, "
                     f"peak {l.peak_inflight_bytes} B / {l.peak_inflight_loads} loads in flight, "
                     f"{l.barriers} BAR, {l.fences} fences, {l.atomics} atomics  [{where}]")
    return "\n".join(lines)


def _parse_defines(items: Sequence[str]) -> dict:
    out = {}
    for it in items:
        k, _, v = it.partition("=")
        try:
            out[k] = int(v, 0) if v else 1
        except ValueError:   # a float size (e.g. SEL_MULT=0.196)
            out[k] = float(v)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", help="cuda_src file (with -D); else every launch of a drafter's step")
    ap.add_argument("-D", action="append", default=[], help="NAME=VALUE compile-time size")
    ap.add_argument("--drafter", default="h4096")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--lm-head", type=int, default=None)
    ap.add_argument("--dump", type=Path, help="write each build's annotated SASS here")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    builds = []
    if a.file:
        builds.append((a.file, _parse_defines(a.D), None, None))
    else:
        from .common import drafter_config
        from .step_trace import Launch, node_label, trace_step
        plan = trace_step(drafter_config(a.drafter), a.window, lm_head_vocab=a.lm_head)
        seen = {}
        for n in plan.nodes:
            if isinstance(n, Launch):
                key = (n.file, n.kernel, tuple(sorted(n.defines.items())))
                if key not in seen:
                    seen[key] = n
                    builds.append((n.file, dict(n.defines), n.kernel, node_label(n)))
    report = []
    for file, defines, kernel, label in builds:
        text = sass_text(file, defines)
        if a.dump:
            a.dump.mkdir(parents=True, exist_ok=True)
            tag = "_".join(f"{k}{v}" for k, v in sorted(defines.items()))[:120]
            (a.dump / f"{Path(file).stem}_{tag}.sass").write_text(text)
        for name, k in analyse_text(text).items():
            if kernel is not None and name != kernel:
                continue
            report.append({"file": file, "defines": defines, "label": label, **k.as_dict()})
            if not a.json:
                print(f"== {label or file} {file} {' '.join(f'{x}={y}' for x, y in sorted(defines.items()))}")
                print(describe(k))
    if a.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
