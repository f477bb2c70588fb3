"""A short soak (profiling/soak.py) in CI: random acceptances, jumps, rewinds,
resets and planted bad inputs through one cache, oracle-checked, with device
memory flat after the first step."""
from profiling import soak


def test_short_soak_is_clean():
    stats = soak.run(steps=80, check_every=8, sample_every=10, seed=3, backend="emulated", verbose=False)
    assert stats["failures"] == 0 and stats["bad_accepted"] == 0
    assert stats["events"]["bad"] >= 1 and stats["bad_rejected"] == stats["events"]["bad"]
    assert stats["events"]["rewind"] + stats["events"]["reset"] + stats["events"]["jump"] >= 2
    assert stats["checks"] >= 10
    assert stats["max_err"] < 2e-3
    assert stats["device_growth"] == 0
    assert stats["ok"]
