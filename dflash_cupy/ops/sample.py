"""Draft tokens from logits (``cuda_src/sample.cu``, its draw in ``draw.cuh``) and the NumPy reference
sampler that reproduces them from the same Philox uniforms.

``TokenSampler(backend, vocab)``; ``__call__(logits, tokens, knobs, rng,
n_rows, stream=None, lane_rows=None)`` writes ``tokens[:n_rows]`` (int32). The per-step
values are device arrays, so a captured graph reads new ones at each replay:
``knobs`` f32 ``[3]`` = (temperature, top_p, top_k), ``rng`` u64 ``[2]`` =
(seed, counter base). ``SamplingParams`` validates and packs them. Lanes: with
``lane_rows``, ``knobs`` ``[lanes, 3]`` and ``rng`` ``[lanes, 2]``, row ``lane *
lane_rows + r`` takes its lane's knobs and draws as row ``r`` (each lane's rows come out
as a one-lane call with that lane's knobs and rng would give them).

Greedy (temperature 0) is the argmax with ties to the lowest token id (as
``torch.argmax``). Sampling is deterministic for a given seed and counter:
probabilities become integer masses (``trunc(w * 2^40)``), so every sum is
exact and order-free; the reference computes the same masses, except where
its ``exp`` and the kernel's ``expf`` differ in the last bit, which can move
a draw only when the uniform lies within that rounding of a boundary
(``sample_reference`` reports each draw's margin for that reason).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import checks, kernels

BLOCK = 512
MASS_SCALE = np.float32(2.0 ** 40)
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 = greedy; ``top_k`` 0 = off; ``top_p`` 1.0 = off;
    ``seed`` a u64. Raises ``ValueError``/``TypeError`` naming the field."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise TypeError(f"{name} must be a float, got {type(v).__name__}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise TypeError(f"top_k must be an int, got {type(self.top_k).__name__}")
        if not 0 <= self.top_k < 2 ** 24:
            raise ValueError(f"top_k must be in [0, 2^24), got {self.top_k}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"seed must be in [0, 2^64), got {self.seed}")

    def knobs(self) -> np.ndarray:
        return np.array([self.temperature, self.top_p, self.top_k], np.float32)


class TokenSampler:
    """One block per row of ``logits [>= n_rows, ld >= vocab]`` f32; ``tokens`` int32."""

    def __init__(self, backend, vocab: int):
        if not isinstance(vocab, (int, np.integer)) or isinstance(vocab, bool) or not 1 <= vocab < 2 ** 31:
            raise ValueError(f"vocab must be a positive int, got {vocab!r}")
        self.backend = backend
        self.vocab = int(vocab)
        self.block = min(BLOCK, max(32, -(-self.vocab // 32) * 32))
        mod = kernels.load_module(backend, "sample.cu", SAMPLE_V=self.vocab, SAMPLE_BLOCK=self.block)
        self._kernel = mod.get_function("sample_rows")
        self._reduce = mod.get_function("argmax_partials")

    def __repr__(self):
        return f"TokenSampler(vocab={self.vocab}, block={self.block})"

    def __call__(self, logits, tokens, knobs, rng, n_rows: int, stream=None, lane_rows=None) -> None:
        be = self.backend
        checks.device_array(be, "logits", logits, np.float32)
        checks.device_array(be, "tokens", tokens, np.int32, ndim=1)
        lanes = None if lane_rows is None else -1
        checks.device_array(be, "knobs", knobs, np.float32, ndim=1 if lanes is None else 2)
        checks.device_array(be, "rng", rng, np.uint64, ndim=1 if lanes is None else 2)
        if logits.shape[1] < self.vocab:
            raise ValueError(f"logits must have >= {self.vocab} columns, got shape {tuple(logits.shape)}")
        if lanes is not None:
            lane_rows = checks.int_arg(lane_rows, "lane_rows", 1)
            lanes = knobs.shape[0]
        want_k, want_r = ((3,), (2,)) if lanes is None else ((lanes, 3), (lanes, 2))
        if tuple(knobs.shape) != want_k:
            raise ValueError(f"knobs must have shape {list(want_k)}, got {tuple(knobs.shape)}")
        if tuple(rng.shape) != want_r:
            raise ValueError(f"rng must have shape {list(want_r)}, got {tuple(rng.shape)}")
        if isinstance(n_rows, bool) or not isinstance(n_rows, (int, np.integer)):
            raise TypeError(f"n_rows must be an int, got {type(n_rows).__name__}")
        if not 0 <= n_rows <= min(logits.shape[0], tokens.shape[0]):
            raise ValueError(f"n_rows={n_rows} must be in [0, {min(logits.shape[0], tokens.shape[0])}]")
        if lanes is not None and n_rows > lanes * lane_rows:
            raise ValueError(f"n_rows={n_rows} exceeds {lanes} lanes of lane_rows={lane_rows}")
        if n_rows == 0:
            return
        self._kernel((int(n_rows), 1, 1), (self.block, 1, 1),
                     (logits, np.int32(logits.shape[1]), np.int32(n_rows), knobs, rng,
                      np.int32(0 if lane_rows is None else lane_rows), tokens),
                     stream=stream)


    def reduce_partials(self, partials, tokens, n_rows: int, stream=None) -> None:
        """Greedy tokens from the fused lm_head GEMM's ``partials`` (u32
        ``[>= n_rows, blocks, 2]``: each column block's best (order key,
        column), ``Gemm(..., "argmax")``): the same token as the argmax of
        the full logits row, ties to the lowest id."""
        be = self.backend
        checks.device_array(be, "partials", partials, np.uint32, ndim=3)
        checks.device_array(be, "tokens", tokens, np.int32, ndim=1)
        if partials.shape[2] != 2:
            raise ValueError(f"partials must have shape [rows, blocks, 2], got {tuple(partials.shape)}")
        n_rows = checks.int_arg(n_rows, "n_rows")
        if n_rows > min(partials.shape[0], tokens.shape[0]):
            raise ValueError(f"n_rows={n_rows} must be in [0, {min(partials.shape[0], tokens.shape[0])}]")
        if n_rows == 0:
            return
        self._reduce((n_rows, 1, 1), (self.block, 1, 1),
                     (partials, np.int32(partials.shape[1]), np.int32(n_rows), tokens), stream=stream)


# ---------------------------------------------------------------- NumPy reference

def philox4x32_10(counter, key) -> tuple[int, int, int, int]:
    """Philox4x32 with 10 rounds (Salmon et al., SC'11) on Python ints."""
    c0, c1, c2, c3 = (int(x) & _MASK32 for x in counter)
    k0, k1 = (int(x) & _MASK32 for x in key)
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _MASK32, p1 & _MASK32, ((p0 >> 32) ^ c3 ^ k1) & _MASK32, \
            p0 & _MASK32
    return c0, c1, c2, c3


def row_uniform64(row: int, seed: int, counter: int) -> int:
    """The 64-bit draw of ``row``: ``c1 << 32 | c0`` of Philox(counter=(row, base lo, base hi, 0))."""
    c = philox4x32_10((row, counter & _MASK32, (counter >> 32) & _MASK32, 0),
                      (seed & _MASK32, (seed >> 32) & _MASK32))
    return (c[1] << 32) | c[0]


def _order_keys(z: np.ndarray) -> np.ndarray:
    u = z.view(np.uint32)
    k = np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint32)
    return np.where(np.isnan(z), np.uint32(0), k)


def draw_masses(z: np.ndarray, keys: np.ndarray | None = None) -> np.ndarray:
    """``draw.cuh``'s ``draw_mass`` of each f32 ``z`` against the largest (order key):
    ``trunc(w * 2^40)`` u64, ``w = 1`` at the maximum, else ``exp(z - max)`` in f32; NaN: 0."""
    z = np.asarray(z, np.float32)
    keys = _order_keys(z) if keys is None else keys
    kmax = keys.max()
    m = z[keys == kmax][0] if kmax else np.float32(np.nan)
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(z == m, np.float32(1.0), np.exp((z - m).astype(np.float32)).astype(np.float32))
    return np.where(np.isnan(z), 0, (w.astype(np.float32) * MASS_SCALE)).astype(np.uint64)


def inverse_cdf(bits: int, mass: np.ndarray) -> tuple[int, float]:
    """``draw.cuh``'s draw from u64 ``mass`` (total > 0) with the 64 random ``bits``: the
    first index whose running mass exceeds ``floor(bits * total / 2^64)``, and the
    draw's margin (the target's distance to its interval's nearer end, over the total)."""
    total = int(mass.sum(dtype=np.uint64))
    target = (int(bits) * total) >> 64
    cum = np.cumsum(mass, dtype=np.uint64)
    tok = int(np.searchsorted(cum, np.uint64(target), side="right"))
    lo = int(cum[tok - 1]) if tok else 0
    return tok, min(target - lo, int(cum[tok]) - 1 - target) / total


def sample_reference(logits, params: SamplingParams, counter: int, vocab: int | None = None):
    """Tokens ``[rows]`` int32 and, per row, the draw's margin: the distance
    (in units of the row's kept mass) from the target to the nearest boundary
    between tokens (``inf`` for greedy)."""
    lg = np.asarray(logits, np.float32)
    V = lg.shape[1] if vocab is None else int(vocab)
    lg = lg[:, :V]
    tokens = np.zeros(lg.shape[0], np.int32)
    margins = np.full(lg.shape[0], np.inf)
    for r in range(lg.shape[0]):
        if not params.temperature > 0.0:
            keys = _order_keys(lg[r])
            tokens[r] = int(np.argmax(keys))  # first of the largest keys
            continue
        inv_t = np.float32(1.0) / np.float32(params.temperature)
        z = lg[r] * inv_t
        keys = _order_keys(z)
        mass = draw_masses(z, keys)
        thr = 1
        if 0 < params.top_k < V:
            thr = max(thr, int(np.sort(keys)[::-1][params.top_k - 1]))
        if params.top_p < 1.0:
            kept = keys >= thr
            s = int(mass[kept].sum(dtype=np.uint64))
            if s > 0:
                p = math.ceil(float(np.float32(params.top_p)) * float(s))
                p = min(max(p, 1), s)
                order = np.argsort(keys[kept], kind="stable")[::-1]
                ks, ms = keys[kept][order], mass[kept][order]
                cum = np.cumsum(ms, dtype=np.uint64)
                # mass(key >= t) for each distinct key t: the last occurrence of t in descending order
                last = np.r_[ks[1:] != ks[:-1], True]
                ok = (cum >= np.uint64(p)) & last
                thr = max(thr, int(ks[np.argmax(ok)]))
        kept_mass = np.where(keys >= thr, mass, np.uint64(0))
        total = int(kept_mass.sum(dtype=np.uint64))
        if total == 0:
            tokens[r] = 0
            continue
        tokens[r], margins[r] = inverse_cdf(row_uniform64(r, params.seed, counter), kept_mass)
    return tokens, margins
