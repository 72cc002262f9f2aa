"""nn.Modules whose signatures and state dicts mirror torch.nn.RMSNorm and torch.nn.LayerNorm."""
from __future__ import annotations

import numbers

import torch
from torch import nn

from normkit.ops import LAYER_NORM, RMS_NORM
from normkit.checks import check_save
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


class _RMSBase(nn.Module):
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
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Start as the identity scale: ``weight + offset == 1``."""
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.offset)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"offset={self.offset}, casting_mode={self.casting_mode!r}, save={self.save!r}")


class RMSNorm(_RMSBase):
    """RMSNorm over the last dimension, ``y = x / sqrt(mean(x**2) + eps) * (weight + offset)``.

    A drop-in for ``torch.nn.RMSNorm`` (same argument names, same ``weight`` in the state dict) with
    Gemma's ``offset`` and the ``casting_mode`` of ``torch_frontend.rms_norm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight, self.eps, offset=self.offset, casting_mode=self.casting_mode, save=self.save)


class FusedAddRMSNorm(_RMSBase):
    """``forward(x, residual)`` returns ``(rms_norm(x + residual), x + residual)``, fused in one pass."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.fused_add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset,
                                    casting_mode=self.casting_mode, save=self.save)


class LayerNorm(nn.Module):
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
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight, self.bias, self.eps, save=self.save)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"save={self.save!r}")
