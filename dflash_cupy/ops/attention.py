"""Masked split-KV ring attention of the noise rows (``cuda_src/attention.cu``)
and its NumPy reference.

``out[b, h*d:(h+1)*d] = softmax(q[b,h] . K[:, kvh]^T * scale + mask[b]) @ V[:, kvh]``
with ``kvh = h // (n_head/n_head_kv)`` (GQA), over all ``kv_total`` cache rows
(f16, read exactly), additive f16 mask (0 / -inf), softmax in f32, and an
optional fused gate ``out *= softplus(g)`` with ``g [B, n_head]`` (``"head"``)
or ``[B, n_head*d]`` (``"element"``). A row with every key hidden gets 0.
A slot hidden from a row never reaches that row's output, whatever its K/V
hold (NaN, Inf): stale ring slots need no clearing on reset or rewind.

Grid ``(n_head_kv, n_splits, row_groups)``: each block loads a 32-row K/V
tile of one kv head once for all ``q_len * n_head/n_head_kv`` query rows that
read it. With ``n_splits > 1`` each block writes its partial (un-normalised
output, max, sum) into a workspace allocated by the constructor, and the
splits are merged (log-sum-exp, splits in a fixed order: bit-identical every
launch) by one of two ``merge`` modes, bit-identical to each other
(``attention_common.cuh``):

* ``"launch"``: a second kernel, ``ring_attn_combine``, merges every row
  (two launches per call; the combine's full grid reads the partials);
* ``"fold"``: the last of the ``n_splits`` blocks of a (lane, kv head[, row
  group]) to finish merges them, in the same launch (per-unit int32 arrival
  counters, owned here, zero between launches): one launch, but that lone
  block reads its unit's partials at one SM's share of the L2 bandwidth.

Which is faster depends on the shape: ``default_merge`` is the cost model's
rule, and ``launch_candidates`` / ``use_config`` let the autotuner
(``dflash_cupy/tuning.py``) time ``(n_splits, merge)`` configurations on a GPU.

Lanes (``lanes > 1``): one launch per kernel serves ``lanes`` independent
requests (their q/out rows ``lane_rows`` apart, their own K/V rows and masks,
``attention_common.cuh``); the lane is the grid's z (tensor cores) or folded
into x (``lane * n_head_kv + kv head``, CUDA cores), the combine's y. With
``live`` (the lanes' step descriptors, on the device) the blocks of an idle
lane return before reading anything (or counting), so idle lanes cost one
block start each. Every lane's units count toward filling the SMs, so the
default split count per lane falls as lanes grow (``default_splits``, with a
floor that keeps a batch with few live lanes fast; the merge folds from
``FOLD_FROM_LANES`` lanes on).

Two split kernels (``path``): ``"mma"`` (``cuda_src/attention_mma.cu``,
tensor cores, q and p split into two f16 terms, V read with ldmatrix.trans; the default where it applies:
``head_dim % 16 == 0``, ``head_dim <= 128``, at most 128 query rows per kv
head) and ``"fma"`` (``attention.cu``, CUDA cores, any head_dim). At long
windows the CUDA-core kernel is bound by its own arithmetic (B*G rows x D x
2 FMAs per key), the tensor-core one by reading K and V.
"""
from __future__ import annotations

import math

import numpy as np

from .. import checks, device_props, dtypes, kernels
from ..kv_pages import PAGE_ALIGN, check_page, dense_table, pages_per_lane, physical_rows

GATES = {None: 0, "head": 1, "element": 2}
DESC_LEN = kernels.constants("step_desc.cuh")["DESC_LEN"]   # the per-lane descriptor row of ``live``
_C = kernels.constants("attention_common.cuh")
TILE = _C["TILE"]                        # keys per shared-memory tile
COMBINE_THREADS = _C["COMBINE_THREADS"]  # block of ring_attn_combine (merge="launch")
SMEM_LIMIT = device_props.DEFAULT_SMEM   # static shared memory cap (no opt-in for static)
MAX_WARPS = 8
MMA_MAX_ROWS = 128         # query rows per kv head (q_len * n_head/n_head_kv) of attention_mma.cu
BLOCKS_PER_SM = 2          # what the split kernels' registers allow (~215 regs x 128 threads)
# The split and merge rules below are the cost model's; the figures that chose
# each constant, and how to reproduce them, are in docs/decisions/attention.md.
# The autotuner's timings on a GPU (launch_candidates) overrule all of them.
# Fewer tiles per split fill the SMs at short windows; below 4 the partials'
# round trip (and the merge) costs more than the extra blocks gain.
MIN_TILES_PER_SPLIT = 4
MERGES = ("launch", "fold")
# default_merge's crossover. The fold saves a graph node per layer and the
# combine launch, but the last block of each unit reads its unit's partials
# alone, at one SM's share of the L2 bandwidth; at long windows the split
# kernel's own bound grows past its latency path plus that tail and hides it.
FOLD_FROM_KV_TOTAL = 24 * 1024
MAX_SPLIT_CANDIDATES = 5   # split counts > 1 the tuner tries (x 2 merges, + n_splits 1)
# Lanes: every lane's (kv head[, row group]) is a unit of n_splits blocks, so
# a batch of L lanes fills the SMs with L times fewer splits per lane. But the
# count is frozen at capture for the batch's lane capacity, and a batch with
# few live lanes would then run each live lane's window in a few long serial
# pieces. So a batch keeps at least n_tiles // BATCH_TILES_PER_SPLIT splits
# (pieces of 16 to 31 tiles), never more than one lane alone would get.
BATCH_TILES_PER_SPLIT = 16
# The folded merge's cost is one unit's partials read by one block: fixed
# however many lanes share the launch, while ring_attn_combine reads every
# lane's partials (and is a node of its own). So "fold" from 4 lanes on.
FOLD_FROM_LANES = 4


def _fill_splits(units: int, sm_count: int) -> int:
    """The split count nearest ``BLOCKS_PER_SM`` blocks per SM over ``units``
    units (halves up): the grid fits one wave instead of spilling a partial one."""
    slots = BLOCKS_PER_SM * sm_count
    return max(1, (2 * slots + units) // (2 * units))


def default_splits(n_head_kv: int, kv_total: int, sm_count: int, row_groups: int = 1, lanes: int = 1) -> int:
    """One lane: enough blocks for ``BLOCKS_PER_SM`` per SM, but at least
    ``MIN_TILES_PER_SPLIT`` key tiles each. ``lanes > 1``: the count that
    fills the SMs counting every lane's units, at least ``n_tiles //
    BATCH_TILES_PER_SPLIT`` (a batch with few live lanes stays fast), at most
    the one-lane count."""
    n_tiles = -(-kv_total // TILE)
    units = n_head_kv * row_groups
    one = max(1, min(-(-(BLOCKS_PER_SM * sm_count) // units), n_tiles // MIN_TILES_PER_SPLIT))
    if lanes <= 1:
        return one
    return max(1, min(one, max(_fill_splits(units * lanes, sm_count), n_tiles // BATCH_TILES_PER_SPLIT)))


def default_merge(kv_total: int, n_splits: int, lanes: int = 1) -> str | None:
    """The cost model's merge for ``n_splits`` splits over ``kv_total`` keys
    per lane: ``None`` for one split (nothing to merge), else ``"fold"`` from
    ``FOLD_FROM_KV_TOTAL`` keys or ``FOLD_FROM_LANES`` lanes on, ``"launch"``
    below both."""
    if n_splits <= 1:
        return None
    return "fold" if kv_total >= FOLD_FROM_KV_TOTAL or lanes >= FOLD_FROM_LANES else "launch"


def split_candidates(n_head_kv: int, kv_total: int, sm_count: int, row_groups: int = 1,
                     lanes: int = 1) -> list[int]:
    """The split counts worth timing on a device, ascending: 1 (no merge) and
    up to ``MAX_SPLIT_CANDIDATES`` more, the nearest to the cost rule's count
    ``d`` first, from d/2, 3d/4, d, 3d/2, 2d, the counts that fill one and two
    blocks per SM (every lane's units counted) without the
    ``MIN_TILES_PER_SPLIT`` floor, and two key tiles per split; none above the
    key tiles, none within a factor 1.25 of one already kept (a
    near-duplicate times the same thing)."""
    n_tiles = -(-kv_total // TILE)
    d = default_splits(n_head_kv, kv_total, sm_count, row_groups, lanes)
    units = n_head_kv * row_groups * lanes
    pool = {d // 2, 3 * d // 4, d, 3 * d // 2, 2 * d, -(-sm_count // units),
            -(-(BLOCKS_PER_SM * sm_count) // units), n_tiles // 2}
    kept: list[int] = []
    for x in sorted((x for x in pool if 1 < x <= n_tiles), key=lambda x: (abs(math.log(x / d)), x)):
        if len(kept) < MAX_SPLIT_CANDIDATES and all(max(x, k) > 1.25 * min(x, k) for k in kept):
            kept.append(x)
    return [1] + sorted(kept)


class RingAttention:
    """``RingAttention(backend, head_dim, n_head, n_head_kv, q_len, kv_total,
    n_splits=None, gate=None, scale=None, path="auto", lanes=1, lane_rows=None,
    merge=None, page=32)``; ``gate`` is ``None``, ``"head"`` or ``"element"``; ``scale``
    defaults to ``1/sqrt(head_dim)``; ``merge`` is ``"launch"``, ``"fold"`` or
    ``None`` (``default_merge``), and nothing with one split.

    ``__call__(q, k_cache, v_cache, mask, out, gate=None, stream=None, live=None, pages=None)``,
    with ``BS = lane_rows`` (default ``q_len``; lane ``l``'s ``q_len`` rows
    start at row ``l*BS`` of q, out and gate):
    ``q [lanes*BS, n_head, head_dim]`` or ``[lanes*BS, n_head*head_dim]`` f32;
    ``k_cache``, ``v_cache [lanes*kv_total, n_head_kv*head_dim]`` f16 (16-byte
    aligned; lane ``l``'s rows at ``l*kv_total``), or with ``pages`` (the lanes' page
    tables, device int32 ``[lanes, ceil(kv_total / page)]``, ``kv_pages.py``: lane ``l``'s
    key ``r`` at row ``pages[l, r // page] + r % page``) pools of any row count, every
    table entry plus ``page`` rows within them (not checked: on the device); ``mask [lanes, q_len,
    kv_total]`` f16 (``[q_len, kv_total]`` too when ``lanes == 1``); ``out
    [lanes*BS, n_head*head_dim]`` f32; ``gate [lanes*BS, n_head]`` /
    ``[lanes*BS, n_head*head_dim]`` f32 per the mode. Rows of q/out/gate past a
    lane's ``q_len`` are neither read nor written. ``live``: the step
    descriptors ``[lanes, DESC_LEN]`` device int32, read when the kernels run;
    a lane whose ``DESC_ACTIVE`` entry is 0 is idle: its blocks (the
    combine's too) exit before reading anything and its out rows are untouched.
    ``None``: every lane runs. Every lane in one launch per kernel; each lane's
    result is bit-identical to a single-lane call on its slices.
    No allocation, no host sync: capture-safe. With ``n_splits > 1`` the
    instance owns one partials workspace (``part_o``, ``part_ml``: ``[lanes,
    n_splits, ...]``), and with ``merge="fold"`` the arrival ``counters``
    (int32, one per (lane, kv head, row group), zero between launches: the
    merging block resets its own): calls must be ordered (one stream), never
    concurrent on two streams, and a launch must not be abandoned half way.

    Tuning (the interface of ``Gemm``, ``dflash_cupy/tuning.py``): a
    configuration is ``(n_splits, merge)``; ``launch_candidates()``,
    ``default_config()``, ``config()``, ``use_config(m, config)``. The shape
    is fixed at construction, so their ``m`` (the GEMMs' row count) is
    accepted and ignored. ``use_config`` recompiles and reallocates the
    workspace: before the first graph capture of this object only.
    """

    def __init__(self, backend, head_dim: int, n_head: int, n_head_kv: int, q_len: int,
                 kv_total: int, n_splits: int | None = None, gate: str | None = None,
                 scale: float | None = None, path: str = "auto", lanes: int = 1, lane_rows: int | None = None,
                 merge: str | None = None, out_kind: str | None = None, page: int = PAGE_ALIGN):
        self.backend = backend
        # out: f32, or rounded once to "f16" / "bf16" (the o projection's weight type, read by a
        # single-rounding GEMM with x16: the same bits it would round f32 to, half the bytes)
        if out_kind not in (None, "f16", "bf16"):
            raise ValueError(f"out_kind {out_kind!r}: expected None (f32), 'f16' or 'bf16'")
        self.out_kind = out_kind
        self.out_dtype = np.dtype(np.float32) if out_kind is None else dtypes.DEVICE[out_kind]
        self.D = checks.int_arg(head_dim, "head_dim", 1)
        self.NH = checks.int_arg(n_head, "n_head", 1)
        self.NKV = checks.int_arg(n_head_kv, "n_head_kv", 1)
        self.B = checks.int_arg(q_len, "q_len", 1)
        self.kv_total = checks.int_arg(kv_total, "kv_total", 1)
        self.lanes = checks.int_arg(lanes, "lanes", 1)
        self.lane_rows = self.B if lane_rows is None else checks.int_arg(lane_rows, "lane_rows", 1)
        if self.lane_rows < self.B:
            raise ValueError(f"lane_rows={lane_rows} must be >= q_len={q_len}")
        if self.D % 8 or self.D > 256:
            raise ValueError(f"head_dim must be a multiple of 8 and at most 256, got {head_dim}")
        if self.NH % self.NKV:
            raise ValueError(f"n_head={n_head} must be a multiple of n_head_kv={n_head_kv}")
        if gate not in GATES:
            raise ValueError(f"gate {gate!r}: expected one of {tuple(GATES)}")
        self.gate = gate
        self.scale = 1.0 / math.sqrt(self.D) if scale is None else float(scale)
        if not np.isfinite(self.scale):
            raise ValueError(f"scale must be finite, got {scale!r}")

        G = self.NH // self.NKV
        R = self.B * G
        # <= 8 warps: ptxas caps a 16-warp block at 128 registers and the kernel spills there
        mma_ok = self.D % 16 == 0 and self.D <= 128 and R <= MMA_MAX_ROWS
        if path not in ("auto", "mma", "fma"):
            raise ValueError(f"path {path!r}: expected 'auto', 'mma' or 'fma'")
        if path == "mma" and not mma_ok:
            raise ValueError(f"path 'mma' needs head_dim % 16 == 0, head_dim <= 128 and at most {MMA_MAX_ROWS} "
                             f"query rows per kv head (head_dim={self.D}, rows={R})")
        self.path = "mma" if (path == "auto" and mma_ok) or path == "mma" else "fma"
        # rows per block: all of them unless q_s [RB, D] f32 plus one K and one
        # V tile would exceed the static shared-memory cap
        rb_fit = (SMEM_LIMIT - 2 * TILE * self.D * 2) // (4 * self.D)
        self.rows_per_block = min(R, rb_fit)
        self.row_groups = -(-R // self.rows_per_block)
        self.warps = min(MAX_WARPS, self.rows_per_block)
        if self.path == "mma":
            self._block = (-(-R // 16) * 32, 1, 1)
        else:
            self._block = (self.warps * 32, 1, 1)
        self._sm_count = device_props.of(backend).sm_count
        self._unit_rows = 1 if self.path == "mma" else self.row_groups   # row groups per unit of splits
        if self.lanes > 65535:   # grid z (tensor cores) and the combine's y
            raise ValueError(f"lanes={lanes} exceeds the 65535 limit of grid y/z")
        self.page = check_page(page)   # K/V rows per page: a multiple of the key tile
        self.n_pages = pages_per_lane(self.kv_total, self.page)
        self._dense = backend.asarray(dense_table(self.lanes, self.kv_total, self.page))   # pages=None's table
        self._captured = False     # a graph holds the workspace's address: no reconfiguring
        self.part_o = self.part_ml = self.counters = None
        self._configure(*self._resolve(n_splits, merge))

    # ------------------------------------------------------------------ configuration
    def _resolve(self, n_splits, merge) -> tuple[int, str | None]:
        """Validated ``(n_splits, merge)``, defaults filled in (merge ``None`` at one split)."""
        if merge is not None and merge not in MERGES:
            raise ValueError(f"merge {merge!r}: expected one of {MERGES} or None (the default rule)")
        n_tiles = -(-self.kv_total // TILE)
        if n_splits is None:
            n_splits = default_splits(self.NKV, self.kv_total, self._sm_count, self._unit_rows, self.lanes)
        n_splits = checks.int_arg(n_splits, "n_splits", 1)
        if n_splits > n_tiles:
            raise ValueError(f"n_splits={n_splits} exceeds the {n_tiles} key tiles of kv_total={self.kv_total}")
        if n_splits == 1:
            return 1, None
        return n_splits, merge if merge is not None else default_merge(self.kv_total, n_splits, self.lanes)

    def _configure(self, n_splits: int, merge: str | None) -> None:
        """Compile the kernels of ``(n_splits, merge)`` and allocate what they need."""
        grid = ((self.NKV, n_splits, self.lanes) if self.path == "mma"                    # z = lane
                else (self.NKV * self.lanes, n_splits, self.row_groups))   # x = lane * NKV + kv head
        if max(grid[1:]) > 65535:
            raise ValueError(f"n_splits={n_splits}, lanes={self.lanes}: grid {grid} exceeds the 65535 "
                             f"limit of grid y/z")
        # one lane at lane_rows = q_len compiles exactly the single-request kernel
        lane_opts = {} if (self.lanes, self.lane_rows) == (1, self.B) else dict(LANES=self.lanes,
                                                                                 LANE_ROWS=self.lane_rows)
        fold = {} if n_splits == 1 else dict(FOLD_MERGE=int(merge == "fold"))
        sizes = dict(D=self.D, NH=self.NH, NKV=self.NKV, B=self.B, KV_TOTAL=self.kv_total, SPLITS=n_splits,
                     **({} if self.page == PAGE_ALIGN else {"PAGE": self.page}),
                     GATE=GATES[self.gate], **lane_opts, **fold,
                     **({} if self.out_kind is None else {"OUT16": dtypes.CODE[self.out_kind]}))
        # attention.cu: the CUDA-core split kernel and ring_attn_combine
        module = None
        if self.path == "fma" or merge == "launch":
            module = kernels.load_module(self.backend, "attention.cu", RB=self.rows_per_block,
                                         NWARPS=self.warps, **sizes)
        if self.path == "mma":   # all R rows in one block: one warp per 16 rows
            split = kernels.load_module(self.backend, "attention_mma.cu", **sizes).get_function(
                "ring_attn_mma_split")
        else:
            split = module.get_function("ring_attn_split")
        combine = module.get_function("ring_attn_combine") if merge == "launch" else None
        if n_splits > 1:
            self.part_o = self.backend.zeros((self.lanes, n_splits, self.B * self.NH, self.D), np.float32)
            self.part_ml = self.backend.zeros((self.lanes, n_splits, self.B * self.NH, 2), np.float32)
        else:
            self.part_o = self.part_ml = None
        # one per unit of n_splits blocks (grid x times z: (lane, kv head[, row group]))
        self.counters = self.backend.zeros((grid[0] * grid[2],), np.int32) if merge == "fold" else None
        self.n_splits, self.merge = n_splits, merge
        self._grid, self._split, self._combine = grid, split, combine
        self._cgrid = (-(-(self.B * self.NH * self.D) // COMBINE_THREADS), self.lanes, 1)

    def launch_candidates(self, m=None) -> list:
        """The ``(n_splits, merge)`` configurations worth timing (``split_candidates``
        x both merges; ``(1, None)`` once); the default's among them."""
        out = []
        for n in split_candidates(self.NKV, self.kv_total, self._sm_count, self._unit_rows, self.lanes):
            out += [(1, None)] if n == 1 else [(n, mg) for mg in MERGES]
        d = self.default_config()
        if d not in out:
            out.append(d)
        return out

    def default_config(self, m=None) -> tuple:
        """The cost rule's ``(n_splits, merge)`` (``default_splits``, ``default_merge``)."""
        return self._resolve(None, None)

    def config(self, m=None) -> tuple:
        """The ``(n_splits, merge)`` a call launches now."""
        return (self.n_splits, self.merge)

    def use_config(self, m=None, config=None) -> None:
        """Launch with ``config = (n_splits, merge)`` from now on (any valid
        pair; ``launch_candidates()`` lists those worth timing): compiles its
        kernels and replaces the workspace. Before any graph captured this
        object only (a captured graph holds the workspace's address)."""
        if config is None:
            raise TypeError("use_config needs config=(n_splits, merge)")
        if not isinstance(config, (tuple, list)) or len(config) != 2:
            raise ValueError(f"config must be (n_splits, merge), got {config!r}")
        resolved = self._resolve(config[0], config[1])
        if self._captured:
            raise RuntimeError("use_config() after a graph captured this RingAttention: "
                               "tune before the first capture")
        if resolved != self.config():
            self._configure(*resolved)

    def __repr__(self):
        return (f"RingAttention(head_dim={self.D}, n_head={self.NH}, n_head_kv={self.NKV}, "
                f"q_len={self.B}, kv_total={self.kv_total}, n_splits={self.n_splits}, merge={self.merge!r}, "
                f"gate={self.gate!r}, path={self.path}, rows_per_block={self.rows_per_block}, "
                f"warps={self.warps}" + (f", lanes={self.lanes}, lane_rows={self.lane_rows}" if self.lanes > 1 else "")
                + ")")

    def bytes_moved(self) -> int:
        """Compulsory traffic of one lane: K and V once, q, mask, out (+ partials
        written and read back by the merge, either merge)."""
        b = 2 * self.kv_total * self.NKV * self.D * 2 + self.B * self.NH * self.D * (4 + self.out_dtype.itemsize)
        b += self.B * self.kv_total * 2
        if self.n_splits > 1:
            b += 2 * self.n_splits * self.B * self.NH * (self.D + 2) * 4
        return b

    def __call__(self, q, k_cache, v_cache, mask, out, gate=None, stream=None, live=None, pages=None):
        be = self.backend
        B, NH, D, L = self.B, self.NH, self.D, self.lanes
        rows = L * self.lane_rows
        checks.device_array(be, "q", q, np.float32, ndim=None)
        if tuple(q.shape) not in ((rows, NH, D), (rows, NH * D)):
            raise ValueError(f"q must have shape {(rows, NH, D)} or {(rows, NH * D)}, got {tuple(q.shape)}")
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            checks.device_array(be, name, c, np.float16, ndim=2)
            if pages is None and tuple(c.shape) != (L * self.kv_total, self.NKV * D):
                raise ValueError(f"{name} must have shape {(L * self.kv_total, self.NKV * D)}, "
                                 f"got {tuple(c.shape)}")
            if pages is not None and (c.shape[1] != self.NKV * D or c.shape[0] < self.page):
                raise ValueError(f"{name} must have shape [pool rows >= {self.page}, {self.NKV * D}], "
                                 f"got {tuple(c.shape)}")
            checks.aligned16(**{name: c})
        if pages is None:
            pages = self._dense
        checks.device_array(be, "pages", pages, np.int32, ndim=2)
        if tuple(pages.shape) != (L, self.n_pages):
            raise ValueError(f"pages must have shape {(L, self.n_pages)} (kv_total={self.kv_total} keys in pages "
                             f"of {self.page}), got {tuple(pages.shape)}")
        checks.device_array(be, "mask", mask, np.float16, ndim=None)
        if tuple(mask.shape) != (L, B, self.kv_total) and not (L == 1 and tuple(mask.shape) == (B, self.kv_total)):
            want = (L, B, self.kv_total) if L > 1 else f"{(B, self.kv_total)} or {(1, B, self.kv_total)}"
            raise ValueError(f"mask must have shape {want}, got {tuple(mask.shape)}")
        checks.device_array(be, "out", out, self.out_dtype, ndim=2)
        if tuple(out.shape) != (rows, NH * D):
            raise ValueError(f"out must have shape {(rows, NH * D)}, got {tuple(out.shape)}")
        for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("mask", mask)):
            checks.check_no_overlap(out=out, **{name: a})
        if pages is not None:
            checks.check_no_overlap(out=out, pages=pages)
        if self.gate is None:
            if gate is not None:
                raise ValueError("gate given but this RingAttention was built with gate=None")
            gate = out  # never read
        else:
            if gate is None:
                raise ValueError(f"gate is required (built with gate={self.gate!r})")
            checks.device_array(be, "gate", gate, np.float32, ndim=2)
            want = (rows, NH) if self.gate == "head" else (rows, NH * D)
            if tuple(gate.shape) != want:
                raise ValueError(f"gate must have shape {want} for gate={self.gate!r}, "
                                 f"got {tuple(gate.shape)}")
            checks.check_no_overlap(out=out, gate=gate)
        if live is not None:
            checks.device_array(be, "live", live, np.int32, ndim=2)
            if tuple(live.shape) != (L, DESC_LEN):
                raise ValueError(f"live must have shape {(L, DESC_LEN)} (the lanes' step descriptors), "
                                 f"got {tuple(live.shape)}")
        po = self.part_o if self.part_o is not None else out      # unused when n_splits == 1
        pml = self.part_ml if self.part_ml is not None else out
        cnt = self.counters if self.counters is not None else out  # unused unless merge == "fold"
        lv, use = (out, 0) if live is None else (live, 1)         # out: a valid pointer, never read
        if be.is_capturing():
            self._captured = True
        self._split(self._grid, self._block,
                    (q, k_cache, v_cache, pages, mask, po, pml, cnt, out, gate, np.float32(self.scale), lv,
                     np.int32(use)),
                    stream=stream)
        if self._combine is not None:
            self._combine(self._cgrid, (COMBINE_THREADS, 1, 1), (po, pml, gate, out, lv, np.int32(use)),
                          stream=stream)


def paged_reference(q, k_pool, v_pool, mask, pages, page: int, **kw) -> np.ndarray:
    """``ring_attention_reference`` of every lane of a paged call: lane ``l``'s keys read
    from the pools through its page table ``pages[l]``; ``q [lanes, q_len, ...]``, ``mask
    [lanes, q_len, kv_total]``, ``gate [lanes, q_len, ...]`` (``kw``). Returns ``[lanes, q_len,
    nh*d]``."""
    mask = np.asarray(mask)
    gate = kw.pop("gate", None)
    out = []
    for l in range(mask.shape[0]):
        rows = physical_rows(pages[l], page, mask.shape[2])
        out.append(ring_attention_reference(q[l], np.asarray(k_pool)[rows], np.asarray(v_pool)[rows], mask[l],
                                            gate=None if gate is None else gate[l], **kw))
    return np.stack(out)


def ring_attention_reference(q, k_cache, v_cache, mask, *, n_head_kv: int, scale: float | None = None,
                             gate=None, gate_mode: str | None = None) -> np.ndarray:
    """NumPy oracle of ``RingAttention`` in float64: ``q [B, nh, d]`` (or
    ``[B, nh*d]``) f32, caches f16 ``[S, nkv*d]`` converted exactly, additive
    f16 ``mask [B, S]``. Returns f32 ``[B, nh*d]``; rows with every key hidden
    give 0. ``gate_mode``: ``None``, ``"head"`` (``gate [B, nh]``) or
    ``"element"`` (``gate [B, nh*d]``), applied as ``softplus(gate)``."""
    k = np.asarray(k_cache, dtype=np.float16).astype(np.float64)
    v = np.asarray(v_cache, dtype=np.float16).astype(np.float64)
    S = k.shape[0]
    nkv = int(n_head_kv)
    d = k.shape[1] // nkv
    qq = np.asarray(q, dtype=np.float32).astype(np.float64)
    B = qq.shape[0]
    qq = qq.reshape(B, -1, d)
    nh = qq.shape[1]
    rep = nh // nkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kh = np.repeat(k.reshape(S, nkv, d), rep, axis=1)          # [S, nh, d]
    vh = np.repeat(v.reshape(S, nkv, d), rep, axis=1)
    m = np.asarray(mask, dtype=np.float16).astype(np.float64)  # [B, S]
    scores = np.einsum("bhd,shd->bhs", qq, kh) * scale + m[:, None, :]
    mx = scores.max(axis=-1, keepdims=True)
    hidden_row = ~np.isfinite(mx)
    with np.errstate(invalid="ignore"):
        p = np.exp(scores - np.where(hidden_row, 0.0, mx))
    p = np.where(hidden_row, 0.0, p)
    den = p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhs,shd->bhd", p, vh) / np.where(den > 0, den, 1.0)
    if gate_mode is not None:
        g = np.asarray(gate, dtype=np.float32).astype(np.float64)
        sp = np.logaddexp(0.0, g)
        o = o * (sp.reshape(B, nh, 1) if gate_mode == "head" else sp.reshape(B, nh, d))
    elif gate is not None:
        raise ValueError("gate given without gate_mode")
    return o.reshape(B, nh * d).astype(np.float32)
