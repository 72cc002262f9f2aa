"""Eager call signatures and their bound plans: the Torch frontend's one cache.

A call signature is the op, its options (``save`` among them), whether the forward stores statistics
for a backward, the dtype of the copy of y it writes for y's consumers (if any: ``key``'s ``copy``),
and each tensor's class, shape, strides, dtype and device: everything
``normkit.driver.Bound``'s plans fix. Its first eager call is validated (``bind``); a repeated one (a
training loop's) finds its ``Signature`` among the op's last few (``last``: its options compared, its
tensors' layouts checked in C++) or by ``key``, and launches a ``Bound`` with no validation, planning
or reshaping.

A signature holds one ``Bound`` per choice of what the backward keeps (the input, or the output) and
remembers that choice per frozen weight: its identity, data pointer, version and grad flag
(``Signature.route``), so a repeated call decides with one small lookup, and reads the weight's
values (one host synchronization) only when it first meets a weight version. The choice then rides
with the saved state: an autograd node's backward reads what its own forward kept. ``rms_norm_rope``'s
signatures (``torch_frontend._rope._Signature``: its own plans, the same ``Decisions``) are kept here too.

A weight written where torch's version counter does not see it (``w.data[i] = 0``, a write through
``w.numpy()`` or DLPack) keeps its cached choice. The forward that keeps the output checks the
weight on the device at every call (its recovery, ``normkit.norm_math.recovery``): where the weight
breaks the safety rule that call's dx is NaN, never wrong, and the forward sets a flag in host memory
(``TRIP``) that the next call reads without synchronizing; every remembered choice is then forgotten
and made again from the weights' values.

``rms_norm_rope``'s output-keeping forward also checks the rotary tables on the device (every pair of
table columns a usable rotation: ``normkit.norm_math.rope_table_usable``); where one is not, that
call's backward gives its rows a NaN dx and the forward sets the flag's second slot. The next
``rms_norm_rope`` call reads it (``rope_tables_tripped``), warns (``NormkitRopeTablesWarning``) and
turns on one process-wide switch, ``ROPE_TABLES_KEEP_X``: from then on ``save="auto"`` keeps x for
``rms_norm_rope`` (eager, and in graphs compiled after it, which read it while tracing). ``reset()``
turns it off again.
"""
from __future__ import annotations

import ctypes
import itertools
import warnings

import torch

from normkit import driver, norm_math
from normkit.ops import Op, Options
from torch_frontend import _compat, _save
from torch_frontend._backend import BACKEND, NormkitRopeTablesWarning

BOUND: dict = {}
BOUND_LIMIT = 4096  # distinct call signatures kept (a model has a handful); past it, start again
DECISIONS_LIMIT = 4096  # weight versions remembered per signature: every layer's norm of one width shares one


def key(op: Op, eps, offset, casting_mode, store_stats: bool, x, residual, weight, bias, save: str = "auto",
        copy: torch.dtype | None = None) -> tuple:
    """The signature of a call (each option with its class: ``1e-6`` and ``np.float64(1e-6)`` are
    validated apart). ``copy``: the dtype in which the forward also writes y (Y2), or None: a plan
    with that store and one without are bound apart. Raises AttributeError for a non-tensor,
    RuntimeError for a tensor without strides or sizes (sparse, nested): the caller then validates,
    which names it."""
    return (op.name, store_stats, save, copy, eps.__class__, eps, offset.__class__, offset, casting_mode.__class__,
            casting_mode, x.__class__, x.shape, x.stride(), x.dtype, x.device,
            None if residual is None else (residual.__class__, residual.shape, residual.stride(), residual.dtype,
                                           residual.device),
            None if weight is None else (weight.__class__, weight.shape, weight.stride(), weight.dtype, weight.device),
            None if bias is None else (bias.__class__, bias.shape, bias.stride(), bias.dtype, bias.device))


# --- the flag the output-keeping forward sets where a weight breaks the safety rule -----------------

# device type -> (int32 [2] tensor the kernels write, a ctypes view of it the host reads): slot 0, a
# weight breaking the safety rule (every output-keeping forward); slot 1, rms_norm_rope's tables with
# a pair that is not a usable rotation. Each slot is written by one kind of store only (the constant 1).
_TRIPS: dict = {}
WEIGHT, TABLES = 0, 1  # the slots


_TRIP_FLAGS: list = []  # the ctypes views of ``_TRIPS``, for the per-call look (empty: no flag made yet)


def trip(device: torch.device):
    """The flags for launches on ``device``: host memory the kernel writes (pinned, for CUDA kernels)."""
    entry = _TRIPS.get(device.type)
    if entry is None:
        t = torch.zeros(2, dtype=torch.int32, pin_memory=device.type == "cuda")
        entry = _TRIPS[device.type] = (t, (ctypes.c_int32 * 2).from_address(t.data_ptr()))
        _TRIP_FLAGS.append(entry[1])
    return entry[0]


def _tripped() -> bool:
    """Whether a forward has found a weight breaking the safety rule since the last look; then every
    remembered choice is forgotten (and the flag cleared)."""
    for flag in _TRIP_FLAGS:
        if flag[WEIGHT]:
            flag[WEIGHT] = 0
            for entry in BOUND.values():
                entry.forget()
            return True
    return False


# --- rms_norm_rope's tables: the process-wide switch ----------------------------------------------

ROPE_TABLES_KEEP_X = False  # set once a forward has found rotary tables the output-saving backward cannot invert


def rope_tables_tripped() -> bool:
    """``ROPE_TABLES_KEEP_X``, after reading the tables' flag: where an output-keeping ``rms_norm_rope``
    forward has found a pair of table columns that is not a usable rotation since the last look, the
    flag is cleared, a ``NormkitRopeTablesWarning`` says so, and the switch is turned on."""
    global ROPE_TABLES_KEEP_X
    for flag in _TRIP_FLAGS:
        if flag[TABLES]:
            flag[TABLES] = 0
            ROPE_TABLES_KEEP_X = True
            warnings.warn(
                "normkit: rms_norm_rope's cos/sin have a pair of columns that is not a rotation (the pair check "
                f"2|cos_a cos_b + sin_a sin_b| >= {norm_math.ROPE_TABLE_RATIO:g} (cos_a^2 + sin_a^2 + cos_b^2 + "
                "sin_b^2) fails), so the output cannot be rotated back accurately: the last output-saving backward "
                "gave those rows a NaN dx. From now on save='auto' keeps x for rms_norm_rope in this process "
                "(save='output' keeps poisoning those rows); pass save='input' to avoid it",
                NormkitRopeTablesWarning, stacklevel=5)
    return ROPE_TABLES_KEEP_X


def rope_tables_state_set() -> bool:
    """Whether ``ROPE_TABLES_KEEP_X`` is on or a tables' flag is set (unread): what ``reset`` clears."""
    return ROPE_TABLES_KEEP_X or any(flag[TABLES] for flag in _TRIP_FLAGS)


def weight_tripped_unread() -> bool:
    """Whether a forward has found a weight breaking the safety rule that no call has read since (the
    next call's decision forgets every remembered choice): what ``reset`` also clears."""
    return any(flag[WEIGHT] for flag in _TRIP_FLAGS)


def reset() -> None:
    """Turn ``ROPE_TABLES_KEEP_X`` off, clear both flags and forget every remembered save choice: the
    process's state as at import, but for the call signatures' plans (for tests, or once the tables
    have been fixed)."""
    global ROPE_TABLES_KEEP_X
    for flag in _TRIP_FLAGS:
        flag[WEIGHT] = flag[TABLES] = 0
    for entry in BOUND.values():
        entry.forget()
    ROPE_TABLES_KEEP_X = False


_UIDS = itertools.count(1)


def uid(t) -> int:
    """The tensor object's own number (from 1), given on first sight: a data pointer alone is not an
    identity (a freed weight's memory is handed to the next tensor, whose ``_version`` starts at 0
    again)."""
    n = getattr(t, "_normkit_uid", None)
    if n is None:
        n = t._normkit_uid = next(_UIDS)
    return n


def _version_key(t):
    """A parameter's identity, data pointer, version and grad flag (None for None); None for an
    inference tensor, which has no version counter (it is never remembered: torch refuses to save
    it for a backward anyway, and says to clone it)."""
    if t is None:
        return None
    try:
        return uid(t), t.data_ptr(), t._version, t.requires_grad
    except RuntimeError:  # "Inference tensors do not track version counter"
        return False


class Decisions:
    """The choices of what the backward keeps (True: the output) made for the weights seen with one
    call signature, per weight and bias identity, data pointer, version and grad flag: a
    ``Signature``'s, or ``rms_norm_rope``'s signature's (``torch_frontend._rope``)."""

    __slots__ = ("memo",)

    def __init__(self):
        self.memo: dict = {}  # (weight's key, bias's key) -> the choice

    def forget(self) -> None:
        self.memo.clear()

    def remembered(self, weight, bias):
        """The choice remembered for this weight and bias version, or None: the key of
        ``_version_key``, built inline (every call looks) for parameters seen before (their uid given)."""
        try:
            return self.memo.get((
                weight if weight is None else (weight._normkit_uid, weight.data_ptr(), weight._version,
                                               weight.requires_grad),
                bias if bias is None else (bias._normkit_uid, bias.data_ptr(), bias._version, bias.requires_grad)))
        except (AttributeError, RuntimeError):  # not seen before, or an inference tensor
            return None

    def saves_output(self, weight, bias, decide, *args) -> bool:
        """The remembered choice for this weight and bias version, else ``decide(*args)``'s (remembered,
        unless a parameter is an inference tensor); a remembered choice to keep the output is made
        again after a forward has found a weight breaking the safety rule (``_tripped``)."""
        from_output = self.remembered(weight, bias)
        if from_output is None or (from_output and _TRIP_FLAGS and _tripped()):
            k = (_version_key(weight), _version_key(bias))
            from_output = decide(*args)
            if False not in k:
                if len(self.memo) >= DECISIONS_LIMIT:
                    self.memo.clear()
                self.memo[k] = from_output
        return from_output


def remember(k: tuple, entry) -> None:
    """Keep ``entry`` (whose ``forget()`` drops its save choices) for call signature ``k``."""
    if len(BOUND) >= BOUND_LIMIT:
        clear()
    BOUND[k] = entry


def clear() -> None:
    """Forget every call signature (and each op's last one, ``last``)."""
    BOUND.clear()
    _LAST.clear()


# --- each op's last signatures, tried first ------------------------------------------------------
# A training loop calls each norm with few signatures, again and again. Each op's last few signatures
# found in ``BOUND`` (op name -> [(options, check, Signature)], the most recent first) are tried
# before the key is built: the call's options compared as a tuple, its tensors by a C++ check of
# their layouts (``_compat.layout_check``, made once per signature), which costs less than building
# and hashing ``key``. Pointers into BOUND, not a second table: they name BOUND's signatures and are
# forgotten with them.
_LAST: dict = {}
LAST_PER_OP = 4


def options(store_stats: bool, save, copy, eps, offset, casting_mode) -> tuple:
    """What ``key`` holds of a call besides its tensors' layouts, each option's class before its value (so
    that a comparison stops at the class: ``1e-6`` and ``np.float64(1e-6)`` differ there)."""
    return (store_stats, save, copy, eps.__class__, offset.__class__, casting_mode.__class__, eps, offset, casting_mode)


def last(op: Op, opts: tuple, x, residual, weight, bias):
    """One of the op's last signatures (``note``) made for this call's options and its tensors' layouts
    (dtype, device, sizes, strides, dispatch keys, grad flags), else None."""
    entries = _LAST.get(op.name)
    if entries is not None:
        for entry in entries:
            if entry[0] == opts and entry[1](x, residual, weight, bias):
                return entry[2]
    return None


def note(op: Op, opts: tuple, x, residual, weight, bias, sig) -> None:
    """Make ``sig``, found in BOUND (or just put there) for this call, the op's most recent signature."""
    if not _compat.LAYOUT_CHECKS:
        return
    same = sig.layouts
    if same is None:
        same = sig.layouts = _layouts(x, residual, weight, bias)
    entries = _LAST.setdefault(op.name, [])
    entries[:] = [(opts, same, sig)] + [e for e in entries if e[2] is not sig][:LAST_PER_OP - 1]


def _layouts(x, residual, weight, bias):
    """``same(x, residual, weight, bias) -> bool``: whether a call's tensors are present where these are,
    with these layouts."""
    arrays = (x, residual, weight, bias)
    present = tuple(i for i, t in enumerate(arrays) if t is not None)
    check = _compat.layout_check(tuple(arrays[i] for i in present))
    if present == (0, 2):  # rms_norm with a weight
        return lambda x, r, w, b: r is None and b is None and w is not None and check(x, w)
    if present == (0, 1, 2):  # fused_add_rms_norm with a weight
        return lambda x, r, w, b: b is None and r is not None and w is not None and check(x, r, w)
    if present == (0, 2, 3):  # layer_norm with a weight and a bias
        return lambda x, r, w, b: r is None and w is not None and b is not None and check(x, w, b)

    def same(*tensors):
        for i, t in enumerate(tensors):
            if (t is None) != (i not in present):
                return False
        return check(*[t for t in tensors if t is not None])
    return same


class Signature:
    """A validated call signature: its ``Bound`` for each choice of what the backward keeps, and the
    choices made for the weights seen with it."""

    __slots__ = ("op", "opts", "store_stats", "b_dtype", "save", "y2_dtype", "fixed", "layouts", "_bounds",
                 "_decisions")

    def __init__(self, op: Op, opts: Options, store_stats: bool, b_dtype: str, save: str,
                 y2_dtype: str | None = None):
        self.op, self.opts, self.store_stats, self.b_dtype, self.save = op, opts, store_stats, b_dtype, save
        self.y2_dtype = y2_dtype  # the dtype of y's copy that each Bound's forward writes (None: none)
        self._bounds = [None, None]  # keeping the input, keeping the output
        self._decisions = Decisions()
        self.layouts = None  # the check of its tensors' layouts, once made (``note``)
        # where there is nothing to decide (no backward, or save="input"), every call's Bound: the
        # input-keeping one; else None, and ``route`` decides per call
        self.fixed = self.bound(False) if not store_stats or save == "input" else None

    def bound(self, from_output: bool, device: torch.device | None = None) -> driver.Bound:
        """The ``Bound`` keeping the input, or the output (whose forward sets ``trip(device)``, where a
        device is given, when the weight breaks the safety rule)."""
        b = self._bounds[from_output]
        if b is None:
            if from_output and device is not None and _compat.transforms_active():
                # under a torch.func transform the Function raises before any launch: nothing is kept
                return driver.Bound(BACKEND, self.op, self.opts, self.store_stats, from_output, self.b_dtype,
                                    y2_dtype=self.y2_dtype)
            flag = trip(device) if from_output and device is not None else None
            b = self._bounds[from_output] = driver.Bound(BACKEND, self.op, self.opts, self.store_stats, from_output,
                                                         self.b_dtype, flag, self.y2_dtype)
        return b

    @property
    def bounds(self) -> list:
        """The ``Bound``s made so far."""
        return [b for b in self._bounds if b is not None]

    def forget(self) -> None:
        self._decisions.forget()

    def route(self, x, weight, bias) -> driver.Bound:
        """The ``Bound`` of this call: the output-keeping one where ``_save.saves_output`` says so, else
        the input-keeping one. x's dtype and row length, and every option, are the signature's, so the
        answer is remembered per weight and bias identity, data pointer, version and grad flag. Inside
        a non-reentrant checkpoint (its forward and its recomputation) ``save="auto"`` keeps the input
        (``normkit.saving.decide``)."""
        if self.fixed is not None:
            return self.fixed
        hooked = _compat.checkpointing()
        if hooked and self.save == "auto":
            return self._bounds[0] or self.bound(False)
        from_output = self._decisions.remembered(weight, bias)
        if from_output:
            for flag in _TRIP_FLAGS:  # ``_tripped``'s look, inline
                if flag[WEIGHT]:
                    from_output = None
        if from_output is None:
            opts = self.opts
            from_output = self._decisions.saves_output(weight, bias, _save.saves_output, self.op, self.save, x, weight,
                                                       bias, opts.offset, opts.casting, hooked)
        return self._bounds[from_output] or self.bound(from_output, x.device)


def bind(k: tuple | None, op: Op, opts: Options, store_stats: bool, b_dtype: str = "float32",
         save: str = "auto", y2_dtype: str | None = None) -> Signature:
    """The ``Signature`` of a validated call (``b_dtype``: the bias's dtype, dB's; ``y2_dtype``: the dtype
    of y's copy its forward writes, as ``key``'s ``copy``), remembered under ``k`` (None: not
    remembered)."""
    sig = Signature(op, opts, store_stats, b_dtype, save, y2_dtype)
    if k is not None:
        remember(k, sig)
    return sig
