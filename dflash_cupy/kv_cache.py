"""``DraftKvCache``: the drafter step over a ring-cached context KV, replayed
as one captured graph (SPEC §3-§4).

Plan / run split:

* ``begin_step(ring, committed)`` (plan, host O(1)): decides rewind / bulk
  append / in-graph append, runs the rare bulk append (prefill, jumps, after
  a rewind) outside the graph in chunks, and writes the step descriptor into
  pinned memory. It validates everything before it changes anything: a bad
  call raises and leaves the cache as it was.
* ``run()`` (replay): launches the captured step graph. Inside it one copy
  brings the descriptor over; kernels derive the append rows and positions,
  update the slot table, gather the new feature rows from the ring, build
  both masks, append the new K/V rows, and run the layer stack over the
  noise block.

Two step graphs alternate (double-buffered descriptors), so the host can
plan step N+1 while the device still runs step N; before it rewrites a
pinned buffer the host checks the event of the work that read it (the replay
two steps back, the noise copy two calls back) and waits only if that has
not run yet, never on the step it just launched.

Streams (CuPy's way): every call that issues device work (``begin_step``'s
bulk append, ``set_noise_embed``, ``run``, ``step``, ``reset``) issues it on
the caller's current stream (``cupy.cuda.get_current_stream()``; the
emulated backend's ``current_stream()``) or on ``stream=``. Inputs produced
on that stream (a device ``noise_embed``, ring rows written there) are read
after they are written; outputs can be consumed there at once. Work the cache
issued earlier on another stream, and the ring's latest write, are ordered
before it by event edges on the device; nothing waits on the host. The step
graphs are captured on a private stream and replayed on the caller's.

Output lifetime: ``hidden_states`` and ``logits`` are the cache's own
buffers, rewritten by every step (``h1 = kv.step(...); h2 = kv.step(...)``
gives ``h1 is h2``): consume or copy them, in stream order, before the next
``run``/``step`` on another stream, or wait for them.

Device buffers (row-major):
  k_cache[l], v_cache[l]  [kv_total, n_head_kv*head_dim] f16
  mask_full, mask_swa     [q_len, kv_total] f16 (0 visible / -inf hidden)
  noise_embed             [q_len, hidden] f32 (input)
  hidden_states           [q_len, hidden] f32 (output)
  logits                  [q_len, vocab]  f32 (output, iff lm_head)
  draft_tokens            [q_len] int32 (output, iff lm_head): row i's token, greedy
                          argmax or drawn per ``sampling`` (``ops/sample.py``)
"""
from __future__ import annotations

import numpy as np

from .checks import int_arg
from .feature_ring import FeatureRing
from .geometry import BULK_CHUNK
from .interop import array_like, device_view
from .kv_pages import DEFAULT_PAGE
from .nvtx_ranges import nvtx_range
from .ops.step_descriptor import decide_lanes
from .step_engine import EngineFacade, StepEngine
from .weights import DraftWeights

MAX_CAPACITY = 1 << 24  # ring slots: positions and slots are int32, and 16M rows per layer is already ~32 GB
RING_GRAPHS = 4         # rings whose step graphs stay captured (switching back does not recapture)


def _ring_word(lane: int) -> str:
    return "the ring this step was planned on"


def check_ring_size(capacity, rewind_slack) -> tuple:
    """The facades' ``capacity`` (the window) and ``rewind_slack``, checked: ``(capacity,
    rewind_slack)`` as ints whose ring slots ``capacity + rewind_slack`` fit ``MAX_CAPACITY``."""
    capacity = int_arg(capacity, "capacity", 1)
    rewind_slack = int_arg(rewind_slack, "rewind_slack", 0)
    if capacity + rewind_slack > MAX_CAPACITY:
        raise ValueError(f"capacity={capacity} + rewind_slack={rewind_slack} exceeds {MAX_CAPACITY} ring slots")
    return capacity, rewind_slack


class DraftKvCache(EngineFacade):
    """``DraftKvCache(weights, capacity, *, lm_head=None, sampling=None, backend=None, bulk_chunk=256,
    x_split=True, tune=None, pdl=False, selfcheck=None, rewind_slack=0, page_size=64, kv_pages=None)``
    (``page_size``, ``kv_pages``: the K/V pools, as ``DraftKvBatch``: this is its one-lane case).

    ``weights``: ``DraftWeights`` (host) — placed on the backend once and
    cached on the weights object. ``capacity``: the drafter's feature-window cap.
    ``rewind_slack``: the K/V ring keeps that many positions below the window too
    (``capacity + rewind_slack`` slots), so a rewind by at most that many positions
    needs no feature rows and appends nothing (SPEC §3 step 1 otherwise: reset and append
    the window again from the ring); 0 (default): every rewind resets. The feature ring
    passed to ``begin_step`` may be smaller than ``capacity``: a step reads only the rows
    it appends, and a deeper rewind or a jump whose rows the ring no longer holds raises
    ``KeyError`` (nothing changed): re-prefill (``reset`` + ``prefill``).
    ``lm_head``: the target's ``[vocab, hidden]`` matrix (NumPy f32/f16/bf16, or a
    device array: CuPy, PyTorch, JAX, DLPack — used in place), optional; with it each
    step also ends in ``draft_tokens``,
    greedy by default or sampled per ``sampling`` (a ``SamplingParams``;
    ``set_sampling`` changes it between steps, no recapture).

    ``x_split`` (default True): each f32 activation enters the tensor-core GEMMs
    as two 16-bit terms, hi + lo (about 16 significant bits; the tolerance
    table's ``step`` and ``step_kv16`` rows). ``False`` rounds it once to the
    weight type, as bf16 inference stacks do: half the MMAs, which only pays
    where the GEMMs are MMA-bound (many rows: ``DraftKvBatch`` with several
    lanes), at ~11x the error (``step_x1``: 1.5e-2 measured with bf16 weights).

    ``tune`` (default None: on a GPU unless ``DFLASH_CUPY_TUNE=0``): time each
    GEMM call site's launch configurations once per device and shape and keep
    the fastest (``dflash_cupy.tuning``: cached on disk, so later caches read
    it); ``self.tuned`` lists what was chosen. False: the cost rule decides.

    ``pdl`` (default False): capture the step graph with programmatic dependent
    launch (sm_90+): every kernel node that directly follows another kernel node
    may start while that one drains (its weight prefetch and block setup overlap
    the tail; each kernel orders its real work with ``pdl_wait()``,
    ``cuda_src/pdl.cuh``). Eager steps and bulk appends launch without it.
    Bit-identical to ``pdl=False`` on the emulator, whose PDL check holds every
    kernel's pre-wait accesses apart from the kernel before it; not yet run on
    a GPU, hence off by default.

    ``selfcheck`` (default None: ``DFLASH_CUPY_SELFCHECK``, ``auto``): the device's
    self-check verdict (``dflash_cupy/selfcheck.py``; on a GPU run on first use, cached per
    device) picks the kernel variants: a failed one is replaced by its fallback (wgmma ->
    mma.sync stream GEMM -> CUDA-core GEMM, tensor-core -> CUDA-core attention, PDL -> the
    plain graph) with one ``RuntimeWarning``; a failure with no fallback left raises
    ``selfcheck.SelfCheckError``. ``"off"`` trusts every variant, ``"force"`` checks now, a
    ``selfcheck.Report`` is obeyed as given. ``self.checked`` holds what was decided.

    Every step rewrites ``hidden_states``, ``logits``, ``draft_tokens`` and ``noise_embed`` in
    place (the graphs are bound to them): a returned array is the next step's
    output too. Work is issued on the caller's current stream or ``stream=``
    (the module docstring has the contract).
    """

    def __init__(self, weights: DraftWeights, capacity: int, *, lm_head=None, sampling=None,
                 logits: bool = True, backend=None, bulk_chunk: int = 256, x_split: bool = True,
                 tune: bool | None = None, pdl: bool = False, selfcheck=None, rewind_slack: int = 0,
                 page_size: int = DEFAULT_PAGE, kv_pages=None):
        if not isinstance(weights, DraftWeights):
            raise TypeError(f"weights must be a DraftWeights, got {type(weights).__name__}")
        capacity, rewind_slack = check_ring_size(capacity, rewind_slack)
        if not isinstance(bulk_chunk, int) or isinstance(bulk_chunk, bool) or not 1 <= bulk_chunk <= BULK_CHUNK:
            raise ValueError(f"bulk_chunk must be an int in [1, {BULK_CHUNK}], got {bulk_chunk!r}")
        if not isinstance(logits, (bool, np.bool_)):
            raise TypeError(f"logits must be a bool, got {type(logits).__name__}")
        # the one step engine, with one lane (it checks the shared arguments, sampling among them)
        self.engine = e = StepEngine.build(weights, capacity, 1, owner="DraftKvCache", lm_head=lm_head, logits=logits,
                                     sampling=sampling, backend=backend, bulk_chunk=bulk_chunk, x_split=x_split,
                                     tune=tune, pdl=pdl, selfcheck=selfcheck, rewind_slack=rewind_slack,
                                     page_size=page_size, kv_pages=kv_pages)
        self.backend, self.config, self.weights, self.geom = e.backend, e.config, weights, e.geom
        B = e.q_len
        # lane 0's views of the engine's buffers, under the single cache's shapes
        self.k_cache, self.v_cache = e.k_cache, e.v_cache
        self.mask_full = None if e.mask_full is None else e.mask_full[0]
        self.mask_swa = None if e.mask_swa is None else e.mask_swa[0]
        self.slot_pos = e.slot_pos[0]
        self.desc = e.desc[0]
        self.pos_q = e.pos_all[e.ctx_rows:e.ctx_rows + B]
        self.noise_embed = e.noise_embed[:B]
        self.hidden_states = e.hidden_states[0]
        self.logits = None if e.logits is None else e.logits[0]
        self.draft_tokens = None if e.draft_tokens is None else e.draft_tokens[0]
        # DFlash 2 with an LM head (SPEC §6): the selector's outputs, rows 1..q_len-1
        self.candidate_ids = self.candidate_values = self.selector_choice = self.selector_q = None
        if e.selects:
            self.candidate_ids, self.candidate_values = e.candidate_ids[0], e.candidate_values[0]
            self.selector_choice, self.selector_q = e.selector_choice[0], e.selector_q[0]
        self._ring: FeatureRing | None = None
        self._ring_graphs: dict = {}  # id(ring) -> (ring, gather, graph slots) of recently used rings
        self._closed = False

    # ------------------------------------------------------------------ properties
    trash_slot = property(lambda self: self.geom.trash_slot)
    sampling = property(lambda self: self.engine.sampling[0])

    @property
    def next_pos(self) -> int:
        """The position after the last row the cache holds."""
        return self.engine._next[0]

    @property
    def last_plan(self):
        """The ``StepFields`` of the latest ``begin_step`` (for reports)."""
        return self.engine.lane_fields()[0] if self.engine._plan is not None else None

    def __repr__(self):
        return (f"DraftKvCache({self.geom}, layers={self.config.n_layer}, backend={self.backend.name}, "
                f"next_pos={self.next_pos})")

    # ------------------------------------------------------------------ public API
    def begin_step(self, ring: FeatureRing, committed: int, stream=None) -> None:
        """Plan one step for ``committed`` tokens (host O(1)); a bulk append,
        when needed, runs on the current stream (or ``stream``)."""
        self._check_open()
        e = self.engine
        with nvtx_range("dflash plan", "green"):
            stream = self.backend.as_stream(stream)  # (a bad stream raises before any change)
            self._use_ring(ring, committed)
            e.plan((committed,), stream, single=True)

    def _use_ring(self, ring, committed=None) -> None:
        """Bind ``ring`` for the next plan, append or prefill, once it and (given) ``committed``
        pass the host planner's checks (nothing changes otherwise)."""
        if ring is self._ring:
            return
        self._check_ring(ring)
        if committed is not None:   # the one host planner checks committed and the ring's rows
            e = self.engine
            decide_lanes((committed,), e._next, (ring,), self.geom, self.config.swa_window, single=True,
                         kv_lo=e._kv_lo)
        self._switch_ring(ring)

    def append(self, ring: FeatureRing, committed: int, stream=None) -> None:
        """Append the rows ``begin_step(ring, committed)`` would (the positions up to
        ``committed`` that the cache lacks in its window, read from ``ring``), outside the
        graph and with no step; ``next_pos`` becomes ``committed``. Lets a caller alternate
        ``ring.write`` and ``append`` to stream a prompt through a ring smaller than it
        (``prefill`` does both). A planned, not yet run step is dropped."""
        self._check_open()
        stream = self.backend.as_stream(stream)
        self._use_ring(ring, committed)
        self.engine.append((committed,), stream, single=True)

    def prefill(self, ring: FeatureRing, rows, stream=None, *, start=None) -> None:
        """Streaming prefill: write the feature rows ``rows [n, fc_in]`` (NumPy, or a device
        array of the ring's storage dtype) of positions ``start .. start+n`` (``start``:
        default ``next_pos``; after ``reset`` it may be the window's first position, see
        ``StepEngine.prefill``) into ``ring`` and append them, in chunks of at most
        ``min(ring.capacity, capacity)`` rows, on the current stream (or ``stream``): ``n``
        may exceed the ring. Rows below the final window and the slack are skipped. After it
        ``begin_step(ring, next_pos)`` appends nothing.
        Equals appending the whole prompt at once within the f16 K/V tolerance (bit for bit
        where the chunks are the bulk append's own: ``tests/test_rings.py``). A planned, not
        yet run step is dropped; bad ``rows`` raise before any change."""
        self._check_open()
        stream = self.backend.as_stream(stream)
        self._use_ring(ring)
        self.engine.prefill(0, rows, stream, start)

    def _check_ring(self, ring) -> None:
        if not isinstance(ring, FeatureRing):
            raise TypeError(f"ring must be a FeatureRing, got {type(ring).__name__}")
        if ring._closed:
            raise RuntimeError("ring is closed")
        if ring.backend is not self.backend:
            same = "another instance of" if ring.backend.name == self.backend.name else ""
            raise ValueError(f"ring lives on {same} backend {ring.backend.name!r} "
                             f"({type(ring.backend).__name__} at {id(ring.backend):#x}), the cache on "
                             f"{self.backend.name!r} ({id(self.backend):#x}): use one backend object")
        if ring.fc_in != self.config.fc_in:
            raise ValueError(f"ring rows have fc_in={ring.fc_in}, the drafter needs {self.config.fc_in}")

    def _switch_ring(self, ring) -> None:
        """Bind ``ring`` (the graphs read it by pointer): its graphs and gather
        are kept for the last few rings, so alternating rings does not recapture."""
        e = self.engine
        if self._ring is not None:
            self._ring_graphs[id(self._ring)] = (self._ring, e.gather, e.graphs.slots)
        hit = self._ring_graphs.pop(id(ring), None)
        gather = None
        if hit is not None and hit[0] is ring:
            _, gather, e.graphs.slots = hit
        else:
            e.graphs.slots = [None, None]
        e.bind_rings([ring], ring.storage.reshape(1, ring.capacity, ring.fc_in), gather)
        while len(self._ring_graphs) >= RING_GRAPHS:
            self._ring_graphs.pop(next(iter(self._ring_graphs)))
        self._ring = ring

    def set_noise_embed(self, noise_embed, stream=None) -> None:
        """Copy ``[q_len, hidden]`` noise embeddings (NumPy, or a device array
        read in order on the current stream or ``stream``) into ``noise_embed``."""
        self._check_open()
        dev, host = self._check_noise(noise_embed)
        stream = self.backend.as_stream(stream)
        if noise_embed is self.noise_embed:
            return  # filled in place by the caller
        B, H = self.q_len, self.config.hidden_size
        self.engine.copy_noise(None if host is None else host[None], None if dev is None else dev.reshape(1, B, H),
                               stream)

    def set_anchor(self, anchor, stream=None) -> None:
        """DFlash 2: the block's first token (the verified anchor the selector walks from) for
        the next ``run``: a host int in ``[0, vocab)``, or a device int32 array of one element
        read on the device in order on the current stream (or ``stream``), so a pipeline that
        verifies on the device never reads back (an out-of-range device id is clamped and
        flagged in ``selector.flags``). Needed once per step."""
        self._check_open()
        host, dev = self._check_anchor(anchor)
        self.engine.copy_anchors(host, dev, self.backend.as_stream(stream))

    def _check_anchor(self, anchor):
        """``(host list, None)`` or ``(None, device view [1])`` of a valid anchor."""
        e = self.engine
        if isinstance(anchor, (int, np.integer)) and not isinstance(anchor, (bool, np.bool_)):
            return e.check_host_anchors([anchor], [False]), None
        if e.selects and array_like(anchor):
            dev = device_view(self.backend, anchor, "anchor", dtype=np.int32, shape=None)
            if dev is not None:
                if dev.size != 1:
                    raise ValueError(f"anchor must be one token id, got a device array of shape {list(dev.shape)}")
                return None, dev.reshape(1)
        return e.check_host_anchors([anchor], [False]), None

    def _check_noise(self, noise_embed):
        """``(device view, None)`` or ``(None, host array)`` of valid noise embeddings."""
        shape = (self.q_len, self.config.hidden_size)
        dev = device_view(self.backend, noise_embed, "noise_embed", dtype=np.float32, shape=shape)
        if dev is None:
            return None, self.engine.check_host_noise(noise_embed, shape)
        return dev, None

    def _check_outputs(self, out, tokens_out):
        """Device views of the caller's output buffers (validated before any change)."""
        shape = (self.q_len, self.config.hidden_size)
        o = t = None
        if out is not None:
            o = device_view(self.backend, out, "out", dtype=np.float32, shape=shape)
            if o is None:
                raise TypeError(f"out must be a device array (it is written in stream order), "
                                f"got {type(out).__name__}")
        if tokens_out is not None:
            if self.draft_tokens is None:
                raise ValueError("tokens_out needs an lm_head (this cache has none)")
            t = device_view(self.backend, tokens_out, "tokens_out", dtype=np.int32, shape=(self.q_len,))
            if t is None:
                raise TypeError(f"tokens_out must be a device array, got {type(tokens_out).__name__}")
        return o, t

    def run(self, eager: bool = False, stream=None, *, out=None, tokens_out=None):
        """Replay the planned step on the current stream (or ``stream``;
        ``eager=True``: launch its kernels one by one instead, same order,
        same results) and consume the plan. Returns ``hidden_states``, which
        the next step rewrites (so do ``logits`` and ``draft_tokens``).
        ``out`` (``[q_len, hidden]`` f32) and ``tokens_out`` (``[q_len]``
        int32), device arrays of the caller's (any interop type), receive
        copies in stream order: results that outlive the next step, for one
        small device copy each (``out`` is ``q_len*hidden*4`` bytes)."""
        self._check_open()
        o, t = self._check_outputs(out, tokens_out)
        copies = []
        if o is not None:
            copies.append((o, self.hidden_states))
        if t is not None:
            copies.append((t, self.draft_tokens))
        self.engine.run(stream, eager, _ring_word, copies)
        return self.hidden_states

    def step(self, ring: FeatureRing, committed: int, noise_embed, stream=None, *, out=None,
             tokens_out=None, anchor=None):
        """``begin_step`` + noise embeddings (+ ``set_anchor(anchor)``: DFlash 2) + ``run``,
        all on the current stream (or ``stream``); returns ``hidden_states`` (rewritten by
        the next step: ``kv.step(...) is kv.step(...)``; ``out``/``tokens_out`` as in
        ``run``)."""
        self._check_open()
        self._check_noise(noise_embed)  # before begin_step changes anything
        self._check_outputs(out, tokens_out)
        if anchor is not None:
            self._check_anchor(anchor)
        elif self.engine.selects and not self.engine._anchored:
            raise ValueError("anchor: a DFlash 2 step needs the block's first token (step(..., anchor=) or "
                             "set_anchor)")
        stream = self.backend.as_stream(stream)
        self.begin_step(ring, committed, stream=stream)
        self.set_noise_embed(noise_embed, stream=stream)
        if anchor is not None:
            self.set_anchor(anchor, stream=stream)
        return self.run(stream=stream, out=out, tokens_out=tokens_out)

    def reset(self, stream=None) -> None:
        """Forget every cached row (a new request whose prefix differs); the
        slot table is cleared on the current stream (or ``stream``)."""
        self._check_open()
        self.engine.reset((0,), stream)

    def close(self) -> None:
        if self._closed:
            return
        # Release everything the cache holds (device arrays, pinned staging, graphs,
        # compiled ops, the ring): only what repr and the closed checks read stays.
        self._release(("backend", "config", "weights", "geom"))
