"""RMSNorm followed by rotary position embedding (QK-norm, then RoPE): one forward and one backward kernel.

The math and its rounding points are ``normkit.norm_math``'s (``rms_norm_rope_forward`` and the two
backwards); the RMSNorm pieces are ``normkit.kernels.norm``'s own helpers, so a row is normalized
exactly as ``rms_norm`` normalizes it.

Rows. x has shape ``(..., D)``; its rows are addressed by three row indices ``(i0, i1, i2)`` of sizes
``(M / (n1 n2), n1, n2)``, row ``r = (i0 * n1 + i1) * n2 + i2``, and every array (x, cos, sin, the
output, dy, dx) has its own three row strides over them (0 where it is broadcast) and column stride
1. The frontends merge x's leading dimensions into these three in memory order
(``normkit.rope.row_layout``), so [B, S, H, D] rows, their [B, H, S, D] transposed view, and cos/sin
of [B, S, 1, D], [B, 1, S, D] or [1, 1, S, D] are all read in place, without a copy or an expanded
table.

Pairs. Column j rotates with its partner p(j): j +- D/2 (``rotate_half``), or j ^ 1 when
INTERLEAVED; sigma_j is -1 on the first column of a pair and +1 on the second. The partner's values
are loaded a second time at the partner columns (the same cache lines), so each program computes
both members of every pair from its own loads.

Parameter order is fixed for jax-triton 0.3.1, which binds by position: array inputs, then runtime
scalars, then outputs, then constexprs. Launch configuration lives in ``normkit.launch``
(``plan_rope_forward``, ``plan_rope_backward``).
"""
import triton
import triton.language as tl

from normkit.kernels.norm import _load_weight, _scale_shift, _store_recovery


@triton.jit
def _row_indices(rows64, n1, n2):
    """The three row indices ``(i0, i1, i2)`` of flat rows ``r = (i0 * n1 + i1) * n2 + i2``."""
    i2 = rows64 % n2
    t = rows64 // n2
    return t // n1, t % n1, i2


@triton.jit
def _row_starts(i0, i1, i2, s0, s1, s2):
    """Element offset of each row's first column, from its three row strides."""
    return i0 * s0 + i1 * s1 + i2 * s2


@triton.jit
def _pairs(cols, D: tl.constexpr, INTERLEAVED: tl.constexpr):
    """``(partner column, sigma)``: sigma -1.0 on the first column of a pair, +1.0 on the second."""
    if INTERLEAVED:
        partner = cols ^ 1
        sign = tl.where((cols % 2) == 0, -1.0, 1.0)
    else:
        first = cols < D // 2
        partner = tl.where(first, cols + D // 2, cols - D // 2)
        sign = tl.where(first, -1.0, 1.0)
    return partner, sign


@triton.jit
def _load_tables(COS, SIN, c_start, s_start, cols, mask, X, CASTING: tl.constexpr):
    """cos and sin at ``cols`` in fp32, rounded to x.dtype first under CASTING 0 (HF's ``cos.to(x.dtype)``)."""
    c = tl.load(COS + c_start[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + s_start[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if CASTING == 0:
        c = c.to(X.dtype.element_ty).to(tl.float32)
        s = s.to(X.dtype.element_ty).to(tl.float32)
    return c, s


@triton.jit(do_not_specialize=["M", "n1", "n2"])
def rms_norm_rope_fwd_kernel(
    X,  # input rows (..., D), row strides sx0, sx1, sx2, column stride 1
    W,  # weight [D] (HAS_W), any float dtype, element stride W_STRIDE
    COS,  # cos table, broadcast against x: row strides sc0, sc1, sc2 (0 where broadcast), column stride 1
    SIN,  # sin table: row strides ss0, ss1, ss2
    eps,  # fp32 scalar added to the mean square
    offset,  # fp32 scalar added to the weight (Gemma: 1.0)
    M,  # number of rows
    n1,  # sizes of the second and third row index (the first is M / (n1 n2))
    n2,
    sx0, sx1, sx2,  # x's row strides, in elements
    sc0, sc1, sc2,  # cos's
    ss0, ss1, ss2,  # sin's
    sy0, sy1, sy2,  # the output's
    Y,  # output, x.dtype, row strides sy0, sy1, sy2, column stride 1
    RSTD,  # per-row 1/rms, fp32 [M] in flat row order (STORE_STATS)
    REC,  # fp32 [D + 1] (STORE_REC): 1 / w_y per column, then the poison (norm's _store_recovery)
    D: tl.constexpr,  # head dimension (even)
    HAS_W: tl.constexpr,  # elementwise weight present
    CASTING: tl.constexpr,  # 0 none (x.dtype products), 1 llama (round x_hat), 2 gemma (all fp32)
    INTERLEAVED: tl.constexpr,  # GPT-J pairs (2i, 2i + 1) instead of rotate_half's (i, i + D/2)
    STORE_STATS: tl.constexpr,  # a backward will run: write RSTD
    STORE_REC: tl.constexpr,  # the backward reads the output: program 0 writes the weight's recovery REC
    W_MIN: tl.constexpr,  # STORE_REC: a column whose |w_y| is below this (x.dtype's bound) is unsafe
    BOUND_SCALE: tl.constexpr,  # STORE_REC: sqrt(D) (1 + 4u), the largest |x_hat|
    Y_MAX: tl.constexpr,  # STORE_REC: x.dtype's largest finite value
    PAIR_RATIO: tl.constexpr,  # STORE_REC: the largest |w_y[p] / w_y[j]| of a pair (norm_math.ROPE_PAIR_RATIO)
    REC_CHUNK: tl.constexpr,  # STORE_REC: columns per step of the recovery
    W_STRIDE: tl.constexpr,  # the weight's element stride
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    # y = rms_norm(x) rounded to x.dtype, as rms_norm stores it; then out = y * cos + sigma * y_p * sin
    # (CASTING 0: each product and the sum rounded to x.dtype; else fp32, one rounding at the store).
    eps = tl.cast(eps, tl.float32)  # fp64 when Inductor launches the kernel: see norm_fwd_kernel
    offset = tl.cast(offset, tl.float32)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    pcols, sign = _pairs(cols, D, INTERLEAVED)
    w = None
    wp = None
    if HAS_W:
        w = _load_weight(W, cols, col_mask, offset, X, W_STRIDE, CASTING)
        wp = _load_weight(W, pcols, col_mask, offset, X, W_STRIDE, CASTING)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    i0, i1, i2 = _row_indices(rows64, n1, n2)
    mask = row_mask[:, None] & col_mask[None, :]
    x_start = _row_starts(i0, i1, i2, sx0, sx1, sx2)
    x = tl.load(X + x_start[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(X + x_start[:, None] + pcols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) * (1.0 / D) + eps)
    y = _scale_shift(x, rstd, w, None, X, HAS_W, False, CASTING).to(X.dtype.element_ty).to(tl.float32)
    yp = _scale_shift(xp, rstd, wp, None, X, HAS_W, False, CASTING).to(X.dtype.element_ty).to(tl.float32)
    c, s = _load_tables(COS, SIN, _row_starts(i0, i1, i2, sc0, sc1, sc2), _row_starts(i0, i1, i2, ss0, ss1, ss2),
                        cols, mask, X, CASTING)
    a = y * c
    b = (sign[None, :] * yp) * s
    if CASTING == 0:
        a = a.to(X.dtype.element_ty).to(tl.float32)
        b = b.to(X.dtype.element_ty).to(tl.float32)
    out = a + b
    y_start = _row_starts(i0, i1, i2, sy0, sy1, sy2)
    tl.store(Y + y_start[:, None] + cols[None, :], out.to(Y.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(RSTD + rows64, rstd, mask=row_mask)
    if STORE_REC:
        if tl.program_id(0) == 0:
            _store_recovery(W, None, REC, None, offset, X, D, HAS_W, False, False, CASTING, W_STRIDE, 1, W_MIN, 0.0,
                            BOUND_SCALE, Y_MAX, REC_CHUNK)
            if HAS_W:
                # the recovery of column j carries its partner's rounding error times |w_y[p] / w_y[j]|:
                # past PAIR_RATIO the poison is NaN too (norm_math.rope_recovery_array)
                ratio = tl.where(col_mask, tl.abs(wp) / tl.abs(w), 0.0)
                bad = (tl.max(ratio, axis=0) > PAIR_RATIO) | (tl.max(tl.where(ratio != ratio, 1, 0), axis=0) > 0)
                tl.debug_barrier()  # after _store_recovery's store of REC[D]
                tl.store(REC + D, float("nan"), mask=bad)


@triton.jit(do_not_specialize=["M", "n1", "n2"])
def rms_norm_rope_bwd_kernel(
    X,  # the forward's input x, or, with FROM_Y, its output (x.dtype); row strides sx0, sx1, sx2
    W,  # weight [D] (HAS_W), element stride W_STRIDE
    COS,  # cos table, row strides sc0, sc1, sc2
    SIN,  # sin table, row strides ss0, ss1, ss2
    DY,  # gradient of the output, row strides sdy0, sdy1, sdy2, column stride 1
    RSTD,  # per-row 1/rms, fp32 [M] in flat row order
    REC,  # FROM_Y: the forward's recovery of the weight, fp32 [D + 1] (1 / w_y, poison)
    offset,  # fp32 scalar added to the weight
    M,  # number of rows
    n1,  # sizes of the second and third row index
    n2,
    sx0, sx1, sx2,  # row strides, in elements, of X, COS, SIN, DY and DX
    sc0, sc1, sc2,
    ss0, ss1, ss2,
    sdy0, sdy1, sdy2,
    sdx0, sdx1, sdx2,
    DX,  # gradient of x (COMPUTE_DX), x.dtype, row strides sdx0, sdx1, sdx2
    DW_PART,  # fp32 [num_programs, D] per-program dW partials (COMPUTE_DW), reduced by partial_sum_kernel
    D: tl.constexpr,  # head dimension (even)
    HAS_W: tl.constexpr,  # elementwise weight present
    CASTING: tl.constexpr,  # 0 none (cos/sin rounded to x.dtype), 1 llama (dW sees x_hat rounded), 2 gemma
    INTERLEAVED: tl.constexpr,  # GPT-J pairs
    COMPUTE_DX: tl.constexpr,  # x needs a gradient
    COMPUTE_DW: tl.constexpr,  # weight needs a gradient: accumulate and write DW_PART
    FROM_Y: tl.constexpr,  # X holds the output, weight frozen: y = R^-1(out), x_hat = y * REC
    W_STRIDE: tl.constexpr,  # the weight's element stride
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    # dy = R^T(d_out) = d_out * cos - sigma * d_out_p * sin_p, then RMSNorm's backward:
    # g = dy * w_eff, c1 = mean(g * x_hat), dx = (g - x_hat * c1) * rstd, dW += dy * x_hat.
    # FROM_Y (frozen weight, the output kept instead of x): y = (cos_p * out - sigma * sin * out_p) / det,
    # det = cos * cos_p + sin * sin_p, and x_hat = y / w_y (REC), so c1 = mean(dy * y). Tiles are dealt
    # round-robin to the programs; with dW each program owns one partial row, so the reduction order is
    # fixed and the result bitwise reproducible (no atomics).
    tl.static_assert(not (FROM_Y and COMPUTE_DW))
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    offset = tl.cast(offset, tl.float32)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    pcols, sign = _pairs(cols, D, INTERLEAVED)
    if HAS_W:
        w = tl.load(W + cols * W_STRIDE, mask=col_mask, other=0.0).to(tl.float32) + offset
    if FROM_Y:
        poison = tl.load(REC + D)
        inv_w = tl.load(REC + cols, mask=col_mask, other=0.0)
    if COMPUTE_DW:
        dw_acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    num_tiles = (M + BLOCK_M - 1) // BLOCK_M
    for tile in tl.range(pid, num_tiles, num_progs):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        i0, i1, i2 = _row_indices(rows64, n1, n2)
        mask = row_mask[:, None] & col_mask[None, :]
        c_start = _row_starts(i0, i1, i2, sc0, sc1, sc2)
        s_start = _row_starts(i0, i1, i2, ss0, ss1, ss2)
        c, s = _load_tables(COS, SIN, c_start, s_start, cols, mask, X, CASTING)
        cp, sp = _load_tables(COS, SIN, c_start, s_start, pcols, mask, X, CASTING)
        dy_start = _row_starts(i0, i1, i2, sdy0, sdy1, sdy2)
        d = tl.load(DY + dy_start[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dp = tl.load(DY + dy_start[:, None] + pcols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = d * c - sign[None, :] * (dp * sp)
        x_start = _row_starts(i0, i1, i2, sx0, sx1, sx2)
        x = tl.load(X + x_start[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)
        if FROM_Y:
            xp = tl.load(X + x_start[:, None] + pcols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = (cp * x - sign[None, :] * (s * xp)) / (c * cp + s * sp)
            xn = tl.where(mask, y, 0.0)  # masked lanes divide 0 by 0
            if HAS_W:
                xn = xn * inv_w[None, :]
        else:
            xn = x * rstd[:, None]
        if COMPUTE_DX:
            if HAS_W:
                g = dy * w[None, :]
            else:
                g = dy
            c1 = tl.sum(g * xn, axis=1) * (1.0 / D)
            dx = (g - xn * c1[:, None]) * rstd[:, None]
            if FROM_Y:
                dx += poison
            dx_start = _row_starts(i0, i1, i2, sdx0, sdx1, sdx2)
            tl.store(DX + dx_start[:, None] + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if CASTING == 1:
                xn = xn.to(X.dtype.element_ty).to(tl.float32)
            dw_acc += dy * xn
    if COMPUTE_DW:
        tl.store(DW_PART + pid.to(tl.int64) * D + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
