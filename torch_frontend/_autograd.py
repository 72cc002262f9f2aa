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
of ``normkit.reference`` on the saved tensors, rounded to the inputs' dtypes. Every route of
autograd then sees the right second-order terms (``.backward()``, ``autograd.grad`` with
``inputs``, ``backward(inputs=...)``). Without ``create_graph`` the kernels compute every gradient.

A batched output gradient (``autograd.grad(..., is_grads_batched=True)``, a vectorized
``autograd.functional.jacobian``) has no storage a kernel could read: it takes the same
differentiable torch operations, which vmap batches. Tensors handed back by a saved-tensor hook, and
incoming gradients, are read as their values whatever their dtype, device, strides or lazy negation
(``_saved``, ``_incoming``).

Inputs are flattened to 2-D rows *inside* the Function, and its gradients reshaped there: had the
flattening views been recorded by autograd, the fused add's x and residual (which share one
gradient) would receive two views of one buffer, and their ``.grad`` would alias.
"""
from __future__ import annotations

import torch

from normkit import reference
from normkit.ops import Grads, Op, Options
from torch_frontend import _ops
from torch_frontend._rows import resolve_neg

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
        dy, ds = _incoming(dy, ds)
        x, weight, mean, rstd = _saved(ctx, dy, ds)
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


def _saved(ctx, dy, ds) -> tuple:
    """``(x, weight, mean, rstd)`` as the kernels read them: x in the dtype and on the device of the
    gradients arriving (the output's), the per-row statistics contiguous, in fp32, on x's device.

    A saved-tensor hook may hand back other tensors than were saved: in another dtype (one that
    widens or compresses what it stores), on another device (one that offloads), as a strided view,
    or as a lazily negated view. A launch bound to the compiled kernel of fp32 statistics would
    misread wider ones, a kernel reads a strided buffer as contiguous and a negated view's raw memory
    without its sign, and it cannot read host memory. The statistics are one number per row, so
    moving or copying them costs little; x is converted back only when a hook changed it."""
    x, weight, mean, rstd = ctx.saved_tensors
    like = dy if dy is not None else ds
    if like is not None and (x.dtype != like.dtype or x.device != like.device):
        x = x.to(like.device, like.dtype)
    traced = torch.compiler.is_compiling()  # dynamo reads values, not raw memory, and bans is_neg there
    if not traced and (x.is_neg() or (weight is not None and weight.is_neg())):
        x, weight = resolve_neg(x, "the saved input"), resolve_neg(weight, "the saved weight")
    rstd = _statistic(rstd, x, traced)
    if mean is not None:
        mean = _statistic(mean, x, traced)
    return x, weight, mean, rstd


def _statistic(t, x, traced: bool):
    if t.dtype != torch.float32 or t.device != x.device:
        t = t.to(x.device, torch.float32)
    if not traced and t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def _incoming(dy, ds) -> tuple:
    """The gradients arriving at the backward, with a lazy negation applied (autograd hands them on
    as the caller made them: ``z.conj().imag`` or ``torch._neg_view`` carry their sign as a flag that
    a kernel reading the memory would not see)."""
    if torch.compiler.is_compiling():  # traced: dynamo reads values, not raw memory, and bans is_neg here
        return dy, ds
    if dy is not None and dy.is_neg():
        dy = resolve_neg(dy, "the output gradient")
    if ds is not None and ds.is_neg():
        ds = resolve_neg(ds, "the gradient of residual_out")
    return dy, ds


def _batched(t) -> bool:
    """A gradient batched by ``autograd.grad(..., is_grads_batched=True)`` or a vectorized
    ``autograd.functional.jacobian``: a tensor without storage, which no kernel can read."""
    return t is not None and not torch.compiler.is_compiling() and _is_legacy_batched(t)


_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


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
    dy, ds = _incoming(dy, ds)
    x, weight, mean, rstd = _saved(ctx, dy, ds)
    if dy is not None and not torch.is_grad_enabled() and not _is_legacy_batched(dy):  # the common case
        return bound.backward(x, weight, dy, ds, mean, rstd, flags)
    return _backward(bound.op, bound.opts, bound, bound.bias_dtype, flags, x, weight, mean, rstd, dy, ds)


def _backward(op: Op, opts: Options, bound, b_dtype: torch.dtype, flags: tuple, x, weight, mean, rstd, dy,
              ds) -> tuple:
    """``(dx, dweight, dbias)`` of the gradients ``flags`` (``(dx, dw, db)``) asks for, from the saved
    tensors: by the kernels (the bound plans where there are), or, under ``create_graph=True`` with
    something to differentiate, by ``differentiable_backward``."""
    if dy is None and ds is None:
        return None, None, None
    if _batched(dy) or _batched(ds):  # one backward per batch element: torch operations vmap over them
        return differentiable_backward(op, opts, x, weight, dy, ds, GRADS[flags], b_dtype)
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
    """``(dx, dweight, dbias)`` as differentiable torch operations: the reference's float64 math on
    ``x`` (the fused add's saved sum), rounded to the inputs' dtypes. The statistics are recomputed
    from ``x`` rather than read from the forward's, so that they are differentiated too."""
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    if dy is None:
        dy = torch.zeros_like(x)
    if op.is_rms:
        dx, dw = reference.rms_norm_bwd(f64(x), f64(weight), f64(dy), opts.eps, opts.offset)
        db = None
    else:
        dx, dw, db = reference.layer_norm_bwd(f64(x), f64(weight), True if grads.db else None, f64(dy), opts.eps)
    if ds is not None:
        dx = dx + f64(ds)
    return (dx.to(x.dtype) if grads.dx else None, dw.to(weight.dtype) if grads.dw else None,
            db.to(b_dtype) if grads.db else None)
