"""The one tolerance table: |got - ref| <= atol + rtol * |ref|, by the dtype in
which the kernel stores or rounds its result. References round where the
kernels round, so these only absorb accumulation-order and libm differences."""
import numpy as np

TOL = {
    "f32": dict(atol=1e-5, rtol=1e-5),     # f32 accumulation, order differs from NumPy
    "f16": dict(atol=1e-3, rtol=2e-3),     # one f16 rounding (2^-11) of a value near 1
    "bf16": dict(atol=8e-3, rtol=1.6e-2),  # one bf16 rounding (2^-8)
    # whole drafter step vs the plain float64 oracle (rebased positions, exact
    # K/V): f16 K/V storage and f32 math through several layers. Loose: it
    # cannot tell f16 from bf16 K/V storage (tests/test_tolerance_teeth.py).
    "step": dict(atol=2e-3, rtol=2e-2),
    # whole drafter step vs the tight oracle (``draft_forward(..., pos_offset=lo,
    # kv_round="f16")``: K/V rounded to f16 where and at the absolute positions
    # where the cache rounds them). What is left is f32 arithmetic and the odd
    # f16 rounding tie resolved the other way: <= 5.4e-4 measured over every
    # drafter and schedule of tests/test_kv_cache.py (bf16/f16/f32/mixed
    # weights, positions to 2^31). A bf16 rounding of K/V moves outputs by
    # >= 3.7e-3, one RoPE position off by one by >= 4e-2, one mask slot off by
    # one by >= 0.5: each fails this bound (the negative controls).
    "step_kv16": dict(atol=1.5e-3, rtol=0.0),
    # whole drafter step with ``x_split=False`` vs the plain float64 oracle: every GEMM
    # input rounded once to the 16-bit weight type (bf16: 2^-9 relative per element)
    # instead of hi + lo. Measured over tests/test_kv_cache.py: 1.46e-2 (bf16 weights),
    # 9.2e-4 (f16), 6.5e-3 (f16 logits), ~11x the split's error. Absolute only, so
    # a RoPE position off by one (>= 4e-2) or a mask slot off by one (>= 0.5) still fails.
    "step_x1": dict(atol=2.5e-2, rtol=0.0),
}


def within(got, ref, kind) -> tuple[bool, float]:
    """(all elements within the ``kind`` tolerance, max abs error)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    t = TOL[kind]
    err = np.abs(got - ref)
    return bool((err <= t["atol"] + t["rtol"] * np.abs(ref)).all()), float(err.max(initial=0.0))


def assert_close(got, ref, kind, what=""):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    t = TOL[kind]
    err = np.abs(got - ref)
    bound = t["atol"] + t["rtol"] * np.abs(ref)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{err.size} elements outside {kind} tolerance "
            f"(atol={t['atol']}, rtol={t['rtol']}); worst at {i}: got {got[i]!r}, ref {ref[i]!r}, "
            f"max abs err {err.max():.3e}")
