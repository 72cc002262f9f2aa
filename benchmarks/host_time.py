"""Host time per call, as a training loop pays it: normkit through autograd against its peers.

Back-to-back calls timed on the host (``benchmarks.timing.Timer.loop``: blocks of calls, one sync per
block), at a shape whose GPU work is short (default 4096x1024 bf16, about 8 MB per tensor): the time
per call is then the host path's (Python, autograd, dispatch, allocation, launch), since the GPU
keeps up. The peers are ``benchmarks/impls_torch.py``'s (normkit, Liger, torch eager). Modes:

- ``fwd``: forward only, nothing requires grad;
- ``fwd_bwd_frozen``: forward + ``torch.autograd.grad`` with respect to x (weight frozen);
- ``fwd_bwd_full``: forward + gradients of x and the weight.

``python_floor`` is not a peer: an ``autograd.Function`` that allocates its output and gradient and
launches nothing, the host-time floor of any norm launched from Python. ``--graphs`` adds fwd + frozen
bwd with the host path removed, under CUDA graphs.

Only public APIs are used, so the same script times another checkout of normkit (``PYTHONPATH``)
for a before/after comparison (``--label``, ``--json``).

    python benchmarks/host_time.py [--shape 4096x1024] [--dtype bfloat16] [--ops rms_norm] [--graphs]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: a before/after run picks the checkout

import torch  # noqa: E402

from benchmarks import impls_torch as it  # noqa: E402
from benchmarks.timing import Timer, torch_sync  # noqa: E402
from normkit.ops import OPS  # noqa: E402
from normkit.shapes import parse  # noqa: E402

MODES = ("fwd", "fwd_bwd_frozen", "fwd_bwd_full")
PEERS = {"normkit": it.normkit_fn, "torch_eager": it.eager_fn, "liger": it.liger_fn}


class _Floor(torch.autograd.Function):
    """The least a Python ``autograd.Function`` can cost: allocate the output in forward and the
    input's gradient in backward, launch nothing. Not a peer: the host-time floor of any norm
    launched from Python (normkit, Liger), against which eager ATen's C++ autograd is measured."""

    @staticmethod
    def forward(ctx, x, *params):
        ctx.shapes = [p.shape if p is not None else None for p in params]
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        grads = [dy.new_empty(shape) if need else None for shape, need in zip(ctx.shapes, ctx.needs_input_grad[1:])]
        return torch.empty_like(dy), *grads


def _impls(op: str) -> dict:
    """name -> f(*primals in OPS[op].inputs order) -> the first output."""
    impls = {"python_floor": lambda x, *params: _Floor.apply(x, *params)}
    for name, make in PEERS.items():
        try:
            f = make(op)
        except ImportError:  # Liger not installed
            continue
        impls[name] = lambda *primals, f=f: f(*primals)[0]
    return impls


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4096x1024")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--rep-ms", type=float, default=200.0, help="milliseconds timed per row, over 5 blocks")
    p.add_argument("--label", default="", help="a name for this checkout in the output (e.g. 'before')")
    p.add_argument("--json", default=None, help="append the records to this JSON-lines file")
    p.add_argument("--graphs", action="store_true", help="also fwd + frozen bwd under CUDA graphs: "
                   "torch.compile(mode='reduce-overhead') and torch.cuda.make_graphed_callables (CUDA only)")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = Timer(warmup_ms=args.rep_ms / 10, rep_ms=args.rep_ms)
    dtype = getattr(torch, args.dtype)
    M, N = parse(args.shape)
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
    x, r, dy = rand(M, N), rand(M, N), rand(M, N)
    records = []
    print(f"host time per call (us), {M}x{N} {args.dtype} on {dev}; {args.label or 'this checkout'}")
    for op in args.ops.split(","):
        spec = OPS[op]
        for mode in MODES:
            row = []
            for name, f in _impls(op).items():
                trained = mode == "fwd_bwd_full"
                values = {"x": x.clone().requires_grad_(mode != "fwd"), "residual": r,
                          **{n: rand(N).requires_grad_(trained) for n in spec.params}}
                primals = [values[n] for n in spec.inputs]
                wrt = [values["x"]] + ([values[n] for n in spec.params] if trained else [])

                def call(_i, f=f, primals=primals, wrt=wrt):
                    y = f(*primals)
                    return y if mode == "fwd" else torch.autograd.grad(y, wrt, dy)

                try:
                    us = timer.loop(call, torch_sync)
                except Exception as e:  # a peer that cannot run this case: say so, keep going
                    print(f"  {op} {mode} {name}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                records.append({"label": args.label, "op": op, "mode": mode, "impl": name, "shape": args.shape,
                                "dtype": args.dtype, "host_us": us})
                row.append(f"{name} {us:7.1f}")
            print(f"  {op:19s} {mode:15s} " + " | ".join(row), flush=True)
    if args.graphs and dev.type == "cuda":
        records += _graphs(args, timer, x, r, dy, rand)
    if args.json:
        with open(args.json, "a") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
    return records


def _graphs(args, timer: Timer, x, r, dy, rand) -> list[dict]:
    """fwd + frozen bwd per call with the host path removed: the step captured as CUDA graphs, by
    ``torch.compile(mode="reduce-overhead")`` (Inductor launches normkit's kernels itself, through
    its triton ops) and by ``torch.cuda.make_graphed_callables`` (normkit's eager path, captured)."""
    records = []
    N = x.shape[-1]
    for op in args.ops.split(","):
        spec = OPS[op]
        row = []
        for name, f in _impls(op).items():
            if name == "python_floor":
                continue
            fixed = {"residual": r, **{n: rand(N) for n in spec.params}}

            def fn(a, f=f, fixed=fixed):
                return f(*(a if n == "x" else fixed[n] for n in spec.inputs))

            for how in ("reduce-overhead", "graphed"):
                torch._dynamo.reset()
                xg = x.clone().requires_grad_(True)
                if how == "reduce-overhead":
                    g = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
                else:
                    g = torch.cuda.make_graphed_callables(fn, (xg,))

                def call(_i, g=g, xg=xg):
                    return torch.autograd.grad(g(xg), xg, dy)

                try:
                    for i in range(3):  # warm-up, capture, replay
                        call(i)
                    us = timer.loop(call, torch_sync)
                except Exception as e:  # a peer that cannot be captured: say so, keep going
                    print(f"  {op} {how} {name}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                records.append({"label": args.label, "op": op, "mode": f"fwd_bwd_frozen/{how}", "impl": name,
                                "shape": args.shape, "dtype": args.dtype, "host_us": us})
                row.append(f"{name}/{how} {us:7.1f}")
        print(f"  {op:19s} {'frozen, graphs':15s} " + " | ".join(row), flush=True)
    return records


if __name__ == "__main__":
    main()
