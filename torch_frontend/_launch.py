"""Allocate outputs and launch a normkit.launch plan on torch tensors."""
from __future__ import annotations

import functools

import numpy as np
import torch

from normkit import launch as plans

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
CPU_NUM_SMS = 4  # "SM" count the interpreter plans with: a few programs, each looping over tiles


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@functools.lru_cache(maxsize=None)
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return CPU_NUM_SMS


def run(call: plans.KernelCall, arrays: dict, device: torch.device) -> dict:
    """Launch ``call`` reading ``arrays`` (name -> tensor); return its outputs (name -> tensor)."""
    outs = {
        name: torch.empty(shape, dtype=TORCH_DTYPES[dtype], device=device)
        for name, (shape, dtype) in call.out_specs.items()
    }
    if plans.poison():
        for t in outs.values():
            t.fill_(float("nan"))
    args = [arrays[name] if name in call.present_inputs else None for name in call.inputs]
    args += [float(np.float32(v)) if name in plans.FLOAT_SCALARS else int(v) for name, v in call.scalars]
    args += [outs.get(name) for name in call.outputs]
    interpret = device.type != "cuda" or plans.is_interpreted(call.kernel)
    kernel = plans.interpreted(call.kernel) if interpret else call.kernel
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            kernel[call.grid](*args, **call.constexprs, num_warps=call.num_warps, num_stages=call.num_stages)
    else:
        kernel[call.grid](*args, **call.constexprs, num_warps=call.num_warps, num_stages=call.num_stages)
    call.record("torch", interpret)
    return outs

