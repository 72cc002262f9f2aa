"""normkit: Triton normalization kernels with a frozen-parameter backward, for Torch and JAX.

The package itself is framework-free (it imports neither torch nor jax):

- ``normkit.kernels``: the ``@triton.jit`` kernels, shared by both frontends;
- ``normkit.launch``: the launch heuristics and the kernel-argument plans;
- ``normkit.norm_math``: the norms' math once over an array namespace (NumPy, torch, JAX);
- ``normkit.reference``: the float64 NumPy reference (forward and closed-form backward);
- ``normkit.record_launches()``: records which kernel variants ran.

Use it through ``torch_frontend`` or ``jax_frontend``.
"""
from normkit.record import Launch, LaunchLog, record_launches

__version__ = "0.1.0"
__all__ = ["Launch", "LaunchLog", "record_launches", "__version__"]
