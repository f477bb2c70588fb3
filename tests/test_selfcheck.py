"""The device self-check (dflash_cupy/selfcheck.py, selfcheck_verdict.py) on the emulated
backend: every variant passes; the verdict is cached per device and source and read back;
the modes (auto / off / force) decide when it runs; caches obey a stored verdict (the
fallbacks, one warning per variant, an error when no fallback is left); the command line
serves people and tools. Its fault-injection half is tests/test_selfcheck_faults.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import dflash_cupy
from dflash_cupy import backends, reference
from dflash_cupy import selfcheck as sc
from dflash_cupy import selfcheck_verdict as sv
from dflash_cupy.backends.base import Backend
from dflash_cupy.config import DraftConfig
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_batch import DraftKvBatch
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.tolerances import within
from dflash_cupy.weights import DraftWeights

ROOT = Path(__file__).resolve().parent.parent
EMU_BUDGET_S = 60.0   # the emulated self-check once its kernels are built (2 busy cores: ~16 s)


def _report(be, fail=(), **status):
    """A stored-looking verdict for ``be``: every variant passes but ``fail``."""
    st = {v: "pass" for v in sv.VARIANTS}
    st.update(status)
    checks = []
    for i, v in enumerate(fail):
        st[v] = "fail"
        checks.append(sv.Check(v, f"planted failure of {v}", False, 0.25 + i, "f32"))
    return sv.Report(device=sv.device_identity(be), status=st, checks=checks)


# ---------------------------------------------------------------- the whole check
@pytest.mark.slow
def test_emulated_selfcheck_passes_every_variant(emu, verdicts):
    """CI's run: every variant, every check passes on the emulator (a second run, its kernels
    built, stays within the budget); the report reads for people and round-trips as JSON."""
    rep = dflash_cupy.selfcheck(emu)
    t0 = time.perf_counter()
    rep = dflash_cupy.selfcheck(emu)                 # warm: what a user's later check costs
    warm = time.perf_counter() - t0
    assert rep.passed and rep.complete, rep.text()
    assert set(rep.status) == set(sv.VARIANTS) and set(rep.status.values()) == {"pass"}
    for v in sv.VARIANTS:
        assert sum(c.variant == v for c in rep.checks) >= 3, v
    assert all(c.ok for c in rep.checks) and len(rep.checks) >= 100
    assert warm < EMU_BUDGET_S, f"the emulated self-check took {warm:.1f} s"
    text = rep.text()
    assert text.count("PASS") == len(sv.VARIANTS) and "verdict: every variant passed" in text
    assert "NVIDIA H200 (emulated profile)" in text and rep.device["source"] in text
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["passed"] and d["choices"] == {"wgmma": True, "stream": True, "attention_mma": True, "pdl": True}
    assert sv.Report.from_dict(d).to_dict() == rep.to_dict()
    # stored beside nothing else in the private file, keyed by the device
    stored = json.loads(verdicts.read_text())
    assert list(stored["reports"]) == [rep.key] and rep.key.startswith("emulated|NVIDIA H200")
    # exact checks for the index and plan kernels, the tolerance table elsewhere
    assert {c.bound for c in rep.checks if c.variant == "plan"} == {"exact"}
    assert {c.bound for c in rep.checks if c.variant.startswith("step.")} <= {"step", "exact"}


# ---------------------------------------------------------------- verdicts on disk
def test_verdict_cache_is_keyed_by_device_and_source(emu, verdicts, monkeypatch):
    rep = _report(emu, fail=("gemm.wgmma",))
    path = sv.store(rep)
    assert path == verdicts and sv.cache_path() == verdicts
    back = sv.load(emu)
    assert back is not None and back.to_dict() == rep.to_dict()
    assert back.worst("gemm.wgmma").error == 0.25
    # another cuda_src (or driver, CuPy, device): another key, nothing known
    monkeypatch.setitem(sv._digests, True, "0" * 16)
    assert sv.load(emu) is None
    sv.store(_report(emu))
    assert len(json.loads(verdicts.read_text())["reports"]) == 2     # both devices' verdicts kept
    # a damaged file is ignored with a warning, then rewritten whole
    verdicts.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignored"):
        assert sv.load(emu) is None
    sv.store(_report(emu))
    assert sv.load(emu) is not None


def test_the_default_file_lives_beside_the_tuning_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(sv.ENV_CACHE, raising=False)
    monkeypatch.setenv("DFLASH_CUPY_TUNE_CACHE", str(tmp_path / "t" / "tuning.json"))
    from dflash_cupy import tuning
    assert sv.cache_path() == tuning.cache_path().parent / "selfcheck.json"


def test_modes(emu, verdicts, monkeypatch):
    """auto on the emulator: the known verdict, never a run; off: nothing read; force: a run;
    bad values name the variable or argument."""
    runs = []
    monkeypatch.setattr(sv, "RUNNER", lambda be, **kw: runs.append(kw) or _report(be, fail=("attention.mma",)))
    assert sv.for_cache(emu) is sv.TRUST and not runs            # nothing known, nothing run
    sv.store(_report(emu, fail=("gemm.wgmma",)))
    sv.forget()
    with pytest.warns(RuntimeWarning, match="gemm.wgmma"):
        ch = sv.for_cache(emu)
    assert not ch.wgmma and ch.stream and ch.attention_mma and not runs
    assert sv.for_cache(emu, "off") is sv.TRUST
    monkeypatch.setenv(sv.ENV_MODE, "off")
    assert sv.for_cache(emu) is sv.TRUST and sv.variant_usable(emu, "gemm.wgmma")
    with pytest.warns(RuntimeWarning, match="attention.mma"):
        assert not sv.for_cache(emu, "force").attention_mma and len(runs) == 1
    assert not sv.for_cache(emu, True).attention_mma and len(runs) == 2
    given = _report(emu, fail=("graph.pdl",))
    with pytest.warns(RuntimeWarning, match="graph.pdl"):
        assert not sv.for_cache(emu, given).pdl
    monkeypatch.setenv(sv.ENV_MODE, "sometimes")
    with pytest.raises(ValueError, match="DFLASH_CUPY_SELFCHECK='sometimes'"):
        sv.for_cache(emu)
    with pytest.raises(ValueError, match="selfcheck must be"):
        sv.for_cache(emu, "maybe")
    with pytest.raises(ValueError, match="unknown variants"):
        dflash_cupy.selfcheck(emu, only=("gemm.tensor",))


# a 'cuda' backend for the verdict logic (nothing launches: every method a no-op)
_FakeGpu = type("_FakeGpu", (Backend,), {"name": "cuda", **{m: (lambda self, *a, **k: None)
                                                            for m in Backend.__abstractmethods__}})


def test_auto_on_a_gpu_checks_once_then_reads_the_verdict(verdicts, monkeypatch):
    """On a GPU, auto runs the check when no complete verdict is known, and not again; a verdict
    cut short by a lost CUDA context is completed, without re-running what failed."""
    gpu = _FakeGpu()
    ident = dict(backend="cuda", name="NVIDIA H100 80GB HBM3", device=0, cc="90", driver="12080", runtime="12080",
                 cupy="13.3.0", source="f" * 16)
    monkeypatch.setattr(sv, "device_identity", lambda be=None: dict(ident))
    runs = []

    def runner(be, known_failures=(), **kw):
        runs.append(tuple(known_failures))
        st = {v: "pass" for v in sv.VARIANTS}
        rep = sv.Report(device=dict(ident), status=st)
        if len(runs) == 1:        # the first process: wgmma ends the context, the rest never ran
            st.update({v: "not run" for v in sv.VARIANTS})
            st.update({"plan": "pass", "gemm.wgmma": "fail"})
            rep.context_lost = True
            rep.checks.append(sv.Check("gemm.wgmma", "bf16 wg128", False, None, "exact",
                                       "CUDARuntimeError: cudaErrorIllegalAddress"))
        else:
            st.update({v: "fail" for v in known_failures})
        sv.store(rep)
        return rep
    monkeypatch.setattr(sv, "RUNNER", runner)
    first = sv.report_for(gpu)                            # (report_for reports; caches announce)
    assert first.context_lost and runs == [()]
    assert not first.choices().attention_mma              # unrun after a lost context: not trusted
    sv.forget()                                           # the next process
    with pytest.warns(RuntimeWarning, match="gemm.wgmma"):
        ch = sv.for_cache(gpu)
    assert runs == [(), ("gemm.wgmma",)] and not ch.wgmma and ch.stream and ch.attention_mma
    sv.forget()
    assert sv.report_for(gpu).complete and len(runs) == 2   # complete now: read, not run


# ---------------------------------------------------------------- caches obey the verdict
def _drafter(kind):
    cfg = DraftConfig(**sc.E2E)
    host = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}[kind]
    w = DraftWeights.random(cfg, seed=zlib.crc32(b"obey " + kind.encode()) & 0xFFFF, dtype=host)
    rng = np.random.default_rng(9)
    lm = (rng.standard_normal((sc.E2E_VOCAB, cfg.hidden_size)) / np.sqrt(cfg.hidden_size)).astype(host)
    return cfg, w, lm


def _check_steps(be, kv, cfg, w, lm):
    rng = np.random.default_rng(4)
    feats = rng.standard_normal((53, cfg.fc_in)).astype(np.float32)
    with FeatureRing(sc.E2E_RING, cfg.n_captured, cfg.hidden_size, np.float32, backend=be) as ring:
        ring.write(10, feats[10:50])
        for c in (50, 53):
            if c == 53:
                ring.write(50, feats[50:53])
            noise = rng.standard_normal((cfg.q_len, cfg.hidden_size)).astype(np.float32)
            h = be.to_numpy(kv.step(ring, c, noise))
            ref_h, ref_l = reference.draft_forward(w, feats[c - 40:c], noise, lm_head=lm)
            assert within(h, ref_h, "step")[0], (c, within(h, ref_h, "step"))
            toks = be.to_numpy(kv.draft_tokens)
            assert (ref_l[np.arange(len(toks)), toks] >= ref_l.max(axis=1) - 2e-2).all()


def test_cache_takes_every_fallback_and_warns_once_per_variant(emu, verdicts, recwarn):
    """A stored verdict failing wgmma, the stream GEMM, the tensor-core attention and PDL: an
    f16 cache with the fused argmax (logits=False) runs gemm.cu (its greedy token through
    the sampler), the CUDA-core attention and a plain graph, and still matches the oracle."""
    sv.store(_report(emu, fail=("gemm.wgmma", "gemm.stream", "attention.mma", "graph.pdl")))
    sv.forget()
    cfg, w, lm = _drafter("f16")
    with DraftKvCache(w, sc.E2E_CAPACITY, lm_head=lm, logits=False, backend=emu, bulk_chunk=sc.E2E_BULK, tune=False,
                      pdl=True) as kv:
        said = [str(r.message) for r in recwarn if issubclass(r.category, RuntimeWarning)]
        for v in ("gemm.wgmma", "gemm.stream", "attention.mma", "graph.pdl"):
            assert sum(f"self-check: {v} (" in s for s in said) == 1, said
        assert "using gemm.fma instead" in " ".join(said) and "the plain step graph" in " ".join(said)
        ch = kv.checked
        assert (ch.wgmma, ch.stream, ch.attention_mma, ch.pdl) == (False, False, False, False)
        assert all(g.path == "fma" for g in (kv.g_fc, kv.g_kv, kv.g_qkv, kv.g_o, kv.g_gate_up, kv.g_down, kv.g_lm))
        assert kv.attention.path == "fma" and kv.pdl is False and kv.logits is None and kv._logits is not None
        _check_steps(emu, kv, cfg, w, lm)
    n = len(recwarn)
    DraftKvCache(w, sc.E2E_CAPACITY, lm_head=lm, logits=False, backend=emu, tune=False).close()
    assert len(recwarn) == n                     # announced once per process


def test_cache_raises_when_no_fallback_is_left(emu, verdicts):
    cfg, w, lm = _drafter("bf16")
    for fail, needed in ((("gemm.stream", "gemm.fma"), "gemm.fma"), (("norm",), "norm"), (("step.bf16",), "step.bf16"),
                         (("attention.mma", "attention.fma"), "attention.fma")):
        rep = _report(emu, fail=fail)
        with pytest.warns(RuntimeWarning), pytest.raises(sv.SelfCheckError, match=needed.replace(".", r"\.")):
            DraftKvCache(w, sc.E2E_CAPACITY, lm_head=lm, backend=emu, tune=False, selfcheck=rep)
    # a failure this cache does not need: it builds (f32 weights never take the step.bf16 path)
    _, w32, lm32 = _drafter("f32")
    DraftKvCache(w32, sc.E2E_CAPACITY, lm_head=lm32, backend=emu, tune=False,
                 selfcheck=_report(emu, fail=("step.bf16",))).close()
    # off builds anyway
    DraftKvCache(w, sc.E2E_CAPACITY, lm_head=lm, backend=emu, tune=False, selfcheck="off").close()


def test_dflash2_step_check_follows_the_oracle_and_has_teeth(emu, verdicts, monkeypatch):
    """step.dflash2 runs a DFlash 2 drafter through a cache (prefill, a ring wrap, a sampled
    step) and follows the oracle's walk on every row; it fails when the cache's outputs stop
    matching the oracle: draws from other uniforms (the sampled step only), a step without the
    convolutions (the hidden states). DFlash 2 caches need it; DFlash v1 caches do not."""
    from dflash_cupy import reference as ref_mod
    from dflash_cupy.ops import selector as sel_mod
    rep = sc.run(emu, only=["step.dflash2"], store_report=False)
    checks = [c for c in rep.checks if c.variant == "step.dflash2"]
    assert rep.status["step.dflash2"] == "pass" and len(checks) == 4 * len(sc.E2E_SCHEDULE), rep.text()
    walks = [c for c in checks if c.name.startswith("draft tokens and q")]
    assert all(c.detail.startswith("15/15 rows") for c in walks), [c.detail for c in walks]
    assert "T=0.8" in walks[-1].name
    # the kernel drawing with another counter (as the oracle sees it): the sampled step fails
    uniforms = sel_mod.selector_uniforms
    monkeypatch.setattr(sel_mod, "selector_uniforms",
                        lambda seed, counter, *a, **kw: uniforms(seed, counter + 1, *a, **kw))
    bad = sc.run(emu, only=["step.dflash2"], store_report=False)
    failed = [c.name for c in bad.checks if c.variant == "step.dflash2" and not c.ok]
    assert bad.status["step.dflash2"] == "fail" and failed and all("T=0.8" in n for n in failed), failed
    monkeypatch.setattr(sel_mod, "selector_uniforms", uniforms)
    # the convolutions left out (as the oracle sees it): the hidden states fail at every step
    forward = ref_mod.draft_forward

    def without_conv(w, *a, **kw):
        c = w.config
        return forward(DraftWeights(c.replace(dflash2=None), {k: v for k, v in w.items() if "_conv." not in k
                                                              and not k.startswith("candidate_selector.")}), *a, **kw)
    monkeypatch.setattr(ref_mod, "draft_forward", without_conv)
    bad = sc.run(emu, only=["step.dflash2"], store_report=False)
    failed = [c.name for c in bad.checks if c.variant == "step.dflash2" and not c.ok]
    assert sum(n.startswith("hidden states") for n in failed) == len(sc.E2E_SCHEDULE), failed
    monkeypatch.setattr(ref_mod, "draft_forward", forward)
    # a verdict failing it: DFlash 2 caches refuse to build, DFlash v1 caches do not mind
    from tests.support.drafters import built
    w2, _ = built("g")
    lm2 = np.random.default_rng(1).standard_normal((19, w2.config.hidden_size)).astype(np.float32)
    failing = _report(emu, fail=("step.dflash2",))
    with pytest.warns(RuntimeWarning), pytest.raises(sv.SelfCheckError, match=r"step\.dflash2"):
        DraftKvCache(w2, 23, lm_head=lm2, backend=emu, tune=False, selfcheck=failing)
    _, w32, lm32 = _drafter("f32")
    DraftKvCache(w32, sc.E2E_CAPACITY, lm_head=lm32, backend=emu, tune=False, selfcheck=failing).close()


def test_lane_batch_obeys_the_verdict(emu, verdicts):
    _, w, _ = _drafter("f32")
    rep = _report(emu, fail=("attention.mma", "graph.pdl"))
    with pytest.warns(RuntimeWarning):
        with DraftKvBatch(w, sc.E2E_CAPACITY, 2, backend=emu, tune=False, pdl=True, selfcheck=rep) as b:
            assert b.attention.path == "fma" and b.pdl is False and not b.checked.attention_mma
    with pytest.raises(ValueError, match="selfcheck must be"):
        DraftKvBatch(w, sc.E2E_CAPACITY, 2, backend=emu, selfcheck="sometimes")


def test_standalone_gemm_follows_the_verdict(emu, verdicts):
    from dflash_cupy.ops.gemm import Gemm
    assert Gemm(emu, 64, 64, "bf16", max_m=16).path == "stream"
    sv.store(_report(emu, fail=("gemm.stream",)))
    sv.forget()
    with pytest.warns(RuntimeWarning, match="gemm.stream"):
        assert Gemm(emu, 64, 64, "bf16", max_m=16).path == "fma"
    # options only the stream GEMM has keep it (a cache's construction would raise instead)
    assert Gemm(emu, 64, 64, "bf16", max_m=16, norm_eps=1e-6).path == "stream"


# ---------------------------------------------------------------- the command line
def _cli(args, env_extra, timeout=600):
    env = dict(os.environ, DFLASH_CUPY_BACKEND="emulated", PYTHONPATH=str(ROOT), **env_extra)
    return subprocess.run([sys.executable, "-m", "dflash_cupy", "selfcheck", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_command_line(tmp_path):
    env = {sv.ENV_CACHE: str(tmp_path / "v.json")}
    p = _cli(["--cached"], env)
    assert p.returncode == 2 and "no stored self-check verdict" in p.stderr
    p = _cli(["--json", "--only", "plan,norm", "--out", str(tmp_path / "r.json")], env)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout)
    assert d["passed"] and d["status"]["plan"] == d["status"]["norm"] == "pass"
    assert d["status"]["gemm.wgmma"] == "not run" and json.loads((tmp_path / "r.json").read_text()) == d
    p = _cli(["--cached"], env)
    assert p.returncode == 0 and "PASS plan" in p.stdout and "---- gemm.wgmma" in p.stdout
    p = _cli(["--only", "gemm.tensor"], env)
    assert p.returncode != 0 and "unknown variants" in p.stderr
    assert backends.get("emulated") is not None
