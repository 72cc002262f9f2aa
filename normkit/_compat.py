"""Triton's private entry points, fenced: every bet normkit makes on Triton internals is in this file.

- Running the compiled-mode kernels in Triton's interpreter (CPU arrays, on any machine):
  ``interpreted``, with the patches below, each applied only where its target still fits.
- Launching a compiled kernel through its C launcher with pointers as integers
  (``direct_launch``): written against Triton 3.6's ``CompiledKernel``, used only under that
  version, checked against Triton's own launch in the GPU tests.

The interpreter
===============

Everything normkit changes in Triton's interpreter lives here. A change is applied only while one of
normkit's interpreted launches runs, and only under ``_LOCK``, a process-wide lock held for the whole
launch; it is restored before the lock is released. Compiled launches are never affected.

Why a lock
----------
Triton's interpreter is process-global state. ``interpreter.interpreter_builder`` holds the current
grid index and grid size; every launch patches ``triton.language`` itself (its builtins,
``tl.range``, ``tl.tensor.__index__``, ...) and restores it when done; normkit's own patches below
are class and module attributes as well. Two launches interleaved in threads read each other's
program ids and restore each other's patches: silently wrong outputs, ``InterpreterError``s, and
patches left in place for the rest of the process. So every interpreted launch takes ``_LOCK``: the
Torch frontend's launches on CPU tensors, from any thread, and the JAX frontend's, which run from
``jax.pure_callback`` on XLA's threads. Interpreted launches are mostly Python holding the GIL, so
serializing them costs little parallelism. Interpreter launches that do not go through this module
(someone's own ``TRITON_INTERPRET=1`` kernels in another thread) are not serialized with normkit's;
nothing here can make those safe.

The patches (written against Triton 3.6.x, tested with 3.6 to 3.9)
-------------------------------------------------------------------
- ``jit-device-calls``: Triton's interpreter can run a kernel defined without TRITON_INTERPRET, but
  the kernel's calls into ``triton.language``'s own jit functions (``tl.sum``) are then
  JITFunctions, which refuse to be called outside a compiled kernel. Such a call is treated as what
  it is there: a device-function call, interpreted as well. It does what Triton's
  ``InterpretedFunction.__call__`` does, except that the language patches that call makes (on
  ``triton.language.core``'s builtins, through ``_patch_lang``) are undone when it returns: Triton
  3.6 never undoes them, which would leave ``tl.core.load`` and friends bound to the interpreter
  for the rest of the process, where a later compiled kernel would trace them.
- ``bf16-rtne``: Triton 3.6's interpreter converts fp32 to bf16 by truncation, where compiled code
  rounds to nearest even; the interpreter would then drift by up to an ulp per rounding. The
  conversion (``InterpreterBuilder.cast_impl``) is replaced by ``ml_dtypes``' round-to-nearest-even one.
- ``numpy-index``: the interpreter holds every scalar (runtime arguments, ``tl.program_id``,
  ``tl.num_programs``) as a 1-element array, and its ``tl.tensor.__index__`` -- what ``range()``
  and ``tl.range`` bounds go through -- is ``int(array)``. numpy 2.4 made that conversion of an
  ndim > 0 array an error (``TypeError: only 0-dimensional arrays can be converted to Python
  scalars``; numpy 1.25 to 2.3 warn with a DeprecationWarning), which failed every launch of
  normkit's kernels. ``__index__`` reads the single element instead; other sizes fail as before.

Other Triton versions
---------------------
The patches reach into private names (``InterpreterBuilder.cast_impl``, ``_patch_lang``,
``_patch_lang_tensor``, ``_LangPatchScope.set_attr``) that any Triton release may change. So each
patch is applied only if its targets still exist with the signature it was written for (checked
once per process and Triton version): a patch that no longer fits its target could corrupt results
silently, which is worse than what skipping it costs (a loud error for a device call or a numpy
conversion; bf16 roundings that differ from a GPU's by an ulp). A patch that fits does the right
thing on any version: round-to-nearest-even is what compiled code does, a device call is a device
call, and reading a 1-element array's element is what ``int()`` did (Triton 3.9 fixed
``__index__`` itself the same way). ``TESTED_TRITON`` lists the releases the test suite passes
under, every patch fitting (CI's pip install check runs a part of it on whatever Triton pip
resolves). Under any other Triton, or should any target not fit, a ``NormkitInterpreterWarning`` is
issued once per process and version, naming the version and the patches applied and skipped:
normkit's CPU results there are untested, not known wrong. Refusing to run instead would make every
Triton release a breaking change for CPU users, and a CUDA torch pins its own Triton; capping
``triton`` in pyproject.toml for the same reason is not done.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import warnings
from typing import Callable

import ml_dtypes
import numpy as np

TESTED_TRITON = ("3.6.", "3.7.", "3.8.", "3.9.")  # version prefixes the test suite passes under, every patch fitting

# Held around every interpreted launch, patches applied and restored inside it. Re-entrant so that
# a launch issued from within a launch (a pre-run hook, say) cannot deadlock its own thread.
_LOCK = threading.RLock()


class NormkitInterpreterWarning(UserWarning):
    """normkit's interpreter path runs under a Triton version (or Triton internals) it was not
    tested with."""


def is_interpreted(kernel) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


# ---------------------------------------------------------------------------------------------
# Applying and undoing attribute patches.

_MISSING = object()


class _Undo:
    """Sets attributes and remembers what they were, to put everything back in reverse order."""

    def __init__(self) -> None:
        self._changes: list[tuple[object, str, object]] = []

    def set(self, obj, name: str, value) -> None:
        self._changes.append((obj, name, vars(obj).get(name, _MISSING)))
        setattr(obj, name, value)

    def restore(self) -> None:
        while self._changes:
            obj, name, original = self._changes.pop()
            if original is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, original)


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


@dataclasses.dataclass(frozen=True)
class _Patch:
    name: str
    fits: Callable[[], bool]  # its targets exist with the shape it was written for
    apply: Callable[[_Undo], None]


# ---------------------------------------------------------------------------------------------
# jit-device-calls


@functools.lru_cache(maxsize=None)
def _interpreted_device_fn(fn):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def _device_call(jit_fn, *args, **kwargs):
    """A JITFunction called from inside an interpreted kernel: Triton 3.6's
    ``InterpretedFunction.__call__``, with its language patches undone on return."""
    from triton.runtime import interpreter

    scope = interpreter._patch_lang(jit_fn.fn)
    try:
        return _interpreted_device_fn(jit_fn.fn).rewrite()(*args, **kwargs)
    finally:
        scope.restore()


def _fits_device_calls() -> bool:
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    return ("__call__" in vars(JITFunction) and _params(interpreter._patch_lang) == ["fn"]
            and callable(getattr(scope_cls, "restore", None))
            and _params(interpreter.InterpretedFunction.rewrite) == ["self"])


def _apply_device_calls(undo: _Undo) -> None:
    from triton.runtime.jit import JITFunction

    undo.set(JITFunction, "__call__", _device_call)


# ---------------------------------------------------------------------------------------------
# bf16-rtne


def _f32_to_bf16_rtne(data):
    """fp32 to bf16 bits, rounded to nearest even (``ml_dtypes``), as the interpreter stores bf16."""
    return np.asarray(data, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _cast_rtne(cast_impl):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(_f32_to_bf16_rtne(src.data), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    return cast


def _fits_rtne() -> bool:
    from triton.runtime import interpreter

    return ("cast_impl" in vars(interpreter.InterpreterBuilder)
            and _params(interpreter.InterpreterBuilder.cast_impl) == ["self", "src", "dst_type"]
            and [f.name for f in dataclasses.fields(interpreter.TensorHandle)][:2] == ["data", "dtype"])


def _apply_rtne(undo: _Undo) -> None:
    from triton.runtime import interpreter

    undo.set(interpreter.InterpreterBuilder, "cast_impl", _cast_rtne(interpreter.InterpreterBuilder.cast_impl))


# ---------------------------------------------------------------------------------------------
# numpy-index


def _tensor_index(self) -> int:
    data = self.handle.data
    if isinstance(data, np.ndarray) and data.size == 1:
        data = data.item()  # the interpreter's scalars are 1-element arrays; int() of those is gone in numpy 2.4
    return int(data)


def _fits_index() -> bool:
    from triton.runtime import interpreter

    return (_params(interpreter._patch_lang_tensor) == ["tensor", "scope"]
            # _patch_lang finds it as a module global at call time: replacing that global is enough
            and "_patch_lang_tensor" in interpreter._patch_lang.__code__.co_names
            and _params(interpreter._LangPatchScope.set_attr) == ["self", "obj", "name", "value"])


def _apply_index(undo: _Undo) -> None:
    from triton.runtime import interpreter

    patch_lang_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", _tensor_index)

    undo.set(interpreter, "_patch_lang_tensor", patched)


PATCHES = (
    _Patch("jit-device-calls", _fits_device_calls, _apply_device_calls),
    _Patch("bf16-rtne", _fits_rtne, _apply_rtne),
    _Patch("numpy-index", _fits_index, _apply_index),
)


def _fits(patch: _Patch) -> bool:
    try:
        return bool(patch.fits())
    except Exception:  # a target gone or reshaped
        return False


_CHOSEN: dict[str, tuple[_Patch, ...]] = {}  # Triton version -> the patches that fit it


def _patches() -> tuple[_Patch, ...]:
    """The patches to apply under this process's Triton (decided, and warned about, once)."""
    import triton

    version = triton.__version__
    chosen = _CHOSEN.get(version)
    if chosen is None:
        chosen = tuple(p for p in PATCHES if _fits(p))
        skipped = [p.name for p in PATCHES if p not in chosen]
        _CHOSEN[version] = chosen  # decided (and warned about) once, even where the warning raises
        if skipped or not version.startswith(TESTED_TRITON):
            warnings.warn(NormkitInterpreterWarning(
                f"normkit: running kernels in the interpreter of Triton {version}, which normkit's interpreter path "
                f"is untested with (tested: Triton {', '.join(v + 'x' for v in TESTED_TRITON)}); "
                f"applied the patches that fit this version: {', '.join(p.name for p in chosen) or 'none'}; "
                f"skipped: {', '.join(skipped) or 'none'}. CPU results may differ from compiled ones."),
                stacklevel=4)
    return chosen


# ---------------------------------------------------------------------------------------------


class _Interpreted:
    """A compiled-mode kernel run by Triton's interpreter, e.g. for CPU arrays on any machine.

    Each launch holds ``_LOCK`` throughout, with ``PATCHES`` (those that fit this Triton) applied
    inside it and restored before it is released; see the module docstring.
    """

    def __init__(self, kernel):
        from triton.runtime.interpreter import InterpretedFunction

        self.kernel = kernel if isinstance(kernel, InterpretedFunction) else InterpretedFunction(kernel.fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _LOCK:
                undo = _Undo()
                try:
                    for patch in _patches():
                        patch.apply(undo)
                    with np.errstate(all="ignore"):  # NaN/Inf in the data propagate silently, as on a GPU
                        return self.kernel[grid](*args, **kwargs)
                finally:
                    undo.restore()

        return launch


@functools.lru_cache(maxsize=None)
def interpreted(kernel) -> _Interpreted:
    """The same kernel source, run by Triton's interpreter (CPU arrays)."""
    return _Interpreted(kernel)


# ---------------------------------------------------------------------------------------------
# The compiled kernel's launch, everything but the stream and the pointers bound.

DIRECT_LAUNCH_TRITON = ("3.6.",)  # the releases whose CompiledKernel.run the direct launch follows


@functools.lru_cache(maxsize=None)
def _runtime_knobs():
    from triton import knobs

    return knobs.runtime


def launch_hooks_active() -> bool:
    """Whether a Triton launch hook (a profiler's) is set: then every launch must take Triton's own path."""
    runtime = _runtime_knobs()
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool((enter is not None and getattr(enter, "calls", True)) or (exit_ is not None and getattr(exit_, "calls", True)))


def direct_launch(compiled, grid: int, scalars: tuple, constexprs: tuple):
    """``launch(stream, in_ptrs, out_ptrs)``: the call Triton 3.6's ``CompiledKernel.run`` makes for a
    one-dimensional ``grid``, with the kernel's pointers given as integers (so the C launcher neither
    calls ``data_ptr()`` nor asks the driver about each one) and the runtime scalars and constexprs
    bound. None where this Triton is not one it was written for, or where the launcher does more than
    launch (a kernel that needs scratch memory): then Triton's own path launches."""
    import triton

    if not triton.__version__.startswith(DIRECT_LAUNCH_TRITON):
        return None
    try:
        launcher = compiled.run
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
        c_launch = launcher.launch
        # after the stream: function, cooperative, pdl, global and profile scratch, packed metadata,
        # launch metadata, enter and exit hooks
        bound = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                 compiled.packed_metadata, None, None, None)
    except AttributeError:
        return None

    def launch(stream: int, in_ptrs: list, out_ptrs: list) -> None:
        c_launch(grid, 1, 1, stream, *bound, *in_ptrs, *scalars, *out_ptrs, *constexprs)

    return launch
