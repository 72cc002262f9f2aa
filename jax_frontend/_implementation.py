"""The interface every JAX implementation of the norms provides (``functional.IMPLEMENTATIONS``).

An implementation runs one pass of an op over 2-D rows ``[M, N]`` (M >= 1) and returns its buffers
by name, exactly the keys of ``Op.fwd_buffers`` / ``Op.bwd_buffers``:

- ``jax_frontend._triton``: ``normkit.kernels.norm`` through jax-triton (GPU) or Triton's
  interpreter (CPU);
- ``jax_frontend._pallas``: ``normkit.kernels.norm_pallas`` through ``pallas_call``;
- ``jax_frontend._xla``: plain ``jax.numpy``.

The distributed wrappers satisfy the same interface over arrays of the caller's shape ``(..., N)``
and run one of the above on each device's rows: ``_shard_map.ShardedImpl`` (Explicit mesh axes) and
``_custom_partitioning.PartitionedImpl`` (everything else, Auto mesh axes included).
"""
from __future__ import annotations

from typing import Protocol

import jax

from normkit.ops import Grads, Op, Options

FORWARD_MODE_ERROR = (
    "normkit: forward-mode differentiation is not supported: the norm kernels have a custom VJP "
    "(reverse mode) but no JVP rule, so jax.jvp, jax.jacfwd, jax.linearize, jax.hessian and derivatives "
    "of the gradient do not work. Use jax.grad, jax.value_and_grad, jax.vjp or jax.jacrev.")


class Implementation(Protocol):
    """One set of kernels for the three ops. Absent inputs are None; a flag that is off (no weight, a
    frozen gradient) traces no work for it."""

    def forward(self, op: Op, x: jax.Array, residual: jax.Array | None, weight: jax.Array | None,
                bias: jax.Array | None, *, opts: Options, store_stats: bool,
                store_rec: bool = False) -> dict[str, jax.Array]:
        """Y (and S for the fused add; MEAN and RSTD when ``store_stats``; REC, the weight's recovery
        for a backward that reads y, when ``store_rec``) over rows ``x``."""
        ...

    def backward(self, op: Op, x: jax.Array, weight: jax.Array | None, dy: jax.Array, dres: jax.Array | None,
                 mean: jax.Array | None, rstd: jax.Array, *, opts: Options, grads: Grads,
                 b_dtype: str | None, bias: jax.Array | None = None, from_output: bool = False,
                 rec: jax.Array | None = None) -> dict[str, jax.Array]:
        """DX (plus ``dres`` for the fused add), DW and DB as ``grads`` asks. ``x`` is what the forward
        normalized (the fused add's sum); dW takes the weight's dtype and dB ``b_dtype``.
        ``from_output``: ``x`` is the forward's output y instead, ``bias`` the bias and ``rec`` the
        forward's REC, weight and bias frozen (dx alone, ``mean`` not read; see
        ``normkit.driver.backward``)."""
        ...
