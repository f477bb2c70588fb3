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
from .geometry import BULK_CHUNK, RingGeometry
from .interop import device_view
from .nvtx_ranges import nvtx_range
from .step_issuer import StepIssuer
from .ops.gather import FeatureGather
from .ops.step_descriptor import (DESC_LEN, DESC_N_NEW, bulk_chunks, decide_lanes, fill_chunk_descriptor,
                                  pack_descriptors)
from .ops.sample import SamplingParams
from .rope_params import rope_parameters
from .weights import DraftWeights

MAX_M = 64  # rows per GEMM M-tile
MAX_CAPACITY = 1 << 24  # ring slots: positions and slots are int32, and 16M rows per layer is already ~32 GB
RING_GRAPHS = 4         # rings whose step graphs stay captured (switching back does not recapture)


# The step-inputs block (bytes): descriptor int32 [DESC_LEN], sampling knobs f32 [3], the
# RNG state u64 [2] at the next multiple of 8.
_KNOBS_AT = DESC_LEN * 4
_RNG_AT = -(-(_KNOBS_AT + 12) // 8) * 8
_STEP_IN_BYTES = _RNG_AT + 16


def _step_in_sampling(block) -> tuple:
    """The knobs and RNG views of a step-inputs block (device or pinned)."""
    return block[_KNOBS_AT:_KNOBS_AT + 12].view(np.float32), block[_RNG_AT:_RNG_AT + 16].view(np.uint64)


class DraftKvCache(StepIssuer):
    """``DraftKvCache(weights, capacity, *, lm_head=None, sampling=None, backend=None, bulk_chunk=256,
    x_split=True, tune=None, pdl=False, selfcheck=None)``.

    ``weights``: ``DraftWeights`` (host) — placed on the backend once and
    cached on the weights object. ``capacity``: ring slots, the drafter's
    feature-window cap. ``lm_head``: the target's ``[vocab, hidden]`` matrix
    (NumPy f32/f16/bf16, or a device array: CuPy, PyTorch, JAX, DLPack — used
    in place), optional; with it each step also ends in ``draft_tokens``,
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
                 tune: bool | None = None, pdl: bool = False, selfcheck=None):
        if not isinstance(weights, DraftWeights):
            raise TypeError(f"weights must be a DraftWeights, got {type(weights).__name__}")
        capacity = int_arg(capacity, "capacity", 1)
        if capacity > MAX_CAPACITY:
            raise ValueError(f"capacity={capacity} exceeds {MAX_CAPACITY} ring slots")
        if not isinstance(bulk_chunk, int) or isinstance(bulk_chunk, bool) or not 1 <= bulk_chunk <= BULK_CHUNK:
            raise ValueError(f"bulk_chunk must be an int in [1, {BULK_CHUNK}], got {bulk_chunk!r}")
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if not isinstance(logits, (bool, np.bool_)):
            raise TypeError(f"logits must be a bool, got {type(logits).__name__}")
        if not logits and sampling.temperature > 0:
            raise ValueError("sampling with temperature > 0 needs logits=True (the fused argmax is greedy)")
        self.write_logits = bool(logits)
        self._take_args(weights, backend, x_split, pdl, tune, selfcheck)
        be, c = self.backend, self.config
        self.geom = RingGeometry(int(capacity), c.q_len)
        g = self.geom
        self.dw = weights.device(be)  # placed once per backend, cached on the weights
        H, B, A = c.hidden_size, g.q_len, g.a_step
        # Bulk appends run in chunks of exactly bulk_chunk rows (the last one shorter); the
        # append workspace also holds a step's A rows, so it has max(bulk_chunk, A) rows.
        self.bulk_chunk = int(bulk_chunk)
        R = max(self.bulk_chunk, A)

        # ---- caches and step state
        kvw = c.kv_dim
        self.k_cache = [be.zeros((g.kv_total, kvw), np.float16) for _ in range(c.n_layer)]
        self.v_cache = [be.zeros((g.kv_total, kvw), np.float16) for _ in range(c.n_layer)]
        self.mask_full = be.zeros((B, g.kv_total), np.float16) if c.any_full else None
        self.mask_swa = be.zeros((B, g.kv_total), np.float16) if c.any_sliding else None
        self.slot_pos = be.asarray(np.full(g.capacity, -1, np.int32))
        # The step's inputs from the host, one block so that one H2D copy node brings them:
        # the descriptor, then (with an LM head) the sampling knobs and the RNG state.
        sampled = lm_head is not None
        self._step_in = be.zeros((_STEP_IN_BYTES if sampled else DESC_LEN * 4,), np.uint8)
        self.desc = self._step_in[:DESC_LEN * 4].view(np.int32)
        self.bulk_desc = be.zeros((DESC_LEN,), np.int32)
        self.ap_pos = be.zeros((R,), np.int32)    # bulk append rows
        self.ap_rows = be.zeros((R,), np.int32)
        # The step's rows: A append rows then the B noise rows, positions and cache rows
        # side by side so one GEMM and one RoPE launch per layer serve both.
        self.pos_all = be.zeros((A + B,), np.int32)
        self.rows_all = be.asarray(np.concatenate([np.zeros(A, np.int32),
                                                   np.arange(g.capacity, g.capacity + B, dtype=np.int32)]))
        self.pos_q = self.pos_all[A:]
        inv_freq, self.attn_scaling = rope_parameters(c)
        self.inv_freq = be.asarray(np.asarray(inv_freq, np.float64))

        # ---- activations
        self.ap_feat = be.zeros((R, c.fc_in), np.float32)
        self.ctx = be.zeros((R, H), np.float32)
        self.ctx_kv_in = be.zeros((R, H), np.float32) if c.context_kv_layer_norm else None
        self.ctx_kv = be.zeros((R, 2 * kvw), np.float32)
        # Step rows [0, A): the appended context rows, [A, A+B): the noise rows.
        gate_w = self._alloc_step_rows(A, B)   # the step's rows: A append rows, then the noise block
        self.hidden_states = self._hs
        self.lm_head = None
        self.logits = None
        self.draft_tokens = None
        self.sampling = sampling
        if lm_head is not None:
            self.lm_head = self._place_lm_head(lm_head)
            if not 1 <= self.lm_head.shape[0] < 2**31:
                raise ValueError(f"lm_head must have between 1 and 2^31-1 rows (the vocabulary), "
                                 f"got {self.lm_head.shape[0]}")
            # logits=False: the greedy token is fused into the lm_head GEMM (per column block
            # partial maxima, one reduction) and the [q_len, vocab] logits are never written
            self.logits = be.zeros((B, self.lm_head.shape[0]), np.float32) if logits else None
            self.draft_tokens = be.zeros((B,), np.int32)
            self.sample_knobs, self.sample_rng = _step_in_sampling(self._step_in)
        self._logits, self._tokens = self.logits, self.draft_tokens   # (the shared step writes these)

        # ---- pinned staging (two of each: alternating steps)
        # sampling knobs and RNG state travel with the descriptor (same slot, same replay)
        self._step_in_host = [be.pinned_empty(self._step_in.shape, np.uint8) for _ in range(2)]
        self._desc_host = [h[:DESC_LEN * 4].view(np.int32) for h in self._step_in_host]
        if sampled:
            self._knobs_host, self._rng_host = zip(*(_step_in_sampling(h) for h in self._step_in_host))
        self._noise_host = [be.pinned_empty((B, H), np.float32) for _ in range(2)]
        self._noise_events = [be.event() for _ in range(2)]  # after the copy that read each
        self._noise_next = 0
        for h in self._step_in_host:
            h[:] = 0
        n_chunks = -(-g.capacity // self.bulk_chunk) + 1
        self._bulk_desc_host = be.pinned_empty((n_chunks, DESC_LEN), np.int32)
        for i in range(2):
            be.label(self._step_in_host[i], f"DraftKvCache step inputs staging [{i}] (descriptor"
                     + (", sampling knobs, rng)" if sampled else ")"))
            be.label(self._noise_host[i], f"DraftKvCache noise staging [{i}]")
        be.label(self._bulk_desc_host, "DraftKvCache bulk descriptor staging")
        self._events = [be.event() for _ in range(2)]  # after the replay that read each descriptor
        self._bulk_event = be.event()

        self._build_step_ops(MAX_M, gate_w, logits)
        self._gather: FeatureGather | None = None
        self._ring: FeatureRing | None = None

        self.next_pos = 0
        self.last_plan = None  # StepFields of the latest begin_step (for reports)
        self._ring_graphs: dict = {}  # id(ring) -> (ring, gather, graphs) of recently used rings
        self._need = (0, 0)           # positions the planned step gathers from the ring
        # Everything above (zeros, kernel workspaces) was memset on the current stream: the
        # first call on any other stream waits for it on the device.
        self._finish_init(("hidden_states", "logits", "draft_tokens", "noise_embed", "k_cache", "v_cache",
                           "slot_pos", "desc", "resid", "xin", "ap_feat"), tune)

    # ------------------------------------------------------------------ properties
    trash_slot = property(lambda self: self.geom.trash_slot)

    def __repr__(self):
        return (f"DraftKvCache({self.geom}, layers={self.config.n_layer}, backend={self.backend.name}, "
                f"next_pos={self.next_pos})")

    # ------------------------------------------------------------------ the step body
    def _append_stage(self, m: int, stream) -> None:
        """Bulk append: rows [0, m) of ap_pos/ap_rows/ap_feat -> K/V cache rows of every layer."""
        self._append_rows(self.ap_feat, m, self.k_cache, self.v_cache, stream)

    def _qkv_skip(self) -> dict:
        # Append rows [n_new, A) are padding (zero features, their K/V go to the trash
        # slot): the stream GEMM reads n_new from the descriptor and skips their
        # 16-row tiles (same outputs: a zero row's result is zero either way).
        pad = (self.desc[DESC_N_NEW:DESC_N_NEW + 1], self.a_step) if self.g_qkv.path == "stream" else None
        return dict(pad_rows=pad)

    def _issue_step(self, slot: int, stream, eager: bool = False) -> None:
        """Every launch and copy of one step, in order (captured once per slot)."""
        be, A = self.backend, self.a_step
        be.copy_h2d_async(self._step_in, self._step_in_host[slot], stream=stream)
        # reset_slots_if, plan_append, the gather and the masks as one launch (step_plan.cu)
        self._gather.plan_step(self.desc, self._ring.storage, self.ap_feat, self.geom, self.slot_pos,
                               self.pos_all[:A], self.rows_all[:A], self.pos_q, mask_full=self.mask_full,
                               mask_swa=self.mask_swa, n_rows=A, stream=stream)
        self._run_rows(stream, eager)

    def _bulk_append(self, fields, s) -> None:
        """Append ``[bulk_start, bulk_start+bulk_count)`` outside the graph, chunk by chunk, on ``s``."""
        be = self.backend
        self.order.reuse(self._bulk_event)  # the pinned chunk descriptors of the last bulk must have been read
        s.wait_event(self._ring.write_event)
        if fields.reset:
            self.ring_slots.reset_slots(self.slot_pos, stream=s)
        # One pinned descriptor row per chunk: bulk_count <= capacity, so there are at most
        # ceil(capacity / bulk_chunk) chunks, fewer than the rows __init__ allocates.
        for i, (start, count) in enumerate(bulk_chunks(fields.bulk_start, fields.bulk_count,
                                                       self.bulk_chunk)):
            host = self._bulk_desc_host[i]
            be.host_write(host, "DraftKvCache bulk chunk descriptor")
            fill_chunk_descriptor(host, fields, start, count)
            be.copy_h2d_async(self.bulk_desc, host, stream=s)
            self.ring_slots.plan_append(self.bulk_desc, self.ap_pos, self.ap_rows, self.slot_pos,
                                     n_rows=count, stream=s)
            self._gather(self.bulk_desc, self._ring.storage, self.ap_feat, n_rows=count, stream=s)
            self._append_stage(count, s)
        self._bulk_event.record(s)
        self._ring.note_read(self, self._bulk_event)

    # ------------------------------------------------------------------ public API
    def begin_step(self, ring: FeatureRing, committed: int, stream=None) -> None:
        """Plan one step for ``committed`` tokens (host O(1)); a bulk append,
        when needed, runs on the current stream (or ``stream``)."""
        self._check_open()
        with nvtx_range("dflash plan", "green"):
            stream = self.backend.as_stream(stream)  # (a bad stream raises before any change)
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
            # the one host planner (the batch's), for one lane: it checks committed and the ring's rows
            plan = decide_lanes((committed,), (self.next_pos,), (ring,), self.geom, self.config.swa_window,
                                single=True)
            fields = plan.fields(0)
            # ---- validated: from here on state changes
            if ring is not self._ring:
                self._switch_ring(ring)
            slot = self._slot ^ 1
            self.order.reuse(self._events[slot])  # the replay that read this slot's descriptor
            if fields.bulk_count:
                s = self.order.order(stream)
                with nvtx_range("dflash bulk append", "red"):
                    self._bulk_append(fields, s)
                self.order.issued(s)
                self.next_pos = fields.committed
            self.backend.host_write(self._step_in_host[slot], "DraftKvCache.begin_step (step inputs)")
            pack_descriptors(self._desc_host[slot], plan.vals)
            if self.sampler is not None:  # the draw's counter: this step's first noise position
                self._knobs_host[slot][:] = self.sampling.knobs()
                self._rng_host[slot][:] = (self.sampling.seed, fields.committed)
            self._slot = slot
            self._need = (fields.start, fields.start + fields.n_new)   # (a bulk append has run: none)
            self.last_plan = fields
            self._pending_next = fields.committed
            self._planned = True

    def _switch_ring(self, ring) -> None:
        """Bind ``ring`` (the graphs read it by pointer): its graphs and gather
        are kept for the last few rings, so alternating rings does not recapture."""
        if self._ring is not None:
            self._ring_graphs[id(self._ring)] = (self._ring, self._gather, self.graphs.slots)
        hit = self._ring_graphs.pop(id(ring), None)
        if hit is not None and hit[0] is ring:
            _, self._gather, self.graphs.slots = hit
        else:
            g = self._gather
            if g is None or (g.ring_capacity, g.kind) != (ring.capacity, ring.kind):
                g = FeatureGather(self.backend, ring.fc_in, ring.capacity, ring.kind)
            self._gather, self.graphs.slots = g, [None, None]
        while len(self._ring_graphs) >= RING_GRAPHS:
            self._ring_graphs.pop(next(iter(self._ring_graphs)))
        self._ring = ring

    def set_noise_embed(self, noise_embed, stream=None) -> None:
        """Copy ``[q_len, hidden]`` noise embeddings (NumPy, or a device array
        read in order on the current stream or ``stream``) into ``noise_embed``."""
        self._check_open()
        self._check_noise(noise_embed)
        be = self.backend
        stream = be.as_stream(stream)
        if noise_embed is self.noise_embed:
            return  # filled in place by the caller
        dev = device_view(be, noise_embed, "noise_embed", dtype=np.float32,
                          shape=(self.q_len, self.config.hidden_size))
        s = self.order.order(stream)
        if dev is None:  # host data, through pinned staging
            self._copy_noise_host(noise_embed, s)
        else:
            be.copy_d2d_async(self.noise_embed, dev, stream=s)
        self.order.issued(s)

    def set_sampling(self, sampling) -> None:
        """How the next planned steps turn logits into ``draft_tokens``: a
        ``SamplingParams`` (temperature 0: greedy). It takes effect at the next
        ``begin_step`` (the knobs travel with that step's descriptor: no
        recapture, no host wait); each step draws with counter = its first
        noise position, so a seed reproduces a whole run."""
        self._check_open()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if self.sampler is None:
            raise ValueError("sampling needs an lm_head (this cache has none)")
        if self.logits is None and sampling.temperature > 0:
            raise ValueError("sampling with temperature > 0 needs logits=True (this cache fuses the greedy "
                             "token into the lm_head GEMM and writes no logits)")
        self.sampling = sampling

    def _check_noise(self, noise_embed) -> None:
        shape = (self.q_len, self.config.hidden_size)
        dev = device_view(self.backend, noise_embed, "noise_embed", dtype=np.float32, shape=shape)
        if dev is None:
            self._check_host_noise(noise_embed, shape)

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
        if not self._planned:
            raise RuntimeError("run() needs a planned step: call begin_step(ring, committed) first "
                               "(each begin_step plans exactly one run)")
        o, t = self._check_outputs(out, tokens_out)
        ring = self._ring
        if ring._closed:
            raise RuntimeError("run(): the ring this step was planned on has been closed")
        if not ring.holds(*self._need):
            raise RuntimeError(f"run(): the ring no longer holds positions [{self._need[0]}, {self._need[1]}) "
                               f"that this step was planned to append (it holds [{ring.lo}, {ring.hi}): a "
                               f"write after begin_step replaced them); call begin_step again")
        slot, be = self._slot, self.backend
        s = self.order.order(stream)
        s.wait_event(self._ring.write_event)  # the rows this step gathers
        self.graphs.launch(slot, s, eager)
        if o is not None:
            be.copy_d2d_async(o, self.hidden_states, stream=s)
        if t is not None:
            be.copy_d2d_async(t, self.draft_tokens, stream=s)
        self._events[slot].record(s)
        self._ring.note_read(self, self._events[slot])  # the ring's next write waits for this step
        self.order.issued(s)
        self._planned = False
        self.next_pos = self._pending_next
        return self.hidden_states

    def step(self, ring: FeatureRing, committed: int, noise_embed, stream=None, *, out=None,
             tokens_out=None):
        """``begin_step`` + noise embeddings + ``run``, all on the current
        stream (or ``stream``); returns ``hidden_states`` (rewritten by the
        next step: ``kv.step(...) is kv.step(...)``; ``out``/``tokens_out``
        as in ``run``)."""
        self._check_open()
        self._check_noise(noise_embed)  # before begin_step changes anything
        self._check_outputs(out, tokens_out)
        stream = self.backend.as_stream(stream)
        self.begin_step(ring, committed, stream=stream)
        self.set_noise_embed(noise_embed, stream=stream)
        return self.run(stream=stream, out=out, tokens_out=tokens_out)

    def reset(self, stream=None) -> None:
        """Forget every cached row (a new request whose prefix differs); the
        slot table is cleared on the current stream (or ``stream``)."""
        self._check_open()
        s = self.order.order(stream)
        self.next_pos = 0
        self._planned = False
        self.ring_slots.reset_slots(self.slot_pos, stream=s)
        self.order.issued(s)

    def close(self) -> None:
        if self._closed:
            return
        self.order.drain()
        if self._ring is not None and not self._ring._closed:
            self._ring.forget_reader(self)
        # Release everything the cache holds (device arrays, pinned staging, graphs,
        # compiled ops, the ring): only what repr and the closed checks read stays.
        self._release({"backend", "config", "weights", "geom", "next_pos", "last_plan", "sampling",
                       "write_logits", "bulk_chunk", "_closed"})

