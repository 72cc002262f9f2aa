"""PyTorch's private and version-dependent entry points, fenced: every bet the Torch frontend makes on
torch internals is in this file, each behind a check at import and with a public fallback where one
exists. tests/test_compat_torch.py exercises each entry on the installed torch.

Checked on torch 2.13 (CPU) and 2.11 (CUDA).
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad


def _lookup(owner, name: str):
    return getattr(owner, name, None)


# --- functorch transforms and forward-mode AD ------------------------------------------------------

_TRANSFORMS_ACTIVE = _lookup(torch._C, "_are_functorch_transforms_active")


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform or a forward-mode AD level is active: there a call must go
    through its ``autograd.Function`` (which raises: normkit's Functions have no jvp or vmap rule).
    Without torch's private answer, every call counts as transformed: the Function always runs."""
    if _TRANSFORMS_ACTIVE is None:
        return True
    return _TRANSFORMS_ACTIVE() or _forward_ad._current_level >= 0


_functorch = _lookup(torch._C, "_functorch")
_IS_LEGACY_BATCHED = _lookup(_functorch, "is_legacy_batchedtensor") if _functorch is not None else None


def _storage_unreachable(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return True
    return False


# ``is_legacy_batched(t)``: whether ``t`` is batched by ``autograd.grad(..., is_grads_batched=True)`` (or a
# vectorized ``autograd.functional.jacobian``): a tensor without storage, which no kernel can read. torch's
# own answer, called directly (every backward asks); without it, a tensor whose storage cannot be reached
# counts as batched.
is_legacy_batched = _IS_LEGACY_BATCHED if _IS_LEGACY_BATCHED is not None else _storage_unreachable


# --- saved-tensor hooks -------------------------------------------------------------------------------

_autograd = _lookup(torch._C, "_autograd")
_TOP_HOOKS = _lookup(_autograd, "_top_saved_tensors_default_hooks") if _autograd is not None else None


def checkpointing() -> bool:
    """Whether the innermost default saved-tensor hooks are ``torch.utils.checkpoint``'s (a non-reentrant
    checkpoint's forward, or its recomputation in the backward): the module of their pack function.
    Without torch's private accessor: False (a checkpoint whose recomputation decides otherwise than
    its forward then fails torch's own check of what was saved, never silently)."""
    if _TOP_HOOKS is None:
        return False
    hooks = _TOP_HOOKS(False)
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


# --- autograd.Function's C apply -------------------------------------------------------------------------

_C_APPLY = _lookup(getattr(torch._C, "_FunctionBase", None), "__dict__") or {}
_C_APPLY = _C_APPLY.get("apply")
_UNWRAP_IF_DEAD = _lookup(_functorch, "unwrap_if_dead") if _functorch is not None else None


def direct_apply(function):
    """``function``'s own C ``apply`` (``torch._C._FunctionBase.apply`` bound to the class), to be called
    with each tensor argument passed through ``unwrap_if_dead``: the work of torch's Python
    ``Function.apply`` for a Function without ``setup_context`` (a generator over the arguments and a
    call per check) where no ``torch.func`` transform is
    active (the caller checks ``transforms_active``). None where this torch lacks either entry: the
    caller then calls ``function.apply``."""
    if _C_APPLY is None or _UNWRAP_IF_DEAD is None or not hasattr(_C_APPLY, "__get__"):
        return None
    return _C_APPLY.__get__(None, function)


# a tensor as it is, or unwrapped where the torch.func transform that wrapped it has exited
unwrap_exited = _UNWRAP_IF_DEAD


# --- dynamo's C++ tensor check ---------------------------------------------------------------------------

try:
    from torch._C._dynamo.guards import TensorGuards as _TENSOR_GUARDS
except ImportError:  # pragma: no cover - a torch without dynamo's C++ guards
    _TENSOR_GUARDS = None


def _layout_check(tensors: tuple):
    return _TENSOR_GUARDS(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                          dynamic_dims_strides=[list(t.stride()) for t in tensors]).check


def _layout_check_works() -> bool:
    """Whether dynamo's check tells apart what a kernel launch must: the same tensors pass; another
    stride, shape, dtype, a lazy negation, a None or a missing tensor do not."""
    if _TENSOR_GUARDS is None:
        return False
    try:
        a, b = torch.ones(2, 3), torch.ones(3, dtype=torch.int32)
        check = _layout_check((a, b))
        return (check(a, b) and check(torch.zeros(2, 3), torch.zeros(3, dtype=torch.int32))
                and not check(a.t().contiguous().t(), b) and not check(a[:1], b) and not check(a.double(), b)
                and not check(torch._neg_view(a), b) and not check(a, None) and not check(a, b.view(1, 3))
                and not _layout_check((a, a))(a, a))
    except Exception:  # noqa: BLE001 - any failure means: do not use it
        return False


LAYOUT_CHECKS = _layout_check_works()


def layout_check(tensors: tuple):
    """``check(*others) -> bool``: True only where ``others`` are tensors of ``tensors``' dtypes, devices,
    sizes, strides, dispatch keys (a lazy negation, a batched gradient, a subclass that dispatches) and
    grad flags, one for one, and no tensor among them twice (dynamo's C++ guard of a compiled graph's
    tensor inputs, a few hundred ns for several tensors). None where this torch lacks it or it fails
    the check at import: the caller then compares the facts itself."""
    return _layout_check(tensors) if LAYOUT_CHECKS else None


# --- CUDA device and stream -----------------------------------------------------------------------------

_GET_DEVICE = _lookup(torch._C, "_cuda_getDevice")
_RAW_STREAM = _lookup(torch._C, "_cuda_getCurrentRawStream")


def _public_raw_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


# The current CUDA device's index: ``current_device()``.
current_device = _GET_DEVICE if _GET_DEVICE is not None else torch.cuda.current_device
# The current CUDA stream of device ``index``, as the integer handle a launcher takes: ``raw_stream(index)``.
raw_stream = _RAW_STREAM if _RAW_STREAM is not None else _public_raw_stream


# --- torch.compile --------------------------------------------------------------------------------------


def mark_dynamo_constant(fn):
    """``fn`` marked as ``torch.compiler.assume_constant_result`` marks it (dynamo calls it instead of
    tracing it), without importing torch._dynamo (a slow import) as that function does. The mark is the
    attribute that decorator sets; ``tests/test_compat_torch.py`` checks that it still is."""
    fn._dynamo_marked_constant = True
    return fn


# --- DTensor sharding rules -----------------------------------------------------------------------------


def register_dtensor_strategy(overload, strategy, static_argnum: int) -> None:
    """Register ``strategy(op_schema)`` as DTensor's sharding strategy of ``overload``, hashing the
    arguments from position ``static_argnum`` on into its sharding cache key. This is what the public
    ``torch.distributed.tensor.experimental.register_sharding`` does, without its limits
    (``torch_frontend._dtensor`` says which)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    DTensor._op_dispatcher.sharding_propagator.register_op_strategy(
        overload, strategy, RuntimeSchemaInfo(static_argnum=static_argnum, needs_pytree=True))


def strategy_spec(arg):
    """The current ``DTensorSpec`` of a strategy function's argument (an ``OpStrategy``), or the argument."""
    from torch.distributed.tensor._op_schema import OpStrategy

    if isinstance(arg, OpStrategy):
        return arg.strategies[0].output_spec
    return arg


def expand_to_full_mesh(mesh, op_schema, strategies: list, n_outputs: int):
    """One mesh dimension's strategies expanded to every mesh dimension (``register_sharding``'s helper)."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=n_outputs)


def schema_mesh(op_schema):
    """The mesh of an ``OpSchema``'s arguments."""
    return op_schema.get_mesh_from_args()


# --- PEFT: a LoRA layer's conversion of its input to its adapters' dtype --------------------------------

_PEFT_CAST = "_cast_input_dtype"  # peft.tuners.tuners_utils.BaseTunerLayer's (PEFT >= 0.15)
_OURS = "_normkit_takes_copy"  # marks a conversion set here


def peft_casts_input(module) -> bool:
    """Whether ``module`` is a PEFT LoRA layer that converts its input to its adapters' dtype through
    ``BaseTunerLayer._cast_input_dtype`` (``x.to(lora_A.weight.dtype)`` unless casting is disabled)."""
    return "lora_A" in module._modules and callable(getattr(type(module), _PEFT_CAST, None))


def peft_cast(layer, x, dtype):
    """PEFT's own conversion of ``x`` for ``layer`` (its class's method)."""
    return getattr(type(layer), _PEFT_CAST)(layer, x, dtype)


def set_peft_cast(layer, fn) -> None:
    """Make ``fn(layer, x, dtype)`` ``layer``'s conversion (an instance attribute over the class's
    method), once."""
    if not getattr(layer.__dict__.get(_PEFT_CAST), _OURS, False):
        import types

        setattr(fn, _OURS, True)
        layer.__dict__[_PEFT_CAST] = types.MethodType(fn, layer)  # not Module.__setattr__: a plain attribute


def restore_peft_cast(layer) -> bool:
    """Give ``layer`` back PEFT's own conversion; whether one of ``set_peft_cast``'s was there."""
    if getattr(layer.__dict__.get(_PEFT_CAST), _OURS, False):
        del layer.__dict__[_PEFT_CAST]
        return True
    return False
