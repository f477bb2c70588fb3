"""profiling.lanes_model: the recorded batch step and its per-lane cost."""
import numpy as np

from profiling import lanes_model as lm
from profiling.common import drafter_config
from profiling.hw_params import get_gpu
from profiling.launch_plan import Launch


def test_batch_plan_marks_live_tiles_and_floor_shares_weights():
    cfg = drafter_config("h4096")
    b, nodes = lm.batch_step_plan(cfg, 256, 4, 3, accept=6)
    assert b.lanes == 4 and b.captures == 2
    kinds = [n.kernel for n in nodes if isinstance(n, Launch)]
    assert kinds.count("plan_lanes") == 1                 # one planning launch for every lane
    marked = [n.known["tile_live"] for n in nodes if isinstance(n, Launch) and "tile_live" in n.known]
    if b._tile_skip:                                      # the GEMMs read the live flags
        assert marked and all(sum(t) < len(t) for t in marked)   # lane 3 idle: dead tiles
    single = {"weights": 100, "lm_head": 10, "total": 150}
    assert lm.floor_bytes(single, 1) == 150 and lm.floor_bytes(single, 4) == 110 + 4 * 40


def test_per_lane_cost_falls_with_lanes():
    gpu = get_gpu("H200")
    rows = [lm.model_batch("qwen3-8b", 2048, n, gpu) for n in (1, 4)]
    r1, r4 = rows
    assert 0.9 < r1["vs_single"] < 1.2                    # one lane costs about a single cache's step
    assert r4["step_us"] > r1["step_us"] and r4["per_lane_us"] < r1["per_lane_us"]
    assert r4["floor_us"] > r1["floor_us"]
    assert "lanes" in lm.format_table(rows)
