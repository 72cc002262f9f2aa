"""The Pallas implementation: ``pallas_call`` glue around ``normkit.kernels.norm_pallas`` (and, in the
last section, around ``normkit.kernels.rope_pallas`` for ``jax_frontend._rope``).

The two entry points of ``jax_frontend._implementation.Implementation``: ``forward`` and
``backward`` over 2-D rows, returning dicts keyed like ``Op.fwd_buffers`` and ``Op.bwd_buffers``;
``rms_norm_rope``'s ``rope_forward`` and ``rope_backward`` launch the same way, RMSNorm's launch
shapes for its rows of D. Launch shapes (rows per tile, warps, grid) come from
``normkit.launch.pallas_blocks`` and ``reduce_blocks``, the one place they are chosen. Launches:

- forward: one ``[BLOCK_M, BLOCK_N]`` row block per program, except LayerNorm on rows of >= 8192
  elements (>= 4096 in fp32): a persistent grid (``normkit.launch.pallas_persistent``);
- backward without dW/dB (frozen weight and bias): one row block per program (LayerNorm's 8192-wide
  rows: a persistent grid), no partial buffer, no reduction;
- backward with dW/dB: a persistent grid of about 1-2 programs per SM, each accumulating one fp32
  partial row over the tiles dealt to it round-robin (prefetching the next), then
  ``partial_sum_kernel`` sums the ``[G, N]`` partials column-wise in a fixed order: dW/dB are
  deterministic (no atomics).

Row arrays are passed whole (``pl.BlockSpec()``) and the kernels index their tiles, so one body
serves one-tile and persistent programs; weight and bias are one ``[BLOCK_N]`` block. Under
``vmap``, ``pallas_call``'s own batching rule adds a grid axis: one launch for the whole batch.

Interpret or compiled is chosen by the platform the computation is *lowered* for, through
``jax.lax.platform_dependent``: interpret mode on CPU, the compiled lowering elsewhere, so a
function traced once works under ``jit`` for either platform (both branches are traced; only the
one for the lowering platform is lowered).

Which GPU lowering (``GPU_LOWERING``, or the environment variable ``NORMKIT_PALLAS_LOWERING``)
---------------------------------------------------------------------------------------------
``"triton"`` (default): Pallas's Triton lowering. For a memory-bound row-wise norm it is the one
that fits: a whole row lives in registers of one program whose warp count we choose, loads and
stores are masked, so any N >= 1 works with a power-of-two block (N = 127, 4097, ...), and the code
it generates is the same shape as ``normkit.kernels.norm``'s, a memory-bound kernel whose timings
against a plain copy are in docs/PERFORMANCE_RECORD.md ("Forward kernels", "Backward kernels and the
frozen path"). What the JAX docs say for 0.11 (Pallas changelog, "Released with JAX 0.11.0"): "The
Triton backend is deprecated and will be removed in a future version of JAX. To keep using Pallas on
GPU, please migrate to the Mosaic GPU backend"; lowering it emits a ``DeprecationWarning``
("jax-pallas-triton"). It is still present and working in 0.11: tests/test_pallas_impl.py runs it
compiled on a CUDA GPU with jax 0.11.2. In 0.11 it does not need jax-triton: the Triton IR goes to
XLA's own Triton pipeline.

``"mosaic_gpu"``: not provided for these kernels. Mosaic GPU (the default GPU lowering of a bare
``pallas_call`` since ``jax_pallas_use_mosaic_gpu`` defaults to True) is the supported future, but
(1) in 0.11 reaching it through ``pl.pallas_call`` is itself deprecated ("Using pl.pallas_call for
Mosaic GPU kernels is deprecated ... Please migrate to plgpu.kernel"), (2) it stages blocks through
shared memory with TMA, which needs 16-byte-aligned row strides (N % 8 == 0 in bf16) and copies of
at most 256 elements a dimension (mosaic/gpu/launch_context.py), so odd N needs a padded copy and
long rows a [M, N / 256, 256] view, and it has no lowering for the masked loads used here, (3) its
row reductions need explicit register layouts (``plgpu.load(..., layout=...)``, warpgroup
tiling). It is a different kernel body, not a different lowering of this one. Selecting it raises
``NotImplementedError``.

Row indices are int32 (M < 2**31); the lowering itself switches element offsets to 64 bits for
arrays over 4 GiB.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_frontend import _compat, _launch
from jax_frontend._implementation import FORWARD_MODE_ERROR
from normkit import norm_math, record
from normkit.kernels import norm_pallas, rope_pallas
from normkit.launch import pallas_blocks, reduce_blocks
from normkit.ops import FINITE_MAX, MAX_N, OUTPUT_W_MIN, Grads, Op, Options
from normkit.rope import RMS_NORM_ROPE

LOWERINGS = ("triton", "mosaic_gpu")
GPU_LOWERING = os.environ.get("NORMKIT_PALLAS_LOWERING", "triton")  # read when a call is traced
NUM_SMS: int | None = None  # sizes the persistent grids (and the [G, N] partials); None: ask the device
PERSISTENT_LAYER_NORM = True  # LayerNorm's long rows as a persistent grid, where normkit.launch.pallas_persistent says


def blocks(op: Op, M: int, N: int, dtype, *, backward: bool = False, reduces: bool = False):
    """The launch shape of one pass (``normkit.launch.pallas_blocks``) on the default backend, as
    ``forward`` and ``backward`` launch it (the sweeps behind it: docs/PERFORMANCE_RECORD.md, "Pallas
    launch shapes and code")."""
    return pallas_blocks(op, M, N, elem_bytes=jnp.dtype(dtype).itemsize, num_sms=num_sms(), backward=backward,
                         reduces=reduces, persistent=None if PERSISTENT_LAYER_NORM else False)


# ---------------------------------------------------------------------------------------------
# Platform: interpret on CPU, compiled elsewhere, decided at lowering.


def num_sms() -> int:
    """The default backend's SM count (it sizes the [G, N] partials, a trace-time shape): the same
    number the Triton implementation plans with (INTERPRETER_NUM_SMS on CPU)."""
    if NUM_SMS is not None:
        return NUM_SMS
    return _launch.num_sms("cpu" if jax.default_backend() == "cpu" else "cuda")


def _compiler_params(num_warps: int, num_stages: int = 1):
    lowering = GPU_LOWERING
    if lowering == "triton":
        return _compat.pallas_triton().CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if lowering == "mosaic_gpu":
        raise NotImplementedError(
            "normkit: the Pallas kernels use masked loads (Pallas-Triton primitives) and have no Mosaic GPU "
            "variant; set jax_frontend._pallas.GPU_LOWERING = 'triton' (see the module docstring)")
    raise ValueError(f"normkit: unknown Pallas GPU lowering {lowering!r}; expected one of {LOWERINGS}")


def _run(launch, args):
    """``launch(interpret, *args)``: interpret mode when lowered for CPU, compiled otherwise.

    The kernels have no derivative of their own (the custom_vjp above them is their gradient): a
    derivative of the gradient (hessian, grad of grad) raises normkit's forward-mode error here, as
    the Triton implementation's primitives do, instead of failing inside Pallas's JVP rule."""

    @jax.custom_jvp
    def run(*args):
        return jax.lax.platform_dependent(*args, cpu=functools.partial(launch, True),
                                          default=functools.partial(launch, False))

    @run.defjvp
    def _(primals, tangents):
        raise TypeError(FORWARD_MODE_ERROR)

    return run(*args)


def _with_names(kernel, in_names, out_names, all_names):
    """A pallas_call body over the present refs that calls ``kernel`` with every ref by name (None if absent)."""

    def body(*refs):
        named = dict(zip(in_names + out_names, refs))
        kernel(**{name: named.get(name) for name in all_names})

    return body


def _record(kernel: functools.partial, grid: int, num_warps: int, partials: tuple = ()) -> None:
    """A launch record (normkit.record_launches), made when the call is traced."""
    if record.active():
        cpu = jax.default_backend() == "cpu"
        record.emit(record.Launch(kernel=kernel.func.__name__, frontend="jax-cpu" if cpu else "jax-gpu",
                                  grid=(grid,), num_warps=num_warps, flags=dict(kernel.keywords),
                                  partial_buffers=partials, interpreted=cpu, implementation="pallas"))


def _struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A pallas_call output that varies over the same shard_map axes as ``like`` (under shard_map's
    check_vma every output must say so; outside shard_map that is "none")."""
    return jax.ShapeDtypeStruct(shape, dtype, **_compat.varying_like(like))


_WHOLE = pl.BlockSpec()  # the whole array for every program (its tiles are indexed in the kernel)


def _col_block(block_n: int):
    return pl.BlockSpec((block_n,), lambda i: (0,))  # weight / bias: [BLOCK_N], columns past N masked


# ---------------------------------------------------------------------------------------------
# Entry points.


def forward(op: Op, x, residual, weight, bias, *, opts: Options, store_stats: bool, store_rec: bool = False) -> dict:
    """Y (and S, MEAN, RSTD, REC) for rows x [M, N]; keys exactly those of ``op.fwd_buffers``. REC, the
    weight's recovery, is computed from the weight and bias alone, in ``jax.numpy``."""
    out = _forward(op, x, residual, weight, bias, opts=opts, store_stats=store_stats)
    if store_rec:
        out["REC"] = norm_math.recovery_array(weight, bias, N=x.shape[1], x_dtype=x.dtype, offset=opts.offset,
                                              casting=opts.casting, xp=jnp)
    return out


def _forward(op: Op, x, residual, weight, bias, *, opts: Options, store_stats: bool) -> dict:
    M, N = x.shape
    assert 1 <= N <= MAX_N, N
    buffers = op.fwd_buffers(M, N, jnp.dtype(x.dtype).name, store_stats)
    cfg = blocks(op, M, N, x.dtype)
    inputs = {"x_ref": x, "r_ref": residual if op.has_residual else None, "w_ref": weight, "b_ref": bias}
    inputs = {k: v for k, v in inputs.items() if v is not None}
    in_spec = {"x_ref": _WHOLE, "r_ref": _WHOLE, "w_ref": _col_block(cfg.block_n), "b_ref": _col_block(cfg.block_n)}
    ref_of = {"Y": "y_ref", "S": "s_ref", "MEAN": "mean_ref", "RSTD": "rstd_ref"}
    kernel = functools.partial(
        norm_pallas.norm_fwd_kernel, M=M, N=N, eps=opts.eps, offset=opts.offset, IS_RMS=op.is_rms,
        HAS_RESIDUAL=op.has_residual, HAS_W=weight is not None, HAS_B=bias is not None,
        CASTING=int(opts.casting), STORE_STATS=store_stats, NUM_PROGRAMS=cfg.num_programs,
        TILES_PER_PROGRAM=cfg.tiles_per_program, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    _record(kernel, cfg.num_programs, cfg.num_warps)
    in_names, out_names = list(inputs), list(buffers)
    body = _with_names(kernel, in_names, [ref_of[n] for n in out_names],
                       ("x_ref", "r_ref", "w_ref", "b_ref", "y_ref", "s_ref", "mean_ref", "rstd_ref"))

    def launch(interpret, *args):
        return pl.pallas_call(
            body,
            out_shape=tuple(_struct(shape, dtype, x) for shape, dtype in buffers.values()),
            grid=(cfg.num_programs,),
            in_specs=[in_spec[n] for n in in_names],
            out_specs=tuple(_WHOLE for _ in out_names),
            interpret=interpret,
            compiler_params=None if interpret else _compiler_params(cfg.num_warps, cfg.num_stages),
            name=f"normkit_{op.name}_fwd",
        )(*args)

    return dict(zip(out_names, _run(launch, list(inputs.values()))))


def backward(op: Op, x, weight, dy, dres, mean, rstd, *, opts: Options, grads: Grads,
             b_dtype: str | None, bias=None, from_output: bool = False, rec=None) -> dict:
    """DX (with + dres for the fused op), DW, DB as ``grads`` asks; keys exactly those of ``op.bwd_buffers``.
    dW takes the weight's dtype, dB ``b_dtype``. ``from_output``: ``x`` is the forward's output y,
    ``bias`` the (frozen) bias and ``rec`` the forward's REC (see ``normkit.driver.backward``)."""
    M, N = x.shape
    w_dtype = jnp.dtype(weight.dtype).name if weight is not None else None
    assert 1 <= N <= MAX_N, N
    buffers = op.bwd_buffers(M, N, jnp.dtype(x.dtype).name, grads, w_dtype, b_dtype)
    if not buffers:
        return {}
    has_dres = dres is not None and grads.dx  # without dX it would not be read: leave it out
    cfg = blocks(op, M, N, x.dtype, backward=True, reduces=grads.reduces)
    G = cfg.num_programs
    bias = bias if from_output else None
    inputs = {"x_ref": x, "w_ref": weight, "b_ref": bias, "dy_ref": dy, "dres_ref": dres if has_dres else None,
              "mean_ref": None if op.is_rms or from_output else mean, "rstd_ref": rstd,
              "inv_ref": rec[:N] if from_output and weight is not None else None,
              "poison_ref": rec[N:] if from_output else None}
    inputs = {k: v for k, v in inputs.items() if v is not None}
    in_spec = {name: _WHOLE for name in inputs}
    in_spec["w_ref"] = in_spec["b_ref"] = in_spec["inv_ref"] = _col_block(cfg.block_n)
    part_row = pl.BlockSpec((None, cfg.block_n), lambda i: (i, 0))  # this program's row of the [G, N] partials
    outs = {}  # kernel ref name -> (ShapeDtypeStruct, BlockSpec)
    if grads.dx:
        outs["dx_ref"] = (_struct((M, N), x.dtype, x), _WHOLE)
    if grads.dw:
        outs["dw_part_ref"] = (_struct((G, N), jnp.float32, x), part_row)
    if grads.db:
        outs["db_part_ref"] = (_struct((G, N), jnp.float32, x), part_row)
    kernel = functools.partial(
        norm_pallas.norm_bwd_kernel, M=M, N=N, offset=opts.offset, IS_RMS=op.is_rms, HAS_W=weight is not None,
        HAS_B=bias is not None, HAS_DRES=has_dres, CASTING=int(opts.casting), COMPUTE_DX=grads.dx,
        COMPUTE_DW=grads.dw, COMPUTE_DB=grads.db, FROM_Y=from_output, NUM_PROGRAMS=G,
        TILES_PER_PROGRAM=cfg.tiles_per_program, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    _record(kernel, G, cfg.num_warps, tuple((name.upper().removesuffix("_REF"), (G, N), "float32")
                                            for name in outs if name.endswith("_part_ref")))
    in_names, out_names = list(inputs), list(outs)
    body = _with_names(kernel, in_names, out_names,
                       ("x_ref", "w_ref", "b_ref", "dy_ref", "dres_ref", "mean_ref", "rstd_ref", "inv_ref",
                        "poison_ref", "dx_ref", "dw_part_ref", "db_part_ref"))
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
        out = {"DX": res["dx_ref"]} if grads.dx else {}
        if red is not None:
            out.update(red(interpret, res.get("dw_part_ref"), res.get("db_part_ref")))
        return tuple(out[name] for name in buffers)

    return dict(zip(buffers, _run(launch, list(inputs.values()))))


def _reduce_call(G: int, N: int, buffers: dict):
    """``red(interpret, dw_part, db_part) -> {"DW": ..., "DB": ...}``: the fixed-order column sums."""
    has_dw, has_db = "DW" in buffers, "DB" in buffers
    block_g, block_n, num_warps = reduce_blocks(G, N)
    kernel = functools.partial(norm_pallas.partial_sum_kernel, G=G, N=N, HAS_DW=has_dw, HAS_DB=has_db,
                               BLOCK_G=block_g, BLOCK_N=block_n)
    in_names = ["dw_part_ref"] * has_dw + ["db_part_ref"] * has_db
    out_names = ["DW"] * has_dw + ["DB"] * has_db
    ref_of = {"DW": "dw_ref", "DB": "db_ref"}
    body = _with_names(kernel, in_names, [ref_of[n] for n in out_names],
                       ("dw_part_ref", "db_part_ref", "dw_ref", "db_ref"))
    col_block = pl.BlockSpec((block_n,), lambda j: (j,))
    _record(kernel, -(-N // block_n), num_warps)

    def red(interpret, dw_part, db_part):
        args = [a for a in (dw_part, db_part) if a is not None]
        res = pl.pallas_call(
            body,
            out_shape=tuple(_struct(*buffers[n], args[0]) for n in out_names),
            grid=(-(-N // block_n),),
            in_specs=[_WHOLE] * len(args),
            out_specs=tuple(col_block for _ in out_names),
            interpret=interpret,
            compiler_params=None if interpret else _compiler_params(num_warps),
            name="normkit_partial_sum",
        )(*args)
        return dict(zip(out_names, res))

    return red


# ---------------------------------------------------------------------------------------------
# rms_norm_rope (normkit.kernels.rope_pallas, called by jax_frontend._rope): rows [M, D] of x, the
# tables' rows [T, D] as stored, read through each x row's table row (the kernels' ``_table_rows``).


@dataclasses.dataclass(frozen=True)
class RopeRows:
    """How the flat rows of x reach the tables' rows (``normkit.rope.row_layout``): x's rows are
    ``r = (i0 * n1 + i1) * n2 + i2``, and row r reads table row ``i0 * t0 + i1 * t1 + i2 * t2``."""

    n1: int  # the sizes of the second and third row index
    n2: int
    table: tuple  # (t0, t1, t2): the tables' row strides over the three indices, in rows (0: broadcast)


def _rope_flags(rows: RopeRows, D: int, opts: Options, interleaved: bool, block_m: int, block_d: int,
                weight) -> dict:
    # At D = 2 the two pairings are one pair, (0, 1), with the same tables: rotate_half's. Interleaved,
    # the 2-column rows would be split into 1-column halves, a shape at which a frozen weight's forward
    # crashes (SIGSEGV) in the Triton compile of jax 0.11's Pallas GPU lowering.
    return dict(D=D, offset=opts.offset, ROWS=(rows.n1, rows.n2), TABLE_ROWS=rows.table, HAS_W=weight is not None,
                CASTING=int(opts.casting), INTERLEAVED=interleaved and D > 2, BLOCK_M=block_m, BLOCK_D=block_d)


def rope_forward(x, weight, cos, sin, rows: RopeRows, *, opts: Options, interleaved: bool, store_stats: bool,
                 store_rec: bool) -> dict:
    """Y [M, D] (and RSTD [M], REC [D + 1]) of ``rms_norm_rope`` over rows x [M, D], the tables
    cos/sin [T, D]: the keys of ``normkit.launch.plan_rope_forward``'s outputs."""
    assert store_stats or not store_rec
    M, D = x.shape
    cfg = blocks(RMS_NORM_ROPE, M, D, x.dtype)
    assert cfg.tiles_per_program == 1, cfg  # the forward: one tile per program
    name = jnp.dtype(x.dtype).name
    kernel = functools.partial(
        rope_pallas.rms_norm_rope_fwd_kernel, M=M, eps=opts.eps, STORE_STATS=store_stats, STORE_REC=store_rec,
        W_MIN=OUTPUT_W_MIN[name], BOUND_SCALE=norm_math.bound_scale(D, name), Y_MAX=FINITE_MAX[name],
        PAIR_RATIO=norm_math.ROPE_PAIR_RATIO, **_rope_flags(rows, D, opts, interleaved, cfg.block_m, cfg.block_n,
                                                            weight))
    _record(kernel, cfg.num_programs, cfg.num_warps)
    inputs = {k: v for k, v in {"x_ref": x, "w_ref": weight, "cos_ref": cos, "sin_ref": sin}.items() if v is not None}
    outs = {"Y": ("y_ref", (M, D), x.dtype)}
    if store_stats:
        outs["RSTD"] = ("rstd_ref", (M,), jnp.float32)
    if store_rec:
        outs["REC"] = ("rec_ref", (D + 1,), jnp.float32)
    in_names = list(inputs)
    body = _with_names(kernel, in_names, [ref for ref, _, _ in outs.values()],
                       ("x_ref", "w_ref", "cos_ref", "sin_ref", "y_ref", "rstd_ref", "rec_ref"))

    def launch(interpret, *args):
        return pl.pallas_call(
            body,
            out_shape=tuple(_struct(shape, dtype, x) for _, shape, dtype in outs.values()),
            grid=(cfg.num_programs,),
            in_specs=[_WHOLE] * len(in_names),
            out_specs=tuple(_WHOLE for _ in outs),
            interpret=interpret,
            compiler_params=None if interpret else _compiler_params(cfg.num_warps, cfg.num_stages),
            name="normkit_rms_norm_rope_fwd",
        )(*args)

    return dict(zip(outs, _run(launch, list(inputs.values()))))


def rope_backward(saved, weight, cos, sin, dy, rstd, rec, rows: RopeRows, *, opts: Options, interleaved: bool,
                  grads: Grads, from_output: bool) -> dict:
    """DX [M, D] and DW [D] of ``rms_norm_rope`` as ``grads`` asks, from rows ``saved`` [M, D]: the
    forward's input x, or (``from_output``, the weight frozen) its output, with its REC ``rec``. dW:
    a persistent grid whose programs each write one fp32 partial row, then ``partial_sum_kernel``."""
    assert not (from_output and grads.dw), "the output-saving backward computes dx alone"
    M, D = saved.shape
    cfg = blocks(RMS_NORM_ROPE, M, D, saved.dtype, backward=True, reduces=grads.dw)
    G = cfg.num_programs
    kernel = functools.partial(
        rope_pallas.rms_norm_rope_bwd_kernel, M=M, COMPUTE_DX=grads.dx, COMPUTE_DW=grads.dw, FROM_Y=from_output,
        TABLE_RATIO=norm_math.ROPE_TABLE_RATIO, NUM_PROGRAMS=G, TILES_PER_PROGRAM=cfg.tiles_per_program,
        **_rope_flags(rows, D, opts, interleaved, cfg.block_m, cfg.block_n, weight))
    _record(kernel, G, cfg.num_warps, (("DW_PART", (G, D), "float32"),) if grads.dw else ())
    inputs = {"x_ref": saved, "w_ref": weight, "cos_ref": cos, "sin_ref": sin, "dy_ref": dy, "rstd_ref": rstd,
              "rec_ref": rec if from_output else None}
    inputs = {k: v for k, v in inputs.items() if v is not None}
    outs = {}  # kernel ref name -> (ShapeDtypeStruct, BlockSpec)
    if grads.dx:
        outs["dx_ref"] = (_struct((M, D), saved.dtype, saved), _WHOLE)
    if grads.dw:  # this program's row of the [G, D] partials
        outs["dw_part_ref"] = (_struct((G, D), jnp.float32, saved), pl.BlockSpec((None, cfg.block_n), lambda i: (i, 0)))
    in_names, out_names = list(inputs), list(outs)
    body = _with_names(kernel, in_names, out_names,
                       ("x_ref", "w_ref", "cos_ref", "sin_ref", "dy_ref", "rstd_ref", "rec_ref", "dx_ref",
                        "dw_part_ref"))
    names = ["DX"] * grads.dx + ["DW"] * grads.dw
    red = _reduce_call(G, D, {"DW": ((D,), weight.dtype)}) if grads.dw else None

    def launch(interpret, *args):
        res = dict(zip(out_names, pl.pallas_call(
            body,
            out_shape=tuple(outs[n][0] for n in out_names),
            grid=(G,),
            in_specs=[_WHOLE] * len(in_names),
            out_specs=tuple(outs[n][1] for n in out_names),
            interpret=interpret,
            compiler_params=None if interpret else _compiler_params(cfg.num_warps, cfg.num_stages),
            name="normkit_rms_norm_rope_bwd",
        )(*args)))
        out = {"DX": res["dx_ref"]} if grads.dx else {}
        if red is not None:
            out.update(red(interpret, res["dw_part_ref"], None))
        return tuple(out[name] for name in names)

    return dict(zip(names, _run(launch, list(inputs.values()))))
