"""A frozen norm keeps its output, not its input, for the backward (``save=``), in Torch.

With the weight and bias frozen, the backward recovers x_hat from the output y, so the norm's saved x
(often the only reference left to that activation in a LoRA model) is freed. These tests watch what
autograd saves (``saved_tensors_hooks``) on every Torch route, check the choice ``save="auto"`` makes
and the errors of ``save="output"``, and the gradients against the float64 reference, down to the
smallest weights from which x_hat can be recovered. The JAX side is in tests/test_jax.py.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import normkit
import torch_frontend as tf
from normkit.ops import OPS, OUTPUT_BIAS_RATIO, OUTPUT_W_MIN
from normkit.testing import assert_close
from tests.frontend_torch import DEVICE

D = 32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def randn(*shape, seed, dtype=torch.float32, scale=1.0, shift=0.1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(DEVICE, dtype)


def np64(t):
    return t.detach().double().cpu().numpy()


def safe_params(op: str, seed: int, dtype=torch.float32) -> dict:
    """A weight from which x_hat can be recovered (|w| in [1, 2)) and a bias smaller than it."""
    spec = OPS[op]
    out = {}
    if "weight" in spec.params:
        out["weight"] = (randn(D, seed=seed, dtype=torch.float64).abs() % 1.0 + 1.0).to(dtype)
    if "bias" in spec.params:
        out["bias"] = randn(D, seed=seed + 1, scale=0.3, shift=0.0, dtype=dtype)
    return out


def call(op: str, inputs: dict, **kw):
    out = getattr(tf, op)(*(inputs.get(name) for name in OPS[op].inputs), **kw)
    return out if OPS[op].has_residual else (out,)


@contextlib.contextmanager
def saved_tensors():
    """The tensors autograd saves while the block runs (as packed, before any unpacking)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def _rows_sized(saved, like) -> list:
    return [t for t in saved if t.numel() == like.numel() and t.dim() >= 2]


@pytest.mark.parametrize("attempt", ["first", "repeated"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_frozen_norm_keeps_its_output_not_its_input(op, attempt):
    """save="auto", weight and bias frozen: of the row-sized tensors the norm saves, the only one is its
    output y (the very tensor returned), on a signature's first call and on a repeated (bound) one; dx
    comes from the backward variant that reads y (FROM_Y) and matches the float64 reference."""
    spec = OPS[op]
    for call_no in range(1 if attempt == "first" else 2):
        inputs = {name: randn(4, D, seed=10 * call_no + i).requires_grad_() for i, name in enumerate(spec.row_inputs)}
        inputs.update(safe_params(op, seed=20))
        with saved_tensors() as saved, normkit.record_launches() as log:
            outs = call(op, inputs)
        rows = _rows_sized(saved, inputs["x"])
        assert len(rows) == 1 and rows[0].data_ptr() == outs[0].data_ptr(), \
            f"{op}: saved {[tuple(t.shape) for t in saved]}, not y alone"
        assert all(t.data_ptr() != inputs["x"].data_ptr() for t in saved)
        dy = randn(4, D, seed=30 + call_no)
        with normkit.record_launches() as log:
            grads = torch.autograd.grad(outs[0], [inputs[n] for n in spec.row_inputs], dy)
        (bwd,) = log.of("norm_bwd_kernel")
        assert bwd.flags["FROM_Y"] and not bwd.flags["COMPUTE_DW"], bwd.flags
        _, ref = spec.run_reference({k: np64(v) for k, v in inputs.items()}, spec.options(eps=spec.default_eps),
                                    {"y": np64(dy)})
        for name, g in zip(spec.row_inputs, grads):
            assert_close(np64(g), ref[name], "float32", f"{op} ({attempt}): d{name}")


@pytest.mark.parametrize("op", sorted(OPS))
def test_save_input_and_trained_parameters_keep_the_input(op):
    """save="input", and any trained parameter under "auto", keep x (the fused add: s) as before."""
    spec = OPS[op]
    for how in ("save_input", "trained"):
        inputs = {name: randn(4, D, seed=40 + i).requires_grad_() for i, name in enumerate(spec.row_inputs)}
        inputs.update({k: v.requires_grad_(how == "trained") for k, v in safe_params(op, seed=45).items()})
        with saved_tensors() as saved, normkit.record_launches():
            outs = call(op, inputs, save="input" if how == "save_input" else "auto")
        kept = outs[1] if spec.has_residual else inputs["x"]
        rows = _rows_sized(saved, inputs["x"])
        assert [t.data_ptr() for t in rows] == [kept.data_ptr()], (op, how)


@pytest.mark.parametrize("op", sorted(OPS))
def test_save_output_raises_for_a_trained_parameter_or_an_unsafe_weight(op):
    spec = OPS[op]
    x = randn(4, D, seed=50).requires_grad_()
    inputs = {"x": x, "residual": randn(4, D, seed=51), **safe_params(op, seed=52)}
    trained = dict(inputs, weight=inputs["weight"].clone().requires_grad_())
    with normkit.record_launches() as log, pytest.raises(ValueError, match="save='output' needs every parameter"):
        call(op, trained, save="output")
    assert log.kernels() == []
    unsafe = dict(inputs, weight=inputs["weight"].clone())
    unsafe["weight"][7] = 0.0
    with normkit.record_launches() as log, pytest.raises(ValueError, match="column 7"):
        call(op, unsafe, save="output")
    assert log.kernels() == []
    with pytest.raises(ValueError, match="save must be one of"):
        call(op, inputs, save="outputs")


@pytest.mark.parametrize("op", sorted(OPS))
def test_auto_keeps_the_input_where_the_weight_is_unsafe_and_rechecks_a_changed_weight(op):
    """A weight with a zero column (or, for LayerNorm, a bias over OUTPUT_BIAS_RATIO times the weight)
    cannot give x_hat back: "auto" keeps the input there, with the reason in ``save_decision``. The
    decision is made once per version of the weight: changing the frozen weight in place (a new
    ``_version``) decides again, and the gradients stay right throughout."""
    spec = OPS[op]
    params = safe_params(op, seed=60)
    for state in ("safe", "unsafe", "safe again"):
        if state == "unsafe":
            with torch.no_grad():
                params["weight"][3] = 0.0
        elif state == "safe again":
            with torch.no_grad():
                params["weight"][3] = 1.5
        inputs = {name: randn(4, D, seed=61 + i).requires_grad_() for i, name in enumerate(spec.row_inputs)}
        inputs.update(params)
        with saved_tensors() as saved:
            outs = call(op, inputs)
        keeps_output = any(t.data_ptr() == outs[0].data_ptr() for t in _rows_sized(saved, inputs["x"]))
        assert keeps_output == (state != "unsafe"), (op, state)
        decision = tf.save_decision(params["weight"], params.get("bias"), dtype=torch.float32)
        assert decision.saves_output == (state != "unsafe") and (state != "unsafe" or "column 3" in decision.reason)
        dy = randn(4, D, seed=65)
        grads = torch.autograd.grad(outs[0], [inputs[n] for n in spec.row_inputs], dy)
        _, ref = spec.run_reference({k: np64(v) for k, v in inputs.items()}, spec.options(eps=spec.default_eps),
                                    {"y": np64(dy)})
        for name, g in zip(spec.row_inputs, grads):
            assert_close(np64(g), ref[name], "float32", f"{op} ({state}): d{name}")


def test_save_decision_names_the_reason():
    w = torch.ones(D)
    assert tf.save_decision(w, dtype=torch.bfloat16).saves_output
    small = w.clone()
    small[5] = OUTPUT_W_MIN["float16"] / 2
    assert tf.save_decision(small, dtype=torch.float32).saves_output  # fine in fp32's range
    d = tf.save_decision(small, dtype=torch.float16)
    assert not d.saves_output and "column 5" in d.reason and "float16" in d.reason
    b = torch.zeros(D)
    b[9] = 1.01 * OUTPUT_BIAS_RATIO
    d = tf.save_decision(w, b, dtype=torch.float32)
    assert not d.saves_output and "column 9" in d.reason and "bias" in d.reason
    gemma = torch.full((D,), -1.0)  # offset 1: weight + offset == 0
    assert not tf.save_decision(gemma, dtype=torch.float32, offset=1.0).saves_output
    assert not tf.save_decision(w.clone().requires_grad_(), dtype=torch.float32).saves_output
    assert tf.save_decision(dtype=torch.float32).saves_output  # no parameters at all
    with pytest.raises(TypeError, match="dtype must be"):
        tf.save_decision(w, dtype=torch.int32)


# --- precision ------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(op=st.sampled_from(sorted(OPS)), dtype=st.sampled_from(sorted(DTYPES)),
       casting=st.sampled_from(["llama", "gemma", "none"]), offset=st.sampled_from([0.0, 1.0]),
       magnitude=st.sampled_from(["one", "small", "threshold"]), has_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_dx_from_the_output_is_within_the_tolerance_table(op, dtype, casting, offset, magnitude, has_bias, seed):
    """dx from the output against float64, across dtypes, casting modes, offsets, and weights down to
    the smallest |weight + offset| from which x_hat is recovered (``OUTPUT_W_MIN`` of x's dtype), with
    biases up to ``OUTPUT_BIAS_RATIO`` times the weight: within the tolerance table, like dx from the
    input. The float64 reference sees the inputs as stored (rounded to their dtype)."""
    spec = OPS[op]
    tdt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    scale = {"one": 1.0, "small": 1e-3, "threshold": 2.0 * OUTPUT_W_MIN[dtype]}[magnitude]
    sign = torch.where(torch.rand(D, generator=g) < 0.5, -1.0, 1.0).double()
    w_eff = sign * scale * (1.0 + torch.rand(D, generator=g).double())  # |w_eff| in [scale, 2 scale)
    if dtype == "float16":
        w_eff = w_eff.clamp(-60000.0, 60000.0)
    inputs = {name: (torch.randn(5, D, generator=g).double() + 0.1).to(tdt) for name in spec.row_inputs}
    if "weight" in spec.params:
        inputs["weight"] = (w_eff - (offset if spec.has_offset else 0.0)).to(tdt)
    if "bias" in spec.params and has_bias:
        w_stored = inputs["weight"].double()
        inputs["bias"] = (torch.rand(D, generator=g).double() * OUTPUT_BIAS_RATIO * 0.9 * w_stored.abs()).to(tdt)
    kw = {"offset": offset, "casting_mode": casting} if spec.has_offset else {}
    decision = tf.save_decision(inputs.get("weight"), inputs.get("bias"), dtype=tdt,
                                **({"offset": offset, "casting_mode": casting} if spec.has_offset else {}))
    if not decision.saves_output:  # rounding the weight to its dtype put a column under the bound
        return
    leaves = {k: v.to(DEVICE).requires_grad_(k in spec.row_inputs) for k, v in inputs.items()}
    dy = (torch.randn(5, D, generator=g).double()).to(tdt).to(DEVICE)
    with normkit.record_launches() as log:
        y = call(op, leaves, save="output", **kw)[0]
        grads = torch.autograd.grad(y, [leaves[n] for n in spec.row_inputs], dy)
    assert log.of("norm_bwd_kernel")[0].flags["FROM_Y"]
    _, ref = spec.run_reference({k: np64(v) for k, v in leaves.items()}, spec.options(eps=spec.default_eps, **kw),
                                {"y": np64(dy)})
    for name, got in zip(spec.row_inputs, grads):
        assert_close(np64(got), ref[name], dtype, f"{op} {dtype} {casting} off={offset} |w|~{scale:.3g}: d{name}")


# --- patch_model ------------------------------------------------------------------------------------


def test_patch_report_says_what_each_norm_keeps():
    model = torch.nn.Sequential(torch.nn.LayerNorm(D), torch.nn.Linear(D, D), torch.nn.RMSNorm(D))
    with torch.no_grad():
        model[0].bias[2] = 5.0  # larger than OUTPUT_BIAS_RATIO x its weight of 1: the input is kept
    report = tf.patch_model(model)
    decisions = dict(report.saves)
    assert not decisions["0"].saves_output and "column 2" in decisions["0"].reason
    assert decisions["2"].saves_output
    text = str(report)
    assert "backward keeps the output (not the input) in 1 of 2 patched norm(s)" in text and "column 2" in text
    assert all(m.save == "auto" for m in (model[0], model[2]))
    report = tf.patch_model(torch.nn.Sequential(torch.nn.RMSNorm(D)), save="input")
    assert report.saves[0][1].reason == "save='input'"


# --- torch.compile ------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", sorted(OPS))
def test_weights_sharing_a_signature_are_decided_apart(op):
    """Two frozen weights of one shape (two layers of a model: one call signature), one safe and one
    with a zero column, called alternately: each call keeps what its own weight allows, every time."""
    spec = OPS[op]
    safe, unsafe = safe_params(op, seed=66), safe_params(op, seed=67)
    with torch.no_grad():
        unsafe["weight"][5] = 0.0
    for i, params in enumerate([safe, unsafe, safe, unsafe, safe]):
        inputs = {name: randn(4, D, seed=68 + 7 * i + j).requires_grad_() for j, name in enumerate(spec.row_inputs)}
        inputs.update(params)
        with saved_tensors() as saved:
            outs = call(op, inputs)
        keeps_output = any(t.data_ptr() == outs[0].data_ptr() for t in _rows_sized(saved, inputs["x"]))
        assert keeps_output == (params is safe), (op, i)
        dy = randn(4, D, seed=90 + i)
        grads = torch.autograd.grad(outs[0], [inputs[n] for n in spec.row_inputs], dy)
        _, ref = spec.run_reference({k: np64(v) for k, v in inputs.items()}, spec.options(eps=spec.default_eps),
                                    {"y": np64(dy)})
        for name, g in zip(spec.row_inputs, grads):
            assert_close(np64(g), ref[name], "float32", f"{op} call {i}: d{name}")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
@pytest.mark.parametrize("route", ["inductor", "kernels"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_compiled_frozen_norm_keeps_its_output(op, route):
    """Under torch.compile, a frozen norm followed by a LoRA-style linear (whose trained weight keeps
    the norm's output): the compiled graph saves one row-sized tensor with save="auto" where no bias
    or offset can make the weight unsafe (the norm's output, shared with the linear) and two with
    save="input"; a LayerNorm with a bias keeps its input under "auto" there (its weight's values are
    unseen while tracing). Both routes of a frozen norm (Inductor's composite, normkit's kernels);
    gradients against eager."""
    spec = OPS[op]
    previous = tf.compile_frozen_with(route)
    try:
        params = safe_params(op, seed=70)
        a = randn(D, 8, seed=71).requires_grad_()
        r = randn(6, D, seed=72)
        counts, grads = {}, {}
        for save in ("auto", "input"):
            torch._dynamo.reset()

            def f(x):
                inputs = {"x": x, "residual": r, **params}
                return ((call(op, inputs, save=save)[0] @ a) ** 2).sum()

            x = randn(6, D, seed=73).requires_grad_()
            compiled = torch.compile(f, fullgraph=True)
            compiled(x)  # compile outside the hooks
            with saved_tensors() as saved:
                loss = compiled(x)
            counts[save] = len(_rows_sized(saved, x))
            grads[save] = torch.autograd.grad(loss, [x, a])
            want = torch.autograd.grad(f(x), [x, a])
            for g, w in zip(grads[save], want):
                assert_close(np64(g), np64(w), "float32", f"{op} {route} save={save}: compiled vs eager")
        if spec.has_residual:
            # Both outputs carry a gradient and the residual needs one too (as in a decoder stack),
            # against the float64 reference; the normalized output alone above leaves d_residual_out out.
            torch._dynamo.reset()
            x, res = randn(6, D, seed=75).requires_grad_(), randn(6, D, seed=76).requires_grad_()
            dy, ds = randn(6, D, seed=77), randn(6, D, seed=78)
            outs = torch.compile(lambda x, res: call(op, {"x": x, "residual": res, **params}), fullgraph=True)(x, res)
            got = torch.autograd.grad(outs, [x, res], [dy, ds])
            ref_outs, ref_grads = spec.run_reference({"x": np64(x), "residual": np64(res),
                                                      **{k: np64(v) for k, v in params.items()}},
                                                     spec.options(eps=spec.default_eps), {"y": np64(dy), "residual_out": np64(ds)})
            assert_close(np64(outs[0]), ref_outs["y"], "float32", f"{op} {route}: compiled y")
            for name, gv in zip(("x", "residual"), got):
                assert_close(np64(gv), ref_grads[name], "float32", f"{op} {route}: compiled d{name}, both outputs used")
        auto = 2 if "bias" in spec.params else 1
        assert counts == {"auto": auto, "input": 2}, counts
    finally:
        tf.compile_frozen_with(previous)
        torch._dynamo.reset()


@pytest.mark.slow  # one Inductor compilation per example
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@settings(max_examples=12, deadline=None, derandomize=True)
@given(op=st.sampled_from(sorted(OPS)), dtype=st.sampled_from(["float32", "bfloat16"]),
       x_kind=st.sampled_from(["contiguous", "strided_rows", "expanded_row", "transposed", "swapped_lead"]),
       residual_kind=st.sampled_from(["tied", "contiguous", "strided_rows", "transposed"]),
       dy_kind=st.sampled_from(["contiguous", "strided_rows", "transposed"]), seed=st.integers(0, 2**16))
@example(op="fused_add_rms_norm", dtype="bfloat16", x_kind="expanded_row", residual_kind="tied",
         dy_kind="transposed", seed=5)
@example(op="layer_norm", dtype="float32", x_kind="swapped_lead", residual_kind="tied", dy_kind="strided_rows",
         seed=6)
def test_compiled_output_saving_reads_every_layout_of_x(op, dtype, x_kind, residual_kind, dy_kind, seed):
    """The compiled output-saving route (Inductor's composite, x read through ``_written``'s view)
    with x strided, expanded by rows, transposed or with two leading dims swapped, the fused add's
    residual tied to x or a view of its own, and dy strided: y, s and every gradient against float64,
    and no normkit kernel launched (the route under test, not the kernels)."""
    from tests.layouts import Arg, TorchKit, make_base, view_np

    spec, kit, shape = OPS[op], TorchKit(), (2, 3, D)
    rng = np.random.default_rng(seed)

    def arg(kind):
        values = lambda s: np64(torch.from_numpy(rng.standard_normal(s) + 0.1).to(kit.dtypes[dtype]))  # noqa: E731
        return Arg(make_base(kind, shape, values), dtype, kind, shape)

    leaves = {"x": arg(x_kind)}
    if spec.has_residual and residual_kind != "tied":
        leaves["residual"] = arg(residual_kind)
    dy = arg(dy_kind)
    params = {k: v.to(kit.dtypes[dtype]) for k, v in safe_params(op, seed=seed % 1000).items()}
    views = {name: kit.views[a.kind](kit._tensor(a, DEVICE), shape).detach().requires_grad_()
             for name, a in leaves.items()}
    if spec.has_residual and residual_kind == "tied":
        views["residual"] = views["x"]
    torch._dynamo.reset()
    with normkit.record_launches() as log:
        outs = torch.compile(lambda **a: call(op, {**a, **params}), fullgraph=True)(**views)
        torch.autograd.backward(outs[0], kit.views[dy.kind](kit._tensor(dy, DEVICE), shape))
    assert not log, f"normkit kernels ran ({len(log)}): not the compiled route"
    ref_in = {name: view_np(a.kind, a.base, shape) for name, a in leaves.items()}
    if spec.has_residual and residual_kind == "tied":
        ref_in["residual"] = ref_in["x"]
    ref_outs, ref_grads = spec.run_reference({**ref_in, **{k: np64(v) for k, v in params.items()}},
                                             spec.options(eps=spec.default_eps), {"y": view_np(dy.kind, dy.base, shape)})
    what = f"{op} {dtype} x={x_kind} residual={residual_kind} dy={dy_kind}"
    assert_close(np64(outs[0]), ref_outs["y"], dtype, f"{what}: y")
    if spec.has_residual:
        assert_close(np64(outs[1]), ref_outs["residual_out"], dtype, f"{what}: residual_out")
    if spec.has_residual and residual_kind == "tied":  # x.grad holds both gradients
        want = ref_grads["x"] + ref_grads["residual"]
        assert_close(np64(views["x"].grad), want, dtype, f"{what}: dx + dresidual", reduced_over=D)
    else:
        for name, view in views.items():
            assert_close(np64(view.grad), ref_grads[name], dtype, f"{what}: d{name}", reduced_over=D)
    torch._dynamo.reset()


_RESIDUAL_CHAIN = """
import sys, torch, torch_frontend as tf
torch.manual_seed(0)
D = 64
norms = [tf.RMSNorm(D, dtype=torch.bfloat16, save=sys.argv[1]).requires_grad_(False) for _ in range(6)]
mats = [torch.randn(D, D, dtype=torch.bfloat16) / 8 for _ in norms]
def f(h):  # a decoder stack's residual stream: read by each norm and by the next add
    for norm, m in zip(norms, mats):
        h = h + norm(h) @ m
    return h.float().square().sum()
torch.compile(f, fullgraph=True)(torch.randn(2, 8, D, dtype=torch.bfloat16, requires_grad=True)).backward()
"""


@pytest.mark.slow  # two compilations in subprocesses
def test_compiled_output_saving_writes_the_residual_stream_once():
    """Under torch.compile a frozen norm keeping y does not save x, so nothing else asks Inductor to
    write the residual stream: left alone, each norm's forward kernel recomputed it from earlier
    buffers (a 6-layer LoRA Llama compiled 10 distinct forward norm kernels reading up to 6 buffers,
    against 5 reading up to 4 with x kept; a 16-layer one spent 0.25 ms more a step on an H100). The
    forward kernels with y kept read what they read with x kept. Inductor's generated code, read from
    its documented log (``TORCH_LOGS=output_code``)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    kernels = {}
    for save in ("auto", "input"):
        env = {**os.environ, "TORCH_LOGS": "output_code", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", _RESIDUAL_CHAIN, save], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        # the forward norm kernels (their rsqrt is reciprocal(sqrt)), each with its input pointers
        found = {}
        for m in re.finditer(r"(\w*_fused\w*sqrt\w*) = async_compile", proc.stderr):
            body = proc.stderr[m.end():proc.stderr.index("''')", m.end())]
            found[m.group(1)] = len(set(re.findall(r"\bin_ptr\d+", body.split("{", 1)[0])))
        assert found, proc.stderr[-3000:]
        kernels[save] = found
    assert len(kernels["auto"]) <= len(kernels["input"]), kernels
    assert max(kernels["auto"].values()) <= max(kernels["input"].values()), kernels


def test_the_safety_decision_belongs_to_a_tensor_not_to_an_address():
    """A weight's safety is remembered per tensor and version, not per data pointer: memory that a
    freed weight leaves is handed to the next tensor, whose ``_version`` starts again (seen on a
    GPU: a new weight with a zero column took the decision of the safe one freed before it). Here a
    second tensor over the same memory, at the same version, after a zero was written there."""
    def over(storage):
        return torch.empty(0).set_(storage, 0, (D,), (1,))  # a tensor of its own; set_ makes its version 1

    a = torch.ones(D)
    with torch.no_grad():
        a.add_(0.0)  # version 1
    assert tf.save_decision(a, dtype=torch.float32).saves_output
    writer = over(a.untyped_storage())
    with torch.no_grad():
        writer[3] = 0.0  # the memory now holds a zero column; a's version is unchanged
    c = over(a.untyped_storage())
    assert (c.data_ptr(), c._version) == (a.data_ptr(), a._version)
    d = tf.save_decision(c, dtype=torch.float32)
    assert not d.saves_output and "column 3" in d.reason
