"""The emulated backend's device arrays behave as CuPy's: ``.get()`` reads in
stream order, implicit conversion to NumPy never returns memory that queued
work has not written yet (it waits for every stream, or raises as CuPy does
with ``DFLASH_CUPY_EMU_IMPLICIT=raise``)."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_cupy import interop
from dflash_cupy.emu.device_array import CUPY_IMPLICIT_MESSAGE, DeviceArray, raw
from tests.support.drafters import Driver


def _queued_fill(be, stream, shape=(4, 5), value=3.0):
    """A device array whose fill is queued on ``stream`` and has not run yet."""
    with stream:
        a = be.empty(shape, np.float32)
        a.fill(value)
    assert np.isnan(raw(a)).all(), "the fill must still be queued (poisoned memory)"
    return a


def test_a_steps_output_read_both_ways(emu):
    """The issue's case: np.asarray(kv.step(...)) on the emulator returned the
    queued kernels' unwritten memory; it must equal .get() and to_numpy."""
    d = Driver(emu, "a", seed=3)
    noise = d.step(5, check=False)
    out = d.kv.hidden_states
    assert isinstance(out, DeviceArray)
    stale = raw(out).copy()          # what a plain ndarray would have shown (no wait)
    implicit = np.array(np.asarray(out))
    got = out.get()
    np.testing.assert_array_equal(implicit, got)
    np.testing.assert_array_equal(emu.to_numpy(out), got)
    assert not np.array_equal(stale, got, equal_nan=True), \
        "the step's kernels had run before the read: this test would not see stale data"
    d.check(5, noise)                 # and it is the oracle's answer
    d.close()


def test_implicit_conversion_raises_like_cupy_when_asked(emu, monkeypatch):
    d = Driver(emu, "a", seed=4)
    d.step(5, check=False)
    out = d.kv.hidden_states
    monkeypatch.setenv("DFLASH_CUPY_EMU_IMPLICIT", "raise")
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(out)
    with pytest.raises(TypeError, match="Please use `.get\\(\\)`"):
        out + 1
    got = out.get()                   # the explicit read still works, in stream order
    assert np.isfinite(got).all()
    monkeypatch.setenv("DFLASH_CUPY_EMU_IMPLICIT", "sync")
    np.testing.assert_array_equal(np.asarray(out), got)
    d.close()
    assert "`.get()`" in CUPY_IMPLICIT_MESSAGE


def test_unknown_implicit_mode_is_rejected(emu, monkeypatch):
    a = emu.asarray(np.zeros(3, np.float32))
    monkeypatch.setenv("DFLASH_CUPY_EMU_IMPLICIT", "maybe")
    with pytest.raises(ValueError, match="DFLASH_CUPY_EMU_IMPLICIT='maybe'"):
        np.asarray(a)


def test_get_waits_for_its_stream(emu):
    s = emu.stream()
    a = _queued_fill(emu, s)
    np.testing.assert_array_equal(a.get(stream=s), np.full((4, 5), 3.0, np.float32))
    out = np.empty((4, 5), np.float32)
    assert a.get(stream=s, out=out) is out
    with pytest.raises(ValueError, match="out must be"):
        a.get(stream=s, out=np.empty(3, np.float32))


def test_implicit_reads_wait_for_every_stream(emu):
    s = emu.stream()
    want = np.full((4, 5), 3.0, np.float32)
    for read in (np.asarray, lambda a: np.array(a), lambda a: a + 0, lambda a: a.sum() / 20 * np.ones((4, 5)),
                 lambda a: np.from_dlpack(a)):
        a = _queued_fill(emu, s)
        np.testing.assert_array_equal(read(a), want)
    a = _queued_fill(emu, s)
    assert float(a[1, 2]) == 3.0
    a = _queued_fill(emu, s)
    assert "3." in repr(a) and repr(a).startswith("device_array(")


def test_views_stay_device_arrays_without_waiting(emu):
    s = emu.stream()
    a = _queued_fill(emu, s, shape=(4, 6))
    waits = emu.host_waits
    views = [a[1], a[1:3], a[2, 3], a.reshape(6, 4), a.view(np.int32), a.ravel(), a.T, a.transpose(1, 0)]
    assert all(isinstance(v, DeviceArray) and emu.is_device_array(v) for v in views)
    assert emu.host_waits == waits and np.isnan(raw(a)).all(), "a view waited for the queued fill"
    assert views[2].shape == () and a.data.ptr == a.ctypes.data
    np.testing.assert_array_equal(views[1].get(stream=s), np.full((2, 6), 3.0, np.float32))


def test_copies_and_writes_are_ordered(emu):
    s = emu.stream()
    a = _queued_fill(emu, s)
    with s:
        b = a.copy()                   # queued behind the fill on the same stream
    assert isinstance(b, DeviceArray)
    np.testing.assert_array_equal(b.get(stream=s), np.full((4, 5), 3.0, np.float32))
    a = _queued_fill(emu, s)
    a[0] = 7.0                         # waits for the fill, then writes
    want = np.full((4, 5), 3.0, np.float32)
    want[0] = 7.0
    np.testing.assert_array_equal(a.get(stream=s), want)
    c = _queued_fill(emu, s)[[0, 2]]   # fancy indexing copies: after the fill, on the device
    assert isinstance(c, DeviceArray)
    np.testing.assert_array_equal(c.get(), np.full((2, 5), 3.0, np.float32))
    assert emu.asarray(a).get()[0, 0] == 7.0


def test_no_buffer_protocol(emu):
    a = emu.asarray(np.arange(3, dtype=np.float32))
    with pytest.raises(TypeError):
        memoryview(a)
    with pytest.raises(TypeError, match="must be an ndarray"):
        DeviceArray([1, 2], emu)


def test_interop_takes_the_backends_device_array_as_is(emu):
    a = emu.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert interop.device_view(emu, a, "x", dtype=np.float32, shape=(2, None)) is a
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        interop.device_view(emu, a.T, "x")
