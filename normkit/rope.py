"""RMSNorm followed by rotary position embedding (QK-norm, then RoPE), the host side both frontends share:
the op's entry, its argument checks, and how its rows are addressed.

The op is RMSNorm's row math (``normkit.ops.RMS_NORM``: options, casting modes, the output-saving
safety rule of ``normkit.saving``) followed by a rotation of each pair of columns by the cos/sin
tables (``normkit.norm_math``'s section on ``rms_norm_rope``). It is not in ``normkit.ops.OPS``: its
rows carry tables broadcast against x, which the row-wise ops' machinery (the driver's ``[M, N]``
rows, the harness, the byte model) does not describe.

Rows (``row_layout``). x has shape ``(..., D)``, each array its own strides. The kernels address a row
by three indices, each array with three row strides over them, so that x's leading dimensions are
merged, in x's memory order, into at most three groups: every dimension of one group must be
mergeable (``stride[outer] == size[inner] * stride[inner]``) in every array read or written. A
4-d x always fits: [B, S, H, D] rows, the [B, H, S, D] transposed view of such a buffer, and
cos/sin of [B, S, 1, D], [B, 1, S, D] or [1, 1, S, D] (stride 0 over the dimensions they broadcast
over) are read in place, the tables never expanded. (Two row indices would not do: a [1, 1, S, D]
table with x [B, S, H, D] varies along S only, between B and H.)
"""
from __future__ import annotations

import dataclasses

from normkit import reference
from normkit.checks import check as _check_rows
from normkit.ops import RMS_NORM, X_DTYPES

RMS_NORM_ROPE = dataclasses.replace(RMS_NORM, name="rms_norm_rope", title="RMSNormRoPE",
                                    reference=reference.rms_norm_rope, reference_bwd=reference.rms_norm_rope_bwd)

TABLE_DTYPES = X_DTYPES  # cos and sin: x's dtype (HF casts them to it) or float32


def check(*, x_shape: tuple, x_dtype: str, weight: tuple | None, cos: tuple, sin: tuple, interleaved) -> int:
    """Validate one call's arrays, each ``(shape, dtype name)`` (weight None when absent); return D.
    Raises before any launch, naming the argument."""
    D = _check_rows(RMS_NORM_ROPE, x_shape=tuple(x_shape), x_dtype=x_dtype, weight=weight)
    if not isinstance(interleaved, bool):
        raise TypeError(f"normkit: interleaved must be a bool; got {type(interleaved).__name__}: {interleaved!r}")
    if len(x_shape) < 2:
        raise ValueError(f"normkit: rms_norm_rope needs x of shape (..., rows, D); got {tuple(x_shape)}")
    if D % 2:
        raise ValueError(f"normkit: x has shape {tuple(x_shape)}; rotary embedding pairs the columns of the last "
                         f"dimension, so D={D} must be even")
    for name, (shape, dtype) in (("cos", cos), ("sin", sin)):
        if dtype not in TABLE_DTYPES:
            raise TypeError(f"normkit: {name} has dtype {dtype}; supported dtypes are {', '.join(TABLE_DTYPES)}")
        if dtype not in (x_dtype, "float32"):
            raise TypeError(f"normkit: {name} has dtype {dtype}; expected x's dtype {x_dtype} or float32")
        shape = tuple(shape)
        if len(shape) > len(x_shape) or not shape or shape[-1] != D or any(
                t not in (1, n) for t, n in zip(shape[::-1], tuple(x_shape)[::-1])):
            raise ValueError(
                f"normkit: {name} has shape {shape}, which does not broadcast against x of shape {tuple(x_shape)} "
                f"with last dimension D={D} (as in HF's apply_rotary_pos_emb: e.g. [B, 1, S, D] or [1, 1, S, D] for x "
                "[B, H, S, D], [B, S, 1, D] for x [B, S, H, D])")
    if tuple(cos[0]) != tuple(sin[0]):
        raise ValueError(f"normkit: cos has shape {tuple(cos[0])} but sin has shape {tuple(sin[0])}; they must match")
    if cos[1] != sin[1]:
        raise TypeError(f"normkit: cos has dtype {cos[1]} but sin has dtype {sin[1]}; they must match")
    return D


def broadcast_strides(shape: tuple, strides: tuple, x_shape: tuple) -> tuple:
    """A table's element strides against x's shape: 0 over every dimension it broadcasts over (its
    missing leading ones, and those of size 1 where x's is larger)."""
    pad = len(x_shape) - len(shape)
    out = [0] * pad
    for n, t, s in zip(x_shape[pad:], shape, strides):
        out.append(0 if t == 1 and n != 1 else s)
    return tuple(out)


def contiguous_strides(shape: tuple) -> tuple:
    """Row-major element strides of ``shape``."""
    out, step = [], 1
    for n in reversed(tuple(shape)):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """x's leading dimensions in three groups, outermost first; each group is one row index."""

    shape: tuple  # x's leading (row) dimensions
    groups: tuple  # three tuples of dimension indices (empty: size 1)

    @property
    def rows(self) -> tuple:
        """``(n0, n1, n2)``: the size of each row index."""
        out = []
        for g in self.groups:
            n = 1
            for d in g:
                n *= self.shape[d]
            out.append(n)
        return tuple(out)

    def strides(self, strides: tuple) -> tuple | None:
        """The three row strides of an array with these (leading, row) element strides, or None where
        one of its groups does not merge (the array must then be laid out as another one that does)."""
        out = []
        for g in self.groups:
            for outer, inner in zip(g, g[1:]):
                if strides[outer] != self.shape[inner] * strides[inner]:
                    return None
            out.append(strides[g[-1]] if g else 0)
        return tuple(out)


def row_layout(row_shape: tuple, *row_strides: tuple, in_order: bool = False) -> RowLayout | None:
    """The grouping of x's leading dimensions ``row_shape`` that every array's row strides (the
    first: x's) merge into: dimensions of size 1 dropped, the rest in x's memory order (largest
    stride first; ``in_order``: in their own order, so that the three indices count the rows as x's
    shape flattens them), adjacent ones merged where every array allows; None where more than three
    groups remain."""
    dims = [d for d, n in enumerate(row_shape) if n != 1]
    if not in_order:
        dims.sort(key=lambda d: -abs(row_strides[0][d]))
    groups: list = []
    for d in dims:
        if groups and all(s[groups[-1][-1]] == row_shape[d] * s[d] for s in row_strides):
            groups[-1].append(d)
        else:
            groups.append([d])
    if len(groups) > 3:
        return None
    groups = [[]] * (3 - len(groups)) + groups
    return RowLayout(tuple(row_shape), tuple(tuple(g) for g in groups))
