"""Fault injection: each of four deliberate kernel bugs, built in through a test-only macro
(cuda_src: DFLASH_FAULT_*), must be caught by the device self-check (dflash_cupy/selfcheck.py),
its variant disabled and reported, and a cache built afterwards, which obeys the verdict,
must still match the float64 oracle while the same cache with the check off does not.

The macros are reachable only through ``inject`` below, which appends ``-D<MACRO>=1`` to the
options of the kernel files that include the broken header (one build of each, cached by the
emulator like any other): ``kernels.compile_options`` refuses DFLASH_FAULT_* names, so no
launcher can pass one, and ``test_fault_macros_never_reach_a_normal_build`` holds that."""
from __future__ import annotations

import re
import warnings
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import dflash_cupy
from dflash_cupy import kernels, reference
from dflash_cupy import selfcheck as sc
from dflash_cupy import selfcheck_verdict as sv
from dflash_cupy.backends import KernelLaunchError
from dflash_cupy.emu import pdl_order as emu_pdl
from dflash_cupy.config import DraftConfig
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.tolerances import within
from dflash_cupy.weights import DraftWeights

ROOT = Path(__file__).resolve().parent.parent

# fault -> (macro, kernel files built with it, variants checked, variants it must fail, drafter weights)
FAULTS = {
    # wgmma descriptor with LBO and SBO swapped (cuda_src/wgmma.cuh)
    "wgmma_desc": ("DFLASH_FAULT_WGMMA_DESC", {"gemm_wgmma.cu"},
                   ("gemm.stream", "gemm.wgmma", "step.bf16"), {"gemm.wgmma"}, "bf16"),
    # mma.sync A fragment with registers 1 and 2 swapped (cuda_src/mma.cuh): the stream GEMM and
    # the tensor-core attention both include it
    "mma_frag": ("DFLASH_FAULT_MMA_FRAG", {"gemm_stream.cu", "attention_mma.cu"},
                 ("gemm.stream", "attention.mma", "step.bf16"), {"gemm.stream", "attention.mma"}, "bf16"),
    # ldmatrix.trans read without .trans (cuda_src/ldmatrix.cuh): the tensor-core attention's V
    "ldmatrix_notrans": ("DFLASH_FAULT_LDMATRIX_NOTRANS", {"attention_mma.cu"},
                         ("attention.mma", "step.f32"), {"attention.mma"}, "f32"),
    # a PDL kernel without its wait (cuda_src/pdl.cuh), in the step's RMSNorm (norm.cu)
    "pdl_nowait": ("DFLASH_FAULT_PDL_NOWAIT", {"norm.cu"}, ("graph.pdl",), {"graph.pdl"}, "f32"),
}


def inject(monkeypatch, macro: str, files: set) -> None:
    """Build every module of ``files`` with ``-D<macro>=1`` from now on (the test's monkeypatch
    undoes it). Other files build as always."""
    orig_options, orig_load = kernels.compile_options, kernels.load_module
    state = {"on": False}

    def options(**defines):
        opts = orig_options(**defines)
        return opts + (f"-D{macro}=1",) if state["on"] else opts

    def load(backend, filename, **defines):
        prev, state["on"] = state["on"], filename in files
        try:
            return orig_load(backend, filename, **defines)
        finally:
            state["on"] = prev
    monkeypatch.setattr(kernels, "compile_options", options)
    monkeypatch.setattr(kernels, "load_module", load)


# ---------------------------------------------------------------- a drafter the caches run
def _drafter(kind):
    """The self-check's own end-to-end drafter shape (its kernels are built already), other
    weights: 2 layers, q_len 16 (a step's 50 rows take the wgmma qkv GEMM), 300-token LM head."""
    cfg = DraftConfig(**sc.E2E)
    host = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}[kind]
    w = DraftWeights.random(cfg, seed=zlib.crc32(b"faults " + kind.encode()) & 0xFFFF, dtype=host)
    rng = np.random.default_rng(5)
    lm = (rng.standard_normal((sc.E2E_VOCAB, cfg.hidden_size)) / np.sqrt(cfg.hidden_size)).astype(host)
    return cfg, w, lm


def _steps(be, kv, cfg, w, lm, schedule=(50, 53, 70), pdl_check=False):
    """Drive ``kv`` through ``schedule``; the worst |hidden - oracle| and |logits - oracle|
    relative to the 'step' tolerance (<= 1 passes), per step."""
    rng = np.random.default_rng(11)
    feats = rng.standard_normal((schedule[-1], cfg.fc_in)).astype(np.float32)
    worst = []
    with FeatureRing(sc.E2E_RING, cfg.n_captured, cfg.hidden_size, np.float32, backend=be) as ring:
        have = 0
        for c in schedule:
            lo = c - min(c, sc.E2E_CAPACITY)
            s = max(have, lo)
            ring.write(s, feats[s:c])
            have = c
            noise = rng.standard_normal((cfg.q_len, cfg.hidden_size)).astype(np.float32)
            if pdl_check:
                prev = be.pdl_checker
                emu_pdl.check_pdl(be)
                try:
                    h = be.to_numpy(kv.step(ring, c, noise))
                finally:
                    be.pdl_checker = prev
            else:
                h = be.to_numpy(kv.step(ring, c, noise))
            ref_h, ref_l = reference.draft_forward(w, feats[lo:c], noise, lm_head=lm)
            ok_h, err_h = within(h, ref_h, "step")
            ok_l, err_l = within(be.to_numpy(kv.logits), ref_l, "step")
            worst.append((ok_h and ok_l, max(err_h, err_l)))
    return worst


def _cache(w, lm, be, **kw):
    return DraftKvCache(w, sc.E2E_CAPACITY, lm_head=lm, backend=be, bulk_chunk=sc.E2E_BULK, tune=False, **kw)


# ---------------------------------------------------------------- one test per fault
@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_is_caught_disabled_reported_and_worked_around(emu, monkeypatch, verdicts, fault):
    macro, files, only, must_fail, kind = FAULTS[fault]
    inject(monkeypatch, macro, files)

    # detected: the self-check fails exactly the broken variants, the rest of what it ran passes
    rep = dflash_cupy.selfcheck(emu, only=only)
    failed = {v for v, s in rep.status.items() if s == "fail"}
    assert failed == must_fail, rep.text()
    assert all(rep.status[v] == "pass" for v in only if v not in must_fail), rep.text()
    # reported: for a person and for tools, and stored for the next process
    text = rep.text()
    for v in must_fail:
        assert re.search(rf"FAIL {re.escape(v)} .*-> caches use", text), text
        worst = rep.worst(v)
        assert worst is not None and not worst.ok
    again = sv.load(emu)
    assert again is not None and {v for v, s in again.status.items() if s == "fail"} == must_fail
    assert sv.Report.from_dict(rep.to_dict()).to_dict() == rep.to_dict()

    cfg, w, lm = _drafter(kind)
    pdl = fault == "pdl_nowait"
    # disabled: a cache built now (auto mode: the stored verdict) warns once per variant and
    # takes the fallbacks
    with pytest.warns(RuntimeWarning) as rec:
        kv = _cache(w, lm, emu, pdl=pdl)
    said = " ".join(str(r.message) for r in rec)
    for v in must_fail:
        assert f"self-check: {v} (" in said and "instead" in said, said
    with kv:
        if "gemm.wgmma" in must_fail:
            assert not kv.checked.wgmma and kv.g_qkv.path == "stream" and kv.g_qkv._stream.wg_variants == ()
        if "gemm.stream" in must_fail:
            assert not kv.checked.stream and all(g.path == "fma" for g in (kv.g_fc, kv.g_qkv, kv.g_o, kv.g_lm))
        if "attention.mma" in must_fail:
            assert kv.attention.path == "fma"
        if pdl:
            assert kv.pdl is False
        # worked around: every step within the oracle's tolerance
        results = _steps(emu, kv, cfg, w, lm)
    assert all(ok for ok, _ in results), results

    # the negative control: the same cache with the check off runs the broken variant and fails
    # (for PDL on the emulator, whose launches run in order, the PDL ordering check catches it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with _cache(w, lm, emu, pdl=pdl, selfcheck="off") as bad:
            if pdl:
                assert bad.pdl is True
                errors = []
                try:
                    _steps(emu, bad, cfg, w, lm, schedule=(50,), pdl_check=True)
                except KernelLaunchError as e:
                    errors.append(e)
                while True:   # each racing launch of the step raises when its stream is waited for
                    try:
                        emu.synchronize()
                        break
                    except KernelLaunchError as e:
                        errors.append(e)
                assert errors and all("rmsnorm" in str(e) and "pdl_wait" in str(e) for e in errors), errors
            else:
                ctl = _steps(emu, bad, cfg, w, lm)
                assert not all(ok for ok, _ in ctl), ctl


def test_fault_macros_never_reach_a_normal_build(emu, monkeypatch, verdicts):
    """Nothing outside the tests can switch a fault on: the package and the profiling scripts
    never name the macros (only kernels.py, to refuse them), a launcher cannot pass one, each
    macro appears in cuda_src only behind its #if, and a self-check run builds without any."""
    hits = {p.relative_to(ROOT).as_posix() for d in ("dflash_cupy", "profiling")
            for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".sh")
            and "DFLASH_FAULT" in p.read_text()}
    assert hits == {"dflash_cupy/kernels.py"}, hits
    with pytest.raises(ValueError, match="test-only fault"):
        kernels.compile_options(DFLASH_FAULT_MMA_FRAG=1)
    macros = {m for m, *_ in FAULTS.values()}
    for src in (ROOT / "cuda_src").rglob("*"):
        if not src.is_file():
            continue
        for line in src.read_text().splitlines():
            code = line.split("//")[0]
            for m in re.findall(r"DFLASH_FAULT_\w+", code):
                assert m in macros, (src, line)
                assert re.match(rf"\s*#\s*if(n?def)?\s+(defined\()?{m}\b", code), (src, line)
    seen = set()
    for mdl in ("wgmma.cuh", "mma.cuh", "ldmatrix.cuh", "pdl.cuh"):
        seen |= set(re.findall(r"#\s*ifn?def\s+(DFLASH_FAULT_\w+)", (ROOT / "cuda_src" / mdl).read_text()))
    assert seen == macros
    used = []
    orig = kernels.compile_options
    monkeypatch.setattr(kernels, "compile_options", lambda **d: used.append(orig(**d)) or used[-1])
    rep = dflash_cupy.selfcheck(emu, only=("norm", "rope", "plan", "gemm.wgmma"), store_report=False)
    assert rep.passed and len(used) >= 10
    assert not any("DFLASH_FAULT" in o for opts in used for o in opts)
