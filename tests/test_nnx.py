"""jax_frontend.nnx: normkit's norms as Flax NNX modules, and patch_model on NNX model graphs.

Construction and state as flax's modules; outputs and gradients against the float64 reference
(``normkit.reference``, the tolerance table of ``normkit.testing``); the errors; patch_model's report,
parameters and round trip; LoRA-only training by a ``DiffState`` filter (the norms' backward without
dW, from the launch records; loss and LoRA gradients as the unpatched model's); nnx.jit, scan,
remat and vmap; a 2 x 2 CPU mesh with Auto and Explicit axes (a subprocess). The NNX benchmark's smoke
run is in tests/test_bench.py (a library test imports no benchmark module).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

flax = pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import normkit  # noqa: E402
from jax_frontend import nnx as nknnx  # noqa: E402
from normkit import reference  # noqa: E402
from normkit.testing import assert_close, poisoned_outputs, rounded  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
D = 32
# The implementations each module test runs: auto (Triton's interpreter with torch, else Pallas) and XLA.
IMPLEMENTATIONS = [None, "xla"]


@pytest.fixture(autouse=True)
def strict_promotion():
    """Strict dtype promotion, as the JAX tests run; the tests of flax's mixed-dtype promotion (a bf16
    input with a float32 scale) switch it back to JAX's standard rules, under which flax runs."""
    with jax.numpy_dtype_promotion("strict"):
        yield


def rng(seed=0):
    return np.random.default_rng(seed)


def normal(shape, dtype="float32", seed=0, scale=1.5, shift=0.3):
    """Fresh random values (never zeros), already rounded to ``dtype``, as a jax array of that dtype."""
    return jnp.asarray(rounded(rng(seed).standard_normal(shape) * scale + shift, dtype), dtype)


def randomize(module, seed=1):
    """Random scale (and bias) values of the module's own dtypes and shapes, loaded with nnx.update."""
    gen = rng(seed)
    state = nnx.state(module, nnx.Param)
    new = jax.tree.map(lambda p: jnp.asarray(rounded(gen.uniform(0.5, 1.5, p.shape) * gen.choice([-1, 1], p.shape),
                                                     jnp.dtype(p.dtype).name), p.dtype), state)
    nnx.update(module, new)
    return module


def values(module) -> dict:
    return {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(module)).items()
            if v is not None}


def bwd_launches(log):
    """The backward launches of every implementation (Triton/Pallas ``norm_bwd_kernel``, XLA ``xla_norm_bwd``)."""
    return [launch for launch in log if launch.kernel in ("norm_bwd_kernel", "xla_norm_bwd")]


def assert_no_dw_work(log, implementation=None):
    bwd = bwd_launches(log)
    assert bwd, f"no backward was recorded: {log.kernels()}"
    assert not any(b.flags["COMPUTE_DW"] or b.flags.get("COMPUTE_DB") for b in bwd), [b.flags for b in bwd]
    assert not any(launch.partial_buffers for launch in log)
    assert not log.of("partial_sum_kernel")
    if implementation is not None:
        assert {launch.implementation for launch in log} == {implementation}


# ---------------------------------------------------------------------------------------------
# The modules: construction, state, outputs, gradients.


PAIRS = {"RMSNorm": (nnx.RMSNorm, nknnx.RMSNorm), "LayerNorm": (nnx.LayerNorm, nknnx.LayerNorm)}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_constructor_mirrors_flax(name):
    flax_cls, ours = PAIRS[name]
    theirs = inspect.signature(flax_cls.__init__).parameters
    mine = inspect.signature(ours.__init__).parameters
    assert issubclass(ours, flax_cls)
    extra = {"RMSNorm": ["offset", "casting_mode", "implementation", "save"], "LayerNorm": ["implementation", "save"]}[name]
    assert list(mine) == list(theirs) + extra  # every flax argument, in flax's order, then normkit's
    for arg, p in theirs.items():
        assert mine[arg].kind == p.kind, arg
        if arg == "scale_init" and name == "RMSNorm":
            continue  # None: the identity scale for the offset, flax's initializers.ones for offset 0
        if arg != "self":
            assert mine[arg].default is p.default or mine[arg].default == p.default, arg
    module = ours(D, rngs=nnx.Rngs(0))
    assert module.scale.get_value() is not None
    np.testing.assert_array_equal(values(module)["scale"], values(flax_cls(D, rngs=nnx.Rngs(0)))["scale"])


# (x dtype, param_dtype, dtype): flax promotes x and the parameters to result_type(x, params) or to dtype.
DTYPE_CASES = {
    "fp32": ("float32", jnp.float32, None),
    "bf16": ("bfloat16", jnp.bfloat16, None),
    "bf16_x_fp32_params": ("bfloat16", jnp.float32, None),  # flax computes and returns float32
    "bf16_dtype": ("bfloat16", jnp.float32, jnp.bfloat16),  # the scale rounded to bf16
    "fp16_dtype": ("float16", jnp.float32, jnp.float16),
}


def _reference(name, x, params, eps):
    if name == "LayerNorm":
        return reference.layer_norm(x, params.get("scale"), params.get("bias"), eps)
    return reference.rms_norm(x, params.get("scale"), eps)


@pytest.mark.parametrize("name,case,implementation", [
    *((name, case, None) for name in sorted(PAIRS) for case in sorted(DTYPE_CASES)),
    *((name, case, impl) for name in sorted(PAIRS) for case in ("fp32", "bf16_dtype") for impl in IMPLEMENTATIONS[1:]),
])
def test_outputs_and_dtypes_as_flax(name, case, implementation):
    x_dtype, param_dtype, dtype = DTYPE_CASES[case]
    flax_cls, ours = PAIRS[name]
    theirs = randomize(flax_cls(D, param_dtype=param_dtype, dtype=dtype, rngs=nnx.Rngs(0)))
    mine = ours(D, param_dtype=param_dtype, dtype=dtype, implementation=implementation, rngs=nnx.Rngs(5))
    nnx.update(mine, nnx.state(theirs))  # flax's state loads unchanged
    assert jax.tree.structure(nnx.state(mine)) == jax.tree.structure(nnx.state(theirs))
    x = normal((2, 3, D), x_dtype)
    with jax.numpy_dtype_promotion("standard"), normkit.record_launches() as log, poisoned_outputs():
        y, want = mine(x), theirs(x)
    assert y.dtype == want.dtype and y.shape == x.shape, (y.dtype, want.dtype)
    out = jnp.dtype(want.dtype).name
    params = {k: rounded(v, out) for k, v in values(theirs).items()}  # flax rounds them to the promoted dtype
    ref = _reference(name, np.asarray(x, np.float64), params, theirs.epsilon)
    assert_close(np.asarray(y, np.float64), ref, out, f"{name} {case}")
    assert_close(np.asarray(want, np.float64), ref, out, f"flax {name} {case}")  # the reference is flax's function
    assert log and {launch.implementation for launch in log} == {implementation or jax_frontend_auto()}


@pytest.mark.parametrize("name,kwargs", [("RMSNorm", dict(use_scale=False)),
                                         ("LayerNorm", dict(use_scale=False)),
                                         ("LayerNorm", dict(use_bias=False)),
                                         ("LayerNorm", dict(use_scale=False, use_bias=False))])
def test_modules_without_parameters(name, kwargs):
    flax_cls, ours = PAIRS[name]
    theirs, mine = randomize(flax_cls(D, rngs=nnx.Rngs(0), **kwargs)), ours(D, rngs=nnx.Rngs(0), **kwargs)
    nnx.update(mine, nnx.state(theirs))
    assert jax.tree.structure(nnx.state(mine)) == jax.tree.structure(nnx.state(theirs))
    x = normal((3, D))
    ref = _reference(name, np.asarray(x, np.float64), values(theirs), theirs.epsilon)
    assert_close(mine(x), ref, "float32", f"{name} {kwargs}")


def jax_frontend_auto():
    import jax_frontend

    return jax_frontend.resolve_implementation()


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_gradients_against_the_reference(name):
    """Every gradient (x, scale, bias) through nnx.grad of the whole module, in float32."""
    mine = randomize(PAIRS[name][1](D, rngs=nnx.Rngs(0)))
    x, dy = normal((6, D)), normal((6, D), seed=3, shift=0.0)
    with normkit.record_launches() as log:
        gx, gm = jax.grad(lambda x, m: jnp.sum(m(x) * dy), argnums=(0, 1))(x, mine)
    p = values(mine)
    if name == "RMSNorm":
        dx, dw = reference.rms_norm_bwd(np.asarray(x), p["scale"], np.asarray(dy), mine.epsilon)
        db = None
    else:
        dx, dw, db = reference.layer_norm_bwd(np.asarray(x), p["scale"], p["bias"], np.asarray(dy), mine.epsilon)
    assert_close(gx, dx, "float32", "dx")
    assert_close(gm.scale.get_value(), dw, "float32", "dscale", reduced_over=6)
    if db is not None:
        assert_close(gm.bias.get_value(), db, "float32", "dbias", reduced_over=6)
    (bwd,) = bwd_launches(log)
    assert bwd.flags["COMPUTE_DX"] and bwd.flags["COMPUTE_DW"]


def test_state_interchanges_with_flax():
    """split/merge and state/update between flax's module and normkit's, both ways."""
    theirs = randomize(nnx.LayerNorm(D, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(nknnx.LayerNorm(D, rngs=nnx.Rngs(1)))
    merged = nnx.merge(graphdef, nnx.state(theirs))
    assert isinstance(merged, nknnx.LayerNorm)
    x = normal((4, D))
    assert_close(merged(x), reference.layer_norm(np.asarray(x), values(theirs)["scale"], values(theirs)["bias"],
                                                 theirs.epsilon), "float32", "merged")
    back = nnx.LayerNorm(D, rngs=nnx.Rngs(2))
    nnx.update(back, nnx.state(merged))
    for k, v in values(theirs).items():
        np.testing.assert_array_equal(values(back)[k], v)


def test_rms_norm_options_reach_the_function():
    """offset, casting_mode and implementation go through to jax_frontend.rms_norm (bitwise)."""
    import jax_frontend as jf

    module = nknnx.RMSNorm(D, offset=1.0, casting_mode="llama", implementation="xla", param_dtype=jnp.bfloat16,
                           epsilon=1e-5, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(values(module)["scale"], 0.0)  # scale + offset starts at 1
    randomize(module)
    x = normal((5, D), "bfloat16")
    with normkit.record_launches() as log:
        y = module(x)
    want = jf.rms_norm(x, module.scale.get_value(), 1e-5, offset=1.0, casting_mode="llama", implementation="xla")
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    assert {launch.implementation for launch in log} == {"xla"}
    ref = reference.rms_norm(np.asarray(x, np.float64), values(module)["scale"], 1e-5, offset=1.0)
    assert_close(y, ref, "bfloat16", "offset 1, llama")


def test_fused_add_rms_norm_module():
    module = randomize(nknnx.FusedAddRMSNorm(D, rngs=nnx.Rngs(0)))
    assert jax.tree.structure(nnx.state(module)) == jax.tree.structure(nnx.state(nnx.RMSNorm(D, rngs=nnx.Rngs(0))))
    x, r, dy, ds = (normal((3, 2, D), seed=s) for s in (1, 2, 3, 4))
    with poisoned_outputs():
        y, s = module(x, r)
    w = values(module)["scale"]
    ref_y, ref_s = reference.fused_add_rms_norm(np.asarray(x), np.asarray(r), w, module.epsilon)
    assert_close(y, ref_y, "float32", "y")
    assert_close(s, ref_s, "float32", "residual_out")
    with normkit.record_launches() as log:
        gx, gr = jax.grad(lambda x, r: jnp.sum(module(x, r)[0] * dy) + jnp.sum(module(x, r)[1] * ds),
                          argnums=(0, 1))(x, r)
    dx, dres, _ = reference.fused_add_rms_norm_bwd(np.asarray(x), np.asarray(r), w, np.asarray(dy), np.asarray(ds),
                                                   module.epsilon)
    assert_close(gx, dx, "float32", "dx")
    assert_close(gr, dres, "float32", "dresidual")
    assert_no_dw_work(log)  # the module closed over: its scale is not differentiated


# ---------------------------------------------------------------------------------------------
# Errors: at construction where the settings say it, else at the call, before any launch.


@pytest.mark.parametrize("kwargs,match", [
    (dict(reduction_axes=(-2, -1)), r"reduction_axes=\(-2, -1\): normkit normalizes over one axis, the last"),
    (dict(reduction_axes=-2), r"reduction_axes=-2"),
    (dict(feature_axes=-3), r"feature_axes=-3"),
    (dict(axis_name="batch"), r"axis_name='batch'.*statistics across devices"),
    (dict(axis_index_groups=[[0, 1]]), r"axis_index_groups"),
    (dict(dtype=jnp.int8), r"dtype=.*int8.*float32, bfloat16, float16"),
    (dict(param_dtype=jnp.int32), r"param_dtype=.*int32.* with dtype=None"),
    (dict(epsilon=-1.0), r"eps must be a finite number >= 0"),
    (dict(implementation="cuda"), r"unknown implementation 'cuda'"),
    (dict(casting_mode="fp8"), r"unknown casting_mode 'fp8'"),
    (dict(offset=float("nan")), r"offset must be a finite number"),
])
@pytest.mark.parametrize("cls", [nknnx.RMSNorm, nknnx.LayerNorm, nknnx.FusedAddRMSNorm], ids=lambda c: c.__name__)
def test_construction_errors(cls, kwargs, match):
    if cls is nknnx.LayerNorm and set(kwargs) & {"casting_mode", "offset"}:
        with pytest.raises(TypeError, match="unexpected keyword"):
            cls(D, rngs=nnx.Rngs(0), **kwargs)
        return
    with pytest.raises(ValueError, match=match):
        cls(D, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("cls", [nknnx.RMSNorm, nknnx.LayerNorm], ids=lambda c: c.__name__)
def test_call_errors_before_any_launch(cls):
    x = normal((4, D))
    cases = [
        (cls(D, reduction_axes=0, feature_axes=0, rngs=nnx.Rngs(0)), dict(), r"reduction_axes=0 is not the last axis"),
        (cls(D, rngs=nnx.Rngs(0)), dict(mask=jnp.ones((4, D), bool)), r"takes no mask="),
        (cls(D + 1, rngs=nnx.Rngs(0)), dict(), r"scale has shape|weight has shape \(33,\)"),
    ]
    for module, kwargs, match in cases:
        with normkit.record_launches() as log, pytest.raises((ValueError, TypeError), match=match):
            module(x, **kwargs)
        assert not log, "an error must come before any launch"
    # a non-negative axis that is the last axis of the input is accepted, as flax accepts it
    y = cls(D, reduction_axes=1, feature_axes=(1,), rngs=nnx.Rngs(0))(x)
    assert y.shape == x.shape


# ---------------------------------------------------------------------------------------------
# patch_model.


class Custom(nnx.RMSNorm):  # a subclass with its own call: not patched
    def __call__(self, x, mask=None):
        return super().__call__(x, mask) * 2


class Tower(nnx.Module):
    """Norms in every kind of place: attributes, nnx.List, nnx.Dict, a tuple, a shared one, and
    modules patch_model must leave alone."""

    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.layers = nnx.List([nnx.Dict({"ln": nnx.LayerNorm(D, rngs=rngs), "rms": nnx.RMSNorm(D, rngs=rngs)})
                                for _ in range(2)])
        self.pair = nnx.data((nnx.RMSNorm(D, epsilon=1e-5, rngs=rngs), nnx.Linear(D, D, rngs=rngs)))
        self.shared = self.layers[1]["rms"]
        self.batch_norm = nnx.BatchNorm(D, rngs=rngs)
        self.custom = Custom(D, rngs=rngs)
        self.over_two_axes = nnx.LayerNorm(D, reduction_axes=(-2, -1), rngs=rngs)
        self.mine = nknnx.RMSNorm(D, casting_mode="llama", rngs=rngs)

    def __call__(self, x):
        h = self.norm(x)
        for layer in self.layers:
            h = layer["rms"](layer["ln"](h))
        return self.pair[1](self.pair[0](h)) + self.shared(h)


def _params_by_id(model):
    return {id(v) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}


def test_patch_model_report_parameters_and_round_trip():
    model = randomize(Tower(nnx.Rngs(0)))
    before = nnx.clone(model)
    graphdef, state = nnx.split(model)
    param_ids, shared = _params_by_id(model), model.shared
    report = nknnx.patch_model(model)
    patched = {path: (old.__name__, new) for path, old, new in report.patched}
    assert patched == {"norm": ("RMSNorm", nknnx.RMSNorm), "layers.0.ln": ("LayerNorm", nknnx.LayerNorm),
                       "layers.0.rms": ("RMSNorm", nknnx.RMSNorm), "layers.1.ln": ("LayerNorm", nknnx.LayerNorm),
                       "layers.1.rms": ("RMSNorm", nknnx.RMSNorm), "pair.0": ("RMSNorm", nknnx.RMSNorm)}
    skipped = {path: reason for path, _, reason in report.skipped}
    assert skipped == {"batch_norm": "not a class normkit knows",
                       "custom": "a subclass of flax.nnx.RMSNorm, whose __call__ may differ; not known",
                       "over_two_axes": "reduction_axes=(-2, -1): normkit normalizes over one axis, the last (-1)",
                       "mine": "already a normkit module"}
    assert "patched   4 x flax.nnx.RMSNorm -> jax_frontend.nnx.RMSNorm" in str(report)
    assert model.shared is shared and model.shared is model.layers[1]["rms"]  # the same objects, patched once
    assert isinstance(model.shared, nknnx.RMSNorm) and isinstance(model.pair[0], nknnx.RMSNorm)
    assert model.pair[0].epsilon == 1e-5 and model.pair[0].casting_mode == "gemma" and model.pair[0].offset == 0.0
    assert _params_by_id(model) == param_ids  # the same nnx.Param objects
    assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(state)
    x = normal((3, D))
    with normkit.record_launches() as log:
        got = model(x)
    assert len(bwd_launches(log)) == 0 and len(log) >= 5  # every patched norm ran a kernel
    assert_close(got, np.asarray(before(x), np.float64), "float32", "patched tower")
    assert len(nknnx.patch_model(model)) == 0  # patching twice changes nothing
    restored = nknnx.unpatch_model(model)
    assert sorted(path for path, _, _ in restored.patched) == sorted(patched)
    assert [(p, r) for p, _, r in restored.skipped] == [
        ("mine", "casting_mode='llama': not the function flax.nnx.RMSNorm computes")]
    assert nnx.graphdef(model) == graphdef  # flax's modules again, attribute for attribute


def test_unpatch_keeps_what_flax_cannot_compute():
    model = nnx.Dict({"gemma": nknnx.RMSNorm(D, offset=1.0, rngs=nnx.Rngs(0)),
                      "fused": nknnx.FusedAddRMSNorm(D, rngs=nnx.Rngs(0)),
                      "plain": nknnx.RMSNorm(D, rngs=nnx.Rngs(0))})
    report = nknnx.unpatch_model(model)
    assert [p for p, _, _ in report.patched] == ["plain"] and type(model["plain"]) is nnx.RMSNorm
    assert {p: r for p, _, r in report.skipped} == {
        "gemma": "offset=1.0: not the function flax.nnx.RMSNorm computes",
        "fused": "flax has no fused add-and-norm module"}


def test_patch_model_filters():
    model = Tower(nnx.Rngs(0))
    report = nknnx.patch_model(model, layer_norm=False, include=lambda path, m: not path.startswith("pair"))
    reasons = {path: reason for path, _, reason in report.skipped}
    assert reasons["layers.0.ln"] == "excluded by layer_norm=False" and reasons["pair.0"] == "excluded by include()"
    assert sorted(p for p, _, _ in report.patched) == ["layers.0.rms", "layers.1.rms", "norm"]
    with pytest.raises(ValueError, match="unknown implementation 'cuda'"):
        nknnx.patch_model(model, implementation="cuda")
    report = nknnx.patch_model(nnx.RMSNorm(D, rngs=nnx.Rngs(0)), implementation="xla")  # the root itself
    assert [p for p, _, _ in report.patched] == [""]


# ---------------------------------------------------------------------------------------------
# LoRA by filter, and the transformations.


class Block(nnx.Module):
    """Pre-norm block: RMSNorm -> LoRA projection -> residual add -> LayerNorm."""

    def __init__(self, rngs, scale_init=nnx.initializers.ones, bias_init=nnx.initializers.zeros,
                 kernel_init=nnx.initializers.lecun_normal()):
        self.norm = nnx.RMSNorm(D, scale_init=scale_init, rngs=rngs)
        self.proj = nnx.LoRALinear(D, D, lora_rank=4, b_initializer=nnx.initializers.normal(0.1),
                                   kernel_init=kernel_init, rngs=rngs)
        self.ln = nnx.LayerNorm(D, scale_init=scale_init, bias_init=bias_init, rngs=rngs)

    def __call__(self, x):
        return self.ln(x + self.proj(self.norm(x)))


def loss_fn(model, x):
    return jnp.mean(jnp.tanh(model(x)) ** 2)


def _pair(make, implementation=None):
    """(patched, unpatched): two copies of one random model."""
    model = make()
    randomize(model)
    flax_model = nnx.clone(model)
    report = nknnx.patch_model(model, implementation=implementation)
    assert len(report) > 0 and not report.skipped
    return model, flax_model


def _flat(state) -> dict:
    """An nnx.State's leaves as float64 NumPy arrays by path."""
    return {jax.tree_util.keystr(path): np.asarray(leaf, np.float64)
            for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]}


def _close_trees(got, want, rows, what):
    got, want = _flat(got), _flat(want)
    assert got.keys() == want.keys()
    for path, w in want.items():
        assert_close(got[path], w, "float32", f"{what} {path}", reduced_over=rows)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_lora_filter_runs_no_dw_work(implementation):
    """nnx.value_and_grad with DiffState(0, nnx.LoRAParam) under nnx.jit: loss and LoRA gradients as the
    unpatched model's, and the norms' backward without dW (no partials, no reduction)."""
    model, flax_model = _pair(lambda: Block(nnx.Rngs(0)), implementation)
    x = normal((2, 5, D))
    step = nnx.jit(nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam)))
    with normkit.record_launches() as log:
        loss, grads = step(model, x)
    want_loss, want = step(flax_model, x)
    assert_close(loss, want_loss, "float32", "loss")
    _close_trees(grads, want, 10, "LoRA grad")
    assert {path for path, _ in nnx.to_flat_state(grads)} == {("proj", "lora", "lora_a"), ("proj", "lora", "lora_b")}
    assert_no_dw_work(log, implementation)
    # Training the norms too (every nnx.Param): their dW is computed, and matches flax's.
    with normkit.record_launches() as log:
        grads = nnx.jit(nnx.grad(loss_fn))(model, x)
    _close_trees(grads, nnx.grad(loss_fn)(flax_model, x), 10, "all grads")
    assert all(b.flags["COMPUTE_DW"] for b in bwd_launches(log))


def _stacked_blocks(n=2):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Block(rngs)
    return make(nnx.Rngs(0))


def _scan_apply(blocks, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(block, h):
        return block(h)
    return body(blocks, x)


TRANSFORMS = {
    # nnx.scan over layers whose parameters are stacked on a leading axis (built by nnx.vmap).
    "scan": (_stacked_blocks, lambda m, x: jnp.mean(jnp.tanh(_scan_apply(m, x)) ** 2)),
    "remat": (lambda: Block(nnx.Rngs(0)), lambda m, x: jnp.mean(jnp.tanh(nnx.remat(lambda m, x: m(x))(m, x)) ** 2)),
    # vmap over a batch of inputs, the module broadcast: normkit folds the batch into rows.
    "vmap": (lambda: Block(nnx.Rngs(0)),
             lambda m, x: jnp.mean(jnp.tanh(nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, x)) ** 2)),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_transformations(transform):
    make, loss = TRANSFORMS[transform]
    model, flax_model = _pair(make)
    x = normal((3, 4, D))
    step = nnx.jit(nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))
    with normkit.record_launches() as log:
        got_loss, got = step(model, x)
    want_loss, want = step(flax_model, x)
    assert_close(got_loss, want_loss, "float32", f"{transform} loss")
    _close_trees(got, want, 12, f"{transform} LoRA grad")
    assert_no_dw_work(log)


# ---------------------------------------------------------------------------------------------
# A mesh: 2 x 2 CPU devices in a subprocess (XLA_FLAGS must be set before JAX starts).


def mesh_worker(out: str) -> None:
    """Run in a 4-device process: for Auto and Explicit axes, a Block whose norm parameters are sharded
    along their features over "model" (``nnx.with_partitioning``, FSDP-style) on x sharded over "data";
    with Auto axes its projection is also column-parallel over "model", so that XLA's propagation
    would split the next norm's input along its features; patched against unpatched."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    def make(rngs, axis_type):
        kernel = (None, "model") if axis_type == "Auto" else (None, None)
        return Block(rngs, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("model",)),
                     bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("model",)),
                     kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), kernel))

    results = {}
    for axis_type in ("Auto", "Explicit"):
        mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(AxisType, axis_type),) * 2)
        with jax.set_mesh(mesh):
            model = make(nnx.Rngs(0), axis_type)
            flax_model = nnx.clone(model)
            params = _params_by_id(model)
            report = nknnx.patch_model(model)
            x = jax.device_put(normal((8, 3, D)), NamedSharding(mesh, P("data")))
            res = {"patched": len(report), "same_params": _params_by_id(model) == params,
                   "scale_spec": str(model.norm.scale.get_value().sharding.spec)}
            for filt in ("lora", "all"):
                argnums = nnx.DiffState(0, nnx.LoRAParam) if filt == "lora" else 0
                step = nnx.jit(nnx.value_and_grad(loss_fn, argnums=argnums))
                with normkit.record_launches() as log:
                    loss, grads = step(model, x)
                want_loss, want = step(flax_model, x)
                got_flat, want_flat = _flat(grads), _flat(want)
                res[filt] = {"loss": [float(loss), float(want_loss)],
                             "grads": {k: [got_flat[k].tolist(), w.tolist()] for k, w in want_flat.items()},
                             "compute_dw": [bool(b.flags["COMPUTE_DW"]) for b in bwd_launches(log)],
                             "partials": sum(launch.partial_bytes for launch in log),
                             "rows_per_launch": sorted({launch.flags.get("M", -1) for launch in log})}
            y = nnx.jit(lambda m, x: m(x))(model, x)
            res["out_spec"] = str(y.sharding.spec)
            res["out_first_axis"] = str(y.sharding.spec[0]) if len(y.sharding.spec) else "None"
            results[axis_type] = res
    Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("nnx_mesh") / "mesh.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = "import sys; from tests.test_nnx import mesh_worker; mesh_worker(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_mesh(mesh_results, axis_type):
    res = mesh_results[axis_type]
    assert res["patched"] == 2 and res["same_params"] and res["scale_spec"] == "P('model',)"
    for filt in ("lora", "all"):
        got = res[filt]
        assert_close(got["loss"][0], got["loss"][1], "float32", f"{filt} loss")
        for path, (g, w) in got["grads"].items():
            assert_close(np.asarray(g), np.asarray(w), "float32", f"{filt} {path}", reduced_over=24)
        assert got["compute_dw"] and all(dw == (filt == "all") for dw in got["compute_dw"]), got["compute_dw"]
        assert (got["partials"] > 0) == (filt == "all")
    assert len(res["lora"]["grads"]) == 2 and len(res["all"]["grads"]) == 7
    assert res["out_first_axis"] == "data", res["out_spec"]  # the rows stay where they were


# ---------------------------------------------------------------------------------------------
# Packaging.


def test_import_jax_frontend_does_not_import_flax():
    code = "import sys, jax_frontend; sys.exit('flax' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
