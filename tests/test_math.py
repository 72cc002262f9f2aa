"""The output-saving backward and its safety predicate (``normkit.norm_math``).

- A property test over ops, dtypes, casting modes, offsets, parameter sets and dtypes, w_eff
  magnitudes from 1 down past the safety threshold W_MIN, and bias ratios up past
  OUTPUT_BIAS_RATIO: the predicate agrees with its definition (computed here on its own), and dx
  from the saved output matches the float64 input-saving reference where it is safe, and is NaN
  everywhere where it is not.
- The accuracy bound that sets the thresholds: at |w_eff| = W_MIN and |b| = OUTPUT_BIAS_RATIO |w_eff|,
  dx from the saved output is as accurate as dx from the saved input (relative L2 error, dx stored
  in x's dtype).
- The guard at its boundaries, on each array library (NumPy, torch, JAX), under ``jax.jit`` and
  ``torch.compile``, whose callers cannot look at the weight's values.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import zlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from normkit import norm_math, reference
from normkit.norm_math import OUTPUT_BIAS_RATIO, W_MIN, Casting
from normkit.ops import OPS, X_DTYPES
from normkit.testing import TOLERANCES, assert_close, rounded

NP_DTYPES = {"float64": np.float64, "float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None


def _array(values, dtype: str) -> np.ndarray:
    """float64 ``values`` stored in ``dtype`` (a NumPy array; bfloat16 from ml_dtypes)."""
    return rounded(values, dtype).astype(NP_DTYPES[dtype])


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _expected_unsafe(weight, bias, offset: float, casting: Casting, dtype: str) -> np.ndarray:
    """The safety predicate's definition, per column, on its own: w_eff = weight + offset in fp32
    (float64 for float64 x), rounded to x's dtype under INPUT_DTYPE; 1 without a weight."""
    N = (weight if weight is not None else bias).shape[-1]
    if weight is None:
        w = np.ones(N)
    else:
        f = np.float64 if dtype == "float64" else np.float32
        w = (weight.astype(f) + f(offset)).astype(np.float64)
        if casting == Casting.INPUT_DTYPE:
            w = rounded(w, dtype)
    unsafe = ~np.isfinite(w) | (np.abs(w) < W_MIN[dtype])
    if bias is not None:
        b = _f64(bias)
        unsafe |= ~np.isfinite(b) | (np.abs(b) > OUTPUT_BIAS_RATIO * np.abs(w))
    return unsafe


def test_thresholds_are_the_documented_powers_of_two():
    """W_MIN = TINY / (4 u), TINY the smallest |y| that survives: x's smallest subnormal, or the compute
    dtype's smallest normal where that is larger (fp32 subnormals flush to 0 under XLA on CPU)."""
    finfo = {name: (ml_dtypes.finfo if name == "bfloat16" else np.finfo)(d) for name, d in NP_DTYPES.items()}
    for name, fi in finfo.items():
        assert norm_math.UNIT_ROUNDOFF[name] == float(fi.eps) / 2
        assert norm_math.SMALLEST_SUBNORMAL[name] == float(fi.smallest_subnormal)
    assert W_MIN == {"float16": 2.0**-15, "bfloat16": 2.0**-120, "float32": 2.0**-104, "float64": 2.0**-971}
    for name in W_MIN:  # every threshold is a normal number of the compute dtype: no flush can hide it
        assert W_MIN[name] >= float((finfo["float64"] if name == "float64" else finfo["float32"]).smallest_normal)


# ---------------------------------------------------------------------------------------------
# The property.

@st.composite
def _examples(draw):
    """Hypothesis picks the op, dtypes, casting, offset and parameter set, and a seed; the magnitudes and
    the row length come from the seed's generator, in proportions chosen here (Hypothesis' own draws
    crowd at the ends of their ranges)."""
    op = draw(st.sampled_from(sorted(OPS)))
    spec = OPS[op]
    dtype = draw(st.sampled_from(X_DTYPES + ("float64",)))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    lo, R = math.log2(W_MIN[dtype]), OUTPUT_BIAS_RATIO
    gamma_exp = [0.0, rng.uniform(lo + 2, 0.0), lo + rng.uniform(0.0, 2.0), lo - rng.uniform(0.6, 3.0)][
        rng.choice(4, p=[0.2, 0.3, 0.3, 0.2])]  # 1, between, near W_MIN, below W_MIN
    bias_ratio = [0.0, rng.uniform(0.0, R), R, R * rng.uniform(1.05, 2.0)][
        rng.choice(4, p=[0.2, 0.4, 0.2, 0.2])]  # none, within, at, above the ratio
    N = [1, int(rng.integers(2, 17)), int(rng.integers(17, 97))][rng.choice(3, p=[0.1, 0.3, 0.6])]
    bad_column = [None, math.inf, -math.inf, math.nan][rng.choice(4, p=[0.85, 0.05, 0.05, 0.05])]
    return dict(
        op=op, dtype=dtype,
        casting=draw(st.sampled_from(list(Casting))) if spec.has_offset else Casting.FP32,
        offset=draw(st.sampled_from([0.0, 1.0])) if spec.has_offset else 0.0,
        has_w=draw(st.booleans()), has_b="bias" in spec.params and draw(st.booleans()),
        param_dtype=draw(st.sampled_from([dtype, "float32", "float64"])),
        M=draw(st.integers(1, 6)), N=N, gamma_exp=gamma_exp, bias_ratio=bias_ratio,
        bad_column=bad_column,
        dres=spec.has_residual and draw(st.booleans()),
        seed=int(rng.integers(2**31)))


def _check(ex: dict) -> None:
    op = OPS[ex["op"]]
    dtype, pdt, N = ex["dtype"], ex["param_dtype"], ex["N"]
    rng = np.random.default_rng(ex["seed"])
    shape = (ex["M"], N)
    scale = 2.0 ** ex["gamma_exp"] if ex["has_w"] else 1.0  # |w_eff| (1 without a weight)
    x = _array(rng.standard_normal(shape) * 1.5 + 0.3, dtype)
    residual = _array(rng.standard_normal(shape), dtype) if op.has_residual else None
    w_eff = rng.uniform(1.0, 1.5, N) * rng.choice([-1.0, 1.0], N) * scale  # before rounding
    w = b = None
    if ex["has_w"]:
        w64 = w_eff - ex["offset"]
        if ex["bad_column"] is not None:
            w64[rng.integers(N)] = ex["bad_column"]
        w = _array(w64, pdt)
    if ex["has_b"]:
        b = _array(rng.uniform(0.5, 1.0, N) * rng.choice([-1.0, 1.0], N) * ex["bias_ratio"] * np.abs(w_eff), pdt)
    # dy ~ 1 / |w_eff| keeps dx away from underflow at tiny w_eff (and within x's dtype's range)
    dy_scale = min(1.0 / scale, float(np.finfo(np.float16).max) / 16 if dtype == "float16" else 2.0**100)
    dy = _array(rng.standard_normal(shape) * dy_scale, dtype)
    dres = _array(rng.standard_normal(shape), dtype) if ex["dres"] else None
    kw = dict(is_rms=op.is_rms, offset=ex["offset"], casting=ex["casting"])

    y, s, _, rstd = norm_math.forward(x, residual, w, b, eps=op.default_eps, **kw)
    dx = norm_math.output_backward(y, w, b, dy, dres, rstd, **kw)
    safe = norm_math.output_backward_safe(w, b, x_dtype=dtype, offset=ex["offset"], casting=ex["casting"])

    unsafe = _expected_unsafe(w, b, ex["offset"], ex["casting"], dtype) if (w is not None or b is not None) else None
    assert safe == (unsafe is None or not unsafe.any()), f"predicate says safe={safe}; columns {unsafe}"
    assert dx.shape == shape and dx.dtype == (np.float64 if dtype == "float64" else np.float32)
    if not safe:
        assert np.isnan(dx).all(), "an unsafe column must make dx NaN everywhere"
        return
    # The float64 input-saving reference, on the input the forward normalized (the fused add's stored sum).
    xs = _f64(s if s is not None else x)
    ref = reference.layer_norm_bwd(xs, _f64(w), None, _f64(dy), op.default_eps)[0] if not op.is_rms else \
        reference.rms_norm_bwd(xs, _f64(w), _f64(dy), op.default_eps, ex["offset"])[0]
    if dres is not None:
        ref = ref + _f64(dres)
    bound = _model_error(op, xs, w, b, dy, ex["offset"], dtype)
    got = rounded(dx, dtype)
    tol = TOLERANCES[dtype]
    # dx is linear in g = dy * w_eff, which the table's atol takes to be of order 1; here it is of order sigma
    sigma = dy_scale * scale
    ok = np.abs(got - ref) <= tol["atol"] * sigma + tol["rtol"] * np.abs(ref) + 2 * bound
    assert ok.all(), (f"dx from the saved output ({ex}): {int((~ok).sum())}/{ok.size} off; first at "
                      f"{np.argwhere(~ok)[0].tolist()}: {got[~ok][0]} vs {ref[~ok][0]} (model {bound[~ok][0]:.3g})")


def _model_error(op, xs, w, b, dy, offset, dtype) -> np.ndarray:
    """The output-saving backward's extra error per element (the module docstring's analysis, in
    float64 from the reference's own quantities). x_hat comes back off by
    e = 3u|x_hat| + u|b/w| + TINY/|w| (the forward's roundings of x_hat under "llama" and "none", and
    y's storage), plus a few roundings of the compute dtype; g = dy * w_eff is off by r|g|, with
    r = u (w_eff rounded to x's dtype under "none") + uc (|weight| + |offset|) / |w_eff| (weight + offset
    in the compute dtype, as the kernels take it: it cancels where w_eff is small against the offset,
    for the input-saving backward alike). Through dx = (g - c2 - x_hat c1) rstd that is
    rstd (r|g| + e|c1| + |x_hat| mean(|g|(e + r|x_hat|))) (+ mean(r|g|) for LayerNorm): as small as dx's
    own rounding unless dy is nearly parallel to x_hat in a row (always for N = 1), where dx cancels."""
    u, tiny = norm_math.UNIT_ROUNDOFF[dtype], norm_math.TINY[dtype]
    uc = norm_math.UNIT_ROUNDOFF["float64" if dtype == "float64" else "float32"]
    N = xs.shape[-1]
    xc = xs if op.is_rms else xs - xs.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt((xc * xc).mean(-1, keepdims=True) + op.default_eps)
    weight = np.ones(N) if w is None else _f64(w)
    w_eff = weight + (offset if w is not None else 0.0)
    c1 = np.abs((_f64(dy) * w_eff * xc * rstd).mean(-1, keepdims=True))
    x_hat, w_eff = np.abs(xc * rstd), np.abs(w_eff)
    r = u + uc * (np.abs(weight) + abs(offset)) / w_eff
    ratio = np.zeros(N) if b is None else np.abs(_f64(b)) / w_eff
    e = 3 * u * x_hat + u * ratio + tiny / w_eff + 8 * uc * (x_hat + ratio)
    g = np.abs(_f64(dy)) * w_eff
    err = r * g + e * c1 + x_hat * (g * (e + r * x_hat)).mean(-1, keepdims=True)
    if not op.is_rms:
        err = err + (r * g).mean(-1, keepdims=True)
    return rstd * err


def _run_property(n: int) -> None:
    @seed(zlib.crc32(b"norm_math.output_backward"))
    @settings(max_examples=n, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(ex=_examples())
    def prop(ex):
        _check(ex)

    prop()


@pytest.mark.parametrize("n", [pytest.param(200, id="quick"), pytest.param(3000, id="full", marks=pytest.mark.slow)])
def test_output_backward_property(n):
    """Safe examples: dx from the saved output against the float64 input-saving reference, within the
    tolerance of x's dtype plus (twice) the error model of x_hat's recovery (``_model_error``); unsafe
    ones: NaN everywhere; the predicate as defined, either way."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf weights are among the examples
        _run_property(n)


# ---------------------------------------------------------------------------------------------
# Both backwards are the gradient of the forward (float64 autograd through torch).

@pytest.mark.skipif(not HAS_TORCH, reason="needs torch (a JAX-only install)")
@pytest.mark.parametrize("params", ["none", "weight", "all"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_backwards_are_the_gradient_of_the_forward(op, params):
    """float64: the input-saving backward's dx, dw, db and the output-saving backward's dx against
    torch.autograd through the forward, with an offset where the op takes one."""
    import torch

    spec = OPS[op]
    names = {"none": (), "weight": ("weight",), "all": spec.params}[params]
    offset = 0.5 if spec.has_offset else 0.0
    g = torch.Generator().manual_seed(zlib.crc32(f"{op} {params}".encode()))
    M, N = 5, 24
    t = {"x": torch.randn(M, N, generator=g, dtype=torch.float64) * 1.5 + 0.3}
    if spec.has_residual:
        t["residual"] = torch.randn(M, N, generator=g, dtype=torch.float64)
    if "weight" in names:
        t["weight"] = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    if "bias" in names:  # |b| <= OUTPUT_BIAS_RATIO |w_eff|: the output-saving backward applies
        t["bias"] = torch.rand(N, generator=g, dtype=torch.float64) - 0.5
    leaves = {k: v.clone().requires_grad_(True) for k, v in t.items()}
    dy, ds = (torch.randn(M, N, generator=g, dtype=torch.float64) for _ in range(2))
    kw = dict(is_rms=spec.is_rms, offset=offset)
    y, s, mean, rstd = norm_math.forward(leaves["x"], leaves.get("residual"), leaves.get("weight"),
                                         leaves.get("bias"), eps=spec.default_eps, **kw)
    loss = (y * dy).sum() + ((s * ds).sum() if s is not None else 0)
    want = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    with torch.no_grad():
        xs = s if s is not None else t["x"]
        dres = ds if s is not None else None
        dx, dw, db = norm_math.input_backward(xs, t.get("weight"), dy, dres, is_rms=spec.is_rms, eps=spec.default_eps,
                                              offset=offset, compute_dw="weight" in t, compute_db="bias" in t)
        dx_out = norm_math.output_backward(y, t.get("weight"), t.get("bias"), dy, dres, rstd, **kw)
    for name, got in (("x", dx), ("x", dx_out), ("residual", dx if s is not None else None), ("weight", dw),
                      ("bias", db)):
        if name in want and got is not None:
            assert_close(got.numpy(), want[name].numpy(), "float64", f"{op} d{name}", reduced_over=M)
    assert (dw is None) == ("weight" not in t) and (db is None) == ("bias" not in t)


# ---------------------------------------------------------------------------------------------
# The accuracy that sets the thresholds.

def _relative_error(a, ref) -> float:
    return float(np.linalg.norm(_f64(a) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_output_backward_is_as_accurate_as_input_backward_at_the_thresholds(op, dtype):
    """At |w_eff| in [W_MIN, 1.5 W_MIN] and, for LayerNorm, |b| up to OUTPUT_BIAS_RATIO |w_eff|, dx
    stored in x's dtype is within 10% of the input-saving backward's error (each against float64;
    measured: at most 1.04 times; a bias ratio of 8 gives ~1.15 times, and in fp16, whose W_MIN sits at
    its subnormals, a quarter of W_MIN ~1.3 times)."""
    spec = OPS[op]
    M, N = 64, 256
    rng = np.random.default_rng(zlib.crc32(f"{op} {dtype}".encode()))
    x = _array(rng.standard_normal((M, N)) * 1.5 + 0.3, dtype)
    res = _array(rng.standard_normal((M, N)), dtype) if spec.has_residual else None
    w = _array(rng.uniform(1.0, 1.5, N) * rng.choice([-1.0, 1.0], N) * W_MIN[dtype], dtype)
    b = None
    if "bias" in spec.params:  # |b| = OUTPUT_BIAS_RATIO |w| where that is exact in x's dtype (a power of 2)
        b = _array(OUTPUT_BIAS_RATIO * _f64(w) * rng.choice([-1.0, 1.0], N), dtype)
    # dy ~ 1 / |w_eff| (fp16: as far as its range allows) keeps dx clear of underflow
    dy = _array(rng.standard_normal((M, N)) * (2.0**10 if dtype == "float16" else 1 / W_MIN[dtype]), dtype)
    y, s, mean, rstd = norm_math.forward(x, res, w, b, is_rms=spec.is_rms, eps=spec.default_eps)
    assert norm_math.output_backward_safe(w, b, x_dtype=dtype)
    xs = s if s is not None else x
    dx_in, _, _ = norm_math.input_backward(xs, w, dy, None, mean, rstd, is_rms=spec.is_rms)
    dx_out = norm_math.output_backward(y, w, b, dy, None, rstd, is_rms=spec.is_rms)
    inputs = {"x": _f64(xs), "weight": _f64(w), "bias": _f64(b)}
    if spec.has_residual:
        inputs = {"x": _f64(xs), "residual": np.zeros((M, N)), "weight": _f64(w)}
    _, ref = spec.run_reference(inputs, spec.options(eps=spec.default_eps), {"y": _f64(dy)})
    err_in = _relative_error(rounded(dx_in, dtype), ref["x"])
    err_out = _relative_error(rounded(dx_out, dtype), ref["x"])
    assert 0 < err_in < 4 * norm_math.UNIT_ROUNDOFF[dtype], err_in  # dx's rounding to x's dtype, about u / 2
    assert err_out <= 1.1 * err_in, f"output-saving error {err_out:.3g} vs input-saving {err_in:.3g}"


# ---------------------------------------------------------------------------------------------
# The guard at its boundaries, on each library and traced.

def _boundary_cases(dtype: str):
    """(name, weight, bias, safe) over 8 columns of |w_eff| = 1 but one."""
    d = NP_DTYPES[dtype]
    w_min = d(W_MIN[dtype])
    below = np.nextafter(w_min, d(0))
    ones = np.ones(8)
    cases = []
    for name, v, safe in (("at W_MIN", w_min, True), ("one below W_MIN", below, False), ("zero", 0.0, False),
                          ("-inf", -math.inf, False), ("nan", math.nan, False)):
        w = ones.copy()
        w[3] = v
        cases.append((f"weight {name}", w.astype(d), None, safe))
    for name, v, safe in (("= ratio * |w|", OUTPUT_BIAS_RATIO, True),
                          ("just above", np.nextafter(d(OUTPUT_BIAS_RATIO), d(math.inf)), False),
                          ("inf", math.inf, False), ("nan", math.nan, False)):
        b = np.zeros(8)
        b[5] = v
        cases.append((f"bias {name}", ones.astype(d), b.astype(d), safe))
    cases.append(("bias = ratio, no weight", None, (ones * -OUTPUT_BIAS_RATIO).astype(d), True))
    cases.append(("no parameters", None, None, True))
    return cases


NAMESPACES = ["numpy"] + (["torch", "torch.compile"] if HAS_TORCH else []) + (["jax.jit"] if HAS_JAX else [])


def _to(lib: str, a):
    if a is None:
        return None
    if lib.startswith("torch"):
        import torch

        name = norm_math.dtype_name(a.dtype)
        return torch.from_numpy(a.astype(np.float32) if name == "bfloat16" else a).to(getattr(torch, name))
    if lib.startswith("jax"):
        import jax.numpy as jnp

        return jnp.asarray(a)
    return a


def _output_backward(lib: str):
    fn = norm_math.output_backward
    if lib == "torch.compile":  # traced, no look at the values; xp named (dynamo warns on array_namespace's cache)
        import array_api_compat.torch
        import torch

        torch._dynamo.reset()  # a fresh cache per test: its cases are a handful of graphs each
        return torch.compile(functools.partial(fn, xp=array_api_compat.torch), fullgraph=True, backend="aot_eager")
    if lib == "jax.jit":
        import jax

        return jax.jit(fn, static_argnames=("is_rms", "offset", "casting", "xp"))
    return fn


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compile stack warns about its own internals
@pytest.mark.parametrize("lib", NAMESPACES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_guard_and_predicate_at_the_boundaries(lib, dtype):
    """Each boundary: the host predicate (NumPy, or torch tensors) says it, and the backward, traced
    or not, returns dx NaN everywhere for an unsafe column and a finite dx otherwise."""
    rng = np.random.default_rng(7)
    M, N = 3, 8
    fn = _output_backward(lib)
    # JAX under strict dtype promotion, as its frontend's tests run; NumPy warns on the unsafe columns' 0/0
    strict = {"jax.jit": lambda: __import__("jax").numpy_dtype_promotion("strict"),
              "numpy": lambda: np.errstate(invalid="ignore", divide="ignore")}.get(lib, contextlib.nullcontext)
    for name, w, b, safe in _boundary_cases(dtype):
        is_rms = b is None
        x = _array(rng.standard_normal((M, N)) * 1.5 + 0.3, dtype)
        y, _, _, rstd = norm_math.forward(x, None, w, b, is_rms=is_rms, eps=1e-6)
        dy = _array(rng.standard_normal((M, N)), dtype)
        host = "numpy" if lib == "numpy" or lib == "jax.jit" else "torch"
        assert norm_math.output_backward_safe(_to(host, w), _to(host, b), x_dtype=dtype) is safe, name
        args = [_to(lib, a) for a in (y, w, b, dy)] + [None, _to(lib, rstd)]
        with strict():
            dx = fn(*args, is_rms=is_rms)
        dx = np.asarray(dx.float() if lib.startswith("torch") else dx, dtype=np.float64)
        assert dx.shape == (M, N), name
        if safe:
            assert np.isfinite(dx).all(), f"{lib} {dtype} {name}: dx not finite where the columns are safe"
        else:
            assert np.isnan(dx).all(), f"{lib} {dtype} {name}: dx must be NaN everywhere"


def test_predicate_rounds_w_eff_as_the_forward_does():
    """Under INPUT_DTYPE (casting "none") the forward multiplies by w_eff rounded to x's dtype: an fp32
    weight just below fp16's W_MIN, which fp16 rounds up to W_MIN, is safe there and unsafe elsewhere."""
    w = np.ones(4, np.float32)
    w[1] = 2.0**-15 - 2.0**-30  # fp16 holds multiples of 2**-24 here: it rounds to 2**-15 = W_MIN
    assert float(np.float16(w[1])) == W_MIN["float16"] > float(w[1])
    for casting in Casting:
        safe = norm_math.output_backward_safe(w, None, x_dtype="float16", casting=casting)
        assert safe is (casting == Casting.INPUT_DTYPE), casting
