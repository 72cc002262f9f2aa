"""The Torch backend of ``normkit.driver``: row views and copies, allocation with torch, launches compiled
(CUDA) or interpreted (CPU).

Compiled launches skip Triton's ``JITFunction.run`` (which re-binds and re-specializes every argument
on every call, ~20 us of host time): the kernel Triton compiled for 16-byte-aligned pointers (the
plan fixes every other specialization: strides, flags, sizes) is kept on the plan, and its C
launcher is called directly with the pointers as integers (``_DirectLaunch``). Unaligned pointers,
a launch hook (profilers), or a Triton version this was not written for take the ordinary path.
"""
from __future__ import annotations

import functools
import operator
import warnings

import torch

from normkit import _interpreter, driver, record
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


class NormkitCopyWarning(UserWarning):
    """An input could not be read in place (its last dimension is neither contiguous nor broadcast,
    its leading dimensions do not share one stride, or it is a lazily negated view) and was copied."""


def row_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[M, D]`` rows without a copy (its last dimension contiguous or broadcast, its leading
    dimensions one stride), or None where that needs a copy."""
    D = t.shape[-1]
    if D > 1 and t.stride(-1) not in (0, 1):
        return None
    try:
        return t.view(-1, D)
    except RuntimeError:
        return None


def copy_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` copied into contiguous ``[M, D]`` rows, with a ``NormkitCopyWarning`` naming it."""
    D = t.shape[-1]
    why = ("its last dimension is neither contiguous nor broadcast" if D > 1 and t.stride(-1) not in (0, 1) else
           "it cannot be viewed as rows of one stride")
    warnings.warn(f"normkit: {name} of shape {tuple(t.shape)} has strides {t.stride()}; {why}, so it is copied",
                  NormkitCopyWarning, stacklevel=6)
    return t.reshape(-1, D).contiguous()


def resolve_neg(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """``t`` with torch's lazy negation applied. A negated view (``z.conj().imag``) holds ``-t`` in
    its memory's sign bits only as a flag; a kernel reading the memory would see ``t``'s negation."""
    if t is None or not t.is_neg():
        return t
    warnings.warn(
        f"normkit: {name} of shape {tuple(t.shape)} is a lazily negated view (is_neg()), so it is copied with "
        "the negation applied", NormkitCopyWarning, stacklevel=5)
    return t.resolve_neg()


def keys(*tensors) -> tuple:
    """What a plan fixes of each tensor: class, shape, strides, dtype and device (None for None)."""
    out = []
    for t in tensors:  # a loop: a comprehension would be a call of its own, on every backward
        out.append(None if t is None else (t.__class__, t.shape, t.stride(), t.dtype, t.device))
    return tuple(out)


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
    def describe(*arrays) -> tuple:
        out = []
        for a in arrays:
            out.append(None if a is None else (dtype_name(a.dtype), a.stride()))
        return tuple(out)

    @staticmethod
    def zeros(shape, dtype: str, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(shape, dtype=TORCH_DTYPES[dtype], device=like.device)

    rows = staticmethod(row_view)
    copy_rows = staticmethod(copy_rows)
    keys = staticmethod(keys)

    @staticmethod
    def launch(call: KernelCall, arrays: dict, rows_shape: tuple | None = None) -> dict:
        """``rows_shape``: the caller's ``(..., N)`` shape, in which the row outputs are allocated
        (the same memory layout as the planned ``[M, N]``); see ``normkit.driver.Backend``."""
        prep = _prepared(call)
        launch = prep.bound(call, arrays[prep.first_input].device, rows_shape)
        outs = launch(*[arrays[name] if present else None for name, present in prep.inputs])
        return {name: t for name, t in zip(call.outputs, outs) if t is not None}

    @staticmethod
    def bind(call: KernelCall, like: torch.Tensor, rows_shape: tuple | None = None) -> "_BoundLaunch":
        """``call`` bound to ``like``'s device and its outputs' shapes: ``launch(*inputs)`` (the arrays in
        ``call.inputs`` order) returns the outputs in ``call.outputs`` order; see ``normkit.driver.Backend``."""
        return _prepared(call).bound(call, like.device, rows_shape)


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


def _prepared(call: KernelCall) -> "_Prepared":
    prep = call.cache.get("torch")
    if prep is None:
        prep = call.cache["torch"] = _Prepared(call)
    return prep


def _outputs(call: KernelCall, arrays: dict, rows_shape: tuple | None = None) -> tuple:
    """``(prepared plan, device, outputs)``: every output allocated once, in ``call.out_specs`` order
    (NaN-filled under ``driver.POISON_OUTPUTS``)."""
    prep = _prepared(call)
    device = arrays[prep.first_input].device
    allocs = prep.allocs if rows_shape is None else prep.allocs_in(rows_shape)
    outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in allocs]
    if driver.POISON_OUTPUTS:
        for t in outs:
            t.fill_(float("nan"))
    return prep, device, outs


class _Prepared:
    """What the Torch backend derives once per plan: allocation specs, argument slots, and the
    plan's launches bound per device and output shape."""

    def __init__(self, call: KernelCall):
        self.first_input = next(name for name in call.inputs if name in call.present_inputs)
        self.inputs = [(name, name in call.present_inputs) for name in call.inputs]
        self.present = tuple(present for _, present in self.inputs)
        self.out_names = list(call.out_specs)
        self.allocs = [(tuple(shape), TORCH_DTYPES[dtype]) for shape, dtype in call.out_specs.values()]
        self._allocs_in: dict = {}
        self.out_slots = [self.out_names.index(name) if name in call.out_specs else None for name in call.outputs]
        self.interpreted = _interpreter.is_interpreted(call.kernel)  # TRITON_INTERPRET=1 made it interpreted
        self.direct: dict = {}  # device index -> _DirectLaunch of the kernel compiled for aligned pointers
        self._bound: dict = {}  # (device, rows_shape) -> _BoundLaunch

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

    def bound(self, call: KernelCall, device: torch.device, rows_shape: tuple | None) -> "_BoundLaunch":
        """The plan's launch on ``device`` with its outputs in ``rows_shape``; remembered."""
        key = (device, rows_shape)
        launch = self._bound.get(key)
        if launch is None:
            launch = self._bound[key] = _BoundLaunch(call, self, device, rows_shape)
        return launch


class _BoundLaunch:
    """One plan bound to a device and to its outputs' shapes, everything a launch does not read from
    the arrays derived up front: ``launch(*inputs)`` takes the arrays in ``call.inputs`` order
    (absent inputs are not read), allocates the outputs, launches, and returns the outputs in
    ``call.outputs`` order (None where absent).

    On CUDA, once Triton has compiled the kernel for 16-byte-aligned pointers (the specialization
    every tensor from torch's allocator gets), later launches with aligned pointers call its C
    launcher directly (``_DirectLaunch``); anything else (unaligned pointers, another current
    device, launch hooks such as a profiler's) takes Triton's own path."""

    __slots__ = ("call", "prep", "index", "compiled", "present", "allocs", "direct")

    def __init__(self, call: KernelCall, prep: _Prepared, device: torch.device, rows_shape: tuple | None):
        self.call, self.prep, self.present = call, prep, prep.present
        self.compiled = device.type == "cuda" and not prep.interpreted
        self.index = device.index  # a CUDA tensor's device always has its index
        self.direct = None  # the plan's _DirectLaunch on this device, once Triton has compiled it
        allocs = prep.allocs if rows_shape is None else prep.allocs_in(rows_shape)
        by_name = dict(zip(prep.out_names, allocs))
        self.allocs = [_allocator(*by_name[name], device) if name in by_name else None for name in call.outputs]

    def __call__(self, *inputs) -> list:
        outs = [alloc() if alloc is not None else None for alloc in self.allocs]
        if driver.POISON_OUTPUTS:
            for t in outs:
                if t is not None:
                    t.fill_(float("nan"))
        direct = self.direct
        if direct is not None and self.index == torch._C._cuda_getDevice() and _no_hooks():
            in_ptrs = [a.data_ptr() if present else None for a, present in zip(inputs, self.present)]
            if not functools.reduce(operator.or_, filter(None, in_ptrs), 0) & 15:  # outputs: torch's allocator, aligned
                direct(torch._C._cuda_getCurrentRawStream(self.index), in_ptrs,
                       [t.data_ptr() if t is not None else None for t in outs])
                if record.active():
                    self.call.record("torch", False)
                return outs
        self._launch(inputs, outs)
        return outs

    def _launch(self, inputs: tuple, outs: list) -> None:
        """The launch through Triton: its interpreter (CPU), or its own launcher (which compiles the
        kernel on first use; once compiled for aligned pointers, the direct launch is kept)."""
        call, index = self.call, self.index
        args = [a if present else None for a, present in zip(inputs, self.present)]
        args += call.scalars
        args += outs
        if not self.compiled:
            _interpreter.interpreted(call.kernel)[call.grid](*args, **call.constexprs, num_warps=call.num_warps,
                                                             num_stages=call.num_stages)
            if record.active():
                call.record("torch", True)
            return
        if index != torch._C._cuda_getDevice():
            with torch.cuda.device(index):
                call.kernel[call.grid](*args, **call.constexprs, num_warps=call.num_warps, num_stages=call.num_stages,
                                       enable_fp_fusion=call.fp_fusion)
        else:
            compiled = call.kernel[call.grid](*args, **call.constexprs, num_warps=call.num_warps,
                                              num_stages=call.num_stages, enable_fp_fusion=call.fp_fusion)
            direct = self.prep.direct.get(index)
            if (direct is None and _FAST_OK and compiled is not None
                    and not any(a.data_ptr() & 15 for a in args if isinstance(a, torch.Tensor))):
                direct = self.prep.direct[index] = _DirectLaunch.of(call, compiled)
            if direct:  # False: a kernel Triton's launcher must launch
                self.direct = direct
        if record.active():
            call.record("torch", False)


def _allocator(shape: tuple, dtype: torch.dtype, device: torch.device):
    """``torch.empty`` of ``shape`` bound: called with the sizes as separate arguments, which torch's
    argument parser takes faster than a tuple."""
    if not shape:
        return functools.partial(torch.empty, (), dtype=dtype, device=device)
    return functools.partial(torch.empty, *shape, dtype=dtype, device=device)


class _DirectLaunch:
    """A compiled kernel's C launch function with everything but the stream and the pointers bound:
    the call Triton 3.6's ``CompiledKernel.run`` makes (``JITFunction.run``), given pointers as
    integers (the launcher then neither calls ``data_ptr()`` nor asks the driver about each one)."""

    __slots__ = ("c_launch", "grid", "bound", "scalars", "constexprs")

    @classmethod
    def of(cls, call: KernelCall, compiled):
        """The direct launch of ``compiled``, or False where Triton's launcher does more than launch
        (a kernel that needs scratch memory): then every launch takes Triton's own path."""
        launcher = compiled.run
        if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
            return False
        self = cls()
        self.c_launch, self.grid = launcher.launch, call.grid[0]
        # after the stream: function, cooperative, pdl, global and profile scratch, packed metadata,
        # launch metadata, enter and exit hooks
        self.bound = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                      compiled.packed_metadata, None, None, None)
        self.scalars, self.constexprs = call.scalars, tuple(call.constexprs.values())
        return self

    def __call__(self, stream: int, in_ptrs: list, out_ptrs: list) -> None:
        self.c_launch(self.grid, 1, 1, stream, *self.bound, *in_ptrs, *self.scalars, *out_ptrs, *self.constexprs)


def _no_hooks() -> bool:
    runtime = _knobs.runtime
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return ((enter is None or not getattr(enter, "calls", True))
            and (exit_ is None or not getattr(exit_, "calls", True)))


try:  # the direct launch follows Triton 3.6's JITFunction.run; other versions use the ordinary path
    import triton
    from triton import knobs as _knobs

    _FAST_OK = triton.__version__.startswith("3.6.")
except ImportError:  # pragma: no cover
    _FAST_OK = False


BACKEND = TorchBackend()
INDUCTOR_BACKEND = InductorBackend()
