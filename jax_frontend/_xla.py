"""The XLA implementation: the norms in plain ``jax.numpy``, no custom kernel.

The two entry points of ``jax_frontend._implementation.Implementation`` (dict results keyed like
``Op.fwd_buffers`` / ``Op.bwd_buffers``), same math and rounding points as ``normkit.kernels.norm`` for each casting
mode, and the same frozen semantics: a gradient that is not asked for is not computed (no dW/dB
column sum is even traced for a frozen weight/bias).

Rounding to x.dtype inside a computation uses ``_round`` rather than ``astype(dt).astype(f32)``:
XLA:GPU's default ``xla_allow_excess_precision`` lets its simplify-fp-conversions pass delete
``f32 -> bf16 -> f32`` round trips, which would silently turn the "none"/"llama" casting modes
into "gemma". ``lax.reduce_precision`` is kept; it flushes what would be an fp16 subnormal to
zero, so those (|v| < 2**-14) are rounded on the 2**-24 grid explicitly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from normkit import record
from normkit.ops import Casting, Grads, Op, Options

F32 = jnp.float32


def _record(name: str, **flags) -> None:
    """A launch record (normkit.record_launches) of the XLA computation, made when it is traced."""
    if record.active():
        cpu = jax.default_backend() == "cpu"
        record.emit(record.Launch(kernel=name, frontend="jax-cpu" if cpu else "jax-gpu", grid=(), num_warps=0,
                                  flags=flags, partial_buffers=(), interpreted=False, implementation="xla"))


def _round(v, dtype):
    """fp32 ``v`` rounded to the values of ``dtype`` (round to nearest even), kept in fp32."""
    dtype = jnp.dtype(dtype)
    if dtype == F32:
        return v
    fi = jnp.finfo(dtype)
    r = lax.reduce_precision(v, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    if fi.nexp < 8:  # subnormals of a narrower exponent range (fp16): multiples of its smallest subnormal
        tiny = float(fi.smallest_subnormal)
        r = jnp.where(jnp.abs(v) < float(fi.smallest_normal), jnp.round(v / tiny) * tiny, r)
    return r


def forward(op: Op, x, residual, weight, bias, *, opts: Options, store_stats: bool) -> dict:
    """Y (and S, MEAN, RSTD) for rows x [M, N]; keys exactly those of ``op.fwd_buffers``."""
    M, N = x.shape
    dt = x.dtype
    _record("xla_norm_fwd", **op.fwd_flags, HAS_W=weight is not None, HAS_B=bias is not None,
            CASTING=int(opts.casting), STORE_STATS=store_stats)
    out = {}
    x32 = x.astype(F32)
    s = None
    if op.has_residual:
        # the sum is rounded to x.dtype, as torch's `x + residual`, and normalized as stored
        x32 = _round(x32 + residual.astype(F32), dt)
        s = x32.astype(dt)
    if op.is_rms:
        xc = x32
        var = jnp.sum(x32 * x32, axis=1) * (1.0 / N)
    else:
        mean = jnp.sum(x32, axis=1) * (1.0 / N)
        xc = x32 - mean[:, None]
        var = jnp.sum(xc * xc, axis=1) * (1.0 / N)
    rstd = 1.0 / jnp.sqrt(var + opts.eps)
    if opts.casting == Casting.INPUT_DTYPE:  # every product rounded to x.dtype
        xn = _round(xc * _round(rstd, dt)[:, None], dt)
    elif opts.casting == Casting.ROUND_NORMALIZED:
        xn = _round(xc * rstd[:, None], dt)
    else:
        xn = xc * rstd[:, None]
    y = xn
    if weight is not None:
        w = weight.astype(F32) + opts.offset
        if opts.casting == Casting.INPUT_DTYPE:
            w = _round(w, dt)
        y = y * w[None, :]
    if bias is not None:
        y = y + bias.astype(F32)[None, :]
    out["Y"] = y.astype(dt)
    if s is not None:
        out["S"] = s
    if store_stats and not op.is_rms:
        out["MEAN"] = mean
    if store_stats:
        out["RSTD"] = rstd
    assert out.keys() == op.fwd_buffers(M, N, jnp.dtype(dt).name, store_stats).keys()
    return out


def backward(op: Op, x, weight, dy, dres, mean, rstd, *, opts: Options, grads: Grads,
             b_dtype: str | None) -> dict:
    """DX (with + dres for the fused op), DW, DB as ``grads`` asks; keys exactly those of ``op.bwd_buffers``.
    dW takes the weight's dtype, dB ``b_dtype``."""
    M, N = x.shape
    w_dtype = jnp.dtype(weight.dtype).name if weight is not None else None
    dt = x.dtype
    _record("xla_norm_bwd", IS_RMS=op.is_rms, HAS_W=weight is not None, HAS_DRES=dres is not None,
            CASTING=int(opts.casting), COMPUTE_DX=grads.dx, COMPUTE_DW=grads.dw, COMPUTE_DB=grads.db)
    out = {}
    dy32 = dy.astype(F32)
    if grads.dx or grads.dw:
        x32 = x.astype(F32)
        r = rstd[:, None]
        xn = x32 * r if op.is_rms else (x32 - mean[:, None]) * r
    if grads.dx:
        g = dy32 if weight is None else dy32 * (weight.astype(F32) + opts.offset)[None, :]
        c1 = jnp.sum(g * xn, axis=1, keepdims=True) * (1.0 / N)
        if op.is_rms:
            dx = (g - xn * c1) * r
        else:
            c2 = jnp.sum(g, axis=1, keepdims=True) * (1.0 / N)
            dx = (g - c2 - xn * c1) * r
        if dres is not None:
            dx = dx + dres.astype(F32)
        out["DX"] = dx.astype(dt)
    if grads.dw:
        xw = _round(xn, dt) if opts.casting == Casting.ROUND_NORMALIZED else xn  # as the forward used it
        out["DW"] = jnp.sum(dy32 * xw, axis=0).astype(w_dtype)
    if grads.db:
        out["DB"] = jnp.sum(dy32, axis=0).astype(b_dtype)
    assert out.keys() == op.bwd_buffers(M, N, jnp.dtype(dt).name, grads, w_dtype, b_dtype).keys()
    return out
