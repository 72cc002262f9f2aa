"""Argument checks shared by both frontends; each raises before any launch, naming the argument.

Options (eps, offset, casting_mode) are checked by ``normkit.ops.Op.options``.
"""
from __future__ import annotations

from normkit.ops import MAX_N, PARAM_DTYPES, X_DTYPES, Op

SAVES = ("auto", "input", "output")  # what a norm keeps for its backward (``normkit.saving``)


def check_save(save) -> None:
    """Raises, naming the argument, for anything but one of ``SAVES``."""
    if not isinstance(save, str) or save not in SAVES:
        raise ValueError(f"normkit: save must be one of {SAVES}; got {save!r}")


def _dtype(name: str, dtype: str, allowed: tuple) -> None:
    if dtype not in allowed:
        raise TypeError(f"normkit: {name} has dtype {dtype}; supported dtypes are {', '.join(allowed)}")


def check(op: Op, *, x_shape: tuple, x_dtype: str, residual: tuple | None = None, weight: tuple | None = None,
          bias: tuple | None = None) -> int:
    """Validate the arrays of one call, each given as ``(shape, dtype name)`` or None; return D."""
    _dtype("x", x_dtype, X_DTYPES)
    if len(x_shape) == 0:
        raise ValueError("normkit: x must have at least one dimension (..., D); got a 0-d tensor")
    D = x_shape[-1]
    if D < 1:
        raise ValueError(f"normkit: x has shape {tuple(x_shape)}; the normalized dimension D must be >= 1")
    if D > MAX_N:
        raise ValueError(
            f"normkit: x has shape {tuple(x_shape)}; the normalized dimension D={D} exceeds the supported limit "
            f"of {MAX_N}")
    if op.has_residual:
        if residual is None:
            raise TypeError(f"normkit: {op.name} needs a residual")
        shape, dtype = residual
        _dtype("residual", dtype, X_DTYPES)
        if tuple(shape) != tuple(x_shape):
            raise ValueError(f"normkit: residual has shape {tuple(shape)}; expected x's shape {tuple(x_shape)}")
        if dtype != x_dtype:
            raise TypeError(f"normkit: residual has dtype {dtype}; expected x's dtype {x_dtype}")
    for name, arg in (("weight", weight), ("bias", bias)):
        if arg is None:
            continue
        if name not in op.params:
            raise TypeError(f"normkit: {op.name} takes no {name}")
        shape, dtype = arg
        _dtype(name, dtype, PARAM_DTYPES)
        if tuple(shape) != (D,):
            raise ValueError(
                f"normkit: {name} has shape {tuple(shape)}; expected ({D},) to match x of shape {tuple(x_shape)}")
    return D
