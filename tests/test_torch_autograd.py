"""The Torch frontend under autograd's less common routes: saved-tensor hooks (activation offloading)
against the cached backward plans, double backward through every route, torch.func, inference calls
(which skip the autograd Function) and lazily negated views. Every result is compared with float64."""
import numpy as np
import pytest
import torch

import normkit
import torch_frontend as tf
from normkit.ops import OPS
from normkit.testing import assert_close, poisoned_outputs
from tests.frontend_torch import DEVICE

D = 32


def randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) + 0.1).to(DEVICE, dtype)


def np64(t):
    return t.detach().double().cpu().numpy()


def run(op, inputs: dict, trained: tuple):
    """``op`` on ``inputs`` (name -> tensor); outputs as a tuple."""
    out = getattr(tf, op)(*(inputs.get(name) for name in OPS[op].inputs))
    return out if OPS[op].has_residual else (out,)


# --- saved-tensor hooks ---------------------------------------------------------------------------


def _contiguous_copy():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous().clone(), lambda t: t)


def _save_on_cpu():
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


def _device_round_trip():
    """Pack moves the tensor to the other device (the CPU for CUDA tensors), unpack moves it back."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: (t.device, t.cpu() if t.is_cuda else t.clone()),
                                                    lambda packed: packed[1].to(packed[0]))


def _widened_statistics():
    """Unpack hands back the per-row statistics (the 1-D fp32 tensors of the 8 rows) in float64, as a
    hook that stores or widens them might: a lossless change of dtype the kernels must not misread."""
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t.double() if t.dtype == torch.float32 and t.shape == (8,) else t)


def _statistics_on_the_host():
    """Unpack hands back the per-row statistics (the 1-D fp32 tensors of the 8 rows) in host memory, as
    a hook that offloads them and leaves them there might; the rest as saved."""
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t.cpu() if t.dtype == torch.float32 and t.shape == (8,) else t)


def _strided_statistics():
    """Unpack hands back the per-row statistics as strided views (stride 2) with the same values: the
    kernels must not read them as contiguous."""
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: torch.stack([t, t], -1)[..., 0] if t.dtype == torch.float32 and t.shape == (8,) else t)


def _widened_input():
    """Unpack hands back every saved tensor of the rows' shape (the saved input) in float64, as a hook
    that widens what it stores might: the backward must read it as the input it was, and say nothing
    about the output gradient's dtype."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t.double() if t.dim() == 2 else t)


def _negated_input():
    """Unpack hands back the saved input as a lazily negated view of its values (``_neg_view`` of the
    negation): the kernels must read its values, not its raw memory."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: torch._neg_view(-t) if t.dim() == 2 else t)


HOOKS = {"contiguous_copy": _contiguous_copy, "save_on_cpu": _save_on_cpu, "device_round_trip": _device_round_trip,
         "widened_statistics": _widened_statistics, "strided_statistics": _strided_statistics,
         "widened_input": _widened_input, "negated_input": _negated_input}
if torch.cuda.is_available():  # a second device to hand the statistics back on
    HOOKS["statistics_on_the_host"] = _statistics_on_the_host


def _strided_inputs(op: str, seed: int, strided_x: bool, strided_w: bool) -> dict:
    """Rows of a wider buffer (8 x 32, row stride 40) and/or a weight read with element stride 2."""
    spec = OPS[op]
    inputs = {}
    for i, name in enumerate(spec.row_inputs):
        wide = randn(8, D + 8, seed=seed + i)
        inputs[name] = wide[:, :D] if strided_x else wide[:, :D].contiguous()
    for i, name in enumerate(spec.params):
        wide = randn(2 * D, seed=seed + 10 + i)
        inputs[name] = wide[::2] if strided_w else wide[::2].contiguous()
    return inputs


def _check_call(op: str, inputs: dict, hook, seed: int, what: str) -> None:
    spec = OPS[op]
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items()}  # detach keeps the strides
    dy = randn(8, D, seed=seed + 20)
    with hook():
        y = run(op, leaves, spec.inputs)[0]
    names = list(leaves)
    grads = torch.autograd.grad(y, [leaves[n] for n in names], dy)
    ref_out, ref_grads = spec.run_reference({k: np64(v) for k, v in leaves.items()},
                                            spec.options(eps=spec.default_eps), {"y": np64(dy)})
    assert_close(np64(y), ref_out["y"], "float32", f"{what}: y")
    for name, g in zip(names, grads):
        assert_close(np64(g), ref_grads[name], "float32", f"{what}: d{name}",
                     reduced_over=8 if name in spec.params else 1)


LAYOUTS = ("strided_x", "strided_weight", "both")


def _cached_plan_params():
    """Every op, hook and layout. The default run takes each (op, hook) once, the layout rotating (each
    op meets every layout, and each hook every layout and every op); the others are the slow tier."""
    return [pytest.param(op, hook, layout, id=f"{op}-{hook}-{layout}",
                         marks=() if (o + h) % len(LAYOUTS) == k else pytest.mark.slow)
            for o, op in enumerate(sorted(OPS)) for h, hook in enumerate(sorted(HOOKS))
            for k, layout in enumerate(LAYOUTS)]


@pytest.mark.filterwarnings("ignore:normkit. the saved input.*negated:torch_frontend.NormkitCopyWarning")
@pytest.mark.parametrize("op,hook,layout", _cached_plan_params())
def test_saved_tensor_hooks_with_cached_plans(op, hook, layout):
    """The same call signature, plainly and under a saved-tensor hook that hands the backward
    contiguous copies (in both orders): the cached backward plans must not read the copies with the
    original's strides."""
    from torch_frontend import _bound

    strided_x, strided_w = layout in ("strided_x", "both"), layout in ("strided_weight", "both")
    for order in (("plain", hook), (hook, "plain")):
        _bound.clear()
        for i, which in enumerate(order):
            seed = 1000 + 100 * i + 37 * (order[0] == "plain")
            inputs = _strided_inputs(op, seed, strided_x, strided_w)
            _check_call(op, inputs, HOOKS[which] if which != "plain" else _no_hook, seed,
                        f"{op}, {layout}, {' then '.join(order)}: {which}")


def _register_on_saved_tensors(grad_fn, pack, unpack) -> int:
    """Hooks on each saved tensor of one node (``grad_fn._raw_saved_tensors``); returns how many (the
    slots saved as None refuse them, saying so)."""
    n = 0
    for saved in grad_fn._raw_saved_tensors:
        try:
            saved.register_hooks(pack, unpack)
            n += 1
        except RuntimeError as e:
            assert "value None" in str(e), e
    return n


@pytest.mark.filterwarnings("ignore:normkit. the saved input.*negated:torch_frontend.NormkitCopyWarning")
@pytest.mark.parametrize("trained", [True, False], ids=["trained", "frozen"])
@pytest.mark.parametrize("hook", sorted(HOOKS))
@pytest.mark.parametrize("op", sorted(OPS))
def test_hooks_on_one_nodes_saved_tensors(op, hook, trained):
    """The hooks above registered after the forward on one call's own saved tensors, after a plain
    call of the same signature (whose backward reads the saved tensors as they are, keyed on the
    gradients alone): the hooked call's backward must read what its hooks hand back."""
    spec = OPS[op]
    hooks = HOOKS[hook]()
    for i, hooked in enumerate((False, True)):
        seed = 3000 + 100 * i
        inputs = _strided_inputs(op, seed, strided_x=False, strided_w=False)
        leaves = {k: v.detach().requires_grad_(trained or k in spec.row_inputs) for k, v in inputs.items()}
        dy = randn(8, D, seed=seed + 20)
        y = run(op, leaves, spec.inputs)[0]
        if hooked:
            assert _register_on_saved_tensors(y.grad_fn, hooks.pack_hook, hooks.unpack_hook) >= 3
        wrt = [n for n in leaves if leaves[n].requires_grad]
        grads = torch.autograd.grad(y, [leaves[n] for n in wrt], dy)
        _, ref_grads = spec.run_reference({k: np64(v) for k, v in leaves.items()},
                                          spec.options(eps=spec.default_eps), {"y": np64(dy)})
        for name, g in zip(wrt, grads):
            assert_close(np64(g), ref_grads[name], "float32", f"{op}, {hook}, hooked={hooked}: d{name}",
                         reduced_over=8 if name in spec.params else 1)


def _swap_weight_data(leaves: dict, how: str) -> None:
    """Each parameter's ``.data`` replaced, after the forward, by the same values in float64 or as a
    strided view: a write torch's version counter does not see, which the saved weight follows."""
    for name in leaves:
        if name in ("weight", "bias"):
            v = leaves[name].detach()
            leaves[name].data = v.double() if how == "dtype" else torch.stack([v, -v], -1)[:, 0]


PERTURBATIONS = [f"context:{h}" for h in sorted(HOOKS)] + [f"registered:{h}" for h in sorted(HOOKS)] + [
    "negated_dy", "strided_dy", "expanded_dy", "batched_dy"]
# (a trained parameter's gradient takes the dtype of its new data: the swap is a frozen weight's case)
CASES = [(p, t) for p in PERTURBATIONS for t in (True, False)] + [("weight_data:dtype", False),
                                                                   ("weight_data:strides", False)]


def _checked_params():
    """Every op with every case. The default run takes each hook (in a context around the forward or
    registered after it, frozen and trained) with one op, rotating so that each hook and each way of
    hooking meets every op, and every other perturbation with every op; the others are the slow tier."""
    params = []
    for o, op in enumerate(sorted(OPS)):
        for perturbation, trained in CASES:
            kind, _, hook = perturbation.partition(":")
            quick = kind not in ("context", "registered") or (
                sorted(HOOKS).index(hook) + (kind == "registered") + trained) % len(OPS) == o
            params.append(pytest.param(op, perturbation, trained, id=f"{op}-{perturbation}-{trained}",
                                       marks=() if quick else pytest.mark.slow))
    return params


@pytest.mark.filterwarnings("ignore:normkit. the (saved input|output gradient).*:torch_frontend.NormkitCopyWarning")
@pytest.mark.parametrize("op, perturbation, trained", _checked_params())
def test_checked_backward_reads_what_it_is_handed(op, perturbation, trained, monkeypatch):
    """Plain calls of one signature until the backward finds its launch by the check of the arrays'
    layouts (``_compat.layout_check``, seen passing), then one call whose backward is handed something
    else: a hooked saved tensor, an output gradient of another layout, a batched one, or a parameter
    whose ``.data`` was swapped after the forward. Every gradient is compared with float64."""
    from torch_frontend import _bound, _compat

    _bound.clear()  # this signature's launches found first by their full keys
    spec = OPS[op]
    passed = []
    made = _compat.layout_check

    def counted(tensors):
        check = made(tensors)
        return lambda *a: passed.append(check(*a)) or passed[-1]
    monkeypatch.setattr(_compat, "layout_check", counted)
    kind, _, what = perturbation.partition(":")
    for i in range(4):
        seed = 5000 + 100 * i
        last = i == 3
        inputs = _strided_inputs(op, seed, strided_x=False, strided_w=False)
        leaves = {k: v.detach().requires_grad_(trained or k in spec.row_inputs) for k, v in inputs.items()}
        ref_inputs = {k: np64(v) for k, v in leaves.items()}
        dy = randn(8, D, seed=seed + 20)
        context = HOOKS[what]() if last and kind == "context" else _no_hook
        with context:
            y = run(op, leaves, spec.inputs)[0]
        if last and kind == "registered":
            hooks = HOOKS[what]()
            assert _register_on_saved_tensors(y.grad_fn, hooks.pack_hook, hooks.unpack_hook) >= 3
        if last and kind == "weight_data":
            _swap_weight_data(leaves, what)
        if last and kind == "negated_dy":
            dy = torch._neg_view(-dy)
        elif last and kind == "strided_dy":
            dy = torch.stack([dy, -dy], -1)[..., 0]
        elif last and kind == "expanded_dy":
            dy = randn(8, 1, seed=seed + 21).expand(8, D)
        wrt = [n for n in leaves if leaves[n].requires_grad]
        if last and kind == "batched_dy":
            V = torch.stack([dy, randn(8, D, seed=seed + 22)])
            grads = torch.autograd.grad(y, [leaves[n] for n in wrt], V, is_grads_batched=True)
            cots = [np64(v) for v in V]
        else:
            grads = [g[None] for g in torch.autograd.grad(y, [leaves[n] for n in wrt], dy)]
            cots = [np64(dy)]
        if i == 2:
            assert passed and passed[-1], "the backward did not find its launch by the layout check"
        for b, cot in enumerate(cots):
            _, ref_grads = spec.run_reference(ref_inputs, spec.options(eps=spec.default_eps), {"y": cot})
            for name, g in zip(wrt, grads):
                assert_close(np64(g[b]), ref_grads[name], "float32", f"{op}, {perturbation}, call {i}: d{name}",
                             reduced_over=8 if name in spec.params else 1)


def test_backward_without_the_layout_check(monkeypatch):
    """Where torch has no usable layout check (``_compat.LAYOUT_CHECKS`` off), repeated backwards find their
    launch by the full key of the arrays they read, and are right."""
    from torch_frontend import _compat

    from torch_frontend import _bound

    _bound.clear()
    monkeypatch.setattr(_compat, "LAYOUT_CHECKS", False)
    monkeypatch.setattr(_compat, "layout_check", lambda tensors: pytest.fail("layout_check called"))
    spec = OPS["rms_norm"]
    for i in range(3):
        inputs = _strided_inputs("rms_norm", 7000 + i, strided_x=False, strided_w=False)
        leaves = {k: v.detach().requires_grad_(k == "x") for k, v in inputs.items()}
        dy = randn(8, D, seed=7020 + i)
        dx, = torch.autograd.grad(run("rms_norm", leaves, ("x",))[0], leaves["x"], dy)
        _, ref = spec.run_reference({k: np64(v) for k, v in leaves.items()}, spec.options(eps=spec.default_eps),
                                    {"y": np64(dy)})
        assert_close(np64(dx), ref["x"], "float32", f"call {i}: dx")


def _identity_hook(t):
    return t


class _no_hook:
    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_no_hook = _no_hook()


# --- double backward ------------------------------------------------------------------------------


def _float64_expression(op: str, inputs: dict, eps: float):
    """The op written directly in float64 torch, independent of normkit (autograd differentiates it)."""
    if op == "layer_norm":
        return (torch.nn.functional.layer_norm(inputs["x"], (D,), inputs["weight"], inputs["bias"], eps),)
    s = inputs["x"] + inputs["residual"] if op == "fused_add_rms_norm" else inputs["x"]
    y = s * torch.rsqrt((s * s).mean(-1, keepdim=True) + eps) * inputs["weight"]
    return (y, s) if op == "fused_add_rms_norm" else (y,)


def _penalty(outputs, leaves: dict, wrt: list, c: list, route: str):
    """A gradient penalty: first-order gradients of ``sum(out * c)`` with create_graph=True, then the
    gradients of ``sum(g**2) + sum(x**2)`` by ``route``. Returns (first-order, second-order)."""
    first = torch.autograd.grad(sum((o * k).sum() for o, k in zip(outputs, c)), [leaves[n] for n in wrt],
                                create_graph=True)
    loss = sum((g ** 2).sum() for g in first) + (leaves["x"] ** 2).sum()
    targets = [leaves[n] for n in wrt]
    if route == "autograd.grad":
        second = torch.autograd.grad(loss, targets, allow_unused=True)  # LayerNorm's loss does not depend on its bias
    else:
        for t in targets:
            t.grad = None
        if route == "backward":
            loss.backward()
        else:  # backward(inputs=...)
            loss.backward(inputs=targets)
        second = [t.grad for t in targets]
    return first, second


@pytest.mark.parametrize("route", ["autograd.grad", "backward", "backward(inputs=...)"])
@pytest.mark.parametrize("wrt", [("x",), "all"], ids=["x", "all"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_double_backward_matches_float64_autograd(op, wrt, route):
    spec = OPS[op]
    eps = spec.default_eps
    inputs = {name: randn(4, D, seed=70 + i) for i, name in enumerate(spec.row_inputs)}
    inputs.update({name: randn(D, seed=80 + i) for i, name in enumerate(spec.params)})
    wrt = spec.inputs if wrt == "all" else wrt
    c = [randn(4, D, seed=90 + i) for i in range(len(spec.outputs))]
    leaves = {k: v.clone().requires_grad_(k in wrt) for k, v in inputs.items()}
    # frozen parameters keep the input only on request: a backward from the output has no second order
    outputs = getattr(tf, op)(*(leaves.get(name) for name in spec.inputs), save="input")
    outputs = outputs if spec.has_residual else (outputs,)
    first, second = _penalty(outputs, leaves, list(wrt), c, route)
    leaves64 = {k: v.double().requires_grad_(k in wrt) for k, v in inputs.items()}
    first64, second64 = _penalty(_float64_expression(op, leaves64, eps), leaves64, list(wrt),
                                 [k.double() for k in c], "autograd.grad")
    for name, g, g64, h, h64 in zip(wrt, first, first64, second, second64):
        reduced = 4 if name in spec.params else 1
        assert_close(np64(g), np64(g64), "float32", f"{op} d{name} under create_graph", reduced_over=reduced)
        if h64 is None:  # the loss does not depend on it (a bias: dbias = sum of dy)
            assert h is None or not h.any(), f"{op}: second-order d{name} should be zero"
            continue
        assert h is not None, f"{op}: no second-order gradient for {name} ({route})"
        assert_close(np64(h), np64(h64), "float32", f"{op} second-order d{name} ({route})", reduced_over=reduced)


@pytest.mark.parametrize("op", sorted(OPS))
def test_second_order_through_a_norm_that_kept_its_output_raises(op):
    """A frozen norm keeps its output (save="auto"), from which no second derivative can be taken:
    create_graph=True raises, naming save="input", rather than return a gradient whose second-order
    terms are wrong; a first-order backward of the same call is right."""
    spec = OPS[op]
    inputs = {name: randn(4, D, seed=170 + i).requires_grad_() for i, name in enumerate(spec.row_inputs)}
    inputs.update({name: randn(D, seed=180 + i).abs() + 1.0 if name == "weight" else 0.1 * randn(D, seed=180 + i)
                   for i, name in enumerate(spec.params)})  # a weight from which x_hat can be recovered
    y = run(op, inputs, ("x",))[0]
    with pytest.raises(RuntimeError, match="save='input' to take second derivatives"):
        torch.autograd.grad(y.sum(), inputs["x"], create_graph=True)
    (dx,) = torch.autograd.grad(run(op, inputs, ("x",))[0].sum(), inputs["x"])
    _, ref = spec.run_reference({k: np64(v) for k, v in inputs.items()}, spec.options(eps=spec.default_eps),
                                {"y": np.ones((4, D))})
    assert_close(np64(dx), ref["x"], "float32", f"{op}: dx")


@pytest.mark.parametrize("op", sorted(OPS))
def test_first_order_gradients_without_create_graph_come_from_the_kernels(op):
    """Plain backward still runs the backward kernel (and no float64 math)."""
    import normkit

    spec = OPS[op]
    leaves = {name: randn(4, D, seed=60 + i).requires_grad_() for i, name in enumerate(spec.row_inputs)}
    leaves.update({name: randn(D, seed=65 + i).requires_grad_() for i, name in enumerate(spec.params)})
    with normkit.record_launches() as log:
        y = run(op, leaves, spec.inputs)[0]
        y.sum().backward()
    assert log.of("norm_bwd_kernel"), log.kernels()


def test_torch_func_raises_instead_of_computing():
    """torch.func transforms are not supported: they raise, never return a silently wrong gradient."""
    x, w = randn(4, D, seed=50), randn(D, seed=51)
    with pytest.raises(RuntimeError, match="autograd.Function with functorch transforms"):
        torch.func.grad(lambda t: tf.rms_norm(t, w).sum())(x)


def _dead_wrapper(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` wrapped by a torch.func transform that has returned (a tensor that escaped it)."""
    leaked = []
    torch.func.grad(lambda u: leaked.append(u * 1.0) or u.sum())(t)
    assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[0])
    return leaked[0]


def _inference_inputs(op: str, requires_grad: bool) -> dict:
    spec = OPS[op]
    inputs = {name: randn(8, D, seed=70 + i) for i, name in enumerate(spec.row_inputs)}
    inputs.update({name: randn(D, seed=75 + i) for i, name in enumerate(spec.params)})
    return {k: v.requires_grad_(requires_grad) for k, v in inputs.items()}


class _inference_mode_with_grad:
    """Inference mode with grad mode turned back on inside it (as a module calling
    ``torch.set_grad_enabled(True)`` under a caller's ``inference_mode``): still no graph is recorded."""

    def __enter__(self):
        self._modes = [torch.inference_mode(), torch.enable_grad()]
        for m in self._modes:
            m.__enter__()

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        return False


@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "inference_mode_with_grad", "nothing_requires_grad"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_inference_calls_launch_without_an_autograd_function(op, how, monkeypatch):
    """A repeated call that no gradient can reach launches its bound forward alone: no autograd Function
    runs, no statistics are stored, and its outputs (written over NaN-poisoned buffers) are the float64
    reference's, and bitwise those of the same call through the Function with a gradient to come."""
    from torch_frontend import _autograd

    spec = OPS[op]
    inputs = _inference_inputs(op, requires_grad=how != "nothing_requires_grad")
    trained = {k: v.detach().requires_grad_() for k, v in inputs.items()}
    with poisoned_outputs():
        through_function = [t.detach() for t in run(op, trained, spec.inputs)]
        ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "inference_mode_with_grad": _inference_mode_with_grad}.get(how, torch.enable_grad)
        with ctx():
            run(op, inputs, ())  # the first call binds the signature
            for name in ("RMSNormFunction", "LayerNormFunction", "FusedAddRMSNormFunction"):
                monkeypatch.setattr(getattr(_autograd, name), "apply", None)  # calling it would raise
            with normkit.record_launches() as log:
                got = run(op, inputs, ())
    assert log.kernels() == ["norm_fwd_kernel"] and log[0].flags["STORE_STATS"] is False, log.kernels()
    want, _ = spec.run_reference({k: np64(v) for k, v in inputs.items()}, spec.options(eps=spec.default_eps),
                                 {"y": np.ones((8, D))})
    for name, t, f in zip(spec.outputs, got, through_function):
        assert t.grad_fn is None and not t.requires_grad, name
        assert_close(np64(t), want[name], "float32", f"{op} {how}: {name}")
        assert torch.equal(t, f), f"{op} {how}: {name} differs from the call through the Function"


@pytest.mark.filterwarnings("ignore:.*torch.jit.script. is deprecated:DeprecationWarning")  # torch's first make_dual
def test_transforms_on_a_bound_inference_signature_still_raise():
    """The inference fast path leaves the transforms it cannot serve to the autograd Function, which
    raises: vmap and jvp (torch.func) and forward-mode AD, on a signature already bound."""
    import torch.autograd.forward_ad as fwAD

    x, w = randn(4, D, seed=80), randn(D, seed=81)
    with torch.no_grad():
        tf.rms_norm(x, w)
        tf.rms_norm(x, w)  # bound, and served without the Function
        with pytest.raises(RuntimeError, match="autograd.Function with functorch transforms"):
            torch.func.vmap(lambda t: tf.rms_norm(t, w))(x.reshape(2, 2, D))
        with pytest.raises(RuntimeError, match="autograd.Function with functorch transforms"):
            torch.func.jvp(lambda t: tf.rms_norm(t, w), (x,), (torch.ones_like(x),))
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="jvp"):
            tf.rms_norm(fwAD.make_dual(x, torch.ones_like(x)), w)


# --- negated views --------------------------------------------------------------------------------


def _negated(shape, seed) -> torch.Tensor:
    """A real tensor carrying torch's lazy-negation bit: the imaginary part of a conjugated view."""
    z = torch.complex(randn(*shape, seed=seed), randn(*shape, seed=seed + 1))
    x = z.conj().imag
    assert x.is_neg()
    return x


@pytest.mark.filterwarnings("ignore::torch_frontend.NormkitCopyWarning")
@pytest.mark.parametrize("layout", ["one_column", "expanded", "rows", "weight"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_negated_views_are_read_as_their_values(op, layout):
    spec = OPS[op]
    d = 1 if layout == "one_column" else D
    inputs = {name: randn(4, d, seed=30 + i) for i, name in enumerate(spec.row_inputs)}
    inputs.update({name: randn(d, seed=35 + i) for i, name in enumerate(spec.params)})
    if layout in ("one_column", "rows"):
        inputs["x"] = _negated((4, d), seed=40)
    elif layout == "expanded":  # strides (2, 0): a broadcast column of a complex tensor's imaginary parts
        inputs["x"] = _negated((4, 1), seed=40).expand(4, d)
    else:
        inputs["weight"] = _negated((d,), seed=40)
    want, _ = spec.run_reference({k: np64(v.resolve_neg()) for k, v in inputs.items()},
                                 spec.options(eps=spec.default_eps), {"y": np.ones((4, d))})
    assert any(t.is_neg() for t in inputs.values())
    for attempt in ("first", "repeated"):  # the repeated call takes the eager fast path
        with pytest.warns(tf.NormkitCopyWarning, match="negated"):
            got = run(op, inputs, ())
        for name, t in zip(spec.outputs, got):
            assert_close(np64(t), want[name], "float32", f"{op} {layout} ({attempt}): {name}")


@pytest.mark.parametrize("trained", ["x", "all"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_negated_output_gradients_are_read_as_their_values(op, trained):
    """Output gradients carrying torch's lazy-negation bit (``z.conj().imag``, expanded, or
    ``torch._neg_view``): dx, dW, dB and the fused add's residual_out gradient see their values, on the
    first call and on the repeated (bound) one."""
    spec = OPS[op]
    wrt = spec.inputs if trained == "all" else ("x",)
    for attempt, seed in (("first", 100), ("repeated", 200)):
        inputs = {name: randn(4, D, seed=seed + i) for i, name in enumerate(spec.row_inputs)}
        inputs.update({name: randn(D, seed=seed + 5 + i) for i, name in enumerate(spec.params)})
        leaves = {k: v.requires_grad_(k in wrt) for k, v in inputs.items()}
        outs = run(op, leaves, wrt)
        cots = [_negated((4, 1), seed=seed + 20).expand(4, D)]  # strides (2, 0), negated
        if spec.has_residual:
            cots.append(torch._neg_view(-randn(4, D, seed=seed + 30)))
        assert all(c.is_neg() for c in cots)
        with pytest.warns(tf.NormkitCopyWarning, match="negated"):
            grads = torch.autograd.grad(outs, [leaves[n] for n in wrt], cots)
        cot64 = {name: np64(c.resolve_neg()) for name, c in zip(spec.outputs, cots)}
        _, ref = spec.run_reference({k: np64(v) for k, v in inputs.items()}, spec.options(eps=spec.default_eps), cot64)
        for name, g in zip(wrt, grads):
            assert_close(np64(g), ref[name], "float32", f"{op} ({attempt}): d{name}",
                         reduced_over=4 if name in spec.params else 1)


def _jacobian64(op: str, inputs: dict) -> np.ndarray:
    """d(first output)/dx of the float64 reference, by float64 torch autograd: shape (4, D, 4, D)."""
    leaves = {k: v.detach().double() for k, v in inputs.items()}

    def f(x):
        return _float64_expression(op, {**leaves, "x": x}, OPS[op].default_eps)[0]

    return np64(torch.autograd.functional.jacobian(f, leaves["x"]))


@pytest.mark.parametrize("how", ["is_grads_batched", "jacobian_vectorize"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_batched_output_gradients_match_float64(op, how):
    """``autograd.grad(..., is_grads_batched=True)`` and ``autograd.functional.jacobian(vectorize=True)``
    hand the backward a batched gradient (no storage a kernel could read): each batch element's
    gradient is the float64 reference's."""
    spec = OPS[op]
    inputs = {name: randn(4, D, seed=300 + i) for i, name in enumerate(spec.row_inputs)}
    inputs.update({name: randn(D, seed=305 + i) for i, name in enumerate(spec.params)})
    want = _jacobian64(op, inputs)
    if how == "is_grads_batched":
        x = inputs["x"].clone().requires_grad_()
        y = run(op, {**inputs, "x": x}, ("x",))[0]
        V = randn(3, 4, D, seed=310)
        got, = torch.autograd.grad(y, x, V, is_grads_batched=True)
        want = np.einsum("bij,ijkl->bkl", np64(V), want)
    else:
        got = torch.autograd.functional.jacobian(lambda t: run(op, {**inputs, "x": t}, ("x",))[0], inputs["x"],
                                                 vectorize=True)
    assert_close(np64(got), want, "float32", f"{op} {how}")
