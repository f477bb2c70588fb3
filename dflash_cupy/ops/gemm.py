"""Small-M weight-streaming GEMM (``cuda_src/gemm.cu``) and its NumPy reference.

``y[:m] = x[:m] @ W.T`` with f32 activations, f32/f16/bf16 weights ``[N, K]``
(Hugging Face ``[out, in]``), f32 accumulation and a fused epilogue:

* ``"none"``: ``y = acc``
* ``"residual"``: ``y = residual + acc`` (``residual`` may be ``y`` itself, for
  ``h += attn @ wo.T``)
* ``"silu_mul"``: ``W`` is ``[2N, K]`` = gate rows then up rows (e.g.
  ``concat([gate_proj, up_proj])``), ``y = silu(x @ gate.T) * (x @ up.T)``.

Compile-time: weight dtype, epilogue, K, the M tile ``min(max_m, 64)``, and the
tiling derived from them; N and m are launch arguments. One ``Gemm`` per shape.

Two kernels (``path``):

* ``"stream"`` (``cuda_src/gemm_stream.cu``, planned by ``ops/gemm_stream.py``;
  the default for f16/bf16 weights with ``K % 8 == 0``): tensor cores, M-tile
  variants per M bucket, a register ring of weight loads, wide column groups
  and split K by whole-wave arithmetic over the device's SM count (and, from
  49 rows on sm_90a, ``cuda_src/gemm_wgmma.cu``). The operands are 16-bit, so
  each f32 activation is split into ``hi + lo`` in the weight type
  (``x_split=True``, the default: about 16 significant bits, twice the MMAs)
  or rounded once (``x_split=False``, as cuBLAS does with 16-bit inputs). With ``x_split=False`` and
  ``x16=True`` it reads x already rounded to the weight type (``x`` of
  ``w_dtype``: half the activation bytes, results bit-identical to passing
  the same values as f32; the folded norm's sums of squares are then taken
  from those rounded values). ``y16=True`` (``"none"``/``"silu_mul"``)
  writes y rounded to the weight type (``y`` of ``w_dtype``): what a
  single-rounding GEMM reading it with ``x16=True`` expects.
* ``"fma"`` (``cuda_src/gemm.cu``): f32 activations and FMA; f32 weights,
  K tails, and anyone who wants unrounded activations.

``Gemm.x_round`` says which rounding the kernel applies; ``gemm_reference``
takes it.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .. import checks, device_props, dtypes, kernels
from . import gemm_stream
from .rope import RopeSpec, check_rope_targets

EPILOGUES = gemm_stream.EPILOGUES

MAX_M_LIMIT = 64          # the M tile: acc registers per lane = R * rows * tile; 64 keeps silu_mul spill-free
WARPS = 4                 # warps per block
LANE_K = kernels.constants("gemm.cu")["GEMM_LANE_K"]        # K elements per lane per step
WARP_K = 32 * LANE_K      # K elements per warp per step
SMEM_LIMIT = device_props.DEFAULT_SMEM  # x tiles stay under it: no opt-in attribute needed
PATHS = ("auto", "stream", "fma")
ACC_BUDGET = 64           # accumulators per lane the tiling aims for


def _stream_usable(backend) -> bool:
    """The self-check's verdict on the stream GEMM (``dflash_cupy/selfcheck.py``; True when
    none is known or the check is off)."""
    from .. import selfcheck_verdict
    return selfcheck_verdict.variant_usable(backend, "gemm.stream")


def weight_kind(dtype) -> str:
    """``"f32" | "f16" | "bf16"`` of a weight dtype (``np.uint16`` = bf16 bits)."""
    return dtypes.kind_of(dtype, "w_dtype")


def _taps_group(name: str, v) -> tuple:
    """A DFlash 2 convolution's ``(taps, group_size)`` argument, checked (``name``: the argument)."""
    if not isinstance(v, tuple) or len(v) != 2:
        raise ValueError(f"{name} must be (taps, group_size), got {v!r}")
    return (checks.int_arg(v[0], f"{name} taps", 1), checks.int_arg(v[1], f"{name} group_size", 1))


@dataclass(frozen=True)
class GemmSpec:
    """What one ``Gemm`` computes and with which kernel, decided once (``GemmSpec.make``
    checks the constructor's arguments and resolves ``path="auto"``); every later call
    reads it, nothing recomputes it. ``variant`` is the stream path's ``GemmVariant``
    (its ``-D`` options and tuning key)."""
    N: int
    K: int
    wkind: str                 # "f32" | "f16" | "bf16": the weights' type
    epilogue: str              # EPILOGUES key
    max_m: int                 # rows planned for; any m >= 1 runs (more M tiles)
    path: str                  # "stream" | "fma", resolved
    x_split: bool              # x as hi + lo halves of the weight type (stream path)
    forced_k_split: int | None  # K slices the caller forced (stream path); None: the cost rule's per m
    norm_eps: float | None     # an RMSNorm of x's rows folded in (stream path)
    logits: bool               # argmax / topk: y written too
    wgmma: bool | None         # the wgmma kernel: None auto, True required, False never
    x16: bool                  # x read in the weight type
    y16: bool                  # y written in the weight type
    skip_cols: int             # tile_live 2: column groups below skipped (wgmma)
    live_split: bool           # the wgmma kernel picks its K split per launch
    rope: RopeSpec | None      # the qkv epilogue folded in
    top_k: int = 0             # topk: each column block's K best per row (1..64), else 0
    conv: tuple | None = None  # (taps, group_size): DFlash 2's prepare convolution after it (stream path)
    finish: tuple | None = None  # (taps, group_size): DFlash 2's finish convolution in its epilogue (stream)

    @classmethod
    def make(cls, backend, N: int, K: int, w_dtype, epilogue: str = "none", max_m: int = 64,
             path: str = "auto", x_split: bool = True, k_split: int | None = None,
             norm_eps: float | None = None, logits: bool = True, wgmma: bool | None = None,
             x16: bool = False, y16: bool = False, skip_cols: int = 0, live_split: bool = False,
             rope: RopeSpec | None = None, top_k: int | None = None,
             conv: tuple | None = None, finish: tuple | None = None) -> "GemmSpec":
        """The spec of ``Gemm(backend, ...)``'s arguments; a clear exception naming the bad
        one otherwise. ``backend``: only for ``path="auto"`` (the self-check's verdict)."""
        N, K, max_m = (checks.int_arg(v, name, 1) for v, name in ((N, "N"), (K, "K"), (max_m, "max_m")))
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue {epilogue!r}: expected one of {tuple(EPILOGUES)}")
        wkind = weight_kind(w_dtype)
        if path not in PATHS:
            raise ValueError(f"path {path!r}: expected one of {PATHS}")
        tc_ok = wkind in ("f16", "bf16") and K % 8 == 0
        if path == "stream" and not tc_ok:
            raise ValueError(f"path {path!r} needs f16/bf16 weights and K % 8 == 0 (got {wkind}, K={K})")
        stream_only = epilogue in gemm_stream.SELECTS or norm_eps is not None or x16 or y16 or rope is not None
        if path == "auto" and tc_ok and not stream_only and not _stream_usable(backend):
            tc_ok = False   # the device's self-check failed gemm_stream.cu: gemm.cu instead
        path = "stream" if path == "auto" and tc_ok else ("fma" if path == "auto" else path)
        # "argmax": the lm_head GEMM with the greedy token fused (per column block the best
        # column into ``partials``; ``logits=False``: y is never written)
        # "topk": the same with each column block's ``top_k`` best (order key, id) pairs
        # (``ops/selector.py``'s partials)
        if epilogue in gemm_stream.SELECTS and path != "stream":
            raise ValueError(f"epilogue {epilogue!r} needs the 'stream' path: f16/bf16 weights and K % 8 == 0 "
                             f"(got {wkind}, K={K}, path {path!r})")
        if epilogue == "topk":
            top_k = checks.int_arg(top_k, "top_k", 1)
            if top_k > gemm_stream.TOPK_MAX:
                raise ValueError(f"top_k={top_k} must be <= {gemm_stream.TOPK_MAX}")
            if norm_eps is not None:
                raise ValueError("epilogue 'topk' does not fold an RMSNorm (norm_eps must be None)")
        elif top_k is not None:
            raise ValueError(f"top_k={top_k!r} given but epilogue is {epilogue!r} (only 'topk' takes it)")
        x_split = bool(x_split)
        if norm_eps is not None:
            if path != "stream":
                raise ValueError(f"norm_eps needs path 'stream' (this Gemm runs {path!r})")
            if not isinstance(norm_eps, (int, float, np.floating)) or isinstance(norm_eps, bool) \
                    or not 0 < float(norm_eps) < 1:
                raise ValueError(f"norm_eps must be a float in (0, 1), got {norm_eps!r}")
        if wgmma is not None and not isinstance(wgmma, bool):
            raise TypeError(f"wgmma must be None (auto), True or False, got {wgmma!r}")
        if wgmma and path != "stream":
            raise ValueError(f"wgmma=True needs path 'stream' (this Gemm runs {path!r})")
        skip = checks.int_arg(skip_cols, "skip_cols", 0)
        if skip > N:
            raise ValueError(f"skip_cols={skip_cols} must be in [0, N={N}]")
        if not isinstance(live_split, (bool, np.bool_)):
            raise TypeError(f"live_split must be a bool, got {type(live_split).__name__}")
        x16 = checks.bool_arg(x16, "x16")
        if x16 and (path != "stream" or x_split):
            raise ValueError(f"x16=True (x stored in the weight type) needs path 'stream' and x_split=False "
                             f"(this Gemm runs {path!r} with x_split={x_split})")
        y16 = checks.bool_arg(y16, "y16")
        if y16 and (path != "stream" or epilogue not in ("none", "silu_mul")):
            raise ValueError(f"y16=True (y written in the weight type) needs path 'stream' and epilogue 'none' or "
                             f"'silu_mul' (this Gemm runs {path!r} with {epilogue!r})")
        # rope: the qkv GEMM of a drafter layer may fold QkvNormRope(has_q=True) into its
        # epilogue (the wgmma kernel's GW_EPI 3) where its launch allows (``fuses_rope``)
        if rope is not None and not isinstance(rope, RopeSpec):
            raise TypeError(f"rope must be a RopeSpec or None, got {type(rope).__name__}")
        if rope is not None and (epilogue != "none" or rope.q_width + 2 * rope.kv_width != N):
            raise ValueError(f"rope needs epilogue 'none' and N = q_width + 2 * kv_width "
                             f"({rope.q_width} + 2 * {rope.kv_width}), got {epilogue!r} and N={N}")
        if conv is not None:
            conv = _taps_group("conv", conv)
            if epilogue != "none" or x16 or y16 or rope is not None:
                raise ValueError("conv (the fused prepare convolution) needs epilogue 'none', f32 x and y "
                                 "and no rope")
            if K % conv[1] or N != 2 * conv[0] * (K // conv[1]):
                raise ValueError(f"conv=(taps={conv[0]}, group_size={conv[1]}) needs N = 2 * taps * K / group_size "
                                 f"(N={N}, K={K})")
        if finish is not None:
            finish = _taps_group("finish", finish)
            if path != "stream":
                raise ValueError(f"finish needs path 'stream' (this Gemm runs {path!r})")
            if epilogue != "residual" or norm_eps is not None or y16 or conv is not None or rope is not None:
                raise ValueError("finish (the fused finish convolution) needs epilogue 'residual', an f32 y, "
                                 "no norm_eps, conv or rope")
            if N % finish[1]:
                raise ValueError(f"finish=(taps={finish[0]}, group_size={finish[1]}): group_size must divide N={N}")
        if path == "stream":
            if k_split is not None and (not isinstance(k_split, (int, np.integer)) or isinstance(k_split, bool)
                                        or k_split < 1):
                raise ValueError(f"k_split must be a positive int, got {k_split!r}")
        elif k_split not in (None, 1):
            raise ValueError(f"k_split={k_split}: only the 'stream' path splits K")
        return cls(int(N), int(K), wkind, epilogue, int(max_m), path, x_split,
                   None if k_split is None or path != "stream" else int(k_split),
                   None if norm_eps is None else float(norm_eps),
                   bool(logits) if epilogue in gemm_stream.SELECTS else True,
                   wgmma, x16, y16, skip, bool(live_split), rope, int(top_k) if epilogue == "topk" else 0,
                   conv, finish)

    @functools.cached_property
    def nw(self) -> int:
        """Weight matrices per output column (silu_mul: gate and up)."""
        return 2 if self.epilogue == "silu_mul" else 1

    @functools.cached_property
    def w_rows(self) -> int:
        return self.nw * self.N

    @functools.cached_property
    def w_device_dtype(self) -> np.dtype:
        return dtypes.DEVICE[self.wkind]

    @functools.cached_property
    def x_dtype(self) -> np.dtype:
        """What the kernel reads x as: f32, or (x16) the weight type's device dtype."""
        return self.w_device_dtype if self.x16 else np.dtype(np.float32)

    @functools.cached_property
    def y_dtype(self) -> np.dtype:
        return self.w_device_dtype if self.y16 else np.dtype(np.float32)

    @functools.cached_property
    def split(self) -> int:
        """Halves of x the tensor cores take: 2 (hi + lo) or 1."""
        return 2 if self.x_split else 1

    @functools.cached_property
    def x_round(self) -> str | None:
        """The activations' rounding (``gemm_reference``'s ``x_round``); None: f32 (fma)."""
        return (self.wkind + ("x2" if self.x_split else "")) if self.path == "stream" else None

    @functools.cached_property
    def tile_m(self) -> int:
        """The fma kernel's M tile; larger m is more tiles."""
        return min(self.max_m, MAX_M_LIMIT)

    @functools.cached_property
    def variant(self) -> gemm_stream.GemmVariant | None:
        """The stream path's compile variant (None on the fma path)."""
        if self.path != "stream":
            return None
        return gemm_stream.GemmVariant(
            self.N, self.K, self.wkind, self.epilogue, self.split, norm=self.norm_eps is not None,
            logits=self.logits, x16=self.x16, y16=self.y16, live_split=self.live_split, skip_cols=self.skip_cols,
            rope=None if self.rope is None else (self.rope.head_dim, self.rope.q_width, self.rope.kv_width),
            top_k=self.top_k, conv=self.conv, finish=self.finish)


_SPEC_NAMES = frozenset(f.name for f in dataclasses.fields(GemmSpec)) | frozenset(
    n for n, v in vars(GemmSpec).items() if isinstance(v, functools.cached_property))


class Gemm:
    """``y[:m] = epilogue(x[:m] @ w.T)``: one GEMM shape, compiled once for every m up to ``max_m``.

    Constructor: ``Gemm(backend, N, K, w_dtype, epilogue="none", max_m=64, path="auto",
    x_split=True, k_split=None, norm_eps=None, logits=True, wgmma=None, x16=False, y16=False,
    skip_cols=0, live_split=False, rope=None, top_k=None)``, checked and resolved once into ``self.spec``
    (a frozen ``GemmSpec``, whose fields and properties read as this object's own:
    ``op.path``, ``op.x_round``, ``op.variant``, ...), then the kernels are compiled:

    * ``N, K, w_dtype``: ``w [N, K]`` (``[2N, K]`` for ``"silu_mul"``), f32 / f16 / bf16 bits;
    * ``epilogue``: ``"none" | "residual" | "silu_mul" | "argmax" | "topk"`` (argmax, topk:
      stream path; ``logits`` False stores no logits, only the per-block ``partials``; topk:
      ``top_k`` <= 64 pairs per row and column block, ``gemm_stream.cu`` GS_EPI 4);
    * ``max_m``: rows planned for (any ``m >= 1`` still works: more M tiles);
    * ``path``: ``"auto" | "stream" | "fma"``; ``wgmma``: None (auto), True, False;
    * ``x_split``: x as bf16/f16 hi + lo halves (exact f32 products) or one half;
    * ``k_split``: K slices (stream path; default: the cost rule's per call);
    * ``norm_eps``: fold an RMSNorm of x's rows into the GEMM (``norm=`` at the call);
    * ``x16`` / ``y16``: x read / y written in the weight type (stream path);
    * ``skip_cols``, ``live_split``: lane-batched launches (``tile_live`` entries of 2 skip the
      column groups below ``skip_cols``; the wgmma kernel picks its K split per launch);
    * ``rope``: a ``RopeSpec``: the qkv epilogue (q/k norm, rope, K/V into the caches) folded in.
    * ``conv``: ``(taps, group_size)``: DFlash 2's prepare convolution after the kernel_projection
      GEMM (w's rows in ``ops.conv``'s ``layout="group"``; ``conv=`` at the call, ``fuses_conv``).
    * ``finish``: ``(taps, group_size)``: DFlash 2's finish convolution of the product, added to the
      residual, in the epilogue of a ``"residual"`` GEMM (``finish=`` at the call, ``fuses_finish``).

    ``__call__(x, w, y, m, residual=None, stream=None, pad_rows=None, norm=None, partials=None,
    tile_live=None, rope=None, x2=None, conv=None, finish=None)`` checks its arguments against the spec and launches
    rows ``[0, m)`` on ``stream``; the optional arguments are described on ``__call__``. The
    partial sums of a K split live in a workspace this object owns, so one ``Gemm`` serves one
    stream at a time. No allocation, no host sync: safe inside graph capture.
    """

    def __init__(self, backend, N: int, K: int, w_dtype, epilogue: str = "none", max_m: int = 64,
                 path: str = "auto", x_split: bool = True, k_split: int | None = None,
                 norm_eps: float | None = None, logits: bool = True, wgmma: bool | None = None,
                 x16: bool = False, y16: bool = False, skip_cols: int = 0, live_split: bool = False,
                 rope: RopeSpec | None = None, top_k: int | None = None, conv: tuple | None = None,
                 finish: tuple | None = None):
        self.spec = GemmSpec.make(backend, N, K, w_dtype, epilogue, max_m, path, x_split, k_split, norm_eps,
                                  logits, wgmma, x16, y16, skip_cols, live_split, rope, top_k, conv, finish)
        self.backend = backend
        self.threads = WARPS * 32
        if self.spec.path == "stream":
            self._build_stream()
        else:
            self._build_fma()

    def _build_fma(self):
        s = self.spec
        self.k_split = 1
        # Columns per warp: as many as the accumulator budget allows, so that
        # one staged x tile serves more weight rows.
        self.rows_per_warp = max(1, min(4, ACC_BUDGET // (s.tile_m * s.nw)))
        self.cols_per_block = WARPS * self.rows_per_warp
        # K tile: the largest multiple of WARP_K whose x tile fits the default
        # shared-memory cap, never longer than K needs.
        k_round = -(-s.K // WARP_K) * WARP_K
        kt_fit = max(WARP_K, (SMEM_LIMIT // (4 * s.tile_m)) // WARP_K * WARP_K)
        self.k_tile = min(k_round, kt_fit)
        self.vectorized = s.K % LANE_K == 0
        self._kernel = kernels.load_module(
            self.backend, "gemm.cu", GEMM_WTYPE=dtypes.CODE[s.wkind], GEMM_EPI=EPILOGUES[s.epilogue],
            GEMM_K=s.K, GEMM_MAX_M=s.tile_m, GEMM_R=self.rows_per_warp,
            GEMM_WARPS=WARPS, GEMM_KT=self.k_tile).get_function("gemm")
        self._nblk = -(-s.N // self.cols_per_block)

    def _build_stream(self):
        s = self.spec
        self.vectorized = True
        self.rows_per_warp = 1
        self._stream = gemm_stream.StreamKernels(self.backend, s.variant, s.max_m, k_split=s.forced_k_split,
                                                 wgmma=s.wgmma)
        self.k_split = self._stream.plan(s.max_m).ks   # at m = max_m; each call plans its own m
        self.k_tile = self._stream.plan(s.max_m).kt
        self.cols_per_block = gemm_stream.cols_per_block(s.nw, s.variant.conv is not None)
        self._nblk = -(-s.N // self.cols_per_block)
        self._counters = self._stream._counters

    # ---- launch configurations (autotuning: dflash_cupy/tuning.py)
    def launch_candidates(self, m: int) -> list:
        """``(mt, ks)`` configurations the ``"stream"`` path can run ``m`` rows
        with (``[]`` on the other paths: they have one)."""
        return self._stream.candidates(checks.int_arg(m, "m", 1)) if self.spec.path == "stream" else []

    def default_config(self, m: int):
        """The cost rule's ``(mt, ks)`` for ``m`` rows (``None`` off the stream path)."""
        return self._stream_config(m, default=True)

    def config(self, m: int):
        """The ``(mt, ks)`` a call over ``m`` rows launches now (``None`` off the stream path)."""
        return self._stream_config(m, default=False)

    def _stream_config(self, m: int, default: bool):
        if self.spec.path != "stream":
            return None
        m = checks.int_arg(m, "m", 1)
        p = self._stream.default_plan(m) if default else self._stream.plan(m)
        return (p.mt, p.ks)

    def use_config(self, m: int, config) -> None:
        """Launch ``m`` rows with ``config`` (one of ``launch_candidates(m)``)
        from now on; before the first graph capture only."""
        if self.spec.path != "stream":
            raise ValueError(f"use_config needs the 'stream' path (this Gemm runs {self.spec.path!r})")
        mt, ks = config
        self._stream.use(checks.int_arg(m, "m", 1), mt, ks)
        self._counters = self._stream._counters

    def __repr__(self):
        return (f"Gemm(N={self.spec.N}, K={self.spec.K}, w={self.spec.wkind}, epilogue={self.spec.epilogue!r}, "
                f"max_m={self.spec.max_m}, path={self.spec.path}, R={self.rows_per_warp}, KT={self.k_tile}, "
                f"k_split={self.k_split})")

    def fuses_rope(self, m: int) -> bool:
        """Whether a call over ``m`` rows can take ``rope=`` (the q/k norm + RoPE + K/V scatter
        in the epilogue): a ``rope`` Gemm whose launch for ``m`` (tuned or not) is a wgmma
        variant with every head inside one column group. Otherwise the caller runs the GEMM
        into its qkv matrix and ``QkvNormRope`` after it."""
        m = checks.int_arg(m, "m", 1)
        return self.spec.path == "stream" and self.spec.rope is not None and self._stream.fuses_rope(m)

    def fuses_conv(self, m: int) -> bool:
        """Whether a call over ``m`` rows can take ``conv=`` (the prepare convolution after the
        GEMM): a ``conv`` Gemm on the stream path whose launch for ``m`` (tuned or not) is a
        gemm_stream.cu variant with every group's taps in one column block. Otherwise the caller
        runs ``GroupedConv`` (``layout="group"``) after it."""
        m = checks.int_arg(m, "m", 1)
        return self.spec.path == "stream" and self.spec.conv is not None and self._stream.fuses_conv(m)

    def stores_norm(self, m: int) -> bool:
        """Whether a call over ``m`` rows can take ``norm_out=`` (a ``conv`` Gemm built with
        ``norm_eps`` whose launch for ``m`` is a gemm_stream.cu variant)."""
        m = checks.int_arg(m, "m", 1)
        return (self.spec.path == "stream" and self.spec.conv is not None and self.spec.norm_eps is not None
                and not isinstance(self._stream.plan(m).mt, str))

    def fuses_conv_norm(self, m: int, lane_rows: int) -> bool:
        """Whether a call over ``m`` rows of lanes of ``lane_rows`` can take ``conv=`` with
        ``norm=`` (the prepare convolution of the normed x): ``fuses_conv(m)``, a Gemm built with
        ``norm_eps``, and no lane straddling two row blocks of the launch."""
        if self.spec.norm_eps is None or not self.fuses_conv(m):
            return False
        rows = self._stream.plan(m).rows
        return m <= rows or rows % checks.int_arg(lane_rows, "lane_rows", 1) == 0
    def fuses_finish(self, m: int, lane_rows: int | None = None) -> bool:
        """Whether a call over ``m`` rows in lane blocks of ``lane_rows`` (default ``m``) can take
        ``finish=``: a ``finish`` Gemm whose launch for ``m`` (tuned or not) is a gemm_stream.cu
        variant in which no lane block straddles two row blocks. Otherwise the caller runs the
        GEMM without the residual and ``GroupedConv``'s finish after it."""
        m = checks.int_arg(m, "m", 1)
        lane_rows = m if lane_rows is None else checks.int_arg(lane_rows, "lane_rows", 1)
        return (self.spec.path == "stream" and self.spec.finish is not None
                and self._stream.fin_problem(m, lane_rows) is None)

    def launch_config(self, m: int):
        """``(grid, block, shared_mem)`` of a launch over ``m`` rows."""
        if self.spec.path == "stream":
            return self._stream.launch_config(m)
        mtiles = -(-m // self.spec.tile_m)
        smem = min(m, self.spec.tile_m) * self.k_tile * 4
        return (self._nblk * mtiles, 1, 1), (self.threads, 1, 1), smem

    def bytes_moved(self, m: int) -> int:
        """Compulsory traffic of one call: weights once, x read, y written,
        residual read, the folded norm's scale. (Beyond one M tile each extra
        M tile re-reads the weights from L2, on the "stream" path in the same wave; not counted.)"""
        s = self.spec
        b = s.w_rows * s.K * dtypes.ITEMSIZE[s.wkind] + m * s.K * s.x_dtype.itemsize + m * s.N * s.y_dtype.itemsize
        if s.epilogue == "residual":
            b += m * s.N * 4
        if s.norm_eps is not None:
            b += s.K * 4
        return b

    def _pad(self, pad_rows, m):
        if pad_rows is None:
            return None
        if self.spec.path != "stream":
            raise ValueError(f"pad_rows needs path 'stream' (this Gemm runs {self.spec.path!r})")
        lo, hi = pad_rows
        checks.device_array(self.backend, "pad_rows[0]", lo, np.int32, ndim=1)
        if lo.shape[0] < 1:
            raise ValueError("pad_rows[0] must hold at least one element")
        if not isinstance(hi, (int, np.integer)) or isinstance(hi, bool) or not 0 <= hi <= m:
            raise ValueError(f"pad_rows[1] must be an int in [0, m={m}], got {hi!r}")
        return (lo, int(hi))

    def _tile_live(self, tile_live, m):
        if tile_live is None:
            return None
        checks.device_array(self.backend, "tile_live", tile_live, np.int32, ndim=1)
        if tile_live.shape[0] < -(-m // 16):
            raise ValueError(f"tile_live must hold >= ceil(m/16) = {-(-m // 16)} entries (one per 16 rows), "
                             f"got shape {tuple(tile_live.shape)}")
        return tile_live if self.spec.path == "stream" else None  # the fallbacks compute every row

    def _call_rope(self, x, w, y, m, rope, stream, pad_rows, norm, tile_live, x2=None):
        be = self.backend
        if not self.fuses_rope(m):
            launch = self.config(m) if self.spec.path == "stream" else self.spec.path
            raise ValueError(f"rope given but this Gemm cannot fold it at m={m} (rope={self.spec.rope}, launch "
                             f"{launch!r}): run QkvNormRope after it")
        if not isinstance(rope, tuple) or len(rope) != 7:
            raise ValueError("rope must be (q_norm, k_norm, inv_freq, pos, rows, k_cache, v_cache)")
        q_norm, k_norm, inv_freq, pos, rows, k_cache, v_cache = rope
        check_rope_targets(be, self.spec.rope, m, q_norm, k_norm, inv_freq, pos, rows, y, k_cache, v_cache)
        checks.device_array(be, "x", x, self.spec.x_dtype)
        checks.device_array(be, "w", w, self.spec.w_device_dtype)
        if x.shape[1] != self.spec.K or tuple(w.shape) != (self.spec.w_rows, self.spec.K):
            raise ValueError(f"x must be [>= m, {self.spec.K}] and w [{self.spec.w_rows}, {self.spec.K}], got "
                             f"{tuple(x.shape)} and {tuple(w.shape)}")
        if m < 1:
            raise ValueError(f"m={m} must be >= 1")
        x2 = self._x2_args(x, x2, m, {"q_out": y, "k_cache": k_cache, "v_cache": v_cache})
        for name, a in (("q_out", y), ("k_cache", k_cache), ("v_cache", v_cache)):
            checks.check_no_overlap(**{name: a}, x=x)
        checks.aligned16(x=x, w=w)
        pad_rows = self._pad(pad_rows, m)
        tile_live = self._tile_live(tile_live, m)
        if norm is not None:
            norm = self._norm_args(norm, m)
        s = self.spec.rope
        self._stream(x, w, y, y, m, stream=stream, pad_rows=pad_rows, norm=norm, tile_live=tile_live, x2=x2,
                     rope=(q_norm, k_norm, inv_freq, pos, rows, k_cache, v_cache, k_cache.shape[0], s.eps,
                           s.attn_scale_factor))

    def _norm_args(self, norm, m):
        if self.spec.norm_eps is None:
            raise ValueError("norm given but this Gemm was built without norm_eps")
        if not isinstance(norm, tuple) or len(norm) not in (2, 3):
            raise ValueError("norm must be (ln, norm_lo) or (ln, norm_lo, ln_lo)")
        ln, norm_lo = norm[:2]
        ln_lo = norm[2] if len(norm) == 3 else None
        checks.device_array(self.backend, "norm[0]", ln, np.float32, ndim=1)
        if ln.shape[0] != self.spec.K:
            raise ValueError(f"norm[0] must have shape ({self.spec.K},), got {tuple(ln.shape)}")
        if not isinstance(norm_lo, (int, np.integer)) or isinstance(norm_lo, bool) or not 0 <= norm_lo <= m:
            raise ValueError(f"norm[1] must be an int in [0, m={m}], got {norm_lo!r}")
        checks.aligned16(norm=ln)
        if ln_lo is not None:
            checks.device_array(self.backend, "norm[2] (ln_lo)", ln_lo, np.float32, ndim=1)
            if ln_lo.shape[0] != self.spec.K:
                raise ValueError(f"norm[2] (ln_lo) must have shape ({self.spec.K},), got {tuple(ln_lo.shape)}")
            checks.aligned16(ln_lo=ln_lo)
        return (ln, self.spec.norm_eps, int(norm_lo), ln_lo)

    def _x2_args(self, x, x2, m, y_like):
        """Validated ``x2=(a, row_split)``: x must hold rows ``[0, row_split)``, ``a`` rows
        ``[0, m - row_split)``; neither may overlap what the call writes (``y_like``)."""
        if x2 is None:
            if not 1 <= m <= x.shape[0]:
                raise ValueError(f"m={m} must be in [1, x rows={x.shape[0]}]")
            return None
        if self.spec.path != "stream":
            raise ValueError(f"x2 needs path 'stream' (this Gemm runs {self.spec.path!r})")
        if not isinstance(x2, tuple) or len(x2) != 2:
            raise ValueError("x2 must be (array, row_split)")
        a, row_split = x2
        checks.device_array(self.backend, "x2[0]", a, self.spec.x_dtype)
        if a.shape[1] != self.spec.K:
            raise ValueError(f"x2[0] must have K={self.spec.K} columns, got shape {tuple(a.shape)}")
        if not isinstance(row_split, (int, np.integer)) or isinstance(row_split, bool) or not 0 <= row_split <= m:
            raise ValueError(f"x2[1] (row_split) must be an int in [0, m={m}], got {row_split!r}")
        if x.shape[0] < row_split:
            raise ValueError(f"x must hold row_split={row_split} rows, got shape {tuple(x.shape)}")
        if a.shape[0] < m - row_split:
            raise ValueError(f"x2[0] must hold m - row_split = {m - row_split} rows, got shape {tuple(a.shape)}")
        for name, o in y_like.items():
            if checks.overlaps(a, o):
                raise ValueError(f"x2[0] and {name} share memory")
        checks.aligned16(x2=a)
        return (a, int(row_split))

    def partials_shape(self, m: int) -> tuple:
        """Shape of the u32 ``partials`` the "argmax" (``[m, blocks, 2]``) or "topk"
        (``[m, blocks, top_k, 2]``) epilogue writes for ``m`` rows."""
        return (int(m), self._nblk, self.spec.top_k, 2) if self.spec.top_k else (int(m), self._nblk, 2)

    def __call__(self, x, w, y, m, residual=None, stream=None, pad_rows=None, norm=None,
                 partials=None, tile_live=None, rope=None, x2=None, conv=None, norm_out=None, finish=None):
        """``pad_rows=(lo, hi)`` (``"stream"`` path): rows ``[lo[0], hi)`` of x
        are padding and count as zeros (not read; 16-row tiles of padding only
        are not computed); ``lo`` is a device int32 array read when the kernel
        runs, so a captured graph follows it; ``hi`` a host int <= m.
        ``norm=(ln, norm_lo)`` (a ``Gemm`` built with ``norm_eps``): rows
        ``[norm_lo, m)`` of x enter as ``rmsnorm(x_row) * ln`` (``ln`` [K] f32),
        folded into the GEMM: no separate pass, x unchanged.
        ``partials`` (epilogue "argmax" / "topk" only, u32 ``partials_shape(m)``): each
        row's best column (its ``top_k`` best (order key, id) pairs, best first, empty
        slots (0, 0xffffffff) past the block's columns) per column block; ``y`` is None
        unless ``logits``.
        ``tile_live`` (device int32 ``[>= ceil(m/16)]``, read when the kernel
        runs, so a captured graph follows it): entry ``t`` covers rows
        ``[16t, 16t + 16)``; on the ``"stream"`` path a tile whose entry is 0
        is skipped (no x read, no MMA) and its rows of ``y`` (and of the argmax
        ``partials``) are not written at all. The ``"fma"`` path
        ignores it and computes every row (the dead rows' outputs are never
        consumed by contract). ``None``: every tile is live. An entry of 2 is a
        live tile whose rows need only the columns ``>= skip_cols`` (this
        Gemm's): the wgmma kernel leaves the column groups wholly below
        unwritten for them (a lane-batched qkv's context rows, which feed K and
        V only); the others compute them. With ``live_split`` the wgmma kernel
        chooses its K split per launch from the live tiles (``gemm_stream.
        wg_live_split``), so a step with few live rows still fills the SMs.
        ``rope=(q_norm, k_norm, inv_freq, pos, rows, k_cache, v_cache)`` (a Gemm built with
        ``rope`` where ``fuses_rope(m)``): what ``QkvNormRope(has_q=True)`` would do to the
        result, done in the epilogue: ``y`` is its ``q_out [>= m, q_width] f32``, K and V go
        to the caches' ``rows``, the ``[m, N]`` matrix is never stored; tile_live as that op
        reads it (rows of tiles marked 2 write no Q).
        ``norm=(ln, norm_lo, ln_lo)``: rows ``< norm_lo`` enter as ``rmsnorm(x_row) * ln_lo``
        too (instead of raw).
        ``x2=(a, row_split)`` (``"stream"`` path): rows ``>= row_split`` are read from ``a``
        (row ``r`` from ``a[r - row_split]``), rows below from x: two producers' rows in one
        GEMM without a concatenated copy. Bit-identical to one x holding both.
        ``conv=(base, out, lane_rows)`` (a Gemm built with ``conv`` where ``fuses_conv(m)``):
        also ``out[:m] = GroupedConv(layout="group")(x, base, y, half=0, lane_rows=lane_rows)``
        bit for bit (``base`` f32 ``[taps, K]``, ``out`` f32 ``[>= m, K]``; rows of dead tiles
        untouched), without its launch. With ``norm=(ln, norm_lo)`` (no ``ln_lo``) the convolution
        reads rows ``>= norm_lo`` normed: ``(x[r, c] * ln[c]) * s[r]``, each product rounded to
        f32, ``s[r]`` the row scale the GEMM multiplies its sums by (lanes must not straddle the
        launch's row blocks). ``norm_out`` (f32 ``[>= m, K]``, with ``norm`` and no ``conv``,
        ``stores_norm(m)``): those normed rows (rows ``< norm_lo``: x) stored there, bit for bit
        what the fused convolution reads, so that ``GroupedConv`` of them gives its output where
        the launch cannot fuse it (``fuses_conv_norm``).
        ``finish=(base, d, lane_rows)`` (a Gemm built with ``finish`` where ``fuses_finish(m,
        lane_rows)``): ``y[:m] = GroupedConv(layout="group")(p, base, d, half=1, residual=residual,
        lane_rows=lane_rows)`` bit for bit, ``p`` the product this call would add to ``residual``
        (``base`` f32 ``[taps, N]``: half 1 of base_kernel; ``d`` f32 ``[>= m, 2 * taps * N / group]``,
        the kernel_projection's output; ``residual`` may be ``y``). ``p`` is never stored; a tap
        into a dead tile (``tile_live``) reads 0 there; rows of dead tiles are untouched."""
        m = checks.int_arg(m, "m")
        if rope is not None:
            self._call_rope(x, w, y, m, rope, stream, pad_rows, norm, tile_live, x2)
            return
        if finish is not None:
            given = [n for n, v in (("norm", norm), ("conv", conv), ("norm_out", norm_out), ("partials", partials))
                     if v is not None]
            if given:
                raise ValueError(f"finish does not combine with {', '.join(given)} (a GS_FIN launch applies none)")
        y, r, x2 = self._check_io(x, w, y, m, residual, partials, x2)
        pad_rows = self._pad(pad_rows, m)
        tile_live = self._tile_live(tile_live, m)
        if norm is not None:
            norm = self._norm_args(norm, m)
        if norm_out is not None:
            conv = self._norm_out_args(norm_out, conv, norm, x, w, y, m, pad_rows, x2)
        elif conv is not None:
            conv = self._conv_args(conv, x, w, y, m, pad_rows, x2, norm)
        if conv is not None:
            self._stream(x, w, y, r, m, stream=stream, tile_live=tile_live, conv=conv, norm=norm)
            return
        if finish is not None:
            finish = self._finish_args(finish, x, w, y, m)
            self._stream(x, w, y, r, m, stream=stream, pad_rows=pad_rows, tile_live=tile_live, x2=x2,
                         finish=finish)
            return
        self._run(x, w, y, r, m, stream, pad_rows, norm, partials, tile_live, x2)

    def _norm_out_args(self, out, conv, norm, x, w, y, m, pad_rows, x2):
        """Validated ``norm_out``: the launch's conv arguments (lane_rows -1: store x')."""
        if conv is not None or norm is None:
            raise ValueError("norm_out takes norm= and no conv=")
        if not self.stores_norm(m):
            raise ValueError(f"norm_out needs a Gemm built with conv and norm_eps on a gemm_stream.cu launch "
                             f"(m={m}: {self.config(m) if self.spec.path == 'stream' else self.spec.path!r})")
        if norm[3] is not None:
            raise ValueError("norm_out takes no ln_lo (norm=(ln, norm_lo))")
        if pad_rows is not None or x2 is not None:
            raise ValueError("norm_out does not combine with pad_rows or x2")
        checks.device_array(self.backend, "norm_out", out, np.float32, ndim=2)
        if out.shape[1] != self.spec.K or out.shape[0] < m:
            raise ValueError(f"norm_out must have shape [>= {m}, {self.spec.K}], got {tuple(out.shape)}")
        for name, a in (("x", x), ("w", w), ("y", y)):
            if checks.overlaps(out, a):
                raise ValueError(f"norm_out must not overlap {name}")
        if self.spec.K % 4 == 0 and self.spec.conv[1] % 4 == 0:
            checks.aligned16(norm_out=out)
        return (w, out, -1)   # base: w, read (>= taps * K floats: N * K * 2 bytes), unused

    def _conv_args(self, conv, x, w, y, m, pad_rows, x2, norm=None):
        """Validated ``conv=(base, out, lane_rows)`` (``norm``: the checked norm arguments)."""
        be, s = self.backend, self.spec
        if not self.fuses_conv(m):
            launch = self.config(m) if s.path == "stream" else s.path
            raise ValueError(f"conv given but this Gemm cannot fuse it at m={m} (conv={s.conv}, launch "
                             f"{launch!r}): run GroupedConv after it")
        if pad_rows is not None or x2 is not None:
            raise ValueError("conv does not combine with pad_rows or x2 (the convolution reads x's rows)")
        if not isinstance(conv, tuple) or len(conv) != 3:
            raise ValueError("conv must be (base, out, lane_rows)")
        base, out, lane_rows = conv
        taps = s.conv[0]
        checks.device_array(be, "conv base", base, np.float32, ndim=2)
        if tuple(base.shape) != (taps, s.K):
            raise ValueError(f"conv base must have shape {(taps, s.K)}, got {tuple(base.shape)}")
        checks.device_array(be, "conv out", out, np.float32, ndim=2)
        if out.shape[1] != s.K or out.shape[0] < m:
            raise ValueError(f"conv out must have shape [>= {m}, {s.K}], got {tuple(out.shape)}")
        lane_rows = checks.int_arg(lane_rows, "conv lane_rows", 1)
        if m % lane_rows:
            raise ValueError(f"conv lane_rows={lane_rows} must divide m={m}")
        if norm is not None:
            if norm[3] is not None:
                raise ValueError("conv with norm takes no ln_lo (norm=(ln, norm_lo)): rows below norm_lo "
                                 "are convolved raw")
            rows = self._stream.plan(m).rows
            if not self.fuses_conv_norm(m, lane_rows):
                raise ValueError(f"conv with norm: lane_rows={lane_rows} must divide the launch's {rows}-row "
                                 f"blocks (m={m}): a lane's taps would need another block's row scales")
        for name, a in (("x", x), ("w", w), ("y", y), ("conv base", base)):
            if checks.overlaps(out, a):
                raise ValueError(f"conv out must not overlap {name}")
        if s.K % 4 == 0 and s.conv[1] % 4 == 0:   # 16-byte channel chunks
            checks.aligned16(conv_base=base, conv_out=out)
        return (base, out, lane_rows)

    def _finish_args(self, finish, x, w, y, m):
        """Validated ``finish=(base, d, lane_rows)`` (y and the residual already checked)."""
        be, s = self.backend, self.spec
        if s.finish is None:
            raise ValueError("finish given but this Gemm was built without finish=(taps, group_size)")
        if not isinstance(finish, tuple) or len(finish) != 3:
            raise ValueError("finish must be (base, d, lane_rows)")
        base, d, lane_rows = finish
        taps, group = s.finish
        lane_rows = checks.int_arg(lane_rows, "finish lane_rows", 1)
        if m % lane_rows:
            raise ValueError(f"finish lane_rows={lane_rows} must divide m={m}")
        if not self.fuses_finish(m, lane_rows):
            raise ValueError(f"finish given but this Gemm cannot fuse it at m={m}, lane_rows={lane_rows}: "
                             f"{self._stream.fin_problem(m, lane_rows)}; run GroupedConv after it")
        checks.device_array(be, "finish base", base, np.float32, ndim=2)
        if tuple(base.shape) != (taps, s.N):
            raise ValueError(f"finish base must have shape {(taps, s.N)}, got {tuple(base.shape)}")
        dw = 2 * taps * (s.N // group)
        checks.device_array(be, "finish d", d, np.float32, ndim=2)
        if d.shape[1] != dw or d.shape[0] < m:
            raise ValueError(f"finish d must have shape [>= {m}, {dw}], got {tuple(d.shape)}")
        for name, a in (("finish base", base), ("finish d", d)):
            if checks.overlaps(a, y):
                raise ValueError(f"y must not overlap {name}")
        checks.aligned16(finish_d=d)   # a row's coefficients: one 8- or 16-byte load (2, 4 taps)
        if group % 4 == 0:   # 16-byte channel chunks
            checks.aligned16(finish_base=base)
        return (base, d, lane_rows)

    def _run(self, x, w, y, r, m, stream, pad_rows=None, norm=None, partials=None, tile_live=None, x2=None):
        """The launch of checked arguments (``r``: the residual, or any valid pointer)."""
        if self.spec.path == "stream":
            self._stream(x, w, y, r, m, stream=stream, pad_rows=pad_rows, norm=norm, partials=partials,
                         tile_live=tile_live, x2=x2)
            return
        grid, block, smem = self.launch_config(m)
        self._kernel(grid, block, (x, w, y, r, np.int32(m), np.int32(self.spec.N)), shared_mem=smem, stream=stream)

    def _check_io(self, x, w, y, m, residual, partials, x2):
        """``(y, r, x2)`` of a call's checked arrays: y (the argmax partials where no logits
        are written), the residual (or y: any valid pointer), x2 checked."""
        be = self.backend
        sel = self.spec.epilogue in gemm_stream.SELECTS
        if x2 is not None and (sel or self.spec.path != "stream"):
            raise ValueError(f"x2 needs path 'stream' and an epilogue other than argmax (this Gemm: "
                             f"{self.spec.path!r}, {self.spec.epilogue!r})")
        if sel:
            if partials is None:
                raise ValueError(f"partials is required for epilogue {self.spec.epilogue!r}")
            want = self.partials_shape(m)
            checks.device_array(be, "partials", partials, np.uint32, ndim=len(want))
            if partials.shape[0] < m or tuple(partials.shape[1:]) != want[1:]:
                raise ValueError(f"partials must have shape [>= {m}, {', '.join(map(str, want[1:]))}], got "
                                 f"{tuple(partials.shape)}")
            if not self.spec.logits:
                if y is not None:
                    raise ValueError(f"y must be None: this {self.spec.epilogue} Gemm writes no logits "
                                     f"(logits=False)")
        elif partials is not None:
            raise ValueError(f"partials given but epilogue is {self.spec.epilogue!r}")
        if y is None and sel and not self.spec.logits:
            checks.device_array(be, "x", x, self.spec.x_dtype)
            checks.device_array(be, "w", w, self.spec.w_device_dtype)
            if x.shape[1] != self.spec.K or tuple(w.shape) != (self.spec.w_rows, self.spec.K):
                raise ValueError(f"x must be [>= m, {self.spec.K}] and w [{self.spec.w_rows}, {self.spec.K}], got "
                                 f"{tuple(x.shape)} and {tuple(w.shape)}")
            if not 1 <= m <= x.shape[0]:
                raise ValueError(f"m={m} must be in [1, x rows={x.shape[0]}]")
            checks.aligned16(x=x, w=w)
            return partials, partials, None   # y is never written without logits: any valid pointer
        checks.device_array(be, "x", x, self.spec.x_dtype)
        checks.device_array(be, "w", w, self.spec.w_device_dtype)
        checks.device_array(be, "y", y, self.spec.y_dtype)
        if x.shape[1] != self.spec.K:
            raise ValueError(f"x must have K={self.spec.K} columns, got shape {tuple(x.shape)}")
        if tuple(w.shape) != (self.spec.w_rows, self.spec.K):
            raise ValueError(f"w must have shape {(self.spec.w_rows, self.spec.K)} for epilogue "
                             f"{self.spec.epilogue!r}, got {tuple(w.shape)}")
        if y.shape[1] != self.spec.N:
            raise ValueError(f"y must have N={self.spec.N} columns, got shape {tuple(y.shape)}")
        if x2 is None and (m < 1 or m > x.shape[0] or m > y.shape[0]):
            raise ValueError(f"m={m} must be in [1, min(x rows={x.shape[0]}, y rows={y.shape[0]})]")
        if m < 1 or m > y.shape[0]:
            raise ValueError(f"m={m} must be in [1, y rows={y.shape[0]}]")
        x2 = self._x2_args(x, x2, m, {"y": y})
        checks.check_no_overlap(y=y, x=x)
        checks.check_no_overlap(y=y, w=w)
        if self.spec.epilogue == "residual":
            if residual is None:
                raise ValueError("residual is required for epilogue 'residual'")
            checks.device_array(be, "residual", residual, np.float32)
            if residual.shape[1] != self.spec.N or residual.shape[0] < m:
                raise ValueError(f"residual must have shape [>= m={m}, N={self.spec.N}], "
                                 f"got {tuple(residual.shape)}")
            # Exact aliasing (same element read then written by one thread) is fine;
            # a shifted overlap would read elements other blocks already wrote.
            if checks.overlaps(residual, y) and checks.ptr(residual) != checks.ptr(y):
                raise ValueError("residual must be y itself or not overlap it")
            r = residual
        else:
            if residual is not None:
                raise ValueError(f"residual given but epilogue is {self.spec.epilogue!r}")
            r = y  # unused by the kernel; any valid pointer
        if self.vectorized:
            checks.aligned16(x=x, w=w, y=y, residual=r)
        return y, r, x2


for _name in sorted(_SPEC_NAMES):   # the spec's fields and properties read as the Gemm's own
    setattr(Gemm, _name, property(lambda self, _n=_name: getattr(self.spec, _n),
                                  doc=f"``self.spec.{_name}`` (``GemmSpec``)"))


def gemm_reference(x, w, epilogue: str = "none", residual=None, x_round: str | None = None,
                   norm=None) -> np.ndarray:
    """NumPy oracle for ``Gemm``: the weights are widened exactly from their
    stored dtype (uint16 = bf16 bits), the activations rounded (nearest even)
    as ``x_round`` says (``Gemm.x_round``: ``"f16"``/``"bf16"`` once,
    ``"f16x2"``/``"bf16x2"`` as hi + lo) or kept f32, everything computed in float64 and the result
    rounded once to float32. The kernel accumulates in f32 in a different
    order; ``tolerances.TOL["f32"]`` absorbs that. ``norm=(ln, eps, norm_lo[, ln_lo])``:
    rows ``>= norm_lo`` are ``rmsnorm(x_row) * ln`` in the folded kernel's
    order: ``x * ln`` (f32 product) is what gets rounded, and the row's
    ``1 / sqrt(mean(x^2) + eps)`` (float64) multiplies the accumulated sum
    before the epilogue (normalising first and then rounding differs by one
    rounding of the activations, ~2^-17 relative with hi + lo)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r}: expected one of {tuple(EPILOGUES)}")
    x = np.asarray(x, dtype=np.float32)
    scale = None
    if norm is not None:
        ln, eps, norm_lo = norm[:3]
        ln_lo = norm[3] if len(norm) > 3 else None
        x = x.copy()
        scale = np.ones((x.shape[0], 1))
        for a, b, g in ((norm_lo, x.shape[0], ln), (0, norm_lo if ln_lo is not None else 0, ln_lo)):
            if a < b:
                rows = x[a:b].astype(np.float64)
                scale[a:b, 0] = 1.0 / np.sqrt(np.mean(rows * rows, axis=1) + eps)
                x[a:b] = x[a:b] * np.asarray(g, np.float32)[None, :]
    if x_round is not None:
        kinds = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}
        if x_round.rstrip("x2") not in kinds or x_round not in ("bf16", "f16", "bf16x2", "f16x2"):
            raise ValueError(f"x_round {x_round!r}: expected None, 'f16', 'bf16', 'f16x2' or 'bf16x2'")
        dt = kinds[x_round.rstrip("x2")]
        with np.errstate(over="ignore"):
            hi = x.astype(dt)
            xe = hi.astype(np.float64)
            if x_round.endswith("x2"):  # lo = rnd(x - hi), the difference taken in f32 (exact)
                xe = xe + (x - hi.astype(np.float32)).astype(dt).astype(np.float64)
        x = xe
    x = x.astype(np.float64)
    w = dtypes.to_float(w, np.float64)
    acc = x @ w.T
    if scale is not None:
        acc = acc * scale
    if epilogue == "none":
        out = acc
    elif epilogue == "residual":
        if residual is None:
            raise ValueError("residual is required for epilogue 'residual'")
        out = np.asarray(residual, dtype=np.float32).astype(np.float64) + acc
    else:
        n = w.shape[0] // 2
        if w.shape[0] != 2 * n:
            raise ValueError(f"w must have an even number of rows for silu_mul, got {w.shape[0]}")
        g, u = acc[:, :n], acc[:, n:]
        with np.errstate(over="ignore"):
            out = g / (1.0 + np.exp(-g)) * u
    return out.astype(np.float32)
