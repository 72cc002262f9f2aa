"""The Torch backend of ``normkit.driver``: allocate with torch, launch compiled (CUDA) or interpreted (CPU).

Compiled launches skip Triton's ``JITFunction.run`` (which re-binds and re-specializes every argument
on every call, ~20 us of host time): the kernel Triton compiled for 16-byte-aligned pointers (the
plan fixes every other specialization: strides, flags, sizes) is kept on the plan, and its C
launcher is called directly with the pointers as integers (``_DirectLaunch``). Unaligned pointers,
a launch hook (profilers), or a Triton version this was not written for take the ordinary path.
"""
from __future__ import annotations

import functools

import torch

from normkit import _interpreter, driver
from normkit.launch import INTERPRETER_NUM_SMS, KernelCall

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def nd_shape(name: str, shape: tuple, buffer_shape: tuple) -> tuple:
    """A buffer's shape over the caller's leading shape: rows (M, N) -> shape, statistics (M,) -> shape[:-1]."""
    if len(buffer_shape) == 2 and name not in ("DW_PART", "DB_PART"):
        return tuple(shape)
    if name in ("MEAN", "RSTD"):
        return tuple(shape[:-1])
    return tuple(buffer_shape)


@functools.lru_cache(maxsize=None)
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_NUM_SMS


class TorchBackend:
    frontend = "torch"

    @staticmethod
    def num_sms(like: torch.Tensor) -> int:
        return num_sms(like.device)

    @staticmethod
    def dtype(a: torch.Tensor) -> str:
        return dtype_name(a.dtype)

    @staticmethod
    def strides(a: torch.Tensor) -> tuple[int, ...]:
        return a.stride()

    @staticmethod
    def zeros(shape, dtype: str, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(shape, dtype=TORCH_DTYPES[dtype], device=like.device)

    @staticmethod
    def launch(call: KernelCall, arrays: dict, rows_shape: tuple | None = None) -> dict:
        """``rows_shape``: the caller's ``(..., N)`` shape, in which the row outputs are allocated
        (the same memory layout as the planned ``[M, N]``); see ``normkit.driver.Backend``."""
        prep, device, outs = _outputs(call, arrays, rows_shape)
        if device.type != "cuda" or prep.interpreted:
            _interpreter.interpreted(call.kernel)[call.grid](*prep.args(call, arrays, outs), **call.constexprs,
                                                            num_warps=call.num_warps, num_stages=call.num_stages)
            call.record("torch", True)
        else:
            _launch_cuda(call, prep, device.index, arrays, outs)  # a CUDA tensor's device always has its index
            call.record("torch", False)
        return dict(zip(prep.out_names, outs))


class InductorBackend(TorchBackend):
    """The backend inside the ``torch.library.triton_op`` ops that ``torch.compile`` uses on CUDA.

    Each launch goes through ``torch.library.wrap_triton``: Inductor traces it (on fake tensors) and
    emits the kernel call into its own generated code, so a compiled model launches normkit's kernels
    without a Python trampoline, and CUDA graphs (``mode="reduce-overhead"``) capture them. Outside
    tracing (a triton_op called eagerly) ``wrap_triton`` launches the kernel the ordinary way.

    Inductor compiles the kernel with its own options: Triton's default FMA contraction applies to
    every kernel (the eager LayerNorm backward turns it off for bitwise agreement with JAX), so a
    compiled LayerNorm backward may differ from the eager one in the last bits. It also types the
    float scalars (eps, offset) fp64; the kernels round them to fp32 first, so the row math is the
    eager math (``tests/test_codegen.py``).
    """

    @staticmethod
    def launch(call: KernelCall, arrays: dict, rows_shape: tuple | None = None) -> dict:
        prep, _, outs = _outputs(call, arrays, rows_shape)
        torch.library.wrap_triton(call.kernel)[call.grid](*prep.args(call, arrays, outs), **call.constexprs,
                                                          num_warps=call.num_warps, num_stages=call.num_stages)
        call.record("torch", False)
        return dict(zip(prep.out_names, outs))


def _outputs(call: KernelCall, arrays: dict, rows_shape: tuple | None = None) -> tuple:
    """``(prepared plan, device, outputs)``: every output allocated once, in ``call.out_specs`` order
    (NaN-filled under ``driver.POISON_OUTPUTS``)."""
    prep = call.cache.get("torch")
    if prep is None:
        prep = call.cache["torch"] = _Prepared(call)
    device = arrays[prep.first_input].device
    allocs = prep.allocs if rows_shape is None else prep.allocs_in(rows_shape)
    outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in allocs]
    if driver.POISON_OUTPUTS:
        for t in outs:
            t.fill_(float("nan"))
    return prep, device, outs


class _Prepared:
    """What the Torch backend derives once per plan: allocation specs and argument slots."""

    def __init__(self, call: KernelCall):
        self.first_input = next(name for name in call.inputs if name in call.present_inputs)
        self.inputs = [(name, name in call.present_inputs) for name in call.inputs]
        self.out_names = list(call.out_specs)
        self.allocs = [(tuple(shape), TORCH_DTYPES[dtype]) for shape, dtype in call.out_specs.values()]
        self._allocs_in: dict = {}
        self.out_slots = [self.out_names.index(name) if name in call.out_specs else None for name in call.outputs]
        self.interpreted = _interpreter.is_interpreted(call.kernel)  # TRITON_INTERPRET=1 made it interpreted
        self.direct: dict = {}  # device index -> _DirectLaunch of the kernel compiled for aligned pointers

    def args(self, call: KernelCall, arrays: dict, outs: list) -> list:
        """The kernel's positional arguments: inputs (None where absent), scalars, outputs."""
        args = [arrays[name] if present else None for name, present in self.inputs]
        args += call.scalars
        args += [outs[i] if i is not None else None for i in self.out_slots]
        return args

    def allocs_in(self, rows_shape: tuple) -> list:
        """``allocs`` with the row outputs in ``rows_shape`` (the caller's ``(..., N)``) and the per-row
        statistics in ``rows_shape[:-1]``; remembered per shape (a plan serves one M, so few shapes)."""
        allocs = self._allocs_in.get(rows_shape)
        if allocs is None:
            allocs = self._allocs_in[rows_shape] = [
                (nd_shape(name, rows_shape, shape), dtype) for name, (shape, dtype) in zip(self.out_names, self.allocs)]
        return allocs


def _launch_cuda(call: KernelCall, prep: _Prepared, index: int, arrays: dict, outs: list) -> None:
    """Launch on CUDA device ``index``. Once Triton has compiled the kernel for 16-byte-aligned
    pointers (the specialization every tensor from torch's allocator gets), later launches with
    aligned pointers call its C launcher directly (``_DirectLaunch``); anything else (unaligned
    pointers, another current device, launch hooks such as a profiler's) takes Triton's own path."""
    direct = prep.direct.get(index)
    if direct and index == torch._C._cuda_getDevice() and _no_hooks():
        in_ptrs = [arrays[name].data_ptr() if present else None for name, present in prep.inputs]
        if not any(p & 15 for p in in_ptrs if p):  # outputs come from torch's allocator: aligned
            out_ptrs = [outs[i].data_ptr() if i is not None else None for i in prep.out_slots]
            direct(torch._C._cuda_getCurrentRawStream(index), in_ptrs, out_ptrs)
            return
    args = prep.args(call, arrays, outs)
    if index != torch._C._cuda_getDevice():
        with torch.cuda.device(index):
            compiled = call.kernel[call.grid](*args, **call.constexprs, num_warps=call.num_warps,
                                              num_stages=call.num_stages, enable_fp_fusion=call.fp_fusion)
        return
    compiled = call.kernel[call.grid](*args, **call.constexprs, num_warps=call.num_warps, num_stages=call.num_stages,
                                      enable_fp_fusion=call.fp_fusion)
    if (direct is None and _FAST_OK and compiled is not None
            and not any(a.data_ptr() & 15 for a in args if isinstance(a, torch.Tensor))):
        prep.direct[index] = _DirectLaunch.of(call, compiled)


class _DirectLaunch:
    """A compiled kernel's C launch function with everything but the stream and the pointers bound:
    the call Triton 3.6's ``CompiledKernel.run`` makes (``JITFunction.run``), given pointers as
    integers (the launcher then neither calls ``data_ptr()`` nor asks the driver about each one)."""

    __slots__ = ("c_launch", "grid", "function", "coop", "pdl", "packed", "scalars", "constexprs")

    @classmethod
    def of(cls, call: KernelCall, compiled):
        """The direct launch of ``compiled``, or False where Triton's launcher does more than launch
        (a kernel that needs scratch memory): then every launch takes Triton's own path."""
        launcher = compiled.run
        if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
            return False
        self = cls()
        self.c_launch, self.grid, self.function = launcher.launch, call.grid[0], compiled.function
        self.coop, self.pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        self.packed, self.scalars, self.constexprs = compiled.packed_metadata, call.scalars, tuple(call.constexprs.values())
        return self

    def __call__(self, stream: int, in_ptrs: list, out_ptrs: list) -> None:
        self.c_launch(self.grid, 1, 1, stream, self.function, self.coop, self.pdl, None, None, self.packed, None, None,
                      None, *in_ptrs, *self.scalars, *out_ptrs, *self.constexprs)


def _no_hooks() -> bool:
    hooks = (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook)
    return all(h is None or not getattr(h, "calls", True) for h in hooks)


try:  # the direct launch follows Triton 3.6's JITFunction.run; other versions use the ordinary path
    import triton
    from triton import knobs as _knobs

    _FAST_OK = triton.__version__.startswith("3.6.")
except ImportError:  # pragma: no cover
    _FAST_OK = False


BACKEND = TorchBackend()
INDUCTOR_BACKEND = InductorBackend()
