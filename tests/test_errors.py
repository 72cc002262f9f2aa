"""Bad input raises a clear exception before any launch, naming the argument and the shapes or
dtypes involved; the same checks through each frontend."""
import numpy as np
import pytest

import normkit
from normkit.ops import OPS
from normkit.testing import assert_close

RNG = np.random.default_rng(1234)
X = RNG.standard_normal((4, 8)).astype(np.float32)
W = RNG.standard_normal(8).astype(np.float32)


def call(frontend, op, x, *, residual=None, weight=None, bias=None, **kw):
    """``op`` from the frontend's module; every public function takes ``op.inputs`` positionally."""
    given = {"x": x, "residual": residual if residual is not None else x, "weight": weight, "bias": bias}
    return getattr(frontend.module, op)(*(given[name] for name in OPS[op].inputs), **kw)


def raises(frontend, exc, match, op, x, **kw):
    with normkit.record_launches() as log, pytest.raises(exc, match=match):
        call(frontend, op, x, **kw)
    assert log.kernels() == [], "an error must come before any launch"


@pytest.mark.parametrize("op", list(OPS))
def test_weight_shape(frontend, op):
    x = frontend.raw(X)
    raises(frontend, ValueError, r"weight has shape \(9,\); expected \(8,\)", op, x, weight=frontend.raw(
        RNG.standard_normal(9).astype(np.float32)))
    raises(frontend, ValueError, r"weight has shape \(1, 8\)", op, x, weight=frontend.raw(W[None]))


def test_bias_shape(frontend):
    raises(frontend, ValueError, r"bias has shape \(7,\); expected \(8,\)", "layer_norm", frontend.raw(X),
           weight=frontend.raw(W), bias=frontend.raw(W[:7]))
    raises(frontend, ValueError, r"bias has shape \(8, 1\); expected \(8,\)", "layer_norm", frontend.raw(X),
           bias=frontend.raw(W[:, None]))  # without a weight


def test_residual_shape_and_dtype(frontend):
    raises(frontend, ValueError, r"residual has shape \(4, 4\); expected x's shape \(4, 8\)", "fused_add_rms_norm",
           frontend.raw(X), residual=frontend.raw(X[:, :4].copy()))
    raises(frontend, TypeError, r"residual has dtype float16; expected x's dtype float32", "fused_add_rms_norm",
           frontend.raw(X), residual=frontend.raw(X.astype(np.float16)))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
def test_unsupported_dtypes(frontend, op, dtype):
    bad = (X * 3).astype(dtype)
    raises(frontend, TypeError, r"x has dtype (int32|bool|complex64)", op, frontend.raw(bad))
    raises(frontend, TypeError, r"weight has dtype (int32|bool|complex64)", op, frontend.raw(X),
           weight=frontend.raw((W * 3).astype(dtype)))


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm"])
def test_unknown_casting_mode(frontend, op):
    raises(frontend, ValueError, r"unknown casting_mode 'fp8'", op, frontend.raw(X), casting_mode="fp8")


@pytest.mark.parametrize("op", list(OPS))
def test_negative_eps(frontend, op):
    raises(frontend, ValueError, r"eps must be a finite number >= 0; got -1e-06", op, frontend.raw(X), eps=-1e-6)


@pytest.mark.parametrize("op", list(OPS))
def test_row_length_beyond_the_limit(frontend, op):
    x = frontend.raw(np.ones((2, 65537), np.float32) + RNG.standard_normal((2, 65537)).astype(np.float32))
    raises(frontend, ValueError, r"D=65537 exceeds the supported limit of 65536", op, x)


@pytest.mark.parametrize("op", list(OPS))
def test_non_finite_eps_and_offset(frontend, op):
    raises(frontend, ValueError, r"eps must be a finite number >= 0; got nan", op, frontend.raw(X), eps=float("nan"))
    if op != "layer_norm":
        raises(frontend, ValueError, r"offset must be a finite number; got inf", op, frontend.raw(X),
               offset=float("inf"))


@pytest.mark.parametrize("op", list(OPS))
def test_not_an_array(frontend, op):
    raises(frontend, TypeError, r"x must be a (torch\.Tensor|jax\.Array); got list", op, [[1.0, 2.0]])
    raises(frontend, TypeError, r"weight must be a (torch\.Tensor|jax\.Array); got list", op, frontend.raw(X),
           weight=W.tolist())


@pytest.mark.parametrize("op", list(OPS))
def test_zero_dimensional_x(frontend, op):
    raises(frontend, ValueError, r"x must have at least one dimension", op, frontend.raw(np.float32(1.5)))


@pytest.mark.parametrize("op", list(OPS))
def test_numpy_scalar_options_are_numbers(frontend, op):
    """eps=np.float32(1e-6) is the number it holds: the same result as the Python float."""
    x = frontend.raw(X)
    kw = {"offset": np.float64(0.5)} if OPS[op].has_offset else {}
    got = frontend.numpy(call(frontend, op, x, eps=np.float32(1e-6), **kw)[0] if OPS[op].has_residual
                         else call(frontend, op, x, eps=np.float32(1e-6), **kw))
    kw = {"offset": 0.5} if OPS[op].has_offset else {}
    want = frontend.numpy(call(frontend, op, x, eps=float(np.float32(1e-6)), **kw)[0] if OPS[op].has_residual
                          else call(frontend, op, x, eps=float(np.float32(1e-6)), **kw))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", list(OPS))
def test_array_options_are_refused_clearly(frontend, op):
    raises(frontend, TypeError, r"eps must be a static Python float; it is a \w+; pass a Python float", op,
           frontend.raw(X), eps=frontend.raw(np.float32(1e-6)))
    raises(frontend, TypeError, r"eps must be a static Python float", op, frontend.raw(X), eps="1e-6")
    if OPS[op].has_offset:
        raises(frontend, TypeError, r"offset must be a static Python float", op, frontend.raw(X),
               offset=frontend.raw(np.float32(1.0)))


@pytest.mark.parametrize("op", list(OPS))
def test_eps_and_offset_beyond_float32_are_refused(frontend, op):
    """The kernels compute in fp32: an eps or offset that fp32 cannot hold would become inf or 0 there."""
    x = frontend.raw(X)
    raises(frontend, ValueError, r"eps=1e\+39 does not fit in float32", op, x, eps=1e39)
    raises(frontend, ValueError, r"eps=1e-50 rounds to 0 in float32", op, x, eps=1e-50)
    if OPS[op].has_offset:
        raises(frontend, ValueError, r"offset=-1e\+39 does not fit in float32", op, x, offset=-1e39)


@pytest.mark.parametrize("op", list(OPS))
def test_option_types_are_named(frontend, op):
    x = frontend.raw(X)
    for bad in ([1e-6], None, "1e-6"):
        raises(frontend, TypeError, r"normkit: eps must be a static Python float", op, x, eps=bad)
    if OPS[op].has_offset:
        raises(frontend, TypeError, r"normkit: offset must be a static Python float; got list", op, x, offset=[1.0])
        for bad in (["llama"], 1, None):
            raises(frontend, TypeError, r"normkit: casting_mode must be a str, one of \['gemma', 'llama', 'none'\]",
                   op, x, casting_mode=bad)


@pytest.mark.parametrize("op", list(OPS))
def test_eps_zero_on_a_zero_row_is_nan_as_in_the_reference(frontend, op):
    """eps=0 is allowed: a row with zero variance is then 0/0, NaN, exactly where the float64
    reference (and torch's own norms) put it; the other rows are unaffected."""
    x = X.copy()
    x[1] = 0.0 if OPS[op].is_rms else 2.5  # zero mean square / zero variance
    residual = np.zeros_like(x) if OPS[op].has_residual else None
    out = call(frontend, op, frontend.raw(x), residual=None if residual is None else frontend.raw(residual),
               weight=frontend.raw(W), eps=0.0)
    y = frontend.numpy(out[0] if OPS[op].has_residual else out)
    inputs = {"x": x, "residual": residual, "weight": W}
    with np.errstate(divide="ignore", invalid="ignore"):
        want, _ = OPS[op].run_reference(inputs, OPS[op].options(eps=0.0), {"y": np.ones_like(x)})
    assert np.isnan(want["y"][1]).all() and not np.isnan(np.delete(want["y"], 1, axis=0)).any()
    assert_close(y, want["y"], "float32", f"{op}, eps=0")


def test_implementation_option_type():
    jf = pytest.importorskip("jax_frontend")  # the JAX frontend's own option
    with pytest.raises(TypeError, match=r"normkit: implementation must be None or a str"):
        jf.rms_norm(np.asarray(X), implementation=["triton"])
    with pytest.raises(ValueError, match=r"unknown implementation 'cuda'"):
        jf.rms_norm(np.asarray(X), implementation="cuda")
