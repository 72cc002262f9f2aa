"""normkit for Flax NNX: norm modules that drop in for flax's, and patching of existing models.

    from jax_frontend import nnx as nknnx

    norm = nknnx.RMSNorm(4096, epsilon=1e-6, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))   # flax's arguments
    ln = nknnx.LayerNorm(1024, rngs=nnx.Rngs(0))
    fused = nknnx.FusedAddRMSNorm(4096, rngs=nnx.Rngs(0))   # h, residual = fused(x, residual)
    report = nknnx.patch_model(model)                     # flax's nnx.RMSNorm / nnx.LayerNorm, in place
    print(report)

``RMSNorm`` and ``LayerNorm`` subclass ``flax.nnx.RMSNorm`` and ``flax.nnx.LayerNorm``: the same
constructor arguments and defaults, the same ``scale``/``bias`` ``nnx.Param`` objects and state
paths, flax's dtype promotion and output dtype; only ``__call__`` differs, and runs
``jax_frontend.rms_norm`` / ``layer_norm``. normkit's options are static attributes: ``offset``,
``casting_mode`` (RMSNorm; default ``"gemma"``, flax's math) and ``implementation``.

Frozen by filter: training only the adapters, ``nnx.grad(loss, argnums=nnx.DiffState(0,
nnx.LoRAParam))``, leaves the norms' parameters undifferentiated, so their kernels run the variant
without dW (no accumulation, no fp32 partial buffer, no reduction launch); no ``freeze`` call is
needed. ``nnx.jit``, ``nnx.grad``/``value_and_grad``, ``nnx.scan``, ``nnx.remat``, ``nnx.vmap`` and
meshes (``nnx.with_partitioning``, Auto and Explicit axes) work as with the functions. docs/NNX.md
has the details and the limits.

This module imports flax; ``import jax_frontend`` does not.
"""
from jax_frontend._nnx_modules import FusedAddRMSNorm, LayerNorm, RMSNorm
from jax_frontend._nnx_patch import PatchReport, patch_model, unpatch_model

__all__ = ["RMSNorm", "LayerNorm", "FusedAddRMSNorm", "patch_model", "unpatch_model", "PatchReport"]
