"""Smoke test of an installed normkit: forward + backward of each op through ``torch_frontend`` on CPU
(Triton's interpreter), checked against ``normkit.reference`` (float64) with fresh random inputs.

Meant for a fresh venv made with pip alone (``pip install torch==2.13.0 && pip install ".[torch]"``),
whatever numpy and triton pip picked; ``.ci/run`` runs it that way. It needs nothing from the
checkout: run it from outside the repository root, or as ``python scripts/smoke_install.py`` (the
script's folder, not the checkout, is then on sys.path), so that the installed package is tested.
``--require-installed`` fails if normkit was imported from anywhere but site-packages.

Exits 0 when every result is within tolerance, 1 on any mismatch, error or warning (warnings are
errors here, numpy's array-to-scalar DeprecationWarning for one), except normkit's
``NormkitInterpreterWarning``: pip may pick a Triton newer than the one normkit's interpreter
patches were written for, which normkit allows with that warning; it is printed as a note, and the
results must still match the reference.
"""
from __future__ import annotations

import argparse
import math
import sys
import traceback
import warnings

# |actual - ref| <= atol * sqrt(rows summed over) + rtol * |ref|: the table in tests/tolerances.py
TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (2e-2, 2e-2)}


def _check(name, actual, ref, dtype, reduced_over=1):
    import numpy as np

    actual = actual.detach().double().numpy()
    ref = np.asarray(ref, dtype=np.float64)
    rtol, atol = TOLERANCES[dtype]
    if actual.shape != ref.shape:
        return f"{name}: shape {actual.shape} != reference {ref.shape}"
    err = np.abs(actual - ref)
    bad = ~(err <= atol * math.sqrt(reduced_over) + rtol * np.abs(ref))  # NaN counts as bad
    if bad.any():
        return f"{name}: {int(bad.sum())}/{bad.size} elements off, max |err| {np.nanmax(err):.3g}"
    return None


def _cases(seed: int, dtype_name: str):
    """Yield (name, failure or None) for a forward + backward of each op."""
    import torch

    import torch_frontend as tf
    from normkit import reference as ref

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    shape, n = (3, 5, 40), 40  # leading dims folded into 15 rows; D not a power of two
    rows = 15

    def rand(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale + 0.1).to(dtype).requires_grad_(True)

    def np64(t):
        return t.detach().double().numpy()

    x, res, dy, ds = rand(*shape), rand(*shape), rand(*shape), rand(*shape)
    w, b = rand(n), rand(n)

    y = tf.rms_norm(x, w, eps=1e-6, offset=0.5, casting_mode="gemma")
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    rdx, rdw = ref.rms_norm_bwd(np64(x), np64(w), np64(dy), eps=1e-6, offset=0.5)
    yield "rms_norm y", _check("y", y, ref.rms_norm(np64(x), np64(w), eps=1e-6, offset=0.5), dtype_name)
    yield "rms_norm dx", _check("dx", dx, rdx, dtype_name)
    yield "rms_norm dw", _check("dw", dw, rdw, dtype_name, rows)

    y = tf.layer_norm(x, w, b, eps=1e-5)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    rdx, rdw, rdb = ref.layer_norm_bwd(np64(x), np64(w), np64(b), np64(dy), eps=1e-5)
    yield "layer_norm y", _check("y", y, ref.layer_norm(np64(x), np64(w), np64(b), eps=1e-5), dtype_name)
    yield "layer_norm dx", _check("dx", dx, rdx, dtype_name)
    yield "layer_norm dw", _check("dw", dw, rdw, dtype_name, rows)
    yield "layer_norm db", _check("db", db, rdb, dtype_name, rows)

    # bf16 rounds s = x + residual before normalizing; the reference sees that rounded s
    y, s = tf.fused_add_rms_norm(x, res, w, eps=1e-6)
    dx, dres, dw = torch.autograd.grad((y, s), (x, res, w), (dy, ds))
    s_in = np64(s)
    ry, _ = ref.fused_add_rms_norm(s_in, 0.0 * s_in, np64(w), eps=1e-6)
    rdx, rdres, rdw = ref.fused_add_rms_norm_bwd(s_in, 0.0 * s_in, np64(w), np64(dy), np64(ds), eps=1e-6)
    yield "fused_add_rms_norm y", _check("y", y, ry, dtype_name)
    yield "fused_add_rms_norm s", _check("s", s, ref.fused_add_rms_norm(np64(x), np64(res), np64(w))[1], dtype_name)
    yield "fused_add_rms_norm dx", _check("dx", dx, rdx, dtype_name)
    yield "fused_add_rms_norm dresidual", _check("dresidual", dres, rdres, dtype_name)
    yield "fused_add_rms_norm dw", _check("dw", dw, rdw, dtype_name, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: a fresh one, printed)")
    parser.add_argument("--require-installed", action="store_true",
                        help="fail unless normkit is imported from site-packages (not a checkout)")
    args = parser.parse_args(argv)
    warnings.simplefilter("error")  # a warning on this path is a broken install: fail loudly
    try:
        import numpy as np
        import torch
        import triton

        import normkit
        from normkit._interpreter import NormkitInterpreterWarning
    except Exception:
        traceback.print_exc()
        return 1
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    print(f"normkit smoke: normkit from {normkit.__file__}; torch {torch.__version__}, triton {triton.__version__}, "
          f"numpy {np.__version__}, python {sys.version.split()[0]}; seed {seed}")
    if args.require_installed and "site-packages" not in normkit.__file__:
        print("FAIL: normkit was not imported from site-packages")
        return 1
    failures = 0
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("error")
        warnings.simplefilter("always", NormkitInterpreterWarning)  # recorded, printed below
        for dtype_name in TOLERANCES:
            try:
                for name, failure in _cases(seed, dtype_name):
                    failures += failure is not None
                    print(f"  {'FAIL' if failure else 'ok  '} {dtype_name:8s} {name}" + (f": {failure}" if failure else ""))
            except Exception:
                failures += 1
                print(f"  FAIL {dtype_name:8s} raised:")
                traceback.print_exc(file=sys.stdout)
    for note in {str(n.message) for n in notes}:
        print(f"  note: {note}")
    print("normkit smoke: " + ("all ok" if not failures else f"{failures} failure(s)"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
