"""Test data and tolerances, in one importable place (tests, notebooks and scripts use it).

- ``TOLERANCES`` / ``assert_close``: the one tolerance table. A result passes when
  ``|actual - ref| <= atol * scale + rtol * |ref|``, where ``scale`` is 1 for per-element results
  (y, residual_out, dx) and sqrt(M) for gradients reduced over M rows (dW, dB): their rounding
  errors add up like a random walk over the rows.
- ``rounded``: float64 values as they are once stored in a dtype (bfloat16 rounds to nearest even).
- ``random_inputs``: fresh random inputs and output gradients for an op (never zeros).
- ``poisoned_outputs``: backends fill every output with NaN before a launch, so an element a kernel
  fails to write shows up as NaN.

Framework-free: NumPy (and ml_dtypes for bfloat16) only.
"""
from __future__ import annotations

import contextlib
import math

import ml_dtypes
import numpy as np

from normkit import driver
from normkit.ops import Op

TOLERANCES = {
    # fp32 storage and fp32 math: a handful of roundings of 2^-24, grown by sums over D elements.
    "float32": dict(rtol=2e-5, atol=2e-5),
    # One final rounding to bf16 (2^-9 relative), plus llama/none modes rounding x_hat, rstd and the
    # weight to bf16 before the product: up to ~3 roundings of 2^-9 each.
    "bfloat16": dict(rtol=2e-2, atol=2e-2),
    # As bf16 with fp16's 2^-12 rounding; outputs of magnitude ~10 still pass through rtol.
    "float16": dict(rtol=3e-3, atol=3e-3),
    # float64 parameters: the kernels still compute and accumulate in fp32.
    "float64": dict(rtol=2e-5, atol=2e-5),
}


def coarser(*dtypes: str) -> str:
    """The dtype with the loosest tolerance: the one that bounds a result computed from all of them."""
    return max(dtypes, key=lambda d: TOLERANCES[d]["rtol"])


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


def rounded(a, dtype: str) -> np.ndarray:
    """``a`` as the float64 values it takes once stored in ``dtype`` (round to nearest even; bfloat16
    through ``ml_dtypes``, from float32 as the kernels round it)."""
    a = np.asarray(a, dtype=np.float64)
    if dtype == "float64":
        return a
    if dtype == "bfloat16":
        return a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    return a.astype(np.dtype(dtype)).astype(np.float64)


def random_inputs(op: Op, shape: tuple, dtype: str, rng: np.random.Generator, *, params=None,
                  param_dtype: str | None = None) -> dict:
    """Fresh random inputs of ``op`` (already rounded to their dtypes) and output gradients.

    ``params``: the parameter names present (default: all of ``op.params``). Returns a dict with the
    inputs by name, ``dy`` and, for the fused add, ``ds`` (the gradient of residual_out).
    """
    params = op.params if params is None else params
    D = shape[-1]
    normal = lambda: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731  (float32: half the work)
    out = {"x": rounded(normal() * 1.5 + 0.3, dtype)}
    if op.has_residual:
        out["residual"] = rounded(normal(), dtype)
    pd = param_dtype or dtype
    if "weight" in params:
        out["weight"] = rounded(rng.uniform(0.5, 1.5, D) * rng.choice([-1.0, 1.0], D), pd)
    if "bias" in params:
        out["bias"] = rounded(rng.standard_normal(D) * 0.5, pd)
    out["dy"] = rounded(normal(), dtype)
    if op.has_residual:
        out["ds"] = rounded(normal(), dtype)
    return out


@contextlib.contextmanager
def poisoned_outputs():
    """Inside the block, every output buffer a backend allocates starts as NaN (the JAX backend's
    jax-triton path cannot do this: jax-triton allocates its outputs itself)."""
    saved = driver.POISON_OUTPUTS
    driver.POISON_OUTPUTS = True
    try:
        yield
    finally:
        driver.POISON_OUTPUTS = saved
