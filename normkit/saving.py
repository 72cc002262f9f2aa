"""What a norm keeps for its backward, its input or its output (``save=``): the rule both frontends apply.

With every parameter frozen, the backward can recover x_hat from the output y (``normkit.driver``,
``from_output``), so the norm need not keep x alive. ``decide`` is the choice, given what a frontend
knows of the call; the frontends supply the facts (which parameters are trained, and, where the
weight's values can be read, why x_hat could not be recovered from y: ``norm_math.unsafe_reason``).
"""
from __future__ import annotations

from typing import Callable, Optional

from normkit.ops import Op


def decide(op: Op, save: str, *, trained: list, needs_dx: bool, row_length: int, has_params: bool,
           has_bias: bool, offset: float, unsafe: Optional[Callable[[], Optional[str]]]) -> bool:
    """Whether the backward keeps the output y rather than the input.

    ``trained``: the names of the parameters that need a gradient; ``needs_dx``: whether x (or the
    fused add's residual) does; ``unsafe``: a function giving the reason the weight cannot give x_hat
    back (or None where it can), where the weight's values can be read, else None (traced).

    ``"input"`` keeps the input; ``"output"`` keeps the output, and raises for a trained parameter or,
    where the values are read, an unsafe weight; ``"auto"`` keeps the output where every parameter is
    frozen, x needs a gradient, rows are longer than one element (a one-element row's dx cancels to
    nearly zero, where recovering x_hat costs relative accuracy) and the weight is safe; traced, it
    takes that where only a weight of exactly zero could make it unsafe (no bias, no offset), and the
    kernels give a NaN dx if one does.
    """
    if save == "input":
        return False
    if trained:
        if save == "output":
            raise ValueError(
                f"normkit: save='output' needs every parameter of {op.name} frozen, but {' and '.join(trained)} "
                f"{'requires' if len(trained) == 1 else 'require'} a gradient (dW needs the input); pass "
                "save='auto' or 'input'")
        return False
    if not needs_dx:
        return False
    if row_length == 1 and save == "auto":
        return False
    if not has_params:
        return True
    if unsafe is None:  # traced: the values are unseen
        return save == "output" or (not has_bias and offset == 0.0)
    reason = unsafe()
    if reason is None:
        return True
    if save == "output":
        raise ValueError(f"normkit: save='output' cannot recover x_hat from the output with this weight: {reason}; "
                         "pass save='auto' or 'input'")
    return False
