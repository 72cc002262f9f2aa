"""normkit's main job: frozen against full backward, for every op, on whatever this machine has.

On a CUDA GPU the kernels run compiled at a training-sized shape; on a CPU they run in Triton's
interpreter at a small one. For each op of the op table (``normkit.ops.OPS``) and each frontend it
prints which backward variant ran, what the forward kept for it, the bytes of fp32 partial buffers
it allocated, the gradients' agreement with the float64 reference (and x.grad of frozen vs full),
and median times.

*full* trains every input of the op; *frozen* only its row inputs (x, and the fused add's residual):
the weight and bias are frozen, as in LoRA fine-tuning. A frozen norm runs twice: keeping its input
x for the backward (``save="input"``), and as ``save="auto"`` (the default) chooses, which keeps the
output y instead where the weight allows recovering x from it, and so frees x (column ``kept``).
Each run is also checked: the backward launch must carry exactly the variant's gradient flags,
every gradient must be within the tolerance table (``normkit.testing``) of the reference, and the
frozen dx kept from x must be bitwise the full one's; the exit status is 1 if a check fails. Every column of the
table is explained, with its unit, in the legend printed under it.

    python scripts/compare.py [--shape MxN] [--dtype bfloat16] [--frontends torch,jax] [--reps N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import normkit  # noqa: E402
from benchmarks.timing import Timer, torch_sync  # noqa: E402
from normkit.ops import CASTING_MODES, OPS, Grads, Op, Options  # noqa: E402
from normkit.shapes import parse as parse_shape  # noqa: E402
from normkit.testing import assert_close, random_inputs  # noqa: E402

CUDA = torch.cuda.is_available()
CASTING_NAMES = {casting: name for name, casting in CASTING_MODES.items()}


def variants(op: Op) -> dict[str, tuple[frozenset, str]]:
    """Backward variant -> (the inputs it trains, what the forward keeps: the ``save`` argument)."""
    return {"full": (frozenset(op.inputs), "input"), "frozen": (frozenset(op.row_inputs), "input"),
            "frozen, auto": (frozenset(op.row_inputs), "auto")}


def call_kwargs(op: Op, opts: Options, save: str = "auto") -> dict:
    """The public functions' keyword options for ``opts`` and ``save``."""
    kw = {"eps": opts.eps, "save": save}
    if op.has_offset:
        kw.update(offset=opts.offset, casting_mode=CASTING_NAMES[opts.casting])
    return kw


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def timed(fn, reps):
    """Median wall time in µs of ``reps`` calls of ``fn()``, each synchronized, after one warm-up call."""
    fn()
    return statistics.median(Timer.each(fn, reps, torch_sync))


def torch_runner(op: Op, arrays: dict, dtype: str, opts: Options, trained: frozenset, save: str):
    """``(run, to_numpy)``: ``run()`` computes the gradients through torch autograd (what is timed);
    ``to_numpy(run())`` is ``{input name: gradient as float64 NumPy, or None}``."""
    import torch_frontend as tf

    dev = "cuda" if CUDA else "cpu"
    tdt = getattr(torch, dtype)
    t = {k: torch.from_numpy(v).to(dev, tdt) for k, v in arrays.items()}
    fn, kw = getattr(tf, op.name), call_kwargs(op, opts, save)
    cotangents = [t["dy"]] + ([t["ds"]] if op.has_residual else [])

    def run():
        leaves = {name: t[name].clone().requires_grad_(name in trained) for name in op.inputs}
        outs = fn(*(leaves[name] for name in op.inputs), **kw)
        torch.autograd.backward(list(outs) if op.has_residual else [outs], cotangents)
        return {name: leaf.grad for name, leaf in leaves.items()}

    def to_numpy(grads):
        return {name: None if g is None else g.detach().double().cpu().numpy() for name, g in grads.items()}

    return run, to_numpy


def jax_runner(op: Op, arrays: dict, dtype: str, opts: Options, trained: frozenset, save: str):
    """The same through ``jax.vjp`` under jit, the untrained inputs frozen with ``jax_frontend.freeze``."""
    import jax
    import jax.numpy as jnp

    import jax_frontend as jf

    jdt = getattr(jnp, dtype)
    a = {k: jnp.asarray(v.astype(np.float32)).astype(jdt) for k, v in arrays.items()}
    fn, kw = getattr(jf, op.name), call_kwargs(op, opts, save)
    mask = {name: name in trained for name in op.inputs}
    primals = {name: a[name] for name in op.inputs}
    cot = (a["dy"], a["ds"]) if op.has_residual else a["dy"]

    def outputs(params):
        p = jf.freeze(params, mask)
        return fn(*(p[name] for name in op.inputs), **kw)

    @jax.jit
    def step(params):
        _, vjp = jax.vjp(outputs, params)
        (g,) = vjp(cot)
        return g

    def run():
        return jax.block_until_ready(step(primals))

    def to_numpy(grads):
        g = {name: np.asarray(v.astype(jnp.float32), np.float64) for name, v in grads.items()}
        # a frozen input's cotangent is a symbolic zero, instantiated as zeros: None, as in Torch (a
        # non-zero one stays, and fails the check)
        return {name: None if name not in trained and not np.any(v) else v for name, v in g.items()}

    return run, to_numpy


RUNNERS = {"torch": torch_runner, "jax": jax_runner}


def check(op: Op, dtype: str, M: int, got: dict, want: dict, grads: Grads, log, what: str) -> list[str]:
    """What is wrong with one run (empty if nothing): the launch flags, then each gradient."""
    problems = []
    flags = [(b.flags["COMPUTE_DX"], b.flags["COMPUTE_DW"], b.flags["COMPUTE_DB"]) for b in log.of("norm_bwd_kernel")]
    if flags != [(grads.dx, grads.dw, grads.db)]:
        problems.append(f"{what}: backward launches with (COMPUTE_DX, DW, DB) = {flags}, expected "
                        f"{[(grads.dx, grads.dw, grads.db)]}")
    if bool(log.of("partial_sum_kernel")) != grads.reduces:
        problems.append(f"{what}: partial_sum_kernel {'missing' if grads.reduces else 'launched'}")
    for name in op.inputs:
        trained = grads.dx if name in op.row_inputs else getattr(grads, "dw" if name == "weight" else "db")
        if not trained:
            if got[name] is not None:
                problems.append(f"{what}: frozen {name} got a gradient")
            continue
        try:
            assert_close(got[name], want[name], dtype, f"{what}: d{name}",
                         reduced_over=M if name in op.params else 1)
        except AssertionError as e:
            problems.append(str(e).splitlines()[0])
    return problems


def legend(reps: int) -> dict[str, str]:
    """Each column of the table, with its unit, and what it means (printed under the table)."""
    timing = (f"median wall time of one forward + backward over {reps} call{'s' if reps > 1 else ''}, synchronized"
              + ("" if CUDA else "; on the CPU the kernels run in Triton's interpreter, so this says nothing "
                                 "about speed (run on a GPU, or see benchmarks/)"))
    return {
        "op": "the op (normkit.ops.OPS)",
        "frontend": "torch: torch_frontend through torch.autograd; jax: jax_frontend through jax.vjp under jit",
        "backward": "full: every input trained; frozen: the weight and bias frozen (x and the residual trained), "
                    "as in LoRA, with save='input'; 'frozen, auto': the same with save='auto' (the default)",
        "kept": "what the forward kept for the backward: x (the fused add: x + residual), or the output y, "
                "from which the backward recovers x_hat = (y - bias) / weight, so x is freed; 'auto' keeps y "
                "where the weight allows (torch_frontend.save_decision says why not)",
        "kernels": "the kernels one forward + backward launched, in order (normkit.record_launches)",
        "partials (B)": "bytes of the fp32 per-program dW/dB partial buffers the backward allocated",
        "dx err": "relative error ||dx - ref|| / ||ref|| against the float64 reference (normkit/reference.py)",
        "dW err": "the same for the weight's gradient; '-' where the weight is frozen (no gradient computed)",
        "dx frozen==full": "whether the frozen backward's dx is bitwise equal to the full one's: it must be "
                           "where x is kept (freezing changes only which gradients are computed); from y, x_hat "
                           "is recovered as (y - bias) / weight, rounded differently, so dx is not bitwise the "
                           "same but within the tolerance table (see dx err)",
        "fwd+bwd us": timing,
    }


def main(argv=None) -> int:
    from tabulate import tabulate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8192x4096" if CUDA else "64x512")
    p.add_argument("--dtype", default="bfloat16" if CUDA else "float32", choices=["float32", "bfloat16"])
    p.add_argument("--frontends", default="torch,jax")
    p.add_argument("--reps", type=int, default=50 if CUDA else 3)
    args = p.parse_args(argv)
    M, N = parse_shape(args.shape)
    rng = np.random.default_rng(0)
    where = "compiled on " + torch.cuda.get_device_name() if CUDA else "Triton interpreter on the CPU"
    print(f"normkit {normkit.__version__}: frozen vs full backward, {M}x{N} {args.dtype}, {where}\n", flush=True)
    columns = legend(args.reps)
    rows, problems = [], []
    for op in OPS.values():
        opts = op.options(eps=op.default_eps)  # the frontends' defaults
        arrays = random_inputs(op, (M, N), args.dtype, rng)  # rounded to the dtype: every side sees the same values
        inputs = {name: arrays[name] for name in op.inputs}
        _, want = op.run_reference(inputs, opts, {"y": arrays["dy"], "residual_out": arrays.get("ds")})
        for name in args.frontends.split(","):
            try:
                results = {}
                for variant, (trained, save) in variants(op).items():
                    run, to_numpy = RUNNERS[name](op, arrays, args.dtype, opts, trained, save)
                    with normkit.record_launches() as log:
                        grads = to_numpy(run())
                    t = timed(run, args.reps)
                    results[variant] = (grads, op.grads(trained), log, t)
            except Exception as e:  # report the frontend as unavailable, keep the table going
                rows.append([op.name, name, None, None, f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:60]}"])
                continue
            full_dx = results["full"][0]["x"]
            for variant, (grads, flags, log, t) in results.items():
                dw = grads.get("weight")
                same = np.array_equal(grads["x"], full_dx)
                kept = "y" if any(b.flags.get("FROM_Y") for b in log.of("norm_bwd_kernel")) else "x"
                if kept == "x" and variant != "full" and not same:
                    problems.append(f"{op.name} {name} {variant}: dx is not bitwise the full backward's")
                rows.append([op.name, name, variant, kept,
                             ",".join(k.replace("_kernel", "") for k in dict.fromkeys(log.kernels())),
                             sum(launch.partial_bytes for launch in log), rel_err(grads["x"], want["x"]),
                             None if dw is None else rel_err(dw, want["weight"]),
                             "-" if variant == "full" else "yes" if same else "no", t])
                problems += check(op, args.dtype, M, grads, want, flags, log, f"{op.name} {name} {variant}")
    print(tabulate(rows, headers=list(columns), floatfmt=("", "", "", "", "", "d", ".1e", ".1e", "", ".1f"),
                   missingval="-"))
    print("\nColumns:")
    for column, meaning in columns.items():
        print(f"  {column}: {meaning}")
    if problems:
        print(f"\n{len(problems)} check(s) failed:")
        for line in problems:
            print("  " + line)
        return 1
    print("\nChecks passed: launch flags as the variant asks; gradients within the tolerance table (normkit.testing).")
    print("Next: notebooks/01_frozen_vs_full.ipynb, and torch_frontend.patch_model(model) for a HF/PEFT model.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
