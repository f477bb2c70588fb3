"""Independent caches on independent threads never interfere (the threading
contract: one cache is used from one thread at a time): capture state is per
thread, so one thread capturing a new cache's graphs while others step is
fine. Forced switching (sys.setswitchinterval) interleaves them densely."""
import sys
import threading

import numpy as np

from dflash_cupy.config import DraftConfig
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.weights import DraftWeights

CFG = DraftConfig(n_layer=1, hidden_size=32, n_head=2, n_head_kv=1, head_dim=32, intermediate_size=48,
                  block_size=4, target_layer_ids=(0, 1), rms_norm_eps=1e-6, rope_theta=10000.0)
W = DraftWeights.random(CFG, seed=31, dtype="bf16")
FEATS = np.random.default_rng(32).standard_normal((200, CFG.fc_in)).astype(np.float32)


def _run(be, seed, steps, fresh_caches=False):
    """hidden states of a small schedule; ``fresh_caches``: a new cache (a new capture) every step."""
    rng = np.random.default_rng(seed)
    ring = FeatureRing(64, CFG.n_captured, CFG.hidden_size, backend=be)
    s = be.stream()
    out = []
    kv = None
    with s:
        c = 5 + seed
        ring.write(0, FEATS[:c])
        for _ in range(steps):
            if kv is None or fresh_caches:
                if kv is not None:
                    kv.close()
                kv = DraftKvCache(W, 24, backend=be)
                kv.step(ring, c, np.zeros((4, 32), np.float32))  # the same prefix state each time
            noise = rng.standard_normal((4, 32)).astype(np.float32)
            out.append(be.to_numpy(kv.step(ring, c, noise)).copy())
            ring.write(c, FEATS[c:c + 2])
            c += 2
            if fresh_caches:
                kv.reset()
    kv.close()
    return out


def test_threads_do_not_interfere(emu):
    expect = {i: _run(emu, i, 4, fresh_caches=(i == 0)) for i in range(4)}
    got, errors = {}, []

    def worker(i):
        try:
            got[i] = _run(emu, i, 4, fresh_caches=(i == 0))
        except Exception as e:  # reported below with the thread's number
            errors.append((i, repr(e)))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    for i in range(4):
        for a, b in zip(got[i], expect[i]):
            np.testing.assert_array_equal(a, b)
