"""Batch invariance: a row's results do not depend on the rows it is normalized with.

A row's forward output and its frozen-backward dx (weight and bias frozen, as in LoRA) must be bitwise
the same whether the row is normalized alone, as the last row of a prefix of a batch, inside the
whole batch, or in a slice of it that starts at another row or at an unaligned element. That holds
when the launch plans give a row the same tile (threads and warps per row, hence the reduction
order) whatever the row count (``normkit.launch.tile_config``). Anyone comparing training with
inference numerics, or debugging on a slice of a batch, relies on it.

On a GPU (``scripts/gpu-check.sh tests``) this checks the compiled kernels at the model widths; on a
CPU the interpreted ones at small widths.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_frontend as tf
from normkit.ops import OPS
from tests.frontend_torch import DEVICE

SCALE = float(os.environ.get("NORMKIT_PROPERTY_SCALE", "1"))
ON_GPU = DEVICE.type == "cuda"
WIDTHS = (128, 256, 1000, 1024, 2048, 4096, 8192) if ON_GPU else (8, 96, 128, 200)
MAX_ROWS = 4097 if ON_GPU else 40
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _call(op: str, x, residual, weight, bias):
    spec = OPS[op]
    args = {"x": x, "residual": residual, "weight": weight, "bias": bias}
    out = getattr(tf, op)(*(args[name] for name in spec.inputs))
    return out[0] if spec.has_residual else out


def _results(op: str, x, residual, weight, bias, dy):
    """``(y, dx)`` of the rows ``x``: the forward, then the frozen backward (weight and bias frozen)."""
    x = x.detach().requires_grad_()
    y = _call(op, x, residual, weight, bias)
    dx, = torch.autograd.grad(y, x, dy)
    return y.detach(), dx


@settings(max_examples=max(1, round(40 * SCALE)), deadline=None, derandomize=True, database=None)
@given(op=st.sampled_from(sorted(OPS)), dtype=st.sampled_from(sorted(DTYPES)), D=st.sampled_from(WIDTHS),
       M=st.integers(2, MAX_ROWS), data=st.data())
def _check(op, dtype, D, M, data):
    spec = OPS[op]
    r = data.draw(st.integers(0, M - 1), label="row")
    k = data.draw(st.integers(0, r), label="first row of the slice")
    shift = data.draw(st.integers(1, 7), label="element offset of the unaligned copy")
    g = torch.Generator().manual_seed(M * 7919 + D)
    dt = DTYPES[dtype]

    def rand(*shape):
        return (torch.randn(*shape, generator=g) + 0.1).to(DEVICE, dt)

    x, dy = rand(M, D), rand(M, D)
    residual = rand(M, D) if spec.has_residual else None
    weight = rand(D)
    bias = rand(D) if "bias" in spec.params else None
    res = (lambda a, b: None if residual is None else residual[a:b])  # noqa: E731

    y_all, dx_all = _results(op, x, residual, weight, bias, dy)
    views = {
        "alone": (r, r + 1, 0),
        "prefix": (0, r + 1, r),
        "slice": (k, M, r - k),
    }
    for what, (a, b, i) in views.items():
        y, dx = _results(op, x[a:b], res(a, b), weight, bias, dy[a:b])
        assert torch.equal(y[i], y_all[r]), f"{op} {dtype} D={D} M={M}: y of row {r} differs {what}"
        assert torch.equal(dx[i], dx_all[r]), f"{op} {dtype} D={D} M={M}: dx of row {r} differs {what}"
    # the same rows at an unaligned address: a flat buffer read from element `shift` on
    buf = torch.empty(M * D + shift, device=DEVICE, dtype=dt)
    buf[shift:] = x.reshape(-1)
    x_unaligned = buf[shift:].view(M, D)
    y, dx = _results(op, x_unaligned[k:], res(k, M), weight, bias, dy[k:])
    assert torch.equal(y[r - k], y_all[r]), f"{op} {dtype} D={D} M={M}: y of row {r} differs unaligned"
    assert torch.equal(dx[r - k], dx_all[r]), f"{op} {dtype} D={D} M={M}: dx of row {r} differs unaligned"


def test_a_rows_results_do_not_depend_on_the_batch():
    _check()


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_one_row_alone_and_in_a_batch(op, dtype):
    """The cases seen to differ before tiles depended on N alone (fp32 LayerNorm's forward at D = 128,
    1024 and 4096 for one or two rows; RMSNorm's frozen dx at D = 128 for two rows), for every op."""
    for D in ((128, 1024, 4096) if ON_GPU else (128,)):
        for M in (2, 3, 64):
            _check.hypothesis.inner_test(op=op, dtype=dtype, D=D, M=M, data=_FixedDraws([M - 1, 1, 3]))


class _FixedDraws:
    """``st.data()`` replaced by a list of values, for explicit cases of the property."""

    def __init__(self, values):
        self.values = list(values)

    def draw(self, strategy, label=None):
        return self.values.pop(0)
