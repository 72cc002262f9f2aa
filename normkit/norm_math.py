r"""The norms' math, written once over an array namespace: NumPy, torch and JAX alike.

Every function takes arrays of one library and computes with its namespace ``xp``
(``array_api_compat.array_namespace``; pass ``xp=`` to skip the lookup, e.g. inside a traced
region). Rows are the last axis: arrays have shape ``(..., N)``, per-row statistics ``(...)``.
The float64 reference (``normkit.reference``), the XLA implementation (``jax_frontend._xla``),
the frozen norm under ``torch.compile`` (``torch_frontend._composite``) and the differentiable
double backward (``torch_frontend._autograd``) all call these functions; the Triton and Pallas
kernels (``normkit.kernels``) are the only other copies of the math.

Precision. Float64 inputs are computed in float64 with no rounding at all: that is the reference,
exact arithmetic, to which every casting mode converges. fp32, bf16 and fp16 inputs are computed in
fp32 with the kernels' rounding points (``Casting``): ``w_eff = weight + offset`` (1 without a
weight), ``b`` the bias (0 without one), ``mean(v) = sum(v) * (1/N)`` over a row::

    s = round(x + residual)                                   (fused add: what is normalized and stored)
    mu = mean(x);  xc = x - mu  (RMSNorm: xc = x);  rstd = 1 / sqrt(mean(xc * xc) + eps)
    INPUT_DTYPE:       x_hat = round(xc * round(rstd));  y = x_hat * round(w_eff) + b
    ROUND_NORMALIZED:  x_hat = round(xc * rstd);         y = x_hat * w_eff + b
    FP32:              x_hat = xc * rstd;                y = x_hat * w_eff + b

with ``round`` to x's dtype and y stored in x's dtype. Rounding is the one piece that depends on
the library (``_round``).

Backward from the saved input (``input_backward``; statistics as the forward saved them, or
recomputed from x, and then differentiated too on torch tensors)::

    g = dy * w_eff;   c1 = mean(g * x_hat);   c2 = mean(g)
    dx = (g - x_hat * c1) * rstd  (RMSNorm)   dx = (g - c2 - x_hat * c1) * rstd  (LayerNorm)
    dx += d_residual_out (fused add);   dw = sum over rows of dy * x_hat;   db = sum over rows of dy

(under ROUND_NORMALIZED, dw sees x_hat rounded to x's dtype, as the forward used it).

Backward from the saved output (``output_backward``, x's gradient only, weight and bias frozen).
A frozen norm need not keep x alive: x_hat comes back from y through the *recovery* of the weight
(``recovery``: ``inv = 1 / w_y`` per column, ``w_y`` the weight as the forward multiplied by it,
rounded to x's dtype under INPUT_DTYPE, and one ``poison`` value, 0 or NaN), computed once per call
from the weight and bias alone, never per row::

    x_hat = (y - b) * inv;   g = dy * w_eff;   c1 = mean(g * x_hat);   c2 = mean(g)

and dx as above, plus ``poison``: the same formulas as the input-saving backward, x_hat read from y
instead of x. It is exact enough only where x_hat can be recovered. y holds x_hat * w_y + b with a
relative error u (the unit roundoff of x's dtype: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32) and an
absolute one of TINY, the dtype's smallest subnormal (2^-24 fp16) or, where that is an fp32
subnormal, fp32's smallest normal 2^-126 (XLA on CPU, like any flush-to-zero mode, flushes fp32
subnormals to 0), so the recovered x_hat is off by about::

    u * (|x_hat| + |b / w_y|) + TINY / |w_y|

which stays a few u where ``|w_y| >= W_MIN = TINY / (4 u)`` (2^-15 fp16, 2^-120 bf16, 2^-104
fp32) and ``|b| <= OUTPUT_BIAS_RATIO * |w_y|``. In dx it becomes an error of about
``rstd * (e_j |c1| + |x_hat_j| mean(|g| e))`` for an x_hat error e: as small as dx's own rounding to
x's dtype, except where dx cancels. The one safety rule (``recovery``, ``unsafe_reason``,
``saving.decide``):

- a column is unsafe where ``w_y`` is not finite, ``|w_y| < W_MIN``, or (with a bias) ``b`` is not
  finite or ``|b| > OUTPUT_BIAS_RATIO * |w_y|``;
- y must not overflow: ``|x_hat| <= sqrt(N)`` in every row (the squares of a row of x_hat sum to at
  most N), so ``sqrt(N) (1 + 4u) max|w_y| + max|b|`` must stay below x's largest finite value
  (``FINITE_MAX``; in practice a float16 limit: a y that overflows to inf loses x_hat);
- rows must be long enough (``output_degenerate``): an RMSNorm row of 1 element and a LayerNorm row
  of 1 or 2 have x_hat = +-1 whatever x is, dx is of the order of eps alone, and x_hat recovered
  with y's error u cancels to noise there.

A weight that breaks the first two makes ``poison`` NaN, so dx is NaN everywhere: loud, never a
quietly wrong gradient. ``output_backward_safe`` and ``unsafe_reason`` answer on the host (one
reduction, one bool) for the caller that picks a backward where it can read the weight's values.
"""
from __future__ import annotations

import enum

from array_api_compat import array_namespace, is_jax_namespace


class Casting(enum.IntEnum):
    """Where the forward rounds to x's dtype (the kernels' ``CASTING`` constexpr)."""

    INPUT_DTYPE = 0  # every product rounded to x.dtype, as eager low-precision math does
    ROUND_NORMALIZED = 1  # normalize in fp32, round x_hat to x.dtype, then scale (HF Llama)
    FP32 = 2  # everything in fp32, one rounding at the end (HF Gemma; LayerNorm always)


# The unit roundoff u and the smallest subnormal of each dtype x can have (exact powers of two).
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
SMALLEST_SUBNORMAL = {"float64": 2.0**-1074, "float32": 2.0**-149, "bfloat16": 2.0**-133, "float16": 2.0**-24}
# The smallest |y| the output-saving backward can count on: x's smallest subnormal, but no less than the
# compute dtype's smallest normal, as XLA on CPU (and any flush-to-zero mode) flushes fp32 subnormals to 0.
TINY = {name: max(SMALLEST_SUBNORMAL[name], 2.0**-1022 if name == "float64" else 2.0**-126) for name in UNIT_ROUNDOFF}
# The smallest |w_eff| from which the output-saving backward recovers x_hat: TINY / (4 u).
W_MIN = {name: TINY[name] / (4 * UNIT_ROUNDOFF[name]) for name in UNIT_ROUNDOFF}
# The largest finite value of each dtype x can have (y, stored in it, must stay below).
FINITE_MAX = {"float64": 1.7976931348623157e308, "float32": 3.4028234663852886e38,
              "bfloat16": 3.3895313892515355e38, "float16": 65504.0}
# The largest |b / w_eff| at which the output-saving backward is used: y - b cancels beyond it. At this
# ratio (and |w_eff| at W_MIN) its dx, stored in x's dtype, is as accurate as the input-saving one's
# to within 10% (tests/test_math.py asserts it); the loss grows with the ratio past it.
OUTPUT_BIAS_RATIO = 2.0


# ---------------------------------------------------------------------------------------------
# The library-specific piece: rounding, and the dtypes.

def _round(xp, v, dtype):
    """``v`` (fp32, or float64) rounded to the values of ``dtype`` (round to nearest even), kept in
    v's dtype; the identity where ``dtype`` is v's own (fp32 inputs, and the exact float64 math).

    JAX uses ``lax.reduce_precision`` rather than ``astype(dtype).astype(f32)``: XLA:GPU's default
    ``xla_allow_excess_precision`` lets its simplify-fp-conversions pass delete ``f32 -> bf16 -> f32``
    round trips, which would silently turn the INPUT_DTYPE and ROUND_NORMALIZED modes into FP32.
    ``reduce_precision`` flushes what would be an fp16 subnormal to zero, so those (|v| < 2**-14) are
    rounded on the 2**-24 grid explicitly. torch and NumPy round by the conversion itself.
    """
    if v.dtype == dtype:
        return v
    if is_jax_namespace(xp):
        import jax.numpy as jnp
        from jax import lax

        fi = jnp.finfo(dtype)
        r = lax.reduce_precision(v, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
        if fi.nexp < 8:  # subnormals of a narrower exponent range (fp16): multiples of its smallest subnormal
            tiny = float(fi.smallest_subnormal)
            r = jnp.where(jnp.abs(v) < float(fi.smallest_normal), jnp.round(v / tiny) * tiny, r)
        return r
    return xp.astype(xp.astype(v, dtype), v.dtype)


def _compute_dtype(xp, dtype):
    """float64 for float64 inputs (exact, no rounding), fp32 for everything else."""
    return xp.float64 if dtype == xp.float64 else xp.float32


def _to(xp, a, dtype):
    return xp.astype(a, dtype, copy=False)


def dtype_name(dtype) -> str:
    """``"float32"``, ``"bfloat16"``, ... for a dtype of NumPy (ml_dtypes), torch or JAX, or a name."""
    if isinstance(dtype, str):
        name = dtype
    elif str(dtype).startswith("torch."):
        name = str(dtype).removeprefix("torch.")
    else:  # NumPy (ml_dtypes' bfloat16 included) and JAX dtypes and scalar types
        import numpy as np

        name = np.dtype(dtype).name
    if name not in UNIT_ROUNDOFF:
        raise TypeError(f"normkit: x's dtype must be one of {sorted(UNIT_ROUNDOFF)}; got {dtype!r}")
    return name


def _namespace_dtype(xp, dtype):
    """``dtype`` (a name, or a dtype) as a dtype of ``xp``."""
    if not isinstance(dtype, str):
        return dtype
    name = dtype_name(dtype)
    if name == "bfloat16" and not hasattr(xp, "bfloat16"):  # NumPy: bfloat16 comes from ml_dtypes
        import ml_dtypes

        return ml_dtypes.bfloat16
    return getattr(xp, name)


def _namespace(xp, *arrays):
    return xp if xp is not None else array_namespace(*(a for a in arrays if a is not None))


# ---------------------------------------------------------------------------------------------
# The pieces the forward and both backwards share.

def _mean(xp, v, keepdims=False):
    """The row mean as the kernels take it: the sum times 1/N."""
    return xp.sum(v, axis=-1, keepdims=keepdims) * (1.0 / v.shape[-1])


def _statistics(xp, v, *, is_rms: bool, eps: float):
    """``(mean, xc, rstd)`` of rows ``v`` in the compute dtype; mean is None for RMSNorm."""
    if is_rms:
        mean, xc = None, v
    else:
        mean = _mean(xp, v)
        xc = v - mean[..., None]
    rstd = 1.0 / xp.sqrt(_mean(xp, xc * xc) + eps)
    return mean, xc, rstd


def _w_eff(xp, weight, offset: float, casting, x_dtype, f):
    """``weight + offset`` in the compute dtype ``f``, rounded to x's dtype under INPUT_DTYPE (the
    forward multiplies by that); None without a weight (w_eff = 1)."""
    if weight is None:
        return None
    w = _to(xp, weight, f) + offset
    return _round(xp, w, x_dtype) if casting == Casting.INPUT_DTYPE else w


def _dx(xp, g, x_hat, c1, rstd, *, is_rms: bool, dres, f):
    """dx from ``g = dy * w_eff``, x_hat, ``c1 = mean(g * x_hat)`` and rstd (plus d_residual_out)."""
    r = rstd[..., None]
    if is_rms:
        dx = (g - x_hat * c1) * r
    else:
        dx = (g - _mean(xp, g, keepdims=True) - x_hat * c1) * r
    if dres is not None:
        dx = dx + _to(xp, dres, f)
    return dx


def _column_sum(xp, v):
    """Sum over every row of ``(..., N)``: a gradient of a per-column parameter."""
    return xp.sum(xp.reshape(v, (-1, v.shape[-1])), axis=0)


# ---------------------------------------------------------------------------------------------
# The forward and the two backwards.

def forward(x, residual=None, weight=None, bias=None, *, is_rms: bool, eps: float, offset: float = 0.0,
            casting: Casting = Casting.FP32, xp=None) -> tuple:
    """``(y, s, mean, rstd)`` of rows ``x`` (``(..., N)``): y in x's dtype; s = round(x + residual) in
    x's dtype for the fused add (else None); the statistics in the compute dtype (fp32, or float64
    for float64 x), mean None for RMSNorm. The offset applies to a present weight only."""
    xp = _namespace(xp, x, residual, weight, bias)
    dt = x.dtype
    f = _compute_dtype(xp, dt)
    v = _to(xp, x, f)
    s = None
    if residual is not None:  # the sum is rounded to x.dtype, as torch's `x + residual`, and normalized as stored
        v = _round(xp, v + _to(xp, residual, f), dt)
        s = _to(xp, v, dt)
    mean, xc, rstd = _statistics(xp, v, is_rms=is_rms, eps=eps)
    if casting == Casting.INPUT_DTYPE:  # every product rounded to x.dtype
        x_hat = _round(xp, xc * _round(xp, rstd, dt)[..., None], dt)
    elif casting == Casting.ROUND_NORMALIZED:
        x_hat = _round(xp, xc * rstd[..., None], dt)
    else:
        x_hat = xc * rstd[..., None]
    y = x_hat
    if weight is not None:
        y = y * _w_eff(xp, weight, offset, casting, dt, f)
    if bias is not None:
        y = y + _to(xp, bias, f)
    return _to(xp, y, dt), s, mean, rstd


def input_backward(x, weight, dy, dres=None, mean=None, rstd=None, *, is_rms: bool, eps: float | None = None,
                   offset: float = 0.0, casting: Casting = Casting.FP32, compute_dx: bool = True,
                   compute_dw: bool = False, compute_db: bool = False, xp=None) -> tuple:
    """``(dx, dw, db)`` from the saved input ``x`` (the fused add's sum s), in the compute dtype; None
    where not asked (the kernels' COMPUTE_DX/DW/DB). ``dres``: the fused add's d_residual_out, added
    to dx. ``mean``/``rstd``: the forward's statistics; when rstd is None they are recomputed from x
    (with ``eps``), so that on torch tensors they are differentiated too."""
    xp = _namespace(xp, x, weight, dy, dres)
    f = _compute_dtype(xp, x.dtype)
    dy32 = _to(xp, dy, f)
    dx = dw = db = None
    if compute_dx or compute_dw:
        v = _to(xp, x, f)
        if rstd is None:
            if eps is None:
                raise ValueError("normkit: input_backward needs eps to recompute the statistics (rstd is None)")
            mean, _, rstd = _statistics(xp, v, is_rms=is_rms, eps=eps)
        r = rstd[..., None]
        x_hat = v * r if is_rms else (v - mean[..., None]) * r
    if compute_dx:
        g = dy32 if weight is None else dy32 * (_to(xp, weight, f) + offset)
        c1 = _mean(xp, g * x_hat, keepdims=True)
        dx = _dx(xp, g, x_hat, c1, rstd, is_rms=is_rms, dres=dres, f=f)
    if compute_dw:
        xw = _round(xp, x_hat, x.dtype) if casting == Casting.ROUND_NORMALIZED else x_hat  # as the forward used it
        dw = _column_sum(xp, dy32 * xw)
    if compute_db:
        db = _column_sum(xp, dy32)
    return dx, dw, db


def output_backward(y, weight, bias, dy, dres, rstd, *, is_rms: bool, offset: float = 0.0,
                    casting: Casting = Casting.FP32, rec=None, xp=None):
    """dx, in the compute dtype, from the forward's output ``y`` (stored in x's dtype), its saved
    ``rstd`` and the frozen weight and bias (``dres``: the fused add's d_residual_out, or None).
    ``rec``: the weight's ``recovery`` as the forward computed it, ``(inv, poison)``; None computes it
    here. NaN everywhere if the weight breaks the safety rule (the module docstring). Under
    ``torch.compile`` pass ``xp`` (``array_api_compat.torch``): dynamo warns on the lru_cache of
    ``array_namespace``."""
    xp = _namespace(xp, y, weight, bias, dy, dres)
    dt = y.dtype
    f = _compute_dtype(xp, dt)
    inv, poison = rec if rec is not None else recovery(weight, bias, x_dtype=dt, offset=offset, casting=casting, xp=xp)
    dy32 = _to(xp, dy, f)
    yc = _to(xp, y, f)
    if bias is not None:
        yc = yc - _to(xp, bias, f)
    if weight is None:
        x_hat, g = yc, dy32
    else:
        x_hat, g = yc * inv, dy32 * (_to(xp, weight, f) + offset)
    c1 = _mean(xp, g * x_hat, keepdims=True)
    return _dx(xp, g, x_hat, c1, rstd, is_rms=is_rms, dres=dres, f=f) + poison


# ---------------------------------------------------------------------------------------------
# The safety rule of the output-saving backward.

def output_degenerate(N: int, *, is_rms: bool) -> bool:
    """Rows too short to recover x_hat from: an RMSNorm row of one element, a LayerNorm row of one or
    two. x_hat is +-1 there whatever x is, so dx is of the order of eps alone, and an x_hat read back
    from y (off by x's unit roundoff) cancels to noise in it."""
    return N <= (1 if is_rms else 2)


def bound_scale(N: int, x_dtype) -> float:
    """``sqrt(N) (1 + 4u)``: the largest |x_hat| a row of N elements can reach (the squares of a row
    of x_hat sum to at most N), with room for its roundings to x's dtype."""
    return float(N) ** 0.5 * (1.0 + 4.0 * UNIT_ROUNDOFF[dtype_name(x_dtype)])


def _unsafe_columns(xp, w, b, x_dtype):
    """Per column, whether x_hat cannot be recovered from y; None when every column is safe by
    construction (no weight and no bias: w_y = 1). ``w`` is w_y, as the forward multiplied by it."""
    if w is None and b is None:
        return None
    unsafe = None
    if w is not None:
        unsafe = xp.logical_or(xp.logical_not(xp.isfinite(w)), xp.abs(w) < W_MIN[dtype_name(x_dtype)])
    if b is not None:
        w_abs = 1.0 if w is None else xp.abs(w)
        bad_b = xp.logical_or(xp.logical_not(xp.isfinite(b)), xp.abs(b) > OUTPUT_BIAS_RATIO * w_abs)
        unsafe = bad_b if unsafe is None else xp.logical_or(unsafe, bad_b)
    return unsafe


def _overflows(xp, w, b, N: int, x_dtype):
    """Whether y could overflow x's dtype: ``bound_scale(N) max|w_y| + max|b| > FINITE_MAX`` (a 0-d
    bool array; None without parameters, where |y| = |x_hat| <= sqrt(N) cannot)."""
    if w is None and b is None:
        return None
    name = dtype_name(x_dtype)
    bound = bound_scale(N, name) * (1.0 if w is None else xp.max(xp.abs(w)))
    if b is not None:
        bound = bound + xp.max(xp.abs(b))
    return xp.logical_not(bound <= FINITE_MAX[name])  # NaN (a NaN column) counts as an overflow too


def _weight_terms(weight, bias, x_dtype, offset, casting, xp):
    """``(xp, x's dtype, compute dtype, w_y, b, unsafe columns, overflows)`` of a weight and bias."""
    xp = _namespace(xp, weight, bias)
    dt = _namespace_dtype(xp, x_dtype)
    f = _compute_dtype(xp, dt)
    w = _w_eff(xp, weight, offset, casting, dt, f)
    b = None if bias is None else _to(xp, bias, f)
    N = (weight if weight is not None else bias).shape[-1] if (weight is not None or bias is not None) else 0
    return xp, dt, f, w, b, _unsafe_columns(xp, w, b, dt), _overflows(xp, w, b, N, dt)


def recovery(weight, bias, *, x_dtype, offset: float = 0.0, casting: Casting = Casting.FP32, xp=None) -> tuple:
    """``(inv, poison)``: what the output-saving backward needs of the weight and bias, computed from
    them alone. ``inv = 1 / w_y`` per column (1 where a column is unsafe; None without a weight), in
    the compute dtype; ``poison`` a 0-d array, 0, or NaN where the weight breaks the safety rule
    (an unsafe column, or a y that could overflow). The kernels' forward writes the same values
    (``REC``: inv, then poison)."""
    xp, dt, f, w, b, unsafe, over = _weight_terms(weight, bias, x_dtype, offset, casting, xp)
    if unsafe is None:
        return None, xp.zeros((), dtype=f)
    bad = xp.logical_or(xp.any(unsafe), over)
    poison = xp.where(bad, xp.asarray(float("nan"), dtype=f), xp.asarray(0.0, dtype=f))
    inv = None if w is None else 1.0 / xp.where(unsafe, xp.asarray(1.0, dtype=f), w)
    return inv, poison


def recovery_array(weight, bias, *, N: int, x_dtype, offset: float = 0.0, casting: Casting = Casting.FP32,
                   xp=None):
    """``recovery`` as the kernels' forward stores it (REC): N + 1 values of the compute dtype, 1 / w_y
    per column (1 without a weight), then the poison. ``xp`` is needed where neither array is given."""
    xp = _namespace(xp, weight, bias)
    f = _compute_dtype(xp, _namespace_dtype(xp, x_dtype))
    inv, poison = recovery(weight, bias, x_dtype=x_dtype, offset=offset, casting=casting, xp=xp)
    if inv is None:
        inv = xp.ones((N,), dtype=f)
    return xp.concat([inv, xp.reshape(poison, (1,))])


def split_recovery(rec, N: int, has_weight: bool) -> tuple:
    """``(inv, poison)`` of a REC array (``recovery_array``): inv None without a weight."""
    return (rec[:N] if has_weight else None), rec[N]


def unsafe_columns(weight, bias, *, x_dtype, offset: float = 0.0, casting: Casting = Casting.FP32):
    """``(w_y, unsafe)``: the weight as the forward multiplied by it (fp32; None without a weight) and,
    per column, whether ``output_backward`` cannot recover x_hat there (None when no column can be
    unsafe: no weight and no bias), for this weight and bias (NumPy or torch arrays, or None) and x's
    dtype (a name such as ``"bfloat16"``, or the arrays' library's dtype)."""
    if weight is None and bias is None:
        return None, None
    _, _, _, w, _, unsafe, _ = _weight_terms(weight, bias, x_dtype, offset, casting, None)
    return w, unsafe


def output_backward_safe(weight, bias, *, x_dtype, offset: float = 0.0, casting: Casting = Casting.FP32) -> bool:
    """Whether ``output_backward`` recovers x_hat with this weight and bias (the safety rule but the
    row length, ``output_degenerate``): a host-side check, a few reductions and one bool, for the
    caller that picks the backward."""
    return unsafe_reason(weight, bias, x_dtype=x_dtype, offset=offset, casting=casting) is None


def unsafe_reason(weight, bias, *, x_dtype, offset: float = 0.0, casting: Casting = Casting.FP32) -> str | None:
    """Why ``output_backward`` cannot recover x_hat with this weight and bias, naming the first unsafe
    column (or the overflow of y), or None where it can (the host-side check of
    ``output_backward_safe``)."""
    if weight is None and bias is None:
        return None
    xp, dt, _, w, b, unsafe, over = _weight_terms(weight, bias, x_dtype, offset, casting, None)
    name = dtype_name(dt)
    if bool(xp.any(unsafe)):
        j = int(xp.nonzero(xp.reshape(unsafe, (-1,)))[0][0])
        wj = 1.0 if w is None else float(w[j])
        if bias is not None:
            bj = float(bias[j])
            if not abs(bj) <= OUTPUT_BIAS_RATIO * abs(wj):
                return (f"column {j}: |bias| = {abs(bj):.3g} exceeds {OUTPUT_BIAS_RATIO:g} x |weight| = {abs(wj):.3g} "
                        f"(or is not finite), so y - bias cancels and x_hat cannot be recovered in {name}")
        return (f"column {j}: the weight{' + offset' if offset else ''} is {wj:.3g}, below {W_MIN[name]:.3g} in "
                f"magnitude or not finite, so x_hat = y / weight cannot be recovered in {name}")
    if bool(over):
        N = (weight if weight is not None else bias).shape[-1]
        wmax = 1.0 if w is None else float(xp.max(xp.abs(w)))
        return (f"y could overflow {name}: sqrt({N}) x max|weight{' + offset' if offset else ''}| = "
                f"{bound_scale(N, name) * wmax:.4g}{' plus max|bias|' if bias is not None else ''} reaches its largest "
                f"finite value {FINITE_MAX[name]:.4g}, and an infinite y loses x_hat")
    return None


# ---------------------------------------------------------------------------------------------
# RMSNorm followed by rotary position embedding (QK-norm, then RoPE): ``rms_norm_rope``.
#
# ``R(y) = y * cos + rotate(y) * sin`` over the last axis (HF's ``apply_rotary_pos_emb``), where
# ``rotate`` pairs column j with its partner p(j) and negates the first of each pair:
#
#   rotate_half (interleaved=False): pairs (j, j + D/2), rotate(t) = cat(-t[..., D/2:], t[..., :D/2]);
#   interleaved (GPT-J):             pairs (2i, 2i + 1), rotate(t)[2i] = -t[2i + 1], rotate(t)[2i + 1] = t[2i].
#
# With sigma_j = -1 on the first of a pair and +1 on the second, rotate(t)_j = sigma_j t_{p(j)}, and
# per pair (a, b) R is the 2 x 2 matrix [[c_a, -s_a], [s_b, c_b]]. Then
#
#   transpose (the gradient):  R^T(d) = d * cos - rotate(d * sin)
#   inverse (output saving):   R^-1(o) = (partner(cos) * o - sin * rotate(o)) / det,
#                              det = cos * partner(cos) + sin * partner(sin)
#
# (det = 1 for HF's tables, whose halves repeat: cos^2 + sin^2 = 1; attention_scaling^2 where the
# tables carry one). cos and sin are constants: they get no gradient.
#
# Rounding points (fp32 / bf16 / fp16 x): y = rms_norm(x, weight) is rounded to x's dtype exactly as
# ``forward`` returns it (what HF's q_norm returns); then
#
#   INPUT_DTYPE (casting_mode "none"):  cos and sin rounded to x's dtype, and
#                                       out = round(round(y * cos) + round(rotate(y) * sin)):
#                                       HF's rope evaluated in x's dtype, operation by operation;
#   ROUND_NORMALIZED, FP32:             out = round(y * cos + rotate(y) * sin) in fp32, one rounding.


def rope_partner(t, *, interleaved: bool, xp=None):
    """``t_{p(j)}`` along the last axis: each column's partner in its rotation pair."""
    xp = _namespace(xp, t)
    D = t.shape[-1]
    if interleaved:
        return xp.reshape(xp.stack([t[..., 1::2], t[..., 0::2]], axis=-1), t.shape[:-1] + (D,))
    return xp.concat([t[..., D // 2:], t[..., :D // 2]], axis=-1)


def rope_rotate(t, *, interleaved: bool, xp=None):
    """``rotate(t)_j = sigma_j t_{p(j)}``: HF's ``rotate_half`` (or GPT-J's ``rotate_every_two``)."""
    xp = _namespace(xp, t)
    D = t.shape[-1]
    if interleaved:
        return xp.reshape(xp.stack([-t[..., 1::2], t[..., 0::2]], axis=-1), t.shape[:-1] + (D,))
    return xp.concat([-t[..., D // 2:], t[..., :D // 2]], axis=-1)


def rope(y, cos, sin, *, interleaved: bool, x_dtype=None, casting: Casting = Casting.FP32, xp=None):
    """``R(y) = y * cos + rotate(y) * sin`` in y's dtype; under INPUT_DTYPE each product and the sum
    rounded to ``x_dtype`` (cos and sin as given: ``rms_norm_rope_forward`` rounds them first)."""
    xp = _namespace(xp, y, cos, sin)
    a, b = y * cos, rope_rotate(y, interleaved=interleaved, xp=xp) * sin
    if casting == Casting.INPUT_DTYPE and x_dtype is not None:
        return _round(xp, _round(xp, a, x_dtype) + _round(xp, b, x_dtype), x_dtype)
    return a + b


def rope_transpose(d, cos, sin, *, interleaved: bool, xp=None):
    """``R^T(d) = d * cos - rotate(d * sin)``: the gradient of y for the gradient d of R(y)."""
    xp = _namespace(xp, d, cos, sin)
    return d * cos - rope_rotate(d * sin, interleaved=interleaved, xp=xp)


def rope_inverse(out, cos, sin, *, interleaved: bool, xp=None):
    """``R^-1(out)``: y back from R(y), per pair through its 2 x 2 determinant (1 for HF's tables)."""
    xp = _namespace(xp, out, cos, sin)
    cp = rope_partner(cos, interleaved=interleaved, xp=xp)
    sp = rope_partner(sin, interleaved=interleaved, xp=xp)
    return (cp * out - sin * rope_rotate(out, interleaved=interleaved, xp=xp)) / (cos * cp + sin * sp)


def _rope_tables(xp, cos, sin, casting, x_dtype, f):
    """cos and sin in the compute dtype, as the forward multiplies by them (rounded to x's dtype
    under INPUT_DTYPE, as HF's ``cos.to(x.dtype)``)."""
    c, s = _to(xp, cos, f), _to(xp, sin, f)
    if casting == Casting.INPUT_DTYPE:
        c, s = _round(xp, c, x_dtype), _round(xp, s, x_dtype)
    return c, s


def rms_norm_rope_forward(x, weight, cos, sin, *, eps: float, offset: float = 0.0, casting: Casting = Casting.FP32,
                          interleaved: bool = False, xp=None) -> tuple:
    """``(out, rstd)``: ``out = R(rms_norm(x, weight))`` in x's dtype (rounding points above), rstd per
    row in the compute dtype. cos and sin broadcast against x (``(..., D)``)."""
    xp = _namespace(xp, x, weight, cos, sin)
    dt = x.dtype
    f = _compute_dtype(xp, dt)
    y, _, _, rstd = forward(x, None, weight, None, is_rms=True, eps=eps, offset=offset, casting=casting, xp=xp)
    c, s = _rope_tables(xp, cos, sin, casting, dt, f)
    out = rope(_to(xp, y, f), c, s, interleaved=interleaved, x_dtype=dt, casting=casting, xp=xp)
    return _to(xp, out, dt), rstd


def rms_norm_rope_input_backward(x, weight, cos, sin, dout, rstd=None, *, eps: float | None = None,
                                 offset: float = 0.0, casting: Casting = Casting.FP32, interleaved: bool = False,
                                 compute_dx: bool = True, compute_dw: bool = False, xp=None) -> tuple:
    """``(dx, dw)`` from the saved input x, in the compute dtype (None where not asked): the RMSNorm
    backward (``input_backward``) of ``dy = R^T(dout)``. ``rstd`` None recomputes it (with ``eps``)."""
    xp = _namespace(xp, x, weight, cos, sin, dout)
    f = _compute_dtype(xp, x.dtype)
    c, s = _rope_tables(xp, cos, sin, casting, x.dtype, f)
    dy = rope_transpose(_to(xp, dout, f), c, s, interleaved=interleaved, xp=xp)
    dx, dw, _ = input_backward(x, weight, dy, None, None, rstd, is_rms=True, eps=eps, offset=offset, casting=casting,
                               compute_dx=compute_dx, compute_dw=compute_dw, xp=xp)
    return dx, dw


def rms_norm_rope_output_backward(out, weight, cos, sin, dout, rstd, *, offset: float = 0.0,
                                  casting: Casting = Casting.FP32, interleaved: bool = False, rec=None, xp=None):
    """dx, in the compute dtype, from the forward's output ``out`` (x's dtype), its rstd and the frozen
    weight: ``y = R^-1(out)``, ``dy = R^T(dout)``, then ``output_backward`` (x_hat = y / w_y, the row
    term ``mean(dy * w_eff * x_hat) = mean(dy * y)``). ``rec``: the weight's ``recovery`` for x's
    dtype (None computes it); NaN everywhere where the weight breaks the safety rule, and NaN on each
    row with a pair of table columns that is not a usable rotation (``rope_table_usable``)."""
    xp = _namespace(xp, out, weight, cos, sin, dout)
    dt = out.dtype
    f = _compute_dtype(xp, dt)
    c, s = _rope_tables(xp, cos, sin, casting, dt, f)
    y = rope_inverse(_to(xp, out, f), c, s, interleaved=interleaved, xp=xp)
    dy = rope_transpose(_to(xp, dout, f), c, s, interleaved=interleaved, xp=xp)
    if rec is None:
        rec = recovery(weight, None, x_dtype=dt, offset=offset, casting=casting, xp=xp)
    dx = output_backward(y, weight, None, dy, None, rstd, is_rms=True, offset=offset, casting=casting, rec=rec,
                         xp=xp)
    bad = rope_table_rows(c, s, out.shape, interleaved=interleaved, xp=xp)  # pairs too far from a rotation
    return dx + xp.where(bad, xp.asarray(float("nan"), dtype=f), xp.asarray(0.0, dtype=f))[..., None]


def rms_norm_rope_backward(saved, weight, cos, sin, dout, rstd, rec, *, from_output: bool, offset: float = 0.0,
                           casting: Casting = Casting.FP32, interleaved: bool = False, compute_dx: bool = True,
                           compute_dw: bool = False, xp=None) -> tuple:
    """``(dx, dw)`` of what the forward kept, in the compute dtype: from its output (``from_output``,
    ``rec`` the forward's recovery buffer of N + 1 values, or None; dw None) or from its input."""
    if from_output:
        rec = None if rec is None else split_recovery(rec, saved.shape[-1], weight is not None)
        return rms_norm_rope_output_backward(saved, weight, cos, sin, dout, rstd, offset=offset, casting=casting,
                                             interleaved=interleaved, rec=rec, xp=xp), None
    return rms_norm_rope_input_backward(saved, weight, cos, sin, dout, rstd, offset=offset, casting=casting,
                                        interleaved=interleaved, compute_dx=compute_dx, compute_dw=compute_dw, xp=xp)


# The output-saving backward of rms_norm_rope recovers y = R^-1(out) with an error of out's rounding
# relative to each *pair's* magnitude |(y_j, y_p)|, not to y_j's own: so x_hat_j = y_j / w_y[j] carries
# the partner's error times |w_y[p] / w_y[j]|. Past this ratio in some pair the output is not kept
# (``rope_unsafe_reason``), or, where the weight's values were unseen, the recovery is poisoned (NaN dx).
ROPE_PAIR_RATIO = 4.0


def rope_pair_ratio(weight, *, x_dtype, offset: float = 0.0, casting: Casting = Casting.FP32,
                    interleaved: bool = False, xp=None):
    """``max_j |w_y[p(j)] / w_y[j]|`` (a 0-d array; inf where some |w_y| is 0), w_y the weight as the
    forward multiplies by it."""
    xp, dt, f, w, _, _, _ = _weight_terms(weight, None, x_dtype, offset, casting, xp)
    a = xp.abs(w)
    return xp.max(rope_partner(a, interleaved=interleaved, xp=xp) / a)


def rope_recovery_array(weight, *, N: int, x_dtype, offset: float = 0.0, casting: Casting = Casting.FP32,
                        interleaved: bool = False, xp=None):
    """``recovery_array`` for rms_norm_rope: also poisoned (NaN) where the pair ratio exceeds
    ``ROPE_PAIR_RATIO``, as the kernels' forward stores it."""
    rec = recovery_array(weight, None, N=N, x_dtype=x_dtype, offset=offset, casting=casting, xp=xp)
    if weight is None:
        return rec
    xp = _namespace(xp, weight)
    bad = xp.logical_not(rope_pair_ratio(weight, x_dtype=x_dtype, offset=offset, casting=casting,
                                         interleaved=interleaved, xp=xp) <= ROPE_PAIR_RATIO)
    nan = xp.asarray(float("nan"), dtype=rec.dtype)
    return xp.concat([rec[:N], xp.reshape(xp.where(bad, nan, rec[N]), (1,))])


# The output-saving backward recovers y = R^-1(out) per pair through the pair's 2 x 2 matrix
# A = [[c_a, -s_a], [s_b, c_b]] (c, s: cos and sin at the pair's two columns a, b), and out's rounding
# error comes back multiplied by up to A's condition number kappa. With det = c_a c_b + s_a s_b and
# r = 2 |det| / (c_a^2 + s_a^2 + c_b^2 + s_b^2) = 2 kappa / (1 + kappa^2), kappa = (1 + sqrt(1 - r^2)) / r:
# r = 1 for a rotation, scaled or not (HF's tables, attention_scaling included; rounded to bf16 or fp16,
# r stays within 1e-4 of 1), and r -> 0 as det -> 0 (cos and sin of a pair's columns at unrelated angles).
# A pair is usable where r >= ROPE_TABLE_RATIO (det finite and nonzero): kappa <= 2, the recovery's
# error at most twice a rotation's. A row with an unusable pair gets NaN dx (its row term mean(dy * y)
# mixes every pair), and the frontends keep x where they can read the tables.
ROPE_TABLE_RATIO = 0.8


def _rope_table_terms(xp, cos, sin, interleaved: bool):
    """Per column, its pair's ``(|det|, c_a^2 + s_a^2 + c_b^2 + s_b^2)``."""
    cp = rope_partner(cos, interleaved=interleaved, xp=xp)
    sp = rope_partner(sin, interleaved=interleaved, xp=xp)
    return xp.abs(cos * cp + sin * sp), cos * cos + sin * sin + cp * cp + sp * sp


def rope_table_ratio(cos, sin, *, interleaved: bool, xp=None):
    """Per column, its pair's ``r = 2 |det| / (c_a^2 + s_a^2 + c_b^2 + s_b^2)`` (1 for a rotation)."""
    xp = _namespace(xp, cos, sin)
    det, squares = _rope_table_terms(xp, cos, sin, interleaved)
    return 2.0 * det / squares


def rope_table_usable(cos, sin, *, interleaved: bool, xp=None):
    """Per column (both members of a pair alike), whether its pair of table columns is a usable
    rotation: ``2 |det| >= ROPE_TABLE_RATIO * (c_a^2 + s_a^2 + c_b^2 + s_b^2)`` with det finite and
    nonzero, in cos's and sin's dtype (the kernels: fp32, the tables as the forward multiplies by them)."""
    xp = _namespace(xp, cos, sin)
    det, squares = _rope_table_terms(xp, cos, sin, interleaved)
    return (2.0 * det >= ROPE_TABLE_RATIO * squares) & (det > 0) & (det < float("inf"))


def rope_table_rows(cos, sin, shape, *, interleaved: bool, xp=None):
    """Per row of an x of ``shape`` (``shape[:-1]``, bool), whether some pair of its table columns is
    not a usable rotation (``rope_table_usable``): the rows whose output-saving dx is NaN."""
    xp = _namespace(xp, cos, sin)
    bad = xp.logical_not(rope_table_usable(cos, sin, interleaved=interleaved, xp=xp))
    return xp.broadcast_to(xp.any(bad, axis=-1), tuple(shape[:-1]))


def rope_table_unsafe_reason(cos, sin, *, x_dtype, casting: Casting = Casting.FP32,
                             interleaved: bool = False) -> str | None:
    """Why rms_norm_rope's output-saving backward cannot rotate the output back with these tables (a pair
    of columns that is not a usable rotation, ``rope_table_usable``, of the tables as the forward
    multiplies by them), or None where it can. On the host: one reduction, one bool."""
    xp = _namespace(None, cos, sin)
    dt = _namespace_dtype(xp, x_dtype)
    c, s = _rope_tables(xp, cos, sin, casting, dt, _compute_dtype(xp, dt))
    if bool(xp.all(rope_table_usable(c, s, interleaved=interleaved, xp=xp))):
        return None
    r = rope_table_ratio(c, s, interleaved=interleaved, xp=xp)
    worst = float(xp.min(xp.where(r == r, r, xp.zeros_like(r))))
    return (f"cos and sin have a pair of columns that is not a rotation (2|cos_a cos_b + sin_a sin_b| / (cos_a^2 + "
            f"sin_a^2 + cos_b^2 + sin_b^2) is {worst:.3g} < {ROPE_TABLE_RATIO:g}): the output rotated back would carry "
            "its rounding error amplified by up to the pair's condition number")


def rope_unsafe_reason(weight, *, x_dtype, offset: float = 0.0, casting: Casting = Casting.FP32,
                       interleaved: bool = False) -> str | None:
    """Why rms_norm_rope's output-saving backward cannot recover x_hat with this weight (RMSNorm's
    ``unsafe_reason``, or a pair ratio above ``ROPE_PAIR_RATIO``), or None where it can."""
    reason = unsafe_reason(weight, None, x_dtype=x_dtype, offset=offset, casting=casting)
    if reason is not None or weight is None:
        return reason
    ratio = float(rope_pair_ratio(weight, x_dtype=x_dtype, offset=offset, casting=casting, interleaved=interleaved))
    if ratio <= ROPE_PAIR_RATIO:
        return None
    return (f"a rotation pair's weights{' + offset' if offset else ''} differ by a factor {ratio:.3g} > "
            f"{ROPE_PAIR_RATIO:g}: the rotation mixes each pair, so x_hat recovered from the output would carry the "
            "partner's rounding error times that factor")
