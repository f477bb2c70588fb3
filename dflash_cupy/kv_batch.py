"""``DraftKvBatch``: many requests ("lanes") drafted in one captured step, so
each weight is streamed from memory once per step for all of them: a facade over
the one step engine (``step_engine.py``: its device layout, planning and streams).

Each lane is an independent request with the single-lane cache's semantics
(SPEC §3-§4): its own feature ring (``batch.rings[lane]``, a ``FeatureRing``),
positions, window, rewinds, jumps and resets. One ``begin_step(committed)``
plans every lane (``committed[lane]``: the lane's committed tokens, or
``None``: the lane is idle this step); one ``run()`` replays one graph for all
of them. Lanes join and leave through the step descriptors, never by
recapturing: the two step graphs are captured once for the batch's lifetime.
Bulk appends (a joining lane's prefill, jumps, the append after a rewind) run
outside the graph, for that lane only, in chunks.

Outputs: ``hidden_states [L, q_len, hidden]`` f32 and, with ``lm_head``,
``draft_tokens [L, q_len]`` int32 (greedy, or drawn per each lane's ``sampling``) and
``logits [L, q_len, vocab]`` (iff ``logits=True``); a DFlash 2 drafter adds the selector's
``candidate_ids`` / ``candidate_values`` / ``selector_choice`` / ``selector_q`` per lane. All
are views of the batch's own buffers, rewritten by every step; an idle lane's rows are not
meaningful.

Streams: as ``DraftKvCache`` (work on the caller's current stream or
``stream=``; event edges order it after this batch's earlier work and the
rings' latest writes; the host never waits on the step it just launched).
"""
from __future__ import annotations

import numpy as np

from .checks import int_arg
from .feature_ring import FeatureRing
from .geometry import BULK_CHUNK
from .interop import array_like, device_view
from .kv_pages import DEFAULT_PAGE
from .nvtx_ranges import nvtx_range
from .ops.step_descriptor import DESC_ACTIVE, DESC_LEN
from .step_engine import EngineFacade, StepEngine
from .weights import DraftWeights

MAX_LANES = 256


def _lane_word(lane: int) -> str:
    return f"lane {lane}'s ring"


class DraftKvBatch(EngineFacade):
    """``DraftKvBatch(weights, capacity, lanes, *, ring_capacity=None,
    ring_dtype=np.float32, lm_head=None, logits=True, sampling=None, backend=None, bulk_chunk=256,
    x_split=True, tune=None, pdl=False, selfcheck=None, rewind_slack=0, page_size=64, kv_pages=None)``.

    ``capacity``: each lane's context window cap; ``rewind_slack``: as ``DraftKvCache``
    (each lane's K/V ring has ``capacity + rewind_slack`` slots). ``ring_capacity`` (default
    ``capacity``; smaller is allowed: a step reads only the rows it appends) and
    ``ring_dtype`` size the lanes' feature rings, ``batch.rings[i]``: write a
    lane's target hidden states there (``rings[i].write(pos, rows)``) before
    planning a step that needs them, or stream a prompt longer than the ring with
    ``prefill(lane, rows)``. ``lm_head``: ``[vocab, hidden]`` (NumPy or
    a device array, as for ``DraftKvCache``); with it each step ends in ``draft_tokens``.
    ``sampling`` (default None: greedy), as ``DraftKvCache``'s but per lane: one
    ``SamplingParams`` for every lane, or a sequence of ``lanes`` of them (lane ``i`` uses
    ``sampling[i]``); ``set_sampling`` changes it between steps (no recapture). Each lane draws
    with its own temperature (top-k, top-p: DFlash v1 with ``logits=True``), its own seed and,
    as the counter, its own first noise position (``committed[i]``), so lane ``i`` equals a
    single ``DraftKvCache`` built with the same ``SamplingParams`` bit for bit (tokens and, for
    DFlash 2, the selector's ``selector_q``). One ``SamplingParams`` shared by lanes gives them
    the same seed: lanes at the same position then draw the same uniforms; give independent
    requests their own seeds with a sequence.
    ``x_split``: as ``DraftKvCache`` (a lane equals a single cache built with
    the same ``x_split`` bit for bit). With many active lanes the GEMMs are
    bound by MMA issue, not by the weight stream, and ``x_split=False`` halves
    that work (``python -m profiling.lanes_model --x-split both``). ``tune``:
    as ``DraftKvCache`` (the GEMMs tuned at the batch's full row count). ``pdl``:
    as ``DraftKvCache`` (programmatic dependent launch in the step graphs; off by default).
    ``selfcheck``: as ``DraftKvCache`` (the device's self-check verdict picks the kernel variants).
    ``page_size``, ``kv_pages``: the K/V pools (``kv_pages.py``): rows per page (a multiple
    of 32) and pages per pool, shared by the lanes (default: every lane's worst case, so no
    step is ever refused); a lane takes pages as its window grows and gives them back on
    ``reset``; a step whose lanes cannot get their pages is refused at ``begin_step``
    (``kv_pages.PagesRefused``, naming the lane and the shortfall; nothing changed).
    ``kv_memory()``: the pools' accounting.
    """

    def __init__(self, weights: DraftWeights, capacity: int, lanes: int, *, ring_capacity=None,
                 ring_dtype=np.float32, lm_head=None, logits: bool = True, sampling=None, backend=None,
                 bulk_chunk: int = 256, x_split: bool = True, tune: bool | None = None, pdl: bool = False,
                 selfcheck=None, rewind_slack: int = 0, page_size: int = DEFAULT_PAGE, kv_pages=None):
        if not isinstance(weights, DraftWeights):
            raise TypeError(f"weights must be a DraftWeights, got {type(weights).__name__}")
        from .kv_cache import check_ring_size
        capacity, rewind_slack = check_ring_size(capacity, rewind_slack)
        lanes = int_arg(lanes, "lanes", 1)
        if lanes > MAX_LANES:
            raise ValueError(f"lanes={lanes} exceeds {MAX_LANES}")
        ring_capacity = capacity if ring_capacity is None else int_arg(ring_capacity, "ring_capacity", 1)
        if not isinstance(bulk_chunk, int) or isinstance(bulk_chunk, bool) or not 1 <= bulk_chunk <= BULK_CHUNK:
            raise ValueError(f"bulk_chunk must be an int in [1, {BULK_CHUNK}], got {bulk_chunk!r}")
        if not isinstance(logits, (bool, np.bool_)):
            raise TypeError(f"logits must be a bool, got {type(logits).__name__}")
        ring_device_dtype = _ring_device_dtype(ring_dtype)
        self.engine = e = StepEngine.build(weights, capacity, lanes, owner="DraftKvBatch", lm_head=lm_head, logits=logits,
                                     sampling=sampling, per_lane_sampling=True, backend=backend,
                                     bulk_chunk=bulk_chunk, x_split=x_split, tune=tune, pdl=pdl,
                                     selfcheck=selfcheck, rewind_slack=rewind_slack, page_size=page_size,
                                     kv_pages=kv_pages)
        be, c = e.backend, e.config
        self.backend, self.config, self.weights, self.geom, self.lanes = be, c, weights, e.geom, lanes
        # ---- lanes' feature rings: one lane-axis storage, a FeatureRing view per lane
        storage = be.zeros((lanes, ring_capacity, c.fc_in), ring_device_dtype)
        be.label(storage, "DraftKvBatch ring storage")
        self.ring_storage = storage
        self.rings = [FeatureRing(ring_capacity, c.n_captured, c.hidden_size, ring_dtype, backend=be,
                                  storage=storage[i]) for i in range(lanes)]
        e.bind_rings(self.rings, storage)
        self.gather = e.gather
        self.hidden_states, self.logits, self.draft_tokens = e.hidden_states, e.logits, e.draft_tokens
        # DFlash 2 with an LM head (SPEC §6): the selector's outputs per lane, rows 1..q_len-1
        self.candidate_ids = self.candidate_values = self.selector_choice = self.selector_q = None
        if e.selects:
            self.candidate_ids, self.candidate_values = e.candidate_ids, e.candidate_values
            self.selector_choice, self.selector_q = e.selector_choice, e.selector_q
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def sampling(self) -> tuple:
        """Per lane: the ``SamplingParams`` its next planned steps draw with."""
        return self.engine.sampling

    def __repr__(self):
        return (f"DraftKvBatch(lanes={self.lanes}, {self.geom}, layers={self.config.n_layer}, "
                f"backend={self.backend.name})")

    def _check_lane(self, lane) -> int:
        if not isinstance(lane, (int, np.integer)) or isinstance(lane, bool):
            raise TypeError(f"lane must be an int, got {type(lane).__name__}")
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane={lane} out of range [0, {self.lanes})")
        return int(lane)

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
            self.engine.plan(self._per_lane(committed, "committed", "ints or None"), stream)

    def append(self, committed, stream=None) -> None:
        """Append each lane's rows up to ``committed[i]`` (``None``: lane untouched) as
        ``begin_step`` would, outside the graph and with no step (a caller can alternate
        ``rings[i].write`` and ``append`` to stream a prompt through a smaller ring;
        ``prefill`` does both). Validates every lane before changing anything; a planned,
        not yet run step is dropped."""
        self._check_open()
        stream = self.backend.as_stream(stream)
        self.engine.append(self._per_lane(committed, "committed", "ints or None"), stream)

    def prefill(self, lane, rows, stream=None, *, start=None) -> None:
        """Streaming prefill of lane ``lane``: write its feature rows ``rows [n, fc_in]``
        (positions ``start ..``, default ``next_pos[lane]``; ``n`` may exceed its ring) into
        ``rings[lane]`` and
        append them chunk by chunk, as ``DraftKvCache.prefill``. Other lanes are untouched; a
        planned, not yet run step is dropped; bad ``rows`` raise before any change."""
        self._check_open()
        lane = self._check_lane(lane)
        self.engine.prefill(lane, rows, self.backend.as_stream(stream), start)

    @property
    def next_pos(self) -> list:
        """Per lane: the position after the last row its cache holds."""
        return list(self.engine._next)

    @next_pos.setter
    def next_pos(self, v) -> None:
        v = [int_arg(x, "next_pos", 0) for x in v]
        if len(v) != self.lanes:
            raise ValueError(f"next_pos has {len(v)} entries, expected one per lane ({self.lanes})")
        self.engine._next[:] = v
        self.engine._kv_lo[:] = v   # (a model's shortcut: nothing below next_pos is known to be cached)

    @property
    def last_plan(self) -> list:
        """Per lane: the ``StepFields`` of the latest planned step (``None``: idle)."""
        return self.engine.lane_fields()

    def set_noise_embed(self, noise_embed, stream=None) -> None:
        """Copy ``[lanes, q_len, hidden]`` noise embeddings (NumPy, or a device
        f32 array read in order on the current stream or ``stream``) into the
        batch (idle lanes' rows are ignored)."""
        self._check_open()
        e = self.engine
        shape = (self.lanes, self.q_len, self.config.hidden_size)
        dev = device_view(self.backend, noise_embed, "noise_embed", dtype=np.float32, shape=shape)
        host = e.check_host_noise(noise_embed, shape) if dev is None else None
        e.copy_noise(host, dev, self.backend.as_stream(stream))

    def set_anchors(self, anchors, stream=None) -> None:
        """DFlash 2: each lane's block's first token (the anchor its selector walks from) for the
        next ``run``: a host sequence of ``lanes`` ints in ``[0, vocab)`` (``None`` for a lane
        idle in the planned step), or a device int32 ``[lanes]`` array read on the device in
        order on the current stream (or ``stream``). Needed once per step."""
        self._check_open()
        host, dev = self._check_anchors(anchors, self._idle_lanes())
        self.engine.copy_anchors(host, dev, self.backend.as_stream(stream))

    def _idle_lanes(self, committed=None) -> list:
        """Per lane: idle in ``committed`` (else in the planned step; all False when none is)."""
        if committed is not None:
            return [c is None for c in committed]
        e = self.engine
        if not e._planned:
            return [False] * self.lanes
        return [not f for f in e._plan.vals[DESC_ACTIVE::DESC_LEN]]

    def _check_anchors(self, anchors, idle):
        e = self.engine
        if e.selects and array_like(anchors):
            dev = device_view(self.backend, anchors, "anchors", dtype=np.int32, shape=(self.lanes,))
            if dev is not None:
                return None, dev
        anchors = self._per_lane(anchors, "anchors", "token ids (None for idle lanes) or a device int32 array")
        return e.check_host_anchors(anchors, idle), None

    def _per_lane(self, seq, name: str, what: str) -> list:
        """``seq`` as a list of one entry per lane (``what``: the entries, for messages)."""
        try:
            seq = list(seq)
        except TypeError:
            raise TypeError(f"{name} must be a sequence of {self.lanes} {what}, got {type(seq).__name__}") from None
        if len(seq) != self.lanes:
            raise ValueError(f"{name} has {len(seq)} entries, expected one per lane ({self.lanes})")
        return seq

    def run(self, eager: bool = False, stream=None):
        """Replay the planned step for every lane (``eager``: launch the
        kernels one by one, same results); returns ``hidden_states``
        ``[lanes, q_len, hidden]`` (rewritten by the next step)."""
        self._check_open()
        self.engine.run(stream, eager, _lane_word)
        return self.hidden_states

    def step(self, committed, noise_embed, stream=None, *, anchors=None):
        """``begin_step`` + ``set_noise_embed`` (+ ``set_anchors(anchors)``: DFlash 2) + ``run``
        on one stream."""
        self._check_open()
        if anchors is not None:
            try:
                idle = self._idle_lanes(list(committed))
            except TypeError:
                idle = [False] * self.lanes   # begin_step names the bad committed
            self._check_anchors(anchors, idle)   # before begin_step changes anything
        elif self.engine.selects and not self.engine._anchored:
            raise ValueError("anchors: a DFlash 2 step needs each active lane's first block token "
                             "(step(..., anchors=) or set_anchors)")
        stream = self.backend.as_stream(stream)
        self.begin_step(committed, stream=stream)
        self.set_noise_embed(noise_embed, stream=stream)
        if anchors is not None:
            self.set_anchors(anchors, stream=stream)
        return self.run(stream=stream)

    def reset(self, lane=None, stream=None) -> None:
        """Forget lane ``lane``'s cached rows (``None``: every lane's), on the
        current stream (or ``stream``); a planned, not yet run step is dropped."""
        self._check_open()
        lanes = range(self.lanes) if lane is None else [self._check_lane(lane)]
        self.engine.reset(lanes, stream)

    def close(self) -> None:
        if self._closed:
            return
        rings = self.rings or ()
        self._release(("backend", "config", "weights", "geom", "lanes"))
        for ring in rings:
            ring.close()


def _ring_device_dtype(dtype):
    from . import dtypes
    return dtypes.DEVICE[dtypes.kind_of(dtype, "ring_dtype")]
