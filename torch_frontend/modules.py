"""nn.Modules whose signatures and state dicts mirror torch.nn.RMSNorm and torch.nn.LayerNorm.

Each module also remembers whether its weight (and bias) would let a frozen norm keep its output, for
each dtype x may have (``save_hint``): ``torch.compile`` traces fake tensors, whose values it cannot
read, and decides from that instead (``torch_frontend._save.traced_saves_output``; dynamo guards on
it, so a changed hint recompiles). It is read from the values when the module is built, its
parameters reset or loaded (``load_state_dict``), and when ``patch_model`` adopts a model's
parameters; after changing a frozen weight in place, call ``refresh_save_hint()``. Eager calls read
the weight itself (once per version of it) and do not use it.
"""
from __future__ import annotations

import numbers

import torch
from torch import nn

from normkit.checks import check_save
from normkit.ops import CASTING_MODES, FUSED_ADD_RMS_NORM, LAYER_NORM, RMS_NORM, Casting
from torch_frontend import _save
from torch_frontend import functional as F

__all__ = ["RMSNorm", "LayerNorm", "FusedAddRMSNorm"]


def _last_dim(normalized_shape) -> tuple[int]:
    if isinstance(normalized_shape, numbers.Integral):
        normalized_shape = (int(normalized_shape),)
    if not isinstance(normalized_shape, (tuple, list, torch.Size)) or not all(
            isinstance(d, numbers.Integral) for d in normalized_shape):
        raise TypeError(f"normkit: normalized_shape must be an int D (or a 1-tuple of it); got "
                        f"{type(normalized_shape).__name__}: {normalized_shape!r}")
    normalized_shape = tuple(int(d) for d in normalized_shape)
    if len(normalized_shape) != 1:
        raise ValueError(
            f"normkit: normalized_shape {normalized_shape} is not supported; normkit normalizes over the last "
            "dimension only, so give one int D"
        )
    return normalized_shape


_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _SaveHint(nn.Module):
    """The ``save_hint`` of a normkit module (the module docstring)."""

    save_hint: dict
    # ``patch_model``'s, where the output's consumers take it in another dtype (PEFT's LoRA layers):
    # ``output_copy(module, x)`` is ``(dtype, keep)`` for this call or None (``functional._apply``'s copy)
    output_copy = None

    def _copy(self, x):
        return None if self.output_copy is None else self.output_copy(self, x)

    def _init_save_hint(self) -> None:
        """An empty hint, refreshed after every ``load_state_dict``; ``reset_parameters`` fills it."""
        self.save_hint = {}
        self.register_load_state_dict_post_hook(_refresh_save_hint)

    def refresh_save_hint(self) -> dict:
        """Read the weight (and bias) again: ``{x's dtype: whether a frozen norm could keep its output}``
        (empty where the values cannot be read: parameters on the meta device)."""
        weight, bias = self.weight, getattr(self, "bias", None)
        params = [t for t in (weight, bias) if t is not None]
        if any(t.is_meta for t in params):
            self.save_hint = {}
        else:
            offset = getattr(self, "offset", 0.0)
            casting = CASTING_MODES[self.casting_mode] if hasattr(self, "casting_mode") else Casting.FP32
            self.save_hint = {dtype: _save.unsafe_reason(weight, bias, offset, casting, dtype) is None
                              for dtype in _X_DTYPES}
        return self.save_hint


def _refresh_save_hint(module: _SaveHint, incompatible_keys) -> None:
    module.refresh_save_hint()


class _RMSBase(_SaveHint):
    def __init__(self, normalized_shape, eps=1e-6, elementwise_affine=True, *, offset=0.0, casting_mode="llama",
                 save="auto", device=None, dtype=None):
        super().__init__()
        RMS_NORM.options(eps=eps, offset=offset, casting_mode=casting_mode)  # raises, naming a bad option
        check_save(save)
        self.save = save
        self.normalized_shape = _last_dim(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = float(offset)
        self.casting_mode = casting_mode
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self._init_save_hint()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Start as the identity scale: ``weight + offset == 1``."""
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.offset)
        self.refresh_save_hint()

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"offset={self.offset}, casting_mode={self.casting_mode!r}, save={self.save!r}")


class RMSNorm(_RMSBase):
    """RMSNorm over the last dimension, ``y = x / sqrt(mean(x**2) + eps) * (weight + offset)``.

    A drop-in for ``torch.nn.RMSNorm`` (same argument names, same ``weight`` in the state dict) with
    Gemma's ``offset`` and the ``casting_mode`` of ``torch_frontend.rms_norm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F._apply(RMS_NORM, x, None, self.weight, None, self.eps, self.offset, self.casting_mode, self.save,
                        self.save_hint, self._copy(x))


class FusedAddRMSNorm(_RMSBase):
    """``forward(x, residual)`` returns ``(rms_norm(x + residual), x + residual)``, fused in one pass."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F._apply(FUSED_ADD_RMS_NORM, x, residual, self.weight, None, self.eps, self.offset, self.casting_mode,
                        self.save, self.save_hint, self._copy(x))


class LayerNorm(_SaveHint):
    """LayerNorm over the last dimension; a drop-in for ``torch.nn.LayerNorm`` (same state dict)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None, *,
                 save="auto"):
        super().__init__()
        LAYER_NORM.options(eps=eps)  # raises, naming a bad eps
        check_save(save)
        self.save = save
        self.normalized_shape = _last_dim(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self._init_save_hint()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        self.refresh_save_hint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F._apply(LAYER_NORM, x, None, self.weight, self.bias, self.eps, 0.0, "llama", self.save,
                        self.save_hint, self._copy(x))

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"save={self.save!r}")
