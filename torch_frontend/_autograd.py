"""The ``torch.autograd.Function``s of the three ops.

``NormFunction`` takes a call's op, options and (where bound) plans as arguments: the first call of
a signature, and every call under ``torch.compile`` or on tensor subclasses. A repeated eager call
goes through its op's ``Bound*`` Function instead, whose one extra argument, the ``_fastpath.Bound``,
holds the rest: autograd's host time grows with every argument it handles.

Which gradients the backward computes comes from ``ctx.needs_input_grad``: a frozen weight, bias or
input turns its COMPUTE_* flag off, so its work, its fp32 partial buffer and its reduction launch
disappear.

A gradient that will itself be differentiated (``create_graph=True``: gradient penalties, Hessian
products) is computed with differentiable torch operations instead of the kernels: the float64 math
of ``normkit.norm_math`` on the saved tensors, rounded to the inputs' dtypes. Every route of
autograd then sees the right second-order terms (``.backward()``, ``autograd.grad`` with
``inputs``, ``backward(inputs=...)``). Without ``create_graph`` the kernels compute every gradient.

Inputs are flattened to 2-D rows *inside* the Function, and its gradients reshaped there: had the
flattening views been recorded by autograd, the fused add's x and residual (which share one
gradient) would receive two views of one buffer, and their ``.grad`` would alias.
"""
from __future__ import annotations

import array_api_compat.torch as _xp  # named, not looked up: dynamo warns on array_namespace's lru_cache
import torch

from normkit import norm_math
from normkit.ops import Grads, Op, Options
from torch_frontend import _ops

GRADS = {(dx, dw, db): Grads(dx, dw, db) for dx in (False, True) for dw in (False, True) for db in (False, True)}


class NormFunction(torch.autograd.Function):
    """``forward(op, opts, store_stats, bound, x, residual, weight, bias)`` over any leading shape;
    ``bound``: the call signature's ``_fastpath.Bound`` plans (eager fast path), or None."""

    @staticmethod
    def forward(ctx, op: Op, opts: Options, store_stats: bool, bound, x, residual, weight, bias):
        if bound is not None:
            y, s, mean, rstd = bound.forward(x, residual, weight, bias)
        else:
            y, s, mean, rstd = _ops.forward(op, x, residual, weight, bias, opts, store_stats)
        ctx.op, ctx.opts, ctx.bound = op, opts, bound
        ctx.b_dtype = bias.dtype if bias is not None else torch.float32
        if op.has_residual:
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(s, weight, mean, rstd)
            return y, s
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy, ds=None):
        needs = ctx.needs_input_grad  # (op, opts, store_stats, bound, x, residual, weight, bias)
        x, weight, mean, rstd = _saved(ctx)
        dx, dw, db = _backward(ctx.op, ctx.opts, ctx.bound, ctx.b_dtype, (needs[4] or needs[5], needs[6], needs[7]),
                               x, weight, mean, rstd, dy, ds)
        return (None, None, None, None, dx if needs[4] else None, dx if needs[5] else None, dw, db)


class BoundRMSNorm(torch.autograd.Function):
    """``forward(bound, x, weight)``: ``rms_norm`` by its ``_fastpath.Bound`` plans, for a repeated eager
    call. One Function per op (this one, ``BoundLayerNorm``, ``BoundFusedAddRMSNorm``) hands autograd
    only the op's own arguments: each one more costs host time in the forward and the backward."""

    @staticmethod
    def forward(ctx, bound, x, weight):
        return _bound_forward(ctx, bound, x, weight, None)

    @staticmethod
    def backward(ctx, dy):
        needs = ctx.needs_input_grad  # (bound, x, weight)
        dx, dw, _ = _bound_backward(ctx, (needs[1], needs[2], False), dy, None)
        return None, dx, dw


class BoundLayerNorm(torch.autograd.Function):
    """``forward(bound, x, weight, bias)``: ``layer_norm`` by its bound plans (see ``BoundRMSNorm``)."""

    @staticmethod
    def forward(ctx, bound, x, weight, bias):
        return _bound_forward(ctx, bound, x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        needs = ctx.needs_input_grad  # (bound, x, weight, bias)
        return None, *_bound_backward(ctx, (needs[1], needs[2], needs[3]), dy, None)


class BoundFusedAddRMSNorm(torch.autograd.Function):
    """``forward(bound, x, residual, weight)``: ``fused_add_rms_norm`` by its bound plans (see
    ``BoundRMSNorm``)."""

    @staticmethod
    def forward(ctx, bound, x, residual, weight):
        y, s, mean, rstd = bound.forward(x, residual, weight, None)
        ctx.bound = bound
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(s, weight, mean, rstd)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        needs = ctx.needs_input_grad  # (bound, x, residual, weight)
        dx, dw, _ = _bound_backward(ctx, (needs[1] or needs[2], needs[3], False), dy, ds)
        return None, dx if needs[1] else None, dx if needs[2] else None, dw


def _saved(ctx) -> tuple:
    """``(x, weight, mean, rstd)`` as saved, the per-row statistics in fp32 on x's device, as the kernels
    read them. A saved-tensor hook may hand them back in another dtype (one that widens or compresses
    what it stores), or on another device (one that offloads them): a launch bound to the compiled
    kernel of fp32 statistics would read such a buffer as fp32, and a kernel cannot read host memory.
    The statistics are one number per row, so moving them costs little."""
    x, weight, mean, rstd = ctx.saved_tensors
    if rstd.dtype != torch.float32 or rstd.device != x.device:
        rstd = rstd.to(x.device, torch.float32)
    if mean is not None and (mean.dtype != torch.float32 or mean.device != x.device):
        mean = mean.to(x.device, torch.float32)
    return x, weight, mean, rstd


def _bound_forward(ctx, bound, x, weight, bias):
    """y of ``BoundRMSNorm`` / ``BoundLayerNorm`` (bias None for RMSNorm), with what the backward reads
    saved."""
    y, _, mean, rstd = bound.forward(x, None, weight, bias)
    ctx.bound = bound
    ctx.save_for_backward(x, weight, mean, rstd)
    return y


def _bound_backward(ctx, flags: tuple, dy, ds) -> tuple:
    """``(dx, dweight, dbias)`` of a ``Bound*`` Function: its bound backward plans, except where
    ``_backward`` has more to do (create_graph=True, or only residual_out's gradient)."""
    bound = ctx.bound
    x, weight, mean, rstd = _saved(ctx)
    if dy is not None and not torch.is_grad_enabled():  # the common case: the bound kernels
        return bound.backward(x, weight, dy, ds, mean, rstd, flags)
    return _backward(bound.op, bound.opts, bound, bound.bias_dtype, flags, x, weight, mean, rstd, dy, ds)


def _backward(op: Op, opts: Options, bound, b_dtype: torch.dtype, flags: tuple, x, weight, mean, rstd, dy,
              ds) -> tuple:
    """``(dx, dweight, dbias)`` of the gradients ``flags`` (``(dx, dw, db)``) asks for, from the saved
    tensors: by the kernels (the bound plans where there are), or, under ``create_graph=True`` with
    something to differentiate, by ``differentiable_backward``."""
    if dy is None and ds is None:
        return None, None, None
    # Grad mode is on only under create_graph=True.
    if torch.is_grad_enabled():
        if any(t is not None and t.requires_grad for t in (dy, ds, x, weight)):
            return differentiable_backward(op, opts, x, weight, dy, ds, GRADS[flags], b_dtype)
        with torch.no_grad():
            return _kernel_backward(op, opts, bound, b_dtype, flags, x, weight, dy, ds, mean, rstd)
    return _kernel_backward(op, opts, bound, b_dtype, flags, x, weight, dy, ds, mean, rstd)


def _kernel_backward(op: Op, opts: Options, bound, b_dtype: torch.dtype, flags: tuple, x, weight, dy, ds, mean,
                     rstd) -> tuple:
    if dy is None:  # only residual_out was used: y's gradient is exactly zero
        dy = torch.zeros_like(x)
    if bound is not None:
        return bound.backward(x, weight, dy, ds, mean, rstd, flags)
    return _ops.backward(op, x, weight, dy, ds, mean, rstd, opts, GRADS[flags], b_dtype)


def differentiable_backward(op: Op, opts: Options, x, weight, dy, ds, grads: Grads, b_dtype: torch.dtype) -> tuple:
    """``(dx, dweight, dbias)`` as differentiable torch operations: the float64 math of
    ``normkit.norm_math.input_backward`` on ``x`` (the fused add's saved sum), rounded to the inputs'
    dtypes. The statistics are recomputed from ``x`` rather than read from the forward's, so that they
    are differentiated too."""
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    if dy is None:
        dy = torch.zeros_like(x)
    dx, dw, db = norm_math.input_backward(f64(x), f64(weight), f64(dy), f64(ds), is_rms=op.is_rms, eps=opts.eps,
                                          offset=opts.offset, compute_dx=grads.dx, compute_dw=grads.dw,
                                          compute_db=grads.db, xp=_xp)
    return (dx.to(x.dtype) if grads.dx else None, dw.to(weight.dtype) if grads.dw else None,
            db.to(b_dtype) if grads.db else None)
