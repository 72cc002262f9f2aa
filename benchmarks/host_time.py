"""Host time per call, as a training loop pays it: normkit through autograd against its peers.

A CPU-timed loop of many calls, synchronized once at the end, at a shape whose GPU work is short
(default 4096x1024 bf16, about 8 MB per tensor): the time per call is then the host path's (Python,
autograd, dispatch, allocation, launch), since the GPU keeps up. Modes:

- ``fwd``: forward only, nothing requires grad;
- ``fwd_bwd_frozen``: forward + ``torch.autograd.grad`` with respect to x (weight frozen);
- ``fwd_bwd_full``: forward + gradients of x and the weight.

``python_floor`` is not a peer: an ``autograd.Function`` that allocates its output and gradient and
launches nothing, the host-time floor of any norm launched from Python.

Only public APIs are used, so the same script times another checkout of normkit (``PYTHONPATH``)
for a before/after comparison. ``--profile`` prints a torch.profiler table (CPU and CUDA
activities) and a cProfile table of normkit's fwd + frozen bwd; ``--breakdown`` times the forward's host
path layer by layer.

    python benchmarks/host_time.py [--shape 4096x1024] [--dtype bfloat16] [--iters 2000] [--profile]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

MODES = ("fwd", "fwd_bwd_frozen", "fwd_bwd_full")


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


def _impls(op: str, eps: float):
    """name -> f(x, w, b, r) -> output tensor (the first output)."""
    impls = {"python_floor": lambda x, w, b, r: _Floor.apply(x, w, b)}
    import torch_frontend as tf

    impls["normkit"] = {
        "rms_norm": lambda x, w, b, r: tf.rms_norm(x, w, eps),
        "layer_norm": lambda x, w, b, r: tf.layer_norm(x, w, b, eps),
        "fused_add_rms_norm": lambda x, w, b, r: tf.fused_add_rms_norm(x, r, w, eps)[0],
    }[op]
    impls["torch_eager"] = {
        "rms_norm": lambda x, w, b, r: F.rms_norm(x, (x.shape[-1],), w, eps),
        "layer_norm": lambda x, w, b, r: F.layer_norm(x, (x.shape[-1],), w, b, eps),
        "fused_add_rms_norm": lambda x, w, b, r: F.rms_norm(x + r, (x.shape[-1],), w, eps),
    }[op]
    try:
        if op == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            impls["liger"] = lambda x, w, b, r: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", True, None)
        elif op == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            impls["liger"] = lambda x, w, b, r: LigerLayerNormFunction.apply(x, w, b, eps)
        else:
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

            impls["liger"] = lambda x, w, b, r: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama",
                                                                                   False)[0]
    except ImportError:
        pass
    return impls


def host_us(fn, iters: int, sync) -> float:
    """Median over 5 batches of ``iters // 5`` calls, each batch synchronized once at its end."""
    fn()
    sync()
    per = max(1, iters // 5)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(per):
            fn()
        sync()
        times.append((time.perf_counter() - t) / per * 1e6)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4096x1024")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ops", default="rms_norm,layer_norm,fused_add_rms_norm")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--label", default="", help="a name for this checkout in the output (e.g. 'before')")
    p.add_argument("--json", default=None, help="append the records to this JSON-lines file")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="time the forward's host path layer by layer")
    p.add_argument("--backward", action="store_true", help="where a repeated RMSNorm backward's host time goes "
                   "(time inside normkit's layers, measured on the thread that runs the backward)")
    p.add_argument("--graphs", action="store_true", help="also fwd + frozen bwd under CUDA graphs: "
                   "torch.compile(mode='reduce-overhead') and torch.cuda.make_graphed_callables (CUDA only)")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dtype = getattr(torch, args.dtype)
    M, N = map(int, args.shape.split("x"))
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
    x, r, dy = rand(M, N), rand(M, N), rand(M, N)
    records = []
    print(f"host time per call (us), {M}x{N} {args.dtype} on {dev}; {args.label or 'this checkout'}")
    for op in args.ops.split(","):
        eps = 1e-5 if op == "layer_norm" else 1e-6
        for mode in MODES:
            row = []
            for name, f in _impls(op, eps).items():
                w = rand(N).requires_grad_(mode == "fwd_bwd_full")
                b = rand(N).requires_grad_(mode == "fwd_bwd_full") if op == "layer_norm" else None
                xg = x.clone().requires_grad_(mode != "fwd")
                wrt = [xg] + ([w] + ([b] if b is not None else []) if mode == "fwd_bwd_full" else [])

                def call(f=f, xg=xg, w=w, b=b, wrt=wrt):
                    y = f(xg, w, b, r)
                    if mode != "fwd":
                        torch.autograd.grad(y, wrt, dy)

                try:
                    us = host_us(call, args.iters, sync)
                except Exception as e:  # a peer that cannot run this case: say so, keep going
                    print(f"  {op} {mode} {name}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                records.append({"label": args.label, "op": op, "mode": mode, "impl": name, "shape": args.shape,
                                "dtype": args.dtype, "host_us": us})
                row.append(f"{name} {us:7.1f}")
            print(f"  {op:19s} {mode:15s} " + " | ".join(row), flush=True)
    if args.graphs and dev.type == "cuda":
        records += _graphs(args, x, r, dy, rand, sync)
    if args.json:
        with open(args.json, "a") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
    if args.breakdown:
        _breakdown(x, dy, N, dev, rand, args.iters, sync)
    if args.backward:
        _backward_breakdown(x, dy, N, rand, args.iters, sync)
    if args.profile:
        _profile(x, dy, N, dev, rand)
    return records


def _graphs(args, x, r, dy, rand, sync) -> list[dict]:
    """fwd + frozen bwd per call with the host path removed: the step captured as CUDA graphs, by
    ``torch.compile(mode="reduce-overhead")`` (Inductor launches normkit's kernels itself, through
    its triton ops) and by ``torch.cuda.make_graphed_callables`` (normkit's eager path, captured)."""
    records = []
    N = x.shape[-1]
    for op in args.ops.split(","):
        eps = 1e-5 if op == "layer_norm" else 1e-6
        row = []
        for name, f in _impls(op, eps).items():
            if name == "python_floor":
                continue
            w = rand(N)
            b = rand(N) if op == "layer_norm" else None
            for how in ("reduce-overhead", "graphed"):
                torch._dynamo.reset()
                xg = x.clone().requires_grad_(True)
                if how == "reduce-overhead":
                    g = torch.compile(lambda a, f=f, w=w, b=b: f(a, w, b, r), mode="reduce-overhead", fullgraph=True)
                else:
                    g = torch.cuda.make_graphed_callables(lambda a, f=f, w=w, b=b: f(a, w, b, r), (xg,))

                def call(g=g, xg=xg):
                    torch.autograd.grad(g(xg), xg, dy)

                try:
                    for _ in range(3):  # warm-up, capture, replay
                        call()
                    us = host_us(call, args.iters, sync)
                except Exception as e:  # a peer that cannot be captured: say so, keep going
                    print(f"  {op} {how} {name}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                records.append({"label": args.label, "op": op, "mode": f"fwd_bwd_frozen/{how}", "impl": name,
                                "shape": args.shape, "dtype": args.dtype, "host_us": us})
                row.append(f"{name}/{how} {us:7.1f}")
        print(f"  {op:19s} {'frozen, graphs':15s} " + " | ".join(row), flush=True)
    return records


def _breakdown(x, dy, N, dev, rand, iters: int, sync) -> None:
    """Where the forward's host time goes, layer by layer (each row includes the rows above it)."""
    import torch_frontend as tf
    from normkit import driver
    from normkit.ops import RMS_NORM

    w = rand(N)
    opts = RMS_NORM.options(eps=1e-6)
    backend = tf.backend
    call = None

    def plan_and_launch():
        driver.forward(backend, RMS_NORM, x, None, w, None, opts, False)

    plan_and_launch()
    from normkit.launch import plan_forward

    call = plan_forward(RMS_NORM, *x.shape, backend.dtype(x), backend.dtype(w), None, opts, False,
                        (x.shape[1], 1, 0, 1, 1, 1), backend.num_sms(x))
    arrays = {"X": x, "R": None, "W": w, "B": None}

    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g

    xg = x.clone().requires_grad_(True)
    tf.rms_norm(x, w)  # binds this signature's plans (torch_frontend's eager fast path), if it has one
    from torch_frontend import functional

    bound = next((b for b in functional._BOUND.values() if b.op is RMS_NORM), None)
    rows = [
        ("torch.empty of y", lambda: torch.empty_like(x)),
        ("an empty autograd.Function apply", lambda: Noop.apply(xg)),
        ("backend.launch of a planned call", lambda: backend.launch(call, arrays)),
        *([("the bound forward (a repeated call's launch)", lambda: bound.forward(x, None, w, None))] if bound else []),
        ("driver.forward (plan lookup + launch)", plan_and_launch),
        ("torch_frontend.rms_norm, no grad", lambda: tf.rms_norm(x, w)),
        ("torch_frontend.rms_norm, x requires grad", lambda: tf.rms_norm(xg, w)),
        ("F.rms_norm, no grad", lambda: F.rms_norm(x, (N,), w, 1e-6)),
    ]
    print("host-time breakdown (us per call):")
    for name, fn in rows:
        print(f"  {name:45s} {host_us(fn, iters, sync):8.1f}", flush=True)


def _backward_breakdown(x, dy, N, rand, iters: int, sync) -> None:
    """The backward of a repeated ``rms_norm`` call (a retained graph, weight frozen) against the
    ``python_floor`` backward, then the time spent inside each normkit layer per call. The backward
    runs on autograd's device thread (CUDA), where cProfile does not look: each layer is wrapped in a
    ``perf_counter`` pair instead, which adds a little to every row."""
    import threading
    import torch_frontend as tf
    from torch_frontend import _backend, functional

    w = rand(N)
    xg = x.clone().requires_grad_(True)
    y, y_floor = tf.rms_norm(xg, w), _Floor.apply(xg, w)
    rows = [("python_floor backward", lambda: torch.autograd.grad(y_floor, xg, dy, retain_graph=True)),
            ("normkit backward", lambda: torch.autograd.grad(y, xg, dy, retain_graph=True))]
    print("backward host time (us per call), RMSNorm, weight frozen:")
    for name, fn in rows:
        print(f"  {name:45s} {host_us(fn, iters, sync):8.1f}", flush=True)
    spent: dict = {}

    def timed(label, fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                key = (label, threading.current_thread().name)
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t
        return run

    layers = [(functional.NormFunction, "backward", "NormFunction.backward", staticmethod),
              (functional._Bound, "backward", "the bound backward plan", None),
              (_backend.TorchBackend, "launch", "TorchBackend.launch", staticmethod),
              (_backend, "_launch_compiled", "the launch (Triton's launcher)", None),
              (torch, "empty", "torch.empty", None)]
    saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _, _ in layers]
    try:
        for owner, attr, label, wrap in layers:
            fn = timed(label, getattr(owner, attr))
            setattr(owner, attr, wrap(fn) if wrap else fn)
        n = max(5, iters // 5 * 5)
        total = host_us(rows[1][1], n, sync)
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)
    print(f"  {'normkit backward, instrumented':45s} {total:8.1f}")
    for (label, thread), s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"    inside {label:38s} {s / (n + 1) * 1e6:8.1f}   (thread {thread})")


def _profile(x, dy, N, dev, rand):
    import torch_frontend as tf
    from torch.profiler import ProfilerActivity, profile

    w = rand(N)
    xg = x.clone().requires_grad_(True)

    def step():
        torch.autograd.grad(tf.rms_norm(xg, w), xg, dy)

    for _ in range(20):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(200):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    import cProfile
    import pstats

    with cProfile.Profile() as pr:
        for _ in range(500):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: a before/after run can pick the checkout
    main()
