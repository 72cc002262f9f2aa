"""Running the compiled-mode kernels in Triton's interpreter (CPU arrays, on any machine).

Everything normkit changes in Triton lives here, is applied only while an interpreted launch runs,
and only for the Triton versions it was written against.
"""
from __future__ import annotations

import functools

import numpy as np


def is_interpreted(kernel) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def _f32_to_bf16_rtne(data):
    u = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(data), np.uint16(0x7FC0), rounded)


def _cast_rtne(cast_impl):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(_f32_to_bf16_rtne(src.data), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    return cast


class _Interpreted:
    """A compiled-mode kernel run by Triton's interpreter, e.g. for CPU arrays on any machine.

    Two things are patched while (and only while) the interpreter runs one of these launches:

    - Triton's interpreter can run a kernel defined without TRITON_INTERPRET, but the kernel's calls
      into ``triton.language``'s own jit functions (``tl.sum``) are then JITFunctions, which refuse
      to be called outside a compiled kernel. Such a call is treated as what it is there: a
      device-function call, interpreted as well.
    - Triton 3.6's interpreter converts fp32 to bf16 by truncation, where compiled code rounds to
      nearest even; the interpreter would then drift by up to an ulp per rounding. The conversion
      is replaced by a round-to-nearest-even one.
    """

    def __init__(self, kernel):
        from triton.runtime.interpreter import InterpretedFunction

        self.kernel = kernel if isinstance(kernel, InterpretedFunction) else InterpretedFunction(kernel.fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction

            from triton.runtime import interpreter

            saved_call, saved_cast = JITFunction.__call__, interpreter.InterpreterBuilder.cast_impl
            JITFunction.__call__ = lambda fn, *a, **k: InterpretedFunction(fn.fn)(*a, **k)
            interpreter.InterpreterBuilder.cast_impl = _cast_rtne(saved_cast)
            try:
                with np.errstate(all="ignore"):  # NaN/Inf in the data propagate silently, as on a GPU
                    return self.kernel[grid](*args, **kwargs)
            finally:
                JITFunction.__call__ = saved_call
                interpreter.InterpreterBuilder.cast_impl = saved_cast

        return launch


@functools.lru_cache(maxsize=None)
def interpreted(kernel) -> _Interpreted:
    """The same kernel source, run by Triton's interpreter (CPU arrays)."""
    return _Interpreted(kernel)
