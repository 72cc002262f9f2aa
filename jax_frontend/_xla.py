"""The XLA implementation: the norms in plain ``jax.numpy``, no custom kernel.

The two entry points of ``jax_frontend._implementation.Implementation`` (dict results keyed like
``Op.fwd_buffers`` / ``Op.bwd_buffers``) over the math of ``normkit.norm_math``, which holds the same
math and rounding points as ``normkit.kernels.norm`` for each casting mode (rounding to x.dtype by
``lax.reduce_precision``, which XLA keeps: ``norm_math._round`` says why), and the same frozen
semantics: a gradient that is not asked for is not computed (no dW/dB column sum is even traced
for a frozen weight/bias).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from normkit import norm_math, record
from normkit.ops import Grads, Op, Options


def _record(name: str, **flags) -> None:
    """A launch record (normkit.record_launches) of the XLA computation, made when it is traced."""
    if record.active():
        cpu = jax.default_backend() == "cpu"
        record.emit(record.Launch(kernel=name, frontend="jax-cpu" if cpu else "jax-gpu", grid=(), num_warps=0,
                                  flags=flags, partial_buffers=(), interpreted=False, implementation="xla"))


def forward(op: Op, x, residual, weight, bias, *, opts: Options, store_stats: bool, store_rec: bool = False) -> dict:
    """Y (and S, MEAN, RSTD, REC) for rows x [M, N]; keys exactly those of ``op.fwd_buffers``."""
    M, N = x.shape
    _record("xla_norm_fwd", **op.fwd_flags, HAS_W=weight is not None, HAS_B=bias is not None,
            CASTING=int(opts.casting), STORE_STATS=store_stats)
    y, s, mean, rstd = norm_math.forward(x, residual, weight, bias, is_rms=op.is_rms, eps=opts.eps,
                                         offset=opts.offset, casting=opts.casting, xp=jnp)
    out = {"Y": y}
    if s is not None:
        out["S"] = s
    if store_stats and not op.is_rms:
        out["MEAN"] = mean
    if store_stats:
        out["RSTD"] = rstd
    if store_rec:
        out["REC"] = norm_math.recovery_array(weight, bias, N=N, x_dtype=x.dtype, offset=opts.offset,
                                              casting=opts.casting, xp=jnp)
    assert out.keys() == op.fwd_buffers(M, N, jnp.dtype(x.dtype).name, store_stats, store_rec).keys()
    return out


def backward(op: Op, x, weight, dy, dres, mean, rstd, *, opts: Options, grads: Grads,
             b_dtype: str | None, bias=None, from_output: bool = False, rec=None) -> dict:
    """DX (with + dres for the fused op), DW, DB as ``grads`` asks; keys exactly those of ``op.bwd_buffers``.
    dW takes the weight's dtype, dB ``b_dtype``. ``from_output``: x is the forward's output y and
    ``bias`` the (frozen) bias and ``rec`` the forward's recovery of the weight: ``norm_math.output_backward``
    (dx alone)."""
    M, N = x.shape
    w_dtype = jnp.dtype(weight.dtype).name if weight is not None else None
    _record("xla_norm_bwd", IS_RMS=op.is_rms, HAS_W=weight is not None, HAS_DRES=dres is not None,
            CASTING=int(opts.casting), COMPUTE_DX=grads.dx, COMPUTE_DW=grads.dw, COMPUTE_DB=grads.db,
            FROM_Y=from_output)
    if from_output:
        assert not grads.reduces, "the output-saving backward computes dx alone"
        dx = norm_math.output_backward(x, weight, bias, dy, dres, rstd, is_rms=op.is_rms, offset=opts.offset,
                                       casting=opts.casting, rec=norm_math.split_recovery(rec, N, weight is not None),
                                       xp=jnp)
        return {"DX": dx.astype(x.dtype)} if grads.dx else {}
    dx, dw, db = norm_math.input_backward(x, weight, dy, dres, mean, rstd, is_rms=op.is_rms, offset=opts.offset,
                                          casting=opts.casting, compute_dx=grads.dx, compute_dw=grads.dw,
                                          compute_db=grads.db, xp=jnp)
    out = {}
    if grads.dx:
        out["DX"] = dx.astype(x.dtype)
    if grads.dw:
        out["DW"] = dw.astype(w_dtype)
    if grads.db:
        out["DB"] = db.astype(b_dtype)
    assert out.keys() == op.bwd_buffers(M, N, jnp.dtype(x.dtype).name, grads, w_dtype, b_dtype).keys()
    return out
