"""The Torch frontend's public functions: ``rms_norm``, ``layer_norm`` and ``fused_add_rms_norm``, and
their validation.

A call is checked (shapes, dtypes, devices, options; ``normkit.checks``, ``Op.options``) before
anything is launched, then runs through the autograd Function (``_autograd``). A repeated eager
call of the same signature skips the checks and the planning (``_fastpath``), and one that no
gradient can reach (inference: grad mode off, or no input requiring a gradient) skips the autograd
Function too. Under torch.compile
a norm whose parameters are frozen runs as torch operations that Inductor generates and fuses with
its neighbours (``_composite``); one with a trained parameter runs the kernels. The other modules of
the frontend, one job each: ``_rows`` (row views and the general path over any leading shape),
``_ops`` (the torch.library ops for torch.compile and tensor subclasses), ``_backend`` (the driver's
Torch backend), ``_dtensor`` (DTensor placements), ``modules`` and ``patch``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.autograd.forward_ad as _forward_ad

from normkit import checks
from normkit.ops import FUSED_ADD_RMS_NORM, LAYER_NORM, RMS_NORM, Op, Options
from torch_frontend import _composite, _fastpath
from torch_frontend._autograd import BoundFusedAddRMSNorm, BoundLayerNorm, BoundRMSNorm, NormFunction
from torch_frontend._backend import dtype_name
from torch_frontend._ops import forward as _ops_forward
from torch_frontend._ops import subclassed
from torch_frontend._rows import NormkitCopyWarning, resolve_neg

__all__ = ["rms_norm", "layer_norm", "fused_add_rms_norm", "NormkitCopyWarning"]

def _validate(op: Op, x, residual, weight, bias, eps, offset, casting_mode) -> Options:
    """Shapes and dtypes (each ``(shape, dtype name)`` or None) and options, checked; raises naming the argument."""
    checks.check(op, x_shape=x[0], x_dtype=x[1], residual=residual, weight=weight, bias=bias)
    return op.options(eps=eps, offset=offset, casting_mode=casting_mode)


# A call validates what the last calls with the same shapes, dtypes and options already validated:
# remembered (only successes; typed, so 1e-6 and np.float64(1e-6) are checked apart).
_validated = functools.lru_cache(maxsize=256, typed=True)(_validate)


def _check(op: Op, x, *, residual=None, weight=None, bias=None, eps, offset=0.0, casting_mode="llama") -> Options:
    """The options of a valid call; raises, naming the argument, before anything is launched."""
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"normkit: {name} must be a torch.Tensor; got {type(t).__name__}")
        if t.is_nested:
            raise TypeError(f"normkit: {name} is a nested tensor; normkit normalizes dense tensors: pad it, or call "
                            f"normkit on each component (or on {name}.values() of a jagged tensor)")
        if t.layout != torch.strided:
            raise TypeError(f"normkit: {name} has layout {t.layout}; normkit normalizes dense (torch.strided) tensors: "
                            f"pass {name}.to_dense()")
    spec = lambda t: None if t is None else (tuple(t.shape), dtype_name(t.dtype))  # noqa: E731
    specs = (spec(x), spec(residual), spec(weight), spec(bias))
    cached = not torch.compiler.is_compiling()  # dynamo traces through caches (and warns): check plainly
    if cached:
        try:
            hash((eps, offset, casting_mode))
        except TypeError:  # not a number or a name at all: the plain checks raise, naming it
            cached = False
    opts = (_validated if cached else _validate)(op, *specs, eps, offset, casting_mode)
    for name, t in (("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"normkit: {name} is on {t.device} but x is on {x.device}; all tensors must share a device")
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"normkit: x is on {x.device}; normkit runs on CUDA (compiled) or CPU (interpreted)")
    # DTensor placement checks and the custom ops' sharding registration, imported only when a tensor
    # subclass arrives (torch_frontend/_dtensor.py).
    if subclassed(x, residual, weight, bias):
        from torch_frontend import _dtensor
        _dtensor.check(op, x, residual, weight, bias)
    return opts


def _needs_stats(*tensors) -> bool:
    """A backward may come: grad mode on (and inference mode off, which records no graph even with grad
    mode turned back on inside it), and an input requiring a gradient."""
    return (torch.is_grad_enabled() and (torch.compiler.is_compiling() or not torch.is_inference_mode_enabled())
            and any(t is not None and t.requires_grad for t in tensors))  # dynamo cannot trace inference mode


def _no_transforms() -> bool:
    """No torch.func transform and no forward-mode AD level is active: there the autograd Function
    must run, since it is what raises (normkit's Functions have no jvp and no vmap rule)."""
    return not torch._C._are_functorch_transforms_active() and _forward_ad._current_level < 0


def _apply(op: Op, x, residual, weight, bias, eps, offset, casting_mode):
    """A call through an autograd Function: the op's ``Bound*`` Function with its bound plans when the
    signature is known (eager; with no gradient to come, the bound forward alone), else
    ``NormFunction``, validated first, and bound for the next call."""
    key = None
    if not torch.compiler.is_compiling():
        try:
            key, bound = _fastpath.lookup(op, eps, offset, casting_mode, x, residual, weight, bias)
        except (AttributeError, TypeError, RuntimeError):  # not a tensor, an unhashable option, or a tensor
            # without strides or sizes (sparse, mkldnn, nested): the checks below name it
            key = bound = None
        if bound is not None:
            if not bound.store_stats and _no_transforms():
                # no gradient can reach this call (grad mode off, or no input requires one): the bound
                # forward alone, without an autograd Function (whose apply costs host time)
                y, s, _, _ = bound.forward(x, residual, weight, bias)
                return (y, s) if op.has_residual else y
            # the op's own Function: autograd handles only the op's arguments
            if op is RMS_NORM:
                return BoundRMSNorm.apply(bound, x, weight)
            if op is LAYER_NORM:
                return BoundLayerNorm.apply(bound, x, weight, bias)
            if op is FUSED_ADD_RMS_NORM:
                return BoundFusedAddRMSNorm.apply(bound, x, residual, weight)
            return NormFunction.apply(op, bound.opts, bound.store_stats, bound, x, residual, weight, bias)
    opts = _check(op, x, residual=residual, weight=weight, bias=bias, eps=eps, offset=offset,
                  casting_mode=casting_mode)
    if torch.compiler.is_compiling() and _composite.applies(x, residual, weight, bias):
        return _composite.apply(op, opts, x, residual, weight, bias)  # frozen: Inductor generates it
    if not torch.compiler.is_compiling():  # dynamo cannot trace is_neg (the bit is an eager view matter)
        x, residual, weight, bias = (resolve_neg(t, name) for t, name in
                                     ((x, "x"), (residual, "residual"), (weight, "weight"), (bias, "bias")))
    store_stats = _needs_stats(x, residual, weight, bias)
    bound = None
    if key is not None:
        bound = _fastpath.bind(op, opts, store_stats, x, residual, weight, bias)
        if bound is not None:
            _fastpath.remember(key, bound)
    if not store_stats and not torch.compiler.is_compiling() and _no_transforms():
        # no gradient can reach this call: the forward alone, as the bound inference path does (under
        # inference mode with grad mode turned back on, a Function would try to save inference tensors)
        y, s, _, _ = bound.forward(x, residual, weight, bias) if bound is not None else _ops_forward(
            op, x, residual, weight, bias, opts, False)
        return (y, s) if op.has_residual else y
    return NormFunction.apply(op, opts, store_stats, bound, x, residual, weight, bias)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6, *, offset: float = 0.0,
             casting_mode: str = "llama") -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2) + eps) * (weight + offset)``.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16, any strides (rows are read in place when the last
            dimension is contiguous or broadcast; other layouts are copied with a ``NormkitCopyWarning``).
        weight: ``(D,)`` float32, bfloat16, float16 or float64, any stride (sliced and expanded weights
            are read in place), or None for no elementwise scale.
        eps: added to the mean square; a Python number >= 0 that fits in float32 (the kernels compute
            in fp32). With ``eps=0`` an all-zero row is 0/0: NaN, as in ``torch.nn.functional.rms_norm``.
        offset: added to the weight (Gemma: 1.0); a Python number that fits in float32.
        casting_mode: ``"llama"`` (normalize in fp32, round to x.dtype, then scale), ``"gemma"`` (all fp32,
            round at the end) or ``"none"`` (products rounded to x.dtype).

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.rms_norm``.

    Gradients come from the kernels, for the inputs autograd asks for. A gradient that is itself
    differentiated (``create_graph=True``) is computed with differentiable float64 torch operations
    instead (``torch_frontend._autograd``). ``torch.func`` transforms are not supported (they raise).
    """
    return _apply(RMS_NORM, x, None, weight, None, eps, offset, casting_mode)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``, computed in fp32.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16 (layouts as in ``rms_norm``).
        weight, bias: ``(D,)`` float32, bfloat16, float16 or float64, any stride, or None.
        eps: added to the variance; a Python number >= 0 that fits in float32. With ``eps=0`` a
            constant row is 0/0: NaN, as in ``torch.nn.functional.layer_norm``.

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.layer_norm``. Gradients as in
        ``rms_norm``.
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
