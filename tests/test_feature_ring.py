"""FeatureRing: position p in slot p % capacity, the held range [lo, hi),
storage dtypes, errors that name the argument, close."""
import ml_dtypes
import numpy as np
import pytest

from dflash_cupy.feature_ring import FeatureRing

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float32, np.float16, BF16]


def rows(rng, n, width, scale=3.0):
    return (rng.standard_normal((n, width)) * scale).astype(np.float64)


def storage_bits(be, ring):
    """The device storage as raw bits (bf16 arrives as uint16)."""
    a = be.to_numpy(ring.storage)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def as_bits(a, dtype):
    a = np.asarray(a).astype(dtype)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_write_read_wraparound(backend, rng, dtype):
    cap, L, H = 5, 3, 7                      # fc_in 21: rows of odd width
    with FeatureRing(cap, L, H, dtype, backend=backend) as r:
        assert r.fc_in == L * H and r.capacity == cap
        assert r.dtype == np.dtype(dtype) and r.storage.shape == (cap, L * H)
        hist = rows(rng, 40, L * H)
        r.write(0, hist[0:3])
        r.write(3, hist[3:7])                 # wraps: slots 3, 4, 0, 1
        assert (r.lo, r.hi) == (2, 7)
        got = r.read(2, 5)
        assert got.dtype == np.dtype(dtype) and got.shape == (5, L * H)
        # values are exactly the input rounded (once) to the storage dtype
        assert np.array_equal(as_bits(got, dtype), as_bits(hist[2:7], dtype))
        # and sit in slot p % capacity
        sb = storage_bits(backend, r)
        for p in range(2, 7):
            assert np.array_equal(sb[p % cap], as_bits(hist[p], dtype)), p
        # a write of exactly `capacity` rows starting mid-ring, from f16 / f32 input
        src = hist[7:12].astype(np.float16 if dtype is not np.float32 else np.float32)
        r.write(7, src)
        assert (r.lo, r.hi) == (7, 12)
        assert np.array_equal(as_bits(r.read(7, 5), dtype), as_bits(src, dtype))
        assert np.array_equal(as_bits(r.read(9, 2), dtype), as_bits(src[2:4], dtype))
        assert r.read(9, 0).shape == (0, L * H)
        # large absolute positions: slot p % capacity still
        p0 = 2**20 - 2
        r.write(p0, hist[20:24])
        assert (r.lo, r.hi) == (p0, p0 + 4)
        sb = storage_bits(backend, r)
        for i in range(4):
            assert np.array_equal(sb[(p0 + i) % cap], as_bits(hist[20 + i], dtype))


def test_bf16_rounding_and_specials(backend):
    """bf16 storage rounds to nearest even; inf/nan/-0 survive (stored on request:
    non-finite host rows are refused by default)."""
    x = np.array([[1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.0 - 2**-7 - 2**-9, np.inf, -np.inf, -0.0, 1e-40, 3.1415927]],
                 np.float32)
    with FeatureRing(2, 1, x.shape[1], "bf16", backend=backend) as r:
        with pytest.raises(ValueError, match="not finite"):
            r.write(0, x)
        r.write(0, x, check_finite=False)
        got = r.read(0, 1)
        assert got.dtype == BF16
        assert np.array_equal(got.view(np.uint16), x.astype(BF16).view(np.uint16))
        assert got.view(np.uint16)[0, 0] == np.float32(1.0).view(np.uint32) >> 16     # tie -> even
        assert got.view(np.uint16)[0, 5] == 0x8000                                     # -0 kept
        r.write(1, np.full((1, x.shape[1]), np.nan, np.float32), check_finite=False)
        assert np.isnan(r.read(1, 1).astype(np.float32)).all()


def test_holds_range_semantics(emu, rng):
    cap, W = 5, 4
    with FeatureRing(cap, 1, W, backend=emu) as r:
        h = rows(rng, 30, W)
        assert (r.lo, r.hi) == (0, 0)
        assert r.holds(0, 0) and r.holds(7, 7) and r.holds(5, 3)     # empty ranges
        assert not r.holds(0, 1)
        r.write(0, h[0:3])
        assert r.holds(0, 3) and r.holds(1, 2) and not r.holds(0, 4) and not r.holds(3, 4)
        r.write(3, h[3:5])                    # contiguous append
        assert (r.lo, r.hi) == (0, 5)
        r.write(5, h[5:8])                    # only the last `capacity` survive
        assert (r.lo, r.hi) == (3, 8)
        assert not r.holds(2, 4) and r.holds(3, 8)
        with pytest.raises(KeyError, match=r"\[2, 4\)"):
            r.read(2, 2)
        r.write(6, h[20:21])                  # rewind: rewrite 6, drop 7
        assert (r.lo, r.hi) == (3, 7)
        assert not r.holds(6, 8)
        assert np.array_equal(r.read(6, 1), h[20:21].astype(np.float32))
        assert np.array_equal(r.read(3, 3), h[3:6].astype(np.float32))   # older rows intact
        r.write(12, h[12:14])                 # a gap: nothing before 12 is held
        assert (r.lo, r.hi) == (12, 14)
        assert not r.holds(6, 7) and not r.holds(11, 13)
        r.write(14, h[14:14])                 # empty write at hi changes nothing
        assert (r.lo, r.hi) == (12, 14)
        r.write(13, h[13:13])                 # empty write inside: truncates to 13
        assert (r.lo, r.hi) == (12, 13)
        r.write(10, h[10:12])                 # before lo: [10, 12) only
        assert (r.lo, r.hi) == (10, 12)
        assert not r.holds(12, 13)
        r.write(8, h[8:13])                   # a full-capacity write overlapping the old range
        assert (r.lo, r.hi) == (8, 13)
        assert np.array_equal(r.read(8, 5), h[8:13].astype(np.float32))
        r.reset()
        assert (r.lo, r.hi) == (0, 0) and not r.holds(8, 9)


def test_write_in_chunks_larger_than_staging(emu, rng):
    """Writes longer than the pinned staging buffer (64 rows) wrap correctly."""
    cap, W = 150, 3
    with FeatureRing(cap, 1, W, np.float16, backend=emu) as r:
        h = rows(rng, 400, W)
        r.write(0, h[0:100])
        r.write(100, h[100:250])              # 150 rows: slots 100..149 then 0..99
        assert (r.lo, r.hi) == (100, 250)
        assert np.array_equal(r.read(100, 150), h[100:250].astype(np.float16))
        sb = storage_bits(emu, r)
        assert np.array_equal(sb[np.arange(100, 250) % cap], as_bits(h[100:250], np.float16))


def test_errors_name_the_argument(emu):
    with pytest.raises(ValueError, match="capacity"):
        FeatureRing(0, 1, 4, backend=emu)
    with pytest.raises(TypeError, match="capacity"):
        FeatureRing(2.0, 1, 4, backend=emu)
    with pytest.raises(ValueError, match="n_captured_layers"):
        FeatureRing(4, 0, 4, backend=emu)
    with pytest.raises(ValueError, match="hidden_size"):
        FeatureRing(4, 1, -1, backend=emu)
    with pytest.raises(TypeError, match="dtype"):
        FeatureRing(4, 1, 4, np.int32, backend=emu)
    with pytest.raises(TypeError, match="dtype"):
        FeatureRing(4, 1, 4, "f64", backend=emu)

    r = FeatureRing(4, 2, 3, backend=emu)
    ok = np.ones((2, 6), np.float32)
    r.write(0, ok)
    state = (r.lo, r.hi, emu.to_numpy(r.storage).copy())

    def unchanged():
        assert (r.lo, r.hi) == state[:2]
        assert np.array_equal(emu.to_numpy(r.storage), state[2])

    for bad in (np.ones((2, 5), np.float32), np.ones((6,), np.float32), np.ones((1, 2, 6), np.float32)):
        with pytest.raises(ValueError, match="rows"):
            r.write(2, bad)
        unchanged()
    with pytest.raises(TypeError, match="rows must be an array"):  # not an array at all
        r.write(2, [[1.0] * 6])
    unchanged()
    with pytest.raises(ValueError, match="rows"):           # more rows than the ring holds
        r.write(2, np.ones((5, 6), np.float32))
    unchanged()
    for bad in (np.ones((1, 6), np.complex64), np.array([["a"] * 6]), np.ones((1, 6), bool)):
        with pytest.raises(TypeError, match="rows"):
            r.write(2, bad)
        unchanged()
    with pytest.raises(ValueError, match="start_pos"):
        r.write(-1, ok)
    with pytest.raises(TypeError, match="start_pos"):
        r.write(1.0, ok)
    with pytest.raises(ValueError, match="start_pos"):
        r.write(2**31 - 2, ok)                               # positions overflow int32
    unchanged()
    with pytest.raises(ValueError, match="start_pos"):
        r.read(-1, 1)
    with pytest.raises(ValueError, match="n"):
        r.read(0, -1)
    with pytest.raises(KeyError, match=r"\[1, 3\)"):
        r.read(1, 2)
    r.close()
    for fn, args in ((r.write, (2, ok)), (r.read, (0, 1)), (r.reset, ())):
        with pytest.raises(RuntimeError, match="closed"):
            fn(*args)
    r.close()                                                 # idempotent


def test_device_array_write(backend, rng):
    """A device array of the storage dtype is copied device to device (on the
    emulator too, where device arrays are NumPy arrays in device memory); any
    other dtype is refused."""
    with FeatureRing(4, 1, 8, np.float16, backend=backend) as r:
        h = rows(rng, 6, 8).astype(np.float16)
        r.write(2, backend.asarray(h[:3]))
        assert np.array_equal(r.read(2, 3), h[:3])
        with pytest.raises(TypeError, match="rows"):
            r.write(5, backend.asarray(h[:1].astype(np.float32)))
        assert (r.lo, r.hi) == (2, 5)


def test_context_manager_closes(emu):
    with FeatureRing(3, 1, 4, backend=emu) as r:
        r.write(0, np.zeros((1, 4), np.float32))
    assert r.storage is None
    with pytest.raises(RuntimeError, match="closed"):
        r.write(1, np.zeros((1, 4), np.float32))
