"""The Torch backend of ``normkit.driver``: row views and copies, allocation with torch, launches compiled
(CUDA) or interpreted (CPU).

A plan bound to a device and to its outputs' shapes (``TorchBackend.bind``: a ``_BoundLaunch``)
launches, once Triton has compiled its kernel for 16-byte-aligned pointers (the plan fixes every
other specialization: strides, flags, sizes), through that compiled kernel's own launch
(``CompiledKernel[grid]``), which skips ``JITFunction.run``'s argument binding and specialization
on every call. Unaligned pointers, another current device, or a Triton launch hook (a profiler's)
take ``JITFunction.run``. ``LAUNCH = "direct"`` launches through the C launcher with the pointers as
integers instead (``normkit._compat.direct_launch``; Triton 3.6 only).
"""
from __future__ import annotations

import functools
import operator
import warnings

import torch

from normkit import _compat as _triton_compat
from normkit import driver, record, rope
from normkit.launch import INTERPRETER_NUM_SMS, KernelCall
from torch_frontend import _compat

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


class NormkitCopyWarning(UserWarning):
    """An input could not be read in place (its last dimension is neither contiguous nor broadcast,
    its leading dimensions do not share one stride, or it is a lazily negated view) and was copied.
    The backward reads an output gradient whose leading dimensions merge into three row indices in
    place (``three_index_view``)."""


class NormkitRopeTablesWarning(UserWarning):
    """``rms_norm_rope``'s output-keeping forward found cos/sin with a pair of columns that is not a usable
    rotation (``normkit.norm_math.rope_table_usable``): that call's backward gave those rows a NaN dx,
    and from then on ``save="auto"`` keeps x for ``rms_norm_rope`` in the process
    (``torch_frontend._bound.ROPE_TABLES_KEEP_X``)."""


def _columns_in_place(t: torch.Tensor) -> bool:
    """Whether the kernels read ``t``'s last dimension as it lies: contiguous or broadcast (or of one column)."""
    return t.shape[-1] <= 1 or t.stride(-1) in (0, 1)


def row_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[M, D]`` rows without a copy (its last dimension contiguous or broadcast, its leading
    dimensions one stride), or None where that needs a copy."""
    D = t.shape[-1]
    if not _columns_in_place(t):
        return None
    try:
        return t.view(-1, D)
    except RuntimeError:
        return None


def three_index_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[n0, n1, n2, D]`` rows of three indices without a copy (its last dimension contiguous
    or broadcast, its leading dimensions merged, in their order, into at most three groups:
    ``normkit.rope.row_layout``), or None where that needs a copy. A [B, S, H, D] view of a
    [B, H, S, D] buffer (attention's output gradient) is one."""
    if not _columns_in_place(t):
        return None
    layout = rope.row_layout(tuple(t.shape[:-1]), t.stride()[:-1], in_order=True)
    if layout is None:
        return None
    return t.view(*layout.rows, t.shape[-1])


def copy_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` copied into contiguous ``[M, D]`` rows, with a ``NormkitCopyWarning`` naming it."""
    D = t.shape[-1]
    why = ("its last dimension is neither contiguous nor broadcast" if not _columns_in_place(t) else
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
    """What a plan fixes of each tensor: class, shape, strides, dtype and device, and whether it is a
    lazily negated view, which a kernel cannot read (None for None)."""
    out = []
    for t in tensors:  # a loop: a comprehension would be a call of its own, on every backward
        out.append(None if t is None else (t.__class__, t.shape, t.stride(), t.dtype, t.device, t.is_neg()))
    return tuple(out)


def backward_key(grads, saved, weight, bias, aux, rstd, dy, dres) -> tuple:
    """``Bound.backward``'s key: ``grads`` and, of each array the backward reads, ``keys``' facts, the
    device as its index (``get_device``: -1 for the CPU; an int hashes faster than a device, and the
    backward's arrays are on the device type of the forward's, or a hook moved them off the GPU), in
    one flat tuple built inline (every backward makes one; a tensor's six facts, or one None)."""
    return (grads, saved.__class__, saved.shape, saved.stride(), saved.dtype, saved.get_device(), saved.is_neg(),
            None if weight is None else (weight.__class__, weight.shape, weight.stride(), weight.dtype,
                                         weight.get_device(), weight.is_neg()),
            None if bias is None else (bias.__class__, bias.shape, bias.stride(), bias.dtype, bias.get_device(),
                                       bias.is_neg()),
            None if aux is None else (aux.__class__, aux.shape, aux.stride(), aux.dtype, aux.get_device(),
                                      aux.is_neg()),
            None if rstd is None else (rstd.__class__, rstd.shape, rstd.stride(), rstd.dtype, rstd.get_device(),
                                       rstd.is_neg()),
            dy.__class__, dy.shape, dy.stride(), dy.dtype, dy.get_device(), dy.is_neg(),
            None if dres is None else (dres.__class__, dres.shape, dres.stride(), dres.dtype, dres.get_device(),
                                       dres.is_neg()))


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
    three_index_rows = staticmethod(three_index_view)
    copy_rows = staticmethod(copy_rows)
    keys = staticmethod(keys)
    backward_key = staticmethod(backward_key)

    @staticmethod
    def launch(call: KernelCall, arrays: dict, rows_shape: tuple | None = None, outs: dict | None = None) -> dict:
        """``rows_shape``: the caller's ``(..., N)`` shape, in which the row outputs are allocated
        (the same memory layout as the planned ``[M, N]``); see ``normkit.driver.Backend``. ``outs``:
        the outputs, allocated by the caller as the plan's strides say (``rms_norm_rope``'s, laid out
        like x), instead. The bound launch is kept on the plan (``KernelCall.cache``) per device and
        shape."""
        like = arrays[next(name for name in call.inputs if name in call.present_inputs)]
        key = ("torch", like.device, rows_shape)
        launch = call.cache.get(key)
        if launch is None:
            launch = call.cache[key] = _BoundLaunch(call, like.device, rows_shape)
        given = None if outs is None else [outs.get(name) for name in call.outputs]
        result = launch(*[arrays.get(name) for name in call.inputs], outs=given)
        return {name: t for name, t in zip(call.outputs, result) if t is not None}

    @staticmethod
    def bind(call: KernelCall, like: torch.Tensor, rows_shape: tuple | None = None, tail: tuple = ()) -> "_BoundLaunch":
        """``call`` bound to ``like``'s device and its outputs' shapes, and to ``tail``, its last inputs:
        ``launch(*inputs)`` (the other arrays in ``call.inputs`` order) returns the outputs in
        ``call.outputs`` order; see ``normkit.driver.Backend``."""
        return _BoundLaunch(call, like.device, rows_shape, tail)


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
        device = arrays[next(name for name in call.inputs if name in call.present_inputs)].device
        outs = [_empty(driver.caller_shape(name, shape, rows_shape) if rows_shape else shape, dtype, device)
                for name, (shape, dtype) in call.out_specs.items()]
        by_name = dict(zip(call.out_specs, outs))
        args = [arrays.get(name) if name in call.present_inputs else None for name in call.inputs]
        args += list(call.scalars)
        args += [by_name.get(name) for name in call.outputs]
        torch.library.wrap_triton(call.kernel)[call.grid](*args, **call.constexprs, num_warps=call.num_warps,
                                                          num_stages=call.num_stages)
        call.record("torch", False)
        return by_name


def _empty(shape: tuple, dtype: str, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=TORCH_DTYPES[dtype], device=device)
    if driver.POISON_OUTPUTS:
        t.fill_(float("nan"))
    return t


# "direct": normkit._compat.direct_launch (Triton 3.6; elsewhere, and under launch hooks, the compiled kernel's
# own launch); "triton": always the compiled kernel's own launch. "direct" is the default because it
# spends less host time per forward + backward: the launch A/B in docs/PERFORMANCE_RECORD.md ("The
# launch paths", under "The weight's recovery in the forward, one safety rule, and the launch paths")
# chose it.
LAUNCH = "direct"


class _BoundLaunch:
    """One plan bound to a device and to its outputs' shapes, everything a launch does not read from
    the arrays derived up front: ``launch(*inputs)`` takes the arrays in ``call.inputs`` order
    (absent inputs are not read), allocates the outputs, launches, and returns the outputs in
    ``call.outputs`` order (None where absent).

    On CUDA, once Triton has compiled the kernel for 16-byte-aligned pointers (the specialization
    every tensor from torch's allocator gets), later launches with aligned pointers go through the
    compiled kernel's own launch (or ``LAUNCH = "direct"``'s); anything else (unaligned pointers,
    another current device, launch hooks such as a profiler's) takes ``JITFunction.run``."""

    __slots__ = ("call", "present", "index", "compiled", "allocs", "none", "runner", "direct", "scalars", "tail",
                 "arrays")

    def __init__(self, call: KernelCall, device: torch.device, rows_shape: tuple | None, tail: tuple = ()):
        self.call = call
        self.tail = tail  # the last inputs, bound: a call passes the others
        self.present = tuple(name in call.present_inputs for name in call.inputs)
        self.compiled = device.type == "cuda" and not _triton_compat.is_interpreted(call.kernel)
        self.index = device.index  # a CUDA tensor's device always has its index
        allocs = [None if name not in call.out_specs else _allocator(
            driver.caller_shape(name, call.out_specs[name][0], rows_shape) if rows_shape is not None
            else tuple(call.out_specs[name][0]), TORCH_DTYPES[call.out_specs[name][1]], device)
            for name in call.outputs]
        self.allocs = tuple((i, alloc) for i, alloc in enumerate(allocs) if alloc is not None)  # (position, alloc)
        self.none = [None] * len(allocs)  # the outputs' list before allocation
        self.runner = None  # the compiled kernel's launch, once Triton has compiled it for aligned pointers
        self.direct = None  # LAUNCH == "direct": normkit._compat.direct_launch of it
        self.scalars = tuple(call.scalars)
        self.arrays = None  # interpreted: the inputs' dtypes and devices at the first launch

    def __call__(self, *inputs, outs: list | None = None) -> list:
        """``outs``: the outputs in ``call.outputs`` order, allocated by the caller (None: allocated here)."""
        if outs is None:
            outs = self.none[:]
            for i, alloc in self.allocs:  # a loop: a comprehension would be a call of its own
                outs[i] = alloc()
            if driver.POISON_OUTPUTS:
                for t in outs:
                    if t is not None:
                        t.fill_(float("nan"))
        if self.tail:
            inputs += self.tail
        direct = self.direct
        if direct is not None and self.index == _compat.current_device() and not _triton_compat.launch_hooks_active():
            in_ptrs = [a.data_ptr() if present else None for a, present in zip(inputs, self.present)]
            if not functools.reduce(operator.or_, filter(None, in_ptrs), 0) & 15:
                direct(_compat.raw_stream(self.index), in_ptrs, [None if t is None else t.data_ptr() for t in outs])
                if record.active():
                    self.call.record("torch", False)
                return outs
        elif self.runner is not None and self.index == _compat.current_device():
            args = [a if present else None for a, present in zip(inputs, self.present)]
            if not functools.reduce(operator.or_, [a.data_ptr() for a in args if a is not None], 0) & 15:
                self.runner(*args, *self.scalars, *outs, *self.call.constexprs.values())
                if record.active():
                    self.call.record("torch", False)
                return outs
        self._launch(inputs, outs)
        return outs

    def _launch(self, inputs: tuple, outs: list) -> None:
        """The launch through Triton: its interpreter (CPU), or ``JITFunction.run`` (which compiles the
        kernel on first use; once compiled for aligned pointers, its own launch is kept)."""
        call, index = self.call, self.index
        args = [a if present else None for a, present in zip(inputs, self.present)]
        args += call.scalars
        args += outs
        if not self.compiled:
            # A compiled launch reads pointers with the dtypes of its first launch (Triton specializes on
            # them, and the kernel's runner is kept); the interpreter reads each array as it is. So that
            # the CPU tests see what a GPU would misread, every interpreted launch must pass arrays of
            # its first launch's dtypes and devices.
            arrays = tuple(None if a is None else (a.dtype, a.device) for a in args
                           if a is None or isinstance(a, torch.Tensor))
            if self.arrays is None:
                self.arrays = arrays
            elif arrays != self.arrays:
                raise RuntimeError(f"normkit: internal error: {call.kernel.__name__} bound for arrays of "
                                   f"{self.arrays} was given {arrays}")
            _triton_compat.interpreted(call.kernel)[call.grid](*args, **call.constexprs, num_warps=call.num_warps,
                                                               num_stages=call.num_stages)
            if record.active():
                call.record("torch", True)
            return
        if index != _compat.current_device():
            with torch.cuda.device(index):
                call.kernel[call.grid](*args, **call.constexprs, num_warps=call.num_warps, num_stages=call.num_stages,
                                       enable_fp_fusion=call.fp_fusion)
        else:
            compiled = call.kernel[call.grid](*args, **call.constexprs, num_warps=call.num_warps,
                                              num_stages=call.num_stages, enable_fp_fusion=call.fp_fusion)
            if (self.runner is None and compiled is not None and not _triton_compat.launch_hooks_active()
                    and not any(a.data_ptr() & 15 for a in args if isinstance(a, torch.Tensor))):
                self.runner = compiled[(*call.grid, 1, 1)[:3]]
                if LAUNCH == "direct":
                    self.direct = _triton_compat.direct_launch(compiled, call.grid[0], tuple(call.scalars),
                                                               tuple(call.constexprs.values()))
        if record.active():
            call.record("torch", False)


def _allocator(shape: tuple, dtype: torch.dtype, device: torch.device):
    """``torch.empty`` of ``shape`` bound: called with the sizes as separate arguments, which torch's
    argument parser takes faster than a tuple."""
    if not shape:
        return functools.partial(torch.empty, (), dtype=dtype, device=device)
    return functools.partial(torch.empty, *shape, dtype=dtype, device=device)


BACKEND = TorchBackend()
INDUCTOR_BACKEND = InductorBackend()
