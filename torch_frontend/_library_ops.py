"""The torch.library ops: normkit's passes as operators, for ``torch.compile`` and tensor subclasses.

An eager call on plain tensors launches its bound plans directly (``_bound``), with no dispatcher.
Two other callers need operators:

- ``torch.compile`` on CUDA with static shapes: the ``torch.library.triton_op`` ops
  ``normkit::norm_fwd_cuda`` / ``normkit::norm_bwd_cuda``, whose launches go through ``wrap_triton``:
  Inductor emits the kernels into its generated code, and CUDA graphs capture them;
- tensor subclasses (DTensor), and ``torch.compile`` on CPU or with dynamic shapes: the opaque custom
  ops ``normkit::norm_fwd`` / ``normkit::norm_bwd`` with fake (meta) implementations; DTensor
  dispatches them to its local shards (``_dtensor`` registers their sharding). Their bodies run on
  real tensors and launch the same bound plans as an eager call (``_bound``).

Row tensors keep the caller's shape ``(..., D)``; the per-row statistics have shape ``(...)``; the
weight's recovery (for a backward that reads the output) is a ``(D + 1,)`` tensor of its own. An
absent result is an empty ``(0,)`` tensor (the ops return ``Tensor[]``).
"""
from __future__ import annotations

from typing import Optional

import torch

from normkit import driver
from normkit.ops import OPS, Casting, Grads, Op, Options, rec_offset
from torch_frontend import _bound, _compat
from torch_frontend._backend import INDUCTOR_BACKEND, TORCH_DTYPES, copy_rows, dtype_name, row_view

FWD_RESULTS = driver.FWD_RESULTS[:5]  # Y, S, MEAN, RSTD, REC: the ops write no copy of y (Y2)
BWD_RESULTS = ("DX", "DW", "DB")

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # what the eager path launches on directly


def subclassed(*tensors) -> bool:
    """A tensor subclass (DTensor, FakeTensor, ...) among ``tensors``; a module's ``nn.Parameter`` is plain."""
    return any(t is not None and type(t) not in _PLAIN for t in tensors)


def _operators(x, *tensors) -> tuple:
    """The ``(forward, backward)`` ops of a call: the triton ops when compiling plain CUDA tensors, the
    opaque custom ops otherwise (tensor subclasses; compiling on CPU or with symbolic shapes)."""
    # Symbolic shapes cannot be told apart here (dynamo answers isinstance(SymInt, int) with True); the
    # triton ops hand such calls to the opaque ops themselves (_traced_forward / _traced_backward).
    if (torch.compiler.is_compiling() and x.device.type == "cuda" and not subclassed(x, *tensors)
            and triton_ops_registered()):
        return torch.ops.normkit.norm_fwd_cuda, torch.ops.normkit.norm_bwd_cuda
    return torch.ops.normkit.norm_fwd, torch.ops.normkit.norm_bwd


def _absent(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


def _symbolic(x: torch.Tensor) -> bool:
    """Sizes that are SymInts (``torch.compile(dynamic=True)``): no plan can be sized from them. Run
    inside an op's body (fake-tensor tracing), where a SymInt is not an int, unlike in dynamo's trace."""
    return not all(isinstance(d, int) for d in x.shape)


def _rows(t, name):
    if t is None:
        return None
    rows = row_view(t)
    return rows if rows is not None else copy_rows(t, name)


def _norm_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
              bias: Optional[torch.Tensor], op: str, eps: float, offset: float, casting: int,
              store_stats: bool, store_rec: bool) -> list[torch.Tensor]:
    """(y, residual_out, mean, rstd, rec) of real tensors: the bound plans of the call's signature
    (whose recovery follows the rows in rstd: split off here into a tensor of its own)."""
    spec, opts = OPS[op], Options(eps, offset, Casting(casting))
    k = _bound.key(spec, eps, offset, casting, store_stats, x, residual, weight, bias)
    bound = (_bound.BOUND.get(k) or _bound.bind(k, spec, opts, store_stats)).bound(store_rec)
    y, s, mean, rstd, _, _ = bound.forward(x, residual, weight, bias)
    rec = None
    if store_rec:
        M = x.numel() // max(x.shape[-1], 1)
        rstd, rec = rstd[:M].view(x.shape[:-1]), rstd[rec_offset(M):].clone()
    return [t if t is not None else _absent(x) for t in (y, s, mean, rstd, rec)]


def _norm_bwd(saved: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], dy: torch.Tensor,
              dres: Optional[torch.Tensor], mean: Optional[torch.Tensor], rstd: torch.Tensor,
              rec: Optional[torch.Tensor], op: str, offset: float, casting: int, dx: bool, dw: bool, db: bool,
              b_dtype: torch.dtype, from_output: bool) -> list[torch.Tensor]:
    """(dx, dweight, dbias) of real tensors; a result not asked for is an empty (0,) tensor."""
    spec, opts = OPS[op], Options(0.0, offset, Casting(casting))
    # a Bound of the backward alone, keyed on its options (its plans are kept per layout inside it)
    k = ("backward", op, offset, casting, b_dtype, from_output)
    bound = (_bound.BOUND.get(k) or _bound.bind(k, spec, opts, True, dtype_name(b_dtype))).bound(from_output)
    outs = bound.backward(saved, weight, bias, dy, dres, mean, rstd.reshape(-1).contiguous(), Grads(dx, dw, db),
                          rec if from_output else None)
    return [t if t is not None else _absent(saved) for t in outs]


def _inductor_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], op: str, eps: float, offset: float, casting: int,
                  store_stats: bool, store_rec: bool) -> list[torch.Tensor]:
    """The triton op's body: the driver's launches through ``wrap_triton``, traced by Inductor."""
    if _symbolic(x):  # traced with symbolic shapes: no plan can be made, the opaque op runs instead
        return torch.ops.normkit.norm_fwd(x, residual, weight, bias, op, eps, offset, casting, store_stats,
                                          store_rec)
    shape = x.shape
    outs = driver.forward(INDUCTOR_BACKEND, OPS[op], _rows(x, "x"), _rows(residual, "residual"), weight, bias,
                          Options(eps, offset, Casting(casting)), store_stats, store_rec)[:len(FWD_RESULTS)]
    lead = shape[:-1]
    return [_absent(x) if t is None else t.view(shape) if i < 2 else t.view(lead) if i < 4 else t
            for i, t in enumerate(outs)]


def _inductor_bwd(saved: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  dy: torch.Tensor, dres: Optional[torch.Tensor], mean: Optional[torch.Tensor], rstd: torch.Tensor,
                  rec: Optional[torch.Tensor], op: str, offset: float, casting: int, dx: bool, dw: bool, db: bool,
                  b_dtype: torch.dtype, from_output: bool) -> list[torch.Tensor]:
    if _symbolic(saved):
        return torch.ops.normkit.norm_bwd(saved, weight, bias, dy, dres, mean, rstd, rec, op, offset, casting, dx, dw,
                                          db, b_dtype, from_output)
    rows = lambda t: None if t is None else t.reshape(-1).contiguous()  # noqa: E731  (statistics)
    outs = driver.backward(INDUCTOR_BACKEND, OPS[op], _rows(saved, "the saved input"), weight,
                           _rows(dy, "the output gradient"), _rows(dres, "the residual_out gradient"), rows(mean),
                           rows(rstd), Options(0.0, offset, Casting(casting)), Grads(dx, dw, db),
                           dtype_name(b_dtype), bias, from_output, rec)
    return [t.view(saved.shape) if i == 0 and t is not None else t if t is not None else _absent(saved)
            for i, t in enumerate(outs)]


_norm_fwd_op = torch.library.custom_op("normkit::norm_fwd", _norm_fwd, mutates_args=())
_norm_bwd_op = torch.library.custom_op("normkit::norm_bwd", _norm_bwd, mutates_args=())


@_norm_fwd_op.register_fake
def _(x, residual, weight, bias, op, eps, offset, casting, store_stats, store_rec):
    M, N = x.numel() // max(x.shape[-1], 1), x.shape[-1]
    specs = OPS[op].fwd_buffers(M, N, dtype_name(x.dtype), store_stats, store_rec)
    return [x.new_empty(driver.caller_shape(name, specs[name][0], x.shape), dtype=TORCH_DTYPES[specs[name][1]])
            if name in specs else _absent(x) for name in FWD_RESULTS]


@_norm_bwd_op.register_fake
def _(saved, weight, bias, dy, dres, mean, rstd, rec, op, offset, casting, dx, dw, db, b_dtype, from_output):
    M, N = saved.numel() // max(saved.shape[-1], 1), saved.shape[-1]
    w_dtype = dtype_name(weight.dtype) if weight is not None else None
    specs = OPS[op].bwd_buffers(M, N, dtype_name(saved.dtype), Grads(dx, dw, db), w_dtype, dtype_name(b_dtype))
    return [saved.new_empty(driver.caller_shape(name, specs[name][0], saved.shape), dtype=TORCH_DTYPES[specs[name][1]])
            if name in specs else _absent(saved) for name in BWD_RESULTS]


TRITON_OPS: list = []


def triton_ops_registered() -> bool:
    """Registers ``normkit::norm_fwd_cuda`` / ``normkit::norm_bwd_cuda`` (the custom ops' schema, as
    ``torch.library.triton_op``) on first use. Registering imports torch._dynamo, a slow import, so it waits
    for the first compilation. Dynamo runs this function as it is rather than tracing it (what
    ``torch.compiler.assume_constant_result`` marks; the mark is set by hand because that function
    imports torch._dynamo too)."""
    if not TRITON_OPS:
        TRITON_OPS.append(torch.library.triton_op("normkit::norm_fwd_cuda", _inductor_fwd, mutates_args=()))
        TRITON_OPS.append(torch.library.triton_op("normkit::norm_bwd_cuda", _inductor_bwd, mutates_args=()))
    return True


_compat.mark_dynamo_constant(triton_ops_registered)


def forward(op: Op, x, residual, weight, bias, opts: Options, store_stats: bool, store_rec: bool = False) -> tuple:
    """``(y, residual_out, mean, rstd, rec, None)``, as ``normkit.driver.forward``'s results, through the
    call's operators; an absent result is None (y's copy, Y2, always: the traced routes convert y
    themselves). ``store_rec``: the backward will read y (the weight's recovery is computed too)."""
    fwd, _ = _operators(x, residual, weight, bias)
    outs = fwd(x, residual, weight, bias, op.name, opts.eps, opts.offset, int(opts.casting), store_stats, store_rec)
    present = op.fwd_buffers(1, 1, "float32", store_stats, store_rec)
    return (*(t if name in present else None for name, t in zip(FWD_RESULTS, outs)), None)


def backward(op: Op, saved, weight, bias, dy, dres, mean, rstd, rec, opts: Options, grads: Grads,
             b_dtype: torch.dtype, from_output: bool) -> tuple:
    """``(dx, dweight, dbias)`` through the call's operators; a result not asked for is None."""
    _, bwd = _operators(saved, weight, dy, dres)
    outs = bwd(saved, weight, bias if from_output else None, dy, dres, mean, rstd, rec if from_output else None,
               op.name, opts.offset, int(opts.casting), grads.dx, grads.dw, grads.db, b_dtype, from_output)
    return tuple(t if want else None for t, want in zip(outs, (grads.dx, grads.dw, grads.db)))
