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

The functions take NumPy arrays (and anything ``np.asarray`` reads) or torch tensors and compute in
float64: they are the float64 layer over ``normkit.norm_math``, where the math is written once for
NumPy, torch and JAX (with the kernels' rounding points for low-precision inputs). The statistics
are recomputed from x in every backward, so on torch tensors every result is differentiable.
"""
from __future__ import annotations

import numpy as np

from normkit import norm_math


def _f64(a):
    if a is None:
        return None
    if _is_torch(a):
        return a.double()
    return np.asarray(a, dtype=np.float64)


def _is_torch(a) -> bool:
    return type(a).__module__.startswith("torch") and hasattr(a, "double")


def _np64(a):
    return np.asarray(a.detach().double().cpu()) if _is_torch(a) else np.asarray(a, dtype=np.float64)


def _copy(a):
    return a.clone() if _is_torch(a) else a.copy()


def rms_norm(x, weight=None, eps=1e-6, offset=0.0):
    """y = x / sqrt(mean(x**2) + eps) * (weight + offset)."""
    return norm_math.forward(_f64(x), None, _f64(weight), None, is_rms=True, eps=eps, offset=offset)[0]


def rms_norm_bwd(x, weight, dy, eps=1e-6, offset=0.0):
    """(dx, dw) of rms_norm for the output gradient dy; dw is None without a weight."""
    dx, dw, _ = norm_math.input_backward(_f64(x), _f64(weight), _f64(dy), is_rms=True, eps=eps, offset=offset,
                                         compute_dw=weight is not None)
    return dx, dw


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias."""
    return norm_math.forward(_f64(x), None, _f64(weight), _f64(bias), is_rms=False, eps=eps)[0]


def layer_norm_bwd(x, weight, bias, dy, eps=1e-5):
    """(dx, dw, db) of layer_norm; dw and db are None where the parameter is absent."""
    return norm_math.input_backward(_f64(x), _f64(weight), _f64(dy), is_rms=False, eps=eps,
                                    compute_dw=weight is not None, compute_db=bias is not None)


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, offset=0.0):
    """(y, s) with s = x + residual and y = rms_norm(s, weight, eps, offset)."""
    y, s, _, _ = norm_math.forward(_f64(x), _f64(residual), _f64(weight), None, is_rms=True, eps=eps, offset=offset)
    return y, s


def fused_add_rms_norm_bwd(x, residual, weight, dy, ds=None, eps=1e-6, offset=0.0):
    """(dx, dresidual, dw) for the gradients dy of y and ds of s (None means zero)."""
    s = _f64(x) + _f64(residual)
    dx, dw, _ = norm_math.input_backward(s, _f64(weight), _f64(dy), _f64(ds), is_rms=True, eps=eps, offset=offset,
                                         compute_dw=weight is not None)
    return dx, _copy(dx), dw


def rms_norm_rope(x, weight, cos, sin, eps=1e-6, offset=0.0, interleaved=False):
    """out = R(rms_norm(x, weight, eps, offset)), ``R(y) = y * cos + rotate(y) * sin`` (HF's
    ``apply_rotary_pos_emb`` with cos and sin broadcast against x; ``rotate`` is ``rotate_half``, or
    GPT-J's pairs (2i, 2i + 1) when ``interleaved``): ``normkit.norm_math.rms_norm_rope_forward``."""
    return norm_math.rms_norm_rope_forward(_f64(x), _f64(weight), _f64(cos), _f64(sin), eps=eps, offset=offset,
                                           interleaved=interleaved)[0]


def rms_norm_rope_bwd(x, weight, cos, sin, dout, eps=1e-6, offset=0.0, interleaved=False):
    """(dx, dw) of rms_norm_rope for the output gradient dout (cos and sin are constants); dw is None
    without a weight."""
    return norm_math.rms_norm_rope_input_backward(_f64(x), _f64(weight), _f64(cos), _f64(sin), _f64(dout), eps=eps,
                                                  offset=offset, interleaved=interleaved,
                                                  compute_dw=weight is not None)


def rope_table_rows(cos, sin, shape, interleaved=False, x_dtype=None, casting=None):
    """Per row of an x of ``shape`` (bool, ``shape[:-1]``), whether a pair of its table columns fails
    ``norm_math.rope_table_usable`` (the rows the output-saving backward gives a NaN dx), in float64
    from the tables as the forward multiplies by them: rounded to ``x_dtype`` first under casting
    ``norm_math.Casting.INPUT_DTYPE`` (casting_mode "none"). NumPy's booleans, from any input."""
    c, s = _np64(cos), _np64(sin)
    if casting == norm_math.Casting.INPUT_DTYPE and x_dtype is not None:
        c, s = (norm_math._round(np, t, norm_math._namespace_dtype(np, x_dtype)) for t in (c, s))
    return norm_math.rope_table_rows(c, s, shape, interleaved=interleaved, xp=np)


def rope_table_ratio(cos, sin, interleaved=False):
    """Per column, its pair's ``r = 2 |det| / (c_a^2 + s_a^2 + c_b^2 + s_b^2)`` in float64 (1 for a
    rotation; a pair is usable where ``r >= norm_math.ROPE_TABLE_RATIO``): for tests that keep away
    from the boundary, where fp32 and float64 may round r to either side."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return norm_math.rope_table_ratio(_np64(cos), _np64(sin), interleaved=interleaved, xp=np)
