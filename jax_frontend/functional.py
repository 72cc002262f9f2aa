"""The JAX frontend: one ``jax.custom_vjp`` over the shared Triton kernels serves the three ops.

Which gradients the backward computes comes from ``.perturbed`` (``defvjp(..., symbolic_zeros=True)``):
an input that is under ``jax.lax.stop_gradient`` (see ``freeze``), outside the differentiated
arguments, or closed over is unperturbed, so its COMPUTE_* flag is off: its work, its fp32 partial
buffer and its reduction launch disappear, and its cotangent is a symbolic zero. The choice is made
when the forward rule is traced and stays static (Python bools carried in the residuals' tree
structure). Inputs are flattened to 2-D rows before the custom_vjp boundary and reshaped after it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jax_frontend import _launch
from jax_frontend import _primitives as prims
from normkit import checks

__all__ = ["rms_norm", "layer_norm", "fused_add_rms_norm"]

_FUSED = "fused_add_rms_norm"


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static part of one call (custom_vjp's nondiff argument)."""

    op: str
    eps: float
    offset: float
    casting: str


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Needs:
    """Which inputs the backward must differentiate: static pytree aux data inside the residuals."""

    x: bool
    residual: bool
    weight: bool
    bias: bool
    w_dtype: str | None
    b_dtype: str | None

    @property
    def dx(self) -> bool:  # the fused op's x and residual share one gradient
        return self.x or self.residual

    @property
    def any(self) -> bool:
        return self.dx or self.weight or self.bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(cfg: _Config, x, residual, weight, bias):
    """Rows in, rows out. No backward will run here, so no statistics are stored."""
    y, s, _, _ = prims.forward(cfg.op, cfg.eps, cfg.offset, cfg.casting, x, residual, weight, bias,
                               store_stats=False)
    return (y, s) if cfg.op == _FUSED else y


def _value(p):
    return None if p is None else p.value


def _perturbed(p) -> bool:
    return p is not None and p.perturbed


def _norm_fwd(cfg: _Config, x, residual, weight, bias):
    w, b = _value(weight), _value(bias)
    needs = _Needs(x=_perturbed(x), residual=_perturbed(residual), weight=_perturbed(weight), bias=_perturbed(bias),
                   w_dtype=None if w is None else _launch.dtype_name(w.dtype),
                   b_dtype=None if b is None else _launch.dtype_name(b.dtype))
    y, s, mean, rstd = prims.forward(cfg.op, cfg.eps, cfg.offset, cfg.casting, _value(x), _value(residual), w, b,
                                     store_stats=needs.any)
    saved_x = s if cfg.op == _FUSED else _value(x)  # the fused op normalized s = x + residual
    out = (y, s) if cfg.op == _FUSED else y
    if not needs.any:  # nothing will be differentiated: keep nothing alive
        return out, (None, None, None, None, needs)
    return out, (saved_x, w, mean, rstd, needs)


def _zero(ct):
    return ct is None or isinstance(ct, SymbolicZero)


def _norm_bwd(cfg: _Config, res, ct):
    x, w, mean, rstd, needs = res
    dy, ds = ct if cfg.op == _FUSED else (ct, None)
    dy = None if _zero(dy) else dy
    ds = None if _zero(ds) else ds  # residual_out unused: the kernel reads no DRES
    if not needs.any or (dy is None and ds is None):
        return None, None, None, None
    if dy is None:  # only residual_out was used: y's gradient is exactly zero
        dy = jnp.zeros_like(x)
    dx, dw, db = prims.backward(cfg.op, cfg.offset, cfg.casting, x, w, dy, ds, mean, rstd, compute_dx=needs.dx,
                                compute_dw=needs.weight, compute_db=needs.bias, w_dtype=needs.w_dtype,
                                b_dtype=needs.b_dtype)
    return (dx if needs.x else None, dx if needs.residual else None, dw if needs.weight else None,
            db if needs.bias else None)


_norm.defvjp(_norm_fwd, _norm_bwd, symbolic_zeros=True)


# ---------------------------------------------------------------------------------------------
# Public functions.


def _as_array(a, name: str):
    if a is None:
        return None
    if not isinstance(a, (jax.Array, np.ndarray)):
        raise TypeError(f"normkit: {name} must be a jax.Array; got {type(a).__name__}")
    return jnp.asarray(a)


def _check(x, *, weight=None, bias=None, residual=None, eps, offset=0.0, casting_mode="gemma"):
    """Validate at trace time, before any launch; return the arrays."""
    x, weight, bias, residual = (_as_array(a, n) for a, n in ((x, "x"), (weight, "weight"), (bias, "bias"),
                                                                (residual, "residual")))
    spec = lambda a: None if a is None else (tuple(a.shape), _launch.dtype_name(a.dtype))  # noqa: E731
    checks.check(x_shape=tuple(x.shape), x_dtype=_launch.dtype_name(x.dtype), weight=spec(weight), bias=spec(bias),
                 residual=spec(residual), eps=eps, offset=offset, casting_mode=casting_mode)
    return x, weight, bias, residual


def _rows(a):
    return a.reshape(-1, a.shape[-1])


def rms_norm(x: jax.Array, weight: jax.Array | None = None, eps: float = 1e-6, *, offset: float = 0.0,
             casting_mode: str = "llama") -> jax.Array:
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * (weight + offset)``.

    Backward: with ``x_hat = x * rstd`` and ``g = dy * (weight + offset)``,
    ``dx = rstd * (g - x_hat * mean(g * x_hat))`` and ``dweight = sum over rows of dy * x_hat``.
    A frozen input (under ``jax.lax.stop_gradient``, e.g. through ``freeze``, or simply not
    differentiated) is not computed: its kernel flag is off and its cotangent a symbolic zero.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16.
        weight: ``(D,)`` of any float dtype, or None for no elementwise scale.
        eps: added to the mean square; a Python number (static).
        offset: added to the weight (Gemma: 1.0); static.
        casting_mode: ``"llama"`` (normalize in fp32, round to x.dtype, then scale), ``"gemma"`` (all fp32,
            round at the end) or ``"none"`` (products rounded to x.dtype); static.

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.rms_norm``.

    Raises:
        TypeError, ValueError: at trace time, naming the argument, for a bad dtype, shape or option.
    """
    x, weight, _, _ = _check(x, weight=weight, eps=eps, offset=offset, casting_mode=casting_mode)
    y = _norm(_Config("rms_norm", float(eps), float(offset), casting_mode), _rows(x), None, weight, None)
    return y.reshape(x.shape)


def layer_norm(x: jax.Array, weight: jax.Array | None = None, bias: jax.Array | None = None,
               eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * weight + bias``, computed in fp32.

    Backward: with ``x_hat = (x - mean) * rstd`` and ``g = dy * weight``,
    ``dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))``, ``dweight = sum over rows of dy * x_hat``
    and ``dbias = sum over rows of dy``. Frozen inputs are skipped as in ``rms_norm``.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16.
        weight, bias: ``(D,)`` of any float dtype, or None.
        eps: added to the variance; a Python number (static).

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.layer_norm``.

    Raises:
        TypeError, ValueError: at trace time, naming the argument, for a bad dtype, shape or option.
    """
    x, weight, bias, _ = _check(x, weight=weight, bias=bias, eps=eps)
    y = _norm(_Config("layer_norm", float(eps), 0.0, "gemma"), _rows(x), None, weight, bias)
    return y.reshape(x.shape)


def fused_add_rms_norm(x: jax.Array, residual: jax.Array, weight: jax.Array | None = None, eps: float = 1e-6, *,
                       offset: float = 0.0, casting_mode: str = "llama") -> tuple[jax.Array, jax.Array]:
    """``s = x + residual`` (rounded to x.dtype) and ``y = rms_norm(s)``, in one pass.

    Backward: x and residual both receive ``ds + drms_norm(s; dy)``, where dy and ds are the
    cotangents of y and of residual_out; an unused residual_out costs no read. Frozen inputs are
    skipped as in ``rms_norm``.

    Args:
        x, residual: ``(..., D)`` of the same shape and dtype (float32, bfloat16 or float16).
        weight, eps, offset, casting_mode: as in ``rms_norm``.

    Returns:
        ``(y, residual_out)`` where ``residual_out = s``; both ``(..., D)`` in x.dtype.

    Raises:
        TypeError, ValueError: at trace time, naming the argument, for a bad dtype, shape or option.
    """
    x, weight, _, residual = _check(x, weight=weight, residual=residual, eps=eps, offset=offset,
                                    casting_mode=casting_mode)
    y, s = _norm(_Config(_FUSED, float(eps), float(offset), casting_mode), _rows(x), _rows(residual), weight, None)
    return y.reshape(x.shape), s.reshape(x.shape)
