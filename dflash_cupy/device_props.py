"""Device properties the launchers size their grids and tiles by: queried
from the GPU on the CuPy backend, an explicit H200 profile on the emulator
(so emulated launches are shaped exactly as on the GPU the project targets).

``of(backend)`` is the one entry point; ``query_cupy()`` is the CuPy query.
"""
from __future__ import annotations

from dataclasses import dataclass

# Dynamic shared memory any block may use without the opt-in attribute: a CUDA
# constant (every architecture since Kepler), not a property of the device.
DEFAULT_SMEM = 48 * 1024


@dataclass(frozen=True)
class DeviceProps:
    name: str
    sm_count: int      # streaming multiprocessors
    smem_optin: int    # dynamic shared memory per block with the opt-in attribute (bytes)
    l2_bytes: int


# NVIDIA H200 SXM (GH100): 132 SMs, 227 KiB opt-in shared memory per block, 50 MiB L2.
H200 = DeviceProps(name="NVIDIA H200 (emulated profile)", sm_count=132, smem_optin=232448,
                   l2_bytes=50 * 2**20)

def query_cupy(device: int | None = None) -> DeviceProps:
    """The current (or given) CUDA device's properties, through CuPy's runtime
    (a few attribute reads: launchers query once, when they are built)."""
    import cupy
    rt = cupy.cuda.runtime
    dev = rt.getDevice() if device is None else int(device)
    attr = lambda a: int(rt.deviceGetAttribute(a, dev))  # noqa: E731
    try:
        name = rt.getDeviceProperties(dev).get("name", b"?")
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    except Exception:  # the name is informational only
        name = f"CUDA device {dev}"
    return DeviceProps(name=name, sm_count=attr(rt.cudaDevAttrMultiProcessorCount),
                       smem_optin=attr(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin),
                       l2_bytes=attr(rt.cudaDevAttrL2CacheSize))


def of(backend) -> DeviceProps:
    """The properties kernels launched on ``backend`` see."""
    return query_cupy() if backend.name == "cuda" else H200
