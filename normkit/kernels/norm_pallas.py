"""Pallas kernel bodies for the row-wise norms: the math of ``normkit.kernels.norm``, over Refs.

One forward and one backward body serve the three ops, plus the fixed-order column sum of the
backward's fp32 partials. Flags are static Python arguments (bind them with ``functools.partial``),
so a flag that is off traces no load, no store and no arithmetic, as a Triton constexpr does. An
absent input or output is passed as ``None``; the flags say which ones are present.

Rounding follows ``norm.py`` point for point: CASTING 0 (``Casting.INPUT_DTYPE``) rounds rstd, the
weight and x_hat to x.dtype; 1 (``ROUND_NORMALIZED``) rounds x_hat; 2 (``FP32``) rounds only the
output. The fused add rounds ``x + residual`` to x.dtype and normalizes the rounded sum.

Row tiles are ``[BLOCK_M, BLOCK_N]`` with BLOCK_N the power of two >= N, dealt round-robin to the
programs (``TILES_PER_PROGRAM`` each; 1 is one row block per program). Every load is masked
(``other=0``) and every store is masked, so rows past M and columns past N are never read or
written. A program that walks several tiles issues the next tile's loads before reducing the
current one (a software prefetch: the Pallas-Triton lowering does not pipeline these loops).

The masked ``load``/``store`` are Pallas-Triton primitives; they also run in interpret mode (any
platform). LayerNorm's backward computes ``dx = (g - c2 - x_hat * c1) * rstd`` as ``norm.py`` does;
unlike the Triton launch (``fp_fusion=False``), Pallas cannot turn off FMA contraction, so on GPU
``g = dy * w`` may be fused into the subtraction. The pallas_call glue (grid, BlockSpecs, compiler
params) and the launch heuristic are in ``jax_frontend/_pallas.py``.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_frontend._compat import pallas_triton

pltriton = pallas_triton()  # Pallas's Triton backend (deprecated in jax 0.11): its masked load and store
F32 = jnp.float32


def _round(v, dtype):
    """v (fp32) rounded to ``dtype`` and back: the value it takes once stored in that dtype."""
    return v.astype(dtype).astype(F32)


def _masks(row0, M, N, BLOCK_M, BLOCK_N):
    """(row_mask [BLOCK_M], col_mask [BLOCK_N], mask [BLOCK_M, BLOCK_N]) of the block at row0."""
    row_mask = row0 + lax.broadcasted_iota(jnp.int32, (BLOCK_M,), 0) < M
    col_mask = lax.broadcasted_iota(jnp.int32, (BLOCK_N,), 0) < N
    return row_mask, col_mask, row_mask[:, None] & col_mask[None, :]


def _tile_rows(pid, t, num_programs, M, N, BLOCK_M, BLOCK_N):
    """This program's tile t (tiles are dealt round-robin): (row slice, row mask, tile mask)."""
    row0 = _i32((pid + t * num_programs) * BLOCK_M)
    row_mask, _, mask = _masks(row0, M, N, BLOCK_M, BLOCK_N)
    return pl.ds(row0, BLOCK_M), row_mask, mask


def _i32(v):
    """A slice start as int32 (program ids are int32; a bare Python int would be int64 under x64)."""
    return jnp.asarray(v, jnp.int32)


def _load(ref, mask):
    return pltriton.load(ref, mask=mask, other=0.0)


def _effective_weight(w, offset: float, dt, CASTING: int):
    """weight + offset in fp32 as the forward multiplies by it (rounded to x.dtype under CASTING 0)."""
    w = w.astype(F32) + offset
    return _round(w, dt) if CASTING == 0 else w


def _normalize(xc, rstd, dt, CASTING: int):
    """x_hat = xc * rstd with CASTING's rounding points: rstd and the product rounded to x.dtype under
    0 (each product in x.dtype), the product under 1, nothing under 2."""
    if CASTING == 0:
        return _round(xc * _round(rstd, dt)[:, None], dt)
    if CASTING == 1:
        return _round(xc * rstd[:, None], dt)
    return xc * rstd[:, None]


def _walk_tiles(TILES_PER_PROGRAM: int, load_tile, compute_tile, acc):
    """``acc = compute_tile(t, load_tile(t), acc)`` over this program's tiles t = 0, 1, ...; the final acc.
    One tile: straight through. Several (a persistent program): a loop with a software prefetch, tile
    t + 1's loads issued before tile t is reduced, so that one program keeps two tiles in flight (the
    Pallas-Triton lowering does not pipeline the loop); the last prefetch, past the tiles, is masked."""
    if TILES_PER_PROGRAM == 1:
        return compute_tile(0, load_tile(0), acc)

    def step(t, carry):
        acc, tile = carry
        nxt = load_tile(t + 1)
        return compute_tile(t, tile, acc), nxt

    acc, _ = lax.fori_loop(0, TILES_PER_PROGRAM, step, (acc, load_tile(0)))
    return acc


def norm_fwd_kernel(
    x_ref,  # [M, N] whole: the input rows (its tiles are indexed here)
    r_ref,  # [M, N] whole: residual rows (HAS_RESIDUAL), else None
    w_ref,  # [BLOCK_N] block of the weight [N] (HAS_W), any float dtype
    b_ref,  # [BLOCK_N] block of the bias [N] (HAS_B)
    y_ref,  # out: [M, N] whole: y, x.dtype
    s_ref,  # out: [M, N] whole: residual_out = x + residual rounded to x.dtype (HAS_RESIDUAL)
    mean_ref,  # out: [M] whole: fp32 per-row mean (STORE_STATS and not IS_RMS)
    rstd_ref,  # out: [M] whole: fp32 per-row 1/std (STORE_STATS)
    *,
    M: int,  # number of rows: rows past it are masked
    N: int,  # row length: columns past it are masked
    eps: float,  # added to the variance (an fp32 constant)
    offset: float,  # added to the weight in fp32 (Gemma: 1.0)
    IS_RMS: bool,  # True: RMSNorm (no mean subtraction); False: LayerNorm
    HAS_RESIDUAL: bool,  # fused add: normalize s = x + residual and store s
    HAS_W: bool,  # elementwise weight present
    HAS_B: bool,  # bias present
    CASTING: int,  # 0 none (x.dtype products), 1 llama (round x_hat), 2 gemma (all fp32)
    STORE_STATS: bool,  # a backward will run: write MEAN/RSTD
    NUM_PROGRAMS: int,  # grid size: tiles are dealt round-robin to the programs
    TILES_PER_PROGRAM: int,  # ceil(tiles / NUM_PROGRAMS): 1 is one row block per program
    BLOCK_M: int,  # rows per tile
    BLOCK_N: int,  # next power of two >= N
):
    dt = x_ref.dtype
    pid = pl.program_id(0)
    _, col_mask, _ = _masks(0, M, N, BLOCK_M, BLOCK_N)
    if HAS_W:
        w = _effective_weight(_load(w_ref, col_mask), offset, dt, CASTING)
    if HAS_B:
        b = _load(b_ref, col_mask).astype(F32)
    cols = pl.ds(_i32(0), BLOCK_N)

    def tile_rows(t):
        return _tile_rows(pid, t, NUM_PROGRAMS, M, N, BLOCK_M, BLOCK_N)

    def load_tile(t):
        rows, _, mask = tile_rows(t)
        tile = {"x": _load(x_ref.at[rows, cols], mask)}
        if HAS_RESIDUAL:
            tile["r"] = _load(r_ref.at[rows, cols], mask)
        return tile

    def compute_tile(t, tile, acc):  # acc None: the forward sums nothing across tiles
        rows, row_mask, mask = tile_rows(t)
        x_raw = tile["x"]
        if HAS_RESIDUAL:
            # the sum is rounded to x.dtype, exactly as torch's `x + residual`, and normalized as stored
            x_raw = (x_raw.astype(F32) + tile["r"].astype(F32)).astype(dt)
            pltriton.store(s_ref.at[rows, cols], x_raw, mask=mask)
        x = x_raw.astype(F32)  # zero outside the mask

        if IS_RMS:
            xc = x
            var = jnp.sum(x * x, axis=1) * (1.0 / N)
        else:
            mean = jnp.sum(x, axis=1) * (1.0 / N)
            xc = jnp.where(mask, x - mean[:, None], 0.0)
            var = jnp.sum(xc * xc, axis=1) * (1.0 / N)
        rstd = 1.0 / jnp.sqrt(var + eps)
        if STORE_STATS:
            pltriton.store(rstd_ref.at[rows], rstd, mask=row_mask)
            if not IS_RMS:
                pltriton.store(mean_ref.at[rows], mean, mask=row_mask)

        y = _normalize(xc, rstd, dt, CASTING)
        if HAS_W:
            y = y * w[None, :]
        if HAS_B:
            y = y + b[None, :]
        pltriton.store(y_ref.at[rows, cols], y.astype(y_ref.dtype), mask=mask)
        return acc

    _walk_tiles(TILES_PER_PROGRAM, load_tile, compute_tile, None)


def norm_bwd_kernel(
    x_ref,  # [M, N] whole: the normalized input as the forward saw it (s = x + residual for the fused add),
    # or, with FROM_Y, the forward's output y
    w_ref,  # [BLOCK_N] block of the weight [N] (HAS_W)
    b_ref,  # [BLOCK_N] block of the bias [N] (HAS_B: read only FROM_Y)
    dy_ref,  # [M, N] whole: gradient of y
    dres_ref,  # [M, N] whole: gradient of residual_out (HAS_DRES)
    mean_ref,  # [M] whole: fp32 per-row mean (not IS_RMS, not FROM_Y)
    rstd_ref,  # [M] whole: fp32 per-row 1/std
    inv_ref,  # [BLOCK_N] block of the forward's 1 / w_y [N] (FROM_Y and HAS_W: the REC buffer's first N values)
    poison_ref,  # [1] whole: REC's last value, 0 or NaN (FROM_Y)
    dx_ref,  # out: [M, N] whole, x.dtype (COMPUTE_DX); for the fused add also residual's gradient
    dw_part_ref,  # out: [BLOCK_N] block of this program's row of the fp32 [NUM_PROGRAMS, N] dW partials (COMPUTE_DW)
    db_part_ref,  # out: [BLOCK_N] block of this program's row of the fp32 dB partials (COMPUTE_DB)
    *,
    M: int,  # number of rows
    N: int,  # row length
    offset: float,  # added to the weight in fp32
    IS_RMS: bool,  # True: RMSNorm; False: LayerNorm
    HAS_W: bool,  # elementwise weight present
    HAS_B: bool,  # bias present (read only FROM_Y)
    HAS_DRES: bool,  # fused add with a gradient flowing into residual_out (read only with COMPUTE_DX)
    CASTING: int,  # 1 llama: dW sees x_hat rounded to x.dtype (the forward rounded it so)
    COMPUTE_DX: bool,  # x (or residual) needs a gradient
    COMPUTE_DW: bool,  # weight needs a gradient: accumulate and write this program's dW partial row
    COMPUTE_DB: bool,  # bias needs a gradient: accumulate and write this program's dB partial row
    FROM_Y: bool,  # x_ref holds y, weight and bias frozen: x_hat = (y - b) * inv, no mean read
    NUM_PROGRAMS: int,  # grid size: tiles are dealt round-robin to the programs
    TILES_PER_PROGRAM: int,  # ceil(tiles / NUM_PROGRAMS): 1 when nothing is reduced
    BLOCK_M: int,  # rows per tile
    BLOCK_N: int,  # next power of two >= N
):
    # Tile t of program p is tile p + t * NUM_PROGRAMS; a tile past the last one is fully masked.
    # With dW/dB each program owns one partial row, so the reduction order is fixed and the result
    # bitwise reproducible (no atomics). FROM_Y as in norm.py: x_hat = (y - b) * (1 / w_y), 1 / w_y and
    # the poison (NaN where the weight breaks the safety rule) as the forward computed them (REC).
    assert not (FROM_Y and (COMPUTE_DW or COMPUTE_DB))
    dt = x_ref.dtype
    pid = pl.program_id(0)
    _, col_mask, _ = _masks(0, M, N, BLOCK_M, BLOCK_N)
    if HAS_W:
        w = _load(w_ref, col_mask).astype(F32) + offset
    poison = 0.0
    if FROM_Y:
        poison = poison_ref[...]
        if HAS_B:
            b = _load(b_ref, col_mask).astype(F32)
        if HAS_W:
            inv_w = _load(inv_ref, col_mask)
    cols = pl.ds(_i32(0), BLOCK_N)

    def tile_rows(t):
        return _tile_rows(pid, t, NUM_PROGRAMS, M, N, BLOCK_M, BLOCK_N)

    def load_tile(t):
        """Tile t's inputs as stored (x.dtype, fp32 stats): what a prefetch keeps in registers."""
        rows, row_mask, mask = tile_rows(t)
        tile = {"x": _load(x_ref.at[rows, cols], mask), "dy": _load(dy_ref.at[rows, cols], mask),
                "rstd": _load(rstd_ref.at[rows], row_mask)}
        if not (IS_RMS or FROM_Y):
            tile["mean"] = _load(mean_ref.at[rows], row_mask)
        return tile

    def compute_tile(t, tile, acc):
        rows, _, mask = tile_rows(t)
        x = tile["x"].astype(F32)
        dy = tile["dy"].astype(F32)
        rstd = tile["rstd"]
        if FROM_Y:
            t = x - b[None, :] if HAS_B else x  # y - b: the normalized row times w_y
            xn = t * inv_w[None, :] if HAS_W else t
        elif IS_RMS:
            xn = x * rstd[:, None]
        else:
            xn = jnp.where(mask, (x - tile["mean"][:, None]) * rstd[:, None], 0.0)
        if COMPUTE_DX:
            g = dy * w[None, :] if HAS_W else dy
            # from y, mean(g x_hat) = mean(dy w (y - b) / w_y) is mean(dy (y - b)), as norm.py sums it
            c1 = jnp.sum(dy * t if FROM_Y else g * xn, axis=1) * (1.0 / N)
            if IS_RMS:
                dx = (g - xn * c1[:, None]) * rstd[:, None]
            else:
                c2 = jnp.sum(g, axis=1) * (1.0 / N)
                dx = (g - c2[:, None] - xn * c1[:, None]) * rstd[:, None]
            if HAS_DRES:
                # read here, after the row sums, not with the prefetched tile: it is needed only for
                # this add, and carrying it across the loop would add a third tile to the registers
                dx = dx + _load(dres_ref.at[rows, cols], mask).astype(F32)
            if FROM_Y:
                dx = dx + poison
            pltriton.store(dx_ref.at[rows, cols], dx.astype(dx_ref.dtype), mask=mask)
        dw_acc, db_acc = acc
        if COMPUTE_DW:
            if CASTING == 1:
                xn = _round(xn, dt)
            dw_acc = dw_acc + dy * xn
        if COMPUTE_DB:
            db_acc = db_acc + dy
        return dw_acc, db_acc

    zeros = jnp.zeros((BLOCK_M, BLOCK_N), F32)
    dw_acc, db_acc = _walk_tiles(TILES_PER_PROGRAM, load_tile, compute_tile,
                                 (zeros if COMPUTE_DW else None, zeros if COMPUTE_DB else None))
    if COMPUTE_DW:
        pltriton.store(dw_part_ref, jnp.sum(dw_acc, axis=0), mask=col_mask)
    if COMPUTE_DB:
        pltriton.store(db_part_ref, jnp.sum(db_acc, axis=0), mask=col_mask)


def partial_sum_kernel(
    dw_part_ref,  # [G, N] whole: fp32 dW partials (HAS_DW)
    db_part_ref,  # [G, N] whole: fp32 dB partials (HAS_DB)
    dw_ref,  # out: [BLOCK_N] block of dW [N], the weight's dtype (HAS_DW)
    db_ref,  # out: [BLOCK_N] block of dB [N], the bias's dtype (HAS_DB)
    *,
    G: int,  # number of partial rows
    N: int,  # row length
    HAS_DW: bool,  # reduce the dW partials
    HAS_DB: bool,  # reduce the dB partials
    BLOCK_G: int,  # partial rows per step
    BLOCK_N: int,  # columns per program
):
    # Fixed-order column sums over the partial rows: deterministic.
    col0 = _i32(pl.program_id(0) * BLOCK_N)
    col_mask = col0 + lax.broadcasted_iota(jnp.int32, (BLOCK_N,), 0) < N
    cols = pl.ds(col0, BLOCK_N)

    def step(k, acc):
        g0 = _i32(k * BLOCK_G)
        g_mask = g0 + lax.broadcasted_iota(jnp.int32, (BLOCK_G,), 0) < G
        mask = g_mask[:, None] & col_mask[None, :]
        rows = pl.ds(g0, BLOCK_G)
        dw_acc, db_acc = acc
        if HAS_DW:
            dw_acc = dw_acc + _load(dw_part_ref.at[rows, cols], mask)
        if HAS_DB:
            db_acc = db_acc + _load(db_part_ref.at[rows, cols], mask)
        return dw_acc, db_acc

    zeros = jnp.zeros((BLOCK_G, BLOCK_N), F32)
    steps = -(-G // BLOCK_G)
    acc = (zeros if HAS_DW else None, zeros if HAS_DB else None)
    acc = step(0, acc) if steps == 1 else lax.fori_loop(0, steps, step, acc)
    dw_acc, db_acc = acc
    if HAS_DW:
        pltriton.store(dw_ref, jnp.sum(dw_acc, axis=0).astype(dw_ref.dtype), mask=col_mask)
    if HAS_DB:
        pltriton.store(db_ref, jnp.sum(db_acc, axis=0).astype(db_ref.dtype), mask=col_mask)
