"""``backends.get``: automatic choice, the DFLASH_CUPY_BACKEND override, explicit
names, the process-wide singleton, and errors that name what was wrong."""
import inspect

import pytest

from dflash_cupy import backends
from dflash_cupy.backends import Backend, BackendError

GPU = backends.gpu_available()


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Each test starts with no cached backends and no override; the process's
    singletons are put back afterwards so other test files keep theirs."""
    saved = dict(backends._instances)
    backends._instances.clear()
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    yield
    backends._instances.clear()
    backends._instances.update(saved)


class _FakeRuntime:
    def __init__(self, count):
        self.count = count

    def getDeviceCount(self):
        if isinstance(self.count, Exception):
            raise self.count
        return self.count


@pytest.mark.parametrize("count,want", [(0, False), (1, True), (4, True),
                                        (RuntimeError("cudaErrorNoDevice"), False)])
def test_gpu_available_follows_the_device_count(monkeypatch, count, want):
    import sys
    import types
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=_FakeRuntime(count)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert backends.gpu_available() is want


def test_gpu_available_is_false_when_cupy_does_not_import(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert backends.gpu_available() is False


def test_default_is_cuda_with_gpu_else_emulated():
    b = backends.get()
    assert isinstance(b, Backend)
    assert b.name == ("cuda" if GPU else "emulated")


def test_env_override_selects_emulated(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "emulated")
    assert backends.get().name == "emulated"


def test_env_override_is_case_and_space_insensitive(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "  Emulated \n")
    assert backends.get().name == "emulated"


def test_empty_env_means_automatic(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "   ")
    assert backends.get().name == ("cuda" if GPU else "emulated")


@pytest.mark.parametrize("value", ["gpu", "cpu", "cupy", "emu"])
def test_bad_env_value_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(backends.ENV_VAR, value)
    with pytest.raises(ValueError, match=backends.ENV_VAR) as ei:
        backends.get()
    assert repr(value) in str(ei.value)
    assert not backends._instances


def test_explicit_name_wins_over_env(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "not-a-backend")
    assert backends.get("emulated").name == "emulated"


@pytest.mark.parametrize("name", ["Emulated", "gpu", ""])
def test_bad_explicit_name(name):
    with pytest.raises(ValueError, match="backend name"):
        backends.get(name)


def test_backend_instance_passes_through():
    b = backends.get("emulated")
    assert backends.get(b) is b


def test_singleton_per_name(monkeypatch):
    a = backends.get("emulated")
    assert backends.get("emulated") is a
    monkeypatch.setenv(backends.ENV_VAR, "emulated")
    assert backends.get() is a
    assert backends._instances == {"emulated": a}


def test_cuda_without_gpu_raises_backend_error(monkeypatch):
    if backends.gpu_available():
        pytest.skip("a GPU is visible: 'cuda' is available here")
    with pytest.raises(BackendError, match="no CUDA GPU"):
        backends.get("cuda")
    monkeypatch.setenv(backends.ENV_VAR, "cuda")
    with pytest.raises(BackendError, match="no CUDA GPU"):
        backends.get()
    assert "cuda" not in backends._instances


@pytest.mark.skipif(not GPU, reason="needs a visible CUDA GPU (the no-GPU case is the test above)")
def test_cuda_with_gpu_is_the_cuda_backend(monkeypatch):
    b = backends.get("cuda")
    assert b.name == "cuda"
    monkeypatch.setenv(backends.ENV_VAR, "cuda")
    assert backends.get() is b


def test_cuda_backend_implements_the_whole_interface():
    # Importable and constructible without a GPU (construction touches no device), with no
    # abstract method left unimplemented.
    from dflash_cupy.backends.cuda import NVRTC_FLAGS, CudaBackend
    assert not inspect.isabstract(CudaBackend)
    b = CudaBackend()
    assert b.name == "cuda" and not b.is_capturing()
    assert "--std=c++17" in NVRTC_FLAGS and "-ftz=true" in NVRTC_FLAGS
    for meth in ("empty", "zeros", "asarray", "to_numpy", "pinned_empty", "is_device_array",
                 "compile", "stream", "current_stream", "as_stream", "event", "copy_h2d_async", "copy_d2h_async",
                 "copy_d2d_async", "synchronize", "begin_capture", "end_capture", "is_capturing"):
        sig_base = inspect.signature(getattr(Backend, meth))
        sig_cuda = inspect.signature(getattr(CudaBackend, meth))
        assert list(sig_cuda.parameters) == list(sig_base.parameters), meth
