"""Every private, undocumented or version-dependent JAX / jaxlib / Flax entry point the JAX frontend uses,
each as one small named function or constant. A reader sees the whole list of bets here; an upgrade
that breaks one breaks here, loudly (``MissingAPI`` names the entry and what it needs), and each
entry has a self-test on CPU in ``tests/test_compat_jax.py``.

"Private" is in the sense of JAX's API compatibility page: ``jax._src``, ``jax.core``,
``jax.interpreters``, ``jax.extend`` and ``jax.experimental`` are outside its compatibility policy,
and jaxlib's FFI target names and the lowering context's attributes are documented nowhere.

Checked by ``tests/test_compat_jax.py`` on jax/jaxlib 0.10.2 (CPU) with flax 0.12.8, and on jax/jaxlib
0.11.2 with flax 0.12.10 (on a CUDA machine: its default CUDA backend, and JAX_PLATFORMS=cpu).

The entries:

- primitives and their rules: ``new_primitive``, ``lower_fun``, ``register_lowering``,
  ``register_jvp``, ``register_batching``;
- lowering internals: ``require_devices_during_lowering``, ``lowering_device_assignment``,
  ``lowering_platforms``;
- host callbacks routed past ``jax.pure_callback``: ``host_callback_index``,
  ``CPU_CALLBACK_TARGET``, ``call_host_callback``;
- ``custom_partitioning`` (and the ``def_partition`` keywords normkit passes);
- ``SymbolicZero`` (``jax.custom_vjp(symbolic_zeros=True)``'s cotangent marker);
- Pallas's Triton lowering, deprecated in jax 0.11: ``pallas_triton``;
- the manual-axis ("varying") type of an array inside ``shard_map``: ``varying_axes``,
  ``varying_like``, ``pcast_varying``;
- a CUDA device's SM count: ``device_core_count``;
- Flax: ``set_class`` (a module's ``__class__`` changed past ``nnx.Module.__setattr__``).

Not here, on purpose:

- ``jax.experimental.pallas`` itself (``pallas_call``, ``BlockSpec``, ``program_id``, ...): the
  kernel language of the Pallas implementation, ``jax_frontend/_pallas.py`` and
  ``normkit/kernels/norm_pallas.py``, whose tests (``tests/test_pallas_impl.py``) are its check;
- ``jax_frontend._launch.import_jax_triton``: jax-triton's pinned version (0.3.1) and its import-time
  ``TRITON_CACHE_DIR`` bug, a third-party package rather than JAX; tested in ``tests/test_jax.py``;
- ``jax.core.Tracer`` in ``jax_frontend.functional._saves_output`` (whether the parameters' values
  are known), code of the save decision, left to its owners.
"""
from __future__ import annotations

import functools
import inspect

import jax
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.experimental.custom_partitioning import custom_partitioning as _custom_partitioning
from jax.interpreters import ad, batching, mlir

__all__ = [
    "MissingAPI", "new_primitive", "lower_fun", "register_lowering", "register_jvp", "register_batching",
    "require_devices_during_lowering", "lowering_device_assignment", "lowering_platforms", "host_callback_index",
    "CPU_CALLBACK_TARGET", "call_host_callback", "custom_partitioning", "DEF_PARTITION_KEYWORDS", "SymbolicZero",
    "pallas_triton", "varying_field", "varying_axes", "varying_like", "pcast_varying", "device_core_count",
    "set_class",
]


class MissingAPI(ImportError):
    """A private or version-dependent entry point of this module is gone or has changed."""


def _missing(entry: str, what: str) -> MissingAPI:
    return MissingAPI(f"normkit: jax_frontend._compat.{entry} needs {what}, which jax {jax.__version__} does not "
                      "provide as it did in jax 0.10.2 and 0.11.2 (see the entry's docstring for its fallback)")


# ---------------------------------------------------------------------------------------------
# Primitives and their rules (jax.extend, jax.interpreters).


def new_primitive(name: str):
    """A new primitive with several results: ``jax.extend.core.Primitive(name)`` with
    ``multiple_results = True``.

    Needs: ``jax.extend.core.Primitive`` (jax.extend: "no compatibility guarantee"). Fallback: none;
    a JAX without it has no way for a library to define a primitive (``jax.core.Primitive`` is
    deprecated since jax 0.10)."""
    try:
        from jax.extend.core import Primitive
    except ImportError as err:
        raise _missing("new_primitive", "jax.extend.core.Primitive") from err
    prim = Primitive(name)
    prim.multiple_results = True
    return prim


def lower_fun(fun, multiple_results: bool):
    """A lowering rule that traces ``fun`` and lowers it inline: ``jax.interpreters.mlir.lower_fun``.

    Needs: ``mlir.lower_fun(fun, multiple_results=...)`` returning ``rule(ctx, *args)``. Fallback: none
    public (``jax.extend.mlir`` has no lowering registry in 0.10/0.11)."""
    try:
        fn = mlir.lower_fun
    except AttributeError as err:
        raise _missing("lower_fun", "jax.interpreters.mlir.lower_fun") from err
    return fn(fun, multiple_results=multiple_results)


def register_lowering(prim, rule, platform: str | None = None) -> None:
    """Register ``rule(ctx, *args, **params)`` as ``prim``'s lowering (for ``platform``, or every one):
    ``jax.interpreters.mlir.register_lowering``. Fallback: none public."""
    try:
        fn = mlir.register_lowering
    except AttributeError as err:
        raise _missing("register_lowering", "jax.interpreters.mlir.register_lowering") from err
    if platform is None:
        fn(prim, rule)
    else:
        fn(prim, rule, platform=platform)


def register_jvp(prim, rule) -> None:
    """Register ``rule(primals, tangents, **params)`` as ``prim``'s JVP: the registry
    ``jax.interpreters.ad.primitive_jvps``. Fallback: none public."""
    try:
        registry = ad.primitive_jvps
    except AttributeError as err:
        raise _missing("register_jvp", "jax.interpreters.ad.primitive_jvps") from err
    registry[prim] = rule


def register_batching(prim, rule) -> None:
    """Register ``rule(args, dims, **params) -> (outs, out_dims)`` as ``prim``'s vmap rule: the registry
    ``jax.interpreters.batching.primitive_batchers``. Fallback: none public."""
    try:
        registry = batching.primitive_batchers
    except AttributeError as err:
        raise _missing("register_batching", "jax.interpreters.batching.primitive_batchers") from err
    registry[prim] = rule


# ---------------------------------------------------------------------------------------------
# Lowering internals (jax._src; the lowering context's attributes).


def require_devices_during_lowering(prim) -> None:
    """Make ``jit`` lower any computation holding ``prim`` with its device assignment known (which
    ``custom_partitioning`` needs, and ``lowering_device_assignment`` reads).

    Needs: the set ``jax._src.dispatch.prim_requires_devices_during_lowering`` (the same registration
    ``jax.nn.dot_product_attention``'s cuDNN path makes). Fallback: none; without it a partitioned
    computation would lower as if on one device, so its absence raises."""
    try:
        from jax._src import dispatch

        registry = dispatch.prim_requires_devices_during_lowering
    except (ImportError, AttributeError) as err:
        raise _missing("require_devices_during_lowering",
                       "jax._src.dispatch.prim_requires_devices_during_lowering") from err
    registry.add(prim)


def lowering_device_assignment(ctx):
    """The devices the module being lowered is compiled for, or None where its axis context has none
    (a ``shard_map`` body, already per device; a primitive not in ``require_devices_during_lowering``).

    Needs: ``ctx.module_context.axis_context`` (its ``device_assignment`` is read with a None default).
    Fallback: none."""
    try:
        axis_context = ctx.module_context.axis_context
    except AttributeError as err:
        raise _missing("lowering_device_assignment", "ctx.module_context.axis_context in a lowering rule") from err
    return getattr(axis_context, "device_assignment", None)


def lowering_platforms(ctx) -> tuple:
    """The platforms the module being lowered is for, e.g. ``("cpu",)``.

    Needs: ``ctx.module_context.platforms``. Fallback: none (``jax.lax.platform_dependent`` chooses by
    platform, but cannot tell a rule which platform it lowers for)."""
    try:
        return tuple(ctx.module_context.platforms)
    except AttributeError as err:
        raise _missing("lowering_platforms", "ctx.module_context.platforms in a lowering rule") from err


# ---------------------------------------------------------------------------------------------
# Host callbacks registered by hand (jax._src.callback's own mechanism, see _launch.routed_host_callbacks).

# The jaxlib FFI target ``jax.pure_callback`` lowers to on CPU (jax._src.callback, "xla_ffi_python_cpu_callback").
CPU_CALLBACK_TARGET = "xla_ffi_python_cpu_callback"


def host_callback_index(module_context, callback) -> int:
    """The index of ``callback`` among the host callbacks of the module being lowered (``module_context``:
    a lowering rule's ``ctx.module_context``), registering it on first use: the index
    ``call_host_callback`` takes.

    Needs: ``module_context.host_callbacks`` (a list the executable receives) and
    ``module_context.add_host_callback``, as ``jax.pure_callback``'s lowering uses them. Fallback: none
    (``jax.pure_callback`` is the public way, and is what normkit uses outside custom_partitioning)."""
    try:
        callbacks, add = module_context.host_callbacks, module_context.add_host_callback
    except AttributeError as err:
        raise _missing("host_callback_index",
                       "module_context.host_callbacks and module_context.add_host_callback") from err
    for index, registered in enumerate(callbacks):
        if registered is callback:
            return index
    add(callback)
    return len(module_context.host_callbacks) - 1


def call_host_callback(index: int, out_shape, *operands):
    """Call the host callback registered at ``index`` (``host_callback_index``) on ``operands``, on CPU:
    ``callback(*host_arrays) -> tuple of arrays`` shaped as ``out_shape``.

    Needs: jaxlib's FFI target ``CPU_CALLBACK_TARGET`` with its ``index`` attribute (uint64), the
    convention of ``jax.pure_callback``'s CPU lowering. Fallback: ``jax.pure_callback``."""
    return jax.ffi.ffi_call(CPU_CALLBACK_TARGET, out_shape)(*operands, index=np.uint64(index))


# ---------------------------------------------------------------------------------------------
# custom_partitioning and custom_vjp's symbolic zeros.

# The keywords of ``custom_partitioning.def_partition`` normkit passes (need_replication_factors: jax >= 0.7).
DEF_PARTITION_KEYWORDS = ("partition", "infer_sharding_from_operands", "sharding_rule", "need_replication_factors")


def custom_partitioning(fun):
    """``jax.experimental.custom_partitioning.custom_partitioning(fun)``; normkit calls its
    ``def_partition`` with ``DEF_PARTITION_KEYWORDS``.

    Needs: those keywords (the Shardy ``sharding_rule`` as a string, ``need_replication_factors``).
    Fallback: none (jax.experimental)."""
    _check_def_partition()
    return _custom_partitioning(fun)


@functools.lru_cache(maxsize=None)
def _check_def_partition() -> None:
    params = inspect.signature(_custom_partitioning.def_partition).parameters
    if not set(DEF_PARTITION_KEYWORDS) <= set(params):
        raise _missing("custom_partitioning", f"custom_partitioning.def_partition({', '.join(DEF_PARTITION_KEYWORDS)})")


# ``SymbolicZero``: the cotangent a ``jax.custom_vjp(..., symbolic_zeros=True)`` backward receives for an
# output nothing differentiates (its forward receives primals with ``.value`` and ``.perturbed``). Needs:
# ``jax.custom_derivatives.SymbolicZero`` (jax.custom_derivatives is outside the compatibility policy's
# list, though custom_vjp's docstring names it). Fallback: none. Imported at the top of this module.


# ---------------------------------------------------------------------------------------------
# Pallas's Triton lowering (deprecated in jax 0.11).


@functools.lru_cache(maxsize=None)
def pallas_triton():
    """The module ``jax.experimental.pallas.triton``: ``CompilerParams(num_warps=, num_stages=)`` and the
    masked ``load``/``store`` the Pallas kernels use (also in interpret mode).

    Deprecated in jax 0.11 ("The Pallas Triton backend is deprecated"; lowering it warns, and
    pyproject.toml's filterwarnings lets that warning through); still present and working in 0.11.2.
    Fallback: none for these kernels (Mosaic GPU needs another kernel body: ``jax_frontend._pallas``'s
    docstring)."""
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError as err:
        raise _missing("pallas_triton", "jax.experimental.pallas.triton (Pallas's Triton backend)") from err
    return pltriton


# ---------------------------------------------------------------------------------------------
# The manual ("varying") axes of an array inside shard_map.


@functools.lru_cache(maxsize=None)
def varying_field() -> str | None:
    """The ShapeDtypeStruct keyword that says over which manual (shard_map) mesh axes an output varies:
    ``manual_axis_type`` (jax 0.10, 0.11) or ``vma`` (older releases), or None if it has neither."""
    params = inspect.signature(jax.ShapeDtypeStruct.__init__).parameters
    return next((name for name in ("manual_axis_type", "vma") if name in params), None)


def varying_axes(a) -> frozenset:
    """The manual mesh axes ``a`` varies over (inside shard_map; empty elsewhere).

    Needs: ``jax.typeof(a).manual_axis_type.varying`` (jax 0.10, 0.11); fallback: ``.vma`` (older
    releases), else none."""
    aval = jax.typeof(a)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def varying_like(like) -> dict:
    """The ShapeDtypeStruct keyword arguments (``varying_field``) of an output that varies over the
    same shard_map axes as ``like`` ({} where the version has no such keyword).

    Needs: the aval's ``manual_axis_type`` (jax 0.10, 0.11; else its ``mat``) or ``vma``."""
    field = varying_field()
    aval = jax.typeof(like)
    value = getattr(aval, field, None) if field else None
    if field == "manual_axis_type" and value is None:
        value = getattr(aval, "mat", None)
    return {field: value} if value is not None else {}


def pcast_varying(a, axes: tuple):
    """``a`` marked as varying over the manual mesh axes ``axes``: ``jax.lax.pcast(a, axes, to="varying")``
    (jax 0.10, 0.11); fallback: ``jax.lax.pvary`` (releases before pcast)."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(a, axes, to="varying")
    return jax.lax.pvary(a, axes)  # pragma: no cover  (releases before pcast)


# ---------------------------------------------------------------------------------------------
# Devices.


def device_core_count(device) -> int | None:
    """A CUDA device's SM count (jaxlib's undocumented ``Device.core_count``), or None where the device
    has none (CPU). Fallback: the caller asks the CUDA driver (``jax_frontend._launch._gpu_num_sms``)."""
    cores = getattr(device, "core_count", None)
    return int(cores) if cores else None


# ---------------------------------------------------------------------------------------------
# Flax.


def set_class(obj, cls: type) -> None:
    """Give ``obj`` the class ``cls`` in place (``__class__``, as ``torch.nn.utils.parametrize`` does),
    past ``flax.nnx.Module.__setattr__`` (for which ``__class__`` is not an attribute of the graph).

    Needs: ``object.__setattr__(obj, "__class__", cls)`` to be allowed, i.e. ``cls`` and ``type(obj)``
    with the same instance layout (normkit's subclasses add no slots), and nnx to keep a module's
    state in its ``__dict__`` so that it survives the change (flax 0.12). Fallback: none (a new module
    would be a different object, not found where the graph shares it)."""
    try:
        object.__setattr__(obj, "__class__", cls)  # past nnx's __setattr__: not an attribute of the graph
    except TypeError as err:
        raise _missing("set_class", f"__class__ assignment from {type(obj).__qualname__} to {cls.__qualname__} "
                                    f"(the same instance layout)") from err
