"""The shared test harness: a case description, its inputs, the reference answer, and the checks.

Each frontend adapter (tests/frontends.py) turns a ``Case`` plus NumPy inputs into outputs,
gradients and a launch log; the test bodies in test_parity.py etc. are written once against it.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from normkit import reference as ref
from normkit.shapes import Shape
from tests.tolerances import assert_close

PARAMS = {  # the parameters each op can take, besides x
    "rms_norm": ("weight",),
    "layer_norm": ("weight", "bias"),
    "fused_add_rms_norm": ("residual", "weight"),
}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    @property
    def inputs(self) -> tuple[str, ...]:
        names = ["x"]
        if self.op == "fused_add_rms_norm":
            names.append("residual")
        if self.has_w:
            names.append("weight")
        if self.has_b:
            names.append("bias")
        return tuple(names)

    @property
    def trained(self) -> frozenset:
        return frozenset(self.trainable) & frozenset(self.inputs)

    @property
    def kwargs(self) -> dict:
        kw = {"eps": self.eps}
        if self.op != "layer_norm":
            kw.update(offset=self.offset, casting_mode=self.casting)
        return kw

    def __str__(self) -> str:
        frozen = ",".join(sorted(set(self.inputs) - self.trained)) or "none"
        parts = [self.op, self.shape.name, self.dtype, f"w={self.w_dtype or self.has_w}", f"b={self.has_b}"]
        if self.op != "layer_norm":
            parts += [self.casting, f"off={self.offset}"]
        return "-".join(str(p) for p in parts) + f"-frozen={frozen}"


def rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """a as the float64 values it takes once stored in ``dtype``."""
    return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(TORCH_DTYPES[dtype]).double().numpy()


def make_inputs(case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh random inputs, already rounded to their dtypes, plus output gradients dy (and ds)."""
    shape = case.shape.shape
    D = shape[-1]
    out = {"x": rounded(rng.standard_normal(shape) * 1.5 + 0.3, case.dtype)}
    if case.op == "fused_add_rms_norm":
        out["residual"] = rounded(rng.standard_normal(shape), case.dtype)
    wd = case.w_dtype or case.dtype
    if case.has_w:
        out["weight"] = rounded(rng.uniform(0.5, 1.5, D) * rng.choice([-1.0, 1.0], D), wd)
    if case.has_b:
        out["bias"] = rounded(rng.standard_normal(D) * 0.5, wd)
    out["dy"] = rounded(rng.standard_normal(shape), case.dtype)
    if case.op == "fused_add_rms_norm":
        out["ds"] = rounded(rng.standard_normal(shape), case.dtype)
    return out


def reference(case: Case, inp: dict) -> tuple[dict, dict]:
    """(outputs, gradients) of the float64 reference, gradients for every input."""
    w, eps, off = inp.get("weight"), case.eps, case.offset
    if case.op == "rms_norm":
        y = ref.rms_norm(inp["x"], w, eps, off)
        dx, dw = ref.rms_norm_bwd(inp["x"], w, inp["dy"], eps, off)
        return {"y": y}, {"x": dx, "weight": dw}
    if case.op == "layer_norm":
        b = inp.get("bias")
        y = ref.layer_norm(inp["x"], w, b, eps)
        dx, dw, db = ref.layer_norm_bwd(inp["x"], w, b, inp["dy"], eps)
        return {"y": y}, {"x": dx, "weight": dw, "bias": db}
    y, s = ref.fused_add_rms_norm(inp["x"], inp["residual"], w, eps, off)
    dx, dres, dw = ref.fused_add_rms_norm_bwd(inp["x"], inp["residual"], w, inp["dy"], inp["ds"], eps, off)
    return {"y": y, "residual_out": s}, {"x": dx, "residual": dres, "weight": dw}


@dataclasses.dataclass
class Result:
    outputs: dict  # name -> float64 array
    grads: dict  # input name -> float64 array, or None where no gradient was produced
    log: list  # the LaunchLog of the call


def check_against_reference(case: Case, res: Result, inp: dict) -> None:
    ref_out, ref_grads = reference(case, inp)
    for name, r in ref_out.items():
        assert_close(res.outputs[name], r, case.dtype, f"{case}: {name}")
    for name in case.inputs:
        if name in case.trained:
            reduced = case.shape.M if name in ("weight", "bias") else 1
            dt = (case.w_dtype or case.dtype) if name in ("weight", "bias") else case.dtype
            assert res.grads[name] is not None, f"{case}: {name} is trainable but got no gradient"
            assert_close(res.grads[name], ref_grads[name], dt, f"{case}: d{name}", reduced_over=reduced)
        else:
            assert res.grads[name] is None, f"{case}: {name} is frozen but got a gradient"


def check_launch_flags(case: Case, log) -> None:
    """The backward ran with exactly the COMPUTE_* flags the trainable set asks for, and allocated
    partial buffers only for the parameters that are trained."""
    bwd = log.of("norm_bwd_kernel")
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
    assert names == ({"DW_PART"} if "weight" in case.trained else set()) | (
        {"DB_PART"} if "bias" in case.trained else set())
    reductions = log.of("partial_sum_kernel")
    assert len(reductions) == (1 if names else 0)
    fwd = log.of("norm_fwd_kernel")
    assert len(fwd) == 1 and fwd[0].flags["STORE_STATS"]


def trainable_subsets(case_inputs: tuple[str, ...]):
    """Every non-empty subset of the inputs that can be trained."""
    for k in range(1, len(case_inputs) + 1):
        yield from (frozenset(c) for c in itertools.combinations(case_inputs, k))


def parity_cases(shapes) -> list[Case]:
    """Every combination of op, dtype, casting mode and offset, weight/bias presence, frozen set and shape."""
    cases = []
    for shape in shapes:
        for dtype in ("float32", "bfloat16", "float16"):
            for op in ("rms_norm", "fused_add_rms_norm"):
                for casting, offset in itertools.product(("llama", "gemma", "none"), (0.0, 1.0)):
                    for has_w in (True, False) if offset == 0.0 else (True,):  # offset acts on the weight
                        base = Case(op, shape, dtype, has_w=has_w, casting=casting, offset=offset)
                        for tr in trainable_subsets(base.inputs):
                            cases.append(dataclasses.replace(base, trainable=tr))
            for has_w, has_b in ((True, True), (True, False), (False, True), (False, False)):
                base = Case("layer_norm", shape, dtype, has_w=has_w, has_b=has_b, eps=1e-5)
                for tr in trainable_subsets(base.inputs):
                    cases.append(dataclasses.replace(base, trainable=tr))
    return cases
