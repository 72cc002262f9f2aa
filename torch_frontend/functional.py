"""The Torch frontend: one ``torch.autograd.Function`` over ``normkit.driver`` serves the three ops.

Which gradients the backward computes comes from ``ctx.needs_input_grad``: a frozen weight, bias or
input turns its COMPUTE_* flag off, so its work, its fp32 partial buffer and its reduction launch
disappear.

A repeated eager call (same shapes, strides, dtypes, devices and options) skips validation and
planning: its plans were bound at the first call (``_BOUND``, ``_apply``), and its outputs are
allocated in the caller's shape.

Inputs are flattened to 2-D rows *inside* the Function, and its gradients reshaped there: had the
flattening views been recorded by autograd, the fused add's x and residual (which share one
gradient) would receive two views of one buffer, and their ``.grad`` would alias. (The custom ops
take the caller's shape too, so that a DTensor's placements apply to it as the user sees it.)
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Optional

import torch

from normkit import checks, driver
from normkit.ops import FUSED_ADD_RMS_NORM, LAYER_NORM, OPS, RMS_NORM, Casting, Grads, Op, Options
from torch_frontend._backend import BACKEND, INDUCTOR_BACKEND, TORCH_DTYPES, dtype_name

__all__ = ["rms_norm", "layer_norm", "fused_add_rms_norm", "NormkitCopyWarning"]


class NormkitCopyWarning(UserWarning):
    """An input could not be viewed as rows with a contiguous (or broadcast) last dimension and was copied."""


def _row_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[M, D]`` rows without a copy (its last dimension contiguous or broadcast, its leading
    dimensions one stride), or None where that needs a copy."""
    D = t.shape[-1]
    if D > 1 and t.stride(-1) not in (0, 1):
        return None
    try:
        return t.view(-1, D)
    except RuntimeError:
        return None


def _as_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` as ``[M, D]`` rows with column stride 0 or 1; a copy (with a warning) only if it must."""
    rows = _row_view(t)
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


# ---------------------------------------------------------------------------------------------
# The driver over any leading shape, reached three ways:
# - eager, plain tensors: called directly (no dispatcher);
# - ``torch.compile`` on CUDA: through the ``torch.library.triton_op`` ops ``normkit::norm_fwd_cuda``
#   / ``normkit::norm_bwd_cuda``, whose launches go through ``wrap_triton``: Inductor emits the
#   kernels into its generated code, and CUDA graphs capture them;
# - tensor subclasses (DTensor), and ``torch.compile`` on CPU or with dynamic shapes: through the
#   opaque custom ops ``normkit::norm_fwd`` / ``normkit::norm_bwd`` with fake (meta)
#   implementations; DTensor dispatches them to its local shards (torch_frontend/_dtensor.py
#   registers their sharding).
# Row tensors keep the caller's shape ``(..., D)``; the per-row statistics have shape ``(...)``.

_FWD_RESULTS = ("Y", "S", "MEAN", "RSTD")
_BWD_RESULTS = ("DX", "DW", "DB")


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # what the eager path launches on directly


def _subclassed(*tensors) -> bool:
    """A tensor subclass (DTensor, FakeTensor, ...) among ``tensors``; a module's ``nn.Parameter`` is plain."""
    return any(t is not None and type(t) not in _PLAIN for t in tensors)


def _route(x, *tensors) -> tuple | None:
    """The ``(forward, backward)`` ops a call goes through: None in eager mode (the driver directly, so
    module calls skip the dispatcher), the triton ops when compiling plain CUDA tensors of static
    shape, the opaque custom ops otherwise (tensor subclasses; compiling on CPU or with symbolic
    shapes)."""
    if not torch.compiler.is_compiling():
        return (torch.ops.normkit.norm_fwd, torch.ops.normkit.norm_bwd) if _subclassed(x, *tensors) else None
    # Symbolic shapes cannot be told apart here (dynamo answers isinstance(SymInt, int) with True); the
    # triton ops hand such calls to the opaque ops themselves (_fwd_body / _bwd_body).
    if x.device.type == "cuda" and not _subclassed(x, *tensors) and _triton_ops_registered():
        return torch.ops.normkit.norm_fwd_cuda, torch.ops.normkit.norm_bwd_cuda
    return torch.ops.normkit.norm_fwd, torch.ops.normkit.norm_bwd


def _absent(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


def _shaped(t: torch.Tensor | None, shape) -> torch.Tensor | None:
    """Rows ``t`` in the caller's shape, as a tensor of its own rather than a view of an internal
    buffer (autograd forbids in-place ops on a custom Function's view outputs: ``y *= 2`` must work)."""
    if t is None or t.shape == shape:
        return t
    return t.view(shape).detach()


def _nd_shape(name: str, shape: tuple, buffer_shape: tuple) -> tuple:
    """A buffer's shape over the caller's leading shape: rows (M, N) -> shape, statistics (M,) -> shape[:-1]."""
    if len(buffer_shape) == 2 and name not in ("DW_PART", "DB_PART"):
        return tuple(shape)
    if name in ("MEAN", "RSTD"):
        return tuple(shape[:-1])
    return tuple(buffer_shape)


def _forward_nd(op: Op, x, residual, weight, bias, opts: Options, store_stats: bool, backend=BACKEND) -> tuple:
    shape = x.shape
    r2d = _as_rows(residual, "residual") if residual is not None else None
    outs = driver.forward(backend, op, _as_rows(x, "x"), r2d, weight, bias, opts, store_stats)
    lead = shape[:-1]
    return (_shaped(outs[0], shape), _shaped(outs[1], shape), _shaped(outs[2], lead), _shaped(outs[3], lead))


def _backward_nd(op: Op, x, weight, dy, dres, mean, rstd, opts: Options, grads: Grads, b_dtype: str | None,
                 backend=BACKEND) -> tuple:
    shape = x.shape
    rows = lambda t: t.reshape(-1) if t is not None else None  # noqa: E731  (statistics: contiguous, a view)
    dres2d = _as_rows(dres, "the residual_out gradient") if dres is not None else None
    dx, dw, db = driver.backward(backend, op, _as_rows(x, "x"), weight, _as_rows(dy, "the output gradient"), dres2d,
                                 rows(mean), rows(rstd), opts, grads, b_dtype)
    return (dx.view(shape) if dx is not None else None), dw, db


def _symbolic(x: torch.Tensor) -> bool:
    """Sizes that are SymInts (``torch.compile(dynamic=True)``): no plan can be sized from them. Run
    inside an op's body (fake-tensor tracing), where a SymInt is not an int, unlike in dynamo's trace."""
    return not all(isinstance(d, int) for d in x.shape)


def _fwd_body(backend):
    def norm_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], op: str, eps: float, offset: float, casting: int,
                 store_stats: bool) -> list[torch.Tensor]:
        """(y, residual_out, mean, rstd); an absent result is an empty (0,) tensor."""
        if backend is INDUCTOR_BACKEND and _symbolic(x):  # the triton op, traced with symbolic shapes
            return torch.ops.normkit.norm_fwd(x, residual, weight, bias, op, eps, offset, casting, store_stats)
        outs = _forward_nd(OPS[op], x, residual, weight, bias, Options(eps, offset, Casting(casting)), store_stats,
                           backend)
        return [t if t is not None else _absent(x) for t in outs]
    return norm_fwd


def _bwd_body(backend):
    def norm_bwd(x: torch.Tensor, weight: Optional[torch.Tensor], dy: torch.Tensor, dres: Optional[torch.Tensor],
                 mean: Optional[torch.Tensor], rstd: torch.Tensor, op: str, offset: float, casting: int,
                 dx: bool, dw: bool, db: bool, b_dtype: torch.dtype) -> list[torch.Tensor]:
        """(dx, dweight, dbias); a result not asked for is an empty (0,) tensor."""
        if backend is INDUCTOR_BACKEND and _symbolic(x):
            return torch.ops.normkit.norm_bwd(x, weight, dy, dres, mean, rstd, op, offset, casting, dx, dw, db, b_dtype)
        outs = _backward_nd(OPS[op], x, weight, dy, dres, mean, rstd, Options(0.0, offset, Casting(casting)),
                            Grads(dx, dw, db), dtype_name(b_dtype), backend)
        return [t if t is not None else _absent(x) for t in outs]
    return norm_bwd


_norm_fwd_op = torch.library.custom_op("normkit::norm_fwd", _fwd_body(BACKEND), mutates_args=())
_norm_bwd_op = torch.library.custom_op("normkit::norm_bwd", _bwd_body(BACKEND), mutates_args=())


@_norm_fwd_op.register_fake
def _(x, residual, weight, bias, op, eps, offset, casting, store_stats):
    M, N = x.numel() // max(x.shape[-1], 1), x.shape[-1]
    specs = OPS[op].fwd_buffers(M, N, dtype_name(x.dtype), store_stats)
    return [x.new_empty(_nd_shape(name, x.shape, specs[name][0]), dtype=TORCH_DTYPES[specs[name][1]])
            if name in specs else _absent(x) for name in _FWD_RESULTS]


@_norm_bwd_op.register_fake
def _(x, weight, dy, dres, mean, rstd, op, offset, casting, dx, dw, db, b_dtype):
    M, N = x.numel() // max(x.shape[-1], 1), x.shape[-1]
    w_dtype = dtype_name(weight.dtype) if weight is not None else None
    specs = OPS[op].bwd_buffers(M, N, dtype_name(x.dtype), Grads(dx, dw, db), w_dtype, dtype_name(b_dtype))
    return [x.new_empty(_nd_shape(name, x.shape, specs[name][0]), dtype=TORCH_DTYPES[specs[name][1]])
            if name in specs else _absent(x) for name in _BWD_RESULTS]


_TRITON_OPS: list = []


def _triton_ops_registered() -> bool:
    """Registers ``normkit::norm_fwd_cuda`` / ``normkit::norm_bwd_cuda`` (the custom ops' schema, as
    ``torch.library.triton_op``) on first use. Registering imports torch._dynamo (1.4 s), so it waits
    for the first compilation. Dynamo runs this function as it is rather than tracing it (what
    ``torch.compiler.assume_constant_result`` marks; the mark is set by hand because that function
    imports torch._dynamo too)."""
    if not _TRITON_OPS:
        _TRITON_OPS.append(torch.library.triton_op("normkit::norm_fwd_cuda", _fwd_body(INDUCTOR_BACKEND),
                                                   mutates_args=()))
        _TRITON_OPS.append(torch.library.triton_op("normkit::norm_bwd_cuda", _bwd_body(INDUCTOR_BACKEND),
                                                   mutates_args=()))
    return True


_triton_ops_registered._dynamo_marked_constant = True  # torch._dynamo.decorators.assume_constant_result


def _forward(op: Op, x, residual, weight, bias, opts: Options, store_stats: bool) -> tuple:
    ops = _route(x, residual, weight, bias)
    if ops is None:
        return _forward_nd(op, x, residual, weight, bias, opts, store_stats)
    outs = ops[0](x, residual, weight, bias, op.name, opts.eps, opts.offset, int(opts.casting), store_stats)
    present = op.fwd_buffers(1, 1, "float32", store_stats)
    return tuple(t if name in present else None for name, t in zip(_FWD_RESULTS, outs))


def _backward(op: Op, x, weight, dy, dres, mean, rstd, opts: Options, grads: Grads, b_dtype: torch.dtype) -> tuple:
    ops = _route(x, weight, dy, dres)
    if ops is None:
        return _backward_nd(op, x, weight, dy, dres, mean, rstd, opts, grads, dtype_name(b_dtype))
    outs = ops[1](x, weight, dy, dres, mean, rstd, op.name, opts.offset, int(opts.casting), grads.dx, grads.dw,
                  grads.db, b_dtype)
    return tuple(t if want else None for t, want in zip(outs, (grads.dx, grads.dw, grads.db)))


# ---------------------------------------------------------------------------------------------
# The autograd.Function.

DOUBLE_BACKWARD_ERROR = (
    "normkit: differentiating normkit's gradient (double backward, e.g. a gradient penalty built with "
    "create_graph=True) is not supported: the backward kernels have no derivative of their own. Use "
    "torch.nn.functional's norms for that part of the model.")


class NormFunction(torch.autograd.Function):
    """``forward(op, opts, store_stats, bound, x, residual, weight, bias)`` over any leading shape;
    ``bound``: the call signature's ``_Bound`` plans (eager fast path), or None."""

    @staticmethod
    def forward(ctx, op: Op, opts: Options, store_stats: bool, bound, x, residual, weight, bias):
        if bound is not None:
            y, s, mean, rstd = bound.forward(x, residual, weight, bias)
        else:
            y, s, mean, rstd = _forward(op, x, residual, weight, bias, opts, store_stats)
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
        grads = _GRADS[needs[4] or needs[5], needs[6], needs[7]]
        x, weight, mean, rstd = ctx.saved_tensors
        if dy is None and ds is None:
            return (None,) * 8
        # Grad mode is on only under create_graph=True: then the kernels' results must refuse to be
        # differentiated again, and run without recording.
        grad_mode = torch.is_grad_enabled()
        twice = grad_mode and any(t is not None and t.requires_grad for t in (dy, ds, x, weight))
        with torch.no_grad() if grad_mode else _NO_CONTEXT:
            if dy is None:  # only residual_out was used: y's gradient is exactly zero
                dy = torch.zeros_like(x)
            if ctx.bound is not None:
                dx, dw, db = ctx.bound.backward(x, weight, dy, ds, mean, rstd, grads)
            else:
                dx, dw, db = _backward(ctx.op, x, weight, dy, ds, mean, rstd, ctx.opts, grads, ctx.b_dtype)
        results = [dx if needs[4] else None, dx if needs[5] else None, dw, db]
        if twice:
            results = _delayed_error(results)
        return (None, None, None, None, *results)


_GRADS = {(dx, dw, db): Grads(dx, dw, db) for dx in (False, True) for dw in (False, True) for db in (False, True)}
_NO_CONTEXT = contextlib.nullcontext()


def _delayed_error(results: list) -> list:
    """Gradients that raise DOUBLE_BACKWARD_ERROR if they are differentiated (instead of silently
    acting as constants); the values are unchanged."""
    present = [t for t in results if t is not None]
    err = torch._C._functions.DelayedError(DOUBLE_BACKWARD_ERROR.encode(), len(present))
    marked = err(*[t.detach().requires_grad_() for t in present])
    marked = list(marked) if isinstance(marked, (tuple, list)) else [marked]
    it = iter(marked)
    return [next(it) if t is not None else None for t in results]


# ---------------------------------------------------------------------------------------------
# Public functions.


def _validate(op: Op, x, residual, weight, bias, eps, offset, casting_mode) -> Options:
    """Shapes and dtypes (each ``(shape, dtype name)`` or None) and options, checked; raises naming the argument."""
    checks.check(op, x_shape=x[0], x_dtype=x[1], residual=residual, weight=weight, bias=bias)
    return op.options(eps=eps, offset=offset, casting_mode=casting_mode)


# A call validates what the last calls with the same shapes, dtypes and options already validated:
# remembered (only successes; typed, so 1e-6 and np.float64(1e-6) are checked apart).
_validated = functools.lru_cache(maxsize=256, typed=True)(_validate)


def _check(op: Op, x, *, residual=None, weight=None, bias=None, eps, offset=0.0, casting_mode="llama") -> Options:
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"normkit: {name} must be a torch.Tensor; got {type(t).__name__}")
    spec = lambda t: None if t is None else (tuple(t.shape), dtype_name(t.dtype))  # noqa: E731
    specs = (spec(x), spec(residual), spec(weight), spec(bias))
    cached = not torch.compiler.is_compiling()  # dynamo traces through caches (and warns): check plainly
    if cached:
        try:
            hash((eps, offset, casting_mode))
        except TypeError:  # not a number at all: the plain checks raise, naming it
            cached = False
    opts = (_validated if cached else _validate)(op, *specs, eps, offset, casting_mode)
    for name, t in (("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"normkit: {name} is on {t.device} but x is on {x.device}; all tensors must share a device")
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"normkit: x is on {x.device}; normkit runs on CUDA (compiled) or CPU (interpreted)")
    # Distributed (issue 12): DTensor placement checks and the custom ops' sharding registration,
    # imported only when a tensor subclass arrives (torch_frontend/_dtensor.py).
    if _subclassed(x, residual, weight, bias):
        from torch_frontend import _dtensor
        _dtensor.check(op, x, residual, weight, bias)
    return opts


def _needs_stats(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------------------------
# The eager fast path. A call signature (the op, its options, and each tensor's class, shape,
# strides, dtype and device) is validated and planned once: ``_BOUND`` keeps its plans, so a
# repeated eager call (a training loop's) launches without re-validating, re-planning or reshaping.
# Outputs are allocated in the caller's shape directly (no views of row buffers). The kernel calls
# are the driver's own plans, so results are those of the general path, bitwise.


def _meta(t) -> tuple | None:
    return None if t is None else (t.__class__, t.shape, t.stride(), t.dtype, t.device)


def _nd_allocs(call, shape) -> list:
    """``(shape, dtype)`` per output of ``call`` in out_specs order, row outputs in the caller's shape."""
    return [(_nd_shape(name, shape, spec_shape), TORCH_DTYPES[dtype])
            for name, (spec_shape, dtype) in call.out_specs.items()]


class _Bound:
    """One call signature's forward plan, and its backward plans per (gradients, dy/dres layout)."""

    __slots__ = ("op", "opts", "b_dtype", "fwd", "fwd_allocs", "bwd")

    def __init__(self, op: Op, opts: Options, b_dtype: str | None, fwd, fwd_allocs):
        self.op, self.opts, self.b_dtype, self.fwd, self.fwd_allocs = op, opts, b_dtype, fwd, fwd_allocs
        self.bwd: dict = {}

    def forward(self, x, residual, weight, bias) -> tuple:
        out = BACKEND.launch(self.fwd, {"X": x, "R": residual, "W": weight, "B": bias}, self.fwd_allocs)
        return out["Y"], out.get("S"), out.get("MEAN"), out.get("RSTD")

    def backward(self, x, weight, dy, dres, mean, rstd, grads: Grads) -> tuple:
        # autograd hands the backward gradients of the outputs' shape, dtype and device (it checks and
        # converts them), so their class and strides are all that can vary
        key = (grads, dy.__class__, dy.stride(), None if dres is None else (dres.__class__, dres.stride()))
        plan = self.bwd.get(key, False)
        if plan is False:
            plan = self.bwd[key] = self._plan_backward(x, weight, dy, dres, grads)
        if plan is None:  # a dy/dres layout that must be copied: the general path (it warns)
            return _backward_nd(self.op, x, weight, dy, dres, mean, rstd, self.opts, grads, self.b_dtype)
        call, reduce, allocs = plan
        out = BACKEND.launch(call, {"X": x, "W": weight, "DY": dy, "DRES": dres, "MEAN": mean, "RSTD": rstd}, allocs)
        if reduce is not None:
            out.update(BACKEND.launch(reduce, out))
        return out.get("DX"), out.get("DW"), out.get("DB")

    def _plan_backward(self, x, weight, dy, dres, grads: Grads):
        dy_rows, dres_rows = _row_view(dy), (_row_view(dres) if dres is not None else None)
        if dy_rows is None or (dres is not None and dres_rows is None):
            return None
        plan = driver.backward_plan(BACKEND, self.op, x.view(-1, x.shape[-1]), weight, dy_rows, dres_rows, self.opts,
                                    grads, self.b_dtype)
        if plan is None:
            return None
        call, reduce = plan
        return call, reduce, _nd_allocs(call, x.shape)


def _bind(op: Op, opts: Options, store_stats: bool, x, residual, weight, bias) -> _Bound | None:
    """The bound plans of a validated call, or None where the general path must run (tensor
    subclasses, no rows, layouts that are copied)."""
    if _subclassed(x, residual, weight, bias) or x.numel() == 0:
        return None
    x_rows, r_rows = _row_view(x), (_row_view(residual) if residual is not None else None)
    if x_rows is None or (residual is not None and r_rows is None):
        return None
    fwd = driver.forward_plan(BACKEND, op, x_rows, r_rows, weight, bias, opts, store_stats)
    if fwd is None:
        return None
    b_dtype = dtype_name(bias.dtype) if bias is not None else "float32"
    return _Bound(op, opts, b_dtype, fwd, _nd_allocs(fwd, x.shape))


_BOUND: dict = {}
_BOUND_LIMIT = 4096  # distinct call signatures kept (a model has a handful); past it, start again


def _apply(op: Op, x, residual, weight, bias, eps, offset, casting_mode):
    key = None
    if not torch.compiler.is_compiling():
        try:
            store_stats = _needs_stats(x, residual, weight, bias)
            key = (op.name, store_stats, eps.__class__, eps, offset.__class__, offset, casting_mode,
                   _meta(x), _meta(residual), _meta(weight), _meta(bias))
            bound = _BOUND.get(key)
        except (AttributeError, TypeError):  # not a tensor, or an unhashable option: the checks below name it
            key = bound = None
        if bound is not None:
            return NormFunction.apply(op, bound.opts, store_stats, bound, x, residual, weight, bias)
    opts = _check(op, x, residual=residual, weight=weight, bias=bias, eps=eps, offset=offset,
                  casting_mode=casting_mode)
    store_stats = _needs_stats(x, residual, weight, bias)
    bound = None
    if key is not None:
        bound = _bind(op, opts, store_stats, x, residual, weight, bias)
        if bound is not None:
            if len(_BOUND) >= _BOUND_LIMIT:
                _BOUND.clear()
            _BOUND[key] = bound
    return NormFunction.apply(op, opts, store_stats, bound, x, residual, weight, bias)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6, *, offset: float = 0.0,
             casting_mode: str = "llama") -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2) + eps) * (weight + offset)``.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16, any strides (rows are read in place when the last
            dimension is contiguous or broadcast; other layouts are copied with a ``NormkitCopyWarning``).
        weight: ``(D,)`` float32, bfloat16, float16 or float64, any stride (sliced and expanded weights
            are read in place), or None for no elementwise scale.
        eps: added to the mean square; a Python number.
        offset: added to the weight (Gemma: 1.0).
        casting_mode: ``"llama"`` (normalize in fp32, round to x.dtype, then scale), ``"gemma"`` (all fp32,
            round at the end) or ``"none"`` (products rounded to x.dtype).

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.rms_norm``.
    """
    return _apply(RMS_NORM, x, None, weight, None, eps, offset, casting_mode)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``, computed in fp32.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16 (layouts as in ``rms_norm``).
        weight, bias: ``(D,)`` float32, bfloat16, float16 or float64, any stride, or None.
        eps: added to the variance; a Python number.

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.layer_norm``.
    """
    return _apply(LAYER_NORM, x, None, weight, bias, eps, 0.0, "llama")


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor] = None,
                       eps: float = 1e-6, *, offset: float = 0.0,
                       casting_mode: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to x.dtype) and ``y = rms_norm(s)``, in one pass.

    Returns:
        ``(y, residual_out)`` where ``residual_out = s``; both ``(..., D)`` in x.dtype. x and residual
        must share shape and dtype; they receive equal gradients, in separate tensors. See ``rms_norm``
        for the options.
    """
    return _apply(FUSED_ADD_RMS_NORM, x, residual, weight, None, eps, offset, casting_mode)
