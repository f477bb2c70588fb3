"""ring_attn_split (cuda_src/attention.cu) and ring_attn_mma_split
(cuda_src/attention_mma.cu): masked split-KV GQA attention of the noise rows
over the whole ring cache, the splits merged by ring_attn_combine (merge
"launch") or in the same launch by the last block of each unit to finish
(merge "fold"), bit-identical to each other; both split kernels where they
apply; the tuning interface (every candidate configuration correct). Hidden
slots of every kind, planted with NaN/Inf, leave the output bit-identical."""
import numpy as np
import pytest

from dflash_cupy.geometry import RingGeometry
from dflash_cupy.ops.attention import (RingAttention, default_merge, default_splits, ring_attention_reference,
                                       split_candidates)
from dflash_cupy.reference import contiguous_slot_pos, ring_masks
from tests.support.tolerances import assert_close

NEG_INF = np.float16(-np.inf)


def make_inputs(rng, B, NH, NKV, D, kv_total, q_scale=2.0):
    q = (rng.standard_normal((B, NH, D)) * q_scale).astype(np.float32)
    k = rng.standard_normal((kv_total, NKV * D)).astype(np.float16)
    v = rng.standard_normal((kv_total, NKV * D)).astype(np.float16)
    return q, k, v


def run(be, att, q, k, v, mask, gate=None, q_flat=False):
    out = be.asarray(np.full((att.B, att.NH * att.D), np.nan, np.float32))
    qd = be.asarray(q.reshape(att.B, -1) if q_flat else q)
    att(qd, be.asarray(k), be.asarray(v), be.asarray(mask), out,
        gate=None if gate is None else be.asarray(gate))
    return be.to_numpy(out)


# (D, NH, NKV, B, kv_total, n_splits, gate): GQA ratios 1/2/4, D 32/64/128/256,
# B 1/3/4/16, awkward kv_total, splits 1..5, gate none/head/element
CONFIGS = [
    (32, 4, 4, 1, 37, 1, None),
    (64, 8, 4, 4, 100, 3, "head"),
    (128, 8, 2, 16, 160, 2, "element"),
    (64, 4, 1, 16, 33, 2, None),
    (128, 4, 4, 4, 97, 4, "head"),
    (32, 2, 1, 3, 19, 1, "element"),
    (256, 4, 1, 16, 70, 3, None),       # 64 query rows > 16 that fit shared memory: row groups
    (64, 2, 2, 16, 200, 5, None),
]


def paths(D):
    return ("fma", "mma") if D % 16 == 0 and D <= 128 else ("fma",)


@pytest.mark.parametrize("D,NH,NKV,B,kv_total,n_splits,gate,path",
                         [c + (p,) for c in CONFIGS for p in paths(c[0])])
def test_random_masks(backend, rng, D, NH, NKV, B, kv_total, n_splits, gate, path):
    att = RingAttention(backend, D, NH, NKV, B, kv_total, n_splits=n_splits, gate=gate, path=path)
    assert att.path == path
    q, k, v = make_inputs(rng, B, NH, NKV, D, kv_total)
    mask = np.where(rng.random((B, kv_total)) < 0.4, np.float16(0), NEG_INF).astype(np.float16)
    mask[:, rng.integers(kv_total)] = 0                  # every row sees something...
    if B > 2:
        mask[1] = NEG_INF                                # ...except row 1: all hidden -> 0
        mask[2] = NEG_INF
        mask[2, kv_total - 1] = 0                        # one key, in the last (partial) tile
    g = None
    if gate == "head":
        g = (rng.standard_normal((B, NH)) * 3).astype(np.float32)
    elif gate == "element":
        g = (rng.standard_normal((B, NH * D)) * 3).astype(np.float32)
        g.flat[:3] = [25.0, -30.0, 0.0]                  # softplus's linear and tiny ends
    got = run(backend, att, q, k, v, mask, g, q_flat=(D == 64))
    ref = ring_attention_reference(q, k, v, mask, n_head_kv=NKV, gate=g, gate_mode=gate)
    assert np.isfinite(got).all()
    assert_close(got, ref, "f32", f"attention {att}")
    if B > 2:
        assert (got[1] == 0).all(), "row with every key hidden must be exactly 0"


@pytest.mark.parametrize("capacity,q_len,committed,swa", [(45, 4, 100, 10), (20, 16, 37, 5),
                                                          (3, 8, 1000003, 2), (50, 4, 2**20 + 9, 0)])
def test_ring_masks(backend, rng, capacity, q_len, committed, swa):
    """Ring-ordered slots with wraparound: masks from the oracle, trash and
    padding rows holding large finite junk that must stay invisible."""
    geom = RingGeometry(capacity, q_len)
    D, NH, NKV = 64, 4, 2
    q, k, v = make_inputs(rng, q_len, NH, NKV, D, geom.kv_total)
    k[geom.trash_slot:] = 300.0
    v[geom.trash_slot:] = -500.0
    slot_pos = contiguous_slot_pos(committed, capacity)
    mfull, mswa = ring_masks(slot_pos, committed, geom, swa)
    for path in paths(D):
        att = RingAttention(backend, D, NH, NKV, q_len, geom.kv_total,
                            n_splits=min(2, geom.kv_total // 32), path=path)
        for name, mask in (("full", mfull), ("swa", mswa)):
            got = run(backend, att, q, k, v, mask)
            ref = ring_attention_reference(q, k, v, mask, n_head_kv=NKV)
            assert_close(got, ref, "f32", f"{name} mask, {path}")


def test_split_count_invariance(backend, rng):
    """1, 2, 3 and 7 splits (some of them entirely hidden) agree."""
    D, NH, NKV, B, kv_total = 32, 4, 2, 4, 224
    q, k, v = make_inputs(rng, B, NH, NKV, D, kv_total)
    mask = np.full((B, kv_total), NEG_INF, np.float16)
    mask[:, 3:40] = 0                                     # only the first split sees anything
    mask[:, 150] = 0
    ref = ring_attention_reference(q, k, v, mask, n_head_kv=NKV)
    for path in paths(D):
        outs = [run(backend, RingAttention(backend, D, NH, NKV, B, kv_total, n_splits=s, path=path),
                    q, k, v, mask) for s in (1, 2, 3, 7)]
        for s, o in zip((1, 2, 3, 7), outs):
            assert_close(o, ref, "f32", f"n_splits={s}, {path}")


# Shapes of CONFIGS (test_random_masks): the same compiled variants, one split and three.
@pytest.mark.parametrize("D,NH,NKV,B,kv_total,n_splits,gate", [CONFIGS[5][:7], CONFIGS[1][:7]])
def test_all_hidden_is_zero(backend, rng, D, NH, NKV, B, kv_total, n_splits, gate):
    q, k, v = make_inputs(rng, B, NH, NKV, D, kv_total)
    mask = np.full((B, kv_total), NEG_INF, np.float16)
    g = rng.standard_normal((B, NH) if gate == "head" else (B, NH * D)).astype(np.float32)
    for path in paths(D):
        att = RingAttention(backend, D, NH, NKV, B, kv_total, n_splits=n_splits, gate=gate, path=path)
        got = run(backend, att, q, k, v, mask, g)
        assert (got == 0).all(), path


def test_default_splits_and_sizes():
    assert default_splits(8, 2080, 132) == 16         # 65 tiles, >= 4 tiles per split: 128 blocks
    assert default_splits(8, 8192 + 32, 132) == 33    # 2 blocks per SM on 132 SMs
    assert default_splits(8, 8192 + 32, sm_count=78) == 20
    assert default_splits(8, 64, 132) == 1
    assert default_splits(1, 100000, 132) == 264
    assert default_splits(4, 100000, 132, row_groups=2) == 33



def test_default_splits_count_the_lanes():
    """Every lane's kv heads (and row groups) are units of n_splits blocks: a
    batch fills the SMs with fewer splits per lane as its lanes grow, never
    more than one lane gets, never fewer than n_tiles // BATCH_TILES_PER_SPLIT
    (a batch with few live lanes keeps short latency paths); lanes=1 is the
    single-request rule (test_default_splits_and_sizes)."""
    from dflash_cupy.ops.attention import BATCH_TILES_PER_SPLIT
    assert BATCH_TILES_PER_SPLIT == 16
    # qwen3-8b's attention (8 kv heads) at 2K (65 tiles), H200's 132 SMs
    got = {L: default_splits(8, 2080, 132, lanes=L) for L in (1, 2, 3, 4, 8, 16, 64, 256)}
    assert got == {1: 16, 2: 16, 3: 11, 4: 8, 8: 4, 16: 4, 64: 4, 256: 4}
    assert got[16] < got[1] and got[4] * 4 * 8 <= 2 * 132    # 4 lanes: one wave of 2 blocks per SM
    # 8K (257 tiles): the floor keeps 16; 32K (1025): the one-lane count, 33, whatever the lanes
    assert [default_splits(8, 8224, 132, lanes=L) for L in (1, 2, 4, 16, 64)] == [33, 17, 16, 16, 16]
    assert {default_splits(8, 32800, 132, lanes=L) for L in (1, 4, 16, 256)} == {33}
    # a short window (10 tiles, floor 0): the fill alone, down to one split (nothing to merge)
    assert [default_splits(8, 300, 132, lanes=L) for L in (1, 16, 22, 23, 64)] == [2, 2, 2, 1, 1]
    # row groups count like kv heads (the CUDA-core kernel's grid z)
    assert default_splits(4, 100000, 132, row_groups=2, lanes=4) == 33    # floor 3125 // 16: capped at one lane's
    assert default_splits(4, 4000, 132, row_groups=2, lanes=4) == 8       # 264 / 32 = 8.25
    assert default_splits(4, 4000, 132, row_groups=1, lanes=4) == 17      # 264 / 16 = 16.5: halves up
    for kvt in (100, 2080, 8224, 50_000):
        seq = [default_splits(8, kvt, 132, lanes=L) for L in range(1, 80)]
        assert all(a >= b >= 1 for a, b in zip(seq, seq[1:])), kvt       # never more as lanes grow


def test_batch_default_config_and_candidates():
    """What a batch's RingAttention picks by default (the merge folds from
    FOLD_FROM_LANES lanes on, nothing to merge at one split), and the tuner's
    candidates around it: the fill counts of every lane's units among them."""
    from dflash_cupy.ops.attention import FOLD_FROM_LANES
    assert FOLD_FROM_LANES == 4
    assert default_merge(2080, 8, lanes=4) == "fold" and default_merge(2080, 16, lanes=3) == "launch"
    assert default_merge(2080, 16) == "launch" and default_merge(2080, 1, lanes=64) is None
    be = _recording()
    cfg = {L: RingAttention(be, 128, 32, 8, 16, 2080, lanes=L, lane_rows=16).config() for L in (1, 2, 4, 16, 64)}
    assert cfg == {1: (16, "launch"), 2: (16, "launch"), 4: (8, "fold"), 16: (4, "fold"), 64: (4, "fold")}
    one = RingAttention(be, 128, 32, 8, 16, 300, lanes=32)
    assert one.config() == (1, None) and one.part_o is None and one.counters is None
    fma = RingAttention(be, 256, 4, 2, 9, 4000, lanes=4, path="fma")
    assert fma.row_groups == 2 and fma.config() == (17, "fold") and fma._grid == (8, 17, 2)   # 264 / 16 units
    assert tuple(fma.counters.shape) == (4 * 2 * 2,)
    for L, kvt in ((16, 2080), (64, 2080), (4, 8224), (32, 300)):
        att = RingAttention(be, 128, 32, 8, 16, kvt, lanes=L)
        cands = att.launch_candidates()
        splits = split_candidates(8, kvt, 132, lanes=L)
        assert att.default_config() in cands and cands[0] == (1, None) and len(cands) <= 12
        assert splits == sorted(splits) and splits[-1] <= -(-kvt // 32)
        fill = -(-264 // (8 * L))                             # two blocks per SM over every lane's units
        assert fill == 1 or fill in splits, (L, kvt, splits)
    assert split_candidates(8, 2080, 132, lanes=16) == [1, 2, 3, 4, 6, 8]
    assert split_candidates(8, 2080, 132, lanes=1) == split_candidates(8, 2080, 132)

def test_bad_arguments_raise(emu):
    be = emu
    D, NH, NKV, B, kvt = 32, 4, 2, 3, 100     # a LANE_CASES single-lane twin's variant
    att = RingAttention(be, D, NH, NKV, B, kvt, n_splits=3, gate="head")
    args = dict(q=be.zeros((B, NH, D), np.float32), k_cache=be.zeros((kvt, NKV * D), np.float16),
                v_cache=be.zeros((kvt, NKV * D), np.float16), mask=be.zeros((B, kvt), np.float16),
                out=be.zeros((B, NH * D), np.float32), gate=be.zeros((B, NH), np.float32))
    att(**args)
    bad = [("q", be.zeros((B, NH, D + 1), np.float32), ValueError),
           ("k_cache", be.zeros((kvt, NKV * D), np.float32), TypeError),
           ("v_cache", be.zeros((kvt + 1, NKV * D), np.float16), ValueError),
           ("mask", be.zeros((B, kvt), np.float32), TypeError),
           ("out", be.zeros((B, NH, D), np.float32), ValueError),
           ("gate", be.zeros((B, NH * D), np.float32), ValueError)]
    for name, val, exc in bad:
        with pytest.raises(exc, match=name):
            att(**{**args, name: val})
    with pytest.raises(ValueError, match="gate"):
        att(**{**args, "gate": None})
    with pytest.raises(ValueError, match="n_head"):
        RingAttention(be, D, 6, 4, B, kvt)
    with pytest.raises(ValueError, match="head_dim"):
        RingAttention(be, 36, 4, 4, B, kvt)
    with pytest.raises(ValueError, match="n_splits"):
        RingAttention(be, D, NH, NKV, B, kvt, n_splits=5)   # only 4 tiles


# ---------------------------------------------------------------------------- isolation
# Every kind of slot a mask hides, planted with NaN, +-Inf and f16's largest
# finite values, must leave the output exactly as if the slot held zeros.
PLANTS = (np.nan, np.inf, -np.inf, 65504.0, -65504.0)

# (D, NH, NKV, q_len, paths): GQA 1, 2, 4, 8; head_dim 64/128 on both kernels, 40 on the CUDA cores
ISO_CONFIGS = [(64, 4, 4, 3, ("fma", "mma")), (128, 8, 4, 16, ("fma", "mma")),
               (64, 8, 2, 4, ("fma", "mma")), (128, 16, 2, 3, ("fma", "mma")), (40, 4, 2, 5, ("fma",))]


def _bits_equal(a, b):
    return np.array_equal(np.ascontiguousarray(a).view(np.uint32), np.ascontiguousarray(b).view(np.uint32))


def _stale_ring(capacity, q_len):
    """A ring after a long run, a rewind and a partial reset: slots holding
    positions past the rewound ``committed`` (stale), slots overwritten by
    newer positions (evicted, past the window), slots never written (empty)."""
    geom = RingGeometry(capacity, q_len)
    before = capacity + capacity // 2 + 7          # wrapped once and a half
    committed = before - capacity // 3             # rewound: the newest third is stale
    slot_pos = contiguous_slot_pos(before, capacity)
    slot_pos[[1, capacity // 2, capacity - 2]] = -1  # empty after a partial reset
    return geom, committed, slot_pos


def _plant(rng, a, rows, col_lo, col_hi):
    """Fill ``a[rows, col_lo:col_hi]`` with the plants, every kind in every row."""
    vals = np.array(PLANTS, np.float32)
    for r in np.atleast_1d(rows):
        a[r, col_lo:col_hi] = vals[rng.permutation(np.arange(col_hi - col_lo) % len(vals))].astype(np.float16)


@pytest.mark.parametrize("D,NH,NKV,q_len,pths", ISO_CONFIGS)
def test_hidden_slots_never_reach_the_output(backend, rng, D, NH, NKV, q_len, pths):
    """Empty, stale (past a rewind), evicted and out-of-window ring slots, the
    trash slot and the padding rows, all hidden from every row: planted with
    NaN/Inf/65504 in K and V the output equals, bit for bit, the output with
    those rows zeroed; for both masks (full, sliding window), both kernels,
    one and three splits. The sliding mask's causal noise slots: slot j planted,
    the rows before j are bit-identical, the rows that see it turn NaN."""
    geom, committed, slot_pos = _stale_ring(97, q_len)
    kvt = geom.kv_total
    q, k, v = make_inputs(rng, q_len, NH, NKV, D, kvt)
    masks = ring_masks(slot_pos, committed, geom, 20)
    for path in pths:
        for splits in (1, 3):
            att = RingAttention(backend, D, NH, NKV, q_len, kvt, n_splits=splits, path=path)
            for name, mask in zip(("full", "swa"), masks):
                hidden = np.flatnonzero(np.isneginf(mask.astype(np.float32)).all(axis=0))
                assert geom.trash_slot in hidden and (slot_pos[hidden[hidden < 97]] != -1).any()
                kz, vz = k.copy(), v.copy()
                kz[hidden] = 0
                vz[hidden] = 0
                kp, vp = kz.copy(), vz.copy()
                for h in range(NKV):                       # every kv head, a different mix
                    _plant(rng, kp, hidden, h * D, (h + 1) * D)
                    _plant(rng, vp, hidden, h * D, (h + 1) * D)
                clean = run(backend, att, q, kz, vz, mask)
                dirty = run(backend, att, q, kp, vp, mask)
                assert np.isfinite(clean).all()
                assert _bits_equal(dirty, clean), f"{name} mask, {path}, {splits} splits: hidden slot leaked"
                ref = ring_attention_reference(q, kz, vz, mask, n_head_kv=NKV)
                assert_close(clean, ref, "f32", f"{name} mask, {path}")
            if q_len < 2:
                continue
            # causal noise slots of the sliding mask: slot cap + j is hidden from rows < j only
            mask = masks[1]
            j = q_len // 2 + 1 if q_len > 2 else 1
            slot = geom.capacity + j
            kz, vz = k.copy(), v.copy()
            kz[slot] = vz[slot] = 0
            kp, vp = kz.copy(), v.copy()             # K zeroed too: every row that sees it weighs it > 0
            vp[slot] = np.float16(np.nan)
            dirty = run(backend, att, q, kp, vp, mask)
            clean = run(backend, att, q, kz, vz, mask)
            assert _bits_equal(dirty[:j], clean[:j]), f"{path}: causal-hidden noise slot leaked"
            assert np.isnan(dirty[j:]).all(), f"{path}: a NaN the rows see must show"


# (D, NH, NKV, q_len, capacity, n_splits, path): q_len 1/3/16, GQA 1/2/4/8, head_dim 64/128
# on both kernels and 40/24 (not multiples of 16) on the CUDA cores; rings from 32 slots to
# a few thousand, wrapped (positions past the capacity), default and forced split counts
AWKWARD = [(64, 8, 8, 1, 32, 1, "mma"), (64, 8, 8, 1, 32, 2, "fma"),
           (128, 16, 2, 3, 1000, None, "mma"), (128, 16, 2, 3, 1000, 5, "fma"),
           (128, 32, 8, 16, 2048, None, "mma"), (64, 8, 4, 16, 300, 3, "fma"),
           (64, 8, 4, 3, 2600, None, "mma"), (40, 8, 4, 3, 500, 3, "fma"), (24, 8, 1, 1, 77, None, "fma")]


@pytest.mark.parametrize("D,NH,NKV,q_len,capacity,n_splits,path", AWKWARD)
def test_awkward_sizes_against_the_reference(backend, rng, D, NH, NKV, q_len, capacity, n_splits, path):
    geom = RingGeometry(capacity, q_len)
    committed = capacity + capacity // 3 + 5                  # wrapped
    slot_pos = contiguous_slot_pos(committed, capacity)
    q, k, v = make_inputs(rng, q_len, NH, NKV, D, geom.kv_total)
    att = RingAttention(backend, D, NH, NKV, q_len, geom.kv_total, n_splits=n_splits, path=path)
    assert att.path == path
    assert att.merge == (None if att.n_splits == 1 else "launch")     # the default rule at these sizes
    other = (RingAttention(backend, D, NH, NKV, q_len, geom.kv_total, n_splits=att.n_splits, path=path,
                           merge="fold") if att.n_splits > 1 else None)
    for name, mask in zip(("full", "swa"), ring_masks(slot_pos, committed, geom, capacity // 3)):
        got = run(backend, att, q, k, v, mask)
        ref = ring_attention_reference(q, k, v, mask, n_head_kv=NKV)
        assert_close(got, ref, "f32", f"{name} mask, {att}")
        if other is not None:
            assert _bits_equal(run(backend, other, q, k, v, mask), got), f"{name} mask: fold != launch"


@pytest.mark.parametrize("path,merge", [("fma", "launch"), ("mma", "launch"), ("fma", "fold"), ("mma", "fold")])
def test_repeats_are_bit_identical(backend, rng, path, merge):
    """Same inputs, same bits: across repeats (the emulator shuffles the thread
    order each run) and across a captured graph's replays."""
    D, NH, NKV, B = 64, 8, 2, 4
    kvt = _stale_ring(97, B)[0].kv_total       # an ISO_CONFIGS shape: its "launch" variants are shared
    q, k, v = make_inputs(rng, B, NH, NKV, D, kvt)
    mask = np.where(rng.random((B, kvt)) < 0.7, np.float16(0), NEG_INF).astype(np.float16)
    att = RingAttention(backend, D, NH, NKV, B, kvt, n_splits=3, path=path, merge=merge)
    first = run(backend, att, q, k, v, mask)
    for _ in range(2):
        assert _bits_equal(run(backend, att, q, k, v, mask), first)
    qd, kd, vd, md = (backend.asarray(a) for a in (q, k, v, mask))
    out = backend.asarray(np.full((B, NH * D), np.nan, np.float32))
    stream = backend.stream()
    backend.begin_capture(stream)
    att(qd, kd, vd, md, out, stream=stream)
    graph = backend.end_capture(stream)
    nan = backend.pinned_empty((B, NH * D), np.float32)
    nan[:] = np.nan
    for _ in range(2):
        backend.copy_h2d_async(out, nan, stream)          # a replay must write every element again
        stream.synchronize()
        graph.launch(stream)
        stream.synchronize()
        assert _bits_equal(backend.to_numpy(out), first)


# ---------------------------------------------------------------------------- lanes
# (D, NH, NKV, q_len, lane_rows, kv_total, n_splits, gate, path): one launch over
# lanes whose q/out rows sit lane_rows apart; D 256 on the CUDA cores has 2 row groups
# per lane (blockIdx.z = lane * row_groups + group).
LANE_CASES = [
    (32, 4, 2, 3, 16, 100, 1, None, "mma"),
    (32, 4, 2, 3, 16, 100, 3, "head", "mma"),
    (32, 4, 2, 3, 16, 100, 1, "element", "fma"),
    (32, 4, 2, 3, 16, 100, 3, None, "fma"),
    (256, 4, 2, 9, 9, 40, 2, "element", "fma"),
]


def _lane_inputs(rng, L, D, NH, NKV, B, BS, kvt, gate):
    q = np.full((L * BS, NH * D), np.nan, np.float32)       # rows past a lane's q_len: never read
    k = rng.standard_normal((L * kvt, NKV * D)).astype(np.float16)
    v = rng.standard_normal((L * kvt, NKV * D)).astype(np.float16)
    mask = np.where(rng.random((L, B, kvt)) < 0.5, np.float16(0), NEG_INF).astype(np.float16)
    gw = {None: 0, "head": NH, "element": NH * D}[gate]
    g = np.full((L * BS, gw), np.nan, np.float32) if gate else None
    for lane in range(L):
        q[lane * BS:lane * BS + B] = rng.standard_normal((B, NH * D)) * 2
        if gate:
            g[lane * BS:lane * BS + B] = rng.standard_normal((B, gw)) * 3
    mask[:, 0, :] = NEG_INF                                  # a row with nothing visible: 0
    return q, k, v, mask, g


@pytest.mark.parametrize("D,NH,NKV,B,BS,kvt,n_splits,gate,path", LANE_CASES)
def test_lanes_equal_single_lane_calls(backend, rng, D, NH, NKV, B, BS, kvt, n_splits, gate, path):
    """3 lanes in one launch, lane 1 idle by its descriptor: lanes 0 and 2 are bit for
    bit the single-lane RingAttention on their slices; the idle lane's rows and every
    row past a lane's q_len keep the sentinel. With live=None lane 1 runs too."""
    from dflash_cupy.ops.attention import DESC_LEN
    from dflash_cupy import kernels
    active = kernels.constants("step_desc.cuh")["DESC_ACTIVE"]
    L = 3
    att = RingAttention(backend, D, NH, NKV, B, kvt, n_splits=n_splits, gate=gate, path=path, lanes=L,
                        lane_rows=BS)
    one = RingAttention(backend, D, NH, NKV, B, kvt, n_splits=n_splits, gate=gate, path=path)
    assert att.path == one.path == path and att.n_splits == n_splits
    q, k, v, mask, g = _lane_inputs(rng, L, D, NH, NKV, B, BS, kvt, gate)
    desc = rng.integers(0, 1000, (L, DESC_LEN)).astype(np.int32)
    desc[:, active] = [1, 0, 7]
    sentinel = np.float32(7.5)
    out = backend.asarray(np.full((L * BS, NH * D), sentinel, np.float32))
    gd = None if g is None else backend.asarray(g)
    qd, kd, vd, md = (backend.asarray(a) for a in (q, k, v, mask))
    att(qd, kd, vd, md, out, gate=gd, live=backend.asarray(desc))
    got = backend.to_numpy(out)
    expect = np.full_like(got, sentinel)
    singles = {}
    for lane in range(L):
        r = slice(lane * BS, lane * BS + B)
        o1 = backend.asarray(np.full((B, NH * D), np.nan, np.float32))
        one(backend.asarray(q[r]), backend.asarray(k[lane * kvt:(lane + 1) * kvt]),
            backend.asarray(v[lane * kvt:(lane + 1) * kvt]), backend.asarray(mask[lane]), o1,
            gate=None if g is None else backend.asarray(g[r]))
        singles[lane] = backend.to_numpy(o1)
        ref = ring_attention_reference(q[r], k[lane * kvt:(lane + 1) * kvt], v[lane * kvt:(lane + 1) * kvt],
                                       mask[lane], n_head_kv=NKV, gate=None if g is None else g[r],
                                       gate_mode=gate)
        assert_close(singles[lane], ref, "f32", f"single lane {lane}")
        if lane != 1:
            expect[r] = singles[lane]
    np.testing.assert_array_equal(got.view(np.uint32), expect.view(np.uint32))
    assert (got[0:B] == 0).any() and (got[0] == 0).all()    # lane 0's row 0 sees nothing: exactly 0
    # every lane live (live=None): the idle lane's rows now filled, the others unchanged
    att(qd, kd, vd, md, out, gate=gd)
    got = backend.to_numpy(out)
    expect[BS:BS + B] = singles[1]
    np.testing.assert_array_equal(got.view(np.uint32), expect.view(np.uint32))


def test_one_lane_with_lane_rows_and_live(backend, rng):
    # lanes=1: q/out rows lane_rows apart changes nothing but the shapes; an idle lane
    # (live) leaves out untouched; 3-D mask [1, q_len, kv_total] accepted
    from dflash_cupy.ops.attention import DESC_LEN
    from dflash_cupy import kernels
    active = kernels.constants("step_desc.cuh")["DESC_ACTIVE"]
    D, NH, NKV, B, kvt = 32, 4, 2, 3, 64
    att = RingAttention(backend, D, NH, NKV, B, kvt, n_splits=2, lane_rows=8)
    one = RingAttention(backend, D, NH, NKV, B, kvt, n_splits=2)
    q, k, v, mask, _ = _lane_inputs(rng, 1, D, NH, NKV, B, 8, kvt, None)
    out = backend.asarray(np.full((8, NH * D), 7.5, np.float32))
    desc = np.zeros((1, DESC_LEN), np.int32)
    att(backend.asarray(q), backend.asarray(k), backend.asarray(v), backend.asarray(mask), out,
        live=backend.asarray(desc))
    assert (backend.to_numpy(out) == 7.5).all()
    desc[0, active] = 1
    att(backend.asarray(q), backend.asarray(k), backend.asarray(v), backend.asarray(mask), out,
        live=backend.asarray(desc))
    o1 = backend.zeros((B, NH * D), np.float32)
    one(backend.asarray(q[:B]), backend.asarray(k), backend.asarray(v), backend.asarray(mask[0]), o1)
    got = backend.to_numpy(out)
    np.testing.assert_array_equal(got[:B], backend.to_numpy(o1))
    assert (got[B:] == 7.5).all()


def test_lanes_bad_arguments(emu):
    from dflash_cupy.ops.attention import DESC_LEN
    be = emu
    D, NH, NKV, B, kvt, L, BS = 32, 4, 2, 2, 40, 3, 4
    with pytest.raises(ValueError, match="lanes=0"):
        RingAttention(be, D, NH, NKV, B, kvt, lanes=0)
    with pytest.raises(ValueError, match="lane_rows=1 must be >= q_len=2"):
        RingAttention(be, D, NH, NKV, B, kvt, lanes=L, lane_rows=1)
    att = RingAttention(be, D, NH, NKV, B, kvt, n_splits=1, lanes=L, lane_rows=BS, gate="head")
    args = dict(q=be.zeros((L * BS, NH * D), np.float32), k_cache=be.zeros((L * kvt, NKV * D), np.float16),
                v_cache=be.zeros((L * kvt, NKV * D), np.float16), mask=be.zeros((L, B, kvt), np.float16),
                out=be.zeros((L * BS, NH * D), np.float32), gate=be.zeros((L * BS, NH), np.float32),
                live=be.zeros((L, DESC_LEN), np.int32))
    att(**args)
    bad = [("q", be.zeros((L * B, NH * D), np.float32), ValueError),
           ("k_cache", be.zeros((kvt, NKV * D), np.float16), ValueError),
           ("mask", be.zeros((B, kvt), np.float16), ValueError),
           ("out", be.zeros((L * B, NH * D), np.float32), ValueError),
           ("gate", be.zeros((L * B, NH), np.float32), ValueError),
           ("live", be.zeros((L, 7), np.int32), ValueError),
           ("live", be.zeros((L, DESC_LEN), np.float32), TypeError)]
    for name, val, exc in bad:
        with pytest.raises(exc, match=name):
            att(**{**args, name: val})


# ---------------------------------------------------------------------------- the two merges
# (D, NH, NKV, q_len, lane_rows, capacity, n_splits, gate, path): 3 lanes (lane 1 idle), each
# on its own wrapped ring with its own mask; rows_per_block 16 at D 256 on the CUDA cores
# gives 2 row groups (units per lane: kv heads x row groups); n_splits 1 has no merge at all.
MERGE_CASES = [
    (64, 8, 2, 3, 5, 150, 3, None, "mma"),
    (64, 8, 2, 3, 5, 150, 4, "element", "mma"),
    (64, 8, 2, 3, 5, 150, 3, "head", "fma"),
    (256, 4, 2, 9, 9, 70, 2, "element", "fma"),
    (32, 4, 4, 1, 1, 190, 5, "head", "mma"),          # 6 key tiles in 5 splits: the last 2 empty
    (64, 8, 2, 3, 5, 150, 1, "element", "mma"),
    (64, 8, 2, 3, 5, 150, 1, None, "fma"),
]


@pytest.mark.parametrize("D,NH,NKV,B,BS,capacity,n_splits,gate,path", MERGE_CASES)
def test_split_merges(backend, rng, D, NH, NKV, B, BS, capacity, n_splits, gate, path):
    """merge "launch" (two launches) and "fold" (one, whatever n_splits): the
    live lanes equal the NumPy reference and each other bit for bit, the idle
    lane's rows (and rows past q_len) keep the sentinel, the fold's arrival
    counters are all zero after every launch (idle lane included), and graph
    replays give the same bits as the eager call."""
    from dflash_cupy import kernels
    from dflash_cupy.ops.attention import DESC_LEN
    active = kernels.constants("step_desc.cuh")["DESC_ACTIVE"]
    L = 3
    geom = RingGeometry(capacity, B)
    kvt = geom.kv_total
    q, k, v, _, g = _lane_inputs(rng, L, D, NH, NKV, B, BS, kvt, gate)
    mask = np.empty((L, B, kvt), np.float16)
    for lane in range(L):                                    # wrapped rings, full / sliding masks
        committed = capacity + 7 + 13 * lane
        slot_pos = contiguous_slot_pos(committed, capacity)
        mask[lane] = ring_masks(slot_pos, committed, geom, capacity // 3)[lane % 2]
    if B > 1:
        mask[0, 1] = NEG_INF                                 # a row with nothing visible: 0
    desc = rng.integers(0, 1000, (L, DESC_LEN)).astype(np.int32)
    desc[:, active] = [1, 0, 3]
    sentinel = np.float32(7.5)
    qd, kd, vd, md = (backend.asarray(a) for a in (q, k, v, mask))
    gd = None if g is None else backend.asarray(g)
    results = {}
    for merge in ("launch", "fold"):
        att = RingAttention(backend, D, NH, NKV, B, kvt, n_splits=n_splits, gate=gate, path=path, lanes=L,
                            lane_rows=BS, merge=merge)
        assert att.path == path and att.n_splits == n_splits
        folded = n_splits > 1 and merge == "fold"
        if n_splits == 1:
            assert att.merge is None and att.counters is None and att.part_o is None
        else:
            assert att.merge == merge and tuple(att.part_o.shape) == (L, n_splits, B * NH, D)
        if folded:
            groups = 1 if path == "mma" else att.row_groups
            assert (D == 256) == (groups == 2)
            assert tuple(att.counters.shape) == (L * NKV * groups,)
            assert (backend.to_numpy(att.counters) == 0).all()
        else:
            assert att.counters is None
        dd = backend.asarray(desc)
        out = backend.asarray(np.full((L * BS, NH * D), sentinel, np.float32))
        att(qd, kd, vd, md, out, gate=gd, live=dd)
        got = results[merge] = backend.to_numpy(out)
        if folded:
            assert (backend.to_numpy(att.counters) == 0).all(), "the merging block must reset its counter"
        for lane in range(L):
            r = slice(lane * BS, lane * BS + B)
            assert (got[lane * BS + B:(lane + 1) * BS] == sentinel).all(), "rows past q_len are never written"
            if lane == 1:
                assert (got[r] == sentinel).all(), "an idle lane's rows must stay untouched"
                continue
            ref = ring_attention_reference(q[r], k[lane * kvt:(lane + 1) * kvt], v[lane * kvt:(lane + 1) * kvt],
                                           mask[lane], n_head_kv=NKV, gate=None if g is None else g[r],
                                           gate_mode=gate)
            assert np.isfinite(got[r]).all()
            assert_close(got[r], ref, "f32", f"lane {lane}, {att}")
        if B > 1:
            assert (got[1] == 0).all()
        # captured: one kernel node (two with the combine), replays bit-identical to the eager call
        stream = backend.stream()
        backend.begin_capture(stream)
        att(qd, kd, vd, md, out, gate=gd, live=dd, stream=stream)
        graph = backend.end_capture(stream)
        assert graph.n_launches == (2 if n_splits > 1 and merge == "launch" else 1)
        fill = backend.pinned_empty((L * BS, NH * D), np.float32)
        fill[:] = sentinel
        for _ in range(2):
            backend.copy_h2d_async(out, fill, stream)
            graph.launch(stream)
            stream.synchronize()
            assert _bits_equal(backend.to_numpy(out), got)
            if folded:
                assert (backend.to_numpy(att.counters) == 0).all()
        # every lane idle: nothing written, nothing counted
        idle = desc.copy()
        idle[:, active] = 0
        att(qd, kd, vd, md, out, gate=gd, live=backend.asarray(idle))
        assert _bits_equal(backend.to_numpy(out), got)
        if folded:
            assert (backend.to_numpy(att.counters) == 0).all()
    assert _bits_equal(results["fold"], results["launch"]), "the two merges must agree bit for bit"



# (D, NH, NKV, q_len, lane_rows, capacity, lanes, path, want): batches at their default
# configuration: lanes enough to bring the split count to 1 (22 lanes x 8 kv heads on
# 132 SMs; one lane alone would split in 2), a fold at 7 splits of 5 tiles over 33 tiles
# (the last split holds 3), the CUDA cores' two row groups folded in 3 splits; awkward
# q_len / lane_rows / head counts; lanes 1, 3 and the last one idle.
DEFAULT_BATCHES = [
    (32, 16, 8, 3, 5, 280, 23, "mma", (1, None)),
    (32, 8, 8, 2, 3, 1030, 5, "mma", (7, "fold")),
    (256, 4, 2, 9, 11, 390, 6, "fma", (3, "fold")),
]


@pytest.mark.parametrize("D,NH,NKV,B,BS,capacity,L,path,want", DEFAULT_BATCHES)
def test_batches_at_their_default_split_counts(backend, rng, D, NH, NKV, B, BS, capacity, L, path, want):
    """A batch at the split count and merge its lanes give it: every live lane
    equals the NumPy reference and, bit for bit, a single-lane call with the
    same (n_splits, merge); idle lanes and rows past q_len keep the sentinel;
    the fold's counters end at zero."""
    from dflash_cupy import kernels
    from dflash_cupy.ops.attention import DESC_LEN
    active = kernels.constants("step_desc.cuh")["DESC_ACTIVE"]
    geom = RingGeometry(capacity, B)
    kvt = geom.kv_total
    att = RingAttention(backend, D, NH, NKV, B, kvt, lanes=L, lane_rows=BS, path=path)
    alone = default_splits(NKV, kvt, 132, att._unit_rows)
    assert att.path == path and att.config() == want and att.n_splits <= alone
    if want[0] == 1:
        assert alone > 1, "the lanes, not the window, bring this batch to one split"
    q, k, v, _, _ = _lane_inputs(rng, L, D, NH, NKV, B, BS, kvt, None)
    mask = np.empty((L, B, kvt), np.float16)
    for lane in range(L):
        committed = capacity + 3 + 11 * lane
        mask[lane] = ring_masks(contiguous_slot_pos(committed, capacity), committed, geom, capacity // 4)[lane % 2]
    desc = rng.integers(0, 1000, (L, DESC_LEN)).astype(np.int32)
    idle = {1, 3, L - 1}
    desc[:, active] = [0 if lane in idle else 1 + lane for lane in range(L)]
    sentinel = np.float32(-3.25)
    out = backend.asarray(np.full((L * BS, NH * D), sentinel, np.float32))
    att(backend.asarray(q), backend.asarray(k), backend.asarray(v), backend.asarray(mask), out,
        live=backend.asarray(desc))
    got = backend.to_numpy(out)
    if att.counters is not None:
        assert (backend.to_numpy(att.counters) == 0).all()
    one = RingAttention(backend, D, NH, NKV, B, kvt, n_splits=want[0], merge=want[1], path=path)
    for lane in range(L):
        r = slice(lane * BS, lane * BS + B)
        assert (got[lane * BS + B:(lane + 1) * BS] == sentinel).all(), "rows past q_len are never written"
        if lane in idle:
            assert (got[r] == sentinel).all(), f"idle lane {lane} written"
            continue
        kl, vl = k[lane * kvt:(lane + 1) * kvt], v[lane * kvt:(lane + 1) * kvt]
        ref = ring_attention_reference(q[r], kl, vl, mask[lane], n_head_kv=NKV)
        assert_close(got[r], ref, "f32", f"lane {lane}, {att}")
        if lane in (0, L - 2):
            o1 = backend.asarray(np.full((B, NH * D), np.nan, np.float32))
            one(backend.asarray(q[r]), backend.asarray(kl), backend.asarray(vl), backend.asarray(mask[lane]), o1)
            assert _bits_equal(got[r], backend.to_numpy(o1)), f"lane {lane} != its single-lane call"

def test_fold_merge_uses_the_counters(emu, rng):
    """The merge is gated by the counts alone: counters that do not start at
    zero (here at n_splits: every ticket drawn is past the last one) mean no
    block merges and out is not written, and the counts keep growing. With
    them at zero (every launch leaves them so) the result is the reference."""
    be = emu
    D, NH, NKV, B, kvt, S = 32, 4, 2, 2, 192, 3
    q, k, v = make_inputs(rng, B, NH, NKV, D, kvt)
    mask = np.zeros((B, kvt), np.float16)
    att = RingAttention(be, D, NH, NKV, B, kvt, n_splits=S, path="fma", merge="fold")
    ref = ring_attention_reference(q, k, v, mask, n_head_kv=NKV)
    good = run(be, att, q, k, v, mask)
    assert_close(good, ref, "f32", "counters at zero")
    start = be.pinned_empty(att.counters.shape, np.int32)
    start[:] = S                                         # every ticket drawn is past the last one
    be.copy_h2d_async(att.counters, start)
    be.synchronize()
    stale = run(be, att, q, k, v, mask)
    assert np.isnan(stale).all(), "with every ticket past the last, nobody merges: out keeps run()'s NaN"
    assert (be.to_numpy(att.counters) == 2 * S).all()


# ---------------------------------------------------------------------------- tuning
def _recording():
    from profiling.step_trace import RecordingBackend
    return RecordingBackend()        # constructors compile nothing and run nothing on it


def test_default_merge_rule():
    """The cost model's crossover (ops/attention.py: FOLD_FROM_KV_TOTAL): the
    combine launch at a short window, the folded merge at a long one, nothing
    to merge with one split; what the constructor picks from it."""
    from dflash_cupy.ops.attention import FOLD_FROM_KV_TOTAL
    assert default_merge(2080, 16) == "launch"            # qwen3-8b at 2K
    assert default_merge(32800, 33) == "fold"             # ... at 32K
    assert default_merge(FOLD_FROM_KV_TOTAL - 1, 33) == "launch"
    assert default_merge(FOLD_FROM_KV_TOTAL, 33) == "fold"
    assert default_merge(100_000, 1) is None
    be = _recording()
    small = RingAttention(be, 128, 32, 8, 16, 2080)
    assert small.config() == small.default_config() == (16, "launch")
    assert RingAttention(be, 128, 32, 8, 16, 32800).config() == (33, "fold")
    assert RingAttention(be, 128, 32, 8, 16, 32800, n_splits=4).config() == (4, "fold")
    assert RingAttention(be, 128, 32, 8, 16, 2080, merge="fold").config() == (16, "fold")
    assert RingAttention(be, 128, 32, 8, 16, 2080, n_splits=1, merge="launch").config() == (1, None)
    with pytest.raises(ValueError, match="merge"):
        RingAttention(be, 128, 32, 8, 16, 2080, merge="both")


@pytest.mark.parametrize("kvt,default", [(2080, (16, "launch")), (32800, (33, "fold")), (200, (1, None))])
def test_launch_candidates_of_the_presets(kvt, default):
    """Few (<= 12), each split count > 1 with both merges, one split once, the
    default among them, none with more splits than key tiles."""
    att = RingAttention(_recording(), 128, 32, 8, 16, kvt)
    cands = att.launch_candidates()
    assert att.default_config() == default and default in cands
    assert len(cands) <= 12 and len(set(cands)) == len(cands)
    assert cands[0] == (1, None) and all(n > 1 for n, _ in cands[1:])
    splits = split_candidates(8, kvt, 132)
    assert splits == sorted(splits) and splits[-1] <= -(-kvt // 32)
    assert cands == [(1, None)] + [(n, m) for n in splits[1:] for m in ("launch", "fold")]
    assert att.launch_candidates(16) == cands and att.config(16) == att.config()   # m: ignored


@pytest.mark.slow
@pytest.mark.parametrize("path", ["mma", "fma"])
def test_every_tuning_candidate_is_correct(backend, rng, path):
    """use_config to each candidate: what it allocates matches the
    configuration, every one equals the reference, and at each split count
    the two merges agree bit for bit."""
    D, NH, NKV, B, kvt = 64, 8, 2, 3, 300               # 10 key tiles: 1 .. 4 splits
    att = RingAttention(backend, D, NH, NKV, B, kvt, gate="head", path=path)
    cands = att.launch_candidates()
    assert cands == [(1, None)] + [(n, m) for n in (2, 3, 4) for m in ("launch", "fold")]
    assert att.config() == att.default_config() == (2, "launch")
    q, k, v = make_inputs(rng, B, NH, NKV, D, kvt)
    mask = np.where(rng.random((B, kvt)) < 0.5, np.float16(0), NEG_INF).astype(np.float16)
    g = rng.standard_normal((B, NH)).astype(np.float32)
    ref = ring_attention_reference(q, k, v, mask, n_head_kv=NKV, gate=g, gate_mode="head")
    got = {}
    for c in cands:
        att.use_config(None, c)
        n, merge = c
        assert att.config() == c and att.n_splits == n and att.merge == merge
        assert (att.part_o is None) == (n == 1)
        if n > 1:
            assert tuple(att.part_o.shape) == (1, n, B * NH, D) and tuple(att.part_ml.shape) == (1, n, B * NH, 2)
        assert (att.counters is not None) == (merge == "fold")
        got[c] = run(backend, att, q, k, v, mask, g)
        assert_close(got[c], ref, "f32", f"{c}, {path}")
    for n in (2, 3, 4):
        assert _bits_equal(got[(n, "fold")], got[(n, "launch")]), f"{n} splits, {path}"


def test_use_config_checks_and_refuses_after_capture(emu, rng):
    """A bad configuration raises naming what is wrong and changes nothing;
    after a graph captured the object, use_config raises (the graph holds the
    workspace's address) and the captured graph still computes the same."""
    be = emu
    D, NH, NKV, B, kvt = 32, 4, 2, 2, 192
    att = RingAttention(be, D, NH, NKV, B, kvt, n_splits=3, merge="fold", path="fma")
    before = (att.config(), att.part_o, att.counters)
    for bad, exc, what in [((3, "both"), ValueError, "merge"), ((7, "fold"), ValueError, "n_splits"),
                           ((0, "launch"), ValueError, "n_splits"), ((3,), ValueError, "config"),
                           ("fold", ValueError, "config")]:
        with pytest.raises(exc, match=what):
            att.use_config(None, bad)
        assert (att.config(), att.part_o, att.counters) == before
    with pytest.raises(TypeError, match="config"):
        att.use_config()
    att.use_config(None, (2, "launch"))                   # before any capture: allowed
    att.use_config(config=(3, "fold"))
    assert att.config() == (3, "fold")
    q, k, v = make_inputs(rng, B, NH, NKV, D, kvt)
    mask = np.zeros((B, kvt), np.float16)
    eager = run(be, att, q, k, v, mask)                   # an eager call is no capture
    att.use_config(None, (3, "launch"))
    assert _bits_equal(run(be, att, q, k, v, mask), eager)
    qd, kd, vd, md = (be.asarray(a) for a in (q, k, v, mask))
    out = be.asarray(np.full((B, NH * D), np.nan, np.float32))
    stream = be.stream()
    be.begin_capture(stream)
    att(qd, kd, vd, md, out, stream=stream)
    graph = be.end_capture(stream)
    for c in [(2, "fold"), (3, "fold"), (1, None)]:
        with pytest.raises(RuntimeError, match="capture"):
            att.use_config(None, c)
        assert att.config() == (3, "launch")
    graph.launch(stream)
    stream.synchronize()
    assert _bits_equal(be.to_numpy(out), eager)


# (D, NH, NKV, B, kv_total, n_splits, gate, page, lanes): awkward kv_total (a partial last page
# and tile), pages of one, two and four key tiles, one lane and three
PAGED = [(64, 8, 2, 3, 100, 3, "head", 64, 3), (32, 4, 4, 1, 37, 1, None, 32, 1),
         (128, 8, 8, 16, 300, 2, "element", 128, 2)]


@pytest.mark.parametrize("D,NH,NKV,B,kv_total,n_splits,gate,page,L", PAGED)
def test_paged_pools_match_the_dense_layout(backend, rng, D, NH, NKV, B, kv_total, n_splits, gate, page, L):
    """Every lane's keys through a shuffled page table into one shared pool (pages of the
    lanes interleaved, in reverse and random order; unmapped pages hold NaN): bit-identical
    to the dense layout of the same logical rows, and the paged NumPy reference."""
    from dflash_cupy.kv_pages import pages_per_lane
    from dflash_cupy.ops.attention import paged_reference
    n = pages_per_lane(kv_total, page)
    pool_pages = L * n + 3
    perm = rng.permutation(pool_pages)[:L * n].reshape(L, n)
    table = (perm * page).astype(np.int32)
    k_pool = np.full((pool_pages * page, NKV * D), np.nan, np.float16)
    v_pool = np.full_like(k_pool, np.nan)
    q = (rng.standard_normal((L * B, NH, D)) * 2).astype(np.float32)
    k_dense = rng.standard_normal((L * kv_total, NKV * D)).astype(np.float16)
    v_dense = rng.standard_normal((L * kv_total, NKV * D)).astype(np.float16)
    from dflash_cupy.kv_pages import physical_rows
    for l in range(L):
        rows = physical_rows(table[l], page, kv_total)
        k_pool[rows] = k_dense[l * kv_total:(l + 1) * kv_total]
        v_pool[rows] = v_dense[l * kv_total:(l + 1) * kv_total]
    mask = np.where(rng.random((L, B, kv_total)) < 0.5, np.float16(0), NEG_INF).astype(np.float16)
    mask[:, :, kv_total - 1] = 0                       # the last key: the partial page's
    g = None if gate is None else (rng.standard_normal((L * B, NH) if gate == "head" else (L * B, NH * D))
                                   ).astype(np.float32)
    for path in paths(D):
        att = RingAttention(backend, D, NH, NKV, B, kv_total, n_splits=n_splits, gate=gate, path=path, lanes=L,
                            page=page)
        outs = []
        for k, v, pages in ((k_dense, v_dense, None), (k_pool, v_pool, table)):
            out = backend.asarray(np.full((L * B, NH * D), np.nan, np.float32))
            att(backend.asarray(q), backend.asarray(k), backend.asarray(v), backend.asarray(mask), out,
                gate=None if g is None else backend.asarray(g),
                pages=None if pages is None else backend.asarray(pages))
            outs.append(backend.to_numpy(out))
        np.testing.assert_array_equal(outs[1], outs[0], err_msg=f"paged vs dense, {path}")
        ref = paged_reference(q.reshape(L, B, NH, D), k_pool, v_pool, mask, table, page, n_head_kv=NKV,
                              gate=None if g is None else g.reshape(L, B, -1), gate_mode=gate)
        assert_close(outs[1], ref.reshape(L * B, -1), "f32", f"paged attention, {path}")


def test_paged_arguments_raise(emu):
    att = RingAttention(emu, 32, 4, 4, 2, 100, lanes=2, page=64)
    q = emu.zeros((4, 128), np.float32)
    kv = emu.zeros((640, 128), np.float16)
    mask, out = emu.zeros((2, 2, 100), np.float16), emu.zeros((4, 128), np.float32)
    with pytest.raises(ValueError, match=r"pages must have shape \(2, 2\)"):
        att(q, kv, kv, mask, out, pages=emu.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="page_size=48 must be a multiple of 32"):
        RingAttention(emu, 32, 4, 4, 2, 100, page=48)
