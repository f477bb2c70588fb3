"""The self-check's verdicts and how caches obey them (the low layer of
``dflash_cupy/selfcheck.py``, which runs the checks: the product imports only this).

``Report`` (per variant a status, every ``Check``), ``Choices`` (what a cache may use),
the verdict cache (``selfcheck.json`` beside the tuning cache, keyed by
``device_identity``), the modes (``DFLASH_CUPY_SELFCHECK=auto|off|force``, a cache's
``selfcheck=``) and the hooks the product calls: ``for_cache`` and ``require`` (a cache's
construction), ``variant_usable`` (standalone ops). Running a check needs the runner
``dflash_cupy.selfcheck`` registers here (``RUNNER``) when the package is imported.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

VERSION = 1
ENV_MODE = "DFLASH_CUPY_SELFCHECK"
ENV_CACHE = "DFLASH_CUPY_SELFCHECK_CACHE"
MODES = ("auto", "off", "force")

# variant -> what it is
VARIANTS = {
    "plan": "step planning and feature gather (ring_slots.cu, step_plan.cu)",
    "norm": "RMSNorm (norm.cu)",
    "rope": "q/k norm + RoPE + K/V scatter (rope.cu)",
    "sample": "token sampler and argmax reduction (sample.cu)",
    "dflash2": "DFlash 2 convolution and candidate selector (conv.cu, selector.cu)",
    "gemm.fma": "CUDA-core GEMM (gemm.cu)",
    "gemm.stream": "mma.sync stream GEMM (gemm_stream.cu)",
    "gemm.wgmma": "wgmma GEMM (gemm_wgmma.cu)",
    "attention.fma": "CUDA-core attention (attention.cu)",
    "attention.mma": "tensor-core attention (attention_mma.cu)",
    "step.f32": "a cached drafter step, f32 weights, vs the float64 oracle",
    "step.bf16": "a cached drafter step, bf16 weights, vs the float64 oracle",
    "step.f16": "a cached drafter step, f16 weights (fused argmax), vs the float64 oracle",
    "step.dflash2": "a cached DFlash 2 drafter step (convolutions, selector), bf16 weights, vs the float64 oracle",
    "graph.pdl": "step graph with programmatic dependent launch",
}
# the documented fallback order: what a cache uses instead of a failed variant
FALLBACK = {
    "gemm.wgmma": "gemm.stream",
    "gemm.stream": "gemm.fma",
    "attention.mma": "attention.fma",
    "graph.pdl": "the plain step graph",
}
STATUSES = ("pass", "fail", "unavailable", "not run")

_lock = threading.RLock()
_memo: dict = {}          # report key -> Report (or None: looked for on disk, none there)
_warned: set = set()      # (report key, variant) announced in this process
_tls = threading.local()  # .running: a check in progress on this thread; .choices: a cache's choices


class SelfCheckError(RuntimeError):
    """A cache needs a kernel variant the device's self-check failed, with no fallback left."""


# ---------------------------------------------------------------------------- records
@dataclass
class Check:
    """One comparison: ``error`` is the worst ``|got - ref|`` (for exact checks: the number of
    elements that differ), ``bound`` the tolerance kind (``tolerances.TOL``) or ``"exact"``."""
    variant: str
    name: str
    ok: bool
    error: float | None = None
    bound: str = "exact"
    detail: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Choices:
    """What a cache may use: each flag False disables that variant (and takes its fallback)."""
    wgmma: bool = True
    stream: bool = True
    attention_mma: bool = True
    pdl: bool = True
    failed: tuple = ()            # variants that failed (no fallback ones make caches raise)
    report: "Report | None" = field(default=None, compare=False, repr=False)

    def usable(self, variant: str) -> bool:
        flag = {"gemm.wgmma": self.wgmma, "gemm.stream": self.stream, "attention.mma": self.attention_mma,
                "graph.pdl": self.pdl}.get(variant)
        return flag if flag is not None else variant not in self.failed


TRUST = Choices()


@dataclass
class Report:
    """The self-check's verdict for one device: per variant a status (``STATUSES``) and a
    note, and every check it ran."""
    device: dict
    status: dict
    notes: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    seconds: float = 0.0
    created: str = ""
    context_lost: bool = False    # a GPU error ended the CUDA context: later variants "not run"

    @property
    def key(self) -> str:
        return _key_of(self.device)

    @property
    def passed(self) -> bool:
        """No variant failed (unavailable and unrun ones do not count)."""
        return not any(s == "fail" for s in self.status.values())

    @property
    def complete(self) -> bool:
        return not any(s == "not run" for s in self.status.values())

    def failed(self) -> list:
        return [v for v in VARIANTS if self.status.get(v) == "fail"]

    def usable(self, variant: str) -> bool:
        """Pass, or not run (a partial report trusts what it did not check); False for a
        failure, a variant this device lacks, or anything after a lost CUDA context."""
        s = self.status.get(variant, "not run")
        return s == "pass" or (s == "not run" and not self.context_lost)

    def worst(self, variant: str) -> Check | None:
        """The check that failed by the most (the first exception), or None."""
        bad = [c for c in self.checks if c.variant == variant and not c.ok]
        if not bad:
            return None
        num = [c for c in bad if c.error is not None and np.isfinite(c.error)]
        return max(num, key=lambda c: c.error) if num and len(num) == len(bad) else \
            next((c for c in bad if c.error is None or not np.isfinite(c.error)), bad[0])

    def choices(self) -> Choices:
        stream = self.usable("gemm.stream")
        return Choices(wgmma=stream and self.usable("gemm.wgmma"), stream=stream,
                       attention_mma=self.usable("attention.mma"), pdl=self.usable("graph.pdl"),
                       failed=tuple(self.failed()) + (("context lost",) if self.context_lost else ()),
                       report=self)

    # ---- serialisation
    def to_dict(self) -> dict:
        return {"version": VERSION, "key": self.key, "device": dict(self.device), "passed": self.passed,
                "status": dict(self.status), "notes": dict(self.notes), "seconds": round(self.seconds, 3),
                "created": self.created, "context_lost": self.context_lost,
                "choices": {k: getattr(self.choices(), k) for k in ("wgmma", "stream", "attention_mma", "pdl")},
                "checks": [{**dataclasses.asdict(c), "error": None if c.error is None else
                            (float(c.error) if np.isfinite(c.error) else str(c.error)),
                            "seconds": round(c.seconds, 3)} for c in self.checks]}

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        if not isinstance(d, dict) or d.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} self-check report")
        checks = []
        for c in d.get("checks", []):
            c = dict(c)
            if isinstance(c.get("error"), str):
                c["error"] = float(c["error"])
            checks.append(Check(**c))
        status = {str(k): str(v) for k, v in d["status"].items()}
        if any(v not in STATUSES for v in status.values()):
            raise ValueError(f"unknown status in {status}")
        return cls(device=dict(d["device"]), status=status, notes=dict(d.get("notes", {})), checks=checks,
                   seconds=float(d.get("seconds", 0.0)), created=str(d.get("created", "")),
                   context_lost=bool(d.get("context_lost", False)))

    def text(self) -> str:
        """The report for a person: device, one line per variant, the failures' details."""
        dv = self.device
        lines = [f"dflash_cupy self-check on {dv.get('name')} ({dv.get('backend')} backend; compute capability "
                 f"{dv.get('cc')}, driver {dv.get('driver')}, CuPy {dv.get('cupy')}, cuda_src {dv.get('source')})"]
        for v, what in VARIANTS.items():
            s = self.status.get(v, "not run")
            mine = [c for c in self.checks if c.variant == v]
            word = {"pass": "PASS", "fail": "FAIL", "unavailable": "n/a", "not run": "----"}[s]
            line = f"  {word:4s} {v:14s} {what}"
            if s == "pass":
                errs = [c for c in mine if c.bound != "exact" and c.error is not None]
                w = max(errs, key=lambda c: c.error / _tol_scale(c.bound), default=None)
                line += f": {len(mine)} checks" + (f", worst {w.error:.2e} ({w.bound})" if w else ", exact")
            elif s == "fail":
                c = self.worst(v)
                if c is not None:
                    line += f": {_describe(c)}"
                if v in FALLBACK:
                    line += f" -> caches use {FALLBACK[v]}"
            if self.notes.get(v):
                line += f" [{self.notes[v]}]"
            lines.append(line)
        bad = [c for c in self.checks if not c.ok]
        if bad:
            lines.append("failed checks:")
            lines += [f"  {c.variant}: {c.name}: {_describe(c, where=False)}" for c in bad[:40]]
            if len(bad) > 40:
                lines.append(f"  ... and {len(bad) - 40} more")
        if self.context_lost:
            lines.append("the CUDA context was lost during the check: restart the process; the next check "
                         "skips what failed")
        off = [v for v in self.failed() if v in FALLBACK]
        hard = [v for v in self.failed() if v not in FALLBACK]
        verdict = "every variant passed" if self.passed else (
            (f"disabled: {', '.join(f'{v} -> {FALLBACK[v]}' for v in off)}" if off else "") +
            ("; " if off and hard else "") +
            (f"failed without a fallback: {', '.join(hard)} (caches that need them raise SelfCheckError)"
             if hard else ""))
        lines.append(f"verdict: {verdict}; {len(self.checks)} checks in {self.seconds:.1f} s"
                     + ("" if self.complete else " (----: not checked in this run)"))
        return "\n".join(lines)


def _tol_scale(kind: str) -> float:
    from .tolerances import TOL
    return TOL[kind]["atol"] if kind in TOL else 1.0


def _describe(c: Check, where: bool = True) -> str:
    """What went wrong (``where``: naming the check)."""
    at = f" in {c.name}" if where else ""
    if c.error is None:
        return (f"{c.name}: " if where else "") + (c.detail or "failed")
    if c.bound == "exact":
        return f"{int(c.error)} elements differ{at}" + (f" ({c.detail})" if c.detail else "")
    return f"worst error {c.error:.3g} > {c.bound} tolerance{at}"


# ---------------------------------------------------------------------------- identity, cache
def source_digest(backend_name: str) -> str:
    """sha256 (16 hex digits) of every file in ``cuda_src`` (its ``emu/`` headers only for the
    emulated backend: they do not reach a GPU build)."""
    return _source_digest(backend_name == "emulated")


_digests: dict = {}


def _source_digest(with_emu: bool) -> str:
    if with_emu in _digests:
        return _digests[with_emu]
    from .source_dir import CUDA_SRC
    h = hashlib.sha256()
    for p in sorted(CUDA_SRC.rglob("*")):
        rel = p.relative_to(CUDA_SRC).as_posix()
        if not p.is_file() or p.suffix not in (".cu", ".cuh", ".h") or (rel.startswith("emu/") and not with_emu):
            continue
        h.update(rel.encode() + b"\0" + p.read_bytes() + b"\0")
    _digests[with_emu] = h.hexdigest()[:16]
    return _digests[with_emu]


def device_identity(backend=None) -> dict:
    """What a verdict is keyed by: backend, device name, compute capability, driver, CuPy
    version, source digest."""
    from . import backends, device_props
    be = backends.get(backend)
    try:
        import cupy
        cupy_v = cupy.__version__
    except Exception:
        cupy = None
        cupy_v = "none"
    if be.name == "cuda":
        dev = cupy.cuda.Device()
        ident = dict(backend="cuda", name=device_props.query_cupy().name, device=int(dev.id),
                     cc=str(dev.compute_capability), driver=str(cupy.cuda.runtime.driverGetVersion()),
                     runtime=str(cupy.cuda.runtime.runtimeGetVersion()))
    else:
        ident = dict(backend=be.name, name=device_props.of(be).name, device=0, cc="90", driver="emulator",
                     runtime="emulator")
    ident.update(cupy=cupy_v, source=source_digest(be.name))
    return ident


def _key_of(ident: dict) -> str:
    return "|".join(str(ident.get(k)) for k in ("backend", "name", "cc", "driver", "runtime", "cupy", "source"))


def cache_path() -> Path:
    """``DFLASH_CUPY_SELFCHECK_CACHE``, else ``selfcheck.json`` beside the tuning cache."""
    p = os.environ.get(ENV_CACHE)
    if p:
        return Path(p)
    # beside tuning.cache_path() (read here without importing tuning, which imports the ops)
    tune = os.environ.get("DFLASH_CUPY_TUNE_CACHE")
    return (Path(tune).parent if tune else Path.home() / ".cache" / "dflash_cupy") / "selfcheck.json"


def _read_file(path: Path, quiet: bool = False) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("reports"), dict):
            raise ValueError(f"expected {{'version': {VERSION}, 'reports': {{...}}}}")
        return data["reports"]
    except (OSError, ValueError) as e:
        if not quiet:
            warnings.warn(f"dflash_cupy self-check cache {path} ignored ({e}); it will be rewritten",
                          RuntimeWarning, stacklevel=3)
        return {}


def load(backend=None, path: str | Path | None = None) -> Report | None:
    """The stored report of this device (``device_identity``), or None."""
    ident = device_identity(backend)
    d = _read_file(Path(path) if path is not None else cache_path()).get(_key_of(ident))
    if d is None:
        return None
    try:
        return Report.from_dict(d)
    except (ValueError, TypeError, KeyError) as e:
        warnings.warn(f"dflash_cupy self-check: a stored report was unreadable ({e}); checking again",
                      RuntimeWarning, stacklevel=2)
        return None


def store(report: Report, path: str | Path | None = None) -> Path:
    """Write ``report`` into the cache file (atomically; other devices' reports are kept)."""
    path = Path(path) if path is not None else cache_path()
    with _lock:
        reports = _read_file(path, quiet=True)   # (a damaged file is replaced)
        reports[report.key] = report.to_dict()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": VERSION, "reports": reports}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        _memo[report.key] = report
    return path


def forget() -> None:
    """Drop the in-memory verdicts and warnings (the file stays): tests, or after a fix."""
    with _lock:
        _memo.clear()
        _warned.clear()


# ---------------------------------------------------------------------------- modes, cache hooks
def mode(selfcheck=None) -> str:
    """The mode a ``selfcheck=`` argument means: ``None`` -> ``DFLASH_CUPY_SELFCHECK``
    (default ``auto``), ``True`` -> ``force``, ``False`` -> ``off``."""
    if selfcheck is None:
        v = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
        if v not in MODES:
            raise ValueError(f"{ENV_MODE}={v!r}: expected one of {MODES}")
        return v
    if isinstance(selfcheck, (bool, np.bool_)):
        return "force" if selfcheck else "off"
    if isinstance(selfcheck, str) and selfcheck in MODES:
        return selfcheck
    raise ValueError(f"selfcheck must be None, a bool, one of {MODES}, or a selfcheck.Report, got {selfcheck!r}")


RUNNER: Callable | None = None   # dflash_cupy.selfcheck.run, registered when the package is imported


def _run(be, **kw) -> "Report":
    if RUNNER is None:
        raise RuntimeError("the self-check runner is not registered (import dflash_cupy first)")
    return RUNNER(be, **kw)


def report_for(backend=None, selfcheck=None) -> Report | None:
    """The verdict a cache on ``backend`` obeys under ``selfcheck`` (see ``mode``): ``None``
    trusts every variant (off; or auto on the emulator with nothing known)."""
    from . import backends
    be = backends.get(backend)
    if isinstance(selfcheck, Report):
        return selfcheck
    m = mode(selfcheck)
    if m == "off" or getattr(_tls, "running", False):
        return None
    if m == "force":
        return _run(be)
    key = _key_of(device_identity(be))
    with _lock:
        if key not in _memo:
            _memo[key] = load(be)
        rep = _memo[key]
    if be.name != "cuda":
        return rep
    if rep is not None and rep.complete:
        return rep
    # a GPU with no complete verdict: check now (what failed before, e.g. a variant that ended
    # the last process's CUDA context, stays failed and is not run again)
    return _run(be, known_failures=rep.failed() if rep is not None else ())


def variant_usable(backend, variant: str) -> bool:
    """Whether ``variant`` may be used on ``backend`` under the current mode (standalone ops:
    ``Gemm(path="auto")``, ``gemm_stream.wgmma_verified``). Inside a cache's construction its
    choices decide; while a check runs, everything is."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {tuple(VARIANTS)}")
    ch = getattr(_tls, "choices", None)
    if ch is not None:
        return ch.usable(variant)
    rep = report_for(backend)
    if rep is None:
        return True
    _warn(rep)
    return rep.choices().usable(variant)


class applied:
    """``with applied(choices):`` the standalone hooks (``variant_usable``) answer from
    ``choices`` (a cache building its ops)."""

    def __init__(self, choices: Choices):
        self.choices = choices

    def __enter__(self):
        self._prev = getattr(_tls, "choices", None)
        _tls.choices = self.choices
        return self.choices

    def __exit__(self, *exc):
        _tls.choices = self._prev


def for_cache(backend, selfcheck=None) -> Choices:
    """A cache's choices at construction (``selfcheck=``: None, a mode, a bool, a ``Report``),
    announcing each disabled variant once per process."""
    if isinstance(selfcheck, Choices):
        return selfcheck
    rep = report_for(backend, selfcheck)
    if rep is None:
        return TRUST
    _warn(rep)
    return rep.choices()


def _warn(rep: Report) -> None:
    for v in rep.failed():
        k = (rep.key, v)
        if k in _warned:
            continue
        _warned.add(k)
        c = rep.worst(v)
        why = _describe(c) if c is not None else "failed"
        fb = FALLBACK.get(v)
        then = f"using {fb} instead" if fb else "no fallback: caches that need it raise SelfCheckError"
        warnings.warn(f"dflash_cupy self-check: {v} ({VARIANTS[v]}) failed on {rep.device.get('name')}: {why}; "
                      f"{then}. `python -m dflash_cupy selfcheck` prints the report (send it with a bug report).",
                      RuntimeWarning, stacklevel=4)


def require(choices: Choices, issuer) -> None:
    """Raise ``SelfCheckError`` if a cache (a ``StepEngine`` with its ops built) needs a variant
    that failed and has no fallback left."""
    rep = choices.report
    if rep is None:
        return
    need = {"plan", "norm", "rope"}
    if getattr(issuer, "sampler", None) is not None:
        need.add("sample")
    if getattr(issuer, "conv", None) is not None or getattr(issuer, "selector", None) is not None:
        need |= {"dflash2", "step.dflash2"}
    kinds = set()
    for name in ("g_fc", "g_kv", "g_qkv", "g_o", "g_gate_up", "g_down", "g_attn_gate", "g_lm"):
        g = getattr(issuer, name, None)
        if g is not None:
            need.add("gemm.fma" if g.path == "fma" else "gemm.stream")
            kinds.add(g.wkind)
    need.add("attention.fma" if issuer.attention.path == "fma" else "attention.mma")
    need |= {f"step.{k}" for k in kinds}
    bad = sorted(v for v in need if rep.status.get(v) == "fail")
    if rep.context_lost:
        bad.append("(the CUDA context was lost during the check)")
    if bad:
        raise SelfCheckError(
            f"{getattr(issuer, 'owner', type(issuer).__name__)}: the self-check on {rep.device.get('name')} failed {', '.join(bad)}, which this "
            f"cache needs with no fallback left: it would draft garbage. `python -m dflash_cupy selfcheck` prints the "
            f"report; DFLASH_CUPY_SELFCHECK=off (or selfcheck='off') builds it anyway.")


