"""Per-kernel step times without nsys (profiling/kernel_times.py) and the launch
observer it stands on (backends.base.observe_launches), on the emulated backend:
the node sequence and labels must be the cost model's, node for node."""
import time

import numpy as np
import pytest

from dflash_cupy import backends, kernels
from dflash_cupy.backends.base import notify_launch, observe_launches
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.ops.norm import RmsNorm
from profiling import common, kernel_times, perf_model
from profiling.step_trace import trace_step


@pytest.fixture(scope="module")
def be():
    return backends.get("emulated")


def test_observer_sees_kernels_and_copies_in_order(be):
    seen = []
    x = be.asarray(np.ones((3, 19), np.float32))
    w = be.asarray(np.ones(19, np.float32))
    y = be.zeros((3, 19), np.float32)
    host = be.pinned_empty((3, 19), np.float32)
    host[...] = 2.0
    norm = RmsNorm(be, 19)
    s = be.stream()
    be.synchronize()                              # zeros() wrote y on the default stream
    with observe_launches(lambda *a: seen.append(a)):
        be.copy_h2d_async(x, host, stream=s)
        norm(x, w, y, stream=s)
        be.copy_d2d_async(x, y, stream=s)
    norm(x, w, y, stream=s)                       # outside: not observed
    be.synchronize()
    assert [(k, n) for k, n, _, _ in seen] == [("copy", "h2d"), ("kernel", "rmsnorm"), ("copy", "d2d")]
    assert seen[0][2][0] is x and seen[0][2][1] is host and all(a[3] is s for a in seen)
    assert seen[1][2]["x"] is x and seen[1][2]["y"] is y   # the kernel's arguments by parameter name
    np.testing.assert_allclose(be.to_numpy(y), 1.0, rtol=1e-6)


def test_observers_nest_and_unwind_on_error():
    calls = []
    with observe_launches(lambda *a: calls.append("outer")):
        with pytest.raises(KeyError):
            with observe_launches(lambda *a: calls.append("inner")):
                notify_launch("kernel", "k", {}, None)
                raise KeyError("boom")
        notify_launch("kernel", "k", {}, None)
    notify_launch("kernel", "k", {}, None)         # nothing observes any more
    assert calls == ["inner", "outer", "outer"]
    with pytest.raises(TypeError, match="fn must be callable"):
        with observe_launches(3):
            pass


def test_hold_stream_holds(be):
    hold = kernels.load_module(be, "hold.cu").get_function("hold_stream")
    hold((1,), (1,), (np.int64(0),))
    be.synchronize()
    t0 = time.perf_counter()
    hold((1,), (1,), (np.int64(3_000_000),))       # 3 ms of the emulator's nanosecond clock
    be.synchronize()
    assert time.perf_counter() - t0 >= 3e-3


def _cache(be, name, window, accept):
    cfg = common.drafter_config(name)
    w = common.RandomDraftWeights(cfg, be, seed=1)
    ring = FeatureRing(window + 8 * accept + 32, cfg.n_captured, cfg.hidden_size, dtype=np.float32, backend=be)
    common.fill_ring(ring, be, seed=2)
    kv = DraftKvCache(w, window, backend=be)
    kv.set_noise_embed(np.random.default_rng(3).standard_normal((cfg.q_len, cfg.hidden_size)).astype(np.float32))
    kv.begin_step(ring, window)        # prefill (bulk append) and the first graph
    kv.run()
    kv.synchronize()
    state = {"c": window}

    def advance():
        state["c"] += accept
        return state["c"]
    return cfg, kv, ring, advance


def test_step_nodes_are_the_cost_models_nodes(be):
    window, accept = 40, 3
    cfg, kv, ring, advance = _cache(be, "tiny", window, accept)
    try:
        before = be.to_numpy(kv.hidden_states)
        t = kernel_times.step_kernel_times(kv, ring, advance, repeats=2)
        plan = trace_step(cfg, window, accept=accept)
        want = [kernel_times.node_label(n) for n in plan.nodes]
        assert t.labels == want                      # node for node, GEMM roles included
        assert any(l.endswith("[gate_up]") for l in t.labels)
        assert t.labels[0] == "memcpy h2d" and len(t.us) == len(want) == len(t.samples_us[0])
        assert len(t.samples_us) == 2 and all(u > 0 for u in t.us)
        d = t.as_dict()
        assert d["sum_us"] == pytest.approx(sum(d["kernels_us"].values()))
        assert list(d["kernels_us"]) == list(dict.fromkeys(want))   # first-appearance order
        assert d["method"].startswith("host clock") and "not a GPU time" in d["method"]
        # the steps really ran: the step's output moved on
        assert not np.array_equal(before, be.to_numpy(kv.hidden_states))
        # ... and the perf model reads the same labels for its groups
        m = perf_model.model_step("tiny", window, perf_model.get_gpu("H200"), accept=accept)
        assert set(d["kernels_us"]) == set(m["groups"])
    finally:
        kv.close()
        ring.close()


def test_bad_arguments_raise_before_any_step(be):
    window, accept = 24, 2
    cfg, kv, ring, advance = _cache(be, "tiny", window, accept)
    try:
        committed = kv.next_pos
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="repeats"):
                kernel_times.step_kernel_times(kv, ring, advance, repeats=bad)
        with pytest.raises(TypeError, match="next_committed"):
            kernel_times.step_kernel_times(kv, ring, 5)
        assert kv.next_pos == committed              # nothing was stepped
    finally:
        kv.close()
        ring.close()


def test_bench_step_kernel_row_and_the_models_comparison(tmp_path, capsys):
    from profiling import bench_step
    out = tmp_path / "step.json"
    res = bench_step.main(["--smoke", "--backend", "emulated", "--drafters", "tiny", "--windows", "32",
                           "--modes", "graph", "--kernel-times", "2", "--no-plot", "--out", str(out)])
    (k,) = [r for r in res["rows"] if r["mode"] == "kernels"]
    (g,) = [r for r in res["rows"] if r["mode"] == "graph"]
    assert k["n_nodes"] == len(k["nodes"]) and k["graph_us"] == g["us_per_step"]
    assert k["sum_us"] == pytest.approx(sum(us for _, us in k["nodes"]))
    assert "kernels:" in capsys.readouterr().out
    # An emulated run is no measurement: the model ignores it ...
    assert perf_model.load_measured(tmp_path / "none.json") == {}
    # ... and reads the same rows from a GPU run, beside its per-kernel predictions.
    import json
    doc = json.loads(out.read_text())
    doc["meta"]["device"]["backend"] = "cuda"
    m = perf_model.model_step("tiny", 32, perf_model.get_gpu("H200"))
    first = next(iter(m["groups"]))
    doc["rows"][1]["kernels_us"] = {label: e["predicted_us"] * (2.0 if label == first else 1.1)
                                    for label, e in m["groups"].items()}
    out.write_text(json.dumps(doc))
    meas = perf_model.load_measured(tmp_path / "none.json")
    assert set(meas["tiny"]["32"]) == {"step_us", "kernels"}
    agree = perf_model.kernel_agreement(m, meas["tiny"]["32"]["kernels"])
    assert agree[0][0] == first and agree[0][3] == pytest.approx(2.0)    # worst first
    text = perf_model.format_report(m, meas)
    n = len(m["groups"])
    assert f"{n - 1} of {n} groups within +-25%" in text and f"{first} x2.00" in text
    assert "meas/pred" in text and "us per node" in text
    # gpu_check's summary says the same from the JSON
    from profiling import summarize
    doc["meta"]["device"]["gpu"] = "NVIDIA H200"
    doc["rows"][1]["kernels_us"] = meas["tiny"]["32"]["kernels"]
    out.write_text(json.dumps(doc))
    summ = summarize.summarize_file(out)
    assert f"per kernel vs the model (H200): {n - 1} of {n} groups within +-25%" in summ
    assert f"{first}" in summ and "x2.00" in summ


class _FakeCudaBackend:
    """The cuda branch of step_kernel_times without a GPU: events carry a fake device
    timestamp; ``early`` says how many tries find the hold already over."""
    name = "cuda"

    def __init__(self, early):
        self.early, self.t = early, 0.0

    def is_capturing(self):
        return False

    def current_stream(self):
        return "s0"

    def synchronize(self):
        pass

    def event(self):
        be = self

        class Ev:
            def record(self, stream=None):
                be.t += 1.0             # one microsecond per node
                self.t = be.t

            def query(self):
                return be.early_now
        return Ev()


class _FakeCache:
    def __init__(self, be):
        self.backend, self.steps = be, []

    def begin_step(self, ring, committed):
        self.steps.append(committed)

    def run(self, eager=False, stream=None):
        assert eager and stream == "s0"
        notify_launch("copy", "h2d", (None, None), stream)
        notify_launch("kernel", "plan_step", {}, stream)
        notify_launch("kernel", "rmsnorm", {}, stream)


def test_the_cuda_branch_retries_a_short_hold(monkeypatch):
    be = _FakeCudaBackend(early=1)
    holds = []

    def hold(grid, block, args, stream=None):
        assert grid == (1,) and block == (1,) and stream == "s0" and isinstance(args[0], np.int64)
        holds.append(int(args[0]))
        be.early_now = len(holds) <= be.early      # the first hold ends before the host is done
    monkeypatch.setattr(kernel_times, "_hold_kernel", lambda b: hold)
    monkeypatch.setattr(kernel_times, "_clock_hz", lambda b: 1e9)
    monkeypatch.setattr(kernel_times, "_elapsed_s", lambda a, b: (b.t - a.t) * 1e-6)
    monkeypatch.setattr(kernel_times, "name_arrays", lambda kv: {})
    kv = _FakeCache(be)
    n = iter(range(100, 200))
    t = kernel_times.step_kernel_times(kv, None, lambda: next(n), repeats=2)
    assert t.labels == ["memcpy h2d", "plan_step", "rmsnorm"]
    assert len(holds) == 3 and holds[1] == 2 * holds[0] and holds[2] == holds[1]   # doubled once, then kept
    assert holds[0] >= kernel_times.HOLD_MIN_S * 1e9
    assert kv.steps == [100, 101, 102, 103]        # the unmeasured step, a retried one, two measured
    assert t.method.startswith("cuda events") and t.hold_s == pytest.approx(holds[-1] * 1e-9)
    assert len(t.us) == 3 and all(u > 0 for u in t.us)

    be2 = _FakeCudaBackend(early=99)
    holds.clear()
    monkeypatch.setattr(kernel_times, "_hold_kernel", lambda b: lambda g, bl, a, stream=None: (
        holds.append(int(a[0])), setattr(be2, "early_now", True)))
    with pytest.raises(RuntimeError, match="host still outran"):
        kernel_times.step_kernel_times(_FakeCache(be2), None, lambda: next(n), repeats=1)
    assert len(holds) == kernel_times.HOLD_TRIES
