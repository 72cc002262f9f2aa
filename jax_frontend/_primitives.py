"""Two JAX primitives over 2-D rows: the forward launch and the backward launch (+ dW/dB reduction).

Why primitives rather than calling ``triton_call`` directly: jax-triton's ``triton_call`` refuses
vmap, and a ``pure_callback`` would run once per batch element. Each primitive carries its static
variant (``FwdSpec``/``BwdSpec``) and has

- an abstract rule (output shapes), so ``jit``/``eval_shape``/``scan`` trace it without launching;
- a batching rule that folds the batch axes into rows, so ``vmap`` (nested too) becomes one launch
  over ``batch * M`` rows. Where folding would change the meaning it runs the batch sequentially
  instead (``lax.map``): when the weight or bias is itself batched, and when the backward reduces
  dW/dB, because vmap semantics ask for one dW per batch element, and a folded launch would sum
  them;
- a lowering per platform ("cpu": the interpreter behind ``pure_callback``; "cuda"/"rocm":
  jax-triton), and an eager implementation that picks the platform of its input arrays.

The primitives are only ever called inside ``jax_frontend.functional``'s custom_vjp rules, so they
need no differentiation rules of their own; differentiating them (forward mode, or a second
derivative through the backward) raises ``FORWARD_MODE_ERROR``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir

from jax_frontend import _launch
from normkit import launch as plans

FWD_ROW_INPUTS = frozenset({"X", "R"})  # [M, N] (or [M]) arrays: batch axes fold into their rows
BWD_ROW_INPUTS = frozenset({"X", "DY", "DRES", "MEAN", "RSTD"})


@dataclasses.dataclass(frozen=True)
class FwdSpec:
    """The forward variant; ``store_stats`` only when a backward will run."""

    op: str
    eps: float
    offset: float
    casting: str
    store_stats: bool
    has_r: bool
    has_w: bool
    has_b: bool

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("X",) + ("R",) * self.has_r + ("W",) * self.has_w + ("B",) * self.has_b

    @property
    def outputs(self) -> tuple[str, ...]:
        mean = self.store_stats and self.op == "layer_norm"
        return ("Y",) + ("S",) * self.has_r + ("MEAN",) * mean + ("RSTD",) * self.store_stats


@dataclasses.dataclass(frozen=True)
class BwdSpec:
    """The backward variant: which gradients to compute, and the dtypes of dW/dB."""

    op: str
    offset: float
    casting: str
    compute_dx: bool
    compute_dw: bool
    compute_db: bool
    has_w: bool
    has_dres: bool
    w_dtype: str | None
    b_dtype: str | None

    @property
    def inputs(self) -> tuple[str, ...]:
        mean = self.op == "layer_norm"
        return ("X",) + ("W",) * self.has_w + ("DY",) + ("DRES",) * self.has_dres + ("MEAN",) * mean + ("RSTD",)

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("DX",) * self.compute_dx + ("DW",) * self.compute_dw + ("DB",) * self.compute_db


norm_fwd_p = jex.core.Primitive("normkit_norm_fwd")
norm_fwd_p.multiple_results = True
norm_bwd_p = jex.core.Primitive("normkit_norm_bwd")
norm_bwd_p.multiple_results = True


# ---------------------------------------------------------------------------------------------
# Shapes.


def _fwd_shapes(M: int, N: int, x_dtype, spec: FwdSpec) -> list:
    """(shape, dtype) of each output."""
    shapes = {"Y": ((M, N), x_dtype), "S": ((M, N), x_dtype), "MEAN": ((M,), jnp.float32), "RSTD": ((M,), jnp.float32)}
    return [shapes[name] for name in spec.outputs]


def _bwd_shapes(M: int, N: int, x_dtype, spec: BwdSpec) -> list:
    shapes = {"DX": ((M, N), x_dtype), "DW": ((N,), spec.w_dtype), "DB": ((N,), spec.b_dtype)}
    return [shapes[name] for name in spec.outputs]


def _avals(shapes_fn, x_aval, spec) -> list:
    """Output avals: x's, with new shapes and dtypes (sharding and the like follow x)."""
    return [x_aval.update(shape=shape, dtype=jnp.dtype(dtype), weak_type=False)
            for shape, dtype in shapes_fn(*x_aval.shape, x_aval.dtype, spec)]


norm_fwd_p.def_abstract_eval(lambda x, *_, spec: _avals(_fwd_shapes, x, spec))
norm_bwd_p.def_abstract_eval(lambda x, *_, spec: _avals(_bwd_shapes, x, spec))


# ---------------------------------------------------------------------------------------------
# Launch: plan, then run on the platform's path.


def _lowering_platform(platform: str) -> str:
    """A device or backend platform name ("cpu", "gpu", "cuda", "rocm") as a lowering platform."""
    return platform if platform in ("cpu", "rocm") else "cuda"


def _platform_of(arrays) -> str:
    """Eagerly: the platform the input arrays live on."""
    for a in arrays:
        devices = getattr(a, "devices", None)
        if devices is not None:
            return _lowering_platform(next(iter(devices())).platform)
    return _lowering_platform(jax.default_backend())


def _fwd_impl(*args, spec: FwdSpec, platform: str | None = None):
    platform = platform or _platform_of(args)
    arrays = dict(zip(spec.inputs, args))
    x = arrays["X"]
    M, N = x.shape
    if M == 0:
        return [jnp.zeros(shape, dtype) for shape, dtype in _fwd_shapes(M, N, x.dtype, spec)]
    call = plans.plan_forward(op=spec.op, M=M, N=N, x_dtype=_launch.dtype_name(x.dtype), has_w=spec.has_w,
                              has_b=spec.has_b, eps=spec.eps, offset=spec.offset, casting=spec.casting,
                              store_stats=spec.store_stats, num_sms=_launch.num_sms(platform))
    out = _launch.run(call, arrays, platform)
    return [out[name] for name in spec.outputs]


def _bwd_impl(*args, spec: BwdSpec, platform: str | None = None):
    platform = platform or _platform_of(args)
    arrays = dict(zip(spec.inputs, args))
    x = arrays["X"]
    M, N = x.shape
    if M == 0:  # no rows: dX is empty and dW/dB are sums of nothing
        return [jnp.zeros(shape, dtype) for shape, dtype in _bwd_shapes(M, N, x.dtype, spec)]
    call = plans.plan_backward(op=spec.op, M=M, N=N, x_dtype=_launch.dtype_name(x.dtype), has_w=spec.has_w,
                               has_dres=spec.has_dres, offset=spec.offset, casting=spec.casting,
                               compute_dx=spec.compute_dx, compute_dw=spec.compute_dw, compute_db=spec.compute_db,
                               num_sms=_launch.num_sms(platform))
    out = _launch.run(call, arrays, platform)
    red = plans.plan_reduce(call, w_dtype=spec.w_dtype if spec.compute_dw else None,
                            b_dtype=spec.b_dtype if spec.compute_db else None)
    if red is not None:
        out.update(_launch.run(red, out, platform))
    return [out[name] for name in spec.outputs]


norm_fwd_p.def_impl(_fwd_impl)
norm_bwd_p.def_impl(_bwd_impl)
for _platform in ("cpu", "cuda", "rocm"):
    mlir.register_lowering(norm_fwd_p, mlir.lower_fun(functools.partial(_fwd_impl, platform=_platform),
                                                      multiple_results=True), platform=_platform)
    mlir.register_lowering(norm_bwd_p, mlir.lower_fun(functools.partial(_bwd_impl, platform=_platform),
                                                      multiple_results=True), platform=_platform)


# ---------------------------------------------------------------------------------------------
# Differentiation: none (the custom_vjp above them is the gradient).

FORWARD_MODE_ERROR = (
    "normkit: forward-mode differentiation is not supported: the norm kernels have a custom VJP "
    "(reverse mode) but no JVP rule, so jax.jvp, jax.jacfwd, jax.linearize, jax.hessian and derivatives "
    "of the gradient do not work. Use jax.grad, jax.value_and_grad, jax.vjp or jax.jacrev.")


def _no_jvp(primals, tangents, **params):
    raise TypeError(FORWARD_MODE_ERROR)


ad.primitive_jvps[norm_fwd_p] = _no_jvp
ad.primitive_jvps[norm_bwd_p] = _no_jvp


# ---------------------------------------------------------------------------------------------
# vmap.


def _axis_size(args, dims) -> int:
    (size,) = {a.shape[d] for a, d in zip(args, dims) if d is not None}
    return size


def _sequential(prim, args, dims, spec):
    """One launch per batch element, in a loop (lax.map); outputs batched along axis 0."""
    mapped = [i for i, d in enumerate(dims) if d is not None]
    xs = tuple(jnp.moveaxis(args[i], dims[i], 0) for i in mapped)

    def one(slices):
        call_args = list(args)
        for i, s in zip(mapped, slices):
            call_args[i] = s
        return tuple(prim.bind(*call_args, spec=spec))

    outs = jax.lax.map(one, xs)
    return list(outs), [0] * len(outs)


def _folded(prim, args, dims, spec, row_inputs):
    """Batch axes folded into rows: one launch over ``size * M`` rows."""
    size = _axis_size(args, dims)
    folded = []
    for name, a, d in zip(spec.inputs, args, dims):
        if name in row_inputs:
            a = jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
            if name == "X":
                rows = a.shape[1]
            a = a.reshape((size * a.shape[1],) + a.shape[2:])
        folded.append(a)
    outs = prim.bind(*folded, spec=spec)
    # Row outputs [size*M, ...] -> [size, M, ...]; no output of a folded launch is per-column.
    return [o.reshape((size, rows) + o.shape[1:]) for o in outs], [0] * len(outs)


def _batched_params(spec, dims, row_inputs) -> bool:
    return any(d is not None for name, d in zip(spec.inputs, dims) if name not in row_inputs)


def _fwd_batch(args, dims, *, spec: FwdSpec):
    if _batched_params(spec, dims, FWD_ROW_INPUTS):
        return _sequential(norm_fwd_p, args, dims, spec)
    return _folded(norm_fwd_p, args, dims, spec, FWD_ROW_INPUTS)


def _bwd_batch(args, dims, *, spec: BwdSpec):
    if spec.compute_dw or spec.compute_db or _batched_params(spec, dims, BWD_ROW_INPUTS):
        return _sequential(norm_bwd_p, args, dims, spec)
    return _folded(norm_bwd_p, args, dims, spec, BWD_ROW_INPUTS)


batching.primitive_batchers[norm_fwd_p] = _fwd_batch
batching.primitive_batchers[norm_bwd_p] = _bwd_batch


# ---------------------------------------------------------------------------------------------
# Entry points used by the custom_vjp rules: None for an absent input or output.


def forward(op, eps, offset, casting, x, residual, weight, bias, *, store_stats):
    """(y, s, mean, rstd) over rows x [M, N]; s, mean and rstd are None where not produced."""
    spec = FwdSpec(op=op, eps=eps, offset=offset, casting=casting, store_stats=store_stats,
                   has_r=residual is not None, has_w=weight is not None, has_b=bias is not None)
    args = [a for a in (x, residual, weight, bias) if a is not None]
    out = dict(zip(spec.outputs, norm_fwd_p.bind(*args, spec=spec)))
    return out["Y"], out.get("S"), out.get("MEAN"), out.get("RSTD")


def backward(op, offset, casting, x, weight, dy, dres, mean, rstd, *, compute_dx, compute_dw, compute_db,
             w_dtype, b_dtype):
    """(dx, dw, db); each None where not computed."""
    spec = BwdSpec(op=op, offset=offset, casting=casting, compute_dx=compute_dx, compute_dw=compute_dw,
                   compute_db=compute_db, has_w=weight is not None, has_dres=dres is not None,
                   w_dtype=w_dtype if compute_dw else None, b_dtype=b_dtype if compute_db else None)
    args = [x] + [weight] * spec.has_w + [dy] + [dres] * spec.has_dres + [mean] * (op == "layer_norm") + [rstd]
    out = dict(zip(spec.outputs, norm_bwd_p.bind(*args, spec=spec)))
    return out.get("DX"), out.get("DW"), out.get("DB")
