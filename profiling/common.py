"""Helpers shared by the benchmarks: drafter presets, fast random weights
placed straight on the backend, ring filling, result files, tables.

Random weights: ``DraftWeights.random`` draws float64 on the host (minutes for
a 3.5 GB drafter); ``RandomDraftWeights`` instead draws float32 normals in
chunks with the backend's own generator (CuPy on a GPU, NumPy on the
emulator) and rounds them to bf16 in place, directly into the fused device
layout ``DeviceWeights`` uses, and hands them to ``DraftWeights`` as weights
that live only on that device (``placed=``), which ``DraftKvCache`` takes
unchanged.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

from dflash_cupy import backends, device_props
from dflash_cupy.config import DFlash2Config, DraftConfig
from dflash_cupy.weights import DraftWeights

PROFILING_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROFILING_DIR.parent
RESULTS_DIR = PROFILING_DIR / "results"

# ---------------------------------------------------------------------------- drafter presets
DRAFTERS = {
    # The Qwen3.5-27B DFlash drafter: 5 layers, hidden 5120, 5 captured target layers.
    "qwen3.5-27b": dict(n_layer=5, hidden_size=5120, n_head=32, n_head_kv=8, head_dim=128,
                        intermediate_size=17408, block_size=16,
                        target_layer_ids=(1, 16, 31, 46, 61), rope_theta=10_000_000.0),
    # A hidden-4096 drafter (Qwen3-8B-sized target).
    "h4096": dict(n_layer=5, hidden_size=4096, n_head=32, n_head_kv=8, head_dim=128,
                  intermediate_size=12288, block_size=16, target_layer_ids=(1, 9, 17, 25, 33),
                  rope_theta=1_000_000.0),
    # DFlash 2 (SPEC §6): z-lab's published layout (hidden 6656, 5 sliding layers, window 2048,
    # bidirectional inside the block, 202048-token vocabulary) ...
    "dflash2-h6656": dict(n_layer=5, hidden_size=6656, n_head=32, n_head_kv=8, head_dim=128,
                          intermediate_size=19968, block_size=16, target_layer_ids=(1, 13, 25, 37, 49),
                          rope_theta=500_000.0, layer_sliding=(True,) * 5, sliding_window=2048, is_causal=False,
                          mask_token_id=201818,
                          dflash2=DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                                                selector_top_k=16, vocab_size=202048, final_logit_softcapping=20.0,
                                                output_multiplier=0.19611613513818404)),
    # ... and the same additions on the hidden-5120 drafter above (its 151936-token vocabulary)
    "dflash2-h5120": dict(n_layer=5, hidden_size=5120, n_head=32, n_head_kv=8, head_dim=128,
                          intermediate_size=17408, block_size=16, target_layer_ids=(1, 16, 31, 46, 61),
                          rope_theta=10_000_000.0, mask_token_id=151669,
                          dflash2=DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                                                selector_top_k=16, vocab_size=151936, final_logit_softcapping=20.0,
                                                output_multiplier=0.19611613513818404)),
    # Smoke / host-overhead drafter: every dimension tiny, same code paths.
    "tiny": dict(n_layer=2, hidden_size=32, n_head=4, n_head_kv=2, head_dim=8,
                 intermediate_size=64, block_size=4, target_layer_ids=(0, 1)),
}
DEFAULT_DRAFTER = "qwen3.5-27b"


def drafter_config(name: str) -> DraftConfig:
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}: expected one of {', '.join(DRAFTERS)}")
    return DraftConfig(**DRAFTERS[name])


def config_summary(c: DraftConfig) -> dict:
    return {"n_layer": c.n_layer, "hidden_size": c.hidden_size, "n_head": c.n_head,
            "n_head_kv": c.n_head_kv, "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size, "block_size": c.block_size,
            "n_captured": c.n_captured, "fc_in": c.fc_in, "attn_gate": c.attn_gate,
            "any_sliding": c.any_sliding}


# ---------------------------------------------------------------------------- CLI helpers
def int_list(s: str) -> list[int]:
    """``"256,1K,32k"`` -> ``[256, 1024, 32768]``."""
    out = []
    for tok in str(s).split(","):
        tok = tok.strip()
        if not tok:
            continue
        mult = 1
        if tok[-1] in "kK":
            tok, mult = tok[:-1], 1024
        try:
            v = int(tok) * mult
        except ValueError:
            raise ValueError(f"expected comma-separated ints (K suffix allowed), got {s!r}") from None
        if v <= 0:
            raise ValueError(f"values must be positive, got {s!r}")
        out.append(v)
    if not out:
        raise ValueError(f"empty list {s!r}")
    return out


def str_list(s: str) -> list[str]:
    return [t.strip() for t in str(s).split(",") if t.strip()]


def add_common_args(p, *, json_default_name: str) -> None:
    p.add_argument("--backend", choices=backends.NAMES, default=None,
                   help="cuda or emulated (default: $DFLASH_CUPY_BACKEND, else cuda if a GPU is visible)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and few repeats (CI / dry run); every code path, no meaningful numbers")
    p.add_argument("--out", default=None,
                   help=f"result JSON path (default profiling/results/[cpu/]{json_default_name})")
    p.add_argument("--seed", type=int, default=0)


def host_bench_parser(prog: str, doc: str, *, json_default_name: str, steps: str, warmup: str):
    """The parser of a host-time bench (``bench_host``, ``bench_run_host``): the common
    arguments, the emulated backend by default, ``--steps``, ``--warmup`` and ``--accept``
    (``steps``/``warmup``: what their help says the defaults are)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, json_default_name=json_default_name)
    p.set_defaults(backend="emulated")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per configuration (default {steps})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps first (default {warmup})")
    p.add_argument("--accept", type=int, default=3, help="tokens committed per step (default 3)")
    return p


def default_out(backend, name: str) -> Path:
    return (RESULTS_DIR if backend.name == "cuda" else RESULTS_DIR / "cpu") / name


# ---------------------------------------------------------------------------- environment
def device_info(backend) -> dict:
    info = {"backend": backend.name, "python": sys.version.split()[0], "numpy": np.__version__,
            "host": platform.node(), "cpu_count": os.cpu_count()}
    p = device_props.of(backend)  # what the launchers size their grids by
    info.update({"gpu": p.name, "sm_count": p.sm_count, "l2_bytes": p.l2_bytes,
                 "smem_optin_bytes": p.smem_optin})
    if backend.name == "cuda":
        try:
            import cupy
            rt = cupy.cuda.runtime
            props = rt.getDeviceProperties(rt.getDevice())
            info.update({
                "cupy": cupy.__version__, "cuda_runtime": rt.runtimeGetVersion(),
                "cuda_driver": rt.driverGetVersion(),
                "total_mem_bytes": int(props.get("totalGlobalMem", 0)),
                "cc": f"{props.get('major', '?')}.{props.get('minor', '?')}",
            })
        except Exception as e:  # informational only
            info["gpu_info_error"] = f"{type(e).__name__}: {e}"
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["emu_threads"] = getattr(backend, "threads", None)
    return info


def git_info() -> dict:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
        if head.returncode:
            return {}
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except Exception:
        return {}


def meta(backend, argv=None) -> dict:
    return {"time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": list(sys.argv[1:] if argv is None else argv),
            "device": device_info(backend), "git": git_info()}


def start_result(bench: str, backend, args, argv, extra_note: str = "") -> tuple[dict, float]:
    """Measure the copy bandwidth (the floor's yardstick, same run), print it,
    and start the result dict every bench writes. Returns (result, bytes/s)."""
    from . import timer
    copy = timer.copy_bandwidth(backend, (16 << 20) if args.smoke else None)
    print(f"copy bandwidth (read+write): {copy['GBps']:.1f} GB/s{extra_note}", flush=True)
    return ({"bench": bench, "meta": meta(backend, argv), "args": vars(args), "copy": copy},
            copy["GBps"] * 1e9)


def print_rows(label: str, rows: list[dict]) -> None:
    """One line per kernel row: time and achieved bandwidth, or the error it hit."""
    for r in rows:
        if "us" in r:
            print(f"  {label} {r['impl']:>12}{' M=%3d' % r['M'] if 'M' in r else ''}: {r['us']:9.2f} us "
                  f"{r['GBps']:7.0f} GB/s ({r['frac_of_copy_bw']:.2f} of copy)", flush=True)
        else:
            print(f"  {label} {r['impl']:>12}: {r['error']}", flush=True)


def add_rows(result: dict, rows: list[dict], out, backend) -> None:
    """Keep a finished configuration's rows: into the result, onto disk at once
    (a later timeout loses nothing), device memory freed for the next one."""
    result["rows"].extend(rows)
    write_json(out, result)
    free_device_memory(backend)


def finish(result: dict, out, table) -> dict:
    print(format_table([r for r in result["rows"] if "us" in r], table))
    print(f"results: {out}")
    return result


def write_json(path, obj) -> Path:
    """Write atomically (a timeout mid-write leaves the previous file intact)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_json_default) + "\n")
    os.replace(tmp, path)
    return path


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def free_device_memory(backend) -> None:
    """Return cached blocks to the driver between configurations (CuPy pools)."""
    if backend.name != "cuda":
        return
    import gc
    gc.collect()
    try:
        import cupy
        backend.synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    except Exception:
        pass


def format_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """``cols``: (key, header, format spec); missing keys print as '-'."""
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        line = []
        for key, _, fmt in cols:
            v = r.get(key)
            line.append("-" if v is None else (format(v, fmt) if fmt else str(v)))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


# ---------------------------------------------------------------------------- random data on the backend
def _xp(backend):
    if backend.name == "cuda":
        import cupy
        return cupy
    return np


def _rng(backend, seed: int):
    if backend.name == "cuda":
        import cupy
        return cupy.random.RandomState(int(seed))
    return np.random.default_rng(int(seed))


CHUNK_ELEMS = 1 << 24  # elements drawn per chunk (64 MiB of float32 scratch)


def _fill(backend, out, seed: int, scale: float, convert) -> None:
    """Draw N(0, scale^2) float32 rows into ``out`` chunk by chunk through ``convert``."""
    rs = _rng(backend, seed)
    rows = out.shape[0]
    cols = int(np.prod(out.shape[1:], dtype=np.int64)) if out.ndim > 1 else 1
    step = max(1, CHUNK_ELEMS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = rs.standard_normal((r1 - r0,) + tuple(out.shape[1:]), dtype=np.float32)
        if scale != 1.0:
            x *= np.float32(scale)
        out[r0:r1] = convert(x)
    backend.synchronize()  # CuPy drew on the default stream; the step runs on others


def _to_bf16_bits(x):
    """float32 -> bf16 bit patterns (uint16), round to nearest even (finite inputs)."""
    xp = np if isinstance(x, np.ndarray) else _cupy()
    u = x.view(xp.uint32)
    u = u + (xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1)))
    return (u >> 16).astype(xp.uint16)


def _cupy():
    import cupy
    return cupy


def random_bf16(backend, shape, *, scale: float = 1.0, seed: int = 0):
    """A device array of bf16 bit patterns (uint16) ~ N(0, scale^2)."""
    out = backend.empty(tuple(shape), np.uint16)
    _fill(backend, out, seed, scale, _to_bf16_bits)
    return out


def random_f16(backend, shape, *, scale: float = 1.0, seed: int = 0):
    out = backend.empty(tuple(shape), np.float16)
    _fill(backend, out, seed, scale, lambda x: x.astype(np.float16))
    return out


def random_f32(backend, shape, *, scale: float = 1.0, seed: int = 0):
    out = backend.empty(tuple(shape), np.float32)
    _fill(backend, out, seed, scale, lambda x: x)
    return out


def _norm_scale(backend, n: int, seed: int, rows: int | None = None):
    rng = np.random.default_rng(seed)
    shape = (n,) if rows is None else (rows, n)
    return backend.asarray(rng.uniform(0.8, 1.2, size=shape).astype(np.float32))


class _Layer:
    """The attributes ``DraftKvCache`` reads from ``DeviceWeights.layers[i]``."""

    def __init__(self, backend, c: DraftConfig, i: int, seed: int):
        H, s = c.hidden_size, seed + 100 * (i + 1)
        self.input_layernorm = _norm_scale(backend, H, s)
        self.post_attention_layernorm = _norm_scale(backend, H, s + 1)
        self.q_norm = _norm_scale(backend, c.head_dim, s + 2)
        self.k_norm = _norm_scale(backend, c.head_dim, s + 3)
        self.w_qkv = random_bf16(backend, (c.q_dim + 2 * c.kv_dim, H), scale=H ** -0.5, seed=s + 4)
        self.w_kv = self.w_qkv[c.q_dim:]  # [k; v] rows, as DeviceWeights lays them out
        self.w_o = random_bf16(backend, (H, c.q_dim), scale=c.q_dim ** -0.5, seed=s + 5)
        self.w_gate_up = random_bf16(backend, (2 * c.intermediate_size, H), scale=H ** -0.5,
                                     seed=s + 6)
        self.w_down = random_bf16(backend, (H, c.intermediate_size),
                                  scale=c.intermediate_size ** -0.5, seed=s + 7)
        gate_rows = {"none": 0, "head": c.n_head, "element": c.q_dim}[c.attn_gate]
        self.w_attn_gate = (random_bf16(backend, (gate_rows, H), scale=H ** -0.5, seed=s + 8)
                            if gate_rows else None)
        self.sliding = c.is_sliding(i)
        # DFlash 2: the convolutions' projections (bf16) and bases (f32 [2, taps, H], tiny)
        self.conv_a_kp = self.conv_a_base = self.conv_m_kp = self.conv_m_base = None
        d2 = c.dflash2
        if d2 is not None:
            P = d2.projection_rows(H)
            self.conv_a_kp = random_bf16(backend, (P, H), scale=H ** -0.5, seed=s + 9)
            self.conv_m_kp = random_bf16(backend, (P, H), scale=H ** -0.5, seed=s + 10)
            self.conv_a_base = _norm_scale(backend, H, s + 11, rows=2 * d2.conv_kernel_size).reshape(2, -1, H)
            self.conv_m_base = _norm_scale(backend, H, s + 12, rows=2 * d2.conv_kernel_size).reshape(2, -1, H)

    def arrays(self):
        yield from (self.input_layernorm, self.post_attention_layernorm, self.q_norm, self.k_norm,
                    self.w_qkv, self.w_o, self.w_gate_up, self.w_down)
        if self.w_attn_gate is not None:
            yield self.w_attn_gate
        if self.conv_a_kp is not None:
            yield from (self.conv_a_kp, self.conv_a_base, self.conv_m_kp, self.conv_m_base)


class RandomDeviceWeights:
    """Random bf16 weights in ``DeviceWeights``' layout, drawn on the backend."""

    def __init__(self, config: DraftConfig, backend, seed: int = 0):
        c = self.config = config
        self.backend = backend
        H = c.hidden_size
        self.fc = random_bf16(backend, (H, c.fc_in), scale=c.fc_in ** -0.5, seed=seed + 1)
        self.hidden_norm = _norm_scale(backend, H, seed + 2)
        self.norm = _norm_scale(backend, H, seed + 3)
        self.aux_norms = _norm_scale(backend, H, seed + 4, rows=c.n_captured) if c.aux_hidden_norms \
            else None
        self.layers = [_Layer(backend, c, i, seed) for i in range(c.n_layer)]
        arrays = [self.fc, self.hidden_norm, self.norm] + ([self.aux_norms] if self.aux_norms is not None
                                                           else [])
        self.selector_hp = self.selector_pred = self.selector_succ = None
        d2 = c.dflash2
        if d2 is not None:   # DFlash 2: the candidate selector's projection and codebooks
            R, V = d2.selector_rank, d2.vocab_size
            self.selector_hp = random_bf16(backend, (R, H), scale=H ** -0.5, seed=seed + 5)
            self.selector_pred = random_bf16(backend, (V, R), scale=R ** -0.5, seed=seed + 6)
            self.selector_succ = random_bf16(backend, (V, R), scale=R ** -0.5, seed=seed + 7)
            arrays += [self.selector_hp, self.selector_pred, self.selector_succ]
        for L in self.layers:
            arrays.extend(L.arrays())
        self.nbytes = sum(int(a.nbytes) for a in arrays)


class RandomDraftWeights(DraftWeights):
    """A ``DraftWeights`` whose only form is random bf16 on one backend
    (no host tensors): ``device(backend)`` returns the placed weights."""

    def __init__(self, config: DraftConfig, backend=None, seed: int = 0):
        be = backends.get(backend)
        super().__init__(config, {}, placed={be.name: RandomDeviceWeights(config, be, seed)})


RING_BLOCK_ROWS = 4096


def fill_ring(ring, backend, seed: int = 0) -> None:
    """Write random feature rows for positions ``[0, ring.capacity)``."""
    cap, fc_in = ring.capacity, ring.fc_in
    blk = min(RING_BLOCK_ROWS, cap)
    if backend.name == "cuda":
        kind = ring.kind
        make = {"bf16": random_bf16, "f16": random_f16, "f32": random_f32}[kind]
        block = make(backend, (blk, fc_in), seed=seed)
    else:  # the emulator's FeatureRing takes host rows (device arrays are NumPy arrays there)
        block = np.random.default_rng(seed).standard_normal((blk, fc_in), dtype=np.float32)
    for start in range(0, cap, blk):
        n = min(blk, cap - start)
        ring.write(start, block[:n])
    del block
