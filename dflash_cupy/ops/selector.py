"""The DFlash 2 candidate selector (``cuda_src/selector.cu``, SPEC §6) and its NumPy
references, which round where the kernels round.

``SelectorKernels(backend, config, q_len, lanes=1, weight_kind="bf16", partial_blocks=0)`` for a
``DraftConfig`` with ``dflash2`` (K = ``selector_top_k`` <= 64, ``selector_rank``,
``vocab_size``, ``output_multiplier``, ``final_logit_softcapping``). ``R = q_len - 1``
selector rows per lane (block rows 1..q_len-1). Shapes and dtypes (device arrays):

- ``topk(logits, ids, vals, row0=1, row_stride=q_len)``: ``logits`` f32 ``[rows, ld >=
  vocab]``; lane ``l``'s selector row ``j`` is logits row ``l * row_stride + row0 + j``
  (the default: all lanes' block rows ``[lanes * q_len, vocab]``, row 0 the anchor's).
  Writes ``ids`` int32 ``[lanes, R, K]`` (best raw logit first, ties to the lowest id) and
  ``vals`` f32 ``[lanes, R, K]`` = ``softcap(logit * output_multiplier)``, softcap(v) =
  ``tanh(v / cap) * cap`` (no cap: v). Non-finite logits rank by ``float_order.cuh``'s
  total order: +inf above every finite logit, -inf below, NaN below everything (the
  module's argmax rule); their values follow IEEE (+-inf -> +-cap, NaN -> NaN).
- ``merge_partials(partials, ids, vals, row0=0, row_stride=R)``: the same ``ids`` / ``vals``
  from per-column-block candidates (u32 ``[rows, blocks, K, 2]`` (order key, id), e.g. the
  lm_head GEMM's fused top-K, ``Gemm(..., "topk")``, whose rows are every step row: then
  ``row0=1, row_stride`` the lane's rows), each block's pairs best first; ``partial_blocks``:
  their blocks, which size the merge's registers (partials with more blocks than this and
  ``topk``'s own are refused).
- ``walk(hidden, hp_w, pred_cb, succ_cb, anchors, ids, vals, tokens, choice, q, knobs,
  rng)``: ``hidden`` f32 ``[lanes, S >= q_len, H]`` (the block's final normed hidden rows,
  S rows per lane, e.g. a step engine's 16-row lane blocks; rows 1..q_len-1 are read), ``hp_w`` ``[rank, H]``, ``pred_cb`` / ``succ_cb`` ``[vocab, rank]`` in
  ``weight_kind``'s device dtype (``dtypes.DEVICE``: bf16 as uint16 bits), ``anchors``
  int32 ``[lanes]`` (the block's first token per lane, read on the device), ``ids`` /
  ``vals`` as ``topk`` wrote them, ``knobs`` f32 ``[3]`` and ``rng`` u64 ``[2]``
  (``ops/sample.py``'s step block: temperature = knobs[0], (seed, counter base)). Writes
  ``tokens`` int32 ``[lanes, q_len]`` (row 0 the anchor, rows 1.. the walk), ``choice``
  int32 ``[lanes, R]`` (the candidate index taken) and ``q`` f32 ``[lanes, R, K]`` (the
  distribution drawn from; one-hot at temperature 0); per-lane ``knobs`` / ``rng``
  below. ``self.flags`` int32 ``[lanes]``: 1 where the lane's device anchor was outside
  ``[0, vocab)`` (then clamped into it).
- ``merge_and_walk(partials, hidden, hp_w, pred_cb, succ_cb, anchors, ids, vals, tokens,
  choice, q, knobs, rng, row0=0, row_stride=R)``: ``merge_partials`` then ``walk`` in the two
  launches ``walk`` alone takes (``selector_project_merge``: the merge's rows beside the
  projection's slices; ``selector_edges_walk``: every row's K x K edge scores, 4 blocks a row,
  then the lane's last block walks), with both checks before them and the same outputs bit for
  bit (``ids`` / ``vals`` too); a step engine's fused lm_head top-K.

With ``q_len`` 1 (no selector rows) ``topk`` and ``merge_partials`` do nothing and ``walk`` /
``merge_and_walk`` write only ``tokens[:, 0]``; ``partials``, ``ids``, ``vals``, ``choice``
and ``q`` are then not read (None is fine). All are capture-safe: no host sync, no
allocation (workspaces are made here, so one instance has one ``topk`` and one ``walk`` or
``merge_and_walk`` in flight at a time). The
walk's uniform for lane ``l``, block row ``r`` (1..R) is ``row_uniform64(l * q_len + r,
seed, counter) / 2^64`` (``selector_uniforms``), drawn by ``draw.cuh``'s integer inverse
CDF, the same generator and draw as ``TokenSampler``. With per-lane step blocks, ``knobs``
f32 ``[lanes, 3]`` and ``rng`` u64 ``[lanes, 2]`` (a step engine's lanes, each with its own
``SamplingParams``), lane ``l`` walks at temperature ``knobs[l, 0]`` with ``row_uniform64(r,
rng[l, 0], rng[l, 1]) / 2^64``: exactly a one-lane walk with that lane's knobs and rng, so a
lane batch is bit-identical to single caches.
"""
from __future__ import annotations

import numpy as np

from .. import checks, dtypes, kernels
from .sample import _order_keys, draw_masses, inverse_cdf, row_uniform64

_C = kernels.constants("selector.cu")
TK_NT = _C["SEL_TK_NT"]                   # threads of both top-K kernels
TK_TILE = TK_NT * _C["SEL_TK_PER"]        # columns per block of selector_topk_blocks
WK_NW = _C["SEL_WK_NW"]                   # warps per block of selector_walk (one hp row each)
MAX_K = _C["SEL_MAX_K"]


def edge_blocks_per_row(k: int) -> int:
    """selector_edges_walk's blocks per selector row (selector.cu's ESPLIT)."""
    return min(k, 4)


class SelectorKernels:
    """See the module docstring. ``weight_kind``: the selector tensors' device kind
    ("f32", "f16" or "bf16"), fixed at build time as the other weight kernels' types."""

    def __init__(self, backend, config, q_len: int, lanes: int = 1, weight_kind="bf16", partial_blocks: int = 0):
        d2 = getattr(config, "dflash2", None)
        if d2 is None:
            raise ValueError(f"config: {type(config).__name__} has no dflash2 (a DFlash 2 "
                             f"DraftConfig is needed for the selector)")
        self.q_len = checks.int_arg(q_len, "q_len", 1)
        self.lanes = checks.int_arg(lanes, "lanes", 1)
        if self.q_len > 64:
            raise ValueError(f"q_len={self.q_len} must be <= 64")
        self.K, self.rank, self.vocab = d2.selector_top_k, d2.selector_rank, d2.vocab_size
        if self.K > MAX_K:
            raise ValueError(f"config.dflash2.selector_top_k={self.K}: the kernels take K <= {MAX_K}")
        if _shared_bytes(self.q_len, self.K, self.rank) > 48 * 1024:
            raise ValueError(f"q_len={self.q_len}, selector_top_k={self.K}, selector_rank={self.rank}: the edge "
                             f"scores' rank vectors and the walk's staging exceed 48 KiB of shared memory")
        self.H = int(config.hidden_size)
        self.multiplier = float(d2.output_multiplier)
        self.cap = d2.final_logit_softcapping
        self.weight_kind = dtypes.kind_of(weight_kind, "weight_kind")
        self.w_dtype = dtypes.DEVICE[self.weight_kind]
        self.R = self.q_len - 1
        self.nblk = -(-self.vocab // TK_TILE)
        self.split = -(-self.rank // WK_NW)
        self.backend = backend
        # column blocks of the partials merge_partials will be given (a fused lm_head top-K's):
        # they size the merge's registers (SEL_PBLK)
        self.partial_blocks = checks.int_arg(partial_blocks, "partial_blocks", 0)
        self.max_partial_blocks = max(self.nblk, self.partial_blocks)   # the merge's NBLK_MAX
        code = dtypes.CODE[self.weight_kind]
        mod = kernels.load_module(backend, "selector.cu", SEL_V=self.vocab, SEL_K=self.K, SEL_Q=self.q_len,
                                  SEL_H=self.H, SEL_RANK=self.rank, SEL_HPT=code, SEL_CBT=code,
                                  SEL_MULT=self.multiplier, SEL_CAP=float(self.cap or 0.0),
                                  **({"SEL_PBLK": self.partial_blocks} if self.partial_blocks else {}))
        self._blocks = mod.get_function("selector_topk_blocks")
        self._merge = mod.get_function("selector_topk_merge")
        self._project = mod.get_function("selector_project_merge")
        self._edges_walk = mod.get_function("selector_edges_walk")
        rows = max(1, self.lanes * self.R)
        self.part = backend.zeros((rows, self.nblk, self.K, 2), np.uint32)   # (order key, id) per block
        self.hp_ws = backend.zeros((self.lanes, max(1, self.R), self.rank), np.float32)
        self.edges = backend.zeros((self.lanes, max(1, self.R), self.K, self.K), np.float32)   # [i][c] a row
        self.counters = backend.zeros((self.lanes,), np.int32)   # zero between launches
        self.flags = backend.zeros((self.lanes,), np.int32)

    def __repr__(self):
        return (f"SelectorKernels(vocab={self.vocab}, K={self.K}, q_len={self.q_len}, lanes={self.lanes}, "
                f"H={self.H}, rank={self.rank}, weight_kind={self.weight_kind!r})")

    def _out(self, name, a, dtype, shape):
        checks.device_array(self.backend, name, a, dtype, ndim=len(shape))
        if tuple(a.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(a.shape)}")

    def topk(self, logits, ids, vals, row0: int = 1, row_stride: int | None = None, stream=None) -> None:
        be, L, R, K = self.backend, self.lanes, self.R, self.K
        if not R:
            return
        checks.device_array(be, "logits", logits, np.float32)
        row0 = checks.int_arg(row0, "row0")
        row_stride = self.q_len if row_stride is None else checks.int_arg(row_stride, "row_stride")
        if logits.shape[1] < self.vocab:
            raise ValueError(f"logits must have >= {self.vocab} columns, got shape {tuple(logits.shape)}")
        self._out("ids", ids, np.int32, (L, R, K))
        self._out("vals", vals, np.float32, (L, R, K))
        if R and (row_stride < R and L > 1):
            raise ValueError(f"row_stride={row_stride} must be >= R={R} (lanes' rows may not overlap)")
        need = (L - 1) * row_stride + row0 + R if R else 0
        if need > logits.shape[0]:
            raise ValueError(f"logits has {logits.shape[0]} rows; lanes={L}, row0={row0}, "
                             f"row_stride={row_stride} read up to row {need - 1}")
        checks.check_no_overlap(ids=ids, vals=vals, logits=logits)
        self._blocks((self.nblk, L * R, 1), (TK_NT, 1, 1),
                     (logits, np.int32(logits.shape[1]), np.int32(row0), np.int32(row_stride),
                      np.int32(self.nblk), self.part), stream=stream)
        self._merge((L * R, 1, 1), (TK_NT, 1, 1), (self.part, np.int32(self.nblk), np.int32(0), np.int32(R),
                                                    ids, vals), stream=stream)

    def merge_partials(self, partials, ids, vals, row0: int = 0, row_stride: int | None = None,
                       stream=None) -> None:
        """``ids`` / ``vals`` (as ``topk`` writes them) from per-column-block candidates:
        ``partials`` u32 ``[rows, blocks, K, 2]``, each column block's K best (order key, id)
        pairs best first (the merge reads each block's first pair as its best), empty slots
        with an id >= vocab (e.g. 0xffffffff) last; any column partition into at most
        ``max(partial_blocks, the kernel's own blocks)`` blocks (the merge holds one first pair
        per block in registers; more are refused). Lane ``l``'s selector row ``j`` is partials
        row ``l * row_stride + row0 + j`` (default: ``[lanes * R, ...]``, row_stride R; a fused lm_head top-K's partials of every
        step row: ``row0=1``, ``row_stride`` the lane's rows). The merge ``topk`` runs, for a
        GEMM epilogue that writes them (``Gemm(..., "topk")``, ``gemm_stream.cu`` GS_EPI 4)."""
        L, R, K = self.lanes, self.R, self.K
        if not R:
            return
        row0, row_stride = self._check_partials(partials, row0, row_stride)
        self._out("ids", ids, np.int32, (L, R, K))
        self._out("vals", vals, np.float32, (L, R, K))
        checks.check_no_overlap(ids=ids, vals=vals, partials=partials)
        self._merge((L * R, 1, 1), (TK_NT, 1, 1), (partials, np.int32(partials.shape[1]), np.int32(row0),
                                                    np.int32(row_stride), ids, vals), stream=stream)

    def _check_partials(self, partials, row0, row_stride) -> tuple[int, int]:
        """merge_partials' checks of ``partials`` and its row mapping: ``(row0, row_stride)``."""
        L, R, K = self.lanes, self.R, self.K
        checks.device_array(self.backend, "partials", partials, np.uint32, ndim=4)
        row0 = checks.int_arg(row0, "row0", 0)
        row_stride = R if row_stride is None else checks.int_arg(row_stride, "row_stride", 1)
        if L > 1 and row_stride < R:
            raise ValueError(f"row_stride={row_stride} must be >= R={R} (lanes' rows may not overlap)")
        need = (L - 1) * row_stride + row0 + R
        if partials.shape[0] < need or partials.shape[2:] != (K, 2) or partials.shape[1] < 1:
            raise ValueError(f"partials must have shape [>= {need}, blocks >= 1, {K}, 2] (lanes={L}, row0={row0}, "
                             f"row_stride={row_stride}), got {list(partials.shape)}")
        if partials.shape[1] > self.max_partial_blocks:
            raise ValueError(f"partials has {partials.shape[1]} column blocks; this merge was built for at most "
                             f"{self.max_partial_blocks} (SelectorKernels(partial_blocks=...) sizes it)")
        return row0, row_stride

    def walk(self, hidden, hp_w, pred_cb, succ_cb, anchors, ids, vals, tokens, choice, q, knobs, rng,
             stream=None) -> None:
        args = self._walk_args(hidden, hp_w, pred_cb, succ_cb, anchors, ids, vals, tokens, choice, q, knobs, rng)
        self._launch(self.part, 1, 0, 0, 0, args, stream)

    def merge_and_walk(self, partials, hidden, hp_w, pred_cb, succ_cb, anchors, ids, vals, tokens, choice, q,
                       knobs, rng, row0: int = 0, row_stride: int | None = None, stream=None) -> None:
        """``merge_partials(partials, ids, vals, row0, row_stride)`` then ``walk(hidden, ...,
        rng)`` in two launches, as ``walk`` alone takes (``selector_project_merge``: the
        merge's rows beside the projection's slices; then ``selector_edges_walk``): the same
        checks (raised before anything is launched) and the same outputs bit for bit, ``ids``
        / ``vals`` included. With ``q_len`` 1 it writes only ``tokens[:, 0]``, as ``walk``
        does (``partials``, ``ids``, ``vals``, ``choice``, ``q`` unread: None is fine)."""
        R = self.R
        if R:
            row0, row_stride = self._check_partials(partials, row0, row_stride)
        args = self._walk_args(hidden, hp_w, pred_cb, succ_cb, anchors, ids, vals, tokens, choice, q, knobs, rng,
                               partials=partials if R else None)
        if R:
            self._launch(partials, partials.shape[1], row0, row_stride, R, args, stream)
        else:
            self._launch(self.part, 1, 0, 0, 0, args, stream)

    def _launch(self, part, nblk, row0, row_stride, merge_rows, args, stream) -> None:
        """The projection (and ``merge_rows`` merge rows) then the edges and the walk; q_len 1:
        the walk's launch alone (it writes ``tokens[:, 0]``)."""
        (hidden, hidden_rows, hp_w, pred_cb, succ_cb, anchors, ids, vals, knobs, rng, per_lane, tokens, choice, q) = args
        L, R = self.lanes, self.R
        if R:
            self._project((self.split + merge_rows, L, 1), (WK_NW * 32, 1, 1),
                          (part, np.int32(nblk), np.int32(row0), np.int32(row_stride), np.int32(merge_rows),
                           hidden, hidden_rows, hp_w, ids, vals, self.hp_ws), stream=stream)
        self._edges_walk((max(R * edge_blocks_per_row(self.K), 1), L, 1), (WK_NW * 32, 1, 1),
                         (pred_cb, succ_cb, anchors, ids, vals, knobs, rng, per_lane, tokens, choice, q, self.hp_ws,
                          self.edges, self.counters, self.flags), stream=stream)

    def _walk_args(self, hidden, hp_w, pred_cb, succ_cb, anchors, ids, vals, tokens, choice, q, knobs, rng,
                   partials=None) -> tuple:
        """walk's checks; its kernel arguments (placeholders for what q_len 1 does not read).
        ``partials``: also checked not to overlap the others (merge_and_walk)."""
        be, L, R, K, Q = self.backend, self.lanes, self.R, self.K, self.q_len
        checks.device_array(be, "hidden", hidden, np.float32, ndim=3)
        if hidden.shape[0] != L or hidden.shape[1] < Q or hidden.shape[2] != self.H:
            raise ValueError(f"hidden must have shape [{L}, >= {Q}, {self.H}] (rows per lane >= q_len), "
                             f"got {list(hidden.shape)}")
        self._out("hp_w", hp_w, self.w_dtype, (self.rank, self.H))
        self._out("pred_cb", pred_cb, self.w_dtype, (self.vocab, self.rank))
        self._out("succ_cb", succ_cb, self.w_dtype, (self.vocab, self.rank))
        self._out("anchors", anchors, np.int32, (L,))
        if R:
            self._out("ids", ids, np.int32, (L, R, K))
            self._out("vals", vals, np.float32, (L, R, K))
        self._out("tokens", tokens, np.int32, (L, Q))
        if R:
            self._out("choice", choice, np.int32, (L, R))
            self._out("q", q, np.float32, (L, R, K))
        blocks = getattr(knobs, "ndim", 1) == 2   # per-lane step blocks
        self._out("knobs", knobs, np.float32, (L, 3) if blocks else (3,))
        self._out("rng", rng, np.uint64, (L, 2) if blocks else (2,))
        if R:
            checks.check_no_overlap(tokens=tokens, choice=choice, q=q, ids=ids, vals=vals, anchors=anchors,
                                    hidden=hidden, **({} if partials is None else {"partials": partials}))
        else:   # no selector rows: only tokens[:, 0] is written; unread pointers get placeholders
            checks.check_no_overlap(tokens=tokens, anchors=anchors)
            ids = choice = self.counters
            vals = q = self.hp_ws
        return (hidden, np.int32(hidden.shape[1]), hp_w, pred_cb, succ_cb, anchors, ids, vals, knobs, rng,
                np.int32(blocks), tokens, choice, q)

    def anchors_to_device(self, anchors):
        """Host anchors (one token id per lane) as the device int32 ``[lanes]`` array ``walk``
        reads; an id outside ``[0, vocab)`` raises ValueError naming the lane (not capture-safe:
        it allocates; a pipeline that verifies on the device passes its own array)."""
        a = np.asarray(anchors)
        if a.ndim == 0:
            a = a.reshape(1)
        if a.shape != (self.lanes,) or not (np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"anchors must be {self.lanes} token ids (ints), got {anchors!r}")
        bad = np.flatnonzero((a < 0) | (a >= self.vocab))
        if bad.size:
            raise ValueError(f"anchors[{bad[0]}]={a[bad[0]]} is outside the vocabulary [0, {self.vocab})")
        return self.backend.asarray(a.astype(np.int32))


def _shared_bytes(q_len: int, k: int, rank: int) -> int:
    """selector_edges_walk's static shared memory (selector.cu's static_assert, the same sum)."""
    ra = max(1, q_len - 1)
    ui = min(-(-k // edge_blocks_per_row(k)), max(1, 16 * 1024 // (rank * 4)))   # selector.cu's UI
    stage = ra * k * k * 4 if ra * k * k * 4 <= 16 * 1024 else 4  # its ESTAGE
    return ui * rank * 4 + k * 12 + stage + k * 4 + ra * k * 4 + ra * 8 + k * 8 + 4 + 16


# ---------------------------------------------------------------- NumPy references

def topk_reference(logits, k: int, vocab: int, multiplier: float, cap) -> tuple[np.ndarray, np.ndarray]:
    """``selector_topk_*`` for logits rows ``[rows, >= vocab]`` f32: ``(ids [rows, k] int32,
    vals [rows, k] f32)``, ranked by order key (NaN last), ties to the lowest id; vals
    ``softcap(logit * multiplier)`` in f32 (``tanh(v / cap) * cap``)."""
    lg = np.asarray(logits, np.float32)[:, :vocab]
    ids = np.zeros((lg.shape[0], k), np.int32)
    cols = np.arange(lg.shape[1])
    for r in range(lg.shape[0]):
        ids[r] = np.lexsort((cols, -_order_keys(lg[r]).astype(np.int64)))[:k]
    x = np.take_along_axis(lg, ids, axis=1) * np.float32(multiplier)
    if cap:
        c = np.float32(cap)
        with np.errstate(invalid="ignore"):
            x = (np.tanh(x / c) * c).astype(np.float32)
    return ids, x.astype(np.float32)


def partials_reference(logits, k: int, vocab: int, cols: int) -> np.ndarray:
    """Per-column-block candidates as a GEMM epilogue with ``cols``-wide column blocks writes
    them: u32 ``[rows, blocks, k, 2]``, each block's k best (order key, id) best first (ties
    to the lower id), then empty slots (0, 0xffffffff)."""
    lg = np.asarray(logits, np.float32)[:, :vocab]
    nb = -(-vocab // cols)
    out = np.zeros((lg.shape[0], nb, k, 2), np.uint32)
    out[..., 1] = 0xFFFFFFFF
    for r in range(lg.shape[0]):
        for b in range(nb):
            seg = lg[r, b * cols:(b + 1) * cols]
            keys = _order_keys(seg)
            best = np.lexsort((np.arange(seg.size), -keys.astype(np.int64)))[:k]
            out[r, b, :best.size, 0] = keys[best]
            out[r, b, :best.size, 1] = best + b * cols
    return out


def warp_dot_reference(w, x) -> np.ndarray:
    """``selector.cu``'s ``warp_dot`` of rows ``w [n, len]`` with vectors ``x [N, len]`` (f32,
    the kernel's order): ``[n, N]`` f32."""
    w, x = np.asarray(w, np.float32), np.asarray(x, np.float32)
    n, length = w.shape
    acc = np.zeros((n, 32, x.shape[0]), np.float32)
    lane8 = 8 * np.arange(32)
    for c0 in range(0, length, 256):
        for e in range(8):
            idx = c0 + lane8 + e
            ok = idx < length
            i = np.where(ok, idx, 0)
            prod = w[:, i][:, :, None] * x[:, i].T[None, :, :]
            acc = np.where(ok[None, :, None], acc + prod, acc)
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        acc = acc + acc[:, lanes ^ o, :]
    return acc[:, 0, :]


def selector_uniforms(seed: int, counter: int, lanes: int, q_len: int) -> np.ndarray:
    """The walk's uniforms ``[lanes, q_len - 1]`` float64 (``row_uniform64(l * q_len + r,
    seed, counter) / 2^64``): what the float64 oracle (``reference.select_draft(...,
    uniforms=)``) takes."""
    return np.array([[row_uniform64(l * q_len + r, seed, counter) / 2.0 ** 64 for r in range(1, q_len)]
                     for l in range(lanes)], np.float64).reshape(lanes, q_len - 1)


def walk_reference(hidden, hp_w, pred_cb, succ_cb, anchors, ids, vals, vocab: int,
                   temperature: float = 0.0, seed: int = 0, counter: int = 0) -> dict:
    """``selector_walk`` in NumPy: weights in any layout ``dtypes.to_float`` widens, the rest
    as ``SelectorKernels.walk`` takes them (host arrays). Returns ``tokens, choice, q, flags,
    scores [lanes, R, K]`` (the row's edge scores given the choice before) and ``margin [lanes,
    R]`` (greedy: best score minus the runner-up, inf for K = 1; sampled: ``inverse_cdf``'s)."""
    hidden = np.asarray(hidden, np.float32)
    L, Q, _ = hidden.shape
    ids, vals = np.asarray(ids), np.asarray(vals, np.float32)
    R, K = Q - 1, ids.shape[-1]
    W = dtypes.to_float(hp_w, np.float32)
    P, S = dtypes.to_float(pred_cb, np.float32), dtypes.to_float(succ_cb, np.float32)
    out = dict(tokens=np.zeros((L, Q), np.int32), choice=np.zeros((L, R), np.int32),
               q=np.zeros((L, R, K), np.float32), flags=np.zeros(L, np.int32),
               scores=np.zeros((L, R, K), np.float32), margin=np.full((L, R), np.inf))
    inv_t = np.float32(1.0) / np.float32(temperature) if temperature > 0 else None
    for lane in range(L):
        a = int(anchors[lane])
        out["flags"][lane] = not 0 <= a < vocab
        prev = min(max(a, 0), vocab - 1)
        out["tokens"][lane, 0] = prev
        hp = warp_dot_reference(W, hidden[lane, 1:]).T if R else None     # [R, rank]
        for j in range(R):
            u = P[prev] * hp[j]
            cand = np.clip(ids[lane, j], 0, vocab - 1)
            s = vals[lane, j] + warp_dot_reference(S[cand], u[None])[:, 0]
            out["scores"][lane, j] = s
            if inv_t is None:
                keys = _order_keys(s)
                c = int(np.argmax(keys))
                out["q"][lane, j, c] = 1.0
                if K > 1:
                    out["margin"][lane, j] = float(s[c]) - float(np.max(np.delete(s, c)))
            else:
                mass = draw_masses(s * inv_t)
                total = int(mass.sum(dtype=np.uint64))
                if total:
                    c, out["margin"][lane, j] = inverse_cdf(row_uniform64(lane * Q + j + 1, seed, counter), mass)
                    out["q"][lane, j] = mass.astype(np.float32) / np.float32(total)
                else:
                    c = 0
            out["choice"][lane, j] = c
            prev = int(np.clip(ids[lane, j, c], 0, vocab - 1))
            out["tokens"][lane, j + 1] = prev
    return out
