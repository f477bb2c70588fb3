"""``StepRecipe``: the step's fusion decisions, made once when a cache or batch is built and
read by its allocation, its kernel builds and every step (frozen: never re-derived)."""
from __future__ import annotations

from dataclasses import dataclass

from .ops.gemm import weight_kind


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
    cost a build where they would never run).
    ``conv``: DFlash 2's convolutions wrap each sublayer (SPEC §6): the input norms run as
    launches of their own (a convolution sits between each norm and its GEMM, so nothing
    folds) and the ``finish`` convolution adds the o / down GEMMs' outputs to the residual
    stream, in their epilogue where the launch fuses it (``Gemm(finish=...)``), else after
    them from their plain outputs (``GroupedConv.finish_norm``).
    ``gate_up_async``: with ``conv``, the gate_up GEMM reads the prepare convolution's f32
    rows through the folded-norm variant with ``norm_lo`` = every row (GS_NORM's contract: rows
    below norm_lo enter raw, unscaled, ln never read), i.e. staged by cp.async instead of
    through registers, on the stream path with a 16-bit weight and H % 8 == 0 (where the
    fold would apply). Why: the register-staged x chunk is a dependent chain that grows with
    the K slice, so its launch rule prices a partial second round of blocks whole and splits
    K to flatten it (h5120: 9 slices); cp.async puts a chunk's copies in flight at once, so
    its rule prices bytes in flight and keeps fewer (docs/decisions/dflash2.md, gemm.md)."""
    fold_norms: bool
    fold_hidden: bool
    attn16: str | None
    act16: str | None
    gate_up_x16: str | None
    qkv_rope: bool
    conv: bool = False
    gate_up_async: bool = False

    @classmethod
    def derive(cls, config, dw, checked, x_split: bool, n_ctx: int, n_noise: int) -> "StepRecipe":
        """The recipe for these weights (``dw``: on the device), self-check verdict, rounding
        and step rows (``n_ctx`` context rows, then ``n_noise`` noise rows)."""
        from .ops.gemm_stream import WG_MIN_M
        c, L0, H = config, dw.layers[0], config.hidden_size
        kind = {k: weight_kind(getattr(L0, k).dtype) for k in ("w_qkv", "w_o", "w_gate_up", "w_down")}
        sixteen = ("f16", "bf16")
        conv = c.dflash2 is not None
        fold = (checked.stream and H % 8 == 0 and kind["w_qkv"] in sixteen and kind["w_gate_up"] in sixteen
                and not conv)
        attn = act = x16 = None
        if not x_split and checked.stream:
            o, gu, dn = kind["w_o"], kind["w_gate_up"], kind["w_down"]
            attn = o if o in sixteen and c.q_dim % 8 == 0 else None
            act = dn if dn in sixteen and gu == dn and c.intermediate_size % 8 == 0 and H % 8 == 0 else None
            if n_noise >= GATE_UP_X16_MIN_ROWS and gu in sixteen and H % 8 == 0 and not conv:
                x16 = gu
        gu_async = conv and checked.stream and H % 8 == 0 and kind["w_gate_up"] in sixteen
        return cls(fold_norms=bool(fold), fold_hidden=bool(fold and not c.context_kv_layer_norm and x_split),
                   attn16=attn, act16=act, gate_up_x16=x16, qkv_rope=n_ctx + n_noise >= WG_MIN_M, conv=conv,
                   gate_up_async=bool(gu_async))
