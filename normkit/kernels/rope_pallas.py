"""Pallas kernel bodies for ``rms_norm_rope``: the math of ``normkit.kernels.rope``, over Refs.

One forward and one backward body; the backward's dW partials are summed by
``normkit.kernels.norm_pallas.partial_sum_kernel``. Flags are static Python arguments (bound with
``functools.partial``); an absent input or output is ``None``, as in ``norm_pallas``.

Rounding follows ``rope.py`` and ``normkit.norm_math`` point for point: y = rms_norm(x, weight) is
rounded to x.dtype (``norm_pallas``'s ``_effective_weight`` and ``_normalize``: CASTING 0 rounds rstd,
the weight and x_hat, 1 rounds x_hat, 2 nothing); then ``out_1 = y_1 cos_1 - y_2 sin_1`` and
``out_2 = y_2 cos_2 + y_1 sin_2`` over the pairs' (first, second) members, with cos/sin and each
product rounded to x.dtype under CASTING 0 (HF's rotation in x's dtype), in fp32 with one rounding
at the store otherwise.

Rows. x (and the output, dy, dx) is ``[M, D]``: a JAX array is contiguous in its logical shape, so
its rows are the flat rows ``r = (i0 * n1 + i1) * n2 + i2`` of ``normkit.rope.row_layout``'s three
row indices. cos and sin are ``[T, D]``, the rows of the tables as stored (never broadcast or
copied): row r of x reads table row ``i0 * t0 + i1 * t1 + i2 * t2``, the tables' three row strides
counted in rows (0 over a dimension the tables broadcast over), computed in the kernel from r
(``_table_rows``). Every load and store is an integer-array index of its Ref (``ref.at[rows, cols]``),
masked: on GPU a gather by pointer arithmetic, contiguous along the columns; in interpret mode a
gather (indices clamped, then masked) and a scatter (indices past the array dropped).

Pairs. rotate_half reads the halves ``[0, D/2)`` and ``[D/2, D)`` as two ``[BLOCK_M, BLOCK_D / 2]``
tiles; INTERLEAVED reads the whole row and splits it into its even and odd columns in registers
(``jnp.reshape`` to ``[..., BLOCK_D / 2, 2]`` then ``lax.split``, which Pallas's Triton lowering turns
into ``tt.split``; ``lax.concatenate`` of two ``[..., 1]`` values, ``tt.join``, to store), as
``rope.py``'s ``tl.reshape``/``tl.split``/``tl.join``. Row reductions sum over both tiles.

The forward's program 0 writes REC, the weight's recovery for the output-saving backward (``rope.py``'s
``_store_pair_recovery``, ``norm_math.rope_recovery_array``): 1 / w_y per column (1 where unsafe,
and without a weight), then 0, or NaN where a column is unsafe, y could overflow x.dtype, or a pair's
``|w_y[p] / w_y[j]|`` exceeds PAIR_RATIO. The pallas_call glue is ``jax_frontend/_pallas.py``'s
``rope_forward`` and ``rope_backward``.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from normkit.kernels.norm_pallas import (F32, _effective_weight, _i32, _load, _normalize, _round, _walk_tiles,
                                        pltriton)


def _iota(n: int):
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _split_pairs(v):
    """``[..., 2 K]`` in memory order -> its even and odd columns, ``[..., K]`` each."""
    *lead, n = v.shape
    v = v.reshape(*lead, n // 2, 2)
    first, second = lax.split(v, (1, 1), axis=v.ndim - 1)
    return first.reshape(*lead, n // 2), second.reshape(*lead, n // 2)


def _join_pairs(first, second):
    """``_split_pairs``' inverse."""
    *lead, k = first.shape
    v = lax.concatenate([first.reshape(*lead, k, 1), second.reshape(*lead, k, 1)], len(lead) + 1)
    return v.reshape(*lead, 2 * k)


# Where a load or store goes: ``(index, mask)``, ``index(cols)`` the Ref index of the columns ``cols``
# (an int32 vector) and ``mask(col_mask)`` the mask of the block it reads or writes.


def _at_rows(r, row_mask):
    """Rows r (an int32 [BLOCK_M] vector) of a ``[R, D]`` Ref; those outside ``row_mask`` masked."""
    return (lambda cols: (r[:, None], cols[None, :])), (lambda col_mask: row_mask[:, None] & col_mask[None, :])


def _at_vector():
    """A ``[D]`` Ref as a vector."""
    return (lambda cols: (cols,)), (lambda col_mask: col_mask)


def _at_tile(BLOCK_M: int):
    """A ``[D]`` Ref as ``BLOCK_M`` identical rows, laid out as the row tiles: on GPU read 128 bits wide
    (a lone vector of D columns has fewer elements than the program has threads: the compiler spreads
    it one element per thread, scalar loads), as ``rope.py``'s ``_load_columns``."""
    same = jnp.zeros((BLOCK_M, 1), jnp.int32)
    return (lambda cols: (same + cols[None, :],)), (lambda col_mask: jnp.broadcast_to(col_mask, (BLOCK_M,) +
                                                                                        col_mask.shape))


def _member_columns(D: int, INTERLEAVED: bool, BLOCK_D: int):
    """``(column vectors, their mask)`` a row is read through: the whole row (INTERLEAVED: its pairs
    are split after the load), or rotate_half's two halves, one per member of the pairs."""
    if INTERLEAVED:
        cols = _iota(BLOCK_D)
        return (cols,), cols < D
    h = _iota(BLOCK_D // 2)
    return (h, h + D // 2), h < D // 2


def _load_pairs(ref, at, D: int, INTERLEAVED: bool, BLOCK_D: int):
    """ref at ``at`` (``_at_rows``, ``_at_vector``, ``_at_tile``) as the pairs' (first, second) members in
    fp32, ``[..., BLOCK_D // 2]`` each, 0 past D/2."""
    index, mask = at
    col_sets, col_mask = _member_columns(D, INTERLEAVED, BLOCK_D)
    loaded = [_load(ref.at[index(cols)], mask(col_mask)).astype(F32) for cols in col_sets]
    return _split_pairs(loaded[0]) if INTERLEAVED else tuple(loaded)


def _store_pairs(ref, at, first, second, D: int, INTERLEAVED: bool, BLOCK_D: int):
    """``_load_pairs``' inverse: the pairs' members stored, rounded to ref's dtype, as contiguous rows."""
    index, mask = at
    col_sets, col_mask = _member_columns(D, INTERLEAVED, BLOCK_D)
    first, second = first.astype(ref.dtype), second.astype(ref.dtype)
    values = (_join_pairs(first, second),) if INTERLEAVED else (first, second)
    for cols, value in zip(col_sets, values):
        pltriton.store(ref.at[index(cols)], value, mask=mask(col_mask))


def _table_rows(r, ROWS: tuple, TABLE_ROWS: tuple):
    """The table row of each flat row r of x: ``i0 t0 + i1 t1 + i2 t2`` with ``r = (i0 n1 + i1) n2 + i2``."""
    n1, n2 = _i32(ROWS[0]), _i32(ROWS[1])
    t = lax.div(r, n2)  # r >= 0: truncating division, one instruction (``//`` is floor division)
    i0, i1, i2 = lax.div(t, n1), lax.rem(t, n1), lax.rem(r, n2)
    return i0 * TABLE_ROWS[0] + i1 * TABLE_ROWS[1] + i2 * TABLE_ROWS[2]


def _load_tables(cos_ref, sin_ref, tr, row_mask, dt, CASTING: int, D: int, INTERLEAVED: bool, BLOCK_D: int):
    """``(cos_1, cos_2, sin_1, sin_2)`` of table rows tr in fp32, rounded to x.dtype first under CASTING 0
    (HF's ``cos.to(x.dtype)``)."""
    c1, c2 = _load_pairs(cos_ref, _at_rows(tr, row_mask), D, INTERLEAVED, BLOCK_D)
    s1, s2 = _load_pairs(sin_ref, _at_rows(tr, row_mask), D, INTERLEAVED, BLOCK_D)
    if CASTING == 0:
        return _round(c1, dt), _round(c2, dt), _round(s1, dt), _round(s2, dt)
    return c1, c2, s1, s2


def _unsafe_weight(w, W_MIN: float):
    """Where x_hat cannot be recovered from y through w_y: |w_y| under W_MIN, infinite or NaN."""
    a = jnp.abs(w)
    return (a < W_MIN) | (a == jnp.inf) | (w != w)


def _any(v):
    return jnp.max(v.astype(jnp.int32)) > 0


def _any_per_row(v):
    """Per row of a ``[BLOCK_M, n]`` boolean tile, whether any of it is set."""
    return jnp.max(v.astype(jnp.int32), axis=1) > 0


def _unusable_pairs(det, c1, c2, s1, s2, mask, TABLE_RATIO: float):
    """Where (inside ``mask``) a pair of table columns is not a usable rotation (``rope.py``'s
    ``_unusable_pairs``, ``norm_math.rope_table_usable``): ``2 |det| < TABLE_RATIO * (c1^2 + s1^2 + c2^2 +
    s2^2)``, or det 0, infinite or NaN."""
    a = jnp.abs(det)
    ok = (2.0 * a >= TABLE_RATIO * (c1 * c1 + s1 * s1 + c2 * c2 + s2 * s2)) & (a > 0.0) & (a < jnp.inf)
    return mask & ~ok


def _store_recovery(rec_ref, w_ref, offset: float, dt, CASTING: int, D: int, HAS_W: bool, INTERLEAVED: bool,
                    W_MIN: float, BOUND_SCALE: float, Y_MAX: float, PAIR_RATIO: float, BLOCK_D: int):
    """REC from the weight w_y as the forward multiplies by it, read as a vector (one program's work)."""
    if not HAS_W:  # x_hat = y: nothing to recover, nothing unsafe
        ones = jnp.ones((BLOCK_D // 2,), F32)
        _store_pairs(rec_ref, _at_vector(), ones, ones, D, INTERLEAVED, BLOCK_D)
        rec_ref[pl.ds(D, 1)] = jnp.zeros((1,), F32)
        return
    w1, w2 = (_effective_weight(w, offset, dt, CASTING) for w in _load_pairs(w_ref, _at_vector(), D, INTERLEAVED,
                                                                              BLOCK_D))
    h_mask = _iota(BLOCK_D // 2) < D // 2
    a1, a2 = jnp.abs(w1), jnp.abs(w2)
    unsafe1 = h_mask & _unsafe_weight(w1, W_MIN)
    unsafe2 = h_mask & _unsafe_weight(w2, W_MIN)
    wmax = jnp.maximum(jnp.max(jnp.where(h_mask, a1, 0.0)), jnp.max(jnp.where(h_mask, a2, 0.0)))
    r1 = jnp.where(h_mask, a2 / a1, 0.0)  # the pair ratio both ways: inf or NaN where a |w_y| is 0
    r2 = jnp.where(h_mask, a1 / a2, 0.0)
    bad = _any(unsafe1 | unsafe2) | _any((r1 > PAIR_RATIO) | (r1 != r1) | (r2 > PAIR_RATIO) | (r2 != r2))
    bound = BOUND_SCALE * wmax
    poisoned = bad | (bound > Y_MAX) | (bound != bound)
    _store_pairs(rec_ref, _at_vector(), 1.0 / jnp.where(unsafe1, 1.0, w1), 1.0 / jnp.where(unsafe2, 1.0, w2), D,
                 INTERLEAVED, BLOCK_D)
    rec_ref[pl.ds(D, 1)] = jnp.full((1,), jnp.where(poisoned, F32(jnp.nan), F32(0.0)))


def rms_norm_rope_fwd_kernel(
    x_ref,  # [M, D] whole: the input rows
    w_ref,  # [D] whole: the weight (HAS_W), any float dtype
    cos_ref,  # [T, D] whole: the cos table's rows as stored (row r of x reads _table_rows(r))
    sin_ref,  # [T, D] whole: the sin table's rows, laid out as cos's
    y_ref,  # out: [M, D] whole: the output, x.dtype
    rstd_ref,  # out: [M] whole: fp32 per-row 1/rms (STORE_STATS)
    rec_ref,  # out: [D + 1] whole: fp32 REC, 1 / w_y per column, then the poison (STORE_REC)
    *,
    M: int,  # number of rows: rows past it are masked
    D: int,  # head dimension (even): columns past it are masked
    eps: float,  # added to the mean square (an fp32 constant)
    offset: float,  # added to the weight in fp32 (Gemma: 1.0)
    ROWS: tuple,  # (n1, n2): the sizes of the second and third row index
    TABLE_ROWS: tuple,  # (t0, t1, t2): the tables' row strides over the three row indices, in rows
    HAS_W: bool,  # elementwise weight present
    CASTING: int,  # 0 none (x.dtype products), 1 llama (round x_hat), 2 gemma (all fp32)
    INTERLEAVED: bool,  # GPT-J pairs (2i, 2i + 1) instead of rotate_half's (i, i + D/2)
    STORE_STATS: bool,  # a backward will run: write RSTD
    STORE_REC: bool,  # the backward reads the output: program 0 writes the weight's recovery REC
    W_MIN: float,  # STORE_REC: a column whose |w_y| is below this (x.dtype's bound) is unsafe
    BOUND_SCALE: float,  # STORE_REC: sqrt(D) (1 + 4u), the largest |x_hat|
    Y_MAX: float,  # STORE_REC: x.dtype's largest finite value
    PAIR_RATIO: float,  # STORE_REC: the largest |w_y[p] / w_y[j]| of a pair (norm_math.ROPE_PAIR_RATIO)
    BLOCK_M: int,  # rows per program
    BLOCK_D: int,  # next power of two >= D
):
    dt = x_ref.dtype
    pid = pl.program_id(0)
    if HAS_W:
        w1, w2 = (_effective_weight(w, offset, dt, CASTING) for w in _load_pairs(w_ref, _at_tile(BLOCK_M), D,
                                                                                  INTERLEAVED, BLOCK_D))
    r = _i32(pid * BLOCK_M) + _iota(BLOCK_M)
    row_mask = r < M
    x1, x2 = _load_pairs(x_ref, _at_rows(r, row_mask), D, INTERLEAVED, BLOCK_D)
    rstd = 1.0 / jnp.sqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) * (1.0 / D) + eps)
    y1, y2 = _normalize(x1, rstd, dt, CASTING), _normalize(x2, rstd, dt, CASTING)
    if HAS_W:
        y1, y2 = y1 * w1, y2 * w2
    y1, y2 = _round(y1, dt), _round(y2, dt)  # y as rms_norm stores it
    c1, c2, s1, s2 = _load_tables(cos_ref, sin_ref, _table_rows(r, ROWS, TABLE_ROWS), row_mask, dt, CASTING, D,
                                  INTERLEAVED, BLOCK_D)
    a1, b1, a2, b2 = y1 * c1, y2 * s1, y2 * c2, y1 * s2
    if CASTING == 0:  # HF's rotation in x.dtype: each product rounded, then the sum at the store
        a1, b1, a2, b2 = _round(a1, dt), _round(b1, dt), _round(a2, dt), _round(b2, dt)
    _store_pairs(y_ref, _at_rows(r, row_mask), a1 - b1, a2 + b2, D, INTERLEAVED, BLOCK_D)
    if STORE_STATS:
        pltriton.store(rstd_ref.at[r], rstd, mask=row_mask)
    if STORE_REC:
        @pl.when(pid == 0)
        def _():
            _store_recovery(rec_ref, w_ref, offset, dt, CASTING, D, HAS_W, INTERLEAVED, W_MIN, BOUND_SCALE, Y_MAX,
                            PAIR_RATIO, BLOCK_D)


def rms_norm_rope_bwd_kernel(
    x_ref,  # [M, D] whole: the forward's input x, or, with FROM_Y, its output (x.dtype)
    w_ref,  # [D] whole: the weight (HAS_W)
    cos_ref,  # [T, D] whole: the cos table's rows
    sin_ref,  # [T, D] whole: the sin table's rows
    dy_ref,  # [M, D] whole: gradient of the output
    rstd_ref,  # [M] whole: fp32 per-row 1/rms
    rec_ref,  # [D + 1] whole: the forward's REC (FROM_Y)
    dx_ref,  # out: [M, D] whole: gradient of x, x.dtype (COMPUTE_DX)
    dw_part_ref,  # out: [BLOCK_D] block of this program's row of the fp32 [NUM_PROGRAMS, D] dW partials (COMPUTE_DW)
    *,
    M: int,  # number of rows
    D: int,  # head dimension (even)
    offset: float,  # added to the weight in fp32
    ROWS: tuple,  # (n1, n2): the sizes of the second and third row index
    TABLE_ROWS: tuple,  # (t0, t1, t2): the tables' row strides, in rows
    HAS_W: bool,  # elementwise weight present
    CASTING: int,  # 0 none (cos/sin rounded to x.dtype), 1 llama (dW sees x_hat rounded), 2 gemma
    INTERLEAVED: bool,  # GPT-J pairs
    COMPUTE_DX: bool,  # x needs a gradient
    COMPUTE_DW: bool,  # weight needs a gradient: accumulate and write this program's dW partial row
    FROM_Y: bool,  # x_ref holds the output, weight frozen: y = R^-1(out), x_hat = y * REC
    TABLE_RATIO: float,  # FROM_Y: the smallest usable 2|det| / (sum of squares) of a pair of table columns
    NUM_PROGRAMS: int,  # grid size: tiles are dealt round-robin to the programs
    TILES_PER_PROGRAM: int,  # ceil(tiles / NUM_PROGRAMS): 1 when nothing is reduced
    BLOCK_M: int,  # rows per tile
    BLOCK_D: int,  # next power of two >= D
):
    # dy = R^T(d_out) (dy_1 = d_1 cos_1 + d_2 sin_2, dy_2 = d_2 cos_2 - d_1 sin_1), then RMSNorm's
    # backward: g = dy * w_eff, m = mean(g * x_hat), dx = (g - x_hat * m) * rstd, dW += dy * x_hat.
    # FROM_Y: y = (cos_p * out - sigma * sin * out_p) / det, det = cos * cos_p + sin * sin_p, and
    # x_hat = y / w_y (REC), plus REC's poison, and NaN on a row with a pair of table columns that is not a
    # usable rotation (_unusable_pairs). Tile t of program p is tile p + t * NUM_PROGRAMS (past
    # the last one: fully masked), the next one prefetched (norm_pallas's _walk_tiles); with dW each
    # program owns one partial row, so the reduction order is fixed and the result bitwise
    # reproducible (no atomics).
    assert not (FROM_Y and COMPUTE_DW)
    dt = x_ref.dtype
    pid = pl.program_id(0)
    if HAS_W:
        w1, w2 = (w + offset for w in _load_pairs(w_ref, _at_tile(BLOCK_M), D, INTERLEAVED, BLOCK_D))
    if FROM_Y:
        poison = rec_ref[pl.ds(D, 1)]
        inv1, inv2 = _load_pairs(rec_ref, _at_tile(BLOCK_M), D, INTERLEAVED, BLOCK_D)
    h_mask = _iota(BLOCK_D // 2) < D // 2

    def tile_rows(t):
        r = _i32((pid + t * NUM_PROGRAMS) * BLOCK_M) + _iota(BLOCK_M)
        return r, r < M

    def load_tile(t):
        """Tile t's inputs as stored (fp32 pairs, rstd): what a prefetch keeps in registers."""
        r, row_mask = tile_rows(t)
        return {"tables": _load_tables(cos_ref, sin_ref, _table_rows(r, ROWS, TABLE_ROWS), row_mask, dt, CASTING,
                                       D, INTERLEAVED, BLOCK_D),
                "d": _load_pairs(dy_ref, _at_rows(r, row_mask), D, INTERLEAVED, BLOCK_D),
                "x": _load_pairs(x_ref, _at_rows(r, row_mask), D, INTERLEAVED, BLOCK_D),
                "rstd": _load(rstd_ref.at[r], row_mask)}

    def compute_tile(t, tile, acc):
        r, row_mask = tile_rows(t)
        c1, c2, s1, s2 = tile["tables"]
        d1, d2 = tile["d"]
        x1, x2 = tile["x"]
        rstd = tile["rstd"][:, None]
        dy1 = d1 * c1 + d2 * s2
        dy2 = d2 * c2 - d1 * s1
        if FROM_Y:
            det = c1 * c2 + s1 * s2
            mask = row_mask[:, None] & h_mask[None, :]
            xn1 = jnp.where(mask, (c2 * x1 + s1 * x2) / det, 0.0)  # masked lanes divide 0 by 0
            xn2 = jnp.where(mask, (c1 * x2 - s2 * x1) / det, 0.0)
            bad = _unusable_pairs(det, c1, c2, s1, s2, mask, TABLE_RATIO)  # not the masked lanes' 0 / 0
            row_poison = poison + jnp.where(_any_per_row(bad), F32(jnp.nan), F32(0.0))[:, None]
            if HAS_W:
                xn1, xn2 = xn1 * inv1, xn2 * inv2
        else:
            xn1, xn2 = x1 * rstd, x2 * rstd
        if COMPUTE_DX:
            g1, g2 = (dy1 * w1, dy2 * w2) if HAS_W else (dy1, dy2)
            m = ((jnp.sum(g1 * xn1, axis=1) + jnp.sum(g2 * xn2, axis=1)) * (1.0 / D))[:, None]
            dx1, dx2 = (g1 - xn1 * m) * rstd, (g2 - xn2 * m) * rstd
            if FROM_Y:
                dx1, dx2 = dx1 + row_poison, dx2 + row_poison
            _store_pairs(dx_ref, _at_rows(r, row_mask), dx1, dx2, D, INTERLEAVED, BLOCK_D)
        if COMPUTE_DW:
            if CASTING == 1:  # as the forward multiplied by it
                xn1, xn2 = _round(xn1, dt), _round(xn2, dt)
            acc = (acc[0] + dy1 * xn1, acc[1] + dy2 * xn2)
        return acc

    zeros = jnp.zeros((BLOCK_M, BLOCK_D // 2), F32)
    acc = _walk_tiles(TILES_PER_PROGRAM, load_tile, compute_tile, (zeros, zeros) if COMPUTE_DW else None)
    if COMPUTE_DW:
        _store_pairs(dw_part_ref, _at_vector(), jnp.sum(acc[0], axis=0), jnp.sum(acc[1], axis=0), D, INTERLEAVED,
                     BLOCK_D)
