"""Frozen norms under ``torch.compile``: the op as plain torch operations, for Inductor to generate.

A compiled LoRA/PEFT step runs faster with the model's own norm than with an opaque kernel in its
place (the evidence: ``docs/PERFORMANCE_RECORD.md``, "torch.compile and Inductor"): Inductor writes
the norm into the kernels around it (the residual add and the LoRA output's cast before it, the fp32
copy LoRA's A reads after it, and in the backward the sum of the gradients arriving from q/k/v and
their LoRA branches), where a kernel it cannot see needs each of those materialized first. A frozen
norm's backward is dx alone, which Inductor's generated kernel computes at the memory bound too, so
the kernels have nothing left to win there. So under ``torch.compile``, a call whose weight and bias
(where present) need no gradient runs as the operations below, and Inductor fuses them.

What its backward keeps follows ``save`` (``_save.traced_saves_output``: the weight's values are not
seen while tracing). Keeping the output, the call is ``_FromOutput``, an ``autograd.Function`` of
torch operations whose backward reads y and the per-row rstd alone (``norm_math.output_backward``,
NaN where the weight turns out unsafe), so AOTAutograd keeps no x for it; its forward reads x through
``_written``, so that Inductor still writes a residual stream once, as it does for a saved x. Keeping
the input, it is plain operations, whose backward AOTAutograd derives.

A norm with a trained weight or bias keeps normkit's kernels under compile: their deterministic
fp32-partial dW/dB reduction is where they beat Inductor's. Tensor subclasses (DTensor) keep the
custom ops. ``compile_frozen_with("kernels")`` sends frozen norms to the kernels too.

The math is ``normkit.norm_math``'s, with the rounding points of ``normkit.kernels.norm`` for each
casting mode (as ``jax_frontend/_xla.py`` has them). Inductor may keep an intermediate in fp32 where
the eager code rounds to x.dtype (its ``emulate_precision_casts`` is off by default), as it does for
the model's own norm, so results agree with the kernels to ``normkit.testing``'s tolerances, not
bitwise.
"""
from __future__ import annotations

from typing import Literal

import array_api_compat.torch as _xp  # the namespace, named here: dynamo warns on array_namespace's lru_cache
import torch

from normkit import norm_math
from normkit.ops import Op, Options

_ROUTES = ("inductor", "kernels")
_route = "inductor"


def compile_frozen_with(route: Literal["inductor", "kernels"]) -> str:
    """Where ``torch.compile`` sends a norm whose parameters are frozen: ``"inductor"`` (the default:
    the op as torch operations, fused with its neighbours) or ``"kernels"`` (normkit's kernels, as
    in eager mode). Returns the previous route. A compiled function recompiles when this changes.
    ``rms_norm_rope`` always compiles as torch operations (it has no custom op)."""
    global _route
    if not isinstance(route, str) or route not in _ROUTES:
        raise ValueError(f"normkit: compile_frozen_with takes one of {_ROUTES}; got {route!r}")
    previous, _route = _route, route
    return previous


def applies(x, residual, weight, bias) -> bool:
    """Whether this call, being compiled, runs as torch operations: plain tensors, no parameter
    that needs a gradient, and the route left at ``"inductor"``."""
    from torch_frontend._library_ops import subclassed

    return (_route == "inductor" and not subclassed(x, residual, weight, bias)
            and not (weight is not None and weight.requires_grad) and not (bias is not None and bias.requires_grad))


def apply(op: Op, opts: Options, x, residual, weight, bias, from_output: bool = False):
    """The op's outputs as ``functional`` returns them: y, or ``(y, residual_out)`` for the fused add."""
    if from_output and (x.requires_grad or (residual is not None and residual.requires_grad)):
        return _FromOutput.apply(op, opts, *_distinct(x, residual, weight, bias))
    y, s, _, _ = norm_math.forward(x, residual, weight, bias, is_rms=op.is_rms, eps=opts.eps, offset=opts.offset,
                                   casting=opts.casting, xp=_xp)
    return (y, s) if op.has_residual else y


class _FromOutput(torch.autograd.Function):
    """A frozen norm in torch operations whose backward reads its output: x_hat = (y - b) / w."""

    @staticmethod
    def forward(ctx, op: Op, opts: Options, x, residual, weight, bias):
        x, residual = _written(x), _written(residual)
        y, s, _, rstd = norm_math.forward(x, residual, weight, bias, is_rms=op.is_rms, eps=opts.eps,
                                          offset=opts.offset, casting=opts.casting, xp=_xp)
        ctx.op, ctx.opts = op, opts
        ctx.save_for_backward(y, weight, bias, rstd)
        # Returned as views (same storage, no copy): traced by dynamo on torch 2.11 (the eager, aot_eager
        # and inductor backends alike), an autograd.Function output returned as the tensor itself (y,
        # which is saved, and the fused add's s) receives a zero gradient in the backward, and a view
        # the right one (docs/PERFORMANCE_RECORD.md, "the compiled output-saving route").
        out = y.view_as(y)
        if not op.has_residual:
            return out
        return out, (s if s is None else s.view_as(s))

    @staticmethod
    def backward(ctx, dy, ds=None):
        y, weight, bias, rstd = ctx.saved_tensors
        op, opts = ctx.op, ctx.opts
        dx = norm_math.output_backward(y, weight, bias, dy, ds, rstd, is_rms=op.is_rms, offset=opts.offset,
                                       casting=opts.casting, xp=_xp).to(y.dtype)
        # dx for x and residual whether or not each needs it (autograd drops what is not needed): under
        # dynamo, needs_input_grad need not count the non-tensor arguments op and opts
        return None, None, dx, dx if op.has_residual else None, None, None


def _distinct(*tensors) -> list:
    """The tensors, a repeated one (the fused add's residual tied to x, a weight tied to the bias) as a
    view of itself: dynamo traces no ``autograd.Function`` given one tensor twice."""
    out: list = []
    for t in tensors:
        out.append(t.view_as(t) if t is not None and any(t is u for u in out) else t)
    return out


def _written(t):
    """``t`` itself, as a view Inductor must read from memory: its lowering of ``as_strided`` writes a
    pointwise producer out once. Keeping x, a saved x is written anyway; keeping y, nothing else asks
    for it, and a residual stream (``h = h + branch``, read by the norm and the next add) is recomputed
    inside each norm's kernel from up to five earlier buffers (docs/PERFORMANCE_RECORD.md, "Where the
    compiled output-saving step's time goes")."""
    return None if t is None else torch.as_strided(t, t.size(), t.stride())
