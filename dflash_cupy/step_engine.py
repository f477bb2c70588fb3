"""``StepEngine``: the one drafter step engine. ``DraftKvCache`` is a one-lane use of it and
``DraftKvBatch`` a many-lane one; both are thin facades (argument checks, shapes, rings).

Each lane is an independent request with the ring-cache semantics of SPEC §3-§4. One
``plan`` decides every lane on the host (``decide_lanes``, O(1) per lane), runs the rare
bulk appends outside the graph and packs the step's inputs into pinned memory; one ``run``
replays a captured graph for all lanes. Lanes join and leave through the descriptors,
never by recapturing: two step graphs (alternating input buffers) are captured once.

Device layout (lanes ``L``; ``CS = align16(a_step)``, ``BS = align16(q_len)``):

  step_in             one block the graph copies in at once: desc [L, DESC_LEN] int32
                      (``DESC_ACTIVE`` 0: an idle lane), then, with an LM head, each
                      lane's sampling knobs f32 [L, 3] and RNG state u64 [L, 2] (seed,
                      counter = the lane's committed count: ``lane_sampling``)
  k_cache[l], v_cache[l]
                      [(kv_pages + 1) * page_size, n_head_kv*head_dim] f16: layer l's pools of
                      pages shared by the lanes (``kv_pages.py``); lane ``i``'s logical rows
                      (SPEC §3 layout, ``[0, kv_total)``; its ring: ``slots`` = capacity +
                      rewind_slack rows) through its page table
  page_table          [L, ceil(kv_total / page_size)] int32: each entry a page's first row;
                      uploaded by ``plan`` only when a lane's pages changed (stream order
                      puts it after the last step that read it, before the bulk and the step)
  slot_pos [L, slots] int32;  mask_full / mask_swa [L, q_len, kv_total] f16
  ring_storage        [L, ring_capacity, fc_in]: the lanes' feature rings (bound by the facade)
  step rows (the GEMMs' M axis): context rows ``[0, L*CS)``: the active lanes' appended
                      rows packed back to back in lane order (lane ``i``'s at
                      ``desc[i, DESC_CTX_ROW0]``), the rest padding; then noise rows
                      (lane ``i``'s ``q_len`` rows at ``L*CS + i*BS``)
  tile_live           [L*(CS+BS)/16] int32: nonzero iff the 16-row tile holds a live row,
                      written on the device by the planning kernel; the stream GEMMs and
                      norms skip dead tiles (idle lanes, padding), the attention idle lanes

Per step on the device: one input copy, one planning launch for all lanes
(``step_plan.cu``'s ``plan_lanes``), then per layer one GEMM per weight over every live row
of every lane and the attention per (lane, kv head); the final norm and the LM head.

Streams: work is issued on the caller's current stream or ``stream=``; ``StreamOrder``
orders it after this engine's earlier work and the rings' latest writes by event edges;
the host never waits on the step it just launched (pinned buffers alternate, and are
rewritten only once the work that read them has run)."""
from __future__ import annotations

import contextlib

import numpy as np

from . import backends, dtypes, tuning
from . import selfcheck_verdict as selfcheck_mod
from .checks import bool_arg, int_arg
from .device_weights import device_dtype, to_device_matrix
from .geometry import RingGeometry, align_up
from .interop import device_view
from .kv_pages import DEFAULT_PAGE, KvPages
from .memory_plan import MemoryReport
from .nvtx_ranges import nvtx_range
from .ops.attention import RingAttention
from .ops.conv import GroupedConv
from .ops.gather import FeatureGather
from .ops.norm import RmsNorm
from .ops.ring_slots import RingSlots
from .ops.rope import QkvNormRope
from .ops.gemm import weight_kind
from .ops.sample import SamplingParams, TokenSampler
from .ops.selector import SelectorKernels
from .ops.step_descriptor import (DESC_ACTIVE, DESC_COMMITTED, DESC_LEN, DESC_RESET, DESC_START, INT32_MAX,
                                  StepFields, bulk_chunks, decide_lanes, fill_chunk_descriptor, pack_descriptors)
from .rope_params import rope_parameters
from .step_graphs import StepGraphs
from .step_recipe import StepRecipe
from .stream_order import PinnedStaging, StreamOrder

GEMM_MAX_M = 64  # the GEMMs' largest M tile; more rows run as more row blocks of the same launch
TILE_ROWS = 16   # the stream GEMM's row tile: lane regions are whole tiles, so a dead lane is whole dead tiles
# Lanes at most this many check their rings in plain Python at run(); more use NumPy (its fixed
# cost is a few microseconds, more than a short loop).
_PY_CHECK_LANES = 16
# the names the facades show the engine's own buffers under (labels in the emulator's reports)
_PUBLIC = {"_hs": "hidden_states", "_logits": "logits", "_tokens": "draft_tokens", "_step_in": "step_inputs"}


def _step_in_layout(lanes: int, sampled: bool) -> tuple:
    """Byte offsets of the step-inputs block: the descriptors, the sampling knobs f32 [lanes, 3]
    and the RNG state u64 [lanes, 2] at the next multiple of 8; its size."""
    knobs = lanes * DESC_LEN * 4
    if not sampled:
        return knobs, knobs, knobs
    rng = -(-(knobs + 12 * lanes) // 8) * 8
    return knobs, rng, rng + 16 * lanes


def lane_sampling(sampling, lanes: int, *, per_lane: bool, lm_head: bool, logits: bool, selects: bool,
                  default=None) -> tuple:
    """``sampling`` checked, as one ``SamplingParams`` per lane: a ``SamplingParams`` (every
    lane), with ``per_lane`` a sequence of ``lanes`` of them, or None (``default``, if given).
    ``lm_head``: the engine has one; ``logits``: it writes logits; ``selects``: DFlash 2's
    selector draws the tokens. Raises naming ``sampling`` (or ``sampling[i]``)."""
    if sampling is None and default is not None:
        sampling = default
    if isinstance(sampling, SamplingParams):
        per, names = (sampling,) * lanes, ("sampling",) * lanes
    elif per_lane and isinstance(sampling, (list, tuple)):
        if len(sampling) != lanes:
            raise ValueError(f"sampling has {len(sampling)} entries, expected one per lane ({lanes})")
        for i, sp in enumerate(sampling):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling[{i}] must be a SamplingParams, got {type(sp).__name__}")
        per, names = tuple(sampling), tuple(f"sampling[{i}]" for i in range(lanes))
    else:
        also = f" or a sequence of one per lane ({lanes})" if per_lane else ""
        raise TypeError(f"sampling must be a SamplingParams{also}, got {type(sampling).__name__}")
    for sp, name in zip(per, names):
        if sp.temperature > 0 and not lm_head:
            raise ValueError(f"{name} with temperature > 0 needs an lm_head (none was given)")
        if selects:
            StepEngine.check_selector_sampling(sp, name)
        elif sp.temperature > 0 and not logits:
            raise ValueError(f"{name} with temperature > 0 needs logits=True (the fused argmax is greedy)")
    return per


class StepEngine:
    """``StepEngine(weights, capacity, lanes, *, owner, lm_head=None, logits=True, sampling=None,
    backend=None, bulk_chunk=256, x_split=True, tune=None, pdl=False, selfcheck=None,
    rewind_slack=0, page_size=64, kv_pages=None)``: ``lanes`` independent requests, each with a
    window of ``capacity`` positions and a K/V ring of ``capacity + rewind_slack`` slots, drafted
    by one captured step, their K/V in pools of ``kv_pages`` pages of ``page_size`` rows
    (default: every lane's worst case; ``kv_pages.py``). The facade checks its own arguments
    first and binds the lanes' feature rings (``bind_rings``) before the first ``plan``.
    ``owner``: the facade's name (labels,
    NVTX ranges, messages). ``sampling``: a ``SamplingParams`` for every lane, or with
    ``per_lane_sampling`` a sequence of one per lane (``lane_sampling``); ``self.sampling`` holds
    one per lane. The other arguments are ``DraftKvCache``'s."""

    def __init__(self, weights, capacity: int, lanes: int, *, owner: str, lm_head=None, logits: bool = True,
                 sampling=None, per_lane_sampling: bool = False, backend=None, bulk_chunk: int = 256,
                 x_split: bool = True, tune: bool | None = None, pdl: bool = False, selfcheck=None,
                 rewind_slack: int = 0, page_size: int = DEFAULT_PAGE, kv_pages=None):
        self.owner = owner
        # each lane's sampling, checked before anything is built
        selects = weights.config.dflash2 is not None and lm_head is not None
        self.sampling = lane_sampling(sampling, lanes, per_lane=per_lane_sampling, lm_head=lm_head is not None,
                                      logits=bool(logits), selects=selects, default=SamplingParams())
        self._per_lane_sampling = per_lane_sampling
        self._nvtx = "dflash" if lanes == 1 else "dflash batch"
        self.x_split = bool_arg(x_split, "x_split")
        self.pdl = bool_arg(pdl, "pdl")
        if tune is not None:
            bool_arg(tune, "tune")
        self.backend = be = backends.get(backend)
        self.config = c = weights.config
        self.weights = weights
        self.checked = selfcheck_mod.for_cache(be, selfcheck)   # failed variants -> their fallbacks
        self.pdl = self.pdl and self.checked.pdl                # PDL -> the plain graph
        self.lanes = lanes
        self.geom = g = RingGeometry(int(capacity), c.q_len, rewind_slack)
        # the page allocator sees the ring's slots (window + slack) as its ring
        self.kv_pages = KvPages(lanes, g.slots, g.q_len, g.kv_total, page_size, kv_pages)
        self.page = self.kv_pages.page
        # DFlash 2 with an LM head: the draft tokens are the candidate selector's walk (SPEC §6)
        self.selects = c.dflash2 is not None and lm_head is not None
        self.dw = weights.device(be)   # placed once per backend, cached on the weights
        self.bulk_chunk = int(bulk_chunk)
        self.write_logits = bool(logits)
        H, B, A, kvw = c.hidden_size, g.q_len, g.a_step, c.kv_dim
        CS, BS = align_up(A, TILE_ROWS), align_up(B, TILE_ROWS)
        self.ctx_rows, self.lane_rows = CS, BS
        NC, NN = lanes * CS, lanes * BS   # context rows, noise rows

        # ---- caches and step state
        pool_rows = (self.kv_pages.pages + 1) * self.page   # page 0: the shared page
        self.k_cache = [be.zeros((pool_rows, kvw), np.float16) for _ in range(c.n_layer)]
        self.v_cache = [be.zeros((pool_rows, kvw), np.float16) for _ in range(c.n_layer)]
        self.page_table = be.zeros((lanes, self.kv_pages.n), np.int32)   # every entry the shared page
        self._pages_staging = PinnedStaging(be, (lanes, self.kv_pages.n), np.int32, f"{owner} page table staging")
        self._pages_version = 0
        self.mask_full = be.zeros((lanes, B, g.kv_total), np.float16) if c.any_full else None
        self.mask_swa = be.zeros((lanes, B, g.kv_total), np.float16) if c.any_sliding else None
        self.slot_pos = be.asarray(np.full((lanes, g.slots), -1, np.int32))
        sampled = lm_head is not None
        knobs_at, rng_at, in_bytes = _step_in_layout(lanes, sampled)
        self._step_in = be.zeros((in_bytes,), np.uint8)
        self.desc = self._step_in[:knobs_at].view(np.int32).reshape(lanes, DESC_LEN)
        self.tile_live = be.zeros(((NC + NN) // TILE_ROWS,), np.int32)
        self.tiles_ctx, self.tiles_noise = self.tile_live[:NC // TILE_ROWS], self.tile_live[NC // TILE_ROWS:]
        # positions and cache rows of the step rows: the planning launch writes them every step
        self.pos_all, self.rows_all = be.zeros((NC + NN,), np.int32), be.zeros((NC + NN,), np.int32)
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

        # ---- lm head: logits and tokens (greedy, or drawn per ``sampling``)
        self.lm_head = self.logits = self.draft_tokens = self._logits = self._tokens = None
        self._lm_owned = False
        self.sample_knobs = self.sample_rng = None
        if lm_head is not None:
            self.lm_head = self._place_lm_head(lm_head)
            V = self.lm_head.shape[0]
            if not 1 <= V < 2**31:
                raise ValueError(f"lm_head must have between 1 and 2^31-1 rows (the vocabulary), got {V}")
            self._tokens = be.zeros((NN,), np.int32)
            self.draft_tokens = self._tokens.reshape(lanes, BS)[:, :B]
            if self.selects:
                self._alloc_selector(V)
            if logits:
                # logits=False: the greedy token is fused into the lm_head GEMM (per column block
                # partial maxima, one reduction) and the logits are never written
                self._logits = be.zeros((NN, V), np.float32)
                self.logits = self._logits.reshape(lanes, BS, V)[:, :B]
            # per lane: (temperature, top_p, top_k) and (seed, counter base)
            self.sample_knobs = self._step_in[knobs_at:knobs_at + 12 * lanes].view(np.float32).reshape(lanes, 3)
            self.sample_rng = self._step_in[rng_at:rng_at + 16 * lanes].view(np.uint64).reshape(lanes, 2)

        # ---- pinned staging (two of each: alternating steps)
        self._step_in_host = [be.pinned_empty((in_bytes,), np.uint8) for _ in range(2)]
        self._desc_host = [h[:knobs_at].view(np.int32).reshape(lanes, DESC_LEN) for h in self._step_in_host]
        self._knobs_host = [h[knobs_at:knobs_at + 12 * lanes].view(np.float32).reshape(lanes, 3)
                            for h in self._step_in_host] if sampled else None
        self._rng_host = [h[rng_at:rng_at + 16 * lanes].view(np.uint64).reshape(lanes, 2)
                          for h in self._step_in_host] if sampled else None
        self._sampling_in = [None, None]   # the lanes' sampling last written into each staging buffer
        for a in self._step_in_host:
            a[...] = 0
        self._noise_staging = PinnedStaging(be, (NN, H), np.float32, f"{owner} noise staging")
        self._noise_events = self._noise_staging.events
        self._n_chunks = -(-g.capacity // self.bulk_chunk) + 1
        self._bulk_desc_host = be.pinned_empty((lanes * self._n_chunks, DESC_LEN), np.int32)
        # DFlash 2: the anchors' pinned staging (two: alternating steps), and whether the
        # planned step has its anchors
        self._anchor_staging = PinnedStaging(be, (lanes,), np.int32, f"{owner} anchor staging") \
            if self.selects else None
        self._anchored = False
        for i in range(2):
            be.label(self._step_in_host[i], f"{owner} step inputs staging [{i}] (descriptors"
                     + (", sampling knobs, rng)" if sampled else ")"))
        be.label(self._bulk_desc_host, f"{owner} bulk descriptor staging")
        self._events = [be.event() for _ in range(2)]   # after the replay that read each input buffer
        self._bulk_event = be.event()

        # ---- kernels (all compiled now: nothing compiles during capture). max_m: the most rows
        # one call sees (all lanes' rows, or a bulk chunk); past one 64-row block the stream
        # GEMMs compile their wgmma variants too (an sm_90a device or the emulator). The
        # attention: one launch for every (lane, kv head); an idle lane's blocks exit at once.
        self._build_step_ops(max(GEMM_MAX_M, NC + NN, R), gate_w, logits, lanes=lanes, lane_rows=BS)
        self.ring_storage = self.gather = None   # bound by the facade (bind_rings)
        self.rings = None
        self._ring_writes = [-1] * lanes   # each ring's write count when a step last waited for it

        self._next = [0] * lanes          # per lane: the next position to append (next_pos)
        # per lane: kv_lo, where the run of rows appended up to next_pos starts (the K/V ring
        # holds [max(kv_lo, next_pos - slots), next_pos): what a rewind within the slack needs)
        self._kv_lo = [0] * lanes
        self._plan = self._plan_desc = None
        self._plan_fields = [None] * lanes
        self._slot = 0         # the input buffer the planned step uses
        self._planned = False
        self._closed = False
        self._label_arrays(("_hs", "_logits", "_tokens", "noise_embed", "k_cache", "v_cache", "page_table",
                            "slot_pos", "_step_in", "resid", "xin", "ap_feat", "tile_live"))
        selfcheck_mod.require(self.checked, self)   # a failed variant with no fallback left: raise
        self.tuned = tuning.tune_sites(self._tune_sites(), backend=be, tune=tune)
        self.graphs = StepGraphs(be, self._issue_step, pdl=self.pdl, nvtx=self._nvtx)
        # construction's memsets ran on the current stream: the first call on any other
        # stream waits for them on the device
        self.order = StreamOrder(be)

    capacity = property(lambda self: self.geom.capacity)
    rewind_slack = property(lambda self: self.geom.rewind_slack)
    q_len = property(lambda self: self.geom.q_len)
    kv_total = property(lambda self: self.geom.kv_total)
    a_step = property(lambda self: self.geom.a_step)
    trash_slot = property(lambda self: self.geom.trash_slot)

    # ------------------------------------------------------------------ construction pieces
    def _label_arrays(self, names) -> None:
        """Name the device arrays held in these attributes (lists: each item) for the
        emulator's reports."""
        for name in names:
            v = getattr(self, name)
            for i, a in enumerate(v if isinstance(v, list) else [v]):
                if a is not None:
                    suffix = f"[{i}]" if isinstance(v, list) else ""
                    self.backend.label(a, f"{self.owner}.{_PUBLIC.get(name, name)}{suffix}")

    def _place_lm_head(self, lm_head):
        """The target's ``[vocab, hidden]`` LM head on the device: a device array of any
        framework used in place, else NumPy copied once."""
        be, H = self.backend, self.config.hidden_size
        dev = device_view(be, lm_head, "lm_head", dtype=(np.float32, np.float16, np.uint16),
                          shape=(None, H))
        self._lm_owned = True   # a copy this engine allocated (memory_report counts it as weights)
        if dev is not None:  # the caller's device matrix, used in place
            if not be.is_device_array(dev):  # emulated: foreign CPU memory has no guard pages
                dev = be.asarray(dev)
            else:
                self._lm_owned = False
            return dev
        if not isinstance(lm_head, np.ndarray):
            lm_head = np.asarray(lm_head)
        if lm_head.ndim != 2 or lm_head.shape[1] != H:
            raise ValueError(f"lm_head must have shape [vocab, {H}], got {list(lm_head.shape)}")
        try:
            device_dtype(lm_head.dtype)
        except TypeError:
            raise TypeError(f"lm_head dtype must be f32, f16 or bf16, got {lm_head.dtype}") from None
        if lm_head.shape[0] < 1:
            raise ValueError("lm_head must have at least one row (the vocabulary), got 0")
        return to_device_matrix(be, lm_head)

    def _alloc_selector(self, V: int) -> None:
        """DFlash 2's selector buffers (SPEC §6; ``ops/selector.py`` has the layouts): the
        anchors (the block's first token per lane), the walk's tokens (``draft_tokens``), the
        candidates (ids, values), the choice and ``q``. The top-K's input (``_build_gemms``): the
        fused top-K's partials, else the logits (the engine's own buffer when the caller asked
        for none)."""
        be, c, L, B = self.backend, self.config, self.lanes, self.q_len
        d2 = c.dflash2
        if V != d2.vocab_size:
            raise ValueError(f"lm_head has {V} rows, the DFlash 2 drafter's vocabulary (its selector codebooks) "
                             f"has vocab_size={d2.vocab_size}")
        R, K = B - 1, d2.selector_top_k
        self.anchors = be.zeros((L,), np.int32)
        self.draft_tokens = be.zeros((L, B), np.int32)
        self.candidate_ids = be.zeros((L, R, K), np.int32)
        self.candidate_values = be.zeros((L, R, K), np.float32)
        self.selector_choice = be.zeros((L, R), np.int32)
        self.selector_q = be.zeros((L, R, K), np.float32)

    @staticmethod
    def check_selector_sampling(sampling, name: str = "sampling") -> None:
        """The selector draws from its K candidates at ``temperature`` (SPEC §6): top-k and
        top-p have no meaning there."""
        if sampling.top_k or sampling.top_p != 1.0:
            raise ValueError(f"{name}: a DFlash 2 drafter's candidate selector samples its own top-K at the "
                             f"temperature only; top_k={sampling.top_k} / top_p={sampling.top_p} do not apply")

    def set_sampling(self, sampling) -> None:
        """The lanes' sampling from the next ``plan`` on (``lane_sampling``'s forms; the knobs
        travel in the step inputs: no recapture, no host wait). Raises, nothing changed, on a
        bad ``sampling``."""
        if self.lm_head is None:
            raise ValueError("sampling needs an lm_head (this cache has none)")
        self.sampling = lane_sampling(sampling, self.lanes, per_lane=self._per_lane_sampling, lm_head=True,
                                      logits=self.logits is not None, selects=self.selects)

    def _alloc_step_rows(self, n_ctx: int, n_noise: int) -> int:
        """The fusion decisions (``recipe``) and the step's activations over its rows (``n_ctx``
        context rows, then ``n_noise`` noise rows); returns the attention gate's width (0: no
        gate)."""
        be, c = self.backend, self.config
        self.n_ctx, self.n_noise = n_ctx, n_noise
        self.recipe = r = StepRecipe.derive(c, self.dw, self.checked, self.x_split, n_ctx, n_noise)
        H, nc, nn, kvw = c.hidden_size, n_ctx, n_noise, c.kv_dim
        # resid: [T (context-KV-norm variant) | h, the residual stream];
        # xin: each layer's GEMM input [T or rmsnorm(T)*ln | rmsnorm(h)*ln].
        self.resid = be.zeros((nc + nn, H), np.float32)
        self.xin = be.zeros((nc + nn, H), np.float32)
        self.h, self.hn = self.resid[nc:], self.xin[nc:]
        # the folded norms' GEMMs read resid / h directly, so the context rows live in resid
        self.ctx_step = self.resid[:nc] if c.context_kv_layer_norm or r.fold_norms else self.xin[:nc]
        self.noise_embed = be.zeros((nn, H), np.float32)   # read in place by the first layer
        self.qkv = be.zeros((nc + nn, c.q_dim + 2 * kvw), np.float32)
        self.q_all = be.zeros((nc + nn, c.q_dim), np.float32)
        self.q = self.q_all[nc:]
        # f32, or 16-bit where x_split=False allows (StepRecipe.attn16 / act16)
        attn_dt, act_dt = (np.dtype(np.float32) if k is None else dtypes.DEVICE[k] for k in (r.attn16, r.act16))
        self.attn = be.zeros((nn, c.q_dim), attn_dt)
        gate_w = {"none": 0, "head": c.n_head, "element": c.q_dim}[c.attn_gate]
        self.gate = be.zeros((nn, gate_w), np.float32) if gate_w else None
        self.act = be.zeros((nn, c.intermediate_size), act_dt)
        # gate_up's 16-bit input rows, or None
        self.hn16 = be.zeros((nn, H), dtypes.DEVICE[r.gate_up_x16]) if r.gate_up_x16 else None
        self._hs = be.zeros((nn, H), np.float32)   # the final norm's output rows
        # DFlash 2: a sublayer's normed input (cx), its convolution coefficients (dconv, the
        # kernel_projection GEMM's output), the o / down GEMMs' plain outputs (obuf)
        self.cx = self.dconv = self.obuf = None
        if r.conv:
            d2 = c.dflash2
            self.cx, self.obuf = be.zeros((nn, H), np.float32), be.zeros((nn, H), np.float32)
            self.dconv = be.zeros((nn, d2.projection_rows(H)), np.float32)
        return gate_w

    def _build_step_ops(self, max_m: int, gate_w: int, logits: bool, **attn_kw) -> None:
        """Every kernel a step or a bulk append launches, compiled now (nothing compiles
        during capture); ``attn_kw``: the attention's lane layout."""
        be, c = self.backend, self.config
        self.rms = RmsNorm(be, c.hidden_size, c.rms_norm_eps)
        x16 = self.recipe.gate_up_x16
        self.rms16 = None if x16 is None else RmsNorm(be, c.hidden_size, c.rms_norm_eps, out_kind=x16)
        self._build_gemms(max_m, gate_w, logits, self.n_noise)  # g_fc .. g_lm (x_split), _lm_part
        self.sampler = TokenSampler(be, self.lm_head.shape[0]) if self.lm_head is not None else None
        self.selector = None
        if self.selects:   # the selector's tokens replace the sampler's
            self.sampler = None
            # the fused top-K's partials: its column blocks size the merge's registers
            pblk = 0 if self._lm_part is None else int(self._lm_part.shape[1])
            self.selector = SelectorKernels(be, c, self.q_len, self.lanes,
                                            weight_kind=weight_kind(self.dw.selector_hp.dtype), partial_blocks=pblk)
        self.rope_ctx = QkvNormRope(be, c.head_dim, c.n_head, c.n_head_kv, False, c.rms_norm_eps,
                                    self.attn_scaling)
        self.rope_step = QkvNormRope(be, c.head_dim, c.n_head, c.n_head_kv, True, c.rms_norm_eps,
                                     self.attn_scaling)
        self.attention = RingAttention(be, c.head_dim, c.n_head, c.n_head_kv, self.q_len, self.kv_total,
                                       gate=None if c.attn_gate == "none" else c.attn_gate,
                                       out_kind=self.recipe.attn16,
                                       path="auto" if self.checked.attention_mma else "fma", page=self.page,
                                       **attn_kw)
        self.ring_slots = RingSlots(be, self.geom, page=self.page)
        d2 = c.dflash2
        # the finish convolutions write the next norm's output too (finish_norm)
        # (d in the device weights' group-major layout: device_weights.py)
        self.conv = GroupedConv(be, c.hidden_size, d2.conv_kernel_size, d2.conv_group_size,
                                norm_eps=c.rms_norm_eps, layout="group") if d2 else None

    def _build_gemms(self, max_m: int, gate_w: int, logits: bool, lm_rows: int) -> None:
        """The step's GEMMs (``g_fc`` .. ``g_lm``), compiled now, every one
        rounding its activations as ``self.x_split`` says; ``_lm_part``: the
        fused argmax's partials for ``lm_rows`` rows (``logits=False``), or (DFlash 2, a
        16-bit lm_head on the stream path, with or without logits) the fused top-K's."""
        from .ops.gemm import Gemm
        from .ops.rope import RopeSpec
        be, c, H = self.backend, self.config, self.config.hidden_size
        L0, kvw = self.dw.layers[0], c.kv_dim
        r = self.recipe
        fold_eps = c.rms_norm_eps if r.fold_norms else None
        # the self-check's choices: a failed stream GEMM -> gemm.cu, a failed wgmma -> gemm_stream.cu
        ch = self.checked
        fallback = dict(path="auto" if ch.stream else "fma", **({} if ch.wgmma else {"wgmma": False}))

        def gemm(*a, **kw):
            # tile_live: the K split per launch from the live tiles; the qkv GEMM skips the
            # context rows' Q columns (tile_live 2)
            with selfcheck_mod.applied(ch):
                return Gemm(be, *a, max_m=max_m, x_split=self.x_split, live_split=True, **{**fallback, **kw})
        self.g_fc = gemm(H, c.fc_in, self.dw.fc.dtype)
        self.g_kv = gemm(2 * kvw, H, L0.w_qkv.dtype)
        # rope: the q/k norm + RoPE + K/V scatter folds into the qkv GEMM's epilogue where its
        # launch allows (_qkv_rope); QkvNormRope (rope_step) runs after it elsewhere
        rope = RopeSpec(c.head_dim, c.n_head, c.n_head_kv, c.rms_norm_eps, self.attn_scaling) \
            if r.qkv_rope else None
        self.g_qkv = gemm(c.q_dim + 2 * kvw, H, L0.w_qkv.dtype, norm_eps=fold_eps, skip_cols=c.q_dim, rope=rope)
        # DFlash 2 (recipe.conv): the o / down outputs go through the finish convolution, which
        # adds them to the residual stream: in their epilogue (finish, _finish) where the stream
        # path serves them, else they write plain outputs and GroupedConv's finish follows
        d2 = c.dflash2
        fin_ok = lambda w, k: ch.stream and weight_kind(w.dtype) in ("f16", "bf16") and k % 8 == 0   # noqa: E731
        fin = lambda w, k: ({"finish": (d2.conv_kernel_size, d2.conv_group_size)}   # noqa: E731
                            if r.conv and fin_ok(w, k) else {})
        resid = "none" if r.conv else "residual"
        self.g_o = gemm(H, c.q_dim, L0.w_o.dtype, "residual" if fin(L0.w_o, c.q_dim) else resid,
                        x16=r.attn16 is not None, **fin(L0.w_o, c.q_dim))
        x16 = r.gate_up_x16 is not None   # its norm a launch of its own (rms16), 16-bit rows
        # (recipe.gate_up_async: the folded-norm variant, every row raw: its cp.async staging)
        gu_eps = c.rms_norm_eps if r.gate_up_async else None if x16 else fold_eps
        self.g_gate_up = gemm(c.intermediate_size, H, L0.w_gate_up.dtype, "silu_mul",
                              norm_eps=gu_eps, x16=x16, y16=r.act16 is not None)
        self.g_down = gemm(H, c.intermediate_size, L0.w_down.dtype,
                           "residual" if fin(L0.w_down, c.intermediate_size) else resid, x16=r.act16 is not None,
                           **fin(L0.w_down, c.intermediate_size))
        # a finish GEMM whose launch cannot fuse (a tuned wgmma plan, lanes straddling its row
        # blocks) writes its plain output through a zero residual (0 + p: p up to a zero's sign,
        # which the finish convolution's sums cannot see)
        self._zero_rows = (self.backend.zeros((self.n_noise, H), np.float32)
                           if self.g_o.finish is not None or self.g_down.finish is not None else None)
        self.g_attn_gate = gemm(gate_w, H, L0.w_attn_gate.dtype) if gate_w else None
        # the prepare convolution after it where its launch allows (fuses_conv: _prepare)
        conv = (c.dflash2.conv_kernel_size, c.dflash2.conv_group_size) if r.conv else None
        # every sublayer's norm folded in (_conv_layer) where this variant takes it at the step's
        # rows: mma.sync launches only (a wgmma one could neither fuse nor store the normed rows,
        # and a lane must equal a single cache whichever way each takes); decided once here
        self.g_conv0 = gemm(c.dflash2.projection_rows(H), H, L0.conv_a_kp.dtype, norm_eps=c.rms_norm_eps,
                            conv=conv, wgmma=False) if r.conv else None
        self._fold_norms = self.g_conv0 is not None and self.g_conv0.stores_norm(self.n_noise)
        # otherwise the GEMM reads the norms' outputs (cx)
        self.g_conv = (gemm(c.dflash2.projection_rows(H), H, L0.conv_a_kp.dtype, conv=conv)
                       if r.conv and not self._fold_norms else None)
        self.g_lm = self._lm_part = None
        if self.lm_head is not None:
            V = self.lm_head.shape[0]
            fused = not logits and ch.stream and not self.selects   # the fused argmax: a stream-GEMM epilogue
            # DFlash 2: each column block's top-K in the lm_head GEMM's epilogue (logits only when
            # asked for: the same GEMM either way, so the candidates do not depend on it), merged
            # by the selector; an f32 lm_head (or a failed stream GEMM): logits, then its top-K
            topk = self.selects and ch.stream and weight_kind(self.lm_head.dtype) != "f32" and H % 8 == 0
            if topk:
                self.g_lm = gemm(V, H, self.lm_head.dtype, "topk", logits=logits,
                                 top_k=c.dflash2.selector_top_k)
            else:
                self.g_lm = (gemm(V, H, self.lm_head.dtype) if not fused else
                             gemm(V, H, self.lm_head.dtype, "argmax", logits=False))
            if fused or topk:
                self._lm_part = be.zeros(self.g_lm.partials_shape(lm_rows), np.uint32)
            elif not logits:   # logits into a buffer of the engine's, then the greedy sampler or the top-K
                self._logits = be.zeros((lm_rows, V), np.float32)

    def _tune_sites(self) -> list:
        """``(label, op, m)`` of every GEMM call a step or a bulk chunk makes, and the attention."""
        nc, nn, R = self.n_ctx, self.n_noise, self.bulk_chunk
        return [("fc", self.g_fc, nc), ("fc", self.g_fc, R), ("kv", self.g_kv, R), ("qkv", self.g_qkv, nc + nn),
                ("attn_gate", self.g_attn_gate, nn), ("o", self.g_o, nn), ("gate_up", self.g_gate_up, nn),
                ("down", self.g_down, nn), ("conv", self.g_conv, nn), ("conv0", self.g_conv0, nn),
                ("lm_head", self.g_lm, nn),
                ("attention", self.attention, 0)]

    # the composed objects' state under the names the step code and the tests read
    capture_stream = property(lambda self: self.graphs.capture_stream)
    captures = property(lambda self: self.graphs.captures)        # step graphs captured so far
    _graphs = property(lambda self: self.graphs.slots)
    _tail = property(lambda self: self.order.tail)
    # times the host had to wait for queued work to reuse a pinned buffer
    host_waits = property(lambda self: self.order.host_waits)

    # ------------------------------------------------------------------ rings
    def bind_rings(self, rings, storage, gather: FeatureGather | None = None) -> None:
        """The lanes' feature rings (``rings[i]``: lane ``i``'s ``FeatureRing``) and their
        storage as one device array ``[lanes, ring_capacity, fc_in]``, which the step graphs
        read by pointer (rebinding needs graphs of its own: the facade swaps ``graphs.slots``).
        ``gather``: a ``FeatureGather`` for that storage, else one is built."""
        if gather is None:
            g = self.gather
            r = rings[0]
            if g is None or (g.ring_capacity, g.kind) != (r.capacity, r.kind):
                g = FeatureGather(self.backend, r.fc_in, r.capacity, r.kind)
            gather = g
        self.rings, self.ring_storage, self.gather = list(rings), storage, gather
        self._ring_writes = [-1] * self.lanes

    # ------------------------------------------------------------------ the step body
    def _issue_step(self, slot: int, stream, eager: bool = False) -> None:
        """Every launch and copy of one step, in order (captured once per slot)."""
        self.backend.copy_h2d_async(self._step_in, self._step_in_host[slot], stream=stream)
        self.gather.plan_lanes(self.desc, self.ring_storage, self.ap_feat, self.geom, self.slot_pos, self.pos_all,
                               self.rows_all, self.tile_live, cs=self.ctx_rows, bs=self.lane_rows,
                               mask_full=self.mask_full, mask_swa=self.mask_swa, rule=self.config.mask_rule,
                               stream=stream, pages=self.page_table, page=self.page)
        self._run_rows(stream, eager)

    def _layer_input(self, li: int):
        """The residual stream's noise rows layer ``li`` reads: ``noise_embed`` itself for the
        first layer, read in place (its o GEMM writes ``h = noise_embed + attn @ Wo``, so no
        step copies it into ``h``), ``h`` after."""
        return self.h if li else self.noise_embed

    def _qkv_norm(self, L, n_ctx: int) -> tuple:
        """The qkv GEMM's folded norms over [context rows; noise rows]: every row
        ``rmsnorm * input_layernorm`` with the context-KV-norm variant (its context rows are T),
        else the noise rows so and the context rows as they are (T) or, the hidden norm folded,
        ``rmsnorm(y) * hidden_norm`` = T."""
        if self.config.context_kv_layer_norm:
            return (L.input_layernorm, 0)
        if self.recipe.fold_hidden:
            return (L.input_layernorm, n_ctx, self.dw.hidden_norm)
        return (L.input_layernorm, n_ctx)

    def _fuse_rows(self, feat, out, m: int, stream, hidden_norm: bool = True, **gemm_kw) -> None:
        """Rows [0, m) of ``feat`` -> T = rmsnorm(feat @ fc.T) * hidden_norm into ``out``
        (``hidden_norm=False``: the fc output y only, its norm folded into the consumer;
        ``gemm_kw``: e.g. the GEMM's ``tile_live``)."""
        c, dw = self.config, self.dw
        if dw.aux_norms is not None:  # each captured layer's slice normalised with its own scale
            self.rms(feat, dw.aux_norms, feat, rows=m * c.n_captured, stream=stream)
        self.g_fc(feat, dw.fc, out, m, stream=stream, **gemm_kw)
        if hidden_norm:
            self.rms(out, dw.hidden_norm, out, rows=m, stream=stream, tile_live=gemm_kw.get("tile_live"))

    def _qkv_rope(self, li: int, L, x, m: int, stream, **gemm_kw) -> None:
        """Layer ``li``'s qkv projection of the step's ``m`` rows of ``x`` with the q/k norm,
        RoPE and the K/V scatter: Q into ``q_all``, K/V into the layer's caches at ``rows_all``.
        One launch where the qkv GEMM folds them into its epilogue, else the GEMM into ``qkv``
        and ``rope_step`` (``gemm_kw``: norm, x2, tile_live; the last also for the rope)."""
        if self.g_qkv.rope is not None and self.g_qkv.fuses_rope(m):
            self.g_qkv(x, L.w_qkv, self.q_all, m, stream=stream,
                       rope=(L.q_norm, L.k_norm, self.inv_freq, self.pos_all, self.rows_all, self.k_cache[li],
                             self.v_cache[li]), **gemm_kw)
            return
        self.g_qkv(x, L.w_qkv, self.qkv, m, stream=stream, **gemm_kw)
        self.rope_step(self.qkv, L.k_norm, self.inv_freq, self.pos_all, self.rows_all,
                       self.k_cache[li], self.v_cache[li], q_norm=L.q_norm, q_out=self.q_all, stream=stream,
                       tile_live=gemm_kw.get("tile_live"))

    def _step_layer(self, li: int, L, stream) -> None:
        """One decoder layer (SPEC §2 step 2) over the noise rows, with the
        layer's K/V of the step's appended context rows computed alongside:
        one [q; k; v] GEMM and one norm+RoPE+scatter over all the step's rows (the
        context rows' Q skipped through tile_live: free next to streaming the weights once
        instead of twice). Dead tiles (``tile_live`` 0: idle lanes, padding) are skipped,
        and an idle lane's attention blocks exit at once (same outputs for every row a
        later launch reads)."""
        nc, nn = self.n_ctx, self.n_noise
        live = self.tiles_noise
        h_in = self._layer_input(li)
        ctx_norm = self.config.context_kv_layer_norm  # context rows: rmsnorm(T) * input_layernorm too
        if self.recipe.conv:
            self._conv_layer(li, L, h_in, stream)
            return
        if self.recipe.fold_norms:
            # rmsnorm(rows) * input_layernorm inside the GEMM, from the context rows then h_in
            # (two pointers, never a concatenated copy: noise_embed read in place); where the
            # hidden norm folds too (fold_hidden) the context rows are fc's outputs y, entering
            # as rmsnorm(y) * hidden_norm = T: no node of its own
            self._qkv_rope(li, L, self.ctx_step, nc + nn, stream, tile_live=self.tile_live, x2=(h_in, nc),
                           norm=self._qkv_norm(L, nc))
            if self.g_attn_gate is not None:   # the gate GEMM still reads hn
                self.rms(h_in, L.input_layernorm, self.hn, stream=stream)
        else:
            if ctx_norm and li:
                self.rms(self.resid, L.input_layernorm, self.xin, stream=stream)
            elif ctx_norm:   # the first layer's noise rows are noise_embed, read in place
                self.rms(self.ctx_step, L.input_layernorm, self.xin[:nc], stream=stream)
                self.rms(h_in, L.input_layernorm, self.hn, stream=stream)
            else:
                self.rms(h_in, L.input_layernorm, self.hn, stream=stream)
            self._qkv_rope(li, L, self.xin, nc + nn, stream, tile_live=self.tile_live)
        self._attend(li, L, self.h, h_in, stream)
        if self.recipe.gate_up_x16 is not None:
            self.rms16(self.h, L.post_attention_layernorm, self.hn16, tile_live=live, stream=stream)
            self.g_gate_up(self.hn16, L.w_gate_up, self.act, nn, tile_live=live, stream=stream)
        elif self.recipe.fold_norms:
            self.g_gate_up(self.h, L.w_gate_up, self.act, nn, tile_live=live, stream=stream,
                           norm=(L.post_attention_layernorm, 0))
        else:
            self.rms(self.h, L.post_attention_layernorm, self.hn, stream=stream)
            self.g_gate_up(self.hn, L.w_gate_up, self.act, nn, tile_live=live, stream=stream)
        self.g_down(self.act, L.w_down, self.h, nn, tile_live=live, residual=self.h, stream=stream)

    def _attend(self, li: int, L, out, residual, stream, finish=None) -> None:
        """The attention sublayer after the qkv projection: the gate GEMM (reading ``hn``), the
        masked ring attention, and the o GEMM into ``out`` (``+ residual``, its epilogue, when
        given); ``finish=(base, residual, ln, out, conv_kw)``: DFlash 2's finish and norm
        after it instead (``_finish``)."""
        nn, live = self.n_noise, self.tiles_noise
        if self.g_attn_gate is not None:
            self.g_attn_gate(self.hn, L.w_attn_gate, self.gate, nn, tile_live=live, stream=stream)
        mask = self.mask_swa if L.sliding else self.mask_full
        self.attention(self.q, self.k_cache[li], self.v_cache[li], mask, self.attn, gate=self.gate,
                       stream=stream, live=self.desc, pages=self.page_table)
        if finish is not None:
            self._finish(self.g_o, self.attn, L.w_o, *finish)
            return
        self.g_o(self.attn, L.w_o, out, nn, tile_live=live, stream=stream,
                 **({} if residual is None else {"residual": residual}))

    def _conv_layer(self, li: int, L, h_in, stream) -> None:
        """A DFlash 2 decoder layer (SPEC §6): each sublayer's normed noise rows give the
        convolution coefficients (a kernel_projection GEMM into ``dconv``), the ``prepare``
        convolution of those rows (run by that GEMM itself where it fuses it, ``_prepare``) is
        the sublayer's input, and the ``finish`` convolution of its output is added to the
        residual stream. Context rows take the DFlash path unchanged (their K/V from T, or
        rmsnorm(T) * input_layernorm). Each lane's block is its own sequence (``lane_rows``).
        Each finish runs in the o / down GEMM's epilogue where it fuses (``_finish``; else
        after the GEMM, bit for bit the same). The norm that reads its output, and the first
        layer's input norm, are folded into the next kernel_projection GEMM where it can take
        them (``g_conv0`` reads ``h`` with the norm's weight, ``_fold_norms``: a property of
        the step's rows, so a lane and a single cache fold alike); else the norm is written
        into ``cx`` (``rms``, or ``finish_norm`` with the finish). After the last layer the
        final norm is an ``rms`` launch (or ``finish_norm``)."""
        nc, nn, live, bs = self.n_ctx, self.n_noise, self.tiles_noise, self.lane_rows
        conv_kw = dict(lane_rows=bs, tile_live=live, stream=stream)
        layers = self.dw.layers
        if self.config.context_kv_layer_norm:
            self.rms(self.ctx_step, L.input_layernorm, self.xin[:nc], stream=stream)
        fold = self._fold_norms
        if li == 0 and not fold:
            self.rms(h_in, L.input_layernorm, self.cx, stream=stream)
        self._prepare(L.conv_a_kp, L.conv_a_base, conv_kw,
                      (h_in, L.input_layernorm) if fold else None)   # hn = xin[nc:]
        self._qkv_rope(li, L, self.xin, nc + nn, stream, tile_live=self.tile_live)
        self._attend(li, L, self.obuf, None, stream, finish=(L.conv_a_base[1], h_in, L.post_attention_layernorm,
                                                             None if fold else self.cx, conv_kw))
        self._prepare(L.conv_m_kp, L.conv_m_base, conv_kw, (self.h, L.post_attention_layernorm) if fold else None)
        # gate_up_async: norm_lo = nn, so no row is normalised (ln is never read)
        raw = {"norm": (L.post_attention_layernorm, nn)} if self.recipe.gate_up_async else {}
        self.g_gate_up(self.hn, L.w_gate_up, self.act, nn, tile_live=live, stream=stream, **raw)
        last = li + 1 == len(layers)
        self._finish(self.g_down, self.act, L.w_down, L.conv_m_base[1], self.h,
                     self.dw.norm if last else layers[li + 1].input_layernorm,
                     self._hs if last else (None if fold else self.cx), conv_kw)

    def _finish(self, g, x, w, base, residual, ln, out, conv_kw) -> None:
        """``h`` = ``residual`` + finish(``g``'s product of ``x`` and ``w``), then ``out`` = its
        norm with ``ln``: the finish in ``g``'s epilogue where ``g`` fuses it, then an ``rms``
        launch unless ``out`` is None (the next kernel_projection GEMM folds the norm,
        ``_fold_norms``); else ``g``'s plain output into ``obuf``, then ``GroupedConv``'s
        finish, or ``finish_norm`` with ``out`` (bit-identical)."""
        nn, live, bs, stream = self.n_noise, self.tiles_noise, self.lane_rows, conv_kw["stream"]
        if g.finish is not None and g.fuses_finish(nn, bs):
            g(x, w, self.h, nn, residual=residual, tile_live=live, stream=stream,
              finish=(base, self.dconv, bs))
            if out is not None:
                self.rms(self.h, ln, out, tile_live=live, stream=stream)
            return
        plain = {} if g.finish is None else {"residual": self._zero_rows}
        g(x, w, self.obuf, nn, tile_live=live, stream=stream, **plain)
        if out is None:
            self.conv(self.obuf, base, self.dconv, 1, self.h, residual=residual, **conv_kw)
            return
        self.conv.finish_norm(self.obuf, base, self.dconv, self.h, residual, ln, out, **conv_kw)

    def _prepare(self, kp, base, conv_kw, norm=None) -> None:
        """A sublayer's coefficients ``dconv`` = kernel_projection(``cx``) and its prepare
        convolution into ``hn``: one launch where the GEMM fuses it (``fuses_conv``), else the
        GEMM and ``GroupedConv`` (bit-identical either way). ``norm=(h, ln)`` (``g_conv0``,
        ``stores_norm``): the GEMM reads ``h`` and normalises it with ``ln``, and convolves those
        rows itself (``fuses_conv_norm``: ``cx`` not written) or stores them in ``cx`` for
        ``GroupedConv`` (the same bits either way)."""
        nn, live = self.n_noise, self.tiles_noise
        stream = conv_kw["stream"]
        if norm is not None:
            h, ln = norm
            g = self.g_conv0
            if g.fuses_conv_norm(nn, conv_kw["lane_rows"]):
                g(h, kp, self.dconv, nn, tile_live=live, stream=stream, norm=(ln, 0),
                  conv=(base[0], self.hn, conv_kw["lane_rows"]))
                return
            g(h, kp, self.dconv, nn, tile_live=live, stream=stream, norm=(ln, 0), norm_out=self.cx)
            self.conv(self.cx, base[0], self.dconv, 0, self.hn, **conv_kw)
            return
        if self.g_conv.fuses_conv(nn):
            self.g_conv(self.cx, kp, self.dconv, nn, tile_live=live, stream=stream,
                        conv=(base[0], self.hn, conv_kw["lane_rows"]))
            return
        self.g_conv(self.cx, kp, self.dconv, nn, tile_live=live, stream=stream)
        self.conv(self.cx, base[0], self.dconv, 0, self.hn, **conv_kw)

    def _run_rows(self, stream, eager: bool) -> None:
        """The step after its planning launch: T for the appended context rows (the hidden
        norm folded into the qkv GEMMs where they fold the input norms), the layers, the
        final norm and the LM head (``_logits``, or the fused argmax's partials) with the
        tokens."""
        dw, nn, live = self.dw, self.n_noise, self.tiles_noise
        self._fuse_rows(self.ap_feat, self.ctx_step, self.n_ctx, stream, hidden_norm=not self.recipe.fold_hidden,
                        tile_live=self.tiles_ctx)
        for li, L in enumerate(dw.layers):
            # per-layer ranges only when eager: inside a graph they would mark capture time
            with nvtx_range(f"layer {li}") if eager else contextlib.nullcontext():
                self._step_layer(li, L, stream)
        if not self.recipe.conv:   # DFlash 2: the last layer's finish wrote it (_conv_layer)
            self.rms(self.h, dw.norm, self._hs, stream=stream)
        if self.selector is not None:   # DFlash 2: top-K of the logits, then the walk from the anchor
            sel = self.selector
            walk_args = (self._hs.reshape(self.lanes, self.lane_rows, -1), dw.selector_hp, dw.selector_pred,
                         dw.selector_succ, self.anchors, self.candidate_ids, self.candidate_values, self.draft_tokens,
                         self.selector_choice, self.selector_q, self.sample_knobs, self.sample_rng)
            if self._lm_part is not None:   # fused: each column block's top-K; merged (rows 1.. of each lane)
                self.g_lm(self._hs, self.lm_head, self._logits if self.write_logits else None, nn, tile_live=live,
                          partials=self._lm_part, stream=stream)
                # and walked in one launch
                sel.merge_and_walk(self._lm_part, *walk_args, row0=1, row_stride=self.lane_rows, stream=stream)
            else:
                self.g_lm(self._hs, self.lm_head, self._logits, nn, tile_live=live, stream=stream)
                sel.topk(self._logits, self.candidate_ids, self.candidate_values, row0=1,
                         row_stride=self.lane_rows, stream=stream)
                sel.walk(*walk_args, stream=stream)
        elif self.g_lm is not None:
            if self._logits is None:
                self.g_lm(self._hs, self.lm_head, None, nn, tile_live=live, partials=self._lm_part, stream=stream)
                self.sampler.reduce_partials(self._lm_part, self._tokens, nn, stream=stream)
            else:
                self.g_lm(self._hs, self.lm_head, self._logits, nn, tile_live=live, stream=stream)
                self.sampler(self._logits, self._tokens, self.sample_knobs, self.sample_rng, nn, stream=stream,
                             lane_rows=self.lane_rows)

    def _append_rows(self, feat, m: int, k_caches, v_caches, stream) -> None:
        """Bulk append: rows [0, m) of ``feat`` at ``ap_pos``/``ap_rows`` -> the K/V
        rows of every layer (``k_caches[l]``, ``v_caches[l]``)."""
        self._fuse_rows(feat, self.ctx, m, stream)
        for li, L in enumerate(self.dw.layers):
            src = self.ctx
            if self.ctx_kv_in is not None:
                self.rms(self.ctx, L.input_layernorm, self.ctx_kv_in, rows=m, stream=stream)
                src = self.ctx_kv_in
            self.g_kv(src, L.w_kv, self.ctx_kv, m, stream=stream)
            self.rope_ctx(self.ctx_kv, L.k_norm, self.inv_freq, self.ap_pos, self.ap_rows,
                          k_caches[li], v_caches[li], n_rows=m, stream=stream)

    def _bulk_append(self, lane: int, fields, s) -> None:
        """Append lane ``lane``'s ``[bulk_start, bulk_start+bulk_count)`` outside the graph,
        chunk by chunk, on ``s``."""
        be, ring = self.backend, self.rings[lane]
        s.wait_event(ring.write_event)
        slot_pos = self.slot_pos[lane]
        if fields.reset:
            self.ring_slots.reset_slots(slot_pos, stream=s)
        # One pinned descriptor row per chunk: bulk_count <= capacity, so there are at most
        # ceil(capacity / bulk_chunk) chunks, fewer than the rows allocated per lane.
        for i, (start, count) in enumerate(bulk_chunks(fields.bulk_start, fields.bulk_count, self.bulk_chunk)):
            host = self._bulk_desc_host[lane * self._n_chunks + i]
            be.host_write(host, f"{self.owner} bulk chunk descriptor")
            fill_chunk_descriptor(host, fields, start, count)
            be.copy_h2d_async(self.bulk_desc, host, stream=s)
            self.ring_slots.plan_append(self.bulk_desc, self.ap_pos, self.ap_rows, slot_pos, n_rows=count, stream=s,
                                        pages=self.page_table[lane])
            self.gather(self.bulk_desc, self.ring_storage[lane], self.bulk_feat, n_rows=count, stream=s)
            self._append_rows(self.bulk_feat, count, self.k_cache, self.v_cache, s)

    # ------------------------------------------------------------------ plan / run
    def plan(self, committed, stream, single: bool = False):
        """Plan one step of every lane (``committed[i]``: an int > 0, or ``None``: lane ``i``
        idle) on ``stream`` (an ``as_stream`` result): validate every lane before any change
        (``decide_lanes``; ``single``: messages name a single cache's arguments), run the bulk
        appends, pack the step's inputs. Returns the ``LaneDecisions``."""
        plan = self.decide(committed, single)
        pages = self._plan_pages(committed, plan)   # raises (nothing changed) if a lane gets none
        # ---- validated: from here on state changes
        be = self.backend
        self._take_pages(pages, stream)
        slot = self._slot ^ 1
        self.order.reuse(self._events[slot])   # the replay that read this slot's inputs
        if plan.bulk:
            self._issue_bulk(plan.bulk, stream)
            bulk = {i for i, _ in plan.bulk}
            for i, p in plan.restart:
                if i in bulk:
                    self._kv_lo[i] = p
        be.host_write(self._step_in_host[slot], f"{self.owner}.begin_step (step inputs)")
        pack_descriptors(self._desc_host[slot], plan.vals)
        if self._rng_host is not None:
            # each lane draws with its own knobs and seed, and counter = its first noise
            # position (committed): what a single cache with that lane's SamplingParams draws
            sp, rng = self.sampling, self._rng_host[slot]
            if self._sampling_in[slot] is not sp:   # (a tuple of frozen SamplingParams: same object, same knobs)
                self._knobs_host[slot][:] = [p.knobs() for p in sp]
                rng[:, 0] = [p.seed for p in sp]
                self._sampling_in[slot] = sp
            rng[:, 1] = plan.vals[DESC_COMMITTED::DESC_LEN]
        self._slot = slot
        self._plan, self._plan_fields, self._plan_desc = plan, None, self._desc_host[slot]
        self._planned = True
        return plan

    def _plan_pages(self, committed, plan) -> list:
        """The lanes' page changes for ``committed`` (``KvPages.plan``; raises
        ``PagesRefused`` with nothing changed): lanes whose slot table ``plan`` empties (a
        reset, in a bulk append or in the graph) may shrink."""
        resets = {i for i, f in plan.bulk if f.reset}
        resets.update(i for i in range(self.lanes) if plan.vals[i * DESC_LEN + DESC_RESET])
        return self.kv_pages.plan(committed, resets)

    def _take_pages(self, pages, stream) -> None:
        """Apply planned page changes and upload the tables if they changed."""
        self.kv_pages.commit(pages)
        self._upload_pages(stream)

    def decide(self, committed, single: bool = False, in_graph_max=None):
        """``decide_lanes`` over this engine's lanes (their positions, rings and runs)."""
        return decide_lanes(committed, self._next, self.rings, self.geom, self.config.swa_window, single=single,
                            kv_lo=self._kv_lo, in_graph_max=in_graph_max)

    def _issue_bulk(self, bulk, stream) -> None:
        """The bulk appends ``bulk`` (``(lane, StepFields)``) on ``stream``; each lane's
        ``next_pos`` becomes its ``committed``."""
        self.order.reuse(self._bulk_event)  # the pinned chunk descriptors of the last bulk were read
        s = self.order.order(stream)
        with nvtx_range(f"{self._nvtx} bulk append", "red"):
            for i, f in bulk:
                self._bulk_append(i, f, s)
                self._next[i] = f.committed
        self._bulk_event.record(s)
        for i, _ in bulk:
            self.rings[i].note_read(self, self._bulk_event)
        self.order.issued(s)

    def append(self, committed, stream, single: bool = False) -> None:
        """Append each lane's rows up to ``committed[i]`` (``None``: lane untouched) as
        ``begin_step`` would, outside the graph and with no step; a planned, not yet run
        step is dropped. Validates every lane first (``decide_lanes``)."""
        plan = self.decide(committed, single, in_graph_max=0)
        pages = self._plan_pages(committed, plan)
        # ---- validated: from here on state changes
        self._planned = self._anchored = False
        self._take_pages(pages, stream)
        if plan.bulk:
            self._issue_bulk(plan.bulk, stream)
        for i, v in enumerate(committed):   # lanes with nothing to append (a rewind within the slack)
            if v is not None:
                self._next[i] = int(v)
        for i, p in plan.restart:
            self._kv_lo[i] = p

    def prefill(self, lane: int, rows, stream, start=None) -> None:
        """Write ``rows`` (feature rows of positions ``start ..``, any number: checked by
        ``FeatureRing.check_rows`` before any change) into lane ``lane``'s ring and append
        them, chunk by chunk (at most ``min(ring capacity, capacity)`` rows each, so a prompt
        longer than the ring streams through it); ``next_pos`` becomes ``start + len(rows)``.
        ``start`` (default ``next_pos``) may skip ahead of ``next_pos`` only as far as the
        final window's first position (a jump: the window must not reach rows never given).
        Rows below the final window and its slack (the last ``capacity + rewind_slack``
        positions) are neither written nor appended (the lane's run then starts past
        ``start``, as after a jump). A planned, not yet run step is dropped.
        Each chunk is one bulk append; the host waits for the previous one to have read its
        pinned chunk descriptors before it writes the next."""
        ring, g = self.rings[lane], self.geom
        _, checked, _ = ring.check_rows(rows)
        p0 = self._next[lane]
        n = int(checked.shape[0])
        start = p0 if start is None else int_arg(start, "start", 0)
        end = start + n
        if end > INT32_MAX - g.q_len:
            raise ValueError(f"rows: positions [{start}, {end}) overflow int32 (with the noise block)")
        win_lo = end - min(end, g.capacity)
        if start != p0 and not p0 < start <= win_lo:
            where = "behind" if start < p0 else "ahead of"
            raise ValueError(f"start={start} is {where} next_pos={p0}: prefill continues at next_pos, or jumps "
                             f"ahead no further than its final window's first position ({win_lo} for "
                             f"{n} rows); for a rewind use begin_step / append, or reset first")
        pages = self.kv_pages.plan([end if i == lane else None for i in range(self.lanes)]) if n else []
        # ---- validated: from here on state changes
        self._planned = self._anchored = False
        if not n:
            return
        self._take_pages(pages, stream)
        # the last capacity + rewind_slack rows: the window, and what a rewind within the slack needs
        first = max(start, end - min(end, g.slots))
        if first > p0:
            self._kv_lo[lane] = first
        step = min(ring.capacity, g.capacity)
        for s in range(first, end, step):
            c = min(step, end - s)
            ring.write(s, checked[s - start:s - start + c], stream, check_finite=False)
            lo = max(0, s + c - g.capacity)
            self._issue_bulk([(lane, StepFields(s + c, lo, s + c, 0, lo, False, s, c))], stream)

    def _upload_pages(self, stream) -> None:
        """The page tables onto the device when a lane's pages changed (in stream order: after
        the steps that read the old tables, before the bulk appends and the step that read
        the new ones)."""
        if self.kv_pages.version == self._pages_version:
            return
        s = self.order.order(stream)
        self._pages_staging.copy(self.order, self.page_table, lambda st: np.copyto(st, self.kv_pages.table), s)
        self.order.issued(s)
        self._pages_version = self.kv_pages.version

    def kv_memory(self):
        """The K/V pools' accounting (``kv_pages.PagesUsage``): bytes per pool, used and free
        pages, pages per lane."""
        return self.kv_pages.usage(self.config.kv_dim * 2, 2 * self.config.n_layer)

    def lane_fields(self) -> list:
        """Per lane: the ``StepFields`` of the latest planned step (``None``: idle)."""
        if self._plan_fields is None and self._plan is not None:
            self._plan_fields = [self._plan.fields(i) for i in range(self.lanes)]
        return self._plan_fields

    def _check_rings_hold(self, lane_word) -> None:
        """The planned step reads ring positions ``[start, committed)`` of each active lane:
        every ring must still hold them (a write after ``plan`` may have replaced them)."""
        d, rings = self._plan_desc, self.rings
        if self.lanes <= _PY_CHECK_LANES:
            for i, r in enumerate(rings):
                row = d[i]
                if not row[DESC_ACTIVE]:
                    continue
                if r._closed:
                    raise RuntimeError(f"run(): {lane_word(i)} has been closed")
                need, c = int(row[DESC_START]), int(row[DESC_COMMITTED])
                if need < c and not (r.lo <= need and c <= r.hi):
                    self._not_held(lane_word(i), need, c, r)
            return
        act, c, need = d[:, DESC_ACTIVE] != 0, d[:, DESC_COMMITTED].astype(np.int64), d[:, DESC_START]
        rlo = np.fromiter((r.lo for r in rings), np.int64, self.lanes)
        rhi = np.fromiter((r.hi for r in rings), np.int64, self.lanes)
        bad = act & (need < c) & ~((rlo <= need) & (c <= rhi))
        closed = [i for i, r in enumerate(rings) if r._closed and act[i]]
        if closed:
            raise RuntimeError(f"run(): {lane_word(closed[0])} has been closed")
        if bad.any():
            i = int(np.argmax(bad))
            self._not_held(lane_word(i), int(need[i]), int(c[i]), rings[i])

    @staticmethod
    def _not_held(ring_word, need, c, ring):
        raise RuntimeError(f"run(): {ring_word} no longer holds positions [{need}, {c}) that this step was "
                           f"planned to append (it holds [{ring.lo}, {ring.hi}): a write after begin_step "
                           f"replaced them); call begin_step again")

    def run(self, stream, eager: bool, lane_word, copies=()) -> None:
        """Replay (``eager``: launch one by one) the planned step of every lane on ``stream``,
        then the ``copies`` (``(dst, src)`` device arrays) after it; consumes the plan.
        ``lane_word(i)``: how messages name lane ``i``'s ring."""
        if not self._planned:
            raise RuntimeError("run() needs a planned step: call begin_step first (each begin_step plans exactly "
                               "one run)")
        self._check_rings_hold(lane_word)
        if self.selects and not self._anchored:
            raise RuntimeError("run(): a DFlash 2 step needs each active lane's anchor (the block's first token): "
                               "set it after begin_step (set_anchor / set_anchors, or step(..., anchor=))")
        slot, be = self._slot, self.backend
        s = self.order.order(stream)
        # The planning launch reads every lane's ring storage: wait for the rings written
        # since the last step (older writes are ordered before it already: by that step's
        # waits, then stream order or the edge to the order's tail).
        seen = self._ring_writes
        for i, ring in enumerate(self.rings):
            if ring.writes != seen[i]:
                s.wait_event(ring.write_event)
                seen[i] = ring.writes
        self.graphs.launch(slot, s, eager)
        for dst, src in copies:
            be.copy_d2d_async(dst, src, stream=s)
        self._events[slot].record(s)
        for ring in self.rings:
            ring.note_read(self, self._events[slot])   # the ring's next write waits for this step
        self.order.issued(s)
        self._planned = self._anchored = False
        # each active lane's next position is its committed count (from the plan's own list:
        # no per-lane read of the pinned buffer)
        vals = self._plan.vals
        self._next = [c if a else n for n, a, c in zip(self._next, vals[DESC_ACTIVE::DESC_LEN],
                                                       vals[DESC_COMMITTED::DESC_LEN])]
        for i, p in self._plan.restart:   # (rare: resets and jumps)
            self._kv_lo[i] = p

    def reset(self, lanes, stream) -> None:
        """Forget the cached rows of ``lanes`` on ``stream``; a planned, not yet run step is
        dropped."""
        s = self.order.order(stream)
        self._planned = self._anchored = False
        for i in lanes:
            self._next[i] = self._kv_lo[i] = 0
            self.ring_slots.reset_slots(self.slot_pos[i], stream=s)
        self.order.issued(s)
        self.kv_pages.release(lanes)   # the next plan uploads the tables

    # ------------------------------------------------------------------ noise embeddings
    def check_host_noise(self, noise_embed, shape) -> np.ndarray:
        """Host noise embeddings as given (NumPy): ``shape``, a float dtype or bf16
        (``ml_dtypes``), converted to f32 in the staging copy."""
        host = np.asarray(noise_embed)
        if host.shape != shape:
            raise ValueError(f"noise_embed must have shape {list(shape)}, got {list(host.shape)}")
        if host.dtype.kind != "f" and host.dtype != dtypes.HOST["bf16"]:
            raise TypeError(f"noise_embed must be a float array, got dtype {host.dtype}")
        return host

    def copy_noise(self, host, dev, stream) -> None:
        """``[lanes, q_len, hidden]`` noise embeddings into ``noise_embed`` on ``stream``:
        ``dev`` (a device array) copied on the device, else ``host`` through the pinned staging
        buffers in turn."""
        be = self.backend
        s = self.order.order(stream)
        B, BS = self.q_len, self.lane_rows
        if dev is not None:
            if BS == B:
                be.copy_d2d_async(self.noise_embed, dev.reshape(self.lanes * B, -1), stream=s)
            else:
                for i in range(self.lanes):
                    be.copy_d2d_async(self.noise_embed[i * BS:i * BS + B], dev[i], stream=s)
        else:
            def fill(stage):   # each lane's rows; the padding is never read
                stage.reshape(self.lanes, BS, -1)[:, :B] = host
            self._noise_staging.copy(self.order, self.noise_embed, fill, s)
        self.order.issued(s)

    # ------------------------------------------------------------------ anchors (DFlash 2)
    def check_host_anchors(self, anchors, idle_ok) -> list:
        """Host anchors, one token id per lane (``None`` for a lane with ``idle_ok[i]``), each in
        ``[0, vocab)``; raises naming the lane (``lanes == 1``: the anchor) before any change."""
        if not self.selects:
            raise ValueError("anchors are read by a DFlash 2 drafter's candidate selector only (this "
                             + ("drafter is not DFlash 2)" if self.config.dflash2 is None else "cache has no lm_head)"))
        V, out = self.config.dflash2.vocab_size, []
        for i, a in enumerate(anchors):
            name = "anchor" if self.lanes == 1 else f"anchors[{i}]"
            if a is None and idle_ok[i]:
                out.append(0)
                continue
            if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)):
                raise TypeError(f"{name} must be a token id (an int), got {a!r}"
                                + ("" if self.lanes == 1 else " (None only for a lane idle this step)"))
            if not 0 <= a < V:
                raise ValueError(f"{name}={a} is outside the vocabulary [0, {V})")
            out.append(int(a))
        return out

    def copy_anchors(self, host, dev, stream) -> None:
        """The planned step's anchors into ``anchors`` on ``stream``: ``dev`` (a device int32
        ``[lanes]`` array, read on the device: out-of-range ids are clamped and flagged in
        ``selector.flags``) or ``host`` (checked ints) through the pinned staging in turn."""
        be = self.backend
        s = self.order.order(stream)
        if dev is not None:
            be.copy_d2d_async(self.anchors, dev, stream=s)
        else:
            def fill(stage):
                stage[:] = host
            self._anchor_staging.copy(self.order, self.anchors, fill, s)
        self.order.issued(s)
        self._anchored = True

    # ------------------------------------------------------------------ lifetime
    def check_open(self):
        if self._closed:
            raise RuntimeError(f"{self.owner} is closed")

    def synchronize(self) -> None:
        """Host wait for every piece of work this engine issued, on any stream."""
        self.order.synchronize()

    @classmethod
    def build(cls, weights, capacity: int, lanes: int, **kwargs) -> "StepEngine":
        """``StepEngine(weights, capacity, lanes, **kwargs)`` with ``allocated``: the bytes its
        construction allocated (an ``AllocationLedger``). The device weights are placed first,
        outside that count: they are shared by every cache built on the same weights."""
        be = backends.get(kwargs.get("backend"))
        weights.device(be)
        with be.ledger() as led:
            engine = cls(weights, capacity, lanes, **kwargs)
        engine.allocated = led
        return engine

    def memory_report(self, ring_bytes: int = 0) -> MemoryReport:
        """The device bytes this engine holds, by pool (``memory_plan``): the K/V rows, the
        masks and tables, the step's own buffers (everything else its construction allocated),
        ``ring_bytes`` of feature rings the facade owns, and the shared weights apart."""
        nbytes = lambda arrays: sum(int(a.nbytes) for a in arrays if a is not None)  # noqa: E731
        kv = nbytes((*self.k_cache, *self.v_cache))
        masks = nbytes((self.mask_full, self.mask_swa, self.slot_pos, self.page_table))
        lm = 0 if self.lm_head is None else int(self.lm_head.nbytes)
        lm_owned = lm if self._lm_owned else 0
        step = self.allocated.device - kv - masks - lm_owned
        pools = {"kv": kv, "feature_rings": int(ring_bytes), "masks": masks, "step": step,
                 "weights": self.dw.nbytes + lm}
        use = self.kv_memory()
        return MemoryReport(pools, page_size=use.page_rows, pages_used=use.used, pages_free=use.free,
                            lane_pages=tuple(use.per_lane))

    def close(self) -> None:
        """Wait for the queued work (its errors not raised here), stop being a reader of the
        rings, and drop every device array, pinned buffer, graph and compiled op."""
        if self._closed:
            return
        self.order.drain()
        for ring in self.rings or ():
            if not ring._closed:
                ring.forget_reader(self)
        self.graphs.release()
        keep = {"backend", "config", "weights", "geom", "lanes", "owner", "_next", "_kv_lo", "_plan", "_plan_fields",
                "sampling", "write_logits", "bulk_chunk", "graphs", "order", "_closed"}
        for name in list(vars(self)):
            if name not in keep:
                setattr(self, name, None)
        self._closed = True


class EngineFacade:
    """What ``DraftKvCache`` and ``DraftKvBatch`` share as facades of one ``StepEngine``
    (``self.engine``): attributes they do not define are the engine's (the ops, buffers,
    recipe, graphs, stream order, tuning), the geometry, the host wait, the closed check,
    ``set_sampling`` and the release. Nothing of the step is here: it is the engine's."""

    def __getattr__(self, name):
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    capacity = property(lambda self: self.geom.capacity)
    q_len = property(lambda self: self.geom.q_len)
    kv_total = property(lambda self: self.geom.kv_total)
    a_step = property(lambda self: self.geom.a_step)

    def synchronize(self) -> None:
        """Host wait for every piece of work this object issued, on any stream."""
        self.engine.synchronize()

    def memory(self):
        """The device memory this object holds, by pool: a ``MemoryReport`` (``memory_plan``;
        ``.table()`` prints it). ``bytes_for`` sizes the same pools before allocating."""
        self._check_open()
        rings = getattr(self, "ring_storage", None)
        return self.engine.memory_report(0 if rings is None else int(rings.nbytes))

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def set_sampling(self, sampling) -> None:
        """How the next planned steps turn logits into ``draft_tokens``: a ``SamplingParams``
        (temperature 0: greedy) for every lane, or (``DraftKvBatch``) a sequence of one per
        lane. It takes effect at the next ``begin_step`` (the knobs travel with that step's
        inputs: no recapture, no host wait); each lane draws with counter = its first noise
        position, so a seed reproduces a whole run. Bad input raises naming ``sampling`` (or
        ``sampling[i]``) and changes nothing."""
        self._check_open()
        self.engine.set_sampling(sampling)

    def _release(self, keep) -> None:
        """Close the engine and drop every attribute but ``keep`` (only what repr and the
        closed checks read stays)."""
        self.engine.close()
        for name in list(vars(self)):
            if name not in keep and name not in ("engine", "_closed"):
                setattr(self, name, None)
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
