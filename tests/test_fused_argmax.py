"""The lm_head GEMM with the greedy token fused (Gemm epilogue "argmax", the
stream path): per column block the best column into partials, reduced by
TokenSampler.reduce_partials to the argmax of the full logits row (ties to
the lowest id, NaN lowest), with or without writing the logits."""
import ml_dtypes
import numpy as np
import pytest

from dflash_cupy import dtypes
from dflash_cupy.ops.gemm import Gemm, gemm_reference
from dflash_cupy.ops.sample import TokenSampler
from tests.support.gemm import host_weights


def _run(backend, xh, wh, N, K, m, logits, wdtype="bf16"):
    op = Gemm(backend, N, K, wdtype, "argmax", max_m=64, logits=logits)
    x, w = backend.asarray(xh), backend.asarray(wh)
    part = backend.zeros(op.partials_shape(m), np.uint32)
    y = backend.zeros((m, N), np.float32) if logits else None
    op(x, w, y, m, partials=part)
    tok = backend.zeros((m,), np.int32)
    TokenSampler(backend, N).reduce_partials(part, tok, m)
    return op, backend.to_numpy(tok), (backend.to_numpy(y) if logits else None)


@pytest.mark.parametrize("N,K,m", [(1000, 64, 3), (300, 136, 19), (37, 40, 1), (2053, 128, 33)])
@pytest.mark.parametrize("logits", [False, True])
def test_fused_argmax_is_the_argmax_of_the_logits(backend, rng, N, K, m, logits):
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, N, K, "bf16")
    wh[N // 2] = wh[N // 5]                       # a duplicated row: ties go to the lower id
    op, tok, y = _run(backend, xh, wh, N, K, m, logits)
    ref = gemm_reference(xh, wh, x_round=op.x_round)
    want = np.argmax(ref, axis=1)
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0] > 1e-3) | (want == N // 5)  # unambiguous, or the exact tie
    np.testing.assert_array_equal(tok[clear], want[clear])
    if logits:  # the logits it wrote are the GEMM's, and the token is their argmax exactly
        plain = Gemm(backend, N, K, "bf16", max_m=64)
        yp = backend.zeros((m, N), np.float32)
        plain(backend.asarray(xh), backend.asarray(wh), yp, m)
        np.testing.assert_array_equal(y, backend.to_numpy(yp))
        np.testing.assert_array_equal(tok, np.argmax(y, axis=1))


def test_ties_across_column_blocks(backend, rng):
    N, K, m = 600, 64, 2
    xh = np.zeros((m, K), np.float32)
    xh[:, 0] = 1.0
    wh = np.zeros((N, K), np.float32)
    wh[[10, 300, 599], 0] = 2.0                   # three equal maxima in different column blocks
    wbits = dtypes.device_bits(wh.astype(ml_dtypes.bfloat16))
    _, tok, y = _run(backend, xh, wbits, N, K, m, True)
    assert (tok == 10).all()
    assert (y[:, [10, 300, 599]] == 2.0).all()


def test_argmax_needs_the_stream_path_and_partials(backend):
    with pytest.raises(ValueError, match="argmax' needs the 'stream' path"):
        Gemm(backend, 64, 64, "f32", "argmax")
    op = Gemm(backend, 64, 64, "bf16", "argmax", logits=False)
    x, w = backend.zeros((4, 64), np.float32), backend.zeros((64, 64), np.uint16)
    with pytest.raises(ValueError, match="partials is required"):
        op(x, w, None, 4)
    with pytest.raises(ValueError, match="partials must have shape"):
        op(x, w, None, 4, partials=backend.zeros((4, 9, 2), np.uint32))
    with pytest.raises(ValueError, match="y must be None"):
        op(x, w, backend.zeros((4, 64), np.float32), 4, partials=backend.zeros(op.partials_shape(4), np.uint32))
    with pytest.raises(ValueError, match="partials given"):
        Gemm(backend, 64, 64, "bf16")(x, w, backend.zeros((4, 64), np.float32), 4,
                                      partials=backend.zeros((4, 1, 2), np.uint32))
