"""The drafter's configuration (SPEC §2, §5), read from a Hugging Face DFlash ``config.json``.

``DraftConfig`` holds every number the drafter step needs and validates them
once, so nothing downstream (weights, kernels, oracle) re-checks shapes
against the config.

Field map from a z-lab DFlash ``config.json`` (``DraftConfig.from_hf``):

==========================  ============================================================
DraftConfig                 config.json
==========================  ============================================================
n_layer                     ``num_hidden_layers``
hidden_size                 ``hidden_size``
n_head                      ``num_attention_heads``
n_head_kv                   ``num_key_value_heads`` (default: ``num_attention_heads``)
head_dim                    ``head_dim`` (default: ``hidden_size // num_attention_heads``)
intermediate_size           ``intermediate_size``
block_size                  ``block_size``, else ``dflash_config.block_size``
target_layer_ids            ``dflash_config.target_layer_ids`` (else top level)
num_target_layers           ``num_target_layers`` (else ``dflash_config.num_target_layers``)
rms_norm_eps                ``rms_norm_eps`` (default 1e-6)
rope_theta                  ``rope_theta``, else ``rope_parameters.rope_theta`` (int or float)
rope_scaling                ``rope_scaling`` (or a non-default ``rope_parameters``)
layer_sliding               ``layer_types`` ("sliding_attention" / "full_attention")
sliding_window              ``sliding_window`` (None or 0: no limit)
max_position_embeddings     ``max_position_embeddings`` (only YaRN reads it)
mask_token_id               ``dflash_config.mask_token_id`` (else top level)
aux_hidden_norms            ``aux_hidden_norms`` (bool; top level or in ``dflash_config``)
context_kv_layer_norm       ``context_kv_layer_norm`` (bool; top level or in ``dflash_config``)
attn_gate                   ``attn_gate``: "none" | "head" | "element" (top level or in
                            ``dflash_config``)
is_causal                   ``is_causal`` (bool; top level or in ``dflash_config``; absent:
                            None, sliding layers causal inside the block, full layers not)
window_rule                 ``dflash_config.window_rule``: "per_row" (default) | "anchored"
                            (this module's own key, written only when not the default)
==========================  ============================================================

Sliding layers: when ``layer_types`` is present it decides which layers slide
and ``sliding_window`` is taken as written (``use_sliding_window`` is then
ignored: the per-layer list is the explicit statement, and newer z-lab
configs give ``layer_types`` + ``sliding_window`` without that legacy flag).
When ``layer_types`` is absent, Hugging Face's Qwen3 rule applies: layers
``i >= max_window_layers`` (default 28) slide iff ``use_sliding_window`` is
true and ``sliding_window`` is set; otherwise every layer is full.

The three optional variants and their tensors (see ``weights.py``):

* ``aux_hidden_norms``: each captured layer's slice of a feature row is
  rms-normalised with its own weight ``aux_hidden_norms.{j}.weight`` [H]
  before ``fc``;
* ``context_kv_layer_norm``: the fused context rows go through the layer's
  ``input_layernorm`` before ``k_proj`` / ``v_proj`` (no extra tensors);
* ``attn_gate``: ``attn *= softplus(hn @ layers.{i}.self_attn.gate_proj.weight.T)``,
  weight ``[n_head, H]`` ("head") or ``[n_head*head_dim, H]`` ("element").

When saved (``to_hf``) non-default variant flags are written inside
``dflash_config``.

Masks (``mask_rule``, see ``mask_rule.py``): sliding layers use the serving engines'
per-row window by default (``window_rule="per_row"``); ``"anchored"`` is the seed's rule
(SPEC §3.5), e.g. ``dataclasses.replace(config, window_rule="anchored")``.

Architectures (``architectures``, a one-entry list; absent: DFlash): ``DFlashDraftModel``
gives ``dflash2=None``; ``DFlash2DraftModel`` gives a ``DFlash2Config`` (SPEC §6) read
from ``dflash_config`` (z-lab reads each field there first, then at the top level; both
present and different is an error) plus the top-level ``vocab_size``:

==========================  ============================================================
DFlash2Config               config.json
==========================  ============================================================
conv_kernel_size            ``conv_kernel_size`` (taps of each convolution, required)
conv_group_size             ``conv_group_size`` (channels sharing one dynamic tap, required)
selector_rank               ``selector_rank`` (required)
selector_top_k              ``selector_top_k`` (K candidates per row, required)
vocab_size                  ``vocab_size`` (top level; rows of the selector's codebooks)
final_logit_softcapping     ``final_logit_softcapping`` (None or 0: no softcap)
output_multiplier           ``output_multiplier`` (default 1.0)
input_embedding_scale       ``input_embedding_scale`` (default 1.0)
==========================  ============================================================

Nothing a drafter computes with is dropped silently: any other architecture is refused,
and so is any ``dflash_config`` key outside the ones above, the DFlash keys and
``_IGNORED_DFLASH_CONFIG_KEYS``, and any DFlash 2 field in a config that does not
declare ``DFlash2DraftModel``. Other top-level keys (``bos_token_id``, ``dtype``, ...)
are kept in ``extra`` and written back.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from .mask_rule import WINDOW_RULES, MaskRule

ATTN_GATES = ("none", "head", "element")
ROPE_SCALING_TYPES = ("linear", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
VARIANT_KEYS = ("aux_hidden_norms", "context_kv_layer_norm", "attn_gate")
ARCH_DFLASH, ARCH_DFLASH2 = "DFlashDraftModel", "DFlash2DraftModel"
ARCHITECTURES = (ARCH_DFLASH, ARCH_DFLASH2)
# DFlash 2 fields (SPEC §6): dflash_config first, else the top level (as z-lab reads them)
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                "final_logit_softcapping", "output_multiplier", "input_embedding_scale")
_DFLASH2_REQUIRED = DFLASH2_KEYS[:4]
# dflash_config keys every kind understands
_DFLASH_CONFIG_KEYS = ("target_layer_ids", "mask_token_id", "block_size", "num_target_layers",
                       "is_causal", "window_rule", *VARIANT_KEYS)
# dflash_config keys that change nothing this module computes and are kept in `extra`
# (none known yet: a key lands here only once its meaning is checked)
_IGNORED_DFLASH_CONFIG_KEYS: tuple = ()

# HF Qwen3Config's default for max_window_layers, used only when layer_types is absent.
_HF_DEFAULT_MAX_WINDOW_LAYERS = 28

# DraftConfig field -> the config.json key it comes from (and, for the plain
# ones, goes back to in to_hf): the one key map; error messages name it too.
HF_KEY = {
    "n_layer": "num_hidden_layers", "hidden_size": "hidden_size",
    "n_head": "num_attention_heads", "n_head_kv": "num_key_value_heads",
    "head_dim": "head_dim", "intermediate_size": "intermediate_size",
    "block_size": "block_size", "target_layer_ids": "dflash_config.target_layer_ids",
    "num_target_layers": "num_target_layers", "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta", "rope_scaling": "rope_scaling", "layer_sliding": "layer_types",
    "sliding_window": "sliding_window", "max_position_embeddings": "max_position_embeddings",
    "mask_token_id": "dflash_config.mask_token_id",
}
# fields to_hf writes unchanged under their HF_KEY
_PLAIN_FIELDS = ("hidden_size", "n_layer", "n_head", "n_head_kv", "head_dim", "intermediate_size",
                 "rms_norm_eps", "sliding_window", "block_size", "num_target_layers")

# Keys from_hf consumes; everything else in a config.json is kept in `extra`
# so a loaded-then-saved config loses nothing.
_CONSUMED_KEYS = {k.split(".")[-1] for k in HF_KEY.values()} | {
    "rope_parameters", "use_sliding_window", "max_window_layers", "dflash_config",
    "hidden_act", "attention_bias", "partial_rotary_factor", "is_causal", *VARIANT_KEYS, "architectures",
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class DFlash2Config:
    """The DFlash 2 additions (SPEC §6), validated once; ``DraftConfig.dflash2``.

    ``conv_kernel_size`` taps per convolution, ``conv_group_size`` channels per
    dynamic-tap group (``hidden_size`` must be a multiple: checked by
    ``DraftConfig``), ``selector_rank`` and ``selector_top_k`` (K <= ``vocab_size``)
    size the candidate selector; ``final_logit_softcapping`` None means no softcap
    (0 in a config.json is read as None); ``output_multiplier`` > 0 (so the top-K of
    the raw logits is the top-K of the scaled ones); ``input_embedding_scale``
    multiplies the noise rows' embeddings.
    """
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    vocab_size: int
    final_logit_softcapping: float | None = None
    output_multiplier: float = 1.0
    input_embedding_scale: float = 1.0

    def __post_init__(self):
        def bad(name, value, why):
            raise ValueError(f"DFlash2Config.{name}={value!r}: {why}")

        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                     "vocab_size"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                bad(name, v, "must be a positive int")
        if self.selector_top_k > self.vocab_size:
            bad("selector_top_k", self.selector_top_k,
                f"must be <= vocab_size={self.vocab_size} (K candidates per row)")
        cap = self.final_logit_softcapping
        if cap is not None:
            if not _is_real(cap) or not math.isfinite(cap) or cap < 0:
                bad("final_logit_softcapping", cap, "must be a finite number >= 0, or None")
            object.__setattr__(self, "final_logit_softcapping", float(cap) if cap > 0 else None)
        m = self.output_multiplier
        if not _is_real(m) or not math.isfinite(m) or not m > 0:
            bad("output_multiplier", m, "must be a positive finite number")
        object.__setattr__(self, "output_multiplier", float(m))
        e = self.input_embedding_scale
        if not _is_real(e) or not math.isfinite(e) or e == 0:
            bad("input_embedding_scale", e, "must be a finite non-zero number")
        object.__setattr__(self, "input_embedding_scale", float(e))

    def n_groups(self, hidden_size: int) -> int:
        """Dynamic-tap groups G = hidden_size / conv_group_size (channel c is in group
        c // conv_group_size)."""
        return hidden_size // self.conv_group_size

    def projection_rows(self, hidden_size: int) -> int:
        """Rows of each ``kernel_projection``: 2 * taps * G, laid out (half, tap, group)."""
        return 2 * self.conv_kernel_size * self.n_groups(hidden_size)


@dataclass(frozen=True)
class DraftConfig:
    """Shape and hyper-parameters of one DFlash drafter (see the module docstring).

    ``layer_sliding`` is a tuple of ``n_layer`` bools (True = sliding-window
    layer); ``()`` means every layer is a full-attention layer.
    ``target_layer_ids`` are the target layers whose hidden states form one
    feature row (``fc_in = len(target_layer_ids) * hidden_size``);
    ``num_target_layers`` is the target's depth, kept for information only.
    """
    n_layer: int
    hidden_size: int
    n_head: int
    n_head_kv: int
    head_dim: int
    intermediate_size: int
    block_size: int
    target_layer_ids: tuple = ()
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    layer_sliding: tuple = ()
    sliding_window: int | None = None
    max_position_embeddings: int | None = None
    mask_token_id: int | None = None
    aux_hidden_norms: bool = False
    context_kv_layer_norm: bool = False
    attn_gate: str = "none"
    is_causal: bool | None = None
    window_rule: str = "per_row"
    dflash2: DFlash2Config | None = None
    # unrecognised config.json keys, written back by to_hf(); not part of equality
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ checks
    def __post_init__(self):
        def bad(name, value, why):
            raise ValueError(f"DraftConfig.{name}={value!r}: {why}")

        def setf(name, value):
            object.__setattr__(self, name, value)

        for name in ("n_layer", "hidden_size", "n_head", "n_head_kv", "head_dim",
                     "intermediate_size", "block_size"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                bad(name, v, "must be a positive int")
        if self.n_head % self.n_head_kv:
            bad("n_head", self.n_head,
                f"must be a multiple of n_head_kv={self.n_head_kv} (grouped-query attention)")
        if self.head_dim % 2:
            bad("head_dim", self.head_dim, "must be even (RoPE rotates pairs of halves)")

        ids = self.target_layer_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            bad("target_layer_ids", ids, "must be a list of ints")
        ids = tuple(ids)
        if not ids:
            bad("target_layer_ids", ids, "must name at least one captured target layer")
        for i in ids:
            if not _is_int(i) or i < 0:
                bad("target_layer_ids", ids, f"entry {i!r} is not a non-negative int")
        setf("target_layer_ids", ids)
        ntl = self.num_target_layers
        if ntl is not None:
            # informational only: published configs differ on whether ids count the
            # embedding output, so ids are not range-checked against it
            if not _is_int(ntl) or ntl <= 0:
                bad("num_target_layers", ntl, "must be a positive int or None")

        if not _is_real(self.rms_norm_eps) or not (self.rms_norm_eps > 0):
            bad("rms_norm_eps", self.rms_norm_eps, "must be a positive number")
        if not _is_real(self.rope_theta) or not (self.rope_theta > 0) \
                or not math.isfinite(self.rope_theta):
            bad("rope_theta", self.rope_theta, "must be a positive finite number")
        # rope_theta may be an int in config.json (1000000); keep it numerically, as float
        setf("rope_theta", float(self.rope_theta))

        mpe = self.max_position_embeddings
        if mpe is not None and (not _is_int(mpe) or mpe <= 0):
            bad("max_position_embeddings", mpe, "must be a positive int or None")
        setf("rope_scaling", _normalise_rope_scaling(self.rope_scaling, mpe))

        sl = self.layer_sliding
        if isinstance(sl, (str, bytes)) or not hasattr(sl, "__iter__"):
            bad("layer_sliding", sl, "must be a sequence of bools")
        sl = tuple(sl)
        if not sl:
            sl = (False,) * self.n_layer
        if len(sl) != self.n_layer:
            bad("layer_sliding", sl, f"has {len(sl)} entries, expected n_layer={self.n_layer}")
        for s in sl:
            if not isinstance(s, bool):
                bad("layer_sliding", sl, f"entry {s!r} is not a bool")
        setf("layer_sliding", sl)
        sw = self.sliding_window
        if sw is not None and (not _is_int(sw) or sw < 0):
            bad("sliding_window", sw, "must be a non-negative int or None (0/None: no limit)")
        if sw == 0:
            setf("sliding_window", None)

        mt = self.mask_token_id
        if mt is not None and (not _is_int(mt) or mt < 0):
            bad("mask_token_id", mt, "must be a non-negative int or None")
        for name in ("aux_hidden_norms", "context_kv_layer_norm"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                bad(name, v, "must be a bool")
        gate = self.attn_gate
        if gate is None or gate is False:
            gate = "none"
        if gate not in ATTN_GATES:
            bad("attn_gate", self.attn_gate, f"must be one of {ATTN_GATES}")
        setf("attn_gate", gate)
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            bad("is_causal", self.is_causal, "must be a bool or None")
        if self.window_rule not in WINDOW_RULES:
            bad("window_rule", self.window_rule, f"must be one of {WINDOW_RULES}")
        d2 = self.dflash2
        if d2 is not None:
            if not isinstance(d2, DFlash2Config):
                bad("dflash2", d2, "must be a DFlash2Config or None")
            if self.hidden_size % d2.conv_group_size:
                bad("dflash2", d2, f"conv_group_size={d2.conv_group_size} does not divide "
                    f"hidden_size={self.hidden_size}")
            if mt is None or mt >= d2.vocab_size:
                bad("mask_token_id", mt, f"a DFlash 2 drafter needs a mask token id below "
                    f"vocab_size={d2.vocab_size}")
        if not isinstance(self.extra, dict):
            bad("extra", self.extra, "must be a dict")

    def __hash__(self):
        return hash(json.dumps(self.to_hf(include_extra=False), sort_keys=True))

    # ------------------------------------------------------------- properties
    @property
    def n_captured(self) -> int:
        """Number of captured target layers (slices of one feature row)."""
        return len(self.target_layer_ids)

    @property
    def fc_in(self) -> int:
        """Width of one feature row: n_captured * hidden_size."""
        return self.n_captured * self.hidden_size

    @property
    def q_len(self) -> int:
        """Noise rows per step (= block_size)."""
        return self.block_size

    @property
    def gqa_ratio(self) -> int:
        """Query heads per kv head: query head i reads kv head i // gqa_ratio."""
        return self.n_head // self.n_head_kv

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def swa_window(self) -> int:
        """Sliding window as the masks use it: 0 means no limit."""
        return self.sliding_window or 0

    @property
    def mask_rule(self) -> MaskRule:
        """Which keys each block row sees (``mask_rule.py``), from ``sliding_window``,
        ``window_rule`` and ``is_causal``."""
        return MaskRule.for_config(self.swa_window, self.window_rule, self.is_causal)

    @property
    def layer_types(self) -> tuple:
        """Hugging Face ``layer_types`` strings, one per layer."""
        return tuple("sliding_attention" if s else "full_attention" for s in self.layer_sliding)

    @property
    def architecture(self) -> str:
        """The Hugging Face architecture name: DFlash2DraftModel or DFlashDraftModel."""
        return ARCH_DFLASH if self.dflash2 is None else ARCH_DFLASH2

    @property
    def any_sliding(self) -> bool:
        return any(self.layer_sliding)

    @property
    def any_full(self) -> bool:
        return not all(self.layer_sliding)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_sliding[layer]

    def replace(self, **changes) -> "DraftConfig":
        """A copy with some fields changed (validated again)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw.update(changes)
        if "n_layer" in changes and "layer_sliding" not in changes \
                and len(kw["layer_sliding"]) != kw["n_layer"]:
            kw["layer_sliding"] = ()
        return DraftConfig(**kw)

    # --------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf(cls, path_or_dict) -> "DraftConfig":
        """Parse a DFlash drafter ``config.json``: a dict, a path to the file,
        or a checkpoint directory holding it. Raises ValueError naming the
        field on anything missing or malformed."""
        if isinstance(path_or_dict, Mapping):
            d = dict(path_or_dict)
        else:
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            try:
                with open(p, encoding="utf-8") as f:
                    d = json.load(f)
            except FileNotFoundError:
                raise FileNotFoundError(f"DraftConfig.from_hf: no config file at {p!r}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"DraftConfig.from_hf: {p!r} is not valid JSON: {e}") from None
            if not isinstance(d, dict):
                raise ValueError(f"DraftConfig.from_hf: {p!r} does not hold a JSON object")
        return cls._from_dict(d)

    @classmethod
    def _from_dict(cls, d: dict) -> "DraftConfig":
        dc = d.get("dflash_config") or {}
        if not isinstance(dc, Mapping):
            raise ValueError(f"config.json dflash_config={dc!r}: must be an object")

        def need(key, value):
            if value is None:
                raise ValueError(f"config.json: missing required field {key!r}")
            return value

        def top_or_dc(key):
            # Top level wins (older z-lab layout); newer configs nest some keys in dflash_config.
            return d[key] if d.get(key) is not None else dc.get(key)

        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.json hidden_act={act!r}: the drafter's FFN is SiLU-gated "
                             "(only 'silu' is supported)")
        if d.get("attention_bias"):
            raise ValueError(f"config.json attention_bias={d['attention_bias']!r}: "
                             "projection biases are not supported")
        prf = d.get("partial_rotary_factor", 1.0)
        if prf != 1.0:
            raise ValueError(f"config.json partial_rotary_factor={prf!r}: only full-head RoPE "
                             "(1.0) is supported")

        n_head = need("num_attention_heads", d.get("num_attention_heads"))
        hidden = need("hidden_size", d.get("hidden_size"))
        n_layer = need("num_hidden_layers", d.get("num_hidden_layers"))
        head_dim = d.get("head_dim")
        if head_dim is None and _is_int(hidden) and _is_int(n_head) and n_head > 0:
            head_dim = hidden // n_head

        rope_params = d.get("rope_parameters")
        if rope_params is not None and not isinstance(rope_params, Mapping):
            raise ValueError(f"config.json rope_parameters={rope_params!r}: must be an object")
        rope_theta = d.get("rope_theta")
        if rope_theta is None and rope_params:
            rope_theta = rope_params.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params:
            rs = {k: v for k, v in rope_params.items() if k != "rope_theta"}
            if rs.get("rope_type", rs.get("type", "default")) != "default":
                rope_scaling = rs
        if rope_scaling is not None and not isinstance(rope_scaling, Mapping):
            raise ValueError(f"config.json rope_scaling={rope_scaling!r}: must be an object "
                             "or null")

        layer_types = d.get("layer_types")
        sliding_window = d.get("sliding_window")
        if layer_types is not None:
            if isinstance(layer_types, (str, bytes)) or not isinstance(layer_types, (list, tuple)):
                raise ValueError(f"config.json layer_types={layer_types!r}: must be a list")
            for t in layer_types:
                if t not in LAYER_TYPES:
                    raise ValueError(f"config.json layer_types: entry {t!r} is not one of "
                                     f"{LAYER_TYPES}")
            if _is_int(n_layer) and len(layer_types) != n_layer:
                raise ValueError(f"config.json layer_types has {len(layer_types)} entries, "
                                 f"expected num_hidden_layers={n_layer}")
            sliding = tuple(t == "sliding_attention" for t in layer_types)
        else:
            use_swa = bool(d.get("use_sliding_window", False))
            mwl = d.get("max_window_layers", _HF_DEFAULT_MAX_WINDOW_LAYERS)
            if not use_swa:
                sliding_window = None  # HF Qwen3Config drops the window when SWA is off
            if sliding_window and _is_int(n_layer):
                sliding = tuple(i >= mwl for i in range(n_layer))
            else:
                sliding = ()

        variants = {k: v for k in VARIANT_KEYS if (v := _either_place(d, dc, k)) is not None}

        target_ids = top_or_dc("target_layer_ids")
        need("dflash_config.target_layer_ids", target_ids)
        if isinstance(target_ids, (str, bytes)) or not isinstance(target_ids, (list, tuple)):
            raise ValueError(f"config.json dflash_config.target_layer_ids={target_ids!r}: "
                             "must be a list of ints")

        dflash2 = _parse_dflash2(d, dc)
        consumed = _CONSUMED_KEYS | ({"vocab_size", *DFLASH2_KEYS} if dflash2 else set())
        extra = {k: v for k, v in d.items() if k not in consumed}
        extra_dc = {k: v for k, v in dc.items() if k in _IGNORED_DFLASH_CONFIG_KEYS}
        if extra_dc:
            extra["dflash_config"] = extra_dc

        try:
            return cls(
                n_layer=n_layer,
                hidden_size=hidden,
                n_head=n_head,
                n_head_kv=d.get("num_key_value_heads") if d.get("num_key_value_heads") is not None
                else n_head,
                head_dim=need("head_dim", head_dim),
                intermediate_size=need("intermediate_size", d.get("intermediate_size")),
                block_size=need("block_size", top_or_dc("block_size")),
                target_layer_ids=target_ids,
                num_target_layers=top_or_dc("num_target_layers"),
                rms_norm_eps=d.get("rms_norm_eps") if d.get("rms_norm_eps") is not None else 1e-6,
                rope_theta=rope_theta if rope_theta is not None else 1_000_000.0,
                rope_scaling=rope_scaling,
                layer_sliding=sliding,
                sliding_window=sliding_window,
                max_position_embeddings=d.get("max_position_embeddings"),
                mask_token_id=top_or_dc("mask_token_id"),
                is_causal=top_or_dc("is_causal"),
                window_rule=dc.get("window_rule", "per_row"),
                extra=extra,
                dflash2=dflash2,
                **variants,
            )
        except ValueError as e:
            # name the config.json key as well as the DraftConfig field
            msg = str(e)
            m = re.match(r"DraftConfig\.(\w+)", msg)
            if m and m.group(1) in HF_KEY:
                raise ValueError(f"{msg} [config.json: {HF_KEY[m.group(1)]}]") from None
            if m and m.group(1) == "dflash2":
                raise ValueError(f"{msg} [config.json: dflash_config]") from None
            raise

    def to_hf(self, include_extra: bool = True) -> dict:
        """The config as a Hugging Face ``config.json`` dict (what ``from_hf`` reads back)."""
        d: dict[str, Any] = {"model_type": "qwen3"}
        extra = dict(self.extra) if include_extra else {}
        extra_dc = extra.pop("dflash_config", {})
        d.update(extra)
        d["architectures"] = [self.architecture]
        rt = self.rope_theta
        d.update({HF_KEY[f]: getattr(self, f) for f in _PLAIN_FIELDS})
        d.update({
            "hidden_act": "silu",
            "attention_bias": False,
            # an integral theta is written as an int, as the published configs do
            "rope_theta": int(rt) if rt.is_integer() and abs(rt) < 2**53 else rt,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.any_sliding and self.sliding_window is not None,
        })
        if self.max_position_embeddings is not None:
            d["max_position_embeddings"] = self.max_position_embeddings
        dc = dict(extra_dc)
        dc["target_layer_ids"] = list(self.target_layer_ids)
        dc["mask_token_id"] = self.mask_token_id
        if self.aux_hidden_norms:
            dc["aux_hidden_norms"] = True
        if self.context_kv_layer_norm:
            dc["context_kv_layer_norm"] = True
        if self.attn_gate != "none":
            dc["attn_gate"] = self.attn_gate
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        if self.window_rule != "per_row":
            dc["window_rule"] = self.window_rule
        d2 = self.dflash2
        if d2 is not None:
            d["vocab_size"] = d2.vocab_size
            dc.update({k: getattr(d2, k) for k in DFLASH2_KEYS})
        d["dflash_config"] = dc
        return d

    def save(self, path) -> None:
        """Write ``config.json`` (``path`` is a directory or the file itself)."""
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        with open(p, "w", encoding="utf-8") as f:
            json.dump(self.to_hf(), f, indent=2)
            f.write("\n")


def _normalise_rope_scaling(rs, max_position_embeddings):
    """Validate ``rope_scaling`` and return it as a plain dict with ``rope_type``
    set (HF's legacy ``type`` key is accepted), or None for no scaling."""
    if rs is None:
        return None
    if not isinstance(rs, Mapping):
        raise ValueError(f"DraftConfig.rope_scaling={rs!r}: must be a dict or None")
    rs = dict(rs)
    rtype = rs.pop("rope_type", None)
    legacy = rs.pop("type", None)
    rtype = rtype if rtype is not None else legacy
    if rtype is None:
        raise ValueError(f"DraftConfig.rope_scaling={rs!r}: has no 'rope_type'")
    if rtype == "default":
        return None
    if rtype not in ROPE_SCALING_TYPES:
        raise ValueError(f"DraftConfig.rope_scaling rope_type={rtype!r}: unsupported "
                         f"(supported: {ROPE_SCALING_TYPES})")
    rs.pop("rope_theta", None)

    def positive(key, required):
        v = rs.get(key)
        if v is None:
            if required:
                raise ValueError(f"DraftConfig.rope_scaling[{key!r}]: required for "
                                 f"rope_type={rtype!r}")
            return
        if not _is_real(v) or not (v > 0) or not math.isfinite(v):
            raise ValueError(f"DraftConfig.rope_scaling[{key!r}]={v!r}: must be a positive number")

    if rtype == "linear":
        positive("factor", True)
    else:  # yarn
        has_orig = rs.get("original_max_position_embeddings") is not None
        # HF: factor may be omitted and derived as max_position_embeddings / original_max
        positive("factor", not has_orig)
        positive("original_max_position_embeddings", False)
        if (not has_orig or rs.get("factor") is None) and max_position_embeddings is None:
            raise ValueError("DraftConfig.max_position_embeddings=None: YaRN rope_scaling needs "
                             "it when rope_scaling lacks 'original_max_position_embeddings' "
                             "or 'factor'")
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            v = rs.get(key)
            if v is not None and (not _is_real(v) or not math.isfinite(v)):
                raise ValueError(f"DraftConfig.rope_scaling[{key!r}]={v!r}: must be a number")
        af = rs.get("attention_factor")
        if af is not None:
            positive("attention_factor", False)
        tr = rs.get("truncate")
        if tr is not None and not isinstance(tr, bool):
            raise ValueError(f"DraftConfig.rope_scaling['truncate']={tr!r}: must be a bool")
    out = {"rope_type": rtype}
    out.update(rs)
    return out


def _either_place(d: Mapping, dc: Mapping, key: str):
    """``key`` from the top level or ``dflash_config`` (None if in neither); both set and
    different is an error naming both values."""
    a, b = d.get(key), dc.get(key)
    if a is not None and b is not None and a != b:
        raise ValueError(f"config.json {key}: top level says {a!r} but dflash_config says {b!r}")
    return a if a is not None else b


def _architecture(d: Mapping) -> str:
    """The one architecture a config.json declares (absent: DFlash); anything this
    module does not implement is refused, naming it."""
    arch = d.get("architectures")
    if arch is None:
        return ARCH_DFLASH
    if isinstance(arch, (str, bytes)) or not isinstance(arch, (list, tuple)) or len(arch) != 1:
        raise ValueError(f"config.json architectures={arch!r}: must be a one-entry list, "
                         f"one of {list(ARCHITECTURES)}")
    if arch[0] not in ARCHITECTURES:
        raise ValueError(f"config.json architectures={arch!r}: {arch[0]!r} is not implemented "
                         f"by this module (it implements {', '.join(ARCHITECTURES)})")
    return arch[0]


def _parse_dflash2(d: Mapping, dc: Mapping) -> DFlash2Config | None:
    """The DFlash2Config of a ``DFlash2DraftModel`` config.json, None for DFlash. A
    dflash_config key this module does not understand, or a DFlash 2 field in a config
    that does not declare DFlash 2, is refused: dropping it would run half a model."""
    arch = _architecture(d)
    known = set(_DFLASH_CONFIG_KEYS) | set(_IGNORED_DFLASH_CONFIG_KEYS)
    if arch == ARCH_DFLASH2:
        known |= set(DFLASH2_KEYS)
    unknown = sorted(k for k in dc if k not in known)
    if unknown:
        v2 = sorted(set(unknown) & set(DFLASH2_KEYS))
        why = (f"DFlash 2 field(s) {v2} in a {arch} config (declare architectures "
               f"[{ARCH_DFLASH2!r}] to run them)" if v2 else
               f"not understood by this module for {arch}")
        raise ValueError(f"config.json dflash_config: key(s) {unknown}: {why}")
    if arch != ARCH_DFLASH2:
        top = sorted(k for k in DFLASH2_KEYS if d.get(k) is not None)
        if top:
            raise ValueError(f"config.json: DFlash 2 field(s) {top} in a {arch} config "
                             f"(declare architectures [{ARCH_DFLASH2!r}] to run them)")
        return None
    values = {}
    for key in DFLASH2_KEYS:
        v = _either_place(d, dc, key)
        if v is None and key in _DFLASH2_REQUIRED:
            raise ValueError(f"config.json: missing required DFlash 2 field "
                             f"'dflash_config.{key}'")
        if v is not None:
            values[key] = v
    if d.get("vocab_size") is None:
        raise ValueError("config.json: missing required field 'vocab_size' (a DFlash 2 "
                         "drafter's selector codebooks have one row per token)")
    try:
        return DFlash2Config(vocab_size=d["vocab_size"], **values)
    except ValueError as e:
        m = re.match(r"DFlash2Config\.(\w+)", str(e))
        where = "vocab_size" if m and m.group(1) == "vocab_size" else \
            f"dflash_config.{m.group(1)}" if m else "dflash_config"
        raise ValueError(f"{e} [config.json: {where}]") from None
