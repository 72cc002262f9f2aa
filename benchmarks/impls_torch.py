"""Torch-side implementations, their inputs, and how each mode is timed (benchmarks/README.md, "How
each peer is run"). Every implementation is a function ``f(*primals) -> tuple of outputs`` over the op's
inputs in ``normkit.ops.OPS[op].inputs`` order, with the op's ``default_eps``; ``bwd_frozen`` freezes the
weight and bias, x (and the residual) stay trainable.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from benchmarks.bytemodel import DTYPES
from benchmarks.timing import torch_sync
from normkit.ops import OPS

EPS = {name: op.default_eps for name, op in OPS.items()}


class TorchInputs:
    """Rotated activation sets (x, residual, dy, ds) and one set of parameters for one case."""

    def __init__(self, op: str, M: int, N: int, dtype: str, device, n_sets: int, seed: int = 0):
        dt = getattr(torch, DTYPES[dtype])
        g = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale + shift).to(dt)

        self.op, self.M, self.N, self.n_sets = op, M, N, n_sets
        self.x = [randn(M, N) for _ in range(n_sets)]
        self.residual = [randn(M, N) for _ in range(n_sets)] if op == "fused_add_rms_norm" else None
        self.dy = [randn(M, N) for _ in range(n_sets)]
        # A distinct tensor for d(residual_out): inductor may read one tensor passed twice only once.
        self.ds = [randn(M, N) for _ in range(n_sets)] if op == "fused_add_rms_norm" else None
        self.weight = randn(N, scale=0.1, shift=1.0)
        self.bias = randn(N, scale=0.1) if op == "layer_norm" else None

    def primals(self, i: int) -> list:
        i %= self.n_sets
        by_name = {"x": self.x[i], "weight": self.weight, "bias": self.bias,
                   "residual": self.residual[i] if self.residual is not None else None}
        return [by_name[name] for name in OPS[self.op].inputs]

    def cotangents(self, i: int) -> list:
        i %= self.n_sets
        return [self.dy[i]] + ([self.ds[i]] if self.ds is not None else [])

    def set_trainable(self, names: frozenset) -> None:
        for name, tensors in (("x", self.x), ("residual", self.residual), ("weight", [self.weight]),
                              ("bias", [self.bias])):
            for t in tensors or []:
                if t is not None:
                    t.requires_grad_(name in names)

    def free(self) -> None:
        self.x = self.residual = self.dy = self.ds = self.weight = self.bias = None


def trainable(op: str, mode: str) -> frozenset:
    """The inputs ``mode`` differentiates: all of them, or the row inputs only (``bwd_frozen``)."""
    spec = OPS[op]
    return frozenset(spec.row_inputs if mode == "bwd_frozen" else spec.inputs)


# ---------------------------------------------------------------------------------------------
# The implementations.


def normkit_fn(op: str):
    import torch_frontend as tf

    f, eps = getattr(tf, op), EPS[op]
    return (lambda *p: tuple(f(*p, eps))) if op == "fused_add_rms_norm" else (lambda *p: (f(*p, eps),))


def liger_fn(op: str):
    eps = EPS[op]
    if op == "rms_norm":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda x, w: (LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", True, None),)
    if op == "layer_norm":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: (LigerLayerNormFunction.apply(x, w, b, eps),)
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    return lambda x, r, w: tuple(LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False))


def eager_fn(op: str):
    eps = EPS[op]
    if op == "rms_norm":
        return lambda x, w: (F.rms_norm(x, (x.shape[-1],), w, eps),)
    if op == "layer_norm":
        return lambda x, w, b: (F.layer_norm(x, (x.shape[-1],), w, b, eps),)
    return lambda x, r, w: (lambda s: (F.rms_norm(s, (s.shape[-1],), w, eps), s))(x + r)  # one add


def _rms_expr(x, w, eps):
    # The Hugging Face Llama RMSNorm expression.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def compile_source(op: str):
    """The plain PyTorch expression torch.compile is given."""
    eps = EPS[op]
    if op == "rms_norm":
        def rms_norm_expr(x, w):
            return (_rms_expr(x, w, eps),)
        return rms_norm_expr
    if op == "layer_norm":
        def layer_norm_expr(x, w, b):
            return (F.layer_norm(x, (x.shape[-1],), w, b, eps),)
        return layer_norm_expr

    def fused_add_rms_norm_expr(x, r, w):
        s = x + r
        return _rms_expr(s, w, eps), s
    return fused_add_rms_norm_expr


def configure_dynamo() -> None:
    """Recompile limits high enough for one op's three graphs per shape, and a hard failure (never a
    silent fall back to eager) when a limit is hit anyway; backward graphs reusable for timing."""
    import torch._dynamo.config as dc
    import torch._functorch.config as fc

    fc.donated_buffer = False  # a donated saved buffer forbids calling backward twice
    for name, value in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 65536),
                        ("accumulated_cache_size_limit", 65536), ("fail_on_recompile_limit_hit", True),
                        ("fail_on_cache_limit_hit", True), ("suppress_errors", False)):
        if hasattr(dc, name):
            setattr(dc, name, value)


class Compiled:
    """torch.compile of one op for one shape, and the evidence that it ran compiled.

    ``fullgraph=True`` turns a graph break into an error; ``fail_on_recompile_limit_hit`` turns the
    recompile limit into an error; timed calls run under ``error_on_recompile`` so a guard failure
    during timing is an error too. ``check()`` also requires a captured graph and, for backward
    modes, a compiled AOT-autograd graph.
    """

    def __init__(self, op: str, backend: str):
        import torch._dynamo
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        self.counters = counters
        self.backend = backend
        self.fn = torch.compile(compile_source(op), backend=backend, dynamic=False, fullgraph=True)
        self.compile_s = 0.0

    def __call__(self, *args):
        return self.fn(*args)

    def evidence(self) -> dict:
        c = self.counters
        return {"backend": self.backend, "unique_graphs": int(c["stats"]["unique_graphs"]),
                "graph_breaks": int(sum(c["graph_break"].values())),
                "aot_autograd_ok": int(c["aot_autograd"]["ok"]), "compile_s": round(self.compile_s, 3)}

    def check(self, needs_backward: bool) -> dict:
        ev = self.evidence()
        if ev["unique_graphs"] < 1:
            raise RuntimeError(f"torch.compile captured no graph: {ev}")
        if ev["graph_breaks"]:
            raise RuntimeError(f"torch.compile graph breaks: {ev}")
        if needs_backward and ev["aot_autograd_ok"] < 1:
            raise RuntimeError(f"torch.compile compiled no backward graph: {ev}")
        return ev

    def timing(self):
        import torch._dynamo.config as dc

        return dc.patch(error_on_recompile=True)


# ---------------------------------------------------------------------------------------------
# Timing one mode.


def peak_memory(fn, device) -> int | None:
    """Peak bytes allocated by ``fn()`` above what was allocated before it (its outputs included)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def time_e2e(f, inp: TorchInputs, mode: str, timer, device, compiled: Compiled | None = None) -> dict:
    """Time ``f`` through autograd in ``mode`` (``fwd`` under no_grad; ``bwd_*`` the backward alone, on
    graphs built beforehand); returns median_us, peak_mem_bytes and, compiled, the compile evidence."""
    names = frozenset() if mode == "fwd" else trainable(inp.op, mode)
    inp.set_trainable(names)
    k, graphs, extra = inp.n_sets, None, {}

    def grads(out, i, **kw):
        wrt = [t for name, t in zip(OPS[inp.op].inputs, inp.primals(i)) if name in names]
        return torch.autograd.grad(out, wrt, inp.cotangents(i), **kw)

    try:
        with torch.no_grad() if mode == "fwd" else contextlib.nullcontext():
            t0 = time.perf_counter()
            if mode == "fwd":
                def call(i):
                    return f(*inp.primals(i))
            elif mode == "fwd_bwd":
                def call(i):
                    return grads(f(*inp.primals(i)), i)
            else:
                graphs = [f(*inp.primals(i)) for i in range(k)]

                def call(i):
                    return grads(graphs[i % k], i, retain_graph=True)
            torch_sync(call(0))
            if compiled is not None:
                compiled.compile_s += time.perf_counter() - t0
                extra["compile"] = compiled.check(needs_backward=mode != "fwd")
            with compiled.timing() if compiled is not None else contextlib.nullcontext():
                us = timer.loop(call, torch_sync)
                peak = peak_memory(lambda: call(0), device)
        return {"median_us": us, "peak_mem_bytes": peak, **extra}
    finally:
        graphs = None  # noqa: F841 (drop the retained graphs before the inputs)
        inp.set_trainable(frozenset())


def time_kernel(inp: TorchInputs, mode: str, timer, device) -> dict:
    """normkit's bare launches (``normkit.driver`` with the Torch backend), exactly as the frontend issues
    them; ``partial_bytes``: the fp32 dW/dB partial buffers (outside the byte model)."""
    import normkit
    from normkit import driver
    from normkit.ops import Grads
    from torch_frontend import backend

    op, k, w, b = OPS[inp.op], inp.n_sets, inp.weight, inp.bias
    opts = op.options(eps=EPS[inp.op])  # the frontend's defaults (llama casting for the RMS ops)
    inp.set_trainable(frozenset())

    def fwd(i, stats):
        r = inp.residual[i % k] if inp.residual is not None else None
        return driver.forward(backend, op, inp.x[i % k], r, w, b, opts, stats)

    def bwd(i, saved, full):
        _, s, mean, rstd, _, _ = saved
        dres = inp.ds[i % k] if inp.ds is not None else None
        return driver.backward(backend, op, s if op.has_residual else inp.x[i % k], w, inp.dy[i % k], dres, mean,
                               rstd, opts, Grads(dx=True, dw=full and w is not None, db=full and b is not None),
                               backend.dtype(b) if b is not None else None)

    saved = [fwd(i, True) for i in range(k)] if mode in ("bwd_full", "bwd_frozen") else None
    body = {"fwd": lambda i: fwd(i, False), "fwd_bwd": lambda i: bwd(i, fwd(i, True), True)}.get(
        mode, lambda i: bwd(i, saved[i % k], mode == "bwd_full"))
    with normkit.record_launches() as log:  # also the first call: compiles
        body(0)
    torch_sync()
    counter = iter(range(1, 1 << 62))
    us = timer.kernel(lambda: body(next(counter)))  # each call on the next input set
    return {"median_us": us, "peak_mem_bytes": peak_memory(lambda: body(0), device),
            "launches": [launch.kernel for launch in log],
            "partial_bytes": int(sum(launch.partial_bytes for launch in log))}
