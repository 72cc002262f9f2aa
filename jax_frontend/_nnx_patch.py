"""Turn the ``flax.nnx.RMSNorm`` / ``flax.nnx.LayerNorm`` modules of a model graph into normkit's, in place.

    >>> report = jax_frontend.nnx.patch_model(model)
    >>> print(report)            # what was patched, what was left alone and why

normkit's ``RMSNorm`` and ``LayerNorm`` are subclasses of flax's that replace only ``__call__``, so a
module is patched by giving the object itself the subclass (``__class__``, as
``torch.nn.utils.parametrize`` does) and normkit's options as static attributes. Nothing else
changes: the same object wherever the graph reaches it (lists, dicts, tuples, shared between
layers, held by an ``nnx.Optimizer``), the same ``nnx.Param`` objects with their values, sharding
and metadata, the same state paths. A patched RMSNorm computes flax's function (``offset=0``,
``casting_mode="gemma"``: float32 math, one rounding at the end).

Only flax's own classes are patched. A subclass of them (whose ``__call__`` may differ) and any
other module whose class name contains "Norm" (``nnx.BatchNorm``, ``nnx.GroupNorm``, a model's own
RMSNorm) are listed in the report as skipped, with the reason.
"""
from __future__ import annotations

from typing import Callable, Optional

from flax import nnx

from jax_frontend import _compat
from jax_frontend import _nnx_modules as modules
from jax_frontend import functional
from normkit import checks
from normkit.patch_report import PatchReport as _PatchReport

__all__ = ["patch_model", "unpatch_model", "PatchReport"]

# flax's class -> normkit's subclass
PATCHABLE = {nnx.RMSNorm: modules.RMSNorm, nnx.LayerNorm: modules.LayerNorm}
FLAX_OF = {new: old for old, new in PATCHABLE.items()}
NORMKIT_CLASSES = (modules.RMSNorm, modules.LayerNorm, modules.FusedAddRMSNorm)


class PatchReport(_PatchReport):
    """What ``patch_model`` (or ``unpatch_model``) did.

    ``patched``: ``(path, old class, new class)`` for each module changed; ``skipped``: ``(path, class,
    reason)`` for each norm-looking module left as it was. A path is the module's attribute path from
    the root, dotted (``"layers.0.attn_norm"``; ``""`` for the root itself); a module the graph reaches
    at several paths (shared) appears once, at the first.
    """

    @staticmethod
    def class_name(cls: type) -> str:
        return _qualname(cls)


def _qualname(cls: type) -> str:
    module = cls.__module__
    if module.startswith("flax.nnx"):
        module = "flax.nnx"  # as users write it
    elif module.startswith("jax_frontend."):
        module = "jax_frontend.nnx"
    return f"{module}.{cls.__qualname__}"


def _dotted(path) -> str:
    return ".".join(str(k) for k in path)


def _reason(module, cls) -> Optional[str]:
    """Why a module of a patchable class cannot be patched (its settings), or None."""
    return modules.unsupported(num_features=module.num_features, dtype=module.dtype, param_dtype=module.param_dtype,
                               reduction_axes=module.reduction_axes, feature_axes=module.feature_axes,
                               axis_name=module.axis_name, axis_index_groups=module.axis_index_groups)


def _classify(cls: type) -> tuple[Optional[type], Optional[str]]:
    """(normkit class, None) for a patchable class; (None, reason) for a norm-looking other one;
    (None, None) for anything else."""
    if cls in PATCHABLE:
        return PATCHABLE[cls], None
    if issubclass(cls, NORMKIT_CLASSES):
        return None, "already a normkit module"
    for flax_cls in PATCHABLE:
        if issubclass(cls, flax_cls):
            return None, f"a subclass of {_qualname(flax_cls)}, whose __call__ may differ; not known"
    if "norm" in cls.__name__.lower():
        return None, "not a class normkit knows"
    return None, None


def _set_class(module, cls: type) -> None:
    _compat.set_class(module, cls)  # past nnx's __setattr__: not an attribute of the graph


def patch_model(model: nnx.Module, *, rms_norm: bool = True, layer_norm: bool = True,
                include: Optional[Callable[[str, nnx.Module], bool]] = None,
                implementation: Optional[str] = None, save: str = "auto") -> PatchReport:
    """Make the ``nnx.RMSNorm`` and ``nnx.LayerNorm`` modules of ``model`` normkit's, in place.

    Args:
        model: any NNX module (the root of the graph; it may itself be a norm).
        rms_norm, layer_norm: patch ``nnx.RMSNorm`` / ``nnx.LayerNorm`` modules.
        include: optional ``include(path, module) -> bool``; a patchable module it rejects is skipped.
        implementation: the patched modules' ``implementation`` (None: auto; see
            ``jax_frontend.resolve_implementation``).
        save: the patched modules' ``save`` (what their backward keeps; ``jax_frontend.rms_norm``).

    Returns:
        A ``PatchReport``. Each patched module is the same object, with the same ``nnx.Param``
        objects (values, sharding metadata, state paths unchanged), now an instance of
        ``jax_frontend.nnx.RMSNorm``/``LayerNorm`` with flax's math. Modules whose settings the
        kernels cannot compute (``reduction_axes`` other than the last axis, ``axis_name``, ...) are
        skipped with the reason. Patching twice changes nothing. Patch outside of any transform;
        functions already traced (``nnx.jit``) trace again, since the graph definition changed.
    """
    if implementation is not None and implementation not in functional.IMPLEMENTATIONS:
        raise ValueError(f"normkit: unknown implementation {implementation!r}; expected None or one of "
                         f"{functional.IMPLEMENTATIONS}")
    checks.check_save(save)
    report = PatchReport()
    for path, module in list(nnx.iter_modules(model)):
        cls = type(module)
        new_cls, reason = _classify(cls)
        if new_cls is None:
            if reason is not None:
                report.skipped.append((_dotted(path), cls, reason))
            continue
        name = _dotted(path)
        flag = "rms_norm" if new_cls is modules.RMSNorm else "layer_norm"
        if not {"rms_norm": rms_norm, "layer_norm": layer_norm}[flag]:
            report.skipped.append((name, cls, f"excluded by {flag}=False"))
            continue
        if include is not None and not include(name, module):
            report.skipped.append((name, cls, "excluded by include()"))
            continue
        reason = _reason(module, cls)
        if reason is not None:
            report.skipped.append((name, cls, reason))
            continue
        # The options first: setting an attribute is what fails inside a transform, before the class changes.
        modules.set_options(module, new_cls, **new_cls.FLAX_OPTIONS, implementation=implementation, save=save)
        _set_class(module, new_cls)
        report.patched.append((name, cls, new_cls))
    return report


def unpatch_model(model: nnx.Module) -> PatchReport:
    """Make normkit's ``RMSNorm``/``LayerNorm`` modules of ``model`` flax's again, in place.

    Every normkit ``RMSNorm`` or ``LayerNorm`` whose function flax's class computes (an RMSNorm with
    ``offset=0`` and ``casting_mode="gemma"``, as ``patch_model`` leaves it; any LayerNorm) becomes an
    instance of flax's class again, without normkit's attributes: the same object and parameters.
    Others (another offset or casting mode, ``FusedAddRMSNorm``) are listed as skipped.
    """
    report = PatchReport(verb="restored")
    for path, module in list(nnx.iter_modules(model)):
        cls = type(module)
        if not issubclass(cls, NORMKIT_CLASSES):
            continue
        name = _dotted(path)
        if cls not in FLAX_OF:
            reason = ("flax has no fused add-and-norm module" if cls is modules.FusedAddRMSNorm
                      else "a subclass of a normkit module; not known")
            report.skipped.append((name, cls, reason))
            continue
        differ = {k: getattr(module, k) for k, v in cls.FLAX_OPTIONS.items() if getattr(module, k) != v}
        if differ:
            report.skipped.append((name, cls, ", ".join(f"{k}={v!r}" for k, v in differ.items())
                                   + f": not the function {_qualname(FLAX_OF[cls])} computes"))
            continue
        for option in cls.OPTIONS:
            delattr(module, option)
        _set_class(module, FLAX_OF[cls])
        report.patched.append((name, cls, FLAX_OF[cls]))
    return report
