"""Row views: a tensor of any leading shape ``(..., D)`` as the driver's ``[M, D]`` rows, and back.

The driver reads rows whose column stride is 0 or 1 and whose leading dimensions collapse to one
row stride; such a tensor is viewed in place. Any other layout is copied, with a
``NormkitCopyWarning``. ``forward`` and ``backward`` run the driver over the caller's shape: this
is the general path (the eager fast path in ``_fastpath`` binds the same plans once per signature).
"""
from __future__ import annotations

import warnings

import torch

from normkit import driver
from normkit.ops import Grads, Op, Options
from torch_frontend._backend import BACKEND

__all__ = ["NormkitCopyWarning"]


class NormkitCopyWarning(UserWarning):
    """An input could not be read in place (its last dimension is neither contiguous nor broadcast,
    its leading dimensions do not share one stride, or it is a lazily negated view) and was copied."""


def row_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[M, D]`` rows without a copy (its last dimension contiguous or broadcast, its leading
    dimensions one stride), or None where that needs a copy."""
    D = t.shape[-1]
    if D > 1 and t.stride(-1) not in (0, 1):
        return None
    try:
        return t.view(-1, D)
    except RuntimeError:
        return None


def as_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` as ``[M, D]`` rows with column stride 0 or 1; a copy (with a warning) only if it must."""
    rows = row_view(t)
    if rows is not None:
        return rows
    D = t.shape[-1]
    if D > 1 and t.stride(-1) not in (0, 1):
        warnings.warn(
            f"normkit: {name} of shape {tuple(t.shape)} has strides {t.stride()}; its last dimension is neither "
            "contiguous nor broadcast, so it is copied", NormkitCopyWarning, stacklevel=5)
        return t.contiguous().view(-1, D)
    warnings.warn(
        f"normkit: {name} of shape {tuple(t.shape)} with strides {t.stride()} cannot be viewed as rows of one "
        "stride, so it is copied", NormkitCopyWarning, stacklevel=5)
    return t.reshape(-1, D)


def resolve_neg(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """``t`` with torch's lazy negation applied. A negated view (``z.conj().imag``) holds ``-t`` in
    its memory's sign bits only as a flag; a kernel reading the memory would see ``t``'s negation."""
    if t is None or not t.is_neg():
        return t
    warnings.warn(
        f"normkit: {name} of shape {tuple(t.shape)} is a lazily negated view (is_neg()), so it is copied with "
        "the negation applied", NormkitCopyWarning, stacklevel=4)
    return t.resolve_neg()


def _shaped(t: torch.Tensor | None, shape) -> torch.Tensor | None:
    """Rows ``t`` in the caller's shape, as a tensor of its own rather than a view of an internal
    buffer (autograd forbids in-place ops on a custom Function's view outputs: ``y *= 2`` must work)."""
    if t is None or t.shape == shape:
        return t
    return t.view(shape).detach()


def forward(op: Op, x, residual, weight, bias, opts: Options, store_stats: bool, backend=BACKEND) -> tuple:
    """``(y, residual_out, mean, rstd)`` over x ``(..., D)``; statistics of shape ``x.shape[:-1]``."""
    shape = x.shape
    r2d = as_rows(residual, "residual") if residual is not None else None
    outs = driver.forward(backend, op, as_rows(x, "x"), r2d, weight, bias, opts, store_stats)
    lead = shape[:-1]
    return (_shaped(outs[0], shape), _shaped(outs[1], shape), _shaped(outs[2], lead), _shaped(outs[3], lead))


def backward(op: Op, x, weight, dy, dres, mean, rstd, opts: Options, grads: Grads, b_dtype: str | None,
             backend=BACKEND) -> tuple:
    """``(dx, dweight, dbias)`` over x ``(..., D)``; an entry ``grads`` does not ask for is None."""
    shape = x.shape
    rows = lambda t: t.reshape(-1).contiguous() if t is not None else None  # noqa: E731  (statistics, read as contiguous)
    dres2d = as_rows(dres, "the residual_out gradient") if dres is not None else None
    dx, dw, db = driver.backward(backend, op, as_rows(x, "x"), weight, as_rows(dy, "the output gradient"), dres2d,
                                 rows(mean), rows(rstd), opts, grads, b_dtype)
    return (dx.view(shape) if dx is not None else None), dw, db
