"""Launch plans: the one place where block sizes, warps, grids and partial counts are chosen.

``normkit.driver`` asks for a plan and hands it to a frontend's backend, which only allocates and
launches; so a given shape runs the same compiled kernel with the same configuration from Torch and
from JAX. Plans are memoized on hashable positional keys: at small shapes the host time per call is
most of the time.

A ``KernelCall`` names every kernel parameter in the kernel's positional order (array inputs,
runtime scalars, outputs, constexprs), as jax-triton 0.3.1 binds them. An input or output the
variant does not use is *absent*: the Torch backend passes ``None`` for it, the JAX backend a
one-element dummy the kernel never touches.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
from typing import Any

from normkit import record
from normkit import norm_math
from normkit.ops import ELEM_BYTES, FINITE_MAX, OUTPUT_BIAS_RATIO, OUTPUT_W_MIN, Grads, Op, Options

FWD_INPUTS = ("X", "R", "W", "B", "TRIP")
FWD_SCALARS = ("eps", "offset", "M", "stride_xm", "stride_rm")
FWD_OUTPUTS = ("Y", "S", "MEAN", "RSTD", "REC", "Y2")
BWD_INPUTS = ("X", "W", "B", "DY", "DRES", "MEAN", "RSTD", "REC")
BWD_SCALARS = ("offset", "M", "stride_xm", "stride_dym", "stride_dresm", "dy_n1", "dy_n2", "stride_dy1", "stride_dy2")
# (dy_n1, dy_n2, stride_dy1, stride_dy2) of a dy read as rows of one stride: ones, which Triton's launcher
# specializes as constants, so that the kernel compiled for such a dy has no parameter for them
DY_ONE_STRIDE = (1, 1, 1, 1)
BWD_OUTPUTS = ("DX", "DW_PART", "DB_PART")
RED_INPUTS = ("DW_PART", "DB_PART")
RED_SCALARS = ("G",)
RED_OUTPUTS = ("DW", "DB")


@functools.cache
def kernels():
    """``normkit.kernels.norm``, the Triton kernels, imported by the first plan that launches one: the
    Pallas implementation reads this module's heuristics without the triton package installed."""
    from normkit.kernels import norm

    return norm


@dataclasses.dataclass(frozen=True, eq=False)
class KernelCall:
    """Everything a backend needs to launch one kernel. Plans are shared: never mutate one, except
    ``cache``, where a backend may keep what it derives from the plan (a bound launcher)."""

    kernel: Any  # the @triton.jit function
    grid: tuple[int, ...]
    num_warps: int
    num_stages: int
    inputs: tuple[str, ...]  # positional array inputs, in kernel order
    present_inputs: frozenset  # the inputs this variant reads
    scalar_names: tuple[str, ...]  # runtime scalars, in kernel order
    scalars: tuple  # their values: ints, and floats that are float32-exact
    outputs: tuple[str, ...]  # positional outputs, in kernel order
    out_specs: dict  # name -> (shape, dtype name) for each output this variant writes
    constexprs: dict
    fp_fusion: bool = True  # Triton's enable_fp_fusion (FMA contraction); pass it to the launcher
    cache: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):  # once per plan (plans are memoized): the kernel's positional order
        names = self.inputs + self.scalar_names + self.outputs + tuple(self.constexprs)
        assert tuple(self.kernel.arg_names) == names, (self.kernel.arg_names, names)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else self.kernel.__name__

    def record(self, frontend: str, interpreted: bool) -> None:
        if not record.active():
            return
        partials = tuple(
            (name, tuple(shape), dtype) for name, (shape, dtype) in self.out_specs.items() if name.endswith("_PART")
        )
        record.emit(record.Launch(kernel=self.name, frontend=frontend, grid=self.grid, num_warps=self.num_warps,
                                  flags=dict(self.constexprs), partial_buffers=partials, interpreted=interpreted))


def _f32(value: float) -> float:
    """``value`` rounded to float32, as the kernels receive it (a Python float holding it exactly)."""
    import struct

    return struct.unpack("f", struct.pack("f", value))[0]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Chosen by scripts/tune.py's sweeps (bf16, kernel-only timings; docs/PERFORMANCE_RECORD.md, "Forward
# kernels" and "Backward kernels and the frozen path"):
# - 4 warps per 4096-element tile, 8 per 8192, 16 per 16384: about 8-16 elements per thread;
# - short rows: several rows per tile (4096 // BLOCK_N), so one program still moves a useful amount;
# - every dx-only backward: one program per tile, no pipelining;
# - the forwards: one program per tile, straight through (forward_tile);
# - dW/dB backward: one (tile >= 8192) or two programs per SM, each accumulating one fp32 partial row,
#   with the next tiles prefetched (3-4 stages).
SMEM_BUDGET = 160 * 1024  # bytes of shared memory the prefetched tiles may take (Hopper GPUs: 228 KB per SM)


def tile_config(M: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a row-wise pass over an M x N tensor.

    The tile depends on N alone, never on M: a row's reduction order follows the tile's layout (how
    many threads and warps share a row), so a row must meet the same tile whether it is normalized
    alone, in a short batch or in a long one (batch invariance). Fewer rows than a tile holds leave
    the rest of it masked, which costs nothing measurable: such calls are launch-bound.
    """
    return _tile_config(_next_pow2(N))


@functools.lru_cache(maxsize=None)
def _tile_config(block_n: int) -> tuple[int, int, int]:
    block_m = max(1, min(16, 4096 // block_n))
    num_warps = min(32, max(4, block_m * block_n // 1024))
    return block_m, block_n, num_warps


# The forward's tiles (measurements: docs/PERFORMANCE_RECORD.md, "Forward kernels"). The forward runs
# one program per tile, each straight through (LOOP_STAGES 0): a loop around the tile slows the
# LayerNorm forward on 16-bit rows, and without that loop the persistent, prefetching grid wins at
# none of the swept shapes.
# - LayerNorm: tiles of 8192 elements (16384 for 16-bit rows of >= 8192) with 64 bytes of the row per
#   thread.
# - RMSNorm: tile_config's tiles, except where scripts/tune.py's sweep found a faster one: the entries
#   of normkit/tiles.json, (residual, element bytes, BLOCK_N) -> (BLOCK_M, warps, CHUNK_N) (the
#   evidence for each: docs/PERFORMANCE_RECORD.md, "The forward tile table"). CHUNK_N > 0 reads the
#   row in two passes over chunks of that many columns (the sum of squares with the chunks kept in
#   L2, then the chunks again from L2 to normalize, as Inductor's looped reductions do) instead of
#   holding it in registers.
def rms_forward_tiles(table: dict) -> dict:
    """tiles.json's RMSNorm forward entries: {(residual, elem_bytes, BLOCK_N): (BLOCK_M, warps, CHUNK_N)}."""
    return {(e["residual"], e["elem_bytes"], e["block_n"]): tuple(e["tile"]) for e in table["rms_forward"]}


def backward_tiles(table: dict) -> dict:
    """tiles.json's dx-only backward entries: {(op name, from_output, elem_bytes, BLOCK_N): (num_warps, CHUNK_N,
    programs per SM (0: one program per tile; a fraction: fewer programs than SMs), LOOP_STAGES, BLOCK_M (0:
    tile_config's), PARAMS_PER_TILE (0 or 1))}; an entry of four values keeps tile_config's BLOCK_M, one of
    four or five holds the parameters once per program (PARAMS_PER_TILE 0)."""
    return {(e["op"], e["from_output"], e["elem_bytes"], e["block_n"]): (*e["tile"], 0, 0)[:6]
            for e in table.get("backward_dx", [])}


_TILES = json.loads(importlib.resources.files("normkit").joinpath("tiles.json").read_text())
_RMS_FWD_TILES = rms_forward_tiles(_TILES)
# The dx-only backward (every frozen-parameter backward) over rows of one tile each: tile_config's
# tiles, except the entries of tiles.json's "backward_dx", found by benchmarks/save_ab.py --sweep
# (the output-saving backward's warps and CHUNK_N per op, element size and BLOCK_N; evidence:
# docs/PERFORMANCE_RECORD.md, "The output-saving backward's tiles" and "Tiles that load the
# parameters in each tile"). CHUNK_N > 0 reads the row in
# two passes over chunks (the row sums, then dx from the chunks again, from L2), so that fewer
# per-column vectors (the weight, its recovery, the bias) are live beside the row; programs per SM
# > 0 makes the grid persistent: each program loads those vectors once and loops over many rows,
# the next ones prefetched (LOOP_STAGES), instead of reading them from L2 with every row; BLOCK_M > 0
# (a power of two) sets the rows per tile, over which a program shares those vectors too;
# PARAMS_PER_TILE 1 (from y, one pass) loads them in every tile where used instead of holding them
# across the loop and the row sums: fewer registers per thread (benchmarks/registers.py), more reads
# from L1/L2. Each entry depends on N alone, as tile_config does (batch invariance).
_BWD_TILES = backward_tiles(_TILES)


def forward_tile(op: Op, M: int, N: int, elem_bytes: int) -> tuple[int, int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, num_warps, persistent, CHUNK_N) of the forward over an M x N tensor of
    ``elem_bytes``-byte elements; ``persistent``: a grid of a few programs per SM that prefetch (no
    shape chooses it: with loop-free tiles it wins at none of the swept shapes; `scripts/tune.py`
    sweeps it and the property tests force it, so the kernel's tile loop stays benchmarked and
    tested); ``CHUNK_N``: 0, or (RMSNorm) the columns per chunk of a row read in two passes."""
    block_m, block_n, num_warps = tile_config(M, N)  # N alone: see tile_config
    if op.is_rms:
        block_m, num_warps, chunk = _RMS_FWD_TILES.get((op.has_residual, elem_bytes, block_n), (block_m, num_warps, 0))
        assert chunk == 0 or (block_n % chunk == 0 and 16 <= chunk < block_n), chunk
        return block_m, block_n, num_warps, False, chunk
    elements = 16384 if elem_bytes < 4 and block_n >= 8192 else 8192
    block_m = max(1, min(16, elements // block_n))
    num_warps = min(32, max(4, block_m * block_n * elem_bytes // 2048))  # 64 bytes per thread
    return block_m, block_n, num_warps, False, 0


def _stages(block_m: int, block_n: int, elem_bytes: int, streams: int, want: int) -> int:
    """Pipelining depth: ``want``, or fewer when that many prefetched tiles overflow shared memory."""
    per_stage = block_m * block_n * elem_bytes * streams
    return max(1, min(want, SMEM_BUDGET // per_stage))


def num_partials(M: int, N: int, num_sms: int) -> int:
    """Programs (hence fp32 partial rows) of a backward that reduces dW/dB."""
    block_m, block_n, _ = tile_config(M, N)
    tiles = -(-M // block_m)
    return max(1, min(tiles, (1 if block_m * block_n >= 8192 else 2) * num_sms))


def _rows_contiguous(M: int, N: int, present) -> bool:
    """Every present row input is [M, N] contiguous (``present``: their (row stride, column stride)),
    so the kernel addresses them with the compile-time N. An absent input does not count: its
    placeholder strides would otherwise send the common case to the runtime-stride path, whose
    row starts Triton can prove 16-byte aligned only where the launcher specializes integer
    arguments (Triton's own launcher does, jax-triton 0.3.1 does not: scalar loads there)."""
    return all(c == 1 for _, c in present) and (M <= 1 or all(s == N for s, _ in present))


REC_CHUNK = 1024  # columns per step of the forward's recovery of the weight (program 0's extra work)


@functools.lru_cache(maxsize=8192)
def plan_forward(op: Op, M: int, N: int, x_dtype: str, w_dtype: str | None, b_dtype: str | None, opts: Options,
                 store_stats: bool, layout: tuple, num_sms: int, store_rec: bool = False, rec_in_rstd: bool = False,
                 has_trip: bool = False, y2_dtype: str | None = None) -> KernelCall:
    """The forward launch over M >= 1 rows; ``w_dtype``/``b_dtype`` None for an absent weight/bias.

    ``layout`` is ``(stride_xm, x_col, stride_rm, r_col, w_stride, b_stride)`` in elements, column
    strides 0 or 1 (``normkit.driver`` reads them from the arrays). ``num_sms``, the device's SM
    count, sizes the persistent LayerNorm grid (``forward_tile``). ``store_rec``: the backward will
    read y, so program 0 also writes the weight's recovery (``Op.fwd_buffers``; in RSTD with
    ``rec_in_rstd``), and sets the flag TRIP (``has_trip``) where the weight breaks the safety rule.
    ``y2_dtype``: y is also stored in this dtype (Y2, ``Op.fwd_buffers``), with the same tile and grid.
    """
    assert store_stats or not store_rec
    stride_xm, x_col, stride_rm, r_col, w_stride, b_stride = layout
    has_w, has_b = w_dtype is not None, b_dtype is not None
    block_m, block_n, num_warps, persistent, chunk = forward_tile(op, M, N, ELEM_BYTES[x_dtype])
    tiles = -(-M // block_m)
    grid, stages = tiles, 0  # LOOP_STAGES 0: one program per tile, no loop in the kernel
    if persistent:
        want = _stages(block_m, block_n, ELEM_BYTES[x_dtype], 1, 3)
        if want > 1:
            grid, stages = min(tiles, (4 if block_m * block_n <= 4096 else 2) * num_sms), want
    present = {"X"} | ({"R"} if op.has_residual else set()) | ({"W"} if has_w else set()) | (
        {"B"} if has_b else set()) | ({"TRIP"} if has_trip else set())
    rows_contiguous = _rows_contiguous(M, N, [(stride_xm, x_col)] + ([(stride_rm, r_col)] if op.has_residual else []))
    return KernelCall(
        kernel=kernels().norm_fwd_kernel,
        grid=(grid,),
        num_warps=num_warps,
        num_stages=1,
        inputs=FWD_INPUTS,
        present_inputs=frozenset(present),
        scalar_names=FWD_SCALARS,
        scalars=(_f32(opts.eps), _f32(opts.offset), M, stride_xm, stride_rm),
        outputs=FWD_OUTPUTS,
        out_specs=op.fwd_buffers(M, N, x_dtype, store_stats, store_rec, rec_in_rstd, y2_dtype),
        constexprs=dict(
            N=N,
            **op.fwd_flags,
            HAS_W=has_w,
            HAS_B=has_b,
            CASTING=int(opts.casting),
            STORE_STATS=store_stats,
            STORE_REC=store_rec,
            REC_IN_RSTD=store_rec and rec_in_rstd,
            HAS_TRIP=has_trip,
            HAS_Y2=y2_dtype is not None,
            W_MIN=OUTPUT_W_MIN[x_dtype] if store_rec else 0.0,
            BIAS_RATIO=OUTPUT_BIAS_RATIO if store_rec else 0.0,
            BOUND_SCALE=_f32(norm_math.bound_scale(N, x_dtype)) if store_rec else 0.0,
            Y_MAX=FINITE_MAX[x_dtype] if store_rec else 0.0,
            REC_CHUNK=min(_next_pow2(N), REC_CHUNK),
            ROWS_CONTIGUOUS=rows_contiguous,
            X_COL_STRIDE=x_col,
            R_COL_STRIDE=r_col,
            W_STRIDE=w_stride if has_w else 1,
            B_STRIDE=b_stride if has_b else 1,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            LOOP_STAGES=stages,
            CHUNK_N=chunk,
        ),
    )


@functools.lru_cache(maxsize=8192)
def plan_backward(op: Op, M: int, N: int, x_dtype: str, w_dtype: str | None, b_dtype: str | None, has_dres: bool,
                  opts: Options, grads: Grads, layout: tuple, num_sms: int, from_output: bool = False,
                  has_bias: bool = False, rec_in_rstd: bool = False,
                  dy_rows: tuple | None = None) -> tuple[KernelCall, KernelCall | None]:
    """The backward launch over M >= 1 rows, and the reduction of its partials (None without dW/dB).

    ``w_dtype``/``b_dtype``: the parameters' dtypes (None if absent, or, for the bias, not trained),
    which dW/dB take. ``layout`` is ``(stride_xm, x_col, stride_dym, dy_col, stride_dresm, dres_col,
    w_stride, b_stride)``. Without dW/dB there are no partials and one program per tile.
    ``from_output``: the kernel reads the forward's output y where it would read x (dx only; weight and
    bias frozen), the bias (``has_bias``) and the forward's recovery of the weight (REC, or in RSTD
    after its rows: ``rec_in_rstd``) to recover x_hat from it; no mean is read. ``dy_rows``: None, or
    ``(n1, n2, s1, s2)`` where dy's rows are indexed by three indices (DY_ROWS3): row r at
    ``(r // (n1 n2)) stride_dym + ((r // n2) % n1) s1 + (r % n2) s2``; the other inputs' addressing
    (ROWS_CONTIGUOUS) is then decided without dy.
    """
    stride_xm, x_col, stride_dym, dy_col, stride_dresm, dres_col, w_stride, b_stride = layout
    has_w = w_dtype is not None
    has_b = from_output and has_bias
    reduces = grads.reduces
    assert not (from_output and reduces), "the output-saving backward computes dx alone"
    block_m, block_n, num_warps = tile_config(M, N)
    chunk = per_sm = per_tile = 0
    stages = 1
    if grads.dx and not reduces:
        num_warps, chunk, per_sm, stages, rows, per_tile = _BWD_TILES.get(
            (op.name, from_output, ELEM_BYTES[x_dtype], block_n), (num_warps, 0, 0, 1, 0, 0))
        assert chunk == 0 or (block_n % chunk == 0 and 16 <= chunk < block_n), chunk
        assert rows >= 0 and rows & (rows - 1) == 0, rows
        assert per_tile in (0, 1) and not (per_tile and (chunk or not from_output)), per_tile
        block_m = rows or block_m
        stages = _stages(block_m, block_n, ELEM_BYTES[x_dtype], 3 if has_dres else 2, stages)
    tiles = -(-M // block_m)
    grid = num_partials(M, N, num_sms) if reduces else min(tiles, max(1, round(per_sm * num_sms))) if per_sm else tiles
    if reduces:
        streams = 2 + (1 if has_dres else 0)  # x and dy (and d_residual) are prefetched
        stages = _stages(block_m, block_n, ELEM_BYTES[x_dtype], streams, 4 if block_m * block_n >= 8192 else 3)
    out_specs = {}
    if grads.dx:
        out_specs["DX"] = ((M, N), x_dtype)
    if grads.dw:
        out_specs["DW_PART"] = ((grid, N), "float32")
    if grads.db:
        out_specs["DB_PART"] = ((grid, N), "float32")
    present = {"X", "DY", "RSTD"} | ({"W"} if has_w else set()) | ({"DRES"} if has_dres else set())
    present |= ({"B"} if has_b else set()) | (set() if op.is_rms or from_output else {"MEAN"})
    present |= {"REC"} if from_output and not rec_in_rstd else set()
    rows_contiguous = _rows_contiguous(M, N, [(stride_xm, x_col)] + ([(stride_dym, dy_col)] if dy_rows is None else [])
                                       + ([(stride_dresm, dres_col)] if has_dres else []))
    bwd = KernelCall(
        # LayerNorm's dx = rstd * (g - mean(g) - ...): contracting g = dy * w into an FMA with the
        # subtraction leaves g's rounding error amplified by rstd where it should cancel exactly.
        fp_fusion=op.is_rms,
        kernel=kernels().norm_bwd_kernel,
        grid=(grid,),
        num_warps=num_warps,
        num_stages=1,
        inputs=BWD_INPUTS,
        present_inputs=frozenset(present),
        scalar_names=BWD_SCALARS,
        scalars=(_f32(opts.offset), M, stride_xm, stride_dym, stride_dresm, *(dy_rows or DY_ONE_STRIDE)),
        outputs=BWD_OUTPUTS,
        out_specs=out_specs,
        constexprs=dict(
            N=N,
            IS_RMS=op.is_rms,
            HAS_W=has_w,
            HAS_B=has_b,
            HAS_DRES=has_dres,
            CASTING=int(opts.casting),
            COMPUTE_DX=grads.dx,
            COMPUTE_DW=grads.dw,
            COMPUTE_DB=grads.db,
            FROM_Y=from_output,
            REC_IN_RSTD=from_output and rec_in_rstd,
            ROWS_CONTIGUOUS=rows_contiguous,
            DY_ROWS3=dy_rows is not None,
            X_COL_STRIDE=x_col,
            DY_COL_STRIDE=dy_col,
            DRES_COL_STRIDE=dres_col,
            W_STRIDE=w_stride if has_w else 1,
            B_STRIDE=b_stride if has_b else 1,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            LOOP_STAGES=stages,
            PERSISTENT=grid < tiles,
            CHUNK_N=chunk,
            PARAMS_PER_TILE=bool(per_tile),
        ),
    )
    return bwd, _plan_reduce(N, grid, w_dtype if grads.dw else None, b_dtype if grads.db else None)


def reduce_blocks(G: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_G, BLOCK_N, num_warps) of the partial-sum reduction (Triton and Pallas): 64 columns per
    program, 32 partial rows a step; 4 warps from 1024 elements a step, else 1."""
    block_g, block_n = min(_next_pow2(G), 32), min(_next_pow2(N), 64)
    return block_g, block_n, 4 if block_g * block_n >= 1024 else 1


def _plan_reduce(N: int, G: int, w_dtype: str | None, b_dtype: str | None) -> KernelCall | None:
    """The fixed-order column sum of a backward's G partial rows into dW/dB, or None without any."""
    has_dw, has_db = w_dtype is not None, b_dtype is not None
    if not (has_dw or has_db):
        return None
    block_g, block_n, num_warps = reduce_blocks(G, N)
    out_specs = {}
    if has_dw:
        out_specs["DW"] = ((N,), w_dtype)
    if has_db:
        out_specs["DB"] = ((N,), b_dtype)
    present = ({"DW_PART"} if has_dw else set()) | ({"DB_PART"} if has_db else set())
    return KernelCall(
        kernel=kernels().partial_sum_kernel,
        grid=(-(-N // block_n),),
        num_warps=num_warps,
        num_stages=1,
        inputs=RED_INPUTS,
        present_inputs=frozenset(present),
        scalar_names=RED_SCALARS,
        scalars=(G,),
        outputs=RED_OUTPUTS,
        out_specs=out_specs,
        constexprs=dict(N=N, HAS_DW=has_dw, HAS_DB=has_db, BLOCK_G=block_g, BLOCK_N=block_n),
    )


# The "SM" count plans are made with when the kernels run in Triton's interpreter (CPU arrays): a few
# programs, each looping over several tiles, so the persistent loops and partials are exercised.
INTERPRETER_NUM_SMS = 4


# ---------------------------------------------------------------------------------------------
# The Pallas kernels (normkit/kernels/norm_pallas.py, launched by jax_frontend._pallas).


@dataclasses.dataclass(frozen=True)
class PallasBlocks:
    block_m: int  # rows per tile
    block_n: int  # next power of two >= N
    num_warps: int  # warps per program (Triton lowering)
    num_programs: int  # grid size
    tiles_per_program: int  # tiles each program walks (1: one row block per program)
    num_stages: int = 1  # Triton loop pipelining, which Pallas does not apply to these loops (the kernels prefetch)


def pallas_persistent(op: Op, N: int, *, elem_bytes: int, backward: bool) -> bool:
    """Whether a Pallas pass without dW/dB walks several tiles per program (a persistent grid): only
    LayerNorm's (two dependent reductions per row), where the sweeps found it faster
    (docs/PERFORMANCE_RECORD.md, "Pallas launch shapes and code"): its forward on rows of >= 8192
    elements (>= 4096 in fp32), its dx-only backward on rows of 8192 (next power of two)."""
    if op.is_rms:
        return False
    if backward:
        return _next_pow2(N) == 8192
    return _next_pow2(N) >= (4096 if elem_bytes >= 4 else 8192)


@functools.lru_cache(maxsize=4096)
def pallas_blocks(op: Op, M: int, N: int, *, elem_bytes: int, num_sms: int, backward: bool = False,
                  reduces: bool = False, persistent: bool | None = None) -> PallasBlocks:
    """Launch shape of one Pallas row-wise pass of ``op`` over M x N (jax_frontend._pallas).

    ``backward``: the backward pass; ``reduces``: a backward with dW/dB partials; ``elem_bytes``: the
    rows' element size; ``num_sms``: the device's SM count (``INTERPRETER_NUM_SMS`` in interpret
    mode). ``persistent`` (a pass without dW/dB whose programs walk several tiles) defaults to
    ``pallas_persistent``; False keeps one tile per program. The rules, each chosen by a sweep
    that started from the Triton kernels' choices (the sweeps: docs/PERFORMANCE_RECORD.md, "Pallas
    launch shapes and code"):
    - a tile is BLOCK_M rows x BLOCK_N (next power of two >= N) columns, ~4096 elements, with
      about 8-16 elements per thread (4 warps per 4096, 8 per 8192, up to 32);
    - forward and dx-only backward: one tile per program, except on LayerNorm's long rows;
    - dW/dB backward: min(tiles, 1 program per SM for tiles of >= 8192 elements, else 2), each
      prefetching its next tile; 8192-element tiles get 16 warps there (4096-element ones lose with
      16). More programs per SM only add partials: one program's registers already fill an SM;
    - persistent forward in bf16/fp16: 2 programs per SM for tiles of >= 8192 elements, else 4, with
      half the warps of a one-tile program (at least 4);
    - persistent forward in fp32, rows of >= 8192: tiles of >= 16384 elements, 16 warps (32 on wider
      rows), 1 program per SM (the bf16 choice's 4 warps spill in fp32);
    - persistent forward in fp32, narrower rows: twice the one-tile warps, 2 programs per SM;
    - persistent dx-only backward (rows of 8192 only): 1 program per SM, 32 warps. Wider rows keep
      one row per program: there a prefetched fp32 tile spills.
    """
    if persistent is None:
        persistent = pallas_persistent(op, N, elem_bytes=elem_bytes, backward=backward)
    persistent = persistent and not reduces
    block_m, block_n, num_warps = tile_config(M, N)  # the Triton kernels' tiles
    wide_fp32_forward = persistent and not backward and elem_bytes >= 4 and block_n >= 8192
    if wide_fp32_forward:
        block_m = max(block_m, 16384 // block_n)
        num_warps = 16 if block_n <= 8192 else 32  # 16 on 16384-wide rows: 128 registers and spills
    tiles = -(-M // block_m)
    big = block_m * block_n >= 8192
    if reduces:
        programs = max(1, min(tiles, (1 if big else 2) * num_sms))
        if big:
            num_warps = min(32, 2 * num_warps)
    elif persistent and backward:
        programs = max(1, min(tiles, num_sms))
        num_warps = 32
    elif wide_fp32_forward:
        programs = max(1, min(tiles, num_sms))
    elif persistent and elem_bytes >= 4:  # fp32 rows of < 8192: twice the warps, 2 programs per SM
        programs = max(1, min(tiles, 2 * num_sms))
        num_warps = min(32, 2 * num_warps)
    elif persistent:
        programs = max(1, min(tiles, (2 if big else 4) * num_sms))
        num_warps = max(4, num_warps // 2)
    else:
        programs = tiles
    return PallasBlocks(block_m, block_n, num_warps, programs, -(-tiles // programs))


# ---------------------------------------------------------------------------------------------
# RMSNorm followed by rotary embedding (normkit/kernels/rope.py, normkit.rope): rows addressed by
# three row indices, each array with its own three row strides (normkit.rope.row_layout).

ROPE_STRIDES = ("0", "1", "2")
ROPE_FWD_INPUTS = ("X", "W", "COS", "SIN", "TRIP")
ROPE_FWD_SCALARS = ("eps", "offset", "M", "n1", "n2") + tuple(
    f"s{a}{i}" for a in ("x", "c", "s", "y") for i in ROPE_STRIDES)
ROPE_FWD_OUTPUTS = ("Y", "RSTD", "REC")
ROPE_BWD_INPUTS = ("X", "W", "COS", "SIN", "DY", "RSTD", "REC")
ROPE_BWD_SCALARS = ("offset", "M", "n1", "n2") + tuple(
    f"s{a}{i}" for a in ("x", "c", "s", "dy", "dx") for i in ROPE_STRIDES)
ROPE_BWD_OUTPUTS = ("DX", "DW_PART")


@functools.cache
def rope_kernels():
    """``normkit.kernels.rope``, imported by the first rope plan."""
    from normkit.kernels import rope

    return rope


def _rope_strides_aligned(D: int, interleaved: bool, strides: tuple, dtypes: tuple) -> bool:
    """Whether every row stride of every array, and rotate_half's offset D/2 of the second half, is a
    multiple of 16 bytes' worth of that array's elements (a stride of 0 is): then the kernels mark
    each row start ``tl.multiple_of`` it (STRIDES_ALIGNED), and their row accesses are 128 bits wide
    under jax-triton too, which gives the compiler no divisibility of the run-time strides."""
    for triple, dtype in zip(strides, dtypes, strict=True):
        step = 16 // ELEM_BYTES[dtype]
        if any(s % step for s in (*triple, *(() if interleaved else (D // 2,)))):
            return False
    return True


@functools.lru_cache(maxsize=4096)
def plan_rope_forward(D: int, rows: tuple, x_dtype: str, w_dtype: str | None, opts: Options, interleaved: bool,
                      store_stats: bool, store_rec: bool, strides: tuple, w_stride: int,
                      out_shape: tuple, *, table_dtypes: tuple, has_trip: bool = False) -> KernelCall:
    """The forward of ``rms_norm_rope`` over ``rows = (n0, n1, n2)`` rows of D columns (``M = n0 n1
    n2 >= 1``). ``strides``: the row strides ``(s0, s1, s2)`` of x, cos, sin and the output, in that
    order (``normkit.rope.row_layout``); ``w_stride`` the weight's element stride; ``out_shape``
    the output's shape (the caller's x shape), in which a backend that allocates it does so;
    ``table_dtypes``: cos's and sin's dtypes (with the strides, they decide STRIDES_ALIGNED).
    ``store_rec``: the backward will read the output, so program 0 writes the weight's recovery REC,
    and, ``has_trip``, sets the flags TRIP[0] where the weight breaks the safety rule and TRIP[1] where a
    pair of table columns is not a usable rotation (``norm_math.rope_table_usable``). Tiles as RMSNorm's
    (``tile_config``: N alone fixes a row's reduction order), one per program."""
    assert store_stats or not store_rec
    n0, n1, n2 = rows
    M = n0 * n1 * n2
    has_w = w_dtype is not None
    trip = has_trip and store_rec
    block_m, block_d, num_warps = tile_config(M, D)
    out_specs = {"Y": (tuple(out_shape), x_dtype)}
    if store_stats:
        out_specs["RSTD"] = ((M,), "float32")
    if store_rec:
        out_specs["REC"] = ((D + 1,), "float32")
    return KernelCall(
        kernel=rope_kernels().rms_norm_rope_fwd_kernel,
        grid=(-(-M // block_m),),
        num_warps=num_warps,
        num_stages=1,
        inputs=ROPE_FWD_INPUTS,
        present_inputs=frozenset({"X", "COS", "SIN"} | ({"W"} if has_w else set()) | ({"TRIP"} if trip else set())),
        scalar_names=ROPE_FWD_SCALARS,
        scalars=(_f32(opts.eps), _f32(opts.offset), M, n1, n2, *(s for triple in strides for s in triple)),
        outputs=ROPE_FWD_OUTPUTS,
        out_specs=out_specs,
        constexprs=dict(
            D=D,
            HAS_W=has_w,
            CASTING=int(opts.casting),
            INTERLEAVED=interleaved,
            STORE_STATS=store_stats,
            STORE_REC=store_rec,
            HAS_TRIP=trip,
            W_MIN=OUTPUT_W_MIN[x_dtype] if store_rec else 0.0,
            BOUND_SCALE=_f32(norm_math.bound_scale(D, x_dtype)) if store_rec else 0.0,
            Y_MAX=FINITE_MAX[x_dtype] if store_rec else 0.0,
            PAIR_RATIO=norm_math.ROPE_PAIR_RATIO,
            TABLE_RATIO=norm_math.ROPE_TABLE_RATIO,
            REC_CHUNK=min(_next_pow2(D), REC_CHUNK),
            W_STRIDE=w_stride if has_w else 1,
            STRIDES_ALIGNED=_rope_strides_aligned(D, interleaved, strides, (x_dtype, *table_dtypes, x_dtype)),
            BLOCK_M=block_m,
            BLOCK_D=block_d,
        ),
    )


@functools.lru_cache(maxsize=4096)
def plan_rope_backward(D: int, rows: tuple, x_dtype: str, w_dtype: str | None, opts: Options, interleaved: bool,
                       grads: Grads, from_output: bool, strides: tuple, w_stride: int, num_sms: int,
                       out_shape: tuple, *, table_dtypes: tuple) -> tuple[KernelCall, KernelCall | None]:
    """The backward of ``rms_norm_rope`` and the fixed-order reduction of its dW partials (None
    without dW). ``strides``: the row strides of the saved rows (x, or the output ``from_output``),
    cos, sin, dy and dx (dy and dx in x's dtype); ``out_shape``: dx's shape; ``table_dtypes``: cos's
    and sin's dtypes. With dW, ``num_partials`` programs each own one fp32 partial row
    (``partial_sum_kernel`` then sums them in a fixed order); without, one program per tile."""
    assert not (from_output and grads.dw), "the output-saving backward computes dx alone"
    n0, n1, n2 = rows
    M = n0 * n1 * n2
    has_w = w_dtype is not None
    block_m, block_d, num_warps = tile_config(M, D)
    tiles = -(-M // block_m)
    grid = num_partials(M, D, num_sms) if grads.dw else tiles
    out_specs = {}
    if grads.dx:
        out_specs["DX"] = (tuple(out_shape), x_dtype)
    if grads.dw:
        out_specs["DW_PART"] = ((grid, D), "float32")
    present = {"X", "COS", "SIN", "DY", "RSTD"} | ({"W"} if has_w else set()) | ({"REC"} if from_output else set())
    bwd = KernelCall(
        kernel=rope_kernels().rms_norm_rope_bwd_kernel,
        grid=(grid,),
        num_warps=num_warps,
        num_stages=1,
        inputs=ROPE_BWD_INPUTS,
        present_inputs=frozenset(present),
        scalar_names=ROPE_BWD_SCALARS,
        scalars=(_f32(opts.offset), M, n1, n2, *(s for triple in strides for s in triple)),
        outputs=ROPE_BWD_OUTPUTS,
        out_specs=out_specs,
        constexprs=dict(
            D=D,
            HAS_W=has_w,
            CASTING=int(opts.casting),
            INTERLEAVED=interleaved,
            COMPUTE_DX=grads.dx,
            COMPUTE_DW=grads.dw,
            FROM_Y=from_output,
            TABLE_RATIO=norm_math.ROPE_TABLE_RATIO,
            W_STRIDE=w_stride if has_w else 1,
            STRIDES_ALIGNED=_rope_strides_aligned(D, interleaved, strides,
                                                  (x_dtype, *table_dtypes, x_dtype, x_dtype)),
            BLOCK_M=block_m,
            BLOCK_D=block_d,
        ),
    )
    return bwd, _plan_reduce(D, grid, w_dtype if grads.dw else None, None)
