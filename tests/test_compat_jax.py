"""jax_frontend._compat: a self-test of each private or version-dependent JAX / jaxlib / Flax entry point,
on CPU. Each test uses the entry the way the frontend does, on a tiny case of its own, so that a JAX or
Flax upgrade that changes one fails here, naming it, rather than deep inside a norm; and no module of
the frontend but ``_compat`` reaches for those APIs itself."""
from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_frontend import _compat  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CPU = jax.devices("cpu")[0]  # the CPU path, also on a machine whose default backend is a GPU


def on_cpu(a):
    """``a`` committed to the CPU: the computations that take it run, and are lowered, there."""
    return jax.device_put(a, CPU)


def _identity_primitive(name: str, *, requires_devices: bool, seen: dict):
    """A one-result primitive whose lowering records what ``_compat`` reads from its context."""
    prim = _compat.new_primitive(name)
    prim.def_impl(lambda x: [x])
    prim.def_abstract_eval(lambda x: [x])

    def lower(ctx, x):
        seen[name] = (_compat.lowering_device_assignment(ctx), _compat.lowering_platforms(ctx))
        return _compat.lower_fun(lambda x: [x], multiple_results=True)(ctx, x)

    _compat.register_lowering(prim, lower)
    if requires_devices:
        _compat.require_devices_during_lowering(prim)
    return prim


def _one_device_mesh() -> Mesh:
    return Mesh(np.array([CPU]), ("i",))


# ---------------------------------------------------------------------------------------------
# Primitives and their rules.


def test_a_primitive_with_impl_lowering_jvp_and_vmap_rules():
    """new_primitive, lower_fun, register_lowering, register_jvp, register_batching."""
    prim = _compat.new_primitive("normkit_compat_twice")
    assert prim.multiple_results and prim.name == "normkit_compat_twice"
    prim.def_impl(lambda x: [x * 2])
    prim.def_abstract_eval(lambda x: [x])
    _compat.register_lowering(prim, _compat.lower_fun(lambda x: [x * 2], multiple_results=True))

    def no_jvp(primals, tangents, **params):
        raise TypeError("normkit_compat_twice: no jvp")

    batched = []

    def batch(args, dims):
        batched.append(dims)
        return prim.bind(*args), [dims[0]]

    _compat.register_jvp(prim, no_jvp)
    _compat.register_batching(prim, batch)

    x = on_cpu(jnp.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(prim.bind(x)[0], 2 * x)  # eager: the impl
    np.testing.assert_array_equal(jax.jit(lambda x: prim.bind(x)[0])(x), 2 * x)  # jit: the lowering
    assert "normkit_compat_twice" in str(jax.make_jaxpr(lambda x: prim.bind(x)[0])(x))
    np.testing.assert_array_equal(jax.vmap(lambda r: prim.bind(r)[0])(x), 2 * x)
    assert batched == [(0,)]
    with pytest.raises(TypeError, match="no jvp"):
        jax.jvp(lambda x: prim.bind(x)[0], (x,), (x,))


# ---------------------------------------------------------------------------------------------
# Lowering internals.


def test_devices_during_lowering_and_the_lowering_platforms():
    """require_devices_during_lowering, lowering_device_assignment, lowering_platforms: a registered
    primitive's module knows its device under jit; an unregistered one's, and a shard_map body's, do not."""
    seen = {}
    registered = _identity_primitive("normkit_compat_devices", requires_devices=True, seen=seen)
    plain = _identity_primitive("normkit_compat_no_devices", requires_devices=False, seen=seen)
    x = on_cpu(jnp.ones(4))
    jax.jit(lambda x: registered.bind(x)[0]).lower(x)
    jax.jit(lambda x: plain.bind(x)[0]).lower(x)
    assert seen["normkit_compat_devices"] == ((CPU,), ("cpu",))
    assert seen["normkit_compat_no_devices"] == (None, ("cpu",))

    seen.clear()
    body = jax.shard_map(lambda x: registered.bind(x)[0], mesh=_one_device_mesh(), in_specs=P("i"), out_specs=P("i"))
    jax.jit(body).lower(x)
    assert seen["normkit_compat_devices"] == (None, ("cpu",))


# ---------------------------------------------------------------------------------------------
# Host callbacks registered by hand.


def test_pure_callback_lowers_to_the_cpu_callback_target():
    """CPU_CALLBACK_TARGET is the FFI target jax.pure_callback lowers to on CPU."""
    x = on_cpu(jnp.ones(3))
    text = jax.jit(lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)).lower(x).as_text()
    assert _compat.CPU_CALLBACK_TARGET in text, text


def test_a_host_callback_registered_by_index_is_called():
    """host_callback_index registers once per module; call_host_callback calls it on host arrays."""
    calls = []

    def host(key, x):
        calls.append((int(key), np.asarray(x).copy()))
        return (np.asarray(x) * 3 + int(key),)

    indices = []
    prim = _compat.new_primitive("normkit_compat_host")
    prim.def_abstract_eval(lambda x: [x])

    def lower(ctx, x):
        index = _compat.host_callback_index(ctx.module_context, host)
        indices.append(index)
        indices.append(_compat.host_callback_index(ctx.module_context, host))  # found, not registered again
        aval = ctx.avals_in[0]
        out = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        return _compat.lower_fun(
            lambda x: list(_compat.call_host_callback(index, [out], jnp.asarray(7, jnp.int32), x)),
            multiple_results=True)(ctx, x)

    _compat.register_lowering(prim, lower, platform="cpu")
    x = on_cpu(jnp.arange(4.0))
    y = jax.jit(lambda x: prim.bind(x)[0])(x)
    np.testing.assert_array_equal(y, np.arange(4.0) * 3 + 7)
    assert indices[0] == indices[1] and len(calls) == 1 and calls[0][0] == 7


# ---------------------------------------------------------------------------------------------
# custom_partitioning and symbolic zeros.


def test_custom_partitioning_takes_the_keywords_normkit_passes():
    from jax.experimental.custom_partitioning import custom_partitioning

    params = inspect.signature(custom_partitioning.def_partition).parameters
    assert set(_compat.DEF_PARTITION_KEYWORDS) <= set(params), list(params)

    def double(x):
        return x * 2

    fn = _compat.custom_partitioning(double)
    fn.def_partition(partition=lambda mesh, arg_shapes, result_shape: None,
                     infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: None,
                     sharding_rule="... n -> ... n", need_replication_factors=("n",))
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(jax.jit(fn)(x), 2 * x)  # one device: run as is, never partitioned


def test_symbolic_zero_is_the_cotangent_of_an_unused_output():
    seen = {}

    @jax.custom_vjp
    def f(x, y):
        return x * 2, x * y

    def fwd(x, y):
        seen["perturbed"] = (x.perturbed, y.perturbed)
        return f(x.value, y.value), (x.value, y.value)

    def bwd(res, cts):
        seen["cts"] = tuple(type(ct) for ct in cts)
        x, y = res
        dy, dz = cts
        return (2 * dy, jnp.zeros_like(y))

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    jax.grad(lambda x: f(x, jnp.float32(3.0))[0])(jnp.float32(1.0))
    assert seen["perturbed"] == (True, False)
    assert seen["cts"][1] is _compat.SymbolicZero and seen["cts"][0] is not _compat.SymbolicZero


# ---------------------------------------------------------------------------------------------
# Pallas's Triton backend.


def test_pallas_triton_masked_load_store_and_compiler_params():
    from jax.experimental import pallas as pl

    pltriton = _compat.pallas_triton()
    params = pltriton.CompilerParams(num_warps=4, num_stages=1)
    assert (params.num_warps, params.num_stages) == (4, 1)

    def kernel(x_ref, o_ref):
        mask = jax.lax.broadcasted_iota(jnp.int32, (8,), 0) < 5
        pltriton.store(o_ref, pltriton.load(x_ref, mask=mask, other=0.0) * 2, mask=mask)

    x = jnp.arange(8.0)
    y = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True)(x)
    np.testing.assert_array_equal(np.asarray(y)[:5], np.arange(5.0) * 2)


# ---------------------------------------------------------------------------------------------
# The varying (manual) axes inside shard_map.


def _axes(value) -> frozenset:
    """The varying axes in a ShapeDtypeStruct keyword's value (a ManualAxisType or a set of names)."""
    return frozenset(value.varying if hasattr(value, "varying") else value)


def test_varying_axes_inside_and_outside_shard_map():
    """varying_field, varying_axes, varying_like, pcast_varying."""
    field = _compat.varying_field()
    assert field in ("manual_axis_type", "vma"), inspect.signature(jax.ShapeDtypeStruct.__init__)
    seen = {}

    def body(x, w):
        seen["x"], seen["w"] = _compat.varying_axes(x), _compat.varying_axes(w)
        seen["cast"] = _compat.varying_axes(_compat.pcast_varying(w, ("i",)))
        kwargs = _compat.varying_like(x)
        seen["like"] = _axes(kwargs[field])
        seen["struct"] = _axes(getattr(jax.ShapeDtypeStruct((2,), jnp.float32, **kwargs), field))
        return x

    x, w = on_cpu(jnp.ones((4, 3))), on_cpu(jnp.ones(3))
    jax.jit(jax.shard_map(body, mesh=_one_device_mesh(), in_specs=(P("i"), P()), out_specs=P("i")))(x, w)
    assert seen == {"x": {"i"}, "w": frozenset(), "cast": {"i"}, "like": {"i"}, "struct": {"i"}}, seen

    assert _compat.varying_axes(x) == frozenset()
    assert all(not _axes(v) for v in _compat.varying_like(x).values())


# ---------------------------------------------------------------------------------------------
# Devices.


def test_device_core_count():
    class Fake:
        core_count = 132

    assert _compat.device_core_count(Fake()) == 132
    for device in jax.devices():
        cores = _compat.device_core_count(device)
        if device.platform == "gpu":  # a CUDA device says its SM count
            assert isinstance(cores, int) and cores > 0, device
        else:
            assert cores is None, (device, cores)


# ---------------------------------------------------------------------------------------------
# Flax.


def test_set_class_changes_a_flax_module_in_place():
    pytest.importorskip("flax")
    from flax import nnx

    class Mixin:
        __slots__ = ()  # no instance layout, as normkit's _Call

    class Sub(nnx.RMSNorm, Mixin):
        def __call__(self, x, mask=None):
            return super().__call__(x, mask) + 1

    module = nnx.RMSNorm(4, rngs=nnx.Rngs(0))
    scale, state = module.scale, nnx.state(module)
    x = jnp.ones((2, 4))
    before = module(x)
    _compat.set_class(module, Sub)
    assert type(module) is Sub and module.scale is scale and "__class__" not in vars(module)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), nnx.state(module), state))
    np.testing.assert_allclose(module(x), before + 1)
    graphdef, params = nnx.split(module)
    assert type(nnx.merge(graphdef, params)) is Sub
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(module, x), before + 1)
    _compat.set_class(module, nnx.RMSNorm)
    assert type(module) is nnx.RMSNorm and module.scale is scale

    class Slotted:
        __slots__ = ("extra",)  # another instance layout: refused, loudly

    with pytest.raises(_compat.MissingAPI, match="set_class"):
        _compat.set_class(module, Slotted)
    assert type(module) is nnx.RMSNorm


# ---------------------------------------------------------------------------------------------
# The fence itself.

PRIVATE = re.compile(r"jax\._src|jax\.interpreters|jax\.extend|xla_ffi_|\.host_callbacks\b|\.add_host_callback\b|"
                     r"pallas import triton|object\.__setattr__|\.core_count\b|manual_axis_type|\.vma\b|"
                     r"jax\.lax\.(pcast|pvary)\b|custom_derivatives|prim_requires_devices|"
                     r"module_context\.(axis_context|platforms)\b|[\"']core_count[\"']")


def _code(path: Path) -> dict[int, str]:
    """{line number: the line without its comment} for every line of ``path`` outside a docstring."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = dict(enumerate(source.splitlines(), 1))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row] = lines[row][:col]
    return {n: line for n, line in lines.items() if n not in docstrings}


def test_no_frontend_module_but_compat_uses_a_private_api():
    """The fence: outside ``_compat`` (and its docstrings and comments, which may name what it fences),
    no module of the JAX frontend, nor the Pallas kernel bodies, reaches a private API itself."""
    files = sorted((ROOT / "jax_frontend").glob("*.py")) + [ROOT / "normkit" / "kernels" / "norm_pallas.py"]
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in files if path.name != "_compat.py"
            for n, line in _code(path).items() if PRIVATE.search(line)]
    assert not hits, "\n".join(hits)
