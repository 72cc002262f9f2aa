"""The Triton implementation: ``normkit.kernels.norm`` as two JAX primitives over 2-D rows, the
forward launch and the backward launch (+ dW/dB reduction), each run by ``normkit.driver``.

Why primitives rather than calling ``triton_call`` directly: jax-triton's ``triton_call`` refuses
vmap, and a ``pure_callback`` would run once per batch element. Each primitive carries its static
variant (``FwdSpec``/``BwdSpec``) and has

- an abstract rule (output shapes), so ``jit``/``eval_shape``/``scan`` trace it without launching;
- a batching rule that folds the batch axes into rows, so ``vmap`` (nested too) becomes one launch
  over ``batch * M`` rows. Where folding would change the meaning it runs the batch sequentially
  instead (``lax.map``): when the weight or bias is itself batched, and when the backward reduces
  dW/dB, because vmap semantics ask for one dW per batch element, and a folded launch would sum
  them;
- a lowering per platform ("cpu": the interpreter behind a host callback; "cuda"/"rocm":
  jax-triton, ``jax_frontend._launch``), and an eager implementation that picks the platform of its
  input arrays.

The primitives are only ever called inside ``jax_frontend.functional``'s custom_vjp rules, so they
need no differentiation rules of their own; differentiating them (forward mode, or a second
derivative through the backward) raises ``FORWARD_MODE_ERROR``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_frontend import _compat, _launch
from jax_frontend._implementation import FORWARD_MODE_ERROR
from normkit import driver
from normkit.ops import Grads, Op, Options

FWD_ROW_INPUTS = frozenset({"X", "R"})  # [M, N] (or [M]) arrays: batch axes fold into their rows
BWD_ROW_INPUTS = frozenset({"X", "DY", "DRES", "MEAN", "RSTD"})


@dataclasses.dataclass(frozen=True)
class FwdSpec:
    """The forward variant (the primitive's static parameter); ``store_stats`` only when a backward
    will run."""

    op: Op
    opts: Options
    store_stats: bool
    has_w: bool
    has_b: bool
    store_rec: bool = False  # also the weight's recovery (REC), for a backward that reads y

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("X",) + ("R",) * self.op.has_residual + ("W",) * self.has_w + ("B",) * self.has_b

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(self.op.fwd_buffers(1, 1, "float32", self.store_stats, self.store_rec))

    def buffers(self, M: int, N: int, x_dtype: str) -> list:
        return list(self.op.fwd_buffers(M, N, x_dtype, self.store_stats, self.store_rec).values())


@dataclasses.dataclass(frozen=True)
class BwdSpec:
    """The backward variant: which gradients to compute, and dB's dtype (dW takes the weight's)."""

    op: Op
    opts: Options
    grads: Grads
    has_w: bool
    has_dres: bool
    b_dtype: str | None
    from_output: bool = False  # X is the forward's output y (dx alone; no mean; the bias read if has_b; REC)
    has_b: bool = False

    @property
    def inputs(self) -> tuple[str, ...]:
        return (("X",) + ("W",) * self.has_w + ("B",) * self.has_b + ("DY",) + ("DRES",) * self.has_dres
                + ("MEAN",) * (self.op.saves_mean and not self.from_output) + ("RSTD",) + ("REC",) * self.from_output)

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(self.op.bwd_buffers(1, 1, "float32", self.grads, "float32", "float32"))

    def buffers(self, M: int, N: int, x_dtype: str, w_dtype: str | None) -> list:
        return list(self.op.bwd_buffers(M, N, x_dtype, self.grads, w_dtype, self.b_dtype).values())


norm_fwd_p = _compat.new_primitive("normkit_norm_fwd")
norm_bwd_p = _compat.new_primitive("normkit_norm_bwd")


# ---------------------------------------------------------------------------------------------
# Shapes: the op table's buffers, so the abstract rules cannot drift from what the kernels write.


def _aval(x_aval, shape, dtype):
    """An output aval: x's, with a new shape and dtype (sharding and the like follow x)."""
    return x_aval.update(shape=shape, dtype=jnp.dtype(dtype), weak_type=False)


def _fwd_abstract(x, *_, spec: FwdSpec):
    return [_aval(x, shape, dtype) for shape, dtype in spec.buffers(*x.shape, _launch.dtype_name(x.dtype))]


def _bwd_abstract(x, *args, spec: BwdSpec):
    w_dtype = _launch.dtype_name(args[0].dtype) if spec.has_w else None
    return [_aval(x, shape, dtype) for shape, dtype in spec.buffers(*x.shape, _launch.dtype_name(x.dtype), w_dtype)]


norm_fwd_p.def_abstract_eval(_fwd_abstract)
norm_bwd_p.def_abstract_eval(_bwd_abstract)


# ---------------------------------------------------------------------------------------------
# Launch: the driver, with the backend of the platform the computation runs on.


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
    backend = _launch.backend(platform or _platform_of(args))
    a = dict(zip(spec.inputs, args))
    outs = driver.forward(backend, spec.op, a["X"], a.get("R"), a.get("W"), a.get("B"), spec.opts, spec.store_stats,
                          spec.store_rec)
    return [t for t in outs if t is not None]


def _bwd_impl(*args, spec: BwdSpec, platform: str | None = None):
    backend = _launch.backend(platform or _platform_of(args))
    a = dict(zip(spec.inputs, args))
    outs = driver.backward(backend, spec.op, a["X"], a.get("W"), a["DY"], a.get("DRES"), a.get("MEAN"), a["RSTD"],
                           spec.opts, spec.grads, spec.b_dtype, a.get("B"), spec.from_output, a.get("REC"))
    return [t for t in outs if t is not None]


norm_fwd_p.def_impl(_fwd_impl)
norm_bwd_p.def_impl(_bwd_impl)
for _platform in ("cpu", "cuda", "rocm"):
    _compat.register_lowering(norm_fwd_p, _compat.lower_fun(functools.partial(_fwd_impl, platform=_platform),
                                                            multiple_results=True), platform=_platform)
    _compat.register_lowering(norm_bwd_p, _compat.lower_fun(functools.partial(_bwd_impl, platform=_platform),
                                                            multiple_results=True), platform=_platform)


# ---------------------------------------------------------------------------------------------
# Differentiation: none (the custom_vjp above them is the gradient).

def _no_jvp(primals, tangents, **params):
    raise TypeError(FORWARD_MODE_ERROR)


_compat.register_jvp(norm_fwd_p, _no_jvp)
_compat.register_jvp(norm_bwd_p, _no_jvp)


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
    # Row outputs [size*M, ...] -> [size, M, ...]; the weight's recovery (REC) is one for the whole batch
    # (no other output of a folded launch is per-column).
    names = spec.outputs
    return ([o if name == "REC" else o.reshape((size, rows) + o.shape[1:]) for name, o in zip(names, outs)],
            [batching.not_mapped if name == "REC" else 0 for name in names])


def _batched_params(spec, dims, row_inputs) -> bool:
    return any(d is not None for name, d in zip(spec.inputs, dims) if name not in row_inputs)


def _fwd_batch(args, dims, *, spec: FwdSpec):
    if _batched_params(spec, dims, FWD_ROW_INPUTS):
        return _sequential(norm_fwd_p, args, dims, spec)
    return _folded(norm_fwd_p, args, dims, spec, FWD_ROW_INPUTS)


def _bwd_batch(args, dims, *, spec: BwdSpec):
    if spec.grads.reduces or _batched_params(spec, dims, BWD_ROW_INPUTS):
        return _sequential(norm_bwd_p, args, dims, spec)
    return _folded(norm_bwd_p, args, dims, spec, BWD_ROW_INPUTS)


_compat.register_batching(norm_fwd_p, _fwd_batch)
_compat.register_batching(norm_bwd_p, _bwd_batch)


# ---------------------------------------------------------------------------------------------
# Entry points: jax_frontend._implementation.Implementation.


def forward(op: Op, x, residual, weight, bias, *, opts: Options, store_stats: bool, store_rec: bool = False) -> dict:
    """The forward's buffers by name (op.fwd_buffers) over rows x [M, N]; ``store_rec``: REC too."""
    spec = FwdSpec(op=op, opts=opts, store_stats=store_stats, has_w=weight is not None, has_b=bias is not None,
                   store_rec=store_rec)
    args = [a for a in (x, residual, weight, bias) if a is not None]
    return dict(zip(spec.outputs, norm_fwd_p.bind(*args, spec=spec)))


def backward(op: Op, x, weight, dy, dres, mean, rstd, *, opts: Options, grads: Grads, b_dtype: str | None,
             bias=None, from_output: bool = False, rec=None) -> dict:
    """The backward's results by name (op.bwd_buffers): DX, DW, DB as ``grads`` asks (dW in the weight's
    dtype, dB in ``b_dtype``); ``from_output``: x is the forward's output y (``Implementation``)."""
    has_b = from_output and bias is not None
    spec = BwdSpec(op=op, opts=opts, grads=grads, has_w=weight is not None, has_dres=dres is not None,
                   b_dtype=b_dtype if grads.db else None, from_output=from_output, has_b=has_b)
    args = ([x] + [weight] * spec.has_w + [bias] * has_b + [dy] + [dres] * spec.has_dres
            + [mean] * (op.saves_mean and not from_output) + [rstd] + [rec] * from_output)
    return dict(zip(spec.outputs, norm_bwd_p.bind(*args, spec=spec)))
