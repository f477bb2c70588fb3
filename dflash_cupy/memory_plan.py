"""Device memory of a drafter deployment, by pool: ``bytes_for`` sizes one before anything is
allocated; ``MemoryReport`` is what ``DraftKvBatch.memory()`` / ``DraftKvCache.memory()``
return for a live one (the same pools, from the arrays it holds, plus page usage).

Pools (bytes; GiB = 2^30 in the printed tables):
  kv              every layer's K and V page pools, f16 ``[(pages + 1) * page_size, n_head_kv *
                  head_dim]`` x 2 x n_layer (``kv_pages.py``; the shared page included)
  feature_rings   the lanes' feature rings ``[lanes, ring_capacity, fc_in]`` in ``ring_dtype``
  masks           the step's masks f16 ``[lanes, q_len, kv_total]`` (full and/or sliding layers),
                  ``slot_pos`` int32 ``[lanes, slots]`` and the page table int32
  step            the step's own buffers (activations over every lane's rows, the bulk-append
                  workspace, logits / tokens / selector outputs, the GEMMs' split-K workspaces);
                  ``memory()`` counts it, ``bytes_for`` estimates it without the split-K
                  workspaces (their size follows the device's SM count and the tuned tilings)
  weights         the drafter's device weights and the LM head: shared by every cache built on
                  the same ``DraftWeights``, so reported apart from the cache's own total
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import dtypes
from .checks import int_arg
from .geometry import RingGeometry, align_up
from .kv_pages import DEFAULT_PAGE, check_page, lane_pages, pages_per_lane, pool_bytes

GIB = float(1 << 30)
POOLS = ("kv", "feature_rings", "masks", "step")   # a cache's own pools; weights are shared


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per pool (``pools``: ``POOLS`` plus ``weights``), and, for a paged K/V pool, its
    pages: ``page_size`` rows each, ``pages_used`` / ``pages_free`` and ``lane_pages`` (pages
    held per lane). ``total``: the cache's own pools (weights excluded, they are shared);
    ``with_weights``: everything."""
    pools: dict
    page_size: int = 0
    pages_used: int = 0
    pages_free: int = 0
    lane_pages: tuple = ()

    @property
    def total(self) -> int:
        return sum(self.pools.get(k, 0) for k in POOLS)

    @property
    def with_weights(self) -> int:
        return self.total + self.pools.get("weights", 0)

    def pages_line(self) -> str:
        """The page pool's use in one line (per lane for up to 16 lanes, else a summary)."""
        lp = list(self.lane_pages)
        per = (f"per lane {lp}" if len(lp) <= 16 else
               f"{sum(1 for p in lp if p)} of {len(lp)} lanes hold pages (at most {max(lp, default=0)})")
        return f"  pages of {self.page_size} rows: {self.pages_used} used, {self.pages_free} free; {per}"

    def table(self) -> str:
        """The pools as a small text table (GiB), then the pages, if any."""
        rows = [f"  {k:<14} {self.pools.get(k, 0) / GIB:10.3f} GiB" for k in (*POOLS, "weights")]
        rows.append(f"  {'total':<14} {self.total / GIB:10.3f} GiB  (with weights {self.with_weights / GIB:.3f} GiB)")
        if self.page_size:
            rows.append(self.pages_line())
        return "\n".join(rows)


def side_by_side(planned: MemoryReport, held: MemoryReport) -> str:
    """``bytes_for``'s report beside a live object's ``memory()`` (MiB), pool by pool."""
    mib = float(1 << 20)
    rows = [f"  {'pool':<14} {'bytes_for':>12} {'memory()':>12}"]
    for k in (*POOLS, "weights"):
        rows.append(f"  {k:<14} {planned.pools.get(k, 0) / mib:10.3f} MiB {held.pools.get(k, 0) / mib:8.3f} MiB")
    rows.append(f"  {'total':<14} {planned.total / mib:10.3f} MiB {held.total / mib:8.3f} MiB  (weights apart)")
    if held.page_size:
        rows.append(held.pages_line())
    return "\n".join(rows)


def weight_bytes(config, weight_dtype=np.float16, vocab: int = 0, lm_head_dtype=np.float16) -> int:
    """Device bytes of the drafter's weights as ``DeviceWeights`` places them (matrices in their
    checkpoint dtype, norms and convolution bases f32) plus an LM head ``[vocab, hidden]``."""
    from .weights import expected_shapes
    wsize = dtypes.DEVICE[dtypes.kind_of(weight_dtype, "weight_dtype")].itemsize
    total = 0
    for name, shape in expected_shapes(config).items():
        f32 = len(shape) == 1 or name.endswith(".base_kernel")
        total += int(np.prod(shape)) * (4 if f32 else wsize)
    if vocab:
        total += vocab * config.hidden_size * dtypes.DEVICE[dtypes.kind_of(lm_head_dtype, "lm_head_dtype")].itemsize
    return total


def mask_bytes(config, lanes: int, geom: RingGeometry, table_entries: int = 0) -> int:
    """The masks (one per attention kind present), ``slot_pos`` and ``table_entries`` page-table
    entries per lane."""
    n_masks = int(config.any_full) + int(config.any_sliding)
    return lanes * (n_masks * geom.q_len * geom.kv_total * 2 + geom.slots * 4 + table_entries * 4)


def step_bytes_estimate(config, lanes: int, *, vocab: int = 0, logits: bool = True, bulk_chunk: int = 256,
                        lm16: bool = True) -> int:
    """An estimate of the step's own buffers (every activation f32, where the engine stores
    some in 16 bits; no split-K workspace): the rows of every lane's step, the bulk-append
    workspace, the LM head's outputs (``lm16``: a 16-bit LM head, whose DFlash 2 top-K is
    fused into its GEMM: per-block partials instead of logits the selector reads)."""
    H, B = config.hidden_size, config.block_size
    cs, bs = align_up(2 * B + 2, 16), align_up(B, 16)
    nc, nn = lanes * cs, lanes * bs
    kvw, gate = config.kv_dim, {"none": 0, "head": config.n_head, "element": config.q_dim}[config.attn_gate]
    rows = (nc + nn) * (3 * H + config.q_dim + 2 * kvw + config.q_dim + 1)   # resid, xin, qkv, q_all, tiles
    rows += nc * config.fc_in + nn * (H + config.q_dim + gate + config.intermediate_size + 2 * H)
    if config.dflash2 is not None:
        rows += nn * (2 * H + config.dflash2.projection_rows(H))
    bulk = bulk_chunk * (config.fc_in + 2 * H + 2 * kvw + 2)
    out = 0
    if vocab:
        # 4-byte elements: the logits (when written, or the selector reads them), the tokens
        fused = config.dflash2 is not None and lm16
        out = nn * (vocab * int(logits or (config.dflash2 is not None and not fused)) + 1)
        if config.dflash2 is not None:
            k = config.dflash2.selector_top_k
            out += lanes * (B + 1 + (B - 1) * (3 * k + 1))
            if fused:   # the fused top-K's partials: (key, id) per row, 256-column block and candidate
                out += nn * -(-vocab // 256) * k * 2
    return 4 * (rows + bulk + out) + 4096


def bytes_for(config, lanes: int, window: int, *, rewind_slack: int = 0, ring_capacity: int | None = None,
              ring_dtype=np.float32, page_size: int = DEFAULT_PAGE, kv_pages: int | None = None,
              weight_dtype=np.float16, vocab: int = 0, lm_head_dtype=np.float16, logits: bool = True,
              bulk_chunk: int = 256) -> MemoryReport:
    """The device memory of ``lanes`` requests with ``window``-position windows, before anything
    is allocated: a ``MemoryReport`` (``.total``, ``.with_weights``, ``.table()``), the same
    pools ``memory()`` reports for ``DraftKvBatch(weights, window, lanes, ...)`` built with
    these arguments.

    ``rewind_slack``: extra K/V ring slots per lane; ``ring_capacity``: feature-ring rows per
    lane (default ``window``); ``page_size`` / ``kv_pages``: the K/V pools (``kv_pages.py``:
    ``kv_pages`` usable pages of ``page_size`` rows per pool, default every lane's worst case,
    plus the shared page); ``vocab`` > 0: an LM head."""
    lanes = int_arg(lanes, "lanes", 1)
    window = int_arg(window, "window", 1)
    rewind_slack = int_arg(rewind_slack, "rewind_slack", 0)
    ring_capacity = window if ring_capacity is None else int_arg(ring_capacity, "ring_capacity", 1)
    geom = RingGeometry(window, config.block_size, rewind_slack)
    rsize = dtypes.DEVICE[dtypes.kind_of(ring_dtype, "ring_dtype")].itemsize
    page = check_page(page_size)
    worst = lane_pages(geom.slots, geom.slots, geom.q_len, page)
    pages = lanes * worst if kv_pages is None else int_arg(kv_pages, "kv_pages", 1)
    pools = {
        "kv": pool_bytes(lanes, geom.slots, geom.q_len, config.kv_dim * 2, 2 * config.n_layer, page, pages),
        "feature_rings": lanes * ring_capacity * config.fc_in * rsize,
        "masks": mask_bytes(config, lanes, geom, pages_per_lane(geom.kv_total, page)),
        "step": step_bytes_estimate(config, lanes, vocab=vocab, logits=logits, bulk_chunk=bulk_chunk,
                                    lm16=dtypes.kind_of(lm_head_dtype, "lm_head_dtype") != "f32"),
        "weights": weight_bytes(config, weight_dtype, vocab, lm_head_dtype),
    }
    return MemoryReport(pools, page_size=page, pages_free=pages, lane_pages=(0,) * lanes)
