"""One pass of an op over arrays of the caller's shape ``(..., N)``, and how its buffers lie against x.

An implementation (``_implementation.Implementation``) runs over 2-D rows ``[M, N]``. A ``Pass`` is
one forward or backward of an op with its static options and the inputs present; ``Pass.run``
flattens its arrays to rows, runs the implementation and restores the shape (no rows: zeros, no
launch). Both distributed routes run a ``Pass`` on each device's rows: ``_shard_map`` (Explicit
mesh axes) and ``_custom_partitioning`` (everything else). What a sharding of x means for every
buffer is ``LAYOUT``:

- ``ROW`` buffers ``(..., N)``, sharded like x: x, residual, dy, dres and Y, S, DX;
- ``STAT`` buffers ``(...)``, one value per row, sharded like x's leading dimensions: MEAN, RSTD;
- ``COLUMN`` buffers ``(N,)``, whole on every device: weight, bias and DW, DB (sums over all rows,
  so each device's partial sum is reduced over the mesh axes the rows are split on);
- ``REPLICA`` buffers ``(N + 1,)``, whole and the same on every device, never reduced: REC, the
  weight's recovery (computed from the weight and bias alone) for a backward that reads y.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_frontend import _launch
from jax_frontend._implementation import Implementation
from normkit.ops import Grads, Op, Options

ROW, STAT, COLUMN, REPLICA = "row", "stat", "column", "replica"
LAYOUT = {
    "x": ROW, "residual": ROW, "dy": ROW, "dres": ROW, "Y": ROW, "S": ROW, "DX": ROW,
    "mean": STAT, "rstd": STAT, "MEAN": STAT, "RSTD": STAT,
    "weight": COLUMN, "bias": COLUMN, "DW": COLUMN, "DB": COLUMN,
    "rec": REPLICA, "REC": REPLICA,
}
FWD_INPUTS = ("x", "residual", "weight", "bias")
BWD_INPUTS = ("x", "weight", "bias", "dy", "dres", "mean", "rstd", "rec")  # x: what the forward kept (x or y)


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass: the forward (``grads`` None) or the backward computing ``grads``."""

    base: Implementation  # runs on 2-D rows
    op: Op
    opts: Options
    inputs: tuple[str, ...]  # the inputs present, in FWD_INPUTS / BWD_INPUTS order
    store_stats: bool = False  # forward: also write MEAN/RSTD for a backward
    store_rec: bool = False  # forward: also write REC for a backward that reads y
    grads: Grads | None = None  # backward: which gradients
    b_dtype: str | None = None  # backward: dB's dtype
    from_output: bool = False  # backward: "x" is the forward's output y (and the bias an input), dx alone

    @staticmethod
    def present(names: tuple[str, ...], arrays: tuple) -> tuple[tuple[str, ...], list]:
        """(the names of the arrays that are not None, those arrays)."""
        kept = [(n, a) for n, a in zip(names, arrays) if a is not None]
        return tuple(n for n, _ in kept), [a for _, a in kept]

    @property
    def reduces(self) -> bool:
        """A backward with dW/dB: column sums over every row."""
        return self.grads is not None and self.grads.reduces

    def buffers(self, M: int, N: int, x_dtype: str, w_dtype: str | None) -> dict:
        """The implementation's buffers over M rows, ``name -> (shape, dtype name)``."""
        if self.grads is None:
            return self.op.fwd_buffers(M, N, x_dtype, self.store_stats, self.store_rec)
        return self.op.bwd_buffers(M, N, x_dtype, self.grads, w_dtype, self.b_dtype)

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(self.buffers(1, 1, "float32", "float32"))

    @staticmethod
    def shape(name: str, lead: tuple, N: int) -> tuple:
        """A buffer's shape for x of shape ``lead + (N,)``."""
        return {ROW: lead + (N,), STAT: lead, COLUMN: (N,), REPLICA: (N + 1,)}[LAYOUT[name]]

    def out_specs(self, lead: tuple, N: int, x_dtype: str, w_dtype: str | None) -> list[tuple[tuple, str]]:
        """``(shape, dtype name)`` of each output, in ``outputs`` order."""
        buffers = self.buffers(math.prod(lead), N, x_dtype, w_dtype)
        return [(self.shape(name, lead, N), dtype) for name, (_, dtype) in buffers.items()]

    def run(self, *arrays) -> list:
        """The outputs, in ``outputs`` order, for arrays of the caller's shape (in ``inputs`` order)."""
        a = dict(zip(self.inputs, arrays))
        x = a["x"]
        lead, N = tuple(x.shape[:-1]), x.shape[-1]
        w_dtype = _launch.dtype_name(a["weight"].dtype) if "weight" in a else None
        if math.prod(lead) == 0:  # no rows: nothing to launch; dW/dB are sums of nothing
            return [jnp.zeros(shape, dtype) for shape, dtype in self.out_specs(lead, N, _launch.dtype_name(x.dtype),
                                                                                w_dtype)]
        rows = {n: t.reshape(-1, N) if LAYOUT[n] == ROW else t.reshape(-1) for n, t in a.items()}
        if self.grads is None:
            out = self.base.forward(self.op, rows["x"], rows.get("residual"), rows.get("weight"), rows.get("bias"),
                                    opts=self.opts, store_stats=self.store_stats, store_rec=self.store_rec)
        else:
            out = self.base.backward(self.op, rows["x"], rows.get("weight"), rows["dy"], rows.get("dres"),
                                     rows.get("mean"), rows["rstd"], opts=self.opts, grads=self.grads,
                                     b_dtype=self.b_dtype, bias=rows.get("bias"), from_output=self.from_output,
                                     rec=rows.get("rec"))
        assert set(out) == set(self.outputs), (tuple(out), self.outputs)
        return [out[name].reshape(self.shape(name, lead, N)) for name in self.outputs]

    def reduce_columns(self, outputs: list, row_axes: tuple) -> list:
        """On one device's rows: dW/dB summed over the devices holding the other rows (``psum`` over the
        mesh axes the rows are split on); the other outputs as they are."""
        if not row_axes:
            return list(outputs)
        return [jax.lax.psum(o, row_axes) if LAYOUT[n] == COLUMN else o for n, o in zip(self.outputs, outputs)]


# ---------------------------------------------------------------------------------------------
# Shardings of x, as PartitionSpec entries.


def mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axis names of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_entries(sharding, ndim: int) -> tuple:
    """The PartitionSpec entries of a NamedSharding over ``ndim`` dimensions (None: replicated)."""
    entries = tuple(sharding.spec) if sharding is not None else ()
    return entries + (None,) * (ndim - len(entries))


def show(spec: tuple) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def check_rows_whole(shape: tuple, spec: tuple, remedy: str) -> None:
    """Raise ``ValueError`` when x's normalized (last) dimension is sharded: each row must be on one device."""
    axes = mesh_axes(spec[-1])
    if axes:
        raise ValueError(f"normkit: x of shape {shape} has sharding {show(spec)}: its normalized (last) dimension is "
                         f"sharded over mesh axes {axes}, and each row must be on one device; {remedy}")
