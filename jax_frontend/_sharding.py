"""Sharded inputs: each device runs the kernels on its own rows, through ``jax.shard_map`` inside the op.

When x's type carries a sharding over Explicit mesh axes (``jax.make_mesh``'s default axis type; the
mode ``jax.set_mesh`` enables; also inside a jit whose inputs are ``NamedSharding``-placed on such a
mesh), ``functional._call`` runs the op with ``ShardedImpl`` instead of the plain implementation:

- forward: ``shard_map`` over the mesh's Explicit axes with x (and residual) split as their type
  says and the weight and bias replicated; each device flattens its own block of rows, runs the
  kernel, and keeps y, residual_out and the per-row statistics sharded like x. No collective.
- backward: the same, with the output gradients split like x; dx stays sharded like x. dW/dB,
  partial sums over this device's rows, are ``psum``-reduced over exactly the mesh axes the rows are
  split on (one all-reduce per trainable parameter). A frozen parameter's gradient is not computed
  (its cotangent is a symbolic zero), so there is nothing to reduce and no all-reduce.

Why ``shard_map`` and not ``custom_partitioning``: with types that carry the sharding, the partition
is known when the op is traced, so the op can state it (shard_map) instead of answering XLA's
partitioner from a Python callback during compilation. The same code then serves CPU and GPU: on
CPU the kernels run in Triton's interpreter from a ``pure_callback``, and a callback lowered inside a
``custom_partitioning`` partition rule is a known use-after-free (jax PR #23620: the callback is not
kept alive by the executable). Concurrent shards on CPU share the interpreter's process-wide lock.

Not handled here (the plain path runs, and XLA partitions around the opaque kernel call by
replicating its operands, i.e. gathering x):

- Auto axes: their sharding is chosen by the partitioner after tracing and is not in the type, so
  the op cannot see it (a one-time ``NormkitShardingWarning`` says so). Use Explicit axes, or call
  normkit inside your own ``jax.shard_map`` (it then sees local rows, and JAX's transpose of
  shard_map reduces the weight gradient as for any replicated input).
- Manual axes (inside a shard_map): the rows are already local. ``match_varying`` only marks the
  weight (and bias) as varying like x, so that their cotangents type-check and are psum-reduced by
  JAX's transpose.
- ``vmap`` over a sharded axis: inside vmap the per-example type has no sharding on that axis.

Raises, at trace time and before anything is launched: a normalized (last) dimension that is
sharded (each row must be on one device), a weight or bias sharded on the normalized dimension (a
tensor-parallel norm), and a residual whose sharding differs from x's.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from normkit.ops import Grads, Op, Options


class NormkitShardingWarning(UserWarning):
    """normkit cannot see how an input is sharded (Auto mesh axes) and runs the op unsharded."""


_WARNED_AUTO = False


def _sharding(a) -> NamedSharding | None:
    """The NamedSharding in ``a``'s type (jax.typeof), or None."""
    if a is None:
        return None
    try:
        sharding = getattr(jax.typeof(a), "sharding", None)
    except (TypeError, AttributeError):  # pragma: no cover  (not an array)
        return None
    return sharding if isinstance(sharding, NamedSharding) else None


def _axes(entry) -> tuple[str, ...]:
    """The mesh axis names of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec(sharding: NamedSharding | None, ndim: int) -> tuple:
    """The PartitionSpec entries of a sharding over ``ndim`` dimensions (replicated: all None)."""
    entries = tuple(sharding.spec) if sharding is not None else ()
    return entries + (None,) * (ndim - len(entries))


def _show(spec: tuple) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def _warn_auto(mesh) -> None:
    global _WARNED_AUTO
    if _WARNED_AUTO:
        return
    _WARNED_AUTO = True
    warnings.warn(
        f"normkit: the mesh axes {tuple(mesh.auto_axes)} are Auto, so an input's sharding is not in its type and "
        "the norm cannot see which rows are local: it runs unsharded and XLA gathers its inputs. Use Explicit axes "
        "(jax.make_mesh's default; jax.sharding.reshard / explicit_axes), or call normkit inside jax.shard_map.",
        NormkitShardingWarning, stacklevel=4)


def sharded_impl(op: Op, base, x, residual=None, weight=None, bias=None):
    """A ``ShardedImpl`` over ``base`` when x's type is sharded over Explicit mesh axes, else None.

    Raises (before any launch) for placements the kernels cannot run on locally."""
    sharding = _sharding(x)
    if sharding is None or sharding.mesh.empty:
        return None
    mesh = sharding.mesh
    explicit = tuple(mesh.explicit_axes)
    if not explicit:
        if any(mesh.shape[a] > 1 for a in mesh.auto_axes):
            _warn_auto(mesh)
        return None
    spec = _spec(sharding, x.ndim)
    if x.ndim == 0 or _axes(spec[-1]):
        raise ValueError(
            f"normkit: x of shape {tuple(x.shape)} has sharding {_show(spec)}: its normalized (last) dimension is "
            f"sharded over mesh axes {_axes(spec[-1])}, and each row must be on one device. Shard a leading (batch or "
            "sequence) dimension instead, or reshard x first (jax.sharding.reshard).")
    if residual is not None:
        r_spec = _spec(_sharding(residual), residual.ndim)
        if r_spec != spec:
            raise ValueError(
                f"normkit: residual has sharding {_show(r_spec)} but x has {_show(spec)}; they must be sharded alike "
                "(jax.sharding.reshard one of them)")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        p_spec = _spec(_sharding(p), p.ndim)
        if any(_axes(e) for e in p_spec):
            raise ValueError(
                f"normkit: {name} has sharding {_show(p_spec)}: a {name} sharded on the normalized dimension (a "
                f"tensor-parallel norm) is not supported; replicate it (PartitionSpec()) on every mesh axis")
    row_axes = tuple(a for e in spec[:-1] for a in _axes(e))
    if not row_axes and mesh.size == 1:
        return None
    # Replicated rows on a mesh of several devices still go through shard_map (with nothing split and
    # nothing reduced): every device computes all rows from its own copy. The plain path cannot take
    # them: on CPU its pure_callback fails on mesh-typed operands, and Pallas's padding mixes types.
    return ShardedImpl(base=base, mesh=mesh, spec=spec, row_axes=row_axes, manual_axes=explicit)


def _varying(a) -> frozenset:
    """The manual mesh axes ``a`` varies over (inside shard_map; empty elsewhere)."""
    if a is None:
        return frozenset()
    aval = jax.typeof(a)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; older releases: aval.vma
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _pcast_varying(a, axes: tuple):
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(a, axes, to="varying")
    return jax.lax.pvary(a, axes)  # pragma: no cover  (releases before pcast)


def match_varying(*arrays) -> tuple:
    """Inside a caller's ``shard_map``: every input marked as varying over the manual axes any input
    varies over, as JAX does for its own primitives' operands.

    The custom_vjp's backward returns cotangents computed from this device's rows, which vary over
    the axes x varies over; a replicated weight's cotangent must not. Cast the weight to varying in
    the forward, and JAX's transpose of that cast is the psum of dW over those axes: one all-reduce
    per trainable parameter, none for a frozen one (its cotangent is a symbolic zero)."""
    axes = frozenset().union(*(_varying(a) for a in arrays))
    if not axes:
        return arrays
    out = []
    for a in arrays:
        missing = tuple(sorted(axes - _varying(a))) if a is not None else ()
        out.append(_pcast_varying(a, missing) if missing else a)
    return tuple(out)


def _rows(a):
    return None if a is None else a.reshape(-1, a.shape[-1])


def _present(**arrays) -> dict:
    return {k: v for k, v in arrays.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class ShardedImpl:
    """The implementation interface of ``jax_frontend.functional`` (``forward``/``backward``), over
    arrays of the caller's shape ``(..., N)`` sharded by ``spec``; ``base`` runs on each device's rows."""

    base: object  # the per-device implementation (jax_frontend._primitives)
    mesh: object  # the (abstract) mesh of x's type
    spec: tuple  # x's PartitionSpec entries, the last one None
    row_axes: tuple  # mesh axes the rows are split over: where dW/dB partials are psum-reduced
    manual_axes: tuple  # the axes the shard_map makes manual (every Explicit axis)

    def _shard_map(self, body, in_specs, out_specs):
        # check_vma=False: the body is never differentiated (it runs inside the custom_vjp's rules), its
        # psum is explicit, and not every implementation types its kernel outputs' varying axes (a
        # pallas_call's out_shape carries none).
        return jax.shard_map(body, mesh=self.mesh, in_specs=(in_specs,), out_specs=out_specs,
                             axis_names=frozenset(self.manual_axes), check_vma=False)

    def forward(self, op: Op, x, residual, weight, bias, *, opts: Options, store_stats: bool) -> dict:
        rows, stats = P(*self.spec), P(*self.spec[:-1])
        args = _present(x=x, residual=residual, weight=weight, bias=bias)
        in_specs = {k: rows if k in ("x", "residual") else P() for k in args}
        out_specs = {k: rows if len(shape) == 2 else stats
                     for k, (shape, _) in op.fwd_buffers(1, 1, "float32", store_stats).items()}

        def body(a):
            lead = a["x"].shape[:-1]
            out = self.base.forward(op, _rows(a["x"]), _rows(a.get("residual")), a.get("weight"), a.get("bias"),
                                    opts=opts, store_stats=store_stats)
            return {k: v.reshape(lead + v.shape[1:]) for k, v in out.items()}

        return self._shard_map(body, in_specs, out_specs)(args)

    def backward(self, op: Op, x, weight, dy, dres, mean, rstd, *, opts: Options, grads: Grads,
                 b_dtype: str | None) -> dict:
        rows, stats = P(*self.spec), P(*self.spec[:-1])
        args = _present(x=x, weight=weight, dy=dy, dres=dres, mean=mean, rstd=rstd)
        in_specs = {k: P() if k == "weight" else stats if k in ("mean", "rstd") else rows for k in args}
        out_specs = {k: rows if k == "DX" else P()
                     for k in op.bwd_buffers(1, 1, "float32", grads, "float32", "float32")}

        def body(a):
            lead = a["x"].shape[:-1]
            flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
            out = self.base.backward(op, _rows(a["x"]), a.get("weight"), _rows(a["dy"]), _rows(a.get("dres")),
                                     flat(a.get("mean")), flat(a["rstd"]), opts=opts, grads=grads, b_dtype=b_dtype)
            if "DX" in out:
                out["DX"] = out["DX"].reshape(lead + out["DX"].shape[1:])
            for k in ("DW", "DB"):  # this device's rows only: sum over the devices holding the other rows
                if k in out:
                    out[k] = jax.lax.psum(out[k], self.row_axes)
            return out

        return self._shard_map(body, in_specs, out_specs)(args)
