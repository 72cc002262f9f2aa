"""The op table: what each normalization op *is*, written once, as data.

Every layer reads an op from here instead of testing its name: the kernels' flags, the buffers each
launch writes (with shapes and dtypes), the inputs that can be frozen, and the float64 reference.
A frontend adds only what is framework-specific (autograd / custom_vjp, modules, launchers).

    >>> from normkit.ops import OPS
    >>> op = OPS["layer_norm"]
    >>> op.inputs, op.outputs, op.fwd_flags
    (('x', 'weight', 'bias'), ('y',), {'IS_RMS': False, 'HAS_RESIDUAL': False})

Adding a row-wise op is: a kernel variant (a constexpr flag), one ``Op`` entry below, its math in
``normkit.norm_math`` (with its float64 reference in ``normkit.reference``), and one public function
per frontend (docs/ADDING_AN_OP.md).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable

from normkit import reference
from normkit.norm_math import FINITE_MAX, OUTPUT_BIAS_RATIO, W_MIN
from normkit.norm_math import Casting  # where the forward rounds to x's dtype: defined beside the math

# ---------------------------------------------------------------------------------------------
# Vocabulary.

X_DTYPES = ("float32", "bfloat16", "float16")  # activations: x, residual, dy
PARAM_DTYPES = X_DTYPES + ("float64",)  # weight and bias (their gradients keep their dtype)
MAX_N = 65536  # longest supported row: one row must fit one program's registers
ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

# The output-saving backward (a frozen norm keeps y, not x, and recovers x_hat = (y - b) / w_eff) is
# exact enough where dividing by w_eff loses nothing: column j is safe when w_eff_j is finite with
# |w_eff_j| >= OUTPUT_W_MIN[x's dtype], and b_j is finite with |b_j| <= OUTPUT_BIAS_RATIO * |w_eff_j|
# (normkit.norm_math derives both; the kernels receive them as constexprs).
OUTPUT_W_MIN = {name: W_MIN[name] for name in X_DTYPES}


# The public ``casting_mode`` names (the ones Liger and HF users know) and what they mean.
CASTING_MODES = {"none": Casting.INPUT_DTYPE, "llama": Casting.ROUND_NORMALIZED, "gemma": Casting.FP32}
DEFAULT_CASTING_MODE = "llama"


@dataclasses.dataclass(frozen=True)
class Options:
    """The static options of one call."""

    eps: float
    offset: float = 0.0  # added to the weight (Gemma's 1 + w)
    casting: Casting = Casting.FP32


@dataclasses.dataclass(frozen=True)
class Grads:
    """Which gradients a backward computes; a frozen input's flag is off and costs nothing."""

    dx: bool  # x (and, for the fused add, residual: they share one gradient)
    dw: bool
    db: bool = False
    # derived once, read as plain attributes (a plan reads them on every first call)
    any: bool = dataclasses.field(init=False, repr=False, compare=False)
    reduces: bool = dataclasses.field(init=False, repr=False, compare=False)  # dW/dB: fp32 partials, a reduction

    def __post_init__(self):
        object.__setattr__(self, "any", bool(self.dx or self.dw or self.db))
        object.__setattr__(self, "reduces", bool(self.dw or self.db))


def copies_exactly(x_dtype: str, dtype: str) -> bool:
    """Whether y, in ``x_dtype``, has a copy in ``dtype`` that the forward can write beside it (Y2): a
    dtype that holds every ``x_dtype`` value exactly (x's own, or a wider float), so that the copy is
    ``y.to(dtype)`` bit for bit whatever the rounding of the conversion."""
    return dtype == x_dtype or (dtype in ("float32", "float64") and ELEM_BYTES[dtype] > ELEM_BYTES[x_dtype])


def rec_offset(M: int) -> int:
    """Where the weight's recovery begins in an RSTD buffer that holds it after M rows' statistics: M
    rounded up to a multiple of 4 floats, so that it is as 16-byte aligned as the buffer (the kernels
    load it in vectors)."""
    return (M + 3) // 4 * 4


# Every Grads, by its (dx, dw, db) flags: a frontend that holds the flags as a tuple looks it up.
GRADS = {(dx, dw, db): Grads(dx, dw, db) for dx in (False, True) for dw in (False, True) for db in (False, True)}


@dataclasses.dataclass(frozen=True)
class Op:
    """One row-wise normalization op. Buffer names are the kernels' parameter names."""

    name: str  # the public function name
    title: str  # the module / human name
    is_rms: bool  # no mean subtraction (kernel flag IS_RMS)
    has_residual: bool  # fused residual add: also returns residual_out = x + residual
    params: tuple[str, ...]  # optional per-column parameters, in signature order
    has_offset: bool  # takes offset (added to the weight) and casting_mode
    default_eps: float
    reference: Callable  # float64 forward: normkit.reference
    reference_bwd: Callable  # float64 backward

    @property
    def row_inputs(self) -> tuple[str, ...]:
        """The [M, N] inputs (the user-facing names)."""
        return ("x", "residual") if self.has_residual else ("x",)

    @property
    def inputs(self) -> tuple[str, ...]:
        """Everything that can be differentiated, hence frozen, in signature order."""
        return self.row_inputs + self.params

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("y", "residual_out") if self.has_residual else ("y",)

    @property
    def fwd_flags(self) -> dict:
        return {"IS_RMS": self.is_rms, "HAS_RESIDUAL": self.has_residual}

    def options(self, *, eps, offset=0.0, casting_mode=DEFAULT_CASTING_MODE) -> Options:
        """Validated options (raises naming the argument); LayerNorm always computes in fp32."""
        eps = _number("eps", eps)
        if eps < 0:
            raise ValueError(f"normkit: eps must be a finite number >= 0; got {eps!r}")
        offset = _number("offset", offset)
        if not isinstance(casting_mode, str):
            raise TypeError(f"normkit: casting_mode must be a str, one of {sorted(CASTING_MODES)}; got "
                            f"{type(casting_mode).__name__}: {casting_mode!r}")
        if casting_mode not in CASTING_MODES:
            raise ValueError(
                f"normkit: unknown casting_mode {casting_mode!r}; expected one of {sorted(CASTING_MODES)}")
        if not self.has_offset:
            return Options(eps, 0.0, Casting.FP32)
        return Options(eps, offset, CASTING_MODES[casting_mode])

    def grads(self, trained) -> Grads:
        """The kernel's gradient flags for a set of trained input names."""
        trained = set(trained)
        return Grads(dx=bool(trained & set(self.row_inputs)), dw="weight" in trained, db="bias" in trained)

    # The buffers each launch writes, ``name -> (shape, dtype name)``. The plans, the Torch fake
    # (meta) functions and the JAX abstract rules all read these, so they cannot drift apart.

    def fwd_buffers(self, M: int, N: int, x_dtype: str, store_stats: bool, store_rec: bool = False,
                    rec_in_rstd: bool = False, y2_dtype: str | None = None) -> dict:
        """``store_rec``: the backward will read y, so the forward also writes the weight's recovery
        (``norm_math.recovery``: 1 / w_y per column, then the poison; N + 1 fp32 values), as a buffer
        REC of its own or, ``rec_in_rstd``, in RSTD after its M rows, from ``rec_offset(M)`` (one
        allocation for both). ``y2_dtype``: the forward also writes y in that dtype, Y2 (a dtype that
        holds y exactly: ``copies_exactly``), for consumers that take y in it."""
        out = {"Y": ((M, N), x_dtype)}
        if self.has_residual:
            out["S"] = ((M, N), x_dtype)
        if store_stats and not self.is_rms:
            out["MEAN"] = ((M,), "float32")
        if store_stats:
            out["RSTD"] = ((rec_offset(M) + N + 1 if store_rec and rec_in_rstd else M,), "float32")
        if store_rec and not rec_in_rstd:
            out["REC"] = ((N + 1,), "float32")
        if y2_dtype is not None:
            out["Y2"] = ((M, N), y2_dtype)
        return out

    def bwd_buffers(self, M: int, N: int, x_dtype: str, grads: Grads, w_dtype: str | None,
                    b_dtype: str | None) -> dict:
        """The backward's results (after the partials are reduced): DX, DW, DB."""
        out = {}
        if grads.dx:
            out["DX"] = ((M, N), x_dtype)
        if grads.dw:
            out["DW"] = ((N,), w_dtype)
        if grads.db:
            out["DB"] = ((N,), b_dtype)
        return out

    @property
    def saves_mean(self) -> bool:  # the backward reads the forward's per-row mean
        return not self.is_rms

    def run_reference(self, inputs: dict, opts: Options, cotangents: dict) -> tuple[dict, dict]:
        """The float64 reference: (outputs by name, gradients by input name, every input).

        ``inputs`` maps input names to arrays (an absent parameter is missing or None);
        ``cotangents`` maps output names to their gradients (a missing residual_out one is zero).
        """
        kw = {name: inputs.get(name) for name in self.inputs}
        extra = {"eps": opts.eps, **({"offset": opts.offset} if self.has_offset else {})}
        outs = self.reference(**kw, **extra)
        outs = outs if isinstance(outs, tuple) else (outs,)
        cot = {"dy": cotangents["y"]}
        if self.has_residual:
            cot["ds"] = cotangents.get("residual_out")
        grads = self.reference_bwd(**kw, **cot, **extra)
        return dict(zip(self.outputs, outs)), dict(zip(self.inputs, grads))


def _number(name: str, value) -> float:
    """A static, finite Python number (NumPy scalars welcome); arrays, tensors and tracers refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = type(value).__name__
        if "Tracer" in kind:
            hint = ("it is traced (an argument of a jitted function): it must be static; pass a Python "
                    "float, or mark the argument static with static_argnames")
        elif hasattr(value, "shape"):
            hint = f"it is a {kind}; pass a Python float, e.g. float({name})"
        else:
            hint = f"got {kind}"
        raise TypeError(f"normkit: {name} must be a static Python float; {hint}: {value!r}")
    value = float(value)
    if not -math.inf < value < math.inf:  # NaN fails too; math.isfinite breaks torch.compile(dynamic=True)
        raise ValueError(f"normkit: {name} must be a finite number{' >= 0' if name == 'eps' else ''}; got {value!r}")
    # The kernels compute in fp32: a value fp32 cannot hold would silently become inf or 0 there.
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"normkit: {name}={value!r} does not fit in float32 (largest {FLOAT32_MAX:.7g}), in which "
                         "the kernels compute")
    if value != 0.0 and abs(value) < FLOAT32_TINIEST:
        raise ValueError(f"normkit: {name}={value!r} rounds to 0 in float32 (smallest nonzero {FLOAT32_TINIEST:.7g}), "
                         "in which the kernels compute; pass 0.0 if that is what you mean")
    return value


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINIEST = 1.401298464324817e-45  # the smallest positive float32 (a subnormal)


RMS_NORM = Op(
    name="rms_norm", title="RMSNorm", is_rms=True, has_residual=False, params=("weight",), has_offset=True,
    default_eps=1e-6, reference=reference.rms_norm, reference_bwd=reference.rms_norm_bwd)
LAYER_NORM = Op(
    name="layer_norm", title="LayerNorm", is_rms=False, has_residual=False, params=("weight", "bias"),
    has_offset=False, default_eps=1e-5, reference=reference.layer_norm, reference_bwd=reference.layer_norm_bwd)
FUSED_ADD_RMS_NORM = Op(
    name="fused_add_rms_norm", title="FusedAddRMSNorm", is_rms=True, has_residual=True, params=("weight",),
    has_offset=True, default_eps=1e-6, reference=reference.fused_add_rms_norm,
    reference_bwd=reference.fused_add_rms_norm_bwd)

OPS = {op.name: op for op in (RMS_NORM, LAYER_NORM, FUSED_ADD_RMS_NORM)}
