"""GEMM set-ups shared by the GEMM test modules: weights in their storage dtype, one
checked ``Gemm`` call (``run``), tile_live flag arrays, the wgmma kernel's unused
trailing arguments, and the qkv-epilogue inputs."""
import ml_dtypes
import numpy as np

from dflash_cupy.ops.gemm import Gemm, gemm_reference
from tests.support.rope import plain_table
from tests.support.tolerances import assert_close

SENTINEL = np.float32(7.5)


def host_weights(rng, rows, K, wkind):
    """Weights scaled so results are O(1), in their device storage dtype."""
    w = (rng.standard_normal((rows, K)) / np.sqrt(K)).astype(np.float32)
    if wkind == "f16":
        return w.astype(np.float16)
    if wkind == "bf16":
        return w.astype(ml_dtypes.bfloat16).view(np.uint16)
    return w


def run(backend, rng, *, N, K, wkind, epilogue, m, max_m=64, x_rows=None, in_place=False, path="auto",
        x_split=True, k_split=None, config=None, wgmma=None):
    op = Gemm(backend, N, K, wkind, epilogue=epilogue, max_m=max_m, path=path, x_split=x_split,
              k_split=k_split, wgmma=wgmma)
    if config is not None:   # a launch configuration of the stream path (e.g. a wgmma variant)
        op.use_config(m, config)
    x_rows = m if x_rows is None else x_rows
    xh = rng.standard_normal((x_rows, K)).astype(np.float32)
    wh = host_weights(rng, 2 * N if epilogue == "silu_mul" else N, K, wkind)
    y0 = np.full((x_rows, N), 7.5, np.float32)   # rows >= m must keep this
    rh = rng.standard_normal((x_rows, N)).astype(np.float32) if epilogue == "residual" else None
    x, w = backend.asarray(xh), backend.asarray(wh)
    if in_place:
        y = backend.asarray(rh)
        op(x, w, y, m, residual=y)
    else:
        y = backend.asarray(y0)
        op(x, w, y, m, residual=None if rh is None else backend.asarray(rh))
    got = backend.to_numpy(y)
    ref = gemm_reference(xh[:m], wh, epilogue, None if rh is None else rh[:m], x_round=op.x_round)
    what = f"{op!r} m={m}"
    assert_close(got[:m], ref, "f32", what)
    tail = rh[m:] if in_place else y0[m:]
    np.testing.assert_array_equal(got[m:], tail, err_msg=f"{what}: rows >= m were written")
    return op


def tile_flags(rng, m, force_dead_block=False):
    """One flag per 16-row tile: random, with at least one live and one dead tile;
    ``force_dead_block``: the first 64-row block all dead (the block exits early)."""
    n = -(-m // 16)
    f = rng.integers(0, 2, n).astype(np.int32) * rng.integers(1, 5, n).astype(np.int32)  # any nonzero is live
    f[rng.integers(0, n)] = 0
    f[rng.integers(0, n)] = 3
    if force_dead_block and n > 4:
        f[:4] = 0
    return f


def live_rows(flags, m):
    return np.repeat(flags != 0, 16)[:m]


def counters_zero(backend, op):
    cnt = backend.to_numpy(op._counters)
    assert cnt.size >= max(op._stream.plan(m).grid[0] for m in (1, op.max_m)) and not cnt.any(), cnt.tolist()


def by_field(kernel, flat) -> tuple:
    """A stream GEMM's launch arguments from ``flat``, given in the order of its parameters
    (gemm_wgmma: of its struct's fields, GemmWgmmaParams), as the launcher passes them
    (``gemm_stream.launch_args``: the struct by field name)."""
    from dflash_cupy.ops.gemm_stream import launch_args
    sig = kernel.sig.params
    names = [f.name for f in sig[0].fields] if len(sig) == 1 and sig[0].is_struct else [p.name for p in sig]
    if len(flat) != len(names):
        raise ValueError(f"{kernel.name}: {len(flat)} values for {len(names)} parameters")
    return launch_args(kernel, dict(zip(names, flat)))


def no_rope(sk):
    """The wgmma kernel's trailing qkv-epilogue arguments (GW_EPI 3 only reads them), as
    StreamKernels passes them to the other epilogues."""
    return (sk._ws, sk._ws, sk._no_freq, sk._counters, sk._counters, sk._no_kv, sk._no_kv, np.int32(0),
            np.float32(0.0), np.float32(1.0))


def no_conv(sk):
    """gemm_stream.cu's trailing GS_CONV arguments (base, out, lane_rows 0: off) and GS_FIN's
    (base, d, lane_rows 0: off), as StreamKernels passes them to every gemm_stream launch."""
    return (sk._ws, sk._ws, np.int32(0), sk._ws, sk._ws, np.int32(0))


def qkv_setup(be, rng, spec, K, m, wkind, kv_rows, x16=False):
    N = spec.q_width + 2 * spec.kv_width
    xh = rng.standard_normal((m, K)).astype(np.float32)
    if x16:   # x stored in the weight type: the values a single-rounding GEMM reads
        xh = xh.astype(ml_dtypes.bfloat16 if wkind == "bf16" else np.float16)
        xd = be.asarray(xh.view(np.uint16) if wkind == "bf16" else xh)
    else:
        xd = be.asarray(xh)
    wh = host_weights(rng, N, K, wkind)
    # positions up to past 2^30 (the angle reduction), rows: a ring's slots in a scrambled
    # order (wrapped), a few out of [0, kv_rows) that must be skipped
    pos = rng.integers(0, 2**31 - 200, m).astype(np.int32)
    pos[:4] = [0, 1, 2**20, 2**20 + 12345]
    rows = rng.permutation(kv_rows)[:m].astype(np.int32) if m <= kv_rows else \
        rng.integers(0, kv_rows, m).astype(np.int32)
    rows[5] = -1
    rows[6] = kv_rows
    d = dict(x=xd, w=be.asarray(wh), pos=be.asarray(pos), rows=be.asarray(rows),
             qn=be.asarray(rng.uniform(0.5, 1.5, spec.head_dim).astype(np.float32)),
             kn=be.asarray(rng.uniform(0.5, 1.5, spec.head_dim).astype(np.float32)),
             freq=be.asarray(plain_table(spec.head_dim)),
             ln=be.asarray(rng.uniform(0.5, 1.5, K).astype(np.float32)),
             k0=rng.standard_normal((kv_rows, spec.kv_width)).astype(np.float16),
             v0=rng.standard_normal((kv_rows, spec.kv_width)).astype(np.float16), N=N)
    return d
