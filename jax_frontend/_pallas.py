"""The Pallas implementation: ``pallas_call`` glue around ``normkit.kernels.norm_pallas``.

Two entry points with the interface every implementation provides (see ``jax_frontend._xla``):
``forward`` and ``backward`` over 2-D rows, returning dicts keyed like ``Op.fwd_buffers`` and
``Op.bwd_buffers``. Launches:

- forward: one ``[BLOCK_M, BLOCK_N]`` row block per program, blocked BlockSpecs;
- backward without dW/dB (frozen weight and bias): one row block per program, no partial buffer,
  no reduction;
- backward with dW/dB: a persistent grid of about 1-2 programs per SM, each accumulating one fp32
  partial row over the tiles dealt to it round-robin, then ``partial_sum_kernel`` sums the
  ``[G, N]`` partials column-wise in a fixed order: dW/dB are deterministic (no atomics).

Interpret or compiled is chosen by the platform the computation is *lowered* for, through
``jax.lax.platform_dependent``: interpret mode on CPU, the compiled lowering elsewhere, so a
function traced once works under ``jit`` for either platform (both branches are traced; only the
one for the lowering platform is lowered).

Which GPU lowering (``GPU_LOWERING``, or the environment variable ``NORMKIT_PALLAS_LOWERING``)
---------------------------------------------------------------------------------------------
``"triton"`` (default): Pallas's Triton lowering. For a memory-bound row-wise norm it is the one
that fits: a whole row lives in registers of one program whose warp count we choose, loads and
stores are masked, so any N >= 1 works with a power-of-two block (N = 127, 4097, ...), and the code
it generates is the same shape as ``normkit.kernels.norm``'s, which measures 93-100% of copy
bandwidth on the H200 (benchmarks/NOTES.md). What the JAX docs say for 0.11 (Pallas changelog,
"Released with JAX 0.11.0"): "The Triton backend is deprecated and will be removed in a future
version of JAX. To keep using Pallas on GPU, please migrate to the Mosaic GPU backend"; lowering
it emits a ``DeprecationWarning`` ("jax-pallas-triton"). It is still present and working in 0.11.

``"mosaic_gpu"``: not provided for these kernels. Mosaic GPU (the default GPU lowering of a bare
``pallas_call`` since ``jax_pallas_use_mosaic_gpu`` defaults to True) is the supported future, but
(1) in 0.11 reaching it through ``pl.pallas_call`` is itself deprecated ("Using pl.pallas_call for
Mosaic GPU kernels is deprecated ... Please migrate to plgpu.kernel"), (2) it stages blocks through
shared memory with TMA, which needs 16-byte-aligned row strides (N % 8 == 0 in bf16) and boxes of at
most 256 elements a dimension, so odd N needs a padded copy, and it has no masked loads, (3) its
row reductions need explicit register layouts (``plgpu.load(..., layout=...)``, warpgroup
tiling). It is a different kernel body, not a different lowering of this one; see the report that
came with this module for what a port would take. Selecting it raises ``NotImplementedError``.

Note: the compiled Triton path computes offsets in int32, like Pallas-Triton does: M * N must stay
below 2**31 elements per array.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from normkit.kernels import norm_pallas
from normkit.ops import MAX_N, Grads, Op, Options

LOWERINGS = ("triton", "mosaic_gpu")
GPU_LOWERING = os.environ.get("NORMKIT_PALLAS_LOWERING", "triton")  # read when a call is traced
NUM_SMS: int | None = None  # programs of the dW/dB backward are sized from this; None: ask the device
CPU_NUM_SMS = 4  # the "SM" count on CPU (interpret mode): a few partial rows, so the loop is exercised


# ---------------------------------------------------------------------------------------------
# Block-size heuristic: the one place where Pallas launch shapes are chosen (to move into
# normkit/launch.py next to the Triton plans).


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


SMEM_BUDGET = 160 * 1024  # bytes of shared memory that prefetched tiles may take (H100/H200: 228 KB per SM)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    block_m: int  # rows per tile
    block_n: int  # next power of two >= N
    num_warps: int  # warps per program (Triton lowering)
    num_programs: int  # grid size
    tiles_per_program: int  # tiles each program walks (1: one row block per program)
    num_stages: int  # software-pipelining depth of the tile loop (Triton lowering)


@functools.lru_cache(maxsize=4096)
def block_config(M: int, N: int, *, elem_bytes: int, reduces: bool = False, streams: int = 2,
                 num_sms: int = 132) -> BlockConfig:
    """Launch shape of a row-wise pass over M x N (``reduces``: a backward with dW/dB partials).

    The same choices as ``normkit.launch`` (measured on an H200 for the Triton kernels):
    - a tile of BLOCK_M rows x BLOCK_N (next power of two >= N) columns, ~4096 elements, with
      about 8-16 elements per thread (4 warps per 4096, 8 per 8192, 16 per 16384, up to 32);
    - forward and dx-only backward: one tile per program, no pipelining;
    - dW/dB backward: min(tiles, 1 program per SM for tiles >= 8192 elements, else 2), each walking
      its tiles with the next ones prefetched (3-4 stages, fewer when ``streams`` prefetched
      tiles of ``elem_bytes`` would overflow shared memory).
    """
    block_n = _next_pow2(N)
    block_m = max(1, min(16, 4096 // block_n, _next_pow2(max(M, 1))))
    num_warps = min(32, max(4, block_m * block_n // 1024))
    tiles = -(-M // block_m)
    if not reduces:
        return BlockConfig(block_m, block_n, num_warps, tiles, 1, 1)
    big = block_m * block_n >= 8192
    programs = max(1, min(tiles, (1 if big else 2) * num_sms))
    per_stage = block_m * block_n * elem_bytes * streams
    stages = max(1, min(4 if big else 3, SMEM_BUDGET // per_stage))
    return BlockConfig(block_m, block_n, num_warps, programs, -(-tiles // programs), stages)


def reduce_config(G: int, N: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_N) of the partial-sum reduction: 64 columns per program, 32 partial rows a step."""
    return min(_next_pow2(G), 32), min(_next_pow2(N), 64)


# ---------------------------------------------------------------------------------------------
# Platform: interpret on CPU, compiled elsewhere, decided at lowering.


def _num_sms() -> int:
    if NUM_SMS is not None:
        return NUM_SMS
    return _default_num_sms()


@functools.lru_cache(maxsize=None)
def _default_num_sms() -> int:
    """The default device's SM count (it sizes the [G, N] partials, a trace-time shape)."""
    for device in jax.devices():
        cores = getattr(device, "core_count", None)
        if device.platform != "cpu" and cores:
            return int(cores)
    return CPU_NUM_SMS


def _compiler_params(cfg_warps: int, stages: int):
    lowering = GPU_LOWERING
    if lowering == "triton":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=cfg_warps, num_stages=stages)
    if lowering == "mosaic_gpu":
        raise NotImplementedError(
            "normkit: the Pallas kernels use masked loads (Pallas-Triton primitives) and have no Mosaic GPU "
            "variant; set jax_frontend._pallas.GPU_LOWERING = 'triton' (see the module docstring)")
    raise ValueError(f"normkit: unknown Pallas GPU lowering {lowering!r}; expected one of {LOWERINGS}")


def _run(launch, args):
    """``launch(interpret, *args)``: interpret mode when lowered for CPU, compiled otherwise."""
    return jax.lax.platform_dependent(*args, cpu=functools.partial(launch, True),
                                      default=functools.partial(launch, False))


def _with_names(kernel, in_names, out_names, all_names):
    """A pallas_call body over the present refs that calls ``kernel`` with every ref by name (None if absent)."""

    def body(*refs):
        named = dict(zip(in_names + out_names, refs))
        kernel(**{name: named.get(name) for name in all_names})

    return body


_WHOLE = pl.BlockSpec()  # the whole array for every program (its tiles are indexed in the kernel)


# ---------------------------------------------------------------------------------------------
# Entry points.


def forward(op: Op, x, residual, weight, bias, *, opts: Options, store_stats: bool) -> dict:
    """Y (and S, MEAN, RSTD) for rows x [M, N]; keys exactly those of ``op.fwd_buffers``."""
    M, N = x.shape
    assert 1 <= N <= MAX_N, N
    x_dtype = jnp.dtype(x.dtype).name
    cfg = block_config(M, N, elem_bytes=jnp.dtype(x.dtype).itemsize)
    bm, bn = cfg.block_m, cfg.block_n
    buffers = op.fwd_buffers(M, N, x_dtype, store_stats)
    has_w, has_b = weight is not None, bias is not None
    inputs = {"x_ref": x, "r_ref": residual if op.has_residual else None, "w_ref": weight, "b_ref": bias}
    inputs = {k: v for k, v in inputs.items() if v is not None}
    row_block = pl.BlockSpec((bm, bn), lambda i: (i, 0))
    col_block = pl.BlockSpec((bn,), lambda i: (0,))
    stat_block = pl.BlockSpec((bm,), lambda i: (i,))
    in_spec = {"x_ref": row_block, "r_ref": row_block, "w_ref": col_block, "b_ref": col_block}
    ref_of = {"Y": "y_ref", "S": "s_ref", "MEAN": "mean_ref", "RSTD": "rstd_ref"}
    out_spec = {"Y": row_block, "S": row_block, "MEAN": stat_block, "RSTD": stat_block}
    kernel = functools.partial(
        norm_pallas.norm_fwd_kernel, M=M, N=N, eps=opts.eps, offset=opts.offset, IS_RMS=op.is_rms,
        HAS_RESIDUAL=op.has_residual, HAS_W=has_w, HAS_B=has_b, CASTING=int(opts.casting),
        STORE_STATS=store_stats, BLOCK_M=bm, BLOCK_N=bn)
    in_names = list(inputs)
    out_names = list(buffers)
    body = _with_names(kernel, in_names, [ref_of[n] for n in out_names],
                       ("x_ref", "r_ref", "w_ref", "b_ref", "y_ref", "s_ref", "mean_ref", "rstd_ref"))

    def launch(interpret, *args):
        return pl.pallas_call(
            body,
            out_shape=tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in buffers.values()),
            grid=(cfg.num_programs,),
            in_specs=[in_spec[n] for n in in_names],
            out_specs=tuple(out_spec[n] for n in out_names),
            interpret=interpret,
            compiler_params=None if interpret else _compiler_params(cfg.num_warps, 1),
            name=f"normkit_{op.name}_fwd",
        )(*args)

    outs = _run(launch, list(inputs.values()))
    return dict(zip(out_names, outs))


def backward(op: Op, x, weight, dy, dres, mean, rstd, *, opts: Options, grads: Grads,
             w_dtype: str | None, b_dtype: str | None) -> dict:
    """DX (with + dres for the fused op), DW, DB as ``grads`` asks; keys exactly those of ``op.bwd_buffers``."""
    M, N = x.shape
    assert 1 <= N <= MAX_N, N
    x_dtype = jnp.dtype(x.dtype).name
    buffers = op.bwd_buffers(M, N, x_dtype, grads, w_dtype, b_dtype)
    if not buffers:
        return {}
    has_w = weight is not None
    has_dres = dres is not None and grads.dx  # without dX it would not be read: leave it out
    streams = 2 + has_dres
    cfg = block_config(M, N, elem_bytes=jnp.dtype(x.dtype).itemsize, reduces=grads.reduces, streams=streams,
                       num_sms=_num_sms())
    bm, bn, G = cfg.block_m, cfg.block_n, cfg.num_programs
    inputs = {"x_ref": x, "w_ref": weight, "dy_ref": dy, "dres_ref": dres if has_dres else None,
              "mean_ref": None if op.is_rms else mean, "rstd_ref": rstd}
    inputs = {k: v for k, v in inputs.items() if v is not None}
    col_block = pl.BlockSpec((bn,), lambda i: (0,))
    part_row = pl.BlockSpec((None, bn), lambda i: (i, 0))  # this program's row of the [G, N] partials
    in_spec = {"x_ref": _WHOLE, "w_ref": col_block, "dy_ref": _WHOLE, "dres_ref": _WHOLE, "mean_ref": _WHOLE,
               "rstd_ref": _WHOLE}
    outs = {}  # kernel ref name -> (ShapeDtypeStruct, BlockSpec)
    if grads.dx:
        outs["dx_ref"] = (jax.ShapeDtypeStruct((M, N), x.dtype), _WHOLE)
    if grads.dw:
        outs["dw_part_ref"] = (jax.ShapeDtypeStruct((G, N), jnp.float32), part_row)
    if grads.db:
        outs["db_part_ref"] = (jax.ShapeDtypeStruct((G, N), jnp.float32), part_row)
    kernel = functools.partial(
        norm_pallas.norm_bwd_kernel, M=M, N=N, offset=opts.offset, IS_RMS=op.is_rms, HAS_W=has_w,
        HAS_DRES=has_dres, CASTING=int(opts.casting), COMPUTE_DX=grads.dx, COMPUTE_DW=grads.dw,
        COMPUTE_DB=grads.db, NUM_PROGRAMS=G, TILES_PER_PROGRAM=cfg.tiles_per_program, BLOCK_M=bm, BLOCK_N=bn)
    in_names, out_names = list(inputs), list(outs)
    body = _with_names(kernel, in_names, out_names,
                       ("x_ref", "w_ref", "dy_ref", "dres_ref", "mean_ref", "rstd_ref", "dx_ref", "dw_part_ref",
                        "db_part_ref"))
    red = _reduce_call(G, N, buffers) if grads.reduces else None

    def launch(interpret, *args):
        res = pl.pallas_call(
            body,
            out_shape=tuple(outs[n][0] for n in out_names),
            grid=(G,),
            in_specs=[in_spec[n] for n in in_names],
            out_specs=tuple(outs[n][1] for n in out_names),
            interpret=interpret,
            compiler_params=None if interpret else _compiler_params(cfg.num_warps, cfg.num_stages),
            name=f"normkit_{op.name}_bwd",
        )(*args)
        res = dict(zip(out_names, res))
        out = {}
        if grads.dx:
            out["DX"] = res["dx_ref"]
        if red is not None:
            out.update(red(interpret, res.get("dw_part_ref"), res.get("db_part_ref")))
        return tuple(out[name] for name in buffers)

    return dict(zip(buffers, _run(launch, list(inputs.values()))))


def _reduce_call(G: int, N: int, buffers: dict):
    """``red(interpret, dw_part, db_part) -> {"DW": ..., "DB": ...}``: the fixed-order column sums."""
    has_dw, has_db = "DW" in buffers, "DB" in buffers
    block_g, block_n = reduce_config(G, N)
    kernel = functools.partial(norm_pallas.partial_sum_kernel, G=G, N=N, HAS_DW=has_dw, HAS_DB=has_db,
                               BLOCK_G=block_g, BLOCK_N=block_n)
    in_names = ["dw_part_ref"] * has_dw + ["db_part_ref"] * has_db
    out_names = ["DW"] * has_dw + ["DB"] * has_db
    ref_of = {"DW": "dw_ref", "DB": "db_ref"}
    body = _with_names(kernel, in_names, [ref_of[n] for n in out_names],
                       ("dw_part_ref", "db_part_ref", "dw_ref", "db_ref"))
    col_block = pl.BlockSpec((block_n,), lambda j: (j,))

    def red(interpret, dw_part, db_part):
        args = [a for a in (dw_part, db_part) if a is not None]
        res = pl.pallas_call(
            body,
            out_shape=tuple(jax.ShapeDtypeStruct(*buffers[n]) for n in out_names),
            grid=(-(-N // block_n),),
            in_specs=[_WHOLE] * len(args),
            out_specs=tuple(col_block for _ in out_names),
            interpret=interpret,
            compiler_params=None if interpret else _compiler_params(4 if block_g * block_n >= 1024 else 1, 1),
            name="normkit_partial_sum",
        )(*args)
        return dict(zip(out_names, res))

    return red
