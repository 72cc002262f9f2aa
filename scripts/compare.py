"""normkit's main job: frozen against full backward, for every op, on whatever this machine has.

On a CUDA GPU the kernels run compiled at a training-sized shape; on a CPU they run in Triton's
interpreter at a small one. For each op and frontend it prints which backward variant ran, the
fp32 partial buffers it allocated, the gradients' agreement with the float64 reference (and x.grad
of frozen vs full), and median times.

    python scripts/compare.py [--shape MxN] [--dtype bfloat16] [--frontends torch,jax]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import normkit  # noqa: E402
from normkit import reference as ref  # noqa: E402

CUDA = torch.cuda.is_available()
OPS = ("rms_norm", "layer_norm", "fused_add_rms_norm")


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def reference(op, x, r, w, b, dy, ds):
    if op == "rms_norm":
        dx, dw = ref.rms_norm_bwd(x, w, dy)
        return dx, dw, None
    if op == "layer_norm":
        return ref.layer_norm_bwd(x, w, b, dy)
    dx, _, dw = ref.fused_add_rms_norm_bwd(x, r, w, dy, ds)
    return dx, dw, None


def timed(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        if CUDA:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if CUDA:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def torch_runner(op, arrays, dtype, frozen):
    import torch_frontend as tf

    dev = "cuda" if CUDA else "cpu"
    t = {k: torch.from_numpy(v.astype(np.float32)).to(dev, dtype) for k, v in arrays.items() if v is not None}

    def run():
        x = t["x"].clone().requires_grad_(True)
        w = t["w"].clone().requires_grad_(not frozen)
        b = t["b"].clone().requires_grad_(not frozen) if "b" in t else None
        if op == "rms_norm":
            outs, grads = [tf.rms_norm(x, w)], [t["dy"]]
        elif op == "layer_norm":
            outs, grads = [tf.layer_norm(x, w, b)], [t["dy"]]
        else:
            outs, grads = list(tf.fused_add_rms_norm(x, t["r"], w)), [t["dy"], t["ds"]]
        torch.autograd.backward(outs, grads)
        return x.grad, w.grad, None if b is None else b.grad

    def np_(g):
        return None if g is None else g.detach().double().cpu().numpy()

    return run, np_


def jax_runner(op, arrays, dtype, frozen):
    import jax
    import jax.numpy as jnp

    import jax_frontend as jf

    jdt = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[dtype]
    a = {k: jnp.asarray(v.astype(np.float32)).astype(jdt) for k, v in arrays.items() if v is not None}
    trainable = {"x": True, "w": not frozen, "b": not frozen}

    def loss_vjp(params):
        p = jf.freeze(params, {k: trainable[k] for k in params})
        if op == "rms_norm":
            return (jf.rms_norm(p["x"], p["w"]),)
        if op == "layer_norm":
            return (jf.layer_norm(p["x"], p["w"], p.get("b")),)
        return jf.fused_add_rms_norm(p["x"], a["r"], p["w"])

    params = {k: a[k] for k in ("x", "w", "b") if k in a}
    cot = (a["dy"],) if op != "fused_add_rms_norm" else (a["dy"], a["ds"])

    @jax.jit
    def step(params):
        _, vjp = jax.vjp(loss_vjp, params)
        (g,) = vjp(cot)
        return g["x"], g["w"], g.get("b")

    def run():
        out = step(params)
        jax.block_until_ready(out)
        return out

    def np_(g):
        if g is None:
            return None
        g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
        return None if frozen and not np.any(g) and g.ndim == 1 else g

    return run, np_


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8192x4096" if CUDA else "64x512")
    p.add_argument("--dtype", default="bfloat16" if CUDA else "float32", choices=["float32", "bfloat16"])
    p.add_argument("--frontends", default="torch,jax")
    p.add_argument("--reps", type=int, default=50 if CUDA else 3)
    args = p.parse_args()
    M, N = map(int, args.shape.split("x"))
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(0)
    where = "compiled on " + torch.cuda.get_device_name() if CUDA else "Triton interpreter on the CPU"
    print(f"normkit {normkit.__version__}: frozen vs full backward, {M}x{N} {args.dtype}, {where}\n")
    header = (f"{'op':19s} {'frontend':8s} {'backward':8s} {'kernels':34s} {'partials':>9s} {'dx err':>8s} "
              f"{'dW err':>8s} {'dx frozen==full':>15s} {'fwd+bwd us':>11s}")
    print(header)
    print("-" * len(header))
    runners = {"torch": torch_runner, "jax": jax_runner}
    for op in OPS:
        rounded = lambda a: torch.from_numpy(a.astype(np.float32)).to(dtype).double().numpy()  # noqa: E731
        arrays = {
            "x": rounded(rng.standard_normal((M, N))),
            "r": rounded(rng.standard_normal((M, N))) if op == "fused_add_rms_norm" else None,
            "w": rounded(rng.uniform(0.5, 1.5, N)),
            "b": rounded(rng.standard_normal(N) * 0.1) if op == "layer_norm" else None,
            "dy": rounded(rng.standard_normal((M, N))),
            "ds": rounded(rng.standard_normal((M, N))) if op == "fused_add_rms_norm" else None,
        }
        want_dx, want_dw, _ = reference(op, arrays["x"], arrays["r"], arrays["w"], arrays["b"], arrays["dy"],
                                        arrays["ds"])
        for name in args.frontends.split(","):
            try:
                results = {}
                for frozen in (False, True):
                    run, np_ = runners[name](op, arrays, dtype, frozen)
                    with normkit.record_launches() as log:
                        grads = run()
                    t = timed(run, args.reps)
                    results[frozen] = (grads, np_, log, t)
            except Exception as e:  # report the frontend as unavailable, keep the table going
                print(f"{op:19s} {name:8s} unavailable: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            dx_same = np.array_equal(results[True][1](results[True][0][0]), results[False][1](results[False][0][0]))
            for frozen in (False, True):
                grads, np_, log, t = results[frozen]
                kernels = ",".join(k.replace("_kernel", "") for k in dict.fromkeys(log.kernels()))
                partial = sum(launch.partial_bytes for launch in log)
                dw = np_(grads[1])
                dw_err = "-" if dw is None else f"{rel_err(dw, want_dw):.1e}"
                print(f"{op:19s} {name:8s} {'frozen' if frozen else 'full':8s} {kernels:34s} {partial:9d} "
                      f"{rel_err(np_(grads[0]), want_dx):8.1e} {dw_err:>8s} {str(dx_same):>15s} {t:11.1f}")
    print("\nerr: ||got - ref|| / ||ref|| against the float64 reference (normkit/reference.py).")
    print("Next: notebooks/01_frozen_vs_full.ipynb, and torch_frontend.patch_model(model) for a HF/PEFT model.")


if __name__ == "__main__":
    main()
