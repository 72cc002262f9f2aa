"""The JAX frontend's ``implementation=`` choice: which one auto picks (for the norms and for
``rms_norm_rope`` alike), that a requested one that cannot run raises (never a silent fallback), that
the launch record names it, and that every implementation keeps the frozen semantics under jit,
grad, vjp, vmap, scan and checkpoint.

Parity with the float64 reference for every implementation is in tests/test_parity.py; the Pallas
and XLA bodies' own tests are in tests/test_pallas_impl.py.
"""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_frontend as jf
import normkit
from jax_frontend import _rope, functional
from normkit.ops import OPS
from normkit.testing import assert_close, random_inputs

IMPLS = list(jf.IMPLEMENTATIONS)
KERNEL_NAMES = {"triton": ("norm_fwd_kernel", "norm_bwd_kernel"), "pallas": ("norm_fwd_kernel", "norm_bwd_kernel"),
                "xla": ("xla_norm_fwd", "xla_norm_bwd")}
ROPE_KERNEL_NAMES = {"triton": ("rms_norm_rope_fwd_kernel", "rms_norm_rope_bwd_kernel"),
                     "pallas": ("rms_norm_rope_fwd_kernel", "rms_norm_rope_bwd_kernel"),
                     "xla": ("xla_rms_norm_rope_fwd", "xla_rms_norm_rope_bwd")}


@pytest.fixture(autouse=True)
def strict_promotion():
    with jax.numpy_dtype_promotion("strict"):
        yield


def _available(impl):
    return functional._unavailable(impl, jax.default_backend()) is None


IMPLS_HERE = [pytest.param(i, marks=pytest.mark.skipif(not _available(i), reason=f"{i} cannot run here"))
              for i in IMPLS]


def _inputs(op="rms_norm", shape=(6, 40), seed=0):
    inp = random_inputs(OPS[op], shape, "float32", np.random.default_rng(seed))
    return {k: jnp.asarray(v, jnp.float32) for k, v in inp.items()}, inp


def _ref_grads(op, inp, trained):
    spec = OPS[op]
    _, grads = spec.run_reference(inp, spec.options(eps=spec.default_eps), {"y": inp["dy"]})
    return {k: grads[k] for k in trained}


def test_auto_picks_triton_where_it_runs_else_pallas(monkeypatch):
    platform = jax.default_backend()
    want = "triton" if _available("triton") else "pallas"
    assert jf.resolve_implementation(None) == want
    assert _rope.IMPLEMENTATIONS == jf.IMPLEMENTATIONS and _rope._implementation(None) == want
    if platform == "cpu":  # without torch the Triton interpreter path cannot run: auto takes Pallas
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
        functional._unavailable.cache_clear()
        try:
            assert jf.resolve_implementation(None) == "pallas" and _rope._implementation(None) == "pallas"
            with pytest.raises(RuntimeError, match=r"implementation='triton' cannot run on the cpu backend: .*torch"):
                jf.rms_norm(jnp.ones((2, 8), jnp.float32), implementation="triton")
            table = jnp.ones((3, 8), jnp.float32)
            with pytest.raises(RuntimeError, match=r"implementation='triton' cannot run on the cpu backend: .*torch"):
                jf.rms_norm_rope(jnp.ones((2, 3, 8), jnp.float32), None, table, table, implementation="triton")
        finally:
            functional._unavailable.cache_clear()


def test_unknown_implementation():
    with normkit.record_launches() as log, pytest.raises(ValueError, match=r"unknown implementation 'cuda'"):
        jf.rms_norm(jnp.ones((2, 8), jnp.float32), implementation="cuda")
    assert not log


@pytest.mark.parametrize("impl", IMPLS_HERE)
def test_records_name_the_implementation(impl):
    d, _ = _inputs()
    with normkit.record_launches() as log:
        jax.grad(lambda x: jnp.sum(jf.rms_norm(x, d["weight"], implementation=impl) * d["dy"]))(d["x"])
    assert {launch.implementation for launch in log} == {impl}
    fwd, bwd = KERNEL_NAMES[impl]
    assert log.of(fwd) and log.of(bwd)


@pytest.mark.parametrize("impl", IMPLS_HERE)
def test_rms_norm_rope_records_name_the_implementation(impl):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 2, 8)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, 8), jnp.float32)
    theta = rng.uniform(-4, 4, (3, 1, 4))
    cos, sin = (jnp.asarray(f(np.concatenate([theta, theta], -1)), jnp.float32) for f in (np.cos, np.sin))
    with normkit.record_launches() as log:
        jax.grad(lambda x, w: jnp.sum(jf.rms_norm_rope(x, w, cos, sin, implementation=impl)), argnums=(0, 1))(x, w)
    assert {launch.implementation for launch in log} == {impl}
    fwd, bwd = ROPE_KERNEL_NAMES[impl]
    assert log.of(fwd) and log.of(bwd)


@pytest.mark.parametrize("impl", IMPLS_HERE)
@pytest.mark.parametrize("how", ["freeze", "argnums", "stop_gradient"])
def test_frozen_weight_skips_dw_in_every_implementation(impl, how):
    d, inp = _inputs()

    def loss(x, w):
        return jnp.sum(jf.rms_norm(x, w, implementation=impl) * d["dy"])

    with normkit.record_launches() as log:
        if how == "freeze":
            dx, dw = jax.jit(jax.grad(lambda x, w: loss(x, jf.freeze(w, False)), argnums=(0, 1)))(d["x"], d["weight"])
            np.testing.assert_array_equal(np.asarray(dw), 0.0)
        elif how == "argnums":
            dx = jax.jit(jax.grad(loss))(d["x"], d["weight"])
        else:
            dx = jax.grad(lambda x, w: loss(x, jax.lax.stop_gradient(w)))(d["x"], d["weight"])
    assert_close(np.asarray(dx), _ref_grads("rms_norm", inp, ["x"])["x"], "float32", f"{impl} dx")
    (bwd,) = log.of(KERNEL_NAMES[impl][1])
    assert bwd.flags["COMPUTE_DX"] and not bwd.flags["COMPUTE_DW"]
    assert bwd.partial_buffers == () and not log.of("partial_sum_kernel")


@pytest.mark.parametrize("impl", [pytest.param(*p.values, marks=[*p.marks, pytest.mark.slow]) if p.values[0] == "pallas"
                                  else p for p in IMPLS_HERE])  # Pallas's interpreter: about 10 s each, the slow tier
@pytest.mark.parametrize("op", sorted(OPS))
def test_transformations_in_every_implementation(impl, op):
    """grad of vmap, vmap of grad (per-example dW), scan over layers and checkpoint: each against the
    float64 reference of the same computation."""
    spec = OPS[op]
    d, inp = _inputs(op, shape=(3, 4, 24), seed=3)
    names = spec.inputs
    fn = getattr(jf, op)

    cts = [d[c] for c in ("dy", "ds") if c in d]

    def loss(*args, cts=cts):
        outs = fn(*args, implementation=impl)
        outs = outs if spec.has_residual else (outs,)
        return sum(jnp.sum(o * c) for o, c in zip(outs, cts))

    args = [d[n] for n in names]
    argnums = tuple(range(len(names)))
    # per batch element (the leading axis): rows (4, 24), with their own cotangents; parameters shared
    axes = tuple(0 if n in spec.row_inputs else None for n in names)

    def per_example_loss(*a):
        return jax.vmap(lambda cts, *r: loss(*r, cts=cts), in_axes=(0,) + axes)(cts, *a)

    g_vmap = jax.jit(jax.grad(lambda *a: jnp.sum(per_example_loss(*a)), argnums=argnums))(*args)
    g_plain = jax.grad(loss, argnums=argnums)(*args)
    for n, a, b in zip(names, g_vmap, g_plain):  # the batch of 3 x 4 rows is the same rows as one call
        assert_close(np.asarray(a), np.asarray(b), "float32", f"{impl} {op} grad(vmap) d{n}", reduced_over=12)
    _, ref = spec.run_reference(inp, spec.options(eps=spec.default_eps), {"y": inp["dy"], "residual_out": inp.get("ds")})
    for n, a in zip(names, g_plain):
        assert_close(np.asarray(a), ref[n], "float32", f"{impl} {op} grad d{n}", reduced_over=12)
    per = jax.vmap(lambda cts, *a: jax.grad(lambda *r: loss(*r, cts=cts), argnums=argnums)(*a),
                   in_axes=(0,) + axes)(cts, *args)  # one dW per batch element
    for i, n in enumerate(names):
        if n in spec.params:
            assert per[i].shape == (3, 24)
            assert_close(np.asarray(per[i].sum(0)), ref[n], "float32", f"{impl} {op} vmap(grad) d{n}", reduced_over=12)
    ck = jax.jit(jax.grad(jax.checkpoint(loss), argnums=argnums))(*args)
    for n, a in zip(names, ck):
        assert_close(np.asarray(a), ref[n], "float32", f"{impl} {op} checkpoint d{n}", reduced_over=12)

    def scanned(x, *params):  # the same layer twice under lax.scan, differentiated w.r.t. x
        def layer(h, _):
            out = fn(h, *params, implementation=impl) if not spec.has_residual else fn(h, *params,
                                                                                        implementation=impl)[0]
            return out, None
        h, _ = jax.lax.scan(layer, x, None, length=2)
        return jnp.sum(h * d["dy"])

    def scanned_twice(x, *params):
        once = fn(x, *params, implementation=impl)
        once = once[0] if spec.has_residual else once
        twice = fn(once, *params, implementation=impl)
        return jnp.sum((twice[0] if spec.has_residual else twice) * d["dy"])

    rest = args[1:]
    assert_close(np.asarray(jax.jit(jax.grad(scanned))(args[0], *rest)),
                 np.asarray(jax.grad(scanned_twice)(args[0], *rest)), "float32", f"{impl} {op} scan")


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "triton"])
def test_pallas_and_xla_batch_without_a_loop(impl):
    """vmap of the forward is one computation over the batch (Pallas batches pallas_call itself)."""
    d, _ = _inputs(shape=(5, 6, 40))
    with normkit.record_launches() as log:
        y = jax.jit(jax.vmap(lambda x: jf.rms_norm(x, d["weight"], implementation=impl)))(d["x"])
    assert len(log) == 1 and y.shape == (5, 6, 40)
    flat = jf.rms_norm(d["x"], d["weight"], implementation=impl)
    if impl == "pallas":  # the same kernel over the same rows
        np.testing.assert_array_equal(np.asarray(y), np.asarray(flat))
    else:  # XLA fuses a jitted computation differently from eager op-by-op: within rounding
        assert_close(np.asarray(y), np.asarray(flat), "float32", "xla vmap")
