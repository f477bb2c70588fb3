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
