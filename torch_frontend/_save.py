"""What a norm keeps for its backward: its input, or, with every parameter frozen, its output.

With the weight and bias frozen (LoRA, PEFT), the normalized row can be recovered from the output:
``x_hat = (y - bias) / (weight + offset)``, so the backward needs y instead of x (``normkit.driver``,
``from_output``). Where y is kept alive anyway (a LoRA adapter in the activations' dtype saves it
as its input), the norm's saved x, often the only reference left to that activation, is freed: one
activation per norm less. An adapter that computes in another dtype (PEFT's default fp32 adapters on
a bf16 model) saves its own converted copy instead; then keeping y saves nothing, and costs nothing
either.

``save="auto"`` (the default) keeps the output where every parameter is frozen, x needs a
gradient, rows are longer than one element (a one-element row's dx cancels to nearly zero, where
recovering x_hat would cost relative accuracy), and the weight is *safe*: no column of
``weight + offset`` so small, nor of the bias so large against it, that dividing by it loses x_hat
in x's dtype (``normkit.ops.OUTPUT_W_MIN``, ``OUTPUT_BIAS_RATIO``). Otherwise it keeps the input.
The rule is ``normkit.saving.decide``, shared with the JAX frontend. ``"input"`` always keeps the
input; ``"output"`` always keeps the output, and raises where a parameter is trained or the weight
is unsafe.

Safety is read from the weight's values once per version of it (the tensor object, its data
pointer and ``_version``): one host synchronization when a frozen weight is first seen or changed,
never one per call. ``save_decision`` answers the same question for a weight, with the reason.

Where the values cannot be read (``torch.compile`` traces fake tensors), ``"auto"`` keeps the output
where no column can be unsafe but for a weight of exactly zero: no bias and no offset. A LayerNorm's
trained bias is often larger than its weight in some column, and ``weight + offset`` (Gemma's
``1 + w``) vanishes where a 16-bit w is -1; those keep the input there. A weight that turns out
unsafe makes the kernels' dx NaN (never a quietly wrong gradient); ``save="input"`` avoids it.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

import torch

from normkit import norm_math, saving
from normkit.ops import CASTING_MODES, Casting, Op

@dataclasses.dataclass(frozen=True)
class SaveDecision:
    """Whether a norm with this weight keeps its output for the backward (``saves_output``), and why."""

    saves_output: bool
    reason: str

    def __bool__(self) -> bool:
        return self.saves_output


_SAFETY: dict = {}
_SAFETY_LIMIT = 1024
_UIDS = itertools.count(1)


def uid(t) -> int:
    """The tensor object's own number (from 1), given on first sight: a data pointer alone is not an
    identity (a freed weight's memory is handed to the next tensor, whose ``_version`` starts at 0
    again)."""
    n = getattr(t, "_normkit_uid", None)
    if n is None:
        n = t._normkit_uid = next(_UIDS)
    return n


def _version_key(t) -> tuple | None:
    """A weight's identity and version, with everything about it the safety check reads."""
    if t is None:
        return None
    return uid(t), t.data_ptr(), t._version, t.dtype, t.device, t.shape, t.stride()


def _reason(weight, bias, offset: float, casting: Casting, x_dtype: torch.dtype) -> str | None:
    """Why x_hat cannot be recovered from y with this weight (``norm_math.unsafe_reason``: the first
    column that fails), or None; remembered per version of the weight and bias."""
    key = (_version_key(weight), _version_key(bias), offset, casting, x_dtype)
    try:
        return _SAFETY[key]
    except KeyError:
        pass
    if len(_SAFETY) >= _SAFETY_LIMIT:
        _SAFETY.clear()
    with torch.no_grad():
        reason = _SAFETY[key] = norm_math.unsafe_reason(
            None if weight is None else weight.detach(), None if bias is None else bias.detach(), x_dtype=x_dtype,
            offset=offset, casting=casting)
    return reason


def saves_output(op: Op, save: str, x, weight, bias, offset: float, casting: Casting) -> bool:
    """Eager: whether a call whose forward stores statistics for a backward keeps its output
    (``normkit.saving.decide``, the weight's values read once per version of it). A call signature
    remembers its answers per weight identity and version (``_bound.Signature.saves_output``)."""
    return saving.decide(op, save, trained=_trained(weight, bias), needs_dx=True, row_length=x.shape[-1],
                         has_params=weight is not None or bias is not None, has_bias=bias is not None, offset=offset,
                         unsafe=lambda: _reason(weight, bias, offset, casting, x.dtype))


def traced_saves_output(op: Op, save: str, x, weight, bias, offset: float) -> bool:
    """Traced (``torch.compile``), where the weight's values are unseen (``normkit.saving.decide``)."""
    return saving.decide(op, save, trained=_trained(weight, bias), needs_dx=True, row_length=x.shape[-1],
                         has_params=weight is not None or bias is not None, has_bias=bias is not None, offset=offset,
                         unsafe=None)


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
    reason = _reason(weight, bias, float(offset), CASTING_MODES[casting_mode], dtype)
    if reason is None:
        return SaveDecision(True, "every parameter frozen and the weight safe: x_hat = (y - bias) / weight")
    return SaveDecision(False, reason)
