"""The JAX frontend: one ``jax.custom_vjp`` over the shared Triton kernels serves the three ops.

Which gradients the backward computes comes from ``.perturbed`` (``defvjp(..., symbolic_zeros=True)``):
an input that is under ``jax.lax.stop_gradient`` (see ``freeze``), outside the differentiated
arguments, or closed over is unperturbed, so its COMPUTE_* flag is off: its work, its fp32 partial
buffer and its reduction launch disappear, and its cotangent is a symbolic zero. The choice is made
when the forward rule is traced and stays static (Python bools carried in the residuals' tree
structure).

Arrays keep the caller's shape ``(..., N)`` across the custom_vjp boundary; each pass flattens its
rows to 2-D inside (``_rows.Pass``), on each device's rows where the inputs are sharded. Flattening
before the boundary would merge a sharded sequence axis with an unsharded batch axis, which no
sharding of the merged axis expresses: XLA would gather the activation to do it.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

from jax_frontend import _custom_partitioning, _launch, _shard_map, _triton
from jax_frontend._compat import SymbolicZero
from jax_frontend._implementation import Implementation
from normkit import checks, launch, norm_math, saving
from normkit.ops import FUSED_ADD_RMS_NORM, LAYER_NORM, RMS_NORM, Grads, Op, Options

__all__ = ["rms_norm", "layer_norm", "fused_add_rms_norm", "IMPLEMENTATIONS", "resolve_implementation"]

SAVES = checks.SAVES

# ---------------------------------------------------------------------------------------------
# Implementations: the same op, its frozen semantics and its custom_vjp, over three sets of kernels.

IMPLEMENTATIONS = ("triton", "pallas", "xla")


def _implementation_module(name: str) -> Implementation:
    if name == "triton":  # normkit.kernels.norm through jax-triton (GPU) or Triton's interpreter (CPU)
        # The kernels imported here, on the tracing thread: imported later, in the middle of a lowering
        # that XLA's partitioner runs on a thread of its own, the import can crash the process (a
        # garbage collection on that thread in the middle of it).
        launch.kernels()
        return _triton
    if name == "pallas":  # normkit.kernels.norm_pallas through pallas_call
        from jax_frontend import _pallas

        return _pallas
    from jax_frontend import _xla  # plain jax.numpy

    return _xla


@functools.lru_cache(maxsize=None)
def _unavailable(name: str, platform: str) -> str | None:
    """Why implementation ``name`` cannot run on ``platform`` (jax.default_backend()), or None."""
    if platform not in ("cpu", "gpu") and name != "xla":
        return f"its kernels run on NVIDIA GPUs (and on CPU in an interpreter), not on {platform}"
    if name == "triton" and importlib.util.find_spec("triton") is None:
        return "it runs the Triton kernels, which need the triton package (pip install normkit's torch extra)"
    if name == "triton" and platform == "cpu" and importlib.util.find_spec("torch") is None:
        return "on CPU it runs the Triton kernels in Triton's interpreter, which needs torch (pip install torch)"
    if name == "triton" and platform == "gpu":
        try:
            _launch.import_jax_triton()
        except ImportError as err:
            return str(err)
    return None


def resolve_implementation(implementation: str | None = None, like=None) -> str:
    """The implementation a call with ``implementation=`` runs on the default backend.

    ``None`` (auto) picks ``"triton"`` where it can run (a GPU with jax-triton 0.3.1; on CPU, Triton's
    interpreter, when torch is installed), else ``"pallas"`` (no jax-triton; a torch-free CPU install),
    else ``"xla"``. On CPU inside a ``shard_map`` (``like``, the input, varies over manual mesh axes)
    auto skips Pallas: Pallas's interpreter cannot type its padding under shard_map's ``check_vma``.
    A requested implementation that cannot run raises: never a silent fallback. The launch records
    (``normkit.record_launches``) name the implementation that ran.
    """
    platform = jax.default_backend()
    if implementation is None:
        skip = {"pallas"} if platform == "cpu" and like is not None and _shard_map.varying(like) else set()
        return next(name for name in IMPLEMENTATIONS if name not in skip and _unavailable(name, platform) is None)
    if not isinstance(implementation, str):
        raise TypeError(f"normkit: implementation must be None or a str, one of {IMPLEMENTATIONS}; got "
                        f"{type(implementation).__name__}: {implementation!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"normkit: unknown implementation {implementation!r}; expected None or one of "
                         f"{IMPLEMENTATIONS}")
    reason = _unavailable(implementation, platform)
    if reason is not None:
        raise RuntimeError(f"normkit: implementation={implementation!r} cannot run on the {platform} backend: {reason}")
    return implementation



@dataclasses.dataclass(frozen=True)
class _Config:
    """The static part of one call (custom_vjp's nondiff argument)."""

    op: Op
    opts: Options
    impl: Implementation  # over arrays of the caller's shape: _shard_map.ShardedImpl or _custom_partitioning's
    save: str = "auto"  # what the backward keeps: "auto", "input" or "output" (_saves_output)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Needs:
    """Which inputs the backward must differentiate: static pytree aux data inside the residuals."""

    x: bool
    residual: bool
    weight: bool
    bias: bool
    b_dtype: str | None
    from_output: bool = False  # the residuals hold y, the bias and REC, not x: weight and bias frozen

    @property
    def grads(self) -> Grads:  # the fused op's x and residual share one gradient
        return Grads(dx=self.x or self.residual, dw=self.weight, db=self.bias)


def _outputs(cfg: _Config, out: dict):
    return (out["Y"], out["S"]) if cfg.op.has_residual else out["Y"]


def _forward(cfg: _Config, x, residual, weight, bias, *, store_stats: bool, store_rec: bool = False) -> dict:
    return cfg.impl.forward(cfg.op, x, residual, weight, bias, opts=cfg.opts, store_stats=store_stats,
                            store_rec=store_rec)


def _backward(cfg: _Config, x, weight, bias, dy, dres, mean, rstd, rec, *, grads: Grads, b_dtype,
              from_output: bool) -> dict:
    return cfg.impl.backward(cfg.op, x, weight, dy, dres, mean, rstd, opts=cfg.opts, grads=grads, b_dtype=b_dtype,
                             bias=bias, from_output=from_output, rec=rec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(cfg: _Config, x, residual, weight, bias):
    """Arrays of the caller's shape in and out. No backward will run here, so no statistics are stored."""
    return _outputs(cfg, _forward(cfg, x, residual, weight, bias, store_stats=False))


def _value(p):
    return None if p is None else p.value


def _perturbed(p) -> bool:
    return p is not None and p.perturbed


def _saves_output(cfg: _Config, needs: "_Needs", x, weight, bias) -> bool:
    """Whether the residuals hold the output y rather than the input: ``save`` (``rms_norm``'s docstring)
    for a call whose weight and bias are not differentiated (``normkit.saving.decide``). Where their
    values are known (not traced) "auto" applies the safety rule to them (``normkit.norm_math``);
    traced, ``saving.traced_rule``, and the kernels' dx is NaN where a weight turns out unsafe."""
    traced = any(isinstance(p, jax.core.Tracer) for p in (weight, bias) if p is not None)
    x_dtype = _launch.dtype_name(x.dtype)
    return saving.decide(
        cfg.op, cfg.save, trained=[n for n in ("weight", "bias") if getattr(needs, n)],
        needs_dx=needs.x or needs.residual, row_length=x.shape[-1], has_params=weight is not None or bias is not None,
        has_bias=bias is not None, offset=cfg.opts.offset, x_dtype=x_dtype,
        unsafe=None if traced else lambda: norm_math.unsafe_reason(
            _host(weight), _host(bias), x_dtype=x_dtype, offset=cfg.opts.offset, casting=cfg.opts.casting))


def _host(a):
    """A parameter's known values on the host, as float32 NumPy (exact for every parameter dtype but
    float64). Converted by NumPy, not by jnp: under a trace (a jit closing over the parameter) a jnp
    conversion would be a traced operation, whose result has no values to read."""
    return None if a is None else np.asarray(a).astype(np.float32)


def _norm_fwd(cfg: _Config, x, residual, weight, bias):
    b = _value(bias)
    needs = _Needs(x=_perturbed(x), residual=_perturbed(residual), weight=_perturbed(weight), bias=_perturbed(bias),
                   b_dtype=None if b is None else _launch.dtype_name(b.dtype))
    if not needs.grads.any:  # nothing will be differentiated: keep nothing alive
        out = _forward(cfg, _value(x), _value(residual), _value(weight), b, store_stats=False)
        return _outputs(cfg, out), (None, None, None, None, None, needs)
    from_output = _saves_output(cfg, needs, _value(x), _value(weight), b)
    out = _forward(cfg, _value(x), _value(residual), _value(weight), b, store_stats=True, store_rec=from_output)
    if from_output:  # y, the bias and the weight's recovery (REC) in the mean's place
        needs = dataclasses.replace(needs, from_output=True)
        return _outputs(cfg, out), (out["Y"], _value(weight), b, out["REC"], out["RSTD"], needs)
    saved_x = out["S"] if cfg.op.has_residual else _value(x)  # the fused op normalized s = x + residual
    return _outputs(cfg, out), (saved_x, _value(weight), None, out.get("MEAN"), out["RSTD"], needs)


def _zero(ct):
    return ct is None or isinstance(ct, SymbolicZero)


def _norm_bwd(cfg: _Config, res, ct):
    x, w, b, aux, rstd, needs = res
    mean, rec = (None, aux) if needs.from_output else (aux, None)
    dy, ds = ct if cfg.op.has_residual else (ct, None)
    dy = None if _zero(dy) else dy
    ds = None if _zero(ds) else ds  # residual_out unused: the kernel reads no DRES
    grads = needs.grads
    if not grads.any or (dy is None and ds is None):
        return None, None, None, None
    if dy is None:  # only residual_out was used: y's gradient is exactly zero
        dy = jnp.zeros_like(x)
    out = _backward(cfg, x, w, b, dy, ds, mean, rstd, rec, grads=grads, b_dtype=needs.b_dtype,
                    from_output=needs.from_output)
    assert set(out) == set(cfg.op.bwd_buffers(1, 1, "float32", grads, "float32", "float32")), out.keys()
    dx = out.get("DX")
    return (dx if needs.x else None, dx if needs.residual else None, out.get("DW"), out.get("DB"))


_norm.defvjp(_norm_fwd, _norm_bwd, symbolic_zeros=True)


# ---------------------------------------------------------------------------------------------
# Public functions.


def _as_array(a, name: str):
    if a is None:
        return None
    if not isinstance(a, (jax.Array, np.ndarray)):
        raise TypeError(f"normkit: {name} must be a jax.Array; got {type(a).__name__}")
    return jnp.asarray(a)


def _call(op: Op, x, residual=None, weight=None, bias=None, *, eps, offset=0.0, casting_mode="llama",
          implementation=None, save="auto"):
    """Validate at trace time, before any launch; run the op over rows and restore the shape."""
    x, residual, weight, bias = (_as_array(a, n) for a, n in ((x, "x"), (residual, "residual"),
                                                                (weight, "weight"), (bias, "bias")))
    spec = lambda a: None if a is None else (tuple(a.shape), _launch.dtype_name(a.dtype))  # noqa: E731
    checks.check(op, x_shape=tuple(x.shape), x_dtype=_launch.dtype_name(x.dtype), residual=spec(residual),
                 weight=spec(weight), bias=spec(bias))
    opts = op.options(eps=eps, offset=offset, casting_mode=casting_mode)
    checks.check_save(save)
    base = _implementation_module(resolve_implementation(implementation, x))
    # Distributed (jax_frontend/_shard_map.py, _custom_partitioning.py): inside a caller's shard_map,
    # inputs varying alike; a parameter sharded over Explicit mesh axes gathered; x sharded over
    # Explicit mesh axes runs per device through shard_map (unsupported shardings raise here);
    # anything else through a primitive that XLA's partitioner splits by rows.
    x, residual, weight, bias = _shard_map.match_varying(x, residual, weight, bias)
    weight, bias = _shard_map.whole_params(weight, bias)
    impl = (_shard_map.sharded_impl(op, base, x, residual, weight, bias)
            or _custom_partitioning.PartitionedImpl(base))
    return _norm(_Config(op, opts, impl, save), x, residual, weight, bias)


def rms_norm(x: jax.Array, weight: jax.Array | None = None, eps: float = 1e-6, *, offset: float = 0.0,
             casting_mode: str = "llama", implementation: str | None = None, save: str = "auto") -> jax.Array:
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
        implementation: ``None`` (auto), ``"triton"``, ``"pallas"`` or ``"xla"``; see
            ``resolve_implementation``. Every one computes the same function with the same frozen
            semantics; the launch record names the one that ran.
        save: what the backward keeps in its residuals (static): ``"auto"`` keeps the output y instead of
            x where the weight and bias are not differentiated (frozen), rows are long enough and x_hat
            can be recovered from y (``normkit.saving.decide``): by the weight's values where they are
            known when the rule is traced (not tracers), else where only a weight of exactly zero could
            prevent it (no bias, no offset, x not float16: ``normkit.saving.traced_rule``; the kernels'
            dx is NaN if such a weight turns up). ``"input"`` keeps x; ``"output"`` keeps y, and raises
            where a parameter is differentiated, rows are too short, or known values are unsafe.
            Keeping y frees x where y is kept anyway (an adapter in x's dtype) and x is held for the
            norm alone.

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.rms_norm``.

    Raises:
        TypeError, ValueError: at trace time, naming the argument, for a bad dtype, shape or option.
    """
    return _call(RMS_NORM, x, weight=weight, eps=eps, offset=offset, casting_mode=casting_mode,
                 implementation=implementation, save=save)


def layer_norm(x: jax.Array, weight: jax.Array | None = None, bias: jax.Array | None = None,
               eps: float = 1e-5, *, implementation: str | None = None, save: str = "auto") -> jax.Array:
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * weight + bias``, computed in fp32.

    Backward: with ``x_hat = (x - mean) * rstd`` and ``g = dy * weight``,
    ``dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))``, ``dweight = sum over rows of dy * x_hat``
    and ``dbias = sum over rows of dy``. Frozen inputs are skipped as in ``rms_norm``.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16.
        weight, bias: ``(D,)`` of any float dtype, or None.
        eps: added to the variance; a Python number (static).
        implementation, save: as in ``rms_norm``.

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.layer_norm``.

    Raises:
        TypeError, ValueError: at trace time, naming the argument, for a bad dtype, shape or option.
    """
    return _call(LAYER_NORM, x, weight=weight, bias=bias, eps=eps, implementation=implementation, save=save)


def fused_add_rms_norm(x: jax.Array, residual: jax.Array, weight: jax.Array | None = None, eps: float = 1e-6, *,
                       offset: float = 0.0, casting_mode: str = "llama", implementation: str | None = None,
                       save: str = "auto") -> tuple[jax.Array, jax.Array]:
    """``s = x + residual`` (rounded to x.dtype) and ``y = rms_norm(s)``, in one pass.

    Backward: x and residual both receive ``ds + drms_norm(s; dy)``, where dy and ds are the
    cotangents of y and of residual_out; an unused residual_out costs no read. Frozen inputs are
    skipped as in ``rms_norm``.

    Args:
        x, residual: ``(..., D)`` of the same shape and dtype (float32, bfloat16 or float16).
        weight, eps, offset, casting_mode, implementation, save: as in ``rms_norm``.

    Returns:
        ``(y, residual_out)`` where ``residual_out = s``; both ``(..., D)`` in x.dtype.

    Raises:
        TypeError, ValueError: at trace time, naming the argument, for a bad dtype, shape or option.
    """
    return _call(FUSED_ADD_RMS_NORM, x, residual, weight, eps=eps, offset=offset, casting_mode=casting_mode,
                 implementation=implementation, save=save)
