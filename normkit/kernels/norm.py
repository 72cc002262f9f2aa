"""Row-wise normalization kernels: RMSNorm, LayerNorm and fused residual-add + RMSNorm.

One forward and one backward kernel serve the three ops; constexpr flags pick the variant at
compile time, so a flag that is off costs no instruction, no load and no store.

Parameter order is fixed for jax-triton 0.3.1, which binds by position: array inputs, then
runtime scalars, then outputs, then constexprs. Launch configuration lives in normkit.launch.
"""
import triton
import triton.language as tl


@triton.jit
def _row_offsets(rows64, cols, N: tl.constexpr, stride_m, COL_STRIDE: tl.constexpr, ROWS_CONTIGUOUS: tl.constexpr):
    """Element offsets of a [rows, cols] block: of a contiguous [M, N] array, or by run-time row strides."""
    if ROWS_CONTIGUOUS:
        return rows64[:, None] * N + cols[None, :]
    return rows64[:, None] * stride_m + cols[None, :] * COL_STRIDE


@triton.jit
def _load_rows(X, R, S, rows64, cols, mask, stride_xm, stride_rm, N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               ROWS_CONTIGUOUS: tl.constexpr, X_COL_STRIDE: tl.constexpr, R_COL_STRIDE: tl.constexpr,
               EVICTION: tl.constexpr):
    """The block of rows to normalize, in x.dtype: x, or s = x + residual (stored to S) for the fused add."""
    x_raw = tl.load(X + _row_offsets(rows64, cols, N, stride_xm, X_COL_STRIDE, ROWS_CONTIGUOUS), mask=mask,
                    other=0.0, eviction_policy=EVICTION)
    if HAS_RESIDUAL:
        r_raw = tl.load(R + _row_offsets(rows64, cols, N, stride_rm, R_COL_STRIDE, ROWS_CONTIGUOUS), mask=mask,
                        other=0.0, eviction_policy=EVICTION)
        # the sum is rounded to x.dtype, exactly as torch's `x + residual`, and normalized as stored
        x_raw = (x_raw.to(tl.float32) + r_raw.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(S + rows64[:, None] * N + cols[None, :], x_raw, mask=mask)
    return x_raw


@triton.jit
def _effective_weight(w, offset, X, CASTING: tl.constexpr):
    """weight + offset in fp32 (rounded to x.dtype first under CASTING 0, as eager low-precision math)."""
    w = w.to(tl.float32) + offset
    if CASTING == 0:
        w = w.to(X.dtype.element_ty).to(tl.float32)
    return w


@triton.jit
def _load_weight(W, cols, col_mask, offset, X, W_STRIDE: tl.constexpr, CASTING: tl.constexpr):
    """``_effective_weight`` of the weight's columns ``cols``."""
    return _effective_weight(tl.load(W + cols * W_STRIDE, mask=col_mask, other=0.0), offset, X, CASTING)


@triton.jit
def _unsafe_weight(w, W_MIN: tl.constexpr):
    """Where x_hat cannot be recovered from y through w_y (normkit.norm_math's rule): |w_y| under W_MIN,
    infinite or NaN."""
    w_abs = tl.abs(w)
    return (w_abs < W_MIN) | (w_abs == float("inf")) | (w != w)


@triton.jit
def _scale_shift(xc, rstd, w, b, X, HAS_W: tl.constexpr, HAS_B: tl.constexpr, CASTING: tl.constexpr):
    """y in fp32 from the centred rows ``xc`` and their rstd, with the rounding points of CASTING."""
    if CASTING == 0:
        # x.dtype throughout: each product is rounded to x.dtype, as eager low-precision math does
        xn = (xc * rstd[:, None].to(X.dtype.element_ty).to(tl.float32)).to(X.dtype.element_ty).to(tl.float32)
    elif CASTING == 1:
        xn = (xc * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    else:
        xn = xc * rstd[:, None]
    y = xn
    if HAS_W:
        y = y * w[None, :]
    if HAS_B:
        y = y + b[None, :]
    return y


@triton.jit
def _store_recovery(W, B, REC, TRIP, offset, X, N: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                    HAS_TRIP: tl.constexpr, CASTING: tl.constexpr, W_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr,
                    W_MIN: tl.constexpr, BIAS_RATIO: tl.constexpr, BOUND_SCALE: tl.constexpr, Y_MAX: tl.constexpr,
                    REC_CHUNK: tl.constexpr):
    """What the output-saving backward needs of the weight (normkit.norm_math.recovery), from the
    weight and bias alone: REC[j] = 1 / w_y[j] (1 where column j is unsafe), REC[N] = 0, or NaN where
    the weight breaks the safety rule (a column unsafe, or y able to overflow x's dtype); then TRIP is
    set too. In chunks of REC_CHUNK columns, so that it needs few registers beside the forward's own."""
    bad = tl.zeros((), dtype=tl.int32)
    wmax = tl.zeros((), dtype=tl.float32)
    bmax = tl.zeros((), dtype=tl.float32)
    for c0 in tl.range(0, N, REC_CHUNK):
        cols = c0 + tl.arange(0, REC_CHUNK)
        cmask = cols < N
        unsafe = cols < 0  # no column yet
        if HAS_W:
            w = _load_weight(W, cols, cmask, offset, X, W_STRIDE, CASTING)  # w_y: what the forward multiplied by
            w_abs = tl.abs(w)
            unsafe = cmask & _unsafe_weight(w, W_MIN)
            wmax = tl.maximum(wmax, tl.max(tl.where(cmask, w_abs, 0.0), axis=0))
        if HAS_B:
            b_abs = tl.abs(tl.load(B + cols * B_STRIDE, mask=cmask, other=0.0).to(tl.float32))
            if HAS_W:
                limit = BIAS_RATIO * w_abs
            else:
                limit = BIAS_RATIO
            unsafe = unsafe | (cmask & ((b_abs > limit) | (b_abs != b_abs)))
            bmax = tl.maximum(bmax, tl.max(tl.where(cmask, b_abs, 0.0), axis=0))
        bad = tl.maximum(bad, tl.max(unsafe.to(tl.int32), axis=0))
        if HAS_W:
            tl.store(REC + cols, 1.0 / tl.where(unsafe, 1.0, w), mask=cmask)
    if HAS_W:
        bound = BOUND_SCALE * wmax + bmax
    else:
        bound = BOUND_SCALE + bmax
    poisoned = (bad > 0) | (bound > Y_MAX) | (bound != bound)
    tl.store(REC + N, tl.where(poisoned, float("nan"), 0.0))
    if HAS_TRIP:
        tl.store(TRIP, 1, mask=poisoned)


@triton.jit
def _store_y(Y, Y2, y, rows64, cols, mask, N: tl.constexpr, HAS_Y2: tl.constexpr):
    """The block of y (fp32) rounded to Y's dtype (x's) and stored to the contiguous [M, N] Y; HAS_Y2:
    that rounded value also stored to Y2, converted to Y2's dtype (an exact widening: Y2 holds the
    very values of ``Y.to(Y2's dtype)``)."""
    y_ptrs = Y + rows64[:, None] * N + cols[None, :]  # the address, then the rounding: without HAS_Y2 the
    # same instructions, in the same order, as a plain store of y.to(Y.dtype.element_ty)
    yv = y.to(Y.dtype.element_ty)
    tl.store(y_ptrs, yv, mask=mask)
    if HAS_Y2:
        tl.store(Y2 + rows64[:, None] * N + cols[None, :], yv.to(Y2.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_tile(tile, X, R, Y, S, MEAN, RSTD, Y2, eps, offset, M, stride_xm, stride_rm, w, b, cols, col_mask, W,
              N: tl.constexpr, IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_W: tl.constexpr,
              HAS_B: tl.constexpr, CASTING: tl.constexpr, STORE_STATS: tl.constexpr, HAS_Y2: tl.constexpr,
              ROWS_CONTIGUOUS: tl.constexpr, X_COL_STRIDE: tl.constexpr, R_COL_STRIDE: tl.constexpr,
              W_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr):
    """The forward of one tile of BLOCK_M rows (``w``/``b``: the preloaded parameters of the one-pass path)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    if CHUNK_N == 0:
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_rows(X, R, S, rows64, cols, mask, stride_xm, stride_rm, N, HAS_RESIDUAL, ROWS_CONTIGUOUS,
                       X_COL_STRIDE, R_COL_STRIDE, "").to(tl.float32)
        if IS_RMS:
            xc = x
            var = tl.sum(x * x, axis=1) * (1.0 / N)
        else:
            mean = tl.sum(x, axis=1) * (1.0 / N)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            var = tl.sum(xc * xc, axis=1) * (1.0 / N)
        rstd = 1.0 / tl.sqrt(var + eps)
        y = _scale_shift(xc, rstd, w, b, X, HAS_W, HAS_B, CASTING)
        _store_y(Y, Y2, y, rows64, cols, mask, N, HAS_Y2)
    else:
        # first pass: the sum of squares, chunk by chunk, each chunk kept in L2 for the second
        acc = tl.zeros((BLOCK_M, CHUNK_N), dtype=tl.float32)
        for c0 in tl.static_range(0, BLOCK_N, CHUNK_N):
            ccols = c0 + tl.arange(0, CHUNK_N)
            cmask = row_mask[:, None] & (ccols < N)[None, :]
            x = _load_rows(X, R, S, rows64, ccols, cmask, stride_xm, stride_rm, N, HAS_RESIDUAL,
                           ROWS_CONTIGUOUS, X_COL_STRIDE, R_COL_STRIDE, "evict_last").to(tl.float32)
            acc += x * x
        var = tl.sum(acc, axis=1) * (1.0 / N)
        rstd = 1.0 / tl.sqrt(var + eps)
        # second pass: read the rows again (s, as stored, for the fused add) and normalize
        if HAS_RESIDUAL:
            tl.debug_barrier()  # s as other threads of the program stored it
        for c0 in tl.static_range(0, BLOCK_N, CHUNK_N):
            ccols = c0 + tl.arange(0, CHUNK_N)
            ccol_mask = ccols < N
            cmask = row_mask[:, None] & ccol_mask[None, :]
            if HAS_RESIDUAL:
                x = tl.load(S + rows64[:, None] * N + ccols[None, :], mask=cmask, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
            else:
                x = tl.load(X + _row_offsets(rows64, ccols, N, stride_xm, X_COL_STRIDE, ROWS_CONTIGUOUS),
                            mask=cmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if HAS_W:
                w = _load_weight(W, ccols, ccol_mask, offset, X, W_STRIDE, CASTING)
            else:
                w = None
            y = _scale_shift(x, rstd, w, None, X, HAS_W, False, CASTING)
            _store_y(Y, Y2, y, rows64, ccols, cmask, N, HAS_Y2)
    if STORE_STATS:
        tl.store(RSTD + rows64, rstd, mask=row_mask)
        if not IS_RMS:
            tl.store(MEAN + rows64, mean, mask=row_mask)


@triton.jit(do_not_specialize=["M"])  # M's value must not change the code: cross-frontend bitwise parity
def norm_fwd_kernel(
    X,  # input rows [M, N], row stride stride_xm, column stride X_COL_STRIDE
    R,  # residual rows [M, N] (HAS_RESIDUAL), row stride stride_rm, column stride R_COL_STRIDE
    W,  # weight [N] (HAS_W), any float dtype, element stride W_STRIDE
    B,  # bias [N] (HAS_B), element stride B_STRIDE
    TRIP,  # int32 [1] (HAS_TRIP): set to 1 when REC's poison is NaN (a flag the host reads)
    eps,  # fp32 scalar added to the variance
    offset,  # fp32 scalar added to the weight (Gemma: 1.0)
    M,  # number of rows
    stride_xm,  # row strides, in elements; ignored when ROWS_CONTIGUOUS
    stride_rm,
    Y,  # output rows [M, N] contiguous, x.dtype
    S,  # residual_out = x + residual, [M, N] contiguous (HAS_RESIDUAL)
    MEAN,  # per-row mean, fp32 [M] (STORE_STATS and not IS_RMS)
    RSTD,  # per-row 1/std, fp32 [M] (STORE_STATS); [rec_offset(M) + N + 1] with REC after the rows (REC_IN_RSTD)
    REC,  # fp32 [N + 1] (STORE_REC, not REC_IN_RSTD): 1 / w_y per column, then the poison (_store_recovery)
    Y2,  # y again [M, N] contiguous (HAS_Y2), in a dtype that holds every x.dtype value exactly: Y's values
    N: tl.constexpr,  # row length; compile-time so masks and vector widths are known
    IS_RMS: tl.constexpr,  # True: RMSNorm (no mean subtraction); False: LayerNorm
    HAS_RESIDUAL: tl.constexpr,  # fused add: normalize s = x + residual and store s
    HAS_W: tl.constexpr,  # elementwise weight present
    HAS_B: tl.constexpr,  # bias present
    CASTING: tl.constexpr,  # 0 none (x.dtype products), 1 llama (round x_hat), 2 gemma (all fp32)
    STORE_STATS: tl.constexpr,  # a backward will run: write MEAN/RSTD
    STORE_REC: tl.constexpr,  # the backward reads y (FROM_Y): program 0 writes the weight's recovery REC
    REC_IN_RSTD: tl.constexpr,  # REC lies in RSTD, after its M rows (one buffer for the statistics and REC)
    HAS_TRIP: tl.constexpr,  # TRIP is present
    HAS_Y2: tl.constexpr,  # also store y, as rounded to x.dtype, widened to Y2's dtype (a consumer's copy)
    W_MIN: tl.constexpr,  # STORE_REC: a column whose |w_y| is below this (x.dtype's bound) is unsafe
    BIAS_RATIO: tl.constexpr,  # STORE_REC: a column whose |b| exceeds this times |w_y| is unsafe
    BOUND_SCALE: tl.constexpr,  # STORE_REC: sqrt(N) (1 + 4u), the largest |x_hat|
    Y_MAX: tl.constexpr,  # STORE_REC: x.dtype's largest finite value, which |y| must stay below
    REC_CHUNK: tl.constexpr,  # STORE_REC: columns per step of the recovery
    ROWS_CONTIGUOUS: tl.constexpr,  # every input is [M, N] contiguous: use the compile-time N
    X_COL_STRIDE: tl.constexpr,  # x's column stride: 1, or 0 for a row broadcast along N
    R_COL_STRIDE: tl.constexpr,  # residual's column stride: 1 or 0
    W_STRIDE: tl.constexpr,  # the weight's element stride (1; 0 if expanded, k if sliced [::k])
    B_STRIDE: tl.constexpr,  # the bias's element stride
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # next power of two >= N
    LOOP_STAGES: tl.constexpr,  # 0: one program per tile, no loop; else the tile loop's pipelining depth
    CHUNK_N: tl.constexpr,  # 0: each row in registers, read once; else RMSNorm (IS_RMS) in two passes
    # over CHUNK_N-column chunks: the sum of squares, then a second read (from L2) to normalize
):
    # LOOP_STAGES 0: the grid has one program per tile of BLOCK_M rows, each runs it straight through
    # (a loop around one tile slows the LayerNorm forward on long 16-bit rows: docs/PERFORMANCE_RECORD.md,
    # "Forward kernels").
    # Otherwise tiles are dealt round-robin to the programs; LOOP_STAGES > 1 prefetches the next
    # tile's rows while this one is reduced.
    # The float scalars are pinned to fp32: Inductor passes a Python float to a user kernel as fp64,
    # which would silently carry the whole row's math into fp64 (values are fp32-exact: launch._f32).
    tl.static_assert(CHUNK_N == 0 or (IS_RMS and BLOCK_N % CHUNK_N == 0 and CHUNK_N < BLOCK_N))
    eps = tl.cast(eps, tl.float32)
    offset = tl.cast(offset, tl.float32)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = None
    b = None
    if CHUNK_N == 0:  # the one-pass tiles hold the parameters in registers, loaded once per program
        if HAS_W:
            w = _load_weight(W, cols, col_mask, offset, X, W_STRIDE, CASTING)
        if HAS_B:
            b = tl.load(B + cols * B_STRIDE, mask=col_mask, other=0.0).to(tl.float32)
    if LOOP_STAGES == 0:  # one program per tile: straight-line code, no loop around it
        _fwd_tile(tl.program_id(0), X, R, Y, S, MEAN, RSTD, Y2, eps, offset, M, stride_xm, stride_rm, w, b, cols,
                  col_mask, W, N, IS_RMS, HAS_RESIDUAL, HAS_W, HAS_B, CASTING, STORE_STATS, HAS_Y2, ROWS_CONTIGUOUS,
                  X_COL_STRIDE, R_COL_STRIDE, W_STRIDE, BLOCK_M, BLOCK_N, CHUNK_N)
    else:
        num_tiles = (M + BLOCK_M - 1) // BLOCK_M
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), num_stages=LOOP_STAGES):
            _fwd_tile(tile, X, R, Y, S, MEAN, RSTD, Y2, eps, offset, M, stride_xm, stride_rm, w, b, cols,
                      col_mask, W, N, IS_RMS, HAS_RESIDUAL, HAS_W, HAS_B, CASTING, STORE_STATS, HAS_Y2,
                      ROWS_CONTIGUOUS, X_COL_STRIDE, R_COL_STRIDE, W_STRIDE, BLOCK_M, BLOCK_N, CHUNK_N)
    if STORE_REC:
        if tl.program_id(0) == 0:
            if REC_IN_RSTD:
                rec = RSTD + (M + 3) // 4 * 4  # normkit.ops.rec_offset: 16-byte aligned
            else:
                rec = REC
            _store_recovery(W, B, rec, TRIP, offset, X, N, HAS_W, HAS_B, HAS_TRIP, CASTING, W_STRIDE, B_STRIDE, W_MIN,
                            BIAS_RATIO, BOUND_SCALE, Y_MAX, REC_CHUNK)


@triton.jit
def _three_index_rows(rows64, n1, n2, s0, s1, s2):
    """Element offset of each row r of rows indexed by three indices of extents (n0, n1, n2), row-major:
    (r // (n1 n2)) s0 + ((r // n2) % n1) s1 + (r % n2) s2."""
    inner = rows64 // n2
    return (inner // n1) * s0 + (inner % n1) * s1 + (rows64 % n2) * s2


@triton.jit
def _bwd_rows(X, DY, rows64, dy_rows, cols, mask, stride_xm, stride_dym, N: tl.constexpr,
              ROWS_CONTIGUOUS: tl.constexpr, DY_ROWS3: tl.constexpr, X_COL_STRIDE: tl.constexpr,
              DY_COL_STRIDE: tl.constexpr, EVICTION: tl.constexpr):
    """The block's saved rows (x, or y with FROM_Y) and dy, in fp32; DY_ROWS3: dy's rows start at the
    offsets ``dy_rows`` (``_three_index_rows``)."""
    x = tl.load(X + _row_offsets(rows64, cols, N, stride_xm, X_COL_STRIDE, ROWS_CONTIGUOUS), mask=mask, other=0.0,
                eviction_policy=EVICTION).to(tl.float32)
    if DY_ROWS3:
        dy_ptrs = DY + dy_rows[:, None] + cols[None, :] * DY_COL_STRIDE
    else:
        dy_ptrs = DY + _row_offsets(rows64, cols, N, stride_dym, DY_COL_STRIDE, ROWS_CONTIGUOUS)
    dy = tl.load(dy_ptrs, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    return x, dy


@triton.jit
def _bwd_weight(W, cols, col_mask, offset, W_STRIDE: tl.constexpr):
    """weight + offset in fp32 at ``cols``, as the backward multiplies dy by it (not rounded to x.dtype)."""
    return tl.load(W + cols * W_STRIDE, mask=col_mask, other=0.0).to(tl.float32) + offset


@triton.jit
def _bwd_chunk(X, DY, B, rows64, dy_rows, row_mask, c0, bc, stride_xm, stride_dym, N: tl.constexpr,
               ROWS_CONTIGUOUS: tl.constexpr, DY_ROWS3: tl.constexpr, X_COL_STRIDE: tl.constexpr,
               DY_COL_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr, LOAD_B: tl.constexpr, CHUNK_N: tl.constexpr,
               EVICTION: tl.constexpr):
    """One chunk of a two-pass backward from column c0: its columns, their mask, the block's mask, the
    saved rows and dy there, and (LOAD_B) the bias there, else ``bc`` as given."""
    ccols = c0 + tl.arange(0, CHUNK_N)
    ccol_mask = ccols < N
    cmask = row_mask[:, None] & ccol_mask[None, :]
    x, dy = _bwd_rows(X, DY, rows64, dy_rows, ccols, cmask, stride_xm, stride_dym, N, ROWS_CONTIGUOUS, DY_ROWS3,
                      X_COL_STRIDE, DY_COL_STRIDE, EVICTION)
    if LOAD_B:
        bc = tl.load(B + ccols * B_STRIDE, mask=ccol_mask, other=0.0).to(tl.float32)
    return ccols, ccol_mask, cmask, x, dy, bc


@triton.jit
def _bwd_store_dx(DX, DRES, dx, poison, rows64, cols, mask, stride_dresm, N: tl.constexpr,
                  ROWS_CONTIGUOUS: tl.constexpr, DRES_COL_STRIDE: tl.constexpr, HAS_DRES: tl.constexpr,
                  FROM_Y: tl.constexpr):
    """dx (plus d_residual_out, plus the recovery's poison from y) stored to the contiguous DX."""
    if HAS_DRES:
        dx += tl.load(DRES + _row_offsets(rows64, cols, N, stride_dresm, DRES_COL_STRIDE, ROWS_CONTIGUOUS),
                      mask=mask, other=0.0).to(tl.float32)
    if FROM_Y:
        dx += poison
    tl.store(DX + rows64[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_centred(x, b, mean, FROM_Y: tl.constexpr, IS_RMS: tl.constexpr, HAS_B: tl.constexpr):
    """The saved rows centred: y - b (FROM_Y), x - mean (LayerNorm) or x."""
    if FROM_Y:
        t = x
        if HAS_B:
            t = t - b[None, :]
    elif IS_RMS:
        t = x
    else:
        t = x - mean[:, None]
    return t


@triton.jit
def _bwd_xhat(t, rec, rstd, mask, FROM_Y: tl.constexpr, IS_RMS: tl.constexpr, HAS_W: tl.constexpr):
    """x_hat from the centred rows: (y - b) / w_y (FROM_Y: ``rec`` is 1 / w_y), else (x - mean) * rstd."""
    if FROM_Y:
        xn = t
        if HAS_W:
            xn = xn * rec[None, :]
    elif IS_RMS:
        xn = t * rstd[:, None]
    else:
        xn = tl.where(mask, t * rstd[:, None], 0.0)
    return xn


@triton.jit
def _bwd_sums(dy, t, xn, w, FROM_Y: tl.constexpr, IS_RMS: tl.constexpr, HAS_W: tl.constexpr):
    """The terms of the row sums: (g x_hat, g), with g = dy w (LayerNorm's second sum; RMSNorm from y
    has no use for it). FROM_Y, g x_hat = dy w (y - b) / w_y is dy (y - b) (``t``): it needs neither
    the weight nor its recovery, and ``xn`` is not read."""
    if HAS_W and not (FROM_Y and IS_RMS):
        g = dy * w[None, :]
    else:
        g = dy
    if FROM_Y:
        s1 = dy * t
    else:
        s1 = g * xn
    return s1, g


@triton.jit
def _bwd_dx(dy, xn, w, c1, c2, rstd, IS_RMS: tl.constexpr, HAS_W: tl.constexpr):
    """dx = rstd (g - c2 - x_hat c1), g = dy w: c1 = mean(g x_hat), c2 = mean(g) (LayerNorm)."""
    if HAS_W:
        g = dy * w[None, :]
    else:
        g = dy
    if IS_RMS:
        dx = (g - xn * c1[:, None]) * rstd[:, None]
    else:
        dx = (g - c2[:, None] - xn * c1[:, None]) * rstd[:, None]
    return dx


@triton.jit(do_not_specialize=["M"])
def norm_bwd_kernel(
    X,  # the forward's input as it normalized it (s = x + residual for the fused add), or, with FROM_Y,
    # its output y (x.dtype); row stride stride_xm
    W,  # weight [N] (HAS_W), element stride W_STRIDE
    B,  # bias [N] (HAS_B: read only FROM_Y, to recover x_hat from y), element stride B_STRIDE
    DY,  # gradient of the output [M, N], row stride stride_dym; DY_ROWS3: rows of three indices
    DRES,  # gradient of residual_out [M, N] (HAS_DRES), row stride stride_dresm
    MEAN,  # per-row mean, fp32 [M] (not IS_RMS, not FROM_Y)
    RSTD,  # per-row 1/std, fp32 [M] ([rec_offset(M) + N + 1] with REC after the rows: REC_IN_RSTD)
    REC,  # FROM_Y, not REC_IN_RSTD: the forward's recovery of the weight, fp32 [N + 1] (1 / w_y, poison)
    offset,  # fp32 scalar added to the weight
    M,  # number of rows
    stride_xm,  # row strides, in elements; ignored when ROWS_CONTIGUOUS
    stride_dym,  # DY_ROWS3: the stride of dy's outermost row index
    stride_dresm,
    dy_n1,  # DY_ROWS3: the extents of dy's two inner row indices (else 1)
    dy_n2,
    stride_dy1,  # DY_ROWS3: their strides, in elements (else 1)
    stride_dy2,
    DX,  # gradient of x [M, N] contiguous (COMPUTE_DX); for the fused add also that of residual
    DW_PART,  # fp32 [num_programs, N] per-program dW partials (COMPUTE_DW)
    DB_PART,  # fp32 [num_programs, N] per-program dB partials (COMPUTE_DB)
    N: tl.constexpr,  # row length
    IS_RMS: tl.constexpr,  # True: RMSNorm; False: LayerNorm
    HAS_W: tl.constexpr,  # elementwise weight present
    HAS_B: tl.constexpr,  # bias present (read only FROM_Y)
    HAS_DRES: tl.constexpr,  # fused add with a gradient flowing into residual_out
    CASTING: tl.constexpr,  # 1 llama: dW sees x_hat rounded to x.dtype (the forward rounded it so)
    COMPUTE_DX: tl.constexpr,  # x (or residual) needs a gradient
    COMPUTE_DW: tl.constexpr,  # weight needs a gradient: accumulate and write DW_PART
    COMPUTE_DB: tl.constexpr,  # bias needs a gradient: accumulate and write DB_PART
    FROM_Y: tl.constexpr,  # X holds y, weight and bias frozen: x_hat = (y - b) * REC, no mean read
    REC_IN_RSTD: tl.constexpr,  # FROM_Y: REC lies in RSTD, after its M rows
    ROWS_CONTIGUOUS: tl.constexpr,  # every input is [M, N] contiguous: use the compile-time N
    DY_ROWS3: tl.constexpr,  # dy's row r at (r // (n1 n2)) stride_dym + ((r // n2) % n1) stride_dy1 +
    # (r % n2) stride_dy2 (n1, n2: dy_n1, dy_n2), whatever ROWS_CONTIGUOUS says of the other inputs
    X_COL_STRIDE: tl.constexpr,  # column strides of x, dy and d_residual: 1, or 0 (broadcast along N)
    DY_COL_STRIDE: tl.constexpr,
    DRES_COL_STRIDE: tl.constexpr,
    W_STRIDE: tl.constexpr,  # the weight's element stride
    B_STRIDE: tl.constexpr,  # the bias's element stride
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # next power of two >= N
    LOOP_STAGES: tl.constexpr,  # software-pipelining depth of the tile loop (1: none)
    PERSISTENT: tl.constexpr,  # fewer programs than tiles, each looping over many: the one-pass tiles
    # load the weight's recovery once per program too, not once per tile
    CHUNK_N: tl.constexpr,  # 0: each row in registers, read once; else (dx alone) two passes over
    # CHUNK_N-column chunks: the row sums, then a second read (from L2) to write dx
    PARAMS_PER_TILE: tl.constexpr,  # FROM_Y, CHUNK_N 0: the weight, bias and recovery loaded in each tile
    # where used (the weight again after the row sums), none held across the loop or the sums: fewer
    # registers, more reads of those vectors from L1/L2
):
    # Tiles are dealt round-robin to the programs; with dW/dB each program owns one partial row,
    # so the reduction order is fixed and the result bitwise reproducible (no atomics).
    # FROM_Y (a frozen norm that kept its output, not its input): x_hat = (y - b) * (1 / w_y), with
    # 1 / w_y as the forward's program 0 computed it from the weight (REC). The row sums come first
    # and need neither the weight nor REC (mean(g x_hat) = mean(dy (y - b))); the rest is the
    # input-saving backward's arithmetic. Where the weight breaks the safety rule (normkit.norm_math),
    # REC's poison is NaN and so is every dx: never a quietly wrong gradient.
    tl.static_assert(not (FROM_Y and (COMPUTE_DW or COMPUTE_DB)))
    tl.static_assert(CHUNK_N == 0 or (COMPUTE_DX and not (COMPUTE_DW or COMPUTE_DB) and BLOCK_N % CHUNK_N == 0
                                      and CHUNK_N < BLOCK_N))
    tl.static_assert(not PARAMS_PER_TILE or (FROM_Y and CHUNK_N == 0))
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    offset = tl.cast(offset, tl.float32)  # fp64 when Inductor launches the kernel (see norm_fwd_kernel)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = None
    b = None
    poison = None  # FROM_Y: REC's last value, 0 or NaN
    if FROM_Y:
        if REC_IN_RSTD:
            rec_ptr = RSTD + (M + 3) // 4 * 4  # normkit.ops.rec_offset: 16-byte aligned
        else:
            rec_ptr = REC
        poison = tl.load(rec_ptr + N)
    if CHUNK_N == 0 and not PARAMS_PER_TILE:  # the one-pass tiles hold the parameters in registers, loaded
        # once per program
        if HAS_W:
            w = _bwd_weight(W, cols, col_mask, offset, W_STRIDE)
        if FROM_Y and HAS_B:
            b = tl.load(B + cols * B_STRIDE, mask=col_mask, other=0.0).to(tl.float32)
        if FROM_Y and HAS_W and PERSISTENT:  # once per program, which loops over many tiles
            rec_once = tl.load(rec_ptr + cols, mask=col_mask, other=0.0)
    if COMPUTE_DW:
        dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if COMPUTE_DB:
        db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    num_tiles = (M + BLOCK_M - 1) // BLOCK_M
    for tile in tl.range(pid, num_tiles, num_progs, num_stages=LOOP_STAGES):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)
        # mean, c2 and the recovery where a variant reads them; else placeholders that no code reads
        # (a name first bound inside the tile loop, not carried by it)
        mean = rstd
        if not (IS_RMS or FROM_Y):
            mean = tl.load(MEAN + rows64, mask=row_mask, other=0.0)
        rec = rstd
        dy_rows = rows64  # DY_ROWS3: where dy's rows start
        if DY_ROWS3:
            dy_rows = _three_index_rows(rows64, dy_n1, dy_n2, stride_dym, stride_dy1, stride_dy2)
        if CHUNK_N == 0:
            mask = row_mask[:, None] & col_mask[None, :]
            wt = w  # the parameters this tile reads: the program's, or (PARAMS_PER_TILE) loaded here
            bt = b
            if PARAMS_PER_TILE:
                if HAS_B:
                    bt = tl.load(B + cols * B_STRIDE, mask=col_mask, other=0.0).to(tl.float32)
                if HAS_W and not IS_RMS:  # LayerNorm's sum of g = dy w; RMSNorm's sum needs no weight
                    wt = _bwd_weight(W, cols, col_mask, offset, W_STRIDE)
            x, dy = _bwd_rows(X, DY, rows64, dy_rows, cols, mask, stride_xm, stride_dym, N, ROWS_CONTIGUOUS,
                              DY_ROWS3, X_COL_STRIDE, DY_COL_STRIDE, "")
            t = _bwd_centred(x, bt, mean, FROM_Y, IS_RMS, HAS_B)
            xn = t
            if not FROM_Y:
                xn = _bwd_xhat(t, rec, rstd, mask, FROM_Y, IS_RMS, HAS_W)
            if COMPUTE_DX:
                s1, g = _bwd_sums(dy, t, xn, wt, FROM_Y, IS_RMS, HAS_W)
                c1 = tl.sum(s1, axis=1) * (1.0 / N)
                c2 = c1
                if not IS_RMS:
                    c2 = tl.sum(g, axis=1) * (1.0 / N)
            if FROM_Y:
                if HAS_W:
                    if PARAMS_PER_TILE:  # after the sums, the weight again: neither live across them
                        wt = _bwd_weight(W, cols, col_mask, offset, W_STRIDE)
                        rec = tl.load(rec_ptr + cols, mask=col_mask, other=0.0)
                    elif PERSISTENT:
                        rec = rec_once
                    else:  # after the sums: not live across them
                        rec = tl.load(rec_ptr + cols, mask=col_mask, other=0.0)
                xn = _bwd_xhat(t, rec, rstd, mask, FROM_Y, IS_RMS, HAS_W)
            if COMPUTE_DX:
                dx = _bwd_dx(dy, xn, wt, c1, c2, rstd, IS_RMS, HAS_W)
                _bwd_store_dx(DX, DRES, dx, poison, rows64, cols, mask, stride_dresm, N, ROWS_CONTIGUOUS,
                              DRES_COL_STRIDE, HAS_DRES, FROM_Y)
            if COMPUTE_DW:
                if CASTING == 1:
                    xn = xn.to(X.dtype.element_ty).to(tl.float32)
                dw_acc += dy * xn
            if COMPUTE_DB:
                db_acc += dy
        else:
            # first pass: the row sums, chunk by chunk, each chunk kept in L2 for the second
            wc = rstd  # the chunk's weight and bias where read
            bc = rstd
            acc1 = tl.zeros((BLOCK_M, CHUNK_N), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_M, CHUNK_N), dtype=tl.float32)
            for c0 in tl.static_range(0, BLOCK_N, CHUNK_N):
                ccols, ccol_mask, cmask, x, dy, bc = _bwd_chunk(
                    X, DY, B, rows64, dy_rows, row_mask, c0, bc, stride_xm, stride_dym, N, ROWS_CONTIGUOUS,
                    DY_ROWS3, X_COL_STRIDE, DY_COL_STRIDE, B_STRIDE, FROM_Y and HAS_B, CHUNK_N, "evict_last")
                if HAS_W and not (FROM_Y and IS_RMS):  # FROM_Y RMSNorm: the sum needs no weight
                    wc = _bwd_weight(W, ccols, ccol_mask, offset, W_STRIDE)
                t = _bwd_centred(x, bc, mean, FROM_Y, IS_RMS, HAS_B)
                xn = t
                if not FROM_Y:
                    xn = _bwd_xhat(t, rec, rstd, cmask, FROM_Y, IS_RMS, HAS_W)
                s1, g = _bwd_sums(dy, t, xn, wc, FROM_Y, IS_RMS, HAS_W)
                acc1 += s1
                if not IS_RMS:
                    acc2 += g
            c1 = tl.sum(acc1, axis=1) * (1.0 / N)
            c2 = c1
            if not IS_RMS:
                c2 = tl.sum(acc2, axis=1) * (1.0 / N)
            # second pass: read the chunks again and write dx
            for c0 in tl.static_range(0, BLOCK_N, CHUNK_N):
                ccols, ccol_mask, cmask, x, dy, bc = _bwd_chunk(
                    X, DY, B, rows64, dy_rows, row_mask, c0, bc, stride_xm, stride_dym, N, ROWS_CONTIGUOUS,
                    DY_ROWS3, X_COL_STRIDE, DY_COL_STRIDE, B_STRIDE, FROM_Y and HAS_B, CHUNK_N, "evict_first")
                if HAS_W:
                    wc = _bwd_weight(W, ccols, ccol_mask, offset, W_STRIDE)
                    if FROM_Y:
                        rec = tl.load(rec_ptr + ccols, mask=ccol_mask, other=0.0)
                t = _bwd_centred(x, bc, mean, FROM_Y, IS_RMS, HAS_B)
                xn = _bwd_xhat(t, rec, rstd, cmask, FROM_Y, IS_RMS, HAS_W)
                dx = _bwd_dx(dy, xn, wc, c1, c2, rstd, IS_RMS, HAS_W)
                _bwd_store_dx(DX, DRES, dx, poison, rows64, ccols, cmask, stride_dresm, N, ROWS_CONTIGUOUS,
                              DRES_COL_STRIDE, HAS_DRES, FROM_Y)
    if COMPUTE_DW:
        tl.store(DW_PART + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB_PART + pid.to(tl.int64) * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit(do_not_specialize=["G"])
def partial_sum_kernel(
    DW_PART,  # fp32 [G, N] dW partials (HAS_DW)
    DB_PART,  # fp32 [G, N] dB partials (HAS_DB)
    G,  # number of partial rows
    DW,  # dW [N], the weight's dtype (HAS_DW)
    DB,  # dB [N], the bias's dtype (HAS_DB)
    N: tl.constexpr,  # row length
    HAS_DW: tl.constexpr,  # reduce DW_PART into DW
    HAS_DB: tl.constexpr,  # reduce DB_PART into DB
    BLOCK_G: tl.constexpr,  # partial rows per step
    BLOCK_N: tl.constexpr,  # columns per program
):
    # Fixed-order column sums over the partial rows: deterministic.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dw_acc = tl.zeros((BLOCK_G, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_G, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        mask = (g < G)[:, None] & col_mask[None, :]
        off = g.to(tl.int64)[:, None] * N + cols[None, :]
        if HAS_DW:
            dw_acc += tl.load(DW_PART + off, mask=mask, other=0.0)
        if HAS_DB:
            db_acc += tl.load(DB_PART + off, mask=mask, other=0.0)
    if HAS_DW:
        tl.store(DW + cols, tl.sum(dw_acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if HAS_DB:
        tl.store(DB + cols, tl.sum(db_acc, axis=0).to(DB.dtype.element_ty), mask=col_mask)
