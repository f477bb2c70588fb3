"""DFlash 2's grouped dynamic convolution (``cuda_src/conv.cu``, SPEC §6) and its NumPy
reference.

``y[r, c] = res[r, c] + sum_{t < taps, i - t >= 0} (base[t, c] + d[r, (half*taps + t)*G + c // group])
* x[r - t, c]`` with ``i = r % lane_rows`` (each lane's block is its own sequence: a tap
before its first row reads zero). ``half`` 0 is the "prepare" convolution of a sublayer's
normed input, half 1 the "finish" convolution of its output (with the residual added).
``GroupedConv(..., norm_eps=eps).finish_norm`` fuses a finish with the RMSNorm of its output
(``grouped_conv_norm``: that norm's output as ``RmsNorm`` computes it, bit for bit).
``layout="group"``: ``d``'s columns ``[group][half][tap]`` instead of the published
``[half][tap][group]`` (the kernel_projection's rows permuted by ``group_major_rows``, so that a
GEMM column block holds whole groups, both halves: ``Gemm(conv=...)`` fuses "prepare" into
that GEMM, every column block taking its share).
"""
from __future__ import annotations

import numpy as np

from .. import checks, kernels
from .norm import norm_threads

THREADS = 128
LAYOUTS = ("tap", "group")   # d's columns: [half][tap][group] (published) or [group][half][tap]


def group_major_rows(taps: int, groups: int) -> np.ndarray:
    """The row order that turns a kernel_projection ``[2*taps*groups, H]`` (rows
    ``[half][tap][group]``) into ``layout="group"``'s ``[group][half][tap]``: ``W[perm]``."""
    g, h, t = np.meshgrid(np.arange(groups), np.arange(2), np.arange(taps), indexing="ij")
    return ((h * taps + t) * groups + g).reshape(-1)


def d_column(half, tap, group, taps: int, groups: int, layout: str = "tap"):
    """``d``'s column of ``(half, tap, group)`` in ``layout``."""
    if layout == "group":
        return (group * 2 + half) * taps + tap
    return (half * taps + tap) * groups + group


class GroupedConv:
    """``GroupedConv(backend, hidden, taps, group_size)``;
    ``__call__(x, base, d, half, y, residual=None, lane_rows=None, tile_live=None, stream=None)``.

    ``x``, ``y`` (and ``residual``) f32 ``[rows, hidden]``; ``base`` f32 ``[taps, hidden]`` (one
    half of the checkpoint's ``base_kernel``); ``d`` f32 ``[rows, 2*taps*G]``; ``lane_rows``
    (default ``rows``): rows per lane block. ``y`` may be ``residual`` itself, never ``x``.
    ``tile_live``: rows of a 16-row tile marked 0 are skipped. Capture-safe.
    ``norm_eps``: also compile ``finish_norm`` (the finish fused with an RMSNorm of that eps).
    ``layout``: ``d``'s column order, ``"tap"`` (published) or ``"group"`` (module docstring)."""

    def __init__(self, backend, hidden: int, taps: int, group_size: int, norm_eps: float | None = None,
                 layout: str = "tap"):
        self.backend = backend
        self.hidden = checks.int_arg(hidden, "hidden", 1)
        self.taps = checks.int_arg(taps, "taps", 1)
        self.group_size = checks.int_arg(group_size, "group_size", 1)
        if self.hidden % self.group_size:
            raise ValueError(f"group_size={group_size} must divide hidden={hidden}")
        self.groups = self.hidden // self.group_size
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
        self.layout = layout
        self.norm_eps = None
        if norm_eps is not None:
            self.norm_eps = checks.float_arg(norm_eps, "norm_eps")
            if not self.norm_eps >= 0.0:
                raise ValueError(f"norm_eps must be >= 0, got {norm_eps!r}")
        self.norm_tpr = norm_threads(self.hidden)   # rmsnorm's threads per row (its sums' order)
        module = kernels.load_module(backend, "conv.cu", CONV_H=self.hidden, CONV_TAPS=self.taps,
                                     CONV_GROUP=self.group_size, CONV_THREADS=THREADS, CONV_NORM_TPR=self.norm_tpr,
                                     **({"CONV_GMAJOR": 1} if layout == "group" else {}))
        self._kernel = module.get_function("grouped_conv")
        self._norm_kernel = None if norm_eps is None else module.get_function("grouped_conv_norm")
        self._no_live = backend.zeros((1,), np.int32)   # tile_live's placeholder (never read)

    def __repr__(self):
        norm = "" if self.norm_eps is None else f", norm_eps={self.norm_eps}"
        lay = "" if self.layout == "tap" else f", layout={self.layout!r}"
        return f"GroupedConv(hidden={self.hidden}, taps={self.taps}, group_size={self.group_size}{norm}{lay})"

    def __call__(self, x, base, d, half: int, y, residual=None, lane_rows=None, tile_live=None, stream=None):
        rows, lane_rows = self._check(x, base, d, half, y, residual, lane_rows, tile_live)
        if rows == 0:
            return
        self._kernel((-(-self.hidden // THREADS), rows, 1), (THREADS, 1, 1),
                     (x, base, d, np.int32(half), y if residual is None else residual,
                      np.int32(residual is not None), y, np.int32(lane_rows),
                      self._no_live if tile_live is None else tile_live, np.int32(tile_live is not None)),
                     stream=stream)

    def finish_norm(self, x, base, d, y, residual, w, yn, lane_rows=None, tile_live=None, stream=None) -> None:
        """The finish convolution (half 1) into ``y`` = ``residual`` + conv (``y`` may be
        ``residual``), and ``yn`` = rmsnorm(``y``) * ``w`` (f32 ``[rows, hidden]`` and
        ``[hidden]``; ``yn`` overlaps none of the others) as ``RmsNorm(hidden, norm_eps)``
        computes it; rows of dead tiles leave both untouched. Needs ``norm_eps``."""
        if self._norm_kernel is None:
            raise RuntimeError("finish_norm needs a GroupedConv built with norm_eps")
        if residual is None:
            raise ValueError("finish_norm adds the residual: residual must be given")
        rows, lane_rows = self._check(x, base, d, 1, y, residual, lane_rows, tile_live)
        be, H = self.backend, self.hidden
        checks.device_array(be, "w", w, np.float32, ndim=1)
        if tuple(w.shape) != (H,):
            raise ValueError(f"w must have shape {(H,)}, got {tuple(w.shape)}")
        checks.device_array(be, "yn", yn, np.float32, ndim=2)
        if tuple(yn.shape) != tuple(x.shape):
            raise ValueError(f"yn must have shape {tuple(x.shape)}, got {tuple(yn.shape)}")
        for name, a in (("x", x), ("y", y), ("residual", residual), ("w", w), ("d", d), ("base", base)):
            if checks.overlaps(a, yn):
                raise ValueError(f"yn must not overlap {name}")
        if H % 4 == 0:   # the kernel moves 4 channels at once (norm.cu's chunks)
            checks.aligned16(x=x, base=base, residual=residual, y=y, w=w, yn=yn)
        if rows == 0:
            return
        self._norm_kernel((rows, 1, 1), (self.norm_tpr, 1, 1),
                          (x, base, d, np.int32(1), residual, y, np.int32(lane_rows), w, np.float32(self.norm_eps),
                           yn, self._no_live if tile_live is None else tile_live, np.int32(tile_live is not None)),
                          stream=stream)

    def _check(self, x, base, d, half, y, residual, lane_rows, tile_live) -> tuple:
        """Every argument check both launches share; ``(rows, lane_rows)``."""
        be, H = self.backend, self.hidden
        checks.device_array(be, "x", x, np.float32, ndim=2)
        rows = x.shape[0]
        shapes = {"x": (rows, H), "y": (rows, H), "base": (self.taps, H), "d": (rows, 2 * self.taps * self.groups)}
        args = {"x": x, "y": y, "base": base, "d": d}
        if residual is not None:
            args["residual"], shapes["residual"] = residual, (rows, H)
        for name, a in args.items():
            checks.device_array(be, name, a, np.float32, ndim=2)
            if tuple(a.shape) != shapes[name]:
                raise ValueError(f"{name} must have shape {shapes[name]}, got {tuple(a.shape)}")
        if half not in (0, 1):
            raise ValueError(f"half must be 0 (prepare) or 1 (finish), got {half!r}")
        lane_rows = rows if lane_rows is None else checks.int_arg(lane_rows, "lane_rows", 1)
        if rows % lane_rows:
            raise ValueError(f"lane_rows={lane_rows} must divide the {rows} rows")
        if checks.overlaps(x, y):
            raise ValueError("y must not overlap x (the taps read other rows of x)")
        if residual is not None and checks.overlaps(residual, y) and checks.ptr(residual) != checks.ptr(y):
            raise ValueError("y must be residual itself or not overlap it")
        checks.check_no_overlap(y=y, base=base, d=d)
        if tile_live is not None:
            checks.tile_flags(be, tile_live, rows)
        return rows, lane_rows


def grouped_conv_reference(x, base, d, half: int, group_size: int, residual=None, lane_rows=None,
                           layout: str = "tap") -> np.ndarray:
    """NumPy oracle of ``GroupedConv``, rounding where the kernel rounds: ``w = base + d`` in
    f32, then one fused multiply-add per tap in tap order (f64 product and sum of f32 values,
    rounded to f32), then the residual added in f32. ``layout``: ``d``'s column order."""
    x = np.asarray(x, np.float32)
    base = np.asarray(base, np.float32)
    d = np.asarray(d, np.float32)
    rows, H = x.shape
    taps = base.shape[0]
    G = H // group_size
    lane_rows = rows if lane_rows is None else lane_rows
    i = np.arange(rows) % lane_rows
    grp = np.arange(H) // group_size
    acc = np.zeros((rows, H), np.float32)
    for t in range(taps):
        w = (base[t][None, :] + d[:, d_column(half, t, grp, taps, G, layout)]).astype(np.float32)
        xs = np.zeros((rows, H), np.float32)
        xs[t:] = x[:rows - t] if t else x
        term = (w.astype(np.float64) * xs + acc).astype(np.float32)
        acc = np.where((i >= t)[:, None], term, acc)
    if residual is not None:
        acc = (np.asarray(residual, np.float32) + acc).astype(np.float32)
    return acc
