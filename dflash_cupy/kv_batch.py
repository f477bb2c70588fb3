"""``DraftKvBatch``: many requests ("lanes") drafted in one captured step, so
each weight is streamed from memory once per step for all of them.

Each lane is an independent request with the single-lane cache's semantics
(SPEC §3-§4): its own feature ring (``batch.rings[lane]``, a ``FeatureRing``),
positions, window, rewinds, jumps and resets. One ``begin_step(committed)``
plans every lane (``committed[lane]``: the lane's committed tokens, or
``None``: the lane is idle this step); one ``run()`` replays one graph for all
of them. Lanes join and leave through the step descriptor, never by
recapturing: the two step graphs (alternating descriptor buffers, as in
``DraftKvCache``) are captured once for the batch's lifetime.

Device layout (lanes ``L``; ``CS = align16(a_step)``, ``BS = align16(q_len)``):

  desc                [L, DESC_LEN] int32: one step descriptor per lane
                      (``DESC_ACTIVE`` 0 marks an idle lane)
  k_cache[l], v_cache[l]
                      [L*kv_total, n_head_kv*head_dim] f16: lane ``i``'s ring
                      at rows ``[i*kv_total, (i+1)*kv_total)`` (SPEC §3 layout)
  slot_pos            [L, capacity] int32;  masks [L, q_len, kv_total] f16
  ring storage        [L, ring_capacity, fc_in]: lane ``i``'s ``FeatureRing``
  step rows (the GEMMs' M axis): ctx rows ``[0, L*CS)``: the active lanes'
                      appended context rows packed back to back in lane order
                      (lane ``i``'s at ``desc[i, DESC_CTX_ROW0]``, so 16 lanes
                      appending 6 rows each are 96 GEMM rows, not 16 tiles), the
                      rest padding; then noise rows (lane ``i``'s ``q_len`` rows at
                      ``L*CS + i*BS``)
  tile_live           [L*(CS+BS)/16] int32: nonzero iff the 16-row tile holds a
                      live row (a packed context row or a noise row of an active
                      lane); written on the device by the planning kernel

Per step on the device: one descriptor copy, one planning launch for all
lanes (``step_plan.cu``'s ``plan_lanes``), one GEMM per weight over every live
row of every lane (the stream GEMM skips dead tiles: idle lanes and the
padding cost no rows), attention per (lane, kv head) over that lane's ring
and masks. Bulk appends (a joining lane's prefill, jumps, the append after a
rewind) run outside the graph, for that lane only, in chunks.

Outputs: ``hidden_states [L, q_len, hidden]`` f32 and, with ``lm_head``,
``draft_tokens [L, q_len]`` int32 (greedy) and ``logits [L, q_len, vocab]``
(iff ``logits=True``): views of the batch's own buffers, rewritten by every
step; an idle lane's rows are not meaningful.

Streams: as ``DraftKvCache`` (work on the caller's current stream or
``stream=``; event edges order it after this batch's earlier work and the
rings' latest writes; the host never waits on the step it just launched).
"""
from __future__ import annotations

import numpy as np

from .checks import int_arg
from .feature_ring import FeatureRing
from .geometry import RingGeometry, align_up
from .interop import device_view
from .nvtx_ranges import nvtx_range
from .step_issuer import StepIssuer
from .ops.gather import FeatureGather
from .ops.sample import SamplingParams
from .ops.step_descriptor import (DESC_ACTIVE, DESC_COMMITTED, DESC_LEN, DESC_START, bulk_chunks, fill_chunk_descriptor,
                                  pack_descriptors, decide_lanes)
from .rope_params import rope_parameters
from .weights import DraftWeights

MAX_LANES = 256
GEMM_MAX_M = 64  # the GEMMs' largest M tile; more rows run as more row blocks of the same launch
TILE_ROWS = 16   # the stream GEMM's row tile: lane regions are whole tiles, so a dead lane is whole dead tiles



class DraftKvBatch(StepIssuer):
    """``DraftKvBatch(weights, capacity, lanes, *, ring_capacity=None,
    ring_dtype=np.float32, lm_head=None, logits=True, backend=None, bulk_chunk=256, x_split=True,
    tune=None, pdl=False, selfcheck=None)``.

    ``capacity``: each lane's context window cap (ring-cache slots, as
    ``DraftKvCache``). ``ring_capacity`` (default ``capacity``) and
    ``ring_dtype`` size the lanes' feature rings, ``batch.rings[i]``: write a
    lane's target hidden states there (``rings[i].write(pos, rows)``) before
    planning a step that needs them. ``lm_head``: ``[vocab, hidden]`` (NumPy or
    a device array, as for ``DraftKvCache``); draft tokens are greedy.
    ``x_split``: as ``DraftKvCache`` (a lane equals a single cache built with
    the same ``x_split`` bit for bit). With many active lanes the GEMMs are
    bound by MMA issue, not by the weight stream, and ``x_split=False`` halves
    that work (``python -m profiling.lanes_model --x-split both``). ``tune``:
    as ``DraftKvCache`` (the GEMMs tuned at the batch's full row count). ``pdl``:
    as ``DraftKvCache`` (programmatic dependent launch in the step graphs; off by default).
    ``selfcheck``: as ``DraftKvCache`` (the device's self-check verdict picks the kernel variants).
    """

    lane_batched = True

    _nvtx = "dflash batch"

    def __init__(self, weights: DraftWeights, capacity: int, lanes: int, *, ring_capacity=None,
                 ring_dtype=np.float32, lm_head=None, logits: bool = True, backend=None, bulk_chunk: int = 256,
                 x_split: bool = True, tune: bool | None = None, pdl: bool = False, selfcheck=None):
        if not isinstance(weights, DraftWeights):
            raise TypeError(f"weights must be a DraftWeights, got {type(weights).__name__}")
        from .kv_cache import MAX_CAPACITY
        capacity = int_arg(capacity, "capacity", 1)
        if capacity > MAX_CAPACITY:
            raise ValueError(f"capacity={capacity} exceeds {MAX_CAPACITY} ring slots")
        lanes = int_arg(lanes, "lanes", 1)
        if lanes > MAX_LANES:
            raise ValueError(f"lanes={lanes} exceeds {MAX_LANES}")
        ring_capacity = capacity if ring_capacity is None else int_arg(ring_capacity, "ring_capacity", 1)
        if ring_capacity < capacity:
            raise ValueError(f"ring_capacity={ring_capacity} is smaller than capacity={capacity}: a lane's ring "
                             f"must hold its whole window")
        from .geometry import BULK_CHUNK
        if not isinstance(bulk_chunk, int) or isinstance(bulk_chunk, bool) or not 1 <= bulk_chunk <= BULK_CHUNK:
            raise ValueError(f"bulk_chunk must be an int in [1, {BULK_CHUNK}], got {bulk_chunk!r}")
        if not isinstance(logits, (bool, np.bool_)):
            raise TypeError(f"logits must be a bool, got {type(logits).__name__}")
        self._take_args(weights, backend, x_split, pdl, tune, selfcheck)
        be, c = self.backend, self.config
        self.lanes = lanes
        self.geom = g = RingGeometry(capacity, c.q_len)
        if lanes * g.kv_total >= 2**31:
            raise ValueError(f"lanes={lanes} x {g.kv_total} cache rows per lane overflow int32 row indices")
        self.dw = weights.device(be)
        self.bulk_chunk = int(bulk_chunk)
        H, B, A, kvw = c.hidden_size, g.q_len, g.a_step, c.kv_dim
        CS, BS = align_up(A, TILE_ROWS), align_up(B, TILE_ROWS)
        self.ctx_rows, self.lane_rows = CS, BS
        NC, NN = lanes * CS, lanes * BS   # ctx rows, noise rows
        M = NC + NN
        self.write_logits = bool(logits)

        # ---- lanes' feature rings: one lane-axis storage, a FeatureRing view per lane
        storage = be.zeros((lanes, ring_capacity, c.fc_in), _ring_device_dtype(ring_dtype))
        be.label(storage, "DraftKvBatch ring storage")
        self.ring_storage = storage
        self.rings = [FeatureRing(ring_capacity, c.n_captured, H, ring_dtype, backend=be, storage=storage[i])
                      for i in range(lanes)]

        # ---- caches and step state
        self.k_cache = [be.zeros((lanes * g.kv_total, kvw), np.float16) for _ in range(c.n_layer)]
        self.v_cache = [be.zeros((lanes * g.kv_total, kvw), np.float16) for _ in range(c.n_layer)]
        self.mask_full = be.zeros((lanes, B, g.kv_total), np.float16) if c.any_full else None
        self.mask_swa = be.zeros((lanes, B, g.kv_total), np.float16) if c.any_sliding else None
        self.slot_pos = be.asarray(np.full((lanes, capacity), -1, np.int32))
        self.desc = be.zeros((lanes, DESC_LEN), np.int32)
        self.tile_live = be.zeros((M // TILE_ROWS,), np.int32)
        self.tiles_ctx, self.tiles_noise = self.tile_live[:NC // TILE_ROWS], self.tile_live[NC // TILE_ROWS:]
        pos0 = np.zeros(M, np.int32)
        rows0 = np.zeros(M, np.int32)
        for i in range(lanes):   # noise rows: fixed cache rows (the lane's noise scratch, padding -> trash)
            j = np.arange(BS)
            rows0[NC + i * BS + j] = i * g.kv_total + np.where(j < B, g.capacity + j, g.trash_slot)
            rows0[i * CS:(i + 1) * CS] = i * g.kv_total + g.trash_slot
        self.pos_all, self.rows_all = be.asarray(pos0), be.asarray(rows0)
        inv_freq, self.attn_scaling = rope_parameters(c)
        self.inv_freq = be.asarray(np.asarray(inv_freq, np.float64))

        # ---- step activations (rows as above)
        self.ap_feat = be.zeros((NC, c.fc_in), np.float32)
        gate_w = self._alloc_step_rows(NC, NN)
        self.hidden_states = self._hs.reshape(lanes, BS, H)[:, :B]

        # ---- bulk append workspace (one lane at a time, outside the graph)
        R = self.bulk_chunk
        self.bulk_desc = be.zeros((DESC_LEN,), np.int32)
        self.ap_pos = be.zeros((R,), np.int32)
        self.ap_rows = be.zeros((R,), np.int32)
        self.bulk_feat = be.zeros((R, c.fc_in), np.float32)
        self.ctx = be.zeros((R, H), np.float32)
        self.ctx_kv_in = be.zeros((R, H), np.float32) if c.context_kv_layer_norm else None
        self.ctx_kv = be.zeros((R, 2 * kvw), np.float32)

        # ---- lm head (greedy tokens)
        self.lm_head = self.logits = self.draft_tokens = self._logits = self._tokens = None
        if lm_head is not None:
            self.lm_head = self._place_lm_head(lm_head)
            V = self.lm_head.shape[0]
            self._tokens = be.zeros((NN,), np.int32)
            self.draft_tokens = self._tokens.reshape(lanes, BS)[:, :B]
            if logits:
                self._logits = be.zeros((NN, V), np.float32)
                self.logits = self._logits.reshape(lanes, BS, V)[:, :B]
                self.sample_knobs = be.asarray(np.asarray(SamplingParams().knobs(), np.float32))
                self.sample_rng = be.zeros((2,), np.uint64)

        # ---- pinned staging (two of each: alternating steps)
        self._desc_host = [be.pinned_empty((lanes, DESC_LEN), np.int32) for _ in range(2)]
        self._noise_host = [be.pinned_empty((NN, H), np.float32) for _ in range(2)]
        for a in self._desc_host + self._noise_host:
            a[...] = 0
        self._noise_events = [be.event() for _ in range(2)]
        self._noise_next = 0
        n_chunks = -(-capacity // self.bulk_chunk) + 1
        self._n_chunks = n_chunks
        self._bulk_desc_host = be.pinned_empty((lanes * n_chunks, DESC_LEN), np.int32)
        for i in range(2):
            be.label(self._desc_host[i], f"DraftKvBatch step descriptor staging [{i}]")
            be.label(self._noise_host[i], f"DraftKvBatch noise staging [{i}]")
        be.label(self._bulk_desc_host, "DraftKvBatch bulk descriptor staging")
        self._events = [be.event() for _ in range(2)]
        self._bulk_event = be.event()

        # ---- kernels (all compiled now: nothing compiles during capture)
        # max_m: the most rows one call sees (all lanes' rows, or a bulk chunk); past one 64-row
        # block the stream GEMMs compile their wgmma variants too (an sm_90a device or the emulator).
        # The attention: one launch for every (lane, kv head); an idle lane's blocks exit at once
        self._build_step_ops(max(GEMM_MAX_M, NC + NN, R), gate_w, logits, lanes=lanes, lane_rows=BS)
        ring_kind = self.rings[0].kind
        self.gather = FeatureGather(be, c.fc_in, ring_capacity, ring_kind)

        self._next = np.zeros(lanes, np.int64)   # per lane: next position to append (next_pos)
        self._plan_desc = self._plan = None   # the planned step's descriptors (pinned) and LaneDecisions
        self._plan_fields = [None] * lanes
        self._ring_writes = [-1] * lanes   # each ring's write count when a step last waited for it
        self._finish_init(("_hs", "_logits", "_tokens", "noise_embed", "k_cache", "v_cache", "slot_pos", "desc",
                           "resid", "xin", "ap_feat", "tile_live"), tune)

    # ------------------------------------------------------------------ properties
    _attn_live = property(lambda self: self.desc)   # (StepIssuer: idle lanes' attention blocks exit)

    def __repr__(self):
        return (f"DraftKvBatch(lanes={self.lanes}, {self.geom}, layers={self.config.n_layer}, "
                f"backend={self.backend.name})")

    def _check_lane(self, lane) -> int:
        if not isinstance(lane, (int, np.integer)) or isinstance(lane, bool):
            raise TypeError(f"lane must be an int, got {type(lane).__name__}")
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane={lane} out of range [0, {self.lanes})")
        return int(lane)

    # ------------------------------------------------------------------ the step body
    def _lane_cache(self, cache, lane):
        kv = self.geom.kv_total
        return cache[lane * kv:(lane + 1) * kv]

    def _bulk_append(self, lane: int, fields, s) -> None:
        be, ring = self.backend, self.rings[lane]
        s.wait_event(ring.write_event)
        slot_pos = self.slot_pos[lane]
        if fields.reset:
            self.ring_slots.reset_slots(slot_pos, stream=s)
        for i, (start, count) in enumerate(bulk_chunks(fields.bulk_start, fields.bulk_count, self.bulk_chunk)):
            host = self._bulk_desc_host[lane * self._n_chunks + i]
            be.host_write(host, "DraftKvBatch bulk chunk descriptor")
            fill_chunk_descriptor(host, fields, start, count)
            be.copy_h2d_async(self.bulk_desc, host, stream=s)
            self.ring_slots.plan_append(self.bulk_desc, self.ap_pos, self.ap_rows, slot_pos, n_rows=count, stream=s)
            self.gather(self.bulk_desc, self.ring_storage[lane], self.bulk_feat, n_rows=count, stream=s)
            self._append_rows(self.bulk_feat, count, [self._lane_cache(k, lane) for k in self.k_cache],
                              [self._lane_cache(v, lane) for v in self.v_cache], s)

    def _qkv_skip(self) -> dict:
        # every tile of the step's rows: 0 dead (idle lanes, padding), 2 a context tile (no Q)
        return dict(tile_live=self.tile_live)

    def _issue_step(self, slot: int, stream, eager: bool = False) -> None:
        """Every launch and copy of one step, in order (captured once per slot)."""
        self.backend.copy_h2d_async(self.desc, self._desc_host[slot], stream=stream)
        self.gather.plan_lanes(self.desc, self.ring_storage, self.ap_feat, self.geom, self.slot_pos, self.pos_all,
                               self.rows_all, self.tile_live, cs=self.ctx_rows, bs=self.lane_rows,
                               mask_full=self.mask_full, mask_swa=self.mask_swa, stream=stream)
        self._run_rows(stream, eager)

    # ------------------------------------------------------------------ public API
    def begin_step(self, committed, stream=None) -> None:
        """Plan one step for every lane: ``committed[i]`` is lane ``i``'s
        committed token count (an int > 0) or ``None`` (lane idle this step:
        no rows, no attention, its state unchanged). Host O(lanes); bulk
        appends, when a lane needs one, run on the current stream (or
        ``stream``) for that lane only. Validates every lane before changing
        anything."""
        self._check_open()
        with nvtx_range("dflash batch plan", "green"):
            stream = self.backend.as_stream(stream)
            try:
                committed = list(committed)
            except TypeError:
                raise TypeError(f"committed must be a sequence of {self.lanes} ints or None, "
                                f"got {type(committed).__name__}") from None
            if len(committed) != self.lanes:
                raise ValueError(f"committed has {len(committed)} entries, expected one per lane ({self.lanes})")
            plan = decide_lanes(committed, self._next.tolist(), self.rings, self.geom, self.config.swa_window)
            # ---- validated: from here on state changes
            be = self.backend
            slot = self._slot ^ 1
            self.order.reuse(self._events[slot])
            if plan.bulk:
                self.order.reuse(self._bulk_event)
                s = self.order.order(stream)
                with nvtx_range("dflash batch bulk append", "red"):
                    for i, f in plan.bulk:
                        self._bulk_append(i, f, s)
                        self._next[i] = f.committed
                self._bulk_event.record(s)
                for i, _ in plan.bulk:
                    self.rings[i].note_read(self, self._bulk_event)
                self.order.issued(s)
            host = self._desc_host[slot]
            be.host_write(host, "DraftKvBatch.begin_step (descriptors)")
            pack_descriptors(host, plan.vals)
            self._slot = slot
            self._plan, self._plan_fields, self._plan_desc = plan, None, host
            self._planned = True

    @property
    def next_pos(self) -> list:
        """Per lane: the position after the last row its cache holds."""
        return [int(x) for x in self._next]

    @next_pos.setter
    def next_pos(self, v) -> None:
        self._next[:] = v

    @property
    def last_plan(self) -> list:
        """Per lane: the ``StepFields`` of the latest planned step (``None``: idle)."""
        if self._plan_fields is None and self._plan is not None:
            self._plan_fields = [self._plan.fields(i) for i in range(self.lanes)]
        return self._plan_fields

    def set_noise_embed(self, noise_embed, stream=None) -> None:
        """Copy ``[lanes, q_len, hidden]`` noise embeddings (NumPy, or a device
        f32 array read in order on the current stream or ``stream``) into the
        batch (idle lanes' rows are ignored)."""
        self._check_open()
        be, c = self.backend, self.config
        shape = (self.lanes, self.q_len, c.hidden_size)
        dev = device_view(be, noise_embed, "noise_embed", dtype=np.float32, shape=shape)
        if dev is None:
            host = self._check_host_noise(noise_embed, shape)
        stream = be.as_stream(stream)
        s = self.order.order(stream)
        B, BS = self.q_len, self.lane_rows
        if dev is None:
            self._copy_noise_host(host, s)
        elif BS == B:
            be.copy_d2d_async(self.noise_embed, dev.reshape(self.lanes * B, -1), stream=s)
        else:
            for i in range(self.lanes):
                be.copy_d2d_async(self.noise_embed[i * BS:i * BS + B], dev[i], stream=s)
        self.order.issued(s)

    def _noise_rows(self, stage):
        # lane i's q_len rows at the start of its lane_rows (the rest: padding, never read)
        return stage.reshape(self.lanes, self.lane_rows, -1)[:, :self.q_len]

    def run(self, eager: bool = False, stream=None):
        """Replay the planned step for every lane (``eager``: launch the
        kernels one by one, same results); returns ``hidden_states``
        ``[lanes, q_len, hidden]`` (rewritten by the next step)."""
        self._check_open()
        if not self._planned:
            raise RuntimeError("run() needs a planned step: call begin_step(committed) first")
        # the planned descriptors (pinned; the next begin_step writes the other buffer): the
        # step reads ring positions [start, committed) of each active lane
        d = self._plan_desc
        act, c, need = d[:, DESC_ACTIVE] != 0, d[:, DESC_COMMITTED].astype(np.int64), d[:, DESC_START]
        rings = self.rings
        rlo = np.fromiter((r.lo for r in rings), np.int64, self.lanes)
        rhi = np.fromiter((r.hi for r in rings), np.int64, self.lanes)
        bad = act & (need < c) & ~((rlo <= need) & (c <= rhi))
        closed = [i for i, r in enumerate(rings) if r._closed and act[i]]
        if closed:
            raise RuntimeError(f"run(): lane {closed[0]}'s ring has been closed")
        if bad.any():
            i = int(np.argmax(bad))
            raise RuntimeError(f"run(): lane {i}'s ring no longer holds positions [{need[i]}, {c[i]}) that this "
                               f"step was planned to append (it holds [{rings[i].lo}, {rings[i].hi})); call "
                               f"begin_step again")
        slot = self._slot
        s = self.order.order(stream)
        # The planning launch takes every lane's ring storage: wait for the rings written
        # since the last step (the older writes are ordered before it already: by that
        # step's waits, then stream order or the edge to _tail).
        seen = self._ring_writes
        for i, ring in enumerate(self.rings):
            if ring.writes != seen[i]:
                s.wait_event(ring.write_event)
                seen[i] = ring.writes
        self.graphs.launch(slot, s, eager)
        self._events[slot].record(s)
        for ring in self.rings:
            ring.note_read(self, self._events[slot])
        self.order.issued(s)
        self._planned = False
        self._next[act] = c[act]
        return self.hidden_states

    def step(self, committed, noise_embed, stream=None):
        """``begin_step`` + ``set_noise_embed`` + ``run`` on one stream."""
        self._check_open()
        stream = self.backend.as_stream(stream)
        self.begin_step(committed, stream=stream)
        self.set_noise_embed(noise_embed, stream=stream)
        return self.run(stream=stream)

    def reset(self, lane=None, stream=None) -> None:
        """Forget lane ``lane``'s cached rows (``None``: every lane's), on the
        current stream (or ``stream``); a planned, not yet run step is dropped."""
        self._check_open()
        lanes = range(self.lanes) if lane is None else [self._check_lane(lane)]
        s = self.order.order(stream)
        self._planned = False
        for i in lanes:
            self._next[i] = 0
            self.ring_slots.reset_slots(self.slot_pos[i], stream=s)
        self.order.issued(s)

    def close(self) -> None:
        if self._closed:
            return
        self.order.drain()
        for ring in self.rings or ():
            ring.forget_reader(self)
            ring.close()
        keep = {"backend", "config", "weights", "geom", "lanes", "_next", "_plan_fields", "_plan", "_closed"}
        self._release(keep)



def _ring_device_dtype(dtype):
    from . import dtypes
    return dtypes.DEVICE[dtypes.kind_of(dtype, "ring_dtype")]
