"""Device properties (one source: the device on CuPy, the explicit H200
profile on the emulator) and the constants Python reads from cuda_src."""
import sys
import types

import pytest

from dflash_cupy import device_props, kernels


def test_emulator_presents_the_h200_profile(emu):
    p = device_props.of(emu)
    assert p is device_props.H200
    assert (p.sm_count, p.smem_optin, p.l2_bytes) == (132, 227 * 1024, 50 * 2**20)
    # the emulator's launch limit is that profile's opt-in shared memory
    from dflash_cupy.emu import build as emu_build
    assert emu_build.SMEM_BYTES == p.smem_optin


def test_cupy_query_reads_the_device_attributes(monkeypatch):
    class Runtime:
        cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerBlockOptin = 16, 97
        cudaDevAttrL2CacheSize = 89

        def getDevice(self):
            return 3

        def deviceGetAttribute(self, attr, dev):
            assert dev == 3
            return {16: 108, 97: 166912, 89: 40 * 2**20}[attr]   # an A100's figures

        def getDeviceProperties(self, dev):
            return {"name": b"NVIDIA A100-SXM4-80GB"}

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=Runtime())))
    p = device_props.query_cupy()
    assert p == device_props.DeviceProps("NVIDIA A100-SXM4-80GB", 108, 166912, 40 * 2**20)
    assert device_props.of(types.SimpleNamespace(name="cuda")) == p


def test_constants_come_from_the_cuda_sources(tmp_path, monkeypatch):
    c = kernels.constants("step_desc.cuh")
    assert c["DESC_LEN"] == 10 and c["DESC_RESET"] == 5 and c["DESC_CTX_ROWS"] == 8
    assert kernels.constants("attention_common.cuh")["TILE"] == 32
    # -D-settable defaults (#ifndef NAME / #define NAME) are not constants
    assert "D" not in kernels.constants("attention_common.cuh")
    src = tmp_path / "k.cuh"
    src.write_text("#ifndef N\n#define N 4\n#endif\n#define FIXED 7  // why\n#define EXPR (2 * FIXED)\n")
    monkeypatch.setattr(kernels, "CUDA_SRC", tmp_path)
    kernels.constants.cache_clear()
    try:
        assert kernels.constants("k.cuh") == {"FIXED": 7}
    finally:
        kernels.constants.cache_clear()


def test_python_launch_constants_match_the_headers():
    from dflash_cupy.ops import attention, gemm, ring_slots, step_descriptor
    assert step_descriptor.DESC_LEN == kernels.constants("step_desc.cuh")["DESC_LEN"]
    assert (ring_slots.SLOT_THREADS, ring_slots.ROW_THREADS) == (256, 128)
    assert attention.TILE == 32 and attention.COMBINE_THREADS == 128
    assert gemm.LANE_K == 4
    assert gemm.SMEM_LIMIT == attention.SMEM_LIMIT == device_props.DEFAULT_SMEM == 48 * 1024


@pytest.mark.parametrize("sms,want", [(132, 33), (66, 17), (264, 66)])
def test_attention_splits_follow_the_sm_count(sms, want):
    from dflash_cupy.ops.attention import default_splits
    # 8 kv heads over a long window: splits for 2 blocks per SM
    assert default_splits(8, 100_000, sms) == want
