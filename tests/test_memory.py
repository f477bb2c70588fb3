"""Device memory accounting: the backend's allocation ledger, ``memory()`` of live caches, and
``bytes_for`` (sizing before allocating) against what a real allocation holds."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from dflash_cupy import backends
from dflash_cupy.config import DraftConfig
from dflash_cupy.geometry import RingGeometry
from dflash_cupy.kv_batch import DraftKvBatch
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.kv_pages import DEFAULT_PAGE, lane_pages
from dflash_cupy.memory_plan import GIB, bytes_for, weight_bytes
from tests.support.drafters import SPECS, built


def test_ledger_counts_each_allocation_once_on_its_thread(emu):
    with emu.ledger() as led:
        emu.zeros((10, 4), np.float32)           # zeros -> empty inside: counted once
        emu.asarray(np.ones(3))                  # f64
        emu.pinned_empty((5,), np.int32)
        with emu.ledger() as inner:
            emu.empty((2,), np.int16)
        other = threading.Thread(target=lambda: emu.zeros((1000,), np.float32))
        other.start()
        other.join()                             # another thread's allocation is not ours
    emu.zeros((7,), np.float32)                  # after the block: not counted
    assert (led.device, led.pinned, inner.device, inner.pinned) == (160 + 24 + 4, 20, 4, 0)


@pytest.mark.parametrize("name,lanes,capacity,slack,ring", [("a", 3, 33, 0, 38), ("g", 2, 19, 5, 3)])
def test_batch_memory_matches_bytes_for(emu, name, lanes, capacity, slack, ring):
    """A real allocation's K/V, feature-ring, mask and weight pools equal ``bytes_for``'s to
    the byte; the step's own buffers are counted by ``memory()`` and estimated by ``bytes_for``
    (reported: the GEMMs' split-K workspaces follow the device)."""
    sp = SPECS[name]
    w, lm = built(name)[:2]
    with DraftKvBatch(w, capacity, lanes, ring_capacity=ring, ring_dtype=sp.ring_dtype, lm_head=lm,
                      rewind_slack=slack, backend=emu) as b:
        got = b.memory()
    want = bytes_for(sp.config, lanes, capacity, rewind_slack=slack, ring_capacity=ring, ring_dtype=sp.ring_dtype,
                     weight_dtype=sp.wdtype, vocab=0 if lm is None else lm.shape[0], lm_head_dtype=sp.lm_dtype)
    for pool in ("kv", "feature_rings", "masks", "weights"):
        assert got.pools[pool] == want.pools[pool], pool
    g = RingGeometry(capacity, sp.config.block_size, slack)
    worst = lane_pages(g.slots, g.slots, g.q_len, DEFAULT_PAGE)   # a lane's pages at a full ring
    assert got.pools["kv"] == 2 * sp.config.n_layer * (lanes * worst + 1) * DEFAULT_PAGE * sp.config.kv_dim * 2
    assert (got.page_size, got.pages_used, got.pages_free, got.lane_pages) == (DEFAULT_PAGE, 0, lanes * worst,
                                                                              (0,) * lanes)
    assert got.pools["feature_rings"] == lanes * ring * sp.config.fc_in * np.dtype(sp.ring_dtype).itemsize
    assert got.pools["step"] > 0
    assert got.total == sum(got.pools[p] for p in ("kv", "feature_rings", "masks", "step"))
    print(f"\n{name}: step buffers counted {got.pools['step']} B, estimated {want.pools['step']} B")


def test_cache_memory_counts_a_callers_lm_head_as_weights_only(emu):
    """A device LM head the caller owns is not the cache's allocation; a NumPy one is copied
    (and still reported under weights, shared data, not under the cache's own pools)."""
    w, lm = built("a")[:2]
    dev_lm = emu.asarray(lm)
    with DraftKvCache(w, 23, lm_head=dev_lm, backend=emu) as kv_dev, \
            DraftKvCache(w, 23, lm_head=lm, backend=emu) as kv_host:
        a, b = kv_dev.memory(), kv_host.memory()
    assert a.pools == b.pools
    assert a.pools["feature_rings"] == 0          # a single cache reads the caller's ring
    assert a.pools["weights"] == w.device(emu).nbytes + lm.nbytes
    with pytest.raises(RuntimeError, match="closed"):
        kv_dev.memory()


def test_weight_bytes_equal_the_placed_weights(emu):
    for name in ("a", "b", "g", "h"):
        sp = SPECS[name]
        w = built(name)[0]
        assert weight_bytes(sp.config, sp.wdtype) == w.device(emu).nbytes, name


def test_bytes_for_serving_scale():
    """64 lanes at a 32K window of the hidden-4096 drafter (5 captured layers, 8 kv heads x
    128), rewind slack 64, f16 feature rings of 1024 rows: the pools by hand. Reported."""
    cfg = DraftConfig(n_layer=5, hidden_size=4096, n_head=32, n_head_kv=8, head_dim=128, intermediate_size=12288,
                      block_size=16, target_layer_ids=(1, 9, 17, 25, 33), rms_norm_eps=1e-6,
                      rope_theta=1_000_000.0)
    r = bytes_for(cfg, 64, 32768, rewind_slack=64, ring_capacity=1024, ring_dtype=np.float16,
                  weight_dtype=np.float16)
    # per lane: 513 pages of 64 rows under the 32832 ring slots, one more for the noise scratch
    # and the trash slot; one shared page per pool
    assert lane_pages(32832, 32832, 16, 64) == 514
    assert r.pools["kv"] == 2 * 5 * (64 * 514 + 1) * 64 * 1024 * 2
    assert r.pools["feature_rings"] == 64 * 1024 * 5 * 4096 * 2
    print(f"\nh4096, 64 lanes x 32K window, ring 1024 (f16):\n{r.table()}")
    assert r.total / GIB == pytest.approx(sum(r.pools[p] for p in ("kv", "feature_rings", "masks", "step")) / GIB)


@pytest.mark.parametrize("kw,match", [(dict(lanes=0), "lanes"), (dict(window=0), "window"),
                                      (dict(rewind_slack=-1), "rewind_slack"), (dict(ring_capacity=0), "ring_capacity"),
                                      (dict(kv_pages=0), "kv_pages"), (dict(page_size=48), "page_size"),
                                      (dict(ring_dtype=np.int8), "ring_dtype"),
                                      (dict(weight_dtype=np.int32), "weight_dtype")])
def test_bytes_for_refuses_bad_arguments(kw, match):
    args = dict(lanes=2, window=64)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        bytes_for(SPECS["a"].config, args.pop("lanes"), args.pop("window"), **args)


def test_memory_follows_the_pages_lanes_hold(emu):
    """A pool smaller than the worst case: ``bytes_for`` and ``memory()`` agree on it; the pages
    in use follow what each lane holds (a prefill takes them, a reset gives them back)."""
    sp = SPECS["a"]
    w = built("a")[0]
    cfg, lanes, capacity, page = sp.config, 3, 200, 32
    g = RingGeometry(capacity, cfg.block_size)
    with DraftKvBatch(w, capacity, lanes, page_size=page, kv_pages=9, backend=emu) as b:
        want = bytes_for(cfg, lanes, capacity, page_size=page, kv_pages=9, weight_dtype=sp.wdtype)
        assert b.memory().pools["kv"] == want.pools["kv"] == 2 * cfg.n_layer * 10 * page * cfg.kv_dim * 2
        assert b.memory().pools["masks"] == want.pools["masks"]
        rows = np.random.default_rng(3).standard_normal((70, cfg.fc_in)).astype(np.float32)
        b.prefill(1, rows)
        m = b.memory()
        held = lane_pages(70, g.slots, g.q_len, page)
        assert (m.pages_used, m.pages_free, m.lane_pages) == (held, 9 - held, (0, held, 0))
        b.reset(1)
        assert b.memory().pages_used == 0


def test_serving_scale_configuration_allocated_matches_bytes_for(emu):
    """The serving-scale configuration (64 lanes, 32K windows, rewind slack 64, f16 feature
    rings of 1024 rows, 5 captured layers, 16-row blocks) at a scaled-down hidden size (32,
    one layer, one kv head of 32) allocated for real on the emulator: its pools equal
    ``bytes_for``'s to the byte."""
    cfg = DraftConfig(n_layer=1, hidden_size=32, n_head=1, n_head_kv=1, head_dim=32, intermediate_size=48,
                      block_size=16, target_layer_ids=(1, 9, 17, 25, 33), rms_norm_eps=1e-6, rope_theta=1e6)
    from dflash_cupy.weights import DraftWeights
    w = DraftWeights.random(cfg, seed=5, dtype=np.float16)
    kw = dict(rewind_slack=64, ring_capacity=1024, ring_dtype=np.float16)
    with DraftKvBatch(w, 32768, 64, backend=emu, **kw) as b:
        got = b.memory()
    want = bytes_for(cfg, 64, 32768, weight_dtype=np.float16, **kw)
    for pool in ("kv", "feature_rings", "masks", "weights"):
        assert got.pools[pool] == want.pools[pool], pool
    assert got.pages_free == want.pages_free == 64 * lane_pages(32832, 32832, 16, DEFAULT_PAGE)
    print(f"\nscaled-down serving configuration, allocated:\n{got.table()}")
