"""The torch.library ops, and the route of a call to them or to the driver directly.

A call reaches the driver one of three ways:

- eager, plain tensors: directly (``_rows.forward``/``backward``; no dispatcher);
- ``torch.compile`` on CUDA: through the ``torch.library.triton_op`` ops ``normkit::norm_fwd_cuda``
  / ``normkit::norm_bwd_cuda``, whose launches go through ``wrap_triton``: Inductor emits the
  kernels into its generated code, and CUDA graphs capture them;
- tensor subclasses (DTensor), and ``torch.compile`` on CPU or with dynamic shapes: through the
  opaque custom ops ``normkit::norm_fwd`` / ``normkit::norm_bwd`` with fake (meta) implementations;
  DTensor dispatches them to its local shards (``_dtensor`` registers their sharding).

Row tensors keep the caller's shape ``(..., D)``; the per-row statistics have shape ``(...)``. An
absent result is an empty ``(0,)`` tensor (the ops return ``Tensor[]``).
"""
from __future__ import annotations

from typing import Optional

import torch

from normkit.ops import OPS, Casting, Grads, Op, Options
from torch_frontend import _rows
from torch_frontend._backend import BACKEND, INDUCTOR_BACKEND, TORCH_DTYPES, dtype_name, nd_shape

FWD_RESULTS = ("Y", "S", "MEAN", "RSTD")
BWD_RESULTS = ("DX", "DW", "DB")

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # what the eager path launches on directly


def subclassed(*tensors) -> bool:
    """A tensor subclass (DTensor, FakeTensor, ...) among ``tensors``; a module's ``nn.Parameter`` is plain."""
    return any(t is not None and type(t) not in _PLAIN for t in tensors)


def _route(x, *tensors) -> tuple | None:
    """The ``(forward, backward)`` ops a call goes through: None in eager mode (the driver directly, so
    module calls skip the dispatcher), the triton ops when compiling plain CUDA tensors of static
    shape, the opaque custom ops otherwise (tensor subclasses; compiling on CPU or with symbolic
    shapes)."""
    if not torch.compiler.is_compiling():
        return (torch.ops.normkit.norm_fwd, torch.ops.normkit.norm_bwd) if subclassed(x, *tensors) else None
    # Symbolic shapes cannot be told apart here (dynamo answers isinstance(SymInt, int) with True); the
    # triton ops hand such calls to the opaque ops themselves (_fwd_body / _bwd_body).
    if x.device.type == "cuda" and not subclassed(x, *tensors) and triton_ops_registered():
        return torch.ops.normkit.norm_fwd_cuda, torch.ops.normkit.norm_bwd_cuda
    return torch.ops.normkit.norm_fwd, torch.ops.normkit.norm_bwd


def _absent(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


def _symbolic(x: torch.Tensor) -> bool:
    """Sizes that are SymInts (``torch.compile(dynamic=True)``): no plan can be sized from them. Run
    inside an op's body (fake-tensor tracing), where a SymInt is not an int, unlike in dynamo's trace."""
    return not all(isinstance(d, int) for d in x.shape)


def _fwd_body(backend):
    def norm_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], op: str, eps: float, offset: float, casting: int,
                 store_stats: bool) -> list[torch.Tensor]:
        """(y, residual_out, mean, rstd); an absent result is an empty (0,) tensor."""
        if backend is INDUCTOR_BACKEND and _symbolic(x):  # the triton op, traced with symbolic shapes
            return torch.ops.normkit.norm_fwd(x, residual, weight, bias, op, eps, offset, casting, store_stats)
        outs = _rows.forward(OPS[op], x, residual, weight, bias, Options(eps, offset, Casting(casting)), store_stats,
                             backend)
        return [t if t is not None else _absent(x) for t in outs]
    return norm_fwd


def _bwd_body(backend):
    def norm_bwd(x: torch.Tensor, weight: Optional[torch.Tensor], dy: torch.Tensor, dres: Optional[torch.Tensor],
                 mean: Optional[torch.Tensor], rstd: torch.Tensor, op: str, offset: float, casting: int,
                 dx: bool, dw: bool, db: bool, b_dtype: torch.dtype) -> list[torch.Tensor]:
        """(dx, dweight, dbias); a result not asked for is an empty (0,) tensor."""
        if backend is INDUCTOR_BACKEND and _symbolic(x):
            return torch.ops.normkit.norm_bwd(x, weight, dy, dres, mean, rstd, op, offset, casting, dx, dw, db, b_dtype)
        outs = _rows.backward(OPS[op], x, weight, dy, dres, mean, rstd, Options(0.0, offset, Casting(casting)),
                              Grads(dx, dw, db), dtype_name(b_dtype), backend)
        return [t if t is not None else _absent(x) for t in outs]
    return norm_bwd


_norm_fwd_op = torch.library.custom_op("normkit::norm_fwd", _fwd_body(BACKEND), mutates_args=())
_norm_bwd_op = torch.library.custom_op("normkit::norm_bwd", _bwd_body(BACKEND), mutates_args=())


@_norm_fwd_op.register_fake
def _(x, residual, weight, bias, op, eps, offset, casting, store_stats):
    M, N = x.numel() // max(x.shape[-1], 1), x.shape[-1]
    specs = OPS[op].fwd_buffers(M, N, dtype_name(x.dtype), store_stats)
    return [x.new_empty(nd_shape(name, x.shape, specs[name][0]), dtype=TORCH_DTYPES[specs[name][1]])
            if name in specs else _absent(x) for name in FWD_RESULTS]


@_norm_bwd_op.register_fake
def _(x, weight, dy, dres, mean, rstd, op, offset, casting, dx, dw, db, b_dtype):
    M, N = x.numel() // max(x.shape[-1], 1), x.shape[-1]
    w_dtype = dtype_name(weight.dtype) if weight is not None else None
    specs = OPS[op].bwd_buffers(M, N, dtype_name(x.dtype), Grads(dx, dw, db), w_dtype, dtype_name(b_dtype))
    return [x.new_empty(nd_shape(name, x.shape, specs[name][0]), dtype=TORCH_DTYPES[specs[name][1]])
            if name in specs else _absent(x) for name in BWD_RESULTS]


TRITON_OPS: list = []


def triton_ops_registered() -> bool:
    """Registers ``normkit::norm_fwd_cuda`` / ``normkit::norm_bwd_cuda`` (the custom ops' schema, as
    ``torch.library.triton_op``) on first use. Registering imports torch._dynamo (1.4 s), so it waits
    for the first compilation. Dynamo runs this function as it is rather than tracing it (what
    ``torch.compiler.assume_constant_result`` marks; the mark is set by hand because that function
    imports torch._dynamo too)."""
    if not TRITON_OPS:
        TRITON_OPS.append(torch.library.triton_op("normkit::norm_fwd_cuda", _fwd_body(INDUCTOR_BACKEND),
                                                  mutates_args=()))
        TRITON_OPS.append(torch.library.triton_op("normkit::norm_bwd_cuda", _bwd_body(INDUCTOR_BACKEND),
                                                  mutates_args=()))
    return True


triton_ops_registered._dynamo_marked_constant = True  # torch._dynamo.decorators.assume_constant_result


def forward(op: Op, x, residual, weight, bias, opts: Options, store_stats: bool) -> tuple:
    """``(y, residual_out, mean, rstd)`` through the route of the call; an absent result is None."""
    ops = _route(x, residual, weight, bias)
    if ops is None:
        return _rows.forward(op, x, residual, weight, bias, opts, store_stats)
    outs = ops[0](x, residual, weight, bias, op.name, opts.eps, opts.offset, int(opts.casting), store_stats)
    present = op.fwd_buffers(1, 1, "float32", store_stats)
    return tuple(t if name in present else None for name, t in zip(FWD_RESULTS, outs))


def backward(op: Op, x, weight, dy, dres, mean, rstd, opts: Options, grads: Grads, b_dtype: torch.dtype) -> tuple:
    """``(dx, dweight, dbias)`` through the route of the call; a result not asked for is None."""
    ops = _route(x, weight, dy, dres)
    if ops is None:
        return _rows.backward(op, x, weight, dy, dres, mean, rstd, opts, grads, dtype_name(b_dtype))
    outs = ops[1](x, weight, dy, dres, mean, rstd, op.name, opts.offset, int(opts.casting), grads.dx, grads.dw,
                  grads.db, b_dtype)
    return tuple(t if want else None for t, want in zip(outs, (grads.dx, grads.dw, grads.db)))
