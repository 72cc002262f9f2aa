"""Eager call signatures and their bound plans: the Torch frontend's one cache.

A call signature is the op, its options (``save`` among them), whether the forward stores statistics
for a backward, and each tensor's class, shape, strides, dtype and device: everything
``normkit.driver.Bound``'s plans fix. Its first eager call is validated (``bind``); a repeated one (a
training loop's) finds its ``Signature`` by ``key`` and launches its ``Bound`` with no validation,
planning or reshaping. A signature holds one ``Bound`` per choice of what the backward keeps (input or
output) and remembers that choice per frozen weight (its identity and version: ``Signature.route``), so
a repeated call decides it with one small lookup. The backward plans live on each ``Bound``, keyed on
what they read (a saved-tensor hook may hand the backward other layouts than the forward saw).
"""
from __future__ import annotations

from normkit import driver
from normkit.ops import Op, Options
from torch_frontend import _save
from torch_frontend._backend import BACKEND

BOUND: dict = {}
BOUND_LIMIT = 4096  # distinct call signatures kept (a model has a handful); past it, start again
DECISIONS_LIMIT = 4096  # weight versions remembered per signature: every layer's norm of one width shares one


def key(op: Op, eps, offset, casting_mode, store_stats: bool, x, residual, weight, bias, save: str = "auto") -> tuple:
    """The signature of a call (each option with its class: ``1e-6`` and ``np.float64(1e-6)`` are
    validated apart). Raises AttributeError for a non-tensor, RuntimeError for a tensor without
    strides or sizes (sparse, nested): the caller then validates, which names it."""
    return (op.name, store_stats, save, eps.__class__, eps, offset.__class__, offset, casting_mode.__class__,
            casting_mode, x.__class__, x.shape, x.stride(), x.dtype, x.device,
            None if residual is None else (residual.__class__, residual.shape, residual.stride(), residual.dtype,
                                           residual.device),
            None if weight is None else (weight.__class__, weight.shape, weight.stride(), weight.dtype, weight.device),
            None if bias is None else (bias.__class__, bias.shape, bias.stride(), bias.dtype, bias.device))


class Signature:
    """A validated call signature: its ``Bound`` for each choice of what the backward keeps, and the
    choices made for the weights seen with it."""

    __slots__ = ("op", "opts", "store_stats", "b_dtype", "save", "fixed", "_bounds", "_decisions")

    def __init__(self, op: Op, opts: Options, store_stats: bool, b_dtype: str, save: str):
        self.op, self.opts, self.store_stats, self.b_dtype, self.save = op, opts, store_stats, b_dtype, save
        self._bounds = [None, None]  # keeping the input, keeping the output
        self._decisions: dict = {}
        # where there is nothing to decide (no backward, or save="input"), every call's Bound: the
        # input-keeping one; else None, and ``route`` decides per call
        self.fixed = self.bound(False) if not store_stats or save == "input" else None

    def bound(self, from_output: bool) -> driver.Bound:
        b = self._bounds[from_output]
        if b is None:
            b = self._bounds[from_output] = driver.Bound(BACKEND, self.op, self.opts, self.store_stats, from_output,
                                                         self.b_dtype)
        return b

    @property
    def bounds(self) -> list:
        """The ``Bound``s made so far."""
        return [b for b in self._bounds if b is not None]

    def route(self, x, weight, bias) -> driver.Bound:
        """The ``Bound`` of this call (``fixed`` where that is set): keeping the output where
        ``_save.saves_output`` says so, else the input. x's dtype and row length, and every option,
        are the signature's, so the answer is remembered per weight and bias identity, data pointer,
        version and grad flag."""
        if self.fixed is not None:
            return self.fixed
        k = (None if weight is None else (getattr(weight, "_normkit_uid", None) or _save.uid(weight), weight.data_ptr(),
                                          weight._version, weight.requires_grad),
             None if bias is None else (getattr(bias, "_normkit_uid", None) or _save.uid(bias), bias.data_ptr(),
                                        bias._version, bias.requires_grad))
        from_output = self._decisions.get(k)
        if from_output is None:
            if len(self._decisions) >= DECISIONS_LIMIT:
                self._decisions.clear()
            opts = self.opts
            from_output = self._decisions[k] = _save.saves_output(self.op, self.save, x, weight, bias, opts.offset,
                                                                  opts.casting)
        return self._bounds[from_output] or self.bound(from_output)


def bind(k: tuple | None, op: Op, opts: Options, store_stats: bool, b_dtype: str = "float32",
         save: str = "auto") -> Signature:
    """The ``Signature`` of a validated call (``b_dtype``: the bias's dtype, dB's), remembered under
    ``k`` (None: not remembered)."""
    sig = Signature(op, opts, store_stats, b_dtype, save)
    if k is not None:
        if len(BOUND) >= BOUND_LIMIT:
            BOUND.clear()
        BOUND[k] = sig
    return sig
