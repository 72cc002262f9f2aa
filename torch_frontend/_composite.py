"""Frozen norms under ``torch.compile``: the op as plain torch operations, for Inductor to generate.

A compiled LoRA/PEFT step measured on an H200 runs faster with the model's own norm than with an
opaque kernel in its place (``docs/PERFORMANCE_RECORD.md``, "torch.compile and Inductor"): Inductor writes
the norm into the kernels around it (the residual add and the LoRA output's cast before it, the fp32
copy LoRA's A reads after it, and in the backward the sum of the gradients arriving from q/k/v and
their LoRA branches), where a kernel it cannot see needs each of those materialized first. A frozen
norm's backward is dx alone, which Inductor's generated kernel computes at the memory bound too, so
the kernels have nothing left to win there. So under ``torch.compile``, a call whose weight and bias
(where present) need no gradient runs as the operations below, with no ``autograd.Function``:
autograd (AOTAutograd, when compiling) derives the backward and Inductor fuses it.

A norm with a trained weight or bias keeps normkit's kernels under compile: their deterministic
fp32-partial dW/dB reduction is where they beat Inductor's. Tensor subclasses (DTensor) keep the
custom ops. ``compile_frozen_with("kernels")`` sends frozen norms to the kernels too.

The math and rounding points follow ``normkit.kernels.norm`` for each casting mode (as
``jax_frontend/_xla.py`` does). Inductor may keep an intermediate in fp32 where the eager code
rounds to x.dtype (its ``emulate_precision_casts`` is off by default), as it does for the model's
own norm, so results agree with the kernels to ``normkit.testing``'s tolerances, not bitwise.
"""
from __future__ import annotations

from typing import Literal

import torch

from normkit.ops import Casting, Op, Options

_ROUTES = ("inductor", "kernels")
_route = "inductor"


def compile_frozen_with(route: Literal["inductor", "kernels"]) -> str:
    """Where ``torch.compile`` sends a norm whose parameters are frozen: ``"inductor"`` (the default:
    the op as torch operations, fused with its neighbours) or ``"kernels"`` (normkit's kernels, as
    in eager mode). Returns the previous route. A compiled function recompiles when this changes."""
    global _route
    if not isinstance(route, str) or route not in _ROUTES:
        raise ValueError(f"normkit: compile_frozen_with takes one of {_ROUTES}; got {route!r}")
    previous, _route = _route, route
    return previous


def applies(x, residual, weight, bias) -> bool:
    """Whether this call, being compiled, runs as torch operations: plain tensors, no parameter
    that needs a gradient, and the route left at ``"inductor"``."""
    from torch_frontend._ops import subclassed

    return (_route == "inductor" and not subclassed(x, residual, weight, bias)
            and not (weight is not None and weight.requires_grad) and not (bias is not None and bias.requires_grad))


def _rounded(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return v if dtype == torch.float32 else v.to(dtype).float()


def apply(op: Op, opts: Options, x, residual, weight, bias):
    """The op's outputs as ``functional`` returns them: y, or ``(y, residual_out)`` for the fused add."""
    dt = x.dtype
    s = None
    x32 = x.float()
    if op.has_residual:  # the sum rounded to x.dtype, as torch's `x + residual`, and normalized as stored
        s = (x32 + residual.float()).to(dt)
        x32 = s.float()
    if op.is_rms:
        xc = x32
    else:
        xc = x32 - x32.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + opts.eps)
    if opts.casting == Casting.INPUT_DTYPE:  # every product rounded to x.dtype
        y = _rounded(xc * _rounded(rstd, dt), dt)
    elif opts.casting == Casting.ROUND_NORMALIZED:
        y = _rounded(xc * rstd, dt)
    else:
        y = xc * rstd
    if weight is not None:
        w = weight.float() + opts.offset if opts.offset else weight.float()
        y = y * (_rounded(w, dt) if opts.casting == Casting.INPUT_DTYPE else w)
    if bias is not None:
        y = y + bias.float()
    y = y.to(dt)
    return (y, s) if op.has_residual else y
