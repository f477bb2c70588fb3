"""Foreign arrays in, zero-copy (dflash_cupy.interop): NumPy, DLPack and
array-interface objects on the emulated backend; CuPy / CUDA-array-interface
objects on a GPU; PyTorch when installed; clear errors for the rest."""
import numpy as np
import pytest

from dflash_cupy import backends
from dflash_cupy.interop import device_view


class _DLPackOnly:
    """Exposes only the DLPack protocol (like a JAX or PyTorch CPU tensor)."""

    def __init__(self, a, device=(1, 0)):
        self._a, self._dev = a, device

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._dev


class _ArrayInterfaceOnly:
    def __init__(self, a):
        self._a = a
        self.__array_interface__ = a.__array_interface__


@pytest.fixture
def emu_be():
    return backends.get("emulated")


def test_device_arrays_are_themselves_host_arrays_none(emu_be):
    a = emu_be.zeros((3, 4), np.float32)
    assert device_view(emu_be, a, "x", dtype=np.float32, shape=(3, 4)) is a
    assert device_view(emu_be, np.zeros((3, 4), np.float32), "x") is None  # host: the caller copies
    assert device_view(emu_be, _ArrayInterfaceOnly(np.zeros(3)), "x") is None


def test_dlpack_objects_are_zero_copy(emu_be):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    v = device_view(emu_be, _DLPackOnly(a), "rows", dtype=np.float32, shape=(None, 4))
    assert np.shares_memory(v, a) and v.shape == (3, 4)
    a[1, 2] = -5.0
    assert v[1, 2] == -5.0


def test_errors_name_the_argument(emu_be):
    a = emu_be.zeros((3, 4), np.float32)
    with pytest.raises(TypeError, match="noise_embed must have dtype float32, got float64"):
        device_view(emu_be, emu_be.zeros((3, 4), np.float64), "noise_embed", dtype=np.float32)
    with pytest.raises(ValueError, match=r"noise_embed must have shape \[3, 5\], got \[3, 4\]"):
        device_view(emu_be, a, "noise_embed", shape=(3, 5))
    with pytest.raises(ValueError, match="rows must be C-contiguous"):
        device_view(emu_be, emu_be.zeros((4, 6), np.float32)[:, ::2], "rows")
    with pytest.raises(ValueError, match="rows: .* DLPack device \\(2, 0\\)"):
        device_view(emu_be, _DLPackOnly(np.zeros(3), device=(2, 0)), "rows")
    with pytest.raises(TypeError, match="lm_head must be an array"):
        device_view(emu_be, [[1.0, 2.0]], "lm_head")


def test_dtype_alternatives(emu_be):
    a = emu_be.zeros((4,), np.uint16)
    assert device_view(emu_be, a, "w", dtype=(np.float16, np.uint16)) is a
    with pytest.raises(TypeError, match="float16 or uint16"):
        device_view(emu_be, a.view(np.int16), "w", dtype=(np.float16, np.uint16))


def test_torch_cpu_tensors_round_trip(emu_be):
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    v = device_view(emu_be, t, "rows", dtype=np.float32, shape=(3, 4))
    t[0, 0] = 42.0
    assert v[0, 0] == 42.0
    back = torch.from_dlpack(v)  # outputs: zero-copy the other way
    v[2, 3] = -1.0
    assert back[2, 3].item() == -1.0
    with pytest.raises(ValueError, match="C-contiguous"):
        device_view(emu_be, t.t(), "rows")


@pytest.mark.skipif(not backends.gpu_available(), reason="CuPy device arrays need a GPU")
def test_cuda_objects_are_zero_copy():
    import cupy
    be = backends.get("cuda")
    a = cupy.arange(6, dtype=cupy.float32).reshape(2, 3)

    class CAI:
        __cuda_array_interface__ = a.__cuda_array_interface__

    for obj in (a, CAI(), _DLPackOnly(a, device=(2, a.device.id))):
        v = device_view(be, obj, "x", dtype=np.float32, shape=(2, 3))
        assert v.data.ptr == a.data.ptr
    assert device_view(be, np.zeros(3, np.float32), "x") is None  # host data: the caller copies
