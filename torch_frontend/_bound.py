"""Eager call signatures and their bound plans: the Torch frontend's one cache.

A call signature is the op, its options (``save`` among them), whether the forward stores statistics
for a backward, whether that backward reads the output (``_save``), and each tensor's class, shape, strides, dtype
and device: everything ``normkit.driver.Bound``'s plans fix. Its first eager call is validated and
bound (``bind``); a repeated one (a training loop's) finds its ``Bound`` by ``key`` and launches it
with no validation, planning or reshaping. The backward plans live on the ``Bound`` itself, keyed on
what they read (a saved-tensor hook may hand the backward other layouts than the forward saw).
"""
from __future__ import annotations

from normkit import driver
from normkit.ops import Op, Options
from torch_frontend._backend import BACKEND

BOUND: dict = {}
BOUND_LIMIT = 4096  # distinct call signatures kept (a model has a handful); past it, start again


def key(op: Op, eps, offset, casting_mode, store_stats: bool, from_output: bool, x, residual, weight, bias,
        save: str = "auto") -> tuple:
    """The signature of a call (each option with its class: ``1e-6`` and ``np.float64(1e-6)`` are
    validated apart). Raises AttributeError for a non-tensor, RuntimeError for a tensor without
    strides or sizes (sparse, nested): the caller then validates, which names it."""
    return (op.name, store_stats, from_output, save, eps.__class__, eps, offset.__class__, offset, casting_mode.__class__,
            casting_mode, x.__class__, x.shape, x.stride(), x.dtype, x.device,
            None if residual is None else (residual.__class__, residual.shape, residual.stride(), residual.dtype,
                                           residual.device),
            None if weight is None else (weight.__class__, weight.shape, weight.stride(), weight.dtype, weight.device),
            None if bias is None else (bias.__class__, bias.shape, bias.stride(), bias.dtype, bias.device))


def bind(k: tuple | None, op: Op, opts: Options, store_stats: bool, from_output: bool,
         b_dtype: str = "float32") -> driver.Bound:
    """The ``Bound`` of a validated call (``b_dtype``: the bias's dtype, dB's), remembered under ``k``
    (None: not remembered)."""
    bound = driver.Bound(BACKEND, op, opts, store_stats, from_output, b_dtype)
    if k is not None:
        if len(BOUND) >= BOUND_LIMIT:
            BOUND.clear()
        BOUND[k] = bound
    return bound
