"""Per-head q/k RMSNorm + NEOX RoPE + f16 K/V scatter (``cuda_src/rope.cu``)
and its NumPy reference.

One launch takes the rows of one fused QKV GEMM, ``qkv [M, QKV_W] f32`` laid
out ``[Q (n_head*d, only with has_q) | K (n_head_kv*d) | V (n_head_kv*d)]``:

* Q: ``rmsnorm(q_head) * q_norm``, RoPE at ``pos[m]`` -> ``q_out [M, n_head*d] f32``;
* K: ``rmsnorm(k_head) * k_norm``, RoPE -> f16 row ``k_cache[rows[m]]``;
* V: f16 row ``v_cache[rows[m]]``.

RoPE uses a device table ``inv_freq [d/2] float64`` (plain ``theta**(-2i/d)``,
or HF linear / YaRN tables from ``dflash_cupy.rope_params.rope_parameters``)
and multiplies cos and sin by ``attn_scale_factor`` (YaRN's attention scaling,
1.0 otherwise). Angles are formed in double and reduced modulo 2*pi on the
device, so absolute positions of 2^20 and beyond lose no accuracy.

The append stage uses ``has_q=False`` (rows = ring slots / the trash slot),
the noise rows ``has_q=True`` (rows = ``capacity + i``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import checks, kernels

THREADS = 128  # 4 warps per row: enough head units to keep them busy, one block per row


@dataclass(frozen=True)
class RopeSpec:
    """What a qkv GEMM needs to fold ``QkvNormRope(has_q=True)`` into its epilogue
    (``ops.gemm.Gemm(rope=...)``, gemm_wgmma.cu's GW_EPI 3): the head geometry and the two
    scalars of the norm and the rotation."""
    head_dim: int
    n_head: int
    n_head_kv: int
    eps: float = 1e-6
    attn_scale_factor: float = 1.0

    def __post_init__(self):
        for name in ("head_dim", "n_head", "n_head_kv"):
            checks.int_arg(getattr(self, name), name, 1)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotate_half RoPE, got {self.head_dim}")
        if not checks.float_arg(self.eps, "eps") >= 0.0:
            raise ValueError(f"eps must be >= 0, got {self.eps!r}")
        if not np.isfinite(checks.float_arg(self.attn_scale_factor, "attn_scale_factor")):
            raise ValueError(f"attn_scale_factor must be finite, got {self.attn_scale_factor!r}")

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim


def check_kv_caches(kv_width: int, k_cache, v_cache) -> None:
    """The layer's K and V ring caches (f16 device arrays, checked by the caller): ``kv_width``
    columns each, the same shape, apart."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.shape[1] != kv_width:
            raise ValueError(f"{name} must have {kv_width} columns (n_head_kv*head_dim), "
                             f"got shape {tuple(c.shape)}")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    checks.check_no_overlap(k_cache=k_cache, v_cache=v_cache)


def check_rope_targets(be, spec: RopeSpec, m: int, q_norm, k_norm, inv_freq, pos, rows, q_out, k_cache, v_cache):
    """The arrays the q/k norm + RoPE + scatter reads and writes, for ``m`` rows (shared by
    ``QkvNormRope`` and the fused qkv GEMM): raises naming the first bad one."""
    d = spec.head_dim
    for name, a, dt in (("q_norm", q_norm, np.float32), ("k_norm", k_norm, np.float32),
                        ("inv_freq", inv_freq, np.float64), ("pos", pos, np.int32), ("rows", rows, np.int32)):
        checks.device_array(be, name, a, dt, ndim=1)
    checks.device_array(be, "q_out", q_out, np.float32, ndim=2)
    checks.device_array(be, "k_cache", k_cache, np.float16, ndim=2)
    checks.device_array(be, "v_cache", v_cache, np.float16, ndim=2)
    for name, a in (("q_norm", q_norm), ("k_norm", k_norm)):
        if a.shape[0] != d:
            raise ValueError(f"{name} must have shape ({d},), got {tuple(a.shape)}")
    if inv_freq.shape[0] != d // 2:
        raise ValueError(f"inv_freq must have shape ({d // 2},), got {tuple(inv_freq.shape)}")
    for name, a in (("pos", pos), ("rows", rows)):
        if a.shape[0] < m:
            raise ValueError(f"{name} has {a.shape[0]} rows, fewer than m={m}")
    if q_out.shape[1] != spec.q_width or q_out.shape[0] < m:
        raise ValueError(f"q_out must have shape [>= {m}, {spec.q_width}], got {tuple(q_out.shape)}")
    check_kv_caches(spec.kv_width, k_cache, v_cache)
    checks.check_no_overlap(q_out=q_out, k_cache=k_cache)
    checks.check_no_overlap(q_out=q_out, v_cache=v_cache)


class QkvNormRope:
    """``QkvNormRope(backend, head_dim, n_head, n_head_kv, has_q, eps=1e-6, attn_scale_factor=1.0)``.

    ``__call__(qkv, k_norm, inv_freq, pos, rows, k_cache, v_cache, q_norm=None,
    q_out=None, n_rows=None, stream=None)``:

    * ``qkv [>= n_rows, qkv_width] f32``; ``q_norm``/``k_norm [head_dim] f32``;
      ``inv_freq [head_dim/2] float64``; ``pos``, ``rows [>= n_rows] int32``;
    * ``k_cache``, ``v_cache [kv_rows, n_head_kv*head_dim] f16`` (rows outside
      ``[0, kv_rows)`` are skipped by the kernel rather than written);
    * ``q_out [>= n_rows, n_head*head_dim] f32`` and ``q_norm`` only with ``has_q``.

    ``n_rows`` defaults to ``qkv.shape[0]`` (a bulk-append chunk may use a
    prefix of a larger buffer). No allocation, no host sync: capture-safe.
    """

    def __init__(self, backend, head_dim: int, n_head: int, n_head_kv: int, has_q: bool,
                 eps: float = 1e-6, attn_scale_factor: float = 1.0):
        self.backend = backend
        self.D = checks.int_arg(head_dim, "head_dim", 1)
        self.NH = checks.int_arg(n_head, "n_head", 1)
        self.NKV = checks.int_arg(n_head_kv, "n_head_kv", 1)
        if self.D % 2:
            raise ValueError(f"head_dim must be even for rotate_half RoPE, got {head_dim}")
        if not isinstance(has_q, (bool, np.bool_)):
            raise TypeError(f"has_q must be a bool, got {has_q!r}")
        self.has_q = bool(has_q)
        self.eps = checks.float_arg(eps, "eps")
        if not self.eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        self.attn_scale_factor = checks.float_arg(attn_scale_factor, "attn_scale_factor")
        if not np.isfinite(self.attn_scale_factor):
            raise ValueError(f"attn_scale_factor must be finite, got {attn_scale_factor!r}")
        self.q_width = self.NH * self.D if self.has_q else 0
        self.kv_width = self.NKV * self.D
        self.qkv_width = self.q_width + 2 * self.kv_width
        self._module = kernels.load_module(backend, "rope.cu", D=self.D, NH=self.NH, NKV=self.NKV,
                                           HAS_Q=self.has_q, ROPE_THREADS=THREADS)
        self._kernel = self._module.get_function("qkv_norm_rope")
        # without q the kernel's q_out is never written; it still needs an array of its own
        # (a shared one, e.g. a weight, would look written to the stream-hazard checks)
        self._no_q = None if self.has_q else backend.zeros((1, 1), np.float32)

    def __repr__(self):
        return (f"QkvNormRope(head_dim={self.D}, n_head={self.NH}, n_head_kv={self.NKV}, "
                f"has_q={self.has_q}, eps={self.eps}, attn_scale_factor={self.attn_scale_factor})")

    def __call__(self, qkv, k_norm, inv_freq, pos, rows, k_cache, v_cache, q_norm=None,
                 q_out=None, n_rows=None, stream=None, tile_live=None):
        """``tile_live`` (device int32 ``[>= ceil(n_rows/16)]``, read when the kernel runs):
        the rows of a tile marked 0 are skipped (nothing written), those of a tile marked 2
        (a lane batch's context rows) skip their Q heads; ``None``: every row, every head."""
        be = self.backend
        checks.device_array(be, "qkv", qkv, np.float32, ndim=2)
        checks.device_array(be, "k_norm", k_norm, np.float32, ndim=1)
        checks.device_array(be, "inv_freq", inv_freq, np.float64, ndim=1)
        checks.device_array(be, "pos", pos, np.int32, ndim=1)
        checks.device_array(be, "rows", rows, np.int32, ndim=1)
        checks.device_array(be, "k_cache", k_cache, np.float16, ndim=2)
        checks.device_array(be, "v_cache", v_cache, np.float16, ndim=2)
        if qkv.shape[1] != self.qkv_width:
            raise ValueError(f"qkv must have {self.qkv_width} columns "
                             f"({'Q|' if self.has_q else ''}K|V), got shape {tuple(qkv.shape)}")
        if k_norm.shape[0] != self.D:
            raise ValueError(f"k_norm must have shape ({self.D},), got {tuple(k_norm.shape)}")
        if inv_freq.shape[0] != self.D // 2:
            raise ValueError(f"inv_freq must have shape ({self.D // 2},), got {tuple(inv_freq.shape)}")
        check_kv_caches(self.kv_width, k_cache, v_cache)
        n_rows = qkv.shape[0] if n_rows is None else checks.int_arg(n_rows, "n_rows")
        for name, a in (("qkv", qkv), ("pos", pos), ("rows", rows)):
            if a.shape[0] < n_rows:
                raise ValueError(f"{name} has {a.shape[0]} rows, fewer than n_rows={n_rows}")
        if self.has_q:
            if q_norm is None or q_out is None:
                raise ValueError("q_norm and q_out are required when has_q=True")
            checks.device_array(be, "q_norm", q_norm, np.float32, ndim=1)
            checks.device_array(be, "q_out", q_out, np.float32, ndim=2)
            if q_norm.shape[0] != self.D:
                raise ValueError(f"q_norm must have shape ({self.D},), got {tuple(q_norm.shape)}")
            if q_out.shape[1] != self.q_width or q_out.shape[0] < n_rows:
                raise ValueError(f"q_out must have shape [>= {n_rows}, {self.q_width}], "
                                 f"got {tuple(q_out.shape)}")
            for name, a in (("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache)):
                checks.check_no_overlap(q_out=q_out, **{name: a})
        else:
            if q_norm is not None or q_out is not None:
                raise ValueError("q_norm / q_out given but has_q=False")
            q_norm = k_norm       # never read
            q_out = self._no_q    # never written: the op's own placeholder, not a shared array

        if tile_live is not None:
            checks.tile_flags(be, tile_live, n_rows, "n_rows")
        if n_rows == 0:
            return
        self._kernel((n_rows, 1, 1), (THREADS, 1, 1),
                     (qkv, q_norm, k_norm, inv_freq, pos, rows, q_out, k_cache, v_cache,
                      np.int32(n_rows), np.int32(k_cache.shape[0]), np.float32(self.eps),
                      np.float32(self.attn_scale_factor), pos if tile_live is None else tile_live,
                      np.int32(tile_live is not None)), stream=stream)


def qkv_norm_rope_reference(qkv, q_norm, k_norm, inv_freq, pos, *, head_dim: int, n_head: int,
                            n_head_kv: int, has_q: bool, eps: float = 1e-6,
                            attn_scale_factor: float = 1.0):
    """NumPy oracle of ``QkvNormRope`` in float64 from the f32 inputs.

    Returns ``(q [M, n_head*d] float32 or None, k [M, n_head_kv*d] float16,
    v [M, n_head_kv*d] float16)``: rounded where the kernel rounds (Q stored
    f32, K and V stored f16). Angles ``pos * inv_freq`` in float64 exactly as
    the kernel forms them (``np.cos`` reduces large float64 arguments exactly).
    """
    d, nh, nkv = int(head_dim), int(n_head), int(n_head_kv)
    x = np.asarray(qkv, dtype=np.float32).astype(np.float64)
    M = x.shape[0]
    qw = nh * d if has_q else 0
    if x.shape[1] != qw + 2 * nkv * d:
        raise ValueError(f"qkv: {x.shape[1]} columns, expected {qw + 2 * nkv * d}")
    inv = np.asarray(inv_freq, dtype=np.float64)
    ang = np.asarray(pos, dtype=np.int64).astype(np.float64)[:, None] * inv[None, :]
    cos = (np.cos(ang) * attn_scale_factor)[:, None, :]
    sin = (np.sin(ang) * attn_scale_factor)[:, None, :]
    half = d // 2

    def norm_rope(h, w):  # h [M, heads, d]
        h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)
        a, b = h[..., :half], h[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    q = None
    if has_q:
        q = norm_rope(x[:, :qw].reshape(M, nh, d), q_norm).reshape(M, qw).astype(np.float32)
    k = norm_rope(x[:, qw:qw + nkv * d].reshape(M, nkv, d), k_norm)
    k = k.reshape(M, nkv * d).astype(np.float16)
    v = x[:, qw + nkv * d:].astype(np.float16)
    return q, k, v

