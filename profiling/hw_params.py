"""GPU parameter sets for the cost model (``perf_model.py``), each number with its source.

Two kinds of number live here:

* **datasheet / architecture facts** (SM count, register file, shared memory
  per SM, allocation granularities, peak HBM bandwidth): from NVIDIA's
  documents, cited beside each;
* **effective rates and latencies** (achievable HBM and L2 bandwidth, memory
  latencies, the mma.sync rate, the gap between graph nodes): approximate,
  from published microbenchmarks or this project's own measurement, and the
  first thing a calibration file (``profiling/results/calibration.json``)
  overrides once a GPU run has measured them.

Units: bytes, seconds, Hz. ``GPU.with_overrides(dict)`` returns a copy with
fields replaced (the calibration hook); unknown keys raise.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class GPU:
    name: str
    sm_count: int
    clock_hz: float               # SM clock under sustained load
    hbm_peak_Bps: float
    hbm_Bps: float                # achievable streaming bandwidth (read + write counted)
    hbm_latency_s: float          # a global load that misses L2, under load
    l2_Bps: float                 # achievable L2 hit bandwidth, whole chip
    l2_latency_s: float
    l2_bytes: int
    smem_wavefronts_per_clk_sm: float   # shared memory: one 128-byte wavefront per clock per SM
    mma_per_clk_sm: float         # mma.sync m16n8k16 (f16/bf16 in, f32 acc) instructions per clock per SM
    wgmma_per_clk_sm: float       # wgmma work in m16n8k16 equivalents per clock per SM
    node_gap_s: float             # idle time between two dependent kernel nodes of a graph
    # the same across a programmatic (PDL) edge: the next kernel's blocks are already placed
    # and waiting in griddepcontrol.wait (a labelled guess: see its source)
    pdl_gap_s: float = 0.5e-6
    # one warp's dependent chain per (row, head) unit of the qkv GEMM's epilogue (counters:
    # epilogue_*_rounds), in SM clocks: a labelled estimate (see its source)
    rope_round_clocks: float = 650.0
    copy_round_clocks: float = 300.0
    # occupancy limits (compute capability 9.0)
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256     # registers, allocated per warp
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 228 * 1024
    smem_per_block_max: int = 227 * 1024
    smem_alloc_unit: int = 128
    smem_reserved_per_block: int = 1024
    sources: dict = field(default_factory=dict, compare=False, repr=False)

    def with_overrides(self, over: dict) -> "GPU":
        names = {f.name for f in dataclasses.fields(self)} - {"name", "sources"}
        bad = sorted(set(over) - names)
        if bad:
            raise ValueError(f"calibration: unknown GPU parameter(s) {bad}; known: {sorted(names)}")
        vals = {}
        for k, v in over.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"calibration: {k} must be a positive number, got {v!r}")
            vals[k] = type(getattr(self, k))(v)
        src = dict(self.sources)
        src.update({k: "calibration file" for k in vals})
        return dataclasses.replace(self, sources=src, **vals)


_COMMON_SOURCES = {
    "regs_per_sm": "CUDA C Programming Guide, Table 'Technical Specifications per Compute Capability' (9.0)",
    "max_regs_per_thread": "same table (9.0)",
    "reg_alloc_unit": "CUDA Occupancy Calculator (cc 9.0: register allocation unit size 256, per warp)",
    "max_warps_per_sm": "CUDA C Programming Guide, cc 9.0: 64 resident warps per SM",
    "max_blocks_per_sm": "CUDA C Programming Guide, cc 9.0: 32 resident blocks per SM",
    "smem_per_sm": "Hopper Tuning Guide: 228 KB shared memory per SM (227 KB per block max)",
    "smem_per_block_max": "Hopper Tuning Guide",
    "smem_alloc_unit": "CUDA Occupancy Calculator (cc 9.0: shared memory allocation unit 128 B)",
    "smem_reserved_per_block": "CUDA C Programming Guide, cc 8.0+: 1 KB of shared memory reserved per block",
    "smem_wavefronts_per_clk_sm": "32 banks x 4 B per clock per SM (CUDA C Programming Guide, "
                                  "shared memory); Nsight Compute counts a 128 B wavefront per pass",
    "mma_per_clk_sm": "approx.: dense f16 tensor peak is 1024 FMA/clk/SM x2 on Hopper (H100 whitepaper: "
                      "989 TFLOPS at 132 SMs), but mma.sync (not wgmma) reaches about half of it "
                      "(Luo et al. 2024, 'Benchmarking and Dissecting the Nvidia Hopper GPU "
                      "Architecture', arXiv:2402.13499): 1024 FMA/clk/SM = 0.5 m16n8k16 per clock",
    "wgmma_per_clk_sm": "approx.: the dense peak is 1.0 m16n8k16 equivalent per clock per SM (2048 FMA); "
                        "large CUTLASS/cuBLAS bf16 GEMMs on H100 SXM reach ~750-800 of its 989 TFLOPS, so "
                        "0.8; wgmma with N = 64-128 from a register A operand assumed to keep that pace; "
                        "calibrate (tests/test_gemm_wgmma.py timings on a GPU)",
    "node_gap_s": "approx.: the issue's review estimate of 1.5-3 us per kernel boundary in a graph "
                  "(low end taken); calibrate from a measured eager vs graph step",
    "pdl_gap_s": "guess, no published measurement found: with programmatic dependent launch the next "
                 "kernel's blocks are launched and resident (waiting in griddepcontrol.wait) before the "
                 "previous grid ends, which removes the launch and block-placement part of node_gap_s; "
                 "what remains is the release after the previous grid's completion and memory flush, "
                 "taken as a third of node_gap_s. The weight prefetch before the wait is not modelled "
                 "separately. Calibrate: gpu_check.sh replays the step with and without PDL",
    "rope_round_clocks": "estimate from gemm_wgmma.cu's qkv epilogue (rope_math.cuh): one round is a warp's "
                         "GW_EPI_UNITS = 2 (row, head) units at once. One unit's dependent chain: shared "
                         "loads + warp sum (5 shuffles) + rsqrt ~210 clk, pos / inv_freq / norm-weight loads "
                         "(L1 mostly) ~150, two interleaved rope_cos_sin (fp64 reduction, sincospif) ~150, "
                         "rotation and stores ~60: ~570; the second unit's chain overlaps it, but with 2 warps "
                         "per scheduler the round issues ~4 x 130 instructions per scheduler: ~650. "
                         "Latencies after Luo et al. 2024 (arXiv:2402.13499). Not measured: ncu on a GPU",
    "copy_round_clocks": "estimate, as rope_round_clocks: a round of V heads is the loads, the warp sums every "
                         "warp runs, the (unused) angles and the f16 stores, ~300 clk",
    "hbm_latency_s": "approx.: ~480 ns unloaded DRAM latency on H100 (chipsandcheese.com, 'Nvidia's "
                     "H100: Funny L2, and Tons of Bandwidth', 2023), raised for a loaded system; "
                     "calibrate",
    "l2_latency_s": "approx.: ~260-300 ns L2 hit latency incl. the far partition (same article)",
    "l2_Bps": "approx.: ~2.5x HBM for the L2 hit path on H100 (same article: ~5.5-7 TB/s measured); "
              "calibrate",
}

H200 = GPU(
    name="H200", sm_count=132, clock_hz=1.755e9,
    hbm_peak_Bps=4.8e12, hbm_Bps=4.3e12, hbm_latency_s=650e-9,
    l2_Bps=10.0e12, l2_latency_s=280e-9, l2_bytes=50 * 2**20,
    smem_wavefronts_per_clk_sm=1.0, mma_per_clk_sm=0.5, wgmma_per_clk_sm=0.8, node_gap_s=1.5e-6,
    sources=dict(_COMMON_SOURCES, **{
        "sm_count": "H200 SXM = GH100 with 132 SMs (NVIDIA H200 datasheet, same die as H100 SXM)",
        "clock_hz": "approx.: H100/H200 SXM max boost 1.98 GHz, ~1.755 GHz sustained under load "
                    "(H100 whitepaper quotes 1.755 GHz for its FP32 figures)",
        "hbm_peak_Bps": "NVIDIA H200 datasheet: 4.8 TB/s HBM3e",
        "hbm_Bps": "measured by this project: 1 GiB device-to-device copy ~4.3 TB/s (read + write) "
                   "on an H200 (profiling/README.md, Floor)",
        "l2_Bps": "approx.: H200's L2 is H100's (50 MB); ~10 TB/s read hit bandwidth assumed; calibrate",
        "l2_bytes": "NVIDIA H200 datasheet / H100 whitepaper: 50 MB L2",
    }))

H100 = dataclasses.replace(
    H200, name="H100", hbm_peak_Bps=3.35e12, hbm_Bps=3.0e12, hbm_latency_s=650e-9,
    sources=dict(H200.sources, **{
        "hbm_peak_Bps": "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3",
        "hbm_Bps": "approx.: ~90% of peak for a streaming copy (the ratio measured on the H200); "
                   "calibrate",
        "sm_count": "NVIDIA H100 whitepaper: H100 SXM5 has 132 SMs",
    }))

GPUS = {"H200": H200, "H100": H100}

CALIBRATION_FILE = Path(__file__).resolve().parent / "results" / "calibration.json"


def get_gpu(name: str, calibration: str | Path | None = None) -> GPU:
    """The named parameter set, with ``calibration`` (a JSON file
    ``{"H200": {"hbm_Bps": 4.2e12, ...}}``; default ``results/calibration.json``
    when it exists) applied."""
    key = name.upper()
    if key not in GPUS:
        raise ValueError(f"gpu {name!r}: expected one of {', '.join(GPUS)}")
    gpu = GPUS[key]
    path = Path(calibration) if calibration is not None else CALIBRATION_FILE
    if calibration is not None and not path.is_file():
        raise FileNotFoundError(f"calibration file {path} not found")
    if path.is_file():
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"calibration file {path}: expected a JSON object keyed by GPU name")
        over = data.get(key, {})
        if over:
            gpu = gpu.with_overrides(over)
    return gpu
