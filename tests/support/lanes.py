"""Lanes of a ``DraftKvBatch`` each mirrored by a twin single cache (``Twin``: a
``Driver`` whose ring writes and resets go to its lane too); ``play`` steps the
batch and checks every active lane against its twin bit for bit."""
from __future__ import annotations

import numpy as np

from dflash_cupy import backends
from dflash_cupy.kv_batch import DraftKvBatch
from dflash_cupy.ops.step_descriptor import DESC_ACTIVE
from tests.support.drafters import SPECS, Driver, built

IDLE = None


class Twin(Driver):
    """A single-lane Driver whose ring writes and resets are mirrored into one lane of a batch."""

    def __init__(self, be, name, batch, lane, seed):
        super().__init__(be, name, seed=seed, x_split=batch.x_split)
        self.batch, self.lane = batch, lane

    def feed(self, c):
        lo = c - min(c, self.cap)
        good = min(self.ring.hi, self.valid_hi)
        s = good if self.ring.lo <= lo <= good else lo
        if s < c:
            self.batch.rings[self.lane].write(s, self.features(s, c))
        super().feed(c)

    def reset(self):
        super().reset()
        self.batch.reset(self.lane)
        self.batch.rings[self.lane].reset()


def make(name, lanes, be=None, **kw):
    be = be or backends.get("emulated")
    s = SPECS[name]
    w, lm = built(name)
    batch = DraftKvBatch(w, s.capacity, lanes, ring_capacity=s.ring_capacity, ring_dtype=s.ring_dtype,
                         lm_head=lm, backend=be, bulk_chunk=s.bulk_chunk, **kw)
    twins = [Twin(be, name, batch, i, seed=100 + i) for i in range(lanes)]
    return be, batch, twins


def play(be, batch, twins, ops, eager=False):
    """``ops[i]``: lane i's op this step: an int (committed), IDLE, ("rewind", c)
    (features from c on change, then step at c) or ("reset", c)."""
    c_all = []
    noise = np.zeros((batch.lanes, batch.q_len, batch.config.hidden_size), np.float32)
    for i, op in enumerate(ops):
        t = twins[i]
        if op is IDLE:
            c_all.append(None)
            continue
        if isinstance(op, tuple):
            kind, c = op
            if kind == "rewind":
                t.forget_from(c)
            else:
                t.reset()
        else:
            c = op
        noise[i] = t.step(c)   # the twin's own step, checked against the oracle
        c_all.append(c)
    if eager:
        batch.begin_step(c_all)
        batch.set_noise_embed(noise)
        out = batch.run(eager=True)
    else:
        out = batch.step(c_all, noise)
    assert out is batch.hidden_states
    hs = be.to_numpy(batch.hidden_states)
    toks = None if batch.draft_tokens is None else be.to_numpy(batch.draft_tokens)
    logits = None if batch.logits is None else be.to_numpy(batch.logits)
    desc = be.to_numpy(batch.desc)
    for i, c in enumerate(c_all):
        assert (desc[i, DESC_ACTIVE] != 0) == (c is not None)
        if c is None:
            continue
        t = twins[i]
        what = f"lane {i}, committed={c}"
        assert batch.next_pos[i] == c, what
        assert np.array_equal(hs[i], be.to_numpy(t.kv.hidden_states)), what + " hidden_states"
        assert np.array_equal(be.to_numpy(batch.slot_pos)[i], be.to_numpy(t.kv.slot_pos)), what + " slot_pos"
        for m_b, m_s in ((batch.mask_full, t.kv.mask_full), (batch.mask_swa, t.kv.mask_swa)):
            if m_b is not None:
                assert np.array_equal(be.to_numpy(m_b)[i].view(np.uint16),
                                      be.to_numpy(m_s).view(np.uint16)), what + " mask"
        if toks is not None:
            assert np.array_equal(toks[i], be.to_numpy(t.kv.draft_tokens)), what + " draft_tokens"
        if logits is not None:
            assert np.array_equal(logits[i], be.to_numpy(t.kv.logits)), what + " logits"
    return c_all
