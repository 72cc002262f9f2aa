"""The ``torch.autograd.Function`` of each op: ``RMSNormFunction``, ``LayerNormFunction``,
``FusedAddRMSNormFunction``.

Each takes a *route* and the op's own tensors (autograd's host time grows with every argument it
handles). The route runs the passes: an eager call's ``normkit.driver.Bound`` (its bound plans), or,
under ``torch.compile`` and for tensor subclasses, a ``Traced`` route through the torch.library ops
(``_library_ops``). Which gradients the backward computes comes from ``ctx.needs_input_grad``: a
frozen weight, bias or input turns its COMPUTE_* flag off, so its work, its fp32 partial buffer and
its reduction launch disappear.

What the forward keeps for the backward is the route's ``from_output`` (``_save``): the input (the
fused add's sum s), or, with every parameter frozen, the output y and the weight's recovery (in
RSTD after the rows, or, on a ``Traced`` route, a tensor of its own), from which the backward
recovers x_hat; then the input need not stay alive. The decision belongs to the node: its backward
reads what its own forward kept.

A gradient that will itself be differentiated (``create_graph=True``: gradient penalties, Hessian
products) is computed with differentiable torch operations instead of the kernels: the float64 math
of ``normkit.norm_math`` on the saved input, rounded to the inputs' dtypes, so that every route of
autograd sees the right second-order terms. A norm that kept its output cannot be differentiated
twice (the statistics it would need are gone): that raises, naming ``save="input"``. A batched output
gradient (``autograd.grad(..., is_grads_batched=True)``, a vectorized ``autograd.functional.jacobian``)
has no storage a kernel could read: it takes differentiable torch operations too, which vmap
batches. Tensors handed back by a saved-tensor hook, and incoming gradients, are read as their
values whatever their dtype, device, strides or lazy negation (``_saved``, ``_incoming``). An eager
backward launches without converting only what a launch bound before has read as it is: found first
by a C++ check that its arrays have the layouts of the arrays that launch last read (``_checked``),
else by the full key of their layouts.

Under compiled autograd (``torch._dynamo.compiled_autograd``), which traces the backward of an eager
forward, the backward runs through the torch.library ops, as a ``Traced`` route's does.

Inputs keep the caller's shape ``(..., D)`` across the Function (the bound launches allocate the
outputs in it), so no view is recorded: the fused add's x and residual, which share one gradient,
receive separate tensors, and their ``.grad`` never alias.
"""
from __future__ import annotations

import dataclasses
import operator

import array_api_compat.torch as _xp  # named, not looked up: dynamo warns on array_namespace's lru_cache
import torch

from normkit import norm_math
from normkit.ops import GRADS, Grads, Op, Options, rec_offset
from torch_frontend import _compat, _library_ops
from torch_frontend._backend import TORCH_DTYPES, resolve_neg
from torch_frontend._backend import backward_key


@dataclasses.dataclass(frozen=True)
class Traced:
    """The route of a call under ``torch.compile`` or on tensor subclasses: the torch.library ops."""

    op: Op
    opts: Options
    store_stats: bool
    from_output: bool
    b_dtype: str  # dB's dtype (the bias's; float32 without one)

    def forward(self, x, residual, weight, bias) -> tuple:
        return _library_ops.forward(self.op, x, residual, weight, bias, self.opts, self.store_stats,
                                    self.from_output)


def _traced_backward(route, saved, weight, bias, dy, dres, mean, rstd, rec, flags: tuple) -> tuple:
    """The backward through the torch.library ops (a ``Traced`` route's; an eager route's under
    compiled autograd, its recovery split off the rows' statistics)."""
    if route.from_output and rec is None:  # an eager forward's: the recovery follows the rows in rstd
        M = saved.numel() // max(saved.shape[-1], 1)
        rstd, rec = rstd[:M].view(saved.shape[:-1]), rstd[rec_offset(M):]
    return _library_ops.backward(route.op, saved, weight, bias, dy, dres, mean, rstd, rec, route.opts, GRADS[flags],
                                 TORCH_DTYPES[route.b_dtype], route.from_output)


class RMSNormFunction(torch.autograd.Function):
    """``forward(route, x, weight)``: ``rms_norm`` by ``route`` (a ``Bound`` or a ``Traced``)."""

    @staticmethod
    def forward(ctx, route, x, weight):
        y, _, _, rstd, rec, _ = route.forward(x, None, weight, None)
        ctx.route = route
        ctx.save_for_backward(y if route.from_output else x, weight, None, rec, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        needs = ctx.needs_input_grad  # (route, x, weight)
        dx, dw, _ = _backward(ctx, (needs[1], needs[2], False), dy, None)
        return None, dx, dw


class LayerNormFunction(torch.autograd.Function):
    """``forward(route, x, weight, bias)``: ``layer_norm`` by ``route``."""

    @staticmethod
    def forward(ctx, route, x, weight, bias):
        y, _, mean, rstd, rec, _ = route.forward(x, None, weight, bias)
        ctx.route = route
        if route.from_output:
            ctx.save_for_backward(y, weight, bias, rec, rstd)
        else:
            ctx.save_for_backward(x, weight, None, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        needs = ctx.needs_input_grad  # (route, x, weight, bias)
        return None, *_backward(ctx, (needs[1], needs[2], needs[3]), dy, None)


class FusedAddRMSNormFunction(torch.autograd.Function):
    """``forward(route, x, residual, weight)``: ``fused_add_rms_norm`` by ``route``; x and residual get
    equal gradients, as separate tensors."""

    @staticmethod
    def forward(ctx, route, x, residual, weight):
        y, s, _, rstd, rec, _ = route.forward(x, residual, weight, None)
        ctx.route = route
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(y if route.from_output else s, weight, None, rec, rstd)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        needs = ctx.needs_input_grad  # (route, x, residual, weight)
        dx, dw, _ = _backward(ctx, (needs[1] or needs[2], needs[3], False), dy, ds)
        # one tensor for both: autograd hands a gradient used twice to each input as its own copy
        return None, dx if needs[1] else None, dx if needs[2] else None, dw


class WithCopyFunction(torch.autograd.Function):
    """``forward(route, copy, x, residual, weight, bias)``: the op's outputs by an eager ``route`` (a
    ``Bound``), followed by y in the dtype ``copy[0]`` (an exact widening: the same values as
    ``y.to(copy[0])``), for consumers that would each convert y to that dtype (PEFT's LoRA layers,
    ``torch_frontend.patch``). A route bound with that dtype (``Bound.y2_dtype``) has its forward kernel
    store the copy beside y, in the same pass (Y2); otherwise (x's own dtype: y itself) y is converted.
    Where the route keeps the output and ``copy[1]`` says the consumers keep that copy for their own
    backward, the norm keeps the copy instead of y: nothing of its own. The backward adds the copy's
    gradient to y's in fp32."""

    @staticmethod
    def forward(ctx, route, copy, x, residual, weight, bias):
        y, s, mean, rstd, rec, y2 = route.forward(x, residual, weight, bias)
        if y2 is None:
            y2 = y.to(copy[0])
        ctx.route, ctx.y_dtype = route, y.dtype
        ctx.set_materialize_grads(False)
        if route.from_output:
            ctx.save_for_backward(y2 if copy[1] else y, weight, bias, rec, rstd)
        else:
            ctx.save_for_backward(x if residual is None else s, weight, None, mean, rstd)
        return (y, s, y2) if residual is not None else (y, y2)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad  # (route, copy, x, residual, weight, bias)
        dy, ds, dy2 = grads if len(grads) == 3 else (grads[0], None, grads[1])
        if dy2 is not None:  # y's gradient and its copy's, summed in the copy's (wider) dtype (promotion)
            dy = (dy2 if dy is None else dy2 + dy).to(ctx.y_dtype)
        dx, dw, db = _backward(ctx, (needs[2] or needs[3], needs[4], needs[5]), dy, ds)
        return None, None, dx if needs[2] else None, dx if needs[3] else None, dw, db


# "direct": an eager call with no torch.func transform active enters each Function's C apply
# (``_compat.direct_apply``); "python": always torch's ``Function.apply``. "direct" is the default by
# the same-process host A/B of the two recorded in docs/PERFORMANCE_RECORD.md (its section on the
# Functions' C apply).
APPLY = "direct"
_DIRECT_RMS, _DIRECT_LN, _DIRECT_ADD = (_compat.direct_apply(fn) for fn in
                                        (RMSNormFunction, LayerNormFunction, FusedAddRMSNormFunction))


def apply_eager(route, op: Op, x, residual, weight, bias):
    """``apply`` of an eager route (a ``Bound``) where the caller has seen that nothing is being
    compiled and no torch.func transform is active: through each Function's C apply
    (``_compat.direct_apply``) where ``APPLY`` says so."""
    if APPLY == "direct" and _DIRECT_RMS is not None:
        unwrap = _compat.unwrap_exited  # a tensor left by an exited transform, as Function.apply does
        x, weight = unwrap(x), weight if weight is None else unwrap(weight)
        if op.has_residual:
            return _DIRECT_ADD(route, x, unwrap(residual), weight)
        if op.params == ("weight",):
            return _DIRECT_RMS(route, x, weight)
        return _DIRECT_LN(route, x, weight, bias if bias is None else unwrap(bias))
    return apply(route, op, x, residual, weight, bias)


def apply(route, op: Op, x, residual, weight, bias, copy=None):
    """The op's outputs through its Function: y, or ``(y, residual_out)``; with ``copy`` (an eager
    route's ``(dtype, keep)``), y's copy in that dtype follows them (``WithCopyFunction``)."""
    if copy is not None:
        return WithCopyFunction.apply(route, copy, x, residual, weight, bias)
    if (route.__class__ is not Traced and APPLY == "direct" and _DIRECT_RMS is not None
            and not torch.compiler.is_compiling() and not _compat.transforms_active()):
        return apply_eager(route, op, x, residual, weight, bias)
    if op.has_residual:
        return FusedAddRMSNormFunction.apply(route, x, residual, weight)
    if op.params == ("weight",):
        return RMSNormFunction.apply(route, x, weight)
    return LayerNormFunction.apply(route, x, weight, bias)


def _saved(route, tensors: tuple, dy, ds, traced: bool) -> tuple:
    """``(saved, weight, bias, mean, rstd, rec)`` as the kernels read them, from a node's unpacked saved
    ``tensors`` (``route``'s): the saved rows (a kept output also as its float32 widening) in the dtype
    and on the device of the gradients arriving (the output's), the per-row statistics (and the
    weight's recovery) contiguous, in fp32, on their device.

    A saved-tensor hook may hand back other tensors than were saved: in another dtype (one that
    widens or compresses what it stores), on another device (one that offloads), as a strided view,
    or as a lazily negated view. A launch bound to the compiled kernel of fp32 statistics would
    misread wider ones, a kernel reads a strided buffer as contiguous and a negated view's raw memory
    without its sign, and it cannot read host memory. The statistics are one number per row, so
    moving or copying them costs little; the rows are converted back only when a hook changed them.
    ``traced``: under ``torch.compile``, where dynamo reads values, not raw memory, and bans
    ``is_neg``."""
    saved, weight, bias, aux, rstd = tensors
    mean, rec = (None, aux) if route.from_output else (aux, None)
    like = dy if dy is not None else ds
    # (dtypes are singletons: ``is`` compares them; ``get_device`` compares devices without making
    # device objects, and is -1 for every CPU tensor)
    if like is not None and (saved.dtype is not like.dtype or saved.get_device() != like.get_device()) and not (
            route.from_output and saved.dtype is torch.float32 and saved.get_device() == like.get_device()):
        # (a kept output in float32, e.g. the fp32 copy PEFT's adapters keep, ``WithCopyFunction``, is
        # read as it is: the output-keeping backward rounds nothing to its dtype)
        saved = saved.to(like.device, like.dtype)
    if not traced and (saved.is_neg() or (weight is not None and weight.is_neg())
                       or (bias is not None and bias.is_neg())):
        saved = resolve_neg(saved, "the saved input")
        weight, bias = resolve_neg(weight, "the saved weight"), resolve_neg(bias, "the saved bias")
    device = saved.get_device()
    rstd = _statistic(rstd, saved, device, traced)
    if mean is not None:
        mean = _statistic(mean, saved, device, traced)
    if rec is not None:
        rec = _statistic(rec, saved, device, traced)
    return saved, weight, bias, mean, rstd, rec


def _statistic(t, like, device: int, traced: bool):
    if t.dtype is not torch.float32 or t.get_device() != device:
        t = t.to(like.device, torch.float32)
    if not traced and t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def _row_statistic(rstd, saved):
    """The per-row rstd in the rows' leading shape (an eager output-keeping forward's rstd is followed
    by the weight's recovery in one buffer)."""
    M = saved.numel() // max(saved.shape[-1], 1)
    return rstd if rstd.numel() == M else rstd[:M].view(saved.shape[:-1])


def _incoming(dy, ds) -> tuple:
    """``(dy, ds, batched)``: the gradients arriving at the backward, with a lazy negation applied
    (autograd hands them on as the caller made them: ``z.conj().imag`` or ``torch._neg_view`` carry
    their sign as a flag that a kernel reading the memory would not see), and whether one is batched
    by ``autograd.grad(..., is_grads_batched=True)`` or a vectorized ``autograd.functional.jacobian``:
    a tensor without storage, which no kernel can read. Eager only: dynamo bans ``is_neg``."""
    batched = False
    if dy is not None:
        if dy.is_neg():
            dy = resolve_neg(dy, "the output gradient")
        batched = _compat.is_legacy_batched(dy)
    if ds is not None:
        if ds.is_neg():
            ds = resolve_neg(ds, "the gradient of residual_out")
        batched = batched or _compat.is_legacy_batched(ds)
    return dy, ds, batched


SECOND_ORDER_ERROR = (
    "normkit: this norm kept its output rather than its input for the backward (save='auto' with every "
    "parameter frozen, or save='output'), and a gradient computed from the output cannot be differentiated "
    "again (create_graph=True): call the norm with save='input' to take second derivatives")


def _backward(ctx, flags: tuple, dy, ds) -> tuple:
    """``(dx, dweight, dbias)`` of the gradients ``flags`` (``(dx, dw, db)``) asks for, from the saved
    tensors: by the route's kernels, or, under ``create_graph=True`` with something to differentiate
    or for a batched gradient, by differentiable torch operations."""
    route = ctx.route
    traced = torch.compiler.is_compiling()
    tensors = ctx.saved_tensors  # unpacked once (a checkpoint's hooks allow no second unpacking)
    if dy is not None and not traced and route.__class__ is not Traced and not torch.is_grad_enabled():
        # an eager node's backward whose arrays a launch has read as they are before: found by a check
        # of their layouts against the arrays that launch last read (``_checked``), or else by one
        # lookup of their keys (``driver.Bound.bound_backward``); either only where nothing needs
        # converting
        saved, weight, bias, aux, rstd = tensors
        # aux: the recovery after an output-keeping forward, else the mean (read with no bias)
        bias, mean, rec = (bias, None, aux) if route.from_output else (None, aux, None)
        one = ds is None or ds is dy  # one incoming gradient to check (a check passes no tensor twice)
        short = (flags, ds is None, one)
        checked = route.bound_backward(short)
        if checked is not None:
            pick, check, launch = checked
            if check(*pick(tensors), dy) if one else check(*pick(tensors), dy, ds):
                return launch(saved, weight, bias, dy, ds, mean, rstd, rec)
        if not (_compat.is_legacy_batched(dy) or (ds is not None and _compat.is_legacy_batched(ds))):
            launch = route.bound_backward(backward_key(flags, saved, weight, bias, aux, rstd, dy, ds))
            if launch is not None:
                if checked is None and _compat.LAYOUT_CHECKS:
                    route.keep_backward(short, (*_checked(tensors, dy, ds, one), launch))
                return launch(saved, weight, bias, dy, ds, mean, rstd, rec)
    batched = False
    if not traced:
        dy, ds, batched = _incoming(dy, ds)
    saved, weight, bias, mean, rstd, rec = _saved(route, tensors, dy, ds, traced)
    if dy is None and ds is None:
        return None, None, None
    if batched:  # one backward per batch element: torch operations vmap over them
        return differentiable_backward(route, saved, weight, bias, dy, ds, _row_statistic(rstd, saved), GRADS[flags])
    if torch.is_grad_enabled():  # only under create_graph=True
        if any(t is not None and t.requires_grad for t in (dy, ds, saved, weight)):
            if route.from_output:
                raise RuntimeError(SECOND_ORDER_ERROR)
            return differentiable_backward(route, saved, weight, bias, dy, ds, rstd, GRADS[flags])
        with torch.no_grad():
            return _kernel_backward(route, flags, saved, weight, bias, dy, ds, mean, rstd, rec, traced)
    return _kernel_backward(route, flags, saved, weight, bias, dy, ds, mean, rstd, rec, traced)


def _checked(tensors: tuple, dy, ds, one: bool) -> tuple:
    """``(pick, check)``: ``check(*pick(tensors), dy)`` (``one``: no ds, or ds is dy) or ``check(*pick(tensors),
    dy, ds)`` is True only where a backward's unpacked saved ``tensors`` and incoming gradients are arrays
    of these ones' layouts (``_compat.layout_check``: dtype, device, sizes, strides, lazy negation,
    batching), one for one; a launch that read these reads those as they are. ``pick`` takes the
    saved tensors that are not None (a slot saved as None is handed back as None, never through a
    hook)."""
    pick = operator.itemgetter(*[i for i, t in enumerate(tensors) if t is not None])
    return pick, _compat.layout_check((*pick(tensors), dy) if one else (*pick(tensors), dy, ds))


def _kernel_backward(route, flags: tuple, saved, weight, bias, dy, ds, mean, rstd, rec, traced: bool) -> tuple:
    if dy is None:  # only residual_out was used: y's gradient is exactly zero
        dy = torch.zeros_like(saved)
    if traced or route.__class__ is Traced:  # compiled (compiled autograd too), or a tensor subclass's
        return _traced_backward(route, saved, weight, bias, dy, ds, mean, rstd, rec, flags)
    return route.backward(saved, weight, bias, dy, ds, mean, rstd, flags, rec)


def differentiable_backward(route, saved, weight, bias, dy, ds, rstd, grads: Grads) -> tuple:
    """``(dx, dweight, dbias)`` as differentiable torch operations in float64, rounded to the inputs'
    dtypes: ``normkit.norm_math.input_backward`` on the saved input (its statistics recomputed from it,
    so that they are differentiated too), or, for a norm that kept its output,
    ``norm_math.output_backward`` (first order only: its statistics are the forward's)."""
    op, opts = route.op, route.opts
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    if dy is None:
        dy = torch.zeros_like(saved)
    if route.from_output:
        dx = norm_math.output_backward(f64(saved), f64(weight), f64(bias), f64(dy), f64(ds), rstd.double(),
                                       is_rms=op.is_rms, offset=opts.offset, casting=opts.casting, xp=_xp)
        dw = db = None
    else:
        dx, dw, db = norm_math.input_backward(f64(saved), f64(weight), f64(dy), f64(ds), is_rms=op.is_rms,
                                              eps=opts.eps, offset=opts.offset, compute_dx=grads.dx,
                                              compute_dw=grads.dw, compute_db=grads.db, xp=_xp)
    return (dx.to(saved.dtype) if grads.dx else None, dw.to(weight.dtype) if grads.dw else None,
            db.to(TORCH_DTYPES[route.b_dtype]) if grads.db else None)
