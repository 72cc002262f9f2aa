"""The Torch frontend adapter: runs a harness Case through torch_frontend and hands back NumPy results."""
from __future__ import annotations

import numpy as np
import torch

import normkit
from normkit.testing import poisoned_outputs
from tests.frontends import apply_op
from tests.harness import Case, Result
from torch_frontend._backend import TORCH_DTYPES

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _np(t):
    return None if t is None else t.detach().to(torch.float64).cpu().numpy()


class TorchFrontend:
    name = "torch"

    @property
    def module(self):
        import torch_frontend

        return torch_frontend

    @staticmethod
    def numpy(t) -> np.ndarray:
        """A result as a NumPy array (float64 for floating types)."""
        return _np(t)

    def raw(self, a: np.ndarray) -> torch.Tensor:
        """``a`` as a tensor of the same dtype (ints, bools and complex included)."""
        return torch.from_numpy(np.array(a)).to(DEVICE)  # np.array keeps 0-d arrays 0-d

    def tensor(self, a: np.ndarray, dtype: str, strided: bool = False) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE, TORCH_DTYPES[dtype])
        if strided:  # the same values as rows of a wider buffer: row stride D + 13, last dim contiguous
            wide = torch.full((*t.shape[:-1], t.shape[-1] + 13), float("nan"), dtype=t.dtype, device=DEVICE)
            wide[..., : t.shape[-1]] = t
            t = wide[..., : t.shape[-1]]
        return t

    def call(self, case: Case, inp: dict) -> Result:
        import torch_frontend as tf

        wd = case.w_dtype or case.dtype
        args = {}
        for name in case.inputs:
            dt = wd if name in ("weight", "bias") else case.dtype
            strided = case.shape.strided and name in ("x", "residual")
            t = self.tensor(inp[name], dt, strided)
            if name in case.trained:
                t.requires_grad_(True)
            args[name] = t
        with normkit.record_launches() as log, poisoned_outputs():
            outs = apply_op(tf, case, args)
            grads_out = [self.tensor(inp["dy"], case.dtype)]
            if case.spec.has_residual:
                grads_out.append(self.tensor(inp["ds"], case.dtype))
            if case.trained:
                torch.autograd.backward(list(outs.values()), grads_out)
        return Result(
            outputs={k: _np(v) for k, v in outs.items()},
            grads={name: _np(args[name].grad) for name in case.inputs},
            log=log,
        )
