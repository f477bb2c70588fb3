"""RMSNorm over rows (``cuda_src/norm.cu``) and its NumPy reference.

``y[r] = x[r] / sqrt(mean(x[r]**2) + eps) * w[r % w_rows]`` for rows of width
``D``. ``x`` may be any C-contiguous f32 array whose last axis is a multiple of
``D``: it is viewed as ``[x.size // D, D]`` rows, so the aux hidden norms
take ``[M, n_cap*H]`` with ``D = H`` and a weight table ``[n_cap, H]``. (The
per-head q/k norms are fused into ``rope.cu``.) ``out_kind="f16"`` / ``"bf16"``: ``y``
holds the f32 result rounded once to that type (device layout, ``dtypes.DEVICE``), the
input of a GEMM built with ``x16=True``.
"""
from __future__ import annotations

import numpy as np

from .. import checks, dtypes, kernels

MAX_TPR = 1024      # threads per row at most (one block)
CHUNKS_PER_THREAD = 4  # target register chunks per thread before widening the row group


def norm_threads(D: int) -> int:
    """Threads per row of ``rmsnorm`` (NORM_TPR) for rows of width ``D``: about
    ``CHUNKS_PER_THREAD`` chunks of 4 (or 1) each. Its sums of squares depend on it, so a
    kernel that reproduces them bit for bit (conv.cu's ``grouped_conv_norm``) takes it too."""
    chunks = D // (4 if D % 4 == 0 else 1)
    want = -(-chunks // CHUNKS_PER_THREAD)
    return min(MAX_TPR, max(32, -(-want // 32) * 32))


class RmsNorm:
    """``RmsNorm(backend, D, eps=1e-6, out_kind=None)``; ``__call__(x, w, y, rows=None, stream=None)``.

    ``w``: f32 ``[D]`` or ``[w_rows, D]`` (row ``r`` uses ``w[r % w_rows]``).
    ``y``: same shape as ``x``: f32 (may be ``x`` itself), or with ``out_kind``
    "f16" / "bf16" that type's device dtype (never ``x``). ``rows``: normalise
    only the first ``rows`` D-wide rows (default: all). Capture-safe.
    """

    def __init__(self, backend, D: int, eps: float = 1e-6, out_kind: str | None = None):
        D = checks.int_arg(D, "D", 1)
        eps = checks.float_arg(eps, "eps")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        kind = None if out_kind is None else dtypes.kind_of(out_kind, "out_kind")
        self.out_kind = None if kind == "f32" else kind
        self.y_dtype = dtypes.DEVICE[self.out_kind or "f32"]
        self.backend = backend
        self.D = int(D)
        self.eps = eps
        self.vec = 4 if self.D % 4 == 0 else 1
        self.tpr = norm_threads(self.D)
        self.block = self.tpr * max(1, 128 // self.tpr)   # whole rows per block (tpr 96: one)
        self.rows_per_block = self.block // self.tpr
        self._module = kernels.load_module(backend, "norm.cu", NORM_D=self.D, NORM_TPR=self.tpr,
                                           NORM_BLOCK=self.block,
                                           **({"NORM_Y16": dtypes.CODE[self.out_kind]} if self.out_kind else {}))
        self._kernel = self._module.get_function("rmsnorm")
        self._no_live = backend.zeros((1,), np.int32)   # tile_live's placeholder (never read)

    def __repr__(self):
        out = f", out_kind={self.out_kind!r}" if self.out_kind else ""
        return f"RmsNorm(D={self.D}, eps={self.eps}, tpr={self.tpr}, block={self.block}{out})"

    def bytes_moved(self, rows: int, w_rows: int = 1) -> int:
        return (rows * (4 + self.y_dtype.itemsize) + w_rows * 4) * self.D

    def __call__(self, x, w, y, rows=None, stream=None, tile_live=None):
        """``tile_live`` (device int32 ``[>= ceil(rows/16)]``, read when the kernel runs): rows
        of a tile marked 0 are skipped, ``y`` untouched there (a lane batch's dead rows)."""
        be = self.backend
        D = self.D
        for name, a, dt in (("x", x, np.float32), ("w", w, np.float32), ("y", y, self.y_dtype)):
            checks.device_array(be, name, a, dt, ndim=None)
        if x.ndim < 1 or x.shape[-1] % D:
            raise ValueError(f"x's last axis must be a multiple of D={D}, got shape {tuple(x.shape)}")
        if tuple(y.shape) != tuple(x.shape):
            raise ValueError(f"y must have x's shape {tuple(x.shape)}, got {tuple(y.shape)}")
        if w.ndim == 1 and w.shape[0] == D:
            w_rows = 1
        elif w.ndim == 2 and w.shape[1] == D and w.shape[0] >= 1:
            w_rows = w.shape[0]
        else:
            raise ValueError(f"w must have shape [{D}] or [w_rows, {D}], got {tuple(w.shape)}")
        total = x.size // D
        rows = total if rows is None else checks.int_arg(rows, "rows")
        if rows > total:
            raise ValueError(f"rows={rows} must be in [0, {total}] (x holds {total} rows of {D})")
        if checks.overlaps(x, y) and (self.out_kind or checks.ptr(x) != checks.ptr(y)):
            raise ValueError("y must not overlap x (16-bit y)" if self.out_kind else
                             "y must be x itself or not overlap it")
        checks.check_no_overlap(y=y, w=w)
        if self.vec == 4:
            checks.aligned16(x=x, w=w, y=y)
        if tile_live is not None:
            checks.tile_flags(be, tile_live, rows)
        if rows == 0:
            return
        grid = (-(-rows // self.rows_per_block), 1, 1)
        self._kernel(grid, (self.block, 1, 1),
                     (x, w, y, np.int32(rows), np.int32(w_rows), np.float32(self.eps),
                      self._no_live if tile_live is None else tile_live, np.int32(tile_live is not None)),
                     stream=stream)


def rmsnorm_reference(x, w, D: int | None = None, eps: float = 1e-6) -> np.ndarray:
    """NumPy oracle for ``RmsNorm``: rows of width ``D`` (default ``w.shape[-1]``),
    weight row ``r % w_rows``, computed in float64 from the f32 inputs and rounded
    once to float32."""
    w = np.asarray(w, dtype=np.float32).astype(np.float64)
    D = w.shape[-1] if D is None else int(D)
    w = w.reshape(-1, D)
    x = np.asarray(x, dtype=np.float32)
    rows = x.astype(np.float64).reshape(-1, D)
    inv = 1.0 / np.sqrt(np.mean(rows * rows, axis=1, keepdims=True) + eps)
    wr = w[np.arange(rows.shape[0]) % w.shape[0]]
    return (rows * inv * wr).astype(np.float32).reshape(x.shape)
