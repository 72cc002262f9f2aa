"""Smoke test of an installed normkit: forward + backward of each op, checked against the float64
reference (``normkit.ops.Op.run_reference``) within the tolerance table (``normkit.testing``), with
fresh random inputs; on CPU (Triton's interpreter for torch, the auto implementation for JAX).

Meant for a fresh venv made with pip alone, whatever numpy and triton pip picked; ``.ci/run`` runs it
that way: ``pip install torch==2.13.0 && pip install ".[torch]"`` (default: the Torch frontend), and
``pip install ".[jax]"`` with no torch (``--jax``: the README's JAX example, then every op through
``jax_frontend``). Run it from outside the repository root, or as ``python scripts/smoke_install.py``
(the script's folder, not the checkout, is then on sys.path), so that the installed package is
tested; ``--require-installed`` fails if normkit was imported from anywhere but site-packages.

Exits 0 when every result is within tolerance, 1 on any mismatch, error or warning (warnings are
errors here), except normkit's ``NormkitInterpreterWarning``: pip may pick a Triton newer than the
ones normkit's interpreter path is tested with (``normkit._interpreter.TESTED_TRITON``), which normkit
allows with that warning; it is printed as a note, and the results must still match the reference.
"""
from __future__ import annotations

import argparse
import sys
import traceback
import warnings

SHAPE = (3, 5, 40)  # leading dims folded into 15 rows; D not a power of two
DTYPES = ("float32", "bfloat16")


def _torch_case(op, inp: dict, dtype: str):
    """(outputs, gradients) through torch_frontend, every input trained."""
    import torch

    import torch_frontend as tf

    t = {name: torch.tensor(inp[name], dtype=getattr(torch, dtype), requires_grad=True) for name in op.inputs}
    outs = getattr(tf, op.name)(*(t[name] for name in op.inputs))
    outs = outs if op.has_residual else (outs,)
    cots = [torch.tensor(inp[c], dtype=getattr(torch, dtype)) for c in ("dy", "ds")[:len(outs)]]
    torch.autograd.backward(list(outs), cots)
    wide = lambda a: a.detach().double().numpy()  # noqa: E731
    return dict(zip(op.outputs, map(wide, outs))), {name: wide(t[name].grad) for name in op.inputs}


def _jax_case(op, inp: dict, dtype: str):
    """(outputs, gradients) through jax_frontend (its auto implementation), every input trained."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_frontend as jf

    arrays = [jnp.asarray(inp[name], jnp.float32).astype(dtype) for name in op.inputs]
    outs, vjp = jax.vjp(getattr(jf, op.name), *arrays)
    outs = outs if op.has_residual else (outs,)
    grads = vjp(tuple(jnp.asarray(inp[c], jnp.float32).astype(dtype) for c in ("dy", "ds")[:len(outs)])
                if op.has_residual else jnp.asarray(inp["dy"], jnp.float32).astype(dtype))
    wide = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    return dict(zip(op.outputs, map(wide, outs))), dict(zip(op.inputs, map(wide, grads)))


def _readme_jax_example() -> None:
    """The README's JAX example: freeze inside the loss; the norm runs its dW-free variant."""
    import jax
    import jax.numpy as jnp

    import jax_frontend as jf
    import normkit

    params = {"attn": jnp.eye(8) * 0.5 + 0.1, "norm": jnp.linspace(0.5, 1.5, 8)}
    batch = jnp.arange(32.0).reshape(4, 8) / 10

    def loss_fn(params, batch):
        params = jf.freeze(params, {"attn": True, "norm": False})
        h = jf.rms_norm(batch @ params["attn"], params["norm"], eps=1e-6)
        return (h ** 2).mean()

    with normkit.record_launches() as log:
        grads = jax.grad(loss_fn)(params, batch)
    (bwd,) = [launch for launch in log if launch.kernel.endswith(("norm_bwd_kernel", "norm_bwd"))]
    assert not bwd.flags["COMPUTE_DW"] and not float(jnp.abs(grads["norm"]).max()), bwd.flags
    print(f"  README JAX example ok: implementation {bwd.implementation}, frozen norm: COMPUTE_DW off")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jax", action="store_true", help="check jax_frontend instead of torch_frontend")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--require-installed", action="store_true")
    args = p.parse_args(argv)
    warnings.simplefilter("error")
    try:
        import numpy as np

        import normkit
        from normkit.ops import OPS
        from normkit.testing import assert_close, random_inputs
    except Exception:
        traceback.print_exc()
        return 1
    if args.require_installed and "site-packages" not in normkit.__file__:
        print(f"normkit was imported from {normkit.__file__}, not from an installed copy")
        return 1
    try:
        from normkit._interpreter import NormkitInterpreterWarning

        warnings.filterwarnings("default", category=NormkitInterpreterWarning)
    except ImportError:
        pass
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    frontend = "jax" if args.jax else "torch"
    print(f"normkit {normkit.__version__} from {normkit.__file__}; {frontend}; numpy {np.__version__}; seed {seed}")
    failures = 0
    if args.jax:
        try:
            _readme_jax_example()
        except Exception:
            traceback.print_exc()
            failures += 1
    run = _jax_case if args.jax else _torch_case
    for dtype in DTYPES:
        for op in OPS.values():
            inp = random_inputs(op, SHAPE, dtype, np.random.default_rng(seed))
            try:
                outs, grads = run(op, inp, dtype)
                ref_outs, ref_grads = op.run_reference(inp, op.options(eps=op.default_eps),
                                                       {"y": inp["dy"], "residual_out": inp.get("ds")})
                for name, r in ref_outs.items():
                    assert_close(outs[name], r, dtype, f"{op.name} {dtype} {name}")
                for name, r in ref_grads.items():
                    rows = 15 if name in op.params else 1
                    assert_close(grads[name], r, dtype, f"{op.name} {dtype} d{name}", reduced_over=rows)
                print(f"  {op.name:19s} {dtype:9s} ok")
            except Exception:
                failures += 1
                print(f"  {op.name:19s} {dtype:9s} FAILED")
                traceback.print_exc()
    print("smoke: all ok" if not failures else f"smoke: {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
