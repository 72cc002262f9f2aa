"""What a norm keeps for its backward, its input or its output (``save=``): the rule both frontends apply.

With every parameter frozen, the backward can recover x_hat from the output y (``normkit.driver``,
``from_output``), so the norm need not keep x alive. ``decide`` is the choice, given what a frontend
knows of the call; the frontends supply the facts (which parameters are trained, and, where the
weight's values can be read, why x_hat could not be recovered from y: ``norm_math.unsafe_reason``).
"""
from __future__ import annotations

from typing import Callable, Optional

from normkit import norm_math
from normkit.ops import Op


def traced_rule(*, has_bias: bool, offset: float, x_dtype: str) -> bool:
    """Where the weight's values are unseen (``jax.jit``, ``torch.compile``): whether only a weight of
    exactly zero, infinite or NaN in some column could break the safety rule. A bias (a LayerNorm's
    trained bias often exceeds its weight in some column), an offset (Gemma's ``1 + w`` vanishes where
    a 16-bit w is -1) and float16 activations (``sqrt(N) max|w|`` reaches 65504 for weights in the
    hundreds) can break it with ordinary values, so those keep the input."""
    return not has_bias and offset == 0.0 and x_dtype != "float16"


def decide(op: Op, save: str, *, trained: list, needs_dx: bool, row_length: int, has_params: bool,
           has_bias: bool, offset: float, x_dtype: str, unsafe: Optional[Callable[[], Optional[str]]],
           hooked: bool = False) -> bool:
    """Whether the backward keeps the output y rather than the input.

    ``trained``: the names of the parameters that need a gradient; ``needs_dx``: whether x (or the
    fused add's residual) does; ``unsafe``: a function giving the reason the weight cannot give x_hat
    back (or None where it can), where the weight's values can be read, else None (traced);
    ``hooked``: the call runs inside a non-reentrant activation checkpoint (Torch), its forward or
    its recomputation.

    ``"input"`` keeps the input; ``"output"`` keeps the output, and raises for a trained parameter, for
    rows too short to recover x_hat from (``norm_math.output_degenerate``) or, where the values are
    read, an unsafe weight; ``"auto"`` keeps the output where every parameter is frozen, x needs a
    gradient, no checkpoint is recomputing the call (the backward reads what the recomputation saved,
    and a parameter's ``requires_grad`` may have changed since the forward, which would change the
    decision: it keeps what needs no decision to agree), the rows are long enough and the weight
    passes the safety rule (``norm_math``); traced, it takes ``traced_rule`` instead of the weight's values, and
    the kernels give a NaN dx if the weight turns out unsafe.
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
    if norm_math.output_degenerate(row_length, is_rms=op.is_rms):
        if save == "output":
            raise ValueError(
                f"normkit: save='output' cannot recover x_hat from rows of {row_length} element"
                f"{'' if row_length == 1 else 's'} ({op.name}: x_hat is +-1 there and dx cancels); pass save='auto' "
                "or 'input'")
        return False
    if hooked and save == "auto":
        return False
    if not has_params:
        return True
    if unsafe is None:  # traced: the values are unseen
        return save == "output" or traced_rule(has_bias=has_bias, offset=offset, x_dtype=x_dtype)
    reason = unsafe()
    if reason is None:
        return True
    if save == "output":
        raise ValueError(f"normkit: save='output' cannot recover x_hat from the output with this weight: {reason}; "
                         "pass save='auto' or 'input'")
    return False
