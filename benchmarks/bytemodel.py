"""The byte model: the bytes each op and mode must move at the least (benchmarks/README.md, "Byte model").

Every input is read once and every output written once, per pass: activation-sized tensors ``M * N * s``
bytes (s: x's element size), parameter-sized ones ``N * ws``, per-row fp32 statistics ``4 * M``. Not
counted: the fp32 partial-dW/dB buffers (reported apart, as ``partial_bytes``), what an implementation
chooses to save or recompute, and the fused add's second gradient (d(residual) is dx, written once).
``fwd`` is the inference forward (no statistics); ``fwd_bwd`` the training forward, then the full backward.
"""
from __future__ import annotations

from normkit.ops import ELEM_BYTES, OPS as _OPS, Op

STAT = 4  # bytes per row of an fp32 statistic (mean, rstd)
MODES = ("fwd", "bwd_full", "bwd_frozen", "fwd_bwd")  # the benchmarks' one list of modes
OPS = tuple(_OPS)
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}  # the benchmarks' short dtype names -> normkit's


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype``, short ("bf16") or normkit's ("bfloat16") name."""
    return ELEM_BYTES[DTYPES.get(dtype, dtype)]


def input_set_bytes(op: str, M: int, N: int, itemsize: int) -> int:
    """The activation-sized arrays one timed call reads fresh: the row inputs (x, the residual) and
    the outputs' cotangents (dy, and the residual output's). Input sets are rotated by this size."""
    spec = _OPS[op]
    return (len(spec.row_inputs) + len(spec.outputs)) * M * N * itemsize


def _stats(op: Op) -> tuple[str, ...]:
    return ("mean", "rstd") if op.saves_mean else ("rstd",)


def forward_terms(op: Op, M, N, s, ws, *, stats=False) -> dict[str, int]:
    """Read the row inputs and the parameters; write the outputs (and the statistics when training)."""
    t = {f"read {name}": M * N * s for name in op.row_inputs}
    t.update({f"read {name}": N * ws for name in op.params})
    t.update({f"write {name}": M * N * s for name in op.outputs})
    if stats:
        t.update({f"write {name}": STAT * M for name in _stats(op)})
    return t


def backward_terms(op: Op, M, N, s, ws, *, frozen) -> dict[str, int]:
    """Read what the forward normalized (x, or residual_out for the fused add), dy (and the gradient of
    residual_out), the weight and the statistics; write dx (one tensor, which the fused add's residual
    shares) and, unless frozen, each parameter's gradient. The bias is not read."""
    t = {"read residual_out" if op.has_residual else "read x": M * N * s, "read dy": M * N * s}
    if op.has_residual:
        t["read d_residual_out"] = M * N * s
    t["read weight"] = N * ws
    t.update({f"read {name}": STAT * M for name in _stats(op)})
    t["write dx (= d_residual)" if op.has_residual else "write dx"] = M * N * s
    if not frozen:
        t.update({f"write d{name}": N * ws for name in op.params})
    return t


def terms(op: str, mode: str, M: int, N: int, itemsize: int, w_itemsize: int | None = None) -> dict[str, int]:
    """Named byte terms of one (op, mode); their sum is the modelled traffic."""
    ws = itemsize if w_itemsize is None else w_itemsize
    spec = _OPS[op]
    if mode == "fwd":
        return forward_terms(spec, M, N, itemsize, ws)
    if mode in ("bwd_full", "bwd_frozen"):
        return backward_terms(spec, M, N, itemsize, ws, frozen=mode == "bwd_frozen")
    if mode == "fwd_bwd":
        fwd = {f"fwd: {k}": v for k, v in forward_terms(spec, M, N, itemsize, ws, stats=True).items()}
        bwd = {f"bwd: {k}": v for k, v in backward_terms(spec, M, N, itemsize, ws, frozen=False).items()}
        return {**fwd, **bwd}
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def bytes_moved(op: str, mode: str, M: int, N: int, itemsize: int, w_itemsize: int | None = None) -> int:
    """The modelled bytes of one call of ``op`` in ``mode``."""
    return sum(terms(op, mode, M, N, itemsize, w_itemsize).values())
