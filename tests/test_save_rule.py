"""The one safety rule of the output-saving backward (``normkit.saving.decide``, ``normkit.norm_math``), on
every route of both frontends: a frozen norm keeps its output where x_hat can be recovered from it, its
input where it cannot, and never gives a NaN or a wrong gradient that keeping the input would not.

- A property test over ops, dtypes, row lengths (from 1), weights near each edge of the rule (tiny and
  zero columns, biases at and over ``OUTPUT_BIAS_RATIO`` times the weight, weights large enough for a
  float16 y to overflow) and rows that reach ``|x_hat| = sqrt(N)``, through every frontend (Torch
  eager; JAX's Triton, Pallas and XLA implementations under ``jit``): outputs and gradients against the
  float64 reference, and what was kept against the rule. Where the weight's values are unseen (JAX
  under ``jit``) the rule is ``saving.traced_rule``; a weight that then turns out unsafe gives a NaN dx
  everywhere, loud, never a wrong one.
- Each way a caller can meet the rule: float16 overflow and two-column LayerNorm rows on every route
  (eager, ``torch.compile`` with and without a module that knows its weight, JAX eager and jitted,
  Flax NNX); a weight written behind torch's version counter; a checkpoint whose parameters change
  their ``requires_grad`` between the forward and the recomputation; ``torch.compile(dynamic=True)``;
  compiled autograd over an eager forward; a weight made under ``torch.inference_mode``.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from normkit import norm_math
from normkit.norm_math import OUTPUT_BIAS_RATIO, W_MIN
from normkit.ops import OPS
from normkit.shapes import Shape
from normkit.testing import TOLERANCES, assert_close, rounded
from tests.frontends import FRONTENDS, requires_torch
from tests.harness import Case, forced_plan, rule_keeps_output

FP16_MAX = 65504.0


# ---------------------------------------------------------------------------------------------
# Inputs at the rule's edges.


def _edge_inputs(op: str, N: int, dtype: str, regime: str, rng, rows: int = 3) -> dict:
    """Inputs of ``op`` over ``rows`` rows of N (rounded to ``dtype``), the weight and bias in a ``regime``:
    "plain" (|w| in [0.5, 1.5], |b| below the ratio), "tiny" (one column at a quarter of W_MIN), "zero"
    (one column 0), "bias" (one column's |b| at 1.5 x the ratio), "huge" (float16's y can overflow: max|w|
    at 1.5 x 65504 / sqrt(N)); the first row of x has one element far larger than the others, so that its
    |x_hat| nears sqrt(N)."""
    spec = OPS[op]
    x = rng.standard_normal((rows, N)) * 1.5 + 0.3
    x[0, rng.integers(N)] = 1e3  # |x_hat| of that element -> sqrt(N)
    w = rng.uniform(0.5, 1.5, N) * rng.choice([-1.0, 1.0], N)
    j = int(rng.integers(N))
    if regime == "tiny":
        w[j] = W_MIN[dtype] / 4
    elif regime == "zero":
        w[j] = 0.0
    elif regime == "huge":  # (at most 60000: float16 holds the weight itself)
        w *= min(1.5 * FP16_MAX / math.sqrt(N), 60000.0) / np.abs(w).max()
    out = {"x": rounded(x, dtype), "weight": rounded(w, dtype)}
    if spec.has_residual:
        out["residual"] = rounded(rng.standard_normal((rows, N)) * 0.1, dtype)
    if "bias" in spec.params:
        b = rng.uniform(0.0, 0.5, N) * OUTPUT_BIAS_RATIO * np.abs(w)
        if regime == "bias":
            b[j] = 1.5 * OUTPUT_BIAS_RATIO * abs(w[j]) + 1.0
        out["bias"] = rounded(b, dtype)
    scale = 1.0 / max(np.abs(w).max(), 1e-30) if regime == "huge" else 1.0
    out["dy"] = rounded(rng.standard_normal((rows, N)) * scale, dtype)
    if spec.has_residual:
        out["ds"] = rounded(rng.standard_normal((rows, N)) * scale, dtype)
    return out


def _expected_output_kept(case: Case, inp: dict, traced: bool) -> bool:
    """What ``save="auto"`` keeps for this case (the weight and bias frozen, x trained): the rule."""
    return rule_keeps_output(case.spec, case.shape.N, inp["weight"], inp["bias"] if case.has_b else None,
                             x_dtype=case.dtype, opts=case.spec.options(**case.kwargs), traced=traced)


def _check_case(frontend, case: Case, inp: dict) -> None:
    res = frontend.call(case, inp)
    spec = case.spec
    traced = frontend.name.startswith("jax")  # jitted: the weight's values are unseen
    kept = _expected_output_kept(case, inp, traced)
    from_y = [launch.flags.get("FROM_Y") for launch in res.log if "bwd" in launch.kernel]
    assert from_y == [kept], (str(case), from_y, kept)
    ref_out, ref_grads = spec.run_reference({k: inp.get(k) for k in spec.inputs}, spec.options(**case.kwargs),
                                            {"y": inp["dy"], "residual_out": inp.get("ds")})
    for name in spec.outputs:  # y as stored in x's dtype: inf where a float16 y overflows, as the reference's
        assert_close(res.outputs[name], rounded(ref_out[name], case.dtype), case.dtype, f"{case}: {name}")
    unsafe = norm_math.unsafe_reason(inp["weight"].astype(np.float32),
                                     inp["bias"].astype(np.float32) if case.has_b else None,
                                     x_dtype=case.dtype, offset=case.offset) is not None
    for name in spec.row_inputs:
        got = res.grads[name]
        if kept and unsafe:  # traced, and the weight turned out unsafe: loud, everywhere
            assert np.isnan(got).all(), f"{case}: d{name} must be NaN everywhere (traced, unsafe weight)"
            continue
        assert np.isfinite(got).all(), f"{case}: d{name} not finite"
        ref = ref_grads[name]
        scale = max(1.0, float(np.abs(ref).max()) * TOLERANCES[case.dtype]["rtol"] / TOLERANCES[case.dtype]["atol"])
        err = np.abs(got - ref)
        bound = TOLERANCES[case.dtype]["atol"] * scale + TOLERANCES[case.dtype]["rtol"] * np.abs(ref)
        assert (err <= bound).all(), f"{case}: d{name} off by {err.max():.3g} (bound {bound.min():.3g}..)"


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(op=st.sampled_from(sorted(OPS)), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
       N=st.sampled_from([1, 2, 3, 4, 8, 33]),
       regime=st.sampled_from(["plain", "tiny", "zero", "bias", "huge"]), seed=st.integers(0, 2**16))
def test_auto_follows_the_rule_on_every_frontend(frontend, op, dtype, N, regime, seed):
    """``save="auto"`` with frozen parameters at the rule's edges: kept what the rule says, and every
    result right (dx within the tolerance table, scaled to dx's magnitude) or, traced with an unsafe
    weight, NaN everywhere."""
    spec = OPS[op]
    if regime == "bias" and "bias" not in spec.params:
        regime = "zero"
    case = Case(op, Shape("edge", (3, N), frozenset()), dtype, has_b="bias" in spec.params, trainable=frozenset(spec.row_inputs),
                eps=spec.default_eps, casting="gemma" if spec.has_offset else "llama")
    inp = _edge_inputs(op, N, dtype, regime, np.random.default_rng(seed))
    with np.errstate(over="ignore", invalid="ignore"):
        _check_case(frontend, case, inp)


@pytest.fixture
def backward_plan(request, monkeypatch, frontend):
    """Every dx-only backward planned in two passes over half-row chunks (``CHUNK_N``), or on a
    persistent grid (programs loop over tiles, keeping the weight's recovery loaded), or with the
    parameters loaded in each tile (``PARAMS_PER_TILE``), one program per tile or persistent."""
    from tests.test_properties import _HalfRowsBackward, _PersistentBackward, _PerTileBackward

    if request.param == "two passes":
        yield from forced_plan(monkeypatch, frontend, "_BWD_TILES", _HalfRowsBackward(), "norm_bwd_kernel",
                               lambda flags: flags["CHUNK_N"] > 0 and flags["FROM_Y"])
    elif request.param.startswith("per tile"):
        persistent = request.param.endswith("persistent")
        yield from forced_plan(monkeypatch, frontend, "_BWD_TILES", _PerTileBackward(persistent), "norm_bwd_kernel",
                               lambda flags: flags["PARAMS_PER_TILE"] and flags["PERSISTENT"] == persistent)
    else:
        yield from forced_plan(monkeypatch, frontend, "_BWD_TILES", _PersistentBackward(), "norm_bwd_kernel",
                               lambda flags: flags["PERSISTENT"] and flags["FROM_Y"])


# The default run: every op on every plan through Torch; through JAX (the same plans and kernels,
# launched by its frontend), each plan once and each op at least once. The other JAX cases are the
# slow tier.
BACKWARD_PLANS = ["two passes", "persistent", "per tile", "per tile, persistent"]
PLAN_QUICK_JAX = {(plan, sorted(OPS)[i % len(OPS)]) for i, plan in enumerate(BACKWARD_PLANS)}


@pytest.mark.parametrize("backward_plan,op,frontend", [
    pytest.param(plan, op, frontend, marks=() if frontend == "torch" or (plan, op) in PLAN_QUICK_JAX
                 else pytest.mark.slow)
    for plan in BACKWARD_PLANS for op in sorted(OPS) for frontend in ("jax", "torch") if frontend in FRONTENDS],
    indirect=["backward_plan", "frontend"])
def test_output_saving_backward_in_two_passes_and_on_a_persistent_grid(frontend, op, backward_plan):
    """The output-saving backward with rows read in two passes (the row sums, then dx), on a
    persistent grid, and with its parameters loaded in each tile: right against float64 at row lengths that fill, and that do not fill, the chunks, in each dtype, with and without
    a bias (JAX under ``jit`` keeps the input of a norm with a bias: ``saving.traced_rule``)."""
    spec = OPS[op]
    for seed, (dtype, N) in enumerate([("bfloat16", 64), ("float32", 200), ("float16", 96)]):
        case = Case(op, Shape("chunks", (70, N), frozenset()), dtype, has_b="bias" in spec.params and seed > 0,
                    trainable=frozenset(spec.row_inputs), eps=spec.default_eps,
                    casting=("llama", "gemma", "none")[seed] if spec.has_offset else "llama",
                    offset=1.0 if spec.has_offset and seed else 0.0)
        inp = _edge_inputs(op, N, dtype, "plain", np.random.default_rng(seed), rows=70)
        if not case.has_b:
            inp.pop("bias", None)
        _check_case(frontend, case, inp)


# ---------------------------------------------------------------------------------------------
# Torch routes.

try:
    import torch
except ImportError:  # a JAX-only install: the Torch tests are skipped (requires_torch)
    torch = None


def _t(a, dtype):
    import torch

    from torch_frontend._backend import TORCH_DTYPES

    return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(TORCH_DTYPES[dtype])


def _np(t):
    return t.detach().double().numpy()


def _torch_call(op: str, inputs: dict, **kw):
    import torch_frontend as tf

    spec = OPS[op]
    out = getattr(tf, op)(*(inputs.get(n) for n in spec.inputs), **kw)
    return out if spec.has_residual else (out,)


def _grads_both_saves(op: str, inp: dict, dtype: str, fn=None) -> dict:
    """dx (and dresidual) of ``op`` with save="auto" and save="input", through ``fn`` (default: eager)."""
    spec = OPS[op]
    got = {}
    for save in ("auto", "input"):
        t = {k: _t(inp[k], dtype) for k in spec.inputs}
        for k in spec.row_inputs:
            t[k].requires_grad_(True)

        def call(*rows, save=save, t=t):
            return _torch_call(op, {**t, **dict(zip(spec.row_inputs, rows))}, save=save)

        outs = (fn or (lambda f: f))(call)(*(t[k] for k in spec.row_inputs))
        cots = [_t(inp["dy"], dtype)] + ([_t(inp["ds"], dtype)] if spec.has_residual else [])
        got[save] = [_np(g) for g in torch.autograd.grad(list(outs), [t[k] for k in spec.row_inputs], cots)]
    return got


@requires_torch
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("route", ["eager", "compiled", "compiled module"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_float16_overflow_keeps_the_input(op, route):
    """A frozen float16 weight large enough for y to overflow (a row whose |x_hat| nears sqrt(N)): y is
    inf there, as torch's own norm gives it, and dx is the input-saving backward's, finite and right,
    eagerly, compiled (the weight's values unseen: float16 keeps the input) and through a normkit
    module under torch.compile (which knows its weight)."""
    import torch_frontend as tf

    spec = OPS[op]
    inp = _edge_inputs(op, 64, "float16", "huge", np.random.default_rng(1))
    assert norm_math.unsafe_reason(inp["weight"], None, x_dtype="float16") is not None
    if route == "compiled module":
        mod = {"rms_norm": tf.RMSNorm, "layer_norm": tf.LayerNorm, "fused_add_rms_norm": tf.FusedAddRMSNorm}[op](64)
        with torch.no_grad():
            mod.weight.copy_(_t(inp["weight"], "float32"))
            if "bias" in spec.params:
                mod.bias.copy_(_t(inp["bias"], "float32"))
        mod.refresh_save_hint()
        assert mod.save_hint[torch.float16] is False
        mod = mod.half().requires_grad_(False)
        torch._dynamo.reset()
        f = torch.compile(mod, backend="aot_eager")
        rows = [_t(inp[k], "float16").requires_grad_(True) for k in spec.row_inputs]
        outs = f(*rows)
        outs = outs if spec.has_residual else (outs,)
        cots = [_t(inp["dy"], "float16")] + ([_t(inp["ds"], "float16")] if spec.has_residual else [])
        got = [_np(g) for g in torch.autograd.grad(list(outs), rows, cots)]
    else:
        fn = None
        if route == "compiled":
            torch._dynamo.reset()
            fn = lambda f: torch.compile(f, backend="aot_eager")  # noqa: E731
        grads = _grads_both_saves(op, inp, "float16", fn)
        got = grads["auto"]
        for a, b in zip(grads["auto"], grads["input"]):
            assert np.array_equal(a, b), f"{op} {route}: auto differs from save='input'"
    _, ref = spec.run_reference({k: inp.get(k) for k in spec.inputs}, spec.options(eps=spec.default_eps),
                                {"y": inp["dy"], "residual_out": inp.get("ds")})
    for name, g in zip(spec.row_inputs, got):
        assert np.isfinite(g).all(), f"{op} {route}: d{name} not finite"
        assert_close(g, ref[name], "float16", f"{op} {route}: d{name}")


@requires_torch
@pytest.mark.parametrize("N", [1, 2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_degenerate_rows_keep_the_input(op, dtype, N):
    """A LayerNorm row of 1 or 2 elements and an RMSNorm row of 1 have x_hat = +-1 whatever x is: dx
    is of the order of eps, and x_hat read back from y would cancel to noise there. "auto" keeps the
    input (the very gradients of save="input"), and save="output" refuses."""
    spec = OPS[op]
    inp = _edge_inputs(op, N, dtype, "plain", np.random.default_rng(N))
    grads = _grads_both_saves(op, inp, dtype)
    degenerate = norm_math.output_degenerate(N, is_rms=spec.is_rms)
    if degenerate:
        for a, b in zip(grads["auto"], grads["input"]):
            assert np.array_equal(a, b)
        t = {k: _t(inp[k], dtype).requires_grad_(k in spec.row_inputs) for k in spec.inputs}
        with pytest.raises(ValueError, match=f"rows of {N} element"):
            _torch_call(op, t, save="output")
    _, ref = spec.run_reference({k: inp.get(k) for k in spec.inputs}, spec.options(eps=spec.default_eps),
                                {"y": inp["dy"], "residual_out": inp.get("ds")})
    for name, g in zip(spec.row_inputs, grads["auto"]):
        assert_close(g, ref[name], dtype, f"{op} N={N}: d{name}")


@requires_torch
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_weight_written_behind_the_version_counter(op):
    """A frozen weight zeroed in one column through ``.data`` (torch's version counter does not see it)
    after a call decided to keep the output: the next call's forward finds the weight unsafe (its
    recovery), so that call's dx is NaN everywhere, never wrong; the call after it keeps the input and
    is right; ``save_decision`` tells why."""
    import torch_frontend as tf
    from torch_frontend import _bound

    spec = OPS[op]
    rng = np.random.default_rng(7)
    inp = _edge_inputs(op, 16, "float32", "plain", rng)
    w = _t(inp["weight"], "float32")
    params = {"weight": w, **({"bias": _t(inp["bias"], "float32")} if "bias" in spec.params else {})}

    def step():
        rows = {k: _t(inp[k], "float32").requires_grad_(True) for k in spec.row_inputs}
        outs = _torch_call(op, {**rows, **params})
        return torch.autograd.grad(outs[0], [rows[k] for k in spec.row_inputs], _t(inp["dy"], "float32"))

    assert not _bound.weight_tripped_unread()  # no flag left by another test (conftest's reset)
    step()  # decides: the output
    version = w._version
    w.data[3] = 0.0
    assert w._version == version  # the write went around the counter
    poisoned = step()
    assert all(g.isnan().all() for g in poisoned)
    assert _bound.weight_tripped_unread()  # set by that forward, read by the next call
    fixed = step()
    assert not _bound.weight_tripped_unread()
    rows = {k: _t(inp[k], "float32").requires_grad_(True) for k in spec.row_inputs}
    outs = _torch_call(op, {**rows, **params}, save="input")
    want = torch.autograd.grad(outs[0], [rows[k] for k in spec.row_inputs], _t(inp["dy"], "float32"))
    for a, b in zip(fixed, want):
        assert torch.equal(a, b)
    assert "column 3" in tf.save_decision(w, params.get("bias"), dtype=torch.float32).reason


@requires_torch
@pytest.mark.parametrize("direction", ["frozen then trained", "trained then frozen"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_checkpoint_recomputation_makes_the_forwards_decision(op, direction):
    """A non-reentrant checkpoint whose norm weight changes its ``requires_grad`` between the forward
    and the recomputation in the backward: the recomputation keeps what the forward kept (inside a
    checkpoint, "auto" keeps the input, which needs no decision to agree), so dx is right. (The weight's
    gradient follows torch's rules: none for a weight frozen at the forward, and none accumulated into
    a weight that no longer requires one.)"""
    import torch.utils.checkpoint as cp

    spec = OPS[op]
    inp = _edge_inputs(op, 16, "float32", "plain", np.random.default_rng(3))
    trained_first = direction == "trained then frozen"
    params = {k: _t(inp[k], "float32").requires_grad_(trained_first) for k in spec.params}
    rows = {k: _t(inp[k], "float32").requires_grad_(True) for k in spec.row_inputs}

    def f(*r):
        return tuple(_torch_call(op, {**dict(zip(spec.row_inputs, r)), **params}))

    outs = cp.checkpoint(f, *(rows[k] for k in spec.row_inputs), use_reentrant=False)
    for p in params.values():
        p.requires_grad_(not trained_first)
    cots = [_t(inp["dy"], "float32")] + ([_t(inp["ds"], "float32")] if spec.has_residual else [])
    torch.autograd.backward(list(outs), cots)
    _, ref = spec.run_reference({k: inp.get(k) for k in spec.inputs}, spec.options(eps=spec.default_eps),
                                {"y": inp["dy"], "residual_out": inp.get("ds")})
    for k in spec.row_inputs:
        assert_close(_np(rows[k].grad), ref[k], "float32", f"{op} {direction}: d{k}")
    assert all(p.grad is None for p in params.values())


@requires_torch
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("frozen_with", ["inductor", "kernels"])
def test_compiled_dynamic_chain_of_frozen_and_trained_norms(frozen_with):
    """``torch.compile(dynamic=True)`` over RMSNorm (frozen) -> fused add (trained) -> LayerNorm (frozen,
    with a bias), frozen norms as Inductor's operations or normkit's kernels: the gradients of the
    eager chain, at two sequence lengths (one compiled graph)."""
    import torch_frontend as tf

    g = torch.Generator().manual_seed(5)
    D = 32
    w1, w3 = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    b3 = torch.rand(D, generator=g) * 0.1
    w2 = (torch.rand(D, generator=g) + 0.5).requires_grad_()

    def chain(x, r):
        y, s = tf.fused_add_rms_norm(tf.rms_norm(x, w1), r, w2)
        z = tf.layer_norm(y, w3, b3)
        return (z * z).sum() + s.sum()

    previous = tf.compile_frozen_with(frozen_with)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(chain, dynamic=True, backend="aot_eager")
        for S in (6, 9):
            x = torch.randn(2, S, D, generator=g).requires_grad_()
            r = torch.randn(2, S, D, generator=g)
            want = torch.autograd.grad(chain(x, r), [x, w2])
            got = torch.autograd.grad(compiled(x, r), [x, w2])
            for a, b, what in zip(got, want, ("dx", "dw2")):
                assert_close(_np(a), _np(b), "float32", f"dynamic S={S}: {what}", reduced_over=2 * S)
    finally:
        tf.compile_frozen_with(previous)
        torch._dynamo.reset()


@requires_torch
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
# compiled autograd's fake-tensor conversion reads .grad of the graph's non-leaf tensors (torch's own warning)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize("op", sorted(OPS))
def test_compiled_autograd_over_an_eager_forward(op):
    """Compiled autograd traces the backward of an eager forward (frozen, keeping its output; and
    trained): it runs through normkit's library ops, with the eager backward's gradients bit for bit."""
    from torch._dynamo import compiled_autograd

    spec = OPS[op]
    inp = _edge_inputs(op, 16, "float32", "plain", np.random.default_rng(9))
    for trained in (False, True):
        grads = []
        for compiled in (False, True):
            params = {k: _t(inp[k], "float32").requires_grad_(trained) for k in spec.params}
            rows = {k: _t(inp[k], "float32").requires_grad_(True) for k in spec.row_inputs}
            outs = _torch_call(op, {**rows, **params})
            loss = sum((o * _t(inp["dy"], "float32")).sum() for o in outs)
            torch._dynamo.reset()
            with compiled_autograd._enable(torch.compile(backend="eager")) if compiled else contextlib.nullcontext():
                loss.backward()
            grads.append([t.grad for t in (*rows.values(), *params.values())])
        for a, b in zip(*grads):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{op} trained={trained}"


@requires_torch
def test_a_weight_made_under_inference_mode_says_to_clone_it():
    """As torch's own norm and save="input" do: an inference tensor cannot be saved for a backward."""
    import torch_frontend as tf

    with torch.inference_mode():
        w = torch.ones(32)
    x = torch.randn(4, 32, requires_grad=True)
    for save in ("auto", "input"):
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward.*clone"):
            tf.rms_norm(x, w, save=save)


@requires_torch
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("what", ["layer_norm with a bias", "gemma offset"])
def test_compiled_modules_keep_the_output_where_eager_does(what):
    """Under torch.compile a normkit module decides from what it knows of its weight (its
    ``save_hint``): a LayerNorm with a bias and a Gemma-style RMSNorm (offset 1) keep their output
    where their weights are safe, as eagerly; one whose bias is too large keeps its input."""
    import torch_frontend as tf

    from tests.test_save_output import _rows_sized, saved_tensors

    D = 32
    for safe in (True, False):
        if what == "layer_norm with a bias":
            norm = tf.LayerNorm(D)
            with torch.no_grad():
                norm.bias.copy_(torch.linspace(-0.5, 0.5, D))
                if not safe:
                    norm.bias[4] = 5.0
        else:
            norm = tf.RMSNorm(D, offset=1.0, casting_mode="gemma")
            with torch.no_grad():
                norm.weight.copy_(torch.linspace(-0.5, 0.5, D))
                if not safe:
                    norm.weight[4] = -1.0  # 1 + w = 0
        norm.refresh_save_hint()
        norm.requires_grad_(False)
        a = torch.randn(D, 8, requires_grad=True)
        x = torch.randn(6, D, requires_grad=True)
        torch._dynamo.reset()
        f = torch.compile(lambda x: ((norm(x) @ a) ** 2).sum(), fullgraph=True, backend="aot_eager")
        f(x)
        with saved_tensors() as saved:
            loss = f(x)
        assert len(_rows_sized(saved, x)) == (1 if safe else 2), (what, safe)
        got = torch.autograd.grad(loss, [x, a])
        want = torch.autograd.grad(((norm(x) @ a) ** 2).sum(), [x, a])
        for g_, w_ in zip(got, want):
            assert_close(_np(g_), _np(w_), "float32", f"{what} safe={safe}: compiled vs eager")


@requires_torch
@pytest.mark.parametrize("entry", sorted(__import__("normkit.launch", fromlist=["_BWD_TILES"])._BWD_TILES),
                         ids=lambda k: f"{k[0]}-{'output' if k[1] else 'input'}-{k[2]}B-{k[3]}")
def test_each_planned_backward_tile_at_its_shape(entry):
    """Every dx-only backward tile of normkit/tiles.json, at a shape that plans it (more rows than its
    grid has programs, where it is persistent): dx through autograd against float64, launched with
    the tile's warps, chunks and grid."""
    import normkit
    from normkit.launch import _BWD_TILES, tile_config
    from tests.frontend_torch import DEVICE
    from torch_frontend._backend import num_sms

    op, from_output, elem_bytes, block_n = entry
    spec = OPS[op]
    dtype = {2: "bfloat16", 4: "float32"}[elem_bytes]
    num_warps, chunk, per_sm, _, rows, per_tile = _BWD_TILES[entry]
    block_m = rows or tile_config(1, block_n)[0]  # rows per tile: more tiles than a persistent grid's programs
    M = (3 * max(1, round(per_sm * num_sms(DEVICE))) + 5) * block_m if per_sm else 7
    N = block_n - 40  # a row that does not fill the tile
    case = Case(op, Shape("planned", (M, N), frozenset()), dtype, has_b="bias" in spec.params,
                trainable=frozenset(spec.row_inputs), eps=spec.default_eps)
    inp = _edge_inputs(op, N, dtype, "plain", np.random.default_rng(block_n), rows=M)
    with np.errstate(over="ignore", invalid="ignore"), normkit.record_launches() as log:
        _check_case(FRONTENDS["torch"](), case, inp)
    bwd = log.of("norm_bwd_kernel")[0]
    assert (bwd.num_warps, bwd.flags["CHUNK_N"], bwd.flags["PERSISTENT"]) == (num_warps, chunk, per_sm > 0), bwd
    assert rows == 0 or bwd.flags["BLOCK_M"] == rows, bwd
    assert bwd.flags["PARAMS_PER_TILE"] == bool(per_tile), bwd


@requires_torch
@pytest.mark.parametrize("plan", ["per tile", "per tile, persistent", "as planned"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_output_saving_backward_reads_strided_and_expanded_parameters(op, plan, monkeypatch):
    """The output-saving backward with a frozen weight read every other element of a larger buffer and
    a frozen bias expanded from one value (stride 0), each tile loading them (``PARAMS_PER_TILE``) or
    the program holding them: dx against float64, the output kept."""
    import torch

    import normkit
    import torch_frontend as tf
    from tests.frontend_torch import DEVICE
    from tests.test_properties import _PerTileBackward

    spec = OPS[op]
    rows, N = 70, 96
    rng = np.random.default_rng(7)
    w_buf = rng.uniform(1.0, 2.0, 2 * N)
    b_val = 0.25
    x, dy = rng.standard_normal((rows, N)), rng.standard_normal((rows, N))
    res = rng.standard_normal((rows, N)) * 0.1
    t = lambda a: torch.tensor(a, dtype=torch.float32, device=DEVICE)  # noqa: E731
    xt = t(x).requires_grad_()
    args = [xt] + ([t(res).requires_grad_()] if spec.has_residual else []) + [t(w_buf)[::2]]
    if "bias" in spec.params:
        args.append(t(np.array([b_val])).expand(N))
    with contextlib.ExitStack() as stack:
        if plan != "as planned":
            persistent = plan.endswith("persistent")
            stack.enter_context(contextlib.contextmanager(forced_plan)(
                monkeypatch, FRONTENDS["torch"](), "_BWD_TILES", _PerTileBackward(persistent), "norm_bwd_kernel",
                lambda flags: flags["PARAMS_PER_TILE"] and flags["PERSISTENT"] == persistent))
        with normkit.record_launches() as log:
            out = getattr(tf, op)(*args)
            y = out[0] if spec.has_residual else out
            dx = torch.autograd.grad(y, xt, t(dy))[0]
    assert [launch.flags["FROM_Y"] for launch in log.of("norm_bwd_kernel")] == [True], log
    inputs = {"x": x, "weight": w_buf[::2], "bias": np.full(N, b_val) if "bias" in spec.params else None,
              "residual": res if spec.has_residual else None}
    _, grads = spec.run_reference({k: inputs.get(k) for k in spec.inputs}, spec.options(eps=spec.default_eps),
                                  {"y": dy})
    assert_close(dx.detach().cpu().numpy(), grads["x"], "float32", f"{op} {plan}: dx")
