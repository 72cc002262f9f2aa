"""The eager fast path: a call signature validated and planned once, launched directly after that.

A call signature is the op, its options, and each tensor's class, shape, strides, dtype and device.
Its first eager call validates it and binds the driver's plans to it (``bind``); a repeated call (a
training loop's) finds them in ``BOUND`` and launches them through the driver without validating,
planning or reshaping again, with its outputs allocated in the caller's shape. The plans are the
driver's own, so results are those of the general path, bitwise.

A backward plan fixes the layouts of every tensor it reads: the saved x and weight as well as the
incoming gradients. A ``saved_tensors_hooks`` (activation offloading, ``save_on_cpu``) may hand the
backward other tensors than the forward saw, so the backward plans are keyed on all of them.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from normkit import driver
from normkit.launch import KernelCall
from normkit.ops import Grads, Op, Options
from torch_frontend import _rows
from torch_frontend._backend import BACKEND, dtype_name
from torch_frontend._ops import subclassed


class BoundBackward(NamedTuple):
    """A backward plan (``driver.backward_plan``: the launch and the reduction or None) and its bound
    launch ``(x, weight, dy, dres, mean, rstd) -> (dx, dweight, dbias)``."""

    call: KernelCall
    reduce: KernelCall | None
    launch: Callable


class Bound:
    """One call signature's forward plan, and its backward plans per (gradients, saved and incoming layouts).

    ``forward(x, residual, weight, bias) -> (y, residual_out, mean, rstd)`` launches the forward plan
    ``fwd``; ``backward`` finds (or makes) the backward plan of its arguments' layouts in ``bwd``.
    """

    __slots__ = ("op", "opts", "store_stats", "b_dtype", "bias_dtype", "fwd", "forward", "bwd")

    def __init__(self, op: Op, opts: Options, store_stats: bool, bias_dtype: torch.dtype, fwd, x):
        self.op, self.opts, self.store_stats, self.fwd = op, opts, store_stats, fwd
        self.bias_dtype, self.b_dtype = bias_dtype, dtype_name(bias_dtype)  # dB's dtype (fp32 without a bias)
        self.forward = driver.bind_forward(BACKEND, fwd, x, x.shape)
        self.bwd: dict = {}

    def backward(self, x, weight, dy, dres, mean, rstd, flags: tuple) -> tuple:
        """``(dx, dweight, dbias)``; ``flags``: the ``(dx, dw, db)`` a ``Grads`` holds."""
        # autograd hands the backward gradients of the outputs' shape, dtype and device (it checks and
        # converts them), so their class and strides are all that can vary; the saved tensors may be
        # anything a saved-tensor hook returns
        key = (flags, x.__class__, x.shape, x.stride(), x.dtype, x.device,
               None if weight is None else (weight.__class__, weight.shape, weight.stride(), weight.dtype,
                                            weight.device),
               None if mean is None else mean.stride(), rstd.stride(), dy.__class__, dy.stride(),
               None if dres is None else (dres.__class__, dres.stride()))
        plan = self.bwd.get(key, False)
        if plan is False:
            plan = self.bwd[key] = self._plan_backward(x, weight, dy, dres, mean, rstd, Grads(*flags))
        if plan is None:  # a layout that must be copied: the general path (it warns)
            return _rows.backward(self.op, x, weight, dy, dres, mean, rstd, self.opts, Grads(*flags), self.b_dtype)
        return plan.launch(x, weight, None, dy, dres, mean, rstd)

    def _plan_backward(self, x, weight, dy, dres, mean, rstd, grads: Grads) -> BoundBackward | None:
        if subclassed(x, weight) or not rstd.is_contiguous() or (mean is not None and not mean.is_contiguous()):
            return None
        x_rows, dy_rows = _rows.row_view(x), _rows.row_view(dy)
        dres_rows = _rows.row_view(dres) if dres is not None else None
        if x_rows is None or dy_rows is None or (dres is not None and dres_rows is None):
            return None
        plan = driver.backward_plan(BACKEND, self.op, x_rows, weight, dy_rows, dres_rows, self.opts, grads,
                                    self.b_dtype)
        if plan is None:
            return None
        return BoundBackward(*plan, driver.bind_backward(BACKEND, plan, x, x.shape))


def bind(op: Op, opts: Options, store_stats: bool, x, residual, weight, bias) -> Bound | None:
    """The bound plans of a validated call, or None where the general path must run (tensor
    subclasses, no rows, layouts that are copied)."""
    if subclassed(x, residual, weight, bias) or x.numel() == 0:
        return None
    x_rows, r_rows = _rows.row_view(x), (_rows.row_view(residual) if residual is not None else None)
    if x_rows is None or (residual is not None and r_rows is None):
        return None
    fwd = driver.forward_plan(BACKEND, op, x_rows, r_rows, weight, bias, opts, store_stats)
    if fwd is None:
        return None
    return Bound(op, opts, store_stats, bias.dtype if bias is not None else torch.float32, fwd, x)


BOUND: dict = {}
BOUND_LIMIT = 4096  # distinct call signatures kept (a model has a handful); past it, start again


def lookup(op: Op, eps, offset, casting_mode, x, residual, weight, bias) -> tuple:
    """``(key, bound)``: the call's key in ``BOUND`` and its bound plans, or None where not bound yet;
    ``(None, None)`` where the call must not be bound (a lazily negated input, which is copied).
    Raises AttributeError or TypeError for a non-tensor or an unhashable option (the caller then
    validates, which names it).

    The key: the op, whether the forward stores statistics for a backward (grad mode on and an input
    requiring grad), each option with its class (``1e-6`` and ``np.float64(1e-6)`` are validated
    apart), and what a plan fixes of each tensor: class, shape, strides, dtype and device."""
    store_stats = torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and (
        x.requires_grad or (residual is not None and residual.requires_grad)
        or (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad))
    key = (op.name, store_stats, eps.__class__, eps, offset.__class__, offset, casting_mode.__class__, casting_mode,
           x.__class__, x.shape, x.stride(), x.dtype, x.device,
           None if residual is None else (residual.__class__, residual.shape, residual.stride(), residual.dtype,
                                          residual.device),
           None if weight is None else (weight.__class__, weight.shape, weight.stride(), weight.dtype, weight.device),
           None if bias is None else (bias.__class__, bias.shape, bias.stride(), bias.dtype, bias.device))
    bound = BOUND.get(key)  # hashes the key: raises TypeError for an unhashable option
    if x.is_neg() or (residual is not None and residual.is_neg()) or (weight is not None and weight.is_neg()) or (
            bias is not None and bias.is_neg()):
        return None, None
    return key, bound


def remember(key: tuple, bound: Bound) -> None:
    if len(BOUND) >= BOUND_LIMIT:
        BOUND.clear()
    BOUND[key] = bound
