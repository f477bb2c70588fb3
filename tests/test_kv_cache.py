"""DraftKvCache (SPEC §3-§4): the ring-cached drafter step against the float64
one-shot oracle ``reference.draft_forward`` over the window ``[lo, committed)``.

Every step a test drives is checked the same way (``Driver.check``):
``hidden`` (and ``logits``) within the "step" tolerance of the oracle, the
slot table equal to a NumPy model of SPEC §3, and both masks bit-equal to
``reference.ring_masks`` of that model.

Cost: a step of these tiny drafters takes ~20-200 ms on the emulator, so the
shapes live in a few fixed drafters (``SPECS`` in tests/support/drafters.py, each
compiled once and cached on disk by g++) and hypothesis draws schedules and
drafter indices, not shapes.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_cupy import backends
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.weights import DraftWeights
from tests.support.drafters import BF16, MAX_ERR, MAX_ERR_TIGHT, MAX_ERR_X1, SPECS, Driver, bits, built

PLAIN_CEILING = 1.6e-3   # max |step - plain oracle| over this module (measured 1.23e-3)
TIGHT_CEILING = 8e-4     # max |step - tight oracle| over this module (measured 5.4e-4)
X1_CEILING = 2e-2        # max |step - oracle| with x_split=False (measured 1.46e-2, bf16 weights)
P20 = 2**20


# what hypothesis draws from: d and e cost 5-10x a step of the others, so rarely
DRAWN = ("a", "b", "c", "a", "b", "c", "d", "e")


@pytest.fixture(autouse=True, scope="module")
def _report_errors():
    # this module's steps only: Drivers of other modules record into the same dicts
    # (tests/support/drafters.py), and parallel workers run modules in any order
    for errs in (MAX_ERR, MAX_ERR_TIGHT, MAX_ERR_X1):
        errs.clear()
    yield
    if MAX_ERR:  # shown with -s: the measured errors behind the "step" tolerance
        print("\nmax |step - oracle| by weight dtype: "
              + ", ".join(f"{k}: {v:.2e}" for k, v in sorted(MAX_ERR.items())))
        print("max |step - tight oracle| by weight dtype: "
              + ", ".join(f"{k}: {v:.2e}" for k, v in sorted(MAX_ERR_TIGHT.items())))
        print("max |step - oracle| with x_split=False: "
              + ", ".join(f"{k}: {v:.2e}" for k, v in sorted(MAX_ERR_X1.items())))
        # the maxima themselves are asserted: the plain comparison measured <= 1.23e-3
        # (bf16 weights) when these ceilings were set; a regression past them fails here
        assert max(MAX_ERR.values()) <= PLAIN_CEILING, MAX_ERR
        assert max(MAX_ERR_TIGHT.values()) <= TIGHT_CEILING, MAX_ERR_TIGHT
    if MAX_ERR_X1:
        assert max(MAX_ERR_X1.values()) <= X1_CEILING, MAX_ERR_X1


def standard_ops(name):
    """Growth from 1, acceptances 1..q_len, the largest in-graph append, a bulk
    jump, sliding past capacity, a jump over a whole window, small and large
    rewinds, a reset, growth again."""
    s = SPECS[name]
    cap, q = s.capacity, s.config.q_len
    A = 2 * q + 2
    c, ops = 1, [1]
    for d in (1, q, A, A + 1, 1, q):
        c += d
        ops.append(c)
    c = max(c + 1, cap + 3)          # past capacity: the ring wraps
    ops += [c, c + 1, c + q]
    c += q + 2 * cap + 5             # nothing of the old window survives
    ops += [c, c + q // 2 + 1]
    c += q // 2 + 1
    ops += [("rewind", c - 3), c - 2, ("rewind", max(1, c - cap - 1)), max(2, c - cap)]
    ops += ["reset", 3, 3 + q, ("eager", 4 + q)]
    return ops


# --------------------------------------------------------------------------- 1. the SPEC §3 invariant
@pytest.mark.parametrize("name,base", [
    ("a", 0), ("a", P20 - 7), ("b", 0), ("b", P20 - 3), ("c", 0), ("c", 2**31 - 200),
    ("d", 0), ("e", P20 - 100), ("f", P20 + 11), ("g", 0), ("h", P20 - 5),
])
def test_invariant_schedule(backend, name, base):
    d = Driver(backend, name, base=base, seed=zlib.crc32(f"{name}{base}".encode()))
    try:
        d.run_ops(standard_ops(name))
    finally:
        d.close()


@pytest.mark.parametrize("name", ["b", "c", "f"])
def test_single_term_activations(backend, name):
    """x_split=False (each activation rounded once to the 16-bit weight type:
    half the tensor-core work) through the whole schedule, against the oracle."""
    d = Driver(backend, name, seed=zlib.crc32(f"x1{name}".encode()), x_split=False)
    try:
        assert d.kv.x_split is False
        assert all(g.x_split is False for g in (d.kv.g_fc, d.kv.g_qkv, d.kv.g_o, d.kv.g_gate_up, d.kv.g_down))
        d.run_ops(standard_ops(name))
    finally:
        d.close()


@st.composite
def scenarios(draw):
    name = draw(st.sampled_from(DRAWN))
    s = SPECS[name]
    cap, q = s.capacity, s.config.q_len
    A = 2 * q + 2
    base = draw(st.sampled_from([0, 0, P20 - 5]))
    first = draw(st.integers(1, cap + A + 2))
    op = st.one_of(
        st.tuples(st.just("accept"), st.integers(1, q)),
        st.tuples(st.just("grow"), st.integers(0, A)),               # in-graph append (0: redraft)
        st.tuples(st.just("jump"), st.integers(A + 1, A + 2 * cap + 3)),  # bulk path
        st.tuples(st.just("rewind"), st.integers(1, 2 * cap + q)),
        st.tuples(st.just("reset"), st.integers(1, cap + A + 2)),
    )
    ops = draw(st.lists(st.tuples(op, st.booleans()), min_size=2, max_size=7))
    return name, base, first, ops, draw(st.integers(0, 2**16))


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(scenario=scenarios())
def test_invariant_property(backend, scenario):
    name, base, first, ops, seed = scenario
    d = Driver(backend, name, base=base, seed=seed)
    try:
        d.run_drawn(first, ops)
    finally:
        d.close()


def test_mixed_weight_dtypes(backend):
    """A checkpoint whose matrices differ in dtype between layers and inside a
    fused group (q f16, k/v bf16) still steps: one GEMM serves every layer."""
    w, _ = built("a")
    t = dict(w.tensors)
    t["fc.weight"] = t["fc.weight"].astype(np.float16)
    t["layers.0.self_attn.q_proj.weight"] = t["layers.0.self_attn.q_proj.weight"].astype(np.float16)
    for n in ("self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj",
              "input_layernorm"):
        t[f"layers.1.{n}.weight"] = t[f"layers.1.{n}.weight"].astype(BF16)
    mixed = DraftWeights(w.config, t)
    assert mixed.dtype is None
    d = Driver(backend, "a", seed=4, weights=mixed)
    try:
        d.run_ops([3, 30, ("rewind", 9), 10])
    finally:
        d.close()


def test_ring_switch(backend):
    """A step reads the ring by pointer inside its graph: switching to another
    ring (another dtype, another capacity) must rebind it, and back again."""
    d = Driver(backend, "a", seed=3)
    cfg = d.spec.config
    other = FeatureRing(31, cfg.n_captured, cfg.hidden_size, np.float16, backend=backend)
    first = d.ring
    try:
        d.run_ops([1, 5, 30, 33])
        d.ring, d.valid_hi = other, 0            # the target now writes another ring
        d.run_ops([34, 37, ("eager", 38)])
        d.ring, d.valid_hi = first, 0
        d.run_ops([39, 43])
    finally:
        d.close()
        other.close()


# --------------------------------------------------------------------------- 2. replay == eager
@pytest.mark.parametrize("name", ["a", "b"])
def test_replay_equals_eager_bitwise(backend, name):
    cap, q = SPECS[name].capacity, SPECS[name].config.q_len
    g, e = Driver(backend, name, seed=11), Driver(backend, name, seed=11)
    sched = [1, 1 + q, 3 + q, cap + 2, cap + 3, cap + 3 + q, 3 * cap + 40, 2, "reset", 4]
    try:
        for c in sched:
            if c == "reset":
                g.reset()
                e.reset()
                continue
            if c < (g.committed or 0):
                g.forget_from(c)
                e.forget_from(c)
            g.step(c, eager=False)
            e.step(c, eager=True)
            a, b = g.kv, e.kv
            pairs = [("hidden_states", a.hidden_states, b.hidden_states), ("slot_pos", a.slot_pos, b.slot_pos)]
            pairs += [(n, getattr(a, n), getattr(b, n)) for n in ("logits", "mask_full", "mask_swa")
                      if getattr(a, n) is not None]
            pairs += [(f"k_cache[{i}]", x, y) for i, (x, y) in enumerate(zip(a.k_cache, b.k_cache))]
            pairs += [(f"v_cache[{i}]", x, y) for i, (x, y) in enumerate(zip(a.v_cache, b.v_cache))]
            for n, x, y in pairs:
                assert np.array_equal(bits(backend.to_numpy(x)), bits(backend.to_numpy(y))), \
                    f"{n} differs between replay and eager at committed={c}"
    finally:
        g.close()
        e.close()


# --------------------------------------------------------------------------- 3. steady state
def test_steady_state_no_alloc_no_sync_no_recapture(emu, monkeypatch):
    d = Driver(emu, "a", seed=5)
    kv = d.kv
    cap, q = d.cap, d.q
    d.run_ops([1, cap + 1, cap + 2, cap + 2 + q])   # window full, both step graphs captured
    graphs = list(kv._graphs)
    assert all(gr is not None for gr in graphs)

    phase = {"now": None}
    calls = {"capture": 0, "launch": 0}

    def forbid(what, phases):
        def f(*a, **k):
            if phase["now"] in phases:
                raise AssertionError(f"{what} called during {phase['now']} of a steady-state step")
            return orig[what](*a, **k)
        return f

    orig = {n: getattr(emu, n) for n in ("empty", "zeros", "asarray", "pinned_empty", "to_numpy",
                                        "synchronize", "compile", "begin_capture")}
    plan_and_run = ("begin_step", "set_noise_embed", "run")
    for n in ("empty", "zeros", "asarray", "pinned_empty", "compile"):
        monkeypatch.setattr(emu, n, forbid(n, plan_and_run))
    for n in ("to_numpy", "synchronize"):
        monkeypatch.setattr(emu, n, forbid(n, plan_and_run))

    def counting_capture(stream):
        calls["capture"] += 1
        return orig["begin_capture"](stream)
    monkeypatch.setattr(emu, "begin_capture", counting_capture)
    for st in (emu.null_stream, kv.capture_stream):
        orig[st.name] = st.synchronize
        monkeypatch.setattr(st, "synchronize", forbid(st.name, plan_and_run))
    for i, ev in enumerate(kv._events + kv._noise_events + [kv._tail, kv._bulk_event]):
        # the device keeps up (check() reads every step's outputs): no pinned buffer is
        # reused before the work that read it has run, so the host never waits
        orig[f"event{i}"] = ev.synchronize
        monkeypatch.setattr(ev, "synchronize", forbid(f"event{i}", plan_and_run))
    waits = kv.host_waits
    for gr in graphs:
        launch = gr.launch

        def counted(stream=None, _launch=launch):
            calls["launch"] += 1
            return _launch(stream)
        monkeypatch.setattr(gr, "launch", counted)

    c = d.committed
    for a in (1, q, 2, q):          # acceptances within a_step, window full
        c += a
        d.feed(c)
        noise = d.noise()
        d.model(c)
        phase["now"] = "begin_step"
        kv.begin_step(d.ring, c)
        phase["now"] = "set_noise_embed"
        kv.set_noise_embed(noise)
        phase["now"] = "run"
        out = kv.run()
        phase["now"] = None
        assert out is kv.hidden_states
        d.committed = c
        d.check(c, noise)
    assert calls == {"capture": 0, "launch": 4}
    assert [id(gr) for gr in kv._graphs] == [id(gr) for gr in graphs]
    assert kv.host_waits == waits
    d.close()


# --------------------------------------------------------------------------- 4. masks and slot table
def test_masks_and_slot_table(backend):
    """Window edges: below the sliding window, at it, at capacity, one past,
    in-graph rewind (reset flag in the descriptor), bulk rewind, redraft."""
    d = Driver(backend, "a", seed=9)
    cap, q, w = d.cap, d.q, 3
    try:
        d.run_ops([1, w - 1, w, w + 1, cap - 1, cap, cap + 1, cap + 1, 2 * cap + 1,
                   ("rewind", 2 * cap - 2), ("rewind", cap + 2), cap + 2 + q, ("rewind", 2),
                   ("eager", 2 + q)])
        sp = backend.to_numpy(d.kv.slot_pos)
        assert sorted(sp[sp >= 0].tolist()) == list(range(0, 2 + q))
    finally:
        d.close()


# --------------------------------------------------------------------------- 5. bad input
def _state(kv):
    return kv.next_pos, kv.backend.to_numpy(kv.slot_pos).tolist(), kv._planned


def test_bad_input_leaves_cache_unchanged(backend):
    """Each bad call raises an exception naming the problem, changes nothing,
    and the next valid step equals (bit for bit) that of a twin cache which
    never saw the bad call."""
    name = "c"
    s = SPECS[name]
    cfg, cap, q = s.config, s.capacity, s.config.q_len
    d = Driver(backend, name, seed=21)
    twin = DraftKvCache(d.w, cap, lm_head=d.lm, backend=backend)
    kv, ring = d.kv, d.ring
    H = cfg.hidden_size

    def bad(exc, match, fn, *args):
        before = _state(kv)
        with pytest.raises(exc, match=match):
            fn(*args)
        assert _state(kv) == before, f"{fn.__name__}{args!r} changed the cache"

    def valid(c, order="step"):
        d.feed(c)
        noise = d.noise()
        d.model(c)
        if order == "step":
            kv.step(ring, c, noise)
        elif order == "noise_first":    # noise embeddings may be staged before planning
            kv.set_noise_embed(noise)
            kv.begin_step(ring, c)
            kv.run()
        elif order == "device":         # a device array, read on the current stream
            kv.begin_step(ring, c)
            kv.set_noise_embed(backend.asarray(noise))
            kv.run()
        else:
            kv.begin_step(ring, c)
            kv.set_noise_embed(noise)
            kv.run()
        twin.step(ring, c, noise)
        d.committed = c
        d.check(c, noise)
        for n in ("hidden_states", "logits"):
            assert np.array_equal(backend.to_numpy(getattr(kv, n)), backend.to_numpy(getattr(twin, n))), \
                f"{n} differs from the twin at committed={c}"

    small = FeatureRing(cap - 1, cfg.n_captured, H, s.ring_dtype, backend=backend)
    wide = FeatureRing(cap, cfg.n_captured + 1, H, s.ring_dtype, backend=backend)
    closed = FeatureRing(cap, cfg.n_captured, H, s.ring_dtype, backend=backend)
    closed.close()
    try:
        bad(RuntimeError, "begin_step", kv.run)
        for c in (0, -3):
            bad(ValueError, "committed", kv.begin_step, ring, c)
        for c in (True, 2.0, "3"):
            bad(TypeError, "committed", kv.begin_step, ring, c)
        bad(KeyError, r"positions \[0, 2\)", kv.begin_step, ring, 2)      # nothing written yet
        valid(5)
        bad(KeyError, r"positions \[5, 12\)", kv.begin_step, ring, 12)    # bulk range missing
        bad(KeyError, r"positions \[5, 7\)", kv.begin_step, ring, 7)      # in-graph range missing
        bad(TypeError, "ring", kv.begin_step, np.zeros((cap, cfg.fc_in), np.float32), 5)
        bad(ValueError, "fc_in", kv.begin_step, wide, 5)
        bad(RuntimeError, "ring is closed", kv.begin_step, closed, 5)
        d.feed(cap + 4)
        # a ring smaller than the window is allowed; it must hold the rows the step appends
        bad(KeyError, r"missing \[5, " + str(cap + 4) + r"\).*re-prefill", kv.begin_step, small, cap + 4)
        valid(cap + 4)
        for shape in ((q, H - 1), (q + 1, H), (H,), (q * H,)):
            bad(ValueError, "noise_embed", kv.step, ring, cap + 5, np.zeros(shape, np.float32))
            bad(ValueError, "noise_embed", kv.set_noise_embed, np.zeros(shape, np.float32))
        for arr in (np.zeros((q, H), np.int32), np.zeros((q, H), np.complex64), [[0.0] * H] * q):
            bad(TypeError, "noise_embed", kv.set_noise_embed, arr)  # a list is not an array either
        # device arrays must be f32
        bad(TypeError, "noise_embed", kv.set_noise_embed, backend.asarray(np.zeros((q, H), np.float16)))
        d.feed(cap + 4 + 3 * q + 4)                 # a bulk jump ...
        bad(TypeError, "noise_embed", kv.step, ring, cap + 4 + 3 * q + 4, np.zeros((q, H), np.int64))
        valid(cap + 4 + 3 * q + 4)                  # ... after a bad step call changes nothing
        # a bad call while a valid step is planned leaves that plan in place
        c = d.committed + 1
        d.feed(c)
        kv.begin_step(ring, c)
        bad(ValueError, "committed", kv.begin_step, ring, 0)
        bad(TypeError, "noise_embed", kv.set_noise_embed, np.zeros((q, H), np.int16))
        noise = d.noise()
        kv.set_noise_embed(noise)
        kv.run()
        twin.step(ring, c, noise)
        d.model(c)
        d.committed = c
        d.check(c, noise)
        assert np.array_equal(backend.to_numpy(kv.hidden_states), backend.to_numpy(twin.hidden_states))
        valid(c + 1, order="noise_first")
        valid(c + 2, order="split")
        valid(c + 3, order="device")
        d.reset()                                   # kv.reset()
        twin.reset()
        bad(RuntimeError, "begin_step", kv.run)
        valid(2)
        valid(3, order="noise_first")
    finally:
        for r in (small, wide):
            r.close()
        twin.close()
        d.close()


def test_ring_on_another_backend():
    if not backends.gpu_available():
        pytest.skip("needs both backends (no GPU visible)")
    emu, cuda = backends.get("emulated"), backends.get("cuda")
    w, lm = built("c")
    s = SPECS["c"]
    for be, other in ((emu, cuda), (cuda, emu)):
        with DraftKvCache(w, s.capacity, lm_head=lm, backend=be) as kv, \
                FeatureRing(s.ring_capacity, 1, 32, backend=other) as r:
            r.write(0, np.ones((3, 32), np.float32))
            with pytest.raises(ValueError, match="backend"):
                kv.begin_step(r, 3)
            assert kv.next_pos == 0 and not kv._planned


def test_constructor_errors(emu):
    w, _ = built("a")
    H = SPECS["a"].config.hidden_size
    for bad in (0, "False", None):
        with pytest.raises(TypeError, match="x_split"):
            DraftKvCache(w, 7, backend=emu, x_split=bad)
    with pytest.raises(TypeError, match="weights"):
        DraftKvCache(w.tensors, 7, backend=emu)
    for cap, exc in ((0, ValueError), (-1, ValueError), (True, TypeError), (2.5, TypeError)):
        with pytest.raises(exc, match="capacity"):
            DraftKvCache(w, cap, backend=emu)
    for bc in (0, 2048, 1.5):
        with pytest.raises(ValueError, match="bulk_chunk"):
            DraftKvCache(w, 7, backend=emu, bulk_chunk=bc)
    for lm in (np.zeros((5, H + 1), np.float32), np.zeros((H,), np.float32)):
        with pytest.raises(ValueError, match="lm_head"):
            DraftKvCache(w, 7, lm_head=lm, backend=emu)
    with pytest.raises(TypeError, match="lm_head"):
        DraftKvCache(w, 7, lm_head=np.zeros((5, H), np.int32), backend=emu)


# --------------------------------------------------------------------------- 7. close
def test_close_and_context_manager(backend):
    d = Driver(backend, "c", seed=2)
    d.run_ops([1, 4])
    kv, ring = d.kv, d.ring
    with kv as k:
        assert k is kv
        d.step(5)
    noise = d.noise()
    for fn, args in ((kv.begin_step, (ring, 6)), (kv.set_noise_embed, (noise,)), (kv.run, ()),
                     (kv.step, (ring, 6, noise)), (kv.reset, ())):
        with pytest.raises(RuntimeError, match="closed"):
            fn(*args)
    kv.close()      # idempotent
    ring.close()


def test_ring_writes_wait_for_queued_steps(emu, monkeypatch):
    # On a GPU the ring's copies run on its own stream: each write must be ordered
    # after every step (and bulk append) the cache has queued that gathers from the
    # ring, or a fast write could replace a slot before the step read it.
    d = Driver(emu, "a", seed=11)
    kv, ring = d.kv, d.ring
    waits = []
    s = emu.stream()
    monkeypatch.setattr(s, "wait_event", lambda ev: waits.append(ev))
    d.run_ops([d.cap + 3])             # a bulk append, then the step's replay
    assert kv._bulk_event is not None and ring._readers[id(kv.engine)] in kv._events
    last = ring._readers[id(kv.engine)]
    waits.clear()
    with s:
        d.feed(d.committed + 1)        # the next write waits for that replay, on the device
    assert last in waits and ring.write_event in waits
    emu.synchronize()
    d.close()


@pytest.mark.skipif(not backends.gpu_available(),
                    reason="CuPy allocator check; its emulated twin is test_steady_state_no_alloc_no_sync_no_recapture")
def test_steady_state_no_device_allocation_cuda():
    import cupy
    be = backends.get("cuda")
    d = Driver(be, "a", seed=6)
    kv = d.kv
    d.run_ops([1, d.cap + 1, d.cap + 2, d.cap + 2 + d.q])     # both step graphs captured

    def deny(size):
        raise AssertionError(f"device allocation of {size} bytes inside a steady-state step")

    c = d.committed
    for a in (1, d.q, 2):
        c += a
        d.feed(c)
        noise = d.noise()
        d.model(c)
        with cupy.cuda.using_allocator(deny):
            kv.begin_step(d.ring, c)
            kv.set_noise_embed(noise)
            kv.run()
        d.committed = c
        d.check(c, noise)
    d.close()


def test_bulk_chunk_below_a_step_is_honoured(emu):
    # bulk_chunk is the rows per bulk launch exactly, also below a step's a_step rows (the
    # append workspace grows to a_step instead of the chunk being raised): a prefill of
    # capacity+2 rows in chunks of 3 matches the oracle and the default chunking bit for bit.
    name = "a"
    cap, a_step = SPECS[name].capacity, 2 * SPECS[name].config.q_len + 2
    small, default = Driver(emu, name, seed=5), Driver(emu, name, seed=5)
    try:
        small.kv.close()
        small.kv = DraftKvCache(small.w, cap, lm_head=small.lm, backend=emu, bulk_chunk=3)
        assert 3 < a_step and small.kv.bulk_chunk == 3
        launches = []
        e = small.kv.engine
        real = e._append_rows
        e._append_rows = lambda feat, n, k, v, s: (launches.append(n), real(feat, n, k, v, s))[1]
        for c in (cap + 2, cap + 2 + a_step + 1):   # a prefill, then a jump: both bulk appends
            small.step(c)
            default.step(c)
            for x, y in zip(small.kv.k_cache + small.kv.v_cache + [small.kv.hidden_states],
                            default.kv.k_cache + default.kv.v_cache + [default.kv.hidden_states]):
                assert np.array_equal(bits(emu.to_numpy(x)), bits(emu.to_numpy(y))), f"committed={c}"
        assert launches[:8] == [3] * 7 + [2], launches   # cap rows of the first window: 23 = 7*3 + 2
        assert max(launches) <= 3
    finally:
        small.close()
        default.close()


@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_noise_embed_is_read_in_place(backend, name):
    """The first layer reads ``noise_embed`` where it lies (no copy node per step): a step
    leaves it bit for bit as it was, a plan + run without ``set_noise_embed`` reuses it, and
    noise written into ``kv.noise_embed`` on the device is what the next step reads. (a: f32
    weights, noise_embed alone; b: the folded norms with the gate GEMM's rmsnorm; c: the
    context-KV-norm variant, noise_embed inside the first layer's rows.)"""
    d = Driver(backend, name, seed=5)
    kv, cap = d.kv, d.spec.capacity
    c1 = cap + 2
    n1 = d.step(c1)
    assert np.array_equal(bits(backend.to_numpy(kv.noise_embed)), bits(n1)), "a step wrote noise_embed"
    c2 = c1 + 3
    d.feed(c2)
    d.model(c2)
    kv.begin_step(d.ring, c2)
    kv.run()
    d.committed = c2
    d.check(c2, n1)
    n3 = d.noise()
    c3 = c2 + 1
    d.feed(c3)
    d.model(c3)
    backend.copy_d2d_async(kv.noise_embed, backend.asarray(n3))
    kv.begin_step(d.ring, c3)
    kv.set_noise_embed(kv.noise_embed)   # filled in place: nothing to copy
    kv.run()
    d.committed = c3
    d.check(c3, n3)
