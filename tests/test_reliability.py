"""Misuse that used to pass silently (issue 10): stale plans, rings closed or
rewritten between plan and run, ring switching, reader bookkeeping, capacity
bounds, non-finite ring rows, backend instances, bf16 noise."""
import ml_dtypes
import numpy as np
import pytest

from dflash_cupy import backends
from dflash_cupy.emu.backend import EmulatedBackend
from dflash_cupy.config import DraftConfig
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import MAX_CAPACITY, DraftKvCache
from dflash_cupy.weights import DraftWeights

CFG = DraftConfig(n_layer=1, hidden_size=32, n_head=2, n_head_kv=1, head_dim=32, intermediate_size=48,
                  block_size=4, target_layer_ids=(0, 1), rms_norm_eps=1e-6, rope_theta=10000.0)
W = DraftWeights.random(CFG, seed=21, dtype="bf16")
FEATS = np.random.default_rng(22).standard_normal((120, CFG.fc_in)).astype(np.float32)
NOISE = np.random.default_rng(23).standard_normal((CFG.q_len, CFG.hidden_size)).astype(np.float32)


def _ring(be, cap=32, upto=0):
    r = FeatureRing(cap, CFG.n_captured, CFG.hidden_size, backend=be)
    if upto:
        r.write(max(0, upto - cap), FEATS[max(0, upto - cap):upto])
    return r


def test_run_refuses_a_plan_the_ring_no_longer_backs(emu):
    ring = _ring(emu, upto=22)
    with DraftKvCache(W, 24, backend=emu) as kv:
        kv.step(ring, 18, NOISE)
        kv.begin_step(ring, 22)                 # plans to append positions [18, 22) in the graph
        ring.write(40, FEATS[40:44])            # a write far ahead: the ring now holds [40, 44)
        with pytest.raises(RuntimeError, match=r"no longer holds positions \[18, 22\)"):
            kv.run()
        assert kv.next_pos == 18                # nothing appended
        ring.write(0, FEATS[:22])
        kv.begin_step(ring, 22)                 # a fresh plan runs
        kv.set_noise_embed(NOISE)
        kv.run()
        assert kv.next_pos == 22
        kv.begin_step(ring, 22)
        ring.close()
        with pytest.raises(RuntimeError, match="ring this step was planned on has been closed"):
            kv.run()


def test_run_consumes_its_plan(emu):
    ring = _ring(emu, upto=10)
    with DraftKvCache(W, 24, backend=emu) as kv:
        kv.step(ring, 10, NOISE)
        with pytest.raises(RuntimeError, match="needs a planned step"):
            kv.run()


def test_switching_rings_does_not_recapture(emu):
    a, b = _ring(emu, cap=128, upto=100), _ring(emu, cap=128, upto=100)
    with DraftKvCache(W, 24, backend=emu) as kv:
        c = 40
        for i in range(12):                     # a a b b a a b b ...: both slots on both rings
            kv.step(a if (i // 2) % 2 == 0 else b, c, NOISE)
            c += 1 + (i % 3)
        assert kv.captures == 4                 # two graphs per ring, then only replays (5 switches)


def test_ring_forgets_closed_readers(emu):
    ring = _ring(emu, upto=10)
    for _ in range(12):
        with DraftKvCache(W, 16, backend=emu) as kv:
            kv.step(ring, 10, NOISE)
    ring.write(10, FEATS[10:12])
    assert len(ring._readers) == 0


def test_capacity_upper_bound(emu):
    with pytest.raises(ValueError, match=f"exceeds {MAX_CAPACITY}"):
        DraftKvCache(W, MAX_CAPACITY + 1, backend=emu)


def test_non_finite_rows_are_refused_unless_asked(emu):
    ring = FeatureRing(8, CFG.n_captured, CFG.hidden_size, dtype=np.float16, backend=emu)
    rows = FEATS[:3].copy()
    ring.write(0, rows)
    for val, what in ((np.nan, "not finite"), (np.inf, "not finite"), (7e4, "overflows f16")):
        bad = rows.copy()
        bad[1, 5] = val
        with pytest.raises(ValueError, match=rf"rows\[1, 5\] = .* {what}"):
            ring.write(3, bad)
        assert (ring.lo, ring.hi) == (0, 3)     # refused: nothing written
    bad = rows.copy()
    bad[0, 0] = 7e4
    ring.write(3, bad, check_finite=False)      # stored as it converts: inf in f16
    assert np.isinf(ring.read(3, 1)[0, 0].astype(np.float32))


def test_backend_instances_are_named(emu):
    other = EmulatedBackend()
    ring = FeatureRing(8, CFG.n_captured, CFG.hidden_size, backend=other)
    ring.write(0, FEATS[:4])
    with DraftKvCache(W, 8, backend=emu) as kv:
        with pytest.raises(ValueError, match="another instance of backend 'emulated'"):
            kv.begin_step(ring, 4)


def test_bf16_noise_is_accepted_like_the_ring(emu):
    ring = _ring(emu, upto=9)
    nb = NOISE.astype(ml_dtypes.bfloat16)
    with DraftKvCache(W, 16, backend=emu) as kv:
        h1 = emu.to_numpy(kv.step(ring, 9, nb)).copy()
        kv.reset()
        h2 = emu.to_numpy(kv.step(ring, 9, nb.astype(np.float32)))
    np.testing.assert_array_equal(h1, h2)
