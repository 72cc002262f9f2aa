"""Launch plans: the one place where block sizes, warps, grids and partial counts are chosen.

Both frontends call these functions and then only allocate and launch, so a given shape runs the
same compiled kernel with the same configuration from Torch and from JAX.

A plan names every kernel parameter in the kernel's positional order (array inputs, runtime
scalars, outputs, constexprs). An input or output the variant does not use is *absent*: the Torch
frontend passes ``None`` for it, the JAX frontend a one-element dummy the kernel never touches.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any


from normkit import record
from normkit.kernels import norm_bwd_kernel, norm_fwd_kernel, partial_sum_kernel

MAX_N = 65536  # longest supported row; one row must fit one program's registers
CASTING_MODES = {"none": 0, "llama": 1, "gemma": 2}
OPS = ("rms_norm", "layer_norm", "fused_add_rms_norm")

FWD_INPUTS = ("X", "R", "W", "B")
FWD_SCALARS = ("eps", "offset", "M", "stride_x", "stride_r", "stride_y")
FWD_OUTPUTS = ("Y", "S", "MEAN", "RSTD")
BWD_INPUTS = ("X", "W", "DY", "DRES", "MEAN", "RSTD")
BWD_SCALARS = ("offset", "M", "stride_x", "stride_dy", "stride_dres")
BWD_OUTPUTS = ("DX", "DW_PART", "DB_PART")
RED_INPUTS = ("DW_PART", "DB_PART")
RED_SCALARS = ("G",)
RED_OUTPUTS = ("DW", "DB")
FLOAT_SCALARS = frozenset({"eps", "offset"})  # passed as float32; every other scalar is an int

_POISON = [False]


@contextlib.contextmanager
def poisoned_outputs():
    """Testing aid: frontends fill every output buffer with NaN before the launch, so an element
    the kernel fails to write shows up as NaN."""
    _POISON.append(True)
    try:
        yield
    finally:
        _POISON.pop()


def poison() -> bool:
    return _POISON[-1]


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """Everything a frontend needs to launch one kernel."""

    kernel: Any  # the @triton.jit function
    grid: tuple[int, ...]
    num_warps: int
    num_stages: int
    inputs: tuple[str, ...]  # positional array inputs, in kernel order
    present_inputs: frozenset  # the inputs this variant reads
    scalars: tuple[tuple[str, Any], ...]  # (name, value), in kernel order
    outputs: tuple[str, ...]  # positional outputs, in kernel order
    out_specs: dict  # name -> (shape, dtype name) for each output this variant writes
    constexprs: dict
    fp_fusion: bool = True  # Triton's enable_fp_fusion (FMA contraction); pass it to the launcher

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else self.kernel.__name__

    def record(self, frontend: str, interpreted: bool) -> None:
        if not record.active():
            return
        partials = tuple(
            (name, tuple(shape), dtype) for name, (shape, dtype) in self.out_specs.items() if name.endswith("_PART")
        )
        record.emit(
            record.Launch(
                kernel=self.name,
                frontend=frontend,
                grid=self.grid,
                num_warps=self.num_warps,
                flags=dict(self.constexprs),
                partial_buffers=partials,
                interpreted=interpreted,
            )
        )


def _memoized(plan):
    """Plans are pure functions of hashable keyword arguments (``strides`` as a dict): memoize them,
    since per-call host time matters at small shapes. Callers must not mutate a returned plan."""
    cached = functools.lru_cache(maxsize=4096)(
        lambda key: plan(**{k: dict(v) if k == "strides" and v is not None else v for k, v in key}))

    @functools.wraps(plan)
    def wrapper(**kwargs):
        strides = kwargs.get("strides")
        if strides is not None:
            kwargs["strides"] = tuple(strides.items())
        return cached(tuple(kwargs.items()))  # call sites pass keywords in a fixed order

    wrapper.cache_info = cached.cache_info
    return wrapper


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Measured on an H200 (scripts/tune.py, bf16, kernel-only medians; notes in benchmarks/NOTES.md):
# - 4 warps per 4096-element tile, 8 per 8192, 16 per 16384: about 8-16 elements per thread;
# - short rows: several rows per tile (4096 // BLOCK_N), so one program still moves a useful amount;
# - RMSNorm forward and every dx-only backward: one program per tile, no pipelining (93-100% of copy);
# - LayerNorm forward (two dependent reductions per row): a persistent grid of 2-4 programs per SM
#   with the next tiles prefetched (LOOP_STAGES=3): 71% -> 84% of copy at 8192x8192;
# - dW/dB backward: one (tile >= 8192) or two programs per SM, each accumulating one fp32 partial row,
#   with the next tiles prefetched (3-4 stages): 66% -> 85-92% of copy in bf16.
SMEM_BUDGET = 160 * 1024  # bytes of shared memory the prefetched tiles may take (H100/H200: 228 KB per SM)


@functools.lru_cache(maxsize=None)
def tile_config(M: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a row-wise pass over an M x N tensor."""
    block_n = _next_pow2(N)
    block_m = max(1, min(16, 4096 // block_n, _next_pow2(max(M, 1))))
    num_warps = min(32, max(4, block_m * block_n // 1024))
    return block_m, block_n, num_warps


def _stages(block_m: int, block_n: int, elem_bytes: int, streams: int, want: int) -> int:
    """Pipelining depth: ``want``, or fewer when that many prefetched tiles overflow shared memory."""
    per_stage = block_m * block_n * elem_bytes * streams
    return max(1, min(want, SMEM_BUDGET // per_stage))


_ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _contiguous(M: int, N: int, strides: dict) -> bool:
    return M <= 1 or all(s == N for s in strides.values())


@_memoized
def plan_forward(
    *,
    op: str,
    M: int,
    N: int,
    x_dtype: str,
    has_w: bool,
    has_b: bool,
    eps: float,
    offset: float = 0.0,
    casting: str = "gemma",
    store_stats: bool,
    strides: dict | None = None,
    num_sms: int | None = None,
) -> KernelCall:
    """The forward launch. ``strides`` maps stride_x/stride_r/stride_y to row strides (default N);
    ``num_sms`` (the device's SM count) enables the persistent LayerNorm variant."""
    is_rms = op != "layer_norm"
    has_res = op == "fused_add_rms_norm"
    strides = {"stride_x": N, "stride_r": N, "stride_y": N, **(strides or {})}
    block_m, block_n, num_warps = tile_config(M, N)
    tiles = -(-M // block_m)
    grid, stages = tiles, 1
    if not is_rms and num_sms:
        stages = _stages(block_m, block_n, _ELEM_BYTES[x_dtype], 1, 3)
        if stages > 1:
            grid = min(tiles, (4 if block_m * block_n <= 4096 else 2) * num_sms)
    out_specs = {"Y": ((M, N), x_dtype)}
    if has_res:
        out_specs["S"] = ((M, N), x_dtype)
    if store_stats:
        out_specs["RSTD"] = ((M,), "float32")
        if not is_rms:
            out_specs["MEAN"] = ((M,), "float32")
    present = {"X"} | ({"R"} if has_res else set()) | ({"W"} if has_w else set()) | ({"B"} if has_b else set())
    scalars = {"eps": eps, "offset": offset, "M": M, **strides}
    return KernelCall(
        kernel=norm_fwd_kernel,
        grid=(grid,),
        num_warps=num_warps,
        num_stages=1,
        inputs=FWD_INPUTS,
        present_inputs=frozenset(present),
        scalars=tuple((name, scalars[name]) for name in FWD_SCALARS),
        outputs=FWD_OUTPUTS,
        out_specs=out_specs,
        constexprs=dict(
            N=N,
            IS_RMS=is_rms,
            HAS_RESIDUAL=has_res,
            HAS_W=has_w,
            HAS_B=has_b,
            CASTING=CASTING_MODES[casting],
            STORE_STATS=store_stats,
            ROWS_CONTIGUOUS=_contiguous(M, N, strides),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            LOOP_STAGES=stages,
        ),
    )


def num_partials(M: int, N: int, num_sms: int) -> int:
    """Programs (hence fp32 partial rows) of a backward that reduces dW/dB."""
    block_m, block_n, _ = tile_config(M, N)
    tiles = -(-M // block_m)
    return max(1, min(tiles, (1 if block_m * block_n >= 8192 else 2) * num_sms))


@_memoized
def plan_backward(
    *,
    op: str,
    M: int,
    N: int,
    x_dtype: str,
    has_w: bool,
    has_dres: bool,
    offset: float = 0.0,
    casting: str = "gemma",
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
    num_sms: int,
    strides: dict | None = None,
) -> KernelCall:
    """The backward launch. Without dW/dB there are no partials and one program per tile."""
    is_rms = op != "layer_norm"
    strides = {"stride_x": N, "stride_dy": N, "stride_dres": N, **(strides or {})}
    block_m, block_n, num_warps = tile_config(M, N)
    tiles = -(-M // block_m)
    reduces = compute_dw or compute_db
    grid = num_partials(M, N, num_sms) if reduces else tiles
    stages = 1
    if reduces:
        streams = 2 + (1 if has_dres else 0)  # x and dy (and d_residual) are prefetched
        stages = _stages(block_m, block_n, _ELEM_BYTES[x_dtype], streams, 4 if block_m * block_n >= 8192 else 3)
    out_specs = {}
    if compute_dx:
        out_specs["DX"] = ((M, N), x_dtype)
    if compute_dw:
        out_specs["DW_PART"] = ((grid, N), "float32")
    if compute_db:
        out_specs["DB_PART"] = ((grid, N), "float32")
    present = {"X", "DY", "RSTD"} | ({"W"} if has_w else set())
    present |= {"DRES"} if has_dres else set()
    present |= set() if is_rms else {"MEAN"}
    scalars = {"offset": offset, "M": M, **strides}
    return KernelCall(
        # LayerNorm's dx = rstd * (g - mean(g) - ...): contracting g = dy * w into an FMA with the
        # subtraction leaves g's rounding error amplified by rstd where it should cancel exactly.
        fp_fusion=is_rms,
        kernel=norm_bwd_kernel,
        grid=(grid,),
        num_warps=num_warps,
        num_stages=1,
        inputs=BWD_INPUTS,
        present_inputs=frozenset(present),
        scalars=tuple((name, scalars[name]) for name in BWD_SCALARS),
        outputs=BWD_OUTPUTS,
        out_specs=out_specs,
        constexprs=dict(
            N=N,
            IS_RMS=is_rms,
            HAS_W=has_w,
            HAS_DRES=has_dres,
            CASTING=CASTING_MODES[casting],
            COMPUTE_DX=compute_dx,
            COMPUTE_DW=compute_dw,
            COMPUTE_DB=compute_db,
            ROWS_CONTIGUOUS=_contiguous(M, N, strides),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            LOOP_STAGES=stages,
        ),
    )


def plan_reduce(bwd: KernelCall, *, w_dtype: str | None, b_dtype: str | None) -> KernelCall | None:
    """The column sum of a backward's partials into dW/dB, or None when it wrote none."""
    has_dw = "DW_PART" in bwd.out_specs
    has_db = "DB_PART" in bwd.out_specs
    if not (has_dw or has_db):
        return None
    N = bwd.constexprs["N"]
    G = bwd.grid[0]
    block_n = min(_next_pow2(N), 64)
    block_g = min(_next_pow2(G), 32)
    out_specs = {}
    if has_dw:
        out_specs["DW"] = ((N,), w_dtype)
    if has_db:
        out_specs["DB"] = ((N,), b_dtype)
    present = ({"DW_PART"} if has_dw else set()) | ({"DB_PART"} if has_db else set())
    return KernelCall(
        kernel=partial_sum_kernel,
        grid=(-(-N // block_n),),
        num_warps=4 if block_g * block_n >= 1024 else 1,
        num_stages=1,
        inputs=RED_INPUTS,
        present_inputs=frozenset(present),
        scalars=(("G", G),),
        outputs=RED_OUTPUTS,
        out_specs=out_specs,
        constexprs=dict(N=N, HAS_DW=has_dw, HAS_DB=has_db, BLOCK_G=block_g, BLOCK_N=block_n),
    )


def _check_signatures() -> None:
    """The name tables above must follow the kernels' positional order."""
    for kernel, names in (
        (norm_fwd_kernel, FWD_INPUTS + FWD_SCALARS + FWD_OUTPUTS),
        (norm_bwd_kernel, BWD_INPUTS + BWD_SCALARS + BWD_OUTPUTS),
        (partial_sum_kernel, RED_INPUTS + RED_SCALARS + RED_OUTPUTS),
    ):
        assert tuple(kernel.arg_names[: len(names)]) == names, (kernel.arg_names, names)


_check_signatures()
