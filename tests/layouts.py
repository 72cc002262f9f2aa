"""Input layouts for the property tests (tests/test_properties.py), built per frontend.

A *layout* says how an input's values are laid out in memory: the test draws the values of a
*base* buffer (NumPy, float64, already rounded to the input's dtype, NaN in any padding that the
view must not read) and each frontend builds, from that base, the *view* it passes to the op.

- Torch: the view is a real strided / expanded / sliced / transposed view of a torch tensor holding
  the base, and the differentiated leaf is that view itself (``view.detach().requires_grad_()``
  keeps its strides), so ``leaf.grad`` is the gradient of the view.
- JAX: arrays have no user-visible strides, so the same values are reached by slicing /
  broadcasting / transposing the base inside the jitted function, and the vjp is taken there with
  respect to those views (the op's arguments). Differentiating the base instead would add XLA's
  transpose of the layout (sums over broadcast axes): for a column-expanded x those sums cancel
  exactly in exact arithmetic (rows are constant), so in bf16 they are rounding noise, for any
  correct kernel.

Either way the gradient reported for an input is that of the view, element by element, and is
compared with the float64 reference as it is. Row inputs (x, residual) and output gradients (dy,
d_residual_out) have the shape ``(*lead, D)``; weight and bias ``(D,)``.

``KITS[frontend_name]`` runs one case (forward, then backward of the used outputs) under
``normkit.testing.poisoned_outputs()`` and returns an ``Outcome`` in NumPy; the test body never
branches on the frontend except through this module.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import numpy as np

import normkit
from normkit.testing import poisoned_outputs

PAD = 13  # extra columns of a row-strided buffer (NaN-filled) and extra rows of a transposed one

ROW_LAYOUTS = (  # x and residual, and the output gradients dy and d_residual_out
    "contiguous",
    "strided_rows",  # buf[..., :D] of a buffer D + PAD wide: row stride D + PAD, last dim contiguous
    "expanded_row",  # t[:1].expand(M, D): every row the same, row stride 0
    "expanded_col",  # t[:, :1].expand(M, D): every row constant, last-dim stride 0
    "transposed",  # buf.movedim(0, -1)[..., :D] of a (D + PAD, *lead) buffer: last dim not contiguous
    # buf.movedim(-2, -3)[..., :D] of a (*lead[:-2], lead[-1], lead[-2], D + PAD) buffer: the last two
    # leading dims swapped, as a [B, S, H, D] view of a [B, H, S, D] gradient: rows of three indices
    "swapped_lead",
)
PARAM_LAYOUTS = (
    "contiguous",
    "slice2",  # w_big[::2] of a 2*D buffer (NaN at the odd positions): element stride 2
    "slice3",  # w_big[1::3] of a 3*D buffer (NaN elsewhere): offset 1, element stride 3
    "expanded",  # torch.tensor(v).expand(D): element stride 0, every element the same
)


# ---------------------------------------------------------------------------------------------
# The layouts in NumPy: the base's shape, the base (with NaN padding), the view.


def base_shape(kind: str, shape: tuple) -> tuple:
    *lead, D = shape
    lead = tuple(lead)
    return {
        "contiguous": shape,
        "strided_rows": lead + (D + PAD,),
        "expanded_row": (1,) * len(lead) + (D,),
        "expanded_col": lead + (1,),
        "transposed": (D + PAD,) + lead,
        "swapped_lead": lead[:-2] + lead[-2:][::-1] + (D + PAD,),
        "slice2": (2 * D,),
        "slice3": (3 * D,),
        "expanded": (),
    }[kind]


def make_base(kind: str, shape: tuple, values) -> np.ndarray:
    """The base buffer: ``values(s)`` (a float64 array of shape s) where the view reads, NaN elsewhere."""
    D = shape[-1]
    if kind == "strided_rows":
        base = np.full(base_shape(kind, shape), np.nan)
        base[..., :D] = values(shape)
        return base
    if kind in ("transposed", "swapped_lead"):
        base = np.full(base_shape(kind, shape), np.nan)
        view_np(kind, base, shape)[...] = values(shape)
        return base
    if kind in ("slice2", "slice3"):
        base = np.full(base_shape(kind, shape), np.nan)
        base[_PARAM_SLICES[kind]] = values(shape)
        return base
    bshape = base_shape(kind, shape)
    return np.asarray(values(bshape), dtype=np.float64).reshape(bshape)


_PARAM_SLICES = {"slice2": slice(None, None, 2), "slice3": slice(1, None, 3)}


def _views(expand, movedim):
    """The view of each layout, written once over a framework's expand and movedim."""
    return {
        "contiguous": lambda b, shape: b,
        "strided_rows": lambda b, shape: b[..., : shape[-1]],
        "expanded_row": expand,
        "expanded_col": expand,
        "transposed": lambda b, shape: movedim(b, 0, -1)[..., : shape[-1]],
        "swapped_lead": lambda b, shape: (movedim(b, -2, -3) if len(shape) > 2 else b)[..., : shape[-1]],
        "slice2": lambda b, shape: b[::2],
        "slice3": lambda b, shape: b[1::3],
        "expanded": expand,
    }


NP_VIEWS = _views(lambda b, shape: np.broadcast_to(b, shape), np.moveaxis)


def view_np(kind: str, base: np.ndarray, shape: tuple) -> np.ndarray:
    """The values the op sees: what every frontend's view of the base must hold."""
    v = NP_VIEWS[kind](base, shape)
    assert v.shape == tuple(shape), (kind, v.shape, shape)
    return v


# ---------------------------------------------------------------------------------------------
# One case, as a frontend runs it.


@dataclasses.dataclass(frozen=True)
class Arg:
    """One input leaf, or one output gradient."""

    base: np.ndarray  # float64 values, exact in ``dtype``; NaN where the view must not read
    dtype: str  # "float32", "bfloat16", "float16" or "float64"
    kind: str  # a layout name
    shape: tuple  # the shape of the view


@dataclasses.dataclass
class Outcome:
    outputs: dict  # output name -> float64 array (the view's shape)
    grads: dict  # input name -> float64 gradient of its view, or None where none was produced
    bases_after: dict  # leaf and cotangent name -> float64 base buffer as it is after the backward
    log: list  # the launches recorded during the call
    # For the fused op with x and residual both trained (distinct leaves): asserts that their
    # gradients are independent (no shared storage; writing one leaves the other unchanged).
    check_independent: callable = None
    copied: tuple = ()  # the names of the arrays a frontend copied, saying so (torch: NormkitCopyWarning)


def _apply(module, op: str, args: dict, kwargs: dict) -> dict:
    if op == "rms_norm":
        return {"y": module.rms_norm(args["x"], args.get("weight"), **kwargs)}
    if op == "layer_norm":
        return {"y": module.layer_norm(args["x"], args.get("weight"), args.get("bias"), **kwargs)}
    y, s = module.fused_add_rms_norm(args["x"], args["residual"], args.get("weight"), **kwargs)
    return {"y": y, "residual_out": s}


class TorchKit:
    """Real strided / expanded / sliced torch views; the leaves are the views themselves."""

    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch
        self.views = _views(lambda b, shape: b.expand(shape), torch.movedim)
        self.dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                       "float64": torch.float64}

    def _tensor(self, a: Arg, device=None):
        """The base, at the start of a NaN-filled storage as large as base plus view (on ``device``,
        the CPU by default): a kernel that ignores a stride (0 or > 1) and reads past the base reads
        NaN, deterministically, rather than whatever memory follows a small allocation."""
        torch = self.torch
        values = torch.from_numpy(np.array(a.base, dtype=np.float64)).to(device, self.dtypes[a.dtype])
        storage = torch.full((values.numel() + math.prod(a.shape) + 16,), float("nan"), dtype=values.dtype,
                             device=values.device)
        base = storage[: values.numel()].view(values.shape)
        base.copy_(values)
        return base

    def _np(self, t):
        return None if t is None else t.detach().to(self.torch.float64).numpy().copy()

    def run(self, op: str, kwargs: dict, leaves: dict, trained: frozenset, tied: bool, cotangents: dict,
            how: str) -> Outcome:
        """``leaves``: name -> Arg for x, residual (absent when tied to x), weight, bias; ``cotangents``:
        output name -> Arg for each output whose gradient flows back (y always; residual_out or not).
        ``how`` (the JAX freezing mechanism) has no meaning here."""
        import torch_frontend as tf

        torch = self.torch
        bases = {name: self._tensor(a) for name, a in {**leaves, **cotangents}.items()}
        args = {}
        for name, a in leaves.items():
            view = self.views[a.kind](bases[name], a.shape).detach()  # a leaf with the view's strides
            assert tuple(view.shape) == tuple(a.shape)
            args[name] = view.requires_grad_(name in trained)
        if tied:
            args["residual"] = args["x"]
        cots = {name: self.views[a.kind](bases[name], a.shape) for name, a in cotangents.items()}
        with normkit.record_launches() as log, poisoned_outputs(), warnings.catch_warnings(record=True) as caught:
            # A layout the kernels cannot read in place is copied, with this warning: recorded.
            warnings.simplefilter("always", tf.NormkitCopyWarning)
            outs = _apply(tf, op, args, kwargs)
            if trained:
                torch.autograd.backward([outs[name] for name in cotangents], [cots[name] for name in cotangents])
        grads = {name: self._np(args[name].grad) for name in leaves}
        return Outcome(
            outputs={name: self._np(t) for name, t in outs.items()},
            grads=grads,
            bases_after={name: self._np(t) for name, t in bases.items()},
            log=log,
            check_independent=lambda: self._check_independent(args["x"].grad, args["residual"].grad),
            copied=tuple(str(w.message).removeprefix("normkit: ").split(" of shape")[0] for w in caught),
        )

    def _check_independent(self, gx, gr) -> None:
        """x.grad and residual.grad are two tensors: no shared storage, and writing one leaves the other."""
        torch = self.torch
        assert gx is not None and gr is not None, "x and residual are trained but one got no gradient"
        if gx.numel() == 0:
            return  # no elements, no storage to share
        assert gx.data_ptr() != gr.data_ptr(), "x.grad and residual.grad share storage (same data_ptr)"
        assert gx.untyped_storage().data_ptr() != gr.untyped_storage().data_ptr(), (
            "x.grad and residual.grad are views of one storage")
        before = gr.clone()
        gx.add_(1.0)  # a user clipping or zeroing x.grad in place
        assert torch.equal(gr, before), "writing x.grad in place changed residual.grad"
        gx.sub_(1.0)


class JaxKit:
    """The same values through slicing / broadcasting / transposing the bases inside the jitted
    function; the views are differentiated there, the frozen ones left out of the vjp ("argnums")
    or stopped by ``jax_frontend.freeze``."""

    name = "jax"

    def __init__(self, module=None):
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp = jax, jnp
        self.module = module  # jax_frontend, or the adapter's view of it with implementation= bound
        self.views = _views(lambda b, shape: jnp.broadcast_to(b, shape), jnp.moveaxis)
        self.dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
                       "float64": jnp.float64}

    def _array(self, a: Arg):
        host = np.asarray(a.base, dtype=np.float64 if a.dtype == "float64" else np.float32)
        return self.jnp.asarray(host).astype(self.dtypes[a.dtype])  # exact: the values are rounded already

    def _np(self, a):
        if a is None:
            return None
        a = self.jnp.asarray(a)
        wide = self.jnp.float64 if a.dtype == self.jnp.float64 else self.jnp.float32
        return np.asarray(a.astype(wide), dtype=np.float64).copy()

    def run(self, op: str, kwargs: dict, leaves: dict, trained: frozenset, tied: bool, cotangents: dict,
            how: str) -> Outcome:
        """As TorchKit.run; ``how`` is "argnums" (only the trained inputs are differentiated, and with
        nothing trained there is no backward at all) or "freeze" (every input is differentiated and
        ``jax_frontend.freeze`` stops the frozen ones: their gradients must be exactly zero)."""
        import jax_frontend

        jf = self.module or jax_frontend
        jax = self.jax
        wide = any(a.dtype == "float64" for a in {**leaves, **cotangents}.values())
        with jax.enable_x64(True) if wide else contextlib.nullcontext():
            arrays = {name: self._array(a) for name, a in leaves.items()}
            cot_arrays = {name: self._array(a) for name, a in cotangents.items()}

            def fn(diff, const):
                args = {**const, **diff}
                if how == "freeze":
                    args = jf.freeze(args, {name: name in trained for name in args})
                if tied:
                    args["residual"] = args["x"]
                outs = _apply(jf, op, args, kwargs)
                return {name: outs[name] for name in cotangents}, outs

            def run(arrays, cot_arrays):
                # The layouts, inside the jit: each view from its base.
                views = {name: self.views[a.kind](arrays[name], a.shape) for name, a in leaves.items()}
                cots = {name: self.views[a.kind](cot_arrays[name], a.shape) for name, a in cotangents.items()}
                if how == "argnums" and not trained:
                    return fn({}, views)[1], {}
                diff = {k: v for k, v in views.items() if how == "freeze" or k in trained}
                const = {k: v for k, v in views.items() if k not in diff}
                _, vjp, outs = jax.vjp(lambda d: fn(d, const), diff, has_aux=True)
                (grads,) = vjp(cots)
                return outs, grads

            with normkit.record_launches() as log, poisoned_outputs(), jax.numpy_dtype_promotion("strict"):
                outs, grads = jax.jit(run)(arrays, cot_arrays)  # a fresh jit: traced (and recorded) every call
            report = {}
            for name in leaves:
                g = grads.get(name)
                if name not in trained and g is not None:  # "freeze": an instantiated symbolic zero
                    assert not np.any(self._np(g)), f"frozen {name} got a nonzero gradient"
                    g = None
                report[name] = self._np(g)
            return Outcome(
                outputs={name: self._np(v) for name, v in outs.items()},
                grads=report,
                bases_after={name: self._np(v) for name, v in {**arrays, **cot_arrays}.items()},
                log=log,
                check_independent=lambda: None,  # immutable arrays: one can never be written through the other
            )


KITS = {"torch": TorchKit, "jax": JaxKit}


def kit(frontend):
    """The kit for a test adapter (tests/frontends.py): "torch", or "jax" with any implementation."""
    if frontend.name == "torch":
        return TorchKit()
    return JaxKit(frontend.module)
