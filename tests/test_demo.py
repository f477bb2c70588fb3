"""``python -m dflash_cupy demo``: the ring cache against the oracle, random and from a checkpoint."""
import numpy as np

from dflash_cupy.__main__ import main
from dflash_cupy.config import DraftConfig
from dflash_cupy.demo import _schedule
from dflash_cupy.weights import DraftWeights


def test_schedule_has_growth_a_jump_and_a_rewind():
    s = _schedule(np.random.default_rng(0), 30, 20, 8, 18, 48)
    steps = np.diff(s)
    assert s[0] == 20 and (steps[:9] >= 1).all() and (steps[:9] <= 8).all()
    assert steps.max() > 18          # a jump: more than a_step rows at once (bulk append)
    assert steps.min() < 0           # a rewind


def test_demo_random_drafter(capsys):
    assert main(["demo", "--steps", "16", "--every", "4", "--capacity", "24", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "OK: every step matches the one-shot oracle" in out
    header = next(l for l in out.splitlines() if "committed" in l and "appended" in l)
    assert header.split() == ["step", "committed", "appended", "bulk", "max", "err", "host", "us"]
    rows = [l for l in out.splitlines() if l.strip()[:1].isdigit()]
    assert any(" yes" in l for l in rows) and any(" no " in l for l in rows)   # bulk and in-graph steps


def test_demo_from_checkpoint(tmp_path, capsys):
    cfg = DraftConfig(n_layer=1, hidden_size=32, n_head=2, n_head_kv=1, head_dim=32, intermediate_size=48,
                      block_size=4, target_layer_ids=(0, 2), layer_sliding=(True,), sliding_window=6)
    DraftWeights.random(cfg, seed=3, dtype="bf16").save_pretrained(tmp_path)
    assert main(["demo", "--checkpoint", str(tmp_path), "--steps", "10", "--capacity", "16"]) == 0
    out = capsys.readouterr().out
    assert "bf16 x" in out and "sliding_attention" in out and "OK:" in out


def test_demo_dflash2_random_and_from_checkpoint(tmp_path, capsys):
    """``demo --dflash2`` (a random DFlash 2 drafter) and a saved DFlash 2 checkpoint: hidden
    states and the selector's walk checked against the oracle at every step."""
    args = ["demo", "--dflash2", "--steps", "8", "--every", "4", "--capacity", "20", "--block-size", "4",
            "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "48", "--sliding", "0",
            "--window", "6", "--vocab", "40"]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("DFlash 2 selector:"))
    assert int(line.split()[3]) > 0 and line.endswith(" 0 differ") and "OK:" in out
    from dflash_cupy.config import DFlash2Config
    cfg = DraftConfig(n_layer=1, hidden_size=32, n_head=2, n_head_kv=1, head_dim=32, intermediate_size=48,
                      block_size=4, target_layer_ids=(0,), mask_token_id=1,
                      dflash2=DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                            selector_top_k=3, vocab_size=30))
    DraftWeights.random(cfg, seed=4, dtype="bf16").save_pretrained(tmp_path)
    assert main(["demo", "--checkpoint", str(tmp_path), "--steps", "6", "--capacity", "16"]) == 0
    out = capsys.readouterr().out
    assert "DFlash 2 selector:" in out and " 0 differ" in out and "OK:" in out


def test_spec_demo_dflash2_shows_both_acceptances(capsys):
    assert main(["demo", "--spec", "--dflash2", "--tokens", "10", "--capacity", "16", "--block-size", "4",
                 "--vocab", "64", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "48"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("DFlash 2: acceptance length"))
    assert "candidate selector" in line and "argmax" in line and "every step within tolerance" in out


def test_spec_demo_runs_the_loop(capsys):
    assert main(["demo", "--spec", "--tokens", "24", "--capacity", "16", "--block-size", "4",
                 "--vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "every step within tolerance" in out
    assert "24 tokens after a 20-token prompt" in out and "acceptance length mean" in out
    for part in ("target", "ring write", "draft step", "accept"):
        assert any(l.strip().startswith(part) and "ms/step" in l for l in out.splitlines())


def test_spec_target_is_causal_and_incremental():
    """The target over a sequence at once equals prefix + committed continuation
    (what the loop relies on when it commits the accepted prefix)."""
    from dflash_cupy.spec_demo import RandomTarget, accepted
    toks = np.random.default_rng(0).integers(0, 50, 12).astype(np.int32)
    full = RandomTarget(np, 50, 16, 4, (1, 3), seed=5)
    f_all, n_all, _ = full.forward(toks)
    inc = RandomTarget(np, 50, 16, 4, (1, 3), seed=5)
    f1, n1, in1 = inc.forward(toks[:7])
    inc.commit(in1, 6)
    f2, n2, _ = inc.forward(toks[7:])
    np.testing.assert_allclose(np.concatenate([f1, f2]), f_all, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.concatenate([n1, n2]), n_all)
    # acceptance: the leading run of drafts the target confirms
    nxt = np.array([5, 6, 7, 8], np.int32)
    assert int(accepted(np, np.array([0, 5, 6, 9], np.int32), nxt)) == 2
    assert int(accepted(np, np.array([0, 1, 6, 7], np.int32), nxt)) == 0
    assert int(accepted(np, np.array([0, 5, 6, 7], np.int32), nxt)) == 3


def test_lane_schedules_differ_join_pause_rewind_and_leave():
    from dflash_cupy.lanes_demo import _lane_schedules
    s = _lane_schedules(np.random.default_rng(0), 8, 40, 20, 8, 48)
    assert [next(k for k, c in enumerate(l) if c is not None) for l in s] == list(range(8))  # staggered joins
    assert len({next(c for c in l if c is not None) for l in s}) == 8                    # different prompts
    lane0 = [c for c in s[0] if c is not None]
    assert min(np.diff(lane0)) < 0                                                       # a rewind
    assert None in s[1][8:] and s[7][-1] is None                                         # a pause, a leave


def test_demo_lanes(capsys):
    assert main(["demo", "--lanes", "3", "--steps", "8", "--every", "2", "--capacity", "24",
                 "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "3 lanes" in out and "OK: every lane of every step matches the one-shot oracle" in out
    assert "captured 2x" in out
