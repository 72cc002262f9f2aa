"""The norms as composite torch operations, for ``torch.compile`` to generate and fuse.

Under ``torch.compile``, a norm whose weight and bias are frozen (LoRA/PEFT fine-tuning) runs as
these operations instead of normkit's kernels. Inductor then writes the norm into the kernels around
it: the residual add and the LoRA output's cast before it, the fp32 copy LoRA's A reads after it,
and, in the backward, the sum of the gradients arriving from q/k/v and their LoRA branches. An
opaque kernel needs each of those materialized in memory first; measured on an H200 (LoRA step, 4
layers x 1024 hidden, 8192 tokens, 2026-12-01) the compiled step was 8% slower with normkit's kernels
than with HF's norm, 0.8 ms more device time in 27 more kernels. A frozen norm's backward is dx
alone, which Inductor's generated kernel also computes at the memory bound, so nothing is lost. A
trained weight or bias keeps normkit's kernels: their fp32-partial dW/dB reduction is where they
beat Inductor's. Plain tensors only (a DTensor keeps the custom ops).

The math and rounding points are those of ``normkit.kernels.norm`` (the same as
``jax_frontend._xla``) for each casting mode; Inductor may keep an intermediate rounding to
x.dtype in fp32 (its ``emulate_precision_casts`` is off by default), as it does for the model's own
norm, so results agree with the kernels to the tolerances of ``normkit.testing``.
"""
from __future__ import annotations

import dataclasses

import torch

from normkit.ops import Casting, Grads, Op, Options


def applies(x, residual, weight, bias) -> bool:
    """Compiling plain tensors whose weight and bias (if any) need no gradient."""
    from torch_frontend._ops import subclassed

    return (torch.compiler.is_compiling() and not subclassed(x, residual, weight, bias)
            and not any(p is not None and p.requires_grad for p in (weight, bias)))


def _rounded(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return v if dtype == torch.float32 else v.to(dtype).float()


@dataclasses.dataclass(frozen=True)
class Composite:
    """The forward and backward of one op as torch operations (the interface of ``_fastpath.Bound``)."""

    op: Op
    opts: Options
    store_stats: bool

    def forward(self, x, residual, weight, bias) -> tuple:
        """``(y, residual_out, mean, rstd)`` over x ``(..., D)``; an entry the op does not produce is None."""
        op, opts, dt = self.op, self.opts, x.dtype
        x32 = x.float()
        s = None
        if op.has_residual:  # the sum is rounded to x.dtype, as torch's `x + residual`, and normalized as stored
            s = (x32 + residual.float()).to(dt)
            x32 = s.float()
        mean = None
        if op.is_rms:
            xc = x32
        else:
            mean = x32.mean(-1)
            xc = x32 - mean[..., None]
        rstd = torch.rsqrt((xc * xc).mean(-1) + opts.eps)
        if opts.casting == Casting.INPUT_DTYPE:  # every product rounded to x.dtype
            xn = _rounded(xc * _rounded(rstd, dt)[..., None], dt)
        elif opts.casting == Casting.ROUND_NORMALIZED:
            xn = _rounded(xc * rstd[..., None], dt)
        else:
            xn = xc * rstd[..., None]
        y = xn
        if weight is not None:
            w = weight.float() + opts.offset
            y = y * (_rounded(w, dt) if opts.casting == Casting.INPUT_DTYPE else w)
        if bias is not None:
            y = y + bias.float()
        keep = self.store_stats
        return y.to(dt), s, (mean if keep else None), (rstd if keep else None)

    def backward(self, x, weight, dy, dres, mean, rstd, grads: Grads, b_dtype: torch.dtype = torch.float32) -> tuple:
        """``(dx, dweight, dbias)``; an entry ``grads`` does not ask for is None."""
        op, opts = self.op, self.opts
        dy32, r = dy.float(), rstd[..., None]
        xn = x.float() * r if op.is_rms else (x.float() - mean[..., None]) * r
        dx = dw = db = None
        if grads.dx:
            g = dy32 if weight is None else dy32 * (weight.float() + opts.offset)
            c1 = (g * xn).mean(-1, keepdim=True)
            dx32 = (g - xn * c1) * r if op.is_rms else (g - g.mean(-1, keepdim=True) - xn * c1) * r
            if dres is not None:
                dx32 = dx32 + dres.float()
            dx = dx32.to(x.dtype)
        N = x.shape[-1]
        if grads.dw:
            xw = _rounded(xn, x.dtype) if opts.casting == Casting.ROUND_NORMALIZED else xn  # as the forward used it
            dw = (dy32 * xw).reshape(-1, N).sum(0).to(weight.dtype)
        if grads.db:
            db = dy32.reshape(-1, N).sum(0).to(b_dtype)
        return dx, dw, db
