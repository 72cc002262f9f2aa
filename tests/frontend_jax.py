"""The JAX frontend adapter: runs a harness Case through jax_frontend and hands back NumPy results.

Frozen inputs are made unperturbed in one of two ways, alternating by case so that both are
covered by the full parity suite:

- "argnums": only the trained inputs are differentiated (``jax.vjp`` over them; the frozen ones are
  closed over). A frozen input then has no cotangent at all: it is reported as None.
- "freeze": every input is differentiated, but ``jax_frontend.freeze`` stops the frozen ones inside
  the function. JAX instantiates their symbolic-zero cotangents as zeros; the adapter asserts they
  are exactly zero and reports None.

Either way the launch record (checked by the shared test body) must show the frozen input's
COMPUTE_* flag off and no partial buffer for it, i.e. the zero was symbolic, never computed.
"""
from __future__ import annotations

import os
import zlib

# On the GPU machine the tests may run in several processes on one GPU (pytest -n): JAX must not
# preallocate most of its memory in each. Set before any JAX backend starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import functools  # noqa: E402

import normkit  # noqa: E402
from normkit.ops import OPS  # noqa: E402
from normkit.testing import poisoned_outputs  # noqa: E402
from tests.frontends import apply_op as _apply  # noqa: E402
from tests.harness import Case, Result  # noqa: E402

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
PAD = 13  # strided cases: rows are a slice of a buffer D + PAD wide (JAX slices it inside the jit)


def _np(a):
    return None if a is None else np.asarray(jnp.asarray(a, jnp.float32), dtype=np.float64)


def mechanism(case: Case) -> str:
    return ("argnums", "freeze")[zlib.crc32(str(case).encode()) % 2]


def apply_op(case: Case, args: dict, implementation: str | None = None) -> dict:
    """The op on named arrays; outputs by name."""
    return _apply(_Bound(implementation), case, args)


def _unpad(case: Case, name: str, a):
    return a[..., : case.shape.N] if case.shape.strided and name in ("x", "residual") else a


def _run(case: Case, how: str, arrays: dict, cotangents: dict, implementation: str | None = None):
    """Forward + backward of one case; traced afresh each call (launch records come from tracing)."""
    import jax_frontend as jf

    def fn(diff, const):
        args = {name: _unpad(case, name, a) for name, a in {**const, **diff}.items()}
        if how == "freeze":
            args = jf.freeze(args, {name: name in case.trained for name in args})
        return apply_op(case, args, implementation)

    if how == "freeze":
        diff, const = arrays, {}
    else:
        diff = {k: v for k, v in arrays.items() if k in case.trained}
        const = {k: v for k, v in arrays.items() if k not in case.trained}
    outs, vjp = jax.vjp(lambda d: fn(d, const), diff)
    (grads,) = vjp({k: cotangents[k] for k in outs}) if case.trained else ({},)
    return outs, grads


class _Bound:
    """jax_frontend with ``implementation=`` bound on the op functions."""

    def __init__(self, implementation):
        import jax_frontend

        self._module, self._implementation = jax_frontend, implementation

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if name in OPS:
            return functools.partial(fn, implementation=self._implementation)
        return fn


class JaxFrontend:
    def __init__(self, jit: bool = True, implementation: str | None = None):
        self.jit = jit  # False: run eagerly (op by op), e.g. to pick the platform from the arrays
        self.implementation = implementation  # None: auto (jax_frontend.resolve_implementation)
        self.name = "jax" if implementation is None else f"jax-{implementation}"

    @property
    def module(self):
        return _Bound(self.implementation)

    @staticmethod
    def numpy(a) -> np.ndarray:
        """A result as a NumPy array (float64 for floating types)."""
        return _np(a)

    def raw(self, a: np.ndarray) -> jax.Array:
        """``a`` as an array of the same dtype (ints, bools and complex included)."""
        return jnp.asarray(np.array(a))  # np.array keeps 0-d arrays 0-d

    def array(self, a: np.ndarray, dtype: str, strided: bool = False) -> jax.Array:
        a = np.asarray(a, dtype=np.float32)
        if strided:  # the same values as rows of a wider buffer, NaN in the padding
            a = np.concatenate([a, np.full(a.shape[:-1] + (PAD,), np.nan, np.float32)], axis=-1)
        return jnp.asarray(a).astype(JNP_DTYPES[dtype])

    def call(self, case: Case, inp: dict) -> Result:
        wd = case.w_dtype or case.dtype
        arrays = {}
        for name in case.inputs:
            dt = wd if name in ("weight", "bias") else case.dtype
            arrays[name] = self.array(inp[name], dt, case.shape.strided and name in ("x", "residual"))
        cot = {"y": self.array(inp["dy"], case.dtype)}
        if case.spec.has_residual:
            cot["residual_out"] = self.array(inp["ds"], case.dtype)
        how = mechanism(case)
        with normkit.record_launches() as log, poisoned_outputs(), jax.numpy_dtype_promotion("strict"):
            # A fresh jit per call: the case is traced (and its launches recorded) every time.
            run = lambda a, c: _run(case, how, a, c, self.implementation)  # noqa: E731
            outs, grads = (jax.jit(run) if self.jit else run)(arrays, cot)
        report = {}
        for name in case.inputs:
            g = grads.get(name)
            if name in case.trained:
                report[name] = _np(_unpad(case, name, g))
            else:
                if g is not None:  # "freeze": an instantiated symbolic zero
                    assert not np.any(np.asarray(g, dtype=np.float32)), f"{case}: frozen {name} got a nonzero gradient"
                report[name] = None
        return Result(outputs={k: _np(v) for k, v in outs.items()}, grads=report, log=log)
