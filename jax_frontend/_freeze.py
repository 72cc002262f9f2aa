"""``freeze``: stop the gradient of every frozen leaf, so normkit's kernels skip its work."""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

__all__ = ["freeze"]


def _flag(flag, path) -> bool:
    if isinstance(flag, (bool, np.bool_)):
        return bool(flag)
    where = jax.tree_util.keystr(path) or "the root"
    raise TypeError(
        f"normkit.freeze: trainable must hold Python bools (static, decided at trace time); got "
        f"{type(flag).__name__} at {where}")


def _stop(leaf):
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return jax.lax.stop_gradient(leaf)
    return leaf  # a non-array leaf (an int, a string, a config object) has no gradient to stop


def freeze(params: Any, trainable: Any | Callable[[Any], Any]) -> Any:
    """``params`` with ``jax.lax.stop_gradient`` applied to every leaf that is not trainable.

    A stopped leaf is *unperturbed* inside normkit's ``custom_vjp``: its COMPUTE_DW/DB (or DX) flag
    is off, no fp32 partial buffer is allocated, no reduction is launched and its cotangent is a
    symbolic zero. ``jax.grad`` still returns zeros for it (the symbolic zero, instantiated).

    Use it inside the loss function, where the gradient is taken::

        def loss_fn(params, batch):
            params = jax_frontend.freeze(params, trainable)   # e.g. {"norm": {"weight": False}, ...}
            return loss(model(params, batch))

        grads = jax.grad(loss_fn)(params, batch)

    An optimizer mask (``optax.masked``) only masks the *updates*: the gradients it discards are
    still computed. Freeze for speed, and mask too if the optimizer must not touch the frozen leaves
    (weight decay, for instance, acts on a zero gradient).

    Args:
        params: any pytree.
        trainable: a pytree of bools with the structure of ``params`` or a prefix of it (a bool for a
            whole subtree), or a callable ``params -> such a pytree`` (the convention of
            ``optax.masked``). ``True`` means trainable.

    Returns:
        A pytree like ``params``.
    """
    mask = trainable(params) if callable(trainable) else trainable

    def apply(path, flag, subtree):
        return subtree if _flag(flag, path) else jax.tree.map(_stop, subtree)

    try:
        return jax.tree_util.tree_map_with_path(apply, mask, params)
    except ValueError as err:
        raise ValueError(
            f"normkit.freeze: trainable must have the structure of params, or a prefix of it: {err}") from err
