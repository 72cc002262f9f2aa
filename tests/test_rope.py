"""rms_norm_rope (RMSNorm, then rotary embedding) through both frontends against the float64 reference.

Each body is written once and runs through every adapter: Torch, JAX's Triton implementation (the
interpreter behind a host callback on CPU), JAX's Pallas implementation (interpret mode on CPU) and
JAX's XLA implementation. Outputs are poisoned (NaN before every launch; Pallas's interpret mode
starts every float output as NaN itself), so an element a kernel fails to write fails the comparison.

Tolerances are the table's (``normkit.testing.TOLERANCES``). The rotation's roundings are relative to
the magnitude of the pair it mixes, not to the element it produces (``y_j cos - y_p sin`` can cancel),
so the output is compared in units of its pair's magnitude (``_pair_units``: divided by the pair's
norm rounded up to a power of two, which is exact).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import normkit
from normkit import norm_math, reference, rope, saving
from normkit.ops import CASTING_MODES
from normkit.testing import assert_close, coarser, poisoned_outputs, rounded

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None
CASTINGS = ("llama", "gemma", "none")


# ---------------------------------------------------------------------------------------------
# Cases and inputs.


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 2
    S: int = 3
    H: int = 2
    D: int = 16
    dtype: str = "float32"
    table_dtype: str | None = None  # None: x's
    casting: str = "llama"
    offset: float = 0.0
    interleaved: bool = False
    transposed: bool = False  # x is [B, H, S, D], the transposed view of a [B, S, H, D] buffer (Torch)
    table: str = "batch"  # "batch": [B, S, 1, D] / [B, 1, S, D]; "shared": [S, D] / [1, 1, S, D]
    trained: bool = True  # the weight requires a gradient (else it is frozen)
    save: str = "auto"
    scale: float = 1.0  # the tables' factor (HF's attention_scaling)
    tables: str = "rotary"  # "rotary": HF's (a pair's columns at one angle); "mixed": some table rows not rotations
    seed: int = 0

    @property
    def shape(self) -> tuple:
        return (self.B, self.H, self.S, self.D) if self.transposed else (self.B, self.S, self.H, self.D)

    @property
    def table_shape(self) -> tuple:
        B = self.B if self.table == "batch" else 1
        if self.transposed:
            return (B, 1, self.S, self.D)
        return (B, self.S, 1, self.D) if self.table == "batch" else (self.S, 1, self.D)

    @property
    def kwargs(self) -> dict:
        return dict(eps=1e-6, offset=self.offset, casting_mode=self.casting, interleaved=self.interleaved,
                    save=self.save)


def inputs(case: Case) -> dict:
    """Fresh random inputs (never zeros), exact in their dtypes, in float64."""
    rng = np.random.default_rng(case.seed)
    D, td = case.D, case.table_dtype or case.dtype
    theta = rng.uniform(-4.0, 4.0, case.table_shape[:-1] + (D // 2,))
    theta = np.repeat(theta, 2, axis=-1) if case.interleaved else np.concatenate([theta, theta], axis=-1)
    if case.tables == "mixed":  # about half the table rows: an angle of its own per column, no rotation
        free = rng.uniform(-4.0, 4.0, case.table_shape)
        theta = np.where(rng.random(case.table_shape[:-1] + (1,)) < 0.5, free, theta)
    return {
        "x": rounded(rng.standard_normal(case.shape) * 1.5 + 0.3, case.dtype),
        # weight + offset in +-[0.5, 1.5] (Gemma's weights lie around 0)
        "weight": rounded(rng.uniform(0.5, 1.5, D) * rng.choice([-1.0, 1.0], D) - case.offset, case.dtype),
        "cos": rounded(np.cos(theta) * case.scale, td),
        "sin": rounded(np.sin(theta) * case.scale, td),
        "dout": rounded(rng.standard_normal(case.shape), case.dtype),
    }


@dataclasses.dataclass
class Run:
    out: np.ndarray
    dx: np.ndarray
    dw: np.ndarray | None
    log: list
    saved_x: bool | None = None  # Torch: whether the autograd graph kept a tensor of x's storage


# ---------------------------------------------------------------------------------------------
# Adapters: one per frontend / implementation.


class TorchAdapter:
    name = "torch"
    compile_backend = None  # a torch.compile backend: the call compiled, fullgraph (TorchCompiledAdapter)

    def run(self, case: Case, a: dict) -> Run:
        import torch

        import torch_frontend as tf
        from torch_frontend._backend import TORCH_DTYPES

        t = lambda v, dt: torch.from_numpy(np.ascontiguousarray(v)).to(TORCH_DTYPES[dt])  # noqa: E731
        td = case.table_dtype or case.dtype
        if case.transposed:  # the [B, H, S, D] view of a [B, S, H, D] buffer
            leaf = t(a["x"].swapaxes(1, 2), case.dtype).requires_grad_(True)
            x = leaf.transpose(1, 2)
        else:
            leaf = x = t(a["x"], case.dtype).requires_grad_(True)
        w = t(a["weight"], case.dtype).requires_grad_(case.trained)
        saved = []

        def pack(s):
            saved.append(s)
            return s

        cos, sin = t(a["cos"], td), t(a["sin"], td)
        if self.compile_backend is not None:
            def f(leaf, w):  # the leaf passed in (the transposed view taken inside, as a model does)
                return tf.rms_norm_rope(leaf.transpose(1, 2) if case.transposed else leaf, w, cos, sin, **case.kwargs)

            call = torch.compile(f, backend=self.compile_backend, fullgraph=True)  # fullgraph: no graph break
            with normkit.record_launches() as log:
                out = call(leaf, w)
                out.backward(t(a["dout"], case.dtype))
        else:
            with normkit.record_launches() as log, poisoned_outputs(), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
                out = tf.rms_norm_rope(x, w, cos, sin, **case.kwargs)
                out.backward(t(a["dout"], case.dtype))
            assert out.stride() == x.stride(), (out.stride(), x.stride())  # laid out like x
        dx = leaf.grad.transpose(1, 2) if case.transposed else leaf.grad
        ptr = leaf.untyped_storage().data_ptr()
        np64 = lambda v: None if v is None else v.detach().double().numpy()  # noqa: E731
        return Run(np64(out), np64(dx), np64(w.grad), log, saved_x=None if self.compile_backend else
                   any(s.untyped_storage().data_ptr() == ptr for s in saved))


class TorchCompiledAdapter(TorchAdapter):
    """The Torch call inside ``torch.compile(..., fullgraph=True)``: the kernels as custom ops."""

    def __init__(self, backend: str):
        self.compile_backend = backend
        self.name = f"torch-compile-{backend}"


class JaxAdapter:
    def __init__(self, implementation: str):
        self.implementation = implementation
        self.name = f"jax-{implementation}"

    def run(self, case: Case, a: dict) -> Run:
        import jax
        import jax.numpy as jnp

        import jax_frontend as jf

        dts = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
        j = lambda v, dt: jnp.asarray(np.asarray(v, np.float32)).astype(dts[dt])  # noqa: E731
        td = case.table_dtype or case.dtype
        x, w = j(a["x"], case.dtype), j(a["weight"], case.dtype)
        cos, sin, d = j(a["cos"], td), j(a["sin"], td), j(a["dout"], case.dtype)
        call = lambda x, w: jf.rms_norm_rope(x, w, cos, sin, implementation=self.implementation,  # noqa: E731
                                             **case.kwargs)
        with normkit.record_launches() as log, poisoned_outputs():
            if case.trained:
                out, vjp = jax.vjp(jax.jit(call), x, w)
                dx, dw = vjp(d)
            else:  # a frozen weight: closed over, not jitted, so its values are known to the save rule
                out, vjp = jax.vjp(lambda x: call(x, w), x)
                (dx,), dw = vjp(d), None
        np64 = lambda v: None if v is None else np.asarray(jnp.asarray(v, jnp.float32), np.float64)  # noqa: E731
        return Run(np64(out), np64(dx), np64(dw), log)


ADAPTERS = {}
if HAS_TORCH:
    ADAPTERS["torch"] = TorchAdapter()
    if HAS_JAX:
        ADAPTERS["jax-triton"] = JaxAdapter("triton")  # the interpreter on CPU runs on torch tensors
if HAS_JAX:
    ADAPTERS["jax-pallas"] = JaxAdapter("pallas")
    ADAPTERS["jax-xla"] = JaxAdapter("xla")


@pytest.fixture(params=sorted(ADAPTERS))
def adapter(request):
    return ADAPTERS[request.param]


# ---------------------------------------------------------------------------------------------
# The check, written once.


def _pair_units(y: np.ndarray, interleaved: bool) -> np.ndarray:
    """Per element, its pair's magnitude ``|(y_j, y_p)|`` (the scale the rotation's roundings are
    relative to) rounded up to a power of two, at least 1."""
    norm = np.sqrt(y * y + norm_math.rope_partner(y, interleaved=interleaved) ** 2)
    return 2.0 ** np.ceil(np.log2(np.maximum(norm, 1.0)))


def _flags(log, part: str) -> dict:
    (launch,) = [launch for launch in log if part in launch.kernel][-1:]
    return launch.flags


def expected_from_output(case: Case, a: dict) -> bool:
    """What ``save`` keeps (normkit.saving.decide with the weight's values): the output where the
    weight is frozen and safe (RMSNorm's rule and the pair ratio, ``norm_math.rope_unsafe_reason``)."""
    if case.save == "input" or case.trained:
        return False
    return norm_math.rope_unsafe_reason(a["weight"], x_dtype=case.dtype, offset=case.offset,
                                        casting=CASTING_MODES[case.casting], interleaved=case.interleaved) is None


def check(adapter, case: Case) -> None:
    a = inputs(case)
    run = adapter.run(case, a)
    check_values(adapter.name, case, a, run)
    from_output = expected_from_output(case, a)
    assert bool(_flags(run.log, "fwd")["STORE_REC"]) == from_output, run.log
    bwd = _flags(run.log, "bwd")
    assert bool(bwd["FROM_Y"]) == from_output and bool(bwd["COMPUTE_DW"]) == case.trained, bwd
    if run.saved_x is not None:
        assert run.saved_x == (not from_output), f"{adapter.name} {case}: x kept = {run.saved_x}"


def check_values(name: str, case: Case, a: dict, run: Run) -> None:
    """A run's out, dx and dw against the float64 reference."""
    tol = coarser(case.dtype, case.table_dtype or case.dtype)
    ref = reference.rms_norm_rope(a["x"], a["weight"], a["cos"], a["sin"], 1e-6, case.offset, case.interleaved)
    y = reference.rms_norm(a["x"], a["weight"], 1e-6, case.offset)
    units = _pair_units(y, case.interleaved) * max(case.scale, 1.0)
    assert_close(run.out / units, ref / units, tol, f"{name} {case}: out (in units of its pair)")
    dx, dw = reference.rms_norm_rope_bwd(a["x"], a["weight"], a["cos"], a["sin"], a["dout"], 1e-6, case.offset,
                                         case.interleaved)
    assert_close(run.dx, dx, tol, f"{name} {case}: dx")
    if case.trained:
        assert_close(run.dw, dw, tol, f"{name} {case}: dw", reduced_over=int(np.prod(case.shape[:-1])))
    else:
        assert run.dw is None or not np.any(run.dw), f"{name}: a frozen weight got a gradient"


# ---------------------------------------------------------------------------------------------
# Tests.


def _grid():
    """Every casting mode x offset x pairing once, the other factors rotating through theirs."""
    out = []
    i = 0
    for casting in CASTINGS:
        for offset in (0.0, 1.0):
            for interleaved in (False, True):
                out.append(Case(casting=casting, offset=offset, interleaved=interleaved,
                                dtype=("float32", "bfloat16", "float16")[i % 3], transposed=bool(i % 2),
                                table=("batch", "shared")[(i // 2) % 2], trained=bool((i // 3) % 2), seed=i))
                i += 1
    return out


def _grid_params():
    """The grid through every adapter. JAX's Triton implementation launches the Torch frontend's plans
    and kernels, which the grid meets through Torch: its default run takes the grid's first four cases
    (each dtype, both layouts of x and of the tables, frozen and trained), the rest is the slow tier."""
    return [pytest.param(name, case, id=f"{name}-{case}",
                         marks=pytest.mark.slow if name == "jax-triton" and i >= 4 else ())
            for name in sorted(ADAPTERS) for i, case in enumerate(_grid())]


@pytest.mark.parametrize("name,case", _grid_params())
def test_matches_reference(name, case):
    check(ADAPTERS[name], case)


@pytest.mark.parametrize("case", [
    Case(dtype="bfloat16", table_dtype="float32", trained=False, transposed=True, D=8),
    Case(casting="gemma", offset=1.0, trained=False, scale=1.25, D=8),  # tables carrying attention_scaling
    Case(trained=False, save="input", D=8),
    Case(dtype="float16", D=24, S=2, H=3, trained=False),  # D not a power of two
    # one pair per row, interleaved (the pairings coincide), frozen and trained
    Case(dtype="float16", casting="none", offset=1.0, interleaved=True, B=1, S=3, H=1, D=2, trained=False, seed=89),
    Case(casting="gemma", interleaved=True, B=3, S=3, H=2, D=2, table="shared", seed=51841),
], ids=str)
def test_variants(adapter, case):
    check(adapter, case)


def test_save_output_raises_for_a_trained_or_unsafe_weight(adapter):
    case = Case(D=8, save="output")
    with pytest.raises(ValueError, match="save='output'.*weight"):
        adapter.run(case, inputs(case))
    case = Case(D=8, save="output", trained=False, offset=1.0)
    a = inputs(case)
    a["weight"][3] = -1.0  # weight + offset is 0 in column 3
    with pytest.raises(ValueError, match="column 3"):
        adapter.run(case, a)


def test_gradients_bitwise_reproducible(adapter):
    case = Case(dtype="bfloat16", B=3, S=5, H=2, D=16, transposed=True)
    a = inputs(case)
    first, second = adapter.run(case, a), adapter.run(case, a)
    for name in ("out", "dx", "dw"):
        assert np.array_equal(getattr(first, name), getattr(second, name)), name


BAD = {
    "odd D": (dict(x=(2, 3, 2, 7)), "D=7 must be even"),
    "cos shape": (dict(cos=(2, 4, 1, 8)), "cos has shape"),
    "sin shape": (dict(sin=(1, 3, 1, 8)), "cos has shape .* but sin has shape"),
    "table dtype": (dict(table_dtype="float16"), "cos has dtype float16; expected x's dtype bfloat16 or float32"),
    "table dtypes differ": (dict(sin_dtype="float32"), "cos has dtype bfloat16 but sin has dtype float32"),
    "weight shape": (dict(weight=(4,)), r"weight has shape \(4,\); expected \(8,\)"),
    # (JAX without x64 has no float64 array: there x is int32, a dtype it has and normkit refuses)
    "x dtype": (dict(x_dtype="float64"), "x has dtype (float64|int32)"),
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_bad_inputs_raise_before_launch(adapter, what):
    change, message = BAD[what]
    x_shape = change.get("x", (2, 3, 2, 8))
    D = x_shape[-1]
    shapes = dict(x=x_shape, weight=change.get("weight", (D,)), cos=change.get("cos", (2, 3, 1, D)))
    shapes["sin"] = change.get("sin", shapes["cos"])
    x_dtype = change.get("x_dtype", "bfloat16")
    td = change.get("table_dtype", x_dtype if x_dtype != "float64" else "float32")
    dtypes = dict(x=x_dtype, weight="bfloat16", cos=td, sin=change.get("sin_dtype", td))
    rng = np.random.default_rng(0)
    arrays = {k: rng.standard_normal(s) + 2.0 for k, s in shapes.items()}
    with normkit.record_launches() as log, pytest.raises((ValueError, TypeError), match=message):
        _call(adapter, arrays, dtypes)
    assert not log, "a launch before the check"


def _call(adapter, arrays: dict, dtypes: dict):
    if adapter.name == "torch":
        import torch

        import torch_frontend as tf

        dt = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        a = {k: torch.from_numpy(v).to(dt[dtypes[k]]) for k, v in arrays.items()}
        return tf.rms_norm_rope(a["x"], a["weight"], a["cos"], a["sin"])
    import jax.numpy as jnp

    import jax_frontend as jf

    dt = {"float64": jnp.int32, "float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    a = {k: jnp.asarray(v.astype(np.float32)).astype(dt[dtypes[k]]) for k, v in arrays.items()}
    return jf.rms_norm_rope(a["x"], a["weight"], a["cos"], a["sin"], implementation=adapter.implementation)


# Property: random shapes, layouts, tables, pairings, dtypes and modes (Torch, and JAX's Pallas and XLA
# implementations; the JAX Triton path shares the Torch frontend's plans, while the Pallas launch maps
# x's rows to the tables' rows itself).

@st.composite
def cases(draw):
    return Case(B=draw(st.integers(1, 3)), S=draw(st.integers(1, 4)), H=draw(st.integers(1, 3)),
                D=2 * draw(st.integers(1, 12)), dtype=draw(st.sampled_from(("float32", "bfloat16", "float16"))),
                casting=draw(st.sampled_from(CASTINGS)), offset=draw(st.sampled_from((0.0, 1.0))),
                interleaved=draw(st.booleans()), transposed=draw(st.booleans()),
                table=draw(st.sampled_from(("batch", "shared"))), trained=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("name", [n for n in ("torch", "jax-pallas", "jax-xla") if n in ADAPTERS])
def test_property(name):
    @settings(max_examples={"torch": 12, "jax-pallas": 8}.get(name, 4), derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases())
    def prop(case):
        check(ADAPTERS[name], case)

    prop()


# ---------------------------------------------------------------------------------------------
# The reference itself, and the rotation's layouts, against HF's formulas.


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_is_hf_formula(interleaved):
    """The float64 reference (forward and both backwards) against HF's own formulas differentiated by
    torch's autograd, with tables that carry an attention scaling."""
    import torch

    case = Case(interleaved=interleaved, scale=1.3, offset=1.0, transposed=True)
    a = inputs(case)
    x = torch.tensor(a["x"], requires_grad=True)
    w = torch.tensor(a["weight"], requires_grad=True)
    cos, sin, d = (torch.tensor(a[k]) for k in ("cos", "sin", "dout"))
    D = case.D

    def rotate(t):
        if interleaved:
            return torch.stack((-t[..., 1::2], t[..., ::2]), -1).flatten(-2)
        return torch.cat((-t[..., D // 2:], t[..., : D // 2]), -1)

    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)
    out = y * cos + rotate(y) * sin
    out.backward(d)
    ref = reference.rms_norm_rope(a["x"], a["weight"], a["cos"], a["sin"], 1e-6, 1.0, interleaved)
    dx, dw = reference.rms_norm_rope_bwd(a["x"], a["weight"], a["cos"], a["sin"], a["dout"], 1e-6, 1.0, interleaved)
    np.testing.assert_allclose(ref, out.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dw, w.grad.numpy(), rtol=1e-10, atol=1e-10)
    o, rstd = norm_math.rms_norm_rope_forward(a["x"], a["weight"], a["cos"], a["sin"], eps=1e-6, offset=1.0,
                                              interleaved=interleaved)
    dx_out = norm_math.rms_norm_rope_output_backward(o, a["weight"], a["cos"], a["sin"], a["dout"], rstd, offset=1.0,
                                                     interleaved=interleaved)
    np.testing.assert_allclose(dx_out, x.grad.numpy(), rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_none_mode_is_hf_rope_in_x_dtype():
    """casting_mode="none": the rotation is HF's, operation by operation in x's dtype, on rms_norm's
    output: bitwise on CPU. "llama" (the rotation in fp32, rounded once) stays within one rounding
    of the pair's magnitude of HF's bf16 rotation of the llama-mode rms_norm."""
    import torch

    import torch_frontend as tf

    case = Case(dtype="bfloat16", transposed=True)
    a = inputs(case)
    x = torch.tensor(a["x"]).to(torch.bfloat16)
    w = torch.tensor(a["weight"]).to(torch.bfloat16)
    cos, sin = (torch.tensor(a[k]).to(torch.bfloat16) for k in ("cos", "sin"))
    D = case.D
    rotate = lambda t: torch.cat((-t[..., D // 2:], t[..., : D // 2]), -1)  # noqa: E731
    for mode in ("none", "llama"):
        y = tf.rms_norm(x, w, casting_mode=mode)
        hf = y * cos + rotate(y) * sin
        out = tf.rms_norm_rope(x, w, cos, sin, casting_mode=mode)
        if mode == "none":
            assert torch.equal(out, hf)
        else:
            units = _pair_units(y.double().numpy(), False)
            err = np.abs(out.double().numpy() - hf.double().numpy()) / units
            assert err.max() <= 2.0 ** -7, err.max()


def test_row_layout_groups_in_memory_order():
    """x [B, H, S, D] viewed from a [B, S, H, D] buffer, with a [1, 1, S, D] table: three indices (B, S, H)
    in memory order; contiguous x with a [B, S, 1, D] table: (B S) merged, then H."""
    B, S, H, D = 2, 3, 4, 8
    x_t = (S * H * D, D, H * D)  # the transposed view's row strides
    table = rope.broadcast_strides((1, 1, S, D), (S * D, S * D, D, 1), (B, H, S, D))[:-1]
    layout = rope.row_layout((B, H, S), x_t, table)
    assert layout.rows == (B, S, H) and layout.strides(x_t) == (S * H * D, H * D, D)
    assert layout.strides(table) == (0, D, 0)
    table = rope.broadcast_strides((B, S, 1, D), (S * D, D, D, 1), (B, S, H, D))[:-1]
    layout = rope.row_layout((B, S, H), (S * H * D, H * D, D), table)
    assert layout.rows == (1, B * S, H) and layout.strides(table) == (0, D, 0)


def _bad_pair(case: Case, a: dict) -> dict:
    """Column 0's weight 0.1, its partner's 1: a pair ratio of 10 (above ROPE_PAIR_RATIO)."""
    a["weight"][0], a["weight"][1 if case.interleaved else case.D // 2] = 0.1, 1.0
    return a


def test_pair_ratio_keeps_the_input(adapter):
    """A frozen weight whose rotation pair differs by more than ROPE_PAIR_RATIO: "auto" keeps x (the
    weight's values are read), "output" raises naming the pair."""
    case = Case(D=8, trained=False, interleaved=True)
    a = _bad_pair(case, inputs(case))
    assert not expected_from_output(case, a)
    run = adapter.run(case, a)
    assert not _flags(run.log, "bwd")["FROM_Y"]
    with pytest.raises(ValueError, match="rotation pair"):
        adapter.run(dataclasses.replace(case, save="output"), a)


@pytest.mark.skipif(not HAS_JAX, reason="needs jax")
@pytest.mark.parametrize("implementation", [n.removeprefix("jax-") for n in ADAPTERS if n.startswith("jax-")])
def test_traced_unsafe_weight_poisons_dx(implementation):
    """Under jit the weight's values are unseen: the traced rule keeps the output, and the forward's
    recovery is poisoned where the pair ratio turns out too large, so dx is NaN (loud), never quietly
    imprecise; a safe weight gives the reference's dx."""
    import jax
    import jax.numpy as jnp

    import jax_frontend as jf

    case = Case(D=8, trained=False)
    for bad in (False, True):
        a = inputs(case)
        if bad:
            a = _bad_pair(case, a)
        x, w, cos, sin, d = (jnp.asarray(a[k], jnp.float32) for k in ("x", "weight", "cos", "sin", "dout"))

        def f(x, w):
            return jf.rms_norm_rope(x, jf.freeze(w, False), cos, sin, implementation=implementation)

        with normkit.record_launches() as log:
            _, vjp = jax.vjp(jax.jit(f), x, w)
            dx, dw = vjp(d)
        assert _flags(log, "bwd")["FROM_Y"] and not np.any(np.asarray(dw))
        if bad:
            assert np.all(np.isnan(np.asarray(dx)))
        else:
            ref, _ = reference.rms_norm_rope_bwd(a["x"], a["weight"], a["cos"], a["sin"], a["dout"])
            assert_close(np.asarray(dx, np.float64), ref, "float32", "dx")


@pytest.mark.skipif(not HAS_JAX, reason="needs jax")
@pytest.mark.parametrize("case", [
    Case(B=2, S=5, H=4, D=16, dtype="bfloat16", transposed=True),
    # the other pairing and table layout with a head dimension of masked columns: the slow tier (the
    # default run meets them in Pallas's dW on the default grid, test_pallas_accesses_stay_inside_the_arrays)
    pytest.param(Case(B=2, S=5, H=4, D=24, interleaved=True, casting="none", table="shared"), marks=pytest.mark.slow),
], ids=str)
def test_pallas_dw_programs_walk_several_tiles(case, monkeypatch):
    """dW through a grid of fewer programs than tiles, each walking several tiles with the next one
    prefetched (the last prefetch past the rows, masked), as on a GPU with many more rows than SMs:
    the reference's values, bitwise reproducible."""
    from jax_frontend import _pallas

    monkeypatch.setattr(_pallas, "NUM_SMS", 1)  # 40 rows, tiles of 16: 2 programs, 2 tiles each
    adapter = ADAPTERS["jax-pallas"]
    check(adapter, case)
    a = inputs(case)
    first, second = adapter.run(case, a), adapter.run(case, a)
    (bwd,) = first.log.of("rms_norm_rope_bwd_kernel")
    assert bwd.flags["TILES_PER_PROGRAM"] > 1 and bwd.grid[0] > 1 and bwd.flags["COMPUTE_DW"], bwd
    for name in ("out", "dx", "dw"):
        assert np.array_equal(getattr(first, name), getattr(second, name)), name


@pytest.mark.skipif(not HAS_JAX, reason="needs jax")
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_jax_vmap(implementation):
    """vmap over a batch of x, the weight and the tables shared (the Triton implementation has no
    batching rule): each element's output and dx as one call per element gives them, dW their sum."""
    import jax
    import jax.numpy as jnp

    import jax_frontend as jf

    case = Case(B=1, D=8, table="shared")
    batch = [inputs(dataclasses.replace(case, seed=i)) for i in range(2)]
    x, ct = (jnp.asarray(np.stack([a[k] for a in batch]), jnp.float32) for k in ("x", "dout"))
    w, cos, sin = (jnp.asarray(batch[0][k], jnp.float32) for k in ("weight", "cos", "sin"))

    def f(x, w):
        return jf.rms_norm_rope(x, w, cos, sin, implementation=implementation)

    out, vjp = jax.vjp(jax.vmap(f, in_axes=(0, None)), x, w)
    dx, dw = vjp(ct)
    dw_sum = 0.0
    for i in range(len(batch)):
        out_i, vjp_i = jax.vjp(f, x[i], w)
        dx_i, dw_i = vjp_i(ct[i])
        dw_sum = dw_sum + np.asarray(dw_i, np.float64)
        for name, a, b in (("out", out[i], out_i), ("dx", dx[i], dx_i)):
            assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), "float32", f"{name}[{i}]")
    assert_close(np.asarray(dw, np.float64), dw_sum, "float32", "dw", reduced_over=int(np.prod(x.shape[:-1])))


@pytest.mark.skipif(not HAS_JAX, reason="needs jax")
@pytest.mark.parametrize("implementation", [n.removeprefix("jax-") for n in ADAPTERS if n.startswith("jax-")])
def test_jax_empty_rows(implementation):
    """No rows: empty results of x's shape, zero dW, nothing launched by the kernel implementations."""
    import jax
    import jax.numpy as jnp

    import jax_frontend as jf

    D = 8
    x, w, table = jnp.zeros((2, 0, 3, D), jnp.float32), jnp.ones((D,), jnp.float32), jnp.ones((1, 1, 3, D))
    with normkit.record_launches() as log:
        out, vjp = jax.vjp(lambda x, w: jf.rms_norm_rope(x, w, table, table, implementation=implementation), x, w)
        dx, dw = vjp(out)
    assert out.shape == dx.shape == x.shape and dw.shape == (D,) and not np.any(np.asarray(dw))
    assert implementation == "xla" or not log, log.kernels()


@pytest.mark.skipif(not HAS_JAX, reason="needs jax")
@pytest.mark.parametrize("implementation", [n.removeprefix("jax-") for n in ADAPTERS if n.startswith("jax-")])
def test_jax_attention_keeps_no_normalized_q_or_k(implementation):
    """A QK-norm attention block under ``jax.vjp`` (trained q/k/v projections, a frozen norm weight
    closed over, then attention, which keeps the rotated q and k for its own backward): with
    save="auto" the only q- or k-shaped residuals are the rotated q and k themselves, so the fused op
    keeps nothing of its own; save="input" keeps the projections' q and k as well. Under jit alike,
    and the gradients of both agree."""
    import jax
    import jax.numpy as jnp

    import jax_frontend as jf
    from tests.harness import residuals_of_shape

    B, S, H, D, C = 2, 4, 2, 8, 16
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((B, S, C)), jnp.float32)
    wq, wk = (jnp.asarray(rng.standard_normal((C, H * D)) / 4, jnp.float32) for _ in range(2))
    wv = jnp.asarray(rng.standard_normal((C, H * 3)) / 4, jnp.float32)  # v's heads 3 wide: no q-shaped v
    norm_w = jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32)
    table = inputs(Case(B=B, S=S, H=1, D=D))  # [B, S, 1, D] tables, broadcast over the heads
    cos, sin = (jnp.asarray(table[k], jnp.float32) for k in ("cos", "sin"))

    def block(x, wq, wk, wv, save):
        q = (x @ wq).reshape(B, S, H, D)
        k = (x @ wk).reshape(B, S, H, D)
        v = (x @ wv).reshape(B, S, H, 3)
        q, k = (jf.rms_norm_rope(t, norm_w, cos, sin, save=save, implementation=implementation) for t in (q, k))
        p = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(D), axis=-1)
        return (jnp.einsum("bhst,bthe->bshe", p, v) ** 2).sum()

    args = (x, wq, wk, wv)
    for how, wrap in (("plain", lambda f: f), ("jit", jax.jit)):
        kept = {save: residuals_of_shape(wrap(lambda *a, save=save: block(*a, save)), args, (B, S, H, D))
                for save in ("auto", "input")}
        assert len(kept["auto"]) == 2 and len(kept["input"]) == 4, (how, kept)
    grads = {save: jax.jit(jax.grad(lambda *a: block(*a, save), argnums=(0, 1, 2, 3)))(*args)
             for save in ("auto", "input")}
    for name, g_auto, g_input in zip(("x", "wq", "wk", "wv"), grads["auto"], grads["input"]):
        assert_close(np.asarray(g_auto, np.float64), np.asarray(g_input, np.float64), "float32", name)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_torch_strided_slice_and_empty_rows():
    """q as a slice of a fused qkv projection ([B, S, 3 H D] viewed [B, S, H, D], then transposed): read
    in place; the output dense in x's dimension order. No rows: empty results, zero dW."""
    import torch

    import torch_frontend as tf

    B, S, H, D = 2, 3, 2, 8
    rng = np.random.default_rng(1)
    qkv = torch.tensor(rng.standard_normal((B, S, 3 * H * D)), dtype=torch.float32)
    leaf = qkv.requires_grad_(True)
    q = leaf[..., : H * D].view(B, S, H, D).transpose(1, 2)
    w = torch.tensor(rng.uniform(0.5, 1.5, D), dtype=torch.float32, requires_grad=True)
    theta = torch.tensor(rng.uniform(-4, 4, (1, 1, S, D // 2)))
    cos, sin = (f(torch.cat([theta, theta], -1)).float() for f in (torch.cos, torch.sin))
    d = torch.tensor(rng.standard_normal((B, H, S, D)), dtype=torch.float32)
    with poisoned_outputs():
        out = tf.rms_norm_rope(q, w, cos, sin)
        out.backward(d)
    a = {"x": q.detach().double().numpy(), "weight": w.detach().double().numpy(), "cos": cos.double().numpy(),
         "sin": sin.double().numpy()}
    assert_close(out.detach().numpy(), reference.rms_norm_rope(a["x"], a["weight"], a["cos"], a["sin"]), "float32", "out")
    dx, dw = reference.rms_norm_rope_bwd(a["x"], a["weight"], a["cos"], a["sin"], d.double().numpy())
    assert_close(leaf.grad[..., : H * D].view(B, S, H, D).transpose(1, 2).numpy(), dx, "float32", "dx")
    assert not leaf.grad[..., H * D:].any()
    assert_close(w.grad.numpy(), dw, "float32", "dw", reduced_over=B * S * H)
    assert out.stride() == (S * H * D, D, H * D, 1)  # a [B, S, H, D] buffer, seen as x is
    x0 = torch.zeros((2, 0, 3, D), requires_grad=True)
    w0 = torch.ones(D, requires_grad=True)
    out = tf.rms_norm_rope(x0, w0, cos[:, :, :1].expand(1, 1, 3, D)[:, :, :3], sin[:, :, :1].expand(1, 1, 3, D))
    out.sum().backward()
    assert out.shape == x0.shape and x0.grad.shape == x0.shape and not w0.grad.any()


def _rope_target(t, case: Case) -> str | None:
    """Which of rms_norm_rope's saved tensors ``t`` is, by its shape: "rows" (x, or the output it kept),
    "weight", "statistics" (rstd and the weight's recovery) or "tables" (cos and sin)."""
    M = case.B * case.S * case.H
    if tuple(t.shape) == case.shape:
        return "rows"
    if tuple(t.shape) == case.table_shape:
        return "tables"
    if t.dim() == 1:
        return "weight" if t.numel() == case.D else "statistics" if t.numel() in (M, case.D + 1) else None
    return None


HANDED_BACK = ("widened", "strided", "dense", "negated")  # what a saved-tensor hook's unpack hands back


def _handed_back(how: str, t):
    """``t``'s values as a hook might hand them back: in float64, with every stride doubled (the last
    dimension's too), copied dense, or as a lazily negated view of its negation."""
    import torch

    if how == "widened":
        return t.double()
    if how == "strided":
        return torch.stack([t, t], -1)[..., 0]
    if how == "dense":
        return t.contiguous()
    return torch._neg_view(-t)


HOOK_TARGETS = ("rows", "weight", "statistics", "tables")  # which saved tensor the unpack hands back changed
HOOK_WAYS = [(when, trained) for when in ("hooks_active", "registered_after") for trained in (False, True)]


def _hook_params():
    """Every target, handed-back kind, way of hooking and frozen or trained weight. The default run
    takes each (target, handed-back kind) once, the way and the weight rotating (a Latin square: each
    target and each kind meets both ways, frozen and trained); the others are the slow tier."""
    return [pytest.param(trained, target, handed_back, when,
                         id=f"{'trained' if trained else 'frozen'}-{target}-{handed_back}-{when}",
                         marks=() if HOOK_WAYS[(t + h) % len(HOOK_WAYS)] == (when, trained) else pytest.mark.slow)
            for when, trained in HOOK_WAYS for h, handed_back in enumerate(HANDED_BACK)
            for t, target in enumerate(HOOK_TARGETS)]


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.filterwarnings("ignore::torch_frontend.NormkitCopyWarning")
@pytest.mark.parametrize("trained,target,handed_back,when", _hook_params())
def test_torch_saved_tensor_hooks(trained, target, handed_back, when):
    """A saved-tensor hook hands the backward one kind of saved tensor in another dtype, layout or as a
    negated view, either as a ``saved_tensors_hooks`` context around the forward or registered after it
    on the node's ``grad_fn._raw_saved_tensors``. The same call signature ran plainly first, so its
    backward plans are cached: the hooked call's gradients must still match the float64 reference."""
    import torch

    import torch_frontend as tf

    case = Case(B=2, S=3, H=2, D=8, dtype="bfloat16", transposed=True, table="batch", trained=trained)
    a = inputs(case)

    def unpack(t):
        return _handed_back(handed_back, t) if _rope_target(t, case) == target else t

    def run(hooked: bool) -> Run:
        leaf = torch.from_numpy(np.ascontiguousarray(a["x"].swapaxes(1, 2))).to(torch.bfloat16).requires_grad_(True)
        w = torch.from_numpy(a["weight"]).to(torch.bfloat16).requires_grad_(trained)
        cos, sin = (torch.from_numpy(a[n]).to(torch.bfloat16) for n in ("cos", "sin"))
        hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack) if hooked and when == "hooks_active"
                 else contextlib.nullcontext())
        with poisoned_outputs(), hooks:
            out = tf.rms_norm_rope(leaf.transpose(1, 2), w, cos, sin, **case.kwargs)
        if hooked and when == "registered_after":
            for slot in out.grad_fn._raw_saved_tensors:
                try:
                    slot.register_hooks(lambda t: t, unpack)
                except RuntimeError as e:  # a slot saved as None
                    assert "value None" in str(e), e
        with poisoned_outputs():
            out.backward(torch.from_numpy(a["dout"]).to(torch.bfloat16))
        np64 = lambda v: None if v is None else v.detach().double().numpy()  # noqa: E731
        return Run(np64(out), np64(leaf.grad.transpose(1, 2)), np64(w.grad), [])

    run(False)  # the signature's plans, cached
    check_values(f"{target} {handed_back} {when}", case, a, run(True))


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_torch_saved_tensor_hook_of_another_shape_raises():
    """A hook that hands back the saved rows in another shape gets a clear error, not a misread."""
    import torch

    import torch_frontend as tf

    case = Case(B=2, S=3, H=2, D=8, trained=False)
    a = inputs(case)
    x = torch.from_numpy(a["x"]).float().requires_grad_(True)
    reshaped = lambda t: t.reshape(-1, case.D) if tuple(t.shape) == case.shape else t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, reshaped):
        out = tf.rms_norm_rope(x, torch.from_numpy(a["weight"]).float(), torch.from_numpy(a["cos"]).float(),
                               torch.from_numpy(a["sin"]).float())
    with pytest.raises(RuntimeError, match=r"the saved rows came back from its saved-tensor hook with shape \(12, 8\)"):
        out.backward(torch.from_numpy(a["dout"]).float())


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.parametrize("save", ["auto", "input"])
def test_torch_create_graph_then_a_second_backward_raises(save):
    """Under ``create_graph=True`` the first-order gradients are the float64 reference's; differentiating
    them again raises (no double backward), never a silent zero."""
    import torch

    import torch_frontend as tf

    B, S, H, D = 2, 3, 2, 8
    rng = np.random.default_rng(5)
    x = torch.tensor(rng.standard_normal((B, S, H, D)), dtype=torch.float32, requires_grad=True)
    w = torch.tensor(rng.uniform(0.5, 1.5, D), dtype=torch.float32)
    theta = torch.tensor(rng.uniform(-4, 4, (1, S, 1, D // 2)))
    cos, sin = (f(torch.cat([theta, theta], -1)).float() for f in (torch.cos, torch.sin))
    d = torch.tensor(rng.standard_normal((B, S, H, D)), dtype=torch.float32, requires_grad=True)
    with poisoned_outputs():
        (dx,) = torch.autograd.grad(tf.rms_norm_rope(x, w, cos, sin, save=save), x, d, create_graph=True)
    a = {k: v.detach().double().numpy() for k, v in (("x", x), ("weight", w), ("cos", cos), ("sin", sin))}
    ref, _ = reference.rms_norm_rope_bwd(a["x"], a["weight"], a["cos"], a["sin"], d.detach().double().numpy())
    assert_close(dx.detach().numpy(), ref, "float32", "dx")
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.sum().backward()


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.parametrize("trained", [False, True])
def test_torch_attention_gradient_read_in_place(trained, monkeypatch):
    """HF's layout: x the [B, H, S, D] transpose of a [B, S, H, D] projection, cos/sin [B, 1, S, D], and
    the output's gradient [B, H, S, D] contiguous, as attention's backward hands it. The forward merges
    B and S into one row index, which dy does not fit; the backward then groups the rows its own way
    and reads dy in place (no copy), with dx and dW as the float64 reference's."""
    import torch

    import torch_frontend as tf

    B, S, H, D = 2, 5, 3, 8
    rng = np.random.default_rng(11)
    leaf = torch.tensor(rng.standard_normal((B, S, H, D)), dtype=torch.float32, requires_grad=True)
    w = torch.tensor(rng.uniform(0.5, 1.5, D), dtype=torch.float32, requires_grad=trained)
    theta = torch.tensor(rng.uniform(-4, 4, (B, 1, S, D // 2)))
    cos, sin = (f(torch.cat([theta, theta], -1)).float() for f in (torch.cos, torch.sin))
    d = torch.tensor(rng.standard_normal((B, H, S, D)), dtype=torch.float32)
    x = leaf.transpose(1, 2)
    copies = []
    with poisoned_outputs():
        out = tf.rms_norm_rope(x, w, cos, sin)
        with monkeypatch.context() as m:
            for name in ("copy_", "contiguous", "clone"):
                m.setattr(torch.Tensor, name, lambda self, *a, _f=getattr(torch.Tensor, name), **k:
                          copies.append(tuple(self.shape)) or _f(self, *a, **k))
            out.backward(d)
    assert copies == []
    a = {k: v.detach().double().numpy() for k, v in (("x", x), ("weight", w), ("cos", cos), ("sin", sin))}
    dx, dw = reference.rms_norm_rope_bwd(a["x"], a["weight"], a["cos"], a["sin"], d.double().numpy())
    assert_close(leaf.grad.transpose(1, 2).numpy(), dx, "float32", "dx")
    if trained:
        assert_close(w.grad.numpy(), dw, "float32", "dw", reduced_over=B * S * H)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_torch_decides_once_per_weight_version(monkeypatch):
    """The frozen weight's values are read (``norm_math.rope_unsafe_reason``, a host synchronization)
    once per version of it, not per call; an in-place write to the weight makes the next call read it
    again."""
    import torch

    import torch_frontend as tf
    from normkit import norm_math

    reads = []
    real = norm_math.rope_unsafe_reason
    monkeypatch.setattr(norm_math, "rope_unsafe_reason", lambda *a, **k: reads.append(1) or real(*a, **k))
    case = Case(D=8, trained=False)
    a = inputs(case)
    w = torch.tensor(a["weight"], dtype=torch.float32)
    cos, sin = (torch.tensor(a[k], dtype=torch.float32) for k in ("cos", "sin"))

    def dx():
        x = torch.tensor(a["x"], dtype=torch.float32, requires_grad=True)
        return torch.autograd.grad(tf.rms_norm_rope(x, w, cos, sin), x, torch.tensor(a["dout"], dtype=torch.float32))[0]

    first = dx()
    for _ in range(3):
        assert torch.equal(dx(), first)
    assert len(reads) == 1
    with torch.no_grad():
        w.mul_(1.0)  # the same values, a new version
    assert torch.equal(dx(), first) and len(reads) == 2


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_torch_weight_written_behind_the_version_counter():
    """A frozen weight zeroed in one column through ``.data`` (the version counter does not see it)
    after a call decided to keep the output: the next call's forward finds the weight unsafe in its
    recovery, so that call's dx is NaN everywhere, never wrong, and flags it; the call after it reads
    the weight again, keeps x, and gives save="input"'s dx exactly."""
    import torch

    import torch_frontend as tf

    case = Case(D=8, trained=False)
    a = inputs(case)
    w = torch.tensor(a["weight"], dtype=torch.float32)
    cos, sin = (torch.tensor(a[k], dtype=torch.float32) for k in ("cos", "sin"))

    def dx(save="auto"):
        x = torch.tensor(a["x"], dtype=torch.float32, requires_grad=True)
        out = tf.rms_norm_rope(x, w, cos, sin, save=save)
        return torch.autograd.grad(out, x, torch.tensor(a["dout"], dtype=torch.float32))[0]

    dx()  # decides: the output
    version = w._version
    w.data[3] = 0.0
    assert w._version == version
    assert dx().isnan().all()
    assert torch.equal(dx(), dx(save="input"))


# ---------------------------------------------------------------------------------------------
# Tables that are not rotations: the output-saving backward cannot rotate the output back accurately
# where a pair's 2 x 2 matrix is ill-conditioned (norm_math.ROPE_TABLE_RATIO). Such rows get NaN dx,
# never a wrong one; Torch's forward flags them and the next call warns and keeps x; JAX keeps x where
# it reads the tables, and under jit relies on the NaN rows.


def _hf_tables(positions: int, D: int, dtype: str, scale: float, interleaved: bool):
    """HF's rotary tables (base 10000, positions 0 .. positions - 1) times ``scale``, rounded to dtype."""
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, D, 2) / D)
    theta = np.arange(positions)[:, None] * inv_freq[None, :]
    theta = np.repeat(theta, 2, axis=-1) if interleaved else np.concatenate([theta, theta], axis=-1)
    return rounded(np.cos(theta) * scale, dtype), rounded(np.sin(theta) * scale, dtype)


@pytest.mark.parametrize("interleaved", [False, True])
def test_table_check_passes_rotations_and_fails_unrelated_angles(interleaved):
    """ROPE_TABLE_RATIO bounds the pair matrix's condition number by 2 (diag(1, 2) sits on the boundary);
    HF's tables, rounded to fp32, bf16 or fp16, with or without an attention scaling, pass in every pair
    (in fp32 as the kernels compute, and in float64); tables with an angle per column fail somewhere."""
    r = norm_math.ROPE_TABLE_RATIO
    assert (1 + np.sqrt(1 - r * r)) / r == pytest.approx(2.0)
    assert reference.rope_table_ratio(np.array([1.0, 2.0]), np.zeros(2), interleaved) == pytest.approx([r, r])
    for dtype in ("float32", "bfloat16", "float16"):
        for scale in (1.0, 1.2):
            cos, sin = _hf_tables(4096, 128, dtype, scale, interleaved)
            assert not reference.rope_table_rows(cos, sin, cos.shape, interleaved).any(), (dtype, scale)
            c32, s32 = cos.astype(np.float32), sin.astype(np.float32)
            assert norm_math.rope_table_usable(c32, s32, interleaved=interleaved).all(), (dtype, scale)
            assert norm_math.rope_table_unsafe_reason(c32, s32, x_dtype=dtype, casting=norm_math.Casting.INPUT_DTYPE,
                                                      interleaved=interleaved) is None
    theta = np.random.default_rng(0).uniform(-4.0, 4.0, (16, 16))
    cos, sin = np.cos(theta), np.sin(theta)
    assert reference.rope_table_rows(cos, sin, cos.shape, interleaved).any()
    assert "not a rotation" in norm_math.rope_table_unsafe_reason(cos, sin, x_dtype="float32", interleaved=interleaved)


def _bad_rows(case: Case, a: dict) -> np.ndarray:
    """The rows of x whose tables fail the pair check (``reference.rope_table_rows``), as x is laid out."""
    return reference.rope_table_rows(a["cos"], a["sin"], case.shape, case.interleaved, case.dtype,
                                     CASTING_MODES[case.casting])


def _near_boundary(case: Case, a: dict) -> bool:
    """Whether a pair's ratio lies so near ROPE_TABLE_RATIO that fp32 and float64 may judge it apart."""
    r = reference.rope_table_ratio(a["cos"], a["sin"], case.interleaved)
    return bool(np.any(np.abs(r - norm_math.ROPE_TABLE_RATIO) < 1e-3))


def check_poisoned_rows(name: str, case: Case, a: dict, run: Run, bad: np.ndarray) -> None:
    """out against the reference; dx NaN on exactly the rows ``bad`` (all of each), the reference's elsewhere."""
    nan = np.isnan(run.dx)
    assert np.array_equal(nan.any(axis=-1), bad) and np.array_equal(nan.all(axis=-1), bad), \
        f"{name} {case}: NaN rows {nan.any(axis=-1).astype(int).tolist()}, failing rows {bad.astype(int).tolist()}"
    dx, _ = reference.rms_norm_rope_bwd(a["x"], a["weight"], a["cos"], a["sin"], a["dout"], 1e-6, case.offset,
                                        case.interleaved)
    check_values(name, case, a, dataclasses.replace(run, dx=np.where(bad[..., None], dx, run.dx)))


def _tables_warning():
    import torch_frontend as tf

    return pytest.warns(tf.NormkitRopeTablesWarning, match="cos/sin .* not a rotation.*NaN dx.*save='input'")


def _torch_tables_case(adapter, case: Case, a: dict) -> None:
    """Torch eager: the first call keeps the output; failing rows NaN, the rest right. Where any row
    failed, the next call warns, keeps x (from then on) and is right everywhere; else nothing is flagged."""
    from torch_frontend import _bound

    from_output = expected_from_output(case, a)
    bad = _bad_rows(case, a) if from_output else np.zeros(case.shape[:-1], bool)
    run = adapter.run(case, a)
    check_poisoned_rows(adapter.name, case, a, run, bad)
    assert run.saved_x == (not from_output)
    if bad.any():
        with _tables_warning():
            run = adapter.run(case, a)
        assert _bound.ROPE_TABLES_KEEP_X and run.saved_x and not _flags(run.log, "bwd")["FROM_Y"]
        check_values(adapter.name, case, a, run)
    else:
        assert not _bound.rope_tables_state_set()


def _jax_tables_case(adapter, case: Case, a: dict) -> None:
    """JAX eager (the tables' values read): right, x kept where a row fails; under jit (the tables and the
    weight traced): the output kept where the traced rule says so, failing rows then NaN, the rest right."""
    import jax
    import jax.numpy as jnp

    import jax_frontend as jf
    from tests.harness import residuals_of_shape

    from_output = expected_from_output(case, a)
    bad = _bad_rows(case, a) if from_output else np.zeros(case.shape[:-1], bool)
    run = adapter.run(case, a)
    check_values(adapter.name, case, a, run)
    assert bool(_flags(run.log, "bwd")["FROM_Y"]) == (from_output and not bad.any())
    dts = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    x, w, d = (jnp.asarray(a[k], jnp.float32).astype(dts[case.dtype]) for k in ("x", "weight", "dout"))
    cos, sin = (jnp.asarray(a[k], jnp.float32).astype(dts[case.table_dtype or case.dtype]) for k in ("cos", "sin"))

    def call(x, c, s):
        return jf.rms_norm_rope(x, w, c, s, implementation=adapter.implementation, **case.kwargs)

    kept_x = [line for line in residuals_of_shape(lambda x: call(x, cos, sin), (x,), case.shape)
              if "from the argument" in line]
    assert bool(kept_x) == (not from_output or bad.any()), kept_x
    jitted = jax.jit(call)
    with normkit.record_launches() as log, poisoned_outputs():
        out, vjp = jax.vjp(lambda x: jitted(x, cos, sin), x)
        (dx,) = vjp(d)
    traced_output = saving.traced_rule(has_bias=False, offset=case.offset, x_dtype=case.dtype)  # values unseen
    assert bool(_flags(log, "bwd")["FROM_Y"]) == traced_output
    bad = _bad_rows(case, a) if traced_output else np.zeros(case.shape[:-1], bool)
    np64 = lambda v: np.asarray(jnp.asarray(v, jnp.float32), np.float64)  # noqa: E731
    check_poisoned_rows(f"{adapter.name} jit", case, a, Run(np64(out), np64(dx), None, []), bad)


def check_tables(adapter, case: Case) -> None:
    a = inputs(case)
    if _near_boundary(case, a):
        return
    (_torch_tables_case if adapter.name == "torch" else _jax_tables_case)(adapter, case, a)


@st.composite
def table_cases(draw):
    # (the first of each choice is what hypothesis's simplest example takes: mixed tables, 16-bit x)
    return Case(B=draw(st.integers(1, 2)), S=draw(st.integers(2, 4)), H=draw(st.integers(1, 2)),
                D=2 * draw(st.integers(2, 6)), dtype=draw(st.sampled_from(("bfloat16", "float16", "float32"))),
                casting=draw(st.sampled_from(CASTINGS)), offset=draw(st.sampled_from((0.0, 1.0))),
                interleaved=draw(st.booleans()), transposed=draw(st.booleans()),
                table=draw(st.sampled_from(("batch", "shared"))), trained=False,
                scale=draw(st.sampled_from((1.0, 1.2))), tables=draw(st.sampled_from(("mixed", "rotary", "mixed"))),
                seed=draw(st.integers(0, 2**16)))


def _tables_property(name: str, examples: int) -> None:
    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=table_cases())
    def prop(case):
        if HAS_TORCH:
            from torch_frontend import _bound

            _bound.reset()  # each example from a fresh process state
        check_tables(ADAPTERS[name], case)

    prop()


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_tables_property(name):
    """Frozen weight, save="auto", HF-style tables (possibly scaled) or tables with rows that are not
    rotations, in fp32, bf16 and fp16, every frontend and implementation: never a wrong dx
    (``check_tables``)."""
    _tables_property(name, {"torch": 10}.get(name, 4))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_tables_property_exhaustive(name):
    _tables_property(name, {"torch": 60}.get(name, 25))


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.parametrize("weight", [True, False])
def test_torch_tables_trip_then_keeps_x(weight):
    """A frozen weight (or none) and tables with one position not a rotation: the first call's dx is NaN
    on that position's rows only; the next warns, keeps x and matches save="input" exactly; the switch
    holds for other tables too; save="output" keeps the output and the NaN rows (and warns again);
    ``_bound.reset()`` turns the switch off."""
    import torch

    import torch_frontend as tf
    from torch_frontend import _bound

    case = Case(D=8, trained=False, table="shared", S=3)
    a = inputs(case)
    a["cos"][1, 0, 1], a["sin"][1, 0, 1] = 1.0, 0.0  # position 1: column 1 at angle 0, its partner at pi/2
    a["cos"][1, 0, 5], a["sin"][1, 0, 5] = 0.0, 1.0
    bad = _bad_rows(case, a)
    assert bad[:, 1].all() and not bad[:, [0, 2]].any()
    w = torch.tensor(a["weight"], dtype=torch.float32) if weight else None
    cos, sin = (torch.tensor(a[k], dtype=torch.float32) for k in ("cos", "sin"))

    def dx(save="auto", c=cos, s=sin):
        x = torch.tensor(a["x"], dtype=torch.float32, requires_grad=True)
        with normkit.record_launches() as log:
            out = tf.rms_norm_rope(x, w, c, s, save=save)
            g = torch.autograd.grad(out, x, torch.tensor(a["dout"], dtype=torch.float32))[0]
        return g, _flags(log, "bwd")["FROM_Y"]

    first, from_y = dx()
    assert from_y and np.array_equal(first.isnan().all(-1).numpy(), bad)
    assert not first[torch.tensor(~bad)].isnan().any()
    with _tables_warning():
        second, from_y = dx()
    assert not from_y and torch.equal(second, dx("input")[0])
    hf = inputs(dataclasses.replace(case, seed=1))
    assert not dx(c=torch.tensor(hf["cos"], dtype=torch.float32), s=torch.tensor(hf["sin"], dtype=torch.float32))[1]
    out, from_y = dx("output")
    assert from_y and np.array_equal(out.isnan().all(-1).numpy(), bad)
    with _tables_warning():
        dx("output")
    _bound.reset()
    assert dx(c=torch.tensor(hf["cos"], dtype=torch.float32), s=torch.tensor(hf["sin"], dtype=torch.float32))[1]


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_torch_weight_trip_and_tables_trip_are_told_apart(monkeypatch):
    """The weight's trip (a write torch does not version) re-reads the weight, no warning, the switch
    off; the tables' trip warns and turns the switch on, the weight's remembered choice not re-read."""
    import torch

    import torch_frontend as tf
    from torch_frontend import _bound

    reads = []
    real = norm_math.rope_unsafe_reason
    monkeypatch.setattr(norm_math, "rope_unsafe_reason", lambda *a, **k: reads.append(1) or real(*a, **k))
    case = Case(D=8, trained=False)
    a = inputs(case)
    w = torch.tensor(a["weight"], dtype=torch.float32)
    cos, sin = (torch.tensor(a[k], dtype=torch.float32) for k in ("cos", "sin"))

    def dx(c=cos, s=sin):
        x = torch.tensor(a["x"], dtype=torch.float32, requires_grad=True)
        return torch.autograd.grad(tf.rms_norm_rope(x, w, c, s), x, torch.tensor(a["dout"], dtype=torch.float32))[0]

    dx()
    w.data[3] = 0.0
    assert dx().isnan().all()
    dx()  # the weight's trip: read again, x kept (a warning would raise: the error filter)
    assert len(reads) == 2 and not _bound.rope_tables_state_set()
    w.data[3] = 1.0
    with torch.no_grad():
        w.mul_(1.0)  # a new version: read again, the output kept
    bad = cos.clone(), sin.clone()  # column 0 at angle 0, its partner (column 4) at pi/2: det 0, every row
    bad[0][..., 0], bad[1][..., 0], bad[0][..., 4], bad[1][..., 4] = 1.0, 0.0, 0.0, 1.0
    assert dx(*bad).isnan().all() and len(reads) == 3
    with _tables_warning():
        dx(*bad)
    assert _bound.ROPE_TABLES_KEEP_X and len(reads) == 3


# ---------------------------------------------------------------------------------------------
# torch.compile: traced as torch operations (no graph break), against the reference and eager.

COMPILED_CASES = [  # CPU Inductor compiles slowly: two cases; aot_eager runs the same graph for the rest
    ("inductor", Case(D=8, trained=False, transposed=True)),  # frozen: the output-saving route
    ("inductor", Case(D=8, casting="gemma", offset=1.0)),  # trained: dW
    ("aot_eager", Case(D=8, dtype="bfloat16", trained=False, casting="gemma", offset=1.0, transposed=True,
                       table="shared")),
    ("aot_eager", Case(D=8, dtype="bfloat16", casting="none", interleaved=True, table_dtype="float32")),
    ("aot_eager", Case(D=8, dtype="float16", trained=False, save="input")),
]


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compile stack warns about its own internals
@pytest.mark.parametrize("backend, case", COMPILED_CASES, ids=lambda v: str(v))
def test_torch_compile_matches_reference_and_eager(backend, case):
    """Compiled with fullgraph=True (a graph break raises): the kernels run through the custom ops (a
    forward and a backward launch, and dW's reduction where trained); out, dx and dW as the float64
    reference's and the eager kernels' within the tolerance table."""
    import torch

    torch._dynamo.reset()
    a = inputs(case)
    run = TorchCompiledAdapter(backend).run(case, a)
    want = ["rms_norm_rope_fwd_kernel", "rms_norm_rope_bwd_kernel"] + (["partial_sum_kernel"] if case.trained else [])
    assert run.log.kernels() == want, run.log.kernels()
    check_values(f"torch-compile-{backend}", case, a, run)
    eager = TorchAdapter().run(case, a)
    tol = coarser(case.dtype, case.table_dtype or case.dtype)
    units = _pair_units(reference.rms_norm(a["x"], a["weight"], 1e-6, case.offset), case.interleaved)
    assert_close(run.out / units, eager.out / units, tol, "compiled vs eager: out (in units of its pair)")
    assert_close(run.dx, eager.dx, tol, "compiled vs eager: dx")
    if case.trained:
        assert_close(run.dw, eager.dw, tol, "compiled vs eager: dw", reduced_over=int(np.prod(case.shape[:-1])))
    torch._dynamo.reset()


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torch_compiled_tables_trip_then_keeps_x():
    """Compiled, the tables are checked by the forward as in eager: the first call's failing rows get NaN
    dx and the custom op's forward reads the flag (warning); the switch it sets is guarded on, so the
    next call is traced again and keeps x, right everywhere."""
    import torch

    torch._dynamo.reset()
    case = Case(D=8, trained=False, tables="mixed", seed=3)
    a = inputs(case)
    bad = _bad_rows(case, a)
    assert bad.any() and not bad.all()
    with _tables_warning():
        run = TorchCompiledAdapter("aot_eager").run(case, a)
    assert _flags(run.log, "bwd")["FROM_Y"]
    check_poisoned_rows("torch-compile", case, a, run, bad)
    run = TorchCompiledAdapter("aot_eager").run(case, a)
    assert not _flags(run.log, "bwd")["FROM_Y"]
    check_values("torch-compile", case, a, run)
    torch._dynamo.reset()


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torch_compiled_unsafe_weight_poisons_dx():
    """Compiled, the weight's values are unseen: a frozen weight keeps the output under "auto" (the
    traced rule) and the recovery is poisoned where the pair ratio turns out too large, so dx is NaN;
    save="input" keeps x and gives the reference's dx."""
    import torch

    torch._dynamo.reset()
    case = Case(D=8, trained=False)
    a = _bad_pair(case, inputs(case))
    dx_ref, _ = reference.rms_norm_rope_bwd(a["x"], a["weight"], a["cos"], a["sin"], a["dout"])
    assert np.all(np.isnan(TorchCompiledAdapter("aot_eager").run(case, a).dx))
    run = TorchCompiledAdapter("aot_eager").run(dataclasses.replace(case, save="input"), a)
    assert_close(run.dx, dx_ref, "float32", "dx")
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# The Pallas kernels' memory accesses: on GPU an access past an array is an illegal address (the
# process aborts), while interpret mode clamps a gather's indices and drops a scatter's, so a missing
# mask would pass every value test on CPU. Here every masked load and store of the rope kernels (and
# of the dW partial sum) is checked, in interpret mode, against the extent of the array it addresses
# (a block past the array's end counts only its part inside the array): each index the mask keeps
# must lie inside.


def _access_checker(monkeypatch):
    """Instrument Pallas-Triton's masked load/store and ``pallas_call``; returns the list that collects
    ``(load/store, kernel#ref, number of out-of-bounds kept lanes)``."""
    import jax
    import jax.numpy as jnp
    from jax._src.state import indexing
    from jax._src.state.types import TransformedRef
    from jax.experimental import pallas as pl

    from normkit.kernels import norm_pallas

    pt = norm_pallas.pltriton
    extents, bad = {}, []
    load, store, pallas_call = pt.load, pt.store, pl.pallas_call

    def check(ref, mask, what):
        base, (idx,) = (ref.ref, ref.transforms) if isinstance(ref, TransformedRef) else (ref, (None,))
        name, extent = extents[id(base)]
        if idx is None:
            idx = indexing.NDIndexer.from_indices_shape(tuple(slice(None) for _ in base.shape), base.shape)
        shape = idx.get_indexer_shape()
        ok, pos = jnp.ones(shape, bool), len(idx.int_indexer_shape)
        for i, ext in zip(idx.indices, extent):
            if isinstance(i, indexing.Slice):
                v = i.start + i.stride * jax.lax.broadcasted_iota(jnp.int32, (i.size,), 0)
                v = v.reshape([i.size if d == pos else 1 for d in range(len(shape))])
                pos += 1
            else:
                v = jnp.asarray(i)
                v = v.reshape(v.shape + (1,) * (len(shape) - v.ndim))
            ok = ok & (v >= 0) & (v < ext)
        kept = jnp.ones(shape, bool) if mask is None else jnp.broadcast_to(mask, shape)
        n = jnp.sum((kept & ~ok).astype(jnp.int32))
        jax.debug.callback(lambda n: bad.append((what, name, int(n))) if n else None, n)

    def checked_load(ref, *args, mask=None, **kw):
        check(ref, mask, "load")
        return load(ref, *args, mask=mask, **kw)

    def checked_store(ref, value, *args, mask=None, **kw):
        check(ref, mask, "store")
        return store(ref, value, *args, mask=mask, **kw)

    def checked_call(body, *, out_shape, in_specs, out_specs, **kw):
        outs = out_shape if isinstance(out_shape, (tuple, list)) else (out_shape,)
        specs = list(in_specs) + list(out_specs if isinstance(out_specs, (tuple, list)) else (out_specs,))

        def call(*args):
            shapes = [a.shape for a in args] + [o.shape for o in outs]

            def instrumented(*refs):
                pid = pl.program_id(0)
                for i, (ref, shape, spec) in enumerate(zip(refs, shapes, specs)):
                    if spec.block_shape is None:
                        extent = tuple(shape)
                    else:  # the block's part inside the array
                        extent = tuple(jnp.minimum(b, s - start * b) for b, s, start in
                                       zip(spec.block_shape, shape, spec.index_map(pid)) if b is not None)
                    extents[id(ref)] = (f"{kw.get('name')}#{i}", extent)
                body(*refs)

            return pallas_call(instrumented, out_shape=out_shape, in_specs=in_specs, out_specs=out_specs, **kw)(*args)

        return call

    monkeypatch.setattr(pt, "load", checked_load)
    monkeypatch.setattr(pt, "store", checked_store)
    monkeypatch.setattr(pl, "pallas_call", checked_call)
    return bad


PALLAS_ACCESS_CASES = [
    Case(B=3, S=4, H=3, D=D, interleaved=interleaved, trained=trained, save=save, transposed=transposed,
         table=table, seed=D)
    for D in (2, 6, 22)  # a one-column half, odd halves
    for interleaved, transposed, table in ((False, False, "batch"), (True, True, "shared"))
    for trained, save in ((True, "auto"), (False, "auto"), (False, "input"))
]
# The default run: each head dimension in each layout once, the backward (from x with dW, from the
# output, from x frozen) rotating, so that each backward meets two head dimensions and both layouts;
# the other cases are the slow tier.
PALLAS_ACCESS_QUICK = {c for i, c in enumerate(PALLAS_ACCESS_CASES) if i % 3 == (i // 3) % 3}


@pytest.mark.skipif(not HAS_JAX, reason="needs jax")
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in PALLAS_ACCESS_QUICK else pytest.mark.slow)
                                  for c in PALLAS_ACCESS_CASES], ids=str)
def test_pallas_accesses_stay_inside_the_arrays(case, monkeypatch):
    """36 rows (three programs, the last one partly past M) of the property's head dimensions: every
    access of the forward, the backward (from x, from the output, with dW) and the dW sum in bounds."""
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("instruments interpret mode")
    bad = _access_checker(monkeypatch)
    a = inputs(case)
    run = ADAPTERS["jax-pallas"].run(case, a)
    jax.effects_barrier()
    assert not bad, f"{case}: out-of-bounds accesses kept by their masks: {bad}"
    check_values("jax-pallas", case, a, run)
