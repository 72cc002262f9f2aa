"""The shared test harness: a case description, its inputs, the reference answer, and the checks.

Each frontend adapter (tests/frontends.py) turns a ``Case`` plus NumPy inputs into outputs,
gradients and a launch log; the test bodies in test_parity.py etc. are written once against it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools

import numpy as np
import pytest

from normkit import norm_math, saving
from normkit.ops import DEFAULT_CASTING_MODE, OPS, Op
from normkit.shapes import Shape
from normkit.testing import assert_close, coarser, random_inputs


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    shape: Shape
    dtype: str = "float32"
    has_w: bool = True
    has_b: bool = False
    w_dtype: str | None = None  # None: the weight has x's dtype
    casting: str = "llama"
    offset: float = 0.0
    trainable: frozenset = frozenset({"x", "weight", "bias", "residual"})
    eps: float = 1e-6
    save: str = "auto"  # what the backward keeps (the public functions' save=)

    @property
    def spec(self) -> Op:
        return OPS[self.op]

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(p for p, has in (("weight", self.has_w), ("bias", self.has_b)) if has)

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.spec.row_inputs + self.params

    @property
    def trained(self) -> frozenset:
        return frozenset(self.trainable) & frozenset(self.inputs)

    @property
    def kwargs(self) -> dict:
        """The op's options (as ``Op.options`` takes them)."""
        kw = {"eps": self.eps}
        if self.spec.has_offset:
            kw.update(offset=self.offset, casting_mode=self.casting)
        return kw

    @property
    def call_kwargs(self) -> dict:
        """The public functions' keyword arguments: the options, and ``save`` where not the default."""
        return self.kwargs if self.save == "auto" else {**self.kwargs, "save": self.save}

    def __str__(self) -> str:
        frozen = ",".join(sorted(set(self.inputs) - self.trained)) or "none"
        parts = [self.op, self.shape.name, self.dtype, f"w={self.w_dtype or self.has_w}", f"b={self.has_b}"]
        if self.spec.has_offset:
            parts += [self.casting, f"off={self.offset}"]
        return "-".join(str(p) for p in parts) + f"-frozen={frozen}" + ("" if self.save == "auto" else
                                                                         f"-save={self.save}")


def same_save(case: Case) -> Case:
    """``case`` with ``save`` made explicit, as both frontends must run it to compare bit for bit: what
    ``"auto"`` keeps where the weight's values are unseen (a jitted JAX call): the output where every
    parameter is frozen, the rows are long enough and ``normkit.saving.traced_rule`` holds. An eager
    Torch call decides by the values, and may keep the output in more cases (``torch_frontend._save``)."""
    if case.save != "auto":
        return case
    frozen = not (case.trained & set(case.params))
    output = (frozen and saving.traced_rule(has_bias=case.has_b, offset=case.offset, x_dtype=case.dtype)
              and not norm_math.output_degenerate(case.shape.shape[-1], is_rms=case.spec.is_rms))
    return dataclasses.replace(case, save="output" if output else "input")


def rule_keeps_output(op: Op, N: int, weight, bias, *, x_dtype: str, opts, traced: bool) -> bool:
    """Whether ``save="auto"`` keeps the output of a call with every parameter frozen and x trained, by
    the save rule stated from the example's facts: rows long enough (``norm_math.output_degenerate``),
    and a weight and bias (NumPy, as stored; None where absent) that pass the safety rule, or, where
    the values are unseen (``traced``), ``saving.traced_rule``. ``opts``: the op's ``Options``."""
    if norm_math.output_degenerate(N, is_rms=op.is_rms):
        return False
    if weight is None and bias is None:
        return True
    if traced:
        return saving.traced_rule(has_bias=bias is not None, offset=opts.offset, x_dtype=x_dtype)
    f32 = lambda a: None if a is None else np.asarray(a, np.float32)  # noqa: E731
    return norm_math.unsafe_reason(f32(weight), f32(bias), x_dtype=x_dtype, offset=opts.offset,
                                   casting=opts.casting) is None


def make_inputs(case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh random inputs, already rounded to their dtypes, plus output gradients dy (and ds)."""
    return random_inputs(case.spec, case.shape.shape, case.dtype, rng, params=case.params, param_dtype=case.w_dtype)


def reference(case: Case, inp: dict) -> tuple[dict, dict]:
    """(outputs, gradients) of the float64 reference, gradients for every input."""
    opts = case.spec.options(**case.kwargs)
    return case.spec.run_reference(inp, opts, {"y": inp["dy"], "residual_out": inp.get("ds")})


@dataclasses.dataclass
class Result:
    outputs: dict  # name -> float64 array
    grads: dict  # input name -> float64 array, or None where no gradient was produced
    log: list  # the LaunchLog of the call


def check_against_reference(case: Case, res: Result, inp: dict, ref: tuple | None = None) -> None:
    """``res`` against the float64 reference of ``inp`` (``ref``: that reference, if already computed)."""
    ref_out, ref_grads = ref if ref is not None else reference(case, inp)
    for name, r in ref_out.items():
        assert_close(res.outputs[name], r, case.dtype, f"{case}: {name}")
    for name in case.inputs:
        if name in case.trained:
            reduced = case.shape.M if name in ("weight", "bias") else 1
            dt = coarser(case.w_dtype or case.dtype, case.dtype) if name in ("weight", "bias") else case.dtype
            assert res.grads[name] is not None, f"{case}: {name} is trainable but got no gradient"
            assert_close(res.grads[name], ref_grads[name], dt, f"{case}: d{name}", reduced_over=reduced)
        else:
            assert res.grads[name] is None, f"{case}: {name} is frozen but got a gradient"


KERNELS = {  # (forward, backward, partial-sum reduction) as the launch records name them
    "triton": ("norm_fwd_kernel", "norm_bwd_kernel", "partial_sum_kernel"),
    "pallas": ("norm_fwd_kernel", "norm_bwd_kernel", "partial_sum_kernel"),
    "xla": ("xla_norm_fwd", "xla_norm_bwd", None),  # a column sum inside the computation: no partials
}


def check_launch_flags(case: Case, log) -> None:
    """The backward ran with exactly the COMPUTE_* flags the trainable set asks for, and allocated
    partial buffers only for the parameters that are trained."""
    implementations = {launch.implementation for launch in log}
    assert len(implementations) <= 1, implementations
    fwd_name, bwd_name, red_name = KERNELS[implementations.pop() if implementations else "triton"]
    bwd = log.of(bwd_name)
    if not case.trained or case.shape.M == 0:
        assert not bwd
        return
    assert len(bwd) == 1, log.kernels()
    flags = bwd[0].flags
    want_dx = bool({"x", "residual"} & case.trained)
    assert flags["COMPUTE_DX"] == want_dx
    assert flags["COMPUTE_DW"] == ("weight" in case.trained)
    assert flags["COMPUTE_DB"] == ("bias" in case.trained)
    names = {name for name, _, _ in bwd[0].partial_buffers}
    reductions = log.of(red_name) if red_name else []
    if red_name is None:
        assert not names and not reductions
    else:
        assert names == ({"DW_PART"} if "weight" in case.trained else set()) | (
            {"DB_PART"} if "bias" in case.trained else set())
        assert len(reductions) == (1 if names else 0)
    fwd = log.of(fwd_name)
    assert len(fwd) == 1 and fwd[0].flags["STORE_STATS"]


def trainable_subsets(case_inputs: tuple[str, ...]):
    """Every non-empty subset of the inputs that can be trained."""
    for k in range(1, len(case_inputs) + 1):
        yield from (frozenset(c) for c in itertools.combinations(case_inputs, k))


def parity_cases(shapes) -> list[Case]:
    """Every combination of op, dtype, casting mode and offset, weight/bias presence, frozen set and shape."""
    return [dataclasses.replace(v, shape=shape) for shape in shapes for v in variants()]


def variants() -> list[Case]:
    """Every combination of op, dtype, casting mode and offset, weight/bias presence and frozen set
    (shape: None), grouped by (dtype, op)."""
    cases = []
    for dtype in ("float32", "bfloat16", "float16"):
        for op in OPS.values():
            options = (itertools.product(("llama", "gemma", "none"), (0.0, 1.0)) if op.has_offset
                       else [("llama", 0.0)])
            for casting, offset in options:
                for params in _param_sets(op.params, offset):
                    base = Case(op.name, None, dtype, has_w="weight" in params, has_b="bias" in params,
                                casting=casting, offset=offset, eps=op.default_eps)
                    for tr in trainable_subsets(base.inputs):
                        cases.append(dataclasses.replace(base, trainable=tr))
    return cases


def repeats_default_casting(case: Case) -> bool:
    """An fp32 case in a casting mode other than the default, with something frozen. In fp32 every
    rounding to x's dtype is exact, so the casting modes compute the same values; each mode's kernel
    variant still runs (everything trained, every parameter set and offset), its frozen sets run in
    the default mode, and the bf16/fp16 cases run every mode with every frozen set."""
    return (case.dtype == "float32" and case.casting != DEFAULT_CASTING_MODE
            and case.trained != frozenset(case.inputs))


def quick_cases(shapes, *, each_frozen_set: bool = True, each_casting: bool = True,
                full_and_frozen_at=None, rotate_over=None) -> list[Case]:
    """The part of ``parity_cases(shapes)`` (less ``repeats_default_casting``) that the default test
    run takes; the rest is the slow tier. It still meets every variant and every shape:

    - every variant once, at a shape that rotates through ``rotate_over`` (default ``shapes``; within
      each op and dtype, from a different start), so each of those shapes meets many. A variant is a
      kernel variant (op, dtype, casting mode, offset, parameter set, and the gradient flags
      COMPUTE_DX/DW/DB) and, with ``each_frozen_set``, each frozen set that maps to it (x, residual or
      both trained give the same COMPUTE_DX: the frontend routes one gradient to them). Without it,
      one frozen set per kernel variant: for an implementation behind a frontend whose routing
      another run already covers.
      Without ``each_casting``, the variants of the default casting mode without offset, and each
      other casting mode and offset once per op and dtype (they change the row math, not which
      gradients are computed): for an implementation whose every example costs a compilation;
    - every shape (of ``full_and_frozen_at``, default ``shapes``) with every op and dtype, twice, in
      the default casting with every parameter: the full backward (dX, and dW/dB through the fp32
      partials and their reduction) and the frozen one (only the row inputs trained: no partials).

    What the slow tier adds is each variant at the other shapes: the shapes decide block sizes, masks,
    program counts and strides, which the second part covers for every op and dtype."""
    chosen, seen = [], set()
    for v in variants():
        key = v if each_frozen_set else (v.op, v.dtype, v.casting, v.offset, v.params, v.spec.grads(v.trained))
        if not each_casting and (v.casting, v.offset) != (DEFAULT_CASTING_MODE, 0.0):
            key = (v.op, v.dtype, v.casting, v.offset)
        if not repeats_default_casting(v) and key not in seen:
            seen.add(key)
            chosen.append(v)
    placed, rotation = [], shapes if rotate_over is None else rotate_over
    for shift, (_, group) in enumerate(itertools.groupby(chosen, key=lambda v: (v.dtype, v.op))):
        placed += [dataclasses.replace(v, shape=rotation[(i + shift) % len(rotation)]) for i, v in enumerate(group)]
    for shape in shapes if full_and_frozen_at is None else full_and_frozen_at:
        for v in variants():
            if (v.casting, v.offset) == (DEFAULT_CASTING_MODE, 0.0) and v.params == v.spec.params and (
                    v.trained in (frozenset(v.inputs), frozenset(v.spec.row_inputs))):
                placed.append(dataclasses.replace(v, shape=shape))
    return list(dict.fromkeys(placed))


def _param_sets(params: tuple[str, ...], offset: float):
    """Every subset of the op's parameters; with an offset (which acts on the weight) the weight stays."""
    for k in range(len(params), -1, -1):
        for subset in itertools.combinations(params, k):
            if offset == 0.0 or "weight" in subset:
                yield subset


def forced_plan(monkeypatch, frontend, name, value, kernel, forced):
    """A fixture's body: ``normkit.launch.<name>`` replaced by ``value`` for one test, with every plan
    and trace cache cleared before and after, so that no other test sees such a plan. ``forced(flags)``
    tells a launch of ``kernel`` by the forced plan from its constexprs: the test must have launched at
    least one, so that it cannot pass without running the plan it forces."""
    if frontend.name == "jax":
        from jax_frontend import resolve_implementation

        if resolve_implementation(None) != "triton":  # a torch-free CPU install runs Pallas
            pytest.skip("the JAX frontend runs Pallas here: no Triton kernel to plan")
    import normkit
    from normkit import launch

    def clear():
        launch.plan_forward.cache_clear()
        launch.plan_backward.cache_clear()
        if importlib.util.find_spec("torch") is not None:
            from torch_frontend import _bound

            _bound.clear()
        if importlib.util.find_spec("jax") is not None:
            import jax

            jax.clear_caches()

    clear()
    monkeypatch.setattr(launch, name, value)
    with normkit.record_launches() as log:
        yield
    clear()
    assert any(forced(launch.flags) for launch in log.of(kernel)), "no launch of the forced plan"


def residuals_of_shape(f, args: tuple, shape: tuple) -> list:
    """The residuals ``jax.vjp`` of ``f(*args)`` keeps that have ``shape``, or that shape stacked by a
    scan (the lines of ``jax.ad_checkpoint.print_saved_residuals``: dtype[shape] and where each comes
    from)."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(f, *args)
    dims = ",".join(map(str, shape)) + "]"
    return [line for line in buf.getvalue().splitlines()
            if line.split(" ", 1)[0].endswith("[" + dims) or line.split(" ", 1)[0].endswith("[1," + dims)]
