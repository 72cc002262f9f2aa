"""What a norm keeps for its backward: its input, or, with every parameter frozen, its output.

With the weight and bias frozen (LoRA, PEFT), the normalized row can be recovered from the output:
``x_hat = (y - bias) / (weight + offset)``, so the backward needs y instead of x (``normkit.driver``,
``from_output``). Where y is kept alive anyway (a LoRA adapter in the activations' dtype saves it
as its input), the norm's saved x, often the only reference left to that activation, is freed: one
activation per norm less. An adapter that computes in another dtype (PEFT's default fp32 adapters on
a bf16 model) saves its own converted copy instead; then keeping y saves nothing, and costs nothing
either.

``save="auto"`` (the default) keeps the output where ``normkit.saving.decide`` says so: every
parameter frozen, x needing a gradient, no saved-tensor hook active, rows long enough, and the
weight passing the safety rule of ``normkit.norm_math`` (no column whose weight is too small, or
bias too large against it, to recover x_hat in x's dtype; no y that could overflow). Otherwise it
keeps the input. ``"input"`` always keeps the input; ``"output"`` always keeps the output, and raises
where a parameter is trained, the rows are too short or the weight is unsafe.

Eager calls read the weight's values once per version of it (``_bound.Signature.route``);
``save_decision`` answers the same question for a weight, with the reason. Where the values cannot
be read (``torch.compile`` traces fake tensors) the decision is ``saving.traced_rule`` unless the
module calling knows its weight (``known``: normkit's modules remember the answer for their weight,
``torch_frontend.modules``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from normkit import norm_math, saving
from normkit.ops import CASTING_MODES, Casting, Op
from torch_frontend._backend import dtype_name


@dataclasses.dataclass(frozen=True)
class SaveDecision:
    """Whether a norm with this weight keeps its output for the backward (``saves_output``), and why."""

    saves_output: bool
    reason: str

    def __bool__(self) -> bool:
        return self.saves_output


def _local(t):
    """A DTensor's local tensor (a norm's weight and bias are replicated: the local one is whole)."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


def unsafe_reason(weight, bias, offset: float, casting: Casting, x_dtype: torch.dtype) -> str | None:
    """Why x_hat cannot be recovered from y with this weight and bias (``norm_math.unsafe_reason``:
    the first column that fails, or the overflow of y), or None: read from the values, a host
    synchronization."""
    with torch.no_grad():
        return norm_math.unsafe_reason(None if weight is None else _local(weight).detach(),
                                       None if bias is None else _local(bias).detach(), x_dtype=x_dtype,
                                       offset=offset, casting=casting)


def saves_output(op: Op, save: str, x, weight, bias, offset: float, casting: Casting, hooked: bool = False) -> bool:
    """Eager: whether a call whose forward stores statistics for a backward keeps its output
    (``normkit.saving.decide``, the weight's values read; ``hooked``: saved-tensor hooks are active).
    A call signature remembers its answers per weight version (``_bound.Signature.route``)."""
    return saving.decide(op, save, trained=_trained(weight, bias), needs_dx=True, row_length=x.shape[-1],
                         has_params=weight is not None or bias is not None, has_bias=bias is not None, offset=offset,
                         x_dtype=dtype_name(x.dtype), hooked=hooked,
                         unsafe=lambda: unsafe_reason(weight, bias, offset, casting, x.dtype))


def traced_saves_output(op: Op, save: str, x, weight, bias, offset: float, known: Optional[bool] = None) -> bool:
    """Traced (``torch.compile``), where the weight's values are unseen (``normkit.saving.decide``):
    ``known``, what the module calling knows of its weight (True: safe, False: unsafe, None: nothing)."""
    unsafe = None if known is None else (lambda: None if known else "the module's weight is unsafe")
    return saving.decide(op, save, trained=_trained(weight, bias), needs_dx=True, row_length=x.shape[-1],
                         has_params=weight is not None or bias is not None, has_bias=bias is not None, offset=offset,
                         x_dtype=dtype_name(x.dtype), unsafe=unsafe)


def _trained(weight, bias) -> list:
    return [n for n, t in (("weight", weight), ("bias", bias)) if t is not None and t.requires_grad]


def save_decision(weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, *,
                  dtype: torch.dtype, offset: float = 0.0, casting_mode: str = "llama") -> SaveDecision:
    """Whether a frozen norm with this ``weight`` (and ``bias``), on inputs of ``dtype``, keeps its output
    for the backward under ``save="auto"``, and why (``SaveDecision.reason``).

    ``casting_mode`` and ``offset`` as in ``rms_norm`` (a LayerNorm passes neither). A trained weight
    or bias keeps the input: dW and dB need it.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"normkit: dtype must be torch.float32, bfloat16 or float16 (x's dtype); got {dtype}")
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"normkit: unknown casting_mode {casting_mode!r}; expected one of {sorted(CASTING_MODES)}")
    trained = _trained(weight, bias)
    if trained:
        return SaveDecision(False, f"{' and '.join(trained)} {'is' if len(trained) == 1 else 'are'} trained: "
                                   "the backward needs the input for dW/dB")
    if weight is None and bias is None:
        return SaveDecision(True, "no weight or bias: x_hat is the output itself")
    reason = unsafe_reason(weight, bias, float(offset), CASTING_MODES[casting_mode], dtype)
    if reason is None:
        return SaveDecision(True, "every parameter frozen and the weight safe: x_hat = (y - bias) / weight")
    return SaveDecision(False, reason)
