"""The framework-neutral driver: (op, rows, options, gradients needed) -> kernel launches.

Both frontends run this code: the empty-row cases, the plan, one allocation per result (through the
backend), the launch, and the reduction of the dW/dB partials. A frontend supplies a ``Backend``,
the little that differs between frameworks. Because the sequence exists once, the two frontends
launch identical kernels with identical grids and arguments, and agree bitwise on a GPU.

Arrays are 2-D rows ``[M, N]`` (the frontends flatten leading dimensions) whose column stride is
0 or 1; parameters are 1-D ``[N]`` with any element stride. The backward's dy may instead be
``[n0, n1, n2, N]``: rows indexed by three indices, each with its own stride (``Backend.three_index_rows``).
"""
from __future__ import annotations

import math
from typing import Any, Protocol

from normkit.launch import plan_backward, plan_forward
from normkit.ops import GRADS, Grads, Op, Options, copies_exactly, rec_offset


class Backend(Protocol):
    """What a frontend provides to the driver."""

    frontend: str  # the launch records' name: "torch", "jax-gpu", "jax-cpu"

    def num_sms(self, like) -> int:
        """The SM count of the device ``like`` lives on (the plans' persistent grid sizes)."""

    def dtype(self, a) -> str:
        """A dtype name of normkit.ops (X_DTYPES / PARAM_DTYPES)."""

    def strides(self, a) -> tuple[int, ...]:
        """Element strides of ``a``."""

    def describe(self, *arrays) -> tuple:
        """``(dtype name, strides)`` of each array (None for None), in one call: what a plan reads of
        its arrays."""

    def zeros(self, shape: tuple, dtype: str, like) -> Any:
        """A zero-filled array on ``like``'s device (dW/dB of no rows; empty results)."""

    def launch(self, call, arrays: dict, rows_shape: tuple | None = None) -> dict:
        """Allocate ``call.out_specs`` once, launch ``call`` reading ``arrays`` (name -> array or None),
        record it, and return the outputs (name -> array).

        ``rows_shape``: the caller's ``(..., N)`` shape of the plan's ``[M, N]`` rows, to allocate each
        output in it (``caller_shape``: the same memory layout); None allocates the plan's own shapes. A backend may ignore it (JAX reshapes after
        the custom_vjp boundary instead)."""

    def rows(self, a):
        """``a`` of shape ``(..., N)`` as ``[M, N]`` rows without a copy (column stride 0 or 1, the
        leading dimensions one stride), or None where that needs a copy. Optional, for ``Bound``."""

    def three_index_rows(self, a):
        """``a`` of shape ``(..., N)`` as ``[n0, n1, n2, N]`` without a copy (column stride 0 or 1, the
        leading dimensions merged, in their order, into three), or None where that needs a copy.
        Optional, for ``Bound``'s dy (the backward kernel reads dy's rows by three indices)."""

    def copy_rows(self, a, name: str):
        """``a`` as contiguous ``[M, N]`` rows, copied (and said so: a warning naming ``name``).
        Optional, for ``Bound``."""

    def keys(self, *arrays) -> tuple:
        """What a plan fixes of each array: class, shape, strides, dtype and device (None for None), in
        one call. Optional, for a frontend's cache of ``Bound``s."""

    def backward_key(self, grads, saved, weight, bias, aux, rstd, dy, dres) -> tuple:
        """A hashable key of ``grads`` and of what a backward plan fixes of each array it reads
        (``keys``' facts; dy is never None). Optional, for ``Bound`` (its backward plans are kept per
        the keys of the arrays they read)."""

    def bind(self, call, like, rows_shape: tuple | None = None, tail: tuple = ()):
        """Optional, for a frontend that launches one plan many times (``bind_forward``,
        ``bind_backward``): ``launch(*arrays)``, what ``launch`` does with everything that does not
        depend on the arrays done once. ``launch`` takes the arrays in ``call.inputs`` order (an
        absent input is not read) on ``like``'s device, and returns the outputs in ``call.outputs``
        order, None where absent. ``tail``: the last inputs, bound here (``launch`` takes the others)."""


def _dtype(backend: Backend, a) -> str | None:
    return backend.dtype(a) if a is not None else None


def _rows_layout(a, described) -> tuple[int, int]:
    """(row stride, column stride) of 2-D rows ``a`` (``described``: its ``Backend.describe`` entry),
    or (the outermost row index's stride, column stride) of ``[n0, n1, n2, N]`` rows; the column
    stride must be 0 or 1 (frontends copy other layouts first). An absent array reads as
    contiguous."""
    if a is None:
        return 0, 1
    stride_m, stride_n = described[1][0], described[1][-1]
    if a.shape[-1] == 1:
        stride_n = 1  # one column: its stride is never used
    elif stride_n not in (0, 1):
        raise ValueError(f"normkit: rows with column stride {stride_n} reached the driver; the frontend must copy them")
    return stride_m, stride_n


def _three_index(a, described) -> tuple | None:
    """``(n1, n2, s1, s2)`` of ``[n0, n1, n2, N]`` rows ``a`` (``Backend.three_index_rows``): the extents
    and strides of the two inner row indices; None for 2-D rows or an absent array."""
    if a is None or len(a.shape) == 2:
        return None
    return a.shape[1], a.shape[2], described[1][1], described[1][2]


def _param_stride(described) -> int:
    return described[1][0] if described is not None else 1


def _name(described) -> str | None:
    return described[0] if described is not None else None


def forward_plan(backend: Backend, op: Op, x, residual, weight, bias, opts: Options, store_stats: bool,
                 store_rec: bool = False, rec_in_rstd: bool = False, has_trip: bool = False,
                 y2_dtype: str | None = None):
    """The forward's ``KernelCall`` over rows ``x [M, N]`` (None for no rows). A frontend may keep
    it and launch it again for arrays of the same shapes, strides, dtypes and device. ``store_rec``:
    the backward will read y, so the forward also writes the weight's recovery (REC; in RSTD after its
    rows with ``rec_in_rstd``), and sets the flag TRIP (``has_trip``) where the weight breaks the
    safety rule (``normkit.norm_math``). ``y2_dtype``: the forward also stores y in that dtype (Y2,
    exactly ``Y.to(y2_dtype)``); raises where that dtype cannot hold y exactly
    (``normkit.ops.copies_exactly``)."""
    M, N = x.shape
    if y2_dtype is not None and not copies_exactly(backend.dtype(x), y2_dtype):
        raise TypeError(f"normkit: the forward cannot write a {y2_dtype} copy of a {backend.dtype(x)} output: "
                        f"{y2_dtype} does not hold every {backend.dtype(x)} value exactly")
    if M == 0:
        return None
    residual = residual if op.has_residual else None
    num_sms = backend.num_sms(x)
    d_x, d_res, d_w, d_b = backend.describe(x, residual, weight, bias)
    layout = (*_rows_layout(x, d_x), *_rows_layout(residual, d_res), _param_stride(d_w), _param_stride(d_b))
    return plan_forward(op, M, N, d_x[0], _name(d_w), _name(d_b), opts, store_stats, layout, num_sms, store_rec,
                        rec_in_rstd, has_trip, y2_dtype)


FWD_RESULTS = ("Y", "S", "MEAN", "RSTD", "REC", "Y2")


def _no_rows(backend: Backend, op: Op, x, store_stats: bool, store_rec: bool, rec_in_rstd: bool,
             y2_dtype: str | None = None) -> tuple:
    """The forward's buffers over no rows (``x`` of shape ``(..., N)``, no elements): zeros in ``x``'s
    shape (``caller_shape``; a recovery of no rows is still the weight's, but no backward reads it)."""
    shape = tuple(x.shape)
    buffers = op.fwd_buffers(0, shape[-1], backend.dtype(x), store_stats, store_rec, rec_in_rstd, y2_dtype)
    return tuple(None if name not in buffers else
                 backend.zeros(caller_shape(name, buffers[name][0], shape), buffers[name][1], x)
                 for name in FWD_RESULTS)


def forward(backend: Backend, op: Op, x, residual, weight, bias, opts: Options, store_stats: bool,
            store_rec: bool = False, rec_in_rstd: bool = False, y2_dtype: str | None = None) -> tuple:
    """``(Y, S, MEAN, RSTD, REC, Y2)`` over rows ``x [M, N]``; an entry the op or the flags do not produce
    is None. S = x + residual (fused add); MEAN, RSTD: fp32 statistics for a backward; REC: the weight's
    recovery for a backward that reads y; Y2: y in ``y2_dtype``, stored by the same pass
    (``forward_plan``)."""
    call = forward_plan(backend, op, x, residual, weight, bias, opts, store_stats, store_rec, rec_in_rstd,
                        y2_dtype=y2_dtype)
    if call is None:
        return _no_rows(backend, op, x, store_stats, store_rec, rec_in_rstd, y2_dtype)
    return launch_forward(backend, call, x, residual, weight, bias)


def launch_forward(backend: Backend, call, x, residual, weight, bias, rows_shape: tuple | None = None,
                   trip=None) -> tuple:
    """``(Y, S, MEAN, RSTD, REC, Y2)`` of a forward plan (``forward_plan``) on arrays of the shapes, strides,
    dtypes and device it was made for."""
    out = backend.launch(call, {"X": x, "R": residual, "W": weight, "B": bias, "TRIP": trip}, rows_shape)
    return tuple(out.get(name) for name in FWD_RESULTS)


def backward_plan(backend: Backend, op: Op, x, weight, dy, dres, opts: Options, grads: Grads,
                  b_dtype: str | None = None, bias=None, from_output: bool = False, rec_in_rstd: bool = False):
    """``(backward call, reduction call or None)`` over rows ``x [M, N]``, or None when there is
    nothing to launch (no gradient asked for, or no rows). Raises on a dy / dres dtype other than x's.
    ``dy``: rows ``[M, N]``, or ``[n0, n1, n2, N]`` rows of three indices (``n0 n1 n2 = M``).
    ``from_output``: ``x`` is the forward's output y (see ``backward``), in dy's dtype or as its float32
    widening; ``bias`` is then read too, and the forward's recovery of the weight (REC, or in RSTD:
    ``rec_in_rstd``)."""
    if not grads.any:
        return None
    M, N = x.shape
    bias = bias if from_output else None
    num_sms = backend.num_sms(x)
    d_x, d_dy, d_dres, d_w, d_b = backend.describe(x, dy, dres, weight, bias)
    x_dtype = d_x[0]
    if from_output and x_dtype == "float32" and d_dy is not None and d_dy[0] != x_dtype:
        # y kept as its float32 widening (the copy its consumers keep): the kernel reads it as it is and
        # rounds nothing to X's dtype from y (FROM_Y has no dW); the rows' dtype, dx's, is dy's
        x_dtype = d_dy[0]
    for name, d in (("dy", d_dy), ("the gradient of residual_out", d_dres)):
        if d is not None and d[0] != x_dtype:
            raise TypeError(f"normkit: {name} has dtype {d[0]}; expected the output's dtype {x_dtype}")
    if M == 0:
        return None
    layout = (*_rows_layout(x, d_x), *_rows_layout(dy, d_dy), *_rows_layout(dres, d_dres), _param_stride(d_w),
              _param_stride(d_b))
    return plan_backward(op, M, N, x_dtype, _name(d_w), b_dtype if grads.db else None, dres is not None,
                         opts, grads, layout, num_sms, from_output, bias is not None, from_output and rec_in_rstd,
                         _three_index(dy, d_dy))


def _check_statistics(backend: Backend, M: int, N: int, mean, rstd, rec, rec_in_rstd: bool) -> None:
    """The kernels read the per-row statistics as M contiguous fp32 values (RSTD followed by the N + 1
    of the weight's recovery, ``rec_in_rstd``), and REC as N + 1."""
    rstd_n = rec_offset(M) + N + 1 if rec_in_rstd else M
    for name, t, n in (("mean", mean, M), ("rstd", rstd, rstd_n), ("recovery", rec, N + 1)):
        if t is None:
            continue
        if tuple(t.shape) != (n,) or (n > 1 and backend.strides(t) != (1,)) or backend.dtype(t) != "float32":
            raise ValueError(f"normkit: the {name} reached the driver with shape {tuple(t.shape)}, strides "
                             f"{backend.strides(t)} and dtype {backend.dtype(t)}; the kernels read {n} contiguous "
                             "float32 values (the frontend must make them so)")


def backward(backend: Backend, op: Op, x, weight, dy, dres, mean, rstd, opts: Options, grads: Grads,
             b_dtype: str | None = None, bias=None, from_output: bool = False, rec=None) -> tuple:
    """``(DX, DW, DB)``; an entry ``grads`` does not ask for is None.

    ``x`` is what the forward normalized (S for the fused add); ``dres``, the gradient of
    residual_out, is None when it is zero (then it is not read). dW takes the weight's dtype, dB
    ``b_dtype`` (the bias's dtype; the bias itself is not needed).

    ``from_output``: ``x`` is the forward's output y instead, ``bias`` the bias (None if absent) and
    ``rec`` the forward's recovery of the weight (None: it follows the rows in ``rstd``): the backward
    of a norm whose weight and bias are frozen, which kept y rather than x (dx alone; ``mean`` is not
    read). Where the weight breaks the safety rule dx is NaN (``normkit.norm_math``): a frontend
    checks ``norm_math.unsafe_reason`` first where it can see the weight's values
    (``normkit.saving.decide``).
    """
    rec_in_rstd = from_output and rec is None
    plan = backward_plan(backend, op, x, weight, dy, dres, opts, grads, b_dtype, bias, from_output, rec_in_rstd)
    if plan is None:
        if not grads.any:
            return None, None, None
        M, N = x.shape  # no rows: dX is empty and dW/dB are sums of nothing
        out = {name: backend.zeros(shape, dtype, x) for name, (shape, dtype) in
               op.bwd_buffers(M, N, backend.dtype(x), grads, _dtype(backend, weight), b_dtype).items()}
        return out.get("DX"), out.get("DW"), out.get("DB")
    M, N = x.shape
    _check_statistics(backend, M, N, mean if not (op.is_rms or from_output) else None, rstd,
                      rec if from_output else None, rec_in_rstd)
    return launch_backward(backend, plan, x, weight, dy, dres, mean, rstd, bias=bias if from_output else None,
                           rec=rec if from_output else None)


def launch_backward(backend: Backend, plan: tuple, x, weight, dy, dres, mean, rstd,
                    rows_shape: tuple | None = None, bias=None, rec=None) -> tuple:
    """``(DX, DW, DB)`` of a backward plan (``backward_plan``: the backward launch, then the reduction
    of its dW/dB partials) on arrays of the shapes, strides, dtypes and device it was made for."""
    call, reduce = plan
    out = backend.launch(call, {"X": x, "W": weight, "B": bias, "DY": dy, "DRES": dres, "MEAN": mean, "RSTD": rstd,
                                "REC": rec}, rows_shape)
    if reduce is not None:
        out.update(backend.launch(reduce, out))
    return out.get("DX"), out.get("DW"), out.get("DB")


def caller_shape(name: str, buffer_shape: tuple, rows_shape: tuple) -> tuple:
    """A buffer's shape over the caller's ``(..., N)`` rows: row buffers ``(M, N)`` -> ``rows_shape``,
    per-row statistics ``(M,)`` -> ``rows_shape[:-1]`` (the same memory layout); the rest (the weight's
    recovery, statistics followed by it, per-column results, partials) as planned."""
    if name in ("Y", "S", "DX", "Y2"):
        return tuple(rows_shape)
    if name in ("MEAN", "RSTD") and len(buffer_shape) == 1 and len(rows_shape) >= 1 and \
            buffer_shape[0] == math.prod(rows_shape[:-1]):
        return tuple(rows_shape[:-1])
    return tuple(buffer_shape)


def bind_forward(backend: Backend, call, like, rows_shape: tuple | None = None):
    """``launch(x, residual, weight, bias, trip) -> (Y, S, MEAN, RSTD, REC, Y2)``: ``launch_forward`` of a
    forward plan bound once (``Backend.bind``) for arrays on ``like``'s device, for a frontend that
    launches the plan again and again (an absent result is None)."""
    return backend.bind(call, like, rows_shape)  # the kernel's outputs are FWD_RESULTS


def bind_backward(backend: Backend, plan: tuple, like, rows_shape: tuple | None = None):
    """``launch(x, weight, bias, dy, dres, mean, rstd, rec) -> (DX, DW, DB)``: ``launch_backward`` of a
    backward plan bound once (``Backend.bind``) for arrays on ``like``'s device (an entry not asked for
    is None)."""
    call, reduce = plan
    launch = backend.bind(call, like, rows_shape)
    if reduce is None:  # no dW/dB: the kernel's outputs are (DX, None, None)
        return launch
    launch_reduce = backend.bind(reduce, like)

    def launch_and_reduce(x, weight, bias, dy, dres, mean, rstd, rec) -> tuple:
        dx, dw_part, db_part = launch(x, weight, bias, dy, dres, mean, rstd, rec)
        dw, db = launch_reduce(dw_part, db_part)
        return dx, dw, db

    return launch_and_reduce


class Bound:
    """One call signature bound once, for a frontend that launches it again and again: the forward
    plan and its bound launch, and the backward plans, each bound, per the layouts they meet.

    A signature is what the plans fix: the op, the options, whether statistics are stored, and each
    array's shape, strides, dtype and device; the frontend keys its cache of ``Bound``s on that
    (``Backend.keys``), so every call of one ``Bound`` passes arrays of the layouts of its first.
    Arrays keep the caller's shape ``(..., N)``; rows that cannot be read in place are copied at
    every call (``Backend.copy_rows``, which says so), except an output gradient that the kernel reads
    by three row indices (``Backend.three_index_rows``). ``from_output``: the backward reads the
    forward's output y rather than its input (see ``backward``), which the frontend saves instead;
    the forward then writes the weight's recovery after the statistics in RSTD. ``b_dtype``: dB's
    dtype (the bias's). ``y2_dtype``: the forward also writes y in that dtype (Y2), for consumers that
    take y in it; a signature with it and one without are different ``Bound``s.

    ``forward(x, residual, weight, bias) -> (Y, S, MEAN, RSTD, REC, Y2)`` (REC None: it follows the rows
    in RSTD; Y2 None without ``y2_dtype``; ``trip``, given, is a flag the forward sets where the weight
    breaks the safety rule);
    ``backward(saved, weight, bias, dy, dres, mean, rstd, grads, rec=None) -> (DX, DW,
    DB)``, where ``saved`` is what the frontend kept: x (the fused add's sum s), or y when
    ``from_output``, whose recovery ``rec`` is a buffer of its own or (None) follows the rows in rstd.
    """

    __slots__ = ("backend", "op", "opts", "store_stats", "from_output", "b_dtype", "trip", "y2_dtype", "fwd",
                 "forward", "_bwd")

    def __init__(self, backend: Backend, op: Op, opts: Options, store_stats: bool, from_output: bool = False,
                 b_dtype: str = "float32", trip=None, y2_dtype: str | None = None):
        assert store_stats or not from_output
        self.backend, self.op, self.opts, self.store_stats = backend, op, opts, store_stats
        self.from_output, self.b_dtype, self.trip, self.y2_dtype = from_output, b_dtype, trip, y2_dtype
        self.fwd = None  # the forward plan, once bound (None also where there are no rows)
        # ``forward`` is the bound launch itself once the first call has bound it: a repeated call
        # goes straight to the launch
        self.forward = self._first_forward
        self._bwd: dict = {}

    def _first_forward(self, x, residual, weight, bias) -> tuple:
        self.forward = self._bind_forward(x, residual, weight, bias)
        return self.forward(x, residual, weight, bias)

    def _bind_forward(self, x, residual, weight, bias):
        """``launch(x, residual, weight, bias)`` for arrays of these layouts."""
        backend, op, trip = self.backend, self.op, self.trip
        (x_rows, r_rows), copies = _row_views(backend, (("x", x), ("residual", residual)))
        rec, y2_dtype = self.from_output, self.y2_dtype
        self.fwd = forward_plan(backend, op, x_rows, r_rows, weight, bias, self.opts, self.store_stats, rec, rec,
                                rec and trip is not None, y2_dtype)
        if self.fwd is None:  # no rows: zeros of each buffer, in the caller's shape, fresh at every call
            return lambda x, *_: _no_rows(backend, op, x, self.store_stats, rec, rec, y2_dtype)
        # the flag (FWD_INPUTS' last) bound into the launch, which then takes (x, residual, weight, bias)
        launch = backend.bind(self.fwd, x, tuple(x.shape), (trip if rec else None,))
        return _copying(backend, launch, {0: "x", 1: "residual"}, copies) if any(copies) else launch

    def backward(self, saved, weight, bias, dy, dres, mean, rstd, grads, rec=None) -> tuple:
        """``grads``: a ``Grads``, or its ``(dx, dw, db)`` flags (a tuple hashes faster)."""
        from_output = self.from_output
        if from_output:
            mean = None  # not read
        else:
            bias = rec = None
        k = self.backend.backward_key(grads, saved, weight, bias, rec if from_output else mean, rstd, dy, dres)
        bound = self._bwd.get(k)
        if bound is None:
            bound = self._bwd[k] = self._bind_backward(saved, weight, bias, dy, dres, grads, rec)
        return bound[1](saved, weight, bias, dy, dres, mean, rstd, rec)

    def bound_backward(self, k):
        """The launch ``backward`` bound for key ``k``, or None where it has bound none: ``k`` is
        ``Backend.backward_key(grads, saved, weight, bias, aux, rstd, dy, dres)``, with bias None unless
        ``from_output`` and aux the recovery (``from_output``) or the mean. The launch takes
        ``(saved, weight, bias, dy, dres, mean, rstd, rec)``. A frontend whose arrays may need
        converting before a launch can read them (a saved-tensor hook's) looks its own arrays up
        first: their key is found only where arrays of that key were launched as they are."""
        bound = self._bwd.get(k)
        return None if bound is None else bound[1]

    def keep_backward(self, k, entry) -> None:
        """Keep a frontend's own ``entry`` under ``k`` (a key unlike ``Backend.backward_key``'s), beside the
        bound backward plans: ``bound_backward(k)`` returns it. A frontend keeps there what lets it
        find a launch it has bound with less work than the full key (the Torch frontend: a check of
        the arrays' layouts and the launch that read arrays of those layouts)."""
        self._bwd[k] = (None, entry)

    @property
    def backward_plans(self) -> list:
        """The backward plans bound so far: ``(backward call, reduction call or None)`` each."""
        return [plan for plan, _ in self._bwd.values() if plan is not None]

    def _bind_backward(self, saved, weight, bias, dy, dres, grads: Grads, rec):
        """``(plan, launch)``: the backward plan (None where nothing is launched) and
        ``launch(saved, weight, bias, dy, dres, mean, rstd, rec) -> (DX, DW, DB)`` for arrays of these
        layouts, rows copied first where they cannot be read in place."""
        backend, op = self.backend, self.op
        grads = grads if isinstance(grads, Grads) else GRADS[grads]
        bias = bias if self.from_output else None
        if not grads.any:
            return None, lambda *_: (None, None, None)
        rows, copies = _row_views(backend, (("the saved input", saved), ("the output gradient", dy),
                                            ("the residual_out gradient", dres)), three_index=1)
        plan = backward_plan(backend, op, rows[0], weight, rows[1], rows[2], self.opts, grads, self.b_dtype, bias,
                             self.from_output, rec is None)
        if plan is None:  # no rows: dx empty, dW/dB sums of nothing, fresh at every call
            M, N = rows[0].shape
            buffers = op.bwd_buffers(M, N, backend.dtype(dy), grads, _dtype(backend, weight), self.b_dtype)

            def no_rows(saved, *_):
                out = {name: backend.zeros(shape, dtype, saved) for name, (shape, dtype) in buffers.items()}
                dx = out.get("DX")
                return None if dx is None else dx.reshape(saved.shape), out.get("DW"), out.get("DB")
            return None, no_rows
        # the launch takes (saved, weight, bias, dy, dres, mean, rstd, rec): rows at positions 0, 3 and 4
        positions = {0: "the saved input", 3: "the output gradient", 4: "the residual_out gradient"}
        launch = bind_backward(backend, plan, saved, tuple(saved.shape))
        return plan, _copying(backend, launch, positions, copies) if any(copies) else launch


def _row_views(backend: Backend, named, three_index: int | None = None) -> tuple[list, tuple]:
    """``(rows, copies)`` of ``(name, array or None)`` pairs: each array as ``[M, N]`` rows (the
    ``three_index``-th, where it cannot be, as rows of three indices: ``Backend.three_index_rows``),
    viewed in place or, where it cannot be, copied (``copies[i]``: the i-th must be copied at every
    call)."""
    rows, copies = [], []
    for i, (name, a) in enumerate(named):  # a loop, not a comprehension: the backend's calls follow each other
        view = backend.rows(a) if a is not None else None
        if view is None and a is not None and i == three_index:
            view = backend.three_index_rows(a)
        copies.append(a is not None and view is None)
        rows.append(backend.copy_rows(a, name) if copies[-1] else view)
    return rows, tuple(copies)


def _copying(backend: Backend, launch, positions: dict, copies: tuple):
    """``launch``, with the row arguments that must be copied (``positions``: argument position -> name,
    for the warning, of the rows ``_row_views`` saw, in order; ``copies``: its flags) copied into rows
    first. Callers take the launch itself where nothing is copied."""
    copied = {i: name for (i, name), c in zip(positions.items(), copies) if c}

    def copy_then_launch(*arrays) -> tuple:
        arrays = list(arrays)
        for i, name in copied.items():
            arrays[i] = backend.copy_rows(arrays[i], name)
        return launch(*arrays)

    return copy_then_launch


# Testing aid (normkit.testing.poisoned_outputs): backends fill every output with NaN before the
# launch, so an element the kernel fails to write shows up as NaN.
POISON_OUTPUTS = False
