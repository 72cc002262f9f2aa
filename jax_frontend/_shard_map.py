"""Shardings that are in the inputs' types: Explicit mesh axes (``jax.shard_map`` inside the op) and
manual axes (inside the caller's ``jax.shard_map``).

When x's type splits its rows over Explicit mesh axes (``jax.make_mesh``'s default axis type; the
mode ``jax.set_mesh`` enables; also inside a jit whose inputs are ``NamedSharding``-placed on such a
mesh), ``functional._call`` runs the op with ``ShardedImpl`` (rows the type leaves whole, e.g. the
replicated arrays made after ``jax.set_mesh``, go to ``_custom_partitioning`` like any other):

- forward: ``shard_map`` over the mesh's Explicit axes with x (and residual) split as their type
  says and the weight and bias replicated; each device runs the pass on its own rows
  (``_rows.Pass``) and keeps y, residual_out and the per-row statistics sharded like x. No
  collective.
- backward: the same, with the output gradients split like x; dx stays sharded like x. dW/dB,
  partial sums over this device's rows, are ``psum``-reduced over exactly the mesh axes the rows are
  split on (one all-reduce per trainable parameter). A frozen parameter's gradient is not computed
  (its cotangent is a symbolic zero), so there is nothing to reduce and no all-reduce.
- a weight or bias sharded along the normalized dimension (FSDP-style) is gathered first
  (``whole_params``: ``jax.sharding.reshard`` to replicated, an all-gather of N elements); JAX's
  transpose of that reshard hands each device its slice of the gradient.

Because the partition is in the types when the op is traced, the op states it with shard_map; the
same code serves CPU (Triton's interpreter from a host callback) and GPU. Concurrent shards on CPU
share the interpreter's process-wide lock.

Inside the caller's shard_map the rows are already local. ``match_varying`` only marks the weight
(and bias) as varying like x, so that their cotangents type-check and are psum-reduced by JAX's
transpose.

Raises, at trace time and before anything is launched: a normalized (last) dimension that is
sharded (each row must be on one device), and a residual whose sharding differs from x's.
Everything else (Auto mesh axes, no mesh) is ``_custom_partitioning``'s.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_frontend import _compat, _rows
from jax_frontend._implementation import Implementation
from jax_frontend._rows import COLUMN, LAYOUT, REPLICA, ROW, STAT, Pass
from normkit.ops import Grads, Op, Options


def _sharding(a) -> NamedSharding | None:
    """The NamedSharding in ``a``'s type (jax.typeof), or None."""
    if a is None:
        return None
    try:
        sharding = getattr(jax.typeof(a), "sharding", None)
    except (TypeError, AttributeError):  # pragma: no cover  (not an array)
        return None
    return sharding if isinstance(sharding, NamedSharding) else None


def explicit(sharding: NamedSharding | None) -> bool:
    """Whether ``sharding`` is on a mesh with Explicit axes."""
    return sharding is not None and not sharding.mesh.empty and bool(sharding.mesh.explicit_axes)


def whole_params(weight, bias) -> tuple:
    """A weight or bias whose type shards it over Explicit mesh axes, replicated (an all-gather of its N
    elements; JAX's transpose slices the gradient back to that sharding); the others unchanged."""
    out = []
    for p in (weight, bias):
        sharding = _sharding(p)
        if explicit(sharding) and any(_rows.mesh_axes(e) for e in _rows.spec_entries(sharding, p.ndim)):
            p = jax.sharding.reshard(p, NamedSharding(sharding.mesh, P()))
        out.append(p)
    return tuple(out)


def placed(base: Implementation, sharding: NamedSharding, shape: tuple) -> "ShardedImpl":
    """A ``ShardedImpl`` over ``base`` for an x of ``shape`` placed by ``sharding`` (on a mesh with
    Explicit axes); its ``row_axes`` are empty where the rows are whole on every device.

    Raises (before any launch) for a normalized dimension that is sharded."""
    spec = _rows.spec_entries(sharding, len(shape))
    _rows.check_rows_whole(tuple(shape), spec, "shard a leading (batch or sequence) dimension instead, or "
                                               "reshard x first (jax.sharding.reshard)")
    row_axes = tuple(a for e in spec[:-1] for a in _rows.mesh_axes(e))
    return ShardedImpl(base=base, mesh=sharding.mesh, spec=spec, row_axes=row_axes,
                       manual_axes=tuple(sharding.mesh.explicit_axes))


def sharded_impl(op: Op, base: Implementation, x, residual=None, weight=None, bias=None):
    """A ``ShardedImpl`` over ``base`` when x's type splits its rows over Explicit mesh axes, else None.

    Raises (before any launch) for placements the kernels cannot run on locally."""
    sharding = _sharding(x)
    if not explicit(sharding):
        return None
    impl = placed(base, sharding, tuple(x.shape))
    if residual is not None:
        r_spec = _rows.spec_entries(_sharding(residual), residual.ndim)
        if r_spec != impl.spec:
            raise ValueError(
                f"normkit: residual has sharding {_rows.show(r_spec)} but x has {_rows.show(impl.spec)}; they must "
                "be sharded alike (jax.sharding.reshard one of them)")
    return impl if impl.row_axes else None


def varying(a) -> frozenset:
    """The manual mesh axes ``a`` varies over (inside shard_map; empty elsewhere)."""
    if a is None:
        return frozenset()
    return _compat.varying_axes(a)


def match_varying(*arrays) -> tuple:
    """Inside a caller's ``shard_map``: every input marked as varying over the manual axes any input
    varies over, as JAX does for its own primitives' operands.

    The custom_vjp's backward returns cotangents computed from this device's rows, which vary over
    the axes x varies over; a replicated weight's cotangent must not. Cast the weight to varying in
    the forward, and JAX's transpose of that cast is the psum of dW over those axes: one all-reduce
    per trainable parameter, none for a frozen one (its cotangent is a symbolic zero)."""
    axes = frozenset().union(*(varying(a) for a in arrays))
    if not axes:
        return arrays
    out = []
    for a in arrays:
        missing = tuple(sorted(axes - varying(a))) if a is not None else ()
        out.append(_compat.pcast_varying(a, missing) if missing else a)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ShardedImpl:
    """``_implementation.Implementation`` over arrays of the caller's shape ``(..., N)`` sharded by
    ``spec``; ``base`` runs on each device's rows."""

    base: Implementation  # the per-device implementation
    mesh: object  # the (abstract) mesh of x's type
    spec: tuple  # x's PartitionSpec entries, the last one None
    row_axes: tuple  # mesh axes the rows are split over: where dW/dB partials are psum-reduced
    manual_axes: tuple  # the axes the shard_map makes manual (every Explicit axis)

    def forward(self, op: Op, x, residual, weight, bias, *, opts: Options, store_stats: bool,
                store_rec: bool = False) -> dict:
        names, arrays = Pass.present(_rows.FWD_INPUTS, (x, residual, weight, bias))
        return self.run(Pass(self.base, op, opts, names, store_stats=store_stats, store_rec=store_rec), arrays)

    def backward(self, op: Op, x, weight, dy, dres, mean, rstd, *, opts: Options, grads: Grads,
                 b_dtype: str | None, bias=None, from_output: bool = False, rec=None) -> dict:
        names, arrays = Pass.present(_rows.BWD_INPUTS, (x, weight, bias if from_output else None, dy, dres, mean,
                                                        rstd, rec if from_output else None))
        return self.run(Pass(self.base, op, opts, names, grads=grads, b_dtype=b_dtype, from_output=from_output), arrays)

    def run(self, pass_: Pass, arrays: list) -> dict:
        """``pass_``'s outputs by name, each device running it on its own rows."""
        specs = {ROW: P(*self.spec), STAT: P(*self.spec[:-1]), COLUMN: P(), REPLICA: P()}

        def body(*local):
            return pass_.reduce_columns(pass_.run(*local), self.row_axes)

        # check_vma=False: the body is never differentiated (it runs inside the custom_vjp's rules), its
        # psum is explicit, and not every implementation types its kernel outputs' varying axes (a
        # pallas_call's out_shape carries none).
        outs = jax.shard_map(body, mesh=self.mesh, in_specs=tuple(specs[LAYOUT[n]] for n in pass_.inputs),
                             out_specs=[specs[LAYOUT[n]] for n in pass_.outputs],
                             axis_names=frozenset(self.manual_axes), check_vma=False)(*arrays)
        return dict(zip(pass_.outputs, outs))
