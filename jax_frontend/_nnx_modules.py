"""normkit's norms as Flax NNX modules: ``RMSNorm`` and ``LayerNorm`` subclass ``flax.nnx.RMSNorm`` and
``flax.nnx.LayerNorm`` and replace only their ``__call__``; ``FusedAddRMSNorm`` has RMSNorm's parameters.

Construction is flax's own (the same arguments, defaults, ``scale``/``bias`` ``nnx.Param`` objects and
static attributes), so state moves between flax's modules and these unchanged. Each call runs the
``jax_frontend`` function; its keyword arguments are built in one method, ``_function_kwargs``.

Dtypes follow flax: ``promote_dtype((x, scale[, bias]), dtype=self.dtype)`` first (``dtype=None``:
``jnp.result_type`` of the input and the parameters; a bf16 input with the default float32
``param_dtype`` is computed, and returned, in float32), then the kernel in that dtype with float32
statistics and one rounding at the end, which is flax's math (``casting_mode="gemma"`` for RMSNorm).
"""
from __future__ import annotations

import operator
from collections.abc import Iterable
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from jax.sharding import PartitionSpec as P

from jax_frontend import functional
from normkit import checks
from normkit.ops import LAYER_NORM, MAX_N, RMS_NORM, X_DTYPES

__all__ = ["RMSNorm", "LayerNorm", "FusedAddRMSNorm", "unsupported"]

FLAX_CASTING_MODE = "gemma"  # flax's RMSNorm: fp32 statistics and product, one rounding at the end


# ---------------------------------------------------------------------------------------------
# What the kernels cannot compute. One function serves the constructors (which raise) and
# patch_model (which skips the module, giving the reason).


def _one_axis(axes) -> int | None:
    """The axis of ``axes`` (an int or an iterable of one int, as flax canonicalizes it), or None."""
    axes = tuple(axes) if isinstance(axes, Iterable) else (axes,)
    if len(axes) != 1 or isinstance(axes[0], bool):
        return None
    try:
        return operator.index(axes[0])
    except TypeError:
        return None


def _dtype_name(dtype) -> str | None:
    try:
        return jnp.dtype(dtype).name
    except TypeError:
        return None


def unsupported(*, num_features, dtype, param_dtype, reduction_axes, feature_axes, axis_name,
                axis_index_groups) -> str | None:
    """Why normkit cannot compute a flax norm with these settings (naming the argument), or None.

    The kernels normalize each row over its last axis, on the device that holds the row, in
    float32, bfloat16 or float16. A non-negative axis can only be checked against the input's rank,
    at the call.
    """
    for name, axes in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
        axis = _one_axis(axes)
        if axis is None or (axis < 0 and axis != -1):
            return f"{name}={axes!r}: normkit normalizes over one axis, the last (-1)"
    if axis_name is not None:
        return (f"axis_name={axis_name!r}: normkit computes each row's statistics on the device that holds the "
                "row; statistics across devices (lax.pmean over a named axis) are not supported. Under jit on a "
                "mesh, shard the rows (leading axes) instead: each device then normalizes its own rows")
    if axis_index_groups is not None:
        return "axis_index_groups: statistics across devices are not supported (see axis_name)"
    if isinstance(num_features, bool) or not isinstance(num_features, int) or not 1 <= num_features <= MAX_N:
        return f"num_features={num_features!r}: normkit supports 1..{MAX_N} features"
    if dtype is not None and _dtype_name(dtype) not in X_DTYPES:
        return f"dtype={dtype!r}: normkit's kernels compute in {', '.join(X_DTYPES)}"
    if dtype is None and _dtype_name(param_dtype) not in X_DTYPES:
        return (f"param_dtype={param_dtype!r} with dtype=None: flax would promote the input to it, and normkit's "
                f"kernels compute in {', '.join(X_DTYPES)}; give dtype=")
    return None


def _check_construction(**settings) -> None:
    reason = unsupported(**settings)
    if reason is not None:
        raise ValueError(f"normkit: {reason}")


def _check_options(op, *, epsilon, offset=0.0, casting_mode=FLAX_CASTING_MODE, implementation=None,
                   save="auto") -> None:
    op.options(eps=epsilon, offset=offset, casting_mode=casting_mode)  # raises, naming a bad option
    checks.check_save(save)
    if implementation is not None and implementation not in functional.IMPLEMENTATIONS:
        raise ValueError(f"normkit: unknown implementation {implementation!r}; expected None or one of "
                         f"{functional.IMPLEMENTATIONS}")


# ---------------------------------------------------------------------------------------------
# The call, shared by the three modules.


class _Call:
    """The call path of a normkit module: flax's checks and dtype promotion, then the function."""

    # A mixin placed after flax's class that adds no instance layout, so that flax's class is each
    # module's base and patch_model can give a flax module normkit's subclass (``__class__``).
    __slots__ = ()
    _function = None  # the jax_frontend function (a staticmethod in each module class)
    # normkit's options: static attributes named as the function's keyword arguments.
    OPTIONS: tuple[str, ...] = ()
    # The options' values under which the module computes what flax's class computes (patch_model sets
    # them; unpatch_model restores flax's class only where they hold).
    FLAX_OPTIONS: dict = {}

    def _function_kwargs(self) -> dict:
        """The keyword arguments of ``self._function``: every option of a call, in one place."""
        return {"eps": self.epsilon, **{name: getattr(self, name) for name in self.OPTIONS}}

    def _check_call(self, x, mask) -> None:
        if mask is not None:
            raise ValueError(f"normkit: {type(self).__name__} takes no mask=: the kernels normalize every element "
                             "of a row (use flax.nnx's module for masked statistics)")
        ndim = jnp.ndim(x)
        for name in ("reduction_axes", "feature_axes"):
            axis = _one_axis(getattr(self, name))
            if ndim == 0 or axis not in (-1, ndim - 1):
                raise ValueError(f"normkit: {name}={getattr(self, name)!r} is not the last axis of an input of "
                                 f"shape {jnp.shape(x)}; normkit normalizes over the last axis")

    def _run(self, x, *args, params, mask):
        """``self._function`` on ``x``, ``args`` (the residual) and ``params`` (scale[, bias]), all promoted
        together as flax promotes them; the output in flax's output dtype."""
        self._check_call(x, mask)
        promoted = self.promote_dtype((x, *args, *params), dtype=self.dtype)
        rows = _whole_rows(*promoted[:1 + len(args)])
        out = self._function(*rows, *promoted[1 + len(args):], **self._function_kwargs())
        out_dtype = dtypes.canonicalize_dtype(*promoted, dtype=self.dtype)
        return jax.tree.map(lambda a: a if a.dtype == out_dtype else a.astype(out_dtype), out)


def _whole_rows(*arrays):
    """Under a mesh whose axes are all Auto (``jax.set_mesh``), ``arrays`` constrained to be whole along
    their last (normalized) axis, their leading axes left to XLA.

    The kernels need each row on one device. With Auto axes the partitioner's propagation would
    otherwise carry a feature-axis sharding into the norm's input, from a parameter sharded along its
    features (``nnx.with_partitioning(..., ("model",))``, FSDP) or from a tensor-parallel neighbour,
    and normkit would reject it at compile time. Where the model's own sharding splits that axis,
    XLA instead gathers it before the norm, as it would for any op that needs whole rows. Explicit axes
    state their sharding in the types (normkit then gathers sharded parameters itself); without a
    mesh set there is nothing to constrain.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
        return arrays
    spec = lambda a: P(*([P.UNCONSTRAINED] * (a.ndim - 1)), None)  # noqa: E731
    return tuple(jax.lax.with_sharding_constraint(a, spec(a)) for a in arrays)


def _value(param):
    return None if param is None else param[...]


def set_options(module, cls: type, **options) -> None:
    """Set ``module``'s normkit options (exactly ``cls.OPTIONS``, normkit's class of the module), as
    static attributes."""
    assert set(options) == set(cls.OPTIONS), (sorted(options), cls.OPTIONS)
    for name, value in options.items():
        setattr(module, name, value)


def _identity_scale(offset: float):
    """The scale that makes ``scale + offset == 1``: flax's ``ones`` for offset 0."""
    return initializers.ones if offset == 0 else initializers.constant(1.0 - offset)


# ---------------------------------------------------------------------------------------------
# Modules.


class RMSNorm(nnx.RMSNorm, _Call):
    """RMSNorm over the last axis, ``y = x / sqrt(mean(x**2) + epsilon) * (scale + offset)``, through
    ``jax_frontend.rms_norm``: a drop-in for ``flax.nnx.RMSNorm`` (a subclass of it).

    The constructor takes flax's arguments, with flax's defaults, and builds the same ``scale``
    ``nnx.Param``; what normkit cannot do raises here, naming the argument: ``reduction_axes`` or
    ``feature_axes`` other than the last axis, ``axis_name``/``axis_index_groups`` (statistics across
    devices), a dtype outside float32/bfloat16/float16. ``use_fast_variance`` is kept as an attribute;
    RMSNorm has no mean, so it changes nothing in flax either. The call takes no ``mask``.

    Dtypes as flax: x and scale promoted by ``promote_dtype(..., dtype=self.dtype)``, float32
    statistics, the result in the promoted dtype.

    normkit's options (static attributes):
        offset: added to the scale (Gemma: 1.0). With ``scale_init=None`` (the default) the scale
            starts at ``1 - offset``, so the module starts as the identity scale; for offset 0 that is
            flax's ``initializers.ones``.
        casting_mode: ``"gemma"`` (the default: all in float32, one rounding at the end, which is
            flax's math), ``"llama"`` (x_hat rounded to the dtype before the product) or ``"none"``;
            see ``jax_frontend.rms_norm``.
        implementation: ``None`` (auto), ``"triton"``, ``"pallas"`` or ``"xla"``.
        save: what the backward keeps, ``"auto"`` (default), ``"input"`` or ``"output"``; see
            ``jax_frontend.rms_norm``. With ``"auto"``, a frozen scale with no offset keeps the output y
            rather than x: one activation less per norm in a LoRA step.

    Frozen by filter: a ``scale`` outside what ``nnx.grad`` differentiates (e.g.
    ``argnums=nnx.DiffState(0, nnx.LoRAParam)``) runs the kernel variant without dW.
    """

    _function = staticmethod(functional.rms_norm)
    OPTIONS = ("offset", "casting_mode", "implementation", "save")
    FLAX_OPTIONS = {"offset": 0.0, "casting_mode": FLAX_CASTING_MODE}

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None, param_dtype=jnp.float32,
                 use_scale: bool = True, scale_init=None, reduction_axes=-1, feature_axes=-1, axis_name=None,
                 axis_index_groups=None, use_fast_variance: bool = True, promote_dtype=dtypes.promote_dtype,
                 rngs: nnx.Rngs, scale_metadata=MappingProxyType({}), offset: float = 0.0,
                 casting_mode: str = FLAX_CASTING_MODE, implementation: str | None = None, save: str = "auto"):
        _check_construction(num_features=num_features, dtype=dtype, param_dtype=param_dtype,
                            reduction_axes=reduction_axes, feature_axes=feature_axes, axis_name=axis_name,
                            axis_index_groups=axis_index_groups)
        _check_options(RMS_NORM, epsilon=epsilon, offset=offset, casting_mode=casting_mode,
                       implementation=implementation, save=save)
        # flax's constructor, named rather than super(): FusedAddRMSNorm shares this __init__.
        scale_init = _identity_scale(offset) if scale_init is None else scale_init
        nnx.RMSNorm.__init__(self, num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                             use_scale=use_scale, scale_init=scale_init,
                             reduction_axes=reduction_axes, feature_axes=feature_axes, axis_name=axis_name,
                             axis_index_groups=axis_index_groups, use_fast_variance=use_fast_variance,
                             promote_dtype=promote_dtype, rngs=rngs, scale_metadata=scale_metadata)
        set_options(self, type(self), offset=float(offset), casting_mode=casting_mode, implementation=implementation,
                    save=save)

    def __call__(self, x, mask=None):
        """``(..., num_features)`` in, the same shape out, in the promoted dtype."""
        return self._run(x, params=(_value(self.scale),), mask=mask)


class LayerNorm(nnx.LayerNorm, _Call):
    """LayerNorm over the last axis, ``y = (x - mean) / sqrt(var + epsilon) * scale + bias``, through
    ``jax_frontend.layer_norm``: a drop-in for ``flax.nnx.LayerNorm`` (a subclass of it).

    Construction, errors and dtypes as ``RMSNorm``. ``use_fast_variance`` is kept as an attribute
    but the kernels always take the variance of the centered values, ``mean((x - mean)**2)`` in
    float32 (flax's ``use_fast_variance=False``); flax's default, ``E[x**2] - E[x]**2``, can lose
    digits when ``|mean| >> std``, so normkit's result is the more accurate one there.

    normkit's options: ``implementation`` and ``save`` (as ``RMSNorm``; with ``"auto"``, a LayerNorm
    with a bias keeps its input under ``nnx.jit``, where the values that would allow otherwise are
    unseen).
    """

    _function = staticmethod(functional.layer_norm)
    OPTIONS = ("implementation", "save")

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None, param_dtype=jnp.float32,
                 use_bias: bool = True, use_scale: bool = True, bias_init=initializers.zeros_init(),
                 scale_init=initializers.ones_init(), reduction_axes=-1, feature_axes=-1, axis_name=None,
                 axis_index_groups=None, use_fast_variance: bool = True, promote_dtype=dtypes.promote_dtype,
                 rngs: nnx.Rngs, bias_metadata=MappingProxyType({}), scale_metadata=MappingProxyType({}),
                 implementation: str | None = None, save: str = "auto"):
        _check_construction(num_features=num_features, dtype=dtype, param_dtype=param_dtype,
                            reduction_axes=reduction_axes, feature_axes=feature_axes, axis_name=axis_name,
                            axis_index_groups=axis_index_groups)
        _check_options(LAYER_NORM, epsilon=epsilon, implementation=implementation, save=save)
        super().__init__(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, use_bias=use_bias,
                         use_scale=use_scale, bias_init=bias_init, scale_init=scale_init,
                         reduction_axes=reduction_axes, feature_axes=feature_axes, axis_name=axis_name,
                         axis_index_groups=axis_index_groups, use_fast_variance=use_fast_variance,
                         promote_dtype=promote_dtype, rngs=rngs, bias_metadata=bias_metadata,
                         scale_metadata=scale_metadata)
        set_options(self, type(self), implementation=implementation, save=save)

    def __call__(self, x, *, mask=None):
        """``(..., num_features)`` in, the same shape out, in the promoted dtype."""
        return self._run(x, params=(_value(self.scale), _value(self.bias)), mask=mask)


class FusedAddRMSNorm(nnx.Module, _Call):
    """``(y, s)`` with ``s = x + residual`` and ``y = rms_norm(s)``, in one pass: the pre-norm residual
    stream's add and the next norm, through ``jax_frontend.fused_add_rms_norm``::

        h, residual = self.post_attention_norm(attn_out, residual)

    The constructor, the parameters (``scale``), the options and the errors are ``RMSNorm``'s, so a
    ``FusedAddRMSNorm`` loads an ``nnx.RMSNorm``'s state. x, residual and scale are promoted together
    as flax promotes a norm's input and scale; ``s`` and ``y`` are in the promoted dtype (so ``s`` is
    the sum rounded once, to that dtype). It is not an ``nnx.RMSNorm``: it takes two inputs and
    returns two outputs.
    """

    _function = staticmethod(functional.fused_add_rms_norm)
    OPTIONS = RMSNorm.OPTIONS

    __init__ = RMSNorm.__init__  # flax's RMSNorm constructor: the same attributes and ``scale``

    def __call__(self, x, residual, mask=None):
        """``x`` and ``residual``: ``(..., num_features)`` of one shape; returns ``(y, x + residual)``."""
        return self._run(x, residual, params=(_value(self.scale),), mask=mask)
