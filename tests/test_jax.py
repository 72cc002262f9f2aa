"""The JAX frontend beyond the shared parity suite: transformations, freeze, the frozen-flag launch
records, forward-mode and bad-input errors, cross-frontend parity and the jax-triton import hazard.

Gradients are compared with ``jax.grad`` of a plain jnp reference (the math of ``normkit.reference``,
written in jnp so that JAX can differentiate it), within the tolerance table.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
import zlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import jax_frontend as jf
import normkit
from normkit import launch as plans
from normkit import reference
from normkit.shapes import Shape, shapes
from tests.frontend_jax import JaxFrontend
from tests.frontends import requires_torch
from tests import test_errors
from tests.harness import (check_against_reference, check_launch_flags, make_inputs, parity_cases, residuals_of_shape,
                           same_save)
from normkit.ops import DEFAULT_CASTING_MODE, OPS
from normkit.testing import assert_close, random_inputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = jax.default_backend() == "gpu"
FRONTEND = "jax-gpu" if ON_GPU else "jax-cpu"


@pytest.fixture(autouse=True)
def strict_promotion():
    with jax.numpy_dtype_promotion("strict"):
        yield


# ---------------------------------------------------------------------------------------------
# The jnp reference (float32 math; the float64 NumPy reference stays the specification).


def ref_rms_norm(x, weight=None, eps=1e-6, offset=0.0):
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * (weight + offset)


def ref_layer_norm(x, weight=None, bias=None, eps=1e-5):
    xc = x - jnp.mean(x, axis=-1, keepdims=True)
    y = xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
    y = y if weight is None else y * weight
    return y if bias is None else y + bias


def ref_fused_add_rms_norm(x, residual, weight=None, eps=1e-6, offset=0.0):
    s = x + residual
    return ref_rms_norm(s, weight, eps, offset), s


# The jnp reference of each op, with the same positional inputs (op.inputs) as its public function.
REFS = {"rms_norm": ref_rms_norm, "layer_norm": ref_layer_norm, "fused_add_rms_norm": ref_fused_add_rms_norm}


def op_fn(op, impl):
    """f(x, p, q) of the op's inputs in signature order: (x, p, q) are x followed by the op's other
    differentiable inputs (weight; weight and bias; residual and weight), None where it has fewer."""
    n = len(OPS[op].inputs)
    return lambda x, p, q: impl(*(x, p, q)[:n])


def _loss(op, impl):
    """f(x, p, q, ct) -> sum over outputs of <output, cotangent>."""
    fn, has_residual = op_fn(op, impl), OPS[op].has_residual

    def loss(x, p, q, ct):
        outs = fn(x, p, q)
        return sum(jnp.sum(o * c) for o, c in zip(outs if has_residual else (outs,), ct))
    return loss


# Each op as f(x, p, q, ct) -> scalar loss, for the normkit op and the reference; ct: output cotangents.
LOSSES = {op: (_loss(op, getattr(jf, op)), _loss(op, REFS[op])) for op in OPS}


def op_inputs(op, shape=(3, 5, 40), seed=0):
    """(x, p, q, ct) in float32 (``normkit.testing.random_inputs``); rows over all leading axes."""
    inp = random_inputs(OPS[op], shape, "float32", np.random.default_rng(seed))
    x, p, q = [*(jnp.asarray(inp[name], jnp.float32) for name in OPS[op].inputs), None, None][:3]
    ct = tuple(jnp.asarray(inp[name], jnp.float32) for name in ("dy", "ds") if name in inp)
    return x, p, q, ct


def close(actual, expected, what, rows=1):
    """Within the float32 row of the tolerance table; dW/dB summed over ``rows`` rows."""
    jax.tree.map(lambda a, e: assert_close(np.asarray(a), np.asarray(e), "float32", what, reduced_over=rows),
                 actual, expected)


def _reduced(op, i, rows):
    """The reduction length behind gradient i of (x, p, q): parameters are summed over rows."""
    spec = OPS[op]
    return rows if i < len(spec.inputs) and spec.inputs[i] in spec.params else 1


def close_grads(op, got, want, rows, what):
    for i, (g, w) in enumerate(zip(got, want)):
        close(g, w, f"{what} d{i}", _reduced(op, i, rows))


ALL_OPS = sorted(OPS)


# ---------------------------------------------------------------------------------------------
# Transformations.


@pytest.mark.parametrize("op", ALL_OPS)
def test_grad_and_value_and_grad(op):
    f, ref = LOSSES[op]
    x, p, q, ct = op_inputs(op)
    got = jax.grad(f, argnums=(0, 1, 2))(x, p, q, ct)
    want = jax.grad(ref, argnums=(0, 1, 2))(x, p, q, ct)
    close_grads(op, got, want, 15, f"{op} grad")
    val, got2 = jax.value_and_grad(f, argnums=(0, 1, 2))(x, p, q, ct)
    close(val, ref(x, p, q, ct), f"{op} value", rows=x.size)
    close_grads(op, got2, want, 15, f"{op} value_and_grad")


@pytest.mark.parametrize("op", ALL_OPS)
def test_jit_grad(op):
    f, ref = LOSSES[op]
    x, p, q, ct = op_inputs(op)
    got = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, p, q, ct)
    close_grads(op, got, jax.grad(ref, argnums=(0, 1, 2))(x, p, q, ct), 15, f"{op} jit(grad)")
    got = jax.grad(jax.jit(f), argnums=(0, 1, 2))(x, p, q, ct)
    close_grads(op, got, jax.grad(ref, argnums=(0, 1, 2))(x, p, q, ct), 15, f"{op} grad(jit)")


@pytest.mark.parametrize("op", ALL_OPS)
def test_vjp(op):
    x, p, q, ct = op_inputs(op)
    out, vjp = jax.vjp(op_fn(op, getattr(jf, op)), x, p, q)
    rout, rvjp = jax.vjp(op_fn(op, REFS[op]), x, p, q)
    close(out, rout, f"{op} vjp primal")
    cts = ct if OPS[op].has_residual else ct[0]
    close_grads(op, vjp(cts), rvjp(cts), 15, f"{op} vjp")


@requires_torch
@pytest.mark.parametrize("op", ALL_OPS)
def test_vmap_folds_into_one_launch(op):
    """The Triton implementation's batching rule folds the batch axes into rows (on CPU: torch)."""
    x, p, q, ct = op_inputs(op, shape=(4, 6, 40))
    # the inputs after x; a row input (the residual) unbatched: one example's rows, broadcast by vmap
    rest = [a[0] if name in OPS[op].row_inputs else a for name, a in zip(OPS[op].inputs[1:], (p, q))]
    fwd = lambda x: getattr(jf, op)(x, *rest, implementation="triton")  # noqa: E731
    rfwd = lambda x: REFS[op](x, *rest)  # noqa: E731
    with normkit.record_launches() as log:
        got = jax.vmap(fwd)(x)
    close(got, jax.vmap(rfwd)(x), f"{op} vmap")
    (launch,) = log  # one launch over 4 * 6 rows (the residual, unbatched, is broadcast)
    assert launch.kernel == "norm_fwd_kernel" and launch.frontend == FRONTEND
    flat_rest = [jnp.tile(a, (4, 1)) if name in OPS[op].row_inputs else a
                 for name, a in zip(OPS[op].inputs[1:], rest)]
    flat_fwd = lambda x: getattr(jf, op)(x, *flat_rest, implementation="triton")  # noqa: E731
    with normkit.record_launches() as flat:  # the same launch as over the 24 rows given at once
        flat_fwd(x.reshape(24, 40))
    assert (launch.grid, launch.flags) == (flat[0].grid, flat[0].flags)
    # nested vmap, under jit: still one launch over every row
    with normkit.record_launches() as log:
        got = jax.jit(jax.vmap(jax.vmap(fwd)))(x.reshape(2, 2, 6, 40))
    close(got, jax.vmap(jax.vmap(rfwd))(x.reshape(2, 2, 6, 40)), f"{op} vmap(vmap)")
    assert len(log) == 1


@pytest.mark.parametrize("op", ALL_OPS)
def test_grad_of_vmap_and_vmap_of_grad(op):
    f, ref = LOSSES[op]
    x, p, q, ct = op_inputs(op, shape=(4, 6, 40))
    args = (x, p, q, ct)
    # the leading axis is a vmapped batch; parameters shared (the fused op's residual is batched)
    p_is_rows = OPS[op].inputs[1] in OPS[op].row_inputs
    axes = (0, 0 if p_is_rows else None, None, 0)
    vf = lambda *a: jnp.sum(jax.vmap(f, in_axes=axes)(*a))  # noqa: E731
    vref = lambda *a: jnp.sum(jax.vmap(ref, in_axes=axes)(*a))  # noqa: E731
    close_grads(op, jax.grad(vf, argnums=(0, 1, 2))(*args), jax.grad(vref, argnums=(0, 1, 2))(*args), 24,
                f"{op} grad(vmap)")
    # per-example gradients: one dW per batch element
    per = jax.vmap(jax.grad(f, argnums=(0, 1, 2)), in_axes=axes)(*args)
    rper = jax.vmap(jax.grad(ref, argnums=(0, 1, 2)), in_axes=axes)(*args)
    close_grads(op, per, rper, 6, f"{op} vmap(grad)")
    # nested: vmap over two axes of per-example gradients
    x2, ct2 = x.reshape(2, 2, 6, 40), tuple(c.reshape(2, 2, 6, 40) for c in ct)
    p2 = p.reshape(2, 2, 6, 40) if p_is_rows else p
    nested = jax.vmap(jax.vmap(jax.grad(f, argnums=(0, 1, 2)), in_axes=axes), in_axes=axes)
    close_grads(op, nested(x2, p2, q, ct2), jax.vmap(jax.vmap(jax.grad(ref, argnums=(0, 1, 2)), in_axes=axes),
                                                     in_axes=axes)(x2, p2, q, ct2), 6, f"{op} vmap(vmap(grad))")


def test_vmap_over_batched_weights():
    """A batched weight cannot fold into rows: one launch per batch element, same results."""
    x, w, _, ct = op_inputs("rms_norm", shape=(3, 5, 40))
    ws = jnp.stack([w, 2 * w, -w])
    got = jax.vmap(jf.rms_norm)(x, ws)
    close(got, jax.vmap(ref_rms_norm)(x, ws), "vmap over weights")
    f = lambda x, w: jnp.sum(jax.vmap(jf.rms_norm)(x, w) * ct[0])  # noqa: E731
    r = lambda x, w: jnp.sum(jax.vmap(ref_rms_norm)(x, w) * ct[0])  # noqa: E731
    close_grads("rms_norm", jax.grad(f, argnums=(0, 1))(x, ws), jax.grad(r, argnums=(0, 1))(x, ws), 5,
                "grad(vmap over weights)")


@pytest.mark.parametrize("op", ALL_OPS)
def test_scan_over_layers(op):
    """A stack of layers under lax.scan, differentiated w.r.t. the input and every layer's parameters."""
    x, p, q, ct = op_inputs(op, shape=(6, 40))
    L = 3
    ps = jnp.stack([p * (1 + 0.1 * i) for i in range(L)])
    qs = None if q is None else jnp.stack([q * (1 - 0.1 * i) for i in range(L)])

    def net(norm):
        def loss(x, ps, qs):
            def layer(h, pq):
                p, q = pq
                out = norm(h, p, q)
                out = out[0] + out[1] if isinstance(out, tuple) else out
                return jnp.tanh(out), None
            h, _ = jax.lax.scan(layer, x, (ps, qs))
            return jnp.sum(h * ct[0])
        return loss

    norms = (op_fn(op, getattr(jf, op)), op_fn(op, REFS[op]))
    got = jax.jit(jax.grad(net(norms[0]), argnums=(0, 1, 2)))(x, ps, qs)
    want = jax.grad(net(norms[1]), argnums=(0, 1, 2))(x, ps, qs)
    close_grads(op, got, want, 6 * L, f"{op} scan")


@pytest.mark.parametrize("op", ALL_OPS)
def test_checkpoint(op):
    f, ref = LOSSES[op]
    x, p, q, ct = op_inputs(op)
    with normkit.record_launches() as log:
        got = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1, 2)))(x, p, q, ct)
    close_grads(op, got, jax.grad(ref, argnums=(0, 1, 2))(x, p, q, ct), 15, f"{op} checkpoint")
    assert log.of("norm_bwd_kernel")
    policy = jax.checkpoint_policies.nothing_saveable
    got = jax.grad(jax.checkpoint(f, policy=policy), argnums=(0, 1, 2))(x, p, q, ct)
    close_grads(op, got, jax.grad(ref, argnums=(0, 1, 2))(x, p, q, ct), 15, f"{op} checkpoint(nothing_saveable)")


@pytest.mark.parametrize("op", ALL_OPS)
def test_forward_mode_raises(op):
    f, _ = LOSSES[op]
    x, p, q, ct = op_inputs(op, shape=(2, 8))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda x: f(x, p, q, ct), (x,), (jnp.ones_like(x),))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jacfwd(lambda x: f(x, p, q, ct))(x)
    # a derivative of the gradient differentiates the backward kernel: normkit's own message
    with pytest.raises(TypeError, match="normkit: forward-mode differentiation is not supported"):
        jax.hessian(lambda x: f(x, p, q, ct))(x)
    with pytest.raises(TypeError, match="normkit: forward-mode differentiation is not supported"):
        jax.grad(lambda x: jnp.sum(jax.grad(lambda x: f(x, p, q, ct))(x) ** 2))(x)


def test_empty_rows():
    x = jnp.zeros((0, 40), jnp.float32)
    w = jnp.ones((40,), jnp.float32)
    with normkit.record_launches() as log:
        y = jf.rms_norm(x, w)
        dx, dw = jax.grad(lambda x, w: jnp.sum(jf.rms_norm(x, w)), argnums=(0, 1))(x, w)
    assert y.shape == (0, 40) and dx.shape == (0, 40)
    np.testing.assert_array_equal(np.asarray(dw), np.zeros(40, np.float32))
    assert not log


# ---------------------------------------------------------------------------------------------
# Frozen inputs: freeze, stop_gradient, argnums, closures, and what the launch record shows.


def _params():
    x, w, b, ct = op_inputs("layer_norm", shape=(6, 40))
    r = jnp.asarray(np.random.default_rng(1).standard_normal((6, 40)), jnp.float32)
    w2 = jnp.asarray(np.random.default_rng(2).uniform(0.5, 1.5, 40), jnp.float32)
    return {"ln": {"weight": w, "bias": b}, "rms": {"weight": w2}}, x, r, ct


def _model(params, x, r, norms=None):
    norms = norms or (jf.layer_norm, jf.fused_add_rms_norm)
    h = norms[0](x, params["ln"]["weight"], params["ln"]["bias"])
    y, s = norms[1](h, r, params["rms"]["weight"])
    return jnp.sum(y * s)


def _ref_model(params, x, r):
    return _model(params, x, r, (ref_layer_norm, ref_fused_add_rms_norm))


@pytest.mark.parametrize("mask", [
    pytest.param({"ln": {"weight": False, "bias": True}, "rms": {"weight": True}}, id="pytree"),
    pytest.param({"ln": False, "rms": True}, id="prefix"),
    pytest.param(lambda p: jax.tree.map(lambda _: False, p) | {"rms": {"weight": True}}, id="callable"),
])
def test_freeze(mask):
    params, x, r, _ = _params()
    resolved = mask(params) if callable(mask) else mask
    ln_w = resolved["ln"] if isinstance(resolved["ln"], bool) else resolved["ln"]["weight"]
    ln_b = resolved["ln"] if isinstance(resolved["ln"], bool) else resolved["ln"]["bias"]

    with normkit.record_launches() as log:
        grads = jax.grad(lambda p: _model(jf.freeze(p, mask), x, r))(params)
    want = jax.grad(_ref_model)(params, x, r)
    for trained, got, ref in ((ln_w, grads["ln"]["weight"], want["ln"]["weight"]),
                              (ln_b, grads["ln"]["bias"], want["ln"]["bias"]),
                              (True, grads["rms"]["weight"], want["rms"]["weight"])):
        if trained:
            close(got, ref, "trained", rows=6)
        else:
            np.testing.assert_array_equal(np.asarray(got), 0.0)
    bwd = {launch.flags["IS_RMS"]: launch for launch in log.of("norm_bwd_kernel")}
    rms_bwd = bwd.pop(True)
    assert rms_bwd.frontend == FRONTEND and rms_bwd.flags["COMPUTE_DW"]
    assert rms_bwd.flags["COMPUTE_DX"] == (ln_w or ln_b)  # dx only feeds the layer norm's dW/dB
    if ln_w or ln_b:
        ln_bwd = bwd.pop(False)
        assert not ln_bwd.flags["COMPUTE_DX"]  # x is not differentiated
        assert ln_bwd.flags["COMPUTE_DW"] == ln_w and ln_bwd.flags["COMPUTE_DB"] == ln_b
        want_parts = ({"DW_PART"} if ln_w else set()) | ({"DB_PART"} if ln_b else set())
        assert {n for n, _, _ in ln_bwd.partial_buffers} == want_parts
    assert not bwd  # a fully frozen layer norm runs no backward at all
    (ln_fwd,) = [launch for launch in log.of("norm_fwd_kernel") if not launch.flags["IS_RMS"]]
    assert ln_fwd.flags["STORE_STATS"] == (ln_w or ln_b)


def test_freeze_errors():
    params, *_ = _params()
    with pytest.raises(TypeError, match="bools"):
        jf.freeze(params, {"ln": jnp.asarray(True), "rms": True})
    with pytest.raises(ValueError, match="structure"):
        jf.freeze(params, {"ln": True})
    frozen = jf.freeze({"a": jnp.ones(3), "n": 3, "s": "name"}, False)  # non-array leaves pass through
    assert frozen["n"] == 3 and frozen["s"] == "name"


def _dw_flags(log):
    (bwd,) = log.of("norm_bwd_kernel")
    return bwd.flags["COMPUTE_DW"], bwd.partial_buffers, len(log.of("partial_sum_kernel"))


@pytest.mark.parametrize("how", ["stop_gradient", "argnums", "closure", "closure_jit", "freeze"])
def test_frozen_weight_runs_the_variant_without_dw(how):
    x, w, _, ct = op_inputs("rms_norm", shape=(6, 40))

    def loss(x, w):
        return jnp.sum(jf.rms_norm(x, w) * ct[0])

    with normkit.record_launches() as log:
        if how == "stop_gradient":
            dx, dw = jax.grad(lambda x, w: loss(x, jax.lax.stop_gradient(w)), argnums=(0, 1))(x, w)
            np.testing.assert_array_equal(np.asarray(dw), 0.0)
        elif how == "argnums":
            dx = jax.grad(loss, argnums=0)(x, w)
        elif how == "closure":
            dx = jax.grad(lambda x: loss(x, w))(x)
        elif how == "closure_jit":
            dx = jax.jit(lambda x, w: jax.grad(lambda x: loss(x, w))(x))(x, w)
        else:
            dx, dw = jax.grad(lambda x, w: loss(x, jf.freeze(w, False)), argnums=(0, 1))(x, w)
            np.testing.assert_array_equal(np.asarray(dw), 0.0)
    close(dx, jax.grad(lambda x: jnp.sum(ref_rms_norm(x, w) * ct[0]))(x), how)
    assert _dw_flags(log) == (False, (), 0)
    (fwd,) = log.of("norm_fwd_kernel")
    assert fwd.flags["STORE_STATS"] and fwd.frontend == FRONTEND


def test_vjp_differentiates_every_primal():
    """Under jax.vjp every primal is perturbed: the weight's gradient is computed. Closing over the
    weight is how to leave it out of a vjp."""
    x, w, _, ct = op_inputs("rms_norm", shape=(6, 40))
    with normkit.record_launches() as log:
        jax.vjp(jf.rms_norm, x, w)[1](ct[0])
    assert _dw_flags(log)[0]
    with normkit.record_launches() as log:
        jax.vjp(lambda x: jf.rms_norm(x, w), x)[1](ct[0])
    assert _dw_flags(log) == (False, (), 0)


def test_frozen_x_and_forward_only():
    x, w, b, ct = op_inputs("layer_norm", shape=(6, 40))
    with normkit.record_launches() as log:
        jf.layer_norm(x, w, b)
        jax.jit(jf.layer_norm)(x, w, b)
    assert [launch.flags["STORE_STATS"] for launch in log] == [False, False]  # no backward: no stats
    with normkit.record_launches() as log:
        db = jax.grad(lambda b: jnp.sum(jf.layer_norm(x, w, b) * ct[0]))(b)
    close(db, jnp.sum(ct[0], axis=0), "db", rows=6)
    (bwd,) = log.of("norm_bwd_kernel")
    assert (bwd.flags["COMPUTE_DX"], bwd.flags["COMPUTE_DW"], bwd.flags["COMPUTE_DB"]) == (False, False, True)
    assert [n for n, _, _ in bwd.partial_buffers] == ["DB_PART"]


def test_fused_unused_outputs():
    """An unused residual_out reads no DRES; an unused y is a zero dy (as the Torch frontend)."""
    x, r, w, ct = op_inputs("fused_add_rms_norm", shape=(6, 40))
    with normkit.record_launches() as log:
        got = jax.grad(lambda x, r: jnp.sum(jf.fused_add_rms_norm(x, r, w)[0] * ct[0]), argnums=(0, 1))(x, r)
    want = jax.grad(lambda x, r: jnp.sum(ref_fused_add_rms_norm(x, r, w)[0] * ct[0]), argnums=(0, 1))(x, r)
    close(got, want, "y only")
    assert not log.of("norm_bwd_kernel")[0].flags["HAS_DRES"]
    got = jax.grad(lambda x, r: jnp.sum(jf.fused_add_rms_norm(x, r, w)[1] * ct[1]), argnums=(0, 1))(x, r)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ct[1]), rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ct[1]), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Bad input. tests/test_errors.py checks every error through both frontends (the ``frontend``
# fixture). Here its tests run once more on ``TracedJaxFrontend``: each jax_frontend function is
# traced with ``jax.jit(...).trace()``, its array arguments abstract, and only then lowered and run.
# So every error must come while tracing, before anything is lowered or launched.

F32 = jnp.float32


def _traced(fn):
    def call(*args, **kwargs):
        slots = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]  # the rest (None, lists) as given

        def body(*arrays):
            full = list(args)
            for i, a in zip(slots, arrays):
                full[i] = a
            return fn(*full, **kwargs)

        arrays = [args[i] for i in slots]
        traced = jax.jit(body).trace(*arrays)  # a bad input raises here
        return traced.lower().compile()(*arrays)
    return call


class TracedJaxFrontend(JaxFrontend):
    name = "jax-traced"

    @property
    def module(self):
        return types.SimpleNamespace(**{op: _traced(getattr(jf, op)) for op in OPS})


@pytest.fixture
def frontend():
    """This module's ``frontend`` (conftest's runs both frontends): the traced JAX frontend."""
    return TracedJaxFrontend()


for _name, _test in vars(test_errors).items():  # test_traced_weight_shape, ...: test_errors' bodies
    if _name.startswith("test_") and callable(_test):
        globals()["test_traced_" + _name.removeprefix("test_")] = _test


def test_bad_input_abstract():
    """Checked on shapes alone (nothing is allocated or launched): D over the limit, a traced eps."""
    with pytest.raises(ValueError, match="exceeds the supported limit of 65536"):
        jax.eval_shape(jf.rms_norm, jax.ShapeDtypeStruct((2, 65537), F32))
    with pytest.raises(TypeError, match="eps must be a static Python float; it is traced"):
        jax.jit(jf.rms_norm)(jnp.ones((2, 8), F32), None, 1e-6)  # eps traced under jit: it must be static
    assert jax.eval_shape(jf.rms_norm, jax.ShapeDtypeStruct((2, 65536), F32)).shape == (2, 65536)


# ---------------------------------------------------------------------------------------------
# Cross-frontend parity.


def _compare(case, a, b, exact):
    for name in a.outputs:
        if exact:
            np.testing.assert_array_equal(a.outputs[name], b.outputs[name], err_msg=f"{case}: {name}")
        else:
            assert_close(a.outputs[name], b.outputs[name], case.dtype, f"{case}: {name} jax vs torch")
    for name in case.inputs:
        ga, gb = a.grads[name], b.grads[name]
        assert (ga is None) == (gb is None), f"{case}: d{name} presence differs"
        if ga is None:
            continue
        if exact:
            np.testing.assert_array_equal(ga, gb, err_msg=f"{case}: d{name}")
        else:
            reduced = case.shape.M if name in ("weight", "bias") else 1
            dt = (case.w_dtype or case.dtype) if name in ("weight", "bias") else case.dtype
            assert_close(ga, gb, dt, f"{case}: d{name} jax vs torch", reduced_over=reduced)


def _run_both(case):
    from tests.frontend_torch import TorchFrontend

    case = same_save(case)
    inp = make_inputs(case, np.random.default_rng(zlib.crc32(str(case).encode())))
    res_jax = JaxFrontend().call(case, inp)
    res_torch = TorchFrontend().call(case, inp)
    check_against_reference(case, res_jax, inp)
    return res_jax, res_torch


CROSS_CASES = [c for c in parity_cases([s for s in shapes("ci") if s.name == "3d"])
               if c.trained == frozenset(c.inputs) or len(c.trained) == 1]
# The default run: every parameter set and trained set in the default casting without offset, and
# each other casting mode and offset with every parameter trained (they change the row math, not the
# plan or which gradients are computed); the other cases are the slow tier.
CROSS_QUICK = {c for c in CROSS_CASES if (c.casting, c.offset) == (DEFAULT_CASTING_MODE, 0.0)
               or (c.params == c.spec.params and c.trained == frozenset(c.inputs))}


@requires_torch
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in CROSS_QUICK else pytest.mark.slow)
                                  for c in CROSS_CASES], ids=str)
def test_cross_frontend_within_tolerance(case):
    """Both frontends on CPU: equal within the tolerance table, and in fact bit for bit, since both run
    the same plan (same SM count) in the same interpreter; a difference means the plans diverged."""
    res_jax, res_torch = _run_both(case)
    _compare(case, res_jax, res_torch, exact=False)
    if not ON_GPU:
        _compare(case, res_jax, res_torch, exact=True)


# Contiguous shapes only: a JAX array has no row stride (the adapter's "strided" input is a contiguous
# copy, ROWS_CONTIGUOUS=True, where Torch reads the strided rows in place).
GPU_SHAPES = [s for s in shapes("ci", "gpu") if s.name in ("one_row", "d1000", "3d", "gpu_rows", "gpu_wide")]
# At the large shapes, fewer combinations (every one runs at the small shapes): gpu_rows in the default
# casting without offset, with every parameter and frozen set; gpu_wide with everything trained.
GPU_CASES = [c for c in parity_cases(GPU_SHAPES)
             if c.shape.name not in ("gpu_rows", "gpu_wide")
             or (c.shape.name == "gpu_rows" and (c.casting, c.offset) == ("llama", 0.0))
             or (c.shape.name == "gpu_wide" and c.trained == frozenset(c.inputs))]


@pytest.mark.parametrize("case", GPU_CASES if ON_GPU else [pytest.param(None, id="needs-gpu")], ids=str)
def test_bitwise_parity_with_torch_on_gpu(case):
    """Same kernel source, same plan (grid, warps, partial count from the same SM count): on GPU the
    two frontends must agree bit for bit, outputs and gradients."""
    if not ON_GPU:
        pytest.skip("GPU only: bitwise parity needs compiled kernels on both frontends "
                    "(on CPU, test_cross_frontend_within_tolerance checks parity within the tolerance table)")
    import torch

    assert torch.cuda.is_available(), "jax sees a GPU, torch must too"
    res_jax, res_torch = _run_both(case)
    check_launch_flags(case, res_jax.log)
    # where the weight's recovery is stored (Torch's eager forward: after the statistics, with the trip
    # flag; JAX: a buffer of its own) is not math: every other flag must match
    storage = ("REC_IN_RSTD", "HAS_TRIP")
    for a, b in zip(res_jax.log, res_torch.log):
        fa, fb = ({k: v for k, v in f.items() if k not in storage} for f in (a.flags, b.flags))
        assert (a.kernel, a.grid, a.num_warps, fa) == (b.kernel, b.grid, b.num_warps, fb), (a, b)
    _compare(case, res_jax, res_torch, exact=True)


@requires_torch
def test_same_num_sms_as_torch():
    """The plans depend on the SM count: both frontends must use the same one (on GPU, the device's)."""
    import torch
    from torch_frontend import _backend as torch_backend

    from jax_frontend import _launch

    assert _launch.num_sms("cpu") == torch_backend.num_sms(torch.device("cpu"))
    if ON_GPU:
        assert _launch.num_sms("cuda") == torch_backend.num_sms(torch.device("cuda"))


# ---------------------------------------------------------------------------------------------
# The GPU path's arguments, checked on any machine: jax-triton 0.3.1's conventions, then the
# interpreter runs them.


SCALARS = frozenset(plans.FWD_SCALARS + plans.BWD_SCALARS + plans.RED_SCALARS)
FLOAT_SCALARS = frozenset({"eps", "offset"})


def _strict_triton_call(calls):
    from jax_frontend import _launch

    def triton_call(*args, kernel, out_shape, grid, num_warps, num_stages, enable_fp_fusion, name, **metaparams):
        names = kernel.arg_names
        # the plan's FMA-contraction choice: off for the LayerNorm backward only
        assert enable_fp_fusion is (kernel.fn.__name__ != "norm_bwd_kernel" or metaparams["IS_RMS"])
        n_pos = len(args)
        assert len(args) + len(out_shape) + len(metaparams) == len(names), "every kernel parameter is bound"
        assert set(metaparams) == set(names[n_pos + len(out_shape):]), "keywords are exactly the constexprs"
        for arg, pname in zip(args, names):
            assert arg is not None, f"{pname}: jax-triton 0.3.1 has no None"
            assert not isinstance(arg, float) or isinstance(arg, np.float32), f"{pname}: a Python float is fp64"
            if isinstance(arg, (bool, int, np.float32)):
                assert pname in SCALARS, f"{pname} is not a runtime scalar"
                assert isinstance(arg, np.float32) == (pname in FLOAT_SCALARS), pname
            else:
                assert isinstance(arg, jax.Array) and arg.dtype in (jnp.float32, jnp.bfloat16, jnp.float16), pname
        assert all(isinstance(s, jax.ShapeDtypeStruct) for s in out_shape)
        assert isinstance(num_warps, int) and isinstance(num_stages, int) and isinstance(name, str)
        assert all(isinstance(g, int) and g > 0 for g in grid)
        calls.append(kernel.fn.__name__)
        return _launch.interpreter_triton_call(*args, kernel=kernel, out_shape=out_shape, grid=grid,
                                               num_warps=num_warps, num_stages=num_stages,
                                               enable_fp_fusion=enable_fp_fusion, **metaparams)

    return triton_call


GPU_PATH_CASES = [c for c in parity_cases([Shape("gpu_path", (300, 48), frozenset())])
                  if c.dtype == "bfloat16" and c.casting in ("llama",) and c.offset == 0.0
                  or c.op == "layer_norm" and c.dtype == "float16"]
# The default run: in bfloat16, one frozen set per kernel variant (op, parameter set and the gradients
# computed: every argument and partial buffer, present and absent); in float16, each parameter set with
# everything trained. The other frozen sets are the slow tier.
GPU_PATH_QUICK = set({(c.op, c.params, c.spec.grads(c.trained)): c for c in reversed(GPU_PATH_CASES)
                      if c.dtype == "bfloat16"}.values()) | {
    c for c in GPU_PATH_CASES if c.dtype == "float16" and c.trained == frozenset(c.inputs)}


@requires_torch
# 19 row tiles: the H200's plan (132 SMs) gives 19 dW/dB partials where the CPU plan gives 8.
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in GPU_PATH_QUICK else pytest.mark.slow)
                                  for c in GPU_PATH_CASES], ids=str)
def test_gpu_path_arguments(case, monkeypatch):
    from jax_frontend import _launch, _triton

    calls = []
    monkeypatch.setattr(_launch, "gpu_triton_call", lambda: _strict_triton_call(calls))
    monkeypatch.setattr(_triton, "_platform_of", lambda arrays: "cuda")
    monkeypatch.setattr(_launch, "num_sms", lambda platform: 132)  # the H200's plan: more programs
    inp = make_inputs(case, np.random.default_rng(zlib.crc32(str(case).encode())))
    res = JaxFrontend(jit=False).call(case, inp)  # eager: the platform comes from _platform_of
    check_against_reference(case, res, inp)
    check_launch_flags(case, res.log)
    assert {launch.frontend for launch in res.log} == {"jax-gpu"}
    assert calls == res.log.kernels()


# ---------------------------------------------------------------------------------------------
# The import hazard: jax_triton 0.3.1 clears TRITON_CACHE_DIR when imported.


def _python(code: str, env_update: dict, pythonpath: list[str] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env.update({k: v for k, v in env_update.items() if v is not None})
    # The caller's own PYTHONPATH entries stay (on the GPU machine, jax-triton lives in one of them).
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*pythonpath, REPO, *inherited]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_import_leaves_cache_dir_alone():
    """Importing jax_frontend imports neither jax_triton nor torch, and leaves TRITON_CACHE_DIR as it was."""
    for cache_dir in ("/tmp/normkit-triton-cache", None):
        proc = _python("""
            import os, sys
            before = os.environ.get("TRITON_CACHE_DIR")
            import jax_frontend
            assert os.environ.get("TRITON_CACHE_DIR") == before, os.environ.get("TRITON_CACHE_DIR")
            assert "jax_triton" not in sys.modules and "torch" not in sys.modules, "imported too early"
        """, {"TRITON_CACHE_DIR": cache_dir})
        assert proc.returncode == 0, proc.stderr


CLOBBERING_JAX_TRITON = """
import os
os.environ["TRITON_CACHE_DIR"] = ""  # what jax-triton 0.3.1 does at import, before failing on a CPU-only jax
raise ImportError("jax-triton requires JAX to be installed with GPU support")
"""


@pytest.mark.parametrize("cache_dir", ["/tmp/normkit-triton-cache", None], ids=["set", "unset"])
def test_gpu_import_path_restores_cache_dir(tmp_path, cache_dir):
    """The GPU path's ``import jax_triton`` fails here (a stand-in that clobbers the variable, as the real
    one does on a CPU-only jax); TRITON_CACHE_DIR must come back, and Triton must still find its cache."""
    pkg = tmp_path / "jax_triton"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(CLOBBERING_JAX_TRITON)
    proc = _python("""
        import os
        before = os.environ.get("TRITON_CACHE_DIR")
        from jax_frontend import _launch
        try:
            _launch.gpu_triton_call()
        except ImportError as err:
            assert "jax-triton 0.3.1" in str(err), err
        else:
            raise AssertionError("the stand-in jax_triton must fail")
        assert os.environ.get("TRITON_CACHE_DIR") == before, repr(os.environ.get("TRITON_CACHE_DIR"))
        import triton
        from triton.runtime.cache import get_cache_manager
        assert triton.knobs.cache.dir
        get_cache_manager("00" * 32)  # raises "Could not create or locate cache dir" if clobbered
    """, {"TRITON_CACHE_DIR": cache_dir}, [str(tmp_path)])
    assert proc.returncode == 0, proc.stderr


TORCH_LAUNCH = """
import torch, torch_frontend
x = torch.randn(5, {D}, device="cuda", dtype=torch.bfloat16)
torch_frontend.rms_norm(x, torch.ones({D}, device="cuda"))  # a fresh Triton JIT compile
torch.cuda.synchronize()
"""
JAX_LAUNCH = """
import jax, jax.numpy as jnp, sys, jax_frontend
assert jax.default_backend() == "gpu"
y = jax_frontend.rms_norm(jnp.ones((5, {D}), jnp.bfloat16)).block_until_ready()  # imports jax_triton
assert "jax_triton" in sys.modules
"""


@requires_torch
@pytest.mark.parametrize("order", ["jax_first", "torch_first"])
def test_import_hazard(order):
    """Both frontends in one process, either order. On GPU: the Torch-side Triton compile still works
    after jax_frontend has imported jax_triton and launched through it. On CPU (no jax_triton to
    import): importing jax_frontend, before or after torch_frontend, leaves TRITON_CACHE_DIR unchanged
    (test_gpu_import_path_restores_cache_dir covers the restore itself)."""
    if ON_GPU:
        D = 200 + (order == "jax_first") + 2 * (os.getpid() % 97)  # an unusual D: nothing cached in-process
        code = (JAX_LAUNCH + TORCH_LAUNCH) if order == "jax_first" else (TORCH_LAUNCH + JAX_LAUNCH + TORCH_LAUNCH)
        code = code.replace("{D}", str(D))
    else:
        first, second = ("jax_frontend", "torch_frontend") if order == "jax_first" else ("torch_frontend",
                                                                                         "jax_frontend")
        code = f"""
import os
before = os.environ.get("TRITON_CACHE_DIR")
import {first}
assert os.environ.get("TRITON_CACHE_DIR") == before
import {second}
assert os.environ.get("TRITON_CACHE_DIR") == before
"""
    for cache_dir in ("/tmp/normkit-triton-cache", None) if not ON_GPU else (os.environ.get("TRITON_CACHE_DIR"),):
        proc = _python(code, {"TRITON_CACHE_DIR": cache_dir})
        assert proc.returncode == 0, proc.stderr


FAKE_GPU = """
import sys, jax, jax.numpy as jnp
from jax_frontend import _launch, _triton
def triton_call(*args, out_shape, **kwargs):  # stands in for jax_triton: outputs of the right shape
    return [jnp.zeros(s.shape, s.dtype) for s in out_shape]
_launch.gpu_triton_call = lambda: triton_call
_triton._platform_of = lambda arrays: "cuda"
_launch.num_sms = lambda platform: 132
"""


def test_gpu_path_does_not_import_torch():
    """The JAX GPU path needs no torch. On CPU: with jax_triton's triton_call replaced by a stand-in (the
    rest of the GPU path runs as it would there), torch is never imported. On GPU, for real: Triton's
    CUDA driver itself imports torch when it is installed (``CudaDriver.is_active``), so the check is
    the one a torch-free install cares about: with ``import torch`` made to fail, the path runs, and its
    results are bitwise those of a process where torch is importable."""
    work = """
import jax_frontend, zlib
x = jax.random.normal(jax.random.PRNGKey(0), (4, 64), jnp.float32)
w = 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(1), (64,), jnp.float32)
outs = jax.grad(lambda x, w: jnp.sum(jnp.sin(jax_frontend.layer_norm(x, w, w))), argnums=(0, 1))(x, w)
outs += jax.grad(lambda x, r, w: jnp.sum(jnp.sin(jax_frontend.fused_add_rms_norm(x, r, w)[0])), argnums=(0, 1, 2))(x, x[::-1], w)
print("digest", zlib.crc32(b"".join(bytes(memoryview(np.asarray(o))) for o in outs)))
"""
    if not ON_GPU:
        proc = _python(FAKE_GPU + "import numpy as np\n" + work + "assert 'torch' not in sys.modules, 'the GPU path imported torch'\n",
                       {"TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR")})
        assert proc.returncode == 0, proc.stderr
        return
    digests = []
    for block in ("import sys; sys.modules['torch'] = None  # 'import torch' raises ImportError\n", ""):
        code = block + JAX_LAUNCH.replace("{D}", "64") + "import numpy as np\n" + work
        if block:
            code += "assert sys.modules['torch'] is None\n"
        proc = _python(code, {"TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR")})
        assert proc.returncode == 0, proc.stderr
        digests.append([line for line in proc.stdout.splitlines() if line.startswith("digest")])
    assert digests[0] == digests[1] and digests[0], digests


# --- what a frozen norm keeps for its backward ------------------------------------------------------


@pytest.mark.parametrize("implementation", jf.IMPLEMENTATIONS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_frozen_norm_keeps_its_output_in_the_residuals(op, implementation):
    """A frozen norm followed by a LoRA-style linear that keeps its input (the norm's output y): with
    save="auto" the residuals hold one row-sized array (y, kept once for both), with save="input" two
    (x, or the fused add's sum, and y); under jit, scan, checkpoint and a shard_map over a mesh alike;
    and the gradients agree
    with the float64 reference either way."""
    try:
        jf.resolve_implementation(implementation)
    except RuntimeError as e:  # the Triton implementation on CPU without torch: a JAX-only install
        pytest.skip(str(e))
    spec = OPS[op]
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.float32)
    params = {"weight": jnp.asarray(rng.uniform(1.0, 2.0, 32), jnp.float32),
              "bias": jnp.asarray(rng.standard_normal(32) * 0.1, jnp.float32)}
    a = jnp.asarray(rng.standard_normal((32, 4)), jnp.float32)

    def loss(x, a, save):
        inputs = {"x": x, "residual": r, **params}
        out = getattr(jf, op)(*(inputs[n] for n in spec.inputs), implementation=implementation, save=save)
        y = out[0] if spec.has_residual else out
        return ((y @ a) ** 2).sum()  # a is trained, as LoRA's A: its gradient keeps y

    def scanned(x, a, save):
        return jax.lax.scan(lambda c, xi: (c + loss(xi, a, save), None), 0.0, x[None])[0]

    def checkpointed(x, a, save):
        return jax.checkpoint(lambda t, b: loss(t, b, save), policy=jax.checkpoint_policies.everything_saveable)(x, a)

    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def on_a_mesh(x, a, save):  # rows split over a mesh axis, in a shard_map (the parameters closed over)
        return jax.shard_map(lambda t, b: jax.lax.psum(loss(t, b, save), "data"), mesh=mesh,
                             in_specs=(P("data"), P()), out_specs=P())(x, a)

    for how, f in (("plain", loss), ("scan", scanned), ("checkpoint", checkpointed), ("shard_map", on_a_mesh)):
        kept = {save: residuals_of_shape(lambda t, b: f(t, b, save), (x, a), x.shape) for save in ("auto", "input")}
        # inside a scan or a checkpoint the closed-over parameters are traced: "auto" cannot see a
        # LayerNorm's bias against its weight there, and keeps the input (jax_frontend.rms_norm's docstring)
        auto = 2 if how != "plain" and "bias" in spec.params else 1
        assert len(kept["auto"]) == auto and len(kept["input"]) == 2, (how, kept)
    grads = {save: jax.jit(jax.grad(lambda t, b: loss(t, b, save), argnums=(0, 1)))(x, a) for save in ("auto", "input")}
    for g_auto, g_input in zip(grads["auto"], grads["input"]):
        np.testing.assert_allclose(np.asarray(g_auto), np.asarray(g_input), rtol=2e-5, atol=2e-5)


# The default run: both dtypes through the Triton implementation, one each through Pallas and XLA (the
# save rule that reads the constants is the frontend's, the same for every implementation); the other
# two are the slow tier.
LOW_PRECISION_QUICK = {("bfloat16", "triton"), ("float16", "triton"), ("float16", "pallas"), ("bfloat16", "xla")}


@pytest.mark.parametrize("dtype,implementation", [
    pytest.param(dtype, implementation, marks=() if (dtype, implementation) in LOW_PRECISION_QUICK else
                 pytest.mark.slow) for implementation in jf.IMPLEMENTATIONS for dtype in ("bfloat16", "float16")])
def test_jit_closing_over_low_precision_frozen_parameters(implementation, dtype):
    """A jit that closes over the frozen parameters (constants of the trace, so the save rule reads their
    values) in a 16-bit dtype: every op, rms_norm_rope too, keeps its output, and its output and dx match
    the float64 reference; the kernel implementations give the eager call's, bit for bit (the same
    kernels run; XLA may fuse the "xla" implementation's operations differently under jit)."""
    try:
        jf.resolve_implementation(implementation)
    except RuntimeError as e:  # the Triton implementation on CPU without torch: a JAX-only install
        pytest.skip(str(e))
    rng = np.random.default_rng(3)
    dt = jnp.dtype(dtype)
    x, r = (jnp.asarray(rng.standard_normal((2, 3, 2, 8)), dt) for _ in range(2))
    ct = jnp.asarray(rng.standard_normal((2, 3, 2, 8)), jnp.float32)  # the output's cotangent
    w, b = jnp.asarray(rng.uniform(0.5, 1.5, 8), dt), jnp.asarray(rng.uniform(-0.1, 0.1, 8), dt)
    angle = np.tile(rng.uniform(0, 6.3, (1, 3, 1, 4)), 2)  # HF's tables: both halves of a row the same angles
    cos, sin = jnp.asarray(np.cos(angle), jnp.float32), jnp.asarray(np.sin(angle), jnp.float32)
    calls = {"rms_norm": (lambda t: jf.rms_norm(t, w, implementation=implementation),
                          lambda: reference.rms_norm(x, w), lambda dy: reference.rms_norm_bwd(x, w, dy)[0]),
             "layer_norm": (lambda t: jf.layer_norm(t, w, b, implementation=implementation),
                            lambda: reference.layer_norm(x, w, b), lambda dy: reference.layer_norm_bwd(x, w, b, dy)[0]),
             "fused_add_rms_norm": (lambda t: jf.fused_add_rms_norm(t, r, w, implementation=implementation)[0],
                                    lambda: reference.fused_add_rms_norm(x, r, w)[0],
                                    lambda dy: reference.fused_add_rms_norm_bwd(x, r, w, dy)[0]),
             "rms_norm_rope": (lambda t: jf.rms_norm_rope(t, w, cos, sin, implementation=implementation),
                               lambda: reference.rms_norm_rope(x, w, cos, sin),
                               lambda dy: reference.rms_norm_rope_bwd(x, w, cos, sin, dy)[0])}
    for name, (f, ref_y, ref_dx) in calls.items():
        def loss(t):
            return (f(t).astype(jnp.float32) * ct).sum()

        with normkit.record_launches() as log:
            dx_jit = jax.jit(jax.grad(loss))(x)
        y_jit = jax.jit(f)(x)
        dy = np.asarray(ct.astype(dt), np.float64)  # the loss's gradient of the output, in its dtype
        assert_close(np.asarray(y_jit, np.float64), ref_y(), dtype, f"{name}: y")
        assert_close(np.asarray(dx_jit, np.float64), ref_dx(dy), dtype, f"{name}: dx")
        if implementation != "xla":  # the same kernels as an eager call's
            assert np.array_equal(np.asarray(dx_jit, np.float32), np.asarray(jax.grad(loss)(x), np.float32)), name
            np.testing.assert_array_equal(np.asarray(y_jit, np.float32), np.asarray(f(x), np.float32))  # the kernels' backward read the output
            assert any(launch.flags.get("FROM_Y") for launch in log if "bwd" in launch.kernel), (name, log.kernels())


def test_save_output_raises_where_it_cannot_hold():
    x = jnp.ones((4, 8)) + jnp.arange(8.0)
    w = jnp.ones(8)
    with pytest.raises(ValueError, match="save must be one of"):
        jf.rms_norm(x, w, save="outputs")
    with pytest.raises(ValueError, match="save='output' needs every parameter"):
        jax.grad(lambda w: jf.rms_norm(x, w, save="output").sum())(w)
    zero = w.at[3].set(0.0)
    with pytest.raises(ValueError, match="column 3"):  # eager: the values are known
        jax.vjp(lambda t: jf.rms_norm(t, zero, save="output"), x)
    with pytest.raises(ValueError, match="column 3"):  # a constant under jit: its values are known too
        jax.jit(jax.grad(lambda t: jf.rms_norm(t, zero, save="output").sum()))(x)
    # a jit argument: the values are unseen, so the output is kept (no bias, no offset) and the zero
    # weight makes dx NaN, never quietly wrong; save="input" is right
    for save, finite in (("auto", False), ("output", False), ("input", True)):
        dx = jax.jit(jax.grad(lambda t, v: jf.rms_norm(t, v, save=save).sum()))(x, zero)
        assert bool(jnp.isfinite(dx).all()) if finite else bool(jnp.isnan(dx).all()), save
    dx = jax.jit(jax.grad(lambda t: jf.rms_norm(t, zero).sum()))(x)  # auto, a constant: the input is kept
    assert bool(jnp.isfinite(dx).all())
