"""nvtx is optional: ranges annotate under the package's domain when it is
installed and are no-op contexts when it is not."""
import contextlib

from dflash_cupy import nvtx_ranges


def test_ranges_use_nvtx_when_installed():
    import nvtx
    assert nvtx_ranges.available()
    r = nvtx_ranges.nvtx_range("plan", "green")
    assert isinstance(r, nvtx.annotate)
    with r:
        pass


def test_ranges_are_no_ops_without_nvtx(monkeypatch):
    monkeypatch.setattr(nvtx_ranges, "_nvtx", None)
    assert not nvtx_ranges.available()
    r = nvtx_ranges.nvtx_range("plan")
    assert isinstance(r, contextlib.nullcontext)
    with r:
        pass
