"""The Triton kernels, and nothing else: every function here is ``@triton.jit``."""
from normkit.kernels.norm import norm_bwd_kernel, norm_fwd_kernel, partial_sum_kernel

__all__ = ["norm_fwd_kernel", "norm_bwd_kernel", "partial_sum_kernel"]
