"""profiling/: each benchmark's smoke mode end to end (tiny shapes), the byte
counts it reports against a hand count, the shared timer, the fast random
weights, and gpu_check.sh's dry run.

Runs on the emulated backend always and on CuPy when a GPU is visible (the
GPU machine's test run thereby exercises the benches' CUDA paths first).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dflash_cupy.ops.step_descriptor import DESC_LEN
from dflash_cupy import backends
from dflash_cupy.weights import DraftWeights
from profiling import (bench_attention, bench_gemm, bench_host, bench_step, common, run_differential,
                       summarize, timer)

from tests.support.gpu_check_run import recorded_commands

ROOT = Path(__file__).resolve().parent.parent
TINY = common.drafter_config("tiny")


DESC = 4 * DESC_LEN   # one step descriptor, bytes


def _align32(x):
    return -(-x // 32) * 32


# --------------------------------------------------------------------------- hand counts (tiny drafter)
def _tiny_dims():
    c = TINY
    assert (c.n_layer, c.hidden_size, c.n_head, c.n_head_kv, c.head_dim, c.intermediate_size,
            c.block_size, c.n_captured) == (2, 32, 4, 2, 8, 64, 4, 2), "hand counts assume this drafter"
    return dict(L=2, H=32, NH=4, NKV=2, D=8, I=64, B=4, FC=64, QD=32, KVW=16, A=10)


def hand_append(m, n_new, noise_positions, layers=True):
    """bytes of plan_append + gather + feature fusion over m rows (bf16 ring), and
    with ``layers`` the bulk append's per-layer [k; v] GEMM + RoPE."""
    d = _tiny_dims()
    L, H, D, FC, KVW = d["L"], d["H"], d["D"], d["FC"], d["KVW"]
    act = DESC + 2 * m * 4 + n_new * 4 + (d["B"] * 4 if noise_positions else 0)
    feat = n_new * FC * 2 + m * FC * 4
    w = H * FC * 2                                     # fc
    act += m * FC * 4 + m * H * 4                      # fc x, y
    act += (2 * m + 1) * H * 4                         # hidden_norm
    kv_write = 0
    for _ in range(L if layers else 0):
        w += 2 * KVW * H * 2                           # [k; v] rows
        act += m * H * 4 + m * 2 * KVW * 4             # kv gemm x, y
        act += m * 2 * KVW * 4 + 2 * m * 4 + D * 4 + (D // 2) * 8   # rope: qkv, pos+rows, k_norm, inv_freq
        kv_write += 2 * m * KVW * 2
    return dict(weights=w, activations=act, features=feat, kv_cache_write=kv_write)


def hand_step(window, n_new):
    d = _tiny_dims()
    L, H, NH, NKV, D, I, B, QD, KVW, A = (d[k] for k in ("L", "H", "NH", "NKV", "D", "I", "B", "QD",
                                                         "KVW", "A"))
    S = _align32(window + B + 1)
    ap = hand_append(A, n_new, True, layers=False)     # the layers do the appended rows
    M = A + B                                          # rows of the per-layer qkv GEMM and RoPE
    w, act, kvw_ = ap["weights"], ap["activations"] + 2 * DESC, ap["kv_cache_write"]
    masks = DESC + window * 4 + B * S * 2
    act += 2 * B * H * 4                               # h <- noise_embed
    kv_read = 0
    for _ in range(L):
        act += H * 4                                   # input_layernorm scale (folded into the qkv GEMM)
        w += (QD + 2 * KVW) * H * 2
        act += M * H * 4 + M * (QD + 2 * KVW) * 4      # qkv gemm, appended + noise rows
        act += M * (QD + 2 * KVW) * 4 + 2 * M * 4 + 2 * D * 4 + (D // 2) * 8 + M * QD * 4  # rope + q out
        kvw_ += 2 * M * KVW * 2
        kv_read += 2 * S * NKV * D * 2                 # attention K, V (n_splits == 1 here)
        masks += B * S * 2
        act += 2 * B * NH * D * 4                      # attention q, out
        w += H * QD * 2
        act += B * QD * 4 + 2 * B * H * 4              # o gemm (+ residual)
        act += H * 4                                   # post_attention_layernorm scale (folded into gate_up)
        w += 2 * I * H * 2
        act += B * H * 4 + B * I * 4                   # gate_up (silu_mul)
        w += H * I * 2
        act += B * I * 4 + 2 * B * H * 4               # down (+ residual)
    act += (2 * B + 1) * H * 4                         # final norm
    out = dict(weights=w, lm_head=0, kv_cache_read=kv_read, kv_cache_write=kvw_, masks=masks,
               features=ap["features"], activations=act)
    out["total"] = sum(out.values())
    return out


def hand_legacy(window, bulk_chunk=256):
    assert window <= bulk_chunk
    bulk = hand_append(window, window, False)
    step = hand_step(window, 0)
    out = dict(step)
    for k, v in bulk.items():
        out[k] += v
    out["activations"] += window * 4                   # reset_slots
    out["total"] = sum(v for k, v in out.items() if k != "total")
    return out


# --------------------------------------------------------------------------- smoke runs
def test_bench_step_smoke_bytes(backend, tmp_path):
    out = tmp_path / "step.json"
    accept = 3
    res = bench_step.main(["--smoke", "--backend", backend.name, "--out", str(out), "--no-plot",
                           "--windows", "32,64", "--warmup", "2", "--repeats", "2", "--inner", "1",
                           "--legacy-repeats", "1", "--accept", str(accept)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(res["rows"]))
    bw = saved["copy"]["GBps"] * 1e9
    seen = set()
    for r in saved["rows"]:
        assert "skipped" not in r, r
        seen.add((r["window"], r["mode"]))
        want = hand_legacy(r["window"]) if r["mode"] == "legacy" else hand_step(r["window"], accept)
        assert r["bytes"] == want, (r["window"], r["mode"])
        assert r["bytes_total"] == want["total"]
        assert r["kv_total"] == _align32(r["window"] + 4 + 1)
        # the rates are the hand-counted bytes over the measured time
        med = r["timing"]["median_us"] * 1e-6
        assert r["GBps"] == pytest.approx(want["total"] / med / 1e9)
        assert r["floor_us"] == pytest.approx(want["total"] / bw * 1e6)
        assert r["hidden_finite"]
        assert r["timing"]["samples"] == (1 if r["mode"] == "legacy" else 2)
    assert seen == {(w, m) for w in (32, 64) for m in ("graph", "eager", "legacy")}
    assert set(saved["summary"]["tiny"]) == {"graph", "eager", "legacy"}


def test_bench_step_legacy_window_cap_and_merge(backend, tmp_path):
    first = tmp_path / "a.json"
    bench_step.main(["--smoke", "--backend", backend.name, "--out", str(first), "--no-plot", "--windows", "32",
                     "--modes", "graph,legacy", "--legacy-max-window", "16", "--warmup", "1",
                     "--repeats", "1", "--inner", "1"])
    rows = json.loads(first.read_text())["rows"]
    assert [(r["mode"], "skipped" in r) for r in rows] == [("graph", False), ("legacy", True)]
    second = tmp_path / "b.json"
    res = bench_step.main(["--smoke", "--backend", backend.name, "--out", str(second), "--no-plot",
                           "--windows", "32", "--modes", "graph", "--merge", str(first)])
    assert [r.get("merged_from") for r in res["rows"]] == [str(first)] * 2


@pytest.mark.slow
def test_bench_gemm_smoke_bytes(backend, tmp_path):
    res = bench_gemm.main(["--smoke", "--backend", backend.name, "--out", str(tmp_path / "g.json"),
                           "--ms", "16,34,64", "--warmup", "1", "--repeats", "2", "--mma-sync"])
    cublas = [r for r in res["rows"] if r["impl"] == "cublas_f16"]
    if backend.name == "cuda":  # the comparison may fail (it records why), but it must have run
        assert {r["shape"] for r in cublas} == {"fc", "kv", "qkv", "o", "gate_up", "down"}
        assert all("us" in r or "error" in r for r in cublas)
    else:
        assert not cublas
    H, FC, QD, KVW, I = 32, 64, 32, 16, 64
    shapes = {  # name: (weight rows, K, N, residual)
        "fc": (H, FC, H, False), "kv": (2 * KVW, H, 2 * KVW, False),
        "qkv": (QD + 2 * KVW, H, QD + 2 * KVW, False), "o": (H, QD, H, True),
        "gate_up": (2 * I, H, I, False), "down": (H, I, H, True)}
    rows = [r for r in res["rows"] if r["impl"] == "dflash"]
    assert {(r["shape"], r["M"]) for r in rows} == {(s, m) for s in shapes for m in (16, 34, 64)}
    # M = 64 takes the wgmma kernel (sm_90a: the emulator; a Hopper GPU that passes its self-check)
    wg = {r["shape"]: r["config"][0] for r in rows if r["M"] == 64}
    if backend.name != "cuda":
        assert set(wg.values()) == {"wg64"}
    forced = [r for r in res["rows"] if r["impl"] == "dflash_mma_sync"]
    assert {(r["shape"], r["M"]) for r in forced} == {(s, m) for s in shapes for m in (16, 34, 64)}
    assert all(isinstance(r["config"][0], int) for r in forced)
    rows += forced
    for r in rows:
        wr, K, N, resid = shapes[r["shape"]]
        want = wr * K * 2 + r["M"] * K * 4 + r["M"] * N * 4 * (2 if resid else 1)
        assert r["bytes"] == want, r["shape"]
        assert r["weight_bytes"] == wr * K * 2
        assert r["GBps"] == pytest.approx(want / (r["us"] * 1e-6) / 1e9)
        assert r["out_finite"]


def test_bench_attention_smoke_bytes(backend, tmp_path):
    res = bench_attention.main(["--smoke", "--backend", backend.name, "--out", str(tmp_path / "a.json"),
                                "--warmup", "1", "--repeats", "2"])
    B, NH, NKV, D = 4, 4, 2, 8
    other = [r for r in res["rows"] if r["impl"] != "dflash"]
    assert len(other) == (2 if backend.name == "cuda" else 0)
    rows = [r for r in res["rows"] if r["impl"] == "dflash"]
    assert [r["window"] for r in rows] == [32, 64]
    for r in rows:
        S = _align32(r["window"] + B + 1)
        assert r["kv_total"] == S and r["n_splits"] == 1
        want = 2 * S * NKV * D * 2 + 2 * B * NH * D * 4 + B * S * 2
        assert r["bytes"] == want
        assert r["kv_bytes"] == 2 * S * NKV * D * 2
        assert r["out_finite"]


def test_bench_host_smoke_json_line(backend, tmp_path, capsys):
    res = bench_host.main(["--smoke", "--backend", backend.name, "--json", "--out", str(tmp_path / "h.json"),
                           "--steps", "100", "--warmup", "10"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    d = json.loads(last)
    assert list(d) == ["host_us_per_step"]
    assert list(d["host_us_per_step"]) == ["32", "64"]
    for v in d["host_us_per_step"].values():
        assert 0 < v < 1000  # sanity only: the 10 us target is for bench_host's full run
    assert d["host_us_per_step"] == res["host_us_per_step"]
    assert [r["steps"] for r in res["rows"]] == [100, 100]


def test_bench_run_host_smoke_json_line(emu, tmp_path, capsys):
    """bench_run_host: a whole step's host time (replay stubbed) for a single cache and a
    batch side by side; every part timed, and the stubbed steps still advance the lanes."""
    from profiling import bench_run_host
    res = bench_run_host.main(["--smoke", "--json", "--out", str(tmp_path / "r.json"), "--steps", "20",
                               "--warmup", "2", "--capacities", "32", "--lanes", "1,3", "--clock", "thread"])
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(d) == ["step_host_us"] and list(d["step_host_us"]) == ["single 32", "lanes 1", "lanes 3"]
    assert d["step_host_us"] == res["step_host_us"]
    for r in res["rows"]:
        for k in ("step_us", "begin_step_us", "set_noise_embed_us", "run_us"):
            assert 0 < r[k] < 10000, (r["config"], k)   # sanity only: the figures are the bench's
    with pytest.raises(RuntimeError, match="captured before"):   # nothing to stub before a capture
        bench_run_host.stub_replays(type("E", (), {"graphs": type("G", (), {"slots": [None, None]})()})())

# --------------------------------------------------------------------------- timer
def test_timer_counts_calls_and_orders_stats(backend):
    calls = []
    src = backend.asarray(np.arange(1024, dtype=np.float32))
    dst = backend.zeros((1024,), np.float32)
    stream = backend.stream()

    def fn():
        calls.append(1)
        backend.copy_d2d_async(dst, src, stream=stream)

    t = timer.measure(fn, backend, stream=stream, warmup=2, repeats=5, inner=3)
    assert len(calls) == 2 + 5 * 3
    d = t.as_dict()
    assert d["samples"] == 5 and d["inner"] == 3
    assert 0 < d["min_us"] <= d["p10_us"] <= d["median_us"] <= d["p90_us"]
    assert d["method"] == ("cuda-events" if backend.name == "cuda" else "perf_counter")
    np.testing.assert_array_equal(backend.to_numpy(dst), np.arange(1024, dtype=np.float32))


def test_timer_budget_and_graph(backend):
    src = backend.asarray(np.arange(256, dtype=np.float32))
    dst = backend.zeros((256,), np.float32)
    stream = backend.stream()
    g = timer.capture(backend, stream, lambda: backend.copy_d2d_async(dst, src, stream=stream), inner=4)
    t = timer.measure(lambda: (g.launch(stream), time.sleep(0.002)), backend, stream=stream, warmup=0,
                      repeats=50, min_repeats=3, budget_s=0.001)
    assert len(t.samples_s) == 3
    np.testing.assert_array_equal(backend.to_numpy(dst), np.arange(256, dtype=np.float32))
    with pytest.raises(ValueError, match="repeats"):
        timer.measure(lambda: None, backend, repeats=0)


def test_copy_bandwidth_counts_read_plus_write_over_the_median(backend, monkeypatch):
    """A known timing gives a known rate: read + write bytes over the median sample."""
    def fake_measure(fn, be, **kw):
        return timer.Timing(samples_s=[4e-3, 1e-3, 2e-3], inner=1)

    monkeypatch.setattr(timer, "measure", fake_measure)
    r = timer.copy_bandwidth(backend, 1 << 20, repeats=3)
    assert r["bytes_moved"] == 2 << 20
    assert r["GBps"] == pytest.approx((2 << 20) / 2e-3 / 1e9)   # median sample: 2 ms
    assert r["timing"]["median_us"] == pytest.approx(2000.0)


# --------------------------------------------------------------------------- random weights
def test_bf16_rounding_matches_ml_dtypes(backend):
    x = np.random.default_rng(3).standard_normal(4099).astype(np.float32) * np.float32(7.5)
    x[:4] = [0.0, -0.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]  # exact ties round to even
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    if backend.name == "cuda":
        import cupy
        got = cupy.asnumpy(common._to_bf16_bits(cupy.asarray(x)))
    else:
        got = common._to_bf16_bits(x)
    np.testing.assert_array_equal(got, want)


def test_random_weights_match_device_weights_layout(emu):
    cfg = TINY.replace(attn_gate="head", aux_hidden_norms=True)
    real = DraftWeights.random(cfg, seed=1, dtype="bf16").device(emu)
    fast = common.RandomDraftWeights(cfg, emu, seed=1)
    dev = fast.device(emu)

    def layout(obj):
        return {k: (None if v is None else (tuple(v.shape), np.dtype(v.dtype)))
                for k, v in vars(obj).items() if hasattr(v, "shape") or v is None}

    assert layout(dev) == layout(real)
    for a, b in zip(dev.layers, real.layers):
        assert layout(a) == layout(b)
        assert a.sliding == b.sliding
    assert dev.nbytes == real.nbytes
    w = emu.to_numpy(dev.layers[0].w_gate_up)
    vals = (w.astype(np.uint32) << 16).view(np.float32)
    assert abs(vals.std() * np.sqrt(cfg.hidden_size) - 1) < 0.1  # N(0, 1/H) entries
    with pytest.raises(ValueError, match="live on"):
        fast.device(backends.get("cuda") if backends.gpu_available() else _OtherBackend())


class _OtherBackend(backends.Backend):
    name = "other"
    empty = zeros = asarray = to_numpy = pinned_empty = is_device_array = compile = None
    stream = event = copy_h2d_async = copy_d2h_async = copy_d2d_async = synchronize = None
    current_stream = as_stream = None
    begin_capture = end_capture = is_capturing = None


# --------------------------------------------------------------------------- helpers, plot, summary
def test_int_list_and_table():
    assert common.int_list("256,1K,32k") == [256, 1024, 32768]
    with pytest.raises(ValueError):
        common.int_list("12,x")
    with pytest.raises(ValueError):
        common.int_list("0")
    t = common.format_table([{"a": 1.5, "b": "x"}, {"a": None}], [("a", "A", ".1f"), ("b", "B", "")])
    assert t.splitlines() == ["  A  B", "1.5  x", "  -  -"]


def test_plot_and_summary(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [{"drafter": "d", "window": w, "mode": m, "us_per_step": us, "floor_us": 10.0,
             "ratio_to_floor": us / 10.0, "bytes_total": 1000}
            for w, us in ((256, 11.0), (1024, 12.0)) for m in ("graph", "eager")]
    result = {"bench": "step", "rows": rows, "copy": {"GBps": 100.0},
              "meta": {"device": {"backend": "emulated"}}, "summary": bench_step.summarize(rows)}
    png = bench_step.plot(result, tmp_path / "p.png")
    assert png is not None and png.stat().st_size > 1000
    (tmp_path / "step.json").write_text(json.dumps(result))
    assert summarize.main(["--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "graph step grows x1.091" in out


# --------------------------------------------------------------------------- scripts
@pytest.mark.slow
@pytest.mark.skipif(backends.gpu_available(), reason="the CPU dry run; the GPU machine runs the real check")
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gc"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("DFLASH_CUPY_BACKEND", None)
    p = subprocess.run(["bash", str(ROOT / "profiling" / "gpu_check.sh"), str(out), "--dry-run"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    bench = out / "bench.log"
    assert p.returncode == 0, (p.stdout[-4000:] + p.stderr[-2000:]
                               + (bench.read_text()[-3000:] if bench.exists() else ""))
    files = sorted(f.name for f in out.iterdir())
    assert len(files) <= 8, files
    for name in ("gpu_check.log", "tests.log", "bench.log", "step_quick.json", "gemm.json",
                 "attention.json", "step.json"):
        assert name in files, files
    step = json.loads((out / "step.json").read_text())
    assert {(r["window"], r["mode"]) for r in step["rows"]} == \
        {(w, m) for w in (32, 64) for m in ("graph", "eager", "legacy", "kernels")}
    assert "nodes, their own times sum to" in p.stdout     # the summary's per-kernel lines
    assert "FINISHED ok" in p.stdout and "host_us_per_step" in (out / "bench.log").read_text()


def test_gpu_check_fails_early_without_gpu(tmp_path):
    if backends.gpu_available():
        pytest.skip("a GPU is visible")
    env = dict(os.environ, PYTHON=sys.executable)
    p = subprocess.run(["bash", str(ROOT / "profiling" / "gpu_check.sh"), str(tmp_path / "o")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "FATAL" in p.stdout and "START tests" not in p.stdout


def test_shell_scripts_parse():
    for name in ("gpu_check.sh", "nsys_step.sh"):
        p = subprocess.run(["bash", "-n", str(ROOT / "profiling" / name)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr


def test_gpu_check_real_commands_parse(tmp_path):
    """The non-dry (GPU) command lines, recorded by a stand-in python, must be
    accepted by each bench's own argument parser (no GPU needed)."""
    cmds = recorded_commands(tmp_path, DFLASH_CUPY_BACKEND="emulated")  # the script must unset it
    assert cmds[0][:2] == ["-", "0"]  # preflight, real mode
    assert cmds[1][1:3] == ["dflash_cupy", "selfcheck"] and "--only" not in cmds[1]  # the whole self-check first
    cmds = cmds[:1] + cmds[2:]
    mods = [c[1] for c in cmds[1:]]
    assert mods == ["pytest", "profiling.run_differential", "profiling.bench_step", "profiling.pdl_check",
                    "profiling.bench_lanes",
                    "profiling.bench_gemm", "profiling.bench_attention", "profiling.bench_step",
                    "profiling.bench_host", "profiling.soak", "profiling.summarize"]
    pytest_args = cmds[1][2:]
    assert pytest_args[-3:] == ["--maxfail=25", "-k", "not emulated"] and "tests" in pytest_args
    diff = run_differential.parse_args(cmds[2][2:])  # the kernel tests' emulated cases, against the GPU
    assert diff.mode == "1" and "tests/test_gemm.py" in diff.files and diff.timeout_s == 95
    assert diff.pytest_args == ["--maxfail=40", "-k", "emulated"]
    cmds = cmds[:2] + cmds[3:]
    from profiling import pdl_check
    pc = pdl_check.parse_args(cmds[3][2:])   # the step with and without PDL, h4096
    assert not pc.smoke and pc.drafter == "h4096" and pc.windows == [2048, 8192] and pc.repeats == 10
    cmds = cmds[:3] + cmds[4:]
    from profiling import bench_lanes
    lanes = bench_lanes.parse_args(cmds[3][2:])   # the batch at 1/4/16 lanes, qwen3-8b, both roundings
    assert lanes.lanes == [1, 4, 16] and lanes.drafter == "qwen3-8b" and lanes.splits == (True, False)
    cmds = cmds[:3] + cmds[4:]
    parsers = {"profiling.bench_step": bench_step.parse_args, "profiling.bench_gemm": bench_gemm.parse_args,
               "profiling.bench_attention": bench_attention.parse_args,
               "profiling.bench_host": bench_host.parse_args, "profiling.summarize": None,
               "profiling.soak": None}
    for c in cmds[2:]:
        if parsers[c[1]] is not None:
            a = parsers[c[1]](c[2:])
            assert not a.smoke
    quick, full = bench_step.parse_args(cmds[2][2:]), bench_step.parse_args(cmds[5][2:])
    assert quick.drafters == ["qwen3.5-27b"] and quick.windows == [256, 4096, 32768]
    assert full.drafters == ["qwen3.5-27b", "h4096"] and full.merge.endswith("step_quick.json")
    assert quick.kernel_times == full.kernel_times == 5   # every node timed: the model's per-kernel check
    assert bench_host.parse_args(cmds[6][2:]).backend == "cuda"
    from profiling import soak
    sa = soak.parse_args(cmds[7][2:])
    assert sa.steps == 100000 and sa.max_seconds and sa.check_every == 500


# The lane counts of gpu_check.sh's dry run (test_gpu_check_dry_run), which the smoke test
# uses too: the same compiled variants serve both, built once in a suite.
DRY_RUN_LANES = "1,3"


def test_dry_run_steps_the_smoke_tests_lanes(tmp_path):
    cmds = recorded_commands(tmp_path, "--dry-run")
    lanes = [c for c in cmds if c[1:2] == ["profiling.bench_lanes"]]
    assert len(lanes) == 1 and lanes[0][lanes[0].index("--lanes") + 1] == DRY_RUN_LANES, lanes


@pytest.mark.slow
def test_bench_lanes_smoke(tmp_path):
    """bench_lanes on the emulator: every row, the per-lane arithmetic, one
    batch for every lane count (its step graphs captured twice in all), and
    the model's prediction for a named preset."""
    from profiling import bench_lanes, lanes_model
    from profiling.hw_params import get_gpu
    out = tmp_path / "lanes.json"
    res = bench_lanes.main(["--smoke", "--backend", "emulated", "--out", str(out), "--x-split", "both",
                            "--lanes", DRY_RUN_LANES])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["x_split"], r["active"]) for r in rows] == [("split", 1), ("split", 3), ("single", 1), ("single", 3)]
    for r in rows:
        assert r["hidden_finite"] and r["captures"] == 2
        assert r["us_per_lane"] == pytest.approx(r["us_per_step"] / r["active"])
        assert r["vs_single"] == pytest.approx(r["us_per_lane"] / r["single_us"])
        assert r["predicted_us"] is None          # no model for the tiny preset
    assert res["rows"] == rows
    a = bench_lanes.parse_args(["--drafter", "qwen3-8b", "--window", "2K", "--lanes", "4"])
    want = lanes_model.model_batch("qwen3-8b", 2048, 4, get_gpu("H200"), accept=6)["step_us"]
    assert bench_lanes._predict(a, 4, True) == pytest.approx(want)


def test_bench_attention_both_merges(tmp_path):
    """--merges both: the default configuration and the other merge at the same
    split count, side by side (the fold/launch crossover is the model's guess)."""
    res = bench_attention.main(["--smoke", "--backend", "emulated", "--out", str(tmp_path / "a.json"),
                                "--warmup", "1", "--repeats", "2", "--windows", "2K", "--merges", "both"])
    rows = [r for r in res["rows"] if r["impl"].startswith("dflash")]
    assert len(rows) == 2
    d, o = rows
    assert d["impl"] == "dflash" and d["n_splits"] > 1 and d["merge"] in ("fold", "launch")
    assert o["impl"] == f"dflash {o['merge']}" and {d["merge"], o["merge"]} == {"fold", "launch"}
    assert o["n_splits"] == d["n_splits"] and o["bytes"] == d["bytes"] and d["out_finite"] and o["out_finite"]
