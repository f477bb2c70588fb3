"""The launches and copies of one drafter step at real shapes, without running it.

``RecordingBackend`` implements the backend seam (``dflash_cupy.backends.base``)
with NumPy arrays that are allocated but never touched (Linux maps their pages
lazily, so a 3.5 GB drafter costs address space, not memory) and kernels that
only record their launch: name, source file, compile-time sizes, grid, block,
dynamic shared memory and arguments. ``DraftKvCache`` runs unchanged on it, so
the recorded step graph is exactly what the product would capture: the same
launcher classes decide grids, tilings and split factors.

``trace_step(config, window)`` builds a cache with ``capacity = window``, plans
the prefill (a bulk append, recorded separately) and one in-graph step, and
returns a ``StepTrace``: the graph's nodes in order (``Launch`` / ``Copy``),
each launch's arrays named after the cache attribute they are (``k_cache[2]``,
``w.layers[0].w_gate_up``, ...).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from dflash_cupy.backends import signatures
from dflash_cupy.backends.base import Backend, CaptureError, Graph, Kernel, Module, dim3, resolve_pdl
from dflash_cupy.config import DraftConfig
from dflash_cupy.weights import DraftWeights

_DEFINE_RE = re.compile(r"^-D(\w+)=(.*)$")
# the stream path's kernels (same arguments: ops/gemm_stream.StreamKernels launches either)
STREAM_GEMMS = ("gemm_stream", "gemm_wgmma")


@dataclass(frozen=True)
class ArrayRef:
    """An array argument: its name in the cache (or ``?``), shape, dtype, bytes, address."""
    name: str
    shape: tuple
    dtype: str
    nbytes: int
    ptr: int


@dataclass
class Launch:
    kernel: str
    file: str
    defines: dict
    grid: tuple
    block: tuple
    shared_mem: int
    # ArrayRef or a Python int/float (the scalar's value); a struct parameter's argument
    # as a dict of its fields (gemm_wgmma's GemmWgmmaParams)
    args: list
    known: dict = field(default_factory=dict)   # device values the plan knows (e.g. "pad_lo": n_new)
    # The recording's arrays themselves (None for scalars): what the host wrote into them
    # by the time of the step (descriptor, positions) is there; an emulated counter run
    # (profiling/emulated_counters.py) starts from it.
    arrays: list = field(default_factory=list, repr=False, compare=False)
    pdl: bool = False     # launched with programmatic stream serialization (PDL)
    names: list = field(default_factory=list)   # the kernel's parameter names (its signature)

    @property
    def n_blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    def arg(self, name: str):
        """The argument of parameter (or struct field) ``name``."""
        P = self.params()
        if name not in P:
            raise KeyError(f"launch of {self.kernel}: no parameter or struct field named {name!r}")
        return P[name]

    def params(self) -> dict:
        """Parameter (and struct field) name -> argument: a struct argument's fields, the
        other arguments by the signature's names (``names``)."""
        out = dict(zip(self.names, self.args))
        for a in self.args:
            if isinstance(a, dict):
                out.update(a)
        return out

    def with_args(self, **changes) -> "Launch":
        """A copy with arguments replaced by name: a parameter of the signature (``names``),
        else a field of the struct argument (added where the recording left it out)."""
        plain = {k: v for k, v in changes.items() if k in self.names}
        fields = {k: v for k, v in changes.items() if k not in plain}
        if fields and sum(isinstance(a, dict) for a in self.args) != 1:
            raise KeyError(f"launch of {self.kernel}: no parameter named {sorted(fields)} and no one struct")
        names = list(self.names) + [None] * (len(self.args) - len(self.names))
        args = [{**a, **fields} if isinstance(a, dict) else plain.get(n, a) for n, a in zip(names, self.args)]
        return dataclasses.replace(self, args=args, known=dict(self.known))

    def leaves(self) -> list:
        """Every argument, a struct's fields in its place."""
        return [v for a in self.args for v in (a.values() if isinstance(a, dict) else (a,))]

    def variant(self) -> tuple:
        """What one compiled kernel is: (file, kernel, sorted defines)."""
        return (self.file, self.kernel, tuple(sorted(self.defines.items())))


@dataclass
class Copy:
    kind: str        # "h2d" | "d2h" | "d2d"
    nbytes: int
    dst: ArrayRef
    src: ArrayRef


def _ref(a) -> ArrayRef:
    return ArrayRef("?", tuple(a.shape), str(a.dtype), int(a.nbytes), int(a.ctypes.data))


class _Stream:
    def __init__(self, be):
        self._be = be
        self.ptr = id(self)

    def synchronize(self):
        self._be._no_capture("stream.synchronize()")

    def is_capturing(self) -> bool:
        return self._be._capturing is self

    def wait_event(self, event):
        pass


class _Event:
    def __init__(self, be):
        self._be = be

    def record(self, stream=None):
        pass

    def synchronize(self):
        self._be._no_capture("event.synchronize()")

    def query(self) -> bool:
        return True


class RecordedGraph(Graph):
    def __init__(self, nodes: list):
        self.nodes = nodes

    def launch(self, stream=None) -> None:
        pass  # nothing to run: the nodes are the product


class _Kernel(Kernel):
    def __init__(self, be, name, file, defines, sig=None):
        self._be, self.name, self.file, self.defines, self.sig = be, name, file, defines, sig

    def __call__(self, grid, block, args: Sequence[Any], shared_mem: int = 0, stream=None, pdl=None):
        be = self._be
        nodes = be._capture_nodes
        pdl = resolve_pdl(pdl, be._capturing is not None and bool(nodes) and isinstance(nodes[-1], Launch),
                          self.name)
        g, b = dim3(grid, f"kernel {self.name}: grid"), dim3(block, f"kernel {self.name}: block")
        def val(a):
            return _ref(a) if isinstance(a, np.ndarray) else a.item()

        def arr(a):
            return a if isinstance(a, np.ndarray) else None
        vals = [{k: val(v) for k, v in a.items()} if isinstance(a, Mapping) else val(a) for a in args]
        arrays = [{k: arr(v) for k, v in a.items()} if isinstance(a, Mapping) else arr(a) for a in args]
        names = [p.name for p in self.sig.params] if self.sig is not None else []
        be._emit(Launch(self.name, self.file, dict(self.defines), g, b, int(shared_mem), vals,
                        arrays=arrays, pdl=pdl, names=names))


class _Module(Module):
    def __init__(self, be, file, defines, sigs=None):
        self._be, self.file, self.defines, self._sigs = be, file, defines, sigs or {}

    def get_function(self, name: str) -> Kernel:
        return _Kernel(self._be, name, self.file, self.defines, self._sigs.get(name))


_SPARSE_COPY_FROM = 64 << 20     # bytes: asarray copies smaller arrays whole
_SPARSE_COPY_CHUNK = 1 << 20     # bytes per chunk tested for zeros


class RecordingBackend(Backend):
    """Backend whose launches and copies are recorded, never run (module docstring)."""

    name = "recording"
    compute_capability = "90"   # it models an H200 (kernels.arch_options asks)

    def __init__(self):
        self._capturing = None
        self._capture_nodes: list | None = None
        self.eager: list = []   # everything issued outside capture (prefill, resets)
        self._current = _Stream(self)

    def _emit(self, node):
        (self._capture_nodes if self._capturing is not None else self.eager).append(node)

    def _no_capture(self, what):
        if self._capturing is not None:
            raise CaptureError(f"{what} during capture")

    # arrays: untouched pages are never committed (zeros, not garbage: a counter run
    # copies the small ones, and the integers in them must be valid)
    def empty(self, shape, dtype):
        self._no_capture("allocation")
        return np.zeros(shape, dtype)

    def zeros(self, shape, dtype):
        self._no_capture("allocation")
        return np.zeros(shape, dtype)

    def asarray(self, host):
        """A copy of ``host``; its all-zero chunks are skipped (the copy starts as zeros), so
        the shape-only weights' matrices (a 152K-row LM head: 1.5 GB of untouched zeros) cost
        a read of the zero page, not 1.5 GB committed and written."""
        self._no_capture("allocation")
        host = np.asarray(host)
        if host.nbytes < _SPARSE_COPY_FROM:
            return np.array(host, copy=True, order="C")
        out = np.zeros(host.shape, host.dtype)
        src, dst = np.ascontiguousarray(host).reshape(-1), out.reshape(-1)
        step = max(1, _SPARSE_COPY_CHUNK // max(1, host.itemsize))
        for i in range(0, src.size, step):
            chunk = src[i:i + step]
            if chunk.view(np.uint8).any():
                dst[i:i + step] = chunk
        return out

    def to_numpy(self, arr, stream=None):
        return np.array(arr)

    def pinned_empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def is_device_array(self, x) -> bool:
        return isinstance(x, np.ndarray)

    def compile(self, source, options=(), filename=None) -> Module:
        defines = {}
        for o in options:
            m = _DEFINE_RE.match(o)
            if m:
                v = m.group(2)
                try:
                    defines[m.group(1)] = int(v)
                except ValueError:
                    defines[m.group(1)] = float(v)
        file = (filename or "?").rsplit("/", 1)[-1]
        return _Module(self, file, defines, {k.name: k for k in signatures.parse_kernels(source)})

    def stream(self):
        return _Stream(self)

    def current_stream(self):
        return self._current

    def as_stream(self, stream):
        if stream is None:
            return self._current
        if not isinstance(stream, _Stream):
            raise TypeError(f"stream must be a recording stream or None, got {type(stream).__name__}")
        return stream

    def event(self):
        return _Event(self)

    def _copy(self, kind, dst, src, nbytes):
        n = src.nbytes if nbytes is None else int(nbytes)
        self._emit(Copy(kind, n, _ref(dst), _ref(src)))
        # Done at issue time, so the device arrays hold what the host sent them (the
        # step's descriptor); nothing else ever writes them here.
        if 0 < n <= min(dst.nbytes, src.nbytes) and dst.flags.c_contiguous and src.flags.c_contiguous:
            ctypes.memmove(dst.ctypes.data, src.ctypes.data, n)

    def copy_h2d_async(self, dst, src, stream=None, nbytes=None):
        self._copy("h2d", dst, src, nbytes)

    def copy_d2h_async(self, dst, src, stream=None, nbytes=None):
        self._copy("d2h", dst, src, nbytes)

    def copy_d2d_async(self, dst, src, stream=None, nbytes=None):
        self._copy("d2d", dst, src, nbytes)

    def synchronize(self):
        self._no_capture("synchronize()")

    def begin_capture(self, stream):
        if self._capturing is not None:
            raise CaptureError("already capturing")
        self._capturing, self._capture_nodes = stream, []

    def end_capture(self, stream):
        if self._capturing is not stream:
            raise CaptureError("end_capture on a stream that is not capturing")
        g = RecordedGraph(self._capture_nodes)
        self._capturing, self._capture_nodes = None, None
        return g

    def is_capturing(self) -> bool:
        return self._capturing is not None


# ---------------------------------------------------------------------------- weights
class _EmptyLayer:
    """``DeviceWeights.layers[i]``'s attributes, bf16 bits, never written."""

    def __init__(self, be, c: DraftConfig, i: int, wdt):
        H = c.hidden_size
        f32 = lambda n: be.empty((n,), np.float32)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = f32(H), f32(H)
        self.q_norm, self.k_norm = f32(c.head_dim), f32(c.head_dim)
        self.w_qkv = be.empty((c.q_dim + 2 * c.kv_dim, H), wdt)
        self.w_kv = self.w_qkv[c.q_dim:]
        self.w_o = be.empty((H, c.q_dim), wdt)
        self.w_gate_up = be.empty((2 * c.intermediate_size, H), wdt)
        self.w_down = be.empty((H, c.intermediate_size), wdt)
        gate_rows = {"none": 0, "head": c.n_head, "element": c.q_dim}[c.attn_gate]
        self.w_attn_gate = be.empty((gate_rows, H), wdt) if gate_rows else None
        self.sliding = c.is_sliding(i)
        self.conv_a_kp = self.conv_a_base = self.conv_m_kp = self.conv_m_base = None
        d2 = c.dflash2
        if d2 is not None:   # DFlash 2: the convolutions' projections and bases
            P = d2.projection_rows(H)
            self.conv_a_kp, self.conv_m_kp = be.empty((P, H), wdt), be.empty((P, H), wdt)
            base = (2, d2.conv_kernel_size, H)
            self.conv_a_base, self.conv_m_base = be.empty(base, np.float32), be.empty(base, np.float32)


class _EmptyDeviceWeights:
    def __init__(self, c: DraftConfig, be, wdt):
        self.config, self.backend = c, be
        H = c.hidden_size
        self.fc = be.empty((H, c.fc_in), wdt)
        self.hidden_norm = be.empty((H,), np.float32)
        self.norm = be.empty((H,), np.float32)
        self.aux_norms = be.empty((c.n_captured, H), np.float32) if c.aux_hidden_norms else None
        self.layers = [_EmptyLayer(be, c, i, wdt) for i in range(c.n_layer)]
        self.selector_hp = self.selector_pred = self.selector_succ = None
        d2 = c.dflash2
        if d2 is not None:   # DFlash 2: the candidate selector's projection and codebooks
            self.selector_hp = be.empty((d2.selector_rank, H), wdt)
            self.selector_pred = be.empty((d2.vocab_size, d2.selector_rank), wdt)
            self.selector_succ = be.empty((d2.vocab_size, d2.selector_rank), wdt)


class ShapeOnlyWeights(DraftWeights):
    """A ``DraftWeights`` with the real layout and dtype and no values."""

    def __init__(self, config: DraftConfig, backend: RecordingBackend, w_dtype=np.uint16):
        self._dev = _EmptyDeviceWeights(config, backend, w_dtype)
        super().__init__(config, {}, placed={backend.name: self._dev})

    def device(self, backend=None):  # the recording backend is not registered in backends.get
        return self._dev


# ---------------------------------------------------------------------------- the step
@dataclass
class StepTrace:
    config: DraftConfig
    window: int
    capacity: int
    q_len: int
    a_step: int
    kv_total: int
    nodes: list                          # the step graph, in order
    prefill: list = field(default_factory=list)   # the bulk append issued by the first begin_step
    cache: Any = None                    # the DraftKvCache (recording backend), for its ops

    @property
    def launches(self) -> list:
        return [n for n in self.nodes if isinstance(n, Launch)]

    @property
    def copies(self) -> list:
        return [n for n in self.nodes if isinstance(n, Copy)]

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)


def node_label(n) -> str:
    """A node's name in the cost model's tables (``perf_model``) and in measured per-kernel
    times (``kernel_times``): the kernel, with a GEMM's weight role (``gemm_stream[gate_up]``),
    or ``memcpy h2d``."""
    if isinstance(n, Copy):
        return f"memcpy {n.kind}"
    if n.kernel in ("gemm", "gemm_stream", "gemm_wgmma"):
        wname = getattr(n.params().get("w"), "name", "?")
        role = wname.rsplit(".", 1)[-1].replace("w_", "") if "." in wname else wname
        return f"{n.kernel}[{role}]"
    return n.kernel


def array_span(a):
    """``(address, nbytes)`` of a NumPy array (the recording and emulated backends'
    device arrays) or a CuPy one; ``None`` for anything else."""
    if isinstance(a, np.ndarray):
        return int(a.ctypes.data), int(a.nbytes)
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    return (int(ptr), int(a.nbytes)) if isinstance(ptr, int) and hasattr(a, "nbytes") else None


def name_arrays(kv) -> dict:
    """(address, nbytes) -> the cache attribute holding that array (any backend's arrays)."""
    names: dict = {}

    def put(name, a):
        span = array_span(a)
        if span is not None:
            names.setdefault(span, name)

    # the facade's views first (their names are the public ones), then its engine's arrays
    for obj in (kv, getattr(kv, "engine", None)):
        for k, v in (vars(obj).items() if obj is not None else ()):
            if array_span(v) is not None:
                put(k, v)
            elif isinstance(v, list):
                for i, a in enumerate(v):
                    put(f"{k}[{i}]", a)
    for gname in ("g_fc", "g_kv", "g_qkv", "g_o", "g_gate_up", "g_down", "g_attn_gate", "g_lm"):
        g = getattr(kv, gname, None)
        if g is not None:
            put(f"{gname}.ws", getattr(g, "_ws", None))
            put(f"{gname}.counters", getattr(g, "_counters", None))
    att = kv.attention
    put("attention.part_o", att.part_o)
    put("attention.part_ml", att.part_ml)
    put("attention.counters", att.counters)
    dw = kv.dw
    for k in ("fc", "hidden_norm", "norm", "aux_norms"):
        put(f"w.{k}", getattr(dw, k))
    for i, L in enumerate(dw.layers):
        for k, v in vars(L).items():
            put(f"w.layers[{i}].{k}", v)
    ring = getattr(kv, "_ring", None)   # a single cache's bound ring (a batch names its storage)
    if ring is not None:
        put("ring.storage", ring.storage)
    put("inv_freq", kv.inv_freq)
    return names


def named(r, names):
    """``r`` (an ArrayRef) under its name in ``names`` (``name_arrays``), or the named array
    holding it; anything else as it is."""
    if isinstance(r, ArrayRef):
        return ArrayRef(names.get((r.ptr, r.nbytes), containing_name(names, r)), r.shape, r.dtype,
                        r.nbytes, r.ptr)
    return r


def _rename(nodes, names):
    fix = functools.partial(named, names=names)
    for n in nodes:
        if isinstance(n, Launch):
            n.args = [{k: fix(v) for k, v in a.items()} if isinstance(a, dict) else fix(a) for a in n.args]
        else:
            n.dst, n.src = fix(n.dst), fix(n.src)


def containing_name(names, r) -> str:
    """A view's name: the named array that holds it, with the byte offset."""
    for (p, nb), name in names.items():
        if p <= r.ptr and r.ptr + r.nbytes <= p + nb:
            return f"{name}+{r.ptr - p}" if r.ptr != p else f"{name}[:{r.nbytes}B]"
    return "?"


def mark_live_tiles(b, nodes, active: int, accept: int) -> None:
    """The step's live 16-row tiles (what ``plan_lanes`` writes at run time: 2 for the packed
    context rows, 1 for the active lanes' noise rows) of the step engine ``b`` (lanes
    ``[0, active)`` each appending ``accept`` rows), written into its recorded ``tile_live``
    (the emulated counters rebuild small arrays from the recording's bytes) and attached to
    each launch that reads them (``known["tile_live"]``; ``known["lanes_app"]``: the planning
    launch's appended rows per lane, ``None`` idle)."""
    CS, BS, L = b.ctx_rows, b.lane_rows, b.lanes
    live = np.zeros(L * (CS + BS) // 16, np.int32)
    n_app = min(accept, b.a_step)
    live[:(active * n_app + 15) // 16] = 2           # the appended rows, packed back to back (K/V only)
    for i in range(active):
        live[(L * CS + i * BS) // 16:(L * CS + (i + 1) * BS) // 16] = 1
    b.tile_live[...] = live
    base = int(b.tile_live.ctypes.data)
    for n in nodes:
        if not isinstance(n, Launch):
            continue
        if n.kernel == "plan_lanes":   # each lane's appended rows (None: idle)
            n.known["lanes_app"] = tuple(n_app if i < active else None for i in range(L))
        for a in n.leaves():
            ptr = getattr(a, "ptr", None)
            if ptr is not None and base <= ptr < base + b.tile_live.nbytes and getattr(a, "dtype", "") == "int32":
                t0 = (ptr - base) // 4
                n.known["tile_live"] = tuple(int(x) for x in live[t0:t0 + a.nbytes // 4])


def trace_step(config: DraftConfig, window: int, *, ring_dtype=np.uint16, w_dtype=np.uint16,
              accept: int = 6, lm_head_vocab: int | None = None, attn_config=None,
              pdl: bool = False, logits: bool = True) -> StepTrace:
    """The step graph of a steady-state step at ``window`` (``capacity = window``,
    the ring full, ``accept`` rows appended in the graph). Weights and ring
    default to bf16 (``np.uint16`` bits). ``attn_config``: the attention's
    ``(n_splits, merge)`` (``RingAttention.use_config``; ``None`` in either
    place: its default), as the autotuner would set it before the capture;
    ``None``: the cost rule's. ``pdl``: the cache's switch (``Launch.pdl`` marks the
    launches that carry programmatic stream serialization). ``logits``: the cache's switch (False:
    the LM head's fused argmax / DFlash 2's fused top-K, no logits written)."""
    from dflash_cupy.feature_ring import FeatureRing
    from dflash_cupy.kv_cache import DraftKvCache

    if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    be = RecordingBackend()
    w = ShapeOnlyWeights(config, be, w_dtype)
    lm = be.empty((int(lm_head_vocab), config.hidden_size), w_dtype) if lm_head_vocab else None
    kv = DraftKvCache(w, capacity=int(window), backend=be, lm_head=lm, pdl=pdl, logits=bool(logits))
    if attn_config is not None:
        n, merge = attn_config
        d_n, d_merge = kv.attention.default_config()
        kv.attention.use_config(None, (d_n if n is None else n, merge))
    ring_kind = {np.dtype(np.uint16): "bf16", np.dtype(np.float16): np.float16,
                 np.dtype(np.float32): np.float32}[np.dtype(ring_dtype)]
    import ml_dtypes
    ring = FeatureRing(int(window), config.n_captured, config.hidden_size,
                       dtype=ml_dtypes.bfloat16 if ring_kind == "bf16" else ring_kind, backend=be)
    # The ring "holds" every position the two plans read; its rows are never looked at.
    ring.lo, ring.hi = 0, int(window) + accept
    kv.begin_step(ring, int(window))          # prefill: bulk append outside the graph
    prefill = list(be.eager)
    be.eager.clear()
    if kv.engine.selects:                     # DFlash 2: the selector walks from an anchor
        kv.set_anchor(0)
    kv.run()                                  # no step captured yet: captures slot 1's graph
    kv.begin_step(ring, int(window) + accept)  # steady state: accept rows appended in-graph
    if kv.engine.selects:
        kv.set_anchor(0)
    kv.run()                                  # captures slot 0's graph
    nodes = kv._graphs[kv._slot].nodes
    # What the planning kernel writes at run time (the recording runs no kernel): the live
    # row tiles, as this step's plan makes them.
    mark_live_tiles(kv.engine, nodes, 1, kv.last_plan.n_new)
    names = name_arrays(kv)
    _rename(nodes, names)
    _rename(prefill, names)
    return StepTrace(config, int(window), kv.capacity, kv.q_len, kv.a_step, kv.kv_total, nodes,
                    prefill, kv)
