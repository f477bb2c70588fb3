"""Recorded launches for the cost-model tests (``profiling.step_trace``): array
references by shape and dtype, and a gemm_stream launch as ``StreamKernels``
plans it."""
import numpy as np

from profiling.step_trace import ArrayRef, Launch


def arr(name, shape, dtype):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return ArrayRef(name, tuple(shape), np.dtype(dtype).name, n, 0)


def gs_launch(M, N, K, epi=0, split=2, ks=None):
    """A gemm_stream launch as ``StreamKernels`` makes it (the launcher's ``plan``)."""
    from dflash_cupy.ops import gemm_stream as gs
    nw = 2 if epi == 2 else 1
    p = gs.plan(N, K, M, nw, split, ks=ks)
    d = dict(GS_WTYPE=2, GS_EPI=epi, GS_K=K, GS_MT=p.mt, GS_NT=4 // nw, GS_WARPS=8, GS_SPLIT=split,
             GS_DEPTH=gs.DEPTH[p.mt])
    # the first arguments by name (Launch.params reads a dict as the recording's names); a
    # test adds the others it needs
    args = [dict(x=arr("x", (M, K), np.float32), w=arr("w", (nw * N, K), np.uint16),
                 y=arr("y", (M, N), np.float32), r=arr("y", (M, N), np.float32), M=M, N=N, kz=p.kz, kt=p.kt,
                 ws=arr("ws", (1,), np.float32), counters=arr("cnt", (1,), np.int32),
                 pad_lo=arr("cnt", (1,), np.int32), pad_hi=0)]
    return Launch("gemm_stream", "gemm_stream.cu", d, p.grid, (256, 1, 1), p.smem, args), p
