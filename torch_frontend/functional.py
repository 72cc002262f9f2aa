"""The Torch frontend's public functions: ``rms_norm``, ``layer_norm`` and ``fused_add_rms_norm``, their
validation and their routes.

A call takes one route, chosen in one place, ``_apply``:

- **traced** (inside ``torch.compile``, or compiled autograd): a norm whose parameters are frozen runs
  as torch operations that Inductor generates and fuses with its neighbours (``_composite``); one
  with a trained parameter runs the kernels through the op's Function and the torch.library ops
  (``_library_ops``);
- **subclass** (DTensor, ...): the op's Function through the torch.library ops, which DTensor
  dispatches to the local shards (``_dtensor``), where the eager route's bound plans run;
- **no-grad** (plain tensors that no gradient can reach: grad or inference mode off, or no input
  requiring one, and no ``torch.func`` transform active): the signature's ``normkit.driver.Bound``
  launches the forward alone;
- **eager** (plain tensors otherwise): the signature's ``Bound`` through the op's autograd Function
  (``_autograd``); under a ``torch.func`` transform the Function raises (it has no vmap or jvp rule).

A signature is validated and bound on its first call (``_bound``). What the backward keeps, the
input or the output, is ``save`` (``_save``).
"""
from __future__ import annotations

from typing import Optional

import torch

from normkit import checks
from normkit.ops import FUSED_ADD_RMS_NORM, LAYER_NORM, PARAM_DTYPES, RMS_NORM, X_DTYPES, Op, Options, copies_exactly
from torch_frontend import _autograd, _bound, _compat, _composite, _save
from torch_frontend._backend import DTYPE_NAMES, TORCH_DTYPES, NormkitCopyWarning, dtype_name, resolve_neg
from torch_frontend._library_ops import subclassed

__all__ = ["rms_norm", "layer_norm", "fused_add_rms_norm", "NormkitCopyWarning"]


def _check(op: Op, x, residual, weight, bias, eps, offset, casting_mode, save) -> Options:
    """The options of a valid call; raises, naming the argument, before anything is launched."""
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"normkit: {name} must be a torch.Tensor; got {type(t).__name__}")
        if t.is_nested:
            raise TypeError(f"normkit: {name} is a nested tensor; normkit normalizes dense tensors: pad it, or call "
                            f"normkit on each component (or on {name}.values() of a jagged tensor)")
        if t.layout != torch.strided:
            raise TypeError(f"normkit: {name} has layout {t.layout}; normkit normalizes dense (torch.strided) tensors: "
                            f"pass {name}.to_dense()")
    # the dtype's name from the table (``dtype_name`` names the others, for the error)
    spec = lambda t: (None if t is None else  # noqa: E731
                      (tuple(t.shape), DTYPE_NAMES.get(t.dtype) or dtype_name(t.dtype)))
    checks.check(op, x_shape=spec(x)[0], x_dtype=spec(x)[1], residual=spec(residual), weight=spec(weight),
                 bias=spec(bias))
    checks.check_save(save)
    opts = op.options(eps=eps, offset=offset, casting_mode=casting_mode)
    for name, t in (("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"normkit: {name} is on {t.device} but x is on {x.device}; all tensors must share a device")
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"normkit: x is on {x.device}; normkit runs on CUDA (compiled) or CPU (interpreted)")
    # DTensor placement checks and the custom ops' sharding registration, imported only when a tensor
    # subclass arrives (torch_frontend/_dtensor.py).
    if subclassed(x, residual, weight, bias):
        from torch_frontend import _dtensor
        _dtensor.check(op, x, residual, weight, bias)
    return opts


def _outputs(op: Op, outs: tuple):
    return (outs[0], outs[1]) if op.has_residual else outs[0]


def _apply(op: Op, x, residual, weight, bias, eps, offset, casting_mode, save, known=None, copy=None):
    """A call by its route (the module docstring). ``known``: a normkit module's ``save_hint``, what it
    knows of its weight for the traced route (``torch_frontend.modules``). ``copy``: ``(dtype, keep)``
    where the output's consumers take it in another dtype (``torch_frontend.patch``): on the eager and
    no-grad routes y then carries that copy (``copy_of``), and with ``keep`` a norm keeping its output
    keeps the copy instead. The signature's forward kernel writes that copy beside y where it holds y
    exactly and is not y's own dtype (``_KERNEL_COPIES``); otherwise y is converted."""
    if torch.compiler.is_compiling():  # traced
        return _compiled(op, x, residual, weight, bias, eps, offset, casting_mode, save, known)
    k = y2_dtype = None
    try:
        store_stats = torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and (
            x.requires_grad or (residual is not None and residual.requires_grad)
            or (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad))
        if x.is_neg() or (residual is not None and residual.is_neg()) or (weight is not None and weight.is_neg()) or (
                bias is not None and bias.is_neg()):
            x, residual, weight, bias = (resolve_neg(t, name) for t, name in
                                         ((x, "x"), (residual, "residual"), (weight, "weight"), (bias, "bias")))
        if copy is not None and (x.dtype, copy[0]) in _KERNEL_COPIES:
            y2_dtype = copy[0]
        call = _bound.options(store_stats, save, y2_dtype, eps, offset, casting_mode)
        sig = _bound.last(op, call, x, residual, weight, bias)
        if sig is None:
            k = _bound.key(op, eps, offset, casting_mode, store_stats, x, residual, weight, bias, save, y2_dtype)
            sig = _bound.BOUND.get(k)  # hashes the key: raises TypeError for an unhashable option
            if sig is not None:
                _bound.note(op, call, x, residual, weight, bias, sig)
    except (AttributeError, TypeError, RuntimeError):  # not a tensor, an unhashable option, a tensor without
        # strides or sizes (sparse, mkldnn, nested): the checks below name it
        k = sig = None
    if sig is None:
        opts = _check(op, x, residual, weight, bias, eps, offset, casting_mode, save)
        b_dtype = dtype_name(bias.dtype) if bias is not None else "float32"
        if subclassed(x, residual, weight, bias):  # subclass
            from_output = store_stats and _save.saves_output(op, save, x, weight, bias, opts.offset, opts.casting,
                                                             _compat.checkpointing())
            route = _autograd.Traced(op, opts, store_stats, from_output, b_dtype)
            if not store_stats and not _compat.transforms_active():
                return _outputs(op, route.forward(x, residual, weight, bias))
            return _autograd.apply(route, op, x, residual, weight, bias)
        # k None (not keyable): not remembered
        sig = _bound.bind(k, op, opts, store_stats, b_dtype, save, None if y2_dtype is None else DTYPE_NAMES[y2_dtype])
    bound = sig.fixed or sig.route(x, weight, bias)
    transformed = _compat.transforms_active()
    if not store_stats and not transformed:  # no-grad
        y, s, _, _, _, y2 = bound.forward(x, residual, weight, bias)
        if copy is not None:
            _attach_copy(y, y.to(copy[0]) if y2 is None else y2)
        return (y, s) if op.has_residual else y
    if copy is not None:  # eager, with the consumers' copy of y
        *outs, y2 = _autograd.apply(bound, op, x, residual, weight, bias, copy)
        _attach_copy(outs[0], y2)
        return tuple(outs) if op.has_residual else outs[0]
    if not transformed:  # eager
        return _autograd.apply_eager(bound, op, x, residual, weight, bias)
    return _autograd.apply(bound, op, x, residual, weight, bias)  # eager, under a torch.func transform


_COPY = "_normkit_copy"  # the attribute of an output that carries its copy in another dtype

# (x's dtype, the copy's dtype) where the forward kernel writes y's copy beside y (Y2): a wider dtype, which
# holds y exactly (normkit.ops.copies_exactly); in x's own dtype the copy is y itself (``y.to``)
_KERNEL_COPIES = frozenset((TORCH_DTYPES[a], TORCH_DTYPES[b]) for a in X_DTYPES for b in PARAM_DTYPES
                           if a != b and copies_exactly(a, b))


def _attach_copy(y, y2) -> None:
    # with both versions: an in-place write to either after this makes the copy stale (``copy_of``)
    try:
        setattr(y, _COPY, (y2, y._version, y2._version))
    except RuntimeError:  # an inference tensor has no version counter: no copy to share
        pass


def copy_of(x, dtype):
    """The copy of ``x`` in ``dtype`` that the norm that produced ``x`` wrote with it (``_apply``'s
    ``copy``), or None: none was written, or x or the copy has been written in place since."""
    c = getattr(x, _COPY, None)
    if c is None or c[0].dtype is not dtype or c[1] != x._version or c[2] != c[0]._version:
        return None
    return c[0]


def _compiled(op: Op, x, residual, weight, bias, eps, offset, casting_mode, save, known):
    """Inside a ``torch.compile`` trace: frozen norms as torch operations for Inductor (``_composite``),
    others through the op's Function and the torch.library ops."""
    opts = _check(op, x, residual, weight, bias, eps, offset, casting_mode, save)
    from_output = _save.traced_saves_output(op, save, x, weight, bias, opts.offset,
                                            known.get(x.dtype) if known else None)
    if _composite.applies(x, residual, weight, bias):
        return _composite.apply(op, opts, x, residual, weight, bias, from_output)
    store_stats = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, residual, weight, bias))
    route = _autograd.Traced(op, opts, store_stats, from_output and store_stats,
                             dtype_name(bias.dtype) if bias is not None else "float32")
    return _autograd.apply(route, op, x, residual, weight, bias)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6, *, offset: float = 0.0,
             casting_mode: str = "llama", save: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2) + eps) * (weight + offset)``.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16, any strides (rows are read in place when the last
            dimension is contiguous or broadcast; other layouts are copied with a ``NormkitCopyWarning``).
        weight: ``(D,)`` float32, bfloat16, float16 or float64, any stride (sliced and expanded weights
            are read in place), or None for no elementwise scale.
        eps: added to the mean square; a Python number >= 0 that fits in float32 (the kernels compute
            in fp32). With ``eps=0`` an all-zero row is 0/0: NaN, as in ``torch.nn.functional.rms_norm``.
        offset: added to the weight (Gemma: 1.0); a Python number that fits in float32.
        casting_mode: ``"llama"`` (normalize in fp32, round to x.dtype, then scale), ``"gemma"`` (all fp32,
            round at the end) or ``"none"`` (products rounded to x.dtype).
        save: what the backward keeps: ``"auto"`` (the output where every parameter is frozen and the
            weight allows recovering x_hat from it, else the input), ``"input"`` or ``"output"`` (raises
            for a trained parameter or such a weight). Keeping the output frees x where y is kept
            anyway (a LoRA adapter in x's dtype keeps it) and x is held for the norm alone; see
            ``torch_frontend.save_decision``.

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.rms_norm``.

    Gradients come from the kernels, for the inputs autograd asks for. A gradient that is itself
    differentiated (``create_graph=True``) is computed with differentiable float64 torch operations
    instead (``torch_frontend._autograd``). ``torch.func`` transforms are not supported (they raise).
    """
    return _apply(RMS_NORM, x, None, weight, None, eps, offset, casting_mode, save)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5, *, save: str = "auto") -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``, computed in fp32.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16 (layouts as in ``rms_norm``).
        weight, bias: ``(D,)`` float32, bfloat16, float16 or float64, any stride, or None.
        eps: added to the variance; a Python number >= 0 that fits in float32. With ``eps=0`` a
            constant row is 0/0: NaN, as in ``torch.nn.functional.layer_norm``.
        save: as in ``rms_norm``.

    Returns:
        ``(..., D)`` in x.dtype. The math is in ``normkit.reference.layer_norm``. Gradients as in
        ``rms_norm``.
    """
    return _apply(LAYER_NORM, x, None, weight, bias, eps, 0.0, "llama", save)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor] = None,
                       eps: float = 1e-6, *, offset: float = 0.0, casting_mode: str = "llama",
                       save: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to x.dtype) and ``y = rms_norm(s)``, in one pass.

    Returns:
        ``(y, residual_out)`` where ``residual_out = s``; both ``(..., D)`` in x.dtype. x and residual
        must share shape and dtype; they receive equal gradients, in separate tensors. See ``rms_norm``
        for the options.
    """
    return _apply(FUSED_ADD_RMS_NORM, x, residual, weight, None, eps, offset, casting_mode, save)
