"""The fixed drafters of the cache tests and the ``Driver`` that plays the target
around one ``DraftKvCache``, checking every step against the float64 oracle.

A step of these tiny drafters takes ~20-200 ms on the emulator, so the shapes
live in a few fixed drafters (``SPECS``, each compiled once and cached on disk
by g++). ``MAX_ERR*``: the largest errors any ``Driver`` measured in this
process (tests/test_kv_cache.py clears them at its start and asserts ceilings on its own)."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from dflash_cupy import reference
from dflash_cupy.config import DFlash2Config, DraftConfig
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.weights import DraftWeights
from tests.support.tolerances import assert_close

BF16 = ml_dtypes.bfloat16


# --------------------------------------------------------------------------- fixed drafters
@dataclass(frozen=True)
class Spec:
    config: DraftConfig
    wdtype: object          # weight dtype
    capacity: int
    ring_capacity: int
    ring_dtype: object
    vocab: int = 0          # 0: no lm_head
    lm_dtype: object = np.float32
    bulk_chunk: int = 256


def small_config(**kw):
    return DraftConfig(**{"rms_norm_eps": 1e-6, "rope_theta": 10000.0, **kw})


# Between them: block sizes 1/4/8/16, GQA ratios 1/2/4, head_dim 32/64/128, full
# and sliding layers mixed, windows below (a, d) and above (b) the capacity,
# every drafter variant, f32/f16/bf16 weights and rings, logits with f32 and bf16
# LM heads, capacities odd, smaller than q_len (b), larger than a_step (bulk
# path: a, c, e) and large enough for split attention (e: kv_total 512).
SPECS = {
    "a": Spec(small_config(n_layer=2, hidden_size=32, n_head=2, n_head_kv=1, head_dim=32,
                   intermediate_size=48, block_size=4, target_layer_ids=(1, 3),
                   layer_sliding=(False, True), sliding_window=3),
              np.float32, capacity=23, ring_capacity=25, ring_dtype=np.float32, vocab=19),
    "b": Spec(small_config(n_layer=2, hidden_size=32, n_head=4, n_head_kv=1, head_dim=32,
                   intermediate_size=40, block_size=8, target_layer_ids=(0, 2, 5),
                   layer_sliding=(True, False), sliding_window=40,
                   aux_hidden_norms=True, attn_gate="head"),
              BF16, capacity=5, ring_capacity=5, ring_dtype=BF16),
    "c": Spec(small_config(n_layer=1, hidden_size=32, n_head=2, n_head_kv=2, head_dim=64,
                   intermediate_size=40, block_size=1, target_layer_ids=(0,),
                   context_kv_layer_norm=True, attn_gate="element"),
              np.float16, capacity=13, ring_capacity=20, ring_dtype=np.float16, vocab=19,
              lm_dtype=BF16),
    "d": Spec(small_config(n_layer=1, hidden_size=32, n_head=2, n_head_kv=1, head_dim=128,
                   intermediate_size=48, block_size=16, target_layer_ids=(0,),
                   layer_sliding=(True,), sliding_window=9),
              np.float32, capacity=37, ring_capacity=37, ring_dtype=np.float32),
    "e": Spec(small_config(n_layer=1, hidden_size=32, n_head=2, n_head_kv=1, head_dim=32,
                   intermediate_size=32, block_size=4, target_layer_ids=(0, 1),
                   layer_sliding=(False,)),
              np.float32, capacity=491, ring_capacity=500, ring_dtype=BF16, bulk_chunk=64),
    # RoPE scaling: YaRN (frequency blend and attention factor on cos/sin) through the ring
    "f": Spec(small_config(n_layer=1, hidden_size=32, n_head=2, n_head_kv=1, head_dim=32,
                   intermediate_size=32, block_size=4, target_layer_ids=(0,),
                   rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 64},
                   max_position_embeddings=256),
              BF16, capacity=29, ring_capacity=40, ring_dtype=np.float16),
    # DFlash 2 (SPEC §6): the published layout's non-causal per-row sliding window with a
    # full layer, 2 taps in 2 groups (bf16); 3 taps, block 16 whose taps cross tiles, a
    # context-KV-norm variant and an attention gate reading the convolved rows (f16)
    "g": Spec(small_config(n_layer=2, hidden_size=32, n_head=2, n_head_kv=1, head_dim=32,
                   intermediate_size=48, block_size=4, target_layer_ids=(1, 3),
                   layer_sliding=(True, False), sliding_window=5, is_causal=False, mask_token_id=3,
                   dflash2=DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                         selector_top_k=4, vocab_size=19)),
              BF16, capacity=23, ring_capacity=25, ring_dtype=BF16),
    "h": Spec(small_config(n_layer=1, hidden_size=32, n_head=2, n_head_kv=2, head_dim=32,
                   intermediate_size=40, block_size=16, target_layer_ids=(0,),
                   layer_sliding=(True,), sliding_window=9, mask_token_id=3,
                   context_kv_layer_norm=True, attn_gate="head",
                   dflash2=DFlash2Config(conv_kernel_size=3, conv_group_size=8, selector_rank=8,
                                         selector_top_k=4, vocab_size=19)),
              np.float16, capacity=37, ring_capacity=40, ring_dtype=np.float32),
}


_BUILT: dict = {}
MAX_ERR: dict = {}        # weight dtype -> max |hidden - oracle| seen (for reports)
MAX_ERR_TIGHT: dict = {}  # the same against the tight oracle (f16 K/V rounding modelled)
MAX_ERR_X1: dict = {}     # the same with x_split=False (one rounding of each GEMM input)


def built(name):
    """(weights, lm_head) of a fixed drafter, made once per session."""
    if name not in _BUILT:
        s = SPECS[name]
        w = DraftWeights.random(s.config, seed=7 + ord(name), dtype=s.wdtype)
        lm = None
        if s.vocab:
            r = np.random.default_rng(ord(name))
            lm = (r.standard_normal((s.vocab, s.config.hidden_size))
                  / np.sqrt(s.config.hidden_size)).astype(s.lm_dtype)
        _BUILT[name] = (w, lm)
    return _BUILT[name]


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


# --------------------------------------------------------------------------- the driver
class Driver:
    """Plays the target around one DraftKvCache: owns the feature history
    (by absolute position, redrawn after rewinds and resets so stale cache
    rows would show), writes the ring like the target does (only what is
    missing), models ``slot_pos``/``next_pos`` per SPEC §3, and checks every
    step against the oracle."""

    def __init__(self, be, name, base=0, seed=0, weights=None, x_split=True, tune=None, pdl=False):
        self.be, self.name, self.spec = be, name, SPECS[name]
        self.x_split = x_split
        s, c = self.spec, self.spec.config
        self.w, self.lm = built(name)
        if weights is not None:
            self.w = weights
        self.kv = DraftKvCache(self.w, s.capacity, lm_head=self.lm, backend=be, bulk_chunk=s.bulk_chunk,
                               x_split=x_split, tune=tune, pdl=pdl)
        self.ring = FeatureRing(s.ring_capacity, c.n_captured, c.hidden_size, s.ring_dtype, backend=be)
        self.rng = np.random.default_rng(seed)
        self.cap, self.q = s.capacity, c.q_len
        self.origin = max(0, base - s.capacity)   # first position any window can need
        self.floor = max(1, base)                 # lowest committed a schedule goes to
        self.hist = np.zeros((0, c.fc_in), np.float32)
        self.valid_hi = 0        # ring rows in [ring.lo, valid_hi) match the history
        self.sp = np.full(s.capacity, -1, np.int64)
        self.next_pos = 0
        self.committed = None

    # ---- the target's side
    def features(self, a, b):
        need = b - self.origin
        if need > len(self.hist):
            more = self.rng.standard_normal((need - len(self.hist), self.hist.shape[1]))
            self.hist = np.concatenate([self.hist, more.astype(np.float32)])
        return self.hist[a - self.origin:b - self.origin]

    def forget_from(self, p):
        """Positions >= p get new features (rewind: new tokens after p)."""
        self.hist = self.hist[:max(0, p - self.origin)]
        self.valid_hi = min(self.valid_hi, p)

    def reset(self):
        """A new request with a different prefix: its ring rows are the old request's."""
        self.kv.reset()
        self.ring.reset()
        self.forget_from(self.origin)
        self.sp[:] = -1
        self.next_pos = 0

    def feed(self, c):
        lo = c - min(c, self.cap)
        good = min(self.ring.hi, self.valid_hi)
        s = good if self.ring.lo <= lo <= good else lo
        if s < c:
            self.ring.write(s, self.features(s, c))
        self.valid_hi = max(self.valid_hi, c)
        assert self.ring.holds(lo, c)

    def model(self, c):
        """SPEC §3 begin_step on the NumPy slot table."""
        if self.next_pos > c:
            self.sp[:] = -1
            self.next_pos = 0
        lo = c - min(c, self.cap)
        for p in range(max(self.next_pos, lo), c):
            self.sp[p % self.cap] = p
        self.next_pos = c

    def noise(self):
        return self.rng.standard_normal((self.q, self.spec.config.hidden_size)).astype(np.float32)

    # ---- one step
    def step(self, c, eager=False, check=True):
        self.feed(c)
        noise = self.noise()
        self.model(c)
        if eager:
            self.kv.begin_step(self.ring, c)
            self.kv.set_noise_embed(noise)
            out = self.kv.run(eager=True)
        else:
            out = self.kv.step(self.ring, c, noise)
        assert out is self.kv.hidden_states
        self.committed = c
        if check:
            self.check(c, noise)
        return noise

    def check(self, c, noise):
        be, kv, cfg = self.be, self.kv, self.spec.config
        what = f"drafter {self.name}, committed={c}"
        lo = c - min(c, self.cap)
        X = self.features(lo, c).astype(self.ring.dtype)   # the ring rounds the features
        ref = reference.draft_forward(self.w, X, noise, lm_head=self.lm)
        hidden = be.to_numpy(kv.hidden_states)
        if not self.x_split:
            self._check_single_term(hidden, ref, what)
        else:
            self._check_split(hidden, ref, X, noise, lo, what)
        assert kv.next_pos == c, what
        np.testing.assert_array_equal(be.to_numpy(kv.slot_pos), self.sp, err_msg=what + " slot_pos")
        mf, ms = reference.ring_masks(self.sp, c, kv.geom, cfg.mask_rule)
        assert (kv.mask_full is not None) == cfg.any_full
        assert (kv.mask_swa is not None) == cfg.any_sliding
        if kv.mask_full is not None:
            assert np.array_equal(bits(be.to_numpy(kv.mask_full)), bits(mf)), what + " mask_full"
        if kv.mask_swa is not None:
            assert np.array_equal(bits(be.to_numpy(kv.mask_swa)), bits(ms)), what + " mask_swa"

    def _check_split(self, hidden, ref, X, noise, lo, what):
        be, kv = self.be, self.kv
        # The tight oracle: the same f16 rounding of K/V where the cache stores them, at the
        # absolute positions where it rounds them; what is left is f32 arithmetic.
        tight = reference.draft_forward(self.w, X, noise, lm_head=self.lm, pos_offset=lo, kv_round="f16")
        tight_h = tight[0] if self.lm is not None else tight
        assert_close(hidden, tight_h, "step_kv16", what + " (tight oracle)")
        key0 = np.dtype(self.spec.wdtype).name if self.w.dtype is not None else "mixed"
        MAX_ERR_TIGHT[key0] = max(MAX_ERR_TIGHT.get(key0, 0.0), float(np.abs(hidden - tight_h).max()))
        # "step": the only rounding the SPEC allows is the f16 K/V storage
        # (rel. 2^-11 per cached row); everything else is f32 math (f16/bf16
        # weights are read exactly, activations kept f32-accurate) through the
        # layers, accumulated in another order than the float64 oracle's.
        key = np.dtype(self.spec.wdtype).name if self.w.dtype is not None else "mixed"
        if self.lm is not None:
            ref, lref = ref
            logits = be.to_numpy(kv.logits)
            assert_close(logits, lref, "step", what + " (logits)")
            MAX_ERR[key + " logits"] = max(MAX_ERR.get(key + " logits", 0.0),
                                           float(np.abs(logits - lref).max()))
        assert_close(hidden, ref, "step", what)
        MAX_ERR[key] = max(MAX_ERR.get(key, 0.0), float(np.abs(hidden - ref).max()))

    def _check_single_term(self, hidden, ref, what):
        """``x_split=False``: every GEMM input rounded once to the weight type
        (bf16: 2^-9 relative), so only the plain oracle at the ``step_x1``
        tolerance; the kernels that round are tested exactly at the GEMM level."""
        key = np.dtype(self.spec.wdtype).name if self.w.dtype is not None else "mixed"
        if self.lm is not None:
            ref, lref = ref
            logits = self.be.to_numpy(self.kv.logits)
            assert_close(logits, lref, "step_x1", what + " (logits, x_split=False)")
            MAX_ERR_X1[key + " logits"] = max(MAX_ERR_X1.get(key + " logits", 0.0),
                                              float(np.abs(logits - lref).max()))
        assert_close(hidden, ref, "step_x1", what + " (x_split=False)")
        MAX_ERR_X1[key] = max(MAX_ERR_X1.get(key, 0.0), float(np.abs(hidden - ref).max()))

    def run_ops(self, ops):
        """``ops``: ints (committed, relative to ``floor - 1``), ``("rewind", c)``
        (features from c on change), ``"reset"`` (new request)."""
        for op in ops:
            eager = False
            if isinstance(op, tuple) and op[0] == "eager":
                op, eager = op[1], True
            if op == "reset":
                self.reset()
                continue
            if isinstance(op, tuple):       # ("rewind", c)
                c = self.floor - 1 + op[1]
                self.forget_from(c)
            else:
                c = self.floor - 1 + op
            self.step(c, eager=eager)

    def run_drawn(self, first, ops):
        """A drawn schedule: a first step at ``first`` (relative to ``floor - 1``), then
        ``((kind, k), eager)`` ops: accept / grow / jump by ``k``, rewind by ``k`` (features
        from there on change), reset then step at ``k``."""
        self.step(self.floor - 1 + first)
        for (kind, k), eager in ops:
            c = self.committed
            if kind in ("accept", "grow", "jump"):
                c += k
            elif kind == "rewind":
                c = max(self.floor, c - k)
                self.forget_from(c)
            else:
                self.reset()
                c = self.floor - 1 + k
            self.step(c, eager=eager)

    def close(self):
        self.kv.close()
        self.ring.close()
