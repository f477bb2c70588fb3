"""Streams as a GPU runs them, on the emulated backend: deferred per-stream
execution, hazard detection (StreamOrderError), the current stream, graph
replay on a stream; and the library's stream contract with the caller
(DraftKvCache / FeatureRing ordered on the caller's current stream)."""
import numpy as np
import pytest

from dflash_cupy import reference
from dflash_cupy.backends import CaptureError, StreamOrderError
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import DraftKvCache
from tests.support.drafters import SPECS, built
from tests.support.tolerances import assert_close

SRC = r"""
extern "C" __global__ void fill(float* y, float v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = v;
}
extern "C" __global__ void add(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}
extern "C" __global__ void sum2(const float* a, const float* b, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i];
}
"""
N = 64


@pytest.fixture
def k(emu):
    mod = emu.compile(SRC, filename="streams.cu")
    return {n: mod.get_function(n) for n in ("fill", "add", "sum2")}


def fresh(emu, name, value=0.0):
    """A device array complete for every stream (asarray is synchronous)."""
    return emu.label(emu.asarray(np.full(N, value, np.float32)), name)


def fill(k, y, v, stream=None):
    k["fill"]((1,), (N,), (y, np.float32(v), np.int32(N)), stream=stream)


# --------------------------------------------------------------------------- deferred execution
def test_work_runs_later_than_the_host_expects(emu, k):
    s1, s2 = emu.stream(), emu.stream()
    a, b = fresh(emu, "a"), fresh(emu, "b")
    fill(k, a, 1.0, s1)
    fill(k, b, 2.0, s2)
    assert a[0] == 0 and b[0] == 0, "launches are queued, not run at issue"
    s1.synchronize()
    assert a[0] == 1 and b[0] == 0, "synchronising one stream leaves the other's work queued"
    assert emu.to_numpy(b, stream=s2)[0] == 2
    assert emu.to_numpy(a).tolist() == [1.0] * N  # the host knows s1 is done: any stream may read


def test_event_edge_orders_streams_and_runs_the_producer_first(emu, k):
    s1, s2 = emu.stream(), emu.stream()
    x, y = fresh(emu, "x"), fresh(emu, "y", 10.0)
    ev = emu.event()
    fill(k, x, 3.0, s1)
    ev.record(s1)
    s2.wait_event(ev)
    k["add"]((1,), (N,), (x, y, np.int32(N)), stream=s2)
    assert x[0] == 0
    # draining s2 runs s1's fill first (the wait), whatever order the host asks in
    assert emu.to_numpy(y, stream=s2).tolist() == [13.0] * N


def test_event_query_makes_progress_and_synchronize_informs_the_host(emu, k):
    s = emu.stream()
    x = fresh(emu, "x")
    ev = emu.event()
    assert ev.query(), "an event never recorded is complete"
    fill(k, x, 5.0, s)
    ev.record(s)
    assert not ev.query() and ev.query(), "a poll loop ends: the emulated device progresses"
    assert emu.to_numpy(x)[0] == 5  # the host learnt of the completion from query()


# --------------------------------------------------------------------------- hazards
def test_read_after_write_between_streams_names_everything(emu, k):
    s1, s2 = emu.stream(), emu.stream()
    x, y = fresh(emu, "x"), fresh(emu, "y")
    fill(k, x, 1.0, s1)
    with pytest.raises(StreamOrderError) as e:
        k["add"]((1,), (N,), (x, y, np.int32(N)), stream=s2)
    msg = str(e.value)
    for part in ("read-after-write", "'x'", "kernel add (x)", s2.name, "kernel fill (y)", s1.name):
        assert part in msg, (part, msg)
    assert not s2._queue, "a launch that raises queues nothing"
    # the same with an event edge is fine
    ev = emu.event()
    ev.record(s1)
    s2.wait_event(ev)
    k["add"]((1,), (N,), (x, y, np.int32(N)), stream=s2)
    assert emu.to_numpy(y, stream=s2).tolist() == [1.0] * N


def test_write_after_read_and_write_after_write(emu, k):
    s1, s2 = emu.stream(), emu.stream()
    x, y, z = fresh(emu, "x"), fresh(emu, "y"), fresh(emu, "z")
    k["add"]((1,), (N,), (x, y, np.int32(N)), stream=s1)      # reads x, writes y
    with pytest.raises(StreamOrderError, match=r"write-after-read hazard on 'x'.*kernel fill \(y\)"):
        fill(k, x, 2.0, s2)
    with pytest.raises(StreamOrderError, match=r"write-after-write hazard on 'y'"):
        fill(k, y, 2.0, s2)
    # reads from two streams do not conflict (const T* is a read only)
    k["sum2"]((1,), (N,), (x, x, z, np.int32(N)), stream=s2)
    emu.synchronize()
    fill(k, x, 2.0, s2)   # after a device synchronisation the host orders everything
    emu.synchronize()


def test_disjoint_parts_of_one_array_do_not_conflict(emu):
    s1, s2 = emu.stream(), emu.stream()
    buf = emu.label(emu.empty((2, N), np.float32), "buf")
    src = emu.pinned_empty((2, N), np.float32)
    src[...] = 7
    emu.copy_h2d_async(buf[0], src[0], stream=s1)
    emu.copy_h2d_async(buf[1], src[1], stream=s2)
    with pytest.raises(StreamOrderError, match=r"'buf'.*bytes \[0, 256\)"):
        emu.copy_d2d_async(buf[0], buf[1], stream=s2)
    emu.synchronize()
    assert emu.to_numpy(buf).tolist() == [[7.0] * N] * 2


def test_host_read_of_device_memory_another_stream_writes(emu, k):
    s = emu.stream()
    x = fresh(emu, "x")
    fill(k, x, 4.0, s)
    with pytest.raises(StreamOrderError, match=r"to_numpy on the default stream reads it while kernel fill"):
        emu.to_numpy(x)                    # CuPy's x.get() reads on the current stream
    with s:
        assert emu.to_numpy(x)[0] == 4     # on the stream that wrote it: in order


def test_zeros_is_a_memset_on_the_current_stream(emu, k):
    s = emu.stream()
    z = emu.label(emu.zeros((N,), np.float32), "z")
    with pytest.raises(StreamOrderError, match=r"write-after-write hazard on 'z'.*zeros \(memset\) on "
                                               r"the default stream"):
        fill(k, z, 1.0, s)
    with s:
        z2 = emu.zeros((N,), np.float32)
        fill(k, z2, 1.0)                   # same (current) stream: ordered
        assert emu.to_numpy(z2)[0] == 1


def test_host_rewrite_of_pinned_staging_that_queued_work_reads(emu):
    s = emu.stream()
    d = fresh(emu, "d")
    p = emu.pinned_empty((N,), np.float32)
    p[...] = 1
    emu.copy_h2d_async(d, p, stream=s)
    with pytest.raises(StreamOrderError, match=r"write-after-read.*host write.*copy_h2d_async \(src\)"):
        emu.host_write(p, "host write")
    ev = emu.event()
    ev.record(s)
    ev.synchronize()
    emu.host_write(p)                      # the copy has run: fine
    p[...] = 2
    emu.copy_h2d_async(d, p, stream=s)
    p[...] = 3                             # an undeclared rewrite before the copy ran ...
    with pytest.raises(StreamOrderError, match="pinned source .* was rewritten by the host"):
        s.synchronize()                    # ... is caught when the copy runs


def test_host_read_of_pinned_buffer_a_queued_copy_writes(emu, k):
    s = emu.stream()
    x = fresh(emu, "x")
    out = emu.pinned_empty((N,), np.float32)
    fill(k, x, 6.0, s)
    emu.copy_d2h_async(out, x, stream=s)
    with pytest.raises(StreamOrderError, match="read-after-write.*host read"):
        emu.host_read(out)
    s.synchronize()
    emu.host_read(out)
    assert out[0] == 6


def test_device_synchronize_covers_streams_that_are_gone(emu, k):
    import gc
    x = fresh(emu, "x")
    s = emu.stream()
    fill(k, x, 1.0, s)
    ev = emu.event()
    ev.record(s)
    assert not ev.query()                  # ran, but the host was not told
    del s, ev
    gc.collect()
    emu.synchronize()                      # ... a device synchronisation tells it
    fill(k, x, 2.0, emu.stream())


# --------------------------------------------------------------------------- current stream
def test_current_stream_and_with_block(emu, k):
    assert emu.current_stream() is emu.null_stream and emu.as_stream(None) is emu.null_stream
    s1, s2 = emu.stream(), emu.stream()
    x = fresh(emu, "x")
    with s1:
        assert emu.current_stream() is s1
        with s2:
            assert emu.current_stream() is s2
        assert emu.current_stream() is s1
        fill(k, x, 2.0)                    # stream=None: the current stream
    assert emu.current_stream() is emu.null_stream
    assert len(s1._queue) == 1 and not s2._queue
    with pytest.raises(StreamOrderError):
        emu.to_numpy(x)
    assert emu.to_numpy(x, stream=s1)[0] == 2


# --------------------------------------------------------------------------- graphs
def test_graph_replay_queues_nodes_in_capture_order_on_the_launch_stream(emu, k):
    cs, s1, s2 = emu.stream(), emu.stream(), emu.stream()
    x, y = fresh(emu, "x"), fresh(emu, "y")
    p = emu.pinned_empty((N,), np.float32)
    emu.begin_capture(cs)
    emu.copy_h2d_async(x, p, stream=cs)
    k["add"]((1,), (N,), (x, y, np.int32(N)), stream=cs)
    g = emu.end_capture(cs)
    for i in range(3):
        p[...] = i + 1
        g.launch(s1)                        # runs on s1, not on the capture stream
        assert not cs._queue and len(s1._queue) == 2
        s1.synchronize()
    assert emu.to_numpy(y, stream=s1).tolist() == [6.0] * N
    fill(k, x, 0.0, s2)
    with pytest.raises(StreamOrderError, match=r"'x'.*copy_h2d_async \(dst\) on " + s1.name):
        g.launch(s1)                        # x is still being written on s2
    assert not s1._queue, "a replay that raises queues none of its nodes"
    ev = emu.event()
    ev.record(s2)
    s1.wait_event(ev)
    g.launch(s1)
    s1.synchronize()


def test_capture_rules(emu):
    cs = emu.stream()
    outside = emu.event()
    outside.record(emu.stream())
    with pytest.raises(CaptureError, match="default stream"):
        emu.begin_capture(emu.null_stream)
    emu.begin_capture(cs)
    try:
        with pytest.raises(CaptureError, match="outside the capture"):
            cs.wait_event(outside)
        inside = emu.event()
        inside.record(cs)
        cs.wait_event(inside)               # an event of the same capture: fine
    finally:
        g = emu.end_capture(cs)
    s = emu.stream()
    g.launch(s)                             # the event node records on the replay stream
    assert inside._stream is s
    other = emu.stream()
    other.wait_event(inside)
    other.synchronize()


# --------------------------------------------------------------------------- the library's contract
class Pipeline:
    """The target side of a decode loop with everything on the device: the
    features and noise of each step are produced on the current stream (here
    by copies from per-step pinned buffers), the drafter consumes them and
    the tokens are read back on the same stream; no synchronisation anywhere."""

    def __init__(self, be, name="a", seed=3):
        self.be, spec = be, SPECS[name]
        self.cfg = spec.config
        self.w, self.lm = built(name)
        self.kv = DraftKvCache(self.w, spec.capacity, lm_head=self.lm, backend=be)
        self.ring = FeatureRing(spec.ring_capacity, self.cfg.n_captured, self.cfg.hidden_size,
                                spec.ring_dtype, backend=be)
        self.rng = np.random.default_rng(seed)
        self.hist = np.zeros((0, self.cfg.fc_in), np.float32)
        self.committed = 0

    def device_input(self, host, dtype=np.float32):
        be = self.be
        p = be.pinned_empty(host.shape, dtype)
        p[...] = host
        d = be.empty(host.shape, dtype)
        be.copy_h2d_async(d, p)            # on the current stream
        return d

    def step(self, accepted, eager=False, ring_stream=None, check=True):
        """One decode step; ``check=False`` leaves its outputs unread (the
        device may still be running it when the host issues the next one)."""
        be, kv = self.be, self.kv
        c = self.committed + accepted
        new = self.rng.standard_normal((c - self.committed, self.cfg.fc_in)).astype(np.float32)
        self.hist = np.concatenate([self.hist, new])
        w0 = max(self.committed, c - self.ring.capacity)   # what the ring can hold
        rows = new[w0 - self.committed:].astype(self.ring.dtype)
        with ring_stream or be.current_stream():
            self.ring.write(w0, self.device_input(rows, self.ring.storage.dtype))
        noise = self.rng.standard_normal((kv.q_len, self.cfg.hidden_size)).astype(np.float32)
        if eager:
            kv.begin_step(self.ring, c)
            kv.set_noise_embed(self.device_input(noise))
            hidden = kv.run(eager=True)
        else:
            hidden = kv.step(self.ring, c, self.device_input(noise))
        if not check:
            self.committed = c
            return hidden
        logits = be.to_numpy(kv.logits)    # on the current stream: in order after the step
        got = be.to_numpy(hidden)
        self.committed = c
        lo = c - min(c, kv.capacity)
        ref, lref = reference.draft_forward(self.w, self.hist[lo:c].astype(self.ring.dtype), noise,
                                            lm_head=self.lm)
        assert_close(got, ref, "step", f"committed={c}")
        assert_close(logits, lref, "step", f"committed={c} (logits)")
        return hidden

    def close(self):
        self.kv.close()
        self.ring.close()


def test_pipeline_on_a_stream_needs_no_synchronisation(emu):
    s = emu.stream()
    with s:
        p = Pipeline(emu)
        outs = [p.step(a) for a in (5, 1, p.kv.q_len, 30)]   # a prefill, steps, a bulk jump
        assert all(o is outs[0] for o in outs), "hidden_states is one buffer, rewritten by each step"
    # the same cache used from another stream next: ordered after its earlier work by events
    with s:
        p.step(1, check=False)             # still queued on s ...
    s2 = emu.stream()
    with s2:
        p.step(2)                          # ... when the next step is issued on s2
        p.step(1, eager=True, check=False)
    s3 = emu.stream()
    with s3:
        p.kv.reset()                       # (ordered after the eager step on s2)
        # a new request, on a third stream
        p.ring.reset()
        p.hist, p.committed = p.hist[:0], 0
        p.step(6)
        p.step(2, eager=True)
    p.close()


def test_ring_written_on_one_stream_read_by_steps_on_another(emu):
    """The target writes features on its stream, the drafter steps on its own:
    the library orders the gathers after the writes and the next writes after
    the gathers, on the device, with no synchronisation."""
    target, drafter = emu.stream(), emu.stream()
    with drafter:
        p = Pipeline(emu)
        for a in (5, 1, 3, 30, 2, 1):      # prefill, steps, a bulk jump (the ring wraps)
            p.step(a, ring_stream=target, check=False)   # the next write overlaps this step
            p.step(1, ring_stream=target)
    p.close()


def test_pipeline_raises_when_the_library_drops_the_ordering(emu, monkeypatch):
    s = emu.stream()
    private = emu.stream()
    with s:
        p = Pipeline(emu)
    emu.synchronize()                       # construction is not what this test is about
    # the old behaviour: the cache issues on its own stream, with no edges to the caller's
    monkeypatch.setattr(p.kv.order, "order", lambda stream=None, after=(): private)
    with s:
        # the step reads its device noise before the caller's stream has written it
        with pytest.raises(StreamOrderError, match=r"read-after-write hazard .* copy_d2d_async \(src\) on "
                                                   + private.name):
            p.step(5)
        # and the caller reads hidden states the private stream may still be writing
        p.kv.set_noise_embed(np.zeros((p.kv.q_len, p.cfg.hidden_size), np.float32))
        h = p.kv.run()
        with pytest.raises(StreamOrderError, match=r"read-after-write hazard on 'DraftKvCache.hidden_states'"
                                                   r".* to_numpy on " + s.name):
            emu.to_numpy(h)
    emu.synchronize()
    monkeypatch.undo()
    with s:
        p.step(5)                           # the library's ordering restored: fine
    p.close()


def test_ring_write_without_ordering_raises(emu, monkeypatch):
    s = emu.stream()
    with s:
        p = Pipeline(emu)
        p.step(5)
        c = p.committed + 1                 # one more step queued on s, its outputs not read yet
        p.ring.write(p.committed, np.ones((1, p.cfg.fc_in), np.float32))
        p.kv.step(p.ring, c, np.zeros((p.kv.q_len, p.cfg.hidden_size), np.float32))
    private = emu.stream()
    # a ring that writes on its own stream, without edges to queued readers or the caller
    monkeypatch.setattr(p.ring._stream_order, "order", lambda stream=None, after=(): private)
    with s:
        with pytest.raises(StreamOrderError, match=r"write-after-read hazard on 'FeatureRing.storage'"
                                                   r".*kernel (gather_features|plan_lanes)"):
            p.ring.write(c, np.ones((1, p.cfg.fc_in), np.float32))
        s.synchronize()                     # the step is done: only the input is unordered now
        rows = p.device_input(np.ones((1, p.cfg.fc_in), np.float32))   # produced on s
        with pytest.raises(StreamOrderError, match=r"read-after-write.*copy_d2d_async \(src\)"):
            p.ring.write(c, rows)
    emu.synchronize()


def test_output_lifetime_and_run_consumes_its_plan(emu):
    s = emu.stream()
    with s:
        p = Pipeline(emu)
        h1 = p.step(5)
        first = emu.to_numpy(h1)
        h2 = p.step(1)
        assert h1 is h2 and not np.array_equal(emu.to_numpy(h1), first), "the next step overwrites h1"
        with pytest.raises(RuntimeError, match="begin_step"):
            p.kv.run()                      # the plan was consumed: no silent replay of the old one
    p.close()


def test_host_waits_per_steady_state_step(emu):
    """Zero host waits per step while the device keeps up (the caller reads each
    step's tokens); when it falls behind the host waits only to reuse a pinned
    buffer, and results stay right."""
    s = emu.stream()
    with s:
        p = Pipeline(emu)
        for a in (5, 2, 3, 1):                          # warm-up: prefill, both graphs captured
            p.step(a)
        kv_w, ring_w = p.kv.host_waits, p.ring.host_waits
        for a in (1, 2, 4, 1, 3, 2):
            p.step(a)
        assert (p.kv.host_waits, p.ring.host_waits) == (kv_w, ring_w)
        # a host that runs ahead (no reads for several steps): waits now happen, bounded by one
        # per reused buffer per step, and the step it finally reads is still right
        kv = p.kv
        for a in (1, 1, 1, 1):
            c = p.committed + a
            new = p.rng.standard_normal((a, p.cfg.fc_in)).astype(np.float32)
            p.hist = np.concatenate([p.hist, new])
            p.ring.write(p.committed, new)
            kv.step(p.ring, c, np.zeros((kv.q_len, p.cfg.hidden_size), np.float32))
            p.committed = c
        assert kv.host_waits > kv_w
        assert kv.host_waits - kv_w <= 2 * 4
        p.step(1)
    p.close()


def test_noise_staging_is_reused_only_after_its_copy_ran(emu):
    """Noise staged several times for one step (the last one counts): each
    staging buffer is rewritten only once the copy that read it has run."""
    s = emu.stream()
    with s:
        p = Pipeline(emu)
        p.step(5)
        kv, H = p.kv, p.cfg.hidden_size
        c = p.committed + 1
        new = p.rng.standard_normal((1, p.cfg.fc_in)).astype(np.float32)
        p.hist = np.concatenate([p.hist, new])
        p.ring.write(p.committed, new)
        kv.begin_step(p.ring, c)
        waits = kv.host_waits
        noises = [p.rng.standard_normal((kv.q_len, H)).astype(np.float32) for _ in range(3)]
        for n in noises:                    # the third reuses the first's buffer: its copy is queued
            kv.set_noise_embed(n)
        assert kv.host_waits == waits + 1
        got = emu.to_numpy(kv.run())
        ref, _ = reference.draft_forward(p.w, p.hist[c - min(c, kv.capacity):c], noises[-1],
                                         lm_head=p.lm)
        assert_close(got, ref, "step", "last staged noise")
    p.close()


def test_a_bad_stream_argument_changes_nothing(emu):
    s = emu.stream()
    with s:
        p = Pipeline(emu)
        p.step(5)
    kv, ring = p.kv, p.ring
    H, c = p.cfg.hidden_size, p.committed
    noise = np.zeros((kv.q_len, H), np.float32)
    rows = np.ones((1, p.cfg.fc_in), np.float32)
    state = lambda: (kv.next_pos, kv._planned, kv._slot, ring.lo, ring.hi)  # noqa: E731
    before = state()
    for bad in (5, "s", np.float32(0)):
        for call in (lambda: kv.step(ring, c + 1, noise, stream=bad),
                     lambda: kv.begin_step(ring, c, stream=bad),
                     lambda: kv.set_noise_embed(noise, stream=bad),
                     lambda: kv.reset(stream=bad),
                     lambda: ring.write(c, rows, stream=bad)):
            with pytest.raises(TypeError, match="stream"):
                call()
            assert state() == before
    with pytest.raises(RuntimeError, match="begin_step"):
        kv.run(stream=s)
    p.close()
