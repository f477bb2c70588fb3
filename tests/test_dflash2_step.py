"""DFlash 2 in the cached step (SPEC §6): the convolutions around every sublayer, checked
step by step against the float64 oracle by ``tests/support/drafters.py`` (drafters "g" and "h"
in test_kv_cache's schedules, "g" in test_kv_batch's lanes); here the negative control and
what is refused until the candidate selector is in the graph."""
import numpy as np
import pytest

from dflash_cupy import reference
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.tolerances import within
from dflash_cupy.weights import DraftWeights
from tests.support.drafters import SPECS, Driver, built


def test_step_runs_the_convolutions(emu):
    """One step matches the DFlash 2 oracle, and is outside the step tolerance of the same
    weights without the convolutions: the check has teeth."""
    d = Driver(emu, "g", seed=5)
    try:
        noise = d.step(11)                                   # checked against the oracle inside
        c = d.spec.config
        X = d.features(0, 11).astype(d.ring.dtype)
        v1 = DraftWeights(c.replace(dflash2=None), {k: v for k, v in d.w.items() if "_conv." not in k
                                                     and not k.startswith("candidate_selector.")})
        ok, err = within(emu.to_numpy(d.kv.hidden_states), reference.draft_forward(v1, X, noise), "step")
        assert not ok and err > 1e-2, err
        assert d.kv.recipe.conv and not d.kv.recipe.fold_norms
    finally:
        d.close()


def test_lm_head_refused_until_the_selector_runs_in_the_graph(emu):
    w, _ = built("g")
    lm = np.zeros((SPECS["g"].config.dflash2.vocab_size, w.config.hidden_size), np.float32)
    with pytest.raises(NotImplementedError, match="candidate selector"):
        DraftKvCache(w, 23, lm_head=lm, backend=emu)
