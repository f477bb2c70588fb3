"""One argument check for the whole package: a non-int count is a TypeError,
an out-of-range one a ValueError, wherever it is passed."""
import numpy as np
import pytest

from dflash_cupy import DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from dflash_cupy.checks import check_no_overlap, int_arg
from dflash_cupy.ops.attention import RingAttention
from dflash_cupy.ops.rope import QkvNormRope


@pytest.mark.parametrize("v", [2.0, 2.5, True, "3", None])
def test_int_arg_rejects_non_ints(v):
    with pytest.raises(TypeError, match="^n must be an int"):
        int_arg(v, "n")


def test_int_arg_range_and_numpy_ints():
    assert int_arg(np.int64(3), "n", 1) == 3 and type(int_arg(np.int32(3), "n")) is int
    with pytest.raises(ValueError, match=r"^n=0 must be >= 1"):
        int_arg(0, "n", 1)


def test_same_exceptions_across_the_package(emu):
    c = DraftConfig(n_layer=1, hidden_size=8, n_head=2, n_head_kv=1, head_dim=4,
                    intermediate_size=8, block_size=2, target_layer_ids=(0,))
    w = DraftWeights.random(c)
    for make in (lambda v: FeatureRing(v, 1, 8, backend=emu),
                 lambda v: DraftKvCache(w, v, backend=emu),
                 lambda v: RingAttention(emu, 8, 2, 1, 2, v),
                 lambda v: QkvNormRope(emu, v, 2, 1, True)):
        with pytest.raises(TypeError, match="must be an int"):
            make(2.5)
        with pytest.raises(TypeError, match="must be an int"):
            make(2.0)
        with pytest.raises(ValueError, match="must be >= 1"):
            make(0)


def test_overlap_names_both_arrays():
    a = np.zeros(8, np.float32)
    check_no_overlap(x=a[:4], y=a[4:])
    with pytest.raises(ValueError, match="^y must not overlap x"):
        check_no_overlap(y=a[2:6], x=a[:4])
