"""normkit for PyTorch: functions and nn.Modules over the shared Triton kernels.

CUDA tensors run the compiled kernels; CPU tensors run the same kernels in Triton's interpreter.
"""
from torch_frontend.functional import NormkitCopyWarning, fused_add_rms_norm, layer_norm, rms_norm
from torch_frontend.modules import FusedAddRMSNorm, LayerNorm, RMSNorm
from torch_frontend.patch import PatchReport, patch_model, unpatch_model

__all__ = [
    "rms_norm", "layer_norm", "fused_add_rms_norm",
    "RMSNorm", "LayerNorm", "FusedAddRMSNorm",
    "NormkitCopyWarning",
    "patch_model", "unpatch_model", "PatchReport",
]
