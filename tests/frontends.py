"""Frontend adapters: run a harness Case through one frontend and hand back NumPy results.

Test bodies take the ``frontend`` fixture and never import a frontend themselves. A frontend whose
framework is not installed (the torch-free JAX install) is simply not registered.
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.harness import Case

HAS_TORCH = importlib.util.find_spec("torch") is not None
# For tests of the Torch frontend against the JAX one, and of the JAX frontend's Triton path on CPU
# (Triton's interpreter runs on torch tensors): they run in the main suite; a torch-free install
# (CI's JAX-only check) deselects them.
requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch (a JAX-only install)")


def apply_op(module, case: Case, args: dict) -> dict:
    """The case's op from ``module`` (torch_frontend or jax_frontend) on named arrays; outputs by name.
    Every public function takes the op's inputs positionally in ``op.inputs`` order."""
    out = getattr(module, case.op)(*(args.get(name) for name in case.spec.row_inputs + ("weight", "bias")
                                     if name in case.spec.inputs), **case.call_kwargs)
    return dict(zip(case.spec.outputs, out if case.spec.has_residual else (out,)))


FRONTENDS = {}


def _register():
    import functools

    if HAS_TORCH:
        from tests.frontend_torch import TorchFrontend

        FRONTENDS["torch"] = TorchFrontend
    if importlib.util.find_spec("jax") is not None:
        from tests.frontend_jax import JaxFrontend  # imported here: tests.frontend_jax imports tests.harness

        FRONTENDS["jax"] = JaxFrontend  # auto: Triton (its interpreter on CPU, with torch), else Pallas
        for implementation in ("pallas", "xla"):
            FRONTENDS[f"jax-{implementation}"] = functools.partial(JaxFrontend, implementation=implementation)


_register()
