"""The GEMM variants the NVRTC checks compile (``tests/test_nvrtc.py``,
``tests/test_launch_limits.py``): each a ``GemmVariant`` and a launch of it, whose ``-D``
options come from the variant's own ``stream_defines`` / ``wgmma_defines``, the options
the launcher compiles: a check and a launch cannot drift apart."""
from __future__ import annotations

from dflash_cupy import kernels
from dflash_cupy.ops.gemm_stream import GemmVariant as V

# (variant, M tiles) of gemm_stream.cu: every epilogue, both weight types, the three M
# variants, a short K, hi + lo or not, the folded norm, 16-bit x and y
STREAM = [
    (V(256, 4096, 'bf16', 'none'), 1),
    (V(256, 4096, 'bf16', 'none'), 2),
    (V(256, 4096, 'bf16', 'none'), 4),
    (V(256, 12288, 'bf16', 'residual'), 4),
    (V(256, 4096, 'bf16', 'silu_mul'), 1),
    (V(256, 5120, 'bf16', 'silu_mul'), 4),
    (V(256, 5120, 'f16', 'silu_mul', split=1), 4),
    (V(256, 40, 'f16', 'residual'), 2),
    (V(256, 4096, 'bf16', 'argmax', logits=False), 1),
    (V(256, 5120, 'f16', 'argmax', logits=True), 2),
    (V(256, 5120, 'bf16', 'topk', logits=False, top_k=16), 1),
    (V(256, 6656, 'bf16', 'topk', logits=False, top_k=16), 4),
    (V(256, 40, 'f16', 'topk', logits=True, top_k=64), 2),
    (V(256, 4096, 'bf16', 'none', norm=True), 4),
    (V(256, 4096, 'bf16', 'silu_mul', norm=True), 1),
    (V(256, 12288, 'bf16', 'silu_mul', split=1, x16=True), 4),
    (V(256, 4096, 'bf16', 'residual', split=1, x16=True), 2),
    (V(256, 4096, 'f16', 'silu_mul', split=1, norm=True, x16=True), 4),
    (V(256, 4096, 'bf16', 'none', split=1, norm=True, x16=True), 1),
    (V(256, 4096, 'bf16', 'silu_mul', split=1, norm=True, y16=True), 4),
    (V(256, 4096, 'f16', 'silu_mul', y16=True), 1),
    (V(1280, 5120, 'bf16', 'none', conv=(2, 16)), 1),     # DFlash 2's kernel_projection + prepare
    (V(1664, 6656, 'bf16', 'none', conv=(2, 16)), 4),
    (V(800, 200, 'f16', 'none', conv=(4, 2)), 2),        # scalar channels, 4 taps
    (V(1280, 5120, 'bf16', 'none', norm=True, conv=(2, 16)), 1),   # layer 0: its input norm folded too
    (V(1280, 5120, 'bf16', 'none', norm=True, conv=(2, 16)), 2),
    (V(5120, 4096, 'bf16', 'residual', finish=(2, 16)), 1),   # DFlash 2's o / down + finish
    (V(6656, 17920, 'bf16', 'residual', split=1, x16=True, finish=(2, 16)), 4),
    (V(288, 128, 'f16', 'residual', finish=(4, 8)), 2),      # 4 taps, a partial column block
]

# (variant, row block, wgmma_defines options) of gemm_wgmma.cu: also the lane batches' live
# split and column skip, and the qkv epilogue
WGMMA = [
    (V(256, 4096, 'bf16', 'none', split=1), 128, dict()),
    (V(256, 4096, 'bf16', 'silu_mul', split=1, norm=True), 128, dict()),
    (V(256, 12288, 'bf16', 'residual'), 128, dict()),
    (V(256, 4096, 'f16', 'none', norm=True), 64, dict()),
    (V(256, 5120, 'bf16', 'silu_mul'), 64, dict()),
    (V(256, 4096, 'bf16', 'none', norm=True), 128, dict(sms=132, skip_cols=4096)),
    (V(256, 4096, 'bf16', 'silu_mul', split=1, norm=True, x16=True, y16=True), 64, dict(sms=132)),
    (V(256, 4096, 'bf16', 'silu_mul', split=1, x16=True), 128, dict()),
    (V(256, 12288, 'bf16', 'residual', split=1, x16=True), 64, dict()),
    (V(256, 4096, 'f16', 'silu_mul', split=1, norm=True, x16=True), 128, dict()),
    (V(256, 4096, 'bf16', 'silu_mul', split=1, norm=True, y16=True), 128, dict()),
    (V(256, 4096, 'f16', 'silu_mul', y16=True), 64, dict()),
    (V(256, 4096, 'bf16', 'none', norm=True, rope=(128, 4096, 1024)), 128, dict(qkv=True)),
    (V(256, 4096, 'bf16', 'none', norm=True, rope=(128, 4096, 1024)), 64, dict(qkv=True)),
    (V(256, 5120, 'bf16', 'none', split=1, norm=True, rope=(128, 4096, 1024)), 128,
     dict(sms=132, skip_cols=4096, qkv=True)),
    (V(256, 4096, 'f16', 'none', split=1, x16=True, rope=(64, 2048, 512)), 64, dict(qkv=True)),
]


def _opts(defines: dict) -> tuple[str, ...]:
    return tuple(o for o in kernels.compile_options(**defines) if o.startswith("-D"))


def option_sets(filename: str) -> list[tuple[str, ...]]:
    """The ``-D`` option sets checked for kernel file ``filename`` (none for other files)."""
    if filename == "gemm_stream.cu":
        return [_opts(v.stream_defines(mt)) for v, mt in STREAM]
    if filename == "gemm_wgmma.cu":
        return [_opts(v.wgmma_defines(bt, **kw)) for v, bt, kw in WGMMA]
    return []
