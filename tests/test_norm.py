"""RmsNorm (cuda_src/norm.cu) against rmsnorm_reference: widths that exercise each
row split (one warp, several warps, several rows per block, scalar tails), cycling
weight rows (aux hidden norms), in-place use, row prefixes, extreme magnitudes and
bad input."""
import numpy as np
import pytest

from dflash_cupy.ops.norm import RmsNorm, rmsnorm_reference
from tests.support.tolerances import assert_close


def run(backend, rng, D, xh, wh, *, eps=1e-6, rows=None, in_place=False):
    op = RmsNorm(backend, D, eps=eps)
    x, w = backend.asarray(xh), backend.asarray(wh)
    sentinel = np.full(xh.shape, -3.25, np.float32)
    y = x if in_place else backend.asarray(sentinel)
    op(x, w, y, rows=rows)
    got = backend.to_numpy(y)
    n = xh.size // D if rows is None else rows
    flat_got = got.reshape(-1, D)
    ref = rmsnorm_reference(xh, wh, D=D, eps=eps).reshape(-1, D)
    assert_close(flat_got[:n], ref[:n], "f32", f"{op!r} rows={n} in_place={in_place}")
    untouched = xh.reshape(-1, D) if in_place else sentinel.reshape(-1, D)
    np.testing.assert_array_equal(flat_got[n:], untouched[n:], err_msg="rows past `rows` written")
    return op


@pytest.mark.parametrize("D,expect_tpr", [
    (19, 32),      # scalar loads, several rows per block
    (128, 32),     # one warp per row
    (1000, 64),    # two warps per row, two rows per block: shared partials
    (1300, 96),    # three warps per row: one row per block (128 would not be whole rows)
    (4096, 256),   # 8 warps, 4 float4 chunks per thread
    (5000, 320),   # chunk count not a multiple of the row's threads
])
def test_widths(backend, rng, D, expect_tpr):
    for nrows in (1, 3, 19, 33) if D <= 1000 else (1, 3):
        xh = rng.standard_normal((nrows, D)).astype(np.float32)
        wh = (1.0 + 0.3 * rng.standard_normal(D)).astype(np.float32)
        op = run(backend, rng, D, xh, wh)
        assert op.tpr == expect_tpr


def test_rows_are_D_wide_slices_of_the_last_axis(backend, rng):
    # [B, n*d] normalised in d-wide slices with one weight row (the row view the
    # cycling aux norms below rely on, here without the cycling).
    B, nh, d = 5, 3, 64
    xh = rng.standard_normal((B, nh * d)).astype(np.float32)
    wh = rng.standard_normal(d).astype(np.float32)
    run(backend, rng, d, xh, wh)


@pytest.mark.parametrize("n_cap,H,M", [(3, 64, 7), (2, 33, 5)])
def test_cycling_weight_rows(backend, rng, n_cap, H, M):
    # aux hidden norms: [M, n_cap*H] as M*n_cap rows, weight table [n_cap, H].
    xh = rng.standard_normal((M, n_cap * H)).astype(np.float32)
    wh = rng.standard_normal((n_cap, H)).astype(np.float32)
    run(backend, rng, H, xh, wh)
    # the weight row really cycles: a reference that ignored it would differ
    ref = rmsnorm_reference(xh, wh, D=H).reshape(M, n_cap, H)
    ref0 = rmsnorm_reference(xh, wh[0], D=H).reshape(M, n_cap, H)
    assert not np.allclose(ref[:, 1], ref0[:, 1])


@pytest.mark.parametrize("D", [19, 256])
def test_in_place_and_prefix(backend, rng, D):
    xh = rng.standard_normal((9, D)).astype(np.float32)
    wh = rng.standard_normal((3, D)).astype(np.float32)
    run(backend, rng, D, xh, wh, in_place=True)
    run(backend, rng, D, xh, wh, in_place=True, rows=4)
    run(backend, rng, D, xh, wh, rows=5)
    run(backend, rng, D, xh, wh, rows=0)


@pytest.mark.parametrize("scale", [1e15, 1e-15, 1e-3, 1e4])
def test_magnitudes(backend, rng, scale):
    D = 384
    xh = (rng.standard_normal((6, D)) * scale).astype(np.float32)
    # rows of different magnitude are independent; stay clear of squares below
    # f32's normal range (-ftz flushes them; see norm.cu)
    xh[2] *= 1e2 if scale < 1 else 1e-2
    xh[4] = 0.0     # an all-zero row normalises to zero (eps keeps it finite)
    wh = rng.standard_normal(D).astype(np.float32)
    run(backend, rng, D, xh, wh, eps=1e-6)
    # eps = 0 (0/0 on the zero row is NaN in both, so leave it out)
    run(backend, rng, D, np.delete(xh, 4, axis=0), wh, eps=0.0)


def test_eps_matters(backend, rng):
    # Small inputs: the result depends on eps, so a kernel that dropped it would fail.
    D = 64
    xh = (rng.standard_normal((2, D)) * 1e-3).astype(np.float32)
    wh = np.ones(D, np.float32)
    run(backend, rng, D, xh, wh, eps=1e-6)
    a = rmsnorm_reference(xh, wh, eps=1e-6)
    b = rmsnorm_reference(xh, wh, eps=0.0)
    assert not np.allclose(a, b, rtol=1e-3)


def test_bad_input(backend):
    D = 32
    op = RmsNorm(backend, D)
    x = backend.zeros((4, D), np.float32)
    w = backend.zeros((D,), np.float32)
    y = backend.zeros((4, D), np.float32)
    op(x, w, y)

    def raises(exc, match, *args, **kw):
        with pytest.raises(exc, match=match):
            op(*args, **kw)

    raises(TypeError, "^x ", backend.zeros((4, D), np.float16), w, y)
    raises(TypeError, "^w ", x, backend.zeros((D,), np.float16), y)
    raises(TypeError, "^y ", x, w, np.zeros((4, D), np.float32).tolist())
    raises(ValueError, "^x's last axis", backend.zeros((4, D + 1), np.float32), w,
           backend.zeros((4, D + 1), np.float32))
    raises(ValueError, "^y must have x's shape", x, w, backend.zeros((5, D), np.float32))
    raises(ValueError, "^w must have shape", x, backend.zeros((D + 1,), np.float32), y)
    raises(ValueError, "^w must have shape", x, backend.zeros((2, 2, D), np.float32), y)
    raises(ValueError, "^rows=", x, w, y, rows=5)
    raises(TypeError, "^rows ", x, w, y, rows=1.5)
    with pytest.raises(ValueError, match="^D=0 must be >= 1"):
        RmsNorm(backend, 0)
    with pytest.raises(ValueError, match="^eps "):
        RmsNorm(backend, D, eps=-1.0)


@pytest.mark.parametrize("D", [19, 4096])
def test_tile_live_skips_dead_rows(backend, rng, D):
    """tile_live (a lane batch's flags): rows of a 0 tile keep y's bits, the others equal
    the launch without flags bit for bit; a short flag array is refused."""
    rows = 53
    op = RmsNorm(backend, D)
    xh = rng.standard_normal((rows, D)).astype(np.float32)
    wh = rng.uniform(0.5, 1.5, D).astype(np.float32)
    x, w = backend.asarray(xh), backend.asarray(wh)
    flags = np.array([2, 0, 1, 0], np.int32)
    sentinel = np.full((rows, D), -3.25, np.float32)
    y_all, y_fl = backend.asarray(sentinel), backend.asarray(sentinel)
    op(x, w, y_all)
    op(x, w, y_fl, tile_live=backend.asarray(flags))
    live = np.repeat(flags != 0, 16)[:rows]
    got, want = backend.to_numpy(y_fl), backend.to_numpy(y_all)
    np.testing.assert_array_equal(got[live].view(np.uint32), want[live].view(np.uint32))
    np.testing.assert_array_equal(got[~live], sentinel[~live])
    with pytest.raises(ValueError, match="tile_live must hold"):
        op(x, w, y_fl, tile_live=backend.asarray(flags[:3]))
    with pytest.raises(TypeError, match="tile_live"):
        op(x, w, y_fl, tile_live=backend.asarray(flags.astype(np.float32)))


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("D", [19, 4096])
def test_sixteen_bit_output_is_the_f32_result_rounded_once(backend, rng, kind, D):
    """``out_kind``: y holds the f32 kernel's own result rounded to nearest even, bit for bit
    (scalar and float4 paths, tile_live skipping a dead tile, rows past ``rows`` untouched);
    a 16-bit y may not alias x, and y's dtype is checked."""
    from dflash_cupy import dtypes
    nrows, rows = 40, 37
    xh = (rng.standard_normal((nrows, D)) * rng.uniform(0.01, 50, (nrows, 1))).astype(np.float32)
    wh = (1.0 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    x, w = backend.asarray(xh), backend.asarray(wh)
    live = backend.asarray(np.array([1, 0, 1], np.int32))   # rows 16..31 dead
    y32 = backend.zeros((nrows, D), np.float32)
    RmsNorm(backend, D)(x, w, y32, rows=rows, tile_live=live)
    op = RmsNorm(backend, D, out_kind=kind)
    assert op.out_kind == kind and kind in repr(op)
    sentinel = np.full((nrows, D), 0x7E01, np.uint16).view(dtypes.DEVICE[kind])
    y = backend.asarray(sentinel)
    op(x, w, y, rows=rows, tile_live=live)
    got = backend.to_numpy(y).view(np.uint16)
    want = dtypes.device_bits(backend.to_numpy(y32).astype(dtypes.HOST[kind])).view(np.uint16)
    live_rows = np.r_[0:16, 32:rows]
    np.testing.assert_array_equal(got[live_rows], want[live_rows])
    np.testing.assert_array_equal(got[16:32], sentinel.view(np.uint16)[16:32], err_msg="dead tile written")
    np.testing.assert_array_equal(got[rows:], sentinel.view(np.uint16)[rows:], err_msg="rows past `rows` written")
    assert not np.array_equal(got[live_rows], dtypes.device_bits(xh.astype(dtypes.HOST[kind])).view(np.uint16)[live_rows])
    with pytest.raises(TypeError, match="y must have dtype"):
        op(x, w, y32)
    with pytest.raises(ValueError, match="must not overlap x"):
        op(x, w, x.view(dtypes.DEVICE[kind]).reshape(-1)[:nrows * D].reshape(nrows, D))
    assert RmsNorm(backend, D, out_kind="f32").out_kind is None
    with pytest.raises(TypeError, match="out_kind"):
        RmsNorm(backend, D, out_kind="int8")


def test_sixteen_bit_output_counters_match_the_static_model(emu, rng):
    """The emulator's count of a 16-bit-output launch (every block) against
    profiling/counters.py: half the f32 launch's store bytes, the same load bytes."""
    from dflash_cupy.emu.counting import count_launch
    from profiling import counters as ctr
    from profiling.step_trace import RecordingBackend

    D, rows = 4096, 19
    stored = {}
    for kind in (None, "bf16"):
        rec = RecordingBackend()
        op = RmsNorm(rec, D, out_kind=kind)
        op(rec.zeros((rows, D), np.float32), rec.zeros((D,), np.float32), rec.zeros((rows, D), op.y_dtype))
        st = ctr.static_counters(rec.eager[-1])
        eop = RmsNorm(emu, D, out_kind=kind)
        x = emu.asarray(rng.standard_normal((rows, D)).astype(np.float32))
        w, y = emu.asarray(np.ones(D, np.float32)), emu.zeros((rows, D), eop.y_dtype)
        grid = (-(-rows // eop.rows_per_block), 1, 1)
        c = count_launch(eop._kernel, grid, (eop.block, 1, 1),
                         (x, w, y, np.int32(rows), np.int32(1), np.float32(eop.eps), eop._no_live, np.int32(0)))
        assert c.gst_bytes == sum(st.bytes_written.values()) == rows * D * eop.y_dtype.itemsize
        assert c.gst_sectors == c.gst_bytes // 32        # 8-byte stores: whole sectors
        stored[kind] = c.gst_bytes
    assert stored["bf16"] * 2 == stored[None]
