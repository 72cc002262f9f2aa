r"""The float64 NumPy reference: the specification of every op, forward and backward.

All arrays have shape (..., D); statistics are taken over the last axis. ``w_eff = weight + offset``
(``offset = 1`` gives Gemma's ``1 + w``); a missing weight means ``w_eff = 1``, a missing bias ``b = 0``.

RMSNorm::

    rstd = 1 / sqrt(mean(x**2) + eps);   x_hat = x * rstd;   y = x_hat * w_eff
    g = dy * w_eff
    dx = rstd * (g - x_hat * mean(g * x_hat))
    dw = sum over rows of dy * x_hat

LayerNorm::

    mu = mean(x);   rstd = 1 / sqrt(mean((x - mu)**2) + eps);   x_hat = (x - mu) * rstd
    y = x_hat * w + b
    g = dy * w
    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
    dw = sum over rows of dy * x_hat;   db = sum over rows of dy

Fused add + RMSNorm returns ``(y, s)`` with ``s = x + residual`` and ``y = rms_norm(s)``; given the
gradients ``dy`` of y and ``ds`` of s, both x and residual receive ``ds + drms_norm(dy)``.

The casting modes change only where results are rounded to low precision, so the reference has
none: it is exact arithmetic, to which every mode converges.

The functions take NumPy arrays (and anything ``np.asarray`` reads) or torch tensors, and compute in
float64 with the arrays' own methods: on torch tensors the result is differentiable, which is how
the Torch frontend differentiates its gradient (``torch_frontend._autograd``, under
``create_graph=True``).
"""
from __future__ import annotations

import numpy as np


def _f64(a):
    if a is None:
        return None
    if _is_torch(a):
        return a.double()
    return np.asarray(a, dtype=np.float64)


def _is_torch(a) -> bool:
    return type(a).__module__.startswith("torch") and hasattr(a, "double")


def _copy(a):
    return a.clone() if _is_torch(a) else a.copy()


def _mean(a):
    return a.mean(axis=-1, keepdims=True)


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def rms_norm(x, weight=None, eps=1e-6, offset=0.0):
    """y = x / sqrt(mean(x**2) + eps) * (weight + offset)."""
    x = _f64(x)
    rstd = (_mean(x * x) + eps) ** -0.5
    y = x * rstd
    if weight is not None:
        y = y * (_f64(weight) + offset)
    return y


def rms_norm_bwd(x, weight, dy, eps=1e-6, offset=0.0):
    """(dx, dw) of rms_norm for the output gradient dy; dw is None without a weight."""
    x, dy = _f64(x), _f64(dy)
    rstd = (_mean(x * x) + eps) ** -0.5
    x_hat = x * rstd
    g = dy if weight is None else dy * (_f64(weight) + offset)
    dx = rstd * (g - x_hat * _mean(g * x_hat))
    dw = None if weight is None else _rows(dy * x_hat).sum(axis=0)
    return dx, dw


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias."""
    x = _f64(x)
    xc = x - _mean(x)
    y = xc * (_mean(xc * xc) + eps) ** -0.5
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    return y


def layer_norm_bwd(x, weight, bias, dy, eps=1e-5):
    """(dx, dw, db) of layer_norm; dw and db are None where the parameter is absent."""
    x, dy = _f64(x), _f64(dy)
    xc = x - _mean(x)
    rstd = (_mean(xc * xc) + eps) ** -0.5
    x_hat = xc * rstd
    g = dy if weight is None else dy * _f64(weight)
    dx = rstd * (g - _mean(g) - x_hat * _mean(g * x_hat))
    dw = None if weight is None else _rows(dy * x_hat).sum(axis=0)
    db = None if bias is None else _rows(dy).sum(axis=0)
    return dx, dw, db


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, offset=0.0):
    """(y, s) with s = x + residual and y = rms_norm(s, weight, eps, offset)."""
    s = _f64(x) + _f64(residual)
    return rms_norm(s, weight, eps, offset), s


def fused_add_rms_norm_bwd(x, residual, weight, dy, ds=None, eps=1e-6, offset=0.0):
    """(dx, dresidual, dw) for the gradients dy of y and ds of s (None means zero)."""
    s = _f64(x) + _f64(residual)
    dx, dw = rms_norm_bwd(s, weight, dy, eps, offset)
    if ds is not None:
        dx = dx + _f64(ds)
    return dx, _copy(dx), dw
