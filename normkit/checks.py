"""Argument checks shared by both frontends; each raises before any launch, naming the argument."""
from __future__ import annotations

import math

from normkit.launch import CASTING_MODES, MAX_N

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _dtype(name: str, dtype: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"normkit: {name} has dtype {dtype}; supported dtypes are float32, bfloat16 and float16")


def check(
    *,
    x_shape: tuple,
    x_dtype: str,
    weight: tuple | None = None,  # (shape, dtype) or None
    bias: tuple | None = None,
    residual: tuple | None = None,
    eps: float,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> int:
    """Validate one call; return the row length D."""
    _dtype("x", x_dtype)
    if len(x_shape) == 0:
        raise ValueError("normkit: x must have at least one dimension (..., D); got a 0-d tensor")
    D = x_shape[-1]
    if D < 1:
        raise ValueError(f"normkit: x has shape {tuple(x_shape)}; the normalized dimension D must be >= 1")
    if D > MAX_N:
        raise ValueError(
            f"normkit: x has shape {tuple(x_shape)}; the normalized dimension D={D} exceeds the supported limit "
            f"of {MAX_N}"
        )
    for name, arg in (("weight", weight), ("bias", bias)):
        if arg is None:
            continue
        shape, dtype = arg
        _dtype(name, dtype)
        if tuple(shape) != (D,):
            raise ValueError(f"normkit: {name} has shape {tuple(shape)}; expected ({D},) to match x of shape {tuple(x_shape)}")
    if residual is not None:
        shape, dtype = residual
        _dtype("residual", dtype)
        if tuple(shape) != tuple(x_shape):
            raise ValueError(f"normkit: residual has shape {tuple(shape)}; expected x's shape {tuple(x_shape)}")
        if dtype != x_dtype:
            raise TypeError(f"normkit: residual has dtype {dtype}; expected x's dtype {x_dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"normkit: eps must be a finite number >= 0; got {eps!r}")
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ValueError(f"normkit: offset must be a finite number; got {offset!r}")
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"normkit: unknown casting_mode {casting_mode!r}; expected one of {sorted(CASTING_MODES)}")
    return D
