"""profiling.lanes_model: the recorded batch step and its per-lane cost."""
import numpy as np
import pytest

from profiling import lanes_model as lm
from profiling.common import drafter_config
from profiling.hw_params import get_gpu
from profiling.step_trace import Launch
from tests.support.model_params import report_goal


def test_batch_plan_marks_live_tiles_and_floor_shares_weights():
    cfg = drafter_config("h4096")
    b, nodes = lm.trace_batch_step(cfg, 256, 4, 3, accept=6)
    assert b.lanes == 4 and b.captures == 2
    kinds = [n.kernel for n in nodes if isinstance(n, Launch)]
    assert kinds.count("plan_lanes") == 1                 # one planning launch for every lane
    marked = [n.known["tile_live"] for n in nodes if isinstance(n, Launch) and "tile_live" in n.known]
    assert marked and all(sum(t) < len(t) for t in marked)   # the GEMMs read the flags; lane 3 idle: dead tiles
    single = {"weights": 100, "lm_head": 10, "total": 150}
    assert lm.floor_bytes(single, 1) == 150 and lm.floor_bytes(single, 4) == 110 + 4 * 40


@pytest.mark.slow
def test_per_lane_cost_falls_with_lanes():
    gpu = get_gpu("H200")
    rows = [lm.model_batch("qwen3-8b", 2048, n, gpu) for n in (1, 4)]
    r1, r4 = rows
    assert 0.9 < r1["vs_single"] < 1.2                    # one lane costs about a single cache's step
    assert r4["step_us"] > r1["step_us"] and r4["per_lane_us"] < r1["per_lane_us"]
    assert r4["floor_us"] > r1["floor_us"]
    assert "lanes" in lm.format_table(rows)


def test_gemm_stream_counters_skip_dead_tiles():
    """The static counters follow tile_live when the plan knows the flags: a dead
    tile costs no MMAs, x loads or stores; a block of dead tiles loads no weights."""
    from profiling import counters as ctr
    from tests.support.launches import arr, gs_launch
    L, p = gs_launch(256, 256, 256)
    assert p.mt == 4 and p.grid[0] == 4      # linear grid: 1 column group x 4 M blocks
    L = L.with_args(ln=None, eps=0.0, norm_lo=0, tile_live=arr("tl", (16,), np.int32), use_live=1)
    unknown = ctr.static_counters(L)
    flags = [True] * 8 + [False] * 4 + [True, False, False, False]   # block 2 all dead, block 3 one tile
    L.known["tile_live"] = tuple(flags)
    c = ctr.static_counters(L)
    assert c.mma * 16 == unknown.mma * 9
    assert c.bytes_read[next(k for k in c.bytes_read if k.startswith("x"))] == 9 * 16 * 256 * 4
    assert c.gld_sectors < unknown.gld_sectors
    assert any("7 dead 16-row tile(s) skipped" in n for n in c.notes)
    assert any("assumed live" in n for n in unknown.notes)


@pytest.mark.slow
def test_single_term_activations_halve_the_mmas_where_they_bind(request):
    """x_split=False: one rounding of each GEMM input halves the modelled MMAs;
    at one lane (a weight stream) the step is unchanged, at 16 lanes (MMA-bound
    with hi + lo) it is shorter (by how much: reported)."""
    from profiling import counters as ctr
    gpu = get_gpu("H200")
    cfg = drafter_config("h4096")
    mma = {}
    for xs in (True, False):
        _, nodes = lm.trace_batch_step(cfg, 256, 4, 4, accept=6, x_split=xs)
        gemms = [n for n in nodes if isinstance(n, Launch) and n.kernel in ("gemm_stream", "gemm_wgmma")]
        assert gemms and all(n.defines.get("GS_SPLIT", n.defines.get("GW_SPLIT")) == (2 if xs else 1) for n in gemms)
        mma[xs] = sum(ctr.static_counters(n).mma + ctr.static_counters(n).wgmma_mma for n in gemms)
    assert mma[True] == 2 * mma[False]
    one = {xs: lm.model_batch("qwen3-8b", 2048, 1, gpu, x_split=xs) for xs in (True, False)}
    assert abs(one[True]["step_us"] - one[False]["step_us"]) < 0.02 * one[True]["step_us"]
    many = {xs: lm.model_batch("qwen3-8b", 2048, 16, gpu, x_split=xs) for xs in (True, False)}
    assert many[False]["step_us"] < many[True]["step_us"]
    ratio = many[False]["step_us"] / many[True]["step_us"]
    report_goal(request, "16 lanes, one rounding / hi + lo step", ratio, "below 0.9", ratio < 0.9)
    assert many[False]["x_split"] is False and "single" in lm.format_table([many[False]])


@pytest.mark.slow
def test_batch_attention_splits_fall_with_lanes(monkeypatch, request):
    """ops/attention.py counts the lanes in the units that fill the SMs: at 16
    lanes (2K window) the batch's attention splits each lane's keys 4 ways
    (folded) instead of 16 (plus a combine launch), and the model's attention
    time per step falls against the one-lane rule (forced back here; 328 to 209 us
    when the rule came: the figures are reported); one lane is untouched."""
    from dflash_cupy.ops import attention
    gpu = get_gpu("H200")
    new = {n: lm.model_batch("qwen3-8b", 2048, n, gpu) for n in (1, 16)}
    b16, _ = lm.trace_batch_step(drafter_config("h4096"), 2048, 16, 16)
    assert b16.attention.config() == (4, "fold")
    splits, merge = attention.default_splits, attention.default_merge
    monkeypatch.setattr(attention, "default_splits", lambda nkv, kvt, sms, rg=1, lanes=1: splits(nkv, kvt, sms, rg))
    monkeypatch.setattr(attention, "default_merge", lambda kvt, n, lanes=1: merge(kvt, n))
    old = {n: lm.model_batch("qwen3-8b", 2048, n, gpu) for n in (1, 16)}
    b16, _ = lm.trace_batch_step(drafter_config("h4096"), 2048, 16, 16)
    assert b16.attention.config() == (16, "launch")
    assert new[1]["attention_us"] == old[1]["attention_us"] and new[1]["step_us"] == old[1]["step_us"]
    assert new[16]["attention_us"] < old[16]["attention_us"]
    assert new[16]["n_nodes"] == old[16]["n_nodes"] - 5        # no combine launch in the 5 layers
    assert new[16]["step_us"] < old[16]["step_us"]
    report_goal(request, "16 lanes attention us (one-lane rule)", old[16]["attention_us"], "above 300", old[16]["attention_us"] > 300)
    report_goal(request, "16 lanes attention us", new[16]["attention_us"], "below 220 and 0.7 x the one-lane rule's",
                new[16]["attention_us"] < 220 and new[16]["attention_us"] < 0.7 * old[16]["attention_us"])
    saved = old[16]["step_us"] - new[16]["step_us"]
    report_goal(request, "16 lanes step us saved by the lane-aware splits", saved, "above 100", saved > 100)


def test_plan_lanes_counters_follow_the_active_lanes():
    """plan_lanes: an idle lane's blocks and the gather blocks past a lane's appended rows
    exit at their start; the model counts the rows gathered and the working blocks."""
    from profiling import counters as ctr
    cfg = drafter_config("h4096")
    b, nodes = lm.trace_batch_step(cfg, 256, 4, 2, accept=6)
    L = next(n for n in nodes if isinstance(n, Launch) and n.kernel == "plan_lanes")
    assert L.known["lanes_app"] == (6, 6, None, None)
    known = ctr.static_counters(L)
    del L.known["lanes_app"]
    every = ctr.static_counters(L)
    gx = -(-cfg.fc_in // 1024)
    plan_blocks = L.grid[0] - gx * b.a_step
    assert known.live_blocks == 2 * (6 * gx + plan_blocks)
    assert every.live_blocks == 4 * (b.a_step * gx + plan_blocks) > known.live_blocks
    assert known.dram_bytes < every.dram_bytes


def test_pdl_charges_the_programmatic_edges_their_own_gap():
    """--pdl: the batch's pdl=True graph has the same nodes; each launch right after a launch
    costs pdl_gap_s instead of node_gap_s, and nothing else moves."""
    gpu = get_gpu("H200")
    plain, pdl = (lm.model_batch("qwen3-8b", 256, 3, gpu, lanes=4, pdl=p) for p in (False, True))
    assert plain["n_pdl_edges"] == 0 and pdl["n_nodes"] == plain["n_nodes"]
    assert 0 < pdl["n_pdl_edges"] < pdl["n_nodes"]   # the first launch follows the descriptor copy
    saved = (gpu.node_gap_s - gpu.pdl_gap_s) * 1e6 * pdl["n_pdl_edges"]
    assert abs((plain["step_us"] - pdl["step_us"]) - saved) < 1e-6
    assert abs((plain["gaps_us"] - pdl["gaps_us"]) - saved) < 1e-6
    assert pdl["single_step_us"] < plain["single_step_us"]   # the reference step modelled with PDL too


@pytest.mark.slow
def test_sixteen_lanes_take_the_x16_gate_up_path(monkeypatch, request):
    """At 16 active lanes (h4096, 2K, one rounding of the GEMM inputs) the gate_up GEMM reads
    16-bit normalised rows from a norm launch of its own (one node more per layer) instead of
    staging f32 h in every column group; forced back to the fold (the threshold raised) the
    model prices the batch step slower, which is why the rule exists. The per-request share
    (the lanes issue's 1/8 goal) is reported, not asserted: it is a model output."""
    import dflash_cupy.step_recipe as si
    gpu = get_gpu("H200")
    r = lm.model_batch("h4096", 2048, 16, gpu, x_split=False)
    b, nodes = lm.trace_batch_step(drafter_config("h4096"), 2048, 16, 16, x_split=False)
    assert b.hn16 is not None and b.g_gate_up.x16
    assert sum(1 for n in nodes if isinstance(n, Launch) and n.kernel == "rmsnorm"
               and n.defines.get("NORM_Y16")) == b.config.n_layer
    monkeypatch.setattr(si, "GATE_UP_X16_MIN_ROWS", 10**9)
    folded = lm.model_batch("h4096", 2048, 16, gpu, x_split=False)
    assert folded["n_nodes"] == r["n_nodes"] - b.config.n_layer
    assert folded["step_us"] > r["step_us"]
    report_goal(request, "16 lanes, h4096 2K: share of the single step per request", r["vs_single"],
                "the lanes issue's 1/8", r["vs_single"] <= 1 / 8)
    report_goal(request, "the same with the folded gate_up", folded["vs_single"], "the lanes issue's 1/8",
                folded["vs_single"] <= 1 / 8)