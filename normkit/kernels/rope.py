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
INTERLEAVED; sigma_j is -1 on the first column of a pair and +1 on the second. Every row is read
once, as contiguous blocks the compiler vectorizes, and split into the pairs' first and second
members, two ``[BLOCK_M, BLOCK_D / 2]`` tiles: rotate_half loads the halves ``[0, D/2)`` and
``[D/2, D)`` as two tiles; INTERLEAVED loads the whole row and splits each pair in registers
(``tl.reshape`` then ``tl.split``; ``tl.join`` to store). Each half's result is computed from both,
with the products and rounding points of ``normkit.norm_math``'s formulas (out_1 = y_1 cos_1 -
y_2 sin_1, out_2 = y_2 cos_2 + y_1 sin_2). Row reductions sum over both tiles.

Alignment. Pointers are 16-byte aligned under every launcher, but a row start computed from run-time
strides tells the compiler nothing (jax-triton marks no integer divisible by 16). With
STRIDES_ALIGNED (``normkit.launch``: every row stride, and D/2 for rotate_half, a multiple of 16
bytes of its array's dtype) each row start is marked ``tl.multiple_of`` 16 bytes' worth of elements,
so the row accesses are 128 bits wide under either launcher.

Parameter order is fixed for jax-triton 0.3.1, which binds by position: array inputs, then runtime
scalars, then outputs, then constexprs. Launch configuration lives in ``normkit.launch``
(``plan_rope_forward``, ``plan_rope_backward``).
"""
import triton
import triton.language as tl

from normkit.kernels.norm import _effective_weight, _scale_shift, _store_recovery, _unsafe_weight


@triton.jit
def _row_indices(rows64, n1, n2):
    """The three row indices ``(i0, i1, i2)`` of flat rows ``r = (i0 * n1 + i1) * n2 + i2``."""
    i2 = rows64 % n2
    t = rows64 // n2
    return t // n1, t % n1, i2


@triton.jit
def _row_starts(i0, i1, i2, s0, s1, s2, P, ALIGNED: tl.constexpr):
    """Element offset of each row's first column in array P, from its three row strides; ALIGNED: a
    multiple of 16 bytes' worth of P's elements (every stride is, ``normkit.launch``)."""
    start = i0 * s0 + i1 * s1 + i2 * s2
    if ALIGNED:
        start = tl.multiple_of(start, 128 // P.dtype.element_ty.primitive_bitwidth)
    return start


@triton.jit
def _load_rows(P, start, row_mask, D: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Rows of P at ``start`` as the pairs' (first, second) members in fp32, ``[BLOCK_M, BLOCK_D // 2]``
    each (0 past D/2): rotate_half's two halves, or INTERLEAVED's even and odd columns."""
    if INTERLEAVED:
        cols = tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols < D)[None, :]
        v = tl.load(P + start[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        first, second = tl.split(tl.reshape(v, (BLOCK_M, BLOCK_D // 2, 2)))
    else:
        h = tl.arange(0, BLOCK_D // 2)
        mask = row_mask[:, None] & (h < D // 2)[None, :]
        first = tl.load(P + start[:, None] + h[None, :], mask=mask, other=0.0).to(tl.float32)
        second = tl.load(P + (start[:, None] + D // 2) + h[None, :], mask=mask, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _store_rows(P, start, first, second, row_mask, D: tl.constexpr, INTERLEAVED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """``_load_rows``' inverse: the pairs' members stored, rounded to P's dtype, as contiguous rows."""
    first = first.to(P.dtype.element_ty)
    second = second.to(P.dtype.element_ty)
    if INTERLEAVED:
        cols = tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols < D)[None, :]
        tl.store(P + start[:, None] + cols[None, :], tl.reshape(tl.join(first, second), (BLOCK_M, BLOCK_D)),
                 mask=mask)
    else:
        h = tl.arange(0, BLOCK_D // 2)
        mask = row_mask[:, None] & (h < D // 2)[None, :]
        tl.store(P + start[:, None] + h[None, :], first, mask=mask)
        tl.store(P + (start[:, None] + D // 2) + h[None, :], second, mask=mask)


@triton.jit
def _load_columns(P, STRIDE: tl.constexpr, D: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """A vector of D columns (element stride STRIDE) as the pairs' (first, second) members in fp32,
    loaded as ``[BLOCK_M, BLOCK_D // 2]`` tiles of identical rows: laid out as the row tiles, 128 bits
    wide. (A lone vector of D columns has fewer elements than the program has threads: the compiler
    spreads it one element per thread, scalar loads, and re-loads it so in any layout a use asks for.)"""
    same = tl.zeros((BLOCK_M, 1), dtype=tl.int32)  # every row of the tile at the vector
    if INTERLEAVED:
        cols = tl.arange(0, BLOCK_D)[None, :]
        v = tl.load(P + same + cols * STRIDE, mask=(same == 0) & (cols < D), other=0.0).to(tl.float32)
        first, second = tl.split(tl.reshape(v, (BLOCK_M, BLOCK_D // 2, 2)))
    else:
        h = tl.arange(0, BLOCK_D // 2)[None, :]
        mask = (same == 0) & (h < D // 2)
        first = tl.load(P + same + h * STRIDE, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(P + same + (h + D // 2) * STRIDE, mask=mask, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _store_columns(P, first, second, D: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr):
    """A contiguous vector of D columns from the pairs' (first, second) members, ``[BLOCK_D // 2]`` each."""
    first = first.to(P.dtype.element_ty)
    second = second.to(P.dtype.element_ty)
    if INTERLEAVED:
        cols = tl.arange(0, BLOCK_D)
        tl.store(P + cols, tl.reshape(tl.join(first, second), (BLOCK_D,)), mask=cols < D)
    else:
        h = tl.arange(0, BLOCK_D // 2)
        tl.store(P + h, first, mask=h < D // 2)
        tl.store(P + D // 2 + h, second, mask=h < D // 2)


@triton.jit
def _max_all(t):
    return tl.max(tl.max(t, axis=1), axis=0)


@triton.jit
def _row_any(t):
    """Per row of a ``[BLOCK_M, n]`` boolean tile, whether any of it is set."""
    return tl.max(t.to(tl.int32), axis=1) > 0


@triton.jit
def _store_pair_recovery(REC, TRIP, w1, w2, D: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_TRIP: tl.constexpr,
                         W_MIN: tl.constexpr, BOUND_SCALE: tl.constexpr, Y_MAX: tl.constexpr,
                         PAIR_RATIO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """norm's ``_store_recovery`` (no bias) from the weight tiles ``_load_columns`` gave, w_y in fp32,
    plus the pair ratio: REC[j] = 1 / w_y[j] (1 where column j is unsafe) from the tiles' first row;
    REC[D] = 0, or NaN where a column is unsafe, y could overflow x's dtype, or some pair's
    |w_y[p] / w_y[j]| exceeds PAIR_RATIO (its recovery would carry the partner's rounding error times
    that ratio: norm_math.rope_recovery_array); then TRIP is set too (HAS_TRIP)."""
    # the tiles' first row alone: a mask that differs by row keeps the reductions on the tiles' layout
    # (over a broadcast the compiler would reduce a [1, D / 2] vector, spread one column per thread)
    lead = tl.arange(0, BLOCK_M) == 0
    mask = lead[:, None] & (tl.arange(0, BLOCK_D // 2) < D // 2)[None, :]
    a1 = tl.abs(w1)
    a2 = tl.abs(w2)
    unsafe1 = mask & _unsafe_weight(w1, W_MIN)
    unsafe2 = mask & _unsafe_weight(w2, W_MIN)
    wmax = tl.maximum(_max_all(tl.where(mask, a1, 0.0)), _max_all(tl.where(mask, a2, 0.0)))
    r1 = tl.where(mask, a2 / a1, 0.0)
    r2 = tl.where(mask, a1 / a2, 0.0)
    bad = tl.maximum(_max_all((unsafe1 | unsafe2).to(tl.int32)),
                     _max_all(((r1 > PAIR_RATIO) | (r1 != r1) | (r2 > PAIR_RATIO) | (r2 != r2)).to(tl.int32)))
    bound = BOUND_SCALE * wmax
    poisoned = (bad > 0) | (bound > Y_MAX) | (bound != bound)
    _store_rows(REC, tl.zeros((BLOCK_M,), dtype=tl.int64), 1.0 / tl.where(unsafe1, 1.0, w1),
                1.0 / tl.where(unsafe2, 1.0, w2), lead, D, INTERLEAVED, BLOCK_M, BLOCK_D)
    tl.store(REC + D, tl.where(poisoned, float("nan"), 0.0))
    if HAS_TRIP:
        tl.store(TRIP, 1, mask=poisoned)


@triton.jit
def _unusable_pairs(det, c1, c2, s1, s2, mask, TABLE_RATIO: tl.constexpr):
    """Where (inside ``mask``) a pair of table columns is not a usable rotation
    (``norm_math.rope_table_usable``): ``2 |det| < TABLE_RATIO * (c1^2 + s1^2 + c2^2 + s2^2)``, or det 0,
    infinite or NaN. det = c1 c2 + s1 s2, as the output-saving backward divides by it."""
    a = tl.abs(det)
    ok = (2.0 * a >= TABLE_RATIO * (c1 * c1 + s1 * s1 + c2 * c2 + s2 * s2)) & (a > 0.0) & (a < float("inf"))
    return mask & ~ok


@triton.jit
def _round_table(t, X, CASTING: tl.constexpr):
    """cos or sin in fp32, rounded to x.dtype first under CASTING 0 (HF's ``cos.to(x.dtype)``)."""
    if CASTING == 0:
        t = t.to(X.dtype.element_ty).to(tl.float32)
    return t


@triton.jit
def _load_tables(COS, SIN, c_start, s_start, row_mask, X, D: tl.constexpr, CASTING: tl.constexpr,
                 INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(cos_1, cos_2, sin_1, sin_2)``: the tables at the pairs' first and second members."""
    c1, c2 = _load_rows(COS, c_start, row_mask, D, INTERLEAVED, BLOCK_M, BLOCK_D)
    s1, s2 = _load_rows(SIN, s_start, row_mask, D, INTERLEAVED, BLOCK_M, BLOCK_D)
    return (_round_table(c1, X, CASTING), _round_table(c2, X, CASTING), _round_table(s1, X, CASTING),
            _round_table(s2, X, CASTING))


@triton.jit(do_not_specialize=["M", "n1", "n2"])
def rms_norm_rope_fwd_kernel(
    X,  # input rows (..., D), row strides sx0, sx1, sx2, column stride 1
    W,  # weight [D] (HAS_W), any float dtype, element stride W_STRIDE
    COS,  # cos table, broadcast against x: row strides sc0, sc1, sc2 (0 where broadcast), column stride 1
    SIN,  # sin table: row strides ss0, ss1, ss2
    TRIP,  # int32 [2] (HAS_TRIP): flags the host reads: TRIP[0] = 1 where REC's poison is NaN (the weight),
    # TRIP[1] = 1 where a pair of table columns is not a usable rotation (the backward's NaN rows)
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
    HAS_TRIP: tl.constexpr,  # TRIP is present (STORE_REC)
    W_MIN: tl.constexpr,  # STORE_REC: a column whose |w_y| is below this (x.dtype's bound) is unsafe
    BOUND_SCALE: tl.constexpr,  # STORE_REC: sqrt(D) (1 + 4u), the largest |x_hat|
    Y_MAX: tl.constexpr,  # STORE_REC: x.dtype's largest finite value
    PAIR_RATIO: tl.constexpr,  # STORE_REC: the largest |w_y[p] / w_y[j]| of a pair (norm_math.ROPE_PAIR_RATIO)
    TABLE_RATIO: tl.constexpr,  # HAS_TRIP: the smallest usable 2|det| / (sum of squares) of a pair of table columns
    REC_CHUNK: tl.constexpr,  # STORE_REC: columns per step of the recovery
    W_STRIDE: tl.constexpr,  # the weight's element stride
    STRIDES_ALIGNED: tl.constexpr,  # every row stride (and D/2) a multiple of 16 bytes of its array's dtype
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    # y = rms_norm(x) rounded to x.dtype, as rms_norm stores it; then out = y * cos + sigma * y_p * sin,
    # out_1 = y_1 cos_1 - y_2 sin_1 and out_2 = y_2 cos_2 + y_1 sin_2 over the pairs' (first, second)
    # members (CASTING 0: each product and the sum rounded to x.dtype; else fp32, one rounding at the store).
    eps = tl.cast(eps, tl.float32)  # fp64 when Inductor launches the kernel: see norm_fwd_kernel
    offset = tl.cast(offset, tl.float32)
    if HAS_W:
        w1, w2 = _load_columns(W, W_STRIDE, D, INTERLEAVED, BLOCK_M, BLOCK_D)
        w1 = _effective_weight(w1, offset, X, CASTING)
        w2 = _effective_weight(w2, offset, X, CASTING)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    i0, i1, i2 = _row_indices(rows64, n1, n2)
    x_start = _row_starts(i0, i1, i2, sx0, sx1, sx2, X, STRIDES_ALIGNED)
    x1, x2 = _load_rows(X, x_start, row_mask, D, INTERLEAVED, BLOCK_M, BLOCK_D)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) * (1.0 / D) + eps)
    y1 = _scale_shift(x1, rstd, None, None, X, False, False, CASTING)  # x_hat; the weight tiles are 2-d
    y2 = _scale_shift(x2, rstd, None, None, X, False, False, CASTING)
    if HAS_W:
        y1 = y1 * w1
        y2 = y2 * w2
    y1 = y1.to(X.dtype.element_ty).to(tl.float32)
    y2 = y2.to(X.dtype.element_ty).to(tl.float32)
    c1, c2, s1, s2 = _load_tables(COS, SIN, _row_starts(i0, i1, i2, sc0, sc1, sc2, COS, STRIDES_ALIGNED),
                                  _row_starts(i0, i1, i2, ss0, ss1, ss2, SIN, STRIDES_ALIGNED), row_mask, X, D,
                                  CASTING, INTERLEAVED, BLOCK_M, BLOCK_D)
    a1 = y1 * c1
    b1 = y2 * s1
    a2 = y2 * c2
    b2 = y1 * s2
    if CASTING == 0:
        a1 = a1.to(X.dtype.element_ty).to(tl.float32)
        b1 = b1.to(X.dtype.element_ty).to(tl.float32)
        a2 = a2.to(X.dtype.element_ty).to(tl.float32)
        b2 = b2.to(X.dtype.element_ty).to(tl.float32)
    y_start = _row_starts(i0, i1, i2, sy0, sy1, sy2, Y, STRIDES_ALIGNED)
    _store_rows(Y, y_start, a1 - b1, a2 + b2, row_mask, D, INTERLEAVED, BLOCK_M, BLOCK_D)
    if STORE_STATS:
        tl.store(RSTD + rows64, rstd, mask=row_mask)
    if STORE_REC:
        if HAS_TRIP:  # every program flags its rows' unusable table pairs (the backward's NaN rows)
            pairs = row_mask[:, None] & (tl.arange(0, BLOCK_D // 2) < D // 2)[None, :]
            bad = _unusable_pairs(c1 * c2 + s1 * s2, c1, c2, s1, s2, pairs, TABLE_RATIO)
            tl.store(TRIP + 1, 1, mask=_max_all(bad.to(tl.int32)) > 0)
        if tl.program_id(0) == 0:
            if HAS_W:
                _store_pair_recovery(REC, TRIP, w1, w2, D, INTERLEAVED, HAS_TRIP, W_MIN, BOUND_SCALE, Y_MAX,
                                     PAIR_RATIO, BLOCK_M, BLOCK_D)
            else:  # REC[D] alone
                _store_recovery(W, None, REC, None, offset, X, D, HAS_W, False, False, CASTING, W_STRIDE, 1, W_MIN,
                                0.0, BOUND_SCALE, Y_MAX, REC_CHUNK)


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
    TABLE_RATIO: tl.constexpr,  # FROM_Y: the smallest usable 2|det| / (sum of squares) of a pair of table columns
    W_STRIDE: tl.constexpr,  # the weight's element stride
    STRIDES_ALIGNED: tl.constexpr,  # every row stride (and D/2) a multiple of 16 bytes of its array's dtype
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    # dy = R^T(d_out) = d_out * cos - sigma * d_out_p * sin_p (dy_1 = d_1 cos_1 + d_2 sin_2,
    # dy_2 = d_2 cos_2 - d_1 sin_1), then RMSNorm's backward:
    # g = dy * w_eff, c1 = mean(g * x_hat), dx = (g - x_hat * c1) * rstd, dW += dy * x_hat.
    # FROM_Y (frozen weight, the output kept instead of x): y = (cos_p * out - sigma * sin * out_p) / det,
    # det = cos * cos_p + sin * sin_p, and x_hat = y / w_y (REC), so c1 = mean(dy * y); a row with a pair
    # of table columns that is not a usable rotation (_unusable_pairs) gets NaN dx. Tiles are dealt
    # round-robin to the programs; with dW each program owns one partial row, so the reduction order is
    # fixed and the result bitwise reproducible (no atomics).
    tl.static_assert(not (FROM_Y and COMPUTE_DW))
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    offset = tl.cast(offset, tl.float32)
    h_mask = tl.arange(0, BLOCK_D // 2) < D // 2
    if HAS_W:
        w1, w2 = _load_columns(W, W_STRIDE, D, INTERLEAVED, BLOCK_M, BLOCK_D)
        w1 += offset
        w2 += offset
    if FROM_Y:
        poison = tl.load(REC + D)
        inv_w1, inv_w2 = _load_columns(REC, 1, D, INTERLEAVED, BLOCK_M, BLOCK_D)
    if COMPUTE_DW:
        dw_acc1 = tl.zeros((BLOCK_M, BLOCK_D // 2), dtype=tl.float32)
        dw_acc2 = tl.zeros((BLOCK_M, BLOCK_D // 2), dtype=tl.float32)
    num_tiles = (M + BLOCK_M - 1) // BLOCK_M
    for tile in tl.range(pid, num_tiles, num_progs):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        i0, i1, i2 = _row_indices(rows64, n1, n2)
        c1, c2, s1, s2 = _load_tables(COS, SIN, _row_starts(i0, i1, i2, sc0, sc1, sc2, COS, STRIDES_ALIGNED),
                                      _row_starts(i0, i1, i2, ss0, ss1, ss2, SIN, STRIDES_ALIGNED), row_mask, X,
                                      D, CASTING, INTERLEAVED, BLOCK_M, BLOCK_D)
        d1, d2 = _load_rows(DY, _row_starts(i0, i1, i2, sdy0, sdy1, sdy2, DY, STRIDES_ALIGNED), row_mask, D,
                            INTERLEAVED, BLOCK_M, BLOCK_D)
        dy1 = d1 * c1 + d2 * s2
        dy2 = d2 * c2 - d1 * s1
        x1, x2 = _load_rows(X, _row_starts(i0, i1, i2, sx0, sx1, sx2, X, STRIDES_ALIGNED), row_mask, D,
                            INTERLEAVED, BLOCK_M, BLOCK_D)
        rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)
        if FROM_Y:
            det = c1 * c2 + s1 * s2
            mask = row_mask[:, None] & h_mask[None, :]
            xn1 = tl.where(mask, (c2 * x1 + s1 * x2) / det, 0.0)  # masked lanes divide 0 by 0
            xn2 = tl.where(mask, (c1 * x2 - s2 * x1) / det, 0.0)
            bad = _unusable_pairs(det, c1, c2, s1, s2, mask, TABLE_RATIO)  # not the masked lanes' 0 / 0
            row_poison = poison + tl.where(_row_any(bad), float("nan"), 0.0)
            if HAS_W:
                xn1 = xn1 * inv_w1
                xn2 = xn2 * inv_w2
        else:
            xn1 = x1 * rstd[:, None]
            xn2 = x2 * rstd[:, None]
        if COMPUTE_DX:
            if HAS_W:
                g1 = dy1 * w1
                g2 = dy2 * w2
            else:
                g1 = dy1
                g2 = dy2
            m = (tl.sum(g1 * xn1, axis=1) + tl.sum(g2 * xn2, axis=1)) * (1.0 / D)
            dx1 = (g1 - xn1 * m[:, None]) * rstd[:, None]
            dx2 = (g2 - xn2 * m[:, None]) * rstd[:, None]
            if FROM_Y:
                dx1 += row_poison[:, None]
                dx2 += row_poison[:, None]
            _store_rows(DX, _row_starts(i0, i1, i2, sdx0, sdx1, sdx2, DX, STRIDES_ALIGNED), dx1, dx2, row_mask, D,
                        INTERLEAVED, BLOCK_M, BLOCK_D)
        if COMPUTE_DW:
            if CASTING == 1:
                xn1 = xn1.to(X.dtype.element_ty).to(tl.float32)
                xn2 = xn2.to(X.dtype.element_ty).to(tl.float32)
            dw_acc1 += dy1 * xn1
            dw_acc2 += dy2 * xn2
    if COMPUTE_DW:
        _store_columns(DW_PART + pid.to(tl.int64) * D, tl.sum(dw_acc1, axis=0), tl.sum(dw_acc2, axis=0), D,
                       INTERLEAVED, BLOCK_D)
