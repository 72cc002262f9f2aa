"""Inputs whose sharding XLA's partitioner chooses (Auto mesh axes, or no mesh): a sharding rule for it.

``PartitionedImpl`` runs each pass of an op (``_rows.Pass``) as one primitive, ``normkit_rows``,
over arrays of the caller's shape ``(..., N)``; every call takes it except those ``_shard_map``
takes (rows split over Explicit mesh axes). Under ``jit`` on one device it lowers to the
implementation's kernels as they are. When the computation is partitioned over several devices
(inputs placed with a ``NamedSharding`` on a mesh whose axes are Auto: ``jax.sharding.Mesh``'s
default, Flax and most training code; host arrays placed by ``jit(in_shardings=...)``), it lowers
through ``jax.experimental.custom_partitioning``. Where x's type already places it on a mesh with
Explicit axes (replicated arrays made after ``jax.set_mesh``; a vmapped call whose batch axis is
split), the placement is known and the pass lowers through ``_shard_map.ShardedImpl`` instead, with
no rule to consult. The rule:

- the Shardy sharding rule (``sharding_rule``) says what the op is to the partitioner's
  propagation: row buffers ``"... n"``, statistics ``"..."``, weight, bias, dW and dB ``"n"``, with
  ``n`` never sharded (``need_replication_factors``). Shardy is the default partitioner in jax 0.10
  and 0.11; ``infer_sharding_from_operands`` answers the same for the older GSPMD propagation;
- ``partition`` keeps x's sharding of the leading dimensions for every row buffer and statistic,
  asks for the weight and bias whole (a weight sharded along N, FSDP-style, is all-gathered: a
  vector of N, never the activation), and returns the per-device computation: the same primitive
  on the device's rows, then ``psum`` of dW/dB over exactly the mesh axes the rows are split on.
  A frozen parameter's gradient is not computed, so nothing is reduced;
- neither callback raises, whatever sharding it is handed. Under the GSPMD partitioner
  (``jax_use_shardy_partitioner=False``) jaxlib CHECKs the status of ``infer_sharding_from_operands``,
  so a Python exception there aborts the whole process (SIGABRT; jax 0.10.2, and XLA's
  ``custom_partition_callback.cc`` keeps the check); one from ``partition`` comes back as a
  ``JaxRuntimeError`` under both partitioners. So an x that arrives split along its normalized
  (last) dimension (constrained to ``P(..., "sp")`` under ``jit``, or committed so) is given a
  placement with that dimension whole: both partitioners then gather it (an all-gather of the
  activation before the op) and the op runs on whole rows, correctly, and ``partition`` logs a
  warning naming x's sharding and the remedy. An operand without a sharding yet counts as
  replicated; in a program without a mesh (x placed by a ``GSPMDSharding``) the op runs whole on
  every device, also with a warning.

Where the sharding is known before compilation the placement is refused instead, with a
``ValueError`` naming x, its sharding and what to do: in x's type (Explicit axes:
``_shard_map.placed``, at trace time), and on a committed array outside ``jit`` (``_eager``, before
the primitive is compiled). Under ``jit`` with Auto axes the sharding is in no type, so only the
partitioner sees it, and gathering is the one answer it can give.

Why ``custom_partitioning``: with Auto axes the sharding is chosen after tracing and is not in any
type, so the op cannot state its partition itself (as ``_shard_map`` does for Explicit axes); only
a rule that the partitioner calls can keep it per device. It is bound in the primitive's lowering,
not when tracing, so ``vmap``, ``scan`` and ``jax.checkpoint`` see an ordinary primitive.

On CPU the Triton implementation's kernels run in Triton's interpreter from a host callback. One
lowered inside the per-device computation would not survive compilation (see
``_launch.routed_host_callbacks``), so on CPU the enclosing module registers one dispatcher while it
is lowered and the per-device launches call it.

``vmap`` folds its batch axis into the leading dimensions (one partitioned launch), except where
folding would change the result: a batched weight or bias, and a backward that reduces dW/dB (vmap
wants one per batch element). Those run the implementation's own ``vmap`` rule, unpartitioned.
Outside ``jit``, a call on arrays spread over several devices compiles the primitive alone, so it
runs per device too.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_frontend import _compat, _launch, _rows, _shard_map
from jax_frontend._implementation import FORWARD_MODE_ERROR, Implementation
from jax_frontend._rows import COLUMN, LAYOUT, REPLICA, ROW, STAT, Pass
from normkit.ops import Grads, Op, Options

_log = logging.getLogger(__name__)

rows_p = _compat.new_primitive("normkit_rows")


@dataclasses.dataclass(frozen=True)
class PartitionedImpl:
    """``_implementation.Implementation`` over arrays of the caller's shape; ``base`` runs on rows."""

    base: Implementation

    def forward(self, op: Op, x, residual, weight, bias, *, opts: Options, store_stats: bool,
                store_rec: bool = False) -> dict:
        names, arrays = Pass.present(_rows.FWD_INPUTS, (x, residual, weight, bias))
        return _bind(Pass(self.base, op, opts, names, store_stats=store_stats, store_rec=store_rec), arrays)

    def backward(self, op: Op, x, weight, dy, dres, mean, rstd, *, opts: Options, grads: Grads,
                 b_dtype: str | None, bias=None, from_output: bool = False, rec=None) -> dict:
        names, arrays = Pass.present(_rows.BWD_INPUTS, (x, weight, bias if from_output else None, dy, dres, mean,
                                                        rstd, rec if from_output else None))
        return _bind(Pass(self.base, op, opts, names, grads=grads, b_dtype=b_dtype, from_output=from_output), arrays)


def _bind(pass_: Pass, arrays) -> dict:
    return dict(zip(pass_.outputs, rows_p.bind(*arrays, pass_=pass_, route=None)))


# ---------------------------------------------------------------------------------------------
# The primitive: shapes, eager calls, differentiation, vmap.


def _abstract(*avals, pass_: Pass, route):
    a = dict(zip(pass_.inputs, avals))
    x = a["x"]
    w_dtype = _launch.dtype_name(a["weight"].dtype) if "weight" in a else None
    specs = pass_.out_specs(tuple(x.shape[:-1]), x.shape[-1], _launch.dtype_name(x.dtype), w_dtype)
    # Each output keeps x's mesh and varying axes; its spec is x's over the dimensions it has (rows:
    # all of x's; per-row statistics: the leading ones), or replicated for a per-column result. Set in
    # the same update as the shape: JAX 0.11 checks that a sharding's spec matches the shape's rank.
    x_spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(tuple(x.sharding.spec)))
    out = []
    for name, (shape, dtype) in zip(pass_.outputs, specs):
        spec = P(None) if LAYOUT[name] in (COLUMN, REPLICA) else P(*x_spec[:len(shape)])
        out.append(x.update(shape=shape, dtype=jnp.dtype(dtype), weak_type=False,
                            sharding=x.sharding.update(spec=spec)))
    return out


def _no_jvp(primals, tangents, **params):
    raise TypeError(FORWARD_MODE_ERROR)


def _batch(args, dims, *, pass_: Pass, route):
    columns_batched = any(d is not None for n, d in zip(pass_.inputs, dims) if LAYOUT[n] in (COLUMN, REPLICA))
    if columns_batched or pass_.reduces:  # the implementation's own vmap rule, one result per batch element
        outs = jax.vmap(pass_.run, in_axes=tuple(dims))(*args)
        return list(outs), [0] * len(outs)
    (size,) = {a.shape[d] for a, d in zip(args, dims) if d is not None}
    folded = []
    for name, a, d in zip(pass_.inputs, args, dims):
        if LAYOUT[name] in (ROW, STAT):  # one more leading dimension: more rows
            a = jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
        folded.append(a)
    outs = rows_p.bind(*folded, pass_=pass_, route=route)
    # the weight's recovery (REC) is the weight's alone: one for the whole batch
    return outs, [0 if LAYOUT[n] in (ROW, STAT) else None for n in pass_.outputs]


def _eager(*args, pass_: Pass, route):
    """Outside jit: on arrays spread over several devices, compiled alone by ``jax.jit`` (so
    partitioned per device like under jit); otherwise run as traced code, op by op.

    Raises ``ValueError`` (before anything is compiled or launched) for an x whose committed
    sharding splits its normalized (last) dimension: here the placement is known, so it is refused
    rather than gathered."""
    if any(len(a.sharding.device_set) > 1 for a in args if isinstance(a, jax.Array)):
        x = args[0]  # x is the first input of every pass
        if isinstance(x.sharding, NamedSharding):
            _rows.check_rows_whole(tuple(x.shape), _rows.spec_entries(x.sharding, x.ndim), _REMEDY)
        return _compiled_alone(pass_, route)(*args)
    return pass_.run(*args)


@functools.lru_cache(maxsize=256)
def _compiled_alone(pass_: Pass, route):
    return jax.jit(lambda *arrays: rows_p.bind(*arrays, pass_=pass_, route=route))


rows_p.def_abstract_eval(_abstract)
rows_p.def_impl(_eager)
_compat.register_jvp(rows_p, _no_jvp)
_compat.register_batching(rows_p, _batch)


# ---------------------------------------------------------------------------------------------
# Lowering: as is on one device, through custom_partitioning when the partitioner splits it.


def _partitioned(ctx) -> bool:
    """Whether XLA's partitioner splits this computation over several devices. A jit's module has a
    device assignment (``_compat.require_devices_during_lowering`` below); a shard_map body, already per
    device, has none."""
    devices = _compat.lowering_device_assignment(ctx)
    return devices is not None and len(devices) > 1


def _typed_split(ctx, pass_: Pass) -> _shard_map.ShardedImpl | None:
    """Where x's type already places it on a mesh with Explicit axes (replicated arrays made after
    ``jax.set_mesh``; a vmapped call whose batch axis is split): that placement as a
    ``_shard_map.ShardedImpl``, which states the per-device computation itself; else None. The
    partitioner is not asked: on JAX 0.11 a custom_partitioning call over such types fails at run
    time on a sharding custom call that nothing partitions."""
    aval = dict(zip(pass_.inputs, ctx.avals_in))["x"]
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not _shard_map.explicit(sharding):
        return None
    return _shard_map.placed(pass_.base, sharding, tuple(aval.shape))


def _lower(ctx, *args, pass_: Pass, route):
    if route is None and _partitioned(ctx):
        typed = _typed_split(ctx, pass_)
        if typed is not None:
            return _compat.lower_fun(lambda *arrays: list(typed.run(pass_, list(arrays)).values()),
                                     multiple_results=True)(ctx, *args)
        return _lower_partitioned(ctx, *args, pass_=pass_)
    with _launch.routed_host_callbacks(route):
        return _compat.lower_fun(pass_.run, multiple_results=True)(ctx, *args)


def _lower_partitioned(ctx, *args, pass_: Pass):
    # On CPU the dispatcher is registered whatever the implementation (one host callback per module;
    # only the Triton implementation's interpreted launches call it).
    cpu = _compat.lowering_platforms(ctx) == ("cpu",)
    route = _launch.host_dispatcher_index(ctx.module_context) if cpu else None

    def per_device(*arrays):  # custom_partitioning resolves positional arguments: no functools.partial
        return rows_p.bind(*arrays, pass_=pass_, route=route)

    fn = _compat.custom_partitioning(per_device)
    fn.def_partition(partition=functools.partial(_partition, pass_, route),
                     infer_sharding_from_operands=functools.partial(_infer, pass_),
                     sharding_rule=sharding_rule(pass_),
                     need_replication_factors=("n",) + ("r",) * any(
                         LAYOUT[n] == REPLICA for n in pass_.inputs + pass_.outputs))
    return _compat.lower_fun(fn, multiple_results=True)(ctx, *args)


_compat.register_lowering(rows_p, _lower)
# custom_partitioning needs the device assignment when it is lowered, which jit provides only to
# computations holding a primitive registered so (jax.nn.dot_product_attention's cuDNN path registers
# its wrappers the same way).
_compat.require_devices_during_lowering(rows_p)


# ---------------------------------------------------------------------------------------------
# The rule.


def sharding_rule(pass_: Pass) -> str:
    """The Shardy rule of a pass, e.g. ``"... n, n -> ... n, ..."`` (RMSNorm's forward with statistics);
    ``r``, the weight's recovery (N + 1 values), is never sharded either."""
    term = {ROW: "... n", STAT: "...", COLUMN: "n", REPLICA: "r"}
    return (", ".join(term[LAYOUT[n]] for n in pass_.inputs) + " -> "
            + ", ".join(term[LAYOUT[n]] for n in pass_.outputs))


_REMEDY = ("place x on a sharding of its leading (batch or sequence) dimensions only (jax.device_put, or "
           "jax.lax.with_sharding_constraint under jit)")


def _shardings(mesh, x) -> tuple[dict, tuple, Mesh]:
    """({layout: sharding}, the mesh axes x's rows are split over, the mesh) for x, a ShapeDtypeStruct
    carrying the sharding the partitioner proposes (None: not chosen yet).

    Never raises (see the module docstring): x's leading dimensions keep their sharding and its last
    dimension is whole; an x without a sharding counts as replicated; without a mesh (x placed by a
    ``GSPMDSharding``) every buffer is whole on every device, on a one-axis mesh of x's devices."""
    sharding = x.sharding
    if mesh.empty:
        devices = sorted(sharding.device_set, key=lambda d: d.id) if sharding is not None else jax.devices()[:1]
        whole = NamedSharding(Mesh(np.array(devices), ("devices",)), P())  # HLO: replicated
        return {ROW: whole, STAT: whole, COLUMN: whole, REPLICA: whole}, (), whole.mesh
    spec = (_rows.spec_entries(sharding, len(x.shape)) if isinstance(sharding, NamedSharding)
            else (None,) * len(x.shape))
    lead = spec[:-1]
    row_axes = tuple(axis for entry in lead for axis in _rows.mesh_axes(entry))
    return ({ROW: NamedSharding(mesh, P(*lead, None)), STAT: NamedSharding(mesh, P(*lead)),
             COLUMN: NamedSharding(mesh, P()), REPLICA: NamedSharding(mesh, P())}, row_axes, mesh)


def _gathered(pass_: Pass, mesh, x) -> str | None:
    """Why ``partition`` gathers x's rows (a warning's text), or None where it keeps them in place."""
    what = f"normkit: {pass_.op.name}'s {'forward' if pass_.grads is None else 'backward'}: x of shape {tuple(x.shape)}"
    if mesh.empty and x.sharding is not None and len(x.sharding.device_set) > 1:
        return (f"{what} is placed by {x.sharding}, which names no mesh: the op runs on the whole array on every "
                "device (XLA's partitioner gathers it); place the inputs with a jax.sharding.NamedSharding")
    if isinstance(x.sharding, NamedSharding):
        spec = _rows.spec_entries(x.sharding, len(x.shape))
        if _rows.mesh_axes(spec[-1]):
            return (f"{what} arrives with sharding {_rows.show(spec)}, which splits its normalized (last) dimension "
                    f"over mesh axes {_rows.mesh_axes(spec[-1])}: XLA's partitioner gathers that dimension (an "
                    f"all-gather of x) and the op runs on whole rows; {_REMEDY} to keep x in place")
    return None


def _partition(pass_: Pass, route, mesh, arg_shapes, result_shape):
    why = _gathered(pass_, mesh, arg_shapes[0])
    shardings, row_axes, mesh = _shardings(mesh, arg_shapes[0])
    if why is not None:
        _log.warning(why)

    def per_device(*arrays):
        return pass_.reduce_columns(rows_p.bind(*arrays, pass_=pass_, route=route), row_axes)

    return (mesh, per_device, [shardings[LAYOUT[n]] for n in pass_.outputs],
            tuple(shardings[LAYOUT[n]] for n in pass_.inputs))


def _infer(pass_: Pass, mesh, arg_shapes, result_shape):
    shardings, _, _ = _shardings(mesh, arg_shapes[0])
    return [shardings[LAYOUT[n]] for n in pass_.outputs]
