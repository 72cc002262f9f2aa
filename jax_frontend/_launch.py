"""The JAX backends of ``normkit.driver``: jax-triton on GPU, Triton's interpreter on CPU.

Both paths take the same positional arguments, in jax-triton 0.3.1's calling convention, built
once by ``kernel_args``:

- array inputs in kernel order, an absent one as a one-element dummy (jax-triton has no ``None``);
- runtime scalars, ``np.float32`` for the float ones (a Python float would become fp64) and
  Python ints otherwise;
- ``out_shape``: one ``ShapeDtypeStruct`` per kernel output, a one-element dummy for an absent one;
- the constexprs as keyword metaparams, with ``num_warps``, ``num_stages`` and ``enable_fp_fusion``
  from the plan.

On GPU these go to ``jax_triton.triton_call``. On CPU ``interpreter_triton_call`` takes the same
call and runs it from a host callback through ``normkit._compat.interpreted``, on zero-copy
torch views of the host buffers. The CPU path is therefore also a test of the GPU path's argument
assembly; only jax-triton itself is left for the GPU machine.

The host callback is ``jax.pure_callback``, except in the per-device computations that XLA's
partitioner builds from ``jax.experimental.custom_partitioning`` (``routed_host_callbacks``).

Neither jax_triton nor torch is imported until a launch on its path needs it: the GPU path never
imports torch and the CPU path never imports jax_triton.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_frontend import _compat as _jax_compat  # JAX's private entry points (normkit._compat: Triton's)
from normkit import _compat, driver
from normkit.launch import INTERPRETER_NUM_SMS, KernelCall

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}
_DUMMY = jax.ShapeDtypeStruct((1,), jnp.float32)  # an absent output: jax-triton allocates 4 bytes, never written


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


# ---------------------------------------------------------------------------------------------
# The SM count the plans are made with (the dW/dB backward's partial count, the persistent LayerNorm
# forward's grid): the same number as the Torch frontend's, so that both frontends launch the same
# grids and, on GPU, agree bitwise.


@functools.lru_cache(maxsize=None)
def _gpu_num_sms(platform: str) -> int:
    try:
        devices = jax.devices(platform)
    except RuntimeError:  # a platform name jax.devices does not know: the default backend's devices
        devices = jax.devices()
    for device in devices:
        cores = _jax_compat.device_core_count(device)  # the SM count on CUDA devices
        if cores:
            return cores
    from triton.runtime import driver  # fallback: ask the CUDA driver through Triton (no torch)

    return int(driver.active.utils.get_device_properties(0)["multiprocessor_count"])


def num_sms(platform: str) -> int:
    return INTERPRETER_NUM_SMS if platform == "cpu" else _gpu_num_sms(platform)


# ---------------------------------------------------------------------------------------------
# Arguments in jax-triton 0.3.1's convention.


def _is_scalar(arg) -> bool:
    """What triton_call 0.3.1 treats as a scalar kernel argument (everything else is an array)."""
    return isinstance(arg, (bool, int, float, np.float32))


def kernel_args(call: KernelCall, arrays: dict) -> tuple[list, list]:
    """(positional args, out_shape) of ``call`` reading ``arrays`` (name -> jax array)."""
    args = [arrays[name] if name in call.present_inputs else jnp.zeros((1,), jnp.float32) for name in call.inputs]
    args += [np.float32(value) if isinstance(value, float) else int(value) for value in call.scalars]
    out_shape = [
        jax.ShapeDtypeStruct(tuple(call.out_specs[name][0]), JNP_DTYPES[call.out_specs[name][1]])
        if name in call.out_specs else _DUMMY
        for name in call.outputs
    ]
    return args, out_shape


# ---------------------------------------------------------------------------------------------
# GPU: jax-triton, imported on first use with TRITON_CACHE_DIR protected.


def _restore_env(name: str, saved: str | None) -> None:
    if saved is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = saved


@functools.lru_cache(maxsize=None)
def import_jax_triton():
    """``import jax_triton``, undoing its import-time ``os.environ["TRITON_CACHE_DIR"] = ""``.

    jax-triton 0.3.1 clears TRITON_CACHE_DIR when imported (even when the import then fails, as it
    does on a CPU-only jax). Every later Triton JIT compile in the process, e.g. a torch_frontend
    launch, would then fail with "Could not create or locate cache dir". jax-triton's own compile
    path does not use that cache, so the variable is restored (or removed, if it was unset).
    """
    saved = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    except ImportError as err:
        raise ImportError(
            "normkit: running on a GPU backend needs jax-triton 0.3.1 (pip install jax-triton==0.3.1) with a "
            f"CUDA-enabled jax; importing it failed: {err}") from err
    finally:
        _restore_env("TRITON_CACHE_DIR", saved)
    version = tuple(int(p) for p in jax_triton.__version__.split(".")[:2] if p.isdigit())
    import triton

    triton_version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if version >= (0, 4) and triton_version < (3, 7):
        raise ImportError(
            f"normkit: jax-triton {jax_triton.__version__} needs triton >= 3.7 (with triton "
            f"{triton.__version__} its NVIDIA backend is a stub); use jax-triton 0.3.1")
    return jax_triton


def gpu_triton_call():
    """``jax_triton.triton_call`` (tests replace this to run the GPU path's arguments on CPU)."""
    return import_jax_triton().triton_call


# ---------------------------------------------------------------------------------------------
# CPU: the same call through Triton's interpreter, from a pure_callback.


def _torch_view(a: np.ndarray):
    """A zero-copy torch tensor over a host array (bf16 through a uint16 view)."""
    import torch

    a = np.ascontiguousarray(a)
    bf16 = a.dtype == jnp.bfloat16
    if bf16:
        a = a.view(np.uint16)
    # The callback's inputs are read-only views of JAX's buffers: torch.from_numpy would warn that it
    # cannot mark them read-only, DLPack shares them silently. The kernels never write an input.
    t = torch.from_numpy(a) if a.flags.writeable else torch.from_dlpack(a)
    return t.view(torch.bfloat16) if bf16 else t


class _Array:
    """Marks an array slot in the positional argument template of an interpreted call."""


def _host_launch(runner, grid, template, out_shape, poison, options, metaparams, *host_arrays):
    """Run one interpreted launch on host buffers; return the output buffers."""
    arrays = iter(host_arrays)
    args = []
    for slot in template:
        if slot is _Array:
            args.append(_torch_view(np.asarray(next(arrays))))
        else:  # a scalar: the value the Torch frontend passes (the fp32 value as a Python float)
            args.append(float(slot) if isinstance(slot, np.float32) else slot)
    fill = np.full if poison else (lambda shape, _, dtype: np.empty(shape, dtype))
    outs = [fill(s.shape, np.nan, np.dtype(s.dtype)) for s in out_shape]
    args += [_torch_view(o) for o in outs]
    runner[grid](*args, **metaparams, **options)
    return outs


# Host callbacks inside custom_partitioning's per-device computations. custom_partitioning lowers
# the per-device computation during compilation, in a module context of its own, so a pure_callback
# there registers its Python function in a list that the executable never receives: the host
# callbacks are handed to the compiler before partitioning starts (the open jax PR #23620 describes
# this; its test stays skipped). At run time the callback's index then points past the executable's
# list and the process crashes (jax 0.10.2; custom_partitioning.py and callback.py are unchanged in
# this respect in jax 0.11). So the enclosing module registers one dispatcher while it is lowered
# (``host_dispatcher_index``), and while a per-device computation is lowered
# (``routed_host_callbacks``) each launch calls jaxlib's Python-callback FFI target
# ("xla_ffi_python_cpu_callback", the one ``jax.pure_callback`` lowers to on CPU) with the
# dispatcher's index and a key into ``_ROUTED``. Both private steps are in ``jax_frontend._compat``
# (``host_callback_index``, ``call_host_callback``).

_ROUTE: contextvars.ContextVar = contextvars.ContextVar("normkit_host_callback_index", default=None)
_ROUTED: list = []  # key -> host launch; one entry per launch lowered this way, kept for the process


def _dispatch(key, *host_arrays):
    return tuple(_ROUTED[int(key)](*host_arrays))


def host_dispatcher_index(module_context) -> int:
    """The index of the launch dispatcher among a module's host callbacks (registered on first use)."""
    return _jax_compat.host_callback_index(module_context, _dispatch)


@contextlib.contextmanager
def routed_host_callbacks(index: int | None):
    """Interpreted launches lowered inside go through the dispatcher at ``index`` (None: pure_callback)."""
    token = _ROUTE.set(index)
    try:
        yield
    finally:
        _ROUTE.reset(token)


def _host_call(host, out_shape: list, arrays: list):
    index = _ROUTE.get()
    if index is None:
        # vmap never reaches the callback (normkit's primitives fold batch axes into rows first);
        # "sequential" is the safe answer should it ever be batched directly.
        return jax.pure_callback(host, out_shape, *arrays, vmap_method="sequential")
    _ROUTED.append(host)
    key = jnp.asarray(len(_ROUTED) - 1, jnp.int32)
    return list(_jax_compat.call_host_callback(index, out_shape, key, *arrays))


def interpreter_triton_call(*args, kernel, out_shape, grid, num_warps, num_stages, enable_fp_fusion=True, name="",
                            **metaparams):
    """``jax_triton.triton_call``'s calling convention, run by Triton's interpreter on the host.

    Arrays go through a host callback (so this works eagerly and under jit); scalars and constexprs are
    baked into the callback. Under ``normkit.testing.poisoned_outputs()`` every output
    buffer starts as NaN. ``enable_fp_fusion`` has no meaning in the interpreter (numpy does not
    contract), as for the Torch frontend's interpreted launches.
    """
    del name, enable_fp_fusion
    template = tuple(_Array if not _is_scalar(a) else a for a in args)
    arrays = [a for a in args if not _is_scalar(a)]
    host = functools.partial(_host_launch, _compat.interpreted(kernel), tuple(grid), template, tuple(out_shape),
                             driver.POISON_OUTPUTS, dict(num_warps=num_warps, num_stages=num_stages), dict(metaparams))
    return _host_call(host, list(out_shape), arrays)


# ---------------------------------------------------------------------------------------------


class JaxBackend:
    """``normkit.driver``'s backend for arrays lowered for ``platform`` ("cpu", "cuda", "rocm")."""

    def __init__(self, platform: str):
        self.platform = platform
        self.frontend = "jax-cpu" if platform == "cpu" else "jax-gpu"

    def num_sms(self, like) -> int:
        return num_sms(self.platform)

    @staticmethod
    def dtype(a) -> str:
        return dtype_name(a.dtype)

    @staticmethod
    def strides(a) -> tuple[int, ...]:
        return (a.shape[1], 1) if a.ndim == 2 else (1,)  # JAX arrays are always contiguous

    @classmethod
    def describe(cls, *arrays) -> tuple:
        return tuple(None if a is None else (dtype_name(a.dtype), cls.strides(a)) for a in arrays)

    @staticmethod
    def zeros(shape, dtype: str, like):
        return jnp.zeros(shape, JNP_DTYPES[dtype])

    def launch(self, call: KernelCall, arrays: dict, rows_shape: tuple | None = None) -> dict:
        """Launch ``call`` (``rows_shape`` is not used: each pass flattens and restores its rows itself,
        ``jax_frontend._rows.Pass``); under ``normkit.testing.poisoned_outputs()`` the interpreter path's
        outputs start as NaN (jax-triton allocates its outputs inside XLA and 0.3.1 can only zero them)."""
        interpret = self.platform == "cpu" or _compat.is_interpreted(call.kernel)
        triton_call = interpreter_triton_call if interpret else gpu_triton_call()
        args, out_shape = kernel_args(call, arrays)
        outs = triton_call(*args, kernel=call.kernel, out_shape=out_shape, grid=call.grid,
                           num_warps=call.num_warps, num_stages=call.num_stages, enable_fp_fusion=call.fp_fusion,
                           name=f"normkit_{call.name}", **call.constexprs)
        call.record(self.frontend, interpret)
        return {name: out for name, out in zip(call.outputs, outs) if name in call.out_specs}


@functools.lru_cache(maxsize=None)
def backend(platform: str) -> JaxBackend:
    return JaxBackend(platform)
