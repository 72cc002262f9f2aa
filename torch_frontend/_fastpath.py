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

import torch

from normkit import driver
from normkit.ops import Grads, Op, Options
from torch_frontend import _rows
from torch_frontend._backend import BACKEND, dtype_name
from torch_frontend._ops import subclassed


def meta(t) -> tuple | None:
    """What a plan fixes of a tensor: class, shape, strides, dtype and device."""
    return None if t is None else (t.__class__, t.shape, t.stride(), t.dtype, t.device)


class Bound:
    """One call signature's forward plan, and its backward plans per (gradients, saved and incoming layouts)."""

    __slots__ = ("op", "opts", "b_dtype", "fwd", "bwd")

    def __init__(self, op: Op, opts: Options, b_dtype: str | None, fwd):
        self.op, self.opts, self.b_dtype, self.fwd = op, opts, b_dtype, fwd
        self.bwd: dict = {}

    def forward(self, x, residual, weight, bias) -> tuple:
        return driver.launch_forward(BACKEND, self.fwd, x, residual, weight, bias, x.shape)

    def backward(self, x, weight, dy, dres, mean, rstd, grads: Grads) -> tuple:
        # autograd hands the backward gradients of the outputs' shape, dtype and device (it checks and
        # converts them), so their class and strides are all that can vary; the saved tensors may be
        # anything a saved-tensor hook returns
        key = (grads, meta(x), meta(weight), rstd.stride(), dy.__class__, dy.stride(),
               None if dres is None else (dres.__class__, dres.stride()))
        plan = self.bwd.get(key, False)
        if plan is False:
            plan = self.bwd[key] = self._plan_backward(x, weight, dy, dres, mean, rstd, grads)
        if plan is None:  # a layout that must be copied: the general path (it warns)
            return _rows.backward(self.op, x, weight, dy, dres, mean, rstd, self.opts, grads, self.b_dtype)
        return driver.launch_backward(BACKEND, plan, x, weight, dy, dres, mean, rstd, x.shape)

    def _plan_backward(self, x, weight, dy, dres, mean, rstd, grads: Grads):
        if subclassed(x, weight) or not rstd.is_contiguous() or (mean is not None and not mean.is_contiguous()):
            return None
        x_rows, dy_rows = _rows.row_view(x), _rows.row_view(dy)
        dres_rows = _rows.row_view(dres) if dres is not None else None
        if x_rows is None or dy_rows is None or (dres is not None and dres_rows is None):
            return None
        return driver.backward_plan(BACKEND, self.op, x_rows, weight, dy_rows, dres_rows, self.opts, grads,
                                    self.b_dtype)


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
    b_dtype = dtype_name(bias.dtype) if bias is not None else "float32"
    return Bound(op, opts, b_dtype, fwd)


BOUND: dict = {}
BOUND_LIMIT = 4096  # distinct call signatures kept (a model has a handful); past it, start again


def signature(op: Op, store_stats: bool, eps, offset, casting_mode, x, residual, weight, bias) -> tuple:
    """The key of ``BOUND``. Raises AttributeError or TypeError for a non-tensor or an unhashable
    option (the caller then validates, which names it)."""
    key = (op.name, store_stats, eps.__class__, eps, offset.__class__, offset, casting_mode.__class__, casting_mode,
           meta(x), meta(residual), meta(weight), meta(bias))
    hash(key)
    return key


def remember(key: tuple, bound: Bound) -> None:
    if len(BOUND) >= BOUND_LIMIT:
        BOUND.clear()
    BOUND[key] = bound
