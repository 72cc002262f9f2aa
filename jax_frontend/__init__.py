"""normkit for JAX: the same Triton kernels as the Torch frontend, through ``jax.custom_vjp``.

JAX frontend
============

Functions, mirroring ``torch_frontend`` (same options, dtypes, shapes and errors)::

    import jax_frontend as nk

    y = nk.rms_norm(x, weight, eps=1e-6, offset=0.0, casting_mode="llama")   # x: (..., D)
    y = nk.layer_norm(x, weight, bias, eps=1e-5)
    y, residual_out = nk.fused_add_rms_norm(x, residual, weight, eps=1e-6)   # residual_out = x + residual

``eps``, ``offset`` and ``casting_mode`` are static Python values. Bad input (dtype, shape, option)
raises at trace time, naming the argument, before anything is launched.

Frozen parameters
-----------------
Each op's backward computes only what is differentiated. An input is left out when it is under
``jax.lax.stop_gradient``, outside ``jax.grad``'s ``argnums``, or closed over: the kernel variant
without its gradient runs (no dW work, no fp32 partial buffer, no reduction launch) and its
cotangent is a symbolic zero. ``nk.freeze(params, trainable)`` applies ``stop_gradient`` by mask::

    trainable = {"attn": True, "norm": {"weight": False}}     # a prefix of params, or a callable
    def loss_fn(params, batch):
        params = nk.freeze(params, trainable)                  # freeze *inside* the loss
        return loss(model(params, batch))
    grads = jax.grad(loss_fn)(params, batch)

An optimizer mask such as ``optax.masked`` only masks updates: without ``freeze`` the frozen
gradients are still computed. Under ``jax.vjp`` every primal counts as differentiated; pass only
the trainable inputs to ``jax.vjp`` (close over the rest) to skip the others.

Transformations
---------------
``jit``, ``grad``, ``value_and_grad``, ``vjp``, ``vmap`` (nested too), ``lax.scan`` and
``jax.checkpoint`` work. ``vmap`` folds batch axes into rows: one launch. Two cases run one launch
per batch element instead (a ``lax.map`` loop), because folding would change the result: a batched
weight or bias, and a trained weight or bias whose gradient vmap must return per batch element (as
in ``grad`` of a vmapped function). For one launch, pass the batch as leading axes of ``x``.
Forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``, ``jax.hessian``,
derivatives of a gradient) is not supported: the kernels have a VJP but no JVP rule. It raises a
``TypeError``: JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp function", or
normkit's "forward-mode differentiation is not supported" when it reaches a kernel.

Meshes
------
Under ``jit`` on inputs sharded over a mesh, each device runs the kernels on its own rows: on Auto
mesh axes through a sharding rule that XLA's partitioner calls (``custom_partitioning``), on
Explicit axes through ``shard_map`` inside the op, and inside your own ``shard_map`` on the local
rows. Outputs stay sharded like x; dW/dB are reduced over the mesh axes the rows are split on, and
only when trained. docs/MULTI_GPU.md has the details and the limits.

Backends
--------
On a GPU backend the kernels are compiled through ``jax_triton.triton_call`` (jax-triton 0.3.1 for
triton 3.6; imported on first GPU use, with ``TRITON_CACHE_DIR`` restored afterwards so that Torch-side
Triton compiles in the same process keep working; torch is not imported). On CPU the same kernels run
in Triton's interpreter from a ``jax.pure_callback``, eagerly or under jit (this needs torch).
The platform is the one the computation is lowered for (or, eagerly, where the arrays live).
Launch plans are shared with the Torch frontend (``normkit.launch``), so on GPU both frontends run
identical kernels with identical grids and agree bitwise. ``normkit.record_launches()`` records each
launch, as frontend "jax-gpu" or "jax-cpu", when it is issued eagerly or when a jitted computation is
compiled (a cached jit call records nothing).
"""
from jax_frontend._freeze import freeze
from jax_frontend.functional import IMPLEMENTATIONS, fused_add_rms_norm, layer_norm, resolve_implementation, rms_norm
from jax_frontend._rope import rms_norm_rope

__all__ = ["rms_norm", "layer_norm", "fused_add_rms_norm", "rms_norm_rope", "freeze", "IMPLEMENTATIONS", "resolve_implementation"]
