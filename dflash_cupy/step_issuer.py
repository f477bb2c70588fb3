"""What ``DraftKvCache`` and ``DraftKvBatch`` share: placing the LM head, allocating the step's
rows and building its kernels, the geometry properties, the step's layers and head (one
code path; the lane batch's row skipping through small hooks). Three parts are objects of
their own, held by the cache or batch:

* ``StepRecipe`` (frozen): the fusion decisions, computed once at construction;
* ``StreamOrder`` (``stream_order.py``): issuing work on the caller's stream after this
  object's earlier work (event edges on the device, never a host wait), and reusing pinned
  staging only once the work that read it has run;
* ``StepGraphs``: running a step either eagerly or as one of its two step graphs, captured
  on first use and replayed after."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from . import backends, dtypes, tuning
from . import selfcheck_verdict as selfcheck_mod
from .backends.base import programmatic_launches
from .checks import bool_arg
from .device_weights import device_dtype, to_device_matrix
from .interop import device_view
from .nvtx_ranges import nvtx_range
from .ops.attention import RingAttention
from .ops.gemm import weight_kind
from .ops.norm import RmsNorm
from .ops.ring_slots import RingSlots
from .ops.rope import QkvNormRope
from .ops.sample import SamplingParams, TokenSampler
from .stream_order import StreamOrder


# Steps with at least this many noise rows (x_split=False) run the post-attention norm as
# its own launch writing rmsnorm(h) * ln rounded once to the weight type, and the gate_up
# GEMM reads those 16-bit rows (x16) instead of folding the norm and staging f32 h: every
# column group stages the step's rows, so with many rows (a lane batch) that halves the
# gate_up GEMM's largest L2 stream for one small node; with few rows the fold, one node
# fewer, is cheaper. The cost model (profiling/lanes_model.py, h4096 2K, H200) crosses
# between 96 rows (+10 us per step) and 128 (-9 us; -85 us at 256 rows, -207 at 1024).
GATE_UP_X16_MIN_ROWS = 128


@dataclass(frozen=True)
class StepRecipe:
    """The step's fusion decisions, made once when a cache or batch is built (``derive``) and
    read by its allocation, its kernel builds and every step.

    ``fold_norms``: the per-layer input and post-attention RMSNorms fold into the qkv and
    gate_up GEMMs (they run on the stream path: 16-bit weights, K % 8 == 0); those GEMMs then
    read ``resid`` / ``h`` directly, so the context rows live in ``resid``.
    ``fold_hidden``: the hidden norm folds into every layer's qkv GEMM too (``ln_lo``): the
    folded norms without the context-KV-norm variant (whose context rows are normalised
    twice), with hi + lo activations (the default). With ``x_split=False`` the context rows
    would enter as bf16(y * hidden_norm) instead of bf16(T): statistically the same error
    (over 4 seeds of test_kv_cache's schedules b / f the maxima were 1.33-2.28e-2 before,
    1.74-2.08e-2 folded), but the pinned seed's maximum moves from 1.52e-2 to 2.02e-2, past
    test_kv_cache's X1_CEILING of 2e-2, so that mode keeps the hidden rmsnorm node.
    ``attn16`` / ``act16``: the 16-bit weight kind ("f16" / "bf16") the attention output and
    the silu * up activations are stored in, or None for f32. With ``x_split=False`` their
    only readers (the o and down projections) round them to their weight type once anyway,
    so storing them rounded by their producers (the attention, the gate_up epilogue) is
    bit-identical and halves the bytes those GEMMs re-read per column group; only where the
    reading GEMM runs the stream path (f16/bf16 weights, K % 8 == 0) and, for ``act``, the
    gate_up and down weights share the type.
    ``gate_up_x16``: the kind the gate_up GEMM's input rows are stored in by a norm launch of
    their own (``hn16``, see ``GATE_UP_X16_MIN_ROWS``), or None (the norm folded, or f32
    rows): ``x_split=False``, a 16-bit gate_up weight with H % 8 == 0 and enough noise rows.
    ``qkv_rope``: the qkv GEMM is offered the q/k norm + RoPE + K/V scatter epilogue (where
    the step's rows take the wgmma kernel by default: its qkv variants are compiled now, and
    cost a build where they would never run). ``lane_batched``: the GEMMs read ``tile_live``
    (K split per launch from the live tiles; the qkv GEMM skips the context rows' Q)."""
    fold_norms: bool
    fold_hidden: bool
    attn16: str | None
    act16: str | None
    gate_up_x16: str | None
    qkv_rope: bool
    lane_batched: bool

    @classmethod
    def derive(cls, config, dw, checked, x_split: bool, n_ctx: int, n_noise: int,
               lane_batched: bool) -> "StepRecipe":
        """The recipe for these weights (``dw``: on the device), self-check verdict, rounding
        and step rows (``n_ctx`` context rows, then ``n_noise`` noise rows)."""
        from .ops.gemm_stream import WG_MIN_M
        c, L0, H = config, dw.layers[0], config.hidden_size
        kind = {k: weight_kind(getattr(L0, k).dtype) for k in ("w_qkv", "w_o", "w_gate_up", "w_down")}
        sixteen = ("f16", "bf16")
        fold = checked.stream and H % 8 == 0 and kind["w_qkv"] in sixteen and kind["w_gate_up"] in sixteen
        attn = act = x16 = None
        if not x_split and checked.stream:
            o, gu, dn = kind["w_o"], kind["w_gate_up"], kind["w_down"]
            attn = o if o in sixteen and c.q_dim % 8 == 0 else None
            act = dn if dn in sixteen and gu == dn and c.intermediate_size % 8 == 0 and H % 8 == 0 else None
            if n_noise >= GATE_UP_X16_MIN_ROWS and gu in sixteen and H % 8 == 0:
                x16 = gu
        return cls(fold_norms=bool(fold), fold_hidden=bool(fold and not c.context_kv_layer_norm and x_split),
                   attn16=attn, act16=act, gate_up_x16=x16, qkv_rope=n_ctx + n_noise >= WG_MIN_M,
                   lane_batched=bool(lane_batched))


class StepGraphs:
    """``StepGraphs(backend, issue, pdl=False, nvtx="dflash")``: a step run eagerly or as one
    of its graphs, one per descriptor buffer (``slots``), each captured on a private stream
    (``capture_stream``: a CUDA graph cannot be captured on the legacy default stream) the
    first time and replayed on the caller's stream after. ``issue(slot, stream, eager)``
    issues every launch and copy of one step. ``pdl``: each launch right after another launch
    of a capture carries programmatic stream serialization (``base.programmatic_launches``);
    eager steps never do."""

    def __init__(self, backend, issue, *, pdl: bool = False, nvtx: str = "dflash"):
        self.backend = backend
        self._issue = issue
        self.pdl = pdl
        self._nvtx = nvtx
        self.capture_stream = backend.stream()
        self.slots = [None, None]
        self.captures = 0      # step graphs captured so far

    def launch(self, slot: int, s, eager: bool) -> None:
        """Step ``slot`` on ``s``: its kernels one by one (``eager``), or its graph."""
        if eager:
            with nvtx_range(f"{self._nvtx} eager step", "yellow"):
                self._issue(slot, s, eager=True)
            return
        graph = self.slots[slot]
        if graph is None:
            be, cs = self.backend, self.capture_stream
            with nvtx_range(f"{self._nvtx} capture", "purple"):
                be.begin_capture(cs)
                try:
                    with programmatic_launches(self.pdl):
                        self._issue(slot, cs)
                finally:
                    graph = be.end_capture(cs)
                self.slots[slot] = graph
                self.captures += 1
        with nvtx_range(f"{self._nvtx} replay", "blue"):
            graph.launch(s)

    def release(self) -> None:
        """Drop the graphs and the capture stream (``captures`` stays readable)."""
        self.slots = [None, None]
        self._issue = self.capture_stream = None


class StepIssuer:
    """Base of ``DraftKvCache`` and ``DraftKvBatch``. The subclass's constructor calls
    ``_take_args`` once its own arguments are checked, sets ``geom`` and ``dw``, calls
    ``_alloc_step_rows(n_ctx, n_noise)`` (the step's rows, the GEMMs' M axis: ``n_ctx``
    appended context rows, then ``n_noise`` noise rows; it derives the ``recipe``), then
    ``_build_step_ops``, and ``_finish_init`` last (the stream order and the step graphs).
    Its ``_issue_step(slot, stream, eager)`` issues one step (the descriptor copy and the
    planning launch, then ``_run_rows``); ``_qkv_skip`` and the attributes below say which
    rows the step's launches skip."""

    _nvtx = "dflash"   # NVTX range prefix
    # lane batches pass tile_live to their GEMMs (per launch K split; qkv skips context rows' Q)
    lane_batched = False
    pdl = False        # the subclass's pdl= (programmatic dependent launch in its step graphs)
    # A lane batch's device flags per 16-row tile of its context / noise rows (the stream GEMMs
    # and the norms skip dead tiles: idle lanes, padding) and the per-lane descriptors its
    # attention reads (an idle lane's blocks exit at once); None: every row is live.
    tiles_ctx = tiles_noise = None
    _attn_live = None

    def _take_args(self, weights, backend, x_split, pdl, tune, selfcheck=None) -> None:
        """The constructor arguments every issuer takes, checked after the subclass's own
        (so a bad one raises before anything is allocated). ``selfcheck``: the device's
        self-check verdict decides which kernel variants this object may use (``checked``,
        ``dflash_cupy/selfcheck.py``): a failed one is replaced by its fallback."""
        self.x_split = bool_arg(x_split, "x_split")
        self.pdl = bool_arg(pdl, "pdl")
        if tune is not None:
            bool_arg(tune, "tune")
        self.backend = backends.get(backend)
        self.config = weights.config
        self.weights = weights
        self.checked = selfcheck_mod.for_cache(self.backend, selfcheck)
        self.pdl = self.pdl and self.checked.pdl    # PDL -> the plain graph

    capacity = property(lambda self: self.geom.capacity)
    q_len = property(lambda self: self.geom.q_len)
    kv_total = property(lambda self: self.geom.kv_total)
    a_step = property(lambda self: self.geom.a_step)

    def _label_arrays(self, names) -> None:
        """Name the device arrays held in these attributes (lists: each item) for the
        emulator's reports."""
        for name in names:
            v = getattr(self, name)
            for i, a in enumerate(v if isinstance(v, list) else [v]):
                if a is not None:
                    suffix = f"[{i}]" if isinstance(v, list) else ""
                    self.backend.label(a, f"{type(self).__name__}.{name}{suffix}")

    def _place_lm_head(self, lm_head):
        """The target's ``[vocab, hidden]`` LM head on the device: a device array of any
        framework used in place, else NumPy copied once."""
        be, H = self.backend, self.config.hidden_size
        dev = device_view(be, lm_head, "lm_head", dtype=(np.float32, np.float16, np.uint16),
                          shape=(None, H))
        if dev is not None:  # the caller's device matrix, used in place
            if not be.is_device_array(dev):  # emulated: foreign CPU memory has no guard pages
                dev = be.asarray(dev)
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

    def _alloc_step_rows(self, n_ctx: int, n_noise: int) -> int:
        """The fusion decisions (``recipe``) and the step's activations over its rows (``n_ctx``
        context rows, then ``n_noise`` noise rows); returns the attention gate's width (0: no
        gate)."""
        be, c = self.backend, self.config
        self.n_ctx, self.n_noise = n_ctx, n_noise
        self.recipe = r = StepRecipe.derive(c, self.dw, self.checked, self.x_split, n_ctx, n_noise,
                                            self.lane_batched)
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
        self.rope_ctx = QkvNormRope(be, c.head_dim, c.n_head, c.n_head_kv, False, c.rms_norm_eps,
                                    self.attn_scaling)
        self.rope_step = QkvNormRope(be, c.head_dim, c.n_head, c.n_head_kv, True, c.rms_norm_eps,
                                     self.attn_scaling)
        self.attention = RingAttention(be, c.head_dim, c.n_head, c.n_head_kv, self.q_len, self.kv_total,
                                       gate=None if c.attn_gate == "none" else c.attn_gate,
                                       out_kind=self.recipe.attn16,
                                       path="auto" if self.checked.attention_mma else "fma", **attn_kw)
        self.ring_slots = RingSlots(be, self.geom)

    def _build_gemms(self, max_m: int, gate_w: int, logits: bool, lm_rows: int) -> None:
        """The step's GEMMs (``g_fc`` .. ``g_lm``), compiled now, every one
        rounding its activations as ``self.x_split`` says; ``_lm_part``: the
        fused argmax's partials for ``lm_rows`` rows (``logits=False``)."""
        from .ops.gemm import Gemm
        from .ops.rope import RopeSpec
        be, c, H = self.backend, self.config, self.config.hidden_size
        L0, kvw = self.dw.layers[0], c.kv_dim
        r = self.recipe
        fold_eps = c.rms_norm_eps if r.fold_norms else None
        # lane batches (tile_live): K split per launch from the live tiles, and the qkv GEMM
        # skips the Q columns of the context rows (tile_live 2)
        lanes = r.lane_batched
        # the self-check's choices: a failed stream GEMM -> gemm.cu, a failed wgmma -> gemm_stream.cu
        ch = self.checked
        fallback = dict(path="auto" if ch.stream else "fma", **({} if ch.wgmma else {"wgmma": False}))

        def gemm(*a, **kw):
            with selfcheck_mod.applied(ch):
                return Gemm(be, *a, max_m=max_m, x_split=self.x_split, live_split=lanes, **fallback, **kw)
        self.g_fc = gemm(H, c.fc_in, self.dw.fc.dtype)
        self.g_kv = gemm(2 * kvw, H, L0.w_qkv.dtype)
        # rope: the q/k norm + RoPE + K/V scatter folds into the qkv GEMM's epilogue where its
        # launch allows (_qkv_rope); QkvNormRope (rope_step) runs after it elsewhere
        rope = RopeSpec(c.head_dim, c.n_head, c.n_head_kv, c.rms_norm_eps, self.attn_scaling) \
            if r.qkv_rope else None
        self.g_qkv = gemm(c.q_dim + 2 * kvw, H, L0.w_qkv.dtype, norm_eps=fold_eps,
                          skip_cols=c.q_dim if lanes else 0, rope=rope)
        self.g_o = gemm(H, c.q_dim, L0.w_o.dtype, "residual", x16=r.attn16 is not None)
        x16 = r.gate_up_x16 is not None   # its norm a launch of its own (rms16), 16-bit rows
        self.g_gate_up = gemm(c.intermediate_size, H, L0.w_gate_up.dtype, "silu_mul",
                              norm_eps=None if x16 else fold_eps, x16=x16, y16=r.act16 is not None)
        self.g_down = gemm(H, c.intermediate_size, L0.w_down.dtype, "residual", x16=r.act16 is not None)
        self.g_attn_gate = gemm(gate_w, H, L0.w_attn_gate.dtype) if gate_w else None
        self.g_lm = self._lm_part = None
        if self.lm_head is not None:
            V = self.lm_head.shape[0]
            fused = not logits and ch.stream   # the fused argmax is a stream-GEMM epilogue
            self.g_lm = (gemm(V, H, self.lm_head.dtype) if not fused else
                         gemm(V, H, self.lm_head.dtype, "argmax", logits=False))
            if fused:
                self._lm_part = be.zeros(self.g_lm.partials_shape(lm_rows), np.uint32)
            elif not logits:   # its fallback: logits into a buffer of this object's, then the greedy sampler
                self._logits = be.zeros((lm_rows, V), np.float32)
                if getattr(self, "sample_knobs", None) is None:
                    self.sample_knobs = be.asarray(np.asarray(SamplingParams().knobs(), np.float32))  # greedy
                    self.sample_rng = be.zeros((2,), np.uint64)

    def _tune_sites(self) -> list:
        """``(label, op, m)`` of every GEMM call a step or a bulk chunk makes, and the attention."""
        nc, nn, R = self.n_ctx, self.n_noise, self.bulk_chunk
        return [("fc", self.g_fc, nc), ("fc", self.g_fc, R), ("kv", self.g_kv, R), ("qkv", self.g_qkv, nc + nn),
                ("attn_gate", self.g_attn_gate, nn), ("o", self.g_o, nn), ("gate_up", self.g_gate_up, nn),
                ("down", self.g_down, nn), ("lm_head", self.g_lm, nn), ("attention", self.attention, 0)]

    def _finish_init(self, labels, tune) -> None:
        """The constructor's last step: the step state, the emulator's names for ``labels``,
        the GEMMs' launch configurations measured on the device (``dflash_cupy/tuning.py``,
        before any capture), the step graphs and the stream order (construction memsets on
        the current stream: the first call on any other stream waits for them on the device)."""
        self._slot = 0         # the descriptor buffer the planned step uses
        self._planned = False
        self._closed = False
        self._label_arrays(labels)
        selfcheck_mod.require(self.checked, self)   # a failed variant with no fallback left: raise
        self.tuned = tuning.tune_sites(self._tune_sites(), backend=self.backend, tune=tune)
        self.graphs = StepGraphs(self.backend, self._issue_step, pdl=self.pdl, nvtx=self._nvtx)
        self.order = StreamOrder(self.backend)

    # the composed objects' state under the names the step code and the tests read
    capture_stream = property(lambda self: self.graphs.capture_stream)
    captures = property(lambda self: self.graphs.captures)        # step graphs captured so far
    _graphs = property(lambda self: self.graphs.slots)
    _tail = property(lambda self: self.order.tail)
    # times the host had to wait for queued work to reuse a pinned buffer
    host_waits = property(lambda self: self.order.host_waits)

    # ------------------------------------------------------------ shared step pieces
    def _layer_input(self, li: int):
        """The residual stream's noise rows layer ``li`` reads: ``noise_embed`` itself for the
        first layer, read in place (its o GEMM writes ``h = noise_embed + attn @ Wo``, so no
        step copies it into ``h``), ``h`` after."""
        return self.h if li else self.noise_embed

    def _qkv_x2(self, li: int, n_ctx: int) -> dict:
        """The qkv GEMM's second input when it reads ``ctx_step`` then the layer's noise rows
        (two pointers, never a concatenated copy): ``x2`` = (noise rows, n_ctx)."""
        return dict(x2=(self._layer_input(li), n_ctx))

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
        and ``rope_step`` (``gemm_kw``: pad_rows, norm, tile_live; the last also for the rope)."""
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
        context rows' q is computed and ignored, or skipped where the wgmma kernel
        reads tile_live: free next to streaming the weights once instead of twice).
        Rows the step does not need are skipped as ``_qkv_skip``, ``tiles_noise`` and
        ``_attn_live`` say (same outputs for every row a later launch reads)."""
        nc, nn = self.n_ctx, self.n_noise
        live = self.tiles_noise
        h_in = self._layer_input(li)
        ctx_norm = self.config.context_kv_layer_norm  # context rows: rmsnorm(T) * input_layernorm too
        if self.recipe.fold_norms:
            # rmsnorm(rows) * input_layernorm inside the GEMM, from the context rows then h_in
            # (two pointers: noise_embed read in place); where the hidden norm folds too
            # (_fold_hidden) the context rows are fc's outputs y, entering as
            # rmsnorm(y) * hidden_norm = T: no node of its own
            self._qkv_rope(li, L, self.ctx_step, nc + nn, stream, **self._qkv_skip(), **self._qkv_x2(li, nc),
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
            self._qkv_rope(li, L, self.xin, nc + nn, stream, **self._qkv_skip())
        if self.g_attn_gate is not None:
            self.g_attn_gate(self.hn, L.w_attn_gate, self.gate, nn, tile_live=live, stream=stream)
        mask = self.mask_swa if L.sliding else self.mask_full
        self.attention(self.q, self.k_cache[li], self.v_cache[li], mask, self.attn, gate=self.gate,
                       stream=stream, live=self._attn_live)
        self.g_o(self.attn, L.w_o, self.h, nn, tile_live=live, residual=h_in, stream=stream)
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
        self.rms(self.h, dw.norm, self._hs, stream=stream)
        if self.g_lm is not None:
            if self._logits is None:
                self.g_lm(self._hs, self.lm_head, None, nn, tile_live=live, partials=self._lm_part, stream=stream)
                self.sampler.reduce_partials(self._lm_part, self._tokens, nn, stream=stream)
            else:
                self.g_lm(self._hs, self.lm_head, self._logits, nn, tile_live=live, stream=stream)
                self.sampler(self._logits, self._tokens, self.sample_knobs, self.sample_rng, nn, stream=stream)

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

    def _check_host_noise(self, noise_embed, shape) -> np.ndarray:
        """Host noise embeddings as given (NumPy): ``shape``, a float dtype or bf16
        (``ml_dtypes``), converted to f32 in the staging copy."""
        host = np.asarray(noise_embed)
        if host.shape != shape:
            raise ValueError(f"noise_embed must have shape {list(shape)}, got {list(host.shape)}")
        if host.dtype.kind != "f" and host.dtype != dtypes.HOST["bf16"]:
            raise TypeError(f"noise_embed must be a float array, got dtype {host.dtype}")
        return host

    def _copy_noise_host(self, host, s) -> None:
        """Host noise embeddings -> ``noise_embed`` on ``s``, through the pinned staging
        buffers in turn (``_noise_rows``: where in a staging buffer they go)."""
        i = self._noise_next
        self._noise_next ^= 1
        self.order.reuse(self._noise_events[i])  # the copy that last read this staging buffer
        stage = self._noise_host[i]
        self.backend.host_write(stage, f"{type(self).__name__}.set_noise_embed (staging)")
        self._noise_rows(stage)[...] = host
        self.backend.copy_h2d_async(self.noise_embed, stage, stream=s)
        self._noise_events[i].record(s)

    def _noise_rows(self, stage):
        """Where the noise embeddings go in a staging buffer (a lane batch pads its lanes)."""
        return stage

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def synchronize(self) -> None:
        """Host wait for every piece of work this object issued, on any stream."""
        self.order.synchronize()

    def _release(self, keep) -> None:
        """Close: drop every attribute but ``keep`` (device arrays, pinned staging, graphs,
        compiled ops), so that only what repr and the closed checks read stays (the
        stream order and the graphs' capture count too)."""
        self.graphs.release()
        for name in list(vars(self)):
            if name not in keep and name not in ("graphs", "order"):
                setattr(self, name, None)
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
