"""Autotuning: the stream GEMM's and the ring attention's launch
configurations chosen by measurement on the device, per device and shape,
and remembered on disk.

Every launcher plans its launch by a cost rule (``ops/gemm_stream.py``), which
is a model until a GPU confirms it. On a GPU, ``tune_op(gemm, m)`` times each
launch configuration the GEMM can run ``m`` rows with (``Gemm.launch_candidates``:
M-tile variant x K split; about 10-40 of them, a few ms in all) on scratch
buffers (``tune_op`` does the same for a ``RingAttention``: split count x
merge, the folded last-block merge or the separate combine launch), keeps the fastest (``Gemm.use_config``) and records the choice with
every candidate's time (measurements the cost model can be checked against) in
a JSON cache keyed by device and shape; the next process on that device reads
the choice instead of timing. Tuning happens when a cache is built, before its
first graph capture (a captured graph holds the chosen launch).

The emulated backend never times: its clock says nothing about a GPU. It
keeps the cost rule's plan unless a timer is given (tests). CI runs every
candidate configuration on the emulator against the NumPy reference
(``tests/test_tuning.py``), so whatever a GPU picks computes the right thing.

Environment:

* ``DFLASH_CUPY_TUNE``: ``0`` never tunes (the cost rule decides, the cache
  is not read); default ``1``: on a GPU, read the cache and time what it lacks.
* ``DFLASH_CUPY_TUNE_CACHE``: the cache file (default
  ``~/.cache/dflash_cupy/tuning.json``).

Cache file: ``{"version": 1, "entries": {key: {"choice": [mt, ks], "default":
[mt, ks], "times_us": {"mt,ks": median_us, ...}, "device": name}}}``. A key
names the device (name and SM count), the kernel and every size that changes
its speed. A damaged file is ignored with a warning and rewritten; a cached
choice that is not a candidate of the GEMM asking is timed again.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from . import device_props

VERSION = 1
ENV_MODE = "DFLASH_CUPY_TUNE"
ENV_CACHE = "DFLASH_CUPY_TUNE_CACHE"


def enabled() -> bool:
    """``DFLASH_CUPY_TUNE`` is not ``0`` (nor ``off``/``false``/``no``)."""
    return os.environ.get(ENV_MODE, "1").strip().lower() not in ("0", "off", "false", "no")


def cache_path() -> Path:
    p = os.environ.get(ENV_CACHE)
    return Path(p) if p else Path.home() / ".cache" / "dflash_cupy" / "tuning.json"


class TuneCache:
    """The on-disk choices: ``get(key)``, ``put(key, entry)`` (written through,
    atomically: a reader never sees half a file)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else cache_path()
        self.entries: dict = {}
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
                if not isinstance(data, dict) or data.get("version") != VERSION \
                        or not isinstance(data.get("entries"), dict):
                    raise ValueError(f"expected {{'version': {VERSION}, 'entries': {{...}}}}")
                self.entries = data["entries"]
            except (OSError, ValueError) as e:
                warnings.warn(f"dflash_cupy tuning cache {self.path} ignored ({e}); it will be rewritten",
                              RuntimeWarning, stacklevel=2)

    def get(self, key: str):
        e = self.entries.get(key)
        return e if isinstance(e, dict) else None

    def put(self, key: str, entry: dict) -> None:
        self.entries[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": VERSION, "entries": self.entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise


def device_key(backend) -> str:
    p = device_props.of(backend)
    return f"{p.name}|sm{p.sm_count}"


def gemm_key(gemm, m: int) -> str:
    """Everything that changes a stream GEMM launch's speed: the device, N, K,
    weight type, epilogue, activation terms, folded norm, logits, 16-bit x / y, the
    fused qkv epilogue (rope), the on-device K split (live_split) and the skipped
    columns, m."""
    return f"{device_key(gemm.backend)}|gemm_stream|{gemm._stream.variant.key()}|m{int(m)}"


def event_timer(backend, warmup: int = 3, repeats: int = 9) -> Callable | None:
    """``timer(fn) -> seconds`` (median of ``repeats`` event-timed calls after
    ``warmup``) on the CUDA backend; ``None`` elsewhere (no device clock)."""
    if backend.name != "cuda":
        return None
    import cupy

    def timer(fn) -> float:
        s = backend.current_stream()
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            e0, e1 = backend.event(), backend.event()
            e0.record(s)
            fn()
            e1.record(s)
            e1.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(e0.raw, e1.raw) * 1e-3)
        return statistics.median(samples)

    return timer


def attention_key(att) -> str:
    """Everything that changes a ring attention launch's speed."""
    return (f"{device_key(att.backend)}|ring_attention|D{att.D}|NH{att.NH}|NKV{att.NKV}|B{att.B}"
            f"|kv{att.kv_total}|lanes{att.lanes}x{att.lane_rows}|gate{att.gate}|{att.path}")


def _scratch_gemm(gemm, m: int):
    """A call of ``gemm`` over ``m`` rows on zero-filled scratch buffers of its
    shapes (speed does not depend on the values; the product's buffers are
    never touched)."""
    be, N, K = gemm.backend, gemm.N, gemm.K
    x = be.zeros((m, K), gemm.x_dtype)
    w = be.zeros((gemm.w_rows, K), gemm.w_device_dtype)
    kw = {}
    if gemm.norm_eps is not None:
        kw["norm"] = (be.asarray(np.ones(K, np.float32)), 0)
    if gemm.epilogue in ("argmax", "topk"):
        kw["partials"] = be.zeros(gemm.partials_shape(m), np.uint32)
        y = be.zeros((m, N), np.float32) if gemm.logits else None
    else:
        y = be.zeros((m, N), gemm.y_dtype)
    if gemm.epilogue == "residual":
        kw["residual"] = y
    return lambda: gemm(x, w, y, m, **kw)


def _scratch_attention(att, m=None):
    """A call of ``att`` on scratch buffers: every key visible (mask 0), every
    lane active (an idle lane's blocks would exit at once and time nothing)."""
    from .ops.step_descriptor import DESC_ACTIVE, DESC_LEN
    be, L, D = att.backend, att.lanes, att.D
    rows = L * att.lane_rows
    q = be.zeros((rows, att.NH * D), np.float32)
    k = be.zeros((L * att.kv_total, att.NKV * D), np.float16)
    v = be.zeros((L * att.kv_total, att.NKV * D), np.float16)
    mask = be.zeros((L, att.B, att.kv_total), np.float16)
    out = be.zeros((rows, att.NH * D), att.out_dtype)
    gate = None if att.gate is None else be.zeros((rows, att.NH if att.gate == "head" else att.NH * D),
                                                 np.float32)
    live = None
    if L > 1:
        d = np.zeros((L, DESC_LEN), np.int32)
        d[:, DESC_ACTIVE] = 1
        live = be.asarray(d)
    return lambda: att(q, k, v, mask, out, gate=gate, live=live)


def _kind(op):
    """(key, scratch call) makers for an object the tuner knows, else None."""
    from .ops.attention import RingAttention
    from .ops.gemm import Gemm
    if isinstance(op, Gemm):
        return (gemm_key, _scratch_gemm) if op.path == "stream" else None
    if isinstance(op, RingAttention):
        return (lambda a, m: attention_key(a)), _scratch_attention
    return None


def _label(c) -> str:
    return ",".join(str(v) for v in c)


def tune_op(op, m: int = 0, *, cache: TuneCache | None = None, timer: Callable | None = None,
            retime: bool = False) -> dict | None:
    """Choose ``op``'s launch configuration (a stream ``Gemm`` for ``m`` rows,
    or a ``RingAttention``): the cached choice for this device and shape if
    there is one (unless ``retime``), else, when a ``timer`` is available
    (default: CUDA events on a GPU), the fastest of its candidates, recorded
    in ``cache``. Returns the entry used, or ``None`` when the cost rule's
    plan stays (nothing to choose, or no cache entry and no timer)."""
    kind = _kind(op)
    if kind is None:
        return None
    make_key, make_call = kind
    m = int(m)
    cands = [tuple(c) for c in op.launch_candidates(m)]
    if len(cands) < 2:
        return None
    key = make_key(op, m)
    entry = cache.get(key) if cache is not None else None
    if entry is not None and not retime:
        choice = tuple(entry.get("choice", ()))
        if choice in cands:
            op.use_config(m, choice)
            return entry
    timer = timer if timer is not None else event_timer(op.backend)
    if timer is None:
        return None
    call = make_call(op, m)
    times = {}
    for c in cands:
        op.use_config(m, c)
        times[c] = float(timer(call))
    best = min(cands, key=lambda c: (times[c], _label(c)))
    op.use_config(m, best)
    entry = {"choice": list(best), "default": list(op.default_config(m)),
             "times_us": {_label(c): round(t * 1e6, 3) for c, t in times.items()},
             "device": device_props.of(op.backend).name}
    if cache is not None:
        cache.put(key, entry)
    return entry


def tune_gemm(gemm, m: int, **kw) -> dict | None:
    """``tune_op`` for a ``Gemm`` (``None`` off the stream path)."""
    return tune_op(gemm, m, **kw)


def tune_sites(sites, *, backend, tune: bool | None, cache: TuneCache | None = None,
               timer: Callable | None = None) -> dict:
    """Tune every ``(label, op, m)`` of ``sites`` (the GEMM calls a cache's step
    and bulk appends make, and its attention) as the product classes' ``tune=`` asks: ``None`` tunes on a
    GPU when ``DFLASH_CUPY_TUNE`` allows, ``True`` always (the emulator only
    reads the cache, or times with a given ``timer``), ``False`` never.
    Returns ``{(label, m): entry}`` for the sites tuned."""
    if tune is None:
        tune = enabled() and backend.name == "cuda"
    if not tune:
        return {}
    cache = cache if cache is not None else TuneCache()
    out = {}
    seen = set()
    for label, op, m in sites:
        if op is None or (id(op), int(m)) in seen:
            continue
        seen.add((id(op), int(m)))
        e = tune_op(op, m, cache=cache, timer=timer)
        if e is not None:
            out[(label, int(m))] = e
    return out


def report(path: str | Path) -> str:
    """One line per cached shape: the cost rule's configuration and time, the
    measured fastest and its gain, how many candidates were timed."""
    if not Path(path).is_file():
        return f"no tuning cache at {path}"
    cache = TuneCache(path)
    lines = [f"tuning cache {cache.path}: {len(cache.entries)} shape(s)"]
    for key, e in sorted(cache.entries.items()):
        times = e.get("times_us") or {}
        d, c = e.get("default"), e.get("choice")
        td = times.get(_label(d)) if d else None
        tc = times.get(_label(c)) if c else None
        gain = f"{td / tc:.2f}x" if td and tc else "?"
        shape = key.split("|", 2)[-1]
        lines.append(f"  {shape}: default {tuple(d) if d else '?'} {td if td is not None else '?'} us"
                     f" -> chosen {tuple(c) if c else '?'} {tc if tc is not None else '?'} us ({gain}; "
                     f"{len(times)} candidates)")
    return "\n".join(lines)

