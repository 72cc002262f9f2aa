"""The byte model: the bytes each op and mode must move at the least.

Rule: every input is read once and every output is written once, per pass. Achieved bandwidth is
``bytes / median time``; it is divided by a device-to-device copy's bandwidth (read + write counted)
measured in the same run.

Sizes, for ``x`` of shape M x N with element size ``s`` and a weight/bias element size ``ws``:

- ``MN``: an activation-sized tensor, ``M * N * s`` bytes (x, residual, y, residual_out, dy, ds, dx);
- ``N``: a parameter-sized tensor, ``N * ws`` bytes (weight, bias, dweight, dbias);
- ``M``: a per-row fp32 statistic, ``4 * M`` bytes (rstd; LayerNorm also mean).

What is deliberately NOT counted:

- fp32 partial-dW/dB buffers, written by the backward's programs and read back by the reduction
  (``G x N x 4`` bytes each way, G <= 2 x SMs): that traffic is the cost of the full backward's
  design and is reported apart (``partial_bytes`` of normkit's kernel-path records);
- whatever an implementation chooses to save or recompute beyond the statistics above (XLA's fp32
  residuals, torch.compile's recomputation): the model describes the op, not one implementation;
- the second gradient of the fused add: d(residual) equals dx, and the Torch frontends return the
  same tensor for both, so it is written once.

``fwd`` is the inference forward (no statistics written); ``fwd_bwd`` is the training forward
(statistics written) followed by the full backward.
"""
from __future__ import annotations

STAT = 4  # bytes per row of an fp32 statistic (mean, rstd)
MODES = ("fwd", "bwd_full", "bwd_frozen", "fwd_bwd")
OPS = ("rms_norm", "layer_norm", "fused_add_rms_norm")


def rms_norm_fwd(M, N, s, ws, *, stats=False):
    """Read x, weight; write y (and rstd when training)."""
    t = {"read x": M * N * s, "read weight": N * ws, "write y": M * N * s}
    if stats:
        t["write rstd"] = STAT * M
    return t


def rms_norm_bwd(M, N, s, ws, *, frozen):
    """Read x, dy, weight, rstd; write dx (and dweight unless frozen)."""
    t = {"read x": M * N * s, "read dy": M * N * s, "read weight": N * ws, "read rstd": STAT * M,
         "write dx": M * N * s}
    if not frozen:
        t["write dweight"] = N * ws
    return t


def layer_norm_fwd(M, N, s, ws, *, stats=False):
    """Read x, weight, bias; write y (and mean, rstd when training)."""
    t = {"read x": M * N * s, "read weight": N * ws, "read bias": N * ws, "write y": M * N * s}
    if stats:
        t["write mean"] = STAT * M
        t["write rstd"] = STAT * M
    return t


def layer_norm_bwd(M, N, s, ws, *, frozen):
    """Read x, dy, weight, mean, rstd; write dx (and dweight, dbias unless frozen). The bias is not read."""
    t = {"read x": M * N * s, "read dy": M * N * s, "read weight": N * ws, "read mean": STAT * M,
         "read rstd": STAT * M, "write dx": M * N * s}
    if not frozen:
        t["write dweight"] = N * ws
        t["write dbias"] = N * ws
    return t


def fused_add_rms_norm_fwd(M, N, s, ws, *, stats=False):
    """Read x, residual, weight; write y and residual_out (and rstd when training)."""
    t = {"read x": M * N * s, "read residual": M * N * s, "read weight": N * ws, "write y": M * N * s,
         "write residual_out": M * N * s}
    if stats:
        t["write rstd"] = STAT * M
    return t


def fused_add_rms_norm_bwd(M, N, s, ws, *, frozen):
    """Read residual_out (the saved sum), dy, d(residual_out), weight, rstd; write dx (= d residual, one
    tensor) and dweight unless frozen."""
    t = {"read residual_out": M * N * s, "read dy": M * N * s, "read d_residual_out": M * N * s,
         "read weight": N * ws, "read rstd": STAT * M, "write dx (= d_residual)": M * N * s}
    if not frozen:
        t["write dweight"] = N * ws
    return t


_FWD = {"rms_norm": rms_norm_fwd, "layer_norm": layer_norm_fwd, "fused_add_rms_norm": fused_add_rms_norm_fwd}
_BWD = {"rms_norm": rms_norm_bwd, "layer_norm": layer_norm_bwd, "fused_add_rms_norm": fused_add_rms_norm_bwd}


def terms(op: str, mode: str, M: int, N: int, itemsize: int, w_itemsize: int | None = None) -> dict[str, int]:
    """Named byte terms of one (op, mode); their sum is the modelled traffic."""
    ws = itemsize if w_itemsize is None else w_itemsize
    if mode == "fwd":
        return _FWD[op](M, N, itemsize, ws)
    if mode in ("bwd_full", "bwd_frozen"):
        return _BWD[op](M, N, itemsize, ws, frozen=mode == "bwd_frozen")
    if mode == "fwd_bwd":
        fwd = {f"fwd: {k}": v for k, v in _FWD[op](M, N, itemsize, ws, stats=True).items()}
        bwd = {f"bwd: {k}": v for k, v in _BWD[op](M, N, itemsize, ws, frozen=False).items()}
        return {**fwd, **bwd}
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def bytes_moved(op: str, mode: str, M: int, N: int, itemsize: int, w_itemsize: int | None = None) -> int:
    """The modelled bytes of one call of ``op`` in ``mode``."""
    return sum(terms(op, mode, M, N, itemsize, w_itemsize).values())
