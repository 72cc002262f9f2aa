"""Torch-frontend specifics: modules and state dicts, frozen semantics, determinism, cross-checks
against torch.nn.functional and transformers' Llama and Gemma RMSNorms, NaN/Inf, empty inputs,
copies and torch.compile."""
import copy

import numpy as np
import pytest
import torch

import normkit
import torch_frontend as tf
from normkit import reference as ref
from normkit.ops import OPS
from tests.frontend_torch import DEVICE
from normkit.testing import assert_close

BF16 = torch.bfloat16


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + 0.1).to(DEVICE, dtype)


def np64(t):
    return t.detach().double().cpu().numpy()


def apply(op, inputs):
    """``op``'s public function on named inputs (every one takes ``op.inputs`` positionally, in that
    order); its outputs as a tuple (y, and residual_out for the fused add)."""
    out = getattr(tf, op)(*(inputs.get(name) for name in OPS[op].inputs))
    return out if OPS[op].has_residual else (out,)


# --- modules -------------------------------------------------------------------------------------


def test_rmsnorm_module_state_dict_interchanges_with_torch_nn():
    ours = tf.RMSNorm(48, eps=1e-6, device=DEVICE)
    theirs = torch.nn.RMSNorm(48, eps=1e-6, device=DEVICE)
    with torch.no_grad():
        theirs.weight.copy_(randn(48, seed=1))
    ours.load_state_dict(theirs.state_dict())
    assert set(ours.state_dict()) == set(theirs.state_dict()) == {"weight"}
    x = randn(3, 5, 48, seed=2)
    assert_close(np64(ours(x)), np64(theirs(x)), "float32", "RMSNorm vs torch.nn.RMSNorm")
    theirs.load_state_dict(ours.state_dict())  # and back


def test_layernorm_module_state_dict_interchanges_with_torch_nn():
    for bias in (True, False):
        ours = tf.LayerNorm(40, bias=bias, device=DEVICE)
        theirs = torch.nn.LayerNorm(40, bias=bias, device=DEVICE)
        with torch.no_grad():
            theirs.weight.copy_(randn(40, seed=3))
            if bias:
                theirs.bias.copy_(randn(40, seed=4))
        ours.load_state_dict(theirs.state_dict())
        assert set(ours.state_dict()) == set(theirs.state_dict())
        x = randn(6, 40, seed=5, scale=3.0)
        assert_close(np64(ours(x)), np64(theirs(x)), "float32", f"LayerNorm(bias={bias}) vs torch.nn.LayerNorm")


def test_module_defaults_and_options():
    m = tf.RMSNorm(16, offset=1.0, casting_mode="gemma", dtype=BF16, device=DEVICE)
    assert m.weight.dtype == BF16 and torch.all(m.weight == 0)  # weight + offset starts at 1
    assert tf.RMSNorm(16, elementwise_affine=False).weight is None
    ln = tf.LayerNorm((16,), elementwise_affine=False)
    assert ln.weight is None and ln.bias is None
    with pytest.raises(ValueError, match="normalized_shape"):
        tf.RMSNorm((4, 16))
    f = tf.FusedAddRMSNorm(16, device=DEVICE)
    x, r = randn(2, 16, seed=6), randn(2, 16, seed=7)
    y, s = f(x, r)
    assert_close(np64(s), np64(x) + np64(r), "float32", "residual_out")
    assert_close(np64(y), ref.rms_norm(np64(x) + np64(r), np64(f.weight), 1e-6), "float32", "y")


# --- frozen semantics ----------------------------------------------------------------------------


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_frozen_weight_gives_bitwise_equal_dx_and_no_partials(op, dtype):
    """A frozen weight (and bias) costs no dW/dB work and no partials; keeping the input (save="input"),
    dx is bitwise that of the trained call. Keeping the output (the default), see
    test_frozen_norm_keeps_its_output."""
    x0 = randn(37, 200, dtype=dtype, seed=8)
    r0 = randn(37, 200, dtype=dtype, seed=9)
    w0 = randn(200, dtype=dtype, seed=10)
    dy = randn(37, 200, dtype=dtype, seed=11)
    grads, logs = {}, {}
    for frozen in (False, True):
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(not frozen)
        b = randn(200, dtype=dtype, seed=12).requires_grad_(not frozen) if "bias" in OPS[op].params else None
        with normkit.record_launches() as log:
            y = getattr(tf, op)(*({"x": x, "residual": r0, "weight": w, "bias": b}[n] for n in OPS[op].inputs),
                                save="input")
            y = y[0] if OPS[op].has_residual else y
            y.backward(dy)
        grads[frozen], logs[frozen] = x.grad, log
        if frozen:
            assert w.grad is None and (b is None or b.grad is None)
        else:
            assert w.grad is not None
    assert torch.equal(grads[True], grads[False]), "x.grad must not depend on whether the weight is trained"
    (bwd,) = logs[True].of("norm_bwd_kernel")
    assert bwd.flags["COMPUTE_DW"] is False and bwd.flags["COMPUTE_DB"] is False
    assert bwd.partial_buffers == () and bwd.partial_bytes == 0
    assert not logs[True].of("partial_sum_kernel")
    assert logs[False].of("norm_bwd_kernel")[0].partial_bytes > 0


def test_frozen_x_computes_only_dw():
    x = randn(20, 64, seed=13)
    w = randn(64, seed=14).requires_grad_(True)
    dy = randn(20, 64, seed=15)
    with normkit.record_launches() as log:
        tf.rms_norm(x, w).backward(dy)
    assert x.grad is None
    (bwd,) = log.of("norm_bwd_kernel")
    assert bwd.flags["COMPUTE_DX"] is False and bwd.flags["COMPUTE_DW"] is True
    _, dw = ref.rms_norm_bwd(np64(x), np64(w), np64(dy))
    assert_close(np64(w.grad), dw, "float32", "dw", reduced_over=20)


def test_no_stats_without_backward():
    x, w = randn(8, 32, seed=16), randn(32, seed=17)
    with normkit.record_launches() as log:
        tf.rms_norm(x, w)  # nothing requires grad
        with torch.no_grad():
            tf.layer_norm(x.requires_grad_(True), w)
    assert [launch.flags["STORE_STATS"] for launch in log] == [False, False]


def test_fused_add_gradients_when_only_residual_out_is_used():
    x = randn(9, 24, seed=18).requires_grad_(True)
    r = randn(9, 24, seed=19).requires_grad_(True)
    w = randn(24, seed=20).requires_grad_(True)
    ds = randn(9, 24, seed=21)
    _, s = tf.fused_add_rms_norm(x, r, w)
    s.backward(ds)
    assert torch.equal(x.grad, ds) and torch.equal(r.grad, ds)
    assert w.grad is not None and torch.count_nonzero(w.grad) == 0  # y unused: dW is exactly zero


# --- determinism ---------------------------------------------------------------------------------


@pytest.mark.parametrize("op", list(OPS))
def test_weight_gradients_are_bitwise_reproducible(op):
    x = randn(517, 96, dtype=BF16, seed=22)
    r = randn(517, 96, dtype=BF16, seed=26)
    dy = randn(517, 96, dtype=BF16, seed=23)
    results = []
    for _ in range(2):
        params = {name: randn(96, dtype=BF16, seed=seed).requires_grad_(True)
                  for name, seed in (("weight", 24), ("bias", 25)) if name in OPS[op].params}
        apply(op, {"x": x, "residual": r, **params})[0].backward(dy)
        results.append({name: p.grad.clone() for name, p in params.items()})
    assert results[0].keys() == set(OPS[op].params)
    for name in OPS[op].params:
        assert torch.equal(results[0][name], results[1][name]), name


# --- cross-checks --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16])
def test_matches_hf_llama_and_gemma_rmsnorm(dtype):
    x = randn(11, 130, dtype=dtype, seed=26, scale=2.0)
    w = randn(130, dtype=dtype, seed=27)
    name = {torch.float32: "float32", BF16: "bfloat16", torch.float16: "float16"}[dtype]
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # y = x_hat * (1 + w), all in fp32
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for cls, kw in ((LlamaRMSNorm, {}), (GemmaRMSNorm, dict(offset=1.0, casting_mode="gemma"))):
        hf = cls(130, eps=1e-6).to(DEVICE, dtype)
        with torch.no_grad():
            hf.weight.copy_(w)  # the same weight: Gemma's module adds the 1 itself
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya = tf.rms_norm(xa, w, 1e-6, **kw)
        yb = hf(xb)
        assert ya.dtype == yb.dtype == dtype
        assert_close(np64(ya), np64(yb), name, f"{type(hf).__name__}")
        dy = randn(11, 130, dtype=dtype, seed=28)
        ya.backward(dy)
        yb.backward(dy)
        assert_close(np64(xa.grad), np64(xb.grad), name, f"{type(hf).__name__} dx")


def test_matches_torch_functional():
    x = randn(7, 3, 77, seed=29, scale=2.0)
    w, b = randn(77, seed=30), randn(77, seed=31)
    assert_close(np64(tf.rms_norm(x, w, 1e-6)), np64(torch.nn.functional.rms_norm(x, (77,), w, 1e-6)),
                 "float32", "vs F.rms_norm")
    assert_close(np64(tf.layer_norm(x, w, b, 1e-5)), np64(torch.nn.functional.layer_norm(x, (77,), w, b, 1e-5)),
                 "float32", "vs F.layer_norm")


# --- special values and shapes -------------------------------------------------------------------


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_nan_and_inf_reach_the_same_elements_as_the_reference(op):
    x = randn(5, 16, seed=32)
    x[1, 3] = float("nan")
    x[3, 7] = float("inf")
    w = randn(16, seed=33)
    y = getattr(tf, op)(x, w)
    with np.errstate(invalid="ignore"):  # the reference meets inf * 0 and NaN too
        want = OPS[op].reference(np64(x), np64(w), eps=OPS[op].default_eps)
    assert_close(np64(y), want, "float32", f"{op} with NaN/Inf")
    assert np.isnan(np64(y)[1]).all() and np.isfinite(np64(y)[[0, 2, 4]]).all()


@pytest.mark.parametrize("op", list(OPS))
def test_zero_rows(op):
    x = torch.empty(0, 3, 32, device=DEVICE).requires_grad_(True)
    w = randn(32, seed=34).requires_grad_(True)
    with normkit.record_launches() as log:
        outs = apply(op, {"x": x, "residual": torch.empty(0, 3, 32, device=DEVICE), "weight": w})
        sum(o.sum() for o in outs).backward()
    y = outs[0]
    assert y.shape == (0, 3, 32) and x.grad.shape == (0, 3, 32)
    assert w.grad is not None and torch.count_nonzero(w.grad) == 0 and w.grad.shape == (32,)
    assert log.kernels() == []  # nothing to launch
    # repeated calls of the bound signature: each dW is a tensor of its own, so changing one in place
    # (as an optimizer or the user may) leaves the next call's zeros
    for _ in range(2):
        outs = apply(op, {"x": x, "residual": torch.empty(0, 3, 32, device=DEVICE), "weight": w})
        (dw,) = torch.autograd.grad(sum(o.sum() for o in outs), [w])
        assert torch.count_nonzero(dw) == 0
        dw.add_(1.0)


def test_strided_rows_are_not_copied():
    big = randn(10, 300, seed=35)
    x = big[:, 17:17 + 128]  # row stride 300, last dim contiguous
    w = randn(128, seed=36)
    with normkit.record_launches() as log:
        y = tf.rms_norm(x, w)
    assert log[0].flags["ROWS_CONTIGUOUS"] is False
    assert_close(np64(y), ref.rms_norm(np64(x), np64(w)), "float32", "strided rows")


def test_non_contiguous_last_dim_is_copied_with_a_warning():
    x = randn(64, 12, seed=37).t()  # (12, 64) with last-dim stride 12
    w = randn(64, seed=38)
    with pytest.warns(tf.NormkitCopyWarning, match="neither contiguous nor broadcast"):
        y = tf.rms_norm(x, w)
    assert_close(np64(y), ref.rms_norm(np64(x), np64(w)), "float32", "transposed input")


def test_expanded_gradient_is_accepted():
    x = randn(6, 40, seed=39).requires_grad_(True)
    w = randn(40, seed=40)
    tf.rms_norm(x, w).sum().backward()  # dy is an expanded scalar: all strides 0
    dx, _ = ref.rms_norm_bwd(np64(x), np64(w), np.ones((6, 40)))
    assert_close(np64(x.grad), dx, "float32", "dx for an expanded dy")


def test_weight_of_another_dtype():
    x = randn(9, 64, dtype=BF16, seed=41).requires_grad_(True)
    w = randn(64, dtype=torch.float32, seed=42).requires_grad_(True)
    y = tf.rms_norm(x, w, casting_mode="gemma")
    dy = randn(9, 64, dtype=BF16, seed=43)
    y.backward(dy)
    assert y.dtype == BF16 and x.grad.dtype == BF16 and w.grad.dtype == torch.float32
    dx, dw = ref.rms_norm_bwd(np64(x), np64(w), np64(dy))
    assert_close(np64(y), ref.rms_norm(np64(x), np64(w)), "bfloat16", "y")
    assert_close(np64(w.grad), dw, "bfloat16", "dw", reduced_over=9)


# --- torch.compile -------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compile stack warns about its own internals
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")  # Inductor's advice on an fp32 matmul
def test_torch_compile_fullgraph_has_no_graph_breaks():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(32, 32, device=DEVICE), tf.RMSNorm(32, device=DEVICE))
    model[1].weight.requires_grad_(False)  # the LoRA situation: frozen norm weight
    compiled = torch.compile(model, fullgraph=True)
    x = randn(5, 32, seed=44).requires_grad_(True)
    with normkit.record_launches() as log:
        y = compiled(x)
        y.backward(torch.ones_like(y))
    eager_x = x.detach().clone().requires_grad_(True)
    y_eager = model(eager_x)
    y_eager.backward(torch.ones_like(y_eager))
    assert_close(np64(y), np64(y_eager), "float32", "compiled forward")
    assert_close(np64(x.grad), np64(eager_x.grad), "float32", "compiled dx")
    assert log.kernels() == [], log.kernels()  # a frozen norm under compile: Inductor generates it (_composite)
    explanation = torch._dynamo.explain(model)(randn(5, 32, seed=45))
    assert explanation.graph_break_count == 0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
@pytest.mark.parametrize("route", ["inductor", "kernels"])
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trained"])
def test_compile_route_by_frozen_parameters(frozen, route):
    """Under torch.compile a norm with frozen parameters runs as torch operations that Inductor
    generates (``compile_frozen_with("inductor")``, the default) or as normkit's kernels
    (``"kernels"``); one with a trained parameter always runs the kernels. Every op, every route,
    against float64: y and the gradients of the row inputs (and of the trained parameters)."""
    previous = tf.compile_frozen_with(route)
    try:
        for op, spec in OPS.items():
            torch._dynamo.reset()
            D = 48
            params = {n: randn(D, seed=30 + i).requires_grad_(not frozen) for i, n in enumerate(spec.params)}
            inputs = {n: randn(3, 4, D, seed=40 + i).requires_grad_(True) for i, n in enumerate(spec.row_inputs)}
            dy = randn(3, 4, D, seed=49)
            fn = {"rms_norm": lambda: tf.rms_norm(inputs["x"], params["weight"]),
                  "layer_norm": lambda: tf.layer_norm(inputs["x"], params["weight"], params["bias"]),
                  "fused_add_rms_norm": lambda: tf.fused_add_rms_norm(inputs["x"], inputs["residual"],
                                                                      params["weight"])[0]}[op]
            with normkit.record_launches() as log:
                y = torch.compile(fn, fullgraph=True)()
                wrt = list(inputs.values()) + ([] if frozen else list(params.values()))
                grads = torch.autograd.grad(y, wrt, dy)
            kernels = set(log.kernels())
            if frozen and route == "inductor":
                assert kernels == set(), (op, kernels)
            else:
                assert {"norm_fwd_kernel", "norm_bwd_kernel"} <= kernels, (op, kernels)
            ref_out, ref_grads = spec.run_reference({k: np64(v) for k, v in {**inputs, **params}.items()},
                                                    spec.options(eps=spec.default_eps), {"y": np64(dy)})
            assert_close(np64(y), ref_out["y"], "float32", f"{op}: y")
            for name, g in zip(list(inputs) + ([] if frozen else list(params)), grads):
                assert_close(np64(g), ref_grads[name], "float32", f"{op}: d{name}",
                             reduced_over=12 if name in spec.params else 1)
    finally:
        tf.compile_frozen_with(previous)
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("casting_mode", ["llama", "gemma", "none"])
def test_compiled_frozen_norm_follows_each_casting_mode(casting_mode):
    """The torch-operation route rounds where the kernels do, per casting mode and with an offset
    (bf16 input, fp32 weight): against the float64 reference and against the eager kernels."""
    torch._dynamo.reset()
    w = randn(64, dtype=torch.float32, seed=31)
    x, r = randn(6, 64, dtype=BF16, seed=32), randn(6, 64, dtype=BF16, seed=33)
    for op in ("rms_norm", "fused_add_rms_norm"):
        fn = (lambda x, r: tf.rms_norm(x, w, offset=1.0, casting_mode=casting_mode)) if op == "rms_norm" else \
             (lambda x, r: tf.fused_add_rms_norm(x, r, w, offset=1.0, casting_mode=casting_mode)[0])
        with normkit.record_launches() as log:
            got = torch.compile(fn, fullgraph=True)(x, r)
        assert log.kernels() == []
        want = fn(x, r)
        s = np64(x) + np64(r) if op == "fused_add_rms_norm" else np64(x)
        assert_close(np64(got), ref.rms_norm(s, np64(w) + 1.0), "bfloat16", f"{op} {casting_mode} vs float64")
        assert_close(np64(got), np64(want), "bfloat16", f"{op} {casting_mode} vs eager")
    torch._dynamo.reset()


def test_compile_frozen_with_refuses_an_unknown_route():
    with pytest.raises(ValueError, match=r"compile_frozen_with takes one of \('inductor', 'kernels'\); got 'xla'"):
        tf.compile_frozen_with("xla")
    assert tf.compile_frozen_with("inductor") == "inductor"


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_repeated_calls_reuse_bound_plans(op, frozen, monkeypatch):
    """The eager fast path: the first call of a signature validates and plans; later calls with the
    same shapes, strides, dtypes, devices and options launch the bound plans (no validation), on
    fresh data, and match the float64 reference every time; another signature plans again."""
    from torch_frontend import _bound, functional

    spec = OPS[op]
    _bound.clear()
    real_check = functional._check
    for call, shape in enumerate([(2, 3, 40)] * 3 + [(7, 40)]):
        inp = {name: randn(*shape, seed=100 + 10 * call + i) for i, name in enumerate(spec.row_inputs)}
        inp.update({name: randn(40, seed=200 + 10 * call + i) for i, name in enumerate(spec.params)})
        dy = randn(*shape, seed=300 + call)
        leaves = {k: v.requires_grad_(not (frozen and k in spec.params)) for k, v in inp.items()}
        if call in (1, 2):  # a repeated signature must not be validated again
            monkeypatch.setattr(functional, "_check", lambda *a, **k: pytest.fail("validated a bound signature"))
        else:
            monkeypatch.setattr(functional, "_check", real_check)
        y = {"rms_norm": lambda: tf.rms_norm(leaves["x"], leaves["weight"]),
             "layer_norm": lambda: tf.layer_norm(leaves["x"], leaves["weight"], leaves["bias"]),
             "fused_add_rms_norm": lambda: tf.fused_add_rms_norm(leaves["x"], leaves["residual"], leaves["weight"])[0],
             }[op]()
        wrt = [t for t in leaves.values() if t.requires_grad]
        got = torch.autograd.grad(y, wrt, dy)
        np_inp = {k: np64(v) for k, v in inp.items()}
        ref_out, ref_grads = spec.run_reference(np_inp, spec.options(eps=spec.default_eps), {"y": np64(dy)})
        assert_close(np64(y), ref_out["y"], "float32", f"{op} call {call}: y")
        for (name, t), g in zip([(k, v) for k, v in leaves.items() if v.requires_grad], got):
            assert_close(np64(g), ref_grads[name], "float32", f"{op} call {call}: d{name}", reduced_over=dy.numel() // 40)
    assert len(_bound.BOUND) == 2  # two signatures


FIELDS = ("op", "M", "N", "dtype", "layout", "weight", "eps", "save", "x_grad", "w_grad", "grad_mode")


def _call_spec(st):
    """One call's make-up: op, rows, x's dtype and layout, the weight's kind, eps, save, grad flags."""
    return st.fixed_dictionaries({
        "op": st.sampled_from(sorted(OPS)), "M": st.sampled_from([2, 3]), "N": st.sampled_from([8, 16]),
        "dtype": st.sampled_from([torch.float32, BF16]), "layout": st.sampled_from(["dense", "sliced", "3d"]),
        "weight": st.sampled_from(["fp32", "bf16", "strided", "none"]),
        "eps": st.sampled_from([1e-6, np.float64(1e-6), 1e-5]), "save": st.sampled_from(["auto", "input"]),
        "x_grad": st.booleans(), "w_grad": st.booleans(), "grad_mode": st.booleans()})


def _make_call(spec: dict, seed: int) -> dict:
    M, N, dtype = spec["M"], spec["N"], spec["dtype"]
    op = OPS[spec["op"]]

    def rows(s):
        if spec["layout"] == "sliced":
            return randn(M, N + 5, dtype=dtype, seed=s)[:, :N]
        return randn(M, N, dtype=dtype, seed=s).reshape((1, M, N) if spec["layout"] == "3d" else (M, N))
    inputs = {name: rows(seed + i).requires_grad_(spec["x_grad"]) for i, name in enumerate(op.row_inputs)}
    for i, name in enumerate(op.params):
        kind = spec["weight"]
        if kind == "none":
            continue
        w = randn(2 * N, seed=seed + 10 + i)[::2] if kind == "strided" else randn(N, seed=seed + 10 + i,
                                                                                 dtype=BF16 if kind == "bf16" else
                                                                                 torch.float32)
        inputs[name] = w.requires_grad_(spec["w_grad"])
    return inputs


@pytest.mark.parametrize("seed", range(3))
def test_each_call_takes_its_keys_signature(seed, monkeypatch):
    """Random sequences of calls (ops, shapes, dtypes, row layouts, weights, eps of another class,
    save, grad flags and grad mode), several repeated: each op's last signatures (``_bound.last``), when
    one is found, are exactly the one ``BOUND`` holds under the call's full key, and every output and
    gradient matches the float64 reference."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from torch_frontend import _bound

    real_last = _bound.last
    fields = _call_spec(st)

    @settings(max_examples=8, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(base=fields, other=fields, changed=st.lists(st.sampled_from(FIELDS[1:]), min_size=1, max_size=2),
           order=st.lists(st.integers(0, 2), min_size=4, max_size=8))
    def run(base, other, changed, order):
        # the base call, one that differs from it in one or two fields (often a layout alone), and another
        specs = [base, {**base, **{f: other[f] for f in changed}}, other]
        _bound.clear()
        hits = []

        def last(op, opts, x, residual, weight, bias):
            sig = real_last(op, opts, x, residual, weight, bias)
            if sig is not None:
                k = _bound.key(op, opts[6], opts[7], opts[8], opts[0], x, residual, weight, bias, opts[1], opts[2])
                assert _bound.BOUND.get(k) is sig, "the last signature found is not the call's own"
                hits.append(op.name)
            return sig
        monkeypatch.setattr(_bound, "last", last)
        for n, i in enumerate(order):
            spec = specs[i % len(specs)]
            op = OPS[spec["op"]]
            inputs = _make_call(spec, seed=1000 * seed + 17 * n)
            kwargs = {"eps": spec["eps"], "save": spec["save"]}
            with torch.set_grad_enabled(spec["grad_mode"]):
                outs = getattr(tf, spec["op"])(*(inputs.get(name) for name in op.inputs), **kwargs)
            outs = outs if op.has_residual else (outs,)
            leaves = [(k, v) for k, v in inputs.items() if v.requires_grad and outs[0].requires_grad]
            dys = [randn(*o.shape, dtype=o.dtype, seed=seed + 50 + n + j) for j, o in enumerate(outs)]
            grads = torch.autograd.grad(outs, [v for _, v in leaves], dys) if leaves else ()
            ref_out, ref_grads = op.run_reference({k: np64(v) for k, v in inputs.items()},
                                                  op.options(eps=float(spec["eps"])),
                                                  {name: np64(d) for name, d in zip(op.outputs, dys)})
            tol = "bfloat16" if spec["dtype"] == BF16 else "float32"
            for name, o in zip(op.outputs, outs):
                assert_close(np64(o), ref_out[name], tol, f"call {n} {spec}: {name}")
            for (name, _), g in zip(leaves, grads):
                assert_close(np64(g), ref_grads[name], tol, f"call {n} {spec}: d{name}",
                             reduced_over=spec["M"] if name in op.params else 1)
        all_hits.extend(hits)

    all_hits = []
    run()
    assert all_hits, "no call found its signature among the op's last ones"


@pytest.mark.parametrize("save", ["input", "output"])
def test_bound_backward_takes_each_gradient_layout(save):
    """A bound signature's backward plans are keyed by the gradient's class and strides: contiguous,
    broadcast (stride 0) and transposed gradients of one forward signature each get a plan (the
    transposed one, which cannot be read as rows, is copied first, with a warning), every one right
    against float64, and a contiguous gradient again reuses its plan; whichever tensor the forward
    kept."""
    import contextlib

    from torch_frontend import _bound

    _bound.clear()
    w = randn(40, seed=400)
    layouts = {
        "contiguous": lambda seed: randn(6, 40, seed=seed),
        "broadcast": lambda seed: randn(40, seed=seed).expand(6, 40),
        "transposed": lambda seed: randn(40, 6, seed=seed).t(),
    }
    for i, (name, make) in enumerate([*layouts.items(), ("contiguous", layouts["contiguous"])]):
        x = randn(6, 40, seed=410 + i).requires_grad_(True)
        dy = make(420 + i)
        copies = pytest.warns(tf.NormkitCopyWarning, match="output gradient") if name == "transposed" else \
            contextlib.nullcontext()
        with copies:
            (dx,) = torch.autograd.grad(tf.rms_norm(x, w, save=save), x, dy)
        _, ref_grads = OPS["rms_norm"].run_reference({"x": np64(x), "weight": np64(w)},
                                                      OPS["rms_norm"].options(eps=1e-6), {"y": np64(dy)})
        assert_close(np64(dx), ref_grads["x"], "float32", f"dx, {name} gradient")
    (sig,) = _bound.BOUND.values()
    (bound,) = sig.bounds
    assert bound.from_output == (save == "output")
    assert len(bound.backward_plans) == 3  # contiguous, broadcast, transposed; the second contiguous one reused


def _qk_norm_backward(op: str, trained: bool, save: str, dy):
    """``op`` over rows of dy's shape, its weight (and bias) ``trained`` or frozen, differentiated with
    ``dy`` (and a contiguous d_residual_out) under poisoned outputs: every gradient against the float64
    reference."""
    from normkit.testing import poisoned_outputs

    spec = OPS[op]
    shape = tuple(dy.shape)
    leaves = {name: randn(*shape, seed=500 + i).requires_grad_(True) for i, name in enumerate(spec.row_inputs)}
    leaves.update({name: (randn(shape[-1], seed=510 + i, scale=0.1) + (name == "weight")).requires_grad_(trained)
                   for i, name in enumerate(spec.params)})  # a weight near 1, a small bias: save="auto" keeps y
    cots = {"y": dy, "residual_out": randn(*shape, seed=520)}
    with normkit.record_launches() as log, poisoned_outputs():
        outs = getattr(tf, op)(*(leaves[name] for name in spec.inputs), save=save)
        outs = dict(zip(spec.outputs, outs if spec.has_residual else (outs,)))
        wrt = [name for name in spec.inputs if leaves[name].requires_grad]
        got = torch.autograd.grad([outs[n] for n in spec.outputs], [leaves[n] for n in wrt],
                                  [cots[n] for n in spec.outputs])
    _, ref_grads = spec.run_reference({k: np64(v) for k, v in leaves.items()}, spec.options(eps=spec.default_eps),
                                      {name: np64(cots[name]) for name in spec.outputs})
    rows = dy.numel() // shape[-1]
    for name, g in zip(wrt, got):
        assert_close(np64(g), ref_grads[name], "float32", f"{op} ({save}): d{name}",
                     reduced_over=rows if name in spec.params else 1)
    return log


@pytest.mark.parametrize("save", ["auto", "input"])
@pytest.mark.parametrize("trained", [False, True], ids=["frozen", "trained"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_an_attention_laid_out_gradient_is_read_in_place(op, trained, save):
    """A QK-norm over q [B, S, H, D] gets from attention's backward a dy laid out [B, H, S, D] under
    the [B, S, H, D] view, which no row stride describes: the backward reads it in place by three row
    indices (DY_ROWS3), from the saved x or (save="auto", parameters frozen) from y, with no copy and
    no warning, and its gradients are the float64 reference's."""
    import warnings

    B, S, H = 2, 3, 4
    dy = randn(B, H, S, 24, seed=530).transpose(1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tf.NormkitCopyWarning)
        log = _qk_norm_backward(op, trained, save, dy)
    (bwd,) = log.of("norm_bwd_kernel")
    assert bwd.flags["DY_ROWS3"] is True and bwd.flags["ROWS_CONTIGUOUS"] is True, bwd.flags
    assert bwd.flags["FROM_Y"] == (save == "auto" and not trained), bwd.flags  # both backwards: from y, from x


def test_a_gradient_of_four_row_indices_is_copied_with_a_warning():
    """A dy whose leading dimensions merge into no fewer than four row indices (a [2, 2, 2, 2, D] view
    with each pair of dimensions swapped) is copied into rows, saying so, and read right."""
    dy = randn(2, 2, 2, 2, 24, seed=540).permute(1, 0, 3, 2, 4)
    with pytest.warns(tf.NormkitCopyWarning, match="output gradient"):
        log = _qk_norm_backward("rms_norm", True, "input", dy)
    (bwd,) = log.of("norm_bwd_kernel")
    assert bwd.flags["DY_ROWS3"] is False, bwd.flags


def test_triton_ops_register_inside_a_compiled_graph():
    """The triton ops register on first compiled use (registering imports torch._dynamo), from
    inside dynamo's trace, with no graph break; afterwards they exist under normkit's namespace."""
    from torch_frontend import _library_ops

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return x * 2 if _library_ops.triton_ops_registered() else x

    x = randn(3, seed=47)
    assert torch.equal(f(x), x * 2)
    assert len(_library_ops.TRITON_OPS) == 2
    for name in ("norm_fwd", "norm_bwd"):  # the custom ops' schema, under another name
        custom, triton = getattr(torch.ops.normkit, name).default, getattr(torch.ops.normkit, name + "_cuda").default
        assert str(triton._schema) == str(custom._schema).replace(name, name + "_cuda", 1)


# --- CUDA graphs: how users remove host overhead entirely (GPU only) ------------------------------

_CUDA_ONLY = pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")


def _lora_like_model():
    """A linear layer (trained) into a normkit RMSNorm with a frozen weight, and a fused add."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64, device=DEVICE)
            self.norm = tf.RMSNorm(64, device=DEVICE)
            self.add_norm = tf.FusedAddRMSNorm(64, device=DEVICE)
            self.norm.weight.requires_grad_(False)

        def forward(self, x):
            h = self.norm(self.proj(x))
            y, _ = self.add_norm(h, x)
            return y

    torch.manual_seed(0)
    return Block()


def _grads(model, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    return y.detach(), x.grad, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compile_with_dynamic_shapes_matches_eager():
    """dynamic=True: symbolic row counts cannot size a plan, so the call takes the opaque custom ops
    (their fake implementations handle symbolic shapes); two row counts, one compiled graph."""
    _check_dynamic_compile(width=48, row_counts=(5, 11), seed=80)


def _check_dynamic_compile(width: int, row_counts: tuple, seed: int) -> None:
    """rms_norm under torch.compile(dynamic=True), one graph over several row counts: the forward
    against float64, the backward bitwise equal to the eager one (the same kernel; the weight is
    trained, so the kernels run under compile)."""
    torch._dynamo.reset()
    w = randn(width, dtype=BF16, seed=seed).requires_grad_(True)
    compiled = torch.compile(lambda x: tf.rms_norm(x, w), dynamic=True, fullgraph=True)
    for i, rows in enumerate(row_counts):
        x = randn(rows, width, dtype=BF16, seed=seed + 1 + i).requires_grad_(True)
        dy = randn(rows, width, dtype=BF16, seed=seed + 1 + len(row_counts) + i)
        y = compiled(x)
        (dx,) = torch.autograd.grad(y, x, dy)
        assert_close(np64(y), ref.rms_norm(np64(x), np64(w)), "bfloat16", f"dynamic forward, {rows} rows")
        x2 = x.detach().clone().requires_grad_(True)
        (want,) = torch.autograd.grad(tf.rms_norm(x2, w), x2, dy)
        assert torch.equal(dx, want), f"dynamic backward, {rows} rows: the compiled one runs the eager kernel"
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_triton_ops_hand_symbolic_shapes_to_the_opaque_ops(monkeypatch):
    """On CUDA, compiling routes to the triton ops even under dynamic=True: dynamo answers
    isinstance(SymInt, int) with True, so the route cannot see symbolic sizes (found on the H200).
    The triton ops then hand the call to the opaque ops from inside their body. Forced here on CPU."""
    from torch_frontend import _library_ops

    def operators(x, *tensors):
        if torch.compiler.is_compiling() and _library_ops.triton_ops_registered():
            return torch.ops.normkit.norm_fwd_cuda, torch.ops.normkit.norm_bwd_cuda
        return torch.ops.normkit.norm_fwd, torch.ops.normkit.norm_bwd

    monkeypatch.setattr(_library_ops, "_operators", operators)
    _check_dynamic_compile(width=40, row_counts=(6, 13), seed=90)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_compiled_ops_match_eager(op, frozen):
    """Each op under torch.compile (the triton ops on CUDA, the custom ops on CPU) against the eager
    path, trained and frozen parameters, a 3-D bf16 input: forward, dx and the parameters' gradients."""
    torch._dynamo.reset()
    spec = OPS[op]
    D = 96
    params = {name: randn(D, dtype=BF16, seed=60 + i).requires_grad_(not frozen) for i, name in enumerate(spec.params)}
    fn = {"rms_norm": lambda x, r: tf.rms_norm(x, params["weight"]),
          "layer_norm": lambda x, r: tf.layer_norm(x, params["weight"], params["bias"]),
          "fused_add_rms_norm": lambda x, r: tf.fused_add_rms_norm(x, r, params["weight"])[0]}[op]
    compiled = torch.compile(fn, fullgraph=True)
    x0, r0, dy = randn(3, 5, D, dtype=BF16, seed=70), randn(3, 5, D, dtype=BF16, seed=71), randn(3, 5, D, dtype=BF16, seed=72)
    results = []
    for f in (fn, compiled):
        x, r = x0.clone().requires_grad_(True), r0.clone().requires_grad_(True)
        y = f(x, r)
        wrt = [x] + ([r] if spec.has_residual else []) + ([] if frozen else list(params.values()))
        results.append([y, *torch.autograd.grad(y, wrt, dy)])
    for i, (want, got) in enumerate(zip(*results)):
        assert_close(np64(got), np64(want), "bfloat16", f"{op} result {i}")


@_CUDA_ONLY
# torch's warm-up loop keeps the previous iteration's graph alive while it runs the next one, and
# torch 2.11 warns about the AccumulateGrad streams that follow; the replays below are the check
@pytest.mark.filterwarnings("ignore:The AccumulateGrad node's stream does not match:UserWarning")
def test_make_graphed_callables_matches_eager():
    model = _lora_like_model()
    eager = copy.deepcopy(model)  # the reference runs on a copy: the captured model's parameters never saw
    x, dy = randn(32, 64, seed=90), randn(32, 64, seed=91)  # an eager backward on the default stream
    want = _grads(eager, x, dy)
    graphed = torch.cuda.make_graphed_callables(model, (x.clone().requires_grad_(True),))
    for _ in range(3):  # replays
        model.zero_grad(set_to_none=True)
        got = _grads(graphed, x, dy)
    for a, b in zip((want[0], want[1], *want[2]), (got[0], got[1], *got[2])):
        assert torch.equal(a, b), "a CUDA-graph replay must be bitwise the eager result"


@_CUDA_ONLY
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
@pytest.mark.parametrize("route", ["inductor", "kernels"])
def test_compiled_model_launches_normkit_kernels_from_inductor_code(route):
    """Under torch.compile on CUDA the kernels are ``triton_op``s: Inductor's generated code launches
    them itself (no opaque custom-op call back into Python). The model's trained fused add + norm
    runs the kernels; its frozen norm is generated by Inductor, or runs the frozen kernel variant
    with ``compile_frozen_with("kernels")``."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    previous = tf.compile_frozen_with(route)
    try:
        model = _lora_like_model()
        compiled = torch.compile(model, fullgraph=True)
        x, dy = randn(32, 64, seed=94), randn(32, 64, seed=95)
        want = _grads(copy.deepcopy(model), x, dy)
        with normkit.record_launches() as log:
            got, codes = run_and_get_code(lambda: _grads(compiled, x, dy))
    finally:
        tf.compile_frozen_with(previous)
    code = "\n".join(codes)
    for kernel in ("norm_fwd_kernel", "norm_bwd_kernel"):
        assert kernel in code, f"{kernel} is not launched from Inductor's code"
    assert "torch.ops.normkit" not in code, "an opaque normkit op is still called from the compiled graph"
    frozen_variant = [launch.flags["COMPUTE_DW"] is False for launch in log.of("norm_bwd_kernel")]
    assert any(frozen_variant) == (route == "kernels"), frozen_variant
    for a, b in zip((want[0], want[1], *want[2]), (got[0], got[1], *got[2])):
        assert_close(np64(b), np64(a), "float32", "compiled vs eager")
    torch._dynamo.reset()


@_CUDA_ONLY
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compile stack warns about its own internals
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")  # Inductor's advice on the fp32 Linear
# torch 2.11's CUDAGraphTreeManager captures an empty graph on purpose (it creates the memory pool) and
# lets CUDA's "empty graph" warning out (torch 2.13 catches it); the skip counter below is the check
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
def test_compile_reduce_overhead_matches_eager():
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = _lora_like_model()
    x, dy = randn(32, 64, seed=92), randn(32, 64, seed=93)
    want = _grads(model, x, dy)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        model.zero_grad(set_to_none=True)
        got = _grads(compiled, x, dy)
    assert counters["inductor"]["cudagraph_skips"] == 0, "Inductor ran a graph without CUDA graphs"
    for a, b in zip((want[0], want[1], *want[2]), (got[0], got[1], *got[2])):
        assert_close(np64(b), np64(a), "float32", "reduce-overhead vs eager")


# --- large offsets (GPU only: needs > 4 GiB) -----------------------------------------------------


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device with > 8 GiB free: 2^31+ elements")
def test_more_than_2_31_elements():
    M, N = 2**31 // 4096 + 3, 4096
    x = torch.randn(M, N, device=DEVICE, dtype=BF16)
    w = torch.randn(N, device=DEVICE, dtype=BF16)
    y = tf.rms_norm(x, w)
    for rows in (slice(0, 2), slice(M - 2, M)):  # the first rows and the rows past 2^31 elements
        assert_close(np64(y[rows]), ref.rms_norm(np64(x[rows]), np64(w)), "bfloat16", f"rows {rows}")
    del x, y
    torch.cuda.empty_cache()


def test_tensors_on_different_devices():
    x = randn(4, 8, seed=46)
    w = torch.empty(8, device="meta")  # a device other than x's, available on any machine
    with normkit.record_launches() as log, pytest.raises(ValueError, match=r"weight is on meta but x is on"):
        tf.rms_norm(x, w)
    with pytest.raises(ValueError, match=r"residual is on meta but x is on"):
        tf.fused_add_rms_norm(x, torch.empty(4, 8, device="meta"))
    assert log.kernels() == []


# --- layouts and aliasing (each of these gave silently wrong numbers before) ---------------------


def _rms64(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("alias", ["residual_is_x", "weight_is_a_row_of_x", "bias_is_weight"])
def test_aliased_arguments(alias):
    """One tensor passed as two arguments (or a weight that is a view of x): outputs and every gradient
    as float64 autograd gives them for the same aliasing."""
    x0, w0 = randn(6, 32, seed=96), randn(32, seed=97)
    dy = randn(6, 32, seed=98)

    def run(x, w, mod, norm):
        if alias == "residual_is_x":
            return norm.fused_add_rms_norm(x, x, w)[0] if mod is tf else _rms64(x + x, w)
        if alias == "weight_is_a_row_of_x":
            xa = x * 1  # a non-leaf, so that x[0] is a view in the graph
            return norm.rms_norm(xa, xa[0]) if mod is tf else _rms64(xa, xa[0])
        return (norm.layer_norm(x, w, w) if mod is tf
                else torch.nn.functional.layer_norm(x, (32,), w, w, 1e-5))

    got_x, got_w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    want_x, want_w = x0.double().requires_grad_(True), w0.double().requires_grad_(True)
    y = run(got_x, got_w, tf, tf)
    y_ref = run(want_x, want_w, torch, None)
    (y * dy).sum().backward()
    (y_ref * dy.double()).sum().backward()
    assert_close(np64(y), np64(y_ref), "float32", f"{alias}: y")
    assert_close(np64(got_x.grad), np64(want_x.grad), "float32", f"{alias}: dx")
    if alias != "weight_is_a_row_of_x":
        assert_close(np64(got_w.grad), np64(want_w.grad), "float32", f"{alias}: dw", reduced_over=6)


def test_sliced_and_expanded_parameters_are_read_with_their_strides():
    x = randn(5, 16, seed=60)
    w_sliced = randn(32, seed=61)[::2]
    w_expanded = torch.tensor(1.5, device=DEVICE).expand(16)
    assert_close(np64(tf.rms_norm(x, w_sliced, casting_mode="gemma")), ref.rms_norm(np64(x), np64(w_sliced)),
                 "float32", "sliced weight")
    assert_close(np64(tf.rms_norm(x, w_expanded)), ref.rms_norm(np64(x), np64(w_expanded)), "float32",
                 "expanded weight")
    w3, b2 = randn(48, seed=62)[::3], randn(32, seed=63)[1::2]
    assert_close(np64(tf.layer_norm(x, w3, b2)), ref.layer_norm(np64(x), np64(w3), np64(b2)), "float32",
                 "sliced weight and bias")
    # through a module whose Parameter is a strided view, with the backward
    m = tf.RMSNorm(16, device=DEVICE)
    m.weight = torch.nn.Parameter(randn(32, seed=64)[::2])
    xg = randn(5, 16, seed=65).requires_grad_(True)
    dy = randn(5, 16, seed=66)
    m(xg).backward(dy)
    dx, dw = ref.rms_norm_bwd(np64(xg), np64(m.weight), np64(dy))
    assert_close(np64(xg.grad), dx, "float32", "dx, strided weight")
    assert_close(np64(m.weight.grad), dw, "float32", "dw, strided weight", reduced_over=5)


@pytest.mark.parametrize("shape", [(6, 24), (2, 3, 24)])
def test_fused_add_gradients_are_separate_tensors(shape):
    x = randn(*shape, seed=67).requires_grad_(True)
    r = randn(*shape, seed=68).requires_grad_(True)
    w = randn(24, seed=69)
    dy, ds = randn(*shape, seed=70), randn(*shape, seed=71)

    def step():
        y, s = tf.fused_add_rms_norm(x, r, w)
        torch.autograd.backward([y, s], [dy, ds])

    step()
    assert x.grad.data_ptr() != r.grad.data_ptr()
    once = x.grad.clone()
    assert torch.equal(r.grad, once)
    step()  # accumulates: twice the gradient, not three times
    assert torch.equal(x.grad, 2 * once) and torch.equal(r.grad, 2 * once)
    x.grad.mul_(0)
    assert torch.equal(r.grad, 2 * once), "zeroing x.grad must leave residual.grad alone"
    x.grad = 2 * once.clone()
    total = torch.nn.utils.clip_grad_norm_([x, r], max_norm=1.0)
    expect = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(2 * once)] * 2))
    assert torch.allclose(total, expect)
    assert torch.allclose(x.grad, r.grad), "clipping must scale each gradient once"


def test_float64_parameters():
    x = randn(7, 40, seed=75).requires_grad_(True)
    w = randn(40, dtype=torch.float64, seed=76).requires_grad_(True)
    b = randn(40, dtype=torch.float64, seed=77).requires_grad_(True)
    dy = randn(7, 40, seed=78)
    y = tf.layer_norm(x, w, b)
    y.backward(dy)
    assert y.dtype == torch.float32 and w.grad.dtype == torch.float64 and b.grad.dtype == torch.float64
    dx, dw, db = ref.layer_norm_bwd(np64(x), np64(w), np64(b), np64(dy))
    assert_close(np64(y), ref.layer_norm(np64(x), np64(w), np64(b)), "float32", "y")
    assert_close(np64(x.grad), dx, "float32", "dx")
    assert_close(np64(w.grad), dw, "float32", "dw", reduced_over=7)
    assert_close(np64(b.grad), db, "float32", "db", reduced_over=7)


def test_in_place_ops_on_the_outputs():
    x = randn(2, 3, 16, seed=79).requires_grad_(True)
    w = randn(16, seed=80).requires_grad_(True)
    y = tf.rms_norm(x, w)
    y.mul_(2)  # HF code scales hidden states in place
    y.sum().backward()
    dx, dw = ref.rms_norm_bwd(np64(x), np64(w), np.full((2, 3, 16), 2.0))
    assert_close(np64(x.grad), dx, "float32", "dx after y *= 2")
    _, s = tf.fused_add_rms_norm(x, randn(2, 3, 16, seed=81), w)
    s.add_(1)  # residual_out is saved for the backward: autograd must notice
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.sum().backward()


# --- allocations --------------------------------------------------------------------------------


class _CountAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    FACTORIES = ("empty.memory_format", "empty_strided.default", "zeros.default", "empty_like.default",
                 "zeros_like.default", "new_empty.default", "new_zeros.default", "full.default", "clone.default",
                 "contiguous.default", "_to_copy.default")

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if name in self.FACTORIES:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


class _UncountedLaunches:
    """Triton's interpreter (the CPU path) copies arguments internally: keep those out of the count."""

    def __init__(self, kernel):
        self.launcher = _INTERPRETED(kernel)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with torch.utils._python_dispatch._disable_current_modes():
                return self.launcher[grid](*args, **kwargs)
        return launch


from normkit import _compat as _interpreter_mod  # noqa: E402

_INTERPRETED = _interpreter_mod.interpreted


@pytest.mark.parametrize("requires_grad, want", [(False, 1), (True, 2)])
def test_forward_allocates_each_output_once(requires_grad, want, monkeypatch):
    """y alone without a backward; y and rstd when one will follow (nothing allocated twice)."""
    monkeypatch.setattr(_interpreter_mod, "interpreted", _UncountedLaunches)
    x = randn(2, 8, 32, seed=82)
    w = randn(32, seed=83).requires_grad_(requires_grad)
    tf.rms_norm(x, w)  # warm the plan cache: counting starts with a known plan
    with _CountAllocations() as mode:
        tf.rms_norm(x, w)
    assert len(mode.calls) == want, mode.calls


def test_eager_module_calls_skip_the_dispatcher(monkeypatch):
    """An eager call, through a module whose weight is an ``nn.Parameter`` too, launches directly: the
    ``normkit::norm_fwd/norm_bwd`` custom ops (kept for torch.compile and tensor subclasses) never run,
    nor do the DTensor placement checks."""
    from torch_frontend import _dtensor

    def no_dtensor_check(*args):
        raise AssertionError("the DTensor checks ran for plain tensors")

    monkeypatch.setattr(_dtensor, "check", no_dtensor_check)
    norm, add = tf.RMSNorm(64, device=DEVICE), tf.FusedAddRMSNorm(64, device=DEVICE)
    x, r = randn(8, 64, seed=94).requires_grad_(True), randn(8, 64, seed=95)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as prof:
        y = norm(x)
        z, s = add(y, r)
        (z.sum() + s.sum()).backward()
    names = {e.name for e in prof.events()}
    assert not {n for n in names if n.startswith("normkit::")}, sorted(n for n in names if "normkit" in n)
    assert x.grad is not None and norm.weight.grad is not None and add.weight.grad is not None


def test_module_options_are_checked_at_construction():
    with pytest.raises(TypeError, match=r"normkit: casting_mode must be a str"):
        tf.RMSNorm(8, casting_mode=["llama"])
    with pytest.raises(TypeError, match=r"normkit: offset must be a static Python float; got str"):
        tf.FusedAddRMSNorm(8, offset="1")
    with pytest.raises(ValueError, match=r"normkit: eps=1e\+39 does not fit in float32"):
        tf.LayerNorm(8, eps=1e39)
    with pytest.raises(TypeError, match=r"normkit: normalized_shape must be an int D"):
        tf.LayerNorm(8.0)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the bound launches are the compiled (CUDA) path")
@pytest.mark.parametrize("launch", ["triton", "direct"])
def test_bound_launches_match_tritons_launcher_and_respect_alignment(launch, monkeypatch):
    """After ``JITFunction.run`` compiled a plan's kernel for aligned pointers, later launches go
    through the compiled kernel's own launch (``launch="triton"``) or its C launcher with integer
    pointers (``"direct"``, ``normkit._compat.direct_launch``): bitwise the same results as the first,
    ``JITFunction.run``-launched call. A tensor 2 bytes off 16-byte alignment needs the unaligned
    specialization, so it takes ``JITFunction.run``, and is right; so does a launch under a hook."""
    from torch_frontend import _backend, _bound

    monkeypatch.setattr(_backend, "LAUNCH", launch)
    _bound.clear()  # fresh bound launches, made under this mode

    def run(x, w, dy):
        x = x.detach().requires_grad_(True)
        y = tf.rms_norm(x, w)
        (dx,) = torch.autograd.grad(y, x, dy)
        return y, dx

    w = randn(96, dtype=BF16, seed=501)
    x, dy = randn(64, 96, dtype=BF16, seed=502), randn(64, 96, dtype=BF16, seed=503)
    first = run(x, w, dy)  # compiles through JITFunction.run
    with normkit.record_launches() as log:
        again = run(x, w, dy)  # the bound launches
    assert [r.kernel for r in log] == ["norm_fwd_kernel", "norm_bwd_kernel"]
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    buf = randn(64 * 96 + 1, dtype=BF16, seed=504)
    unaligned = buf[1:].view(64, 96)
    assert unaligned.data_ptr() % 16 != 0
    y, dx = run(unaligned, w, dy)
    want_dx, _ = ref.rms_norm_bwd(np64(unaligned), np64(w), np64(dy))
    assert_close(np64(y), ref.rms_norm(np64(unaligned), np64(w)), "bfloat16", "y, unaligned x")
    assert_close(np64(dx), want_dx, "bfloat16", "dx, unaligned x")
    with _LaunchHook() as hook:  # a launch hook (a profiler's): it sees every launch, same results
        hooked = run(x, w, dy)
    assert len(hook.calls) == 2, hook.calls
    for a, b in zip(first, hooked):
        assert torch.equal(a, b)


def _bound_plans(x):
    """The forward and backward plans the fast path bound for ``rms_norm(x, w)``."""
    from torch_frontend import _bound

    bound = next(b for sig in _bound.BOUND.values() for b in sig.bounds
                 if b.fwd is not None and b.op.name == "rms_norm" and b.fwd.out_specs["Y"][0] == (x.shape[0], x.shape[1]))
    plans = [bound.fwd] + [plan[0] for plan in bound.backward_plans]
    return plans


class _LaunchHook:
    def __enter__(self):
        from triton import knobs
        self.saved = knobs.runtime.launch_enter_hook
        self.calls = []
        knobs.runtime.launch_enter_hook = lambda meta: self.calls.append(meta)
        return self

    def __exit__(self, *exc):
        from triton import knobs
        knobs.runtime.launch_enter_hook = self.saved
        assert self.calls, "Triton's launcher did not run under the hook"
        return False


def _non_dense(kind: str, t: torch.Tensor) -> torch.Tensor:
    if kind == "sparse_coo":
        return t.to_sparse()
    if kind == "sparse_csr":
        return t.to_sparse_csr() if t.dim() == 2 else t.to_sparse()
    if kind == "mkldnn":
        return t.cpu().to_mkldnn()
    return torch.nested.as_nested_tensor([t, t[:1]] if t.dim() == 2 else [t[None], t[None]], layout=torch.jagged)


@pytest.mark.filterwarnings("ignore:.*[Ss]parse.*:UserWarning")  # torch's beta-API notes on sparse CSR
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "mkldnn", "nested"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_non_dense_tensors_raise_naming_the_argument(op, kind):
    """Sparse, mkldnn and nested tensors: a normkit error naming the argument and its layout, before any
    launch, on the first call and on a repeated one (a bound signature must not swallow it)."""
    spec = OPS[op]
    inputs = {name: randn(4, 8, seed=i) for i, name in enumerate(spec.row_inputs)}
    inputs.update({name: randn(8, seed=5 + i) for i, name in enumerate(spec.params)})
    for name in spec.inputs:
        if kind == "mkldnn" and DEVICE != "cpu":
            continue
        apply(op, inputs)  # the dense call, bound
        bad = dict(inputs, **{name: _non_dense(kind, inputs[name])})
        what = "nested tensor" if kind == "nested" else "layout torch."
        with normkit.record_launches() as log, pytest.raises(TypeError, match=f"normkit: {name} (is a|has) {what}"):
            apply(op, bad)
        assert log.kernels() == [], "an error must come before any launch"
