"""Gemm (cuda_src/gemm.cu) against gemm_reference: every weight dtype and epilogue,
awkward M/N/K (K tails included), M tiling beyond max_m, in-place residual, rows
past m untouched, and bad input."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from dflash_cupy.ops.gemm import Gemm, gemm_reference
from tests.support.gemm import host_weights, run
from tests.support.tolerances import assert_close

WKINDS = ("f32", "f16", "bf16")
EPILOGUES = ("none", "residual", "silu_mul")


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("wkind,path", [("f32", "fma"), ("f16", "fma"), ("bf16", "fma"),
                                        ("f16", "stream"), ("bf16", "stream")])
def test_dtypes_epilogues_odd_m(backend, rng, wkind, epilogue, path):
    # K=296 with max_m=64: three FMA K tiles of 128 (the last partial), a K tail
    # inside a 64-wide tensor-core step.
    for m in (1, 3, 19, 33, 64):
        op = run(backend, rng, N=37, K=296, wkind=wkind, epilogue=epilogue, m=m, x_rows=67, path=path)
        assert op.path == path and op.x_round == (wkind + "x2" if path == "stream" else None)


def test_split_k_results_repeat_bit_for_bit(backend, rng):
    N, K, m = 45, 1024, 16
    op = Gemm(backend, N, K, "bf16", max_m=16, k_split=4)
    x = backend.asarray(rng.standard_normal((m, K)).astype(np.float32))
    w = backend.asarray(host_weights(rng, N, K, "bf16"))
    outs = []
    for _ in range(3):
        y = backend.zeros((m, N), np.float32)
        op(x, w, y, m)
        outs.append(backend.to_numpy(y))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_k_split_defaults(backend):
    # few column groups and a long K: split; many column groups or a short K: not
    assert Gemm(backend, 5120, 17408, "bf16", max_m=16).k_split > 1
    assert Gemm(backend, 64, 128, "bf16", max_m=16).k_split == 1
    assert Gemm(backend, 8, 64, "f32").k_split == 1
    with pytest.raises(ValueError, match="only the 'stream' path"):
        Gemm(backend, 8, 64, "f32", k_split=2)
    with pytest.raises(ValueError, match="k_split"):
        Gemm(backend, 8, 64, "bf16", k_split=0)


def test_k_split_follows_the_device_sm_count(emu, monkeypatch):
    """The split is sized by the device's SM count (the emulator presents the H200 profile)."""
    from dflash_cupy import device_props
    assert device_props.of(emu) is device_props.H200
    h200 = Gemm(emu, 5120, 17408, "bf16", max_m=16).k_split
    # an A100's 108 SMs: 5 slices (100 blocks, one wave of its 216 slots), where the H200 takes 13
    small = dataclasses.replace(device_props.H200, sm_count=108)
    monkeypatch.setattr(device_props, "of", lambda be: small)
    assert Gemm(emu, 5120, 17408, "bf16", max_m=16).k_split < h200


@pytest.mark.parametrize("wkind,epilogue,K", [
    ("f32", "none", 19), ("f16", "none", 33), ("bf16", "none", 19),
    ("f16", "residual", 19), ("bf16", "silu_mul", 33), ("f32", "silu_mul", 131),
])
def test_k_tails(backend, rng, wkind, epilogue, K):
    # K % 4 != 0: scalar, guarded loads; N not a multiple of the block's columns.
    for m in (1, 3, 19):
        op = run(backend, rng, N=29, K=K, wkind=wkind, epilogue=epilogue, m=m, max_m=19)
        assert not op.vectorized


@pytest.mark.parametrize("wkind,epilogue,max_m,path", [
    ("bf16", "none", 16, "fma"), ("f16", "silu_mul", 64, "fma"), ("f32", "residual", 7, "fma"),
    ("bf16", "none", 16, "stream"), ("f16", "silu_mul", 64, "stream"), ("bf16", "residual", 20, "stream")])
def test_m_tiles_beyond_max_m(backend, rng, wkind, epilogue, max_m, path):
    for m in (100, max_m + 1):
        run(backend, rng, N=21, K=64, wkind=wkind, epilogue=epilogue, m=m, max_m=max_m,
            x_rows=103, path=path)


def test_stream_path_is_the_default_for_half_weights(backend):
    # gemm_stream.cu is the tensor-core kernel (gemm_mma.cu, its predecessor, is gone)
    assert Gemm(backend, 8, 64, "bf16").path == "stream"
    assert Gemm(backend, 8, 64, "f16").path == "stream"
    with pytest.raises(ValueError, match="path 'mma'"):
        Gemm(backend, 8, 64, "bf16", path="mma")
    assert Gemm(backend, 8, 64, "f32").path == "fma"
    assert Gemm(backend, 8, 36, "bf16").path == "fma"     # K % 8 != 0
    with pytest.raises(ValueError, match="path 'stream' needs"):
        Gemm(backend, 8, 36, "bf16", path="stream")
    with pytest.raises(ValueError, match="path 'gpu'"):
        Gemm(backend, 8, 64, "f16", path="gpu")


@pytest.mark.parametrize("max_m", [1, 3, 8])
def test_small_max_m_several_columns_per_warp(backend, rng, max_m):
    # Small max_m gives 4 columns per warp and one long K tile; N=67 leaves a
    # partially filled last block (some warps with no valid column at all).
    op = run(backend, rng, N=67, K=520, wkind="f16", epilogue="none", m=max_m, max_m=max_m, path="fma")
    assert op.rows_per_warp == 4 and op.k_tile == 640


@pytest.mark.parametrize("wkind", ["f16", "bf16"])
def test_residual_in_place(backend, rng, wkind):
    for m in (1, 19, 40):
        for path in ("fma", "stream"):
            run(backend, rng, N=45, K=96, wkind=wkind, epilogue="residual", m=m, max_m=16,
                x_rows=41, in_place=True, path=path)


@pytest.mark.parametrize("path", ["fma", "stream"])
def test_exact_small_integers(backend, rng, path):
    # Integer data: every partial sum is exact in f32, so any indexing slip
    # (wrong row, wrong column, dropped K step) shows up as an exact mismatch.
    N, K, m = 23, 200, 9
    op = Gemm(backend, N, K, "bf16", max_m=16, path=path)
    xh = rng.integers(-3, 4, (m, K)).astype(np.float32)
    wf = rng.integers(-3, 4, (N, K)).astype(np.float32)
    wh = wf.astype(ml_dtypes.bfloat16).view(np.uint16)
    y = backend.zeros((m, N), np.float32)
    op(backend.asarray(xh), backend.asarray(wh), y, m)
    np.testing.assert_array_equal(backend.to_numpy(y), xh @ wf.T)


def test_silu_extremes(backend, rng):
    # Large |gate|: silu saturates to g (g >> 0) or to -0 (g << 0) without NaN.
    N, K, m = 5, 8, 2
    op = Gemm(backend, N, K, "f32", epilogue="silu_mul", max_m=4)
    xh = np.ones((m, K), np.float32)
    wh = np.zeros((2 * N, K), np.float32)
    wh[:N, 0] = [200.0, -200.0, 0.0, 3.0, -90.0]
    wh[N:, 0] = [0.5, 2.0, 1.0, -1.0, 4.0]
    y = backend.zeros((m, N), np.float32)
    op(backend.asarray(xh), backend.asarray(wh), y, m)
    got = backend.to_numpy(y)
    assert np.isfinite(got).all()
    assert_close(got, gemm_reference(xh, wh, "silu_mul"), "f32", "silu extremes")


def test_reference_rounds_weights_from_storage():
    # The oracle must see the stored bf16/f16 values, not the f32 originals.
    x = np.ones((1, 2), np.float32)
    w32 = np.array([[1.0 + 2 ** -10, 1.0]], np.float32)
    bf = w32.astype(ml_dtypes.bfloat16)
    assert gemm_reference(x, bf.view(np.uint16))[0, 0] == 2.0
    assert gemm_reference(x, bf)[0, 0] == 2.0
    assert gemm_reference(x, w32.astype(np.float16))[0, 0] == np.float32(2.0 + 2 ** -10)
    # ... and round the activations only when told (the MMA path's x_round)
    xs = np.array([[1.0 + 2 ** -10, 0.0]], np.float32)
    one = np.array([[1.0, 1.0]], np.float16)
    assert gemm_reference(xs, one)[0, 0] == np.float32(1.0 + 2 ** -10)
    assert gemm_reference(xs, one, x_round="f16")[0, 0] == np.float32(1.0 + 2 ** -10)
    assert gemm_reference(xs, one, x_round="bf16")[0, 0] == 1.0
    assert gemm_reference(xs, one, x_round="bf16x2")[0, 0] == np.float32(1.0 + 2 ** -10)


def test_bytes_moved(backend):
    op = Gemm(backend, 8, 16, "f16", epilogue="silu_mul", max_m=4)
    assert op.bytes_moved(3) == 16 * 16 * 2 + 3 * 16 * 4 + 3 * 8 * 4
    op = Gemm(backend, 8, 16, "f32", epilogue="residual", max_m=4)
    assert op.bytes_moved(2) == 8 * 16 * 4 + 2 * 16 * 4 + 2 * 2 * 8 * 4


def test_bad_input(backend):
    N, K = 8, 16
    op = Gemm(backend, N, K, "f16", max_m=4)
    x = backend.zeros((4, K), np.float32)
    w = backend.zeros((N, K), np.float16)
    y = backend.zeros((4, N), np.float32)
    op(x, w, y, 4)  # the good call works

    def raises(exc, match, *args, **kw):
        with pytest.raises(exc, match=match):
            op(*args, **kw)

    raises(TypeError, "^w ", x, backend.zeros((N, K), np.float32), y, 4)
    raises(TypeError, "^w ", x, np.zeros((N, K), np.float16).tolist(), y, 4)
    raises(TypeError, "^x ", backend.zeros((4, K), np.float16), w, y, 4)
    raises(ValueError, "^x ", backend.zeros((4, K + 1), np.float32), w, y, 4)
    raises(ValueError, "^x ", backend.zeros((4 * K,), np.float32), w, y, 4)
    raises(ValueError, "^w ", x, backend.zeros((N + 1, K), np.float16), y, 4)
    raises(ValueError, "^y ", x, w, backend.zeros((4, N + 1), np.float32), 4)
    raises(ValueError, "^m=", x, w, y, 5)
    raises(ValueError, "^m=", x, w, y, 0)
    raises(TypeError, "^m ", x, w, y, 2.0)
    raises(ValueError, "^residual", x, w, y, 4, residual=y)
    raises(ValueError, "^y must not overlap x", x, w, x.reshape(4 * K)[: 4 * N].reshape(4, N), 4)

    res = Gemm(backend, N, K, "f16", epilogue="residual", max_m=4)
    with pytest.raises(ValueError, match="^residual is required"):
        res(x, w, y, 4)
    with pytest.raises(ValueError, match="^residual must have shape"):
        res(x, w, y, 4, residual=backend.zeros((3, N), np.float32))

    silu = Gemm(backend, N, K, "bf16", epilogue="silu_mul", max_m=4)
    with pytest.raises(ValueError, match=r"^w must have shape \(16, 16\)"):
        silu(x, backend.zeros((N, K), np.uint16), y, 4)

    with pytest.raises(ValueError, match="^epilogue"):
        Gemm(backend, N, K, "f16", epilogue="gelu")
    with pytest.raises(TypeError, match="^w_dtype"):
        Gemm(backend, N, K, np.int8)
    with pytest.raises(ValueError, match="^max_m=0 must be >= 1"):
        Gemm(backend, N, K, "f16", max_m=0)   # any max_m >= 1: beyond 64 the tile stays 64
    with pytest.raises(ValueError, match="^K=0 must be >= 1"):
        Gemm(backend, N, 0, "f16")
    with pytest.raises(TypeError, match="^N must be an int"):
        Gemm(backend, 2.0, K, "f16")
