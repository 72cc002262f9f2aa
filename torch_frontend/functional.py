"""The Torch frontend: one ``torch.autograd.Function`` per op over the shared Triton kernels.

Which gradients the backward computes comes from ``ctx.needs_input_grad``: a frozen weight, bias or
input turns its COMPUTE_* flag off, so its work, its fp32 partial buffer and its reduction launch
disappear. Inputs are flattened to 2-D rows before the autograd boundary and reshaped after it.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from normkit import checks
from normkit import launch as plans
from torch_frontend import _launch

__all__ = ["rms_norm", "layer_norm", "fused_add_rms_norm", "NormkitCopyWarning"]


class NormkitCopyWarning(UserWarning):
    """An input could not be viewed as rows with a contiguous last dimension and was copied."""


# ---------------------------------------------------------------------------------------------
# Launch helpers: 2-D rows in, 2-D rows out. Absent results are None.


def _as_rows(t: torch.Tensor, name: str, *, warn: bool = True) -> torch.Tensor:
    D = t.shape[-1]
    if D > 1 and t.stride(-1) != 1:
        if warn:
            warnings.warn(
                f"normkit: {name} of shape {tuple(t.shape)} has strides {t.stride()}; its last dimension is not "
                "contiguous, so it is copied", NormkitCopyWarning, stacklevel=4)
        t = t.contiguous()
    try:
        return t.view(-1, D)
    except RuntimeError:
        if warn:
            warnings.warn(
                f"normkit: {name} of shape {tuple(t.shape)} with strides {t.stride()} cannot be viewed as rows "
                "of one stride, so it is copied", NormkitCopyWarning, stacklevel=4)
        return t.reshape(-1, D)


def _norm_fwd(x, residual, weight, bias, op, eps, offset, casting, store_stats):
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    s = torch.empty((M, N), dtype=x.dtype, device=x.device) if residual is not None else None
    stats = torch.empty((M,), dtype=torch.float32, device=x.device) if store_stats else None
    mean = torch.empty((M,), dtype=torch.float32, device=x.device) if store_stats and op == "layer_norm" else None
    if M == 0:
        return y, s, mean, stats
    strides = {"stride_x": x.stride(0), "stride_r": residual.stride(0) if residual is not None else N,
               "stride_y": N}
    call = plans.plan_forward(op=op, M=M, N=N, x_dtype=_launch.dtype_name(x.dtype), has_w=weight is not None,
                              has_b=bias is not None, eps=eps, offset=offset, casting=casting,
                              store_stats=store_stats, strides=strides, num_sms=_launch.num_sms(x.device))
    out = _launch.run(call, {"X": x, "R": residual, "W": weight, "B": bias}, x.device)
    return out["Y"], out.get("S"), out.get("MEAN"), out.get("RSTD")


def _norm_bwd(x, weight, dy, dres, mean, rstd, op, offset, casting, need_dx, need_dw, need_db, w_dtype, b_dtype):
    M, N = x.shape
    if not (need_dx or need_dw or need_db):
        return None, None, None
    dy = _as_rows(dy, "dy", warn=False)  # autograd's gradients may be expanded (stride 0): copy those
    dres = _as_rows(dres, "d_residual", warn=False) if dres is not None else None
    if M == 0:
        dx = torch.empty((0, N), dtype=x.dtype, device=x.device) if need_dx else None
        dw = torch.zeros((N,), dtype=w_dtype, device=x.device) if need_dw else None
        db = torch.zeros((N,), dtype=b_dtype, device=x.device) if need_db else None
        return dx, dw, db
    strides = {"stride_x": x.stride(0), "stride_dy": dy.stride(0),
               "stride_dres": dres.stride(0) if dres is not None else N}
    call = plans.plan_backward(op=op, M=M, N=N, x_dtype=_launch.dtype_name(x.dtype), has_w=weight is not None,
                               has_dres=dres is not None, offset=offset, casting=casting, compute_dx=need_dx,
                               compute_dw=need_dw, compute_db=need_db, num_sms=_launch.num_sms(x.device),
                               strides=strides)
    arrays = {"X": x, "W": weight, "DY": dy, "DRES": dres, "MEAN": mean, "RSTD": rstd}
    out = _launch.run(call, arrays, x.device)
    red = plans.plan_reduce(call, w_dtype=_launch.dtype_name(w_dtype) if need_dw else None,
                            b_dtype=_launch.dtype_name(b_dtype) if need_db else None)
    if red is not None:
        out.update(_launch.run(red, out, x.device))
    return out.get("DX"), out.get("DW"), out.get("DB")


# torch.compile sees the launches as opaque custom ops (no graph break, no tracing into Triton
# glue); eager calls skip the dispatcher and launch directly. Both run the same code.

def _empty_if_none(t, like):
    return t if t is not None else like.new_empty((0,))


@torch.library.custom_op("normkit::norm_fwd", mutates_args=())
def _norm_fwd_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], op: str, eps: float, offset: float, casting: str,
                 store_stats: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    outs = _norm_fwd(x, residual, weight, bias, op, eps, offset, casting, store_stats)
    return tuple(_empty_if_none(t, x) for t in outs)


@_norm_fwd_op.register_fake
def _(x, residual, weight, bias, op, eps, offset, casting, store_stats):
    M, N = x.shape
    y = x.new_empty((M, N))
    s = x.new_empty((M, N)) if residual is not None else x.new_empty((0,))
    rstd = x.new_empty((M,), dtype=torch.float32) if store_stats else x.new_empty((0,))
    mean = x.new_empty((M,), dtype=torch.float32) if store_stats and op == "layer_norm" else x.new_empty((0,))
    return y, s, mean, rstd


@torch.library.custom_op("normkit::norm_bwd", mutates_args=())
def _norm_bwd_op(x: torch.Tensor, weight: Optional[torch.Tensor], dy: torch.Tensor, dres: Optional[torch.Tensor],
                 mean: Optional[torch.Tensor], rstd: torch.Tensor, op: str, offset: float, casting: str,
                 need_dx: bool, need_dw: bool, need_db: bool, w_dtype: torch.dtype,
                 b_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    outs = _norm_bwd(x, weight, dy, dres, mean, rstd, op, offset, casting, need_dx, need_dw, need_db, w_dtype,
                     b_dtype)
    return tuple(_empty_if_none(t, x) for t in outs)


@_norm_bwd_op.register_fake
def _(x, weight, dy, dres, mean, rstd, op, offset, casting, need_dx, need_dw, need_db, w_dtype, b_dtype):
    M, N = x.shape
    dx = x.new_empty((M, N)) if need_dx else x.new_empty((0,))
    dw = x.new_empty((N,), dtype=w_dtype) if need_dw else x.new_empty((0,))
    db = x.new_empty((N,), dtype=b_dtype) if need_db else x.new_empty((0,))
    return dx, dw, db


def _fwd(x, residual, weight, bias, op, eps, offset, casting, store_stats):
    if not torch.compiler.is_compiling():
        return _norm_fwd(x, residual, weight, bias, op, eps, offset, casting, store_stats)
    y, s, mean, rstd = torch.ops.normkit.norm_fwd(x, residual, weight, bias, op, eps, offset, casting, store_stats)
    return (y, s if residual is not None else None, mean if store_stats and op == "layer_norm" else None,
            rstd if store_stats else None)


def _bwd(x, weight, dy, dres, mean, rstd, op, offset, casting, need_dx, need_dw, need_db, w_dtype, b_dtype):
    if not torch.compiler.is_compiling():
        return _norm_bwd(x, weight, dy, dres, mean, rstd, op, offset, casting, need_dx, need_dw, need_db,
                         w_dtype, b_dtype)
    dx, dw, db = torch.ops.normkit.norm_bwd(x, weight, dy, dres, mean, rstd, op, offset, casting, need_dx, need_dw,
                                            need_db, w_dtype, b_dtype)
    return dx if need_dx else None, dw if need_dw else None, db if need_db else None


# ---------------------------------------------------------------------------------------------
# One autograd.Function per op.

_F32 = torch.float32


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting, store_stats):
        y, _, _, rstd = _fwd(x, None, weight, None, "rms_norm", eps, offset, casting, store_stats)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.casting = offset, casting
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw, _ = _bwd(x, weight, dy, None, None, rstd, "rms_norm", ctx.offset, ctx.casting, need_dx, need_dw,
                         False, weight.dtype if weight is not None else _F32, _F32)
        return dx, dw, None, None, None, None


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, store_stats):
        y, _, mean, rstd = _fwd(x, None, weight, bias, "layer_norm", eps, 0.0, "gemma", store_stats)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.b_dtype = bias.dtype if bias is not None else _F32
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = _bwd(x, weight, dy, None, mean, rstd, "layer_norm", 0.0, "gemma", need_dx, need_dw, need_db,
                          weight.dtype if weight is not None else _F32, ctx.b_dtype)
        return dx, dw, db, None, None


class FusedAddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting, store_stats):
        ctx.set_materialize_grads(False)
        y, s, _, rstd = _fwd(x, residual, weight, None, "fused_add_rms_norm", eps, offset, casting, store_stats)
        ctx.save_for_backward(s, weight, rstd)
        ctx.offset, ctx.casting = offset, casting
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, weight, rstd = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_dw = ctx.needs_input_grad[2]
        if dy is None:
            if ds is None:
                return None, None, None, None, None, None, None
            dy = torch.zeros_like(s)  # only residual_out was used: y's gradient is exactly zero
        dx, dw, _ = _bwd(s, weight, dy, ds, None, rstd, "fused_add_rms_norm", ctx.offset, ctx.casting, need_dx,
                         need_dw, False, weight.dtype if weight is not None else _F32, _F32)
        dres = dx if ctx.needs_input_grad[1] else None
        dx = dx if ctx.needs_input_grad[0] else None
        return dx, dres, dw, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Public functions.


def _check(x, *, weight=None, bias=None, residual=None, eps, offset=0.0, casting_mode="gemma"):
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"normkit: {name} must be a torch.Tensor; got {type(t).__name__}")
    spec = lambda t: None if t is None else (tuple(t.shape), _launch.dtype_name(t.dtype))  # noqa: E731
    checks.check(x_shape=tuple(x.shape), x_dtype=_launch.dtype_name(x.dtype), weight=spec(weight), bias=spec(bias),
                 residual=spec(residual), eps=eps, offset=offset, casting_mode=casting_mode)
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and t.device != x.device:
            raise ValueError(f"normkit: {name} is on {t.device} but x is on {x.device}; all tensors must share a device")
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"normkit: x is on {x.device}; normkit runs on CUDA (compiled) or CPU (interpreted)")


def _needs_stats(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6, *, offset: float = 0.0,
             casting_mode: str = "llama") -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2) + eps) * (weight + offset)``.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16; rows may be strided if the last dim is contiguous.
        weight: ``(D,)`` of any float dtype, or None for no elementwise scale.
        eps: added to the mean square.
        offset: added to the weight (Gemma: 1.0).
        casting_mode: ``"llama"`` (normalize in fp32, round to x.dtype, then scale), ``"gemma"`` (all fp32,
            round at the end) or ``"none"`` (products rounded to x.dtype).

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.rms_norm``.
    """
    _check(x, weight=weight, eps=eps, offset=offset, casting_mode=casting_mode)
    x2d = _as_rows(x, "x")
    y = RMSNormFunction.apply(x2d, weight, float(eps), float(offset), casting_mode, _needs_stats(x, weight))
    return y.view(x.shape)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``, computed in fp32.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16.
        weight, bias: ``(D,)`` of any float dtype, or None.
        eps: added to the variance.

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.layer_norm``.
    """
    _check(x, weight=weight, bias=bias, eps=eps)
    x2d = _as_rows(x, "x")
    y = LayerNormFunction.apply(x2d, weight, bias, float(eps), _needs_stats(x, weight, bias))
    return y.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor] = None,
                       eps: float = 1e-6, *, offset: float = 0.0,
                       casting_mode: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to x.dtype) and ``y = rms_norm(s)``, in one pass.

    Returns:
        ``(y, residual_out)`` where ``residual_out = s``; both ``(..., D)`` in x.dtype. x and residual
        must share shape and dtype. See ``rms_norm`` for the options.
    """
    _check(x, weight=weight, residual=residual, eps=eps, offset=offset, casting_mode=casting_mode)
    x2d, r2d = _as_rows(x, "x"), _as_rows(residual, "residual")
    y, s = FusedAddRMSNormFunction.apply(x2d, r2d, weight, float(eps), float(offset), casting_mode,
                                         _needs_stats(x, residual, weight))
    return y.view(x.shape), s.view(x.shape)
