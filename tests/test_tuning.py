"""Autotuning (dflash_cupy/tuning.py): every launch configuration a GPU may
pick computes the right result on the emulator; the choice is the timer's
fastest, cached per device and shape on disk, read back by the next GEMM,
never applied after a capture; the product classes tune their GEMM call
sites when asked and still match the oracle."""
import json

import numpy as np
import pytest

from dflash_cupy import tuning
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.ops.gemm import Gemm, gemm_reference
from tests.support.drafters import built
from tests.support.gemm import host_weights
from tests.support.tolerances import assert_close


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    # never the user's cache: every test writes its own file
    monkeypatch.setenv(tuning.ENV_CACHE, str(tmp_path / "tuning.json"))
    monkeypatch.delenv(tuning.ENV_MODE, raising=False)


def _case(be, rng, op, m):
    K, N = op.K, op.N
    xh = rng.standard_normal((m, K)).astype(np.float32)
    wh = host_weights(rng, op.w_rows, K, op.wkind)
    rh = rng.standard_normal((m, N)).astype(np.float32) if op.epilogue == "residual" else None
    return xh, wh, rh


def _check(be, op, m, xh, wh, rh, what):
    y = be.asarray(np.full((m, op.N), 7.5, np.float32))
    op(be.asarray(xh), be.asarray(wh), y, m, residual=None if rh is None else be.asarray(rh))
    ref = gemm_reference(xh, wh, op.epilogue, rh, x_round=op.x_round)
    assert_close(be.to_numpy(y), ref, "f32", what)


# ---------------------------------------------------------------- every candidate is correct
@pytest.mark.parametrize("N,K,wkind,epilogue,x_split", [
    (300, 1040, "bf16", "none", True),       # a partial column group; K = 16 steps + 16
    (70, 520, "f16", "silu_mul", True),
    (260, 840, "bf16", "residual", False),
])
@pytest.mark.slow
def test_every_candidate_matches_the_reference(emu, N, K, wkind, epilogue, x_split):
    rng = np.random.default_rng(N + K)
    op = Gemm(emu, N, K, wkind, epilogue, max_m=64, x_split=x_split)
    seen_mt, seen_ks = set(), set()
    for m in (1, 19, 33, 100):
        cands = op.launch_candidates(m)
        assert op.default_config(m) in cands and len(set(cands)) == len(cands)
        xh, wh, rh = _case(emu, rng, op, m)
        for c in cands:
            op.use_config(m, c)
            assert op.config(m) == c
            _check(emu, op, m, xh, wh, rh, f"{op!r} m={m} config={c}")
            seen_mt.add(c[0])
            seen_ks.add(c[1])
        # the split-K counters are left at zero by every configuration
        assert not emu.to_numpy(op._stream._counters).any()
    assert seen_mt == {1, 2, 4, "wg64"} and max(seen_ks) >= 8   # the wgmma kernel too (max_m = 64)


def test_candidates_respect_the_kernels_limits(emu):
    op = Gemm(emu, 512, 4096, "bf16", max_m=16)
    assert {c[0] for c in op.launch_candidates(16)} == {1}     # only the compiled variants
    assert all(1 <= ks <= 16 for _, ks in op.launch_candidates(16))
    argmax = Gemm(emu, 512, 4096, "bf16", "argmax", max_m=64, logits=False)
    assert {ks for _, ks in argmax.launch_candidates(40)} == {1}   # the fused argmax never splits K
    assert Gemm(emu, 8, 64, "f32").launch_candidates(4) == []       # the fma path has one launch
    with pytest.raises(ValueError, match="not a launch configuration"):
        op.use_config(16, (4, 1))


# ---------------------------------------------------------------- choosing, caching, reading back
def test_tune_picks_the_fastest_and_caches_it(emu, tmp_path):
    op = Gemm(emu, 300, 1040, "bf16", max_m=64)
    m = 19
    cands = op.launch_candidates(m)
    want = next(c for c in cands if c != op.default_config(m))
    times = {c: 5e-6 + 1e-7 * i for i, c in enumerate(cands)}
    times[want] = 1e-6
    ran = []

    def timer(fn):
        fn()
        ran.append(op.config(m))
        return times[op.config(m)]

    cache = tuning.TuneCache()
    entry = tuning.tune_gemm(op, m, cache=cache, timer=timer)
    assert sorted(ran, key=str) == sorted(cands, key=str)   # every candidate timed once
    assert op.config(m) == want and tuple(entry["choice"]) == want
    assert tuple(entry["default"]) == op.default_config(m)
    data = json.loads((tmp_path / "tuning.json").read_text())
    key = tuning.gemm_key(op, m)
    assert key in data["entries"] and "|m19" in key and "N300|K1040|bf16" in key
    assert len(data["entries"][key]["times_us"]) == len(cands)
    assert data["entries"][key]["times_us"][f"{want[0]},{want[1]}"] == pytest.approx(1.0)

    # a new process: a new Gemm and cache object, no timer -> the cached choice
    op2 = Gemm(emu, 300, 1040, "bf16", max_m=64)
    assert op2.config(m) == op2.default_config(m)
    e2 = tuning.tune_gemm(op2, m, cache=tuning.TuneCache())
    assert e2 is not None and op2.config(m) == want
    # another shape is not served by it
    op3 = Gemm(emu, 300, 1040, "f16", max_m=64)
    assert tuning.tune_gemm(op3, m, cache=tuning.TuneCache()) is None
    assert op3.config(m) == op3.default_config(m)


def test_gemm_keys_tell_kernel_variants_apart(emu):
    """A choice timed for one kernel variant never serves another of the same shape: 16-bit
    x or y, the fused qkv epilogue, the on-device K split and skipped columns are in the key."""
    from dflash_cupy.ops.rope import RopeSpec
    base = dict(max_m=64, x_split=False)
    ops = [Gemm(emu, 256, 1040, "bf16", **base), Gemm(emu, 256, 1040, "bf16", x16=True, **base),
           Gemm(emu, 256, 1040, "bf16", y16=True, **base), Gemm(emu, 256, 1040, "bf16", live_split=True, **base),
           Gemm(emu, 256, 1040, "bf16", live_split=True, skip_cols=128, **base),
           Gemm(emu, 256, 1040, "bf16", rope=RopeSpec(64, 2, 1, 1e-6, 1.0), **base)]
    keys = [tuning.gemm_key(op, 33) for op in ops]
    assert len(set(keys)) == len(keys), keys
    assert tuning.gemm_key(Gemm(emu, 256, 1040, "bf16", **base), 33) == keys[0]


def test_bad_cache_files_are_ignored_not_trusted(emu, tmp_path):
    path = tmp_path / "tuning.json"
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignored"):
        cache = tuning.TuneCache()
    assert cache.entries == {}
    op = Gemm(emu, 300, 1040, "bf16", max_m=64)
    m = 33
    # a cached choice that is not a candidate of this GEMM: re-timed when a timer exists, else ignored
    cache.put(tuning.gemm_key(op, m), {"choice": [4, 99]})
    assert tuning.tune_gemm(op, m, cache=cache) is None and op.config(m) == op.default_config(m)
    e = tuning.tune_gemm(op, m, cache=cache, timer=lambda fn: (fn(), 1e-6)[1])
    assert tuple(e["choice"]) in op.launch_candidates(m)
    assert json.loads(path.read_text())["version"] == tuning.VERSION
    path.write_text(json.dumps({"version": 99, "entries": {}}))
    with pytest.warns(RuntimeWarning, match="version"):
        tuning.TuneCache()


def test_no_retuning_after_a_capture(emu):
    op = Gemm(emu, 300, 1040, "bf16", max_m=64)
    x, w, y = emu.zeros((19, 1040), np.float32), emu.zeros((300, 1040), np.uint16), emu.zeros((19, 300), np.float32)
    s = emu.stream()
    emu.begin_capture(s)
    op(x, w, y, 19, stream=s)
    emu.end_capture(s)
    with pytest.raises(RuntimeError, match="capture"):
        op.use_config(19, op.launch_candidates(19)[0])


def test_modes(emu, monkeypatch):
    op = Gemm(emu, 300, 1040, "bf16", max_m=64)
    sites = [("x", op, 19), ("x", op, 19), ("none", None, 3)]
    # tune=None: only on a GPU; the emulator keeps the cost rule
    assert tuning.tune_sites(sites, backend=emu, tune=None) == {}
    timer = lambda fn: (fn(), 1e-6)[1]  # noqa: E731
    got = tuning.tune_sites(sites, backend=emu, tune=True, timer=timer)
    assert list(got) == [("x", 19)]          # each (gemm, m) once, None skipped
    monkeypatch.setenv(tuning.ENV_MODE, "0")
    assert not tuning.enabled()
    monkeypatch.setenv(tuning.ENV_MODE, "1")
    assert tuning.enabled()
    assert tuning.event_timer(emu) is None    # no device clock on the emulator


# ---------------------------------------------------------------- the product classes
def test_cache_tunes_its_call_sites_and_still_matches(emu, monkeypatch):
    """DraftKvCache(tune=True) with a timer under which the last candidate of
    every call site is fastest (not the cost rule's choice wherever there is
    another): each site runs its choice, and every step of a schedule with
    growth, a bulk jump, a rewind and a reset still matches the oracle (the
    Driver checks each step)."""
    from tests.support.drafters import Driver

    def last_wins(backend):
        n = []

        def t(fn):
            fn()
            n.append(1)
            return 1.0 / len(n)
        return t
    monkeypatch.setattr(tuning, "event_timer", last_wins)
    d = Driver(emu, "b", seed=5, tune=True)
    try:
        kv = d.kv
        assert kv.tuned, "no call site was tuned"
        assert any(e["choice"] != e["default"] for e in kv.tuned.values()), kv.tuned
        gemms = {"fc": kv.g_fc, "kv": kv.g_kv, "qkv": kv.g_qkv, "o": kv.g_o, "gate_up": kv.g_gate_up,
                 "down": kv.g_down, "attn_gate": kv.g_attn_gate, "attention": kv.attention}
        for (label, m), e in kv.tuned.items():
            assert list(gemms[label].config(m)) == e["choice"]
        d.run_ops([1, 2, 9, 12, 40, ("rewind", 38), 39, "reset", 3])
    finally:
        d.close()


def test_tune_argument_is_checked(emu):
    w, _ = built("a")
    with pytest.raises(TypeError, match="tune"):
        DraftKvCache(w, 7, backend=emu, tune="yes")
    from dflash_cupy.kv_batch import DraftKvBatch
    with pytest.raises(TypeError, match="tune"):
        DraftKvBatch(w, 7, 2, backend=emu, tune=1)


def test_report_lists_default_and_choice(emu, tmp_path):
    op = Gemm(emu, 300, 1040, "bf16", max_m=64)
    cands = op.launch_candidates(19)
    speed = {c: 2e-6 for c in cands}
    speed[cands[-1]] = 1e-6
    tuning.tune_gemm(op, 19, cache=tuning.TuneCache(), timer=lambda fn: (fn(), speed[op.config(19)])[1])
    text = tuning.report(tmp_path / "tuning.json")
    assert "1 shape(s)" in text and "N300|K1040|bf16" in text
    d = op.default_config(19)
    gain = "1.00x" if d == cands[-1] else "2.00x"
    assert f"chosen {cands[-1]}" in text and gain in text and f"{len(cands)} candidates" in text


def test_attention_is_tuned_and_cached(emu):
    """The ring attention's (n_splits, merge) configurations through the same
    tuner: the timer's fastest is applied and cached, a new object reads it
    back, and the tuned object still matches the reference (every lane active
    in the scratch call: live descriptors of 2 lanes)."""
    from dflash_cupy.ops.attention import RingAttention, ring_attention_reference
    D, NH, NKV, B, kvt = 32, 4, 2, 3, 600
    att = RingAttention(emu, D, NH, NKV, B, kvt, lanes=2)
    cands = att.launch_candidates()
    merges = {c[1] for c in cands}
    assert len(cands) >= 3 and {"fold", "launch"} <= merges and att.default_config() in cands
    want = next(c for c in reversed(cands) if c != att.default_config())
    seen = []

    def timer(fn):
        fn()
        seen.append(att.config())
        return 1e-6 if att.config() == want else 3e-6
    e = tuning.tune_op(att, cache=tuning.TuneCache(), timer=timer)
    assert sorted(seen, key=str) == sorted(cands, key=str) and att.config() == want
    assert tuple(e["choice"]) == want and "ring_attention|D32|NH4|NKV2|B3|kv600|lanes2x3" in tuning.attention_key(att)
    att2 = RingAttention(emu, D, NH, NKV, B, kvt, lanes=2)
    assert tuning.tune_op(att2, cache=tuning.TuneCache()) is not None and att2.config() == want
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2 * B, NH * D)).astype(np.float32)
    k = rng.standard_normal((2 * kvt, NKV * D)).astype(np.float16)
    v = rng.standard_normal((2 * kvt, NKV * D)).astype(np.float16)
    mask = np.where(rng.random((2, B, kvt)) < 0.3, -np.inf, 0).astype(np.float16)
    out = emu.zeros((2 * B, NH * D), np.float32)
    att2(emu.asarray(q), emu.asarray(k), emu.asarray(v), emu.asarray(mask), out)
    got = emu.to_numpy(out)
    for lane in range(2):
        ref = ring_attention_reference(q[lane * B:(lane + 1) * B], k[lane * kvt:(lane + 1) * kvt],
                                       v[lane * kvt:(lane + 1) * kvt], mask[lane], n_head_kv=NKV)
        assert_close(got[lane * B:(lane + 1) * B], np.asarray(ref).reshape(B, NH * D), "f16",
                     f"tuned {att2.config()} lane {lane}")
