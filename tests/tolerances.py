"""The one tolerance table. A result passes when |actual - ref| <= atol * scale + rtol * |ref|.

``scale`` is 1 for per-element results (y, residual_out, dx) and sqrt(M) for gradients reduced
over M rows (dW, dB): their rounding errors add up like a random walk over the rows.
"""
from __future__ import annotations

import math

import numpy as np

TOLERANCES = {
    # fp32 storage and fp32 math: a handful of roundings of 2^-24, grown by sums over D elements.
    "float32": dict(rtol=2e-5, atol=2e-5),
    # One final rounding to bf16 (2^-9 relative), plus llama/none modes rounding x_hat, rstd and the
    # weight to bf16 before the product: up to ~3 roundings of 2^-9 each.
    "bfloat16": dict(rtol=2e-2, atol=2e-2),
    # As bf16 with fp16's 2^-12 rounding; outputs of magnitude ~10 still pass through rtol.
    "float16": dict(rtol=3e-3, atol=3e-3),
}


def assert_close(actual, ref, dtype: str, what: str, reduced_over: int = 1) -> None:
    """Compare with the float64 reference; NaN/Inf must sit exactly where the reference has them."""
    actual = np.asarray(actual, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert actual.shape == ref.shape, f"{what}: shape {actual.shape} != reference {ref.shape}"
    tol = TOLERANCES[dtype]
    atol = tol["atol"] * math.sqrt(max(reduced_over, 1))
    ref_nan, act_nan = np.isnan(ref), np.isnan(actual)
    assert np.array_equal(ref_nan, act_nan), (
        f"{what}: NaN at {np.argwhere(act_nan & ~ref_nan)[:5].tolist()} (unwritten or wrong) / "
        f"missing at {np.argwhere(ref_nan & ~act_nan)[:5].tolist()}")
    ref_inf = np.isinf(ref)
    assert np.array_equal(actual[ref_inf], ref[ref_inf]), f"{what}: Inf differs from the reference"
    ok = ref_nan | ref_inf | (np.abs(actual - ref) <= atol + tol["rtol"] * np.abs(ref))
    if not ok.all():
        bad = np.argwhere(~ok)[:5]
        err = np.abs(actual - ref)[~ok].max()
        raise AssertionError(
            f"{what} ({dtype}): {int((~ok).sum())}/{ok.size} elements off, max |err| {err:.3g} "
            f"(atol {atol:.3g}, rtol {tol['rtol']}); first at {bad.tolist()}: "
            f"{[(float(actual[tuple(i)]), float(ref[tuple(i)])) for i in bad]}")
