"""normkit for PyTorch: functions and nn.Modules over the shared Triton kernels.

CUDA tensors run the compiled kernels; CPU tensors run the same kernels in Triton's interpreter.
``backend`` is the Torch backend of ``normkit.driver``, for kernel-level use (benchmarks, tuning):
``normkit.driver.forward(torch_frontend.backend, normkit.ops.OPS["rms_norm"], x2d, ...)``.
"""
from torch_frontend._backend import BACKEND as backend
from torch_frontend._composite import compile_frozen_with
from torch_frontend._backend import NormkitRopeTablesWarning
from torch_frontend.functional import NormkitCopyWarning, fused_add_rms_norm, layer_norm, rms_norm
from torch_frontend.modules import FusedAddRMSNorm, LayerNorm, RMSNorm
from torch_frontend._rope import rms_norm_rope
from torch_frontend._save import SaveDecision, save_decision
from torch_frontend.patch import PatchReport, patch_model, unpatch_model

__all__ = [
    "rms_norm", "layer_norm", "fused_add_rms_norm", "rms_norm_rope",
    "RMSNorm", "LayerNorm", "FusedAddRMSNorm",
    "NormkitCopyWarning", "NormkitRopeTablesWarning", "backend",
    "patch_model", "unpatch_model", "PatchReport", "compile_frozen_with", "save_decision", "SaveDecision",
]

